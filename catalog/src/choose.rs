//! Which replica a client tries first. The rule, in order:
//!
//! 1. the better data path: direct, then mixed, then bounce (as the node proved it at start);
//! 2. the lighter load: fewer control connections open on the node when it last published
//!    (a node whose own entry is missing counts as the most loaded);
//! 3. at random among replicas equal on both, so that clients spread over them.
//!
//! A client that cannot connect to or open the first tries the next, in the same order.

use crate::entry::{NodeEntry, RegionEntry};

/// A region as one node serves it, with that node's load.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Replica {
    /// The catalog entry.
    pub entry: RegionEntry,
    /// The node's open control connections when it last published (`None`: no node entry).
    pub connections: Option<u64>,
}

/// Pair each entry with its node's load.
pub fn replicas(entries: Vec<RegionEntry>, nodes: &[NodeEntry]) -> Vec<Replica> {
    entries
        .into_iter()
        .map(|entry| {
            let connections = nodes
                .iter()
                .find(|n| n.node == entry.node)
                .map(|n| n.connections);
            Replica { entry, connections }
        })
        .collect()
}

/// Order replicas by the rule above; `tiebreak` draws the random part (one value per replica).
pub fn rank(v: Vec<Replica>, mut tiebreak: impl FnMut() -> u64) -> Vec<Replica> {
    let mut keyed: Vec<_> = v
        .into_iter()
        .map(|r| {
            (
                r.entry.path_rank(),
                r.connections.unwrap_or(u64::MAX),
                tiebreak(),
                r,
            )
        })
        .collect();
    keyed.sort_by_key(|k| (k.0, k.1, k.2));
    keyed.into_iter().map(|k| k.3).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(node: &str, path: &str) -> RegionEntry {
        RegionEntry {
            region: "r".into(),
            node: node.into(),
            endpoints: vec![format!("{node}:7471")],
            size: 1,
            access: "ro".into(),
            kind: "host".into(),
            path: path.into(),
            strategy: None,
            nic: None,
        }
    }

    fn node(name: &str, connections: u64) -> NodeEntry {
        NodeEntry {
            node: name.into(),
            endpoints: vec![format!("{name}:7471")],
            nics: vec![],
            connections,
            version: String::new(),
        }
    }

    fn order(v: &[Replica]) -> Vec<&str> {
        v.iter().map(|r| r.entry.node.as_str()).collect()
    }

    #[test]
    fn path_first_then_load_then_chance() {
        let nodes = [node("a", 9), node("b", 1), node("c", 5)];
        let r = replicas(
            vec![
                entry("a", "direct"),
                entry("b", "bounce"),
                entry("c", "direct"),
                entry("d", "direct"),
            ],
            &nodes,
        );
        // c (direct, 5) before a (direct, 9) before d (direct, no node entry) before b (bounce)
        assert_eq!(order(&rank(r, || 0)), ["c", "a", "d", "b"]);
    }

    #[test]
    fn equal_replicas_are_spread_at_random() {
        let nodes = [node("a", 2), node("b", 2)];
        let r = replicas(vec![entry("a", "direct"), entry("b", "direct")], &nodes);
        let mut seq = [1u64, 0].into_iter();
        assert_eq!(order(&rank(r.clone(), || seq.next().unwrap())), ["b", "a"]);
        let mut seq = [0u64, 1].into_iter();
        assert_eq!(order(&rank(r, || seq.next().unwrap())), ["a", "b"]);
    }
}
