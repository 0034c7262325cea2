//! The server: a catalog of regions served over RC QPs, one QP per connection.
//!
//! Each region's memory comes from a [`peermem::Provider`] (host RAM, a file, NVMe CMB through
//! P2PDMA, a dma-buf, device-private memory). When a region is built (at start-up, or by
//! [`ServerHandle::add_region`]) the server decides the path its bytes take
//! ([`peermem::plan::decide`]): **direct** — one-sided RDMA on an MR of the memory, with the
//! first registration strategy that a canary proves — or **bounce** — the provider's copy
//! engine plus registered host staging buffers per connection: for a fetch the client
//! RDMA-READs a chunk the server staged (`stage`), or, on a device without memory windows, the
//! server RDMA-WRITEs it; for a put the server RDMA-READs the client's buffer. A region may be direct for its
//! first `window` bytes and bounce for the rest (mixed); clients see the split in `ls`.
//! Clients without an RDMA device move bytes over the control connection instead (`tcp`).
//!
//! A region's direct part is registered once, in the server's protection domain, with no
//! remote access of its own; each open binds a memory window over it on the client's own QP
//! (`windows`), so an rkey handed to one client is useless on another client's QP and dies
//! with the handle. On a device without memory windows, or a server that serves read-only
//! memory, each connection registers what it opens in a protection domain of its own, through
//! a registration cache. A region can be removed while clients use it
//! ([`ServerHandle::remove_region`]): its windows and registrations are revoked, in-flight
//! bounce copies finish, and the memory is freed only when nothing refers to it any more.
//! Completed puts are announced on [`ServerHandle::put_notices`].
//!
//! The code is split by concern: [`config`] (settings), `regions` (the region table),
//! `windows` (one registration per region), `session` (the protocol rules of a connection,
//! sans-IO), `driver` (the connection task that feeds the session and carries out its steps),
//! `bounce` (the staging pipeline), `tcp` (the TCP data path) and `notices` (put notices).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::protocol::RegionInfo;

mod bounce;
pub mod config;
mod driver;
mod nics;
mod notices;
mod preauth;
mod regions;
mod ring_hold;
mod ring_put;
mod ring_wait;
pub(crate) mod session;
mod stage;
mod tcp;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod testkit;
mod windows;

pub use crate::spec::{RegionOptions, RegionSource, RegionSpec};
pub use config::{MemoryRegionSpec, ServerConfig, SharingPolicy};
pub use notices::{PutNotice, PUT_NOTICE_BACKLOG};
use regions::RegionTable;
pub use regions::{crc_of, RegionReport, Removal};

/// The full-access token (when not empty) and the scoped ones; none, or an empty one, is an
/// error.
fn grants_of(token: &crate::Token, scoped: &[crate::Grant]) -> Result<Vec<crate::Grant>> {
    let mut out = Vec::new();
    if !token.is_empty() {
        out.push(crate::Grant::all(token.clone()));
    }
    for g in scoped {
        if g.token.is_empty() {
            return Err(Error::Config(
                "an empty token: every token needs a secret".into(),
            ));
        }
        out.push(g.clone());
    }
    if out.is_empty() {
        return Err(Error::Config(
            "the token is empty: put a secret in the token file".into(),
        ));
    }
    Ok(out)
}

