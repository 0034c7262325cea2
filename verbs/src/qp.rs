//! Reliable-connected queue pairs: creation, the INIT→RTR→RTS state machine, and posting.
//!
//! The safe API moves the local buffer into the operation and hands it back on completion; if
//! the future is dropped, the buffer stays in the CQ's pending table until the device reports
//! the work request done.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::{Arc, Mutex};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, QueuePair as _, QueuePairAttribute, QueuePairAttributeMask, QueuePairState,
    SendOperationFlags, SetScatterGatherEntry as _,
};
use sideway::ibverbs::AccessFlags;
use tokio::sync::oneshot;

use crate::cq::{Cq, CqMode, Done, Queue};
use crate::device::{io_of, select_port_gid, GidInfo};
use crate::endpoint::{mtu_enum, negotiate_mtu, rand_psn, Endpoint};
use crate::error::{Call, Error, Result};
use crate::local::Local;
use crate::mr::{ProtectionDomain, RemoteSlice};
pub use crate::pending::{Pending, PendingRecv};
use crate::wr::{RecvInfo, SendOp, SendWr};

/// QP state, as reported by `ibv_query_qp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// RESET
    Reset,
    /// INIT
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every outstanding and new work request is flushed.
    Error,
    /// Unknown
    Unknown,
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Options for [`QueuePair::new`].
#[derive(Debug, Clone)]
pub struct QpOptions {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Port (default: the first ACTIVE port with a usable GID).
    pub port: Option<u8>,
    /// GID index (default: the RoCE v2 GID of `local_ip` if one carries it, else RoCE v2 with
    /// an IPv4-mapped address, see [`pick_gid`](crate::pick_gid)).
    pub gid_index: Option<u32>,
    /// The address our control connection uses: without `gid_index`, the RoCE v2 GID that
    /// carries it is preferred, so RDMA takes the same interface as the TCP connection.
    pub local_ip: Option<std::net::IpAddr>,
    /// Traffic class of the GRH (RoCE v2: the IP header's DSCP and ECN bits), e.g. the class a
    /// RoCE fleet reserves for lossless traffic (DSCP 26 is traffic class 104).
    pub traffic_class: u8,
    /// Service level (0–15; on RoCE, mapped to a priority by the device).
    pub service_level: u8,
    /// Event-driven or polling completions.
    pub cq_mode: CqMode,
    /// Outstanding RDMA READs (initiator and responder); capped by the device.
    pub max_rd_atomic: u8,
    /// Local ACK timeout exponent: a request unanswered for 4.096 µs × 2^n is sent again
    /// (0: never). Default 18, about 1.07 s: on soft-RoCE a server's transmit queue holds up to
    /// 64 packets per QP, and with 32 clients reading 1 MiB chunks at once the responses of a
    /// QP waited longer than 14's 67 ms behind the others. Each such timeout resent the rest of
    /// a READ that was still on its way (up to 3.3 times the bytes fetched in a lab run) and
    /// cut the aggregate rate to 0.4-0.8 of one client's, where 18 measured 1.1 with no retry.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Initial PSN (default: random).
    pub psn: Option<u32>,
    /// Whether memory windows may be bound (and invalidated) on this QP: type 2 windows
    /// bound here give remote access only to requests that arrive on this QP. Off by default:
    /// a provider without memory windows would refuse the QP.
    pub memory_windows: bool,
    /// Bytes a SEND or WRITE may carry inside the work request ([`Local::Inline`]): the
    /// device copies them at the post, so small messages need no registered buffer and no
    /// DMA read of one. 0 (the default): no inline data. A device refuses the QP if it
    /// cannot carry this many (rxe: up to 400 bytes on the kernels of the lab).
    pub max_inline_data: u32,
    /// The largest path MTU this side takes (256, 512, 1024, 2048 or 4096): the endpoint
    /// advertises the smaller of it and the port's active MTU, and the connection runs at the
    /// smaller of both ends' (None: the port's).
    pub max_path_mtu: Option<u32>,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            max_send_wr: 128,
            max_recv_wr: 128,
            port: None,
            gid_index: None,
            local_ip: None,
            traffic_class: 0,
            service_level: 0,
            cq_mode: CqMode::Events,
            max_rd_atomic: 16,
            timeout: 18,
            retry_cnt: 7,
            rnr_retry: 7,
            psn: None,
            memory_windows: false,
            max_inline_data: 0,
            max_path_mtu: None,
        }
    }
}

