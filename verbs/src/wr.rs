//! Work requests: what a send-queue operation is (WRITE, WRITE with immediate, READ, SEND), the
//! buffer it uses, the checks every work request passes before it is posted, and which work
//! requests of a batch ask for a completion.

use crate::error::{Error, Result};
use crate::local::Local;
use crate::mr::RemoteSlice;

/// A send-queue operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA WRITE of the local bytes to the remote slice.
    Write(RemoteSlice),
    /// RDMA WRITE with immediate data (consumes a RECV at the peer).
    WriteImm(RemoteSlice, u32),
    /// RDMA READ of the remote slice into the local bytes.
    Read(RemoteSlice),
    /// SEND of the local bytes.
    Send,
    /// SEND with immediate data.
    SendImm(u32),
}

impl SendOp {
    /// A human name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            SendOp::Write(_) => "RDMA WRITE",
            SendOp::WriteImm(..) => "RDMA WRITE with immediate",
            SendOp::Read(_) => "RDMA READ",
            SendOp::Send => "SEND",
            SendOp::SendImm(_) => "SEND with immediate",
        }
    }

    fn device_writes_local(&self) -> bool {
        matches!(self, SendOp::Read(_))
    }

    fn remote(&self) -> Option<RemoteSlice> {
        match *self {
            SendOp::Write(r) | SendOp::WriteImm(r, _) | SendOp::Read(r) => Some(r),
            SendOp::Send | SendOp::SendImm(_) => None,
        }
    }
}

/// One send work request of the safe API.
#[derive(Debug)]
pub struct SendWr {
    /// What to do.
    pub op: SendOp,
    /// The local bytes.
    pub local: Local,
}

/// What a completed RECV reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvInfo {
    /// Bytes received.
    pub byte_len: u32,
    /// Immediate data, if the sender attached some.
    pub imm: Option<u32>,
}

pub(crate) fn validate(wr: &SendWr, max_inline: u32) -> Result<()> {
    if let Local::Inline(b) = &wr.local {
        if wr.op.device_writes_local() {
            return Err(Error::InvalidArgument(format!(
                "{} writes into the local buffer: inline bytes are only a SEND or WRITE source",
                wr.op.name()
            )));
        }
        if b.len() > max_inline as usize {
            return Err(Error::InvalidArgument(format!(
                "{} inline bytes, but the QP was created for at most {max_inline} \
                 (QpOptions::max_inline_data)",
                b.len()
            )));
        }
    }
    if wr.op.device_writes_local() && matches!(wr.local, Local::Shared(..)) {
        return Err(Error::InvalidArgument(format!(
            "{} writes into the local buffer: pass an owned buffer, not a shared one",
            wr.op.name()
        )));
    }
    if let Some(r) = wr.op.remote() {
        if wr.local.len() as u64 > r.len {
            return Err(Error::OutOfBounds {
                what: "remote slice",
                offset: 0,
                len: wr.local.len() as u64,
                size: r.len,
            });
        }
    }
    Ok(())
}

/// Which work requests of a post ask the device for a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Signal {
    /// Every `n`-th, and the last.
    Every(usize),
    /// None, unless the send queue (`outstanding` work requests with these, of `capacity`) is
    /// half full, when the last does, so that a queue of deferred work requests is always
    /// retired before it fills.
    Deferred { outstanding: usize, capacity: usize },
}

impl Signal {
    /// Whether work request `i` of `n` asks for a completion.
    pub(crate) fn at(self, i: usize, n: usize) -> bool {
        let last = i + 1 == n;
        match self {
            Signal::Every(every) => (i + 1) % every.max(1) == 0 || last,
            Signal::Deferred {
                outstanding,
                capacity,
            } => last && outstanding >= (capacity / 2).max(1),
        }
    }
}

/// The lifetime-bound view of a work request's local bytes, for posting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawSendWr<'a> {
    pub(crate) op: SendOp,
    /// Where the local bytes are.
    pub(crate) data: RawData<'a>,
}

/// The local bytes of a work request being posted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RawData<'a> {
    /// A registered range: lkey of the MR covering it, address, length.
    Sge(u32, u64, u32),
    /// Copied into the work request when it is posted.
    Inline(&'a [u8]),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signal_plan(n: usize, every: usize) -> Vec<bool> {
        (0..n).map(|i| Signal::Every(every).at(i, n)).collect()
    }

    fn deferred_plan(n: usize, outstanding: usize, capacity: usize) -> Vec<bool> {
        let s = Signal::Deferred {
            outstanding,
            capacity,
        };
        (0..n).map(|i| s.at(i, n)).collect()
    }

    #[test]
    fn deferred_work_requests_are_signaled_only_once_half_the_queue_is_taken() {
        assert_eq!(deferred_plan(1, 1, 16), vec![false]);
        assert_eq!(deferred_plan(2, 7, 16), vec![false, false]);
        assert_eq!(deferred_plan(3, 8, 16), vec![false, false, true]);
        assert_eq!(deferred_plan(1, 1, 1), vec![true]);
        assert_eq!(deferred_plan(1, 1, 2), vec![true]);
        assert!(deferred_plan(0, 9, 16).is_empty());
    }

    #[test]
    fn moderation_signals_every_nth_and_the_last() {
        assert_eq!(signal_plan(3, 1), vec![true, true, true]);
        assert_eq!(
            signal_plan(7, 3),
            vec![false, false, true, false, false, true, true]
        );
        assert_eq!(signal_plan(2, 8), vec![false, true]);
        assert!(signal_plan(0, 4).is_empty());
    }
}
