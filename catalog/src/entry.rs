//! What the catalog stores: one JSON document per node and per region a node serves. No
//! secret is ever stored (tokens stay with the nodes). Values read back are hostile: anyone
//! with write access to the prefix can put anything there, so every value is bounded, parsed
//! and checked against its key before it is used.

use serde::{Deserialize, Serialize};

use crate::keys::{valid_node, valid_region};

/// Largest value the catalog accepts (reading and writing).
pub const MAX_VALUE_BYTES: usize = 16 * 1024;

/// Most control endpoints one node may publish.
pub const MAX_ENDPOINTS: usize = 16;

/// A serving node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeEntry {
    /// The node's name (unique in the catalog).
    pub node: String,
    /// Control addresses (`HOST:PORT`) a client connects to, in order of preference.
    pub endpoints: Vec<String>,
    /// The RDMA devices the node serves from.
    #[serde(default)]
    pub nics: Vec<String>,
    /// Control connections open when last published (refreshed every few seconds): the load
    /// a client uses to choose between replicas.
    #[serde(default)]
    pub connections: u64,
    /// p2p-rdma version of the node.
    #[serde(default)]
    pub version: String,
}

/// A region as one node serves it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionEntry {
    /// Region name (several nodes may publish the same name: replicas).
    pub region: String,
    /// The node that serves it.
    pub node: String,
    /// That node's control addresses.
    pub endpoints: Vec<String>,
    /// Size in bytes.
    pub size: u64,
    /// `ro` or `rw`.
    pub access: String,
    /// Memory kind (host, file, cmb, nvme, dmabuf, devpriv...).
    pub kind: String,
    /// direct, mixed or bounce.
    pub path: String,
    /// Registration strategy of the direct part.
    #[serde(default)]
    pub strategy: Option<String>,
    /// The node's RDMA device that serves the direct part.
    #[serde(default)]
    pub nic: Option<String>,
}

impl RegionEntry {
    /// How good the data path is, lower first: direct, mixed, bounce, anything else.
    pub fn path_rank(&self) -> u8 {
        match self.path.as_str() {
            "direct" => 0,
            "mixed" => 1,
            "bounce" => 2,
            _ => 3,
        }
    }
}

/// Encode an entry for the catalog (refusing one over [`MAX_VALUE_BYTES`]).
pub fn encode<T: Serialize>(what: &str, v: &T) -> Result<String, String> {
    let s = serde_json::to_string(v).map_err(|e| format!("{what}: {e}"))?;
    if s.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "{what}: {} bytes, over the catalog's {MAX_VALUE_BYTES}-byte limit per entry",
            s.len()
        ));
    }
    Ok(s)
}

/// Decode and check a node entry stored under `node`'s key.
pub fn decode_node(node: &str, value: &[u8]) -> Result<NodeEntry, String> {
    let e: NodeEntry = parse(value)?;
    if e.node != node {
        return Err(format!("names node '{}' under node '{node}'s key", e.node));
    }
    check_endpoints(&e.endpoints)?;
    if e.nics.len() > 64 || e.version.len() > 64 {
        return Err("more than 64 NICs or an over-long version".into());
    }
    Ok(e)
}

/// Decode and check a region entry stored under (`region`, `node`)'s key.
pub fn decode_region(region: &str, node: &str, value: &[u8]) -> Result<RegionEntry, String> {
    let e: RegionEntry = parse(value)?;
    if e.region != region || e.node != node {
        return Err(format!(
            "names region '{}' of node '{}' under the key of region '{region}' of node '{node}'",
            e.region, e.node
        ));
    }
    valid_region(&e.region)?;
    valid_node(&e.node)?;
    check_endpoints(&e.endpoints)?;
    if !matches!(e.access.as_str(), "ro" | "rw") {
        return Err(format!("access '{}' is neither ro nor rw", e.access));
    }
    for (what, s) in [("kind", &e.kind), ("path", &e.path)] {
        if s.is_empty() || s.len() > 32 {
            return Err(format!("{what} '{s}' is empty or over 32 bytes"));
        }
    }
    Ok(e)
}

