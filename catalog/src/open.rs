//! Opening a region by name: resolve it, then connect to its replicas in the order of
//! [`crate::choose`] until one opens it.

use crate::catalog::Catalog;
use crate::choose::Replica;
use crate::error::{Error, Result};

/// A region opened on one of its nodes.
#[derive(Debug)]
pub struct Opened {
    /// The connection to that node.
    pub client: bridge::Client,
    /// The open region.
    pub region: bridge::OpenRegion,
    /// The replica used.
    pub replica: Replica,
    /// The endpoint connected to.
    pub endpoint: String,
    /// Replicas tried before it, with why each failed.
    pub failed: Vec<String>,
    /// Replicas not tried yet, in order (for a retry if this one fails later).
    pub rest: Vec<Replica>,
}

/// Resolve `region` and open it for `purpose` on the best node that answers (a fetch's open
/// names its range, so that the node stages its first chunk: [`bridge::Client::open_for`]).
/// `node` restricts the choice to one node; `config` makes a client configuration for an
/// endpoint (the token, device and timeouts of the caller). A write open is refused when
/// several nodes publish the name and none was named: a put to one replica would leave the
/// others different.
pub async fn open(
    catalog: &Catalog,
    region: &str,
    purpose: bridge::OpenFor,
    node: Option<&str>,
    config: &dyn Fn(String) -> bridge::ClientConfig,
) -> Result<Opened> {
    let mut replicas = catalog.resolve(region).await?;
    if let Some(n) = node {
        let all: Vec<String> = replicas.iter().map(|r| r.entry.node.clone()).collect();
        replicas.retain(|r| r.entry.node == n);
        if replicas.is_empty() {
            return Err(Error::NotFound {
                at: format!("{}", catalog.url()),
                region: format!("{region}' on node '{n}"),
                hint: format!(" (it is served by: {})", all.join(", ")),
            });
        }
    }
    if purpose.writes() && replicas.len() > 1 {
        let all: Vec<&str> = replicas.iter().map(|r| r.entry.node.as_str()).collect();
        return Err(Error::Config(format!(
            "region '{region}' has {} replicas ({}): a put would change only one of them; \
             name the node to write (--node NODE)",
            replicas.len(),
            all.join(", ")
        )));
    }
    open_among(region, replicas, purpose, config).await
}

/// Open `region` for `purpose` on the first of `replicas` that answers (each endpoint of each
/// in turn).
pub async fn open_among(
    region: &str,
    replicas: Vec<Replica>,
    purpose: bridge::OpenFor,
    config: &dyn Fn(String) -> bridge::ClientConfig,
) -> Result<Opened> {
    let mut failed = Vec::new();
    let mut left = replicas.into_iter();
    while let Some(replica) = left.next() {
        for ep in &replica.entry.endpoints {
            let attempt = async {
                let mut c = bridge::Client::connect(config(ep.clone())).await?;
                let r = c.open_for(region, purpose).await?;
                Ok::<_, bridge::Error>((c, r))
            };
            match attempt.await {
                Ok((client, r)) => {
                    return Ok(Opened {
                        client,
                        region: r,
                        endpoint: ep.clone(),
                        replica,
                        failed,
                        rest: left.collect(),
                    })
                }
                Err(e) => {
                    tracing::info!(region, node = replica.entry.node, endpoint = ep, error = %e, "replica failed; trying the next");
                    failed.push(format!("node {} at {ep}: {e}", replica.entry.node));
                }
            }
        }
    }
    Err(Error::NoReplica {
        region: region.to_string(),
        tried: failed.join("; "),
    })
}
