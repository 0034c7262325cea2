//! The server: a catalog of regions served over RC QPs, one PD + QP per connection.
//!
//! Each region's memory comes from a [`Provider`] (host RAM, a file, NVMe CMB through P2PDMA,
//! a dma-buf). At start-up the server decides, per region, the path its bytes take
//! ([`peermem::plan::decide`]): **direct** — one-sided RDMA on an MR of the memory, with the
//! first registration strategy that a canary proves — or **bounce** — the provider's copy
//! engine plus a ring of registered host staging buffers per connection, the server
//! RDMA-WRITEs (fetch) or RDMA-READs (put) the client's buffer. A region may be direct for its
//! first `window` bytes and bounce for the rest (mixed); clients see the split in `ls`.
//!
//! Each connection gets its own protection domain, so an rkey handed to one client is useless
//! on another client's QP; MRs are registered per connection through a registration cache
//! (a reopened region is a hit) and released when the connection ends, so a vanished client
//! leaves nothing behind. A region can be removed while clients use it
//! ([`ServerHandle::remove_region`]): its registrations are revoked, in-flight bounce copies
//! finish, and the memory is freed only when nothing refers to it any more.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use peermem::canary::{register_mode, Attempt, DeviceMr};
use peermem::hmm::{Segment, SegmentPath};
use peermem::plan::{decide, P2pPolicy, PathKind, RegChoice};
use peermem::regcache::{Lease, Limits, RegCache};
use peermem::{DmaBufMemory, HostMemory, Provider};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument as _;
use verbs::{
    Access, Context, HostBuffer, Local, ProtectionDomain, QpOptions, QueuePair, RegMode, RegionRef,
    RegisteredBuffer, RemoteSlice, SendOp, SendWr, SharedMemory, SinkBuffer,
};

use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::metrics::{Direction, Metrics, XferPath};
use crate::protocol::{AccessMode, DataPath, ErrorCode, Extent, Msg, RegionInfo, VERSION};
pub use crate::spec::{RegionOptions, RegionSource, RegionSpec};

/// A region over memory the embedding application provides: any [`Provider`] (a window of its
/// own RAM, a dma-buf fd it exported, device memory).
#[derive(Debug, Clone)]
pub struct MemoryRegionSpec {
    /// Name clients use.
    pub name: String,
    /// The memory.
    pub provider: Arc<dyn Provider>,
    /// Refuse puts (and register without remote write).
    pub read_only: bool,
    /// Overrides.
    pub options: RegionOptions,
}

impl MemoryRegionSpec {
    /// A window of host memory the application keeps writing through its own `Arc`.
    pub fn window(
        name: impl Into<String>,
        mem: Arc<SharedMemory>,
        offset: u64,
        len: u64,
        read_only: bool,
    ) -> Result<MemoryRegionSpec> {
        let name = name.into();
        let provider = HostMemory::window(mem, offset, len, !read_only)
            .map_err(|e| Error::Config(format!("region '{name}': {e}")))?;
        Ok(MemoryRegionSpec {
            name,
            provider: Arc::new(provider),
            read_only,
            options: RegionOptions::default(),
        })
    }
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// RDMA device (None: first active).
    pub device: Option<String>,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The shared secret.
    pub token: crate::Token,
    /// Regions to serve.
    pub regions: Vec<RegionSpec>,
    /// Regions over memory the embedding application provides.
    pub memory_regions: Vec<MemoryRegionSpec>,
    /// Most concurrent authenticated connections; more are refused with `busy`.
    pub max_connections: usize,
    /// Most connections that have not said hello yet (each for at most `hello_timeout`);
    /// more are closed at once. Kept apart from `max_connections` so that silent sockets
    /// cannot lock authenticated clients out.
    pub max_unauthenticated: usize,
    /// RDMA READ/WRITEs a client may keep in flight (the QP's responder resources).
    pub max_outstanding: u32,
    /// Regions one connection may hold open at once.
    pub max_open_per_connection: usize,
    /// How long a new connection may take to say hello.
    pub hello_timeout: Duration,
    /// How long shutdown waits for connections to finish.
    pub drain_timeout: Duration,
    /// P2P policy for regions that do not set their own.
    pub p2p: P2pPolicy,
    /// Registration strategies for regions that do not set their own.
    pub reg: RegChoice,
    /// Bytes per staging buffer of the bounce path (the largest bounce request).
    pub bounce_chunk: usize,
    /// Staging buffers per connection (bounce copies and RDMA in flight at once).
    pub bounce_depth: usize,
    /// Registration cache limits, per connection.
    pub cache: Limits,
    /// sysfs root (for CMB devices).
    pub sysfs: PathBuf,
    /// Where the server counts what it does (share it with a [`crate::http::MetricsServer`]).
    pub metrics: Arc<Metrics>,
}

impl ServerConfig {
    /// Defaults for everything but device, address, token and regions.
    pub fn new(
        listen: SocketAddr,
        token: impl Into<crate::Token>,
        regions: Vec<RegionSpec>,
    ) -> ServerConfig {
        ServerConfig {
            device: None,
            listen,
            token: token.into(),
            regions,
            memory_regions: Vec::new(),
            max_connections: 64,
            max_unauthenticated: 256,
            max_outstanding: 16,
            max_open_per_connection: 64,
            hello_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            p2p: P2pPolicy::Preferred,
            reg: RegChoice::Auto,
            bounce_chunk: 1 << 20,
            bounce_depth: 8,
            cache: Limits::default(),
            sysfs: PathBuf::from("/sys"),
            metrics: Arc::new(Metrics::new()),
        }
    }
}

struct Region {
    info: RegionInfo,
    /// None once removed.
    provider: Mutex<Option<Arc<dyn Provider>>>,
    /// To know when the memory is really gone after removal.
    weak: Weak<dyn Provider>,
    /// Bytes `[0, direct_len)` are direct (with `mode`); the rest bounce.
    direct_len: u64,
    mode: Option<RegMode>,
    attempts: Vec<Attempt>,
    removed: AtomicBool,
    /// Device-private regions: the strategy a canary proved for MRs of window mappings, so the
    /// NIC moves windowed units straight to and from the client (None: the CPU copies them).
    window_mode: Option<RegMode>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region").field("info", &self.info).finish()
    }
}

impl Region {
    fn provider(&self) -> std::result::Result<Arc<dyn Provider>, (ErrorCode, String)> {
        self.provider
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| removed(&self.info.name))
    }
}

fn removed(name: &str) -> (ErrorCode, String) {
    (
        ErrorCode::Removed,
        format!("region '{name}' was removed from this server"),
    )
}

/// What [`ServerHandle::remove_region`] did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Removal {
    /// Region.
    pub region: String,
    /// Whether the memory was released (nothing refers to it any more) within the timeout.
    pub released: bool,
    /// How long it took.
    pub seconds: f64,
}

/// A region's registration attempts, as decided at start-up.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RegionReport {
    /// What clients see.
    pub info: RegionInfo,
    /// Every attempt.
    pub attempts: Vec<Attempt>,
}

#[derive(Debug)]
struct Shared {
    cfg: ServerConfig,
    ctx: Context,
    regions: Vec<Region>,
    active: AtomicUsize,
    /// Connections that have not said hello yet.
    unauthenticated: AtomicUsize,
    removals: watch::Sender<u64>,
    /// The token clients must present (replaced by [`ServerHandle::set_token`]).
    token: RwLock<crate::Token>,
}

impl Shared {
    fn metrics(&self) -> &Metrics {
        &self.cfg.metrics
    }
}

/// A bound server, ready to [`Server::run`].
#[derive(Debug)]
pub struct Server {
    shared: Arc<Shared>,
    listener: TcpListener,
}

/// Controls a server while it runs (cheap to clone).
#[derive(Debug, Clone)]
pub struct ServerHandle {
    shared: Arc<Shared>,
}

/// A region's memory, name, read-only flag and options, before its path is decided.
type Opened = (String, Arc<dyn Provider>, bool, RegionOptions);

