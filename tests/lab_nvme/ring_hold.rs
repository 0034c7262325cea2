//! The CMB ring's hold limit: slots held too long while others want the ring are taken back,
//! and a client whose chunks come too late to READ in time asks for them again.

use std::time::Duration;

use p2p_rdma::bridge::OpenRegion;

use super::ring::{counter_sum, ring_client, ring_lends, ring_nic_leg_expected};
use super::*;

/// The tests' ring hold limit.
const HOLD: Duration = Duration::from_secs(3);

/// A server of `nvme:` region `spec` whose ring hold limit is [`HOLD`].
async fn hold_server(spec: &str) -> Running {
    start(&[spec], |c| c.ring_hold = HOLD).await
}

/// The server's count of ring slots taken back.
fn taken_back(s: &Running) -> u64 {
    let metrics = s.handle.metrics().encode();
    counter_sum(&metrics, "p2p_rdma_ring_slots_taken_back_total", "")
}

/// Clients that each open region `d` to fetch the MiB at `mib` (for each of `mibs`) and read
/// nothing: each holds the slot its first chunk was lent from (where the ring lends).
async fn holders(
    addr: std::net::SocketAddr,
    mibs: std::ops::Range<u64>,
) -> Vec<(Client, OpenRegion, u64)> {
    let mut held = Vec::new();
    for i in mibs {
        let mut c = ring_client(addr).await;
        let h = c.open_to_fetch("d", i << 20, 1 << 20).await.unwrap();
        held.push((c, h, i));
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_ring_slots_held_past_the_hold_limit_while_others_want_them_are_taken_back() {
    // as in `lab_nvme_a_ring_whose_slots_idle_clients_hold_is_not_waited_on`, four clients
    // hold the ring's four slots and read nothing, but the server's ring hold limit is 3 s: once it passed, and another client wants the ring, their slots
    // go back to the ring and that client's fetches are lent again while the four are still
    // connected. A slot nobody wants stays lent; a holder that comes back gives its chunk back
    // unread and asks for it again
    use std::time::Instant;
    let cmb = controller_of("p2plab0");
    let (dev, model) = ssd_with_image(8 << 20, 75);
    let s = hold_server(&format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:4M")).await;
    let taken_back = || taken_back(&s);
    let idle = holders(s.addr, 0..4).await;
    let lent_at = Instant::now();
    let mut c = ring_client(s.addr).await;
    let info = c.list().await.unwrap().remove(0);
    let lends = ring_lends(&info.reason);
    // past the limit, with nobody wanting the ring: the slots stay lent
    tokio::time::sleep(HOLD + Duration::from_secs(2)).await;
    assert_eq!(taken_back(), 0, "slots nobody wanted were taken back");
    // now a client wants the ring: its first fetch finds every slot held and copies; the
    // held slots go back within about a second, and a later fetch is lent whole
    let h = c.open("d", false).await.unwrap();
    let mut reps = Vec::new();
    let wanted_at = Instant::now();
    while reps.len() < 8 {
        let rep = fetch_matches(&mut c, &h, 0, 8 << 20, &model).await;
        let whole = rep.zero_copy_bytes == 8 << 20;
        reps.push(rep.zero_copy_bytes);
        if whole || !lends {
            break;
        }
    }
    eprintln!(
        "held {:?} before the ring was wanted; fetches since then, zero-copy bytes: {reps:?} \
         in {:?}; {} slots taken back",
        wanted_at - lent_at,
        wanted_at.elapsed(),
        taken_back()
    );
    if !lends {
        assert_eq!(reps, [0], "no ring lends here");
        assert_eq!(taken_back(), 0);
        for (c, _, _) in idle {
            c.bye().await.unwrap();
        }
        s.stop().await;
        return;
    }
    // (its first chunk found every slot held and was copied)
    assert!(
        reps[0] < 8 << 20,
        "the first fetch found every slot held: {reps:?}"
    );
    assert_eq!(
        *reps.last().unwrap(),
        8 << 20,
        "no fetch was lent whole while the four held their slots: {reps:?}"
    );
    assert_eq!(taken_back(), 4, "{}", s.handle.metrics().encode());
    // the holders' fetches now find their chunks held too long to READ: each gives its chunk
    // back unread and asks for it again (a READ of a slot taken back would fail and take the
    // QP down), and gets its bytes
    for (mut ic, ih, i) in idle {
        let rep = fetch_matches(&mut ic, &ih, i << 20, 1 << 20, &model).await;
        assert_eq!(rep.reasked_chunks, 1, "{rep:?}");
        ic.bye().await.unwrap();
    }
    let again = fetch_matches(&mut c, &h, 0, 8 << 20, &model).await;
    assert_eq!(again.zero_copy_bytes, 8 << 20, "{again:?}");
    c.bye().await.unwrap();
    s.stop().await;
}

/// Another client that, from 300 ms on, fetches the second half of region `d` (8 MiB, whose
/// bytes are `model`) until `stop`, so that it wants the ring; its fetches, counted.
fn wants_the_ring(
    addr: std::net::SocketAddr,
    model: Vec<u8>,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    let stop = std::sync::Arc::clone(stop);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut c = ring_client(addr).await;
        let h = c.open("d", false).await.unwrap();
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            fetch_matches(&mut c, &h, 4 << 20, 4 << 20, &model).await;
            n += 1;
        }
        c.bye().await.unwrap();
        n
    })
}

