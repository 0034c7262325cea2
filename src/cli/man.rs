//! Man pages from the clap definitions (clap_mangen): the same text as `--help`.

use std::path::Path;

use anyhow::Context as _;

/// Write `p2p-rdma.1` and `p2p-rdma-SUB.1` into `dir`, or the main page to stdout.
pub(crate) fn write(cmd: clap::Command, dir: Option<&Path>) -> anyhow::Result<()> {
    let Some(dir) = dir else {
        clap_mangen::Man::new(cmd)
            .render(&mut std::io::stdout())
            .context("writing the man page")?;
        return Ok(());
    };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut pages = vec![("p2p-rdma.1".to_string(), cmd.clone())];
    for sub in cmd.get_subcommands() {
        // clap keeps command names as &'static str; this process ends right after
        let name: &'static str = Box::leak(format!("p2p-rdma-{}", sub.get_name()).into_boxed_str());
        pages.push((format!("{name}.1"), sub.clone().name(name)));
    }
    for (file, c) in pages {
        let path = dir.join(&file);
        let mut out = Vec::new();
        clap_mangen::Man::new(c)
            .render(&mut out)
            .with_context(|| format!("rendering {file}"))?;
        std::fs::write(&path, out).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("p2p-rdma: wrote {}", path.display());
    }
    Ok(())
}
