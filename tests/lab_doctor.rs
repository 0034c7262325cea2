//! Lab tests of `p2p-rdma doctor`: registration attempts proved by a byte-comparing canary.
use std::process::Command;

fn device() -> String {
    std::env::var("P2P_RDMA_DEVICE").unwrap_or_else(|_| {
        panic!("P2P_RDMA_DEVICE is not set. lab test: run it with soft-roce/lab")
    })
}

fn doctor(reg: &str) -> (Option<i32>, serde_json::Value, String) {
    doctor_region("host:1M", &["--reg", reg])
}

/// `doctor --region SPEC ARGS... --json` on the lab device: exit code, JSON, stderr.
fn doctor_region(spec: &str, args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["doctor", "--region", spec])
        .args(args)
        .args(["--json", "--device", &device()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"));
    (out.status.code(), v, err)
}

#[test]
#[ignore = "lab"]
fn lab_doctor_pinned_host_memory_passes_the_canary() {
    let (code, v, err) = doctor("pinned");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(v["chosen"], "pinned");
    let c = &v["attempts"][0]["canary"];
    assert_eq!(c["write_wrong"], 0);
    assert_eq!(c["read_wrong"], 0);
    assert!(
        c["len"].as_u64().unwrap() > c["path_mtu"].as_u64().unwrap(),
        "{c}"
    );
    assert_ne!(c["offset"].as_u64().unwrap() % 4096, 0, "{c}");
}

#[test]
#[ignore = "lab"]
fn lab_doctor_auto_explains_each_strategy() {
    let (code, v, err) = doctor("auto");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(v["attempts"][0]["mode"], "dma-buf");
    assert_eq!(v["attempts"][0]["outcome"], "not-applicable");
    assert!(v["attempts"][0]["message"]
        .as_str()
        .unwrap()
        .contains("not exported as a dma-buf"));
    assert_eq!(v["chosen"], "pinned");
    assert_eq!(v["path"], "direct");
}

#[test]
#[ignore = "lab"]
fn lab_doctor_odp_follows_the_kernel_and_the_canary_catches_the_rxe_odp_offset_bug() {
    let ctx = verbs::Context::open(Some(&device())).unwrap();
    let odp = ctx.info().caps.odp;
    let mtu = ctx.port(1).unwrap().active_mtu;
    let (code, v, err) = doctor("odp");
    let a = &v["attempts"][0];
    if !odp.supported {
        assert_eq!(code, Some(1), "{err}");
        assert_eq!(a["outcome"], "registration-failed");
        assert_eq!(a["errno"], 95);
        assert!(
            a["message"].as_str().unwrap().contains("no ODP support"),
            "{a}"
        );
        assert!(err.contains("no registration strategy passed"), "{err}");
    } else if std::env::var("P2P_LAB_KERNEL").as_deref() == Ok("7.3") {
        // rxe 7.3 ignores the in-page offset of ODP packets (LAB.md): a packet that starts
        // partway into a page lands at (or is read from) the page's start. The canary starts
        // partway into a page, so it must see wrong bytes at path MTU 1024 and at 4096 alike,
        // although every completion succeeded. (If a fixed kernel makes this pass, update LAB.md
        // and this expectation.)
        let _ = mtu;
        assert_eq!(code, Some(1), "{err}");
        assert_eq!(a["outcome"], "canary-failed", "{a}");
        let wrong = a["canary"]["write_wrong"].as_u64().unwrap()
            + a["canary"]["read_wrong"].as_u64().unwrap();
        assert!(wrong > 0, "{a}");
    } else {
        assert_eq!(code, Some(0), "{err}\n{v}");
        assert_eq!(a["outcome"], "works", "{a}");
    }
}

#[test]
#[ignore = "lab"]
fn lab_doctor_read_only_memory_proves_the_strategy_on_a_scratch_buffer_too() {
    // a read-only file of zeros: its own canary can only read, and zeros read the same from
    // any offset, so the rxe 7.3 ODP offset bug (LAB.md) cannot show in its bytes; the scratch
    // host buffer's pattern must catch it
    let path = std::env::temp_dir().join(format!("p2p-doctor-ro-{}.bin", std::process::id()));
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let spec = format!("file:{}:ro", path.display());
    let ctx = verbs::Context::open(Some(&device())).unwrap();
    let odp = ctx.info().caps.odp.supported;
    let (code, v, err) = doctor_region(&spec, &["--reg", "odp"]);
    let a = &v["attempts"][0];
    if !odp {
        assert_eq!(a["outcome"], "registration-failed", "{a}");
    } else if std::env::var("P2P_LAB_KERNEL").as_deref() == Ok("7.3") {
        assert_eq!(code, Some(1), "{err}\n{v}");
        assert_eq!(a["outcome"], "canary-error", "{a}");
        let m = a["message"].as_str().unwrap();
        assert!(m.contains("scratch host buffer"), "{m}");
    } else {
        assert_eq!(code, Some(0), "{err}\n{v}");
    }
    // pinned moves bytes right: the scratch canary passes and the file goes direct
    let (code, v, err) = doctor_region(&spec, &["--reg", "pinned"]);
    assert_eq!(code, Some(0), "{err}\n{v}");
    assert_eq!(v["attempts"][0]["outcome"], "works", "{v}");
    let _ = std::fs::remove_file(&path);
}

#[test]
#[ignore = "lab"]
fn lab_doctor_shows_hmm_page_residency_before_and_after_the_attempts() {
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_else(|_| {
        panic!("P2P_LAB_KERNEL is not set. lab test: run it with soft-roce/lab")
    });
    let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args([
            "doctor",
            "--region",
            "devpriv:hmm:512K",
            "--json",
            "--device",
            &device(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    if kernel != "7.3" {
        // the 6.12 lab kernel has no CONFIG_DEVICE_PRIVATE, so no test_hmm
        assert_ne!(out.status.code(), Some(0));
        assert!(
            err.contains("test_hmm") && err.contains("CONFIG_DEVICE_PRIVATE"),
            "{err}"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(0), "{err}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"));
    assert_eq!(v["memory"], "devpriv");
    assert_eq!(v["attempts"][0]["mode"], "odp", "{v}");
    let before = v["residency_before"].as_str().unwrap();
    let after = v["residency_after"].as_str().unwrap();
    assert!(
        before.starts_with("128 of 128 pages device-private"),
        "{before}"
    );
    // whichever strategy won, the pages it touched are back in host RAM
    assert!(!after.starts_with("128 of 128"), "{after}");
    assert_eq!(v["path"], "direct", "{v}");
}

#[test]
#[ignore = "lab"]
fn lab_doctor_proves_how_the_nic_reaches_a_device_private_window() {
    let (code, v, _) = doctor_region("devpriv:memfd:1M,window=256K", &[]);
    // the region as a whole has no CPU mapping or dma-buf: it is served through the bridge
    assert_ne!(code, Some(0), "{v}");
    assert_eq!(v["path"], "bounce", "{v}");
    // its window units are udmabuf dma-bufs: rxe refuses dma-buf MRs (EOPNOTSUPP), so the CPU
    // copies them, and the doctor says which attempt failed how
    let w = &v["window"];
    assert!(w["mode"].is_null(), "{w}");
    assert_eq!(w["attempts"][0]["mode"], "dma-buf", "{w}");
    assert_eq!(w["attempts"][0]["outcome"], "registration-failed", "{w}");
    assert_eq!(w["attempts"][0]["errno"], 95, "{w}");
    assert!(
        w["reason"].as_str().unwrap().contains("copied by the CPU"),
        "{w}"
    );
    // and no window on a region without one
    let (_, v, _) = doctor_region("devpriv:memfd:1M", &[]);
    assert!(v["window"].is_null(), "{v}");
}

#[test]
#[ignore = "lab"]
fn lab_doctor_applies_the_specs_own_options_as_serve_does() {
    // ,p2p=disabled: nothing is attempted, and the answer says why
    let (code, v, err) = doctor_region("host:1M,p2p=disabled", &[]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(v["path"], "bounce", "{v}");
    assert_eq!(v["attempts"].as_array().map(Vec::len), Some(0), "{v}");
    assert!(err.contains("disabled"), "{err}");
    // ,reg=pinned in the spec wins over --reg odp, as a region's option wins over serve's
    let (code, v, err) = doctor_region("host:1M,reg=pinned", &["--reg", "odp"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(v["chosen"], "pinned", "{v}");
}

#[test]
#[ignore = "lab"]
fn lab_doctor_registers_a_region_over_one_mrs_size_limit_as_several_mrs() {
    // 1.25 GiB of host memory in a 3 GiB guest: rxe on Linux 7.x refuses one MR over 1 GiB
    // (its page list is one kmalloc) with ENOMEM; the region goes direct as two MRs
    let (code, v, err) = doctor_region("host:1280M", &["--reg", "pinned"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(v["path"], "direct", "{v}");
    assert_eq!(v["direct_bytes"].as_u64(), Some(1280 << 20), "{v}");
    let mrs = v["direct_mrs"].as_u64().unwrap();
    if mrs > 1 {
        assert_eq!(mrs, 2, "{v}");
        let why = v["reason"].as_str().unwrap();
        assert!(
            why.contains("ENOMEM") && why.contains("registered as 2 "),
            "{why}"
        );
    }
}
