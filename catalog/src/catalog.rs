//! The client side: connect to etcd, list the catalog, resolve a region to its replicas, watch
//! regions and nodes appear and disappear.

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{ConnectOptions, GetOptions, Txn, TxnOp, TxnOpResponse};

use crate::choose::{rank, replicas, Replica};
use crate::entry::{decode_node, decode_region, NodeEntry, RegionEntry};
use crate::error::{Error, Result};
use crate::keys::{valid_region, Key, Layout};
use crate::url::CatalogUrl;

/// Most keys one listing reads (a hostile or runaway catalog cannot make a client read more).
pub const MAX_LISTED_KEYS: i64 = 200_000;

/// Most replicas of one region a resolve considers (their node entries are read in one
/// transaction, within etcd's default limit of 128 operations).
pub const MAX_REPLICAS: i64 = 64;

/// How to reach etcd: credentials, TLS files, the time allowed per request.
#[derive(Debug, Clone)]
pub struct CatalogOptions {
    /// etcd user and password (etcd's own authentication).
    pub user: Option<(String, String)>,
    /// CA certificate (PEM) that signed the members' certificates (`etcds://`).
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM), for members that require client certificates.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// Time allowed for each request (and for connecting).
    pub timeout: Duration,
}

impl Default for CatalogOptions {
    fn default() -> Self {
        CatalogOptions {
            user: None,
            ca: None,
            identity: None,
            timeout: Duration::from_secs(5),
        }
    }
}

/// A connection to a catalog.
#[derive(Clone)]
pub struct Catalog {
    pub(crate) client: etcd_client::Client,
    pub(crate) url: CatalogUrl,
    pub(crate) layout: Layout,
    pub(crate) timeout: Duration,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog")
            .field("url", &self.url.to_string())
            .finish()
    }
}

/// Everything a catalog holds at one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Listing {
    /// Every region entry (one per node serving it), by region then node.
    pub regions: Vec<RegionEntry>,
    /// Every node.
    pub nodes: Vec<NodeEntry>,
    /// Entries that were refused (malformed, oversized, not matching their key), with why.
    pub skipped: Vec<String>,
    /// Keys under the prefix.
    pub keys: usize,
    /// Bytes of keys and values under the prefix.
    pub bytes: u64,
    /// etcd's revision of this listing.
    pub revision: i64,
}

/// A change seen by [`CatalogWatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatalogEvent {
    /// A node published (or updated) a region.
    RegionUp(RegionEntry),
    /// A node no longer serves a region (removed, or the node's lease ended).
    RegionDown {
        /// Region.
        region: String,
        /// Node.
        node: String,
    },
    /// A node published (or updated) its entry.
    NodeUp(NodeEntry),
    /// A node's entry went (it stopped, or its lease ended).
    NodeDown(String),
    /// An entry that was refused, with why.
    Skipped(String),
    /// The watch lost etcd (said once per outage); it reconnects by itself, with a backoff of
    /// 0.2 s doubling to 5 s, and then says [`CatalogEvent::Resumed`].
    Interrupted(String),
    /// Watching again after [`CatalogEvent::Interrupted`], from the revision where it stopped:
    /// no change was missed.
    Resumed,
    /// etcd had compacted the changes made while the watch was away, so they cannot be
    /// replayed: this listing is the catalog now, and the watch goes on from its revision.
    Relisted(Listing),
}

pub(crate) async fn within<T>(
    at: &str,
    op: &'static str,
    timeout: Duration,
    f: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            let (kind, why) = crate::error::describe(&e);
            Err(Error::Etcd {
                at: at.to_string(),
                op,
                kind,
                why,
            })
        }
        Err(_) => Err(Error::Timeout {
            at: at.to_string(),
            op,
            secs: timeout.as_secs().max(1),
        }),
    }
}

/// How errors name a catalog: `etcd at HOST:PORT (prefix P)`.
pub(crate) fn at(url: &CatalogUrl) -> String {
    format!("{} (prefix {})", url.members(), url.prefix)
}

/// An etcd client for `url` (lazy: it connects on the first request).
pub(crate) async fn client(url: &CatalogUrl, o: &CatalogOptions) -> Result<etcd_client::Client> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(o.timeout)
        .with_timeout(o.timeout)
        .with_keep_alive(Duration::from_secs(10), o.timeout);
    if let Some((u, p)) = &o.user {
        opts = opts.with_user(u.clone(), p.clone());
    }
    if o.ca.is_some() || o.identity.is_some() {
        if !url.tls {
            return Err(Error::Config(format!(
                "catalog {url}: TLS files were given for a plain etcd:// URL: write etcds://"
            )));
        }
        let mut tls = etcd_client::TlsOptions::new();
        if let Some(ca) = &o.ca {
            let pem = std::fs::read(ca).map_err(|e| {
                Error::Config(format!("catalog CA certificate {}: {e}", ca.display()))
            })?;
            tls = tls.ca_certificate(etcd_client::Certificate::from_pem(pem));
        }
        if let Some((cert, key)) = &o.identity {
            let read = |p: &PathBuf, what: &str| {
                std::fs::read(p)
                    .map_err(|e| Error::Config(format!("catalog {what} {}: {e}", p.display())))
            };
            tls = tls.identity(etcd_client::Identity::from_pem(
                read(cert, "client certificate")?,
                read(key, "client key")?,
            ));
        }
        opts = opts.with_tls(tls);
    } else if url.tls {
        opts = opts.with_tls(etcd_client::TlsOptions::new().with_native_roots());
    }
    // with a user, connect asks for a token: that is a request, bounded like the others
    within(
        &at(url),
        "connect",
        o.timeout,
        etcd_client::Client::connect(url.uris(), Some(opts)),
    )
    .await
}

