//! The topology doctor against the sysfs fixtures in tests/fixtures/sysfs: for every tree, the
//! path class, verdict and reason codes of each (RDMA device, memory device) pair.
use std::path::PathBuf;

use p2p_rdma::peermem::topology::{Extra, PathClass, Report, Sysfs, Topology, Verdict};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sysfs")
        .join(name)
}

fn report(name: &str) -> Report {
    let root = fixture(name);
    assert!(root.is_dir(), "fixture {} is missing", root.display());
    let extra = Extra::load(&root).unwrap();
    Topology::read(&Sysfs::new(&root), &extra).report()
}

/// Assert one pair: path, verdict, and that `codes` are all among its reason codes (and
/// `absent` are not).
fn check(
    r: &Report,
    nic: &str,
    dev: &str,
    path: Option<PathClass>,
    verdict: Verdict,
    codes: &[&str],
    absent: &[&str],
) {
    let p = r
        .pairs
        .iter()
        .find(|p| p.rdma_device == nic && p.device_pci == dev)
        .unwrap_or_else(|| panic!("no pair {nic} x {dev} in {:#?}", r.pairs));
    let have: Vec<&str> = p.reasons.iter().map(|r| r.code).collect();
    assert_eq!(p.path, path, "{nic} x {dev}: {have:?}");
    assert_eq!(p.verdict, verdict, "{nic} x {dev}: {have:?}");
    for c in codes {
        assert!(have.contains(c), "{nic} x {dev}: {c} missing from {have:?}");
    }
    for c in absent {
        assert!(
            !have.contains(c),
            "{nic} x {dev}: {c} unexpected in {have:?}"
        );
    }
    for reason in &p.reasons {
        assert!(!reason.message.is_empty());
        if reason.severity != p2p_rdma::peermem::topology::Severity::Info {
            assert!(
                reason.fix.is_some() || reason.code == "p2pmem_not_published",
                "{} has no fix",
                reason.code
            );
        }
    }
}

#[test]
fn nic_and_nvme_under_one_switch_without_acs_are_direct() {
    let r = report("switch-direct");
    assert_eq!(r.pairs.len(), 1);
    check(
        &r,
        "mlx5_0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::Direct,
        &["common_upstream_bridge", "p2pmem", "no_iommu"],
        &["acs_redirect"],
    );
    let p = &r.pairs[0];
    assert_eq!(p.distance, Some(4));
    assert_eq!(
        p.bridges,
        vec!["0000:02:01.0", "0000:01:00.0", "0000:02:00.0"]
    );
}

#[test]
fn acs_redirect_on_the_downstream_ports_goes_through_the_host_bridge() {
    let r = report("switch-acs");
    check(
        &r,
        "mlx5_0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::ThroughHostBridge,
        &["acs_redirect", "host_bridge_whitelisted"],
        &["common_upstream_bridge"],
    );
    let p = &r.pairs[0];
    assert_eq!(p.acs_redirect, vec!["0000:02:00.0", "0000:02:01.0"]);
    let fix = p
        .reasons
        .iter()
        .find(|r| r.code == "acs_redirect")
        .unwrap()
        .fix
        .clone()
        .unwrap();
    assert!(
        fix.contains("pci=disable_acs_redir=0000:02:00.0;0000:02:01.0"),
        "{fix}"
    );
}

#[test]
fn without_root_acs_is_unknown_not_guessed() {
    let r = report("switch-unprivileged");
    check(
        &r,
        "mlx5_0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::Unknown,
        &["acs_unknown"],
        &["acs_redirect", "common_upstream_bridge"],
    );
    let m = &r.pairs[0]
        .reasons
        .iter()
        .find(|r| r.code == "acs_unknown")
        .unwrap()
        .message;
    assert!(m.contains("need root"), "{m}");
}

#[test]
fn two_root_ports_of_a_whitelisted_intel_host_bridge() {
    let r = report("intel-root-ports-whitelisted");
    check(
        &r,
        "mlx5_0",
        "0000:02:00.0",
        Some(PathClass::Phb),
        Verdict::ThroughHostBridge,
        &["no_common_bridge", "host_bridge_whitelisted"],
        &["acs_redirect"],
    );
}

