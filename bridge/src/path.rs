//! The one way a region's path is decided, used by `serve`, `doctor` and `bench`: the region
//! spec's own options (`,reg=`, `,p2p=`, `,window=`) over the caller's defaults, then
//! [`peermem::plan::decide`] (registration attempts proved by canaries, policy applied).

use std::sync::Arc;

use peermem::plan::{decide, P2pPolicy, Planned, Refused, RegChoice};
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

#[cfg(test)]
mod tests {
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
