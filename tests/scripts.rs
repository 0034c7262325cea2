//! Host-side tests of the lab's scripts: options they refuse before booting anything, and the
//! steps of a fetch that fail (with stand-ins for apt-get and the packages it downloads).
use std::process::Command;

fn script(path: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(path)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("running {path}: {e}"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn two_host_test_refuses_fetch_rounds_that_are_not_a_positive_number() {
    for bad in ["0", "x", "-3", ""] {
        let (code, stderr) = script("soft-roce/two-host-test", &["--fetch-rounds", bad]);
        assert_eq!(code, Some(2), "--fetch-rounds '{bad}': {stderr}");
        assert!(
            stderr.contains("--fetch-rounds needs a positive whole number")
                && stderr.contains(&format!("got '{bad}'")),
            "--fetch-rounds '{bad}': {stderr}"
        );
    }
}

/// `scripts/perf-report ARGS` exits 2 saying `message`, before it builds anything.
fn perf_report_refuses(args: &[&str], message: &str) {
    let (code, stderr) = script("scripts/perf-report", args);
    assert_eq!(code, Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(message), "{args:?}: {stderr}");
    assert!(!stderr.contains("Compiling"), "it built first: {stderr}");
}

#[test]
fn perf_report_refuses_fewer_than_one_fetch_round_before_building() {
    perf_report_refuses(
        &["--fetch-rounds", "0"],
        "--fetch-rounds must be at least 1, got 0",
    );
}

#[test]
fn perf_report_help_says_what_each_option_does_and_its_default() {
    let out = Command::new("scripts/perf-report")
        .arg("--help")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("running scripts/perf-report --help");
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for (option, default) in [
        ("--rounds N", "default 2"),
        ("--fetch-rounds F", "default 15"),
        ("--compare-rounds M", "0 skips it"),
        ("--storage-rounds S", "as many as the compare's; 0 skips it"),
        ("--storage-qemu V[,V]", "default 7.2,10"),
        ("--loopback-rounds K", "default 0"),
        ("--kernel KERNEL", "default 7.3"),
        ("--out DIR", "target/perf-report"),
        ("--from-logs", "run nothing"),
    ] {
        // the option's line and the indented lines that go on with it
        let mut lines = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(option));
        let first = lines
            .next()
            .unwrap_or_else(|| panic!("{option} is not described:\n{help}"));
        let more = lines.take_while(|l| l.starts_with("      ") && !l.trim().starts_with('-'));
        let line = std::iter::once(first)
            .chain(more)
            .flat_map(str::split_whitespace)
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            line.contains(default),
            "{option}: '{line}' lacks '{default}'"
        );
    }
    // what it runs and what it needs, not only the options
    assert!(
        help.contains("soft-roce/two-host-test") && help.contains("Needs:"),
        "{help}"
    );
}

#[test]
fn perf_report_refuses_an_emulator_the_lab_does_not_have_before_building() {
    perf_report_refuses(
        &["--storage-qemu", "7.2,9"],
        "choose 7.2 and/or 10 (comma-separated), got '7.2,9'",
    );
}

#[test]
fn lab_refuses_an_emulator_it_does_not_know_before_booting() {
    for bad in ["9", "7", ""] {
        let (code, stderr) = script("soft-roce/lab", &["--qemu", bad, "--", "true"]);
        if bad.is_empty() {
            // an empty value is a missing one
            assert_eq!(code, Some(1), "--qemu '': {stderr}");
            assert!(stderr.contains("--qemu needs a value"), "{stderr}");
            continue;
        }
        assert_eq!(code, Some(125), "--qemu '{bad}': {stderr}");
        assert!(
            stderr.contains(&format!("unknown QEMU '{bad}' (choose 7.2 or 10)")),
            "--qemu '{bad}': {stderr}"
        );
        assert!(!stderr.contains("fetching"), "it fetched first: {stderr}");
    }
}

#[test]
fn lab_refuses_an_rxe_it_does_not_build_before_building_or_booting() {
    let refused = |args: &[&str], want: &str| {
        let (code, stderr) = script("soft-roce/lab", args);
        assert_eq!(code, Some(125), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("fetching") && !stderr.contains("building"),
            "{args:?}: it fetched or built first: {stderr}"
        );
    };
    refused(
        &["--rxe", "fixed", "--", "true"],
        "unknown rxe 'fixed' (choose stock or odp-fix)",
    );
    // the fix is built for the 7.3 kernel's rxe, whose ODP it mends (6.12's rxe has none)
    refused(
        &["--kernel", "6.12", "--rxe", "odp-fix", "--", "true"],
        "--rxe odp-fix is built for kernel 7.3 only",
    );
    refused(
        &["fetch", "--rxe", "stok", "7.3"],
        "unknown rxe 'stok' (choose stock or odp-fix)",
    );
}

