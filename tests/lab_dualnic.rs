//! Lab tests of a server on two NICs (soft-roce/lab --topology switch --nics 2: each NVMe with
//! a CMB sits under its own PCIe switch beside its own e1000e, rxe0 on 10.77.0.1 and rxe1 on
//! 10.77.1.1): each region's registrations go to the NIC the topology ranks best for its
//! memory (or the one it names), clients connect their QP there on their own, and a client
//! held to the other NIC still gets every byte, through bounce buffers, told why.
use std::process::Command;

use p2p_rdma::bridge::protocol::{DataPath, ErrorCode};
use p2p_rdma::bridge::{Client, ClientConfig, Error};
use serde_json::Value;

mod common;
use common::{data, start, LAB, TOKEN};

/// That this is the two-NIC guest.
fn two_nics() {
    assert_eq!(
        std::env::var("P2P_LAB_NICS").as_deref(),
        Ok("2"),
        "needs the two-NIC guest (soft-roce/lab --topology switch --nics 2). {LAB}"
    );
}

/// (nvme name, the RDMA device ranked first for it) for each NVMe with a CMB.
fn cmbs_and_their_nics() -> Vec<(String, String)> {
    two_nics();
    let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["topo", "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("topo: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    let best = v["best_nics"].as_array().expect("best_nics with two NICs");
    let mut out = Vec::new();
    for m in v["memory_devices"].as_array().unwrap() {
        let (Some(nvme), Some(_)) = (m["nvme"].as_str(), m["p2pmem"].as_object()) else {
            continue;
        };
        let b = best
            .iter()
            .find(|b| b["device_pci"] == m["bdf"])
            .unwrap_or_else(|| panic!("no best NIC for {nvme}: {v}"));
        out.push((
            nvme.to_string(),
            b["rdma_device"].as_str().unwrap().to_string(),
        ));
    }
    out.sort();
    assert_eq!(out.len(), 2, "two CMBs: {v}");
    assert_ne!(out[0].1, out[1].1, "each CMB has its own NIC: {out:?}");
    out
}

fn other(nic: &str) -> &'static str {
    if nic == "rxe0" {
        "rxe1"
    } else {
        "rxe0"
    }
}

