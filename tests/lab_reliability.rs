//! Reliability under load, with figures (`scripts/reliability` runs these and collects the
//! `reliability:` lines into its table): a flood of silent and dribbling sockets beside real
//! clients, a soak of many clients against a model of the expected contents, a client killed
//! in the middle of a transfer, a server killed in the middle of a put, and the isolation of
//! rkeys. `P2P_RELIABILITY_LONG=1` runs the long sizes (640 sockets for 2 minutes, 64 clients
//! for 10 minutes); so does the marker file `target/reliability/long` that
//! `scripts/reliability --long` leaves for the lab guest.

mod common;
#[path = "lab_reliability/resuming.rs"]
mod resuming;
#[path = "lab_reliability/retries.rs"]
mod retries;
use common::{data, rdma_resources, start, TOKEN};

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use p2p_rdma::bridge::protocol::{encode, Msg, VERSION};
use p2p_rdma::bridge::{Client, ClientConfig, Error};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

fn long() -> bool {
    // the lab guest sees the host's tree: scripts/reliability --long leaves this marker
    std::env::var("P2P_RELIABILITY_LONG").is_ok_and(|v| v == "1")
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target/reliability/long")
            .exists()
}

/// Report a figure: printed, and appended to `$P2P_LAB_OUT/reliability.txt` (the lab's output
/// folder) where `scripts/reliability` collects it for its table.
fn figure(line: String) {
    println!("{line}");
    if let Ok(dir) = std::env::var("P2P_LAB_OUT") {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(std::path::Path::new(&dir).join("reliability.txt"))
            .expect("the lab's output folder is writable");
        writeln!(f, "{line}").unwrap();
    }
}

/// This process's resident memory, KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS in /proc/self/status")
}

fn resources() -> [usize; 4] {
    // every line of `rdma resource show KIND` names the device
    let dev = std::env::var("P2P_RDMA_DEVICE").unwrap_or_else(|_| "rxe".into());
    ["qp", "mr", "pd", "cq"].map(|k| rdma_resources(k, &dev))
}

/// Enough file descriptors for a flood (the lab's default soft limit is 1024).
fn raise_nofile() {
    let st = Command::new("prlimit")
        .args([
            "--pid",
            &std::process::id().to_string(),
            "--nofile=65536:65536",
        ])
        .status()
        .expect("prlimit (util-linux)");
    assert!(st.success(), "prlimit --nofile failed");
}

fn small_client(addr: std::net::SocketAddr) -> ClientConfig {
    let mut c = ClientConfig::new(addr.to_string(), TOKEN);
    c.chunk = 256 << 10;
    c.depth = 2;
    c.timeout = Duration::from_secs(60);
    c
}

