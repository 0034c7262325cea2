//! The raw libibverbs calls that `sideway` does not wrap, and the host-memory mapping used by
//! [`crate::HostBuffer`]. Every `unsafe` block of this crate that is not in `cq.rs`, `mr.rs`
//! or `qp.rs` lives here; each states the invariant it relies on.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use sideway::ibverbs::device_context::DeviceContext;

use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_advise_mr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device_attr_ex,
    ibv_get_cq_event, ibv_pd, ibv_query_device_ex, ibv_req_notify_cq, ibv_sge,
};

/// Check that the real libibverbs can be loaded: the bindings load it lazily, so a missing
/// library would otherwise show up as an empty device list or EOPNOTSUPP.
pub(crate) fn libibverbs_loadable() -> Result<(), String> {
    const NAME: &CStr = c"libibverbs.so.1";
    // SAFETY: `NAME` is a valid NUL-terminated string; dlopen has no other preconditions.
    // Loading libibverbs runs its constructors, which the device list call would run anyway.
    let handle = unsafe { libc::dlopen(NAME.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by the loader, which we copy
        // before any other dl* call can invalidate it.
        let msg = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "dlopen(libibverbs.so.1) failed".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(msg);
    }
    // The handle is deliberately kept open: the library stays loaded for the process anyway.
    Ok(())
}

/// On-demand paging capabilities (`struct ibv_odp_caps`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawOdpCaps {
    pub(crate) general_caps: u64,
    pub(crate) rc_odp_caps: u32,
}

/// `ibv_query_device_ex` for the fields `sideway` does not expose.
pub(crate) fn query_odp_caps(ctx: &DeviceContext) -> io::Result<RawOdpCaps> {
    let mut attr = MaybeUninit::<ibv_device_attr_ex>::zeroed();
    // SAFETY: the raw context is used only within this call, while `ctx` (which owns it and
    // closes it on drop) is borrowed, so it is live.
    let raw: NonNull<ibv_context> = unsafe { ctx.context() };
    // SAFETY: `raw` is live (above); `attr` is a zeroed, writable `ibv_device_attr_ex`, and a
    // NULL input is allowed by ibv_query_device_ex(3).
    let ret = unsafe { ibv_query_device_ex(raw.as_ptr(), std::ptr::null(), attr.as_mut_ptr()) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    // SAFETY: the call succeeded, so the struct was filled in (and it was zeroed before).
    let attr = unsafe { attr.assume_init() };
    Ok(RawOdpCaps {
        general_caps: attr.odp_caps.general_caps,
        rc_odp_caps: attr.odp_caps.per_transport_caps.rc_odp_caps,
    })
}

/// `ibv_req_notify_cq(cq, 0)`.
///
/// # Safety
/// `cq` must be a live CQ.
pub(crate) unsafe fn req_notify_cq(cq: NonNull<ibv_cq>) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    let ret = unsafe { ibv_req_notify_cq(cq.as_ptr(), 0) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret))
    }
}

/// Non-blocking `ibv_get_cq_event` followed by `ibv_ack_cq_events(cq, 1)`.
/// Returns `Ok(false)` when there was no event (EAGAIN).
///
/// # Safety
/// `channel` must be a live completion channel whose fd is non-blocking, and `expected` the only
/// CQ attached to it (live).
pub(crate) unsafe fn get_and_ack_cq_event(
    channel: NonNull<ibv_comp_channel>,
    expected: NonNull<ibv_cq>,
) -> io::Result<bool> {
    let mut cq: *mut ibv_cq = std::ptr::null_mut();
    let mut ctx: *mut libc::c_void = std::ptr::null_mut();
    // SAFETY: `channel` is live (caller); the out-pointers point to valid locals.
    let ret = unsafe { ibv_get_cq_event(channel.as_ptr(), &mut cq, &mut ctx) };
    if ret != 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::EAGAIN) => Ok(false),
            _ => Err(err),
        };
    }
    debug_assert_eq!(
        cq,
        expected.as_ptr(),
        "completion channel shared between CQs"
    );
    // SAFETY: `cq` was just returned by ibv_get_cq_event for this channel, so it is live and
    // has exactly one unacknowledged event, which we acknowledge (destroy_cq waits for it).
    unsafe { ibv_ack_cq_events(cq, 1) };
    Ok(true)
}

