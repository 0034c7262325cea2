//! `p2p-rdma bench`: an ib_write_bw / ib_read_bw / ib_send_bw / ib_*_lat-style benchmark
//! between two hosts.
//!
//! The server waits on a TCP port (perftest's 18515 by default); the client connects, sends the
//! parameters, and both sides set up RC QPs (one or more) and exchange their endpoints and
//! memory keys over that connection. Bandwidth runs keep `tx_depth` work requests in flight per
//! QP and post every free slot in one batch (one doorbell: on rxe one system call per batch
//! instead of one per work request). Latency runs ping-pong one message at a time.
//!
//! The server's memory (`--mem` on the server) may be any region spec of `serve`. When its
//! registration is proved direct, the client's one-sided operations target it; when it is not
//! (a bounce path), the server serves it through the bridge's bounce pipeline and the client
//! measures `put` (write) / `fetch` (read) transfers of each size, so the `path` column says
//! which path the numbers are for.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bridge::protocol::WireEndpoint;
use peermem::canary::DeviceMr;
use peermem::plan::{P2pPolicy, PathKind, RegChoice};
use peermem::Provider;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt as _, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use verbs::{
    Access, Context, CqMode, HostBuffer, Local, ProtectionDomain, QpOptions, QueuePair, RegMode,
    RegisteredBuffer, RemoteSlice, SendOp, SendWr, SinkBuffer,
};

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchOp {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND / RECV.
    Send,
}

impl BenchOp {
    /// perftest's name for the same test.
    pub fn perftest(self, lat: bool) -> &'static str {
        match (self, lat) {
            (BenchOp::Write, false) => "ib_write_bw",
            (BenchOp::Read, false) => "ib_read_bw",
            (BenchOp::Send, false) => "ib_send_bw",
            (BenchOp::Write, true) => "ib_write_lat",
            (BenchOp::Read, true) => "ib_read_lat",
            (BenchOp::Send, true) => "ib_send_lat",
        }
    }
}

/// The parameters the client sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchParams {
    /// Operation.
    pub op: BenchOp,
    /// Message sizes, in order.
    pub sizes: Vec<u64>,
    /// Work requests per QP per size (bandwidth) or round trips (latency).
    pub iters: Option<u64>,
    /// Or seconds per size.
    pub duration: Option<f64>,
    /// Work requests in flight per QP.
    pub tx_depth: u32,
    /// Queue pairs.
    pub qps: u32,
    /// Both directions at once (write and read).
    pub bidir: bool,
    /// Latency mode.
    pub lat: bool,
    /// Check the data at the end of each size.
    pub validate: bool,
    /// Ask for a completion every this many work requests (perftest's `--cq-mod`); 0: by size
    /// (see [`BenchParams::signal_every`]).
    #[serde(default)]
    pub cq_mod: u32,
    /// Busy-poll the completion queues on both sides (perftest's default) instead of sleeping
    /// on completion events.
    #[serde(default)]
    pub poll: bool,
}

impl BenchParams {
    /// Reject nonsense before anything is set up.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.sizes.is_empty() {
            return Err("no message size".into());
        }
        if let Some(&s) = self.sizes.iter().find(|&&s| s == 0 || s > (1 << 30)) {
            return Err(format!("message size {s} is outside 1 byte .. 1 GiB"));
        }
        if self.tx_depth == 0 || self.tx_depth > 4096 {
            return Err(format!(
                "--tx-depth must be 1..=4096, not {}",
                self.tx_depth
            ));
        }
        if self.cq_mod > self.tx_depth {
            return Err(format!(
                "--cq-mod {} is larger than --tx-depth {}: the window would never refill",
                self.cq_mod, self.tx_depth
            ));
        }
        if self.qps == 0 || self.qps > 64 {
            return Err(format!("--qps must be 1..=64, not {}", self.qps));
        }
        match (self.iters, self.duration) {
            (Some(0), _) => return Err("--iters must be at least 1".into()),
            (_, Some(d)) if !(d > 0.0 && d <= 3600.0) => {
                return Err(format!("--duration must be in (0, 3600] seconds, not {d}"))
            }
            (None, None) => return Err("give --iters or --duration".into()),
            _ => {}
        }
        if self.bidir && (self.lat || self.op == BenchOp::Send) {
            return Err("--bidir is for write and read bandwidth runs".into());
        }
        if self.lat && self.qps > 1 {
            return Err("latency runs use one QP".into());
        }
        Ok(())
    }

    fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1) as usize
    }

    /// Work requests per completion for messages of `size` bytes: `--cq-mod`, or by default
    /// one completion per 256 KiB moved, at most a quarter of `tx_depth` work requests apart
    /// (so the window refills while the rest is in flight). Large messages are each signaled:
    /// their completion costs nothing next to their transfer, and a duration run counts only
    /// completed messages, so coarser signals would under-count the last ones.
    pub fn signal_every(&self, size: u64) -> usize {
        match self.cq_mod {
            0 => {
                ((256 << 10) / size.max(1)).clamp(1, (u64::from(self.tx_depth) / 4).max(1)) as usize
            }
            n => n as usize,
        }
    }
}

