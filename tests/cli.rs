//! Host-side tests of the command line: usage errors, help, and the no-device path.
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
}

fn rdma_devices_on_host() -> Vec<String> {
    std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn devices_reports_what_the_host_has() {
    let out = bin().arg("devices").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let host = rdma_devices_on_host();
    if host.is_empty() {
        assert_eq!(
            out.status.code(),
            Some(69),
            "stdout: {stdout}\nstderr: {stderr}"
        );
        assert!(stderr.contains("no RDMA device found"), "{stderr}");
        assert!(
            stderr.contains("soft-roce/lab"),
            "must point at the lab: {stderr}"
        );
    } else {
        assert!(out.status.success(), "{stderr}");
        for name in host {
            assert!(stdout.contains(&name), "{name} missing from: {stdout}");
        }
    }
}

#[test]
fn devices_json_is_valid_json_either_way() {
    let out = bin().args(["devices", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let arr = v.as_array().expect("a JSON array");
    assert_eq!(arr.len(), rdma_devices_on_host().len());
    if arr.is_empty() {
        assert_eq!(out.status.code(), Some(69));
    }
}

#[test]
fn bad_sizes_are_usage_errors_with_a_hint() {
    let out = bin().args(["loopback", "--size", "12Q"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("unknown unit") && e.contains("K, M, G"), "{e}");
    let out = bin()
        .args(["loopback", "--duration", "-1"])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let out = bin()
        .args(["loopback", "--iters", "5", "--duration", "2"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "--iters and --duration conflict"
    );
}

#[test]
fn help_teaches() {
    let out = bin().arg("--help").output().unwrap();
    let h = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for s in ["devices", "loopback", "soft-roce/lab", "Exit status"] {
        assert!(h.contains(s), "--help lacks {s}: {h}");
    }
    let out = bin().args(["loopback", "--help"]).output().unwrap();
    let h = String::from_utf8_lossy(&out.stdout);
    assert!(h.contains("Examples:") && h.contains("--verify"), "{h}");
}

#[test]
fn gpu_memory_without_a_driver_says_why() {
    let out = bin()
        .args(["doctor", "--region", "cuda:0:1M"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    if std::path::Path::new("/dev/nvidiactl").exists() && cfg!(feature = "cuda") {
        // A machine with the NVIDIA driver: the driver must load; what fails is elsewhere.
        assert!(!e.contains("no CUDA driver"), "{e}");
        return;
    }
    assert!(
        e.contains("no CUDA driver: dlopen(libcuda.so.1) failed")
            || e.contains("no CUDA support (cargo feature `cuda`)"),
        "{e}"
    );
    assert!(e.contains("fix:"), "{e}");
}

#[test]
fn bench_checks_its_arguments_before_touching_anything() {
    for (args, why) in [
        (
            vec!["bench", "send", "127.0.0.1", "--bidir"],
            "--bidir is for write and read",
        ),
        (
            vec!["bench", "write", "127.0.0.1", "--lat", "--qps", "2"],
            "latency runs use one QP",
        ),
        (
            vec!["bench", "write", "127.0.0.1", "--tx-depth", "0"],
            "--tx-depth must be",
        ),
        (
            vec!["bench", "read", "127.0.0.1", "--duration", "0"],
            "--duration must be",
        ),
        (
            vec!["bench", "write", "127.0.0.1", "--mem", "cmb:nvme0:1M"],
            "give --mem to the server",
        ),
    ] {
        let out = bin().args(&args).output().unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {e}");
        assert!(e.contains(why), "{args:?}: {e}");
    }
    let out = bin()
        .args(["bench", "write", "127.0.0.1", "--size", "1M", "--all"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--size and --all conflict");
    let out = bin().args(["bench", "--help"]).output().unwrap();
    let h = String::from_utf8_lossy(&out.stdout);
    assert!(
        h.contains("Examples:") && h.contains("soft-roce/compare") && h.contains("--report-gbits"),
        "{h}"
    );
}

#[test]
fn bench_says_when_no_server_listens() {
    // Port 9 (discard) is not served here: refused, retried a few seconds, then exit 5.
    let out = bin()
        .args(["bench", "write", "127.0.0.1:9", "--iters", "1"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{e}");
    assert!(
        e.contains("cannot reach the bench server at 127.0.0.1:9"),
        "{e}"
    );
}
