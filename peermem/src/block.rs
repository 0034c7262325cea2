//! Block storage (an NVMe namespace, or a file) as a region's memory: the bytes live on the
//! device, the NIC cannot address them, and the copy engine is direct I/O (`O_DIRECT`
//! `pread`/`pwrite`), so served bytes never sit in the page cache.
//!
//! Two ways for bytes to go between the device and the bounce path's host staging buffers:
//!
//! - **host staging**: the device DMAs straight into (out of) the staging buffer when the
//!   request is aligned to the logical block size, else into an aligned buffer the CPU copies;
//! - **through a CMB** (`via`): the device DMAs into a ring of slots allocated in an NVMe
//!   controller memory buffer (P2PDMA), peer to peer, and the CPU copies the slot to the
//!   staging buffer (and the other way for puts). Each leg is proved at open (`O_DIRECT` into
//!   p2pmem is accepted and the bytes match what a read into host memory gives) and falls back
//!   on its own, with the kernel's reason, to host staging.
//!
//! Writes that cover a block only partly read, patch and write that block under one lock, so
//! two puts that share a block never lose each other's bytes.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use verbs::{HostBuffer, SharedMemory};

use crate::cmb::CmbMemory;
use crate::error::Error;
use crate::provider::{check_range, Provider};

/// The largest piece one direct I/O moves (requests are split into pieces of this size).
const PIECE: u64 = 1 << 20;

/// Ring slots are a whole number of pages, so that a chunk lent to the NIC from the start of a
/// block at the start of a slot starts on a page ([`BlockStorage::lend_slot`]).
const PAGE: u64 = 4096;

/// An open namespace (or file) range served as a region.
#[derive(Debug)]
pub struct BlockStorage {
    path: PathBuf,
    file: File,
    /// Where byte 0 of the region is on the device.
    base: u64,
    len: u64,
    /// The logical block size: direct I/O's alignment.
    block: u64,
    writable: bool,
    /// Whether `path` is a block device (else a regular file).
    is_device: bool,
    /// Held while a partly covered block is read, patched and written back.
    rmw: Mutex<()>,
    via: Option<Ring>,
    /// Why there is no ring although one was asked for.
    via_refused: Option<String>,
    /// What the NIC's registration attempts on the ring found (set by the server).
    nic_leg: Mutex<Option<String>>,
    moved: Moved,
}

/// Bytes moved per leg, for the listing and the host-memory claim.
#[derive(Debug, Default)]
struct Moved {
    /// Device → CMB (peer to peer).
    dev_to_cmb: AtomicU64,
    /// CMB → device.
    cmb_to_dev: AtomicU64,
    /// Device → host memory.
    dev_to_host: AtomicU64,
    /// Host memory → device.
    host_to_dev: AtomicU64,
    /// CMB → NIC: bytes of ring slots lent to the NIC (peer to peer).
    cmb_to_nic: AtomicU64,
}

/// A ring of staging slots in a CMB, and what its legs were proved to do.
#[derive(Debug)]
struct Ring {
    cmb: Arc<CmbMemory>,
    slot: u64,
    /// Offsets of the free slots (a [`RingLease`] gives its slot back here).
    free: Arc<Mutex<Vec<u64>>>,
    /// Device → CMB works (else why not).
    read: Result<(), String>,
    /// CMB → device works (else why not; read-only regions never try).
    write: Result<(), String>,
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

/// What `via=cmb:DEV:SIZE` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViaCmb {
    /// PCI address or NVMe controller of the CMB.
    pub device: String,
    /// Bytes of the ring.
    pub size: u64,
}

fn sys_err(call: &'static str, context: String, hint: &'static str, e: std::io::Error) -> Error {
    Error::Sys {
        call,
        context,
        hint,
        source: e,
    }
}

