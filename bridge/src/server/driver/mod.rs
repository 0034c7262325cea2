//! The connection task: reads frames, asks the [`Session`] what they mean, and carries out its
//! steps with sockets and verbs (the QP, registrations, the bounce pipeline, checksums).
//!
//! Bounce requests are pipelined (several in flight); every reply goes out in request order,
//! so a request of another kind first waits for the bounces before it.

mod access;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use peermem::canary::DeviceMr;
use peermem::regcache::RegCache;
use tokio::sync::watch;
use verbs::{ProtectionDomain, QpOptions, QueuePair, RegisteredBuffer};

use super::bounce::{on_memory, InFlight};
use super::preauth;
use super::regions::crc_of;
use super::session::{self, Catalog, HelloFault, Refusal, Rules, Session, Step, MAX_STAGED};
use super::stage::may_hold;
use super::Shared;
use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::metrics::{Direction, Metrics, XferPath};
use crate::protocol::{ErrorCode, Msg, VERSION};
use crate::token::Scope;
use access::HandleMr;

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

/// Per-connection state; dropping it destroys the MRs, the QP and the PD.
pub(super) struct ConnState {
    // drop order: the session (its handles' leases), in-flight bounces, cache, staging ring,
    // QP, PD
    pub(super) session: Session<HandleMr>,
    pub(super) inflight: VecDeque<InFlight>,
    /// Keyed by (region index, writable): an open for reading gets an MR without remote write.
    cache: Option<RegCache<(usize, bool, usize), DeviceMr>>,
    pub(super) ring: Vec<RegisteredBuffer>,
    /// Staging slots of staged fetches, by slot number.
    pub(super) pulls: Vec<super::stage::PullSlot>,
    /// Chunks lent from a region's CMB ring, by staging slot number, until the client
    /// releases the slot (their windows are revoked then).
    pub(super) lent: HashMap<u32, super::stage::LentChunk>,
    /// MRs of device-private window mappings, by the mapping's address (the MR holds the
    /// mapping, so the address is not reused while the entry exists). Entries whose mapping the
    /// region gave up (evicted or invalidated: the MR holds the last reference) are dropped.
    pub(super) window_mrs: HashMap<usize, Arc<DeviceMr>>,
    pub(super) qp: Option<QueuePair>,
    pd: Option<ProtectionDomain>,
    /// The cache's counters as last added to the metrics.
    cache_seen: peermem::regcache::Stats,
    /// Bytes of staging buffers this connection allocated (for the metrics).
    pub(super) staging_bytes: u64,
    /// Who: the hello's client name and the peer address (for put notices).
    pub(super) client: String,
    /// Our address on the control connection (the QP prefers the GID that carries it).
    local_ip: Option<std::net::IpAddr>,
    /// The server device of this connection's QP and staging (an index into its devices):
    /// the one carrying the control connection's address until the client's connect names one.
    pub(super) nic: usize,
    /// This connection's place in ring queues.
    pub(super) id: u64,
    /// `Stage`s waiting for a ring slot, in request order.
    pub(super) parking: super::ring_wait::Parking,
}

/// Run `f`, which may block for long (a registration pins every page of a region), without
/// stalling the other connections: on a multi-threaded runtime the worker hands its other
/// tasks to another thread first. (A current-thread runtime has no other thread to hand
/// them to: there `f` just runs.)
pub(super) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

pub(super) fn internal(e: impl std::fmt::Display) -> Refusal {
    (ErrorCode::Internal, e.to_string())
}

