//! A block-storage region's staging ring in an NVMe CMB: its slots, the proof of its legs
//! at open, and the slots lent out: to the NIC to read a fetch's chunk the device read into
//! the slot ([`BlockStorage::lend_slot`]), and to the NIC to write a put's chunk into, which
//! the device then takes from the slot ([`BlockStorage::lend_slot_for_put`],
//! [`BlockStorage::commit_slot`]). Either way the bytes stay out of host memory.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use verbs::{HostBuffer, SharedMemory};

use super::{lock, BlockStorage, PAGE, PIECE};
use crate::cmb::CmbMemory;
use crate::error::Error;
use crate::provider::{check_range, Provider};

/// A ring of staging slots in a CMB, and what its legs were proved to do.
#[derive(Debug)]
pub(super) struct Ring {
    /// The ring's memory, until it is given back to the CMB ([`BlockStorage::give_back_ring`]):
    /// then no slot is taken any more.
    mem: Mutex<Option<Arc<CmbMemory>>>,
    /// Bytes of the ring, and the CMB's PCI address (kept for the report once it is given back).
    pub(super) len: u64,
    pub(super) bdf: String,
    /// Why the ring was given back to the CMB (None while it is held).
    pub(super) given_back: Mutex<Option<String>>,
    pub(super) slot: u64,
    /// Offsets of the free slots (a [`RingLease`] gives its slot back here).
    pub(super) free: Arc<Mutex<Vec<u64>>>,
    /// Device → CMB works (else why not).
    pub(super) read: Result<(), String>,
    /// CMB → device works (else why not; read-only regions never try).
    pub(super) write: Result<(), String>,
}

/// A ring slot lent out with a chunk the device read into it, peer to peer, for the NIC to
/// read from the CMB itself ([`BlockStorage::lend_slot`]). The slot goes back to the ring when
/// the lease is dropped: whoever lends the bytes to a peer revokes the peer's access first.
#[derive(Debug)]
pub struct RingLease {
    free: Arc<Mutex<Vec<u64>>>,
    slot: u64,
    /// Where the chunk's bytes are in the ring's memory (offsets into [`BlockStorage::ring`]).
    pub range: std::ops::Range<u64>,
}

impl Drop for RingLease {
    fn drop(&mut self) {
        lock(&self.free).push(self.slot);
    }
}

impl Ring {
    /// How many slots the ring has (at least one: `prove_ring`).
    pub(super) fn slots(&self) -> u64 {
        (self.len / self.slot).max(1)
    }

    /// The ring's memory, None once given back.
    pub(super) fn memory(&self) -> Option<Arc<CmbMemory>> {
        lock(&self.mem).clone()
    }
}

impl BlockStorage {
    /// A free ring slot for `span` bytes whose leg (`write`: CMB → device) was proved, and the
    /// ring's memory (held by the caller while it uses the slot).
    fn take_slot(&self, write: bool, span: u64) -> Option<(&Ring, u64, Arc<SharedMemory>)> {
        let ring = self.via.as_ref()?;
        let ok = if write { &ring.write } else { &ring.read };
        ok.as_ref().ok()?;
        if span > ring.slot {
            return None;
        }
        let mem = ring.memory()?;
        let slot = lock(&ring.free).pop()?;
        Some((ring, slot, cmb_mem(&mem)))
    }

    /// Whether some chunk can go through the ring, given what the NIC was proved to do with
    /// it (`nic_reads`: it reads slots, `nic_lands`: it writes them): the NIC's leg and the
    /// device's leg of one direction both hold. Else the ring is given back to the CMB, so that
    /// other regions can have that memory, and the reason says why: no chunk would go through it
    /// (they go by direct I/O through host staging). Called once the NIC's legs were tried
    /// ([`BlockStorage::set_nic_legs`]); a ring whose two device legs failed is given back at
    /// open.
    pub(super) fn keep_ring_if_used(&self, nic_reads: bool, nic_lands: bool) -> bool {
        let Some(ring) = self.via.as_ref() else {
            return false;
        };
        let reads = nic_reads && ring.read.is_ok();
        let lands = nic_lands && ring.write.is_ok();
        if reads || lands {
            return true;
        }
        self.give_back_ring(
            "no chunk can go through it: the NIC reaches it neither way, or not where the \
             device's leg of the same direction holds",
        );
        false
    }

