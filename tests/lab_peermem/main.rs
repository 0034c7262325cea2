//! Lab tests of the peer-memory paths: bounce, mixed (a P2P window), dma-buf fallback, the
//! `--p2p` policy, region removal while clients transfer, and NVMe CMB through P2PDMA (the
//! `lab_nvme_*` tests need a lab topology with NVMe controllers: `switch` or `iommu`);
//! device-private regions in [`devpriv`].

#[path = "../common/mod.rs"]
mod common;
mod devpriv;
use common::{bind, client_config, data, raw, run, start, LAB, TOKEN};

use std::net::SocketAddr;
use std::time::Duration;

use p2p_rdma::bridge::protocol::{encode, DataPath, ErrorCode, Msg, VERSION};
use p2p_rdma::bridge::{Client, ClientConfig, Error};

fn kernel() -> String {
    std::env::var("P2P_LAB_KERNEL").unwrap_or_else(|_| panic!("P2P_LAB_KERNEL is not set. {LAB}"))
}

/// Small bounce buffers, so that transfers cross many of them.
fn small_bounce(c: &mut p2p_rdma::bridge::ServerConfig) {
    c.bounce_chunk = 128 << 10;
    c.bounce_depth = 4;
}

fn cfg(addr: SocketAddr) -> ClientConfig {
    let mut c = client_config(addr, 256 << 10, 6);
    c.timeout = Duration::from_secs(20);
    c
}

/// The server's regions, as `ls` lists them (the client leaves at once).
async fn regions(addr: SocketAddr) -> Vec<p2p_rdma::bridge::protocol::RegionInfo> {
    let mut c = Client::connect(cfg(addr)).await.unwrap();
    let list = c.list().await.unwrap();
    c.bye().await.unwrap();
    list
}

