//! Posting send work requests: at once (one doorbell per call), or prepared ahead and handed
//! to the device later with a single call ([`PreparedSend`]).
//!
//! This is the hot path of every transfer, and of latency loops that post the next work request
//! as soon as the previous completion is seen: a post allocates only the returned list and each
//! work request's result channel.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::atomic::Ordering;

use sideway::ibverbs::queue_pair::{
    PostSendGuard as _, QueuePair as _, SetInlineData as _, SetScatterGatherEntry as _,
    WorkRequestFlags,
};
use smallvec::SmallVec;
use tokio::sync::oneshot;

use crate::cq::{CqState, Done, Queue};
use crate::device::io_of;
use crate::error::{Call, Error, Result};
use crate::local::Local;
use crate::qp::{Pending, QueuePair};
use crate::wr::{validate, RawData, RawSendWr, SendOp, SendWr, Signal};

type Rxs = Vec<(u64, oneshot::Receiver<Done>, &'static str)>;

/// Whether [`QueuePair::stage`] rings the doorbell or leaves the work requests prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ring {
    Now,
    Later,
}

impl QueuePair {
    /// Post a batch of send work requests (one doorbell). The buffers are owned by the returned
    /// [`Pending`] until each completes; they come back in order.
    pub fn post_send(&self, wrs: Vec<SendWr>) -> Result<Pending> {
        self.post_send_every(wrs, 1)
    }

    /// Like [`QueuePair::post_send`], but only every `every`-th work request (and the last) asks
    /// the device for a completion; the ones between complete when the next signaled one does
    /// (an RC send queue completes in order). Fewer completions mean less work for the device
    /// (for rxe: the kernel's completer) and fewer wake-ups per byte, as perftest's `--cq-mod`.
    /// Each work request still owns its buffer until it is known to be complete.
    pub fn post_send_moderated(&self, wrs: Vec<SendWr>, every: usize) -> Result<Pending> {
        self.post_send_every(wrs, every.max(1))
    }

    /// Post send work requests that ask for no completion of their own, as perftest's latency
    /// tests do: the device then writes no completion entry for them, and nothing waits for
    /// one. Each completes (and gives its buffer back) when a later signaled work request on
    /// this QP does, posted by any call; awaiting the returned [`Pending`] before one is posted
    /// waits until then. So that the send queue cannot fill with work requests nothing
    /// retires, the last of a call is signaled anyway once half the queue is taken. Meant for
    /// inline data, whose bytes are copied at the post.
    pub fn post_send_deferred(&self, wrs: Vec<SendWr>) -> Result<Pending> {
        self.post_send_every(wrs, 0)
    }

    /// Write send work requests into the send queue without handing them to the device:
    /// [`PreparedSend::post`] does that later with one call (the doorbell), and dropping the
    /// [`PreparedSend`] takes them back. For request/response loops whose next request is
    /// known before the last response arrives: preparing it while waiting leaves only the
    /// doorbell between seeing the response and sending the next request.
    ///
    /// Every work request is signaled, as with [`QueuePair::post_send`]. Until the
    /// `PreparedSend` is posted or dropped it holds the send queue: other sends and binds on
    /// this QP are refused (`InvalidArgument`), receives are not affected.
    pub fn prepare_send(&self, wrs: Vec<SendWr>) -> Result<PreparedSend> {
        self.prepare_every(wrs, 1)
    }

    /// [`QueuePair::prepare_send`] for work requests that ask for no completion of their own,
    /// as [`QueuePair::post_send_deferred`].
    pub fn prepare_send_deferred(&self, wrs: Vec<SendWr>) -> Result<PreparedSend> {
        self.prepare_every(wrs, 0)
    }

    fn prepare_every(&self, wrs: Vec<SendWr>, every: usize) -> Result<PreparedSend> {
        let (rxs, taken) = self.stage(wrs, every, Ring::Later)?;
        Ok(PreparedSend {
            qp: self.clone(),
            rxs: Some(rxs),
            taken,
        })
    }

    fn post_send_every(&self, wrs: Vec<SendWr>, every: usize) -> Result<Pending> {
        let (rxs, _) = self.stage(wrs, every, Ring::Now)?;
        Ok(self.pending(rxs))
    }

