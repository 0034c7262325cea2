//! Staged fetches: the bounce path's fetch in the direction of the direct path. The server
//! copies a chunk of the region into one of the connection's staging slots, and the client
//! RDMA-READs it through a read-only memory window over the slot, bound on the client's QP, as
//! it reads direct extents; then it releases the slot (`Unstage`) for the next chunk. Between
//! hosts a READ streams the whole chunk in one response, where the WRITE the classic bounce
//! fetch uses is held to the sender's window of unacknowledged packets (on rxe: ib_write_bw
//! 0.66x ib_read_bw in the two-host lab).
//!
//! Only connections whose device binds memory windows stage: the window is what keeps one
//! client from reading another's staging buffer (an MR's rkey works on every QP of the PD).
//! A slot's window is bound once, over the whole slot buffer, when the connection stages its
//! first chunk there (slot 0's ahead of it, while the client sets up: see
//! [`ConnState::prepare_first_slot`]), and stays bound until the connection ends
//! ([`verbs::StandingWindow`]): later chunks are copied under it, with no bind per chunk. So
//! the client can read its slots at any time, and what it can read is only what was staged for
//! it on this connection: the first chunk of a slot zeroes the rest of the buffer (pooled
//! across connections, it may hold another client's bytes) before the window is bound, and a
//! slot bound ahead is zeroed whole. Slot buffers are registered once per
//! device, at start (`bounce_depth` of them, within the staging budget). An open that names
//! its fetch's range has the first chunk staged with it ([`ConnState::stage_first`]), so that
//! the fetch's first READ waits for no `Stage` exchange.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use peermem::block::{BlockStorage, RingLease};
use verbs::{
    Access, HostBuffer, MemoryWindow, ProtectionDomain, RegMode, RegionRef, RegisteredBuffer,
    StandingWindow,
};

use super::bounce::{copy_error_code, off_workers, record_staged, reserve, BOUNCE_STALL};
use super::driver::{internal, ConnState};
use super::regions::{removed, Region};
use super::ring_wait::{RingQueue, SlotFreed};
use super::session::{Refusal, MAX_STAGED};
use super::Shared;
use crate::metrics::{BounceStage, Direction};
use crate::protocol::{ErrorCode, Msg, RegionInfo, Span, StagedChunk};

/// Chunks lent from page starts start on one of these.
pub(super) const PAGE: u64 = 4096;

/// Bytes of replies a connection may hold back at once (a `Staged` reply is under 100
/// bytes): past it, a reply goes out at once.
pub(super) const MAX_HELD_REPLIES: usize = 16 * 1024;

/// Whether `reply` may wait in the connection for the replies behind it and go out with them
/// in one write, when the client's next request is already here (the caller checks that
/// last: it reads the socket). A client asks for staged chunks in batches, in one write
/// (`client::window::may_stage`); their `Staged` replies go back the same way, saving both
/// hosts a wake-up per chunk. Only while the client holds another staged chunk
/// (`held_by_client` counts this one too): its NIC has that one to read meanwhile, and the
/// first chunk of a fetch is answered at once. A held reply goes out with the next one sent,
/// and before the server waits for the client again.
pub(super) fn may_hold(reply: &Msg, held_by_client: u32, held_bytes: usize) -> bool {
    matches!(reply, Msg::Staged { .. }) && held_by_client > 1 && held_bytes < MAX_HELD_REPLIES
}

/// What a region's CMB ring (or its own memory, lent from page starts) did with a chunk.
enum InRing {
    /// Lent: the `Staged` reply.
    Lent(Box<Msg>),
    /// It would lend the chunk, but has no slot for it now (or other connections wait for
    /// the next one).
    Busy,
    /// It does not lend this chunk to this connection: it is staged in host memory.
    No,
}

/// One staging slot of a connection: its buffer, with the window over it once the first chunk
/// was staged there (kept, and the buffer with it, until the connection ends).
#[derive(Debug, Default)]
pub(super) enum PullSlot {
    /// Nothing staged here yet (or a bind that timed out took the buffer).
    #[default]
    Empty,
    /// A buffer whose window is not bound (its bind failed: the next chunk tries again).
    Unbound(RegisteredBuffer),
    /// The buffer lent to this connection's client through a window on its QP.
    Bound(StandingWindow),
}

