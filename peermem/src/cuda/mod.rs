//! GPU memory through the CUDA driver API, loaded at run time.
//!
//! [`CudaMemory`] is a [`Provider`] for device memory of an NVIDIA GPU: allocated with
//! `cuMemAlloc` (or adopted from an embedding application), exported as a dma-buf with
//! `cuMemGetHandleForAddressRange` so that a NIC may register it (`ibv_reg_dmabuf_mr`), and
//! copied in and out with `cuMemcpyHtoD` / `cuMemcpyDtoH` when the bounce path serves it.
//! `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` is set on the memory so that copies and RDMA see each
//! other's writes in order, and `CU_POINTER_ATTRIBUTE_BUFFER_ID` is checked before every
//! registration and copy, so that memory freed (or freed and reallocated at the same address)
//! by its owner is never touched.
//!
//! The driver is reached through the [`CudaDriver`] trait. The real one ([`load`]) opens
//! `libcuda.so.1` with `dlopen` — there is no link-time dependency — and exists only when the
//! crate is built with the `cuda` feature; without it, [`load`] says so. Tests drive the
//! provider's logic with a fake driver table.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use verbs::SharedMemory;

use crate::error::Error;
use crate::provider::{check_range, Provider};

mod device_private;
#[cfg(feature = "cuda")]
mod dl;

pub use device_private::{CudaDevice, CudaWindow};

/// `CUresult` codes this module gives meaning to.
pub mod code {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: i32 = 0;
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: i32 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: i32 = 2;
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: i32 = 3;
    /// `CUDA_ERROR_STUB_LIBRARY`.
    pub const STUB_LIBRARY: i32 = 34;
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: i32 = 100;
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const INVALID_DEVICE: i32 = 101;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: i32 = 801;
    /// `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`.
    pub const SYSTEM_DRIVER_MISMATCH: i32 = 803;
}

/// A failed CUDA driver call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} returned {name} ({code}): {text}{}", hint(*.code).map(|h| format!(" — {h}")).unwrap_or_default())]
pub struct CuError {
    /// The driver entry point.
    pub call: &'static str,
    /// The `CUresult`.
    pub code: i32,
    /// Its name (`CUDA_ERROR_...`), from `cuGetErrorName` when the driver knows it.
    pub name: String,
    /// The driver's description, from `cuGetErrorString`.
    pub text: String,
}

impl CuError {
    /// An error with the names this module knows (for drivers that cannot name their codes).
    pub fn new(call: &'static str, code: i32) -> CuError {
        let name = match code {
            code::INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
            code::OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
            code::NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
            code::STUB_LIBRARY => "CUDA_ERROR_STUB_LIBRARY",
            code::NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
            code::INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
            code::NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
            code::SYSTEM_DRIVER_MISMATCH => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
            _ => "CUDA error",
        };
        CuError {
            call,
            code,
            name: name.into(),
            text: String::new(),
        }
    }
}

/// What a code means for a user of this tool.
fn hint(code: i32) -> Option<&'static str> {
    Some(match code {
        code::INVALID_VALUE => "the pointer is not (or no longer) a live allocation, or a size is wrong",
        code::OUT_OF_MEMORY => "not enough free memory on the GPU (see nvidia-smi)",
        code::STUB_LIBRARY => "the libcuda.so.1 found is the CUDA toolkit's stub, not the driver: fix the library path",
        code::NO_DEVICE => "no GPU is visible to this process (driver not loaded, or CUDA_VISIBLE_DEVICES hides them)",
        code::INVALID_DEVICE => "there is no GPU with that number",
        code::NOT_SUPPORTED => "this GPU or driver does not support the operation",
        code::SYSTEM_DRIVER_MISMATCH => "libcuda.so.1 and the loaded kernel module are different versions: reboot or reinstall the driver",
        _ => return None,
    })
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA ordinal (as in `cuda:N:SIZE`).
    pub ordinal: u32,
    /// Product name.
    pub name: String,
    /// PCI address (`0000:41:00.0`), for the topology doctor.
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub total_mem: u64,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: the driver can export its memory as dma-bufs.
    pub dmabuf_supported: bool,
}

