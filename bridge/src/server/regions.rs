//! The region table: each region's memory opened, its path decided (registration attempts
//! proved by canaries, policy applied), and what clients see of it.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use peermem::canary::{Attempt, AttemptOutcome, DeviceMr};
use peermem::plan::PathKind;
use peermem::{DmaBufMemory, HostMemory, Provider};
use verbs::RegMode;

use super::config::ServerConfig;
use super::nics::Nics;
use super::session::{Catalog, Refusal};
use super::windows;
use crate::error::{Error, Result};
use crate::protocol::{AccessMode, DataPath, ErrorCode, Extent, RegionInfo};
use crate::spec::{RegionOptions, RegionSource, RegionSpec};

pub(super) struct Region {
    pub(super) info: RegionInfo,
    /// None once removed.
    pub(super) provider: Mutex<Option<Arc<dyn Provider>>>,
    /// To know when the memory is really gone after removal.
    pub(super) weak: Weak<dyn Provider>,
    /// Bytes `[0, segments.direct_len)` are direct (with `mode`), the rest bounce; the direct
    /// part is registered as MRs of `segments.segment` bytes (the driver may cap one MR's size).
    pub(super) segments: crate::path::Segments,
    pub(super) mode: Option<RegMode>,
    pub(super) attempts: Vec<Attempt>,
    pub(super) removed: AtomicBool,
    /// Device-private regions: the strategy a canary proved for MRs of window mappings, so the
    /// NIC moves windowed units straight to and from the client (None: the CPU copies them).
    pub(super) window_mode: Option<RegMode>,
    /// Block storage staged through a CMB ring that the NIC was proved to reach: staged
    /// fetches lend it ring slots instead of copying them to host staging, and puts of whole
    /// blocks land in its slots where the NIC was proved to write them.
    /// Taken at removal, so that the ring's registration (and the CMB with it) is released
    /// once the windows lent over it are gone.
    pub(super) ring_nic: Mutex<Option<crate::path::RingNic>>,
    /// The connections whose staged chunks wait for a slot of the ring, in turn.
    pub(super) ring_queue: Arc<super::ring_wait::RingQueue>,
    /// The one registration of the direct part (an MR per segment) that every open binds its
    /// memory windows over (empty: registered per connection, no direct part, or removed).
    pub(super) shared: Mutex<Vec<Arc<DeviceMr>>>,
    /// The device its direct part is registered on (an index into the server's devices).
    pub(super) nic: usize,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region").field("info", &self.info).finish()
    }
}

impl Region {
    /// The shared registration of the direct part, an MR per segment (None: per-connection
    /// registration, or the region was removed).
    pub(super) fn shared_mrs(&self) -> Option<Vec<Arc<DeviceMr>>> {
        let mrs = self
            .shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        (!mrs.is_empty()).then_some(mrs)
    }

    pub(super) fn provider(&self) -> std::result::Result<Arc<dyn Provider>, Refusal> {
        self.provider
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| removed(&self.info.name))
    }
}

pub(super) fn removed(name: &str) -> Refusal {
    (
        ErrorCode::Removed,
        format!("region '{name}' was removed from this server"),
    )
}

/// What [`ServerHandle::remove_region`](super::ServerHandle::remove_region) did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Removal {
    /// Region.
    pub region: String,
    /// Whether the memory was released (nothing refers to it any more) within the timeout.
    pub released: bool,
    /// How long it took.
    pub seconds: f64,
}

/// A region's registration attempts, as decided at start-up.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RegionReport {
    /// What clients see.
    pub info: RegionInfo,
    /// Every attempt.
    pub attempts: Vec<Attempt>,
}

/// A region's memory, name, read-only flag and options, before its path is decided.
type Opened = (String, Arc<dyn Provider>, bool, RegionOptions);

