//! Host memory the CPU and the NIC share: anonymous buffers and served regions (RAM or a mapped
//! file). A served region is only ever copied by the CPU (remote peers may write it at any
//! time), and a file's copies go through the file, so a truncated file is an error, not a
//! SIGBUS.

use crate::error::{Call, Error, Result};
use crate::ffi::Mapping;

/// Page-aligned, zero-filled host memory (an anonymous mapping).
#[derive(Debug)]
pub struct HostBuffer {
    pub(crate) map: Mapping,
}

impl HostBuffer {
    /// `len` bytes of ordinary pages.
    pub fn new(len: usize) -> Result<HostBuffer> {
        Mapping::anonymous(len, false)
            .map(|map| HostBuffer { map })
            .map_err(|e| Error::verbs(Call::Mmap, format!("{len} bytes of anonymous memory"), e))
    }

    /// `len` bytes (a multiple of the huge page size) from huge pages (`MAP_HUGETLB`).
    pub fn huge(len: usize) -> Result<HostBuffer> {
        Mapping::anonymous(len, true).map(|map| HostBuffer { map }).map_err(|e| {
            Error::verbs(
                Call::Mmap,
                format!("{len} bytes of huge pages (is vm.nr_hugepages set, and len a multiple of the huge page size?)"),
                e,
            )
        })
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Contents.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_slice()
    }

    /// Contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.map.as_mut_slice()
    }
}

/// Repeat `step(done)` (it moves bytes from `done` on, returning how many) until `len` bytes
/// have moved: the loop over short reads and writes. A step that moves nothing is
/// `stalled(done)`.
fn all_of(
    len: usize,
    mut step: impl FnMut(usize) -> Result<usize>,
    stalled: impl Fn(usize) -> Error,
) -> Result<()> {
    let mut done = 0;
    while done < len {
        match step(done)? {
            0 => return Err(stalled(done)),
            n => done += n,
        }
    }
    Ok(())
}

/// Memory shared between many registrations and remote peers (a served region): host RAM or a
/// mapped file. The CPU reaches it only by copying ([`SharedMemory::read_at`] /
/// [`SharedMemory::write_at`]), never through references, because remote peers may write it at
/// any time.
///
/// The CPU copies of a file go through the file itself (`pread`/`pwrite` on the same page
/// cache the mapping shows), never through the mapping: a file that another process truncates
/// then yields [`Error::FileShrank`] instead of a SIGBUS that would kill the process.
#[derive(Debug)]
pub struct SharedMemory {
    pub(crate) map: Mapping,
    pub(crate) writable: bool,
    kind: &'static str,
    /// The mapped file (files only).
    file: Option<std::fs::File>,
}

impl SharedMemory {
    /// Zeroed anonymous memory, optionally from huge pages.
    pub fn anonymous(len: usize, huge: bool) -> Result<SharedMemory> {
        let map = Mapping::anonymous(len, huge).map_err(|e| {
            Error::verbs(
                Call::Mmap,
                if huge {
                    format!("{len} bytes of huge pages (is vm.nr_hugepages set, and the size a multiple of the huge page size?)")
                } else {
                    format!("{len} bytes of anonymous memory")
                },
                e,
            )
        })?;
        Ok(SharedMemory {
            map,
            writable: true,
            kind: if huge { "host-huge" } else { "host" },
            file: None,
        })
    }

