//! A batch's staged chunks: their `Staged` replies turned into READs straight into the
//! buffer, the oldest piece's READ awaited, lent chunks that came too late to READ in time
//! asked for again, and what is in flight settled after an error.

use std::sync::Arc;

use verbs::{Local, Pending, SendOp, SendWr};

use super::{Batch, Flight, Held};
use crate::client::wait::{done_or_bytes, end_oldest, read_op, Woke};
use crate::client::window::{
    bounce_reply, give_back_late, reask, staged_reply, staged_reply_ready, taken_back, StagedAt,
};
use crate::client::Rdma;
use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::protocol::Msg;

impl Batch<'_, '_> {
    /// Staged fetches in the window (requested or being read).
    pub(super) fn pulls(&self) -> usize {
        self.window
            .iter()
            .filter(|f| {
                matches!(
                    f,
                    Flight::Stage { .. } | Flight::Again { .. } | Flight::Pull(..)
                )
            })
            .count()
    }

    /// Whether staged fetches in the window still wait for their `Staged` replies.
    pub(super) fn awaits_replies(&self) -> bool {
        self.window
            .iter()
            .any(|f| matches!(f, Flight::Stage { .. }))
    }

    /// Whether chunks in the window wait to be asked for again.
    pub(super) fn asks_again(&self) -> bool {
        self.window
            .iter()
            .any(|f| matches!(f, Flight::Again { .. }))
    }

    /// Wait for `p`, the oldest piece's READ (of the server's staging slot in `at`, which is
    /// then released), and meanwhile turn the `Staged` replies that arrive into READs (see
    /// [`done_or_bytes`]).
    pub(super) async fn land(
        &mut self,
        rdma: &mut Rdma,
        conn: &mut Conn,
        p: Pending,
        at: Option<StagedAt>,
        pos: u64,
    ) -> Result<()> {
        let slot = at.map(|a| a.slot);
        let deadline = tokio::time::Instant::now() + self.stall;
        let mut done = std::pin::pin!(p.wait());
        loop {
            let limits = (deadline, self.stall, read_op(slot), pos);
            let watch = self.awaits_replies();
            match done_or_bytes(&rdma.qp, conn, done.as_mut(), watch, limits)
                .await
                .map_err(|e| taken_back(e, at.as_ref()))?
            {
                // the returned locals are this sink's clones: dropped here
                Woke::Done(_) => break,
                Woke::Bytes => {
                    if let Err(e) = self.start_pulls(rdma, conn, false).await {
                        return Err(end_oldest(conn, done.as_mut(), deadline, slot, e).await);
                    }
                }
            }
        }
        if let Some(slot) = slot {
            // with our next message (the next chunk's `Stage`, as a rule): see `Conn::defer`
            conn.defer(&Msg::Unstage { slot });
        }
        Ok(())
    }

    /// Turn the requested staged fetches into READs into the buffer, in order (replies come
    /// in request order: up to the first classic bounce request), so that they overlap. With
    /// `wait`, replies are waited for until the oldest piece can land: its own reply, or, when
    /// it was given back to be asked for again, every reply before it is asked again. The
    /// others are taken if they have arrived, so that a late reply holds up no landing (as in
    /// a fetch). A lent chunk whose reply came too late to READ in time is given back unread
    /// and asked for again once no earlier `Stage` awaits its reply (see
    /// `window::readable_in_time`).
    pub(super) async fn start_pulls(
        &mut self,
        rdma: &mut Rdma,
        conn: &mut Conn,
        wait: bool,
    ) -> Result<()> {
        loop {
            let front_again = matches!(self.window.front(), Some(Flight::Again { .. }));
            for i in 0..self.window.len() {
                let (asked, dst) = match self.window[i] {
                    Flight::Direct(..) | Flight::Pull(..) | Flight::Again { .. } => continue,
                    Flight::Bounce(..) => break,
                    Flight::Stage { asked, at } => (asked, at),
                };
                let Some(Held::Sink(sink)) = &self.held else {
                    return Err(Error::Config(
                        "internal: a staged fetch without the buffer shared with READs".into(),
                    ));
                };
                let sink = Arc::clone(sink);
                let at = if wait && (i == 0 || front_again) {
                    staged_reply(conn, self.stall, asked.len).await?
                } else {
                    match staged_reply_ready(conn, asked.len).await? {
                        Some(r) => r,
                        None => break,
                    }
                };
                if give_back_late(conn, &at, &asked) {
                    self.window[i] = Flight::Again { asked, at: dst };
                    continue;
                }
                let wr = SendWr {
                    op: SendOp::Read(at.remote),
                    local: Local::sink(sink, dst..dst + asked.len as usize)?,
                };
                let pending = match rdma.qp.post_send(vec![wr]) {
                    Ok(p) => p,
                    Err(e) => {
                        conn.send(&Msg::Unstage { slot: at.slot }).await?;
                        return Err(e.into());
                    }
                };
                self.window[i] = Flight::Pull(pending, at, asked.pos);
            }
            self.ask_again(conn).await?;
            let unstarted = matches!(
                self.window.front(),
                Some(Flight::Stage { .. } | Flight::Again { .. })
            );
            if !wait || !unstarted {
                return Ok(());
            }
        }
    }

    /// Ask again for the chunks given back unread, in window order, once no `Stage` in the
    /// window awaits its reply (replies come in request order).
    async fn ask_again(&mut self, conn: &mut Conn) -> Result<()> {
        if self.awaits_replies() || !self.asks_again() {
            return Ok(());
        }
        for f in self.window.iter_mut() {
            if let Flight::Again { asked, at } = *f {
                self.reasked += 1;
                *f = Flight::Stage {
                    asked: reask(conn, asked),
                    at,
                };
            }
        }
        conn.send_deferred().await
    }

    /// After an error: wait (bounded) for what is in flight, reading every bounce reply.
    pub(super) async fn settle(&mut self, rdma: &mut Rdma, conn: &mut Conn) {
        let mut conn_ok = true;
        for f in self.window.drain(..) {
            match f {
                Flight::Direct(p, ..) => {
                    let _ = tokio::time::timeout(self.stall, p.wait()).await;
                }
                Flight::Bounce(staging, n, _) => {
                    if conn_ok && bounce_reply(conn, self.stall, n).await.is_err() {
                        conn_ok = false;
                    }
                    rdma.pools.give(staging);
                }
                // its release is deferred: it goes with the next message
                Flight::Again { .. } => {}
                Flight::Stage { asked, .. } => {
                    if conn_ok {
                        conn_ok = match staged_reply(conn, self.stall, asked.len).await {
                            Ok(at) => conn.send(&Msg::Unstage { slot: at.slot }).await.is_ok(),
                            Err(_) => false,
                        };
                    }
                }
                Flight::Pull(p, StagedAt { slot, .. }, _) => {
                    let _ = tokio::time::timeout(self.stall, p.wait()).await;
                    if conn_ok {
                        conn_ok = conn.send(&Msg::Unstage { slot }).await.is_ok();
                    }
                }
            }
        }
    }
}
