//! The CUDA driver API, opened with `dlopen("libcuda.so.1")` at run time.
//!
//! The FFI boundary of the CUDA provider: every `unsafe` block of it is here. The entry points
//! are resolved once with `dlsym` and kept as typed function pointers; the library is never
//! closed (the driver does not support being unloaded while contexts exist).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Mutex;

use super::{code, CuError, CudaDriver, GpuInfo};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

const CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: c_int = 6;
const CU_POINTER_ATTRIBUTE_BUFFER_ID: c_int = 7;
const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;

/// The entry points, typed as in `cuda.h` (the `_v2` symbols are the 64-bit ones).
#[derive(Clone, Copy)]
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
    pointer_set_attribute: unsafe extern "C" fn(*const c_void, c_int, CuDevicePtr) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// CUDA >= 11.7 only.
    get_handle_for_address_range:
        Option<unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, c_int, u64) -> CuResult>,
}

/// Why the driver could not be opened.
#[derive(Debug, thiserror::Error)]
pub(super) enum OpenError {
    #[error("dlopen(libcuda.so.1) failed: {0}")]
    NoLibrary(String),
    #[error("libcuda.so.1 lacks {0} (driver too old?)")]
    MissingSymbol(&'static str),
    #[error("{0}")]
    Init(CuError),
}

/// libcuda.so.1, initialised, with one retained primary context per GPU used.
#[derive(Debug)]
pub(super) struct DlCuda {
    api: ApiDebug,
    version: i32,
    /// Primary contexts retained so far, by ordinal (pointers kept as integers: they are
    /// process-wide handles, valid on any thread).
    contexts: Mutex<HashMap<u32, usize>>,
}

struct ApiDebug(Api);

impl std::fmt::Debug for ApiDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("libcuda.so.1")
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; it is copied out at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Resolve `name` in `lib` as a function pointer of type `F`.
///
/// # Safety
/// `lib` is a handle from dlopen, and `F` is an `extern "C"` function pointer type matching
/// the symbol's C prototype.
unsafe fn sym<F: Copy>(lib: *mut c_void, name: &CStr) -> Option<F> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `lib` is a live dlopen handle and `name` a C string (caller's contract).
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        None
    } else {
        // SAFETY: a non-null symbol address reinterpreted as a function pointer of the same
        // size; the caller guarantees the prototype.
        Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
    }
}

macro_rules! need {
    ($lib:expr, $name:literal) => {
        // SAFETY: the field this initialises is typed after the symbol's prototype in cuda.h.
        unsafe { sym($lib, $name) }.ok_or(OpenError::MissingSymbol(match $name.to_str() {
            Ok(s) => s,
            Err(_) => "?",
        }))?
    };
}

