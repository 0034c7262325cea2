//! An open that names the range its fetch will read next (`Open { first }`): the first piece of
//! it is staged with the open, so that the fetch's first READ waits for no `Stage` exchange.

use super::{Catalog, Refusal, Session};
use crate::piece::{piece, Cut};
use crate::protocol::{DataPath, Extent, Span};

/// The first piece of an open's range to stage, as a `Stage` step would: slot `slot` (held
/// for the client) gets `len` bytes of region `region` at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FirstStage {
    pub(crate) region: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) slot: u32,
}

impl<T> Session<T> {
    /// What to stage of `first` for the open that just gave `handle`: its first piece, cut as
    /// the client cuts its fetch (within one of `extents`, the ones the client's `Opened`
    /// shows; at most `first.len`, which the client holds to its chunk, and the bounce chunk;
    /// from partway into a multiple of `align`, the `piece_align` the `Opened` says, up to
    /// the next one), when that piece is on the bounce path and the handle stages.
    ///
    /// None: nothing to stage (an empty range or one past the region's end, a direct piece, a
    /// handle opened for writing or one that does not stage). Err: the checks of a `Stage`
    /// refused it (all slots held, no QP); the open goes on without. On Ok the slot is held,
    /// as for a `Stage`: the driver calls [`Session::unstaged`] if it cannot stage.
    pub(crate) fn stage_first(
        &mut self,
        handle: u32,
        first: Span,
        extents: &[Extent],
        align: u64,
        regions: &dyn Catalog,
    ) -> Option<Result<FirstStage, Refusal>> {
        let e = self.entry(handle)?;
        if !e.pull || e.writable || first.len == 0 {
            return None;
        }
        let size = regions.info(e.region).size;
        let left = size.checked_sub(first.offset).filter(|n| *n > 0)?;
        let len = first.len.min(left);
        let cut = Cut {
            bounce_chunk: self.rules.bounce_chunk,
            align,
        };
        let p = piece(extents, first.offset, len, len, cut).ok()?;
        if p.path == DataPath::Direct {
            return None;
        }
        Some(
            self.stage(handle, p.pos, p.len, regions)
                .map(|(region, slot)| FirstStage {
                    region,
                    offset: p.pos,
                    len: p.len,
                    slot,
                }),
        )
    }
}
