//! Following a catalog: regions and nodes as they come and go, across etcd outages.
//!
//! A watch remembers the last revision it delivered. When etcd goes away it says so once
//! ([`CatalogEvent::Interrupted`]), reconnects with a backoff, and watches again from the next
//! revision, so no change is missed ([`CatalogEvent::Resumed`]). When etcd has compacted that
//! history meanwhile, the watch lists the catalog again and hands over the listing
//! ([`CatalogEvent::Relisted`]) before going on.

use std::collections::VecDeque;
use std::time::Duration;

use etcd_client::{EventType, WatchOptions, WatchResponse};

use crate::catalog::{within, Catalog, CatalogEvent};
use crate::error::{describe, words, Error, Result};
use crate::keys::Key;

/// First and longest wait between two attempts to watch again.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(5));

impl Catalog {
    /// Watch the catalog from now on; start from a [`Catalog::list`] and give its revision to
    /// miss nothing between the two. The first watch must be set up now (its failure is the
    /// error); later outages are events, not errors.
    pub async fn watch(&self, after_revision: Option<i64>) -> Result<CatalogWatch> {
        let stream = self.watch_from(after_revision).await?;
        Ok(CatalogWatch {
            catalog: self.clone(),
            stream: Some(stream),
            revision: after_revision,
            pending: VecDeque::new(),
            backoff: BACKOFF.0,
            away: false,
        })
    }

    async fn watch_from(&self, after_revision: Option<i64>) -> Result<etcd_client::WatchStream> {
        let mut c = self.client.clone();
        let mut opts = WatchOptions::new().with_prefix();
        if let Some(r) = after_revision {
            opts = opts.with_start_revision(r + 1);
        }
        let stream = within(
            &self.at(),
            "watch",
            self.timeout,
            c.watch(self.layout.all(), Some(opts)),
        )
        .await?;
        Ok(stream)
    }
}

/// Changes of a catalog as they happen.
pub struct CatalogWatch {
    catalog: Catalog,
    /// `None` while etcd is away.
    stream: Option<etcd_client::WatchStream>,
    /// The last revision delivered (`None`: only "from now on" is known).
    revision: Option<i64>,
    pending: VecDeque<CatalogEvent>,
    backoff: Duration,
    /// Interrupted was said and Resumed not yet.
    away: bool,
}

impl std::fmt::Debug for CatalogWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatalogWatch")
            .field("catalog", &self.catalog)
            .field("revision", &self.revision)
            .finish()
    }
}

impl CatalogWatch {
    /// The next change. It waits as long as it takes, across etcd outages (which it reports as
    /// events); an error is a refusal that watching again cannot cure (e.g. permission).
    pub async fn next(&mut self) -> Result<Option<CatalogEvent>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(Some(e));
            }
            let Some(stream) = self.stream.as_mut() else {
                self.reconnect().await?;
                continue;
            };
            match stream.message().await {
                Ok(Some(resp)) => self.take(resp).await?,
                Ok(None) => self.lost("etcd ended the watch".into()),
                Err(e) => {
                    let (kind, why) = describe(&e);
                    if kind == crate::EtcdFailure::Auth {
                        return Err(Error::Etcd {
                            at: self.catalog.at(),
                            op: "watch",
                            kind,
                            why,
                        });
                    }
                    self.lost(words(&e));
                }
            }
        }
    }

    /// The revision of the last change delivered.
    pub fn revision(&self) -> Option<i64> {
        self.revision
    }

    fn lost(&mut self, why: String) {
        self.stream = None;
        if !self.away {
            self.away = true;
            tracing::info!(catalog = %self.catalog.at(), %why, "catalog watch interrupted");
            self.pending.push_back(CatalogEvent::Interrupted(format!(
                "catalog {}: watch interrupted: {why}; watching again when etcd answers",
                self.catalog.at()
            )));
        }
    }

    /// Watch again from the next revision, waiting (with the backoff) until etcd answers.
    async fn reconnect(&mut self) -> Result<()> {
        loop {
            tokio::time::sleep(self.backoff).await;
            self.backoff = (self.backoff * 2).clamp(BACKOFF.0, BACKOFF.1);
            match self.catalog.watch_from(self.revision).await {
                Ok(s) => {
                    self.stream = Some(s);
                    self.backoff = BACKOFF.0;
                    return Ok(());
                }
                // credentials refused now: watching again will not cure it
                Err(
                    e @ Error::Etcd {
                        kind: crate::EtcdFailure::Auth,
                        ..
                    },
                ) => return Err(e),
                Err(e) => tracing::debug!(error = %e, "catalog watch: etcd still away"),
            }
        }
    }

    async fn take(&mut self, resp: WatchResponse) -> Result<()> {
        if resp.created() {
            if self.away {
                self.away = false;
                tracing::info!(catalog = %self.catalog.at(), "catalog watch resumed");
                self.pending.push_back(CatalogEvent::Resumed);
            }
            if self.revision.is_none() {
                // "from now on": now is this revision
                self.revision = resp.header().map(|h| h.revision());
            }
        }
        if resp.canceled() {
            if resp.compact_revision() > 0 {
                // the changes since our revision are gone: the catalog as it is now instead
                let l = self.catalog.list().await?;
                tracing::info!(
                    catalog = %self.catalog.at(),
                    from = ?self.revision,
                    compacted = resp.compact_revision(),
                    now = l.revision,
                    "catalog watch: history compacted, listed again"
                );
                self.revision = Some(l.revision);
                self.stream = None;
                self.backoff = Duration::ZERO;
                self.away = false;
                self.pending.push_back(CatalogEvent::Relisted(l));
                return Ok(());
            }
            return Err(Error::Config(format!(
                "catalog {}: etcd cancelled the watch: {}",
                self.catalog.at(),
                resp.cancel_reason()
            )));
        }
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            self.revision = Some(self.revision.unwrap_or(0).max(kv.mod_revision()));
            let e = match ev.event_type() {
                EventType::Put => self.catalog.decode(kv.key(), kv.value()),
                EventType::Delete => match self.catalog.layout.parse(kv.key()) {
                    Some(Key::Node(n)) => Some(CatalogEvent::NodeDown(n)),
                    Some(Key::Region { region, node }) => {
                        Some(CatalogEvent::RegionDown { region, node })
                    }
                    None => None,
                },
            };
            self.pending.extend(e);
        }
        Ok(())
    }
}
