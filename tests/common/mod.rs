//! Helpers shared by the lab tests (each `tests/lab_*.rs` file includes this module).
#![allow(dead_code)]

pub(crate) const LAB: &str = "lab test: needs an RDMA device; run it with soft-roce/lab";

/// The lab guest's address (and a check that the lab set up an RDMA device).
pub(crate) fn lab_ip() -> String {
    std::env::var("P2P_RDMA_DEVICE")
        .unwrap_or_else(|_| panic!("P2P_RDMA_DEVICE is not set. {LAB}"));
    std::env::var("P2P_LAB_IP").unwrap_or_else(|_| panic!("P2P_LAB_IP is not set. {LAB}"))
}

/// The active MTU of port 1 of the lab's RDMA device (9000-byte netdev: 4096; 1500: 1024).
pub(crate) fn lab_port_mtu() -> u32 {
    let dev = std::env::var("P2P_RDMA_DEVICE")
        .unwrap_or_else(|_| panic!("P2P_RDMA_DEVICE is not set. {LAB}"));
    verbs::Context::open(Some(&dev))
        .unwrap()
        .port(1)
        .unwrap()
        .active_mtu
}

/// Whether the guest runs `rdma_rxe` with its ODP copy fixed (`soft-roce/lab --rxe odp-fix`,
/// soft-roce/rxe-odp-offset.patch): its NIC then reads and writes a CMB at any offset and path
/// MTU, where the kernel's own rdma_rxe copies each packet from the start of its page (LAB.md).
/// Panics where `P2P_LAB_RXE` and the loaded module disagree: the fixed one is built out of tree
/// (taint `O`), the kernel's own is not.
pub(crate) fn lab_rxe_any_offset() -> bool {
    let taint = std::fs::read_to_string("/sys/module/rdma_rxe/taint")
        .unwrap_or_else(|e| panic!("/sys/module/rdma_rxe/taint: {e}. {LAB}"));
    let asked = std::env::var("P2P_LAB_RXE").ok();
    rxe_any_offset(asked.as_deref(), &taint).unwrap_or_else(|e| panic!("{e}"))
}

/// [`lab_rxe_any_offset`]'s check: whether `P2P_LAB_RXE` (`asked`) names the fixed rxe, if a
/// module of that `taint` (`/sys/module/rdma_rxe/taint`) is the one it names.
pub(crate) fn rxe_any_offset(asked: Option<&str>, taint: &str) -> Result<bool, String> {
    let fixed = asked == Some("odp-fix");
    if taint.contains('O') == fixed {
        Ok(fixed)
    } else {
        Err(format!(
            "P2P_LAB_RXE={:?}, but the loaded rdma_rxe's taint is {:?} ('O': built out of tree, \
             as soft-roce/lab --rxe odp-fix builds it)",
            asked.unwrap_or_default(),
            taint.trim()
        ))
    }
}

pub(crate) fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// `len` pseudo-random bytes (xorshift), reproducible from `seed`.
pub(crate) fn data(len: usize, seed: u32) -> Vec<u8> {
    p2p_rdma::bench::pattern_from(len, seed)
}

pub(crate) const TOKEN: &str = "lab-token-0123456789";

/// A client of the server at `addr` with [`TOKEN`], moving `chunk` bytes per RDMA request and
/// keeping up to `depth` of them in flight.
pub(crate) fn client_config(
    addr: impl std::fmt::Display,
    chunk: usize,
    depth: usize,
) -> p2p_rdma::bridge::ClientConfig {
    let mut c = p2p_rdma::bridge::ClientConfig::new(addr.to_string(), TOKEN);
    c.chunk = chunk;
    c.depth = depth;
    c
}

/// A server running in this process on the lab address.
pub(crate) struct Running {
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) handle: p2p_rdma::bridge::ServerHandle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<p2p_rdma::bridge::Result<()>>,
}

impl Running {
    /// Shut down and check that the server ended cleanly.
    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

/// Bind a server for `regions` on the lab address (any port), with [`TOKEN`].
pub(crate) async fn bind(
    regions: &[&str],
    tweak: impl FnOnce(&mut p2p_rdma::bridge::ServerConfig),
) -> p2p_rdma::bridge::Result<p2p_rdma::bridge::Server> {
    use p2p_rdma::bridge::{RegionSpec, Server, ServerConfig};
    init_tracing();
    let ip = lab_ip();
    let specs: Vec<RegionSpec> = regions.iter().map(|s| s.parse().unwrap()).collect();
    let mut cfg = ServerConfig::new(format!("{ip}:0").parse().unwrap(), TOKEN, specs);
    tweak(&mut cfg);
    Server::bind(cfg).await
}

/// Run a bound server until [`Running::stop`].
pub(crate) fn run(server: p2p_rdma::bridge::Server) -> Running {
    let addr = server.local_addr().unwrap();
    let handle = server.handle();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async {
        let _ = rx.await;
    }));
    Running {
        addr,
        handle,
        stop: Some(tx),
        task,
    }
}

/// Bind and run.
pub(crate) async fn start(
    regions: &[&str],
    tweak: impl FnOnce(&mut p2p_rdma::bridge::ServerConfig),
) -> Running {
    run(bind(regions, tweak).await.unwrap())
}

/// Send raw bytes on a fresh control connection, close our side, and decode every reply.
pub(crate) async fn raw(
    addr: std::net::SocketAddr,
    bytes: &[u8],
) -> Vec<p2p_rdma::bridge::protocol::Msg> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s.shutdown().await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), s.read_to_end(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let mut d = p2p_rdma::bridge::protocol::Decoder::new();
    d.feed(&buf);
    let mut out = Vec::new();
    while let Ok(Some(m)) = d.next_msg() {
        out.push(m);
    }
    out
}

/// The code of the first error among `msgs`.
pub(crate) fn code_of(
    msgs: &[p2p_rdma::bridge::protocol::Msg],
) -> Option<p2p_rdma::bridge::protocol::ErrorCode> {
    msgs.iter().find_map(|m| match m {
        p2p_rdma::bridge::protocol::Msg::Error { code, .. } => Some(*code),
        _ => None,
    })
}

/// How many lines of `rdma resource show KIND` contain `marker`.
pub(crate) fn rdma_resources(kind: &str, marker: &str) -> usize {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", kind])
        .output()
        .expect("rdma tool (iproute2)");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(marker))
        .count()
}
