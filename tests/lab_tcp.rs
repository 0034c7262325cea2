//! Lab tests of the TCP data path: a client without an RDMA device fetches and puts over its
//! control connection, with the same regions, checks and verification, and the CLI picks it
//! by itself (and says so) on a host where no RDMA device shows.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use p2p_rdma::bridge::protocol::{DataPath, ErrorCode};
use p2p_rdma::bridge::{Client, ClientConfig, Transport};

fn tcp_client(addr: std::net::SocketAddr) -> ClientConfig {
    let mut c = client_config(addr, 256 << 10, 4);
    c.transport = Transport::Tcp;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_tcp_clients_fetch_and_put_every_kind_of_region() {
    let dir = std::env::temp_dir().join("lab-tcp");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("f.bin");
    std::fs::write(&file, data(1 << 20, 8)).unwrap();
    let file_spec = format!("f=file:{}", file.display());
    let s = start(&["mix=host:4M,window=1M", "ro=host:1M", &file_spec], |c| {
        c.bounce_chunk = 128 << 10
    })
    .await;
    let mut notices = s.handle.put_notices();
    let mut c = Client::connect(tcp_client(s.addr)).await.unwrap();
    // put and fetch across the direct and the bounce part of a mixed region
    let mix = c.open("mix", true).await.unwrap();
    assert_eq!(mix.remote.len, 0, "a TCP client holds no rkey: {mix:?}");
    let d = data(3 << 20, 21);
    let put = c
        .put(&mix, 12_345, &mut d.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(
        (put.tcp_bytes, put.direct_bytes, put.bounce_bytes),
        (d.len() as u64, 0, 0)
    );
    assert!(put.verified);
    assert_eq!(c.tcp_reason(), Some("the TCP transport was asked for"));
    let mut sink = Vec::new();
    let got = c
        .fetch(&mix, 12_345, d.len() as u64, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert!(got.verified && sink == d);
    assert_eq!(got.tcp_bytes, d.len() as u64);
    // the time to first byte is within the fetch; a put has none
    let first = got.first_bytes_ms.expect("a fetch's first bytes");
    assert!(first > 0.0 && first <= got.seconds * 1e3, "{got:?}");
    assert_eq!(put.first_bytes_ms, None);
    // a put is noticed, chunk by chunk, as a TCP put
    let n = tokio::time::timeout(Duration::from_secs(10), notices.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (n.region.as_str(), n.offset, n.path),
        ("mix", 12_345, DataPath::Tcp)
    );
    // a file region: durable when the put returns
    let f = c.open("f", true).await.unwrap();
    let patch = data(300_000, 2);
    c.put(&f, 1000, &mut patch.as_slice(), None, true, &mut |_| {})
        .await
        .unwrap();
    assert!(std::fs::read(&file).unwrap()[1000..301_000] == patch[..]);
    // refusals keep the connection in step: a put through a handle opened for reading (its
    // bytes are dropped by the server), a range past the end
    let ro = c.open("ro", false).await.unwrap();
    let e = c
        .put(&ro, 0, &mut &[1u8; 5000][..], None, false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ReadOnly), "{e}");
    let mut sink = Vec::new();
    let e = c
        .fetch(&ro, (1 << 20) - 10, 11, &mut sink, false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::OutOfRange), "{e}");
    let mut sink = Vec::new();
    c.fetch(&ro, 0, 1 << 20, &mut sink, true, &mut |_| {})
        .await
        .unwrap();
    assert!(sink.iter().all(|&b| b == 0));
    // removal: a TCP client's next request is refused, not served from freed memory
    s.handle
        .remove_region("ro", Duration::from_secs(5))
        .await
        .unwrap();
    let e = c
        .fetch(&ro, 0, 4096, &mut Vec::new(), false, &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Removed), "{e}");
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_cli_without_an_rdma_device_fetches_and_puts_over_tcp_and_says_why() {
    let s = start(&["ram=host:2M"], |_| {}).await;
    let dir = std::env::temp_dir().join("lab-tcp-cli");
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    std::fs::write(&input, data(1_500_000, 5)).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let bin = env!("CARGO_BIN_EXE_p2p-rdma");
    // a host where no RDMA device shows: in a mount namespace, empty directories over the
    // device nodes and the sysfs classes (libibverbs may list devices over netlink, but cannot
    // open one without its /dev/infiniband node)
    let no_rdma = |args: String| {
        let script = format!(
            "for d in /dev/infiniband /sys/class/infiniband /sys/class/infiniband_verbs; do \
             mount -t tmpfs none $d || exit 99; done; exec {bin} {args} --token-file {}",
            token.display()
        );
        let addr = s.addr;
        async move {
            tokio::task::spawn_blocking(move || {
                Command::new("unshare")
                    .args(["-m", "sh", "-c", &script])
                    .env_remove("P2P_RDMA_DEVICE")
                    .output()
                    .expect("unshare (util-linux)")
            })
            .await
            .map(|o| (o, addr))
            .unwrap()
        }
    };
    let (out, addr) = no_rdma(format!(
        "put {} ram -i {} --verify",
        s.addr,
        input.display()
    ))
    .await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("the bytes went over TCP: no RDMA device on this host"),
        "{err}"
    );
    assert!(err.contains("verified"), "{err}");
    let (out, _) = no_rdma(format!(
        "fetch {addr} ram --length 1500000 -o {} --verify --json",
        output.display()
    ))
    .await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["tcp_bytes"], 1_500_000, "{rep}");
    assert_eq!(rep["verified"], true, "{rep}");
    assert_eq!(std::fs::read(&output).unwrap(), data(1_500_000, 5));
    // --transport rdma on that host: the device error, not a silent fallback
    let (out, _) = no_rdma(format!(
        "fetch {addr} ram --length 4096 -o {} --transport rdma",
        output.display()
    ))
    .await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("over TCP"), "{err}");
    s.stop().await;
}
