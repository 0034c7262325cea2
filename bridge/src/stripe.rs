//! Striping one transfer over several connections, each with its own queue pair (`fetch` and
//! `put` with `--qps N`): how a range is cut, and how the stripes' reports make one. Sans-IO.
//!
//! Each stripe is a whole number of chunks (the last one takes the rest), so no work request
//! is cut smaller than it would be in one stream; a range too short for `n` stripes of at least
//! one chunk gets fewer. The stripes' CRC-32Cs combine, in range order, into the CRC-32C of the
//! whole range, so a striped transfer reports the same checksum as an unstriped one.

use crate::client::TransferReport;

/// Most stripes of one transfer.
pub const MAX_STRIPES: usize = 64;

/// One stripe: a part of the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stripe {
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Cut `len` bytes at `offset` into at most `n` stripes of whole `chunk`s, in order, covering
/// the range exactly (an empty range: no stripe).
pub fn plan(offset: u64, len: u64, n: usize, chunk: u64) -> Vec<Stripe> {
    let chunk = chunk.max(1);
    let chunks = len.div_ceil(chunk);
    let n = (n.clamp(1, MAX_STRIPES) as u64).min(chunks);
    let mut out = Vec::with_capacity(n as usize);
    let mut at = 0;
    for i in 0..n {
        // chunks spread evenly: the first `chunks % n` stripes take one more
        let k = chunks / n + u64::from(i < chunks % n);
        let l = (k * chunk).min(len - at);
        out.push(Stripe {
            offset: offset + at,
            len: l,
        });
        at += l;
    }
    out
}

/// A part of a range that a transfer did not move, `len` bytes at `offset`: kept from an
/// earlier try and compared with the server's checksum, `crc` the CRC-32C both sides had. As a
/// report (of `like`'s op and region) to [`merge`] with the reports of the parts moved, so that
/// the merged one covers the whole range, its CRC included, with the kept bytes counted apart.
pub fn kept(like: &TransferReport, offset: u64, len: u64, crc: u32) -> TransferReport {
    TransferReport {
        offset,
        bytes: len,
        kept_bytes: len,
        seconds: 0.0,
        mib_per_sec: 0.0,
        direct_bytes: 0,
        bounce_bytes: 0,
        zero_copy_bytes: 0,
        tcp_bytes: 0,
        crc32c: Some(crc),
        verified: true,
        first_bytes_ms: None,
        reasked_chunks: 0,
        ..like.clone()
    }
}

