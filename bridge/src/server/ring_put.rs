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

impl ConnState {
    /// A slot of region `r`'s CMB ring for the put `req`, when its chunk can land there: a
    /// ring whose landing the NIC proved on this connection's device (from page starts: at
    /// this connection's path MTU only), a chunk of whole blocks no longer than a slot, a
    /// slot free, and this connection under its bounce depth (ring puts hold no staging
    /// buffer, so the depth is what bounds them). None: the chunk goes through host staging.
    pub(super) fn put_slot(
        &self,
        shared: &Shared,
        r: &Region,
        provider: &Arc<dyn Provider>,
        req: &Bounce,
    ) -> Option<Arc<PutSlot>> {
        if !req.to_region || self.inflight.len() >= shared.cfg.bounce_depth {
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
        match block.lend_slot_for_put(req.offset, req.len) {
            Ok(Some(lease)) => Some(Arc::new(PutSlot { mr: nic.mr, lease })),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, req.offset, req.len, "no ring slot for a put");
                None
            }
        }
    }
}