    /// Map the whole of `file` (shared: remote writes reach the file). The file must not shrink
    /// while mapped.
    pub fn file(file: &std::fs::File, writable: bool) -> Result<SharedMemory> {
        let len = file
            .metadata()
            .map_err(|e| Error::verbs(Call::Mmap, "fstat of the file to serve", e))?
            .len();
        let len = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument("file too large to map".into()))?;
        if len == 0 {
            return Err(Error::InvalidArgument("cannot serve an empty file".into()));
        }
        let map = Mapping::file(file, len, writable).map_err(|e| {
            Error::verbs(
                Call::Mmap,
                format!(
                    "{len}-byte file, {}",
                    if writable { "read-write" } else { "read-only" }
                ),
                e,
            )
        })?;
        let file = file
            .try_clone()
            .map_err(|e| Error::verbs(Call::Mmap, "dup of the file to serve", e))?;
        Ok(SharedMemory {
            map,
            writable,
            kind: "file",
            file: Some(file),
        })
    }

    /// Map `len` bytes of a device file at offset 0, shared (e.g. an NVMe CMB allocated through
    /// `/sys/bus/pci/devices/BDF/p2pmem/allocate`, or a dma-buf that supports mmap). `kind` names
    /// the memory in reports ("cmb", "dmabuf").
    pub fn map_device(
        file: &std::fs::File,
        len: usize,
        writable: bool,
        kind: &'static str,
    ) -> Result<SharedMemory> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot map 0 bytes".into()));
        }
        let map = Mapping::file(file, len, writable).map_err(|e| {
            Error::verbs(
                Call::Mmap,
                format!("{len} bytes of {kind} memory, MAP_SHARED at offset 0"),
                e,
            )
        })?;
        Ok(SharedMemory {
            map,
            writable,
            kind,
            file: None,
        })
    }

    /// Zeroed anonymous memory in base pages only (no transparent huge pages): what drivers
    /// that migrate memory page by page, such as HMM's, need.
    pub fn anonymous_base_pages(len: usize) -> Result<SharedMemory> {
        let m = SharedMemory::anonymous(len, false)?;
        m.map.no_huge_pages().map_err(|e| {
            Error::verbs(
                Call::Mmap,
                format!("madvise(MADV_NOHUGEPAGE) on {len} bytes of anonymous memory"),
                e,
            )
        })?;
        Ok(m)
    }

    /// The virtual address of byte 0 in this process, for drivers that mirror the process's
    /// address space (HMM). Nothing may be dereferenced through it.
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
    /// "host", "host-huge", "file", or the kind given to [`SharedMemory::map_device`].
    pub fn kind(&self) -> &'static str {
        self.kind
    }
    /// Whether the CPU (and so remote peers) may write it.
    pub fn writable(&self) -> bool {
        self.writable
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len() as u64 => Ok(offset as usize),
            _ => Err(Error::OutOfBounds {
                what: "shared memory",
                offset,
                len: len as u64,
                size: self.len() as u64,
            }),
        }
    }

    /// Copy bytes out.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let o = self.check(offset, out.len())?;
        match &self.file {
            Some(f) => {
                use std::os::unix::fs::FileExt as _;
                f.read_exact_at(out, offset).map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => self.shrank(f, offset, out.len()),
                    _ => Error::verbs(Call::Pread, format!("{} bytes at {offset}", out.len()), e),
                })
            }
            None => {
                self.map.copy_out(o, out);
                Ok(())
            }
        }
    }

    /// Copy bytes in.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(Error::InvalidArgument(
                "this memory is mapped read-only".into(),
            ));
        }
        let o = self.check(offset, data.len())?;
        match &self.file {
            Some(f) => {
                use std::os::unix::fs::FileExt as _;
                // never extend a file that shrank: the bytes past its end are not served
                let end = offset + data.len() as u64;
                if file_len(f)? < end {
                    return Err(self.shrank(f, offset, data.len()));
                }
                f.write_all_at(data, offset).map_err(|e| {
                    Error::verbs(Call::Pwrite, format!("{} bytes at {offset}", data.len()), e)
                })
            }
            None => {
                self.map.copy_in(o, data);
                Ok(())
            }
        }
    }

    /// Fill `offset..offset + len` of this memory from `fd` at `file_offset` by `pread` into
    /// the mapping itself: with an `O_DIRECT` descriptor of a block device the device DMAs
    /// straight into this memory (an NVMe reading into a CMB mapping: peer to peer, Linux
    /// ≥ 6.2), where [`SharedMemory::write_at`] would copy through the CPU. Loops over short
    /// reads; the end of the file is [`Error::InvalidArgument`]. The kernel's own refusals keep
    /// their errno (EREMOTEIO: the devices cannot reach each other; EINVAL: alignment or a
    /// kernel that does not take P2PDMA pages for direct I/O).
    pub fn fill_from_fd(
        &self,
        offset: u64,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        file_offset: u64,
    ) -> Result<()> {
        if !self.writable {
            return Err(Error::InvalidArgument(
                "this memory is mapped read-only".into(),
            ));
        }
        let o = self.check(offset, len)?;
        all_of(
            len,
            |done| {
                self.map
                    .pread_into(o + done, len - done, fd, file_offset + done as u64)
                    .map_err(|e| {
                        Error::verbs(
                            Call::Pread,
                            format!(
                                "{} bytes at {} into {} memory",
                                len - done,
                                file_offset + done as u64,
                                self.kind
                            ),
                            e,
                        )
                    })
            },
            |_| {
                Error::InvalidArgument(format!(
                    "the file ends before byte {}",
                    file_offset + len as u64
                ))
            },
        )
    }

    /// Write `offset..offset + len` of this memory to `fd` at `file_offset` by `pwrite` from
    /// the mapping itself (the way back of [`SharedMemory::fill_from_fd`]: with `O_DIRECT`, the
    /// device DMAs out of this memory). Loops over short writes.
    pub fn drain_to_fd(
        &self,
        offset: u64,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        file_offset: u64,
    ) -> Result<()> {
        let o = self.check(offset, len)?;
        all_of(
            len,
            |done| {
                self.map
                    .pwrite_from(o + done, len - done, fd, file_offset + done as u64)
                    .map_err(|e| {
                        Error::verbs(
                            Call::Pwrite,
                            format!(
                                "{} bytes from {} memory at {}",
                                len - done,
                                self.kind,
                                file_offset + done as u64
                            ),
                            e,
                        )
                    })
            },
            |done| {
                Error::InvalidArgument(format!("no byte written at {}", file_offset + done as u64))
            },
        )
    }

    /// Make what was written to `offset..offset + len` durable: `fdatasync` of a file (the
    /// server's own writes, by [`SharedMemory::write_at`], are in its page cache). Memory that
    /// is not a file has nothing to make durable. Fails with [`Error::FileShrank`] when the
    /// range is past the end of a file that shrank.
    pub fn sync(&self, offset: u64, len: u64) -> Result<()> {
        let Some(f) = &self.file else {
            return Ok(());
        };
        self.check(offset, len as usize)?;
        if file_len(f)? < offset + len {
            return Err(self.shrank(f, offset, len as usize));
        }
        f.sync_data()
            .map_err(|e| Error::verbs(Call::Fdatasync, format!("{len} bytes at {offset}"), e))
    }

    fn shrank(&self, f: &std::fs::File, offset: u64, len: usize) -> Error {
        match file_len(f) {
            Ok(now) => Error::FileShrank {
                mapped: self.len() as u64,
                now,
                offset,
                end: offset + len as u64,
            },
            Err(e) => e,
        }
    }
}

