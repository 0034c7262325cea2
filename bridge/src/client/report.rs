//! What a transfer did: the report every fetch and put returns (and `--json` prints).

use std::time::Duration;

use serde::Serialize;

use super::checksum::Checksum;
use super::OpenRegion;
use crate::size::mib_per_sec;

/// What a transfer did.
#[derive(Debug, Clone, Serialize)]
pub struct TransferReport {
    /// "fetch" or "put".
    pub op: &'static str,
    /// Region name.
    pub region: String,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from first post to last completion (and output written).
    pub seconds: f64,
    /// MiB/s.
    pub mib_per_sec: f64,
    /// Bytes that took the direct path.
    pub direct_bytes: u64,
    /// Bytes that took the bounce path.
    pub bounce_bytes: u64,
    /// Of the bounce bytes, those the server's NIC moved straight between our buffer and the
    /// device's memory: no staging copy (device-private regions whose window MRs work, chunks
    /// of an NVMe region lent from or landed in its CMB ring, SSD → CMB → NIC and back, and
    /// chunks of a CMB region that start on a page, read from or landed in the CMB itself).
    pub zero_copy_bytes: u64,
    /// Bytes that went over the TCP control connection (a client without an RDMA device,
    /// or `Transport::Tcp`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tcp_bytes: u64,
    /// CRC-32C of the bytes moved, when the transfer was verified (the sum is a pass of the
    /// CPU over every byte, so an unverified transfer does not compute it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
    /// Whether the server's checksum of the range was compared and matched.
    pub verified: bool,
    /// A fetch's time to first byte: milliseconds from its start (as `seconds`) until its
    /// first piece had arrived. On the bounce path this holds the server's staging of the first
    /// chunk and its control round trip, which a direct fetch does not wait for. None for a
    /// put and for a fetch of nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bytes_ms: Option<f64>,
    /// Milliseconds the region's `Open` took before the transfer ([`OpenRegion::open_ms`]),
    /// where the caller reports it (the CLI does): the set-up each path does there, such as
    /// the first chunk a fetch's open stages, is outside `seconds`. Comparisons of the direct
    /// and bounce paths count `seconds` plus this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_ms: Option<f64>,
    /// Chunks lent from a CMB ring whose replies came too late to be read within the server's
    /// ring hold limit (the client's sink blocked for most of it, say): given back unread and
    /// asked for again, so that a READ never meets a slot the server may have taken back.
    /// Counted once per ask again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reasked_chunks: u64,
    /// Of `bytes`, those this transfer did not move: kept from an earlier try or run (a
    /// resumed or continued transfer of the CLI) and compared with the server's checksum
    /// instead ([`crate::stripe::kept`]). `mib_per_sec` counts the bytes moved, `bytes` less
    /// these. The library's own transfers keep none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A duration in milliseconds, for a report.
pub(super) fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[allow(clippy::too_many_arguments)]
pub(super) fn report(
    op: &'static str,
    r: &OpenRegion,
    offset: u64,
    bytes: u64,
    seconds: f64,
    sum: Checksum,
    verified: bool,
    by_path: [u64; 3],
) -> TransferReport {
    TransferReport {
        op,
        region: r.info.name.clone(),
        offset,
        bytes,
        seconds,
        mib_per_sec: mib_per_sec(bytes, seconds),
        direct_bytes: by_path[0],
        bounce_bytes: by_path[1],
        zero_copy_bytes: by_path[2],
        tcp_bytes: 0,
        crc32c: sum.value(),
        verified,
        first_bytes_ms: None,
        open_ms: None,
        reasked_chunks: 0,
        kept_bytes: 0,
    }
}
