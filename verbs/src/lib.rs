//! Safe, async RDMA verbs for p2p-rdma, on top of `sideway` (libibverbs loaded at run time).
//!
//! - [`devices`] / [`Context`]: devices, ports, GID tables, capabilities (incl. ODP);
//! - [`ProtectionDomain`], [`HostBuffer`], [`RegisteredBuffer`], [`MemoryRegion`]: pinned, ODP and
//!   dma-buf registration, with typed errors that explain the errno;
//! - [`QueuePair`]: RC QPs with their own tokio-driven CQ, the INIT→RTR→RTS state machine and
//!   posting of WRITE/READ/SEND/RECV (with immediate data, in batches). The safe API owns the
//!   buffers until completion, even when the future is dropped;
//! - [`PreparedSend`]: send work requests written into the send queue ahead of time and handed
//!   to the device later with one call (the doorbell), for latency-critical loops;
//! - [`MemoryWindow`]: type 2 windows bound on one QP over a shared registration (one MR per
//!   region, one window per peer);
//!
//! Unsafe code is confined to the FFI-facing modules (`ffi`, `mr`, `mw`, `cq`, `qp`, `post`), each block with
//! a `// SAFETY:` argument.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod cq;
mod device;
mod endpoint;
mod error;
mod ffi;
mod local;
mod memory;
mod mr;
mod mw;
mod pending;
mod post;
mod qp;
mod wr;

pub use cq::CqMode;
pub use device::{
    device_names, devices, gid_ipv4, no_device_error, pick_gid, Context, DeviceCaps, DeviceInfo,
    GidInfo, GidKind, OdpCaps, PortInfo,
};
pub use endpoint::{negotiate_mtu, Endpoint, IB_MTUS};
pub use error::{meaning, Call, Error, Result, WcStatus};
pub use local::{Local, RegionRef, SinkBuffer};
pub use memory::{HostBuffer, SharedMemory};
pub use mr::{
    Access, DmabufSupport, MemoryRegion, ProtectionDomain, RegMode, RegisteredBuffer, RemoteSlice,
    SharedRegion,
};
pub use mw::{MemoryWindow, StandingBindError, StandingWindow};
pub use post::{AfterPoll, PreparedSend};
pub use qp::{PathInfo, Pending, PendingRecv, QpOptions, QpState, QueuePair};
pub use wr::{RecvInfo, SendOp, SendWr};