/// Serves one connection. `ticket` is its place in the pre-hello waiting room, taken by the
/// accept loop so that "oldest" means first accepted; `evicted` says whether taking it closed
/// the oldest waiting connection.
pub(super) async fn connection(
    shared: Arc<Shared>,
    mut conn: Conn,
    mut stop: watch::Receiver<bool>,
    (mut ticket, evicted): (preauth::Ticket, bool),
) {
    let m = shared.metrics();
    m.connections_accepted.inc();
    m.connections.inc();
    let _gauge = GaugeGuard(&m.connections);
    // Before the hello, a connection holds a place in a waiting room of its own, not an
    // authenticated client's slot: sockets that never say hello cannot lock real clients out.
    // When the room is full, the oldest waiting socket is closed (without a byte in reply).
    m.unauthenticated.set(shared.preauth.waiting() as i64);
    if evicted {
        m.preauth_evictions.inc();
        tracing::warn!(
            limit = shared.cfg.max_unauthenticated,
            "too many connections have not said hello: closed the oldest"
        );
    }
    conn.set_max_frame(crate::protocol::MAX_HELLO_FRAME);
    conn.set_send_timeout(shared.cfg.send_timeout);
    let hello = tokio::select! {
        h = authenticate(&shared, &mut conn) => h,
        _ = &mut ticket.evicted => {
            tracing::info!("connection closed before its hello: a newer one took its place");
            drop(ticket);
            m.unauthenticated.set(shared.preauth.waiting() as i64);
            return;
        }
    };
    drop(ticket);
    m.unauthenticated.set(shared.preauth.waiting() as i64);
    let (client, scope) = match hello {
        Ok(x) => x,
        Err(e) => {
            tracing::info!(error = %e, "connection refused before authentication");
            conn.shutdown().await;
            return;
        }
    };
    conn.set_max_frame(crate::protocol::MAX_FRAME);
    let n = shared.active.fetch_add(1, Ordering::SeqCst) + 1;
    let _guard = ActiveGuard(&shared.active);
    if n > shared.cfg.max_connections {
        tracing::warn!(
            limit = shared.cfg.max_connections,
            "connection refused: limit reached"
        );
        shared.metrics().error(&ErrorCode::Busy.to_string());
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
    let client = format!("{client}@{}", conn.peer);
    match serve_connection(&shared, &mut conn, &mut stop, scope, client).await {
        Ok(()) => tracing::info!("connection closed"),
        Err(e) => tracing::info!(error = %e, "connection ended"),
    }
    conn.shutdown().await;
}

/// The hello: version and token. Nothing about a region is said before it succeeds.
async fn authenticate(shared: &Shared, conn: &mut Conn) -> Result<(String, Scope)> {
    let msg = match conn.recv(Some(shared.cfg.hello_timeout), "hello").await {
        Ok(m) => m,
        Err(e) => {
            if let Error::Protocol { source, .. } = &e {
                let _ = conn
                    .send(&Msg::error(ErrorCode::BadRequest, source.to_string()))
                    .await;
            }
            return Err(e);
        }
    };
    let checked = {
        let grants = shared.grants.read().unwrap_or_else(|p| p.into_inner());
        session::check_hello(msg, &grants)
    };
    let refused = match checked {
        Ok((client, scope)) => {
            tracing::info!(client, ?scope, "client authenticated");
            return Ok((client, scope));
        }
        Err(r) => r,
    };
    let _ = conn.send(&Msg::error(refused.code, &refused.message)).await;
    Err(match refused.fault {
        HelloFault::NotHello(got) => Error::Unexpected {
            peer: conn.peer.clone(),
            got,
            want: "hello",
        },
        HelloFault::Version(theirs) => Error::Version {
            peer: conn.peer.clone(),
            theirs,
            ours: VERSION,
        },
        HelloFault::Token(client) => {
            tracing::warn!(client, "wrong token");
            shared.metrics().auth_failures.inc();
            shared.metrics().error(&ErrorCode::Unauthorized.to_string());
            Error::Server {
                code: ErrorCode::Unauthorized,
                message: format!("client '{client}' sent a wrong token"),
            }
        }
    })
}

async fn serve_connection(
    shared: &Shared,
    conn: &mut Conn,
    stop: &mut watch::Receiver<bool>,
    scope: Scope,
    client: String,
) -> Result<()> {
    conn.send(&Msg::Welcome {
        version: VERSION,
        server: format!(
            "p2p-rdma {} on {}",
            env!("CARGO_PKG_VERSION"),
            shared.nics.primary().name()
        ),
        max_outstanding: shared.cfg.max_outstanding,
        nics: shared.nics.announce(),
    })
    .await?;

    let mut st = ConnState::new(
        Rules {
            max_open: shared.cfg.max_open_per_connection,
            bounce_chunk: shared.cfg.bounce_chunk as u64,
            pull_depth: shared.cfg.bounce_depth.min(MAX_STAGED as usize) as u32,
        },
        scope,
        client,
    );
    st.local_ip = conn.local_ip;
    st.nic = shared
        .nics
        .for_connection(None, conn.local_ip)
        .unwrap_or_default();
    let mut removals = shared.removals.subscribe();
    removals.borrow_and_update();
    let m = shared.metrics();
    let mut stopping = false;
    let result = 'conn: loop {
        // draining (the server is stopping): a client with nothing open is told and let go; one
        // with open handles finishes its transfers (new opens are refused) until it closes them
        if st.session.may_leave() && st.inflight.is_empty() {
            let reply = Msg::error(ErrorCode::ShuttingDown, "the server is shutting down");
            count_reply(m, &reply);
            let _ = conn.send(&reply).await;
            break Ok(());
        }
        // replies held back for their batch go out before we wait for the client
        if conn.deferred_len() > 0 && !conn.next_is_here() {
            if let Err(e) = conn.send_deferred().await {
                break Err(e);
            }
        }
        // silent with nothing in flight: idle; a bounce in flight answers on its own
        let idle = st.inflight.is_empty().then_some(shared.cfg.idle_timeout);
        let hold_look = st.next_hold_look();
        let msg = tokio::select! {
            biased;
            _ = stop.changed(), if !stopping => {
                stopping = true;
                st.session.drain();
                continue;
            }
            _ = removals.changed() => {
                st.revoke_removed(shared);
                st.sync_metrics(m, false);
                continue;
            }
            done = super::bounce::next_done(&mut st.inflight) => {
                let f = st.inflight.pop_front().expect("a bounce was in flight");
                let reply = st.complete(shared, f, done);
                if let Err(e) = conn.send(&reply).await {
                    break Err(e);
                }
                continue;
            }
            _ = st.parking.wake(), if st.parking.any() => {
                // a ring slot came back, or a parked chunk waited its limit
                for reply in st.resume(shared).await {
                    if let Err(e) = answer(conn, st.session.staged_count(), m, &reply).await {
                        break 'conn Err(e);
                    }
                }
                continue;
            }
            _ = ConnState::hold_look(hold_look) => {
                // a ring slot the client held past the limit: back to the ring if wanted
                st.take_back_held(shared);
                continue;
            }
            m = conn.recv(idle, "a request (idle timeout)") => m,
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
        let step = st.session.step(msg, &shared.regions);
        if st.parking.any() && replies_after(&step) {
            // its reply comes after the parked chunks' ones: they wait no more
            for reply in st.flush_parked(shared).await {
                if let Err(e) = answer(conn, st.session.staged_count(), m, &reply).await {
                    break 'conn Err(e);
                }
            }
        }
        let reply = match step {
            Step::Leave => break st.drain(shared, conn).await,
            Step::Ignore => continue,
            Step::Report {
                region,
                offset,
                len,
                to_region,
                micros,
            } => {
                if to_region {
                    shared.notices.put(crate::server::PutNotice {
                        region: shared.regions.info(region).name.clone(),
                        offset,
                        len,
                        client: st.client.clone(),
                        path: crate::protocol::DataPath::Direct,
                    });
                }
                let dir = Direction::of(to_region);
                m.transfer(
                    &shared.regions.info(region).name,
                    dir,
                    XferPath::direct,
                    len,
                );
                m.observe(dir, XferPath::direct, micros as f64 / 1e6);
                continue;
            }
            Step::Bounce(req) => match st.start_bounce(shared, conn, req).await {
                Err(e) => break Err(e),
                Ok(Ok(())) => continue,
                Ok(Err((code, message))) => {
                    tracing::debug!(%code, message, "bounce refused");
                    Msg::Error { code, message }
                }
            },
            Step::Unstage(slot) => {
                // the session marked the slot free; its window stays bound for the next chunk,
                // but a chunk lent from a CMB ring goes back: its window is revoked first
                st.lent.remove(&slot);
                tracing::trace!(slot, "staging slot released");
                continue;
            }
            Step::Stage {
                region,
                offset,
                len,
                slot,
            } => {
                // replies go out in request order: the bounces in flight answer first
                if let Err(e) = st.drain(shared, conn).await {
                    break Err(e);
                }
                let arrived = tokio::time::Instant::now();
                let p = super::ring_wait::Parked {
                    region,
                    offset,
                    len,
                    slot,
                    arrived,
                };
                match st.stage_or_park(shared, p).await {
                    Some(reply) => reply,
                    None => continue,
                }
            }
            step @ (Step::TcpRead { .. } | Step::TcpWrite { .. } | Step::Skip { .. }) => {
                if let Err(e) = st.drain(shared, conn).await {
                    break Err(e);
                }
                match super::tcp::serve(shared, &st.client, conn, step).await {
                    Ok(Some(reply)) => reply,
                    Ok(None) => continue,
                    Err(e) => break Err(e),
                }
            }
            other => {
                if let Err(e) = st.drain(shared, conn).await {
                    break Err(e);
                }
                st.execute(shared, other)
                    .await
                    .unwrap_or_else(|(code, message)| {
                        tracing::debug!(%code, message, "request refused");
                        Msg::Error { code, message }
                    })
            }
        };
        if let Err(e) = st.drain(shared, conn).await {
            break Err(e);
        }
        let set_up = matches!(
            reply,
            Msg::Connected { .. }
                | Msg::Opened {
                    pull_depth: 1..,
                    ..
                }
        );
        // (a reply held for its batch is a `Staged` one, never a set-up reply)
        if let Err(e) = answer(conn, st.session.staged_count(), m, &reply).await {
            break Err(e);
        }
        // the client now sets up its side (its QP, its buffers): meanwhile, the window of the
        // slot its first staged chunk will take, unless its next request is already here
        if set_up && !conn.next_is_here() {
            st.prepare_first_slot(shared).await;
        }
    };
    m.open_handles.dec_by(st.session.open_count() as i64);
    st.release_slots(shared);
    shared
        .staging
        .fetch_sub(st.staging_bytes, std::sync::atomic::Ordering::SeqCst);
    st.sync_metrics(m, true);
    result
}

/// Whether a request's reply (or what it does) comes after those of the `Stage`s before it.
fn replies_after<T>(step: &Step<T>) -> bool {
    !matches!(
        step,
        Step::Stage { .. } | Step::Unstage(_) | Step::Ignore | Step::Report { .. } | Step::Leave
    )
}

/// Send a reply, counted by its code, or hold it for its batch where it may wait (see
/// `may_hold`; `held`: the staged chunks the client holds) and the client's next request is
/// here.
async fn answer(conn: &mut Conn, held: u32, m: &Metrics, reply: &Msg) -> Result<()> {
    count_reply(m, reply);
    if may_hold(reply, held, conn.deferred_len()) && conn.next_is_here() {
        conn.defer(reply);
        return Ok(());
    }
    conn.send(reply).await
}

/// Count an error reply by its code.
pub(super) fn count_reply(m: &Metrics, reply: &Msg) {
    if let Msg::Error { code, .. } = reply {
        m.error(&code.to_string());
    }
}

impl ConnState {
    fn new(rules: Rules, scope: Scope, client: String) -> ConnState {
        let id = super::ring_wait::next_conn_id();
        ConnState {
            id,
            parking: super::ring_wait::Parking::new(id),
            client,
            local_ip: None,
            session: Session::new(rules, scope),
            inflight: VecDeque::new(),
            cache: None,
            ring: Vec::new(),
            pulls: Vec::new(),
            lent: HashMap::new(),
            window_mrs: HashMap::new(),
            qp: None,
            pd: None,
            nic: 0,
            cache_seen: Default::default(),
            staging_bytes: 0,
        }
    }

    /// The connection's protection domain, on its device, created on first use: with memory
    /// windows, the device's own (the regions at home there are registered in it once);
    /// otherwise one of the connection's own.
    pub(super) fn pd(&mut self, shared: &Shared) -> std::result::Result<ProtectionDomain, Refusal> {
        if let Some(pd) = &self.pd {
            return Ok(pd.clone());
        }
        let nic = shared.nics.get(self.nic);
        let pd = if nic.sharing.windows() {
            nic.pd.clone()
        } else {
            ProtectionDomain::new(&nic.ctx).map_err(internal)?
        };
        self.pd = Some(pd.clone());
        Ok(pd)
    }

    /// Drop this connection's registrations of removed regions, and its MRs of window mappings
    /// that were evicted or invalidated.
    fn revoke_removed(&mut self, shared: &Shared) {
        self.sweep_window_mrs();
        let gone = |idx: &usize| shared.regions.is_removed(*idx);
        // chunks lent from a removed region's CMB ring: their windows are revoked
        self.lent.retain(|_, c| !gone(&c.region));
        for (handle, region, lease) in self.session.payloads_mut() {
            if gone(&region) && lease.take().is_some() {
                tracing::info!(
                    handle,
                    region = shared.regions.info(region).name,
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

    /// Carry out a step that replies (the bounces before it have been answered).
    async fn execute(
        &mut self,
        shared: &Shared,
        step: Step<HandleMr>,
    ) -> std::result::Result<Msg, Refusal> {
        match step {
            Step::Reply(m) => Ok(m),
            Step::List => Ok(Msg::Regions {
                regions: shared
                    .regions
                    .listing()
                    .into_iter()
                    .filter(|r| self.session.scope().sees(&r.name))
                    .collect(),
            }),
            Step::Connect(endpoint, nic) => self.connect(shared, endpoint, nic.as_deref()),
            Step::Open {
                region,
                writable,
                first,
            } => {
                let r = shared.regions.get(region);
                // the region's MRs (and windows over them) live on its own device: a QP on
                // another one reaches it through bounce buffers only (a region without a
                // direct part is the same from every device)
                let home = r.nic == self.nic || r.segments.direct_len == 0;
                let lease = if home {
                    self.register(shared, region, writable).await?
                } else {
                    None
                };
                let mut segments = lease
                    .as_ref()
                    .map_or_else(Vec::new, |k| k.remote(r.segments));
                // the first segment (what the rkey covers: nothing without one); the list
                // only when there is more than one
                let (addr, rkey, len) = segments
                    .first()
                    .map_or((0, 0, 0), |s| (s.addr, s.rkey, s.len));
                if segments.len() == 1 {
                    segments.clear();
                }
                // a handle without a key has no one-sided part: its bounce requests may cover
                // every byte
                let direct_len = if lease.is_some() {
                    r.segments.direct_len
                } else {
                    0
                };
                // bounce fetches are staged for the client to read when this connection's
                // device binds windows (they keep the staging private to its QP); a
                // device-private region whose window units move zero-copy keeps the server's
                // WRITEs
                let pull = shared.nics.get(self.nic).sharing.windows() && r.window_mode.is_none();
                let handle = self
                    .session
                    .opened(region, writable, direct_len, pull, lease);
                shared.metrics().open_handles.inc();
                self.sync_metrics(shared.metrics(), false);
                tracing::info!(region = r.info.name, handle, writable, path = %r.info.path, "region opened");
                let info = if home {
                    r.info.clone()
                } else {
                    super::nics::elsewhere(&r.info, shared.nics.get(self.nic).name())
                };
                let piece_align = self.piece_align_for(shared, region);
                let first = match first {
                    Some(span) => {
                        self.stage_first(shared, handle, span, &info, piece_align.into())
                            .await
                    }
                    None => None,
                };
                Ok(Msg::Opened {
                    handle,
                    info,
                    addr,
                    rkey,
                    len,
                    bounce_chunk: shared.cfg.bounce_chunk as u64,
                    piece_align,
                    segments,
                    pull_depth: if pull {
                        self.pull_depth_for(shared, region)
                    } else {
                        0
                    },
                    first,
                })
            }
            Step::Checksum {
                region,
                offset,
                len,
            } => {
                let crc = on_memory(
                    shared,
                    region,
                    || format!("checksum of {len} bytes at {offset}"),
                    move |p| crc_of(p, offset, len),
                )
                .await?;
                Ok(Msg::ChecksumIs { crc32c: crc })
            }
            Step::Flush {
                region,
                offset,
                len,
            } => {
                on_memory(
                    shared,
                    region,
                    || format!("making {len} bytes at {offset} durable"),
                    move |p| p.sync(offset, len),
                )
                .await?;
                shared.metrics().flush(&shared.regions.info(region).name);
                Ok(Msg::Flushed { len })
            }
            Step::Close {
                handle,
                region,
                payload,
                last,
            } => {
                shared.metrics().open_handles.dec();
                drop(payload);
                // the rkey dies with the handle: once no other handle of this connection uses
                // the region, its registration goes (no lease is left, so at once), before
                // the client hears Closed
                if last {
                    if let Some(c) = &self.cache {
                        if let Err(e) = c.invalidate(|k| k.0 == region, Duration::from_secs(1)) {
                            tracing::warn!(error = %e, "a closed region's registration is still in use");
                        }
                    }
                    self.sync_metrics(shared.metrics(), false);
                }
                Ok(Msg::Closed { handle })
            }
            Step::Bounce(_)
            | Step::Stage { .. }
            | Step::Unstage(_)
            | Step::Report { .. }
            | Step::TcpRead { .. }
            | Step::TcpWrite { .. }
            | Step::Skip { .. }
            | Step::Ignore
            | Step::Leave => Err(internal("a step without a reply reached the reply path")),
        }
    }

    fn connect(
        &mut self,
        shared: &Shared,
        endpoint: crate::protocol::WireEndpoint,
        nic: Option<&str>,
    ) -> std::result::Result<Msg, Refusal> {
        let want = shared.nics.for_connection(nic, self.local_ip)?;
        if want != self.nic {
            if self.pd.is_some() {
                return Err((
                    ErrorCode::BadRequest,
                    format!(
                        "this connection already holds memory on {}: connect the QP on {} \
                         before opening regions",
                        shared.nics.get(self.nic).name(),
                        shared.nics.get(want).name()
                    ),
                ));
            }
            self.nic = want;
        }
        let here = shared.nics.get(self.nic);
        // the GID that carries the control connection's address, when it is on this device;
        // else the device's own choice
        let local_ip = self
            .local_ip
            .filter(|ip| here.addr.map(std::net::IpAddr::V4) == Some(*ip))
            .or(here.addr.map(std::net::IpAddr::V4));
        let pd = self.pd(shared)?;
        let qp = QueuePair::new(
            &pd,
            shared.cfg.qp_path.apply(
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
                    memory_windows: here.sharing.windows(),
                    ..QpOptions::default()
                },
                local_ip,
            ),
        )
        .map_err(internal)?;
        let remote = verbs::Endpoint::from(endpoint);
        qp.connect(&remote).map_err(internal)?;
        let ep = qp.endpoint();
        tracing::info!(
            qpn = qp.qpn(),
            remote_qpn = remote.qpn,
            device = here.name(),
            "QP connected"
        );
        self.qp = Some(qp);
        self.session.connected();
        Ok(Msg::Connected {
            endpoint: ep.into(),
            nic: (shared.nics.len() > 1).then(|| here.name().to_string()),
        })
    }

    /// Add what the registration cache did since the last call to the metrics; `closing`:
    /// the connection ends, so its registrations and staging buffers go away.
    pub(super) fn sync_metrics(&mut self, m: &Metrics, closing: bool) {
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
