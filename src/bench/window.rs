//! The measured part of a `--duration` run: perftest's rule, so that both tools count the same.
//!
//! perftest's `-D` runs for the whole duration but counts only completions between `margin`
//! seconds after the start and `margin` seconds before the end (its `--margin`, by default a
//! quarter of the duration): the ramp-up (the first batches, the first page faults, the CQ
//! arming) and the drain are excluded on both ends, and the rate is the count over the window.
//! [`Window`] applies the same rule to a stream of completions (one message each), and, for
//! runs made of larger calls (the bounce path's put/fetch), measures between call boundaries so
//! that no call is counted in part.

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

/// Measures a run made of calls that each move several messages: the clock starts at the end of
/// the first call that ends at or after the window's start, and every later call that ends
/// before the window's end counts, whole, up to its end.
#[derive(Debug, Clone, Default)]
pub(crate) struct CallClock {
    started: Option<f64>,
    last: f64,
    messages: u64,
}

impl CallClock {
    /// A call that moved `messages` ended `t` seconds after the start.
    pub(crate) fn ended(&mut self, w: &Window, t: f64, messages: u64) {
        if t < w.from || t >= w.to {
            return;
        }
        match self.started {
            None => self.started = Some(t),
            Some(_) => {
                self.messages += messages;
                self.last = t;
            }
        }
    }

    /// (messages counted, seconds between the first and last counted call boundaries).
    pub(crate) fn result(&self) -> (u64, f64) {
        match self.started {
            Some(s) if self.messages > 0 => (self.messages, self.last - s),
            _ => (0, 0.0),
        }
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
    fn calls_are_counted_whole_between_boundaries_inside_the_window() {
        let w = Window::of(Some(10.0), Some(2.0)).unwrap();
        let mut c = CallClock::default();
        // calls of 4 messages ending every 1.5 s: 1.5 (before), 3.0 (starts the clock), 4.5,
        // 6.0, 7.5 (counted), 9.0 (after the window)
        for i in 1..=6 {
            c.ended(&w, 1.5 * i as f64, 4);
        }
        assert_eq!(c.result(), (12, 4.5));
        let mut none = CallClock::default();
        none.ended(&w, 3.0, 4);
        assert_eq!(none.result(), (0, 0.0), "one boundary measures nothing");
    }
}