    /// Give the ring's memory back to the CMB (see [`BlockStorage::keep_ring_if_used`]).
    pub(super) fn give_back_ring(&self, why: &str) {
        let Some(ring) = self.via.as_ref() else {
            return;
        };
        let mem = lock(&ring.mem).take();
        lock(&ring.free).clear();
        *lock(&ring.given_back) = Some(why.to_string());
        if mem.is_some() {
            tracing::info!(path = %self.path.display(), bytes = ring.len, why, "CMB ring given back");
        }
    }
}

impl BlockStorage {
    /// Build the ring over `cmb` and prove its legs: a read of the region's first slot into
    /// the CMB must give the bytes a read into host memory gives; a write of those same bytes
    /// back from the CMB must read back unchanged (the device's bytes stay what they were).
    pub(super) fn prove_ring(&self, cmb: CmbMemory, chunk: u64) -> Result<Ring, Error> {
        // eight slots (at most 1 MiB each), so that several requests use the ring at once; a
        // whole number of pages (and of blocks) each. Fewer, of `chunk` bytes, where eight
        // would be shorter than the chunks the caller lends: no such chunk would fit one (a
        // 4 MiB ring lent no 1 MiB chunk from its eight 512 KiB slots)
        let unit = self.block.max(PAGE);
        let eighth = ((cmb.len() / 8).min(PIECE) / unit * unit).max(self.block);
        let whole = chunk.div_ceil(unit) * unit;
        let slot = if eighth < whole && whole <= cmb.len() {
            whole
        } else {
            eighth
        };
        if slot > cmb.len() {
            return Err(Error::InvalidArgument(format!(
                "the CMB ring ({} bytes) is smaller than one {}-byte block",
                cmb.len(),
                self.block
            )));
        }
        let n = slot.min(self.len);
        let mut want = HostBuffer::new(n as usize)?;
        self.read_direct(self.base, want.as_mut_slice())?;
        let mem = Arc::clone(cmb.mapping().expect("a CMB has a CPU mapping").0);
        let fd = self.file.as_fd();
        let read = mem
            .fill_from_fd(0, n as usize, fd, self.base)
            .map_err(|e| format!("O_DIRECT read into the CMB: {e}"))
            .and_then(|()| same(&mem, want.as_slice(), "read into the CMB"));
        let write = if !self.writable {
            Err("the region is read-only".to_string())
        } else if let Err(why) = &read {
            Err(format!("not tried: {why}"))
        } else {
            mem.drain_to_fd(0, n as usize, fd, self.base)
                .map_err(|e| format!("O_DIRECT write from the CMB: {e}"))
                .and_then(|()| {
                    let mut got = HostBuffer::new(n as usize).map_err(|e| e.to_string())?;
                    self.read_direct(self.base, got.as_mut_slice())
                        .map_err(|e| e.to_string())?;
                    if got.as_slice() == want.as_slice() {
                        Ok(())
                    } else {
                        Err("the bytes written from the CMB read back different".into())
                    }
                })
        };
        for (leg, r) in [("device → CMB", &read), ("CMB → device", &write)] {
            match r {
                Ok(()) => {
                    tracing::info!(path = %self.path.display(), leg, "peer to peer, verified")
                }
                Err(why) => {
                    tracing::warn!(path = %self.path.display(), leg, why, "through host memory")
                }
            }
        }
        let ring = Ring {
            free: Arc::default(),
            len: cmb.len(),
            bdf: cmb.device().bdf.clone(),
            mem: Mutex::new(Some(Arc::new(cmb))),
            given_back: Mutex::new(None),
            slot,
            read,
            write,
        };
        *lock(&ring.free) = (0..ring.slots()).rev().map(|i| i * slot).collect();
        Ok(ring)
    }

    /// Read the `len` bytes at region offset `offset` from the device into a free ring slot,
    /// peer to peer, and lend the slot: the caller lets the NIC read `range` of the ring's
    /// memory (registered by the caller on the NIC, [`BlockStorage::ring`]) and drops the
    /// lease once the NIC is done. `Ok(None)` when the chunk cannot be lent this way, and the
    /// caller copies it as usual: no ring, a device → CMB leg that was not proved, a chunk
    /// whose covering blocks are longer than a slot, no free slot, or (`page_start`: the NIC's access
    /// was proved only from the start of a page) a chunk that would not start on a page.
    pub fn lend_slot(
        &self,
        offset: u64,
        len: u64,
        page_start: bool,
    ) -> Result<Option<RingLease>, Error> {
        if !self.lends(offset, len, page_start)? {
            return Ok(None);
        }
        let at = self.base + offset;
        let (a0, a1) = self.cover(at, len);
        let skip = at - a0;
        let Some((ring, slot, mem)) = self.take_slot(false, a1 - a0) else {
            return Ok(None);
        };
        let lease = RingLease {
            free: Arc::clone(&ring.free),
            slot,
            range: slot + skip..slot + skip + len,
        };
        // (a read that fails gives the slot back with the lease)
        mem.fill_from_fd(slot, (a1 - a0) as usize, self.fd(), a0)?;
        self.moved.dev_to_cmb.fetch_add(a1 - a0, Ordering::Relaxed);
        self.moved.cmb_to_nic.fetch_add(len, Ordering::Relaxed);
        Ok(Some(lease))
    }

