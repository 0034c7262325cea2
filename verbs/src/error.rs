//! Typed errors: every failing verbs call is reported with the call, its context, the errno and
//! a plain-language meaning that says what to do next.

use std::fmt;
use std::io;

use serde::Serialize;

/// The libibverbs call (or system call) that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum Call {
    /// `ibv_get_device_list`
    GetDeviceList,
    /// `ibv_open_device`
    OpenDevice,
    /// `ibv_query_device` / `ibv_query_device_ex`
    QueryDevice,
    /// `ibv_query_port`
    QueryPort,
    /// `ibv_alloc_pd`
    AllocPd,
    /// `ibv_reg_mr` without `IBV_ACCESS_ON_DEMAND`
    RegMr,
    /// `ibv_reg_mr` with `IBV_ACCESS_ON_DEMAND`
    RegMrOdp,
    /// `ibv_reg_dmabuf_mr`
    RegDmabufMr,
    /// `ibv_advise_mr`
    AdviseMr,
    /// `ibv_create_comp_channel`
    CreateCompChannel,
    /// `ibv_create_cq`
    CreateCq,
    /// `ibv_req_notify_cq`
    ReqNotifyCq,
    /// `ibv_get_cq_event`
    GetCqEvent,
    /// `ibv_poll_cq`
    PollCq,
    /// `ibv_create_qp_ex`
    CreateQp,
    /// `ibv_modify_qp`
    ModifyQp,
    /// `ibv_wr_complete` (posting send work requests)
    PostSend,
    /// `ibv_post_recv`
    PostRecv,
    /// `ibv_alloc_mw` (a type 2 memory window)
    AllocMw,
    /// `ibv_wr_bind_mw` (binding a memory window on a QP)
    BindMw,
    /// `mmap` of host memory for a buffer
    Mmap,
    /// registering the completion channel's fd with tokio
    AsyncFd,
    /// `pread` of a served file (the CPU's copy out of a file region)
    Pread,
    /// `pwrite` of a served file (the CPU's copy into a file region)
    Pwrite,
    /// `fstat` of a served file
    Fstat,
    /// `fdatasync` of a served file (making acknowledged puts durable)
    Fdatasync,
}

