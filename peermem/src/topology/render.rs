//! The report for people: the matrix and the reasons.

use std::fmt::Write as _;

use super::*;

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
        for b in &self.best_nics {
            let _ = writeln!(
                o,
                "best NIC for {}: {} ({} {}){}",
                b.device_pci,
                b.rdma_device,
                b.path.map(|c| c.as_str()).unwrap_or("-"),
                b.verdict.as_str(),
                if b.ties.is_empty() {
                    String::new()
                } else {
                    format!(", as good: {}", b.ties.join(", "))
                }
            );
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
        if !self.storage_pairs.is_empty() {
            o.push_str(
                "\nStorage through a CMB (nvme regions with via=cmb: the SSD DMAs into the CMB, \
                 the NIC reads the CMB; the NIC legs are in the matrix above):\n",
            );
            for p in &self.storage_pairs {
                let _ = writeln!(
                    o,
                    "  SSD {} ({}) -> CMB {}: {} {}",
                    p.rdma_device,
                    p.nic_pci.as_deref().unwrap_or("-"),
                    p.device_pci,
                    p.path.map(|c| c.as_str()).unwrap_or("-"),
                    p.verdict.as_str()
                );
            }
        }
        for p in self.pairs.iter().chain(&self.storage_pairs) {
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
