//! The local side of a work request: a registered buffer (owned, shared, or a sink several
//! READs write at once) or a range of any MR, with the byte range it covers. The CQ's pending
//! table holds these until the device is done with them.

use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::mr::RegisteredBuffer;

/// A local buffer handed to a work request, with the byte range it covers.
///
/// `Owned` buffers may be written by the device (RECV, READ destination); `Shared` ones only read
/// (SEND, WRITE source), so several work requests may use one shared buffer at once. `Sink`
/// buffers may be written by several work requests at once (READ destinations of a benchmark,
/// like perftest's): the CPU cannot see their bytes until every work request is done.
#[derive(Debug)]
pub enum Local {
    /// Exclusively owned.
    Owned(RegisteredBuffer, Range<usize>),
    /// Shared, read-only for the device.
    Shared(Arc<RegisteredBuffer>, Range<usize>),
    /// Shared, written by the device, unreadable by the CPU while shared.
    Sink(Arc<SinkBuffer>, Range<usize>),
    /// Memory registered elsewhere (a device's memory region: a P2P window, a dma-buf): the
    /// device reads or writes it, the CPU never sees it through this handle. The region is kept
    /// alive until the work request completes.
    Region(Arc<dyn RegionRef>, Range<usize>),
    /// Bytes the device takes inside the work request itself (inline data: a SEND or WRITE
    /// source of at most the QP's `max_inline_data` bytes). They are copied when the work
    /// request is posted, so nothing is registered and nothing is held until the completion.
    Inline(Box<[u8]>),
}

/// Registered memory a work request may use that is not a [`RegisteredBuffer`]: a device's MR
/// kept alive, with whatever backs it, by the implementor.
pub trait RegionRef: Send + Sync + std::fmt::Debug {
    /// The memory region; its byte 0 is the work request's range start 0.
    fn memory_region(&self) -> &crate::mr::MemoryRegion;
}

impl RegionRef for RegisteredBuffer {
    fn memory_region(&self) -> &crate::mr::MemoryRegion {
        self.mr()
    }
}

/// A registered buffer that work requests may write concurrently. It offers no access to its
/// bytes: only [`SinkBuffer::into_inner`], once no work request holds it any more, gives the
/// buffer back, so the CPU never reads bytes the device may still be writing.
#[derive(Debug)]
pub struct SinkBuffer(RegisteredBuffer);

impl SinkBuffer {
    /// Wrap a buffer.
    pub fn new(buf: RegisteredBuffer) -> Arc<SinkBuffer> {
        Arc::new(SinkBuffer(buf))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The buffer back, when nothing else holds the sink (every work request that wrote it
    /// completed and gave its reference back); the sink itself otherwise.
    pub fn into_inner(
        this: Arc<SinkBuffer>,
    ) -> std::result::Result<RegisteredBuffer, Arc<SinkBuffer>> {
        Arc::try_unwrap(this).map(|s| s.0)
    }
}

impl Local {
    /// The whole of an owned buffer.
    pub fn owned(buf: RegisteredBuffer) -> Local {
        let n = buf.len();
        Local::Owned(buf, 0..n)
    }

    /// `range` of an owned buffer.
    pub fn owned_range(buf: RegisteredBuffer, range: Range<usize>) -> Result<Local> {
        check_range(&range, buf.len())?;
        Ok(Local::Owned(buf, range))
    }

    /// `range` of a shared buffer.
    pub fn shared(buf: Arc<RegisteredBuffer>, range: Range<usize>) -> Result<Local> {
        check_range(&range, buf.len())?;
        Ok(Local::Shared(buf, range))
    }

    /// `range` of memory registered elsewhere (see [`RegionRef`]).
    pub fn region(mr: Arc<dyn RegionRef>, range: Range<usize>) -> Result<Local> {
        check_range(&range, mr.memory_region().len())?;
        Ok(Local::Region(mr, range))
    }

    /// Bytes sent inline (see [`Local::Inline`]): the QP must have been created with
    /// `max_inline_data` of at least their length.
    pub fn inline(bytes: &[u8]) -> Local {
        Local::Inline(bytes.into())
    }

    /// `range` of a sink (see [`SinkBuffer`]).
    pub fn sink(buf: Arc<SinkBuffer>, range: Range<usize>) -> Result<Local> {
        check_range(&range, buf.len())?;
        Ok(Local::Sink(buf, range))
    }

    fn registered(&self) -> Option<&RegisteredBuffer> {
        match self {
            Local::Owned(b, _) => Some(b),
            Local::Shared(b, _) => Some(b),
            Local::Sink(b, _) => Some(&b.0),
            Local::Region(..) | Local::Inline(_) => None,
        }
    }

    /// The byte range.
    pub fn range(&self) -> Range<usize> {
        match self {
            Local::Owned(_, r) | Local::Shared(_, r) | Local::Sink(_, r) | Local::Region(_, r) => {
                r.clone()
            }
            Local::Inline(b) => 0..b.len(),
        }
    }

    /// Length of the range.
    pub fn len(&self) -> usize {
        let r = self.range();
        r.end - r.start
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of the range (None for a sink or a device's region, whose bytes the CPU may
    /// not see, and for a buffer a remote peer may write: copy those with
    /// [`RegisteredBuffer::read_at`]).
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            Local::Sink(..) | Local::Region(..) => None,
            Local::Inline(b) => Some(b),
            _ => {
                let b = self.registered()?;
                (!b.remotely_writable()).then(|| &b.as_slice()[self.range()])
            }
        }
    }

    /// Give back an owned buffer (None for a shared one or a sink).
    pub fn into_owned(self) -> Option<RegisteredBuffer> {
        match self {
            Local::Owned(b, _) => Some(b),
            Local::Shared(..) | Local::Sink(..) | Local::Region(..) | Local::Inline(_) => None,
        }
    }

    pub(crate) fn sge(&self) -> Result<(u32, u64, u32)> {
        let r = self.range();
        let len = u32::try_from(r.end - r.start).map_err(|_| {
            Error::InvalidArgument("one work request moves at most 4 GiB - 1".into())
        })?;
        let (lkey, addr) = match self {
            Local::Region(m, _) => {
                let mr = m.memory_region();
                (mr.lkey(), mr.addr())
            }
            Local::Inline(_) => {
                return Err(Error::InvalidArgument(
                    "inline bytes have no memory region: they go only into a SEND or WRITE".into(),
                ))
            }
            _ => {
                let b = self
                    .registered()
                    .expect("host buffers are registered buffers");
                (b.mr().lkey(), b.addr())
            }
        };
        Ok((lkey, addr + r.start as u64, len))
    }
}

fn check_range(range: &Range<usize>, size: usize) -> Result<()> {
    if range.start > range.end || range.end > size {
        return Err(Error::OutOfBounds {
            what: "local buffer",
            offset: range.start as u64,
            len: range.end.saturating_sub(range.start) as u64,
            size: size as u64,
        });
    }
    Ok(())
}
