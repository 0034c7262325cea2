//! Zero-copy puts from memory the application owns, one range or a batch of many: the
//! mirror of [`super::zero_copy`]. Direct extents are RDMA-WRITTEN straight from the buffer
//! (work requests only read it, so it is shared by all of them and stays readable); bounce
//! extents are copied once into a staging buffer the server RDMA-READs. A region that holds
//! data (a file) takes every byte through the server, which makes it durable before the call
//! returns.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use verbs::{Local, Pending, RegisteredBuffer, SendOp, SendWr};

use super::wait::await_or_stall;
use super::window::{bounce_reply, piece};
use super::zero_copy::{BatchRange, Landed, LocalBuffer, Stranded};
use super::{Client, Rdma, KEEPALIVE};
use crate::conn::Conn;
use crate::error::{Error, Result};
use crate::protocol::{DataPath, Msg};

enum Flight {
    /// RDMA WRITE from the buffer (of the piece at this region offset).
    Direct(Pending, u64),
    /// The server RDMA-READs this staging buffer.
    Bounce(RegisteredBuffer, u64),
}

impl Client {
    /// Put `len` bytes at byte `at` of `buf` to `offset` of `r` (opened for writing), with no
    /// copy on the direct path.
    pub async fn put_from(
        &mut self,
        r: &super::OpenRegion,
        offset: u64,
        len: u64,
        buf: LocalBuffer,
        at: usize,
    ) -> std::result::Result<Landed, Stranded> {
        self.put_many(
            &[BatchRange {
                region: r,
                offset,
                len,
                at,
            }],
            buf,
        )
        .await?
        .single()
    }