#[test]
fn two_root_ports_of_a_host_bridge_not_on_the_whitelist() {
    let r = report("intel-root-ports-not-whitelisted");
    check(
        &r,
        "mlx5_0",
        "0000:02:00.0",
        Some(PathClass::Phb),
        Verdict::NotSupported,
        &["host_bridge_not_whitelisted"],
        &["host_bridge_whitelisted"],
    );
    let fix = r.pairs[0]
        .reasons
        .iter()
        .find(|r| r.code == "host_bridge_not_whitelisted")
        .unwrap()
        .fix
        .clone()
        .unwrap();
    assert!(fix.contains("one PCIe switch"), "{fix}");
}

#[test]
fn an_amd_zen_cpu_allows_p2p_through_its_host_bridge() {
    let r = report("amd-zen");
    assert_eq!(r.system.cpu.vendor, "amd");
    assert_eq!(r.system.cpu.family, Some(0x19));
    check(
        &r,
        "mlx5_0",
        "0000:02:00.0",
        Some(PathClass::Phb),
        Verdict::ThroughHostBridge,
        &["cpu_allows_p2p", "large_bar"],
        &["host_bridge_not_whitelisted"],
    );
}

#[test]
fn devices_on_two_sockets_are_sys() {
    let r = report("dual-socket");
    check(
        &r,
        "mlx5_0",
        "0000:81:00.0",
        Some(PathClass::Sys),
        Verdict::ThroughHostBridge,
        &["cross_socket", "host_bridge_whitelisted"],
        &[],
    );
    // Xeon E5 host bridges are whitelisted only within one host bridge.
    let r = report("dual-socket-xeon-e5");
    check(
        &r,
        "mlx5_0",
        "0000:81:00.0",
        Some(PathClass::Sys),
        Verdict::NotSupported,
        &["cross_socket", "host_bridge_needs_same_bridge"],
        &[],
    );
}

#[test]
fn iommu_translated_versus_passthrough() {
    let r = report("iommu-translated");
    assert_eq!(r.system.iommus, vec!["dmar0"]);
    check(
        &r,
        "mlx5_0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::ThroughHostBridge,
        &["iommu_translated", "acs_redirect", "ats_disabled"],
        &["iommu_passthrough", "no_iommu"],
    );
    let fix = r.pairs[0]
        .reasons
        .iter()
        .find(|r| r.code == "iommu_translated")
        .unwrap()
        .fix
        .clone()
        .unwrap();
    assert!(fix.contains("iommu=pt"), "{fix}");
    let r = report("iommu-passthrough");
    check(
        &r,
        "mlx5_0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::Direct,
        &["iommu_passthrough"],
        &["iommu_translated", "no_iommu"],
    );
}

#[test]
fn a_gpu_with_a_large_bar_and_an_nvme_without_a_cmb() {
    let r = report("gpu-switch");
    assert_eq!(r.memory_devices.len(), 2);
    check(
        &r,
        "mlx5_0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::Direct,
        &["large_bar", "dmabuf_mr_supported"],
        &["no_p2p_memory"],
    );
    check(
        &r,
        "mlx5_0",
        "0000:05:00.0",
        Some(PathClass::Phb),
        Verdict::NotSupported,
        &["no_p2p_memory", "host_bridge_whitelisted"],
        &[],
    );
    assert_eq!(r.system.kernel_p2pdma, Some(true));
    // rxe0 on a virtio-net NIC: the netdev's device is virtio0, below the PCI function.
    let rxe = r.rdma_devices.iter().find(|d| d.name == "rxe0").unwrap();
    assert_eq!(rxe.pci.as_deref(), Some("0000:06:00.0"));
    check(
        &r,
        "rxe0",
        "0000:03:00.0",
        Some(PathClass::Phb),
        Verdict::ThroughHostBridge,
        &["software_rdma", "host_bridge_whitelisted", "large_bar"],
        &[],
    );
    let gpu = r
        .memory_devices
        .iter()
        .find(|d| d.bdf == "0000:03:00.0")
        .unwrap();
    assert_eq!(gpu.prefetchable_bar, Some((1, 128 << 30)));
}

