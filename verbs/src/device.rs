//! RDMA devices: listing, ports, GID tables, capabilities; opening a device context.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use serde::Serialize;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};

use crate::error::{Call, Error, Result};
use crate::ffi;

/// The kind of a GID entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum GidKind {
    /// InfiniBand (or RoCE v1: the kernel reports both as type 0).
    #[serde(rename = "IB/RoCEv1")]
    IbOrRoceV1,
    /// RoCE v1
    #[serde(rename = "RoCEv1")]
    RoceV1,
    /// RoCE v2 (UDP/IP encapsulated).
    #[serde(rename = "RoCEv2")]
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Serialize)]
pub struct GidInfo {
    /// GID index (what a QP's address vector names).
    pub index: u32,
    /// The GID as an IPv6 address.
    pub gid: Ipv6Addr,
    /// RoCE v1/v2 or IB.
    pub kind: GidKind,
    /// The netdev the GID belongs to (RoCE).
    pub netdev: Option<String>,
    /// The IPv4 address for an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub ipv4: Option<Ipv4Addr>,
}

/// A port of a device.
#[derive(Debug, Clone, Serialize)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// Logical state, e.g. "ACTIVE".
    pub state: String,
    /// Whether the port is ACTIVE.
    pub active: bool,
    /// Largest MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// MTU in use, in bytes (RoCE: follows the netdev MTU).
    pub active_mtu: u32,
    /// "Ethernet" (RoCE) or "InfiniBand".
    pub link_layer: String,
    /// LID (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// The GID table.
    pub gids: Vec<GidInfo>,
}

/// On-demand paging capabilities of a device.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct OdpCaps {
    /// `IBV_ODP_SUPPORT`
    pub supported: bool,
    /// `IBV_ODP_SUPPORT_IMPLICIT`
    pub implicit: bool,
    /// RC transport may SEND from ODP memory.
    pub rc_send: bool,
    /// RC transport may RECV into ODP memory.
    pub rc_recv: bool,
    /// RC RDMA WRITE on ODP memory.
    pub rc_write: bool,
    /// RC RDMA READ on ODP memory.
    pub rc_read: bool,
    /// Raw `general_caps`.
    pub general_caps: u64,
    /// Raw `per_transport_caps.rc_odp_caps`.
    pub rc_odp_caps: u32,
}

impl OdpCaps {
    fn from_raw(raw: ffi::RawOdpCaps) -> OdpCaps {
        OdpCaps {
            supported: raw.general_caps & 1 != 0,
            implicit: raw.general_caps & 2 != 0,
            rc_send: raw.rc_odp_caps & 1 != 0,
            rc_recv: raw.rc_odp_caps & 2 != 0,
            rc_write: raw.rc_odp_caps & 4 != 0,
            rc_read: raw.rc_odp_caps & 8 != 0,
            general_caps: raw.general_caps,
            rc_odp_caps: raw.rc_odp_caps,
        }
    }

    /// Whether an RC QP can do one-sided READ and WRITE on ODP memory.
    pub fn rc_rdma(&self) -> bool {
        self.supported && self.rc_read && self.rc_write
    }
}

/// The capabilities that matter for this project.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceCaps {
    /// Largest MR in bytes.
    pub max_mr_size: u64,
    /// Max number of MRs.
    pub max_mr: i32,
    /// Max QPs.
    pub max_qp: i32,
    /// Max work requests per queue.
    pub max_qp_wr: i32,
    /// Max CQ entries.
    pub max_cqe: i32,
    /// Max scatter/gather entries per WR.
    pub max_sge: i32,
    /// Max outstanding RDMA READ/atomic per QP as responder.
    pub max_qp_rd_atom: i32,
    /// Max outstanding RDMA READ/atomic per QP as initiator.
    pub max_qp_init_rd_atom: i32,
    /// Atomic capability: "none", "hca" or "global".
    pub atomic: &'static str,
    /// ODP support.
    pub odp: OdpCaps,
}

