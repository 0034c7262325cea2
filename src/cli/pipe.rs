//! `fetch -o -`: one stream to stdout. Bytes written to a pipe cannot be taken back, so a try
//! that fails leaves them there and, with `--retries`, the next try goes on after them; what
//! makes that safe is `--verify` (required with `--retries` here): the CRC-32C of every byte
//! each try wrote is kept, and once the range is in, the server's checksum of the parts the
//! failed tries wrote must still match them. A region that changed between tries makes the
//! fetch fail with a mismatch that says so (the pipe then holds bytes of two versions): it
//! cannot start over as a fetch into a file does.

use std::io::Write;

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
    let rep = match rep {
        Ok(t) if !earlier.is_empty() => {
            match still_hold(&mut c, &mut r, region, &earlier, &mut retry).await {
                Ok(()) => {
                    let kept: Vec<Stripe> = earlier.iter().map(|(s, _)| *s).collect();
                    eprintln!(
                        "p2p-rdma: {}",
                        super::resume::resumed(offset, &kept, "written to stdout")
                    );
                    Ok(t)
                }
                Err(e) => Err(e),
            }
        }
        other => other,
    };
    let flushed = sink.flush();
    let rep = whole(rep, &earlier)?;
    flushed.map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))?;
    finish_transfer(c, &r, rep, bar, json).await
}

/// Whether the region still holds the `parts` the failed tries wrote to stdout, by the
/// server's checksum of each against the CRC-32C of what was written; a check cut by a
/// transient failure connects again (out of `retry`'s tries).
async fn still_hold(
    c: &mut bridge::Client,
    r: &mut bridge::OpenRegion,
    region: &str,
    parts: &[(Stripe, u32)],
    retry: &mut Retry,
) -> bridge::Result<()> {
    for (s, crc) in parts {
        let server = loop {
            match c.checksum(r, s.offset, s.len).await {
                Ok(v) => break v,
                Err(e) => {
                    let again = bridge::OpenFor::Fetch {
                        offset: s.offset,
                        len: s.len,
                    };
                    match retry.again(c, &e, "check", region, again).await {
                        Some(o) => *r = o,
                        None => return Err(e),
                    }
                }
            }
        };
        if server != *crc {
            return Err(bridge::Error::Mismatch {
                what: format!(
                    "the {} written to stdout at offset {} of '{region}' by a try before the \
                     last: the region changed since, so stdout holds bytes of two versions of it",
                    bridge::size::human(s.len),
                    s.offset
                ),
                client: *crc,
                server,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
