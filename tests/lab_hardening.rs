//! Lab tests of the server against misbehaving peers (the defects of the hardening work): each
//! one failed before its fix.

mod common;
use common::{start, TOKEN};

use std::time::Duration;

use p2p_rdma::bridge::protocol::{encode, ErrorCode, Msg, VERSION};
use p2p_rdma::bridge::{Client, ClientConfig, Error};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_silent_sockets_do_not_lock_clients_out() {
    let s = start(&["r=host:1M"], |c| {
        c.max_connections = 4;
        c.max_unauthenticated = 64;
        c.hello_timeout = Duration::from_secs(30);
    })
    .await;
    // four times as many silent sockets as there are client slots, and some that dribble
    let mut silent = Vec::new();
    for i in 0..16 {
        let mut t = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        if i % 2 == 0 {
            // a length prefix and half a hello, then nothing
            t.write_all(
                &encode(&Msg::Hello {
                    version: VERSION,
                    token: TOKEN.into(),
                    client: "dribble".into(),
                })[..10],
            )
            .await
            .unwrap();
        }
        silent.push(t);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // every client slot is still free: four clients at once
    let mut clients = Vec::new();
    for i in 0..4 {
        let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
            .await
            .unwrap_or_else(|e| panic!("client {i} locked out by silent sockets: {e}"));
        assert_eq!(c.list().await.unwrap().len(), 1);
        clients.push(c);
    }
    for c in clients {
        c.bye().await.unwrap();
    }
    drop(silent);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_the_unauthenticated_budget_is_bounded() {
    let s = start(&["r=host:1M"], |c| {
        c.max_unauthenticated = 8;
        c.hello_timeout = Duration::from_secs(30);
    })
    .await;
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(tokio::net::TcpStream::connect(s.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // the ninth is closed at once, without a reply
    let mut extra = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(10), extra.read_to_end(&mut buf))
        .await
        .expect("an over-budget socket is closed at once")
        .unwrap_or(0);
    assert_eq!(n, 0, "no bytes for an unauthenticated peer over budget");
    // once the silent ones go, clients get in again
    drop(silent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    c.list().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_large_frames_before_the_hello_are_refused_unbuffered() {
    let s = start(&["r=host:1M"], |_| {}).await;
    let mut t = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    // announce a 1 MiB frame: refused on the prefix alone
    t.write_all(&(1u32 << 20).to_be_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let mut d = p2p_rdma::bridge::protocol::Decoder::new();
    d.feed(&buf);
    match d.next_msg() {
        Ok(Some(Msg::Error { code, message })) => {
            assert_eq!(code, ErrorCode::BadRequest);
            assert!(message.contains("4096-byte limit"), "{message}");
        }
        other => panic!("expected an error reply, got {other:?}"),
    }
    // an authenticated client may still send large frames (a region list, a long name)
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let long = "x".repeat(64 << 10);
    match c.open(&long, false).await {
        Err(Error::Server { code, .. }) => assert_eq!(code, ErrorCode::UnknownRegion),
        other => panic!("{other:?}"),
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_an_rkey_stops_working_at_close() {
    let s = start(&["r=host:1M"], |_| {}).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let r = c.open("r", false).await.unwrap();
    assert!(r.remote.len > 0, "the region is direct: it has an rkey");
    let mut out = Vec::new();
    c.fetch(&r, 0, 4096, &mut out, false, &mut |_| {})
        .await
        .expect("the rkey works while open");
    c.close(&r).await.unwrap();
    // the same rkey, on the same QP, after Close: the NIC must refuse it
    let mut out = Vec::new();
    let res = tokio::time::timeout(
        Duration::from_secs(60),
        c.fetch(&r, 0, 4096, &mut out, false, &mut |_| {}),
    )
    .await
    .expect("a READ on a dead rkey fails, it does not hang");
    assert!(
        res.is_err(),
        "an RDMA READ with the rkey of a closed handle succeeded"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_an_open_for_reading_gets_an_rkey_without_remote_write() {
    let s = start(&["r=host:1M"], |_| {}).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let reader = c.open("r", false).await.unwrap();
    assert!(
        reader.remote.len > 0,
        "the region is direct: it has an rkey"
    );
    let bytes = vec![0xa5u8; 4096];
    let mut src: &[u8] = &bytes;
    let res = tokio::time::timeout(
        Duration::from_secs(60),
        c.put(&reader, 0, &mut src, Some(4096), false, &mut |_| {}),
    )
    .await
    .expect("a WRITE on a read-only rkey fails, it does not hang");
    assert!(
        res.is_err(),
        "an RDMA WRITE through the rkey of an open for reading succeeded"
    );
    // a new connection (the failed WRITE broke the old QP) that opens for writing may put
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let writer = c.open("r", true).await.unwrap();
    let mut src: &[u8] = &bytes;
    c.put(&writer, 0, &mut src, Some(4096), true, &mut |_| {})
        .await
        .expect("an open for writing may put");
    s.stop().await;
}
