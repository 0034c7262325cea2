//! Which RDMA device serves a memory device best: the pairs of one memory device ranked by
//! what the kernel would do with them (verdict), then by how close the two are (path class,
//! then the kernel's P2PDMA distance), the device name last so the order is stable.

use std::cmp::Ordering;

use serde::Serialize;

use super::{Pair, PathClass, Report, Verdict};

/// The RDMA device to serve one memory device from, and why (with more than one RDMA device).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BestNic {
    /// The memory device.
    pub device_pci: String,
    /// The RDMA device ranked first.
    pub rdma_device: String,
    /// Its path class to the memory device.
    pub path: Option<PathClass>,
    /// Its verdict.
    pub verdict: Verdict,
    /// The RDMA devices that rank as well (a tie: any of them serves it as well).
    pub ties: Vec<String>,
}

fn verdict_rank(v: Verdict) -> u8 {
    match v {
        Verdict::Direct => 0,
        Verdict::ThroughHostBridge => 1,
        Verdict::Unknown => 2,
        Verdict::NotSupported => 3,
    }
}

fn path_rank(p: Option<PathClass>) -> u8 {
    match p {
        Some(PathClass::Same) => 0,
        Some(PathClass::Pix) => 1,
        Some(PathClass::Pxb) => 2,
        Some(PathClass::Phb) => 3,
        Some(PathClass::Sys) => 4,
        None => 5,
    }
}

/// How well a pair serves its memory device, ignoring the names: `Less` is better.
fn quality(a: &Pair, b: &Pair) -> Ordering {
    verdict_rank(a.verdict)
        .cmp(&verdict_rank(b.verdict))
        .then(path_rank(a.path).cmp(&path_rank(b.path)))
        .then(
            a.distance
                .unwrap_or(u32::MAX)
                .cmp(&b.distance.unwrap_or(u32::MAX)),
        )
}

impl Report {
    /// The pairs of `device_pci` with the RDMA devices named in `among` (every one when empty),
    /// best first.
    pub fn nics_for(&self, device_pci: &str, among: &[&str]) -> Vec<&Pair> {
        let mut v: Vec<&Pair> = self
            .pairs
            .iter()
            .filter(|p| p.device_pci == device_pci)
            .filter(|p| among.is_empty() || among.contains(&p.rdma_device.as_str()))
            .collect();
        v.sort_by(|a, b| quality(a, b).then(a.rdma_device.cmp(&b.rdma_device)));
        v
    }

    /// For every memory device, the RDMA device ranked first among `among` (every one when
    /// empty), with the ones that tie with it.
    pub fn best_nics(&self, among: &[&str]) -> Vec<BestNic> {
        self.memory_devices
            .iter()
            .filter_map(|m| {
                let ranked = self.nics_for(&m.bdf, among);
                let first = *ranked.first()?;
                Some(BestNic {
                    device_pci: m.bdf.clone(),
                    rdma_device: first.rdma_device.clone(),
                    path: first.path,
                    verdict: first.verdict,
                    ties: ranked[1..]
                        .iter()
                        .filter(|p| quality(p, first) == Ordering::Equal)
                        .map(|p| p.rdma_device.clone())
                        .collect(),
                })
            })
            .collect()
    }
}