impl DlCuda {
    pub(super) fn open() -> Result<DlCuda, OpenError> {
        // SAFETY: dlopen with a constant library name; the handle is never closed, so the
        // function pointers taken from it stay valid for the life of the process.
        let lib =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(OpenError::NoLibrary(dl_error()));
        }
        let api = Api {
            init: need!(lib, c"cuInit"),
            driver_get_version: need!(lib, c"cuDriverGetVersion"),
            device_get_count: need!(lib, c"cuDeviceGetCount"),
            device_get: need!(lib, c"cuDeviceGet"),
            device_get_name: need!(lib, c"cuDeviceGetName"),
            device_get_attribute: need!(lib, c"cuDeviceGetAttribute"),
            device_get_pci_bus_id: need!(lib, c"cuDeviceGetPCIBusId"),
            device_total_mem: need!(lib, c"cuDeviceTotalMem_v2"),
            primary_ctx_retain: need!(lib, c"cuDevicePrimaryCtxRetain"),
            ctx_set_current: need!(lib, c"cuCtxSetCurrent"),
            mem_alloc: need!(lib, c"cuMemAlloc_v2"),
            mem_free: need!(lib, c"cuMemFree_v2"),
            memcpy_dtoh: need!(lib, c"cuMemcpyDtoH_v2"),
            memcpy_htod: need!(lib, c"cuMemcpyHtoD_v2"),
            pointer_get_attribute: need!(lib, c"cuPointerGetAttribute"),
            pointer_set_attribute: need!(lib, c"cuPointerSetAttribute"),
            get_error_name: need!(lib, c"cuGetErrorName"),
            get_error_string: need!(lib, c"cuGetErrorString"),
            // SAFETY: typed after cuMemGetHandleForAddressRange's prototype in cuda.h.
            get_handle_for_address_range: unsafe { sym(lib, c"cuMemGetHandleForAddressRange") },
        };
        let mut d = DlCuda {
            api: ApiDebug(api),
            version: 0,
            contexts: Mutex::new(HashMap::new()),
        };
        // SAFETY: cuInit takes flags 0.
        d.check("cuInit", unsafe { (api.init)(0) })
            .map_err(OpenError::Init)?;
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer for the duration of the call.
        d.check("cuDriverGetVersion", unsafe {
            (api.driver_get_version)(&mut v)
        })
        .map_err(OpenError::Init)?;
        d.version = v;
        Ok(d)
    }

    fn api(&self) -> &Api {
        &self.api.0
    }

    fn check(&self, call: &'static str, r: CuResult) -> Result<(), CuError> {
        if r == code::SUCCESS {
            return Ok(());
        }
        let text = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: `p` is a valid out-pointer; on success the driver points it at a static
            // NUL-terminated string, copied out at once.
            unsafe {
                if f(r, &mut p) == code::SUCCESS && !p.is_null() {
                    Some(CStr::from_ptr(p).to_string_lossy().into_owned())
                } else {
                    None
                }
            }
        };
        let mut e = CuError::new(call, r);
        if let Some(n) = text(self.api().get_error_name) {
            e.name = n;
        }
        e.text = text(self.api().get_error_string).unwrap_or_default();
        Err(e)
    }

    fn device_handle(&self, ordinal: u32) -> Result<CuDevice, CuError> {
        let mut dev: CuDevice = 0;
        let o = c_int::try_from(ordinal)
            .map_err(|_| CuError::new("cuDeviceGet", code::INVALID_DEVICE))?;
        // SAFETY: `dev` is a valid out-pointer.
        self.check("cuDeviceGet", unsafe {
            (self.api().device_get)(&mut dev, o)
        })?;
        Ok(dev)
    }

    /// Make GPU `ordinal`'s primary context current on this thread (retaining it once).
    fn enter(&self, ordinal: u32) -> Result<(), CuError> {
        let ctx = {
            let mut map = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&ordinal) {
                Some(&c) => c,
                None => {
                    let dev = self.device_handle(ordinal)?;
                    let mut c: CuContext = std::ptr::null_mut();
                    // SAFETY: `c` is a valid out-pointer; the retained context is never
                    // released, so the handle stays valid for the process.
                    self.check("cuDevicePrimaryCtxRetain", unsafe {
                        (self.api().primary_ctx_retain)(&mut c, dev)
                    })?;
                    map.insert(ordinal, c as usize);
                    c as usize
                }
            }
        };
        // SAFETY: `ctx` is a primary context retained above and never released.
        self.check("cuCtxSetCurrent", unsafe {
            (self.api().ctx_set_current)(ctx as CuContext)
        })
    }
}

impl CudaDriver for DlCuda {
    fn describe(&self) -> String {
        format!(
            "libcuda.so.1, CUDA driver API {}.{}",
            self.version / 1000,
            self.version % 1000 / 10
        )
    }

