//! Waiting for a run's work requests off the runtime's workers. A latency run waits on a
//! thread of its own: it sleeps on the completion channel between polls, as perftest's
//! `--use_event` loop ([`Settle::Block`]), or with `--poll` spins without yielding
//! ([`Settle::Spin`]). Polled bandwidth lanes and SEND receivers spin together on one thread
//! of their own ([`spin_together`]); event-driven ones await on the runtime. Yielding to the
//! multi-threaded runtime between polls costs a scheduler pass (and often an `epoll_wait`) per
//! poll and lets the loop migrate between worker threads; in one lab guest of two CPUs, where
//! rxe's own work needs the CPUs too, that halved a polled 64 KiB SEND run against
//! ib_send_bw. Awaiting each completion of a latency run on the runtime woke two threads per
//! message and cost the client about 1.5 times the CPU per READ of sleeping on the channel.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use verbs::{AfterPoll, Local, Pending, PendingRecv, PreparedSend, RecvInfo};

use super::{BenchError, Result};

/// How long a latency run waits for a completion before it gives up on the peer.
const QUIET_LIMIT: Duration = Duration::from_secs(10);

/// Polls between two reads of the clock and the stop flag (a clock read is a syscall under
/// some emulators).
const POLLS_PER_CHECK: u32 = 64;

/// How the waits of one latency run are done, on a thread of the run's own (see
/// [`on_own_thread`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Settle<'a> {
    /// Sleep on the completion channel between polls ([`verbs::Pending::sleep_until_event`]),
    /// as perftest's `--use_event` loop sleeps in `ibv_get_cq_event`.
    Block,
    /// Busy-poll.
    Spin { stop: &'a AtomicBool },
}

/// Work requests in flight that a latency loop waits for.
pub(super) trait Waitable: Sized + Send {
    /// What their completion hands back.
    type Out: Send;
    /// Poll once: whether all have completed.
    fn poll_ready(&self) -> verbs::Result<bool>;
    /// The results, once complete.
    fn into_ready(self) -> verbs::Result<Self::Out>;
    /// Sleep until the CQ raises an event, unless all have completed already.
    fn sleep_until_event(&self, deadline: Instant) -> verbs::Result<()>;
    /// Sleep on the completion channel until all have completed; their results.
    fn wait_blocking(self, deadline: Instant) -> verbs::Result<Self::Out>;
    /// Poll once, and post `next` at once if all have completed.
    fn post_after(&self, next: PreparedSend) -> verbs::Result<AfterPoll>;
}

impl Waitable for Pending {
    type Out = Vec<Local>;
    fn poll_ready(&self) -> verbs::Result<bool> {
        Pending::poll_ready(self)
    }
    fn into_ready(self) -> verbs::Result<Self::Out> {
        Pending::into_ready(self)
    }
    fn sleep_until_event(&self, deadline: Instant) -> verbs::Result<()> {
        Pending::sleep_until_event(self, deadline)
    }
    fn wait_blocking(self, deadline: Instant) -> verbs::Result<Self::Out> {
        Pending::wait_blocking(self, deadline)
    }
    fn post_after(&self, next: PreparedSend) -> verbs::Result<AfterPoll> {
        next.post_after(self)
    }
}

impl Waitable for PendingRecv {
    type Out = Vec<(Local, RecvInfo)>;
    fn poll_ready(&self) -> verbs::Result<bool> {
        PendingRecv::poll_ready(self)
    }
    fn into_ready(self) -> verbs::Result<Self::Out> {
        PendingRecv::into_ready(self)
    }
    fn sleep_until_event(&self, deadline: Instant) -> verbs::Result<()> {
        PendingRecv::sleep_until_event(self, deadline)
    }
    fn wait_blocking(self, deadline: Instant) -> verbs::Result<Self::Out> {
        PendingRecv::wait_blocking(self, deadline)
    }
    fn post_after(&self, next: PreparedSend) -> verbs::Result<AfterPoll> {
        next.post_after_recv(self)
    }
}

/// What a wait with a prepared successor gave: the results, the successor's post (when one was
/// given), and the time just after its doorbell (or just after the completion was seen).
pub(super) type Settled<O> = (O, Option<Pending>, Instant);

