//! Registration attempts proved by a canary.
//!
//! A registration that succeeds is not proof that transfers work (rxe 7.3 completes ODP READs
//! and WRITEs at path MTU 1024 with wrong bytes), so every strategy that registers is followed by
//! a canary: an RDMA WRITE and an RDMA READ through that very MR on a loopback QP pair, over a
//! scratch range that spans more than one path MTU and starts partway into a page; the bytes are
//! compared with the CPU's view and the range is restored afterwards.
//!
//! The WRITE half runs only on memory the server allocated itself, before anyone can see it.
//! Memory that holds data ([`Provider::holds_data`]: a file, the embedding application's
//! memory, a dma-buf handed in) is never written by a canary — a crash between the write and
//! the restore would leave a served file changed — so it is registered without remote write
//! and only the READ half runs (its puts go through the server).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use serde::Serialize;
use verbs::{
    Access, HostBuffer, Local, MemoryRegion, ProtectionDomain, QpOptions, QueuePair, RegMode,
    SharedRegion,
};

use crate::error::Error;
use crate::provider::Provider;

mod landing;
pub use landing::{run_landing_canary, LandingReport};

/// What the canary saw.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CanaryReport {
    /// Scratch range start within the region.
    pub offset: u64,
    /// Scratch range length.
    pub len: u64,
    /// Path MTU of the loopback connection.
    pub path_mtu: u32,
    /// Whether the WRITE half ran (not on read-only memory).
    pub write_checked: bool,
    /// Bytes that an RDMA WRITE into the MR did not deliver correctly (CPU view after the write).
    pub write_wrong: u64,
    /// First wrong byte of the WRITE, relative to `offset`.
    pub write_first_wrong: Option<u64>,
    /// Bytes that an RDMA READ from the MR returned wrong.
    pub read_wrong: u64,
    /// First wrong byte of the READ, relative to `offset`.
    pub read_first_wrong: Option<u64>,
}

impl CanaryReport {
    /// Whether both directions moved every byte right.
    pub fn ok(&self) -> bool {
        self.write_wrong == 0 && self.read_wrong == 0
    }
}

impl fmt::Display for CanaryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ok() {
            write!(
                f,
                "canary passed: RDMA {} of {} bytes at offset {} (path MTU {}) moved every byte right",
                if self.write_checked { "WRITE and READ" } else { "READ (memory that is read-only or holds data is never written by a canary)" },
                self.len, self.offset, self.path_mtu
            )
        } else {
            write!(
                f,
                "canary FAILED at path MTU {}: of {} bytes at offset {}, WRITE got {} wrong{}, READ got {} wrong{} \
                 (the completions reported success)",
                self.path_mtu,
                self.len,
                self.offset,
                self.write_wrong,
                first_at(self.write_first_wrong),
                self.read_wrong,
                first_at(self.read_first_wrong),
            )
        }
    }
}

/// How one strategy fared.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum AttemptOutcome {
    /// The memory offers no way in for this strategy.
    NotApplicable {
        /// Why.
        message: String,
    },
    /// Registration failed.
    RegistrationFailed {
        /// errno, if the OS gave one.
        errno: Option<i32>,
        /// The full message (call, context, meaning).
        message: String,
    },
    /// Registered; the canary failed, so the strategy is not used.
    CanaryFailed {
        /// What the canary saw.
        canary: CanaryReport,
    },
    /// The canary could not run (QP set-up failed, or a transfer completed with an error).
    CanaryError {
        /// Why.
        message: String,
    },
    /// Registered and proved by the canary.
    Works {
        /// What the canary saw.
        canary: CanaryReport,
    },
}

