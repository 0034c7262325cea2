//! The control protocol: length-prefixed frames carrying JSON messages, over TCP.
//!
//! This module is pure: [`encode`] turns a message into bytes and [`Decoder`] turns bytes into
//! messages; no I/O, no clock. Frame layout: `u32` big-endian payload length, then the payload,
//! a JSON object with a `"type"` tag. Frames over [`MAX_FRAME`] are refused before buffering.
//! On the TCP data path a [`Msg::TcpData`] or [`Msg::TcpWrite`] frame is followed by exactly
//! the raw bytes it announces ([`Decoder::next_payload`]).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Protocol version spoken by this build.
pub const VERSION: u16 = 3;
/// Largest accepted frame payload.
pub const MAX_FRAME: usize = 1 << 20;

/// Largest frame accepted before the token is checked: a hello is a few hundred bytes, and an
/// unauthenticated peer must not make the server buffer a megabyte.
pub const MAX_HELLO_FRAME: usize = 4 << 10;

/// Region access as the server grants it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AccessMode {
    /// Remote READ only; the NIC refuses writes.
    ReadOnly,
    /// Remote READ and WRITE.
    ReadWrite,
}

impl fmt::Display for AccessMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccessMode::ReadOnly => "ro",
            AccessMode::ReadWrite => "rw",
        })
    }
}

/// How the bytes of a region travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataPath {
    /// One-sided RDMA straight on the region's MR.
    Direct,
    /// Through the server's staging buffers (bounce requests).
    Bounce,
    /// Some extents direct, the others bounce (see [`RegionInfo::extents`]).
    Mixed,
    /// Over the TCP control connection (a transfer of a client without an RDMA device; never
    /// a region's path).
    Tcp,
}

/// A range of a region and the path its bytes take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// Start in the region.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// Direct or bounce (never mixed).
    pub path: DataPath,
}

/// One MR of a region's direct part as an open sees it: the bytes `[offset, offset + len)` of
/// the region are at `addr` under `rkey` (valid only on the connection's QP). A region whose
/// direct part is one MR sends none: [`Msg::Opened`]'s own `addr`, `rkey` and `len` cover it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Start in the region.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// Remote address of the segment's first byte.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// A range of a region that a fetch is about to read ([`Msg::Open`]'s `first`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Start in the region.
    pub offset: u64,
    /// Length (the client's chunk at most: the server stages one piece of it).
    pub len: u64,
}

/// The first chunk of a fetch, staged by the open that named it ([`Msg::Opened`]'s `first`):
/// what a [`Msg::Staged`] reply to `Stage { offset, len }` would say. The client reads it and
/// releases `slot` with [`Msg::Unstage`], as any staged chunk, and releases it unread if its
/// fetch starts elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedChunk {
    /// Start in the region.
    pub offset: u64,
    /// Bytes staged.
    pub len: u64,
    /// The staging slot that holds them.
    pub slot: u32,
    /// Remote address of the first staged byte.
    pub addr: u64,
    /// Remote key (a read-only window on the connection's QP).
    pub rkey: u32,
    /// As [`Msg::Staged`]'s `lent`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub lent: bool,
    /// As [`Msg::Staged`]'s `hold_ms`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hold_ms: u64,
}

/// One of a server's RDMA devices, as [`Msg::Welcome`] announces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerNic {
    /// Device name on the server (`rxe1`, `mlx5_2`).
    pub name: String,
    /// The IPv4 address of the RoCE v2 GID its QPs use (None: none has one): a client picks
    /// its own device by the route to this address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<std::net::Ipv4Addr>,
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataPath::Direct => "direct",
            DataPath::Bounce => "bounce",
            DataPath::Mixed => "mixed",
            DataPath::Tcp => "tcp",
        })
    }
}