impl Settle<'_> {
    /// The results, or `None` once the stop flag is set.
    pub(super) async fn settle<W: Waitable>(self, w: W) -> Result<Option<W::Out>> {
        Ok(self.then(w, None).await?.map(|(out, ..)| out))
    }

    /// Wait for `w` and post `next` (when given) as soon as `w` has completed: only the poll
    /// that sees the completion stands before `next`'s doorbell; the completions are handed
    /// out and `w`'s results taken after it. `None` once the stop flag of a spinning run is
    /// set (then `next` is dropped, not posted).
    pub(super) async fn then<W: Waitable>(
        self,
        w: W,
        next: Option<PreparedSend>,
    ) -> Result<Option<Settled<W::Out>>> {
        match self {
            Settle::Block => {
                let deadline = Instant::now() + QUIET_LIMIT;
                // past the deadline the sleep's ETIMEDOUT says the peer went quiet
                let quiet_past = |e: verbs::Error| {
                    if Instant::now() >= deadline {
                        quiet()
                    } else {
                        e.into()
                    }
                };
                let Some(mut next) = next else {
                    let out = w.wait_blocking(deadline).map_err(quiet_past)?;
                    return Ok(Some((out, None, Instant::now())));
                };
                let sent = loop {
                    match w.post_after(next)? {
                        AfterPoll::Posted(sent) => break sent,
                        AfterPoll::NotYet(back) => {
                            next = back;
                            w.sleep_until_event(deadline).map_err(quiet_past)?;
                        }
                    }
                };
                let at = Instant::now();
                Ok(Some((w.into_ready()?, Some(sent), at)))
            }
            Settle::Spin { stop } => {
                let posted = match next {
                    None => {
                        let seen = spin(|| Ok(w.poll_ready()?.then_some(())), stop)?;
                        if seen.is_none() {
                            return Ok(None);
                        }
                        None
                    }
                    Some(next) => {
                        let mut next = Some(next);
                        let posted = spin(
                            || {
                                let p = next.take().ok_or_else(|| {
                                    verbs::Error::InvalidArgument("a prepared send was lost".into())
                                })?;
                                Ok(match w.post_after(p)? {
                                    AfterPoll::Posted(sent) => Some(sent),
                                    AfterPoll::NotYet(back) => {
                                        next = Some(back);
                                        None
                                    }
                                })
                            },
                            stop,
                        )?;
                        match posted {
                            Some(sent) => Some(sent),
                            None => return Ok(None),
                        }
                    }
                };
                let at = Instant::now();
                Ok(Some((w.into_ready()?, posted, at)))
            }
        }
    }
}

fn quiet() -> BenchError {
    BenchError::Control(format!(
        "no completion in {} s: the peer stopped answering",
        QUIET_LIMIT.as_secs()
    ))
}

/// Call `attempt` until it gives a value (returned), `stop` is set (`None`) or [`QUIET_LIMIT`]
/// passes.
pub(super) fn spin<T>(
    attempt: impl FnMut() -> verbs::Result<Option<T>>,
    stop: &AtomicBool,
) -> Result<Option<T>> {
    // no `pause` between polls (perftest's loops have none either): under TCG it leaves the
    // translated code for QEMU's main loop, a detour that the completion can land in. Nor a
    // `sched_yield`, which bandwidth waits make (`CqMode::Polling`): made every 64 polls, it
    // left a polled WRITE ping-pong in one lab guest of two CPUs at 0.61 of ib_write_lat,
    // against 0.99 without it in the next boot
    attempt_until(attempt, stop, POLLS_PER_CHECK, || Ok(()))
}

/// How long [`block`] sleeps on the completion channel at most before it looks at its
/// attempt and the stop flag again.
const SLICE: Duration = Duration::from_millis(50);

/// As [`spin`], but sleeping on `w`'s completion channel between attempts (its CQ in
/// `CqMode::Blocking`), in slices of at most [`SLICE`]: an attempt that waits for something
/// other than a completion (a run's size) and the stop flag are looked at between them.
pub(super) fn block<T, W: Waitable>(
    w: &W,
    attempt: impl FnMut() -> verbs::Result<Option<T>>,
    stop: &AtomicBool,
) -> Result<Option<T>> {
    attempt_until(attempt, stop, 1, || {
        let until = Instant::now() + SLICE;
        match w.sleep_until_event(until) {
            Ok(()) => Ok(()),
            // the slice ended with no event (ETIMEDOUT)
            Err(_) if Instant::now() >= until => Ok(()),
            Err(e) => Err(e.into()),
        }
    })
}

