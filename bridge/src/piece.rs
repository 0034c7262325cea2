//! How a transfer's range is cut into pieces: at most one chunk each (and on the bounce path
//! one bounce chunk, never across a multiple of the bounce chunk), never across an extent. The
//! client cuts its fetches and puts so; the server cuts an open's first range the same way, so
//! that the chunk it stages with the open is the fetch's first piece.

use crate::error::{Error, Result};
use crate::protocol::{DataPath, Extent};

/// A piece of a transfer: at most one chunk, within one extent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) path: DataPath,
    pub(crate) pos: u64,
    pub(crate) len: u64,
}

/// The next piece at `pos`: at most `chunk` (and `bounce_chunk` for bounce extents), never
/// across an extent boundary. A bounce piece ends at the next multiple of `bounce_chunk` in
/// region offsets, so a transfer that starts partway into one has a short first piece and the
/// rest start on multiples of it: an `nvme` region's pieces then lie within one window of the
/// bounce chunk's size and alignment, so the blocks that cover each one fit a ring slot of that
/// size (with a transfer cut from its own start, every piece of one that starts partway into a
/// block covered a block more than a slot, and none was lent), and a put's pieces past the
/// first start on a block, so that they land from a slot's start (ARCHITECTURE.md, "Pieces cut
/// on the bounce chunk's multiples").
pub(crate) fn piece(
    extents: &[Extent],
    pos: u64,
    remaining: u64,
    chunk: u64,
    bounce_chunk: u64,
) -> Result<Piece> {
    let e = extents
        .iter()
        .find(|e| e.offset <= pos && pos < e.offset + e.len)
        .ok_or_else(|| {
            Error::Config(format!(
                "the server's extents do not cover offset {pos} of the region"
            ))
        })?;
    let mut len = remaining.min(chunk).min(e.offset + e.len - pos);
    if e.path != DataPath::Direct && bounce_chunk > 0 {
        len = len.min(bounce_chunk - pos % bounce_chunk);
    }
    Ok(Piece {
        path: e.path,
        pos,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_respect_chunks_and_never_cross_an_extent() {
        let ext = [
            Extent {
                offset: 0,
                len: 1000,
                path: DataPath::Direct,
            },
            Extent {
                offset: 1000,
                len: 9000,
                path: DataPath::Bounce,
            },
        ];
        let p = piece(&ext, 900, 5000, 512, 64).unwrap();
        assert_eq!((p.path, p.pos, p.len), (DataPath::Direct, 900, 100));
        // bounce pieces end on multiples of the bounce chunk: 1000 is 40 bytes into one
        let p = piece(&ext, 1000, 5000, 512, 64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Bounce, 24));
        let p = piece(&ext, 1024, 5000, 512, 64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Bounce, 64));
        let p = piece(&ext, 1030, 20, 512, 64).unwrap();
        assert_eq!(p.len, 20);
        // direct pieces are cut from their own start
        let p = piece(&ext, 7, 990, 512, 64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Direct, 512));
        let p = piece(&ext, 0, 10, 512, 64).unwrap();
        assert_eq!(p.len, 10);
        let e = piece(&ext, 10_000, 1, 512, 64).unwrap_err().to_string();
        assert!(e.contains("do not cover offset 10000"), "{e}");
    }

    #[test]
    fn bounce_pieces_of_a_range_that_starts_partway_into_a_bounce_chunk_fit_its_windows() {
        let ext = [Extent {
            offset: 0,
            len: 64 << 20,
            path: DataPath::Bounce,
        }];
        let bc = 1 << 20;
        for (start, len, chunk) in [(777, 15_000_000, 1 << 20), (4096 + 777, 700_000, 128 << 10)] {
            let (mut pos, end, mut n) = (start, start + len, 0);
            while pos < end {
                let p = piece(&ext, pos, end - pos, chunk, bc).unwrap();
                assert!(p.len > 0 && p.len <= chunk, "{p:?}");
                // within one window of the bounce chunk's size and alignment
                assert_eq!(p.pos / bc, (p.pos + p.len - 1) / bc, "{p:?}");
                // past the first window, a piece starts where a chunk would from the window
                if pos >= start.next_multiple_of(bc) {
                    assert_eq!(pos % bc % chunk, 0, "{p:?}");
                }
                pos += p.len;
                n += 1;
            }
            assert_eq!(pos, end);
            // one piece more than a range cut from its own start, at most
            assert!(n <= len.div_ceil(chunk) + 1, "{n} pieces");
        }
    }
}
