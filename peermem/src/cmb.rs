//! NVMe controller memory buffers (and any other PCI memory) published through P2PDMA:
//! `/sys/bus/pci/devices/BDF/p2pmem/{size,available,published,allocate}` (Linux ≥ 6.2 for the
//! userspace `allocate` file). An allocation is an `mmap(MAP_SHARED)` of `allocate` at offset 0;
//! the memory goes back to the device's pool when the mapping is gone.

use std::fs::{File, OpenOptions};
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use verbs::SharedMemory;

use crate::error::Error;
use crate::provider::{check_range, Provider};

/// A PCI device that may publish peer memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct P2pDevice {
    /// PCI address, `DDDD:BB:DD.F`.
    pub bdf: String,
    /// The NVMe controller name, when the device is one (`nvme0`).
    pub nvme: Option<String>,
    /// `/sys/bus/pci/devices/BDF` under the sysfs root in use.
    pub dir: PathBuf,
}

/// What `p2pmem/` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pMemInfo {
    /// Bytes of peer memory the device exposes.
    pub size: u64,
    /// Bytes not yet allocated.
    pub available: u64,
    /// Whether it is published for allocation by others (and userspace).
    pub published: bool,
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether `s` looks like a PCI address (with or without the domain).
fn normalise_bdf(s: &str) -> Option<String> {
    let full = if s.matches(':').count() == 1 {
        format!("0000:{s}")
    } else {
        s.to_string()
    };
    let b = full.as_bytes();
    let ok = full.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && full
            .chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit());
    ok.then(|| full.to_ascii_lowercase())
}

/// Find the PCI device named by `sel` (`0000:03:00.0`, `03:00.0` or `nvme0`) under `sysfs`.
pub fn find_device(sysfs: &Path, sel: &str) -> Result<P2pDevice, Error> {
    let (bdf, nvme) = if let Some(bdf) = normalise_bdf(sel) {
        // name the controller if it is one
        let nvme = std::fs::read_dir(sysfs.join("bus/pci/devices").join(&bdf).join("nvme"))
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned());
        (bdf, nvme)
    } else if sel.starts_with("nvme")
        && sel[4..].chars().all(|c| c.is_ascii_digit())
        && sel.len() > 4
    {
        let link = sysfs.join("class/nvme").join(sel).join("device");
        let target = std::fs::read_link(&link).map_err(|_| Error::Unavailable {
            what: format!("NVMe controller {sel}"),
            reason: format!("{} does not exist", link.display()),
            fix: "list controllers with `ls /sys/class/nvme` (is the nvme driver loaded?)".into(),
        })?;
        let bdf = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .and_then(|n| normalise_bdf(&n))
            .ok_or_else(|| Error::Unavailable {
                what: format!("NVMe controller {sel}"),
                reason: format!(
                    "it is not a PCI device ({} -> {})",
                    link.display(),
                    target.display()
                ),
                fix: "only PCIe NVMe controllers have a CMB".into(),
            })?;
        (bdf, Some(sel.to_string()))
    } else {
        return Err(Error::InvalidArgument(format!(
            "'{sel}' is neither a PCI address (0000:03:00.0) nor an NVMe controller (nvme0)"
        )));
    };
    let dir = sysfs.join("bus/pci/devices").join(&bdf);
    if !dir.exists() {
        return Err(Error::Unavailable {
            what: format!("PCI device {bdf}"),
            reason: format!("{} does not exist", dir.display()),
            fix: "list PCI devices with `lspci -D`".into(),
        });
    }
    Ok(P2pDevice { bdf, nvme, dir })
}

/// Where the running kernel's configuration can be read, if anywhere.
fn kernel_config(sysfs: &Path) -> Option<(PathBuf, String)> {
    // only for the live system: a replayed sysfs tree says nothing about this kernel
    if sysfs != Path::new("/sys") {
        return None;
    }
    let release = read_trim(Path::new("/proc/sys/kernel/osrelease"))?;
    for p in [
        PathBuf::from(format!("/boot/config-{release}")),
        PathBuf::from(format!("/usr/lib/modules/{release}/config")),
        PathBuf::from(format!("/lib/modules/{release}/build/.config")),
    ] {
        if let Ok(s) = std::fs::read_to_string(&p) {
            return Some((p, s));
        }
    }
    None
}

/// Whether any PCI device under `sysfs` publishes `p2pmem/`.
fn any_p2pmem(sysfs: &Path) -> bool {
    std::fs::read_dir(sysfs.join("bus/pci/devices"))
        .map(|d| d.flatten().any(|e| e.path().join("p2pmem").is_dir()))
        .unwrap_or(false)
}

