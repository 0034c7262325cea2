//! How a transfer's range is cut into pieces: at most one chunk each (and one bounce chunk on
//! the bounce path), never across an extent. The client cuts its fetches and puts so; the
//! server cuts an open's first range the same way, so that the chunk it stages with the open
//! is the fetch's first piece.

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
/// across an extent boundary.
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
    if e.path != DataPath::Direct {
        len = len.min(bounce_chunk);
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
        let p = piece(&ext, 1000, 5000, 512, 64).unwrap();
        assert_eq!((p.path, p.len), (DataPath::Bounce, 64));
        let p = piece(&ext, 0, 10, 512, 64).unwrap();
        assert_eq!(p.len, 10);
        let e = piece(&ext, 10_000, 1, 512, 64).unwrap_err().to_string();
        assert!(e.contains("do not cover offset 10000"), "{e}");
    }
}
