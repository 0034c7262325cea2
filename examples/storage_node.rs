//! A storage node embedding p2p-rdma: every file in a directory is an object, served as a
//! region of its own (`NAME=file:PATH`), and the catalog follows the directory while clients
//! fetch: a new file is added ([`ServerHandle::add_region`]), a deleted one removed (clients
//! that hold it open get `Removed`, everyone else is undisturbed), a file whose size changed is
//! served at its new size with no moment in which its name is missing
//! ([`ServerHandle::replace_region`]: clients holding the old size get `Removed` and reopen).
//! Clients' puts into objects are reported as they complete
//! ([`ServerHandle::put_notices`]). Everything the node does is printed as one JSON object per
//! line on stdout, so scripts and tests can follow it.
//!
//! A file is served as soon as the node sees it, so writers put an object under a hidden name
//! (`.NAME.tmp`, ignored) and rename it into place; a file written in place can be served half
//! written and is then replaced at its final size on a later scan.
//!
//! ```text
//! cargo run --example storage_node -- LISTEN TOKEN_FILE DIR
//! cargo run --example storage_node -- 10.77.0.1:7600 token /srv/objects
//! ```
//! Fetch an object with `p2p-rdma fetch` or `examples/fetch_object.rs`.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use p2p_rdma::bridge::{RegionSpec, Server, ServerConfig, ServerHandle};
use serde_json::json;

/// How often the directory is looked at.
const SCAN: Duration = Duration::from_millis(300);

fn say(v: serde_json::Value) {
    println!("{v}");
}

/// A region name for a file name: letters, digits, `-_.`; anything else becomes `_`.
fn object_name(path: &Path) -> Option<String> {
    let n = path.file_name()?.to_string_lossy();
    if n.starts_with('.') {
        return None; // hidden files and files being written under a temporary name
    }
    Some(
        n.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect(),
    )
}

/// The objects in `dir`: name → (path, size). Empty files are not served (a region has bytes).
fn scan(dir: &Path) -> std::io::Result<BTreeMap<String, (PathBuf, u64)>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let meta = e.metadata()?;
        if !meta.is_file() || meta.len() == 0 {
            continue;
        }
        if let Some(name) = object_name(&e.path()) {
            out.insert(name, (e.path(), meta.len()));
        }
    }
    Ok(out)
}

async fn add(h: &ServerHandle, name: &str, path: &Path) {
    let spec = format!("{name}=file:{}", path.display());
    let res = match spec.parse::<RegionSpec>() {
        Ok(spec) => h.add_region(spec).await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match res {
        Ok(info) => say(json!({"event": "added", "region": name, "size": info.size,
            "path": info.path.to_string(), "why": info.reason})),
        Err(e) => say(json!({"event": "add-failed", "region": name, "error": e})),
    }
}

async fn resize(h: &ServerHandle, name: &str, path: &Path, was: u64) {
    let spec = format!("{name}=file:{}", path.display());
    let res = match spec.parse::<RegionSpec>() {
        Ok(spec) => h
            .replace_region(spec, Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match res {
        Ok((info, old)) => say(
            json!({"event": "resized", "region": name, "size": info.size,
            "was": was, "released": old.released, "path": info.path.to_string()}),
        ),
        Err(e) => say(json!({"event": "resize-failed", "region": name, "error": e})),
    }
}

async fn remove(h: &ServerHandle, name: &str) {
    match h.remove_region(name, Duration::from_secs(10)).await {
        Ok(r) => say(
            json!({"event": "removed", "region": name, "released": r.released,
            "seconds": r.seconds}),
        ),
        Err(e) => say(json!({"event": "remove-failed", "region": name, "error": e.to_string()})),
    }
}

/// Bring the catalog in line with the directory, forever.
async fn follow(h: ServerHandle, dir: PathBuf) {
    let mut served: BTreeMap<String, u64> = BTreeMap::new();
    loop {
        match scan(&dir) {
            Ok(now) => {
                for (name, was) in served.clone() {
                    match now.get(&name) {
                        None => {
                            remove(&h, &name).await;
                            served.remove(&name);
                        }
                        Some((path, size)) if *size != was => {
                            resize(&h, &name, path, was).await;
                            served.insert(name, *size);
                        }
                        Some(_) => {}
                    }
                }
                for (name, (path, size)) in &now {
                    if !served.contains_key(name) {
                        add(&h, name, path).await;
                        served.insert(name.clone(), *size);
                    }
                }
            }
            Err(e) => say(
                json!({"event": "scan-failed", "dir": dir.display().to_string(),
                "error": e.to_string()}),
            ),
        }
        tokio::time::sleep(SCAN).await;
    }
}

/// Print every put as it completes.
async fn report_puts(h: ServerHandle) {
    let mut rx = h.put_notices();
    loop {
        match rx.recv().await {
            Ok(n) => say(
                json!({"event": "put", "region": n.region, "offset": n.offset,
                "len": n.len, "client": n.client, "path": n.path.to_string()}),
            ),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                say(json!({"event": "puts-missed", "count": missed}))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 3 {
        eprintln!("usage: storage_node LISTEN TOKEN_FILE DIR");
        std::process::exit(2);
    }
    let token = std::fs::read_to_string(&args[1])?.trim().to_string();
    let dir = PathBuf::from(&args[2]);
    if !dir.is_dir() {
        return Err(format!("{} is not a directory", dir.display()).into());
    }
    // the node starts with an empty catalog: the directory fills it
    let server = Server::bind(ServerConfig::new(args[0].parse()?, token, Vec::new())).await?;
    say(
        json!({"event": "listening", "addr": server.local_addr()?.to_string(),
        "device": server.device()}),
    );
    let h = server.handle();
    tokio::spawn(report_puts(h.clone()));
    tokio::spawn(follow(h, dir));
    server
        .run(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
