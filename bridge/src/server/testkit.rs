//! A fake region table, a model of the session's rules, and a reader that turns arbitrary
//! bytes into requests: shared by the host tests and the fuzzers (feature `fuzzing`).

use std::collections::{HashMap, HashSet};

use super::session::{Catalog, Rules, Session, Step};
use crate::protocol::{AccessMode, DataPath, ErrorCode, Extent, Msg, RegionInfo, WireEndpoint};
use crate::token::{Scope, Token};

/// Four regions: `rw` (1 MiB, first 64 KiB direct), `ro` (read-only, all bounce), `gone`
/// (removed), `held` (like `rw`, but it holds data: puts go through the server).
#[derive(Debug)]
pub(crate) struct Fake {
    pub(crate) infos: Vec<RegionInfo>,
    pub(crate) direct: Vec<u64>,
    pub(crate) removed: Vec<bool>,
}

/// A region's description (all bounce), for tests that need one.
pub(crate) fn info(name: &str, size: u64, access: AccessMode) -> RegionInfo {
    RegionInfo {
        name: name.into(),
        size,
        access,
        kind: "host".into(),
        path: DataPath::Mixed,
        reason: String::new(),
        strategy: None,
        extents: vec![Extent {
            offset: 0,
            len: size,
            path: DataPath::Bounce,
        }],
        residency: None,
        server_puts: false,
        nic: None,
    }
}

impl Fake {
    pub(crate) fn new() -> Fake {
        Fake {
            infos: vec![
                info("rw", 1 << 20, AccessMode::ReadWrite),
                info("ro", 1 << 20, AccessMode::ReadOnly),
                info("gone", 4096, AccessMode::ReadWrite),
                RegionInfo {
                    server_puts: true,
                    ..info("held", 1 << 20, AccessMode::ReadWrite)
                },
            ],
            direct: vec![64 << 10, 0, 0, 64 << 10],
            removed: vec![false, false, true, false],
        }
    }
}

impl Catalog for Fake {
    fn find(&self, name: &str) -> Option<usize> {
        self.infos
            .iter()
            .position(|i| i.name == name)
            .filter(|&i| !self.removed[i])
    }
    fn info(&self, idx: usize) -> &RegionInfo {
        &self.infos[idx]
    }
    fn is_removed(&self, idx: usize) -> bool {
        self.removed[idx]
    }
    fn names(&self) -> Vec<String> {
        (0..self.infos.len())
            .filter(|&i| !self.removed[i])
            .map(|i| self.infos[i].name.clone())
            .collect()
    }
}

/// The limits the model checks.
pub(crate) const RULES: Rules = Rules {
    max_open: 4,
    bounce_chunk: 1 << 16,
    pull_depth: 3,
};

/// A client endpoint (the fake driver "connects" anything).
pub(crate) const ENDPOINT: WireEndpoint = WireEndpoint {
    lid: 0,
    gid: [0; 16],
    qpn: 1,
    psn: 0,
    mtu: 1024,
};

/// A session and a model of what it must allow; [`Model::apply`] panics on any disagreement.
#[derive(Debug)]
pub(crate) struct Model {
    pub(crate) session: Session<u32>,
    pub(crate) catalog: Fake,
    /// handle -> (region, writable)
    handles: HashMap<u32, (usize, bool)>,
    /// Handles that may stage fetches (the driver grants it to even regions here).
    pulls: HashSet<u32>,
    /// Staging slots the client holds.
    staged: HashSet<u32>,
    qp: bool,
    draining: bool,
}

impl Model {
    pub(crate) fn new() -> Model {
        Model::scoped(Scope::All)
    }

    /// A model of a client whose token grants `scope`.
    pub(crate) fn scoped(scope: Scope) -> Model {
        Model {
            session: Session::new(RULES, scope),
            catalog: Fake::new(),
            handles: HashMap::new(),
            pulls: HashSet::new(),
            staged: HashSet::new(),
            qp: false,
            draining: false,
        }
    }

