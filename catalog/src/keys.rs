//! The key layout of a catalog in etcd (version 1):
//!
//! ```text
//! PREFIX/v1/nodes/NODE            one per serving node: its endpoints, NICs and load
//! PREFIX/v1/regions/REGION/NODE   one per region a node serves (several nodes: replicas)
//! ```
//!
//! Every key of a node is attached to that node's lease, so all of them go when the node does.
//! Region names are `[A-Za-z0-9._-]` (the server's own rule) and node names
//! `[A-Za-z0-9._:-]`: neither holds a `/`, so a key splits back into its parts unambiguously.

/// Longest node name.
pub const MAX_NODE_NAME: usize = 128;

/// The keys of one catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    root: String,
}

/// What a key of the catalog names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    /// A node's own entry.
    Node(String),
    /// A region served by a node.
    Region {
        /// Region name.
        region: String,
        /// Node name.
        node: String,
    },
}

impl Layout {
    /// The layout under `prefix` (as in [`crate::CatalogUrl::prefix`]).
    pub fn new(prefix: &str) -> Layout {
        Layout {
            root: format!("{}/v1/", prefix.trim_end_matches('/')),
        }
    }

    /// Everything of this catalog (nodes and regions).
    pub fn all(&self) -> String {
        self.root.clone()
    }

    /// All region keys.
    pub fn regions(&self) -> String {
        format!("{}regions/", self.root)
    }

    /// All nodes' entries.
    pub fn nodes(&self) -> String {
        format!("{}nodes/", self.root)
    }

    /// The replicas of one region (the trailing `/` keeps `img` from matching `img2`).
    pub fn region(&self, region: &str) -> String {
        format!("{}regions/{region}/", self.root)
    }

    /// A node's entry.
    pub fn node_key(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.root)
    }

    /// A region's entry as one node serves it.
    pub fn region_key(&self, region: &str, node: &str) -> String {
        format!("{}regions/{region}/{node}", self.root)
    }

    /// What `key` names, or `None` for a key that is not this layout's (written by something
    /// else, or malformed).
    pub fn parse(&self, key: &[u8]) -> Option<Key> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(&self.root)?;
        if let Some(node) = rest.strip_prefix("nodes/") {
            return valid_node(node).ok().map(|()| Key::Node(node.to_string()));
        }
        let (region, node) = rest.strip_prefix("regions/")?.split_once('/')?;
        (valid_region(region).is_ok() && valid_node(node).is_ok()).then(|| Key::Region {
            region: region.to_string(),
            node: node.to_string(),
        })
    }
}

/// A node name: 1 to 128 of `[A-Za-z0-9._:-]`.
pub fn valid_node(n: &str) -> Result<(), String> {
    if n.is_empty() || n.len() > MAX_NODE_NAME {
        return Err(format!(
            "node name '{n}' must be 1 to {MAX_NODE_NAME} bytes long"
        ));
    }
    if !n
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    {
        return Err(format!(
            "node name '{n}' may hold only letters, digits, '-', '_', '.' and ':'"
        ));
    }
    Ok(())
}

/// A region name as servers accept it: 1 to 128 of `[A-Za-z0-9._-]`.
pub fn valid_region(n: &str) -> Result<(), String> {
    if n.is_empty()
        || n.len() > 128
        || !n
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(format!(
            "region name '{n}' must be 1 to 128 letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let l = Layout::new("prod/s3");
        assert_eq!(l.node_key("host-a:7471"), "prod/s3/v1/nodes/host-a:7471");
        assert_eq!(l.region_key("img", "a"), "prod/s3/v1/regions/img/a");
        assert_eq!(l.region("img"), "prod/s3/v1/regions/img/");
        assert_eq!(
            l.parse(l.region_key("img.v2", "b:1").as_bytes()),
            Some(Key::Region {
                region: "img.v2".into(),
                node: "b:1".into()
            })
        );
        assert_eq!(
            l.parse(l.node_key("n").as_bytes()),
            Some(Key::Node("n".into()))
        );
    }

    #[test]
    fn foreign_and_malformed_keys_are_not_ours() {
        let l = Layout::new("p");
        for k in [
            "q/v1/nodes/a",
            "p/v2/nodes/a",
            "p/v1/nodes/",
            "p/v1/nodes/a/b",
            "p/v1/regions/img",
            "p/v1/regions/img/",
            "p/v1/regions//a",
            "p/v1/regions/a b/n",
            "p/v1/other/x",
        ] {
            assert_eq!(l.parse(k.as_bytes()), None, "{k}");
        }
        assert_eq!(l.parse(&[0xff, 0xfe]), None);
    }

    #[test]
    fn names_are_checked() {
        assert!(valid_node("host-1.example:7471").is_ok());
        assert!(valid_node("a/b").is_err());
        assert!(valid_node("").is_err());
        assert!(valid_node(&"x".repeat(129)).is_err());
        assert!(valid_region("img_1.v2").is_ok());
        assert!(valid_region("a:b").is_err());
    }
}
