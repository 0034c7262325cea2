//! The region spec grammar (`NAME=KIND:ARGS[,OPTION=VALUE]...`), driven by one table of kinds
//! and options that both the parser and the help text read, so the two cannot drift.
//!
//! Pure: no IO, no device. `serve --region`, the config file, `doctor` and `bench --mem` all
//! parse through [`RegionSpec::from_str`].

use std::path::PathBuf;
use std::str::FromStr;

use peermem::plan::{P2pPolicy, RegChoice};

use crate::size::parse_size;

/// Where a region's memory comes from, as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionSource {
    /// Zeroed host RAM.
    Host {
        /// Bytes.
        size: u64,
        /// From huge pages.
        huge: bool,
    },
    /// A file, mapped shared.
    File {
        /// Path.
        path: PathBuf,
        /// Registered without remote write; puts are refused.
        read_only: bool,
    },
    /// Peer memory (an NVMe CMB) allocated through P2PDMA.
    Cmb {
        /// PCI address (`0000:03:00.0`, `03:00.0`) or NVMe controller (`nvme0`).
        device: String,
        /// Bytes.
        size: u64,
    },
    /// Block storage (an NVMe namespace, or a file) read and written by direct I/O, staged
    /// in host memory or, with `,via=cmb:DEV:SIZE`, in a CMB.
    Nvme {
        /// Block device (or file).
        path: PathBuf,
        /// `(offset, len)` on the device (default: all of it).
        range: Option<(u64, u64)>,
        /// Puts are refused.
        read_only: bool,
    },
    /// A dma-buf from the built-in exporter (memfd + /dev/udmabuf).
    DmaBuf {
        /// Bytes.
        size: u64,
    },
    /// Device-private memory emulated by an unmapped memfd (`devpriv:memfd:SIZE`): per-unit
    /// residency, a P2P window of `,window=SIZE` (udmabuf exports), `,policy=migrate|copy`.
    DevPriv {
        /// Bytes.
        size: u64,
    },
    /// Real device-private pages of the kernel's HMM test driver (`devpriv:hmm:SIZE`): anonymous
    /// memory migrated to `/dev/hmm_dmirror0`'s device memory at start.
    DevPrivHmm {
        /// Bytes.
        size: u64,
    },
    /// Device memory of a GPU as device-private memory (`devpriv:cuda:GPU:SIZE`): copy engine
    /// cuMemcpy, a P2P window of `,window=SIZE` (dma-buf exports of 64 KiB units).
    DevPrivCuda {
        /// CUDA ordinal.
        gpu: u32,
        /// Bytes.
        size: u64,
    },
    /// Device memory of a GPU (CUDA ordinal), exported as a dma-buf where the driver can.
    Cuda {
        /// CUDA ordinal.
        gpu: u32,
        /// Bytes.
        size: u64,
    },
}

/// Per-region settings that override the server's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionOptions {
    /// P2P policy for this region.
    pub p2p: Option<P2pPolicy>,
    /// Registration strategies for this region.
    pub reg: Option<RegChoice>,
    /// Serve only the first this many bytes direct, the rest through bounce buffers (like a
    /// device whose P2P window is smaller than its memory). For `devpriv` regions: the size
    /// of the device's P2P window.
    pub window: Option<u64>,
    /// `devpriv` regions: migrate units to host RAM on access, or copy and leave them.
    pub policy: Option<peermem::hmm::Policy>,
    /// On a server with several RDMA devices: register the direct part on this one (default:
    /// the one the topology ranks best for the memory's PCI device, else the first).
    pub nic: Option<String>,
    /// `nvme` regions: stage through a ring in this CMB (`via=cmb:DEV:SIZE`).
    pub via: Option<peermem::block::ViaCmb>,
}

/// `NAME=KIND:ARGS[,OPTION=VALUE]...`; `p2p-rdma serve --help` lists every form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Name clients use.
    pub name: String,
    /// Memory.
    pub source: RegionSource,
    /// Overrides.
    pub options: RegionOptions,
}

/// One form of a kind, for the help text.
#[derive(Debug, Clone, Copy)]
pub struct FormDoc {
    /// `NAME=...` syntax.
    pub syntax: &'static str,
    /// What it serves.
    pub help: &'static str,
}

/// A memory kind: its keyword, its forms, and the parser of what follows `KIND:`.
struct Kind {
    keyword: &'static str,
    forms: &'static [FormDoc],
    parse: fn(&str, &str) -> Result<RegionSource, String>,
}

