//! The benchmark's server side: its target memory, one session, and the bounce path.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use peermem::canary::DeviceMr;
use peermem::plan::{P2pPolicy, PathKind, RegChoice};
use peermem::Provider;
use tokio::net::TcpListener;
use verbs::{
    Access, Context, HostBuffer, Local, ProtectionDomain, QueuePair, RegMode, RegisteredBuffer,
    SinkBuffer,
};

use super::pong::{self, Pings, Pongs, RunSize, PONG_BYTE};
use super::settle;
use super::*;

/// The server's target memory: host RAM, or a provider's memory proved direct.
pub(super) enum Target {
    Host(RegisteredBuffer),
    Device(DeviceMr),
}

impl Target {
    pub(super) fn keys(&self, len: u64) -> Result<Keys> {
        Ok(match self {
            Target::Host(b) => b.mr().remote(0..len)?,
            Target::Device(d) => d.mr().remote(0..len)?,
        }
        .into())
    }
    pub(super) fn fill(&mut self, data: &[u8]) -> Result<()> {
        match self {
            // the client may write this memory at any time: copy, never borrow
            Target::Host(b) => b
                .write_at(0, data)
                .map_err(|e| BenchError::Config(e.to_string()))?,
            Target::Device(d) => d
                .provider()
                .copy_in(d.start(), data)
                .map_err(|e| BenchError::Config(e.to_string()))?,
        }
        Ok(())
    }
    pub(super) fn read(&self, len: usize) -> Result<Vec<u8>> {
        match self {
            Target::Host(b) => {
                let mut v = vec![0; len];
                b.read_at(0, &mut v)
                    .map_err(|e| BenchError::Config(e.to_string()))?;
                Ok(v)
            }
            Target::Device(d) => {
                let mut v = vec![0; len];
                d.provider()
                    .copy_out(d.start(), &mut v)
                    .map_err(|e| BenchError::Config(e.to_string()))?;
                Ok(v)
            }
        }
    }
}

/// Receive buffers per QP for SEND runs: as perftest's server, 512 (or the depth, where that
/// is more), so that a sender's window never finds the receive queue empty while the
/// receiver reposts (each such SEND is refused with an RNR NAK and retried only after the
/// RNR timer, 0.64 ms); within 128 MiB of buffers for all QPs together.
pub(super) fn recv_slots(p: &BenchParams) -> u32 {
    let by_mem = ((128usize << 20) / p.qps.max(1) as usize / p.max_size()).max(2) as u32;
    p.tx_depth.max(512).min(by_mem).clamp(2, 4096)
}

/// Server memory options.
#[derive(Debug, Clone)]
pub struct ServerMem {
    /// The token clients must present.
    pub token: bridge::Token,
    /// A region spec of `serve` without the name (None: host RAM).
    pub spec: Option<String>,
    /// Policy.
    pub p2p: P2pPolicy,
    /// Strategy.
    pub reg: RegChoice,
    /// Memory that holds data (a file, block storage) may be written (`--overwrite`): the
    /// benchmark writes it, and the server writes its pattern into it for reads.
    pub overwrite: bool,
}

impl ServerMem {
    /// Whether the benchmark must leave `provider`'s bytes as they are: it holds data, and
    /// `--overwrite` was not given.
    fn keeps(&self, provider: &dyn Provider) -> bool {
        provider.holds_data() && !self.overwrite
    }
}

/// What the server's memory must allow for the benchmark `p` (and nothing more).
pub(super) fn target_access(p: &BenchParams) -> Access {
    match (p.op, p.bidir) {
        (BenchOp::Send, _) => Access::LOCAL_WRITE,
        (BenchOp::Read, false) => Access::REMOTE_READ,
        (BenchOp::Write, false) => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        (_, true) => Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    }
}

/// Serve one benchmark client on `listen`, then return.
pub async fn serve_one(listen: SocketAddr, side: &Side, mem: &ServerMem) -> Result<()> {
    let l = TcpListener::bind(listen)
        .await
        .map_err(|e| BenchError::Control(format!("cannot listen on {listen}: {e}")))?;
    tracing::info!(%listen, "waiting for a bench client");
    let (s, peer) = l
        .accept()
        .await
        .map_err(|e| BenchError::Control(format!("accept: {e}")))?;
    tracing::info!(%peer, "bench client connected");
    let mut c = Control::new(s);
    match serve_session(&mut c, side, mem).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = c
                .send(&Msg::Error {
                    message: e.to_string(),
                })
                .await;
            Err(e)
        }
    }
}