/// Open the memory of every region (allocate RAM, map files, allocate CMB, export dma-bufs).
fn open_providers(cfg: &ServerConfig) -> Result<Vec<Opened>> {
    let mut out: Vec<Opened> = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    for n in cfg
        .memory_regions
        .iter()
        .map(|m| m.name.as_str())
        .chain(cfg.regions.iter().map(|r| r.name.as_str()))
    {
        if names.contains(&n) {
            return Err(Error::Config(format!("region name '{n}' is given twice")));
        }
        names.push(n);
    }
    for m in &cfg.memory_regions {
        out.push((
            m.name.clone(),
            Arc::clone(&m.provider),
            m.read_only || !m.provider.writable(),
            m.options.clone(),
        ));
    }
    for spec in &cfg.regions {
        let (p, ro) = spec.open(&cfg.sysfs, cfg.bounce_chunk as u64)?;
        out.push((spec.name.clone(), p, ro, spec.options.clone()));
    }
    Ok(out)
}

impl RegionSpec {
    /// A device-private region over `dev`, with this spec's window and policy (default: no
    /// window, copy).
    fn device_private(&self, dev: Arc<dyn peermem::hmm::DeviceBacking>) -> Arc<dyn Provider> {
        Arc::new(peermem::hmm::DevicePrivate::new(
            dev,
            self.options.window.unwrap_or(0),
            self.options.policy.unwrap_or(peermem::hmm::Policy::Copy),
        ))
    }

    /// Open the memory: allocate RAM, map the file, allocate CMB (P2PDMA, sysfs at `sysfs`),
    /// export a dma-buf. Returns the provider and whether the region is read-only.
    /// `chunk` is the server's bounce chunk: a CMB staging ring's slots hold one.
    pub fn open(&self, sysfs: &std::path::Path, chunk: u64) -> Result<(Arc<dyn Provider>, bool)> {
        let name = &self.name;
        let cfg_err = |e: peermem::Error| Error::Config(format!("region '{name}': {e}"));
        Ok(match &self.source {
            RegionSource::Host { size, huge } => (
                Arc::new(HostMemory::anonymous(*size, *huge).map_err(cfg_err)?),
                false,
            ),
            RegionSource::File { path, read_only } => {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(!read_only)
                    .open(path)
                    .map_err(|e| {
                        Error::io(
                            format!(
                                "region '{name}': cannot open {} {}",
                                path.display(),
                                if *read_only {
                                    "for reading"
                                } else {
                                    "for reading and writing (add :ro to serve it read-only)"
                                }
                            ),
                            e,
                        )
                    })?;
                let mem = HostMemory::file(&file, !read_only).map_err(|e| {
                    Error::Config(format!("region '{name}' ({}): {e}", path.display()))
                })?;
                (Arc::new(mem), *read_only)
            }
            RegionSource::Cmb { device, size } => (
                Arc::new(peermem::cmb::CmbMemory::allocate(sysfs, device, *size).map_err(cfg_err)?),
                false,
            ),
            RegionSource::Nvme {
                path,
                range,
                read_only,
            } => {
                let mem = peermem::block::BlockStorage::open(
                    path,
                    *range,
                    !read_only,
                    self.options.via.as_ref(),
                    chunk,
                    sysfs,
                )
                .map_err(|e| Error::Config(format!("region '{name}' ({}): {e}", path.display())))?;
                (Arc::new(mem), *read_only)
            }
            RegionSource::DmaBuf { size } => (
                Arc::new(DmaBufMemory::udmabuf(*size).map_err(cfg_err)?),
                false,
            ),
            RegionSource::DevPriv { size } => {
                let dev = peermem::hmm::MemfdDevice::new(*size).map_err(cfg_err)?;
                (self.device_private(Arc::new(dev)), false)
            }
            RegionSource::DevPrivHmm { size } => {
                let mem = peermem::dmirror::DmirrorMemory::new(None, *size).map_err(cfg_err)?;
                // populate every page (zeros) so that all of them have something to migrate
                mem.copy_in(0, &vec![0; *size as usize]).map_err(cfg_err)?;
                let moved = mem.migrate_to_device(0..*size).map_err(cfg_err)?;
                tracing::info!(
                    region = %name,
                    pages = moved,
                    residency = %mem.residency().map_err(cfg_err)?,
                    "migrated to HMM device-private memory"
                );
                (Arc::new(mem), false)
            }
            RegionSource::DevPrivCuda { gpu, size } => {
                let driver = peermem::cuda::load().map_err(cfg_err)?;
                let dev =
                    peermem::cuda::CudaDevice::allocate(driver, *gpu, *size).map_err(cfg_err)?;
                (self.device_private(Arc::new(dev)), false)
            }
            RegionSource::Cuda { gpu, size } => {
                let driver = peermem::cuda::load().map_err(cfg_err)?;
                (
                    Arc::new(
                        peermem::cuda::CudaMemory::allocate(driver, *gpu, *size)
                            .map_err(cfg_err)?,
                    ),
                    false,
                )
            }
        })
    }
}

