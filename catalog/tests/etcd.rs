//! The catalog against a real etcd member: publish, list, resolve, watch, lease expiry after
//! a crash, etcd going away and coming back, hostile entries, etcd authentication and TLS.

#[path = "support/etcd_member.rs"]
mod etcd_member;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use catalog::publish::Source;
use catalog::{
    Catalog, CatalogEvent, CatalogOptions, NodeEntry, Publisher, PublisherConfig, RegionEntry,
};
use etcd_member::Etcd;

fn region(name: &str, node: &str, path: &str) -> RegionEntry {
    RegionEntry {
        region: name.into(),
        node: node.into(),
        endpoints: vec![format!("10.0.0.{}:7471", node.len())],
        size: 1 << 20,
        access: "ro".into(),
        kind: "host".into(),
        path: path.into(),
        strategy: Some("pinned".into()),
        nic: None,
    }
}

type Served = Arc<Mutex<Vec<RegionEntry>>>;

fn source(node: &str, served: &Served, connections: u64) -> Source {
    let node = node.to_string();
    let served = Arc::clone(served);
    Arc::new(move || {
        (
            NodeEntry {
                node: node.clone(),
                endpoints: vec!["10.0.0.1:7471".into()],
                nics: vec!["rxe0".into()],
                connections,
                version: "test".into(),
            },
            served.lock().unwrap().clone(),
        )
    })
}

fn config(e: &Etcd, prefix: &str, node: &str, ttl: u64) -> PublisherConfig {
    let mut c = PublisherConfig::new(e.url(prefix), node);
    c.ttl = Duration::from_secs(ttl);
    c.interval = Duration::from_millis(200);
    c.options.timeout = Duration::from_secs(2);
    c
}

async fn catalog(e: &Etcd, prefix: &str) -> Catalog {
    let o = CatalogOptions {
        timeout: Duration::from_secs(2),
        ..CatalogOptions::default()
    };
    Catalog::connect(&e.url(prefix), &o).await.unwrap()
}

async fn until<F: std::future::Future<Output = bool>>(
    what: &str,
    secs: u64,
    mut f: impl FnMut() -> F,
) -> Duration {
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    start.elapsed()
}