/// `poll(2)` for `fd` readable, at most `timeout_ms` milliseconds: whether it is. A signal
/// that interrupts the wait counts as not readable (the caller polls its CQ and waits again).
pub(crate) fn wait_readable(fd: std::os::fd::RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid, initialised pollfd on our stack and nfds is 1, so poll reads and
    // writes only that struct; an fd that is not open is reported in `revents`, not undefined.
    let ret = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::EINTR) => Ok(false),
            _ => Err(err),
        };
    }
    Ok(ret > 0 && pfd.revents & libc::POLLIN != 0)
}

/// `ibv_advise_mr(pd, PREFETCH[_WRITE], FLUSH, sge)`.
///
/// # Safety
/// `pd` must be live and `lkey` the lkey of a live ODP MR of that PD covering `addr..addr+len`.
pub(crate) unsafe fn advise_mr_prefetch(
    pd: NonNull<ibv_pd>,
    write: bool,
    lkey: u32,
    addr: u64,
    len: u32,
) -> io::Result<()> {
    const IB_UVERBS_ADVISE_MR_FLAG_FLUSH: u32 = 1;
    let advice = if write {
        rdma_mummy_sys::ib_uverbs_advise_mr_advice::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE
    } else {
        rdma_mummy_sys::ib_uverbs_advise_mr_advice::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH
    };
    let mut sge = ibv_sge {
        addr,
        length: len,
        lkey,
    };
    // SAFETY: guaranteed by the caller; `sge` is a valid one-element list that outlives the call.
    let ret = unsafe {
        ibv_advise_mr(
            pd.as_ptr(),
            advice,
            IB_UVERBS_ADVISE_MR_FLAG_FLUSH,
            &mut sge,
            1,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret))
    }
}

