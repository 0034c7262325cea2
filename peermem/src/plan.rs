//! The path decision for one region: the user's policy applied to the registration attempts.
//!
//! A plan is a prediction; the attempt decides: every strategy that registers is proved by a
//! canary ([`crate::canary`]) before the region is declared direct. When none works the region
//! goes through the bounce path (its provider's copy engine and host staging buffers), unless
//! the policy says `required`, in which case it is refused with every attempt's reason.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use verbs::{ProtectionDomain, RegMode};

use crate::canary::{register_with_canary, Attempt, AttemptOutcome, DeviceMr};
use crate::provider::Provider;

/// What the user allows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum P2pPolicy {
    /// Direct or nothing: a region that cannot go direct is refused, with the reasons.
    Required,
    /// Direct when a strategy works, bounce otherwise (the default).
    #[default]
    Preferred,
    /// Always bounce (no registration of the region's memory at all).
    Disabled,
}

impl FromStr for P2pPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "required" => Ok(P2pPolicy::Required),
            "preferred" => Ok(P2pPolicy::Preferred),
            "disabled" => Ok(P2pPolicy::Disabled),
            o => Err(format!(
                "unknown P2P policy '{o}': required, preferred or disabled"
            )),
        }
    }
}

impl fmt::Display for P2pPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            P2pPolicy::Required => "required",
            P2pPolicy::Preferred => "preferred",
            P2pPolicy::Disabled => "disabled",
        })
    }
}

/// Which registration strategies to try.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RegChoice {
    /// dma-buf, then pinned, then ODP.
    #[default]
    Auto,
    /// Only this one (diagnosis); the canary still runs.
    Only(RegMode),
}

impl RegChoice {
    /// The strategies in order of preference (for `Auto`, the general order; a provider may
    /// prefer another, see [`RegChoice::modes_for`]).
    pub fn modes(self) -> Vec<RegMode> {
        match self {
            RegChoice::Auto => vec![RegMode::DmaBuf, RegMode::Pinned, RegMode::OnDemand],
            RegChoice::Only(m) => vec![m],
        }
    }

    /// The strategies to attempt for `provider`: its own order for `Auto`.
    pub fn modes_for(self, provider: &dyn Provider) -> Vec<RegMode> {
        match self {
            RegChoice::Auto => provider.registration_order(),
            RegChoice::Only(m) => vec![m],
        }
    }
}

impl FromStr for RegChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(RegChoice::Auto),
            "pinned" => Ok(RegChoice::Only(RegMode::Pinned)),
            "odp" => Ok(RegChoice::Only(RegMode::OnDemand)),
            "dmabuf" => Ok(RegChoice::Only(RegMode::DmaBuf)),
            o => Err(format!(
                "unknown registration strategy '{o}': auto, pinned, odp or dmabuf"
            )),
        }
    }
}

/// The path a region's bytes take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PathKind {
    /// One-sided RDMA on an MR of the memory.
    Direct,
    /// The provider's copy engine and host staging buffers.
    Bounce,
}

/// What was decided for a region, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// The path.
    pub path: PathKind,
    /// The strategy, when direct.
    pub mode: Option<RegMode>,
    /// One line: why this path.
    pub reason: String,
    /// Every registration attempt, in order.
    pub attempts: Vec<Attempt>,
    /// The policy applied.
    pub policy: P2pPolicy,
}

/// A decision together with the proved MR (when direct; registered on the PD given).
#[derive(Debug)]
pub struct Planned {
    /// The decision.
    pub decision: Decision,
    /// The MR the canary proved, when direct.
    pub mr: Option<DeviceMr>,
}

/// `--p2p required` and no strategy works.
#[derive(Debug, Clone, thiserror::Error)]
#[error("--p2p required, but {what} cannot go direct: {reasons}")]
pub struct Refused {
    /// The memory.
    pub what: String,
    /// Every attempt's outcome, joined.
    pub reasons: String,
    /// The attempts.
    pub attempts: Vec<Attempt>,
}

