//! Real device-private pages: the kernel's HMM test driver (`test_hmm`, `/dev/hmm_dmirrorN`).
//!
//! The driver mirrors this process's address space and owns a pool of `MEMORY_DEVICE_PRIVATE`
//! pages. [`DmirrorMemory`] is anonymous memory of this process whose pages the driver migrates
//! to its device-private memory on request (`HMM_DMIRROR_MIGRATE_TO_DEV`): the CPU page tables
//! then hold device-private swap entries, which the CPU cannot access and a NIC cannot map. What
//! happens next is the kernel's own behaviour, which this provider exposes rather than hides:
//!
//! - a CPU access faults the page back to system RAM (the driver's `migrate_to_ram`);
//! - an ODP registration leaves the pages on the device; the NIC's first access faults them back
//!   through `hmm_range_fault` (rxe does this);
//! - a pinned registration faults every page back to RAM when it pins them, and pinned pages
//!   can no longer be migrated to the device (the ioctl fails with ENOENT).
//!
//! So ODP is preferred (the pages stay on the device until touched), pinned is the fallback,
//! and the canary decides; [`DmirrorMemory::residency`] reads the driver's snapshot so `ls` and
//! `doctor` show where each page is before and after an access.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use verbs::{RegMode, SharedMemory};

use crate::error::Error;
use crate::provider::{check_range, Provider};

/// The first mirror device of `test_hmm` (device-private memory).
pub const DEFAULT_DEVICE: &str = "/dev/hmm_dmirror0";

/// `struct hmm_dmirror_cmd` of the driver's uapi (`lib/test_hmm_uapi.h`): five `__u64`.
#[repr(C)]
#[derive(Debug, Default)]
struct Cmd {
    addr: u64,
    ptr: u64,
    npages: u64,
    cpages: u64,
    faults: u64,
}

/// `_IOWR('H', nr, struct hmm_dmirror_cmd)`.
const fn iowr(nr: u64) -> u64 {
    (3 << 30) | ((std::mem::size_of::<Cmd>() as u64) << 16) | ((b'H' as u64) << 8) | nr
}
const MIGRATE_TO_DEV: u64 = iowr(2);
const MIGRATE_TO_SYS: u64 = iowr(3);
const SNAPSHOT: u64 = iowr(4);

// snapshot bytes (one per page)
const PROT_READ: u8 = 0x01;
const PROT_WRITE: u8 = 0x02;
const PROT_ZERO: u8 = 0x10;
const PROT_ERROR: u8 = 0xFF;

/// Where the pages of a range are, by the driver's snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PageResidency {
    /// Pages in this mirror's device-private memory.
    pub device: u64,
    /// Pages in another device's private or coherent memory.
    pub other_device: u64,
    /// Pages in system RAM (including the shared zero page).
    pub host: u64,
    /// Pages not populated.
    pub unpopulated: u64,
    /// Pages the driver could not report.
    pub unknown: u64,
}

impl PageResidency {
    /// Classify the driver's per-page snapshot bytes.
    pub fn from_snapshot(bytes: &[u8]) -> PageResidency {
        let mut r = PageResidency::default();
        for &b in bytes {
            match b {
                PROT_ERROR => r.unknown += 1,
                b if b & 0xF0 == 0x20 => r.device += 1,
                b if matches!(b & 0xF0, 0x30..=0x50) => r.other_device += 1,
                b if b & PROT_ZERO != 0 || b & (PROT_READ | PROT_WRITE) != 0 => r.host += 1,
                _ => r.unpopulated += 1,
            }
        }
        r
    }

    /// Pages counted.
    pub fn total(&self) -> u64 {
        self.device + self.other_device + self.host + self.unpopulated + self.unknown
    }
}

impl std::fmt::Display for PageResidency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} pages device-private, {} in host RAM",
            self.device,
            self.total(),
            self.host
        )?;
        if self.unpopulated > 0 {
            write!(f, ", {} not populated", self.unpopulated)?;
        }
        if self.other_device > 0 {
            write!(f, ", {} on another device", self.other_device)?;
        }
        if self.unknown > 0 {
            write!(f, ", {} unknown", self.unknown)?;
        }
        Ok(())
    }
}

