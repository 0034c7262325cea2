//! Waiting for the oldest RDMA operation of a transfer without waiting forever: bounded by
//! the stall limit (then the QP goes to the error state, so that the rest is flushed), and
//! watching the control connection meanwhile (a server that goes away ends the wait at once;
//! `Staged` replies that arrive are handed to the caller).

use std::future::Future;
use std::time::Duration;

use verbs::{Local, Pending};

use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::protocol::Msg;

/// Wait for a work request, but not forever: an RDMA transport that stalls (no completion and
/// no error) is turned into an error, and the QP is moved to the error state so that every other
/// outstanding work request completes (flushed) and gives its buffer back. The control
/// connection is watched meanwhile: a server that goes away ends the wait at once (bytes that
/// arrive are kept for the next receive).
pub(super) async fn await_or_stall(
    qp: &verbs::QueuePair,
    conn: &mut Conn,
    p: Pending,
    limit: Duration,
    op: &'static str,
    offset: u64,
) -> Result<Vec<Local>> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut done = std::pin::pin!(p.wait());
    loop {
        let limits = (deadline, limit, op, offset);
        if let Woke::Done(back) = done_or_bytes(qp, conn, done.as_mut(), false, limits).await? {
            return Ok(back);
        }
    }
}

/// What ended a wait in [`done_or_bytes`].
pub(super) enum Woke {
    /// The RDMA operation completed.
    Done(Vec<Local>),
    /// Bytes arrived on the control connection first.
    Bytes,
}

/// Wait for `done`, the oldest piece's RDMA operation, until `deadline` (then the QP goes to
/// the error state, as in [`await_or_stall`]); with `watch`, return as soon as bytes arrive on
/// the control connection instead, so that the caller turns the `Staged` replies among them
/// into READs at once and waits again. (Read only once the oldest READ had ended, the replies
/// of a fetch's first chunks waited for its first READ, and the server's NIC had nothing to
/// send for a round trip after it.) Without `watch` the bytes are kept for the next receive
/// and the wait goes on. Either way the end of the control connection (the server died, or
/// closed it) ends the wait at once, with the server's last error message if it sent one:
/// the RDMA operation would otherwise wait out `limit` (or the NIC's retries) for a peer QP
/// that is gone.
pub(super) async fn done_or_bytes(
    qp: &verbs::QueuePair,
    conn: &mut Conn,
    mut done: std::pin::Pin<&mut impl Future<Output = verbs::Result<Vec<Local>>>>,
    watch: bool,
    (deadline, limit, op, offset): (tokio::time::Instant, Duration, &'static str, u64),
) -> Result<Woke> {
    let want = if watch { "a staged chunk" } else { op };
    loop {
        tokio::select! {
            biased;
            r = done.as_mut() => return Ok(Woke::Done(r?)),
            r = conn.more_bytes(want) => match r {
                Ok(()) if watch => return Ok(Woke::Bytes),
                Ok(()) => {}
                Err(e) => return Err(gone(qp, conn, e)),
            },
            () = tokio::time::sleep_until(deadline) => return Err(stalled(qp, limit, op, offset)),
        }
    }
}

/// The control connection ended (`e`) while an RDMA operation was in flight: the QP goes to
/// the error state (so that what is in flight completes, flushed, and gives its buffers
/// back), and the error is the server's last message when it explained itself before it
/// closed, `e` otherwise.
fn gone(qp: &verbs::QueuePair, conn: &mut Conn, e: Error) -> Error {
    if let Err(e) = qp.set_error() {
        tracing::warn!(error = %e, "could not move the QP to the error state");
    }
    while let Ok(Some(m)) = conn.try_recv() {
        if let Msg::Error { code, message } = m {
            return Error::Server { code, message };
        }
    }
    e
}

/// How a stall error names the oldest piece's READ: of a staged chunk (in the server's slot
/// `slot`) or of a direct extent.
pub(super) fn read_op(slot: Option<u32>) -> &'static str {
    match slot {
        None => "RDMA READ",
        Some(_) => "RDMA READ of a staged chunk",
    }
}

/// Turning later replies into READs failed (`e`) while the oldest piece's READ (`done`) was in
/// flight: that piece is still ours, so it ends (until `deadline`) and its server slot goes back
/// before the error is returned (`settle` waits for the rest of the window).
pub(super) async fn end_oldest(
    conn: &mut Conn,
    done: std::pin::Pin<&mut impl Future<Output = verbs::Result<Vec<Local>>>>,
    deadline: tokio::time::Instant,
    slot: Option<u32>,
    e: Error,
) -> Error {
    let _ = tokio::time::timeout_at(deadline, done).await;
    if let Some(slot) = slot {
        let _ = conn.send(&Msg::Unstage { slot }).await;
    }
    e
}

/// The error of an RDMA operation that did not complete within `limit`; the QP goes to the
/// error state, so that the operation completes (flushed) and its buffer comes back.
fn stalled(qp: &verbs::QueuePair, limit: Duration, op: &'static str, offset: u64) -> Error {
    if let Err(e) = qp.set_error() {
        tracing::warn!(error = %e, "could not move the stalled QP to the error state");
    }
    Error::Stalled {
        op,
        offset,
        secs: limit.as_secs(),
        qpn: qp.qpn(),
    }
}
