//! What a server is told: its settings and the regions over memory the application provides.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use peermem::plan::{P2pPolicy, RegChoice};
use peermem::regcache::Limits;
use peermem::{HostMemory, Provider};
use verbs::SharedMemory;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::spec::{RegionOptions, RegionSpec};

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

/// How clients get access to the regions' direct parts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SharingPolicy {
    /// One registration per region and a memory window per open, where the device proves
    /// windows at start (else per connection, said in the log). Read-only memory that would be
    /// registered (a `file:...:ro` mapping, a read-only dma-buf) cannot carry windows (an
    /// `MW_BIND` MR is pinned for writing), so such a region goes through bounce buffers and
    /// every other region keeps its windows.
    #[default]
    Auto,
    /// Each connection registers what it opens, in a protection domain of its own: read-only
    /// memory goes direct too, but every open pins and registers (its cost grows with the
    /// region's size) and bounce fetches are written by the server instead of staged.
    PerConnection,
}

impl std::str::FromStr for SharingPolicy {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(SharingPolicy::Auto),
            "per-connection" => Ok(SharingPolicy::PerConnection),
            _ => Err(format!("'{s}': want auto or per-connection")),
        }
    }
}

impl std::fmt::Display for SharingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SharingPolicy::Auto => "auto",
            SharingPolicy::PerConnection => "per-connection",
        })
    }
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// RDMA device (None: first active).
    pub device: Option<String>,
    /// More RDMA devices to serve from, after `device`: each region's direct part is then
    /// registered on the one the topology ranks best for its memory (see
    /// [`RegionInfo::nic`](crate::protocol::RegionInfo::nic)).
    pub more_devices: Vec<String>,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The shared secret that grants every region (may be empty when `grants` has some).
    pub token: crate::Token,
    /// More tokens, each with its scope (some regions, for reading or writing).
    pub grants: Vec<crate::Grant>,
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
    /// How long an authenticated connection may stay silent on its control connection with
    /// nothing in flight before it is closed (its handles and registrations released).
    /// One-sided transfers end with a report, so a working client is never idle this long.
    pub idle_timeout: Duration,
    /// How long a client may hold a chunk lent from a slot of a region's CMB ring while other
    /// connections want the ring's slots: past it, the chunk's window is revoked and the slot
    /// goes back to the ring (the client's READ of it, if it still comes, fails). A client
    /// reads a lent chunk as soon as it is lent, so only a client that stopped reading holds
    /// one this long.
    pub ring_hold: Duration,
    /// How long a reply may wait for a client that stopped reading before the connection is
    /// closed (a full socket buffer must not hold a connection's resources forever).
    pub send_timeout: Duration,
    /// Bytes of pinned staging buffers all connections together may hold; a bounce request
    /// that would need more waits for one of its own connection's buffers, or is refused with
    /// `busy` when the connection has none in flight.
    pub max_staging_bytes: u64,
    /// P2P policy for regions that do not set their own.
    pub p2p: P2pPolicy,
    /// Registration strategies for regions that do not set their own.
    pub reg: RegChoice,
    /// Memory windows over one registration per region, or a registration per connection.
    pub sharing: SharingPolicy,
    /// Bytes per staging buffer of the bounce path (the largest bounce request).
    pub bounce_chunk: usize,
    /// Staging buffers per connection (bounce copies and RDMA in flight at once).
    pub bounce_depth: usize,
    /// Registration cache limits, per connection.
    pub cache: Limits,
    /// sysfs root (for CMB devices).
    pub sysfs: PathBuf,
    /// GID, traffic class and service level of the connections' QPs.
    pub qp_path: crate::QpPath,
    /// Where the server counts what it does (share it with a [`crate::http::MetricsServer`]).
    pub metrics: Arc<Metrics>,
}

impl ServerConfig {
    /// Every device named, `device` first (empty: the first active one).
    pub(super) fn device_names(&self) -> Vec<String> {
        self.device
            .iter()
            .chain(&self.more_devices)
            .cloned()
            .collect()
    }

    /// The bounce chunk a server cuts staged transfers at unless told otherwise (1 MiB).
    pub const DEFAULT_BOUNCE_CHUNK: usize = 1 << 20;

    /// Defaults for everything but device, address, token and regions.
    pub fn new(
        listen: SocketAddr,
        token: impl Into<crate::Token>,
        regions: Vec<RegionSpec>,
    ) -> ServerConfig {
        ServerConfig {
            device: None,
            more_devices: Vec::new(),
            listen,
            token: token.into(),
            grants: Vec::new(),
            regions,
            memory_regions: Vec::new(),
            max_connections: 64,
            max_unauthenticated: 256,
            max_outstanding: 16,
            max_open_per_connection: 64,
            hello_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
            send_timeout: Duration::from_secs(30),
            ring_hold: Duration::from_secs(30),
            max_staging_bytes: 1 << 30,
            p2p: P2pPolicy::Preferred,
            reg: RegChoice::Auto,
            sharing: SharingPolicy::Auto,
            bounce_chunk: Self::DEFAULT_BOUNCE_CHUNK,
            bounce_depth: 8,
            cache: Limits::default(),
            sysfs: PathBuf::from("/sys"),
            qp_path: crate::QpPath::default(),
            metrics: Arc::new(Metrics::new()),
        }
    }
}
