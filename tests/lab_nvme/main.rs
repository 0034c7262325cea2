//! Lab tests of block-storage regions (`nvme:`): the lab's switch and iommu topologies put an
//! SSD (an NVMe without a CMB, serial `p2plabssd`, a fresh image per run) on the PCIe switch
//! beside the NVMe with a CMB and the NIC. The CMB ring's tests are in [`ring`].

mod any_offset;
#[path = "../common/mod.rs"]
mod common;
mod ring;
mod ring_hold;

use std::os::unix::fs::FileExt;

use common::*;
use p2p_rdma::bridge::protocol::{DataPath, ErrorCode};
use p2p_rdma::bridge::{Client, ClientConfig};

/// The namespace of the controller whose serial is `serial` (`/dev/nvme2n1`).
fn namespace_of(serial: &str) -> String {
    let topo = std::env::var("P2P_LAB_TOPOLOGY").unwrap_or_default();
    let blocks = std::fs::read_dir("/sys/block").expect("/sys/block");
    let mut names: Vec<String> = blocks
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nvme"))
        .collect();
    names.sort();
    for n in &names {
        // the namespace's device is its controller, or with multipath its subsystem: both
        // have the serial. With multipath (QEMU 10's NVMe controllers are in a subsystem)
        // /sys/block also lists each path to the namespace (e.g. nvme1c1n1), a hidden disk
        // that has no device node: the namespace is its head (nvme1n1)
        let s =
            std::fs::read_to_string(format!("/sys/block/{n}/device/serial")).unwrap_or_default();
        let dev = format!("/dev/{n}");
        if s.trim() == serial && std::path::Path::new(&dev).exists() {
            return dev;
        }
    }
    panic!(
        "no NVMe namespace with serial {serial} among {names:?}: this test needs the lab's switch \
         or iommu topology (now: '{topo}')"
    )
}

/// The controller (`nvme0`) whose serial is `serial`.
fn controller_of(serial: &str) -> String {
    for e in std::fs::read_dir("/sys/class/nvme")
        .expect("/sys/class/nvme")
        .flatten()
    {
        let s = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
        if s.trim() == serial {
            return e.file_name().to_string_lossy().into_owned();
        }
    }
    panic!("no NVMe controller with serial {serial}: this test needs the lab's switch topology")
}

