//! Aggregate fetch throughput of N concurrent clients in one process: each its own
//! connection, QP and registered buffer, all connected and opened first (one after the
//! other), then started at once on their share of the same bytes (`fetch_into`, zero-copy).
//! The transfer's wall time is measured apart from the set-up, so the figure is the server's
//! and the wire's, not N process start-ups.
//!
//! ```text
//! cargo run --example many_clients -- ADDR TOKEN_FILE REGION N[,N...] [MIB] [ROUNDS]
//! ```
//! With several counts (`1,8,32`), every round runs each count in turn on the same
//! connections (the first N of them), so that a slow spell of a shared host falls on all counts
//! alike; each count's rate is then compared with the first count's in the same round.
//! Prints one JSON line per count: clients, bytes, the median transfer MiB/s over ROUNDS
//! (default 3) with its spread, the median and range of the per-round ratio to the first count,
//! and the set-up time of all connections.
use std::time::Instant;

use p2p_rdma::bridge::{Client, ClientConfig};

/// The median, the smallest and the largest of `v` (not empty).
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !(4..=6).contains(&args.len()) {
        eprintln!("usage: many_clients ADDR TOKEN_FILE REGION N[,N...] [MIB] [ROUNDS]");
        std::process::exit(2);
    }
    let counts = args[3]
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<u64>, _>>()?;
    let mib: u64 = args.get(4).map_or(Ok(64), |v| v.parse())?;
    let rounds: usize = args.get(5).map_or(Ok(3), |v| v.parse())?;
    if counts.contains(&0) || rounds == 0 || mib == 0 {
        return Err("every N, MIB and ROUNDS must be at least 1".into());
    }
    let total = mib << 20;
    if let Some(n) = counts.iter().find(|&&n| total / n == 0) {
        return Err(format!("{mib} MiB cannot be shared by {n} clients").into());
    }
    let most = *counts.iter().max().expect("at least one count");
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    // set-up, one client after the other (a burst of N handshakes is not what is measured):
    // every client connected, the region opened, its buffer registered, as large as the
    // largest share it takes (client k takes part in every count above k)
    let t = Instant::now();
    let mut clients = Vec::new();
    for k in 0..most {
        let step = |e: &dyn std::fmt::Display| format!("client {} of {most}: {e}", k + 1);
        let mut c = Client::connect(ClientConfig::new(args[0].clone(), token.clone()))
            .await
            .map_err(|e| step(&e))?;
        let r = c.open(&args[2], false).await.map_err(|e| step(&e))?;
        if r.info.size < total {
            return Err(format!("region '{}' holds less than {mib} MiB", args[2]).into());
        }
        let fewest = counts.iter().filter(|&&n| n > k).min().expect("k < most");
        let buf = c
            .buffer((total / fewest) as usize)
            .await
            .map_err(|e| step(&e))?;
        clients.push((k, c, r, buf));
    }
    let setup = t.elapsed().as_secs_f64();
    let mut rates = vec![Vec::new(); counts.len()];
    for _ in 0..rounds {
        for (i, &n) in counts.iter().enumerate() {
            let share = total / n;
            let start = std::sync::Arc::new(tokio::sync::Barrier::new(n as usize + 1));
            let mut set = tokio::task::JoinSet::new();
            for (k, mut c, r, buf) in clients.drain(..n as usize) {
                let start = std::sync::Arc::clone(&start);
                set.spawn(async move {
                    start.wait().await;
                    let landed = c
                        .fetch_into(&r, k * share, share, buf, 0)
                        .await
                        .map_err(|e| format!("{n} clients, client {}: {e}", k + 1))?;
                    Ok::<_, String>((k, c, r, landed.buffer))
                });
            }
            start.wait().await;
            let t = Instant::now();
            let mut back = Vec::new();
            while let Some(j) = set.join_next().await {
                back.push(j??);
            }
            rates[i].push((share * n) as f64 / t.elapsed().as_secs_f64() / 1048576.0);
            // the clients back at the front, in their order, for the next count
            back.sort_by_key(|c| c.0);
            clients.splice(0..0, back);
        }
    }
    for (_, c, _, _) in clients {
        c.bye().await?;
    }
    for (i, &n) in counts.iter().enumerate() {
        let (median, min, max) = spread(&rates[i]);
        let ratios: Vec<f64> = rates[i].iter().zip(&rates[0]).map(|(a, b)| a / b).collect();
        let (r_median, r_min, r_max) = spread(&ratios);
        println!(
            "{}",
            serde_json::json!({
                "clients": n,
                "bytes": total / n * n,
                "mib_per_sec": median,
                "min_mib_per_sec": min,
                "max_mib_per_sec": max,
                "ratio_to_first": r_median,
                "min_ratio_to_first": r_min,
                "max_ratio_to_first": r_max,
                "first_clients": counts[0],
                "rounds": rounds,
                "setup_seconds": setup,
            })
        );
    }
    Ok(())
}