/// Anonymous memory of this process migrated to the HMM test driver's device-private pages.
#[derive(Debug)]
pub struct DmirrorMemory {
    mem: Arc<SharedMemory>,
    dev: File,
    path: PathBuf,
    len: u64,
    page: u64,
}

impl DmirrorMemory {
    /// `len` bytes (rounded up to whole pages) mirrored by the driver at `device`
    /// ([`DEFAULT_DEVICE`] when `None`); the pages stay in host RAM until
    /// [`DmirrorMemory::migrate_to_device`].
    pub fn new(device: Option<&Path>, len: u64) -> Result<DmirrorMemory, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a device-private region needs at least 1 byte".into(),
            ));
        }
        let path = device.unwrap_or(Path::new(DEFAULT_DEVICE)).to_path_buf();
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENXIO) | Some(libc::ENODEV) => Error::Unavailable {
                    what: format!("HMM device-private memory ({})", path.display()),
                    reason: format!(
                        "{}: the kernel's HMM test driver (test_hmm) is not loaded; it exists only in kernels with CONFIG_DEVICE_PRIVATE, and Debian does not ship it",
                        e
                    ),
                    fix: "build and load lib/test_hmm.c for the running kernel (the soft-RoCE lab does this for its 7.3 guest: soft-roce/lab --kernel 7.3), or serve devpriv:memfd".into(),
                },
                _ => Error::Sys {
                    call: "open",
                    context: path.display().to_string(),
                    hint: "the HMM test driver's device must be readable and writable (root)",
                    source: e,
                },
            })?;
        let page = crate::udmabuf::page_size() as u64;
        let rounded = len.div_ceil(page) * page;
        let n = usize::try_from(rounded)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        let mem = Arc::new(SharedMemory::anonymous_base_pages(n)?);
        Ok(DmirrorMemory {
            mem,
            dev,
            path,
            len,
            page,
        })
    }

    fn pages(&self, range: &std::ops::Range<u64>) -> Result<(u64, u64), Error> {
        check_range(
            "device-private memory",
            range.start,
            range.end.saturating_sub(range.start),
            self.len,
        )?;
        let first = range.start / self.page;
        let last = range.end.div_ceil(self.page);
        Ok((first, last - first))
    }

    /// Issue one request on `npages` pages from page `first`; returns the command as the driver
    /// updated it and the buffer it may have written (one byte per page for a snapshot).
    fn cmd(
        &self,
        req: u64,
        name: &'static str,
        first: u64,
        npages: u64,
    ) -> Result<(Cmd, Vec<u8>), Error> {
        // a snapshot writes one byte per page through `ptr`; for the other requests, give the
        // driver room for a page of data per page, whatever it does with `ptr`
        let room = if req == SNAPSHOT {
            npages
        } else {
            npages * self.page
        };
        let mut out = vec![0u8; room as usize];
        let mut c = Cmd {
            addr: self.mem.addr() + first * self.page,
            ptr: out.as_mut_ptr() as u64,
            npages,
            ..Cmd::default()
        };
        // SAFETY: the ioctl takes a pointer to a `struct hmm_dmirror_cmd`, which `Cmd`
        // reproduces (repr(C), five u64). `addr..addr + npages pages` lies inside our own
        // mapping (checked by `pages`), which the driver only migrates (the memory stays
        // ours; its contents are preserved); `ptr` points to `out`, which is large enough for
        // what the request writes (a snapshot: one byte per page) and outlives the call.
        let r = unsafe { libc::ioctl(self.dev.as_raw_fd(), req as _, &mut c as *mut Cmd) };
        if r < 0 {
            return Err(crate::error::sys(
                name,
                format!(
                    "{} pages at +{} of {} bytes through {}",
                    npages,
                    first * self.page,
                    self.len,
                    self.path.display()
                ),
                "the HMM test driver refused (ENOENT: pages pinned by an RDMA registration cannot migrate; ENOMEM: its device memory is exhausted)",
            ));
        }
        Ok((c, out))
    }

    /// Migrate the pages of `range` to device-private memory; returns how many moved.
    pub fn migrate_to_device(&self, range: std::ops::Range<u64>) -> Result<u64, Error> {
        let (first, n) = self.pages(&range)?;
        let (c, _) = self.cmd(
            MIGRATE_TO_DEV,
            "ioctl(HMM_DMIRROR_MIGRATE_TO_DEV)",
            first,
            n,
        )?;
        tracing::debug!(
            pages = n,
            migrated = c.cpages,
            "migrated to device-private memory"
        );
        Ok(c.cpages)
    }

    /// Migrate the pages of `range` back to system RAM; returns how many moved.
    pub fn migrate_to_host(&self, range: std::ops::Range<u64>) -> Result<u64, Error> {
        let (first, n) = self.pages(&range)?;
        let (c, _) = self.cmd(
            MIGRATE_TO_SYS,
            "ioctl(HMM_DMIRROR_MIGRATE_TO_SYS)",
            first,
            n,
        )?;
        Ok(c.cpages)
    }

    /// Where the pages of the whole region are now.
    pub fn residency(&self) -> Result<PageResidency, Error> {
        let (first, n) = self.pages(&(0..self.len))?;
        let (_, snap) = self.cmd(SNAPSHOT, "ioctl(HMM_DMIRROR_SNAPSHOT)", first, n)?;
        Ok(PageResidency::from_snapshot(&snap[..n as usize]))
    }

    /// The driver's device file.
    pub fn device(&self) -> &Path {
        &self.path
    }
}