/// Write `img` at 0 on `dev` and make it durable, then drop the page cache, so that what
/// the server reads comes from the device.
fn write_image(dev: &str, img: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(dev).unwrap();
    f.write_all_at(img, 0).unwrap();
    f.sync_all().unwrap();
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

/// The lab SSD's namespace (serial p2plabssd), with `data(len, seed)` written at 0 by
/// [`write_image`]: the model a test compares against.
fn ssd_with_image(len: usize, seed: u32) -> (String, Vec<u8>) {
    let dev = namespace_of("p2plabssd");
    let model = data(len, seed);
    write_image(&dev, &model);
    (dev, model)
}

/// `len` bytes at `offset` of `dev` as `dd iflag=direct` reads them.
fn dd_direct(dev: &str, offset: u64, len: u64) -> Vec<u8> {
    assert!(offset % 4096 == 0 && len % 4096 == 0);
    let out = std::process::Command::new("dd")
        .args([
            &format!("if={dev}"),
            "of=/dev/stdout",
            "bs=4096",
            &format!("skip={}", offset / 4096),
            &format!("count={}", len / 4096),
            "iflag=direct",
            "status=none",
        ])
        .output()
        .expect("dd");
    assert!(
        out.status.success(),
        "dd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The page cache, in KiB (`Cached:` of /proc/meminfo).
fn cached_kib() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix("Cached:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn client(addr: std::net::SocketAddr) -> ClientConfig {
    let mut c = ClientConfig::new(addr.to_string(), TOKEN);
    c.chunk = 256 << 10;
    c
}

/// Deterministic (offset, len) pairs inside `size`, some aligned, most not.
fn ranges(size: u64, n: usize) -> Vec<(u64, u64)> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| {
            let len = 1 + next() % (3 << 20);
            let off = next() % (size - len);
            if i % 4 == 0 {
                (off / 4096 * 4096, len.div_ceil(4096) * 4096)
            } else {
                (off, len)
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_region_serves_the_ssd_by_direct_io_and_puts_reach_it() {
    let size: u64 = 16 << 20;
    let (dev, mut model) = ssd_with_image(size as usize, 31);
    let s = start(
        &[
            &format!("data=nvme:{dev}:0:16M"),
            &format!("ro=nvme:{dev}:16M:4M:ro"),
        ],
        |c| c.bounce_chunk = 256 << 10,
    )
    .await;
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let list = c.list().await.unwrap();
    let info = list.iter().find(|r| r.name == "data").unwrap();
    assert_eq!(
        (info.kind.as_str(), info.path),
        ("nvme", DataPath::Bounce),
        "{info:?}"
    );
    assert!(
        info.reason.contains("a NIC cannot address block storage")
            && info.reason.contains("device → host staging by direct I/O")
            && info.reason.contains("made durable"),
        "{}",
        info.reason
    );
    assert!(info.server_puts, "{info:?}");
    // fetches of any range return the image, and the page cache does not grow with them
    let h = c.open("data", true).await.unwrap();
    assert!(
        h.pull_depth > 0,
        "the read-only namespace cost the device its memory windows: fetches are not staged"
    );
    let cached = cached_kib();
    let mut fetched = 0;
    for (off, len) in ranges(size, 12) {
        let mut sink = Vec::new();
        let r = c
            .fetch(&h, off, len, &mut sink, true, &mut |_| {})
            .await
            .unwrap();
        assert!(
            r.verified && sink == model[off as usize..(off + len) as usize],
            "{off}+{len}"
        );
        fetched += len;
    }
    let grown = cached_kib().saturating_sub(cached);
    assert!(
        grown < fetched / 1024 / 4,
        "the page cache grew by {grown} KiB for {} KiB fetched: the server read through it",
        fetched / 1024
    );
    // puts, aligned or not, are on the device when acknowledged, and a fetch sees them
    for (i, (off, len)) in [
        (12_345u64, 300_000u64),
        (1 << 20, 1 << 20),
        (size - 100, 100),
        (4095, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let d = data(len as usize, 100 + i as u32);
        let r = put_model(&mut c, &h, off, &d, &mut model).await;
        assert!(r.verified);
        let (a0, a1) = (off / 4096 * 4096, (off + len).div_ceil(4096) * 4096);
        assert!(
            dd_direct(&dev, a0, a1 - a0) == model[a0 as usize..a1 as usize],
            "put {off}+{len} is not on the device"
        );
        let mut sink = Vec::new();
        c.fetch(&h, off, len, &mut sink, true, &mut |_| {})
            .await
            .unwrap();
        assert!(
            sink == d,
            "a fetch after the put {off}+{len} did not see it"
        );
    }
    // the read-only range: served, puts refused, its bytes untouched
    let ro = c.open("ro", false).await.unwrap();
    let e = c
        .put(&ro, 0, &mut &[1u8; 4096][..], None, false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ReadOnly), "{e}");
    let moved = moved(&mut c, "data").await;
    assert!(
        moved.contains("device → CMB 0.0 MiB") && !moved.contains("device → host 0.0"),
        "{moved}"
    );
    c.bye().await.unwrap();
    s.stop().await;
}

/// Put `d` at `off` (with the client's check sum) and write it into `model` too: the put's
/// report.
async fn put_model(
    c: &mut Client,
    h: &p2p_rdma::bridge::OpenRegion,
    off: u64,
    d: &[u8],
    model: &mut [u8],
) -> p2p_rdma::bridge::TransferReport {
    let rep = c
        .put(h, off, &mut &d[..], None, true, &mut |_| {})
        .await
        .unwrap();
    model[off as usize..off as usize + d.len()].copy_from_slice(d);
    rep
}

/// Fetch `len` bytes at `off` (with the client's check sum) and compare them with `model`'s:
/// the fetch's report.
async fn fetch_matches(
    c: &mut Client,
    h: &p2p_rdma::bridge::OpenRegion,
    off: u64,
    len: u64,
    model: &[u8],
) -> p2p_rdma::bridge::TransferReport {
    let mut sink = Vec::new();
    let rep = c
        .fetch(h, off, len, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert!(
        sink == model[off as usize..(off + len) as usize],
        "{off}+{len}"
    );
    rep
}

/// Whether the client's count of zero-copy bytes (chunks the server said it lent) is the
/// server's CMB → NIC figure, `lent_mib` (as `ls` rounds it).
fn same_as_server(zero_copy_bytes: u64, lent_mib: f64) -> bool {
    (zero_copy_bytes as f64 / (1 << 20) as f64 - lent_mib).abs() < 0.06
}

/// The bytes each leg of block-storage region `name` moved, as `ls` shows them.
async fn moved(c: &mut Client, name: &str) -> String {
    c.list()
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no region '{name}' listed"))
        .residency
        .unwrap_or_default()
}

/// MiB the NIC read from region `d`'s CMB ring, as `ls` shows them.
async fn cmb_to_nic(c: &mut Client) -> f64 {
    leg_mib(&moved(c, "d").await, "CMB → NIC")
}

/// The MiB of one leg (`CMB → NIC`) in what `ls` shows of a region's moved bytes.
fn leg_mib(moved: &str, leg: &str) -> f64 {
    moved
        .split(&format!("{leg} "))
        .nth(1)
        .and_then(|v| v.split(" MiB").next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {leg} figure in {moved}"))
}

/// `p2p-rdma bench` with the lab token.
fn bench_cmd() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_p2p-rdma"));
    c.env("P2P_RDMA_TOKEN", TOKEN);
    c
}

#[test]
#[ignore = "lab"]
fn lab_nvme_bench_reads_an_ssd_and_writes_it_only_when_told_to() {
    // the SSD holds data and is served through the bounce path (a NIC cannot address block
    // storage): a write benchmark would overwrite it and, without --overwrite, is refused by
    // both sides (before a path is chosen), a read benchmark measures it through bounce, and
    // the SSD's bytes are the same afterwards
    let (dev, model) = ssd_with_image(4 << 20, 53);
    let spec = format!("nvme:{dev}:0:4M");
    let addr = |port: u16| format!("{}:{port}", lab_ip());
    // a bench server of `op` on `port` for `mem`, with `more` arguments
    let serve = |op: &str, port: u16, mem: &str, more: &[&str]| {
        bench_cmd()
            .args(["bench", op, "--port", &port.to_string(), "--mem", mem])
            .args(more)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let stderr_of = |c: std::process::Child| {
        let o = c.wait_with_output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // a run both sides ended well: the client's first JSON row
    let row_of = |s: std::process::Child, out: std::process::Output| -> serde_json::Value {
        let (ok, sv) = stderr_of(s);
        assert!(
            out.status.success() && ok,
            "{}\nserver: {sv}",
            String::from_utf8_lossy(&out.stderr)
        );
        let first = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        serde_json::from_str(&first).unwrap_or_else(|e| panic!("{e}: {first}"))
    };
    let s = serve("write", 19150, &spec, &[]);
    let out = bench_cmd()
        .args([
            "bench",
            "write",
            &addr(19150),
            "--size",
            "1M",
            "--iters",
            "4",
        ])
        .output()
        .unwrap();
    let (ok, sv) = stderr_of(s);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && !ok,
        "the write benchmark ran: {err}\n{sv}"
    );
    assert!(
        sv.contains("holds data") && err.contains("holds data"),
        "server: {sv}\nclient: {err}"
    );
    // and it names the way to allow it
    assert!(err.contains("give the server --overwrite"), "{err}");
    let s = serve("read", 19151, &spec, &[]);
    let out = bench_cmd()
        .args([
            "bench",
            "read",
            &addr(19151),
            "--size",
            "1M",
            "--iters",
            "4",
            "--json",
        ])
        .output()
        .unwrap();
    let row = row_of(s, out);
    assert_eq!(row["path"], "bounce", "{row}");
    assert_eq!(row["iterations"], 4, "{row}");
    assert!(
        dd_direct(&dev, 0, 4 << 20) == model,
        "the SSD's bytes changed under a bench"
    );
    // told to (--overwrite), the server lets a write benchmark destroy the SSD's bytes: through
    // a CMB ring, each message lands there by the NIC where the landing canary passed (7.3 at
    // path MTU 4096), and --validate reads the last message back from the SSD by direct I/O
    let cmb = controller_of("p2plab0");
    let ring = format!("{spec},via=cmb:{cmb}:8M");
    let s = serve("write", 19152, &ring, &["--overwrite"]);
    let out = bench_cmd()
        .args([
            "bench",
            "write",
            &addr(19152),
            "--size",
            "1M",
            "--iters",
            "8",
            "--validate",
            "--json",
        ])
        .output()
        .unwrap();
    let row = row_of(s, out);
    eprintln!("{row}");
    assert_eq!(row["path"], "bounce", "{row}");
    assert_eq!(row["validated"], true, "{row}");
    assert_eq!(row["iterations"], 8, "{row}");
    // (the rxe of `soft-roce/lab --rxe odp-fix` lands at any path MTU)
    let landed = if lab_rxe_any_offset() || lab_port_mtu() == 4096 {
        1.0
    } else {
        0.0
    };
    assert_eq!(row["lent_fraction"].as_f64(), Some(landed), "{row}");
    assert!(
        dd_direct(&dev, 0, 4 << 20) != model,
        "the write benchmark left the SSD as it was"
    );
}