impl Call {
    /// The name of the C function.
    pub fn name(self) -> &'static str {
        match self {
            Call::GetDeviceList => "ibv_get_device_list",
            Call::OpenDevice => "ibv_open_device",
            Call::QueryDevice => "ibv_query_device_ex",
            Call::QueryPort => "ibv_query_port",
            Call::AllocPd => "ibv_alloc_pd",
            Call::RegMr => "ibv_reg_mr",
            Call::RegMrOdp => "ibv_reg_mr(IBV_ACCESS_ON_DEMAND)",
            Call::RegDmabufMr => "ibv_reg_dmabuf_mr",
            Call::AdviseMr => "ibv_advise_mr",
            Call::CreateCompChannel => "ibv_create_comp_channel",
            Call::CreateCq => "ibv_create_cq",
            Call::ReqNotifyCq => "ibv_req_notify_cq",
            Call::GetCqEvent => "ibv_get_cq_event",
            Call::PollCq => "ibv_poll_cq",
            Call::CreateQp => "ibv_create_qp_ex",
            Call::ModifyQp => "ibv_modify_qp",
            Call::PostSend => "ibv_wr_complete",
            Call::PostRecv => "ibv_post_recv",
            Call::AllocMw => "ibv_alloc_mw(IBV_MW_TYPE_2)",
            Call::BindMw => "ibv_wr_bind_mw",
            Call::Mmap => "mmap",
            Call::AsyncFd => "AsyncFd::register_with_interest",
            Call::Pread => "pread",
            Call::Pwrite => "pwrite",
            Call::Fstat => "fstat",
            Call::Fdatasync => "fdatasync",
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an errno returned by `call` means in practice, and what to do about it.
pub fn meaning(call: Call, errno: i32) -> &'static str {
    use Call::*;
    match (call, errno) {
        (RegMrOdp, libc::EOPNOTSUPP) => {
            "the device has no ODP support (on-demand paging); use a pinned MR or bounce buffers"
        }
        (RegMrOdp, libc::EINVAL) => "the device or kernel rejected ODP for this range or access",
        (RegMr, libc::EFAULT) => {
            "the range is not backed by pages the kernel can pin (device memory mapped with \
             VM_IO/VM_PFNMAP such as a p2pmem or dma-buf mapping, or an unmapped address); try an \
             ODP or dma-buf MR, or bounce buffers"
        }
        (RegMr | RegMrOdp, libc::ENOMEM) => {
            "cannot lock the memory: RLIMIT_MEMLOCK is too low (check `ulimit -l`), the system is \
             out of memory, or the driver refuses an MR this large (rxe on Linux 7.x: at most \
             1 GiB of 4 KiB pages per MR; serve registers a larger region as several MRs)"
        }
        (RegMr | RegMrOdp, libc::EPERM | libc::EACCES) => {
            "not permitted: the access flags ask for write access to read-only memory, or the \
             memlock limit forbids pinning"
        }
        (RegMr | RegDmabufMr, libc::EINVAL) => {
            "invalid address, length or access flags (REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE)"
        }
        (RegMrOdp | RegDmabufMr, libc::EFAULT) => {
            "the address range is invalid for this registration"
        }
        (RegDmabufMr, libc::EOPNOTSUPP) => {
            "the device (or its user-space provider) does not support dma-buf MRs; use a pinned or \
             ODP MR, or bounce buffers"
        }
        (Pread | Pwrite, libc::EREMOTEIO) => {
            "the block device and the memory cannot reach each other peer to peer (P2PDMA: \
             different host bridges not whitelisted, ACS redirect, or an IOMMU in the way)"
        }
        (Pread | Pwrite, libc::EINVAL) => {
            "misaligned direct I/O (offset, length and buffer must be multiples of the logical \
             block size), or a kernel that does not accept P2PDMA pages for direct I/O (Linux < 6.2)"
        }
        (Pread | Pwrite, libc::EFAULT) => {
            "the kernel cannot pin the buffer for direct I/O (device memory it does not accept here)"
        }
        (Pread | Pwrite, libc::EIO) => "the device reported an I/O error",
        (RegDmabufMr, libc::EBADF) => "the file descriptor is not a dma-buf",
        (AdviseMr, libc::EOPNOTSUPP) => {
            "the device does not support ibv_advise_mr (prefetch); pages fault in on first access"
        }
        (OpenDevice, libc::EACCES | libc::EPERM) => {
            "no permission to open /dev/infiniband/uverbs*; run as root or join the rdma group"
        }
        (ModifyQp, libc::EINVAL) => {
            "an attribute is invalid for this QP state transition (GID index, path MTU, PSN or access)"
        }
        (ModifyQp, libc::ETIMEDOUT) => "resolving the route to the remote GID timed out",
        (ModifyQp, libc::ENETUNREACH) => "the remote GID is unreachable from this port's netdev",
        (PostSend | PostRecv, libc::ENOMEM) => "the work queue is full; wait for completions",
        (PostSend | PostRecv, libc::EINVAL) => {
            "invalid work request (QP not in a state that allows posting, or bad opcode/SGE)"
        }
        (CreateCq | CreateQp, libc::EINVAL) => "the requested size or capability exceeds device limits",
        (CreateCq | CreateQp | AllocPd | CreateCompChannel, libc::ENOMEM) => {
            "out of device or host resources"
        }
        (AllocMw, libc::EOPNOTSUPP | libc::EINVAL) => {
            "the device has no type 2 memory windows; register per client instead"
        }
        (AllocMw, libc::ENOMEM) => "the device's memory windows are all in use",
        (BindMw, libc::EOPNOTSUPP) => {
            "the QP cannot bind memory windows (created without them, or the provider has none)"
        }
        (_, libc::EOPNOTSUPP) => "operation not supported by this device",
        (_, libc::ENODEV) => "the RDMA device went away",
        _ => "unexpected error",
    }
}

/// Status of a work completion (`enum ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WcStatus(pub u32);

impl WcStatus {
    /// `IBV_WC_SUCCESS`
    pub const SUCCESS: WcStatus = WcStatus(0);
    /// `IBV_WC_LOC_PROT_ERR` — "IB error 4".
    pub const LOC_PROT_ERR: WcStatus = WcStatus(4);
    /// `IBV_WC_WR_FLUSH_ERR`
    pub const WR_FLUSH_ERR: WcStatus = WcStatus(5);
    /// `IBV_WC_REM_ACCESS_ERR`
    pub const REM_ACCESS_ERR: WcStatus = WcStatus(10);

