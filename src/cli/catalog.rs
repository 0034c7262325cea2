//! The catalog on the command line: etcd connection options, `serve --catalog` publishing,
//! `ls etcd://...` of the whole cluster, and fetch/put by region name.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use bridge::size::human;
use catalog::{Catalog, CatalogOptions, CatalogUrl};

use super::emit;
use super::exit::Usage;

/// How to reach etcd (any command that takes an `etcd://` address, and `serve --catalog`).
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct EtcdArgs {
    /// etcd user (etcd's own authentication); the password comes from
    /// --catalog-password-file or P2P_RDMA_ETCD_PASSWORD.
    #[arg(long, value_name = "USER")]
    pub(crate) catalog_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, value_name = "FILE")]
    pub(crate) catalog_password_file: Option<PathBuf>,
    /// CA certificate (PEM) of the etcd members (with an etcds:// URL; default: the system's
    /// roots).
    #[arg(long, value_name = "FILE")]
    pub(crate) catalog_ca: Option<PathBuf>,
    /// Client certificate (PEM), for members that require one (with --catalog-key).
    #[arg(long, value_name = "FILE", requires = "catalog_key")]
    pub(crate) catalog_cert: Option<PathBuf>,
    /// Client certificate's key (PEM).
    #[arg(long, value_name = "FILE", requires = "catalog_cert")]
    pub(crate) catalog_key: Option<PathBuf>,
    /// Seconds to wait for etcd at each request.
    #[arg(long, value_name = "SECONDS")]
    pub(crate) catalog_timeout: Option<u64>,
}

/// The `[catalog]` table of `serve --config` (all optional; flags override).
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CatalogFile {
    pub(crate) url: Option<String>,
    pub(crate) ttl_secs: Option<u64>,
    pub(crate) node: Option<String>,
    #[serde(default)]
    pub(crate) advertise: Vec<String>,
    pub(crate) user: Option<String>,
    pub(crate) password_file: Option<PathBuf>,
    pub(crate) ca: Option<PathBuf>,
    pub(crate) cert: Option<PathBuf>,
    pub(crate) key: Option<PathBuf>,
    pub(crate) timeout_secs: Option<u64>,
}

impl EtcdArgs {
    /// The options, flags first, then the config file's `[catalog]` table.
    pub(crate) fn options(&self, file: &CatalogFile) -> anyhow::Result<CatalogOptions> {
        let mut o = CatalogOptions::default();
        if let Some(s) = self.catalog_timeout.or(file.timeout_secs) {
            o.timeout = Duration::from_secs(s.max(1));
        }
        if let Some(user) = self.catalog_user.clone().or(file.user.clone()) {
            let pw = match self
                .catalog_password_file
                .as_ref()
                .or(file.password_file.as_ref())
            {
                Some(f) => std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read the etcd password file {}", f.display()))?
                    .trim()
                    .to_string(),
                None => std::env::var("P2P_RDMA_ETCD_PASSWORD").map_err(|_| {
                    Usage(format!(
                        "etcd user '{user}' needs a password: --catalog-password-file FILE or \
                         P2P_RDMA_ETCD_PASSWORD"
                    ))
                })?,
            };
            o.user = Some((user, pw));
        }
        o.ca = self.catalog_ca.clone().or(file.ca.clone());
        o.identity = match (
            self.catalog_cert.clone().or(file.cert.clone()),
            self.catalog_key.clone().or(file.key.clone()),
        ) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(Usage(
                    "a client certificate needs its key, and a key its certificate".into(),
                )
                .into())
            }
        };
        Ok(o)
    }
}

/// Parse an `etcd://` address given where a server address may be.
pub(crate) fn url(s: &str) -> anyhow::Result<CatalogUrl> {
    Ok(s.parse::<CatalogUrl>().map_err(Usage)?)
}

/// `ls etcd://...`: every region of the cluster, by region then node, and the nodes.
pub(crate) async fn ls(
    url: &CatalogUrl,
    o: &CatalogOptions,
    json: bool,
    watch: bool,
) -> anyhow::Result<()> {
    let c = Catalog::connect(url, o).await?;
    let l = c.list().await?;
    match (json, watch) {
        (true, false) => return emit(&format!("{}\n", serde_json::to_string_pretty(&l)?)),
        // JSON lines: the listing, then one line per change
        (true, true) => emit(&format!(
            "{}\n",
            serde_json::json!({"event": "listing", "listing": l})
        ))?,
        (false, _) => emit(&listing_text(&l, url))?,
    }
    if watch {
        let mut w = c.watch(Some(l.revision)).await?;
        while let Some(ev) = w.next().await? {
            use catalog::CatalogEvent as E;
            let line = match (&ev, json) {
                (E::RegionUp(r), true) => {
                    serde_json::json!({"event": "region_up", "entry": r}).to_string()
                }
                (E::RegionDown { region, node }, true) => {
                    serde_json::json!({"event": "region_down", "region": region, "node": node})
                        .to_string()
                }
                (E::NodeUp(n), true) => {
                    serde_json::json!({"event": "node_up", "entry": n}).to_string()
                }
                (E::NodeDown(n), true) => {
                    serde_json::json!({"event": "node_down", "node": n}).to_string()
                }
                (E::Skipped(s), true) => {
                    serde_json::json!({"event": "skipped", "why": s}).to_string()
                }
                (E::RegionUp(r), false) => format!(
                    "+ region {} on {} ({}, {}, {})",
                    r.region,
                    r.node,
                    human(r.size),
                    r.access,
                    r.path
                ),
                (E::RegionDown { region, node }, false) => format!("- region {region} on {node}"),
                (E::NodeUp(n), false) => {
                    format!("+ node {} ({} connections)", n.node, n.connections)
                }
                (E::NodeDown(n), false) => format!("- node {n}"),
                (E::Skipped(s), false) => format!("! skipped {s}"),
                (E::Interrupted(why), true) => {
                    serde_json::json!({"event": "interrupted", "why": why}).to_string()
                }
                (E::Resumed, true) => serde_json::json!({"event": "resumed"}).to_string(),
                (E::Relisted(l), true) => {
                    serde_json::json!({"event": "relisted", "listing": l}).to_string()
                }
                (E::Interrupted(why), false) => format!("! {why}"),
                (E::Resumed, false) => "! watching again (no change was missed)".to_string(),
                (E::Relisted(l), false) => format!(
                    "! etcd compacted the changes made while the watch was away; the catalog now:\n{}",
                    listing_text(l, url).trim_end()
                ),
            };
            emit(&format!("{line}\n"))?;
        }
    }
    Ok(())
}

