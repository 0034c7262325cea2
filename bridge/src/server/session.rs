//! The protocol rules of one connection, without sockets or verbs: messages in, steps out.
//!
//! A [`Session`] knows what a client may do and when: the hello (version, token), the limit
//! of open handles, the access an open asks for, the ranges of a region, which bytes are
//! served direct (one-sided RDMA on an rkey) and which go through the bounce path, and what
//! is refused while the server drains. It decides; the I/O driver (`driver.rs`) carries out
//! the steps it returns (registering memory, connecting the QP, posting the bounce) and tells
//! the session what came of them ([`Session::opened`]). Host tests drive it with a fake
//! [`Catalog`], and the fuzzer drives it with arbitrary messages.
//!
//! Handles are slots of a [`Slab`] (bounded by the open limit) tagged with the slot's
//! generation (how many times it was freed), so a handle number is never that of a live handle
//! of another open, and a stale one (closed, then its slot reused) is refused as not open.

use slab::Slab;

use crate::protocol::{AccessMode, ErrorCode, Msg, RegionInfo, Span, WireEndpoint, VERSION};
use crate::token::{find_grant, Grant, Scope};

/// A refusal sent back to the client: a code and a message that says what to do.
pub(crate) type Refusal = (ErrorCode, String);

/// Most handles one connection may hold (the slot number lives in a handle's low 16 bits).
pub(crate) const MAX_HANDLES: usize = 1 << 16;

/// What the session needs to know of the regions served.
pub(crate) trait Catalog {
    /// The index of a region served under `name` (not removed).
    fn find(&self, name: &str) -> Option<usize>;
    /// What clients see of region `idx`.
    fn info(&self, idx: usize) -> &RegionInfo;
    /// Whether region `idx` was removed.
    fn is_removed(&self, idx: usize) -> bool;
    /// The names of the regions served (for an unknown-region refusal).
    fn names(&self) -> Vec<String>;
}

/// The limits a session enforces.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rules {
    /// Handles one connection may hold open at once (at most [`MAX_HANDLES`]).
    pub(crate) max_open: usize,
    /// The largest bounce request.
    pub(crate) bounce_chunk: u64,
    /// Staged chunks a client may hold unreleased at once (0: no staged fetches; at most
    /// [`MAX_STAGED`]).
    pub(crate) pull_depth: u32,
}

/// The most staging slots one connection may hold.
pub(crate) const MAX_STAGED: u32 = 64;

/// Why a hello was refused (the reply is `code` and `message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HelloFault {
    /// The first message was not a hello.
    NotHello(&'static str),
    /// Another protocol version.
    Version(u16),
    /// A wrong token, from a client that calls itself this.
    Token(String),
}

/// A hello refused: what to reply and why.
#[derive(Debug, Clone)]
pub(crate) struct HelloRefused {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) fault: HelloFault,
}

/// Check a connection's first message. Returns the client's name and what its token grants.
pub(crate) fn check_hello(msg: Msg, grants: &[Grant]) -> Result<(String, Scope), HelloRefused> {
    let (version, token, client) = match msg {
        Msg::Hello {
            version,
            token,
            client,
        } => (version, token, client),
        other => {
            return Err(HelloRefused {
                code: ErrorCode::Unauthorized,
                message: "say hello with the token first".into(),
                fault: HelloFault::NotHello(other.kind()),
            })
        }
    };
    if version != VERSION {
        return Err(HelloRefused {
            code: ErrorCode::BadVersion,
            message: format!(
                "server speaks protocol version {VERSION}, client {version}; use matching p2p-rdma versions"
            ),
            fault: HelloFault::Version(version),
        });
    }
    match find_grant(grants, &token) {
        Some(scope) => Ok((client, scope)),
        None => Err(HelloRefused {
            code: ErrorCode::Unauthorized,
            message: "wrong token".into(),
            fault: HelloFault::Token(client),
        }),
    }
}

