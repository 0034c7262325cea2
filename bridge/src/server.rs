//! The server: a catalog of regions served over RC QPs, one PD + QP per connection.
//!
//! Each connection gets its own protection domain, so an rkey handed to one client is useless
//! on another client's QP; regions are registered per connection when opened and deregistered
//! when closed or when the connection ends, so a vanished client leaves nothing behind.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument as _;
use verbs::{
    Access, Context, ProtectionDomain, QpOptions, QueuePair, RegMode, SharedMemory, SharedRegion,
};

use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::protocol::{
    constant_time_eq, AccessMode, DataPath, ErrorCode, Msg, RegionInfo, VERSION,
};
use crate::size::parse_size;

/// Where a region's memory comes from, as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionSource {
    /// Zeroed host RAM.
    Host {
        /// Bytes.
        size: u64,
        /// From huge pages.
        huge: bool,
    },
    /// A file, mapped shared.
    File {
        /// Path.
        path: PathBuf,
        /// Registered without remote write; puts are refused.
        read_only: bool,
    },
}

/// `NAME=host:SIZE[:huge]` or `NAME=file:PATH[:ro]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Name clients use.
    pub name: String,
    /// Memory.
    pub source: RegionSource,
}

impl FromStr for RegionSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        const FORMS: &str = "NAME=host:SIZE[:huge] or NAME=file:PATH[:ro]";
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("region '{s}' has no '=': expected {FORMS}"))?;
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "region name '{name}' must be non-empty letters, digits, '-', '_' or '.'"
            ));
        }
        let (kind, arg) = rest
            .split_once(':')
            .ok_or_else(|| format!("region '{s}': expected {FORMS}"))?;
        let source = match kind {
            "host" => {
                let (size, huge) = match arg.strip_suffix(":huge") {
                    Some(sz) => (sz, true),
                    None => (arg, false),
                };
                let size = parse_size(size).map_err(|e| format!("region '{name}': {e}"))?;
                if size == 0 {
                    return Err(format!("region '{name}': size must be at least 1 byte"));
                }
                RegionSource::Host { size, huge }
            }
            "file" => {
                let (path, read_only) = match arg.strip_suffix(":ro") {
                    Some(p) => (p, true),
                    None => (arg, false),
                };
                if path.is_empty() {
                    return Err(format!("region '{name}': empty file path"));
                }
                RegionSource::File {
                    path: PathBuf::from(path),
                    read_only,
                }
            }
            other => {
                return Err(format!(
                    "region '{name}': unknown kind '{other}': expected {FORMS}"
                ))
            }
        };
        Ok(RegionSpec {
            name: name.to_string(),
            source,
        })
    }
}

/// A region that is a window of memory the embedding application owns (e.g. one object of an
/// arena). The application may keep writing the memory through its own `Arc`.
#[derive(Debug, Clone)]
pub struct MemoryRegionSpec {
    /// Name clients use.
    pub name: String,
    /// The memory.
    pub mem: Arc<SharedMemory>,
    /// Window start.
    pub offset: u64,
    /// Window length.
    pub len: u64,
    /// Refuse puts (and register without remote write).
    pub read_only: bool,
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// RDMA device (None: first active).
    pub device: Option<String>,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The shared secret.
    pub token: String,
    /// Regions to serve.
    pub regions: Vec<RegionSpec>,
    /// Regions over memory the embedding application provides.
    pub memory_regions: Vec<MemoryRegionSpec>,
    /// Most concurrent connections; more are refused with `busy`.
    pub max_connections: usize,
    /// RDMA READ/WRITEs a client may keep in flight (the QP's responder resources).
    pub max_outstanding: u32,
    /// Regions one connection may hold open at once.
    pub max_open_per_connection: usize,
    /// How long a new connection may take to say hello.
    pub hello_timeout: Duration,
    /// How long shutdown waits for connections to finish.
    pub drain_timeout: Duration,
}

