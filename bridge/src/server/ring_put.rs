//! Puts into an `nvme` region's CMB ring (NIC → CMB → SSD): where the NIC was proved to land
//! an RDMA READ in the ring (the landing canary, see [`crate::path::ring_nic_leg`]) and the
//! device to take a chunk from it (the CMB → device leg), a put's chunk of whole blocks is
//! RDMA-READ from the client's buffer straight into a free ring slot, and the device writes it
//! from there once the READ completed: no byte crosses host memory. Every other chunk goes
//! through host staging as before.

use std::sync::Arc;

use peermem::block::{BlockStorage, RingLease};
use peermem::canary::DeviceMr;
use peermem::Provider;
use verbs::{Local, MemoryRegion, RegionRef};

use super::driver::ConnState;
use super::regions::Region;
use super::ring_wait::{RingQueue, SlotFreed};
use super::session::Bounce;
use super::stage::lock;
use super::Shared;

/// A ring slot a put's chunk lands in. The work request that writes it holds it as its local
/// memory, so the slot goes back to the ring only once the NIC is done with it, even when the
/// connection (and the request's future) goes away first.
#[derive(Debug)]
pub(super) struct PutSlot {
    mr: Arc<DeviceMr>,
    lease: RingLease,
    /// The ring's waiters look again once the slot is back (after the lease).
    _freed: SlotFreed,
}

impl RegionRef for PutSlot {
    fn memory_region(&self) -> &MemoryRegion {
        self.mr.mr()
    }
}

impl PutSlot {
    /// The work request's local end: the chunk's bytes in the slot.
    pub(super) fn local(self: &Arc<Self>) -> verbs::Result<Local> {
        let r = &self.lease.range;
        let me: Arc<dyn RegionRef> = Arc::clone(self) as Arc<dyn RegionRef>;
        Local::region(me, r.start as usize..r.end as usize)
    }

    /// Write the landed chunk to region offset `offset` of `provider`'s device.
    pub(super) fn commit(
        &self,
        provider: &dyn Provider,
        offset: u64,
    ) -> Result<(), peermem::Error> {
        let block = provider
            .as_any()
            .downcast_ref::<BlockStorage>()
            .ok_or_else(|| {
                peermem::Error::InvalidArgument("a ring slot of a region that is not nvme".into())
            })?;
        block.commit_slot(&self.lease, offset)
    }
}

/// Where a put's chunk goes: see [`ConnState::put_slot`].
pub(super) enum PutRoute {
    /// Into this ring slot.
    Ring(Arc<PutSlot>),
    /// Into the ring once this connection's oldest transfer in flight completes: the
    /// connection is at its bounce depth, or every slot is lent and some to this connection's
    /// own landings, which give theirs back as they complete.
    Wait,
    /// Into the ring once this connection's turn comes and a slot is free: every slot is
    /// lent to other connections, or other connections wait for the next one (`ring_wait`).
    Queue(Arc<RingQueue>),
    /// Through host staging.
    Host,
}

impl ConnState {
    /// Where region `r`'s put `req` goes. Its chunk lands in the CMB ring when the NIC was
    /// proved to land READs there on this connection's device (from page starts: at this
    /// connection's path MTU only), the chunk is whole blocks no longer than a slot, a slot
    /// is free, it is this connection's turn (`ring_wait`) and the connection is under its
    /// bounce depth (ring puts hold no staging buffer, so the depth is what bounds them). A
    /// chunk that would land waits for this connection's own transfers in flight, or else
    /// its turn, rather than cross host memory.
    pub(super) fn put_slot(
        &self,
        shared: &Shared,
        r: &Region,
        provider: &Arc<dyn Provider>,
        req: &Bounce,
    ) -> PutRoute {
        let lands = || -> Option<(Arc<DeviceMr>, &BlockStorage)> {
            if !req.to_region {
                return None;
            }
            let nic = lock(&r.ring_nic)
                .clone()
                .filter(|n| n.puts && self.nic == r.nic)?;
            let block = provider.as_any().downcast_ref::<BlockStorage>()?;
            let qp = self.qp.as_ref()?;
            if let Some(proved) = nic.page_start {
                // proved from page starts at `proved` only: at a smaller path MTU the READ's
                // response packets land partway into pages
                if qp.path_mtu() != Some(proved) {
                    return None;
                }
            }
            match block.put_lands(req.offset, req.len) {
                Ok(true) => Some((nic.mr, block)),
                Ok(false) => None,
                Err(e) => {
                    tracing::debug!(error = %e, req.offset, req.len, "no ring slot for a put");
                    None
                }
            }
        };
        let Some((mr, block)) = lands() else {
            return PutRoute::Host;
        };
        if self.inflight.len() >= shared.cfg.bounce_depth {
            return PutRoute::Wait;
        }
        let q = &r.ring_queue;
        if q.my_turn(self.id) {
            match block.lend_slot_for_put(req.offset, req.len) {
                Ok(Some(lease)) => {
                    let _freed = SlotFreed::new(q);
                    return PutRoute::Ring(Arc::new(PutSlot { mr, lease, _freed }));
                }
                Err(e) => {
                    tracing::debug!(error = %e, req.offset, req.len, "no ring slot for a put");
                    return PutRoute::Host;
                }
                Ok(None) => {}
            }
        }
        // every slot is lent, or others wait for the next one: this connection's own
        // landings give theirs back first; with none, it waits its turn (it holds no slot
        // that anyone waits for), unless nothing moved in the ring lately or its client still
        // holds chunks lent to its fetches (their releases would wait behind this put)
        if self.inflight.iter().any(|f| f.lands()) {
            PutRoute::Wait
        } else if !self.lent.is_empty() {
            PutRoute::Host
        } else if q.stalled() {
            tracing::debug!(
                req.offset,
                req.len,
                "every ring slot lent and none came back lately: the put goes through host staging"
            );
            PutRoute::Host
        } else {
            PutRoute::Queue(Arc::clone(q))
        }
    }
}
