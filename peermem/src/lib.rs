//! Where memory comes from and how a NIC may reach it.
//!
//! - [`provider`]: host RAM and files, NVMe CMB through P2PDMA ([`cmb`]), dma-bufs (the
//!   built-in [`udmabuf`] exporter or an application's fd), GPU memory ([`cuda`], driver loaded
//!   at run time with the `cuda` feature); each with a copy engine;
//! - [`canary`]: registration attempts (dma-buf, pinned, ODP) proved by a byte-comparing
//!   canary transfer;
//! - [`plan`]: the user's policy (`--p2p required|preferred|disabled`) applied to those
//!   attempts: direct with one strategy, or bounce, and why;
//! - [`hmm`]: device-private regions: per-unit residency, a limited P2P window, per-unit
//!   fallback (migrate or bounce) and invalidation;
//! - [`dmirror`]: real device-private pages of the kernel's HMM test driver (`test_hmm`);
//! - [`topology`]: the PCIe tree from sysfs and, per NIC and device, whether peer-to-peer can
//!   work (the kernel's own rule) and why not;
//! - [`regcache`]: a registration cache with LRU limits and invalidation that waits for
//!   in-flight users.
#![deny(unsafe_code)]

pub mod block;
pub mod canary;
pub mod cmb;
pub mod cuda;
pub mod dmirror;
pub mod error;
pub mod hmm;
pub mod plan;
pub mod provider;
pub mod regcache;
pub mod topology;
pub mod udmabuf;

pub use error::Error;
pub use provider::{DmaBufMemory, HostMemory, Provider};
pub use udmabuf::Udmabuf;
