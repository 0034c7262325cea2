//! `etcd://HOST:PORT[,HOST:PORT...]/PREFIX` (or `etcds://` for TLS): where the catalog lives.

use std::fmt;
use std::str::FromStr;

/// The prefix used when the URL names none.
pub const DEFAULT_PREFIX: &str = "p2p-rdma";

/// etcd's client port, used when an endpoint names none.
pub const DEFAULT_PORT: u16 = 2379;

/// A parsed catalog URL: the etcd members to ask and the key prefix of this catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogUrl {
    /// `HOST:PORT` of each member, in the order given.
    pub endpoints: Vec<String>,
    /// Key prefix (no leading or trailing `/`): several catalogs can share one etcd.
    pub prefix: String,
    /// `etcds://`: talk TLS to the members.
    pub tls: bool,
}

impl CatalogUrl {
    /// Whether a command-line address names a catalog rather than a server.
    pub fn is_catalog(s: &str) -> bool {
        s.starts_with("etcd://") || s.starts_with("etcds://")
    }

    /// The endpoints as the etcd client wants them (`http://` or `https://`).
    pub fn uris(&self) -> Vec<String> {
        let scheme = if self.tls { "https" } else { "http" };
        self.endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect()
    }

    /// `etcd at HOST:PORT, HOST:PORT`: how errors name it.
    pub fn members(&self) -> String {
        format!("etcd at {}", self.endpoints.join(", "))
    }
}

impl fmt::Display for CatalogUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}://{}/{}",
            if self.tls { "etcds" } else { "etcd" },
            self.endpoints.join(","),
            self.prefix
        )
    }
}

impl FromStr for CatalogUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (tls, rest) = if let Some(r) = s.strip_prefix("etcd://") {
            (false, r)
        } else if let Some(r) = s.strip_prefix("etcds://") {
            (true, r)
        } else {
            return Err(format!(
                "'{s}' is not a catalog URL: expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX \
                 (etcds:// for TLS)"
            ));
        };
        let (hosts, prefix) = match rest.split_once('/') {
            Some((h, p)) => (h, p),
            None => (rest, ""),
        };
        let prefix = prefix.trim_end_matches('/');
        let prefix = if prefix.is_empty() {
            DEFAULT_PREFIX
        } else {
            prefix
        };
        check_prefix(prefix)
            .map_err(|why| format!("catalog URL '{s}': prefix '{prefix}' {why}"))?;
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            let e = endpoint(h).map_err(|why| format!("catalog URL '{s}': {why}"))?;
            if !endpoints.contains(&e) {
                endpoints.push(e);
            }
        }
        Ok(CatalogUrl {
            endpoints,
            prefix: prefix.to_string(),
            tls,
        })
    }
}

/// `HOST[:PORT]` or `[V6][:PORT]`, port defaulting to etcd's.
fn endpoint(h: &str) -> Result<String, String> {
    if h.is_empty() {
        return Err("an empty etcd endpoint (give HOST:PORT, comma-separated)".into());
    }
    if h.contains('@') {
        return Err(format!(
            "'{h}': credentials do not belong in the URL (use the catalog user and password options)"
        ));
    }
    let (host, port) = if let Some(r) = h.strip_prefix('[') {
        let (v6, after) = r
            .split_once(']')
            .ok_or_else(|| format!("'{h}': an IPv6 address needs its closing ']'"))?;
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("'{h}': '{v6}' is not an IPv6 address"));
        }
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(format!("'{h}': expected :PORT after ']'")),
        };
        (format!("[{v6}]"), port)
    } else {
        match h.rsplit_once(':') {
            Some((host, p)) => (host.to_string(), Some(p)),
            None => (h.to_string(), None),
        }
    };
    if host.is_empty()
        || !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-.[]:".contains(c))
    {
        return Err(format!("'{h}': '{host}' is not a host name or address"));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("'{h}': port '{p}' is not a number from 1 to 65535"))?,
    };
    Ok(format!("{host}:{port}"))
}

/// Prefix characters: letters, digits, `-_.` and `/` between parts.
fn check_prefix(p: &str) -> Result<(), &'static str> {
    if p.len() > 128 {
        return Err("is longer than 128 bytes");
    }
    if p.starts_with('/') || p.contains("//") {
        return Err("has an empty part (no leading '/' and no '//')");
    }
    if !p
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
    {
        return Err("may hold only letters, digits, '-', '_', '.' and '/'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_members_prefix_and_tls() {
        let u: CatalogUrl = "etcd://10.0.0.1:2379,10.0.0.2:2380/prod/storage"
            .parse()
            .unwrap();
        assert_eq!(u.endpoints, ["10.0.0.1:2379", "10.0.0.2:2380"]);
        assert_eq!(u.prefix, "prod/storage");
        assert!(!u.tls);
        assert_eq!(u.uris()[1], "http://10.0.0.2:2380");
        assert_eq!(
            u.to_string(),
            "etcd://10.0.0.1:2379,10.0.0.2:2380/prod/storage"
        );
        let t: CatalogUrl = "etcds://etcd.example:2379".parse().unwrap();
        assert!(t.tls);
        assert_eq!(t.prefix, DEFAULT_PREFIX);
        assert_eq!(t.uris()[0], "https://etcd.example:2379");
    }

    #[test]
    fn port_defaults_and_ipv6() {
        let u: CatalogUrl = "etcd://node1,[fd00::1]:2479,[::1]/x/".parse().unwrap();
        assert_eq!(u.endpoints, ["node1:2379", "[fd00::1]:2479", "[::1]:2379"]);
        assert_eq!(u.prefix, "x");
        assert_eq!(
            u.members(),
            "etcd at node1:2379, [fd00::1]:2479, [::1]:2379"
        );
    }

    #[test]
    fn refuses_bad_urls_with_the_reason() {
        for (bad, why) in [
            ("10.0.0.1:2379", "not a catalog URL"),
            ("etcd:///p", "empty etcd endpoint"),
            ("etcd://a:0/p", "port '0'"),
            ("etcd://a:99999/p", "port '99999'"),
            ("etcd://user:pw@a:2379/p", "credentials"),
            ("etcd://a:2379/p q", "may hold only"),
            ("etcd://a:2379//p", "empty part"),
            ("etcd://[zz]:1/p", "not an IPv6"),
            ("etcd://a b:1/p", "not a host"),
        ] {
            let e = bad.parse::<CatalogUrl>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(CatalogUrl::is_catalog("etcds://x"));
        assert!(!CatalogUrl::is_catalog("10.0.0.1:7471"));
    }
}
