//! `put --continue`'s search for how much of a piece the region already holds: the longest
//! start of the piece, in whole `--chunk`s, whose every chunk matches the input. Sans-IO: the
//! caller compares the spans [`Scan::next`] names (the server's checksum against the input's)
//! and tells [`Scan::answer`] whether each matched.
//!
//! A put interrupted part way put a start of its piece, so the spans grow (one chunk, then
//! twice as long each time, up to [`STEP_CAP`]) while they match, and the first span that does
//! not is halved down to the first chunk that differs. The result is the one a compare of every
//! chunk in order would find (bytes written past the first chunk that differs, by WRITEs still
//! in flight when the put stopped, are not kept either way), in a number of round trips that
//! no longer grows with the chunk count: 64 MiB held in 4 KiB chunks took 16,384 compares one
//! chunk at a time, and takes 16 this way. The cost is bytes: up to two spans of `STEP_CAP`
//! more are summed on both sides than the region holds.

/// The longest span compared at once (rounded down to whole chunks, at least one).
pub(crate) const STEP_CAP: u64 = 16 << 20;

/// Where the search stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Spans of `step` bytes from `held` have matched so far.
    Grow { step: u64 },
    /// The `span` bytes from `held` hold a chunk that differs.
    Narrow { span: u64 },
    /// `held` is the answer.
    Done,
}

/// The search over a piece of `len` bytes in chunks of `chunk`.
#[derive(Debug, Clone)]
pub(crate) struct Scan {
    len: u64,
    chunk: u64,
    cap: u64,
    held: u64,
    phase: Phase,
}

impl Scan {
    /// A search over `len` bytes compared in whole chunks of `chunk` bytes (0 is taken as 1).
    pub(crate) fn new(len: u64, chunk: u64) -> Scan {
        let chunk = chunk.max(1);
        let cap = (STEP_CAP / chunk).max(1) * chunk;
        Scan {
            len,
            chunk,
            cap,
            held: 0,
            phase: if len == 0 {
                Phase::Done
            } else {
                Phase::Grow { step: chunk }
            },
        }
    }

    /// The next span to compare, `(offset in the piece, length)`; `None` once the search is
    /// over.
    pub(crate) fn next(&self) -> Option<(u64, u64)> {
        let n = match self.phase {
            Phase::Done => return None,
            Phase::Grow { step } => step.min(self.len - self.held),
            Phase::Narrow { span } => self.half(span),
        };
        Some((self.held, n))
    }

    /// Whether the span [`Scan::next`] named matched.
    pub(crate) fn answer(&mut self, matched: bool) {
        let Some((_, n)) = self.next() else { return };
        self.phase = match (self.phase, matched) {
            (Phase::Grow { step }, true) => {
                self.held += n;
                if self.held == self.len {
                    Phase::Done
                } else {
                    Phase::Grow {
                        step: (step * 2).min(self.cap),
                    }
                }
            }
            (Phase::Grow { .. }, false) => self.narrowed(n),
            (Phase::Narrow { span }, true) => {
                self.held += n;
                self.narrowed(span - n)
            }
            (Phase::Narrow { .. }, false) => self.narrowed(n),
            (Phase::Done, _) => Phase::Done,
        };
    }

    /// The bytes from the piece's start that matched: the answer once [`Scan::next`] is
    /// `None`.
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// A span of `span` bytes from `held` known to hold a chunk that differs: done when it is
    /// one chunk (or the piece's shorter last one), else to be halved.
    fn narrowed(&self, span: u64) -> Phase {
        if span <= self.chunk {
            Phase::Done
        } else {
            Phase::Narrow { span }
        }
    }

    /// The first half of a span longer than a chunk, in whole chunks: at least one, shorter
    /// than the span.
    fn half(&self, span: u64) -> u64 {
        (span.div_ceil(self.chunk) / 2).max(1) * self.chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search's answer and its compare count, over a piece whose chunks in `bad` differ.
    fn run(len: u64, chunk: u64, bad: &[u64]) -> (u64, usize) {
        let mut s = Scan::new(len, chunk);
        let mut asked = 0;
        while let Some((at, n)) = s.next() {
            assert!(n > 0 && at + n <= len, "{at}+{n} out of {len}");
            assert_eq!(at % chunk, 0, "a span starts on a chunk");
            assert!(n % chunk == 0 || at + n == len, "whole chunks: {at}+{n}");
            let first = at / chunk;
            let last = (at + n).div_ceil(chunk);
            s.answer(!bad.iter().any(|b| (first..last).contains(b)));
            asked += 1;
            assert!(asked < 10_000, "the search does not end");
        }
        (s.held(), asked)
    }

    /// What a compare of each chunk in order finds.
    fn linear(len: u64, chunk: u64, bad: &[u64]) -> u64 {
        let first_bad = bad.iter().copied().min().unwrap_or(u64::MAX);
        first_bad.saturating_mul(chunk).min(len)
    }

    #[test]
    fn the_search_finds_what_a_compare_of_every_chunk_in_order_finds() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..3000 {
            let chunk = [1, 3, 4096, 1 << 20][rand(4) as usize];
            let len = rand(200 * chunk) + 1;
            let chunks = len.div_ceil(chunk);
            // none, one, or several differing chunks (bytes in flight past the first)
            let bad: Vec<u64> = (0..rand(4)).map(|_| rand(chunks)).collect();
            let (held, _) = run(len, chunk, &bad);
            assert_eq!(
                held,
                linear(len, chunk, &bad),
                "len {len}, chunk {chunk}, bad {bad:?}"
            );
        }
    }

    #[test]
    fn round_trips_grow_with_the_log_of_the_chunks_not_their_count() {
        let k = 4096;
        // everything held: 4K, 8K, ..., 16M (32M - 4K), then 16M, 16M and the last 4K
        assert_eq!(run(64 << 20, k, &[]), (64 << 20, 16));
        // the last chunk differs
        let (held, asked) = run(64 << 20, k, &[(64 << 20) / k - 1]);
        assert_eq!(held, (64 << 20) - k);
        assert!(asked <= 16 + 12, "{asked}");
        // nothing held: one compare
        assert_eq!(run(64 << 20, k, &[0]), (0, 1));
        // a piece of one short chunk
        assert_eq!(run(10, k, &[]), (10, 1));
        assert_eq!(run(10, k, &[0]), (0, 1));
        assert_eq!(run(0, k, &[]), (0, 0));
    }

    #[test]
    fn a_chunk_longer_than_the_cap_is_compared_whole() {
        let chunk = 40 << 20;
        let mut s = Scan::new(100 << 20, chunk);
        assert_eq!(s.next(), Some((0, chunk)));
        s.answer(true);
        assert_eq!(s.next(), Some((chunk, chunk)));
        s.answer(true);
        assert_eq!(s.next(), Some((2 * chunk, 20 << 20)));
        s.answer(false);
        assert_eq!((s.next(), s.held()), (None, 2 * chunk));
    }
}
