//! A loopback transfer between two RC QPs of one device: the smoke test of a node's RDMA stack,
//! and the verbs layer's own ib_write_bw/ib_read_bw-style throughput loop.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bridge::size::mib_per_sec;
use serde::Serialize;
use verbs::{
    Access, Context, CqMode, HostBuffer, Local, Pending, ProtectionDomain, QpOptions, QueuePair,
    RegMode, RegisteredBuffer, SendOp, SendWr,
};

/// Which one-sided operation to loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA WRITE
    Write,
    /// RDMA READ
    Read,
}

/// Parameters of a loopback run.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    /// Device name (None: first active device).
    pub device: Option<String>,
    /// Bytes per work request.
    pub size: usize,
    /// Work requests kept in flight.
    pub depth: usize,
    /// Stop after this many work requests…
    pub iters: Option<u64>,
    /// …or after this long.
    pub duration: Option<Duration>,
    /// Operation.
    pub op: Op,
    /// Event-driven or polling completions.
    pub cq_mode: CqMode,
    /// Check data end to end before the timed loop.
    pub verify: bool,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoopbackReport {
    /// Device used.
    pub device: String,
    /// Operation.
    pub op: Op,
    /// Bytes per work request.
    pub size: usize,
    /// Work requests in flight.
    pub depth: usize,
    /// Work requests completed in the timed loop.
    pub iterations: u64,
    /// Bytes moved in the timed loop.
    pub bytes: u64,
    /// Seconds of the timed loop.
    pub seconds: f64,
    /// Throughput, MiB/s (2^20 bytes per second, as perftest's MB/sec).
    pub mib_per_sec: f64,
    /// Work requests per second.
    pub ops_per_sec: f64,
    /// Whether the data check ran and passed.
    pub verified: bool,
    /// Path MTU of the connection.
    pub path_mtu: u32,
}

/// Why a loopback run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoopbackError {
    /// Verbs failure.
    #[error("{0}")]
    Verbs(#[from] verbs::Error),
    /// Bad parameters.
    #[error("invalid loopback parameters: {0}")]
    Config(String),
    /// Data mismatch.
    #[error("data check failed: {0}")]
    Mismatch(String),
}

fn pattern(b: &mut [u8]) {
    let mut x: u32 = 0x1234_5678;
    for v in b.iter_mut() {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        *v = (x >> 24) as u8;
    }
}

/// Run it.
pub async fn run(cfg: &LoopbackConfig) -> Result<LoopbackReport, LoopbackError> {
    if cfg.size == 0 || cfg.size > u32::MAX as usize {
        return Err(LoopbackError::Config(format!(
            "size must be 1 byte to 4 GiB - 1, not {}",
            cfg.size
        )));
    }
    if cfg.depth == 0 || cfg.depth > 4096 {
        return Err(LoopbackError::Config(format!(
            "depth must be 1..=4096, not {}",
            cfg.depth
        )));
    }
    if cfg.iters.is_none() && cfg.duration.is_none() {
        return Err(LoopbackError::Config(
            "give a number of iterations or a duration".into(),
        ));
    }
    let ctx = Context::open(cfg.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let opts = QpOptions {
        max_send_wr: cfg.depth as u32,
        max_recv_wr: 1,
        cq_mode: cfg.cq_mode,
        ..QpOptions::default()
    };
    let (a, b) = QueuePair::loopback_pair(&pd, opts)?;
    let path_mtu = verbs::negotiate_mtu(a.endpoint().mtu, b.endpoint().mtu);
    let reg = |len, access| -> Result<RegisteredBuffer, verbs::Error> {
        pd.register(HostBuffer::new(len)?, access, RegMode::Pinned)
    };
    // the local side of the work requests needs no remote access; the remote side is read and
    // written by the NIC at any time, so the CPU only copies it
    let mut local = reg(cfg.size, Access::LOCAL_WRITE)?;
    let mut remote = reg(cfg.size, Access::ALL)?;
    let target = remote.mr().remote(0..cfg.size as u64)?;

    let mut verified = false;
    if cfg.verify {
        pattern(local.as_mut_slice());
        let l = a.write(Local::owned(local), target).await?;
        local = l.into_owned().expect("owned");
        if local.as_slice() != &remote.to_vec()[..] {
            return Err(LoopbackError::Mismatch(
                "RDMA WRITE: remote bytes differ from the source".into(),
            ));
        }
        let mut expect = remote.to_vec();
        expect.reverse();
        remote.write_at(0, &expect)?;
        let l = a
            .read(Local::owned(local), remote.mr().remote(0..cfg.size as u64)?)
            .await?;
        local = l.into_owned().expect("owned");
        if local.as_slice() != &expect[..] {
            return Err(LoopbackError::Mismatch(
                "RDMA READ: local bytes differ from the remote region".into(),
            ));
        }
        verified = true;
    }

    // The timed loop: `depth` work requests in flight, as ib_write_bw/ib_read_bw do. WRITE
    // sources are shared (the device only reads them); READ destinations must be owned, so each
    // slot of the window gets its own buffer.
    let start = Instant::now();
    let deadline = cfg.duration.map(|d| start + d);
    let limit = cfg.iters.unwrap_or(u64::MAX);
    let mut window: VecDeque<Pending> = VecDeque::with_capacity(cfg.depth);
    let mut posted = 0u64;
    let mut completed = 0u64;
    let shared = Arc::new(local);
    let mut spare: Vec<RegisteredBuffer> = Vec::new();
    if cfg.op == Op::Read {
        for _ in 0..cfg.depth {
            spare.push(reg(cfg.size, Access::LOCAL_WRITE)?);
        }
    }
    loop {
        let time_up = deadline.is_some_and(|d| Instant::now() >= d);
        while window.len() < cfg.depth && posted < limit && !time_up {
            let wr = match cfg.op {
                Op::Write => SendWr {
                    op: SendOp::Write(target),
                    local: Local::shared(Arc::clone(&shared), 0..cfg.size)?,
                },
                Op::Read => SendWr {
                    op: SendOp::Read(target),
                    local: Local::owned(spare.pop().expect("one buffer per slot")),
                },
            };
            window.push_back(a.post_send(vec![wr])?);
            posted += 1;
        }
        let Some(p) = window.pop_front() else { break };
        for l in p.await? {
            if let Some(buf) = l.into_owned() {
                spare.push(buf);
            }
        }
        completed += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    drop(remote);
    let bytes = completed * cfg.size as u64;
    Ok(LoopbackReport {
        device: ctx.name().to_string(),
        op: cfg.op,
        size: cfg.size,
        depth: cfg.depth,
        iterations: completed,
        bytes,
        seconds,
        mib_per_sec: mib_per_sec(bytes, seconds),
        ops_per_sec: if seconds > 0.0 {
            completed as f64 / seconds
        } else {
            0.0
        },
        verified,
        path_mtu,
    })
}
