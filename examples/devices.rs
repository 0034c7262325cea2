//! Embedding example mirroring `p2p-rdma devices --json`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let devices = p2p_rdma::verbs::devices()?;
    if devices.is_empty() {
        return Err(p2p_rdma::verbs::no_device_error().into());
    }
    for d in &devices {
        let gid = d
            .preferred_gid()
            .map(|(port, g)| format!("port {port} GID[{}] {}", g.index, g.gid));
        println!(
            "{}: {}",
            d.name,
            gid.unwrap_or_else(|| "no active port with a GID".into())
        );
    }
    Ok(())
}
