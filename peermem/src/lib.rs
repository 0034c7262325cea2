//! Where memory comes from and how a NIC may reach it.
//!
//! For now: registration attempts proved by a byte-comparing [`canary`], and the built-in
//! dma-buf exporter ([`udmabuf`]: a memfd exported through `/dev/udmabuf`). The other providers (NVMe CMB via P2PDMA, CUDA, device-private pages), the
//! PCIe topology, path plans and the registration cache land with their issues.
#![deny(unsafe_code)]

pub mod canary;
pub mod udmabuf;

pub use udmabuf::{Error, Udmabuf};
