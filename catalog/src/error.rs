//! Errors of the catalog: each names the etcd members and the operation that failed.

/// A catalog error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad settings (URL, node name, TLS files).
    #[error("{0}")]
    Config(String),
    /// etcd answered with an error, or could not be reached.
    #[error("catalog {at}: {op} failed: {why}")]
    Etcd {
        /// `etcd at HOST:PORT, ... (prefix P)`.
        at: String,
        /// What was being done.
        op: &'static str,
        /// Which kind of failure.
        kind: EtcdFailure,
        /// etcd's or the transport's own words.
        why: String,
    },
    /// etcd did not answer in time (down, partitioned, or without a leader).
    #[error(
        "catalog {at}: {op} got no answer within {secs} s: is etcd running and reachable there?"
    )]
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

/// How an etcd request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtcdFailure {
    /// No member answered (down, wrong address, no leader).
    Unreachable,
    /// etcd refused the credentials or the permission.
    Auth,
    /// etcd refused the request for another reason.
    Refused,
}

/// Sort an etcd client error, in the fewest words that say what happened.
pub(crate) fn describe(e: &etcd_client::Error) -> (EtcdFailure, String) {
    let (kind, words) = sort(e);
    explain(kind, words)
}

/// The client's or transport's own words, without a guess at their cause (an established
/// stream that breaks: the guesses of [`describe`] are about a first contact).
pub(crate) fn words(e: &etcd_client::Error) -> String {
    sort(e).1
}

/// The failure's kind and the client's or transport's own words.
fn sort(e: &etcd_client::Error) -> (EtcdFailure, String) {
    use tonic_code::*;
    fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
        let mut cur = e;
        while let Some(s) = cur.source() {
            cur = s;
        }
        cur.to_string()
    }
    match e {
        etcd_client::Error::GRpcStatus(st) => {
            let msg = st.message().to_string();
            let inner = std::error::Error::source(st)
                .map(innermost)
                .unwrap_or_default();
            let words = if inner.is_empty() || msg.contains(&inner) {
                msg.clone()
            } else {
                format!("{msg}: {inner}")
            };
            match i32::from(st.code()) {
                UNAVAILABLE | DEADLINE_EXCEEDED => (EtcdFailure::Unreachable, words),
                UNAUTHENTICATED | PERMISSION_DENIED => (EtcdFailure::Auth, words),
                _ if msg.contains("authentication failed")
                    || msg.contains("user name is empty") =>
                {
                    (EtcdFailure::Auth, words)
                }
                _ => (EtcdFailure::Refused, words),
            }
        }
        etcd_client::Error::TransportError(t) => (EtcdFailure::Unreachable, innermost(t)),
        other => (EtcdFailure::Refused, other.to_string()),
    }
}

/// What the words mean. TLS failures are said as such: the transport's words alone
/// ("connection closed", "BadCertificate", "UnknownIssuer") do not tell which side refused what.
fn explain(kind: EtcdFailure, words: String) -> (EtcdFailure, String) {
    let has = |s: &str| words.contains(s);
    if has("invalid peer certificate") {
        (
            EtcdFailure::Auth,
            format!(
                "{words}: etcd's TLS certificate is not trusted here (give the CA that signed \
                 it: --catalog-ca)"
            ),
        )
    } else if has("fatal alert") && (has("Certificate") || has("certificate")) {
        (
            EtcdFailure::Auth,
            format!(
                "{words}: etcd refused our TLS client certificate (--catalog-cert and \
                 --catalog-key, signed by a CA the member trusts)"
            ),
        )
    } else if kind == EtcdFailure::Unreachable {
        (
            kind,
            format!("etcd cannot be reached ({words}): is it running, and reachable there?"),
        )
    } else if has("connection closed")
        || has("connection reset")
        || has("broken pipe")
        || has("frame with invalid size")
    {
        (
            kind,
            format!(
                "{words}: etcd closed the connection (a member that speaks TLS to a plain \
                 etcd:// URL, or that refuses our client certificate, does this)"
            ),
        )
    } else {
        (kind, words)
    }
}

/// gRPC status codes, by number (the client re-exports no `Code`).
mod tonic_code {
    pub(super) const DEADLINE_EXCEEDED: i32 = 4;
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const UNAVAILABLE: i32 = 14;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

/// Shorthand.
pub type Result<T, E = Error> = std::result::Result<T, E>;
