//! How a transfer's range is cut into pieces: at most one chunk each (and on the bounce path
//! one bounce chunk, never across a multiple of the bounce chunk, nor from partway into the
//! region's piece alignment across the next multiple of it), never across an extent. The
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

/// Where a region's bounce pieces end, as its `Opened` says: on multiples of `bounce_chunk`,
/// and a piece that starts partway into a multiple of `align` (0: none) at the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cut {
    pub(crate) bounce_chunk: u64,
    pub(crate) align: u64,
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
///
/// A bounce piece that starts partway into a multiple of `cut.align` ends at the next one: a
/// server whose NIC reaches the region's ring (or its memory) only from a block's or page's
/// start says so, and a transfer that starts partway into one then has a first piece of less
/// than a block, copied, and the rest start on blocks, which the ring lends and lands
/// (ARCHITECTURE.md, "A first piece up to the next block").
pub(crate) fn piece(
    extents: &[Extent],
    pos: u64,
    remaining: u64,
    chunk: u64,
    cut: Cut,
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
    if e.path != DataPath::Direct {
        if cut.bounce_chunk > 0 {
            len = len.min(cut.bounce_chunk - pos % cut.bounce_chunk);
        }
        if cut.align > 0 && pos % cut.align != 0 {
            len = len.min(cut.align - pos % cut.align);
        }
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

    const BC64: Cut = Cut {
        bounce_chunk: 64,
        align: 0,
    };

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
        let p = piece(&ext, 900, 5000, 512, BC64).unwrap();
        assert_eq!((p.path, p.pos, p.len), (DataPath::Direct, 900, 100));
        // bounce pieces end on multiples of the bounce chunk: 1000 is 40 bytes into one
        let p = piece(&ext, 1000, 5000, 512, BC64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Bounce, 24));
        let p = piece(&ext, 1024, 5000, 512, BC64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Bounce, 64));
        let p = piece(&ext, 1030, 20, 512, BC64).unwrap();
        assert_eq!(p.len, 20);
        // direct pieces are cut from their own start
        let p = piece(&ext, 7, 990, 512, BC64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Direct, 512));
        let p = piece(&ext, 0, 10, 512, BC64).unwrap();
        assert_eq!(p.len, 10);
        let e = piece(&ext, 10_000, 1, 512, BC64).unwrap_err().to_string();
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
                let cut = Cut {
                    bounce_chunk: bc,
                    align: 0,
                };
                let p = piece(&ext, pos, end - pos, chunk, cut).unwrap();
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

    #[test]
    fn a_first_piece_partway_into_the_alignment_ends_at_its_next_multiple() {
        let ext = [
            Extent {
                offset: 0,
                len: 1024,
                path: DataPath::Direct,
            },
            Extent {
                offset: 1024,
                len: 64 << 20,
                path: DataPath::Bounce,
            },
        ];
        let bc = 1 << 20;
        let cut = Cut {
            bounce_chunk: bc,
            align: 512,
        };
        for (start, len, chunk) in [
            (1024 + 777, 15_000_000, 1 << 20),
            ((1 << 20) + 4096 + 1001, 700_000, 128 << 10),
            (3 << 20, 2 << 20, 1 << 20),
        ] {
            let (mut pos, end, mut n) = (start, start + len, 0);
            let mut cuts = Vec::new();
            while pos < end {
                let p = piece(&ext, pos, end - pos, chunk, cut).unwrap();
                assert!(p.len > 0 && p.len <= chunk, "{p:?}");
                assert_eq!(p.pos / bc, (p.pos + p.len - 1) / bc, "{p:?}");
                cuts.push(p.len);
                pos += p.len;
                n += 1;
            }
            assert_eq!(pos, end);
            // only the first piece starts partway into a block, and it ends on the next one:
            // one piece more than without the alignment, at most
            let first = (512 - start % 512) % 512;
            if first > 0 {
                assert_eq!(cuts[0], first, "{start}: {cuts:?}");
            }
            let mut at = start + cuts[0];
            for len in &cuts[1..] {
                assert_eq!(at % 512, 0, "{start}: a piece at {at}");
                at += len;
            }
            assert!(n <= len.div_ceil(chunk) + 2, "{n} pieces");
        }
        // a piece within one block ends where the transfer does
        let p = piece(&ext, 1024 + 700, 20, 1 << 20, cut).unwrap();
        assert_eq!(p.len, 20);
        // direct pieces are not cut by it
        let p = piece(&ext, 7, 1017, 1 << 20, cut).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Direct, 1017));
    }
}