impl Provider for DmirrorMemory {
    fn kind(&self) -> &'static str {
        "devpriv"
    }
    fn describe(&self) -> String {
        let now = match self.residency() {
            Ok(r) => r.to_string(),
            Err(e) => format!("residency unknown: {e}"),
        };
        format!(
            "{} bytes of HMM device-private memory ({}): {now}",
            self.len,
            self.path.display()
        )
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn writable(&self) -> bool {
        true
    }
    fn mapping(&self) -> Option<(&Arc<SharedMemory>, u64)> {
        Some((&self.mem, 0))
    }
    fn dmabuf(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        None
    }
    fn no_dmabuf_reason(&self) -> Option<String> {
        Some("HMM device-private pages have no dma-buf exporter".into())
    }
    fn copy_engine(&self) -> &'static str {
        "CPU (each device-private page touched faults back to host RAM)"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("device-private memory", offset, out.len() as u64, self.len)?;
        Ok(self.mem.read_at(offset, out)?)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        check_range("device-private memory", offset, data.len() as u64, self.len)?;
        Ok(self.mem.write_at(offset, data)?)
    }
    fn registration_order(&self) -> Vec<RegMode> {
        // pinning faults every page back to RAM; ODP leaves them on the device until the NIC
        // touches them
        vec![RegMode::OnDemand, RegMode::Pinned]
    }
    fn residency(&self) -> Option<String> {
        Some(match self.residency() {
            Ok(r) => r.to_string(),
            Err(e) => format!("unknown: {e}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ioctl_numbers_match_the_uapi() {
        // _IOWR('H', 2..4, 40-byte struct)
        assert_eq!(MIGRATE_TO_DEV, 0xC028_4802);
        assert_eq!(MIGRATE_TO_SYS, 0xC028_4803);
        assert_eq!(SNAPSHOT, 0xC028_4804);
    }

    #[test]
    fn snapshot_bytes_are_classified() {
        let r = PageResidency::from_snapshot(&[0x20, 0x23, 0x03, 0x01, 0x10, 0x00, 0x30, 0xFF]);
        assert_eq!(
            r,
            PageResidency {
                device: 2,
                other_device: 1,
                host: 3,
                unpopulated: 1,
                unknown: 1
            }
        );
        assert_eq!(
            r.to_string(),
            "2 of 8 pages device-private, 3 in host RAM, 1 not populated, 1 on another device, 1 unknown"
        );
    }

    #[test]
    fn without_the_driver_the_error_says_what_is_missing() {
        let e = DmirrorMemory::new(Some(Path::new("/dev/hmm_dmirror_absent")), 4096).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("test_hmm") && s.contains("CONFIG_DEVICE_PRIVATE"),
            "{s}"
        );
        assert!(s.contains("devpriv:memfd"), "{s}");
    }
}
