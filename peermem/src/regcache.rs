//! A registration cache.
//!
//! Registering memory costs a system call, page pinning or IOMMU mapping; a device's BAR window
//! is small. The cache keeps registrations (`V`, e.g. an MR) keyed by the memory they cover
//! (`K`, e.g. a region id) and a byte range aligned to [`ALIGN`]:
//!
//! - a request whose range lies inside a cached entry of the same key is a **hit**;
//! - entries are evicted least recently used first when the byte or entry limits would be
//!   exceeded; an entry still **leased** (in use by an in-flight operation) is only unlinked, and
//!   deregistered when its last lease ends (lazy deregistration). Its bytes keep counting against
//!   the limit until then, so a full window makes the request fail ([`CacheError::Full`]) and the
//!   caller falls back, instead of over-committing the device;
//! - [`RegCache::invalidate`] (memory freed, region removed, device gone) unlinks matching
//!   entries at once, so later users register again, then **waits** for their leases to end and
//!   deregisters them before returning: when it returns `Ok`, nothing holds the registration.
//!
//! Pure logic (no I/O, no unsafe): what is cached is up to the caller's `register` closure.

use std::fmt;
use std::ops::{Deref, Range};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Cache keys are aligned to this (64 KiB).
pub const ALIGN: u64 = 64 << 10;

/// `range` widened to [`ALIGN`] boundaries, clipped to `0..size`.
pub fn align(range: &Range<u64>, size: u64) -> Range<u64> {
    let start = range.start / ALIGN * ALIGN;
    let end = range
        .end
        .checked_add(ALIGN - 1)
        .map_or(u64::MAX, |e| e / ALIGN * ALIGN)
        .min(size);
    start..end.max(range.end.min(size))
}

/// Limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Bytes registered at once (cached + still draining).
    pub max_bytes: u64,
    /// Entries cached at once.
    pub max_entries: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_bytes: u64::MAX,
            max_entries: 1024,
        }
    }
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Requests served by a cached entry.
    pub hits: u64,
    /// Requests that registered.
    pub misses: u64,
    /// Entries evicted by the limits.
    pub evictions: u64,
    /// Entries removed by invalidation.
    pub invalidations: u64,
    /// Requests refused because the limits were reached by entries in use.
    pub full: u64,
    /// Bytes of cached entries.
    pub cached_bytes: u64,
    /// Bytes of unlinked entries still in use (deregistered when their last lease ends).
    pub draining_bytes: u64,
    /// Entries cached.
    pub entries: u64,
}

/// Why a request was not served.
#[derive(Debug, thiserror::Error)]
pub enum CacheError<E> {
    /// The range alone exceeds the byte limit.
    #[error("{bytes} bytes exceed the registration cache's limit of {limit} bytes")]
    TooLarge {
        /// Aligned bytes asked for.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// Entries in use fill the limits: the caller should fall back or retry later.
    #[error("the registration cache is full: {in_use} bytes are in use by in-flight operations (limit {limit})")]
    Full {
        /// Bytes held by leased entries.
        in_use: u64,
        /// The limit.
        limit: u64,
    },
    /// The registration itself failed.
    #[error(transparent)]
    Register(E),
}

/// Invalidation did not finish in time: the entries are unlinked (no new user gets them), and
/// will be deregistered when their last lease ends.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{entries} registrations are still in use after {waited:?}; they are unlinked and will be released when their operations end")]
pub struct StillInUse {
    /// Entries still leased.
    pub entries: usize,
    /// How long it waited.
    pub waited: Duration,
}

struct Gate {
    users: Mutex<usize>,
    cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // a panic while holding one of these locks leaves plain counters behind: keep going
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Entry<V> {
    value: V,
    range: Range<u64>,
}

struct Slot<K, V> {
    key: K,
    entry: Arc<Entry<V>>,
    gate: Arc<Gate>,
    last_use: u64,
}

impl<K, V> Slot<K, V> {
    fn bytes(&self) -> u64 {
        self.entry.range.end - self.entry.range.start
    }
    fn in_use(&self) -> bool {
        *lock(&self.gate.users) > 0
    }
}

/// An unlinked entry still leased: only the leases keep it alive, so the last one to end
/// deregisters it.
struct Draining<K, V> {
    key: K,
    entry: Weak<Entry<V>>,
    gate: Arc<Gate>,
    bytes: u64,
}

impl<K, V> Draining<K, V> {
    fn of(s: Slot<K, V>) -> Draining<K, V> {
        Draining {
            bytes: s.bytes(),
            entry: Arc::downgrade(&s.entry),
            key: s.key,
            gate: s.gate,
        }
    }
    fn alive(&self) -> bool {
        self.entry.strong_count() > 0
    }
}

struct Inner<K, V> {
    slots: Vec<Slot<K, V>>,
    draining: Vec<Draining<K, V>>,
    tick: u64,
    stats: Stats,
}

impl<K, V> Inner<K, V> {
    /// Drop unlinked entries whose leases all ended (deregistering them).
    fn reap(&mut self) {
        let before = self.draining.len();
        self.draining.retain(Draining::alive);
        if self.draining.len() != before {
            self.stats.draining_bytes = self.draining.iter().map(|d| d.bytes).sum();
        }
    }
    fn recount(&mut self) {
        self.stats.cached_bytes = self.slots.iter().map(Slot::bytes).sum();
        self.stats.draining_bytes = self.draining.iter().map(|d| d.bytes).sum();
        self.stats.entries = self.slots.len() as u64;
    }
}

/// The cache. `K` identifies the memory (equality only); `V` is the registration.
pub struct RegCache<K, V> {
    inner: Mutex<Inner<K, V>>,
    limits: Limits,
}

impl<K: PartialEq + Clone, V> fmt::Debug for RegCache<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegCache")
            .field("limits", &self.limits)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A registration in use. While a lease lives, its registration is never deregistered;
/// invalidation waits for it.
pub struct Lease<V> {
    entry: Option<Arc<Entry<V>>>,
    gate: Arc<Gate>,
}

impl<V> Lease<V> {
    /// The aligned range the registration covers.
    pub fn range(&self) -> Range<u64> {
        self.entry.as_ref().expect("live lease").range.clone()
    }
}

impl<V> Deref for Lease<V> {
    type Target = V;
    fn deref(&self) -> &V {
        &self.entry.as_ref().expect("live lease").value
    }
}

impl<V: fmt::Debug> fmt::Debug for Lease<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("range", &self.range())
            .field("value", &**self)
            .finish()
    }
}

