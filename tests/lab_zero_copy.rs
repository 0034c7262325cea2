//! Lab tests of the zero-copy client API: fetches that land in a buffer the application owns
//! (`Client::buffer`, `fetch_into`) and batches of many ranges across regions (`fetch_many`).

mod common;
use common::{client_config, data, rdma_resources, start};

use std::net::SocketAddr;

use p2p_rdma::bridge::{BatchRange, Client, ClientConfig, Error};

fn cfg(addr: SocketAddr) -> ClientConfig {
    client_config(addr, 256 << 10, 8)
}

async fn put(c: &mut Client, region: &str, bytes: &[u8]) {
    let r = c.open(region, true).await.unwrap();
    let mut src: &[u8] = bytes;
    c.put(&r, 0, &mut src, Some(bytes.len() as u64), true, &mut |_| {})
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_zero_copy_fetch_lands_in_the_callers_buffer() {
    let s = start(&["ram=host:8M"], |_| {}).await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let d = data(8 << 20, 51);
    put(&mut c, "ram", &d).await;
    let r = c.open("ram", false).await.unwrap();
    let buf = c.buffer(9 << 20).await.unwrap();
    let landed = c.fetch_into(&r, 0, 8 << 20, buf, 4096).await.unwrap();
    assert_eq!(landed.direct_bytes, 8 << 20);
    assert_eq!(landed.bounce_bytes, 0);
    let b = landed.buffer.as_slice();
    assert!(
        b[4096..4096 + (8 << 20)] == d[..],
        "the buffer holds other bytes"
    );
    assert!(
        b[..4096].iter().all(|&x| x == 0),
        "bytes before `at` were written"
    );
    // the same buffer again, at another place, for part of the region
    let landed = c
        .fetch_into(&r, 12_345, 100_000, landed.buffer, 0)
        .await
        .unwrap();
    assert!(landed.buffer.as_slice()[..100_000] == d[12_345..112_345]);
    // out of range: refused before anything moves, and the buffer comes back
    let e = c
        .fetch_into(&r, 8 << 20, 1, landed.buffer, 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&e.error, Error::Server { message, .. } if message.contains("outside region")),
        "{e}"
    );
    let buf = e.buffer.expect("nothing was posted: the buffer comes back");
    // a buffer of another client is refused (its memory is on another protection domain)
    let mut other = Client::connect(cfg(s.addr)).await.unwrap();
    let e = other.fetch_into(&r, 0, 4096, buf, 0).await.unwrap_err();
    assert!(e.to_string().contains("another client"), "{e}");
    assert!(e.buffer.is_some());
    other.bye().await.unwrap();
    c.bye().await.unwrap();
    s.stop().await;
}

