//! Work requests in flight: what the safe API hands back when it posts, to be awaited for the
//! buffers (or dropped, leaving them with the CQ until the device is done with them).

use std::fmt;
use std::future::Future;

use tokio::sync::oneshot;
use tracing::Instrument as _;

use crate::cq::Done;
use crate::error::Result;
use crate::local::Local;
use crate::qp::QueuePair;
use crate::wr::RecvInfo;

/// Send work requests in flight. Await it for the buffers back (in posting order); dropping it
/// leaves the buffers with the CQ until the device is done with them.
#[must_use = "dropping a Pending does not cancel the work requests; await it to learn their outcome"]
pub struct Pending {
    pub(crate) qp: QueuePair,
    pub(crate) rxs: Vec<(u64, oneshot::Receiver<Done>, &'static str)>,
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("qp", &self.qp.qpn())
            .field("wrs", &self.rxs.len())
            .finish()
    }
}

impl Pending {
    /// Number of work requests.
    pub fn len(&self) -> usize {
        self.rxs.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.rxs.is_empty()
    }

    /// One `Pending` per work request, in posting order: a batch posted with one doorbell can
    /// then be awaited work request by work request (to refill a window as soon as a slot
    /// frees).
    pub fn split(self) -> Vec<Pending> {
        let qp = self.qp;
        self.rxs
            .into_iter()
            .map(|rx| Pending {
                qp: qp.clone(),
                rxs: vec![rx],
            })
            .collect()
    }

    /// Wait for all; the first failure is returned (after every work request has completed, so
    /// no buffer is still in use when this returns).
    pub fn wait(self) -> impl Future<Output = Result<Vec<Local>>> + Send {
        let span = self.qp.span();
        async move {
            let done = self.qp.collect(self.rxs).await?;
            Ok(locals(done))
        }
        .instrument(span)
    }
}

impl Pending {
    /// Poll the CQ once, without waiting or yielding: whether every work request has completed
    /// (then [`Pending::into_ready`] returns their results at once). For latency-critical
    /// loops that busy-poll on a thread of their own, as perftest does, and keep their own
    /// deadline; async callers await [`Pending::wait`] instead.
    pub fn poll_ready(&self) -> Result<bool> {
        self.qp.poll_ready(&self.rxs)
    }

    /// The buffers back once [`Pending::poll_ready`] said true; the first failure as in
    /// [`Pending::wait`]. An `InvalidArgument` error if some work request has not completed
    /// (its buffer then stays with the CQ until the device is done with it).
    pub fn into_ready(self) -> Result<Vec<Local>> {
        let _span = self.qp.span().entered();
        let done = self.qp.collect_ready(self.rxs)?;
        Ok(locals(done))
    }
}

impl Pending {
    /// Sleep on the calling thread until the CQ raises a completion event, unless every work
    /// request has completed already; then [`Pending::poll_ready`] (or a post after it) says
    /// whether they have. As perftest's `--use_event` loop, for a latency loop on a thread of
    /// its own that wants nothing between the completion and its next doorbell; async callers
    /// await [`Pending::wait`]. Past `deadline`, an error with `ETIMEDOUT` (the work requests
    /// keep their buffers with the CQ). On a CQ in polling mode it returns at once until then.
    pub fn sleep_until_event(&self, deadline: std::time::Instant) -> Result<()> {
        self.qp.sleep_until_event(&self.rxs, deadline)
    }

    /// Wait for all on the calling thread, sleeping on the completion channel between polls of
    /// the CQ ([`Pending::sleep_until_event`]); the first failure as in [`Pending::wait`], and
    /// past `deadline` an error with `ETIMEDOUT`.
    pub fn wait_blocking(self, deadline: std::time::Instant) -> Result<Vec<Local>> {
        self.qp.sleep_until_done(&self.rxs, deadline)?;
        self.into_ready()
    }
}

impl std::future::IntoFuture for Pending {
    type Output = Result<Vec<Local>>;
    type IntoFuture = std::pin::Pin<Box<dyn Future<Output = Result<Vec<Local>>> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.wait())
    }
}

/// Receives in flight.
#[must_use = "dropping a PendingRecv does not cancel the receives"]
pub struct PendingRecv {
    pub(crate) qp: QueuePair,
    pub(crate) rxs: Vec<(u64, oneshot::Receiver<Done>, &'static str)>,
}

impl fmt::Debug for PendingRecv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingRecv")
            .field("qp", &self.qp.qpn())
            .field("wrs", &self.rxs.len())
            .finish()
    }
}

impl PendingRecv {
    /// Wait for every receive.
    pub async fn wait(self) -> Result<Vec<(Local, RecvInfo)>> {
        let done = self.qp.collect(self.rxs).await?;
        Ok(received(done))
    }
}

fn locals(done: Vec<Done>) -> Vec<Local> {
    done.into_iter().filter_map(|d| d.local).collect()
}

fn received(done: Vec<Done>) -> Vec<(Local, RecvInfo)> {
    done.into_iter()
        .filter_map(|d| {
            let info = RecvInfo {
                byte_len: d.byte_len,
                imm: d.imm,
            };
            d.local.map(|l| (l, info))
        })
        .collect()
}

impl PendingRecv {
    /// Poll the CQ once, without waiting or yielding: whether every receive has completed (see
    /// [`Pending::poll_ready`]).
    pub fn poll_ready(&self) -> Result<bool> {
        self.qp.poll_ready(&self.rxs)
    }

    /// The receives' buffers and results once [`PendingRecv::poll_ready`] said true.
    pub fn into_ready(self) -> Result<Vec<(Local, RecvInfo)>> {
        let _span = self.qp.span().entered();
        let done = self.qp.collect_ready(self.rxs)?;
        Ok(received(done))
    }
}

impl PendingRecv {
    /// Sleep on the calling thread until the CQ raises a completion event, unless every
    /// receive has completed already (see [`Pending::sleep_until_event`]).
    pub fn sleep_until_event(&self, deadline: std::time::Instant) -> Result<()> {
        self.qp.sleep_until_event(&self.rxs, deadline)
    }

    /// Wait for every receive on the calling thread (see [`Pending::wait_blocking`]).
    pub fn wait_blocking(self, deadline: std::time::Instant) -> Result<Vec<(Local, RecvInfo)>> {
        self.qp.sleep_until_done(&self.rxs, deadline)?;
        self.into_ready()
    }
}

impl std::future::IntoFuture for PendingRecv {
    type Output = Result<Vec<(Local, RecvInfo)>>;
    type IntoFuture = std::pin::Pin<Box<dyn Future<Output = Self::Output> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.wait())
    }
}