/// One registration attempt.
#[derive(Debug, Clone, Serialize)]
pub struct Attempt {
    /// Strategy.
    pub mode: RegMode,
    /// Result.
    #[serde(flatten)]
    pub outcome: AttemptOutcome,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            AttemptOutcome::NotApplicable { message } => {
                write!(f, "{}: not applicable: {message}", self.mode)
            }
            AttemptOutcome::RegistrationFailed { message, .. } => {
                write!(f, "{}: registration failed: {message}", self.mode)
            }
            AttemptOutcome::CanaryFailed { canary } => {
                write!(f, "{}: registered, but {canary}", self.mode)
            }
            AttemptOutcome::CanaryError { message } => write!(
                f,
                "{}: registered, canary could not run: {message}",
                self.mode
            ),
            AttemptOutcome::Works { canary } => write!(f, "{}: registered; {canary}", self.mode),
        }
    }
}

/// The strategies tried, in order, and the region of the first that works.
#[derive(Debug)]
pub struct Registration {
    /// Every attempt, in order.
    pub attempts: Vec<Attempt>,
    /// The registration in use, if any strategy worked.
    pub region: Option<DeviceMr>,
}

/// The scratch range the canary uses in a region of `len` bytes: more than one path MTU,
/// starting partway into a page.
pub fn scratch_range(len: u64, path_mtu: u32) -> (u64, u64) {
    let page = 4096u64;
    let want = 2 * u64::from(path_mtu.max(256)) + page + 123;
    let start = page / 2 + 100;
    if len > start + want {
        (start, want)
    } else {
        let start = len / 4;
        (start, len - start)
    }
}

/// The bytes a canary writes over `original`: every byte differs from the one it replaces, and
/// the pattern changes along the range, so a misplaced copy shows.
fn pattern_over(original: &[u8]) -> Vec<u8> {
    original
        .iter()
        .enumerate()
        .map(|(i, b)| !b ^ (i as u8 & 0x10))
        .collect()
}

/// " (first at +N)" for a report's first wrong byte, or nothing.
fn first_at(first_wrong: Option<u64>) -> String {
    first_wrong
        .map(|o| format!(" (first at +{o})"))
        .unwrap_or_default()
}

fn diff(a: &[u8], b: &[u8]) -> (u64, Option<u64>) {
    let mut n = 0u64;
    let mut first = None;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x != y {
            n += 1;
            first.get_or_insert(i as u64);
        }
    }
    (n, first)
}

/// An MR over a provider's memory, of one of the strategies. The MR is deregistered (dropped)
/// before the provider can go away.
#[derive(Debug)]
pub struct DeviceMr {
    // drop order: the MR first, then the provider
    inner: MrInner,
    provider: Arc<dyn Provider>,
    start: u64,
}

#[derive(Debug)]
enum MrInner {
    Cpu(SharedRegion),
    DmaBuf(MemoryRegion),
}

impl DeviceMr {
    /// The MR.
    pub fn mr(&self) -> &MemoryRegion {
        match &self.inner {
            MrInner::Cpu(r) => r.mr(),
            MrInner::DmaBuf(m) => m,
        }
    }
    /// The strategy.
    pub fn mode(&self) -> RegMode {
        self.mr().mode()
    }
    /// The memory.
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }
    /// Offset in the provider of the MR's byte 0.
    pub fn start(&self) -> u64 {
        self.start
    }
}

/// Work requests may use the MR as their local memory ([`verbs::Local::region`]): the MR, and
/// the memory behind it, live as long as the work request holds it.
impl verbs::RegionRef for DeviceMr {
    fn memory_region(&self) -> &MemoryRegion {
        self.mr()
    }
}

/// Why a strategy did not produce an MR.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The memory offers no way in for this strategy (no CPU mapping, not a dma-buf).
    #[error("not applicable: {0}")]
    NotApplicable(String),
    /// The registration call failed.
    #[error(transparent)]
    Failed(#[from] verbs::Error),
}

