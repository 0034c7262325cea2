//! What a transfer between a file and a region still has to move after tries that failed part
//! way (`fetch` and `put --retries` with `--verify`).
//!
//! Each stream of a try moves its piece of the range in order (a fetch writes the file in
//! order; a put's WRITEs complete in order), so what it moved before the failure is a prefix
//! of that piece: it is kept, and the next try moves the rest of each piece, spread again over
//! the connections it has (a stripe that finished leaves its connection a share of another
//! stripe's rest). Once the rest is moved and verified, the kept parts are compared with the
//! server's checksum of the same bytes. Sans-IO: `fetch` and `put` drive it.

use bridge::stripe::{plan, Stripe, MAX_STRIPES};
use bridge::TransferReport;

/// The range of a fetch into a file, and the parts of it not written yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Left {
    offset: u64,
    len: u64,
    /// Parts still to fetch: in order, none empty, none touching the next (an empty list: every
    /// byte was written).
    todo: Vec<Stripe>,
}

impl Left {
    /// Nothing written yet of `len` bytes at `offset`.
    pub(crate) fn new(offset: u64, len: u64) -> Left {
        let todo = if len > 0 {
            vec![Stripe { offset, len }]
        } else {
            Vec::new()
        };
        Left { offset, len, todo }
    }

    /// The whole range: offset and length.
    pub(crate) fn range(&self) -> (u64, u64) {
        (self.offset, self.len)
    }

    /// Whether one stream can move what is left: at most one part, at the end of the range (what
    /// was kept is a start of it).
    pub(crate) fn one_stream(&self) -> bool {
        match self.todo.as_slice() {
            [] => true,
            [t] => t.offset + t.len == self.offset + self.len,
            _ => false,
        }
    }

    /// How many apart parts are still to fetch.
    pub(crate) fn parts(&self) -> usize {
        self.todo.len()
    }

    /// Bytes written by the tries before, kept in the file.
    pub(crate) fn kept_bytes(&self) -> u64 {
        self.len - self.todo.iter().map(|s| s.len).sum::<u64>()
    }

    /// The kept parts (the range less the parts still to fetch), in order.
    pub(crate) fn kept(&self) -> Vec<Stripe> {
        let mut out = Vec::new();
        let mut at = self.offset;
        for s in self.todo.iter().chain(std::iter::once(&Stripe {
            offset: self.offset + self.len,
            len: 0,
        })) {
            if s.offset > at {
                out.push(Stripe {
                    offset: at,
                    len: s.offset - at,
                });
            }
            at = s.offset + s.len;
        }
        out
    }

    /// The first part still to fetch: what the next try's first connection opens for (the
    /// empty range at the end when every byte is written).
    pub(crate) fn first(&self) -> Stripe {
        self.todo.first().copied().unwrap_or(Stripe {
            offset: self.offset + self.len,
            len: 0,
        })
    }

    /// The pieces of the next try over at most `n` connections, one connection each: every
    /// part left gets one connection, the others go one by one to the part with the most
    /// chunks per connection, and each part is cut into its share by `plan`. None when more
    /// parts are left than `n` (they could not all be fetched). One empty piece at the end of
    /// the range when nothing is left (the try still opens, and its report verifies nothing).
    pub(crate) fn spread(&self, n: usize, chunk: u64) -> Option<Vec<Stripe>> {
        let n = n.clamp(1, MAX_STRIPES);
        if self.todo.is_empty() {
            return Some(vec![self.first()]);
        }
        if self.todo.len() > n {
            return None;
        }
        let chunk = chunk.max(1);
        let chunks: Vec<u64> = self.todo.iter().map(|s| s.len.div_ceil(chunk)).collect();
        let mut share = vec![1u64; self.todo.len()];
        for _ in self.todo.len()..n {
            // the part whose connections each have the most chunks to fetch, if any has more
            // chunks than connections
            let most = (0..share.len())
                .filter(|&i| chunks[i] > share[i])
                .max_by(|&a, &b| (chunks[a] * share[b]).cmp(&(chunks[b] * share[a])));
            let Some(i) = most else { break };
            share[i] += 1;
        }
        Some(
            self.todo
                .iter()
                .zip(share)
                .flat_map(|(s, k)| plan(s.offset, s.len, k as usize, chunk))
                .collect(),
        )
    }