/// Open the memory of every region (allocate RAM, map files, allocate CMB, export dma-bufs).
fn open_providers(cfg: &ServerConfig) -> Result<Vec<Opened>> {
    let mut out: Vec<Opened> = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    for n in cfg
        .memory_regions
        .iter()
        .map(|m| m.name.as_str())
        .chain(cfg.regions.iter().map(|r| r.name.as_str()))
    {
        if names.contains(&n) {
            return Err(Error::Config(format!("region name '{n}' is given twice")));
        }
        names.push(n);
    }
    for m in &cfg.memory_regions {
        out.push((
            m.name.clone(),
            Arc::clone(&m.provider),
            m.read_only || !m.provider.writable(),
            m.options,
        ));
    }
    for spec in &cfg.regions {
        let (p, ro) = spec.open(&cfg.sysfs)?;
        out.push((spec.name.clone(), p, ro, spec.options));
    }
    Ok(out)
}

impl RegionSpec {
    /// A device-private region over `dev`, with this spec's window and policy (default: no
    /// window, copy).
    fn device_private(&self, dev: Arc<dyn peermem::hmm::DeviceBacking>) -> Arc<dyn Provider> {
        Arc::new(peermem::hmm::DevicePrivate::new(
            dev,
            self.options.window.unwrap_or(0),
            self.options.policy.unwrap_or(peermem::hmm::Policy::Copy),
        ))
    }

    /// Open the memory: allocate RAM, map the file, allocate CMB (P2PDMA, sysfs at `sysfs`),
    /// export a dma-buf. Returns the provider and whether the region is read-only.
    pub fn open(&self, sysfs: &std::path::Path) -> Result<(Arc<dyn Provider>, bool)> {
        let name = &self.name;
        let cfg_err = |e: peermem::Error| Error::Config(format!("region '{name}': {e}"));
        Ok(match &self.source {
            RegionSource::Host { size, huge } => (
                Arc::new(HostMemory::anonymous(*size, *huge).map_err(cfg_err)?),
                false,
            ),
            RegionSource::File { path, read_only } => {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(!read_only)
                    .open(path)
                    .map_err(|e| {
                        Error::io(
                            format!(
                                "region '{name}': cannot open {} {}",
                                path.display(),
                                if *read_only {
                                    "for reading"
                                } else {
                                    "for reading and writing (add :ro to serve it read-only)"
                                }
                            ),
                            e,
                        )
                    })?;
                let mem = HostMemory::file(&file, !read_only).map_err(|e| {
                    Error::Config(format!("region '{name}' ({}): {e}", path.display()))
                })?;
                (Arc::new(mem), *read_only)
            }
            RegionSource::Cmb { device, size } => (
                Arc::new(peermem::cmb::CmbMemory::allocate(sysfs, device, *size).map_err(cfg_err)?),
                false,
            ),
            RegionSource::DmaBuf { size } => (
                Arc::new(DmaBufMemory::udmabuf(*size).map_err(cfg_err)?),
                false,
            ),
            RegionSource::DevPriv { size } => {
                let dev = peermem::hmm::MemfdDevice::new(*size).map_err(cfg_err)?;
                (self.device_private(Arc::new(dev)), false)
            }
            RegionSource::DevPrivHmm { size } => {
                let mem = peermem::dmirror::DmirrorMemory::new(None, *size).map_err(cfg_err)?;
                // populate every page (zeros) so that all of them have something to migrate
                mem.copy_in(0, &vec![0; *size as usize]).map_err(cfg_err)?;
                let moved = mem.migrate_to_device(0..*size).map_err(cfg_err)?;
                tracing::info!(
                    region = %name,
                    pages = moved,
                    residency = %mem.residency().map_err(cfg_err)?,
                    "migrated to HMM device-private memory"
                );
                (Arc::new(mem), false)
            }
            RegionSource::DevPrivCuda { gpu, size } => {
                let driver = peermem::cuda::load().map_err(cfg_err)?;
                let dev =
                    peermem::cuda::CudaDevice::allocate(driver, *gpu, *size).map_err(cfg_err)?;
                (self.device_private(Arc::new(dev)), false)
            }
            RegionSource::Cuda { gpu, size } => {
                let driver = peermem::cuda::load().map_err(cfg_err)?;
                (
                    Arc::new(
                        peermem::cuda::CudaMemory::allocate(driver, *gpu, *size)
                            .map_err(cfg_err)?,
                    ),
                    false,
                )
            }
        })
    }
}

/// Decide each region's path (registration attempts proved by canaries, policy applied).
async fn build_regions(cfg: &ServerConfig, ctx: &Context) -> Result<Vec<Region>> {
    let providers = open_providers(cfg)?;
    let pd = ProtectionDomain::new(ctx)?;
    let mut out = Vec::new();
    for (name, provider, read_only, opts) in providers {
        let policy = opts.p2p.unwrap_or(cfg.p2p);
        let choice = opts.reg.unwrap_or(cfg.reg);
        let len = provider.len();
        let window = opts.window.map_or(len, |w| w.min(len));
        let residency_before = provider.residency();
        let planned = decide(&pd, &provider, 0..window, choice, policy)
            .await
            .map_err(|r| {
                Error::Config(format!(
                    "region '{name}' ({}) is refused: {r}",
                    provider.describe()
                ))
            })?;
        drop(planned.mr);
        let d = planned.decision;
        for a in &d.attempts {
            let result = match &a.outcome {
                peermem::canary::AttemptOutcome::NotApplicable { .. } => "not-applicable",
                peermem::canary::AttemptOutcome::RegistrationFailed { .. } => "registration-failed",
                peermem::canary::AttemptOutcome::CanaryFailed { .. } => "canary-failed",
                peermem::canary::AttemptOutcome::CanaryError { .. } => "canary-error",
                peermem::canary::AttemptOutcome::Works { .. } => "works",
            };
            cfg.metrics
                .canary
                .get_or_create(&crate::metrics::CanaryLabels {
                    region: name.clone(),
                    strategy: a.mode.to_string(),
                    result: result.to_string(),
                })
                .inc();
        }
        let direct_len = if d.path == PathKind::Direct {
            window
        } else {
            0
        };
        let mut extents = Vec::new();
        if direct_len > 0 {
            extents.push(Extent {
                offset: 0,
                len: direct_len,
                path: DataPath::Direct,
            });
        }
        if direct_len < len {
            extents.push(Extent {
                offset: direct_len,
                len: len - direct_len,
                path: DataPath::Bounce,
            });
        }
        let path = match (direct_len, direct_len == len) {
            (_, true) => DataPath::Direct,
            (0, _) => DataPath::Bounce,
            _ => DataPath::Mixed,
        };
        let mut reason = d.reason.clone();
        if let (Some(before), Some(after)) = (residency_before, provider.residency()) {
            reason.push_str(&format!(
                "; pages before registration: {before}; after: {after}"
            ));
        }
        if direct_len > 0 && direct_len < len {
            reason.push_str(&format!(
                "; bytes from {direct_len} on are beyond the {direct_len}-byte P2P window and go through bounce buffers"
            ));
        }
        let mut window_mode = None;
        if let Some(dp) = provider.as_device_private().filter(|d| d.window_size() > 0) {
            let proof = peermem::plan::prove_window(&pd, dp, choice, policy).await;
            tracing::info!(region = %name, mode = ?proof.mode, why = proof.reason, "P2P window units");
            window_mode = proof.mode;
            reason.push_str(&format!("; window units: {}", proof.reason));
        }
        let access = if read_only {
            AccessMode::ReadOnly
        } else {
            AccessMode::ReadWrite
        };
        tracing::info!(region = %name, %path, reason, "region ready");
        let weak = Arc::downgrade(&provider);
        out.push(Region {
            info: RegionInfo {
                name,
                size: len,
                access,
                kind: provider.kind().to_string(),
                path,
                reason,
                strategy: d.mode.filter(|_| direct_len > 0).map(|m| m.to_string()),
                extents,
                residency: None,
            },
            provider: Mutex::new(Some(provider)),
            weak,
            direct_len,
            mode: d.mode,
            attempts: d.attempts,
            removed: AtomicBool::new(false),
            window_mode,
        });
    }
    Ok(out)
}