/// Register `range` of `provider` with one strategy (no canary).
pub fn register_mode(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    range: Range<u64>,
    access: Access,
    mode: RegMode,
) -> Result<DeviceMr, Refusal> {
    if range.start >= range.end || range.end > provider.len() {
        return Err(Refusal::Failed(verbs::Error::InvalidArgument(format!(
            "range {}..{} is outside the {}-byte {} memory",
            range.start,
            range.end,
            provider.len(),
            provider.kind()
        ))));
    }
    if let Err(e) = provider.check_valid() {
        return Err(Refusal::NotApplicable(e.to_string()));
    }
    let len = usize::try_from(range.end - range.start)
        .map_err(|_| Refusal::NotApplicable("the range does not fit in memory".into()))?;
    let inner = match mode {
        RegMode::DmaBuf => {
            let Some((fd, off)) = provider.dmabuf() else {
                return Err(Refusal::NotApplicable(
                    provider.no_dmabuf_reason().unwrap_or_else(|| {
                        format!("{} memory is not exported as a dma-buf", provider.kind())
                    }),
                ));
            };
            MrInner::DmaBuf(pd.register_dmabuf(fd, off + range.start, len, 0, access)?)
        }
        RegMode::Pinned | RegMode::OnDemand => {
            let Some((mem, base)) = provider.mapping() else {
                if let Some(why) = provider.no_mapping_reason() {
                    return Err(Refusal::NotApplicable(why));
                }
                return Err(Refusal::NotApplicable(format!(
                    "{} memory has no CPU mapping a NIC could register (only {})",
                    provider.kind(),
                    if provider.dmabuf().is_some() {
                        "a dma-buf"
                    } else {
                        "its copy engine"
                    }
                )));
            };
            let s = (base + range.start) as usize;
            MrInner::Cpu(pd.register_shared_range(mem, s..s + len, access, mode)?)
        }
    };
    Ok(DeviceMr {
        inner,
        provider: Arc::clone(provider),
        start: range.start,
    })
}

/// The scratch range of a canary for memory whose every access starts on a page (a staging
/// ring's slots): from byte 0, over more than one path MTU and into a further page.
pub fn page_start_range(len: u64, path_mtu: u32) -> (u64, u64) {
    let want = 2 * u64::from(path_mtu.max(256)) + 4096 + 123;
    (0, want.min(len))
}

/// Where a canary's scratch range starts: the access pattern it proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CanaryAt {
    /// Partway into a page ([`scratch_range`]): proves access at any offset.
    MidPage,
    /// On a page ([`page_start_range`]): proves only accesses that start on a page.
    PageStart,
}

/// Run the canary through `region`'s MR. The memory is restored afterwards. On read-only
/// memory only the READ half runs (against the CPU's view of the bytes).
pub async fn run_canary(pd: &ProtectionDomain, region: &DeviceMr) -> Result<CanaryReport, Error> {
    run_canary_at(pd, region, CanaryAt::MidPage, None).await
}

/// A loopback QP pair at the port's path MTU, or at `max_mtu` where that is smaller (the path
/// MTU a server capped with `--mtu` runs at), with its path MTU.
fn canary_pair(
    pd: &ProtectionDomain,
    max_mtu: Option<u32>,
) -> Result<(QueuePair, QueuePair, u32), Error> {
    let opts = QpOptions {
        max_path_mtu: max_mtu,
        ..QpOptions::default()
    };
    let (a, b) = QueuePair::loopback_pair(pd, opts)?;
    let path_mtu = verbs::negotiate_mtu(a.endpoint().mtu, b.endpoint().mtu);
    Ok((a, b, path_mtu))
}

/// The scratch range of a canary at `at` in a region of `region_len` bytes.
fn range_at(at: CanaryAt, region_len: u64, path_mtu: u32) -> Result<(u64, u64), Error> {
    let (offset, len) = match at {
        CanaryAt::MidPage => scratch_range(region_len, path_mtu),
        CanaryAt::PageStart => page_start_range(region_len, path_mtu),
    };
    if len == 0 {
        return Err(Error::InvalidArgument(
            "the region is too small for a canary".into(),
        ));
    }
    Ok((offset, len))
}