    /// [`Left::spread`], or when more parts are left than `n`, the whole range left again and
    /// spread (the transfer starts over).
    pub(crate) fn spread_or_anew(&mut self, n: usize, chunk: u64) -> Vec<Stripe> {
        if let Some(p) = self.spread(n, chunk) {
            return p;
        }
        *self = Left::new(self.offset, self.len);
        self.spread(n, chunk).unwrap_or_default()
    }

    /// A try over `pieces` (from `spread`) wrote the first `written[i]` bytes of piece `i`; a
    /// piece without a count wrote nothing.
    pub(crate) fn wrote(&mut self, pieces: &[Stripe], written: &[u64]) {
        let mut todo: Vec<Stripe> = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let w = written.get(i).copied().unwrap_or(0).min(p.len);
            if w == p.len {
                continue;
            }
            let rest = Stripe {
                offset: p.offset + w,
                len: p.len - w,
            };
            match todo.last_mut() {
                Some(t) if t.offset + t.len == rest.offset => t.len += rest.len,
                _ => todo.push(rest),
            }
        }
        self.todo = todo;
    }
}

/// The first line of a record of what a fetch left (`Left::record`).
const RECORD_HEADER: &str = "p2p-rdma partial fetch 1";

impl Left {
    /// A record of what is left of a fetch of `region` into a file: kept beside the file while
    /// a striped fetch runs, so that `fetch --continue` knows which parts of the file hold
    /// fetched bytes (a striped fetch's file is sized first and written in several places).
    pub(crate) fn record(&self, region: &str) -> String {
        let mut out = format!(
            "{RECORD_HEADER}\nregion {region}\nrange {} {}\n",
            self.offset, self.len
        );
        for t in &self.todo {
            out.push_str(&format!("left {} {}\n", t.offset, t.len));
        }
        out
    }

    /// What a record says is left of a fetch of `region`, `len` bytes at `offset`; an error
    /// saying why when it is not a record of that fetch (another region or range, damaged).
    pub(crate) fn from_record(
        text: &str,
        region: &str,
        (offset, len): (u64, u64),
    ) -> Result<Left, String> {
        let mut lines = text.lines();
        if lines.next() != Some(RECORD_HEADER) {
            return Err("not a record of a partial fetch".into());
        }
        if lines.next() != Some(&format!("region {region}")) {
            return Err(format!("not a fetch of region '{region}'"));
        }
        if lines.next() != Some(&format!("range {offset} {len}")) {
            return Err(format!("not a fetch of {len} bytes at offset {offset}"));
        }
        let mut todo: Vec<Stripe> = Vec::new();
        let mut at = offset;
        for l in lines {
            let part = l
                .strip_prefix("left ")
                .and_then(|r| r.split_once(' '))
                .and_then(|(o, n)| Some((o.parse::<u64>().ok()?, n.parse::<u64>().ok()?)));
            let Some((o, n)) = part else {
                return Err(format!("a line that is not a part left: '{l}'"));
            };
            // in order, apart, inside the range, none empty
            if n == 0 || o < at || o.checked_add(n).is_none_or(|e| e > offset + len) {
                return Err(format!(
                    "a part left out of order or out of the range: '{l}'"
                ));
            }
            at = o + n;
            todo.push(Stripe { offset: o, len: n });
        }
        let mut l = Left {
            offset,
            len,
            todo: Vec::new(),
        };
        // parts that touch become one
        l.wrote(&todo, &[]);
        Ok(l)
    }
}

