//! Errors of the catalog: each names the etcd members and the operation that failed.

/// A catalog error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad settings (URL, node name, TLS files).
    #[error("{0}")]
    Config(String),
    /// etcd answered with an error, or could not be reached.
    #[error("catalog {at}: {op} failed: {source}")]
    Etcd {
        /// `etcd at HOST:PORT, ... (prefix P)`.
        at: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer in time (down, partitioned, or without a leader).
    #[error("catalog {at}: {op} got no answer within {secs} s: is etcd running and reachable there?")]
    Timeout {
        /// `etcd at HOST:PORT, ... (prefix P)`.
        at: String,
        /// What was being done.
        op: &'static str,
        /// The time waited.
        secs: u64,
    },
    /// No node publishes the region.
    #[error("catalog {at}: no node serves region '{region}'{hint}")]
    NotFound {
        /// `etcd at HOST:PORT, ... (prefix P)`.
        at: String,
        /// The region asked for.
        region: String,
        /// What is there instead.
        hint: String,
    },
    /// Every replica was tried and none could be used.
    #[error("region '{region}': no node could serve it: {tried}")]
    NoReplica {
        /// The region.
        region: String,
        /// Each node tried and why it failed.
        tried: String,
    },
    /// A node's own error.
    #[error(transparent)]
    Bridge(#[from] bridge::Error),
}

/// Shorthand.
pub type Result<T, E = Error> = std::result::Result<T, E>;