/// A bounce request the session accepted: the driver stages it and posts the RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounce {
    pub(crate) handle: u32,
    pub(crate) region: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// A put (the server RDMA-READs the client's buffer) rather than a fetch.
    pub(crate) to_region: bool,
    /// The client's buffer.
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
}

/// What the driver does with a request.
#[derive(Debug)]
pub(crate) enum Step<T> {
    /// Send this reply (after the replies of the bounces in flight: replies go out in request
    /// order). Refusals are `Msg::Error`.
    Reply(Msg),
    /// Reply with the regions served.
    List,
    /// Create the connection's QP (on the server device named, if any) and connect it to the
    /// client's endpoint.
    Connect(WireEndpoint, Option<String>),
    /// Register the direct part of region `region` (with remote write if `writable`), then
    /// call [`Session::opened`]. `first`: the range a fetch will read next (only on a handle
    /// opened for reading): once opened, the driver may stage its first piece
    /// ([`Session::stage_first`]).
    Open {
        region: usize,
        writable: bool,
        first: Option<Span>,
    },
    /// Reply with the CRC-32C of a range (checked) of a region.
    Checksum {
        region: usize,
        offset: u64,
        len: u64,
    },
    /// Make a range (checked) of a region durable, then reply `Flushed`.
    Flush {
        region: usize,
        offset: u64,
        len: u64,
    },
    /// A handle was closed: release `payload` (its registration); when `last`, no other handle
    /// of this connection uses the region, so its registrations go too. Then reply `Closed`.
    Close {
        handle: u32,
        region: usize,
        payload: T,
        last: bool,
    },
    /// Start a bounce transfer (no reply until it completes).
    Bounce(Bounce),
    /// Copy a range (checked) of a region into staging slot `slot`, make it readable by the
    /// client's QP and reply `Staged` (after the replies of the bounces in flight). If that
    /// fails, call [`Session::unstaged`] and reply the refusal.
    Stage {
        region: usize,
        offset: u64,
        len: u64,
        slot: u32,
    },
    /// The client released staging slot `slot` (it held it): the slot may be staged again (its
    /// window stays bound until the connection ends). No reply.
    Unstage(u32),
    /// Send `len` bytes (checked) of a region over the control connection: `TcpData`, then
    /// the bytes (the TCP data path).
    TcpRead {
        region: usize,
        offset: u64,
        len: u64,
    },
    /// Read the `len` raw bytes that follow the request and write them into a region at
    /// `offset` (checked), then reply `TcpWritten`.
    TcpWrite {
        region: usize,
        offset: u64,
        len: u64,
    },
    /// A refused `TcpWrite` whose `len` raw bytes (at most the chunk) follow it on the wire:
    /// read and drop them, then send `reply`.
    Skip { len: u64, reply: Msg },
    /// The client reports a one-sided transfer it finished inside the direct part of a region
    /// it holds open: count it. No reply.
    Report {
        region: usize,
        offset: u64,
        len: u64,
        to_region: bool,
        micros: u64,
    },
    /// Nothing to do (a report that does not hold up is ignored).
    Ignore,
    /// The client said goodbye: finish the bounces in flight, then close.
    Leave,
}

#[derive(Debug)]
struct Entry<T> {
    region: usize,
    writable: bool,
    /// Bytes `[0, direct_len)` reach this handle by one-sided RDMA (the region's direct part,
    /// or nothing when this connection's QP is on another device than the region's).
    direct_len: u64,
    /// Its bounce fetches may be staged for the client to read.
    pull: bool,
    generation: u16,
    payload: T,
}

/// One authenticated connection's protocol state; `T` is what the driver keeps per handle
/// (the registration behind its rkey).
#[derive(Debug)]
pub(crate) struct Session<T> {
    rules: Rules,
    /// What the client's token grants.
    scope: Scope,
    handles: Slab<Entry<T>>,
    /// Per slot: how many times it was freed.
    generations: Vec<u16>,
    qp: bool,
    draining: bool,
    /// Staging slots the client holds (bit n: slot n).
    staged: u64,
}

