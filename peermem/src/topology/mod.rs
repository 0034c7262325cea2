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
pub mod sysfs;
pub mod whitelist;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use config::{acs, Access, Config, PortType};
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

fn read_p2pmem(fs: &Sysfs, dir: &Path) -> Option<P2pMem> {
    if !fs.exists(dir.join("p2pmem")) {
        return None;
    }
    let num = |f: &str| {
        fs.text(dir.join("p2pmem").join(f))
            .and_then(|s| s.parse::<u64>().ok())
    };
    Some(P2pMem {
        size: num("size").unwrap_or(0),
        available: num("available").unwrap_or(0),
        published: num("published").unwrap_or(0) != 0,
    })
}

fn largest_prefetchable_bar(fs: &Sysfs, dir: &Path) -> Option<(u8, u64)> {
    let text = fs.text(dir.join("resource"))?;
    let mut best: Option<(u8, u64)> = None;
    for (i, line) in text.lines().take(6).enumerate() {
        let f: Vec<u64> = line
            .split_whitespace()
            .filter_map(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16).ok())
            .collect();
        if f.len() != 3 || f[1] <= f[0] {
            continue;
        }
        // IORESOURCE_MEM (0x200) and IORESOURCE_PREFETCH (0x2000)
        if f[2] & 0x200 != 0 && f[2] & 0x2000 != 0 {
            let size = f[1] - f[0] + 1;
            if best.is_none_or(|(_, s)| size > s) {
                best = Some((i as u8, size));
            }
        }
    }
    best
}

