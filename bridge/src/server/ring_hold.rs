//! Ring slots a client holds too long go back to the ring.
//!
//! A chunk lent from a slot of a region's CMB ring is the client's until it releases the
//! slot (`Unstage`). A client reads a lent chunk as soon as the `Staged` reply comes and
//! releases it with its next message, so a slot is lent for a round trip and a READ. A client
//! that stops reading (a stalled process, a sink that blocks, or one that holds slots on
//! purpose) would keep them until its connection ends: the other connections' chunks wait
//! for the ring only until it stops moving (`ring_wait`), and then cross host memory.
//!
//! So a slot held past the server's `ring_hold` limit (30 s by default) while the ring is
//! wanted (a connection found no free slot, or others in line before it, in the last few
//! seconds: another connection as a rule, since a client holds no more chunks than the ring
//! has slots) is taken back: the chunk's window is revoked, and the slot goes
//! to the next in line. Nothing the client may still rely on is lost: a READ that already
//! completed has the bytes, and one that comes later fails with a remote access error (the
//! client says why it may have). The slot stays the client's in the session's books until it
//! releases it, so the connection's protocol state does not change. A slot nobody else wants
//! stays lent: a slow client alone on a ring keeps what it holds.

use std::time::Duration;

use tokio::time::Instant;

use super::driver::ConnState;
use super::Shared;

/// How often a chunk held past the limit looks again whether anyone wants its ring.
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// When a connection wanted the ring counts as "now": recently enough that it still waits in
/// line, or copies through host memory because the ring stalled.
const WANTED_WITHIN: Duration = Duration::from_secs(3);

/// Since when a lent chunk holds its ring slot, and when to look at it next.
#[derive(Debug, Clone, Copy)]
pub(super) struct Held {
    since: Instant,
    look_at: Instant,
}

impl Held {
    /// A slot lent now, which may be held for `limit` before anyone asks it back.
    pub(super) fn new(limit: Duration) -> Held {
        let since = Instant::now();
        Held {
            since,
            look_at: since + limit,
        }
    }

    /// Whether a slot held since `self.since` should go back at `now`: it is due, and
    /// `wanted_since` says a connection wanted the ring since the slot was lent and lately.
    /// When not, the next look is [`LOOK_AGAIN`] later.
    fn take_back(&mut self, now: Instant, wanted_since: impl Fn(Instant) -> bool) -> bool {
        if now < self.look_at {
            return false;
        }
        let lately = now.checked_sub(WANTED_WITHIN).unwrap_or(self.since);
        if wanted_since(self.since.max(lately)) {
            return true;
        }
        self.look_at = now + LOOK_AGAIN;
        false
    }
}

impl ConnState {
    /// When the first of this connection's lent ring slots is due a look (None: it holds none).
    pub(super) fn next_hold_look(&self) -> Option<Instant> {
        self.lent
            .values()
            .filter_map(|c| c.held.map(|h| h.look_at))
            .min()
    }

    /// Until [`ConnState::next_hold_look`]; pending forever when no slot is held.
    pub(super) async fn hold_look(at: Option<Instant>) {
        match at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Take back the ring slots this connection's client held past the limit while other
    /// connections want its ring: their windows are revoked and the slots go to the ring.
    pub(super) fn take_back_held(&mut self, shared: &Shared) {
        let now = Instant::now();
        let mut taken = Vec::new();
        for (&slot, c) in self.lent.iter_mut() {
            let Some(held) = c.held.as_mut() else {
                continue;
            };
            let q = &shared.regions.get(c.region).ring_queue;
            if held.take_back(now, |t| q.wanted_since(t)) {
                taken.push((slot, c.region, now - held.since));
            }
        }
        for (slot, region, held) in taken {
            let name = &shared.regions.get(region).info.name;
            tracing::warn!(
                client = %self.client,
                region = %name,
                slot,
                held_s = held.as_secs_f64(),
                limit_s = shared.cfg.ring_hold.as_secs_f64(),
                "took back a CMB ring slot the client held past the limit while others wanted the ring"
            );
            shared.metrics().ring_taken_back(name);
            // (the window is revoked before the slot goes back: `LentChunk`'s drop order)
            self.lent.remove(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_slot_goes_back_only_past_the_limit_and_while_others_want_the_ring() {
        let limit = Duration::from_secs(30);
        let mut h = Held::new(limit);
        let lent = h.since;
        // wanted all along, but not due yet
        assert!(!h.take_back(lent + Duration::from_secs(29), |_| true));
        // due, and nobody wanted the ring since: it stays, and looks again a second later
        let due = lent + limit;
        assert!(!h.take_back(due, |_| false));
        assert_eq!(h.look_at, due + LOOK_AGAIN);
        assert!(!h.take_back(due + Duration::from_millis(500), |_| true));
        // due and wanted lately: back
        assert!(h.take_back(due + LOOK_AGAIN, |_| true));
    }

    #[tokio::test(start_paused = true)]
    async fn a_want_counts_only_when_recent_and_after_the_slot_was_lent() {
        let limit = Duration::from_secs(30);
        let mut h = Held::new(limit);
        let lent = h.since;
        let now = lent + Duration::from_secs(40);
        // the ring is asked whether it was wanted since WANTED_WITHIN ago
        let asked = std::cell::Cell::new(None);
        assert!(!h.take_back(now, |t| {
            asked.set(Some(t));
            false
        }));
        assert_eq!(asked.get(), Some(now - WANTED_WITHIN));
        // a want before the slot was lent is not one for it
        let mut young = Held::new(Duration::ZERO);
        let at = young.since;
        assert!(!young.take_back(at, |t| t <= at - Duration::from_secs(1)));
        assert!(young.take_back(at + LOOK_AGAIN, |t| t <= at + LOOK_AGAIN));
    }
}