async fn nodes_of(c: &Catalog, region: &str) -> Vec<String> {
    match c.resolve(region).await {
        Ok(v) => v.into_iter().map(|r| r.entry.node).collect(),
        Err(catalog::Error::NotFound { .. }) => vec![],
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_list_resolve_watch_and_stop() {
    let e = Etcd::start();
    let served: Served = Arc::new(Mutex::new(vec![
        region("img", "a", "direct"),
        region("logs", "a", "bounce"),
    ]));
    let p = Publisher::start(config(&e, "t1", "a", 5), source("a", &served, 3)).unwrap();
    let st = p.published(Duration::from_secs(10)).await;
    assert!(st.published, "{st:?}");
    assert_eq!(st.keys, 3);
    let c = catalog(&e, "t1").await;
    let l = c.list().await.unwrap();
    assert_eq!(l.nodes.len(), 1);
    assert_eq!(l.nodes[0].connections, 3);
    let names: Vec<_> = l.regions.iter().map(|r| r.region.as_str()).collect();
    assert_eq!(names, ["img", "logs"]);
    assert!(l.skipped.is_empty(), "{:?}", l.skipped);
    assert!(l.bytes > 0 && l.keys == 3);

    let mut w = c.watch(Some(l.revision)).await.unwrap();
    served.lock().unwrap().push(region("new", "a", "direct"));
    let ev = tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(ev, CatalogEvent::RegionUp(region("new", "a", "direct")));
    served.lock().unwrap().retain(|r| r.region != "logs");
    let ev = tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        ev,
        CatalogEvent::RegionDown {
            region: "logs".into(),
            node: "a".into()
        }
    );
    // another prefix is another catalog
    assert!(catalog(&e, "t1other").await.list().await.unwrap().keys == 0);

    // stop revokes the lease: everything of the node goes at once
    let st = p.stop().await;
    assert!(!st.published);
    let mut downs = vec![];
    while downs.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            CatalogEvent::RegionDown { region, .. } => downs.push(region),
            CatalogEvent::NodeDown(n) => downs.push(format!("node {n}")),
            other => panic!("{other:?}"),
        }
    }
    downs.sort();
    assert_eq!(downs, ["img", "new", "node a"]);
    assert_eq!(c.list().await.unwrap().keys, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_node_leaves_within_the_ttl_and_its_replica_stays() {
    let e = Etcd::start();
    let served_a: Served = Arc::new(Mutex::new(vec![region("rep", "a", "direct")]));
    let served_b: Served = Arc::new(Mutex::new(vec![region("rep", "b", "direct")]));
    // node a in a runtime of its own: dropping it ends the task without revoking, as a
    // SIGKILL would (nothing is sent to etcd any more)
    let cfg_a = config(&e, "t2", "a", 3);
    let src_a = source("a", &served_a, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let p = rt.block_on(async {
            let p = Publisher::start(cfg_a, src_a).unwrap();
            assert!(p.published(Duration::from_secs(10)).await.published);
            p
        });
        tx.send(()).unwrap();
        kill_rx.recv().unwrap();
        std::mem::forget(p);
        rt.shutdown_background();
    });
    rx.recv().unwrap();
    let pb = Publisher::start(config(&e, "t2", "b", 3), source("b", &served_b, 9)).unwrap();
    assert!(pb.published(Duration::from_secs(10)).await.published);
    let c = catalog(&e, "t2").await;
    // a has fewer connections: it comes first
    assert_eq!(nodes_of(&c, "rep").await, ["a", "b"]);
    kill_tx.send(()).unwrap();
    t.join().unwrap();
    let gone = until("node a's entries expire", 8, || async {
        nodes_of(&c, "rep").await == ["b"]
    })
    .await;
    eprintln!(
        "node a left the catalog {:.1} s after it died (TTL 3 s)",
        gone.as_secs_f64()
    );
    assert!(gone <= Duration::from_secs(4), "{gone:?}");
    assert!(c.list().await.unwrap().nodes.iter().all(|n| n.node == "b"));
    pb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_then_back_republishes_and_errors_name_the_members() {
    let mut e = Etcd::start();
    let served: Served = Arc::new(Mutex::new(vec![region("img", "a", "direct")]));
    let p = Publisher::start(config(&e, "t3", "a", 3), source("a", &served, 0)).unwrap();
    assert!(p.published(Duration::from_secs(10)).await.published);
    let c = catalog(&e, "t3").await;
    assert_eq!(nodes_of(&c, "img").await, ["a"]);

    e.kill();
    let err = c.resolve("img").await.unwrap_err().to_string();
    assert!(err.contains(&e.endpoint()), "{err}");
    assert!(err.contains("resolve"), "{err}");
    // a new client cannot list either, and says where it looked
    let o = CatalogOptions {
        timeout: Duration::from_secs(1),
        ..CatalogOptions::default()
    };
    let fresh = Catalog::connect(&e.url("t3"), &o).await;
    let err = match fresh {
        Ok(c) => c.list().await.unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(&e.endpoint()), "{err}");
    until("the publisher notices", 10, || async {
        !p.status().published
    })
    .await;
    // changes while etcd is away are published when it is back
    served
        .lock()
        .unwrap()
        .push(region("while-down", "a", "direct"));

    e.launch();
    let back = until("republished", 20, || async {
        let s = p.status();
        s.published && s.leases >= 2
    })
    .await;
    eprintln!(
        "republished {:.1} s after etcd came back",
        back.as_secs_f64()
    );
    until("both regions listed", 10, || async {
        nodes_of(&c, "while-down").await == ["a"] && nodes_of(&c, "img").await == ["a"]
    })
    .await;
    assert!(p.status().error.is_none());
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_regions_cross_the_transaction_limit() {
    let e = Etcd::start();
    let many: Vec<RegionEntry> = (0..1000)
        .map(|i| region(&format!("r{i:04}"), "a", "direct"))
        .collect();
    let served: Served = Arc::new(Mutex::new(many));
    let p = Publisher::start(config(&e, "t4", "a", 10), source("a", &served, 0)).unwrap();
    let st = p.published(Duration::from_secs(60)).await;
    assert!(st.published, "{st:?}");
    assert_eq!(st.keys, 1001);
    let l = catalog(&e, "t4").await.list().await.unwrap();
    assert_eq!(l.regions.len(), 1000);
    eprintln!(
        "1000 regions: published in {:.2} s; catalog {} keys, {} bytes",
        st.first_publish_seconds.unwrap(),
        l.keys,
        l.bytes
    );
    // removing half deletes exactly those
    served.lock().unwrap().truncate(500);
    let c = catalog(&e, "t4").await;
    until("500 removed", 20, || async {
        c.list().await.unwrap().regions.len() == 500
    })
    .await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_entries_are_skipped_with_the_reason() {
    let e = Etcd::start();
    let mut raw = etcd_client::Client::connect([format!("http://{}", e.endpoint())], None)
        .await
        .unwrap();
    let good = serde_json::to_string(&region("img", "a", "direct")).unwrap();
    raw.put("t5/v1/regions/img/a", good.clone(), None)
        .await
        .unwrap();
    // a value naming another region, garbage, an oversized value, a foreign key
    raw.put("t5/v1/regions/img/b", good, None).await.unwrap();
    raw.put("t5/v1/regions/x/a", "{not json", None)
        .await
        .unwrap();
    raw.put("t5/v1/regions/y/a", vec![b' '; 20_000], None)
        .await
        .unwrap();
    raw.put("t5/v1/regions/bad name/a", "{}", None)
        .await
        .unwrap();
    let c = catalog(&e, "t5").await;
    let l = c.list().await.unwrap();
    assert_eq!(l.regions.len(), 1);
    assert_eq!(l.skipped.len(), 3, "{:?}", l.skipped);
    assert!(l.skipped.iter().any(|s| s.contains("t5/v1/regions/img/b")));
    assert!(l.skipped.iter().any(|s| s.contains("limit")));
    assert_eq!(nodes_of(&c, "img").await, ["a"]);
    assert!(matches!(
        c.resolve("x").await,
        Err(catalog::Error::NotFound { .. })
    ));
    assert!(c.resolve("../x").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_authentication_is_used_and_its_refusal_explained() {
    let e = Etcd::start();
    let mut raw = etcd_client::Client::connect([format!("http://{}", e.endpoint())], None)
        .await
        .unwrap();
    raw.user_add("root", "rootpw", None).await.unwrap();
    raw.user_grant_role("root", "root").await.unwrap();
    raw.auth_enable().await.unwrap();

    let url = e.url("t6");
    let mut cfg = config(&e, "t6", "a", 5);
    cfg.options.user = Some(("root".into(), "rootpw".into()));
    let served: Served = Arc::new(Mutex::new(vec![region("img", "a", "direct")]));
    let p = Publisher::start(cfg, source("a", &served, 0)).unwrap();
    assert!(p.published(Duration::from_secs(10)).await.published);

    let anon = Catalog::connect(&url, &CatalogOptions::default())
        .await
        .unwrap();
    let err = anon.list().await.unwrap_err().to_string();
    assert!(err.contains(&e.endpoint()) && err.contains("list"), "{err}");
    let wrong = CatalogOptions {
        user: Some(("root".into(), "nope".into())),
        ..CatalogOptions::default()
    };
    let err = Catalog::connect(&url, &wrong)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("connect"), "{err}");
    let ok = CatalogOptions {
        user: Some(("root".into(), "rootpw".into())),
        ..CatalogOptions::default()
    };
    let c = Catalog::connect(&url, &ok).await.unwrap();
    assert_eq!(nodes_of(&c, "img").await, ["a"]);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tls_with_client_certificates() {
    let e = Etcd::start_tls();
    let pki = e.tls.as_ref().unwrap();
    let url = e.url("t7");
    assert!(url.tls, "{url}");
    let mine = CatalogOptions {
        ca: Some(pki.ca.clone()),
        identity: Some(pki.client.clone()),
        timeout: Duration::from_secs(5),
        ..CatalogOptions::default()
    };

    // a node publishes over TLS, a client resolves over TLS
    let mut cfg = config(&e, "t7", "a", 5);
    cfg.options = mine.clone();
    let served: Served = Arc::new(Mutex::new(vec![region("img", "a", "direct")]));
    let p = Publisher::start(cfg, source("a", &served, 0)).unwrap();
    assert!(p.published(Duration::from_secs(15)).await.published);
    let c = Catalog::connect(&url, &mine).await.unwrap();
    assert_eq!(nodes_of(&c, "img").await, ["a"]);

    // refusals, each naming the member and the operation
    let refused = |o: CatalogOptions, url: catalog::CatalogUrl, why: &'static str| async move {
        let r = match Catalog::connect(&url, &o).await {
            Ok(c) => c.list().await.map(|_| ()),
            Err(e) => Err(e),
        };
        let err = r.expect_err(why);
        let text = err.to_string();
        assert!(text.contains(&e_endpoint(&url)), "{why}: {text}");
        assert!(
            text.contains("list") || text.contains("connect"),
            "{why}: {text}"
        );
        text
    };
    // the client certificate refused: said so (TLS 1.3 may also just close the connection)
    let cert_refused = |t: &str| {
        t.contains("refused our TLS client certificate") || t.contains("closed the connection")
    };
    // no client certificate: the member requires one
    let no_cert = CatalogOptions {
        identity: None,
        ..mine.clone()
    };
    let t = refused(no_cert, url.clone(), "a client without a certificate").await;
    assert!(cert_refused(&t), "{t}");
    // a certificate from a CA the member does not trust
    let stranger = CatalogOptions {
        identity: Some(pki.stranger.clone()),
        ..mine.clone()
    };
    let t = refused(stranger, url.clone(), "a certificate of another CA").await;
    assert!(cert_refused(&t), "{t}");
    // the member's certificate checked against the system roots only: not trusted
    let roots_only = CatalogOptions {
        ca: None,
        ..mine.clone()
    };
    let t = refused(roots_only, url.clone(), "the system roots").await;
    assert!(
        t.contains("not trusted here") && t.contains("--catalog-ca"),
        "{t}"
    );
    // plain etcd:// to a TLS member
    let plain: catalog::CatalogUrl = format!("etcd://{}/t7", e.endpoint()).parse().unwrap();
    let t = refused(
        CatalogOptions {
            timeout: Duration::from_secs(5),
            ..CatalogOptions::default()
        },
        plain.clone(),
        "plain text to a TLS member",
    )
    .await;
    assert!(t.contains("plain etcd:// URL"), "{t}");
    // TLS files with a plain URL: a configuration error before any request
    let err = Catalog::connect(&plain, &mine).await.unwrap_err();
    assert!(matches!(err, catalog::Error::Config(_)), "{err}");
    assert!(err.to_string().contains("etcds://"), "{err}");
    p.stop().await;
}

fn e_endpoint(url: &catalog::CatalogUrl) -> String {
    url.endpoints[0].clone()
}

async fn next_event(w: &mut catalog::CatalogWatch, secs: u64) -> CatalogEvent {
    tokio::time::timeout(Duration::from_secs(secs), w.next())
        .await
        .unwrap_or_else(|_| panic!("no catalog event within {secs} s"))
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_survives_etcd_going_away_and_misses_nothing() {
    let mut e = Etcd::start();
    let ep = format!("http://{}", e.endpoint());
    let raw = || async {
        etcd_client::Client::connect([ep.clone()], None)
            .await
            .unwrap()
    };
    let put = |c: &mut etcd_client::Client, name: &'static str| {
        let v = serde_json::to_string(&region(name, "a", "direct")).unwrap();
        let mut c = c.clone();
        async move {
            c.put(format!("t8/v1/regions/{name}/a"), v, None)
                .await
                .unwrap()
                .header()
                .unwrap()
                .revision()
        }
    };
    let mut r = raw().await;
    put(&mut r, "one").await;
    let c = catalog(&e, "t8").await;
    let l = c.list().await.unwrap();
    let mut w = c.watch(Some(l.revision)).await.unwrap();
    put(&mut r, "two").await;
    assert_eq!(
        next_event(&mut w, 5).await,
        CatalogEvent::RegionUp(region("two", "a", "direct"))
    );

    // etcd goes away: said once
    e.kill();
    match next_event(&mut w, 30).await {
        CatalogEvent::Interrupted(why) => {
            assert!(why.contains(&e.endpoint()), "{why}")
        }
        other => panic!("{other:?}"),
    }
    // back (same data): a change made before the watch is back is delivered after Resumed
    e.launch();
    let mut r = raw().await;
    put(&mut r, "three").await;
    assert_eq!(next_event(&mut w, 30).await, CatalogEvent::Resumed);
    assert_eq!(
        next_event(&mut w, 5).await,
        CatalogEvent::RegionUp(region("three", "a", "direct"))
    );

    // a watch from a compacted revision: the catalog is listed again instead
    let now = put(&mut r, "four").await;
    r.compact(now, None).await.unwrap();
    let mut old = c.watch(Some(l.revision)).await.unwrap();
    match next_event(&mut old, 10).await {
        CatalogEvent::Relisted(l) => {
            let names: Vec<_> = l.regions.iter().map(|r| r.region.as_str()).collect();
            assert_eq!(names, ["four", "one", "three", "two"]);
            assert_eq!(l.revision, now);
        }
        other => panic!("{other:?}"),
    }
    // and goes on from there
    put(&mut r, "five").await;
    assert_eq!(
        next_event(&mut old, 10).await,
        CatalogEvent::RegionUp(region("five", "a", "direct"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_adopts_its_earlier_keys_and_drops_what_it_no_longer_serves() {
    let e = Etcd::start();
    // run 1 of node a serves img and old, then dies without revoking its lease (30 s TTL)
    let run1: Served = Arc::new(Mutex::new(vec![
        region("img", "a", "direct"),
        region("old", "a", "direct"),
    ]));
    let (cfg, src) = (config(&e, "t9", "a", 30), source("a", &run1, 0));
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let p = rt.block_on(async {
            let p = Publisher::start(cfg, src).unwrap();
            assert!(p.published(Duration::from_secs(10)).await.published);
            p
        });
        std::mem::forget(p);
        rt.shutdown_background();
    })
    .join()
    .unwrap();
    // node b serves old too, and node a2 (a name a is a prefix of) serves img
    let b: Served = Arc::new(Mutex::new(vec![region("old", "b", "direct")]));
    let a2: Served = Arc::new(Mutex::new(vec![region("img", "a2", "direct")]));
    let pb = Publisher::start(config(&e, "t9", "b", 30), source("b", &b, 0)).unwrap();
    let pa2 = Publisher::start(config(&e, "t9", "a2", 30), source("a2", &a2, 0)).unwrap();
    assert!(pb.published(Duration::from_secs(10)).await.published);
    assert!(pa2.published(Duration::from_secs(10)).await.published);
    let c = catalog(&e, "t9").await;
    assert_eq!(nodes_of(&c, "old").await.len(), 2);

    // run 2 of node a, well within the old lease's TTL, serves img only
    let run2: Served = Arc::new(Mutex::new(vec![region("img", "a", "direct")]));
    let pa = Publisher::start(config(&e, "t9", "a", 30), source("a", &run2, 0)).unwrap();
    assert!(pa.published(Duration::from_secs(10)).await.published);
    assert_eq!(
        nodes_of(&c, "old").await,
        ["b"],
        "a's old entry is gone now"
    );
    let mut img = nodes_of(&c, "img").await;
    img.sort();
    assert_eq!(img, ["a", "a2"]);
    // and run 2's keys hang on its own lease: its stop takes them all
    pa.stop().await;
    let l = c.list().await.unwrap();
    assert!(l.regions.iter().all(|r| r.node != "a"), "{:?}", l.regions);
    assert!(l.nodes.iter().all(|n| n.node != "a"), "{:?}", l.nodes);
    pb.stop().await;
    pa2.stop().await;
}