fn last_name(p: &Path) -> Option<String> {
    p.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// The PCI function a device path belongs to: the path itself or its nearest PCI ancestor
/// (as the kernel's `find_parent_pci_dev`; a virtio-net netdev's device is `virtio0` below
/// its PCI function).
fn pci_ancestor(p: &Path) -> Option<String> {
    p.ancestors().filter_map(last_name).find(|n| is_bdf(n))
}

impl Topology {
    /// Read everything from `fs`, with `extra` facts (driver probes, kernel configuration).
    pub fn read(fs: &Sysfs, extra: &Extra) -> Topology {
        let mut devs = BTreeMap::new();
        let mut by_path = BTreeMap::new();
        for bdf in fs.list("bus/pci/devices") {
            let rel = PathBuf::from("bus/pci/devices").join(&bdf);
            let Some(path) = fs.resolve(&rel) else {
                continue;
            };
            let h16 = |f: &str| fs.hex(rel.join(f)).map(|v| v as u16).unwrap_or(0);
            let class = fs.hex(rel.join("class")).unwrap_or(0);
            let numa_node = fs
                .text(rel.join("numa_node"))
                .and_then(|s| s.parse::<i32>().ok())
                .filter(|&n| n >= 0);
            let config = Config::parse(&fs.read(rel.join("config")).unwrap_or_default());
            let iommu_group = fs
                .resolve(rel.join("iommu_group"))
                .and_then(|p| last_name(&p));
            let driver = fs.resolve(rel.join("driver")).and_then(|p| last_name(&p));
            let nvme = if class >> 8 == 0x0108 {
                fs.list(rel.join("nvme")).into_iter().next()
            } else {
                None
            };
            let d = PciDev {
                bdf: bdf.clone(),
                vendor: h16("vendor"),
                device: h16("device"),
                class,
                numa_node,
                config,
                iommu_group,
                driver,
                p2pmem: read_p2pmem(fs, &rel),
                prefetchable_bar: largest_prefetchable_bar(fs, &rel),
                nvme,
                path: path.clone(),
            };
            by_path.insert(path, bdf.clone());
            devs.insert(bdf, d);
        }

        let mut rdma = Vec::new();
        for name in fs.list("class/infiniband") {
            let base = PathBuf::from("class/infiniband").join(&name);
            let own = fs
                .resolve(base.join("device"))
                .and_then(|p| pci_ancestor(&p));
            let (software, netdev, pci) = match own {
                Some(bdf) => (None, None, Some(bdf)),
                None => {
                    let netdev = fs.text(base.join("parent")).filter(|s| !s.is_empty());
                    let pci = netdev.as_ref().and_then(|n| {
                        fs.resolve(PathBuf::from("class/net").join(n).join("device"))
                            .and_then(|p| pci_ancestor(&p))
                    });
                    let kind = if name.starts_with("siw") {
                        "siw"
                    } else if name.starts_with("rxe") {
                        "rxe"
                    } else {
                        "software RDMA"
                    };
                    (Some(kind.to_string()), netdev, pci)
                }
            };
            rdma.push(RdmaDev {
                probe: extra.probes.get(&name).cloned(),
                name,
                software,
                netdev,
                pci,
            });
        }

        let mut groups = BTreeMap::new();
        let iommus = fs.list("class/iommu");
        for g in fs.list("kernel/iommu_groups") {
            let base = PathBuf::from("kernel/iommu_groups").join(&g);
            let ty = fs
                .text(base.join("type"))
                .unwrap_or_else(|| "unknown".into());
            let members = fs.list(base.join("devices"));
            groups.insert(g, (ty, members));
        }

        // CPU: devices/system/cpu/modalias = "cpu:type:x86,venVVVVfamFFFFmodMMMM:feature:..."
        let cpu = match fs.text("devices/system/cpu/modalias") {
            Some(m) if m.contains("type:x86,ven") => {
                let field = |tag: &str| {
                    m.find(tag).and_then(|i| {
                        m.get(i + tag.len()..i + tag.len() + 4)
                            .and_then(|h| u32::from_str_radix(h, 16).ok())
                    })
                };
                let vendor = match field("ven") {
                    Some(0) => "intel",
                    Some(2) => "amd",
                    Some(9) => "hygon",
                    Some(_) => "other",
                    None => "unknown",
                };
                let family = field("fam");
                Cpu {
                    vendor: vendor.into(),
                    family,
                    allows_p2p_through_host_bridge: whitelist::cpu_allows(
                        vendor == "amd",
                        family.unwrap_or(0),
                    ),
                }
            }
            _ => Cpu {
                vendor: "unknown".into(),
                family: None,
                allows_p2p_through_host_bridge: false,
            },
        };

        let any_p2pmem = devs.values().any(|d| d.p2pmem.is_some());
        let (kernel_p2pdma, kernel_p2pdma_source) = if any_p2pmem {
            (Some(true), "a PCI device publishes p2pmem/".to_string())
        } else if let Some((on, src)) = &extra.kernel_config_p2pdma {
            (Some(*on), format!("kernel configuration {src}"))
        } else {
            (
                None,
                "no PCI device publishes p2pmem/ and the kernel configuration is not readable"
                    .to_string(),
            )
        };

        Topology {
            devs,
            by_path,
            rdma,
            system: System {
                cpu,
                iommus,
                kernel_p2pdma,
                kernel_p2pdma_source,
            },
            groups,
        }
    }

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
        Report {
            system: self.system.clone(),
            rdma_devices: self.rdma.clone(),
            memory_devices: mems.into_iter().cloned().collect(),
            pci_path_devices: on_path
                .into_iter()
                .filter_map(|b| self.devs.get(b).cloned())
                .collect(),
            pairs,
        }
    }

    /// Analyse one pair.
    pub fn pair(&self, r: &RdmaDev, m: &PciDev) -> Pair {
        let mut reasons = Vec::new();
        let mut p = Pair {
            rdma_device: r.name.clone(),
            nic_pci: r.pci.clone(),
            device_pci: m.bdf.clone(),
            device_kind: m.kind(),
            path: None,
            verdict: Verdict::Unknown,
            distance: None,
            bridges: Vec::new(),
            acs_redirect: Vec::new(),
            reasons: Vec::new(),
        };
        if let Some(kind) = &r.software {
            let on = r.netdev.as_deref().unwrap_or("?");
            reasons.push(reason(
                "software_rdma",
                Severity::Info,
                format!(
                    "{} is software RDMA ({kind}) on {on}: its \"DMA\" is CPU copies in the kernel, so it reaches peer memory only through a CPU mapping{}",
                    r.name,
                    match &r.pci {
                        Some(b) => format!("; the path below is that of {on}'s PCI device {b}"),
                        None => String::new(),
                    }
                ),
                None,
            ));
        }
        let Some(nic) = r.pci.clone().filter(|b| self.devs.contains_key(b)) else {
            reasons.push(reason(
                "not_pci",
                Severity::Blocker,
                match (&r.software, &r.netdev) {
                    (Some(_), Some(n)) => format!("{}'s network device {n} is not a PCI device (a virtual netdev): there is no PCIe path to any device", r.name),
                    _ => format!("{} has no PCI device in this tree", r.name),
                },
                Some("run RDMA on a PCI NIC (for rxe: `rdma link add rxe0 type rxe netdev <the NIC's netdev>`)".into()),
            ));
            p.verdict = Verdict::NotSupported;
            p.reasons = reasons;
            return p;
        };

        // The kernel's calc_map_type_and_dist(provider = memory device, client = NIC).
        let ca = self.chain(&m.bdf);
        let cb = self.chain(&nic);
        let mut redirect: Vec<(String, u16)> = Vec::new();
        let mut unreadable: Vec<String> = Vec::new();
        let mut note = |bdf: &str, redirect: &mut Vec<(String, u16)>| match self.acs_redirect(bdf) {
            Ok(Some(bits)) => redirect.push((bdf.to_string(), bits)),
            Ok(None) => {}
            Err(()) => unreadable.push(bdf.to_string()),
        };
        let mut common = None;
        for (da, a) in ca.iter().enumerate() {
            note(a, &mut redirect);
            if let Some(db) = cb.iter().position(|b| b == a) {
                common = Some((da, db));
                break;
            }
        }
        if let Some((_, db)) = common {
            for b in &cb[..db] {
                note(b, &mut redirect);
            }
        }
        if common.is_none() {
            // Without a common bridge the kernel goes through the host bridge whatever ACS says.
            redirect.clear();
            unreadable.clear();
        }
        p.acs_redirect = redirect.iter().map(|(b, _)| b.clone()).collect();

        enum Map {
            BusAddr,
            HostBridge,
            NotSupported,
        }
        let mut map = Map::HostBridge;
        match common {
            Some((da, db)) => {
                let lca = ca[da].clone();
                p.distance = Some((da + db) as u32);
                // Bridges from the NIC up to the meeting point and down to the device.
                p.bridges = cb[1..db]
                    .iter()
                    .cloned()
                    .chain(std::iter::once(lca.clone()).filter(|l| *l != m.bdf && *l != nic))
                    .chain(ca[1..da].iter().rev().cloned())
                    .collect();
                p.path = Some(self.class_below(&ca[..=da], &cb[..db], da + db, &m.bdf, &nic));
                if m.bdf == nic {
                    reasons.push(reason(
                        "same_function",
                        Severity::Info,
                        format!("{nic} is both the NIC and the memory device"),
                        None,
                    ));
                }
                if redirect.is_empty() && unreadable.is_empty() {
                    map = Map::BusAddr;
                    if m.bdf != nic {
                        reasons.push(reason(
                            "common_upstream_bridge",
                            Severity::Info,
                            format!(
                                "{nic} and {} meet at {} with no ACS redirect on the way: peer traffic stays below it (the kernel maps by bus address, distance {})",
                                m.bdf,
                                self.describe(&lca),
                                da + db
                            ),
                            None,
                        ));
                    }
                }
            }
            None => {
                p.distance = Some((ca.len() + cb.len()) as u32);
                p.bridges = cb[1..]
                    .iter()
                    .cloned()
                    .chain(ca[1..].iter().rev().cloned())
                    .collect();
                let (na, nb) = (m.numa_node, self.devs[&nic].numa_node);
                let cross = matches!((na, nb), (Some(a), Some(b)) if a != b);
                p.path = Some(if cross {
                    PathClass::Sys
                } else {
                    PathClass::Phb
                });
                let (ha, hb) = (m.host_bridge(), self.devs[&nic].host_bridge());
                reasons.push(reason(
                    "no_common_bridge",
                    Severity::Info,
                    format!(
                        "{nic} and {} share no PCIe bridge: their traffic crosses the host bridge{}",
                        m.bdf,
                        if ha == hb { format!(" ({ha})") } else { format!("s ({hb} and {ha})") }
                    ),
                    None,
                ));
                if cross {
                    reasons.push(reason(
                        "cross_socket",
                        Severity::Warning,
                        format!(
                            "{nic} is on NUMA node {} and {} on node {}: peer traffic crosses the link between the CPU sockets, which is slow or unsupported for P2P on many platforms",
                            nb.unwrap_or(-1),
                            m.bdf,
                            na.unwrap_or(-1)
                        ),
                        Some("put the NIC and the device on the same socket (the same NUMA node)".into()),
                    ));
                }
            }
        }

        if !redirect.is_empty() {
            let list: Vec<String> = redirect
                .iter()
                .map(|(b, bits)| {
                    format!(
                        "{} [{}]",
                        self.describe(b),
                        acs::names(*bits & acs::REDIRECT).join(" ")
                    )
                })
                .collect();
            let param: Vec<&str> = redirect.iter().map(|(b, _)| b.as_str()).collect();
            reasons.push(reason(
                "acs_redirect",
                Severity::Warning,
                format!(
                    "ACS redirect is enabled on {}: peer requests between {nic} and {} are sent up to the root complex instead of across the switch",
                    list.join(", "),
                    m.bdf
                ),
                Some(format!(
                    "boot with pci=disable_acs_redir={} to keep the traffic below the common bridge (this weakens the isolation between the devices behind those ports{})",
                    param.join(";"),
                    if self.system.iommus.is_empty() { "" } else { " and merges their IOMMU groups" }
                )),
            ));
        }
        if !unreadable.is_empty() {
            reasons.push(reason(
                "acs_unknown",
                Severity::Warning,
                format!(
                    "cannot tell whether ACS redirects peer traffic at {}: unknown, need root (the extended configuration space is readable only by root)",
                    unreadable.join(", ")
                ),
                Some("run `p2p-rdma topo` as root (or take a capture as root with --capture and replay it)".into()),
            ));
        }

        // Through the host bridge: the whitelist (the kernel's map_through_host_bridge).
        // (A common bridge with no redirect found is bus addresses, or unknown if some ACS
        // could not be read: no host bridge involved either way.)
        let via_host_bridge = common.is_none() || !redirect.is_empty();
        if via_host_bridge {
            if self.system.cpu.allows_p2p_through_host_bridge {
                reasons.push(reason(
                    "cpu_allows_p2p",
                    Severity::Info,
                    format!(
                        "the CPU is an AMD Zen (family {:#x}): the kernel allows P2P through its host bridges",
                        self.system.cpu.family.unwrap_or(0)
                    ),
                    None,
                ));
            } else {
                match self.whitelisted(&m.bdf, &nic) {
                    Ok(r) => reasons.push(r),
                    Err(r) => {
                        reasons.push(r);
                        map = Map::NotSupported;
                    }
                }
            }
        }
        p.verdict = match map {
            Map::BusAddr => Verdict::Direct,
            Map::HostBridge if common.is_some() && redirect.is_empty() => Verdict::Unknown,
            Map::HostBridge => Verdict::ThroughHostBridge,
            Map::NotSupported => Verdict::NotSupported,
        };

        self.iommu_reasons(&nic, m, &p, &mut reasons);
        self.memory_reasons(m, &mut reasons, &mut p.verdict);
        if let Some(probe) = &r.probe {
            driver_reasons(&r.name, probe, m, &mut reasons);
        }
        reasons.sort_by_key(|r| std::cmp::Reverse(r.severity));
        p.reasons = reasons;
        p
    }

    /// PIX/PXB below a common bridge.
    fn class_below(
        &self,
        up_a: &[String],
        up_b: &[String],
        dist: usize,
        a: &str,
        b: &str,
    ) -> PathClass {
        if a == b {
            return PathClass::Same;
        }
        // Bridges on the path: a's ancestors up to and including the meeting point, b's below it.
        let bridges: Vec<&String> = up_a[1..].iter().chain(up_b[1..].iter()).collect();
        let types: Vec<Option<PortType>> = bridges
            .iter()
            .map(|b| self.devs.get(b.as_str()).and_then(|d| d.config.port_type))
            .collect();
        if types.iter().any(|t| t.is_none()) {
            // Unprivileged read: count hops (4 = one switch).
            return if dist <= 4 {
                PathClass::Pix
            } else {
                PathClass::Pxb
            };
        }
        let switches = types
            .iter()
            .filter(|t| **t == Some(PortType::SwitchUpstream))
            .count();
        if switches <= 1 && dist <= 4 {
            PathClass::Pix
        } else {
            PathClass::Pxb
        }
    }

    /// The whitelist check; Ok(info) when allowed, Err(blocker) when not.
    fn whitelisted(&self, a: &str, b: &str) -> Result<Reason, Reason> {
        let (ha, hb) = (self.devs[a].host_bridge(), self.devs[b].host_bridge());
        let same = ha == hb;
        let check = |hbname: &str, same: bool| -> Result<Reason, Reason> {
            let Some(root) = self.host_bridge_dev(hbname) else {
                return Err(reason(
                    "host_bridge_unknown",
                    Severity::Blocker,
                    format!("{hbname} has no host bridge function (00.0 or a root port first on its bus) for the kernel to check against its P2PDMA whitelist, so the kernel refuses P2P through it"),
                    Some("place both devices under one PCIe switch without ACS redirect".into()),
                ));
            };
            let id = format!("{:04x}:{:04x}", root.vendor, root.device);
            match whitelist::lookup(root.vendor, root.device) {
                Some(e) if e.same_host_bridge && !same => Err(reason(
                    "host_bridge_needs_same_bridge",
                    Severity::Blocker,
                    format!("host bridge {id} ({}) at {} is whitelisted only for devices below the same host bridge, and {a} and {b} are below different ones ({ha}, {hb})", e.name, root.bdf),
                    Some("put both devices below one host bridge (one root complex), ideally under one PCIe switch".into()),
                )),
                Some(e) => Ok(reason(
                    "host_bridge_whitelisted",
                    Severity::Info,
                    format!("host bridge {id} ({}) at {} is on the kernel's P2PDMA whitelist: P2P through it is allowed", e.name, root.bdf),
                    None,
                )),
                None => Err(reason(
                    "host_bridge_not_whitelisted",
                    Severity::Blocker,
                    format!("host bridge {id} at {} is not on the kernel's P2PDMA whitelist and the CPU is not an AMD Zen: the kernel refuses peer-to-peer that crosses it", root.bdf),
                    Some(format!("place both devices under one PCIe switch without ACS redirect; if this host bridge is known to forward P2P well, {id} must be added to pci_p2pdma_whitelist in drivers/pci/p2pdma.c")),
                )),
            }
        };
        if same {
            check(&ha, true)
        } else {
            check(&ha, false)?;
            check(&hb, false)
        }
    }

    fn iommu_reasons(&self, nic: &str, m: &PciDev, p: &Pair, reasons: &mut Vec<Reason>) {
        if self.system.iommus.is_empty() {
            reasons.push(reason(
                "no_iommu",
                Severity::Info,
                "no IOMMU is active: devices reach each other by bus address, untranslated".into(),
                None,
            ));
            return;
        }
        let nicd = &self.devs[nic];
        let group = |d: &PciDev| {
            d.iommu_group.as_ref().map(|g| {
                (
                    g.clone(),
                    self.groups
                        .get(g)
                        .map(|(t, _)| t.clone())
                        .unwrap_or_else(|| "unknown".into()),
                )
            })
        };
        let (gn, gm) = (group(nicd), group(m));
        let translated =
            |g: &Option<(String, String)>| matches!(g, Some((_, t)) if t.starts_with("DMA"));
        let describe = |who: &str, g: &Option<(String, String)>| match g {
            Some((n, t)) => format!("{who} (group {n}, {t})"),
            None => format!("{who} (no group)"),
        };
        let iommus = self.system.iommus.join(", ");
        if translated(&gn) || translated(&gm) {
            let through = matches!(p.path, Some(PathClass::Phb | PathClass::Sys))
                || !p.acs_redirect.is_empty();
            reasons.push(reason(
                "iommu_translated",
                Severity::Warning,
                format!(
                    "the IOMMU ({iommus}) translates DMA of {} and {}: {}",
                    describe(nic, &gn),
                    describe(&m.bdf, &gm),
                    if through {
                        "peer requests sent up to the root complex are translated, so the peer's BAR must be mapped in the NIC's IOMMU domain (the kernel does this for P2PDMA and dma-buf mappings; a missing mapping shows up as IOMMU faults in dmesg and as IB error 4 or a hang)"
                    } else {
                        "traffic that stays below the common bridge does not reach it, but the kernel turns ACS redirect on where it isolates groups"
                    }
                ),
                Some(format!(
                    "boot with iommu=pt (pass-through), or make the groups identity: {} (with their drivers unbound)",
                    [&gn, &gm]
                        .iter()
                        .filter_map(|g| g.as_ref().filter(|(_, t)| t.starts_with("DMA")).map(|(n, _)| n.clone()))
                        .collect::<std::collections::BTreeSet<_>>()
                        .iter()
                        .map(|n| format!("echo identity > /sys/kernel/iommu_groups/{n}/type"))
                        .collect::<Vec<_>>()
                        .join("; ")
                )),
            ));
            // ATS on the NIC.
            match (nicd.config.access, nicd.config.ats_enabled) {
                (Access::HeaderOnly, _) => {}
                (_, None) => reasons.push(reason(
                    "ats_absent",
                    Severity::Info,
                    format!("{nic} has no ATS capability: every request it sends upstream is translated by the IOMMU"),
                    None,
                )),
                (_, Some(false)) => reasons.push(reason(
                    "ats_disabled",
                    Severity::Info,
                    format!("{nic} supports ATS but it is disabled: its requests are translated by the IOMMU one by one"),
                    Some("the IOMMU driver enables ATS when it supports device TLBs (e.g. intel_iommu with scalable mode); check dmesg for ATS".into()),
                )),
                (_, Some(true)) => reasons.push(reason(
                    "ats_enabled",
                    Severity::Info,
                    format!("{nic} has ATS enabled: it caches translations and may send translated requests, which bridges with ACS Direct Translated P2P forward peer-to-peer"),
                    None,
                )),
            }
        } else {
            reasons.push(reason(
                "iommu_passthrough",
                Severity::Info,
                format!(
                    "the IOMMU ({iommus}) passes DMA of {} and {} through untranslated",
                    describe(nic, &gn),
                    describe(&m.bdf, &gm)
                ),
                None,
            ));
        }
        if let (Some((a, _)), Some((b, _))) = (&gn, &gm) {
            if a == b {
                reasons.push(reason(
                    "iommu_same_group",
                    Severity::Info,
                    format!(
                        "{nic} and {} share IOMMU group {a}: no ACS isolation separates them",
                        m.bdf
                    ),
                    None,
                ));
            }
        }
    }

    fn memory_reasons(&self, m: &PciDev, reasons: &mut Vec<Reason>, verdict: &mut Verdict) {
        match self.system.kernel_p2pdma {
            Some(false) => {
                reasons.push(reason(
                    "kernel_no_p2pdma",
                    Severity::Blocker,
                    format!("the kernel lacks CONFIG_PCI_P2PDMA ({}): it neither publishes device memory for peers nor maps it for DMA", self.system.kernel_p2pdma_source),
                    Some("boot a kernel built with CONFIG_PCI_P2PDMA=y (Linux >= 6.2 to allocate from userspace through p2pmem/allocate)".into()),
                ));
                *verdict = Verdict::NotSupported;
            }
            None if m.kind() == "nvme" && m.p2pmem.is_none() => {
                reasons.push(reason(
                    "kernel_p2pdma_unknown",
                    Severity::Blocker,
                    format!("{} has no p2pmem/ and no PCI device has one: the kernel most likely lacks CONFIG_PCI_P2PDMA ({}); otherwise the controller has no CMB", m.bdf, self.system.kernel_p2pdma_source),
                    Some("boot a kernel built with CONFIG_PCI_P2PDMA=y; dmesg shows 'failed to register the CMB' from nvme when it is missing".into()),
                ));
                *verdict = Verdict::NotSupported;
            }
            _ => {}
        }
        match &m.p2pmem {
            Some(pm) if pm.published => reasons.push(reason(
                "p2pmem",
                Severity::Info,
                format!(
                    "{}{} publishes {} bytes of peer memory ({} available) under p2pmem/",
                    m.bdf,
                    m.nvme
                        .as_ref()
                        .map(|n| format!(" ({n})"))
                        .unwrap_or_default(),
                    pm.size,
                    pm.available
                ),
                None,
            )),
            Some(_) => {
                reasons.push(reason(
                    "p2pmem_not_published",
                    Severity::Blocker,
                    format!(
                        "{} has peer memory but its driver keeps it (p2pmem/published is 0)",
                        m.bdf
                    ),
                    None,
                ));
                *verdict = Verdict::NotSupported;
            }
            None if m.kind() == "nvme" && self.system.kernel_p2pdma == Some(true) => {
                reasons.push(reason(
                    "no_p2p_memory",
                    Severity::Blocker,
                    format!("{}{} exposes no controller memory buffer (no p2pmem/): there is nothing for a NIC to reach", m.bdf, m.nvme.as_ref().map(|n| format!(" ({n})")).unwrap_or_default()),
                    Some("use an NVMe controller with a CMB (CMBSZ != 0 in `nvme show-regs`)".into()),
                ));
                *verdict = Verdict::NotSupported;
            }
            None => {}
        }
        if let Some((bar, size)) = m.prefetchable_bar {
            if m.kind() != "nvme" && size >= 64 << 20 {
                reasons.push(reason(
                    "large_bar",
                    Severity::Info,
                    format!(
                        "{} has a {} MiB prefetchable BAR{bar}: the window through which peers reach its memory (GPUs map device memory into it on demand)",
                        m.bdf,
                        size >> 20
                    ),
                    None,
                ));
            }
        }
    }
}

