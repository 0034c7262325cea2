//! The CMB ring of an `nvme` region: each leg proved or its refusal named, slots lent to the
//! NIC for fetches and landed in for puts, and given back when a region goes away.

use super::*;

/// What the legs' report says of the CMB → NIC leg in this guest. rxe reaches a p2pmem mapping
/// only through ODP (pinned: EFAULT), and its ODP READs copy every packet from the start of
/// its page (LAB.md): at path MTU 4096 a canary from the start of a page passes (one partway
/// into a page fails), so the NIC reads ring slots itself; at 1024 neither passes. The rxe of
/// `soft-roce/lab --rxe odp-fix` passes the canary partway into a page at either.
pub(super) fn ring_nic_leg_expected() -> (bool, &'static str) {
    if lab_rxe_any_offset() {
        (
            true,
            "CMB → NIC: the NIC reads each chunk from its ring slot through a read-only memory \
             window (odp, proved by a canary); a chunk the ring cannot lend (longer than a slot, \
             no slot free) goes",
        )
    } else if lab_port_mtu() == 4096 {
        (
            true,
            "CMB → NIC: the NIC reads each chunk from its ring slot through a read-only memory \
             window (odp: a canary from the start of a page passed",
        )
    } else {
        (false, "CMB → NIC: the NIC cannot reach the ring (")
    }
}

/// Whether the ring lends fetches' chunks to the NIC in this guest: a kernel with P2PDMA, the
/// CMB → NIC leg proved at this path MTU, and the SSD → CMB leg verified (`reason`: the
/// region's).
pub(super) fn ring_lends(reason: &str) -> bool {
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_default();
    kernel != "6.12"
        && ring_nic_leg_expected().0
        && reason.contains("device → CMB: peer to peer, verified")
}

/// Whether the ring also lands puts' chunks in this guest: it lends
/// ([`ring_lends`]), and the landing canary passed (`reason`: the region's).
pub(super) fn ring_lands(reason: &str) -> bool {
    ring_lends(reason) && reason.contains("NIC → CMB: the NIC writes each put's chunk")
}

