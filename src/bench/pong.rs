//! The server's half of a ping-pong (`bench write|send --lat`): a partner that waits for each
//! ping on a thread of its own, busy-polling (`--poll`) or sleeping on the completion channel
//! between polls, and answers with a pong written into the send queue ahead of time and
//! posted by the very poll that sees the ping land
//! ([`verbs::PreparedSend::post_after_recv`]), as the client posts its pings.
//!
//! A pong has its ping's size, which changes from one run to the next, so a pong prepared
//! ahead must be of the size of the run under way. The control loop announces each run's size
//! before it lets the client start ([`RunSize::announce`]); the partner takes it between two
//! polls, prepares its next pong of that size and says so; only then is the client told to go.
//! So no ping of a run meets a pong prepared for the run before.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use verbs::{
    Access, AfterPoll, HostBuffer, Local, Pending, PendingRecv, PreparedSend, ProtectionDomain,
    QueuePair, RegMode, RegisteredBuffer, SendOp, SendWr,
};

use super::control::Keys;
use super::settle::{self, Settle};
use super::{BenchError, BenchOp, Result};

/// How long the control loop waits for the partner to take a run's size.
const TAKE_LIMIT: Duration = Duration::from_secs(5);

/// A run's size, from the control loop to the partner (0: none yet).
#[derive(Debug, Default)]
pub(super) struct RunSize {
    announced: AtomicUsize,
    taken: AtomicUsize,
}

impl RunSize {
    /// Announce the next run's message size and wait until the partner has taken it (its next
    /// pong is prepared with that size).
    pub(super) async fn announce(&self, size: usize) -> Result<()> {
        self.announce_within(size, TAKE_LIMIT).await
    }

    /// The partner's side: the announced size (at most `max`), with `held` a pong of that size
    /// whenever it is not 0; the size is marked taken once its pong is prepared.
    fn hold(
        &self,
        held: &mut Option<(usize, PreparedSend)>,
        max: usize,
        pongs: &Pongs,
        qp: &QueuePair,
    ) -> verbs::Result<usize> {
        let want = self.announced.load(Ordering::Acquire).min(max);
        if want != 0 && held.as_ref().map(|(m, _)| *m) != Some(want) {
            // (a prepared send holds the send queue: gone before the next is made)
            *held = None;
            *held = Some((want, pongs.prepare(qp, want)?));
            self.taken.store(want, Ordering::Release);
        }
        Ok(want)
    }

