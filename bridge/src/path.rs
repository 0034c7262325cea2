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

/// Whether a decision went to bounce because a registration was refused with ENOMEM: the
/// driver may cap one MR's size (rxe on Linux 7.x keeps an MR's page list in one kmalloc of
/// 16 bytes per 4 KiB page, at most 4 MiB: 1 GiB per MR, huge pages or not).
fn refused_for_size(p: &Planned) -> Option<String> {
    if p.decision.path != PathKind::Bounce {
        return None;
    }
    p.decision.attempts.iter().find_map(|a| match &a.outcome {
        AttemptOutcome::RegistrationFailed {
            errno: Some(libc::ENOMEM),
            ..
        } => Some(format!("{} registration", a.mode)),
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

/// Like [`decide_path`], but when every strategy failed because a registration of the whole
/// window was refused with ENOMEM, retry with shorter prefixes (powers of two, down to 64 MiB):
/// the largest that registers goes direct and the rest through bounce buffers, and the reason
/// says so. Returns the plan and the direct prefix it covers.
pub async fn decide_prefix(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    choice: PathChoice,
) -> Result<(Planned, u64), Refused> {
    let whole = decide_path(pd, provider, choice).await?;
    let Some(what) = refused_for_size(&whole) else {
        return Ok((whole, choice.window));
    };
    let mut window = pow2_below(choice.window);
    while window >= MIN_PREFIX {
        let mut p = decide(pd, provider, 0..window, choice.reg, choice.p2p).await?;
        if p.decision.path == PathKind::Direct {
            p.decision.reason.push_str(&format!(
                "; the {what} of all {} bytes was refused with ENOMEM (the driver caps one MR's \
                 size: rxe keeps its page list in one kmalloc, 1 GiB of 4 KiB pages), so the \
                 first {window} bytes, the largest prefix that registers, go direct",
                choice.window
            ));
            return Ok((p, window));
        }
        window /= 2;
    }
    Ok((whole, choice.window))
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