    /// Whether a fetch's `len` bytes at region offset `offset` are a chunk
    /// [`BlockStorage::lend_slot`] lends when a slot is free (its static half): the
    /// device → CMB leg was proved, the blocks that cover the chunk fit one slot, and (with
    /// `page_start`) the chunk starts on a page of its slot. An error past the end.
    pub fn lends(&self, offset: u64, len: u64, page_start: bool) -> Result<bool, Error> {
        check_range("region", offset, len, self.len)?;
        let Some(ring) = self.via.as_ref().filter(|r| r.read.is_ok()) else {
            return Ok(false);
        };
        let at = self.base + offset;
        let (a0, a1) = self.cover(at, len);
        // every slot starts on a page (`prove_ring`): the chunk does when its offset into
        // the covering blocks is a whole number of pages
        Ok(len != 0 && a1 - a0 <= ring.slot && !(page_start && (at - a0) % PAGE != 0))
    }

    /// How many of the ring's slots are free now (0 without a ring, or once it was given back).
    pub fn free_slots(&self) -> u64 {
        // (a lease from before the ring was given back returns its slot to a ring taking none)
        self.via
            .as_ref()
            .filter(|r| r.memory().is_some())
            .map_or(0, |r| lock(&r.free).len() as u64)
    }

    /// How many slots the region's CMB ring has (None: no ring). A caller that lends more
    /// chunks than that at once finds its own chunks in every slot.
    pub fn ring_slots(&self) -> Option<u64> {
        self.via.as_ref().map(Ring::slots)
    }

    /// Whether puts may go through the ring (the region is writable and its CMB → device leg
    /// was proved), else why not.
    pub fn ring_put_leg(&self) -> Result<(), String> {
        match &self.via {
            Some(_) if !self.writable => Err("the region is read-only".into()),
            Some(r) => r
                .write
                .clone()
                .map_err(|why| format!("CMB → device is not peer to peer ({why})")),
            None => Err("no CMB staging ring".into()),
        }
    }

    /// A free ring slot for a put's `len` bytes at region offset `offset`, for the NIC to
    /// write the chunk into before [`BlockStorage::commit_slot`] writes it to the device: the
    /// slot holds the blocks that cover the chunk, from its start (a page), and the chunk goes
    /// where its bytes fall in them (`range`). `Ok(None)` when the chunk cannot go this way,
    /// and the caller copies it as usual ([`Provider::copy_in`]): see
    /// [`BlockStorage::put_lands`], or no slot free. Nothing is written until the commit: a
    /// put that fails before leaves the region as it was.
    /// A chunk that [`BlockStorage::put_lands`] but finds every slot lent out gets `Ok(None)`
    /// too: a slot comes back when its lease is dropped.
    pub fn lend_slot_for_put(
        &self,
        offset: u64,
        len: u64,
        page_start: bool,
    ) -> Result<Option<RingLease>, Error> {
        if !self.put_lands(offset, len, page_start)? {
            return Ok(None);
        }
        let at = self.base + offset;
        let (a0, a1) = self.cover(at, len);
        let Some((ring, slot, _)) = self.take_slot(true, a1 - a0) else {
            return Ok(None);
        };
        let skip = at - a0;
        Ok(Some(RingLease {
            free: Arc::clone(&ring.free),
            slot,
            range: slot + skip..slot + skip + len,
        }))
    }

