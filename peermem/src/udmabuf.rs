//! A dma-buf exporter built from host memory: a sealed memfd handed to `/dev/udmabuf`
//! (`CONFIG_UDMABUF`, Linux ≥ 4.20). Useful to exercise dma-buf paths (`ibv_reg_dmabuf_mr`)
//! without a GPU.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::error::{sys, Error};

const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542; // _IOW('u', 0x42, struct udmabuf_create)
const UDMABUF_FLAGS_CLOEXEC: u32 = 1;

#[repr(C)]
struct UdmabufCreate {
    memfd: u32,
    flags: u32,
    offset: u64,
    size: u64,
}

/// A dma-buf backed by a memfd. The memfd stays open so the CPU can fill and read the memory
/// with `pread`/`pwrite` (the copy engine of this provider).
#[derive(Debug)]
pub struct Udmabuf {
    dmabuf: OwnedFd,
    memfd: File,
    len: usize,
}

impl Udmabuf {
    /// Export `len` bytes (a multiple of the page size) through `/dev/udmabuf`.
    pub fn create(len: usize) -> Result<Udmabuf, Error> {
        Self::create_at(Path::new("/dev/udmabuf"), len)
    }

    /// Same, with the device node at `dev` (tests, chroots).
    pub fn create_at(dev: &Path, len: usize) -> Result<Udmabuf, Error> {
        let page = page_size();
        if len == 0 || len % page != 0 {
            return Err(Error::InvalidArgument(format!(
                "a udmabuf must be a non-zero multiple of the page size ({page} bytes), not {len}"
            )));
        }
        let memfd = sealed_memfd(len as u64)?;
        let dmabuf = export_range(dev, &memfd, 0, len as u64)?;
        Ok(Udmabuf { dmabuf, memfd, len })
    }

    /// The dma-buf fd (to hand to `ibv_reg_dmabuf_mr`).
    pub fn dmabuf_fd(&self) -> BorrowedFd<'_> {
        self.dmabuf.as_fd()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write `data` at `offset` through the memfd.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.check(offset, data.len())?;
        memfd_write(&self.memfd, offset, data, "udmabuf memfd")
    }

    /// Read into `buf` from `offset` through the memfd.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.check(offset, buf.len())?;
        memfd_read(&self.memfd, offset, buf, "udmabuf memfd")
    }

    fn check(&self, offset: u64, len: usize) -> Result<(), Error> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{len} is outside the {}-byte udmabuf",
                self.len
            ))),
        }
    }

    /// Where the default device node is.
    pub fn default_device() -> PathBuf {
        PathBuf::from("/dev/udmabuf")
    }
}

/// `pread` of all of `buf` at `offset` of a memfd (a copy engine).
pub(crate) fn memfd_read(f: &File, offset: u64, buf: &mut [u8], what: &str) -> Result<(), Error> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, offset).map_err(|e| Error::Sys {
        call: "pread",
        context: format!("{what} at {offset}"),
        hint: "I/O error on the memfd",
        source: e,
    })
}

/// `pwrite` of all of `data` at `offset` of a memfd.
pub(crate) fn memfd_write(f: &File, offset: u64, data: &[u8], what: &str) -> Result<(), Error> {
    use std::os::unix::fs::FileExt;
    f.write_all_at(data, offset).map_err(|e| Error::Sys {
        call: "pwrite",
        context: format!("{what} at {offset}"),
        hint: "I/O error on the memfd",
        source: e,
    })
}

/// A memfd of `len` bytes sealed against shrinking (what udmabuf requires), never mapped by
/// this process: device memory emulated by a file that only a copy engine (pread/pwrite) and
/// dma-buf exports of its ranges reach.
pub fn sealed_memfd(len: u64) -> Result<File, Error> {
    // SAFETY: the name is a valid C string; memfd_create has no memory preconditions.
    let fd = unsafe {
        libc::memfd_create(
            c"p2p-rdma-udmabuf".as_ptr(),
            libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(sys(
            "memfd_create",
            format!("{len} bytes"),
            "the kernel lacks memfd support",
        ));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let memfd = unsafe { File::from_raw_fd(fd) };
    memfd.set_len(len).map_err(|e| Error::Sys {
        call: "ftruncate",
        context: format!("memfd of {len} bytes"),
        hint: "out of memory?",
        source: e,
    })?;
    // SAFETY: fcntl on a valid fd with an integer argument.
    if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
        return Err(sys(
            "fcntl(F_ADD_SEALS)",
            "memfd",
            "udmabuf needs a memfd sealed against shrinking",
        ));
    }
    Ok(memfd)
}

/// Export `len` bytes at `offset` (both page-aligned) of a sealed memfd as a dma-buf through
/// the udmabuf device at `dev`.
pub fn export_range(dev: &Path, memfd: &File, offset: u64, len: u64) -> Result<OwnedFd, Error> {
    let dev_file = OpenOptions::new().read(true).write(true).open(dev).map_err(|e| Error::Sys {
        call: "open",
        context: dev.display().to_string(),
        hint: "no udmabuf device: the kernel needs CONFIG_UDMABUF (module udmabuf), and the caller read/write access to it",
        source: e,
    })?;
    let mut arg = UdmabufCreate {
        memfd: memfd.as_raw_fd() as u32,
        flags: UDMABUF_FLAGS_CLOEXEC,
        offset,
        size: len,
    };
    // SAFETY: UDMABUF_CREATE takes a pointer to a `struct udmabuf_create`, whose layout
    // `UdmabufCreate` reproduces (repr(C), same field types); `arg` outlives the call.
    let ret = unsafe {
        libc::ioctl(
            dev_file.as_raw_fd(),
            UDMABUF_CREATE,
            &mut arg as *mut UdmabufCreate,
        )
    };
    if ret < 0 {
        return Err(sys(
            "ioctl(UDMABUF_CREATE)",
            format!("{} for {len} bytes at {offset}", dev.display()),
            "the kernel refused to export the memfd range (unaligned, or over udmabuf's size_limit_mb?)",
        ));
    }
    // SAFETY: on success the ioctl returns a new dma-buf fd that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ret) })
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_must_be_whole_pages() {
        let e = Udmabuf::create(100).unwrap_err();
        assert!(e.to_string().contains("multiple of the page size"), "{e}");
        assert!(Udmabuf::create(0).is_err());
    }

    #[test]
    fn missing_device_node_is_explained() {
        let e = Udmabuf::create_at(Path::new("/nonexistent/udmabuf"), 4096).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("CONFIG_UDMABUF") && s.contains("/nonexistent/udmabuf"),
            "{s}"
        );
    }
}
