//! The bounce pipeline: a ring of registered host staging buffers per connection. For a fetch
//! the provider's copy engine fills a buffer and the server RDMA-WRITEs it to the client (when
//! the client does not stage its fetches: see `stage`); for a put the server RDMA-READs the
//! client's buffer and copies it into the region. Up to
//! `bounce_depth` requests are in flight; their replies go out in request order.
//!
//! Device-private regions whose window mappings a canary proved go further: windowed units
//! move by RDMA straight between the client and the window MR (zero-copy), the others through
//! the staging buffer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use peermem::canary::{register_mode, DeviceMr};
use peermem::hmm::{Segment, SegmentPath};
use peermem::Provider;
use verbs::{
    Access, HostBuffer, Local, ProtectionDomain, RegMode, RegionRef, RegisteredBuffer, RemoteSlice,
    SendOp, SendWr, SinkBuffer,
};

use super::driver::{count_reply, internal, ConnState};
use super::regions::removed;
use super::ring_put::{Landing, PutRoute};
use super::ring_wait::wait_turn;
use super::session::{Bounce, Catalog, Refusal};
use super::Shared;
use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::metrics::{BounceStage, Direction, XferPath};
use crate::protocol::{ErrorCode, Msg};

/// How long one bounce RDMA operation may take before the connection is declared stalled.
pub(super) const BOUNCE_STALL: Duration = Duration::from_secs(30);

type Completion = verbs::Result<Vec<Local>>;

/// A bounce transfer in flight: the staging buffer is owned by the work request.
pub(super) struct InFlight {
    fut: Pin<Box<dyn Future<Output = Option<Completion>> + Send>>,
    provider: Arc<dyn Provider>,
    offset: u64,
    len: u64,
    to_region: bool,
    /// A device-private transfer with windowed units moved by the NIC itself.
    window: Option<WindowXfer>,
    /// A put's chunk landing in a CMB ring slot (written to the device once it landed), or in
    /// the region's own memory.
    landing: Option<Landing>,
    /// For the metrics: the region and when the request arrived.
    meta: BounceMeta,
}

/// What the metrics need of a bounce request.
#[derive(Debug, Clone, Copy)]
struct BounceMeta {
    region: usize,
    to_region: bool,
    started: Instant,
    /// When its RDMA was posted (None: a device-private transfer, not broken down).
    posted: Option<Instant>,
}

impl InFlight {
    /// A put's chunk landing in a CMB ring slot: its slot comes back once it completes.
    pub(super) fn holds_slot(&self) -> bool {
        matches!(self.landing, Some(Landing::Slot(_)))
    }

    /// A posted bounce transfer of `req`'s range, waited for at most [`BOUNCE_STALL`].
    fn posted(
        pending: verbs::Pending,
        provider: Arc<dyn Provider>,
        req: &Bounce,
        window: Option<WindowXfer>,
        landing: Option<Landing>,
        meta: BounceMeta,
    ) -> InFlight {
        InFlight {
            fut: Box::pin(async move {
                tokio::time::timeout(BOUNCE_STALL, pending.wait())
                    .await
                    .ok()
            }),
            provider,
            offset: req.offset,
            len: req.len,
            to_region: req.to_region,
            window,
            landing,
            meta,
        }
    }
}

/// The segments of a device-private bounce request, some moved by RDMA straight from or to
/// their window MRs (their leases are held until the completion, so invalidation waits for
/// it), the others through the staging buffer.
struct WindowXfer {
    segs: Vec<Segment>,
    /// Per segment: moved by RDMA on a window MR.
    rdma: Vec<bool>,
    staging: Staging,
}

/// A window MR and the offset in it where a piece of a transfer starts.
type WindowPiece = (Arc<DeviceMr>, u64);

/// Where the staged part of a window transfer sits while the work requests hold it.
enum Staging {
    /// Nothing was staged: the buffer waits here.
    Unused(RegisteredBuffer),
    /// A fetch: the NIC reads the staged bytes.
    Shared(Arc<RegisteredBuffer>),
    /// A put: the NIC writes the staged bytes.
    Sink(Arc<SinkBuffer>),
}

/// Take `bytes` of the server-wide staging budget, if that many are left.
pub(super) fn reserve(shared: &Shared, bytes: u64) -> bool {
    shared
        .staging
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
            used.checked_add(bytes)
                .filter(|&n| n <= shared.cfg.max_staging_bytes)
        })
        .is_ok()
}

