//! The transfer window of a fetch or put: how a range is cut into pieces (never across an
//! extent), how each piece is started (one-sided RDMA on a direct extent, a bounce request on a
//! bounce extent, a `Stage` of a chunk the server stages and we READ, asked for again when its
//! reply came too late to READ in time), how its end is awaited (bounded by the stall timeout:
//! `wait`), and how everything still in flight is settled after an error.

use std::collections::VecDeque;
use std::io::Read;
use std::time::{Duration, Instant};

use verbs::{Local, Pending, RegisteredBuffer, RemoteSlice, SendOp, SendWr};

use super::wait::{done_or_bytes, end_oldest, read_op, Woke};
use super::{reply_err, OpenRegion, Rdma};
use crate::conn::Conn;
use crate::error::{Error, Result};
pub(super) use crate::piece::{piece, Cut, Piece};
use crate::protocol::{DataPath, Msg};

/// One transfer in flight.
pub(super) enum Slot {
    /// A one-sided RDMA operation of ours.
    Rdma(Pending, u64),
    /// A bounce request: the server moves the bytes to or from this buffer and replies.
    Bounce(RegisteredBuffer, u64),
    /// A staged fetch asked for: once the server's `Staged` reply is read, we RDMA-READ the
    /// chunk into this buffer.
    Stage(RegisteredBuffer, Asked),
    /// A lent chunk whose `Staged` reply came too late to be READ in time
    /// ([`readable_in_time`]): given back unread, and asked for again once no earlier `Stage`
    /// awaits its reply ([`ask_again`]).
    Again(RegisteredBuffer, Asked),
    /// A staged chunk being read: the READ, the chunk (its slot is released once the READ
    /// completes), and how many times it was asked for again.
    Pull(Pending, StagedAt, u8),
}

/// A staged fetch asked for: what (to ask again) and when.
#[derive(Debug, Clone, Copy)]
pub(super) struct Asked {
    pub(super) handle: u32,
    pub(super) pos: u64,
    pub(super) len: u64,
    /// When its `Stage` was issued: the server lent the chunk no earlier.
    pub(super) at: Instant,
    /// How many times it was asked for again.
    pub(super) again: u8,
}

/// How many times a lent chunk that came too late is asked for again before it is READ all
/// the same.
const MAX_ASKS_AGAIN: u8 = 3;

/// Whether a chunk staged for a `Stage` issued at `asked` may still be READ at `now`. A lent
/// chunk that holds a slot of the region's CMB ring may have the slot taken back once the
/// server's hold limit (`StagedAt::hold`) has passed since it lent the chunk, which it did no
/// earlier than `asked`, if others want the ring then; its READ is posted only while a third
/// of the limit is left for it to complete. Else (the client's sink blocked for most of the
/// limit, say, while the reply waited unread) the chunk goes back unread and is asked for
/// again: the fetch loses time, not its bytes. (A READ of a slot taken back fails with a
/// remote access error, and takes the QP down with it.)
pub(super) fn readable_in_time(at: &StagedAt, asked: Instant, now: Instant) -> bool {
    match at.hold {
        Some(hold) if at.lent => now.saturating_duration_since(asked) < hold - hold / 3,
        _ => true,
    }
}

/// A chunk the server staged for us to READ: its slot there, where it is (`remote.len` is its
/// length), whether the server lent it as it is (a slot of the region's CMB ring: no copy
/// on the server, and no byte of it in the server's host memory), and for a lent chunk that
/// holds a ring slot, the server's hold limit (see [`readable_in_time`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct StagedAt {
    pub(super) slot: u32,
    pub(super) remote: RemoteSlice,
    pub(super) lent: bool,
    pub(super) hold: Option<Duration>,
}

impl StagedAt {
    /// Bytes of it the server's NIC moved zero-copy: all of a lent chunk.
    pub(super) fn zero_copy(&self) -> u64 {
        if self.lent {
            self.remote.len
        } else {
            0
        }
    }
}

