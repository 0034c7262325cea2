//! Lab tests of remote access to registered buffers and memory windows against rxe: remotely
//! writable buffers are only copied, a window's buffer is filled only while no window is
//! bound, and each QP gets its own revocable rkey.
//!
//! They need an RDMA device, so they are `#[ignore]`d in a plain `cargo test`; `soft-roce/lab`
//! runs them inside its QEMU guest (`.ci/run` does so on both kernels) with `--ignored`, and
//! they fail — not skip — when the device named by `P2P_RDMA_DEVICE` is absent.

use std::sync::Arc;

use verbs::{Access, Error, HostBuffer, Local, ProtectionDomain, QpOptions, QueuePair, RegMode};

mod common;
use common::{buf, device, fill, local, pair, refused_remotely, window_pair};

#[tokio::test]
#[ignore = "lab"]
async fn lab_remotely_writable_buffers_are_copied_never_borrowed() {
    let p = pair();
    let mut target = buf(&p.pd, 8192);
    assert!(target.remotely_writable());
    // a reference would promise bytes that a remote peer may change under it
    let t = std::panic::AssertUnwindSafe(&target);
    let borrowed = std::panic::catch_unwind(|| t.as_slice().len());
    assert!(
        borrowed.is_err(),
        "as_slice of a REMOTE_WRITE buffer must refuse"
    );
    // copies work, bounds are checked
    target.write_at(100, b"hello").unwrap();
    let mut out = [0u8; 5];
    target.read_at(100, &mut out).unwrap();
    assert_eq!(&out, b"hello");
    assert!(matches!(
        target.read_at(8190, &mut out),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(target.write_at(usize::MAX, b"x").is_err());
    // a remote WRITE lands and is seen through a copy; Local::bytes offers no borrow of it
    let mut src = local(&p.pd, 4096);
    assert!(!src.remotely_writable());
    fill(src.as_mut_slice(), 9);
    let want = src.as_slice().to_vec();
    p.a.write(Local::owned(src), target.mr().remote(4096..8192).unwrap())
        .await
        .unwrap();
    assert_eq!(&target.to_vec()[4096..], &want[..]);
    assert!(Local::owned(target).bytes().is_none());
}

/// A staging buffer registered for windows: the CPU fills it while it is exclusively owned
/// (no window can be bound then), a read-only window lends it to one peer, and it is
/// exclusively owned again once the window is gone.
#[tokio::test]
#[ignore = "lab"]
async fn lab_a_window_buffer_is_filled_only_while_no_window_is_bound() {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let mut staging = pd
        .register(
            HostBuffer::new(16384).unwrap(),
            Access::LOCAL_WRITE | Access::MW_BIND,
            RegMode::Pinned,
        )
        .unwrap();
    assert!(staging.remotely_writable(), "a window could grant writes");
    fill(staging.as_mut_slice(), 3);
    let want = staging.to_vec();
    let shared = Arc::new(staging);
    // shared: no borrow of its bytes
    let t = std::panic::AssertUnwindSafe(&shared);
    assert!(std::panic::catch_unwind(|| t.as_slice().len()).is_err());
    let (a, b) = window_pair(&pd);
    let w = b
        .bind_window(shared.clone(), 0..8192, Access::REMOTE_READ)
        .await
        .unwrap();
    let got = a
        .read(Local::owned(local(&pd, 8192)), w.remote())
        .await
        .unwrap();
    assert_eq!(got.bytes().unwrap(), &want[..8192]);
    // read-only: a WRITE through it is refused
    refused_remotely(
        a.write(
            Local::owned(local(&pd, 64)),
            w.remote().slice(0, 64).unwrap(),
        )
        .await,
        "a WRITE through a read-only staging window",
    );
    // the window holds the buffer: it cannot be taken back for filling
    let shared = Arc::try_unwrap(shared).expect_err("a bound window holds the buffer");
    drop(w);
    let mut again = Arc::try_unwrap(shared).expect("no window once it is dropped");
    fill(again.as_mut_slice(), 4);
    assert_ne!(again.to_vec(), want);
    // a buffer whose own registration grants remote writes is never lent
    let mut open = buf(&pd, 4096);
    let t = std::panic::AssertUnwindSafe(&mut open);
    assert!(std::panic::catch_unwind(move || {
        let t = t;
        t.0.as_mut_slice().len()
    })
    .is_err());
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_memory_windows_give_each_qp_its_own_revocable_rkey() {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let mut mem = HostBuffer::new(64 << 10).unwrap();
    fill(mem.as_mut_slice(), 7);
    let want = mem.as_slice().to_vec();
    // one registration, no remote access of its own
    let region = Arc::new(
        pd.register(mem, Access::LOCAL_WRITE | Access::MW_BIND, RegMode::Pinned)
            .unwrap(),
    );
    let (a, b) = window_pair(&pd);
    // a window bound on b serves requests that arrive on b (sent by a)
    let w = b
        .bind_window(
            region.clone(),
            4096..20480,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .await
        .unwrap();
    assert_eq!((w.addr(), w.len()), (region.mr().addr() + 4096, 16384));
    assert_ne!(w.rkey(), region.mr().rkey());
    let got = a
        .read(Local::owned(local(&pd, 16384)), w.remote())
        .await
        .unwrap();
    assert_eq!(got.bytes().unwrap(), &want[4096..20480]);
    let mut src = local(&pd, 100);
    src.as_mut_slice().fill(0xab);
    a.write(Local::owned(src), w.remote().slice(10, 100).unwrap())
        .await
        .unwrap();
    let now = region.to_vec();
    assert!(now[4106..4206].iter().all(|&x| x == 0xab));
    assert_eq!(now[..4106], want[..4106]);
    // a second window on the same region for another peer: both work at once
    let (c, d) = window_pair(&pd);
    let w2 = d
        .bind_window(region.clone(), 0..4096, Access::REMOTE_READ)
        .await
        .unwrap();
    let got = c
        .read(Local::owned(local(&pd, 4096)), w2.remote())
        .await
        .unwrap();
    assert_eq!(got.bytes().unwrap(), &want[..4096]);
    // the other peer cannot use the first window's rkey (it is bound to b, not d)
    let stolen = verbs::RemoteSlice {
        len: 64,
        ..w.remote()
    };
    refused_remotely(
        c.read(Local::owned(local(&pd, 64)), stolen).await,
        "a window's rkey on another QP",
    );
    // nor write through its own read-only window
    let (e, f) = window_pair(&pd);
    let ro = f
        .bind_window(region.clone(), 0..4096, Access::REMOTE_READ)
        .await
        .unwrap();
    refused_remotely(
        e.write(
            Local::owned(local(&pd, 64)),
            ro.remote().slice(0, 64).unwrap(),
        )
        .await,
        "a write through a read-only window",
    );
    // the region's own rkey opens nothing
    let (g, h) = window_pair(&pd);
    let raw = region.mr().remote(0..64).unwrap();
    refused_remotely(
        g.read(Local::owned(local(&pd, 64)), raw).await,
        "the MR's own rkey",
    );
    // beyond the window's range. rxe checks a window's rkey, QP, rights and state, but the
    // range only against the MR under it (LAB.md): the server binds every window over its
    // whole registration, so the MR's bound is the window's. Past the MR: refused.
    let (i, j) = window_pair(&pd);
    let whole = j
        .bind_window(region.clone(), 0..(64 << 10), Access::REMOTE_READ)
        .await
        .unwrap();
    let beyond = verbs::RemoteSlice {
        addr: whole.addr() + (64 << 10) - 32,
        len: 64,
        rkey: whole.rkey(),
    };
    refused_remotely(
        i.read(Local::owned(local(&pd, 64)), beyond).await,
        "beyond the region",
    );
    // dropping a window revokes its rkey at once
    let old = w.remote();
    drop(w);
    refused_remotely(
        a.read(
            Local::owned(local(&pd, 64)),
            verbs::RemoteSlice { len: 64, ..old },
        )
        .await,
        "a dropped window",
    );
    drop((h, whole));
    // refusals before anything is posted
    let plain = QueuePair::new(&pd, QpOptions::default()).unwrap();
    let e1 = plain
        .bind_window(region.clone(), 0..64, Access::REMOTE_READ)
        .await
        .unwrap_err();
    assert!(e1.to_string().contains("without memory windows"), "{e1}");
    let unbindable = Arc::new(buf(&pd, 4096));
    let e2 = b
        .bind_window(unbindable, 0..64, Access::REMOTE_READ)
        .await
        .unwrap_err();
    assert!(e2.to_string().contains("MW_BIND"), "{e2}");
    let e3 = b
        .bind_window(region.clone(), 0..(1 << 20), Access::REMOTE_READ)
        .await
        .unwrap_err();
    assert!(matches!(e3, Error::OutOfBounds { .. }), "{e3}");
    let other_pd = ProtectionDomain::new(&ctx).unwrap();
    let foreign = Arc::new(
        other_pd
            .register(
                HostBuffer::new(4096).unwrap(),
                Access::MW_BIND,
                RegMode::Pinned,
            )
            .unwrap(),
    );
    let e4 = b
        .bind_window(foreign, 0..64, Access::REMOTE_READ)
        .await
        .unwrap_err();
    assert!(e4.to_string().contains("protection domain"), "{e4}");
    drop((ro, w2, d, f));
}