/// One report for the whole range out of the stripes' (in range order), timed by the caller
/// (`seconds`: the wall time of all of them).
pub fn merge(reports: &[TransferReport], seconds: f64) -> Option<TransferReport> {
    let first = reports.first()?;
    let mut m = TransferReport {
        bytes: 0,
        direct_bytes: 0,
        bounce_bytes: 0,
        zero_copy_bytes: 0,
        tcp_bytes: 0,
        crc32c: None,
        verified: true,
        reasked_chunks: 0,
        kept_bytes: 0,
        ..first.clone()
    };
    let mut end = first.offset;
    for (i, r) in reports.iter().enumerate() {
        // a range's CRC only when every stripe was summed, and the stripes are one range (a
        // resumed fetch's pieces may have gaps, fetched before)
        m.crc32c = match (i, m.crc32c, r.crc32c) {
            (0, _, c) => c,
            (_, Some(a), Some(b)) if r.offset == end => {
                Some(crc32c::crc32c_combine(a, b, r.bytes as usize))
            }
            _ => None,
        };
        end = r.offset + r.bytes;
        m.bytes += r.bytes;
        m.direct_bytes += r.direct_bytes;
        m.bounce_bytes += r.bounce_bytes;
        m.zero_copy_bytes += r.zero_copy_bytes;
        m.tcp_bytes += r.tcp_bytes;
        m.reasked_chunks += r.reasked_chunks;
        m.kept_bytes += r.kept_bytes;
        m.verified &= r.verified;
        // the stripes start together: the range's first bytes are the earliest stripe's
        m.first_bytes_ms = match (m.first_bytes_ms, r.first_bytes_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    m.seconds = seconds;
    // the rate of the bytes moved
    m.mib_per_sec = crate::size::mib_per_sec(m.bytes - m.kept_bytes, seconds);
    Some(m)
}

/// A fetch's report of `data` at `offset`, summed (`verified`) or not: for the tests of reports.
#[cfg(test)]
pub(crate) fn test_report(offset: u64, data: &[u8], verified: bool) -> TransferReport {
    TransferReport {
        op: "fetch",
        region: "r".into(),
        offset,
        bytes: data.len() as u64,
        seconds: 1.0,
        mib_per_sec: 0.0,
        direct_bytes: data.len() as u64,
        bounce_bytes: 0,
        zero_copy_bytes: 0,
        tcp_bytes: 0,
        crc32c: verified.then(|| crc32c::crc32c(data)),
        verified,
        first_bytes_ms: None,
        open_ms: None,
        reasked_chunks: 0,
        kept_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::test_report as report;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn kept_parts_merge_into_the_crc_of_the_whole_range_and_count_apart() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 13 % 253) as u8).collect();
        let part = |a: usize, b: usize| report(a as u64, &data[a..b], true);
        // kept: 0..30000 and 60000..70000; moved: the rest, in two pieces
        let moved = [part(30_000, 60_000), part(70_000, 100_000)];
        let like = &moved[0];
        let mut all = vec![
            kept(like, 0, 30_000, crc32c::crc32c(&data[..30_000])),
            moved[0].clone(),
            kept(like, 60_000, 10_000, crc32c::crc32c(&data[60_000..70_000])),
            moved[1].clone(),
        ];
        let m = merge(&all, 2.0).unwrap();
        assert_eq!((m.offset, m.bytes, m.kept_bytes), (0, 100_000, 40_000));
        assert_eq!(m.crc32c, Some(crc32c::crc32c(&data)));
        assert!(m.verified);
        // the rate is of the bytes moved; the paths count only them
        assert!((m.mib_per_sec - 60_000.0 / 2.0 / 1048576.0).abs() < 1e-9);
        assert_eq!(m.direct_bytes, 60_000);
        // out of order, the pieces are not one range: no CRC
        all.swap(0, 1);
        assert_eq!(merge(&all, 2.0).unwrap().crc32c, None);
    }

    #[test]
    fn stripes_are_whole_chunks_and_the_last_takes_the_rest() {
        let s = plan(100, 10 * 4096 + 5, 3, 4096);
        let lens: Vec<u64> = s.iter().map(|s| s.len).collect();
        assert_eq!(lens, [4 * 4096, 4 * 4096, 2 * 4096 + 5]);
        assert_eq!(s[0].offset, 100);
        assert_eq!(s[2].offset, 100 + 8 * 4096);
        // fewer chunks than stripes: one stripe per chunk
        assert_eq!(plan(0, 5000, 8, 4096).len(), 2);
        assert!(plan(0, 0, 4, 4096).is_empty());
        assert_eq!(plan(0, 1 << 30, 1000, 1 << 20).len(), MAX_STRIPES);
    }

    #[test]
    fn the_merged_report_has_the_crc_of_the_whole_range() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let s = plan(0, data.len() as u64, 3, 16384);
        let reps: Vec<_> = s
            .iter()
            .map(|s| report(s.offset, &data[s.offset as usize..][..s.len as usize], true))
            .collect();
        let m = merge(&reps, 2.0).unwrap();
        assert_eq!(m.bytes, data.len() as u64);
        assert_eq!(m.offset, 0);
        assert!(m.verified);
        assert!((m.mib_per_sec - data.len() as f64 / 2.0 / 1048576.0).abs() < 1e-9);
        assert_eq!(m.crc32c, Some(crc32c::crc32c(&data)));
        // a stripe that was not verified was not summed: the range has no CRC
        let mut one_unverified = reps.clone();
        one_unverified[1] = report(s[1].offset, &[], false);
        let u = merge(&one_unverified, 1.0).unwrap();
        assert!(!u.verified);
        assert_eq!(u.crc32c, None);
        // pieces with a gap between them (a resumed fetch's) are not one range: no CRC
        let mut gap = reps.clone();
        gap[1].offset += 1;
        let g = merge(&gap, 1.0).unwrap();
        assert!(g.verified);
        assert_eq!(g.crc32c, None);
        assert!(merge(&[], 1.0).is_none());
    }

    #[test]
    fn the_merged_first_bytes_are_the_earliest_stripes() {
        let mut reps = vec![report(0, &[1; 10], false); 3];
        assert_eq!(merge(&reps, 1.0).unwrap().first_bytes_ms, None);
        reps[1].first_bytes_ms = Some(7.5);
        assert_eq!(merge(&reps, 1.0).unwrap().first_bytes_ms, Some(7.5));
        reps[0].first_bytes_ms = Some(9.0);
        reps[2].first_bytes_ms = Some(3.25);
        assert_eq!(merge(&reps, 1.0).unwrap().first_bytes_ms, Some(3.25));
    }

    proptest! {
        #[test]
        fn stripes_cover_the_range_exactly(
            offset in 0u64..1 << 40, len in 0u64..1 << 26, n in 0usize..100, chunk in 1u64..1 << 21
        ) {
            let s = plan(offset, len, n, chunk);
            prop_assert!(s.len() <= n.clamp(1, MAX_STRIPES));
            let mut at = offset;
            for (i, st) in s.iter().enumerate() {
                prop_assert_eq!(st.offset, at);
                prop_assert!(st.len > 0);
                if i + 1 < s.len() {
                    prop_assert_eq!(st.len % chunk, 0);
                }
                at += st.len;
            }
            prop_assert_eq!(at, offset + len);
        }
    }
}
