//! The benchmark's client on the bounce path: the server's memory cannot be registered, so the
//! client moves it through the bridge (puts, and fetches into one registered buffer), with
//! `tx_depth` messages in flight as the direct path keeps `tx_depth` work requests.

use std::time::{Duration, Instant};

use super::*;

/// Bytes one timed fetch call moves at least (whole spans of the region): each call starts
/// with a ramp (the first chunk's staging and control round trip, with nothing landing), so a
/// call of a single 16 MiB span spent about a tenth of its time ramping between the lab guests,
/// a cost the direct path's steady stream of READs does not have. (The window counts the
/// pieces as they land, so a call may be longer than the window.)
const FETCH_CALL: u64 = 32 << 20;

/// Run every size against the server's bridge at `port` of the bench server's host.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run(
    server: &str,
    port: u16,
    token: String,
    side: &Side,
    p: &BenchParams,
    path: &str,
    strategy: &str,
    pat: &[u8],
    c: &mut Control,
    each: &mut (dyn FnMut(&SizeResult) + Send),
) -> Result<Vec<SizeResult>> {
    let host = server
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or(server)
        .to_string();
    let mut cfg = bridge::ClientConfig::new(format!("{host}:{port}"), token);
    cfg.device = side.device.clone();
    cfg.depth = p.tx_depth as usize;
    let mut bc = bridge::Client::connect(cfg).await?;
    let r = bc.open("bench", p.op == BenchOp::Write).await?;
    let mut out = Vec::new();
    // the fetches' landing buffer, registered once (a span is at most the region) and kept
    // from size to size
    let mut landing: Option<bridge::LocalBuffer> = None;
    for &size in &p.sizes {
        // Like the direct path's `tx_depth` work requests in flight, keep `tx_depth` messages
        // in flight: each span is up to `tx_depth` messages (as much of the region as fits),
        // one bounce request per message, pipelined by the bridge client.
        let span = bounce_span(size, p.tx_depth, r.info.size);
        let per_span = span / size;
        bc.set_chunk(size as usize)?;
        let mut mover = match p.op {
            BenchOp::Write => Mover::Put(pat[..size as usize].repeat(per_span as usize)),
            _ => Mover::Fetch(match landing.take() {
                Some(b) if b.len() as u64 >= span => b,
                _ => bc.buffer(span as usize).await?,
            }),
        };
        // the pattern every fetched message must hold (with --validate)
        let check = p.validate.then(|| &pat[..size as usize]);
        // One untimed span first, as the direct path sets its QPs and MRs up before its clock
        // starts: it creates the bridge client's QP and staging buffers and fills the server's
        // staging ring, so the timed loop measures transfers only. (The server writes the
        // pattern only once told to run: nothing is checked here.)
        (mover, _, _) = mover
            .call(&mut bc, &r, size, per_span, span, None, &mut |_| {})
            .await?;
        c.send(&Msg::Run { size }).await?;
        let Msg::Go = c.recv().await? else {
            return Err(BenchError::Control("expected go".into()));
        };
        let start = Instant::now();
        let deadline = p.duration.map(|d| start + Duration::from_secs_f64(d));
        let limit = p.iters.unwrap_or(u64::MAX);
        // a put moves one span per call; a fetch several spans of the region in one batch,
        // landing on each other in the buffer (one span with --validate, so that every
        // fetched message is checked, none overwritten by a later span first)
        let per_call = if p.op == BenchOp::Write || p.validate {
            per_span
        } else {
            per_span * (FETCH_CALL / span).max(1)
        };
        let (mut n, mut peak, mut lent) = (0u64, 0.0f64, 0u64);
        // every message the timed calls moved (`n` becomes those inside the window below)
        let mut all = 0u64;
        let mut fetched_ok = true;
        let window = Window::of(p.duration, p.margin);
        let mut clock = ByteClock::default();
        while n < limit && deadline.is_none_or(|d| Instant::now() < d) {
            // the last call of an --iters run moves only the messages left
            let msgs = per_call.min(limit - n);
            let t = Instant::now();
            let mut before = 0u64;
            let mut landed = |done: u64| {
                if let Some(w) = &window {
                    clock.landed(w, start.elapsed().as_secs_f64(), done - before);
                }
                before = done;
            };
            let (ok, zero_copy);
            (mover, ok, zero_copy) = mover
                .call(&mut bc, &r, size, msgs, span, check, &mut landed)
                .await?;
            fetched_ok &= ok;
            lent += zero_copy;
            let dt = t.elapsed().as_secs_f64();
            if dt > 0.0 {
                peak = peak.max((msgs * size) as f64 / dt / (1 << 20) as f64);
            }
            n += msgs;
            all += msgs;
        }
        let (n, seconds) = match window {
            // the messages that landed inside the window, over its length (none did, a run
            // slower than one message per window: the whole run, ramp-up included)
            Some(w) if clock.bytes() >= size => (clock.bytes() / size, w.seconds()),
            _ => (n, start.elapsed().as_secs_f64()),
        };
        c.send(&Msg::Done { size }).await?;
        let Msg::Stats { validated, .. } = c.recv().await? else {
            return Err(BenchError::Control("expected stats".into()));
        };
        let validated = if p.validate {
            Some(validated.unwrap_or(true) && fetched_ok)
        } else {
            None
        };
        if let Mover::Fetch(b) = mover {
            landing = Some(b);
        }
        let mut res = result(p, size, n, seconds, peak, path, strategy, validated);
        // (of every byte the timed calls moved, the window's calls and the others alike)
        let moved = all * size;
        res.lent_fraction = (moved > 0).then(|| lent as f64 / moved as f64);
        each(&res);
        out.push(res);
    }
    bc.bye().await?;
    c.send(&Msg::Bye).await?;
    Ok(out)
}

