//! The client's RDMA state: its QP (created on the first transfer, and connected to one of the
//! server's), the staging buffers registered on it, and whether a failed transfer left the QP
//! in the error state. A transfer takes it out of the client and puts it back. A reconnect
//! keeps the protection domain and what is registered on it for the next QP.

use std::sync::atomic::{AtomicU64, Ordering};

use verbs::{ProtectionDomain, QpOptions, QueuePair, RegisteredBuffer};

use super::{reply_err, Client};
use crate::error::{Error, Result};
use crate::protocol::{DataPath, Msg};
use crate::staging::{Pools, Use};

/// A client's RDMA state: its QP and the staging buffers registered on it.
pub(super) struct Rdma {
    // drop order: staging buffers, then the QP (which holds the PD)
    pub(super) pools: Pools,
    pub(super) qp: QueuePair,
    /// The QP's inline room: puts of at most this many bytes into a direct extent go inline.
    pub(super) inline: u32,
    /// Why the QP is in the error state, once a transfer that failed left it there: later
    /// transfers are refused with it ([`Error::QpDown`]) instead of being flushed.
    pub(super) down: Option<String>,
}

/// What outlives a connection: the protection domain, and the staging buffers registered on
/// it (the client's own buffers, [`Client::buffer`], hold the domain too).
pub(super) struct Kept {
    // drop order: staging buffers, then the PD
    pools: Pools,
    pd: ProtectionDomain,
}

/// A number for a new connection, unique in this process ([`Client::connection`]).
pub(super) fn next_connection() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Rdma {
    /// A staging buffer for a piece on `path`, moving data to the region or from it.
    pub(super) fn take(
        &mut self,
        path: DataPath,
        to_region: bool,
        chunk: usize,
    ) -> Result<RegisteredBuffer> {
        let u = match (path, to_region) {
            (DataPath::Direct, _) => Use::Direct,
            (_, false) => Use::BounceIn,
            (_, true) => Use::BounceOut,
        };
        self.pools.take(u, self.qp.pd(), chunk)
    }
}

impl Client {
    pub(super) fn depth(&self) -> usize {
        self.cfg.depth.min(self.max_outstanding.max(1) as usize)
    }

    /// Take the RDMA state out of `self` so that it and the control connection can be used
    /// together ([`Client::put_back`] returns it). The first call creates our QP and has the
    /// server connect its own to it. `region`: what is about to be opened (on a server with
    /// several devices, the QP goes to the one that serves it). No staging buffer is
    /// registered here: a client that moves bytes only from and into its own registered
    /// buffers (zero-copy) never pins any.
    pub(super) async fn take_rdma(&mut self, region: Option<&str>) -> Result<Rdma> {
        let depth = self.depth();
        let rdma = match self.rdma.take() {
            Some(r) => {
                if let Some(cause) = &r.down {
                    let e = Error::QpDown {
                        qpn: r.qp.qpn(),
                        cause: cause.clone(),
                    };
                    self.rdma = Some(r);
                    return Err(e);
                }
                r
            }
            None => {
                let nic = self.nic_for(region).await?;
                // after a reconnect: the device of the last QP, unless the route says another
                if let (None, Some(k)) = (&self.device, &self.kept) {
                    self.device = Some(k.pd.context().clone());
                }
                let (ctx, local_ip) = self.local_side(nic.as_deref())?;
                // after a reconnect, the QP goes on the domain of the last one: what was
                // registered on it stays usable
                let (pd, pools) = match self.kept.take() {
                    Some(k) if k.pd.context().name() == ctx.name() => (k.pd, k.pools),
                    Some(k) => {
                        tracing::warn!(
                            before = k.pd.context().name(),
                            now = ctx.name(),
                            "the new connection's QP is on another device than the last one's: \
                             buffers registered before the reconnect cannot be used on it"
                        );
                        (ProtectionDomain::new(&ctx)?, Pools::default())
                    }
                    None => (ProtectionDomain::new(&ctx)?, Pools::default()),
                };
                let opts = |inline| {
                    self.cfg.qp_path.apply(
                        QpOptions {
                            max_send_wr: depth as u32,
                            max_recv_wr: 1,
                            max_rd_atomic: depth.min(255) as u8,
                            max_inline_data: inline,
                            ..QpOptions::default()
                        },
                        local_ip,
                    )
                };
                let (qp, inline) = match QueuePair::new(&pd, opts(self.cfg.inline)) {
                    Ok(qp) => (qp, self.cfg.inline),
                    Err(e) if self.cfg.inline > 0 => {
                        // a QP without inline room that works shows the room was the cause
                        let qp = QueuePair::new(&pd, opts(0))?;
                        tracing::info!(
                            inline = self.cfg.inline,
                            error = %e,
                            "the device refused a QP with inline room; small puts go from \
                             registered buffers"
                        );
                        (qp, 0)
                    }
                    Err(e) => return Err(e.into()),
                };
                let ep = qp.endpoint();
                let m = Msg::Connect {
                    endpoint: ep.into(),
                    nic,
                };
                let remote = match self.request(&m, "connected").await? {
                    Msg::Connected { endpoint, nic } => {
                        self.qp_nic = nic;
                        verbs::Endpoint::from(endpoint)
                    }
                    other => return Err(reply_err(&self.conn.peer, other, "connected")),
                };
                qp.connect(&remote)?;
                Rdma {
                    pools,
                    qp,
                    inline,
                    down: None,
                }
            }
        };
        Ok(rdma)
    }