/// A fetch piece that arrived: the buffer holding its bytes, how many, whether they came one-
/// sided from a direct extent, and how many of them the server's NIC moved zero-copy.
pub(super) struct Arrived {
    pub(super) buf: RegisteredBuffer,
    pub(super) n: u64,
    pub(super) direct: bool,
    pub(super) zero_copy: u64,
    /// How many times it was asked for again ([`readable_in_time`]).
    pub(super) again: u8,
}

/// Whether a piece is a staged fetch: a bounce extent of a handle whose server stages.
pub(super) fn staged(r: &OpenRegion, p: &Piece, to_region: bool) -> bool {
    !to_region && p.path != DataPath::Direct && r.pull_depth > 0
}

/// Staged fetches in the window (requested or being read): at most the handle's `pull_depth`.
pub(super) fn pulls(window: &VecDeque<Slot>) -> usize {
    window
        .iter()
        .filter(|s| matches!(s, Slot::Stage(..) | Slot::Again(..) | Slot::Pull(..)))
        .count()
}

/// Whether a transfer may ask the server to stage its next chunk now. `held`: staged chunks it
/// asked for and has not released; `depth`: how many it may hold at once (the handle's
/// `pull_depth`, within the transfer's own window); `left`: staged chunks it has still to ask
/// for; `asking`: it already asked for one since it last landed a chunk.
///
/// Asks go out in batches. With chunks held, the next ones are asked for only once half the
/// depth is free (or all that are left fit), all in one write after the releases deferred
/// before them ([`issue`] defers each `Stage`; the caller sends them), and the server answers
/// such a batch in one write as well. Each exchange on the control connection costs both hosts
/// a wake-up beside the NIC's work: between the lab hosts, a direct 16 MiB fetch that sent one
/// message of its own per chunk ran about 6% slower, and 16 MiB bounce fetches asked in
/// batches of half the depth ran 4-6% faster than with a `Stage` per chunk
/// (ARCHITECTURE.md). The other half of the depth stays staged meanwhile: the NIC always has
/// chunks to send.
pub(super) fn may_stage(held: usize, depth: usize, left: usize, asking: bool) -> bool {
    if held >= depth {
        return false;
    }
    if held == 0 || asking {
        return true;
    }
    depth - held >= (depth / 2).max(1).min(left.max(1))
}

/// Start moving `buf[..p.len]` to (`to_region`) or from the region at `p.pos`: a one-sided RDMA
/// WRITE or READ on a direct extent (a WRITE within the QP's inline room carries its bytes in
/// the work request, and `buf` goes straight back to the pool), a bounce request on a bounce
/// extent (`stage`: a staged fetch, see [`staged`]: its `Stage` is deferred, and the caller
/// sends it with the others of its batch, see [`may_stage`]).
pub(super) async fn issue(
    rdma: &mut Rdma,
    conn: &mut Conn,
    r: &OpenRegion,
    p: Piece,
    buf: RegisteredBuffer,
    to_region: bool,
    stage: bool,
) -> Result<Slot> {
    if p.path == DataPath::Direct {
        let remote = r.remote_at(p.pos, p.len)?;
        let wr = if to_region && p.len <= u64::from(rdma.inline) {
            let wr = SendWr {
                op: SendOp::Write(remote),
                local: Local::inline(&buf.as_slice()[..p.len as usize]),
            };
            rdma.pools.give(buf);
            wr
        } else {
            SendWr {
                op: if to_region {
                    SendOp::Write(remote)
                } else {
                    SendOp::Read(remote)
                },
                local: Local::owned_range(buf, 0..p.len as usize)?,
            }
        };
        return Ok(Slot::Rdma(rdma.qp.post_send(vec![wr])?, p.len));
    }
    if stage && !to_region {
        let asked = ask(
            conn,
            Asked {
                handle: r.handle,
                pos: p.pos,
                len: p.len,
                at: Instant::now(),
                again: 0,
            },
        );
        return Ok(Slot::Stage(buf, asked));
    }
    let m = Msg::Bounce {
        handle: r.handle,
        offset: p.pos,
        len: p.len,
        to_region,
        addr: buf.addr(),
        rkey: buf.mr().rkey(),
    };
    // on failure the buffer is dropped (deregistered before it is unmapped): the next transfer
    // registers a replacement
    conn.send(&m).await?;
    Ok(Slot::Bounce(buf, p.len))
}

