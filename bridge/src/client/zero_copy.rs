//! Zero-copy fetches into memory the application owns, one range or a batch of many.
//!
//! The application asks the client for a [`LocalBuffer`] (page-aligned host memory registered
//! on the connection's protection domain, for the local side of RDMA only: the server never
//! learns a key to it). A fetch moves the buffer into the call: the direct extents of every
//! range are RDMA-READ straight into it, several work requests in flight. Bounce extents are
//! staged by the server (`Stage`) and READ straight into it as well; from a server that does
//! not stage, they land in a staging buffer first and are copied into it once. The call gives the buffer back when
//! every work request is done; if its future is dropped instead, the buffer stays with the
//! completion queue until the device has finished with it, and is freed then.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use verbs::{
    Access, HostBuffer, Local, Pending, RegMode, RegisteredBuffer, SendOp, SendWr, SinkBuffer,
};

use super::first::First;
use super::window::{ask, bounce_reply, may_stage, piece, staged, Asked, Piece, StagedAt};
use super::{Client, OpenRegion, Rdma, KEEPALIVE};
use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::protocol::{DataPath, Extent, Msg};

mod pulls;

/// Host memory the application owns, registered for zero-copy transfers on one [`Client`]
/// (see [`Client::buffer`]). Only local work requests write it, so its bytes may be borrowed.
#[derive(Debug)]
pub struct LocalBuffer(pub(super) RegisteredBuffer);

impl LocalBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty (never: buffers have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }

    /// The buffer as immutable [`bytes::Bytes`], without a copy: the `Bytes` (and its
    /// clones and slices) own the buffer, which stays registered until the last one drops.
    /// Hand a fetched object to code that speaks `Bytes` (hyper, tonic, a cache).
    pub fn freeze(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for LocalBuffer {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// One range of a batch: `len` bytes at `offset` of `region`, landing at byte `at` of the
/// buffer. Ranges may come from several regions of the same connection.
#[derive(Debug, Clone, Copy)]
pub struct BatchRange<'a> {
    /// The region (opened on the same client).
    pub region: &'a OpenRegion,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Where they land in the buffer.
    pub at: usize,
}

/// A finished batch.
#[derive(Debug)]
pub struct Landed {
    /// The buffer, back.
    pub buffer: LocalBuffer,
    /// One result per range, in order: `Ok` when its bytes are in the buffer, or why nothing of
    /// it moved (outside its region or the buffer, checked before anything is posted).
    pub results: Vec<Result<()>>,
    /// Bytes the NIC landed directly in the buffer.
    pub direct_bytes: u64,
    /// Bytes that came through the server's bounce buffers and one copy here.
    pub bounce_bytes: u64,
    /// Of the bounce bytes, those the server's NIC moved straight between the client's buffers
    /// and the device's memory, with no staging copy on the server (device-private window
    /// units, chunks of an NVMe region lent from its CMB ring), as [`super::TransferReport`]'s.
    pub zero_copy_bytes: u64,
    /// Seconds from the first post to the last completion.
    pub seconds: f64,
    /// Lent chunks whose replies came too late to be read within the server's ring hold
    /// limit, given back unread and asked for again, as [`super::TransferReport`]'s.
    pub reasked_chunks: u64,
}

impl Landed {
    /// A batch of one range as the result of that range: its error, with the buffer, if it
    /// was refused.
    // (the public calls return this very type: the buffer travels back with the error)
    #[allow(clippy::result_large_err)]
    pub(super) fn single(mut self) -> std::result::Result<Landed, Stranded> {
        match self.results.pop() {
            Some(Err(error)) => Err(Stranded {
                error,
                buffer: Some(self.buffer),
            }),
            _ => Ok(self),
        }
    }
}

/// A batch that broke part-way (the connection, the QP, or a stall).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Stranded {
    /// What broke.
    #[source]
    pub error: Error,
    /// The buffer, unless a work request may still write it: then the completion queue keeps
    /// it until the device is done and frees it, so it is never freed under the NIC.
    pub buffer: Option<LocalBuffer>,
}

/// The buffer during a batch: owned between direct phases (bounce data is copied in), shared
/// by the RDMA READs in flight during them.
enum Held {
    Owned(RegisteredBuffer),
    Sink(Arc<SinkBuffer>),
}

