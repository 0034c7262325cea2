//! What a client is told: the server, the secret, the device, chunking, depth, timeouts, the
//! transport and the inline room of its QP.

use std::time::Duration;

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Server control address, `HOST:PORT`.
    pub addr: String,
    /// The shared secret.
    pub token: crate::Token,
    /// RDMA device (None: first active).
    pub device: Option<String>,
    /// Bytes per RDMA work request.
    pub chunk: usize,
    /// Work requests in flight (capped by the server's limit).
    pub depth: usize,
    /// Timeout for connecting and for each control reply.
    pub timeout: Duration,
    /// GID, traffic class and service level of our QP.
    pub qp_path: crate::QpPath,
    /// How the bytes travel: RDMA, TCP, or RDMA when this host has a device (default).
    pub transport: Transport,
    /// The server device for our QP, on a server that serves from several (None: the one
    /// that serves the first region opened).
    pub server_nic: Option<String>,
    /// Puts of at most this many bytes into a direct extent go inline: the bytes travel in
    /// the work request itself (`IBV_SEND_INLINE`), so the device does not fetch them from a
    /// registered buffer. 0: never. A device that refuses a QP with this much inline room
    /// gets one without, said in the log.
    pub inline: u32,
}

/// How a client's bytes travel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Transport {
    /// RDMA when an RDMA device opens here, else TCP over the control connection (said once,
    /// with the reason).
    #[default]
    Auto,
    /// RDMA only: a host without a device fails with the device error.
    Rdma,
    /// Over the TCP control connection: same regions, same checks, no RDMA device needed.
    Tcp,
}

impl ClientConfig {
    /// Defaults: 1 MiB chunks, 16 in flight, 30 s timeout, puts of up to 220 bytes inline
    /// (perftest's default for write latency).
    pub fn new(addr: impl Into<String>, token: impl Into<crate::Token>) -> ClientConfig {
        ClientConfig {
            addr: addr.into(),
            token: token.into(),
            device: None,
            chunk: 1 << 20,
            depth: 16,
            timeout: Duration::from_secs(30),
            qp_path: crate::QpPath::default(),
            transport: Transport::Auto,
            server_nic: None,
            inline: DEFAULT_INLINE,
        }
    }
}

/// Inline room asked for our QP by default: what most devices give (perftest asks the same for
/// its write-latency test).
pub const DEFAULT_INLINE: u32 = 220;