/// What a region is, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Name clients use.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Access granted.
    pub access: AccessMode,
    /// Where the memory comes from: "host", "host-huge", "file", "cmb", "dmabuf".
    pub kind: String,
    /// The path its data takes.
    pub path: DataPath,
    /// Why that path (the registration attempts, the policy).
    #[serde(default)]
    pub reason: String,
    /// The registration strategy of the direct part ("pinned", "odp", "dmabuf").
    #[serde(default)]
    pub strategy: Option<String>,
    /// The region split by path, in order, covering it exactly.
    #[serde(default)]
    pub extents: Vec<Extent>,
    /// Where the pages are at the time of the listing (device-private memory: on the device,
    /// migrated to host RAM, freed; P2P window use). Absent for memory that does not move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<String>,
    /// Puts go through the server (bounce requests, over the direct part too) and are durable
    /// when [`Msg::Flushed`] answers: the memory holds data the server did not create (a file,
    /// the embedding application's memory), so no rkey of it allows remote writes. When false,
    /// the memory does not persist (the server allocated it) and a put is complete once its
    /// bytes are placed: clients send no [`Msg::Flush`] for it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub server_puts: bool,
    /// The server's RDMA device that serves the direct part, when the server serves from
    /// more than one (the one its topology ranks best for the memory): a QP on another of
    /// them reaches the region through bounce buffers only. See [`Msg::Welcome`]'s `nics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic: Option<String>,
}

impl RegionInfo {
    /// The extents, or one extent of [`RegionInfo::path`] over the whole region when the server
    /// sent none.
    pub fn extents(&self) -> Vec<Extent> {
        if self.extents.is_empty() {
            vec![Extent {
                offset: 0,
                len: self.size,
                path: if self.path == DataPath::Mixed {
                    DataPath::Bounce
                } else {
                    self.path
                },
            }]
        } else {
            self.extents.clone()
        }
    }
}

/// A QP endpoint on the wire (see `verbs::Endpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireEndpoint {
    /// LID.
    pub lid: u16,
    /// GID, 16 bytes.
    pub gid: [u8; 16],
    /// QP number.
    pub qpn: u32,
    /// Initial PSN.
    pub psn: u32,
    /// Path MTU in bytes.
    pub mtu: u32,
}

impl From<verbs::Endpoint> for WireEndpoint {
    fn from(e: verbs::Endpoint) -> WireEndpoint {
        WireEndpoint {
            lid: e.lid,
            gid: e.gid.octets(),
            qpn: e.qpn,
            psn: e.psn,
            mtu: e.mtu,
        }
    }
}

impl From<WireEndpoint> for verbs::Endpoint {
    fn from(e: WireEndpoint) -> verbs::Endpoint {
        verbs::Endpoint {
            lid: e.lid,
            gid: e.gid.into(),
            qpn: e.qpn,
            psn: e.psn,
            mtu: e.mtu,
        }
    }
}

/// Error codes carried by [`Msg::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The peer speaks another protocol version.
    BadVersion,
    /// Missing or wrong token, or a request before a successful hello.
    Unauthorized,
    /// No region of that name.
    UnknownRegion,
    /// Offset/length outside the region.
    OutOfRange,
    /// Write access to a read-only region.
    ReadOnly,
    /// A malformed or unexpected request.
    BadRequest,
    /// A server limit was reached (connections, open regions).
    Busy,
    /// The region is served direct: use one-sided RDMA, not bounce requests.
    NotBounce,
    /// The handle is not open on this connection.
    NotOpen,
    /// The server failed (RDMA resources, I/O).
    Internal,
    /// The server is shutting down.
    ShuttingDown,
    /// The region was removed while the handle was open.
    Removed,
    /// Part of the range was freed or moved by the memory's owner (device-private memory)
    /// before or while it was being transferred: nothing of it was sent.
    Invalidated,
    /// The region's file was truncated by another process: the range past its new end is gone
    /// (the server keeps serving the rest and its other regions).
    Truncated,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(String::from));
        f.write_str(s.as_deref().unwrap_or("unknown"))
    }
}

