//! Trying a transfer again after a failure that a new connection may get past
//! ([`Error::is_transient`]): tries left, a wait that doubles, and the reconnect and the new
//! open of the region.

use std::sync::Arc;
use std::time::Duration;

use super::{Client, OpenFor, OpenRegion};
use crate::error::Error;

/// The longest wait between two tries.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// Where each retry is said besides the log.
type Say = Arc<dyn Fn(&str) + Send + Sync>;

/// Tries left for a transfer, and the wait before the next (twice the one before each time, at
/// most 30 s). Each retry is logged at `warn` level, or said through the hook of
/// [`Retries::saying`] (a command line prints it) and logged at `debug` level.
#[derive(Clone)]
pub struct Retries {
    left: u32,
    wait: Duration,
    done: u32,
    say: Option<Say>,
}

impl std::fmt::Debug for Retries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retries")
            .field("left", &self.left)
            .field("wait", &self.wait)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Retries {
    /// Up to `tries` more tries, the first after `first_wait`.
    pub fn new(tries: u32, first_wait: Duration) -> Retries {
        Retries {
            left: tries,
            wait: first_wait,
            done: 0,
            say: None,
        }
    }

    /// No retry: a transfer fails with its first failure.
    pub fn none() -> Retries {
        Retries::new(0, Duration::ZERO)
    }

    /// Say each retry, and why, through `say` (then logged at `debug` level only, so that a
    /// program that prints it and logs warnings does not say it twice).
    pub fn saying(mut self, say: impl Fn(&str) + Send + Sync + 'static) -> Retries {
        self.say = Some(Arc::new(say));
        self
    }

    /// Tries used so far.
    pub fn done(&self) -> u32 {
        self.done
    }

    /// Tries left.
    pub fn left(&self) -> u32 {
        self.left
    }

    fn say(&self, what: &str) {
        match &self.say {
            Some(say) => {
                tracing::debug!("{what}");
                say(what);
            }
            None => tracing::warn!("{what}"),
        }
    }

    /// Use one of the tries left (there must be one): say `why` with the wait and the count,
    /// and wait.
    pub async fn take_turn(&mut self, why: &str) {
        self.left = self.left.saturating_sub(1);
        self.done += 1;
        self.say(&format!(
            "{why} in {:.1} s (retry {} of {})",
            self.wait.as_secs_f64(),
            self.done,
            self.done + self.left
        ));
        tokio::time::sleep(self.wait).await;
        self.wait = (self.wait * 2).min(MAX_WAIT);
    }

    /// After `e` ended the transfer `what`: if it is worth another try and tries are left,
    /// wait, connect `c` again and open `region` again for `purpose`. None: give up with `e`
    /// (not transient, no try left, or the new connection's open was refused outright).
    pub async fn again(
        &mut self,
        c: &mut Client,
        e: &Error,
        what: &str,
        region: &str,
        purpose: OpenFor,
    ) -> Option<OpenRegion> {
        let mut why = e.to_string();
        if !e.is_transient() {
            return None;
        }
        while self.left > 0 {
            self.take_turn(&format!("the {what} failed ({why}); connecting again"))
                .await;
            let opened = match c.reconnect().await {
                Ok(()) => c.open_for(region, purpose).await,
                Err(e) => Err(e),
            };
            match opened {
                Ok(r) => return Some(r),
                Err(e) if e.is_transient() => why = e.to_string(),
                Err(e) => {
                    self.say(&format!("connected again, but: {e}"));
                    return None;
                }
            }
        }
        if self.done > 0 {
            self.say(&format!(
                "no retry left after {}; the last failure: {why}",
                self.done
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[tokio::test(start_paused = true)]
    async fn each_turn_waits_twice_as_long_up_to_the_cap_and_says_so() {
        let said = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&said);
        let mut r = Retries::new(7, Duration::from_secs(4))
            .saying(move |s| log.lock().unwrap().push(s.to_string()));
        let start = tokio::time::Instant::now();
        for _ in 0..5 {
            r.take_turn("the fetch failed").await;
        }
        // 4 + 8 + 16 + 30 + 30
        assert_eq!(start.elapsed(), Duration::from_secs(88));
        assert_eq!((r.done(), r.left()), (5, 2));
        let said = said.lock().unwrap();
        assert_eq!(said[0], "the fetch failed in 4.0 s (retry 1 of 7)");
        assert_eq!(said[4], "the fetch failed in 30.0 s (retry 5 of 7)");
    }
}
