//! Lab tests of what a storage node embedding the server relies on: one registration per
//! region whatever the number of clients (each client reaching it through a memory window of
//! its own), regions added and removed while clients fetch, and put notices. The last test
//! runs `examples/storage_node.rs` as a real node following a directory.

mod common;

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use p2p_rdma::bridge::protocol::{DataPath, ErrorCode, RegionInfo};
use p2p_rdma::bridge::{Client, ClientConfig, RegionSpec};

fn small_client(addr: std::net::SocketAddr) -> ClientConfig {
    // 64 clients in one guest: small staging
    client_config(addr, 64 << 10, 2)
}

/// Pinned memory of this process (`VmPin` of /proc/self/status), in bytes.
fn pinned() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmPin in /proc/self/status")
        * 1024
}

/// Report a figure: printed, and appended to `$P2P_LAB_OUT/storage.txt` (the lab's output
/// directory), where a passing test's output is kept.
fn figure(line: String) {
    println!("{line}");
    if let Ok(dir) = std::env::var("P2P_LAB_OUT") {
        use std::io::Write as _;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(std::path::Path::new(&dir).join("storage.txt"))
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// What the server says of its region `name`.
fn served(s: &Running, name: &str) -> RegionInfo {
    s.handle
        .regions()
        .into_iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no region '{name}' is served"))
}

/// Write `bytes` to `<temp>/lab-storage-NAME.bin` and add it to the server as region `name`
/// (`:ro` when `read_only`).
async fn add_file(s: &Running, name: &str, bytes: &[u8], read_only: bool) -> RegionInfo {
    let file = std::env::temp_dir().join(format!("lab-storage-{name}.bin"));
    std::fs::write(&file, bytes).unwrap();
    let ro = if read_only { ":ro" } else { "" };
    s.handle
        .add_region(
            format!("{name}=file:{}{ro}", file.display())
                .parse()
                .unwrap(),
        )
        .await
        .unwrap()
}

/// MRs of exactly `len` bytes on the lab device.
fn mrs_of(len: u64) -> usize {
    rdma_resources("mr", &format!("mrlen {len} "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_one_registration_serves_every_client_through_its_own_window() {
    const BIG: u64 = 768 << 20;
    const SMALL: u64 = 16 << 20;
    let s = start(&["big=host:768M", "small=host:16M"], |_| {}).await;
    let big = served(&s, "big");
    assert_eq!(big.path, DataPath::Direct, "{big:?}");
    assert!(big.reason.contains("registered once"), "{}", big.reason);
    assert_eq!(mrs_of(BIG), 1, "the big region is registered once at start");
    let pinned_at_start = pinned();
    assert!(pinned_at_start >= BIG, "{pinned_at_start} bytes pinned");

    // open cost, a new client each time: open + first 4 KiB fetch, big vs small region
    let cost = |name: &'static str| {
        let addr = s.addr;
        async move {
            let mut c = Client::connect(small_client(addr)).await.unwrap();
            // the client's QP and staging are set up by its first open of another region
            let warm = c.open("small", false).await.unwrap();
            let t = Instant::now();
            let r = c.open(name, false).await.unwrap();
            let mut sink = Vec::new();
            c.fetch(&r, 0, 4096, &mut sink, false, &mut |_| {})
                .await
                .unwrap();
            let took = t.elapsed().as_secs_f64();
            c.close(&r).await.unwrap();
            c.close(&warm).await.unwrap();
            c.bye().await.unwrap();
            took
        }
    };
    let mut ratios = Vec::new();
    for _ in 0..5 {
        let b = cost("big").await;
        let sm = cost("small").await;
        ratios.push(b / sm);
    }
    ratios.sort_by(f64::total_cmp);
    figure(format!(
        "storage: open + first 4 KiB fetch, new client each time, 768 MiB vs 16 MiB region: median ratio {:.2} (min {:.2}, max {:.2}, 5 rounds)",
        ratios[2], ratios[0], ratios[4]
    ));

    for n in [4usize, 64] {
        let mut clients = Vec::new();
        for i in 0..n {
            let mut c = Client::connect(small_client(s.addr)).await.unwrap();
            let r = c.open("big", i % 2 == 0).await.unwrap();
            // each client reads its own 4 KiB, far apart
            let at = (i as u64 * (BIG / n as u64)) & !4095;
            let mut sink = Vec::new();
            let rep = c
                .fetch(&r, at, 4096, &mut sink, true, &mut |_| {})
                .await
                .unwrap();
            assert_eq!(rep.direct_bytes, 4096);
            clients.push((c, r));
        }
        // every client holds the region open: still one registration of it
        assert_eq!(mrs_of(BIG), 1, "{n} clients holding the region open");
        // and its pages were not pinned again (a registration per client would add 768 MiB
        // each: the guest could not even hold four)
        let grew = pinned().saturating_sub(pinned_at_start);
        figure(format!(
            "storage: {n} clients hold the 768 MiB region open: {} MR of it, pinned memory grew by {:.1} MiB (client staging)",
            mrs_of(BIG),
            grew as f64 / (1 << 20) as f64
        ));
        assert!(grew < BIG / 4, "pinned memory grew by {grew} bytes");
        // windows are per client: client 0's rkey is useless on client 1's QP (forged under
        // client 1's own handle: the client refuses a handle not open on it before any READ)
        let forged = p2p_rdma::bridge::OpenRegion {
            handle: clients[1].1.handle,
            connection: clients[1].1.connection,
            ..clients[0].1.clone()
        };
        let c1 = &mut clients[1].0;
        let mut sink = Vec::new();
        let e = c1
            .fetch(&forged, 0, 4096, &mut sink, false, &mut |_| {})
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("IBV_WC_REM_ACCESS_ERR"),
            "another client's window: {e}"
        );
        // that error took c1's QP down: its next transfer, of its own region, is refused
        // with the cause, not flushed
        let own = clients[1].1.clone();
        let e = clients[1]
            .0
            .fetch(&own, 0, 4096, &mut sink, false, &mut |_| {})
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, p2p_rdma::bridge::Error::QpDown { .. })
                && text.contains("IBV_WC_REM_ACCESS_ERR")
                && text.contains("Client::reconnect"),
            "a transfer after the QP went down: {text}"
        );
        // a handle closed (or another client's) is refused by the client itself, and its QP
        // stays up: the region opened again is fetched
        let others = clients[3].1.clone();
        let (c2, r2) = &mut clients[2];
        c2.close(r2).await.unwrap();
        let e = c2
            .fetch(r2, 0, 4096, &mut sink, false, &mut |_| {})
            .await
            .unwrap_err();
        assert!(e.to_string().contains("is not open on this client"), "{e}");
        let e = c2
            .fetch(&others, 0, 4096, &mut sink, false, &mut |_| {})
            .await
            .unwrap_err();
        assert!(e.to_string().contains("is not open on this client"), "{e}");
        let (c2, r2) = &mut clients[2];
        *r2 = c2.open("big", false).await.unwrap();
        c2.fetch(r2, 0, 4096, &mut sink, false, &mut |_| {})
            .await
            .unwrap();
        for (mut c, r) in clients.drain(2..) {
            c.close(&r).await.unwrap();
            c.bye().await.unwrap();
        }
    }
    assert_eq!(mrs_of(SMALL), 1);
    s.stop().await;
    assert_eq!(mrs_of(BIG), 0, "the registration goes with the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_regions_added_and_removed_while_clients_fetch_and_puts_are_noticed() {
    // a node may start empty
    let s = start(&[], |_| {}).await;
    let mut notices = s.handle.put_notices();
    let added = s
        .handle
        .add_region("a=host:4M".parse::<RegionSpec>().unwrap())
        .await
        .unwrap();
    assert_eq!(added.path, DataPath::Direct, "{added:?}");
    let e = s
        .handle
        .add_region("a=host:1M".parse::<RegionSpec>().unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already served"), "{e}");

    let mut c = Client::connect(small_client(s.addr)).await.unwrap();
    let a = c.open("a", true).await.unwrap();
    let bytes = data(1 << 20, 5);
    let put = c
        .put(&a, 4096, &mut bytes.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(put.direct_bytes, bytes.len() as u64);
    // the client reports its one-sided writes once they completed
    let n = tokio::time::timeout(Duration::from_secs(10), notices.recv())
        .await
        .expect("a put notice")
        .unwrap();
    assert_eq!(
        (n.region.as_str(), n.offset, n.path),
        ("a", 4096, DataPath::Direct)
    );
    assert!(n.client.contains('@'), "{n:?}");

    // add a region while the client keeps fetching the first
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let want = bytes.clone();
    let fetcher = tokio::spawn(async move {
        let mut rounds = 0;
        loop {
            let mut sink = Vec::new();
            c.fetch(&a, 4096, want.len() as u64, &mut sink, true, &mut |_| {})
                .await
                .unwrap();
            assert_eq!(sink, want);
            rounds += 1;
            if stop_rx.try_recv().is_ok() {
                return (c, a, rounds);
            }
        }
    });
    let b = add_file(&s, "b", &data(3 << 20, 9), false).await;
    assert!(b.server_puts, "{b:?}");
    let mut d = Client::connect(small_client(s.addr)).await.unwrap();
    assert!(d.list().await.unwrap().iter().any(|r| r.name == "b"));
    let rb = d.open("b", true).await.unwrap();
    let mut sink = Vec::new();
    d.fetch(&rb, 0, 3 << 20, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(sink, data(3 << 20, 9));
    // a put into data the server holds goes through it: the server saw the bytes arrive
    let patch = data(100_000, 1);
    d.put(&rb, 777, &mut patch.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    let mut seen = 0;
    while seen < patch.len() as u64 {
        let n = tokio::time::timeout(Duration::from_secs(10), notices.recv())
            .await
            .expect("put notices")
            .unwrap();
        assert_eq!(
            (n.region.as_str(), n.path),
            ("b", DataPath::Bounce),
            "{n:?}"
        );
        assert_eq!(n.offset, 777 + seen);
        seen += n.len;
    }
    assert_eq!(seen, patch.len() as u64);
    d.close(&rb).await.unwrap();
    // remove it: new opens are refused; the other client is undisturbed
    let gone = s
        .handle
        .remove_region("b", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(gone.released, "{gone:?}");
    let e = d.open("b", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownRegion), "{e}");
    // a region may come back under a removed one's name
    s.handle
        .add_region("b=host:1M".parse::<RegionSpec>().unwrap())
        .await
        .unwrap();
    let rb = d.open("b", false).await.unwrap();
    assert_eq!(rb.info.size, 1 << 20);
    // read-only memory added to a server that isolates clients with memory windows cannot
    // carry one: it is served through bounce buffers, and its reason says why
    let info = add_file(&s, "ro", &data(1 << 20, 3), true).await;
    assert_eq!(info.path, DataPath::Bounce, "{info:?}");
    assert!(
        info.reason.contains("region 'ro' is read-only memory")
            && info.reason.contains("memory window"),
        "{}",
        info.reason
    );
    let r = d.open("ro", false).await.unwrap();
    let mut sink = Vec::new();
    d.fetch(&r, 0, 1 << 20, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(sink, data(1 << 20, 3));
    d.bye().await.unwrap();
    stop_tx.send(()).unwrap();
    let (mut c, a, rounds) = fetcher.await.unwrap();
    assert!(rounds >= 1);
    c.close(&a).await.unwrap();
    c.bye().await.unwrap();
    s.stop().await;
}

/// `examples/storage_node` next to this test's binary (cargo builds examples with the tests).
fn storage_node_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("examples/storage_node"))
        .unwrap();
    assert!(
        p.exists(),
        "{} is missing: build the examples (cargo test --no-run builds them)",
        p.display()
    );
    p
}

struct Node {
    child: std::process::Child,
    events: std::sync::mpsc::Receiver<serde_json::Value>,
}

impl Node {
    fn next(&self, event: &str, region: Option<&str>) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .events
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no '{event}' event from the storage node"));
            if v["event"] == event && region.is_none_or(|r| v["region"] == r) {
                return v;
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Puts an object in the node's directory the way a writer must: under a hidden temporary name,
/// then renamed, so that the node never sees it half written.
fn publish(dir: &std::path::Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_storage_node_follows_its_directory_while_clients_fetch() {
    init_tracing();
    let dir = std::env::temp_dir().join("lab-storage-node");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("alpha"), data(200_000, 1)).unwrap();
    let token = dir.with_extension("token");
    std::fs::write(&token, TOKEN).unwrap();
    let mut child = std::process::Command::new(storage_node_bin())
        .arg(format!("{}:0", lab_ip()))
        .arg(&token)
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, events) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                let _ = tx.send(v);
            }
        }
    });
    let node = Node { child, events };
    let addr: std::net::SocketAddr = node.next("listening", None)["addr"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    node.next("added", Some("alpha"));
    let mut c = Client::connect(small_client(addr)).await.unwrap();
    let alpha = c.open("alpha", false).await.unwrap();
    let mut sink = Vec::new();
    c.fetch(&alpha, 0, 200_000, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(sink, data(200_000, 1));
    // a new object appears while the client holds the first
    publish(&dir, "beta", &data(1 << 20, 2));
    node.next("added", Some("beta"));
    let beta = c.open("beta", true).await.unwrap();
    let mut sink = Vec::new();
    c.fetch(&beta, 0, 1 << 20, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(sink, data(1 << 20, 2));
    // a put is noticed by the node
    let patch = data(5000, 3);
    c.put(&beta, 100, &mut patch.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    let put = node.next("put", Some("beta"));
    assert_eq!(put["offset"], 100, "{put}");
    assert_eq!(
        &std::fs::read(dir.join("beta")).unwrap()[100..5100],
        &patch[..],
        "the put reached the object's file"
    );
    c.close(&beta).await.unwrap();
    // the object is deleted: the node stops serving it; the other object is undisturbed
    std::fs::remove_file(dir.join("beta")).unwrap();
    let removed = node.next("removed", Some("beta"));
    assert_eq!(removed["released"], true, "{removed}");
    let e = c.open("beta", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownRegion), "{e}");
    let mut sink = Vec::new();
    c.fetch(&alpha, 0, 200_000, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(sink, data(200_000, 1));
    // an object that grows is served at its new size, its name never missing in between
    c.close(&alpha).await.unwrap();
    publish(&dir, "alpha", &data(300_000, 4));
    let again = node.next("resized", Some("alpha"));
    assert_eq!(
        (&again["size"], &again["was"], &again["released"]),
        (&300_000.into(), &200_000.into(), &true.into()),
        "{again}"
    );
    let alpha = c.open("alpha", false).await.unwrap();
    let mut sink = Vec::new();
    c.fetch(&alpha, 0, 300_000, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(sink, data(300_000, 4));
    c.bye().await.unwrap();
}

const GIB: u64 = 1 << 30;
const HUGE: u64 = 1280 << 20;

/// The direct extents of a region, checked to cover `[0, size)` in order with nothing bounced.
fn direct_extents(info: &RegionInfo) -> Vec<(u64, u64)> {
    let mut at = 0;
    let out: Vec<(u64, u64)> = info
        .extents()
        .iter()
        .map(|e| {
            assert_eq!(e.path, DataPath::Direct, "{info:?}");
            assert_eq!(e.offset, at, "{info:?}");
            at += e.len;
            (e.offset, e.len)
        })
        .collect();
    assert_eq!(at, info.size, "{info:?}");
    out
}

/// 8 MiB of a pattern, the same for a seed.
fn pattern(seed: u8) -> Vec<u8> {
    (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_a_region_over_one_mrs_size_limit_goes_direct_as_several_mrs() {
    // rxe on Linux 7.x refuses one MR over 1 GiB (its page list is one kmalloc of 16 bytes per
    // 4 KiB page) with ENOMEM: the server registers 1.25 GiB as two MRs, a window over each
    let s = start(&["huge=host:1280M"], |_| {}).await;
    let info = served(&s, "huge");
    let extents = direct_extents(&info);
    let split = extents.len() > 1;
    if split {
        assert_eq!(extents, vec![(0, GIB), (GIB, HUGE - GIB)], "{info:?}");
        assert!(
            info.reason.contains("ENOMEM") && info.reason.contains("2 MRs"),
            "{}",
            info.reason
        );
        assert_eq!(
            (mrs_of(GIB), mrs_of(HUGE - GIB)),
            (1, 1),
            "one MR per segment"
        );
    } else {
        assert_eq!(mrs_of(HUGE), 1, "the driver took the region in one MR");
    }
    figure(format!(
        "storage: 1.25 GiB host region: {} direct MR(s), reason: {}",
        extents.len(),
        info.reason
    ));
    // a put and a fetch across the boundary between the two MRs, verified end to end
    let at = GIB - (4 << 20);
    let data = pattern(0x5a);
    let mut writer = Client::connect(small_client(s.addr)).await.unwrap();
    let w = writer.open("huge", true).await.unwrap();
    assert_eq!(w.segments.len(), if split { 2 } else { 0 }, "{w:?}");
    let rep = writer
        .put(&w, at, &mut &data[..], None, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(rep.direct_bytes, data.len() as u64, "{rep:?}");
    let mut back = Vec::new();
    let rep = writer
        .fetch(&w, at, data.len() as u64, &mut back, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(rep.direct_bytes, data.len() as u64, "{rep:?}");
    assert!(
        back == data,
        "the bytes across the MR boundary came back changed"
    );
    // another client, zero-copy, straddling the boundary by 4 KiB each side
    let mut reader = Client::connect(small_client(s.addr)).await.unwrap();
    let r = reader.open("huge", false).await.unwrap();
    let got = reader.fetch_bytes(&r, GIB - 4096, 8192).await.unwrap();
    assert_eq!(&got[..], &data[(4 << 20) - 4096..(4 << 20) + 4096]);
    if split {
        // still one registration per segment with two clients, and the writer's window over
        // the second MR is useless on the reader's QP
        assert_eq!((mrs_of(GIB), mrs_of(HUGE - GIB)), (1, 1));
        let forged = p2p_rdma::bridge::OpenRegion {
            handle: r.handle,
            connection: r.connection,
            ..w.clone()
        };
        let e = reader
            .fetch(
                &forged,
                GIB + 4096,
                4096,
                &mut Vec::new(),
                false,
                &mut |_| {},
            )
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("IBV_WC_REM_ACCESS_ERR"),
            "another client's window over the second MR: {e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_a_read_only_file_at_start_goes_through_bounce_and_the_rest_keeps_its_windows() {
    // the default sharing: a read-only file cannot carry a window, so it alone goes through
    // bounce buffers (staged, read through a window over the staging slot), and a writable
    // region beside it is still registered once
    let path = std::env::temp_dir().join(format!("p2p-ro-{}.bin", std::process::id()));
    let bytes = data(3 << 20, 11);
    std::fs::write(&path, &bytes).unwrap();
    let ro = format!("ro=file:{}:ro", path.display());
    let server = bind(&["ram=host:4M", ro.as_str()], |_| {}).await.unwrap();
    assert!(server.memory_windows(), "{}", server.registration());
    let s = run(server);
    let info = served(&s, "ro");
    assert_eq!(info.path, DataPath::Bounce, "{info:?}");
    assert!(
        info.reason.contains("region 'ro' is read-only memory")
            && info.reason.contains("--sharing per-connection"),
        "{}",
        info.reason
    );
    let ram = served(&s, "ram");
    assert_eq!(ram.path, DataPath::Direct, "{ram:?}");
    assert!(ram.reason.contains("registered once"), "{}", ram.reason);
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let r = c.open("ro", false).await.unwrap();
    let mut back = Vec::new();
    let rep = c
        .fetch(&r, 0, bytes.len() as u64, &mut back, true, &mut |_| {})
        .await
        .unwrap();
    assert!(back == bytes, "the read-only file came back changed");
    assert_eq!(rep.direct_bytes, 0, "{rep:?}");
    // its bounce chunks are staged (copied, then read by the client), not written by the
    // server: the server timed copies and no RDMA of its own
    let m = s.handle.metrics().encode();
    let count = |stage: &str| {
        let key = format!(
            "p2p_rdma_bounce_stage_duration_seconds_count{{direction=\"fetch\",stage=\"{stage}\"}} "
        );
        m.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    assert!(count("copy") >= 3.0, "{m}");
    assert_eq!(count("rdma"), 0.0, "{m}");
    // a put into it is refused by the server, and the file is untouched
    let e = c.open("ro", true).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ReadOnly), "{e}");
    let mut src: &[u8] = &[1, 2, 3];
    let e = c
        .put(&r, 0, &mut src, Some(3), false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ReadOnly), "{e}");
    assert!(std::fs::read(&path).unwrap() == bytes, "the file changed");
    c.close(&r).await.unwrap();
    c.bye().await.unwrap();
    s.stop().await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_a_read_only_file_over_one_mrs_size_limit_is_registered_per_connection_in_segments() {
    // read-only memory cannot carry memory windows (an MW_BIND MR is pinned for writing):
    // served direct, each connection registers what it opens, one MR per segment as well
    use std::os::unix::fs::FileExt as _;
    let path = std::env::temp_dir().join(format!("p2p-huge-{}.bin", std::process::id()));
    let data = pattern(0xc3);
    {
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(HUGE).unwrap();
        f.write_all_at(&data, GIB - (4 << 20)).unwrap();
    }
    let spec = format!("huge=file:{}:ro", path.display());
    let server = bind(&[spec.as_str()], |c| {
        c.sharing = p2p_rdma::bridge::SharingPolicy::PerConnection
    })
    .await
    .unwrap();
    assert!(
        !server.memory_windows(),
        "--sharing per-connection binds no windows: {}",
        server.registration()
    );
    let s = run(server);
    let info = served(&s, "huge");
    let extents = direct_extents(&info);
    let mut c = Client::connect(small_client(s.addr)).await.unwrap();
    let r = c.open("huge", false).await.unwrap();
    if extents.len() > 1 {
        assert_eq!(r.segments.len(), extents.len(), "{r:?}");
        assert!(mrs_of(GIB) >= 1 && mrs_of(HUGE - GIB) >= 1);
    }
    let mut back = Vec::new();
    let rep = c
        .fetch(&r, GIB - (4 << 20), 8 << 20, &mut back, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(rep.direct_bytes, 8 << 20, "{rep:?}");
    assert!(
        back == data,
        "the file's bytes across the MR boundary came back changed"
    );
    c.close(&r).await.unwrap();
    c.bye().await.unwrap();
    drop(s);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_storage_node_region_replaced_at_a_new_size_is_never_missing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = start(&["a=host:1M", "k=host:1M,p2p=disabled"], |_| {}).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let k = c.open("k", false).await.unwrap();
    // another client opens and closes the region over and over while it is replaced
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (addr, halt) = (s.addr.to_string(), stop.clone());
    let opener = tokio::spawn(async move {
        let mut o = Client::connect(ClientConfig::new(addr, TOKEN)).await?;
        let mut sizes = Vec::new();
        while !halt.load(Ordering::SeqCst) {
            let r = o.open("a", false).await?;
            sizes.push(r.info.size);
            o.close(&r).await?;
        }
        o.bye().await?;
        Ok::<_, p2p_rdma::bridge::Error>(sizes)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (info, old) = s
        .handle
        .replace_region("a=host:4M".parse().unwrap(), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        (info.size, info.path),
        (4 << 20, DataPath::Direct),
        "{info:?}"
    );
    assert!(old.released, "{old:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let sizes = opener
        .await
        .unwrap()
        .expect("every open during the replacement");
    let first_new = sizes.iter().position(|&n| n == 4 << 20);
    assert!(
        first_new.is_some_and(|i| i > 0 && sizes[i..].iter().all(|&n| n == 4 << 20))
            && sizes.iter().all(|&n| n == 1 << 20 || n == 4 << 20),
        "the old size, then only the new one: {sizes:?}"
    );
    let mut listed: Vec<String> = s.handle.regions().into_iter().map(|r| r.name).collect();
    listed.sort();
    assert_eq!(listed, ["a", "k"], "each name once");
    // a handle of the old memory is told it is gone; a reopen sees the new size
    s.handle
        .replace_region(
            "k=host:2M,p2p=disabled".parse().unwrap(),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let mut sink = Vec::new();
    let e = c
        .fetch(&k, 0, 4096, &mut sink, false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Removed), "{e}");
    let _ = c.close(&k).await;
    let k = c.open("k", false).await.unwrap();
    assert_eq!(k.info.size, 2 << 20);
    let e = s
        .handle
        .replace_region("zz=host:1M".parse().unwrap(), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("add it instead"), "{e}");
    c.bye().await.unwrap();
    s.stop().await;
}
