//! `p2p-rdma serve`: flags and config file merged, metrics endpoint, start-up report,
//! readiness for service managers, SIGTERM drain and SIGHUP token reload.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bridge::size::human;

use super::config;
use super::exit::Usage;
use super::read_grants;

/// `serve`'s arguments (every one may also come from `--config`).
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// TOML file with any of the settings below (flags given here override it; --region
    /// flags replace its regions). See `p2p-rdma serve --help` for the keys.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate FILE (keys, addresses, sizes, region specs) without opening anything, and exit:
    /// 0 when it is valid, 2 naming the bad key and line.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    check_config: Option<PathBuf>,
    /// RDMA device to serve from (default: the first one with an active port). Several
    /// (repeat the flag, or separate with commas), or `all` (every one with an active port):
    /// each region is then served from the one the topology ranks best for its memory (a CMB
    /// or GPU behind the same PCIe switch first; host memory: the first device), and `ls`
    /// names it.
    #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE", value_delimiter = ',')]
    device: Vec<String>,
    /// Control address to listen on [default: 0.0.0.0:7471].
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<SocketAddr>,
    /// Token file (re-read on SIGHUP): one secret per line, alone (every region) or followed by
    /// the regions it grants, `NAME` or `NAME:ro` for reading, `NAME:rw` for writing too.
    /// Default: the one secret of P2P_RDMA_TOKEN.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// A region to serve (repeatable); the grammar is below.
    #[arg(long = "region", short = 'r', value_name = "SPEC")]
    regions: Vec<bridge::RegionSpec>,
    /// Peer-to-peer policy: required (refuse regions that cannot go direct), preferred
    /// (bounce when no strategy works), disabled (always bounce) [default: preferred].
    #[arg(long, value_name = "POLICY")]
    p2p: Option<peermem::plan::P2pPolicy>,
    /// Registration strategy: auto tries dma-buf, pinned, then ODP; pinned, odp or dmabuf
    /// force one (the canary still runs) [default: auto].
    #[arg(long = "reg", value_name = "STRATEGY")]
    reg: Option<peermem::plan::RegChoice>,
    /// How clients reach the regions' direct parts: auto (one registration per region and a
    /// memory window per open, where the device proves windows; read-only memory then goes
    /// through bounce buffers, since an MW_BIND registration is pinned for writing) or
    /// per-connection (each connection registers what it opens: read-only memory goes direct,
    /// but every open pins the region and bounce fetches are written by the server)
    /// [default: auto].
    #[arg(long, value_name = "POLICY")]
    sharing: Option<bridge::server::SharingPolicy>,
    /// Bytes per bounce staging buffer, the largest bounce request [default: 1M].
    #[arg(long, value_parser = super::parse_size_arg, value_name = "SIZE")]
    bounce_chunk: Option<u64>,
    /// Bounce staging buffers per connection (copies and transfers in flight) [default: 8].
    #[arg(long, value_name = "N")]
    bounce_depth: Option<usize>,
    /// Most concurrent client connections [default: 64].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// RDMA operations a client may keep in flight [default: 16].
    #[arg(long, value_name = "N")]
    max_outstanding: Option<u32>,
    /// Serve Prometheus metrics on ADDR:PORT: /metrics, /healthz (alive), /readyz (every
    /// region proved and the listener up).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<SocketAddr>,
    /// Seconds a shutdown (SIGTERM, SIGINT) lets open transfers finish [default: 10].
    #[arg(long, value_name = "SECONDS")]
    drain_timeout: Option<u64>,
    /// Print the start-up report (each region's path, strategy, reasons and every attempt) as
    /// one JSON document on stdout.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    path: super::PathArgs,
    /// Publish every region served in a cluster-wide catalog on etcd, under a lease this
    /// node keeps alive: etcd://HOST:PORT[,HOST:PORT...]/PREFIX (etcds:// for TLS). Clients
    /// then fetch by name from any node (`p2p-rdma fetch etcd://.../PREFIX REGION`). Serving
    /// never waits for etcd: while it is unreachable the node serves on and publishes again
    /// when it answers. SIGTERM revokes the lease.
    #[arg(long, value_name = "URL")]
    catalog: Option<String>,
    /// Seconds the catalog keeps this node's entries after it dies without revoking them
    /// (the etcd lease TTL, 2-3600) [default: 10].
    #[arg(long, value_name = "SECONDS")]
    catalog_ttl: Option<u64>,
    /// This node's name in the catalog, unique in it [default: HOSTNAME:PORT].
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// The control address clients should use, as published in the catalog (repeatable)
    /// [default: the listen address; listening on 0.0.0.0, each RDMA device's IPv4 address
    /// with the listen port].
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Vec<String>,
    #[command(flatten)]
    etcd: super::catalog::EtcdArgs,
}