/// An option after the memory (`,KEY=VALUE`).
struct OptionKind {
    key: &'static str,
    values: &'static str,
    help: &'static str,
    apply: fn(&mut RegionOptions, &str, &str) -> Result<(), String>,
}

const KINDS: &[Kind] = &[
    Kind {
        keyword: "host",
        forms: &[
            FormDoc { syntax: "NAME=host:SIZE", help: "zeroed RAM (K/M/G suffixes)" },
            FormDoc { syntax: "NAME=host:SIZE:huge", help: "from huge pages (vm.nr_hugepages must be set)" },
        ],
        parse: |name, arg| {
            let (size, huge) = match arg.strip_suffix(":huge") {
                Some(sz) => (sz, true),
                None => (arg, false),
            };
            Ok(RegionSource::Host { size: size_of(name, size)?, huge })
        },
    },
    Kind {
        keyword: "file",
        forms: &[
            FormDoc {
                syntax: "NAME=file:PATH",
                help: "a file, mapped shared: puts change the file (it must not shrink while served)",
            },
            FormDoc {
                syntax: "NAME=file:PATH:ro",
                help: "read-only: registered without remote write, so the NIC itself refuses puts",
            },
        ],
        parse: |name, arg| {
            let (path, read_only) = match arg.strip_suffix(":ro") {
                Some(p) => (p, true),
                None => (arg, false),
            };
            if path.is_empty() {
                return Err(format!("region '{name}': empty file path"));
            }
            Ok(RegionSource::File { path: PathBuf::from(path), read_only })
        },
    },
    Kind {
        keyword: "cmb",
        forms: &[FormDoc {
            syntax: "NAME=cmb:DEV:SIZE",
            help: "peer memory of a PCI device through P2PDMA (an NVMe CMB): DEV is a PCI address \
                   (0000:03:00.0) or a controller (nvme0); needs Linux >= 6.2 with CONFIG_PCI_P2PDMA, as root",
        }],
        parse: |name, arg| {
            let bad = || format!("region '{name}': expected cmb:BDF:SIZE or cmb:nvmeN:SIZE");
            let (dev, size) = arg.rsplit_once(':').ok_or_else(bad)?;
            if dev.is_empty() {
                return Err(bad());
            }
            Ok(RegionSource::Cmb { device: dev.to_string(), size: size_of(name, size)? })
        },
    },
    Kind {
        keyword: "nvme",
        forms: &[
            FormDoc {
                syntax: "NAME=nvme:BLOCKDEV[:OFFSET:LEN]",
                help: "an NVMe namespace (or any block device, or a file on a file system with \
                       O_DIRECT), whole or OFFSET:LEN of it (multiples of its logical block size): \
                       fetches read it by direct I/O into staging buffers, puts write it and are \
                       flushed before they are acknowledged; ,via=cmb:DEV:SIZE stages in a CMB",
            },
            FormDoc {
                syntax: "NAME=nvme:BLOCKDEV[:OFFSET:LEN]:ro",
                help: "read-only: puts are refused, the device is opened read-only",
            },
        ],
        parse: |name, arg| {
            let (arg, read_only) = match arg.strip_suffix(":ro") {
                Some(a) => (a, true),
                None => (arg, false),
            };
            let mut parts = arg.rsplitn(3, ':');
            let (last, mid, first) = (parts.next(), parts.next(), parts.next());
            let (path, range) = match (first, mid, last) {
                (Some(p), Some(off), Some(len))
                    if parse_size(off).is_ok() && parse_size(len).is_ok() =>
                {
                    let off = parse_size(off).map_err(|e| format!("region '{name}': offset: {e}"))?;
                    (p, Some((off, size_of(name, len)?)))
                }
                _ => (arg, None),
            };
            if path.is_empty() {
                return Err(format!(
                    "region '{name}': expected nvme:BLOCKDEV[:OFFSET:LEN] (e.g. nvme:/dev/nvme1n1:0:16G)"
                ));
            }
            Ok(RegionSource::Nvme { path: PathBuf::from(path), range, read_only })
        },
    },
    Kind {
        keyword: "dmabuf",
        forms: &[FormDoc {
            syntax: "NAME=dmabuf:SIZE",
            help: "a dma-buf from the built-in exporter (memfd + /dev/udmabuf)",
        }],
        parse: |name, arg| Ok(RegionSource::DmaBuf { size: size_of(name, arg)? }),
    },
    Kind {
        keyword: "devpriv",
        forms: &[
            FormDoc {
                syntax: "NAME=devpriv:memfd:SIZE",
                help: "device-private memory emulated by a memfd this process never maps: copy engine \
                       pread/pwrite, a P2P window of udmabuf exports (,window=SIZE), ,policy=copy (bounce, \
                       stays on the device) or migrate (to host RAM)",
            },
            FormDoc {
                syntax: "NAME=devpriv:hmm:SIZE",
                help: "real device-private pages of the kernel's HMM test driver (test_hmm, \
                       /dev/hmm_dmirror0): migrated to the device at start; ODP preferred",
            },
            FormDoc {
                syntax: "NAME=devpriv:cuda:GPU:SIZE",
                help: "GPU memory as device-private memory (--features cuda): copy engine cuMemcpy, \
                       a P2P window of dma-buf exports of 64 KiB units (,window=SIZE)",
            },
        ],
        parse: |name, arg| match arg.split_once(':') {
            Some(("memfd", size)) => Ok(RegionSource::DevPriv { size: size_of(name, size)? }),
            Some(("hmm", size)) => Ok(RegionSource::DevPrivHmm { size: size_of(name, size)? }),
            Some(("cuda", rest)) => {
                let (gpu, size) = gpu_and_size(name, "devpriv:cuda", rest)?;
                Ok(RegionSource::DevPrivCuda { gpu, size: size_of(name, size)? })
            }
            _ => Err(format!(
                "region '{name}': expected devpriv:memfd:SIZE (emulated device memory), \
                 devpriv:hmm:SIZE (the kernel's HMM test driver) or devpriv:cuda:GPU:SIZE (GPU memory)"
            )),
        },
    },
    Kind {
        keyword: "cuda",
        forms: &[FormDoc {
            syntax: "NAME=cuda:GPU:SIZE",
            help: "memory of CUDA GPU number GPU (build with --features cuda; libcuda.so.1 is loaded \
                   at run time), registered through its dma-buf export (needs NVIDIA's open kernel \
                   modules) and otherwise served by cuMemcpy through bounce buffers",
        }],
        parse: |name, arg| {
            let (gpu, size) = gpu_and_size(name, "cuda", arg)?;
            Ok(RegionSource::Cuda { gpu, size: size_of(name, size)? })
        },
    },
];

