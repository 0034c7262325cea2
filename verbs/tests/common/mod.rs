//! Helpers shared by the verbs lab tests (each `tests/lab_*.rs` file includes this module).
#![allow(dead_code)]

use verbs::{
    Access, Context, Error, HostBuffer, Local, ProtectionDomain, QpOptions, QpState, QueuePair,
    RegMode, RegisteredBuffer, WcStatus,
};

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

/// Two connected QPs of one PD, on the lab device.
pub(crate) struct Pair {
    pub(crate) pd: ProtectionDomain,
    pub(crate) a: QueuePair,
    pub(crate) b: QueuePair,
}

/// A connected pair with `opts`, in RTS.
pub(crate) fn pair_with(opts: QpOptions) -> Pair {
    let ctx = device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let (a, b) = QueuePair::loopback_pair(&pd, opts).unwrap();
    assert_eq!(a.state().unwrap(), QpState::Rts);
    Pair { pd, a, b }
}

/// A connected pair with the default options.
pub(crate) fn pair() -> Pair {
    pair_with(QpOptions::default())
}

/// A buffer remote peers may read and write (the CPU copies it: `to_vec`).
pub(crate) fn buf(pd: &ProtectionDomain, len: usize) -> RegisteredBuffer {
    pd.register(HostBuffer::new(len).unwrap(), Access::ALL, RegMode::Pinned)
        .unwrap()
}

/// A buffer only local work requests use (the CPU may borrow it).
pub(crate) fn local(pd: &ProtectionDomain, len: usize) -> RegisteredBuffer {
    pd.register(
        HostBuffer::new(len).unwrap(),
        Access::LOCAL_WRITE,
        RegMode::Pinned,
    )
    .unwrap()
}

/// `b` filled with a pseudo-random pattern of `seed`.
pub(crate) fn fill(b: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for v in b.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *v = x as u8;
    }
}

/// Where `a` and `b` first differ.
pub(crate) fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}
