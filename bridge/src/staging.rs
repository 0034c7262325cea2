//! The client's staging buffers, one pool per use, each registered with the least access that
//! use needs:
//!
//! - [`Use::Direct`]: the local side of the client's own RDMA READ/WRITE. No remote access at
//!   all: the server never learns these rkeys and could not use them.
//! - [`Use::BounceIn`]: the server RDMA-WRITEs bounce data into it (a fetch). Remotely
//!   writable, so its bytes are only ever copied out ([`RegisteredBuffer::read_at`]), never
//!   borrowed.
//! - [`Use::BounceOut`]: the server RDMA-READs bounce data from it (a put). Remotely readable
//!   only.
//!
//! Buffers are registered on first need and reused; at most `depth` of each are out at once
//! (the transfer window), so a pool never holds more than `depth` buffers.

use verbs::{Access, HostBuffer, ProtectionDomain, RegMode, RegisteredBuffer};

use crate::error::Result;

/// What a staging buffer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// The local side of the client's own RDMA READ or WRITE.
    Direct,
    /// The target of the server's RDMA WRITE (bounce fetch).
    BounceIn,
    /// The source of the server's RDMA READ (bounce put).
    BounceOut,
}

impl Use {
    /// The access a buffer for this use is registered with.
    pub(crate) fn access(self) -> Access {
        match self {
            Use::Direct => Access::LOCAL_WRITE,
            Use::BounceIn => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            Use::BounceOut => Access::LOCAL_WRITE | Access::REMOTE_READ,
        }
    }

    fn of(access: Access) -> Use {
        if access.contains(Access::REMOTE_WRITE) {
            Use::BounceIn
        } else if access.contains(Access::REMOTE_READ) {
            Use::BounceOut
        } else {
            Use::Direct
        }
    }
}

/// Idle staging buffers of one chunk size.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    direct: Vec<RegisteredBuffer>,
    bounce_in: Vec<RegisteredBuffer>,
    bounce_out: Vec<RegisteredBuffer>,
}

impl Pools {
    fn pool(&mut self, u: Use) -> &mut Vec<RegisteredBuffer> {
        match u {
            Use::Direct => &mut self.direct,
            Use::BounceIn => &mut self.bounce_in,
            Use::BounceOut => &mut self.bounce_out,
        }
    }

    /// An idle buffer for `u`, or a new one of `chunk` bytes registered in `pd`.
    pub(crate) fn take(
        &mut self,
        u: Use,
        pd: &ProtectionDomain,
        chunk: usize,
    ) -> Result<RegisteredBuffer> {
        match self.pool(u).pop() {
            Some(b) => Ok(b),
            None => register(u, pd, chunk),
        }
    }

    /// Give a buffer back to the pool of its use (told by the access it was registered with).
    pub(crate) fn give(&mut self, b: RegisteredBuffer) {
        self.pool(Use::of(b.mr().access())).push(b);
    }

    /// Have `n` direct buffers ready (registration is then not part of a transfer's time).
    pub(crate) fn prefill(&mut self, pd: &ProtectionDomain, chunk: usize, n: usize) -> Result<()> {
        while self.direct.len() < n {
            self.direct.push(register(Use::Direct, pd, chunk)?);
        }
        Ok(())
    }

    /// Drop every idle buffer (the chunk size grew).
    pub(crate) fn clear(&mut self) {
        self.direct.clear();
        self.bounce_in.clear();
        self.bounce_out.clear();
    }
}

/// A new staging buffer of `chunk` bytes for `u`, registered with the access `u` needs.
fn register(u: Use, pd: &ProtectionDomain, chunk: usize) -> Result<RegisteredBuffer> {
    Ok(pd.register(HostBuffer::new(chunk)?, u.access(), RegMode::Pinned)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_use_gets_the_least_access_and_comes_back_to_its_pool() {
        assert!(!Use::Direct.access().contains(Access::REMOTE_READ));
        assert!(!Use::Direct.access().contains(Access::REMOTE_WRITE));
        assert!(!Use::BounceOut.access().contains(Access::REMOTE_WRITE));
        assert!(!Use::BounceIn.access().contains(Access::REMOTE_READ));
        for u in [Use::Direct, Use::BounceIn, Use::BounceOut] {
            assert_eq!(Use::of(u.access()), u);
        }
    }
}
