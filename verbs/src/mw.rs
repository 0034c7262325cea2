//! Memory windows (type 2): one registration of a region serves many peers, each through a
//! window of its own. A type 2 window is bound by a work request on one QP and then gives
//! remote access — with the window's rights, over the window's range — only to requests that
//! arrive on that QP; dropping the window deallocates it, and its rkey dies at once.
//!
//! The memory region is registered with [`Access::MW_BIND`] and no remote access, so its own
//! rkey opens nothing: every remote byte goes through a window.
#![allow(unsafe_code)]

use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys::{
    ibv_alloc_mw, ibv_dealloc_mw, ibv_mw, ibv_mw_bind_info, ibv_mw_type, ibv_qp_to_qp_ex,
    ibv_send_flags, ibv_wr_bind_mw, ibv_wr_complete, ibv_wr_start,
};
use sideway::ibverbs::queue_pair::QueuePair as _;
use tracing::Instrument as _;

use crate::cq::Queue;
use crate::error::{Call, Error, Result};
use crate::local::{Local, RegionRef};
use crate::mr::{Access, MemoryRegion, ProtectionDomain, RemoteSlice};
use crate::qp::QueuePair;

/// An allocated window; deallocated on drop.
struct RawMw(NonNull<ibv_mw>);

// SAFETY: libibverbs objects may be used from any thread; the pointer is used only by `Drop`
// (once, with `&mut self`) after allocation.
unsafe impl Send for RawMw {}
// SAFETY: as above: no method reads through the pointer from a shared reference.
unsafe impl Sync for RawMw {}

impl Drop for RawMw {
    fn drop(&mut self) {
        // SAFETY: the window was allocated by ibv_alloc_mw and is deallocated only here; its PD
        // is kept alive by the `WindowInner` that owns this (the PD field drops after it).
        // Deallocating a bound window invalidates it: requests that use its rkey afterwards
        // fail with a remote access error.
        let ret = unsafe { ibv_dealloc_mw(self.0.as_ptr()) };
        if ret != 0 {
            tracing::warn!(errno = ret, "ibv_dealloc_mw failed");
        }
    }
}

struct WindowInner {
    // drop order: the window dies (its rkey with it) before the region it covers is released,
    // and both before the PD
    mw: RawMw,
    mr: Arc<dyn RegionRef>,
    _pd: ProtectionDomain,
    rkey: u32,
    addr: u64,
    len: u64,
    access: Access,
    qpn: u32,
}

impl fmt::Debug for WindowInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("qpn", &self.qpn)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("rkey", &self.rkey)
            .field("access", &self.access)
            .finish()
    }
}

impl RegionRef for WindowInner {
    fn memory_region(&self) -> &MemoryRegion {
        self.mr.memory_region()
    }
}

/// A type 2 memory window bound on one QP over a range of a memory region. It keeps the
/// region registered while it lives; dropping it revokes its rkey.
#[derive(Debug)]
pub struct MemoryWindow {
    inner: Arc<WindowInner>,
}

impl MemoryWindow {
    /// The rkey a peer uses, on the QP the window is bound to only.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    /// Address of the window's first byte (the region's addressing: not zero-based).
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }
    /// Whether the window is empty (never: an empty bind is refused).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// What a peer may do through it.
    pub fn access(&self) -> Access {
        self.inner.access
    }
    /// The QP it is bound to.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }
    /// The window as a remote slice (what a peer is told).
    pub fn remote(&self) -> RemoteSlice {
        RemoteSlice {
            addr: self.inner.addr,
            rkey: self.inner.rkey,
            len: self.inner.len,
        }
    }
}

/// The next key of an rkey: same index (upper 24 bits), the 8-bit key incremented, as a bind
/// requires a key different from the window's current one.
fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

fn check_bind(
    qp_pd: &ProtectionDomain,
    mr: &MemoryRegion,
    range: &Range<u64>,
    access: Access,
) -> Result<()> {
    if !mr.pd().same(qp_pd) {
        return Err(Error::InvalidArgument(
            "a memory window can only be bound over a region of the QP's own protection domain"
                .into(),
        ));
    }
    if !mr.access().contains(Access::MW_BIND) {
        return Err(Error::InvalidArgument(format!(
            "the region was registered without MW_BIND ({}): no window can be bound over it",
            mr.access()
        )));
    }
    if access.bits() & !(Access::REMOTE_READ | Access::REMOTE_WRITE).bits() != 0
        || access == Access::NONE
    {
        return Err(Error::InvalidArgument(format!(
            "a window grants remote read and/or remote write, not {access}"
        )));
    }
    if access.contains(Access::REMOTE_WRITE) && !mr.access().contains(Access::LOCAL_WRITE) {
        return Err(Error::InvalidArgument(
            "a remotely writable window needs a region registered with LOCAL_WRITE".into(),
        ));
    }
    if range.start >= range.end || range.end > mr.len() as u64 {
        return Err(Error::OutOfBounds {
            what: "memory region",
            offset: range.start,
            len: range.end.saturating_sub(range.start),
            size: mr.len() as u64,
        });
    }
    Ok(())
}

