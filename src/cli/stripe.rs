//! `fetch` and `put` with `--qps N`: one transfer striped over N connections to the same
//! server, each with its own queue pair, each stripe a file range of its own (the cut and the
//! merged report: `bridge::stripe`).

use std::io::{Seek as _, SeekFrom};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bridge::stripe::Stripe;
use bridge::{Client, ClientConfig, OpenFor, OpenRegion, TransferReport};

use super::resume::{Left, Tried};
use super::transfer::{file_part, Progress};

/// The connections of a striped transfer, the first one being the one already open.
pub(crate) struct Lanes {
    pub(crate) lanes: Vec<(Client, OpenRegion)>,
}

impl Lanes {
    /// `first` and up to `n - 1` more connections to its server, opened at once (each one's
    /// handshake and open overlap the others'), the `i`th opening `region` for `purpose(i)` (a
    /// fetch's lane names its stripe). A server that refuses some (its connection limit)
    /// leaves fewer stripes, said on stderr; the stripes are then cut again, and a first chunk
    /// staged for another cut goes back unread.
    pub(crate) async fn open(
        first: (Client, OpenRegion),
        base: &ClientConfig,
        region: &str,
        n: usize,
        purpose: impl Fn(usize) -> OpenFor,
    ) -> Lanes {
        let addr = first.0.addr().to_string();
        let mut set = tokio::task::JoinSet::new();
        for i in 1..n {
            let cfg = ClientConfig {
                addr: addr.clone(),
                ..base.clone()
            };
            let (region, purpose) = (region.to_string(), purpose(i));
            set.spawn(async move {
                let lane = async {
                    let mut c = Client::connect(cfg).await?;
                    let r = c.open_for(&region, purpose).await?;
                    Ok::<_, bridge::Error>((c, r))
                };
                (i, lane.await)
            });
        }
        let mut more = Vec::new();
        let mut failed = Vec::new();
        while let Some(done) = set.join_next().await {
            match done {
                Ok((i, Ok(lane))) => more.push((i, lane)),
                Ok((i, Err(e))) => failed.push((i, e.to_string())),
                Err(e) => failed.push((n, format!("its task ended abnormally: {e}"))),
            }
        }
        more.sort_by_key(|(i, _)| *i);
        failed.sort_by_key(|(i, _)| *i);
        let mut lanes = vec![first];
        lanes.extend(more.into_iter().map(|(_, lane)| lane));
        for (i, e) in &failed {
            eprintln!(
                "p2p-rdma: --qps {n}: connection {} to {addr} failed ({e})",
                i + 1
            );
        }
        if !failed.is_empty() {
            eprintln!("p2p-rdma: --qps {n}: striping over {}", lanes.len());
        }
        Lanes { lanes }
    }

    /// Close every connection but the first (which the caller reports on and closes).
    pub(crate) async fn close_rest(&mut self) -> (Client, OpenRegion) {
        let mut all = std::mem::take(&mut self.lanes).into_iter();
        let first = all
            .next()
            .expect("a striped transfer has a first connection");
        for (mut c, r) in all {
            let _ = c.close(&r).await;
            let _ = c.bye().await;
        }
        first
    }
}

/// The connections and pieces of a striped try over what `left` says is left: a connection per
/// piece, up to `n` (`first` and the others, each opened for `purpose` of its piece); when the
/// server took fewer, the pieces are cut again for those it took (a first chunk staged for
/// another cut goes back unread).
pub(crate) async fn lanes_for(
    first: (Client, OpenRegion),
    (base, region): (&ClientConfig, &str),
    left: &mut Left,
    n: usize,
    purpose: impl Fn(Stripe) -> OpenFor,
) -> (Lanes, Vec<Stripe>) {
    let chunk = base.chunk as u64;
    let mut pieces = self::pieces(left, n, chunk);
    let lanes = Lanes::open(first, base, region, pieces.len(), |i| {
        pieces.get(i).copied().map_or(OpenFor::Read, &purpose)
    })
    .await;
    if lanes.lanes.len() < pieces.len() {
        pieces = self::pieces(left, lanes.lanes.len(), chunk);
    }
    (lanes, pieces)
}

type Lane = (Client, OpenRegion);
type Done = (usize, Lane, bridge::Result<TransferReport>);

/// How a striped transfer is watched: the progress line, the bytes moved by earlier tries (for
/// it), and what is handed the bytes each stripe moved so far, every 100 ms while they move.
pub(crate) type Watch<'a> = (&'a mut Progress, u64, &'a mut dyn FnMut(&[u64]));

/// The stripes' reports of a striped transfer, and the bytes each stripe moved in order (what
/// a failed one moved before it failed).
type Striped = (bridge::Result<Tried>, Vec<u64>);

