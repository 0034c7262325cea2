//! Completion queues driven by tokio.
//!
//! One CQ serves one QP (send and receive queues). Every posted work request has an entry in
//! the CQ's pending table that owns the local buffer until its completion is polled, so a
//! dropped future never frees memory the NIC may still touch. There is no background task: the
//! futures that wait drive the CQ. In event mode they sleep on the completion channel (the fd is
//! registered with tokio); in polling mode they poll and yield.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue as _};
use smallvec::SmallVec;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use crate::device::{io_of, Context};
use crate::error::{Call, Error, Result, WcStatus};
use crate::local::Local;

/// How completions are waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CqMode {
    /// Sleep on the completion channel: no CPU use while idle (the default).
    #[default]
    Events,
    /// Busy-poll the CQ: lowest latency, one core busy. After a poll that did not complete
    /// what it waits for, the waiter yields to the OS scheduler (`sched_yield`), then to tokio:
    /// work that is runnable on the same CPU (a software RDMA device's kernel workers, which
    /// move this QP's packets) runs at once instead of when the spinning thread's time slice
    /// ends.
    Polling,
    /// Sleep on the completion channel on the thread that waits, with no runtime involved
    /// ([`crate::Pending::sleep_until_event`]): for a loop on a thread of its own. The channel is
    /// not registered with tokio, so no runtime thread wakes with each event; async waits
    /// poll and yield, as in `Polling`.
    Blocking,
}

/// The result of one work request.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) status: WcStatus,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    pub(crate) imm: Option<u32>,
    pub(crate) local: Option<Local>,
}

/// Whether a pending entry sits on the send or the receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Queue {
    Send,
    Recv,
}

#[derive(Debug)]
struct Pending {
    tx: Option<oneshot::Sender<Done>>,
    local: Option<Local>,
    queue: Queue,
    /// Unsignaled work requests posted before this one, which complete when it does.
    covers: Vec<u64>,
}

#[derive(Debug)]
struct Entry {
    /// Which use of the slab slot this is: a completion carrying another generation's wr_id
    /// (a stale or foreign one) never reaches the slot's current work request.
    generation: u32,
    p: Pending,
}

/// The work requests posted and not completed yet. A wr_id is the slab key in its low 32 bits
/// (a queue holds far fewer work requests) and the slot's generation in its high 32 bits.
#[derive(Debug, Default)]
pub(crate) struct CqState {
    pending: slab::Slab<Entry>,
    next_generation: u32,
    pub(crate) send_outstanding: usize,
    pub(crate) recv_outstanding: usize,
    /// Send work requests posted without a completion of their own and not yet covered by a
    /// later signaled one (see [`crate::QueuePair::post_send_deferred`]).
    pub(crate) uncovered: Vec<u64>,
}