/// Open the devices and decide each region's path (registration attempts proved by canaries,
/// policy applied). Returns the table and the devices.
pub(super) async fn build_regions(cfg: &ServerConfig) -> Result<(RegionTable, Nics)> {
    let providers = open_providers(cfg)?;
    let nics = Nics::open(&cfg.device_names(), cfg.sharing).await?;
    let table = RegionTable::default();
    for (name, provider, read_only, opts) in providers {
        let r = build_region(cfg, &nics, name, provider, read_only, opts).await?;
        table.push(r);
    }
    Ok((table, nics))
}

/// Decide one region's path on the device that serves it and, with memory windows, register
/// its direct part there once.
pub(super) async fn build_region(
    cfg: &ServerConfig,
    nics: &Nics,
    name: String,
    provider: Arc<dyn Provider>,
    read_only: bool,
    opts: RegionOptions,
) -> Result<Region> {
    let (home, home_note) = nics
        .home(&*provider, opts.nic.as_deref(), &cfg.sysfs)
        .map_err(|e| Error::Config(format!("region '{name}': {e}")))?;
    let (pd, sharing) = (&nics.get(home).pd, &nics.get(home).sharing);
    let len = provider.len();
    // block storage: its legs (through the trait object: the Arc itself is `Any` too)
    let block = (*provider)
        .as_any()
        .downcast_ref::<peermem::block::BlockStorage>();
    let mut ring_nic = None;
    if let Some((b, ring)) = block.and_then(|b| b.ring().map(|r| (b, r))) {
        let leg = crate::path::ring_nic_leg(
            pd,
            &ring,
            cfg.reg,
            sharing.windows(),
            b.ring_put_leg(),
            cfg.qp_path.max_mtu,
        )
        .await;
        // (a ring no chunk can go through is given back to the CMB, its registration with it)
        ring_nic = leg.record_on(b);
    }
    let choice = opts.choice(len, cfg.reg, cfg.p2p);
    let residency_before = provider.residency();
    let (planned, segments) = crate::path::decide_segments(pd, &provider, choice)
        .await
        .map_err(|r| {
            Error::Config(format!(
                "region '{name}' ({}) is refused: {r}",
                provider.describe()
            ))
        })?;
    drop(planned.mr);
    let d = planned.decision;
    for a in &d.attempts {
        let result = match &a.outcome {
            AttemptOutcome::NotApplicable { .. } => "not-applicable",
            AttemptOutcome::RegistrationFailed { .. } => "registration-failed",
            AttemptOutcome::CanaryFailed { .. } => "canary-failed",
            AttemptOutcome::CanaryError { .. } => "canary-error",
            AttemptOutcome::Works { .. } => "works",
        };
        cfg.metrics
            .canary
            .get_or_create(&crate::metrics::CanaryLabels {
                region: name.clone(),
                strategy: a.mode.to_string(),
                result: result.to_string(),
            })
            .inc();
    }
    let mut segments = if d.path == PathKind::Direct {
        segments
    } else {
        crate::path::Segments::whole(0)
    };
    let (shared, shared_note) = match d
        .mode
        .filter(|_| segments.direct_len > 0 && sharing.windows())
    {
        None => (Vec::new(), String::new()),
        Some(mode) => {
            let writable = !read_only && !provider.holds_data();
            match windows::share(pd, &name, &provider, segments, mode, writable).await {
                Ok((mrs, short)) => {
                    let mut note = String::new();
                    if let Some((kept, why)) = short {
                        note = format!(
                            "; {why}: the first {} bytes go direct, the rest through bounce \
                             buffers",
                            kept.direct_len
                        );
                        segments = kept;
                    }
                    let direct_len = segments.direct_len;
                    cfg.metrics
                        .shared_registered_bytes
                        .inc_by(direct_len as i64);
                    let mrs_note = match mrs.len() {
                        1 => String::new(),
                        n => format!(" in {n} MRs"),
                    };
                    (
                        mrs,
                        format!(
                            "{note}; registered once ({direct_len} bytes{mrs_note}, no remote \
                             access of its own): each open binds a memory window on the \
                             client's QP"
                        ),
                    )
                }
                Err(why) => {
                    tracing::warn!(region = %name, why, "no memory window over the region");
                    segments = crate::path::Segments::whole(0);
                    (
                        Vec::new(),
                        format!(
                            "; the {mode} registration works, but {why}: this server isolates \
                             clients with memory windows, so the region goes through bounce \
                             buffers (serve --sharing per-connection registers it per \
                             connection instead, direct, and gives up the windows)"
                        ),
                    )
                }
            }
        }
    };
    let direct_len = segments.direct_len;
    // a direct extent per MR: no transfer piece crosses from one MR to the next
    let mut extents: Vec<Extent> = segments
        .ranges()
        .into_iter()
        .map(|r| Extent {
            offset: r.start,
            len: r.end - r.start,
            path: DataPath::Direct,
        })
        .collect();
    if direct_len < len {
        extents.push(Extent {
            offset: direct_len,
            len: len - direct_len,
            path: DataPath::Bounce,
        });
    }
    let path = match (direct_len, direct_len == len) {
        (_, true) => DataPath::Direct,
        (0, _) => DataPath::Bounce,
        _ => DataPath::Mixed,
    };
    let mut reason = d.reason.clone();
    reason.push_str(&shared_note);
    if let Some(b) = block {
        reason.push_str(&format!("; legs: {}", b.legs_plan()));
    }
    let pages_move = block.is_none();
    if let (Some(before), Some(after), true) = (residency_before, provider.residency(), pages_move)
    {
        reason.push_str(&format!(
            "; pages before registration: {before}; after: {after}"
        ));
    }
    if direct_len > 0 && direct_len < len {
        reason.push_str(&format!(
            "; bytes from {direct_len} on are beyond the {direct_len}-byte P2P window and go through bounce buffers"
        ));
    }
    // memory the NIC reads only from page starts (rxe's ODP on a CMB): chunks lent, not copied
    if direct_len == 0 && sharing.windows() {
        let lending =
            crate::path::page_start_lending(pd, &provider, &d, cfg.qp_path.max_mtu, !read_only)
                .await;
        if let Some((nic, note)) = lending {
            tracing::info!(region = %name, lends = nic.is_some(), note, "page-start lending");
            ring_nic = nic;
            reason.push_str(&format!("; {note}"));
        }
    }
    let mut window_mode = None;
    if let Some(dp) = peermem::hmm::DevicePrivate::of(&*provider).filter(|d| d.window_size() > 0) {
        let proof = peermem::plan::prove_window(pd, dp, choice.reg, choice.p2p).await;
        tracing::info!(region = %name, mode = ?proof.mode, why = proof.reason, "P2P window units");
        window_mode = proof.mode;
        reason.push_str(&format!("; window units: {}", proof.reason));
        if window_mode.is_none() {
            // the window is the NIC's: CPU copies take the device's copy engine (or the
            // policy's migration) instead of mapping units into it
            dp.set_copies_map_window(false);
            reason.push_str(
                "; the NIC cannot use the window, so copies of units on the device take the \
                 device's copy engine (or migrate, by the policy) without mapping them into it",
            );
        }
    }
    let access = if read_only {
        AccessMode::ReadOnly
    } else {
        AccessMode::ReadWrite
    };
    if direct_len > 0 && !home_note.is_empty() {
        reason.push_str("; ");
        reason.push_str(&home_note);
    }
    let server_puts = !read_only && provider.holds_data();
    if server_puts {
        reason.push_str(
            "; puts go through the server and are made durable before they are acknowledged \
             (the memory holds data the server did not create: no rkey allows remote writes)",
        );
    }
    tracing::info!(region = %name, %path, reason, "region ready");
    let weak = Arc::downgrade(&provider);
    Ok(Region {
        info: RegionInfo {
            name,
            size: len,
            access,
            kind: provider.kind().to_string(),
            path,
            reason,
            strategy: d.mode.filter(|_| direct_len > 0).map(|m| m.to_string()),
            extents,
            residency: None,
            server_puts,
            nic: (nics.len() > 1 && direct_len > 0).then(|| nics.get(home).name().to_string()),
        },
        nic: home,
        provider: Mutex::new(Some(provider)),
        weak,
        segments,
        mode: d.mode,
        attempts: d.attempts,
        removed: AtomicBool::new(false),
        window_mode,
        ring_nic: Mutex::new(ring_nic),
        ring_queue: Arc::default(),
        shared: Mutex::new(shared),
    })
}