impl P2pDevice {
    fn name(&self) -> String {
        match &self.nvme {
            Some(n) => format!("{} ({n})", self.bdf),
            None => self.bdf.clone(),
        }
    }

    /// Read `p2pmem/`, or explain precisely why there is none.
    pub fn p2pmem(&self, sysfs: &Path) -> Result<P2pMemInfo, Error> {
        let p = self.dir.join("p2pmem");
        let what = format!("peer memory (P2PDMA) of {}", self.name());
        if !p.is_dir() {
            let config = kernel_config(sysfs);
            let (reason, fix) = match &config {
                Some((path, cfg)) if !cfg.lines().any(|l| l == "CONFIG_PCI_P2PDMA=y") => (
                    format!("kernel lacks CONFIG_PCI_P2PDMA (not set in {})", path.display()),
                    "boot a kernel built with CONFIG_PCI_P2PDMA=y (Linux >= 6.2 for userspace allocation)".to_string(),
                ),
                _ if !any_p2pmem(sysfs) => (
                    format!(
                        "kernel lacks CONFIG_PCI_P2PDMA: no PCI device has a p2pmem/ directory{}",
                        if config.is_none() { " (the kernel config is not readable to confirm)" } else { "" }
                    ),
                    "boot a kernel built with CONFIG_PCI_P2PDMA=y (Linux >= 6.2 for userspace allocation); \
                     dmesg shows 'failed to register the CMB' from nvme when it is missing".to_string(),
                ),
                _ => (
                    format!("{} has no p2pmem/: the device exposes no CMB (or its driver did not publish it)", self.dir.display()),
                    if self.nvme.is_some() {
                        "use an NVMe controller with a controller memory buffer (CMBSZ != 0; `nvme show-regs`)".to_string()
                    } else {
                        "only devices whose driver calls pci_p2pdma_add_resource have peer memory".to_string()
                    },
                ),
            };
            return Err(Error::Unavailable { what, reason, fix });
        }
        let num = |f: &str| -> Result<u64, Error> {
            read_trim(&p.join(f))
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| Error::Unavailable {
                    what: what.clone(),
                    reason: format!("{} is unreadable", p.join(f).display()),
                    fix: "run as root".into(),
                })
        };
        Ok(P2pMemInfo {
            size: num("size")?,
            available: num("available")?,
            published: num("published")? != 0,
        })
    }
}

/// `len` bytes of peer memory allocated from a PCI device's P2PDMA pool and mapped.
#[derive(Debug)]
pub struct CmbMemory {
    dev: P2pDevice,
    info: P2pMemInfo,
    mem: Arc<SharedMemory>,
    len: u64,
}

impl CmbMemory {
    /// Allocate `len` bytes (rounded up to whole pages) from `sel` (`BDF` or `nvmeN`), with
    /// sysfs at `sysfs` (normally `/sys`).
    pub fn allocate(sysfs: &Path, sel: &str, len: u64) -> Result<CmbMemory, Error> {
        let dev = find_device(sysfs, sel)?;
        let info = dev.p2pmem(sysfs)?;
        let what = format!("{len} bytes of peer memory from {}", dev.name());
        if !info.published {
            return Err(Error::Unavailable {
                what,
                reason: "the device's p2pmem is not published (p2pmem/published is 0)".into(),
                fix: "its driver keeps the memory for itself; nothing to do from userspace".into(),
            });
        }
        let page = crate::udmabuf::page_size() as u64;
        let rounded = len
            .checked_add(page - 1)
            .map(|v| v / page * page)
            .filter(|&v| v > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("bad size {len}")))?;
        if rounded > info.available {
            return Err(Error::Unavailable {
                what,
                reason: format!(
                    "only {} of its {} bytes are available",
                    info.available, info.size
                ),
                fix: "ask for less, or free other allocations of this device".into(),
            });
        }
        let path = dev.dir.join("p2pmem/allocate");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Unavailable {
                what: what.clone(),
                reason: format!("cannot open {}: {e}", path.display()),
                fix: if e.kind() == std::io::ErrorKind::NotFound {
                    "userspace allocation needs Linux >= 6.2".into()
                } else {
                    "run as root".into()
                },
            })?;
        let n = usize::try_from(rounded)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        let mem = map(&file, n).map_err(|e| Error::Unavailable {
            what,
            reason: format!("mmap of {} failed: {e}", path.display()),
            fix: "check dmesg; the pool may be fragmented or the kernel older than 6.2".into(),
        })?;
        tracing::info!(device = %dev.bdf, bytes = rounded, "allocated peer memory");
        Ok(CmbMemory {
            dev,
            info,
            mem: Arc::new(mem),
            len,
        })
    }

    /// The device.
    pub fn device(&self) -> &P2pDevice {
        &self.dev
    }

    /// The pool as it was before this allocation.
    pub fn pool(&self) -> P2pMemInfo {
        self.info
    }
}

