//! Lab tests of `p2p-rdma topo`: the live report inside each lab topology matches the tree the
//! guest really has (path classes, ACS bits as lspci reads them, IOMMU state, the kernel's
//! verdict), and a capture replays to the same JSON.
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod common;
use common::LAB;

fn topology() -> String {
    std::env::var("P2P_LAB_TOPOLOGY")
        .unwrap_or_else(|_| panic!("P2P_LAB_TOPOLOGY is not set. {LAB}"))
}

fn kernel() -> String {
    std::env::var("P2P_LAB_KERNEL").unwrap_or_else(|_| panic!("P2P_LAB_KERNEL is not set. {LAB}"))
}

fn topo(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .arg("topo")
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "topo {args:?}: {err}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"))
}

fn real(p: &str) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

fn codes(pair: &Value) -> Vec<String> {
    pair["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["code"].as_str().unwrap().to_string())
        .collect()
}

/// The ACS control bits lspci prints for `bdf` ("SrcValid+ TransBlk- ..."), as the names set.
fn lspci_acs(bdf: &str) -> Option<Vec<String>> {
    let out = Command::new("lspci")
        .args(["-vvv", "-s", bdf])
        .output()
        .expect("lspci runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("ACSCtl:"))?;
    Some(
        line.split_whitespace()
            .skip(1)
            .filter(|w| w.ends_with('+'))
            .map(|w| w.trim_end_matches('+').to_string())
            .collect(),
    )
}

#[test]
#[ignore = "lab"]
fn lab_topo_reports_the_tree_the_guest_has() {
    let t = topology();
    let v = topo(&["--json"]);
    let rxe = v["rdma_devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "rxe0")
        .unwrap_or_else(|| panic!("rxe0 missing: {v}"));
    assert_eq!(rxe["software"], "rxe", "{rxe}");
    let pairs = v["pairs"].as_array().unwrap();
    if t == "flat" {
        // rxe0 sits on a dummy netdev: no PCI device, and no NVMe in this machine.
        assert_eq!(rxe["netdev"], "d0");
        assert!(rxe["pci"].is_null(), "{rxe}");
        assert!(
            pairs
                .iter()
                .all(|p| p["verdict"] == "not_supported"
                    && codes(p).contains(&"not_pci".to_string())),
            "{v}"
        );
        return;
    }
    // The NIC of rxe0 is eth0's PCI device.
    let nic_path = real("/sys/class/net/eth0/device");
    let nic = name(&nic_path);
    assert_eq!(rxe["pci"], nic.as_str(), "{rxe}");
    let nic_switch = nic_path.parent().unwrap().parent().unwrap().to_path_buf();
    // Each NVMe: the one below the NIC's switch is PIX, the one on its own root port PHB.
    let mut seen = 0;
    let mut ssd_seen = false;
    for ctrl in std::fs::read_dir("/sys/class/nvme").unwrap() {
        let ctrl = ctrl.unwrap().file_name().to_string_lossy().into_owned();
        let dev = real(&format!("/sys/class/nvme/{ctrl}/device"));
        let bdf = name(&dev);
        let serial = std::fs::read_to_string(format!("/sys/class/nvme/{ctrl}/serial")).unwrap();
        if serial.trim() == "p2plabssd" {
            // the SSD (no CMB) beside the NIC and the CMB on the switch: its storage leg to
            // that CMB stays below the switch (7.3); 6.12 publishes no p2pmem, so no leg
            ssd_seen = true;
            let storage = v["storage_pairs"].as_array();
            if kernel() == "6.12" {
                assert!(storage.is_none(), "{v}");
                continue;
            }
            let cmb = storage
                .unwrap()
                .iter()
                .find(|p| {
                    p["nic_pci"] == bdf.as_str() && {
                        let d = real(&format!(
                            "/sys/bus/pci/devices/{}",
                            p["device_pci"].as_str().unwrap()
                        ));
                        // on the same switch: the same upstream port above their ports
                        d.parent().and_then(Path::parent) == dev.parent().and_then(Path::parent)
                    }
                })
                .unwrap_or_else(|| {
                    panic!("no storage leg from the SSD {bdf} to the CMB beside it: {v}")
                });
            assert_eq!(
                (cmb["path"].as_str(), cmb["verdict"].as_str()),
                (Some("PIX"), Some("direct")),
                "{cmb}"
            );
            assert_eq!(cmb["rdma_device"], ctrl.as_str(), "{cmb}");
            continue;
        }
        let pair = pairs
            .iter()
            .find(|p| p["rdma_device"] == "rxe0" && p["device_pci"] == bdf.as_str())
            .unwrap_or_else(|| panic!("no pair for {bdf}: {v}"));
        let c = codes(pair);
        assert!(c.contains(&"software_rdma".to_string()), "{c:?}");
        let below_switch = dev.parent().unwrap().parent().unwrap() == nic_switch;
        assert_eq!(
            pair["path"],
            if below_switch { "PIX" } else { "PHB" },
            "{bdf}: {pair}"
        );
        let expect = match (kernel().as_str(), below_switch) {
            // 6.12 has no CONFIG_PCI_P2PDMA: nothing is published.
            ("6.12", _) => "not_supported",
            // QEMU's switch ports have no ACS: bus addresses inside the switch.
            (_, true) => "direct",
            // Across root ports: QEMU's q35 host bridge (8086:29c0) is not whitelisted and
            // the emulated CPU is no AMD Zen.
            (_, false) => "not_supported",
        };
        assert_eq!(pair["verdict"], expect, "{bdf}: {pair}");
        if kernel() == "6.12" {
            assert!(c.iter().any(|c| c.starts_with("kernel_")), "{c:?}");
        } else if below_switch {
            assert!(
                c.contains(&"common_upstream_bridge".to_string())
                    && c.contains(&"p2pmem".to_string()),
                "{c:?}"
            );
        } else {
            assert!(
                c.contains(&"host_bridge_not_whitelisted".to_string()),
                "{c:?}"
            );
        }
        if t == "iommu" {
            assert!(c.contains(&"iommu_translated".to_string()), "{c:?}");
        } else {
            assert!(c.contains(&"no_iommu".to_string()), "{c:?}");
        }
        seen += 1;
    }
    assert_eq!(
        seen, 2,
        "the {t} topology has two NVMe controllers with a CMB"
    );
    assert!(ssd_seen, "the {t} topology has an SSD (serial p2plabssd)");
    assert_eq!(
        v["system"]["iommus"].as_array().unwrap().len(),
        usize::from(t == "iommu"),
        "{}",
        v["system"]
    );

    // ACS control bits as lspci reads them, for every function the report looked at.
    let mut checked = 0;
    for d in v["pci_path_devices"]
        .as_array()
        .unwrap()
        .iter()
        .chain(v["memory_devices"].as_array().unwrap())
    {
        let bdf = d["bdf"].as_str().unwrap();
        let ours: Option<Vec<String>> = d["config"]["acs"].as_array().map(|a| {
            let ctrl = a[1].as_u64().unwrap() as u16;
            p2p_rdma::peermem::topology::config::acs::names(ctrl)
                .into_iter()
                .map(String::from)
                .collect()
        });
        assert_eq!(ours, lspci_acs(bdf), "ACS control of {bdf}");
        checked += 1;
    }
    assert!(checked >= 4, "{v}");
}

#[test]
#[ignore = "lab"]
fn lab_topo_capture_replays_as_live() {
    let _ = topology();
    let dir = std::env::temp_dir().join(format!("topo-capture-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["topo", "--capture"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("replay: p2p-rdma topo --sysfs-root"));
    let live = topo(&["--json"]);
    let replay = topo(&["--json", "--sysfs-root", dir.to_str().unwrap()]);
    assert_eq!(
        replay, live,
        "a replayed capture must report what the live system does"
    );
    // A second capture into the same directory is refused.
    let again = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["topo", "--capture"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("not empty"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "lab"]
fn lab_dualnic_each_cmb_ranks_the_nic_beside_it_first() {
    assert_eq!(
        std::env::var("P2P_LAB_NICS").as_deref(),
        Ok("2"),
        "needs the two-NIC guest (soft-roce/lab --topology switch --nics 2). {LAB}"
    );
    let v = topo(&["--json"]);
    let mut nics: Vec<&str> = v["rdma_devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    nics.sort();
    assert_eq!(nics, ["rxe0", "rxe1"], "{v}");
    let best = v["best_nics"].as_array().expect("best_nics with two NICs");
    // each NVMe with a CMB sits under its own switch with one NIC: that NIC ranks first
    // (PIX, direct on 7.3) and nothing ties with it
    let mut chosen = Vec::new();
    for m in v["memory_devices"].as_array().unwrap() {
        let (Some(nvme), Some(_)) = (m["nvme"].as_str(), m["p2pmem"].as_object()) else {
            continue;
        };
        let bdf = m["bdf"].as_str().unwrap();
        let b = best
            .iter()
            .find(|b| b["device_pci"] == bdf)
            .unwrap_or_else(|| panic!("no best NIC for {bdf}: {v}"));
        assert_eq!(b["path"], "PIX", "{nvme}: {b}");
        if kernel() == "7.3" {
            assert_eq!(b["verdict"], "direct", "{nvme}: {b}");
        }
        assert_eq!(b["ties"].as_array().map(Vec::len), Some(0), "{b}");
        chosen.push((
            nvme.to_string(),
            b["rdma_device"].as_str().unwrap().to_string(),
        ));
    }
    assert_eq!(chosen.len(), 2, "two CMBs: {v}");
    assert_ne!(
        chosen[0].1, chosen[1].1,
        "each CMB has its own NIC: {chosen:?}"
    );
    // the doctor, run on the other NIC, names the better one; on the best one it says nothing
    let (nvme, best_nic) = &chosen[0];
    let other = if best_nic == "rxe0" { "rxe1" } else { "rxe0" };
    let doctor = |dev: &str| -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
            .args(["doctor", "--region", &format!("cmb:{nvme}:1M"), "--json"])
            .args(["--device", dev])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"))
    };
    let d = doctor(other);
    assert_eq!(d["better_nic"]["rdma_device"], best_nic.as_str(), "{d}");
    let d = doctor(best_nic);
    assert!(d["better_nic"].is_null(), "{d}");
}
