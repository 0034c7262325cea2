//! The client: connect, authenticate, list and open regions, and move bytes with one-sided
//! RDMA READ/WRITE in chunks, many in flight.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use verbs::{Context, Local, RemoteSlice};

use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::protocol::{DataPath, Extent, Msg, RegionInfo, Span, VERSION};

mod checksum;
mod config;
mod first;
mod nic;
mod rdma;
mod report;
mod resuming;
mod retries;
mod striped;
mod tcp;
mod wait;
mod window;
mod zero_copy;
mod zero_copy_put;
use checksum::Checksum;
pub use config::{ClientConfig, Transport, DEFAULT_INLINE};
pub use first::OpenFor;
use rdma::Rdma;
pub use report::TransferReport;
use report::{millis, report};
pub use resuming::Resumed;
pub use retries::Retries;
pub use striped::{SinkFor, SourceFor, Striped};
use wait::await_or_stall;
use window::{
    bounce_reply, issue, land, may_stage, more_input, overflow_error, piece, pull_staged, pulls,
    read_full, settle, staged, start_pulls, Arrived, Cut, Slot,
};
pub use zero_copy::{BatchRange, Landed, LocalBuffer, Stranded};

/// How often a long transfer tells the server the client is still there (well under the
/// server's idle timeout).
const KEEPALIVE: Duration = Duration::from_secs(30);

/// A region opened on this connection.
#[derive(Debug, Clone)]
pub struct OpenRegion {
    /// Handle for control requests.
    pub handle: u32,
    /// The connection it was opened on ([`Client::connection`]): handles are numbered per
    /// connection, so one from another client, or from before a [`Client::reconnect`], is
    /// refused.
    pub connection: u64,
    /// What the server says about it.
    pub info: RegionInfo,
    /// Where one-sided operations go (the direct extents; `len` is the bytes the rkey covers).
    /// With several [`OpenRegion::segments`], the first one's.
    pub remote: RemoteSlice,
    /// The direct part's MRs when the server registered it as more than one (empty: `remote`
    /// covers it all).
    pub segments: Vec<crate::protocol::Segment>,
    /// Largest bounce request the server accepts.
    pub bounce_chunk: u64,
    /// Where the server's NIC reaches the region's staging only from the start of a block or
    /// page: a bounce piece that starts partway into a multiple of this many bytes ends at the
    /// next one (0: no such cut; see [`crate::protocol::Msg::Opened`]).
    pub piece_align: u64,
    /// How many staged chunks this client may hold at once: its bounce fetches are staged by
    /// the server and read by us (0: the server writes them into our buffers).
    pub pull_depth: u32,
    /// Whether it was opened for writing.
    pub write: bool,
    /// Milliseconds from sending the `Open` to its reply: the server's registration of the
    /// region (or a window over it) and, after [`Client::open_to_fetch`], the staging of the
    /// fetch's first chunk. A fetch's own clock starts after it, so a comparison of the
    /// direct and bounce paths that wants all of each path's set-up adds it.
    pub open_ms: f64,
}

impl OpenRegion {
    /// Where this region's bounce pieces end (the alignment only where it divides the bounce
    /// chunk: one that does not would cut a piece at every multiple of the chunk).
    pub(crate) fn cut(&self) -> Cut {
        let align = self.piece_align;
        Cut {
            bounce_chunk: self.bounce_chunk,
            align: if align > 0 && self.bounce_chunk % align == 0 {
                align
            } else {
                0
            },
        }
    }

    /// Where the region's bytes `[pos, pos + len)` are for a one-sided operation: a slice of
    /// the one MR, or of the segment that holds them (a range across two segments is
    /// refused: the extents are split at their boundaries).
    pub fn remote_at(&self, pos: u64, len: u64) -> Result<RemoteSlice> {
        if self.segments.is_empty() {
            return Ok(self.remote.slice(pos, len)?);
        }
        let s = self
            .segments
            .iter()
            .find(|s| s.offset <= pos && pos - s.offset < s.len)
            .ok_or_else(|| {
                Error::Config(format!(
                    "offset {pos} of region '{}' is in none of the server's {} segments",
                    self.info.name,
                    self.segments.len()
                ))
            })?;
        let seg = RemoteSlice {
            addr: s.addr,
            rkey: s.rkey,
            len: s.len,
        };
        Ok(seg.slice(pos - s.offset, len)?)
    }

