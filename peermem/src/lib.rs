//! Where memory comes from and how a NIC may reach it: providers (host RAM, NVMe CMB via
//! P2PDMA, dma-buf, CUDA, device-private pages), PCIe topology, per-region path plans and the
//! registration cache. The providers, topology and plan land with their issues; until then this
//! crate only fixes the workspace layout.
#![forbid(unsafe_code)]
