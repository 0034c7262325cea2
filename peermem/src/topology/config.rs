//! PCI configuration space, as the `config` file of a device gives it: the PCIe port type,
//! and the ACS and ATS extended capabilities.
//!
//! Unprivileged reads of `config` return only the first 64 bytes; capabilities then cannot be
//! seen and the answer is "unknown", never a guess.

use serde::Serialize;

/// How much of the configuration space could be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    /// 4096 bytes: PCIe extended space included.
    Extended,
    /// 256 bytes: a conventional PCI function (no extended space).
    Standard,
    /// Only the header (an unprivileged read): capabilities unknown.
    HeaderOnly,
}

/// PCIe device/port type (PCIe capability, flags bits 7:4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PortType {
    /// PCIe endpoint.
    Endpoint,
    /// Legacy PCIe endpoint.
    LegacyEndpoint,
    /// Root port of a root complex.
    RootPort,
    /// Upstream port of a switch.
    SwitchUpstream,
    /// Downstream port of a switch.
    SwitchDownstream,
    /// PCIe-to-PCI bridge.
    PcieToPci,
    /// PCI-to-PCIe bridge.
    PciToPcie,
    /// Root-complex integrated endpoint.
    RcEndpoint,
    /// Root-complex event collector.
    RcEventCollector,
    /// A type this code does not know.
    Other(u8),
}

impl PortType {
    fn from_raw(t: u8) -> PortType {
        match t {
            0 => PortType::Endpoint,
            1 => PortType::LegacyEndpoint,
            4 => PortType::RootPort,
            5 => PortType::SwitchUpstream,
            6 => PortType::SwitchDownstream,
            7 => PortType::PcieToPci,
            8 => PortType::PciToPcie,
            9 => PortType::RcEndpoint,
            10 => PortType::RcEventCollector,
            n => PortType::Other(n),
        }
    }
}

/// ACS capability and control bits (PCIe base spec 7.7.8).
pub mod acs {
    /// Source Validation.
    pub const SV: u16 = 1 << 0;
    /// Translation Blocking.
    pub const TB: u16 = 1 << 1;
    /// P2P Request Redirect.
    pub const RR: u16 = 1 << 2;
    /// P2P Completion Redirect.
    pub const CR: u16 = 1 << 3;
    /// Upstream Forwarding.
    pub const UF: u16 = 1 << 4;
    /// P2P Egress Control.
    pub const EC: u16 = 1 << 5;
    /// Direct Translated P2P.
    pub const DT: u16 = 1 << 6;
    /// The bits that make the kernel treat a bridge as redirecting P2P upstream
    /// (`pci_bridge_has_acs_redir`: RR, CR or EC).
    pub const REDIRECT: u16 = RR | CR | EC;

    /// Names of the set bits, in the order lspci prints them.
    pub fn names(bits: u16) -> Vec<&'static str> {
        [
            (SV, "SrcValid"),
            (TB, "TransBlk"),
            (RR, "ReqRedir"),
            (CR, "CmpltRedir"),
            (UF, "UpstreamFwd"),
            (EC, "EgressCtrl"),
            (DT, "DirectTrans"),
        ]
        .into_iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| n)
        .collect()
    }
}

/// What the configuration space says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// How much was readable.
    pub access: Access,
    /// PCIe port type (None: not PCIe, or unreadable).
    pub port_type: Option<PortType>,
    /// ACS capability and control registers, if the function has ACS.
    pub acs: Option<(u16, u16)>,
    /// ATS capability: whether enabled (control bit 15).
    pub ats_enabled: Option<bool>,
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes([*b.get(off)?, *b.get(off + 1)?]))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes([
        *b.get(off)?,
        *b.get(off + 1)?,
        *b.get(off + 2)?,
        *b.get(off + 3)?,
    ]))
}

impl Config {
    /// Parse a `config` file's bytes.
    pub fn parse(b: &[u8]) -> Config {
        let access = match b.len() {
            n if n >= 4096 => Access::Extended,
            n if n >= 256 => Access::Standard,
            _ => Access::HeaderOnly,
        };
        let mut c = Config {
            access,
            port_type: None,
            acs: None,
            ats_enabled: None,
        };
        if access == Access::HeaderOnly {
            return c;
        }
        // Standard capability list (status bit 4), starting at 0x34.
        let status = u16_at(b, 0x06).unwrap_or(0);
        if status & 0x10 != 0 {
            let mut p = usize::from(b[0x34] & 0xfc);
            let mut guard = 0;
            while (0x40..256).contains(&p) && guard < 48 {
                let id = b[p];
                if id == 0x10 {
                    let flags = u16_at(b, p + 2).unwrap_or(0);
                    c.port_type = Some(PortType::from_raw(((flags >> 4) & 0xf) as u8));
                }
                p = usize::from(b[p + 1] & 0xfc);
                guard += 1;
            }
        }
        if access == Access::Extended && c.port_type.is_some() {
            let mut p = 0x100;
            let mut guard = 0;
            while p >= 0x100 && guard < 96 {
                let Some(h) = u32_at(b, p) else { break };
                if h == 0 || h == 0xffff_ffff {
                    break;
                }
                match h & 0xffff {
                    0x000d => {
                        c.acs = Some((u16_at(b, p + 4).unwrap_or(0), u16_at(b, p + 6).unwrap_or(0)))
                    }
                    0x000f => c.ats_enabled = Some(u16_at(b, p + 6).unwrap_or(0) & 0x8000 != 0),
                    _ => {}
                }
                p = (h >> 20) as usize & 0xffc;
                guard += 1;
            }
        }
        c
    }
}