fn parse<T: for<'de> Deserialize<'de>>(value: &[u8]) -> Result<T, String> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "{} bytes, over the {MAX_VALUE_BYTES}-byte limit",
            value.len()
        ));
    }
    serde_json::from_slice(value).map_err(|e| format!("not a catalog entry: {e}"))
}

/// Each endpoint `HOST:PORT` with a port, at most [`MAX_ENDPOINTS`], at least one: what every
/// reader accepts, so what a node may publish.
pub fn check_endpoints(eps: &[String]) -> Result<(), String> {
    if eps.is_empty() || eps.len() > MAX_ENDPOINTS {
        return Err(format!(
            "{} endpoints (1 to {MAX_ENDPOINTS} expected)",
            eps.len()
        ));
    }
    for e in eps {
        let ok = e.len() <= 300
            && e.rsplit_once(':').is_some_and(|(h, p)| {
                !h.is_empty()
                    && p.parse::<u16>().is_ok_and(|p| p > 0)
                    && h.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-.[]:".contains(c))
            });
        if !ok {
            return Err(format!("endpoint '{e}' is not HOST:PORT"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> RegionEntry {
        RegionEntry {
            region: "img".into(),
            node: "a".into(),
            endpoints: vec!["10.0.0.1:7471".into()],
            size: 1 << 20,
            access: "ro".into(),
            kind: "file".into(),
            path: "direct".into(),
            strategy: Some("pinned".into()),
            nic: None,
        }
    }

    #[test]
    fn round_trip() {
        let r = region();
        let v = encode("img", &r).unwrap();
        assert_eq!(decode_region("img", "a", v.as_bytes()).unwrap(), r);
        let n = NodeEntry {
            node: "a".into(),
            endpoints: vec!["[fd00::1]:7471".into()],
            nics: vec!["rxe0".into()],
            connections: 3,
            version: "0.1.0".into(),
        };
        let v = encode("a", &n).unwrap();
        assert_eq!(decode_node("a", v.as_bytes()).unwrap(), n);
    }

    #[test]
    fn hostile_values_are_refused_with_the_reason() {
        let v = encode("img", &region()).unwrap();
        assert!(decode_region("img", "b", v.as_bytes())
            .unwrap_err()
            .contains("under the key"));
        assert!(decode_region("img", "a", b"{")
            .unwrap_err()
            .contains("not a catalog entry"));
        let big = vec![b' '; MAX_VALUE_BYTES + 1];
        assert!(decode_region("img", "a", &big)
            .unwrap_err()
            .contains("limit"));
        for bad in [
            RegionEntry {
                endpoints: vec![],
                ..region()
            },
            RegionEntry {
                endpoints: vec!["host".into()],
                ..region()
            },
            RegionEntry {
                endpoints: vec!["h:0".into()],
                ..region()
            },
            RegionEntry {
                endpoints: vec!["h x:1".into()],
                ..region()
            },
            RegionEntry {
                access: "wo".into(),
                ..region()
            },
            RegionEntry {
                path: String::new(),
                ..region()
            },
            RegionEntry {
                endpoints: vec!["h:1".into(); 17],
                ..region()
            },
        ] {
            let v = serde_json::to_vec(&bad).unwrap();
            assert!(decode_region("img", "a", &v).is_err(), "{bad:?}");
        }
        let huge = RegionEntry {
            kind: "k".repeat(MAX_VALUE_BYTES),
            ..region()
        };
        assert!(encode("img", &huge).unwrap_err().contains("limit"));
    }

    #[test]
    fn path_ranks_direct_first() {
        let mut r = region();
        let mut ranks = vec![];
        for p in ["bounce", "direct", "tcp", "mixed"] {
            r.path = p.into();
            ranks.push(r.path_rank());
        }
        assert_eq!(ranks, [2, 0, 3, 1]);
    }
}
