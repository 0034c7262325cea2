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
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A driver table over host vectors: allocations at fake device addresses, buffer ids that
    /// change on reallocation, injectable failures, and a log of calls.
    #[derive(Debug, Default)]
    struct Fake {
        gpus: Vec<GpuInfo>,
        state: Mutex<FakeState>,
    }

    #[derive(Debug, Default)]
    struct FakeState {
        /// base address → (buffer id, bytes)
        allocs: HashMap<u64, (u64, Vec<u8>)>,
        next_addr: u64,
        next_id: u64,
        fail: HashMap<&'static str, i32>,
        log: Vec<String>,
        sync_memops: Vec<u64>,
        /// dma-buf exports: (address, bytes)
        exports: Vec<(u64, u64)>,
    }

    impl Fake {
        fn new(dmabuf: bool) -> Arc<Fake> {
            Arc::new(Fake {
                gpus: vec![GpuInfo {
                    ordinal: 0,
                    name: "Fake GPU".into(),
                    pci_bus_id: "0000:41:00.0".into(),
                    total_mem: 1 << 30,
                    dmabuf_supported: dmabuf,
                }],
                state: Mutex::new(FakeState {
                    next_addr: 0x7f00_0000_0000,
                    next_id: 1,
                    ..Default::default()
                }),
            })
        }
        fn fail(&self, call: &'static str, code: i32) {
            self.state.lock().unwrap().fail.insert(call, code);
        }
        fn step(
            &self,
            call: &'static str,
        ) -> Result<std::sync::MutexGuard<'_, FakeState>, CuError> {
            let mut s = self.state.lock().unwrap();
            s.log.push(call.to_string());
            match s.fail.get(call) {
                Some(&c) => Err(CuError::new(call, c)),
                None => Ok(s),
            }
        }
        /// The allocation holding `ptr..ptr+len`, as (base, offset).
        fn find(
            s: &FakeState,
            ptr: u64,
            len: usize,
            call: &'static str,
        ) -> Result<(u64, usize), CuError> {
            for (&base, (_, v)) in &s.allocs {
                if ptr >= base && ptr + len as u64 <= base + v.len() as u64 {
                    return Ok((base, (ptr - base) as usize));
                }
            }
            Err(CuError::new(call, code::INVALID_VALUE))
        }
        /// The application frees `ptr` behind the provider's back (and maybe reallocates it).
        fn app_free(&self, ptr: u64, realloc: bool) {
            let mut s = self.state.lock().unwrap();
            let (_, v) = s.allocs.remove(&ptr).unwrap();
            if realloc {
                let id = s.next_id;
                s.next_id += 1;
                s.allocs.insert(ptr, (id, vec![0xEE; v.len()]));
            }
        }
        fn log(&self) -> Vec<String> {
            self.state.lock().unwrap().log.clone()
        }
    }

    impl CudaDriver for Fake {
        fn describe(&self) -> String {
            "fake".into()
        }
        fn device_count(&self) -> Result<u32, CuError> {
            let _s = self.step("cuDeviceGetCount")?;
            Ok(self.gpus.len() as u32)
        }
        fn device(&self, ordinal: u32) -> Result<GpuInfo, CuError> {
            let _s = self.step("cuDeviceGet")?;
            self.gpus
                .get(ordinal as usize)
                .cloned()
                .ok_or(CuError::new("cuDeviceGet", code::INVALID_DEVICE))
        }
        fn alloc(&self, _: u32, size: u64) -> Result<u64, CuError> {
            let mut s = self.step("cuMemAlloc")?;
            let (addr, id) = (s.next_addr, s.next_id);
            s.next_addr += size.next_multiple_of(GPU_PAGE);
            s.next_id += 1;
            s.allocs.insert(addr, (id, vec![0; size as usize]));
            Ok(addr)
        }
        fn free(&self, _: u32, ptr: u64) -> Result<(), CuError> {
            let mut s = self.step("cuMemFree")?;
            s.allocs
                .remove(&ptr)
                .map(|_| ())
                .ok_or(CuError::new("cuMemFree", code::INVALID_VALUE))
        }
        fn copy_to_host(&self, _: u32, dst: &mut [u8], src: u64) -> Result<(), CuError> {
            let s = self.step("cuMemcpyDtoH")?;
            let (base, off) = Fake::find(&s, src, dst.len(), "cuMemcpyDtoH")?;
            dst.copy_from_slice(&s.allocs[&base].1[off..off + dst.len()]);
            Ok(())
        }
        fn copy_to_device(&self, _: u32, dst: u64, src: &[u8]) -> Result<(), CuError> {
            let mut s = self.step("cuMemcpyHtoD")?;
            let (base, off) = Fake::find(&s, dst, src.len(), "cuMemcpyHtoD")?;
            s.allocs.get_mut(&base).unwrap().1[off..off + src.len()].copy_from_slice(src);
            Ok(())
        }
        fn set_sync_memops(&self, _: u32, ptr: u64) -> Result<(), CuError> {
            let mut s = self.step("cuPointerSetAttribute")?;
            Fake::find(&s, ptr, 1, "cuPointerSetAttribute")?;
            s.sync_memops.push(ptr);
            Ok(())
        }
        fn buffer_id(&self, _: u32, ptr: u64) -> Result<u64, CuError> {
            let s = self.step("cuPointerGetAttribute")?;
            let (base, _) = Fake::find(&s, ptr, 1, "cuPointerGetAttribute")?;
            Ok(s.allocs[&base].0)
        }
        fn export_dmabuf(&self, _: u32, ptr: u64, size: u64) -> Result<OwnedFd, CuError> {
            let mut s = self.step("cuMemGetHandleForAddressRange")?;
            s.exports.push((ptr, size));
            Fake::find(&s, ptr, size as usize, "cuMemGetHandleForAddressRange")?;
            assert_eq!(ptr % HOST_PAGE, 0, "export of an unaligned address");
            assert_eq!(size % HOST_PAGE, 0, "export of an unaligned size");
            Ok(std::fs::File::open("/dev/null").unwrap().into())
        }
    }

    fn alloc(fake: &Arc<Fake>, len: u64) -> CudaMemory {
        CudaMemory::allocate(Arc::clone(fake) as Arc<dyn CudaDriver>, 0, len).unwrap()
    }

    #[test]
    fn allocation_round_trips_through_the_copy_engine() {
        let fake = Fake::new(true);
        let m = alloc(&fake, 3 << 20);
        assert_eq!(m.len(), 3 << 20);
        assert_eq!(m.kind(), "cuda");
        assert!(
            m.describe().contains("GPU 0 (Fake GPU, 0000:41:00.0)"),
            "{}",
            m.describe()
        );
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        m.copy_in(12_345, &data).unwrap();
        let mut back = vec![0; data.len()];
        m.copy_out(12_345, &mut back).unwrap();
        assert_eq!(back, data);
        // Whole allocation rounded to 2 MiB, SYNC_MEMOPS set on it, dma-buf exported.
        let s = fake.state.lock().unwrap();
        assert_eq!(s.allocs[&m.device_ptr()].1.len(), 4 << 20);
        assert_eq!(s.sync_memops, vec![m.device_ptr()]);
        drop(s);
        assert_eq!(m.dmabuf().map(|(_, off)| off), Some(0));
        assert!(m.mapping().is_none());
        assert!(m.no_mapping_reason().unwrap().contains("nvidia-peermem"));
        assert_eq!(m.copy_engine(), "cuMemcpyDtoH/HtoD");
    }

    #[test]
    fn copies_stay_inside_the_region() {
        let fake = Fake::new(true);
        let m = alloc(&fake, 1000);
        let mut b = [0u8; 10];
        assert!(matches!(
            m.copy_out(995, &mut b),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            m.copy_in(u64::MAX - 2, &b),
            Err(Error::InvalidArgument(_))
        ));
        // The refused copies never reached the driver.
        assert!(!fake.log().iter().any(|c| c.starts_with("cuMemcpy")));
    }

    #[test]
    fn no_dmabuf_support_is_explained() {
        let fake = Fake::new(false);
        let m = alloc(&fake, 1 << 20);
        assert!(m.dmabuf().is_none());
        let why = m.no_dmabuf_reason().unwrap();
        assert!(why.contains("DMA_BUF_SUPPORTED = 0"), "{why}");
        assert!(!fake
            .log()
            .contains(&"cuMemGetHandleForAddressRange".to_string()));
    }

    #[test]
    fn a_refused_export_is_explained_and_not_fatal() {
        let fake = Fake::new(true);
        fake.fail("cuMemGetHandleForAddressRange", code::NOT_SUPPORTED);
        let m = alloc(&fake, 1 << 20);
        assert!(m.dmabuf().is_none());
        let why = m.no_dmabuf_reason().unwrap();
        assert!(why.contains("CUDA_ERROR_NOT_SUPPORTED (801)"), "{why}");
        // The copy engine still works: the bounce path can serve it.
        m.copy_in(0, b"still here").unwrap();
    }

    #[test]
    fn owned_memory_is_freed_once_on_drop() {
        let fake = Fake::new(true);
        let m = alloc(&fake, 1 << 20);
        let p = m.device_ptr();
        drop(m);
        assert!(!fake.state.lock().unwrap().allocs.contains_key(&p));
        let log = fake.log();
        assert_eq!(log.iter().filter(|c| *c == "cuMemFree").count(), 1);
    }

    #[test]
    fn adopted_memory_freed_by_its_owner_is_never_touched() {
        let fake = Fake::new(true);
        let app_ptr = fake.alloc(0, 1 << 20).unwrap();
        let m = CudaMemory::adopt(
            Arc::clone(&fake) as Arc<dyn CudaDriver>,
            0,
            app_ptr,
            1 << 20,
        )
        .unwrap();
        assert!(m.describe().contains("owned by the application"));
        m.copy_in(0, b"abc").unwrap();
        m.check_valid().unwrap();
        fake.app_free(app_ptr, false);
        let before = fake.log().len();
        let mut b = [0u8; 3];
        let e = m.copy_out(0, &mut b).unwrap_err();
        assert!(matches!(e, Error::Invalidated(_)), "{e}");
        assert!(e.to_string().contains("was freed"), "{e}");
        assert!(m.check_valid().is_err());
        assert!(
            !fake.log()[before..]
                .iter()
                .any(|c| c.starts_with("cuMemcpy")),
            "a copy reached freed memory"
        );
        // Dropping an adopted region does not free the application's memory.
        drop(m);
        assert!(!fake.log()[before..].contains(&"cuMemFree".to_string()));
    }

    #[test]
    fn reallocation_at_the_same_address_is_detected() {
        let fake = Fake::new(true);
        let app_ptr = fake.alloc(0, 1 << 20).unwrap();
        let m = CudaMemory::adopt(
            Arc::clone(&fake) as Arc<dyn CudaDriver>,
            0,
            app_ptr,
            1 << 20,
        )
        .unwrap();
        fake.app_free(app_ptr, true);
        let e = m.copy_in(0, b"x").unwrap_err();
        assert!(e.to_string().contains("freed and reallocated"), "{e}");
        // The new owner's bytes are untouched.
        assert_eq!(fake.state.lock().unwrap().allocs[&app_ptr].1[0], 0xEE);
    }

    #[test]
    fn unaligned_adopted_ranges_are_served_without_a_dmabuf() {
        let fake = Fake::new(true);
        let app_ptr = fake.alloc(0, 1 << 20).unwrap();
        let m = CudaMemory::adopt(
            Arc::clone(&fake) as Arc<dyn CudaDriver>,
            0,
            app_ptr + 100,
            5000,
        )
        .unwrap();
        assert!(m.dmabuf().is_none());
        assert!(m.no_dmabuf_reason().unwrap().contains("not page-aligned"));
        m.copy_in(4990, b"0123456789").unwrap();
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let fake = Fake::new(true);
        let d = || Arc::clone(&fake) as Arc<dyn CudaDriver>;
        let e = CudaMemory::allocate(d(), 3, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("sees one GPU (0)"), "{e}");
        assert!(matches!(
            CudaMemory::allocate(d(), 0, 0),
            Err(Error::InvalidArgument(_))
        ));
        fake.fail("cuMemAlloc", code::OUT_OF_MEMORY);
        let e = CudaMemory::allocate(d(), 0, 1 << 20).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("allocating 2097152 bytes on GPU 0"), "{s}");
        assert!(
            s.contains("CUDA_ERROR_OUT_OF_MEMORY (2)") && s.contains("nvidia-smi"),
            "{s}"
        );
        // A pointer that is not an allocation cannot be adopted.
        let e = CudaMemory::adopt(d(), 0, 0x1000, 4096).unwrap_err();
        assert!(e.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
    }

    #[test]
    fn a_failing_setup_frees_what_it_allocated() {
        let fake = Fake::new(true);
        fake.fail("cuPointerSetAttribute", code::NOT_SUPPORTED);
        let e =
            CudaMemory::allocate(Arc::clone(&fake) as Arc<dyn CudaDriver>, 0, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("SYNC_MEMOPS"), "{e}");
        assert!(
            fake.state.lock().unwrap().allocs.is_empty(),
            "the allocation leaked"
        );
    }

    #[test]
    fn without_a_driver_the_reason_is_precise() {
        match load() {
            // A machine with a GPU and the driver: the table must answer.
            Ok(d) => {
                d.device_count().unwrap();
            }
            Err(e) => {
                let s = e.to_string();
                if cfg!(feature = "cuda") {
                    assert!(s.contains("no CUDA driver"), "{s}");
                } else {
                    assert!(
                        s.contains("no CUDA support") && s.contains("--features cuda"),
                        "{s}"
                    );
                }
            }
        }
    }

    mod device_private {
        use super::*;
        use crate::hmm::{DeviceBacking, DevicePrivate, Policy, UNIT};

        fn region(fake: &Arc<Fake>, len: u64, window: u64) -> DevicePrivate {
            let dev =
                CudaDevice::allocate(Arc::clone(fake) as Arc<dyn CudaDriver>, 0, len).unwrap();
            DevicePrivate::new(Arc::new(dev), window, Policy::Copy)
        }

        fn pattern(len: usize) -> Vec<u8> {
            (0..len as u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect()
        }

        #[test]
        fn gpu_units_go_through_dmabuf_window_exports_or_the_copy_engine() {
            let fake = Fake::new(true);
            let len = 10 * UNIT + 1000;
            let dp = region(&fake, len, 3 * UNIT);
            // the whole allocation is not exported: only window units are
            assert!(fake.state.lock().unwrap().exports.is_empty());
            let data = pattern(len as usize);
            dp.write(0, &data).unwrap();
            let mut back = vec![0; len as usize];
            dp.read(0, &mut back).unwrap();
            assert!(back == data, "data read back differs");
            // an unaligned piece in the middle, across units
            let mut mid = vec![0; 150_000];
            dp.read(70_001, &mut mid).unwrap();
            assert!(mid[..] == data[70_001..220_001]);
            let st = dp.stats();
            assert!(st.window_bytes > 0 && st.bounce_bytes > 0, "{st:?}");
            assert_eq!(
                st.window_bytes + st.bounce_bytes,
                2 * len + 150_000,
                "{st:?}"
            );
            assert!(dp.window_in_use() <= 3 * UNIT);
            let s = fake.state.lock().unwrap();
            let base = s.allocs.keys().copied().next().unwrap();
            assert!(!s.exports.is_empty());
            for &(ptr, size) in &s.exports {
                assert_eq!(size, UNIT, "one unit per export");
                assert_eq!((ptr - base) % UNIT, 0, "unit-aligned export at {ptr:#x}");
                assert!(ptr - base < len, "export past the region at {ptr:#x}");
            }
        }

        #[test]
        fn a_window_unit_is_a_dmabuf_a_nic_can_register_and_the_cpu_reaches_by_copy() {
            let fake = Fake::new(true);
            let dev = CudaDevice::allocate(Arc::clone(&fake) as Arc<dyn CudaDriver>, 0, 4 * UNIT)
                .unwrap();
            dev.copy_in(UNIT + 10, b"hello").unwrap();
            let w = dev.map_window(UNIT + 5..UNIT + 20).unwrap();
            assert_eq!((w.kind(), w.len()), ("cuda-window", UNIT));
            assert_eq!(w.dmabuf().map(|(_, off)| off), Some(0));
            assert!(w.mapping().is_none() && w.no_mapping_reason().is_some());
            assert_eq!(w.pci_device().as_deref(), Some("0000:41:00.0"));
            let mut b = [0u8; 5];
            w.copy_out(10, &mut b).unwrap();
            assert_eq!(&b, b"hello");
            assert!(matches!(
                w.copy_out(UNIT - 2, &mut b),
                Err(Error::InvalidArgument(_))
            ));
            let e = dev.map_window(4 * UNIT..5 * UNIT).unwrap_err();
            assert!(e.to_string().contains("outside"), "{e}");
        }

        #[test]
        fn without_dmabuf_export_every_unit_falls_back_to_the_copy_engine_and_says_why() {
            let fake = Fake::new(false);
            let len = 4 * UNIT;
            let dev =
                CudaDevice::allocate(Arc::clone(&fake) as Arc<dyn CudaDriver>, 0, len).unwrap();
            let e = dev.map_window(0..UNIT).unwrap_err().to_string();
            assert!(
                e.contains("DMA_BUF_SUPPORTED = 0") && e.contains("open kernel modules"),
                "{e}"
            );
            assert!(dev.describe().contains("unavailable"), "{}", dev.describe());
            let dp = DevicePrivate::new(Arc::new(dev), 2 * UNIT, Policy::Copy);
            let data = pattern(len as usize);
            dp.write(0, &data).unwrap();
            let mut back = vec![0; len as usize];
            dp.read(0, &mut back).unwrap();
            assert!(back == data);
            let st = dp.stats();
            assert_eq!((st.window_bytes, st.bounce_bytes), (0, 2 * len), "{st:?}");
            assert!(st.window_fallbacks > 0, "{st:?}");
            assert!(fake.state.lock().unwrap().exports.is_empty());
        }

        #[test]
        fn gpu_memory_the_owner_freed_is_never_copied_nor_exported() {
            for realloc in [false, true] {
                let fake = Fake::new(true);
                let dp = region(&fake, 4 * UNIT, 2 * UNIT);
                dp.write(0, &pattern(4 * UNIT as usize)).unwrap();
                let base = fake
                    .state
                    .lock()
                    .unwrap()
                    .allocs
                    .keys()
                    .copied()
                    .next()
                    .unwrap();
                let exports = fake.state.lock().unwrap().exports.len();
                fake.app_free(base, realloc);
                let calls = fake.log().len();
                let mut b = vec![0; 100];
                // window hits and copy-engine units alike check the buffer id first
                for at in [0, UNIT, 2 * UNIT + 7, 3 * UNIT] {
                    let e = dp.read(at, &mut b).unwrap_err();
                    assert!(matches!(e, Error::Invalidated(_)), "{e}");
                    assert!(e.to_string().contains("freed"), "{e}");
                }
                assert!(dp.write(UNIT, &b).is_err());
                let log = fake.log();
                assert!(
                    !log[calls..].iter().any(|c| c.starts_with("cuMemcpy")),
                    "copied freed memory: {:?}",
                    &log[calls..]
                );
                assert_eq!(
                    fake.state.lock().unwrap().exports.len(),
                    exports,
                    "exported freed memory"
                );
            }
        }
    }
}