/// The completion of the oldest bounce in flight (pending forever when none is).
pub(super) async fn next_done(q: &mut std::collections::VecDeque<InFlight>) -> Option<Completion> {
    match q.front_mut() {
        Some(f) => f.fut.as_mut().await,
        None => std::future::pending().await,
    }
}

/// A finished bounce request: its staged bytes as bounce, its window bytes as zero-copy.
fn record_bounce(shared: &Shared, meta: BounceMeta, len: u64, zero_copy: u64) {
    let m = shared.metrics();
    let name = &shared.regions.info(meta.region).name;
    let dir = Direction::of(meta.to_region);
    let staged = len.saturating_sub(zero_copy);
    if staged > 0 || zero_copy == 0 {
        m.transfer(name, dir, XferPath::bounce, staged);
    }
    if zero_copy > 0 {
        m.transfer(name, dir, XferPath::zero_copy, zero_copy);
    }
    m.observe(dir, XferPath::bounce, meta.started.elapsed().as_secs_f64());
}

/// A staged fetch's bytes (the client reads them itself: the server's part ends here).
/// `lent`: read from a CMB ring slot by the NIC, so they never crossed host memory.
pub(super) fn record_staged(
    shared: &Shared,
    region: usize,
    len: u64,
    started: Instant,
    lent: bool,
) {
    record_bounce(
        shared,
        BounceMeta {
            region,
            to_region: false,
            started,
            posted: None,
        },
        len,
        if lent { len } else { 0 },
    );
}

impl ConnState {
    /// Finish every bounce in flight, replying to each in order.
    pub(super) async fn drain(&mut self, shared: &Shared, conn: &mut Conn) -> Result<()> {
        while !self.inflight.is_empty() {
            self.complete_oldest(shared, conn).await?;
        }
        Ok(())
    }

    /// Wait for the oldest bounce in flight (there is one) and send its reply.
    async fn complete_oldest(&mut self, shared: &Shared, conn: &mut Conn) -> Result<()> {
        let mut f = self.inflight.pop_front().expect("checked: work in flight");
        let done = f.fut.as_mut().await;
        let reply = self.complete(shared, f, done);
        conn.send(&reply).await?;
        Ok(())
    }

    /// [`ConnState::finish`], then count what it did in the metrics: the bytes of a finished
    /// bounce, or the error code of its reply.
    pub(super) fn complete(
        &mut self,
        shared: &Shared,
        f: InFlight,
        done: Option<Completion>,
    ) -> Msg {
        let (meta, offset) = (f.meta, f.offset);
        let dir = Direction::of(meta.to_region);
        if let Some(posted) = meta.posted {
            shared
                .metrics()
                .observe_stage(dir, BounceStage::rdma, posted.elapsed().as_secs_f64());
        }
        let copy = Instant::now();
        let reply = self.finish(f, done);
        if meta.posted.is_some() && meta.to_region {
            // a put's copy into the region happens in finish
            shared
                .metrics()
                .observe_stage(dir, BounceStage::copy, copy.elapsed().as_secs_f64());
        }
        if let Msg::BounceDone { len, zero_copy } = &reply {
            record_bounce(shared, meta, *len, *zero_copy);
            if meta.to_region {
                shared.notices.put(super::PutNotice {
                    region: shared.regions.info(meta.region).name.clone(),
                    offset,
                    len: *len,
                    client: self.client.clone(),
                    path: crate::protocol::DataPath::Bounce,
                });
            }
        }
        count_reply(shared.metrics(), &reply);
        reply
    }

