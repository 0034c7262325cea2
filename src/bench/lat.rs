//! The latency loop of the client: one RDMA READ at a time, or a ping-pong of WRITEs with
//! immediate data or SENDs, timed the way perftest's `ib_*_lat` time it.
//!
//! A sample is the time from one post to the next (halved for a ping-pong, whose round trip is
//! two messages), read just after each doorbell so that no clock read stands between seeing a
//! completion and the next doorbell (the deadline of a timed run is checked against the last
//! post's time), and the next post follows the detection of the previous completion at once:
//! the next message is written into the send queue while the last one is in flight
//! ([`verbs::PreparedSend`]), so that seeing a completion leaves only a doorbell to ring, and
//! the bookkeeping of a round (buffers back, receives re-posted, the sample stored) is done
//! while the next message is on the wire. The turnaround matters beyond its own cost on
//! soft-RoCE: rxe runs a QP's protocol work on a kernel worker, and a doorbell rung while that
//! worker is still busy with the previous message is taken up by it, while one rung later
//! queues the work and wakes a worker.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use verbs::{
    Access, HostBuffer, Local, PendingRecv, PreparedSend, QueuePair, RegMode, RegisteredBuffer,
    SendOp, SendWr,
};

use super::control::Keys;
use super::pong::{prepare_message, PONG_BYTE};
use super::settle::{spin, Settle};
use super::{BenchError, BenchOp, BenchParams, Result};

/// Round trips of `n` bytes until `p`'s iteration count or duration; one sample per round trip,
/// in µs (one way for a ping-pong, as perftest reports it). `pongs`: the receives of a
/// ping-pong, kept by the caller from one size to the next (two stay posted).
pub(super) async fn lat_loop(
    qp: &QueuePair,
    src: &Arc<RegisteredBuffer>,
    keys: Keys,
    n: usize,
    p: &BenchParams,
    how: Settle<'_>,
    pongs: &mut VecDeque<PendingRecv>,
) -> Result<Vec<f64>> {
    let op = p.op;
    let more = limit(p);
    let pd = qp.pd().clone();
    let buffer = |len: usize| -> Result<RegisteredBuffer> {
        Ok(pd.register(
            HostBuffer::new(len.max(1))?,
            Access::LOCAL_WRITE,
            RegMode::Pinned,
        )?)
    };
    let mut times = Vec::new();
    if !more(0, Instant::now()) {
        return Ok(times);
    }
    match op {
        BenchOp::Read => {
            // two destinations: the next read is written into the send queue while the last
            // one is in flight, and its buffer comes back while the next one is
            let mut spare = Some(buffer(n)?);
            let read = |buf: RegisteredBuffer| -> Result<PreparedSend> {
                let wr = SendWr {
                    op: SendOp::Read(keys.slice(n as u64)),
                    local: Local::owned_range(buf, 0..n)?,
                };
                Ok(qp.prepare_send(vec![wr])?)
            };
            let mut inflight = read(buffer(n)?)?.post()?;
            let mut posted = Instant::now();
            loop {
                // seeing this read complete leaves only the next one's doorbell to ring
                let next = if more(times.len() + 1, posted) {
                    Some(read(spare.take().ok_or_else(lost)?)?)
                } else {
                    None
                };
                let (done, next, now) = how.then(inflight, next).await?.ok_or_else(lost)?;
                times.push(micros(now - posted));
                posted = now;
                spare = done.into_iter().next().and_then(Local::into_owned);
                match next {
                    Some(n) => inflight = n,
                    None => return Ok(times),
                }
            }
        }
        BenchOp::Write | BenchOp::Send => {
            // the next ping is written into the send queue while the pong is awaited, so
            // that seeing the pong leaves only its doorbell to ring
            let ping = || -> Result<(PreparedSend, bool)> {
                let sop = if op == BenchOp::Write {
                    SendOp::WriteImm(keys.slice(n as u64), 0)
                } else {
                    SendOp::Send
                };
                // small pings go inline, as perftest's (no DMA read of a buffer), and ask for
                // no completion of their own: a later signaled one retires them (the bytes
                // were copied into the work request). A larger ping's buffer is awaited later.
                let inline = p.goes_inline(n);
                Ok((prepare_message(qp, sop, src, n, inline)?, !inline))
            };
            // two receives posted ahead: the pong of the next round always has one waiting,
            // and the last round's buffer is re-posted after the next ping went out. They
            // outlive a size (the caller keeps them for the next one, whose first pong lands
            // in the one left over), so they hold the largest message.
            while pongs.len() < 2 {
                pongs.push_back(qp.post_recv(vec![Local::owned(buffer(p.max_size())?)])?);
            }
            let (first, awaited) = ping()?;
            let first = first.post()?;
            let mut last_ping = awaited.then_some(first);
            let mut posted = Instant::now();
            loop {
                // the next ping goes out as soon as this pong is seen: a round trip ends when
                // the pong lands, as perftest counts it (the ping's own completion, the NIC's
                // acknowledgement, is not part of it)
                let pong = pongs.pop_front().ok_or_else(lost)?;
                let (prepared, awaited) = if more(times.len() + 1, posted) {
                    let (prepared, awaited) = ping()?;
                    (Some(prepared), awaited)
                } else {
                    (None, false)
                };
                let (back, sent, now) = how.then(pong, prepared).await?.ok_or_else(lost)?;
                times.push(micros(now - posted) / 2.0);
                posted = now;
                // a small ping's own completion is not awaited (see `ping`)
                let next = sent.map(|s| awaited.then_some(s));
                let go_on = next.is_some();
                let previous = match next {
                    Some(sent) => std::mem::replace(&mut last_ping, sent),
                    None => last_ping.take(),
                };
                let (l, info) = back.into_iter().next().ok_or_else(lost)?;
                if info.byte_len as usize != n {
                    return Err(BenchError::Control(format!(
                        "the server answered a ping of {n} bytes with a pong of {}",
                        info.byte_len
                    )));
                }
                let buf = l.into_owned().ok_or_else(lost)?;
                pongs.push_back(qp.post_recv(vec![Local::owned(buf)])?);
                if let Some(previous) = previous {
                    how.settle(previous).await?;
                }
                if !go_on {
                    return Ok(times);
                }
            }
        }
    }
}