    /// The extents a put follows: the region's own, except that a region that holds data (a
    /// file) takes puts through the server only, so that they are durable when acknowledged.
    pub(super) fn put_extents(&self) -> Vec<Extent> {
        if self.info.server_puts {
            vec![Extent {
                offset: 0,
                len: self.info.size,
                path: DataPath::Bounce,
            }]
        } else {
            self.info.extents()
        }
    }
}

/// A connected, authenticated client.
pub struct Client {
    conn: Conn,
    cfg: ClientConfig,
    server: String,
    max_outstanding: u32,
    rdma: Option<Rdma>,
    /// This connection's number in the process ([`Client::connection`]).
    connection: u64,
    /// The handles open on this connection: a transfer through any other (closed, or another
    /// client's) is refused here, before a READ through a dead window takes the QP down.
    open: std::collections::HashSet<u32>,
    /// Why this client moves bytes over TCP (None: over RDMA, or not decided yet).
    tcp: Option<String>,
    /// The device opened to decide the transport, kept for the QP (opened once).
    device: Option<Context>,
    /// The server's devices, when it serves from several.
    nics: Vec<crate::protocol::ServerNic>,
    /// The server device our QP is on (several-device servers).
    qp_nic: Option<String>,
    /// A fetch's first chunk, staged by [`Client::open_to_fetch`] and not read yet.
    first: Option<first::FirstStaged>,
    /// What an earlier connection registered, for the next QP ([`Client::reconnect`]).
    kept: Option<rdma::Kept>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.server)
            .field("addr", &self.cfg.addr)
            .finish()
    }
}

/// The mismatch of a transfer's CRC-32C (`client`) with the server's checksum of its range
/// (`offset`, `len`) of region `name`: what a verified `op` ("fetch", "put") says.
pub(super) fn mismatch(
    op: &str,
    name: &str,
    (offset, len): (u64, u64),
    client: u32,
    server: u32,
) -> Error {
    Error::Mismatch {
        what: format!("{op} of {len} bytes at offset {offset} of '{name}'"),
        client,
        server,
    }
}

pub(super) fn reply_err(peer: &str, m: Msg, want: &'static str) -> Error {
    match m {
        Msg::Error { code, message } => Error::Server { code, message },
        other => Error::Unexpected {
            peer: peer.to_string(),
            got: other.kind(),
            want,
        },
    }
}

impl Client {
    /// Connect and authenticate.
    pub async fn connect(cfg: ClientConfig) -> Result<Client> {
        if cfg.chunk == 0 || cfg.chunk > (1 << 30) {
            return Err(Error::Config(format!(
                "chunk size must be 1 byte to 1 GiB, not {}",
                cfg.chunk
            )));
        }
        if cfg.depth == 0 {
            return Err(Error::Config("depth must be at least 1".into()));
        }
        let stream = tokio::time::timeout(cfg.timeout, tokio::net::TcpStream::connect(&cfg.addr))
            .await
            .map_err(|_| Error::Timeout {
                peer: cfg.addr.clone(),
                what: "the server to accept the TCP connection",
                secs: cfg.timeout.as_secs(),
            })?
            .map_err(|e| Error::Connect {
                addr: cfg.addr.clone(),
                source: e,
            })?;
        let mut conn = Conn::new(stream, cfg.addr.clone());
        conn.send(&Msg::Hello {
            version: VERSION,
            token: cfg.token.clone(),
            client: format!(
                "p2p-rdma {} pid {}",
                env!("CARGO_PKG_VERSION"),
                std::process::id()
            ),
        })
        .await?;
        match conn.recv(Some(cfg.timeout), "welcome").await? {
            Msg::Welcome {
                version,
                server,
                max_outstanding,
                nics,
            } => {
                if version != VERSION {
                    return Err(Error::Version {
                        peer: cfg.addr.clone(),
                        theirs: version,
                        ours: VERSION,
                    });
                }
                tracing::info!(server, max_outstanding, "connected");
                Ok(Client {
                    conn,
                    cfg,
                    server,
                    max_outstanding,
                    rdma: None,
                    connection: rdma::next_connection(),
                    open: std::collections::HashSet::new(),
                    tcp: None,
                    device: None,
                    nics,
                    qp_nic: None,
                    first: None,
                    kept: None,
                })
            }
            other => Err(reply_err(&cfg.addr, other, "welcome")),
        }
    }

    /// The server's self-description.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The control address this client connected to (`HOST:PORT`, as configured).
    pub fn addr(&self) -> &str {
        &self.cfg.addr
    }

