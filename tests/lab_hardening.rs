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
    // a ninth takes the place of the oldest, which is closed at once, without a reply
    let _ninth = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(10), silent[0].read_to_end(&mut buf))
        .await
        .expect("the oldest silent socket is closed at once")
        .unwrap_or(0);
    assert_eq!(n, 0, "no bytes for an unauthenticated peer over budget");
    // with the room full of silent sockets, a real client still gets in (it evicts one)
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .expect("a real client gets past a full waiting room");
    c.list().await.unwrap();
    let metrics = s.handle.metrics().encode();
    assert!(
        metrics.contains("p2p_rdma_preauth_evictions_total 2"),
        "{metrics}"
    );
    drop(silent);
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

/// A file of `len` bytes of `seed`'s pattern in the guest's scratch space.
fn scratch_file(name: &str, len: usize, seed: u32) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::write(&p, common::data(len, seed)).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_a_truncated_file_is_refused_and_the_server_keeps_serving() {
    let path = scratch_file("shrinks", 1 << 20, 11);
    let spec = format!("f=file:{}", path.display());
    let s = start(&[spec.as_str(), "r=host:1M"], |_| {}).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let f = c.open("f", true).await.unwrap();
    // another process truncates the served file to a quarter
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(256 << 10)
        .unwrap();
    // before the fix the server's next copy past the end was a SIGBUS: this process died
    let e = c.checksum(&f, 512 << 10, 4096).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Truncated), "{e}");
    assert!(e.to_string().contains("truncated it"), "{e}");
    let bytes = vec![0x5au8; 8192];
    let mut src: &[u8] = &bytes;
    let e = c
        .put(&f, 768 << 10, &mut src, Some(8192), false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Truncated), "{e}");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        256 << 10,
        "a refused put does not extend the file"
    );
    // what is left, and the other regions, are still served
    let mut head = Vec::new();
    c.fetch(&f, 0, 4096, &mut head, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(head, common::data(1 << 20, 11)[..4096]);
    let r = c.open("r", true).await.unwrap();
    let mut src: &[u8] = &bytes;
    c.put(&r, 0, &mut src, Some(8192), true, &mut |_| {})
        .await
        .unwrap();
    c.bye().await.unwrap();
    s.stop().await;
    std::fs::remove_file(path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_puts_to_a_file_go_through_the_server_and_are_flushed() {
    let path = scratch_file("durable", 1 << 20, 12);
    let spec = format!("f=file:{}", path.display());
    let s = start(&[spec.as_str()], |_| {}).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let f = c.open("f", true).await.unwrap();
    assert!(f.info.server_puts, "{:?}", f.info);
    assert!(
        f.info.reason.contains("puts go through the server"),
        "{}",
        f.info.reason
    );
    let bytes = common::data(300_000, 13);
    let mut src: &[u8] = &bytes;
    let rep = c
        .put(&f, 4096, &mut src, None, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!((rep.bytes, rep.direct_bytes), (300_000, 0), "{rep:?}");
    assert_eq!(rep.bounce_bytes, 300_000);
    // acknowledged: in the file (through the file, not the mapping)
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[4096..4096 + 300_000], &bytes[..]);
    // fetches of the direct part still go by RDMA READ
    let mut out = Vec::new();
    let rep = c
        .fetch(&f, 4096, 300_000, &mut out, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(rep.direct_bytes, 300_000, "{rep:?}");
    assert_eq!(out, bytes);
    // the rkey of an open for writing does not allow remote writes: a forged WRITE fails
    // (a client that ignores server_puts and RDMA-WRITEs the direct part)
    let mut forged = f.clone();
    forged.info.server_puts = false;
    let mut src: &[u8] = &bytes[..4096];
    let res = tokio::time::timeout(
        Duration::from_secs(60),
        c.put(&forged, 0, &mut src, Some(4096), false, &mut |_| {}),
    )
    .await
    .expect("a WRITE on a read-only rkey fails, it does not hang");
    assert!(res.is_err(), "an RDMA WRITE into a served file succeeded");
    assert_eq!(
        &std::fs::read(&path).unwrap()[..4096],
        &common::data(1 << 20, 12)[..4096]
    );
    s.stop().await;
    std::fs::remove_file(path).unwrap();
}

/// A control connection that said hello with the right token.
async fn authenticated(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let mut t = tokio::net::TcpStream::connect(addr).await.unwrap();
    t.write_all(&encode(&Msg::Hello {
        version: VERSION,
        token: TOKEN.into(),
        client: "raw".into(),
    }))
    .await
    .unwrap();
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_an_idle_client_is_closed() {
    let s = start(&["r=host:1M"], |c| c.idle_timeout = Duration::from_secs(2)).await;
    // timed from before the hello: the server's idle clock starts when it has read it, and a
    // loaded guest may run the server before this thread reads the clock after sending
    let started = std::time::Instant::now();
    let mut t = authenticated(s.addr).await;
    // the welcome, then nothing: closed after the idle timeout (before: never)
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), t.read_to_end(&mut buf))
        .await
        .expect("an idle client is closed")
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(15),
        "{took:?}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_a_client_that_stops_reading_is_closed() {
    // 32 regions: each listing is some 10 KiB, so the socket buffers fill within a few
    // hundred replies even on an emulated CPU
    let specs: Vec<String> = (0..32).map(|i| format!("r{i}=host:64K")).collect();
    let specs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let s = start(&specs, |c| c.send_timeout = Duration::from_secs(2)).await;
    let t = authenticated(s.addr).await;
    // far more replies than the socket buffers hold, and we do not read them
    let list = encode(&Msg::List);
    let n = 20_000;
    let mut bytes = Vec::with_capacity(list.len() * n);
    for _ in 0..n {
        bytes.extend_from_slice(&list);
    }
    let (mut rd, mut wr) = t.into_split();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&bytes).await;
        let _ = wr.shutdown().await;
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), rd.read_to_end(&mut buf))
        .await
        .expect("the connection ends")
        .ok();
    let _ = writer.await;
    let mut d = p2p_rdma::bridge::protocol::Decoder::new();
    d.feed(&buf);
    let mut replies = 0;
    while let Ok(Some(_)) = d.next_msg() {
        replies += 1;
    }
    assert!(
        replies < n,
        "the server kept a connection that stopped reading: all {replies} replies were sent"
    );
    // the server still serves others
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    assert_eq!(c.list().await.unwrap().len(), 32);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_the_staging_budget_is_server_wide() {
    let s = start(&["b=host:1M,p2p=disabled"], |c| c.max_staging_bytes = 0).await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let r = c.open("b", false).await.unwrap();
    let mut out = Vec::new();
    let e = c
        .fetch(&r, 0, 4096, &mut out, false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}");
    assert!(e.to_string().contains("staging budget"), "{e}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_hardening_a_scoped_token_reaches_only_what_it_grants() {
    let s = start(&["pub=host:1M", "priv=host:1M", "drop=host:1M"], |c| {
        c.grants = p2p_rdma::bridge::token::parse_grants(
            "reader-token pub\ningest-token drop:rw pub:ro\n",
        )
        .unwrap();
    })
    .await;
    let mut r = Client::connect(ClientConfig::new(s.addr.to_string(), "reader-token"))
        .await
        .unwrap();
    let names: Vec<String> = r
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, ["pub"], "a reader lists only what its token grants");
    let e = r.open("priv", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownRegion), "{e}");
    let e = r.open("pub", true).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Unauthorized), "{e}");
    let h = r.open("pub", false).await.unwrap();
    let mut out = Vec::new();
    r.fetch(&h, 0, 4096, &mut out, true, &mut |_| {})
        .await
        .unwrap();
    let mut w = Client::connect(ClientConfig::new(s.addr.to_string(), "ingest-token"))
        .await
        .unwrap();
    let d = w.open("drop", true).await.unwrap();
    let bytes = vec![7u8; 8192];
    let mut src: &[u8] = &bytes;
    w.put(&d, 0, &mut src, None, true, &mut |_| {})
        .await
        .unwrap();
    // the full-access token still sees everything
    let mut a = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    assert_eq!(a.list().await.unwrap().len(), 3);
    s.stop().await;
}
