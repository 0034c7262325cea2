//! The budget of connections that have not said hello yet.
//!
//! At most `max` wait for their hello at once (each for at most the hello timeout). When a new
//! connection comes and the budget is full, the oldest waiting one is dropped: a silent or
//! dribbling socket has had the longest to say hello, while a real client's hello takes one
//! round trip, so a flood of silent sockets cannot keep real clients out, and the memory and
//! descriptors spent on strangers stay bounded.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The waiting room.
#[derive(Debug)]
pub(super) struct PreAuth {
    max: usize,
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// Oldest first: (ticket id, the way to tell it to leave).
    waiting: VecDeque<(u64, oneshot::Sender<()>)>,
}

/// A place in the waiting room; dropping it leaves the room. It owns its share of the room, so
/// the accept loop can take it (in accept order) and hand it to the connection's task.
#[derive(Debug)]
pub(super) struct Ticket {
    room: Arc<Mutex<Inner>>,
    id: u64,
    /// Resolves when a newer connection took this one's place.
    pub(super) evicted: oneshot::Receiver<()>,
}

impl PreAuth {
    /// A room for `max` connections (at least one).
    pub(super) fn new(max: usize) -> PreAuth {
        PreAuth {
            max: max.max(1),
            inner: Arc::new(Mutex::new(Inner::default())),
        }
    }

    /// Enter; returns the ticket and whether the oldest waiting connection had to leave.
    pub(super) fn admit(&self) -> (Ticket, bool) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut evicted = false;
        while inner.waiting.len() >= self.max {
            if let Some((_, tx)) = inner.waiting.pop_front() {
                let _ = tx.send(());
                evicted = true;
            }
        }
        let (tx, rx) = oneshot::channel();
        let id = inner.next;
        inner.next += 1;
        inner.waiting.push_back((id, tx));
        (
            Ticket {
                room: Arc::clone(&self.inner),
                id,
                evicted: rx,
            },
            evicted,
        )
    }

    /// Connections waiting now.
    pub(super) fn waiting(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting
            .len()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut inner = self.room.lock().unwrap_or_else(|p| p.into_inner());
        inner.waiting.retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_leaves_when_the_room_is_full() {
        let room = PreAuth::new(2);
        let (mut a, out) = room.admit();
        assert!(!out);
        let (mut b, out) = room.admit();
        assert!(!out);
        let (mut c, out) = room.admit();
        assert!(out, "the room was full");
        assert!(a.evicted.try_recv().is_ok(), "the oldest was told to leave");
        assert!(b.evicted.try_recv().is_err());
        assert_eq!(room.waiting(), 2);
        drop(b);
        assert_eq!(room.waiting(), 1, "a ticket leaves when dropped");
        let (_d, out) = room.admit();
        assert!(!out);
        assert!(c.evicted.try_recv().is_err());
        drop(a);
        assert_eq!(
            room.waiting(),
            2,
            "an evicted ticket's drop changes nothing"
        );
    }
}
