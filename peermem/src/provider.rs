//! Memory providers: where a region's bytes live, how a NIC may reach them, and how the CPU (or
//! a device's copy engine) moves them in and out.
//!
//! A provider offers up to two ways for a NIC to reach its memory — a CPU mapping that can be
//! registered pinned or on demand ([`Provider::mapping`]), and a dma-buf ([`Provider::dmabuf`])
//! — and always a copy engine ([`Provider::copy_out`] / [`Provider::copy_in`]) that the bounce
//! path uses when no direct registration works.

use std::fmt;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use verbs::{RegMode, SharedMemory};

use crate::error::Error;
use crate::udmabuf::Udmabuf;

/// One kind of memory a region may live in.
pub trait Provider: AsAny + Send + Sync + fmt::Debug {
    /// Short name: "host", "host-huge", "file", "cmb", "dmabuf", "cuda".
    fn kind(&self) -> &'static str;
    /// One line for humans: what and where.
    fn describe(&self) -> String;
    /// Bytes.
    fn len(&self) -> u64;
    /// Whether empty (providers are never empty).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether remote peers may write it.
    fn writable(&self) -> bool;
    /// A CPU mapping of this memory that a NIC may register pinned or on demand, with the
    /// offset of byte 0 of this provider inside it. `None` when the memory has no such mapping
    /// (a dma-buf exporter's memory, device-private memory).
    fn mapping(&self) -> Option<(&Arc<SharedMemory>, u64)>;
    /// The PCI function (`DDDD:BB:DD.F`) whose memory this is, for the topology doctor's plan.
    fn pci_device(&self) -> Option<String> {
        None
    }
    /// Why [`Provider::mapping`] is `None`, when the provider knows better than "no CPU mapping".
    fn no_mapping_reason(&self) -> Option<String> {
        None
    }
    /// A dma-buf of this memory and the offset of byte 0 in it, for `ibv_reg_dmabuf_mr`.
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)>;
    /// Why [`Provider::dmabuf`] is `None`, when the provider knows (an export the driver refused).
    fn no_dmabuf_reason(&self) -> Option<String> {
        None
    }
    /// How [`Provider::copy_out`] / [`Provider::copy_in`] move bytes (for reports).
    fn copy_engine(&self) -> &'static str;
    /// Whether [`Provider::copy_out`] / [`Provider::copy_in`] may wait on a device (direct
    /// I/O to block storage, page faults of a mapped file) rather than only move bytes in
    /// memory: an async caller runs such copies where the wait holds up no other task.
    fn copies_wait(&self) -> bool {
        false
    }
    /// Copy `out.len()` bytes at `offset` out of the memory.
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error>;
    /// Copy `data` into the memory at `offset`.
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error>;
    /// Make what [`Provider::copy_in`] wrote to `offset..offset + len` durable (a file:
    /// `fdatasync`). Memory that does not persist has nothing to do. Memory that does not
    /// [`Provider::holds_data`] must not need this: clients do not ask a flush of it.
    fn sync(&self, offset: u64, len: u64) -> Result<(), Error> {
        let _ = (offset, len);
        Ok(())
    }
    /// Whether the bytes were there before the server (a file, memory of the embedding
    /// application, a dma-buf handed in): only clients' puts may change them, so a canary never
    /// writes into such memory, and remote peers do not get to RDMA-WRITE it directly (puts go
    /// through the server, which can make them durable).
    fn holds_data(&self) -> bool {
        false
    }
    /// Whether the memory is still valid (not freed or moved by its owner). Registrations and
    /// copies check this first and refuse to touch invalidated memory.
    fn check_valid(&self) -> Result<(), Error> {
        Ok(())
    }
    /// Registration strategies to attempt, best first, when the user did not force one.
    fn registration_order(&self) -> Vec<RegMode> {
        vec![RegMode::DmaBuf, RegMode::Pinned, RegMode::OnDemand]
    }
    /// Where the pages are now (device-private memory: on the device, migrated to host RAM,
    /// freed; P2P window use), for `ls` and `doctor`. `None` for memory that does not move.
    fn residency(&self) -> Option<String> {
        None
    }
}

