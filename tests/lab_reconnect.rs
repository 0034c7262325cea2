//! Lab tests of `Client::reconnect`: a client whose QP went down, or whose server restarted,
//! connects again with what it registered still usable, and the handles of the old
//! connection are refused before anything is sent.

mod common;

use std::time::Duration;

use common::*;
use p2p_rdma::bridge::{Client, OpenRegion};

/// The server's gauge of control connections now open.
fn connections(s: &Running) -> u64 {
    let text = s.handle.metrics().encode();
    text.lines()
        .find(|l| l.starts_with("p2p_rdma_connections "))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no connections gauge in:\n{text}"))
}

/// Wait up to 5 s for the server to count `n` connections.
async fn until_connections(s: &Running, n: u64) {
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while connections(s) != n && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(connections(s), n, "{}", s.handle.metrics().encode());
}

/// Every call through `old` (a handle of a connection before the reconnect) is refused by the
/// client, saying why.
async fn refused_after_reconnect(c: &mut Client, old: &OpenRegion) {
    let why = "before it reconnected";
    let e = c
        .fetch(old, 0, 4096, &mut Vec::new(), false, &mut |_| {})
        .await
        .unwrap_err();
    assert!(e.to_string().contains(why), "fetch: {e}");
    let e = c.checksum(old, 0, 4096).await.unwrap_err();
    assert!(e.to_string().contains(why), "checksum: {e}");
    let e = c.flush(old, 0, 4096).await.unwrap_err();
    assert!(e.to_string().contains(why), "flush: {e}");
    let e = c.close(old).await.unwrap_err();
    assert!(e.to_string().contains(why), "close: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_a_client_whose_qp_went_down_reconnects_and_keeps_its_registered_buffers() {
    let s = start(&["m=host:4M"], |_| {}).await;
    let mut c = Client::connect(client_config(s.addr, 256 << 10, 4))
        .await
        .unwrap();
    let m = c.open("m", true).await.unwrap();
    let d = data(1 << 20, 31);
    c.put(&m, 0, &mut d.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    let buf = c.buffer(1 << 20).await.unwrap();
    // a READ past the end of the window (its keys, another address) fails at the server's NIC
    // and takes the QP down; the next transfer is refused with that cause
    let mut forged = m.clone();
    forged.remote.addr += 4 << 20;
    let e = c
        .fetch(&forged, 0, 4096, &mut Vec::new(), false, &mut |_| {})
        .await
        .unwrap_err();
    assert!(e.to_string().contains("IBV_WC_REM_ACCESS_ERR"), "{e}");
    let e = c
        .fetch(&m, 0, 4096, &mut Vec::new(), false, &mut |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(e, p2p_rdma::bridge::Error::QpDown { .. }),
        "after the QP went down: {e}"
    );
    let before = c.connection();
    until_connections(&s, 1).await;
    c.reconnect().await.unwrap();
    assert_ne!(c.connection(), before);
    // the old connection ended with the reconnect: its session, handles and windows are gone
    until_connections(&s, 1).await;
    refused_after_reconnect(&mut c, &m).await;
    // the region opened again: fetched into the buffer registered before the QP went down,
    // and put from it, with no copy
    let m2 = c.open("m", true).await.unwrap();
    assert_eq!(m2.connection, c.connection());
    let landed = c.fetch_into(&m2, 0, 1 << 20, buf, 0).await.unwrap();
    assert_eq!(landed.direct_bytes, 1 << 20, "{landed:?}");
    assert!(landed.buffer.as_slice() == &d[..], "the bytes differ");
    let put = c
        .put_from(&m2, 2 << 20, 1 << 20, landed.buffer, 0)
        .await
        .unwrap();
    assert_eq!(put.direct_bytes, 1 << 20, "{put:?}");
    let got = c.fetch_bytes(&m2, 2 << 20, 1 << 20).await.unwrap();
    assert!(got[..] == d[..], "the put from the kept buffer differs");
    c.bye().await.unwrap();
    s.stop().await;
}

/// A client (over `Transport::Tcp` if `tcp`) whose server stops and starts again, empty, on
/// the same address: its next call fails with a transient error, it reconnects, the old
/// handle is refused, and it puts and fetches through the region opened again (over RDMA,
/// from the buffer it registered before the restart).
async fn reconnects_to_a_restarted_server(tcp: bool) {
    let s = start(&["m=host:4M"], |_| {}).await;
    let addr = s.addr;
    let mut cfg = client_config(addr, 256 << 10, 4);
    if tcp {
        cfg.transport = p2p_rdma::bridge::Transport::Tcp;
    }
    let mut c = Client::connect(cfg).await.unwrap();
    let m = c.open("m", true).await.unwrap();
    let buf = if tcp {
        None
    } else {
        Some(c.buffer(1 << 20).await.unwrap())
    };
    let d = data(1 << 20, 32);
    c.put(&m, 0, &mut d.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    s.stop().await;
    let s = start(&["m=host:4M"], |cfg| cfg.listen = addr).await;
    let e = c
        .fetch(&m, 0, 4096, &mut Vec::new(), false, &mut |_| {})
        .await
        .unwrap_err();
    assert!(e.is_transient(), "a fetch on the dead connection: {e}");
    c.reconnect().await.unwrap();
    refused_after_reconnect(&mut c, &m).await;
    let m = c.open("m", true).await.unwrap();
    if let Some(mut buf) = buf {
        buf.as_mut_slice().copy_from_slice(&d);
        let put = c.put_from(&m, 0, 1 << 20, buf, 0).await.unwrap();
        assert_eq!(put.direct_bytes, 1 << 20, "{put:?}");
    } else {
        let put = c
            .put(&m, 0, &mut d.as_slice(), None, true, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(put.tcp_bytes, 1 << 20, "{put:?}");
        assert_eq!(c.tcp_reason(), Some("the TCP transport was asked for"));
    }
    let mut got = Vec::new();
    let rep = c
        .fetch(&m, 0, 1 << 20, &mut got, true, &mut |_| {})
        .await
        .unwrap();
    assert!(rep.verified && got == d, "{rep:?}");
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_a_client_reconnects_to_its_server_restarted_on_the_same_address() {
    reconnects_to_a_restarted_server(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_a_tcp_client_reconnects_to_its_server_restarted_on_the_same_address() {
    reconnects_to_a_restarted_server(true).await;
}
