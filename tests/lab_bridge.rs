//! Lab tests of serve / fetch / put on one soft-RoCE host (the two-host run is
//! soft-roce/two-host-test). The server runs in this process on the lab address; clients are
//! the library or the `p2p-rdma` binary.

mod common;
use common::rdma_resources;
use common::{client_config, code_of, data, lab_ip, raw, start, TOKEN};

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use p2p_rdma::bridge::protocol::{encode, ErrorCode, Msg};
use p2p_rdma::bridge::{Client, ClientConfig, Error};
use tokio::io::AsyncReadExt;

fn cfg(addr: SocketAddr) -> ClientConfig {
    client_config(addr, 256 << 10, 8)
}

async fn put(
    c: &mut Client,
    region: &str,
    offset: u64,
    bytes: &[u8],
) -> p2p_rdma::bridge::TransferReport {
    let r = c.open(region, true).await.unwrap();
    let mut src: &[u8] = bytes;
    c.put(
        &r,
        offset,
        &mut src,
        Some(bytes.len() as u64),
        true,
        &mut |_| {},
    )
    .await
    .unwrap()
}

/// Open `region` (a plain open) and fetch a range of it, verified: the bytes and the report.
async fn fetch_verified(
    c: &mut Client,
    region: &str,
    offset: u64,
    len: u64,
) -> (Vec<u8>, p2p_rdma::bridge::TransferReport) {
    let r = c.open(region, false).await.unwrap();
    let mut out = Vec::new();
    let rep = c
        .fetch(&r, offset, len, &mut out, true, &mut |_| {})
        .await
        .unwrap();
    assert!(rep.verified, "{rep:?}");
    (out, rep)
}