#[test]
fn the_nic_beside_a_device_ranks_first_and_one_nic_lists_no_ranking() {
    let r = report("gpu-switch");
    // the GPU: mlx5_0 under its switch (PIX, direct) beats rxe0 through the host bridge
    let gpu = r.nics_for("0000:03:00.0", &[]);
    let names: Vec<&str> = gpu.iter().map(|p| p.rdma_device.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "rxe0"]);
    let best = r
        .best_nics
        .iter()
        .find(|b| b.device_pci == "0000:03:00.0")
        .unwrap();
    assert_eq!(
        (best.rdma_device.as_str(), best.path, best.verdict),
        ("mlx5_0", Some(PathClass::Pix), Verdict::Direct)
    );
    assert!(best.ties.is_empty(), "{best:?}");
    // restricted to the NICs a server uses: the only one left wins, whatever its path
    let only = r.best_nics(&["rxe0"]);
    assert!(only.iter().all(|b| b.rdma_device == "rxe0"), "{only:?}");
    assert_eq!(only.len(), r.memory_devices.len());
    // every memory device has an answer, and the text says it
    assert_eq!(r.best_nics.len(), r.memory_devices.len());
    assert!(
        r.render()
            .contains("best NIC for 0000:03:00.0: mlx5_0 (PIX direct)"),
        "{}",
        r.render()
    );
    // one RDMA device: nothing to rank, and the JSON has no such key
    let one = report("switch-acs");
    assert!(one.best_nics.is_empty());
    let v = serde_json::to_value(&one).unwrap();
    assert!(v.get("best_nics").is_none(), "{v}");
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["best_nics"][0]["rdma_device"], "mlx5_0", "{v}");
}

#[test]
fn the_json_contract_holds() {
    let r = report("switch-acs");
    let v = serde_json::to_value(&r).unwrap();
    let p = &v["pairs"][0];
    for k in [
        "rdma_device",
        "nic_pci",
        "device_pci",
        "path",
        "verdict",
        "reasons",
    ] {
        assert!(!p[k].is_null(), "{k} missing: {p}");
    }
    assert_eq!(p["path"], "PIX");
    assert_eq!(p["verdict"], "through_host_bridge");
    for r in p["reasons"].as_array().unwrap() {
        assert!(r["code"].is_string() && r["message"].is_string(), "{r}");
        assert!(r.get("fix").is_some(), "{r}");
    }
    assert_eq!(v["memory_devices"][0]["vendor"], "144d");
}

#[test]
fn every_fixture_has_a_test() {
    // A fixture added without assertions would test nothing.
    let tested = [
        "switch-direct",
        "switch-acs",
        "switch-unprivileged",
        "intel-root-ports-whitelisted",
        "intel-root-ports-not-whitelisted",
        "amd-zen",
        "dual-socket",
        "dual-socket-xeon-e5",
        "iommu-translated",
        "iommu-passthrough",
        "gpu-switch",
        "lab-7.3-flat",
        "lab-7.3-switch",
        "lab-7.3-iommu",
        "lab-6.12-switch",
    ];
    for e in std::fs::read_dir(fixture("")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            let n = e.file_name().to_string_lossy().into_owned();
            assert!(tested.contains(&n.as_str()), "fixture {n} has no test");
        }
    }
}

#[test]
fn no_fixture_directory_is_empty() {
    // git does not store empty directories: a fresh clone would lack them and replay differently
    // (a `driver` link would dangle, an `nvme/` listing would be missing).
    fn walk(d: &std::path::Path, empty: &mut Vec<String>) {
        let mut any = false;
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            any = true;
            if e.file_type().unwrap().is_dir() {
                walk(&e.path(), empty);
            }
        }
        if !any {
            empty.push(d.display().to_string());
        }
    }
    let mut empty = Vec::new();
    walk(&fixture(""), &mut empty);
    assert!(
        empty.is_empty(),
        "empty fixture directories (add a .keep, as build.py and `topo --capture` do): {empty:?}"
    );
}

/// Replay a lab capture and compare with the JSON the guest printed live.
fn replay_matches_live(name: &str) -> Report {
    let r = report(name);
    let live: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(&format!("{name}.live.json"))).unwrap())
            .unwrap();
    let mut replayed = serde_json::to_value(&r).unwrap();
    if live.get("storage_pairs").is_none() {
        // captured before the report had the storage legs: compare what both have
        replayed.as_object_mut().unwrap().remove("storage_pairs");
    }
    assert_eq!(
        replayed, live,
        "{name}: the replayed capture differs from the live report"
    );
    r
}