/// The `after_help` of `serve`: the region grammar from the parser's own table, then the rest.
pub(crate) fn help() -> String {
    format!(
        r#"{}
Paths: for each region the server tries dma-buf, pinned and ODP registration (or the one --reg
names) and proves the first that registers with a canary transfer (RDMA WRITE + READ compared
byte for byte). A region that no strategy serves goes through bounce buffers: the server copies
with the memory's copy engine into registered host staging buffers and RDMA-writes them to the
client (or reads the client's for a put). --p2p required refuses such a region (and says why);
--p2p disabled forces bounce. The path and its reason are printed at start and shown by `ls`.

Operating: --metrics serves /metrics, /healthz and /readyz; readiness (and systemd's READY=1,
when started with Type=notify) comes once every region is proved. SIGTERM/SIGINT stop accepting
and refuse new opens, let open transfers finish (--drain-timeout), exit 0. SIGHUP re-reads
--token-file; connected clients are not disturbed. A unit file: contrib/p2p-rdma.service.

Token file: one secret per line; alone it grants every region, followed by region names it
grants only those (NAME or NAME:ro for reading, NAME:rw for writing too); other regions are
not listed to its holder. Clients give only their own secret.
  8f0c...admin
  3b1e...reader   img:ro logs
  c9d2...ingest   scratch:rw

Config file (--config, TOML; keys as the flags):
  listen = "0.0.0.0:7471"          token_file = "/etc/p2p-rdma/token"
  metrics = "127.0.0.1:9471"       device = "mlx5_0"    p2p = "preferred"    reg = "auto"
  drain_timeout_secs = 30            (several devices: device = "mlx5_0,mlx5_2" or "all")
  sharing = "auto"
  [limits]  max_connections = 64  max_outstanding = 16  max_open_per_connection = 64
            max_unauthenticated = 256  hello_timeout_secs = 10  idle_timeout_secs = 600
            send_timeout_secs = 30  ring_hold_secs = 30 (a lent CMB ring slot, while
            others want the ring)
  [bounce]  chunk = "1M"  depth = 8  budget = "1G" (pinned staging, all connections)
  [[region]]  name = "cmb"  memory = "cmb:nvme0:16M"  p2p = "required"   (also reg, window,
              policy, nic, via)

Examples:
  head -c 32 /dev/urandom | base64 > token
  p2p-rdma serve --listen 0.0.0.0:7471 --token-file token --region ram=host:1G --region img=file:/data/img.bin:ro
  p2p-rdma serve --config /etc/p2p-rdma/serve.toml --metrics 127.0.0.1:9471
  p2p-rdma serve --device all --token-file token --region cmb0=cmb:nvme0:16M --region cmb1=cmb:nvme1:16M
  p2p-rdma serve --token-file token --region data=nvme:/dev/nvme1n1:0:16G,via=cmb:nvme0:64M
  p2p-rdma serve --check-config /etc/p2p-rdma/serve.toml"#,
        bridge::RegionSpec::help(100)
    )
}

/// Run `serve`.
pub(crate) async fn run(a: ServeArgs) -> anyhow::Result<()> {
    if let Some(file) = &a.check_config {
        let c = config::load(file)?;
        println!(
            "{}: valid ({} region{}{})",
            file.display(),
            c.regions.len(),
            if c.regions.len() == 1 { "" } else { "s" },
            if c.regions.is_empty() {
                "; give them with --region"
            } else {
                ""
            }
        );
        return Ok(());
    }
    let file = match &a.config {
        Some(f) => config::load(f)?,
        None => config::ServeConfig::default(),
    };
    let regions = if a.regions.is_empty() {
        file.regions
    } else {
        a.regions
    };
    if regions.is_empty() {
        return Err(Usage(
            "no region to serve: give --region NAME=KIND:ARGS (see --help) or [[region]] in --config".into(),
        )
        .into());
    }
    let publishing = Publishing {
        node: a.node.clone(),
        advertise: a.advertise.clone(),
        ttl: a.catalog_ttl,
        etcd: a.etcd.clone(),
    };
    let catalog_url = a
        .catalog
        .as_deref()
        .or(file.catalog.url.as_deref())
        .map(super::catalog::url)
        .transpose()?;
    let listen = a
        .listen
        .or(file.listen)
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 7471)));
    let token_file = a.token_file.or(file.token_file);
    let grants = read_grants(token_file.as_deref())?;
    let mut cfg = bridge::ServerConfig::new(listen, bridge::Token::default(), regions);
    cfg.grants = grants;
    let devices = serve_devices(if a.device.is_empty() {
        file.device
            .map(|d| d.split(',').map(|s| s.trim().to_string()).collect())
            .unwrap_or_default()
    } else {
        a.device.clone()
    })?;
    cfg.device = devices.first().cloned();
    cfg.more_devices = devices.iter().skip(1).cloned().collect();
    cfg.qp_path = a.path.qp_path();
    cfg.p2p = a.p2p.or(file.p2p).unwrap_or(cfg.p2p);
    cfg.reg = a.reg.or(file.reg).unwrap_or(cfg.reg);
    cfg.sharing = a.sharing.or(file.sharing).unwrap_or(cfg.sharing);
    cfg.max_connections = a
        .max_connections
        .or(file.max_connections)
        .unwrap_or(cfg.max_connections);
    cfg.max_outstanding = a
        .max_outstanding
        .or(file.max_outstanding)
        .unwrap_or(cfg.max_outstanding)
        .max(1);
    if let Some(n) = file.max_unauthenticated {
        cfg.max_unauthenticated = n.max(1);
    }
    if let Some(n) = file.max_open_per_connection {
        cfg.max_open_per_connection = n;
    }
    if let Some(s) = file.hello_timeout_secs {
        cfg.hello_timeout = Duration::from_secs(s.max(1));
    }
    if let Some(s) = file.idle_timeout_secs {
        cfg.idle_timeout = Duration::from_secs(s.max(1));
    }
    if let Some(s) = file.send_timeout_secs {
        cfg.send_timeout = Duration::from_secs(s.max(1));
    }
    if let Some(s) = file.ring_hold_secs {
        cfg.ring_hold = Duration::from_secs(s.max(1));
    }
    if let Some(n) = file.staging_budget {
        cfg.max_staging_bytes = n;
    }
    if let Some(s) = a.drain_timeout.or(file.drain_timeout_secs) {
        cfg.drain_timeout = Duration::from_secs(s);
    }
    let chunk = a
        .bounce_chunk
        .or(file.bounce_chunk)
        .unwrap_or(cfg.bounce_chunk as u64);
    cfg.bounce_chunk = usize::try_from(chunk)
        .ok()
        .filter(|&c| (1..=1 << 30).contains(&c))
        .ok_or_else(|| Usage("--bounce-chunk must be 1 byte to 1 GiB".into()))?;
    let depth = a
        .bounce_depth
        .or(file.bounce_depth)
        .unwrap_or(cfg.bounce_depth);
    if depth == 0 {
        return Err(Usage("--bounce-depth must be at least 1".into()).into());
    }
    cfg.bounce_depth = depth;

    // the metrics endpoint is up before the canaries run, so /readyz says "not yet"
    let metrics = Arc::clone(&cfg.metrics);
    let metrics_addr = a.metrics.or(file.metrics);
    let metrics_task = match metrics_addr {
        Some(addr) => {
            let s = bridge::http::MetricsServer::bind(addr, Arc::clone(&metrics)).await?;
            let bound = s.local_addr()?;
            eprintln!("p2p-rdma: metrics on http://{bound}/metrics (/healthz, /readyz)");
            Some(tokio::spawn(s.run()))
        }
        None => None,
    };

    let server = bridge::Server::bind(cfg).await?;
    let addr = server.local_addr()?;
    if a.json {
        let doc = serde_json::json!({
            "listen": addr.to_string(),
            "device": server.device(),
            "devices": server
                .devices()
                .into_iter()
                .map(|(name, addr)| serde_json::json!({"name": name, "addr": addr}))
                .collect::<Vec<_>>(),
            "memory_windows": server.memory_windows(),
            "registration": server.registration(),
            "metrics": metrics_addr.map(|m| m.to_string()),
            "catalog": catalog_url.as_ref().map(|u| u.to_string()),
            "regions": server.reports(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        eprintln!("p2p-rdma: registration: {}", server.registration());
        let devices: Vec<String> = server
            .devices()
            .into_iter()
            .map(|(n, ip)| match ip {
                Some(ip) => format!("{n} ({ip})"),
                None => n,
            })
            .collect();
        eprintln!(
            "p2p-rdma: serving on {addr} with RDMA device{} {}:",
            if devices.len() > 1 { "s" } else { "" },
            devices.join(", ")
        );
        for r in server.reports() {
            let i = &r.info;
            eprintln!(
                "  {:<16} {:>12}  {}  {:<9} {}{}",
                i.name,
                human(i.size),
                i.access,
                i.kind,
                i.path,
                i.strategy
                    .as_deref()
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default()
                    + &i.nic
                        .as_deref()
                        .map(|n| format!(" on {n}"))
                        .unwrap_or_default()
            );
            eprintln!("      why: {}", i.reason);
        }
    }
    let handle = server.handle();
    // a no-op outside systemd (no NOTIFY_SOCKET)
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!("serving on {addr}")),
    ]);
    let publisher = match &catalog_url {
        Some(url) => Some(publish(&publishing, &file.catalog, url, &server, addr).await?),
        None => None,
    };
    let reload = tokio::spawn(reload_on_sighup(handle, token_file));
    let res = server
        .run(async move {
            shutdown_signal().await;
            // leave the catalog first: new clients go elsewhere while open transfers finish
            if let Some(p) = publisher {
                let st = p.stop().await;
                eprintln!(
                    "p2p-rdma: catalog: {}",
                    if st.lease == 0 && st.error.is_none() {
                        "left (lease revoked)".to_string()
                    } else {
                        format!(
                            "could not revoke the lease ({}); the entries go when it expires",
                            st.error.unwrap_or_default()
                        )
                    }
                );
            }
        })
        .await;
    reload.abort();
    if let Some(t) = metrics_task {
        t.abort();
    }
    res?;
    eprintln!("p2p-rdma: stopped");
    Ok(())
}