/// Defer the `Stage` of `a` (the caller sends it with the others of its batch); `a` as asked now.
pub(super) fn ask(conn: &mut Conn, a: Asked) -> Asked {
    conn.defer(&Msg::Stage {
        handle: a.handle,
        offset: a.pos,
        len: a.len,
    });
    Asked {
        at: Instant::now(),
        ..a
    }
}

/// The server's answer to one bounce request: how many of its bytes the server's NIC moved
/// zero-copy.
pub(super) async fn bounce_reply(conn: &mut Conn, limit: Duration, n: u64) -> Result<u64> {
    match conn.recv(Some(limit), "bounce-done").await? {
        Msg::BounceDone { len, zero_copy } if len == n => Ok(zero_copy.min(len)),
        Msg::BounceDone { len, .. } => Err(Error::Unexpected {
            peer: conn.peer.clone(),
            got: if len < n {
                "a short bounce-done"
            } else {
                "a long bounce-done"
            },
            want: "bounce-done",
        }),
        other => Err(reply_err(&conn.peer, other, "bounce-done")),
    }
}

/// The server's answer to a staged fetch of `n` bytes: where to read them. Whatever this
/// side deferred goes out first (the `Stage` awaited may be among it).
pub(super) async fn staged_reply(conn: &mut Conn, limit: Duration, n: u64) -> Result<StagedAt> {
    conn.send_deferred().await?;
    let m = conn.recv(Some(limit), "staged").await?;
    check_staged(conn, m, n).await
}

/// The server's answer to a staged fetch of `n` bytes if it has already arrived (`None` if not
/// yet), without waiting: the replies of the chunks behind the oldest one are taken as they
/// come, so that waiting for one never holds up landing another.
pub(super) async fn staged_reply_ready(conn: &mut Conn, n: u64) -> Result<Option<StagedAt>> {
    match conn.try_recv()? {
        Some(m) => Ok(Some(check_staged(conn, m, n).await?)),
        None => Ok(None),
    }
}

/// `m` as the `Staged` reply of a fetch of `n` bytes: where to read them. A chunk of another
/// length is released at once and refused.
async fn check_staged(conn: &mut Conn, m: Msg, n: u64) -> Result<StagedAt> {
    match m {
        Msg::Staged {
            slot,
            addr,
            rkey,
            len,
            lent,
            hold_ms,
        } if len == n => Ok(StagedAt {
            slot,
            remote: RemoteSlice { addr, rkey, len },
            lent,
            hold: (hold_ms > 0).then(|| Duration::from_millis(hold_ms)),
        }),
        Msg::Staged { slot, .. } => {
            conn.send(&Msg::Unstage { slot }).await?;
            Err(Error::Unexpected {
                peer: conn.peer.clone(),
                got: "a staged chunk of another length",
                want: "staged",
            })
        }
        other => Err(reply_err(&conn.peer, other, "staged")),
    }
}

/// Read a staged chunk into `buf`: `reply` is the server's `Staged` answer (or the error
/// instead of it); we RDMA-READ the chunk.
async fn pull(
    rdma: &mut Rdma,
    conn: &mut Conn,
    buf: RegisteredBuffer,
    reply: Result<StagedAt>,
) -> Result<(Pending, StagedAt)> {
    let at = match reply {
        Ok(s) => s,
        Err(e) => {
            rdma.pools.give(buf);
            return Err(e);
        }
    };
    let wr = SendWr {
        op: SendOp::Read(at.remote),
        local: Local::owned_range(buf, 0..at.remote.len as usize)?,
    };
    match rdma.qp.post_send(vec![wr]) {
        Ok(p) => Ok((p, at)),
        Err(e) => {
            conn.send(&Msg::Unstage { slot: at.slot }).await?;
            Err(e.into())
        }
    }
}

