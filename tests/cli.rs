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
fn bench_needs_the_token_on_both_sides() {
    for args in [
        vec!["bench", "write"],
        vec!["bench", "write", "127.0.0.1:9"],
    ] {
        let out = bin()
            .args(&args)
            .env_remove("P2P_RDMA_TOKEN")
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(e.contains("P2P_RDMA_TOKEN"), "{args:?}: {e}");
    }
}

#[test]
fn bench_says_when_no_server_listens() {
    // Port 9 (discard) is not served here: refused, retried a few seconds, then exit 5.
    let out = bin()
        .args(["bench", "write", "127.0.0.1:9", "--iters", "1"])
        .env("P2P_RDMA_TOKEN", "t")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{e}");
    assert!(
        e.contains("cannot reach the bench server at 127.0.0.1:9"),
        "{e}"
    );
}

/// A fresh temporary directory for one test.
fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("p2p-rdma-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn exit_0_check_config_accepts_a_valid_file() {
    let d = tmpdir("cfg-ok");
    let f = d.join("serve.toml");
    std::fs::write(
        &f,
        "listen = \"127.0.0.1:7471\"\nmetrics = \"127.0.0.1:9471\"\n[bounce]\nchunk = \"2M\"\n\n[[region]]\nname = \"ram\"\nmemory = \"host:16M\"\np2p = \"preferred\"\n",
    )
    .unwrap();
    let out = bin()
        .args(["serve", "--check-config"])
        .arg(&f)
        .output()
        .unwrap();
    let o = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{o}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(o.contains("valid (1 region)"), "{o}");
}

#[test]
fn exit_2_for_bad_input_names_what_is_wrong() {
    let d = tmpdir("usage");
    let bad_cfg = d.join("bad.toml");
    std::fs::write(
        &bad_cfg,
        "listen = \"0.0.0.0:7471\"\n\n[bounce]\nchunk = \"12Q\"\n",
    )
    .unwrap();
    let typo = d.join("typo.toml");
    std::fs::write(&typo, "[limits]\nmax_conections = 3\n").unwrap();
    let spec = d.join("spec.toml");
    std::fs::write(&spec, "[[region]]\nname = \"r\"\nmemory = \"disk:1M\"\n").unwrap();
    let input = d.join("in.bin");
    std::fs::write(&input, [0u8; 10]).unwrap();
    // a fetch to stdout with one more option
    let fetch_with = |flag: &str, value: &str| -> Vec<std::ffi::OsString> {
        ["fetch", "127.0.0.1:9", "r", "-o", "-", flag, value]
            .map(Into::into)
            .to_vec()
    };
    let cases: Vec<(Vec<std::ffi::OsString>, &str)> = vec![
        (
            vec![
                "serve".into(),
                "--check-config".into(),
                bad_cfg.clone().into(),
            ],
            "line 4: key 'bounce.chunk'",
        ),
        (
            vec!["serve".into(), "--check-config".into(), typo.into()],
            "max_conections",
        ),
        (
            vec!["serve".into(), "--check-config".into(), spec.into()],
            "line 3: key 'region.memory'",
        ),
        (
            vec![
                "serve".into(),
                "--check-config".into(),
                d.join("missing.toml").into(),
            ],
            "cannot read the config file",
        ),
        (
            vec!["serve".into(), "--region".into(), "r=disk:1M".into()],
            "unknown kind 'disk'",
        ),
        (vec!["serve".into()], "no region to serve"),
        (
            vec![
                "serve".into(),
                "--sharing".into(),
                "windows".into(),
                "--region".into(),
                "r=host:1M".into(),
            ],
            "want auto or per-connection",
        ),
        (
            vec![
                "serve".into(),
                "--config".into(),
                bad_cfg.into(),
                "--region".into(),
                "r=host:1M".into(),
            ],
            "bounce.chunk",
        ),
        (
            vec![
                "put".into(),
                "127.0.0.1:9".into(),
                "r".into(),
                "-i".into(),
                input.clone().into(),
                "--length".into(),
                "11".into(),
            ],
            "--length 11 is more than the 10 bytes",
        ),
        (fetch_with("--offset", "1Q"), "unknown unit"),
        (fetch_with("--ack-timeout", "32"), "0..=31"),
        (fetch_with("--mtu", "1500"), "an Ethernet MTU such as 1500"),
        (
            fetch_with("--retries", "2"),
            "with -o - goes on after the bytes",
        ),
        (fetch_with("--retry-wait", "4000"), "from 0 to 3600"),
        (fetch_with("--continue", "--verify"), "give -o FILE, not -"),
        (
            vec![
                "fetch".into(),
                "127.0.0.1:9".into(),
                "r".into(),
                "-o".into(),
                input.clone().into(),
                "--continue".into(),
            ],
            "add --verify",
        ),
        (
            ["put", "127.0.0.1:9", "r", "-i", "-", "--retries", "1"]
                .map(Into::into)
                .to_vec(),
            "with -i - goes on after the bytes",
        ),
        (
            [
                "put",
                "127.0.0.1:9",
                "r",
                "-i",
                "-",
                "--continue",
                "--verify",
            ]
            .map(Into::into)
            .to_vec(),
            "give -i FILE, not -",
        ),
        (
            vec![
                "put".into(),
                "127.0.0.1:9".into(),
                "r".into(),
                "-i".into(),
                input.into(),
                "-c".into(),
            ],
            "add --verify",
        ),
    ];
    for (args, want) in cases {
        let out = bin()
            .args(&args)
            .env("P2P_RDMA_TOKEN", "t")
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {e}");
        assert!(e.contains(want), "{args:?}: {e}");
    }
}

