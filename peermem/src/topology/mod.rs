//! The PCIe topology doctor: for every RDMA device and every device whose memory a NIC might
//! reach (NVMe CMBs, GPUs, accelerators), whether peer-to-peer DMA can work, and why not.
//!
//! Everything is read from a sysfs tree under a root directory ([`Sysfs`]), so fixtures and
//! captured trees replay exactly. The verdict reproduces the kernel's own decision
//! (`calc_map_type_and_dist()` in `drivers/pci/p2pdma.c`): devices that meet below a common
//! bridge with no ACS redirect on the way talk by bus address (`direct`); otherwise traffic
//! goes through the host bridge, which the kernel allows only for AMD Zen CPUs and whitelisted
//! host bridges ([`whitelist`]). On top of that come what the kernel's rule does not cover but
//! users trip over: IOMMU translation, ATS, the kernel lacking `CONFIG_PCI_P2PDMA`, a device
//! with no peer memory, a software RDMA device, and what the RDMA driver accepts (probes the
//! caller runs and hands in).
#![forbid(unsafe_code)]

pub mod config;
mod pair;
mod rank;
mod read;
mod render;
pub mod sysfs;
pub mod whitelist;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use config::{acs, Access, Config, PortType};
pub use rank::BestNic;
use read::last_name;
pub use sysfs::Sysfs;

/// The file a capture keeps beside the copied tree: facts that are not in sysfs.
pub const CAPTURE_FILE: &str = "p2p-rdma-capture.json";

/// How serious a reason is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Severity {
    /// Explains the verdict.
    Info,
    /// Costs performance or may break things.
    Warning,
    /// Prevents peer-to-peer.
    Blocker,
}

/// One reason, with a stable code, a message for a person, and the fix when there is one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reason {
    /// Stable identifier (`acs_redirect`, `host_bridge_not_whitelisted`, ...).
    pub code: &'static str,
    /// How serious.
    pub severity: Severity,
    /// What is going on, in words.
    pub message: String,
    /// What a user can do about it.
    pub fix: Option<String>,
}

fn reason(code: &'static str, severity: Severity, message: String, fix: Option<String>) -> Reason {
    Reason {
        code,
        severity,
        message,
        fix,
    }
}

/// NCCL-style path class between two PCI functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PathClass {
    /// The same PCI function.
    #[serde(rename = "SAME")]
    Same,
    /// Through at most one PCIe switch.
    #[serde(rename = "PIX")]
    Pix,
    /// Through several PCIe bridges, not through the host bridge.
    #[serde(rename = "PXB")]
    Pxb,
    /// Through a PCIe host bridge (the CPU's root complex).
    #[serde(rename = "PHB")]
    Phb,
    /// Across the link between CPU sockets (NUMA nodes).
    #[serde(rename = "SYS")]
    Sys,
}

impl PathClass {
    /// The short name.
    pub fn as_str(self) -> &'static str {
        match self {
            PathClass::Same => "SAME",
            PathClass::Pix => "PIX",
            PathClass::Pxb => "PXB",
            PathClass::Phb => "PHB",
            PathClass::Sys => "SYS",
        }
    }
}

/// Whether peer-to-peer can work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// By bus address, inside a switch (the kernel's `PCI_P2PDMA_MAP_BUS_ADDR`).
    Direct,
    /// Through the host bridge, which allows it (`PCI_P2PDMA_MAP_THRU_HOST_BRIDGE`).
    ThroughHostBridge,
    /// The kernel refuses it, or something else makes it impossible.
    NotSupported,
    /// Not enough could be read to tell.
    Unknown,
}

impl Verdict {
    /// The JSON name.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Direct => "direct",
            Verdict::ThroughHostBridge => "through_host_bridge",
            Verdict::NotSupported => "not_supported",
            Verdict::Unknown => "unknown",
        }
    }
}

/// A probe result for something the RDMA driver may or may not support.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Support {
    /// Supported.
    Supported,
    /// Not supported.
    Unsupported,
    /// Not probed, or the probe was inconclusive.
    Unknown,
}

/// What the caller found by asking the RDMA driver (live verbs probes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverProbe {
    /// ODP for RC READ and WRITE (device caps).
    pub odp: Support,
    /// dma-buf MRs (`ibv_reg_dmabuf_mr(fd=-1)`: EBADF supported, EOPNOTSUPP not).
    pub dmabuf_mr: Support,
    /// Details (errno, caps) for the report.
    pub detail: String,
}