/// Everything known about one device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// Device name, e.g. `rxe0`, `mlx5_0`.
    pub name: String,
    /// Node GUID, `xxxx:xxxx:xxxx:xxxx`.
    pub node_guid: String,
    /// Transport, e.g. "InfiniBand" (also used by RoCE devices).
    pub transport: String,
    /// PCI vendor id (0xffffff for rxe).
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Firmware version string.
    pub fw_ver: String,
    /// Whether this is a software RDMA device (rxe, siw): its "DMA" is CPU copies in the kernel.
    pub software: bool,
    /// Capabilities.
    pub caps: DeviceCaps,
    /// Ports.
    pub ports: Vec<PortInfo>,
}

impl DeviceInfo {
    /// The first ACTIVE port with a RoCE v2 GID (preferring IPv4-mapped ones), as `(port, gid)`.
    pub fn preferred_gid(&self) -> Option<(u8, &GidInfo)> {
        self.ports
            .iter()
            .filter(|p| p.active)
            .find_map(|p| pick_gid(&p.gids).map(|g| (p.port, g)))
    }
}

/// Choose the GID a QP should use: RoCE v2 with an IPv4-mapped address first, then any RoCE v2,
/// then a non-link-local one, then anything (InfiniBand).
pub fn pick_gid(gids: &[GidInfo]) -> Option<&GidInfo> {
    gids.iter()
        .find(|g| g.kind == GidKind::RoceV2 && g.ipv4.is_some())
        .or_else(|| gids.iter().find(|g| g.kind == GidKind::RoceV2))
        .or_else(|| gids.iter().find(|g| !is_link_local(&g.gid)))
        .or_else(|| gids.first())
}

/// The GID a QP uses: the index asked for; else the RoCE v2 GID that carries the control
/// connection's address; else [`pick_gid`]'s choice.
pub(crate) fn choose_gid(
    gids: &[GidInfo],
    gid_index: Option<u32>,
    ip: Option<std::net::IpAddr>,
) -> Option<GidInfo> {
    if let Some(ix) = gid_index {
        return gids.iter().find(|g| g.index == ix).cloned();
    }
    let on_ip = ip.and_then(|ip| {
        gids.iter().find(|g| {
            g.kind == GidKind::RoceV2
                && match ip {
                    std::net::IpAddr::V4(v4) => g.ipv4 == Some(v4),
                    std::net::IpAddr::V6(v6) => g.gid == v6,
                }
        })
    });
    if let (Some(ip), None) = (ip, on_ip) {
        tracing::debug!(%ip, "no RoCE v2 GID carries the control connection's address; using the default choice");
    }
    on_ip.or_else(|| pick_gid(gids)).cloned()
}

fn is_link_local(gid: &Ipv6Addr) -> bool {
    gid.segments()[0] & 0xffc0 == 0xfe80
}

/// The IPv4 address of an IPv4-mapped GID.
pub fn gid_ipv4(gid: &Ipv6Addr) -> Option<Ipv4Addr> {
    gid.to_ipv4_mapped()
}

fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

fn port_state_name(s: PortState) -> &'static str {
    match s {
        PortState::Nop => "NOP",
        PortState::Down => "DOWN",
        PortState::Initializing => "INIT",
        PortState::Armed => "ARMED",
        PortState::Active => "ACTIVE",
        PortState::ActiveDefer => "ACTIVE_DEFER",
    }
}

fn ensure_library() -> Result<()> {
    ffi::libibverbs_loadable().map_err(|detail| Error::LibraryMissing { detail })
}

/// The device list, or `None` when the kernel has no RDMA support at all.
fn device_list() -> Result<Option<DeviceList>> {
    ensure_library()?;
    match DeviceList::new() {
        Ok(l) => Ok(Some(l)),
        Err(e) => {
            let io = io_of(&e);
            tracing::debug!(error = %e, "ibv_get_device_list failed");
            match io.raw_os_error() {
                // libibverbs says ENOSYS when /sys/class/infiniband does not exist
                Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) => Ok(None),
                _ => Err(Error::verbs(Call::GetDeviceList, "all devices", io)),
            }
        }
    }
}

const NO_KERNEL_RDMA: &str =
    "the kernel has no RDMA support loaded (no /sys/class/infiniband: no RDMA NIC driver, rdma_rxe or siw)";
const NO_DEVICES: &str =
    "the kernel lists no RDMA device (no RDMA NIC, and no rxe/siw device was added)";

/// Names of the RDMA devices on this machine (may be empty).
pub fn device_names() -> Result<Vec<String>> {
    Ok(device_list()?
        .map(|l| l.iter().map(|d| d.name()).collect())
        .unwrap_or_default())
}

