//! The exit status of every command: one table, shown in `--help` and the README, and the
//! mapping from an error chain to its code.

use bridge::protocol::ErrorCode;

/// One row of the table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExitCode {
    pub(crate) code: u8,
    pub(crate) name: &'static str,
    pub(crate) meaning: &'static str,
}

pub(crate) const OK: u8 = 0;
pub(crate) const FAILED: u8 = 1;
pub(crate) const USAGE: u8 = 2;
pub(crate) const REFUSED: u8 = 3;
pub(crate) const AUTH: u8 = 4;
pub(crate) const UNREACHABLE: u8 = 5;
pub(crate) const MISMATCH: u8 = 6;
pub(crate) const NOT_FOUND: u8 = 7;
pub(crate) const UNAVAILABLE: u8 = 69;

/// Every exit status a command can end with.
pub(crate) const TABLE: &[ExitCode] = &[
    ExitCode {
        code: OK,
        name: "ok",
        meaning: "success",
    },
    ExitCode {
        code: FAILED,
        name: "failed",
        meaning: "the operation failed at run time (transfer or verbs error, I/O error, memory \
                  that cannot be opened, a region refused under --p2p required)",
    },
    ExitCode {
        code: USAGE,
        name: "usage",
        meaning: "bad usage or input: flags, region spec, size, offset/length outside the region, \
                  config file",
    },
    ExitCode {
        code: REFUSED,
        name: "refused",
        meaning: "the server refused the request: read-only region, busy, shutting down, removed",
    },
    ExitCode {
        code: AUTH,
        name: "auth",
        meaning: "authentication refused: wrong or missing token, protocol versions differ, or \
                  etcd refused the catalog user",
    },
    ExitCode {
        code: UNREACHABLE,
        name: "unreachable",
        meaning: "the peer cannot be reached: not running, wrong address, timeout (also: \
                  the catalog's etcd, or every node serving a region by name)",
    },
    ExitCode {
        code: MISMATCH,
        name: "mismatch",
        meaning: "--verify or --validate found different data",
    },
    ExitCode {
        code: NOT_FOUND,
        name: "not-found",
        meaning: "no such region on the server (or in the catalog)",
    },
    ExitCode {
        code: UNAVAILABLE,
        name: "unavailable",
        meaning: "no RDMA device, or libibverbs is missing",
    },
];

/// The table as text, for `--help`.
pub(crate) fn help() -> String {
    let mut s = String::from("Exit status:\n");
    for e in TABLE {
        let mut first = true;
        let mut line = String::new();
        let mut flush = |line: &mut String, first: &mut bool| {
            if *first {
                s.push_str(&format!("  {:>2}  {:<12} {line}\n", e.code, e.name));
            } else {
                s.push_str(&format!("{:19}{line}\n", ""));
            }
            *first = false;
            line.clear();
        };
        for w in e.meaning.split_whitespace() {
            if !line.is_empty() && line.len() + 1 + w.len() > 70 {
                flush(&mut line, &mut first);
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(w);
        }
        flush(&mut line, &mut first);
    }
    s.push_str("Logging: RUST_LOG=p2p_rdma=debug,bridge=debug,verbs=debug for details;\n");
    s.push_str("--log-format json for JSON lines.");
    s
}

/// Bad input found by the command line itself (a file too short for --length, a config
/// file that does not validate): exit status 2.
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Usage {}

/// No token was given.
#[derive(Debug)]
pub(crate) struct MissingToken;
impl std::fmt::Display for MissingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no token: give --token-file FILE or set P2P_RDMA_TOKEN (the token file must not be empty)")
    }
}
impl std::error::Error for MissingToken {}

/// bench --validate found different data.
#[derive(Debug)]
pub(crate) struct BenchMismatch;
impl std::fmt::Display for BenchMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("--validate: the data did not match (see the rows marked DATA MISMATCH)")
    }
}
impl std::error::Error for BenchMismatch {}

