//! `p2p-rdma bench`: an ib_write_bw / ib_read_bw / ib_send_bw / ib_*_lat-style benchmark
//! between two hosts.
//!
//! The server waits on a TCP port (perftest's 18515 by default); the client connects, sends the
//! parameters, and both sides set up RC QPs (one or more) and exchange their endpoints and
//! memory keys over that connection. Bandwidth runs keep `tx_depth` work requests in flight per
//! QP and post every free slot in one batch (one doorbell: on rxe one system call per batch
//! instead of one per work request). Latency runs ping-pong one message at a time.
//!
//! The server's memory (`--mem` on the server) may be any region spec of `serve`. When its
//! registration is proved direct, the client's one-sided operations target it; when it is not
//! (a bounce path), the server serves it through the bridge's bounce pipeline and the client
//! measures `put` (write) / `fetch` (read) transfers of each size, so the `path` column says
//! which path the numbers are for.

use serde::{Deserialize, Serialize};
use verbs::{CqMode, QpOptions};

mod bridged;
mod client;
mod control;
mod lat;
mod pong;
mod report;
mod server;
mod settle;
mod window;

use client::*;
pub use client::{run_client, ClientOpts};
use control::*;
use report::*;
pub use report::{header, row};
use server::*;
pub use server::{serve_one, ServerMem};
use window::{ByteClock, Window};

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchOp {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND / RECV.
    Send,
}

impl BenchOp {
    /// perftest's name for the same test.
    pub fn perftest(self, lat: bool) -> &'static str {
        match (self, lat) {
            (BenchOp::Write, false) => "ib_write_bw",
            (BenchOp::Read, false) => "ib_read_bw",
            (BenchOp::Send, false) => "ib_send_bw",
            (BenchOp::Write, true) => "ib_write_lat",
            (BenchOp::Read, true) => "ib_read_lat",
            (BenchOp::Send, true) => "ib_send_lat",
        }
    }
}

/// The parameters the client sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchParams {
    /// Operation.
    pub op: BenchOp,
    /// Message sizes, in order.
    pub sizes: Vec<u64>,
    /// Work requests per QP per size (bandwidth) or round trips (latency).
    pub iters: Option<u64>,
    /// Or seconds per size.
    pub duration: Option<f64>,
    /// Seconds of a `duration` run not counted at each end (warm-up and drain, perftest's
    /// `--margin`); `None`: a quarter of the duration, as perftest.
    #[serde(default)]
    pub margin: Option<f64>,
    /// Work requests in flight per QP.
    pub tx_depth: u32,
    /// Queue pairs.
    pub qps: u32,
    /// Both directions at once (write and read).
    pub bidir: bool,
    /// Latency mode.
    pub lat: bool,
    /// Check the data at the end of each size.
    pub validate: bool,
    /// Ask for a completion every this many work requests (perftest's `--cq-mod`); 0: by size
    /// (see [`BenchParams::signal_every`]).
    #[serde(default)]
    pub cq_mod: u32,
    /// Busy-poll the completion queues on both sides (perftest's default) instead of sleeping
    /// on completion events.
    #[serde(default)]
    pub poll: bool,
    /// Messages of at most this many bytes go inline in their work request (perftest's
    /// `--inline_size`); `None`: perftest's defaults (see [`BenchParams::inline_size`]).
    #[serde(default)]
    pub inline: Option<u32>,
    /// RDMA READs in flight at once per QP (perftest's `--outs`); `None`: as many as the
    /// device allows, as perftest.
    #[serde(default)]
    pub outs: Option<u32>,
}

