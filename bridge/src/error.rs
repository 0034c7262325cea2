//! Errors of the bridge (server and client).

use std::io;

use crate::protocol::{DecodeError, ErrorCode};

/// All errors of the `bridge` crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Cannot reach the server.
    #[error("cannot connect to {addr}: {source} (is `p2p-rdma serve` running there, and the port reachable?)")]
    Connect {
        /// Address.
        addr: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The peer did not answer in time. `what` names what was awaited (a reply by its
    /// message name, or a phrase: "the peer to read a reply (it stopped reading)").
    #[error("{peer}: timed out after {secs} s waiting for {what}")]
    Timeout {
        /// Peer.
        peer: String,
        /// What was awaited.
        what: &'static str,
        /// Seconds.
        secs: u64,
    },
    /// The peer hung up.
    #[error("{peer} closed the connection{during}")]
    Closed {
        /// Peer.
        peer: String,
        /// Context.
        during: String,
    },
    /// Bytes that are not our protocol.
    #[error("protocol error with {peer}: {source}")]
    Protocol {
        /// Peer.
        peer: String,
        /// Cause.
        #[source]
        source: DecodeError,
    },
    /// The peer sent a valid message we did not expect.
    #[error("unexpected message from {peer}: got '{got}' while waiting for {want}")]
    Unexpected {
        /// Peer.
        peer: String,
        /// Received type.
        got: &'static str,
        /// Expected.
        want: &'static str,
    },
    /// The server refused a request.
    #[error("server refused: {message} [{code}]")]
    Server {
        /// Code.
        code: ErrorCode,
        /// Message.
        message: String,
    },
    /// Protocol versions differ.
    #[error("protocol version mismatch: {peer} speaks version {theirs}, this build speaks {ours}; use matching p2p-rdma versions")]
    Version {
        /// Peer.
        peer: String,
        /// Theirs.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// Checksums differ.
    #[error("verification failed: {what}: client CRC-32C {client:#010x}, server {server:#010x}")]
    Mismatch {
        /// What was checked.
        what: String,
        /// Client side.
        client: u32,
        /// Server side.
        server: u32,
    },
    /// A work request neither completed nor failed in time.
    #[error(
        "{op} at offset {offset} did not complete within {secs} s: the RDMA transport stalled (no \
         completion, no error) on QP {qpn}, which was moved to the error state. Check the link \
         between the hosts (MTU, drops), the PCIe path (ACS/IOMMU) and the peer's RDMA device"
    )]
    Stalled {
        /// The operation.
        op: &'static str,
        /// Offset in the region.
        offset: u64,
        /// The limit.
        secs: u64,
        /// Local QP number.
        qpn: u32,
    },
    /// The server refused our READ of a chunk it lent from its CMB ring: it took the slot
    /// back, as it does when a client holds one past its ring hold limit while other clients
    /// want the ring, or when the region is removed.
    #[error(
        "{source}; this READ was of a chunk the server lent from its CMB ring (slot {slot}), and \
         the server takes such a slot back when a client holds it past the server's ring hold \
         limit (ring_hold_secs, 30 s by default) while other clients want the ring, or when \
         the region is removed: read promptly (a fetch that stops reading holds its slots)"
    )]
    LentTakenBack {
        /// The server's staging slot.
        slot: u32,
        /// The READ's completion.
        #[source]
        source: verbs::Error,
    },
    /// The client's QP went to the error state in an earlier transfer (a work request failed
    /// or stalled): every work request on it would only be flushed.
    #[error(
        "this client's QP {qpn} is in the error state since an earlier transfer failed \
         ({cause}): RDMA on this connection is over. Reconnect (Client::reconnect, which \
         keeps the buffers registered) and open the regions again"
    )]
    QpDown {
        /// Local QP number.
        qpn: u32,
        /// The error of the transfer that left it there.
        cause: String,
    },
    /// RDMA failure.
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    /// Local I/O failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Bad configuration or argument.
    #[error("{0}")]
    Config(String),
}