    /// A completed bounce: copy into the region for a put, give the buffer back, say how it went.
    fn finish(&mut self, f: InFlight, done: Option<Completion>) -> Msg {
        let op = if f.to_region {
            "RDMA READ of the client's buffer"
        } else {
            "RDMA WRITE to the client's buffer"
        };
        let mut locals = match done {
            Some(Ok(l)) => l,
            Some(Err(e)) => {
                return Msg::error(ErrorCode::Internal, format!("bounce {op} failed: {e}"))
            }
            None => {
                if let Some(qp) = &self.qp {
                    let _ = qp.set_error();
                }
                return Msg::error(
                    ErrorCode::Internal,
                    format!(
                        "bounce {op} neither completed nor failed in {} s: the RDMA transport stalled",
                        BOUNCE_STALL.as_secs()
                    ),
                );
            }
        };
        if let Some(w) = f.window {
            // every work request's references to the staging buffer and the window MRs go
            // back before the buffer is taken back
            drop(locals);
            return self.finish_window(&f.provider, f.offset, f.len, f.to_region, w);
        }
        if let Some(landing) = f.landing {
            drop(locals);
            let landed = match landing {
                // the chunk landed where it belongs
                Landing::InPlace(_) => Ok(()),
                // the chunk landed in the ring slot: the device takes it from there (the slot
                // goes back to the ring when the last reference, this one, is dropped)
                Landing::Slot(slot) => {
                    off_workers(&*f.provider, || slot.commit(&*f.provider, f.offset))
                }
            };
            return match landed {
                Ok(()) => Msg::BounceDone {
                    len: f.len,
                    zero_copy: f.len,
                },
                Err(e) => Msg::error(
                    copy_error_code(&e),
                    format!(
                        "writing {} bytes into the region at {} from its CMB ring: {e}",
                        f.len, f.offset
                    ),
                ),
            };
        }
        let Some(buf) = locals.pop().and_then(Local::into_owned) else {
            return Msg::error(ErrorCode::Internal, "bounce staging buffer lost");
        };
        let n = f.len as usize;
        let res = if f.to_region {
            off_workers(&*f.provider, || {
                f.provider.copy_in(f.offset, &buf.as_slice()[..n])
            })
        } else {
            Ok(())
        };
        self.ring.push(buf);
        match res {
            Ok(()) => Msg::BounceDone {
                len: f.len,
                zero_copy: 0,
            },
            Err(e) => Msg::error(
                copy_error_code(&e),
                format!(
                    "copying {} bytes into the region at {}: {e}",
                    f.len, f.offset
                ),
            ),
        }
    }

    /// A completed device-private transfer: take the staging buffer back, write its staged
    /// segments into the region (a put), count the segments the NIC moved on window MRs (they
    /// fail if the owner invalidated their units meanwhile), release the leases.
    fn finish_window(
        &mut self,
        provider: &Arc<dyn Provider>,
        offset: u64,
        len: u64,
        to_region: bool,
        w: WindowXfer,
    ) -> Msg {
        let WindowXfer {
            segs,
            rdma,
            staging,
        } = w;
        let buf = match staging {
            Staging::Unused(b) => Some(b),
            Staging::Shared(a) => Arc::try_unwrap(a).ok(),
            Staging::Sink(a) => SinkBuffer::into_inner(a).ok(),
        };
        let Some(buf) = buf else {
            return Msg::error(
                ErrorCode::Internal,
                "bounce staging buffer still in use after its completion",
            );
        };
        let Some(dp) = peermem::hmm::DevicePrivate::of(&**provider) else {
            self.ring.push(buf);
            return Msg::error(ErrorCode::Internal, "not a device-private region");
        };
        let mut zero_copy = 0;
        let mut res = Ok(());
        for (seg, &by_nic) in segs.iter().zip(&rdma) {
            let at = (seg.range.start - offset) as usize;
            let n = (seg.range.end - seg.range.start) as usize;
            res = if by_nic {
                zero_copy += n as u64;
                dp.finish_window_rdma(seg)
            } else if to_region {
                dp.write_segment(seg, &buf.as_slice()[at..at + n])
            } else {
                Ok(())
            };
            if res.is_err() {
                break;
            }
        }
        self.ring.push(buf);
        drop(segs);
        match res {
            Ok(()) => Msg::BounceDone { len, zero_copy },
            Err(e) => Msg::error(
                copy_error_code(&e),
                format!(
                    "{} {len} bytes of the region at {offset}: {e}",
                    if to_region { "writing" } else { "reading" }
                ),
            ),
        }
    }

    /// Drop MRs of window mappings the region no longer holds (evicted or invalidated).
    pub(super) fn sweep_window_mrs(&mut self) {
        self.window_mrs
            .retain(|_, mr| Arc::strong_count(mr.provider()) > 1);
    }

    /// This connection's MR of a window mapping, registered with the proved strategy on first
    /// use; None when the registration fails (the segment is then copied by the CPU).
    fn window_mr(
        &mut self,
        pd: &ProtectionDomain,
        mapping: &Arc<dyn Provider>,
        mode: RegMode,
    ) -> Option<Arc<DeviceMr>> {
        let key = Arc::as_ptr(mapping) as *const () as usize;
        if let Some(mr) = self.window_mrs.get(&key) {
            return Some(Arc::clone(mr));
        }
        match register_mode(pd, mapping, 0..mapping.len(), Access::LOCAL_WRITE, mode) {
            Ok(mr) => {
                let mr = Arc::new(mr);
                self.window_mrs.insert(key, Arc::clone(&mr));
                Some(mr)
            }
            Err(e) => {
                tracing::warn!(mapping = %mapping.describe(), %mode, "no MR of a window mapping, the CPU copies it: {e}");
                None
            }
        }
    }