impl Catalog {
    /// Connect to the catalog at `url`.
    pub async fn connect(url: &CatalogUrl, opts: &CatalogOptions) -> Result<Catalog> {
        Ok(Catalog {
            client: client(url, opts).await?,
            url: url.clone(),
            layout: Layout::new(&url.prefix),
            timeout: opts.timeout,
        })
    }

    /// The catalog's URL.
    pub fn url(&self) -> &CatalogUrl {
        &self.url
    }

    pub(crate) fn at(&self) -> String {
        at(&self.url)
    }

    /// Every node and region of the catalog.
    pub async fn list(&self) -> Result<Listing> {
        let mut c = self.client.clone();
        let resp = within(
            &self.at(),
            "list",
            self.timeout,
            c.get(
                self.layout.all(),
                Some(GetOptions::new().with_prefix().with_limit(MAX_LISTED_KEYS)),
            ),
        )
        .await?;
        let mut l = Listing {
            revision: resp.header().map(|h| h.revision()).unwrap_or(0),
            ..Listing::default()
        };
        if resp.more() {
            l.skipped.push(format!(
                "the catalog holds more than {MAX_LISTED_KEYS} keys: only the first were read"
            ));
        }
        for kv in resp.kvs() {
            l.keys += 1;
            l.bytes += (kv.key().len() + kv.value().len()) as u64;
            match self.decode(kv.key(), kv.value()) {
                Some(CatalogEvent::RegionUp(r)) => l.regions.push(r),
                Some(CatalogEvent::NodeUp(n)) => l.nodes.push(n),
                Some(CatalogEvent::Skipped(why)) => l.skipped.push(why),
                _ => {}
            }
        }
        Ok(l)
    }

    /// The nodes serving `region`, best first (the rule of [`crate::choose`]).
    pub async fn resolve(&self, region: &str) -> Result<Vec<Replica>> {
        valid_region(region).map_err(Error::Config)?;
        let mut c = self.client.clone();
        let resp = within(
            &self.at(),
            "resolve",
            self.timeout,
            c.get(
                self.layout.region(region),
                Some(GetOptions::new().with_prefix().with_limit(MAX_REPLICAS)),
            ),
        )
        .await?;
        let mut entries = Vec::new();
        for kv in resp.kvs() {
            match self.decode(kv.key(), kv.value()) {
                Some(CatalogEvent::RegionUp(r)) => entries.push(r),
                Some(CatalogEvent::Skipped(why)) => tracing::warn!(%why, "catalog entry refused"),
                _ => {}
            }
        }
        if entries.is_empty() {
            return Err(Error::NotFound {
                at: self.at(),
                region: region.to_string(),
                hint: format!(" (`p2p-rdma ls {}` lists what is served)", self.url),
            });
        }
        // the replicas' node entries (their loads) in one transaction: one more round trip,
        // whatever the number of replicas
        let mut names: Vec<&str> = entries.iter().map(|e| e.node.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let reads: Vec<TxnOp> = names
            .iter()
            .map(|n| TxnOp::get(self.layout.node_key(n), None))
            .collect();
        let resp = within(
            &self.at(),
            "resolve",
            self.timeout,
            c.txn(Txn::new().and_then(reads)),
        )
        .await?;
        let mut nodes = Vec::new();
        for (name, r) in names.iter().zip(resp.op_responses()) {
            let TxnOpResponse::Get(g) = r else { continue };
            if let Some(kv) = g.kvs().first() {
                match decode_node(name, kv.value()) {
                    Ok(n) => nodes.push(n),
                    Err(why) => tracing::warn!(%why, node = name, "catalog node entry refused"),
                }
            }
        }
        Ok(rank(replicas(entries, &nodes), rand::random::<u64>))
    }

    /// A key and value of the catalog as an event (`None`: not a key of this layout).
    pub(crate) fn decode(&self, key: &[u8], value: &[u8]) -> Option<CatalogEvent> {
        let name = String::from_utf8_lossy(key).into_owned();
        Some(match self.layout.parse(key)? {
            Key::Node(node) => match decode_node(&node, value) {
                Ok(n) => CatalogEvent::NodeUp(n),
                Err(why) => CatalogEvent::Skipped(format!("{name}: {why}")),
            },
            Key::Region { region, node } => match decode_region(&region, &node, value) {
                Ok(r) => CatalogEvent::RegionUp(r),
                Err(why) => CatalogEvent::Skipped(format!("{name}: {why}")),
            },
        })
    }
}
