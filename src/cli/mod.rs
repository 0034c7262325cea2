//! The command line's modules (the binary's own; the library is `p2p_rdma`).

pub(crate) mod bench;
pub(crate) mod catalog;
pub(crate) mod config;
pub(crate) mod exit;
pub(crate) mod fetch;
pub(crate) mod inspect;
pub(crate) mod ls;
pub(crate) mod man;
pub(crate) mod partial;
pub(crate) mod pipe;
pub(crate) mod put;
pub(crate) mod resume;
pub(crate) mod scan;
pub(crate) mod serve;
pub(crate) mod stripe;
pub(crate) mod transfer;

/// GID, traffic class, service level, ACK timeout and path MTU of the QPs a command creates
/// (serve, fetch, put, bench). A RoCE fleet that reserves a lossless class must set the same on
/// every host.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PathArgs {
    /// GID index of our QPs (`p2p-rdma devices` lists the table). Default: the RoCE v2 GID
    /// carrying the address of the TCP control connection, else the first RoCE v2 GID with an
    /// IPv4 address.
    #[arg(long, short = 'x', value_name = "N")]
    pub(crate) gid_index: Option<u32>,
    /// Traffic class of our RoCE packets: the IP header's DSCP << 2 | ECN (DSCP 26 with ECN
    /// capable transport is 106) [default: 0].
    #[arg(long, value_name = "TC", default_value_t = 0)]
    pub(crate) traffic_class: u8,
    /// Service level, 0-15: RoCE packets carry none, a NIC maps it to a priority (soft-RoCE
    /// ignores it) [default: 0].
    #[arg(long, value_name = "SL", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=15))]
    pub(crate) sl: u8,
    /// ACK timeout of our QPs: a request unanswered for 4.096 us x 2^N is sent again, 7 times
    /// at most before the transfer fails with a transport retry error; 0 waits forever. The
    /// default, 18, is about 1.07 s. With 14 (67 ms, perftest's default), soft-RoCE resent READ
    /// responses that were only queued behind other clients' (32 concurrent clients: up to 3.3
    /// times the bytes, half the aggregate rate). A lower value gives up on a dead peer sooner
    /// and recovers a lost packet sooner on a lossy fabric.
    #[arg(long, value_name = "N", default_value_t = verbs::QpOptions::default().timeout,
          value_parser = clap::value_parser!(u8).range(0..=31))]
    pub(crate) ack_timeout: u8,
    /// Largest path MTU of our QPs: 256, 512, 1024, 2048 or 4096 bytes (the IB sizes; RoCE
    /// carries them in Ethernet frames of that much plus headers). A connection runs at the
    /// smaller of both ends'. Default: the port's active MTU (`p2p-rdma devices` shows it).
    #[arg(long, value_name = "BYTES", value_parser = parse_mtu)]
    pub(crate) mtu: Option<u32>,
}

fn parse_mtu(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(m) if verbs::IB_MTUS.contains(&m) => Ok(m),
        _ => Err(format!(
            "'{s}' is not a path MTU: 256, 512, 1024, 2048 or 4096 (an Ethernet MTU such as 1500 \
             or 9000 is the interface's, set with ip link)"
        )),
    }
}

impl PathArgs {
    pub(crate) fn qp_path(&self) -> bridge::QpPath {
        bridge::QpPath {
            gid_index: self.gid_index,
            traffic_class: self.traffic_class,
            service_level: self.sl,
            ack_timeout: self.ack_timeout,
            max_mtu: self.mtu,
        }
    }
}

/// Sizes with K/M/G suffixes, for clap.
pub(crate) fn parse_size_arg(s: &str) -> Result<u64, String> {
    bridge::size::parse_size(s)
}

/// Write to stdout; a closed pipe (`| head`) is not an error worth a panic.
pub(crate) fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// The server's tokens: `file` read as a token file (one `SECRET [REGION[:ro|:rw]]...` per
/// line, see `serve --help`), or the one secret of P2P_RDMA_TOKEN (every region).
pub(crate) fn read_grants(file: Option<&std::path::Path>) -> anyhow::Result<Vec<bridge::Grant>> {
    let text = read_token(file)?;
    match file {
        Some(p) => bridge::token::parse_grants(&text).map_err(|e| {
            anyhow::anyhow!(exit::Usage(format!("the token file {}: {e}", p.display())))
        }),
        None => Ok(vec![bridge::Grant::all(text)]),
    }
}

/// The token from `file` (surrounding whitespace ignored), or from P2P_RDMA_TOKEN.
pub(crate) fn read_token(file: Option<&std::path::Path>) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let t = match file {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("cannot read the token file {}", p.display()))?,
        None => std::env::var("P2P_RDMA_TOKEN").map_err(|_| anyhow::anyhow!(exit::MissingToken))?,
    };
    let t = t.trim().to_string();
    if t.is_empty() {
        anyhow::bail!(exit::MissingToken);
    }
    Ok(t)
}