/// A polled WRITE ping-pong as `ib_write_lat` runs it: plain WRITEs both ways, each side
/// busy-reading the last byte of the message in its own memory (`landing` here; the server's
/// side is [`super::pong::answer_in_memory`]). Seeing that byte turn non-zero, the loop clears it
/// and posts the next ping, prepared while the last was in flight. No receive and no
/// completion is on that path, as in perftest's.
pub(super) async fn lat_in_memory(
    qp: &QueuePair,
    keys: Keys,
    n: usize,
    p: &BenchParams,
    landing: &mut RegisteredBuffer,
    stop: &AtomicBool,
) -> Result<Vec<f64>> {
    let more = limit(p);
    let mut times = Vec::new();
    if n == 0 || !more(0, Instant::now()) {
        return Ok(times);
    }
    // every byte of a ping is non-zero, its last one included
    let mut src = qp
        .pd()
        .register(HostBuffer::new(n)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
    src.as_mut_slice().fill(PONG_BYTE);
    let src = Arc::new(src);
    // (no pong can land before the first ping)
    landing.write_at(n - 1, &[0])?;
    let ping = || -> Result<(PreparedSend, bool)> {
        let op = SendOp::Write(keys.slice(n as u64));
        // small pings go inline and ask for no completion (see `lat_loop`)
        let inline = p.goes_inline(n);
        Ok((prepare_message(qp, op, &src, n, inline)?, !inline))
    };
    let (first, awaited) = ping()?;
    let mut last_ping = Some(first.post()?).filter(|_| awaited);
    let mut posted = Instant::now();
    loop {
        let mut next = if more(times.len() + 1, posted) {
            Some(ping()?)
        } else {
            None
        };
        let sent = spin(
            || {
                if landing.load_byte(n - 1)? == 0 {
                    return Ok(None);
                }
                // cleared before the next ping goes out: its pong cannot land first
                landing.write_at(n - 1, &[0])?;
                let sent = match next.take() {
                    Some((prepared, awaited)) => Some((prepared.post()?, awaited)),
                    None => None,
                };
                Ok(Some(sent))
            },
            stop,
        )?
        .ok_or_else(lost)?;
        let now = Instant::now();
        times.push(micros(now - posted) / 2.0);
        posted = now;
        let Some((sent, awaited)) = sent else {
            if let Some(previous) = last_ping.take() {
                Settle::Spin { stop }.settle(previous).await?;
            }
            return Ok(times);
        };
        if awaited {
            if let Some(previous) = last_ping.replace(sent) {
                Settle::Spin { stop }.settle(previous).await?;
            }
        } else {
            // an inline ping asked for no completion: this drains the signaled ones that
            // retire them, so that the send queue never fills
            sent.poll_ready()?;
        }
    }
}

/// Whether a latency run goes on after `done` round trips, the last posted at `now`.
fn limit(p: &BenchParams) -> impl Fn(usize, Instant) -> bool {
    let rounds = p.iters.unwrap_or(u64::MAX);
    let deadline = p
        .duration
        .map(|d| Instant::now() + Duration::from_secs_f64(d));
    move |done, now| (done as u64) < rounds && deadline.is_none_or(|d| now < d)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn lost() -> BenchError {
    BenchError::Control("a latency round's buffer did not come back".into())
}
