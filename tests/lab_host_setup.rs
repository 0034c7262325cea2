//! Lab test of soft-roce/host-setup: the guest kernel has rdma_rxe, so the script can add and
//! remove a device for real, idempotently.
use std::path::Path;
use std::process::Command;

fn sh(cmd: &str) -> (bool, String) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
#[ignore = "lab"]
fn lab_host_setup_adds_and_removes_rxe_idempotently() {
    assert!(
        std::env::var("P2P_LAB").is_ok(),
        "lab test: changes the machine's RDMA devices; run it inside soft-roce/lab"
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("soft-roce/host-setup");
    let s = script.display();
    let (ok, t) =
        sh("ip link add hs0 type dummy && ip link set hs0 up && ip addr add 10.99.0.1/24 dev hs0");
    assert!(ok, "{t}");
    let (ok, t) = sh(&format!("{s} add hs0 rxe_hs"));
    assert!(ok && t.contains("created rxe_hs"), "{t}");
    let (ok, t) = sh(&format!("{s} add hs0 rxe_hs"));
    assert!(
        ok && t.contains("nothing to do"),
        "second add must be a no-op: {t}"
    );
    let (ok, t) = sh(&format!("{} devices", env!("CARGO_BIN_EXE_p2p-rdma")));
    assert!(ok && t.contains("rxe_hs"), "{t}");
    let (ok, t) = sh(&format!("{s} add nosuchdev0"));
    assert!(
        !ok && t.contains("no network interface 'nosuchdev0'"),
        "{t}"
    );
    let (ok, t) = sh(&format!("{s} remove rxe_hs"));
    assert!(ok && t.contains("removed rxe_hs"), "{t}");
    let (ok, t) = sh(&format!("{s} remove rxe_hs"));
    assert!(ok && t.contains("nothing to do"), "{t}");
    let _ = sh("ip link del hs0");
}
