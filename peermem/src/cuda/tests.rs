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
    fn step(&self, call: &'static str) -> Result<std::sync::MutexGuard<'_, FakeState>, CuError> {
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
    let e = CudaMemory::allocate(Arc::clone(&fake) as Arc<dyn CudaDriver>, 0, 1 << 20).unwrap_err();
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
        let dev = CudaDevice::allocate(Arc::clone(fake) as Arc<dyn CudaDriver>, 0, len).unwrap();
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
        let dev =
            CudaDevice::allocate(Arc::clone(&fake) as Arc<dyn CudaDriver>, 0, 4 * UNIT).unwrap();
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
        let dev = CudaDevice::allocate(Arc::clone(&fake) as Arc<dyn CudaDriver>, 0, len).unwrap();
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
