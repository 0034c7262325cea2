//! `ls`: the regions one server offers, or (an etcd:// address) every region of a cluster.

use std::time::Duration;

use bridge::size::human;

use super::emit;
use super::exit::Usage;
use super::transfer::TokenArgs;

/// `ls`: a server's regions, or a catalog's.
#[derive(clap::Args, Debug)]
pub(crate) struct LsArgs {
    /// Server control address HOST:PORT, or a catalog etcd://HOST:PORT[,...]/PREFIX:
    /// every region of the cluster, with the node serving it and its path (no token
    /// needed: the catalog holds no secret).
    pub(crate) addr: String,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    /// Print JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Seconds to wait for the server.
    #[arg(long, default_value_t = 30)]
    pub(crate) timeout: u64,
    /// With a catalog: after the listing, print regions and nodes as they come and go, until
    /// interrupted. An etcd outage is said, the watch reconnects by itself and goes on from
    /// where it stopped (or lists again when etcd has compacted that history). With --json:
    /// one JSON object per line, the first {"event":"listing",...}.
    #[arg(long)]
    pub(crate) watch: bool,
    #[command(flatten)]
    pub(crate) etcd: super::catalog::EtcdArgs,
}

pub(crate) async fn run(a: LsArgs) -> anyhow::Result<()> {
    let LsArgs {
        addr,
        token,
        json,
        timeout,
        watch,
        etcd,
    } = a;
    if catalog::CatalogUrl::is_catalog(&addr) {
        let url = super::catalog::url(&addr)?;
        let o = etcd.options(&Default::default())?;
        return super::catalog::ls(&url, &o, json, watch).await;
    }
    if watch {
        return Err(Usage("--watch follows a catalog: give an etcd:// address".into()).into());
    }
    let mut cfg = bridge::ClientConfig::new(addr, token.load()?);
    cfg.timeout = Duration::from_secs(timeout.max(1));
    let mut c = bridge::Client::connect(cfg).await?;
    let regions = c.list().await?;
    let _ = c.bye().await;
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&regions)?))
    } else {
        let mut o = format!(
            "{:<16} {:>14} {:>10}  {:<6} {:<8} {:<7} {}\n",
            "REGION", "BYTES", "SIZE", "ACCESS", "KIND", "PATH", "STRATEGY"
        );
        for r in regions {
            o.push_str(&format!(
                "{:<16} {:>14} {:>10}  {:<6} {:<8} {:<7} {}\n",
                r.name,
                r.size,
                human(r.size),
                r.access.to_string(),
                r.kind,
                r.path.to_string(),
                r.strategy.as_deref().unwrap_or("-")
            ));
            if r.extents.len() > 1 {
                for e in &r.extents {
                    o.push_str(&format!(
                        "    bytes {}..{}: {}\n",
                        e.offset,
                        e.offset + e.len,
                        e.path
                    ));
                }
            }
            if !r.reason.is_empty() {
                o.push_str(&format!("    why: {}\n", r.reason));
            }
            if let Some(res) = &r.residency {
                o.push_str(&format!("    residency: {res}\n"));
            }
            if let Some(nic) = &r.nic {
                o.push_str(&format!("    served from: {nic}\n"));
            }
        }
        emit(&o)
    }
}
