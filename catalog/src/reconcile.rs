//! What a publishing node must write to etcd to make the catalog say what it serves, without
//! I/O: the keys it published under its current lease, compared with the keys it should have.
//! A new lease (first start, or etcd lost the old one) publishes everything again; keys left
//! by an earlier run of the same node are adopted so that those it no longer serves are
//! deleted instead of lingering until their old lease expires.

use std::collections::BTreeMap;

use crate::entry::{encode, NodeEntry, RegionEntry};
use crate::keys::Layout;

/// etcd refuses a transaction of more than 128 operations by default (`--max-txn-ops`).
pub const MAX_OPS_PER_TXN: usize = 100;

/// One write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Put `value` at `key` under the node's lease.
    Put {
        /// Key.
        key: String,
        /// JSON value.
        value: String,
    },
    /// Delete `key`.
    Delete {
        /// Key.
        key: String,
    },
}

/// The keys a node should have: its entry and one per region. Entries that cannot be encoded
/// (over the size limit) are left out and returned with the reason.
pub fn desired(
    layout: &Layout,
    node: &NodeEntry,
    regions: &[RegionEntry],
) -> (BTreeMap<String, String>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut refused = Vec::new();
    match encode(&format!("node '{}'", node.node), node) {
        Ok(v) => {
            out.insert(layout.node_key(&node.node), v);
        }
        Err(e) => refused.push(e),
    }
    for r in regions {
        match encode(&format!("region '{}'", r.region), r) {
            Ok(v) => {
                out.insert(layout.region_key(&r.region, &node.node), v);
            }
            Err(e) => refused.push(e),
        }
    }
    (out, refused)
}

/// The published state under the current lease.
#[derive(Debug, Default)]
pub struct Reconcile {
    published: BTreeMap<String, Option<String>>,
}

impl Reconcile {
    /// Nothing published yet.
    pub fn new() -> Reconcile {
        Reconcile::default()
    }

    /// A new lease: nothing counts as published under it.
    pub fn reset(&mut self) {
        self.published.clear();
    }

    /// Keys of this node found in etcd (from an earlier lease): each is deleted unless it is
    /// still wanted, and then put again under the new lease.
    pub fn adopt(&mut self, keys: impl IntoIterator<Item = String>) {
        for k in keys {
            self.published.entry(k).or_insert(None);
        }
    }

    /// The writes that make etcd hold `want`: the node's entry and new or changed regions
    /// first, then deletions.
    pub fn plan(&self, want: &BTreeMap<String, String>) -> Vec<Op> {
        let mut puts: Vec<Op> = want
            .iter()
            .filter(|(k, v)| self.published.get(*k) != Some(&Some((*v).clone())))
            .map(|(k, v)| Op::Put {
                key: k.clone(),
                value: v.clone(),
            })
            .collect();
        // the node's entry before its regions: a region is never listed without its node
        puts.sort_by_key(|op| match op {
            Op::Put { key, .. } => !key.contains("/v1/nodes/"),
            Op::Delete { .. } => true,
        });
        let deletes = self
            .published
            .keys()
            .filter(|k| !want.contains_key(*k))
            .map(|k| Op::Delete { key: k.clone() });
        puts.into_iter().chain(deletes).collect()
    }

    /// `ops` were written.
    pub fn applied(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Put { key, value } => {
                    self.published.insert(key.clone(), Some(value.clone()));
                }
                Op::Delete { key } => {
                    self.published.remove(key);
                }
            }
        }
    }

    /// Keys published under the current lease.
    pub fn published(&self) -> usize {
        self.published.values().filter(|v| v.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(connections: u64) -> NodeEntry {
        NodeEntry {
            node: "a".into(),
            endpoints: vec!["10.0.0.1:7471".into()],
            nics: vec![],
            connections,
            version: String::new(),
        }
    }

    fn region(name: &str, size: u64) -> RegionEntry {
        RegionEntry {
            region: name.into(),
            node: "a".into(),
            endpoints: vec!["10.0.0.1:7471".into()],
            size,
            access: "ro".into(),
            kind: "host".into(),
            path: "direct".into(),
            strategy: None,
            nic: None,
        }
    }

    fn keys(ops: &[Op]) -> Vec<String> {
        ops.iter()
            .map(|o| match o {
                Op::Put { key, .. } => format!("put {key}"),
                Op::Delete { key } => format!("del {key}"),
            })
            .collect()
    }

    #[test]
    fn first_publish_puts_node_then_regions_and_then_nothing() {
        let l = Layout::new("p");
        let (want, refused) = desired(&l, &node(0), &[region("x", 1), region("b", 2)]);
        assert!(refused.is_empty());
        let mut r = Reconcile::new();
        let ops = r.plan(&want);
        assert_eq!(
            keys(&ops),
            [
                "put p/v1/nodes/a",
                "put p/v1/regions/b/a",
                "put p/v1/regions/x/a"
            ]
        );
        r.applied(&ops);
        assert_eq!(r.published(), 3);
        assert!(r.plan(&want).is_empty());
    }

    #[test]
    fn changes_removals_load_and_new_lease() {
        let l = Layout::new("p");
        let mut r = Reconcile::new();
        let (want, _) = desired(&l, &node(0), &[region("x", 1), region("y", 1)]);
        r.applied(&r.plan(&want));
        // y resized, x removed, the load changed
        let (want, _) = desired(&l, &node(4), &[region("y", 2)]);
        let ops = r.plan(&want);
        assert_eq!(
            keys(&ops),
            [
                "put p/v1/nodes/a",
                "put p/v1/regions/y/a",
                "del p/v1/regions/x/a"
            ]
        );
        r.applied(&ops);
        assert!(r.plan(&want).is_empty());
        // a new lease publishes all again
        r.reset();
        assert_eq!(r.plan(&want).len(), 2);
    }

    #[test]
    fn keys_of_an_earlier_run_are_deleted_or_rewritten() {
        let l = Layout::new("p");
        let mut r = Reconcile::new();
        r.adopt([
            "p/v1/regions/old/a".to_string(),
            "p/v1/regions/y/a".to_string(),
        ]);
        assert_eq!(r.published(), 0);
        let (want, _) = desired(&l, &node(0), &[region("y", 1)]);
        assert_eq!(
            keys(&r.plan(&want)),
            [
                "put p/v1/nodes/a",
                "put p/v1/regions/y/a",
                "del p/v1/regions/old/a"
            ]
        );
    }

    #[test]
    fn an_oversized_entry_is_refused_not_published() {
        let l = Layout::new("p");
        let mut big = region("big", 1);
        big.kind = "k".repeat(crate::entry::MAX_VALUE_BYTES);
        let (want, refused) = desired(&l, &node(0), &[big, region("ok", 1)]);
        assert_eq!(want.len(), 2);
        assert!(refused[0].contains("region 'big'"), "{refused:?}");
    }
}
