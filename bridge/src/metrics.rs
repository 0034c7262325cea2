//! The server's Prometheus metrics (OpenMetrics text through the `prometheus-client` crate).
//!
//! Names follow the ecosystem's conventions: units in the name, `_total` on counters, labels by
//! region, direction and path. Bytes of the **direct** path never pass through the server's
//! CPU (the client's NIC reads or writes the region's MR): the client reports each finished
//! direct transfer on the control connection and the server counts it under `path="direct"`;
//! bounce and zero-copy window bytes are counted by the server itself when their completions
//! arrive.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// Which way bytes moved.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    /// Region → client.
    fetch,
    /// Client → region.
    put,
}

impl Direction {
    /// `put` when bytes go into the region, `fetch` when they come out.
    pub fn of(to_region: bool) -> Direction {
        if to_region {
            Direction::put
        } else {
            Direction::fetch
        }
    }
}

/// How bytes moved.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum XferPath {
    /// One-sided RDMA by the client on the region's MR (reported by the client).
    direct,
    /// Copied through the server's staging buffers.
    bounce,
    /// RDMA straight from or to device memory, by the server (a device-private window
    /// mapping) or by the client (a chunk lent from an `nvme` region's CMB ring).
    zero_copy,
    /// Over the TCP control connection (clients without an RDMA device).
    tcp,
}

/// Labels of transfer counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XferLabels {
    /// Region name.
    pub region: String,
    /// fetch or put.
    pub direction: Direction,
    /// direct, bounce or zero_copy.
    pub path: XferPath,
}

/// Labels of the latency histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    /// fetch or put.
    pub direction: Direction,
    /// direct or bounce (a bounce request with zero-copy units counts as bounce).
    pub path: XferPath,
}

/// Where a bounce request's time goes, on the server.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum BounceStage {
    /// From its arrival until a staging buffer was free for it (the ring was busy).
    queued,
    /// The copy engine: region → staging (fetch) or staging → region (put).
    copy,
    /// The server's RDMA WRITE (fetch) or READ (put) of the client's buffer: posted until its
    /// completion was taken.
    rdma,
    /// A staged fetch's memory window over a slot buffer: allocated and its bind posted, until
    /// the bind's completion was taken (the client then READs the chunk itself). Once per slot
    /// a connection uses: later chunks in the slot go under the same window.
    bind,
    /// The same for a connection's first slot, bound ahead of its first staged chunk: once its
    /// QP was connected and it had opened a region to read that has a bounce part, while the
    /// client set up its side. Off the fetch's path.
    prebind,
    /// A fetch's first chunk staged with the open that named its range
    /// (`Client::open_to_fetch`): the whole staging, from the open's reply being ready to
    /// the chunk readable (its copy and bind are also counted under `copy` and `bind`).
    /// Inside the open, before the fetch starts.
    open,
}

/// Labels of the bounce stage histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// fetch or put.
    pub direction: Direction,
    /// queued, copy, rdma, bind, prebind or open.
    pub stage: BounceStage,
}

/// Labels of error replies.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    /// The protocol's error code (`unknown-region`, `out-of-range`, ...).
    pub code: String,
}

/// Labels of per-region counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegionLabels {
    /// The region's name.
    pub region: String,
}

/// Labels of fetch and put chunks that waited for a ring slot.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RingWaitLabels {
    /// The region's name.
    pub region: String,
    /// lent (a slot came in time) or copied (through host memory after all).
    pub outcome: String,
}

/// Labels of canary results.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CanaryLabels {
    /// Region name.
    pub region: String,
    /// Registration strategy tried.
    pub strategy: String,
    /// works, canary-failed, registration-failed, not-applicable, canary-error.
    pub result: String,
}

