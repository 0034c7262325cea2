//! Helpers shared by the verbs lab tests (each `tests/lab_*.rs` file includes this module).
#![allow(dead_code)]

use verbs::{Context, Error, Local, ProtectionDomain, QpOptions, QueuePair, WcStatus};

pub(crate) const LAB: &str = "lab test: needs an RDMA device; run it with soft-roce/lab (see README), or set P2P_RDMA_DEVICE";

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// The device named by `P2P_RDMA_DEVICE`; a panic that says what is missing without it.
pub(crate) fn device() -> Context {
    init_tracing();
    let name = std::env::var("P2P_RDMA_DEVICE")
        .unwrap_or_else(|_| panic!("P2P_RDMA_DEVICE is not set. {LAB}"));
    Context::open(Some(&name)).unwrap_or_else(|e| panic!("cannot open {name}: {e}. {LAB}"))
}

/// Two connected QPs of `pd` that can bind memory windows.
pub(crate) fn window_pair(pd: &ProtectionDomain) -> (QueuePair, QueuePair) {
    let opts = QpOptions {
        memory_windows: true,
        ..QpOptions::default()
    };
    QueuePair::loopback_pair(pd, opts).unwrap()
}

/// `r` is the remote access error of a request the peer refused.
pub(crate) fn refused_remotely(r: verbs::Result<Local>, what: &str) {
    match r {
        Err(Error::WorkCompletion { status, .. }) => {
            assert_eq!(status, WcStatus::REM_ACCESS_ERR, "{what}")
        }
        other => panic!("{what}: expected a remote access error, got {other:?}"),
    }
}