    /// The inline room of this client's QP: puts of at most this many bytes into a direct
    /// extent travel in the work request. None before the first RDMA transfer creates the QP
    /// (and over TCP); 0 when the device refused the room asked for
    /// ([`ClientConfig::inline`]).
    pub fn inline_room(&self) -> Option<u32> {
        self.rdma.as_ref().map(|r| r.inline)
    }

    async fn request(&mut self, m: &Msg, want: &'static str) -> Result<Msg> {
        self.conn.send(m).await?;
        self.conn.recv(Some(self.cfg.timeout), want).await
    }

    /// The regions the server offers.
    pub async fn list(&mut self) -> Result<Vec<RegionInfo>> {
        match self.request(&Msg::List, "regions").await? {
            Msg::Regions { regions } => Ok(regions),
            other => Err(reply_err(&self.conn.peer, other, "regions")),
        }
    }

    /// Open a region (for writing if `write`). Our QP is connected first: a server that
    /// isolates clients with memory windows binds this handle's window on it.
    pub async fn open(&mut self, region: &str, write: bool) -> Result<OpenRegion> {
        self.open_with(region, write, None).await
    }

    /// [`Client::open`], asking the server to stage the first piece of `first` (a fetch's
    /// range) with the open ([`Client::open_to_fetch`]).
    async fn open_with(
        &mut self,
        region: &str,
        write: bool,
        first: Option<Span>,
    ) -> Result<OpenRegion> {
        if self.rdma.is_none() && !self.over_tcp() {
            match self.take_rdma(Some(region)).await {
                Ok(rdma) => self.put_back(rdma),
                // the server refused our QP (a device it does not serve from): say it now
                Err(e @ Error::Server { .. }) => return Err(e),
                // the transfer will say so again; a server may still list, open and checksum
                Err(e) => tracing::debug!(error = %e, "no QP before the open"),
            }
        }
        // a chunk staged by an earlier open and never read: its slot goes back with this open
        self.release_first();
        // only a QP can read a staged chunk
        let first = first.filter(|_| !write && self.rdma.is_some());
        let m = Msg::Open {
            region: region.to_string(),
            write,
            first,
        };
        let asked = Instant::now();
        match self.request(&m, "opened").await? {
            Msg::Opened {
                handle,
                info,
                addr,
                rkey,
                len,
                bounce_chunk,
                piece_align,
                segments,
                pull_depth,
                first: staged,
            } => {
                let open_ms = millis(asked.elapsed());
                self.keep_first(handle, first, staged, pull_depth, asked);
                self.open.insert(handle);
                Ok(OpenRegion {
                    handle,
                    connection: self.connection,
                    info,
                    remote: RemoteSlice { addr, rkey, len },
                    segments,
                    bounce_chunk: if bounce_chunk == 0 {
                        1 << 20
                    } else {
                        bounce_chunk
                    },
                    piece_align: piece_align.into(),
                    pull_depth,
                    write,
                    open_ms,
                })
            }
            other => Err(reply_err(&self.conn.peer, other, "opened")),
        }
    }

    /// Release a region's handle (its rkey dies on the server).
    pub async fn close(&mut self, r: &OpenRegion) -> Result<()> {
        self.check_open(r)?;
        self.release_first();
        match self
            .request(&Msg::Close { handle: r.handle }, "closed")
            .await?
        {
            Msg::Closed { .. } => {
                self.open.remove(&r.handle);
                Ok(())
            }
            other => Err(reply_err(&self.conn.peer, other, "closed")),
        }
    }

    /// Send the releases of a fetch's last staged chunks now, not with our next request:
    /// chunks lent from a CMB ring hold its slots, which other clients wait for. The fetch's
    /// bytes are here: a connection that broke since shows at the next request.
    async fn release_lent_now(&mut self) {
        if let Err(e) = self.conn.send_deferred().await {
            tracing::debug!(error = %e, "the last staged chunks' releases were not sent");
        }
    }

    /// Tell the server that `len` bytes from `offset` moved by one-sided RDMA (the direct part
    /// of a region is a prefix, so they are contiguous); its metrics count them. No reply.
    async fn report_direct(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        len: u64,
        to_region: bool,
        seconds: f64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.conn
            .send(&Msg::Transferred {
                handle: r.handle,
                offset,
                len,
                to_region,
                micros: (seconds * 1e6) as u64,
            })
            .await
    }