    /// The handles open now.
    pub(crate) fn live(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.handles.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The server starts draining.
    pub(crate) fn drain(&mut self) {
        self.session.drain();
        self.draining = true;
    }

    /// Feed one request; carry out the step as a driver would; check every rule.
    pub(crate) fn apply(&mut self, m: Msg) {
        let c = &self.catalog;
        let step = self.session.step(m.clone(), c);
        match step {
            Step::Open {
                region,
                writable,
                first,
            } => {
                assert!(!self.draining, "an open while draining");
                assert!(
                    first.is_none() || !writable,
                    "a first range on an open to write"
                );
                assert!(self.handles.len() < RULES.max_open, "over the open limit");
                assert!(!c.removed[region], "a removed region opened");
                assert!(
                    !writable || c.infos[region].access == AccessMode::ReadWrite,
                    "a read-only region opened for writing"
                );
                if let Msg::Open { region: name, .. } = &m {
                    assert_eq!(&c.infos[region].name, name);
                    assert!(
                        self.session.scope().allows(name, writable),
                        "an open the token does not grant"
                    );
                }
                let pull = region % 2 == 0;
                let h =
                    self.session
                        .opened(region, writable, c.direct[region], pull, region as u32);
                assert!(
                    self.handles.insert(h, (region, writable)).is_none(),
                    "handle {h} given to two live opens"
                );
                if pull {
                    self.pulls.insert(h);
                } else {
                    self.pulls.remove(&h);
                }
                if let Some(span) = first {
                    let extents = c.infos[region].extents();
                    match self.session.stage_first(h, span, &extents, 0, c) {
                        Some(Ok(f)) => {
                            assert!(pull, "a first chunk staged on a handle without pulls");
                            assert!(self.qp, "a first chunk staged without a QP");
                            assert_eq!(f.region, region);
                            assert_eq!(f.offset, span.offset, "staged from elsewhere");
                            assert!((1..=RULES.bounce_chunk.min(span.len)).contains(&f.len));
                            assert!(f.offset >= c.direct[region], "staging a direct byte");
                            assert!(f.offset + f.len <= c.infos[region].size);
                            assert!(f.slot < RULES.pull_depth, "slot {} past the depth", f.slot);
                            assert!(self.staged.insert(f.slot), "slot {} given twice", f.slot);
                        }
                        Some(Err((code, message))) => {
                            assert!(!message.is_empty());
                            assert!(
                                !self.qp
                                    || self.staged.len() == RULES.pull_depth as usize
                                    || code != ErrorCode::Busy,
                                "busy with {} of {} slots held",
                                self.staged.len(),
                                RULES.pull_depth
                            );
                        }
                        None => {}
                    }
                }
            }
            Step::Close {
                handle,
                region,
                payload,
                last,
            } => {
                assert_eq!(self.handles.remove(&handle).map(|e| e.0), Some(region));
                self.pulls.remove(&handle);
                assert_eq!(payload, region as u32, "another handle's payload");
                assert_eq!(last, !self.handles.values().any(|e| e.0 == region));
            }
            Step::Bounce(b) => {
                let (region, writable) = self.handles[&b.handle];
                assert!(self.qp, "a bounce without a QP");
                assert_eq!(region, b.region);
                assert!(!c.removed[region]);
                assert!(b.len >= 1 && b.len <= RULES.bounce_chunk);
                assert!(
                    b.offset >= c.direct[region] || (b.to_region && c.infos[region].server_puts)
                );
                assert!(b
                    .offset
                    .checked_add(b.len)
                    .is_some_and(|e| e <= c.infos[region].size));
                assert!(
                    !b.to_region || writable,
                    "a put through a handle opened for reading"
                );
            }
            Step::Stage {
                region,
                offset,
                len,
                slot,
            } => {
                let Msg::Stage { handle, .. } = m else {
                    panic!("a stage step for {m:?}")
                };
                assert!(self.qp, "staging without a QP");
                assert_eq!(self.handles[&handle].0, region);
                assert!(
                    self.pulls.contains(&handle),
                    "staging on a handle without pulls"
                );
                assert!(!c.removed[region], "staging a removed region");
                assert!((1..=RULES.bounce_chunk).contains(&len));
                assert!(offset >= c.direct[region], "staging a direct byte");
                assert!(offset
                    .checked_add(len)
                    .is_some_and(|e| e <= c.infos[region].size));
                assert!(slot < RULES.pull_depth, "slot {slot} past the depth");
                assert!(self.staged.insert(slot), "slot {slot} given twice");
            }
            Step::Unstage(slot) => {
                assert!(
                    self.staged.remove(&slot),
                    "released slot {slot} it did not hold"
                );
            }
            Step::TcpRead {
                region,
                offset,
                len,
            }
            | Step::TcpWrite {
                region,
                offset,
                len,
            } => {
                let (Msg::TcpRead { handle, .. } | Msg::TcpWrite { handle, .. }) = m else {
                    panic!("a TCP data step for {m:?}")
                };
                let (open, writable) = self.handles[&handle];
                assert_eq!(open, region);
                assert!(!c.removed[region], "TCP data of a removed region");
                assert!((1..=RULES.bounce_chunk).contains(&len));
                assert!(offset
                    .checked_add(len)
                    .is_some_and(|e| e <= c.infos[region].size));
                if matches!(m, Msg::TcpWrite { .. }) {
                    assert!(writable, "a TCP write through a handle opened for reading");
                    assert_eq!(c.infos[region].access, AccessMode::ReadWrite);
                }
            }
            Step::Skip { len, reply } => {
                let Msg::TcpWrite { len: said, .. } = m else {
                    panic!("a skip step for {m:?}")
                };
                assert_eq!(len, said);
                assert!(len <= RULES.bounce_chunk, "skipping more than a chunk");
                assert!(matches!(reply, Msg::Error { .. }), "{reply:?}");
            }
            Step::Checksum {
                region,
                offset,
                len,
            } => {
                assert!(offset
                    .checked_add(len)
                    .is_some_and(|e| e <= c.infos[region].size));
            }
            Step::Flush {
                region,
                offset,
                len,
            } => {
                let Msg::Flush { handle, .. } = m else {
                    panic!("a flush step for {m:?}")
                };
                assert_eq!(self.handles[&handle], (region, true));
                assert!(offset
                    .checked_add(len)
                    .is_some_and(|e| e <= c.infos[region].size));
            }
            Step::Report {
                region,
                offset,
                len,
                to_region,
                ..
            } => {
                let Msg::Transferred {
                    handle,
                    offset: said,
                    ..
                } = m
                else {
                    panic!("a report step for {m:?}")
                };
                assert_eq!(offset, said);
                assert_eq!(self.handles[&handle].0, region);
                assert!(offset + len <= c.direct[region]);
                assert!(!to_region || self.handles[&handle].1);
            }
            Step::Connect(..) => {
                assert!(!self.qp, "a second QP");
                self.session.connected();
                self.qp = true;
            }
            Step::Reply(Msg::Error { code, message }) => {
                assert!(!message.is_empty());
                if let Msg::Stage { handle, .. } = m {
                    let may = self.qp
                        && self.pulls.contains(&handle)
                        && self.handles.contains_key(&handle)
                        && self.staged.len() < RULES.pull_depth as usize;
                    // a refusal of a stage that could go is one of its range or region
                    assert!(
                        !may || code != ErrorCode::Busy,
                        "busy with {} of {} slots held",
                        self.staged.len(),
                        RULES.pull_depth
                    );
                }
                if let Msg::Close { handle } = m {
                    assert!(!self.handles.contains_key(&handle));
                    assert_eq!(code, ErrorCode::NotOpen);
                }
            }
            Step::Reply(Msg::Located { nic }) => {
                let Msg::Locate { region } = &m else {
                    panic!("located answers {m:?}")
                };
                assert!(self.session.scope().sees(region), "located a hidden region");
                assert_eq!(nic, None, "the fake catalog has one NIC");
            }
            Step::Reply(other) => panic!("a reply that is not an error: {other:?}"),
            Step::List | Step::Ignore | Step::Leave => {}
        }
        assert_eq!(self.session.open_count(), self.handles.len());
        assert_eq!(
            self.session.may_leave(),
            self.draining && self.handles.is_empty()
        );
    }
}

/// Reads requests out of arbitrary bytes; values lean towards the edges (0, limits, the ends
/// of regions, live handles, `u64::MAX`).
#[derive(Debug)]
pub(crate) struct Script<'a> {
    data: &'a [u8],
    /// Handles seen so far, to aim at live ones.
    pub(crate) live: Vec<u32>,
}

