//! Reading a topology out of a sysfs tree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::config::Config;
use super::*;

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

pub(super) fn last_name(p: &Path) -> Option<String> {
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
}
