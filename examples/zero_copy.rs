//! Zero-copy fetches and batches against a running `p2p-rdma serve`, measured side by side
//! with the stream API in the same run:
//!
//! - 1,000 ranges of 4 KiB: one `fetch_many` call against 1,000 `fetch` calls (throughput);
//! - 64 MiB: `fetch_into` a registered buffer against `fetch` to a file (CPU time of this
//!   process, user + system, from /proc/self/stat, and throughput).
//!
//! Each figure is the median of `ROUNDS` runs; the spread (min..max) is printed beside it.
//!
//! ```text
//! cargo run --example zero_copy -- ADDR TOKEN_FILE REGION [ROUNDS]
//! ```
//! REGION must hold at least 64 MiB.
use std::time::Instant;

use p2p_rdma::bridge::{BatchRange, Client, ClientConfig};

const SMALL: u64 = 4096;
const COUNT: u64 = 1000;
const BIG: u64 = 64 << 20;

/// User + system CPU time of this process, seconds (clock ticks of 1/100 s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // the fields after the command name, which is in parentheses and may hold spaces
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name
    (tick(11) + tick(12)) / 100.0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(v: &[f64]) -> String {
    format!(
        "{:.2}..{:.2}",
        v.iter().copied().fold(f64::INFINITY, f64::min),
        v.iter().copied().fold(0.0, f64::max)
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !(3..=4).contains(&args.len()) {
        eprintln!("usage: zero_copy ADDR TOKEN_FILE REGION [ROUNDS]");
        std::process::exit(2);
    }
    let rounds: usize = args.get(3).map_or(Ok(5), |r| r.parse())?;
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    let mut client = Client::connect(ClientConfig::new(args[0].clone(), token)).await?;
    let region = client.open(&args[2], false).await?;
    if region.info.size < BIG {
        return Err(format!("region '{}' holds less than 64 MiB", args[2]).into());
    }
    let mut buf = client.buffer(BIG as usize).await?;

    // 1,000 small ranges, spread over the region
    let step = (region.info.size - SMALL) / COUNT;
    let (mut single, mut batch) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let mut sink = Vec::with_capacity((SMALL * COUNT) as usize);
        for k in 0..COUNT {
            client
                .fetch(&region, k * step, SMALL, &mut sink, false, &mut |_| {})
                .await?;
        }
        single.push((SMALL * COUNT) as f64 / t.elapsed().as_secs_f64() / 1048576.0);
        let ranges: Vec<BatchRange> = (0..COUNT)
            .map(|k| BatchRange {
                region: &region,
                offset: k * step,
                len: SMALL,
                at: (k * SMALL) as usize,
            })
            .collect();
        let t = Instant::now();
        let landed = client.fetch_many(&ranges, buf).await?;
        batch.push((SMALL * COUNT) as f64 / t.elapsed().as_secs_f64() / 1048576.0);
        if let Some(e) = landed.results.iter().find_map(|r| r.as_ref().err()) {
            return Err(format!("a range failed: {e}").into());
        }
        if landed.buffer.as_slice()[..(SMALL * COUNT) as usize] != sink[..] {
            return Err("the batch and the single fetches got different bytes".into());
        }
        buf = landed.buffer;
    }
    let (s, b) = (median(&mut single), median(&mut batch));
    println!(
        "1,000 x 4 KiB: fetch_many {b:.2} MiB/s ({}), 1,000 fetch calls {s:.2} MiB/s ({}), ratio {:.1}",
        spread(&batch),
        spread(&single),
        b / s
    );

    // 64 MiB: into a registered buffer against a file
    let path = std::env::temp_dir().join(format!("zero-copy-{}.bin", std::process::id()));
    let (mut cpu_file, mut cpu_zero, mut bw_file, mut bw_zero) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let mut out = std::fs::File::create(&path)?;
        let (c, t) = (cpu_seconds(), Instant::now());
        client
            .fetch(&region, 0, BIG, &mut out, false, &mut |_| {})
            .await?;
        bw_file.push(BIG as f64 / t.elapsed().as_secs_f64() / 1048576.0);
        cpu_file.push(cpu_seconds() - c);
        let (c, t) = (cpu_seconds(), Instant::now());
        let landed = client.fetch_into(&region, 0, BIG, buf, 0).await?;
        bw_zero.push(BIG as f64 / t.elapsed().as_secs_f64() / 1048576.0);
        cpu_zero.push(cpu_seconds() - c);
        buf = landed.buffer;
    }
    let _ = std::fs::remove_file(&path);
    let (cf, cz) = (median(&mut cpu_file), median(&mut cpu_zero));
    println!(
        "64 MiB: fetch_into {:.2} MiB/s ({}), CPU {cz:.2} s ({}); fetch to a file {:.2} MiB/s ({}), CPU {cf:.2} s ({}); CPU ratio {}",
        median(&mut bw_zero),
        spread(&bw_zero),
        spread(&cpu_zero),
        median(&mut bw_file),
        spread(&bw_file),
        spread(&cpu_file),
        if cf > 0.0 {
            format!("{:.2}", cz / cf)
        } else {
            "n/a (below the clock tick)".into()
        }
    );
    client.bye().await?;
    Ok(())
}
