//! What gives a handle's client access to a region's direct part: a memory window bound on the
//! client's QP over the region's one registration, or (without windows) a lease of the
//! connection's own registration, with the least privilege the open allows.

use peermem::canary::{register_mode, DeviceMr};
use peermem::regcache::{Lease, Limits, RegCache};
use verbs::Access;

use super::{blocking, ConnState};
use crate::metrics::Metrics;
use crate::protocol::{AccessMode, ErrorCode, Segment};
use crate::server::session::Refusal;
use crate::server::Shared;

/// What gives a handle's client access to the region's direct part, one per MR of it
/// (segment): leases of the connection's own registrations, or memory windows bound on its QP
/// over the region's one registration. Dropping it revokes the rkeys (at once for windows; for
/// registrations, when the connection's last handle of the region closes).
pub(in crate::server) enum HandleKey {
    Leases(Vec<Lease<DeviceMr>>),
    Windows(Vec<verbs::MemoryWindow>),
}

impl HandleKey {
    /// The address and rkey of each segment, with the region bytes it covers.
    pub(super) fn remote(&self, segments: crate::path::Segments) -> Vec<Segment> {
        let keys: Vec<(u64, u32)> = match self {
            HandleKey::Leases(l) => l.iter().map(|l| (l.mr().addr(), l.mr().rkey())).collect(),
            HandleKey::Windows(w) => w.iter().map(|w| (w.addr(), w.rkey())).collect(),
        };
        segments
            .ranges()
            .into_iter()
            .zip(keys)
            .map(|(r, (addr, rkey))| Segment {
                offset: r.start,
                len: r.end - r.start,
                addr,
                rkey,
            })
            .collect()
    }
}

/// What a handle holds (None: bounce only, or the region was removed).
pub(in crate::server) type HandleMr = Option<HandleKey>;

fn access_for(mode: AccessMode) -> Access {
    match mode {
        AccessMode::ReadOnly => Access::REMOTE_READ,
        AccessMode::ReadWrite => Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
    }
}

impl ConnState {
    /// The access to a region's direct part for an open (None: the region has none).
    pub(super) async fn register(
        &mut self,
        shared: &Shared,
        region: usize,
        writable: bool,
    ) -> std::result::Result<HandleMr, Refusal> {
        let r = shared.regions.get(region);
        let Some(mode) = r.mode.filter(|_| r.segments.direct_len > 0) else {
            return Ok(None);
        };
        // memory that holds data takes puts through the server only
        let writable = writable && !r.info.server_puts;
        let provider = r.provider()?;
        if shared.nics.get(r.nic).sharing.windows() {
            return self.bind(r, writable, shared.metrics()).await;
        }
        let pd = self.pd(shared)?;
        // least privilege: the rkey allows remote writes only to an open for writing
        let access = access_for(if writable {
            AccessMode::ReadWrite
        } else {
            AccessMode::ReadOnly
        });
        let cache = self.cache(shared.cfg.cache);
        // registering pins (or maps) every page of the direct part: long for a large region.
        // One MR per segment (the driver may cap one MR's size), each cached on its own.
        let leases = blocking(|| {
            r.segments
                .ranges()
                .into_iter()
                .enumerate()
                .map(|(k, seg)| {
                    let len = seg.end - seg.start;
                    cache.get(&(region, writable, k), 0..len, len, |range| {
                        let at = seg.start + range.start..seg.start + range.end;
                        register_mode(&pd, &provider, at, access, mode)
                    })
                })
                .collect::<std::result::Result<Vec<_>, _>>()
        })
        .map_err(|e| {
            (
                ErrorCode::Internal,
                format!("registering region '{}' ({mode}): {e}", r.info.name),
            )
        })?;
        Ok(Some(HandleKey::Leases(leases)))
    }

    /// A memory window over the region's one registration, bound on this connection's QP:
    /// read-only unless the open may write. One work request, whatever the region's size.
    async fn bind(
        &mut self,
        r: &crate::server::regions::Region,
        writable: bool,
        metrics: &Metrics,
    ) -> std::result::Result<Option<HandleKey>, Refusal> {
        // no QP: a client on the TCP data path (or one that connects later and reopens); its
        // handle gets no window, and so no one-sided access
        let Some(qp) = self.qp.clone() else {
            return Ok(None);
        };
        let mrs = r
            .shared_mrs()
            .ok_or_else(|| crate::server::regions::removed(&r.info.name))?;
        let access = if writable {
            Access::REMOTE_READ | Access::REMOTE_WRITE
        } else {
            Access::REMOTE_READ
        };
        let mut windows = Vec::with_capacity(mrs.len());
        for (mr, seg) in mrs.into_iter().zip(r.segments.ranges()) {
            let w = qp
                .bind_window(mr, 0..seg.end - seg.start, access)
                .await
                .map_err(|e| {
                    (
                        ErrorCode::Internal,
                        format!(
                            "binding a memory window over region '{}' (bytes {}..{}): {e}",
                            r.info.name, seg.start, seg.end
                        ),
                    )
                })?;
            metrics.windows_bound.inc();
            windows.push(w);
        }
        Ok(Some(HandleKey::Windows(windows)))
    }

    fn cache(&mut self, limits: Limits) -> &RegCache<(usize, bool, usize), DeviceMr> {
        self.cache.get_or_insert_with(|| RegCache::new(limits))
    }
}