fn refuse<T>(code: ErrorCode, message: impl Into<String>) -> Step<T> {
    Step::Reply(Msg::error(code, message))
}

fn refused<T>((code, message): Refusal) -> Step<T> {
    Step::Reply(Msg::error(code, message))
}

fn out_of_range(info: &RegionInfo, offset: u64, len: u64) -> Option<Refusal> {
    match offset.checked_add(len) {
        Some(end) if end <= info.size => None,
        _ => Some((
            ErrorCode::OutOfRange,
            format!(
                "offset {offset} + length {len} is outside region '{}' of {} bytes",
                info.name, info.size
            ),
        )),
    }
}

impl<T> Session<T> {
    /// A session that has just said welcome, for a token that grants `scope`.
    pub(crate) fn new(rules: Rules, scope: Scope) -> Session<T> {
        let rules = Rules {
            max_open: rules.max_open.min(MAX_HANDLES),
            pull_depth: rules.pull_depth.min(MAX_STAGED),
            ..rules
        };
        Session {
            rules,
            scope,
            handles: Slab::new(),
            generations: Vec::new(),
            qp: false,
            draining: false,
            staged: 0,
        }
    }

    /// What the client's token grants (the driver lists only what it sees).
    pub(crate) fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The server is stopping: no new opens; the client may finish with what it holds.
    pub(crate) fn drain(&mut self) {
        self.draining = true;
    }

    /// Whether the server is stopping and this client holds nothing: tell it and let it go.
    pub(crate) fn may_leave(&self) -> bool {
        self.draining && self.handles.is_empty()
    }

    /// Handles open.
    pub(crate) fn open_count(&self) -> usize {
        self.handles.len()
    }

    /// The driver connected the QP.
    pub(crate) fn connected(&mut self) {
        self.qp = true;
    }

    /// The region behind an open handle.
    pub(crate) fn region_of(&self, handle: u32) -> Option<usize> {
        self.entry(handle).map(|e| e.region)
    }

    /// Every open handle's region and payload (to revoke the registrations of removed regions).
    pub(crate) fn payloads_mut(&mut self) -> impl Iterator<Item = (u32, usize, &mut T)> {
        self.handles
            .iter_mut()
            .map(|(slot, e)| (handle_number(slot, e.generation), e.region, &mut e.payload))
    }

    /// Staged chunks a client may hold, as `Opened` tells it for a handle that may stage.
    pub(crate) fn pull_depth(&self) -> u32 {
        self.rules.pull_depth
    }

    /// Whether a staged fetch is to be expected and none was asked for yet: a QP is connected,
    /// no slot was ever staged into on this connection (`fresh`, the driver's knowledge), and
    /// a handle opened for reading may stage a region with bytes past its one-sided part. A
    /// handle opened for writing is left out: a client that puts would hold a slot buffer it
    /// never reads.
    pub(crate) fn expects_staged_fetch(&self, fresh: bool, regions: &dyn Catalog) -> bool {
        fresh
            && self.qp
            && self.staged == 0
            && self.handles.iter().any(|(_, e)| {
                e.pull
                    && !e.writable
                    && !regions.is_removed(e.region)
                    && e.direct_len < regions.info(e.region).size
            })
    }

    /// Staging slots the client holds: staged for it and not released.
    pub(crate) fn staged_count(&self) -> u32 {
        self.staged.count_ones()
    }

    /// The driver could not stage into `slot`: it is free again.
    pub(crate) fn unstaged(&mut self, slot: u32) {
        if slot < MAX_STAGED {
            self.staged &= !(1u64 << slot);
        }
    }

    /// The open the driver carried out: a new handle for it, whose first `direct_len` bytes
    /// are one-sided (the rest, bounce requests; staged for the client to read when `pull`).
    pub(crate) fn opened(
        &mut self,
        region: usize,
        writable: bool,
        direct_len: u64,
        pull: bool,
        payload: T,
    ) -> u32 {
        let slot = self.handles.vacant_key();
        if self.generations.len() <= slot {
            self.generations.resize(slot + 1, 0);
        }
        let generation = self.generations[slot];
        self.handles.insert(Entry {
            region,
            writable,
            direct_len,
            pull: pull && self.rules.pull_depth > 0,
            generation,
            payload,
        });
        handle_number(slot, generation)
    }

