//! Protection domains and memory regions (pinned, ODP, dma-buf).
//!
//! Lifetimes are encoded in types: a [`MemoryRegion`] holds its [`ProtectionDomain`] (which holds
//! the device context), so it cannot outlive them; a [`RegisteredBuffer`] owns both the memory
//! and the MR that covers it and deregisters before unmapping.
#![allow(unsafe_code)]

use std::fmt;
use std::ops::{BitOr, BitOrAssign, Range};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sideway::ibverbs::protection_domain::ProtectionDomain as SwPd;
use sideway::ibverbs::AccessFlags;

use crate::device::{io_of, Context};
use crate::error::{Call, Error, Result};
use crate::ffi;
use crate::memory::{HostBuffer, SharedMemory};

/// Access rights of a memory region (local read is always allowed).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Access(u32);

impl Access {
    /// Nothing but local read.
    pub const NONE: Access = Access(0);
    /// The NIC may write into the region for local operations (RECV, READ destination).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote peers may RDMA READ from it.
    pub const REMOTE_READ: Access = Access(4);
    /// Remote atomics.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Memory windows may be bound to the region (`IBV_ACCESS_MW_BIND`): remote peers reach
    /// it only through a window's rkey, with the window's rights, on the QP it is bound to.
    pub const MW_BIND: Access = Access(16);
    /// Everything a loopback test or a read-write region needs.
    pub const ALL: Access = Access(1 | 2 | 4 | 8);

    /// Whether all bits of `other` are set.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Raw bits (`IBV_ACCESS_*` values).
    pub fn bits(self) -> u32 {
        self.0
    }

    fn to_sideway(self) -> AccessFlags {
        let mut f = AccessFlags::none();
        if self.contains(Access::LOCAL_WRITE) {
            f |= AccessFlags::LocalWrite;
        }
        if self.contains(Access::REMOTE_WRITE) {
            f |= AccessFlags::RemoteWrite;
        }
        if self.contains(Access::REMOTE_READ) {
            f |= AccessFlags::RemoteRead;
        }
        if self.contains(Access::REMOTE_ATOMIC) {
            f |= AccessFlags::RemoteAtomic;
        }
        if self.contains(Access::MW_BIND) {
            f |= AccessFlags::MemoryWindowBind;
        }
        f
    }

    fn validate(self) -> Result<()> {
        if (self.contains(Access::REMOTE_WRITE) || self.contains(Access::REMOTE_ATOMIC))
            && !self.contains(Access::LOCAL_WRITE)
        {
            return Err(Error::InvalidArgument(
                "REMOTE_WRITE and REMOTE_ATOMIC access need LOCAL_WRITE too (ibv_reg_mr(3))".into(),
            ));
        }
        Ok(())
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = vec!["local-read"];
        for (bit, name) in [
            (Access::LOCAL_WRITE, "local-write"),
            (Access::REMOTE_READ, "remote-read"),
            (Access::REMOTE_WRITE, "remote-write"),
            (Access::REMOTE_ATOMIC, "remote-atomic"),
            (Access::MW_BIND, "mw-bind"),
        ] {
            if self.contains(bit) {
                parts.push(name);
            }
        }
        f.write_str(&parts.join(","))
    }
}

/// How a region is registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RegMode {
    /// Pages are pinned at registration (`ibv_reg_mr`).
    Pinned,
    /// On-demand paging (`IBV_ACCESS_ON_DEMAND`): pages are faulted in by the NIC.
    #[serde(rename = "odp")]
    OnDemand,
    /// A dma-buf exported by a device driver (`ibv_reg_dmabuf_mr`).
    DmaBuf,
}

impl fmt::Display for RegMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegMode::Pinned => "pinned",
            RegMode::OnDemand => "odp",
            RegMode::DmaBuf => "dma-buf",
        })
    }
}

/// A protection domain. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<SwPd>,
    ctx: Context,
}