#[derive(Debug)]
struct Shared {
    cfg: ServerConfig,
    /// The RDMA devices served from, each with its protection domain (the registrations of
    /// the regions at home on it and, with memory windows, its connections' QPs and staging)
    /// and how clients reach those regions' direct parts.
    nics: nics::Nics,
    regions: RegionTable,
    /// Held while a region is added (names stay unique).
    adding: tokio::sync::Mutex<()>,
    /// Puts that completed, for the embedding application.
    notices: notices::Notices,
    active: AtomicUsize,
    /// Connections that have not said hello yet.
    preauth: preauth::PreAuth,
    removals: watch::Sender<u64>,
    /// The tokens clients may present, with their scopes (replaced by
    /// [`ServerHandle::set_grants`]).
    grants: RwLock<Vec<crate::Grant>>,
    /// Bytes of staging buffers all connections hold (bounded by `max_staging_bytes`).
    staging: std::sync::atomic::AtomicU64,
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

impl Server {
    /// Open the device, build the regions (deciding each one's path), bind the listener. A
    /// server may start with no region and add them while it runs
    /// ([`ServerHandle::add_region`]).
    pub async fn bind(cfg: ServerConfig) -> Result<Server> {
        let grants = grants_of(&cfg.token, &cfg.grants)?;
        if cfg.bounce_chunk == 0 || cfg.bounce_depth == 0 {
            return Err(Error::Config(
                "bounce chunk and depth must be at least 1".into(),
            ));
        }
        cfg.metrics.set_ready(false);
        let (regions, nics) = regions::build_regions(&cfg).await?;
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| Error::io(format!("cannot listen on {}", cfg.listen), e))?;
        cfg.metrics.regions.set(regions.live_count() as i64);
        let grants = RwLock::new(grants);
        let preauth = preauth::PreAuth::new(cfg.max_unauthenticated);
        let server = Server {
            shared: Arc::new(Shared {
                cfg,
                nics,
                regions,
                adding: tokio::sync::Mutex::new(()),
                notices: notices::Notices::default(),
                active: AtomicUsize::new(0),
                preauth,
                removals: watch::Sender::new(0),
                grants,
                staging: std::sync::atomic::AtomicU64::new(0),
            }),
            listener,
        };
        stage::prefill_slots(&server.shared);
        Ok(server)
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
            .all()
            .map(|r| RegionReport {
                info: r.info.clone(),
                attempts: r.attempts.clone(),
            })
            .collect()
    }

    /// The RDMA device in use (the first, when several).
    pub fn device(&self) -> &str {
        self.shared.nics.primary().name()
    }

    /// Every RDMA device served from, with the IPv4 address of the RoCE v2 GID its QPs use.
    pub fn devices(&self) -> Vec<(String, Option<std::net::Ipv4Addr>)> {
        self.shared
            .nics
            .iter()
            .map(|n| (n.name().to_string(), n.addr))
            .collect()
    }

    /// How clients reach the regions' direct parts, and why: one registration per region and a
    /// memory window per open, or a registration per connection (with the reason windows are
    /// not used: the device has none, or `--sharing per-connection`). Devices that differ are
    /// named.
    pub fn registration(&self) -> String {
        let n = &self.shared.nics;
        let first = n.primary().sharing.describe();
        if n.iter().all(|x| x.sharing.describe() == first) {
            return first;
        }
        n.iter()
            .map(|x| format!("{}: {}", x.name(), x.sharing.describe()))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Whether opens bind memory windows over one registration per region (on every device).
    pub fn memory_windows(&self) -> bool {
        self.shared.nics.iter().all(|n| n.sharing.windows())
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
                    // the place in the waiting room is taken here, in accept order, not in
                    // whichever order the tasks happen to start
                    let ticket = self.shared.preauth.admit();
                    let shared = Arc::clone(&self.shared);
                    let stop = stop_rx.clone();
                    let span = tracing::info_span!("conn", %peer);
                    tasks.spawn(async move { driver::connection(shared, Conn::new(stream, peer.to_string()), stop, ticket).await }.instrument(span));
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
        self.set_grants(vec![crate::Grant::all(token)])
    }

    /// Replace every token new clients may present, with their scopes (connections already
    /// authenticated keep theirs). Empty tokens, or none at all, are refused.
    pub fn set_grants(&self, grants: Vec<crate::Grant>) -> Result<()> {
        let grants = grants_of(&crate::Token::default(), &grants)?;
        let n = grants.len();
        *self
            .shared
            .grants
            .write()
            .unwrap_or_else(|p| p.into_inner()) = grants;
        tracing::info!(tokens = n, "tokens replaced");
        Ok(())
    }

    /// The server's metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.shared.cfg.metrics)
    }

