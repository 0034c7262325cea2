//! Waiting for a latency run's work requests: awaited on the runtime (completion events), or,
//! with `--poll`, busy-polled on a thread of the run's own without yielding, as perftest's
//! latency tools poll. Yielding to the runtime between polls costs a scheduler pass (and often
//! an `epoll_wait`) per poll and lets the ping-pong migrate between worker threads; a
//! dedicated spinning thread does neither.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use verbs::{Local, Pending, PendingRecv, RecvInfo};

use super::{BenchError, Result};

/// How long a latency run waits for a completion before it gives up on the peer.
const QUIET_LIMIT: Duration = Duration::from_secs(10);

/// Polls between two reads of the clock and the stop flag (a clock read is a syscall under
/// some emulators).
const POLLS_PER_CHECK: u32 = 64;

/// How the waits of one latency run are done.
#[derive(Debug, Clone, Copy)]
pub(super) enum Settle<'a> {
    /// Await on the runtime.
    Events,
    /// Busy-poll on the calling thread, which must be one of the run's own (see [`on_own_thread`]).
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
    /// Await the results.
    fn wait(self) -> impl Future<Output = verbs::Result<Self::Out>> + Send;
}

impl Waitable for Pending {
    type Out = Vec<Local>;
    fn poll_ready(&self) -> verbs::Result<bool> {
        Pending::poll_ready(self)
    }
    fn into_ready(self) -> verbs::Result<Self::Out> {
        Pending::into_ready(self)
    }
    fn wait(self) -> impl Future<Output = verbs::Result<Self::Out>> + Send {
        Pending::wait(self)
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
    fn wait(self) -> impl Future<Output = verbs::Result<Self::Out>> + Send {
        PendingRecv::wait(self)
    }
}

impl Settle<'_> {
    /// The results, or `None` once the stop flag is set.
    pub(super) async fn settle<W: Waitable>(self, w: W) -> Result<Option<W::Out>> {
        Ok(self.then(w, || Ok(())).await?.map(|(out, ())| out))
    }

    /// Wait for `w`, then call `next`, and return both results. When spinning, `next` runs as
    /// soon as the completion is seen and before its results are taken (the next post goes
    /// out first, the bookkeeping follows). `None` once the stop flag is set (then `next` is
    /// not called).
    pub(super) async fn then<W: Waitable, N>(
        self,
        w: W,
        next: impl FnOnce() -> Result<N>,
    ) -> Result<Option<(W::Out, N)>> {
        match self {
            Settle::Events => {
                let out = bounded(w.wait()).await??;
                let n = next()?;
                Ok(Some((out, n)))
            }
            Settle::Spin { stop } => {
                if !spin(|| w.poll_ready(), stop)? {
                    return Ok(None);
                }
                let n = next()?;
                Ok(Some((w.into_ready()?, n)))
            }
        }
    }
}

async fn bounded<T>(f: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(QUIET_LIMIT, f)
        .await
        .map_err(|_| quiet())
}

fn quiet() -> BenchError {
    BenchError::Control(format!(
        "no completion in {} s: the peer stopped answering",
        QUIET_LIMIT.as_secs()
    ))
}

/// Poll until `ready` says true (true returned), `stop` is set (false) or [`QUIET_LIMIT`] passes.
fn spin(ready: impl Fn() -> verbs::Result<bool>, stop: &AtomicBool) -> Result<bool> {
    let start = Instant::now();
    loop {
        for _ in 0..POLLS_PER_CHECK {
            if ready()? {
                return Ok(true);
            }
            std::hint::spin_loop();
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        if start.elapsed() > QUIET_LIMIT {
            return Err(quiet());
        }
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
            Ok(n.get() == 200)
        };
        assert!(spin(ready, &never).unwrap());
        assert_eq!(n.get(), 200, "polled until ready, not beyond");

        let stopped = AtomicBool::new(true);
        assert!(!spin(|| Ok(false), &stopped).unwrap());
    }

    #[test]
    fn spin_passes_a_poll_error_on() {
        let never = AtomicBool::new(false);
        let err = spin(
            || Err(verbs::Error::InvalidArgument("cq gone".into())),
            &never,
        )
        .unwrap_err();
        assert!(err.to_string().contains("cq gone"), "{err}");
    }
}
