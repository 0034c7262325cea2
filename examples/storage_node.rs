//! A small storage node embedding p2p-rdma: it loads objects (files) into one registered arena
//! of host memory and serves each object by name as a read-only region; remote hosts fetch them
//! with one-sided RDMA READ (see `fetch_object.rs`, or `p2p-rdma fetch`).
//!
//! ```text
//! cargo run --example storage_node -- LISTEN TOKEN_FILE FILE...
//! cargo run --example storage_node -- 10.77.0.1:7600 token /etc/hostname /etc/os-release
//! ```
use std::sync::Arc;

use p2p_rdma::bridge::{MemoryRegionSpec, Server, ServerConfig};
use p2p_rdma::verbs::SharedMemory;

const ALIGN: u64 = 4096;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!("usage: storage_node LISTEN TOKEN_FILE FILE...");
        std::process::exit(2);
    }
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    // lay the objects out in one arena, each at a 4 KiB-aligned offset
    let mut objects = Vec::new();
    let mut end = 0u64;
    for path in &args[2..] {
        let bytes = std::fs::read(path)?;
        if bytes.is_empty() {
            eprintln!("skipping empty object {path}");
            continue;
        }
        let name: String = std::path::Path::new(path)
            .file_name()
            .map(|n| {
                n.to_string_lossy()
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect()
            })
            .unwrap_or_else(|| "object".into());
        objects.push((name, end, bytes));
        end = (end + objects.last().map_or(0, |o| o.2.len() as u64)).div_ceil(ALIGN) * ALIGN;
    }
    if objects.is_empty() {
        return Err("no object to serve".into());
    }
    let arena = Arc::new(SharedMemory::anonymous(end as usize, false)?);
    let mut cfg = ServerConfig::new(args[0].parse()?, token, Vec::new());
    for (name, offset, bytes) in &objects {
        arena.write_at(*offset, bytes)?;
        cfg.memory_regions.push(MemoryRegionSpec::window(
            name.clone(),
            Arc::clone(&arena),
            *offset,
            bytes.len() as u64,
            true,
        )?);
    }
    let server = Server::bind(cfg).await?;
    println!(
        "storage node on {} ({}), {} objects in a {} byte arena:",
        server.local_addr()?,
        server.device(),
        objects.len(),
        end
    );
    for r in server.regions() {
        println!("  {:<24} {:>10} bytes", r.name, r.size);
    }
    server
        .run(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
