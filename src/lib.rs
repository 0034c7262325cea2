//! p2p-rdma: serve PCIe device memory to remote hosts over RoCE.
//!
//! This facade re-exports the workspace crates so that examples and tests use one name, and
//! holds the loopback transfer that `p2p-rdma loopback` and `examples/loopback.rs` run, and the
//! two-host benchmark of `p2p-rdma bench`.
#![forbid(unsafe_code)]

pub use bridge;
pub use catalog;
pub use peermem;
pub use verbs;

pub mod bench;
pub mod loopback;