async fn fetch(c: &mut Client, region: &str, offset: u64, len: u64) -> Vec<u8> {
    let (out, rep) = fetch_verified(c, region, offset, len).await;
    assert_eq!(rep.direct_bytes, len);
    // the time to first byte is within the fetch
    let first = rep.first_bytes_ms.expect("a fetch's first bytes");
    assert!(first > 0.0 && first <= rep.seconds * 1e3, "{rep:?}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_put_and_fetch_64_mib_with_verify() {
    let s = start(&["ram=host:64M"], |_| {}).await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let d = data(64 << 20, 7);
    let rep = put(&mut c, "ram", 0, &d).await;
    assert_eq!(rep.bytes, 64 << 20);
    assert!(rep.verified);
    let back = fetch(&mut c, "ram", 0, 64 << 20).await;
    assert!(back == d, "fetched bytes differ from what was put");
    c.bye().await.unwrap();
    s.stop().await;
}

/// How many times the server's bounce stage histogram timed `stage` for fetches.
fn stage_count(s: &common::Running, stage: &str) -> u64 {
    let label = format!("stage=\"{stage}\"");
    s.handle
        .metrics()
        .encode()
        .lines()
        .filter(|l| {
            l.starts_with("p2p_rdma_bounce_stage_duration_seconds_count{")
                && l.contains("direction=\"fetch\"")
                && l.contains(&label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_a_fetch_reads_the_first_chunk_its_open_staged() {
    let s = start(&["bnc=host:8M,p2p=disabled"], |_| {}).await;
    let mut w = Client::connect(cfg(s.addr)).await.unwrap();
    let d = data(8 << 20, 23);
    put(&mut w, "bnc", 0, &d).await;
    w.bye().await.unwrap();

    // the open names the range: its first chunk is staged with it, and the fetch reads it
    // without asking again (21 pieces, 21 copies: bounce pieces end on multiples of the 256 KiB
    // bounce chunk, so the first is 256 KiB less 123 bytes, then 19 of 256 KiB and one of 123)
    let (off, len) = ((1u64 << 20) + 123, 5u64 << 20);
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let (open0, copy0) = (stage_count(&s, "open"), stage_count(&s, "copy"));
    let r = c.open_to_fetch("bnc", off, len).await.unwrap();
    assert_eq!(
        stage_count(&s, "open"),
        open0 + 1,
        "nothing staged with the open"
    );
    assert!(r.open_ms > 0.0, "{r:?}");
    let mut out = Vec::new();
    let rep = c
        .fetch(&r, off, len, &mut out, true, &mut |_| {})
        .await
        .unwrap();
    assert!(rep.verified && rep.bounce_bytes == len, "{rep:?}");
    assert!(out[..] == d[off as usize..(off + len) as usize]);
    assert_eq!(
        stage_count(&s, "copy"),
        copy0 + 21,
        "the first chunk was staged twice"
    );

    // a fetch of another range: the chunk staged for the named one goes back unread, so this
    // fetch still has all 8 slots for its 12 chunks (one held would make the 8th `Busy`)
    let r2 = c.open_to_fetch("bnc", 0, 1 << 20).await.unwrap();
    assert_eq!(stage_count(&s, "open"), open0 + 2);
    let mut out = Vec::new();
    let rep = c
        .fetch(&r2, 4 << 20, 3 << 20, &mut out, true, &mut |_| {})
        .await
        .unwrap();
    assert!(rep.verified, "{rep:?}");
    assert!(out[..] == d[4 << 20..7 << 20]);
    // one named and closed unread, then a batch: nothing held back from either
    let r3 = c.open_to_fetch("bnc", 2 << 20, 1 << 20).await.unwrap();
    c.close(&r3).await.unwrap();
    let r4 = c.open_to_fetch("bnc", 3 << 20, 1 << 20).await.unwrap();
    let buf = c.buffer(3 << 20).await.unwrap();
    let landed = c.fetch_into(&r4, 5 << 20, 3 << 20, buf, 0).await.unwrap();
    assert!(landed.buffer.as_slice()[..] == d[5 << 20..]);
    // a batch whose first piece is the chunk staged with the open reads it (8 chunks, 8
    // copies)
    let copy0 = stage_count(&s, "copy");
    let r5 = c.open_to_fetch("bnc", 6 << 20, 2 << 20).await.unwrap();
    let buf = c.buffer(2 << 20).await.unwrap();
    let landed = c.fetch_into(&r5, 6 << 20, 2 << 20, buf, 0).await.unwrap();
    assert!(landed.buffer.as_slice()[..] == d[6 << 20..]);
    assert_eq!(landed.bounce_bytes, 2 << 20);
    assert_eq!(
        stage_count(&s, "copy"),
        copy0 + 8,
        "the batch asked for the first chunk again"
    );
    c.bye().await.unwrap();

    // a plain open: the server binds the first slot's window while the client sets up, for
    // at least one of three new connections (one whose `Stage` is already there binds it then)
    let pre0 = stage_count(&s, "prebind");
    for k in 0..3u64 {
        let mut c = Client::connect(cfg(s.addr)).await.unwrap();
        let at = k << 20;
        let (got, _) = fetch_verified(&mut c, "bnc", at, 256 << 10).await;
        assert!(got[..] == d[at as usize..(at as usize) + (256 << 10)]);
        c.bye().await.unwrap();
    }
    let pre = stage_count(&s, "prebind") - pre0;
    assert!(
        (1..=3).contains(&pre),
        "{pre} of 3 first windows bound ahead"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_random_offsets_and_lengths() {
    let size = 4 << 20;
    let s = start(&["ram=host:4M"], |_| {}).await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let mut model = vec![0u8; size];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for i in 0..12 {
        let off = rnd(size as u64 - 1);
        let len = 1 + rnd((size as u64 - off).min(700_001));
        let d = data(len as usize, i + 1);
        put(&mut c, "ram", off, &d).await;
        model[off as usize..(off + len) as usize].copy_from_slice(&d);
        let (fo, fl) = (rnd(size as u64 - 1), 0);
        let fl = fl + 1 + rnd((size as u64 - fo).min(900_007));
        let got = fetch(&mut c, "ram", fo, fl).await;
        assert!(
            got[..] == model[fo as usize..(fo + fl) as usize],
            "round {i}: fetch {fo}+{fl} differs"
        );
    }
    s.stop().await;
}

/// Small put pieces go inline in the work request (the default room); a client that asks for
/// more room than the device has gets a QP without it, and its puts land all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_small_puts_go_inline_and_a_device_without_the_room_falls_back() {
    let s = start(&["ram=host:1M"], |_| {}).await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    assert_eq!(c.inline_room(), None, "no QP before the first transfer");
    let small = data(200, 3);
    let rep = put(&mut c, "ram", 4100, &small).await;
    assert_eq!(rep.direct_bytes, 200);
    assert_eq!(c.inline_room(), Some(p2p_rdma::bridge::DEFAULT_INLINE));
    assert!(fetch(&mut c, "ram", 4100, 200).await == small);
    // a chunk from a buffer, then a 100-byte last piece inline
    let mixed = data((256 << 10) + 100, 4);
    put(&mut c, "ram", 8192, &mixed).await;
    assert!(fetch(&mut c, "ram", 8192, mixed.len() as u64).await == mixed);
    c.bye().await.unwrap();

    // far more room than rxe has (its inline data is bounded by its largest work request)
    let mut wide = cfg(s.addr);
    wide.inline = 64 << 10;
    let mut c = Client::connect(wide).await.unwrap();
    let other = data(200, 5);
    put(&mut c, "ram", 4100, &other).await;
    assert_eq!(
        c.inline_room(),
        Some(0),
        "the device refused the room: none"
    );
    assert!(fetch(&mut c, "ram", 4100, 200).await == other);
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_four_clients_at_once() {
    let s = start(&["ram=host:16M"], |_| {}).await;
    let addr = s.addr;
    let mut tasks = Vec::new();
    for k in 0..4u64 {
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect(cfg(addr)).await.unwrap();
            let d = data(3 << 20, 100 + k as u32);
            let off = k * (4 << 20) + 13;
            put(&mut c, "ram", off, &d).await;
            let got = fetch(&mut c, "ram", off, d.len() as u64).await;
            assert!(got == d, "client {k} read back other bytes");
            c.bye().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    s.stop().await;
}

fn rc_qps() -> usize {
    rdma_resources("qp", "type RC")
}

fn mrs() -> usize {
    rdma_resources("mr", "rkey")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_killed_client_is_cleaned_up_and_others_keep_going() {
    let s = start(&["big=host:48M"], |_| {}).await;
    let baseline = rc_qps();
    let baseline_mrs = mrs();
    let token = std::env::temp_dir().join("lab-bridge-token");
    std::fs::write(&token, TOKEN).unwrap();
    // a slow fetch (small chunks, one in flight) that we kill mid-transfer
    let mut child = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args([
            "fetch",
            &s.addr.to_string(),
            "big",
            "-o",
            "/dev/null",
            "--chunk",
            "16K",
            "--depth",
            "1",
            "--token-file",
        ])
        .arg(&token)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while rc_qps() < baseline + 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the client never connected its QP"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the fetch finished before it could be killed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        mrs() > baseline_mrs,
        "the transfer's MRs are not visible in `rdma resource show mr`"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    // another client is served meanwhile
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let d = data(1 << 20, 9);
    put(&mut c, "big", 5, &d).await;
    assert!(fetch(&mut c, "big", 5, d.len() as u64).await == d);
    c.bye().await.unwrap();
    // and the dead client's QPs and MRs (its own and the server's per-connection ones) are gone
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (n, m) = (rc_qps(), mrs());
        if n == baseline && m == baseline_mrs {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{n} RC QPs and {m} MRs remain, expected {baseline} and {baseline_mrs}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_bad_input_gets_clear_errors_and_the_server_keeps_serving() {
    let dir = std::env::temp_dir().join("lab-bridge-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let ro = dir.join("ro.bin");
    std::fs::File::create(&ro)
        .unwrap()
        .write_all(&data(100_000, 3))
        .unwrap();
    let ro_spec = format!("ro=file:{}:ro", ro.display());
    // registrations per connection: the read-only file goes direct, so a forged write meets
    // the NIC (with windows it would go through bounce buffers and meet the server's refusal,
    // lab_storage_node covers that)
    let s = start(&["ram=host:1M", &ro_spec], |c| {
        c.hello_timeout = Duration::from_secs(2);
        c.sharing = p2p_rdma::bridge::SharingPolicy::PerConnection;
    })
    .await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();

    let e = c.open("nope", false).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownRegion), "{e}");
    assert!(e.to_string().contains("it serves: ram, ro"), "{e}");

    let r = c.open("ram", false).await.unwrap();
    let mut sink = Vec::new();
    let e = c
        .fetch(&r, 1 << 20, 1, &mut sink, false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::OutOfRange), "{e}");
    let e = c.checksum(&r, u64::MAX - 1, 10).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::OutOfRange), "{e}");

    let e = c.open("ro", true).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ReadOnly), "{e}");
    // the read-only region is registered without remote write: even a forged write (a client
    // that RDMA-WRITEs to a region it opened for reading) is refused by the NIC
    let mut forger = Client::connect(cfg(s.addr)).await.unwrap();
    let r = forger.open("ro", false).await.unwrap();
    let mut src: &[u8] = &[1, 2, 3];
    let e = forger
        .put(&r, 0, &mut src, Some(3), false, &mut |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::Verbs(verbs::Error::WorkCompletion { .. })),
        "{e}"
    );
    assert_eq!(
        std::fs::read(&ro).unwrap(),
        data(100_000, 3),
        "the read-only file changed"
    );

    // wrong token
    let mut bad = cfg(s.addr);
    bad.token = "wrong".into();
    let e = Client::connect(bad).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Unauthorized), "{e}");
    // nothing about regions before hello
    let m = raw(s.addr, &encode(&Msg::List)).await;
    assert_eq!(code_of(&m), Some(ErrorCode::Unauthorized));
    assert!(!m.iter().any(|m| matches!(m, Msg::Regions { .. })));
    // version mismatch
    let m = raw(
        s.addr,
        &encode(&Msg::Hello {
            version: 99,
            token: TOKEN.into(),
            client: "old".into(),
        }),
    )
    .await;
    assert_eq!(code_of(&m), Some(ErrorCode::BadVersion));
    // garbage and truncated frames
    assert_eq!(
        code_of(&raw(s.addr, b"GET / HTTP/1.1\r\n\r\n").await),
        Some(ErrorCode::BadRequest)
    );
    assert_eq!(
        code_of(&raw(s.addr, &[0, 0, 0, 4, b'{', b'x', b'}', b'!']).await),
        Some(ErrorCode::BadRequest)
    );
    assert_eq!(
        code_of(&raw(s.addr, &encode(&Msg::List)[..6]).await),
        Some(ErrorCode::BadRequest)
    );
    // a client that connects and says nothing is dropped after the hello timeout
    let mut silent = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let mut b = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(20), silent.read(&mut b))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "the server should close a silent connection");

    // and the first client is still fine
    let d = data(300_001, 5);
    put(&mut c, "ram", 17, &d).await;
    assert!(fetch(&mut c, "ram", 17, d.len() as u64).await == d);
    c.bye().await.unwrap();

    // a server that is not there
    let mut gone = cfg("127.0.0.1:1".parse().unwrap());
    gone.timeout = Duration::from_secs(5);
    let e = Client::connect(gone).await.unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_cli_exit_codes() {
    let dir = std::env::temp_dir().join("lab-bridge-cli");
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let input = dir.join("in.bin");
    std::fs::write(&input, data(1_234_567, 11)).unwrap();
    let s = start(&["ram=host:2M"], |_| {}).await;
    let a = s.addr.to_string();
    let bin = env!("CARGO_BIN_EXE_p2p-rdma");
    let run = |args: Vec<String>, env_token: bool| {
        let mut c = Command::new(bin);
        c.args(&args).env_remove("P2P_RDMA_TOKEN");
        if env_token {
            c.env("P2P_RDMA_TOKEN", TOKEN);
        }
        let o = c.output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
            o.stdout,
        )
    };
    let tf = token.display().to_string();
    let s_ = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let (code, err, _) = run(
        s_(&[
            "put",
            &a,
            "ram",
            "-i",
            &input.display().to_string(),
            "--token-file",
            &tf,
            "--verify",
        ]),
        false,
    );
    assert_eq!(code, Some(0), "{err}");
    let out = dir.join("out.bin");
    let (code, err, _) = run(
        s_(&[
            "fetch",
            &a,
            "ram",
            "--length",
            "1234567",
            "-o",
            &out.display().to_string(),
            "--verify",
            "--json",
        ]),
        true,
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), data(1_234_567, 11));
    let (code, _, stdout) = run(s_(&["ls", &a, "--json"]), true);
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(v[0]["name"], "ram");
    let (code, err, _) = run(s_(&["ls", &a]), false);
    assert_eq!(code, Some(4), "missing token: {err}");
    assert!(err.contains("P2P_RDMA_TOKEN"), "{err}");
    let (code, err, _) = run(s_(&["fetch", &a, "nope", "-o", "/dev/null"]), true);
    assert_eq!(code, Some(7), "unknown region (not found): {err}");
    let (code, err, _) = run(
        s_(&["fetch", &a, "ram", "--offset", "3M", "-o", "/dev/null"]),
        true,
    );
    assert_eq!(code, Some(2), "offset out of range (bad input): {err}");
    let (code, err, _) = run(
        s_(&[
            "put",
            &a,
            "ram",
            "-i",
            &input.display().to_string(),
            "--offset",
            "1M",
        ]),
        true,
    );
    assert_eq!(code, Some(2), "does not fit (bad input): {err}");
    let (code, err, _) = run(s_(&["ls", "127.0.0.1:1", "--timeout", "5"]), true);
    assert_eq!(code, Some(5), "unreachable: {err}");
    let (code, err, _) = run(
        s_(&["serve", "--region", "bad", "--token-file", &tf]),
        false,
    );
    assert_eq!(code, Some(2), "bad region spec: {err}");
    assert!(err.contains("NAME=host:SIZE"), "{err}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_connection_limit_refuses_with_busy() {
    let s = start(&["ram=host:1M"], |c| c.max_connections = 1).await;
    let first = Client::connect(cfg(s.addr)).await.unwrap();
    let e = Client::connect(cfg(s.addr)).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}");
    assert!(e.to_string().contains("limit of 1 connections"), "{e}");
    first.bye().await.unwrap();
    // the slot frees once the first client has gone
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match Client::connect(cfg(s.addr)).await {
            Ok(c) => {
                c.bye().await.unwrap();
                break;
            }
            Err(e) if e.code() == Some(ErrorCode::Busy) && std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bridge_serve_stops_gracefully_on_sigterm() {
    let ip = lab_ip();
    let dir = std::env::temp_dir().join("lab-bridge-sigterm");
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let addr = format!("{ip}:7479");
    let server = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args([
            "serve",
            "--listen",
            &addr,
            "--region",
            "ram=host:1M",
            "--token-file",
        ])
        .arg(&token)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let a: SocketAddr = addr.parse().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut c = loop {
        match Client::connect(cfg(a)).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "server never came up: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let r = c.open("ram", false).await.unwrap();
    let ok = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let out = tokio::task::spawn_blocking(move || server.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("shutting down") && err.contains("stopped"),
        "{err}"
    );
    // the connected client was told why
    let e = c.checksum(&r, 0, 1).await.unwrap_err();
    assert!(
        e.code() == Some(ErrorCode::ShuttingDown) || matches!(e, Error::Closed { .. }),
        "{e}"
    );
}