    async fn announce_within(&self, size: usize, limit: Duration) -> Result<()> {
        self.announced.store(size, Ordering::Release);
        let deadline = Instant::now() + limit;
        while self.taken.load(Ordering::Acquire) != size {
            if Instant::now() > deadline {
                return Err(BenchError::Control(format!(
                    "the latency partner did not take the run's size ({size} bytes) in {} ms",
                    limit.as_millis()
                )));
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        Ok(())
    }
}

/// Every byte of a pong, and of a polled ping: the receiver sees a message land when the
/// last byte of its landing buffer turns from 0 to this.
pub(super) const PONG_BYTE: u8 = 0xa5;

/// What the partner answers with.
pub(super) struct Pongs {
    pub(super) op: BenchOp,
    /// WRITEs without immediate data (the client polls its memory for them).
    pub(super) plain_write: bool,
    /// The client's memory (a WRITE with immediate lands there).
    pub(super) client: Keys,
    /// The bytes of a pong (local access only).
    pub(super) source: Arc<RegisteredBuffer>,
    /// Pongs up to this size go inline and ask for no completion of their own.
    pub(super) inline: usize,
}

impl Pongs {
    /// A pong of `n` bytes, written into `qp`'s send queue.
    pub(super) fn prepare(&self, qp: &QueuePair, n: usize) -> verbs::Result<PreparedSend> {
        let op = match self.op {
            BenchOp::Write if self.plain_write => SendOp::Write(self.client.slice(n as u64)),
            BenchOp::Write => SendOp::WriteImm(self.client.slice(n as u64), 0),
            _ => SendOp::Send,
        };
        prepare_message(qp, op, &self.source, n, n <= self.inline)
    }
}

/// The first `n` bytes of `source` as one `op`, written into `qp`'s send queue. Inline, the
/// bytes are copied into the work request, which asks for no completion of its own (a later
/// signaled one retires it); otherwise the buffer is shared and the work request signaled.
pub(super) fn prepare_message(
    qp: &QueuePair,
    op: SendOp,
    source: &Arc<RegisteredBuffer>,
    n: usize,
    inline: bool,
) -> verbs::Result<PreparedSend> {
    if inline {
        let local = Local::inline(&source.as_slice()[..n]);
        qp.prepare_send_deferred(vec![SendWr { op, local }])
    } else {
        let local = Local::shared(Arc::clone(source), 0..n)?;
        qp.prepare_send(vec![SendWr { op, local }])
    }
}

/// A buffer a polled WRITE ping-pong's messages land in, read by the side that owns it.
pub(super) fn landing(pd: &ProtectionDomain, len: usize) -> Result<RegisteredBuffer> {
    Ok(pd.register(
        HostBuffer::new(len)?,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        RegMode::Pinned,
    )?)
}

/// Where a polled partner's pings arrive.
pub(super) enum Pings {
    /// Plain WRITEs into this buffer ([`answer_in_memory`]).
    InMemory(RegisteredBuffer),
    /// SENDs or WRITEs with immediate data, into these posted receives ([`answer`]).
    Received(VecDeque<PendingRecv>),
}

/// Answer pings until `stop` is set (or the client goes quiet) on the calling thread,
/// busy-polling (`poll`) or sleeping on the completion channel between polls; counts them in
/// `received`. Pings in memory (plain WRITEs: a polled run's only) are seen by polling it.
pub(super) async fn partner(
    qp: &QueuePair,
    pings: Pings,
    pongs: &Pongs,
    run: &RunSize,
    stop: &AtomicBool,
    received: &AtomicU64,
    poll: bool,
) -> Result<()> {
    let wait = if poll {
        Settle::Spin { stop }
    } else {
        Settle::Block
    };
    match pings {
        Pings::InMemory(landing) => answer_in_memory(qp, landing, pongs, run, stop, received).await,
        Pings::Received(slots) => answer(qp, slots, pongs, run, stop, received, wait).await,
    }
}

/// Answer pings on `qp` until `stop` is set (or the client goes quiet), waiting as `wait`
/// says: the receives in `slots` are re-posted as they are used. Counts the pings in
/// `received`.
async fn answer(
    qp: &QueuePair,
    mut slots: VecDeque<PendingRecv>,
    pongs: &Pongs,
    run: &RunSize,
    stop: &AtomicBool,
    received: &AtomicU64,
    wait: Settle<'_>,
) -> Result<()> {
    let pong_max = pongs.source.len();
    let mut held: Option<(usize, PreparedSend)> = None;
    while let Some(front) = slots.pop_front() {
        let attempt = || {
            run.hold(&mut held, pong_max, pongs, qp)?;
            match held.take() {
                Some((m, prepared)) => Ok(match prepared.post_after_recv(&front)? {
                    AfterPoll::Posted(sent) => Some(Some((m, sent))),
                    AfterPoll::NotYet(back) => {
                        held = Some((m, back));
                        None
                    }
                }),
                None => Ok(front.poll_ready()?.then_some(None)),
            }
        };
        let seen = match wait {
            Settle::Spin { .. } => settle::spin(attempt, stop),
            Settle::Block => settle::block(&front, attempt, stop),
        };
        let sent: Option<(usize, Pending)> = match seen {
            Ok(Some(sent)) => sent,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "latency partner stops");
                break;
            }
        };
        let Some((local, info)) = front.into_ready()?.pop() else {
            break;
        };
        let n = (info.byte_len as usize).min(pong_max);
        let (m, sent) = match sent {
            Some((m, sent)) => (m, sent),
            // no run announced (a client of another protocol): answered after the fact
            None => (n, pongs.prepare(qp, n)?.post()?),
        };
        if m != n {
            tracing::debug!(ping = n, pong = m, "a ping of another size than its run's");
        }
        received.fetch_add(1, Ordering::Relaxed);
        let Some(buf) = local.into_owned() else { break };
        slots.push_back(qp.post_recv(vec![Local::owned(buf)])?);
        if m > pongs.inline {
            // a larger pong's buffer is shared and its completion awaited (a small one is
            // inline and asked for none: a later signaled one retires it)
            if wait.settle(sent).await?.is_none() {
                break;
            }
        }
    }
    Ok(())
}

