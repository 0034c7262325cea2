//! `Client::fetch_resuming` and `Client::put_resuming`, the library's transfers that go on
//! after a failure, and `Client::fetch_striped` and `Client::put_striped`, the same over several
//! connections: a server killed mid-transfer and started again on the same address.

use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use p2p_rdma::bridge::stripe::Stripe;
use p2p_rdma::bridge::{Client, ClientConfig, Retries, SinkFor, SourceFor};

use crate::common::{data, TOKEN};
use crate::{figure, ServedFile};

/// A sink (or source) that counts the bytes through it, for the test to cut the transfer.
struct Counted<T> {
    inner: T,
    seen: Arc<AtomicU64>,
}

impl<T: Write> Write for Counted<T> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.seen.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<T: Read> Read for Counted<T> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.seen.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// A served file region for a transfer cut by a server restart, and what the transfer says.
struct Cut {
    served: ServedFile,
    addr: std::net::SocketAddr,
    /// Bytes through the transfer's sink or source, for the kill.
    seen: Arc<AtomicU64>,
    /// What the retries said.
    said: Arc<std::sync::Mutex<Vec<String>>>,
    retries: Retries,
    server: Option<super::ServeProcess>,
}

impl Cut {
    /// A file region `name` serving `content` for a fetch, or zeros of its length for a put,
    /// and `Retries::new(4, 1 s)` that say what they do into `said`.
    async fn serve(name: &str, content: &[u8], fetching: bool) -> Cut {
        let (served, server, addr) = ServedFile::start_for(name, content, fetching).await;
        let said = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let log = Arc::clone(&said);
        let retries = Retries::new(4, Duration::from_secs(1))
            .saying(move |s| log.lock().unwrap().push(s.to_string()));
        Cut {
            served,
            addr,
            seen: Arc::new(AtomicU64::new(0)),
            said,
            retries,
            server: Some(server),
        }
    }

