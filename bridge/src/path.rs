//! The one way a region's path is decided, used by `serve`, `doctor` and `bench`: the region
//! spec's own options (`,reg=`, `,p2p=`, `,window=`) over the caller's defaults, then
//! [`peermem::plan::decide`] (registration attempts proved by canaries, policy applied).

use std::sync::Arc;

use peermem::canary::AttemptOutcome;
use peermem::plan::{decide, P2pPolicy, PathKind, Planned, Refused, RegChoice};
use peermem::Provider;
use verbs::ProtectionDomain;

use crate::spec::RegionOptions;

/// What a region's path is decided with, once its options met the defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathChoice {
    /// Registration strategies to attempt.
    pub reg: RegChoice,
    /// P2P policy.
    pub p2p: P2pPolicy,
    /// The bytes from the start that may go direct (the rest goes through bounce buffers).
    pub window: u64,
}

impl RegionOptions {
    /// The spec's options over `reg` and `p2p` (the command's or the configuration's), for a
    /// region of `len` bytes.
    pub fn choice(&self, len: u64, reg: RegChoice, p2p: P2pPolicy) -> PathChoice {
        PathChoice {
            reg: self.reg.unwrap_or(reg),
            p2p: self.p2p.unwrap_or(p2p),
            window: self.window.map_or(len, |w| w.min(len)),
        }
    }
}

/// Decide the path of `provider`'s first `choice.window` bytes.
pub async fn decide_path(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    choice: PathChoice,
) -> Result<Planned, Refused> {
    decide(pd, provider, 0..choice.window, choice.reg, choice.p2p).await
}

/// The shortest direct prefix worth retrying with when a registration is refused for its size.
const MIN_PREFIX: u64 = 64 << 20;

/// The strategy whose registration of the whole range was refused with ENOMEM, if one was: the
/// driver may cap one MR's size (rxe on Linux 7.x keeps an MR's page list in one kmalloc of 16
/// bytes per 4 KiB page, at most 4 MiB: 1 GiB per MR, huge pages or not). It came before the
/// strategy chosen, if any (the search stops at the first that works).
fn refused_for_size(p: &Planned) -> Option<verbs::RegMode> {
    p.decision.attempts.iter().find_map(|a| match &a.outcome {
        AttemptOutcome::RegistrationFailed {
            errno: Some(libc::ENOMEM),
            ..
        } => Some(a.mode),
        _ => None,
    })
}

/// The largest power of two below `n`.
fn pow2_below(n: u64) -> u64 {
    if n <= 1 {
        0
    } else {
        1 << (63 - (n - 1).leading_zeros())
    }
}

/// The direct part of a region as the driver can register it: `segment`-byte MRs one after
/// the other (the last one shorter), one MR when the driver takes the whole part at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segments {
    /// Bytes from the start that go direct.
    pub direct_len: u64,
    /// Bytes of one MR (at least `direct_len` when one MR covers it all).
    pub segment: u64,
}

impl Segments {
    /// One MR over `direct_len` bytes.
    pub fn whole(direct_len: u64) -> Segments {
        Segments {
            direct_len,
            segment: direct_len,
        }
    }

    /// The byte ranges of the MRs, in order.
    pub fn ranges(&self) -> Vec<std::ops::Range<u64>> {
        (0..self.count() as u64)
            .map(|k| k * self.segment..((k + 1) * self.segment).min(self.direct_len))
            .collect()
    }

    /// How many MRs.
    pub fn count(&self) -> usize {
        if self.segment == 0 {
            return 0;
        }
        self.direct_len.div_ceil(self.segment) as usize
    }
}

