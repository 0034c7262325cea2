//! Aggregate fetch throughput of N concurrent clients in one process: each its own
//! connection, QP and registered buffer, all connected and opened first (one after the
//! other), then all started at once on their share of the same bytes (`fetch_into`,
//! zero-copy). The transfer's wall time is
//! measured apart from the set-up, so the figure is the server's and the wire's, not N process
//! start-ups.
//!
//! ```text
//! cargo run --example many_clients -- ADDR TOKEN_FILE REGION N [MIB] [ROUNDS]
//! ```
//! Prints one JSON line: clients, bytes, the median transfer MiB/s over ROUNDS (default 3)
//! with its spread, and the set-up time.
use std::time::Instant;

use p2p_rdma::bridge::{Client, ClientConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !(4..=6).contains(&args.len()) {
        eprintln!("usage: many_clients ADDR TOKEN_FILE REGION N [MIB] [ROUNDS]");
        std::process::exit(2);
    }
    let n: u64 = args[3].parse()?;
    let mib: u64 = args.get(4).map_or(Ok(64), |v| v.parse())?;
    let rounds: usize = args.get(5).map_or(Ok(3), |v| v.parse())?;
    if n == 0 || rounds == 0 || mib == 0 {
        return Err("N, MIB and ROUNDS must be at least 1".into());
    }
    let total = mib << 20;
    let share = total / n;
    if share == 0 {
        return Err(format!("{mib} MiB cannot be shared by {n} clients").into());
    }
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    // set-up, one client after the other (a burst of N handshakes is not what is measured):
    // every client connected, the region opened, its buffer registered
    let t = Instant::now();
    let mut clients = Vec::new();
    for k in 0..n {
        let step = |e: &dyn std::fmt::Display| format!("client {} of {n}: {e}", k + 1);
        let mut c = Client::connect(ClientConfig::new(args[0].clone(), token.clone()))
            .await
            .map_err(|e| step(&e))?;
        let r = c.open(&args[2], false).await.map_err(|e| step(&e))?;
        if r.info.size < total {
            return Err(format!("region '{}' holds less than {mib} MiB", args[2]).into());
        }
        let buf = c.buffer(share as usize).await.map_err(|e| step(&e))?;
        clients.push((k, c, r, buf));
    }
    let setup = t.elapsed().as_secs_f64();
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(clients.len() + 1));
        let mut set = tokio::task::JoinSet::new();
        for (k, mut c, r, buf) in clients.drain(..) {
            let start = std::sync::Arc::clone(&start);
            set.spawn(async move {
                start.wait().await;
                let landed = c
                    .fetch_into(&r, k * share, share, buf, 0)
                    .await
                    .map_err(|e| format!("client {}: {e}", k + 1))?;
                Ok::<_, String>((k, c, r, landed.buffer))
            });
        }
        start.wait().await;
        let t = Instant::now();
        while let Some(j) = set.join_next().await {
            clients.push(j??);
        }
        rates.push((share * n) as f64 / t.elapsed().as_secs_f64() / 1048576.0);
    }
    for (_, c, _, _) in clients {
        c.bye().await?;
    }
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({
            "clients": n,
            "bytes": share * n,
            "mib_per_sec": sorted[sorted.len() / 2],
            "min_mib_per_sec": sorted[0],
            "max_mib_per_sec": sorted[sorted.len() - 1],
            "rounds": rounds,
            "setup_seconds": setup,
        })
    );
    Ok(())
}