    /// Put many ranges of one buffer in one pipelined pass (the batch form of
    /// [`Client::put_from`]); one result per range. When it returns `Ok`, every range that
    /// succeeded is acknowledged: flushed by the server where the region holds data.
    pub async fn put_many(
        &mut self,
        ranges: &[BatchRange<'_>],
        buf: LocalBuffer,
    ) -> std::result::Result<Landed, Stranded> {
        let (mut rdma, buf, results) = self.begin_batch(ranges, buf, true).await?;
        let shared = Arc::new(buf.0);
        let mut window = VecDeque::new();
        let mut direct_by_range = vec![0u64; ranges.len()];
        let mut bounce_bytes = 0u64;
        let start = Instant::now();
        let run = self
            .put_pieces(
                &mut rdma,
                ranges,
                &results,
                &shared,
                &mut window,
                &mut direct_by_range,
                &mut bounce_bytes,
            )
            .await;
        let zero_copy_bytes = match run {
            Ok(n) => n,
            Err(error) => {
                settle(&mut rdma, &mut self.conn, &mut window, self.cfg.timeout).await;
                self.put_back_after(rdma, Some(&error));
                let buffer = Arc::try_unwrap(shared).ok().map(LocalBuffer);
                return Err(Stranded { error, buffer });
            }
        };
        self.put_back(rdma);
        let seconds = start.elapsed().as_secs_f64();
        let Ok(buffer) = Arc::try_unwrap(shared) else {
            return Err(Stranded {
                error: Error::Config("internal: a WRITE still holds the buffer".into()),
                buffer: None,
            });
        };
        let buffer = LocalBuffer(buffer);
        // acknowledged only once durable: one flush per region that holds data, over the span
        // it received
        let mut spans: Vec<(&super::OpenRegion, u64, u64)> = Vec::new();
        for (r, res) in ranges.iter().zip(&results) {
            // memory that does not persist has nothing to make durable (see `put`)
            if res.is_err() || r.len == 0 || !r.region.info.server_puts {
                continue;
            }
            match spans.iter_mut().find(|s| s.0.handle == r.region.handle) {
                Some(s) => {
                    s.1 = s.1.min(r.offset);
                    s.2 = s.2.max(r.offset + r.len);
                }
                None => spans.push((r.region, r.offset, r.offset + r.len)),
            }
        }
        for (region, from, to) in spans {
            if let Err(error) = self.flush(region, from, to - from).await {
                return Err(Stranded {
                    error,
                    buffer: Some(buffer),
                });
            }
        }
        let buffer = self
            .report_batch(ranges, &direct_by_range, true, seconds, buffer)
            .await?;
        Ok(Landed {
            buffer,
            results,
            direct_bytes: direct_by_range.iter().sum(),
            bounce_bytes,
            zero_copy_bytes,
            seconds,
            reasked_chunks: 0,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn put_pieces(
        &mut self,
        rdma: &mut Rdma,
        ranges: &[BatchRange<'_>],
        results: &[Result<()>],
        shared: &Arc<RegisteredBuffer>,
        window: &mut VecDeque<Flight>,
        direct_by_range: &mut [u64],
        bounce_bytes: &mut u64,
    ) -> Result<u64> {
        let chunk = self.cfg.chunk as u64;
        let mut zero_copy = 0;
        let depth = self.depth();
        let stall = self.cfg.timeout;
        let mut alive = Instant::now();
        for (i, r) in ranges.iter().enumerate() {
            if results[i].is_err() {
                continue;
            }
            let extents = r.region.put_extents();
            let mut done = 0u64;
            while done < r.len {
                if window.len() >= depth {
                    zero_copy += complete(rdma, &mut self.conn, window, stall).await?;
                }
                let p = piece(
                    &extents,
                    r.offset + done,
                    r.len - done,
                    chunk,
                    r.region.cut(),
                )?;
                let src = r.at + done as usize..r.at + (done + p.len) as usize;
                if p.path == DataPath::Direct {
                    // a piece within the QP's inline room travels in the work request
                    let local = if p.len <= u64::from(rdma.inline) {
                        Local::inline(&shared.as_slice()[src])
                    } else {
                        Local::shared(Arc::clone(shared), src)?
                    };
                    let wr = SendWr {
                        op: SendOp::Write(r.region.remote_at(p.pos, p.len)?),
                        local,
                    };
                    window.push_back(Flight::Direct(rdma.qp.post_send(vec![wr])?, p.pos));
                    direct_by_range[i] += p.len;
                } else {
                    let mut staging = rdma.take(p.path, true, chunk as usize)?;
                    // (the application's buffer is only read by the device: borrowable)
                    staging.as_mut_slice()[..p.len as usize]
                        .copy_from_slice(&shared.as_slice()[src]);
                    if let Err(e) = self
                        .conn
                        .send(&Msg::Bounce {
                            handle: r.region.handle,
                            offset: p.pos,
                            len: p.len,
                            to_region: true,
                            addr: staging.addr(),
                            rkey: staging.mr().rkey(),
                        })
                        .await
                    {
                        rdma.pools.give(staging);
                        return Err(e);
                    }
                    window.push_back(Flight::Bounce(staging, p.len));
                    *bounce_bytes += p.len;
                }
                done += p.len;
                if alive.elapsed() >= KEEPALIVE {
                    self.conn.send(&Msg::KeepAlive).await?;
                    alive = Instant::now();
                }
            }
        }
        while !window.is_empty() {
            zero_copy += complete(rdma, &mut self.conn, window, stall).await?;
        }
        Ok(zero_copy)
    }
}

/// Wait for the oldest transfer in flight: how many of its bytes the server's NIC moved
/// zero-copy.
async fn complete(
    rdma: &mut Rdma,
    conn: &mut Conn,
    window: &mut VecDeque<Flight>,
    stall: std::time::Duration,
) -> Result<u64> {
    match window.pop_front() {
        Some(Flight::Direct(p, pos)) => {
            await_or_stall(&rdma.qp, conn, p, stall, "RDMA WRITE", pos).await?;
            Ok(0)
        }
        Some(Flight::Bounce(staging, n)) => {
            let res = bounce_reply(conn, stall, n).await;
            rdma.pools.give(staging);
            res
        }
        None => Ok(0),
    }
}

/// After an error: wait (bounded) for what is in flight, reading every bounce reply.
async fn settle(
    rdma: &mut Rdma,
    conn: &mut Conn,
    window: &mut VecDeque<Flight>,
    stall: std::time::Duration,
) {
    let mut conn_ok = true;
    for f in window.drain(..) {
        match f {
            Flight::Direct(p, _) => {
                let _ = tokio::time::timeout(stall, p.wait()).await;
            }
            Flight::Bounce(staging, n) => {
                if conn_ok && bounce_reply(conn, stall, n).await.is_err() {
                    conn_ok = false;
                }
                rdma.pools.give(staging);
            }
        }
    }
}
