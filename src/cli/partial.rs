//! The record beside a file that a striped fetch is writing (`FILE.p2p-rdma-partial`): which
//! parts of the range are still to fetch, saved once a second and after each try, removed once
//! the fetch is done. A striped fetch sizes its file first and writes it in several places, so
//! the file's size does not say what it holds; `fetch --continue` reads the record instead
//! (what the record says is then checked against the server's checksum, like every kept part).

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
