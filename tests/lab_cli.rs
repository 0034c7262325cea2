//! Lab tests of the command line (run inside the soft-RoCE guest by soft-roce/lab-tests).
use std::process::Command;

const LAB: &str =
    "lab test: needs an RDMA device; run it with soft-roce/lab, or set P2P_RDMA_DEVICE";

fn device() -> String {
    std::env::var("P2P_RDMA_DEVICE").unwrap_or_else(|_| panic!("P2P_RDMA_DEVICE is not set. {LAB}"))
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
}

#[test]
#[ignore = "lab"]
fn lab_devices_json_lists_the_device_with_a_roce_v2_gid() {
    let dev = device();
    let out = bin().args(["devices", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = v
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == dev.as_str())
        .unwrap_or_else(|| panic!("{dev} not listed: {v}"));
    let gids = d["ports"][0]["gids"].as_array().unwrap();
    assert!(
        gids.iter()
            .any(|g| g["kind"] == "RoCEv2" && !g["ipv4"].is_null()),
        "no RoCE v2 IPv4-mapped GID: {gids:?}"
    );
    assert_eq!(d["ports"][0]["state"], "ACTIVE");
    assert_eq!(d["software"], true);
    // the table form names the same device
    let out = bin().arg("devices").output().unwrap();
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(
        t.contains(&dev) && t.contains("RoCEv2") && t.contains("software RDMA"),
        "{t}"
    );
    // the default GID is marked, and the mark explained: the RoCE v2 one with an IPv4 address
    let marked: Vec<&str> = t
        .lines()
        .filter(|l| l.trim_start().starts_with("* GID["))
        .collect();
    assert_eq!(marked.len(), 1, "{t}");
    assert!(
        marked[0].contains("::ffff:") && marked[0].contains("RoCEv2"),
        "{t}"
    );
    assert!(t.contains("--gid-index N overrides"), "{t}");
}

#[test]
#[ignore = "lab"]
fn lab_loopback_write_and_read_verify_data() {
    for op in ["write", "read"] {
        let out = bin()
            .args([
                "loopback", "--op", op, "--size", "256K", "--iters", "16", "--depth", "4",
                "--verify", "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{op}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["verified"], true);
        assert_eq!(v["iterations"], 16);
        assert_eq!(v["bytes"], 16 * 256 * 1024);
        assert!(v["mib_per_sec"].as_f64().unwrap() > 0.0);
    }
}

#[test]
#[ignore = "lab"]
fn lab_loopback_unknown_device_exits_69_with_the_list() {
    let out = bin()
        .args(["loopback", "--device", "nosuch0", "--iters", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("nosuch0") && e.contains(&device()), "{e}");
}