impl ProtectionDomain {
    /// Allocate a PD on `ctx`.
    pub fn new(ctx: &Context) -> Result<ProtectionDomain> {
        let inner = ctx
            .inner
            .alloc_pd()
            .map_err(|e| Error::verbs(Call::AllocPd, ctx.name().to_string(), io_of(&e)))?;
        Ok(ProtectionDomain {
            inner,
            ctx: ctx.clone(),
        })
    }

    /// Whether `other` is this very PD (a clone of it), so that memory registered in one may be
    /// used by work requests of the other's QPs.
    pub fn same(&self, other: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Register an owned host buffer; the result owns both.
    pub fn register(
        &self,
        mem: HostBuffer,
        access: Access,
        mode: RegMode,
    ) -> Result<RegisteredBuffer> {
        // SAFETY: `mem` is moved into the returned `RegisteredBuffer`, which drops the MR before
        // the mapping, so the memory is valid for the whole life of the registration.
        let mr =
            unsafe { self.register_raw(mem.map.as_ptr() as usize, mem.map.len(), access, mode)? };
        Ok(RegisteredBuffer { mr, mem })
    }

    /// Register memory this crate does not own (device mappings, memory of an embedding app).
    ///
    /// # Safety
    /// `addr..addr+len` must stay mapped (and, for pinned MRs, not be remapped) until the
    /// returned region and every work request that uses it are gone.
    pub unsafe fn register_raw(
        &self,
        addr: usize,
        len: usize,
        access: Access,
        mode: RegMode,
    ) -> Result<MemoryRegion> {
        access.validate()?;
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty range".into(),
            ));
        }
        let (flags, call) = match mode {
            RegMode::Pinned => (access.to_sideway(), Call::RegMr),
            RegMode::OnDemand => (access.to_sideway() | AccessFlags::OnDemand, Call::RegMrOdp),
            RegMode::DmaBuf => {
                return Err(Error::InvalidArgument(
                    "a dma-buf region is registered with register_dmabuf(fd, ...)".into(),
                ))
            }
        };
        // SAFETY: the caller guarantees the range stays valid for the life of the MR.
        let mr = unsafe { self.inner.reg_mr(addr, len, flags) }.map_err(|e| {
            Error::verbs(
                call,
                format!("{}: {len} bytes at {addr:#x}, {access}", self.ctx.name()),
                io_of(&e),
            )
        })?;
        tracing::debug!(device = self.ctx.name(), addr, len, %mode, %access, lkey = mr.lkey(), "registered MR");
        Ok(MemoryRegion {
            inner: mr,
            pd: self.clone(),
            addr: addr as u64,
            len,
            access,
            mode,
            _dmabuf: None,
        })
    }

    /// Whether the driver accepts dma-buf MRs, found without any dma-buf: `ibv_reg_dmabuf_mr`
    /// with fd -1 fails with EBADF in a driver that would look the fd up (supported) and with
    /// EOPNOTSUPP in one that refuses dma-bufs outright (the user-space provider or the kernel).
    pub fn probe_dmabuf_mr(&self) -> DmabufSupport {
        // SAFETY: fd -1 is never a valid file, so no memory is registered: the provider or the
        // kernel fails before looking at any buffer. Should a driver nevertheless return an MR,
        // sideway's MR owns it and deregisters it when dropped here.
        let r = unsafe {
            self.inner
                .reg_dmabuf_mr(0, 4096, 0, -1, Access::LOCAL_WRITE.to_sideway())
        };
        match r {
            Ok(_) => DmabufSupport::Unknown("a dma-buf MR on fd -1 was accepted".into()),
            Err(e) => match io_of(&e).raw_os_error() {
                Some(libc::EBADF) => DmabufSupport::Supported,
                Some(libc::EOPNOTSUPP) => DmabufSupport::Unsupported,
                Some(n) => DmabufSupport::Unknown(format!(
                    "ibv_reg_dmabuf_mr(fd=-1) failed with errno {n} ({})",
                    std::io::Error::from_raw_os_error(n)
                )),
                None => DmabufSupport::Unknown(format!("ibv_reg_dmabuf_mr(fd=-1): {e}")),
            },
        }
    }

    /// Register `len` bytes at `offset` of a dma-buf; the region's addresses start at `iova`.
    /// The fd is duplicated and kept open for the life of the region.
    pub fn register_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<MemoryRegion> {
        access.validate()?;
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| Error::verbs(Call::RegDmabufMr, "dup of the dma-buf fd", e))?;
        // SAFETY: the kernel takes its own reference on the dma-buf for the MR; `owned` keeps
        // the fd open as long as the region exists; offset/len/iova are checked by the kernel
        // against the dma-buf size.
        let mr = unsafe {
            self.inner
                .reg_dmabuf_mr(offset, len, iova, owned.as_raw_fd(), access.to_sideway())
        }
        .map_err(|e| {
            Error::verbs(
                Call::RegDmabufMr,
                format!(
                    "{}: dma-buf fd {}, offset {offset}, {len} bytes",
                    self.ctx.name(),
                    fd.as_raw_fd()
                ),
                io_of(&e),
            )
        })?;
        Ok(MemoryRegion {
            inner: mr,
            pd: self.clone(),
            addr: iova,
            len,
            access,
            mode: RegMode::DmaBuf,
            _dmabuf: Some(owned),
        })
    }
}

