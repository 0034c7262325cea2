//! Staged fetches: the bounce path's fetch in the direction of the direct path. The server
//! copies a chunk of the region into one of the connection's staging slots and binds a
//! read-only memory window over exactly the staged bytes on the client's QP; the client
//! RDMA-READs them, as it reads direct extents, and releases the slot (`Unstage`), which
//! revokes the window. Between hosts a READ streams the whole chunk in one response, where the
//! WRITE the classic bounce fetch uses is held to the sender's window of unacknowledged
//! packets (on rxe: ib_write_bw 0.66x ib_read_bw in the two-host lab).
//!
//! Only connections whose device binds memory windows stage: the window is what keeps one
//! client from reading another's staging buffer (an MR's rkey works on every QP of the PD).
//! A window covers the bytes of the current chunk, from the moment they are copied until the
//! client releases them. Slot buffers are registered once per device, at start (`bounce_depth`
//! of them, within the staging budget), and pooled across connections; a chunk shorter than
//! its buffer has the rest zeroed first, since rxe confines a window only to the MR under it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use verbs::{
    Access, HostBuffer, MemoryWindow, ProtectionDomain, RegMode, RegionRef, RegisteredBuffer,
};

use super::bounce::{copy_error_code, record_staged, reserve, BOUNCE_STALL};
use super::driver::{internal, ConnState};
use super::regions::removed;
use super::session::{Refusal, MAX_STAGED};
use super::Shared;
use crate::metrics::{BounceStage, Direction};
use crate::protocol::{ErrorCode, Msg};

/// One staging slot of a connection: its buffer (kept for reuse) and, while the client holds
/// the slot, the window over the staged bytes.
#[derive(Debug, Default)]
pub(super) struct PullSlot {
    // drop order: the window (it holds a reference to the buffer's MR), then the buffer
    window: Option<MemoryWindow>,
    buf: Option<Arc<RegisteredBuffer>>,
}

impl ConnState {
    /// Stage `len` bytes of region `region` at `offset` into slot `slot` (the session checked
    /// the range, the handle and that the client does not hold the slot): the `Staged` reply.
    pub(super) async fn stage(
        &mut self,
        shared: &Shared,
        region: usize,
        offset: u64,
        len: u64,
        slot: u32,
    ) -> std::result::Result<Msg, Refusal> {
        let started = Instant::now();
        let r = shared.regions.get(region);
        if r.removed.load(Ordering::SeqCst) {
            return Err(removed(&r.info.name));
        }
        let provider = r.provider()?;
        let idx = slot as usize;
        if self.pulls.len() <= idx {
            self.pulls.resize_with(idx + 1, PullSlot::default);
        }
        // the slot was released, so its window is gone; the buffer is ours alone again
        self.pulls[idx].window = None;
        let mut buf = match self.pulls[idx].buf.take() {
            Some(b) => Arc::try_unwrap(b)
                .map_err(|_| internal(format!("staging slot {slot} is still in use")))?,
            None => self.new_slot_buffer(shared)?,
        };
        let dir = Direction::of(false);
        let m = shared.metrics();
        m.observe_stage(dir, BounceStage::queued, started.elapsed().as_secs_f64());
        let n = len as usize;
        let copy = Instant::now();
        let bytes = buf.as_mut_slice();
        if n < bytes.len() {
            // the buffer is pooled across connections, and rxe confines a window only to the MR
            // under it: nothing of an earlier chunk may stay past this one
            bytes[n..].fill(0);
        }
        let copied = provider.copy_out(offset, &mut bytes[..n]);
        m.observe_stage(dir, BounceStage::copy, copy.elapsed().as_secs_f64());
        let buf = Arc::new(buf);
        if let Err(e) = copied {
            self.pulls[idx].buf = Some(buf);
            return Err((
                copy_error_code(&e),
                format!(
                    "copying {n} bytes out of region '{}' at {offset}: {e}",
                    r.info.name
                ),
            ));
        }
        let Some(qp) = self.qp.as_ref() else {
            self.pulls[idx].buf = Some(buf);
            return Err(internal("staging without a QP"));
        };
        let mr: Arc<dyn RegionRef> = buf.clone();
        let binding = Instant::now();
        let bound = tokio::time::timeout(
            BOUNCE_STALL,
            qp.bind_window(mr, 0..len, Access::REMOTE_READ),
        )
        .await;
        m.observe_stage(dir, BounceStage::bind, binding.elapsed().as_secs_f64());
        let window = match bound {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                self.pulls[idx].buf = Some(buf);
                return Err(internal(format!(
                    "binding a window over staging slot {slot}: {e}"
                )));
            }
            Err(_) => {
                // the bind stays with the CQ until it completes; this buffer goes with it
                return Err(internal(format!(
                    "binding a window over staging slot {slot}: no completion in {} s",
                    BOUNCE_STALL.as_secs()
                )));
            }
        };
        let reply = Msg::Staged {
            slot,
            addr: window.addr(),
            rkey: window.rkey(),
            len,
        };
        self.pulls[idx] = PullSlot {
            window: Some(window),
            buf: Some(buf),
        };
        record_staged(shared, region, len, started);
        Ok(reply)
    }

    /// The client released slot `slot`: its window is revoked (the buffer stays for reuse).
    pub(super) fn unstage(&mut self, slot: u32) {
        if let Some(p) = self.pulls.get_mut(slot as usize) {
            p.window = None;
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
        let chunk = shared.cfg.bounce_chunk as u64;
        let m = shared.metrics();
        let pool = &shared.nics.get(self.nic).slots;
        for PullSlot { window, buf } in self.pulls.drain(..) {
            drop(window);
            let Some(b) = buf.and_then(|b| Arc::try_unwrap(b).ok()) else {
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