/// `serve`'s catalog flags.
struct Publishing {
    node: Option<String>,
    advertise: Vec<String>,
    ttl: Option<u64>,
    etcd: super::catalog::EtcdArgs,
}

/// Start publishing the server's regions in the catalog; waits a few seconds for the first
/// publication and says how it went (serving goes on either way).
async fn publish(
    a: &Publishing,
    file: &super::catalog::CatalogFile,
    url: &catalog::CatalogUrl,
    server: &bridge::Server,
    addr: SocketAddr,
) -> anyhow::Result<catalog::Publisher> {
    use catalog::server::{default_node_name, endpoints_for, source, NodeIdentity};
    let node = a
        .node
        .clone()
        .or(file.node.clone())
        .unwrap_or_else(|| default_node_name(addr.port()));
    let advertise = if a.advertise.is_empty() {
        file.advertise.clone()
    } else {
        a.advertise.clone()
    };
    let endpoints = if advertise.is_empty() {
        let ips: Vec<_> = server
            .devices()
            .into_iter()
            .filter_map(|(_, ip)| ip)
            .collect();
        endpoints_for(addr, &ips).map_err(Usage)?
    } else {
        // the readers' own rule: an endpoint they would refuse is not published
        catalog::entry::check_endpoints(&advertise)
            .map_err(|e| Usage(format!("--advertise: {e}")))?;
        advertise
    };
    let mut cfg = catalog::PublisherConfig::new(url.clone(), node.clone());
    cfg.options = a.etcd.options(file)?;
    if let Some(t) = a.ttl.or(file.ttl_secs) {
        cfg.ttl = Duration::from_secs(t);
    }
    let ttl = cfg.ttl.as_secs();
    let id = NodeIdentity {
        node: node.clone(),
        endpoints: endpoints.clone(),
        nics: server.devices().into_iter().map(|(n, _)| n).collect(),
    };
    let p = catalog::Publisher::start(cfg, source(server.handle(), id))
        .map_err(|e| Usage(e.to_string()))?;
    let st = p.published(Duration::from_secs(5)).await;
    if st.published {
        eprintln!(
            "p2p-rdma: catalog {url}: published {} region{} as node {node} at {} in {:.2} s (lease TTL {ttl} s)",
            st.keys.saturating_sub(1),
            if st.keys == 2 { "" } else { "s" },
            endpoints.join(", "),
            st.first_publish_seconds.unwrap_or_default()
        );
    } else {
        eprintln!(
            "p2p-rdma: catalog {url}: not published yet ({}); serving anyway, and publishing as node {node} when etcd answers",
            st.error.as_deref().unwrap_or("no answer within 5 s")
        );
    }
    Ok(p)
}