const OPTIONS: &[OptionKind] = &[
    OptionKind {
        key: "p2p",
        values: "required|preferred|disabled",
        help: "this region's P2P policy (overrides --p2p)",
        apply: |o, name, v| {
            o.p2p = Some(v.parse().map_err(|e| format!("region '{name}': {e}"))?);
            Ok(())
        },
    },
    OptionKind {
        key: "reg",
        values: "auto|pinned|odp|dmabuf",
        help: "this region's registration strategies (overrides --reg)",
        apply: |o, name, v| {
            o.reg = Some(v.parse().map_err(|e| format!("region '{name}': {e}"))?);
            Ok(())
        },
    },
    OptionKind {
        key: "window",
        values: "SIZE",
        help: "only the first SIZE bytes direct, the rest through bounce buffers (devpriv: the \
               device's P2P window)",
        apply: |o, name, v| {
            let w = parse_size(v).map_err(|e| format!("region '{name}': window: {e}"))?;
            if w == 0 {
                return Err(format!(
                    "region '{name}': window must be at least 1 byte (use p2p=disabled for no direct part)"
                ));
            }
            o.window = Some(w);
            Ok(())
        },
    },
    OptionKind {
        key: "nic",
        values: "DEVICE",
        help: "serve the direct part from this RDMA device of the server (several devices: \
               default the one nearest the memory, else the first)",
        apply: |o, name, v| {
            if v.is_empty() {
                return Err(format!("region '{name}': nic needs a device name"));
            }
            o.nic = Some(v.to_string());
            Ok(())
        },
    },
    OptionKind {
        key: "via",
        values: "cmb:DEV:SIZE",
        help: "nvme regions: stage through a SIZE-byte ring in the CMB of DEV (PCI address or \
               nvmeN): the SSD reads into it peer to peer (proved at start; each leg falls back \
               to host memory on its own, with the kernel's reason)",
        apply: |o, name, v| {
            let bad =
                || format!("region '{name}': expected via=cmb:DEV:SIZE (e.g. via=cmb:nvme0:64M)");
            let rest = v.strip_prefix("cmb:").ok_or_else(bad)?;
            let (dev, size) = rest.rsplit_once(':').ok_or_else(bad)?;
            if dev.is_empty() {
                return Err(bad());
            }
            o.via = Some(peermem::block::ViaCmb {
                device: dev.to_string(),
                size: size_of(name, size)?,
            });
            Ok(())
        },
    },
    OptionKind {
        key: "policy",
        values: "migrate|copy",
        help: "devpriv regions: migrate units to host RAM on access, or copy and leave them",
        apply: |o, name, v| {
            o.policy = Some(v.parse().map_err(|e| format!("region '{name}': {e}"))?);
            Ok(())
        },
    },
];