    /// Ask the server to make `len` bytes at `offset` durable (a file region: `fdatasync`);
    /// a put is acknowledged when this returns.
    pub async fn flush(&mut self, r: &OpenRegion, offset: u64, len: u64) -> Result<()> {
        self.check_open(r)?;
        let m = Msg::Flush {
            handle: r.handle,
            offset,
            len,
        };
        match self.request(&m, "flushed").await? {
            Msg::Flushed { .. } => Ok(()),
            other => Err(reply_err(&self.conn.peer, other, "flushed")),
        }
    }

    /// Compare our CRC-32C of what moved with the server's checksum of the range: whether it
    /// was compared (only a verified transfer sums what it moves).
    async fn verify(
        &mut self,
        r: &OpenRegion,
        op: &str,
        offset: u64,
        len: u64,
        crc: Checksum,
    ) -> Result<bool> {
        let Some(crc) = crc.value() else {
            return Ok(false);
        };
        let server = self.checksum(r, offset, len).await?;
        if server != crc {
            return Err(mismatch(op, &r.info.name, (offset, len), crc, server));
        }
        Ok(true)
    }

    /// Say goodbye and close.
    pub async fn bye(mut self) -> Result<()> {
        self.conn.send(&Msg::Bye).await?;
        self.conn.shutdown().await;
        Ok(())
    }