/// A private anonymous mapping, page aligned, zero filled; unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned exclusively by this value; access to its bytes is
// synchronised by the owners (`&`/`&mut` borrows of `HostBuffer`).
unsafe impl Send for Mapping {}
// SAFETY: as above; shared references only allow reads.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes (rounded up to the page size), optionally from huge pages.
    pub(crate) fn anonymous(len: usize, huge: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length buffer",
            ));
        }
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        if huge {
            flags |= libc::MAP_HUGETLB;
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing touches no
        // existing memory; the result is checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Mapping { ptr, len })
    }

    /// Map `len` bytes of `file` from offset 0, shared (writes reach the file).
    pub(crate) fn file(file: &std::fs::File, len: usize, writable: bool) -> io::Result<Mapping> {
        use std::os::fd::AsRawFd as _;
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot map an empty file",
            ));
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an open file at an address of the kernel's choosing
        // touches no existing memory; the result is checked for MAP_FAILED. (A file truncated
        // behind our back makes accesses past its new end fault: `SharedMemory` therefore never
        // copies a file through the mapping, only through pread/pwrite on the file; the mapping
        // is for the NIC, whose accesses to pinned pages do not fault.)
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Mapping { ptr, len })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The byte at `offset`, read with a volatile load: a loop that waits for a remote write
    /// to change it reads memory every time (a plain load may be hoisted out of the loop).
    pub(crate) fn load_volatile(&self, offset: usize) -> u8 {
        assert!(offset < self.len, "load_volatile out of bounds");
        // SAFETY: `offset` is inside the mapping (asserted), which lives as long as `self`; a
        // single byte is always aligned, and no reference to the mapping is created (a remote
        // write racing with the load leaves an unspecified byte, as for `copy_out`).
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(offset)) }
    }

    /// Copy `out.len()` bytes from `offset` without creating a reference to memory that a
    /// remote peer may be writing concurrently.
    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) {
        assert!(
            offset.checked_add(out.len()).is_some_and(|e| e <= self.len),
            "copy_out out of bounds"
        );
        // SAFETY: the range is inside the mapping (asserted); `out` is a distinct Rust buffer.
        // Remote RDMA writes may race with this copy: the bytes read are then unspecified, which
        // is the documented semantics of reading shared RDMA memory, never undefined behaviour
        // of Rust references (none is created to the mapping).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }

    /// Copy `data` to `offset` (same rules as [`Mapping::copy_out`]); the mapping must be writable.
    pub(crate) fn copy_in(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|e| e <= self.len),
            "copy_in out of bounds"
        );
        // SAFETY: in bounds (asserted), distinct from `data`; the caller checked the mapping is
        // writable.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// `pread(fd, mapping + offset, len, file_offset)`: the kernel moves bytes from the file
    /// into the mapping (with `O_DIRECT` on a block device, by the device's own DMA: for a
    /// P2PDMA mapping, peer to peer). Returns the bytes read.
    pub(crate) fn pread_into(
        &self,
        offset: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        file_offset: u64,
    ) -> io::Result<usize> {
        use std::os::fd::AsRawFd as _;
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "pread_into out of bounds"
        );
        let file_offset = libc::off_t::try_from(file_offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset too large"))?;
        // SAFETY: the destination is `len` bytes inside this mapping (asserted), which lives as
        // long as `self`; no Rust reference to the mapping exists (the kernel writes it, as a
        // remote peer could), and `fd` is borrowed, so it stays open for the call.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                self.ptr.as_ptr().add(offset).cast(),
                len,
                file_offset,
            )
        };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// `pwrite(fd, mapping + offset, len, file_offset)`: the kernel moves bytes from the
    /// mapping into the file. Returns the bytes written.
    pub(crate) fn pwrite_from(
        &self,
        offset: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        file_offset: u64,
    ) -> io::Result<usize> {
        use std::os::fd::AsRawFd as _;
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "pwrite_from out of bounds"
        );
        let file_offset = libc::off_t::try_from(file_offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset too large"))?;
        // SAFETY: the source is `len` bytes inside this mapping (asserted), alive as long as
        // `self`; the kernel only reads it, and `fd` is borrowed for the call.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                self.ptr.as_ptr().add(offset).cast(),
                len,
                file_offset,
            )
        };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// Ask the kernel not to back this mapping with transparent huge pages.
    pub(crate) fn no_huge_pages(&self) -> io::Result<()> {
        // SAFETY: the range is exactly this mapping, which `self` owns; MADV_NOHUGEPAGE only
        // changes how future faults are served and never discards or moves contents.
        let r = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_NOHUGEPAGE) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The bytes as a slice. Only for mappings no remote peer can write: `HostBuffer` is not
    /// registered, and `RegisteredBuffer` refuses (asserts) for REMOTE_WRITE registrations and
    /// copies instead ([`Mapping::copy_out`]).
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes, alive as long as `self`, and zero-filled
        // at creation, so it is initialised. Writers in this process need `&mut self`; the NIC
        // writes it only for a local work request, which owns the buffer while posted (so no
        // borrow exists then), since no rkey that allows remote writes exists for a mapping
        // that reaches here (see above).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access from this process's
        // safe code. (The NIC may write to it only while a work request owns the buffer, which
        // the posting API enforces by moving the buffer into the pending operation; remote
        // writers are excluded as for `as_slice`. A remote reader may read it concurrently,
        // which races on the bytes it receives but never on Rust's view of them.)
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping created by `anonymous` and not unmapped before.
        let ret = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if ret != 0 {
            tracing::error!(error = %io::Error::last_os_error(), len = self.len, "munmap failed");
        }
    }
}