/// Like [`decide_path`], but when every strategy failed because a registration of the whole
/// window was refused with ENOMEM, retry with shorter ranges (powers of two, down to 64 MiB):
/// the largest that registers is proved by the canaries and becomes the size of one MR, and
/// the whole window goes direct as several MRs of that size ([`Segments`]); the reason says
/// so. Registering the other segments is the caller's, which may still fail for memory
/// ([`register_segments`]).
pub async fn decide_segments(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    choice: PathChoice,
) -> Result<(Planned, Segments), Refused> {
    let whole = decide_path(pd, provider, choice).await?;
    let Some(mode) = refused_for_size(&whole) else {
        return Ok((whole, Segments::whole(choice.window)));
    };
    // the preferred strategy was refused only for the size of one MR: it wins, in segments,
    // over a later strategy that took the whole range (an ODP MR faults pages in on the NIC's
    // first touch; a pinned one does not)
    let instead = match (whole.decision.path, whole.decision.mode) {
        (PathKind::Direct, Some(m)) => format!(", preferred over {m}, which took it in one MR"),
        _ => String::new(),
    };
    let mut segment = pow2_below(choice.window);
    while segment >= MIN_PREFIX {
        match decide(pd, provider, 0..segment, RegChoice::Only(mode), choice.p2p).await {
            Ok(mut p) if p.decision.path == PathKind::Direct => {
                let s = Segments {
                    direct_len: choice.window,
                    segment,
                };
                let mut attempts = whole.decision.attempts.clone();
                attempts.truncate(
                    attempts
                        .iter()
                        .position(|a| a.mode == mode)
                        .map_or(attempts.len(), |i| i + 1),
                );
                attempts.append(&mut p.decision.attempts);
                p.decision.attempts = attempts;
                p.decision.reason.push_str(&format!(
                    "; the {mode} registration of all {} bytes in one MR was refused with ENOMEM \
                     (the driver caps one MR's size: rxe keeps its page list in one kmalloc, \
                     1 GiB of 4 KiB pages), so the region is registered as {} {mode} MRs of at \
                     most {segment} bytes, the largest that registers{instead}",
                    choice.window,
                    s.count()
                ));
                return Ok((p, s));
            }
            // bounce, or refused (`--p2p required`) with this one strategy: try shorter, and in
            // the end keep the whole-range plan
            _ => segment /= 2,
        }
    }
    Ok((whole, Segments::whole(choice.window)))
}

/// Register each segment of `s` with `register` (in order, stopping at the first refusal).
/// Returns the MRs and, when one was refused, the segments that did register and why the
/// next one did not: the caller serves the registered prefix direct and the rest through
/// bounce buffers.
pub fn register_segments<M, E: std::fmt::Display>(
    s: Segments,
    mut register: impl FnMut(std::ops::Range<u64>) -> Result<M, E>,
) -> (Vec<M>, Option<(Segments, String)>) {
    let mut out = Vec::new();
    for r in s.ranges() {
        match register(r.clone()) {
            Ok(m) => out.push(m),
            Err(e) => {
                let kept = Segments {
                    direct_len: r.start,
                    segment: s.segment,
                };
                let why = format!(
                    "registering bytes {}..{} (MR {} of {}) failed: {e}",
                    r.start,
                    r.end,
                    out.len() + 1,
                    s.count()
                );
                return (out, Some((kept, why)));
            }
        }
    }
    (out, None)
}

/// For a report (`doctor`): register every segment of a direct plan with its strategy and
/// release them, so the direct length reported is one the driver really takes. A refused
/// segment shortens the direct part to the ones before it, and the reason says so. Runs on a
/// blocking thread (pinning takes long).
pub async fn prove_segments(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    planned: &mut Planned,
    segments: Segments,
) -> Segments {
    let Some(mode) = planned.decision.mode.filter(|_| segments.count() > 1) else {
        return segments;
    };
    // the canary's MR covers the first segment: release it before registering them all
    drop(planned.mr.take());
    let (pd2, p2) = (pd.clone(), Arc::clone(provider));
    let access = verbs::Access::LOCAL_WRITE | verbs::Access::REMOTE_READ;
    let res = tokio::task::spawn_blocking(move || {
        let (mrs, short) = register_segments(segments, |r| {
            peermem::canary::register_mode(&pd2, &p2, r, access, mode)
        });
        drop(mrs);
        short
    })
    .await;
    match res {
        Ok(None) => segments,
        Ok(Some((kept, why))) => {
            planned.decision.reason.push_str(&format!(
                "; {why}: the first {} bytes go direct",
                kept.direct_len
            ));
            kept
        }
        Err(e) => {
            planned
                .decision
                .reason
                .push_str(&format!("; the segments could not be checked: {e}"));
            segments
        }
    }
}

