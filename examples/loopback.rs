//! Embedding example mirroring `p2p-rdma loopback`: verify and time RDMA WRITEs between two QPs
//! of one device.
//!
//! ```text
//! cargo run --example loopback -- [DEVICE]
//! ```
use std::time::Duration;

use p2p_rdma::loopback::{run, LoopbackConfig, Op};
use p2p_rdma::verbs::CqMode;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = std::env::args().nth(1);
    let report = run(&LoopbackConfig {
        device,
        size: 1 << 20,
        depth: 16,
        iters: None,
        duration: Some(Duration::from_secs(2)),
        op: Op::Write,
        cq_mode: CqMode::Events,
        verify: true,
    })
    .await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
