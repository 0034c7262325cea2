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
        let bytes = encode(m);
        let write = self.stream.write_all(&bytes);
        let res = match self.send_timeout {
            Some(t) => tokio::time::timeout(t, write)
                .await
                .map_err(|_| Error::Timeout {
                    peer: self.peer.clone(),
                    what: "the peer to read a reply (it stopped reading)",
                    secs: t.as_secs(),
                })?,
            None => write.await,
        };
        res.map_err(|e| Error::io(format!("sending '{}' to {}", m.kind(), self.peer), e))
    }

    /// The next message; `want` names what the caller waits for (for error messages).
    pub(crate) async fn recv(
        &mut self,
        timeout: Option<Duration>,
        want: &'static str,
    ) -> Result<Msg> {
        let fut = self.recv_inner(want);
        match timeout {
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .map_err(|_| Error::Timeout {
                    peer: self.peer.clone(),
                    what: want,
                    secs: t.as_secs(),
                })?,
            None => fut.await,
        }
    }

    /// Send a message and the `data` it announces (the TCP data path).
    pub(crate) async fn send_with(&mut self, m: &Msg, data: &[u8]) -> Result<()> {
        self.send(m).await?;
        let write = self.stream.write_all(data);
        let res = match self.send_timeout {
            Some(t) => tokio::time::timeout(t, write)
                .await
                .map_err(|_| Error::Timeout {
                    peer: self.peer.clone(),
                    what: "the peer to read data (it stopped reading)",
                    secs: t.as_secs(),
                })?,
            None => write.await,
        };
        res.map_err(|e| Error::io(format!("sending {} bytes to {}", data.len(), self.peer), e))
    }

    /// The `n` raw bytes that follow the message just received.
    pub(crate) async fn recv_payload(
        &mut self,
        n: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>> {
        let fut = async {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                if let Some(p) = self.dec.next_payload(n) {
                    return Ok(p);
                }
                let k = self
                    .stream
                    .read(&mut buf)
                    .await
                    .map_err(|e| Error::io(format!("reading from {}", self.peer), e))?;
                if k == 0 {
                    return Err(Error::Closed {
                        peer: self.peer.clone(),
                        during: format!(" in the middle of {n} bytes of data"),
                    });
                }
                self.dec.feed(&buf[..k]);
            }
        };
        match timeout {
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .map_err(|_| Error::Timeout {
                    peer: self.peer.clone(),
                    what: "data",
                    secs: t.as_secs(),
                })?,
            None => fut.await,
        }
    }

    async fn recv_inner(&mut self, want: &'static str) -> Result<Msg> {
        let mut buf = [0u8; 16 * 1024];
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
            let n = self
                .stream
                .read(&mut buf)
                .await
                .map_err(|e| Error::io(format!("reading from {}", self.peer), e))?;
            if n == 0 {
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
            self.dec.feed(&buf[..n]);
        }
    }

    pub(crate) async fn shutdown(&mut self) {
        let _ = self.stream.shutdown().await;
    }
}
