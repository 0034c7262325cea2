//! The kernel's P2PDMA host-bridge whitelist, kept as data.
//!
//! Source: `pci_p2pdma_whitelist[]` and `cpu_supports_p2pdma()` in Linux's
//! `drivers/pci/p2pdma.c` (as of the 7.x kernels; device IDs of the named constants from
//! `include/linux/pci_ids.h`, `drivers/dma/idxd/registers.h` and the QAT driver). When peer
//! traffic must cross a host bridge, the kernel allows it only if the CPU is an AMD Zen (family
//! 0x17 or later) or the host bridge is on this list; entries marked `same_host_bridge` allow
//! it only between devices under the same host bridge.

/// One whitelist entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// PCI vendor.
    pub vendor: u16,
    /// PCI device (None: any device of the vendor).
    pub device: Option<u16>,
    /// Only between devices below the same host bridge.
    pub same_host_bridge: bool,
    /// What it is.
    pub name: &'static str,
}

const fn e(vendor: u16, device: u16, same: bool, name: &'static str) -> Entry {
    Entry {
        vendor,
        device: Some(device),
        same_host_bridge: same,
        name,
    }
}

const INTEL: u16 = 0x8086;
const GOOGLE: u16 = 0x1ae0;
const NVIDIA: u16 = 0x10de;
const ZHAOXIN: u16 = 0x1d17;

/// The entries, in the kernel's order (the first vendor/device match decides).
pub const WHITELIST: &[Entry] = &[
    e(INTEL, 0x3c00, true, "Intel Xeon E5/Core i7"),
    e(INTEL, 0x3c01, true, "Intel Xeon E5/Core i7"),
    e(INTEL, 0x2f00, true, "Intel Xeon E7 v3/Xeon E5 v3/Core i7"),
    e(INTEL, 0x2f01, true, "Intel Xeon E7 v3/Xeon E5 v3/Core i7"),
    e(INTEL, 0x2030, false, "Intel Skylake-E"),
    e(INTEL, 0x2031, false, "Intel Skylake-E"),
    e(INTEL, 0x2032, false, "Intel Skylake-E"),
    e(INTEL, 0x2033, false, "Intel Skylake-E"),
    e(INTEL, 0x2020, false, "Intel Skylake-E"),
    e(INTEL, 0x09a2, false, "Intel Ice Lake-SP"),
    e(INTEL, 0x0b25, false, "Intel DSA (Sapphire Rapids)"),
    e(INTEL, 0x0cfe, false, "Intel IAX (Sapphire Rapids)"),
    e(INTEL, 0x11fb, false, "Intel DSA (Granite Rapids-D)"),
    e(INTEL, 0x1212, false, "Intel DSA (Diamond Rapids)"),
    e(INTEL, 0x1216, false, "Intel IAA (Diamond Rapids)"),
    e(INTEL, 0x4940, false, "Intel QAT 4xxx"),
    e(INTEL, 0x4942, false, "Intel QAT 401xx"),
    e(INTEL, 0x4944, false, "Intel QAT 402xx"),
    e(INTEL, 0x4946, false, "Intel QAT 420xx"),
    e(INTEL, 0x4948, false, "Intel QAT 6xxx"),
    Entry {
        vendor: GOOGLE,
        device: None,
        same_host_bridge: false,
        name: "Google SoC",
    },
    e(NVIDIA, 0x2f95, false, "NVIDIA CPU"),
    e(NVIDIA, 0x2f96, false, "NVIDIA CPU"),
    e(NVIDIA, 0x2f97, false, "NVIDIA CPU"),
    e(NVIDIA, 0x2f98, false, "NVIDIA CPU"),
    e(ZHAOXIN, 0x1003, true, "Zhaoxin KX-6000/KH-40000"),
    e(ZHAOXIN, 0x1005, true, "Zhaoxin KX-6000/KH-40000"),
    e(ZHAOXIN, 0x1006, true, "Zhaoxin KX-6000G"),
    e(ZHAOXIN, 0x1007, true, "Zhaoxin KX-7000"),
    e(ZHAOXIN, 0x1008, false, "Zhaoxin KH-50000"),
];

/// The first entry for `vendor:device`, as the kernel looks it up.
pub fn lookup(vendor: u16, device: u16) -> Option<&'static Entry> {
    WHITELIST
        .iter()
        .find(|e| e.vendor == vendor && e.device.is_none_or(|d| d == device))
}

/// `cpu_supports_p2pdma()`: an AMD CPU of family 0x17 (Zen) or later.
pub fn cpu_allows(vendor_amd: bool, family: u32) -> bool {
    vendor_amd && family >= 0x17
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_follow_the_kernel() {
        assert!(lookup(0x8086, 0x2020).is_some_and(|e| !e.same_host_bridge));
        assert!(lookup(0x8086, 0x3c00).is_some_and(|e| e.same_host_bridge));
        assert!(lookup(0x1ae0, 0x1234).is_some());
        // QEMU's q35 host bridge is not on the list.
        assert!(lookup(0x8086, 0x29c0).is_none());
        assert!(cpu_allows(true, 0x19));
        assert!(!cpu_allows(true, 0x0f));
        assert!(!cpu_allows(false, 0x19));
    }
}