impl BenchParams {
    /// Reject nonsense before anything is set up.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.sizes.is_empty() {
            return Err("no message size".into());
        }
        if let Some(&s) = self.sizes.iter().find(|&&s| s == 0 || s > (1 << 30)) {
            return Err(format!("message size {s} is outside 1 byte .. 1 GiB"));
        }
        if self.tx_depth == 0 || self.tx_depth > 4096 {
            return Err(format!(
                "--tx-depth must be 1..=4096, not {}",
                self.tx_depth
            ));
        }
        if self.cq_mod > self.tx_depth {
            return Err(format!(
                "--cq-mod {} is larger than --tx-depth {}: the window would never refill",
                self.cq_mod, self.tx_depth
            ));
        }
        if self.qps == 0 || self.qps > 64 {
            return Err(format!("--qps must be 1..=64, not {}", self.qps));
        }
        match (self.iters, self.duration) {
            (Some(0), _) => return Err("--iters must be at least 1".into()),
            (_, Some(d)) if !(d > 0.0 && d <= 3600.0) => {
                return Err(format!("--duration must be in (0, 3600] seconds, not {d}"))
            }
            (None, None) => return Err("give --iters or --duration".into()),
            _ => {}
        }
        match (self.margin, self.duration) {
            (Some(_), None) => return Err("--margin is for --duration runs".into()),
            (Some(m), Some(d)) if !(m >= 0.0 && 2.0 * m < d) => {
                return Err(format!(
                    "--margin {m} must be at least 0 and leave time to measure: under half of --duration {d}"
                ))
            }
            _ => {}
        }
        if self.inline.is_some_and(|n| n > 1024) {
            return Err("--inline-size is at most 1024 bytes (devices carry a few hundred)".into());
        }
        if self.outs.is_some_and(|n| n == 0 || n > 255) {
            return Err("--outs must be 1..=255 (the device may allow fewer)".into());
        }
        if self.bidir && (self.lat || self.op == BenchOp::Send) {
            return Err("--bidir is for write and read bandwidth runs".into());
        }
        if self.lat && self.qps > 1 {
            return Err("latency runs use one QP".into());
        }
        Ok(())
    }

    /// The inline size in effect: `inline`, or perftest's defaults: latency runs carry WRITEs
    /// of up to 220 bytes and SENDs of up to 236 inline, bandwidth runs nothing. READs never
    /// (their local buffer is a destination).
    pub fn inline_size(&self) -> u32 {
        match (self.op, self.inline, self.lat) {
            (BenchOp::Read, ..) => 0,
            (_, Some(n), _) => n,
            (BenchOp::Write, None, true) => 220,
            (BenchOp::Send, None, true) => 236,
            _ => 0,
        }
    }

    /// Whether messages of `size` bytes go inline.
    pub(crate) fn goes_inline(&self, size: usize) -> bool {
        size <= self.inline_size() as usize
    }

    fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1) as usize
    }

    /// Work requests per completion for messages of `size` bytes: `--cq-mod`, or by default
    /// one completion per 256 KiB moved, at most a quarter of `tx_depth` work requests apart
    /// (so the window refills while the rest is in flight). Large messages are each signaled:
    /// their completion costs nothing next to their transfer, and a duration run counts only
    /// completed messages, so coarser signals would under-count the last ones.
    pub fn signal_every(&self, size: u64) -> usize {
        match self.cq_mod {
            0 => {
                ((256 << 10) / size.max(1)).clamp(1, (u64::from(self.tx_depth) / 4).max(1)) as usize
            }
            n => n as usize,
        }
    }
}

/// perftest's `--all`: 2 B to 8 MiB in powers of two.
pub fn all_sizes() -> Vec<u64> {
    (1..=23).map(|i| 1u64 << i).collect()
}

/// The result for one size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SizeResult {
    /// Operation.
    pub op: BenchOp,
    /// Bytes per message.
    pub bytes: u64,
    /// Messages completed (all QPs; both directions with --bidir).
    pub iterations: u64,
    /// Best throughput over a window of `tx_depth` completions, MiB/s.
    pub bw_peak_mib_s: f64,
    /// Average throughput, MiB/s.
    pub bw_avg_mib_s: f64,
    /// Messages per second, millions.
    pub msg_rate_mpps: f64,
    /// Seconds measured.
    pub seconds: f64,
    /// direct / bounce / mixed: the server memory's path.
    pub path: String,
    /// Registration strategy of the server memory (pinned, odp, dma-buf) or the bounce copy
    /// engine.
    pub strategy: String,
    /// QPs.
    pub qps: u32,
    /// Work requests in flight per QP.
    pub tx_depth: u32,
    /// READ runs: the READs the QPs kept in flight at once (`--outs` within the device's
    /// limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outs: Option<u32>,
    /// How completions were waited for: `events` (sleep on the completion channel) or
    /// `polling` (busy-poll, --poll). The bounce path's pipeline always uses events. A
    /// polled WRITE ping-pong (--lat --poll) reports `memory`: each side polled the last byte
    /// of the message in its own memory, as ib_write_lat.
    #[serde(default)]
    pub cq: String,
    /// Whether --validate ran and the data matched.
    pub validated: Option<bool>,
    /// Latency: minimum, µs (one way for write and send ping-pong, as perftest; full for read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_min_us: Option<f64>,
    /// Latency: median.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_median_us: Option<f64>,
    /// Latency: 99th percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_p99_us: Option<f64>,
    /// Latency: 99.9th percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_p999_us: Option<f64>,
    /// Latency: maximum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_max_us: Option<f64>,
    /// Latency: average.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_avg_us: Option<f64>,
    /// The bounce path: the share of the bytes measured that the server's NIC moved from or
    /// into the memory itself instead of through host staging: reads lent (chunks read from
    /// page starts, as `serve` lends them), writes landed (READs of the client's buffer into
    /// the memory from page starts, as `serve` lands puts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lent_fraction: Option<f64>,
}

