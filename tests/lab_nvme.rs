//! Lab tests of block-storage regions (`nvme:`): the lab's switch and iommu topologies put an
//! SSD (an NVMe without a CMB, serial `p2plabssd`, a fresh image per run) on the PCIe switch
//! beside the NVMe with a CMB and the NIC.

mod common;

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
        // have the serial
        let s =
            std::fs::read_to_string(format!("/sys/block/{n}/device/serial")).unwrap_or_default();
        if s.trim() == serial {
            return format!("/dev/{n}");
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

/// What the legs' report says of the CMB → NIC leg in this guest. rxe reaches a p2pmem mapping
/// only through ODP (pinned: EFAULT), and its ODP READs copy every packet from the start of
/// its page (LAB.md): at path MTU 4096 a canary from the start of a page passes (one partway
/// into a page fails), so the NIC reads ring slots itself; at 1024 neither passes.
fn ring_nic_leg_expected() -> (bool, &'static str) {
    let dev = std::env::var("P2P_RDMA_DEVICE").expect("P2P_RDMA_DEVICE");
    let mtu = verbs::Context::open(Some(&dev))
        .unwrap()
        .port(1)
        .unwrap()
        .active_mtu;
    if mtu == 4096 {
        (
            true,
            "CMB → NIC: the NIC reads each chunk from its ring slot through a read-only memory \
             window (odp: a canary from the start of a page passed",
        )
    } else {
        (false, "CMB → NIC: the NIC cannot reach the ring (")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_region_through_a_cmb_proves_each_leg_or_names_the_refusal() {
    let cmb = controller_of("p2plab0");
    let size: u64 = 8 << 20;
    let (dev, mut model) = ssd_with_image(size as usize, 47);
    let s = start(&[&format!("d=nvme:{dev}:0:8M,via=cmb:{cmb}:2M")], |c| {
        c.bounce_chunk = 256 << 10
    })
    .await;
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    eprintln!("reason: {}", info.reason);
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_default();
    let through_cmb = info.reason.contains("device → CMB: peer to peer, verified");
    let iommu = std::env::var("P2P_LAB_TOPOLOGY").as_deref() == Ok("iommu");
    if kernel == "6.12" {
        assert!(
            info.reason.contains("no CMB staging ring")
                && info.reason.contains("CONFIG_PCI_P2PDMA"),
            "{}",
            info.reason
        );
    } else if iommu {
        // with QEMU's IOMMU the SSD's DMA to the CMB's bus address is translated instead of
        // routed inside the switch: the read completes with other bytes, and the proof at
        // start catches it
        assert!(
            !through_cmb
                && info.reason.contains(
                    "device → CMB: through host memory (the read into the CMB completed but the bytes differ"
                ),
            "{}",
            info.reason
        );
    } else {
        // QEMU's SSD DMAs into the CMB beside it on the switch, and back
        assert!(
            through_cmb && info.reason.contains("CMB → device: peer to peer, verified"),
            "{}",
            info.reason
        );
    }
    let (nic_reads_ring, nic_leg) = ring_nic_leg_expected();
    if kernel != "6.12" {
        assert!(info.reason.contains(nic_leg), "{}", info.reason);
    }
    // the NIC reads chunks from the ring only where the SSD's read into it was proved too
    let lends = kernel != "6.12" && nic_reads_ring && through_cmb;
    let h = c.open("d", true).await.unwrap();
    for (off, len) in ranges(size, 6) {
        fetch_matches(&mut c, &h, off, len, &model).await;
    }
    // chunks that start on a page: lent from the ring where the NIC reads it; and one that
    // does not (copied by the CPU), checked against the device
    let lent_before = cmb_to_nic(&mut c).await;
    let mut zero_copy = 0;
    for (off, len) in [(1 << 20, 2 << 20), (4096 * 3, 300_000), (777, 1 << 20)] {
        zero_copy += fetch_matches(&mut c, &h, off, len, &model)
            .await
            .zero_copy_bytes;
    }
    let lent = cmb_to_nic(&mut c).await - lent_before;
    // the client counts the chunks it was lent as the server does
    assert!(
        same_as_server(zero_copy, lent),
        "client: {zero_copy} bytes zero-copy, server: {lent} MiB CMB → NIC"
    );
    if lends {
        // the first two fetches whole (2.3 MiB), maybe not a chunk of the third
        assert!(lent >= 2.2, "{lent} MiB read by the NIC from the ring");
    } else {
        assert_eq!(
            lent, 0.0,
            "nothing is lent where the NIC cannot read the ring"
        );
    }
    let d = data(700_001, 9);
    c.put(&h, 5000, &mut d.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    model[5000..5000 + d.len()].copy_from_slice(&d);
    assert!(
        dd_direct(&dev, 0, 1 << 20) == model[..1 << 20],
        "the put is not on the device"
    );
    let moved = moved(&mut c, "d").await;
    eprintln!("moved: {moved}");
    if through_cmb {
        // every byte went through the ring (8 slots; one client has at most 8 in flight)
        assert!(
            !moved.contains("device → CMB 0.0 MiB")
                && !moved.contains("CMB → device 0.0 MiB")
                && moved.contains("device → host 0.0 MiB")
                && moved.contains("host → device 0.0 MiB"),
            "{moved}"
        );
    } else {
        assert!(moved.contains("device → CMB 0.0 MiB"), "{moved}");
    }
    c.bye().await.unwrap();
    s.stop().await;
    // doctor says the same of each leg
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args([
            "doctor",
            "--region",
            &format!("nvme:{dev}:0:8M,via=cmb:{cmb}:2M"),
            "--json",
        ])
        .args(["--device", &std::env::var("P2P_RDMA_DEVICE").unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"));
    let legs = v["legs"].as_str().unwrap_or_else(|| panic!("no legs: {v}"));
    assert_eq!(v["memory"], "nvme", "{v}");
    assert!(v["residency_before"].is_null(), "{v}");
    if kernel == "6.12" {
        assert!(legs.contains("no CMB staging ring"), "{legs}");
    } else {
        assert!(
            legs.contains(if iommu {
                "device → CMB: through host memory (the read into the CMB completed but the bytes differ"
            } else {
                "device → CMB: peer to peer, verified"
            }) && legs.contains(nic_leg),
            "{legs}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_removing_a_region_mid_fetch_revokes_its_lent_slots_and_frees_its_cmb_ring() {
    // a ring of 20 MiB in a 32 MiB CMB: a second one fits only once the first is freed, the
    // registration the NIC reads it through and every window lent over it included
    use std::time::Duration;
    let cmb = controller_of("p2plab0");
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_default();
    let size: u64 = 8 << 20;
    let (dev, model) = ssd_with_image(size as usize, 53);
    let spec = format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:20M");
    let s = start(&[&spec], |c| c.bounce_chunk = 256 << 10).await;
    let has_ring = |reason: &str| !reason.contains("no CMB staging ring");
    let info = Client::connect(client(s.addr))
        .await
        .unwrap()
        .list()
        .await
        .unwrap()
        .remove(0);
    if kernel == "6.12" {
        // no P2PDMA: no ring to free; the removal is still clean
        assert!(!has_ring(&info.reason), "{}", info.reason);
    } else {
        assert!(has_ring(&info.reason), "{}", info.reason);
    }
    let (nic_reads_ring, _) = ring_nic_leg_expected();
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let h = c.open("d", false).await.unwrap();
    let want = model.clone();
    let fetcher = tokio::spawn(async move {
        let mut whole = 0;
        loop {
            let mut sink = Vec::new();
            match c.fetch(&h, 0, size, &mut sink, false, &mut |_| {}).await {
                Ok(_) => {
                    assert!(sink == want, "a whole fetch with other bytes");
                    whole += 1;
                }
                // the region went away mid-fetch: an error, never other bytes
                Err(e) => return (whole, e),
            }
        }
    });
    // let some fetches through (a chunk or more lent from the ring where the NIC reads it)
    tokio::time::sleep(Duration::from_secs(3)).await;
    let gone = s
        .handle
        .remove_region("d", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(gone.released, "{gone:?}");
    let (whole, e) = tokio::time::timeout(Duration::from_secs(30), fetcher)
        .await
        .expect("the fetches end once the region is removed")
        .unwrap();
    eprintln!("{whole} whole fetches, then: {e}");
    assert!(whole >= 1, "no fetch finished in 3 s: {e}");
    // the same ring again: the CMB has room only if the first was released (connections
    // revoke their windows on their own time, so give them a moment)
    let mut tries = 0;
    let reason = loop {
        let spec: p2p_rdma::bridge::RegionSpec = spec.parse().unwrap();
        let info = s.handle.add_region(spec).await.unwrap();
        if has_ring(&info.reason) || kernel == "6.12" || tries == 20 {
            break info.reason;
        }
        tries += 1;
        s.handle
            .remove_region("d", Duration::from_secs(10))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if kernel != "6.12" {
        assert!(
            has_ring(&reason),
            "the removed region's CMB ring was not freed: {reason}"
        );
    }
    // and it serves again, from its new ring where the NIC reads it
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let h = c.open("d", false).await.unwrap();
    fetch_matches(&mut c, &h, 1 << 20, 2 << 20, &model).await;
    let lent = cmb_to_nic(&mut c).await;
    if kernel != "6.12" && nic_reads_ring && reason.contains("device → CMB: peer to peer") {
        assert!(lent >= 2.0, "{lent} MiB read by the NIC from the new ring");
    }
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_ring_slots_proved_at_one_path_mtu_are_not_lent_to_a_connection_at_another() {
    // where the NIC's access to the ring was proved only from page starts (at path MTU 4096,
    // LAB.md), a client whose QP runs at 1024 reads packets that start partway into pages,
    // which rxe's ODP READ gets wrong: its chunks are copied, and every byte matches
    let cmb = controller_of("p2plab0");
    let (dev, model) = ssd_with_image(8 << 20, 59);
    let spec = format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:2M");
    let s = start(&[&spec], |c| c.bounce_chunk = 256 << 10).await;
    let (nic_reads_ring, _) = ring_nic_leg_expected();
    let mut small = client(s.addr);
    small.qp_path.max_mtu = Some(1024);
    let mut c = Client::connect(small).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    let lends = nic_reads_ring && info.reason.contains("device → CMB: peer to peer, verified");
    if lends {
        assert!(
            info.reason.contains("on connections at path MTU 4096"),
            "{}",
            info.reason
        );
    }
    let h = c.open("d", false).await.unwrap();
    let before = cmb_to_nic(&mut c).await;
    for (off, len) in [(0, 2 << 20), (1 << 20, 3 << 20), (5 << 20, 1 << 20)] {
        let rep = fetch_matches(&mut c, &h, off, len, &model).await;
        assert_eq!(rep.zero_copy_bytes, 0, "{rep:?}");
    }
    assert_eq!(
        cmb_to_nic(&mut c).await,
        before,
        "ring slots lent to a connection at path MTU 1024"
    );
    c.bye().await.unwrap();
    // a client at the port's MTU is lent the same chunks (where the legs allow it)
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let h = c.open("d", false).await.unwrap();
    let rep = fetch_matches(&mut c, &h, 0, 2 << 20, &model).await;
    let lent = cmb_to_nic(&mut c).await - before;
    assert!(
        same_as_server(rep.zero_copy_bytes, lent),
        "{rep:?}, {lent} MiB lent"
    );
    if lends {
        assert!(lent >= 2.0, "{lent} MiB read by the NIC from the ring");
    } else {
        assert_eq!(
            lent, 0.0,
            "nothing is lent where the NIC cannot read the ring"
        );
    }
    c.bye().await.unwrap();
    s.stop().await;
    if !lends {
        return;
    }
    // a server whose own QPs are capped below the port's MTU proves the ring at its own path
    // MTU, where a canary from the start of a page fails too: it lends nothing, and says why
    let s = start(&[&spec], |c| {
        c.bounce_chunk = 256 << 10;
        c.qp_path.max_mtu = Some(1024);
    })
    .await;
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    assert!(
        info.reason
            .contains("CMB → NIC: the NIC cannot reach the ring (")
            && info
                .reason
                .contains("; from the start of a page: odp: registered but the canary found")
            && info.reason.contains("at path MTU 1024)"),
        "{}",
        info.reason
    );
    let h = c.open("d", false).await.unwrap();
    fetch_matches(&mut c, &h, 0, 2 << 20, &model).await;
    assert_eq!(cmb_to_nic(&mut c).await, 0.0, "lent under --mtu 1024");
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_puts_of_whole_blocks_land_in_the_cmb_ring_and_reach_the_ssd() {
    // NIC → CMB → SSD: where the NIC was proved to land READs in the ring (the landing canary)
    // and the SSD to take a chunk from the CMB, a put's chunks of whole blocks are read from
    // the client straight into ring slots; the rest (partly covered blocks) are patched by the
    // CPU as before. Every byte reaches the device either way.
    let cmb = controller_of("p2plab0");
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_default();
    let size: u64 = 8 << 20;
    let (dev, mut model) = ssd_with_image(size as usize, 61);
    let spec = format!("d=nvme:{dev}:0:8M,via=cmb:{cmb}:2M");
    let s = start(&[&spec], |c| c.bounce_chunk = 256 << 10).await;
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    eprintln!("reason: {}", info.reason);
    let (nic_reads_ring, _) = ring_nic_leg_expected();
    let both_legs = info.reason.contains("device → CMB: peer to peer, verified")
        && info.reason.contains("CMB → device: peer to peer, verified");
    let lands = kernel != "6.12" && nic_reads_ring && both_legs;
    if lands {
        assert!(
            info.reason.contains(
                "NIC → CMB: the NIC writes each put's chunk of whole blocks into a ring slot, and \
                 the device takes it from there (odp: landing canary passed: an RDMA READ of"
            ) && info
                .reason
                .contains("(path MTU 4096) landed every byte right"),
            "{}",
            info.reason
        );
    } else if kernel == "6.12" {
        assert!(
            info.reason.contains("no CMB staging ring"),
            "{}",
            info.reason
        );
    } else {
        assert!(info.reason.contains("NIC → CMB: "), "{}", info.reason);
    }
    let h = c.open("d", true).await.unwrap();
    let nic_to_cmb = |moved: &str| leg_mib(moved, "NIC → CMB");
    let before = nic_to_cmb(&moved(&mut c, "d").await);
    // 1 MiB of whole blocks (four chunks), then a put whose last chunk covers a block partly,
    // then 4 MiB: sixteen chunks against eight slots and a bounce depth of eight, which land
    // as the connection's earlier landings complete
    let mut zero_copy = 0;
    let puts = [
        (1u64 << 20, 1u64 << 20, 3u32),
        (3 << 20, 300_000, 4),
        (4 << 20, 4 << 20, 6),
    ];
    for (off, len, seed) in puts {
        let rep = put_model(&mut c, &h, off, &data(len as usize, seed), &mut model).await;
        zero_copy += rep.zero_copy_bytes;
    }
    assert!(
        dd_direct(&dev, 0, size) == model,
        "the puts are not on the device as put"
    );
    fetch_matches(&mut c, &h, 0, size, &model).await;
    let moved_now = moved(&mut c, "d").await;
    eprintln!("moved: {moved_now}");
    let landed = nic_to_cmb(&moved_now) - before;
    assert!(
        same_as_server(zero_copy, landed),
        "client: {zero_copy} bytes zero-copy, server: {landed} MiB NIC → CMB"
    );
    if lands {
        // the whole first and third puts and the first chunk of the second: 5.25 MiB
        assert_eq!(zero_copy, (5 << 20) + (256 << 10), "{moved_now}");
        assert!(moved_now.contains("host → device 0.0 MiB"), "{moved_now}");
    } else {
        assert_eq!(zero_copy, 0, "{moved_now}");
    }
    c.bye().await.unwrap();
    // a client at path MTU 1024: where the landing was proved from page starts at 4096, its
    // chunks go through host staging, and still reach the device
    let mut small = client(s.addr);
    small.qp_path.max_mtu = Some(1024);
    let mut c = Client::connect(small).await.unwrap();
    let h = c.open("d", true).await.unwrap();
    let d = data(512 << 10, 5);
    let rep = put_model(&mut c, &h, 6 << 20, &d, &mut model).await;
    if lands && info.reason.contains("on connections at path MTU 4096") {
        assert_eq!(rep.zero_copy_bytes, 0, "landed at path MTU 1024: {rep:?}");
    }
    assert!(
        dd_direct(&dev, 6 << 20, 512 << 10) == d,
        "the put at path MTU 1024 is not on the device"
    );
    fetch_matches(&mut c, &h, 0, size, &model).await;
    c.bye().await.unwrap();
    s.stop().await;
    if !lands {
        return;
    }
    // a server whose connections each have a protection domain of their own: the ring's
    // registration cannot be a READ's local end on their QPs, so nothing lands, and it says so
    let s = start(&[&spec], |c| {
        c.bounce_chunk = 256 << 10;
        c.sharing = p2p_rdma::bridge::SharingPolicy::PerConnection;
    })
    .await;
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    assert!(
        info.reason
            .contains("NIC → CMB: not tried: each connection of this server has a protection domain of its own"),
        "{}",
        info.reason
    );
    let h = c.open("d", true).await.unwrap();
    let rep = put_model(&mut c, &h, 2 << 20, &data(1 << 20, 6), &mut model).await;
    assert_eq!(rep.zero_copy_bytes, 0, "{rep:?}");
    assert!(
        dd_direct(&dev, 0, size) == model,
        "the put of a per-connection server is not on the device"
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
fn lab_nvme_bench_reads_an_ssd_through_bounce_and_refuses_to_write_it() {
    // the SSD holds data and is served through the bounce path (a NIC cannot address block
    // storage): a write benchmark would overwrite it and is refused by both sides (before a
    // path is chosen), a read benchmark measures it through bounce, and the SSD's bytes are
    // the same afterwards
    let (dev, model) = ssd_with_image(4 << 20, 53);
    let spec = format!("nvme:{dev}:0:4M");
    let addr = |port: u16| format!("{}:{port}", lab_ip());
    let serve = |op: &str, port: u16| {
        bench_cmd()
            .args(["bench", op, "--port", &port.to_string(), "--mem", &spec])
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
    let s = serve("write", 19150);
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
    let s = serve("read", 19151);
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
    let (ok, sv) = stderr_of(s);
    assert!(
        out.status.success() && ok,
        "{}\nserver: {sv}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(row["path"], "bounce", "{row}");
    assert_eq!(row["iterations"], 4, "{row}");
    assert!(
        dd_direct(&dev, 0, 4 << 20) == model,
        "the SSD's bytes changed under a bench"
    );
}
