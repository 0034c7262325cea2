//! Staged fetches that wait for a slot of a region's CMB ring rather than cross host memory.
//!
//! A ring has a few slots (eight as a rule) and every client fetching from the region takes
//! them. A chunk the ring would lend but that finds every slot lent (to other connections, or
//! to this one's earlier chunks) waits: the connection parks its `Stage` and goes on reading
//! the client's messages, so that its own `Unstage`s still give slots back meanwhile (a
//! client releases a chunk once it has read it, with its next request or before it waits for
//! a reply). The connections that wait for one region's ring take turns in the order they
//! came ([`RingQueue`]): a slot given back goes to the first, and a connection that does not
//! wait takes no free slot while others do. A parked chunk waits at most [`WAIT_LIMIT`] in
//! line, then it is copied through host staging as before; and nothing waits for a ring that
//! did not move for [`STALL_AFTER`] (clients that hold its slots and read nothing keep no one
//! waiting for longer).
//!
//! A put's chunk that would land in the ring but finds no slot (and no landing of its own
//! connection in flight, whose slot would come back first) waits in the same line, in the
//! connection's task ([`wait_turn`]): it holds no slot meanwhile, so no one waits for it.
//!
//! Replies stay in request order: the `Stage`s behind a parked one park too, and any other
//! request first has the parked chunks staged without waiting (copied where no slot is free).
//! None of this waits for a client's message: a connection that parks holds no slot it is
//! not about to give back, so every wait ends when slots come back or at its limit.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::watch;

use super::driver::ConnState;
use super::Shared;
use crate::protocol::Msg;

/// How long a chunk waits for its turn at a ring slot before it is copied through host
/// memory. (Under the lab's emulation, four clients sharing four slots on a loaded host saw
/// waits over a second.)
pub(super) const WAIT_LIMIT: Duration = Duration::from_secs(5);

/// A ring in which no chunk was lent and no slot came back for this long is stalled: its
/// slots are held by clients that read nothing, and no chunk waits for them.
pub(super) const STALL_AFTER: Duration = Duration::from_secs(2);

/// A number for each connection, to hold its place in ring queues.
pub(super) fn next_conn_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The connections waiting for a slot of one region's ring, in the order they came, and a
/// signal that a slot came back (or the first in line changed).
#[derive(Debug)]
pub(super) struct RingQueue {
    waiters: Mutex<VecDeque<u64>>,
    changed: watch::Sender<u64>,
    /// When a chunk was last lent from a slot or a slot came back.
    moved: Mutex<Option<Instant>>,
    /// When a connection last wanted a slot and found none free (or others in line before it).
    wanted: Mutex<Option<Instant>>,
}

impl Default for RingQueue {
    fn default() -> Self {
        RingQueue {
            waiters: Mutex::default(),
            changed: watch::channel(0).0,
            moved: Mutex::default(),
            wanted: Mutex::default(),
        }
    }
}

impl RingQueue {
    fn waiters(&self) -> std::sync::MutexGuard<'_, VecDeque<u64>> {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether connection `conn` may take a free slot now: nobody waits, or it is first.
    pub(super) fn my_turn(&self, conn: u64) -> bool {
        self.waiters().front().is_none_or(|&w| w == conn)
    }

    /// Put `conn` in line (at the end, unless it is in line already).
    fn join(&self, conn: u64) {
        self.wanted();
        let mut w = self.waiters();
        if !w.contains(&conn) {
            w.push_back(conn);
        }
    }

    /// Take `conn` out of the line; the next one, if it became first, looks again.
    fn leave(&self, conn: u64) {
        let mut w = self.waiters();
        let was_first = w.front() == Some(&conn);
        w.retain(|&c| c != conn);
        drop(w);
        if was_first {
            self.signal();
        }
    }

