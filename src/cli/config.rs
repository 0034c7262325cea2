//! `serve --config FILE`: everything `serve` takes, in TOML. Flags given on the command line
//! override the file (`--region` flags replace the file's regions). Unknown keys are errors
//! that name the key and its line; so are region specs, sizes and addresses that do not parse.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::exit::Usage;

/// The file, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServeFile {
    /// Control address.
    pub(crate) listen: Option<Spanned<String>>,
    /// RDMA device.
    pub(crate) device: Option<String>,
    /// File holding the token (re-read on SIGHUP).
    pub(crate) token_file: Option<PathBuf>,
    /// required | preferred | disabled.
    pub(crate) p2p: Option<Spanned<String>>,
    /// auto | pinned | odp | dmabuf.
    pub(crate) reg: Option<Spanned<String>>,
    /// auto | per-connection.
    pub(crate) sharing: Option<Spanned<String>>,
    /// Metrics address (`/metrics`, `/healthz`, `/readyz`).
    pub(crate) metrics: Option<Spanned<String>>,
    /// Seconds a shutdown waits for open handles to finish.
    pub(crate) drain_timeout_secs: Option<u64>,
    #[serde(default)]
    pub(crate) limits: Limits,
    #[serde(default)]
    pub(crate) bounce: Bounce,
    #[serde(default, rename = "region")]
    pub(crate) regions: Vec<RegionEntry>,
    #[serde(default)]
    pub(crate) catalog: super::catalog::CatalogFile,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Limits {
    pub(crate) max_connections: Option<usize>,
    pub(crate) max_outstanding: Option<u32>,
    pub(crate) max_open_per_connection: Option<usize>,
    pub(crate) max_unauthenticated: Option<usize>,
    pub(crate) hello_timeout_secs: Option<u64>,
    pub(crate) idle_timeout_secs: Option<u64>,
    pub(crate) send_timeout_secs: Option<u64>,
    pub(crate) ring_hold_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Bounce {
    /// Bytes per staging buffer (K/M/G suffixes).
    pub(crate) chunk: Option<Spanned<String>>,
    /// Bytes of staging buffers all connections together may pin (K/M/G suffixes).
    pub(crate) budget: Option<Spanned<String>>,
    /// Staging buffers per connection.
    pub(crate) depth: Option<usize>,
}

/// `[[region]]`: a name, the memory in the spec grammar of `--region` (without `NAME=`), and
/// the per-region options as keys.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RegionEntry {
    pub(crate) name: Spanned<String>,
    pub(crate) memory: Spanned<String>,
    pub(crate) p2p: Option<String>,
    pub(crate) reg: Option<String>,
    pub(crate) window: Option<String>,
    pub(crate) policy: Option<String>,
    pub(crate) nic: Option<String>,
    pub(crate) via: Option<String>,
}

/// The file, checked: every value parsed.
#[derive(Debug, Default)]
pub(crate) struct ServeConfig {
    pub(crate) listen: Option<SocketAddr>,
    pub(crate) device: Option<String>,
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) p2p: Option<peermem::plan::P2pPolicy>,
    pub(crate) reg: Option<peermem::plan::RegChoice>,
    pub(crate) sharing: Option<bridge::server::SharingPolicy>,
    pub(crate) metrics: Option<SocketAddr>,
    pub(crate) drain_timeout_secs: Option<u64>,
    pub(crate) max_connections: Option<usize>,
    pub(crate) max_outstanding: Option<u32>,
    pub(crate) max_open_per_connection: Option<usize>,
    pub(crate) max_unauthenticated: Option<usize>,
    pub(crate) hello_timeout_secs: Option<u64>,
    pub(crate) idle_timeout_secs: Option<u64>,
    pub(crate) send_timeout_secs: Option<u64>,
    pub(crate) ring_hold_secs: Option<u64>,
    pub(crate) bounce_chunk: Option<u64>,
    pub(crate) staging_budget: Option<u64>,
    pub(crate) bounce_depth: Option<usize>,
    pub(crate) regions: Vec<bridge::RegionSpec>,
    /// `[catalog]`: where and how to publish the regions.
    pub(crate) catalog: super::catalog::CatalogFile,
}

/// 1-based line of a byte offset.
fn line_of(text: &str, at: usize) -> usize {
    text[..at.min(text.len())].matches('\n').count() + 1
}

fn bad(file: &Path, text: &str, at: usize, key: &str, why: impl std::fmt::Display) -> Usage {
    Usage(format!(
        "{}: line {}: key '{key}': {why}",
        file.display(),
        line_of(text, at)
    ))
}