impl Error {
    /// Wrap an I/O error with what was being done.
    pub fn io(what: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// The server's error code, if the server refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Server { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the same request may succeed on a new connection ([`crate::Client::reconnect`])
    /// a little later: the server could not be reached, went away or is busy, the link or the
    /// transport failed (a work request that stalled, was flushed, exhausted its retries or
    /// was refused by the peer's NIC, whose keys a restarted server no longer knows), or the
    /// QP went down. Not for what would fail again the same way: a refusal of the request
    /// itself (unknown region, out of range, read-only, the token), a version mismatch, a
    /// checksum mismatch, a local file's I/O error (out of space, say) or a bad configuration.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Connect { .. }
            | Error::Timeout { .. }
            | Error::Closed { .. }
            | Error::Stalled { .. }
            | Error::LentTakenBack { .. }
            | Error::QpDown { .. } => true,
            Error::Server { code, .. } => matches!(code, ErrorCode::Busy | ErrorCode::ShuttingDown),
            // the control connection broke (a local file's error is of another kind)
            Error::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::NotConnected
                    | io::ErrorKind::TimedOut
                    | io::ErrorKind::UnexpectedEof
            ),
            // the peer's or the link's doing; a local protection or length error is ours
            Error::Verbs(verbs::Error::WorkCompletion { status, .. }) => matches!(
                status.name(),
                "IBV_WC_WR_FLUSH_ERR"
                    | "IBV_WC_BAD_RESP_ERR"
                    | "IBV_WC_REM_INV_REQ_ERR"
                    | "IBV_WC_REM_ACCESS_ERR"
                    | "IBV_WC_REM_OP_ERR"
                    | "IBV_WC_RETRY_EXC_ERR"
                    | "IBV_WC_RNR_RETRY_EXC_ERR"
                    | "IBV_WC_REM_INV_RD_REQ_ERR"
                    | "IBV_WC_REM_ABORT_ERR"
            ),
            _ => false,
        }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_says_what_stalled_and_what_to_check() {
        let e = Error::Stalled {
            op: "RDMA READ",
            offset: 1 << 20,
            secs: 30,
            qpn: 17,
        };
        let s = e.to_string();
        assert!(
            s.contains("RDMA READ at offset 1048576 did not complete within 30 s"),
            "{s}"
        );
        assert!(s.contains("QP 17") && s.contains("ACS/IOMMU"), "{s}");
    }

    #[test]
    fn transient_errors_are_those_a_new_connection_may_get_past() {
        let wc = |status| {
            Error::Verbs(verbs::Error::WorkCompletion {
                qpn: 1,
                wr_id: 2,
                opcode: "RDMA READ",
                status: verbs::WcStatus(status),
                vendor_err: 0,
            })
        };
        let server = |code| Error::Server {
            code,
            message: String::new(),
        };
        let closed = Error::Closed {
            peer: "a:1".into(),
            during: String::new(),
        };
        let down = Error::QpDown {
            qpn: 3,
            cause: "x".into(),
        };
        for e in [
            closed,
            down,
            wc(12),
            wc(5),
            wc(10),
            server(ErrorCode::Busy),
            server(ErrorCode::ShuttingDown),
            Error::io("reading from a:1", io::ErrorKind::ConnectionReset.into()),
        ] {
            assert!(e.is_transient(), "{e}");
        }
        for e in [
            wc(4),
            wc(1),
            server(ErrorCode::UnknownRegion),
            server(ErrorCode::Unauthorized),
            server(ErrorCode::OutOfRange),
            Error::Mismatch {
                what: "fetch".into(),
                client: 1,
                server: 2,
            },
            Error::Config("y".into()),
            Error::io("writing the output", io::ErrorKind::StorageFull.into()),
        ] {
            assert!(!e.is_transient(), "{e}");
        }
    }

    #[test]
    fn server_codes_are_exposed() {
        let e = Error::Server {
            code: ErrorCode::ReadOnly,
            message: "x".into(),
        };
        assert_eq!(e.code(), Some(ErrorCode::ReadOnly));
        assert_eq!(Error::Config("y".into()).code(), None);
    }
}