fn size_of(name: &str, v: &str) -> Result<u64, String> {
    let size = parse_size(v).map_err(|e| format!("region '{name}': {e}"))?;
    if size == 0 {
        return Err(format!("region '{name}': size must be at least 1 byte"));
    }
    Ok(size)
}

/// `GPU:SIZE` of a `KIND:GPU:SIZE` spec: the CUDA ordinal, and the size text.
fn gpu_and_size<'a>(name: &str, kind: &str, arg: &'a str) -> Result<(u32, &'a str), String> {
    let bad = || {
        format!("region '{name}': expected {kind}:GPU:SIZE (GPU: a CUDA device number such as 0)")
    };
    let (gpu, size) = arg.split_once(':').ok_or_else(bad)?;
    Ok((gpu.parse().map_err(|_| bad())?, size))
}

/// Trailing `,KEY=VALUE` options whose key is in [`OPTIONS`]; a comma that starts no known
/// option stays in the memory's text (a file path may contain commas).
fn parse_options(name: &str, rest: &str) -> Result<(String, RegionOptions), String> {
    let mut parts: Vec<&str> = rest.split(',').collect();
    let mut o = RegionOptions::default();
    while parts.len() > 1 {
        let last = parts[parts.len() - 1];
        let Some((k, v)) = last.split_once('=') else {
            break;
        };
        let Some(opt) = OPTIONS.iter().find(|opt| opt.key == k) else {
            break;
        };
        (opt.apply)(&mut o, name, v)?;
        parts.pop();
    }
    Ok((parts.join(","), o))
}

impl RegionSpec {
    /// The accepted forms, for messages: every form of every kind, then the options.
    pub fn forms() -> String {
        let kinds: Vec<&str> = KINDS
            .iter()
            .flat_map(|k| k.forms.iter().map(|f| f.syntax))
            .collect();
        let opts: Vec<String> = OPTIONS
            .iter()
            .map(|o| format!(",{}={}", o.key, o.values))
            .collect();
        format!(
            "{}, optionally followed by {}",
            kinds.join(", "),
            opts.join(" ")
        )
    }

    /// The kinds and options with their explanations, for `--help` (wrapped at `width`).
    pub fn help(width: usize) -> String {
        let mut out = String::from("Region specs (NAME=KIND:ARGS[,OPTION=VALUE]...):\n");
        let col = 26;
        let mut entry = |syntax: &str, help: &str| {
            let mut first = format!("  {syntax}");
            if first.len() + 1 < col {
                first.push_str(&" ".repeat(col - first.len()));
            } else {
                out.push_str(&first);
                out.push('\n');
                first = " ".repeat(col);
            }
            let text = wrap(help, width.saturating_sub(col).max(30));
            for (i, line) in text.iter().enumerate() {
                if i == 0 {
                    out.push_str(&first);
                } else {
                    out.push_str(&" ".repeat(col));
                }
                out.push_str(line);
                out.push('\n');
            }
        };
        for k in KINDS {
            for f in k.forms {
                entry(f.syntax, f.help);
            }
        }
        for o in OPTIONS {
            entry(&format!(",{}={}", o.key, o.values), o.help);
        }
        out
    }

    /// The memory kinds' keywords.
    pub fn kinds() -> impl Iterator<Item = &'static str> {
        KINDS.iter().map(|k| k.keyword)
    }
}

/// Greedy word wrap.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for w in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + w.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(w);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

