//! The TCP data path of the client: for hosts without an RDMA device (or
//! [`Transport::Tcp`]), fetch and put move the bytes over the control connection, with the
//! same regions, checks and verification. Up to `depth` requests of one chunk are in flight;
//! replies come back in order.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::time::Instant;

use super::checksum::Checksum;
use super::report::{millis, report};
use super::window::{more_input, overflow_error, read_full};
use super::{reply_err, Client, OpenRegion, TransferReport, Transport};
use crate::error::{Error, Result};
use crate::protocol::Msg;

impl Client {
    /// Why this client moves its bytes over TCP, once it decided to (None: RDMA, or no
    /// transfer yet).
    pub fn tcp_reason(&self) -> Option<&str> {
        self.tcp.as_deref()
    }

    /// Whether the next transfer goes over TCP: `Transport::Tcp`; or `Auto` on a host where
    /// no RDMA device opens (and none was named: a named device's error is the answer).
    pub(super) fn over_tcp(&mut self) -> bool {
        if self.rdma.is_some() {
            return false;
        }
        if self.tcp.is_some() {
            return true;
        }
        match self.cfg.transport {
            Transport::Rdma => false,
            Transport::Tcp => {
                self.tcp = Some("the TCP transport was asked for".into());
                true
            }
            // a named device: its errors are the answer; an opened one: RDMA
            Transport::Auto if self.cfg.device.is_some() || self.device.is_some() => false,
            Transport::Auto => match verbs::Context::open(None) {
                Ok(ctx) => {
                    // the QP is created on it: the device is opened once
                    self.device = Some(ctx);
                    false
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no RDMA device: moving the bytes over TCP");
                    self.tcp = Some(format!("no RDMA device on this host ({e})"));
                    true
                }
            },
        }
    }

    /// The chunk of a TCP request: ours, at most what the server accepts.
    fn tcp_chunk(&self, r: &OpenRegion) -> u64 {
        (self.cfg.chunk as u64).min(r.bounce_chunk).max(1)
    }

    /// After an error, read the replies of the requests still in flight (each a refusal, or
    /// data to drop), so that the connection stays in step for the next request.
    async fn settle_tcp(&mut self, inflight: &mut VecDeque<u64>) {
        while let Some(n) = inflight.pop_front() {
            match self.conn.recv(Some(self.cfg.timeout), "tcp data").await {
                Ok(Msg::TcpData { len }) if len == n => {
                    if self
                        .conn
                        .recv_payload(n as usize, Some(self.cfg.timeout))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    pub(super) async fn fetch_tcp(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        len: u64,
        sink: &mut (dyn Write + Send),
        verify: bool,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<TransferReport> {
        let chunk = self.tcp_chunk(r);
        let depth = self.depth().max(1);
        let stall = Some(self.cfg.timeout);
        let start = Instant::now();
        let mut inflight: VecDeque<u64> = VecDeque::with_capacity(depth);
        let (mut sent, mut done, mut crc) = (0u64, 0u64, Checksum::new(verify));
        let mut first = None;
        let result: Result<()> = async {
            while done < len {
                while inflight.len() < depth && sent < len {
                    let n = chunk.min(len - sent);
                    let m = Msg::TcpRead {
                        handle: r.handle,
                        offset: offset + sent,
                        len: n,
                    };
                    self.conn.send(&m).await?;
                    inflight.push_back(n);
                    sent += n;
                }
                let n = inflight.front().copied().expect("a request in flight");
                match self.conn.recv(stall, "tcp data").await? {
                    Msg::TcpData { len: got } if got == n => {}
                    other => {
                        inflight.pop_front();
                        return Err(reply_err(&self.conn.peer, other, "tcp data"));
                    }
                }
                let data = self.conn.recv_payload(n as usize, stall).await?;
                first.get_or_insert_with(|| start.elapsed());
                inflight.pop_front();
                crc.add(&data);
                sink.write_all(&data)
                    .map_err(|e| Error::io("writing the fetched data", e))?;
                done += n;
                progress(done);
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            self.settle_tcp(&mut inflight).await;
            return Err(e);
        }
        let seconds = start.elapsed().as_secs_f64();
        let verified = self.verify(r, "fetch", offset, len, crc).await?;
        let mut rep = report("fetch", r, offset, len, seconds, crc, verified, [0; 3]);
        rep.tcp_bytes = len;
        rep.first_bytes_ms = first.map(millis);
        Ok(rep)
    }

    pub(super) async fn put_tcp(
        &mut self,
        r: &OpenRegion,
        offset: u64,
        source: &mut (dyn Read + Send),
        limit: Option<u64>,
        verify: bool,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<TransferReport> {
        let room = r.info.size - offset;
        let max = limit.unwrap_or(room);
        let chunk = self.tcp_chunk(r);
        let depth = self.depth().max(1);
        let stall = Some(self.cfg.timeout);
        let start = Instant::now();
        let mut buf = vec![0u8; chunk as usize];
        let mut inflight: VecDeque<u64> = VecDeque::with_capacity(depth);
        let (mut posted, mut done, mut crc) = (0u64, 0u64, Checksum::new(verify));
        let mut overflow = false;
        let result: Result<()> = async {
            let mut eof = false;
            loop {
                while inflight.len() < depth && !eof && posted < max {
                    let want = chunk.min(max - posted) as usize;
                    let n = read_full(source, &mut buf[..want])
                        .map_err(|e| Error::io("reading the data to put", e))?;
                    if n < want {
                        eof = true;
                    }
                    if n == 0 {
                        break;
                    }
                    crc.add(&buf[..n]);
                    let m = Msg::TcpWrite {
                        handle: r.handle,
                        offset: offset + posted,
                        len: n as u64,
                    };
                    self.conn.send_with(&m, &buf[..n]).await?;
                    inflight.push_back(n as u64);
                    posted += n as u64;
                }
                if !eof && posted >= max && limit.is_none() {
                    overflow = more_input(source)?;
                    eof = true;
                }
                let Some(n) = inflight.pop_front() else {
                    break;
                };
                match self.conn.recv(stall, "tcp written").await? {
                    Msg::TcpWritten { len } if len == n => {}
                    other => return Err(reply_err(&self.conn.peer, other, "tcp written")),
                }
                done += n;
                progress(done);
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            // the replies still due: refusals or acknowledgements, no data
            for _ in inflight.drain(..) {
                if self.conn.recv(stall, "tcp written").await.is_err() {
                    break;
                }
            }
            return Err(e);
        }
        if overflow {
            return Err(overflow_error(r, room, offset, done));
        }
        // acknowledged only once the server made it durable (memory that does not persist:
        // placed once each TcpWritten answered, see `Client::put`)
        if r.info.server_puts {
            self.flush(r, offset, done).await?;
        }
        let seconds = start.elapsed().as_secs_f64();
        let verified = self.verify(r, "put", offset, done, crc).await?;
        let mut rep = report("put", r, offset, done, seconds, crc, verified, [0; 3]);
        rep.tcp_bytes = done;
        Ok(rep)
    }
}