/// Every attempt's outcome in one line.
pub fn summary(attempts: &[Attempt]) -> String {
    if attempts.is_empty() {
        return "no strategy was tried".into();
    }
    attempts
        .iter()
        .map(|a| match &a.outcome {
            AttemptOutcome::NotApplicable { message } => {
                format!("{}: not applicable ({message})", a.mode)
            }
            AttemptOutcome::RegistrationFailed { errno, message } => match errno {
                Some(e) => format!("{}: registration failed, errno {e} ({message})", a.mode),
                None => format!("{}: registration failed ({message})", a.mode),
            },
            AttemptOutcome::CanaryFailed { canary } => format!(
                "{}: registered but the canary found {} wrong bytes on WRITE and {} on READ at path MTU {}",
                a.mode, canary.write_wrong, canary.read_wrong, canary.path_mtu
            ),
            AttemptOutcome::CanaryError { message } => {
                format!("{}: registered but the canary failed ({message})", a.mode)
            }
            AttemptOutcome::Works { .. } => format!("{}: works", a.mode),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Decide the path for `range` of `provider` on `pd`'s device.
pub async fn decide(
    pd: &ProtectionDomain,
    provider: &Arc<dyn Provider>,
    range: Range<u64>,
    choice: RegChoice,
    policy: P2pPolicy,
) -> Result<Planned, Refused> {
    if policy == P2pPolicy::Disabled {
        return Ok(Planned {
            decision: Decision {
                path: PathKind::Bounce,
                mode: None,
                reason: format!(
                    "bounce: --p2p disabled (copy engine: {})",
                    provider.copy_engine()
                ),
                attempts: Vec::new(),
                policy,
            },
            mr: None,
        });
    }
    let reg = register_with_canary(pd, provider, range, &choice.modes_for(provider.as_ref())).await;
    match reg.region {
        Some(mr) => {
            let mode = mr.mode();
            Ok(Planned {
                decision: Decision {
                    path: PathKind::Direct,
                    mode: Some(mode),
                    reason: format!(
                        "direct: {mode} registration, proved by a canary{}",
                        if reg.attempts.len() > 1 {
                            format!(
                                " (before it: {})",
                                summary(&reg.attempts[..reg.attempts.len() - 1])
                            )
                        } else {
                            String::new()
                        }
                    ),
                    attempts: reg.attempts,
                    policy,
                },
                mr: Some(mr),
            })
        }
        None if policy == P2pPolicy::Required => Err(Refused {
            what: provider.describe(),
            reasons: summary(&reg.attempts),
            attempts: reg.attempts,
        }),
        None => Ok(Planned {
            decision: Decision {
                path: PathKind::Bounce,
                mode: None,
                reason: format!(
                    "bounce (copy engine: {}): {}",
                    provider.copy_engine(),
                    summary(&reg.attempts)
                ),
                attempts: reg.attempts,
                policy,
            },
            mr: None,
        }),
    }
}

/// How a NIC may reach the window mappings of a device-private region.
#[derive(Debug, Clone, Serialize)]
pub struct WindowProof {
    /// The strategy a canary proved on a mapped unit (None: window units are copied by the
    /// CPU; a server then leaves the window alone, see
    /// [`crate::hmm::DevicePrivate::set_copies_map_window`]).
    pub mode: Option<RegMode>,
    /// One line: why.
    pub reason: String,
    /// Every registration attempt on the mapped unit.
    pub attempts: Vec<Attempt>,
}

/// Prove how window mappings of `dp` may be registered: attempts (by `choice`) and a canary on
/// the mapping of one unit. `--p2p disabled` tries nothing.
pub async fn prove_window(
    pd: &ProtectionDomain,
    dp: &crate::hmm::DevicePrivate,
    choice: RegChoice,
    policy: P2pPolicy,
) -> WindowProof {
    let copied = |why: String| WindowProof {
        mode: None,
        reason: why,
        attempts: Vec::new(),
    };
    if policy == P2pPolicy::Disabled {
        return copied("copied by the CPU (--p2p disabled)".into());
    }
    let sample: Arc<dyn Provider> = match dp.window_sample() {
        Ok(lease) => Arc::clone(&lease),
        Err(e) => {
            return copied(format!(
                "no window mapping could be made ({e}); units go through the copy engine"
            ))
        }
    };
    let len = sample.len();
    match decide(pd, &sample, 0..len, choice, P2pPolicy::Preferred).await {
        Ok(p) => {
            let d = p.decision;
            let reason = match (d.path, d.mode) {
                (PathKind::Direct, Some(m)) => format!(
                    "the NIC moves them straight to and from the client (zero-copy, {m} MRs of the window mappings; {})",
                    d.reason
                ),
                _ => format!(
                    "copied by the CPU, since no MR of a window mapping works ({})",
                    d.reason
                ),
            };
            WindowProof {
                mode: d.mode.filter(|_| d.path == PathKind::Direct),
                reason,
                attempts: d.attempts,
            }
        }
        Err(r) => copied(format!("copied by the CPU ({r})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_and_choice_parse() {
        assert_eq!(
            "required".parse::<P2pPolicy>().unwrap(),
            P2pPolicy::Required
        );
        assert!("sometimes"
            .parse::<P2pPolicy>()
            .unwrap_err()
            .contains("required, preferred or disabled"));
        assert_eq!(
            "odp".parse::<RegChoice>().unwrap().modes(),
            vec![RegMode::OnDemand]
        );
        assert_eq!(RegChoice::Auto.modes()[0], RegMode::DmaBuf);
        assert!("fast".parse::<RegChoice>().is_err());
    }

    #[test]
    fn summary_names_errno_and_wrong_bytes() {
        let a = vec![
            Attempt {
                mode: RegMode::DmaBuf,
                outcome: AttemptOutcome::RegistrationFailed {
                    errno: Some(95),
                    message: "ibv_reg_dmabuf_mr failed".into(),
                },
            },
            Attempt {
                mode: RegMode::Pinned,
                outcome: AttemptOutcome::NotApplicable {
                    message: "dmabuf memory has no CPU mapping".into(),
                },
            },
        ];
        let s = summary(&a);
        assert!(
            s.contains("errno 95") && s.contains("not applicable"),
            "{s}"
        );
        assert_eq!(summary(&[]), "no strategy was tried");
    }
}