/// Parse and check a config file's text.
pub(crate) fn parse(file: &Path, text: &str) -> Result<ServeConfig, Usage> {
    let raw: ServeFile = toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|s| format!("line {}: ", line_of(text, s.start)));
        Usage(format!(
            "{}: {}{}",
            file.display(),
            line.unwrap_or_default(),
            e.message()
        ))
    })?;
    let addr = |v: &Option<Spanned<String>>, key: &str| -> Result<Option<SocketAddr>, Usage> {
        v.as_ref()
            .map(|s| {
                s.get_ref().parse::<SocketAddr>().map_err(|e| {
                    bad(
                        file,
                        text,
                        s.span().start,
                        key,
                        format!("'{}': {e} (want ADDR:PORT)", s.get_ref()),
                    )
                })
            })
            .transpose()
    };
    let mut c = ServeConfig {
        listen: addr(&raw.listen, "listen")?,
        metrics: addr(&raw.metrics, "metrics")?,
        device: raw.device,
        token_file: raw.token_file,
        drain_timeout_secs: raw.drain_timeout_secs,
        max_connections: raw.limits.max_connections,
        max_outstanding: raw.limits.max_outstanding,
        max_open_per_connection: raw.limits.max_open_per_connection,
        max_unauthenticated: raw.limits.max_unauthenticated,
        hello_timeout_secs: raw.limits.hello_timeout_secs,
        idle_timeout_secs: raw.limits.idle_timeout_secs,
        send_timeout_secs: raw.limits.send_timeout_secs,
        ring_hold_secs: raw.limits.ring_hold_secs,
        bounce_depth: raw.bounce.depth,
        catalog: raw.catalog.clone(),
        ..ServeConfig::default()
    };
    if let Some(u) = &raw.catalog.url {
        u.parse::<catalog::CatalogUrl>()
            .map_err(|e| Usage(format!("{}: key 'catalog.url': {e}", file.display())))?;
    }
    if let Some(t) = raw.catalog.ttl_secs {
        if !catalog::publish::TTL_RANGE.contains(&t) {
            return Err(Usage(format!(
                "{}: key 'catalog.ttl_secs': {t}: give 2 to 3600 seconds",
                file.display()
            )));
        }
    }
    if let Some(n) = &raw.catalog.node {
        catalog::keys::valid_node(n)
            .map_err(|e| Usage(format!("{}: key 'catalog.node': {e}", file.display())))?;
    }
    if let Some(p) = &raw.p2p {
        c.p2p = Some(
            p.get_ref()
                .parse()
                .map_err(|e| bad(file, text, p.span().start, "p2p", e))?,
        );
    }
    if let Some(r) = &raw.reg {
        c.reg = Some(
            r.get_ref()
                .parse()
                .map_err(|e| bad(file, text, r.span().start, "reg", e))?,
        );
    }
    if let Some(r) = &raw.sharing {
        c.sharing = Some(
            r.get_ref()
                .parse()
                .map_err(|e| bad(file, text, r.span().start, "sharing", e))?,
        );
    }
    if let Some(ch) = &raw.bounce.chunk {
        let n = bridge::size::parse_size(ch.get_ref())
            .map_err(|e| bad(file, text, ch.span().start, "bounce.chunk", e))?;
        if !(1..=1 << 30).contains(&n) {
            return Err(bad(
                file,
                text,
                ch.span().start,
                "bounce.chunk",
                "must be 1 byte to 1 GiB",
            ));
        }
        c.bounce_chunk = Some(n);
    }
    if let Some(b) = &raw.bounce.budget {
        let n = bridge::size::parse_size(b.get_ref())
            .map_err(|e| bad(file, text, b.span().start, "bounce.budget", e))?;
        c.staging_budget = Some(n);
    }
    if c.bounce_depth == Some(0) {
        return Err(Usage(format!(
            "{}: key 'bounce.depth' must be at least 1",
            file.display()
        )));
    }
    for r in &raw.regions {
        let mut spec = format!("{}={}", r.name.get_ref(), r.memory.get_ref());
        for (k, v) in [
            ("p2p", &r.p2p),
            ("reg", &r.reg),
            ("window", &r.window),
            ("policy", &r.policy),
            ("nic", &r.nic),
            ("via", &r.via),
        ] {
            if let Some(v) = v {
                spec.push_str(&format!(",{k}={v}"));
            }
        }
        let parsed: bridge::RegionSpec = spec
            .parse()
            .map_err(|e: String| bad(file, text, r.memory.span().start, "region.memory", e))?;
        if c.regions.iter().any(|x| x.name == parsed.name) {
            return Err(bad(
                file,
                text,
                r.name.span().start,
                "region.name",
                format!("region '{}' is given twice", parsed.name),
            ));
        }
        c.regions.push(parsed);
    }
    Ok(c)
}