/// [`run_canary`] over the scratch range `at` names, on QPs at path MTU `max_mtu` at most.
pub async fn run_canary_at(
    pd: &ProtectionDomain,
    region: &DeviceMr,
    at: CanaryAt,
    max_mtu: Option<u32>,
) -> Result<CanaryReport, Error> {
    let prov = region.provider();
    let (a, b, path_mtu) = canary_pair(pd, max_mtu)?;
    let (offset, len) = range_at(at, region.mr().len() as u64, path_mtu)?;
    let base = region.start();
    let writable = prov.writable()
        && !prov.holds_data()
        && region.mr().access().contains(Access::REMOTE_WRITE);
    let n = len as usize;
    let mut original = vec![0u8; n];
    prov.copy_out(base + offset, &mut original)?;
    let pattern = pattern_over(&original);
    let target = region.mr().remote(offset..offset + len)?;
    let result = async {
        let (mut write_wrong, mut write_first_wrong) = (0, None);
        let expect = if writable {
            // WRITE through the MR, check with the CPU
            let mut src = pd.register(HostBuffer::new(n)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
            src.as_mut_slice().copy_from_slice(&pattern);
            a.write(Local::owned(src), target).await?;
            let mut seen = vec![0u8; n];
            prov.copy_out(base + offset, &mut seen)?;
            (write_wrong, write_first_wrong) = diff(&seen, &pattern);
            // READ through the MR bytes the CPU put there
            prov.copy_in(base + offset, &pattern)?;
            &pattern
        } else {
            &original
        };
        let dst = pd.register(HostBuffer::new(n)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
        let got = b.read(Local::owned(dst), target).await?;
        let (read_wrong, read_first_wrong) = diff(got.bytes().unwrap_or(&[]), expect);
        Ok::<_, Error>(CanaryReport {
            offset,
            len,
            path_mtu,
            write_checked: writable,
            write_wrong,
            write_first_wrong,
            read_wrong,
            read_first_wrong,
        })
    }
    .await;
    // restore whatever happened
    let restored = if writable {
        prov.copy_in(base + offset, &original)
    } else {
        Ok(())
    };
    let report = result?;
    restored?;
    Ok(report)
}

/// The full canary (a pattern written, then read at an offset inside a page) on a scratch host
/// buffer registered with `mode`: what a read-only region's own canary cannot check, since it
/// only reads bytes it cannot choose. `Ok(None)`: the strategy moves bytes right; `Ok(Some)`:
/// the report of what went wrong. Strategies without a CPU mapping (dma-buf) have no host
/// equivalent: `Ok(None)`.
async fn scratch_canary(
    pd: &ProtectionDomain,
    mode: RegMode,
    at: CanaryAt,
    max_mtu: Option<u32>,
) -> Result<Option<CanaryReport>, Error> {
    if !matches!(mode, RegMode::Pinned | RegMode::OnDemand) {
        return Ok(None);
    }
    let mem: Arc<dyn Provider> = Arc::new(crate::HostMemory::anonymous(64 << 10, false)?);
    let len = mem.len();
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let reg = register_mode(pd, &mem, 0..len, access, mode).map_err(|r| match r {
        Refusal::Failed(e) => Error::from(e),
        Refusal::NotApplicable(m) => Error::from(verbs::Error::InvalidArgument(m)),
    })?;
    let report = run_canary_at(pd, &reg, at, max_mtu).await?;
    Ok((!report.ok()).then_some(report))
}

/// Try `modes` in order on `range` of `provider`; each registration is proved by a canary
/// before it is trusted. The first strategy that works ends the search; its MR (registered with
/// the canary's access) is returned with every attempt.
pub async fn register_with_canary(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    range: Range<u64>,
    modes: &[RegMode],
) -> Registration {
    register_with_canary_at(pd, provider, range, modes, CanaryAt::MidPage, None).await
}

/// [`register_with_canary`] with the canary's scratch range where `at` says, on QPs at path
/// MTU `max_mtu` at most: what the MR is then proved for.
pub async fn register_with_canary_at(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    range: Range<u64>,
    modes: &[RegMode],
    at: CanaryAt,
    max_mtu: Option<u32>,
) -> Registration {
    let mut attempts = Vec::new();
    let mut chosen = None;
    // the canary writes through the MR: register with local and remote write when allowed
    // (never for memory that holds data: the canary does not write it, nor do remote peers)
    let access = if provider.writable() && !provider.holds_data() {
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
    } else {
        Access::REMOTE_READ
    };
    for &mode in modes {
        let reg = match register_mode(pd, provider, range.clone(), access, mode) {
            Ok(r) => r,
            Err(Refusal::NotApplicable(message)) => {
                attempts.push(Attempt {
                    mode,
                    outcome: AttemptOutcome::NotApplicable { message },
                });
                continue;
            }
            Err(Refusal::Failed(e)) => {
                attempts.push(Attempt {
                    mode,
                    outcome: AttemptOutcome::RegistrationFailed {
                        errno: e.raw_os_error(),
                        message: e.to_string(),
                    },
                });
                continue;
            }
        };
        let outcome = match run_canary_at(pd, &reg, at, max_mtu).await {
            // the canary could only read bytes it did not choose
            Ok(c) if c.ok() && !c.write_checked => {
                match scratch_canary(pd, mode, at, max_mtu).await {
                    Ok(None) => AttemptOutcome::Works { canary: c },
                    Ok(Some(bad)) => AttemptOutcome::CanaryError {
                        message: format!(
                            "the READ of this read-only memory matched what the CPU sees, but \
                             bytes that cannot be written need not reveal a misplaced read (a \
                             run of zeros reads the same from anywhere); the {mode} strategy on \
                             a scratch host buffer with a pattern: {bad}"
                        ),
                    },
                    Err(e) => AttemptOutcome::CanaryError {
                        message: format!(
                            "the {mode} strategy on a scratch host buffer (to check what \
                             read-only memory cannot show): {e}"
                        ),
                    },
                }
            }
            Ok(c) if c.ok() => AttemptOutcome::Works { canary: c },
            Ok(c) => AttemptOutcome::CanaryFailed { canary: c },
            Err(e) => AttemptOutcome::CanaryError {
                message: e.to_string(),
            },
        };
        tracing::info!(%mode, ?outcome, "registration attempt");
        let works = matches!(outcome, AttemptOutcome::Works { .. });
        attempts.push(Attempt { mode, outcome });
        if works {
            chosen = Some(reg);
            break;
        }
    }
    Registration {
        attempts,
        region: chosen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_spans_more_than_one_mtu_and_starts_mid_page() {
        for mtu in [256u32, 1024, 4096] {
            let (o, l) = scratch_range(1 << 20, mtu);
            assert!(o % 4096 != 0, "starts partway into a page");
            assert!(l > u64::from(mtu), "more than one path MTU");
            assert!(o + l <= 1 << 20);
        }
        let (o, l) = scratch_range(1000, 1024);
        assert!(o + l == 1000 && l > 0);
    }

    #[test]
    fn a_page_start_canary_starts_on_a_page_and_spans_pages_and_mtus() {
        for mtu in [256u32, 1024, 4096] {
            let (o, l) = page_start_range(1 << 20, mtu);
            assert_eq!(o, 0);
            assert!(
                l > u64::from(mtu) && l > 4096,
                "more than one MTU and one page"
            );
        }
        // a smaller memory: all of it
        assert_eq!(page_start_range(5000, 4096), (0, 5000));
    }

    #[test]
    fn diff_counts_wrong_bytes() {
        assert_eq!(diff(b"abcd", b"abcd"), (0, None));
        assert_eq!(diff(b"abcd", b"xbcy"), (2, Some(0)));
    }

    #[test]
    fn report_text_says_how_many_bytes_were_wrong() {
        let r = CanaryReport {
            offset: 2148,
            len: 6267,
            path_mtu: 1024,
            write_checked: true,
            write_wrong: 3000,
            write_first_wrong: Some(1948),
            read_wrong: 0,
            read_first_wrong: None,
        };
        assert!(!r.ok());
        let s = r.to_string();
        assert!(
            s.contains("WRITE got 3000 wrong") && s.contains("path MTU 1024"),
            "{s}"
        );
    }
}