/// The concrete type behind a `dyn Provider`, for kinds that offer more than the trait
/// (`hmm::DevicePrivate::of`): the trait itself names no provider type.
pub trait AsAny {
    /// `self` as `Any`.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// `offset..offset+len` within `size`, without overflow.
pub(crate) fn check_range(what: &str, offset: u64, len: u64, size: u64) -> Result<(), Error> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {offset}+{len} is outside the {size}-byte {what}"
        ))),
    }
}

/// Host RAM (anonymous, huge pages) or a mapped file, or a window of such memory owned by an
/// embedding application.
#[derive(Debug, Clone)]
pub struct HostMemory {
    mem: Arc<SharedMemory>,
    offset: u64,
    len: u64,
    writable: bool,
    /// Memory the server did not allocate itself (see [`Provider::holds_data`]).
    holds_data: bool,
}

impl HostMemory {
    /// Zeroed anonymous memory (from huge pages if `huge`).
    pub fn anonymous(len: u64, huge: bool) -> Result<HostMemory, Error> {
        let n = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        Ok(HostMemory {
            holds_data: false,
            ..Self::whole(Arc::new(SharedMemory::anonymous(n, huge)?))
        })
    }

    /// The whole of a file, mapped shared (read-only unless `writable`).
    pub fn file(file: &File, writable: bool) -> Result<HostMemory, Error> {
        Ok(Self::whole(Arc::new(SharedMemory::file(file, writable)?)))
    }

    /// All of `mem` (memory handed in: it holds data, see [`Provider::holds_data`]).
    pub fn whole(mem: Arc<SharedMemory>) -> HostMemory {
        let len = mem.len() as u64;
        let writable = mem.writable();
        HostMemory {
            mem,
            offset: 0,
            len,
            writable,
            holds_data: true,
        }
    }

    /// `len` bytes of `mem` from `offset` (writable only if the memory is and `writable`).
    pub fn window(
        mem: Arc<SharedMemory>,
        offset: u64,
        len: u64,
        writable: bool,
    ) -> Result<HostMemory, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument("an empty window".into()));
        }
        check_range("memory", offset, len, mem.len() as u64)?;
        let writable = writable && mem.writable();
        Ok(HostMemory {
            mem,
            offset,
            len,
            writable,
            holds_data: true,
        })
    }
}

impl Provider for HostMemory {
    fn kind(&self) -> &'static str {
        self.mem.kind()
    }
    fn describe(&self) -> String {
        format!(
            "{} bytes of {} memory{}",
            self.len,
            self.mem.kind(),
            if self.offset > 0 || self.len < self.mem.len() as u64 {
                format!(" (window at {} of {})", self.offset, self.mem.len())
            } else {
                String::new()
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
        Some((&self.mem, self.offset))
    }
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }
    fn copy_engine(&self) -> &'static str {
        "CPU copy"
    }
    fn copies_wait(&self) -> bool {
        // a mapped file faults its pages in from the disk
        self.mem.kind() == "file"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("region", offset, out.len() as u64, self.len)?;
        Ok(self.mem.read_at(self.offset + offset, out)?)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        if !self.writable {
            return Err(Error::InvalidArgument("the memory is read-only".into()));
        }
        check_range("region", offset, data.len() as u64, self.len)?;
        Ok(self.mem.write_at(self.offset + offset, data)?)
    }
    fn sync(&self, offset: u64, len: u64) -> Result<(), Error> {
        check_range("region", offset, len, self.len)?;
        Ok(self.mem.sync(self.offset + offset, len)?)
    }
    fn holds_data(&self) -> bool {
        self.holds_data
    }
}

/// Memory a NIC reaches only as a dma-buf: the built-in exporter (a memfd exported through
/// `/dev/udmabuf`; copy engine: `pread`/`pwrite` on the memfd), or a dma-buf fd handed in by an
/// embedding application (copy engine: the CPU through an `mmap` of the dma-buf, which its
/// exporter must support).
#[derive(Debug)]
pub struct DmaBufMemory {
    inner: DmaBufInner,
    len: u64,
}

#[derive(Debug)]
enum DmaBufInner {
    Udmabuf(Udmabuf),
    Foreign { fd: OwnedFd, map: SharedMemory },
}