/// Build a configuration space (for fixtures and tests): a PCIe function of `port_type`
/// (raw PCIe type), with ACS `(cap, ctrl)` and ATS `enabled` when given.
pub fn synthesize(
    vendor: u16,
    device: u16,
    class: u32,
    port_type: Option<u8>,
    acs: Option<(u16, u16)>,
    ats: Option<bool>,
) -> Vec<u8> {
    let mut b = vec![0u8; if port_type.is_some() { 4096 } else { 256 }];
    b[0..2].copy_from_slice(&vendor.to_le_bytes());
    b[2..4].copy_from_slice(&device.to_le_bytes());
    b[9] = class as u8;
    b[10] = (class >> 8) as u8;
    b[11] = (class >> 16) as u8;
    let bridge = class >> 8 == 0x0604;
    b[0x0e] = if bridge { 1 } else { 0 };
    if let Some(t) = port_type {
        b[0x06] = 0x10; // capability list
        b[0x34] = 0x40;
        b[0x40] = 0x10; // PCIe capability
        b[0x41] = 0x00;
        b[0x42..0x44].copy_from_slice(&((u16::from(t) << 4) | 2).to_le_bytes());
        let mut caps: Vec<(u16, [u8; 4])> = Vec::new();
        if let Some((cap, ctrl)) = acs {
            let mut v = [0u8; 4];
            v[0..2].copy_from_slice(&cap.to_le_bytes());
            v[2..4].copy_from_slice(&ctrl.to_le_bytes());
            caps.push((0x000d, v));
        }
        if let Some(en) = ats {
            let ctrl: u16 = if en { 0x8000 } else { 0 };
            let mut v = [0u8; 4];
            v[2..4].copy_from_slice(&ctrl.to_le_bytes());
            caps.push((0x000f, v));
        }
        let mut at = 0x100usize;
        for (i, (id, body)) in caps.iter().enumerate() {
            let next = if i + 1 < caps.len() { at + 0x10 } else { 0 };
            let h: u32 = u32::from(*id) | (1 << 16) | ((next as u32) << 20);
            b[at..at + 4].copy_from_slice(&h.to_le_bytes());
            b[at + 4..at + 8].copy_from_slice(body);
            at += 0x10;
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_port_type_acs_and_ats() {
        let b = synthesize(
            0x1b36,
            0x000c,
            0x060400,
            Some(4),
            Some((0x5f, acs::SV | acs::RR | acs::CR | acs::UF)),
            None,
        );
        let c = Config::parse(&b);
        assert_eq!(c.access, Access::Extended);
        assert_eq!(c.port_type, Some(PortType::RootPort));
        let (cap, ctrl) = c.acs.unwrap();
        assert_eq!(cap, 0x5f);
        assert_ne!(ctrl & acs::REDIRECT, 0);
        assert_eq!(
            acs::names(ctrl),
            vec!["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]
        );
        assert_eq!(c.ats_enabled, None);
        let nic = Config::parse(&synthesize(
            0x15b3,
            0x101b,
            0x020000,
            Some(0),
            None,
            Some(true),
        ));
        assert_eq!(nic.port_type, Some(PortType::Endpoint));
        assert_eq!(nic.ats_enabled, Some(true));
        assert_eq!(nic.acs, None);
    }

    #[test]
    fn an_unprivileged_read_knows_nothing_and_a_loop_ends() {
        let c = Config::parse(&[0u8; 64]);
        assert_eq!(c.access, Access::HeaderOnly);
        assert_eq!(c.port_type, None);
        // A capability list pointing at itself terminates.
        let mut b = synthesize(1, 2, 0x010802, Some(0), None, None);
        b[0x41] = 0x40;
        let h: u32 = 0x000b | (0x100 << 20);
        b[0x100..0x104].copy_from_slice(&h.to_le_bytes());
        let c = Config::parse(&b);
        assert_eq!(c.port_type, Some(PortType::Endpoint));
    }
}