    /// Start a bounce request of a device-private region whose window MRs work: windowed
    /// segments go by RDMA straight from (fetch) or to (put) the window MR, the others through
    /// `buf`. Consecutive staged segments share one work request.
    fn start_window(
        &mut self,
        shared: &Shared,
        req: &Bounce,
        provider: &Arc<dyn Provider>,
        mode: RegMode,
        mut buf: RegisteredBuffer,
        meta: BounceMeta,
    ) -> std::result::Result<(), Refusal> {
        let name = &shared.regions.info(req.region).name;
        let dp = peermem::hmm::DevicePrivate::of(&**provider).expect("checked by the caller");
        let segs = match dp.plan(req.offset, req.len) {
            Ok(s) => s,
            Err(e) => {
                self.ring.push(buf);
                return Err((copy_error_code(&e), format!("region '{name}': {e}")));
            }
        };
        let pd = match self.pd(shared) {
            Ok(p) => p,
            Err(e) => {
                self.ring.push(buf);
                return Err(e);
            }
        };
        self.sweep_window_mrs();
        let qp = self.qp.clone().expect("checked by the caller");
        // one work request per windowed segment and per run of staged ones, within the room
        // left on the send queue (else everything is staged: one work request)
        let room = (qp.max_send_wr() as usize).saturating_sub(qp.outstanding().0);
        let windowed = segs
            .iter()
            .filter(|s| matches!(s.path, SegmentPath::Window(..)))
            .count();
        let mut mrs: Vec<Option<Arc<DeviceMr>>> = Vec::with_capacity(segs.len());
        for seg in &segs {
            mrs.push(match &seg.path {
                SegmentPath::Window(lease, _) if 2 * windowed < room => {
                    self.window_mr(&pd, lease, mode)
                }
                _ => None,
            });
        }
        if !req.to_region {
            for (seg, mr) in segs.iter().zip(&mrs) {
                if mr.is_some() {
                    continue;
                }
                let at = (seg.range.start - req.offset) as usize;
                let n = (seg.range.end - seg.range.start) as usize;
                if let Err(e) = dp.read_segment(seg, &mut buf.as_mut_slice()[at..at + n]) {
                    self.ring.push(buf);
                    return Err((
                        copy_error_code(&e),
                        format!(
                            "copying {n} bytes out of region '{name}' at {}: {e}",
                            seg.range.start
                        ),
                    ));
                }
            }
        }
        let staging = match (mrs.iter().any(Option::is_none), req.to_region) {
            (false, _) => Staging::Unused(buf),
            (true, false) => Staging::Shared(Arc::new(buf)),
            (true, true) => Staging::Sink(SinkBuffer::new(buf)),
        };
        // pieces: (range in the request, window MR and offset in it)
        let mut pieces: Vec<(std::ops::Range<u64>, Option<WindowPiece>)> = Vec::new();
        for (seg, mr) in segs.iter().zip(&mrs) {
            let r = seg.range.start - req.offset..seg.range.end - req.offset;
            match (mr, &seg.path, pieces.last_mut()) {
                (Some(mr), SegmentPath::Window(_, off), _) => {
                    pieces.push((r, Some((Arc::clone(mr), off - mr.start()))))
                }
                (None, _, Some((prev, None))) if prev.end == r.start => prev.end = r.end,
                _ => pieces.push((r, None)),
            }
        }
        let mut wrs = Vec::with_capacity(pieces.len());
        for (r, mr) in pieces {
            let n = (r.end - r.start) as usize;
            let remote = RemoteSlice {
                addr: req.addr,
                rkey: req.rkey,
                len: req.len,
            }
            .slice(r.start, r.end - r.start)
            .map_err(internal)?;
            let local = match (mr, &staging) {
                (Some((mr, off)), _) => {
                    let mr: Arc<dyn RegionRef> = mr;
                    Local::region(mr, off as usize..off as usize + n)
                }
                (None, Staging::Shared(b)) => {
                    Local::shared(Arc::clone(b), r.start as usize..r.end as usize)
                }
                (None, Staging::Sink(b)) => {
                    Local::sink(Arc::clone(b), r.start as usize..r.end as usize)
                }
                (None, Staging::Unused(_)) => unreachable!("a staged piece has a staging buffer"),
            }
            .map_err(internal)?;
            wrs.push(SendWr {
                op: if req.to_region {
                    SendOp::Read(remote)
                } else {
                    SendOp::Write(remote)
                },
                local,
            });
        }
        let pending = qp
            .post_send(wrs)
            .map_err(|e| internal(format!("posting the bounce transfer: {e}")))?;
        let rdma = mrs.iter().map(Option::is_some).collect();
        self.inflight.push_back(InFlight::posted(
            pending,
            Arc::clone(provider),
            req,
            Some(WindowXfer {
                segs,
                rdma,
                staging,
            }),
            None,
            meta,
        ));
        Ok(())
    }