impl Server {
    /// Open the device, build the regions (deciding each one's path), bind the listener.
    pub async fn bind(cfg: ServerConfig) -> Result<Server> {
        if cfg.token.is_empty() {
            return Err(Error::Config(
                "the token is empty: put a secret in the token file".into(),
            ));
        }
        if cfg.regions.is_empty() && cfg.memory_regions.is_empty() {
            return Err(Error::Config(
                "no region to serve: give at least one --region".into(),
            ));
        }
        if cfg.bounce_chunk == 0 || cfg.bounce_depth == 0 {
            return Err(Error::Config(
                "bounce chunk and depth must be at least 1".into(),
            ));
        }
        cfg.metrics.set_ready(false);
        let ctx = Context::open(cfg.device.as_deref())?;
        let regions = build_regions(&cfg, &ctx).await?;
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| Error::io(format!("cannot listen on {}", cfg.listen), e))?;
        cfg.metrics.regions.set(regions.len() as i64);
        let token = RwLock::new(cfg.token.clone());
        Ok(Server {
            shared: Arc::new(Shared {
                cfg,
                ctx,
                regions,
                active: AtomicUsize::new(0),
                unauthenticated: AtomicUsize::new(0),
                removals: watch::Sender::new(0),
                token,
            }),
            listener,
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::io("local address", e))
    }

    /// What is served.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.handle().regions()
    }

    /// What is served, with every registration attempt.
    pub fn reports(&self) -> Vec<RegionReport> {
        self.shared
            .regions
            .iter()
            .map(|r| RegionReport {
                info: r.info.clone(),
                attempts: r.attempts.clone(),
            })
            .collect()
    }

    /// The RDMA device in use.
    pub fn device(&self) -> &str {
        self.shared.ctx.name()
    }

    /// A handle to control the server while it runs.
    pub fn handle(&self) -> ServerHandle {
        ServerHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Serve until `shutdown` resolves; then stop accepting, tell connections to finish, wait
    /// for them (at most `drain_timeout`), and release everything.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
        self.shared.metrics().set_ready(true);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                res = self.listener.accept() => {
                    let (stream, peer) = match res {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let shared = Arc::clone(&self.shared);
                    let stop = stop_rx.clone();
                    let span = tracing::info_span!("conn", %peer);
                    tasks.spawn(async move { connection(shared, Conn::new(stream, peer.to_string()), stop).await }.instrument(span));
                }
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        tracing::info!(
            connections = tasks.len(),
            "shutting down: no new connections or opens; open handles finish their transfers"
        );
        self.shared.metrics().set_ready(false);
        drop(self.listener);
        let _ = stop_tx.send(true);
        let drain = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(self.shared.cfg.drain_timeout, drain)
            .await
            .is_err()
        {
            tracing::warn!("connections did not finish in time; closing them");
            tasks.shutdown().await;
        }
        Ok(())
    }
}

impl ServerHandle {
    /// Replace the token new clients must present (connections already authenticated are
    /// not disturbed). An empty token is refused.
    pub fn set_token(&self, token: impl Into<crate::Token>) -> Result<()> {
        let token = token.into();
        if token.is_empty() {
            return Err(Error::Config(
                "the token is empty: put a secret in the token file".into(),
            ));
        }
        *self.shared.token.write().unwrap_or_else(|p| p.into_inner()) = token;
        tracing::info!("token replaced");
        Ok(())
    }