pub(crate) struct QpInner {
    // drop order: the QP is destroyed before its CQ (which may still hold buffers of work
    // requests that never completed; after destroy the device no longer touches them)
    qp: Mutex<ExtendedQueuePair>,
    cq: Cq,
    pd: ProtectionDomain,
    pub(crate) qpn: u32,
    port: u8,
    gid: GidInfo,
    psn: u32,
    mtu: u32,
    /// The path MTU agreed at [`QueuePair::connect`] (0 before).
    path_mtu: std::sync::atomic::AtomicU32,
    pub(crate) opts: QpOptions,
    span: tracing::Span,
    /// A [`crate::PreparedSend`] holds the send queue (see [`QueuePair::prepare_send`]).
    pub(crate) prepared: std::sync::atomic::AtomicBool,
}

/// A reliable-connected queue pair with its own CQ. Cheap to clone.
///
/// A QP keeps its PD (and so the device context) alive, and an MR keeps its PD alive: neither
/// can outlive what it depends on (an MR is made only by `ProtectionDomain::register*`).
#[derive(Clone)]
pub struct QueuePair {
    pub(crate) inner: Arc<QpInner>,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("device", &self.inner.pd.context().name())
            .field("qpn", &self.inner.qpn)
            .field("port", &self.inner.port)
            .field("gid_index", &self.inner.gid.index)
            .finish()
    }
}

fn qp_state(s: QueuePairState) -> QpState {
    match s {
        QueuePairState::Reset => QpState::Reset,
        QueuePairState::Init => QpState::Init,
        QueuePairState::ReadyToReceive => QpState::Rtr,
        QueuePairState::ReadyToSend => QpState::Rts,
        QueuePairState::SendQueueDrain => QpState::Sqd,
        QueuePairState::SendQueueError => QpState::Sqe,
        QueuePairState::Error => QpState::Error,
        QueuePairState::Unknown => QpState::Unknown,
    }
}