/// The text of `ls etcd://...`: regions, nodes, skipped entries and a summary line.
fn listing_text(l: &catalog::Listing, url: &CatalogUrl) -> String {
    let mut out = format!(
        "{:<16} {:<22} {:>10}  {:<6} {:<8} {:<7} {:<9} {}\n",
        "REGION", "NODE", "SIZE", "ACCESS", "KIND", "PATH", "STRATEGY", "ENDPOINT"
    );
    for r in &l.regions {
        out.push_str(&format!(
            "{:<16} {:<22} {:>10}  {:<6} {:<8} {:<7} {:<9} {}\n",
            r.region,
            r.node,
            human(r.size),
            r.access,
            r.kind,
            r.path,
            r.strategy.as_deref().unwrap_or("-"),
            r.endpoints.join(",")
        ));
    }
    out.push_str(&format!(
        "\n{:<22} {:>11}  {:<24} {}\n",
        "NODE", "CONNECTIONS", "ENDPOINTS", "NICS"
    ));
    for n in &l.nodes {
        out.push_str(&format!(
            "{:<22} {:>11}  {:<24} {}\n",
            n.node,
            n.connections,
            n.endpoints.join(","),
            n.nics.join(",")
        ));
    }
    for s in &l.skipped {
        out.push_str(&format!("skipped: {s}\n"));
    }
    out.push_str(&format!(
        "{} region entr{} on {} node{} ({} keys, {} in {url})\n",
        l.regions.len(),
        if l.regions.len() == 1 { "y" } else { "ies" },
        l.nodes.len(),
        if l.nodes.len() == 1 { "" } else { "s" },
        l.keys,
        human(l.bytes)
    ));
    out
}

/// A region opened for a transfer: the connection, the open region, and (by name) the
/// replicas left to try if this one fails.
pub(crate) struct Target {
    pub(crate) client: bridge::Client,
    pub(crate) region: bridge::OpenRegion,
    pub(crate) rest: Vec<catalog::Replica>,
}

/// `base` with another server address.
fn at(base: &bridge::ClientConfig, addr: String) -> bridge::ClientConfig {
    bridge::ClientConfig {
        addr,
        ..base.clone()
    }
}

/// Connect and open `region` for `purpose` (a fetch names its range, whose first chunk the
/// server stages with the open: [`bridge::Client::open_for`]): at a server's address, or by
/// name through an `etcd://` catalog on the best node that answers (`--node`: that one only),
/// saying on stderr which node serves it and which failed before.
pub(crate) async fn open(
    addr: &str,
    region: &str,
    purpose: bridge::OpenFor,
    base: &bridge::ClientConfig,
    a: &super::transfer::ClientArgs,
) -> anyhow::Result<Target> {
    if !CatalogUrl::is_catalog(addr) {
        if a.node.is_some() {
            return Err(Usage(
                "--node picks a replica in a catalog: give an etcd:// address".into(),
            )
            .into());
        }
        let mut client = bridge::Client::connect(at(base, addr.to_string())).await?;
        let region = client.open_for(region, purpose).await?;
        return Ok(Target {
            client,
            region,
            rest: Vec::new(),
        });
    }
    let c = Catalog::connect(&url(addr)?, &a.etcd.options(&Default::default())?).await?;
    let opened =
        catalog::open::open(&c, region, purpose, a.node.as_deref(), &|e| at(base, e)).await?;
    Ok(said(opened))
}

/// Open on the next of `rest` (after a failure), as [`open`] does by name.
pub(crate) async fn next(
    region: &str,
    rest: Vec<catalog::Replica>,
    purpose: bridge::OpenFor,
    base: &bridge::ClientConfig,
) -> anyhow::Result<Target> {
    let opened = catalog::open::open_among(region, rest, purpose, &|e| at(base, e)).await?;
    Ok(said(opened))
}

fn said(o: catalog::open::Opened) -> Target {
    say(&o);
    Target {
        client: o.client,
        region: o.region,
        rest: o.rest,
    }
}

fn say(o: &catalog::open::Opened) {
    for f in &o.failed {
        eprintln!("p2p-rdma: catalog: skipped {f}");
    }
    eprintln!(
        "p2p-rdma: catalog: region '{}' from node {} at {} ({} path{})",
        o.region.info.name,
        o.replica.entry.node,
        o.endpoint,
        o.replica.entry.path,
        o.replica
            .connections
            .map(|n| format!(", {n} connections"))
            .unwrap_or_default()
    );
}
