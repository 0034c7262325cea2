//! A control connection: the pure codec wrapped around a TCP stream.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{Error, Result};
use crate::protocol::{encode, Decoder, Msg};

#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    dec: Decoder,
    pub(crate) peer: String,
    /// Our address on this connection (RDMA prefers the GID that carries it).
    pub(crate) local_ip: Option<std::net::IpAddr>,
    /// How long a send may wait for the peer to read (None: as long as it takes).
    send_timeout: Option<Duration>,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream, peer: String) -> Conn {
        let _ = stream.set_nodelay(true);
        let local_ip = stream.local_addr().ok().map(|a| a.ip());
        Conn {
            stream,
            local_ip,
            dec: Decoder::new(),
            peer,
            send_timeout: None,
        }
    }

    /// Give up a send after `t` (a peer that stopped reading), and let the kernel probe an idle
    /// peer (TCP keepalive), so a vanished host is noticed without a request.
    pub(crate) fn set_send_timeout(&mut self, t: Duration) {
        self.send_timeout = Some(t);
        let ka = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(60))
            .with_interval(Duration::from_secs(10))
            .with_retries(6);
        if let Err(e) = socket2::SockRef::from(&self.stream).set_tcp_keepalive(&ka) {
            tracing::debug!(error = %e, "TCP keepalive not set");
        }
    }

    /// Accept frames up to `limit` bytes from now on.
    pub(crate) fn set_max_frame(&mut self, limit: usize) {
        self.dec.set_max_frame(limit);
    }

    pub(crate) async fn send(&mut self, m: &Msg) -> Result<()> {
        self.write(
            &encode(m),
            "the peer to read a reply (it stopped reading)",
            || format!("sending '{}'", m.kind()),
        )
        .await
    }

    /// Send a message and the `data` it announces (the TCP data path).
    pub(crate) async fn send_with(&mut self, m: &Msg, data: &[u8]) -> Result<()> {
        self.send(m).await?;
        self.write(data, "the peer to read data (it stopped reading)", || {
            format!("sending {} bytes", data.len())
        })
        .await
    }

    /// Write `bytes` within the send timeout; `waiting` names what a timeout waited for,
    /// `doing` what failed.
    async fn write(
        &mut self,
        bytes: &[u8],
        waiting: &'static str,
        doing: impl FnOnce() -> String,
    ) -> Result<()> {
        let Conn {
            stream,
            peer,
            send_timeout,
            ..
        } = self;
        let peer: &str = peer;
        let write = async {
            stream
                .write_all(bytes)
                .await
                .map_err(|e| Error::io(format!("{} to {peer}", doing()), e))
        };
        within(*send_timeout, peer, waiting, write).await
    }

    /// The next message; `want` names what the caller waits for (for error messages).
    pub(crate) async fn recv(
        &mut self,
        timeout: Option<Duration>,
        want: &'static str,
    ) -> Result<Msg> {
        let peer = self.peer.clone();
        within(timeout, &peer, want, self.recv_inner(want)).await
    }

    /// The `n` raw bytes that follow the message just received.
    pub(crate) async fn recv_payload(
        &mut self,
        n: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>> {
        let peer = self.peer.clone();
        let fut = async {
            loop {
                if let Some(p) = self.dec.next_payload(n) {
                    return Ok(p);
                }
                if self.read_some().await? == 0 {
                    return Err(Error::Closed {
                        peer: self.peer.clone(),
                        during: format!(" in the middle of {n} bytes of data"),
                    });
                }
            }
        };
        within(timeout, &peer, "data", fut).await
    }

    async fn recv_inner(&mut self, want: &'static str) -> Result<Msg> {
        loop {
            match self.dec.next_msg() {
                Ok(Some(m)) => return Ok(m),
                Ok(None) => {}
                Err(source) => {
                    return Err(Error::Protocol {
                        peer: self.peer.clone(),
                        source,
                    })
                }
            }
            if self.read_some().await? == 0 {
                return Err(match self.dec.finish() {
                    Ok(()) => Error::Closed {
                        peer: self.peer.clone(),
                        during: format!(" while waiting for {want}"),
                    },
                    Err(source) => Error::Protocol {
                        peer: self.peer.clone(),
                        source,
                    },
                });
            }
        }
    }

    /// Read what the peer sent into the decoder; 0 at the end of the stream.
    async fn read_some(&mut self) -> Result<usize> {
        let mut buf = [0u8; 16 * 1024];
        let n = self
            .stream
            .read(&mut buf)
            .await
            .map_err(|e| Error::io(format!("reading from {}", self.peer), e))?;
        self.dec.feed(&buf[..n]);
        Ok(n)
    }

    pub(crate) async fn shutdown(&mut self) {
        let _ = self.stream.shutdown().await;
    }
}

/// `fut` within `limit` (None: as long as it takes); a timeout names `peer` and `what` was
/// awaited.
async fn within<T>(
    limit: Option<Duration>,
    peer: &str,
    what: &'static str,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match limit {
        Some(t) => tokio::time::timeout(t, fut)
            .await
            .map_err(|_| Error::Timeout {
                peer: peer.to_string(),
                what,
                secs: t.as_secs(),
            })?,
        None => fut.await,
    }
}