impl<V> Drop for Lease<V> {
    fn drop(&mut self) {
        // release the entry first, then say so: when an invalidation sees no users, no lease
        // holds the registration any more
        drop(self.entry.take());
        let mut u = lock(&self.gate.users);
        *u -= 1;
        self.gate.cv.notify_all();
    }
}

fn lease<V>(entry: &Arc<Entry<V>>, gate: &Arc<Gate>) -> Lease<V> {
    *lock(&gate.users) += 1;
    Lease {
        entry: Some(Arc::clone(entry)),
        gate: Arc::clone(gate),
    }
}

impl<K: PartialEq + Clone, V> RegCache<K, V> {
    /// An empty cache.
    pub fn new(limits: Limits) -> RegCache<K, V> {
        RegCache {
            inner: Mutex::new(Inner {
                slots: Vec::new(),
                draining: Vec::new(),
                tick: 0,
                stats: Stats::default(),
            }),
            limits,
        }
    }

    /// Counters now.
    pub fn stats(&self) -> Stats {
        let mut i = lock(&self.inner);
        i.reap();
        i.stats
    }

    /// A registration of `key` covering `want` (memory of `size` bytes): a cached one, or a new
    /// one from `register(aligned_range)`.
    pub fn get<E>(
        &self,
        key: &K,
        want: Range<u64>,
        size: u64,
        register: impl FnOnce(Range<u64>) -> Result<V, E>,
    ) -> Result<Lease<V>, CacheError<E>> {
        let mut i = lock(&self.inner);
        i.tick += 1;
        let tick = i.tick;
        i.reap();
        if let Some(s) = i.slots.iter_mut().find(|s| {
            s.key == *key && s.entry.range.start <= want.start && want.end <= s.entry.range.end
        }) {
            s.last_use = tick;
            let l = lease(&s.entry, &s.gate);
            i.stats.hits += 1;
            return Ok(l);
        }
        let range = align(&want, size);
        let bytes = range.end - range.start;
        if bytes > self.limits.max_bytes {
            return Err(CacheError::TooLarge {
                bytes,
                limit: self.limits.max_bytes,
            });
        }
        // evict least recently used entries until the new one fits
        loop {
            let used: u64 = i.slots.iter().map(Slot::bytes).sum::<u64>()
                + i.draining.iter().map(|d| d.bytes).sum::<u64>();
            if used + bytes <= self.limits.max_bytes && i.slots.len() < self.limits.max_entries {
                break;
            }
            let Some(victim) = i
                .slots
                .iter()
                .enumerate()
                .min_by_key(|(_, s)| s.last_use)
                .map(|(n, _)| n)
            else {
                i.stats.full += 1;
                return Err(CacheError::Full {
                    in_use: used,
                    limit: self.limits.max_bytes,
                });
            };
            let s = i.slots.swap_remove(victim);
            i.stats.evictions += 1;
            if s.in_use() {
                i.draining.push(Draining::of(s));
            }
            // else: dropped here, deregistered
            if i.slots.is_empty()
                && i.draining.iter().map(|d| d.bytes).sum::<u64>() + bytes > self.limits.max_bytes
            {
                i.recount();
                i.stats.full += 1;
                return Err(CacheError::Full {
                    in_use: i.stats.draining_bytes,
                    limit: self.limits.max_bytes,
                });
            }
        }
        let value = register(range.clone()).map_err(CacheError::Register)?;
        let slot = Slot {
            key: key.clone(),
            entry: Arc::new(Entry { value, range }),
            gate: Arc::new(Gate {
                users: Mutex::new(0),
                cv: Condvar::new(),
            }),
            last_use: tick,
        };
        let l = lease(&slot.entry, &slot.gate);
        i.slots.push(slot);
        i.stats.misses += 1;
        i.recount();
        Ok(l)
    }