    fn device_count(&self) -> Result<u32, CuError> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.api().device_get_count)(&mut n)
        })?;
        Ok(n.max(0) as u32)
    }

    fn device(&self, ordinal: u32) -> Result<GpuInfo, CuError> {
        let dev = self.device_handle(ordinal)?;
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` bytes and the driver NUL-terminates within them.
        self.check("cuDeviceGetName", unsafe {
            (self.api().device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        let mut bus = [0 as c_char; 64];
        // SAFETY: as above.
        self.check("cuDeviceGetPCIBusId", unsafe {
            (self.api().device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, dev)
        })?;
        let mut total = 0usize;
        // SAFETY: `total` is a valid out-pointer.
        self.check("cuDeviceTotalMem", unsafe {
            (self.api().device_total_mem)(&mut total, dev)
        })?;
        let mut dmabuf = 0;
        // SAFETY: `dmabuf` is a valid out-pointer. Older drivers do not know the attribute and
        // return CUDA_ERROR_INVALID_VALUE: that means "not supported".
        let r = unsafe {
            (self.api().device_get_attribute)(
                &mut dmabuf,
                CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                dev,
            )
        };
        let cstr = |b: &[c_char]| {
            // SAFETY: both buffers were zero-filled and the driver wrote a NUL-terminated
            // string shorter than them, so a NUL lies within the slice.
            unsafe { CStr::from_ptr(b.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        };
        Ok(GpuInfo {
            ordinal,
            name: cstr(&name),
            pci_bus_id: cstr(&bus).to_lowercase(),
            total_mem: total as u64,
            dmabuf_supported: r == code::SUCCESS
                && dmabuf != 0
                && self.api().get_handle_for_address_range.is_some(),
        })
    }

    fn alloc(&self, ordinal: u32, size: u64) -> Result<u64, CuError> {
        self.enter(ordinal)?;
        let n =
            usize::try_from(size).map_err(|_| CuError::new("cuMemAlloc", code::INVALID_VALUE))?;
        let mut p: CuDevicePtr = 0;
        // SAFETY: `p` is a valid out-pointer; the allocation is owned by the caller.
        self.check("cuMemAlloc", unsafe { (self.api().mem_alloc)(&mut p, n) })?;
        Ok(p)
    }

    fn free(&self, ordinal: u32, ptr: u64) -> Result<(), CuError> {
        self.enter(ordinal)?;
        // SAFETY: the caller frees an allocation of its own exactly once (CudaMemory's Drop).
        self.check("cuMemFree", unsafe { (self.api().mem_free)(ptr) })
    }

    fn copy_to_host(&self, ordinal: u32, dst: &mut [u8], src: u64) -> Result<(), CuError> {
        self.enter(ordinal)?;
        // SAFETY: `dst` is a writable host buffer of `dst.len()` bytes for the whole
        // (synchronous) copy; the driver checks the device range itself.
        self.check("cuMemcpyDtoH", unsafe {
            (self.api().memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    fn copy_to_device(&self, ordinal: u32, dst: u64, src: &[u8]) -> Result<(), CuError> {
        self.enter(ordinal)?;
        // SAFETY: `src` is a readable host buffer of `src.len()` bytes for the whole
        // (synchronous) copy; the driver checks the device range itself.
        self.check("cuMemcpyHtoD", unsafe {
            (self.api().memcpy_htod)(dst, src.as_ptr().cast(), src.len())
        })
    }

    fn set_sync_memops(&self, ordinal: u32, ptr: u64) -> Result<(), CuError> {
        self.enter(ordinal)?;
        let one: c_uint = 1;
        // SAFETY: SYNC_MEMOPS takes a pointer to an unsigned int, valid during the call.
        self.check("cuPointerSetAttribute(SYNC_MEMOPS)", unsafe {
            (self.api().pointer_set_attribute)(
                (&one as *const c_uint).cast(),
                CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                ptr,
            )
        })
    }

    fn buffer_id(&self, ordinal: u32, ptr: u64) -> Result<u64, CuError> {
        self.enter(ordinal)?;
        let mut id: u64 = 0;
        // SAFETY: BUFFER_ID writes an unsigned long long through the pointer.
        self.check("cuPointerGetAttribute(BUFFER_ID)", unsafe {
            (self.api().pointer_get_attribute)(
                (&mut id as *mut u64).cast(),
                CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            )
        })?;
        Ok(id)
    }

    fn export_dmabuf(&self, ordinal: u32, ptr: u64, size: u64) -> Result<OwnedFd, CuError> {
        let Some(f) = self.api().get_handle_for_address_range else {
            return Err(CuError {
                call: "cuMemGetHandleForAddressRange",
                code: code::NOT_SUPPORTED,
                name: "missing".into(),
                text: "this driver predates CUDA 11.7 and cannot export dma-bufs".into(),
            });
        };
        self.enter(ordinal)?;
        let n = usize::try_from(size)
            .map_err(|_| CuError::new("cuMemGetHandleForAddressRange", code::INVALID_VALUE))?;
        let mut fd: c_int = -1;
        // SAFETY: for the DMA_BUF_FD handle type the handle out-parameter is an int.
        self.check("cuMemGetHandleForAddressRange", unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                ptr,
                n,
                CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        // SAFETY: on success the driver returned a new dma-buf fd that this process owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}
