//! The command line against a catalog on a real etcd member (no RDMA needed): the cluster
//! listing, fetch by name when every replica is unreachable or the name unknown, etcd down,
//! and a bad `[catalog]` in a config file.

#[path = "../catalog/tests/support/etcd_member.rs"]
mod etcd_member;

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use catalog::{NodeEntry, Publisher, PublisherConfig, RegionEntry};

fn bin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(args)
        .env("P2P_RDMA_TOKEN", "t")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn publish(url: catalog::CatalogUrl) -> Publisher {
    let mut cfg = PublisherConfig::new(url, "n1");
    cfg.interval = Duration::from_millis(200);
    Publisher::start(cfg, publish_source()).unwrap()
}

/// Node n1 serving `img`, at a control port that refuses connections: it died without revoking
/// its lease.
fn publish_source() -> catalog::publish::Source {
    let ep = "127.0.0.1:1".to_string();
    Arc::new(move || {
        (
            NodeEntry {
                node: "n1".into(),
                endpoints: vec![ep.clone()],
                nics: vec!["rxe0".into()],
                connections: 0,
                version: "t".into(),
            },
            vec![RegionEntry {
                region: "img".into(),
                node: "n1".into(),
                endpoints: vec![ep.clone()],
                size: 4096,
                access: "ro".into(),
                kind: "file".into(),
                path: "direct".into(),
                strategy: Some("pinned".into()),
                nic: Some("rxe0".into()),
            }],
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_and_fetch_by_name_say_what_happened() {
    let e = etcd_member::Etcd::start();
    let url = e.url("cli");
    let p = publish(url.clone());
    assert!(p.published(Duration::from_secs(10)).await.published);
    let u = url.to_string();

    let o = bin(&["ls", &u]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("img") && text.contains("n1") && text.contains("127.0.0.1:1"),
        "{text}"
    );
    assert!(text.contains("1 region entry on 1 node"), "{text}");
    let o = bin(&["ls", &u, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["regions"][0]["region"], "img");
    assert_eq!(v["nodes"][0]["nics"][0], "rxe0");

    // every replica unreachable: exit 5 (unreachable), each one named with its error
    let o = bin(&["fetch", &u, "img", "-o", "/dev/null", "--timeout", "2"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("node n1 at 127.0.0.1:1"),
        "{}",
        stderr(&o)
    );
    // unknown name: exit 7, and where to look
    let o = bin(&["fetch", &u, "nope", "-o", "/dev/null"]);
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("p2p-rdma ls {u}")),
        "{}",
        stderr(&o)
    );
    // a node that does not serve it
    let o = bin(&["fetch", &u, "img", "--node", "n2", "-o", "/dev/null"]);
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    assert!(stderr(&o).contains("served by: n1"), "{}", stderr(&o));
    // --node without a catalog
    let o = bin(&[
        "fetch",
        "127.0.0.1:1",
        "img",
        "--node",
        "n1",
        "-o",
        "/dev/null",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    p.stop().await;
    let o = bin(&["ls", &u, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["keys"], 0, "a stopped publisher leaves nothing");
}

#[test]
fn etcd_down_and_bad_settings() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let u = format!("etcd://127.0.0.1:{port}/x");
    for args in [
        vec!["ls", u.as_str(), "--catalog-timeout", "1"],
        vec![
            "fetch",
            u.as_str(),
            "img",
            "-o",
            "/dev/null",
            "--catalog-timeout",
            "1",
        ],
    ] {
        let o = bin(&args);
        assert_eq!(o.status.code(), Some(5), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("etcd at 127.0.0.1:{port}")),
            "{}",
            stderr(&o)
        );
    }
    let o = bin(&["ls", "etcd://h:70000/x"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("port '70000'"), "{}", stderr(&o));
    let o = bin(&["ls", "10.0.0.1:7471", "--watch"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = bin(&["ls", &u, "--catalog-user", "me", "--catalog-timeout", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("P2P_RDMA_ETCD_PASSWORD"),
        "{}",
        stderr(&o)
    );

    let dir = std::env::temp_dir().join(format!("p2p-cat-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("serve.toml");
    std::fs::write(&f, "[catalog]\nurl = \"http://x:1\"\n").unwrap();
    let o = bin(&["serve", "--check-config", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("catalog.url"), "{}", stderr(&o));
    std::fs::write(
        &f,
        "[catalog]\nurl = \"etcd://x:1/p\"\nnode = \"a\"\nttl_secs = 5\n",
    )
    .unwrap();
    let o = bin(&["serve", "--check-config", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_over_etcd_tls_with_a_client_certificate() {
    let e = etcd_member::Etcd::start_tls();
    let pki = e.tls.as_ref().unwrap();
    let url = e.url("tls");
    let u = url.to_string();
    assert!(u.starts_with("etcds://"), "{u}");
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (ca, cert, key) = (s(&pki.ca), s(&pki.client.0), s(&pki.client.1));
    let mut cfg = PublisherConfig::new(url, "n1");
    cfg.options.ca = Some(pki.ca.clone());
    cfg.options.identity = Some(pki.client.clone());
    cfg.interval = Duration::from_millis(200);
    let p = Publisher::start(cfg, publish_source()).unwrap();
    assert!(p.published(Duration::from_secs(10)).await.published);

    let tls = [
        "--catalog-ca",
        &ca,
        "--catalog-cert",
        &cert,
        "--catalog-key",
        &key,
    ];
    let o = bin(&[&["ls", &u, "--json"][..], &tls].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["regions"][0]["region"], "img");
    // without our certificate: refused by etcd, exit 4 (authentication) or 1, said so
    let o = bin(&["ls", &u, "--catalog-ca", &ca, "--catalog-timeout", "5"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("client certificate") || stderr(&o).contains("closed the connection"),
        "{}",
        stderr(&o)
    );
    // without the CA: etcd's certificate is not trusted, exit 4
    let o = bin(&[
        "ls",
        &u,
        "--catalog-cert",
        &cert,
        "--catalog-key",
        &key,
        "--catalog-timeout",
        "5",
    ]);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("--catalog-ca"), "{}", stderr(&o));
    // a certificate without its key: a usage error before any request
    let o = bin(&["ls", &u, "--catalog-cert", &cert]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    p.stop().await;
}