/// The NIC's access to an `nvme` region's CMB staging ring, proved: the server lends ring
/// slots to clients through memory windows over `mr` (fetches), and RDMA-READs puts straight
/// into ring slots through it.
#[derive(Debug, Clone)]
pub struct RingNic {
    /// The whole ring, registered with the strategy a canary proved, for memory windows and
    /// as the local end of READs (`LOCAL_WRITE | MW_BIND`), no remote access of its own.
    pub mr: Arc<peermem::canary::DeviceMr>,
    /// `Some(path MTU)`: the access was proved only from the start of a page (a canary
    /// starting partway into a page failed), at this path MTU: only chunks that start on a
    /// page may be read from or land in the ring, and only on a connection at this path MTU
    /// (at a smaller one, packets start partway into pages). None: proved at any offset.
    pub page_start: Option<u32>,
    /// Puts land in ring slots: a landing canary proved an RDMA READ into `mr`.
    pub puts: bool,
}

/// What the NIC can do with an `nvme` region's ring (the last leg of SSD → CMB → NIC, and the
/// first of NIC → CMB → SSD).
#[derive(Debug)]
pub struct RingLeg {
    /// One line for the legs' report: CMB → NIC (fetches).
    pub report: String,
    /// One line for the legs' report: NIC → CMB (puts).
    pub put_report: String,
    /// The registration to lend slots through (and land puts in, where proved), when the NIC
    /// was proved to reach the ring and the caller lends.
    pub nic: Option<RingNic>,
}

impl RingLeg {
    /// Record these legs on the region `b` (its legs' report) and give the ring back to the
    /// CMB where no chunk can go through it: the registration to lend through, None when the
    /// NIC was not proved to reach the ring or the ring was given back (its registration is
    /// dropped with it, so that the CMB has the memory again).
    pub fn record_on(self, b: &peermem::block::BlockStorage) -> Option<RingNic> {
        let nic = self.nic.as_ref().map_or((false, false), |n| (true, n.puts));
        let kept = b.set_nic_legs((self.report, self.put_report), nic);
        self.nic.filter(|_| kept)
    }
}

/// Whether the NIC can reach an `nvme` region's CMB staging ring: the same registration
/// attempts and canaries as a region's. Ring slots are only ever read from the start of the
/// chunk staged in them, and a chunk that starts on a block starts on a page of its slot, so
/// when the canary partway into a page fails, the strategies it failed get a second canary
/// from the start of a page: rxe's ODP READs copy each packet from the start of its page
/// (LAB.md), so at path MTU 4096 they move page-aligned chunks right and others wrong. That
/// canary runs at the caller's path MTU (`max_mtu`, its `--mtu`; None: the port's), since a
/// proof from page starts holds at one path MTU only.
///
/// `lend`: the caller isolates clients with memory windows (one protection domain, `pd`) and
/// will lend slots to fetches (else the report says why the CPU copies fetches and puts alike).
/// `puts`: whether the region would take puts
/// through the ring (writable, its CMB → device leg proved), else why not; then a landing
/// canary proves that an RDMA READ lands in the ring (the NIC writing into the CMB), at the
/// same offsets and path MTU as the rest.
pub async fn ring_nic_leg(
    pd: &ProtectionDomain,
    ring: &Arc<dyn Provider>,
    reg: RegChoice,
    lend: bool,
    puts: std::result::Result<(), String>,
    max_mtu: Option<u32>,
) -> RingLeg {
    use peermem::canary::{register_mode, run_landing_canary, CanaryAt};
    let copies = peermem::block::FETCH_STAGED;
    let put_copies = peermem::block::PUT_STAGED;
    // (`put_why`: why a put the region would take through the ring does not land there)
    let refused = |report: String, put_why: &str| RingLeg {
        put_report: match &puts {
            Err(why) => format!("not tried: {why}"),
            Ok(()) => format!("{put_why}: {put_copies}"),
        },
        report,
        nic: None,
    };
    let (mode, page_start, how) = match prove_ring_access(pd, ring, reg, max_mtu).await {
        Ok(p) => p,
        Err(why) => {
            return refused(
                format!("the NIC cannot reach the ring ({why}): {copies}"),
                "the NIC cannot reach the ring (see CMB → NIC)",
            )
        }
    };
    if !lend {
        // without memory windows each connection has a protection domain of its own, where
        // the ring's registration (in `pd`) is no use to its QP
        return RingLeg {
            report: format!(
                "the NIC reaches the ring ({how}), but this server does not isolate clients \
                 with memory windows (serve --sharing per-connection), and a slot is lent only \
                 through one: {copies}"
            ),
            put_report: format!(
                "not tried: each connection of this server has a protection domain of its own \
                 (serve --sharing per-connection), where the ring's registration cannot be the \
                 local end of a READ: {put_copies}"
            ),
            nic: None,
        };
    }
    let access = verbs::Access::LOCAL_WRITE | verbs::Access::MW_BIND;
    let mr = match register_mode(pd, ring, 0..ring.len(), access, mode) {
        Ok(mr) => Arc::new(mr),
        Err(e) => {
            return refused(
                format!(
                    "the NIC reaches the ring ({how}), but registering it for memory windows \
                     failed ({e}): {copies}"
                ),
                &format!(
                    "the NIC reaches the ring ({how}), but registering it as the local end of \
                     a READ failed ({e})"
                ),
            )
        }
    };
    let at = if page_start.is_some() {
        CanaryAt::PageStart
    } else {
        CanaryAt::MidPage
    };
    let (lands, put_report) = match puts {
        Err(why) => (false, format!("not tried: {why}")),
        Ok(()) => match run_landing_canary(pd, &mr, at, max_mtu).await {
            Ok(r) if r.ok() => {
                // what a NIC proved from page starts only adds to the chunks that are copied
                let (starts, mtu) = if page_start.is_some() {
                    (
                        "starts partway into a block, ",
                        " or comes on a connection at another path MTU",
                    )
                } else {
                    ("", "")
                };
                (
                    true,
                    format!(
                        "the NIC writes each put's chunk into a ring slot, and the device takes \
                         it from there ({mode}: {r}; a block the chunk covers only partly is \
                         completed in the slot from the device first); a chunk whose blocks are \
                         longer than a slot, {starts}that waits for its turn at a slot in \
                         vain{mtu} goes through host staging"
                    ),
                )
            }
            Ok(r) => (false, format!("{mode}: {r}: {put_copies}")),
            Err(e) => (
                false,
                format!("{mode}: the landing canary could not run ({e}): {put_copies}"),
            ),
        },
    };
    let report = format!(
        "the NIC reads each chunk from its ring slot through a read-only memory window ({how}); \
         a chunk the ring cannot lend (longer than a slot, no slot free{}) goes from the device \
         to host staging by direct I/O",
        if page_start.is_some() {
            ", starting partway into a page, or asked on a connection at another path MTU"
        } else {
            ""
        }
    );
    RingLeg {
        report,
        put_report,
        nic: Some(RingNic {
            mr,
            page_start,
            puts: lands,
        }),
    }
}

