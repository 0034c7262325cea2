//! One transfer striped over several connections, each with its own queue pair, each stripe
//! a stream of its own that goes on after a failure ([`Client::fetch_resuming`],
//! [`Client::put_resuming`]): what `p2p-rdma fetch|put --qps N --retries N --verify` does
//! with files, for a program that gives a sink (or a source) per stripe. The range is cut by
//! [`crate::stripe::plan`], in whole chunks.
//!
//! Each stripe's outcome is its own ([`Striped::stripes`]): a stripe that failed does not
//! stop the others, and the sinks of those that got through hold their stripe whole and
//! verified, so that a caller can move again only the stripes that failed.
//! [`Striped::whole`] makes one report of them all, or gives the first failure.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Client, ClientConfig, OpenFor, Resumed, Retries};
use crate::error::{Error, Result};
use crate::stripe::Stripe;

/// The sink of one stripe, written from its first byte in order.
pub type SinkFor = Box<dyn Write + Send>;
/// The bytes of one stripe, from its first.
pub type SourceFor = Box<dyn Read + Send>;

/// The outcome of [`Client::fetch_striped`] or [`Client::put_striped`].
#[derive(Debug)]
pub struct Striped {
    /// Each stripe, in range order, with the outcome of its stream (the tries before its
    /// last: [`Resumed::earlier`]).
    pub stripes: Vec<(Stripe, Result<Resumed>)>,
    /// Wall time of the transfer, all stripes together.
    pub seconds: f64,
}

impl Striped {
    /// The whole range's report, its CRC-32C that of every byte (the stripes' combined), and
    /// the parts the tries before each stripe's last moved; or the first stripe's failure.
    pub fn whole(self) -> Result<Resumed> {
        let mut reports = Vec::with_capacity(self.stripes.len());
        let mut earlier = Vec::new();
        for (_, out) in self.stripes {
            let r = out?;
            earlier.extend(r.earlier);
            reports.push(r.report);
        }
        let report = crate::stripe::merge(&reports, self.seconds)
            .ok_or_else(|| Error::Config("a striped transfer of no stripe".into()))?;
        Ok(Resumed { report, earlier })
    }
}

/// How often the stripes' progress is summed for the caller.
const TICK: Duration = Duration::from_millis(100);

/// What one stripe's task runs: its own connection (with its retries) and stream.
type Lane = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Resumed>> + Send>>;

/// What a stripe moves: into its sink, or from its source.
enum Job {
    Fetch(SinkFor),
    Put(SourceFor),
}