    fn entry(&self, handle: u32) -> Option<&Entry<T>> {
        let (slot, generation) = split_handle(handle);
        self.handles
            .get(slot)
            .filter(|e| e.generation == generation)
    }

    fn not_open(handle: u32) -> Refusal {
        (
            ErrorCode::NotOpen,
            format!("handle {handle} is not open on this connection"),
        )
    }

    /// What to do with a request of an authenticated client.
    pub(crate) fn step(&mut self, msg: Msg, regions: &dyn Catalog) -> Step<T> {
        match msg {
            Msg::List => Step::List,
            Msg::Bye => Step::Leave,
            Msg::KeepAlive => Step::Ignore,
            Msg::Connect { endpoint, nic } => {
                if self.qp {
                    return refuse(ErrorCode::BadRequest, "this connection already has a QP");
                }
                Step::Connect(endpoint, nic)
            }
            Msg::Open {
                region,
                write,
                first,
            } => self.open(&region, write, first, regions),
            Msg::Locate { region } => match self.visible(&region, regions) {
                Ok(idx) => Step::Reply(Msg::Located {
                    nic: regions.info(idx).nic.clone(),
                }),
                Err(r) => Step::Reply(Msg::Error {
                    code: r.0,
                    message: r.1,
                }),
            },
            Msg::Close { handle } => {
                let (slot, generation) = split_handle(handle);
                match self.handles.get(slot) {
                    Some(e) if e.generation == generation => {
                        let e = self.handles.remove(slot);
                        self.generations[slot] = self.generations[slot].wrapping_add(1);
                        let last = !self.handles.iter().any(|(_, o)| o.region == e.region);
                        Step::Close {
                            handle,
                            region: e.region,
                            payload: e.payload,
                            last,
                        }
                    }
                    _ => refused(Self::not_open(handle)),
                }
            }
            Msg::Checksum {
                handle,
                offset,
                len,
            } => {
                let Some(region) = self.region_of(handle) else {
                    return refused(Self::not_open(handle));
                };
                if let Some(r) = out_of_range(regions.info(region), offset, len) {
                    return refused(r);
                }
                Step::Checksum {
                    region,
                    offset,
                    len,
                }
            }
            Msg::Flush {
                handle,
                offset,
                len,
            } => {
                let Some(e) = self.entry(handle) else {
                    return refused(Self::not_open(handle));
                };
                let info = regions.info(e.region);
                if !e.writable {
                    return refuse(
                        ErrorCode::ReadOnly,
                        format!(
                            "handle {handle} of region '{}' was opened for reading: nothing to flush",
                            info.name
                        ),
                    );
                }
                if let Some(r) = out_of_range(info, offset, len) {
                    return refused(r);
                }
                Step::Flush {
                    region: e.region,
                    offset,
                    len,
                }
            }
            Msg::Bounce {
                handle,
                offset,
                len,
                to_region,
                addr,
                rkey,
            } => match self.bounce(handle, offset, len, to_region, regions) {
                Ok(region) => Step::Bounce(Bounce {
                    handle,
                    region,
                    offset,
                    len,
                    to_region,
                    addr,
                    rkey,
                }),
                Err(r) => refused(r),
            },
            Msg::Stage {
                handle,
                offset,
                len,
            } => match self.stage(handle, offset, len, regions) {
                Ok((region, slot)) => Step::Stage {
                    region,
                    offset,
                    len,
                    slot,
                },
                Err(r) => refused(r),
            },
            Msg::Unstage { slot } => {
                if slot < MAX_STAGED && self.staged & (1u64 << slot) != 0 {
                    self.staged &= !(1u64 << slot);
                    Step::Unstage(slot)
                } else {
                    // releasing what it does not hold changes nothing
                    Step::Ignore
                }
            }
            Msg::TcpRead {
                handle,
                offset,
                len,
            } => match self.tcp(handle, offset, len, false, regions) {
                Ok(region) => Step::TcpRead {
                    region,
                    offset,
                    len,
                },
                Err(r) => refused(r),
            },
            Msg::TcpWrite {
                handle,
                offset,
                len,
            } => match self.tcp(handle, offset, len, true, regions) {
                Ok(region) => Step::TcpWrite {
                    region,
                    offset,
                    len,
                },
                // the bytes are on the wire: drop them to stay in step with the client, unless
                // there are more than any request may carry (then they are read as frames,
                // which ends the connection with a protocol error)
                Err((code, message)) if len <= self.rules.bounce_chunk => Step::Skip {
                    len,
                    reply: Msg::Error { code, message },
                },
                Err(r) => refused(r),
            },
            Msg::Transferred {
                handle,
                offset,
                len,
                to_region,
                micros,
            } => {
                // only ranges inside the direct part of a region the client holds open (for
                // writing, if it says it wrote) count: a report cannot inflate another
                // region's figures
                let Some(e) = self.entry(handle) else {
                    return Step::Ignore;
                };
                let inside = offset
                    .checked_add(len)
                    .is_some_and(|end| end <= e.direct_len);
                if !inside || regions.is_removed(e.region) || (to_region && !e.writable) {
                    return Step::Ignore;
                }
                Step::Report {
                    region: e.region,
                    offset,
                    len,
                    to_region,
                    micros,
                }
            }
            other => refuse(
                ErrorCode::BadRequest,
                format!("'{}' is not a request a client may send now", other.kind()),
            ),
        }
    }

