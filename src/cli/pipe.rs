//! Transfers through pipes: `fetch -o -` (one stream to stdout) and `put -i -` (one stream
//! from stdin). Bytes written to a pipe cannot be taken back, and bytes read from one cannot be
//! read again, so a try that fails cannot start over as with a file: with `--retries` the next
//! try goes on after what the failed one moved. A fetch's are in stdout; a put keeps the bytes
//! it read and the server has not acknowledged yet (at most its window) to put them again
//! ([`Replay`]). What makes that safe is `--verify` (required with `--retries` here): the
//! CRC-32C of the bytes each failed try moved is kept, and once the range is in, the server's
//! checksum of those parts must still match them. A region that changed between tries makes
//! the transfer fail with a mismatch that says so: a fetch's stdout then holds bytes of two
//! versions, a put's range lacks some of its input.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bridge::stripe::Stripe;

use super::resume::Tried;
use super::transfer::{finish_transfer, whole, Progress, Retry};

/// A writer that counts and sums (CRC-32C) the bytes it passes on, since the last
/// [`Written::take`].
#[derive(Debug)]
struct Written<W> {
    inner: W,
    n: u64,
    crc: u32,
}

impl<W: Write> Written<W> {
    fn new(inner: W) -> Written<W> {
        Written {
            inner,
            n: 0,
            crc: 0,
        }
    }

    /// The bytes written and their CRC-32C since the last call.
    fn take(&mut self) -> (u64, u32) {
        let out = (self.n, self.crc);
        (self.n, self.crc) = (0, 0);
        out
    }
}

impl<W: Write> Write for Written<W> {
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
    /// The bytes let go since the last [`Replay::take`], and their CRC-32C.
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

    /// Go back to the stream offset `to` (no earlier than what was let go): the next reads
    /// hand out the kept bytes from there again.
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

/// Put from stdin at `offset` of `r` (the region named `region`), `limit` bytes or up to the
/// end of the input, trying again with `retry` after what each failed try put (with `verify`;
/// without it `retry` has no tries, which the caller ensures), then check (and flush, where
/// the server makes puts durable) the failed tries' parts and finish the transfer.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn from_stdin(
    mut c: bridge::Client,
    mut r: bridge::OpenRegion,
    region: &str,
    (offset, limit): (u64, Option<u64>),
    verify: bool,
    mut retry: Retry,
    mut bar: Progress,
    json: bool,
) -> anyhow::Result<()> {
    let acked = Arc::new(AtomicU64::new(0));
    let mut from = Replay::new(std::io::stdin(), Arc::clone(&acked));
    let mut earlier: Vec<(Stripe, u32)> = Vec::new();
    let mut done = 0;
    let rep = loop {
        let at = offset + done;
        let rest = limit.map(|l| l - done);
        let start = done;
        let rep = c
            .put(&r, at, &mut from, rest, verify, &mut |d| {
                acked.store(start + d, Ordering::Relaxed);
                bar.update(start + d)
            })
            .await;
        let e = match rep {
            Ok(t) => break Ok(Tried::one(t)),
            Err(e) => e,
        };
        let (n, crc) = from.acknowledged();
        if n > 0 {
            earlier.push((Stripe { offset: at, len: n }, crc));
            done += n;
        }
        // the next try reads again what this one read past the bytes put
        from.rewind(done);
        match retry
            .again(&mut c, &e, "put", region, bridge::OpenFor::Write)
            .await
        {
            Some(again) => r = again,
            None => break Err(e),
        }
    };
    let rep = checked(
        &mut c,
        &mut r,
        (region, offset),
        rep,
        &earlier,
        &mut retry,
        true,
    )
    .await;
    finish_transfer(c, &r, whole(rep, &earlier)?, bar, json).await
}