/// `soft-roce/lab info` (with the lab cache `cache`, else the default one): its exit code and
/// standard output.
fn lab_info(cache: Option<&std::path::Path>) -> (Option<i32>, String) {
    let mut cmd = Command::new("soft-roce/lab");
    cmd.arg("info").current_dir(env!("CARGO_MANIFEST_DIR"));
    if let Some(c) = cache {
        cmd.env("P2P_LAB_CACHE", c);
    }
    let o = cmd.output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

/// `soft-roce/lab ARGS` with `apt-get` and `apt-cache` replaced by the shell scripts `apt_get`
/// and `apt_cache` (which see the subcommand as ` download ` in `" $* "`), in a lab cache of its
/// own: its exit code and standard error, and the cache.
fn lab_with_stand_in_apt(
    name: &str,
    args: &[&str],
    apt_get: &str,
    apt_cache: &str,
) -> (Option<i32>, String, std::path::PathBuf) {
    lab_with_stand_in_apt_in(name, args, apt_get, apt_cache, |_| {})
}

/// [`lab_with_stand_in_apt`], with the lab cache filled by `prepare` first.
fn lab_with_stand_in_apt_in(
    name: &str,
    args: &[&str],
    apt_get: &str,
    apt_cache: &str,
    prepare: impl FnOnce(&std::path::Path),
) -> (Option<i32>, String, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("p2p-lab-apt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for (tool, body) in [("apt-get", apt_get), ("apt-cache", apt_cache)] {
        let p = bin.join(tool);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    // the lab installs its Debian packages before it fetches: this checks the fetch alone
    let (code, out) = lab_info(None);
    assert!(
        code == Some(0) && out.contains("missing packages: \n"),
        "this test needs the lab's Debian packages (soft-roce/lab deps): {out}"
    );
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    prepare(&cache);
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let o = Command::new("soft-roce/lab")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PATH", path)
        .env("P2P_LAB_CACHE", &cache)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        cache,
    )
}

#[test]
fn lab_fetch_of_qemu_10_names_the_step_that_failed_and_keeps_nothing_half_done() {
    let madison = "echo ' qemu-system-x86 | 1:10.0.2+ds-1~bpo12+1 | http://mirror.invalid bookworm-backports/main amd64 Packages'";
    let fetch = ["fetch", "--qemu", "10", "7.3"];
    let ver = "1:10.0.2+ds-1~bpo12+1";
    // each case's cache, removed at the end
    let mut caches = Vec::new();
    let mut refused = |name: &str, apt_get: &str, apt_cache: &str, want: &str| {
        let (code, stderr, cache) = lab_with_stand_in_apt(name, &fetch, apt_get, apt_cache);
        assert_eq!(code, Some(125), "{name}: {stderr}");
        assert!(stderr.contains(want), "{name}: {stderr}");
        assert!(
            !cache.join("qemu/10/ready").exists(),
            "{name}: a QEMU that failed is marked ready"
        );
        caches.push(cache.clone());
        cache
    };
    // no 10.x in the suite
    refused(
        "none",
        "exit 0",
        "exit 0",
        "no qemu-system-x86 10.x in bookworm-backports",
    );
    // the download fails: the log it names holds apt-get's words
    let cache = refused(
        "download",
        r#"case " $* " in *" download "*) echo "E: Failed to fetch it (404)" >&2; exit 100;; esac"#,
        madison,
        &format!(
            "downloading qemu-system-x86={ver} qemu-system-common={ver} qemu-system-data={ver} failed, see "
        ),
    );
    let log = cache.join("qemu/10.tmp/dl/download.log");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(logged.contains("404"), "{}: {logged}", log.display());
    // what it downloaded is not a package
    refused(
        "garbage",
        r#"case " $* " in *" download "*) for p in "$@"; do case $p in qemu*) echo not-a-deb > "${p%%=*}_10_amd64.deb";; esac; done;; esac"#,
        madison,
        "unpacking qemu-system-common_10_amd64.deb failed, see ",
    );
    // packages that unpack, whose emulator lacks what the lab needs of it
    refused(
        "no-bounce",
        r#"case " $* " in *" download "*)
  for p in "$@"; do case $p in qemu*)
    n=${p%%=*}; mkdir -p "$n/DEBIAN" "$n/usr/bin"
    printf 'Package: %s\nVersion: 10\nArchitecture: amd64\nMaintainer: lab <lab@localhost>\nDescription: stand-in\n' "$n" > "$n/DEBIAN/control"
    printf '#!/bin/sh\necho nvme options:\n' > "$n/usr/bin/qemu-system-x86_64"; chmod 755 "$n/usr/bin/qemu-system-x86_64"
    [ "$n" = qemu-system-x86 ] || rm -r "$n/usr"
    dpkg-deb -b "$n" "${n}_10_amd64.deb" >/dev/null;;
  esac; done;;
esac"#,
        madison,
        &format!("QEMU {ver} has no x-max-bounce-buffer-size on its NVMe device"),
    );
    for cache in caches {
        let _ = std::fs::remove_dir_all(cache.parent().unwrap());
    }
}