/// Answer pings that land in `landing` (plain WRITEs) with pongs written into the client's
/// memory, as `ib_write_lat` does: the partner busy-reads the last byte of the run's message
/// size until it turns non-zero, clears it (before the pong goes out, so that the next ping
/// cannot land first), and posts the pong prepared for the run. No receive and no completion
/// is on that path; the send completions are drained between rounds.
async fn answer_in_memory(
    qp: &QueuePair,
    mut landing: RegisteredBuffer,
    pongs: &Pongs,
    run: &RunSize,
    stop: &AtomicBool,
    received: &AtomicU64,
) -> Result<()> {
    let max = landing.len().min(pongs.source.len());
    let mut held: Option<(usize, PreparedSend)> = None;
    // the size whose marker byte was cleared (when the run was announced)
    let mut cleared = 0;
    loop {
        let seen = settle::spin(
            || {
                let want = run.announced.load(Ordering::Acquire).min(max);
                if want != 0 && want != cleared {
                    // the client has not started this run (the size is not taken yet): its
                    // marker byte is cleared first
                    landing.write_at(want - 1, &[0])?;
                    cleared = want;
                    tracing::debug!(size = want, "latency partner: run announced");
                }
                run.hold(&mut held, max, pongs, qp)?;
                let Some((m, _)) = &held else { return Ok(None) };
                let m = *m;
                if landing.load_byte(m - 1)? == 0 {
                    return Ok(None);
                }
                landing.write_at(m - 1, &[0])?;
                let Some((_, prepared)) = held.take() else {
                    return Ok(None);
                };
                Ok(Some((m, prepared.post()?)))
            },
            stop,
        );
        let (m, sent) = match seen {
            Ok(Some(sent)) => sent,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "latency partner stops");
                break;
            }
        };
        received.fetch_add(1, Ordering::Relaxed);
        if m > pongs.inline {
            // a larger pong's buffer is shared and its completion awaited
            if (Settle::Spin { stop }).settle(sent).await?.is_none() {
                break;
            }
        } else {
            // an inline pong asked for no completion; this drains the signaled ones that
            // retire them, so that the send queue never fills
            sent.poll_ready()?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_run_starts_once_the_partner_took_its_size() {
        let run = Arc::new(RunSize::default());
        let partner = {
            let run = Arc::clone(&run);
            std::thread::spawn(move || {
                // the partner takes what is announced between two polls
                while run.announced.load(Ordering::Acquire) != 4096 {
                    std::thread::yield_now();
                }
                run.taken.store(4096, Ordering::Release);
            })
        };
        run.announce(4096).await.unwrap();
        partner.join().unwrap();
        assert_eq!(run.taken.load(Ordering::Acquire), 4096);
    }

    #[tokio::test]
    async fn a_partner_that_never_takes_the_size_is_an_error() {
        let run = RunSize::default();
        run.taken.store(2, Ordering::Release);
        let e = run
            .announce_within(8, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("did not take the run's size (8 bytes)"),
            "{e}"
        );
    }
}