    /// The regions still served.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.shared.regions.live().map(|r| r.info.clone()).collect()
    }

    /// Puts that complete from now on: region, range, client and path, for every client. A
    /// subscriber that falls more than [`PUT_NOTICE_BACKLOG`] notices behind misses some and is
    /// told how many (`RecvError::Lagged`).
    pub fn put_notices(&self) -> tokio::sync::broadcast::Receiver<PutNotice> {
        self.shared.notices.subscribe()
    }

    /// Serve one more region while running. Its memory is opened, its path decided (each
    /// registration strategy proved by a canary) and, with memory windows, its direct part
    /// registered once, all off the async workers and before any client can see it; then it
    /// is listed and may be opened. A name already served is refused.
    pub async fn add_region(&self, spec: RegionSpec) -> Result<RegionInfo> {
        let _one_at_a_time = self.shared.adding.lock().await;
        self.check_new_name(&spec.name)?;
        let (provider, read_only) = self.open_spec(&spec).await?;
        self.add(spec.name, provider, read_only, spec.options).await
    }

    /// Serve memory the embedding application owns (see [`MemoryRegionSpec`]) while running,
    /// as [`ServerHandle::add_region`] does.
    pub async fn add_memory_region(&self, m: MemoryRegionSpec) -> Result<RegionInfo> {
        let _one_at_a_time = self.shared.adding.lock().await;
        self.check_new_name(&m.name)?;
        let read_only = m.read_only || !m.provider.writable();
        self.add(m.name, m.provider, read_only, m.options).await
    }

    fn check_new_name(&self, name: &str) -> Result<()> {
        if name.is_empty() {
            return Err(Error::Config("a region needs a name".into()));
        }
        if self.shared.regions.live_named(name).is_some() {
            return Err(Error::Config(format!(
                "region '{name}' is already served: remove it first, or pick another name"
            )));
        }
        Ok(())
    }

    async fn add(
        &self,
        name: String,
        provider: Arc<dyn peermem::Provider>,
        read_only: bool,
        options: RegionOptions,
    ) -> Result<RegionInfo> {
        let r = self.build(name, provider, read_only, options).await?;
        let info = r.info.clone();
        let s = &self.shared;
        s.regions.push(r);
        s.metrics().regions.set(s.regions.live_count() as i64);
        tracing::info!(region = info.name, path = %info.path, size = info.size, "region added");
        Ok(info)
    }

    /// Open a spec's memory off the async workers.
    async fn open_spec(&self, spec: &RegionSpec) -> Result<(Arc<dyn peermem::Provider>, bool)> {
        let sysfs = self.shared.cfg.sysfs.clone();
        let (s, chunk) = (spec.clone(), self.shared.cfg.bounce_chunk as u64);
        tokio::task::spawn_blocking(move || s.open(&sysfs, chunk))
            .await
            .map_err(|e| Error::Config(format!("region '{}': opening task: {e}", spec.name)))?
    }

    /// Serve a region under the same name with other memory (a file that grew or shrank, a
    /// larger allocation), with no moment in which the name is not served: the new memory is
    /// opened, its path decided and registered, and it is listed, while the old one still
    /// serves; then the old one is revoked as [`ServerHandle::remove_region`] does (handles of
    /// it get `Removed`, and a client reopens the name to see the new size). Registered
    /// memory cannot change size in place (an MR covers fixed pages), so a resize is this.
    pub async fn replace_region(
        &self,
        spec: RegionSpec,
        timeout: Duration,
    ) -> Result<(RegionInfo, Removal)> {
        let _one_at_a_time = self.shared.adding.lock().await;
        let old = self.shared.regions.live_named(&spec.name).ok_or_else(|| {
            Error::Config(format!(
                "no region '{}' is being served: add it instead",
                spec.name
            ))
        })?;
        let (provider, read_only) = self.open_spec(&spec).await?;
        let r = self
            .build(spec.name.clone(), provider, read_only, spec.options)
            .await?;
        let info = r.info.clone();
        // listed after the old one: lookups by name find the old one until it is revoked
        self.shared.regions.push(r);
        let removal = self.retire(old, timeout).await;
        tracing::info!(region = info.name, path = %info.path, size = info.size, "region replaced");
        Ok((info, removal))
    }

    /// Decide a region's path and register it (not yet listed).
    async fn build(
        &self,
        name: String,
        provider: Arc<dyn peermem::Provider>,
        read_only: bool,
        options: RegionOptions,
    ) -> Result<regions::Region> {
        let s = &self.shared;
        // the canaries and the registration pin every page of the region: long for a large
        // one, so on a blocking thread (driving its work requests from there), not on a
        // worker that serves the connections
        let on = Arc::clone(s);
        let what = name.clone();
        tokio::task::spawn_blocking(move || {
            tokio::runtime::Handle::current().block_on(regions::build_region(
                &on.cfg, &on.nics, name, provider, read_only, options,
            ))
        })
        .await
        .map_err(|e| Error::Config(format!("region '{what}': registration task: {e}")))?
    }

    /// Stop serving a region: new opens are refused, every connection revokes its
    /// registrations of it (clients' one-sided operations on the old rkey then fail with a
    /// remote access error), in-flight bounce copies finish, and the memory is released once
    /// nothing refers to it. Waits at most `timeout` for that release.
    pub async fn remove_region(&self, name: &str, timeout: Duration) -> Result<Removal> {
        let r = self
            .shared
            .regions
            .live_named(name)
            .ok_or_else(|| Error::Config(format!("no region '{name}' is being served")))?;
        Ok(self.retire(r, timeout).await)
    }

    /// Revoke a region and wait (at most `timeout`) for its memory to be released.
    async fn retire(&self, r: &regions::Region, timeout: Duration) -> Removal {
        let start = Instant::now();
        let name = r.info.name.as_str();
        r.removed.store(true, Ordering::SeqCst);
        drop(r.provider.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(r.ring_nic.lock().unwrap_or_else(|p| p.into_inner()).take());
        if !std::mem::take(&mut *r.shared.lock().unwrap_or_else(|p| p.into_inner())).is_empty() {
            self.shared
                .metrics()
                .shared_registered_bytes
                .dec_by(r.segments.direct_len as i64);
        }
        self.shared
            .metrics()
            .regions
            .set(self.shared.regions.live_count() as i64);
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
        Removal {
            region: name.to_string(),
            released,
            seconds: start.elapsed().as_secs_f64(),
        }
    }
}

