//! Connection bootstrap over a TCP side channel: both ends send their [`Endpoint`] (LID, GID,
//! QPN, PSN, MTU), connect their QP to the other's, then exchange a "ready" byte so that neither
//! posts before the other can receive.
//!
//! The codec is pure (bytes in, values out); [`exchange`] and [`ready`] do the I/O.

use std::net::Ipv6Addr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::qp::{Endpoint, QueuePair};

/// Magic at the start of every endpoint record.
pub const MAGIC: [u8; 4] = *b"P2PQ";
/// Version of the record layout.
pub const VERSION: u16 = 1;
/// Size of an encoded endpoint.
pub const ENDPOINT_LEN: usize = 36;
const READY: u8 = 0x52;

/// Why an endpoint record was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not our protocol.
    #[error("not a p2p-rdma endpoint record (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// Other version.
    #[error("peer speaks bootstrap version {peer}, this build speaks {VERSION}")]
    Version {
        /// The peer's version.
        peer: u16,
    },
    /// Wrong length.
    #[error("endpoint record is {0} bytes, expected {ENDPOINT_LEN}")]
    Length(usize),
    /// PSN over 24 bits or MTU not an IB size.
    #[error("invalid field: {0}")]
    Field(&'static str),
}

/// Encode an endpoint (big-endian).
pub fn encode(ep: &Endpoint) -> [u8; ENDPOINT_LEN] {
    let mut b = [0u8; ENDPOINT_LEN];
    b[0..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_be_bytes());
    b[6..8].copy_from_slice(&ep.lid.to_be_bytes());
    b[8..24].copy_from_slice(&ep.gid.octets());
    b[24..28].copy_from_slice(&ep.qpn.to_be_bytes());
    b[28..32].copy_from_slice(&ep.psn.to_be_bytes());
    b[32..36].copy_from_slice(&ep.mtu.to_be_bytes());
    b
}

/// Decode and validate an endpoint.
pub fn decode(b: &[u8]) -> Result<Endpoint, DecodeError> {
    if b.len() < 6 {
        return Err(DecodeError::Length(b.len()));
    }
    let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(DecodeError::Version { peer: version });
    }
    if b.len() != ENDPOINT_LEN {
        return Err(DecodeError::Length(b.len()));
    }
    let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let gid: [u8; 16] = b[8..24].try_into().expect("16 bytes");
    let ep = Endpoint {
        lid: u16::from_be_bytes([b[6], b[7]]),
        gid: Ipv6Addr::from(gid),
        qpn: u32_at(24),
        psn: u32_at(28),
        mtu: u32_at(32),
    };
    if ep.psn > 0xff_ffff {
        return Err(DecodeError::Field("PSN has more than 24 bits"));
    }
    if ep.qpn > 0xff_ffff {
        return Err(DecodeError::Field("QPN has more than 24 bits"));
    }
    if ![256, 512, 1024, 2048, 4096].contains(&ep.mtu) {
        return Err(DecodeError::Field(
            "MTU is not 256, 512, 1024, 2048 or 4096",
        ));
    }
    Ok(ep)
}

/// How long to wait for the peer during bootstrap.
pub const TIMEOUT: Duration = Duration::from_secs(30);

fn boot_err(peer: &str, reason: impl Into<String>, source: Option<std::io::Error>) -> Error {
    Error::Bootstrap {
        peer: peer.to_string(),
        reason: reason.into(),
        source,
    }
}