/// The logical block size of the block device `meta` describes, from sysfs.
fn logical_block_size(meta: &std::fs::Metadata) -> Option<u64> {
    let rdev = meta.rdev();
    let dir = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    // a partition's queue is its disk's
    let queue = if dir.join("partition").exists() {
        dir.join("../queue")
    } else {
        dir.join("queue")
    };
    std::fs::read_to_string(queue.join("logical_block_size"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl BlockStorage {
    /// Open `path` (a block device, or a regular file on a file system that takes `O_DIRECT`)
    /// for direct I/O, the range `offset..offset + len` (default: to its end), with a CMB
    /// staging ring when `via` asks for one (P2PDMA devices under `sysfs`).
    pub fn open(
        path: &Path,
        range: Option<(u64, u64)>,
        writable: bool,
        via: Option<&ViaCmb>,
        sysfs: &Path,
    ) -> Result<BlockStorage, Error> {
        let shown = path.display();
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| {
                let hint = match e.raw_os_error() {
                    Some(libc::EINVAL) => "the file system does not support O_DIRECT (tmpfs does not): serve it as file:PATH instead",
                    Some(libc::EACCES | libc::EPERM) => "no permission: block devices need root or the disk group",
                    Some(libc::EROFS) => "read-only: add :ro to serve it without puts",
                    Some(libc::EBUSY) => "the device is held exclusively (mounted or in use)",
                    _ => "check the path",
                };
                sys_err("open(O_DIRECT)", format!("{shown}{}", if writable { " read-write" } else { "" }), hint, e)
            })?;
        let meta = file
            .metadata()
            .map_err(|e| sys_err("fstat", shown.to_string(), "check the path", e))?;
        let is_device = meta.file_type().is_block_device();
        let (size, block) = if is_device {
            let size = std::io::Seek::seek(&mut &file, std::io::SeekFrom::End(0)).map_err(|e| {
                sys_err(
                    "lseek(SEEK_END)",
                    shown.to_string(),
                    "the size of the block device",
                    e,
                )
            })?;
            let block = logical_block_size(&meta).ok_or_else(|| Error::Unavailable {
                what: format!("the logical block size of {shown}"),
                reason: "/sys/dev/block/MAJ:MIN/queue/logical_block_size is unreadable".into(),
                fix: "mount sysfs at /sys".into(),
            })?;
            (size, block)
        } else if meta.file_type().is_file() {
            (meta.len(), meta.blksize().max(512))
        } else {
            return Err(Error::InvalidArgument(format!(
                "{shown} is neither a block device nor a regular file"
            )));
        };
        let (base, len) = range.unwrap_or((0, size));
        if len == 0 {
            return Err(Error::InvalidArgument(format!("{shown}: an empty range")));
        }
        check_range(&format!("device {shown}"), base, len, size)?;
        if base % block != 0 || len % block != 0 {
            return Err(Error::InvalidArgument(format!(
                "{shown}: the range {base}+{len} must start and end on the {block}-byte logical \
                 block size (direct I/O)"
            )));
        }
        let mut me = BlockStorage {
            path: path.to_path_buf(),
            file,
            base,
            len,
            block,
            writable,
            is_device,
            rmw: Mutex::new(()),
            via: None,
            via_refused: None,
            nic_leg: Mutex::new(None),
            moved: Moved::default(),
        };
        if let Some(v) = via {
            match CmbMemory::allocate(sysfs, &v.device, v.size) {
                Ok(cmb) => me.via = Some(me.prove_ring(cmb)?),
                Err(e) => {
                    tracing::warn!(path = %shown, error = %e, "no CMB staging ring: host staging");
                    me.via_refused = Some(format!("cmb:{}: {e}", v.device));
                }
            }
        }
        Ok(me)
    }

    /// Build the ring over `cmb` and prove its legs: a read of the region's first slot into
    /// the CMB must give the bytes a read into host memory gives; a write of those same bytes
    /// back from the CMB must read back unchanged (the device's bytes stay what they were).
    fn prove_ring(&self, cmb: CmbMemory) -> Result<Ring, Error> {
        // eight slots (at most 1 MiB each), so that several requests use the ring at once; a
        // whole number of pages (and of blocks) each
        let unit = self.block.max(PAGE);
        let slot = ((cmb.len() / 8).min(PIECE) / unit * unit).max(self.block);
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
        let slots = (cmb.len() / slot).max(1);
        Ok(Ring {
            free: Arc::new(Mutex::new((0..slots).rev().map(|i| i * slot).collect())),
            cmb: Arc::new(cmb),
            slot,
            read,
            write,
        })
    }

    /// `len` bytes at region offset `offset`, cut at multiples of the piece size (a ring slot,
    /// else [`PIECE`]) on the device: (device offset, range in the caller's buffer). The blocks
    /// covering a piece never span more than one piece, so each fits a ring slot.
    fn pieces(&self, offset: u64, len: usize) -> Vec<(u64, std::ops::Range<usize>)> {
        let piece = self.via.as_ref().map_or(PIECE, |r| r.slot);
        let start = self.base + offset;
        let end = start + len as u64;
        let mut out = Vec::new();
        let mut at = start;
        while at < end {
            let next = ((at / piece + 1) * piece).min(end);
            out.push((at, (at - start) as usize..(next - start) as usize));
            at = next;
        }
        out
    }

    /// The CMB ring's memory, for the server to try registering on its NIC (the CMB → NIC
    /// leg); None without a ring.
    pub fn ring(&self) -> Option<Arc<dyn Provider>> {
        self.via
            .as_ref()
            .map(|r| Arc::clone(&r.cmb) as Arc<dyn Provider>)
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
        check_range("region", offset, len, self.len)?;
        let at = self.base + offset;
        let (a0, a1) = self.cover(at, len);
        let skip = at - a0;
        // every slot starts on a page (`prove_ring`): the chunk does when `skip` is one
        if len == 0 || (page_start && skip % PAGE != 0) {
            return Ok(None);
        }
        let Some((ring, slot)) = self.take_slot(false, a1 - a0) else {
            return Ok(None);
        };
        let lease = RingLease {
            free: Arc::clone(&ring.free),
            slot,
            range: slot + skip..slot + skip + len,
        };
        // (a read that fails gives the slot back with the lease)
        cmb_mem(ring).fill_from_fd(slot, (a1 - a0) as usize, self.fd(), a0)?;
        self.moved.dev_to_cmb.fetch_add(a1 - a0, Ordering::Relaxed);
        self.moved.cmb_to_nic.fetch_add(len, Ordering::Relaxed);
        Ok(Some(lease))
    }

    /// Record what registering the ring on the NIC found, for the legs' report.
    pub fn set_nic_leg(&self, what: String) {
        *lock(&self.nic_leg) = Some(what);
    }

    /// The logical block size.
    pub fn block_size(&self) -> u64 {
        self.block
    }

    /// Bytes moved device → CMB and CMB → device (peer to peer), device → host and host →
    /// device, and CMB → NIC (slots lent to the NIC, peer to peer).
    pub fn moved(&self) -> [u64; 5] {
        let m = &self.moved;
        [
            m.dev_to_cmb.load(Ordering::Relaxed),
            m.cmb_to_dev.load(Ordering::Relaxed),
            m.dev_to_host.load(Ordering::Relaxed),
            m.host_to_dev.load(Ordering::Relaxed),
            m.cmb_to_nic.load(Ordering::Relaxed),
        ]
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Read aligned `out` at absolute `at` straight from the device (out's address aligned).
    fn read_direct(&self, at: u64, out: &mut [u8]) -> Result<(), Error> {
        self.file.read_exact_at(out, at).map_err(|e| {
            sys_err(
                "pread(O_DIRECT)",
                format!("{} bytes at {at} of {}", out.len(), self.path.display()),
                "an I/O error of the device, or a range past its end",
                e,
            )
        })
    }

    fn write_direct(&self, at: u64, data: &[u8]) -> Result<(), Error> {
        self.file.write_all_at(data, at).map_err(|e| {
            sys_err(
                "pwrite(O_DIRECT)",
                format!("{} bytes at {at} of {}", data.len(), self.path.display()),
                "an I/O error of the device",
                e,
            )
        })
    }

    fn aligned(&self, v: u64) -> bool {
        v % self.block == 0
    }

    /// The block-aligned range covering `at..at + len`.
    fn cover(&self, at: u64, len: u64) -> (u64, u64) {
        let a0 = at / self.block * self.block;
        let a1 = (at + len).div_ceil(self.block) * self.block;
        (a0, a1)
    }

    /// A free ring slot for `span` bytes whose leg (`write`: CMB → device) was proved.
    fn take_slot(&self, write: bool, span: u64) -> Option<(&Ring, u64)> {
        let ring = self.via.as_ref()?;
        let ok = if write { &ring.write } else { &ring.read };
        ok.as_ref().ok()?;
        if span > ring.slot {
            return None;
        }
        let slot = lock(&ring.free).pop()?;
        Some((ring, slot))
    }

    fn give_slot(ring: &Ring, slot: u64) {
        lock(&ring.free).push(slot);
    }

    /// One piece (at most [`PIECE`] bytes) of a read.
    fn read_piece(&self, at: u64, out: &mut [u8]) -> Result<(), Error> {
        let (a0, a1) = self.cover(at, out.len() as u64);
        let span = (a1 - a0) as usize;
        let skip = (at - a0) as usize;
        if let Some((ring, slot)) = self.take_slot(false, span as u64) {
            let mem = cmb_mem(ring);
            let r = mem
                .fill_from_fd(slot, span, self.fd(), a0)
                .and_then(|()| mem.read_at(slot + skip as u64, out));
            Self::give_slot(ring, slot);
            r?;
            self.moved
                .dev_to_cmb
                .fetch_add(span as u64, Ordering::Relaxed);
            return Ok(());
        }
        if skip == 0 && span == out.len() && self.aligned(out.as_ptr() as u64) {
            // the device DMAs straight into the caller's (staging) buffer
            self.read_direct(a0, out)?;
        } else {
            let mut tmp = HostBuffer::new(span)?;
            self.read_direct(a0, tmp.as_mut_slice())?;
            out.copy_from_slice(&tmp.as_slice()[skip..skip + out.len()]);
        }
        self.moved
            .dev_to_host
            .fetch_add(span as u64, Ordering::Relaxed);
        Ok(())
    }

    /// One piece of a write.
    fn write_piece(&self, at: u64, data: &[u8]) -> Result<(), Error> {
        let (a0, a1) = self.cover(at, data.len() as u64);
        let span = (a1 - a0) as usize;
        let skip = (at - a0) as usize;
        let edges = self.edges(skip, data.len(), span);
        // a partly covered block is read, patched and written under the lock
        let _rmw = (!edges.is_empty()).then(|| lock(&self.rmw));
        if let Some((ring, slot)) = self.take_slot(true, span as u64) {
            let mem = cmb_mem(ring);
            let fd = self.fd();
            let r = edges
                .iter()
                .try_for_each(|&o| mem.fill_from_fd(slot + o, self.block as usize, fd, a0 + o))
                .and_then(|()| mem.write_at(slot + skip as u64, data))
                .and_then(|()| mem.drain_to_fd(slot, span, fd, a0));
            Self::give_slot(ring, slot);
            r?;
            self.moved
                .cmb_to_dev
                .fetch_add(span as u64, Ordering::Relaxed);
            return Ok(());
        }
        if edges.is_empty() && self.aligned(data.as_ptr() as u64) {
            // the device DMAs straight out of the caller's (staging) buffer
            self.write_direct(a0, data)?;
        } else {
            let mut tmp = HostBuffer::new(span)?;
            let buf = tmp.as_mut_slice();
            for &o in &edges {
                let o = o as usize;
                self.read_direct(a0 + o as u64, &mut buf[o..o + self.block as usize])?;
            }
            buf[skip..skip + data.len()].copy_from_slice(data);
            self.write_direct(a0, tmp.as_slice())?;
        }
        self.moved
            .host_to_dev
            .fetch_add(span as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The offsets (in the covering span) of the blocks a write of `len` bytes at `skip`
    /// covers only partly: they are read first, then patched.
    fn edges(&self, skip: usize, len: usize, span: usize) -> Vec<u64> {
        let b = self.block as usize;
        let mut v = Vec::new();
        if skip != 0 {
            v.push(0);
        }
        let last = (span - b) as u64;
        if (skip + len) % b != 0 && v.last() != Some(&last) {
            v.push(last);
        }
        v
    }
}

fn cmb_mem(ring: &Ring) -> &Arc<SharedMemory> {
    ring.cmb.mapping().expect("a CMB has a CPU mapping").0
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

impl Provider for BlockStorage {
    fn kind(&self) -> &'static str {
        "nvme"
    }
    fn describe(&self) -> String {
        format!(
            "{} bytes of {} {} at {} (direct I/O, {}-byte blocks){}",
            self.len,
            if self.is_device {
                "block device"
            } else {
                "file"
            },
            self.path.display(),
            self.base,
            self.block,
            match &self.via {
                Some(r) => format!(
                    ", staged through {} bytes of the CMB of {}",
                    r.cmb.len(),
                    r.cmb.device().bdf
                ),
                None => String::new(),
            }
        )
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn writable(&self) -> bool {
        self.writable
    }
    fn mapping(&self) -> Option<(&Arc<SharedMemory>, u64)> {
        None
    }
    fn no_mapping_reason(&self) -> Option<String> {
        Some(format!(
            "the bytes live on {}: a NIC cannot address block storage, so they are staged",
            self.path.display()
        ))
    }
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }
    fn copy_engine(&self) -> &'static str {
        "O_DIRECT pread/pwrite"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("region", offset, out.len() as u64, self.len)?;
        for (at, range) in self.pieces(offset, out.len()) {
            self.read_piece(at, &mut out[range])?;
        }
        Ok(())
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        if !self.writable {
            return Err(Error::InvalidArgument(format!(
                "{} is served read-only",
                self.path.display()
            )));
        }
        check_range("region", offset, data.len() as u64, self.len)?;
        for (at, range) in self.pieces(offset, data.len()) {
            self.write_piece(at, &data[range])?;
        }
        Ok(())
    }
    fn sync(&self, _offset: u64, _len: u64) -> Result<(), Error> {
        // direct I/O bypasses the page cache, not the device's volatile write cache
        self.file.sync_data().map_err(|e| {
            sys_err(
                "fdatasync",
                self.path.display().to_string(),
                "the device could not flush its write cache",
                e,
            )
        })
    }
    fn holds_data(&self) -> bool {
        true
    }
    fn residency(&self) -> Option<String> {
        let [dc, cd, dh, hd, cn] = self.moved();
        Some(format!(
            "moved: device → CMB {}, CMB → device {}, device → host {}, host → device {}, \
             CMB → NIC {}",
            mib(dc),
            mib(cd),
            mib(dh),
            mib(hd),
            mib(cn)
        ))
    }
}

impl BlockStorage {
    /// Each leg and why, for the region's reason.
    pub fn legs_plan(&self) -> String {
        match (&self.via, &self.via_refused) {
            (None, None) => "device → host staging by direct I/O".into(),
            (None, Some(why)) => {
                format!("device → host staging by direct I/O; no CMB staging ring: {why}")
            }
            (Some(r), _) => {
                let leg = |r: &Result<(), String>, p2p: &str| match r {
                    Ok(()) => format!("{p2p}: peer to peer, verified"),
                    Err(why) => format!("{p2p}: through host memory ({why})"),
                };
                format!(
                    "{}; {}; CMB → NIC: {}",
                    leg(&r.read, "device → CMB"),
                    leg(&r.write, "CMB → device"),
                    lock(&self.nic_leg).clone().unwrap_or_else(|| {
                        "not tried: the CPU copies each slot to host staging".into()
                    })
                )
            }
        }
    }
}

#[cfg(test)]
mod tests;