/// Facts from outside sysfs: driver probes and the kernel configuration. A capture stores
/// them in [`CAPTURE_FILE`] so that a replay reports them as the live run did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extra {
    /// Probes by RDMA device name.
    pub probes: BTreeMap<String, DriverProbe>,
    /// `CONFIG_PCI_P2PDMA` from the kernel configuration, with where it was read.
    pub kernel_config_p2pdma: Option<(bool, String)>,
}

impl Extra {
    /// The kernel configuration of the running kernel, when readable.
    pub fn read_kernel_config() -> Option<(bool, String)> {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
        let release = release.trim();
        for p in [
            format!("/boot/config-{release}"),
            format!("/usr/lib/modules/{release}/config"),
            format!("/lib/modules/{release}/build/.config"),
        ] {
            if let Ok(s) = std::fs::read_to_string(&p) {
                return Some((s.lines().any(|l| l == "CONFIG_PCI_P2PDMA=y"), p));
            }
        }
        None
    }

    /// Read a capture's [`CAPTURE_FILE`] (empty when there is none).
    pub fn load(root: &Path) -> Result<Extra, String> {
        match std::fs::read(root.join(CAPTURE_FILE)) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| format!("{}: {e}", root.join(CAPTURE_FILE).display())),
            Err(_) => Ok(Extra::default()),
        }
    }
}

/// Peer memory a device publishes through P2PDMA.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct P2pMem {
    /// Bytes.
    pub size: u64,
    /// Bytes not allocated.
    pub available: u64,
    /// Published for others (and userspace) to allocate.
    pub published: bool,
}

/// One PCI function.
#[derive(Debug, Clone, Serialize)]
pub struct PciDev {
    /// `DDDD:BB:DD.F`.
    pub bdf: String,
    /// Vendor ID.
    #[serde(serialize_with = "hex4")]
    pub vendor: u16,
    /// Device ID.
    #[serde(serialize_with = "hex4")]
    pub device: u16,
    /// Class code (24 bits).
    #[serde(serialize_with = "hex6")]
    pub class: u32,
    /// NUMA node (None: -1 or unreadable).
    pub numa_node: Option<i32>,
    /// Configuration space facts.
    pub config: Config,
    /// IOMMU group number.
    pub iommu_group: Option<String>,
    /// Bound driver.
    pub driver: Option<String>,
    /// P2PDMA memory, if published under `p2pmem/`.
    pub p2pmem: Option<P2pMem>,
    /// Largest prefetchable memory BAR: (index, bytes).
    pub prefetchable_bar: Option<(u8, u64)>,
    /// NVMe controller name.
    pub nvme: Option<String>,
    #[serde(skip)]
    path: PathBuf,
}

impl PciDev {
    fn is_bridge(&self) -> bool {
        self.class >> 8 == 0x0604 || self.class >> 8 == 0x0600
    }

    /// A short description: "NVMe 1b36:0010".
    pub fn kind(&self) -> &'static str {
        match self.class >> 8 {
            0x0108 => "nvme",
            0x0207 => "infiniband",
            0x0200..=0x02ff => "network",
            _ => match self.class >> 16 {
                0x03 => "gpu",
                0x12 => "accelerator",
                0x0b => "processor",
                _ if self.p2pmem.is_some() => "p2pmem",
                _ => "other",
            },
        }
    }

    fn host_bridge(&self) -> String {
        // devices/pciDDDD:BB/...
        self.path
            .components()
            .nth(1)
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

fn hex4<S: serde::Serializer>(v: &u16, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:04x}"))
}

fn hex6<S: serde::Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:06x}"))
}

fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// An RDMA device and the PCI function that does its DMA.
#[derive(Debug, Clone, Serialize)]
pub struct RdmaDev {
    /// `rxe0`, `mlx5_0`.
    pub name: String,
    /// Software RDMA (`rxe`, `siw`): its DMA is CPU copies in the kernel.
    pub software: Option<String>,
    /// The network device it runs on (software RDMA).
    pub netdev: Option<String>,
    /// The PCI function: the device's own, or (software RDMA) its netdev's.
    pub pci: Option<String>,
    /// Driver probes, when run.
    pub probe: Option<DriverProbe>,
}