    /// Bytes per work request or bounce request from now on (the transfer's message size). A
    /// larger value than before replaces the staging buffers on the next transfer.
    pub fn set_chunk(&mut self, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Err(Error::Config(
                "the chunk size must be at least 1 byte".into(),
            ));
        }
        if bytes > self.cfg.chunk {
            if let Some(r) = &mut self.rdma {
                r.pools.clear();
            }
        }
        self.cfg.chunk = bytes;
        Ok(())
    }

    /// Whether `r` is open on this connection: a handle of another connection names another
    /// region here, or none, and its keys work only on that connection's QP.
    fn check_open(&self, r: &OpenRegion) -> Result<()> {
        let why = if r.connection != self.connection {
            "it was opened on another connection (another client's, or this client's before \
             it reconnected)"
        } else if !self.open.contains(&r.handle) {
            "it was closed"
        } else {
            return Ok(());
        };
        Err(Error::Config(format!(
            "region '{}' (handle {}) is not open on this client: {why}; open it again here",
            r.info.name, r.handle
        )))
    }

    /// A transfer's range: through a handle open on this connection, inside its region.
    fn check_range(&self, r: &OpenRegion, offset: u64, len: u64) -> Result<()> {
        self.check_open(r)?;
        match offset.checked_add(len) {
            Some(end) if end <= r.info.size => Ok(()),
            _ => Err(Error::Server {
                code: crate::protocol::ErrorCode::OutOfRange,
                message: format!(
                    "offset {offset} + length {len} is outside region '{}' of {} bytes",
                    r.info.name, r.info.size
                ),
            }),
        }
    }

    /// Fetch `len` bytes at `offset` of the region into `sink`: direct extents with RDMA READ,
    /// bounce extents by asking the server to stage them and RDMA-READing them (or, from a
    /// server that does not stage, to RDMA-WRITE them into our buffers); several of
    /// either in flight. With `verify`, the server's checksum of the range is compared with
    /// the bytes received.
    ///
    /// `progress` is called with the bytes written to `sink` so far, after each write: the
    /// sink gets the range in order, so after a failure it holds exactly the first bytes last
    /// reported. A caller that goes on after a transient error ([`Error::is_transient`],
    /// [`Client::reconnect`], the region opened again) fetches the rest from `offset` plus
    /// that count.
    pub async fn fetch(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        len: u64,
        sink: &mut (dyn Write + Send),
        verify: bool,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<TransferReport> {
        self.check_range(r, offset, len)?;
        if self.over_tcp() {
            return self.fetch_tcp(r, offset, len, sink, verify, progress).await;
        }
        let chunk = self.cfg.chunk as u64;
        let depth = self.depth();
        let stall = self.cfg.timeout;
        // QP and staging buffers are set up once per client: not part of the transfer's time
        let mut rdma = self.take_staged_rdma(len).await?;
        let extents = r.info.extents();
        // the first piece, if the open staged it (`open_to_fetch`); any other chunk it staged
        // goes back
        let first_staged = self.take_first_for(r, offset, len, chunk);
        let mut pre = first_staged.at();
        let start = Instant::now();
        let mut window: VecDeque<Slot> = VecDeque::with_capacity(depth);
        let mut next = 0u64;
        let mut done = 0u64;
        let mut crc = Checksum::new(verify);
        let mut by_path = [0u64; 3];
        let mut alive = Instant::now();
        let mut scratch = Vec::new();
        let mut first = None;
        let mut reasked = u64::from(matches!(first_staged, first::First::Late));
        let result: Result<()> = async {
            loop {
                let mut asking = false;
                while window.len() < depth && next < len {
                    let p = piece(&extents, offset + next, len - next, chunk, r.cut())?;
                    // staged even when the fetch is one piece: the server's WRITE of a 1 MiB chunk took
                    // 343 ms between the lab hosts, and a one-piece fetch through it ran at 0.55x
                    // a direct fetch, against 0.75x staged
                    let pull = staged(r, &p, false);
                    if let Some(at) = pre.take().filter(|_| pull) {
                        // staged by the open: READ it now, no `Stage` to ask
                        let buf = rdma.take(DataPath::Direct, false, chunk as usize)?;
                        let s = pull_staged(&mut rdma, &mut self.conn, buf, at).await?;
                        window.push_back(s);
                        next += p.len;
                        continue;
                    }
                    if pull {
                        let left = (len - next).div_ceil(r.bounce_chunk.max(1));
                        let cap = (r.pull_depth as usize).min(depth);
                        if !may_stage(pulls(&window), cap, left as usize, asking) {
                            // the server holds no more staged chunks for us, or the next batch
                            // is not complete: read one first
                            break;
                        }
                        asking = true;
                    }
                    // a staged chunk lands by our own READ: a buffer without remote access
                    let path = if pull { DataPath::Direct } else { p.path };
                    let buf = rdma.take(path, false, chunk as usize)?;
                    window
                        .push_back(issue(&mut rdma, &mut self.conn, r, p, buf, false, pull).await?);
                    next += p.len;
                }
                if asking {
                    // the batch's `Stage`s (and the releases before them) in one write
                    self.conn.send_deferred().await?;
                }
                if window
                    .iter()
                    .any(|s| matches!(s, Slot::Stage(..) | Slot::Again(..)))
                {
                    start_pulls(&mut rdma, &mut self.conn, &mut window).await?;
                }
                let Some(slot) = window.pop_front() else {
                    break;
                };
                let at = offset + done;
                let Arrived {
                    buf,
                    n,
                    direct,
                    zero_copy,
                    again,
                } = land(&mut rdma, &mut self.conn, slot, &mut window, stall, at).await?;
                first.get_or_insert_with(|| start.elapsed());
                by_path[2] += zero_copy;
                reasked += u64::from(again);
                let bytes = if buf.remotely_writable() {
                    // the server may write this buffer at any time: copy, never borrow
                    scratch.resize(n as usize, 0);
                    buf.read_at(0, &mut scratch)?;
                    &scratch[..]
                } else {
                    &buf.as_slice()[..n as usize]
                };
                crc.add(bytes);
                let w = sink.write_all(bytes);
                rdma.pools.give(buf);
                w.map_err(|e| Error::io("writing the fetched data", e))?;
                by_path[usize::from(!direct)] += n;
                done += n;
                progress(done);
                if alive.elapsed() >= KEEPALIVE {
                    // one-sided transfers say nothing on the control connection
                    self.conn.send(&Msg::KeepAlive).await?;
                    alive = Instant::now();
                }
            }
            sink.flush()
                .map_err(|e| Error::io("flushing the fetched data", e))
        }
        .await;
        if let Some(at) = pre {
            // the fetch failed before it read the staged chunk
            self.conn.defer(&Msg::Unstage { slot: at.slot });
        }
        settle(&mut rdma, &mut self.conn, &mut window, stall).await;
        self.put_back_after(rdma, result.as_ref().err());
        result?;
        let seconds = start.elapsed().as_secs_f64();
        if by_path[2] > 0 {
            self.release_lent_now().await;
        }
        self.report_direct(r, offset, by_path[0], false, seconds)
            .await?;
        let verified = self.verify(r, "fetch", offset, len, crc).await?;
        let mut rep = report("fetch", r, offset, done, seconds, crc, verified, by_path);
        rep.first_bytes_ms = first.map(millis);
        rep.reasked_chunks = reasked;
        Ok(rep)
    }

    /// Write `source` (until EOF, at most `limit` bytes if given) to the region at `offset`:
    /// direct extents with RDMA WRITE, bounce extents by asking the server to RDMA-READ our
    /// buffers. Refuses up front when `limit` exceeds the region; a stream that turns out longer
    /// than the region stops at the region's end with an error saying how much was written.
    #[allow(clippy::too_many_arguments)]
    pub async fn put(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        source: &mut (dyn Read + Send),
        limit: Option<u64>,
        verify: bool,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<TransferReport> {
        if let Some(l) = limit {
            self.check_range(r, offset, l)?;
        } else {
            self.check_range(r, offset, 0)?;
        }
        if self.over_tcp() {
            return self
                .put_tcp(r, offset, source, limit, verify, progress)
                .await;
        }
        let room = r.info.size - offset;
        let max = limit.unwrap_or(room);
        let chunk = self.cfg.chunk as u64;
        let depth = self.depth();
        let stall = self.cfg.timeout;
        // QP and staging buffers are set up once per client: not part of the transfer's time
        self.release_first();
        let mut rdma = self.take_staged_rdma(max).await?;
        let start = Instant::now();
        let mut window: VecDeque<Slot> = VecDeque::with_capacity(depth);
        let mut posted = 0u64;
        let mut done = 0u64;
        let mut crc = Checksum::new(verify);
        let mut eof = false;
        let mut overflow = false;
        let mut by_path = [0u64; 3];
        let mut alive = Instant::now();
        let extents = r.put_extents();
        let result: Result<()> = async {
            loop {
                while window.len() < depth && !eof && posted < max {
                    let mut p = piece(&extents, offset + posted, max - posted, chunk, r.cut())?;
                    let want = p.len as usize;
                    let mut buf = rdma.take(p.path, true, chunk as usize)?;
                    let n = match read_full(source, &mut buf.as_mut_slice()[..want]) {
                        Ok(n) => n,
                        Err(e) => {
                            rdma.pools.give(buf);
                            return Err(Error::io("reading the data to put", e));
                        }
                    };
                    if n < want {
                        eof = true;
                    }
                    if n == 0 {
                        rdma.pools.give(buf);
                        break;
                    }
                    crc.add(&buf.as_slice()[..n]);
                    p.len = n as u64;
                    window
                        .push_back(issue(&mut rdma, &mut self.conn, r, p, buf, true, false).await?);
                    posted += n as u64;
                }
                if !eof && posted >= max && limit.is_none() {
                    overflow = more_input(source)?;
                    eof = true;
                }
                let Some(slot) = window.pop_front() else {
                    break;
                };
                let at = offset + done;
                match slot {
                    Slot::Rdma(p, n) => {
                        let back =
                            await_or_stall(&rdma.qp, &mut self.conn, p, stall, "RDMA WRITE", at)
                                .await?;
                        for b in back.into_iter().filter_map(Local::into_owned) {
                            rdma.pools.give(b);
                        }
                        by_path[0] += n;
                        done += n;
                    }
                    Slot::Bounce(buf, n) => {
                        let res = bounce_reply(&mut self.conn, stall, n).await;
                        rdma.pools.give(buf);
                        by_path[2] += res?;
                        by_path[1] += n;
                        done += n;
                    }
                    // a put stages nothing (staged() is for fetches); settled all the same
                    s @ (Slot::Stage(..) | Slot::Again(..) | Slot::Pull(..)) => {
                        let l = land(&mut rdma, &mut self.conn, s, &mut window, stall, at).await?;
                        rdma.pools.give(l.buf);
                        return Err(Error::Config("a staged fetch in a put's window".into()));
                    }
                }
                progress(done);
                if alive.elapsed() >= KEEPALIVE {
                    // one-sided transfers say nothing on the control connection
                    self.conn.send(&Msg::KeepAlive).await?;
                    alive = Instant::now();
                }
            }
            Ok(())
        }
        .await;
        settle(&mut rdma, &mut self.conn, &mut window, stall).await;
        self.put_back_after(rdma, result.as_ref().err());
        result?;
        if overflow {
            return Err(overflow_error(r, room, offset, done));
        }
        // acknowledged only once the server made it durable; memory that does not persist
        // (the server takes no puts itself: `server_puts` is false) has nothing to make
        // durable, and the bytes are placed once their WRITEs (or bounce replies) completed
        if r.info.server_puts {
            self.flush(r, offset, done).await?;
        }
        let seconds = start.elapsed().as_secs_f64();
        self.report_direct(r, offset, by_path[0], true, seconds)
            .await?;
        let verified = self.verify(r, "put", offset, done, crc).await?;
        Ok(report(
            "put", r, offset, done, seconds, crc, verified, by_path,
        ))
    }
}