/// Errors of a benchmark run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Verbs.
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    /// The control connection.
    #[error("control connection: {0}")]
    Control(String),
    /// The server cannot be reached.
    #[error("{0}")]
    Unreachable(String),
    /// Bad parameters or memory.
    #[error("{0}")]
    Config(String),
    /// The peer reported an error.
    #[error("the server says: {0}")]
    Peer(String),
    /// The bridge (bounce path).
    #[error(transparent)]
    Bridge(#[from] bridge::Error),
}

type Result<T> = std::result::Result<T, BenchError>;

/// The reproducible byte pattern both sides check against.
pub fn pattern(len: usize) -> Vec<u8> {
    pattern_from(len, 0x9e37_79b9)
}

/// `len` pseudo-random bytes (xorshift), reproducible from `seed`; each seed its own bytes.
pub fn pattern_from(len: usize, seed: u32) -> Vec<u8> {
    // a state that is never zero and differs for every seed (with `seed | 1`, seeds 2k and
    // 2k + 1 made the same bytes, and tests that wrote one over the other saw no change)
    let mut x = (u64::from(seed) << 1) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// One side's device setup.
#[derive(Debug, Clone, Default)]
pub struct Side {
    /// RDMA device.
    pub device: Option<String>,
    /// GID index, traffic class, service level and ACK timeout.
    pub path: bridge::QpPath,
    /// Port.
    pub ib_port: Option<u8>,
}

fn qp_options(side: &Side, p: &BenchParams, recv: u32) -> QpOptions {
    let opts = QpOptions {
        max_send_wr: p.tx_depth.max(2),
        max_recv_wr: recv.max(2),
        port: side.ib_port,
        max_inline_data: p.inline_size(),
        // the QP takes the device's limit where it is lower
        max_rd_atomic: p.outs.map_or(u8::MAX, |n| n.min(255) as u8),
        // a latency run waits on a thread of its own, both sides: spinning, or sleeping on
        // the completion channel with no runtime thread woken by each event
        cq_mode: if p.poll {
            CqMode::Polling
        } else if p.lat {
            CqMode::Blocking
        } else {
            CqMode::Events
        },
        ..QpOptions::default()
    };
    side.path.apply(opts, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_seed_makes_its_own_pattern() {
        let firsts: std::collections::HashSet<Vec<u8>> =
            (0..256).map(|seed| pattern_from(64, seed)).collect();
        assert_eq!(firsts.len(), 256);
        assert_eq!(pattern_from(1000, 7), pattern_from(1000, 7));
        // not one byte value over and over
        let p = pattern(4096);
        assert!(p.iter().collect::<std::collections::HashSet<_>>().len() > 200);
    }

    fn params() -> BenchParams {
        BenchParams {
            op: BenchOp::Write,
            sizes: vec![65536],
            iters: Some(100),
            duration: None,
            margin: None,
            tx_depth: 128,
            qps: 1,
            bidir: false,
            lat: false,
            validate: false,
            cq_mod: 0,
            poll: false,
            inline: None,
            outs: None,
        }
    }

    #[test]
    fn parameters_are_checked() {
        assert!(params().check().is_ok());
        let bad = |f: &dyn Fn(&mut BenchParams), why: &str| {
            let mut p = params();
            f(&mut p);
            let e = p.check().unwrap_err();
            assert!(e.contains(why), "{e}");
        };
        bad(&|p| p.sizes = vec![0], "outside");
        bad(&|p| p.sizes.clear(), "no message size");
        bad(&|p| p.tx_depth = 0, "--tx-depth");
        bad(&|p| p.qps = 0, "--qps");
        bad(&|p| p.cq_mod = 129, "never refill");
        assert_eq!(params().signal_every(2), 32);
        assert_eq!(params().signal_every(65536), 4);
        assert_eq!(params().signal_every(1 << 20), 1);
        let mut p = params();
        p.cq_mod = 3;
        assert_eq!(p.signal_every(2), 3);
        bad(&|p| p.iters = Some(0), "--iters");
        bad(
            &|p| {
                p.iters = None;
                p.duration = None
            },
            "--iters or --duration",
        );
        bad(
            &|p| {
                p.iters = None;
                p.duration = Some(-1.0)
            },
            "--duration",
        );
        bad(&|p| p.margin = Some(1.0), "for --duration runs");
        bad(&|p| p.inline = Some(4096), "--inline-size");
        bad(&|p| p.outs = Some(0), "--outs");
        bad(&|p| p.outs = Some(256), "--outs");
        let outs = |n| {
            qp_options(
                &Side::default(),
                &BenchParams {
                    outs: n,
                    ..params()
                },
                2,
            )
        };
        assert_eq!(
            outs(None).max_rd_atomic,
            255,
            "the device's limit, as perftest"
        );
        assert_eq!(outs(Some(16)).max_rd_atomic, 16);
        let lat = |op| BenchParams {
            op,
            lat: true,
            ..params()
        };
        assert_eq!(lat(BenchOp::Write).inline_size(), 220, "perftest's default");
        assert_eq!(lat(BenchOp::Send).inline_size(), 236);
        assert_eq!(
            lat(BenchOp::Read).inline_size(),
            0,
            "a READ's buffer is written"
        );
        assert_eq!(params().inline_size(), 0, "bandwidth: none unless asked");
        let p = BenchParams {
            inline: Some(64),
            ..params()
        };
        assert!(p.goes_inline(64) && !p.goes_inline(65));
        bad(
            &|p| {
                p.iters = None;
                p.duration = Some(4.0);
                p.margin = Some(2.0)
            },
            "under half of --duration",
        );
        bad(
            &|p| {
                p.op = BenchOp::Send;
                p.bidir = true
            },
            "--bidir",
        );
        bad(
            &|p| {
                p.lat = true;
                p.qps = 2
            },
            "one QP",
        );
    }

    #[test]
    fn send_runs_keep_perftests_receive_depth_within_memory() {
        let slots = |size: u64, tx_depth, qps| {
            server::recv_slots(&BenchParams {
                op: BenchOp::Send,
                sizes: vec![size],
                tx_depth,
                qps,
                ..params()
            })
        };
        assert_eq!(slots(65536, 32, 1), 512, "perftest's 512, above the depth");
        assert_eq!(slots(2, 1024, 1), 1024, "a deeper window gets as many");
        assert_eq!(slots(1 << 20, 128, 1), 128, "128 MiB of buffers");
        assert_eq!(slots(65536, 128, 8), 256, "shared by the QPs");
        assert_eq!(slots(1 << 30, 128, 1), 2, "never fewer than two");
    }

    #[test]
    fn sizes_and_rows() {
        let s = all_sizes();
        assert_eq!((s[0], *s.last().unwrap(), s.len()), (2, 8 << 20, 23));
        let r = result(
            &params(),
            65536,
            1000,
            1.0,
            80.0,
            "direct",
            "pinned",
            Some(true),
        );
        assert!((r.bw_avg_mib_s - 62.5).abs() < 1e-9);
        assert!((r.msg_rate_mpps - 0.001).abs() < 1e-12);
        assert_eq!(r.bw_peak_mib_s, 80.0);
        assert!(row(&r, false).contains("validated"));
        let g = row(&r, true);
        assert!(g.contains("0.52"), "{g}"); // 62.5 MiB/s = 0.524 Gb/s
        let l = lat_result(
            &BenchParams {
                lat: true,
                ..params()
            },
            2,
            &[5.0, 1.0, 3.0, 2.0, 4.0],
            "direct",
            "pinned",
        );
        assert_eq!(
            (l.t_min_us, l.t_median_us, l.t_max_us),
            (Some(1.0), Some(3.0), Some(5.0))
        );
        assert_eq!(l.t_avg_us, Some(3.0));
    }

    #[test]
    fn the_pattern_is_reproducible() {
        assert_eq!(pattern(1000), pattern(1000));
        assert_eq!(&pattern(1000)[..10], &pattern(10)[..]);
        assert!(pattern(4096).iter().any(|&b| b != pattern(4096)[0]));
    }
}
