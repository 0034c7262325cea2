//! Host-side tests of the lab's scripts: options they refuse before booting anything.
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

#[test]
fn perf_report_refuses_fewer_than_one_fetch_round_before_building() {
    let (code, stderr) = script("scripts/perf-report", &["--fetch-rounds", "0"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--fetch-rounds must be at least 1, got 0"),
        "{stderr}"
    );
    assert!(!stderr.contains("Compiling"), "it built first: {stderr}");
}
