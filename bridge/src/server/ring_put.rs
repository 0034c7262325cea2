//! Puts that land without crossing host memory: the NIC RDMA-READs a put's chunk from the
//! client's buffer straight into device memory, where a landing canary proved it may.
//! - Into an `nvme` region's CMB ring (NIC → CMB → SSD; the canary: see
//!   [`crate::path::ring_nic_leg`]): a chunk lands in a free ring slot among the blocks that
//!   cover it, and the device writes them from there once the READ completed (a block the
//!   chunk covers only partly is completed in the slot first).
//! - Into a region's own memory that the NIC reaches from page starts (a CMB, see
//!   [`crate::path::page_start_lending`]): a chunk that starts on a page lands in place.
//!
//! Every other chunk goes through host staging as before.

use std::sync::Arc;

use peermem::block::{BlockStorage, RingLease};
use peermem::canary::DeviceMr;
use peermem::Provider;
use verbs::{Local, MemoryRegion, RegionRef};

use super::driver::ConnState;
use super::regions::Region;
use super::ring_wait::{RingQueue, SlotFreed};
use super::session::Bounce;
use super::stage::PAGE;
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

/// Where a put's chunk lands without crossing host memory: the work request's local end.
pub(super) enum Landing {
    /// A CMB ring slot, written to the device once the chunk landed.
    Slot(Arc<PutSlot>),
    /// The region's own memory, registered from its first byte (`RingNic::mr` of a region
    /// lent from page starts): the chunk is in place once it landed.
    InPlace(Arc<DeviceMr>),
}

impl Landing {
    /// The work request's local end for `req`'s chunk.
    pub(super) fn local(&self, req: &Bounce) -> verbs::Result<Local> {
        match self {
            Landing::Slot(slot) => slot.local(),
            Landing::InPlace(mr) => {
                let me: Arc<dyn RegionRef> = Arc::clone(mr) as Arc<dyn RegionRef>;
                Local::region(me, req.offset as usize..(req.offset + req.len) as usize)
            }
        }
    }
}

/// Where a put's chunk goes: see [`ConnState::put_slot`].
pub(super) enum PutRoute {
    /// Into this ring slot, or in place.
    Lands(Landing),
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
    /// Where region `r`'s put `req` goes. The NIC must have been proved to land READs in the
    /// region's ring, or in its own memory, on this connection's device (from page starts: at
    /// this connection's path MTU only, and only chunks that start on a page); the connection
    /// must be under its bounce depth (landing puts hold no staging buffer, so the depth is
    /// what bounds them).
    /// - Into the ring: the blocks that cover the chunk fit a slot (and, where the NIC lands
    ///   only from page starts, the chunk starts on a block), a slot is free and it
    ///   is this connection's turn (`ring_wait`). A chunk that would land waits for this
    ///   connection's own transfers in flight, or else its turn, rather than cross host
    ///   memory.
    /// - In place: any chunk that starts on a page.
    pub(super) fn put_slot(
        &self,
        shared: &Shared,
        r: &Region,
        provider: &Arc<dyn Provider>,
        req: &Bounce,
    ) -> PutRoute {
        let Some(nic) = self.lending_nic(r).filter(|n| n.puts && req.to_region) else {
            return PutRoute::Host;
        };
        let at_depth = self.inflight.len() >= shared.cfg.bounce_depth;
        let Some(block) = provider.as_any().downcast_ref::<BlockStorage>() else {
            // the region's own memory: its registration starts on a page
            return if nic.page_start.is_some() && req.offset % PAGE != 0 {
                PutRoute::Host
            } else if at_depth {
                PutRoute::Wait
            } else {
                PutRoute::Lands(Landing::InPlace(nic.mr))
            };
        };
        let page_start = nic.page_start.is_some();
        match block.put_lands(req.offset, req.len, page_start) {
            Ok(true) => {}
            Ok(false) => return PutRoute::Host,
            Err(e) => {
                tracing::debug!(error = %e, req.offset, req.len, "no ring slot for a put");
                return PutRoute::Host;
            }
        }
        if at_depth {
            return PutRoute::Wait;
        }
        let q = &r.ring_queue;
        if q.my_turn(self.id) {
            match block.lend_slot_for_put(req.offset, req.len, page_start) {
                Ok(Some(lease)) => {
                    let _freed = SlotFreed::new(q);
                    let mr = nic.mr;
                    return PutRoute::Lands(Landing::Slot(Arc::new(PutSlot { mr, lease, _freed })));
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
        q.wanted();
        if self.inflight.iter().any(|f| f.holds_slot()) {
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