/// The registration strategy that reaches the ring, proved by canaries: at any offset (None),
/// or else from the start of a page at a path MTU (`Some`), and how it was proved; or why no
/// strategy does.
async fn prove_ring_access(
    pd: &ProtectionDomain,
    ring: &Arc<dyn Provider>,
    reg: RegChoice,
    max_mtu: Option<u32>,
) -> std::result::Result<(verbs::RegMode, Option<u32>, String), String> {
    let choice =
        crate::spec::RegionOptions::default().choice(ring.len(), reg, P2pPolicy::Preferred);
    let planned = decide_path(pd, ring, choice)
        .await
        .map_err(|r| r.to_string())?;
    if let Some(mode) = planned.decision.mode {
        if planned.decision.path == peermem::plan::PathKind::Direct {
            return Ok((mode, None, format!("{mode}, proved by a canary")));
        }
    }
    let (mode, mtu, how) = prove_from_page_starts(pd, ring, &planned.decision, max_mtu).await?;
    Ok((
        mode,
        Some(mtu),
        format!(
            "{how}, so only chunks that start on a page move through the ring, on connections \
             at path MTU {mtu}, and clients end a transfer's first piece at the next block so \
             that the rest do"
        ),
    ))
}

/// Where `decision` sent `mem` through bounce buffers because canaries partway into a page
/// failed: the strategies that failed so, tried again with a canary from the start of a page
/// (at `max_mtu`, see [`ring_nic_leg`]). The strategy that passed, the path MTU it passed at
/// and how it was proved; or why none did.
async fn prove_from_page_starts(
    pd: &ProtectionDomain,
    mem: &Arc<dyn Provider>,
    decision: &peermem::plan::Decision,
    max_mtu: Option<u32>,
) -> std::result::Result<(verbs::RegMode, u32, String), String> {
    use peermem::canary::{register_with_canary_at, CanaryAt};
    let failed: Vec<verbs::RegMode> = decision
        .attempts
        .iter()
        .filter(|a| matches!(a.outcome, AttemptOutcome::CanaryFailed { .. }))
        .map(|a| a.mode)
        .collect();
    let at_page = if failed.is_empty() {
        None
    } else {
        Some(
            register_with_canary_at(pd, mem, 0..mem.len(), &failed, CanaryAt::PageStart, max_mtu)
                .await,
        )
    };
    // the registration that passed, with the path MTU its canary passed at
    let passed = at_page.as_ref().and_then(|r| {
        let mr = r.region.as_ref()?;
        let mtu = r.attempts.iter().find_map(|a| match &a.outcome {
            AttemptOutcome::Works { canary } if a.mode == mr.mode() => Some(canary.path_mtu),
            _ => None,
        })?;
        Some((mr.mode(), mtu))
    });
    let Some((mode, mtu)) = passed else {
        let also = at_page
            .map(|r| {
                format!(
                    "; from the start of a page: {}",
                    peermem::plan::summary(&r.attempts)
                )
            })
            .unwrap_or_default();
        return Err(format!("{}{also}", decision.reason));
    };
    let mid_page: Vec<_> = decision
        .attempts
        .iter()
        .filter(|a| a.mode == mode)
        .cloned()
        .collect();
    Ok((
        mode,
        mtu,
        format!(
            "{mode}: a canary from the start of a page passed at path MTU {mtu}, one partway \
             into a page did not ({})",
            peermem::plan::summary(&mid_page)
        ),
    ))
}