/// CRC-32C of a range of a region's memory, reading it in chunks through its copy engine.
pub fn crc_of(
    mem: &dyn Provider,
    offset: u64,
    len: u64,
) -> std::result::Result<u32, peermem::Error> {
    let mut crc = 0u32;
    let mut buf = vec![0u8; (len as usize).min(1 << 20)];
    let mut done = 0u64;
    while done < len {
        let n = ((len - done) as usize).min(buf.len());
        mem.copy_out(offset + done, &mut buf[..n])?;
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        done += n as u64;
    }
    Ok(crc)
}

/// The regions of a server, in the order they were given or added (a region's index never
/// changes; a removed one stays, marked, so indexes held by connections stay valid). Append
/// only: readers never wait for an add.
#[derive(Debug, Default)]
pub(super) struct RegionTable(boxcar::Vec<Region>);

impl RegionTable {
    /// Region `idx`.
    pub(super) fn get(&self, idx: usize) -> &Region {
        &self.0[idx]
    }

    /// Every region, removed ones too.
    pub(super) fn all(&self) -> impl Iterator<Item = &Region> {
        self.0.iter().map(|(_, r)| r)
    }

    /// The regions still served. While a region is replaced its successor is listed after
    /// it under the same name; only the first of a name is served until the old one is
    /// revoked, so only it is shown.
    pub(super) fn live(&self) -> impl Iterator<Item = &Region> {
        let mut seen = std::collections::HashSet::new();
        self.all()
            .filter(|r| !r.removed.load(Ordering::SeqCst))
            .filter(move |r| seen.insert(r.info.name.clone()))
    }

