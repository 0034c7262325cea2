//! Helpers shared by the lab tests (each `tests/lab_*.rs` file includes this module).
#![allow(dead_code)]

pub(crate) const LAB: &str = "lab test: needs an RDMA device; run it with soft-roce/lab";

/// The lab guest's address (and a check that the lab set up an RDMA device).
pub(crate) fn lab_ip() -> String {
    std::env::var("P2P_RDMA_DEVICE")
        .unwrap_or_else(|_| panic!("P2P_RDMA_DEVICE is not set. {LAB}"));
    std::env::var("P2P_LAB_IP").unwrap_or_else(|_| panic!("P2P_LAB_IP is not set. {LAB}"))
}

pub(crate) fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// `len` pseudo-random bytes (xorshift), reproducible from `seed`.
pub(crate) fn data(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}