/// The devices `--device` names (`all`: every one with an active port), without repeats.
fn serve_devices(named: Vec<String>) -> anyhow::Result<Vec<String>> {
    let named: Vec<String> = named.into_iter().filter(|d| !d.is_empty()).collect();
    if named.iter().any(|d| d == "all") {
        if named.len() > 1 {
            return Err(Usage("--device all names every device: give it alone".into()).into());
        }
        let active: Vec<String> = verbs::devices()?
            .into_iter()
            .filter(|d| d.ports.iter().any(|p| p.active))
            .map(|d| d.name)
            .collect();
        if active.is_empty() {
            return Err(verbs::no_device_error().into());
        }
        return Ok(active);
    }
    let mut out: Vec<String> = Vec::new();
    for d in named {
        if out.contains(&d) {
            return Err(Usage(format!("--device {d} is given twice")).into());
        }
        out.push(d);
    }
    Ok(out)
}

/// SIGHUP: read the token file again and hand the new token to the server.
async fn reload_on_sighup(handle: bridge::ServerHandle, token_file: Option<PathBuf>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Reloading]);
        match &token_file {
            None => eprintln!(
                "p2p-rdma: SIGHUP: the token came from P2P_RDMA_TOKEN, not a file: nothing to reload"
            ),
            Some(f) => match read_grants(Some(f)).map(|g| handle.set_grants(g)) {
                Ok(Ok(())) => eprintln!("p2p-rdma: SIGHUP: tokens reloaded from {}", f.display()),
                Ok(Err(e)) => eprintln!("p2p-rdma: SIGHUP: keeping the old token: {e}"),
                Err(e) => eprintln!("p2p-rdma: SIGHUP: keeping the old token: {e:#}"),
            },
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    eprintln!(
        "p2p-rdma: shutting down (no new connections or opens; letting open transfers finish)"
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_help_keeps_the_indentation_of_its_examples() {
        // (a string continued with `\` drops the next line's leading spaces)
        let h = super::help();
        for line in [
            "\n  8f0c...admin\n",
            "\n            max_unauthenticated = 256",
            "\n              policy, nic, via)\n",
            "\n  p2p-rdma serve --check-config /etc/p2p-rdma/serve.toml",
        ] {
            assert!(h.contains(line), "{line:?} is not in:\n{h}");
        }
    }
}