/// The sum of the series of counter `name` in the server's metrics text whose labels hold
/// `label` (`""`: every series).
pub(super) fn counter_sum(metrics: &str, name: &str, label: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The bytes of region `region` that crossed host memory
/// (`p2p_rdma_host_memory_bytes_total`), from the server's metrics text.
pub(super) fn host_memory_bytes(metrics: &str, region: &str) -> u64 {
    counter_sum(
        metrics,
        "p2p_rdma_host_memory_bytes_total",
        &format!("region=\"{region}\""),
    )
}

/// The server's count of chunks that waited for a ring slot with `outcome` (lent, copied), from
/// its metrics' text.
fn ring_waits(metrics: &str, outcome: &str) -> u64 {
    counter_sum(
        metrics,
        "p2p_rdma_ring_waits_total",
        &format!("outcome=\"{outcome}\""),
    )
}

/// A client that asks for 1 MiB chunks: one to a slot of the tests' 4 MiB rings.
pub(super) async fn ring_client(addr: std::net::SocketAddr) -> Client {
    let mut cfg = client(addr);
    cfg.chunk = 1 << 20;
    Client::connect(cfg).await.unwrap()
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
    // a ring that neither of the SSD's legs reaches peer to peer is given back to the CMB at
    // open, before the NIC's legs are tried: no chunk could go through it
    let nic_leg = if iommu {
        "given back to the CMB (no chunk can go through it: neither of the device's legs to the \
         CMB is peer to peer); device → CMB: through host memory"
    } else {
        nic_leg
    };
    if kernel != "6.12" {
        assert!(info.reason.contains(nic_leg), "{}", info.reason);
    }
    if iommu {
        assert!(
            info.reason
                .contains("CMB → NIC: not tried: each chunk goes from the device to host staging"),
            "{}",
            info.reason
        );
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
        // every byte (3.29 MiB) but, where the NIC reads the ring from page starts only, the
        // third fetch's 247 before its first block: its first piece ends there (`piece_align`)
        assert!(lent >= 3.2, "{lent} MiB read by the NIC from the ring");
    } else {
        assert_eq!(
            lent, 0.0,
            "nothing is lent where the NIC cannot read the ring"
        );
    }
    let host_memory = || host_memory_bytes(&s.handle.metrics().encode(), "d");
    let host_before = host_memory();
    let d = data(700_001, 9);
    c.put(&h, 5000, &mut d.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    let put_host = host_memory() - host_before;
    model[5000..5000 + d.len()].copy_from_slice(&d);
    assert!(
        dd_direct(&dev, 0, 1 << 20) == model[..1 << 20],
        "the put is not on the device"
    );
    let moved = moved(&mut c, "d").await;
    eprintln!("moved: {moved}");
    // only the chunks lent to the NIC, or landed by it, went through the ring: every other
    // byte went between the device and host staging by direct I/O. The put starts partway
    // into a block: where the NIC was proved to land at any offset, its first piece (from
    // 5000 to 256 KiB) lands; where only from a page's start, it ends at the next block
    // (5120, `piece_align`) and goes through host staging, and the next piece, from there to
    // 256 KiB, lands. The pieces from 256 KiB to 512 KiB (whole blocks) and from 512 KiB on
    // (it ends partway into a block) land either way. The slots' spans reach the device from
    // the ring: 699,904 bytes, or 700,416 with the first block
    let lands = ring_lands(&info.reason);
    let any = lands && lab_rxe_any_offset();
    assert_eq!(
        !moved.contains("device → CMB 0.0 MiB"),
        lends,
        "device → CMB only for lent chunks: {moved}"
    );
    assert_eq!(
        leg_mib(&moved, "CMB → device"),
        if lands { 0.7 } else { 0.0 },
        "CMB → device only for the put's pieces that landed: {moved}"
    );
    assert!(!moved.contains("device → host 0.0 MiB"), "{moved}");
    // (with the NIC proved from page starts only: one block, the put's first piece's)
    assert_eq!(
        moved.contains("host → device 0.0 MiB"),
        lands,
        "host → device only for the put's pieces that did not land: {moved}"
    );
    // the put's own bytes that crossed host memory: all, its first piece's 120, or none
    assert_eq!(
        put_host,
        match (lands, any) {
            (false, _) => d.len() as u64,
            (true, false) => 120,
            (true, true) => 0,
        },
        "the put's bytes through host memory"
    );
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
    // which rxe's ODP READ gets wrong: its chunks are copied, and every byte matches. Where it
    // was proved at any offset (`soft-roce/lab --rxe odp-fix`), that client is lent chunks too
    let cmb = controller_of("p2plab0");
    let (dev, model) = ssd_with_image(8 << 20, 59);
    let spec = format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:2M");
    let s = start(&[&spec], |c| c.bounce_chunk = 256 << 10).await;
    let (nic_reads_ring, _) = ring_nic_leg_expected();
    let any_offset = lab_rxe_any_offset();
    let mut small = client(s.addr);
    small.qp_path.max_mtu = Some(1024);
    let mut c = Client::connect(small).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    let lends = nic_reads_ring && info.reason.contains("device → CMB: peer to peer, verified");
    if lends {
        assert_eq!(
            info.reason.contains("on connections at path MTU 4096"),
            !any_offset,
            "{}",
            info.reason
        );
    }
    let h = c.open("d", false).await.unwrap();
    let before = cmb_to_nic(&mut c).await;
    let mut zero_copy = 0;
    for (off, len) in [(0, 2 << 20), (1 << 20, 3 << 20), (5 << 20, 1 << 20)] {
        let rep = fetch_matches(&mut c, &h, off, len, &model).await;
        if !any_offset {
            assert_eq!(rep.zero_copy_bytes, 0, "{rep:?}");
        }
        zero_copy += rep.zero_copy_bytes;
    }
    let lent = cmb_to_nic(&mut c).await - before;
    assert!(
        same_as_server(zero_copy, lent),
        "client: {zero_copy} bytes zero-copy, server: {lent} MiB CMB → NIC"
    );
    if lends && any_offset {
        // at least the first fetch whole (2 MiB, a chunk to each of the ring's eight slots)
        assert!(lent >= 2.0, "{lent} MiB lent at path MTU 1024");
    } else {
        assert_eq!(
            lent, 0.0,
            "ring slots lent to a connection at path MTU 1024"
        );
    }
    c.bye().await.unwrap();
    // a client at the port's MTU is lent the same chunks (where the legs allow it)
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let h = c.open("d", false).await.unwrap();
    let before = cmb_to_nic(&mut c).await;
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
    if !lends || any_offset {
        return;
    }
    // a server whose own QPs are capped below the port's MTU proves the ring at its own path
    // MTU, where a canary from the start of a page fails too: it lends nothing, and says why.
    // No chunk can go through that ring (the region takes no puts), so the ring is given back
    // to the CMB: a 20 MiB ring of its 32 MiB, and then a 20 MiB CMB region fits beside it
    let cmb = controller_of("p2plab0");
    let big = format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:20M");
    let s = start(&[&big], |c| {
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
            && info.reason.contains("at path MTU 1024)")
            && info.reason.contains(
                "a ring of 20 slots of 1024 KiB, given back to the CMB (no chunk can go through \
                 it: the NIC reaches it neither way"
            ),
        "{}",
        info.reason
    );
    let h = c.open("d", false).await.unwrap();
    fetch_matches(&mut c, &h, 0, 2 << 20, &model).await;
    assert_eq!(cmb_to_nic(&mut c).await, 0.0, "lent under --mtu 1024");
    let beside: p2p_rdma::bridge::RegionSpec = format!("c=cmb:{cmb}:20M").parse().unwrap();
    let added = s.handle.add_region(beside).await;
    assert!(
        added.is_ok(),
        "no room in the CMB beside a ring given back: {added:?}"
    );
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_puts_land_in_the_cmb_ring_and_reach_the_ssd() {
    // NIC → CMB → SSD: where the NIC was proved to land READs in the ring (the landing canary)
    // and the SSD to take a chunk from the CMB, a put's chunks are read from the client
    // straight into ring slots (a block a chunk covers partly is completed in the slot from
    // the device); the rest go through host staging, and from there to the device by direct
    // I/O. Every byte reaches the device either way.
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
        // (the rxe of `--rxe odp-fix` lands at any offset, at the port's path MTU)
        let mtu = if lab_rxe_any_offset() {
            lab_port_mtu()
        } else {
            4096
        };
        assert!(
            info.reason.contains(
                "NIC → CMB: the NIC writes each put's chunk into a ring slot, and the device \
                 takes it from there (odp: landing canary passed: an RDMA READ of"
            ) && info
                .reason
                .contains(&format!("(path MTU {mtu}) landed every byte right")),
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
        // every byte: the second put's last chunk (37 KiB, its last block partly covered)
        // too, the block completed in its slot from the device: 5.29 MiB from the ring
        assert_eq!(zero_copy, (5 << 20) + 300_000, "{moved_now}");
        let from_ring = leg_mib(&moved_now, "CMB → device");
        assert!((from_ring - 5.29).abs() < 0.06, "{moved_now}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_a_ring_too_small_for_eight_chunks_lends_whole_chunks_from_fewer_slots() {
    // a 4 MiB ring and the default 1 MiB bounce chunk: eight slots would be 512 KiB, which no
    // chunk fits, so the ring has four slots of 1 MiB and the NIC reads every chunk from them.
    // The client is told to hold four staged chunks (not the server's eight): with eight, its
    // fifth to eighth chunks would find its own first four in the slots and be copied
    let cmb = controller_of("p2plab0");
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_default();
    let (dev, model) = ssd_with_image(8 << 20, 67);
    let s = start(&[&format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:4M")], |_| {}).await;
    let mut c = ring_client(s.addr).await;
    let info = c.list().await.unwrap().remove(0);
    eprintln!("reason: {}", info.reason);
    if kernel == "6.12" {
        assert!(
            info.reason.contains("no CMB staging ring"),
            "{}",
            info.reason
        );
    } else {
        assert!(
            info.reason.contains("legs: a ring of 4 slots of 1024 KiB")
                && info.reason.contains("; device → CMB: "),
            "{}",
            info.reason
        );
    }
    let h = c.open("d", false).await.unwrap();
    let rep = fetch_matches(&mut c, &h, 0, 8 << 20, &model).await;
    let lent = cmb_to_nic(&mut c).await;
    eprintln!("{lent} MiB read by the NIC from the ring, {rep:?}");
    let lends = ring_lends(&info.reason);
    if lends {
        assert_eq!(rep.zero_copy_bytes, 8 << 20, "{rep:?}");
        assert!(same_as_server(rep.zero_copy_bytes, lent), "{lent} MiB lent");
    } else {
        assert_eq!(rep.zero_copy_bytes, 0, "{rep:?}");
    }
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_clients_that_share_a_ring_take_turns_at_its_slots_instead_of_copying() {
    // three clients fetch 8 MiB each at once from a ring of four 1 MiB slots, each told to hold
    // four chunks, while a fourth puts 4 MiB: together they ask for four times the slots. A
    // chunk that finds every slot lent waits for one to come back, in turn with the other
    // clients' chunks; before, it was copied through host memory
    let cmb = controller_of("p2plab0");
    let (dev, mut model) = ssd_with_image(12 << 20, 71);
    let s = start(&[&format!("d=nvme:{dev}:0:12M,via=cmb:{cmb}:4M")], |_| {}).await;
    let mut cs = Vec::new();
    for _ in 0..4 {
        let mut c = ring_client(s.addr).await;
        let h = c.open("d", true).await.unwrap();
        cs.push((c, h));
    }
    let info = cs[0].0.list().await.unwrap().remove(0);
    let put = data(4 << 20, 72);
    let mut put_model_bytes = model.clone();
    let [a, b, c, p] = &mut cs[..] else {
        unreachable!("four clients")
    };
    let (ra, rb, rc, rp) = tokio::join!(
        fetch_matches(&mut a.0, &a.1, 0, 8 << 20, &model),
        fetch_matches(&mut b.0, &b.1, 0, 8 << 20, &model),
        fetch_matches(&mut c.0, &c.1, 0, 8 << 20, &model),
        put_model(&mut p.0, &p.1, 8 << 20, &put, &mut put_model_bytes),
    );
    model = put_model_bytes;
    assert!(
        dd_direct(&dev, 0, 12 << 20) == model,
        "the put is not on the device as put"
    );
    let metrics = s.handle.metrics().encode();
    let waits = |outcome: &str| ring_waits(&metrics, outcome);
    let (lent_after_wait, copied_after_wait) = (waits("lent"), waits("copied"));
    let reps = [ra, rb, rc, rp];
    eprintln!(
        "zero-copy bytes {:?}, MiB/s {:?}; waited and lent {lent_after_wait}, copied {copied_after_wait}",
        reps.iter().map(|r| r.zero_copy_bytes).collect::<Vec<_>>(),
        reps.iter().map(|r| r.mib_per_sec as u32).collect::<Vec<_>>()
    );
    let lends = ring_lends(&info.reason);
    let lands = lends && info.reason.contains("CMB → device: peer to peer, verified");
    for rep in &reps[..3] {
        assert_eq!(
            rep.zero_copy_bytes,
            if lends { 8 << 20 } else { 0 },
            "{rep:?}"
        );
    }
    assert_eq!(
        reps[3].zero_copy_bytes,
        if lands { 4 << 20 } else { 0 },
        "{:?}",
        reps[3]
    );
    if lends {
        assert!(
            lent_after_wait > 0,
            "four clients at once never found the ring's four slots lent: nothing was tested"
        );
        assert_eq!(copied_after_wait, 0, "{metrics}");
        assert!(same_as_server(24 << 20, cmb_to_nic(&mut cs[0].0).await));
    } else {
        assert_eq!(lent_after_wait + copied_after_wait, 0, "{metrics}");
    }
    for (c, _) in cs {
        c.bye().await.unwrap();
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_a_ring_whose_slots_idle_clients_hold_is_not_waited_on() {
    // four clients open to fetch and never read the chunk each open lent them: they hold the
    // ring's four slots. Another client's fetch waits only until the ring has not moved for
    // two seconds, then every chunk is copied without waiting; once the four let go, the
    // ring lends again
    let cmb = controller_of("p2plab0");
    let (dev, model) = ssd_with_image(8 << 20, 73);
    let s = start(&[&format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:4M")], |_| {}).await;
    let mut idle = Vec::new();
    for i in 0..4u64 {
        let mut c = ring_client(s.addr).await;
        let h = c.open_to_fetch("d", i << 20, 1 << 20).await.unwrap();
        idle.push((c, h));
    }
    let mut c = ring_client(s.addr).await;
    let info = c.list().await.unwrap().remove(0);
    let h = c.open("d", false).await.unwrap();
    let started = std::time::Instant::now();
    let held = fetch_matches(&mut c, &h, 0, 8 << 20, &model).await;
    let took = started.elapsed();
    let waits = |outcome: &str| ring_waits(&s.handle.metrics().encode(), outcome);
    let copied = waits("copied");
    for (c, _) in idle {
        c.bye().await.unwrap();
    }
    let free = fetch_matches(&mut c, &h, 0, 8 << 20, &model).await;
    eprintln!(
        "slots held: {} zero-copy bytes in {took:?}, {copied} chunks waited and were copied; \
         slots free: {} zero-copy bytes",
        held.zero_copy_bytes, free.zero_copy_bytes
    );
    let lends = ring_lends(&info.reason);
    assert_eq!(held.zero_copy_bytes, 0, "{held:?}");
    if lends {
        // the chunks asked for before the ring stalled waited (the client asks for four at
        // once); the rest were copied at once
        assert!((1..=4).contains(&copied), "{copied} chunks waited");
        assert_eq!(waits("lent"), 0);
        assert_eq!(free.zero_copy_bytes, 8 << 20, "{free:?}");
    } else {
        assert_eq!(copied, 0);
        assert_eq!(free.zero_copy_bytes, 0, "{free:?}");
    }
    c.bye().await.unwrap();
    s.stop().await;
}