/// The CUDA driver calls the provider needs. Every call makes the GPU's primary context
/// current on the calling thread first, so callers may use any thread.
pub trait CudaDriver: Send + Sync + fmt::Debug {
    /// Which library and driver version, for reports.
    fn describe(&self) -> String;
    /// Number of GPUs visible.
    fn device_count(&self) -> Result<u32, CuError>;
    /// Describe GPU `ordinal`.
    fn device(&self, ordinal: u32) -> Result<GpuInfo, CuError>;
    /// `cuMemAlloc` of `size` bytes on GPU `ordinal`.
    fn alloc(&self, ordinal: u32, size: u64) -> Result<u64, CuError>;
    /// `cuMemFree`.
    fn free(&self, ordinal: u32, ptr: u64) -> Result<(), CuError>;
    /// `cuMemcpyDtoH`: `dst.len()` bytes from device address `src`.
    fn copy_to_host(&self, ordinal: u32, dst: &mut [u8], src: u64) -> Result<(), CuError>;
    /// `cuMemcpyHtoD`: `src` to device address `dst`.
    fn copy_to_device(&self, ordinal: u32, dst: u64, src: &[u8]) -> Result<(), CuError>;
    /// `cuPointerSetAttribute(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, 1)` on the allocation at `ptr`.
    fn set_sync_memops(&self, ordinal: u32, ptr: u64) -> Result<(), CuError>;
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)`: unique per allocation, so a
    /// freed-and-reallocated address has a new one; an error when `ptr` is not allocated.
    fn buffer_id(&self, ordinal: u32, ptr: u64) -> Result<u64, CuError>;
    /// `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` over `size` bytes
    /// at `ptr` (both page-aligned).
    fn export_dmabuf(&self, ordinal: u32, ptr: u64, size: u64) -> Result<OwnedFd, CuError>;
}

/// The process's CUDA driver: `libcuda.so.1`, opened once. Fails with the precise reason:
/// this build has no CUDA support, no driver library, a stub library, no GPU.
pub fn load() -> Result<Arc<dyn CudaDriver>, Error> {
    #[cfg(feature = "cuda")]
    {
        static DRIVER: std::sync::OnceLock<Result<Arc<dyn CudaDriver>, String>> =
            std::sync::OnceLock::new();
        DRIVER
            .get_or_init(|| {
                dl::DlCuda::open()
                    .map(|d| Arc::new(d) as Arc<dyn CudaDriver>)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|reason| Error::Unavailable {
                what: "GPU memory".into(),
                reason: format!("no CUDA driver: {reason}"),
                fix: "install the NVIDIA driver (libcuda.so.1 must be on the library path) and check that nvidia-smi lists the GPU".into(),
            })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::Unavailable {
            what: "GPU memory".into(),
            reason: "this build of p2p-rdma has no CUDA support (cargo feature `cuda`)".into(),
            fix: "rebuild with `cargo build --release --features cuda` (no CUDA toolkit is needed: the driver is loaded at run time)".into(),
        })
    }
}

/// Alignment of allocations and of dma-buf export: GPUs map large allocations in 2 MiB pages,
/// and export needs page-aligned ranges.
const GPU_PAGE: u64 = 2 << 20;
const HOST_PAGE: u64 = 4096;

/// Device memory of one GPU.
pub struct CudaMemory {
    driver: Arc<dyn CudaDriver>,
    gpu: GpuInfo,
    ptr: u64,
    len: u64,
    buffer_id: u64,
    /// Whether this provider allocated the memory (and frees it on drop) or adopted an
    /// application's allocation.
    owned: bool,
    dmabuf: Option<OwnedFd>,
    dmabuf_refused: Option<String>,
}

impl fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaMemory")
            .field("gpu", &self.gpu)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .field("dmabuf_refused", &self.dmabuf_refused)
            .finish()
    }
}

fn cuda_err(what: String) -> impl FnOnce(CuError) -> Error {
    move |e| Error::Cuda { what, source: e }
}

fn find_gpu(driver: &dyn CudaDriver, ordinal: u32) -> Result<GpuInfo, Error> {
    let count = driver
        .device_count()
        .map_err(cuda_err("counting GPUs".into()))?;
    if ordinal >= count {
        return Err(Error::Unavailable {
            what: format!("GPU {ordinal}"),
            reason: match count {
                0 => "the CUDA driver sees no GPU".to_string(),
                1 => "the CUDA driver sees one GPU (0)".to_string(),
                n => format!("the CUDA driver sees {n} GPUs (0..{})", n - 1),
            },
            fix: "pick a GPU number that nvidia-smi lists (CUDA_VISIBLE_DEVICES renumbers them)"
                .into(),
        });
    }
    driver
        .device(ordinal)
        .map_err(cuda_err(format!("describing GPU {ordinal}")))
}

impl CudaMemory {
    /// Allocate `len` bytes on GPU `ordinal` (rounded up to 2 MiB for export), set
    /// SYNC_MEMOPS, and export the allocation as a dma-buf when the driver can.
    pub fn allocate(
        driver: Arc<dyn CudaDriver>,
        ordinal: u32,
        len: u64,
    ) -> Result<CudaMemory, Error> {
        CudaMemory::allocate_with(driver, ordinal, len, true)
    }

    /// [`CudaMemory::allocate`], exporting the whole allocation or not.
    pub(crate) fn allocate_with(
        driver: Arc<dyn CudaDriver>,
        ordinal: u32,
        len: u64,
        export: bool,
    ) -> Result<CudaMemory, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a GPU region needs at least 1 byte".into(),
            ));
        }
        let gpu = find_gpu(driver.as_ref(), ordinal)?;
        let alloc_len = len
            .checked_next_multiple_of(GPU_PAGE)
            .ok_or_else(|| Error::InvalidArgument(format!("bad GPU region size {len}")))?;
        let ptr = driver.alloc(ordinal, alloc_len).map_err(cuda_err(format!(
            "allocating {alloc_len} bytes on GPU {ordinal}"
        )))?;
        // From here on the allocation is freed by Drop, whatever fails.
        let mut mem = CudaMemory {
            driver,
            gpu,
            ptr,
            len,
            buffer_id: 0,
            owned: true,
            dmabuf: None,
            dmabuf_refused: None,
        };
        mem.prepare(if export { alloc_len } else { 0 })?;
        Ok(mem)
    }

    /// Serve `len` bytes at device address `ptr` that the embedding application allocated on
    /// GPU `ordinal`. The application keeps ownership: if it frees the memory, this provider
    /// notices (buffer id) and refuses to touch it.
    pub fn adopt(
        driver: Arc<dyn CudaDriver>,
        ordinal: u32,
        ptr: u64,
        len: u64,
    ) -> Result<CudaMemory, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a GPU region needs at least 1 byte".into(),
            ));
        }
        let gpu = find_gpu(driver.as_ref(), ordinal)?;
        let mut mem = CudaMemory {
            driver,
            gpu,
            ptr,
            len,
            buffer_id: 0,
            owned: false,
            dmabuf: None,
            dmabuf_refused: None,
        };
        let export_len = if ptr % HOST_PAGE == 0 && len % HOST_PAGE == 0 {
            len
        } else {
            0
        };
        mem.prepare(export_len)?;
        if export_len == 0 {
            mem.dmabuf_refused = Some(format!(
                "the range {ptr:#x}+{len} is not page-aligned, and a dma-buf export must be"
            ));
        }
        Ok(mem)
    }

    /// Record the buffer id, set SYNC_MEMOPS, export `export_len` bytes (0: do not export).
    fn prepare(&mut self, export_len: u64) -> Result<(), Error> {
        let (o, ptr) = (self.gpu.ordinal, self.ptr);
        self.buffer_id = self
            .driver
            .buffer_id(o, ptr)
            .map_err(cuda_err(format!("looking up the allocation at {ptr:#x}")))?;
        self.driver
            .set_sync_memops(o, ptr)
            .map_err(cuda_err(format!("setting SYNC_MEMOPS at {ptr:#x}")))?;
        if export_len == 0 {
            return Ok(());
        }
        if !self.gpu.dmabuf_supported {
            self.dmabuf_refused = Some(format!(
                "the driver reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 for {} (dma-buf export needs NVIDIA's open kernel modules, driver >= 515, and Linux >= 5.12)",
                self.gpu.name
            ));
            return Ok(());
        }
        match self.driver.export_dmabuf(o, ptr, export_len) {
            Ok(fd) => self.dmabuf = Some(fd),
            Err(e) => self.dmabuf_refused = Some(format!("dma-buf export failed: {e}")),
        }
        Ok(())
    }

    /// The GPU.
    pub fn gpu(&self) -> &GpuInfo {
        &self.gpu
    }

    /// Device address of byte 0.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Why the memory has no dma-buf, when it has none.
    pub fn dmabuf_refused(&self) -> Option<&str> {
        self.dmabuf_refused.as_deref()
    }

    fn check_live(&self) -> Result<(), Error> {
        match self.driver.buffer_id(self.gpu.ordinal, self.ptr) {
            Ok(id) if id == self.buffer_id => Ok(()),
            Ok(id) => Err(Error::Invalidated(format!(
                "GPU {} memory at {:#x} was freed and reallocated (buffer id {} is now {id})",
                self.gpu.ordinal, self.ptr, self.buffer_id
            ))),
            Err(e) => Err(Error::Invalidated(format!(
                "GPU {} memory at {:#x} was freed ({e})",
                self.gpu.ordinal, self.ptr
            ))),
        }
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // Close the dma-buf before the memory behind it goes.
        drop(self.dmabuf.take());
        if self.owned {
            if let Err(e) = self.driver.free(self.gpu.ordinal, self.ptr) {
                tracing::warn!(
                    gpu = self.gpu.ordinal,
                    ptr = self.ptr,
                    "cuMemFree failed: {e}"
                );
            }
        }
    }
}

impl Provider for CudaMemory {
    fn kind(&self) -> &'static str {
        "cuda"
    }
    fn describe(&self) -> String {
        format!(
            "{} bytes on GPU {} ({}, {}){}",
            self.len,
            self.gpu.ordinal,
            self.gpu.name,
            self.gpu.pci_bus_id,
            if self.owned {
                ""
            } else {
                ", owned by the application"
            }
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
        // The driver may print an 8-digit domain ("00000000:41:00.0"); sysfs uses 4.
        let id = &self.gpu.pci_bus_id;
        match id.split_once(':') {
            Some((dom, rest)) if dom.len() > 4 => Some(format!("{}:{rest}", &dom[dom.len() - 4..])),
            _ => Some(id.clone()),
        }
    }
    fn no_mapping_reason(&self) -> Option<String> {
        Some("GPU memory has no CPU mapping; pinned or ODP registration of a CUDA pointer would need the nvidia-peermem kernel module, which p2p-rdma does not rely on (the dma-buf path replaces it)".into())
    }
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        self.dmabuf.as_ref().map(|fd| (fd.as_fd(), 0))
    }
    fn no_dmabuf_reason(&self) -> Option<String> {
        self.dmabuf_refused.clone()
    }
    fn copy_engine(&self) -> &'static str {
        "cuMemcpyDtoH/HtoD"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("GPU region", offset, out.len() as u64, self.len)?;
        self.check_live()?;
        self.driver
            .copy_to_host(self.gpu.ordinal, out, self.ptr + offset)
            .map_err(cuda_err(format!(
                "copying {} bytes from the GPU",
                out.len()
            )))
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        check_range("GPU region", offset, data.len() as u64, self.len)?;
        self.check_live()?;
        self.driver
            .copy_to_device(self.gpu.ordinal, self.ptr + offset, data)
            .map_err(cuda_err(format!("copying {} bytes to the GPU", data.len())))
    }
    fn check_valid(&self) -> Result<(), Error> {
        self.check_live()
    }
}

#[cfg(test)]
mod tests;