    /// A region still served, by name.
    pub(super) fn live_named(&self, name: &str) -> Option<&Region> {
        self.live().find(|r| r.info.name == name)
    }

    /// How many regions are served.
    pub(super) fn live_count(&self) -> usize {
        self.live().count()
    }

    /// Serve one more region (its name is checked by the caller, under the add lock).
    pub(super) fn push(&self, r: Region) -> usize {
        self.0.push(r)
    }

    /// What a listing shows: the regions still served, with their residency now.
    pub(super) fn listing(&self) -> Vec<RegionInfo> {
        self.live()
            .map(|r| {
                let mut info = r.info.clone();
                info.residency = r.provider().ok().and_then(|p| p.residency());
                info
            })
            .collect()
    }
}

impl Catalog for RegionTable {
    fn find(&self, name: &str) -> Option<usize> {
        self.0
            .iter()
            .find(|(_, r)| r.info.name == name && !r.removed.load(Ordering::SeqCst))
            .map(|(i, _)| i)
    }

    fn info(&self, idx: usize) -> &RegionInfo {
        &self.0[idx].info
    }

    fn is_removed(&self, idx: usize) -> bool {
        self.0[idx].removed.load(Ordering::SeqCst)
    }

    fn names(&self) -> Vec<String> {
        self.live().map(|r| r.info.name.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_the_reference() {
        let m = HostMemory::anonymous(3 << 20, false).unwrap();
        let data: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        m.copy_in(0, &data).unwrap();
        assert_eq!(
            crc_of(&m, 5, (3 << 20) - 9).unwrap(),
            crc32c::crc32c(&data[5..(3 << 20) - 4])
        );
        assert_eq!(crc_of(&m, 0, 0).unwrap(), 0);
    }
}