/// The CPU as the kernel's P2PDMA rule sees it.
#[derive(Debug, Clone, Serialize)]
pub struct Cpu {
    /// `amd`, `intel`, `hygon`, `other`, or `unknown` (not x86 or unreadable).
    pub vendor: String,
    /// x86 family.
    pub family: Option<u32>,
    /// `cpu_supports_p2pdma()`: AMD Zen or later.
    pub allows_p2p_through_host_bridge: bool,
}

/// System-wide facts.
#[derive(Debug, Clone, Serialize)]
pub struct System {
    /// CPU.
    pub cpu: Cpu,
    /// Active IOMMUs (`/sys/class/iommu`).
    pub iommus: Vec<String>,
    /// `CONFIG_PCI_P2PDMA`: Some(true/false) or None (unknown), with how it was found.
    pub kernel_p2pdma: Option<bool>,
    /// How `kernel_p2pdma` was found.
    pub kernel_p2pdma_source: String,
}

/// The report for one (RDMA device, memory device) pair.
#[derive(Debug, Clone, Serialize)]
pub struct Pair {
    /// RDMA device.
    pub rdma_device: String,
    /// The NIC's PCI function (None: no PCI device).
    pub nic_pci: Option<String>,
    /// The memory device.
    pub device_pci: String,
    /// What the memory device is.
    pub device_kind: &'static str,
    /// Path class.
    pub path: Option<PathClass>,
    /// Verdict.
    pub verdict: Verdict,
    /// The kernel's P2PDMA distance (hops), when computed.
    pub distance: Option<u32>,
    /// Bridges between the two, from the NIC's side up and down to the device.
    pub bridges: Vec<String>,
    /// Bridges on the path with ACS redirect enabled.
    pub acs_redirect: Vec<String>,
    /// Why, with fixes.
    pub reasons: Vec<Reason>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// System facts.
    pub system: System,
    /// RDMA devices.
    pub rdma_devices: Vec<RdmaDev>,
    /// Memory devices (NVMe, GPUs, accelerators, anything with p2pmem).
    pub memory_devices: Vec<PciDev>,
    /// The NICs' PCI functions and every bridge on a pair's path (ACS, ATS, port types).
    pub pci_path_devices: Vec<PciDev>,
    /// One entry per RDMA device × memory device.
    pub pairs: Vec<Pair>,
    /// With more than one RDMA device: for each memory device, the one to serve it from
    /// (verdict first, then path class, then the kernel's distance).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub best_nics: Vec<BestNic>,
    /// The storage leg of `nvme` regions staged through a CMB: one entry per NVMe controller
    /// (the SSD, as the DMA client; in `rdma_device` and `nic_pci`) × other device with
    /// p2pmem (the CMB): whether the SSD can DMA into it peer to peer. The CMB ↔ NIC and
    /// SSD ↔ NIC legs are in `pairs`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub storage_pairs: Vec<Pair>,
}

/// The PCI tree and everything else read from one sysfs root.
#[derive(Debug)]
pub struct Topology {
    devs: BTreeMap<String, PciDev>,
    by_path: BTreeMap<PathBuf, String>,
    /// RDMA devices.
    pub rdma: Vec<RdmaDev>,
    /// System facts.
    pub system: System,
    groups: BTreeMap<String, (String, Vec<String>)>,
}

impl Topology {
    /// A PCI function by address.
    pub fn device(&self, bdf: &str) -> Option<&PciDev> {
        self.devs.get(bdf)
    }

    /// All PCI functions.
    pub fn devices(&self) -> impl Iterator<Item = &PciDev> {
        self.devs.values()
    }

    /// `pci_upstream_bridge()`: the bridge above `bdf` (None on a root bus).
    pub fn upstream(&self, bdf: &str) -> Option<&str> {
        let d = self.devs.get(bdf)?;
        let parent = d.path.parent()?;
        self.by_path.get(parent).map(|s| s.as_str())
    }

    fn chain(&self, bdf: &str) -> Vec<String> {
        let mut v = vec![bdf.to_string()];
        let mut cur = bdf.to_string();
        while let Some(up) = self.upstream(&cur) {
            if v.iter().any(|x| x == up) {
                break;
            }
            v.push(up.to_string());
            cur = up.to_string();
        }
        v
    }