/// What one try moved: the report of each piece, in range order, and the try's wall time.
#[derive(Clone, Debug)]
pub(crate) struct Tried {
    pub(crate) pieces: Vec<TransferReport>,
    pub(crate) seconds: f64,
}

impl Tried {
    /// A try of one stream, timed by its report.
    pub(crate) fn one(r: TransferReport) -> Tried {
        Tried {
            seconds: r.seconds,
            pieces: vec![r],
        }
    }

    /// The report of the whole range: the pieces moved and the `kept` parts, each with the
    /// CRC-32C it was compared by (`Left::kept` of the try, checked), merged in range order, so
    /// that a transfer resumed or continued reports every byte of its range and the CRC of
    /// them all, the kept ones counted apart. None for a try that reported no piece.
    pub(crate) fn whole(self, kept: &[(Stripe, u32)]) -> Option<TransferReport> {
        let like = self.pieces.first()?.clone();
        let mut all = self.pieces;
        all.extend(
            kept.iter()
                .map(|(k, crc)| bridge::stripe::kept(&like, k.offset, k.len, *crc)),
        );
        all.sort_by_key(|r| (r.offset, r.bytes));
        bridge::stripe::merge(&all, self.seconds)
    }
}

/// What a resumed transfer says once its `kept` parts matched the server's bytes (`moved`:
/// "fetched" or "put"); `offset`: the range's.
pub(crate) fn resumed(offset: u64, kept: &[Stripe], moved: &str) -> String {
    let human = bridge::size::human;
    match kept {
        [k] if k.offset == offset => format!(
            "resumed after the first {} of the range, {moved} before and checked against the \
             server's checksum",
            human(k.len)
        ),
        _ => format!(
            "resumed, keeping {} {moved} before in {} parts ({}), checked against the server's \
             checksum",
            human(kept.iter().map(|k| k.len).sum()),
            kept.len(),
            kept.iter()
                .map(|k| match k.offset - offset {
                    0 => format!("the first {}", human(k.len)),
                    at => format!("{} at {}", human(k.len), human(at)),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(offset: u64, len: u64) -> Stripe {
        Stripe { offset, len }
    }

    /// The report of moving `data[range]` (verified: summed).
    fn moved(data: &[u8], at: usize, len: usize) -> TransferReport {
        TransferReport {
            op: "put",
            region: "r".into(),
            offset: at as u64,
            bytes: len as u64,
            seconds: 1.0,
            mib_per_sec: 0.0,
            direct_bytes: 0,
            bounce_bytes: len as u64,
            zero_copy_bytes: 0,
            tcp_bytes: 0,
            crc32c: Some(crc32c::crc32c(&data[at..at + len])),
            verified: true,
            first_bytes_ms: None,
            open_ms: None,
            reasked_chunks: 0,
            kept_bytes: 0,
        }
    }

    #[test]
    fn a_resumed_try_reports_the_whole_range_with_what_it_kept() {
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 29 % 241) as u8).collect();
        let crc = |a: usize, b: usize| crc32c::crc32c(&data[a..b]);
        // a striped try after one that kept a start of each of two pieces
        let mut left = Left::new(0, 50_000);
        left.wrote(&[s(0, 25_000), s(25_000, 25_000)], &[10_000, 5_000]);
        let kept = left.kept();
        assert_eq!(kept, [s(0, 10_000), s(25_000, 5_000)]);
        let tried = Tried {
            pieces: vec![moved(&data, 10_000, 15_000), moved(&data, 30_000, 20_000)],
            seconds: 0.5,
        };
        let held = [(kept[0], crc(0, 10_000)), (kept[1], crc(25_000, 30_000))];
        let r = tried.clone().whole(&held).unwrap();
        assert_eq!((r.offset, r.bytes, r.kept_bytes), (0, 50_000, 15_000));
        assert_eq!(r.crc32c, Some(crc32c::crc32c(&data)));
        assert_eq!(r.bounce_bytes, 35_000);
        assert!(r.verified && r.op == "put");
        assert!((r.mib_per_sec - 35_000.0 / 0.5 / 1048576.0).abs() < 1e-9);
        // nothing kept: the pieces' own report (two pieces apart: no range CRC)
        let alone = tried.whole(&[]).unwrap();
        assert_eq!(
            (alone.offset, alone.bytes, alone.kept_bytes),
            (10_000, 35_000, 0)
        );
        assert_eq!(alone.crc32c, None);
        // a try of one stream after a kept start, and one that had nothing left to move
        let one = Tried::one(moved(&data, 20_000, 30_000));
        let r = one.whole(&[(s(0, 20_000), crc(0, 20_000))]).unwrap();
        assert_eq!((r.offset, r.bytes, r.kept_bytes), (0, 50_000, 20_000));
        assert_eq!(r.crc32c, Some(crc32c::crc32c(&data)));
        let none_left = Tried::one(moved(&data, 50_000, 0));
        let r = none_left.whole(&[(s(0, 50_000), crc(0, 50_000))]).unwrap();
        assert_eq!((r.bytes, r.kept_bytes), (50_000, 50_000));
        assert_eq!(r.crc32c, Some(crc32c::crc32c(&data)));
        assert!(Tried {
            pieces: vec![],
            seconds: 1.0
        }
        .whole(&[])
        .is_none());
    }

    #[test]
    fn a_new_range_is_cut_as_a_striped_fetch_cuts_it() {
        let l = Left::new(100, 10 << 20);
        assert_eq!(l.kept_bytes(), 0);
        assert!(l.kept().is_empty());
        assert_eq!(l.first(), s(100, 10 << 20));
        for n in 1..5 {
            assert_eq!(
                l.spread(n, 1 << 20),
                Some(plan(100, 10 << 20, n, 1 << 20)),
                "{n}"
            );
        }
    }

    #[test]
    fn what_each_stripe_wrote_is_kept_and_the_rests_are_spread_again() {
        let mut l = Left::new(0, 8 << 20);
        let pieces = l.spread(2, 1 << 20).unwrap();
        assert_eq!(pieces, vec![s(0, 4 << 20), s(4 << 20, 4 << 20)]);
        // the first stripe wrote 3 MiB, the second all of its own
        l.wrote(&pieces, &[3 << 20, 4 << 20]);
        assert_eq!(l.kept_bytes(), 7 << 20);
        assert_eq!(l.kept(), vec![s(0, 3 << 20), s(4 << 20, 4 << 20)]);
        assert_eq!(l.first(), s(3 << 20, 1 << 20));
        // the one part left has one chunk: one connection is enough
        assert_eq!(l.spread(2, 1 << 20), Some(vec![s(3 << 20, 1 << 20)]));
        // with more chunks left it gets both connections again
        let mut l = Left::new(0, 8 << 20);
        l.wrote(&pieces, &[0, 4 << 20]);
        assert_eq!(l.kept(), vec![s(4 << 20, 4 << 20)]);
        assert_eq!(
            l.spread(2, 1 << 20),
            Some(vec![s(0, 2 << 20), s(2 << 20, 2 << 20)])
        );
    }

    #[test]
    fn connections_go_to_the_parts_with_the_most_chunks_each() {
        let mut l = Left::new(0, 16 << 20);
        let pieces = l.spread(4, 1 << 20).unwrap();
        // stripes of 4 MiB: the first wrote 1 MiB, the second 3, the third all, the fourth none
        l.wrote(&pieces, &[1 << 20, 3 << 20, 4 << 20, 0]);
        assert_eq!(
            l.kept(),
            vec![s(0, 1 << 20), s(4 << 20, 3 << 20), s(8 << 20, 4 << 20)]
        );
        // left: 3 MiB at 1 MiB, 1 MiB at 7 MiB, 4 MiB at 12 MiB; the fourth connection goes
        // to the 4 MiB part (4 chunks on one connection, against 3)
        let next = l.spread(4, 1 << 20).unwrap();
        assert_eq!(
            next,
            vec![
                s(1 << 20, 3 << 20),
                s(7 << 20, 1 << 20),
                s(12 << 20, 2 << 20),
                s(14 << 20, 2 << 20)
            ]
        );
        // pieces that touch become one part again
        l.wrote(&next, &[0, 1 << 20, 0, 0]);
        assert_eq!(l.first(), s(1 << 20, 3 << 20));
        assert_eq!(l.kept_bytes(), 9 << 20);
        assert_eq!(
            l.spread(2, 1 << 20),
            Some(vec![s(1 << 20, 3 << 20), s(12 << 20, 4 << 20)])
        );
        // more parts than connections: no try can fetch them all; it starts over
        assert_eq!(l.spread(1, 1 << 20), None);
        assert_eq!(l.spread_or_anew(1, 1 << 20), vec![s(0, 16 << 20)]);
        assert_eq!(l.kept_bytes(), 0);
    }

    #[test]
    fn a_record_gives_back_what_was_left_and_refuses_what_is_not_it() {
        let mut l = Left::new(100, 8 << 20);
        let pieces = l.spread(2, 1 << 20).unwrap();
        l.wrote(&pieces, &[1 << 20, 3 << 20]);
        let text = l.record("big");
        assert_eq!(
            Left::from_record(&text, "big", (100, 8 << 20)).as_ref(),
            Ok(&l)
        );
        // every byte fetched: no part left
        let mut all = Left::new(0, 10);
        all.wrote(&[s(0, 10)], &[10]);
        assert_eq!(
            Left::from_record(&all.record("r"), "r", (0, 10)).map(|l| l.kept_bytes()),
            Ok(10)
        );
        for (text, why) in [
            ("", "not a record"),
            ("p2p-rdma partial fetch 1\nregion other\nrange 100 8388608\n", "region 'big'"),
            ("p2p-rdma partial fetch 1\nregion big\nrange 0 8388608\n", "at offset 100"),
            (
                "p2p-rdma partial fetch 1\nregion big\nrange 100 8388608\nleft 5 x\n",
                "not a part left",
            ),
            (
                "p2p-rdma partial fetch 1\nregion big\nrange 100 8388608\nleft 50 10\n",
                "out of the range",
            ),
            (
                "p2p-rdma partial fetch 1\nregion big\nrange 100 8388608\nleft 200 10\nleft 150 10\n",
                "out of order",
            ),
            (
                "p2p-rdma partial fetch 1\nregion big\nrange 100 8388608\nleft 8388700 100\n",
                "out of the range",
            ),
        ] {
            let e = Left::from_record(text, "big", (100, 8 << 20)).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_resume_says_what_it_kept() {
        assert_eq!(
            resumed(0, &[s(0, 3 << 20)], "put"),
            "resumed after the first 3.0 MiB of the range, put before and checked against the \
             server's checksum"
        );
        assert_eq!(
            resumed(
                100,
                &[s(100, 1 << 20), s(100 + (8 << 20), 2 << 20)],
                "fetched"
            ),
            "resumed, keeping 3.0 MiB fetched before in 2 parts (the first 1.0 MiB, 2.0 MiB at \
             8.0 MiB), checked against the server's checksum"
        );
    }

    #[test]
    fn a_range_all_written_leaves_one_empty_piece_at_its_end() {
        let mut l = Left::new(10, 100);
        let pieces = l.spread(1, 64).unwrap();
        l.wrote(&pieces, &[100]);
        assert_eq!(l.kept(), vec![s(10, 100)]);
        assert_eq!(l.spread(3, 64), Some(vec![s(110, 0)]));
        assert_eq!(Left::new(7, 0).spread(2, 64), Some(vec![s(7, 0)]));
        assert!(Left::new(7, 0).kept().is_empty());
    }
}