    /// The libibverbs name of the status.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "IBV_WC_SUCCESS",
            1 => "IBV_WC_LOC_LEN_ERR",
            2 => "IBV_WC_LOC_QP_OP_ERR",
            3 => "IBV_WC_LOC_EEC_OP_ERR",
            4 => "IBV_WC_LOC_PROT_ERR",
            5 => "IBV_WC_WR_FLUSH_ERR",
            6 => "IBV_WC_MW_BIND_ERR",
            7 => "IBV_WC_BAD_RESP_ERR",
            8 => "IBV_WC_LOC_ACCESS_ERR",
            9 => "IBV_WC_REM_INV_REQ_ERR",
            10 => "IBV_WC_REM_ACCESS_ERR",
            11 => "IBV_WC_REM_OP_ERR",
            12 => "IBV_WC_RETRY_EXC_ERR",
            13 => "IBV_WC_RNR_RETRY_EXC_ERR",
            14 => "IBV_WC_LOC_RDD_VIOL_ERR",
            15 => "IBV_WC_REM_INV_RD_REQ_ERR",
            16 => "IBV_WC_REM_ABORT_ERR",
            17 => "IBV_WC_INV_EECN_ERR",
            18 => "IBV_WC_INV_EEC_STATE_ERR",
            19 => "IBV_WC_FATAL_ERR",
            20 => "IBV_WC_RESP_TIMEOUT_ERR",
            21 => "IBV_WC_GENERAL_ERR",
            22 => "IBV_WC_TM_ERR",
            23 => "IBV_WC_TM_RNDV_INCOMPLETE",
            _ => "unknown work completion status",
        }
    }

    /// What the status means in practice.
    pub fn meaning(self) -> &'static str {
        match self.0 {
            0 => "success",
            1 => "local length error: the receive buffer is smaller than the incoming message",
            2 => "local QP operation error: the work request is inconsistent with the QP",
            4 => {
                "local protection error: the local buffer is not covered by its MR's lkey (or the \
                 MR is gone); with peer memory this is what a P2P path blocked by ACS or the IOMMU \
                 looks like"
            }
            5 => "flushed: the QP entered the error state before this work request was executed",
            8 => "local access error: the local MR does not allow this access",
            9 => "remote invalid request: the responder does not support the operation or the length is invalid",
            10 => {
                "remote access error: the rkey is invalid, the range is outside the remote MR, or \
                 the MR lacks the needed remote access right"
            }
            11 => "remote operation error: the responder could not complete the operation",
            12 => "transport retry counter exceeded: the remote QP does not answer (wrong address, QPN or link down)",
            13 => "RNR retry counter exceeded: the remote side posted no receive buffer",
            19 => "fatal error in the device",
            20 => "response timeout",
            _ => "see ibv_poll_cq(3)",
        }
    }

    /// Whether this is a success.
    pub fn is_success(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// All errors of the `verbs` crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// libibverbs.so.1 could not be loaded.
    #[error(
        "libibverbs is not installed ({detail}); install rdma-core's user-space libraries \
         (Debian: apt-get install libibverbs1 ibverbs-providers)"
    )]
    LibraryMissing {
        /// What the dynamic loader said.
        detail: String,
    },
    /// No RDMA device at all.
    #[error(
        "no RDMA device found: {detail}. On a machine without RDMA hardware use \
         soft-roce/host-setup (kernel with rdma_rxe) or soft-roce/lab (QEMU guest)"
    )]
    NoDevice {
        /// What was seen.
        detail: String,
    },
    /// The named device does not exist.
    #[error("RDMA device '{name}' not found; available: {available}")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// Comma-separated names of the devices that exist.
        available: String,
    },
    /// A verbs call failed.
    #[error("{call} failed ({context}): {meaning} [errno {errno}: {source}]", errno = source.raw_os_error().unwrap_or(0))]
    Verbs {
        /// The failing call.
        call: Call,
        /// Device, region, offset… whatever identifies the object.
        context: String,
        /// Plain-language meaning of the errno for this call.
        meaning: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The port has no GID usable for RoCE v2 / IB addressing.
    #[error("{device} port {port} has no usable GID: {reason}")]
    NoGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// Why none fits.
        reason: String,
    },
    /// A work request completed with an error status.
    #[error("{opcode} (wr_id {wr_id}) on QP {qpn} completed with {status}: {}", status.meaning())]
    WorkCompletion {
        /// Local QP number.
        qpn: u32,
        /// Work request id.
        wr_id: u64,
        /// What was posted.
        opcode: &'static str,
        /// The completion status.
        status: WcStatus,
        /// Vendor-specific syndrome.
        vendor_err: u32,
    },
    /// A range is outside a buffer or region.
    #[error("range offset {offset} length {len} is outside the {what} of {size} bytes")]
    OutOfBounds {
        /// Which object.
        what: &'static str,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the object.
        size: u64,
    },
    /// Too many outstanding work requests.
    #[error(
        "the {queue} queue of QP {qpn} is full ({outstanding} of {capacity} work requests \
         outstanding); await earlier operations or create the QP with a deeper queue"
    )]
    QueueFull {
        /// "send" or "receive".
        queue: &'static str,
        /// QP number.
        qpn: u32,
        /// Currently outstanding.
        outstanding: usize,
        /// Queue capacity.
        capacity: usize,
    },
    /// A caller-supplied value is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A served file became shorter than its mapping (another process truncated it): the
    /// bytes past its new end are gone, and reaching them through the mapping would fault.
    #[error(
        "the served file is now {now} bytes, shorter than the {mapped} bytes served (another \
         process truncated it): bytes {offset}..{end} are gone; restore the file's size or \
         remove the region"
    )]
    FileShrank {
        /// Bytes mapped (the region's size).
        mapped: u64,
        /// The file's size now.
        now: u64,
        /// Start of the refused range.
        offset: u64,
        /// End of the refused range.
        end: u64,
    },
}