    /// Start one bounce request the session accepted. The outer error is the connection's;
    /// the inner one is a refusal to send back.
    pub(super) async fn start_bounce(
        &mut self,
        shared: &Shared,
        conn: &mut Conn,
        req: Bounce,
    ) -> Result<std::result::Result<(), Refusal>> {
        let mut meta = BounceMeta {
            region: req.region,
            to_region: req.to_region,
            started: Instant::now(),
            posted: None,
        };
        let r = shared.regions.get(req.region);
        if r.removed.load(Ordering::SeqCst) {
            return Ok(Err(removed(&r.info.name)));
        }
        let provider = match r.provider() {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        // a put of whole blocks into an `nvme` region whose CMB ring the NIC lands READs in,
        // or one into memory the NIC lands READs in from page starts
        let mut line = None;
        loop {
            match self.put_slot(shared, r, &provider, &req) {
                PutRoute::Lands(landing) => {
                    if line.is_some() {
                        shared.metrics().ring_wait(&r.info.name, true);
                    }
                    return Ok(self.start_landing(shared, &req, provider, landing, meta));
                }
                PutRoute::Wait => self.complete_oldest(shared, conn).await?,
                PutRoute::Queue(q) if wait_turn(&mut line, &q, self.id).await => {}
                PutRoute::Queue(_) | PutRoute::Host => break,
            }
        }
        // (leaving the line, if it waited in one: then it waited in vain)
        if line.take().is_some() {
            shared.metrics().ring_wait(&r.info.name, false);
        }
        // a staging buffer: a free one, a new one while the ring is not full, or the oldest
        // in-flight one once it completes
        let mut buf = loop {
            if let Some(b) = self.ring.pop() {
                break b;
            }
            let chunk = shared.cfg.bounce_chunk as u64;
            if self.inflight.len() < shared.cfg.bounce_depth && reserve(shared, chunk) {
                let pd = match self.pd(shared) {
                    Ok(p) => p,
                    Err(e) => {
                        shared.staging.fetch_sub(chunk, Ordering::SeqCst);
                        return Ok(Err(e));
                    }
                };
                let b = HostBuffer::new(shared.cfg.bounce_chunk)
                    .and_then(|m| pd.register(m, Access::LOCAL_WRITE, RegMode::Pinned));
                match b {
                    Ok(b) => {
                        self.staging_bytes += chunk;
                        shared.metrics().staging_bytes.inc_by(chunk as i64);
                        break b;
                    }
                    Err(e) => {
                        shared.staging.fetch_sub(chunk, Ordering::SeqCst);
                        return Ok(Err(internal(format!("staging buffer: {e}"))));
                    }
                }
            }
            if self.inflight.is_empty() {
                // the server-wide budget is spent by other connections
                return Ok(Err((
                    ErrorCode::Busy,
                    format!(
                        "the server's staging budget ({} bytes of pinned bounce buffers) is in \
                         use by other clients; retry shortly",
                        shared.cfg.max_staging_bytes
                    ),
                )));
            }
            self.complete_oldest(shared, conn).await?;
        };
        // the window units' strategy was proved on the region's own device
        if let Some(mode) = r
            .window_mode
            .filter(|_| r.nic == self.nic)
            .filter(|_| peermem::hmm::DevicePrivate::of(&*provider).is_some())
        {
            return Ok(self.start_window(shared, &req, &provider, mode, buf, meta));
        }
        let n = req.len as usize;
        let remote = RemoteSlice {
            addr: req.addr,
            rkey: req.rkey,
            len: req.len,
        };
        let dir = Direction::of(req.to_region);
        let m = shared.metrics();
        m.observe_stage(
            dir,
            BounceStage::queued,
            meta.started.elapsed().as_secs_f64(),
        );
        let op = if req.to_region {
            SendOp::Read(remote)
        } else {
            let copy = Instant::now();
            let copied = off_workers(&*provider, || {
                provider.copy_out(req.offset, &mut buf.as_mut_slice()[..n])
            });
            m.observe_stage(dir, BounceStage::copy, copy.elapsed().as_secs_f64());
            if let Err(e) = copied {
                self.ring.push(buf);
                let code = copy_error_code(&e);
                return Ok(Err((
                    code,
                    format!(
                        "copying {n} bytes out of region '{}' at {}: {e}",
                        r.info.name, req.offset
                    ),
                )));
            }
            SendOp::Write(remote)
        };
        let qp = self.qp.as_ref().expect("checked above");
        let local = Local::owned_range(buf, 0..n).map_err(Error::Verbs)?;
        meta.posted = Some(Instant::now());
        let pending = match qp.post_send(vec![SendWr { op, local }]) {
            Ok(p) => p,
            Err(e) => return Ok(Err(internal(format!("posting the bounce transfer: {e}")))),
        };
        self.inflight
            .push_back(InFlight::posted(pending, provider, &req, None, None, meta));
        Ok(Ok(()))
    }

    /// Start a put whose chunk lands in a CMB ring slot or in place: an RDMA READ of the
    /// client's buffer into it (see [`ConnState::put_slot`]).
    fn start_landing(
        &mut self,
        shared: &Shared,
        req: &Bounce,
        provider: Arc<dyn Provider>,
        landing: Landing,
        mut meta: BounceMeta,
    ) -> std::result::Result<(), Refusal> {
        let remote = RemoteSlice {
            addr: req.addr,
            rkey: req.rkey,
            len: req.len,
        };
        shared.metrics().observe_stage(
            Direction::of(true),
            BounceStage::queued,
            meta.started.elapsed().as_secs_f64(),
        );
        let local = landing.local(req).map_err(internal)?;
        let Some(qp) = self.qp.as_ref() else {
            return Err(internal("a landing put on a connection without a QP"));
        };
        meta.posted = Some(Instant::now());
        let pending = qp
            .post_send(vec![SendWr {
                op: SendOp::Read(remote),
                local,
            }])
            .map_err(|e| internal(format!("posting the bounce transfer: {e}")))?;
        self.inflight.push_back(InFlight::posted(
            pending,
            provider,
            req,
            None,
            Some(landing),
            meta,
        ));
        Ok(())
    }
}

/// Run `f` on region `region`'s memory on a blocking thread (copy engines and `fdatasync` may
/// take long); a failure is refused with its copy-engine code and `doing` (what was done, for
/// the message).
pub(super) async fn on_memory<R: Send + 'static>(
    shared: &Shared,
    region: usize,
    doing: impl FnOnce() -> String,
    f: impl FnOnce(&dyn Provider) -> std::result::Result<R, peermem::Error> + Send + 'static,
) -> std::result::Result<R, Refusal> {
    let provider = shared.regions.get(region).provider()?;
    tokio::task::spawn_blocking(move || f(&*provider))
        .await
        .map_err(internal)?
        .map_err(|e| (copy_error_code(&e), format!("{}: {e}", doing())))
}

/// Run `f`, a copy of `p`'s bytes, where a wait in it holds up no other connection: a copy that
/// may wait on a device ([`Provider::copies_wait`]: direct I/O, a mapped file's page faults)
/// runs under `tokio::task::block_in_place` on a multi-threaded runtime, which hands this
/// worker's other tasks to another thread first. Memory copies, and any copy on a
/// current-thread runtime (where `block_in_place` is not allowed), run as they are.
pub(super) fn off_workers<R>(p: &dyn Provider, f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let multi =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if multi && p.copies_wait() {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// The error code for a failed copy engine: the owner's invalidation, or a server failure.
pub(super) fn copy_error_code(e: &peermem::Error) -> ErrorCode {
    match e {
        peermem::Error::Invalidated(_) => ErrorCode::Invalidated,
        peermem::Error::Verbs(verbs::Error::FileShrank { .. }) => ErrorCode::Truncated,
        _ => ErrorCode::Internal,
    }
}

#[cfg(test)]
mod tests;
