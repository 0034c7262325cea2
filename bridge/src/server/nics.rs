//! The RDMA devices a server serves from, and which one serves each region.
//!
//! A server opens every device it is told to (`--device` more than once, or `all`), each with
//! its own protection domain and memory-window probe. Each region's direct part is registered
//! on one of them, its *home*: the device the topology doctor ranks best for the region's
//! memory (a CMB or a GPU behind the same PCIe switch beats one across the host bridge), the
//! first device for memory that is not on a PCI device (host RAM, files), or the one the
//! region names. Clients learn the devices from the welcome and a region's home from its
//! listing (`nic`), and connect their QP to the home of what they open; a handle on a QP of
//! another device moves its bytes through bounce buffers (the region's MR and windows live in
//! the home device's protection domain), and its open says so.

use std::net::{IpAddr, Ipv4Addr};

use peermem::topology::{Extra, Sysfs, Topology};
use peermem::Provider;
use verbs::{Context, ProtectionDomain};

use super::config::SharingPolicy;
use super::session::Refusal;
use super::windows::{self, Sharing};
use crate::error::{Error, Result};
use crate::protocol::{ErrorCode, ServerNic};

/// One device a server serves from.
#[derive(Debug)]
pub(super) struct Nic {
    pub(super) ctx: Context,
    /// Its protection domain: the registrations of the regions at home here and, with memory
    /// windows, the QPs and staging buffers of the connections on it.
    pub(super) pd: ProtectionDomain,
    /// How clients reach the direct parts of the regions at home here.
    pub(super) sharing: Sharing,
    /// The IPv4 address of the RoCE v2 GID its QPs use by default.
    pub(super) addr: Option<Ipv4Addr>,
    /// Staging slot buffers (registered in `pd` for memory windows) no connection holds:
    /// registered once, at start, and reused by every connection's staged fetches.
    pub(super) slots: std::sync::Mutex<Vec<verbs::RegisteredBuffer>>,
}

impl Nic {
    pub(super) fn name(&self) -> &str {
        self.ctx.name()
    }
}

/// The devices, the first one the primary (what `--device` named first).
#[derive(Debug)]
pub(super) struct Nics(Vec<Nic>);

impl Nics {
    /// Open `names` (none: the first device with an active port), each with its protection
    /// domain, and probe memory windows on each (unless `policy` asks for registrations per
    /// connection).
    pub(super) async fn open(names: &[String], policy: SharingPolicy) -> Result<Nics> {
        let mut out: Vec<Nic> = Vec::new();
        let wanted: Vec<Option<&str>> = if names.is_empty() {
            vec![None]
        } else {
            names.iter().map(|n| Some(n.as_str())).collect()
        };
        for name in wanted {
            let ctx = Context::open(name)?;
            if out.iter().any(|n| n.name() == ctx.name()) {
                return Err(Error::Config(format!(
                    "RDMA device {} is named twice",
                    ctx.name()
                )));
            }
            let pd = ProtectionDomain::new(&ctx)?;
            let sharing = match policy {
                SharingPolicy::Auto => windows::probe(&pd).await,
                SharingPolicy::PerConnection => {
                    Sharing::PerConnection("--sharing per-connection".into())
                }
            };
            let addr = ctx.info().preferred_gid().and_then(|(_, g)| g.ipv4);
            tracing::info!(
                device = ctx.name(),
                ?addr,
                sharing = sharing.describe(),
                "serving from"
            );
            out.push(Nic {
                ctx,
                pd,
                sharing,
                addr,
                slots: std::sync::Mutex::new(Vec::new()),
            });
        }
        Ok(Nics(out))
    }

    /// The first device.
    pub(super) fn primary(&self) -> &Nic {
        &self.0[0]
    }

    pub(super) fn get(&self, i: usize) -> &Nic {
        &self.0[i]
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Nic> {
        self.0.iter()
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|n| n.name() == name)
    }

    fn names(&self) -> String {
        self.0.iter().map(Nic::name).collect::<Vec<_>>().join(", ")
    }

