//! The serving side: publish what a node serves under a lease it keeps alive, follow changes,
//! and survive etcd going away.
//!
//! The publisher never stops the node from serving. While etcd is unreachable it retries
//! (backing off to 5 s); when etcd answers again it takes a new lease and publishes everything
//! again. Every key is attached to the lease: if the node dies without revoking it, etcd
//! deletes its keys once the TTL passes without a keep-alive. [`Publisher::stop`] revokes the
//! lease, so a node that shuts down leaves the catalog at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp};
use tokio::sync::watch;

use crate::catalog::{at, client, within, CatalogOptions};
use crate::entry::{NodeEntry, RegionEntry};
use crate::error::{Error, Result};
use crate::keys::{valid_node, Key, Layout};
use crate::reconcile::{desired, Op, Reconcile, MAX_OPS_PER_TXN};
use crate::url::CatalogUrl;

/// Shortest and longest lease TTL.
pub const TTL_RANGE: std::ops::RangeInclusive<u64> = 2..=3600;

/// What the node serves now: called about once a second.
pub type Source = Arc<dyn Fn() -> (NodeEntry, Vec<RegionEntry>) + Send + Sync>;

/// Settings of a publisher.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Where.
    pub url: CatalogUrl,
    /// How to reach etcd.
    pub options: CatalogOptions,
    /// The node's name in the catalog.
    pub node: String,
    /// Lease TTL: how long the node's entries outlive it when it dies without revoking.
    pub ttl: Duration,
    /// How often to compare what is served with what is published.
    pub interval: Duration,
}

impl PublisherConfig {
    /// Defaults: TTL 10 s, checked every second.
    pub fn new(url: CatalogUrl, node: impl Into<String>) -> PublisherConfig {
        PublisherConfig {
            url,
            options: CatalogOptions::default(),
            node: node.into(),
            ttl: Duration::from_secs(10),
            interval: Duration::from_secs(1),
        }
    }
}

/// Where a publisher stands.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PublishStatus {
    /// Everything the node serves is in the catalog under a live lease.
    pub published: bool,
    /// Keys of this node in the catalog.
    pub keys: usize,
    /// The lease (0: none).
    pub lease: i64,
    /// Leases taken so far (more than one: etcd went away and came back, or the lease ended).
    pub leases: u64,
    /// The last error, until the next success.
    pub error: Option<String>,
    /// Seconds the first complete publication took.
    pub first_publish_seconds: Option<f64>,
}

/// A running publisher.
#[derive(Debug)]
pub struct Publisher {
    stop: watch::Sender<bool>,
    status: watch::Receiver<PublishStatus>,
    task: tokio::task::JoinHandle<()>,
}

impl Publisher {
    /// Start publishing what `source` says (in a task of the current runtime).
    pub fn start(cfg: PublisherConfig, source: Source) -> Result<Publisher> {
        valid_node(&cfg.node).map_err(Error::Config)?;
        if !TTL_RANGE.contains(&cfg.ttl.as_secs()) {
            return Err(Error::Config(format!(
                "catalog lease TTL {} s: give {} to {} s",
                cfg.ttl.as_secs(),
                TTL_RANGE.start(),
                TTL_RANGE.end()
            )));
        }
        let (stop, stop_rx) = watch::channel(false);
        let (status_tx, status) = watch::channel(PublishStatus::default());
        let task = tokio::spawn(run(cfg, source, stop_rx, status_tx));
        Ok(Publisher { stop, status, task })
    }

    /// Where it stands now.
    pub fn status(&self) -> PublishStatus {
        self.status.borrow().clone()
    }

    /// Wait until everything is published (or `timeout`), returning the status then.
    pub async fn published(&self, timeout: Duration) -> PublishStatus {
        let mut rx = self.status.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|s| s.published)).await;
        self.status()
    }

    /// Revoke the lease (the node's entries leave the catalog at once) and stop. Waits at most
    /// a few seconds for etcd.
    pub async fn stop(self) -> PublishStatus {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(6), self.task).await;
        self.status.borrow().clone()
    }
}

/// Why a session with etcd ended.
enum End {
    Stop,
    Lost(String),
}