/// Put `bytes` at `offset` then fetch them back, both verified against the server's CRC.
/// Returns (put report, fetch report).
async fn round_trip(
    addr: SocketAddr,
    region: &str,
    offset: u64,
    bytes: &[u8],
) -> (
    p2p_rdma::bridge::TransferReport,
    p2p_rdma::bridge::TransferReport,
) {
    let mut c = Client::connect(cfg(addr)).await.unwrap();
    let r = c.open(region, true).await.unwrap();
    let mut src = bytes;
    let put = c
        .put(
            &r,
            offset,
            &mut src,
            Some(bytes.len() as u64),
            true,
            &mut |_| {},
        )
        .await
        .unwrap_or_else(|e| panic!("put to '{region}': {e}"));
    let mut out = Vec::new();
    let fetch = c
        .fetch(&r, offset, bytes.len() as u64, &mut out, true, &mut |_| {})
        .await
        .unwrap_or_else(|e| panic!("fetch of '{region}': {e}"));
    assert!(
        out == bytes,
        "'{region}': fetched bytes differ from the bytes put"
    );
    c.close(&r).await.unwrap();
    c.bye().await.unwrap();
    (put, fetch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bounce_mixed_and_dmabuf_regions_move_every_byte_and_attribute_it() {
    let s = start(
        &[
            "direct=host:2M",
            "bounce=host:2M,p2p=disabled",
            "mixed=host:3M,window=1M",
            "dmabuf=dmabuf:2M",
        ],
        small_bounce,
    )
    .await;
    let list = regions(s.addr).await;
    let info = |n: &str| list.iter().find(|r| r.name == n).unwrap().clone();
    assert_eq!(info("direct").path, DataPath::Direct);
    assert_eq!(info("direct").strategy.as_deref(), Some("pinned"));
    assert_eq!(info("bounce").path, DataPath::Bounce);
    assert!(
        info("bounce").reason.contains("--p2p disabled"),
        "{:?}",
        info("bounce")
    );
    let m = info("mixed");
    assert_eq!(m.path, DataPath::Mixed);
    assert_eq!(m.extents.len(), 2);
    assert_eq!((m.extents[0].offset, m.extents[0].len), (0, 1 << 20));
    assert_eq!(m.extents[1].path, DataPath::Bounce);
    // rxe refuses dma-buf MRs (EOPNOTSUPP on both lab kernels): the region falls back to bounce
    let d = info("dmabuf");
    assert_eq!(d.path, DataPath::Bounce, "{d:?}");
    assert!(
        d.reason.contains("errno 95") && d.reason.contains("pread/pwrite"),
        "{}",
        d.reason
    );

    // unaligned ranges that cross extents and staging-buffer boundaries
    let bytes = data((1 << 20) + 777, 7);
    let (put, fetch) = round_trip(s.addr, "direct", 4097, &bytes).await;
    assert_eq!(
        (put.direct_bytes, put.bounce_bytes),
        (bytes.len() as u64, 0)
    );
    assert_eq!(fetch.direct_bytes, bytes.len() as u64);
    let (put, fetch) = round_trip(s.addr, "bounce", 12345, &bytes).await;
    assert_eq!(
        (put.direct_bytes, put.bounce_bytes),
        (0, bytes.len() as u64)
    );
    assert_eq!(
        (fetch.direct_bytes, fetch.bounce_bytes),
        (0, bytes.len() as u64)
    );
    // a staged fetch's first bytes come after the server staged them, within the fetch
    let first = fetch.first_bytes_ms.expect("a fetch's first bytes");
    assert!(first > 0.0 && first <= fetch.seconds * 1e3, "{fetch:?}");
    assert_eq!(put.first_bytes_ms, None);
    let off = (1 << 20) - 1000;
    let (put, fetch) = round_trip(s.addr, "mixed", off, &bytes).await;
    assert_eq!(put.direct_bytes, 1000, "{put:?}");
    assert_eq!(put.bounce_bytes, bytes.len() as u64 - 1000);
    assert_eq!(fetch.direct_bytes, 1000);
    let (_, fetch) = round_trip(s.addr, "dmabuf", 3, &bytes).await;
    assert_eq!(fetch.bounce_bytes, bytes.len() as u64);

    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_bad_bounce_requests_get_clear_errors_in_order() {
    let dir = std::env::temp_dir().join("lab-peermem-bounce");
    std::fs::create_dir_all(&dir).unwrap();
    let ro = dir.join("ro.bin");
    std::fs::write(&ro, data(300_000, 4)).unwrap();
    let ro_spec = format!("ro=file:{}:ro,p2p=disabled", ro.display());
    // registrations per connection: an open before any QP gets the direct part's key, so the
    // first request meets the direct-part check (with windows, a handle opened without a QP
    // has no window and no direct part, and every request would meet the missing QP first)
    let s = start(&["mixed=host:1M,window=64K", &ro_spec], |c| {
        small_bounce(c);
        c.sharing = p2p_rdma::bridge::SharingPolicy::PerConnection;
    })
    .await;
    let bounce = |handle, offset, len, to_region| Msg::Bounce {
        handle,
        offset,
        len,
        to_region,
        addr: 0x1000,
        rkey: 1,
    };
    let hello = || Msg::Hello {
        version: VERSION,
        token: TOKEN.into(),
        client: "raw".into(),
    };
    // the frames of a raw client that sends everything at once
    let frames = |msgs: &[Msg]| msgs.iter().flat_map(encode).collect::<Vec<u8>>();
    let bytes = frames(&[
        hello(),
        Msg::Open {
            region: "mixed".into(),
            write: true,
            first: None,
        },
        // the first 64 KiB are direct: use the rkey
        bounce(0, 0, 100, false),
        Msg::Open {
            region: "ro".into(),
            write: false,
            first: None,
        },
        // larger than one staging buffer (128 KiB here)
        bounce(0, 64 << 10, (128 << 10) + 1, false),
        // a put into a read-only region
        bounce(1, 0, 100, true),
        // a valid request, but no QP to move the bytes with
        bounce(1, 0, 100, false),
        bounce(9, 0, 100, false),
        Msg::Bye,
    ]);
    let replies = raw(s.addr, &bytes).await;
    let errors: Vec<(ErrorCode, String)> = replies
        .iter()
        .filter_map(|m| match m {
            Msg::Error { code, message } => Some((*code, message.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(replies.len(), 8, "{replies:?}");
    assert!(matches!(replies[0], Msg::Welcome { .. }), "{replies:?}");
    assert!(matches!(replies[1], Msg::Opened { .. }), "{replies:?}");
    assert!(matches!(replies[3], Msg::Opened { .. }), "{replies:?}");
    let want = [
        (ErrorCode::NotBounce, "served direct: use one-sided RDMA"),
        (ErrorCode::BadRequest, "moves 1 to 131072 bytes"),
        (ErrorCode::ReadOnly, "read-only"),
        (ErrorCode::BadRequest, "connect a QP"),
        (ErrorCode::NotOpen, "handle 9 is not open"),
    ];
    assert_eq!(errors.len(), want.len(), "{errors:?}");
    for ((code, msg), (wcode, wtext)) in errors.iter().zip(want) {
        assert_eq!(*code, wcode, "{msg}");
        assert!(msg.contains(wtext), "{msg} (wanted '{wtext}')");
    }
    s.stop().await;

    // with windows (the default), an open before any QP gets no window: no direct part, no
    // key, and a bounce request over the first bytes meets the missing QP instead
    let s = start(&["mixed=host:1M,window=64K"], small_bounce).await;
    let bytes = frames(&[
        hello(),
        Msg::Open {
            region: "mixed".into(),
            write: false,
            first: None,
        },
        bounce(0, 0, 100, false),
        Msg::Bye,
    ]);
    let replies = raw(s.addr, &bytes).await;
    assert_eq!(replies.len(), 3, "{replies:?}");
    assert!(
        matches!(replies[1], Msg::Opened { rkey: 0, .. }),
        "{replies:?}"
    );
    assert!(
        matches!(&replies[2], Msg::Error { code: ErrorCode::BadRequest, message } if message.contains("connect a QP")),
        "{replies:?}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_p2p_required_refuses_what_cannot_go_direct_and_says_why() {
    let e = bind(&["d=dmabuf:1M,p2p=required"], small_bounce)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("region 'd'") && e.contains("--p2p required"),
        "{e}"
    );
    assert!(e.contains("errno 95"), "the dma-buf attempt's errno: {e}");
    assert!(
        e.contains("not applicable"),
        "pinned/ODP have no CPU mapping: {e}"
    );
    // the server-wide policy applies to regions without their own
    let e = bind(&["d=dmabuf:1M"], |c| {
        small_bounce(c);
        c.p2p = p2p_rdma::peermem::plan::P2pPolicy::Required
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("--p2p required"), "{e}");
    // host memory goes direct under `required`
    let s = bind(&["h=host:1M,p2p=required"], small_bounce)
        .await
        .unwrap();
    assert_eq!(s.regions()[0].path, DataPath::Direct);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_removing_regions_during_transfers_never_hangs_and_the_rest_keeps_serving() {
    let s = start(
        &["d=host:4M", "b=host:4M,p2p=disabled", "keep=host:1M"],
        small_bounce,
    )
    .await;
    let addr = s.addr;
    let mut workers = Vec::new();
    for region in ["d", "b"] {
        workers.push(tokio::spawn(async move {
            let mut c = Client::connect(cfg(addr)).await.unwrap();
            let r = c.open(region, false).await.unwrap();
            let mut rounds = 0u32;
            loop {
                let mut out = Vec::new();
                match c.fetch(&r, 0, 4 << 20, &mut out, false, &mut |_| {}).await {
                    Ok(rep) => {
                        assert_eq!(rep.bytes, 4 << 20);
                        rounds += 1;
                        if rounds > 200 {
                            panic!("region '{region}' still served after removal");
                        }
                    }
                    Err(e) => return (region, rounds, e),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    for region in ["b", "d"] {
        let rm = s
            .handle
            .remove_region(region, Duration::from_secs(20))
            .await
            .unwrap();
        assert!(
            rm.released,
            "region '{region}': its memory is still referenced 20 s after removal"
        );
    }
    for w in workers {
        let (region, rounds, e) = tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("a client hung after its region was removed")
            .unwrap();
        let msg = e.to_string();
        eprintln!("region '{region}': {rounds} fetches, then: {msg}");
        let clear = matches!(
            &e,
            Error::Server {
                code: ErrorCode::Removed,
                ..
            }
        ) || msg.contains("remote access")
            || msg.contains("REM_ACCESS")
            || msg.contains("flush")
            || msg.contains("removed");
        assert!(
            clear,
            "region '{region}': unclear error after removal: {msg}"
        );
    }
    // removed regions are gone from the list; the other region still works for new clients
    let mut c = Client::connect(cfg(addr)).await.unwrap();
    let names: Vec<String> = c
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, vec!["keep".to_string()]);
    let e = c.open("d", false).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Server {
                code: ErrorCode::UnknownRegion,
                ..
            }
        ),
        "{e}"
    );
    c.bye().await.unwrap();
    let bytes = data(300_000, 3);
    round_trip(addr, "keep", 5, &bytes).await;
    s.stop().await;
}

/// The lab topology's NVMe controller with a CMB behind the PCIe switch.
fn nvme_behind_switch() -> String {
    let topo = std::env::var("P2P_LAB_TOPOLOGY").unwrap_or_default();
    let dir = std::path::Path::new("/sys/class/nvme");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| {
            panic!("{} is unreadable ({e}): this test needs the lab's switch or iommu topology (now: '{topo}')", dir.display())
        })
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nvme"))
        .collect();
    names.sort();
    assert!(
        !names.is_empty(),
        "no NVMe controller: this test needs the lab's switch or iommu topology (now: '{topo}')"
    );
    // nvme0 is the one on the switch (serial p2plab0)
    for n in &names {
        let serial = std::fs::read_to_string(dir.join(n).join("serial")).unwrap_or_default();
        if serial.trim() == "p2plab0" {
            return n.clone();
        }
    }
    names[0].clone()
}

/// On 6.12 (no `CONFIG_PCI_P2PDMA`) a server with the CMB region `spec` is refused, saying so.
async fn cmb_refused_without_p2pdma(spec: &str) {
    let e = bind(&[spec], small_bounce).await.unwrap_err().to_string();
    assert!(e.contains("CONFIG_PCI_P2PDMA"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_cmb_region_is_served_or_refused_with_the_kernel_reason() {
    let nvme = nvme_behind_switch();
    let spec = format!("cmb=cmb:{nvme}:4M");
    if kernel() == "6.12" {
        let e = bind(&[&spec], small_bounce).await.unwrap_err().to_string();
        assert!(e.contains("kernel lacks CONFIG_PCI_P2PDMA"), "{e}");
        // and a dma-buf region on the same kernel still serves, through bounce
        let s = start(&["d=dmabuf:1M"], small_bounce).await;
        let bytes = data(700_001, 11);
        let (put, _) = round_trip(s.addr, "d", 99, &bytes).await;
        assert_eq!(put.bounce_bytes, bytes.len() as u64);
        s.stop().await;
        return;
    }
    let server = bind(&[&spec], small_bounce).await.unwrap();
    let rep = server.reports().remove(0);
    let att: Vec<(String, String, Option<i64>)> = rep
        .attempts
        .iter()
        .map(|a| {
            let v = serde_json::to_value(a).unwrap();
            (
                v["mode"].as_str().unwrap().to_string(),
                v["outcome"].as_str().unwrap().to_string(),
                v["errno"].as_i64(),
            )
        })
        .collect();
    eprintln!(
        "CMB attempts on {}: {}",
        kernel(),
        serde_json::to_string(&rep.attempts).unwrap()
    );
    eprintln!("CMB path: {} ({})", rep.info.path, rep.info.reason);
    // what LAB.md recorded for 7.3: dma-buf not applicable, pinned EFAULT, ODP registers
    assert_eq!(att[0].1, "not-applicable", "{att:?}");
    assert_eq!(
        (att[1].0.as_str(), att[1].1.as_str(), att[1].2),
        ("pinned", "registration-failed", Some(14)),
        "{att:?}"
    );
    assert_eq!(att[2].0, "odp");
    assert!(
        matches!(att[2].1.as_str(), "works" | "canary-failed"),
        "ODP on a p2pmem mapping: {att:?}"
    );
    let want = if att[2].1 == "works" {
        DataPath::Direct
    } else {
        DataPath::Bounce
    };
    assert_eq!(rep.info.path, want, "{}", rep.info.reason);
    assert_eq!(rep.info.kind, "cmb");
    let s = run(server);
    // whatever the path, the bytes are right
    let bytes = data((2 << 20) + 4321, 5);
    let (put, fetch) = round_trip(s.addr, "cmb", 777, &bytes).await;
    let path_bytes = if want == DataPath::Direct {
        put.direct_bytes
    } else {
        put.bounce_bytes
    };
    assert_eq!(path_bytes, bytes.len() as u64);
    assert_eq!(fetch.bytes, bytes.len() as u64);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_cmb_region_lends_the_nic_chunks_that_start_on_a_page_where_only_those_are_proved()
{
    // rxe reads a p2pmem mapping through ODP, and copies each packet from the start of its
    // page (LAB.md): the region canary (partway into a page) fails, one from a page start
    // passes at path MTU 4096 and fails at 1024. Where it passes, a staged fetch's chunk that
    // starts on a page is lent through a window over the CMB itself, not copied, and a put's
    // chunk that starts on a page is read by the NIC straight into the CMB (a landing canary
    // from a page start passes there too)
    let nvme = nvme_behind_switch();
    if kernel() == "6.12" {
        cmb_refused_without_p2pdma(&format!("c=cmb:{nvme}:4M")).await;
        return;
    }
    let dev = std::env::var("P2P_RDMA_DEVICE").expect("P2P_RDMA_DEVICE");
    let port_mtu = common::lab_port_mtu();
    let s = start(&[&format!("c=cmb:{nvme}:4M")], small_bounce).await;
    let info = regions(s.addr).await.remove(0);
    eprintln!("reason: {}", info.reason);
    if common::lab_rxe_any_offset() {
        // the rxe of `soft-roce/lab --rxe odp-fix` passes the region canary, partway into a
        // page, at any path MTU: the CMB is served directly, nothing lent from page starts,
        // and puts and fetches at any offset move between the client and the CMB
        assert_eq!(info.path, DataPath::Direct, "{}", info.reason);
        assert!(!info.reason.contains("start of a page"), "{}", info.reason);
        let bytes = data(4 << 20, 21);
        for (off, len) in [(0u64, 4u64 << 20), (777, 3 << 20)] {
            let (put, fetch) = round_trip(s.addr, "c", off, &bytes[..len as usize]).await;
            assert_eq!((put.direct_bytes, put.bounce_bytes), (len, 0), "{put:?}");
            assert_eq!(
                (fetch.direct_bytes, fetch.bounce_bytes),
                (len, 0),
                "{fetch:?}"
            );
        }
        s.stop().await;
        return;
    }
    assert_eq!(info.path, DataPath::Bounce, "{}", info.reason);
    let lends = port_mtu == 4096;
    if lends {
        assert!(
            info.reason.contains(
                "; the NIC reads the region's own bytes from the start of a page (odp: a \
                 canary from the start of a page passed at path MTU 4096"
            ),
            "{}",
            info.reason
        );
    } else {
        assert!(
            info.reason
                .contains("no chunk is lent from page starts either"),
            "{}",
            info.reason
        );
    }
    // the doctor says the same
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["doctor", "--region", &format!("cmb:{nvme}:4M"), "--json"])
        .args(["--device", &dev])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let said = v["page_starts"].as_str().unwrap_or_default().to_string();
    assert_eq!(
        said.starts_with("the NIC reads the region's own bytes from the start of a page"),
        lends,
        "{v}"
    );
    // puts land in the region itself where a landing canary from a page start passed
    assert_eq!(
        info.reason.contains(
            "; a put's chunk that starts on a page is read from the client straight into the \
             region by the NIC (landing canary passed"
        ),
        lends,
        "{}",
        info.reason
    );
    let bytes = data(4 << 20, 21);
    // from offset 0 every chunk starts on a page; from 777 the first does not, and the rest
    // do: the server tells the client to end it at the next page (`piece_align`), not at the
    // next multiple of the bounce chunk (128 KiB)
    for (off, len) in [(0u64, 4u64 << 20), (777, 3 << 20)] {
        let want = &bytes[..len as usize];
        let (put, fetch) = round_trip(s.addr, "c", off, want).await;
        eprintln!("at {off}: put {put:?}, fetch {fetch:?}");
        let first = if off % 4096 == 0 {
            0
        } else if lends {
            4096 - off % 4096
        } else {
            (128 << 10) - off % (128 << 10)
        };
        let moved_in_place = if lends { len - first } else { 0 };
        assert_eq!(put.zero_copy_bytes, moved_in_place, "at {off}: {put:?}");
        assert_eq!(put.bounce_bytes, len, "at {off}: {put:?}");
        assert_eq!(fetch.zero_copy_bytes, moved_in_place, "at {off}: {fetch:?}");
        assert_eq!(fetch.bounce_bytes, len, "at {off}: {fetch:?}");
        if off == 0 {
            // what the NIC landed, seen by the CPU: a fetch within one page, partway into it
            // (one piece), is copied by the server from the CMB; and the server's checksum of
            // a longer range is the CPU's reading of it
            let mut c = Client::connect(cfg(s.addr)).await.unwrap();
            let r = c.open("c", false).await.unwrap();
            assert_eq!(r.piece_align, if lends { 4096 } else { 0 }, "{r:?}");
            let mut out = Vec::new();
            let f = c
                .fetch(&r, 4097, 4000, &mut out, true, &mut |_| {})
                .await
                .unwrap();
            assert_eq!(f.zero_copy_bytes, 0, "{f:?}");
            assert!(
                out == bytes[4097..4097 + 4000],
                "the CPU's view of the landed put differs"
            );
            let crc = c.checksum(&r, 4097, 100_000).await.unwrap();
            assert_eq!(
                crc,
                crc32c::crc32c(&bytes[4097..4097 + 100_000]),
                "the CPU's view of the landed put differs"
            );
            c.bye().await.unwrap();
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_nvme_cmb_forced_strategies_report_what_the_kernel_did() {
    let nvme = nvme_behind_switch();
    if kernel() == "6.12" {
        // nothing to register: the allocation itself is refused (see the test above)
        cmb_refused_without_p2pdma(&format!("c=cmb:{nvme}:1M")).await;
        return;
    }
    // --reg pinned: EFAULT, and with --p2p required the region is refused saying so
    let e = bind(
        &[&format!("c=cmb:{nvme}:1M,reg=pinned,p2p=required")],
        small_bounce,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("errno 14"), "{e}");
    // --p2p disabled: bounce without any attempt, bytes right
    let s = run({
        let server = bind(&[&format!("c=cmb:{nvme}:1M,p2p=disabled")], small_bounce)
            .await
            .unwrap();
        let info = server.regions().remove(0);
        assert_eq!(info.path, DataPath::Bounce);
        assert!(
            info.reason.contains("CPU copy from the p2pmem mapping"),
            "{}",
            info.reason
        );
        server
    });
    let bytes = data(600_000, 9);
    let (put, _) = round_trip(s.addr, "c", 1, &bytes).await;
    assert_eq!(put.bounce_bytes, bytes.len() as u64);
    s.stop().await;
}
