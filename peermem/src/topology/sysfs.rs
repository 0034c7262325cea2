//! Reading a sysfs tree under any root, remembering what was read so that exactly those files
//! and links can be copied into a capture that replays the same answers.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

/// One thing read from the tree, by its path relative to the root.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Read {
    Dir(PathBuf),
    Link(PathBuf),
    File(PathBuf),
    /// A file seen only in a directory listing: replayed as an empty file unless read too.
    Entry(PathBuf),
}

/// The file a capture leaves in each directory that would otherwise be empty: version control
/// and archives drop empty directories, and a replay must still find them. Sysfs itself has no
/// names starting with a dot, so listings skip them.
pub const KEEP_FILE: &str = ".keep";

/// A sysfs tree at `root` (`/sys`, or a fixture or capture directory).
#[derive(Debug)]
pub struct Sysfs {
    root: PathBuf,
    seen: Option<Mutex<BTreeSet<Read>>>,
}

impl Sysfs {
    /// The tree at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs {
            root: root.into(),
            seen: None,
        }
    }

    /// The tree at `root`, remembering every file, link and directory read.
    pub fn recording(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs {
            root: root.into(),
            seen: Some(Mutex::new(BTreeSet::new())),
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether this is the running system's `/sys`.
    pub fn is_live(&self) -> bool {
        self.root == Path::new("/sys")
    }

    fn note(&self, r: Read) {
        if let Some(s) = &self.seen {
            s.lock().unwrap_or_else(|p| p.into_inner()).insert(r);
        }
    }

    /// `rel` with every symlink resolved, relative to the root; `None` when a component is
    /// missing or a link leads out of the tree.
    pub fn resolve(&self, rel: impl AsRef<Path>) -> Option<PathBuf> {
        let mut todo: Vec<OsString> = Vec::new();
        push_components(&mut todo, rel.as_ref())?;
        todo.reverse();
        let mut out = PathBuf::new();
        let mut hops = 0;
        while let Some(c) = todo.pop() {
            if c == ".." {
                if !out.pop() {
                    return None;
                }
                continue;
            }
            let cand = out.join(&c);
            let md = fs::symlink_metadata(self.root.join(&cand)).ok()?;
            if md.file_type().is_symlink() {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                let target = fs::read_link(self.root.join(&cand)).ok()?;
                self.note(Read::Link(cand));
                let mut t = Vec::new();
                push_components(&mut t, &target)?;
                for c in t.into_iter().rev() {
                    todo.push(c);
                }
            } else {
                out = cand;
            }
        }
        // The target exists: a capture must have it too.
        if self.seen.is_some() && !out.as_os_str().is_empty() {
            if self.root.join(&out).is_dir() {
                self.note(Read::Dir(out.clone()));
            } else {
                self.note(Read::Entry(out.clone()));
            }
        }
        Some(out)
    }

    /// The bytes of a file.
    pub fn read(&self, rel: impl AsRef<Path>) -> Option<Vec<u8>> {
        let p = self.resolve(rel)?;
        let data = fs::read(self.root.join(&p)).ok()?;
        self.note(Read::File(p));
        Some(data)
    }

    /// A file's text, trimmed.
    pub fn text(&self, rel: impl AsRef<Path>) -> Option<String> {
        self.read(rel)
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
    }

    /// A hexadecimal file (`0x8086`).
    pub fn hex(&self, rel: impl AsRef<Path>) -> Option<u32> {
        let t = self.text(rel)?;
        u32::from_str_radix(t.trim_start_matches("0x"), 16).ok()
    }

    /// The names in a directory, sorted (empty when it does not exist).
    pub fn list(&self, rel: impl AsRef<Path>) -> Vec<String> {
        let Some(p) = self.resolve(rel) else {
            return Vec::new();
        };
        let Ok(rd) = fs::read_dir(self.root.join(&p)) else {
            return Vec::new();
        };
        self.note(Read::Dir(p.clone()));
        let mut names: Vec<String> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        // Every entry, so that a capture lists the same names.
        for n in &names {
            let child = p.join(n);
            match fs::symlink_metadata(self.root.join(&child)).map(|m| m.file_type()) {
                Ok(t) if t.is_symlink() => self.note(Read::Link(child)),
                Ok(t) if t.is_dir() => self.note(Read::Dir(child)),
                Ok(_) => self.note(Read::Entry(child)),
                Err(_) => {}
            }
        }
        names
    }

    /// Whether `rel` exists (following links).
    pub fn exists(&self, rel: impl AsRef<Path>) -> bool {
        match self.resolve(rel) {
            Some(p) => {
                let is_dir = self.root.join(&p).is_dir();
                self.note(if is_dir { Read::Dir(p) } else { Read::File(p) });
                true
            }
            None => false,
        }
    }

    /// Copy every file, link and directory read so far into `dir`, so that a `Sysfs` at `dir`
    /// answers the same. Returns how many entries were written.
    pub fn capture_into(&self, dir: &Path) -> io::Result<usize> {
        let Some(seen) = &self.seen else {
            return Err(io::Error::other("this tree was not opened for recording"));
        };
        let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut n = 0;
        for r in &seen {
            match r {
                Read::Dir(p) => fs::create_dir_all(dir.join(p))?,
                Read::Link(p) => {
                    let target = fs::read_link(self.root.join(p))?;
                    let at = dir.join(p);
                    if let Some(parent) = at.parent() {
                        fs::create_dir_all(parent)?;
                    }
                    if fs::symlink_metadata(&at).is_err() {
                        std::os::unix::fs::symlink(&target, &at)?;
                    }
                }
                Read::Entry(p) => {
                    let at = dir.join(p);
                    if fs::symlink_metadata(&at).is_err() {
                        if let Some(parent) = at.parent() {
                            fs::create_dir_all(parent)?;
                        }
                        fs::write(&at, b"")?;
                    }
                }
                Read::File(p) => {
                    let at = dir.join(p);
                    if let Some(parent) = at.parent() {
                        fs::create_dir_all(parent)?;
                    }
                    // Some sysfs files are readable by root only: copy what was readable.
                    match fs::read(self.root.join(p)) {
                        Ok(data) => fs::write(&at, data)?,
                        Err(e) => {
                            return Err(io::Error::new(e.kind(), format!("{}: {e}", p.display())))
                        }
                    }
                }
            }
            n += 1;
        }
        mark_empty_dirs(dir)?;
        Ok(n)
    }
}

/// Put a [`KEEP_FILE`] into every directory under `dir` that has no entries (links are not
/// followed), so that the tree survives a round trip through git or tar.
pub fn mark_empty_dirs(dir: &Path) -> io::Result<()> {
    let mut empty = true;
    for e in fs::read_dir(dir)? {
        let e = e?;
        empty = false;
        if e.file_type()?.is_dir() {
            mark_empty_dirs(&e.path())?;
        }
    }
    if empty {
        fs::write(dir.join(KEEP_FILE), b"")?;
    }
    Ok(())
}

/// Append the normal components of `p` (and `..`); `None` for absolute paths (a link that
/// leaves the tree).
fn push_components(out: &mut Vec<OsString>, p: &Path) -> Option<()> {
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n.to_os_string()),
            Component::ParentDir => out.push(OsString::from("..")),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("p2p-sysfs-{}-{}", std::process::id(), rand_name()));
        fs::create_dir_all(d.join("devices/pci0000:00/0000:00:01.0/0000:01:00.0")).unwrap();
        fs::write(
            d.join("devices/pci0000:00/0000:00:01.0/0000:01:00.0/vendor"),
            "0x8086\n",
        )
        .unwrap();
        fs::write(d.join("devices/pci0000:00/0000:00:01.0/vendor"), "0x1b36\n").unwrap();
        fs::create_dir_all(d.join("bus/pci/devices")).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0",
            d.join("bus/pci/devices/0000:01:00.0"),
        )
        .unwrap();
        std::os::unix::fs::symlink("/etc", d.join("bus/pci/devices/escape")).unwrap();
        d
    }

    fn rand_name() -> u64 {
        use std::time::{SystemTime, UNIX_EPOCH};
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    }

    #[test]
    fn resolves_links_inside_the_tree_and_refuses_escapes() {
        let d = tree();
        let s = Sysfs::new(&d);
        assert_eq!(
            s.resolve("bus/pci/devices/0000:01:00.0/..").unwrap(),
            PathBuf::from("devices/pci0000:00/0000:00:01.0")
        );
        assert_eq!(s.hex("bus/pci/devices/0000:01:00.0/vendor"), Some(0x8086));
        assert!(s.resolve("bus/pci/devices/escape").is_none());
        assert!(s.resolve("../etc").is_none());
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_capture_replays_exactly_what_was_read() {
        let d = tree();
        let s = Sysfs::recording(&d);
        assert_eq!(s.list("bus/pci/devices"), vec!["0000:01:00.0", "escape"]);
        assert_eq!(
            s.text("bus/pci/devices/0000:01:00.0/vendor").unwrap(),
            "0x8086"
        );
        assert_eq!(s.list("devices/pci0000:00"), vec!["0000:00:01.0"]);
        let cap = d.with_extension("cap");
        s.capture_into(&cap).unwrap();
        let r = Sysfs::new(&cap);
        assert_eq!(r.list("devices/pci0000:00"), vec!["0000:00:01.0"]);
        // Its own vendor file was never read, so it is not there.
        assert_eq!(
            r.list("devices/pci0000:00/0000:00:01.0"),
            vec!["0000:01:00.0"]
        );
        assert_eq!(
            r.text("bus/pci/devices/0000:01:00.0/vendor").unwrap(),
            "0x8086"
        );
        // Not read, so not captured.
        assert!(r.text("devices/pci0000:00/0000:00:01.0/vendor").is_none());
        // A directory that was listed but is empty keeps a marker that listings do not show.
        fs::create_dir_all(d.join("class/iommu")).unwrap();
        assert!(s.list("class/iommu").is_empty());
        fs::remove_dir_all(&cap).unwrap();
        s.capture_into(&cap).unwrap();
        assert!(cap.join("class/iommu").join(KEEP_FILE).exists());
        assert!(Sysfs::new(&cap).exists("class/iommu"));
        assert!(Sysfs::new(&cap).list("class/iommu").is_empty());
        fs::remove_dir_all(d).unwrap();
        fs::remove_dir_all(cap).unwrap();
    }
}