/// What the calls of one size move: puts of the pattern (a span of it), or fetches landing in
/// one registered buffer of at least a span.
enum Mover {
    Put(Vec<u8>),
    Fetch(bridge::LocalBuffer),
}

impl Mover {
    /// Move `msgs` messages of `size`: a put of the first `msgs` of the pattern (at most one
    /// span), or a fetch of `msgs` messages in spans of the region, every span landing at the
    /// start of the buffer. Returns the mover for the next call, whether every fetched
    /// message held `check` (true without one; a fetch losing its buffer ends the run) and
    /// the bytes the server's NIC moved without a copy (lent chunks). `progress` hears the
    /// bytes of the call landed (put: acknowledged) so far, each time a piece lands.
    #[allow(clippy::too_many_arguments)]
    async fn call(
        self,
        bc: &mut bridge::Client,
        r: &bridge::OpenRegion,
        size: u64,
        msgs: u64,
        span: u64,
        check: Option<&[u8]>,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(Mover, bool, u64)> {
        let bytes = msgs * size;
        let buf = match self {
            Mover::Put(data) => {
                let mut cur = std::io::Cursor::new(&data[..bytes as usize]);
                let rep = bc.put(r, 0, &mut cur, Some(bytes), false, progress).await?;
                return Ok((Mover::Put(data), true, rep.zero_copy_bytes));
            }
            Mover::Fetch(buf) => buf,
        };
        let mut ranges = Vec::new();
        let mut left = bytes;
        while left > 0 {
            let len = left.min(span);
            ranges.push(bridge::BatchRange {
                region: r,
                offset: 0,
                len,
                at: 0,
            });
            left -= len;
        }
        let landed = bc
            .fetch_many_with_progress(&ranges, buf, progress)
            .await
            .map_err(|s| BenchError::Bridge(s.error))?;
        for res in landed.results {
            res?;
        }
        let ok = check.is_none_or(|pat| {
            landed.buffer.as_slice()[..bytes.min(span) as usize]
                .chunks(size as usize)
                .all(|m| m == pat)
        });
        Ok((Mover::Fetch(landed.buffer), ok, landed.zero_copy_bytes))
    }
}
