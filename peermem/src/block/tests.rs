use super::*;

/// A file of `len` patterned bytes in a directory whose file system takes O_DIRECT.
fn image(len: usize) -> (tempdir::Dir, PathBuf, Vec<u8>) {
    let dir = tempdir::Dir::new();
    let path = dir.0.join("ns.img");
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    (dir, path, bytes)
}

mod tempdir {
    /// A scratch directory under the target directory (on the build's file system, which
    /// takes O_DIRECT; tmpfs does not), removed on drop.
    pub(super) struct Dir(pub(super) std::path::PathBuf);
    impl Dir {
        pub(super) fn new() -> Dir {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/block-tests")
                .join(format!(
                    "{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::SeqCst)
                ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn open(path: &Path, range: Option<(u64, u64)>, writable: bool) -> BlockStorage {
    BlockStorage::open(
        path,
        range,
        writable,
        None,
        PIECE,
        Path::new("/nonexistent-sysfs"),
    )
    .unwrap_or_else(|e| {
        panic!(
            "{}: this test needs a file system that takes O_DIRECT: {e}",
            path.display()
        )
    })
}

#[test]
fn reads_any_range_aligned_or_not() {
    let (_d, path, bytes) = image(3 << 20);
    let b = open(&path, None, false);
    assert_eq!(b.len(), 3 << 20);
    assert!(b.mapping().is_none() && b.holds_data());
    for (off, len) in [
        (0, 4096),
        (1, 10),
        (4095, 2),
        (100_000, 1_500_000),
        (0, 3 << 20),
        ((3 << 20) - 1, 1),
    ] {
        let mut out = vec![0; len];
        b.copy_out(off as u64, &mut out).unwrap();
        assert_eq!(out, bytes[off..off + len], "{off}+{len}");
    }
    // straight into an aligned buffer: no bounce of its own
    let mut aligned = HostBuffer::new(1 << 20).unwrap();
    b.copy_out(1 << 20, aligned.as_mut_slice()).unwrap();
    assert_eq!(aligned.as_slice(), &bytes[1 << 20..2 << 20]);
    let e = b.copy_out((3 << 20) - 1, &mut [0; 2]).unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    let e = b.copy_in(0, &[1]).unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    assert!(b.residency().unwrap().contains("device → host"));
    assert!(b.moved()[2] >= 3 << 20);
}

#[test]
fn a_range_of_the_device_is_the_region() {
    let (_d, path, bytes) = image(1 << 20);
    let b = open(&path, Some((65536, 131072)), false);
    assert_eq!(b.len(), 131072);
    let mut out = vec![0; 100];
    b.copy_out(131072 - 100, &mut out).unwrap();
    assert_eq!(out, bytes[65536 + 131072 - 100..65536 + 131072]);
    assert!(b.copy_out(131072 - 99, &mut out).is_err());
    for bad in [(1, 4096), (0, 4097), (1 << 20, 4096), (0, 0)] {
        let e =
            BlockStorage::open(&path, Some(bad), false, None, PIECE, Path::new("/x")).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
    }
}

#[test]
fn writes_patch_partial_blocks_and_keep_their_neighbours() {
    let (_d, path, mut model) = image(1 << 20);
    let b = open(&path, None, true);
    let writes: &[(usize, usize)] = &[
        (0, 4096),
        (1, 1),
        (4000, 200),
        (8191, 4098),
        (65536, 300_000),
        ((1 << 20) - 3, 3),
    ];
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|j| (j as u8) ^ (0xa5 + i as u8)).collect();
        b.copy_in(off as u64, &data).unwrap();
        model[off..off + len].copy_from_slice(&data);
    }
    b.sync(0, 1 << 20).unwrap();
    let mut out = vec![0; 1 << 20];
    b.copy_out(0, &mut out).unwrap();
    assert!(out == model, "the device differs from the model");
    assert_eq!(std::fs::read(&path).unwrap(), model);
}

#[test]
fn concurrent_puts_that_share_a_block_lose_nothing() {
    let (_d, path, mut model) = image(64 << 10);
    let b = Arc::new(open(&path, None, true));
    // 16 writers, each owning 256 interleaved bytes of the same four blocks
    let hs: Vec<_> = (0..16u8)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                for round in 0..20u8 {
                    for blk in 0..4u64 {
                        let at = blk * 4096 + t as u64 * 256;
                        b.copy_in(at, &[t ^ round; 256]).unwrap();
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    for t in 0..16usize {
        for blk in 0..4 {
            let at = blk * 4096 + t * 256;
            model[at..at + 256].fill(t as u8 ^ 19);
        }
    }
    let mut out = vec![0; 64 << 10];
    b.copy_out(0, &mut out).unwrap();
    assert!(out == model, "a writer's bytes were lost");
}

#[test]
fn a_cmb_that_cannot_be_had_leaves_host_staging_and_says_why() {
    let (_d, path, bytes) = image(1 << 20);
    let via = ViaCmb {
        device: "nvme9".into(),
        size: 4 << 20,
    };
    let sysfs = tempdir::Dir::new();
    let b = BlockStorage::open(&path, None, true, Some(&via), PIECE, &sysfs.0).unwrap();
    let plan = b.legs_plan();
    assert!(
        plan.contains("no CMB staging ring") && plan.contains("nvme9"),
        "{plan}"
    );
    assert!(b
        .no_mapping_reason()
        .unwrap()
        .contains("a NIC cannot address block storage"));
    let mut out = vec![0; 5000];
    b.copy_out(3, &mut out).unwrap();
    assert_eq!(out, bytes[3..5003]);
    assert_eq!(b.moved()[0], 0, "nothing went through a CMB");
}

#[test]
fn what_is_not_storage_is_refused_with_the_reason() {
    let e = BlockStorage::open(
        Path::new("/nonexistent/ns"),
        None,
        false,
        None,
        PIECE,
        Path::new("/sys"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("open(O_DIRECT)"), "{e}");
    let e = BlockStorage::open(
        Path::new("/dev/null"),
        None,
        false,
        None,
        PIECE,
        Path::new("/sys"),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("neither a block device nor a regular file")
            || e.to_string().contains("O_DIRECT"),
        "{e}"
    );
}

#[test]
fn requests_are_cut_at_piece_boundaries_of_the_device() {
    let (_d, path, _) = image(4 << 20);
    let b = open(&path, Some((4096, 3 << 20)), false);
    let p = b.pieces(4095, (2 << 20) + 10);
    let starts: Vec<u64> = p.iter().map(|(at, _)| *at).collect();
    // device offsets 8191.. cut at 1 MiB and 2 MiB of the device
    assert_eq!(starts, [8191, 1 << 20, 2 << 20]);
    assert_eq!(p[0].1, 0..(1 << 20) - 8191);
    assert_eq!(p.last().unwrap().1.end, (2 << 20) + 10);
    for w in p.windows(2) {
        assert_eq!(w[0].1.end, w[1].1.start);
    }
    for (at, r) in &p {
        let (a0, a1) = b.cover(*at, r.len() as u64);
        assert!(a1 - a0 <= PIECE, "{at}+{}", r.len());
    }
}

/// A stand-in sysfs with one PCI device publishing `size` bytes of p2pmem, whose `allocate`
/// is a plain file (an mmap of it is ordinary shared memory): the ring's logic, without a CMB.
fn fake_p2pmem(size: u64) -> tempdir::Dir {
    let root = tempdir::Dir::new();
    let dir = root.0.join("bus/pci/devices/0000:03:00.0/p2pmem");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("size"), format!("{size}\n")).unwrap();
    std::fs::write(dir.join("available"), format!("{size}\n")).unwrap();
    std::fs::write(dir.join("published"), "1\n").unwrap();
    let f = std::fs::File::create(dir.join("allocate")).unwrap();
    f.set_len(size).unwrap();
    root
}

/// An image of `len` bytes served (`writable` or not) through a ring of `ring` bytes in a
/// [`fake_p2pmem`]: the directories to keep, the image's path and bytes, the region.
fn with_ring(
    len: usize,
    ring: u64,
    writable: bool,
) -> ((tempdir::Dir, tempdir::Dir), PathBuf, Vec<u8>, BlockStorage) {
    let (d, path, bytes) = image(len);
    let sysfs = fake_p2pmem(ring);
    let via = ViaCmb {
        device: "0000:03:00.0".into(),
        size: ring,
    };
    // (no chunk size: eight slots)
    let b = BlockStorage::open(&path, None, writable, Some(&via), 0, &sysfs.0).unwrap();
    ((d, sysfs), path, bytes, b)
}

#[test]
fn ring_slots_are_at_least_the_chunks_lent_where_the_ring_holds_one() {
    let slots = |ring: u64, chunk: u64| {
        let (d, path, _) = image(4 << 20);
        let sysfs = fake_p2pmem(ring);
        let via = ViaCmb {
            device: "0000:03:00.0".into(),
            size: ring,
        };
        let b = BlockStorage::open(&path, None, true, Some(&via), chunk, &sysfs.0).unwrap();
        let r = b.via.as_ref().unwrap();
        let n = lock(&r.free).len() as u64;
        drop((d, sysfs));
        (n, r.slot)
    };
    // eight slots where they hold a chunk, up to 1 MiB each
    assert_eq!(slots(8 << 20, 1 << 20), (8, 1 << 20));
    assert_eq!(slots(2 << 20, 256 << 10), (8, 256 << 10));
    assert_eq!(slots(16 << 20, 1 << 20), (16, 1 << 20));
    // fewer, of a chunk each, where eight would be too short for one
    assert_eq!(slots(4 << 20, 1 << 20), (4, 1 << 20));
    assert_eq!(slots(2 << 20, 1 << 20), (2, 1 << 20));
    assert_eq!(slots(4 << 20, 3 << 20), (1, 3 << 20));
    // (a chunk longer than the ring: eight slots, which lend the shorter chunks)
    assert_eq!(slots(1 << 20, 2 << 20), (8, 128 << 10));
    // a 1 MiB chunk is lent from a 4 MiB ring, and the legs say what the ring is
    let (d, path, _) = image(4 << 20);
    let sysfs = fake_p2pmem(4 << 20);
    let via = ViaCmb {
        device: "0000:03:00.0".into(),
        size: 4 << 20,
    };
    let b = BlockStorage::open(&path, None, false, Some(&via), 1 << 20, &sysfs.0).unwrap();
    assert!(b.lend_slot(1 << 20, 1 << 20, true).unwrap().is_some());
    assert!(
        b.legs_plan()
            .starts_with("a ring of 4 slots of 1024 KiB; device → CMB: "),
        "{}",
        b.legs_plan()
    );
    drop((d, sysfs));
}

#[test]
fn copies_go_by_direct_io_through_host_memory_never_through_a_ring_slot() {
    let (_dirs, path, mut model, b) = with_ring(4 << 20, 2 << 20, true);
    let plan = b.legs_plan();
    assert!(
        plan.contains("device → CMB: peer to peer, verified")
            && plan.contains("CMB → device: peer to peer, verified")
            && plan.contains(&format!("CMB → NIC: not tried: {FETCH_STAGED}"))
            && plan.contains(&format!("NIC → CMB: not tried: {PUT_STAGED}")),
        "{plan}"
    );
    assert!(b.ring().is_some());
    // both legs to the CMB proved, and still the copies (unaligned, aligned, longer than a
    // slot) go between the device and host memory: a CPU copy out of a slot would cross host
    // memory all the same, after a detour through the device's BAR
    for (off, len) in [
        (1usize, 3 << 20),
        (4095, 300_000),
        (0, 4096),
        ((4 << 20) - 7, 7),
    ] {
        let mut out = vec![0; len];
        b.copy_out(off as u64, &mut out).unwrap();
        assert!(out == model[off..off + len], "{off}+{len}");
    }
    for (i, (off, len)) in [(5000usize, 700_001usize), (1 << 20, 1 << 20), (3, 2)]
        .into_iter()
        .enumerate()
    {
        let d: Vec<u8> = (0..len).map(|j| (j * 3 + i) as u8).collect();
        b.copy_in(off as u64, &d).unwrap();
        model[off..off + len].copy_from_slice(&d);
    }
    assert_eq!(std::fs::read(&path).unwrap(), model);
    let [dc, cd, dh, hd, cn, nc] = b.moved();
    assert!(dh > 3 << 20 && hd > 1 << 20, "{:?}", b.moved());
    assert_eq!(
        (dc, cd, cn, nc),
        (0, 0, 0, 0),
        "nothing went through the ring"
    );
    let ring = b.via.as_ref().unwrap();
    assert_eq!(lock(&ring.free).len() as u64, (2 << 20) / ring.slot);
}

#[test]
fn a_ring_no_chunk_can_go_through_is_given_back_to_the_cmb() {
    // the NIC reads slots and the device's read leg holds: kept
    let (_dirs, _, _, b) = with_ring(1 << 20, 1 << 20, true);
    assert!(b.set_nic_legs(("reads".into(), "puts".into()), (true, false)));
    assert!(b.ring().is_some() && b.free_slots() > 0);
    assert!(!b.legs_plan().contains("given back"), "{}", b.legs_plan());
    // the NIC lands puts and the device's write leg holds: kept too
    let (_dirs, _, _, b) = with_ring(1 << 20, 1 << 20, true);
    assert!(b.set_nic_legs(("reads".into(), "puts".into()), (false, true)));
    assert!(b.ring().is_some());
    // the NIC reaches the ring neither way: given back, and every chunk still moves
    let (dirs, path, mut model, b) = with_ring(1 << 20, 1 << 20, true);
    let ring = b.ring().unwrap();
    let lent = b.lend_slot(0, 4096, true).unwrap().unwrap();
    let landing = b.lend_slot_for_put(0, 4096, true).unwrap().unwrap();
    assert!(!b.set_nic_legs(("cannot".into(), "cannot".into()), (false, false)));
    // a put's slot from before is not written to the device from a ring given back
    let e = b.commit_slot(&landing, 0).unwrap_err().to_string();
    assert!(
        e.contains("given back to the CMB: write the chunk through host staging"),
        "{e}"
    );
    drop(landing);
    assert!(
        b.ring().is_none(),
        "the ring's memory is no longer handed out"
    );
    assert_eq!((b.free_slots(), b.ring_slots()), (0, Some(8)));
    assert!(b.lend_slot(0, 4096, true).unwrap().is_none());
    assert!(b.lend_slot_for_put(0, 4096, true).unwrap().is_none());
    // a lease from before holds its slot, and gives it back to a ring that takes none
    drop(lent);
    assert!(b.lend_slot(0, 4096, true).unwrap().is_none());
    assert_eq!(b.free_slots(), 0);
    assert!(
        b.legs_plan().starts_with(
            "a ring of 8 slots of 128 KiB, given back to the CMB (no chunk can go through it: the \
             NIC reaches it neither way"
        ),
        "{}",
        b.legs_plan()
    );
    assert!(b
        .describe()
        .contains("its ring of 1048576 bytes given back to the CMB of 0000:03:00.0"));
    let mut out = vec![0; 300_000];
    b.copy_out(4095, &mut out).unwrap();
    assert!(out == model[4095..304_095]);
    let d = vec![7u8; 5000];
    b.copy_in(100, &d).unwrap();
    model[100..5100].copy_from_slice(&d);
    assert_eq!(std::fs::read(&path).unwrap(), model);
    // the caller's clone of the memory is the last one: once dropped, the CMB has it again
    assert_eq!(Arc::strong_count(&ring), 1);
    drop((ring, dirs));
}

#[test]
fn a_lent_slot_holds_the_chunk_until_the_lease_ends() {
    let (_dirs, _, model, b) = with_ring(4 << 20, 2 << 20, false);
    let ring = b.ring().unwrap();
    let slot = b.via.as_ref().unwrap().slot;
    assert_eq!(
        (slot, slot % PAGE),
        (256 << 10, 0),
        "a whole number of pages"
    );
    let free = || lock(&b.via.as_ref().unwrap().free).len() as u64;
    let slots = free();
    // a chunk that starts on a page, one that starts on a block only, and the region's end
    let mut leases = Vec::new();
    for (off, len, page_start) in [
        (8192u64, 100_000u64, true),
        (512, 4096, false),
        ((4 << 20) - 4096, 4096, true),
    ] {
        let l = b.lend_slot(off, len, page_start).unwrap().unwrap();
        assert_eq!(l.range.end - l.range.start, len);
        let block = b.block_size();
        assert_eq!(
            l.range.start % slot,
            off % block,
            "the chunk's place in its slot"
        );
        if page_start {
            assert_eq!(l.range.start % PAGE, 0);
        }
        let mut got = vec![0; len as usize];
        ring.copy_out(l.range.start, &mut got).unwrap();
        assert!(
            got == model[off as usize..(off + len) as usize],
            "{off}+{len}"
        );
        leases.push(l);
    }
    assert_eq!(free(), slots - 3, "each lease holds its slot");
    // not lent: mid-page where only page starts were proved, or blocks longer than a slot
    assert!(b.lend_slot(512, 4096, true).unwrap().is_none());
    assert!(b.lend_slot(100, 4096, true).unwrap().is_none());
    assert!(b.lend_slot(512, slot, false).unwrap().is_none());
    // a range past the end is an error, not a lease
    assert!(b.lend_slot(4 << 20, 1, false).is_err());
    // the ring runs dry: no lease, nothing blocks
    while let Some(l) = b.lend_slot(0, 4096, true).unwrap() {
        leases.push(l);
    }
    assert_eq!(free(), 0);
    let mut out = vec![0; 10_000];
    b.copy_out(77, &mut out).unwrap();
    assert_eq!(
        out,
        model[77..10_077],
        "copies go through host memory meanwhile"
    );
    let lent: u64 = leases.iter().map(|l| l.range.end - l.range.start).sum();
    drop(leases);
    assert_eq!(free(), slots, "every slot came back");
    let [dc, _, dh, _, cn, _] = b.moved();
    assert_eq!(cn, lent);
    assert!(dc >= lent && dh > 0, "{:?}", b.moved());
    assert!(b.residency().unwrap().contains("CMB → NIC"));
}

#[test]
fn a_read_only_region_never_tries_the_write_leg() {
    let (_dirs, path, bytes, b) = with_ring(1 << 20, 1 << 20, false);
    assert!(b
        .legs_plan()
        .contains("CMB → device: through host memory (the region is read-only)"));
    let mut out = vec![0; 10_000];
    b.copy_out(77, &mut out).unwrap();
    assert_eq!(out, bytes[77..10_077]);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "the device was not written"
    );
}

#[test]
fn a_put_lands_in_a_slot_and_reaches_the_device_only_when_committed() {
    let (_dirs, path, mut model, b) = with_ring(4 << 20, 2 << 20, true);
    assert_eq!(b.ring_put_leg(), Ok(()));
    let ring = b.ring().unwrap();
    let slot = b.via.as_ref().unwrap().slot;
    let free = || lock(&b.via.as_ref().unwrap().free).len() as u64;
    let slots = free();
    // whole blocks: a slot, from its start (a page)
    let l = b.lend_slot_for_put(8192, 3 * 4096, true).unwrap().unwrap();
    assert_eq!(
        (l.range.start % slot, l.range.end - l.range.start),
        (0, 3 * 4096)
    );
    assert_eq!(free(), slots - 1);
    // the NIC's write into the slot (here, the CPU's) changes nothing on the device yet
    let d: Vec<u8> = (0..3 * 4096).map(|j| (j * 7 + 1) as u8).collect();
    ring.copy_in(l.range.start, &d).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        model,
        "written before the commit"
    );
    b.commit_slot(&l, 8192).unwrap();
    model[8192..8192 + d.len()].copy_from_slice(&d);
    assert_eq!(std::fs::read(&path).unwrap(), model);
    drop(l);
    assert_eq!(free(), slots, "the slot came back with its lease");
    let [_, cd, _, hd, _, nc] = b.moved();
    assert_eq!((nc, cd, hd), (3 * 4096, 3 * 4096, 0), "{:?}", b.moved());
    assert!(b.residency().unwrap().contains("NIC → CMB 0.0 MiB"));
    // not lent: a chunk that starts partway into a block where the NIC lands only from page
    // starts (it would land partway into the slot's first page), one whose blocks are longer
    // than a slot; an error past the end. Lent: one that ends partway into a block
    let block = b.block_size();
    assert!(b
        .lend_slot_for_put(block / 2, block, true)
        .unwrap()
        .is_none());
    assert!(b.lend_slot_for_put(0, slot + 1, false).unwrap().is_none());
    assert!(b.lend_slot_for_put(1, slot, false).unwrap().is_none());
    let l = b.lend_slot_for_put(0, block + 1, true).unwrap().unwrap();
    assert_eq!(l.range.end - l.range.start, block + 1);
    drop(l);
    assert!(b.lend_slot_for_put(4 << 20, block, true).is_err());
    // a slot of another region's ring is refused, and so is a range past the end
    let (_d2, _, _, other) = with_ring(1 << 20, 1 << 20, true);
    let foreign = other.lend_slot_for_put(0, 4096, true).unwrap().unwrap();
    let e = b.commit_slot(&foreign, 0).unwrap_err().to_string();
    assert!(e.contains("not one of this region's ring"), "{e}");
    let l = b.lend_slot_for_put(0, 8192, true).unwrap().unwrap();
    let e = b.commit_slot(&l, (4 << 20) - 4096).unwrap_err().to_string();
    assert!(e.contains("is outside the 4194304-byte region"), "{e}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        model,
        "a refused commit writes nothing"
    );
}

#[test]
fn a_put_that_lands_waits_for_a_slot_only_while_every_slot_is_lent() {
    let (_dirs, _, _, b) = with_ring(4 << 20, 1 << 20, true);
    let slot = b.via.as_ref().unwrap().slot;
    let block = b.block_size();
    let mut held = Vec::new();
    while let Some(l) = b.lend_slot_for_put(0, slot, true).unwrap() {
        held.push(l);
    }
    assert_eq!(held.len() as u64, (1 << 20) / slot, "every slot lent once");
    // the chunk is still one the ring takes: the caller waits for a lease to come back
    assert!(b.put_lands(0, slot, true).unwrap());
    assert!(b.lend_slot_for_put(0, slot, true).unwrap().is_none());
    held.pop();
    assert!(b.lend_slot_for_put(0, slot, true).unwrap().is_some());
    // never: starting partway into a block where the NIC lands only from page starts,
    // longer than a slot, empty; an error past the end. Partly covered blocks anywhere else
    assert!(!b.put_lands(block / 2, block, true).unwrap());
    assert!(b.put_lands(block / 2, block, false).unwrap());
    assert!(b.put_lands(0, block / 2, true).unwrap());
    assert!(!b.put_lands(0, slot + block, true).unwrap());
    assert!(!b.put_lands(0, 0, true).unwrap());
    assert!(b.put_lands(4 << 20, block, true).is_err());
}

#[test]
fn a_read_only_region_or_one_without_a_ring_lends_no_slot_for_puts() {
    let (_dirs, _, _, b) = with_ring(1 << 20, 1 << 20, false);
    assert_eq!(b.ring_put_leg(), Err("the region is read-only".to_string()));
    assert!(b.lend_slot_for_put(0, 4096, true).unwrap().is_none());
    assert!(!b.put_lands(0, 4096, true).unwrap());
    let (_d, path, _) = image(1 << 20);
    let plain = open(&path, None, true);
    assert!(plain.ring_put_leg().is_err());
    assert!(plain.lend_slot_for_put(0, 4096, true).unwrap().is_none());
    assert!(!plain.put_lands(0, 4096, true).unwrap());
}

#[test]
fn a_put_that_covers_blocks_partly_lands_and_its_commit_keeps_their_other_bytes() {
    let (_dirs, path, mut model, b) = with_ring(4 << 20, 2 << 20, true);
    let ring = b.ring().unwrap();
    let block = b.block_size();
    // from 100 bytes into a block to 100 bytes into the fourth: two partly covered blocks
    let (offset, len) = (block + 100, 3 * block);
    let l = b.lend_slot_for_put(offset, len, false).unwrap().unwrap();
    let slot = l.range.start - 100;
    assert_eq!(l.range.end - l.range.start, len);
    // the slot holds another put's bytes from before; the NIC's write lands among them
    ring.copy_in(slot, &vec![0xee; 4 * block as usize]).unwrap();
    let d: Vec<u8> = (0..len).map(|j| (j * 13 + 5) as u8).collect();
    ring.copy_in(l.range.start, &d).unwrap();
    // a put beside it, into the same first block, between the landing and the commit
    let side = [9u8; 40];
    b.copy_in(block + 20, &side).unwrap();
    let at = (block + 20) as usize;
    model[at..at + side.len()].copy_from_slice(&side);
    let before = b.moved();
    b.commit_slot(&l, offset).unwrap();
    let o = offset as usize;
    model[o..o + d.len()].copy_from_slice(&d);
    assert!(
        std::fs::read(&path).unwrap() == model,
        "the landed bytes and every other byte of their blocks"
    );
    let after = b.moved();
    let delta: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    // [device → CMB, CMB → device, device → host, host → device, CMB → NIC, NIC → CMB]
    assert_eq!(
        delta,
        [0, 4 * block, 2 * block, 0, 0, len],
        "only the two edge blocks' bytes from the device crossed host memory"
    );
    // a commit at an offset whose bytes fall elsewhere in their blocks is refused
    let e = b.commit_slot(&l, offset + 1).unwrap_err().to_string();
    assert!(e.contains("not where the slot has them"), "{e}");
    assert!(
        std::fs::read(&path).unwrap() == model,
        "a refused commit writes nothing"
    );
    drop(l);
    // a chunk inside one block: its one block, completed on both sides
    let l = b.lend_slot_for_put(7, 9, false).unwrap().unwrap();
    ring.copy_in(l.range.start, &[1; 9]).unwrap();
    b.commit_slot(&l, 7).unwrap();
    model[7..16].copy_from_slice(&[1; 9]);
    assert!(std::fs::read(&path).unwrap() == model);
}