    /// A connection wanted a slot now and found none free, or others in line before it.
    pub(super) fn wanted(&self) {
        *self.wanted.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// Whether a connection wanted a slot and found none at `since` or later.
    pub(super) fn wanted_since(&self, since: Instant) -> bool {
        let wanted = *self.wanted.lock().unwrap_or_else(|p| p.into_inner());
        wanted.is_some_and(|t| t >= since)
    }

    /// A chunk was lent from a slot.
    pub(super) fn lent(&self) {
        *self.moved.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// Whether no chunk was lent and no slot came back for [`STALL_AFTER`]: the slots are
    /// held by clients that read nothing (or by no fetch at all), and a chunk that waited
    /// would only wait its limit.
    pub(super) fn stalled(&self) -> bool {
        Instant::now() >= self.stall_at()
    }

    /// When the ring is stalled if nothing moves meanwhile (now or earlier: stalled).
    fn stall_at(&self) -> Instant {
        let moved = *self.moved.lock().unwrap_or_else(|p| p.into_inner());
        moved.map_or_else(Instant::now, |t| t + STALL_AFTER)
    }

    /// The first in line changed: it looks again.
    fn signal(&self) {
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// A slot came back: the first in line looks again.
    fn back(&self) {
        self.lent();
        self.signal();
    }
}

/// Signals its ring queue when dropped: held by a chunk lent from a ring slot, after the
/// lease (fields drop in order), so the waiters look once the slot is back.
#[derive(Debug)]
pub(super) struct SlotFreed(Arc<RingQueue>);

impl SlotFreed {
    /// For a chunk just lent from a slot of the ring `q` waits for.
    pub(super) fn new(q: &Arc<RingQueue>) -> SlotFreed {
        q.lent();
        SlotFreed(Arc::clone(q))
    }
}

impl Drop for SlotFreed {
    fn drop(&mut self) {
        self.0.back();
    }
}

/// A `Stage` the session accepted that waits for a ring slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parked {
    pub(super) region: usize,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) slot: u32,
    /// When the request arrived.
    pub(super) arrived: Instant,
}

/// A connection's parked `Stage`s, in request order, and the ring queue the first of them
/// waits in. Leaves that queue when dropped (the connection ended).
#[derive(Debug)]
pub(super) struct Parking {
    conn: u64,
    queue: VecDeque<Parked>,
    /// Since when the first parked request is first: it waits at most [`WAIT_LIMIT`] from
    /// then (the time it spent behind its own connection's requests is not the ring's).
    head_since: Instant,
    waiting: Option<(Arc<RingQueue>, watch::Receiver<u64>)>,
}

impl Parking {
    pub(super) fn new(conn: u64) -> Parking {
        Parking {
            conn,
            queue: VecDeque::new(),
            head_since: Instant::now(),
            waiting: None,
        }
    }