/// Run one task per stripe, each with its own file (`files[i]` for `stripes[i]`), keep the
/// progress line moving (`before`: bytes moved by earlier tries), hand `note` the bytes each
/// stripe moved so far every 100 ms while they move, and give the reports (merged by the
/// caller, `Tried::whole`, with what earlier tries kept). A failed stripe fails the transfer
/// (its range is said on stderr; the error is the stripe's own).
async fn run<T, F>(
    lanes: &mut Lanes,
    stripes: Vec<Stripe>,
    files: Vec<T>,
    (bar, before, note): Watch<'_>,
    start: impl Fn(usize, Lane, Stripe, T, Arc<AtomicU64>) -> F,
) -> anyhow::Result<Striped>
where
    F: std::future::Future<Output = Done> + Send + 'static,
{
    anyhow::ensure!(
        stripes.len() <= lanes.lanes.len(),
        "{} stripes for {} connections",
        stripes.len(),
        lanes.lanes.len()
    );
    let t0 = Instant::now();
    if stripes.len() > 1 {
        eprintln!(
            "p2p-rdma: striped over {} connections to {}, one QP each",
            stripes.len(),
            lanes.lanes[0].0.addr()
        );
    }
    let counters: Vec<Arc<AtomicU64>> = stripes.iter().map(|_| Arc::default()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    let mut used = std::mem::take(&mut lanes.lanes);
    // a range of fewer chunks than connections leaves some idle: kept, to be closed in order
    let idle = used.split_off(stripes.len().min(used.len()));
    for (i, ((lane, s), f)) in used
        .into_iter()
        .zip(stripes.iter().copied())
        .zip(files)
        .enumerate()
    {
        tasks.spawn(start(i, lane, s, f, Arc::clone(&counters[i])));
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // what `note` was last handed: it is handed the counts again only when they moved
    let mut noted = vec![0u64; stripes.len()];
    let moved = |c: &[Arc<AtomicU64>]| -> Vec<u64> {
        c.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    };
    let mut results: Vec<Option<(Lane, bridge::Result<TransferReport>)>> =
        (0..stripes.len()).map(|_| None).collect();
    loop {
        tokio::select! {
            d = tasks.join_next() => match d {
                Some(Ok((i, lane, rep))) => results[i] = Some((lane, rep)),
                Some(Err(e)) => anyhow::bail!("a stripe's task ended without a result: {e}"),
                None => break,
            },
            _ = tick.tick() => {
                let now = moved(&counters);
                bar.update(before + now.iter().sum::<u64>());
                if now != noted {
                    note(&now);
                    noted = now;
                }
            }
        }
    }
    let mut reports = Vec::new();
    let mut failed = None;
    for (i, slot) in results.into_iter().enumerate() {
        let Some((lane, rep)) = slot else {
            anyhow::bail!("stripe {} did not report", i + 1)
        };
        lanes.lanes.push(lane);
        match rep {
            Ok(r) => reports.push(r),
            Err(e) => {
                let s = stripes[i];
                eprintln!(
                    "p2p-rdma: stripe {} of {} (bytes {}..{} of the region) failed: {e}",
                    i + 1,
                    stripes.len(),
                    s.offset,
                    s.offset + s.len
                );
                failed.get_or_insert(e);
            }
        }
    }
    lanes.lanes.extend(idle);
    let moved = moved(&counters);
    if let Some(e) = failed {
        return Ok((Err(e), moved));
    }
    anyhow::ensure!(!reports.is_empty(), "a striped transfer without a stripe");
    let tried = Tried {
        pieces: reports,
        seconds: t0.elapsed().as_secs_f64(),
    };
    Ok((Ok(tried), moved))
}

/// Fetch the `pieces` of the range of `len` bytes at `offset` into the file `output`, one
/// piece per lane, each where it goes in the file: the file created and sized first (`fresh`),
/// else (a try after one that failed) written into as it is. `before`: bytes of the range
/// already in the file, for the progress line; `note`: as [`run`]'s.
pub(crate) async fn fetch(
    lanes: &mut Lanes,
    (offset, len): (u64, u64),
    pieces: &[Stripe],
    (output, fresh): (&str, bool),
    verify: bool,
    (bar, before, note): Watch<'_>,
) -> anyhow::Result<Striped> {
    if fresh {
        let f = std::fs::File::create(output)
            .with_context(|| format!("cannot create the output file {output}"))?;
        f.set_len(len)
            .with_context(|| format!("cannot size the output file {output} to {len} bytes"))?;
    }
    let mut files = Vec::new();
    for s in pieces {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(output)
            .with_context(|| format!("cannot open the output file {output}"))?;
        f.seek(SeekFrom::Start(s.offset - offset))
            .with_context(|| format!("cannot seek in {output}"))?;
        files.push(f);
    }
    run(
        lanes,
        pieces.to_vec(),
        files,
        (bar, before, note),
        |i, (mut c, r), s, mut f, done| async move {
            let rep = c
                .fetch(&r, s.offset, s.len, &mut f, verify, &mut |d| {
                    done.store(d, Ordering::Relaxed)
                })
                .await;
            (i, (c, r), rep)
        },
    )
    .await
}

/// Put the `pieces` of the range at `offset` from the file `input` (whose byte 0 goes to
/// `offset`), one piece per lane. `before`: bytes of the range put by earlier tries, for the
/// progress line.
pub(crate) async fn put(
    lanes: &mut Lanes,
    offset: u64,
    pieces: &[Stripe],
    input: &str,
    verify: bool,
    bar: &mut Progress,
    before: u64,
) -> anyhow::Result<Striped> {
    let mut files = Vec::new();
    for s in pieces {
        files.push(
            file_part(input, s.offset - offset, s.len)
                .with_context(|| format!("cannot read the input file {input}"))?,
        );
    }
    run(
        lanes,
        pieces.to_vec(),
        files,
        (bar, before, &mut |_| {}),
        |i, (mut c, r), s, mut f, done| async move {
            let rep = c
                .put(&r, s.offset, &mut f, Some(s.len), verify, &mut |d| {
                    done.store(d, Ordering::Relaxed)
                })
                .await;
            (i, (c, r), rep)
        },
    )
    .await
}

/// The pieces of the next try over `n` connections of what `left` says is left
/// ([`Left::spread_or_anew`]), said on stderr when the transfer has to start over.
pub(crate) fn pieces(left: &mut Left, n: usize, chunk: u64) -> Vec<Stripe> {
    let (parts, kept) = (left.parts(), left.kept_bytes());
    let p = left.spread_or_anew(n, chunk);
    if kept > 0 && left.kept_bytes() == 0 {
        eprintln!(
            "p2p-rdma: {parts} parts of the range are left, over {n} connections: moving the \
             whole range again"
        );
    }
    p
}
