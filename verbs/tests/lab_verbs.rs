//! Lab tests of the verbs layer against the real kernel RDMA stack (rxe).
//!
//! They need an RDMA device, so they are `#[ignore]`d in a plain `cargo test`; `soft-roce/lab`
//! runs them inside its QEMU guest (`.ci/run` does so on both kernels) with `--ignored`, and
//! they fail — not skip — when the device named by `P2P_RDMA_DEVICE` is absent.

use std::sync::Arc;
use std::time::Duration;

use verbs::{
    Access, CqMode, Error, HostBuffer, Local, ProtectionDomain, QpOptions, QpState, QueuePair,
    RegMode, SendOp, SendWr, WcStatus,
};

mod common;
use common::{buf, device, fill, first_diff, local, pair, pair_with};

fn lab_kernel() -> Option<String> {
    std::env::var("P2P_LAB_KERNEL").ok()
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_device_has_active_port_and_roce_v2_gid() {
    let ctx = device();
    let info = ctx.info();
    let (port, gid) = info
        .preferred_gid()
        .unwrap_or_else(|| panic!("{} has no active port with a GID: {info:#?}", info.name));
    assert_eq!(port, 1);
    assert_eq!(gid.kind, verbs::GidKind::RoceV2, "{gid:?}");
    if let Ok(ip) = std::env::var("P2P_LAB_IP") {
        assert_eq!(gid.ipv4.map(|a| a.to_string()), Some(ip), "{gid:?}");
    }
    assert!(info.software, "rxe must be flagged as software RDMA");
    assert!(info.caps.max_mr_size > 0);
    assert!(verbs::device_names().unwrap().contains(&info.name));
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_write_then_read_back_sizes_and_unaligned_offsets() {
    let p = pair();
    const MAX: usize = 8 << 20;
    let remote_buf = buf(&p.pd, MAX + 64);
    let mut src = local(&p.pd, MAX + 64);
    fill(src.as_mut_slice(), 1);
    let mut src = Some(src);
    let mut dst = Some(local(&p.pd, MAX + 64));
    for (i, &len) in [
        1usize,
        2,
        63,
        4095,
        4096,
        4097,
        65_549,
        1 << 20,
        (1 << 20) + 3,
        MAX,
    ]
    .iter()
    .enumerate()
    {
        let loff = (i * 7) % 61; // unaligned local offsets
        let roff = (i * 13) % 59 + 1; // unaligned remote offsets
        let remote = remote_buf
            .mr()
            .remote(roff as u64..(roff + len) as u64)
            .unwrap();
        let l = Local::owned_range(src.take().unwrap(), loff..loff + len).unwrap();
        let l =
            p.a.write(l, remote)
                .await
                .unwrap_or_else(|e| panic!("WRITE of {len} bytes: {e}"));
        let s = l.into_owned().unwrap();
        assert_eq!(
            first_diff(
                &s.as_slice()[loff..loff + len],
                &remote_buf.to_vec()[roff..roff + len]
            ),
            None,
            "WRITE of {len} bytes at remote offset {roff} landed wrong"
        );
        let d = Local::owned_range(dst.take().unwrap(), 5..5 + len).unwrap();
        let d =
            p.b.read(d, remote)
                .await
                .unwrap_or_else(|e| panic!("READ of {len} bytes: {e}"));
        let d = d.into_owned().unwrap();
        assert_eq!(
            first_diff(&d.as_slice()[5..5 + len], &s.as_slice()[loff..loff + len]),
            None,
            "READ of {len} bytes returned wrong data"
        );
        src = Some(s);
        dst = Some(d);
    }
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_send_recv_with_and_without_immediate() {
    let p = pair();
    let mut s = local(&p.pd, 8192);
    fill(s.as_mut_slice(), 2);
    let expect = s.as_slice()[100..100 + 3000].to_vec();
    // plain SEND
    let recv =
        p.b.post_recv(vec![Local::owned(local(&p.pd, 4096))])
            .unwrap();
    let s =
        p.a.send(Local::owned_range(s, 100..3100).unwrap(), None)
            .await
            .unwrap();
    let (r, info) = recv.await.unwrap().pop().unwrap();
    assert_eq!(info.byte_len, 3000);
    assert_eq!(info.imm, None);
    assert_eq!(&r.bytes().unwrap()[..3000], &expect[..]);
    // SEND with immediate
    let recv =
        p.b.post_recv(vec![Local::owned(r.into_owned().unwrap())])
            .unwrap();
    let s =
        p.a.send(
            Local::owned_range(s.into_owned().unwrap(), 0..1).unwrap(),
            Some(0xdead_beef),
        )
        .await
        .unwrap();
    let (r, info) = recv.await.unwrap().pop().unwrap();
    assert_eq!((info.byte_len, info.imm), (1, Some(0xdead_beef)));
    // RDMA WRITE with immediate consumes a receive and carries the immediate
    let target = buf(&p.pd, 4096);
    let recv =
        p.b.post_recv(vec![Local::owned(r.into_owned().unwrap())])
            .unwrap();
    let s = s.into_owned().unwrap();
    let want = s.as_slice()[..512].to_vec();
    p.a.write_imm(
        Local::owned_range(s, 0..512).unwrap(),
        target.mr().remote(0..512).unwrap(),
        7,
    )
    .await
    .unwrap();
    let (_, info) = recv.await.unwrap().pop().unwrap();
    assert_eq!(info.imm, Some(7));
    assert_eq!(&target.to_vec()[..512], &want[..]);
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_deferred_sends_are_delivered_and_retired_by_a_signaled_one_or_a_half_full_queue() {
    let p = pair_with(QpOptions {
        max_send_wr: 8,
        max_inline_data: 64,
        ..QpOptions::default()
    });
    let mut recvs = Vec::new();
    for _ in 0..12 {
        recvs.push(p.b.post_recv(vec![Local::owned(local(&p.pd, 64))]).unwrap());
    }
    let inline = |k: u8| SendWr {
        op: SendOp::Send,
        local: Local::inline(&[k; 16]),
    };
    // three deferred sends: delivered in order, with no completion of their own
    let mut deferred: Vec<_> = (0..3u8)
        .map(|k| p.a.post_send_deferred(vec![inline(k)]).unwrap())
        .collect();
    for (k, r) in recvs.drain(..3).enumerate() {
        let (l, info) = r.await.unwrap().pop().unwrap();
        assert_eq!(info.byte_len, 16);
        assert_eq!(l.bytes().unwrap()[..16], [k as u8; 16]);
    }
    for _ in 0..20 {
        p.a.progress().unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(p.a.outstanding().0, 3, "nothing has retired them yet");
    let last = deferred.pop().unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), last.wait())
            .await
            .is_err(),
        "a deferred send's wait ends only with a later signaled completion"
    );
    // a signaled send retires them
    p.a.post_send(vec![inline(3)])
        .unwrap()
        .wait()
        .await
        .unwrap();
    for d in deferred {
        d.wait().await.unwrap();
    }
    assert_eq!(p.a.outstanding().0, 0);
    // eight more deferred sends on a queue of eight: once half the queue is taken, each asks
    // for a completion by itself, so the queue never fills and empties with no signaled post
    // of the caller's
    for k in 0..8u8 {
        let _ = p.a.post_send_deferred(vec![inline(10 + k)]).unwrap();
    }
    for (k, r) in recvs.drain(1..).enumerate() {
        let (l, _) = r.await.unwrap().pop().unwrap();
        assert_eq!(l.bytes().unwrap()[0], 10 + k as u8);
    }
    let t = std::time::Instant::now();
    while p.a.outstanding().0 > 0 && t.elapsed() < Duration::from_secs(5) {
        p.a.progress().unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        p.a.outstanding().0,
        0,
        "the half-full rule signaled the last of them"
    );
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_prepared_sends_wait_for_their_doorbell_hold_the_queue_and_undo_when_dropped() {
    let p = pair_with(QpOptions {
        max_send_wr: 8,
        max_inline_data: 64,
        ..QpOptions::default()
    });
    let mut recvs = std::collections::VecDeque::new();
    for _ in 0..4 {
        recvs.push_back(p.b.post_recv(vec![Local::owned(local(&p.pd, 64))]).unwrap());
    }
    let inline = |k: u8| SendWr {
        op: SendOp::Send,
        local: Local::inline(&[k; 16]),
    };
    // written into the queue, but not sent before its doorbell
    let prepared = p.a.prepare_send(vec![inline(1)]).unwrap();
    let first = recvs.pop_front().unwrap();
    let mut first = Box::pin(first.wait());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut first)
            .await
            .is_err(),
        "a prepared send goes out only when posted"
    );
    // it holds the send queue: another send is refused, not blocked
    let err = p.a.post_send(vec![inline(9)]).unwrap_err().to_string();
    assert!(err.contains("prepared send holds the send queue"), "{err}");
    // receives are not affected
    recvs.push_back(p.b.post_recv(vec![Local::owned(local(&p.pd, 64))]).unwrap());
    prepared.post().unwrap().wait().await.unwrap();
    let (l, _) = first.await.unwrap().pop().unwrap();
    assert_eq!(l.bytes().unwrap()[..16], [1; 16]);

    // a deferred send, then a prepared signaled one that would retire it, dropped: nothing of
    // the prepared one is sent, and the deferred one waits for the next signaled send
    let deferred = p.a.post_send_deferred(vec![inline(2)]).unwrap();
    let (l, _) = recvs.pop_front().unwrap().await.unwrap().pop().unwrap();
    assert_eq!(l.bytes().unwrap()[0], 2);
    drop(p.a.prepare_send(vec![inline(3)]).unwrap());
    assert_eq!(
        p.a.outstanding().0,
        1,
        "only the deferred send is outstanding"
    );
    p.a.post_send(vec![inline(4)])
        .unwrap()
        .wait()
        .await
        .unwrap();
    deferred.wait().await.unwrap();
    let (l, _) = recvs.pop_front().unwrap().await.unwrap().pop().unwrap();
    assert_eq!(
        l.bytes().unwrap()[0],
        4,
        "the dropped prepared send never went out"
    );
    assert_eq!(p.a.outstanding().0, 0);
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_many_outstanding_work_requests_in_batches() {
    let p = pair_with(QpOptions {
        max_send_wr: 256,
        ..QpOptions::default()
    });
    const CHUNK: usize = 16 << 10;
    const N: usize = 200;
    let mut src = local(&p.pd, CHUNK * N);
    fill(src.as_mut_slice(), 3);
    let src = Arc::new(src);
    let target = buf(&p.pd, CHUNK * N);
    // one batch (one doorbell) of N writes from one shared buffer
    let wrs = (0..N)
        .map(|i| SendWr {
            op: SendOp::Write(
                target
                    .mr()
                    .remote((i * CHUNK) as u64..((i + 1) * CHUNK) as u64)
                    .unwrap(),
            ),
            local: Local::shared(Arc::clone(&src), i * CHUNK..(i + 1) * CHUNK).unwrap(),
        })
        .collect();
    let pending = p.a.post_send(wrs).unwrap();
    assert_eq!(pending.len(), N);
    assert_eq!(p.a.outstanding().0, N);
    let back = pending.await.unwrap();
    assert_eq!(back.len(), N);
    drop(back);
    assert_eq!(p.a.outstanding(), (0, 0));
    assert_eq!(Arc::strong_count(&src), 1);
    assert_eq!(first_diff(src.as_slice(), &target.to_vec()), None);
    // many single-WR posts outstanding at once, completed out of posting order by the waiters
    let mut pend = Vec::new();
    for i in 0..64 {
        let d = Local::owned(local(&p.pd, CHUNK));
        let r = target
            .mr()
            .remote((i * CHUNK) as u64..((i + 1) * CHUNK) as u64)
            .unwrap();
        pend.push(
            p.b.post_send(vec![SendWr {
                op: SendOp::Read(r),
                local: d,
            }])
            .unwrap(),
        );
    }
    assert_eq!(p.b.outstanding().0, 64);
    for (i, pe) in pend.into_iter().enumerate().rev() {
        let d = pe.await.unwrap().pop().unwrap();
        assert_eq!(
            d.bytes().unwrap(),
            &src.as_slice()[i * CHUNK..(i + 1) * CHUNK],
            "READ {i}"
        );
    }
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_queue_full_is_a_typed_error() {
    let p = pair_with(QpOptions {
        max_send_wr: 4,
        ..QpOptions::default()
    });
    let src = Arc::new(buf(&p.pd, 4096));
    let target = buf(&p.pd, 4096);
    let r = target.mr().remote(0..4096).unwrap();
    let wr = || SendWr {
        op: SendOp::Write(r),
        local: Local::shared(Arc::clone(&src), 0..4096).unwrap(),
    };
    let e = p.a.post_send((0..5).map(|_| wr()).collect()).unwrap_err();
    assert!(matches!(e, Error::QueueFull { capacity: 4, .. }), "{e}");
    // nothing was posted, nothing leaked
    assert_eq!(p.a.outstanding(), (0, 0));
    assert_eq!(Arc::strong_count(&src), 1);
    p.a.post_send((0..4).map(|_| wr()).collect())
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_dropped_future_does_not_free_in_flight_buffers() {
    let p = pair();
    let src = Arc::new(buf(&p.pd, 8 << 20));
    let target = buf(&p.pd, 8 << 20);
    let pending =
        p.a.post_send(vec![SendWr {
            op: SendOp::Write(target.mr().remote(0..8 << 20).unwrap()),
            local: Local::shared(Arc::clone(&src), 0..8 << 20).unwrap(),
        }])
        .unwrap();
    drop(pending);
    // the work request still owns its buffer
    assert_eq!(Arc::strong_count(&src), 2);
    assert_eq!(p.a.outstanding(), (1, 0));
    // an owned READ destination, dropped mid-flight, likewise stays with the CQ
    let pending =
        p.b.post_send(vec![SendWr {
            op: SendOp::Read(target.mr().remote(0..8 << 20).unwrap()),
            local: Local::owned(buf(&p.pd, 8 << 20)),
        }])
        .unwrap();
    drop(pending);
    assert_eq!(p.b.outstanding(), (1, 0));
    // once the device reports completion, the buffers are released
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while p.a.outstanding() != (0, 0) || p.b.outstanding() != (0, 0) {
        p.a.progress().unwrap();
        p.b.progress().unwrap();
        assert!(
            tokio::time::Instant::now() < deadline,
            "work requests never completed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(Arc::strong_count(&src), 1);
    // and the QPs still work
    let l =
        p.a.write(
            Local::shared(Arc::clone(&src), 0..64).unwrap(),
            target.mr().remote(0..64).unwrap(),
        )
        .await;
    l.unwrap();
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_bad_rkey_is_a_typed_error_and_moves_the_qp_to_error() {
    let p = pair();
    let target = buf(&p.pd, 4096);
    let mut r = target.mr().remote(0..4096).unwrap();
    r.rkey ^= 0x00ab_cd00;
    let e =
        p.a.read(Local::owned(buf(&p.pd, 4096)), r)
            .await
            .unwrap_err();
    match &e {
        Error::WorkCompletion { status, opcode, .. } => {
            assert_eq!(*status, WcStatus::REM_ACCESS_ERR, "{e}");
            assert_eq!(*opcode, "RDMA READ");
        }
        other => panic!("expected a work completion error, got {other}"),
    }
    assert!(e.to_string().contains("rkey"), "{e}");
    assert_eq!(p.a.state().unwrap(), QpState::Error);
    // later work requests are flushed, not lost
    let e2 =
        p.a.write(
            Local::owned(buf(&p.pd, 64)),
            target.mr().remote(0..64).unwrap(),
        )
        .await;
    match e2 {
        Err(Error::WorkCompletion { status, .. }) => assert_eq!(status, WcStatus::WR_FLUSH_ERR),
        Err(Error::Verbs { .. }) => {} // some providers refuse to post on an errored QP
        other => panic!("expected a flush, got {other:?}"),
    }
    assert_eq!(p.a.outstanding(), (0, 0));
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_remote_write_to_read_only_region_is_refused_by_the_nic() {
    let p = pair();
    let ro =
        p.pd.register(
            HostBuffer::new(4096).unwrap(),
            Access::REMOTE_READ,
            RegMode::Pinned,
        )
        .unwrap();
    let e =
        p.a.write(Local::owned(buf(&p.pd, 64)), ro.mr().remote(0..64).unwrap())
            .await
            .unwrap_err();
    assert!(
        matches!(
            e,
            Error::WorkCompletion {
                status: WcStatus::REM_ACCESS_ERR,
                ..
            }
        ),
        "{e}"
    );
    assert!(ro.as_slice().iter().all(|&b| b == 0));
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_odp_registration_follows_device_caps() {
    let ctx = device();
    let odp = ctx.info().caps.odp;
    match lab_kernel().as_deref() {
        Some("6.12") => assert!(!odp.supported, "rxe on 6.12 has no ODP: {odp:?}"),
        Some("7.3") => assert!(
            odp.supported && odp.rc_rdma(),
            "rxe on 7.3 has RC ODP: {odp:?}"
        ),
        _ => {}
    }
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let res = pd.register(
        HostBuffer::new(64 << 10).unwrap(),
        Access::ALL,
        RegMode::OnDemand,
    );
    if !odp.supported {
        let e = res.expect_err("ODP registration must fail on a device without ODP");
        assert!(e.is_unsupported(), "{e}");
        assert!(e.to_string().contains("no ODP support"), "{e}");
        return;
    }
    let target = res.expect("ODP registration on a device with ODP");
    assert_eq!(target.mr().mode(), RegMode::OnDemand);
    match target.mr().prefetch(0..(64 << 10), true) {
        Ok(()) => {}
        Err(e) => assert!(
            e.is_unsupported(),
            "prefetch failed other than 'unsupported': {e}"
        ),
    }
    let qa = QueuePair::new(&pd, QpOptions::default()).unwrap();
    let qb = QueuePair::new(&pd, QpOptions::default()).unwrap();
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    let mut src = local(&pd, 64 << 10);
    fill(src.as_mut_slice(), 4);
    // One packet per work request, starting at a page boundary: the responder faults the page in.
    // (rxe 7.3 at path MTU 1024 puts every later packet of a page at the page's start, for ODP
    // WRITE as well as READ — the peer-memory canary's business; with MTU 4096 it is right.)
    let mtu = ctx.port(1).unwrap().active_mtu as usize;
    let src = qa
        .write(
            Local::owned_range(src, 0..mtu).unwrap(),
            target.mr().remote(8192..(8192 + mtu) as u64).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        first_diff(src.bytes().unwrap(), &target.to_vec()[8192..8192 + mtu]),
        None,
        "one-packet WRITE into an ODP MR"
    );
    let d = qb
        .read(
            Local::owned(local(&pd, mtu)),
            target.mr().remote(8192..(8192 + mtu) as u64).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        d.bytes().unwrap(),
        &target.to_vec()[8192..8192 + mtu],
        "one-packet READ from an ODP MR"
    );
    if mtu >= 4096 {
        // whole pages per packet: a multi-page transfer must be exact
        let src = Local::owned(src.into_owned().unwrap());
        let src = qa
            .write(src, target.mr().remote(0..(64 << 10)).unwrap())
            .await
            .unwrap();
        assert_eq!(
            first_diff(src.bytes().unwrap(), &target.to_vec()),
            None,
            "64 KiB WRITE into an ODP MR at MTU {mtu}"
        );
        let d = qb
            .read(
                Local::owned(local(&pd, 64 << 10)),
                target.mr().remote(0..(64 << 10)).unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(
            first_diff(d.bytes().unwrap(), src.bytes().unwrap()),
            None,
            "64 KiB READ from an ODP MR at MTU {mtu}"
        );
    }
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_dmabuf_registration_on_udmabuf_reports_unsupported() {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let ub = peermem::Udmabuf::create(64 << 10).expect("the lab kernels have /dev/udmabuf");
    ub.write_at(0, b"hello").unwrap();
    let e = pd
        .register_dmabuf(
            ub.dmabuf_fd(),
            0,
            ub.len(),
            0,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
        )
        .expect_err("rxe has no dma-buf MR support");
    assert!(e.is_unsupported(), "{e}");
    let s = e.to_string();
    assert!(
        s.contains("ibv_reg_dmabuf_mr") && s.contains("does not support dma-buf MRs"),
        "{s}"
    );
}

#[test]
#[ignore = "lab"]
fn lab_polling_mode_works_without_events() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let p = pair_with(QpOptions {
            cq_mode: CqMode::Polling,
            ..QpOptions::default()
        });
        let mut src = local(&p.pd, 1 << 20);
        fill(src.as_mut_slice(), 5);
        let target = buf(&p.pd, 1 << 20);
        let s =
            p.a.write(Local::owned(src), target.mr().remote(0..1 << 20).unwrap())
                .await
                .unwrap();
        assert_eq!(first_diff(s.bytes().unwrap(), &target.to_vec()), None);
    });
}

#[test]
#[ignore = "lab"]
fn lab_blocking_mode_sleeps_on_the_channel_without_a_runtime_and_times_out() {
    // no runtime at all: a blocking CQ registers nothing with tokio
    let p = pair_with(QpOptions {
        cq_mode: CqMode::Blocking,
        max_inline_data: 64,
        ..QpOptions::default()
    });
    let soon = || std::time::Instant::now() + Duration::from_secs(10);
    // nothing arrives: the sleep ends at its deadline with ETIMEDOUT, the receive stays posted
    let recv = p.b.post_recv(vec![Local::owned(local(&p.pd, 64))]).unwrap();
    let t = std::time::Instant::now();
    let err = recv
        .sleep_until_event(t + Duration::from_millis(300))
        .unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(300), "{err}");
    assert!(
        matches!(&err, Error::Verbs { source, .. } if source.raw_os_error() == Some(110)),
        "{err}"
    );
    assert!(
        err.to_string().contains("no completion event in time"),
        "{err}"
    );
    // round trips, each completion waited for by sleeping on the channel: events left from an
    // earlier arm (a completion seen by a poll before its event was read) do not lose one
    let mut recv = Some(recv);
    for k in 0..50u8 {
        let sent =
            p.a.post_send(vec![SendWr {
                op: SendOp::Send,
                local: Local::inline(&[k; 16]),
            }])
            .unwrap();
        let r = recv.take().unwrap();
        let (l, info) = r.wait_blocking(soon()).unwrap().pop().unwrap();
        assert_eq!(
            (info.byte_len, l.bytes().unwrap()[..16].to_vec()),
            (16, vec![k; 16])
        );
        sent.wait_blocking(soon()).unwrap();
        recv = Some(p.b.post_recv(vec![Local::owned(local(&p.pd, 64))]).unwrap());
    }
    // a READ of 1 MiB, waited for the same way
    let mut pattern = vec![0; 1 << 20];
    fill(&mut pattern, 9);
    let mut src = buf(&p.pd, 1 << 20);
    src.write_at(0, &pattern).unwrap();
    let dst = local(&p.pd, 1 << 20);
    let read =
        p.a.post_send(vec![SendWr {
            op: SendOp::Read(src.mr().remote(0..1 << 20).unwrap()),
            local: Local::owned(dst),
        }])
        .unwrap();
    let back = read.wait_blocking(soon()).unwrap().pop().unwrap();
    assert_eq!(first_diff(back.bytes().unwrap(), &pattern), None);
}

#[tokio::test]
#[ignore = "lab"]
async fn lab_traffic_class_service_level_and_gid_reach_the_device() {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    // the lab's RoCE v2 GID with an IPv4 address: pick it by that address
    let port = ctx.port(1).unwrap();
    let g = port
        .gids
        .iter()
        .find(|g| g.kind == verbs::GidKind::RoceV2 && g.ipv4.is_some())
        .expect("a RoCE v2 GID with an IPv4 address")
        .clone();
    let opts = QpOptions {
        traffic_class: 106,
        service_level: 3,
        local_ip: g.ipv4.map(std::net::IpAddr::V4),
        ..QpOptions::default()
    };
    let a = QueuePair::new(&pd, opts.clone()).unwrap();
    let b = QueuePair::new(&pd, QpOptions::default()).unwrap();
    assert_eq!(a.gid().index, g.index);
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    let path = a.path().unwrap();
    assert_eq!(
        (path.traffic_class, path.gid_index),
        (106, g.index),
        "what the device holds of the QP's path: {path:?}"
    );
    // RoCE packets carry no service level (a NIC maps it to a priority); rxe keeps none, so
    // it reads back 0 there, and 3 on a device that keeps it
    assert!(matches!(path.service_level, 0 | 3), "{path:?}");
    let plain = b.path().unwrap();
    assert_eq!((plain.traffic_class, plain.service_level), (0, 0));
    // the path works
    let target = buf(&pd, 4096);
    a.write(
        Local::owned(local(&pd, 64)),
        target.mr().remote(0..64).unwrap(),
    )
    .await
    .unwrap();
    // a service level has 4 bits
    let e = QueuePair::new(
        &pd,
        QpOptions {
            service_level: 16,
            ..QpOptions::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("0–15"), "{e}");
}