impl QueuePair {
    /// Create an RC QP (and its CQ) on `pd`, and move it to INIT. Must run inside a tokio
    /// runtime when `opts.cq_mode` is `Events`.
    pub fn new(pd: &ProtectionDomain, opts: QpOptions) -> Result<QueuePair> {
        let ctx = pd.context();
        let dev = ctx.name().to_string();
        if opts.max_send_wr == 0 {
            return Err(Error::InvalidArgument(
                "max_send_wr must be at least 1".into(),
            ));
        }
        let info = ctx.info();
        if opts.service_level > 15 {
            return Err(Error::InvalidArgument(format!(
                "service level {} is out of range: it has 4 bits (0–15)",
                opts.service_level
            )));
        }
        if let Some(m) = opts.max_path_mtu {
            if !crate::IB_MTUS.contains(&m) {
                return Err(Error::InvalidArgument(format!(
                    "path MTU {m} is not 256, 512, 1024, 2048 or 4096"
                )));
            }
        }
        let (port, gid) = select_port_gid(ctx, opts.port, opts.gid_index, opts.local_ip)?;
        let port_info = ctx.port(port)?;
        let mtu = match opts.max_path_mtu {
            Some(m) => negotiate_mtu(port_info.active_mtu, m),
            None => port_info.active_mtu,
        };
        let max_rd = opts
            .max_rd_atomic
            .min(info.caps.max_qp_rd_atom.clamp(1, 255) as u8)
            .min(info.caps.max_qp_init_rd_atom.clamp(1, 255) as u8)
            .max(1);
        let opts = QpOptions {
            max_rd_atomic: max_rd,
            ..opts
        };
        let depth = opts.max_send_wr + opts.max_recv_wr;
        let cq = Cq::new(ctx, depth, opts.cq_mode)?;
        let mut b = pd.inner.create_qp_builder();
        b.setup_max_send_wr(opts.max_send_wr)
            .setup_max_recv_wr(opts.max_recv_wr.max(1))
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(opts.max_inline_data)
            .setup_send_cq(Arc::clone(&cq.cq))
            .setup_recv_cq(Arc::clone(&cq.cq));
        if opts.memory_windows {
            b.setup_send_ops_flags(
                SendOperationFlags::Send
                    | SendOperationFlags::SendWithImmediate
                    | SendOperationFlags::Write
                    | SendOperationFlags::WriteWithImmediate
                    | SendOperationFlags::Read
                    | SendOperationFlags::BindMemoryWindow
                    | SendOperationFlags::LocalInvalidate,
            );
        }
        let mut qp = b.build_ex().map_err(|e| {
            Error::verbs(
                Call::CreateQp,
                format!(
                    "{dev}: RC, {} send / {} recv WRs",
                    opts.max_send_wr, opts.max_recv_wr
                ),
                io_of(&e),
            )
        })?;
        let qpn = qp.qp_number();
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port)
            .setup_access_flags(
                AccessFlags::LocalWrite
                    | AccessFlags::RemoteWrite
                    | AccessFlags::RemoteRead
                    | AccessFlags::RemoteAtomic,
            );
        qp.modify(&attr).map_err(|e| {
            Error::verbs(
                Call::ModifyQp,
                format!("{dev} QP {qpn}: RESET→INIT"),
                io_of(&e),
            )
        })?;
        let psn = opts.psn.unwrap_or_else(rand_psn) & 0xff_ffff;
        let span = tracing::info_span!("qp", device = %dev, qpn, port, gid_index = gid.index);
        span.in_scope(
            || tracing::debug!(gid = %gid.gid, mtu = port_info.active_mtu, "QP created (INIT)"),
        );
        Ok(QueuePair {
            inner: Arc::new(QpInner {
                qp: Mutex::new(qp),
                cq,
                pd: pd.clone(),
                qpn,
                port,
                gid,
                psn,
                mtu,
                path_mtu: std::sync::atomic::AtomicU32::new(0),
                opts,
                span,
                prepared: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Two QPs on `pd`, each connected to the other (loopback on one port): for canaries,
    /// probes and benchmarks of a device against itself.
    pub fn loopback_pair(pd: &ProtectionDomain, opts: QpOptions) -> Result<(QueuePair, QueuePair)> {
        let a = QueuePair::new(pd, opts.clone())?;
        let b = QueuePair::new(pd, opts)?;
        a.connect(&b.endpoint())?;
        b.connect(&a.endpoint())?;
        Ok((a, b))
    }

    /// Our side of the connection.
    pub fn endpoint(&self) -> Endpoint {
        let i = &self.inner;
        Endpoint {
            lid: i
                .pd
                .context()
                .info()
                .ports
                .iter()
                .find(|p| p.port == i.port)
                .map_or(0, |p| p.lid),
            gid: i.gid.gid,
            qpn: i.qpn,
            psn: i.psn,
            mtu: i.mtu,
        }
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// The GID entry in use.
    pub fn gid(&self) -> &GidInfo {
        &self.inner.gid
    }

    /// The PD.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// Connect to `remote`: INIT → RTR → RTS. The path MTU is the smaller of both ports'.
    pub fn connect(&self, remote: &Endpoint) -> Result<()> {
        remote.check()?;
        let i = &self.inner;
        let dev = i.pd.context().name().to_string();
        let mtu = negotiate_mtu(i.mtu, remote.mtu);
        let mut qp = self.lock_qp();
        let mut ah = AddressHandleAttribute::new();
        let dgid: Gid = remote.gid.into();
        ah.setup_dest_lid(remote.lid)
            .setup_port(i.port)
            .setup_service_level(i.opts.service_level)
            .setup_grh(&dgid, 0, i.gid.index as u8, 64, i.opts.traffic_class);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_enum(mtu))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn & 0xff_ffff)
            .setup_max_dest_read_atomic(i.opts.max_rd_atomic)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        qp.modify(&attr).map_err(|e| {
            Error::verbs(
                Call::ModifyQp,
                format!(
                    "{dev} QP {}: INIT→RTR to QP {} at {} (gid index {}, mtu {mtu}, traffic class {}, sl {})",
                    i.qpn, remote.qpn, remote.gid, i.gid.index, i.opts.traffic_class, i.opts.service_level
                ),
                io_of(&e),
            )
        })?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(i.psn)
            .setup_timeout(i.opts.timeout)
            .setup_retry_cnt(i.opts.retry_cnt)
            .setup_rnr_retry(i.opts.rnr_retry)
            .setup_max_read_atomic(i.opts.max_rd_atomic);
        qp.modify(&attr).map_err(|e| {
            Error::verbs(
                Call::ModifyQp,
                format!("{dev} QP {}: RTR→RTS", i.qpn),
                io_of(&e),
            )
        })?;
        i.path_mtu.store(mtu, std::sync::atomic::Ordering::Relaxed);
        i.span.in_scope(|| tracing::info!(remote_qpn = remote.qpn, remote_gid = %remote.gid, mtu, "QP connected (RTS)"));
        Ok(())
    }

    /// The path MTU agreed with the peer (the smaller of both ends' advertised MTUs); None
    /// before [`QueuePair::connect`].
    pub fn path_mtu(&self) -> Option<u32> {
        match self
            .inner
            .path_mtu
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            m => Some(m),
        }
    }

    /// Current state (`ibv_query_qp`): after a transport error this reports `Error`.
    pub fn state(&self) -> Result<QpState> {
        let qp = self.lock_qp();
        let (attr, _) = qp.query(QueuePairAttributeMask::State).map_err(|e| {
            Error::verbs(
                Call::ModifyQp,
                format!("ibv_query_qp on QP {}", self.inner.qpn),
                io_of(&e),
            )
        })?;
        Ok(qp_state(attr.state()))
    }

    /// The path the device holds for this connected QP (`ibv_query_qp` of the address
    /// vector): what reached the kernel, not what was asked.
    pub fn path(&self) -> Result<PathInfo> {
        let qp = self.lock_qp();
        let mut attr = std::mem::MaybeUninit::<rdma_mummy_sys::ibv_qp_attr>::zeroed();
        let mut init = std::mem::MaybeUninit::<rdma_mummy_sys::ibv_qp_init_attr>::zeroed();
        // SAFETY: the QP is live while its lock is held; both structs are zeroed, writable and
        // of the types ibv_query_qp(3) fills in.
        let ret = unsafe {
            rdma_mummy_sys::ibv_query_qp(
                qp.qp().as_ptr(),
                attr.as_mut_ptr(),
                rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_AV.0 as i32,
                init.as_mut_ptr(),
            )
        };
        if ret != 0 {
            return Err(Error::verbs(
                Call::ModifyQp,
                format!("ibv_query_qp(IBV_QP_AV) on QP {}", self.inner.qpn),
                std::io::Error::from_raw_os_error(ret),
            ));
        }
        // SAFETY: the call succeeded, so the attributes were filled in (zeroed before).
        let ah = unsafe { attr.assume_init() }.ah_attr;
        Ok(PathInfo {
            traffic_class: ah.grh.traffic_class,
            service_level: ah.sl,
            gid_index: u32::from(ah.grh.sgid_index),
        })
    }

    /// Move the QP to the error state: every outstanding work request completes as flushed.
    pub fn set_error(&self) -> Result<()> {
        let mut qp = self.lock_qp();
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        qp.modify(&attr).map_err(|e| {
            Error::verbs(
                Call::ModifyQp,
                format!("QP {}: →ERR", self.inner.qpn),
                io_of(&e),
            )
        })
    }

    /// Send-queue capacity: work requests that may be outstanding at once.
    pub fn max_send_wr(&self) -> u32 {
        self.inner.opts.max_send_wr
    }

    /// RDMA READs (and atomics) this QP keeps in flight at once as the requester, and
    /// accepts at once as the responder: the asked `max_rd_atomic` within the device's limits.
    pub fn max_rd_atomic(&self) -> u8 {
        self.inner.opts.max_rd_atomic
    }

    /// Work requests posted and not yet completed: (send queue, receive queue).
    pub fn outstanding(&self) -> (usize, usize) {
        let s = self.inner.cq.lock();
        (s.send_outstanding, s.recv_outstanding)
    }

    /// Poll the CQ once without waiting, delivering completions to their owners.
    pub fn progress(&self) -> Result<usize> {
        self.inner.cq.drain()
    }

    /// Whether memory windows may be bound on this QP.
    pub fn memory_windows(&self) -> bool {
        self.inner.opts.memory_windows
    }

    pub(crate) fn cq(&self) -> &Cq {
        &self.inner.cq
    }

    pub(crate) fn pending(
        &self,
        rxs: Vec<(u64, oneshot::Receiver<Done>, &'static str)>,
    ) -> Pending {
        Pending {
            qp: self.clone(),
            rxs,
        }
    }

    pub(crate) fn lock_qp(&self) -> std::sync::MutexGuard<'_, ExtendedQueuePair> {
        self.inner.qp.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn check_send_room(&self, state: &crate::cq::CqState, n: usize) -> Result<()> {
        let cap = self.inner.opts.max_send_wr as usize;
        if state.send_outstanding + n > cap {
            return Err(Error::QueueFull {
                queue: "send",
                qpn: self.inner.qpn,
                outstanding: state.send_outstanding,
                capacity: cap,
            });
        }
        Ok(())
    }

    /// Post receive buffers (owned: the device writes them).
    pub fn post_recv(&self, bufs: Vec<Local>) -> Result<PendingRecv> {
        let mut sges = Vec::with_capacity(bufs.len());
        for b in &bufs {
            if matches!(b, Local::Shared(..)) {
                return Err(Error::InvalidArgument(
                    "a receive buffer is written by the device: pass an owned buffer".into(),
                ));
            }
            sges.push(b.sge()?);
        }
        let mut state = self.inner.cq.lock();
        let cap = self.inner.opts.max_recv_wr as usize;
        if state.recv_outstanding + bufs.len() > cap {
            return Err(Error::QueueFull {
                queue: "receive",
                qpn: self.inner.qpn,
                outstanding: state.recv_outstanding,
                capacity: cap,
            });
        }
        let mut ids = Vec::with_capacity(bufs.len());
        let mut rxs = Vec::with_capacity(bufs.len());
        for b in bufs {
            let (id, rx) = state.register(Some(b), Queue::Recv);
            ids.push(id);
            rxs.push((id, rx, "RECV"));
        }
        let res = {
            let mut qp = self.lock_qp();
            let mut guard = qp.start_post_recv();
            for (id, &(lkey, addr, len)) in ids.iter().zip(&sges) {
                let h = guard.construct_wr(*id);
                // SAFETY: the range was checked against the owned registered buffer (or region),
                // which the pending table keeps until the receive completes.
                unsafe { h.setup_sge(lkey, addr, len) };
            }
            guard.post()
        };
        if let Err(e) = res {
            state.unregister(&ids);
            return Err(Error::verbs(
                Call::PostRecv,
                format!("QP {}", self.inner.qpn),
                io_of(&e),
            ));
        }
        drop(state);
        Ok(PendingRecv {
            qp: self.clone(),
            rxs,
        })
    }

    /// RDMA WRITE `local` to `remote`.
    ///
    /// The buffer is moved into the operation, so the CPU cannot touch it while the device may:
    ///
    /// ```compile_fail
    /// # async fn f(qp: verbs::QueuePair, mut buf: verbs::RegisteredBuffer, r: verbs::RemoteSlice) {
    /// let op = qp.write(verbs::Local::owned(buf), r);
    /// buf.as_mut_slice()[0] = 1; // error: `buf` was moved into the work request
    /// op.await.unwrap();
    /// # }
    /// ```
    ///
    /// It comes back when the work request has completed:
    ///
    /// ```no_run
    /// # async fn f(qp: verbs::QueuePair, buf: verbs::RegisteredBuffer, r: verbs::RemoteSlice) -> verbs::Result<()> {
    /// let mut buf = qp.write(verbs::Local::owned(buf), r).await?.into_owned().unwrap();
    /// buf.as_mut_slice()[0] = 1;
    /// # Ok(()) }
    /// ```
    pub async fn write(&self, local: Local, remote: RemoteSlice) -> Result<Local> {
        self.one(SendWr {
            op: SendOp::Write(remote),
            local,
        })
        .await
    }

    /// RDMA WRITE with immediate data.
    pub async fn write_imm(&self, local: Local, remote: RemoteSlice, imm: u32) -> Result<Local> {
        self.one(SendWr {
            op: SendOp::WriteImm(remote, imm),
            local,
        })
        .await
    }

    /// RDMA READ `remote` into `local`.
    pub async fn read(&self, local: Local, remote: RemoteSlice) -> Result<Local> {
        self.one(SendWr {
            op: SendOp::Read(remote),
            local,
        })
        .await
    }

    /// SEND `local`, with optional immediate data.
    pub async fn send(&self, local: Local, imm: Option<u32>) -> Result<Local> {
        let op = imm.map_or(SendOp::Send, SendOp::SendImm);
        self.one(SendWr { op, local }).await
    }

    /// Post one RECV and wait for it.
    pub async fn recv(&self, local: Local) -> Result<(Local, RecvInfo)> {
        let mut v = self.post_recv(vec![local])?.await?;
        Ok(v.pop().expect("one receive posted"))
    }

    async fn one(&self, wr: SendWr) -> Result<Local> {
        let mut v = self.post_send(vec![wr])?.await?;
        Ok(v.pop().expect("one work request posted"))
    }

    /// The QP's tracing span (completions are awaited inside it).
    pub(crate) fn span(&self) -> tracing::Span {
        self.inner.span.clone()
    }

    /// Wait for every work request of a batch; the first failure is returned, but only after
    /// all of them completed (so no buffer is still in use when this returns).
    pub(crate) async fn collect(
        &self,
        rxs: Vec<(u64, oneshot::Receiver<Done>, &'static str)>,
    ) -> Result<Vec<Done>> {
        let mut out = Vec::with_capacity(rxs.len());
        for (wr_id, rx, opcode) in rxs {
            out.push((wr_id, opcode, self.inner.cq.wait(rx).await?));
        }
        self.judge(out)
    }

    /// Sleep on the calling thread until the CQ raises an event, unless every one of `rxs`
    /// already has its result ([`Cq::sleep_until_event`]).
    pub(crate) fn sleep_until_event(
        &self,
        rxs: &[(u64, oneshot::Receiver<Done>, &'static str)],
        deadline: std::time::Instant,
    ) -> Result<()> {
        self.inner
            .cq
            .sleep_until_event(|| self.poll_ready(rxs), deadline)
    }

    /// Poll the CQ, sleeping on its channel between polls, until every one of `rxs` has its
    /// result; past `deadline` an `ETIMEDOUT` error.
    pub(crate) fn sleep_until_done(
        &self,
        rxs: &[(u64, oneshot::Receiver<Done>, &'static str)],
        deadline: std::time::Instant,
    ) -> Result<()> {
        while !self.poll_ready(rxs)? {
            self.sleep_until_event(rxs, deadline)?;
        }
        Ok(())
    }

    /// Poll the CQ once, without waiting: whether every one of `rxs` has its result.
    pub(crate) fn poll_ready(
        &self,
        rxs: &[(u64, oneshot::Receiver<Done>, &'static str)],
    ) -> Result<bool> {
        self.inner.cq.drain()?;
        Ok(rxs.iter().all(|(_, rx, _)| !rx.is_empty()))
    }

    /// The results of `rxs`, every one of which has completed ([`QueuePair::poll_ready`]).
    pub(crate) fn collect_ready(
        &self,
        rxs: Vec<(u64, oneshot::Receiver<Done>, &'static str)>,
    ) -> Result<Vec<Done>> {
        let mut out = Vec::with_capacity(rxs.len());
        for (wr_id, mut rx, opcode) in rxs {
            let done = crate::cq::try_take(&mut rx)?.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{opcode} (wr_id {wr_id}) has not completed yet; take the results only \
                     after poll_ready says true"
                ))
            })?;
            out.push((wr_id, opcode, done));
        }
        self.judge(out)
    }

    /// The first failure among completed work requests, else their results.
    fn judge(&self, done: Vec<(u64, &'static str, Done)>) -> Result<Vec<Done>> {
        let mut first_err = None;
        let mut out = Vec::with_capacity(done.len());
        for (wr_id, opcode, done) in done {
            if !done.status.is_success() && first_err.is_none() {
                first_err = Some(self.wc_error(wr_id, opcode, &done));
            }
            out.push(done);
        }
        match first_err {
            Some(e) => {
                tracing::warn!(error = %e, "work request failed");
                Err(e)
            }
            None => Ok(out),
        }
    }

    fn wc_error(&self, wr_id: u64, opcode: &'static str, done: &Done) -> Error {
        Error::WorkCompletion {
            qpn: self.inner.qpn,
            wr_id,
            opcode,
            status: done.status,
            vendor_err: done.vendor_err,
        }
    }
}

/// What the device holds of a connected QP's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathInfo {
    /// GRH traffic class.
    pub traffic_class: u8,
    /// Service level.
    pub service_level: u8,
    /// Source GID index.
    pub gid_index: u32,
}