#[test]
fn lab_build_of_the_fixed_rxe_names_the_step_that_failed_and_keeps_nothing_half_done() {
    // a 7.3 kernel in the cache (only what the build reads of it), and Debian's kernel source
    // and headers played by packages of a few files: the build fails before any compiler runs
    let kver = "7.3.4+deb13-amd64";
    let tmp = std::env::temp_dir().join(format!("p2p-lab-rxe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let rxe_dir = tmp.join("tree/linux-source-7.3/drivers/infiniband/sw/rxe");
    std::fs::create_dir_all(&rxe_dir).unwrap();
    let tree = tmp.join("tree");
    let apt_get = format!(
        r#"ctl() {{ mkdir -p "$1/DEBIAN"; printf 'Package: %s\nVersion: 1\nArchitecture: amd64\nMaintainer: lab <lab@localhost>\nDescription: stand-in\n' "$2" > "$1/DEBIAN/control"; }}
case " $* " in *" download "*)
  for p in "$@"; do case $p in
    linux-source-7.3) ctl s "$p"; mkdir -p s/usr/src; tar -czf s/usr/src/linux-source-7.3.tar.gz -C {tree} linux-source-7.3; dpkg-deb -b s "${{p}}_1_amd64.deb" >/dev/null;;
    linux-headers-*) ctl h "$p"; mkdir -p "h/usr/src/$p"; echo CONFIG_RDMA_RXE=m > "h/usr/src/$p/.config"; : > "h/usr/src/$p/Module.symvers"; dpkg-deb -b h "${{p}}_1_amd64.deb" >/dev/null;;
  esac; done;;
esac"#,
        tree = tree.display()
    );
    let module = "kernels/7.3/rxe-odp-fix/rdma_rxe.ko";
    // the patch's own lines before it: the file it applies to
    let patch = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("soft-roce/rxe-odp-offset.patch"),
    )
    .unwrap();
    let before: String = patch
        .lines()
        .skip_while(|l| !l.starts_with("@@"))
        .filter(|l| l.starts_with(' ') || l.starts_with('-'))
        .map(|l| format!("{}\n", &l[1..]))
        .collect();
    let mut caches = Vec::new();
    for (name, source, want, log) in [
        (
            "patch",
            "int rxe_odp_is_elsewhere;\n".to_string(),
            "preparing the sources of rdma_rxe.ko failed",
            "FAILED",
        ),
        (
            "build",
            before,
            "building rdma_rxe.ko failed",
            "No rule to make target",
        ),
    ] {
        std::fs::write(rxe_dir.join("rxe_odp.c"), source).unwrap();
        let (code, stderr, cache) = lab_with_stand_in_apt_in(
            &format!("rxe-{name}"),
            &["fetch", "--rxe", "odp-fix", "7.3"],
            &apt_get,
            "exit 0",
            |cache| {
                let k = cache.join("kernels/7.3");
                std::fs::create_dir_all(k.join("rxe-odp-fix")).unwrap();
                std::fs::write(k.join("kver"), kver).unwrap();
                std::fs::write(k.join("ready"), kver).unwrap();
                // built from another patch before: built again, not used
                std::fs::write(cache.join(module), "old").unwrap();
                std::fs::write(cache.join(format!("{module}.patch-sha256")), "0").unwrap();
            },
        );
        assert_eq!(code, Some(125), "{name}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "building rdma_rxe.ko (soft-roce/rxe-odp-offset.patch applied) for {kver}"
            )),
            "{name}: the module of another patch was not built again: {stderr}"
        );
        assert!(
            stderr.contains(want) && stderr.contains(log),
            "{name}: {stderr}"
        );
        assert_eq!(
            std::fs::read_to_string(cache.join(format!("{module}.patch-sha256"))).unwrap(),
            "0",
            "{name}: a failed build is recorded as built from this patch"
        );
        let left: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("rdma_rxe"))
            .collect();
        assert!(
            left.is_empty(),
            "{name}: the build's work left behind: {left:?}"
        );
        let (_, info) = lab_info(Some(&cache));
        assert!(
            info.contains("rxe odp-fix (7.3): built from another soft-roce/rxe-odp-offset.patch (built again on its next use)"),
            "{name}: {info}"
        );
        caches.push(cache);
    }
    for cache in caches {
        let _ = std::fs::remove_dir_all(cache.parent().unwrap());
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
