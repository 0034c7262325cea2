//! Fetch one object from a storage node (`storage_node.rs`) by name, verifying its checksum.
//!
//! ```text
//! cargo run --example fetch_object -- ADDR TOKEN_FILE NAME OUTPUT
//! ```
use p2p_rdma::bridge::{Client, ClientConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 4 {
        eprintln!("usage: fetch_object ADDR TOKEN_FILE NAME OUTPUT");
        std::process::exit(2);
    }
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    let mut client = Client::connect(ClientConfig::new(args[0].clone(), token)).await?;
    let object = client.open(&args[2], false).await?;
    let mut out = std::fs::File::create(&args[3])?;
    let report = client
        .fetch(&object, 0, object.info.size, &mut out, true, &mut |_| {})
        .await?;
    client.close(&object).await?;
    client.bye().await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
