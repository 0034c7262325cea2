//! Chunks of an `nvme` region that start partway into a block: lent from the CMB ring only
//! where the NIC was proved to reach the ring at any offset; and transfers that start partway
//! into one, cut so that the rest of their pieces go through the ring.

use super::ring::{host_memory_bytes, ring_lands, ring_lends};
use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_chunks_that_start_partway_into_a_block_are_lent_only_where_any_offset_was_proved()
{
    // The ring fills a slot from the first block of its chunk, so a chunk that starts on a
    // block (512 bytes here) starts on a page of its slot, and one that starts partway into a
    // block starts partway into a page. The kernel's own rxe moves packets that start partway
    // into a page wrong (LAB.md): there the ring lends chunks that start on a block, at path
    // MTU 4096, and copies the others. The rxe of `soft-roce/lab --rxe odp-fix` reaches the ring
    // at any offset and path MTU: every chunk is lent. A transfer that starts partway into a
    // bounce chunk has a short first piece, and the rest start on its multiples (whole blocks):
    // so only that first piece depends on the offset. Where only chunks that start on a block
    // are lent, the server tells the client so (`piece_align`), and that first piece ends at
    // the next block: only the bytes before it are copied. Every byte matches.
    let cmb = controller_of("p2plab0");
    let size: u64 = 8 << 20;
    let bc: u64 = 256 << 10;
    let (dev, mut model) = ssd_with_image(size as usize, 67);
    let s = start(&[&format!("d=nvme:{dev}:0:8M,via=cmb:{cmb}:2M")], |c| {
        c.bounce_chunk = bc as usize
    })
    .await;
    // chunks of the bounce chunk's size: eight slots of 256 KiB
    let mut c = Client::connect(client(s.addr)).await.unwrap();
    let info = c.list().await.unwrap().remove(0);
    eprintln!("reason: {}", info.reason);
    let any_offset = lab_rxe_any_offset();
    // the check would refuse the other rxe's name for the module loaded here
    let taint = std::fs::read_to_string("/sys/module/rdma_rxe/taint").unwrap();
    let other = if any_offset { "stock" } else { "odp-fix" };
    let e = rxe_any_offset(Some(other), &taint).unwrap_err();
    assert!(e.contains("but the loaded rdma_rxe's taint is"), "{e}");
    let ring = ring_lends(&info.reason);
    let any = ring && any_offset;
    let lands = ring_lands(&info.reason);
    if any_offset {
        // the runs with that rxe have the switch topology and 7.3: both of the ring's legs
        assert!(any && lands, "{}", info.reason);
    }
    let h = c.open("d", true).await.unwrap();
    // (where the ring lends from page starts only: the connection is at the proved path MTU)
    let align = if ring && !any { 512 } else { 0 };
    assert_eq!(h.piece_align, align, "{h:?}");
    let lent_before = cmb_to_nic(&mut c).await;
    let mut zero_copy = 0;
    for (off, len) in [
        (512, 1 << 20),
        (4096 + 777, 700_000),
        ((3 << 20) + 1001, 300_001),
    ] {
        let rep = fetch_matches(&mut c, &h, off, len, &model).await;
        // what comes after the first piece starts on a block
        let first = ((512 - off % 512) % 512).min(len);
        let want = if any {
            len
        } else if ring {
            len - first
        } else {
            0
        };
        assert_eq!(rep.zero_copy_bytes, want, "fetch {off}+{len}: {rep:?}");
        zero_copy += rep.zero_copy_bytes;
    }
    let lent = cmb_to_nic(&mut c).await - lent_before;
    assert!(
        same_as_server(zero_copy, lent),
        "client: {zero_copy} bytes zero-copy, server: {lent} MiB CMB → NIC"
    );
    // puts of whole blocks, a block and seven blocks past a page start
    let nic_to_cmb = |moved: &str| leg_mib(moved, "NIC → CMB");
    let landed_before = nic_to_cmb(&moved(&mut c, "d").await);
    let mut landed = 0;
    for (off, len, seed) in [
        ((2 << 20) + 512, 600 * 512, 8u32),
        ((5 << 20) + 3584, 1 << 20, 9),
    ] {
        let rep = put_model(&mut c, &h, off, &data(len, seed), &mut model).await;
        let want = if lands { len as u64 } else { 0 };
        assert_eq!(rep.zero_copy_bytes, want, "put {off}+{len}: {rep:?}");
        landed += rep.zero_copy_bytes;
    }
    let moved_now = moved(&mut c, "d").await;
    eprintln!("moved: {moved_now}");
    assert!(
        same_as_server(landed, nic_to_cmb(&moved_now) - landed_before),
        "client: {landed} bytes landed, server: {moved_now}"
    );
    // what the NIC moved through the ring did not cross host memory: every byte so far, where
    // the ring lends and lands them all; the chunks it copied did
    let metrics = s.handle.metrics().encode();
    let host = host_memory_bytes(&metrics, "d");
    eprintln!("bytes that crossed host memory: {host}");
    if any {
        assert_eq!(host, 0, "{metrics}");
    } else {
        assert!(host > 0, "{metrics}");
    }
    // a put that starts and ends partway into a block: its first and last pieces cover blocks
    // partly, and land too, the blocks completed in their slots from the device; only the
    // first starts partway into a block, and so lands only where any offset was proved (it
    // ends on the next block where only starts on blocks were)
    let (off, len) = ((6 << 20) + 777, 600_000u64);
    let rep = put_model(&mut c, &h, off, &data(len as usize, 10), &mut model).await;
    let first = 512 - off % 512;
    let want = match (lands, any) {
        (true, true) => len,
        (true, false) => len - first,
        (false, _) => 0,
    };
    assert_eq!(rep.zero_copy_bytes, want, "put {off}+{len}: {rep:?}");
    let metrics = s.handle.metrics().encode();
    let host_after = host_memory_bytes(&metrics, "d");
    assert_eq!(
        host_after - host,
        len - want,
        "the put's bytes that crossed host memory: {metrics}"
    );
    assert!(
        dd_direct(&dev, 0, size) == model,
        "the puts are not on the device as put"
    );
    fetch_matches(&mut c, &h, 0, size, &model).await;
    c.bye().await.unwrap();
    s.stop().await;
}