    fn open(
        &mut self,
        name: &str,
        write: bool,
        first: Option<Span>,
        regions: &dyn Catalog,
    ) -> Step<T> {
        if self.draining {
            return refuse(
                ErrorCode::ShuttingDown,
                "the server is shutting down: no new opens; finish with what is open",
            );
        }
        let region = match self.visible(name, regions) {
            Ok(idx) => idx,
            Err(r) => return refuse(r.0, r.1),
        };
        if write && regions.info(region).access == AccessMode::ReadOnly {
            return refuse(
                ErrorCode::ReadOnly,
                format!("region '{name}' is read-only; puts are refused"),
            );
        }
        if write && !self.scope.allows(name, true) {
            return refuse(
                ErrorCode::Unauthorized,
                format!("this client's token grants region '{name}' for reading only"),
            );
        }
        if self.handles.len() >= self.rules.max_open {
            return refuse(
                ErrorCode::Busy,
                format!(
                    "at most {} regions may be open per connection; close one first",
                    self.rules.max_open
                ),
            );
        }
        Step::Open {
            region,
            writable: write,
            first: first.filter(|_| !write),
        }
    }

    /// The region served under `name`, if this client's token grants it: a region the token
    /// does not grant is not there, as far as this client can tell.
    fn visible(&self, name: &str, regions: &dyn Catalog) -> Result<usize, Refusal> {
        regions
            .find(name)
            .filter(|_| self.scope.sees(name))
            .ok_or_else(|| {
                let names: Vec<String> = regions
                    .names()
                    .into_iter()
                    .filter(|n| self.scope.sees(n))
                    .collect();
                (
                    ErrorCode::UnknownRegion,
                    format!(
                        "no region '{name}' on this server; it serves: {}",
                        names.join(", ")
                    ),
                )
            })
    }

    fn bounce(
        &self,
        handle: u32,
        offset: u64,
        len: u64,
        to_region: bool,
        regions: &dyn Catalog,
    ) -> Result<usize, Refusal> {
        let e = self.live_range(handle, offset, len, regions)?;
        let info = regions.info(e.region);
        let direct = e.direct_len;
        // puts to a region that holds data go through the server, over its direct part too
        if offset < direct && !(to_region && info.server_puts) {
            return Err((
                ErrorCode::NotBounce,
                format!(
                    "bytes 0..{direct} of region '{}' are served direct: use one-sided RDMA on its rkey",
                    info.name
                ),
            ));
        }
        self.one_chunk(len, "a bounce request")?;
        if to_region {
            Self::writable(handle, e, info)?;
        }
        if !self.qp {
            return Err((
                ErrorCode::BadRequest,
                "connect a QP before bounce requests".into(),
            ));
        }
        Ok(e.region)
    }

