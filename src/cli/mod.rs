//! The command line's modules (the binary's own; the library is `p2p_rdma`).

pub(crate) mod config;
pub(crate) mod exit;
pub(crate) mod inspect;
pub(crate) mod man;
pub(crate) mod serve;
pub(crate) mod transfer;

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
