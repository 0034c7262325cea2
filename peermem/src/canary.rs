//! Registration attempts proved by a canary.
//!
//! A registration that succeeds is not proof that transfers work (rxe 7.3 completes ODP READs
//! and WRITEs at path MTU 1024 with wrong bytes), so every strategy that registers is followed by
//! a canary: an RDMA WRITE and an RDMA READ through that very MR on a loopback QP pair, over a
//! scratch range that spans more than one path MTU and starts partway into a page; the bytes are
//! compared with the CPU's view and the range is restored afterwards.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use verbs::{
    Access, HostBuffer, Local, ProtectionDomain, QpOptions, QueuePair, RegMode, SharedMemory,
    SharedRegion,
};

/// What the canary saw.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CanaryReport {
    /// Scratch range start within the region.
    pub offset: u64,
    /// Scratch range length.
    pub len: u64,
    /// Path MTU of the loopback connection.
    pub path_mtu: u32,
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
                "canary passed: RDMA WRITE and READ of {} bytes at offset {} (path MTU {}) moved every byte right",
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
                self.write_first_wrong.map(|o| format!(" (first at +{o})")).unwrap_or_default(),
                self.read_wrong,
                self.read_first_wrong.map(|o| format!(" (first at +{o})")).unwrap_or_default(),
            )
        }
    }
}

/// How one strategy fared.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum AttemptOutcome {
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
    pub region: Option<SharedRegion>,
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

/// Run the canary through `region`'s MR. The memory is restored afterwards.
pub async fn run_canary(
    pd: &ProtectionDomain,
    region: &SharedRegion,
) -> Result<CanaryReport, verbs::Error> {
    let mem = region.memory();
    let a = QueuePair::new(pd, QpOptions::default())?;
    let b = QueuePair::new(pd, QpOptions::default())?;
    a.connect(&b.endpoint())?;
    b.connect(&a.endpoint())?;
    let path_mtu = verbs::negotiate_mtu(a.endpoint().mtu, b.endpoint().mtu);
    let region_len = region.mr().len() as u64;
    let (offset, len) = scratch_range(region_len, path_mtu);
    if len == 0 {
        return Err(verbs::Error::InvalidArgument(
            "the region is too small for a canary".into(),
        ));
    }
    // the MR may cover a window of the memory: translate offsets
    let base = region.window_offset();
    let n = len as usize;
    let mut original = vec![0u8; n];
    mem.read_at(base + offset, &mut original)?;
    let pattern: Vec<u8> = original
        .iter()
        .enumerate()
        .map(|(i, b)| !b ^ (i as u8 & 0x10))
        .collect();
    let mut src = pd.register(HostBuffer::new(n)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
    src.as_mut_slice().copy_from_slice(&pattern);
    let target = region.mr().remote(offset..offset + len)?;
    let result = async {
        // WRITE through the MR, check with the CPU
        a.write(Local::owned(src), target).await?;
        let mut seen = vec![0u8; n];
        mem.read_at(base + offset, &mut seen)?;
        let (write_wrong, write_first_wrong) = diff(&seen, &pattern);
        // READ through the MR of bytes the CPU put there
        mem.write_at(base + offset, &pattern)?;
        let dst = pd.register(HostBuffer::new(n)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
        let got = b.read(Local::owned(dst), target).await?;
        let (read_wrong, read_first_wrong) = diff(got.bytes(), &pattern);
        Ok::<_, verbs::Error>(CanaryReport {
            offset,
            len,
            path_mtu,
            write_wrong,
            write_first_wrong,
            read_wrong,
            read_first_wrong,
        })
    }
    .await;
    // restore whatever happened
    let restored = mem.write_at(base + offset, &original);
    let report = result?;
    restored?;
    Ok(report)
}

/// Try `modes` in order on `mem`; each registration is proved by a canary before it is used.
/// With `stop_at_first`, the first working strategy ends the search.
pub async fn register_with_canary(
    pd: &ProtectionDomain,
    mem: &Arc<SharedMemory>,
    access: Access,
    modes: &[RegMode],
) -> Registration {
    let mut attempts = Vec::new();
    let mut chosen = None;
    for &mode in modes {
        if mode == RegMode::DmaBuf {
            attempts.push(Attempt {
                mode,
                outcome: AttemptOutcome::RegistrationFailed {
                    errno: None,
                    message: format!("{} memory is not a dma-buf", mem.kind()),
                },
            });
            continue;
        }
        // the canary writes through the MR: register with local write for it
        let reg = match pd.register_shared(
            mem,
            access | Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            mode,
        ) {
            Ok(r) => r,
            Err(e) => {
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
        let outcome = match run_canary(pd, &reg).await {
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