impl DmaBufMemory {
    /// `len` bytes from the built-in exporter (rounded up to whole pages).
    pub fn udmabuf(len: u64) -> Result<DmaBufMemory, Error> {
        let page = crate::udmabuf::page_size() as u64;
        let rounded = len
            .checked_add(page - 1)
            .map(|v| v / page * page)
            .filter(|&v| v > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("bad dma-buf size {len}")))?;
        let n = usize::try_from(rounded)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        Ok(DmaBufMemory {
            inner: DmaBufInner::Udmabuf(Udmabuf::create(n)?),
            len,
        })
    }

    /// A dma-buf exported by someone else (a GPU or accelerator driver), `len` bytes. The
    /// exporter must support `mmap` of the dma-buf, which is this provider's copy engine.
    pub fn from_fd(fd: OwnedFd, len: u64) -> Result<DmaBufMemory, Error> {
        let n = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        let file = File::from(fd.try_clone().map_err(|e| Error::Sys {
            call: "dup",
            context: "dma-buf fd".into(),
            hint: "out of file descriptors?",
            source: e,
        })?);
        let map = SharedMemory::map_device(&file, n, true, "dmabuf").map_err(|e| {
            Error::Unavailable {
                what: format!("CPU access to a {len}-byte dma-buf"),
                reason: format!("its exporter refused mmap: {e}"),
                fix: "use an exporter that supports mmap of its dma-bufs, or hand in a provider with its own copy engine".into(),
            }
        })?;
        Ok(DmaBufMemory {
            inner: DmaBufInner::Foreign { fd, map },
            len,
        })
    }
}

impl Provider for DmaBufMemory {
    fn kind(&self) -> &'static str {
        "dmabuf"
    }
    fn describe(&self) -> String {
        match &self.inner {
            DmaBufInner::Udmabuf(_) => format!(
                "{} bytes of dma-buf from the built-in exporter (memfd + /dev/udmabuf)",
                self.len
            ),
            DmaBufInner::Foreign { .. } => {
                format!(
                    "{} bytes of a dma-buf handed in by the application",
                    self.len
                )
            }
        }
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn writable(&self) -> bool {
        true
    }
    fn mapping(&self) -> Option<(&Arc<SharedMemory>, u64)> {
        None
    }
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        Some(match &self.inner {
            DmaBufInner::Udmabuf(u) => (u.dmabuf_fd(), 0),
            DmaBufInner::Foreign { fd, .. } => (fd.as_fd(), 0),
        })
    }
    fn copy_engine(&self) -> &'static str {
        match &self.inner {
            DmaBufInner::Udmabuf(_) => "pread/pwrite on the memfd",
            DmaBufInner::Foreign { .. } => "CPU copy through an mmap of the dma-buf",
        }
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("dma-buf", offset, out.len() as u64, self.len)?;
        match &self.inner {
            DmaBufInner::Udmabuf(u) => u.read_at(offset, out),
            DmaBufInner::Foreign { map, .. } => Ok(map.read_at(offset, out)?),
        }
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        check_range("dma-buf", offset, data.len() as u64, self.len)?;
        match &self.inner {
            DmaBufInner::Udmabuf(u) => u.write_at(offset, data),
            DmaBufInner::Foreign { map, .. } => Ok(map.write_at(offset, data)?),
        }
    }
    fn holds_data(&self) -> bool {
        matches!(self.inner, DmaBufInner::Foreign { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_window_copies_stay_inside() {
        let mem = Arc::new(SharedMemory::anonymous(8192, false).unwrap());
        let w = HostMemory::window(Arc::clone(&mem), 100, 1000, true).unwrap();
        w.copy_in(0, b"abc").unwrap();
        let mut b = [0u8; 3];
        mem.read_at(100, &mut b).unwrap();
        assert_eq!(&b, b"abc");
        assert!(w.copy_in(998, b"abc").is_err());
        assert!(w.copy_out(u64::MAX, &mut b).is_err());
        assert!(HostMemory::window(mem, 8000, 193, true).is_err());
        assert_eq!(w.mapping().unwrap().1, 100);
        assert!(w.describe().contains("window at 100"));
    }

    #[test]
    fn read_only_window_refuses_writes() {
        let mem = Arc::new(SharedMemory::anonymous(4096, false).unwrap());
        let w = HostMemory::window(mem, 0, 4096, false).unwrap();
        assert!(!w.writable());
        assert!(w.copy_in(0, b"x").is_err());
    }
}
