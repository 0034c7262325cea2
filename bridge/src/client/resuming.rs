//! Transfers that outlive their connection: a fetch into a writer, or a put from a reader, that
//! goes on after a failure a new connection may get past ([`Retries`]) rather than start over.
//! A writer cannot take back what it was given, and a reader cannot give again what it gave,
//! so each try goes on after the bytes the one before moved:
//!
//! - a fetch's failed try wrote a start of its part into the sink, in order; the next fetches
//!   the rest after it;
//! - a put's failed try had a start of its part acknowledged (WRITEs and bounce replies
//!   complete in order); the bytes it read past that are kept ([`Replay`], at most the put's
//!   window) and read again by the next try.
//!
//! Every byte is summed (CRC-32C) once, as it is written to the sink or acknowledged from the
//! source, and every try's part is checked against the server's checksum once the range is in
//! (a failed try's part is then flushed, where the server makes puts durable; the last try
//! flushed its own): a part that differs fails with [`Error::Mismatch`], which says whether a
//! try before the last moved it (the region changed between tries). The caller, who knows
//! whether its sink or source can be moved again (a file can, a pipe or a socket cannot),
//! decides what to do then.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Client, OpenFor, OpenRegion, Retries, TransferReport};
use crate::error::{Error, Result};
use crate::stripe::Stripe;

/// The outcome of [`Client::fetch_resuming`] or [`Client::put_resuming`].
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The whole range: `kept_bytes` are those moved by the tries that failed, checked at the
    /// end; `mib_per_sec` is the last try's rate, `crc32c` that of every byte of the range.
    pub report: TransferReport,
    /// The parts the tries that failed moved, in order (empty: the first try did it all).
    pub earlier: Vec<Stripe>,
}

/// A writer that counts and sums (CRC-32C) the bytes it passes on, since the last
/// [`Written::take`].
struct Written<'a> {
    inner: &'a mut (dyn Write + Send),
    n: u64,
    crc: u32,
}

impl Written<'_> {
    /// The bytes written and their CRC-32C since the last call.
    fn take(&mut self) -> (u64, u32) {
        let out = (self.n, self.crc);
        (self.n, self.crc) = (0, 0);
        out
    }
}