    /// [`Client::take_rdma`] for a transfer of `len` bytes through staging buffers (`fetch`,
    /// `put`): one direct-path buffer per slot the transfer can have in flight (its chunks, at
    /// most the depth), ready before the transfer starts (an earlier
    /// transfer that stalled or failed may have left some with the CQ); the bounce path's
    /// (remotely writable or readable, see crate::staging) are registered when first needed.
    pub(super) async fn take_staged_rdma(&mut self, len: u64) -> Result<Rdma> {
        let mut rdma = self.take_rdma(None).await?;
        // no more than the transfer can use at once: 32 clients of 2 MiB fetches each in a
        // 1 GiB host must not pin 16 MiB apiece
        let chunk = self.cfg.chunk.max(1) as u64;
        let n = len.div_ceil(chunk).min(self.depth() as u64) as usize;
        if let Err(e) = rdma.pools.prefill(rdma.qp.pd(), self.cfg.chunk, n) {
            self.rdma = Some(rdma);
            return Err(e);
        }
        Ok(rdma)
    }

    /// Connect again to the same server with the same configuration: a new control connection,
    /// and with the next transfer (or open) a new QP. Use it after [`Error::QpDown`], or when
    /// the control connection broke (the server restarted, a link went down).
    ///
    /// What this client registered survives: the new QP is created on the same protection
    /// domain (on the same device), so buffers from [`Client::buffer`] and the staging
    /// buffers stay registered and usable, with no registration cost. The regions open on the
    /// old connection went with it (the server revokes a connection's windows and releases its
    /// lent chunks when it ends): handles from before are refused here, so open the regions
    /// again. A transfer in flight on the old connection is not resumed: what did not complete
    /// is moved again by the caller ([`Client::fetch`]'s progress count says where a fetch
    /// into a sink stopped).
    ///
    /// On error the client is unchanged (its old connection, possibly dead, stays): call it
    /// again later.
    pub async fn reconnect(&mut self) -> Result<()> {
        let mut fresh = Client::connect(self.cfg.clone()).await?;
        fresh.kept = match self.rdma.take() {
            Some(r) => Some(Kept {
                pd: r.qp.pd().clone(),
                pools: r.pools,
            }),
            None => self.kept.take(),
        };
        fresh.device = self.device.take();
        let old = std::mem::replace(self, fresh);
        tracing::info!(
            server = self.server,
            before = old.connection,
            now = self.connection,
            handles = old.open.len(),
            "connected again; the regions open before are to be opened again"
        );
        // (its control connection closes as it drops: the server ends that session)
        drop(old);
        Ok(())
    }

    /// This connection's number, unique in the process: a new one after each
    /// [`Client::reconnect`]. [`OpenRegion::connection`] says where a handle was opened.
    pub fn connection(&self) -> u64 {
        self.connection
    }

    pub(super) fn put_back(&mut self, rdma: Rdma) {
        self.rdma = Some(rdma);
    }

    /// [`Client::put_back`] after a transfer that may have `failed`: if it failed and left
    /// the QP in the error state (a work request that failed or stalled takes it there), the
    /// error is kept, and the next transfer is refused with it rather than flushed.
    pub(super) fn put_back_after(&mut self, mut rdma: Rdma, failed: Option<&Error>) {
        if let Some(e) = failed.filter(|_| rdma.down.is_none()) {
            if let Ok(verbs::QpState::Error | verbs::QpState::Sqe) = rdma.qp.state() {
                tracing::warn!(qpn = rdma.qp.qpn(), error = %e, "the transfer left the QP in the error state: RDMA on this connection is over");
                rdma.down = Some(e.to_string());
            }
        }
        self.rdma = Some(rdma);
    }
}