impl ServerConfig {
    /// Defaults for everything but device, address, token and regions.
    pub fn new(listen: SocketAddr, token: String, regions: Vec<RegionSpec>) -> ServerConfig {
        ServerConfig {
            device: None,
            listen,
            token,
            regions,
            memory_regions: Vec::new(),
            max_connections: 64,
            max_outstanding: 16,
            max_open_per_connection: 64,
            hello_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

struct Region {
    info: RegionInfo,
    mem: Arc<SharedMemory>,
    base: u64,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region").field("info", &self.info).finish()
    }
}

#[derive(Debug)]
struct Shared {
    cfg: ServerConfig,
    ctx: Context,
    regions: Vec<Region>,
    active: AtomicUsize,
}

/// A bound server, ready to [`Server::run`].
#[derive(Debug)]
pub struct Server {
    shared: Arc<Shared>,
    listener: TcpListener,
}

/// Open the memory of every region (allocate RAM, map files).
fn build_regions(specs: &[RegionSpec], memory: &[MemoryRegionSpec]) -> Result<Vec<Region>> {
    let mut out: Vec<Region> = Vec::new();
    for m in memory {
        if out.iter().any(|r| r.info.name == m.name) {
            return Err(Error::Config(format!(
                "region name '{}' is given twice",
                m.name
            )));
        }
        match m.offset.checked_add(m.len) {
            Some(end) if m.len > 0 && end <= m.mem.len() as u64 => {}
            _ => {
                return Err(Error::Config(format!(
                    "region '{}': window {}+{} is empty or outside its {}-byte memory",
                    m.name,
                    m.offset,
                    m.len,
                    m.mem.len()
                )))
            }
        }
        let access = if m.read_only || !m.mem.writable() {
            AccessMode::ReadOnly
        } else {
            AccessMode::ReadWrite
        };
        out.push(Region {
            info: RegionInfo {
                name: m.name.clone(),
                size: m.len,
                access,
                kind: m.mem.kind().to_string(),
                path: DataPath::Direct,
            },
            mem: Arc::clone(&m.mem),
            base: m.offset,
        });
    }
    for spec in specs {
        if out.iter().any(|r| r.info.name == spec.name) {
            return Err(Error::Config(format!(
                "region name '{}' is given twice",
                spec.name
            )));
        }
        let (mem, access) = match &spec.source {
            RegionSource::Host { size, huge } => {
                let len = usize::try_from(*size)
                    .map_err(|_| Error::Config(format!("region '{}' is too large", spec.name)))?;
                (SharedMemory::anonymous(len, *huge)?, AccessMode::ReadWrite)
            }
            RegionSource::File { path, read_only } => {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(!read_only)
                    .open(path)
                    .map_err(|e| {
                        Error::io(
                            format!(
                                "region '{}': cannot open {} {}",
                                spec.name,
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
                let mem = SharedMemory::file(&file, !read_only).map_err(|e| {
                    Error::Config(format!("region '{}' ({}): {e}", spec.name, path.display()))
                })?;
                (
                    mem,
                    if *read_only {
                        AccessMode::ReadOnly
                    } else {
                        AccessMode::ReadWrite
                    },
                )
            }
        };
        out.push(Region {
            info: RegionInfo {
                name: spec.name.clone(),
                size: mem.len() as u64,
                access,
                kind: mem.kind().to_string(),
                path: DataPath::Direct,
            },
            mem: Arc::new(mem),
            base: 0,
        });
    }
    Ok(out)
}

impl Server {
    /// Open the device, build the regions, bind the listener.
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
        let ctx = Context::open(cfg.device.as_deref())?;
        let regions = build_regions(&cfg.regions, &cfg.memory_regions)?;
        // Check once, at start-up, that the device accepts the regions (registration errors are
        // reported now with their meaning, not on a client's first open).
        let pd = ProtectionDomain::new(&ctx)?;
        for r in &regions {
            register(&pd, r).map_err(|e| {
                Error::Config(format!(
                    "region '{}' cannot be registered on {}: {e}",
                    r.info.name,
                    ctx.name()
                ))
            })?;
        }
        drop(pd);
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| Error::io(format!("cannot listen on {}", cfg.listen), e))?;
        Ok(Server {
            shared: Arc::new(Shared {
                cfg,
                ctx,
                regions,
                active: AtomicUsize::new(0),
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
        self.shared.regions.iter().map(|r| r.info.clone()).collect()
    }

    /// The RDMA device in use.
    pub fn device(&self) -> &str {
        self.shared.ctx.name()
    }

    /// Serve until `shutdown` resolves; then stop accepting, tell connections to finish, wait
    /// for them (at most `drain_timeout`), and release everything.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
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
            "shutting down: no new connections; draining"
        );
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

fn register(pd: &ProtectionDomain, r: &Region) -> verbs::Result<SharedRegion> {
    let start = r.base as usize;
    pd.register_shared_range(
        &r.mem,
        start..start + r.info.size as usize,
        access_for(r.info.access),
        RegMode::Pinned,
    )
}

fn access_for(mode: AccessMode) -> Access {
    match mode {
        AccessMode::ReadOnly => Access::REMOTE_READ,
        AccessMode::ReadWrite => Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
    }
}

struct ActiveGuard<'a>(&'a AtomicUsize);
impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Per-connection RDMA state; dropping it destroys the QP, the MRs and the PD.
#[derive(Default)]
struct ConnState {
    // drop order: MRs, then the QP, then the PD
    open: HashMap<u32, (SharedRegion, usize)>,
    qp: Option<QueuePair>,
    pd: Option<ProtectionDomain>,
    next_handle: u32,
}

async fn connection(shared: Arc<Shared>, mut conn: Conn, mut stop: watch::Receiver<bool>) {
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

async fn serve_connection(
    shared: &Shared,
    conn: &mut Conn,
    stop: &mut watch::Receiver<bool>,
) -> Result<()> {
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
    if !constant_time_eq(token.as_bytes(), shared.cfg.token.as_bytes()) {
        tracing::warn!(client, "wrong token");
        let _ = conn
            .send(&Msg::error(ErrorCode::Unauthorized, "wrong token"))
            .await;
        return Err(Error::Server {
            code: ErrorCode::Unauthorized,
            message: format!("client '{client}' sent a wrong token"),
        });
    }
    tracing::info!(client, "client authenticated");
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

    // 2. requests
    let mut st = ConnState::default();
    loop {
        let msg = tokio::select! {
            m = conn.recv(None, "a request") => m,
            _ = stop.changed() => {
                let _ = conn.send(&Msg::error(ErrorCode::ShuttingDown, "the server is shutting down")).await;
                return Ok(());
            }
        };
        let msg = match msg {
            Ok(m) => m,
            Err(Error::Protocol { peer, source }) => {
                let _ = conn
                    .send(&Msg::error(ErrorCode::BadRequest, source.to_string()))
                    .await;
                return Err(Error::Protocol { peer, source });
            }
            Err(e) => return Err(e),
        };
        if matches!(msg, Msg::Bye) {
            return Ok(());
        }
        let reply = match handle(shared, &mut st, msg).await {
            Ok(r) => r,
            Err((code, message)) => {
                tracing::debug!(%code, message, "request refused");
                Msg::Error { code, message }
            }
        };
        conn.send(&reply).await?;
    }
}

type Reply = std::result::Result<Msg, (ErrorCode, String)>;

fn not_open(handle: u32) -> (ErrorCode, String) {
    (
        ErrorCode::NotOpen,
        format!("handle {handle} is not open on this connection"),
    )
}

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
            .map(|(_, idx)| *idx)
            .ok_or_else(|| not_open(handle))
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
            regions: shared.regions.iter().map(|r| r.info.clone()).collect(),
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
                    max_send_wr: 1,
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
                .position(|r| r.info.name == region)
                .ok_or_else(|| {
                    let names: Vec<&str> = shared
                        .regions
                        .iter()
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
            let pd = st.pd(&shared.ctx)?;
            let mr = register(&pd, r).map_err(internal)?;
            let handle = st.next_handle;
            st.next_handle = st.next_handle.wrapping_add(1);
            let reply = Msg::Opened {
                handle,
                info: r.info.clone(),
                addr: mr.mr().addr(),
                rkey: mr.mr().rkey(),
                len: r.info.size,
            };
            tracing::info!(region, handle, write, "region opened");
            st.open.insert(handle, (mr, idx));
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
            let mem = Arc::clone(&r.mem);
            let base = r.base;
            let crc = tokio::task::spawn_blocking(move || crc_of(&mem, base + offset, len))
                .await
                .map_err(internal)?
                .map_err(internal)?;
            Ok(Msg::ChecksumIs { crc32c: crc })
        }
        Msg::Bounce { handle, .. } => {
            let idx = st.region_index(handle)?;
            Err((
                ErrorCode::NotBounce,
                format!(
                    "region '{}' is served direct: use one-sided RDMA on its rkey",
                    shared.regions[idx].info.name
                ),
            ))
        }
        Msg::Close { handle } => match st.open.remove(&handle) {
            Some(_) => Ok(Msg::Closed { handle }),
            None => Err(not_open(handle)),
        },
        other => Err((
            ErrorCode::BadRequest,
            format!("'{}' is not a request a client may send now", other.kind()),
        )),
    }
}

/// CRC-32C of a range of shared memory, reading it in chunks.
pub fn crc_of(mem: &SharedMemory, offset: u64, len: u64) -> verbs::Result<u32> {
    let mut crc = 0u32;
    let mut buf = vec![0u8; (len as usize).min(1 << 20)];
    let mut done = 0u64;
    while done < len {
        let n = ((len - done) as usize).min(buf.len());
        mem.read_at(offset + done, &mut buf[..n])?;
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        done += n as u64;
    }
    Ok(crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_specs() {
        assert_eq!(
            "ram=host:64M".parse::<RegionSpec>().unwrap(),
            RegionSpec {
                name: "ram".into(),
                source: RegionSource::Host {
                    size: 64 << 20,
                    huge: false
                }
            }
        );
        assert_eq!(
            "h=host:2M:huge".parse::<RegionSpec>().unwrap().source,
            RegionSource::Host {
                size: 2 << 20,
                huge: true
            }
        );
        assert_eq!(
            "f=file:/data/x.bin:ro"
                .parse::<RegionSpec>()
                .unwrap()
                .source,
            RegionSource::File {
                path: "/data/x.bin".into(),
                read_only: true
            }
        );
        assert_eq!(
            "f=file:/data/a:b".parse::<RegionSpec>().unwrap().source,
            RegionSource::File {
                path: "/data/a:b".into(),
                read_only: false
            }
        );
        for (bad, why) in [
            ("ram", "no '='"),
            ("=host:1M", "must be non-empty"),
            ("a b=host:1M", "must be non-empty"),
            ("r=disk:1M", "unknown kind 'disk'"),
            ("r=host:0", "at least 1 byte"),
            ("r=host:12Q", "unknown unit"),
            ("r=file:", "empty file path"),
            ("r=host", "expected NAME=host"),
        ] {
            let e = bad.parse::<RegionSpec>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        let r = RegionInfo {
            name: "r".into(),
            size: 100,
            access: AccessMode::ReadWrite,
            kind: "host".into(),
            path: DataPath::Direct,
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
        let m = SharedMemory::anonymous(3 << 20, false).unwrap();
        let data: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        m.write_at(0, &data).unwrap();
        assert_eq!(
            crc_of(&m, 5, (3 << 20) - 9).unwrap(),
            crc32c::crc32c(&data[5..(3 << 20) - 4])
        );
        assert_eq!(crc_of(&m, 0, 0).unwrap(), 0);
    }
}