impl FromStr for RegionSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("region '{s}' has no '=': expected {}", Self::forms()))?;
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "region name '{name}' must be non-empty letters, digits, '-', '_' or '.'"
            ));
        }
        let (rest, options) = parse_options(name, rest)?;
        let (kind, arg) = rest
            .split_once(':')
            .ok_or_else(|| format!("region '{s}': expected {}", Self::forms()))?;
        let k = KINDS.iter().find(|k| k.keyword == kind).ok_or_else(|| {
            format!(
                "region '{name}': unknown kind '{kind}': expected {}",
                Self::forms()
            )
        })?;
        let source = (k.parse)(name, arg)?;
        if options.via.is_some() && !matches!(source, RegionSource::Nvme { .. }) {
            return Err(format!(
                "region '{name}': via= stages block storage: only nvme regions take it"
            ));
        }
        Ok(RegionSpec {
            name: name.to_string(),
            source,
            options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verbs::RegMode;

    #[test]
    fn nvme_specs() {
        let s: RegionSpec = "data=nvme:/dev/nvme1n1:0:16G,via=cmb:nvme0:64M"
            .parse()
            .unwrap();
        assert_eq!(
            s.source,
            RegionSource::Nvme {
                path: "/dev/nvme1n1".into(),
                range: Some((0, 16 << 30)),
                read_only: false
            }
        );
        assert_eq!(
            s.options.via,
            Some(peermem::block::ViaCmb {
                device: "nvme0".into(),
                size: 64 << 20
            })
        );
        let s: RegionSpec = "d=nvme:/dev/nvme1n1:ro".parse().unwrap();
        assert_eq!(
            s.source,
            RegionSource::Nvme {
                path: "/dev/nvme1n1".into(),
                range: None,
                read_only: true
            }
        );
        let s: RegionSpec = "d=nvme:/srv/a:b/ns.img:1M:2M:ro,via=cmb:0000:03:00.0:8M"
            .parse()
            .unwrap();
        assert_eq!(
            s.source,
            RegionSource::Nvme {
                path: "/srv/a:b/ns.img".into(),
                range: Some((1 << 20, 2 << 20)),
                read_only: true
            }
        );
        assert_eq!(s.options.via.unwrap().device, "0000:03:00.0");
        for (bad, why) in [
            ("d=nvme:", "expected nvme:BLOCKDEV"),
            ("d=nvme:/dev/x:0:0", "at least 1 byte"),
            ("d=host:1M,via=cmb:nvme0:1M", "only nvme regions"),
            ("d=nvme:/dev/x,via=nvme0:1M", "via=cmb:DEV:SIZE"),
            ("d=nvme:/dev/x,via=cmb::1M", "via=cmb:DEV:SIZE"),
            ("d=nvme:/dev/x,via=cmb:nvme0:0", "at least 1 byte"),
        ] {
            let e = bad.parse::<RegionSpec>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn region_specs() {
        assert_eq!(
            "ram=host:64M".parse::<RegionSpec>().unwrap(),
            RegionSpec {
                name: "ram".into(),
                source: RegionSource::Host {
                    size: 64 << 20,
                    huge: false
                },
                options: RegionOptions::default(),
            }
        );
        assert_eq!(
            "h=host:2M:huge".parse::<RegionSpec>().unwrap().source,
            RegionSource::Host {
                size: 2 << 20,
                huge: true
            }
        );
        assert_eq!(
            "f=file:/data/x.bin:ro"
                .parse::<RegionSpec>()
                .unwrap()
                .source,
            RegionSource::File {
                path: "/data/x.bin".into(),
                read_only: true
            }
        );
        assert_eq!(
            "f=file:/data/a:b".parse::<RegionSpec>().unwrap().source,
            RegionSource::File {
                path: "/data/a:b".into(),
                read_only: false
            }
        );
        for (bad, why) in [
            ("ram", "no '='"),
            ("=host:1M", "must be non-empty"),
            ("a b=host:1M", "must be non-empty"),
            ("r=disk:1M", "unknown kind 'disk'"),
            ("r=host:0", "at least 1 byte"),
            ("r=host:12Q", "unknown unit"),
            ("r=file:", "empty file path"),
            ("r=host", "expected NAME=host"),
            ("r=cmb:4M", "expected cmb:BDF:SIZE"),
            ("r=cmb::4M", "expected cmb:BDF:SIZE"),
            ("r=dmabuf:0", "at least 1 byte"),
            ("r=devpriv:1M", "expected devpriv:memfd:SIZE"),
            ("r=devpriv:memfd:1M,policy=move", "unknown policy 'move'"),
            ("r=devpriv:cuda:1M", "expected devpriv:cuda:GPU:SIZE"),
            ("r=devpriv:cuda:x:1M", "expected devpriv:cuda:GPU:SIZE"),
            ("r=devpriv:cuda:0:0", "at least 1 byte"),
            ("r=cuda:1G", "expected cuda:GPU:SIZE"),
            ("r=cuda:x:1G", "expected cuda:GPU:SIZE"),
            ("r=cuda:0:0", "at least 1 byte"),
            ("r=host:1M,p2p=maybe", "unknown P2P policy 'maybe'"),
            ("r=host:1M,reg=fast", "unknown registration strategy"),
            ("r=host:1M,window=0", "window must be at least 1 byte"),
            ("r=host:1M,nic=", "nic needs a device name"),
        ] {
            let e = bad.parse::<RegionSpec>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn device_specs_and_options() {
        let s: RegionSpec = "c=cmb:0000:03:00.0:16M,p2p=required".parse().unwrap();
        assert_eq!(
            s.source,
            RegionSource::Cmb {
                device: "0000:03:00.0".into(),
                size: 16 << 20
            }
        );
        assert_eq!(s.options.p2p, Some(P2pPolicy::Required));
        let s: RegionSpec = "c=cmb:nvme0:1M".parse().unwrap();
        assert_eq!(
            s.source,
            RegionSource::Cmb {
                device: "nvme0".into(),
                size: 1 << 20
            }
        );
        let s: RegionSpec = "d=devpriv:memfd:4M,window=1M,policy=migrate"
            .parse()
            .unwrap();
        assert_eq!(s.source, RegionSource::DevPriv { size: 4 << 20 });
        assert_eq!(s.options.window, Some(1 << 20));
        assert_eq!(s.options.policy, Some(peermem::hmm::Policy::Migrate));
        let s: RegionSpec = "d=devpriv:cuda:1:64M,window=8M".parse().unwrap();
        assert_eq!(
            s.source,
            RegionSource::DevPrivCuda {
                gpu: 1,
                size: 64 << 20
            }
        );
        assert_eq!(s.options.window, Some(8 << 20));
        let s: RegionSpec = "g=cuda:1:256M,reg=dmabuf".parse().unwrap();
        assert_eq!(
            s.source,
            RegionSource::Cuda {
                gpu: 1,
                size: 256 << 20
            }
        );
        assert_eq!(s.options.reg, Some(RegChoice::Only(RegMode::DmaBuf)));
        let s: RegionSpec = "d=dmabuf:2M,window=64K,reg=odp".parse().unwrap();
        assert_eq!(s.source, RegionSource::DmaBuf { size: 2 << 20 });
        assert_eq!(s.options.window, Some(64 << 10));
        assert_eq!(s.options.reg, Some(RegChoice::Only(RegMode::OnDemand)));
        let s: RegionSpec = "h=host:1M,nic=mlx5_2,p2p=required".parse().unwrap();
        assert_eq!(s.options.nic.as_deref(), Some("mlx5_2"));
        assert_eq!(s.options.p2p, Some(P2pPolicy::Required));
        // a comma that is not an option stays in the path
        let s: RegionSpec = "f=file:/data/a,b.bin:ro".parse().unwrap();
        assert_eq!(
            s.source,
            RegionSource::File {
                path: "/data/a,b.bin".into(),
                read_only: true
            }
        );
    }

    #[test]
    fn help_lists_every_kind_and_option_the_parser_takes() {
        let help = RegionSpec::help(100);
        for k in KINDS {
            assert!(
                help.contains(&format!("NAME={}:", k.keyword)),
                "{} missing:\n{help}",
                k.keyword
            );
        }
        for o in OPTIONS {
            assert!(
                help.contains(&format!(",{}=", o.key)),
                "{} missing:\n{help}",
                o.key
            );
        }
        // every syntax shown parses once its placeholders are filled in
        for f in KINDS.iter().flat_map(|k| k.forms) {
            let example = f
                .syntax
                .replace("NAME", "r")
                .replace("[:OFFSET:LEN]", ":0:4M")
                .replace("BLOCKDEV", "/dev/nvme1n1")
                .replace("SIZE", "4M")
                .replace("PATH", "/tmp/x")
                .replace("DEV", "nvme0")
                .replace("GPU", "0");
            assert!(
                example.parse::<RegionSpec>().is_ok(),
                "{} -> {example}",
                f.syntax
            );
        }
        for line in help.lines() {
            assert!(line.len() <= 100, "line too long: {line}");
        }
    }
}