impl Write for Written<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..k]);
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that keeps what it handed out until it is acknowledged (`acked`, a count of the
/// stream's bytes from its start, set by the put's progress), so that a try that failed can
/// be followed by one that reads them again ([`Replay::rewind`]). It sums (CRC-32C) the bytes
/// acknowledged as it lets them go ([`Replay::acknowledged`]).
#[derive(Debug)]
struct Replay<R> {
    inner: R,
    /// Bytes handed out and not let go, the first at stream offset `base`.
    kept: VecDeque<u8>,
    base: u64,
    /// The stream offset of the next byte to hand out.
    pos: u64,
    acked: Arc<AtomicU64>,
    /// The bytes let go since the last [`Replay::acknowledged`], and their CRC-32C.
    gone: u64,
    crc: u32,
}

impl<R: Read> Replay<R> {
    fn new(inner: R, acked: Arc<AtomicU64>) -> Replay<R> {
        Replay {
            inner,
            kept: VecDeque::new(),
            base: 0,
            pos: 0,
            acked,
            gone: 0,
            crc: 0,
        }
    }

    /// Let go of the bytes acknowledged, summing them.
    fn settle(&mut self) {
        let upto = self.acked.load(Ordering::Relaxed).min(self.pos);
        let n = usize::try_from(upto.saturating_sub(self.base))
            .unwrap_or(usize::MAX)
            .min(self.kept.len());
        let (a, b) = self.kept.as_slices();
        let a = &a[..n.min(a.len())];
        let b = &b[..n - a.len()];
        self.crc = crc32c::crc32c_append(crc32c::crc32c_append(self.crc, a), b);
        self.kept.drain(..n);
        self.base += n as u64;
        self.gone += n as u64;
    }

    /// Go back to the stream offset `to` (no earlier than what was let go, no later than what
    /// was handed out): the next reads hand out the kept bytes from there again.
    fn rewind(&mut self, to: u64) {
        self.settle();
        self.pos = to.clamp(self.base, self.pos);
    }

    /// The bytes acknowledged (and let go) since the last call, and their CRC-32C.
    fn acknowledged(&mut self) -> (u64, u32) {
        self.settle();
        let out = (self.gone, self.crc);
        (self.gone, self.crc) = (0, 0);
        out
    }
}

impl<R: Read> Read for Replay<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.settle();
        let at = usize::try_from(self.pos - self.base).unwrap_or(usize::MAX);
        if at < self.kept.len() {
            let (a, b) = self.kept.as_slices();
            let from = if at < a.len() {
                &a[at..]
            } else {
                &b[at - a.len()..]
            };
            let n = from.len().min(buf.len());
            buf[..n].copy_from_slice(&from[..n]);
            self.pos += n as u64;
            return Ok(n);
        }
        let n = self.inner.read(buf)?;
        self.kept.extend(&buf[..n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Client {
    /// Fetch `len` bytes at `offset` of `r` into `sink`, verified; when a try fails in a way a
    /// new connection may get past and `retries` has tries left, connect again, open the
    /// region (`r.info.name`) again and go on after the bytes the failed try wrote, so that
    /// `sink` gets each byte of the range once, in order. `r` is then the region as last
    /// opened. The parts failed tries wrote are checked at the end: [`Error::Mismatch`] when
    /// the region changed meanwhile (`sink` then holds bytes of two versions of it).
    /// `progress` is told the bytes of the range written so far.
    pub async fn fetch_resuming(
        &mut self,
        r: &mut OpenRegion,
        (offset, len): (u64, u64),
        sink: &mut (dyn Write + Send),
        retries: &mut Retries,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<Resumed> {
        let name = r.info.name.clone();
        let mut sink = Written {
            inner: sink,
            n: 0,
            crc: 0,
        };
        let mut earlier = Vec::new();
        let mut done = 0;
        let last = loop {
            let at = offset + done;
            // unverified: the bytes are summed here as they are written, checked at the end
            let rep = self
                .fetch(r, at, len - done, &mut sink, false, &mut |d| {
                    progress(done + d)
                })
                .await;
            let (n, crc) = sink.take();
            let e = match rep {
                Ok(t) => break (t, crc),
                Err(e) => e,
            };
            if n > 0 {
                earlier.push((Stripe { offset: at, len: n }, crc));
                done += n;
            }
            let rest = OpenFor::Fetch {
                offset: offset + done,
                len: len - done,
            };
            *r = retries
                .again(self, &e, "fetch", &name, rest)
                .await
                .ok_or(e)?;
        };
        sink.flush()
            .map_err(|e| Error::io("writing the fetched bytes", e))?;
        self.resumed(r, last, earlier, retries, false).await
    }

    /// Put the bytes of `source` at `offset` of `r` (`limit` of them, or up to its end),
    /// verified; when a try fails in a way a new connection may get past and `retries` has
    /// tries left, connect again, open the region (`r.info.name`) again and go on after the
    /// bytes the server acknowledged, reading `source` once: the bytes read past those (at
    /// most the put's window of chunks in flight) are kept and put again. `r` is then the
    /// region as last opened. The parts failed tries put are checked (and flushed, where the
    /// server makes puts durable) at the end: [`Error::Mismatch`] when the region changed
    /// meanwhile (it then lacks some of `source`'s bytes, which cannot be read again).
    /// `progress` is told the bytes put so far.
    pub async fn put_resuming(
        &mut self,
        r: &mut OpenRegion,
        offset: u64,
        source: &mut (dyn Read + Send),
        limit: Option<u64>,
        retries: &mut Retries,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<Resumed> {
        let name = r.info.name.clone();
        let acked = Arc::new(AtomicU64::new(0));
        let mut from = Replay::new(source, Arc::clone(&acked));
        let mut earlier = Vec::new();
        let mut done = 0;
        let last = loop {
            let (at, start) = (offset + done, done);
            // unverified: the bytes are summed here as they are acknowledged, checked at the end
            let rep = self
                .put(r, at, &mut from, limit.map(|l| l - done), false, &mut |d| {
                    acked.store(start + d, Ordering::Relaxed);
                    progress(start + d)
                })
                .await;
            let e = match rep {
                Ok(t) => {
                    // every byte of the last try is in (and flushed, where puts are made durable)
                    acked.store(start + t.bytes, Ordering::Relaxed);
                    let (n, crc) = from.acknowledged();
                    debug_assert_eq!(n, t.bytes, "the last try's bytes, all acknowledged");
                    break (t, crc);
                }
                Err(e) => e,
            };
            let (n, crc) = from.acknowledged();
            if n > 0 {
                earlier.push((Stripe { offset: at, len: n }, crc));
                done += n;
            }
            // the next try reads again what this one read past the bytes put
            from.rewind(done);
            *r = retries
                .again(self, &e, "put", &name, OpenFor::Write)
                .await
                .ok_or(e)?;
        };
        self.resumed(r, last, earlier, retries, true).await
    }

    /// The whole range's outcome, once every try's part is found in the region as it was
    /// moved: the `earlier` parts (with the CRC-32C of the bytes the failed tries moved) and
    /// the `last` try's (unverified, with the CRC-32C of its bytes), each compared with the
    /// server's checksum, and with `put` an earlier part flushed where the server makes puts
    /// durable (a try flushes only its own, and only when it completes). A check cut by a
    /// failure a new connection may get past connects again.
    async fn resumed(
        &mut self,
        r: &mut OpenRegion,
        (mut last, last_crc): (TransferReport, u32),
        earlier: Vec<(Stripe, u32)>,
        retries: &mut Retries,
        put: bool,
    ) -> Result<Resumed> {
        let name = r.info.name.clone();
        let whole = Stripe {
            offset: last.offset,
            len: last.bytes,
        };
        let parts = earlier.iter().map(|&(s, crc)| (s, crc, true));
        for (s, crc, before) in parts.chain([(whole, last_crc, false)]) {
            let server = loop {
                let step = async {
                    let server = self.checksum(r, s.offset, s.len).await?;
                    if server == crc && before && put && r.info.server_puts {
                        self.flush(r, s.offset, s.len).await?;
                    }
                    Ok::<_, Error>(server)
                }
                .await;
                match step {
                    Ok(v) => break v,
                    Err(e) => {
                        // a plain open: the check moves no bytes, so nothing is staged for it
                        let again = if put { OpenFor::Write } else { OpenFor::Read };
                        *r = retries
                            .again(self, &e, "check", &name, again)
                            .await
                            .ok_or(e)?;
                    }
                }
            };
            if server != crc && !before {
                // the last try's part: as a verified transfer of one try says it
                let op = if put { "put" } else { "fetch" };
                return Err(super::mismatch(op, &name, (s.offset, s.len), crc, server));
            }
            if server != crc {
                let (n, at) = (crate::size::human(s.len), s.offset);
                return Err(Error::Mismatch {
                    what: if put {
                        format!(
                            "the {n} put at offset {at} of '{name}' by a try before the last: \
                             the region changed since, and lacks bytes of the source"
                        )
                    } else {
                        format!(
                            "the {n} fetched from offset {at} of '{name}' by a try before the \
                             last: the region changed since, so the sink holds bytes of two \
                             versions of it"
                        )
                    },
                    client: crc,
                    server,
                });
            }
        }
        (last.crc32c, last.verified) = (Some(last_crc), true);
        let seconds = last.seconds;
        let mut all: Vec<TransferReport> = earlier
            .iter()
            .map(|(s, crc)| crate::stripe::kept(&last, s.offset, s.len, *crc))
            .collect();
        all.push(last.clone());
        all.sort_by_key(|t| (t.offset, t.bytes));
        // (`all` holds the last try's report: a merge of it is never empty)
        let report = crate::stripe::merge(&all, seconds).unwrap_or(last);
        Ok(Resumed {
            report,
            earlier: earlier.into_iter().map(|(s, _)| s).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_hands_out_again_what_was_not_acknowledged_and_sums_what_was() {
        let input: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let acked = Arc::new(AtomicU64::new(0));
        let mut r = Replay::new(&input[..], Arc::clone(&acked));
        let mut got = vec![0u8; 6000];
        r.read_exact(&mut got).unwrap();
        assert_eq!(got, input[..6000]);
        // a try acknowledged 2500 bytes of the 6000 it read, then failed
        acked.store(2500, Ordering::Relaxed);
        assert_eq!(r.acknowledged(), (2500, crc32c::crc32c(&input[..2500])));
        assert_eq!(r.kept.len(), 3500, "only what is not acknowledged is kept");
        r.rewind(2500);
        // the next try reads the 3500 kept bytes again, then goes on with the input
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, input[2500..]);
        acked.store(10_000, Ordering::Relaxed);
        assert_eq!(r.acknowledged(), (7500, crc32c::crc32c(&input[2500..])));
        assert!(r.kept.is_empty());
        // no rewinding before what was let go, nor past what was read
        r.rewind(0);
        assert_eq!(r.pos, 10_000);
    }

    #[test]
    fn a_replay_keeps_no_more_than_what_is_in_flight() {
        let input = vec![7u8; 1 << 20];
        let acked = Arc::new(AtomicU64::new(0));
        let mut r = Replay::new(&input[..], Arc::clone(&acked));
        let mut buf = vec![0u8; 4096];
        let mut read = 0u64;
        while read < input.len() as u64 {
            read += r.read(&mut buf).unwrap() as u64;
            // the server acknowledges all but the last 16 KiB
            acked.store(read.saturating_sub(16 << 10), Ordering::Relaxed);
            assert!(r.kept.len() <= (16 << 10) + 4096, "{}", r.kept.len());
        }
    }

    #[test]
    fn written_bytes_are_counted_and_summed_from_the_last_take() {
        let mut out = Vec::new();
        let mut w = Written {
            inner: &mut out,
            n: 0,
            crc: 0,
        };
        w.write_all(b"hello ").unwrap();
        w.write_all(b"world").unwrap();
        assert_eq!(w.take(), (11, crc32c::crc32c(b"hello world")));
        w.write_all(b"again").unwrap();
        assert_eq!(w.take(), (5, crc32c::crc32c(b"again")));
        assert_eq!(w.take(), (0, 0));
        assert_eq!(out, b"hello worldagain");
    }
}