    /// The server's metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.shared.cfg.metrics)
    }

    /// The regions still served.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.shared
            .regions
            .iter()
            .filter(|r| !r.removed.load(Ordering::SeqCst))
            .map(|r| r.info.clone())
            .collect()
    }

    /// Stop serving a region: new opens are refused, every connection revokes its
    /// registrations of it (clients' one-sided operations on the old rkey then fail with a
    /// remote access error), in-flight bounce copies finish, and the memory is released once
    /// nothing refers to it. Waits at most `timeout` for that release.
    pub async fn remove_region(&self, name: &str, timeout: Duration) -> Result<Removal> {
        let start = Instant::now();
        let r = self
            .shared
            .regions
            .iter()
            .find(|r| r.info.name == name && !r.removed.load(Ordering::SeqCst))
            .ok_or_else(|| Error::Config(format!("no region '{name}' is being served")))?;
        r.removed.store(true, Ordering::SeqCst);
        drop(r.provider.lock().unwrap_or_else(|p| p.into_inner()).take());
        self.shared.removals.send_modify(|g| *g += 1);
        let released = loop {
            if r.weak.strong_count() == 0 {
                break true;
            }
            if start.elapsed() >= timeout {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        tracing::info!(region = name, released, "region removed");
        Ok(Removal {
            region: name.to_string(),
            released,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

impl ServerHandle {
    /// The owner of a device-private region (`devpriv:memfd`) freed or moved the units
    /// overlapping `range`: their window mappings are revoked (waiting at most `timeout` for
    /// transfers using them), transfers planned before fail with [`ErrorCode::Invalidated`],
    /// and a freed unit is never read or written again. Returns how many window mappings were
    /// revoked.
    pub fn invalidate(
        &self,
        name: &str,
        range: std::ops::Range<u64>,
        how: peermem::hmm::Invalidation,
        timeout: Duration,
    ) -> Result<usize> {
        let r = self
            .shared
            .regions
            .iter()
            .find(|r| r.info.name == name && !r.removed.load(Ordering::SeqCst))
            .ok_or_else(|| Error::Config(format!("no region '{name}' is being served")))?;
        let p = r.provider().map_err(|(_, m)| Error::Config(m))?;
        let d = p.as_device_private().ok_or_else(|| {
            Error::Config(format!(
                "region '{name}' ({}) is not device-private memory: its owner cannot invalidate units",
                p.kind()
            ))
        })?;
        let n = d.invalidate(range.clone(), how, timeout).map_err(|e| {
            Error::Config(format!(
                "region '{name}': units {}..{} are still in use after {timeout:?}: {e}",
                range.start, range.end
            ))
        })?;
        tracing::info!(
            region = name,
            ?range,
            ?how,
            revoked = n,
            "units invalidated by their owner"
        );
        // connections drop their MRs of the revoked window mappings
        self.shared.removals.send_modify(|g| *g += 1);
        Ok(n)
    }
}

fn access_for(mode: AccessMode) -> Access {
    match mode {
        AccessMode::ReadOnly => Access::REMOTE_READ,
        AccessMode::ReadWrite => Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
    }
}

/// Decrements a gauge when dropped.
struct GaugeGuard<'a>(&'a prometheus_client::metrics::gauge::Gauge);
impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

struct ActiveGuard<'a>(&'a AtomicUsize);
impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct OpenHandle {
    idx: usize,
    /// The direct part's MR (None: bounce only, or the region was removed).
    lease: Option<Lease<DeviceMr>>,
}

type Completion = verbs::Result<Vec<Local>>;

/// A bounce transfer in flight: the staging buffer is owned by the work request.
struct InFlight {
    fut: Pin<Box<dyn Future<Output = Option<Completion>> + Send>>,
    provider: Arc<dyn Provider>,
    offset: u64,
    len: u64,
    to_region: bool,
    /// A device-private transfer with windowed units moved by the NIC itself.
    window: Option<WindowXfer>,
    /// For the metrics: the region and when the request arrived.
    meta: Option<BounceMeta>,
}

/// What the metrics need of a bounce request.
#[derive(Debug, Clone, Copy)]
struct BounceMeta {
    region: usize,
    to_region: bool,
    started: Instant,
}

/// The segments of a device-private bounce request, some moved by RDMA straight from or to
/// their window MRs (their leases are held until the completion, so invalidation waits for
/// it), the others through the staging buffer.
struct WindowXfer {
    segs: Vec<Segment>,
    /// Per segment: moved by RDMA on a window MR.
    rdma: Vec<bool>,
    staging: Staging,
}

/// A window MR and the offset in it where a piece of a transfer starts.
type WindowPiece = (Arc<DeviceMr>, u64);

/// Where the staged part of a window transfer sits while the work requests hold it.
enum Staging {
    /// Nothing was staged: the buffer waits here.
    Unused(RegisteredBuffer),
    /// A fetch: the NIC reads the staged bytes.
    Shared(Arc<RegisteredBuffer>),
    /// A put: the NIC writes the staged bytes.
    Sink(Arc<SinkBuffer>),
}

/// Per-connection RDMA state; dropping it destroys the MRs, the QP and the PD.
#[derive(Default)]
struct ConnState {
    // drop order: handles (leases), in-flight bounces, cache, staging ring, QP, PD
    open: HashMap<u32, OpenHandle>,
    inflight: VecDeque<InFlight>,
    /// Keyed by (region index, writable): an open for reading gets an MR without remote write.
    cache: Option<RegCache<(usize, bool), DeviceMr>>,
    ring: Vec<RegisteredBuffer>,
    /// MRs of device-private window mappings, by the mapping's address (the MR holds the
    /// mapping, so the address is not reused while the entry exists). Entries whose mapping the
    /// region gave up (evicted or invalidated: the MR holds the last reference) are dropped.
    window_mrs: HashMap<usize, Arc<DeviceMr>>,
    qp: Option<QueuePair>,
    pd: Option<ProtectionDomain>,
    next_handle: u32,
    seen_removals: u64,
    /// The cache's counters as last added to the metrics.
    cache_seen: peermem::regcache::Stats,
    /// Bytes of staging buffers this connection allocated (for the metrics).
    staging_bytes: u64,
}

async fn connection(shared: Arc<Shared>, mut conn: Conn, mut stop: watch::Receiver<bool>) {
    let m = shared.metrics();
    m.connections_accepted.inc();
    m.connections.inc();
    let _gauge = GaugeGuard(&m.connections);
    // Before the hello, a connection holds a slot of its own budget, not an authenticated
    // client's: sockets that never say hello cannot lock real clients out. Over that budget
    // the socket is closed at once, without a byte in reply.
    let pending = shared.unauthenticated.fetch_add(1, Ordering::SeqCst) + 1;
    let pre = ActiveGuard(&shared.unauthenticated);
    if pending > shared.cfg.max_unauthenticated {
        tracing::warn!(
            limit = shared.cfg.max_unauthenticated,
            "connection dropped: too many connections have not said hello yet"
        );
        return;
    }
    conn.set_max_frame(crate::protocol::MAX_HELLO_FRAME);
    let hello = authenticate(&shared, &mut conn).await;
    drop(pre);
    if let Err(e) = hello {
        tracing::info!(error = %e, "connection refused before authentication");
        conn.shutdown().await;
        return;
    }
    conn.set_max_frame(crate::protocol::MAX_FRAME);
    let n = shared.active.fetch_add(1, Ordering::SeqCst) + 1;
    let _guard = ActiveGuard(&shared.active);
    if n > shared.cfg.max_connections {
        tracing::warn!(
            limit = shared.cfg.max_connections,
            "connection refused: limit reached"
        );
        let _ = conn
            .send(&Msg::error(
                ErrorCode::Busy,
                format!(
                    "the server is at its limit of {} connections; retry later",
                    shared.cfg.max_connections
                ),
            ))
            .await;
        return;
    }
    match serve_connection(&shared, &mut conn, &mut stop).await {
        Ok(()) => tracing::info!("connection closed"),
        Err(e) => tracing::info!(error = %e, "connection ended"),
    }
    conn.shutdown().await;
}

async fn next_done(q: &mut VecDeque<InFlight>) -> Option<Completion> {
    match q.front_mut() {
        Some(f) => f.fut.as_mut().await,
        None => std::future::pending().await,
    }
}

/// The hello: version and token. Nothing about a region is said before it succeeds.
async fn authenticate(shared: &Shared, conn: &mut Conn) -> Result<()> {
    // 1. hello, before anything about a region is said
    let hello = conn.recv(Some(shared.cfg.hello_timeout), "hello").await;
    let (version, token, client) = match hello {
        Ok(Msg::Hello {
            version,
            token,
            client,
        }) => (version, token, client),
        Ok(other) => {
            let _ = conn
                .send(&Msg::error(
                    ErrorCode::Unauthorized,
                    "say hello with the token first",
                ))
                .await;
            return Err(Error::Unexpected {
                peer: conn.peer.clone(),
                got: other.kind(),
                want: "hello",
            });
        }
        Err(e) => {
            if let Error::Protocol { source, .. } = &e {
                let _ = conn
                    .send(&Msg::error(ErrorCode::BadRequest, source.to_string()))
                    .await;
            }
            return Err(e);
        }
    };
    if version != VERSION {
        let _ = conn
            .send(&Msg::error(
                ErrorCode::BadVersion,
                format!("server speaks protocol version {VERSION}, client {version}; use matching p2p-rdma versions"),
            ))
            .await;
        return Err(Error::Version {
            peer: conn.peer.clone(),
            theirs: version,
            ours: VERSION,
        });
    }
    let token_ok = {
        let expected = shared.token.read().unwrap_or_else(|p| p.into_inner());
        expected.matches(&token)
    };
    if !token_ok {
        tracing::warn!(client, "wrong token");
        shared.metrics().auth_failures.inc();
        shared.metrics().error(&ErrorCode::Unauthorized.to_string());
        let _ = conn
            .send(&Msg::error(ErrorCode::Unauthorized, "wrong token"))
            .await;
        return Err(Error::Server {
            code: ErrorCode::Unauthorized,
            message: format!("client '{client}' sent a wrong token"),
        });
    }
    tracing::info!(client, "client authenticated");
    Ok(())
}

async fn serve_connection(
    shared: &Shared,
    conn: &mut Conn,
    stop: &mut watch::Receiver<bool>,
) -> Result<()> {
    conn.send(&Msg::Welcome {
        version: VERSION,
        server: format!(
            "p2p-rdma {} on {}",
            env!("CARGO_PKG_VERSION"),
            shared.ctx.name()
        ),
        max_outstanding: shared.cfg.max_outstanding,
    })
    .await?;

    // 2. requests; bounce requests are pipelined (several in flight), and every reply goes out
    // in request order: a request of another kind first waits for the bounces before it
    let mut st = ConnState::default();
    let mut removals = shared.removals.subscribe();
    st.seen_removals = *removals.borrow_and_update();
    let m = shared.metrics();
    let mut draining = false;
    let result = loop {
        // draining (the server is stopping): a client with nothing open is told and let go; one
        // with open handles finishes its transfers (new opens are refused) until it closes them
        if draining && st.open.is_empty() && st.inflight.is_empty() {
            let reply = Msg::error(ErrorCode::ShuttingDown, "the server is shutting down");
            count_reply(m, &reply);
            let _ = conn.send(&reply).await;
            break Ok(());
        }
        let msg = tokio::select! {
            biased;
            _ = stop.changed(), if !draining => {
                draining = true;
                continue;
            }
            _ = removals.changed() => {
                st.revoke_removed(shared);
                st.sync_metrics(m, false);
                continue;
            }
            done = next_done(&mut st.inflight) => {
                let f = st.inflight.pop_front().expect("a bounce was in flight");
                let reply = st.complete(shared, f, done);
                if let Err(e) = conn.send(&reply).await {
                    break Err(e);
                }
                continue;
            }
            m = conn.recv(None, "a request") => m,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(Error::Protocol { peer, source }) => {
                let _ = st.drain(shared, conn).await;
                m.error(&ErrorCode::BadRequest.to_string());
                let _ = conn
                    .send(&Msg::error(ErrorCode::BadRequest, source.to_string()))
                    .await;
                break Err(Error::Protocol { peer, source });
            }
            Err(e) => break Err(e),
        };
        if matches!(msg, Msg::Bye) {
            break st.drain(shared, conn).await;
        }
        if let Msg::Transferred {
            handle,
            offset,
            len,
            to_region,
            micros,
        } = msg
        {
            // a client's report of a finished one-sided transfer: no reply
            let seconds = micros as f64 / 1e6;
            record_direct(shared, &st, handle, offset, len, to_region, seconds);
            continue;
        }
        if let Msg::Bounce {
            handle,
            offset,
            len,
            to_region,
            addr,
            rkey,
        } = msg
        {
            let req = BounceReq {
                handle,
                offset,
                len,
                to_region,
                remote: RemoteSlice { addr, rkey, len },
            };
            let idx = st.open.get(&handle).map(|h| h.idx);
            let started = Instant::now();
            match st.start_bounce(shared, conn, req).await {
                Err(e) => break Err(e),
                Ok(Ok(())) => {
                    if let (Some(region), Some(f)) = (idx, st.inflight.back_mut()) {
                        f.meta = Some(BounceMeta {
                            region,
                            to_region,
                            started,
                        });
                    }
                }
                Ok(Err((code, message))) => {
                    tracing::debug!(%code, message, "bounce refused");
                    if let Err(e) = st.drain(shared, conn).await {
                        break Err(e);
                    }
                    m.error(&code.to_string());
                    if let Err(e) = conn.send(&Msg::Error { code, message }).await {
                        break Err(e);
                    }
                }
            }
            continue;
        }
        if let Err(e) = st.drain(shared, conn).await {
            break Err(e);
        }
        // a client that holds handles may still connect its QP to use them
        let refused_while_draining = draining && matches!(msg, Msg::Open { .. });
        let is_open = matches!(msg, Msg::Open { .. });
        let reply = if refused_while_draining {
            Msg::error(
                ErrorCode::ShuttingDown,
                "the server is shutting down: no new opens; finish with what is open",
            )
        } else {
            match handle(shared, &mut st, msg).await {
                Ok(r) => r,
                Err((code, message)) => {
                    tracing::debug!(%code, message, "request refused");
                    Msg::Error { code, message }
                }
            }
        };
        if is_open {
            st.sync_metrics(m, false);
        }
        count_reply(m, &reply);
        if let Err(e) = conn.send(&reply).await {
            break Err(e);
        }
    };
    m.open_handles.dec_by(st.open.len() as i64);
    st.sync_metrics(m, true);
    result
}

/// The next handle number not in use (the counter wraps; a live handle is never reused, and
/// `max_open_per_connection` keeps the search short).
fn free_handle<V>(open: &HashMap<u32, V>, next: &mut u32) -> u32 {
    loop {
        let h = *next;
        *next = next.wrapping_add(1);
        if !open.contains_key(&h) {
            return h;
        }
    }
}

/// Count an error reply by its code.
fn count_reply(m: &Metrics, reply: &Msg) {
    if let Msg::Error { code, .. } = reply {
        m.error(&code.to_string());
    }
}

/// A finished bounce request: its staged bytes as bounce, its window bytes as zero-copy.
fn record_bounce(shared: &Shared, meta: BounceMeta, len: u64, zero_copy: u64) {
    let m = shared.metrics();
    let name = &shared.regions[meta.region].info.name;
    let dir = Direction::of(meta.to_region);
    let staged = len.saturating_sub(zero_copy);
    if staged > 0 || zero_copy == 0 {
        m.transfer(name, dir, XferPath::bounce, staged);
    }
    if zero_copy > 0 {
        m.transfer(name, dir, XferPath::zero_copy, zero_copy);
    }
    m.observe(dir, XferPath::bounce, meta.started.elapsed().as_secs_f64());
}

/// A client's report of a finished direct transfer. Only ranges inside the direct part of a
/// region the client has open are counted (a report cannot inflate another region's figures).
fn record_direct(
    shared: &Shared,
    st: &ConnState,
    handle: u32,
    offset: u64,
    len: u64,
    to_region: bool,
    seconds: f64,
) {
    let Some(h) = st.open.get(&handle) else {
        return;
    };
    let r = &shared.regions[h.idx];
    if h.lease.is_none() || offset.checked_add(len).is_none_or(|end| end > r.direct_len) {
        tracing::debug!(
            handle,
            offset,
            len,
            "transfer report outside the direct part ignored"
        );
        return;
    }
    let dir = Direction::of(to_region);
    let m = shared.metrics();
    m.transfer(&r.info.name, dir, XferPath::direct, len);
    m.observe(dir, XferPath::direct, seconds);
}

struct BounceReq {
    handle: u32,
    offset: u64,
    len: u64,
    to_region: bool,
    remote: RemoteSlice,
}

type Reply = std::result::Result<Msg, (ErrorCode, String)>;

fn not_open(handle: u32) -> (ErrorCode, String) {
    (
        ErrorCode::NotOpen,
        format!("handle {handle} is not open on this connection"),
    )
}

/// How long one bounce RDMA operation may take before the connection is declared stalled.
const BOUNCE_STALL: Duration = Duration::from_secs(30);

impl ConnState {
    /// This connection's PD, created on first use.
    fn pd(&mut self, ctx: &Context) -> std::result::Result<ProtectionDomain, (ErrorCode, String)> {
        if let Some(pd) = &self.pd {
            return Ok(pd.clone());
        }
        let pd = ProtectionDomain::new(ctx).map_err(internal)?;
        self.pd = Some(pd.clone());
        Ok(pd)
    }

    /// The region behind an open handle.
    fn region_index(&self, handle: u32) -> std::result::Result<usize, (ErrorCode, String)> {
        self.open
            .get(&handle)
            .map(|h| h.idx)
            .ok_or_else(|| not_open(handle))
    }

    /// Drop this connection's registrations of removed regions, and its MRs of window mappings
    /// that were evicted or invalidated.
    fn revoke_removed(&mut self, shared: &Shared) {
        self.sweep_window_mrs();
        let gone = |idx: &usize| shared.regions[*idx].removed.load(Ordering::SeqCst);
        for (handle, h) in self.open.iter_mut() {
            if gone(&h.idx) && h.lease.take().is_some() {
                tracing::info!(
                    handle,
                    region = shared.regions[h.idx].info.name,
                    "revoked the MR of a removed region"
                );
            }
        }
        if let Some(c) = &self.cache {
            // no lease is left (handles dropped theirs): deregisters at once
            if let Err(e) = c.invalidate(|k| gone(&k.0), Duration::from_secs(1)) {
                tracing::warn!(error = %e, "registrations of a removed region are still in use");
            }
        }
    }

    /// Finish every bounce in flight, replying to each in order.
    async fn drain(&mut self, shared: &Shared, conn: &mut Conn) -> Result<()> {
        while let Some(mut f) = self.inflight.pop_front() {
            let done = f.fut.as_mut().await;
            let reply = self.complete(shared, f, done);
            conn.send(&reply).await?;
        }
        Ok(())
    }

    /// [`ConnState::finish`], then count what it did in the metrics: the bytes of a finished
    /// bounce, or the error code of its reply.
    fn complete(&mut self, shared: &Shared, f: InFlight, done: Option<Completion>) -> Msg {
        let meta = f.meta;
        let reply = self.finish(f, done);
        if let (Some(meta), Msg::BounceDone { len, zero_copy }) = (meta, &reply) {
            record_bounce(shared, meta, *len, *zero_copy);
        }
        count_reply(shared.metrics(), &reply);
        reply
    }

    /// A completed bounce: copy into the region for a put, give the buffer back, say how it went.
    fn finish(&mut self, f: InFlight, done: Option<Completion>) -> Msg {
        let op = if f.to_region {
            "RDMA READ of the client's buffer"
        } else {
            "RDMA WRITE to the client's buffer"
        };
        let window = f.window;
        let mut locals = match done {
            Some(Ok(l)) if window.is_some() => {
                // every work request's references to the staging buffer and the window MRs
                // go back before the buffer is taken back
                drop(l);
                let w = window.expect("checked");
                return self.finish_window(&f.provider, f.offset, f.len, f.to_region, w);
            }
            Some(Ok(l)) => l,
            Some(Err(e)) => {
                return Msg::error(ErrorCode::Internal, format!("bounce {op} failed: {e}"))
            }
            None => {
                if let Some(qp) = &self.qp {
                    let _ = qp.set_error();
                }
                return Msg::error(
                    ErrorCode::Internal,
                    format!(
                        "bounce {op} neither completed nor failed in {} s: the RDMA transport stalled",
                        BOUNCE_STALL.as_secs()
                    ),
                );
            }
        };
        let Some(buf) = locals.pop().and_then(Local::into_owned) else {
            return Msg::error(ErrorCode::Internal, "bounce staging buffer lost");
        };
        let n = f.len as usize;
        let res = if f.to_region {
            f.provider.copy_in(f.offset, &buf.as_slice()[..n])
        } else {
            Ok(())
        };
        self.ring.push(buf);
        match res {
            Ok(()) => Msg::BounceDone {
                len: f.len,
                zero_copy: 0,
            },
            Err(e) => Msg::error(
                copy_error_code(&e),
                format!(
                    "copying {} bytes into the region at {}: {e}",
                    f.len, f.offset
                ),
            ),
        }
    }

    /// A completed device-private transfer: take the staging buffer back, write its staged
    /// segments into the region (a put), count the segments the NIC moved on window MRs (they
    /// fail if the owner invalidated their units meanwhile), release the leases.
    fn finish_window(
        &mut self,
        provider: &Arc<dyn Provider>,
        offset: u64,
        len: u64,
        to_region: bool,
        w: WindowXfer,
    ) -> Msg {
        let WindowXfer {
            segs,
            rdma,
            staging,
        } = w;
        let buf = match staging {
            Staging::Unused(b) => Some(b),
            Staging::Shared(a) => Arc::try_unwrap(a).ok(),
            Staging::Sink(a) => SinkBuffer::into_inner(a).ok(),
        };
        let Some(buf) = buf else {
            return Msg::error(
                ErrorCode::Internal,
                "bounce staging buffer still in use after its completion",
            );
        };
        let Some(dp) = provider.as_device_private() else {
            self.ring.push(buf);
            return Msg::error(ErrorCode::Internal, "not a device-private region");
        };
        let mut zero_copy = 0;
        let mut res = Ok(());
        for (seg, &by_nic) in segs.iter().zip(&rdma) {
            let at = (seg.range.start - offset) as usize;
            let n = (seg.range.end - seg.range.start) as usize;
            res = if by_nic {
                zero_copy += n as u64;
                dp.finish_window_rdma(seg)
            } else if to_region {
                dp.write_segment(seg, &buf.as_slice()[at..at + n])
            } else {
                Ok(())
            };
            if res.is_err() {
                break;
            }
        }
        self.ring.push(buf);
        drop(segs);
        match res {
            Ok(()) => Msg::BounceDone { len, zero_copy },
            Err(e) => Msg::error(
                copy_error_code(&e),
                format!(
                    "{} {len} bytes of the region at {offset}: {e}",
                    if to_region { "writing" } else { "reading" }
                ),
            ),
        }
    }

    /// Drop MRs of window mappings the region no longer holds (evicted or invalidated).
    fn sweep_window_mrs(&mut self) {
        self.window_mrs
            .retain(|_, mr| Arc::strong_count(mr.provider()) > 1);
    }

    /// This connection's MR of a window mapping, registered with the proved strategy on first
    /// use; None when the registration fails (the segment is then copied by the CPU).
    fn window_mr(
        &mut self,
        pd: &ProtectionDomain,
        mapping: &Arc<dyn Provider>,
        mode: RegMode,
    ) -> Option<Arc<DeviceMr>> {
        let key = Arc::as_ptr(mapping) as *const () as usize;
        if let Some(mr) = self.window_mrs.get(&key) {
            return Some(Arc::clone(mr));
        }
        match register_mode(pd, mapping, 0..mapping.len(), Access::LOCAL_WRITE, mode) {
            Ok(mr) => {
                let mr = Arc::new(mr);
                self.window_mrs.insert(key, Arc::clone(&mr));
                Some(mr)
            }
            Err(e) => {
                tracing::warn!(mapping = %mapping.describe(), %mode, "no MR of a window mapping, the CPU copies it: {e}");
                None
            }
        }
    }

    /// Start a bounce request of a device-private region whose window MRs work: windowed
    /// segments go by RDMA straight from (fetch) or to (put) the window MR, the others through
    /// `buf`. Consecutive staged segments share one work request.
    fn start_window(
        &mut self,
        shared: &Shared,
        req: &BounceReq,
        provider: &Arc<dyn Provider>,
        mode: RegMode,
        mut buf: RegisteredBuffer,
        name: &str,
    ) -> std::result::Result<(), (ErrorCode, String)> {
        let dp = provider.as_device_private().expect("checked by the caller");
        let segs = match dp.plan(req.offset, req.len) {
            Ok(s) => s,
            Err(e) => {
                self.ring.push(buf);
                return Err((copy_error_code(&e), format!("region '{name}': {e}")));
            }
        };
        let pd = match self.pd(&shared.ctx) {
            Ok(p) => p,
            Err(e) => {
                self.ring.push(buf);
                return Err(e);
            }
        };
        self.sweep_window_mrs();
        let qp = self.qp.clone().expect("checked by the caller");
        // one work request per windowed segment and per run of staged ones, within the room
        // left on the send queue (else everything is staged: one work request)
        let room = (qp.max_send_wr() as usize).saturating_sub(qp.outstanding().0);
        let windowed = segs
            .iter()
            .filter(|s| matches!(s.path, SegmentPath::Window(..)))
            .count();
        let mut mrs: Vec<Option<Arc<DeviceMr>>> = Vec::with_capacity(segs.len());
        for seg in &segs {
            mrs.push(match &seg.path {
                SegmentPath::Window(lease, _) if 2 * windowed < room => {
                    self.window_mr(&pd, lease, mode)
                }
                _ => None,
            });
        }
        if !req.to_region {
            for (seg, mr) in segs.iter().zip(&mrs) {
                if mr.is_some() {
                    continue;
                }
                let at = (seg.range.start - req.offset) as usize;
                let n = (seg.range.end - seg.range.start) as usize;
                if let Err(e) = dp.read_segment(seg, &mut buf.as_mut_slice()[at..at + n]) {
                    self.ring.push(buf);
                    return Err((
                        copy_error_code(&e),
                        format!(
                            "copying {n} bytes out of region '{name}' at {}: {e}",
                            seg.range.start
                        ),
                    ));
                }
            }
        }
        let staging = match (mrs.iter().any(Option::is_none), req.to_region) {
            (false, _) => Staging::Unused(buf),
            (true, false) => Staging::Shared(Arc::new(buf)),
            (true, true) => Staging::Sink(SinkBuffer::new(buf)),
        };
        // pieces: (range in the request, window MR and offset in it)
        let mut pieces: Vec<(std::ops::Range<u64>, Option<WindowPiece>)> = Vec::new();
        for (seg, mr) in segs.iter().zip(&mrs) {
            let r = seg.range.start - req.offset..seg.range.end - req.offset;
            match (mr, &seg.path, pieces.last_mut()) {
                (Some(mr), SegmentPath::Window(_, off), _) => {
                    pieces.push((r, Some((Arc::clone(mr), off - mr.start()))))
                }
                (None, _, Some((prev, None))) if prev.end == r.start => prev.end = r.end,
                _ => pieces.push((r, None)),
            }
        }
        let mut wrs = Vec::with_capacity(pieces.len());
        for (r, mr) in pieces {
            let n = (r.end - r.start) as usize;
            let remote = req
                .remote
                .slice(r.start, r.end - r.start)
                .map_err(internal)?;
            let local = match (mr, &staging) {
                (Some((mr, off)), _) => {
                    let mr: Arc<dyn RegionRef> = mr;
                    Local::region(mr, off as usize..off as usize + n)
                }
                (None, Staging::Shared(b)) => {
                    Local::shared(Arc::clone(b), r.start as usize..r.end as usize)
                }
                (None, Staging::Sink(b)) => {
                    Local::sink(Arc::clone(b), r.start as usize..r.end as usize)
                }
                (None, Staging::Unused(_)) => unreachable!("a staged piece has a staging buffer"),
            }
            .map_err(internal)?;
            wrs.push(SendWr {
                op: if req.to_region {
                    SendOp::Read(remote)
                } else {
                    SendOp::Write(remote)
                },
                local,
            });
        }
        let pending = qp
            .post_send(wrs)
            .map_err(|e| internal(format!("posting the bounce transfer: {e}")))?;
        let rdma = mrs.iter().map(Option::is_some).collect();
        self.inflight.push_back(InFlight {
            fut: Box::pin(async move {
                tokio::time::timeout(BOUNCE_STALL, pending.wait())
                    .await
                    .ok()
            }),
            provider: Arc::clone(provider),
            offset: req.offset,
            len: req.len,
            to_region: req.to_region,
            window: Some(WindowXfer {
                segs,
                rdma,
                staging,
            }),
            meta: None,
        });
        Ok(())
    }

    /// Validate and start one bounce request. The outer error is the connection's; the inner
    /// one is a refusal to send back.
    async fn start_bounce(
        &mut self,
        shared: &Shared,
        conn: &mut Conn,
        req: BounceReq,
    ) -> Result<std::result::Result<(), (ErrorCode, String)>> {
        let h = match self.open.get(&req.handle) {
            Some(h) => h,
            None => return Ok(Err(not_open(req.handle))),
        };
        let r = &shared.regions[h.idx];
        if r.removed.load(Ordering::SeqCst) {
            return Ok(Err(removed(&r.info.name)));
        }
        if let Err(e) = range_check(&r.info, req.offset, req.len) {
            return Ok(Err(e));
        }
        if req.offset < r.direct_len {
            return Ok(Err((
                ErrorCode::NotBounce,
                format!(
                    "bytes 0..{} of region '{}' are served direct: use one-sided RDMA on its rkey",
                    r.direct_len, r.info.name
                ),
            )));
        }
        let chunk = shared.cfg.bounce_chunk as u64;
        if req.len == 0 || req.len > chunk {
            return Ok(Err((
                ErrorCode::BadRequest,
                format!("a bounce request moves 1 to {chunk} bytes, not {}", req.len),
            )));
        }
        if req.to_region && r.info.access == AccessMode::ReadOnly {
            return Ok(Err((
                ErrorCode::ReadOnly,
                format!("region '{}' is read-only; puts are refused", r.info.name),
            )));
        }
        if self.qp.is_none() {
            return Ok(Err((
                ErrorCode::BadRequest,
                "connect a QP before bounce requests".into(),
            )));
        }
        let provider = match r.provider() {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        // a staging buffer: a free one, a new one while the ring is not full, or the oldest
        // in-flight one once it completes
        let mut buf = loop {
            if let Some(b) = self.ring.pop() {
                break b;
            }
            if self.inflight.len() < shared.cfg.bounce_depth {
                let pd = match self.pd(&shared.ctx) {
                    Ok(p) => p,
                    Err(e) => return Ok(Err(e)),
                };
                let b = HostBuffer::new(shared.cfg.bounce_chunk)
                    .and_then(|m| pd.register(m, Access::LOCAL_WRITE, RegMode::Pinned));
                match b {
                    Ok(b) => {
                        self.staging_bytes += shared.cfg.bounce_chunk as u64;
                        shared
                            .metrics()
                            .staging_bytes
                            .inc_by(shared.cfg.bounce_chunk as i64);
                        break b;
                    }
                    Err(e) => return Ok(Err(internal(format!("staging buffer: {e}")))),
                }
            }
            let mut f = self
                .inflight
                .pop_front()
                .expect("ring full means work in flight");
            let done = f.fut.as_mut().await;
            let reply = self.complete(shared, f, done);
            conn.send(&reply).await?;
        };
        if let Some(mode) = r
            .window_mode
            .filter(|_| provider.as_device_private().is_some())
        {
            return Ok(self.start_window(shared, &req, &provider, mode, buf, &r.info.name));
        }
        let n = req.len as usize;
        let op = if req.to_region {
            SendOp::Read(req.remote)
        } else {
            if let Err(e) = provider.copy_out(req.offset, &mut buf.as_mut_slice()[..n]) {
                self.ring.push(buf);
                let code = copy_error_code(&e);
                return Ok(Err((
                    code,
                    format!(
                        "copying {n} bytes out of region '{}' at {}: {e}",
                        r.info.name, req.offset
                    ),
                )));
            }
            SendOp::Write(req.remote)
        };
        let qp = self.qp.as_ref().expect("checked above");
        let local = Local::owned_range(buf, 0..n).map_err(Error::Verbs)?;
        let pending = match qp.post_send(vec![SendWr { op, local }]) {
            Ok(p) => p,
            Err(e) => return Ok(Err(internal(format!("posting the bounce transfer: {e}")))),
        };
        self.inflight.push_back(InFlight {
            fut: Box::pin(async move {
                tokio::time::timeout(BOUNCE_STALL, pending.wait())
                    .await
                    .ok()
            }),
            provider,
            offset: req.offset,
            len: req.len,
            to_region: req.to_region,
            window: None,
            meta: None,
        });
        Ok(Ok(()))
    }

    fn cache(&mut self, limits: Limits) -> &RegCache<(usize, bool), DeviceMr> {
        self.cache.get_or_insert_with(|| RegCache::new(limits))
    }

    /// Add what the registration cache did since the last call to the metrics; `closing`:
    /// the connection ends, so its registrations and staging buffers go away.
    fn sync_metrics(&mut self, m: &Metrics, closing: bool) {
        let now = match (&self.cache, closing) {
            (Some(c), false) => c.stats(),
            (Some(c), true) => peermem::regcache::Stats {
                cached_bytes: 0,
                draining_bytes: 0,
                ..c.stats()
            },
            (None, _) => peermem::regcache::Stats::default(),
        };
        let was = self.cache_seen;
        m.regcache_hits.inc_by(now.hits.saturating_sub(was.hits));
        m.regcache_misses
            .inc_by(now.misses.saturating_sub(was.misses));
        m.regcache_evictions
            .inc_by(now.evictions.saturating_sub(was.evictions));
        let bytes = |s: &peermem::regcache::Stats| (s.cached_bytes + s.draining_bytes) as i64;
        m.regcache_registered_bytes
            .inc_by(bytes(&now) - bytes(&was));
        self.cache_seen = now;
        if closing {
            m.staging_bytes.dec_by(self.staging_bytes as i64);
            self.staging_bytes = 0;
        }
    }
}

/// The error code for a failed copy engine: the owner's invalidation, or a server failure.
fn copy_error_code(e: &peermem::Error) -> ErrorCode {
    match e {
        peermem::Error::Invalidated(_) => ErrorCode::Invalidated,
        _ => ErrorCode::Internal,
    }
}

fn range_check(
    region: &RegionInfo,
    offset: u64,
    len: u64,
) -> std::result::Result<(), (ErrorCode, String)> {
    match offset.checked_add(len) {
        Some(end) if end <= region.size => Ok(()),
        _ => Err((
            ErrorCode::OutOfRange,
            format!(
                "offset {offset} + length {len} is outside region '{}' of {} bytes",
                region.name, region.size
            ),
        )),
    }
}

fn internal(e: impl fmt::Display) -> (ErrorCode, String) {
    (ErrorCode::Internal, e.to_string())
}

async fn handle(shared: &Shared, st: &mut ConnState, msg: Msg) -> Reply {
    match msg {
        Msg::List => Ok(Msg::Regions {
            regions: shared
                .regions
                .iter()
                .filter(|r| !r.removed.load(Ordering::SeqCst))
                .map(|r| {
                    let mut info = r.info.clone();
                    info.residency = r.provider().ok().and_then(|p| p.residency());
                    info
                })
                .collect(),
        }),
        Msg::Connect { endpoint } => {
            if st.qp.is_some() {
                return Err((
                    ErrorCode::BadRequest,
                    "this connection already has a QP".into(),
                ));
            }
            let pd = st.pd(&shared.ctx)?;
            let qp = QueuePair::new(
                &pd,
                QpOptions {
                    // a device-private bounce request may take one work request per window
                    // unit it covers, and one per run of staged units
                    max_send_wr: (shared.cfg.bounce_depth
                        * (shared
                            .cfg
                            .bounce_chunk
                            .div_ceil(peermem::hmm::UNIT as usize)
                            + 2)
                        + 1)
                    .min(4096) as u32,
                    max_recv_wr: 1,
                    max_rd_atomic: shared.cfg.max_outstanding.clamp(1, 255) as u8,
                    ..QpOptions::default()
                },
            )
            .map_err(internal)?;
            let remote = verbs::Endpoint::from(endpoint);
            qp.connect(&remote).map_err(internal)?;
            let ep = qp.endpoint();
            tracing::info!(qpn = qp.qpn(), remote_qpn = remote.qpn, "QP connected");
            st.qp = Some(qp);
            Ok(Msg::Connected {
                endpoint: ep.into(),
            })
        }
        Msg::Open { region, write } => {
            let idx = shared
                .regions
                .iter()
                .position(|r| r.info.name == region && !r.removed.load(Ordering::SeqCst))
                .ok_or_else(|| {
                    let names: Vec<&str> = shared
                        .regions
                        .iter()
                        .filter(|r| !r.removed.load(Ordering::SeqCst))
                        .map(|r| r.info.name.as_str())
                        .collect();
                    (
                        ErrorCode::UnknownRegion,
                        format!(
                            "no region '{region}' on this server; it serves: {}",
                            names.join(", ")
                        ),
                    )
                })?;
            let r = &shared.regions[idx];
            if write && r.info.access == AccessMode::ReadOnly {
                return Err((
                    ErrorCode::ReadOnly,
                    format!("region '{region}' is read-only; puts are refused"),
                ));
            }
            if st.open.len() >= shared.cfg.max_open_per_connection {
                return Err((
                    ErrorCode::Busy,
                    format!(
                        "at most {} regions may be open per connection; close one first",
                        shared.cfg.max_open_per_connection
                    ),
                ));
            }
            let lease = match r.mode {
                Some(mode) if r.direct_len > 0 => {
                    let pd = st.pd(&shared.ctx)?;
                    let provider = r.provider()?;
                    // least privilege: the rkey allows remote writes only to an open for writing
                    let writable = write && r.info.access == AccessMode::ReadWrite;
                    let access = access_for(if writable {
                        AccessMode::ReadWrite
                    } else {
                        AccessMode::ReadOnly
                    });
                    let direct = r.direct_len;
                    let lease = st
                        .cache(shared.cfg.cache)
                        .get(&(idx, writable), 0..direct, direct, |range| {
                            register_mode(&pd, &provider, range, access, mode)
                        })
                        .map_err(|e| {
                            (
                                ErrorCode::Internal,
                                format!("registering region '{region}' ({mode}): {e}"),
                            )
                        })?;
                    Some(lease)
                }
                _ => None,
            };
            let handle = free_handle(&st.open, &mut st.next_handle);
            let (addr, rkey) = lease
                .as_ref()
                .map_or((0, 0), |l| (l.mr().addr(), l.mr().rkey()));
            let reply = Msg::Opened {
                handle,
                info: r.info.clone(),
                addr,
                rkey,
                len: r.direct_len,
                bounce_chunk: shared.cfg.bounce_chunk as u64,
            };
            tracing::info!(region, handle, write, path = %r.info.path, "region opened");
            if st.open.insert(handle, OpenHandle { idx, lease }).is_none() {
                shared.metrics().open_handles.inc();
            }
            Ok(reply)
        }
        Msg::Checksum {
            handle,
            offset,
            len,
        } => {
            let idx = st.region_index(handle)?;
            let r = &shared.regions[idx];
            range_check(&r.info, offset, len)?;
            let provider = r.provider()?;
            let crc = tokio::task::spawn_blocking(move || crc_of(&*provider, offset, len))
                .await
                .map_err(internal)?
                .map_err(internal)?;
            Ok(Msg::ChecksumIs { crc32c: crc })
        }
        Msg::Close { handle } => match st.open.remove(&handle) {
            Some(h) => {
                shared.metrics().open_handles.dec();
                let idx = h.idx;
                drop(h);
                // the rkey dies with the handle: once no other handle of this connection uses
                // the region, its registration goes (no lease is left, so at once), before
                // the client hears Closed
                if !st.open.values().any(|o| o.idx == idx) {
                    if let Some(c) = &st.cache {
                        if let Err(e) = c.invalidate(|k| k.0 == idx, Duration::from_secs(1)) {
                            tracing::warn!(error = %e, "a closed region's registration is still in use");
                        }
                    }
                    st.sync_metrics(shared.metrics(), false);
                }
                Ok(Msg::Closed { handle })
            }
            None => Err(not_open(handle)),
        },
        other => Err((
            ErrorCode::BadRequest,
            format!("'{}' is not a request a client may send now", other.kind()),
        )),
    }
}

/// CRC-32C of a range of a region's memory, reading it in chunks through its copy engine.
pub fn crc_of(
    mem: &dyn Provider,
    offset: u64,
    len: u64,
) -> std::result::Result<u32, peermem::Error> {
    let mut crc = 0u32;
    let mut buf = vec![0u8; (len as usize).min(1 << 20)];
    let mut done = 0u64;
    while done < len {
        let n = ((len - done) as usize).min(buf.len());
        mem.copy_out(offset + done, &mut buf[..n])?;
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        done += n as u64;
    }
    Ok(crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_wrap_without_overwriting_a_live_one() {
        let mut open: HashMap<u32, ()> = HashMap::new();
        let mut next = u32::MAX;
        let a = free_handle(&open, &mut next);
        assert_eq!(a, u32::MAX);
        open.insert(a, ());
        open.insert(0, ());
        open.insert(1, ());
        assert_eq!(
            free_handle(&open, &mut next),
            2,
            "0 and 1 are live: skipped"
        );
        // a full lap comes back to the same live handles and skips them again
        next = u32::MAX;
        assert_eq!(free_handle(&open, &mut next), 2);
    }

    #[test]
    fn the_config_never_prints_its_token() {
        let cfg = ServerConfig::new(
            "127.0.0.1:1".parse().unwrap(),
            "super-secret-token",
            vec!["r=host:1M".parse().unwrap()],
        );
        let d = format!("{cfg:?}");
        assert!(
            !d.contains("super-secret-token") && d.contains("redacted"),
            "{d}"
        );
        let c = crate::ClientConfig::new("127.0.0.1:1", "super-secret-token");
        assert!(!format!("{c:?}").contains("super-secret-token"));
        let hello = Msg::Hello {
            version: VERSION,
            token: "super-secret-token".into(),
            client: "x".into(),
        };
        assert!(!format!("{hello:?}").contains("super-secret-token"));
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        let r = RegionInfo {
            name: "r".into(),
            size: 100,
            access: AccessMode::ReadWrite,
            kind: "host".into(),
            path: DataPath::Direct,
            reason: String::new(),
            strategy: None,
            extents: Vec::new(),
            residency: None,
        };
        assert!(range_check(&r, 0, 100).is_ok());
        assert!(range_check(&r, 100, 0).is_ok());
        assert_eq!(
            range_check(&r, 1, 100).unwrap_err().0,
            ErrorCode::OutOfRange
        );
        assert!(range_check(&r, u64::MAX, 2)
            .unwrap_err()
            .1
            .contains("outside region 'r'"));
    }

    #[test]
    fn crc_matches_the_reference() {
        let m = HostMemory::anonymous(3 << 20, false).unwrap();
        let data: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        m.copy_in(0, &data).unwrap();
        assert_eq!(
            crc_of(&m, 5, (3 << 20) - 9).unwrap(),
            crc32c::crc32c(&data[5..(3 << 20) - 4])
        );
        assert_eq!(crc_of(&m, 0, 0).unwrap(), 0);
    }
}