/// Whether the NIC reads a region that `decision` sent through bounce buffers straight from
/// its own memory, from page starts: where canaries partway into a page failed and one from
/// the start of a page passes (rxe's ODP on a CMB, LAB.md), a staged fetch's chunk that
/// starts on a page is lent to the client through a read-only memory window over the
/// region's own bytes instead of being copied, on connections at the proof's path MTU.
/// `puts` (the region takes puts): a landing canary from a page start then proves that an
/// RDMA READ lands in the region at that path MTU, and a put's chunk that starts on a page
/// is read from the client straight into the region (NIC → memory) instead of through host
/// staging. The registration (`LOCAL_WRITE | MW_BIND`, no remote access of its own, None
/// where no canary passes or the registration fails) and one line for the region's reason
/// that says which. None at all for memory this does not apply to: block storage (its ring
/// lends instead), device-private memory, memory whose decision failed no canary, and memory
/// that holds data (the canaries write).
pub async fn page_start_lending(
    pd: &ProtectionDomain,
    mem: &Arc<dyn Provider>,
    decision: &peermem::plan::Decision,
    max_mtu: Option<u32>,
    puts: bool,
) -> Option<(Option<RingNic>, String)> {
    use peermem::canary::register_mode;
    let canary_failed = decision
        .attempts
        .iter()
        .any(|a| matches!(a.outcome, AttemptOutcome::CanaryFailed { .. }));
    let block = (**mem)
        .as_any()
        .downcast_ref::<peermem::block::BlockStorage>()
        .is_some();
    let devpriv = peermem::hmm::DevicePrivate::of(&**mem).is_some();
    if !canary_failed || block || devpriv || mem.holds_data() {
        return None;
    }
    let (mode, mtu, how) = match prove_from_page_starts(pd, mem, decision, max_mtu).await {
        Ok(p) => p,
        Err(why) => {
            return Some((
                None,
                format!("no chunk is lent from page starts either ({why})"),
            ))
        }
    };
    let access = verbs::Access::LOCAL_WRITE | verbs::Access::MW_BIND;
    Some(match register_mode(pd, mem, 0..mem.len(), access, mode) {
        Ok(mr) => {
            let mr = Arc::new(mr);
            let (lands, put_note) = if puts {
                landing_from_page_starts(pd, &mr, mtu, max_mtu).await
            } else {
                (false, String::new())
            };
            (
                Some(RingNic {
                    mr,
                    page_start: Some(mtu),
                    puts: lands,
                }),
                format!(
                    "the NIC reads the region's own bytes from the start of a page ({how}): \
                     a staged fetch's chunk that starts on a page is lent through a read-only \
                     memory window on connections at path MTU {mtu}, not copied, and clients \
                     end a transfer's first piece at the next page so that the rest do{put_note}"
                ),
            )
        }
        Err(e) => (
            None,
            format!(
                "the NIC reads the region from page starts ({how}), but registering it for \
                 memory windows failed ({e}): every chunk is copied"
            ),
        ),
    })
}

