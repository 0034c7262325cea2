//! The measured part of a `--duration` run: perftest's rule, so that both tools count the same.
//!
//! perftest's `-D` runs for the whole duration but counts only completions between `margin`
//! seconds after the start and `margin` seconds before the end (its `--margin`, by default a
//! quarter of the duration): the ramp-up (the first batches, the first page faults, the CQ
//! arming) and the drain are excluded on both ends, and the rate is the count over the window.
//! [`Window`] applies the same rule to a stream of completions (one message each), and
//! [`ByteClock`] to runs made of larger calls (the bounce path's put/fetch), by the pieces
//! that land inside the window.

/// Seconds from the start of a run at which counting starts and stops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Window {
    from: f64,
    to: f64,
}

impl Window {
    /// The window of a run of `duration` seconds with `margin` seconds excluded at each end
    /// (`None`: a quarter of the duration, as perftest). `None` for `--iters` runs: every
    /// message counts.
    pub(crate) fn of(duration: Option<f64>, margin: Option<f64>) -> Option<Self> {
        let d = duration?;
        let m = margin.unwrap_or(d / 4.0);
        Some(Window { from: m, to: d - m })
    }

    /// Seconds of the window.
    pub(crate) fn seconds(&self) -> f64 {
        self.to - self.from
    }

    /// Whether a completion `t` seconds after the start counts.
    pub(crate) fn counts(&self, t: f64) -> bool {
        t >= self.from && t < self.to
    }
}

/// Measures a run made of calls that each move several messages (the bounce path's put and
/// fetch) by the bytes each call reports as they land: every piece that lands inside the window
/// counts, as perftest counts each completion, however long the calls around it are.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ByteClock {
    bytes: u64,
}

impl ByteClock {
    /// `bytes` landed `t` seconds after the start.
    pub(crate) fn landed(&mut self, w: &Window, t: f64, bytes: u64) {
        if w.counts(t) {
            self.bytes += bytes;
        }
    }

    /// Bytes that landed inside the window.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_run_counts_the_middle_half_by_default_as_perftest() {
        let w = Window::of(Some(4.0), None).unwrap();
        assert_eq!(w.seconds(), 2.0);
        assert!(!w.counts(0.5), "ramp-up");
        assert!(w.counts(1.0));
        assert!(w.counts(2.999));
        assert!(!w.counts(3.0), "drain");
        let w = Window::of(Some(4.0), Some(0.0)).unwrap();
        assert!(w.counts(0.0) && w.seconds() == 4.0);
        assert_eq!(
            Window::of(None, Some(1.0)),
            None,
            "--iters: everything counts"
        );
    }

    #[test]
    fn pieces_count_by_when_they_land_not_by_their_calls() {
        let w = Window::of(Some(8.0), Some(2.0)).unwrap();
        let mut c = ByteClock::default();
        // one long call landing a piece of 10 bytes every 0.5 s from 0.5 to 8.0: the pieces at
        // 2.0 ... 5.5 land inside the window [2, 6)
        for i in 1..=16 {
            c.landed(&w, 0.5 * i as f64, 10);
        }
        assert_eq!(c.bytes(), 80);
        assert_eq!(
            ByteClock::default().bytes(),
            0,
            "nothing landed: nothing counted"
        );
    }
}
