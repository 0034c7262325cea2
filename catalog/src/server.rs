//! What a `bridge` server publishes: its regions as catalog entries, its endpoints, its load.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::entry::{NodeEntry, RegionEntry};
use crate::publish::Source;

/// How often the published load (open connections) may change: a busy node does not write
/// to etcd at every connection.
pub const LOAD_REFRESH: Duration = Duration::from_secs(5);

/// A node as it is published.
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    /// Name in the catalog.
    pub node: String,
    /// Control addresses clients connect to.
    pub endpoints: Vec<String>,
    /// RDMA devices it serves from.
    pub nics: Vec<String>,
}

/// The endpoints to publish for a server listening on `listen`: that address, or, when it
/// listens on every address, the IPv4 address of each RDMA device's RoCE v2 GID (the network
/// the clients' RDMA traffic takes anyway).
pub fn endpoints_for(listen: SocketAddr, nic_addrs: &[Ipv4Addr]) -> Result<Vec<String>, String> {
    if !listen.ip().is_unspecified() {
        return Ok(vec![listen.to_string()]);
    }
    let eps: Vec<String> = nic_addrs
        .iter()
        .map(|ip| SocketAddr::new(IpAddr::V4(*ip), listen.port()).to_string())
        .collect();
    if eps.is_empty() {
        return Err(format!(
            "the server listens on {listen} and no RDMA device has an IPv4 address: name the \
             address clients should use with --advertise HOST:PORT"
        ));
    }
    Ok(eps)
}

/// `HOSTNAME:PORT`: the default node name (unique per server on a host).
pub fn default_node_name(port: u16) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(100)
        .collect();
    format!("{host}:{port}")
}

/// A region as the catalog shows it.
pub fn entry_of(info: &bridge::protocol::RegionInfo, id: &NodeIdentity) -> RegionEntry {
    RegionEntry {
        region: info.name.clone(),
        node: id.node.clone(),
        endpoints: id.endpoints.clone(),
        size: info.size,
        access: info.access.to_string(),
        kind: info.kind.clone(),
        path: info.path.to_string(),
        strategy: info.strategy.clone(),
        nic: info.nic.clone(),
    }
}

/// The publisher's view of a running server: its live regions (regions added or removed
/// while it runs follow within a second) and its open connections (refreshed at most every
/// [`LOAD_REFRESH`]).
pub fn source(handle: bridge::ServerHandle, id: NodeIdentity) -> Source {
    let load: Mutex<Option<(Instant, u64)>> = Mutex::new(None);
    Arc::new(move || {
        let connections = {
            let mut l = load.lock().unwrap_or_else(|p| p.into_inner());
            match *l {
                Some((at, n)) if at.elapsed() < LOAD_REFRESH => n,
                _ => {
                    let n = handle.metrics().connections.get().max(0) as u64;
                    *l = Some((Instant::now(), n));
                    n
                }
            }
        };
        let node = NodeEntry {
            node: id.node.clone(),
            endpoints: id.endpoints.clone(),
            nics: id.nics.clone(),
            connections,
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let regions = handle.regions().iter().map(|r| entry_of(r, &id)).collect();
        (node, regions)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_the_listen_address_or_the_nics() {
        let any: SocketAddr = "0.0.0.0:7471".parse().unwrap();
        let one: SocketAddr = "10.0.0.5:7000".parse().unwrap();
        assert_eq!(endpoints_for(one, &[]).unwrap(), ["10.0.0.5:7000"]);
        assert_eq!(
            endpoints_for(
                any,
                &[Ipv4Addr::new(10, 88, 0, 1), Ipv4Addr::new(10, 89, 0, 1)]
            )
            .unwrap(),
            ["10.88.0.1:7471", "10.89.0.1:7471"]
        );
        assert!(endpoints_for(any, &[]).unwrap_err().contains("--advertise"));
    }

    #[test]
    fn default_node_name_is_a_valid_node_name() {
        let n = default_node_name(7471);
        assert!(n.ends_with(":7471"));
        crate::keys::valid_node(&n).unwrap();
    }
}