/// Every message of the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Msg {
    /// Client → server, first message.
    Hello {
        /// Client's protocol version.
        version: u16,
        /// The shared secret (never printed by `Debug`).
        token: crate::Token,
        /// Free-form client name for logs.
        client: String,
    },
    /// Server → client: the token checked out.
    Welcome {
        /// Server's protocol version.
        version: u16,
        /// Server name for logs.
        server: String,
        /// RDMA operations the client may keep in flight.
        max_outstanding: u32,
        /// The RDMA devices the server serves from, when more than one: each region names
        /// its own ([`RegionInfo::nic`]), and [`Msg::Connect`] picks the one for the QP.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        nics: Vec<ServerNic>,
    },
    /// Client → server: list regions.
    List,
    /// Server → client.
    Regions {
        /// The regions.
        regions: Vec<RegionInfo>,
    },
    /// Client → server: create the server side of the RDMA connection.
    Connect {
        /// Client's QP.
        endpoint: WireEndpoint,
        /// The server device for the server's QP (one of [`Msg::Welcome`]'s `nics`; None:
        /// the one that carries this control connection's address, else the first).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nic: Option<String>,
    },
    /// Server → client.
    Connected {
        /// Server's QP, already connected to the client's.
        endpoint: WireEndpoint,
        /// The server device it is on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nic: Option<String>,
    },
    /// Client → server: which server device serves a region's direct part (a client asks
    /// before it connects its QP, on a server with several).
    Locate {
        /// Region name.
        region: String,
    },
    /// Server → client.
    Located {
        /// The region's device ([`RegionInfo::nic`]; None: the server has one).
        nic: Option<String>,
    },
    /// Client → server: open a region for one-sided access.
    Open {
        /// Region name.
        region: String,
        /// Whether the client wants to write.
        write: bool,
        /// The range a fetch will read next, on a handle opened for reading: the server may
        /// stage its first piece (one chunk, within one extent) with the open, as for a
        /// [`Msg::Stage`], so that the fetch's first READ needs no exchange before it. Where
        /// it cannot (the piece is direct, the handle does not stage, no slot), it opens
        /// without.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        first: Option<Span>,
    },
    /// Server → client: what one-sided access needs.
    Opened {
        /// Handle for later requests.
        handle: u32,
        /// The region.
        info: RegionInfo,
        /// Remote address of byte 0.
        addr: u64,
        /// Remote key (valid only on this connection's QP).
        rkey: u32,
        /// Length.
        len: u64,
        /// Largest bounce request the server accepts (bytes).
        #[serde(default)]
        bounce_chunk: u64,
        /// Where this connection's NIC reaches the region's staging ring (or its memory) only
        /// from the start of a block or page: a bounce piece that starts partway into a
        /// multiple of this many bytes should end at the next one, so that the transfer's
        /// other pieces start on one and go through the ring (0, or what does not divide
        /// `bounce_chunk`: no such cut). The server cuts an open's `first` range so too.
        #[serde(default, skip_serializing_if = "is_zero_u32")]
        piece_align: u32,
        /// The direct part's MRs, in order, when there is more than one (the driver caps one
        /// MR's size); `addr`, `rkey` and `len` are then the first's. The region's extents
        /// are split at the same boundaries, so no transfer piece crosses one.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        segments: Vec<Segment>,
        /// How many [`Msg::Stage`]d chunks the client may hold unreleased at once (0: this
        /// handle's bounce fetches go by [`Msg::Bounce`], the server writing the client's buffer).
        #[serde(default, skip_serializing_if = "is_zero_u32")]
        pull_depth: u32,
        /// The first piece of the open's `first` range, staged (None: it was not asked for,
        /// is direct, or could not be staged; the fetch asks for it as usual).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        first: Option<Box<StagedChunk>>,
    },
    /// Client → server: checksum (CRC-32C) of a range, for end-to-end verification.
    Checksum {
        /// Open handle.
        handle: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Server → client.
    ChecksumIs {
        /// CRC-32C of the range.
        crc32c: u32,
    },
    /// Client → server: move a range through the bounce path (server copies to/from staging
    /// buffers and RDMA-writes/reads the client's buffer).
    Bounce {
        /// Open handle.
        handle: u32,
        /// Offset in the region.
        offset: u64,
        /// Length.
        len: u64,
        /// true: client → region (put); false: region → client (fetch).
        to_region: bool,
        /// Client buffer address.
        addr: u64,
        /// Client buffer rkey.
        rkey: u32,
    },
    /// Server → client: a bounce transfer finished.
    BounceDone {
        /// Bytes moved.
        len: u64,
        /// Of those, bytes the server's NIC moved straight between the client's buffer and the
        /// device's P2P window (zero-copy: no staging copy on the server).
        #[serde(default, skip_serializing_if = "is_zero")]
        zero_copy: u64,
    },
    /// Client → server: copy a range of the region (at most `bounce_chunk` bytes, on a handle
    /// whose [`Msg::Opened`] gave a `pull_depth`) into a staging buffer the client may read,
    /// then reply [`Msg::Staged`]. The client RDMA-READs it, as it reads direct extents, and
    /// sends [`Msg::Unstage`]. A client may send several in one write (it asks in batches);
    /// the replies come in request order, several of them in one write where the requests
    /// came together.
    Stage {
        /// Open handle.
        handle: u32,
        /// Offset in the region.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Server → client: the staged bytes, readable through `rkey` on this connection's QP
    /// only; they stay as they are until the client sends [`Msg::Unstage`] with `slot` (the
    /// next chunk staged in the slot then replaces them).
    Staged {
        /// Which of the connection's staging slots holds them.
        slot: u32,
        /// Remote address of the first staged byte.
        addr: u64,
        /// Remote key: a read-only memory window over the slot's buffer, on the client's QP,
        /// bound when the connection first staged into the slot and kept until it ends.
        rkey: u32,
        /// Bytes staged.
        len: u64,
        /// The chunk is in a slot of the region's CMB ring, lent as it is (SSD → CMB → NIC):
        /// no copy on the server, no byte in its host memory. A client counts it as zero-copy.
        /// (Absent: false, as from a server that predates it.)
        #[serde(default, skip_serializing_if = "is_false")]
        lent: bool,
        /// A lent chunk that holds a slot of the region's CMB ring: the server's ring hold
        /// limit in milliseconds. Once that much time has passed since it lent the chunk, the
        /// server may take the slot back (its window revoked) when other clients want the ring;
        /// a client READs the chunk well before, or gives it back and asks again. (0, absent:
        /// the server takes nothing back, or the chunk holds no ring slot.)
        #[serde(default, skip_serializing_if = "is_zero")]
        hold_ms: u64,
    },
    /// Client → server, no reply: the client has read a staged slot, which may be staged
    /// again (under the same window). It need not come at once: the client sends it before
    /// its next `Stage`, as a rule in the same write.
    Unstage {
        /// The slot of a [`Msg::Staged`].
        slot: u32,
    },
    /// Client → server, no reply: a one-sided (direct) transfer on an open handle finished.
    /// The server never sees those bytes; this report is what its metrics count.
    Transferred {
        /// Open handle.
        handle: u32,
        /// Offset in the region.
        offset: u64,
        /// Bytes.
        len: u64,
        /// true: a put (client → region); false: a fetch.
        to_region: bool,
        /// How long the transfer took, as the client measured it (microseconds).
        micros: u64,
    },
    /// Client → server, after a put: make the range durable (a file: `fdatasync`) and answer
    /// [`Msg::Flushed`]. A put is acknowledged when this answer arrives.
    Flush {
        /// Open handle (opened for writing).
        handle: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Server → client: the range is durable.
    Flushed {
        /// Bytes made durable.
        len: u64,
    },
    /// Client → server: release a handle (its MR and rkey).
    Close {
        /// Handle.
        handle: u32,
    },
    /// Server → client.
    Closed {
        /// Handle.
        handle: u32,
    },
    /// Either way: a request failed.
    Error {
        /// Machine-readable code.
        code: ErrorCode,
        /// Human message saying what to do.
        message: String,
    },
    /// Client → server: send `len` bytes at `offset` of an open region over this connection
    /// (the TCP data path, for clients without an RDMA device). `len` is at most the
    /// `bounce_chunk` of [`Msg::Opened`].
    TcpRead {
        /// Open handle.
        handle: u32,
        /// Offset in the region.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Server → client: exactly `len` raw bytes follow this frame on the stream: the range.
    TcpData {
        /// Bytes that follow.
        len: u64,
    },
    /// Client → server: exactly `len` raw bytes follow this frame; write them at `offset` of a
    /// region opened for writing (at most `bounce_chunk`), then reply [`Msg::TcpWritten`]. A
    /// put is acknowledged by the [`Msg::Flushed`] that follows a [`Msg::Flush`].
    TcpWrite {
        /// Open handle.
        handle: u32,
        /// Offset in the region.
        offset: u64,
        /// Bytes that follow.
        len: u64,
    },
    /// Server → client: the bytes of a [`Msg::TcpWrite`] are in the region.
    TcpWritten {
        /// Bytes written.
        len: u64,
    },
    /// Client → server, no reply: still here (sent during long one-sided transfers, which
    /// say nothing on the control connection, so that the server's idle timeout does not
    /// close it).
    KeepAlive,
    /// Client → server: done; the server closes the connection.
    Bye,
}

impl Msg {
    /// The `type` tag, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "hello",
            Msg::Welcome { .. } => "welcome",
            Msg::List => "list",
            Msg::Regions { .. } => "regions",
            Msg::Connect { .. } => "connect",
            Msg::Connected { .. } => "connected",
            Msg::Locate { .. } => "locate",
            Msg::Located { .. } => "located",
            Msg::Open { .. } => "open",
            Msg::Opened { .. } => "opened",
            Msg::Checksum { .. } => "checksum",
            Msg::ChecksumIs { .. } => "checksum-is",
            Msg::Bounce { .. } => "bounce",
            Msg::BounceDone { .. } => "bounce-done",
            Msg::Stage { .. } => "stage",
            Msg::Staged { .. } => "staged",
            Msg::Unstage { .. } => "unstage",
            Msg::Transferred { .. } => "transferred",
            Msg::Flush { .. } => "flush",
            Msg::Flushed { .. } => "flushed",
            Msg::Close { .. } => "close",
            Msg::Closed { .. } => "closed",
            Msg::Error { .. } => "error",
            Msg::TcpRead { .. } => "tcp-read",
            Msg::TcpData { .. } => "tcp-data",
            Msg::TcpWrite { .. } => "tcp-write",
            Msg::TcpWritten { .. } => "tcp-written",
            Msg::KeepAlive => "keep-alive",
            Msg::Bye => "bye",
        }
    }

    /// An error message.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Msg {
        Msg::Error {
            code,
            message: message.into(),
        }
    }
}

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The length prefix exceeds the decoder's limit ([`MAX_FRAME`], or [`MAX_HELLO_FRAME`]
    /// before authentication).
    #[error("frame of {len} bytes exceeds the {limit}-byte limit (not a p2p-rdma peer?)")]
    TooLarge {
        /// The length the prefix announced.
        len: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The payload is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The stream ended inside a frame.
    #[error("connection closed in the middle of a frame ({0} bytes buffered)")]
    Truncated(usize),
}