    /// Memory devices: NVMe controllers, GPUs, accelerators, and anything with p2pmem.
    pub fn memory_devices(&self) -> Vec<&PciDev> {
        let nics: Vec<&str> = self.rdma.iter().filter_map(|r| r.pci.as_deref()).collect();
        self.devs
            .values()
            .filter(|d| !d.is_bridge() && !nics.contains(&d.bdf.as_str()))
            .filter(|d| {
                matches!(
                    d.kind(),
                    "nvme" | "gpu" | "accelerator" | "processor" | "p2pmem"
                )
            })
            .collect()
    }

    /// ACS redirect state of one function: Some(ctrl bits) if redirecting, None if not,
    /// Err if unknown.
    fn acs_redirect(&self, bdf: &str) -> Result<Option<u16>, ()> {
        let d = self.devs.get(bdf).ok_or(())?;
        match (d.config.access, d.config.acs) {
            (Access::HeaderOnly, _) => Err(()),
            (_, Some((_, ctrl))) if ctrl & acs::REDIRECT != 0 => Ok(Some(ctrl)),
            _ => Ok(None),
        }
    }

    /// The host bridge device the kernel consults for the whitelist (`pci_host_bridge_dev`):
    /// the first function on the root bus, if it is 00.0 or a root port.
    fn host_bridge_dev(&self, hb: &str) -> Option<&PciDev> {
        let first = self
            .devs
            .values()
            .filter(|d| d.path.parent().and_then(last_name).as_deref() == Some(hb))
            .min_by(|a, b| a.bdf.cmp(&b.bdf))?;
        (first.bdf.ends_with(":00.0") || first.config.port_type == Some(PortType::RootPort))
            .then_some(first)
    }

    fn describe(&self, bdf: &str) -> String {
        match self.devs.get(bdf) {
            Some(d) => {
                let role = match d.config.port_type {
                    Some(PortType::RootPort) => " (root port)",
                    Some(PortType::SwitchUpstream) => " (switch upstream port)",
                    Some(PortType::SwitchDownstream) => " (switch downstream port)",
                    _ => "",
                };
                format!("{bdf}{role}")
            }
            None => bdf.to_string(),
        }
    }

    /// Every NVMe controller (an SSD: the DMA client) × every other device that publishes
    /// p2pmem (a CMB: the provider), by the same rule as a NIC × memory pair.
    pub fn storage_pairs(&self) -> Vec<Pair> {
        let mems = self.memory_devices();
        let mut out = Vec::new();
        for ssd in mems.iter().filter(|d| d.kind() == "nvme") {
            let client = RdmaDev {
                name: ssd.nvme.clone().unwrap_or_else(|| ssd.bdf.clone()),
                software: None,
                netdev: None,
                pci: Some(ssd.bdf.clone()),
                probe: None,
            };
            for cmb in mems
                .iter()
                .filter(|d| d.p2pmem.is_some() && d.bdf != ssd.bdf)
            {
                out.push(self.pair(&client, cmb));
            }
        }
        out
    }

    /// Analyse every RDMA device × memory device.
    pub fn report(&self) -> Report {
        let mems = self.memory_devices();
        let mut pairs = Vec::new();
        for r in &self.rdma {
            for m in &mems {
                pairs.push(self.pair(r, m));
            }
        }
        let mut on_path: Vec<&str> = pairs
            .iter()
            .flat_map(|p: &Pair| {
                p.bridges
                    .iter()
                    .map(|b| b.as_str())
                    .chain(p.nic_pci.as_deref())
            })
            .collect();
        on_path.sort();
        on_path.dedup();
        let mut report = Report {
            system: self.system.clone(),
            rdma_devices: self.rdma.clone(),
            memory_devices: mems.into_iter().cloned().collect(),
            pci_path_devices: on_path
                .into_iter()
                .filter_map(|b| self.devs.get(b).cloned())
                .collect(),
            pairs,
            best_nics: Vec::new(),
            storage_pairs: self.storage_pairs(),
        };
        if report.rdma_devices.len() > 1 {
            report.best_nics = report.best_nics(&[]);
        }
        report
    }
}
