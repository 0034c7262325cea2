//! Which server device our QP connects to, and which of our devices carries it.
//!
//! A server that serves from several RDMA devices says so in its welcome (each device with the
//! IPv4 address of its RoCE v2 GID) and registers each region's direct part on one of them.
//! Before our QP exists, the first open asks the server which device serves the region
//! ([`Msg::Locate`]), picks our own device by the route to that device's address (the source
//! address the kernel would use, and the device whose RoCE v2 GID carries it), and connects
//! the QP there. One client has one QP: a region served from another device is then reached
//! through bounce buffers (its open says why); open it on another client for one-sided access.

use std::net::{IpAddr, Ipv4Addr};

use verbs::Context;

use super::{reply_err, Client};
use crate::error::Result;
use crate::protocol::{Msg, ServerNic};

impl Client {
    /// The server's RDMA devices, when it serves from more than one (empty otherwise).
    pub fn server_nics(&self) -> &[ServerNic] {
        &self.nics
    }

    /// The server device our QP is connected to (None: no QP yet, or a one-device server).
    pub fn server_nic(&self) -> Option<&str> {
        self.qp_nic.as_deref()
    }

    /// The server device to connect our QP to, for a first open of `region`: the one the
    /// configuration names, else the region's (asked of the server), else the server's choice.
    pub(super) async fn nic_for(&mut self, region: Option<&str>) -> Result<Option<String>> {
        if self.nics.is_empty() {
            return Ok(None);
        }
        if let Some(n) = &self.cfg.server_nic {
            return Ok(Some(n.clone()));
        }
        let Some(region) = region else {
            return Ok(None);
        };
        let m = Msg::Locate {
            region: region.to_string(),
        };
        match self.request(&m, "located").await? {
            Msg::Located { nic } => Ok(nic),
            other => Err(reply_err(&self.conn.peer, other, "located")),
        }
    }

    /// Our device for a QP that talks to server device `nic`, and the local address its GID
    /// should carry: the configured device, else the one carrying the route to that device's
    /// address, else the default one.
    pub(super) fn local_side(&mut self, nic: Option<&str>) -> Result<(Context, Option<IpAddr>)> {
        let addr = nic
            .and_then(|n| self.nics.iter().find(|x| x.name == n))
            .and_then(|x| x.addr);
        let src = addr.and_then(source_towards);
        let routed = match (&self.cfg.device, src) {
            (None, Some(ip)) => device_carrying(ip),
            _ => None,
        };
        let ctx = match (routed, self.device.take()) {
            (Some(name), Some(c)) if c.name() == name => c,
            (Some(name), _) => Context::open(Some(&name))?,
            (None, Some(c)) => c,
            (None, None) => Context::open(self.cfg.device.as_deref())?,
        };
        tracing::debug!(
            device = ctx.name(),
            server_nic = nic,
            ?src,
            "our side of the QP"
        );
        Ok((ctx, src.or(self.conn.local_ip)))
    }
}

/// The source address the kernel picks to reach `addr` (no packet is sent).
fn source_towards(addr: Ipv4Addr) -> Option<IpAddr> {
    let s = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    // RoCE v2's UDP port; connect only routes
    s.connect((addr, 4791)).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// The RDMA device with a GID that carries `ip`.
fn device_carrying(ip: IpAddr) -> Option<String> {
    let IpAddr::V4(v4) = ip else {
        return None;
    };
    verbs::devices()
        .ok()?
        .into_iter()
        .find(|d| {
            d.ports
                .iter()
                .any(|p| p.gids.iter().any(|g| g.ipv4 == Some(v4)))
        })
        .map(|d| d.name)
}