/// READ a chunk the server has already staged (the first chunk of a fetch, staged with its
/// open) into `buf`: the pull in flight.
pub(super) async fn pull_staged(
    rdma: &mut Rdma,
    conn: &mut Conn,
    buf: RegisteredBuffer,
    at: StagedAt,
) -> Result<Slot> {
    let (p, at) = pull(rdma, conn, buf, Ok(at)).await?;
    Ok(Slot::Pull(p, at, 0))
}

/// What a `Staged` reply (or the error instead of it) makes of the chunk `asked` for: its READ
/// into `buf` in flight, or, when the reply came too late for the READ to be in time
/// ([`readable_in_time`]), the chunk given back (with our next message) to be asked for again.
async fn take_reply(
    rdma: &mut Rdma,
    conn: &mut Conn,
    buf: RegisteredBuffer,
    asked: Asked,
    reply: Result<StagedAt>,
) -> Result<Slot> {
    if let Ok(at) = &reply {
        if give_back_late(conn, at, &asked) {
            return Ok(Slot::Again(buf, asked));
        }
    }
    let (p, at) = pull(rdma, conn, buf, reply).await?;
    Ok(Slot::Pull(p, at, asked.again))
}

/// Defer the `Stage` of a chunk given back unread ([`give_back_late`]): `a` asked once more,
/// now.
pub(super) fn reask(conn: &mut Conn, a: Asked) -> Asked {
    ask(
        conn,
        Asked {
            again: a.again + 1,
            ..a
        },
    )
}

/// Whether the chunk staged in `at` for `asked` came too late to READ in time
/// ([`readable_in_time`]; at most [`MAX_ASKS_AGAIN`] times for one chunk): then its release
/// is deferred (it goes with our next message), and the caller asks for it again.
pub(super) fn give_back_late(conn: &mut Conn, at: &StagedAt, asked: &Asked) -> bool {
    if asked.again >= MAX_ASKS_AGAIN || readable_in_time(at, asked.at, Instant::now()) {
        return false;
    }
    tracing::info!(
        slot = at.slot,
        offset = asked.pos,
        asked_ms = asked.at.elapsed().as_millis() as u64,
        hold_ms = at.hold.map_or(0, |h| h.as_millis() as u64),
        "a lent chunk's reply came too late to READ it within the server's ring hold limit: \
         given back unread, and asked for again"
    );
    conn.defer(&Msg::Unstage { slot: at.slot });
    true
}

/// Ask again for the chunks given back unread ([`Slot::Again`]), in window order, once no
/// `Stage` in the window awaits its reply: replies come in request order, and the window's
/// requested chunks are answered in window order.
async fn ask_again(conn: &mut Conn, window: &mut VecDeque<Slot>) -> Result<()> {
    if awaits_replies(window) {
        return Ok(());
    }
    let mut asked = false;
    for i in 0..window.len() {
        if !matches!(window[i], Slot::Again(..)) {
            continue;
        }
        let Some(Slot::Again(buf, a)) = window.remove(i) else {
            continue;
        };
        window.insert(i, Slot::Stage(buf, reask(conn, a)));
        asked = true;
    }
    if asked {
        conn.send_deferred().await?;
    }
    Ok(())
}