    /// Whether any `Stage` is parked.
    pub(super) fn any(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Park `p` behind the others.
    pub(super) fn push(&mut self, p: Parked) {
        if self.queue.is_empty() {
            self.head_since = Instant::now();
        }
        self.queue.push_back(p);
    }

    /// The first parked request.
    pub(super) fn first(&self) -> Option<Parked> {
        self.queue.front().copied()
    }

    /// Take the first parked request: the next one is first from now.
    pub(super) fn pop(&mut self) -> Option<Parked> {
        self.head_since = Instant::now();
        self.queue.pop_front()
    }

    /// Whether the first parked request waited its limit.
    pub(super) fn first_expired(&self) -> bool {
        self.head_since.elapsed() >= WAIT_LIMIT
    }

    /// Wait in line at `q` (from the first parked request's point of view). A new line is
    /// looked at once at once: a slot may have come back between the caller's look and now.
    pub(super) fn wait_on(&mut self, q: &Arc<RingQueue>) {
        if let Some((old, _)) = &self.waiting {
            if Arc::ptr_eq(old, q) {
                return;
            }
        }
        self.stop_waiting();
        q.join(self.conn);
        let mut rx = q.changed.subscribe();
        rx.mark_changed();
        self.waiting = Some((Arc::clone(q), rx));
    }

    /// Leave the line waited in, if any.
    pub(super) fn stop_waiting(&mut self) {
        if let Some((q, _)) = self.waiting.take() {
            q.leave(self.conn);
        }
    }

    /// Until the first parked request should look again: a slot came back to the ring it
    /// waits for, the ring stalled, or it waited its limit. Pending forever with nothing
    /// parked.
    pub(super) async fn wake(&mut self) {
        if self.queue.is_empty() {
            return std::future::pending().await;
        }
        let deadline = self.head_since + WAIT_LIMIT;
        match &mut self.waiting {
            Some((q, rx)) => {
                let deadline = deadline.min(q.stall_at());
                tokio::select! {
                    r = rx.changed() => {
                        if r.is_err() {
                            // (the region table holds every queue as long as the server runs)
                            tokio::time::sleep_until(deadline).await;
                        }
                    }
                    _ = tokio::time::sleep_until(deadline) => {}
                }
            }
            None => tokio::time::sleep_until(deadline).await,
        }
    }
}

impl Drop for Parking {
    fn drop(&mut self) {
        self.stop_waiting();
    }
}

/// A put's chunk in line for a slot of a ring (see [`wait_turn`]); leaves the line when
/// dropped.
#[derive(Debug)]
pub(super) struct InLine {
    q: Arc<RingQueue>,
    conn: u64,
    rx: watch::Receiver<u64>,
    /// It waits at most [`WAIT_LIMIT`] from then.
    since: Instant,
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.q.leave(self.conn);
    }
}

/// Wait in line at `q` for connection `conn` (a put's chunk, holding no slot of its own)
/// until it should look again: true when a slot came back or the first in line changed, false
/// once it waited its limit in line. The connection holds no slot meanwhile, so no one waits
/// for it.
pub(super) async fn wait_turn(line: &mut Option<InLine>, q: &Arc<RingQueue>, conn: u64) -> bool {
    let l = line.get_or_insert_with(|| {
        q.join(conn);
        let mut rx = q.changed.subscribe();
        // (a slot may have come back between the caller's look and now)
        rx.mark_changed();
        InLine {
            q: Arc::clone(q),
            conn,
            rx,
            since: Instant::now(),
        }
    });
    let deadline = (l.since + WAIT_LIMIT).min(q.stall_at());
    matches!(
        tokio::time::timeout_at(deadline, l.rx.changed()).await,
        Ok(Ok(()))
    )
}

impl ConnState {
    /// Stage a chunk the session accepted (see [`ConnState::stage`]), or park it: its reply,
    /// or None while it waits for a ring slot (or behind another `Stage` that does).
    pub(super) async fn stage_or_park(&mut self, shared: &Shared, p: Parked) -> Option<Msg> {
        if !self.parking.any() && self.ring_busy(shared, p.region, p.offset, p.len).is_none() {
            let may_wait = !shared.regions.get(p.region).ring_queue.stalled();
            if let Some(reply) = self.stage_reply(shared, p, may_wait).await {
                return Some(reply);
            }
            // (None: another connection took the last slot since we looked: wait for the next)
        }
        if !self.parking.any() {
            self.parking
                .wait_on(&shared.regions.get(p.region).ring_queue);
        }
        self.parking.push(p);
        None
    }

    /// The replies of the parked chunks that may go now, in order: lent from a slot that came
    /// back, or copied once they waited their limit. The rest wait on.
    pub(super) async fn resume(&mut self, shared: &Shared) -> Vec<Msg> {
        let mut out = Vec::new();
        while let Some(p) = self.parking.first() {
            if !self.parking.first_expired() {
                if let Some(q) = self.ring_busy(shared, p.region, p.offset, p.len) {
                    self.parking.wait_on(&q);
                    return out;
                }
            }
            let stalled = shared.regions.get(p.region).ring_queue.stalled();
            let may_wait = !self.parking.first_expired() && !stalled;
            let Some(reply) = self.waited(shared, p, may_wait).await else {
                // another connection took the slot first: look again when the next comes back
                self.parking
                    .wait_on(&shared.regions.get(p.region).ring_queue);
                return out;
            };
            self.parking.pop();
            out.push(reply);
            // the next in line takes the next slot: a further chunk of ours waits behind it
            self.parking.stop_waiting();
        }
        out
    }

    /// Every parked chunk staged now, without waiting (copied where no slot is free): a
    /// request of another kind came, and its reply goes out after theirs.
    pub(super) async fn flush_parked(&mut self, shared: &Shared) -> Vec<Msg> {
        let mut out = Vec::new();
        while let Some(p) = self.parking.pop() {
            if let Some(reply) = self.waited(shared, p, false).await {
                out.push(reply);
            }
        }
        self.parking.stop_waiting();
        out
    }