/// Send our endpoint and receive the peer's.
pub async fn exchange<S>(stream: &mut S, local: &Endpoint, peer: &str) -> Result<Endpoint>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let io = async {
        stream.write_all(&encode(local)).await?;
        stream.flush().await?;
        let mut buf = [0u8; ENDPOINT_LEN];
        stream.read_exact(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = match tokio::time::timeout(TIMEOUT, io).await {
        Err(_) => {
            return Err(boot_err(
                peer,
                format!("no endpoint record within {}s", TIMEOUT.as_secs()),
                None,
            ))
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(boot_err(
                peer,
                "the peer closed the connection before sending its endpoint",
                Some(e),
            ))
        }
        Ok(Err(e)) => return Err(boot_err(peer, "I/O error", Some(e))),
        Ok(Ok(b)) => b,
    };
    decode(&buf).map_err(|e| boot_err(peer, e.to_string(), None))
}

/// Tell the peer our QP is connected and wait until it says the same.
pub async fn ready<S>(stream: &mut S, peer: &str) -> Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let io = async {
        stream.write_all(&[READY]).await?;
        stream.flush().await?;
        let mut b = [0u8; 1];
        stream.read_exact(&mut b).await?;
        Ok::<_, std::io::Error>(b[0])
    };
    match tokio::time::timeout(TIMEOUT, io).await {
        Err(_) => Err(boot_err(peer, "the peer did not report ready", None)),
        Ok(Err(e)) => Err(boot_err(peer, "I/O error while waiting for ready", Some(e))),
        Ok(Ok(READY)) => Ok(()),
        Ok(Ok(b)) => Err(boot_err(
            peer,
            format!("unexpected ready byte {b:#04x}"),
            None,
        )),
    }
}

/// The whole dance for one QP: exchange endpoints, connect, wait for the peer. Returns the
/// peer's endpoint.
pub async fn connect_qp<S>(qp: &QueuePair, stream: &mut S, peer: &str) -> Result<Endpoint>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let remote = exchange(stream, &qp.endpoint(), peer).await?;
    qp.connect(&remote)?;
    ready(stream, peer).await?;
    Ok(remote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ep() -> Endpoint {
        Endpoint {
            lid: 0,
            gid: "::ffff:10.77.0.1".parse().unwrap(),
            qpn: 17,
            psn: 0xabcdef,
            mtu: 1024,
        }
    }

    #[test]
    fn roundtrip() {
        let e = ep();
        assert_eq!(decode(&encode(&e)).unwrap(), e);
    }

    #[test]
    fn rejects_garbage_and_versions() {
        let mut b = encode(&ep());
        b[4..6].copy_from_slice(&2u16.to_be_bytes());
        assert_eq!(decode(&b), Err(DecodeError::Version { peer: 2 }));
        assert!(matches!(
            decode(b"GET / HTTP/1.1\r\n\r\n"),
            Err(DecodeError::BadMagic(_))
        ));
        assert_eq!(decode(&[1, 2]), Err(DecodeError::Length(2)));
        let mut b = encode(&ep());
        b[32..36].copy_from_slice(&1500u32.to_be_bytes());
        assert!(matches!(decode(&b), Err(DecodeError::Field(_))));
        let mut b = encode(&ep());
        b[28..32].copy_from_slice(&0x0100_0000u32.to_be_bytes());
        assert!(matches!(decode(&b), Err(DecodeError::Field(_))));
    }

    #[tokio::test]
    async fn exchange_over_a_duplex_pipe() {
        let (mut a, mut b) = tokio::io::duplex(128);
        let ea = ep();
        let eb = Endpoint {
            qpn: 99,
            psn: 1,
            ..ep()
        };
        let (ra, rb) = tokio::join!(exchange(&mut a, &ea, "b"), exchange(&mut b, &eb, "a"));
        assert_eq!(ra.unwrap(), eb);
        assert_eq!(rb.unwrap(), ea);
        let (x, y) = tokio::join!(ready(&mut a, "b"), ready(&mut b, "a"));
        x.unwrap();
        y.unwrap();
    }

    #[tokio::test]
    async fn peer_that_hangs_up_is_reported() {
        let (mut a, b) = tokio::io::duplex(128);
        drop(b);
        let e = exchange(&mut a, &ep(), "10.0.0.2:7000").await.unwrap_err();
        let s = e.to_string();
        assert!(s.contains("10.0.0.2:7000"), "{s}");
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn valid_endpoints_roundtrip(lid: u16, gid: [u8; 16], qpn in 0u32..0x100_0000, psn in 0u32..0x100_0000, m in 0usize..5) {
            let e = Endpoint { lid, gid: Ipv6Addr::from(gid), qpn, psn, mtu: [256, 512, 1024, 2048, 4096][m] };
            prop_assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
    }
}