/// A registered memory region.
pub struct MemoryRegion {
    inner: Arc<sideway::ibverbs::memory_region::MemoryRegion>,
    pd: ProtectionDomain,
    addr: u64,
    len: usize,
    access: Access,
    mode: RegMode,
    _dmabuf: Option<OwnedFd>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("device", &self.pd.context().name())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access)
            .field("mode", &self.mode)
            .finish()
    }
}

impl MemoryRegion {
    /// The binding's region object (for the FFI modules that bind windows over it).
    pub(crate) fn raw(&self) -> &sideway::ibverbs::memory_region::MemoryRegion {
        &self.inner
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey()
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey()
    }
    /// Start address (the iova for dma-buf regions).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the region is empty (never: registration refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.access
    }
    /// Registration mode.
    pub fn mode(&self) -> RegMode {
        self.mode
    }
    /// The PD.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// What a peer needs for one-sided access to `range` of this region.
    pub fn remote(&self, range: Range<u64>) -> Result<RemoteSlice> {
        if range.start > range.end || range.end > self.len as u64 {
            return Err(Error::OutOfBounds {
                what: "memory region",
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                size: self.len as u64,
            });
        }
        Ok(RemoteSlice {
            addr: self.addr + range.start,
            rkey: self.rkey(),
            len: range.end - range.start,
        })
    }

    /// Ask the device to fault in (ODP) pages of `range` now (`ibv_advise_mr`, flushed).
    pub fn prefetch(&self, range: Range<u64>, write: bool) -> Result<()> {
        if self.mode != RegMode::OnDemand {
            return Err(Error::InvalidArgument(
                "prefetch applies to ODP regions only".into(),
            ));
        }
        let r = self.remote(range.clone())?;
        let len = u32::try_from(r.len)
            .map_err(|_| Error::InvalidArgument("prefetch range over 4 GiB".into()))?;
        // SAFETY: the raw PD pointer is used only during this call while `self.pd` keeps the PD
        // alive; the lkey is this live ODP MR's and `r` was bounds-checked against it.
        let res =
            unsafe { ffi::advise_mr_prefetch(self.pd.inner.pd(), write, self.lkey(), r.addr, len) };
        res.map_err(|e| {
            Error::verbs(
                Call::AdviseMr,
                format!("{}: {} bytes", self.pd.context().name(), r.len),
                e,
            )
        })
    }
}