impl Error {
    /// Build a [`Error::Verbs`] from a call, a context and an `io::Error`.
    pub fn verbs(call: Call, context: impl Into<String>, source: io::Error) -> Error {
        let errno = source.raw_os_error().unwrap_or(0);
        Error::Verbs {
            call,
            context: context.into(),
            meaning: meaning(call, errno),
            source,
        }
    }

    /// Same, from a raw errno.
    pub fn errno(call: Call, context: impl Into<String>, errno: i32) -> Error {
        Error::verbs(call, context, io::Error::from_raw_os_error(errno))
    }

    /// The errno carried, if this is an OS-level failure.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Verbs { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// Whether the failure means "this device does not support that".
    pub fn is_unsupported(&self) -> bool {
        self.raw_os_error() == Some(libc::EOPNOTSUPP)
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odp_eopnotsupp_explains_missing_odp() {
        let e = Error::errno(Call::RegMrOdp, "rxe0, 4096 bytes", libc::EOPNOTSUPP);
        let s = e.to_string();
        assert!(s.contains("ibv_reg_mr(IBV_ACCESS_ON_DEMAND)"), "{s}");
        assert!(s.contains("no ODP support"), "{s}");
        assert!(s.contains("errno 95"), "{s}");
        assert!(e.is_unsupported());
    }

    #[test]
    fn pinned_efault_points_at_device_memory() {
        let s = Error::errno(Call::RegMr, "p2pmem", libc::EFAULT).to_string();
        assert!(s.contains("VM_PFNMAP"), "{s}");
        assert!(s.contains("errno 14"), "{s}");
    }

    #[test]
    fn dmabuf_unsupported_is_clean() {
        let e = Error::errno(Call::RegDmabufMr, "udmabuf", libc::EOPNOTSUPP);
        assert!(e.to_string().contains("does not support dma-buf MRs"));
        assert!(e.is_unsupported());
    }

    #[test]
    fn wc_status_four_is_protection_error() {
        assert_eq!(WcStatus(4).name(), "IBV_WC_LOC_PROT_ERR");
        assert!(WcStatus(4).meaning().contains("ACS"));
        assert_eq!(WcStatus(10).name(), "IBV_WC_REM_ACCESS_ERR");
        assert!(WcStatus::SUCCESS.is_success());
        assert!(!WcStatus(99).is_success());
        assert_eq!(WcStatus(99).name(), "unknown work completion status");
    }

    #[test]
    fn work_completion_error_names_everything() {
        let e = Error::WorkCompletion {
            qpn: 17,
            wr_id: 3,
            opcode: "RDMA READ",
            status: WcStatus::REM_ACCESS_ERR,
            vendor_err: 0,
        };
        let s = e.to_string();
        assert!(
            s.contains("RDMA READ")
                && s.contains("QP 17")
                && s.contains("IBV_WC_REM_ACCESS_ERR (10)"),
            "{s}"
        );
    }
}