/// Encode one message as a frame.
pub fn encode(msg: &Msg) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("messages always serialize");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Incremental decoder: feed bytes, take messages.
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    max_frame: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            buf: Vec::new(),
            max_frame: MAX_FRAME,
        }
    }
}

impl Decoder {
    /// A new decoder accepting frames up to [`MAX_FRAME`].
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// Accept frames up to `limit` bytes (at most [`MAX_FRAME`]) from now on.
    pub fn set_max_frame(&mut self, limit: usize) {
        self.max_frame = limit.min(MAX_FRAME);
    }

    /// Append received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Whether a whole frame is buffered (the next [`Decoder::next_msg`] yields it, or its
    /// error).
    pub fn holds_frame(&self) -> bool {
        self.announced()
            .is_some_and(|len| len > self.max_frame || self.buf.len() - 4 >= len)
    }

    /// The length the next frame's header announces, once its 4 bytes are here.
    fn announced(&self) -> Option<usize> {
        let h = self.buf.get(..4)?;
        Some(u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize)
    }

    /// Bytes buffered and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete message, `Ok(None)` if more bytes are needed.
    pub fn next_msg(&mut self) -> Result<Option<Msg>, DecodeError> {
        let Some(len) = self.announced() else {
            return Ok(None);
        };
        if len > self.max_frame {
            return Err(DecodeError::TooLarge {
                len,
                limit: self.max_frame,
            });
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let res = serde_json::from_slice::<Msg>(&self.buf[4..4 + len]);
        self.buf.drain(..4 + len);
        res.map(Some)
            .map_err(|e| DecodeError::Malformed(e.to_string()))
    }

    /// The next `n` raw bytes (the payload a [`Msg::TcpData`] or [`Msg::TcpWrite`] announced),
    /// `None` until all of them are buffered.
    pub fn next_payload(&mut self, n: usize) -> Option<Vec<u8>> {
        if self.buf.len() < n {
            return None;
        }
        let rest = self.buf.split_off(n);
        Some(std::mem::replace(&mut self.buf, rest))
    }

    /// Call at end of stream: an error if a partial frame is left.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Truncated(self.buf.len()))
        }
    }
}

/// Compare two secrets in time that depends only on their lengths' maximum, not on where
/// they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[cfg(test)]
mod tests;