fn driver_reasons(name: &str, probe: &DriverProbe, m: &PciDev, reasons: &mut Vec<Reason>) {
    if m.kind() == "gpu" || m.kind() == "accelerator" {
        match probe.dmabuf_mr {
            Support::Unsupported => reasons.push(reason(
                "dmabuf_mr_unsupported",
                Severity::Warning,
                format!("{name}'s driver refuses dma-buf MRs (EOPNOTSUPP): {} memory exported as a dma-buf cannot be registered, so p2p-rdma serves it through bounce buffers", m.bdf),
                Some("use an RDMA driver with dma-buf MR support (mlx5 and others since Linux 5.12; rxe and siw have none)".into()),
            )),
            Support::Supported => reasons.push(reason(
                "dmabuf_mr_supported",
                Severity::Info,
                format!("{name}'s driver accepts dma-buf MRs"),
                None,
            )),
            Support::Unknown => {}
        }
    }
    if m.kind() == "nvme" || m.kind() == "p2pmem" {
        match probe.odp {
            Support::Supported => reasons.push(reason(
                "odp_supported",
                Severity::Info,
                format!("{name} supports ODP for RC READ/WRITE: a p2pmem mapping can be registered on demand (pinned registration of it fails with EFAULT on drivers that do not map P2PDMA pages); p2p-rdma proves it with a canary before use"),
                None,
            )),
            Support::Unsupported => reasons.push(reason(
                "odp_unsupported",
                Severity::Info,
                format!("{name} has no ODP: a p2pmem mapping can only be registered pinned"),
                None,
            )),
            Support::Unknown => {}
        }
    }
}