/// A client that moves bytes only from and into its own registered buffer pins nothing else:
/// staging buffers are registered by the first transfer that goes through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_zero_copy_a_client_of_its_own_buffers_registers_no_staging() {
    let s = start(&["ram=host:4M"], |_| {}).await;
    let mrs = || rdma_resources("mr", "rkey");
    let before = mrs();
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let r = c.open("ram", true).await.unwrap();
    let buf = c.buffer(1 << 20).await.unwrap();
    let landed = c.fetch_into(&r, 0, 1 << 20, buf, 0).await.unwrap();
    let landed = c.put_from(&r, 4096, 4096, landed.buffer, 0).await.unwrap();
    assert_eq!(
        mrs() - before,
        1,
        "an open, a buffer, a zero-copy fetch and put: only the caller's buffer is registered"
    );
    // a fetch through staging buffers registers one per slot it can have in flight: a 4 KiB
    // fetch one, a fetch of 3 chunks of 256 KiB three (the first one's reused), a fetch of 4
    // MiB (16 chunks) as many as the depth (cfg: 8)
    let mut out = Vec::new();
    let mut staged = Vec::new();
    for len in [4096, 3 * (256 << 10), 4 << 20] {
        out.clear();
        c.fetch(&r, 0, len, &mut out, false, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(out.len() as u64, len);
        staged.push(mrs() - before - 1);
    }
    assert_eq!(staged, [1, 3, 8], "staging buffers after each fetch");
    drop(landed);
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_zero_copy_a_batch_spans_regions_and_paths_with_one_result_per_range() {
    let s = start(
        &[
            "ram=host:4M",
            "mixed=host:4M,window=1M",
            "b=host:1M,p2p=disabled",
        ],
        |c| c.bounce_chunk = 64 << 10,
    )
    .await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let (ram, mixed, b) = (data(4 << 20, 1), data(4 << 20, 2), data(1 << 20, 3));
    put(&mut c, "ram", &ram).await;
    put(&mut c, "mixed", &mixed).await;
    put(&mut c, "b", &b).await;
    let (hr, hm, hb) = (
        c.open("ram", false).await.unwrap(),
        c.open("mixed", false).await.unwrap(),
        c.open("b", false).await.unwrap(),
    );
    let buf = c.buffer(8 << 20).await.unwrap();
    // many small ranges, interleaving the direct and the bounce path
    let mut ranges = Vec::new();
    let mut want: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut at = 0usize;
    for k in 0..200u64 {
        let (region, src, off, len) = match k % 3 {
            0 => (&hr, &ram, k * 17_000 % ((4 << 20) - 8192), 4096 + k % 7),
            1 => (&hm, &mixed, (k * 20_011) % (3 << 20), 5000 + k),
            _ => (&hb, &b, (k * 3001) % ((1 << 20) - 9000), 1 + k * 40),
        };
        ranges.push(BatchRange {
            region,
            offset: off,
            len,
            at,
        });
        want.push((at, src[off as usize..(off + len) as usize].to_vec()));
        at += len as usize + 3;
    }
    // one range across the mixed region's direct window into its bounce part
    ranges.push(BatchRange {
        region: &hm,
        offset: (1 << 20) - 10_000,
        len: 300_000,
        at,
    });
    want.push((at, mixed[(1 << 20) - 10_000..(1 << 20) + 290_000].to_vec()));
    // two refused ones: outside the region, outside the buffer
    ranges.push(BatchRange {
        region: &hb,
        offset: (1 << 20) - 1,
        len: 2,
        at: 0,
    });
    ranges.push(BatchRange {
        region: &hr,
        offset: 0,
        len: 10,
        at: (8 << 20) - 5,
    });
    let landed = c.fetch_many(&ranges, buf).await.unwrap();
    let n = ranges.len();
    for (i, r) in landed.results.iter().enumerate() {
        assert_eq!(r.is_ok(), i < n - 2, "range {i}: {r:?}");
    }
    let got = landed.buffer.as_slice();
    for (i, (at, bytes)) in want.iter().enumerate() {
        assert!(
            got[*at..*at + bytes.len()] == bytes[..],
            "range {i} landed wrong"
        );
    }
    assert!(
        landed.direct_bytes > 0 && landed.bounce_bytes > 0,
        "{landed:?}"
    );
    c.bye().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_zero_copy_puts_leave_from_the_callers_buffer_and_files_are_flushed() {
    let dir = std::env::temp_dir().join(format!("p2p-zc-put-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("f.bin");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    let spec = format!("f=file:{}", file.display());
    let s = start(
        &["ram=host:4M", "mixed=host:4M,window=1M", spec.as_str()],
        |c| c.bounce_chunk = 64 << 10,
    )
    .await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let (hr, hm, hf) = (
        c.open("ram", true).await.unwrap(),
        c.open("mixed", true).await.unwrap(),
        c.open("f", true).await.unwrap(),
    );
    assert!(hf.info.server_puts, "a file takes puts through the server");
    let mut buf = c.buffer(4 << 20).await.unwrap();
    let src = data(4 << 20, 61);
    buf.as_mut_slice().copy_from_slice(&src);
    // the whole buffer into ram; a range across mixed's direct window; part of the file
    let ranges = [
        BatchRange {
            region: &hr,
            offset: 0,
            len: 4 << 20,
            at: 0,
        },
        BatchRange {
            region: &hm,
            offset: (1 << 20) - 5000,
            len: 200_000,
            at: 777,
        },
        BatchRange {
            region: &hf,
            offset: 4099,
            len: 300_000,
            at: 1 << 20,
        },
    ];
    let landed = c.put_many(&ranges, buf).await.unwrap();
    assert!(
        landed.results.iter().all(Result::is_ok),
        "{:?}",
        landed.results
    );
    assert!(landed.direct_bytes > 0 && landed.bounce_bytes > 0);
    assert!(
        landed.buffer.as_slice() == &src[..],
        "a put changed the caller's buffer"
    );
    // every range reads back; the file's bytes are on disk (the put came back after a flush)
    let disk = std::fs::read(&file).unwrap();
    assert!(disk[4099..4099 + 300_000] == src[1 << 20..(1 << 20) + 300_000]);
    let back = c
        .fetch_many(
            &[BatchRange {
                region: &hr,
                offset: 0,
                len: 4 << 20,
                at: 0,
            }],
            landed.buffer,
        )
        .await
        .unwrap();
    assert!(back.buffer.as_slice() == &src[..]);
    let mut got = Vec::new();
    c.fetch(&hm, (1 << 20) - 5000, 200_000, &mut got, true, &mut |_| {})
        .await
        .unwrap();
    assert!(got == src[777..777 + 200_000]);
    // a region opened for reading refuses, range by range, before anything moves
    let ro = c.open("ram", false).await.unwrap();
    let e = c.put_from(&ro, 0, 10, back.buffer, 0).await.unwrap_err();
    assert!(e.to_string().contains("opened for reading"), "{e}");
    assert!(e.buffer.is_some());
    c.bye().await.unwrap();
    s.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_fetched_bytes_are_handed_over_as_bytes_without_a_copy() {
    // a mixed region: the direct part lands by RDMA READ, the rest through bounce buffers
    let s = start(&["mix=host:2M,window=1M"], |_| {}).await;
    let mut c = Client::connect(cfg(s.addr)).await.unwrap();
    let d = data(2 << 20, 77);
    put(&mut c, "mix", &d).await;
    let r = c.open("mix", false).await.unwrap();
    let b = c.fetch_bytes(&r, 1000, (1 << 20) + 5000).await.unwrap();
    assert_eq!(b.len(), (1 << 20) + 5000);
    assert!(b[..] == d[1000..(1 << 20) + 6000], "other bytes");
    // slices share the buffer: no copy
    let tail = b.slice((1 << 20)..);
    assert_eq!(tail.as_ptr(), b[(1 << 20)..].as_ptr());
    drop(b);
    assert!(tail[..] == d[(1 << 20) + 1000..(1 << 20) + 6000]);
    // a buffer of the caller's pool, frozen
    let buf = c.buffer(4096).await.unwrap();
    let landed = c.fetch_into(&r, 0, 4096, buf, 0).await.unwrap();
    let frozen = landed.buffer.freeze();
    assert!(frozen[..] == d[..4096]);
    let e = c.fetch_bytes(&r, 2 << 20, 1).await.unwrap_err();
    assert!(e.to_string().contains("outside region"), "{e}");
    c.bye().await.unwrap();
    s.stop().await;
}