    /// Refuse a post while a [`PreparedSend`] holds the send queue (the caller holds the CQ's
    /// state lock, under which a prepare sets the flag).
    pub(crate) fn check_not_prepared(&self) -> Result<()> {
        if self.inner.prepared.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument(format!(
                "a prepared send holds the send queue of QP {}: post it or drop it before \
                 posting other sends",
                self.inner.qpn
            )));
        }
        Ok(())
    }

    /// Register, write and (with [`Ring::Now`]) post `wrs`. Returns their result channels and,
    /// when prepared, the deferred work requests of earlier calls that these now cover (given
    /// back if the prepared ones are dropped).
    ///
    /// `every`: signal every `every`-th work request and the last; 0: none (deferred).
    fn stage(&self, wrs: Vec<SendWr>, every: usize, ring: Ring) -> Result<(Rxs, Vec<u64>)> {
        for wr in &wrs {
            validate(wr, self.inner.opts.max_inline_data)?;
        }
        let mut raw: SmallVec<[RawSendWr<'_>; 4]> = SmallVec::with_capacity(wrs.len());
        for wr in &wrs {
            let data = match &wr.local {
                Local::Inline(b) => RawData::Inline(b),
                l => {
                    let (lkey, addr, len) = l.sge()?;
                    RawData::Sge(lkey, addr, len)
                }
            };
            raw.push(RawSendWr { op: wr.op, data });
        }
        let mut state = self.cq().lock();
        self.check_not_prepared()?;
        self.check_send_room(&state, wrs.len())?;
        let signal = if every == 0 {
            Signal::Deferred {
                outstanding: state.send_outstanding + wrs.len(),
                capacity: self.inner.opts.max_send_wr as usize,
            }
        } else {
            Signal::Every(every)
        };
        // the entries are registered before the doorbell (a completion may be polled as soon
        // as it rings, by a thread that waits for this state lock) and take their buffers once
        // the work requests are written
        let mut rxs = Vec::with_capacity(wrs.len());
        for wr in &wrs {
            let (id, rx) = state.register(None, Queue::Send);
            rxs.push((id, rx, wr.op.name()));
        }
        if let Err(e) = self.write_wrs(&rxs, &raw, signal, ring) {
            let ids: SmallVec<[u64; 4]> = rxs.iter().map(|r| r.0).collect();
            state.unregister(&ids);
            return Err(e);
        }
        if ring == Ring::Later {
            self.inner.prepared.store(true, Ordering::Release);
        }
        drop(raw);
        let n = wrs.len();
        for ((id, ..), wr) in rxs.iter().zip(wrs) {
            // (inline bytes were copied into the work request; they are kept only so that
            // every work request's local comes back, in order, as for the others)
            state.attach(*id, wr.local);
        }
        // the deferred ones of earlier calls are covered by this call's first signaled one
        let taken = std::mem::take(&mut state.uncovered);
        let given_back = if ring == Ring::Later {
            taken.clone()
        } else {
            Vec::new()
        };
        let mut covered = taken;
        for (i, (id, ..)) in rxs.iter().enumerate() {
            if signal.at(i, n) {
                state.cover(*id, std::mem::take(&mut covered));
            } else {
                covered.push(*id);
            }
        }
        // (only a deferred call leaves any: the others signal their last)
        state.uncovered = covered;
        Ok((rxs, given_back))
    }

    /// Write the work requests into the send queue; ring the doorbell, or keep them (and the
    /// provider's send-queue lock) for [`PreparedSend::post`].
    fn write_wrs(
        &self,
        rxs: &[(u64, oneshot::Receiver<Done>, &'static str)],
        wrs: &[RawSendWr<'_>],
        signal: Signal,
        ring: Ring,
    ) -> Result<()> {
        let mut qp = self.lock_qp();
        let mut guard = qp.start_post_send();
        let n = wrs.len();
        for (i, ((id, ..), wr)) in rxs.iter().zip(wrs).enumerate() {
            let mut flags = if signal.at(i, n) {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            if matches!(wr.data, RawData::Inline(_)) {
                // rxe's provider copies the bytes in ibv_wr_set_inline_data but takes them
                // from there only when the work request's flags say inline
                flags |= WorkRequestFlags::Inline;
            }
            let h = guard.construct_wr(*id, flags);
            let h = match wr.op {
                SendOp::Write(r) => h.setup_write(r.rkey, r.addr),
                SendOp::WriteImm(r, imm) => h.setup_write_imm(r.rkey, r.addr, imm.to_be()),
                SendOp::Read(r) => h.setup_read(r.rkey, r.addr),
                SendOp::Send => h.setup_send(),
                SendOp::SendImm(imm) => h.setup_send_imm(imm.to_be()),
            };
            match &wr.data {
                // the provider copies the bytes into the work request during this call
                // (checked against the QP's max_inline_data by `validate`)
                RawData::Inline(b) => h.setup_inline_data(b),
                // SAFETY: for the safe API the range was checked against the registered buffer
                // (or the device's memory region, for `Local::Region`) that the pending table
                // now owns until the completion.
                RawData::Sge(lkey, addr, len) => unsafe { h.setup_sge(*lkey, *addr, *len) },
            }
        }
        match ring {
            Ring::Now => guard.post().map_err(|e| {
                Error::verbs(
                    Call::PostSend,
                    format!("QP {}: {} work requests", self.inner.qpn, wrs.len()),
                    io_of(&e),
                )
            }),
            Ring::Later => {
                // the work requests stay written and the provider keeps its send-queue lock
                // until PreparedSend::post completes them or its drop aborts them (the guard's
                // own drop would abort them now)
                std::mem::forget(guard);
                Ok(())
            }
        }
    }
}

/// Send work requests written into a QP's send queue and not yet handed to the device (see
/// [`QueuePair::prepare_send`]). [`PreparedSend::post`] rings the doorbell; dropping it takes
/// the work requests back, and their buffers are dropped.
#[must_use = "a prepared send holds its QP's send queue until it is posted or dropped"]
pub struct PreparedSend {
    qp: QueuePair,
    /// None once posted.
    rxs: Option<Rxs>,
    /// Deferred work requests of earlier calls that these cover: uncovered again if dropped.
    taken: Vec<u64>,
}

impl fmt::Debug for PreparedSend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedSend")
            .field("qp", &self.qp.qpn())
            .field("wrs", &self.rxs.as_ref().map_or(0, Vec::len))
            .finish()
    }
}

/// What [`PreparedSend::post_after`] did.
#[derive(Debug)]
#[must_use = "a prepared send not yet posted holds its QP's send queue"]
pub enum AfterPoll {
    /// The awaited work requests had completed: the prepared ones are posted.
    Posted(Pending),
    /// They are still in flight: the prepared send, not posted.
    NotYet(PreparedSend),
}

impl PreparedSend {
    /// Hand the work requests to the device (the doorbell): from here on as after
    /// [`QueuePair::post_send`]. If the device refuses them, the error of the post.
    pub fn post(self) -> Result<Pending> {
        let rung = self.ring();
        self.finish(rung)
    }

    /// Post these work requests as soon as `after` has completed: poll `after`'s CQ once, and
    /// if that completes every work request of `after`, ring this doorbell at once, before the
    /// polled completions are handed out (or at once, if `after` had already completed). For
    /// request/response loops that busy-poll: nothing but the poll stands between seeing the
    /// response and sending the next request. `NotYet` gives this back when `after` is still
    /// in flight; `after`'s results are then taken as usual ([`Pending::into_ready`]).
    pub fn post_after(self, after: &Pending) -> Result<AfterPoll> {
        self.post_after_rxs(&after.qp, &after.rxs)
    }

    /// [`PreparedSend::post_after`] for receives in flight: the next request goes out as soon
    /// as the response has landed.
    pub fn post_after_recv(self, after: &crate::PendingRecv) -> Result<AfterPoll> {
        self.post_after_rxs(&after.qp, &after.rxs)
    }

    fn post_after_rxs(self, qp: &QueuePair, after: &Rxs) -> Result<AfterPoll> {
        // (the doorbell is rung under `after`'s CQ state lock, then the QP's lock: the order
        // every send path takes them in)
        match qp.cq().drain_then(after, || self.ring())? {
            Some(rung) => self.finish(rung).map(AfterPoll::Posted),
            None => Ok(AfterPoll::NotYet(self)),
        }
    }

    /// `ibv_wr_complete`: the doorbell.
    fn ring(&self) -> std::io::Result<()> {
        let qp = self.qp.lock_qp();
        // SAFETY: `qp` was created by ibv_create_qp_ex (`QueuePair::new`) and is live while its
        // lock is held; work requests were started on it by `stage` (Ring::Later), whose
        // provider lock is still held, and no other post can start meanwhile (the `prepared`
        // flag, checked under the CQ state lock by every send path). `ring` is called once:
        // `finish` consumes the value right after.
        unsafe { crate::ffi::wr_complete(qp.qp()) }
    }

    /// After the doorbell: the pending work requests, or (the device refused them) the post's
    /// error with the work requests forgotten.
    fn finish(mut self, rung: std::io::Result<()>) -> Result<Pending> {
        let rxs = self.rxs.take().unwrap_or_default();
        match rung {
            Ok(()) => {
                self.qp.inner.prepared.store(false, Ordering::Release);
                Ok(self.qp.pending(rxs))
            }
            Err(e) => {
                let n = rxs.len();
                self.undo(rxs);
                Err(Error::verbs(
                    Call::PostSend,
                    format!("QP {}: {n} prepared work requests", self.qp.qpn()),
                    e,
                ))
            }
        }
    }

    /// Forget work requests that never reached the device: their entries leave the pending
    /// table, the deferred ones they had covered are uncovered again, and the send queue is
    /// free for other posts once that is done.
    fn undo(&mut self, rxs: Rxs) {
        let ids: SmallVec<[u64; 4]> = rxs.iter().map(|r| r.0).collect();
        let mut state = self.qp.cq().lock();
        state.unregister(&ids);
        give_back(&mut state, &ids, std::mem::take(&mut self.taken));
        drop(state);
        self.qp.inner.prepared.store(false, Ordering::Release);
    }
}

impl Drop for PreparedSend {
    fn drop(&mut self) {
        let Some(rxs) = self.rxs.take() else { return };
        {
            let qp = self.qp.lock_qp();
            // SAFETY: as in `post`: the QP is live and the started work requests are this
            // value's; aborting releases the provider's send-queue lock and leaves the queue
            // as it was before `stage`.
            unsafe { crate::ffi::wr_abort(qp.qp()) };
        }
        self.undo(rxs);
    }
}

/// Undo a prepared call's covering: its own deferred ids leave the uncovered list, and the
/// earlier ones it had taken over return to it.
fn give_back(state: &mut CqState, ours: &[u64], mut taken: Vec<u64>) {
    state.uncovered.retain(|id| !ours.contains(id));
    taken.append(&mut state.uncovered);
    state.uncovered = taken;
}