/// One polled work completion.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawWc {
    pub(crate) wr_id: u64,
    pub(crate) status: u32,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    pub(crate) imm: Option<u32>,
}

/// Completions polled by one call of [`poll_cq`] at most.
pub(crate) const POLL_BATCH: usize = 32;

/// `ibv_poll_cq` for up to [`POLL_BATCH`] completions, each handed to `each`. Returns how
/// many. Nothing is allocated: busy-polling callers call this in a tight loop.
///
/// # Safety
/// `cq` must be a live CQ that no other thread polls concurrently.
pub(crate) unsafe fn poll_cq(
    cq: NonNull<ibv_cq>,
    mut each: impl FnMut(RawWc),
) -> io::Result<usize> {
    const IBV_WC_WITH_IMM: u32 = 1 << 1;
    let mut wcs = [const { MaybeUninit::<rdma_mummy_sys::ibv_wc>::uninit() }; POLL_BATCH];
    // SAFETY: `wcs` has room for POLL_BATCH entries; the CQ is live and not polled
    // concurrently (caller).
    let n = unsafe {
        rdma_mummy_sys::ibv_poll_cq(
            cq.as_ptr(),
            POLL_BATCH as i32,
            wcs.as_mut_ptr().cast::<rdma_mummy_sys::ibv_wc>(),
        )
    };
    if n < 0 {
        return Err(io::Error::from_raw_os_error(-n));
    }
    let n = (n as usize).min(POLL_BATCH);
    for wc in &wcs[..n] {
        // SAFETY: ibv_poll_cq initialised the first `n` entries; `ibv_wc` is plain old data.
        let wc = unsafe { wc.assume_init_ref() };
        let imm = if wc.wc_flags & IBV_WC_WITH_IMM != 0 {
            // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate data (network order).
            Some(u32::from_be(unsafe {
                wc.imm_data_invalidated_rkey_union.imm_data
            }))
        } else {
            None
        };
        each(RawWc {
            wr_id: wc.wr_id,
            status: wc.status,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            imm,
        });
    }
    Ok(n)
}

/// `ibv_wr_complete`: hand the work requests started on `qp` (with `ibv_wr_start`) to the
/// device.
///
/// # Safety
/// `qp` must be a live QP created by `ibv_create_qp_ex` on which `ibv_wr_start` was called and
/// neither `ibv_wr_complete` nor `ibv_wr_abort` since, and no other thread may post on its send
/// queue meanwhile.
pub(crate) unsafe fn wr_complete(qp: NonNull<rdma_mummy_sys::ibv_qp>) -> io::Result<()> {
    // SAFETY: a QP created by ibv_create_qp_ex is embedded in an ibv_qp_ex (caller), which
    // ibv_qp_to_qp_ex returns.
    let qpx = unsafe { rdma_mummy_sys::ibv_qp_to_qp_ex(qp.as_ptr()) };
    if qpx.is_null() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: `qpx` is live with started work requests (caller); ibv_wr_complete is set for
    // every QP created with send_ops_flags, as ours are.
    match unsafe { rdma_mummy_sys::ibv_wr_complete(qpx) } {
        0 => Ok(()),
        err => Err(io::Error::from_raw_os_error(err)),
    }
}

/// `ibv_wr_abort`: drop the work requests started on `qp` and not completed.
///
/// # Safety
/// As for [`wr_complete`].
pub(crate) unsafe fn wr_abort(qp: NonNull<rdma_mummy_sys::ibv_qp>) {
    // SAFETY: as in `wr_complete`.
    let qpx = unsafe { rdma_mummy_sys::ibv_qp_to_qp_ex(qp.as_ptr()) };
    if !qpx.is_null() {
        // SAFETY: `qpx` is live with started work requests (caller).
        unsafe { rdma_mummy_sys::ibv_wr_abort(qpx) };
    }
}
