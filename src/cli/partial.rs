//! The record beside a file that a striped fetch is writing (`FILE.p2p-rdma-partial`): which
//! parts of the range are still to fetch, saved every 100 ms while the stripes move and after
//! a failed try, removed once the fetch is done. A striped fetch sizes its file first and
//! writes it in several places, so the file's size does not say what it holds; `fetch
//! --continue` reads the record instead (what the record says is then checked against the
//! server's checksum, like every kept part).

use super::resume::Left;

/// The record's path for the output file `output`.
pub(crate) fn path(output: &str) -> String {
    format!("{output}.p2p-rdma-partial")
}

/// Save what `left` says is left of a fetch of `region` into `output` (written aside and
/// renamed, so that a fetch killed while saving leaves the record before). A record that
/// cannot be saved is said once, and the fetch goes on: it costs a later `--continue` only.
pub(crate) fn save(output: &str, region: &str, left: &Left, warned: &mut bool) {
    let p = path(output);
    let tmp = format!("{p}.new");
    let res = std::fs::write(&tmp, left.record(region)).and_then(|()| std::fs::rename(&tmp, &p));
    if let Err(e) = res {
        if !std::mem::replace(warned, true) {
            eprintln!(
                "p2p-rdma: cannot save {p} ({e}): a --continue of this fetch would start over"
            );
        }
    }
}

/// Remove the record of `output`, if any (a fetch done, or started afresh).
pub(crate) fn remove(output: &str) -> anyhow::Result<()> {
    let p = path(output);
    match std::fs::remove_file(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(anyhow::Error::new(e).context(format!("cannot remove {p}")))
        }
        _ => Ok(()),
    }
}

/// What the record of `output` says is left of the fetch of `region`, `len` bytes at
/// `offset`, when there is one that fits a file of `had` bytes; why it is not used is said.
pub(crate) fn load(
    output: &str,
    region: &str,
    (offset, len): (u64, u64),
    had: u64,
) -> Option<Left> {
    let p = path(output);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            eprintln!("p2p-rdma: --continue: cannot read {p} ({e}): going by the file's size");
            return None;
        }
    };
    match Left::from_record(&text, region, (offset, len)) {
        Ok(l)
            if l.kept()
                .last()
                .is_none_or(|k| k.offset - offset + k.len <= had) =>
        {
            Some(l)
        }
        Ok(_) => {
            eprintln!(
                "p2p-rdma: --continue: {p} says more was fetched than {output} holds: going by \
                 the file's size"
            );
            None
        }
        Err(why) => {
            eprintln!("p2p-rdma: --continue: {p} is not used ({why}): going by the file's size");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_record_is_loaded_back_only_for_its_fetch_and_a_file_that_holds_it() {
        let dir = std::env::temp_dir().join(format!("p2p-partial-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out.bin").display().to_string();
        let range = (4096, 8 << 20);
        assert_eq!(load(&out, "r", range, 8 << 20), None, "no record");
        let mut l = Left::new(range.0, range.1);
        let pieces = l.spread(2, 1 << 20).unwrap();
        l.wrote(&pieces, &[1 << 20, 2 << 20]);
        let mut warned = false;
        save(&out, "r", &l, &mut warned);
        assert!(!warned);
        assert!(!std::path::Path::new(&format!("{}.new", path(&out))).exists());
        // the kept parts end 6 MiB into the range: a file of that many bytes holds them
        assert_eq!(
            l.kept().last().map(|k| k.offset + k.len - range.0),
            Some(6 << 20)
        );
        assert_eq!(load(&out, "r", range, 6 << 20), Some(l.clone()));
        assert_eq!(
            load(&out, "r", range, (6 << 20) - 1),
            None,
            "a file too short"
        );
        assert_eq!(load(&out, "other", range, 8 << 20), None, "another region");
        assert_eq!(
            load(&out, "r", (0, 8 << 20), 8 << 20),
            None,
            "another range"
        );
        remove(&out).unwrap();
        remove(&out).unwrap();
        assert_eq!(load(&out, "r", range, 8 << 20), None, "removed");
        // a record that cannot be saved is said once
        let nowhere = dir.join("no/such/dir/out.bin").display().to_string();
        save(&nowhere, "r", &l, &mut warned);
        assert!(warned);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