/// The address, rkey and length a peer uses for one-sided RDMA on (part of) a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSlice {
    /// Remote virtual address (or iova).
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteSlice {
    /// The sub-slice at `offset` of `len` bytes. The peer chose `addr` and `len`: a slice whose
    /// addresses would wrap past `u64::MAX` is refused like one past the end.
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteSlice> {
        let addr = self.addr.checked_add(offset);
        let fits = self.addr.checked_add(self.len).is_some();
        match (offset.checked_add(len), addr) {
            (Some(end), Some(addr)) if end <= self.len && fits => Ok(RemoteSlice {
                addr,
                rkey: self.rkey,
                len,
            }),
            _ => Err(Error::OutOfBounds {
                what: "remote slice",
                offset,
                len,
                size: self.len,
            }),
        }
    }
}

impl ProtectionDomain {
    /// Register `range` of shared memory (e.g. one object of an arena).
    pub fn register_shared_range(
        &self,
        mem: &Arc<SharedMemory>,
        range: Range<usize>,
        access: Access,
        mode: RegMode,
    ) -> Result<SharedRegion> {
        if range.start >= range.end || range.end > mem.len() {
            return Err(Error::OutOfBounds {
                what: "shared memory",
                offset: range.start as u64,
                len: range.end.saturating_sub(range.start) as u64,
                size: mem.len() as u64,
            });
        }
        if !mem.writable
            && (access.contains(Access::LOCAL_WRITE) || access.contains(Access::REMOTE_WRITE))
        {
            return Err(Error::InvalidArgument(
                "read-only memory can only be registered with local/remote read access".into(),
            ));
        }
        // SAFETY: the range is inside the mapping (checked above); the returned `SharedRegion`
        // holds an `Arc` of the memory and drops the MR first, so the mapping outlives the
        // registration.
        let mr = unsafe {
            self.register_raw(
                mem.map.as_ptr() as usize + range.start,
                range.end - range.start,
                access,
                mode,
            )?
        };
        Ok(SharedRegion {
            mr,
            mem: Arc::clone(mem),
            window_offset: range.start as u64,
        })
    }
}

/// An MR over [`SharedMemory`]. Dropping it deregisters (the rkey dies); the memory lives on
/// while other holders remain.
#[derive(Debug)]
pub struct SharedRegion {
    // the MR is dropped before the memory's Arc
    mr: MemoryRegion,
    mem: Arc<SharedMemory>,
    window_offset: u64,
}

impl SharedRegion {
    /// The MR.
    pub fn mr(&self) -> &MemoryRegion {
        &self.mr
    }
    /// The memory.
    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.mem
    }
    /// Where in the memory the registered range starts.
    pub fn window_offset(&self) -> u64 {
        self.window_offset
    }
}

/// Host memory together with the MR that covers it. Dropping it deregisters, then unmaps.
#[derive(Debug)]
pub struct RegisteredBuffer {
    // field order matters: the MR is dropped (deregistered) before the memory is unmapped
    mr: MemoryRegion,
    mem: HostBuffer,
}