/// Turn the requested staged fetches in `window` into READs in flight (or into chunks to ask
/// for again), in order (replies come in request order: up to the first classic bounce
/// request, whose reply is read when it is the oldest). With `wait` (the stall limit), every
/// reply is waited for; without, only those that have arrived are taken.
async fn take_replies(
    rdma: &mut Rdma,
    conn: &mut Conn,
    window: &mut VecDeque<Slot>,
    wait: Option<Duration>,
) -> Result<()> {
    for i in 0..window.len() {
        let n = match &window[i] {
            Slot::Rdma(..) | Slot::Pull(..) | Slot::Again(..) => continue,
            Slot::Bounce(..) => break,
            Slot::Stage(_, a) => a.len,
        };
        let reply = match wait {
            Some(stall) => staged_reply(conn, stall, n).await,
            None => match staged_reply_ready(conn, n).await.transpose() {
                Some(reply) => reply,
                None => break,
            },
        };
        let Some(Slot::Stage(buf, asked)) = window.remove(i) else {
            continue;
        };
        let s = take_reply(rdma, conn, buf, asked, reply).await?;
        window.insert(i, s);
    }
    Ok(())
}

/// Turn the requested staged fetches whose `Staged` replies have arrived into READs in
/// flight, without waiting for any ([`take_replies`]): the oldest piece lands meanwhile, and a
/// chunk whose reply is late holds up no other. The READs of all staged chunks overlap.
/// (Waiting here for every reply stalled the loop for the server's staging time per chunk:
/// between the lab hosts a quarter-MiB chunk cost about 29 ms.) Then the chunks given back
/// unread are asked for again, once no reply is awaited ([`ask_again`]).
pub(super) async fn start_pulls(
    rdma: &mut Rdma,
    conn: &mut Conn,
    window: &mut VecDeque<Slot>,
) -> Result<()> {
    take_replies(rdma, conn, window, None).await?;
    ask_again(conn, window).await
}

/// Wait for the oldest piece of a fetch and hand over its bytes. Staged fetches release their
/// server slot once read. Meanwhile the `Staged` replies of the pieces still in `window` become
/// READs as they arrive ([`done_or_bytes`]).
pub(super) async fn land(
    rdma: &mut Rdma,
    conn: &mut Conn,
    slot: Slot,
    window: &mut VecDeque<Slot>,
    stall: Duration,
    at: u64,
) -> Result<Arrived> {
    let mut slot = slot;
    let (p, staged_at, n, again) = loop {
        slot = match slot {
            Slot::Rdma(p, n) => break (p, None, n, 0),
            Slot::Bounce(buf, n) => {
                return match bounce_reply(conn, stall, n).await {
                    Ok(zero_copy) => Ok(Arrived {
                        buf,
                        n,
                        direct: false,
                        zero_copy,
                        again: 0,
                    }),
                    Err(e) => {
                        rdma.pools.give(buf);
                        Err(e)
                    }
                };
            }
            Slot::Stage(buf, asked) => {
                let reply = staged_reply(conn, stall, asked.len).await;
                take_reply(rdma, conn, buf, asked, reply).await?
            }
            Slot::Again(buf, asked) => {
                // the replies of the chunks asked for before it come first; then it is asked
                // for again, ahead of any other given back
                if let Err(e) = take_replies(rdma, conn, window, Some(stall)).await {
                    rdma.pools.give(buf);
                    return Err(e);
                }
                let asked = reask(conn, asked);
                if let Err(e) = ask_again(conn, window).await {
                    rdma.pools.give(buf);
                    return Err(e);
                }
                Slot::Stage(buf, asked)
            }
            Slot::Pull(p, at, again) => break (p, Some(at), at.remote.len, again),
        };
    };
    let server_slot = staged_at.map(|at| at.slot);
    let op = read_op(server_slot);
    let deadline = tokio::time::Instant::now() + stall;
    let mut done = std::pin::pin!(p.wait());
    let mut back = loop {
        let watch = awaits_replies(window);
        match done_or_bytes(
            &rdma.qp,
            conn,
            done.as_mut(),
            watch,
            (deadline, stall, op, at),
        )
        .await
        .map_err(|e| taken_back(e, staged_at.as_ref()))?
        {
            Woke::Done(back) => break back,
            Woke::Bytes => {
                if let Err(e) = start_pulls(rdma, conn, window).await {
                    return Err(end_oldest(conn, done.as_mut(), deadline, server_slot, e).await);
                }
            }
        }
    };
    if let Some(slot) = server_slot {
        // with our next message (the next chunk's `Stage`, as a rule): see `Conn::defer`
        conn.defer(&Msg::Unstage { slot });
    }
    let l = back.pop().expect("one work request");
    Ok(Arrived {
        buf: l.into_owned().expect("owned buffer"),
        n,
        direct: server_slot.is_none(),
        zero_copy: staged_at.map_or(0, |at| at.zero_copy()),
        again,
    })
}

