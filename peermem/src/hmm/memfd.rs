//! A device emulated by a memfd: the device-private backing the lab (and tests) use where no
//! GPU is.

use super::*;

/// Device memory emulated by a memfd this process never maps: copy engine pread/pwrite, P2P
/// window = dma-bufs of memfd ranges exported through `/dev/udmabuf` (on a NIC without dma-buf
/// MRs, such as rxe, registering them fails and the unit falls back by the policy).
#[derive(Debug)]
pub struct MemfdDevice {
    memfd: std::fs::File,
    len: u64,
    udmabuf: std::path::PathBuf,
}

impl MemfdDevice {
    /// `len` bytes (rounded up to whole units), windows through `/dev/udmabuf`.
    pub fn new(len: u64) -> Result<MemfdDevice, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a device-private region needs at least 1 byte".into(),
            ));
        }
        let rounded = len.div_ceil(UNIT) * UNIT;
        Ok(MemfdDevice {
            memfd: crate::udmabuf::sealed_memfd(rounded)?,
            len,
            udmabuf: crate::udmabuf::Udmabuf::default_device(),
        })
    }
}

impl DeviceBacking for MemfdDevice {
    fn describe(&self) -> String {
        format!(
            "{} bytes of emulated device memory (an unmapped memfd)",
            self.len
        )
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        crate::provider::check_range("device memory", offset, out.len() as u64, self.len)?;
        crate::udmabuf::memfd_read(&self.memfd, offset, out, "device memfd")
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        crate::provider::check_range("device memory", offset, data.len() as u64, self.len)?;
        crate::udmabuf::memfd_write(&self.memfd, offset, data, "device memfd")
    }
    fn map_window(&self, range: Range<u64>) -> Result<Arc<dyn Provider>, Error> {
        // export whole units (the memfd is sized in units)
        let start = range.start / UNIT * UNIT;
        let end = range.end.div_ceil(UNIT) * UNIT;
        let fd = crate::udmabuf::export_range(&self.udmabuf, &self.memfd, start, end - start)?;
        Ok(Arc::new(crate::provider::DmaBufMemory::from_fd(
            fd,
            end - start,
        )?))
    }
}