#[test]
fn lab_captures_replay_exactly_as_they_ran_live() {
    // 7.3, switch: NIC (e1000e, rxe0 on eth0) and NVMe 03:00.0 below one QEMU switch whose
    // ports have no ACS; NVMe 05:00.0 on its own root port of QEMU's q35 host bridge.
    let r = replay_matches_live("lab-7.3-switch");
    assert_eq!(r.rdma_devices[0].software.as_deref(), Some("rxe"));
    check(
        &r,
        "rxe0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::Direct,
        &[
            "software_rdma",
            "common_upstream_bridge",
            "p2pmem",
            "odp_supported",
        ],
        &[],
    );
    check(
        &r,
        "rxe0",
        "0000:05:00.0",
        Some(PathClass::Phb),
        Verdict::NotSupported,
        &["host_bridge_not_whitelisted"],
        &[],
    );
    // QEMU's root ports have ACS (capability 0x5f) and, without an IOMMU, nothing enabled;
    // the switch ports have no ACS at all.
    let acs_of = |r: &Report, bdf: &str| {
        r.pci_path_devices
            .iter()
            .find(|d| d.bdf == bdf)
            .unwrap()
            .config
            .acs
    };
    assert_eq!(acs_of(&r, "0000:00:03.0"), Some((0x5f, 0)));
    assert_eq!(acs_of(&r, "0000:02:00.0"), None);

    let r = replay_matches_live("lab-7.3-iommu");
    assert_eq!(r.system.iommus, vec!["dmar0"]);
    // With the IOMMU on, the kernel enables SV, RR, CR and UF on the root ports (above the
    // switch, so the NIC-NVMe path inside the switch stays direct).
    use p2p_rdma::peermem::topology::config::acs;
    assert_eq!(
        acs_of(&r, "0000:00:03.0"),
        Some((0x5f, acs::SV | acs::RR | acs::CR | acs::UF))
    );
    check(
        &r,
        "rxe0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::Direct,
        &["iommu_translated", "ats_absent"],
        &["no_iommu"],
    );
    check(
        &r,
        "rxe0",
        "0000:05:00.0",
        Some(PathClass::Phb),
        Verdict::NotSupported,
        &["iommu_translated", "host_bridge_not_whitelisted"],
        &[],
    );

    // 6.12: no CONFIG_PCI_P2PDMA, nothing published, no ODP on rxe.
    let r = replay_matches_live("lab-6.12-switch");
    assert_eq!(r.system.kernel_p2pdma, None);
    check(
        &r,
        "rxe0",
        "0000:03:00.0",
        Some(PathClass::Pix),
        Verdict::NotSupported,
        &["kernel_p2pdma_unknown", "odp_unsupported"],
        &["p2pmem"],
    );

    // flat: rxe0 on a dummy netdev, no NVMe.
    let r = replay_matches_live("lab-7.3-flat");
    assert_eq!(r.rdma_devices[0].netdev.as_deref(), Some("d0"));
    assert_eq!(r.rdma_devices[0].pci, None);
    assert!(r.pairs.is_empty(), "{:?}", r.pairs);
}

#[test]
fn storage_pairs_say_whether_each_ssd_reaches_each_cmb() {
    // the 7.3 lab: two NVMe controllers with CMBs on different root ports of a q35 host
    // bridge that is not whitelisted: neither SSD reaches the other's CMB
    let r = report("lab-7.3-switch");
    let got: Vec<(&str, &str, Option<PathClass>, Verdict)> = r
        .storage_pairs
        .iter()
        .map(|p| {
            (
                p.rdma_device.as_str(),
                p.device_pci.as_str(),
                p.path,
                p.verdict,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "nvme0",
                "0000:05:00.0",
                Some(PathClass::Phb),
                Verdict::NotSupported
            ),
            (
                "nvme1",
                "0000:03:00.0",
                Some(PathClass::Phb),
                Verdict::NotSupported
            )
        ]
    );
    let p = &r.storage_pairs[0];
    assert_eq!(p.nic_pci.as_deref(), Some("0000:03:00.0"));
    assert!(p
        .reasons
        .iter()
        .any(|r| r.code == "host_bridge_not_whitelisted"));
    let text = r.render();
    assert!(
        text.contains("Storage through a CMB")
            && text.contains("SSD nvme0 (0000:03:00.0) -> CMB 0000:05:00.0: PHB not_supported"),
        "{text}"
    );
    // no device publishes p2pmem: no storage leg to report, and the JSON says nothing of it
    for f in ["gpu-switch", "lab-6.12-switch"] {
        let r = report(f);
        assert!(r.storage_pairs.is_empty(), "{f}");
        let json = serde_json::to_string(&r).unwrap();
        assert!(!json.contains("storage_pairs"), "{f}");
        assert!(!r.render().contains("Storage through a CMB"), "{f}");
    }
}