/// perftest's `--all`: 2 B to 8 MiB in powers of two.
pub fn all_sizes() -> Vec<u64> {
    (1..=23).map(|i| 1u64 << i).collect()
}

/// The result for one size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SizeResult {
    /// Operation.
    pub op: BenchOp,
    /// Bytes per message.
    pub bytes: u64,
    /// Messages completed (all QPs; both directions with --bidir).
    pub iterations: u64,
    /// Best throughput over a window of `tx_depth` completions, MiB/s.
    pub bw_peak_mib_s: f64,
    /// Average throughput, MiB/s.
    pub bw_avg_mib_s: f64,
    /// Messages per second, millions.
    pub msg_rate_mpps: f64,
    /// Seconds measured.
    pub seconds: f64,
    /// direct / bounce / mixed: the server memory's path.
    pub path: String,
    /// Registration strategy of the server memory (pinned, odp, dma-buf) or the bounce copy
    /// engine.
    pub strategy: String,
    /// QPs.
    pub qps: u32,
    /// Work requests in flight per QP.
    pub tx_depth: u32,
    /// How completions were waited for: `events` (sleep on the completion channel) or
    /// `polling` (busy-poll, --poll). The bounce path's pipeline always uses events.
    #[serde(default)]
    pub cq: String,
    /// Whether --validate ran and the data matched.
    pub validated: Option<bool>,
    /// Latency: minimum, µs (one way for write and send ping-pong, as perftest; full for read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_min_us: Option<f64>,
    /// Latency: median.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_median_us: Option<f64>,
    /// Latency: 99th percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_p99_us: Option<f64>,
    /// Latency: 99.9th percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_p999_us: Option<f64>,
    /// Latency: maximum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_max_us: Option<f64>,
    /// Latency: average.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_avg_us: Option<f64>,
}

/// Errors of a benchmark run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Verbs.
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    /// The control connection.
    #[error("control connection: {0}")]
    Control(String),
    /// The server cannot be reached.
    #[error("{0}")]
    Unreachable(String),
    /// Bad parameters or memory.
    #[error("{0}")]
    Config(String),
    /// The peer reported an error.
    #[error("the server says: {0}")]
    Peer(String),
    /// The bridge (bounce path).
    #[error(transparent)]
    Bridge(#[from] bridge::Error),
}

type Result<T> = std::result::Result<T, BenchError>;

/// Memory keys of one side.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Keys {
    addr: u64,
    rkey: u32,
    len: u64,
}