/// Every metric of a server. Cheap to update from any task; `encode` renders the text.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    ready: AtomicBool,
    /// Bytes moved, by region, direction and path.
    pub bytes: Family<XferLabels, Counter>,
    /// Bytes that crossed the server's host memory between the region's memory and the
    /// network (bounce staging, TCP), by region, direction and path: zero on a path that is
    /// peer to peer all the way.
    pub host_memory_bytes: Family<XferLabels, Counter>,
    /// Transfers (client-reported direct transfers, bounce requests), by region, direction, path.
    pub operations: Family<XferLabels, Counter>,
    /// Transfer durations.
    pub latency: Family<LatencyLabels, Histogram>,
    /// Time of each stage of bounce requests (staged bytes only).
    pub bounce_stages: Family<StageLabels, Histogram>,
    /// Error replies sent, by code.
    pub errors: Family<CodeLabels, Counter>,
    /// Flush requests served (puts made durable), by region.
    pub flushes: Family<RegionLabels, Counter>,
    /// Fetch and put chunks that waited for a slot of their region's CMB ring, by outcome.
    pub ring_waits: Family<RingWaitLabels, Counter>,
    /// Slots of a region's CMB ring taken back from clients that held them past the limit.
    pub ring_taken_back: Family<RegionLabels, Counter>,
    /// Connections now open (authenticated or not).
    pub connections: Gauge,
    /// Connections accepted since start.
    pub connections_accepted: Counter,
    /// Connections that have not said hello yet.
    pub unauthenticated: Gauge,
    /// Connections closed before their hello to make room for newer ones.
    pub preauth_evictions: Counter,
    /// Region handles now open across connections.
    pub open_handles: Gauge,
    /// Hellos refused for a wrong token.
    pub auth_failures: Counter,
    /// Registration cache hits.
    pub regcache_hits: Counter,
    /// Registration cache misses (a registration).
    pub regcache_misses: Counter,
    /// Registration cache evictions.
    pub regcache_evictions: Counter,
    /// Bytes registered (pinned or mapped for the NIC) through the caches now.
    pub regcache_registered_bytes: Gauge,
    /// Memory windows bound (one per open of a region's direct part, when the server
    /// registers each region once).
    pub windows_bound: Counter,
    /// Bytes of the regions' shared registrations (registered once, reached through windows).
    pub shared_registered_bytes: Gauge,
    /// Canary results at start, by region, strategy and result.
    pub canary: Family<CanaryLabels, Counter>,
    /// Bytes of registered bounce staging buffers now allocated.
    pub staging_bytes: Gauge,
    /// Bytes of staging slot buffers pooled for the next connections (registered, idle).
    pub staging_pool_bytes: Gauge,
    /// Regions served.
    pub regions: Gauge,
    /// 1 once every region is proved and the listener is up.
    pub ready_gauge: Gauge,
    /// CPU time of the whole server process, user + system (read at each scrape).
    cpu_seconds: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh set, registered under the `p2p_rdma` prefix.
    pub fn new() -> Metrics {
        let m = Metrics {
            registry: Mutex::new(Registry::with_prefix("p2p_rdma")),
            ready: AtomicBool::new(false),
            bytes: Family::default(),
            host_memory_bytes: Family::default(),
            operations: Family::default(),
            latency: Family::new_with_constructor(|| {
                // 10 µs .. ~168 s
                Histogram::new(exponential_buckets(1e-5, 4.0, 13))
            }),
            bounce_stages: Family::new_with_constructor(|| {
                // 10 µs .. ~168 s
                Histogram::new(exponential_buckets(1e-5, 4.0, 13))
            }),
            errors: Family::default(),
            flushes: Family::default(),
            ring_waits: Family::default(),
            ring_taken_back: Family::default(),
            connections: Gauge::default(),
            connections_accepted: Counter::default(),
            unauthenticated: Gauge::default(),
            preauth_evictions: Counter::default(),
            open_handles: Gauge::default(),
            auth_failures: Counter::default(),
            regcache_hits: Counter::default(),
            regcache_misses: Counter::default(),
            regcache_evictions: Counter::default(),
            regcache_registered_bytes: Gauge::default(),
            windows_bound: Counter::default(),
            shared_registered_bytes: Gauge::default(),
            canary: Family::default(),
            staging_bytes: Gauge::default(),
            staging_pool_bytes: Gauge::default(),
            regions: Gauge::default(),
            ready_gauge: Gauge::default(),
            cpu_seconds: Gauge::default(),
        };
        {
            let mut r = m.registry.lock().unwrap_or_else(|p| p.into_inner());
            r.register_with_unit(
                "transferred",
                "Bytes moved, by region, direction and path (direct: reported by the client when its one-sided transfer completed; a bounce fetch's: staged for the client to read, counting a first chunk staged with an open and given back unread; zero_copy: moved by a NIC straight from or to device memory, a device-private window or a CMB ring slot lent to the client)",
                Unit::Bytes,
                m.bytes.clone(),
            );
            r.register_with_unit(
                "host_memory",
                "Bytes that crossed the server's host memory on their way between a region and the network (bounce staging buffers, the TCP connection), by region, direction and path; direct and zero-copy bytes never do",
                Unit::Bytes,
                m.host_memory_bytes.clone(),
            );
            r.register(
                "transfers",
                "Transfers (direct: client-reported; bounce: one per bounce request), by region, direction and path",
                m.operations.clone(),
            );
            r.register_with_unit(
                "transfer_duration",
                "Duration of transfers (direct: measured by the client; bounce: by the server, copy and RDMA)",
                Unit::Seconds,
                m.latency.clone(),
            );
            r.register_with_unit(
                "bounce_stage_duration",
                "Time of each stage of a bounce request on the server: queued (waiting for a staging buffer), copy (the region's copy engine), rdma (the server's RDMA of the client's buffer, posted to completion)",
                Unit::Seconds,
                m.bounce_stages.clone(),
            );
            r.register(
                "errors",
                "Error replies sent to clients, by code",
                m.errors.clone(),
            );
            r.register(
                "flushes",
                "Flush requests served, by region: a put made durable (fdatasync of a file or a namespace); puts into memory that does not persist need none",
                m.flushes.clone(),
            );
            r.register(
                "ring_waits",
                "Fetch and put chunks that found every slot of their region's CMB ring lent (or other connections waiting for the next) and waited their turn (at most 5 s), by region and outcome: lent (a slot came in time) or copied (through host memory after all)",
                m.ring_waits.clone(),
            );
            r.register(
                "ring_slots_taken_back",
                "Slots of a region's CMB ring taken back from a client that held a lent chunk longer than the server's ring hold limit while other connections wanted the ring (its window revoked), by region",
                m.ring_taken_back.clone(),
            );
            r.register(
                "connections",
                "Control connections now open",
                m.connections.clone(),
            );
            r.register(
                "connections_accepted",
                "Control connections accepted since start",
                m.connections_accepted.clone(),
            );
            r.register(
                "unauthenticated_connections",
                "Connections that have not said hello yet",
                m.unauthenticated.clone(),
            );
            r.register(
                "preauth_evictions",
                "Connections closed before their hello to make room for newer ones",
                m.preauth_evictions.clone(),
            );
            r.register(
                "open_handles",
                "Region handles now open",
                m.open_handles.clone(),
            );
            r.register(
                "auth_failures",
                "Hellos refused for a wrong token",
                m.auth_failures.clone(),
            );
            r.register(
                "regcache_hits",
                "Registration cache hits",
                m.regcache_hits.clone(),
            );
            r.register(
                "regcache_misses",
                "Registration cache misses (each one a registration)",
                m.regcache_misses.clone(),
            );
            r.register(
                "regcache_evictions",
                "Registrations evicted from the caches",
                m.regcache_evictions.clone(),
            );
            r.register_with_unit(
                "regcache_registered",
                "Bytes registered for the NIC through the registration caches now",
                Unit::Bytes,
                m.regcache_registered_bytes.clone(),
            );
            r.register(
                "windows_bound",
                "Memory windows bound on clients' QPs (one per open of a direct part)",
                m.windows_bound.clone(),
            );
            r.register_with_unit(
                "shared_registered",
                "Bytes of the regions' registrations made once and reached through memory windows",
                Unit::Bytes,
                m.shared_registered_bytes.clone(),
            );
            r.register(
                "canary_results",
                "Registration attempts at start, by region, strategy and result",
                m.canary.clone(),
            );
            r.register_with_unit(
                "bounce_staging",
                "Registered bounce staging buffers allocated now",
                Unit::Bytes,
                m.staging_bytes.clone(),
            );
            r.register_with_unit(
                "bounce_staging_pool",
                "Registered staging slot buffers idle in the per-device pool (staged fetches)",
                Unit::Bytes,
                m.staging_pool_bytes.clone(),
            );
            r.register("regions", "Regions served", m.regions.clone());
            r.register(
                "ready",
                "1 once every region is proved and the listener is up",
                m.ready_gauge.clone(),
            );
            r.register_with_unit(
                "process_cpu",
                "CPU time of the server process, user + system, from /proc/self/stat (to divide by the bytes moved)",
                Unit::Seconds,
                m.cpu_seconds.clone(),
            );
        }
        m
    }

    /// Mark the server ready (regions proved, listener up) or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
        self.ready_gauge.set(i64::from(ready));
    }

    /// Whether the server is ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Count a finished transfer.
    pub fn transfer(&self, region: &str, direction: Direction, path: XferPath, bytes: u64) {
        let l = XferLabels {
            region: region.to_string(),
            direction,
            path,
        };
        if matches!(path, XferPath::bounce | XferPath::tcp) {
            self.host_memory_bytes.get_or_create(&l).inc_by(bytes);
        }
        self.bytes.get_or_create(&l).inc_by(bytes);
        self.operations.get_or_create(&l).inc();
    }

    /// Record a transfer's duration.
    pub fn observe(&self, direction: Direction, path: XferPath, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.latency
                .get_or_create(&LatencyLabels { direction, path })
                .observe(seconds);
        }
    }

    /// Record the time of one stage of a bounce request.
    pub fn observe_stage(&self, direction: Direction, stage: BounceStage, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.bounce_stages
                .get_or_create(&StageLabels { direction, stage })
                .observe(seconds);
        }
    }

    /// Count a flush request served.
    pub fn flush(&self, region: &str) {
        self.flushes
            .get_or_create(&RegionLabels {
                region: region.to_string(),
            })
            .inc();
    }

    /// Count a fetch or put chunk that waited for a ring slot: `lent` one (or landed in
    /// one), or copied.
    pub fn ring_wait(&self, region: &str, lent: bool) {
        self.ring_waits
            .get_or_create(&RingWaitLabels {
                region: region.to_string(),
                outcome: if lent { "lent" } else { "copied" }.to_string(),
            })
            .inc();
    }

    /// Count a ring slot taken back from a client that held it too long.
    pub fn ring_taken_back(&self, region: &str) {
        self.ring_taken_back
            .get_or_create(&RegionLabels {
                region: region.to_string(),
            })
            .inc();
    }

    /// Count an error reply.
    pub fn error(&self, code: &str) {
        self.errors
            .get_or_create(&CodeLabels {
                code: code.to_string(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        if let Some(cpu) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .as_deref()
            .and_then(cpu_seconds_of_stat)
        {
            self.cpu_seconds.set(cpu);
        }
        let mut out = String::new();
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // writing into a String cannot fail
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}

/// User + system CPU seconds from the text of `/proc/<pid>/stat`: fields 14 and 15, in clock
/// ticks of USER_HZ (100 on every Linux architecture: the kernel's ABI for these fields). The
/// command name (field 2) may hold spaces and parentheses, so fields are counted after the
/// last ')'.
fn cpu_seconds_of_stat(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // after the name: field 3 (state) is the first; utime and stime are fields 14 and 15
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        let stat =
            "4242 (p2p (rdma) x) S 1 4242 4242 0 -1 4194560 1500 0 0 0 250 75 0 0 20 0 9 0 100 0 0";
        assert_eq!(cpu_seconds_of_stat(stat), Some(3.25));
        assert_eq!(cpu_seconds_of_stat("4242 (p2p) S 1"), None);
        assert_eq!(cpu_seconds_of_stat("no name here"), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(cpu_seconds_of_stat(&own).is_some(), "{own}");
        assert!(Metrics::new()
            .encode()
            .contains("p2p_rdma_process_cpu_seconds "));
    }

    #[test]
    fn exposition_has_units_totals_and_labels() {
        let m = Metrics::new();
        m.transfer("ram", Direction::fetch, XferPath::direct, 4096);
        m.transfer("ram", Direction::fetch, XferPath::direct, 4096);
        m.transfer("cmb", Direction::put, XferPath::bounce, 10);
        m.observe(Direction::fetch, XferPath::direct, 0.002);
        m.error("unknown-region");
        m.auth_failures.inc();
        m.set_ready(true);
        let t = m.encode();
        assert!(
            t.contains(r#"p2p_rdma_transferred_bytes_total{region="ram",direction="fetch",path="direct"} 8192"#),
            "{t}"
        );
        assert!(
            t.contains(r#"p2p_rdma_transfers_total{region="cmb",direction="put",path="bounce"} 1"#),
            "{t}"
        );
        // host memory: the bounce bytes, never the direct ones
        assert!(
            t.contains(
                r#"p2p_rdma_host_memory_bytes_total{region="cmb",direction="put",path="bounce"} 10"#
            ),
            "{t}"
        );
        assert!(
            !t.contains(r#"p2p_rdma_host_memory_bytes_total{region="ram""#),
            "{t}"
        );
        assert!(
            t.contains(r#"p2p_rdma_errors_total{code="unknown-region"} 1"#),
            "{t}"
        );
        assert!(t.contains("p2p_rdma_auth_failures_total 1"), "{t}");
        assert!(
            t.contains("# UNIT p2p_rdma_transfer_duration_seconds seconds"),
            "{t}"
        );
        assert!(
            t.contains(
                "p2p_rdma_transfer_duration_seconds_count{direction=\"fetch\",path=\"direct\"} 1"
            ),
            "{t}"
        );
        assert!(t.contains("p2p_rdma_ready 1"), "{t}");
        m.observe_stage(Direction::fetch, BounceStage::copy, 0.25);
        m.observe_stage(Direction::fetch, BounceStage::copy, 0.5);
        let t = m.encode();
        assert!(
            t.contains(
                "p2p_rdma_bounce_stage_duration_seconds_sum{direction=\"fetch\",stage=\"copy\"} 0.75"
            ) && t.contains(
                "p2p_rdma_bounce_stage_duration_seconds_count{direction=\"fetch\",stage=\"copy\"} 2"
            ),
            "{t}"
        );
        assert!(t.trim_end().ends_with("# EOF"), "{t}");
        m.set_ready(false);
        assert!(!m.is_ready());
    }
}
