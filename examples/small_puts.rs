//! Latency of small puts on one connection: N puts of SIZE bytes, one after the other, into
//! each REGION given, each put timed twice, interleaved: as `put` does it, and followed by an
//! explicit `flush` (what every put did before puts into memory that does not persist stopped
//! asking for one). Connection, open and staging buffers are set up first.
//!
//! ```text
//! cargo run --example small_puts -- ADDR TOKEN_FILE N SIZE REGION [REGION...]
//! ```
//! Prints one JSON line per region and mode: the median, p90 and max time in microseconds.
use std::time::Instant;

use p2p_rdma::bridge::{Client, ClientConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        eprintln!("usage: small_puts ADDR TOKEN_FILE N SIZE REGION [REGION...]");
        std::process::exit(2);
    }
    let n: usize = args[2].parse()?;
    let size: usize = args[3].parse()?;
    if n == 0 || size == 0 {
        return Err("N and SIZE must be at least 1".into());
    }
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    let mut c = Client::connect(ClientConfig::new(args[0].clone(), token)).await?;
    let mut regions = Vec::new();
    for name in &args[4..] {
        regions.push(c.open(name, true).await?);
    }
    let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
    // one put each first: the QP and the staging buffers exist before anything is timed
    for r in &regions {
        c.put(r, 0, &mut &data[..], Some(size as u64), false, &mut |_| {})
            .await?;
    }
    // times[region][mode]: mode 0 the put alone, mode 1 the put and a flush
    let mut times: Vec<[Vec<f64>; 2]> =
        vec![[Vec::with_capacity(n), Vec::with_capacity(n)]; regions.len()];
    for i in 0..n {
        for (k, r) in regions.iter().enumerate() {
            let at = (i * size) as u64 % (r.info.size - size as u64 + 1);
            for (mode, m) in times[k].iter_mut().enumerate() {
                let t = Instant::now();
                c.put(r, at, &mut &data[..], Some(size as u64), false, &mut |_| {})
                    .await?;
                if mode == 1 {
                    c.flush(r, at, size as u64).await?;
                }
                m.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    for (r, modes) in regions.iter().zip(times) {
        for (mode, mut t) in modes.into_iter().enumerate() {
            t.sort_by(f64::total_cmp);
            println!(
                "{}",
                serde_json::json!({
                    "region": r.info.name,
                    "kind": r.info.kind,
                    "server_puts": r.info.server_puts,
                    "mode": if mode == 0 { "put" } else { "put+flush" },
                    "puts": n,
                    "size": size,
                    "median_us": t[t.len() / 2],
                    "p90_us": t[t.len() * 9 / 10],
                    "max_us": t[t.len() - 1],
                })
            );
        }
    }
    c.bye().await?;
    Ok(())
}