impl Keys {
    fn slice(&self, len: u64) -> RemoteSlice {
        RemoteSlice {
            addr: self.addr,
            rkey: self.rkey,
            len: len.min(self.len),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
enum Msg {
    Hello {
        /// The shared secret (the same token as `serve`'s).
        token: bridge::Token,
        params: BenchParams,
        endpoints: Vec<WireEndpoint>,
        keys: Keys,
    },
    Ready {
        endpoints: Vec<WireEndpoint>,
        keys: Keys,
        path: String,
        strategy: String,
        bridge: Option<(u16, String)>,
    },
    Run {
        size: u64,
    },
    Go,
    Done {
        size: u64,
    },
    Stats {
        iterations: u64,
        validated: Option<bool>,
    },
    Bye,
    Error {
        message: String,
    },
}

/// Longest control line (a hello with 64 QPs' endpoints is a few KiB).
const MAX_LINE: usize = 64 << 10;

/// How long a client may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

struct Control {
    rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: tokio::net::tcp::OwnedWriteHalf,
}

impl Control {
    fn new(s: TcpStream) -> Control {
        let _ = s.set_nodelay(true);
        let (r, w) = s.into_split();
        Control {
            rd: BufReader::new(r),
            wr: w,
        }
    }
    async fn send(&mut self, m: &Msg) -> Result<()> {
        let mut line = serde_json::to_vec(m).map_err(|e| BenchError::Control(e.to_string()))?;
        line.push(b'\n');
        self.wr
            .write_all(&line)
            .await
            .map_err(|e| BenchError::Control(format!("send: {e}")))
    }
    async fn recv(&mut self) -> Result<Msg> {
        let mut line = String::new();
        // a line is at most MAX_LINE bytes: a peer cannot make us buffer more
        let n = (&mut self.rd)
            .take(MAX_LINE as u64)
            .read_line(&mut line)
            .await
            .map_err(|e| BenchError::Control(format!("receive: {e}")))?;
        if n == 0 {
            return Err(BenchError::Control("the peer closed the connection".into()));
        }
        if !line.ends_with('\n') && n >= MAX_LINE {
            return Err(BenchError::Control(format!(
                "a control line longer than {MAX_LINE} bytes: not a p2p-rdma bench peer"
            )));
        }
        match serde_json::from_str(&line) {
            Ok(Msg::Error { message }) => Err(BenchError::Peer(message)),
            Ok(m) => Ok(m),
            Err(e) => Err(BenchError::Control(format!(
                "bad message ({e}): {}",
                line.trim()
            ))),
        }
    }
}

/// The reproducible byte pattern both sides check against.
pub fn pattern(len: usize) -> Vec<u8> {
    pattern_from(len, 0x9e37_79b9)
}

/// `len` pseudo-random bytes (xorshift), reproducible from `seed`.
pub fn pattern_from(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// One side's device setup.
#[derive(Debug, Clone, Default)]
pub struct Side {
    /// RDMA device.
    pub device: Option<String>,
    /// GID index.
    pub gid_index: Option<u32>,
    /// Port.
    pub ib_port: Option<u8>,
}

fn qp_options(side: &Side, p: &BenchParams, recv: u32) -> QpOptions {
    QpOptions {
        max_send_wr: p.tx_depth.max(2),
        max_recv_wr: recv.max(2),
        port: side.ib_port,
        gid_index: side.gid_index,
        cq_mode: if p.poll {
            CqMode::Polling
        } else {
            CqMode::Events
        },
        ..QpOptions::default()
    }
}

/// The server's target memory: host RAM, or a provider's memory proved direct.
enum Target {
    Host(RegisteredBuffer),
    Device(DeviceMr),
}

impl Target {
    fn keys(&self, len: u64) -> Result<Keys> {
        let r = match self {
            Target::Host(b) => b.mr().remote(0..len)?,
            Target::Device(d) => d.mr().remote(0..len)?,
        };
        Ok(Keys {
            addr: r.addr,
            rkey: r.rkey,
            len: r.len,
        })
    }
    fn fill(&mut self, data: &[u8]) -> Result<()> {
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
    fn read(&self, len: usize) -> Result<Vec<u8>> {
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

/// Receive buffers per QP for SEND runs: enough for the depth, within 256 MiB.
fn recv_slots(p: &BenchParams) -> u32 {
    let by_mem = ((256usize << 20) / p.max_size()).max(2) as u32;
    p.tx_depth.min(by_mem).clamp(2, 512)
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
}

/// What the server's memory must allow for the benchmark `p` (and nothing more).
fn target_access(p: &BenchParams) -> Access {
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

async fn serve_session(c: &mut Control, side: &Side, mem: &ServerMem) -> Result<()> {
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

    // The target memory and its path.
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
                .open(std::path::Path::new("/sys"))
                .map_err(|e| BenchError::Config(format!("--mem {spec}: {e}")))?;
            if provider.len() < max as u64 {
                return Err(BenchError::Config(format!(
                    "--mem {spec} holds {} bytes, less than the largest message ({max})",
                    provider.len()
                )));
            }
            // the spec's own ,reg= ,p2p= apply as in serve; the benchmark measures one path
            let choice = parsed.options.choice(max as u64, mem.reg, mem.p2p);
            if choice.window < max as u64 {
                return Err(BenchError::Config(format!(
                    "--mem {spec}: ,window= ({} bytes) is smaller than the largest message ({max}); \
                     a benchmark measures one path: leave ,window= out or lower --size",
                    choice.window
                )));
            }
            let planned = bridge::path::decide_path(&pd, &provider, choice)
                .await
                .map_err(|r| BenchError::Config(r.to_string()))?;
            match (planned.decision.path, planned.mr) {
                (PathKind::Direct, Some(mr)) => {
                    let access = target_access(&p);
                    if provider.holds_data() && access.contains(Access::REMOTE_WRITE) {
                        return Err(BenchError::Config(format!(
                            "--mem {spec} holds data ({}): a {} benchmark would overwrite it; \
                             benchmark reads of it, or writes to host:, cmb: or dmabuf: memory",
                            provider.describe(),
                            if p.op == BenchOp::Send {
                                "send"
                            } else {
                                "write"
                            }
                        )));
                    }
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

    // memory that holds data (a file) is never written by the benchmark: no pattern to check
    let keep = provider.as_ref().is_some_and(|m| m.holds_data());
    if keep && p.validate {
        return Err(BenchError::Config(format!(
            "--validate needs the server to write its pattern into the memory, and {} holds data; \
             run without --validate",
            mem.spec.as_deref().unwrap_or("the memory")
        )));
    }
    if path == "bounce" {
        let provider =
            provider.ok_or_else(|| BenchError::Config("bounce without memory".into()))?;
        return serve_bounce(c, side, &p, provider, strategy, &mem.token).await;
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
    let my_keys = target.keys(max as u64)?;
    c.send(&Msg::Ready {
        endpoints: qps.iter().map(|q| q.endpoint().into()).collect(),
        keys: my_keys,
        path: path.clone(),
        strategy: strategy.clone(),
        bridge: None,
    })
    .await?;

    // Receivers (SEND runs, and ping-pong partners of latency runs).
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let bad = Arc::new(AtomicU64::new(0));
    let mut receivers = tokio::task::JoinSet::new();
    if p.op == BenchOp::Send || (p.lat && p.op == BenchOp::Write) {
        let pat = Arc::new(pattern(max));
        // local only: no rkey of it is handed out
        let source =
            Arc::new(pd.register(HostBuffer::new(max)?, Access::LOCAL_WRITE, RegMode::Pinned)?);
        for qp in &qps {
            let mut slots = VecDeque::new();
            let n = if p.lat { 2 } else { recv };
            for _ in 0..n {
                let b = pd.register(HostBuffer::new(max)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
                slots.push_back(qp.post_recv(vec![Local::owned(b)])?);
            }
            let (qp, stop, received, bad, pat, source) = (
                qp.clone(),
                Arc::clone(&stop),
                Arc::clone(&received),
                Arc::clone(&bad),
                Arc::clone(&pat),
                Arc::clone(&source),
            );
            let (lat, validate, op) = (p.lat, p.validate, p.op);
            receivers.spawn(async move {
                while let Some(front) = slots.pop_front() {
                    let got = tokio::select! {
                        r = front.wait() => r,
                        _ = async { while !stop.load(Ordering::Relaxed) { tokio::time::sleep(Duration::from_millis(20)).await } } => break,
                    };
                    let Ok(mut got) = got else { break };
                    let Some((local, info)) = got.pop() else { break };
                    let n = info.byte_len as usize;
                    if lat {
                        // pong: the same size back
                        let op = match op {
                            BenchOp::Write => SendOp::WriteImm(client_keys.slice(n as u64), 0),
                            _ => SendOp::Send,
                        };
                        let wr = SendWr { op, local: Local::shared(Arc::clone(&source), 0..n.min(source.len()))? };
                        qp.post_send(vec![wr])?.wait().await?;
                    } else if validate
                        && op == BenchOp::Send
                        && local.bytes().map(|b| &b[..n]) != Some(&pat[..n])
                    {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    received.fetch_add(1, Ordering::Relaxed);
                    let Some(buf) = local.into_owned() else { break };
                    slots.push_back(qp.post_recv(vec![Local::owned(buf)])?);
                }
                Ok::<(), verbs::Error>(())
            });
        }
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
async fn serve_bounce(
    c: &mut Control,
    side: &Side,
    p: &BenchParams,
    provider: Arc<dyn Provider>,
    strategy: String,
    token: &bridge::Token,
) -> Result<()> {
    if provider.holds_data() && p.op != BenchOp::Read {
        return Err(BenchError::Config(format!(
            "the server memory holds data ({}): a write benchmark would overwrite it; \
             benchmark reads of it, or writes to host:, cmb: or dmabuf: memory",
            provider.describe()
        )));
    }
    if p.op == BenchOp::Send || p.lat || p.bidir {
        return Err(BenchError::Config(
            "the server memory goes through bounce buffers: only write and read bandwidth runs (put/fetch through the bridge) are measured on that path".into(),
        ));
    }
    let token = token.clone();
    let local =
        c.wr.local_addr()
            .map_err(|e| BenchError::Control(e.to_string()))?;
    let mut cfg =
        bridge::ServerConfig::new(SocketAddr::new(local.ip(), 0), token.clone(), Vec::new());
    cfg.device = side.device.clone();
    cfg.p2p = P2pPolicy::Disabled;
    cfg.memory_regions.push(bridge::MemoryRegionSpec {
        name: "bench".into(),
        provider: Arc::clone(&provider),
        // least privilege: a read benchmark cannot change the memory
        read_only: p.op == BenchOp::Read,
        options: Default::default(),
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
    })
    .await?;
    let pat = pattern(p.max_size());
    loop {
        match c.recv().await? {
            Msg::Run { size } => {
                if p.op == BenchOp::Read && !provider.holds_data() {
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
fn bounce_span(size: u64, depth: u32, region: u64) -> u64 {
    let msgs = (u64::from(depth.max(1))).min(region / size.max(1)).max(1);
    msgs * size
}

#[derive(Clone)]
enum Lane {
    Shared(Arc<RegisteredBuffer>),
    Sink(Arc<SinkBuffer>),
}

struct LaneResult {
    iterations: u64,
    seconds: f64,
    peak_mib_s: f64,
}

/// One bandwidth loop per QP, all at once; iterations and peak summed.
async fn run_lanes(
    qps: &[QueuePair],
    op: BenchOp,
    local: &Lane,
    remote: Keys,
    size: usize,
    p: &BenchParams,
) -> Result<LaneResult> {
    let mut set = tokio::task::JoinSet::new();
    for qp in qps {
        let (qp, local) = (qp.clone(), local.clone());
        let (depth, iters, duration) = (p.tx_depth as usize, p.iters, p.duration);
        let every = p.signal_every(size as u64);
        set.spawn(async move {
            bw_loop(
                &qp,
                op,
                &local,
                remote.slice(size as u64),
                size,
                (depth, every),
                iters,
                duration,
            )
            .await
        });
    }
    let mut total = LaneResult {
        iterations: 0,
        seconds: 0.0,
        peak_mib_s: 0.0,
    };
    while let Some(r) = set.join_next().await {
        let r = r.map_err(|e| BenchError::Control(format!("a QP's loop failed: {e}")))??;
        total.iterations += r.iterations;
        total.seconds = total.seconds.max(r.seconds);
        total.peak_mib_s += r.peak_mib_s;
    }
    Ok(total)
}

#[allow(clippy::too_many_arguments)]
async fn bw_loop(
    qp: &QueuePair,
    op: BenchOp,
    local: &Lane,
    remote: RemoteSlice,
    size: usize,
    (depth, every): (usize, usize),
    iters: Option<u64>,
    duration: Option<f64>,
) -> Result<LaneResult> {
    let mk = || -> Result<SendWr> {
        let local = match local {
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
        if deadline.is_some_and(|d| Instant::now() >= d) {
            // Past the deadline: drain what is in flight, uncounted (as perftest's -D).
            continue;
        }
        done += 1;
        if done - mark.1 >= depth as u64 {
            let dt = mark.0.elapsed().as_secs_f64();
            if dt > 0.0 {
                peak = peak.max(((done - mark.1) * size as u64) as f64 / dt / (1 << 20) as f64);
            }
            mark = (Instant::now(), done);
        }
    }
    let seconds = match duration {
        Some(d) => d,
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
    let mine_keys = {
        let r = mine.mr().remote(0..max as u64)?;
        Keys {
            addr: r.addr,
            rkey: r.rkey,
            len: r.len,
        }
    };
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
    } = c.recv().await?
    else {
        return Err(BenchError::Control("expected ready".into()));
    };
    let mut out = Vec::new();
    if let Some((port, token)) = bridge {
        let host = o
            .server
            .rsplit_once(':')
            .map(|(h, _)| h)
            .unwrap_or(&o.server)
            .to_string();
        let mut cfg = bridge::ClientConfig::new(format!("{host}:{port}"), token);
        cfg.device = o.side.device.clone();
        cfg.depth = p.tx_depth as usize;
        let mut bc = bridge::Client::connect(cfg).await?;
        let r = bc.open("bench", p.op == BenchOp::Write).await?;
        for &size in &p.sizes {
            // Like the direct path's `tx_depth` work requests in flight, keep `tx_depth` messages
            // in flight: each put/fetch moves a span of up to `tx_depth` messages (as much of the
            // region as fits), one bounce request per message, pipelined by the bridge client.
            let span = bounce_span(size, p.tx_depth, r.info.size);
            let per_call = span / size;
            bc.set_chunk(size as usize)?;
            let data: Vec<u8> = if p.op == BenchOp::Write {
                pat[..size as usize].repeat(per_call as usize)
            } else {
                Vec::new()
            };
            // One untimed span first, as the direct path sets its QPs and MRs up before its
            // clock starts: it creates the bridge client's QP and staging buffers and fills the
            // server's staging ring, so the timed loop measures transfers only.
            match p.op {
                BenchOp::Write => {
                    let mut cur = std::io::Cursor::new(&data[..]);
                    bc.put(&r, 0, &mut cur, Some(span), false, &mut |_| {})
                        .await?;
                }
                _ => {
                    bc.fetch(&r, 0, span, &mut std::io::sink(), false, &mut |_| {})
                        .await?;
                }
            }
            c.send(&Msg::Run { size }).await?;
            let Msg::Go = c.recv().await? else {
                return Err(BenchError::Control("expected go".into()));
            };
            let start = Instant::now();
            let deadline = p.duration.map(|d| start + Duration::from_secs_f64(d));
            let limit = p.iters.unwrap_or(u64::MAX);
            let (mut n, mut peak) = (0u64, 0.0f64);
            let mut fetched_ok = true;
            let mut v = Vec::with_capacity(span as usize);
            while n < limit && deadline.is_none_or(|d| Instant::now() < d) {
                // the last call of an --iters run moves only the messages left
                let msgs = per_call.min(limit - n);
                let t = Instant::now();
                let rep = match p.op {
                    BenchOp::Write => {
                        let mut cur = std::io::Cursor::new(&data[..(msgs * size) as usize]);
                        bc.put(&r, 0, &mut cur, Some(msgs * size), false, &mut |_| {})
                            .await?
                    }
                    _ => {
                        v.clear();
                        let rep = bc
                            .fetch(&r, 0, msgs * size, &mut v, false, &mut |_| {})
                            .await?;
                        if p.validate
                            && !v.chunks(size as usize).all(|m| m == &pat[..size as usize])
                        {
                            fetched_ok = false;
                        }
                        rep
                    }
                };
                let dt = t.elapsed().as_secs_f64();
                if dt > 0.0 {
                    peak = peak.max(rep.bytes as f64 / dt / (1 << 20) as f64);
                }
                n += msgs;
            }
            let seconds = start.elapsed().as_secs_f64();
            c.send(&Msg::Done { size }).await?;
            let Msg::Stats { validated, .. } = c.recv().await? else {
                return Err(BenchError::Control("expected stats".into()));
            };
            let validated = if p.validate {
                Some(validated.unwrap_or(true) && fetched_ok)
            } else {
                None
            };
            let res = result(p, size, n, seconds, peak, &path, &strategy, validated);
            each(&res);
            out.push(res);
        }
        bc.bye().await?;
        c.send(&Msg::Bye).await?;
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
    for &size in &p.sizes {
        let n = size as usize;
        c.send(&Msg::Run { size }).await?;
        let Msg::Go = c.recv().await? else {
            return Err(BenchError::Control("expected go".into()));
        };
        let res = if p.lat {
            let times = lat_loop(&qps[0], p.op, &src, keys, n, p).await?;
            c.send(&Msg::Done { size }).await?;
            let Msg::Stats { .. } = c.recv().await? else {
                return Err(BenchError::Control("expected stats".into()));
            };
            lat_result(p, size, &times, &path, &strategy)
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
            result(p, size, iterations, r.seconds, peak, &path, &strategy, ok)
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

async fn lat_loop(
    qp: &QueuePair,
    op: BenchOp,
    src: &Arc<RegisteredBuffer>,
    keys: Keys,
    n: usize,
    p: &BenchParams,
) -> Result<Vec<f64>> {
    let rounds = p.iters.unwrap_or(u64::MAX);
    let deadline = p
        .duration
        .map(|d| Instant::now() + Duration::from_secs_f64(d));
    let mut times = Vec::new();
    let pd = qp.pd().clone();
    let mut rbuf = Some(pd.register(
        HostBuffer::new(n.max(1))?,
        Access::LOCAL_WRITE,
        RegMode::Pinned,
    )?);
    let mut dst = Some(pd.register(
        HostBuffer::new(n.max(1))?,
        Access::LOCAL_WRITE,
        RegMode::Pinned,
    )?);
    while (times.len() as u64) < rounds && deadline.is_none_or(|d| Instant::now() < d) {
        let t = Instant::now();
        match op {
            BenchOp::Read => {
                let d = dst.take().expect("buffer back");
                let l = qp
                    .read(Local::owned_range(d, 0..n)?, keys.slice(n as u64))
                    .await?;
                dst = l.into_owned();
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            BenchOp::Write | BenchOp::Send => {
                let r = rbuf.take().expect("buffer back");
                let pong = qp.post_recv(vec![Local::owned(r)])?;
                let sop = if op == BenchOp::Write {
                    SendOp::WriteImm(keys.slice(n as u64), 0)
                } else {
                    SendOp::Send
                };
                let ping = qp.post_send(vec![SendWr {
                    op: sop,
                    local: Local::shared(Arc::clone(src), 0..n)?,
                }])?;
                ping.wait().await?;
                let mut back = pong.wait().await?;
                let (l, _) = back
                    .pop()
                    .ok_or_else(|| BenchError::Control("no pong".into()))?;
                rbuf = l.into_owned();
                times.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
    }
    Ok(times)
}

#[allow(clippy::too_many_arguments)]
fn result(
    p: &BenchParams,
    size: u64,
    iterations: u64,
    seconds: f64,
    peak: f64,
    path: &str,
    strategy: &str,
    validated: Option<bool>,
) -> SizeResult {
    let avg = if seconds > 0.0 {
        (iterations * size) as f64 / seconds / (1 << 20) as f64
    } else {
        0.0
    };
    SizeResult {
        op: p.op,
        bytes: size,
        iterations,
        bw_peak_mib_s: peak.max(avg),
        bw_avg_mib_s: avg,
        msg_rate_mpps: if seconds > 0.0 {
            iterations as f64 / seconds / 1e6
        } else {
            0.0
        },
        seconds,
        path: path.into(),
        strategy: strategy.into(),
        qps: p.qps,
        tx_depth: p.tx_depth,
        cq: if p.poll && path != "bounce" {
            "polling"
        } else {
            "events"
        }
        .into(),
        validated,
        t_min_us: None,
        t_median_us: None,
        t_p99_us: None,
        t_p999_us: None,
        t_max_us: None,
        t_avg_us: None,
    }
}

fn lat_result(p: &BenchParams, size: u64, times: &[f64], path: &str, strategy: &str) -> SizeResult {
    let mut t = times.to_vec();
    t.sort_by(|a, b| a.total_cmp(b));
    let q = |f: f64| -> Option<f64> {
        if t.is_empty() {
            None
        } else {
            Some(t[((t.len() as f64 - 1.0) * f).round() as usize])
        }
    };
    let total: f64 = t.iter().sum();
    let mut r = result(
        p,
        size,
        t.len() as u64,
        total / 1e6,
        0.0,
        path,
        strategy,
        None,
    );
    r.bw_peak_mib_s = 0.0;
    r.bw_avg_mib_s = 0.0;
    r.t_min_us = q(0.0);
    r.t_median_us = q(0.5);
    r.t_p99_us = q(0.99);
    r.t_p999_us = q(0.999);
    r.t_max_us = q(1.0);
    r.t_avg_us = (!t.is_empty()).then(|| total / t.len() as f64);
    r
}

/// perftest's table header.
pub fn header(lat: bool, gbits: bool) -> String {
    let line = "-".repeat(100);
    if lat {
        format!("{line}\n #bytes  #iterations  t_min[usec]  t_max[usec]  t_typical[usec]  t_avg[usec]  99% percentile[usec]  99.9% percentile[usec]  path    strategy\n")
    } else {
        let u = if gbits { "Gb/sec" } else { "MiB/sec" };
        format!("{line}\n #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]   path     strategy\n")
    }
}

/// One row of the table.
pub fn row(r: &SizeResult, gbits: bool) -> String {
    if r.t_median_us.is_some() {
        let f = |v: Option<f64>| v.unwrap_or(0.0);
        format!(
            " {:<8} {:<12} {:<12.2} {:<12.2} {:<16.2} {:<12.2} {:<21.2} {:<23.2} {:<7} {}{}\n",
            r.bytes,
            r.iterations,
            f(r.t_min_us),
            f(r.t_max_us),
            f(r.t_median_us),
            f(r.t_avg_us),
            f(r.t_p99_us),
            f(r.t_p999_us),
            r.path,
            r.strategy,
            match r.validated {
                Some(true) => "  (validated)",
                Some(false) => "  (DATA MISMATCH)",
                None => "",
            }
        )
    } else {
        let conv = |mib: f64| {
            if gbits {
                mib * (1 << 20) as f64 * 8.0 / 1e9
            } else {
                mib
            }
        };
        format!(
            " {:<10} {:<14} {:<16.2} {:<19.2} {:<15.6} {:<8} {}{}\n",
            r.bytes,
            r.iterations,
            conv(r.bw_peak_mib_s),
            conv(r.bw_avg_mib_s),
            r.msg_rate_mpps,
            r.path,
            r.strategy,
            match r.validated {
                Some(true) => "  (validated)",
                Some(false) => "  (DATA MISMATCH)",
                None => "",
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> BenchParams {
        BenchParams {
            op: BenchOp::Write,
            sizes: vec![65536],
            iters: Some(100),
            duration: None,
            tx_depth: 128,
            qps: 1,
            bidir: false,
            lat: false,
            validate: false,
            cq_mod: 0,
            poll: false,
        }
    }

    #[test]
    fn parameters_are_checked() {
        assert!(params().check().is_ok());
        let bad = |f: &dyn Fn(&mut BenchParams), why: &str| {
            let mut p = params();
            f(&mut p);
            let e = p.check().unwrap_err();
            assert!(e.contains(why), "{e}");
        };
        bad(&|p| p.sizes = vec![0], "outside");
        bad(&|p| p.sizes.clear(), "no message size");
        bad(&|p| p.tx_depth = 0, "--tx-depth");
        bad(&|p| p.qps = 0, "--qps");
        bad(&|p| p.cq_mod = 129, "never refill");
        assert_eq!(params().signal_every(2), 32);
        assert_eq!(params().signal_every(65536), 4);
        assert_eq!(params().signal_every(1 << 20), 1);
        let mut p = params();
        p.cq_mod = 3;
        assert_eq!(p.signal_every(2), 3);
        bad(&|p| p.iters = Some(0), "--iters");
        bad(
            &|p| {
                p.iters = None;
                p.duration = None
            },
            "--iters or --duration",
        );
        bad(
            &|p| {
                p.iters = None;
                p.duration = Some(-1.0)
            },
            "--duration",
        );
        bad(
            &|p| {
                p.op = BenchOp::Send;
                p.bidir = true
            },
            "--bidir",
        );
        bad(
            &|p| {
                p.lat = true;
                p.qps = 2
            },
            "one QP",
        );
    }

    #[test]
    fn sizes_and_rows() {
        let s = all_sizes();
        assert_eq!((s[0], *s.last().unwrap(), s.len()), (2, 8 << 20, 23));
        let r = result(
            &params(),
            65536,
            1000,
            1.0,
            80.0,
            "direct",
            "pinned",
            Some(true),
        );
        assert!((r.bw_avg_mib_s - 62.5).abs() < 1e-9);
        assert!((r.msg_rate_mpps - 0.001).abs() < 1e-12);
        assert_eq!(r.bw_peak_mib_s, 80.0);
        assert!(row(&r, false).contains("validated"));
        let g = row(&r, true);
        assert!(g.contains("0.52"), "{g}"); // 62.5 MiB/s = 0.524 Gb/s
        let l = lat_result(
            &BenchParams {
                lat: true,
                ..params()
            },
            2,
            &[5.0, 1.0, 3.0, 2.0, 4.0],
            "direct",
            "pinned",
        );
        assert_eq!(
            (l.t_min_us, l.t_median_us, l.t_max_us),
            (Some(1.0), Some(3.0), Some(5.0))
        );
        assert_eq!(l.t_avg_us, Some(3.0));
    }

    #[test]
    fn the_pattern_is_reproducible() {
        assert_eq!(pattern(1000), pattern(1000));
        assert_eq!(&pattern(1000)[..10], &pattern(10)[..]);
        assert!(pattern(4096).iter().any(|&b| b != pattern(4096)[0]));
    }
}