pub(super) async fn serve_session(c: &mut Control, side: &Side, mem: &ServerMem) -> Result<()> {
    let hello = tokio::time::timeout(HELLO_TIMEOUT, c.recv())
        .await
        .map_err(|_| {
            BenchError::Control(format!("no hello within {} s", HELLO_TIMEOUT.as_secs()))
        })??;
    let Msg::Hello {
        token,
        params: p,
        endpoints,
        keys: client_keys,
    } = hello
    else {
        return Err(BenchError::Control("expected hello".into()));
    };
    if !mem.token.matches(&token) {
        return Err(BenchError::Control(
            "wrong token: the client must use the server's token (--token-file or P2P_RDMA_TOKEN)"
                .into(),
        ));
    }
    p.check().map_err(BenchError::Config)?;
    if endpoints.len() != p.qps as usize {
        return Err(BenchError::Control(
            "endpoint count differs from --qps".into(),
        ));
    }
    let ctx = Context::open(side.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let max = p.max_size();

    // The target memory and its path (and the spec's own options, for the bounce path's server).
    let mut options = bridge::spec::RegionOptions::default();
    let (mut target, path, strategy, provider): (
        Target,
        String,
        String,
        Option<Arc<dyn Provider>>,
    ) = match &mem.spec {
        None => (
            Target::Host(pd.register(HostBuffer::new(max)?, target_access(&p), RegMode::Pinned)?),
            "direct".into(),
            "pinned".into(),
            None,
        ),
        Some(spec) => {
            let parsed: bridge::RegionSpec = format!("bench={spec}")
                .parse()
                .map_err(|e: String| BenchError::Config(format!("--mem {spec}: {e}")))?;
            let (provider, _) = parsed
                .open(std::path::Path::new("/sys"), max as u64)
                .map_err(|e| BenchError::Config(format!("--mem {spec}: {e}")))?;
            if provider.len() < max as u64 {
                return Err(BenchError::Config(format!(
                    "--mem {spec} holds {} bytes, less than the largest message ({max})",
                    provider.len()
                )));
            }
            // the spec's own ,reg= ,p2p= apply as in serve; the benchmark measures one path
            let choice = parsed.options.choice(max as u64, mem.reg, mem.p2p);
            options = parsed.options.clone();
            if choice.window < max as u64 {
                return Err(BenchError::Config(format!(
                    "--mem {spec}: ,window= ({} bytes) is smaller than the largest message ({max}); \
                     a benchmark measures one path: leave ,window= out or lower --size",
                    choice.window
                )));
            }
            let access = target_access(&p);
            if mem.keeps(&*provider) && access.contains(Access::REMOTE_WRITE) {
                return Err(BenchError::Config(format!(
                    "--mem {spec} holds data ({}): a {} benchmark would overwrite it; \
                     benchmark reads of it, writes to host:, cmb: or dmabuf: memory, or give \
                     the server --overwrite to let the benchmark destroy what it holds",
                    provider.describe(),
                    if p.bidir { "bidirectional" } else { "write" }
                )));
            }
            let planned = bridge::path::decide_path(&pd, &provider, choice)
                .await
                .map_err(|r| BenchError::Config(r.to_string()))?;
            match (planned.decision.path, planned.mr) {
                (PathKind::Direct, Some(mr)) => {
                    // least privilege: the rkey allows what the benchmark does, no more
                    let mode = mr.mode();
                    drop(mr);
                    let mr =
                        peermem::canary::register_mode(&pd, &provider, 0..max as u64, access, mode)
                            .map_err(|e| {
                                BenchError::Config(format!("--mem {spec} ({mode}): {e}"))
                            })?;
                    (
                        Target::Device(mr),
                        "direct".into(),
                        mode.to_string(),
                        Some(provider),
                    )
                }
                _ => {
                    tracing::info!(reason = %planned.decision.reason, "server memory goes through bounce buffers");
                    // placeholder target (unused on the bounce path)
                    (
                        Target::Host(pd.register(
                            HostBuffer::new(4096)?,
                            Access::ALL,
                            RegMode::Pinned,
                        )?),
                        "bounce".into(),
                        provider.copy_engine().to_string(),
                        Some(provider),
                    )
                }
            }
        }
    };

    // memory that holds data (a file) is never written by the benchmark (unless --overwrite):
    // no pattern to check
    let keep = provider.as_ref().is_some_and(|m| mem.keeps(&**m));
    if keep && p.validate {
        return Err(BenchError::Config(format!(
            "--validate needs the server to write its pattern into the memory, and {} holds data; \
             run without --validate, or give the server --overwrite",
            mem.spec.as_deref().unwrap_or("the memory")
        )));
    }
    if path == "bounce" {
        let provider =
            provider.ok_or_else(|| BenchError::Config("bounce without memory".into()))?;
        return serve_bounce(c, side, &p, provider, strategy, options, mem).await;
    }

    // QPs, one per client QP; SEND runs keep receive buffers posted on every QP.
    let recv = if p.op == BenchOp::Send || p.lat {
        recv_slots(&p)
    } else {
        1
    };
    let mut qps = Vec::new();
    for &ep in &endpoints {
        let qp = QueuePair::new(&pd, qp_options(side, &p, recv))?;
        qp.connect(&ep.into())?;
        qps.push(qp);
    }
    // a polled WRITE ping-pong on host memory goes as ib_write_lat: the pings land in a
    // buffer of the partner's, which it polls (the memory under test keeps its bytes)
    let polled_memory =
        p.lat && p.poll && p.op == BenchOp::Write && matches!(target, Target::Host(_));
    let landing = polled_memory.then(|| pong::landing(&pd, max)).transpose()?;
    let my_keys = match &landing {
        Some(l) => l.mr().remote(0..max as u64)?.into(),
        None => target.keys(max as u64)?,
    };
    c.send(&Msg::Ready {
        endpoints: qps.iter().map(|q| q.endpoint().into()).collect(),
        keys: my_keys,
        path: path.clone(),
        strategy: strategy.clone(),
        bridge: None,
        polled_memory,
    })
    .await?;

    // Receivers (SEND runs, and ping-pong partners of latency runs).
    let stop = Arc::new(AtomicBool::new(false));
    // however this session ends (an error returned early included), its receivers stop: a
    // spinning latency partner is a thread the runtime cannot abort
    let _stop_on_exit = StopOnDrop(Arc::clone(&stop));
    let received = Arc::new(AtomicU64::new(0));
    let bad = Arc::new(AtomicU64::new(0));
    let mut receivers = tokio::task::JoinSet::new();
    let mut polled: Vec<settle::SpinTask<()>> = Vec::new();
    // the run sizes of polled latency partners (one per QP)
    let mut runs: Vec<Arc<RunSize>> = Vec::new();
    if p.op == BenchOp::Send || (p.lat && p.op == BenchOp::Write) {
        let pat = Arc::new(pattern(max));
        // local only: no rkey of it is handed out
        let mut source =
            pd.register(HostBuffer::new(max)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
        // no zero byte: a polled pong is seen by its last byte turning non-zero
        source.as_mut_slice().fill(PONG_BYTE);
        let source = Arc::new(source);
        let mut landing = landing;
        for qp in &qps {
            // small pongs go inline, as the client's pings, and ask for no completion
            let pongs = Arc::new(Pongs {
                op: p.op,
                plain_write: landing.is_some(),
                client: client_keys,
                source: Arc::clone(&source),
                inline: p.inline_size() as usize,
            });
            let mut slots = VecDeque::new();
            if landing.is_none() {
                let n = if p.lat { 2 } else { recv };
                for _ in 0..n {
                    let b =
                        pd.register(HostBuffer::new(max)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
                    slots.push_back(qp.post_recv(vec![Local::owned(b)])?);
                }
            }
            if p.lat {
                // a latency partner answers on a thread of its own, as the client pings: it
                // spins (--poll) or sleeps on the completion channel, and is told each run's
                // size before the run starts
                let pings = match landing.take() {
                    Some(landing) => Pings::InMemory(landing),
                    None => Pings::Received(slots),
                };
                let run = Arc::new(RunSize::default());
                runs.push(Arc::clone(&run));
                let (qp, stop, received) = (qp.clone(), Arc::clone(&stop), Arc::clone(&received));
                let poll = p.poll;
                receivers.spawn(settle::on_own_thread(async move {
                    pong::partner(&qp, pings, &pongs, &run, &stop, &received, poll).await
                }));
                continue;
            }
            let (qp, stop, received, bad, pat) = (
                qp.clone(),
                Arc::clone(&stop),
                Arc::clone(&received),
                Arc::clone(&bad),
                Arc::clone(&pat),
            );
            let (validate, op) = (p.validate, p.op);
            // a SEND bandwidth run's receiver (latency runs have their partner, above)
            let receiver: settle::SpinTask<()> = Box::pin(async move {
                while let Some(front) = slots.pop_front() {
                    let got = tokio::select! {
                        r = front.wait() => r,
                        _ = async { while !stop.load(Ordering::Relaxed) { tokio::time::sleep(Duration::from_millis(20)).await } } => break,
                    };
                    let Ok(mut got) = got else { break };
                    let Some((local, info)) = got.pop() else {
                        break;
                    };
                    let n = info.byte_len as usize;
                    if validate
                        && op == BenchOp::Send
                        && local.bytes().map(|b| &b[..n]) != Some(&pat[..n])
                    {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    received.fetch_add(1, Ordering::Relaxed);
                    let Some(buf) = local.into_owned() else { break };
                    slots.push_back(qp.post_recv(vec![Local::owned(buf)])?);
                }
                Ok::<(), BenchError>(())
            });
            if p.poll {
                polled.push(receiver);
            } else {
                receivers.spawn(receiver);
            }
        }
    }
    // busy-polled receivers spin together on a thread of their own, as the client's lanes
    if !polled.is_empty() {
        receivers.spawn(async move { settle::spin_together(polled).await.map(drop) });
    }

    let pat = pattern(max);
    let sink = if p.bidir && p.op == BenchOp::Read {
        Some(SinkBuffer::new(pd.register(
            HostBuffer::new(max)?,
            Access::LOCAL_WRITE,
            RegMode::Pinned,
        )?))
    } else {
        None
    };
    let source = if p.bidir && p.op == BenchOp::Write {
        // the local side of this side's WRITEs: no remote access
        let mut b = pd.register(HostBuffer::new(max)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
        b.as_mut_slice().copy_from_slice(&pat);
        Some(Arc::new(b))
    } else {
        None
    };
    let mut sink = sink;
    loop {
        match c.recv().await? {
            Msg::Run { size } => {
                let n = size as usize;
                if !keep && (p.op == BenchOp::Read || p.validate) {
                    // READs fetch the pattern; WRITEs are checked against it afterwards.
                    // (Never into memory that holds data: `keep`.)
                    let fill: Vec<u8> = if p.op == BenchOp::Read {
                        pat[..n].to_vec()
                    } else {
                        vec![0; n]
                    };
                    target.fill(&fill)?;
                }
                for run in &runs {
                    run.announce(n).await?;
                }
                let before = received.load(Ordering::Relaxed);
                let bad_before = bad.load(Ordering::Relaxed);
                c.send(&Msg::Go).await?;
                let mut mine = 0;
                if p.bidir {
                    let remote = client_keys;
                    let local = match (&source, &sink) {
                        (Some(s), _) => Lane::Shared(Arc::clone(s)),
                        (_, Some(s)) => Lane::Sink(Arc::clone(s)),
                        _ => unreachable!("bidir has a buffer"),
                    };
                    let r = run_lanes(&qps, p.op, &local, remote, n, &p).await?;
                    mine = r.iterations;
                }
                let Msg::Done { size: s2 } = c.recv().await? else {
                    return Err(BenchError::Control("expected done".into()));
                };
                if s2 != size {
                    return Err(BenchError::Control("size mismatch".into()));
                }
                // let the last receives land
                tokio::time::sleep(Duration::from_millis(if p.op == BenchOp::Send {
                    50
                } else {
                    0
                }))
                .await;
                let validated = if p.validate {
                    Some(match p.op {
                        BenchOp::Write => target.read(n)? == pat[..n],
                        BenchOp::Read if !p.bidir => true,
                        BenchOp::Read => {
                            if let Some(s) = sink.take() {
                                let ok = match SinkBuffer::into_inner(s) {
                                    Ok(b) => {
                                        let ok = b.as_slice()[..n] == pat[..n];
                                        sink = Some(SinkBuffer::new(b));
                                        ok
                                    }
                                    Err(s) => {
                                        sink = Some(s);
                                        false
                                    }
                                };
                                ok
                            } else {
                                true
                            }
                        }
                        BenchOp::Send => bad.load(Ordering::Relaxed) == bad_before,
                    })
                } else {
                    None
                };
                let iterations = if p.op == BenchOp::Send && !p.lat {
                    received.load(Ordering::Relaxed) - before
                } else {
                    mine
                };
                c.send(&Msg::Stats {
                    iterations,
                    validated,
                })
                .await?;
            }
            Msg::Bye => break,
            other => return Err(BenchError::Control(format!("unexpected {other:?}"))),
        }
    }
    // Receivers leave at the stop flag (their posted receives are dropped with the QP).
    stop.store(true, Ordering::Relaxed);
    while receivers.join_next().await.is_some() {}
    drop(provider);
    Ok(())
}

/// Bounce path: serve the memory through the bridge and let the client put/fetch it.
pub(super) async fn serve_bounce(
    c: &mut Control,
    side: &Side,
    p: &BenchParams,
    provider: Arc<dyn Provider>,
    strategy: String,
    options: bridge::spec::RegionOptions,
    mem: &ServerMem,
) -> Result<()> {
    // (a write into memory that holds data was refused before the path was chosen)
    let keep = mem.keeps(&*provider);
    if p.op == BenchOp::Send || p.lat || p.bidir {
        return Err(BenchError::Config(
            "the server memory goes through bounce buffers: only write and read bandwidth runs (put/fetch through the bridge) are measured on that path".into(),
        ));
    }
    let token = mem.token.clone();
    let local =
        c.wr.local_addr()
            .map_err(|e| BenchError::Control(e.to_string()))?;
    let mut cfg =
        bridge::ServerConfig::new(SocketAddr::new(local.ip(), 0), token.clone(), Vec::new());
    cfg.device = side.device.clone();
    // the memory's path is decided as `serve` decides it (the same canaries, which failed
    // here), so that chunks `serve` would lend the NIC from page starts are lent here too
    cfg.p2p = mem.p2p;
    cfg.reg = mem.reg;
    cfg.memory_regions.push(bridge::MemoryRegionSpec {
        name: "bench".into(),
        provider: Arc::clone(&provider),
        // least privilege: a read benchmark cannot change the memory
        read_only: p.op == BenchOp::Read,
        options,
    });
    let server = bridge::Server::bind(cfg).await?;
    let port = server.local_addr()?.port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    c.send(&Msg::Ready {
        endpoints: Vec::new(),
        keys: Keys {
            addr: 0,
            rkey: 0,
            len: 0,
        },
        path: "bounce".into(),
        strategy,
        bridge: Some((port, token.expose().to_string())),
        polled_memory: false,
    })
    .await?;
    let pat = pattern(p.max_size());
    loop {
        match c.recv().await? {
            Msg::Run { size } => {
                if p.op == BenchOp::Read && !keep {
                    // every message the client may fetch in one pipelined span holds the pattern
                    let span = bounce_span(size, p.tx_depth, provider.len());
                    let mut off = 0;
                    while off < span {
                        provider
                            .copy_in(off, &pat[..size as usize])
                            .map_err(|e| BenchError::Config(e.to_string()))?;
                        off += size;
                    }
                }
                c.send(&Msg::Go).await?;
                let Msg::Done { .. } = c.recv().await? else {
                    return Err(BenchError::Control("expected done".into()));
                };
                let validated = if p.validate && p.op == BenchOp::Write {
                    let mut v = vec![0; size as usize];
                    provider
                        .copy_out(0, &mut v)
                        .map_err(|e| BenchError::Config(e.to_string()))?;
                    Some(v == pat[..size as usize])
                } else {
                    None
                };
                c.send(&Msg::Stats {
                    iterations: 0,
                    validated,
                })
                .await?;
            }
            Msg::Bye => break,
            other => return Err(BenchError::Control(format!("unexpected {other:?}"))),
        }
    }
    let _ = tx.send(());
    let _ = task.await;
    Ok(())
}

/// Bytes one pipelined bounce put/fetch moves: `depth` messages of `size`, or as many as the
/// region holds (at least one).
pub(super) fn bounce_span(size: u64, depth: u32, region: u64) -> u64 {
    let msgs = (u64::from(depth.max(1))).min(region / size.max(1)).max(1);
    msgs * size
}

/// Sets the flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