/// A client with no preference lands on `home` and moves every byte one-sided; one held to
/// the other NIC gets every byte through bounce buffers, told why.
async fn follows_the_region(addr: &str, name: &str, home: &str, seed: u32) {
    let len = 1u64 << 20;
    let mut c = Client::connect(ClientConfig::new(addr, TOKEN))
        .await
        .unwrap();
    assert_eq!(c.server_nics().len(), 2, "{:?}", c.server_nics());
    let r = c.open(name, true).await.unwrap();
    assert_eq!(c.server_nic(), Some(home), "{name}");
    assert_eq!(r.info.path, DataPath::Direct, "{:?}", r.info);
    let bytes = data(len as usize, seed);
    let put = c
        .put(&r, 0, &mut &bytes[..], Some(len), true, &mut |_| {})
        .await
        .unwrap();
    assert_eq!((put.direct_bytes, put.bounce_bytes), (len, 0), "{put:?}");
    let mut got = Vec::new();
    let rep = c
        .fetch(&r, 0, len, &mut got, true, &mut |_| {})
        .await
        .unwrap();
    assert!(rep.verified && rep.direct_bytes == len, "{rep:?}");
    assert!(
        got == bytes,
        "{name}: the bytes fetched differ from those put"
    );
    c.close(&r).await.unwrap();
    c.bye().await.unwrap();

    // the region's MR is not in the other NIC's protection domain: the open says bounce, and
    // why, and the bytes still arrive
    let mut cfg = ClientConfig::new(addr, TOKEN);
    cfg.server_nic = Some(other(home).into());
    let mut c = Client::connect(cfg).await.unwrap();
    let r = c.open(name, false).await.unwrap();
    assert_eq!(c.server_nic(), Some(other(home)));
    assert_eq!(r.info.path, DataPath::Bounce, "{:?}", r.info);
    assert!(
        r.info.reason.contains(&format!("registered on {home}")),
        "{}",
        r.info.reason
    );
    let mut got = Vec::new();
    let rep = c
        .fetch(&r, 0, len, &mut got, true, &mut |_| {})
        .await
        .unwrap();
    assert!(rep.verified && rep.bounce_bytes == len, "{rep:?}");
    assert!(
        got == bytes,
        "{name} through the other NIC: the bytes differ"
    );
    c.bye().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_dualnic_serve_places_each_region_on_its_nic_and_clients_follow() {
    let cmbs = cmbs_and_their_nics();
    let specs: Vec<String> = cmbs
        .iter()
        .enumerate()
        .map(|(i, (nvme, _))| format!("c{i}=cmb:{nvme}:1M"))
        .chain(["ram0=host:4M".into(), "ram1=host:4M,nic=rxe1".into()])
        .collect();
    let specs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let s = start(&specs, |c| {
        c.device = Some("rxe0".into());
        c.more_devices = vec!["rxe1".into()];
    })
    .await;
    let listed = s.handle.regions();
    let region = |name: &str| {
        listed
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("{name} not served: {listed:?}"))
            .clone()
    };
    // host memory is on no PCI device: the first NIC, unless the region names one
    let ram0 = region("ram0");
    assert_eq!(ram0.nic.as_deref(), Some("rxe0"), "{ram0:?}");
    assert!(
        ram0.reason.contains("not on a PCI device"),
        "{}",
        ram0.reason
    );
    let ram1 = region("ram1");
    assert_eq!(ram1.nic.as_deref(), Some("rxe1"), "{ram1:?}");
    assert!(
        ram1.reason.contains("as the region asks"),
        "{}",
        ram1.reason
    );
    // a CMB's registrations are tried on the NIC beside it; rxe reaches no p2pmem mapping
    // (pinned: EFAULT, ODP: the canary fails), so it goes through bounce buffers, which any
    // NIC serves alike: no NIC is named
    for (i, (nvme, best)) in cmbs.iter().enumerate() {
        let c = region(&format!("c{i}"));
        assert_eq!(
            (c.path, c.nic.as_deref()),
            (DataPath::Bounce, None),
            "{c:?}"
        );
        assert!(
            c.reason.contains(&format!("({best}: "))
                && !c.reason.contains(&format!("({}: ", other(best))),
            "{nvme}: the registrations ran on {best}: {}",
            c.reason
        );
        let mut cl = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
            .await
            .unwrap();
        let r = cl.open(&c.name, false).await.unwrap();
        assert_eq!(
            r.info.reason, c.reason,
            "a bounce-only region is the same from any NIC"
        );
        let mut got = Vec::new();
        let rep = cl
            .fetch(&r, 0, c.size, &mut got, true, &mut |_| {})
            .await
            .unwrap();
        assert!(rep.verified && rep.bounce_bytes == c.size, "{rep:?}");
        cl.bye().await.unwrap();
    }

    let addr = s.addr.to_string();
    follows_the_region(&addr, "ram0", "rxe0", 40).await;
    follows_the_region(&addr, "ram1", "rxe1", 41).await;

    // a NIC the server does not serve from is refused, naming those it does; so is a region
    // that asks for one
    let mut cfg = ClientConfig::new(addr.clone(), TOKEN);
    cfg.server_nic = Some("mlx5_9".into());
    let mut c = Client::connect(cfg).await.unwrap();
    match c.open("ram0", false).await {
        Err(Error::Server { code, message }) => {
            assert_eq!(code, ErrorCode::BadRequest, "{message}");
            assert!(message.contains("rxe0, rxe1"), "{message}");
        }
        other => panic!("an unknown NIC: {other:?}"),
    }
    let e = s
        .handle
        .add_region("bad=host:1M,nic=mlx5_9".parse().unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("mlx5_9") && e.contains("rxe0, rxe1"), "{e}");

    // the CLI: ls names each region's NIC, fetch says which one it used
    let (cli_ls, cli_fetch) = tokio::task::spawn_blocking(move || {
        let run = |args: &[&str]| {
            let out = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
                .args(args)
                .env("P2P_RDMA_TOKEN", TOKEN)
                .env_remove("P2P_RDMA_DEVICE")
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "{args:?}: {text}");
            text
        };
        let f = std::env::temp_dir().join("dualnic-ram1.bin");
        (
            run(&["ls", &addr]),
            run(&[
                "fetch",
                &addr,
                "ram1",
                "--verify",
                "-o",
                f.to_str().unwrap(),
            ]),
        )
    })
    .await
    .unwrap();
    for (name, nic) in [("ram0", "rxe0"), ("ram1", "rxe1")] {
        // the region's line, then its indented lines
        let block: Vec<&str> = cli_ls
            .lines()
            .skip_while(|l| !l.starts_with(&format!("{name} ")))
            .skip(1)
            .take_while(|l| l.starts_with(' '))
            .collect();
        assert!(
            block
                .iter()
                .any(|l| l.trim() == format!("served from: {nic}")),
            "{name}: {cli_ls}"
        );
    }
    assert!(
        cli_fetch
            .contains("connected to the server's RDMA device rxe1 (it serves from rxe0, rxe1)")
            && cli_fetch.contains("direct 4.0 MiB, bounce 0 B"),
        "{cli_fetch}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_dualnic_a_reconnect_whose_qp_goes_to_the_other_nic_refuses_the_buffers_of_before() {
    // `Client::reconnect` keeps the protection domain, so that buffers registered before stay
    // usable; a region served from the other NIC puts the new QP on another device, where
    // they are not registered: a transfer into one is refused, and says why
    two_nics();
    let s = start(&["ram0=host:4M", "ram1=host:4M,nic=rxe1"], |c| {
        c.device = Some("rxe0".into());
        c.more_devices = vec!["rxe1".into()];
    })
    .await;
    let mut c = Client::connect(ClientConfig::new(s.addr.to_string(), TOKEN))
        .await
        .unwrap();
    let r0 = c.open("ram0", true).await.unwrap();
    assert_eq!(c.server_nic(), Some("rxe0"));
    let d = data(1 << 20, 51);
    c.put(&r0, 0, &mut &d[..], None, true, &mut |_| {})
        .await
        .unwrap();
    let buf = c.buffer(1 << 20).await.unwrap();
    let landed = c.fetch_into(&r0, 0, 1 << 20, buf, 0).await.unwrap();
    assert!(landed.buffer.as_slice() == &d[..], "ram0: the bytes differ");
    c.reconnect().await.unwrap();
    let r1 = c.open("ram1", true).await.unwrap();
    assert_eq!(c.server_nic(), Some("rxe1"));
    // staging buffers are registered again where the QP is: put and fetch work
    c.put(&r1, 0, &mut &d[..], None, true, &mut |_| {})
        .await
        .unwrap();
    let e = c
        .fetch_into(&r1, 0, 1 << 20, landed.buffer, 0)
        .await
        .unwrap_err();
    assert!(
        e.error
            .to_string()
            .contains("before a reconnect that put its QP on another device"),
        "{}",
        e.error
    );
    assert!(e.buffer.is_some(), "the refused buffer comes back");
    let fresh = c.buffer(1 << 20).await.unwrap();
    let got = c.fetch_into(&r1, 0, 1 << 20, fresh, 0).await.unwrap();
    assert!(got.buffer.as_slice() == &d[..], "ram1: the bytes differ");
    c.bye().await.unwrap();
    s.stop().await;
}

