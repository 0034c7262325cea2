//! The end-to-end checksum of a transfer: a CRC-32C of every byte moved, computed only when
//! the caller asked for the range to be verified against the server's. It is a pass of the
//! CPU over every byte, so it is not taken for nothing: the lab's emulated CPU sums about
//! 140 MiB/s, and between the lab's two one-CPU guests a 64 MiB fetch ran at 0.96 of its
//! unsummed speed with it.

/// A running CRC-32C, or nothing when the transfer is not verified.
#[derive(Debug, Clone, Copy)]
pub(super) struct Checksum(Option<u32>);

impl Checksum {
    /// A checksum that sums bytes only if `on`.
    pub(super) fn new(on: bool) -> Checksum {
        Checksum(on.then_some(0))
    }

    /// Add the next bytes of the range.
    pub(super) fn add(&mut self, bytes: &[u8]) {
        if let Some(c) = &mut self.0 {
            *c = crc32c::crc32c_append(*c, bytes);
        }
    }

    /// The CRC of the bytes added, if summed.
    pub(super) fn value(self) -> Option<u32> {
        self.0
    }
}

/// The most bytes one checksum request asks the server to sum. A longer range is asked for in
/// spans of this many bytes and their CRCs combined, so that no request waits on the server for
/// long (the client's `timeout` covers each): the server reads the range through its memory's
/// provider, a few GB/s from host RAM and less from a file, a device's BAR or the lab's
/// emulated CPU (about 140 MiB/s: 7 s a span).
const CHECKSUM_SPAN: u64 = 1 << 30;

/// The spans, offset and length, that a checksum of `len` bytes at `offset` asks for: at most
/// `span` bytes each, in order; one empty span for an empty range (the server still checks it).
fn spans(offset: u64, len: u64, span: u64) -> impl Iterator<Item = (u64, u64)> {
    let span = span.max(1);
    let n = len.div_ceil(span).max(1);
    (0..n).map(move |i| {
        let at = i * span;
        (offset + at, span.min(len - at))
    })
}

/// The CRC-32C of a range out of its spans' (in order, each with its length).
fn combined(parts: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    parts
        .into_iter()
        .fold(0, |crc, (c, n)| crc32c::crc32c_combine(crc, c, n as usize))
}

impl super::Client {
    /// The server's CRC-32C of a range, asked for in spans of at most 1 GiB whose CRCs are
    /// combined (each request waits at most the client's `timeout` for its span's sum).
    pub async fn checksum(
        &mut self,
        r: &super::OpenRegion,
        offset: u64,
        len: u64,
    ) -> crate::error::Result<u32> {
        self.check_open(r)?;
        let mut parts = Vec::new();
        for (at, n) in spans(offset, len, CHECKSUM_SPAN) {
            let m = crate::protocol::Msg::Checksum {
                handle: r.handle,
                offset: at,
                len: n,
            };
            match self.request(&m, "checksum").await? {
                crate::protocol::Msg::ChecksumIs { crc32c } => parts.push((crc32c, n)),
                other => return Err(super::reply_err(&self.conn.peer, other, "checksum")),
            }
        }
        Ok(combined(parts))
    }

    /// Compare `len` bytes read from `local` with the server's bytes at `offset` of `r`, by
    /// CRC-32C: `Error::Mismatch` when they differ (a copy made earlier, checked before it is
    /// trusted; a fetch resumed after a failure checks the part it kept), else the CRC-32C
    /// both sides have (for a report of the whole range, [`crate::stripe::kept`]).
    pub async fn compare(
        &mut self,
        r: &super::OpenRegion,
        offset: u64,
        len: u64,
        local: &mut (dyn std::io::Read + Send),
    ) -> crate::error::Result<u32> {
        self.check_range(r, offset, len)?;
        let mut crc = Checksum::new(true);
        let mut buf = vec![0u8; (1 << 20).min(len.max(1) as usize)];
        let mut left = len;
        while left > 0 {
            let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            local
                .read_exact(&mut buf[..n])
                .map_err(|e| crate::error::Error::io("reading the local copy to compare", e))?;
            crc.add(&buf[..n]);
            left -= n as u64;
        }
        self.verify(r, "local copy", offset, len, crc).await?;
        Ok(crc.value().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_range_is_asked_for_in_spans_whose_crcs_combine_into_its_own() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 17 % 253) as u8).collect();
        for (offset, len, span) in [
            (0u64, 10_000u64, 3_000u64),
            (5, 9_000, 9_000),
            (0, 10_000, 10_001),
            (7, 1, 1),
        ] {
            let s: Vec<_> = spans(offset, len, span).collect();
            // in order, touching, none over the span, the whole range
            assert_eq!(s.first().unwrap().0, offset);
            assert!(s.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            assert!(s.iter().all(|&(_, n)| n <= span && n > 0));
            assert_eq!(s.iter().map(|&(_, n)| n).sum::<u64>(), len);
            let sum = |(at, n): (u64, u64)| crc32c::crc32c(&data[at as usize..(at + n) as usize]);
            let whole = sum((offset, len));
            assert_eq!(combined(s.iter().map(|&p| (sum(p), p.1))), whole);
        }
        assert_eq!(spans(3_000, 10_000, 3_000).count(), 4);
        // an empty range: one empty span, whose CRC is the empty range's
        assert_eq!(spans(9, 0, 4).collect::<Vec<_>>(), [(9, 0)]);
        assert_eq!(combined([(0, 0)]), crc32c::crc32c(&[]));
    }

    #[test]
    fn sums_in_pieces_what_it_would_whole_and_nothing_when_off() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut c = Checksum::new(true);
        for piece in data.chunks(777) {
            c.add(piece);
        }
        assert_eq!(c.value(), Some(crc32c::crc32c(&data)));
        let mut off = Checksum::new(false);
        off.add(&data);
        assert_eq!(off.value(), None);
        assert_eq!(Checksum::new(true).value(), Some(0), "an empty range");
    }
}