/// Fetch `len` bytes at `offset` of `r` (the region named `region`) to stdout, trying again
/// with `retry` after what each failed try wrote (with `verify`; without it `retry` has no
/// tries, which the caller ensures), then check the failed tries' parts and finish the
/// transfer (report, exit).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn to_stdout(
    mut c: bridge::Client,
    mut r: bridge::OpenRegion,
    region: &str,
    (offset, len): (u64, u64),
    verify: bool,
    mut retry: Retry,
    mut bar: Progress,
    json: bool,
) -> anyhow::Result<()> {
    let mut sink = Written::new(std::io::BufWriter::with_capacity(
        1 << 20,
        std::io::stdout(),
    ));
    // the parts the failed tries wrote, each with the CRC-32C of its bytes
    let mut earlier: Vec<(Stripe, u32)> = Vec::new();
    let mut done = 0;
    let rep = loop {
        let at = offset + done;
        let rep = c
            .fetch(&r, at, len - done, &mut sink, verify, &mut |d| {
                bar.update(done + d)
            })
            .await;
        let (n, crc) = sink.take();
        let e = match rep {
            Ok(t) => break Ok(Tried::one(t)),
            Err(e) => e,
        };
        if n > 0 {
            earlier.push((Stripe { offset: at, len: n }, crc));
            done += n;
        }
        let rest = bridge::OpenFor::Fetch {
            offset: offset + done,
            len: len - done,
        };
        match retry.again(&mut c, &e, "fetch", region, rest).await {
            Some(again) => r = again,
            None => break Err(e),
        }
    };
    let rep = checked(
        &mut c,
        &mut r,
        (region, offset),
        rep,
        &earlier,
        &mut retry,
        false,
    )
    .await;
    let flushed = sink.flush();
    let rep = whole(rep, &earlier)?;
    flushed.map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))?;
    finish_transfer(c, &r, rep, bar, json).await
}

/// The last try's outcome `rep`, once the `earlier` parts, those the failed tries moved through
/// the pipe (`put`: from stdin, else to stdout), are found still in the region
/// ([`still_hold`]), which is said; `offset`: the range's.
async fn checked(
    c: &mut bridge::Client,
    r: &mut bridge::OpenRegion,
    (region, offset): (&str, u64),
    rep: bridge::Result<Tried>,
    earlier: &[(Stripe, u32)],
    retry: &mut Retry,
    put: bool,
) -> bridge::Result<Tried> {
    let t = rep?;
    if earlier.is_empty() {
        return Ok(t);
    }
    still_hold(c, r, region, earlier, retry, put).await?;
    let kept: Vec<Stripe> = earlier.iter().map(|(s, _)| *s).collect();
    let moved = if put {
        "put from stdin"
    } else {
        "written to stdout"
    };
    eprintln!("p2p-rdma: {}", super::resume::resumed(offset, &kept, moved));
    Ok(t)
}

/// Whether the region still holds the `parts` the failed tries moved through the pipe, by the
/// server's checksum of each against the CRC-32C of what was moved; with `put`, each is then
/// flushed where the server makes puts durable (a try flushes only its own). A check cut by a
/// transient failure connects again (out of `retry`'s tries).
async fn still_hold(
    c: &mut bridge::Client,
    r: &mut bridge::OpenRegion,
    region: &str,
    parts: &[(Stripe, u32)],
    retry: &mut Retry,
    put: bool,
) -> bridge::Result<()> {
    for (s, crc) in parts {
        let done = loop {
            let step = async {
                let server = c.checksum(r, s.offset, s.len).await?;
                if server == *crc && put && r.info.server_puts {
                    c.flush(r, s.offset, s.len).await?;
                }
                Ok::<_, bridge::Error>(server)
            }
            .await;
            match step {
                Ok(v) => break v,
                Err(e) => {
                    let again = if put {
                        bridge::OpenFor::Write
                    } else {
                        bridge::OpenFor::Fetch {
                            offset: s.offset,
                            len: s.len,
                        }
                    };
                    match retry.again(c, &e, "check", region, again).await {
                        Some(o) => *r = o,
                        None => return Err(e),
                    }
                }
            }
        };
        if done != *crc {
            let (n, at) = (bridge::size::human(s.len), s.offset);
            let what = if put {
                format!(
                    "the {n} put from stdin at offset {at} of '{region}' by a try before the \
                     last: the region changed since, and stdin cannot be read again to put them \
                     back"
                )
            } else {
                format!(
                    "the {n} written to stdout at offset {at} of '{region}' by a try before the \
                     last: the region changed since, so stdout holds bytes of two versions of it"
                )
            };
            return Err(bridge::Error::Mismatch {
                what,
                client: *crc,
                server: done,
            });
        }
    }
    Ok(())
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
        let mut w = Written::new(Vec::new());
        w.write_all(b"hello ").unwrap();
        w.write_all(b"world").unwrap();
        assert_eq!(w.take(), (11, crc32c::crc32c(b"hello world")));
        w.write_all(b"again").unwrap();
        assert_eq!(w.take(), (5, crc32c::crc32c(b"again")));
        assert_eq!(w.take(), (0, 0));
        assert_eq!(w.inner, b"hello worldagain");
    }
}
