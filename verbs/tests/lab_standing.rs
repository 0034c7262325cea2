//! Lab test of standing windows (`QueuePair::bind_standing`) against rxe: a staging buffer lent
//! to the peer of one QP through a read-only window kept bound while its owner rewrites it, as
//! the server's staging slots are lent to a client for a whole connection.
//!
//! `#[ignore]`d in a plain `cargo test`; `soft-roce/lab` runs it in its guest, where it fails —
//! not skips — when the device named by `P2P_RDMA_DEVICE` is absent.

mod common;

use common::{device, refused_remotely, window_pair};
use verbs::{Access, Error, HostBuffer, Local, ProtectionDomain, RegMode, RegisteredBuffer};

/// A READ destination only local work requests use.
fn local(pd: &ProtectionDomain, len: usize) -> Local {
    Local::owned(
        pd.register(
            HostBuffer::new(len).unwrap(),
            Access::LOCAL_WRITE,
            RegMode::Pinned,
        )
        .unwrap(),
    )
}

/// A staging buffer: registered for windows, no remote access of its own.
fn staging(pd: &ProtectionDomain, len: usize) -> RegisteredBuffer {
    pd.register(
        HostBuffer::new(len).unwrap(),
        Access::LOCAL_WRITE | Access::MW_BIND,
        RegMode::Pinned,
    )
    .unwrap()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_a_standing_window_lends_a_buffer_to_one_qp_across_rewrites() {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    // a: the peer, b: the owner's QP; c, d: another connection on the same PD
    let (a, b) = window_pair(&pd);
    let (c, _d) = window_pair(&pd);
    let mut w = b.bind_standing(staging(&pd, 16384)).await.unwrap();
    assert_eq!((w.len(), w.qpn()), (16384, b.qpn()));
    let rkey = w.rkey();

    // one chunk, then another in its place: the peer reads each, through the same rkey
    for seed in [1u8, 2] {
        let want = pattern(8192, seed);
        w.as_mut_slice()[..8192].copy_from_slice(&want);
        let got = a
            .read(local(&pd, 8192), w.remote(0, 8192).unwrap())
            .await
            .unwrap();
        assert_eq!(got.bytes().unwrap(), &want[..], "chunk {seed}");
        assert_eq!(w.rkey(), rkey, "no bind per chunk");
    }
    // the window covers the buffer and no more
    assert!(w.remote(16000, 1000).is_err());
    // another QP of the same protection domain cannot use it
    refused_remotely(
        c.read(local(&pd, 64), w.remote(0, 64).unwrap()).await,
        "a READ through a standing window from another QP",
    );

    // a buffer with remote access of its own is refused before any bind, and comes back
    let open = pd
        .register(HostBuffer::new(4096).unwrap(), Access::ALL, RegMode::Pinned)
        .unwrap();
    let e = b.bind_standing(open).await.expect_err("an open buffer");
    assert!(
        matches!(e.error, Error::InvalidArgument(_)),
        "{:?}",
        e.error
    );
    assert!(e.buf.is_some(), "the buffer comes back");

    // taken back: the window is revoked, the buffer holds the last bytes
    let remote = w.remote(0, 64).unwrap();
    let back = w.into_buffer().expect("nothing else holds the buffer");
    assert_eq!(&back.to_vec()[..8192], &pattern(8192, 2)[..]);
    refused_remotely(
        a.read(local(&pd, 64), remote).await,
        "a READ through a revoked standing window",
    );
}