    /// Whether a put's `len` bytes at region offset `offset` are a chunk the ring takes when
    /// a slot is free (see [`BlockStorage::lend_slot_for_put`]): the CMB → device leg was
    /// proved, the blocks that cover the chunk fit one slot, and (with `page_start`: the NIC
    /// was proved to land only from the start of a page) the chunk starts on a block, so that
    /// it lands from the slot's start. An error past the end.
    pub fn put_lands(&self, offset: u64, len: u64, page_start: bool) -> Result<bool, Error> {
        check_range("region", offset, len, self.len)?;
        let at = self.base + offset;
        let (a0, a1) = self.cover(at, len);
        let fits = |r: &Ring| r.write.is_ok() && a1 - a0 <= r.slot;
        Ok(len != 0 && !(page_start && at != a0) && self.via.as_ref().is_some_and(fits))
    }

    /// Write the chunk the NIC wrote into `lease`'s slot (see
    /// [`BlockStorage::lend_slot_for_put`]) to region offset `offset` on the device, peer to
    /// peer (CMB → device). Whole blocks are written under the shared side of the block lock.
    /// A block the chunk covers only partly is completed in the slot first, under the
    /// exclusive side: its other bytes are read from the device (into host memory: at most two
    /// blocks, counted device → host) and written around the chunk's, so that a put beside it
    /// in the same block loses nothing. The lease stays the caller's: it gives the slot back
    /// once nothing (no work request) can write it any more.
    pub fn commit_slot(&self, lease: &RingLease, offset: u64) -> Result<(), Error> {
        let len = lease.range.end - lease.range.start;
        check_range("region", offset, len, self.len)?;
        let at = self.base + offset;
        let ring = self
            .via
            .as_ref()
            .filter(|r| Arc::ptr_eq(&r.free, &lease.free))
            .ok_or_else(|| {
                Error::InvalidArgument("the slot is not one of this region's ring".into())
            })?;
        let (a0, a1) = self.cover(at, len);
        let (skip, span) = (at - a0, a1 - a0);
        if lease.range.start != lease.slot + skip || span > ring.slot {
            return Err(Error::InvalidArgument(format!(
                "a put's slot holds the blocks that cover its chunk from its start: {len} \
                 bytes at {offset} are not where the slot has them"
            )));
        }
        let mem = ring.memory().ok_or_else(|| {
            Error::InvalidArgument(
                "the region's ring was given back to the CMB: write the chunk through host \
                 staging (copy_in)"
                    .into(),
            )
        })?;
        let mem = cmb_mem(&mem);
        let edges = self.edges(skip as usize, len as usize, span as usize);
        let (_patch, _whole);
        if edges.is_empty() {
            _whole = self.whole_blocks();
        } else {
            _patch = self.patching();
            self.complete_edges(&mem, lease.slot, a0, &edges, skip..skip + len)?;
        }
        mem.drain_to_fd(lease.slot, span as usize, self.fd(), a0)?;
        self.moved.nic_to_cmb.fetch_add(len, Ordering::Relaxed);
        self.moved.cmb_to_dev.fetch_add(span, Ordering::Relaxed);
        Ok(())
    }

    /// Complete the partly covered blocks at `edges` (offsets from `a0`, the device offset of
    /// the slot's first byte) in the slot at `slot`: every byte of them outside `chunk` (the
    /// landed bytes, in the same offsets) is read from the device. The caller holds the
    /// exclusive side of the block lock.
    fn complete_edges(
        &self,
        mem: &SharedMemory,
        slot: u64,
        a0: u64,
        edges: &[u64],
        chunk: std::ops::Range<u64>,
    ) -> Result<(), Error> {
        let b = self.block;
        let mut old = HostBuffer::new(b as usize)?;
        for &o in edges {
            self.read_direct(a0 + o, old.as_mut_slice())?;
            self.moved.dev_to_host.fetch_add(b, Ordering::Relaxed);
            let lo = chunk.start.clamp(o, o + b);
            let hi = chunk.end.clamp(o, o + b);
            let old = old.as_slice();
            if lo > o {
                mem.write_at(slot + o, &old[..(lo - o) as usize])?;
            }
            if hi < o + b {
                mem.write_at(slot + hi, &old[(hi - o) as usize..])?;
            }
        }
        Ok(())
    }
}

fn cmb_mem(cmb: &CmbMemory) -> Arc<SharedMemory> {
    Arc::clone(cmb.mapping().expect("a CMB has a CPU mapping").0)
}

fn same(mem: &SharedMemory, want: &[u8], what: &str) -> Result<(), String> {
    let mut got = vec![0; want.len()];
    mem.read_at(0, &mut got).map_err(|e| e.to_string())?;
    if got == want {
        Ok(())
    } else {
        let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        Err(format!(
            "the {what} completed but the bytes differ from a read into host memory (first at byte {at})"
        ))
    }
}
