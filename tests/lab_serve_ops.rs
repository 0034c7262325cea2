//! Lab tests of `serve` as an operator runs it: metrics scraped and parsed by the Prometheus
//! project's own OpenMetrics parser, readiness, SIGTERM drain, SIGHUP token reload, the start-up
//! report, and the exit codes that need a live server (3 refused, 6 mismatch, 7 not found,
//! 2 out of range). Each test runs the real binary in the soft-RoCE guest.
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::lab_ip;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("p2p-ops-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `serve` process, killed when dropped.
struct Serve {
    child: Child,
    addr: String,
    metrics: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    fn start(dir: &Path, port: u16, regions: &[&str], extra: &[&str]) -> Serve {
        let ip = lab_ip();
        let tok = dir.join("token");
        if !tok.exists() {
            std::fs::write(&tok, "ops-token-1\n").unwrap();
        }
        let addr = format!("{ip}:{port}");
        let metrics = format!("127.0.0.1:{}", port + 1);
        let mut c = bin();
        c.args([
            "serve",
            "--listen",
            &addr,
            "--metrics",
            &metrics,
            "--token-file",
        ])
        .arg(&tok)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for r in regions {
            c.args(["--region", r]);
        }
        Serve {
            child: c.spawn().expect("spawn serve"),
            addr,
            metrics,
        }
    }

    /// Wait until /readyz answers 200; returns every status seen on the way.
    fn wait_ready(&self, limit: Duration) -> Vec<u16> {
        let start = Instant::now();
        let mut seen = Vec::new();
        while start.elapsed() < limit {
            if let Some((status, _)) = http_get(&self.metrics, "/readyz") {
                if seen.last() != Some(&status) {
                    seen.push(status);
                }
                if status == 200 {
                    return seen;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("serve was not ready within {limit:?}; statuses seen: {seen:?}");
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }
}

/// GET a path; None while nothing listens.
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|x| x.1.to_string())?;
    Some((status, body))
}

/// Parse an OpenMetrics exposition with the Prometheus project's own parser
/// (python3-prometheus-client) into (name, labels, value) samples.
fn parse_metrics(text: &str) -> Vec<(String, serde_json::Map<String, serde_json::Value>, f64)> {
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;
    let mut p = Command::new("/usr/bin/python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/install-deps installs python3-prometheus-client)");
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Vec<(String, serde_json::Map<String, serde_json::Value>, f64)> =
        serde_json::from_slice(&out.stdout).unwrap();
    v
}

fn sample(
    samples: &[(String, serde_json::Map<String, serde_json::Value>, f64)],
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).and_then(|x| x.as_str()) == Some(*v))
        })
        .map(|s| s.2)
}

/// How many bounce fetch requests went through `stage` (copy, bind, open, ...) on the server.
fn fetch_stage(
    samples: &[(String, serde_json::Map<String, serde_json::Value>, f64)],
    stage: &str,
) -> Option<f64> {
    sample(
        samples,
        "p2p_rdma_bounce_stage_duration_seconds_count",
        &[("direction", "fetch"), ("stage", stage)],
    )
}