    /// The checks of a staged fetch: those of a bounce fetch, on a handle that may stage, with
    /// a free slot (the lowest) among the `pull_depth` a client may hold.
    fn stage(
        &mut self,
        handle: u32,
        offset: u64,
        len: u64,
        regions: &dyn Catalog,
    ) -> Result<(usize, u32), Refusal> {
        let region = self.bounce(handle, offset, len, false, regions)?;
        if !self.entry(handle).is_some_and(|e| e.pull) {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "handle {handle} does not stage fetches (its Opened gave no pull_depth): \
                     use bounce requests"
                ),
            ));
        }
        let depth = self.rules.pull_depth;
        let Some(slot) = (0..depth).find(|n| self.staged & (1u64 << n) == 0) else {
            return Err((
                ErrorCode::Busy,
                format!(
                    "all {depth} staging slots of this connection hold chunks not yet released: \
                     unstage one after reading it"
                ),
            ));
        };
        self.staged |= 1u64 << slot;
        Ok((region, slot))
    }

    /// The checks of a TCP data request: those of a bounce request, except that any byte of
    /// the region may go this way and no QP is needed (the bytes travel on this connection).
    fn tcp(
        &self,
        handle: u32,
        offset: u64,
        len: u64,
        to_region: bool,
        regions: &dyn Catalog,
    ) -> Result<usize, Refusal> {
        let e = self.live_range(handle, offset, len, regions)?;
        self.one_chunk(len, "a TCP data request")?;
        if to_region {
            Self::writable(handle, e, regions.info(e.region))?;
        }
        Ok(e.region)
    }

    /// The open handle `handle`, of a region still served that `offset..offset + len` fits in.
    fn live_range(
        &self,
        handle: u32,
        offset: u64,
        len: u64,
        regions: &dyn Catalog,
    ) -> Result<&Entry<T>, Refusal> {
        let e = self.entry(handle).ok_or_else(|| Self::not_open(handle))?;
        let info = regions.info(e.region);
        if regions.is_removed(e.region) {
            return Err((
                ErrorCode::Removed,
                format!("region '{}' was removed from this server", info.name),
            ));
        }
        if let Some(r) = out_of_range(info, offset, len) {
            return Err(r);
        }
        Ok(e)
    }

    /// One request moves 1 to `bounce_chunk` bytes (`what` names the request).
    fn one_chunk(&self, len: u64, what: &str) -> Result<(), Refusal> {
        let chunk = self.rules.bounce_chunk;
        if len == 0 || len > chunk {
            return Err((
                ErrorCode::BadRequest,
                format!("{what} moves 1 to {chunk} bytes, not {len}"),
            ));
        }
        Ok(())
    }

    /// A put through handle `handle`: the region is writable and the handle was opened for
    /// writing.
    fn writable(handle: u32, e: &Entry<T>, info: &RegionInfo) -> Result<(), Refusal> {
        if info.access == AccessMode::ReadOnly {
            return Err((
                ErrorCode::ReadOnly,
                format!("region '{}' is read-only; puts are refused", info.name),
            ));
        }
        if !e.writable {
            return Err((
                ErrorCode::ReadOnly,
                format!(
                    "handle {handle} of region '{}' was opened for reading; open it for writing to put",
                    info.name
                ),
            ));
        }
        Ok(())
    }
}

fn handle_number(slot: usize, generation: u16) -> u32 {
    (u32::from(generation) << 16) | slot as u32
}

fn split_handle(handle: u32) -> (usize, u16) {
    ((handle & 0xffff) as usize, (handle >> 16) as u16)
}

mod first;
#[cfg(test)]
mod tests;