/// A READ of a lent chunk that the server's NIC refused (remote access error): the server took
/// the chunk's ring slot back, and the error says when it does.
pub(super) fn taken_back(e: Error, at: Option<&StagedAt>) -> Error {
    match (e, at) {
        (
            Error::Verbs(
                source @ verbs::Error::WorkCompletion {
                    status: verbs::WcStatus::REM_ACCESS_ERR,
                    ..
                },
            ),
            Some(at),
        ) if at.lent => Error::LentTakenBack {
            slot: at.slot,
            source,
        },
        (e, _) => e,
    }
}

/// Whether staged fetches in `window` still wait for their `Staged` replies.
fn awaits_replies(window: &VecDeque<Slot>) -> bool {
    window.iter().any(|s| matches!(s, Slot::Stage(..)))
}

/// After an error: wait (bounded) for everything still in flight so that no buffer is lost and
/// the control connection stays in step (every bounce request gets its reply read).
pub(super) async fn settle(
    rdma: &mut Rdma,
    conn: &mut Conn,
    window: &mut VecDeque<Slot>,
    stall: Duration,
) {
    let mut conn_ok = true;
    for slot in window.drain(..) {
        match slot {
            Slot::Rdma(p, _) => {
                if let Ok(Ok(v)) = tokio::time::timeout(stall, p.wait()).await {
                    for b in v.into_iter().filter_map(Local::into_owned) {
                        rdma.pools.give(b);
                    }
                }
            }
            Slot::Bounce(buf, n) => {
                if conn_ok && bounce_reply(conn, stall, n).await.is_err() {
                    conn_ok = false;
                }
                rdma.pools.give(buf);
            }
            Slot::Stage(buf, asked) => {
                if conn_ok {
                    match staged_reply(conn, stall, asked.len).await {
                        Ok(at) => {
                            conn_ok = conn.send(&Msg::Unstage { slot: at.slot }).await.is_ok()
                        }
                        Err(_) => conn_ok = false,
                    }
                }
                rdma.pools.give(buf);
            }
            Slot::Again(buf, _) => {
                // its release is deferred: it goes with the next message
                rdma.pools.give(buf);
            }
            Slot::Pull(p, StagedAt { slot, .. }, _) => {
                if let Ok(Ok(v)) = tokio::time::timeout(stall, p.wait()).await {
                    for b in v.into_iter().filter_map(Local::into_owned) {
                        rdma.pools.give(b);
                    }
                }
                if conn_ok {
                    conn_ok = conn.send(&Msg::Unstage { slot }).await.is_ok();
                }
            }
        }
    }
}

/// Whether `source` holds more bytes (one is read to find out): asked once a put without a
/// length filled the region to its end.
pub(super) fn more_input(source: &mut (dyn Read + Send)) -> Result<bool> {
    let mut probe = [0u8; 1];
    Ok(read_full(source, &mut probe).map_err(|e| Error::io("reading the data to put", e))? > 0)
}

/// The error of a put whose input is longer than the `room` bytes from `offset` to the end of
/// the region; `done` bytes were written.
pub(super) fn overflow_error(r: &OpenRegion, room: u64, offset: u64, done: u64) -> Error {
    Error::Server {
        code: crate::protocol::ErrorCode::OutOfRange,
        message: format!(
            "the input is longer than the {room} bytes from offset {offset} to the end of region '{}'; \
             the first {done} bytes were written",
            r.info.name
        ),
    }
}