#[test]
fn exit_4_without_a_token_and_5_when_unreachable() {
    let out = bin()
        .args(["ls", "127.0.0.1:9"])
        .env_remove("P2P_RDMA_TOKEN")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{e}");
    assert!(e.contains("no token"), "{e}");
    // port 9 (discard) is not served here: refused
    let out = bin()
        .args(["ls", "127.0.0.1:9", "--timeout", "2"])
        .env("P2P_RDMA_TOKEN", "t")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{e}");
}

#[test]
fn help_documents_every_exit_code_and_the_spec_grammar() {
    let out = bin().arg("--help").output().unwrap();
    let h = String::from_utf8_lossy(&out.stdout);
    for code in [
        "0  ok",
        "1  failed",
        "2  usage",
        "3  refused",
        "4  auth",
        "5  unreachable",
        "6  mismatch",
        "7  not-found",
        "69  unavailable",
    ] {
        assert!(h.contains(code), "{code} missing: {h}");
    }
    let out = bin().args(["serve", "--help"]).output().unwrap();
    let h = String::from_utf8_lossy(&out.stdout);
    for s in [
        "NAME=host:SIZE",
        "NAME=devpriv:hmm:SIZE",
        ",window=SIZE",
        "--metrics",
        "[[region]]",
        "SIGHUP",
    ] {
        assert!(h.contains(s), "{s} missing: {h}");
    }
}

#[test]
fn completions_and_man_pages_come_from_the_clap_definitions() {
    for shell in ["bash", "zsh", "fish"] {
        let out = bin().args(["completions", shell]).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{shell}");
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(
            s.contains("p2p-rdma") && s.contains("check-config"),
            "{shell}: {s}"
        );
    }
    let out = bin().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let d = tmpdir("man");
    let out = bin().args(["man", "--dir"]).arg(&d).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for page in [
        "p2p-rdma.1",
        "p2p-rdma-serve.1",
        "p2p-rdma-fetch.1",
        "p2p-rdma-topo.1",
    ] {
        let t = std::fs::read_to_string(d.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(
            t.starts_with(".ie") || t.contains(".TH"),
            "{page} is not roff: {t}"
        );
    }
    let serve = std::fs::read_to_string(d.join("p2p-rdma-serve.1")).unwrap();
    assert!(serve.contains("check\\-config"), "{serve}");
}

#[test]
fn the_shipped_example_config_and_unit_agree_with_the_binary() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = bin()
        .args(["serve", "--check-config"])
        .arg(root.join("contrib/serve.toml"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let unit = std::fs::read_to_string(root.join("contrib/p2p-rdma.service")).unwrap();
    for s in [
        "Type=notify",
        "LimitMEMLOCK=infinity",
        "CAP_IPC_LOCK",
        "Restart=on-failure",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "serve --config",
    ] {
        assert!(unit.contains(s), "the unit lacks {s}");
    }
}

#[test]
fn serve_explains_a_bad_token_file_before_opening_anything() {
    let dir = std::env::temp_dir().join(format!("p2p-rdma-tokens-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("tokens");
    std::fs::write(&f, "# admin\nadmin-secret\nreader img:rx\n").unwrap();
    let out = bin()
        .args(["serve", "--region", "img=host:1M", "--token-file"])
        .arg(&f)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("line 3") && e.contains("ro or rw") && !e.contains("admin-secret"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