    /// Unlink every entry whose key matches, wait (at most `timeout`) for their leases to end,
    /// and deregister them. Returns how many entries were invalidated.
    pub fn invalidate(
        &self,
        matches: impl Fn(&K) -> bool,
        timeout: Duration,
    ) -> Result<usize, StillInUse> {
        let (victims, gates) = {
            let mut i = lock(&self.inner);
            let mut out = Vec::new();
            let mut gates = Vec::new();
            let mut n = 0;
            while n < i.slots.len() {
                if matches(&i.slots[n].key) {
                    out.push(i.slots.swap_remove(n));
                } else {
                    n += 1;
                }
            }
            let mut n = 0;
            while n < i.draining.len() {
                if matches(&i.draining[n].key) {
                    gates.push(i.draining.swap_remove(n));
                } else {
                    n += 1;
                }
            }
            i.stats.invalidations += (out.len() + gates.len()) as u64;
            i.recount();
            (out, gates)
        };
        let count = victims.len() + gates.len();
        let start = Instant::now();
        let wait = |gate: &Gate| -> bool {
            let mut users = lock(&gate.users);
            while *users > 0 {
                let rest = timeout.saturating_sub(start.elapsed());
                if rest.is_zero() {
                    break;
                }
                users = gate
                    .cv
                    .wait_timeout(users, rest)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            *users > 0
        };
        let mut left = Vec::new();
        for s in victims {
            if wait(&s.gate) {
                left.push(Draining::of(s));
            }
            // else: `s` is dropped here and, no lease holding the entry, so is the registration
        }
        for d in gates {
            if wait(&d.gate) {
                left.push(d);
            }
        }
        if left.is_empty() {
            Ok(count)
        } else {
            let n = left.len();
            // still in use: the last lease of each deregisters it; its bytes count until then
            let mut i = lock(&self.inner);
            i.draining.extend(left);
            i.recount();
            Err(StillInUse {
                entries: n,
                waited: start.elapsed(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A registration that counts live instances and remembers whether it was "freed".
    #[derive(Debug)]
    struct Reg {
        live: Arc<AtomicUsize>,
        range: Range<u64>,
    }
    impl Drop for Reg {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn reg(live: &Arc<AtomicUsize>) -> impl FnOnce(Range<u64>) -> Result<Reg, std::io::Error> + '_ {
        move |range| {
            live.fetch_add(1, Ordering::SeqCst);
            Ok(Reg {
                live: Arc::clone(live),
                range,
            })
        }
    }

    #[test]
    fn aligns_to_64k_and_clips() {
        assert_eq!(align(&(1..2), 1 << 20), 0..ALIGN);
        assert_eq!(align(&(ALIGN..ALIGN + 1), 1 << 20), ALIGN..2 * ALIGN);
        assert_eq!(align(&(10..100), 50), 0..50);
        assert_eq!(align(&(0..u64::MAX), u64::MAX), 0..u64::MAX);
    }

    #[test]
    fn hits_within_a_cached_range_and_misses_outside() {
        let live = Arc::new(AtomicUsize::new(0));
        let c: RegCache<u32, Reg> = RegCache::new(Limits::default());
        let a = c.get(&1, 100..200, 1 << 20, reg(&live)).unwrap();
        assert_eq!(a.range, 0..ALIGN);
        drop(a);
        let b = c.get(&1, 1000..ALIGN, 1 << 20, reg(&live)).unwrap();
        let d = c.get(&2, 1000..ALIGN, 1 << 20, reg(&live)).unwrap();
        let e = c.get(&1, ALIGN..ALIGN + 1, 1 << 20, reg(&live)).unwrap();
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries), (1, 3, 3));
        assert_eq!(live.load(Ordering::SeqCst), 3);
        drop((b, d, e));
        // lazy: still registered
        assert_eq!(live.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn evicts_lru_and_defers_deregistration_of_entries_in_use() {
        let live = Arc::new(AtomicUsize::new(0));
        let c: RegCache<u32, Reg> = RegCache::new(Limits {
            max_bytes: 2 * ALIGN,
            max_entries: 8,
        });
        let a = c.get(&1, 0..1, 1 << 20, reg(&live)).unwrap();
        drop(c.get(&2, 0..1, 1 << 20, reg(&live)).unwrap());
        // a is the LRU and in use: unlinked but kept
        let third = c.get(&3, 0..1, 1 << 20, reg(&live)).unwrap();
        // a is the LRU and in use: unlinked but kept; 2 is idle: deregistered
        let s = c.stats();
        assert_eq!(s.evictions, 2);
        assert_eq!(s.draining_bytes, ALIGN);
        assert_eq!(live.load(Ordering::SeqCst), 2);
        // full: a (draining) + 3 (in use) fill the window; evicting 3 only moves it to draining
        let e = c.get(&4, 0..1, 1 << 20, reg(&live)).unwrap_err();
        assert!(matches!(e, CacheError::Full { .. }), "{e}");
        drop(a);
        drop(third);
        // the last lease deregistered them
        assert_eq!(live.load(Ordering::SeqCst), 0);
        let s = c.stats();
        assert_eq!(s.draining_bytes, 0);
        let _f = c.get(&4, 0..1, 1 << 20, reg(&live)).unwrap();
        assert!(live.load(Ordering::SeqCst) <= 2);
        assert!(matches!(
            c.get(&5, 0..3 * ALIGN, 1 << 20, reg(&live)),
            Err(CacheError::TooLarge { .. })
        ));
    }

    #[test]
    fn entry_limit_evicts() {
        let live = Arc::new(AtomicUsize::new(0));
        let c: RegCache<u32, Reg> = RegCache::new(Limits {
            max_bytes: u64::MAX,
            max_entries: 2,
        });
        for k in 0..5 {
            drop(c.get(&k, 0..1, 1 << 20, reg(&live)).unwrap());
        }
        assert_eq!(c.stats().evictions, 3);
        assert_eq!(live.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn invalidation_waits_for_in_flight_users_then_deregisters() {
        let live = Arc::new(AtomicUsize::new(0));
        let c: Arc<RegCache<u32, Reg>> = Arc::new(RegCache::new(Limits::default()));
        let l = c.get(&7, 0..10, 1 << 20, reg(&live)).unwrap();
        let _other = c.get(&8, 0..10, 1 << 20, reg(&live)).unwrap();
        let user = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            // the in-flight operation still sees valid memory
            assert_eq!(l.range.end, ALIGN);
            drop(l);
        });
        let n = c.invalidate(|k| *k == 7, Duration::from_secs(10)).unwrap();
        assert_eq!(n, 1);
        // when invalidate returns, the registration is gone
        assert_eq!(live.load(Ordering::SeqCst), 1);
        user.join().unwrap();
        // a later user registers again
        let again = c.get(&7, 0..10, 1 << 20, reg(&live)).unwrap();
        assert_eq!(c.stats().misses, 3);
        drop(again);
    }

    #[test]
    fn invalidation_timeout_keeps_the_entry_until_its_last_user() {
        let live = Arc::new(AtomicUsize::new(0));
        let c: RegCache<u32, Reg> = RegCache::new(Limits::default());
        let l = c.get(&1, 0..10, 100, reg(&live)).unwrap();
        let e = c
            .invalidate(|_| true, Duration::from_millis(10))
            .unwrap_err();
        assert_eq!(e.entries, 1);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        assert_eq!(c.stats().draining_bytes, 100);
        // not handed out again
        let fresh = c.get(&1, 0..10, 100, reg(&live)).unwrap();
        assert_eq!(live.load(Ordering::SeqCst), 2);
        drop(l);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        assert_eq!(c.stats().draining_bytes, 0);
        drop(fresh);
    }

    #[test]
    fn many_threads_never_see_a_deregistered_entry() {
        let live = Arc::new(AtomicUsize::new(0));
        let c: Arc<RegCache<u32, Reg>> = Arc::new(RegCache::new(Limits {
            max_bytes: 4 * ALIGN,
            max_entries: 3,
        }));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let c = Arc::clone(&c);
                let live = Arc::clone(&live);
                std::thread::spawn(move || {
                    for n in 0..200u32 {
                        let k = (n + t) % 5;
                        if n % 17 == 0 {
                            let _ = c.invalidate(|x| *x == k, Duration::from_millis(1));
                        }
                        if let Ok(l) = c.get(&k, 0..1, 1 << 20, reg(&live)) {
                            // a lease always refers to a live registration
                            assert!(l.live.load(Ordering::SeqCst) >= 1);
                            assert_eq!(l.range.start, 0);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let _ = c.invalidate(|_| true, Duration::from_secs(5));
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }
}
