//! Lab tests of `p2p-rdma bench`: a server and a client in the guest, every operation with
//! --validate, latency mode, and the bounce path (an NVMe CMB that rxe cannot reach directly).
use std::process::{Child, Command, Stdio};

use serde_json::Value;

mod common;
use common::{lab_ip, LAB, TOKEN};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"));
    c.env("P2P_RDMA_TOKEN", TOKEN);
    c
}

fn server(op: &str, port: u16, extra: &[&str]) -> Child {
    bin()
        .args(["bench", op, "--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Run a client against a fresh server; the JSON rows and the server's exit.
fn run(op: &str, port: u16, server_extra: &[&str], client: &[&str]) -> Vec<Value> {
    let mut s = server(op, port, server_extra);
    let out = bin()
        .args(["bench", op, &format!("{}:{port}", lab_ip()), "--json"])
        .args(client)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let sv = s.wait_with_output_stderr();
    assert!(
        out.status.success(),
        "client {op} {client:?}: {err}\nserver: {sv}"
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

trait ServerExit {
    fn wait_with_output_stderr(&mut self) -> String;
}

impl ServerExit for Child {
    fn wait_with_output_stderr(&mut self) -> String {
        use std::io::Read;
        let st = self.wait().unwrap();
        let mut e = String::new();
        if let Some(mut s) = self.stderr.take() {
            let _ = s.read_to_string(&mut e);
        }
        assert!(st.success(), "bench server failed: {e}");
        e
    }
}

#[test]
#[ignore = "lab"]
fn lab_bench_bandwidth_of_every_operation_is_validated() {
    let _ = std::env::var("P2P_RDMA_DEVICE")
        .unwrap_or_else(|_| panic!("P2P_RDMA_DEVICE is not set. {LAB}"));
    for (i, op) in ["write", "read", "send"].into_iter().enumerate() {
        let rows = run(
            op,
            19100 + i as u16,
            &[],
            &[
                "--size",
                "64K",
                "--iters",
                "300",
                "--tx-depth",
                "16",
                "--validate",
            ],
        );
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(r["op"], op);
        assert_eq!(r["bytes"], 65536);
        assert_eq!(r["iterations"], 300, "{r}");
        assert_eq!(r["validated"], true, "{r}");
        assert_eq!(r["path"], "direct");
        assert_eq!(r["cq"], "events", "{r}");
        assert!(r["bw_avg_mib_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(
            r["bw_peak_mib_s"].as_f64().unwrap() >= r["bw_avg_mib_s"].as_f64().unwrap(),
            "{r}"
        );
    }
}

#[test]
#[ignore = "lab"]
fn lab_bench_sweeps_sizes_qps_and_both_directions() {
    let rows = run(
        "write",
        19110,
        &[],
        &[
            "--all",
            "--iters",
            "20",
            "--tx-depth",
            "8",
            "--qps",
            "2",
            "--validate",
        ],
    );
    assert_eq!(rows.len(), 23);
    assert_eq!(rows[0]["bytes"], 2);
    assert_eq!(rows[22]["bytes"], 8 << 20);
    assert!(
        rows.iter()
            .all(|r| r["iterations"] == 40 && r["validated"] == true),
        "{rows:?}"
    );
    let rows = run(
        "read",
        19111,
        &[],
        &["--size", "256K", "--iters", "50", "--bidir", "--validate"],
    );
    assert_eq!(
        rows[0]["iterations"], 100,
        "both directions count: {}",
        rows[0]
    );
    assert_eq!(rows[0]["validated"], true);
    let rows = run(
        "write",
        19112,
        &[],
        &["--size", "256K", "--iters", "50", "--bidir", "--validate"],
    );
    assert_eq!(rows[0]["iterations"], 100, "{}", rows[0]);
    assert_eq!(rows[0]["validated"], true, "{}", rows[0]);
}

#[test]
#[ignore = "lab"]
fn lab_bench_polling_completion_queues_move_validated_data() {
    for (i, op) in ["write", "read", "send"].into_iter().enumerate() {
        let rows = run(
            op,
            19130 + i as u16,
            &[],
            &[
                "--size",
                "64K",
                "--iters",
                "200",
                "--tx-depth",
                "16",
                "--poll",
                "--validate",
                // two lanes (and, for send, two receivers) spin together on one thread
                "--qps",
                "2",
            ],
        );
        let r = &rows[0];
        assert_eq!(r["cq"], "polling", "{r}");
        assert_eq!(r["iterations"], 400, "200 per QP: {r}");
        assert_eq!(r["validated"], true, "{r}");
        // READs in flight: the device's limit when not given (rxe allows 128)
        let outs = r["outs"].as_u64();
        assert_eq!(outs.is_some(), op == "read", "{r}");
        assert!(outs.is_none_or(|n| n >= 16), "{r}");
    }
    let rows = run(
        "write",
        19133,
        &[],
        &["--lat", "--size", "8", "--iters", "100", "--poll"],
    );
    let r = &rows[0];
    // a polled WRITE ping-pong polls memory, as ib_write_lat
    assert_eq!(
        (r["cq"].as_str(), r["iterations"].as_u64()),
        (Some("memory"), Some(100)),
        "{r}"
    );
    assert!(r["t_min_us"].as_f64().unwrap() > 0.0, "{r}");
}

#[test]
#[ignore = "lab"]
fn lab_bench_latency_reports_percentiles() {
    for (i, op) in ["write", "read", "send"].into_iter().enumerate() {
        let rows = run(
            op,
            19120 + i as u16,
            &[],
            &["--lat", "--size", "8", "--iters", "100"],
        );
        let r = &rows[0];
        assert_eq!(r["iterations"], 100, "{r}");
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
        assert!(f("t_min_us") > 0.0);
        assert!(f("t_min_us") <= f("t_median_us") && f("t_median_us") <= f("t_p99_us"));
        assert!(f("t_p99_us") <= f("t_p999_us") && f("t_p999_us") <= f("t_max_us"));
    }
    // polled: both sides spin on threads of their own and prepare each next message while
    // the last is in flight; a sweep changes the size under a prepared pong and crosses the
    // inline limit (220 and 236 bytes). A pong of the wrong size fails the client's run, and
    // a WRITE ping-pong polling memory would hang on one (no pong byte where it looks)
    for (i, op) in ["write", "read", "send"].into_iter().enumerate() {
        let rows = run(
            op,
            19125 + i as u16,
            &[],
            &["--lat", "--poll", "--all", "--iters", "5"],
        );
        assert_eq!(rows.len(), 23, "2 B to 8 MiB: {rows:?}");
        for (k, r) in rows.iter().enumerate() {
            assert_eq!(r["bytes"], 2u64 << k, "{r}");
            assert_eq!(r["iterations"], 5, "{r}");
            let cq = if op == "write" { "memory" } else { "polling" };
            assert_eq!(r["cq"], cq, "{r}");
            assert!(r["t_median_us"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}

#[test]
#[ignore = "lab"]
fn lab_nvme_bench_measures_the_bounce_path_of_a_cmb() {
    // rxe cannot reach a p2pmem mapping (pinned: EFAULT; ODP: the canary fails), so the CMB
    // is served through bounce buffers and the rows say so, and how much of it the server lent
    // from page starts. 6.12 has no P2PDMA: refused.
    // the controllers with a CMB (the lab's SSD has none)
    let nvme = std::fs::read_dir("/sys/class/nvme")
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| {
            std::fs::read_to_string(format!("/sys/class/nvme/{n}/serial"))
                .is_ok_and(|s| s.trim() != "p2plabssd")
        })
        .min()
        .expect("an NVMe controller with a CMB");
    let spec = format!("cmb:{nvme}:4M");
    if std::env::var("P2P_LAB_KERNEL").as_deref() == Ok("6.12") {
        let mut s = server("read", 19130, &["--mem", &spec]);
        let out = bin()
            .args([
                "bench",
                "read",
                &format!("{}:19130", lab_ip()),
                "--iters",
                "5",
            ])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(e.contains("CONFIG_PCI_P2PDMA"), "{e}");
        let _ = s.wait();
        return;
    }
    for (i, op) in ["write", "read"].into_iter().enumerate() {
        let rows = run(
            op,
            19131 + i as u16,
            &["--mem", &spec],
            &["--size", "1M", "--iters", "8", "--validate"],
        );
        let r = &rows[0];
        assert_eq!(r["validated"], true, "{r}");
        assert_eq!(r["iterations"], 8, "{r}");
        // the rxe of `soft-roce/lab --rxe odp-fix` reads and writes the CMB at any offset: the
        // region canary passes, and the CMB is served directly
        if common::lab_rxe_any_offset() {
            assert_eq!(r["path"], "direct", "{r}");
            continue;
        }
        assert_eq!(r["path"], "bounce", "{r}");
        // as `serve` would: at path MTU 4096 rxe reads the CMB from page starts and lands
        // READs there, and every 1 MiB message starts on one, so reads are lent and writes
        // land in the CMB, not copied
        let lent = if common::lab_port_mtu() == 4096 {
            1.0
        } else {
            0.0
        };
        assert_eq!(r["lent_fraction"].as_f64(), Some(lent), "{r}");
    }
}

#[test]
#[ignore = "lab"]
fn lab_bench_server_refuses_strangers_long_lines_and_writes_into_files() {
    let addr = |port: u16| format!("{}:{port}", lab_ip());
    // a client without the token: refused, and the server says why
    let mut s = server("write", 19140, &[]);
    let out = bin()
        .env("P2P_RDMA_TOKEN", "not-the-token")
        .args(["bench", "write", &addr(19140), "--iters", "5"])
        .output()
        .unwrap();
    let sv = failed(&mut s);
    assert!(!out.status.success());
    assert!(sv.contains("wrong token"), "{sv}");
    // a peer that sends an endless line: refused after 64 KiB, not buffered
    let mut s = server("write", 19141, &[]);
    let mut t = loop {
        match std::net::TcpStream::connect(addr(19141)) {
            Ok(t) => break t,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    };
    use std::io::Write as _;
    let _ = t.write_all(&vec![b'x'; 1 << 20]);
    let sv = failed(&mut s);
    assert!(sv.contains("longer than 65536 bytes"), "{sv}");
    // a write benchmark of a file would overwrite it: refused; a read benchmark is allowed
    let f = std::env::temp_dir().join(format!("bench-file-{}", std::process::id()));
    std::fs::write(&f, common::data(1 << 20, 5)).unwrap();
    let spec = format!("file:{}", f.display());
    let mut s = server("write", 19142, &["--mem", &spec]);
    let out = bin()
        .args(["bench", "write", &addr(19142), "--iters", "5"])
        .output()
        .unwrap();
    let sv = failed(&mut s);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        sv.contains("holds data") && err.contains("holds data"),
        "server: {sv}\nclient: {err}"
    );
    // so would a bidirectional read (the server writes too), and the refusal says which
    let mut s = server("read", 19144, &["--mem", &spec]);
    let out = bin()
        .args(["bench", "read", &addr(19144), "--bidir", "--iters", "5"])
        .output()
        .unwrap();
    let sv = failed(&mut s);
    assert!(!out.status.success());
    assert!(
        sv.contains("a bidirectional benchmark would overwrite it"),
        "{sv}"
    );
    let rows = run(
        "read",
        19143,
        &["--mem", &spec],
        &["--size", "64K", "--iters", "8"],
    );
    assert_eq!(rows[0]["path"], "direct", "{}", rows[0]);
    assert_eq!(std::fs::read(&f).unwrap(), common::data(1 << 20, 5));
    std::fs::remove_file(f).unwrap();
}

/// The stderr of a bench server that must have failed.
fn failed(s: &mut Child) -> String {
    use std::io::Read;
    let st = s.wait().unwrap();
    let mut e = String::new();
    if let Some(mut x) = s.stderr.take() {
        let _ = x.read_to_string(&mut e);
    }
    assert!(!st.success(), "the bench server should have refused: {e}");
    e
}