/// Read and check a config file.
pub(crate) fn load(file: &Path) -> Result<ServeConfig, Usage> {
    let text = std::fs::read_to_string(file).map_err(|e| {
        Usage(format!(
            "cannot read the config file {}: {e}",
            file.display()
        ))
    })?;
    parse(file, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
listen = "0.0.0.0:7471"
token_file = "/etc/p2p-rdma/token"
metrics = "127.0.0.1:9471"
p2p = "preferred"
sharing = "per-connection"
drain_timeout_secs = 30

[limits]
max_connections = 128
ring_hold_secs = 5

[bounce]
chunk = "2M"
depth = 4

[[region]]
name = "ram"
memory = "host:64M"

[[region]]
name = "cmb"
memory = "cmb:nvme0:16M"
p2p = "required"

[[region]]
name = "data"
memory = "nvme:/dev/nvme1n1:0:16G"
via = "cmb:nvme0:64M"

[catalog]
url = "etcd://10.0.0.9:2379,10.0.0.10:2379/prod"
ttl_secs = 10
node = "storage-7"
advertise = ["10.0.0.7:7471"]
"#;

    #[test]
    fn a_full_file_parses() {
        let c = parse(Path::new("serve.toml"), GOOD).unwrap();
        assert_eq!(c.listen, Some("0.0.0.0:7471".parse().unwrap()));
        assert_eq!(c.metrics, Some("127.0.0.1:9471".parse().unwrap()));
        assert_eq!(c.bounce_chunk, Some(2 << 20));
        assert_eq!(c.bounce_depth, Some(4));
        assert_eq!(
            c.sharing,
            Some(bridge::server::SharingPolicy::PerConnection)
        );
        assert_eq!(c.max_connections, Some(128));
        assert_eq!(c.ring_hold_secs, Some(5));
        assert_eq!(c.drain_timeout_secs, Some(30));
        assert_eq!(c.regions.len(), 3);
        assert_eq!(c.catalog.node.as_deref(), Some("storage-7"));
        assert_eq!(c.catalog.advertise, ["10.0.0.7:7471"]);
        assert_eq!(
            c.regions[1].options.p2p,
            Some(peermem::plan::P2pPolicy::Required)
        );
        assert_eq!(
            c.regions[2].options.via,
            Some(peermem::block::ViaCmb {
                device: "nvme0".into(),
                size: 64 << 20
            })
        );
        // via= on memory that is not block storage is refused with the line
        let bad = GOOD.replace(
            "memory = \"host:64M\"",
            "memory = \"host:64M\"\nvia = \"cmb:nvme0:1M\"",
        );
        let e = parse(Path::new("serve.toml"), &bad).unwrap_err();
        assert!(e.0.contains("only nvme regions"), "{}", e.0);
    }

    #[test]
    fn errors_name_the_key_and_line() {
        for (text, want) in [
            ("lisen = \"x\"\n", "line 1"),
            ("\n\nlisten = \"nope\"\n", "line 3: key 'listen'"),
            ("[bounce]\nchunk = \"12Q\"\n", "line 2: key 'bounce.chunk'"),
            ("[limits]\nmax_conections = 3\n", "max_conections"),
            ("[[region]]\nname = \"r\"\nmemory = \"disk:1M\"\n", "line 3: key 'region.memory'"),
            ("[[region]]\nname = \"r\"\nmemory = \"host:1M\"\n[[region]]\nname = \"r\"\nmemory = \"host:1M\"\n", "given twice"),
            ("p2p = \"maybe\"\n", "line 1: key 'p2p'"),
            ("\nsharing = \"windows\"\n", "line 2: key 'sharing': 'windows': want auto"),
            ("[[region]]\nname = \"r\"\n", "memory"),
            ("[catalog]\nurl = \"http://x\"\n", "key 'catalog.url'"),
            ("[catalog]\nttl_secs = 1\n", "key 'catalog.ttl_secs'"),
            ("[catalog]\nnode = \"a/b\"\n", "key 'catalog.node'"),
            ("[catalog]\nurll = \"x\"\n", "urll"),
        ] {
            let e = parse(Path::new("f.toml"), text).unwrap_err().0;
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let e = parse(Path::new("f.toml"), "lisen = \"x\"\n").unwrap_err().0;
        assert!(e.contains("lisen"), "{e}");
    }
}
