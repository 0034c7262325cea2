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
