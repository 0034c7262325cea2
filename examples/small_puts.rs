//! Latency of small puts: N puts of SIZE bytes, one after the other, into each REGION given,
//! each put timed three ways, interleaved:
//! - `put`: as `put` does it (the bytes inline in the work request when SIZE fits the QP's
//!   inline room, 220 bytes by default);
//! - `put, not inline`: the same on a second connection whose QP has no inline room (the NIC
//!   fetches the bytes from a registered buffer);
//! - `put+flush`: the first, followed by an explicit `flush` (what every put did before puts into
//!   memory that does not persist stopped asking for one).
//!
//! The three take turns being first in each round of puts.
//!
//! Connections, opens and staging buffers are set up first: the inline one first, or with
//! `SMALL_PUTS_SWAP` set the other one first (a check that the order of the two connections is
//! not what differs).
//!
//! ```text
//! cargo run --example small_puts -- ADDR TOKEN_FILE N SIZE REGION [REGION...]
//! ```
//! Prints one JSON line per region and mode: the median, p90 and max time in microseconds.
use std::time::Instant;

use p2p_rdma::bridge::{Client, ClientConfig, OpenRegion};

const MODES: [&str; 3] = ["put", "put, not inline", "put+flush"];

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
    let cfg = ClientConfig::new(args[0].clone(), token);
    let plain_cfg = ClientConfig {
        inline: 0,
        ..cfg.clone()
    };
    let (mut c, mut plain) = if std::env::var_os("SMALL_PUTS_SWAP").is_some() {
        let plain = Client::connect(plain_cfg).await?;
        (Client::connect(cfg).await?, plain)
    } else {
        (
            Client::connect(cfg).await?,
            Client::connect(plain_cfg).await?,
        )
    };
    // (the handle opened on each connection, for each region)
    let mut regions: Vec<[OpenRegion; 2]> = Vec::new();
    for name in &args[4..] {
        regions.push([c.open(name, true).await?, plain.open(name, true).await?]);
    }
    let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
    // one put each first: the QPs and the staging buffers exist before anything is timed
    for [r, p] in &regions {
        c.put(r, 0, &mut &data[..], Some(size as u64), false, &mut |_| {})
            .await?;
        plain
            .put(p, 0, &mut &data[..], Some(size as u64), false, &mut |_| {})
            .await?;
    }
    // times[region][mode], modes as in MODES
    let mut times: Vec<[Vec<f64>; 3]> = vec![Default::default(); regions.len()];
    for i in 0..n {
        for (k, [r, p]) in regions.iter().enumerate() {
            let at = (i * size) as u64 % (r.info.size - size as u64 + 1);
            // the modes take turns being first: none always follows the same one
            for j in 0..MODES.len() {
                let mode = (i + j) % MODES.len();
                let t = Instant::now();
                let (client, handle) = if mode == 1 {
                    (&mut plain, p)
                } else {
                    (&mut c, r)
                };
                client
                    .put(
                        handle,
                        at,
                        &mut &data[..],
                        Some(size as u64),
                        false,
                        &mut |_| {},
                    )
                    .await?;
                if mode == 2 {
                    client.flush(handle, at, size as u64).await?;
                }
                times[k][mode].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    for ([r, _], modes) in regions.iter().zip(times) {
        for (mode, mut t) in modes.into_iter().enumerate() {
            t.sort_by(f64::total_cmp);
            println!(
                "{}",
                serde_json::json!({
                    "region": r.info.name,
                    "kind": r.info.kind,
                    "server_puts": r.info.server_puts,
                    "mode": MODES[mode],
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
    plain.bye().await?;
    Ok(())
}