impl CqState {
    /// Record a work request about to be posted; returns its wr_id and the receiver of its result.
    pub(crate) fn register(
        &mut self,
        local: Option<Local>,
        queue: Queue,
    ) -> (u64, oneshot::Receiver<Done>) {
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1);
        let (tx, rx) = oneshot::channel();
        let key = self.pending.insert(Entry {
            generation,
            p: Pending {
                tx: Some(tx),
                local,
                queue,
                covers: Vec::new(),
            },
        });
        let wr_id = (u64::from(generation) << 32) | key as u64;
        match queue {
            Queue::Send => self.send_outstanding += 1,
            Queue::Recv => self.recv_outstanding += 1,
        }
        (wr_id, rx)
    }

    /// Give a registered work request its buffer (held until its completion).
    pub(crate) fn attach(&mut self, wr_id: u64, local: Local) {
        if let Some(key) = self.key(wr_id) {
            self.pending[key].p.local = Some(local);
        }
    }

    /// Work request `signaled` is the only signaled one of `covered` and itself: on a send queue
    /// of an RC QP work requests complete in order, so its successful completion completes them
    /// too. (A failure produces a completion for each work request, signaled or not.)
    pub(crate) fn cover(&mut self, signaled: u64, covered: Vec<u64>) {
        if let Some(key) = self.key(signaled) {
            self.pending[key].p.covers = covered;
        }
    }

    /// Forget entries whose post failed (nothing was handed to the device), returning the buffers.
    pub(crate) fn unregister(&mut self, wr_ids: &[u64]) -> Vec<Local> {
        let mut out = Vec::new();
        for &id in wr_ids {
            if let Some(p) = self.take(id) {
                match p.queue {
                    Queue::Send => self.send_outstanding -= 1,
                    Queue::Recv => self.recv_outstanding -= 1,
                }
                out.extend(p.local);
            }
        }
        out
    }

    /// The slab key of a pending work request (None when `wr_id` is unknown or stale).
    fn key(&self, wr_id: u64) -> Option<usize> {
        let key = (wr_id & u64::from(u32::MAX)) as usize;
        let generation = (wr_id >> 32) as u32;
        match self.pending.get(key) {
            Some(e) if e.generation == generation => Some(key),
            _ => None,
        }
    }

    fn take(&mut self, wr_id: u64) -> Option<Pending> {
        self.key(wr_id).map(|k| self.pending.remove(k).p)
    }

    fn complete(&mut self, wr_id: u64, mut done: Done) {
        let Some(mut p) = self.take(wr_id) else {
            tracing::warn!(wr_id, "completion for an unknown work request");
            return;
        };
        // the unsignaled work requests before it are done too (those that failed or were
        // flushed had completions of their own, and are no longer pending)
        for id in std::mem::take(&mut p.covers) {
            if self.key(id).is_some() {
                self.complete(
                    id,
                    Done {
                        status: done.status,
                        vendor_err: done.vendor_err,
                        byte_len: 0,
                        imm: None,
                        local: None,
                    },
                );
            }
        }
        match p.queue {
            Queue::Send => self.send_outstanding -= 1,
            Queue::Recv => self.recv_outstanding -= 1,
        }
        done.local = p.local.take();
        if let Some(tx) = p.tx.take() {
            // the waiter may be gone (future dropped): then the buffer is dropped here, after the
            // device is done with it
            let _ = tx.send(done);
        }
    }
}

/// An fd wrapper that keeps the channel alive as long as tokio has it registered.
#[derive(Debug)]
struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[derive(Debug)]
pub(crate) struct Cq {
    // drop order: the tokio registration first, then the CQ, then the channel it uses
    fd: Option<AsyncFd<ChannelFd>>,
    pub(crate) cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    state: Mutex<CqState>,
    mode: CqMode,
    device: String,
    /// A blocking sleep woke to a readable channel and left the event unread (see
    /// [`Cq::sleep_until_event`]): the next sleep reads it first.
    unread: AtomicBool,
}

