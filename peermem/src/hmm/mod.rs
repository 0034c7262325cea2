//! Device-private memory: memory a device owns, addressed in 64 KiB units, that the CPU cannot
//! touch and a NIC reaches only through a limited peer-to-peer window.
//!
//! A [`DevicePrivate`] region keeps, per unit, where the bytes live:
//!
//! - on the device ([`Residency::Device`]): reachable through the P2P window when the unit is
//!   mapped there (a limited aperture, like a GPU's BAR1, managed by the registration cache's
//!   LRU: the coldest mappings are evicted once their in-flight users are done), or through
//!   the device's copy engine (the bounce path);
//! - migrated to host RAM ([`Residency::Host`]), what the kernel does today when a NIC faults
//!   on device-private pages (the `migrate` policy);
//! - freed by its owner ([`Residency::Freed`]): never touched again.
//!
//! [`DevicePrivate::plan`] splits any byte range into segments by path — window, host, bounce —
//! so one remote descriptor can be served part direct, part bounced; executing a segment checks
//! that its units were not invalidated in between. [`DevicePrivate::invalidate`] (the owner
//! frees or moves units) revokes window mappings and waits for their in-flight users before
//! returning.
#![forbid(unsafe_code)]

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::error::Error;
use crate::provider::Provider;
use crate::regcache::{CacheError, Lease, Limits, RegCache, StillInUse};

mod memfd;
pub use memfd::MemfdDevice;

/// The unit of residency and of window mappings (the registration cache's alignment).
pub const UNIT: u64 = crate::regcache::ALIGN;

/// What a device offers: its copy engine and, optionally, a P2P window.
pub trait DeviceBacking: Send + Sync + fmt::Debug {
    /// What it is, for reports.
    fn describe(&self) -> String;
    /// Bytes of device memory.
    fn len(&self) -> u64;
    /// Whether empty (never).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy engine: device → host.
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error>;
    /// Copy engine: host → device.
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error>;
    /// Map `range` (unit-aligned) of device memory into the P2P window: a provider a NIC may
    /// register (a BAR aperture, a dma-buf of the range). Errors when there is no window or the
    /// device refuses.
    fn map_window(&self, range: Range<u64>) -> Result<Arc<dyn Provider>, Error>;
}

/// Where a unit's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Residency {
    /// On the device (mapped in the window or not).
    Device,
    /// Migrated to host RAM.
    Host,
    /// Freed by the owner.
    Freed,
}

/// What to do with a unit that is not in the window and cannot be mapped there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Migrate it to host RAM (what the kernel does on a NIC fault); later accesses hit RAM.
    Migrate,
    /// Copy through bounce buffers and leave it on the device.
    Copy,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "migrate" => Ok(Policy::Migrate),
            "copy" => Ok(Policy::Copy),
            o => Err(format!("unknown policy '{o}': expected migrate or copy")),
        }
    }
}

/// How the owner invalidated units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalidation {
    /// Freed: the bytes are gone; accesses fail.
    Free,
    /// Moved within the device: the bytes stay, mappings of the old location are revoked.
    Move,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HmmStats {
    /// Units migrated to host RAM.
    pub migrations: u64,
    /// Bytes moved by the device's copy engine for bounce segments.
    pub bounce_bytes: u64,
    /// Bytes served through the window.
    pub window_bytes: u64,
    /// Bytes served from migrated units in host RAM.
    pub host_bytes: u64,
    /// Window lookups that found the unit mapped.
    pub window_hits: u64,
    /// Units mapped into the window.
    pub window_maps: u64,
    /// Mappings that could not be made (window full of units in use, or refused).
    pub window_fallbacks: u64,
    /// Units invalidated by the owner.
    pub invalidated_units: u64,
    /// Bytes the NIC moved straight from or to window mappings (zero-copy: registered window
    /// MRs), a part of no other count.
    pub window_rdma_bytes: u64,
}

/// The path of one segment.
#[derive(Debug)]
pub enum SegmentPath {
    /// Through the window: the mapping of the unit, and the offset of the segment in it.
    Window(Lease<Arc<dyn Provider>>, u64),
    /// From the unit's host copy.
    Host,
    /// Through the device's copy engine.
    Bounce,
}

/// A piece of an access.
#[derive(Debug)]
pub struct Segment {
    /// Bytes of the region.
    pub range: Range<u64>,
    /// How.
    pub path: SegmentPath,
    generation: u64,
}

impl Segment {
    /// "window", "host" or "bounce".
    pub fn kind(&self) -> &'static str {
        match self.path {
            SegmentPath::Window(..) => "window",
            SegmentPath::Host => "host",
            SegmentPath::Bounce => "bounce",
        }
    }
}

