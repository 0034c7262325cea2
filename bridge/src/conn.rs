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
    /// Encoded messages that wait for the next send ([`Conn::defer`]).
    deferred: Vec<u8>,
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
            deferred: Vec::new(),
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

    /// Send `m`, after the messages deferred so far, in one write (one segment where they fit).
    pub(crate) async fn send(&mut self, m: &Msg) -> Result<()> {
        self.defer(m);
        let kind = m.kind();
        self.write_deferred("the peer to read a reply (it stopped reading)", || {
            format!("sending '{kind}'")
        })
        .await
    }

    /// Queue `m` in front of the next message sent, or until [`Conn::send_deferred`]: messages
    /// that belong together go out in one write (one segment where they fit). The client
    /// defers `Unstage` (it only has to reach the server before the next `Stage`) and the
    /// `Stage`s of one batch; the server defers the `Staged` replies of a batch. Every
    /// exchange on the control connection costs both hosts a wake-up beside the NIC's work
    /// (ARCHITECTURE.md, bounce fetches). What is deferred when the connection ends is never
    /// sent.
    pub(crate) fn defer(&mut self, m: &Msg) {
        self.deferred.extend_from_slice(&encode(m));
    }

    /// Bytes deferred and not yet sent.
    pub(crate) fn deferred_len(&self) -> usize {
        self.deferred.len()
    }

    /// Send what was deferred, if anything, in one write.
    pub(crate) async fn send_deferred(&mut self) -> Result<()> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        self.write_deferred("the peer to read a message (it stopped reading)", || {
            "sending deferred messages".to_string()
        })
        .await
    }

    /// Write the deferred bytes in one write ([`Conn::write`]'s `waiting` and `doing`).
    async fn write_deferred(
        &mut self,
        waiting: &'static str,
        doing: impl FnOnce() -> String,
    ) -> Result<()> {
        let mut bytes = std::mem::take(&mut self.deferred);
        let sent = self.write(&bytes, waiting, doing).await;
        // the buffer's room is kept for the next deferral; after an error the connection is
        // not used again
        bytes.clear();
        self.deferred = bytes;
        sent
    }

    /// Whether a whole message from the peer is already here: in the decoder, or among what
    /// the socket has ready (read into the decoder, never waiting). A read error says no; the
    /// next [`Conn::recv`] reports it.
    pub(crate) fn next_is_here(&mut self) -> bool {
        self.dec.holds_frame()
            || (matches!(self.read_ready(), Ok(Some(n)) if n > 0) && self.dec.holds_frame())
    }

    /// What the socket has ready, read into the decoder without waiting: `Some(n)` bytes (0 at
    /// the end of the stream), `None` when nothing is ready.
    fn read_ready(&mut self) -> std::io::Result<Option<usize>> {
        let mut buf = [0u8; 16 * 1024];
        match self.stream.try_read(&mut buf) {
            Ok(n) => {
                self.dec.feed(&buf[..n]);
                Ok(Some(n))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
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

    /// The next message if it has already arrived, without waiting: what the decoder holds,
    /// then what the socket has ready. `None` when no whole message is here yet (and at the end
    /// of the stream, which the next [`Conn::recv`] reports). Never blocks and loses nothing:
    /// bytes read stay in the decoder.
    pub(crate) fn try_recv(&mut self) -> Result<Option<Msg>> {
        loop {
            if let Some(m) = self.decoded()? {
                return Ok(Some(m));
            }
            match self.read_ready() {
                Ok(Some(0) | None) => return Ok(None),
                Ok(Some(_)) => {}
                Err(e) => return Err(Error::io(format!("reading from {}", self.peer), e)),
            }
        }
    }

    /// Wait until more bytes from the peer are in the decoder (not necessarily a whole
    /// message: [`Conn::try_recv`] says). Cancel-safe: bytes read are kept. The end of the
    /// stream is an error, `want` naming what was awaited.
    pub(crate) async fn more_bytes(&mut self, want: &'static str) -> Result<()> {
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
        Ok(())
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

    /// The next whole message the decoder holds, if any.
    fn decoded(&mut self) -> Result<Option<Msg>> {
        self.dec.next_msg().map_err(|source| Error::Protocol {
            peer: self.peer.clone(),
            source,
        })
    }

    async fn recv_inner(&mut self, want: &'static str) -> Result<Msg> {
        loop {
            if let Some(m) = self.decoded()? {
                return Ok(m);
            }
            self.more_bytes(want).await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ErrorCode;
    use tokio::net::TcpListener;

    /// A connected pair: our `Conn` and the peer's raw stream.
    async fn pair() -> (Conn, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (ours, theirs) = tokio::join!(TcpStream::connect(addr), l.accept());
        (
            Conn::new(ours.unwrap(), addr.to_string()),
            theirs.unwrap().0,
        )
    }

    /// Read from `peer` until `len` bytes came (each read within 5 s; `what` names them).
    async fn read_len(peer: &mut TcpStream, len: usize, what: &str) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        while got.len() < len {
            let n = tokio::time::timeout(Duration::from_secs(5), peer.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("{what} never arrived"))
                .unwrap();
            assert_ne!(n, 0, "closed early");
            got.extend_from_slice(&buf[..n]);
        }
        got
    }

    /// Poll `try_recv` until it yields or `tries` run out (the bytes cross loopback TCP).
    async fn try_until(c: &mut Conn, tries: usize) -> Option<Msg> {
        for _ in 0..tries {
            if let Some(m) = c.try_recv().unwrap() {
                return Some(m);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }

    #[tokio::test]
    async fn try_recv_takes_only_whole_messages_and_loses_no_byte() {
        let (mut c, mut peer) = pair().await;
        assert!(c.try_recv().unwrap().is_none(), "nothing was sent");
        let a = encode(&Msg::Unstage { slot: 3 });
        let b = encode(&Msg::KeepAlive);
        // half of the first message: not a message yet, and its bytes are kept
        peer.write_all(&a[..a.len() / 2]).await.unwrap();
        peer.flush().await.unwrap();
        assert!(try_until(&mut c, 20).await.is_none());
        let mut rest = a[a.len() / 2..].to_vec();
        rest.extend_from_slice(&b);
        peer.write_all(&rest).await.unwrap();
        assert_eq!(try_until(&mut c, 400).await, Some(Msg::Unstage { slot: 3 }));
        // the second one came in the same read: the decoder holds it
        assert_eq!(c.try_recv().unwrap(), Some(Msg::KeepAlive));
        assert!(c.try_recv().unwrap().is_none());
        // a blocking receive after it sees what follows, in order
        peer.write_all(&encode(&Msg::Unstage { slot: 4 }))
            .await
            .unwrap();
        assert_eq!(
            c.recv(Some(Duration::from_secs(5)), "unstage")
                .await
                .unwrap(),
            Msg::Unstage { slot: 4 }
        );
        // the end of the stream is left to the blocking receive to report
        drop(peer);
        assert!(try_until(&mut c, 20).await.is_none());
        assert!(matches!(
            c.recv(Some(Duration::from_secs(5)), "anything").await,
            Err(Error::Closed { .. })
        ));
    }

    #[tokio::test]
    async fn a_deferred_message_waits_for_the_next_send_and_goes_first_in_the_same_write() {
        let (mut c, mut peer) = pair().await;
        c.defer(&Msg::Unstage { slot: 1 });
        c.defer(&Msg::Unstage { slot: 2 });
        let mut buf = vec![0u8; 4096];
        let early = tokio::time::timeout(Duration::from_millis(100), peer.read(&mut buf)).await;
        assert!(early.is_err(), "a deferred message was sent on its own");
        let stage = Msg::Stage {
            handle: 3,
            offset: 4096,
            len: 1 << 20,
        };
        c.send(&stage).await.unwrap();
        let mut want = encode(&Msg::Unstage { slot: 1 });
        want.extend_from_slice(&encode(&Msg::Unstage { slot: 2 }));
        want.extend_from_slice(&encode(&stage));
        let got = read_len(&mut peer, want.len(), "the send").await;
        assert_eq!(
            got, want,
            "deferred messages first, in order, then the one sent"
        );
        // sent once: the next send carries only itself
        c.send(&Msg::KeepAlive).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), peer.read(&mut buf))
            .await
            .expect("the keepalive arrived")
            .unwrap();
        assert_eq!(&buf[..n], &encode(&Msg::KeepAlive)[..]);
    }

    #[tokio::test]
    async fn deferred_messages_go_out_together_on_request_and_only_once() {
        let (mut c, mut peer) = pair().await;
        // nothing deferred: nothing written
        c.send_deferred().await.unwrap();
        assert_eq!(c.deferred_len(), 0);
        let stage = |offset| Msg::Stage {
            handle: 1,
            offset,
            len: 1 << 20,
        };
        c.defer(&Msg::Unstage { slot: 0 });
        c.defer(&stage(0));
        c.defer(&stage(1 << 20));
        let mut want = encode(&Msg::Unstage { slot: 0 });
        want.extend_from_slice(&encode(&stage(0)));
        want.extend_from_slice(&encode(&stage(1 << 20)));
        assert_eq!(c.deferred_len(), want.len());
        c.send_deferred().await.unwrap();
        assert_eq!(c.deferred_len(), 0);
        let got = read_len(&mut peer, want.len(), "the batch").await;
        assert_eq!(got, want, "in order, all of them");
        c.send_deferred().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let again = tokio::time::timeout(Duration::from_millis(100), peer.read(&mut buf)).await;
        assert!(again.is_err(), "a batch was sent twice");
    }

    #[tokio::test]
    async fn deferred_messages_to_a_peer_that_stopped_reading_time_out_and_say_so() {
        let (mut c, _peer) = pair().await;
        c.set_send_timeout(Duration::from_millis(300));
        // more than loopback's socket buffers hold, never read by the peer
        let big = Msg::error(ErrorCode::Internal, "x".repeat(4 << 20));
        for _ in 0..16 {
            c.defer(&big);
        }
        let e = c.send_deferred().await.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("{}: timed out after 0 s waiting for ", c.peer))
                && text.ends_with("the peer to read a message (it stopped reading)"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn next_is_here_only_for_a_whole_message_and_keeps_its_bytes() {
        let (mut c, mut peer) = pair().await;
        assert!(!c.next_is_here(), "nothing was sent");
        let m = encode(&Msg::Unstage { slot: 5 });
        peer.write_all(&m[..m.len() - 1]).await.unwrap();
        for _ in 0..50 {
            assert!(!c.next_is_here(), "a partial frame is not a message");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        peer.write_all(&m[m.len() - 1..]).await.unwrap();
        let mut here = false;
        for _ in 0..400 {
            if c.next_is_here() {
                here = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(here, "the whole message never showed");
        assert_eq!(c.try_recv().unwrap(), Some(Msg::Unstage { slot: 5 }));
        assert!(!c.next_is_here());
    }

    #[tokio::test]
    async fn more_bytes_wakes_on_any_bytes_keeps_them_and_can_be_dropped() {
        let (mut c, mut peer) = pair().await;
        // dropped while nothing came (as a select drops it when a READ completes first)
        let waited = tokio::time::timeout(Duration::from_millis(50), c.more_bytes("x")).await;
        assert!(waited.is_err(), "nothing was sent, yet it woke");
        let a = encode(&Msg::Unstage { slot: 7 });
        // half a message wakes it, and is no message yet
        peer.write_all(&a[..a.len() / 2]).await.unwrap();
        c.more_bytes("unstage").await.unwrap();
        assert!(c.try_recv().unwrap().is_none());
        peer.write_all(&a[a.len() / 2..]).await.unwrap();
        let mut got = None;
        for _ in 0..400 {
            got = c.try_recv().unwrap();
            if got.is_some() {
                break;
            }
            c.more_bytes("unstage").await.unwrap();
        }
        assert_eq!(got, Some(Msg::Unstage { slot: 7 }));
        // the end of the stream is an error that names what was awaited
        drop(peer);
        match c.more_bytes("a staged chunk").await {
            Err(Error::Closed { during, .. }) => assert!(during.contains("a staged chunk")),
            other => panic!("not a closed connection: {other:?}"),
        }
    }
}