enum Flight {
    /// RDMA READ into the buffer (of the piece at this region offset, of this length).
    Direct(Pending, u64, u64),
    /// The server RDMA-WRITEs into a staging buffer; then `len` bytes are copied to `at`.
    Bounce(RegisteredBuffer, u64, usize),
    /// A staged fetch asked for: once the server says where, its bytes are READ straight into
    /// the buffer at `at`.
    Stage { asked: Asked, at: usize },
    /// A lent chunk whose reply came too late to READ in time (`readable_in_time`): given
    /// back unread, and asked for again once no earlier `Stage` awaits its reply.
    Again { asked: Asked, at: usize },
    /// A staged chunk being READ into the buffer: the READ, the chunk (its server slot is
    /// released once the READ completes) and its region offset.
    Pull(Pending, StagedAt, u64),
}

/// Where the batch is: range `i`, `done` bytes of it issued.
struct Cursor {
    i: usize,
    done: u64,
    extents: Vec<Extent>,
}

impl Client {
    /// `len` bytes of page-aligned host memory registered for zero-copy transfers on this
    /// connection (local access only: the server never gets a key to it).
    pub async fn buffer(&mut self, len: usize) -> Result<LocalBuffer> {
        if len == 0 {
            return Err(Error::Config("a buffer needs at least 1 byte".into()));
        }
        let rdma = self.take_rdma(None).await?;
        let b = HostBuffer::new(len).and_then(|b| {
            rdma.qp
                .pd()
                .register(b, Access::LOCAL_WRITE, RegMode::Pinned)
        });
        self.put_back(rdma);
        Ok(LocalBuffer(b?))
    }