    /// What the welcome announces: every device with its address, when there is more than one
    /// (a client of a one-device server needs none of it).
    pub(super) fn announce(&self) -> Vec<ServerNic> {
        if self.0.len() < 2 {
            return Vec::new();
        }
        self.0
            .iter()
            .map(|n| ServerNic {
                name: n.name().to_string(),
                addr: n.addr,
            })
            .collect()
    }

    /// The device for a connection's QP: the one the client asked for; else the one whose
    /// address carries the control connection; else the first.
    pub(super) fn for_connection(
        &self,
        asked: Option<&str>,
        local_ip: Option<IpAddr>,
    ) -> std::result::Result<usize, Refusal> {
        if let Some(name) = asked {
            return self.index_of(name).ok_or_else(|| {
                (
                    ErrorCode::BadRequest,
                    format!(
                        "this server has no RDMA device '{name}'; it serves from: {}",
                        self.names()
                    ),
                )
            });
        }
        Ok(self
            .0
            .iter()
            .position(|n| n.addr.map(IpAddr::V4) == local_ip && local_ip.is_some())
            .unwrap_or(0))
    }

    /// The device that serves a region's direct part, and why (empty with one device):
    /// `named` (the region's `nic` option), else the topology's first for its PCI device,
    /// else the first device.
    pub(super) fn home(
        &self,
        provider: &dyn Provider,
        named: Option<&str>,
        sysfs: &std::path::Path,
    ) -> Result<(usize, String)> {
        if let Some(name) = named {
            let i = self.index_of(name).ok_or_else(|| {
                Error::Config(format!(
                    "the region asks for RDMA device '{name}' (nic={name}), which this server \
                     does not serve from ({})",
                    self.names()
                ))
            })?;
            return Ok((
                i,
                format!("served from {name}, as the region asks (nic={name})"),
            ));
        }
        Ok(self.ranked_home(provider, sysfs))
    }

    fn ranked_home(&self, provider: &dyn Provider, sysfs: &std::path::Path) -> (usize, String) {
        if self.0.len() < 2 {
            return (0, String::new());
        }
        let first = self.primary().name();
        let Some(bdf) = provider.pci_device() else {
            return (
                0,
                format!(
                    "served from {first} (the first device: the memory is not on a PCI device)"
                ),
            );
        };
        let topo = Topology::read(&Sysfs::new(sysfs), &Extra::default());
        let report = topo.report();
        let among: Vec<&str> = self.0.iter().map(Nic::name).collect();
        let ranked = report.nics_for(&bdf, &among);
        let Some(best) = ranked.first() else {
            return (
                0,
                format!(
                    "served from {first} (the topology does not place {bdf} relative to the \
                     served devices)"
                ),
            );
        };
        let i = self.index_of(&best.rdma_device).unwrap_or(0);
        (
            i,
            format!(
                "served from {}: the topology ranks it first for {bdf} ({} {}{})",
                best.rdma_device,
                best.path.map_or("-", |c| c.as_str()),
                best.verdict.as_str(),
                ranked
                    .get(1)
                    .map(|p| format!(
                        "; next: {} {} {}",
                        p.rdma_device,
                        p.path.map_or("-", |c| c.as_str()),
                        p.verdict.as_str()
                    ))
                    .unwrap_or_default()
            ),
        )
    }
}

/// What an open on a QP of device `here` sees of a region whose direct part is registered on
/// another device: every byte through bounce buffers, and why.
pub(super) fn elsewhere(
    info: &crate::protocol::RegionInfo,
    here: &str,
) -> crate::protocol::RegionInfo {
    let home = info.nic.as_deref().unwrap_or("another device");
    let mut out = info.clone();
    out.path = crate::protocol::DataPath::Bounce;
    out.strategy = None;
    out.extents = vec![crate::protocol::Extent {
        offset: 0,
        len: info.size,
        path: crate::protocol::DataPath::Bounce,
    }];
    out.reason = format!(
        "{}; this connection's QP is on {here}, and the direct part is registered on {home}: \
         this handle moves its bytes through bounce buffers (connect on {home} for one-sided \
         access)",
        info.reason
    );
    out
}
