//! A fetch whose first chunk is staged by its open: [`Client::open_to_fetch`] names the range,
//! the server stages the first piece of it with the `Open` (when that piece is on the bounce
//! path) and its `Opened` says where, so the fetch's first READ ([`Client::fetch`], or a
//! batch's: [`Client::fetch_into`], [`Client::fetch_many`]) is posted at once, as on the
//! direct path, instead of after a `Stage` exchange.

use std::time::{Duration, Instant};

use verbs::RemoteSlice;

use super::window::{give_back_late, piece, staged, Asked, StagedAt};
use super::{Client, OpenRegion};
use crate::error::Result;
use crate::protocol::{Msg, Span, StagedChunk};

/// Where a staged chunk is READ: its slot, its address and key on the server, its length.
fn readable(c: &StagedChunk) -> StagedAt {
    StagedAt {
        slot: c.slot,
        remote: RemoteSlice {
            addr: c.addr,
            rkey: c.rkey,
            len: c.len,
        },
        lent: c.lent,
        hold: (c.hold_ms > 0).then(|| Duration::from_millis(c.hold_ms)),
    }
}

/// What a region is opened for ([`Client::open_for`]): callers that open for several
/// purposes (a fetch, a put, a striped transfer's lanes, a replica picked by name) say it
/// with one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenFor {
    /// Reading, no range named ([`Client::open`]).
    Read,
    /// Writing: puts ([`Client::open`]).
    Write,
    /// A fetch of `len` bytes at `offset`, whose first chunk the server stages with the open
    /// where it is on the bounce path ([`Client::open_to_fetch`]).
    Fetch {
        /// Where the fetch starts in the region.
        offset: u64,
        /// How many bytes it reads (more than the region holds: to its end).
        len: u64,
    },
}

impl OpenFor {
    /// Whether the handle is opened for writing.
    pub fn writes(self) -> bool {
        self == OpenFor::Write
    }
}

/// What a fetch finds of the chunk its open staged ([`Client::take_first_for`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum First {
    /// Its first piece: READ it there.
    Read(StagedAt),
    /// None, or another piece (given back).
    Nothing,
    /// Its first piece, lent and held too long to be READ within the server's ring hold
    /// limit: given back, and the fetch asks for it again.
    Late,
}

impl First {
    /// Where to READ the first piece, if it is staged and in time.
    pub(super) fn at(self) -> Option<StagedAt> {
        match self {
            First::Read(at) => Some(at),
            First::Nothing | First::Late => None,
        }
    }
}

/// A first chunk staged by an open, held for this client until its fetch reads it (or it
/// goes back unread).
#[derive(Debug, Clone, Copy)]
pub(super) struct FirstStaged {
    handle: u32,
    chunk: StagedChunk,
    /// When the open was sent: the server lent the chunk no earlier.
    asked: Instant,
}

impl Client {
    /// Open `region` for reading a fetch of `len` bytes at `offset`, and have the server stage
    /// the fetch's first chunk with the open where it is on the bounce path: the next
    /// [`Client::fetch`] of that range through this handle reads it at once, without the
    /// `Stage` exchange its first READ would otherwise wait for (between the lab's two guests,
    /// about 4 ms of a 30 ms fetch of 1 MiB). The open takes that much longer instead (the
    /// server copies the chunk before it replies; [`OpenRegion::open_ms`]). Where nothing can
    /// be staged (a direct range, a server that does not stage, a client over TCP), it is
    /// [`Client::open`]. A chunk that is not read (a fetch or a batch that does not start
    /// with it, a put, a close, another open) goes back to the server with the next request.
    ///
    /// The chunk holds the region's bytes as they were at the open: a put acknowledged
    /// between this open and the fetch may be missing from it. Open and fetch back to back
    /// (as `p2p-rdma fetch` does), or open with [`Client::open`] where a put comes between.
    pub async fn open_to_fetch(
        &mut self,
        region: &str,
        offset: u64,
        len: u64,
    ) -> Result<OpenRegion> {
        let first = (len > 0).then(|| Span {
            offset,
            len: len.min(self.cfg.chunk as u64),
        });
        self.open_with(region, false, first).await
    }

    /// Open `region` for `purpose`: [`Client::open`] for reading or writing,
    /// [`Client::open_to_fetch`] for a fetch of a named range.
    pub async fn open_for(&mut self, region: &str, purpose: OpenFor) -> Result<OpenRegion> {
        match purpose {
            OpenFor::Read => self.open(region, false).await,
            OpenFor::Write => self.open(region, true).await,
            OpenFor::Fetch { offset, len } => self.open_to_fetch(region, offset, len).await,
        }
    }

    /// Keep the chunk an `Opened` reply staged for `asked`, if it is one: else it goes back.
    /// `sent`: when the open was sent.
    pub(super) fn keep_first(
        &mut self,
        handle: u32,
        asked: Option<Span>,
        staged: Option<Box<StagedChunk>>,
        pull_depth: u32,
        sent: Instant,
    ) {
        let Some(&chunk) = staged.as_deref() else {
            return;
        };
        let fits = asked.is_some_and(|a| {
            chunk.offset == a.offset && chunk.len > 0 && chunk.len <= a.len && pull_depth > 0
        });
        if fits {
            self.first = Some(FirstStaged {
                handle,
                chunk,
                asked: sent,
            });
        } else {
            tracing::debug!(?chunk, ?asked, "a first chunk not asked for: released");
            self.conn.defer(&Msg::Unstage { slot: chunk.slot });
        }
    }

    /// The staged first chunk, if it is `len` bytes at `pos` of `handle`'s region (where to
    /// READ it); any other goes back (its release rides on the next request), and so does a
    /// lent chunk held too long to be READ within the server's ring hold limit
    /// ([`give_back_late`]): the fetch asks for it again.
    fn take_first(&mut self, handle: u32, pos: u64, len: u64) -> First {
        let Some(f) = self.first.take() else {
            return First::Nothing;
        };
        if f.handle != handle || f.chunk.offset != pos || f.chunk.len != len {
            self.conn.defer(&Msg::Unstage { slot: f.chunk.slot });
            return First::Nothing;
        }
        let at = readable(&f.chunk);
        let asked = Asked {
            handle,
            pos,
            len,
            at: f.asked,
            again: 0,
        };
        if give_back_late(&mut self.conn, &at, &asked) {
            First::Late
        } else {
            First::Read(at)
        }
    }

    /// The staged first chunk, if it is the first piece of a fetch of `len` bytes at `offset`
    /// of `r`, cut as every fetch cuts its range (`chunk`, the region's extents and bounce
    /// chunk): where to READ it. Any other goes back (with the next request).
    /// `fetch` and the batches ask so, for their first range.
    pub(super) fn take_first_for(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        len: u64,
        chunk: u64,
    ) -> First {
        match piece(&r.info.extents(), offset, len, chunk, r.cut()) {
            Ok(p) if len > 0 && staged(r, &p, false) => self.take_first(r.handle, p.pos, p.len),
            _ => {
                self.release_first();
                First::Nothing
            }
        }
    }

    /// Give an unread staged first chunk back (with the next request).
    pub(super) fn release_first(&mut self) {
        if let Some(f) = self.first.take() {
            self.conn.defer(&Msg::Unstage { slot: f.chunk.slot });
        }
    }
}
