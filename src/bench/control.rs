//! The benchmark's control connection: newline-delimited JSON messages, bounded.

use std::time::Duration;

use bridge::protocol::WireEndpoint;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt as _, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use verbs::RemoteSlice;

use super::*;

/// Memory keys of one side.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct Keys {
    pub(super) addr: u64,
    pub(super) rkey: u32,
    pub(super) len: u64,
}

impl From<RemoteSlice> for Keys {
    fn from(r: RemoteSlice) -> Keys {
        Keys {
            addr: r.addr,
            rkey: r.rkey,
            len: r.len,
        }
    }
}

impl Keys {
    pub(super) fn slice(&self, len: u64) -> RemoteSlice {
        RemoteSlice {
            addr: self.addr,
            rkey: self.rkey,
            len: len.min(self.len),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(super) enum Msg {
    Hello {
        /// The shared secret (the same token as `serve`'s).
        token: bridge::Token,
        params: BenchParams,
        endpoints: Vec<WireEndpoint>,
        keys: Keys,
    },
    Ready {
        endpoints: Vec<WireEndpoint>,
        keys: Keys,
        path: String,
        strategy: String,
        bridge: Option<(u16, String)>,
        /// A polled WRITE latency run goes as perftest's `ib_write_lat`: pings and pongs are
        /// plain WRITEs into `keys` and the client's memory, and each side busy-reads the last
        /// byte of the message in its own memory ([`super::pong::answer_in_memory`]).
        #[serde(default)]
        polled_memory: bool,
    },
    Run {
        size: u64,
    },
    Go,
    Done {
        size: u64,
    },
    Stats {
        iterations: u64,
        validated: Option<bool>,
    },
    Bye,
    Error {
        message: String,
    },
}

/// Longest control line (a hello with 64 QPs' endpoints is a few KiB).
pub(super) const MAX_LINE: usize = 64 << 10;

/// How long a client may take to say hello.
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) struct Control {
    pub(super) rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    pub(super) wr: tokio::net::tcp::OwnedWriteHalf,
}

impl Control {
    pub(super) fn new(s: TcpStream) -> Control {
        let _ = s.set_nodelay(true);
        let (r, w) = s.into_split();
        Control {
            rd: BufReader::new(r),
            wr: w,
        }
    }
    pub(super) async fn send(&mut self, m: &Msg) -> Result<()> {
        let mut line = serde_json::to_vec(m).map_err(|e| BenchError::Control(e.to_string()))?;
        line.push(b'\n');
        self.wr
            .write_all(&line)
            .await
            .map_err(|e| BenchError::Control(format!("send: {e}")))
    }
    pub(super) async fn recv(&mut self) -> Result<Msg> {
        let mut line = String::new();
        // a line is at most MAX_LINE bytes: a peer cannot make us buffer more
        let n = (&mut self.rd)
            .take(MAX_LINE as u64)
            .read_line(&mut line)
            .await
            .map_err(|e| BenchError::Control(format!("receive: {e}")))?;
        if n == 0 {
            return Err(BenchError::Control("the peer closed the connection".into()));
        }
        if !line.ends_with('\n') && n >= MAX_LINE {
            return Err(BenchError::Control(format!(
                "a control line longer than {MAX_LINE} bytes: not a p2p-rdma bench peer"
            )));
        }
        match serde_json::from_str(&line) {
            Ok(Msg::Error { message }) => Err(BenchError::Peer(message)),
            Ok(m) => Ok(m),
            Err(e) => Err(BenchError::Control(format!(
                "bad message ({e}): {}",
                line.trim()
            ))),
        }
    }
}