impl Cq {
    /// Create a CQ of `depth` entries with its own completion channel. In event mode this must be
    /// called within a tokio runtime (the channel's fd is registered with it).
    pub(crate) fn new(ctx: &Context, depth: u32, mode: CqMode) -> Result<Cq> {
        let device = ctx.name().to_string();
        let channel = CompletionChannel::new(&ctx.inner)
            .map_err(|e| Error::verbs(Call::CreateCompChannel, device.clone(), io_of(&e)))?;
        channel.set_nonblocking(true).map_err(|e| {
            Error::verbs(Call::CreateCompChannel, format!("{device}: O_NONBLOCK"), e)
        })?;
        let mut b = ctx.inner.create_cq_builder();
        b.setup_cqe(depth).setup_comp_channel(&channel, 0);
        let cq = b.build().map_err(|e| {
            Error::verbs(
                Call::CreateCq,
                format!("{device}: {depth} entries"),
                io_of(&e),
            )
        })?;
        let fd = match mode {
            CqMode::Events => {
                if tokio::runtime::Handle::try_current().is_err() {
                    return Err(Error::InvalidArgument(
                        "an event-driven CQ needs a tokio runtime: create the QP inside one, or use CqMode::Polling".into(),
                    ));
                }
                // SAFETY: the fd belongs to `channel`, which `ChannelFd` keeps alive (an `Arc`)
                // for as long as the `AsyncFd` exists, and a channel's fd never changes.
                let reg = unsafe {
                    AsyncFd::register_with_interest(
                        ChannelFd(Arc::clone(&channel)),
                        Interest::READABLE,
                    )
                };
                Some(reg.map_err(|e| {
                    Error::verbs(
                        Call::AsyncFd,
                        format!("{device}: completion channel"),
                        e.into_parts().1,
                    )
                })?)
            }
            CqMode::Polling | CqMode::Blocking => None,
        };
        Ok(Cq {
            fd,
            cq,
            channel,
            state: Mutex::new(CqState::default()),
            mode,
            device,
            unread: AtomicBool::new(false),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, CqState> {
        // a panic while holding the lock leaves consistent counters (no partial updates), so a
        // poisoned lock is still usable
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Poll every available completion and hand each to its waiter. Returns how many.
    pub(crate) fn drain(&self) -> Result<usize> {
        self.drain_with(|_| {})
    }

    /// Poll every available completion, as [`Cq::drain`], and call `first` as soon as a poll
    /// has made every one of `awaited` complete, before the completions of that poll are handed
    /// to their waiters (at once when they already are). `first`'s result, or `None` when they
    /// have not all completed yet. `first` may run under the state lock: it may take the QP's
    /// lock (the order every send path takes them in) but not this state lock.
    pub(crate) fn drain_then<R>(
        &self,
        awaited: &[(u64, oneshot::Receiver<Done>, &'static str)],
        first: impl FnOnce() -> R,
    ) -> Result<Option<R>> {
        let mut missing: SmallVec<[u64; 4]> = awaited
            .iter()
            .filter(|(_, rx, _)| rx.is_empty())
            .map(|(id, ..)| *id)
            .collect();
        if missing.is_empty() {
            return Ok(Some(first()));
        }
        let mut first = Some(first);
        let mut out = None;
        self.drain_with(|batch| {
            if first.is_some() {
                missing.retain(|id| !batch.iter().any(|wc| wc.wr_id == *id));
                if missing.is_empty() {
                    out = first.take().map(|f| f());
                }
            }
        })?;
        Ok(out)
    }

    /// Poll every available completion; each polled batch is shown to `before` and then handed
    /// to the waiters. Returns how many.
    fn drain_with(&self, mut before: impl FnMut(&[crate::ffi::RawWc])) -> Result<usize> {
        let mut state = self.lock();
        let mut n = 0;
        loop {
            let mut batch: SmallVec<[crate::ffi::RawWc; crate::ffi::POLL_BATCH]> = SmallVec::new();
            // SAFETY: the CQ lives as long as `self`, and the state lock held here serialises
            // every poller of this CQ.
            let got = unsafe { crate::ffi::poll_cq(self.cq.cq(), |wc| batch.push(wc)) }
                .map_err(|e| Error::verbs(Call::PollCq, self.device.clone(), e))?;
            if got == 0 {
                return Ok(n);
            }
            before(&batch);
            // (by reference: moving the batch out would copy all its inline room, 1 KiB, on
            // every poll of a busy-polling loop)
            for wc in &batch {
                state.complete(
                    wc.wr_id,
                    Done {
                        status: WcStatus(wc.status),
                        vendor_err: wc.vendor_err,
                        byte_len: wc.byte_len,
                        imm: wc.imm,
                        local: None,
                    },
                );
            }
            n += got;
            if got < crate::ffi::POLL_BATCH {
                return Ok(n);
            }
        }
    }

    /// Wait for the result of one work request, driving the CQ meanwhile.
    pub(crate) async fn wait(&self, mut rx: oneshot::Receiver<Done>) -> Result<Done> {
        loop {
            self.drain()?;
            if let Some(done) = try_take(&mut rx)? {
                return Ok(done);
            }
            match (&self.fd, self.mode) {
                (Some(fd), CqMode::Events) => {
                    self.arm()?;
                    // a completion may have landed between the poll and the arm
                    self.drain()?;
                    if let Some(done) = try_take(&mut rx)? {
                        return Ok(done);
                    }
                    tokio::select! {
                        biased;
                        res = &mut rx => return res.map_err(|_| lost()),
                        ready = fd.readable() => {
                            let mut guard = ready.map_err(|e| Error::verbs(Call::GetCqEvent, self.device.clone(), e))?;
                            if !self.consume_event()? {
                                guard.clear_ready();
                            }
                        }
                    }
                }
                _ => {
                    // a spin that holds its CPU holds up whatever must run there for the
                    // completion to come (rxe's workers): give way to it first; with nothing
                    // else runnable the kernel returns at once
                    std::thread::yield_now();
                    tokio::task::yield_now().await
                }
            }
        }
    }

    /// Sleep on the calling thread until this CQ raises a completion event, as perftest's
    /// `--use_event` loop sleeps in `ibv_get_cq_event`: no runtime between the completion and
    /// the caller, who then polls. `ready` polls the CQ and says whether what the caller waits
    /// for has completed (the caller has just found it not): checked once the CQ is armed,
    /// since a completion that landed before the arm raises no event. The event may be
    /// another waiter's, or one left from an earlier arm: the caller polls, and sleeps again
    /// (arming again) if its work is not done; so does a wake-up by a signal. Past `deadline`,
    /// an `ETIMEDOUT` error. A CQ in polling mode returns at once (the caller's loop polls),
    /// until the deadline.
    ///
    /// The event that ends a sleep is left in the channel and read at the start of the next
    /// sleep (`ibv_get_cq_event` and its ack): the caller polls and rings its next doorbell
    /// first, and the read is done while that request is in flight instead of standing between
    /// the completion and the doorbell. An event left unread is not counted against the CQ:
    /// destroying it does not wait for one.
    pub(crate) fn sleep_until_event(
        &self,
        ready: impl Fn() -> Result<bool>,
        deadline: Instant,
    ) -> Result<()> {
        let timed_out = || {
            Error::errno(
                Call::GetCqEvent,
                format!("{}: no completion event in time", self.device),
                libc::ETIMEDOUT,
            )
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        if self.mode == CqMode::Polling {
            return Ok(());
        }
        // the event that ended the last sleep (or another waiter's: then none is left to read)
        if self.unread.swap(false, Ordering::AcqRel) {
            self.consume_event()?;
        }
        self.arm()?;
        if ready()? {
            return Ok(());
        }
        // rounded up: a wait that ends by its timeout ends past the deadline
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        let readable = crate::ffi::wait_readable(self.channel.as_raw_fd(), ms)
            .map_err(|e| Error::verbs(Call::GetCqEvent, self.device.clone(), e))?;
        if readable {
            // read by the next sleep, after the caller's poll and doorbell
            self.unread.store(true, Ordering::Release);
        } else if Instant::now() >= deadline {
            return Err(timed_out());
        }
        Ok(())
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: the CQ is alive as long as `self`; the pointer is used only during the call.
        let res = unsafe { crate::ffi::req_notify_cq(self.cq.cq()) };
        res.map_err(|e| Error::verbs(Call::ReqNotifyCq, self.device.clone(), e))
    }

    fn consume_event(&self) -> Result<bool> {
        // SAFETY: channel and CQ are alive as long as `self`; the channel fd was set
        // non-blocking at creation, and this CQ is the only one attached to the channel.
        let res =
            unsafe { crate::ffi::get_and_ack_cq_event(self.channel.comp_channel(), self.cq.cq()) };
        res.map_err(|e: io::Error| Error::verbs(Call::GetCqEvent, self.device.clone(), e))
    }
}

fn lost() -> Error {
    Error::InvalidArgument("internal: a work request's completion was lost".into())
}

pub(crate) fn try_take(rx: &mut oneshot::Receiver<Done>) -> Result<Option<Done>> {
    match rx.try_recv() {
        Ok(d) => Ok(Some(d)),
        Err(oneshot::error::TryRecvError::Empty) => Ok(None),
        Err(oneshot::error::TryRecvError::Closed) => Err(lost()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_table_counts_and_returns_buffers() {
        let mut s = CqState::default();
        let (a, mut ra) = s.register(None, Queue::Send);
        let (b, _rb) = s.register(None, Queue::Recv);
        let (c, rc) = s.register(None, Queue::Send);
        assert_eq!((s.send_outstanding, s.recv_outstanding), (2, 1));
        assert_ne!(a, b);
        s.complete(
            a,
            Done {
                status: WcStatus::SUCCESS,
                vendor_err: 0,
                byte_len: 7,
                imm: None,
                local: None,
            },
        );
        assert_eq!(ra.try_recv().unwrap().byte_len, 7);
        // a dropped waiter does not break completion
        drop(rc);
        s.complete(
            c,
            Done {
                status: WcStatus::WR_FLUSH_ERR,
                vendor_err: 0,
                byte_len: 0,
                imm: None,
                local: None,
            },
        );
        assert_eq!(s.send_outstanding, 0);
        assert!(s.unregister(&[b]).is_empty());
        assert_eq!(s.recv_outstanding, 0);
        // unknown ids are ignored
        s.complete(
            999,
            Done {
                status: WcStatus::SUCCESS,
                vendor_err: 0,
                byte_len: 0,
                imm: None,
                local: None,
            },
        );
        assert!(s.pending.is_empty());
    }

    fn ok(byte_len: u32) -> Done {
        Done {
            status: WcStatus::SUCCESS,
            vendor_err: 0,
            byte_len,
            imm: None,
            local: None,
        }
    }

    #[test]
    fn a_signaled_completion_completes_the_unsignaled_ones_before_it() {
        let mut s = CqState::default();
        let mut rx = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..4 {
            let (id, r) = s.register(None, Queue::Send);
            ids.push(id);
            rx.push(r);
        }
        s.cover(ids[3], ids[..3].to_vec());
        s.complete(ids[3], ok(9));
        for r in &mut rx[..3] {
            assert_eq!(r.try_recv().unwrap().status, WcStatus::SUCCESS);
        }
        assert_eq!(rx[3].try_recv().unwrap().byte_len, 9);
        assert_eq!(s.send_outstanding, 0);

        // a failure: each work request has its own completion, in order; the signaled one's
        // flush then covers nothing that is left
        let (a, mut ra) = s.register(None, Queue::Send);
        let (b, mut rb) = s.register(None, Queue::Send);
        s.cover(b, vec![a]);
        let mut err = ok(0);
        err.status = WcStatus::WR_FLUSH_ERR;
        s.complete(a, ok(0).with_status(WcStatus(12)));
        s.complete(b, err);
        assert_eq!(ra.try_recv().unwrap().status, WcStatus(12));
        assert_eq!(rb.try_recv().unwrap().status, WcStatus::WR_FLUSH_ERR);
        assert!(s.pending.is_empty());
    }

    #[test]
    fn a_stale_wr_id_never_reaches_the_work_request_now_in_its_slot() {
        let mut s = CqState::default();
        let (old, _r) = s.register(None, Queue::Send);
        s.complete(old, ok(1));
        // the slot is reused by the next work request, under another generation
        let (new, mut rn) = s.register(None, Queue::Send);
        assert_eq!(old & 0xffff_ffff, new & 0xffff_ffff, "same slab slot");
        assert_ne!(old, new);
        s.complete(old, ok(2));
        s.cover(old, vec![new]);
        assert!(s.unregister(&[old]).is_empty());
        assert!(rn.try_recv().is_err(), "the stale id completed nothing");
        assert_eq!(s.send_outstanding, 1);
        s.complete(new, ok(3));
        assert_eq!(rn.try_recv().unwrap().byte_len, 3);
        assert!(s.pending.is_empty());
    }

    impl Done {
        fn with_status(mut self, s: WcStatus) -> Done {
            self.status = s;
            self
        }
    }
}