    /// What every batch does first: the QP, a check that the buffer is this client's, and one
    /// verdict per range (inside its region, inside the buffer, and for puts, opened for
    /// writing), before anything is posted.
    pub(super) async fn begin_batch(
        &mut self,
        ranges: &[BatchRange<'_>],
        buf: LocalBuffer,
        put: bool,
    ) -> std::result::Result<(Rdma, LocalBuffer, Vec<Result<()>>), Stranded> {
        if put {
            // a first chunk staged by an open for a fetch goes back
            self.release_first();
        }
        let rdma = match self.take_rdma(None).await {
            Ok(r) => r,
            Err(error) => {
                return Err(Stranded {
                    error,
                    buffer: Some(buf),
                })
            }
        };
        if !buf.0.mr().pd().same(rdma.qp.pd()) {
            self.put_back(rdma);
            return Err(Stranded {
                error: Error::Config(
                    "the buffer was registered by another client, or by this one before a \
                     reconnect that put its QP on another device (use this client's buffer())"
                        .into(),
                ),
                buffer: Some(buf),
            });
        }
        let size = buf.len() as u64;
        let results = ranges
            .iter()
            .map(|r| {
                if put && !r.region.write {
                    return Err(Error::Config(format!(
                        "region '{}' was opened for reading: open it with write to put",
                        r.region.info.name
                    )));
                }
                self.check_range(r.region, r.offset, r.len)?;
                match (r.at as u64).checked_add(r.len) {
                    Some(end) if end <= size => Ok(()),
                    _ => Err(Error::Config(format!(
                        "{} bytes at byte {} are outside a buffer of {size} bytes",
                        r.len, r.at
                    ))),
                }
            })
            .collect();
        Ok((rdma, buf, results))
    }

    /// Tell the server what each range moved without it (its CPU never saw those bytes).
    pub(super) async fn report_batch(
        &mut self,
        ranges: &[BatchRange<'_>],
        direct_by_range: &[u64],
        to_region: bool,
        seconds: f64,
        buffer: LocalBuffer,
    ) -> std::result::Result<LocalBuffer, Stranded> {
        for (r, &n) in ranges.iter().zip(direct_by_range) {
            if let Err(error) = self
                .report_direct(r.region, r.offset, n, to_region, seconds)
                .await
            {
                return Err(Stranded {
                    error,
                    buffer: Some(buffer),
                });
            }
        }
        Ok(buffer)
    }

    /// Fetch `len` bytes at `offset` into a new buffer of exactly that size, as
    /// [`bytes::Bytes`] (no copy on the direct path; the buffer is registered for this call, so
    /// a node that fetches often keeps a pool of [`Client::buffer`]s and uses
    /// [`Client::fetch_into`] instead).
    pub async fn fetch_bytes(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        len: u64,
    ) -> Result<bytes::Bytes> {
        let n = usize::try_from(len)
            .map_err(|_| Error::Config(format!("{len} bytes do not fit in memory")))?;
        let buf = self.buffer(n).await?;
        match self.fetch_into(r, offset, len, buf, 0).await {
            Ok(landed) => Ok(landed.buffer.freeze()),
            Err(stranded) => Err(stranded.error),
        }
    }

    /// Fetch `len` bytes at `offset` of `r` into `buf` at byte `at`, without a copy on the
    /// direct path (see the module's documentation).
    pub async fn fetch_into(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        len: u64,
        buf: LocalBuffer,
        at: usize,
    ) -> std::result::Result<Landed, Stranded> {
        self.fetch_many(
            &[BatchRange {
                region: r,
                offset,
                len,
                at,
            }],
            buf,
        )
        .await?
        .single()
    }

    /// Fetch many ranges into one buffer in one pipelined pass: direct pieces of every range
    /// are RDMA READs in flight together (up to the connection's depth), across ranges and
    /// regions. Ranges that do not fit their region or the buffer are refused on their own;
    /// ranges whose destinations overlap get the bytes of either.
    pub async fn fetch_many(
        &mut self,
        ranges: &[BatchRange<'_>],
        buf: LocalBuffer,
    ) -> std::result::Result<Landed, Stranded> {
        self.fetch_many_with_progress(ranges, buf, &mut |_| {})
            .await
    }

    /// [`Client::fetch_many`], calling `progress` with the bytes landed so far (in the buffer,
    /// over every range) each time a piece lands.
    pub async fn fetch_many_with_progress(
        &mut self,
        ranges: &[BatchRange<'_>],
        buf: LocalBuffer,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> std::result::Result<Landed, Stranded> {
        let (mut rdma, buf, results) = self.begin_batch(ranges, buf, false).await?;
        let mut batch = Batch {
            ranges,
            ok: results.iter().map(Result::is_ok).collect(),
            chunk: self.cfg.chunk as u64,
            depth: self.depth(),
            stall: self.cfg.timeout,
            held: Some(Held::Owned(buf.0)),
            window: VecDeque::new(),
            direct_by_range: vec![0; ranges.len()],
            bounce_bytes: 0,
            zero_copy_bytes: 0,
            reasked: 0,
            first: None,
        };
        // the first chunk an open staged, if it is the first piece of the batch's first range:
        // its READ is then that piece's. Any other goes back before the batch asks for its own
        // (held meanwhile, it would leave the batch one slot short of the depth)
        let first = match ranges.first().filter(|_| batch.ok.first() == Some(&true)) {
            Some(r) => self.take_first_for(r.region, r.offset, r.len, batch.chunk),
            None => {
                self.release_first();
                First::Nothing
            }
        };
        batch.reasked = u64::from(matches!(first, First::Late));
        batch.first = first.at();
        let start = Instant::now();
        let run = batch.run(&mut rdma, &mut self.conn, progress).await;
        let seconds = start.elapsed().as_secs_f64();
        if let Some(StagedAt { slot, .. }) = batch.first.take() {
            // the batch ended before that piece
            self.conn.defer(&Msg::Unstage { slot });
        }
        if let Err(error) = run {
            batch.settle(&mut rdma, &mut self.conn).await;
            self.put_back_after(rdma, Some(&error));
            let buffer = match batch.held {
                Some(Held::Owned(b)) => Some(LocalBuffer(b)),
                Some(Held::Sink(s)) => SinkBuffer::into_inner(s).ok().map(LocalBuffer),
                None => None,
            };
            return Err(Stranded { error, buffer });
        }
        self.put_back(rdma);
        if batch.zero_copy_bytes > 0 {
            self.release_lent_now().await;
        }
        let buffer = match batch.held.take().map(Batch::owned) {
            Some(Ok(b)) => b,
            Some(Err(held)) => {
                batch.held = Some(held);
                return Err(Stranded {
                    error: Error::Config(
                        "internal: the batch's buffer is still shared with finished READs".into(),
                    ),
                    buffer: None,
                });
            }
            None => unreachable!("the buffer is held between steps"),
        };
        // the server counts what moved without it (its CPU never saw these bytes)
        let buffer = self
            .report_batch(
                ranges,
                &batch.direct_by_range,
                false,
                seconds,
                LocalBuffer(buffer),
            )
            .await?;
        Ok(Landed {
            buffer,
            results,
            direct_bytes: batch.direct_by_range.iter().sum(),
            bounce_bytes: batch.bounce_bytes,
            zero_copy_bytes: batch.zero_copy_bytes,
            seconds,
            reasked_chunks: batch.reasked,
        })
    }
}

/// One batch in progress.
struct Batch<'r, 'a> {
    ranges: &'r [BatchRange<'a>],
    ok: Vec<bool>,
    chunk: u64,
    depth: usize,
    stall: Duration,
    /// None only while it changes hands.
    held: Option<Held>,
    window: VecDeque<Flight>,
    direct_by_range: Vec<u64>,
    bounce_bytes: u64,
    zero_copy_bytes: u64,
    /// Chunks asked for again (see [`Flight::Again`]).
    reasked: u64,
    /// A first chunk staged by an open ([`Client::open_to_fetch`]), the first piece of the
    /// first range, until that piece READs it (if the batch ends before, it goes back).
    first: Option<StagedAt>,
}

impl Batch<'_, '_> {
    /// The next piece to issue (range index, piece, destination), without consuming it.
    fn peek(&self, c: &mut Cursor) -> Result<Option<(usize, Piece, usize)>> {
        loop {
            let Some(r) = self.ranges.get(c.i) else {
                return Ok(None);
            };
            if !self.ok[c.i] || c.done >= r.len {
                c.i += 1;
                c.done = 0;
                if let Some(next) = self.ranges.get(c.i) {
                    c.extents = next.region.info.extents();
                }
                continue;
            }
            let p = piece(
                &c.extents,
                r.offset + c.done,
                r.len - c.done,
                self.chunk,
                r.region.cut(),
            )?;
            return Ok(Some((c.i, p, r.at + c.done as usize)));
        }
    }

    async fn run(
        &mut self,
        rdma: &mut Rdma,
        conn: &mut Conn,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<()> {
        let mut landed = 0u64;
        let mut c = Cursor {
            i: 0,
            done: 0,
            extents: self
                .ranges
                .first()
                .map(|r| r.region.info.extents())
                .unwrap_or_default(),
        };
        let mut alive = Instant::now();
        loop {
            let mut asking = false;
            while self.window.len() < self.depth {
                let Some((i, p, dst)) = self.peek(&mut c)? else {
                    break;
                };
                let region = self.ranges[i].region;
                if p.path == DataPath::Direct {
                    // READs share the buffer: no bounce copy may be pending into it
                    if !self.share_with_reads() {
                        break;
                    }
                    let Some(Held::Sink(sink)) = &self.held else {
                        unreachable!("share_with_reads")
                    };
                    let wr = SendWr {
                        op: SendOp::Read(region.remote_at(p.pos, p.len)?),
                        local: Local::sink(Arc::clone(sink), dst..dst + p.len as usize)?,
                    };
                    let pending = rdma.qp.post_send(vec![wr])?;
                    self.window.push_back(Flight::Direct(pending, p.pos, p.len));
                    self.direct_by_range[i] += p.len;
                } else if i == 0 && p.pos == self.ranges[0].offset && self.first.is_some() {
                    // the first range's first piece, staged by the open (`open_to_fetch`) and
                    // cut as this one: READ it now, no `Stage` to ask
                    if !self.share_with_reads() {
                        break;
                    }
                    let (Some(at), Some(Held::Sink(sink))) = (self.first.take(), &self.held) else {
                        unreachable!("share_with_reads, and the first chunk matched")
                    };
                    let wr = SendWr {
                        op: SendOp::Read(at.remote),
                        local: Local::sink(Arc::clone(sink), dst..dst + p.len as usize)?,
                    };
                    let pending = match rdma.qp.post_send(vec![wr]) {
                        Ok(pending) => pending,
                        Err(e) => {
                            conn.defer(&Msg::Unstage { slot: at.slot });
                            return Err(e.into());
                        }
                    };
                    self.window.push_back(Flight::Pull(pending, at, p.pos));
                } else if staged(region, &p, false) {
                    // the server stages the chunk and we READ it straight into the buffer; the
                    // `Stage`s of a batch go out together (see `may_stage`)
                    let cap = (region.pull_depth as usize).min(self.depth);
                    let left = self.chunks_left(&c, region.bounce_chunk);
                    if !may_stage(self.pulls(), cap, left, asking) || !self.share_with_reads() {
                        break;
                    }
                    asking = true;
                    let asked = ask(
                        conn,
                        Asked {
                            handle: region.handle,
                            pos: p.pos,
                            len: p.len,
                            at: Instant::now(),
                            again: 0,
                        },
                    );
                    self.window.push_back(Flight::Stage { asked, at: dst });
                } else {
                    // copies need the buffer to themselves: no READ may be in flight
                    if !self.take_back() {
                        break;
                    }
                    let staging = rdma.take(p.path, false, self.chunk as usize)?;
                    conn.send(&Msg::Bounce {
                        handle: region.handle,
                        offset: p.pos,
                        len: p.len,
                        to_region: false,
                        addr: staging.addr(),
                        rkey: staging.mr().rkey(),
                    })
                    .await?;
                    self.window.push_back(Flight::Bounce(staging, p.len, dst));
                }
                c.done += p.len;
            }
            if asking {
                conn.send_deferred().await?;
            }
            if self.awaits_replies() || self.asks_again() {
                self.start_pulls(rdma, conn, true).await?;
            }
            let Some(front) = self.window.pop_front() else {
                if self.peek(&mut c)?.is_none() {
                    return Ok(());
                }
                // nothing in flight, so the buffer could change hands: it did not
                return Err(Error::Config(
                    "internal: the batch's buffer is still shared with finished READs".into(),
                ));
            };
            match front {
                Flight::Direct(p, pos, len) => {
                    self.land(rdma, conn, p, None, pos).await?;
                    landed += len;
                }
                Flight::Pull(p, at, pos) => {
                    self.land(rdma, conn, p, Some(at), pos).await?;
                    self.bounce_bytes += at.remote.len;
                    self.zero_copy_bytes += at.zero_copy();
                    landed += at.remote.len;
                }
                Flight::Stage { .. } | Flight::Again { .. } => {
                    return Err(Error::Config(
                        "internal: a staged fetch was not started before its turn".into(),
                    ));
                }
                Flight::Bounce(staging, n, dst) => {
                    let res = bounce_reply(conn, self.stall, n).await;
                    let copied = res.and_then(|zero_copy| {
                        let Some(Held::Owned(b)) = &mut self.held else {
                            unreachable!("bounce pieces are issued only while the buffer is owned")
                        };
                        // the server may write the staging buffer at any time: copied out
                        staging.read_at(0, &mut b.as_mut_slice()[dst..dst + n as usize])?;
                        Ok(zero_copy)
                    });
                    rdma.pools.give(staging);
                    self.zero_copy_bytes += copied?;
                    self.bounce_bytes += n;
                    landed += n;
                }
            }
            progress(landed);
            if alive.elapsed() >= KEEPALIVE {
                conn.send(&Msg::KeepAlive).await?;
                alive = Instant::now();
            }
        }
    }

    /// Chunks of `chunk` bytes the batch has still to issue from the cursor on (direct bytes
    /// counted as well: an upper bound), for the staging batches (`may_stage`).
    fn chunks_left(&self, c: &Cursor, chunk: u64) -> usize {
        let chunk = chunk.max(1);
        let here = self
            .ranges
            .get(c.i)
            .map_or(0, |r| r.len.saturating_sub(c.done).div_ceil(chunk));
        let later: u64 = self.ranges[(c.i + 1).min(self.ranges.len())..]
            .iter()
            .map(|r| r.len.div_ceil(chunk))
            .sum();
        usize::try_from(here + later).unwrap_or(usize::MAX)
    }

    /// Share the buffer with READs; false while bounce copies into it are pending.
    fn share_with_reads(&mut self) -> bool {
        match self.held.take() {
            Some(Held::Owned(b)) if self.window.is_empty() => {
                self.held = Some(Held::Sink(SinkBuffer::new(b)));
                true
            }
            h => {
                let shared = matches!(h, Some(Held::Sink(_)));
                self.held = h;
                shared
            }
        }
    }

    /// Take the buffer back from the READs; false while any is in flight.
    fn take_back(&mut self) -> bool {
        match self.held.take() {
            Some(Held::Sink(s)) if self.window.is_empty() => match Batch::owned(Held::Sink(s)) {
                Ok(b) => {
                    self.held = Some(Held::Owned(b));
                    true
                }
                Err(h) => {
                    self.held = Some(h);
                    false
                }
            },
            h => {
                let owned = matches!(h, Some(Held::Owned(_)));
                self.held = h;
                owned
            }
        }
    }

    /// The buffer itself, once no READ holds it.
    fn owned(h: Held) -> std::result::Result<RegisteredBuffer, Held> {
        match h {
            Held::Owned(b) => Ok(b),
            Held::Sink(s) => SinkBuffer::into_inner(s).map_err(Held::Sink),
        }
    }
}