impl<'a> Script<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Script<'a> {
        Script {
            data,
            live: Vec::new(),
        }
    }

    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn raw(&mut self, n: usize) -> u64 {
        let mut v = 0u64;
        for _ in 0..n {
            v = (v << 8) | u64::from(self.byte().unwrap_or(0));
        }
        v
    }

    fn u64(&mut self) -> u64 {
        match self.byte().unwrap_or(0) % 8 {
            0 => 0,
            1 => 1,
            2 => 64 << 10,
            3 => (1 << 20) - 1,
            4 => 1 << 16,
            5 => u64::MAX,
            6 => self.raw(3),
            _ => self.raw(8),
        }
    }

    fn handle(&mut self) -> u32 {
        match self.byte().unwrap_or(0) % 4 {
            0 | 1 if !self.live.is_empty() => {
                let i = self.raw(1) as usize % self.live.len();
                self.live[i]
            }
            2 => self.raw(1) as u32,
            _ => self.raw(4) as u32,
        }
    }

    /// The next request, or None at the end of the bytes.
    pub(crate) fn next_msg(&mut self) -> Option<Msg> {
        let op = self.byte()?;
        Some(match op % 16 {
            0 => Msg::Open {
                region: ["rw", "ro", "gone", "held", "x", ""][self.raw(1) as usize % 6].into(),
                write: self.raw(1) % 2 == 0,
                first: (self.raw(1) % 2 == 0).then(|| crate::protocol::Span {
                    offset: self.u64(),
                    len: self.u64(),
                }),
            },
            1 => Msg::Close {
                handle: self.handle(),
            },
            2 | 3 => Msg::Bounce {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
                to_region: self.raw(1) % 2 == 0,
                addr: self.raw(8),
                rkey: self.raw(4) as u32,
            },
            4 => Msg::Checksum {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
            },
            5 => Msg::Transferred {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
                to_region: self.raw(1) % 2 == 0,
                micros: self.raw(4),
            },
            6 => Msg::Flush {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
            },
            7 => Msg::Connect {
                endpoint: ENDPOINT,
                nic: None,
            },
            8 if self.raw(1) % 2 == 0 => Msg::List,
            8 => Msg::Locate {
                region: ["rw", "ro", "gone", "x"][self.raw(1) as usize % 4].into(),
            },
            9 => Msg::Hello {
                version: self.raw(2) as u16,
                token: Token::new("t"),
                client: String::new(),
            },
            10 => Msg::Closed {
                handle: self.handle(),
            },
            11 => Msg::TcpRead {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
            },
            12 => Msg::TcpWrite {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
            },
            14 => Msg::Stage {
                handle: self.handle(),
                offset: self.u64(),
                len: self.u64(),
            },
            15 => Msg::Unstage {
                slot: self.raw(1) as u32 % 8,
            },
            _ if self.raw(1) % 2 == 0 => Msg::KeepAlive,
            _ => Msg::Bye,
        })
    }
}
