//! The analysis of one NIC × memory pair: the kernel's rule, then IOMMU, memory and driver
//! reasons.

use super::config::{acs, Access, PortType};
use super::*;

impl Topology {
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