fn client(args: &[&str], dir: &Path) -> std::process::Output {
    bin()
        .args(args)
        .arg("--token-file")
        .arg(dir.join("token"))
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
#[ignore = "lab"]
fn lab_ops_metrics_show_a_fetch_under_its_region_and_path() {
    let d = tmpdir("metrics");
    let s = Serve::start(
        &d,
        17471,
        &["ram=host:8M", "bnc=host:4M,p2p=disabled"],
        // two staging slots per connection: a fetch of four chunks reuses each slot
        &["--json", "--bounce-depth", "2"],
    );
    s.wait_ready(Duration::from_secs(120));
    let before = parse_metrics(&http_get(&s.metrics, "/metrics").unwrap().1);
    assert_eq!(sample(&before, "p2p_rdma_ready", &[]), Some(1.0));
    assert_eq!(sample(&before, "p2p_rdma_regions", &[]), Some(2.0));
    assert!(
        sample(
            &before,
            "p2p_rdma_canary_results_total",
            &[
                ("region", "ram"),
                ("strategy", "pinned"),
                ("result", "works")
            ]
        ) == Some(1.0),
        "{before:?}"
    );
    // the last one striped over two connections (into a file: stripes write at their offsets)
    for (region, len, qps, output) in [
        ("ram", "1M", "1", "/dev/null"),
        ("bnc", "512K", "1", "/dev/null"),
        ("bnc", "2M", "1", "/dev/null"),
        ("bnc", "4M", "1", "/dev/null"),
        ("bnc", "2M", "2", "striped.bin"),
    ] {
        let out = client(
            &[
                "fetch", &s.addr, region, "--length", len, "-o", output, "--verify", "--qps", qps,
            ],
            &d,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = client(&["fetch", &s.addr, "nope", "-o", "/dev/null"], &d);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = parse_metrics(&http_get(&s.metrics, "/metrics").unwrap().1);
    let bytes = |region, path| {
        sample(
            &after,
            "p2p_rdma_transferred_bytes_total",
            &[("region", region), ("direction", "fetch"), ("path", path)],
        )
    };
    assert_eq!(bytes("ram", "direct"), Some(1048576.0), "{after:?}");
    assert_eq!(
        bytes("bnc", "bounce"),
        Some(524288.0 + 2097152.0 + 4194304.0 + 2097152.0),
        "{after:?}"
    );
    assert_eq!(
        bytes("ram", "bounce"),
        None,
        "no bounce bytes on a direct region"
    );
    // the bounce fetches (one chunk, then two, then four, then two stripes of one) were staged
    // for the client to READ: the server copied each chunk, and bound a window once per slot a
    // connection used (1 + 2 + 2 + 1 + 1: the four chunks took turns in two slots, their
    // windows kept bound), but posted no RDMA of its own. `fetch` opens naming its range (each
    // stripe's connection its stripe), so each connection's first chunk was staged with its
    // open (its slot's window bound there), and none was left to bind ahead
    let stage = |stage| fetch_stage(&after, stage);
    assert_eq!(stage("copy"), Some(9.0), "{after:?}");
    assert_eq!(
        stage("open"),
        Some(5.0),
        "each bounce fetch's first chunk staged with its open: {after:?}"
    );
    assert_eq!(
        stage("bind"),
        Some(7.0),
        "a window per slot, not per chunk: {after:?}"
    );
    assert_eq!(
        stage("prebind").unwrap_or(0.0),
        0.0,
        "a slot bound ahead beside one staged with the open: {after:?}"
    );
    assert_eq!(stage("rdma").unwrap_or(0.0), 0.0, "{after:?}");
    assert_eq!(
        sample(
            &after,
            "p2p_rdma_errors_total",
            &[("code", "unknown-region")]
        ),
        Some(1.0)
    );
    assert!(
        sample(
            &after,
            "p2p_rdma_transfer_duration_seconds_count",
            &[("direction", "fetch"), ("path", "direct")]
        ) >= Some(1.0)
    );
    // the open registered the region (per connection) or bound a window over its one
    // registration
    let registered = sample(&after, "p2p_rdma_regcache_misses_total", &[]).unwrap_or(0.0)
        + sample(&after, "p2p_rdma_windows_bound_total", &[]).unwrap_or(0.0);
    assert!(registered >= 1.0, "{after:?}");
    assert!(sample(&after, "p2p_rdma_connections_accepted_total", &[]) >= Some(3.0));
    // clients are gone: nothing open, staging released
    assert_eq!(sample(&after, "p2p_rdma_open_handles", &[]), Some(0.0));
    assert_eq!(
        sample(&after, "p2p_rdma_bounce_staging_bytes", &[]),
        Some(0.0)
    );
    // the staged fetches' slot buffers went back to the device's pool (filled at start: a slot
    // per --bounce-depth), their windows revoked
    assert_eq!(
        sample(&after, "p2p_rdma_bounce_staging_pool_bytes", &[]),
        Some(2.0 * 1048576.0),
        "{after:?}"
    );
    assert_eq!(http_get(&s.metrics, "/healthz").unwrap().0, 200);
    // the start-up report on stdout is one JSON document
    let mut s = s;
    s.signal("TERM");
    let mut stdout = String::new();
    s.child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let regions = v["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 2);
    assert_eq!(regions[0]["info"]["path"], "direct");
    assert_eq!(regions[1]["info"]["path"], "bounce");
    assert!(!regions[0]["attempts"].as_array().unwrap().is_empty());
    // how clients reach the direct parts, and why
    let windows = v["memory_windows"]
        .as_bool()
        .expect("memory_windows in the report");
    let how = v["registration"]
        .as_str()
        .expect("registration in the report");
    assert_eq!(
        how.contains("each open binds a memory window on the client's QP"),
        windows,
        "{how}"
    );
    assert_eq!(s.child.wait().unwrap().code(), Some(0));
}

#[test]
#[ignore = "lab"]
fn lab_ops_readyz_is_not_ready_before_the_canaries_finish() {
    let d = tmpdir("ready");
    // a large region makes pinning (and so the canaries) take a while under emulation
    let s = Serve::start(&d, 17481, &["big=host:512M", "small=host:1M"], &[]);
    let start = Instant::now();
    let seen = loop {
        if let Some((status, _)) = http_get(&s.metrics, "/healthz") {
            assert_eq!(status, 200);
            break s.wait_ready(Duration::from_secs(300));
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the metrics endpoint never came up"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        seen.first(),
        Some(&503),
        "/readyz must say 503 while the canaries run: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&200), "{seen:?}");
}

#[test]
#[ignore = "lab"]
fn lab_ops_sigterm_during_a_64mib_fetch_lets_it_finish_and_exits_0() {
    let d = tmpdir("drain");
    let mut s = Serve::start(&d, 17491, &["ram=host:64M"], &["--drain-timeout", "120"]);
    s.wait_ready(Duration::from_secs(120));
    // one 64 KiB work request at a time: the transfer lasts long enough to be interrupted
    let mut fetch = bin()
        .args([
            "fetch",
            &s.addr,
            "ram",
            "-o",
            "out.bin",
            "--verify",
            "--json",
            "--chunk",
            "64K",
            "--depth",
            "1",
            "--token-file",
        ])
        .arg(d.join("token"))
        .current_dir(&d)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // wait until the fetch holds the region open, then stop the server
    let start = Instant::now();
    loop {
        let m = http_get(&s.metrics, "/metrics").unwrap().1;
        if m.lines().any(|l| l == "p2p_rdma_open_handles 1") {
            break;
        }
        if let Some(st) = fetch.try_wait().unwrap() {
            let mut e = String::new();
            fetch.stderr.take().unwrap().read_to_string(&mut e).unwrap();
            panic!("the fetch ended ({st}) before SIGTERM could be sent: {e}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the fetch never opened the region:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.signal("TERM");
    // draining: not ready any more (the metrics endpoint stays up until the exit)
    let t = Instant::now();
    while http_get(&s.metrics, "/readyz").is_some_and(|(st, _)| st == 200) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "still ready after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // new clients are turned away while the fetch finishes
    let late = client(
        &[
            "fetch",
            &s.addr,
            "ram",
            "--length",
            "4K",
            "-o",
            "/dev/null",
            "--timeout",
            "5",
        ],
        &d,
    );
    assert_ne!(
        late.status.code(),
        Some(0),
        "a new fetch during the drain must not be served"
    );
    let out = fetch.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the fetch in flight at SIGTERM must finish: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["bytes"], 64u64 << 20);
    assert_eq!(rep["verified"], true);
    let t = Instant::now();
    let code = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "serve did not exit after the drain"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(0));
}

#[test]
#[ignore = "lab"]
fn lab_ops_sighup_reloads_the_token_file() {
    let d = tmpdir("hup");
    let s = Serve::start(&d, 17501, &["ram=host:1M"], &[]);
    s.wait_ready(Duration::from_secs(120));
    assert!(client(&["ls", &s.addr], &d).status.success());
    let old = d.join("old-token");
    std::fs::copy(d.join("token"), &old).unwrap();
    std::fs::write(d.join("token"), "ops-token-2\n").unwrap();
    s.signal("HUP");
    let start = Instant::now();
    loop {
        let out = bin()
            .args(["ls", &s.addr, "--token-file"])
            .arg(&old)
            .output()
            .unwrap();
        if out.status.code() == Some(4) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the old token still works after SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        client(&["ls", &s.addr], &d).status.success(),
        "the new token must work"
    );
    let m = parse_metrics(&http_get(&s.metrics, "/metrics").unwrap().1);
    assert!(sample(&m, "p2p_rdma_auth_failures_total", &[]) >= Some(1.0));
}

#[test]
#[ignore = "lab"]
fn lab_ops_exit_codes_of_a_live_server() {
    let d = tmpdir("codes");
    let file = d.join("data.bin");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    let ro = format!("ro=file:{}:ro", file.display());
    let rw = format!("rw=file:{}", file.display());
    let s = Serve::start(&d, 17511, &["ram=host:1M", &ro, &rw], &[]);
    s.wait_ready(Duration::from_secs(120));
    let input = d.join("in.bin");
    std::fs::write(&input, [1u8; 4096]).unwrap();
    let code = |args: &[&str]| {
        let out = client(args, &d);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (c, e) = code(&["fetch", &s.addr, "missing", "-o", "/dev/null"]);
    assert_eq!(c, Some(7), "not found: {e}");
    let (c, e) = code(&["put", &s.addr, "ro", "-i", input.to_str().unwrap()]);
    assert_eq!(c, Some(3), "refused (read-only): {e}");
    let (c, e) = code(&[
        "fetch",
        &s.addr,
        "ram",
        "--offset",
        "1M",
        "--length",
        "1",
        "-o",
        "/dev/null",
    ]);
    assert_eq!(c, Some(2), "out of range: {e}");
    let bad = d.join("bad-token");
    std::fs::write(&bad, "wrong").unwrap();
    let out = bin()
        .args(["ls", &s.addr, "--token-file"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "wrong token");
    // a mismatch: another process keeps changing the served file while a fetch verifies it
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = std::sync::Arc::clone(&stop);
        let file = file.clone();
        std::thread::spawn(move || {
            use std::os::unix::fs::FileExt as _;
            let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = f.write_at(&i.to_le_bytes(), (i * 8) % (1 << 20));
                i += 1;
            }
        })
    };
    let (c, e) = code(&["fetch", &s.addr, "rw", "-o", "/dev/null", "--verify"]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert_eq!(c, Some(6), "a verify mismatch: {e}");
    assert!(
        e.contains("verification failed") && e.contains("CRC-32C"),
        "{e}"
    );
}

#[test]
#[ignore = "lab"]
fn lab_ops_fetch_and_put_striped_over_several_qps() {
    let d = tmpdir("qps");
    let data: Vec<u8> = (0..(8u32 << 20) + 777)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let file = d.join("data.bin");
    std::fs::write(&file, &data).unwrap();
    let f = format!("f=file:{}", file.display());
    let s = Serve::start(&d, 17521, &["ram=host:8M", &f], &[]);
    s.wait_ready(Duration::from_secs(120));
    let json = |out: &std::process::Output| -> serde_json::Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };

    // a fetch in 4 stripes of whole chunks (the last one short), verified, equals the file
    let one = json(&client(
        &["fetch", &s.addr, "f", "-o", "one.bin", "--json", "--verify"],
        &d,
    ));
    let out = client(
        &[
            "fetch", &s.addr, "f", "-o", "four.bin", "--json", "--verify", "--qps", "4", "--chunk",
            "256K",
        ],
        &d,
    );
    let four = json(&out);
    assert!(std::fs::read(d.join("four.bin")).unwrap() == data);
    assert_eq!(four["bytes"], data.len() as u64);
    assert_eq!(four["verified"], true);
    assert_eq!(
        four["crc32c"], one["crc32c"],
        "the stripes' CRC is the range's"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("4 connections"), "{err}");

    // a put in 3 stripes at an offset, then read back in one stream
    let input = d.join("in.bin");
    std::fs::write(&input, &data[..(5 << 20) + 123]).unwrap();
    let put = json(&client(
        &[
            "put", &s.addr, "ram", "-i", "in.bin", "--offset", "4096", "--json", "--verify",
            "--qps", "3",
        ],
        &d,
    ));
    assert_eq!(put["bytes"], (5u64 << 20) + 123);
    assert_eq!(put["verified"], true);
    json(&client(
        &[
            "fetch", &s.addr, "ram", "--offset", "4096", "--length", "5M", "-o", "back.bin",
            "--json",
        ],
        &d,
    ));
    let back = std::fs::read(d.join("back.bin")).unwrap();
    assert!(back == data[..5 << 20], "the striped put's bytes read back");

    // a pipe cannot be striped: a usage error before connecting
    let out = client(&["fetch", &s.addr, "f", "-o", "-", "--qps", "2"], &d);
    assert_eq!(out.status.code(), Some(2));
    let out = client(&["put", &s.addr, "ram", "-i", "-", "--qps", "2"], &d);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
#[ignore = "lab"]
fn lab_ops_a_striped_fetch_past_the_connection_limit_stripes_over_fewer() {
    // a server that takes two connections: a fetch asked to stripe over four gets two, says
    // so, and cuts its stripes again. Each lane's open named its stripe of the first cut
    // (four stripes of one chunk), so the chunk staged for a lane whose stripe moved goes back
    // unread, and the fetch is whole
    let d = tmpdir("qps-limit");
    let data: Vec<u8> = (0..4u32 << 20)
        .map(|i| (i.wrapping_mul(2_246_822_519) >> 11) as u8)
        .collect();
    let file = d.join("data.bin");
    std::fs::write(&file, &data).unwrap();
    let spec = format!("bnc=file:{},p2p=disabled", file.display());
    let s = Serve::start(&d, 17541, &[&spec], &["--max-connections", "2"]);
    s.wait_ready(Duration::from_secs(120));
    let out = client(
        &[
            "fetch",
            &s.addr,
            "bnc",
            "-o",
            "striped.bin",
            "--json",
            "--verify",
            "--qps",
            "4",
        ],
        &d,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(std::fs::read(d.join("striped.bin")).unwrap() == data);
    assert!(err.contains("striping over 2"), "{err}");
    assert_eq!(err.matches("limit of 2 connections").count(), 2, "{err}");
    assert!(err.contains("2 connections"), "{err}");

    let m = parse_metrics(&http_get(&s.metrics, "/metrics").unwrap().1);
    let stage = |stage| fetch_stage(&m, stage).unwrap_or(0.0);
    assert_eq!(stage("open"), 2.0, "both lanes' first chunks: {m:?}");
    // four chunks fetched; one more copied where the lane that got in was not the one whose
    // stripe still starts where its open named (the third)
    let copies = stage("copy");
    assert!(copies == 4.0 || copies == 5.0, "{m:?}");
    // counted as staged for the client: a chunk given back unread too
    assert_eq!(
        sample(
            &m,
            "p2p_rdma_transferred_bytes_total",
            &[
                ("region", "bnc"),
                ("direction", "fetch"),
                ("path", "bounce")
            ]
        ),
        Some(copies * 1048576.0),
        "{m:?}"
    );
    assert_eq!(
        sample(&m, "p2p_rdma_errors_total", &[("code", "busy")]),
        Some(2.0),
        "{m:?}"
    );
    // every slot back, the unread chunk's included
    assert_eq!(
        sample(&m, "p2p_rdma_bounce_staging_bytes", &[]),
        Some(0.0),
        "{m:?}"
    );
}

#[test]
#[ignore = "lab"]
fn lab_ops_a_put_is_flushed_only_into_memory_that_persists() {
    // host memory the server allocated: a put is complete when its WRITEs are, no Flush round
    // trip; a file holds data: its put is made durable by a Flush before it is acknowledged
    let d = tmpdir("flush");
    let file = d.join("data.bin");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    let f = format!("f=file:{}", file.display());
    let s = Serve::start(&d, 17531, &["ram=host:1M", &f], &[]);
    s.wait_ready(Duration::from_secs(120));
    let small: Vec<u8> = (0..200u8).collect();
    std::fs::write(d.join("small.bin"), &small).unwrap();
    for region in ["ram", "f"] {
        let out = client(
            &[
                "put",
                &s.addr,
                region,
                "-i",
                "small.bin",
                "--offset",
                "4100",
                "--verify",
            ],
            &d,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = client(
            &[
                "fetch", &s.addr, region, "--offset", "4100", "--length", "200", "-o", "back.bin",
            ],
            &d,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read(d.join("back.bin")).unwrap(),
            small,
            "{region}"
        );
    }
    let m = parse_metrics(&http_get(&s.metrics, "/metrics").unwrap().1);
    let flushes = |r: &str| sample(&m, "p2p_rdma_flushes_total", &[("region", r)]);
    assert_eq!(flushes("f"), Some(1.0), "the file's put was flushed once");
    assert_eq!(
        flushes("ram").unwrap_or(0.0),
        0.0,
        "no flush of host memory"
    );
    assert_eq!(
        std::fs::read(&file).unwrap()[4100..4300],
        small[..],
        "the file holds the put"
    );
}