async fn run(
    cfg: PublisherConfig,
    source: Source,
    mut stop: watch::Receiver<bool>,
    status: watch::Sender<PublishStatus>,
) {
    let layout = Layout::new(&cfg.url.prefix);
    let started = Instant::now();
    let mut backoff = Duration::from_millis(200);
    let mut said_down = false;
    loop {
        match session(&cfg, &layout, &source, &mut stop, &status, started).await {
            End::Stop => return,
            End::Lost(why) => {
                if status.borrow().published {
                    // it was up: this is a new outage, worth saying
                    said_down = false;
                }
                if !said_down {
                    tracing::warn!(
                        catalog = %cfg.url, error = %why,
                        "catalog unreachable: serving goes on; publishing again when etcd answers"
                    );
                    said_down = true;
                }
                status.send_modify(|s| {
                    s.published = false;
                    s.lease = 0;
                    s.error = Some(why);
                });
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One lease: grant it, publish, keep it alive and follow changes until etcd is lost or a
/// stop is asked for.
async fn session(
    cfg: &PublisherConfig,
    layout: &Layout,
    source: &Source,
    stop: &mut watch::Receiver<bool>,
    status: &watch::Sender<PublishStatus>,
    started: Instant,
) -> End {
    let at = at(&cfg.url);
    let t = cfg.options.timeout;
    let lost = |e: Error| End::Lost(e.to_string());
    let mut c = match client(&cfg.url, &cfg.options).await {
        Ok(c) => c,
        Err(e) => return lost(e),
    };
    let ttl = cfg.ttl.as_secs() as i64;
    let lease = match within(&at, "lease grant", t, c.lease_grant(ttl, None)).await {
        Ok(l) => l.id(),
        Err(e) => return lost(e),
    };
    let (mut keeper, mut acks) =
        match within(&at, "lease keep-alive", t, c.lease_keep_alive(lease)).await {
            Ok(k) => k,
            Err(e) => return lost(e),
        };
    tracing::info!(catalog = %cfg.url, node = cfg.node, lease, ttl, "catalog lease granted");
    status.send_modify(|s| {
        s.lease = lease;
        s.leases += 1;
    });
    let mut rec = Reconcile::new();
    // keys an earlier run of this node left under a lease not yet expired (a crash, a restart
    // within the TTL): its node entry names that lease, and the lease lists its keys, so this
    // reads the node's own keys only, whatever the size of the cluster
    match leftovers(&mut c, &at, t, layout, &cfg.node).await {
        Ok(keys) => {
            if !keys.is_empty() {
                tracing::info!(catalog = %cfg.url, node = cfg.node, keys = keys.len(), "catalog keys of an earlier run adopted");
            }
            rec.adopt(keys)
        }
        Err(e) => return lost(e),
    }
    let keep_every = Duration::from_secs((ttl as u64 / 3).max(1));
    let mut keep = tokio::time::interval(keep_every);
    let mut check = tokio::time::interval(cfg.interval);
    let mut last_ack = Instant::now();
    loop {
        tokio::select! {
            _ = stop.changed() => {
                let _ = within(&at, "lease revoke", t.min(Duration::from_secs(5)), c.lease_revoke(lease)).await;
                tracing::info!(catalog = %cfg.url, node = cfg.node, "catalog lease revoked");
                status.send_modify(|s| { s.published = false; s.keys = 0; s.lease = 0; });
                return End::Stop;
            }
            _ = keep.tick() => {
                if last_ack.elapsed() > cfg.ttl {
                    return End::Lost(format!("no keep-alive answer for {} s: the lease has ended", cfg.ttl.as_secs()));
                }
                if let Err(e) = keeper.keep_alive().await {
                    return End::Lost(format!("lease keep-alive: {e}"));
                }
            }
            ack = acks.message() => match ack {
                Ok(Some(a)) if a.ttl() > 0 => last_ack = Instant::now(),
                Ok(Some(_)) => return End::Lost(format!("etcd says lease {lease:x} has ended")),
                Ok(None) => return End::Lost("etcd closed the keep-alive stream".into()),
                Err(e) => return End::Lost(format!("lease keep-alive: {e}")),
            },
            _ = check.tick() => {
                let (node, regions) = source();
                let (want, refused) = desired(layout, &node, &regions);
                for why in refused {
                    tracing::warn!(catalog = %cfg.url, %why, "not published");
                }
                let ops = rec.plan(&want);
                for batch in ops.chunks(MAX_OPS_PER_TXN) {
                    let txn = Txn::new().and_then(
                        batch.iter().map(|op| match op {
                            Op::Put { key, value } => TxnOp::put(
                                key.as_str(),
                                value.as_str(),
                                Some(PutOptions::new().with_lease(lease)),
                            ),
                            Op::Delete { key } => TxnOp::delete(key.as_str(), None),
                        }).collect::<Vec<_>>(),
                    );
                    if let Err(e) = within(&at, "publish", t, c.txn(txn)).await {
                        return lost(e);
                    }
                    rec.applied(batch);
                }
                let first = status.borrow().first_publish_seconds.is_none();
                let (was_up, leases) = (status.borrow().published, status.borrow().leases);
                if !was_up && leases > 1 {
                    tracing::warn!(catalog = %cfg.url, node = cfg.node, keys = rec.published(), "catalog reachable again: everything published under a new lease");
                }
                status.send_modify(|s| {
                    s.published = true;
                    s.keys = rec.published();
                    s.error = None;
                    if first {
                        s.first_publish_seconds = Some(started.elapsed().as_secs_f64());
                    }
                });
                if !ops.is_empty() {
                    tracing::debug!(catalog = %cfg.url, writes = ops.len(), "catalog updated");
                }
            }
        }
    }
}

/// The keys of this node that an earlier run left: those of the lease its node entry is under.
async fn leftovers(
    c: &mut etcd_client::Client,
    at: &str,
    t: Duration,
    layout: &Layout,
    node: &str,
) -> Result<Vec<String>> {
    let r = within(
        at,
        "read own node entry",
        t,
        c.get(layout.node_key(node), None),
    )
    .await?;
    let Some(old) = r.kvs().first().map(|kv| kv.lease()).filter(|l| *l != 0) else {
        return Ok(Vec::new());
    };
    let ttl = within(
        at,
        "list own keys",
        t,
        c.lease_time_to_live(old, Some(LeaseTimeToLiveOptions::new().with_keys())),
    )
    .await?;
    Ok(ttl
        .keys()
        .iter()
        .filter_map(|k| match layout.parse(k)? {
            Key::Region { region, node: n } if n == node => Some(layout.region_key(&region, &n)),
            Key::Node(n) if n == node => Some(layout.node_key(&n)),
            _ => None,
        })
        .collect())
}
