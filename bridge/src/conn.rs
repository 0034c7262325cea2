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
}

impl Conn {
    pub(crate) fn new(stream: TcpStream, peer: String) -> Conn {
        let _ = stream.set_nodelay(true);
        Conn {
            stream,
            dec: Decoder::new(),
            peer,
        }
    }

    /// Accept frames up to `limit` bytes from now on.
    pub(crate) fn set_max_frame(&mut self, limit: usize) {
        self.dec.set_max_frame(limit);
    }

    pub(crate) async fn send(&mut self, m: &Msg) -> Result<()> {
        self.stream
            .write_all(&encode(m))
            .await
            .map_err(|e| Error::io(format!("sending '{}' to {}", m.kind(), self.peer), e))
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
