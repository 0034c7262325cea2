//! Block storage (an NVMe namespace, or a file) as a region's memory: the bytes live on the
//! device, the NIC cannot address them, and the copy engine is direct I/O (`O_DIRECT`
//! `pread`/`pwrite`), so served bytes never sit in the page cache.
//!
//! Two ways for bytes to go between the device and the network:
//!
//! - **host staging** (every copy): the device DMAs straight into (out of) the bounce path's
//!   staging buffer when the request is aligned to the logical block size, else into an
//!   aligned buffer the CPU copies;
//! - **through a CMB ring** (`via`, peer to peer only): the device DMAs into a slot of a ring
//!   allocated in an NVMe controller memory buffer (P2PDMA) and the NIC reads the slot itself
//!   ([`BlockStorage::lend_slot`]), or the NIC writes a put's chunk into a slot and the device
//!   takes it from there ([`BlockStorage::lend_slot_for_put`]). Each leg is proved at open
//!   (`O_DIRECT` into p2pmem is accepted and the bytes match what a read into host memory
//!   gives). A chunk that does not go through the ring this way goes between the device and
//!   host staging by direct I/O, never through a slot: a CPU copy out of (into) the CMB would
//!   cross host memory all the same, and the CPU's reads of a device's BAR are slow (in the
//!   lab a `memcpy` out of the emulated CMB runs at about 185 MiB/s, 5.4 ms of CPU per MiB),
//!   where the device's own DMA into host memory takes no CPU.
//!
//! Writes that cover a block only partly read, patch and write that block under one lock, so
//! two puts that share a block never lose each other's bytes: in host memory, or in the ring
//! slot a put's chunk landed in (only the block's other bytes, read from the device, cross
//! host memory then).
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use verbs::{HostBuffer, SharedMemory};

use crate::cmb::CmbMemory;
use crate::error::Error;
use crate::provider::{check_range, Provider};

/// The largest piece one direct I/O moves (requests are split into pieces of this size).
const PIECE: u64 = 1 << 20;

/// What happens to a fetch's chunk the ring does not lend to the NIC (for the legs' report).
pub const FETCH_STAGED: &str =
    "each chunk goes from the device to host staging by direct I/O, not through the ring";