fn verbs_code(v: &verbs::Error) -> Option<u8> {
    matches!(
        v,
        verbs::Error::NoDevice { .. }
            | verbs::Error::LibraryMissing { .. }
            | verbs::Error::DeviceNotFound { .. }
    )
    .then_some(UNAVAILABLE)
}

fn server_code(code: ErrorCode) -> u8 {
    match code {
        ErrorCode::Unauthorized | ErrorCode::BadVersion => AUTH,
        ErrorCode::UnknownRegion => NOT_FOUND,
        ErrorCode::OutOfRange => USAGE,
        _ => REFUSED,
    }
}

/// The exit status for an error: the first cause in the chain that says.
pub(crate) fn code_of(e: &anyhow::Error) -> u8 {
    for c in e.chain() {
        if c.downcast_ref::<Usage>().is_some() {
            return USAGE;
        }
        if c.downcast_ref::<MissingToken>().is_some() {
            return AUTH;
        }
        if c.downcast_ref::<BenchMismatch>().is_some() {
            return MISMATCH;
        }
        if let Some(b) = c.downcast_ref::<p2p_rdma::bench::BenchError>() {
            match b {
                p2p_rdma::bench::BenchError::Verbs(v) => {
                    if let Some(code) = verbs_code(v) {
                        return code;
                    }
                }
                p2p_rdma::bench::BenchError::Unreachable(_) => return UNREACHABLE,
                _ => {}
            }
        }
        if let Some(code) = c.downcast_ref::<verbs::Error>().and_then(verbs_code) {
            return code;
        }
        if let Some(k) = c.downcast_ref::<catalog::Error>() {
            return match k {
                catalog::Error::Config(_) => USAGE,
                catalog::Error::Etcd { kind, .. } => match kind {
                    catalog::EtcdFailure::Unreachable => UNREACHABLE,
                    catalog::EtcdFailure::Auth => AUTH,
                    catalog::EtcdFailure::Refused => FAILED,
                },
                catalog::Error::Timeout { .. } | catalog::Error::NoReplica { .. } => UNREACHABLE,
                catalog::Error::NotFound { .. } => NOT_FOUND,
                catalog::Error::Bridge(b) => bridge_code(b),
            };
        }
        if let Some(b) = c.downcast_ref::<bridge::Error>() {
            return bridge_code(b);
        }
    }
    FAILED
}

fn bridge_code(b: &bridge::Error) -> u8 {
    {
        {
            match b {
                bridge::Error::Connect { .. } | bridge::Error::Timeout { .. } => UNREACHABLE,
                bridge::Error::Version { .. } => AUTH,
                bridge::Error::Server { code, .. } => server_code(*code),
                bridge::Error::Mismatch { .. } => MISMATCH,
                bridge::Error::Verbs(v) => verbs_code(v).unwrap_or(FAILED),
                _ => FAILED,
            }
        }
    }
}

/// The error and its causes, each cause only if the text so far does not already say it.
pub(crate) fn render_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for c in e.chain() {
        let t = c.to_string();
        if out.contains(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_documented() {
        let mut seen = std::collections::HashSet::new();
        for e in TABLE {
            assert!(seen.insert(e.code), "code {} twice", e.code);
        }
        let h = help();
        for e in TABLE {
            assert!(h.contains(e.name));
        }
    }

    #[test]
    fn chains_map_to_codes() {
        let server = |code| {
            anyhow::Error::from(bridge::Error::Server {
                code,
                message: "m".into(),
            })
        };
        assert_eq!(code_of(&server(ErrorCode::UnknownRegion)), NOT_FOUND);
        assert_eq!(code_of(&server(ErrorCode::OutOfRange)), USAGE);
        assert_eq!(code_of(&server(ErrorCode::ReadOnly)), REFUSED);
        assert_eq!(code_of(&server(ErrorCode::Unauthorized)), AUTH);
        assert_eq!(code_of(&anyhow::Error::from(MissingToken)), AUTH);
        assert_eq!(
            code_of(&anyhow::Error::from(Usage("x".into())).context("while y")),
            USAGE
        );
        assert_eq!(code_of(&anyhow::anyhow!("plain")), FAILED);
    }
}