/// Read until `buf` is full or EOF; returns the bytes read.
pub(super) fn read_full(src: &mut (dyn Read + Send), buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match src.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_goes_to_the_segment_that_holds_it() {
        use crate::protocol::{AccessMode, Segment};
        use verbs::RemoteSlice;
        const G: u64 = 1 << 30;
        let mut r = OpenRegion {
            handle: 1,
            connection: 1,
            info: crate::server::testkit::info("big", G + G / 4, AccessMode::ReadWrite),
            remote: RemoteSlice {
                addr: 1 << 40,
                rkey: 7,
                len: G,
            },
            segments: Vec::new(),
            bounce_chunk: 1 << 20,
            piece_align: 0,
            pull_depth: 0,
            write: true,
            open_ms: 0.0,
        };
        // one MR: the remote slice itself
        let one = r.remote_at(G - 4096, 4096).unwrap();
        assert_eq!((one.addr, one.rkey), ((1 << 40) + G - 4096, 7));
        assert!(r.remote_at(G - 4096, 8192).is_err());
        r.segments = vec![
            Segment {
                offset: 0,
                len: G,
                addr: 1 << 40,
                rkey: 7,
            },
            Segment {
                offset: G,
                len: G / 4,
                addr: 1 << 50,
                rkey: 8,
            },
        ];
        let second = r.remote_at(G + 5, 100).unwrap();
        assert_eq!(
            (second.addr, second.rkey, second.len),
            ((1 << 50) + 5, 8, 100)
        );
        let first = r.remote_at(0, 4096).unwrap();
        assert_eq!(first.rkey, 7);
        // across the boundary, or past the last segment: refused, never a wrong address
        assert!(r.remote_at(G - 10, 20).is_err());
        let e = r.remote_at(G + G / 4, 1).unwrap_err().to_string();
        assert!(e.contains("none of the server's 2 segments"), "{e}");
    }

    #[test]
    fn a_lent_chunk_is_read_only_while_a_third_of_the_hold_limit_is_left() {
        let at = |lent, hold: Option<u64>| StagedAt {
            slot: 0,
            remote: RemoteSlice {
                addr: 0,
                rkey: 0,
                len: 1 << 20,
            },
            lent,
            hold: hold.map(Duration::from_secs),
        };
        let asked = Instant::now();
        let after = |s: u64| asked + Duration::from_secs(s);
        let held = at(true, Some(30));
        assert!(readable_in_time(&held, asked, asked));
        assert!(readable_in_time(&held, asked, after(19)));
        // 20 s of 30 gone: the READ would have 10 s, a third, left: too late
        assert!(!readable_in_time(&held, asked, after(20)));
        assert!(!readable_in_time(&held, asked, after(45)));
        // a copied chunk, or a lent one that holds no ring slot, is never taken back
        assert!(readable_in_time(&at(false, None), asked, after(3600)));
        assert!(readable_in_time(&at(true, None), asked, after(3600)));
        // a clock read before the ask (never in practice) is in time
        assert!(readable_in_time(&held, after(5), asked));
    }

    #[test]
    fn staged_chunks_are_asked_for_in_batches_of_half_the_depth() {
        // nothing held: ask at once, and go on asking in the same pass until the depth is held
        assert!(may_stage(0, 8, 16, false));
        assert!(may_stage(3, 8, 13, true));
        assert!(!may_stage(8, 8, 8, true), "the server holds no more for us");
        // chunks held: wait until half the depth is free
        assert!(!may_stage(7, 8, 9, false));
        assert!(!may_stage(5, 8, 9, false));
        assert!(may_stage(4, 8, 9, false));
        // unless all that is left fits in what is free
        assert!(may_stage(6, 8, 2, false));
        assert!(!may_stage(7, 8, 2, false));
        // small depths ask for every chunk
        assert!(may_stage(1, 2, 5, false));
        assert!(!may_stage(1, 1, 5, false));
        assert!(may_stage(0, 1, 5, false));
        // an odd depth rounds the batch down
        assert!(may_stage(4, 7, 9, false));
        assert!(!may_stage(5, 7, 9, false));
    }
}