impl Client {
    /// Fetch `len` bytes at `offset` of `region` striped over up to `n` connections to
    /// `cfg`'s server (cut in whole chunks of `cfg.chunk`), each stripe into the sink that
    /// `sink_for` gives for it, verified, each going on after a failure as
    /// [`Client::fetch_resuming`] does (with its own copy of `retries`). `progress` is told
    /// the bytes fetched so far, over all stripes, every 100 ms while they move.
    pub async fn fetch_striped(
        cfg: &ClientConfig,
        region: &str,
        range: (u64, u64),
        n: usize,
        mut sink_for: impl FnMut(Stripe) -> std::io::Result<SinkFor>,
        retries: &Retries,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<Striped> {
        let jobs = |s| {
            let sink = sink_for(s).map_err(|e| Error::io("opening a stripe's sink", e))?;
            Ok(Job::Fetch(sink))
        };
        striped(cfg, region, range, n, jobs, retries, progress).await
    }

    /// Put `len` bytes at `offset` of `region` striped over up to `n` connections to `cfg`'s
    /// server (cut in whole chunks of `cfg.chunk`), each stripe's bytes read from the source
    /// that `source_for` gives for it (from the stripe's first byte; at most the stripe's
    /// length is read), verified, each going on after a failure as [`Client::put_resuming`]
    /// does (with its own copy of `retries`). A source that ends before its stripe leaves
    /// that stripe short: its report says how many bytes it put. `progress` is told the bytes
    /// put so far, over all stripes, every 100 ms while they move.
    pub async fn put_striped(
        cfg: &ClientConfig,
        region: &str,
        range: (u64, u64),
        n: usize,
        mut source_for: impl FnMut(Stripe) -> std::io::Result<SourceFor>,
        retries: &Retries,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<Striped> {
        let jobs = |s| {
            let source = source_for(s).map_err(|e| Error::io("opening a stripe's source", e))?;
            Ok(Job::Put(source))
        };
        striped(cfg, region, range, n, jobs, retries, progress).await
    }
}

/// The stripes of `range` over up to `n` connections, each moving the job `job_for` gives
/// for it on a connection of its own, with its own copy of `retries`.
async fn striped(
    cfg: &ClientConfig,
    region: &str,
    (offset, len): (u64, u64),
    n: usize,
    mut job_for: impl FnMut(Stripe) -> Result<Job>,
    retries: &Retries,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<Striped> {
    let mut lanes = Vec::new();
    for s in stripes(offset, len, n, cfg)? {
        let job = job_for(s)?;
        let (cfg, region, mut retries) = (cfg.clone(), region.to_string(), retries.clone());
        let moved = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&moved);
        let lane: Lane = Box::pin(async move {
            let purpose = match job {
                Job::Fetch(_) => OpenFor::Fetch {
                    offset: s.offset,
                    len: s.len,
                },
                Job::Put(_) => OpenFor::Write,
            };
            let (mut c, mut r) = connected(cfg, &region, purpose, &mut retries).await?;
            let tell = &mut |d| counter.store(d, Ordering::Relaxed);
            let out = match job {
                Job::Fetch(mut sink) => {
                    let range = (s.offset, s.len);
                    c.fetch_resuming(&mut r, range, &mut *sink, &mut retries, tell)
                        .await
                }
                Job::Put(mut source) => {
                    let limit = Some(s.len);
                    c.put_resuming(&mut r, s.offset, &mut *source, limit, &mut retries, tell)
                        .await
                }
            };
            goodbye(c, &r).await;
            out
        });
        lanes.push((s, moved, lane));
    }
    run(lanes, progress).await
}

/// The stripes of `len` bytes at `offset` over up to `n` connections, in whole chunks: one
/// empty stripe for an empty range (its one connection checks the region and the range).
fn stripes(offset: u64, len: u64, n: usize, cfg: &ClientConfig) -> Result<Vec<Stripe>> {
    if offset.checked_add(len).is_none() {
        return Err(Error::Config(format!(
            "offset {offset} + length {len} is past the largest offset"
        )));
    }
    let mut plan = crate::stripe::plan(offset, len, n, cfg.chunk as u64);
    if plan.is_empty() {
        plan.push(Stripe { offset, len: 0 });
    }
    Ok(plan)
}

/// A stripe's connection and its open of `region`: a failure a new connection may get past
/// ([`Error::is_transient`], as a server not up yet) uses a try of `retries` and its wait.
async fn connected(
    cfg: ClientConfig,
    region: &str,
    purpose: OpenFor,
    retries: &mut Retries,
) -> Result<(Client, super::OpenRegion)> {
    loop {
        let opened = async {
            let mut c = Client::connect(cfg.clone()).await?;
            let r = c.open_for(region, purpose).await?;
            Ok::<_, Error>((c, r))
        }
        .await;
        match opened {
            Err(e) if e.is_transient() && retries.left() > 0 => {
                retries
                    .take_turn(&format!(
                        "opening '{region}' failed ({e}); connecting again"
                    ))
                    .await;
            }
            other => return other,
        }
    }
}

/// Close the region and say goodbye; what failed there changes nothing of the stripe's
/// outcome (its bytes are checked, and flushed where puts are made durable, before).
async fn goodbye(mut c: Client, r: &super::OpenRegion) {
    if let Err(e) = c.close(r).await {
        tracing::debug!("closing a stripe's region: {e}");
    }
    if let Err(e) = c.bye().await {
        tracing::debug!("closing a stripe's connection: {e}");
    }
}

/// Run the stripes' lanes together, one task each, telling `progress` the sum of their
/// counters while they move; their outcomes in range order.
async fn run(
    lanes: Vec<(Stripe, Arc<AtomicU64>, Lane)>,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<Striped> {
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut stripes = Vec::with_capacity(lanes.len());
    let mut counters = Vec::with_capacity(lanes.len());
    for (i, (s, moved, lane)) in lanes.into_iter().enumerate() {
        stripes.push(s);
        counters.push(moved);
        tasks.spawn(async move { (i, lane.await) });
    }
    let sum = || -> u64 { counters.iter().map(|c| c.load(Ordering::Relaxed)).sum() };
    let mut outcomes: Vec<Option<Result<Resumed>>> = stripes.iter().map(|_| None).collect();
    let mut tick = tokio::time::interval(TICK);
    let mut told = 0;
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(Ok((i, out))) => outcomes[i] = Some(out),
                Some(Err(e)) => {
                    return Err(Error::Config(format!("a stripe's task ended abnormally: {e}")))
                }
                None => break,
            },
            _ = tick.tick() => {
                let now = sum();
                if now != told {
                    progress(now);
                    told = now;
                }
            }
        }
    }
    progress(sum());
    let stripes = stripes
        .into_iter()
        .zip(outcomes)
        .map(|(s, out)| {
            let out = out.unwrap_or_else(|| {
                Err(Error::Config(format!(
                    "the stripe at offset {} gave no outcome",
                    s.offset
                )))
            });
            (s, out)
        })
        .collect();
    Ok(Striped {
        stripes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::TransferReport;

    fn resumed(offset: u64, data: &[u8], earlier: Vec<Stripe>) -> Resumed {
        let report = TransferReport {
            kept_bytes: earlier.iter().map(|s| s.len).sum(),
            ..crate::stripe::test_report(offset, data, true)
        };
        Resumed { report, earlier }
    }

    /// Lanes over `data` cut in three, the stripe `failing` (if any) failing; each lane says
    /// its bytes moved before it ends, the last one after the others.
    fn lanes(data: &Arc<Vec<u8>>, failing: Option<usize>) -> Vec<(Stripe, Arc<AtomicU64>, Lane)> {
        let plan = crate::stripe::plan(0, data.len() as u64, 3, 1000);
        assert_eq!(plan.len(), 3);
        plan.into_iter()
            .enumerate()
            .map(|(i, s)| {
                let (moved, data) = (Arc::new(AtomicU64::new(0)), Arc::clone(data));
                let counter = Arc::clone(&moved);
                let lane: Lane = Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(50 * (3 - i as u64))).await;
                    counter.store(s.len, Ordering::Relaxed);
                    if failing == Some(i) {
                        return Err(Error::Config(format!("stripe {i} broke")));
                    }
                    let bytes = &data[s.offset as usize..(s.offset + s.len) as usize];
                    // the middle stripe went on after a failed try that moved 500 bytes
                    let earlier = if i == 1 {
                        vec![Stripe {
                            offset: s.offset,
                            len: 500,
                        }]
                    } else {
                        vec![]
                    };
                    Ok(resumed(s.offset, bytes, earlier))
                });
                (s, moved, lane)
            })
            .collect()
    }

    #[test]
    fn an_empty_range_is_one_empty_stripe_and_a_range_past_the_end_of_offsets_is_refused() {
        let cfg = ClientConfig::new("127.0.0.1:1", "t");
        let one = stripes(4096, 0, 4, &cfg).unwrap();
        assert_eq!(
            one,
            [Stripe {
                offset: 4096,
                len: 0
            }]
        );
        let e = stripes(u64::MAX - 10, 11, 4, &cfg).unwrap_err();
        assert!(e.to_string().contains("past the largest offset"), "{e}");
        let four = stripes(0, 64 << 20, 4, &cfg).unwrap();
        assert_eq!(four.len(), 4);
        assert_eq!(four.iter().map(|s| s.len).sum::<u64>(), 64 << 20);
    }

    #[tokio::test]
    async fn a_sink_or_source_that_cannot_be_opened_fails_the_transfer_before_it_connects() {
        // no server at this address: the closure's error comes first, named
        let cfg = ClientConfig::new("127.0.0.1:1", "t");
        let denied = |_: Stripe| -> std::io::Result<SinkFor> {
            Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
        };
        let e = Client::fetch_striped(
            &cfg,
            "r",
            (0, 1 << 20),
            2,
            denied,
            &Retries::none(),
            &mut |_| {},
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("opening a stripe's sink"), "{e}");
        let denied = |_: Stripe| -> std::io::Result<SourceFor> {
            Err(std::io::Error::from(std::io::ErrorKind::NotFound))
        };
        let e = Client::put_striped(
            &cfg,
            "r",
            (0, 1 << 20),
            2,
            denied,
            &Retries::none(),
            &mut |_| {},
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("opening a stripe's source"), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn stripes_end_in_any_order_and_make_one_report_of_the_whole_range() {
        let data: Arc<Vec<u8>> = Arc::new((0..10_000u32).map(|i| (i * 7 % 251) as u8).collect());
        let mut told = Vec::new();
        let out = run(lanes(&data, None), &mut |n| told.push(n))
            .await
            .unwrap();
        let offsets: Vec<u64> = out.stripes.iter().map(|(s, _)| s.offset).collect();
        assert_eq!(
            offsets,
            [0, 4000, 7000],
            "in range order, not the order they ended"
        );
        assert_eq!(told.last(), Some(&10_000), "{told:?}");
        assert!(
            told.windows(2).all(|w| w[0] < w[1]),
            "told only as it grows: {told:?}"
        );
        let whole = out.whole().unwrap();
        assert_eq!((whole.report.offset, whole.report.bytes), (0, 10_000));
        assert_eq!(whole.report.crc32c, Some(crc32c::crc32c(&data)));
        assert_eq!(whole.report.kept_bytes, 500);
        assert_eq!(
            whole.earlier,
            [Stripe {
                offset: 4000,
                len: 500
            }]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stripe_that_fails_leaves_the_others_theirs_and_the_whole_its_failure() {
        let data: Arc<Vec<u8>> = Arc::new(vec![3; 10_000]);
        let out = run(lanes(&data, Some(1)), &mut |_| {}).await.unwrap();
        let ok: Vec<bool> = out.stripes.iter().map(|(_, o)| o.is_ok()).collect();
        assert_eq!(ok, [true, false, true]);
        let e = out.whole().unwrap_err();
        assert_eq!(e.to_string(), "stripe 1 broke");
    }
}