/// A chunk staged in a slot of a region's CMB ring (or, lent from page starts, in the
/// region's own memory: no lease) and lent to the client through a window over its bytes.
/// Field order is drop order: the window is revoked before the slot goes back to the ring.
#[derive(Debug)]
pub(super) struct LentChunk {
    _window: MemoryWindow,
    _lease: Option<RingLease>,
    /// The region's index.
    pub(super) region: usize,
    /// Since when the client holds the ring slot, and when to look whether it held it too
    /// long (see `ring_hold`); None for a chunk lent where it is, which holds no slot.
    pub(super) held: Option<super::ring_hold::Held>,
    /// The ring's waiters look again once the slot is back (after the lease).
    _freed: Option<SlotFreed>,
}

impl ConnState {
    /// Stage `len` bytes of region `region` at `offset` into slot `slot` (the session checked
    /// the range, the handle and that the client does not hold the slot), asked for at
    /// `started`: the `Staged` reply. With `may_wait`, None where the region's CMB ring would
    /// lend the chunk but has no slot for it now (another connection took the last one since
    /// [`ConnState::ring_busy`] looked): the caller parks it (`ring_wait`).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn stage(
        &mut self,
        shared: &Shared,
        region: usize,
        offset: u64,
        len: u64,
        slot: u32,
        started: Instant,
        may_wait: bool,
    ) -> std::result::Result<Option<Msg>, Refusal> {
        let r = shared.regions.get(region);
        if r.removed.load(Ordering::SeqCst) {
            return Err(removed(&r.info.name));
        }
        let provider = r.provider()?;
        // (a chunk still lent in this slot number is the client's no more: the session lets
        // it stage here only after releasing the slot)
        self.lent.remove(&slot);
        match self
            .stage_in_ring(shared, region, &*provider, offset, len, slot, started)
            .await
        {
            InRing::Lent(staged) => return Ok(Some(*staged)),
            InRing::Busy if may_wait => return Ok(None),
            InRing::Busy | InRing::No => {}
        }
        let idx = slot as usize;
        if self.pulls.len() <= idx {
            self.pulls.resize_with(idx + 1, PullSlot::default);
        }
        let dir = Direction::of(false);
        let m = shared.metrics();
        let n = len as usize;
        if n > shared.cfg.bounce_chunk {
            // the session holds a chunk to the slot size: this is a bug, not a client's doing
            return Err(internal(format!(
                "a staged chunk of {n} bytes is larger than the {}-byte slots",
                shared.cfg.bounce_chunk
            )));
        }
        // the chunk into `dst`, timed as the histogram's queued and copy stages
        let copy_chunk = |dst: &mut [u8]| {
            m.observe_stage(dir, BounceStage::queued, started.elapsed().as_secs_f64());
            let copy = Instant::now();
            let copied = off_workers(&*provider, || provider.copy_out(offset, dst));
            m.observe_stage(dir, BounceStage::copy, copy.elapsed().as_secs_f64());
            copied.map_err(|e| {
                (
                    copy_error_code(&e),
                    format!(
                        "copying {n} bytes out of region '{}' at {offset}: {e}",
                        r.info.name
                    ),
                )
            })
        };
        let fresh = match std::mem::take(&mut self.pulls[idx]) {
            PullSlot::Bound(mut w) => {
                // the client released the slot: the next chunk goes under the same window
                let copied = copy_chunk(&mut w.as_mut_slice()[..n]);
                self.pulls[idx] = PullSlot::Bound(w);
                copied?;
                None
            }
            PullSlot::Unbound(b) => Some(b),
            PullSlot::Empty => Some(self.new_slot_buffer(shared)?),
        };
        if let Some(mut buf) = fresh {
            let bytes = buf.as_mut_slice();
            // the buffer is pooled across connections, and the window will cover all of it:
            // no byte of another client's chunk may stay
            bytes[n..].fill(0);
            if let Err(e) = copy_chunk(&mut bytes[..n]) {
                self.pulls[idx] = PullSlot::Unbound(buf);
                return Err(e);
            }
            let window = self.bind_slot(shared, slot, buf, BounceStage::bind).await?;
            self.pulls[idx] = PullSlot::Bound(window);
        }
        let PullSlot::Bound(w) = &self.pulls[idx] else {
            return Err(internal(format!("staging slot {slot} has no window")));
        };
        let remote = w
            .remote(0, len)
            .map_err(|e| internal(format!("staging slot {slot}: {e}")))?;
        record_staged(shared, region, len, started, false);
        Ok(Some(Msg::Staged {
            slot,
            addr: remote.addr,
            rkey: remote.rkey,
            len,
            lent: false,
            hold_ms: 0,
        }))
    }

    /// The staged chunks the client should hold of region `region` at once, as its `Opened`
    /// says: the session's pull depth, or the slots of the region's CMB ring where that ring
    /// lends chunks to this connection's NIC and has fewer. A client that held more would
    /// find its own chunks in every slot, and its next ones would be copied through host
    /// memory rather than wait for its own releases.
    pub(super) fn pull_depth_for(&self, shared: &Shared, region: usize) -> u32 {
        let depth = self.session.pull_depth();
        let r = shared.regions.get(region);
        if r.nic != self.nic || lock(&r.ring_nic).is_none() {
            return depth;
        }
        let Ok(provider) = r.provider() else {
            return depth;
        };
        let slots = provider
            .as_any()
            .downcast_ref::<BlockStorage>()
            .and_then(BlockStorage::ring_slots);
        slots.map_or(depth, |n| depth.min(n.clamp(1, u32::MAX as u64) as u32))
    }

    /// The region's ring (or its own memory, lent from page starts) as this connection's NIC
    /// may read it: None where the ring lends to another device, or was proved from page
    /// starts at another path MTU than this connection's (a READ at a smaller one sends
    /// packets that start partway into pages).
    pub(super) fn lending_nic(&self, r: &Region) -> Option<crate::path::RingNic> {
        let nic = lock(&r.ring_nic).clone().filter(|_| self.nic == r.nic)?;
        let qp = self.qp.as_ref()?;
        match nic.page_start {
            Some(proved) if qp.path_mtu() != Some(proved) => {
                tracing::debug!(
                    path_mtu = ?qp.path_mtu(),
                    proved,
                    "ring slot not lent: the NIC's access was proved at another path MTU"
                );
                None
            }
            _ => Some(nic),
        }
    }

    /// The piece alignment this connection's client of region `region` is told (`Opened`'s
    /// `piece_align`), where the region's ring, or its own memory, is lent to or lands from
    /// this connection's NIC only from the start of a page: the device's logical block (a
    /// chunk that starts on one starts on its slot's first byte, a page) or a page (the
    /// region's own memory, registered from a page). A transfer that starts partway into one
    /// then has a first piece of less than one, copied, and its other pieces go through the
    /// ring; cut on the bounce chunk's multiples alone, its whole first piece was copied.
    /// 0 where the NIC reaches any offset or none, or the bounce chunk is no multiple of it.
    pub(super) fn piece_align_for(&self, shared: &Shared, region: usize) -> u32 {
        let r = shared.regions.get(region);
        if self.lending_nic(r).and_then(|n| n.page_start).is_none() {
            return 0;
        }
        let Ok(provider) = r.provider() else {
            return 0;
        };
        let align = provider
            .as_any()
            .downcast_ref::<BlockStorage>()
            .map_or(PAGE, BlockStorage::block_size);
        match u32::try_from(align) {
            Ok(a) if a > 0 && shared.cfg.bounce_chunk as u64 % align == 0 => a,
            _ => 0,
        }
    }

    /// Whether a staged chunk of region `region` should wait for a slot of its CMB ring (see
    /// `ring_wait`): the ring would lend it to this connection, but no slot is free or other
    /// connections wait before it, and the ring moved lately (a slot was lent or came back in
    /// the wait's limit). The queue to wait in.
    pub(super) fn ring_busy(
        &self,
        shared: &Shared,
        region: usize,
        offset: u64,
        len: u64,
    ) -> Option<Arc<RingQueue>> {
        let r = shared.regions.get(region);
        if r.removed.load(Ordering::SeqCst) {
            return None;
        }
        let nic = self.lending_nic(r)?;
        let provider = r.provider().ok()?;
        let block = provider.as_any().downcast_ref::<BlockStorage>()?;
        let lends = block.lends(offset, len, nic.page_start.is_some());
        let q = &r.ring_queue;
        if !lends.unwrap_or(false) || (block.free_slots() > 0 && q.my_turn(self.id)) {
            return None;
        }
        // (slots held past the ring's hold limit go back now: see `ring_hold`)
        q.wanted();
        if q.stalled() {
            // nothing moved in the ring for the wait's limit: its slots are held by clients
            // that read nothing, and waiting would end only at the limit
            tracing::debug!(region = %r.info.name, "every ring slot lent and none came back lately: not waiting");
            return None;
        }
        Some(Arc::clone(q))
    }

    /// Stage the chunk in a slot of the region's CMB ring and lend the slot to the client
    /// through a read-only window over the chunk's bytes, bound on this connection's QP: the
    /// SSD DMAs into the CMB and the client's NIC reads from there, so the bytes never cross
    /// host memory. A region the NIC reads from page starts (`path::page_start_lending`) lends
    /// the chunk where it is, in its own memory, when the chunk starts on a page: no slot, no
    /// copy. None when the region has no ring the NIC was proved to reach (or not on
    /// this connection's device, or proved from page starts at another path MTU than this
    /// connection's), the ring cannot lend this chunk (see
    /// [`BlockStorage::lend_slot`]), or the bind fails: the chunk is then staged in host
    /// memory as usual (an error of the device shows there, with its reply).
    ///
    /// Whatever a window shows is the region's own bytes (the ring is the region's alone), to
    /// a client whose handle reads the region: a bind that completes after its timeout (the
    /// window is deallocated then, see [`verbs::QueuePair::bind_window`]) shows that client
    /// nothing it may not read.
    #[allow(clippy::too_many_arguments)]
    async fn stage_in_ring(
        &mut self,
        shared: &Shared,
        region: usize,
        provider: &dyn peermem::Provider,
        offset: u64,
        len: u64,
        slot: u32,
        started: Instant,
    ) -> InRing {
        let r = shared.regions.get(region);
        let Some(nic) = self.lending_nic(r) else {
            return InRing::No;
        };
        let block = provider.as_any().downcast_ref::<BlockStorage>();
        let Some(qp) = self.qp.as_ref() else {
            return InRing::No;
        };
        // a chunk the ring would lend (had it a free slot)
        let lends = block.is_some_and(|b| {
            b.lends(offset, len, nic.page_start.is_some())
                .unwrap_or(false)
        });
        if lends && !r.ring_queue.my_turn(self.id) {
            // others wait for a slot: this chunk takes none of theirs
            return InRing::Busy;
        }
        let queued = started.elapsed();
        let read = Instant::now();
        let (lease, range) = match block {
            Some(block) => match off_workers(provider, || {
                block.lend_slot(offset, len, nic.page_start.is_some())
            }) {
                Ok(Some(l)) => {
                    let range = l.range.clone();
                    (Some(l), range)
                }
                // (lent had there been a free slot: another connection took the last one)
                Ok(None) if lends => return InRing::Busy,
                Ok(None) => return InRing::No,
                Err(e) => {
                    tracing::debug!(error = %e, offset, len, "no ring slot lent");
                    return InRing::No;
                }
            },
            // the region's own memory, lent where it is (`path::page_start_lending`): the
            // registration covers the region from its first byte, on a page
            None if nic.page_start.is_some() && offset % PAGE != 0 => return InRing::No,
            None => (None, offset..offset + len),
        };
        let read = read.elapsed();
        let binding = Instant::now();
        let mr: Arc<dyn RegionRef> = nic.mr.clone();
        let bound =
            tokio::time::timeout(BOUNCE_STALL, qp.bind_window(mr, range, Access::REMOTE_READ))
                .await;
        let window = match bound {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, slot, "no window over a CMB ring slot: staged in host memory");
                return InRing::No;
            }
            Err(_) => {
                tracing::warn!(
                    slot,
                    "no window over a CMB ring slot in {} s: staged in host memory",
                    BOUNCE_STALL.as_secs()
                );
                return InRing::No;
            }
        };
        let (dir, m) = (Direction::of(false), shared.metrics());
        m.observe_stage(dir, BounceStage::queued, queued.as_secs_f64());
        m.observe_stage(dir, BounceStage::copy, read.as_secs_f64());
        m.observe_stage(dir, BounceStage::bind, binding.elapsed().as_secs_f64());
        let remote = window.remote();
        let freed = lease.as_ref().map(|_| SlotFreed::new(&r.ring_queue));
        let held = lease
            .as_ref()
            .map(|_| super::ring_hold::Held::new(shared.cfg.ring_hold));
        // the client is told when the slot may be taken back (never for one outside the ring;
        // 0 says no limit, so a limit under a millisecond is told as one)
        let hold_ms = held.as_ref().map_or(0, |_| {
            u64::try_from(shared.cfg.ring_hold.as_millis())
                .unwrap_or(u64::MAX)
                .max(1)
        });
        self.lent.insert(
            slot,
            LentChunk {
                _window: window,
                _lease: lease,
                region,
                held,
                _freed: freed,
            },
        );
        record_staged(shared, region, len, started, true);
        InRing::Lent(Box::new(Msg::Staged {
            slot,
            addr: remote.addr,
            rkey: remote.rkey,
            len,
            lent: true,
            hold_ms,
        }))
    }

    /// The first piece of an open's `first` range, staged with the open (see
    /// `Session::stage_first`): what its `Opened` reply carries, so that the fetch's first
    /// READ needs no `Stage` exchange. Best effort: a piece that is direct, a handle that does
    /// not stage or a stage that fails gives None, and the fetch asks for the piece as usual.
    pub(super) async fn stage_first(
        &mut self,
        shared: &Shared,
        handle: u32,
        span: Span,
        info: &RegionInfo,
        align: u64,
    ) -> Option<Box<StagedChunk>> {
        let started = Instant::now();
        let extents = info.extents();
        let staged = self
            .session
            .stage_first(handle, span, &extents, align, &shared.regions)?;
        let f = match staged {
            Ok(f) => f,
            Err((code, message)) => {
                tracing::debug!(%code, message, "no first chunk staged with the open");
                return None;
            }
        };
        if self.ring_busy(shared, f.region, f.offset, f.len).is_some() {
            // no ring slot for it now: the client asks for it, and it waits for one then
            self.session.unstaged(f.slot);
            return None;
        }
        let staged = self.stage(shared, f.region, f.offset, f.len, f.slot, started, false);
        match staged.await {
            Ok(Some(Msg::Staged {
                slot,
                addr,
                rkey,
                len,
                lent,
                hold_ms,
            })) => {
                shared.metrics().observe_stage(
                    Direction::of(false),
                    BounceStage::open,
                    started.elapsed().as_secs_f64(),
                );
                Some(Box::new(StagedChunk {
                    offset: f.offset,
                    len,
                    slot,
                    addr,
                    rkey,
                    lent,
                    hold_ms,
                }))
            }
            other => {
                // the slot goes back: the client is told of no chunk in it
                self.session.unstaged(f.slot);
                if let Err((code, message)) = other {
                    tracing::debug!(%code, message, "no first chunk staged with the open");
                }
                None
            }
        }
    }

    /// Bind slot 0's window before the client's first `Stage`, once its QP is connected and
    /// it holds a handle that will stage a fetch (see `Session::expects_staged_fetch`): the
    /// driver calls this right after its `Connected` or `Opened` reply went out, while the
    /// client sets up its side, so that the first chunk of a fetch waits for its copy only. A
    /// new connection's first bind took 0.73 ms (0.59-1.02) of a 1 MiB bounce fetch's 3.76 ms
    /// `Stage` round trip between the lab guests. The buffer is zeroed whole (it is pooled
    /// across connections), and the window is timed as the histogram's `prebind` stage. Best
    /// effort: with the staging budget in use, or a bind that fails, the first `Stage` binds
    /// as before.
    pub(super) async fn prepare_first_slot(&mut self, shared: &Shared) {
        let fresh = self.pulls.iter().all(|p| matches!(p, PullSlot::Empty));
        if !self.session.expects_staged_fetch(fresh, &shared.regions) {
            return;
        }
        let mut buf = match self.new_slot_buffer(shared) {
            Ok(b) => b,
            Err((code, message)) => {
                tracing::debug!(%code, message, "no staging slot prepared ahead");
                return;
            }
        };
        buf.as_mut_slice().fill(0);
        if self.pulls.is_empty() {
            self.pulls.push(PullSlot::Empty);
        }
        match self.bind_slot(shared, 0, buf, BounceStage::prebind).await {
            Ok(w) => self.pulls[0] = PullSlot::Bound(w),
            Err((code, message)) => {
                tracing::debug!(%code, message, "no staging slot prepared ahead")
            }
        }
    }

    /// Lend slot `slot`'s freshly filled buffer to the client: a window over all of it on this
    /// connection's QP, timed as the histogram's `stage` (bind, or prebind ahead of the
    /// first `Stage`). A bind that fails leaves the buffer in the slot, unbound, for the next
    /// chunk to try again.
    async fn bind_slot(
        &mut self,
        shared: &Shared,
        slot: u32,
        buf: RegisteredBuffer,
        stage: BounceStage,
    ) -> std::result::Result<StandingWindow, Refusal> {
        let Some(qp) = self.qp.as_ref() else {
            self.pulls[slot as usize] = PullSlot::Unbound(buf);
            return Err(internal("staging without a QP"));
        };
        let binding = Instant::now();
        let bound = tokio::time::timeout(BOUNCE_STALL, qp.bind_standing(buf)).await;
        shared.metrics().observe_stage(
            Direction::of(false),
            stage,
            binding.elapsed().as_secs_f64(),
        );
        match bound {
            Ok(Ok(w)) => Ok(w),
            Ok(Err(e)) => {
                if let Some(b) = e.buf {
                    self.pulls[slot as usize] = PullSlot::Unbound(b);
                }
                Err(internal(format!(
                    "binding a window over staging slot {slot}: {}",
                    e.error
                )))
            }
            // the bind stays with the CQ until it completes; the buffer goes with it
            Err(_) => Err(internal(format!(
                "binding a window over staging slot {slot}: no completion in {} s",
                BOUNCE_STALL.as_secs()
            ))),
        }
    }

    /// A staging buffer for a slot: one from the device's pool, or a new one within the
    /// server-wide staging budget; remote access only through the windows bound over it. The
    /// connection holds it (counted in its staging bytes) until it ends.
    fn new_slot_buffer(
        &mut self,
        shared: &Shared,
    ) -> std::result::Result<RegisteredBuffer, Refusal> {
        let chunk = shared.cfg.bounce_chunk as u64;
        let m = shared.metrics();
        let pooled = lock(&shared.nics.get(self.nic).slots).pop();
        if let Some(b) = pooled {
            m.staging_pool_bytes.dec_by(chunk as i64);
            self.staging_bytes += chunk;
            m.staging_bytes.inc_by(chunk as i64);
            return Ok(b);
        }
        if !reserve(shared, chunk) {
            return Err((
                ErrorCode::Busy,
                format!(
                    "the server's staging budget ({} bytes of pinned bounce buffers) is in use \
                     by other clients; retry shortly",
                    shared.cfg.max_staging_bytes
                ),
            ));
        }
        let pd = match self.pd(shared) {
            Ok(p) => p,
            Err(e) => {
                shared.staging.fetch_sub(chunk, Ordering::SeqCst);
                return Err(e);
            }
        };
        match slot_buffer(&pd, shared.cfg.bounce_chunk) {
            Ok(b) => {
                self.staging_bytes += chunk;
                m.staging_bytes.inc_by(chunk as i64);
                Ok(b)
            }
            Err(e) => {
                shared.staging.fetch_sub(chunk, Ordering::SeqCst);
                Err(internal(format!("staging buffer: {e}")))
            }
        }
    }

    /// The connection ends: its slots' windows are revoked and their buffers go back to the
    /// device's pool (still within the staging budget). A buffer a bind still holds (one that
    /// timed out) goes with it, and the connection's staging bytes release its budget.
    pub(super) fn release_slots(&mut self, shared: &Shared) {
        self.lent.clear();
        let chunk = shared.cfg.bounce_chunk as u64;
        let m = shared.metrics();
        let pool = &shared.nics.get(self.nic).slots;
        for p in self.pulls.drain(..) {
            let b = match p {
                PullSlot::Empty => None,
                PullSlot::Unbound(b) => Some(b),
                PullSlot::Bound(w) => w.into_buffer(),
            };
            let Some(b) = b else {
                continue;
            };
            lock(pool).push(b);
            self.staging_bytes = self.staging_bytes.saturating_sub(chunk);
            m.staging_bytes.dec_by(chunk as i64);
            m.staging_pool_bytes.inc_by(chunk as i64);
        }
    }
}