impl ServerHandle {
    /// The owner of a device-private region (`devpriv:memfd`) freed or moved the units
    /// overlapping `range`: their window mappings are revoked (waiting at most `timeout` for
    /// transfers using them), transfers planned before fail with
    /// [`ErrorCode::Invalidated`](crate::protocol::ErrorCode::Invalidated),
    /// and a freed unit is never read or written again. Returns how many window mappings were
    /// revoked.
    pub async fn invalidate(
        &self,
        name: &str,
        range: std::ops::Range<u64>,
        how: peermem::hmm::Invalidation,
        timeout: Duration,
    ) -> Result<usize> {
        let r = self
            .shared
            .regions
            .live_named(name)
            .ok_or_else(|| Error::Config(format!("no region '{name}' is being served")))?;
        let p = r.provider().map_err(|(_, m)| Error::Config(m))?;
        if peermem::hmm::DevicePrivate::of(&*p).is_none() {
            return Err(Error::Config(format!(
                "region '{name}' ({}) is not device-private memory: its owner cannot invalidate units",
                p.kind()
            )));
        }
        // waiting for the transfers that use the units blocks: not on the runtime's workers
        let units = range.clone();
        let res = tokio::task::spawn_blocking(move || {
            let d = peermem::hmm::DevicePrivate::of(&*p).expect("checked above");
            d.invalidate(units, how, timeout)
        })
        .await
        .map_err(|e| Error::Config(format!("region '{name}': invalidation task: {e}")))?;
        let n = res.map_err(|e| {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Msg, VERSION};

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
}