/// `attempts` calls of `attempt`, then a look at `stop` and the quiet limit, then `between`,
/// until `attempt` gives a value.
fn attempt_until<T>(
    mut attempt: impl FnMut() -> verbs::Result<Option<T>>,
    stop: &AtomicBool,
    attempts: u32,
    mut between: impl FnMut() -> Result<()>,
) -> Result<Option<T>> {
    let start = Instant::now();
    loop {
        for _ in 0..attempts {
            if let Some(v) = attempt()? {
                return Ok(Some(v));
            }
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        if start.elapsed() > QUIET_LIMIT {
            return Err(quiet());
        }
        between()?;
    }
}

/// Run `f` to completion on a thread of its own, outside the runtime's workers, so that a
/// [`Settle::Spin`] inside it spins without starving other tasks.
pub(super) async fn on_own_thread<T, F>(f: F) -> Result<T>
where
    F: Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let rt = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || rt.block_on(f))
        .await
        .map_err(|e| BenchError::Control(format!("the latency thread ended abnormally: {e}")))?
}

/// A task of [`spin_together`].
pub(super) type SpinTask<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// Run `tasks` together on a thread of their own, on a single-threaded runtime with no I/O
/// driver: the busy-polled waits inside them (`CqMode::Polling`) yield to one another there
/// without an `epoll_wait` and without hopping between worker threads (each poll that did not
/// complete what it waits for gives way to the kernel's runnable work first, one
/// `sched_yield`), and one thread spins for all
/// of them, as perftest polls all its QPs from one thread. Their results, in no set order;
/// the first error ends the rest.
pub(super) async fn spin_together<T: Send + 'static>(tasks: Vec<SpinTask<T>>) -> Result<Vec<T>> {
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| BenchError::Control(format!("the polling thread's runtime: {e}")))?;
        rt.block_on(join_all(tasks))
    })
    .await
    .map_err(|e| BenchError::Control(format!("the polling thread ended abnormally: {e}")))?
}

/// Run `tasks` at once on the current runtime: their results, in no set order; the first
/// error ends the rest.
pub(super) async fn join_all<T: Send + 'static>(tasks: Vec<SpinTask<T>>) -> Result<Vec<T>> {
    let mut set = tokio::task::JoinSet::new();
    for t in tasks {
        set.spawn(t);
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        out.push(
            r.map_err(|e| BenchError::Control(format!("a QP's loop ended abnormally: {e}")))??,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn spin_returns_when_ready_and_when_stopped() {
        let n = Cell::new(0);
        let never = AtomicBool::new(false);
        let ready = || {
            n.set(n.get() + 1);
            Ok((n.get() == 200).then_some(n.get()))
        };
        assert_eq!(spin(ready, &never).unwrap(), Some(200));
        assert_eq!(n.get(), 200, "polled until ready, not beyond");

        let stopped = AtomicBool::new(true);
        assert!(spin(|| Ok(None::<()>), &stopped).unwrap().is_none());
    }

    #[tokio::test]
    async fn tasks_spun_together_all_finish_and_errors_pass_on() {
        // two tasks that can only finish together: each yields until the other has started,
        // which a single thread can do only if their yields hand over to one another
        let flags = std::sync::Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);
        let task = |me: usize| -> SpinTask<usize> {
            let flags = std::sync::Arc::clone(&flags);
            Box::pin(async move {
                flags[me].store(true, Ordering::SeqCst);
                while !flags[1 - me].load(Ordering::SeqCst) {
                    tokio::task::yield_now().await;
                }
                Ok(me)
            })
        };
        let mut got = spin_together(vec![task(0), task(1)]).await.unwrap();
        got.sort();
        assert_eq!(got, [0, 1]);
        let failing: SpinTask<()> =
            Box::pin(async { Err(BenchError::Control("lane failed".into())) });
        let e = spin_together(vec![failing]).await.unwrap_err();
        assert!(e.to_string().contains("lane failed"), "{e}");
    }

    #[test]
    fn spin_passes_a_poll_error_on() {
        let never = AtomicBool::new(false);
        let err = spin(
            || Err::<Option<()>, _>(verbs::Error::InvalidArgument("cq gone".into())),
            &never,
        )
        .unwrap_err();
        assert!(err.to_string().contains("cq gone"), "{err}");
    }
}