fn map(file: &File, len: usize) -> Result<SharedMemory, verbs::Error> {
    SharedMemory::map_device(file, len, true, "cmb")
}

impl Provider for CmbMemory {
    fn kind(&self) -> &'static str {
        "cmb"
    }
    fn pci_device(&self) -> Option<String> {
        Some(self.dev.bdf.clone())
    }
    fn describe(&self) -> String {
        format!(
            "{} bytes of peer memory (P2PDMA) of {} ({} bytes in its pool)",
            self.len,
            self.dev.name(),
            self.info.size
        )
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn writable(&self) -> bool {
        true
    }
    fn mapping(&self) -> Option<(&Arc<SharedMemory>, u64)> {
        Some((&self.mem, 0))
    }
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }
    fn copy_engine(&self) -> &'static str {
        "CPU copy from the p2pmem mapping"
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        check_range("CMB allocation", offset, out.len() as u64, self.len)?;
        Ok(self.mem.read_at(offset, out)?)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        check_range("CMB allocation", offset, data.len() as u64, self.len)?;
        Ok(self.mem.write_at(offset, data)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "p2p-cmb-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        let dev = d.join("bus/pci/devices/0000:03:00.0");
        std::fs::create_dir_all(dev.join("nvme/nvme1")).unwrap();
        std::fs::create_dir_all(d.join("bus/pci/devices/0000:00:02.0")).unwrap();
        std::fs::create_dir_all(d.join("class/nvme/nvme1")).unwrap();
        std::os::unix::fs::symlink(
            "../../../bus/pci/devices/0000:03:00.0",
            d.join("class/nvme/nvme1/device"),
        )
        .unwrap();
        d
    }

    #[test]
    fn bdf_forms() {
        assert_eq!(normalise_bdf("03:00.0").as_deref(), Some("0000:03:00.0"));
        assert_eq!(
            normalise_bdf("0000:3A:00.1").as_deref(),
            Some("0000:3a:00.1")
        );
        assert_eq!(normalise_bdf("nvme0"), None);
        assert_eq!(normalise_bdf("0000:03:00"), None);
    }

    #[test]
    fn selects_by_bdf_or_controller_and_explains_missing_p2pmem() {
        let root = tree();
        let by_name = find_device(&root, "nvme1").unwrap();
        assert_eq!(by_name.bdf, "0000:03:00.0");
        let by_bdf = find_device(&root, "03:00.0").unwrap();
        assert_eq!(by_bdf.nvme.as_deref(), Some("nvme1"));
        // no device anywhere has p2pmem/: the kernel lacks P2PDMA
        let e = by_bdf.p2pmem(&root).unwrap_err().to_string();
        assert!(e.contains("kernel lacks CONFIG_PCI_P2PDMA"), "{e}");
        // another device has it: this one has no CMB
        let other = root.join("bus/pci/devices/0000:00:02.0/p2pmem");
        std::fs::create_dir_all(&other).unwrap();
        let e = by_bdf.p2pmem(&root).unwrap_err().to_string();
        assert!(e.contains("exposes no CMB"), "{e}");
        // published pool
        let p = root.join("bus/pci/devices/0000:03:00.0/p2pmem");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("size"), "33554432\n").unwrap();
        std::fs::write(p.join("available"), "4096\n").unwrap();
        std::fs::write(p.join("published"), "1\n").unwrap();
        let info = by_bdf.p2pmem(&root).unwrap();
        assert_eq!(
            info,
            P2pMemInfo {
                size: 32 << 20,
                available: 4096,
                published: true
            }
        );
        let e = CmbMemory::allocate(&root, "nvme1", 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("only 4096 of its 33554432 bytes are available"),
            "{e}"
        );
        std::fs::write(p.join("published"), "0\n").unwrap();
        let e = CmbMemory::allocate(&root, "nvme1", 4096)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not published"), "{e}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn unknown_devices_are_named() {
        let root = tree();
        let e = find_device(&root, "nvme7").unwrap_err().to_string();
        assert!(
            e.contains("nvme7") && e.contains("/sys/class/nvme") || e.contains("class/nvme"),
            "{e}"
        );
        let e = find_device(&root, "0000:09:00.0").unwrap_err().to_string();
        assert!(e.contains("lspci"), "{e}");
        assert!(matches!(
            find_device(&root, "sda"),
            Err(Error::InvalidArgument(_))
        ));
        let _ = std::fs::remove_dir_all(&root);
    }
}
