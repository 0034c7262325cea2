//! What two RC QPs exchange to connect: the endpoint (LID, GID, QPN, PSN, MTU), its checks,
//! and the path MTU both ends agree on.

use std::net::Ipv6Addr;

use serde::{Deserialize, Serialize};
use sideway::ibverbs::device_context::Mtu;

use crate::error::{Error, Result};

/// Everything the peer needs to connect its QP to ours (exchanged over the caller's control
/// connection; [`QueuePair::connect`](crate::QueuePair::connect) checks every field, whatever carried it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID the QP sends from.
    pub gid: Ipv6Addr,
    /// QP number.
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Active path MTU of our port, in bytes.
    pub mtu: u32,
}

impl Endpoint {
    /// Refuse what no QP can connect to: a QPN or PSN over 24 bits, an MTU that is not one of
    /// the five path MTUs. Peers send endpoints over the network: this is checked before any
    /// field reaches the device.
    pub fn check(&self) -> Result<()> {
        if self.qpn > 0xff_ffff {
            return Err(Error::InvalidArgument(format!(
                "peer endpoint: QPN {:#x} has more than 24 bits",
                self.qpn
            )));
        }
        if self.psn > 0xff_ffff {
            return Err(Error::InvalidArgument(format!(
                "peer endpoint: PSN {:#x} has more than 24 bits",
                self.psn
            )));
        }
        if !IB_MTUS.contains(&self.mtu) {
            return Err(Error::InvalidArgument(format!(
                "peer endpoint: MTU {} is not 256, 512, 1024, 2048 or 4096",
                self.mtu
            )));
        }
        Ok(())
    }
}

/// The path MTUs InfiniBand defines (RoCE carries them in Ethernet frames), smallest first.
pub const IB_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

pub(crate) fn mtu_enum(bytes: u32) -> Mtu {
    match bytes {
        0..=256 => Mtu::Mtu256,
        257..=512 => Mtu::Mtu512,
        513..=1024 => Mtu::Mtu1024,
        1025..=2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// The path MTU two ends agree on: the smaller one, as one of the IB MTU sizes.
pub fn negotiate_mtu(local: u32, remote: u32) -> u32 {
    let m = local.min(remote);
    IB_MTUS.into_iter().rev().find(|&x| x <= m).unwrap_or(256)
}
pub(crate) fn rand_psn() -> u32 {
    // no crypto needed: just not always 0, so that stale packets of an old QP are not accepted
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() as u32) & 0xff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_endpoints_are_checked_before_they_reach_the_device() {
        let ok = Endpoint {
            lid: 0,
            gid: std::net::Ipv6Addr::LOCALHOST,
            qpn: 0xff_ffff,
            psn: 0xff_ffff,
            mtu: 4096,
        };
        assert!(ok.check().is_ok());
        for (bad, why) in [
            (Endpoint { qpn: 1 << 24, ..ok }, "QPN"),
            (Endpoint { psn: 1 << 24, ..ok }, "PSN"),
            (Endpoint { mtu: 1500, ..ok }, "MTU 1500"),
            (Endpoint { mtu: 0, ..ok }, "MTU 0"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn mtu_negotiation_takes_the_smaller_ib_size() {
        assert_eq!(negotiate_mtu(4096, 1024), 1024);
        assert_eq!(negotiate_mtu(4096, 4096), 4096);
        assert_eq!(negotiate_mtu(1500, 9000), 1024);
        assert_eq!(negotiate_mtu(100, 4096), 256);
        assert_eq!(mtu_enum(1024), Mtu::Mtu1024);
        assert_eq!(mtu_enum(4096), Mtu::Mtu4096);
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..100 {
            assert!(rand_psn() <= 0xff_ffff);
        }
    }
}