/// A staging slot buffer: host memory registered for memory windows, with no remote access of
/// its own.
fn slot_buffer(pd: &ProtectionDomain, len: usize) -> verbs::Result<RegisteredBuffer> {
    HostBuffer::new(len)
        .and_then(|m| pd.register(m, Access::LOCAL_WRITE | Access::MW_BIND, RegMode::Pinned))
}

/// A mutex's guard, poisoned or not (the data behind the server's mutexes stays consistent).
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// At start: one slot buffer per slot a connection may hold (`bounce_depth`), on every device
/// whose connections stage, within the staging budget, so that a connection's first staged
/// fetches register nothing. A device where registering fails just allocates on demand.
pub(super) fn prefill_slots(shared: &Shared) {
    let chunk = shared.cfg.bounce_chunk as u64;
    let want = shared.cfg.bounce_depth.min(MAX_STAGED as usize);
    let m = shared.metrics();
    for nic in shared.nics.iter().filter(|n| n.sharing.windows()) {
        for _ in 0..want {
            if !reserve(shared, chunk) {
                return;
            }
            match slot_buffer(&nic.pd, shared.cfg.bounce_chunk) {
                Ok(b) => {
                    lock(&nic.slots).push(b);
                    m.staging_pool_bytes.inc_by(chunk as i64);
                }
                Err(e) => {
                    shared.staging.fetch_sub(chunk, Ordering::SeqCst);
                    tracing::warn!(device = nic.name(), error = %e, "staging slots are registered on demand");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_staged_reply_behind_another_held_chunk_waits_for_its_batch() {
        let staged = Msg::Staged {
            slot: 1,
            addr: 4096,
            rkey: 7,
            len: 1 << 20,
            lent: false,
            hold_ms: 0,
        };
        assert!(may_hold(&staged, 2, 0));
        assert!(may_hold(&staged, 8, MAX_HELD_REPLIES - 1));
        // the first chunk the client holds is answered at once: its NIC has nothing else
        assert!(!may_hold(&staged, 1, 0));
        // bounded: past the limit a reply goes out
        assert!(!may_hold(&staged, 8, MAX_HELD_REPLIES));
        // other replies never wait
        assert!(!may_hold(&Msg::KeepAlive, 8, 0));
        assert!(!may_hold(&Msg::error(ErrorCode::Busy, "busy"), 8, 0));
    }
}