#[test]
#[ignore = "lab"]
fn lab_dualnic_serve_device_all_serves_from_every_active_nic() {
    cmbs_and_their_nics();
    let ip = common::lab_ip();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["serve", "--device", "all", "--json", "--listen"])
        .arg(format!("{ip}:0"))
        .args(["--region", "a=host:1M", "--region", "b=host:1M,nic=rxe1"])
        .env("P2P_RDMA_TOKEN", TOKEN)
        .env_remove("P2P_RDMA_DEVICE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    // the start-up report is one JSON document on stdout
    let doc: Value = serde_json::Deserializer::from_reader(serve.stdout.take().unwrap())
        .into_iter()
        .next()
        .expect("a start-up report")
        .expect("JSON");
    let devices: Vec<&str> = doc["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(devices, ["rxe0", "rxe1"], "{doc}");
    let addrs: Vec<&str> = doc["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["addr"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(addrs, ["10.77.0.1", "10.77.1.1"], "{doc}");
    let nic = |name: &str| {
        doc["regions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["info"]["name"] == name)
            .map(|r| r["info"]["nic"].clone())
    };
    assert_eq!(nic("a"), Some(Value::from("rxe0")), "{doc}");
    assert_eq!(nic("b"), Some(Value::from("rxe1")), "{doc}");
    // `all` with another name, or a name twice, is a usage error (exit 2)
    for bad in [&["all", "rxe0"][..], &["rxe0", "rxe0"][..]] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"));
        c.args(["serve", "--region", "a=host:1M"]);
        for d in bad {
            c.args(["--device", d]);
        }
        let out = c.env("P2P_RDMA_TOKEN", TOKEN).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {err}");
        assert!(err.contains("--device"), "{bad:?}: {err}");
    }
    let _ = serve.kill();
    let _ = serve.wait();
}