impl QueuePair {
    /// Bind a type 2 memory window over `range` of `mr` on this QP, granting `access`
    /// (remote read and/or write) to requests that arrive on this QP only. The QP must be
    /// connected and created with [`crate::QpOptions::memory_windows`]; `mr` must be in the
    /// QP's PD and registered with [`Access::MW_BIND`]. The bind is a work request: this waits
    /// for its completion. If the future is dropped first, the window stays with the CQ until
    /// the bind completes, and is then deallocated.
    pub async fn bind_window(
        &self,
        mr: Arc<dyn RegionRef>,
        range: Range<u64>,
        access: Access,
    ) -> Result<MemoryWindow> {
        let region = mr.memory_region();
        check_bind(self.pd(), region, &range, access)?;
        if !self.memory_windows() {
            return Err(Error::InvalidArgument(format!(
                "QP {} was created without memory windows (QpOptions::memory_windows)",
                self.qpn()
            )));
        }
        let addr = region.addr() + range.start;
        let len = range.end - range.start;
        // SAFETY: the PD is live while `self` (which holds it) is borrowed; ibv_alloc_mw only
        // reads the PD and its context, and reports a missing provider op as EOPNOTSUPP.
        let raw =
            unsafe { ibv_alloc_mw(self.pd().inner.pd().as_ptr(), ibv_mw_type::IBV_MW_TYPE_2) };
        let Some(raw) = NonNull::new(raw) else {
            return Err(Error::verbs(
                Call::AllocMw,
                self.pd().context().name().to_string(),
                std::io::Error::last_os_error(),
            ));
        };
        let mw = RawMw(raw);
        // SAFETY: `raw` was just allocated and is live (owned by `mw`).
        let rkey = next_rkey(unsafe { (*raw.as_ptr()).rkey });
        let inner = Arc::new(WindowInner {
            mw,
            mr: Arc::clone(&mr),
            _pd: self.pd().clone(),
            rkey,
            addr,
            len,
            access,
            qpn: self.qpn(),
        });
        let (id, rx) = self.post_bind(&inner, region)?;
        let pending = self.pending(vec![(id, rx, "BIND_MW")]);
        pending.wait().instrument(self.span()).await?;
        tracing::debug!(qpn = self.qpn(), addr, len, rkey, %access, "memory window bound");
        Ok(MemoryWindow { inner })
    }

    /// Post the bind work request of `inner` (signaled), registering it with the CQ so that
    /// the pending table holds the window until it completes.
    fn post_bind(
        &self,
        inner: &Arc<WindowInner>,
        region: &MemoryRegion,
    ) -> Result<(u64, tokio::sync::oneshot::Receiver<crate::cq::Done>)> {
        let (addr, len, access, rkey) = (inner.addr, inner.len, inner.access, inner.rkey);
        let holder: Arc<dyn RegionRef> = inner.clone();
        let mut state = self.cq().lock();
        self.check_not_prepared()?;
        self.check_send_room(&state, 1)?;
        // the pending table holds the window (and so the region) until the bind completes
        let (id, rx) = state.register(Some(Local::Region(holder, 0..0)), Queue::Send);
        let posted = {
            let guard = self.lock_qp();
            // SAFETY: the QP was created by ibv_create_qp_ex (`QueuePair::new`), so its
            // ibv_qp is embedded in an ibv_qp_ex, which ibv_qp_to_qp_ex returns; it is live
            // while `guard` (the QP's lock) is held, and posting is serialized by that lock.
            let qpx = unsafe { ibv_qp_to_qp_ex(guard.qp().as_ptr()) };
            // SAFETY: `qpx` is live when not null (above); reading a function pointer field.
            let can_bind = !qpx.is_null() && unsafe { (*qpx).wr_bind_mw.is_some() };
            if !can_bind {
                Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))
            } else {
                let info = ibv_mw_bind_info {
                    // SAFETY: the MR is live: `inner` holds it, and the pending entry holds
                    // `inner` until the bind completes.
                    mr: unsafe { region.raw().mr().as_ptr() },
                    addr,
                    length: len,
                    mw_access_flags: access.bits(),
                };
                // SAFETY: `qpx` is live and locked (above); wr_bind_mw is present (checked);
                // the window and the MR outlive the work request (the pending entry holds
                // them); `info` is read during the call only.
                let ret = unsafe {
                    ibv_wr_start(qpx);
                    (*qpx).wr_id = id;
                    (*qpx).wr_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                    ibv_wr_bind_mw(qpx, inner.mw.0.as_ptr(), rkey, &info);
                    ibv_wr_complete(qpx)
                };
                if ret == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::from_raw_os_error(ret))
                }
            }
        };
        if let Err(e) = posted {
            state.unregister(&[id]);
            return Err(Error::verbs(
                Call::BindMw,
                format!(
                    "QP {}: window of {len} bytes at {addr:#x}, {access}",
                    self.qpn()
                ),
                e,
            ));
        }
        drop(state);
        Ok((id, rx))
    }
}