/// What happens to a put's chunk the NIC does not write into the ring (for the legs' report).
pub const PUT_STAGED: &str =
    "each put goes from host staging to the device by direct I/O, not through the ring";

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
    /// Held exclusively while a partly covered block is read, patched and written back, and
    /// shared while whole blocks are written: a whole-block put cannot fall between the read
    /// and the write of a patch (which would write the block's old bytes back over it).
    rmw: RwLock<()>,
    via: Option<Ring>,
    /// Why there is no ring although one was asked for.
    via_refused: Option<String>,
    /// What the NIC's registration attempts on the ring found (set by the server): CMB → NIC,
    /// NIC → CMB.
    nic_leg: Mutex<Option<(String, String)>>,
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
    /// NIC → CMB: bytes of puts the NIC wrote into ring slots (peer to peer).
    nic_to_cmb: AtomicU64,
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
    /// staging ring when `via` asks for one (P2PDMA devices under `sysfs`). `chunk` is the
    /// largest chunk the caller lends through one slot (the server's bounce chunk): the ring's
    /// slots are at least that long where the ring holds one (see `prove_ring`).
    pub fn open(
        path: &Path,
        range: Option<(u64, u64)>,
        writable: bool,
        via: Option<&ViaCmb>,
        chunk: u64,
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
            rmw: RwLock::new(()),
            via: None,
            via_refused: None,
            nic_leg: Mutex::new(None),
            moved: Moved::default(),
        };
        if let Some(v) = via {
            match CmbMemory::allocate(sysfs, &v.device, v.size) {
                Ok(cmb) => {
                    me.via = Some(me.prove_ring(cmb, chunk)?);
                    if me
                        .via
                        .as_ref()
                        .is_some_and(|r| r.read.is_err() && r.write.is_err())
                    {
                        me.give_back_ring(
                            "no chunk can go through it: neither of the device's legs to the \
                             CMB is peer to peer",
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(path = %shown, error = %e, "no CMB staging ring: host staging");
                    me.via_refused = Some(format!("cmb:{}: {e}", v.device));
                }
            }
        }
        Ok(me)
    }

    /// `len` bytes at region offset `offset`, cut at multiples of [`PIECE`] on the device:
    /// (device offset, range in the caller's buffer). The blocks covering a piece never span
    /// more than one piece.
    fn pieces(&self, offset: u64, len: usize) -> Vec<(u64, std::ops::Range<usize>)> {
        let start = self.base + offset;
        let end = start + len as u64;
        let mut out = Vec::new();
        let mut at = start;
        while at < end {
            let next = ((at / PIECE + 1) * PIECE).min(end);
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
            .and_then(Ring::memory)
            .map(|m| m as Arc<dyn Provider>)
    }

    /// Record what registering the ring on the NIC found, for the legs' report: the CMB →
    /// NIC leg (fetches) and the NIC → CMB leg (puts); `nic`: whether the NIC was proved to
    /// read ring slots and to write them. Whether the ring is kept: one that no chunk can go
    /// through is given back to the CMB ([`BlockStorage::keep_ring_if_used`]), and the caller
    /// drops its registration of the ring too.
    pub fn set_nic_legs(&self, (reads, puts): (String, String), nic: (bool, bool)) -> bool {
        *lock(&self.nic_leg) = Some((reads, puts));
        self.keep_ring_if_used(nic.0, nic.1)
    }

    /// The logical block size.
    pub fn block_size(&self) -> u64 {
        self.block
    }

    /// Bytes moved device → CMB and CMB → device (peer to peer), device → host and host →
    /// device, CMB → NIC (slots lent to the NIC) and NIC → CMB (puts the NIC wrote into
    /// slots), both peer to peer.
    pub fn moved(&self) -> [u64; 6] {
        let m = &self.moved;
        [
            m.dev_to_cmb.load(Ordering::Relaxed),
            m.cmb_to_dev.load(Ordering::Relaxed),
            m.dev_to_host.load(Ordering::Relaxed),
            m.host_to_dev.load(Ordering::Relaxed),
            m.cmb_to_nic.load(Ordering::Relaxed),
            m.nic_to_cmb.load(Ordering::Relaxed),
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

    /// One piece (at most [`PIECE`] bytes) of a read.
    fn read_piece(&self, at: u64, out: &mut [u8]) -> Result<(), Error> {
        let (a0, a1) = self.cover(at, out.len() as u64);
        let span = (a1 - a0) as usize;
        let skip = (at - a0) as usize;
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
        // a partly covered block is read, patched and written under the exclusive lock, whole
        // blocks under the shared one
        let (_patch, _whole);
        if edges.is_empty() {
            _whole = self.whole_blocks();
        } else {
            _patch = self.patching();
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

    /// The shared side of the block lock, held while whole blocks are written (see `rmw`).
    fn whole_blocks(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.rmw.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The exclusive side of the block lock, held while partly covered blocks are read,
    /// patched and written (see `rmw`).
    fn patching(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.rmw.write().unwrap_or_else(|p| p.into_inner())
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
                Some(r) if r.memory().is_some() =>
                    format!(", staged through {} bytes of the CMB of {}", r.len, r.bdf),
                Some(r) => format!(
                    ", its ring of {} bytes given back to the CMB of {}",
                    r.len, r.bdf
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
    fn copies_wait(&self) -> bool {
        true
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
        let [dc, cd, dh, hd, cn, nc] = self.moved();
        Some(format!(
            "moved: device → CMB {}, CMB → device {}, device → host {}, host → device {}, \
             CMB → NIC {}, NIC → CMB {}",
            mib(dc),
            mib(cd),
            mib(dh),
            mib(hd),
            mib(cn),
            mib(nc)
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
                let (reads, puts) = lock(&self.nic_leg).clone().unwrap_or_else(|| {
                    (
                        format!("not tried: {}", crate::block::FETCH_STAGED),
                        format!("not tried: {}", crate::block::PUT_STAGED),
                    )
                });
                let given_back = lock(&r.given_back)
                    .as_ref()
                    .map(|why| format!(", given back to the CMB ({why})"))
                    .unwrap_or_default();
                format!(
                    "a ring of {} slots of {} KiB{given_back}; {}; {}; CMB → NIC: {reads}; NIC → \
                     CMB: {puts}",
                    r.slots(),
                    r.slot >> 10,
                    leg(&r.read, "device → CMB"),
                    leg(&r.write, "CMB → device"),
                )
            }
        }
    }
}

mod ring;
use ring::Ring;
pub use ring::RingLease;

#[cfg(test)]
mod tests;