/// A sink whose first write blocks for a while (a pipe to a stalled reader, say).
struct StallingSink {
    bytes: Vec<u8>,
    stall: Option<std::time::Duration>,
}

impl std::io::Write for StallingSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if let Some(d) = self.stall.take() {
            std::thread::sleep(d);
        }
        self.bytes.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How the slow reader of [`a_slow_reader_asks_again`] reads.
#[derive(Clone, Copy, PartialEq)]
enum Reader {
    /// `fetch`, into a sink whose first write blocks.
    Sink,
    /// `fetch_many_with_progress` into a registered buffer, with a progress callback whose
    /// first call blocks.
    Batch,
}

/// Three idle clients hold three of the ring's four slots past the 3 s hold limit; a reader
/// of 8 MiB opens with its first chunk lent from the fourth, and blocks for 6 s once that
/// chunk is in (`how`). Its next chunks wait in line until the idle slots are taken back (its
/// own want counts), so they are lent while it blocks and their replies wait unread; meanwhile
/// another client fetches all along and wants the ring, so those slots are due to be taken back
/// too before the reader goes on. The reader gives the late chunks back unread and asks for
/// them again (a READ of them could fail and take its QP down), and gets every byte.
async fn a_slow_reader_asks_again(how: Reader) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;
    let cmb = controller_of("p2plab0");
    let (dev, model) = ssd_with_image(8 << 20, 76);
    let s = hold_server(&format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:4M")).await;
    let idle = holders(s.addr, 1..4).await;
    let mut slow = ring_client(s.addr).await;
    let info = slow.list().await.unwrap().remove(0);
    let lends = ring_lends(&info.reason);
    let buf = slow.buffer(8 << 20).await.unwrap();
    tokio::time::sleep(HOLD + Duration::from_secs(1)).await;
    let h = slow.open_to_fetch("d", 0, 8 << 20).await.unwrap();
    // the other client starts once the slow reader is in line for the ring
    let stop = Arc::new(AtomicBool::new(false));
    let other = wants_the_ring(s.addr, model.clone(), &stop);
    let started = Instant::now();
    let stall = Duration::from_secs(6);
    let (bytes, reasked, zero_copy) = match how {
        Reader::Sink => {
            let mut sink = StallingSink {
                bytes: Vec::new(),
                stall: Some(stall),
            };
            let rep = slow
                .fetch(&h, 0, 8 << 20, &mut sink, true, &mut |_| {})
                .await
                .expect("a fetch whose sink blocked past the hold limit");
            assert!(rep.verified, "{rep:?}");
            (sink.bytes, rep.reasked_chunks, rep.zero_copy_bytes)
        }
        Reader::Batch => {
            let ranges = [p2p_rdma::bridge::BatchRange {
                region: &h,
                offset: 0,
                len: 8 << 20,
                at: 0,
            }];
            let mut first = true;
            let mut progress = |_| {
                if std::mem::take(&mut first) {
                    std::thread::sleep(stall);
                }
            };
            let landed = slow
                .fetch_many_with_progress(&ranges, buf, &mut progress)
                .await
                .expect("a batch whose progress callback blocked past the hold limit");
            assert!(landed.results.iter().all(Result::is_ok), "{landed:?}");
            (
                landed.buffer.as_slice().to_vec(),
                landed.reasked_chunks,
                landed.zero_copy_bytes,
            )
        }
    };
    let took = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let others = other.await.unwrap();
    let taken_back = taken_back(&s);
    eprintln!(
        "{} of 8 MiB in {took:?} (6 s of it blocked): {reasked} chunks asked for again, \
         {zero_copy} bytes zero-copy; {others} fetches of 4 MiB by the other client meanwhile; \
         {taken_back} slots taken back",
        if how == Reader::Sink {
            "fetch"
        } else {
            "batch"
        }
    );
    assert!(bytes == model, "the bytes read differ from the image");
    assert!(others > 0, "the other client fetched nothing");
    if lends {
        assert!(
            reasked > 0,
            "no chunk came late, so this run did not test asking again: the reader's chunks \
             were not lent while it blocked"
        );
        assert!(taken_back >= 3, "{}", s.handle.metrics().encode());
    } else {
        assert_eq!(reasked, 0, "nothing is lent here");
        assert_eq!(taken_back, 0);
    }
    slow.bye().await.unwrap();
    for (c, ..) in idle {
        c.bye().await.unwrap();
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_a_fetch_whose_sink_blocks_asks_again_for_chunks_lent_too_long_ago_to_read() {
    a_slow_reader_asks_again(Reader::Sink).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_a_batch_whose_progress_blocks_asks_again_for_chunks_lent_too_long_ago() {
    a_slow_reader_asks_again(Reader::Batch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_puts_that_want_the_ring_take_back_slots_held_past_the_hold_limit() {
    // as the fetches above, a client's puts want the ring: four idle clients hold its four
    // slots past the 3 s limit, the first put finds no slot and is copied, the slots go back
    // within about a second, and a later put lands in the ring whole. Every byte reaches the
    // SSD, and the holders still get theirs (asked for again)
    let cmb = controller_of("p2plab0");
    let kernel = std::env::var("P2P_LAB_KERNEL").unwrap_or_default();
    let size: u64 = 8 << 20;
    let (dev, mut model) = ssd_with_image(size as usize, 77);
    let s = hold_server(&format!("d=nvme:{dev}:0:8M,via=cmb:{cmb}:4M")).await;
    let taken_back = || taken_back(&s);
    let idle = holders(s.addr, 0..4).await;
    let mut c = ring_client(s.addr).await;
    let info = c.list().await.unwrap().remove(0);
    let lends = ring_lends(&info.reason);
    let lands = kernel != "6.12"
        && ring_nic_leg_expected().0
        && info.reason.contains("CMB → device: peer to peer, verified");
    tokio::time::sleep(HOLD + Duration::from_secs(1)).await;
    assert_eq!(taken_back(), 0, "slots nobody wanted were taken back");
    // puts of 1 MiB into the half the holders do not read, until one lands whole
    let h = c.open("d", true).await.unwrap();
    let mut reps = Vec::new();
    for k in 0..20u64 {
        let off = (4 + k % 4) << 20;
        let rep = put_model(&mut c, &h, off, &data(1 << 20, 100 + k as u32), &mut model).await;
        reps.push(rep.zero_copy_bytes);
        if rep.zero_copy_bytes == 1 << 20 || !(lends && lands) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "puts since the slots were due, zero-copy bytes: {reps:?}; {} slots taken back",
        taken_back()
    );
    assert!(
        dd_direct(&dev, 0, size) == model,
        "the puts are not on the device as put"
    );
    if lends && lands {
        assert_eq!(reps[0], 0, "the first put found every slot held: {reps:?}");
        assert_eq!(
            *reps.last().unwrap(),
            1 << 20,
            "no put landed whole while the four held their slots: {reps:?}"
        );
        // a put lands once one slot is back; the others go back at their next look (each
        // once a second) after the last put that wanted the ring
        let until = std::time::Instant::now() + Duration::from_secs(3);
        while taken_back() < 4 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(taken_back(), 4);
    } else {
        assert!(reps.iter().all(|&z| z == 0), "{reps:?}");
        assert_eq!(taken_back(), 0);
    }
    for (mut ic, ih, i) in idle {
        let rep = fetch_matches(&mut ic, &ih, i << 20, 1 << 20, &model).await;
        assert_eq!(rep.reasked_chunks, u64::from(lends), "{rep:?}");
        ic.bye().await.unwrap();
    }
    c.bye().await.unwrap();
    s.stop().await;
}

/// The server's count of ring slots taken back from region `name`.
fn taken_back_from(s: &Running, name: &str) -> u64 {
    let metrics = s.handle.metrics().encode();
    counter_sum(
        &metrics,
        "p2p_rdma_ring_slots_taken_back_total",
        &format!("region=\"{name}\""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_a_batch_over_two_rings_on_one_connection_loses_only_the_wanted_rings_slots() {
    // regions d and e, each with its own 4 MiB ring in one CMB, on one connection: a batch of
    // 3 MiB of d then 2 MiB of e whose progress callback blocks for 6 s once d's first chunk
    // is in. Three idle clients hold three of d's slots and one holds a slot of e; another
    // client fetches d all along, so d's ring is wanted and e's is not. Past the 3 s limit d's
    // held slots go back (the batch's later chunks of d are lent from them), e's stays lent.
    // The batch's chunks lent while it blocked (d's later ones, and e's first, whose reply
    // comes after theirs) come too late to READ: it gives them back unread, asks for them
    // again and gets every byte, and its connection goes on with both regions
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let cmb = controller_of("p2plab0");
    let (dev, model) = ssd_with_image(16 << 20, 78);
    let s = start(
        &[
            &format!("d=nvme:{dev}:0:8M:ro,via=cmb:{cmb}:4M"),
            &format!("e=nvme:{dev}:8M:8M:ro,via=cmb:{cmb}:4M"),
        ],
        |c| c.ring_hold = HOLD,
    )
    .await;
    let (d_model, e_model) = model.split_at(8 << 20);
    let idle = holders(s.addr, 1..4).await;
    let mut e_holder = ring_client(s.addr).await;
    let e_held = e_holder.open_to_fetch("e", 3 << 20, 1 << 20).await.unwrap();
    let mut slow = ring_client(s.addr).await;
    let infos = slow.list().await.unwrap();
    let lends = infos.iter().all(|i| ring_lends(&i.reason));
    let d = slow.open("d", false).await.unwrap();
    let e = slow.open("e", false).await.unwrap();
    let buf = slow.buffer(5 << 20).await.unwrap();
    // (the holders' slots are due by the time the batch starts: its chunks wait in line for
    // them, and are lent while it blocks)
    tokio::time::sleep(HOLD + Duration::from_secs(1)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let other = wants_the_ring(s.addr, d_model.to_vec(), &stop);
    let ranges = [
        p2p_rdma::bridge::BatchRange {
            region: &d,
            offset: 0,
            len: 3 << 20,
            at: 0,
        },
        p2p_rdma::bridge::BatchRange {
            region: &e,
            offset: 0,
            len: 2 << 20,
            at: 3 << 20,
        },
    ];
    let mut first = true;
    let mut progress = |_| {
        if std::mem::take(&mut first) {
            std::thread::sleep(Duration::from_secs(6));
        }
    };
    let started = std::time::Instant::now();
    let landed = slow
        .fetch_many_with_progress(&ranges, buf, &mut progress)
        .await
        .expect("a batch over two rings whose progress blocked past the hold limit");
    let took = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let others = other.await.unwrap();
    let (from_d, from_e) = (taken_back_from(&s, "d"), taken_back_from(&s, "e"));
    eprintln!(
        "batch of 5 MiB over d and e in {took:?} (6 s of it blocked): {} chunks asked for \
         again, {} bytes zero-copy; {others} fetches of d by the other client; slots taken \
         back: {from_d} of d, {from_e} of e",
        landed.reasked_chunks, landed.zero_copy_bytes
    );
    assert!(landed.results.iter().all(Result::is_ok), "{landed:?}");
    let bytes = landed.buffer.as_slice();
    assert!(bytes[..3 << 20] == d_model[..3 << 20], "d's bytes differ");
    assert!(bytes[3 << 20..] == e_model[..2 << 20], "e's bytes differ");
    assert!(others > 0, "the other client fetched nothing");
    // nobody but its holder wanted e's ring: its slot stays lent
    assert_eq!(from_e, 0, "{}", s.handle.metrics().encode());
    if lends {
        assert!(
            landed.reasked_chunks > 0,
            "no chunk came late, so this run did not test asking again"
        );
        assert!(from_d >= 3, "{}", s.handle.metrics().encode());
    } else {
        assert_eq!(landed.reasked_chunks, 0, "nothing is lent here");
        assert_eq!(from_d, 0);
    }
    // every holder gets its bytes (asked for again: held too long to READ in time, whether
    // taken back or not)
    let rep = fetch_matches(&mut e_holder, &e_held, 3 << 20, 1 << 20, e_model).await;
    assert_eq!(rep.reasked_chunks, u64::from(lends), "{rep:?}");
    e_holder.bye().await.unwrap();
    for (mut ic, ih, i) in idle {
        let rep = fetch_matches(&mut ic, &ih, i << 20, 1 << 20, d_model).await;
        assert_eq!(rep.reasked_chunks, u64::from(lends), "{rep:?}");
        ic.bye().await.unwrap();
    }
    assert_eq!(taken_back_from(&s, "e"), 0);
    // and the batch's connection goes on with both regions, lent whole where the ring lends
    for (h, m) in [(&e, e_model), (&d, d_model)] {
        let rep = fetch_matches(&mut slow, h, 0, 4 << 20, m).await;
        if lends {
            assert_eq!(rep.zero_copy_bytes, 4 << 20, "{rep:?}");
        }
    }
    slow.bye().await.unwrap();
    s.stop().await;
}