    /// The reply of a chunk that waited, counted by how it went (None: with `may_wait`, it
    /// waits on).
    async fn waited(&mut self, shared: &Shared, p: Parked, may_wait: bool) -> Option<Msg> {
        let reply = self.stage_reply(shared, p, may_wait).await?;
        let lent = matches!(reply, Msg::Staged { lent: true, .. });
        let name = &shared.regions.get(p.region).info.name;
        shared.metrics().ring_wait(name, lent);
        tracing::debug!(
            region = %name,
            lent,
            waited_ms = p.arrived.elapsed().as_millis() as u64,
            "a staged chunk waited for a ring slot"
        );
        Some(reply)
    }

    /// The reply to a `Stage`: the chunk staged, or why not (the session takes the slot
    /// back). None: with `may_wait`, the ring has no slot for it now.
    async fn stage_reply(&mut self, shared: &Shared, p: Parked, may_wait: bool) -> Option<Msg> {
        let arrived = p.arrived.into_std();
        let staged = self.stage(shared, p.region, p.offset, p.len, p.slot, arrived, may_wait);
        match staged.await {
            Ok(reply) => reply,
            Err((code, message)) => {
                self.session.unstaged(p.slot);
                tracing::debug!(%code, message, "staging refused");
                Some(Msg::Error { code, message })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_slot_goes_to_the_first_in_line_and_the_next_looks_when_it_leaves() {
        let q = Arc::new(RingQueue::default());
        assert!(
            q.my_turn(1) && q.my_turn(2),
            "nobody waits: anyone takes a slot"
        );
        let (mut a, mut b) = (Parking::new(1), Parking::new(2));
        a.wait_on(&q);
        b.wait_on(&q);
        b.wait_on(&q);
        assert!(q.my_turn(1));
        assert!(!q.my_turn(2) && !q.my_turn(3), "behind the first: no slot");
        let mut rx = q.changed.subscribe();
        a.stop_waiting();
        assert!(
            rx.has_changed().unwrap(),
            "the next in line is told to look"
        );
        assert!(q.my_turn(2) && !q.my_turn(1));
        rx.borrow_and_update();
        drop(b);
        assert!(rx.has_changed().unwrap());
        assert!(q.my_turn(3), "a connection that ends leaves the line");
    }

    #[tokio::test(start_paused = true)]
    async fn a_parked_request_wakes_when_a_slot_comes_back_or_the_ring_stalls() {
        let q = Arc::new(RingQueue::default());
        assert!(q.stalled(), "nothing was ever lent");
        let mut p = Parking::new(7);
        p.push(parked());
        let lease = SlotFreed::new(&q);
        assert!(!q.stalled(), "a chunk was just lent");
        p.wait_on(&q);
        // a new line is looked at once
        tokio::time::timeout(Duration::from_millis(1), p.wake())
            .await
            .expect("looks at once");
        // then only when a slot comes back
        assert!(tokio::time::timeout(Duration::from_millis(100), p.wake())
            .await
            .is_err());
        drop(lease);
        tokio::time::timeout(Duration::from_millis(1), p.wake())
            .await
            .expect("a slot came back");
        // nothing moves: it wakes when the ring stalls, before its own limit
        let back = Instant::now();
        tokio::time::timeout(WAIT_LIMIT, p.wake())
            .await
            .expect("wakes when the ring stalls");
        assert_eq!(back.elapsed(), STALL_AFTER);
        assert!(q.stalled() && !p.first_expired());
        p.pop();
        assert!(tokio::time::timeout(WAIT_LIMIT * 10, p.wake())
            .await
            .is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_parked_request_waits_its_limit_at_most() {
        let mut p = Parking::new(8);
        p.push(parked());
        let first = Instant::now();
        tokio::time::timeout(WAIT_LIMIT * 2, p.wake())
            .await
            .expect("wakes at its limit");
        assert_eq!(first.elapsed(), WAIT_LIMIT);
        assert!(p.first_expired());
    }

    fn parked() -> Parked {
        Parked {
            region: 0,
            offset: 0,
            len: 1,
            slot: 0,
            arrived: Instant::now(),
        }
    }
}