    /// Kill the server (SIGKILL) once `bytes` went through, then start it again on its
    /// address. Watched off the runtime: transfers busy on its workers (four stripes on two)
    /// kept a task of its own from running until they were all but done.
    fn kill_after(&mut self, bytes: u64) -> tokio::task::JoinHandle<super::ServeProcess> {
        let (seen, served, addr) = (Arc::clone(&self.seen), self.served.clone(), self.addr);
        let mut server = self.server.take().expect("one kill per run");
        let started = Instant::now();
        let killer = tokio::task::spawn_blocking(move || {
            while seen.load(Ordering::Relaxed) < bytes {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "no {bytes} bytes moved"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            server.kill();
        });
        tokio::spawn(async move {
            killer.await.unwrap();
            served.again(addr).await
        })
    }

    /// What the retries said.
    fn said(&self) -> Vec<String> {
        self.said.lock().unwrap().clone()
    }
}

/// 64 MiB of a file region fetched (`fetching`) or put through the library with
/// `Retries::new(4, 1 s)`, the server SIGKILLed once 8 MiB went into the sink (24 MiB out of
/// the source: a put reads up to its window of 16 chunks ahead of what the server has) and
/// started again: the transfer goes on after what it moved, each byte through once, and its
/// report covers the whole range.
async fn goes_on_after_a_server_restart(fetching: bool) {
    let content = data(64 << 20, 56);
    let mut run = Cut::serve(&format!("p2p-resuming-{fetching}"), &content, fetching).await;
    let mut cfg = ClientConfig::new(run.addr.to_string(), TOKEN);
    cfg.chunk = 1 << 20;
    let mut c = Client::connect(cfg).await.unwrap();
    let mut r = c.open("f", !fetching).await.unwrap();
    let mib: u64 = if fetching { 8 } else { 24 };
    let cut = run.kill_after(mib << 20);
    let (seen, mut retries) = (Arc::clone(&run.seen), run.retries.clone());
    let (out, got) = if fetching {
        let mut sink = Counted {
            inner: Vec::new(),
            seen: Arc::clone(&seen),
        };
        let out = c
            .fetch_resuming(&mut r, (0, 64 << 20), &mut sink, &mut retries, &mut |_| {})
            .await;
        (out, sink.inner)
    } else {
        let mut source = Counted {
            inner: content.as_slice(),
            seen: Arc::clone(&seen),
        };
        let out = c
            .put_resuming(&mut r, 0, &mut source, None, &mut retries, &mut |_| {})
            .await;
        (out, std::fs::read(&run.served.file).unwrap())
    };
    let _again = cut.await.unwrap();
    let said = run.said();
    let done = out.unwrap_or_else(|e| panic!("{e}; said: {said:?}"));
    assert!(got == content, "the bytes moved differ");
    assert!(
        said.iter()
            .any(|s| s.contains("connecting again") && s.contains("(retry 1 of 4)")),
        "the server was not killed mid-way: this run tested nothing; said: {said:?}"
    );
    // read once: each byte of the source handed out once to the put (kept bytes replayed)
    if !fetching {
        assert_eq!(seen.load(Ordering::Relaxed), 64 << 20);
    }
    let rep = &done.report;
    assert!(rep.verified, "{rep:?}");
    assert_eq!((rep.offset, rep.bytes), (0, 64 << 20), "{rep:?}");
    assert_eq!(rep.crc32c, Some(crc32c::crc32c(&content)), "{rep:?}");
    let kept: u64 = done.earlier.iter().map(|s| s.len).sum();
    assert!(
        kept > 0 && rep.kept_bytes == kept,
        "{rep:?} {:?}",
        done.earlier
    );
    figure(format!(
        "reliability: library {} of 64 MiB with Retries::new(4, 1 s), the server killed once {mib} MiB went through and started again: went on after the {:.1} MiB moved before, verified, whole range reported",
        if fetching { "fetch_resuming" } else { "put_resuming" },
        kept as f64 / (1 << 20) as f64
    ));
    c.bye().await.ok();
    let _ = std::fs::remove_dir_all(&run.served.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_the_library_fetch_resuming_goes_on_after_a_server_restart() {
    goes_on_after_a_server_restart(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_the_library_put_resuming_goes_on_after_a_server_restart() {
    goes_on_after_a_server_restart(false).await;
}

/// 64 MiB of a file region fetched (`fetching`) or put through the library, striped over 4
/// connections (`Client::fetch_striped`, `Client::put_striped`, 256 KiB chunks) with
/// `Retries::new(4, 1 s)`, the server SIGKILLed once 8 MiB went through all stripes together
/// and started again: every stripe goes on after what it moved, each byte through once, and
/// the whole report covers the range with the CRC-32C of every byte.
async fn striped_goes_on_after_a_server_restart(fetching: bool) {
    let content = Arc::new(data(64 << 20, 57));
    let mut run = Cut::serve(&format!("p2p-striped-{fetching}"), &content, fetching).await;
    let (seen, retries) = (Arc::clone(&run.seen), run.retries.clone());
    // chunks of 256 KiB: each stripe's window (16 chunks) moves 4 MiB ahead of its sink, so
    // that the server dies while every stripe has bytes left to move
    let mut cfg = ClientConfig::new(run.addr.to_string(), TOKEN);
    cfg.chunk = 256 << 10;
    let cut = run.kill_after(8 << 20);
    let output = run.served.dir.join("fetched");
    let mut told = 0;
    let range = (0, 64 << 20);
    let out = if fetching {
        std::fs::File::create(&output)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let sink_for = |s: Stripe| -> std::io::Result<SinkFor> {
            let mut f = std::fs::OpenOptions::new().write(true).open(&output)?;
            f.seek(SeekFrom::Start(s.offset))?;
            let seen = Arc::clone(&seen);
            Ok(Box::new(Counted { inner: f, seen }))
        };
        Client::fetch_striped(&cfg, "f", range, 4, sink_for, &retries, &mut |n| told = n).await
    } else {
        let source_for = |s: Stripe| -> std::io::Result<SourceFor> {
            let part = content[s.offset as usize..(s.offset + s.len) as usize].to_vec();
            let seen = Arc::clone(&seen);
            Ok(Box::new(Counted {
                inner: std::io::Cursor::new(part),
                seen,
            }))
        };
        Client::put_striped(&cfg, "f", range, 4, source_for, &retries, &mut |n| told = n).await
    };
    let _again = cut.await.unwrap();
    let said = run.said();
    let out = out.unwrap_or_else(|e| panic!("{e}; said: {said:?}"));
    let parts: Vec<(u64, bool)> = out
        .stripes
        .iter()
        .map(|(s, o)| (s.len, o.is_ok()))
        .collect();
    let done = out
        .whole()
        .unwrap_or_else(|e| panic!("{e}; said: {said:?}"));
    let got = std::fs::read(if fetching { &output } else { &run.served.file }).unwrap();
    assert!(got == *content, "the bytes moved differ");
    assert_eq!(parts, [(16 << 20, true); 4], "four stripes of 16 MiB");
    assert!(
        said.iter().any(|s| s.contains("connecting again")),
        "the server was not killed mid-way: this run tested nothing; said: {said:?}"
    );
    assert_eq!(told, 64 << 20, "progress ends at the whole range");
    if !fetching {
        assert_eq!(
            seen.load(Ordering::Relaxed),
            64 << 20,
            "each source read once"
        );
    }
    let rep = &done.report;
    assert!(rep.verified, "{rep:?}");
    assert_eq!((rep.offset, rep.bytes), range, "{rep:?}");
    assert_eq!(rep.crc32c, Some(crc32c::crc32c(&content)), "{rep:?}");
    let kept: u64 = done.earlier.iter().map(|s| s.len).sum();
    assert!(
        kept > 0 && rep.kept_bytes == kept,
        "{rep:?} {:?}; said: {said:?}",
        done.earlier
    );
    // a fetch's sinks were all written when the server died (8 MiB over 4 of 16 MiB each)
    assert!(
        !fetching || done.earlier.len() >= 2,
        "more than one stripe goes on after what it moved: {:?}",
        done.earlier
    );
    let retried = said
        .iter()
        .filter(|s| s.contains("connecting again"))
        .count();
    figure(format!(
        "reliability: library {} of 64 MiB over 4 connections with Retries::new(4, 1 s), the server killed once 8 MiB went through and started again: {retried} retries over the stripes, went on after the {:.1} MiB moved before in {} parts, verified, whole range reported",
        if fetching { "fetch_striped" } else { "put_striped" },
        kept as f64 / (1 << 20) as f64,
        done.earlier.len()
    ));
    // an empty range: one connection checks the region and the range, nothing moves
    let empty = if fetching {
        let sink_for = |_: Stripe| -> std::io::Result<SinkFor> { Ok(Box::new(std::io::sink())) };
        Client::fetch_striped(&cfg, "f", (4096, 0), 4, sink_for, &retries, &mut |_| {}).await
    } else {
        let source_for =
            |_: Stripe| -> std::io::Result<SourceFor> { Ok(Box::new(std::io::empty())) };
        Client::put_striped(&cfg, "f", (4096, 0), 4, source_for, &retries, &mut |_| {}).await
    };
    let empty = empty.and_then(|s| s.whole()).unwrap();
    assert_eq!((empty.report.offset, empty.report.bytes), (4096, 0));
    assert!(empty.report.verified, "{:?}", empty.report);
    let _ = std::fs::remove_dir_all(&run.served.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_the_library_fetch_striped_goes_on_after_a_server_restart() {
    striped_goes_on_after_a_server_restart(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_the_library_put_striped_goes_on_after_a_server_restart() {
    striped_goes_on_after_a_server_restart(false).await;
}