/// A staging buffer lent to one peer for good: a read-only window over all of it, bound on one
/// QP and kept bound while its owner rewrites the buffer, so that a peer reading chunk after
/// chunk through the same slot costs no bind per chunk.
///
/// What the peer on that QP may see: at any time, any byte of the buffer, including bytes being
/// rewritten (a READ racing with [`StandingWindow::as_mut_slice`] gets some mix of old and new
/// bytes). So the owner writes into it only bytes that peer may read, and the buffer must start
/// that way: [`QueuePair::bind_standing`] takes it with whatever it holds when the bind
/// completes. No other QP can use the window, and the buffer's own registration grants no
/// remote access. [`StandingWindow::into_buffer`] revokes the window and gives the buffer back.
#[derive(Debug)]
pub struct StandingWindow {
    // drop order: the window (its rkey dies, and with it the last remote access), then the
    // buffer
    window: MemoryWindow,
    /// The window's `WindowInner` holds the other reference (for the MR under it); nothing
    /// else does once the bind has completed.
    buf: Arc<crate::mr::RegisteredBuffer>,
}

/// A standing window that could not be bound: the error, and the buffer when it is free again
/// (`None` only if the device still holds it).
#[derive(Debug)]
pub struct StandingBindError {
    /// Why.
    pub error: Error,
    /// The buffer, to reuse.
    pub buf: Option<crate::mr::RegisteredBuffer>,
}

impl StandingWindow {
    /// The rkey the peer uses (on the window's QP only).
    pub fn rkey(&self) -> u32 {
        self.window.rkey()
    }
    /// Address of the buffer's first byte, where the window starts.
    pub fn addr(&self) -> u64 {
        self.window.addr()
    }
    /// Length of the buffer and the window.
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// Whether empty (never: an empty bind is refused).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    /// The QP it is bound to.
    pub fn qpn(&self) -> u32 {
        self.window.qpn()
    }
    /// `len` bytes from `offset` as the peer is told (checked against the buffer).
    pub fn remote(&self, offset: u64, len: u64) -> Result<RemoteSlice> {
        self.window.remote().slice(offset, len)
    }
    /// The buffer's bytes, writable while the window stays bound: the peer on the window's QP
    /// may read any of them at any time, even while they are written (see the type's
    /// documentation), and no one else can.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let (ptr, len) = (self.buf.host_ptr(), self.buf.len());
        // SAFETY: `ptr` is the start of the buffer's mapping of `len` bytes, which lives as long
        // as `self.buf` (borrowed for the returned lifetime through `&mut self`). No other Rust
        // access to these bytes can exist while the slice does: the only other reference to the
        // buffer is the window's `WindowInner`, which uses only the MR (never the bytes), the
        // bind's pending entry that briefly held one more was dropped when `bind_standing`
        // collected the completion, and `StandingWindow` hands out no `&RegisteredBuffer`;
        // `&mut self` makes this slice the only one. The NIC's reads through the window are
        // device accesses outside the program, which may observe the bytes mid-write; that is
        // the documented contract, not undefined behaviour.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }
    /// Revoke the window (its rkey dies at once) and take the buffer back; `None` if something
    /// still holds it (nothing does once the bind completed).
    pub fn into_buffer(self) -> Option<crate::mr::RegisteredBuffer> {
        let StandingWindow { window, buf } = self;
        drop(window);
        Arc::try_unwrap(buf).ok()
    }
}

impl QueuePair {
    /// Bind a read-only window over all of `buf` on this QP and keep it bound: a
    /// [`StandingWindow`], which its owner may rewrite while the peer on this QP reads it. The
    /// buffer must be registered with [`Access::MW_BIND`] and no remote access of its own, and
    /// hold only bytes that peer may read. On failure the buffer comes back with the error
    /// (unless the device still holds it, as after a dropped future).
    pub async fn bind_standing(
        &self,
        buf: crate::mr::RegisteredBuffer,
    ) -> std::result::Result<StandingWindow, StandingBindError> {
        let own = buf.mr().access();
        if own.contains(Access::REMOTE_READ) || own.contains(Access::REMOTE_WRITE) {
            return Err(StandingBindError {
                error: Error::InvalidArgument(format!(
                    "a standing window's buffer must grant no remote access of its own ({own}): \
                     its rkey would open it to every QP of the protection domain"
                )),
                buf: Some(buf),
            });
        }
        let len = buf.len() as u64;
        let buf = Arc::new(buf);
        let mr: Arc<dyn RegionRef> = buf.clone();
        match self.bind_window(mr, 0..len, Access::REMOTE_READ).await {
            Ok(window) => Ok(StandingWindow { window, buf }),
            Err(error) => Err(StandingBindError {
                error,
                buf: Arc::try_unwrap(buf).ok(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::next_rkey;

    #[test]
    fn the_next_rkey_keeps_the_index_and_wraps_the_key() {
        assert_eq!(next_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(next_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(next_rkey(u32::MAX), 0xffff_ff00);
    }
}