/// An attacker: connects, then stays silent or dribbles half a hello a byte at a time, and
/// connects again whenever the server closes it, until `stop`.
async fn attacker(
    addr: std::net::SocketAddr,
    dribble: bool,
    stop: Arc<AtomicBool>,
    conns: Arc<AtomicU64>,
) {
    let hello = encode(&Msg::Hello {
        version: VERSION,
        token: TOKEN.into(),
        client: "attacker".into(),
    });
    while !stop.load(Ordering::Relaxed) {
        let Ok(t) = tokio::net::TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        conns.fetch_add(1, Ordering::Relaxed);
        let (mut rd, mut wr) = t.into_split();
        let mut sent = 0;
        let mut buf = [0u8; 64];
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let step = async {
                if dribble && sent < hello.len() / 2 {
                    wr.write_all(&hello[sent..sent + 1]).await.map(|_| 1usize)
                } else {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    Ok(0)
                }
            };
            let closed = tokio::select! {
                r = rd.read(&mut buf) => !matches!(r, Ok(n) if n > 0),
                r = step => match r { Ok(n) => { sent += n; false } Err(_) => true },
            };
            if closed {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_flood_of_silent_sockets_beside_real_clients() {
    raise_nofile();
    let secs = if long() { 120 } else { 20 };
    let sockets = 640;
    let s = start(&["r=host:4M", "b=host:4M,p2p=disabled"], |c| {
        c.bounce_chunk = 256 << 10;
        c.bounce_depth = 4;
    })
    .await;
    let content = data(4 << 20, 21);
    {
        let mut c = Client::connect(small_client(s.addr)).await.unwrap();
        for name in ["r", "b"] {
            let h = c.open(name, true).await.unwrap();
            let mut src: &[u8] = &content;
            c.put(&h, 0, &mut src, None, true, &mut |_| {})
                .await
                .unwrap();
        }
        c.bye().await.unwrap();
    }
    let rss_before = rss_kib();
    let stop = Arc::new(AtomicBool::new(false));
    let conns = Arc::new(AtomicU64::new(0));
    let mut attackers = tokio::task::JoinSet::new();
    for i in 0..sockets {
        attackers.spawn(attacker(
            s.addr,
            i % 2 == 1,
            Arc::clone(&stop),
            Arc::clone(&conns),
        ));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..8u64 {
        let addr = s.addr;
        let content = content.clone();
        clients.spawn(async move {
            let (mut ok, mut failed) = (0u64, 0u64);
            let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ i;
            let mut c: Option<(Client, HashMap<&str, p2p_rdma::bridge::OpenRegion>)> = None;
            while Instant::now() < deadline {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let name = if x & 1 == 0 { "r" } else { "b" };
                let len = 4096 + (x >> 8) % (512 << 10);
                let off = (x >> 32) % ((4 << 20) - len);
                let res: Result<(), Error> = async {
                    if c.is_none() {
                        let mut cl = Client::connect(small_client(addr)).await?;
                        let mut hs = HashMap::new();
                        for n in ["r", "b"] {
                            hs.insert(n, cl.open(n, false).await?);
                        }
                        c = Some((cl, hs));
                    }
                    let (cl, hs) = c.as_mut().expect("connected");
                    let mut out = Vec::new();
                    cl.fetch(&hs[name], off, len, &mut out, false, &mut |_| {})
                        .await?;
                    assert_eq!(
                        out,
                        content[off as usize..(off + len) as usize],
                        "wrong bytes from '{name}' at {off}+{len}"
                    );
                    Ok(())
                }
                .await;
                match res {
                    Ok(()) => ok += 1,
                    Err(e) => {
                        eprintln!("client {i}: fetch failed: {e}");
                        failed += 1;
                        c = None;
                    }
                }
            }
            (ok, failed)
        });
    }
    let (mut ok, mut failed) = (0, 0);
    while let Some(r) = clients.join_next().await {
        let (o, f) = r.unwrap();
        ok += o;
        failed += f;
    }
    let rss_during = rss_kib();
    stop.store(true, Ordering::Relaxed);
    attackers.shutdown().await;
    let rate = ok as f64 / (ok + failed).max(1) as f64;
    let metrics = s.handle.metrics().encode();
    let evictions = metrics
        .lines()
        .find_map(|l| l.strip_prefix("p2p_rdma_preauth_evictions_total "))
        .unwrap_or("?")
        .to_string();
    figure(format!(
        "reliability: flood: {ok}/{} real fetches ok ({:.2}%) in {secs} s beside {sockets} silent/dribbling sockets ({} attacker connections, {evictions} closed before their hello); test process RSS {} -> {} MiB",
        ok + failed,
        rate * 100.0,
        conns.load(Ordering::Relaxed),
        rss_before / 1024,
        rss_during / 1024
    ));
    assert!(ok > 0 && rate >= 0.99, "{ok} ok, {failed} failed");
    assert!(
        rss_during < rss_before + (256 << 10),
        "memory grew from {rss_before} to {rss_during} KiB"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_soak_many_clients_against_a_model() {
    let (clients, secs) = if long() { (64, 600) } else { (64, 30) };
    let slice: u64 = 1 << 20;
    let bslice: u64 = 256 << 10;
    let before = resources();
    let s = start(
        &[
            &format!("s=host:{}M", clients),
            &format!("sb=host:{}K,p2p=disabled", clients * 256),
        ],
        |c| {
            c.bounce_chunk = 128 << 10;
            c.bounce_depth = 2;
            c.max_connections = clients as usize + 4;
        },
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(secs);
    let verified = Arc::new(AtomicU64::new(0));
    let wrong = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..clients as u64 {
        let addr = s.addr;
        let verified = Arc::clone(&verified);
        let wrong = Arc::clone(&wrong);
        tasks.spawn(async move {
            let mut cfg = small_client(addr);
            cfg.chunk = 64 << 10;
            let mut c = Client::connect(cfg).await.unwrap();
            let regions = [
                (c.open("s", true).await.unwrap(), i * slice, slice),
                (c.open("sb", true).await.unwrap(), i * bslice, bslice),
            ];
            // the model: what this client last wrote to its own slices (zeros at first)
            let mut model = [vec![0u8; slice as usize], vec![0u8; bslice as usize]];
            let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ (i << 20);
            let mut ops = 0u64;
            while Instant::now() < deadline {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let k = (x & 1) as usize;
                let (h, base, size) = &regions[k];
                let len = 1 + (x >> 8) % (size / 2);
                let off = (x >> 32) % (size - len);
                if (x >> 2) & 1 == 0 {
                    let bytes = data(len as usize, x as u32);
                    let mut src: &[u8] = &bytes;
                    c.put(h, base + off, &mut src, Some(len), false, &mut |_| {})
                        .await
                        .unwrap_or_else(|e| panic!("client {i}: put: {e}"));
                    model[k][off as usize..(off + len) as usize].copy_from_slice(&bytes);
                } else {
                    let mut out = Vec::new();
                    c.fetch(h, base + off, len, &mut out, false, &mut |_| {})
                        .await
                        .unwrap_or_else(|e| panic!("client {i}: fetch: {e}"));
                    let want = &model[k][off as usize..(off + len) as usize];
                    let bad = out.iter().zip(want).filter(|(a, b)| a != b).count()
                        + out.len().abs_diff(want.len());
                    wrong.fetch_add(bad as u64, Ordering::Relaxed);
                    verified.fetch_add(len, Ordering::Relaxed);
                }
                ops += 1;
            }
            c.bye().await.unwrap();
            ops
        });
    }
    let mut ops = 0;
    while let Some(r) = tasks.join_next().await {
        ops += r.unwrap();
    }
    s.stop().await;
    // everything the server and the clients created is gone
    let after = resources();
    let verified = verified.load(Ordering::Relaxed);
    let wrong = wrong.load(Ordering::Relaxed);
    figure(format!(
        "reliability: soak: {clients} clients, {secs} s, {ops} put/fetch operations, {:.1} MiB verified against the model, {wrong} wrong bytes; rdma resources (qp, mr, pd, cq) before {before:?} after {after:?}",
        verified as f64 / (1 << 20) as f64
    ));
    assert_eq!(wrong, 0);
    assert!(verified > 0);
    assert_eq!(before, after, "QPs, MRs, PDs or CQs leaked");
}

/// Fetch one byte at `off` through `r` (possibly forged); refused or not, never hung.
async fn fetch(c: &mut Client, r: p2p_rdma::bridge::OpenRegion, off: u64) -> Result<(), Error> {
    let mut out = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(60),
        c.fetch(&r, off, 1, &mut out, false, &mut |_| {}),
    )
    .await
    .expect("refused, not hung")
    .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_rkeys_are_isolated() {
    let s = start(&["r=host:1M"], |_| {}).await;
    let mut a = Client::connect(small_client(s.addr)).await.unwrap();
    let mut b = Client::connect(small_client(s.addr)).await.unwrap();
    let ra = a.open("r", false).await.unwrap();
    let rb = b.open("r", false).await.unwrap();
    let mut refused = Vec::new();
    let mut check = |what: &str, res: Result<(), Error>| {
        assert!(res.is_err(), "{what}: the NIC or the server let it through");
        refused.push(what.to_string());
    };
    // A's rkey on B's QP (another PD)
    check("A's rkey on B's QP", fetch(&mut b, ra.clone(), 0).await);
    let mut b = Client::connect(small_client(s.addr)).await.unwrap();
    let rb2 = b.open("r", false).await.unwrap();
    // one byte before the start and one past the end of the region's MR
    let mut before = rb2.clone();
    before.remote.addr -= 1;
    check("one byte before the region", fetch(&mut b, before, 0).await);
    let mut b = Client::connect(small_client(s.addr)).await.unwrap();
    let rb3 = b.open("r", false).await.unwrap();
    let mut past = rb3.clone();
    past.remote.len += 1;
    past.info.size += 1;
    for e in &mut past.info.extents {
        e.len += 1;
    }
    check(
        "one byte past the region",
        fetch(&mut b, past, 1 << 20).await,
    );
    // an rkey after Close
    let mut c = Client::connect(small_client(s.addr)).await.unwrap();
    let rc = c.open("r", false).await.unwrap();
    let keep = c.open("r", false).await.unwrap();
    c.close(&rc).await.unwrap();
    c.close(&keep).await.unwrap();
    check("an rkey after Close", fetch(&mut c, rc, 0).await);
    // an rkey after the region was removed
    let mut d = Client::connect(small_client(s.addr)).await.unwrap();
    let rd = d.open("r", false).await.unwrap();
    s.handle
        .remove_region("r", Duration::from_secs(5))
        .await
        .unwrap();
    check("an rkey after removal", fetch(&mut d, rd, 0).await);
    figure(format!(
        "reliability: isolation: {} of {} cases refused ({})",
        refused.len(),
        5,
        refused.join("; ")
    ));
    drop((a, rb));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_client_killed_mid_transfer_disturbs_nothing() {
    let before = resources();
    let s = start(&["big=host:64M", "b=host:8M,p2p=disabled"], |c| {
        c.bounce_chunk = 256 << 10;
    })
    .await;
    let content = data(8 << 20, 31);
    let mut c = Client::connect(small_client(s.addr)).await.unwrap();
    let h = c.open("b", true).await.unwrap();
    let mut src: &[u8] = &content;
    c.put(&h, 0, &mut src, None, true, &mut |_| {})
        .await
        .unwrap();
    let mut killed = Vec::new();
    for (region, len) in [("big", 64 << 20), ("b", 8 << 20)] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
            .args([
                "fetch",
                &s.addr.to_string(),
                region,
                "-o",
                "/dev/null",
                "--length",
                &len.to_string(),
            ])
            .env("P2P_RDMA_TOKEN", TOKEN)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let _ = Command::new("kill")
            .args(["-KILL", &child.id().to_string()])
            .status();
        let st = child.wait().unwrap();
        killed.push(format!("{region}: {st}"));
    }
    // the other client is not disturbed, and its bytes are intact
    let mut out = Vec::new();
    c.fetch(&h, 0, 8 << 20, &mut out, true, &mut |_| {})
        .await
        .unwrap();
    assert!(out == content, "the bounce region changed");
    c.bye().await.unwrap();
    // the killed clients' connections are gone: their QPs, MRs, PDs are released
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let m = s.handle.metrics().encode();
        if m.contains("p2p_rdma_connections 0") || Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(metrics.contains("p2p_rdma_connections 0"), "{metrics}");
    s.stop().await;
    let after = resources();
    figure(format!(
        "reliability: faults: client killed (SIGKILL) mid-fetch on the direct and the bounce path ({}): the other client's fetch verified, every connection released, rdma resources before {before:?} after {after:?}",
        killed.join(", ")
    ));
    assert_eq!(before, after, "QPs, MRs, PDs or CQs leaked");
}

/// A file region `f` in a directory of its own beside a token file, served by a
/// [`ServeProcess`].
#[derive(Clone)]
struct ServedFile {
    /// The directory (removed by the test at its end).
    dir: std::path::PathBuf,
    token_file: std::path::PathBuf,
    /// The region's file.
    file: std::path::PathBuf,
    /// Its spec, to serve it again.
    spec: String,
}

impl ServedFile {
    /// A new directory `name` under the temp dir holding a token file and a file of `bytes`,
    /// served as `f`: the files, the server and its address.
    async fn start(name: &str, bytes: &[u8]) -> (ServedFile, ServeProcess, std::net::SocketAddr) {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token_file = dir.join("token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
        let file = dir.join("region.bin");
        std::fs::write(&file, bytes).unwrap();
        let spec = format!("f=file:{}", file.display());
        let (server, addr) = ServeProcess::start(&spec, &token_file).await;
        let f = ServedFile {
            dir,
            token_file,
            file,
            spec,
        };
        (f, server, addr)
    }

    /// [`ServedFile::start`] for a transfer of `content`: the region holds it for a fetch
    /// (`fetching`), zeros of its length for a put.
    async fn start_for(
        name: &str,
        content: &[u8],
        fetching: bool,
    ) -> (ServedFile, ServeProcess, std::net::SocketAddr) {
        if fetching {
            ServedFile::start(name, content).await
        } else {
            ServedFile::start(name, &vec![0; content.len()]).await
        }
    }

    /// Serve it again on `addr` (after the server there was killed).
    async fn again(&self, addr: std::net::SocketAddr) -> ServeProcess {
        ServeProcess::start_at(addr, &self.spec, &self.token_file)
            .await
            .0
    }
}

/// A `p2p-rdma serve` process; killed (SIGKILL) and reaped when dropped, also when a test fails.
struct ServeProcess(std::process::Child);

impl ServeProcess {
    /// Start one serving `region` (a spec) on a free port; returns once it answers.
    async fn start(
        region: &str,
        token_file: &std::path::Path,
    ) -> (ServeProcess, std::net::SocketAddr) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        ServeProcess::start_at(addr, region, token_file).await
    }

    /// [`ServeProcess::start`] on `addr`.
    async fn start_at(
        addr: std::net::SocketAddr,
        region: &str,
        token_file: &std::path::Path,
    ) -> (ServeProcess, std::net::SocketAddr) {
        let child = ServeProcess(
            Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
                .args(["serve", "--listen", &addr.to_string(), "--token-file"])
                .arg(token_file)
                .args(["--region", region])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("p2p-rdma serve"),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(c) = Client::connect(small_client(addr)).await {
                let _ = c.bye().await;
                return (child, addr);
            }
            assert!(
                Instant::now() < deadline,
                "p2p-rdma serve did not answer within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_server_killed_mid_put_loses_no_acknowledged_byte() {
    let dir = std::env::temp_dir().join(format!("p2p-killput-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let file = dir.join("region.bin");
    std::fs::write(&file, vec![0u8; 40 << 20]).unwrap();
    let spec = format!("f=file:{}", file.display());
    let (mut server, addr) = ServeProcess::start(&spec, &token_file).await;

    // an acknowledged put of the first 8 MiB
    let acked = data(8 << 20, 41);
    let mut c = Client::connect(small_client(addr)).await.unwrap();
    let h = c.open("f", true).await.unwrap();
    let mut src: &[u8] = &acked;
    c.put(&h, 0, &mut src, None, true, &mut |_| {})
        .await
        .unwrap();
    // a 32 MiB put after it, cut by SIGKILL of the server
    let second = data(32 << 20, 42);
    let mut c2 = Client::connect(small_client(addr)).await.unwrap();
    let h2 = c2.open("f", true).await.unwrap();
    let started = Instant::now();
    let moved = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = std::sync::Arc::clone(&moved);
    let put = tokio::spawn(async move {
        let mut src: &[u8] = &second;
        let r = c2
            .put(&h2, 8 << 20, &mut src, None, true, &mut |d| {
                seen.store(d, std::sync::atomic::Ordering::SeqCst)
            })
            .await;
        (r, started.elapsed())
    });
    // cut it once its first 2 MiB are in: mid-put whatever the lab's speed
    let deadline = Instant::now() + Duration::from_secs(60);
    while moved.load(std::sync::atomic::Ordering::SeqCst) < 2 << 20 {
        assert!(Instant::now() < deadline, "the second put did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    let killed_at = started.elapsed();
    let (res, ended) = tokio::time::timeout(Duration::from_secs(120), put)
        .await
        .expect("the cut put ends (with an error), it does not hang")
        .unwrap();
    let err = res.expect_err("a put whose server died is not reported as done");
    // the first client's connection is gone too: its next request fails, it does not hang
    let mut probe = Vec::new();
    let asked = Instant::now();
    let other = tokio::time::timeout(
        Duration::from_secs(120),
        c.fetch(&h, 0, 4096, &mut probe, false, &mut |_| {}),
    )
    .await
    .expect("the idle client learns the server is gone");
    let other = other.expect_err("a fetch from a dead server cannot succeed");
    let idle_failed = asked.elapsed();
    // it learns from the control connection's end, not by waiting out its 60 s stall limit
    // (its RDMA READ goes to a QP that no longer exists, and nothing answers it)
    assert!(
        !matches!(other, Error::Stalled { .. }),
        "the idle client waited for its stall limit instead of seeing the connection end: {other}"
    );
    assert!(
        other.to_string().contains(&addr.to_string()),
        "the error does not name the server that went away: {other}"
    );

    // a new server on the same file: every acknowledged byte is there
    let (server, addr) = ServeProcess::start(&spec, &token_file).await;
    let mut c = Client::connect(small_client(addr)).await.unwrap();
    let h = c.open("f", false).await.unwrap();
    let mut got = Vec::new();
    c.fetch(&h, 0, 8 << 20, &mut got, true, &mut |_| {})
        .await
        .unwrap();
    assert!(got == acked, "an acknowledged put was lost");
    c.bye().await.unwrap();
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
    figure(format!(
        "reliability: faults: server killed (SIGKILL) {:.1} s into a 32 MiB put to a file region: the put failed after {:.1} s ({err}); an idle client's next request failed after {:.1} s ({other}); after a restart the acknowledged 8 MiB were intact",
        killed_at.as_secs_f64(),
        ended.as_secs_f64(),
        idle_failed.as_secs_f64()
    ));
}
