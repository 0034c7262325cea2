//! GPU memory as device-private memory: the `cuda` realisation of [`crate::hmm`].
//!
//! The CPU never touches the GPU's memory: the copy engine is `cuMemcpyDtoH/HtoD`, and the P2P
//! window (like a GPU's BAR1 aperture, limited and managed by the region's LRU) is made of
//! dma-buf exports of 64 KiB units (`cuMemGetHandleForAddressRange` over each unit), which a
//! NIC with dma-buf MRs registers directly. Every copy and export first checks the
//! allocation's buffer id, so memory the owner freed is never touched.
#![forbid(unsafe_code)]

use std::fmt;
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use verbs::SharedMemory;

use super::{cuda_err, CudaDriver, CudaMemory};
use crate::error::Error;
use crate::hmm::{DeviceBacking, UNIT};
use crate::provider::{check_range, Provider};

/// A GPU allocation serving as the device of a [`crate::hmm::DevicePrivate`] region.
#[derive(Debug)]
pub struct CudaDevice {
    mem: Arc<CudaMemory>,
}

impl CudaDevice {
    /// Allocate `len` bytes on GPU `ordinal` (whole 2 MiB pages, so every 64 KiB unit can be
    /// exported). The allocation is not exported as a whole: window units are, one by one.
    pub fn allocate(
        driver: Arc<dyn CudaDriver>,
        ordinal: u32,
        len: u64,
    ) -> Result<CudaDevice, Error> {
        Ok(CudaDevice {
            mem: Arc::new(CudaMemory::allocate_with(driver, ordinal, len, false)?),
        })
    }

    /// The GPU memory behind it.
    pub fn memory(&self) -> &CudaMemory {
        &self.mem
    }
}

impl DeviceBacking for CudaDevice {
    fn describe(&self) -> String {
        format!(
            "{}; copy engine cuMemcpy, P2P window of dma-buf exports{}",
            self.mem.describe(),
            if self.mem.gpu().dmabuf_supported {
                ""
            } else {
                " (unavailable: the driver cannot export dma-bufs)"
            }
        )
    }
    fn len(&self) -> u64 {
        self.mem.len()
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        self.mem.copy_out(offset, out)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.mem.copy_in(offset, data)
    }
    fn map_window(&self, range: Range<u64>) -> Result<Arc<dyn Provider>, Error> {
        let gpu = self.mem.gpu();
        if !gpu.dmabuf_supported {
            return Err(Error::Unavailable {
                what: format!("a P2P window on GPU {}", gpu.ordinal),
                reason: format!(
                    "the driver reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 for {}",
                    gpu.name
                ),
                fix: "use NVIDIA's open kernel modules (driver >= 515) on Linux >= 5.12; until then units are served by the copy engine".into(),
            });
        }
        if range.start >= range.end || range.end > self.mem.len() {
            return Err(Error::InvalidArgument(format!(
                "window range {range:?} is outside the {} bytes of GPU memory",
                self.mem.len()
            )));
        }
        // whole units: inside the allocation, which is whole 2 MiB pages
        let start = range.start / UNIT * UNIT;
        let end = range.end.div_ceil(UNIT) * UNIT;
        self.mem.check_live()?;
        let fd = self
            .mem
            .driver
            .export_dmabuf(gpu.ordinal, self.mem.device_ptr() + start, end - start)
            .map_err(cuda_err(format!(
                "exporting bytes {start}..{end} of GPU {} memory as a dma-buf",
                gpu.ordinal
            )))?;
        Ok(Arc::new(CudaWindow {
            mem: Arc::clone(&self.mem),
            offset: start,
            len: end - start,
            fd,
        }))
    }
}

/// One window mapping: a dma-buf of `len` bytes at `offset` of the GPU memory. A NIC registers
/// the dma-buf; the CPU reaches the bytes only through the copy engine.
pub struct CudaWindow {
    mem: Arc<CudaMemory>,
    offset: u64,
    len: u64,
    fd: OwnedFd,
}

impl fmt::Debug for CudaWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaWindow")
            .field("gpu", &self.mem.gpu().ordinal)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl CudaWindow {
    /// Offset of the window's first byte in the GPU memory.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Provider for CudaWindow {
    fn kind(&self) -> &'static str {
        "cuda-window"
    }
    fn describe(&self) -> String {
        format!(
            "bytes {}..{} of GPU {} memory, exported as a dma-buf",
            self.offset,
            self.offset + self.len,
            self.mem.gpu().ordinal
        )
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
    fn pci_device(&self) -> Option<String> {
        self.mem.pci_device()
    }
    fn no_mapping_reason(&self) -> Option<String> {
        self.mem.no_mapping_reason()
    }
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        Some((self.fd.as_fd(), 0))
    }
    fn copy_engine(&self) -> &'static str {
        "cuMemcpyDtoH/HtoD"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("GPU window", offset, out.len() as u64, self.len)?;
        self.mem.copy_out(self.offset + offset, out)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        check_range("GPU window", offset, data.len() as u64, self.len)?;
        self.mem.copy_in(self.offset + offset, data)
    }
    fn check_valid(&self) -> Result<(), Error> {
        self.mem.check_live()
    }
}