impl RegisteredBuffer {
    /// The MR.
    pub fn mr(&self) -> &MemoryRegion {
        &self.mr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.mem.len()
    }
    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }
    /// Whether a remote peer holding the rkey may write this buffer at any time (it was
    /// registered with [`Access::REMOTE_WRITE`], or with [`Access::MW_BIND`] and
    /// [`Access::LOCAL_WRITE`], so that a writable memory window may be bound over it). Such a
    /// buffer is never lent out as a Rust reference: read and write it with
    /// [`RegisteredBuffer::read_at`] / [`RegisteredBuffer::write_at`].
    pub fn remotely_writable(&self) -> bool {
        let a = self.mr.access();
        a.contains(Access::REMOTE_WRITE) || a.contains(Access::MW_BIND | Access::LOCAL_WRITE)
    }
    /// Contents. While the buffer is not posted, only a remote peer could change it, and one
    /// can only with an rkey that allows remote writes.
    ///
    /// # Panics
    /// When the buffer is [remotely writable](RegisteredBuffer::remotely_writable): a `&[u8]`
    /// promises bytes that do not change while it lives, which a remote writer would break.
    pub fn as_slice(&self) -> &[u8] {
        self.assert_local_only("as_slice");
        self.mem.as_slice()
    }
    /// Contents, writable (no work request can be using the buffer: posting takes ownership).
    /// Unlike [`RegisteredBuffer::as_slice`], this works on a buffer registered for memory
    /// windows (`MW_BIND`) without remote write of its own: a window holds the buffer through
    /// an `Arc` ([`crate::QueuePair::bind_window`]), so while `&mut self` exists no window is
    /// bound over it, and the MR's own rkey lets no peer write.
    ///
    /// # Panics
    /// When the registration itself grants `REMOTE_WRITE`.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        assert!(
            !self.mr.access().contains(Access::REMOTE_WRITE),
            "RegisteredBuffer::as_mut_slice on a buffer registered with REMOTE_WRITE: a remote \
             peer may change it at any time; use read_at/write_at/to_vec"
        );
        self.mem.as_mut_slice()
    }
    /// The first byte of the buffer's memory, for [`crate::StandingWindow`], which writes it
    /// while a window over it stays bound.
    pub(crate) fn host_ptr(&self) -> *mut u8 {
        self.mem.map.as_ptr()
    }
    /// Copy `out.len()` bytes from `offset` out of the buffer; works for every buffer (a remote
    /// write racing with the copy leaves unspecified bytes in `out`, never undefined behaviour).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        self.mem.map.copy_out(offset, out);
        Ok(())
    }
    /// Copy `data` into the buffer at `offset`; works for every buffer.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        self.mem.map.copy_in(offset, data);
        Ok(())
    }
    /// The byte at `offset`, read from memory on every call (a volatile load): for loops that
    /// busy-wait for a remote WRITE to land, as perftest's latency tests wait for a message's
    /// last byte to change. Works for every buffer.
    pub fn load_byte(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1)?;
        Ok(self.mem.map.load_volatile(offset))
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.mem.map.copy_out(0, &mut v);
        v
    }
    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::OutOfBounds {
                what: "registered buffer",
                offset: offset as u64,
                len: len as u64,
                size: self.len() as u64,
            }),
        }
    }
    fn assert_local_only(&self, what: &str) {
        assert!(
            !self.remotely_writable(),
            "RegisteredBuffer::{what} on a buffer registered with REMOTE_WRITE: a remote peer may \
             change it at any time; use read_at/write_at/to_vec"
        );
    }
    /// The address of byte 0.
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }
}
/// What [`ProtectionDomain::probe_dmabuf_mr`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", content = "detail", rename_all = "kebab-case")]
pub enum DmabufSupport {
    /// The driver looks dma-buf fds up (EBADF for fd -1).
    Supported,
    /// The driver refuses dma-buf MRs (EOPNOTSUPP).
    Unsupported,
    /// Something else happened.
    Unknown(String),
}

#[cfg(test)]
mod tests {
    use super::RemoteSlice;

    #[test]
    fn remote_slices_never_wrap() {
        let r = RemoteSlice {
            addr: 4096,
            rkey: 7,
            len: 100,
        };
        let s = r.slice(10, 90).unwrap();
        assert_eq!((s.addr, s.len, s.rkey), (4106, 90, 7));
        assert!(r.slice(10, 91).is_err());
        assert!(r.slice(u64::MAX, 2).is_err());
        // a peer's address at the top of the space: no overflow, no panic
        let top = RemoteSlice {
            addr: u64::MAX,
            rkey: 1,
            len: 10,
        };
        assert!(top.slice(1, 1).is_err());
        assert!(
            top.slice(0, 1).is_err(),
            "addr + len wraps: the whole slice is invalid"
        );
        let edge = RemoteSlice {
            addr: u64::MAX - 10,
            rkey: 1,
            len: 10,
        };
        assert_eq!(edge.slice(9, 1).unwrap().addr, u64::MAX - 1);
    }
}