impl Report {
    /// The matrix and the reasons, for people.
    pub fn render(&self) -> String {
        let mut o = String::new();
        if self.rdma_devices.is_empty() {
            o.push_str("no RDMA devices in this tree\n");
        }
        if self.memory_devices.is_empty() {
            o.push_str("no memory devices (NVMe, GPU, accelerator, p2pmem) in this tree\n");
        }
        if self.pairs.is_empty() {
            return o;
        }
        let cols: Vec<String> = self
            .memory_devices
            .iter()
            .map(|d| {
                format!(
                    "{} {}",
                    d.bdf,
                    d.nvme.clone().unwrap_or_else(|| d.kind().to_string())
                )
            })
            .collect();
        let w0 = self
            .rdma_devices
            .iter()
            .map(|r| r.name.len() + 14)
            .max()
            .unwrap_or(8)
            .max(8);
        let wc = cols.iter().map(|c| c.len()).max().unwrap_or(0).max(26);
        let _ = write!(o, "{:w0$}", "");
        for c in &cols {
            let _ = write!(o, "  {c:wc$}");
        }
        o.push('\n');
        for r in &self.rdma_devices {
            let label = format!(
                "{} {}",
                r.name,
                r.pci
                    .as_deref()
                    .map(|p| p.get(5..).unwrap_or(p))
                    .unwrap_or("(no PCI)")
            );
            let _ = write!(o, "{label:w0$}");
            for m in &self.memory_devices {
                let cell = self
                    .pairs
                    .iter()
                    .find(|p| p.rdma_device == r.name && p.device_pci == m.bdf)
                    .map(|p| {
                        format!(
                            "{} {}",
                            p.path.map(|c| c.as_str()).unwrap_or("-"),
                            p.verdict.as_str()
                        )
                    })
                    .unwrap_or_default();
                let _ = write!(o, "  {cell:wc$}");
            }
            o.push('\n');
        }
        o.push_str("\nLegend: SAME one function, PIX one switch, PXB several bridges, PHB through a host bridge, SYS across sockets\n");
        let _ = writeln!(
            o,
            "CPU: {}{}; IOMMU: {}; kernel P2PDMA: {} ({})",
            self.system.cpu.vendor,
            self.system
                .cpu
                .family
                .map(|f| format!(" family {f:#x}"))
                .unwrap_or_default(),
            if self.system.iommus.is_empty() {
                "none".to_string()
            } else {
                self.system.iommus.join(", ")
            },
            match self.system.kernel_p2pdma {
                Some(true) => "yes",
                Some(false) => "no",
                None => "unknown",
            },
            self.system.kernel_p2pdma_source
        );
        for p in &self.pairs {
            let _ = writeln!(
                o,
                "\n{} ({}) -> {} ({}): {} {}",
                p.rdma_device,
                p.nic_pci.as_deref().unwrap_or("no PCI device"),
                p.device_pci,
                p.device_kind,
                p.path.map(|c| c.as_str()).unwrap_or("-"),
                p.verdict.as_str()
            );
            for r in &p.reasons {
                let tag = match r.severity {
                    Severity::Info => "  ",
                    Severity::Warning => "! ",
                    Severity::Blocker => "x ",
                };
                let _ = writeln!(o, "  {tag}[{}] {}", r.code, r.message);
                if let Some(f) = &r.fix {
                    let _ = writeln!(o, "      fix: {f}");
                }
            }
        }
        o
    }
}
