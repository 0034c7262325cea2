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