/// Whether an RDMA READ lands right in `mr` (a region's own memory, read from page starts at
/// path MTU `mtu`) from the start of a page at that path MTU: the landing canary
/// ([`peermem::canary::run_landing_canary`]), which restores the bytes it wrote. Whether puts
/// land, and the clause for the region's reason that says so or why not.
async fn landing_from_page_starts(
    pd: &ProtectionDomain,
    mr: &Arc<peermem::canary::DeviceMr>,
    mtu: u32,
    max_mtu: Option<u32>,
) -> (bool, String) {
    use peermem::canary::{run_landing_canary, CanaryAt};
    let copied = "every put is copied from host staging";
    match run_landing_canary(pd, mr, CanaryAt::PageStart, max_mtu).await {
        Ok(r) if r.ok() && r.path_mtu == mtu => (
            true,
            format!(
                "; a put's chunk that starts on a page is read from the client straight into \
                 the region by the NIC ({r}) on connections at path MTU {mtu}; other chunks \
                 are copied from host staging"
            ),
        ),
        Ok(r) if r.ok() => (
            false,
            format!(
                "; {copied}: the landing canary passed at path MTU {}, not at {mtu}, where \
                 fetches are lent",
                r.path_mtu
            ),
        ),
        Ok(r) => (false, format!("; {copied} ({r})")),
        Err(e) => (
            false,
            format!("; {copied}: the landing canary could not run ({e})"),
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefixes_are_the_powers_of_two_below() {
        use super::pow2_below;
        assert_eq!(pow2_below(1280 << 20), 1 << 30);
        assert_eq!(pow2_below(1 << 30), 512 << 20);
        assert_eq!(pow2_below(3), 2);
        assert_eq!(pow2_below(1), 0);
    }

    #[test]
    fn segments_cover_the_direct_part_in_order_and_a_refusal_keeps_the_prefix() {
        use super::{register_segments, Segments};
        let s = Segments {
            direct_len: 1280 << 20,
            segment: 1 << 30,
        };
        assert_eq!(s.ranges(), vec![0..1 << 30, 1 << 30..1280 << 20]);
        assert_eq!(Segments::whole(5).ranges(), vec![0..5]);
        assert!(Segments::whole(0).ranges().is_empty());
        let exact = Segments {
            direct_len: 4 << 20,
            segment: 2 << 20,
        };
        assert_eq!(exact.count(), 2);
        // every segment registers
        let (mrs, failed) = register_segments(s, Ok::<_, String>);
        assert_eq!((mrs.len(), failed), (2, None));
        // the second is refused: the first is kept, and the reason names the range
        let three = Segments {
            direct_len: 3 << 20,
            segment: 1 << 20,
        };
        let (mrs, failed) = register_segments(three, |r| {
            if r.start == 1 << 20 {
                Err("ENOMEM".to_string())
            } else {
                Ok(r)
            }
        });
        assert_eq!(mrs, vec![0..1 << 20]);
        let (kept, why) = failed.unwrap();
        assert_eq!(kept.direct_len, 1 << 20);
        assert!(why.contains("MR 2 of 3") && why.contains("ENOMEM"), "{why}");
    }

    use super::*;

    #[test]
    fn the_spec_overrides_the_defaults_and_the_window_is_clamped() {
        let none = RegionOptions::default();
        let c = none.choice(100, RegChoice::Auto, P2pPolicy::Preferred);
        assert_eq!(
            (c.reg, c.p2p, c.window),
            (RegChoice::Auto, P2pPolicy::Preferred, 100)
        );
        let spec = RegionOptions {
            p2p: Some(P2pPolicy::Disabled),
            reg: Some(RegChoice::Only(verbs::RegMode::Pinned)),
            window: Some(1000),
            ..RegionOptions::default()
        };
        let c = spec.choice(100, RegChoice::Auto, P2pPolicy::Required);
        assert_eq!(
            (c.reg, c.p2p, c.window),
            (
                RegChoice::Only(verbs::RegMode::Pinned),
                P2pPolicy::Disabled,
                100
            )
        );
    }
}
