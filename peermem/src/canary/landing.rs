//! The landing canary: an RDMA READ whose local end is the MR, so that the NIC writes the
//! response into it. That is a path of its own in a NIC (rxe: the requester's completion
//! copies each response packet into the MR, where a remote WRITE is copied by the responder),
//! so the canary of a remote WRITE does not prove it. A server that RDMA-READs a client's
//! buffer straight into device memory (a put into an NVMe CMB ring slot) proves it first.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use verbs::{Access, HostBuffer, Local, ProtectionDomain, RegMode, RegionRef};

use super::{canary_pair, diff, first_at, pattern_over, range_at, CanaryAt, DeviceMr};
use crate::error::Error;

/// What a READ landing in the MR did.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LandingReport {
    /// Scratch range start within the region.
    pub offset: u64,
    /// Scratch range length.
    pub len: u64,
    /// Path MTU of the loopback connection.
    pub path_mtu: u32,
    /// Bytes the READ left wrong in the MR (CPU view after its completion).
    pub wrong: u64,
    /// First wrong byte, relative to `offset`.
    pub first_wrong: Option<u64>,
}

impl LandingReport {
    /// Whether every byte landed right.
    pub fn ok(&self) -> bool {
        self.wrong == 0
    }
}

impl fmt::Display for LandingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ok() {
            write!(
                f,
                "landing canary passed: an RDMA READ of {} bytes into offset {} (path MTU {}) \
                 landed every byte right",
                self.len, self.offset, self.path_mtu
            )
        } else {
            write!(
                f,
                "landing canary FAILED at path MTU {}: an RDMA READ of {} bytes into offset {} \
                 left {} wrong{} (the completion reported success)",
                self.path_mtu,
                self.len,
                self.offset,
                self.wrong,
                first_at(self.first_wrong),
            )
        }
    }
}

/// RDMA-READ a pattern from a host buffer into the scratch range `at` names of `region`'s MR
/// (on QPs at path MTU `max_mtu` at most) and compare what the CPU then sees; the range is
/// restored afterwards. Only memory the server allocated itself (writable, holding no data)
/// is written, and the MR must allow local writes.
pub async fn run_landing_canary(
    pd: &ProtectionDomain,
    region: &Arc<DeviceMr>,
    at: CanaryAt,
    max_mtu: Option<u32>,
) -> Result<LandingReport, Error> {
    let prov = region.provider();
    if !prov.writable() || prov.holds_data() {
        return Err(Error::InvalidArgument(format!(
            "a landing canary writes the memory, and {} memory that is read-only or holds data \
             is never written by a canary",
            prov.kind()
        )));
    }
    if !region.mr().access().contains(Access::LOCAL_WRITE) {
        return Err(Error::InvalidArgument(
            "the MR is registered without local write: a READ cannot land in it".into(),
        ));
    }
    let (_a, b, path_mtu) = canary_pair(pd, max_mtu)?;
    let (offset, len) = range_at(at, region.mr().len() as u64, path_mtu)?;
    let (base, n) = (region.start(), len as usize);
    let mut original = vec![0u8; n];
    prov.copy_out(base + offset, &mut original)?;
    let pattern = pattern_over(&original);
    let result = async {
        let mut src = pd.register(
            HostBuffer::new(n)?,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
            RegMode::Pinned,
        )?;
        src.as_mut_slice().copy_from_slice(&pattern);
        let from = src.mr().remote(0..len)?;
        let mr: Arc<dyn RegionRef> = Arc::clone(region) as Arc<dyn RegionRef>;
        let into = Local::region(mr, offset as usize..(offset + len) as usize)?;
        b.read(into, from).await?;
        drop(src);
        let mut seen = vec![0u8; n];
        prov.copy_out(base + offset, &mut seen)?;
        let (wrong, first_wrong) = diff(&seen, &pattern);
        Ok::<_, Error>(LandingReport {
            offset,
            len,
            path_mtu,
            wrong,
            first_wrong,
        })
    }
    .await;
    let restored = prov.copy_in(base + offset, &original);
    let report = result?;
    restored?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_landing_report_says_how_many_bytes_landed_wrong() {
        let mut r = LandingReport {
            offset: 0,
            len: 12_411,
            path_mtu: 1024,
            wrong: 3072,
            first_wrong: Some(1024),
        };
        assert!(!r.ok());
        let s = r.to_string();
        assert!(
            s.contains("FAILED at path MTU 1024") && s.contains("left 3072 wrong (first at +1024)"),
            "{s}"
        );
        r.wrong = 0;
        assert!(r.ok() && r.to_string().contains("landed every byte right"));
    }
}