#[derive(Debug)]
struct Unit {
    residency: Residency,
    /// Bumped on every invalidation: a planned segment of an older generation is refused.
    generation: u64,
    /// The migrated bytes (Host).
    host: Option<Vec<u8>>,
}

/// A device-private region (from a `dyn Provider`: [`DevicePrivate::of`]).
pub struct DevicePrivate {
    dev: Arc<dyn DeviceBacking>,
    policy: Policy,
    units: Mutex<Vec<Unit>>,
    window: RegCache<u64, Arc<dyn Provider>>,
    window_bytes: u64,
    /// Whether CPU copies ([`DevicePrivate::read`], [`DevicePrivate::write`]) map units into
    /// the window (see [`DevicePrivate::set_copies_map_window`]).
    copies_map: AtomicBool,
    stats: [AtomicU64; 9],
}

impl fmt::Debug for DevicePrivate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePrivate")
            .field("device", &self.dev.describe())
            .field("policy", &self.policy)
            .field("window_bytes", &self.window_bytes)
            .finish()
    }
}

const MIGRATIONS: usize = 0;
const BOUNCE: usize = 1;
const WINDOW: usize = 2;
const HOST: usize = 3;
const HITS: usize = 4;
const MAPS: usize = 5;
const FALLBACKS: usize = 6;
const INVALIDATED: usize = 7;
const WINDOW_RDMA: usize = 8;

impl DevicePrivate {
    /// The device-private region behind `p`, if it is one (its owner may free or move units).
    pub fn of(p: &dyn Provider) -> Option<&DevicePrivate> {
        p.as_any().downcast_ref::<DevicePrivate>()
    }
}

impl DevicePrivate {
    /// A region over all of `dev`, with a P2P window of `window_bytes` (0: none).
    pub fn new(dev: Arc<dyn DeviceBacking>, window_bytes: u64, policy: Policy) -> DevicePrivate {
        let n = dev.len().div_ceil(UNIT) as usize;
        DevicePrivate {
            units: Mutex::new(
                (0..n)
                    .map(|_| Unit {
                        residency: Residency::Device,
                        generation: 0,
                        host: None,
                    })
                    .collect(),
            ),
            window: RegCache::new(Limits {
                max_bytes: window_bytes,
                max_entries: usize::MAX,
            }),
            window_bytes,
            copies_map: AtomicBool::new(true),
            dev,
            policy,
            stats: Default::default(),
        }
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.dev.len()
    }

    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Counters.
    pub fn stats(&self) -> HmmStats {
        let g = |i: usize| self.stats[i].load(Ordering::Relaxed);
        HmmStats {
            migrations: g(MIGRATIONS),
            bounce_bytes: g(BOUNCE),
            window_bytes: g(WINDOW),
            host_bytes: g(HOST),
            window_hits: g(HITS),
            window_maps: g(MAPS),
            window_fallbacks: g(FALLBACKS),
            invalidated_units: g(INVALIDATED),
            window_rdma_bytes: g(WINDOW_RDMA),
        }
    }

    /// Bytes of the window in use (mapped units, including those draining).
    pub fn window_in_use(&self) -> u64 {
        let s = self.window.stats();
        s.cached_bytes + s.draining_bytes
    }

    /// The size of the P2P window (0: none).
    pub fn window_size(&self) -> u64 {
        self.window_bytes
    }

    /// A window mapping of the first unit on the device, to prove how a NIC may register window
    /// mappings (the canary runs on it). Fails when there is no window or nothing can be mapped.
    pub fn window_sample(&self) -> Result<Lease<Arc<dyn Provider>>, Error> {
        if self.window_bytes == 0 {
            return Err(Error::InvalidArgument(
                "this device-private region has no P2P window".into(),
            ));
        }
        let first = self
            .lock()
            .iter()
            .position(|u| u.residency == Residency::Device);
        let i = first.ok_or_else(|| {
            Error::InvalidArgument("no unit of the region is on the device".into())
        })? as u64;
        // straight to the device: a sample must not count as a window hit or map
        self.window
            .get(&i, self.unit_range(i), self.len(), |_| {
                self.dev.map_window(self.unit_range(i))
            })
            .map_err(|e| match e {
                CacheError::Register(e) => e,
                other => Error::InvalidArgument(format!("no room in the window: {other}")),
            })
    }

