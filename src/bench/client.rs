//! The benchmark's client side: bandwidth lanes and latency ping-pong.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use verbs::{
    Access, Context, HostBuffer, Local, ProtectionDomain, QueuePair, RegMode, RegisteredBuffer,
    RemoteSlice, SendOp, SendWr, SinkBuffer,
};

use super::lat::{lat_in_memory, lat_loop};
use super::pong;
use super::settle::{self, Settle};
use super::*;

#[derive(Clone)]
pub(super) enum Lane {
    Shared(Arc<RegisteredBuffer>),
    Sink(Arc<SinkBuffer>),
}

pub(super) struct LaneResult {
    pub(super) iterations: u64,
    pub(super) seconds: f64,
    pub(super) peak_mib_s: f64,
}

/// One bandwidth loop per QP, all at once; iterations and peak summed.
pub(super) async fn run_lanes(
    qps: &[QueuePair],
    op: BenchOp,
    local: &Lane,
    remote: Keys,
    size: usize,
    p: &BenchParams,
) -> Result<LaneResult> {
    let mut lanes: Vec<settle::SpinTask<LaneResult>> = Vec::new();
    for qp in qps {
        let (qp, local) = (qp.clone(), local.clone());
        let (depth, iters, duration) = (p.tx_depth as usize, p.iters, p.duration);
        let measure = Window::of(p.duration, p.margin);
        let every = p.signal_every(size as u64);
        let inline = p.goes_inline(size);
        lanes.push(Box::pin(async move {
            bw_loop(
                &qp,
                op,
                &local,
                remote.slice(size as u64),
                size,
                (depth, every, inline),
                iters,
                duration,
                measure,
            )
            .await
        }));
    }
    // busy-polled lanes spin on a thread of their own (see `spin_together`); event-driven ones
    // sleep on the runtime
    let results = if p.poll {
        settle::spin_together(lanes).await?
    } else {
        settle::join_all(lanes).await?
    };
    let mut total = LaneResult {
        iterations: 0,
        seconds: 0.0,
        peak_mib_s: 0.0,
    };
    for r in results {
        total.iterations += r.iterations;
        total.seconds = total.seconds.max(r.seconds);
        total.peak_mib_s += r.peak_mib_s;
    }
    Ok(total)
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn bw_loop(
    qp: &QueuePair,
    op: BenchOp,
    local: &Lane,
    remote: RemoteSlice,
    size: usize,
    (depth, every, inline): (usize, usize, bool),
    iters: Option<u64>,
    duration: Option<f64>,
    measure: Option<Window>,
) -> Result<LaneResult> {
    let mk = || -> Result<SendWr> {
        let local = match local {
            Lane::Shared(b) if inline => Local::inline(&b.as_slice()[..size]),
            Lane::Shared(b) => Local::shared(Arc::clone(b), 0..size)?,
            Lane::Sink(b) => Local::sink(Arc::clone(b), 0..size)?,
        };
        let op = match op {
            BenchOp::Write => SendOp::Write(remote),
            BenchOp::Read => SendOp::Read(remote),
            BenchOp::Send => SendOp::Send,
        };
        Ok(SendWr { op, local })
    };
    let limit = iters.unwrap_or(u64::MAX);
    let start = Instant::now();
    let deadline = duration.map(|d| start + Duration::from_secs_f64(d));
    // One entry per work request; a refill posts every free slot in one batch (one doorbell),
    // once at least a quarter of the window is free; every `every`-th work request of a batch
    // (and its last) asks for a completion, which completes those before it.
    let mut window: VecDeque<verbs::Pending> = VecDeque::new();
    let (mut posted, mut done) = (0u64, 0u64);
    let refill = (depth / 4).max(1);
    let mut mark = (start, 0u64);
    let mut peak = 0.0f64;
    loop {
        let time_up = deadline.is_some_and(|d| Instant::now() >= d);
        let room = depth - window.len();
        if (room >= refill || window.is_empty()) && room > 0 && posted < limit && !time_up {
            let n = room.min((limit - posted).min(256) as usize);
            let wrs = (0..n).map(|_| mk()).collect::<Result<Vec<_>>>()?;
            window.extend(qp.post_send_moderated(wrs, every)?.split());
            posted += n as u64;
        }
        let Some(pend) = window.pop_front() else {
            break;
        };
        pend.wait().await?;
        // A duration run counts only the completions inside its window (perftest's -D: the
        // ramp-up and the drain are not measured).
        if measure.is_some_and(|w| !w.counts(start.elapsed().as_secs_f64())) {
            continue;
        }
        done += 1;
        if done == 1 {
            mark = (Instant::now(), 1);
        } else if done - mark.1 >= depth as u64 {
            let dt = mark.0.elapsed().as_secs_f64();
            if dt > 0.0 {
                peak = peak.max(((done - mark.1) * size as u64) as f64 / dt / (1 << 20) as f64);
            }
            mark = (Instant::now(), done);
        }
    }
    let seconds = match measure {
        Some(w) => w.seconds(),
        None => start.elapsed().as_secs_f64(),
    };
    Ok(LaneResult {
        iterations: done,
        seconds,
        peak_mib_s: peak,
    })
}

/// Client options.
#[derive(Debug, Clone)]
pub struct ClientOpts {
    /// `host:port` of the server.
    pub server: String,
    /// The server's token.
    pub token: bridge::Token,
    /// Device setup.
    pub side: Side,
    /// Parameters.
    pub params: BenchParams,
}

/// Run the benchmark against a server; `each` is called with every size's result as soon as
/// it is known.
pub async fn run_client(
    o: &ClientOpts,
    each: &mut (dyn FnMut(&SizeResult) + Send),
) -> Result<Vec<SizeResult>> {
    let p = &o.params;
    p.check().map_err(BenchError::Config)?;
    // A server started just before may not listen yet: retry refusals for a few seconds.
    let mut tries = 0;
    let s = loop {
        match TcpStream::connect(&o.server).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            r => break r,
        }
    };
    let s = s.map_err(|e| {
        BenchError::Unreachable(format!(
            "cannot reach the bench server at {}: {e} (is `p2p-rdma bench {}` running there?)",
            o.server,
            match p.op {
                BenchOp::Write => "write",
                BenchOp::Read => "read",
                BenchOp::Send => "send",
            }
        ))
    })?;
    let mut c = Control::new(s);
    let ctx = Context::open(o.side.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let max = p.max_size();
    let recv = if p.lat || p.bidir {
        recv_slots(p).min(4)
    } else {
        1
    };
    let mut qps = Vec::new();
    for _ in 0..p.qps {
        // (a latency loop without --poll sleeps on the completion channel on a thread of its
        // own, `Settle::Block`: its CQ is `CqMode::Blocking`)
        qps.push(QueuePair::new(&pd, qp_options(&o.side, p, recv))?);
    }
    let pat = pattern(max);
    // Local memory: a source for writes and sends, a sink for reads; one target for the
    // server's writes (bidir, write ping-pong).
    let mut src = pd.register(HostBuffer::new(max)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
    src.as_mut_slice().copy_from_slice(&pat);
    let src = Arc::new(src);
    let mut sink = Some(SinkBuffer::new(pd.register(
        HostBuffer::new(max)?,
        Access::LOCAL_WRITE,
        RegMode::Pinned,
    )?));
    // the server's READs (--bidir) fetch the pattern from here; its WRITEs land here
    // (remotely writable: the CPU only copies it)
    let mut mine = pd.register(HostBuffer::new(max)?, Access::ALL, RegMode::Pinned)?;
    mine.write_at(0, &pat)?;
    // a polled WRITE ping-pong's pongs land in a buffer of their own, which the loop polls
    // (the server may answer with WRITEs with immediate instead: they land there too)
    let mut landing = (p.lat && p.poll && p.op == BenchOp::Write)
        .then(|| pong::landing(&pd, max))
        .transpose()?;
    let mine_keys: Keys = landing
        .as_ref()
        .unwrap_or(&mine)
        .mr()
        .remote(0..max as u64)?
        .into();
    c.send(&Msg::Hello {
        token: o.token.clone(),
        params: p.clone(),
        endpoints: qps.iter().map(|q| q.endpoint().into()).collect(),
        keys: mine_keys,
    })
    .await?;
    let Msg::Ready {
        endpoints,
        keys,
        path,
        strategy,
        bridge,
        polled_memory,
    } = c.recv().await?
    else {
        return Err(BenchError::Control("expected ready".into()));
    };
    if polled_memory && landing.is_none() {
        return Err(BenchError::Control(
            "the server wants a polled WRITE ping-pong, which this run is not".into(),
        ));
    }
    let mut out = Vec::new();
    if let Some((port, token)) = bridge {
        let out = bridged::run(
            &o.server, port, token, &o.side, p, &path, &strategy, &pat, &mut c, each,
        )
        .await?;
        return Ok(out);
    }
    if endpoints.len() != qps.len() {
        return Err(BenchError::Control(
            "the server answered with a different number of QPs".into(),
        ));
    }
    for (qp, &ep) in qps.iter().zip(&endpoints) {
        qp.connect(&ep.into())?;
    }
    // a latency ping-pong's receives, kept from one size to the next
    let mut pongs = VecDeque::new();
    for &size in &p.sizes {
        let n = size as usize;
        c.send(&Msg::Run { size }).await?;
        let Msg::Go = c.recv().await? else {
            return Err(BenchError::Control("expected go".into()));
        };
        let res = if p.lat {
            // the loop runs on a thread of its own: it busy-polls (--poll) or sleeps on the
            // completion channel, and nothing stands between a completion and the next post
            let (qp, src, p2) = (qps[0].clone(), Arc::clone(&src), p.clone());
            let mut mine = std::mem::take(&mut pongs);
            let mut pad = landing.take();
            let (times, back, pad_back) = settle::on_own_thread(async move {
                let never = AtomicBool::new(false);
                let t = match pad.as_mut() {
                    Some(pad) if polled_memory => {
                        lat_in_memory(&qp, keys, n, &p2, pad, &never).await?
                    }
                    _ => {
                        let how = if p2.poll {
                            Settle::Spin { stop: &never }
                        } else {
                            Settle::Block
                        };
                        lat_loop(&qp, &src, keys, n, &p2, how, &mut mine).await?
                    }
                };
                Ok((t, mine, pad))
            })
            .await?;
            pongs = back;
            landing = pad_back;
            c.send(&Msg::Done { size }).await?;
            let Msg::Stats { .. } = c.recv().await? else {
                return Err(BenchError::Control("expected stats".into()));
            };
            let mut r = lat_result(p, size, &times, &path, &strategy);
            if polled_memory {
                r.cq = "memory".into();
            }
            r
        } else {
            let lane = match p.op {
                BenchOp::Read => Lane::Sink(sink.take().expect("sink is back after each size")),
                _ => Lane::Shared(Arc::clone(&src)),
            };
            if p.bidir && p.op == BenchOp::Write {
                mine.write_at(0, &vec![0; n])?;
            }
            let r = run_lanes(&qps, p.op, &lane, keys, n, p).await?;
            c.send(&Msg::Done { size }).await?;
            let Msg::Stats {
                iterations: theirs,
                validated,
            } = c.recv().await?
            else {
                return Err(BenchError::Control("expected stats".into()));
            };
            let mut ok = validated;
            if p.validate && p.bidir && p.op == BenchOp::Write {
                // the server's WRITEs into this side are done when its stats arrive
                let mut seen = vec![0; n];
                mine.read_at(0, &mut seen)?;
                ok = Some(ok.unwrap_or(true) && seen[..] == pat[..n]);
            }
            if let Lane::Sink(s) = lane {
                let b = SinkBuffer::into_inner(s)
                    .map_err(|_| BenchError::Control("a READ is still in flight".into()))?;
                if p.validate {
                    ok = Some(ok.unwrap_or(true) && b.as_slice()[..n] == pat[..n]);
                }
                sink = Some(SinkBuffer::new(b));
            }
            let iterations = match (p.op, p.bidir) {
                // a completed RC SEND was received: count the sender's completions within the
                // time (the receiver also sees what drains after the deadline)
                (BenchOp::Send, _) => r.iterations,
                (_, true) => r.iterations + theirs,
                _ => r.iterations,
            };
            let peak = if p.bidir {
                r.peak_mib_s * 2.0
            } else {
                r.peak_mib_s
            };
            let mut res = result(p, size, iterations, r.seconds, peak, &path, &strategy, ok);
            if p.op == BenchOp::Read {
                res.outs = Some(u32::from(qps[0].max_rd_atomic()));
            }
            res
        };
        each(&res);
        out.push(res);
    }
    c.send(&Msg::Bye).await?;
    for q in &qps {
        let _ = q.set_error();
    }
    Ok(out)
}