fn file_len(f: &std::fs::File) -> Result<u64> {
    f.metadata()
        .map(|m| m.len())
        .map_err(|e| Error::verbs(Call::Fstat, "the served file's size", e))
}

#[cfg(test)]
mod file_tests {
    use super::SharedMemory;
    use crate::error::Error;

    fn served(len: usize) -> (std::path::PathBuf, std::fs::File, SharedMemory) {
        let path =
            std::env::temp_dir().join(format!("p2p-rdma-shrink-{}-{len}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(len as u64).unwrap();
        let m = SharedMemory::file(&f, true).unwrap();
        (path, f, m)
    }

    /// Before: a file truncated by another process turned the next copy into SIGBUS (the
    /// process died). Now the copy fails with FileShrank and the memory stays usable.
    #[test]
    fn a_truncated_file_is_refused_not_faulted() {
        let (path, f, m) = served(64 << 10);
        m.write_at(60 << 10, &[7u8; 4096]).unwrap();
        let mut out = [0u8; 4096];
        m.read_at(60 << 10, &mut out).unwrap();
        assert_eq!(out, [7u8; 4096]);
        f.set_len(16 << 10).unwrap();
        for e in [
            m.read_at(60 << 10, &mut out).unwrap_err(),
            m.write_at(60 << 10, &out).unwrap_err(),
            m.sync(20 << 10, 4096).unwrap_err(),
        ] {
            assert!(
                matches!(
                    e,
                    Error::FileShrank {
                        mapped: 65536,
                        now: 16384,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("truncated it"), "{e}");
        }
        assert_eq!(
            f.metadata().unwrap().len(),
            16 << 10,
            "a refused write does not extend the file"
        );
        // what is left is still served
        m.write_at(0, b"still here").unwrap();
        m.sync(0, 10).unwrap();
        let mut head = [0u8; 10];
        m.read_at(0, &mut head).unwrap();
        assert_eq!(&head, b"still here");
        assert_eq!(&std::fs::read(&path).unwrap()[..10], b"still here");
        std::fs::remove_file(path).unwrap();
    }
}
