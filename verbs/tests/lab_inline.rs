//! Lab test of inline data (`Local::Inline`, `QpOptions::max_inline_data`) against rxe: small
//! SENDs and WRITEs whose bytes travel inside the work request, with no registered buffer.
//!
//! `#[ignore]`d in a plain `cargo test`; `soft-roce/lab` runs it in its guest, where it fails —
//! not skips — when the device named by `P2P_RDMA_DEVICE` is absent.

use verbs::{Error, Local, ProtectionDomain, QpOptions, QpState, QueuePair};

mod common;
use common::{buf, device, local};

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_inline_sends_and_writes_need_no_registered_buffer() {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let opts = QpOptions {
        max_inline_data: 256,
        ..QpOptions::default()
    };
    let (a, b) = QueuePair::loopback_pair(&pd, opts).unwrap();
    let bytes = pattern(256);

    // SEND: the receiver gets the bytes, though no MR of the sender holds them
    let rbuf = local(&pd, 4096);
    let recv = b.post_recv(vec![Local::owned(rbuf)]).unwrap();
    a.send(Local::inline(&bytes[..200]), Some(9)).await.unwrap();
    let (r, info) = recv.wait().await.unwrap().pop().unwrap();
    assert_eq!((info.byte_len, info.imm), (200, Some(9)));
    assert_eq!(&r.bytes().unwrap()[..200], &bytes[..200]);

    // WRITE: at the largest inline size the QP was created for
    let target = buf(&pd, 4096);
    a.write(Local::inline(&bytes), target.mr().remote(100..356).unwrap())
        .await
        .unwrap();
    assert_eq!(&target.to_vec()[100..356], &bytes[..]);

    // refused before anything is posted: over the QP's size, or as a READ destination
    let e = a
        .write(
            Local::inline(&pattern(257)),
            target.mr().remote(0..257).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("at most 256")),
        "{e}"
    );
    let e = a
        .read(
            Local::inline(&bytes[..8]),
            target.mr().remote(0..8).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("inline")),
        "{e}"
    );
    assert_eq!(a.state().unwrap(), QpState::Rts, "a refusal posts nothing");
    a.write(
        Local::inline(&bytes[..1]),
        target.mr().remote(0..1).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(target.to_vec()[0], bytes[0]);

    // a QP created without inline data refuses even one byte
    let (plain, _peer) = QueuePair::loopback_pair(&pd, QpOptions::default()).unwrap();
    let e = plain
        .write(
            Local::inline(&bytes[..1]),
            target.mr().remote(0..1).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("max_inline_data")),
        "{e}"
    );
}