/// Why there is no device, for callers that got an empty [`devices`] list.
pub fn no_device_error() -> Error {
    let sys = std::path::Path::new("/sys/class/infiniband");
    Error::NoDevice {
        detail: if sys.exists() {
            NO_DEVICES
        } else {
            NO_KERNEL_RDMA
        }
        .into(),
    }
}

/// Query every RDMA device. An empty list is not an error here; [`Context::open`] reports it.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let names = device_names()?;
    names
        .iter()
        .map(|n| Context::open(Some(n)).map(|c| c.info().clone()))
        .collect()
}

/// An open device context. Cheap to clone; PDs, CQs and QPs keep it alive.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) inner: Arc<DeviceContext>,
    info: Arc<DeviceInfo>,
}

impl Context {
    /// Open the device called `name`, or the first device with an ACTIVE port when `None`.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let list = device_list()?.ok_or_else(|| Error::NoDevice {
            detail: NO_KERNEL_RDMA.into(),
        })?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        if names.is_empty() {
            return Err(Error::NoDevice {
                detail: NO_DEVICES.into(),
            });
        }
        let candidates: Vec<usize> = match name {
            Some(n) => match names.iter().position(|x| x == n) {
                Some(i) => vec![i],
                None => {
                    return Err(Error::DeviceNotFound {
                        name: n.to_string(),
                        available: names.join(", "),
                    })
                }
            },
            None => (0..names.len()).collect(),
        };
        let mut first = None;
        for i in candidates {
            let dev = list.get(i).ok_or_else(|| Error::NoDevice {
                detail: NO_DEVICES.into(),
            })?;
            let inner = dev.open().map_err(|e| {
                let io = source_io(&e).unwrap_or_else(std::io::Error::last_os_error);
                Error::verbs(Call::OpenDevice, names[i].clone(), io)
            })?;
            let info = query_info(
                &names[i],
                &dev.guid().to_string(),
                &dev.transport_type().to_string(),
                &inner,
            )?;
            let ctx = Context {
                inner,
                info: Arc::new(info),
            };
            if name.is_some() || ctx.info.ports.iter().any(|p| p.active) {
                return Ok(ctx);
            }
            first.get_or_insert(ctx);
        }
        // no active port anywhere: return the first device; connecting will explain.
        first.ok_or_else(|| Error::NoDevice {
            detail: NO_DEVICES.into(),
        })
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// What was queried when the device was opened.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Port information, re-queried now (state and MTU can change).
    pub fn port(&self, port: u8) -> Result<PortInfo> {
        query_port(&self.info.name, &self.inner, port)
    }
}

/// Find the OS error inside one of sideway's error types. Their "kind" enums are
/// `#[error(transparent)]`, which hides the `io::Error` from `source()`, so besides walking the
/// chain this also reads the "(os error N)" that the transparent Display carries.
fn source_io(e: &(dyn std::error::Error + 'static)) -> Option<std::io::Error> {
    if let Some(mr) = e.downcast_ref::<sideway::ibverbs::memory_region::RegisterMemoryRegionError>()
    {
        if let sideway::ibverbs::memory_region::RegisterMemoryRegionErrorKind::Ibverbs(io) = &mr.0 {
            return io.raw_os_error().map(std::io::Error::from_raw_os_error);
        }
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(n) = io.raw_os_error() {
                return Some(std::io::Error::from_raw_os_error(n));
            }
        }
        if let Some(n) = os_error_in(&err.to_string()) {
            return Some(std::io::Error::from_raw_os_error(n));
        }
        cur = err.source();
    }
    None
}

fn os_error_in(s: &str) -> Option<i32> {
    let i = s.rfind("(os error ")?;
    let rest = &s[i + "(os error ".len()..];
    rest[..rest.find(')')?].parse().ok()
}

