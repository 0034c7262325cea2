//! Results: per-size figures and the perftest-style table.

use super::*;

#[allow(clippy::too_many_arguments)]
pub(super) fn result(
    p: &BenchParams,
    size: u64,
    iterations: u64,
    seconds: f64,
    peak: f64,
    path: &str,
    strategy: &str,
    validated: Option<bool>,
) -> SizeResult {
    let avg = if seconds > 0.0 {
        (iterations * size) as f64 / seconds / (1 << 20) as f64
    } else {
        0.0
    };
    SizeResult {
        op: p.op,
        bytes: size,
        iterations,
        bw_peak_mib_s: peak.max(avg),
        bw_avg_mib_s: avg,
        msg_rate_mpps: if seconds > 0.0 {
            iterations as f64 / seconds / 1e6
        } else {
            0.0
        },
        seconds,
        path: path.into(),
        strategy: strategy.into(),
        qps: p.qps,
        tx_depth: p.tx_depth,
        outs: None,
        cq: if p.poll && path != "bounce" {
            "polling"
        } else {
            "events"
        }
        .into(),
        validated,
        t_min_us: None,
        t_median_us: None,
        t_p99_us: None,
        t_p999_us: None,
        t_max_us: None,
        t_avg_us: None,
        lent_fraction: None,
    }
}

pub(super) fn lat_result(
    p: &BenchParams,
    size: u64,
    times: &[f64],
    path: &str,
    strategy: &str,
) -> SizeResult {
    let mut t = times.to_vec();
    t.sort_by(|a, b| a.total_cmp(b));
    let q = |f: f64| -> Option<f64> {
        if t.is_empty() {
            None
        } else {
            Some(t[((t.len() as f64 - 1.0) * f).round() as usize])
        }
    };
    let total: f64 = t.iter().sum();
    let mut r = result(
        p,
        size,
        t.len() as u64,
        total / 1e6,
        0.0,
        path,
        strategy,
        None,
    );
    r.bw_peak_mib_s = 0.0;
    r.bw_avg_mib_s = 0.0;
    r.t_min_us = q(0.0);
    r.t_median_us = q(0.5);
    r.t_p99_us = q(0.99);
    r.t_p999_us = q(0.999);
    r.t_max_us = q(1.0);
    r.t_avg_us = (!t.is_empty()).then(|| total / t.len() as f64);
    r
}

/// perftest's table header.
pub fn header(lat: bool, gbits: bool) -> String {
    let line = "-".repeat(100);
    if lat {
        format!("{line}\n #bytes  #iterations  t_min[usec]  t_max[usec]  t_typical[usec]  t_avg[usec]  99% percentile[usec]  99.9% percentile[usec]  path    strategy\n")
    } else {
        let u = if gbits { "Gb/sec" } else { "MiB/sec" };
        format!("{line}\n #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]   path     strategy\n")
    }
}

/// One row of the table.
pub fn row(r: &SizeResult, gbits: bool) -> String {
    if r.t_median_us.is_some() {
        let f = |v: Option<f64>| v.unwrap_or(0.0);
        format!(
            " {:<8} {:<12} {:<12.2} {:<12.2} {:<16.2} {:<12.2} {:<21.2} {:<23.2} {:<7} {}{}\n",
            r.bytes,
            r.iterations,
            f(r.t_min_us),
            f(r.t_max_us),
            f(r.t_median_us),
            f(r.t_avg_us),
            f(r.t_p99_us),
            f(r.t_p999_us),
            r.path,
            r.strategy,
            match r.validated {
                Some(true) => "  (validated)",
                Some(false) => "  (DATA MISMATCH)",
                None => "",
            }
        )
    } else {
        let conv = |mib: f64| {
            if gbits {
                mib * (1 << 20) as f64 * 8.0 / 1e9
            } else {
                mib
            }
        };
        format!(
            " {:<10} {:<14} {:<16.2} {:<19.2} {:<15.6} {:<8} {}{}{}\n",
            r.bytes,
            r.iterations,
            conv(r.bw_peak_mib_s),
            conv(r.bw_avg_mib_s),
            r.msg_rate_mpps,
            r.path,
            r.strategy,
            r.lent_fraction
                .map(|f| format!("  ({:.0}% zero-copy, not through host staging)", f * 100.0))
                .unwrap_or_default(),
            match r.validated {
                Some(true) => "  (validated)",
                Some(false) => "  (DATA MISMATCH)",
                None => "",
            }
        )
    }
}