    /// A window segment the NIC moved straight from or to its mapping (no CPU copy) has
    /// completed: count it, or fail like a copy would when its units were invalidated after it
    /// was planned (a put's bytes may then have landed where the owner no longer looks).
    pub fn finish_window_rdma(&self, seg: &Segment) -> Result<(), Error> {
        self.check_generation(seg)?;
        self.stats[WINDOW_RDMA].fetch_add(seg.range.end - seg.range.start, Ordering::Relaxed);
        Ok(())
    }

    /// Per-unit residency, for `ls` and `doctor`: (units on the device, of which mapped in the
    /// window, migrated to host, freed).
    pub fn residency(&self) -> (u64, u64, u64, u64) {
        let units = self.lock();
        let mut r = (0, 0, 0, 0);
        for u in units.iter() {
            match u.residency {
                Residency::Device => r.0 += 1,
                Residency::Host => r.2 += 1,
                Residency::Freed => r.3 += 1,
            }
        }
        r.1 = self.window.stats().entries;
        r
    }

    /// The residency of the unit holding `offset`.
    pub fn residency_at(&self, offset: u64) -> Option<Residency> {
        self.lock()
            .get((offset / UNIT) as usize)
            .map(|u| u.residency)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Unit>> {
        self.units.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn unit_range(&self, i: u64) -> Range<u64> {
        i * UNIT..((i + 1) * UNIT).min(self.len())
    }

    /// Whether CPU copies of units on the device map them into the P2P window (the default)
    /// or leave the window alone and take the policy's path (the device's copy engine, or a
    /// migration to host RAM). The window is there for the NIC: where the NIC cannot use it
    /// (no window strategy passed its canary), a mapping made for a CPU copy costs an export,
    /// a mapping and a fault per page, and then its eviction, per unit, to copy bytes the
    /// copy engine moves without them. [`DevicePrivate::plan`] (the NIC's) always maps.
    pub fn set_copies_map_window(&self, on: bool) {
        self.copies_map.store(on, Ordering::Relaxed);
    }

    /// Split `offset..offset+len` into segments by path, mapping units into the window (or
    /// migrating them, by the policy) as needed. Fails if a unit was freed.
    pub fn plan(&self, offset: u64, len: u64) -> Result<Vec<Segment>, Error> {
        self.plan_with(offset, len, true)
    }

    /// [`DevicePrivate::plan`] for a CPU copy: units on the device are mapped into the window
    /// only while copies may map ([`DevicePrivate::set_copies_map_window`]).
    fn plan_copy(&self, offset: u64, len: u64) -> Result<Vec<Segment>, Error> {
        self.plan_with(offset, len, self.copies_map.load(Ordering::Relaxed))
    }

    fn plan_with(&self, offset: u64, len: u64, map: bool) -> Result<Vec<Segment>, Error> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "range {offset}+{len} is outside the {}-byte device-private region",
                    self.len()
                ))
            })?;
        let mut out: Vec<Segment> = Vec::new();
        let mut at = offset;
        while at < end {
            let i = at / UNIT;
            let ur = self.unit_range(i);
            let seg_end = end.min(ur.end);
            let (residency, generation) = {
                let u = &self.lock()[i as usize];
                (u.residency, u.generation)
            };
            let path = match residency {
                Residency::Freed => {
                    return Err(Error::Invalidated(format!(
                        "device-private unit at {} was freed by its owner",
                        ur.start
                    )))
                }
                Residency::Host => SegmentPath::Host,
                Residency::Device => match map.then(|| self.map(i, ur.clone())).flatten() {
                    Some(lease) => SegmentPath::Window(lease, at - ur.start),
                    None => match self.policy {
                        Policy::Copy => SegmentPath::Bounce,
                        Policy::Migrate => {
                            self.migrate(i, generation)?;
                            SegmentPath::Host
                        }
                    },
                },
            };
            // merge host or bounce segments that continue the previous one
            match (out.last_mut(), &path) {
                (Some(prev), SegmentPath::Host)
                    if matches!(prev.path, SegmentPath::Host)
                        && prev.range.end == at
                        && prev.generation == generation =>
                {
                    prev.range.end = seg_end
                }
                (Some(prev), SegmentPath::Bounce)
                    if matches!(prev.path, SegmentPath::Bounce)
                        && prev.range.end == at
                        && prev.generation == generation =>
                {
                    prev.range.end = seg_end
                }
                _ => out.push(Segment {
                    range: at..seg_end,
                    path,
                    generation,
                }),
            }
            at = seg_end;
        }
        Ok(out)
    }

    /// A window mapping of unit `i`, if the window has room (evicting cold unused ones).
    fn map(&self, i: u64, ur: Range<u64>) -> Option<Lease<Arc<dyn Provider>>> {
        if self.window_bytes == 0 {
            return None;
        }
        let before = self.window.stats().hits;
        let r = self.window.get(&i, ur.clone(), self.len(), |_| {
            self.dev.map_window(ur.clone())
        });
        match r {
            Ok(l) => {
                if self.window.stats().hits > before {
                    self.stats[HITS].fetch_add(1, Ordering::Relaxed);
                } else {
                    self.stats[MAPS].fetch_add(1, Ordering::Relaxed);
                }
                Some(l)
            }
            Err(CacheError::Full { .. } | CacheError::TooLarge { .. }) => {
                self.stats[FALLBACKS].fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(CacheError::Register(e)) => {
                tracing::debug!(unit = i, "no window mapping: {e}");
                self.stats[FALLBACKS].fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Migrate unit `i` to host RAM (copy engine), unless it changed since `generation`.
    fn migrate(&self, i: u64, generation: u64) -> Result<(), Error> {
        let ur = self.unit_range(i);
        let mut buf = vec![0u8; (ur.end - ur.start) as usize];
        self.dev.copy_out(ur.start, &mut buf)?;
        let mut units = self.lock();
        let u = &mut units[i as usize];
        if u.generation != generation || u.residency != Residency::Device {
            return Err(Error::Invalidated(format!(
                "device-private unit at {} changed while it was being migrated",
                ur.start
            )));
        }
        u.residency = Residency::Host;
        u.host = Some(buf);
        self.stats[MIGRATIONS].fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn check_generation(&self, seg: &Segment) -> Result<(), Error> {
        let units = self.lock();
        for i in seg.range.start / UNIT..seg.range.end.div_ceil(UNIT) {
            let u = &units[i as usize];
            if u.generation > seg.generation || u.residency == Residency::Freed {
                return Err(Error::Invalidated(format!(
                    "device-private unit at {} was invalidated after this transfer was planned",
                    i * UNIT
                )));
            }
        }
        Ok(())
    }

    /// Walk the host copies of the migrated units holding `len` bytes from `at`: `f` gets each
    /// piece and how many bytes came before it.
    fn host_chunks(
        &self,
        mut at: u64,
        len: usize,
        mut f: impl FnMut(&mut [u8], usize),
    ) -> Result<(), Error> {
        let mut units = self.lock();
        let mut done = 0usize;
        while done < len {
            let i = (at / UNIT) as usize;
            let host = units[i].host.as_mut().ok_or_else(|| {
                Error::Invalidated(format!("unit at {at} is no longer in host RAM"))
            })?;
            let off = (at - i as u64 * UNIT) as usize;
            let k = (host.len() - off).min(len - done);
            f(&mut host[off..off + k], done);
            done += k;
            at += k as u64;
        }
        Ok(())
    }

    /// Read one planned segment into `out` (its length) with the CPU: the reference data path,
    /// and what the bridge's bounce path does for host and bounce segments.
    pub fn read_segment(&self, seg: &Segment, out: &mut [u8]) -> Result<(), Error> {
        self.check_generation(seg)?;
        let n = out.len() as u64;
        match &seg.path {
            SegmentPath::Window(lease, off) => {
                lease.copy_out(*off, out)?;
                self.stats[WINDOW].fetch_add(n, Ordering::Relaxed);
            }
            SegmentPath::Bounce => {
                self.dev.copy_out(seg.range.start, out)?;
                self.stats[BOUNCE].fetch_add(n, Ordering::Relaxed);
            }
            SegmentPath::Host => {
                self.host_chunks(seg.range.start, out.len(), |host, done| {
                    out[done..done + host.len()].copy_from_slice(host)
                })?;
                self.stats[HOST].fetch_add(n, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Write `data` (the segment's length) through one planned segment.
    pub fn write_segment(&self, seg: &Segment, data: &[u8]) -> Result<(), Error> {
        self.check_generation(seg)?;
        let n = data.len() as u64;
        match &seg.path {
            SegmentPath::Window(lease, off) => {
                lease.copy_in(*off, data)?;
                self.stats[WINDOW].fetch_add(n, Ordering::Relaxed);
            }
            SegmentPath::Bounce => {
                self.dev.copy_in(seg.range.start, data)?;
                self.stats[BOUNCE].fetch_add(n, Ordering::Relaxed);
            }
            SegmentPath::Host => {
                self.host_chunks(seg.range.start, data.len(), |host, done| {
                    host.copy_from_slice(&data[done..done + host.len()])
                })?;
                self.stats[HOST].fetch_add(n, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Read `out.len()` bytes at `offset`, segment by segment.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        for seg in self.plan_copy(offset, out.len() as u64)? {
            let r = (seg.range.start - offset) as usize..(seg.range.end - offset) as usize;
            self.read_segment(&seg, &mut out[r])?;
        }
        Ok(())
    }

    /// Write `data` at `offset`, segment by segment.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        for seg in self.plan_copy(offset, data.len() as u64)? {
            let r = (seg.range.start - offset) as usize..(seg.range.end - offset) as usize;
            self.write_segment(&seg, &data[r])?;
        }
        Ok(())
    }

    /// The owner freed or moved the units overlapping `range`: revoke their window mappings
    /// and wait (at most `timeout`) for in-flight users; segments planned before fail from now
    /// on. A moved unit that had migrated to host RAM keeps its bytes there; a freed unit's
    /// bytes are gone.
    pub fn invalidate(
        &self,
        range: Range<u64>,
        how: Invalidation,
        timeout: Duration,
    ) -> Result<usize, StillInUse> {
        let first = range.start / UNIT;
        let last = range.end.div_ceil(UNIT).min(self.len().div_ceil(UNIT));
        {
            let mut units = self.lock();
            for i in first..last {
                let u = &mut units[i as usize];
                u.generation += 1;
                if how == Invalidation::Free {
                    u.residency = Residency::Freed;
                    u.host = None;
                }
            }
        }
        self.stats[INVALIDATED].fetch_add(last.saturating_sub(first), Ordering::Relaxed);
        self.window
            .invalidate(|k| (first..last).contains(k), timeout)
    }

    /// The owner allocated the freed units overlapping `range` again (zeroed on the device).
    pub fn reallocate(&self, range: Range<u64>) -> Result<(), Error> {
        let first = range.start / UNIT;
        let last = range.end.div_ceil(UNIT).min(self.len().div_ceil(UNIT));
        for i in first..last {
            let ur = self.unit_range(i);
            self.dev
                .copy_in(ur.start, &vec![0; (ur.end - ur.start) as usize])?;
            let mut units = self.lock();
            let u = &mut units[i as usize];
            if u.residency == Residency::Freed {
                u.residency = Residency::Device;
                u.generation += 1;
            }
        }
        Ok(())
    }
}

/// As a provider (what the bridge serves today): no mapping a NIC registers as a whole, the
/// copy engine follows each unit's path (window mapping, host copy, or the device's engine).
impl Provider for DevicePrivate {
    fn kind(&self) -> &'static str {
        "devpriv"
    }
    fn describe(&self) -> String {
        let (device, mapped, host, freed) = self.residency();
        format!(
            "{}; {} units of {} KiB: {device} on the device ({mapped} mapped in a {} KiB window), {host} migrated to host RAM, {freed} freed; policy {:?}",
            self.dev.describe(),
            device + host + freed,
            UNIT >> 10,
            self.window_bytes >> 10,
            self.policy
        )
    }
    fn len(&self) -> u64 {
        self.dev.len()
    }
    fn writable(&self) -> bool {
        true
    }
    fn mapping(&self) -> Option<(&Arc<verbs::SharedMemory>, u64)> {
        None
    }
    fn no_mapping_reason(&self) -> Option<String> {
        Some("device-private memory has no CPU mapping; only units mapped in its P2P window are reachable by a NIC".into())
    }
    fn dmabuf(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        None
    }
    fn no_dmabuf_reason(&self) -> Option<String> {
        Some("device-private memory is exported unit by unit through its P2P window, not as one dma-buf".into())
    }
    fn copy_engine(&self) -> &'static str {
        "per unit: window mapping, host copy (migrated) or the device's copy engine"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        self.read(offset, out)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.write(offset, data)
    }
    fn residency(&self) -> Option<String> {
        let (device, mapped, host, freed) = DevicePrivate::residency(self);
        let s = self.stats();
        Some(format!(
            "{device} units of {} KiB on the device ({mapped} mapped in the window, {} of {} KiB in use), {host} migrated to host RAM, {freed} freed; {} migrations, {} window maps, {} window hits, {} window fallbacks, bytes: {} window RDMA (zero-copy), {} window copies, {} host, {} bounce",
            UNIT >> 10,
            self.window_in_use() >> 10,
            self.window_bytes >> 10,
            s.migrations,
            s.window_maps,
            s.window_hits,
            s.window_fallbacks,
            s.window_rdma_bytes,
            s.window_bytes,
            s.host_bytes,
            s.bounce_bytes
        ))
    }
}

#[cfg(test)]
mod tests;