pub(crate) fn io_of(e: &(dyn std::error::Error + 'static)) -> std::io::Error {
    source_io(e).unwrap_or_else(|| std::io::Error::other(e.to_string()))
}

fn query_info(
    name: &str,
    guid: &str,
    transport: &str,
    ctx: &Arc<DeviceContext>,
) -> Result<DeviceInfo> {
    let attr = ctx
        .query_device()
        .map_err(|e| Error::verbs(Call::QueryDevice, name.to_string(), io_of(&e)))?;
    let odp = match ffi::query_odp_caps(ctx) {
        Ok(raw) => OdpCaps::from_raw(raw),
        Err(e) => {
            tracing::debug!(device = name, error = %e, "ibv_query_device_ex failed; assuming no ODP");
            OdpCaps::default()
        }
    };
    let atomic = match attr.atomic_capability() {
        sideway::ibverbs::device_context::AtomicCapability::None => "none",
        sideway::ibverbs::device_context::AtomicCapability::HostChannelAdapter => "hca",
        sideway::ibverbs::device_context::AtomicCapability::Global => "global",
    };
    let mut ports = Vec::new();
    for p in 1..=attr.phys_port_cnt() {
        ports.push(query_port(name, ctx, p)?);
    }
    let software =
        matches!(attr.vendor_id(), 0xffffff) || name.starts_with("rxe") || name.starts_with("siw");
    Ok(DeviceInfo {
        name: name.to_string(),
        node_guid: guid.to_string(),
        transport: transport.to_string(),
        vendor_id: attr.vendor_id(),
        vendor_part_id: attr.vendor_part_id(),
        fw_ver: attr.firmware_version(),
        software,
        caps: DeviceCaps {
            max_mr_size: attr.max_mr_size(),
            max_mr: attr.max_mr(),
            max_qp: attr.max_qp(),
            max_qp_wr: attr.max_qp_wr(),
            max_cqe: attr.max_cqe(),
            max_sge: attr.max_sge(),
            max_qp_rd_atom: attr.max_qp_rd_atom(),
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom(),
            atomic,
            odp,
        },
        ports,
    })
}

fn query_port(name: &str, ctx: &Arc<DeviceContext>, port: u8) -> Result<PortInfo> {
    let pa = ctx
        .query_port(port)
        .map_err(|e| Error::verbs(Call::QueryPort, format!("{name} port {port}"), io_of(&e)))?;
    let mut gids = Vec::new();
    for index in 0..pa.gid_tbl_len().max(0) as u32 {
        let Ok(entry) = ctx.query_gid_ex(port, index) else {
            continue;
        };
        let gid: Ipv6Addr = entry.gid().into();
        if gid.is_unspecified() {
            continue;
        }
        let kind = match entry.gid_type() {
            GidType::RoceV2 => GidKind::RoceV2,
            GidType::RoceV1 => GidKind::RoceV1,
            GidType::InfiniBand => GidKind::IbOrRoceV1,
        };
        gids.push(GidInfo {
            index,
            gid,
            kind,
            netdev: entry.netdev_name().ok().filter(|s| !s.is_empty()),
            ipv4: gid_ipv4(&gid),
        });
    }
    let state = pa.port_state();
    Ok(PortInfo {
        port,
        state: port_state_name(state).to_string(),
        active: state == PortState::Active,
        max_mtu: mtu_bytes(pa.max_mtu()),
        active_mtu: mtu_bytes(pa.active_mtu()),
        link_layer: match pa.link_layer() {
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Unspecified => "unspecified",
        }
        .to_string(),
        lid: pa.lid(),
        gids,
    })
}

pub(crate) fn select_port_gid(
    ctx: &crate::Context,
    port: Option<u8>,
    gid_index: Option<u32>,
    local_ip: Option<std::net::IpAddr>,
) -> Result<(u8, GidInfo)> {
    let info = ctx.info();
    let dev = ctx.name().to_string();
    let ports: Vec<_> = match port {
        Some(p) => {
            let pi = info
                .ports
                .iter()
                .find(|x| x.port == p)
                .ok_or_else(|| Error::NoGid {
                    device: dev.clone(),
                    port: p,
                    reason: format!("the device has {} port(s)", info.ports.len()),
                })?;
            vec![ctx.port(pi.port)?]
        }
        None => info
            .ports
            .iter()
            .map(|p| ctx.port(p.port))
            .collect::<Result<_>>()?,
    };
    let mut why = String::new();
    for p in &ports {
        if !p.active {
            why = format!("port state is {} (the netdev or link is down)", p.state);
            continue;
        }
        let g = choose_gid(&p.gids, gid_index, local_ip);
        match g {
            Some(g) => return Ok((p.port, g)),
            None => {
                why = match gid_index {
                    Some(ix) => format!("GID index {ix} is empty"),
                    None => "the GID table is empty (no IP address on the netdev?)".into(),
                }
            }
        }
    }
    Err(Error::NoGid {
        device: dev,
        port: port.unwrap_or(1),
        reason: if why.is_empty() {
            "no ports".into()
        } else {
            why
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(index: u32, s: &str, kind: GidKind) -> GidInfo {
        let gid: Ipv6Addr = s.parse().unwrap();
        GidInfo {
            index,
            gid,
            kind,
            netdev: Some("d0".into()),
            ipv4: gid_ipv4(&gid),
        }
    }

    #[test]
    fn the_gid_of_the_control_connections_address_wins_unless_an_index_is_given() {
        // two interfaces: the default choice is the first IPv4 RoCE v2 GID
        let t = vec![
            g(0, "fe80::1", GidKind::RoceV2),
            g(1, "::ffff:10.77.0.1", GidKind::RoceV2),
            g(2, "::ffff:10.88.0.1", GidKind::RoceV1),
            g(3, "::ffff:10.88.0.1", GidKind::RoceV2),
        ];
        let ip = |s: &str| Some(s.parse::<std::net::IpAddr>().unwrap());
        assert_eq!(choose_gid(&t, None, None).unwrap().index, 1);
        assert_eq!(choose_gid(&t, None, ip("10.88.0.1")).unwrap().index, 3);
        // an address no GID carries: the default choice
        assert_eq!(choose_gid(&t, None, ip("192.0.2.7")).unwrap().index, 1);
        // the index asked for, even a RoCE v1 one, and none when it is empty
        assert_eq!(choose_gid(&t, Some(2), ip("10.77.0.1")).unwrap().index, 2);
        assert!(choose_gid(&t, Some(9), None).is_none());
    }

    #[test]
    fn rxe_table_picks_ipv4_mapped_roce_v2() {
        // rxe: index 0 link-local, index 1 ::ffff:<IPv4>, both RoCE v2
        let t = vec![
            g(0, "fe80::7aae:faff:feb8:1785", GidKind::RoceV2),
            g(1, "::ffff:10.77.0.1", GidKind::RoceV2),
        ];
        let p = pick_gid(&t).unwrap();
        assert_eq!(p.index, 1);
        assert_eq!(p.ipv4, Some(Ipv4Addr::new(10, 77, 0, 1)));
    }

    #[test]
    fn roce_v2_beats_v1_and_link_local_is_last_resort() {
        let t = vec![
            g(0, "fe80::1", GidKind::RoceV1),
            g(1, "2001:db8::1", GidKind::RoceV1),
            g(2, "2001:db8::1", GidKind::RoceV2),
        ];
        assert_eq!(pick_gid(&t).unwrap().index, 2);
        let t = vec![
            g(0, "fe80::1", GidKind::IbOrRoceV1),
            g(1, "2001:db8::2", GidKind::IbOrRoceV1),
        ];
        assert_eq!(pick_gid(&t).unwrap().index, 1);
        assert!(pick_gid(&[]).is_none());
    }

    #[test]
    fn os_error_is_found_in_transparent_messages() {
        assert_eq!(
            os_error_in("Operation not supported (os error 95)"),
            Some(95)
        );
        assert_eq!(os_error_in("failed to register memory region"), None);
        let e = sideway::ibverbs::memory_region::RegisterMemoryRegionError::from(
            sideway::ibverbs::memory_region::RegisterMemoryRegionErrorKind::Ibverbs(
                std::io::Error::from_raw_os_error(14),
            ),
        );
        assert_eq!(io_of(&e).raw_os_error(), Some(14));
    }

    #[test]
    fn odp_caps_decode_rxe_7_3() {
        // rxe on 7.3: general_caps 0x1, rc_odp 0xff
        let c = OdpCaps::from_raw(ffi::RawOdpCaps {
            general_caps: 1,
            rc_odp_caps: 0xff,
        });
        assert!(c.supported && !c.implicit && c.rc_rdma());
        let none = OdpCaps::from_raw(ffi::RawOdpCaps::default());
        assert!(!none.supported && !none.rc_rdma());
    }
}
