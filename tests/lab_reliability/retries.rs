//! `fetch` and `put --retries`: a server killed mid-transfer and started again, or not up yet
//! when the client starts.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{data, TOKEN};
use crate::{figure, ServeProcess, ServedFile};

/// Whether `file` holds `want` at `at` (a put has reached it).
fn holds(file: &std::path::Path, at: u64, want: &[u8]) -> bool {
    use std::io::{Read as _, Seek as _};
    let mut got = vec![0u8; want.len()];
    std::fs::File::open(file)
        .and_then(|mut f| {
            f.seek(std::io::SeekFrom::Start(at))?;
            f.read_exact(&mut got)
        })
        .is_ok()
        && got == want
}

/// The stderr of a `p2p-rdma` command run in the background (`child`), once it has ended
/// within `secs` and succeeded (`what`: the command, for the messages).
async fn succeeded(
    child: tokio::task::JoinHandle<std::io::Result<std::process::Output>>,
    secs: u64,
    what: &str,
) -> String {
    let done = tokio::time::timeout(Duration::from_secs(secs), child)
        .await
        .unwrap_or_else(|_| panic!("the {what} ends"))
        .unwrap()
        .unwrap();
    let err = String::from_utf8_lossy(&done.stderr).into_owned();
    eprintln!("the {what} said:\n{err}");
    assert!(done.status.success(), "{:?}: {err}", done.status);
    err
}

/// What [`a_cli_transfer_with_retries_outlives_a_server_restart`] moves.
#[derive(Clone, Copy, PartialEq)]
enum Moved {
    /// A fetch, which resumes after the bytes it wrote.
    Fetch,
    /// A fetch whose region changes while the server is down (the first MiB of each half): a
    /// part it kept differs, and it fetches the whole range again.
    FetchChanged,
    /// A put, which resumes after the bytes it put.
    Put,
    /// A put whose region changes while the server is down (the first MiB of each half): a
    /// part it kept is not there any more, and it puts the whole range again.
    PutChanged,
    /// A fetch to stdout (`-o -`, a file here), which goes on after the bytes it wrote.
    FetchPipe,
    /// A fetch to stdout whose region changes while the server is down: the bytes it wrote
    /// cannot be taken back, and it fails with a mismatch that says so.
    FetchPipeChanged,
    /// A put from stdin (`-i -`, a file here), which goes on after the bytes it put.
    PutPipe,
    /// A put from stdin whose region changes while the server is down: the bytes it put
    /// cannot be read again, and it fails with a mismatch that says so.
    PutPipeChanged,
}

impl Moved {
    fn fetching(self) -> bool {
        matches!(
            self,
            Moved::Fetch | Moved::FetchChanged | Moved::FetchPipe | Moved::FetchPipeChanged
        )
    }

    fn changed(self) -> bool {
        matches!(
            self,
            Moved::FetchChanged
                | Moved::PutChanged
                | Moved::FetchPipeChanged
                | Moved::PutPipeChanged
        )
    }

    fn pipe(self) -> bool {
        matches!(
            self,
            Moved::FetchPipe | Moved::FetchPipeChanged | Moved::PutPipe | Moved::PutPipeChanged
        )
    }
}

/// `p2p-rdma fetch` or `put --retries --verify --qps QPS` of 128 MiB of a file region whose
/// server is killed mid-way and started again on the same address: the transfer connects
/// again (the first try may find nobody listening yet, and waits longer) and ends verified
/// with every byte where it belongs, resumed after what each of its streams moved (unless the
/// region changed meanwhile).
async fn a_cli_transfer_with_retries_outlives_a_server_restart(moved: Moved, qps: u16) {
    let fetching = moved.fetching();
    let op = if fetching { "fetch" } else { "put" };
    let mut content = data(128 << 20, 43);
    let name = format!("p2p-retry-{op}-{}-{}-{qps}", moved.changed(), moved.pipe());
    let (served, mut server, addr) = ServedFile::start_for(&name, &content, fetching).await;
    let (dir, file) = (&served.dir, &served.file);
    // the other end: the file written by the fetch, or read by the put
    let local = dir.join("local.bin");
    if !fetching {
        std::fs::write(&local, &content).unwrap();
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"));
    cmd.args([op, &addr.to_string(), "f", "--verify", "--retries", "4"])
        .args([
            "--retry-wait",
            "1",
            "--qps",
            &qps.to_string(),
            "--token-file",
        ])
        .arg(&served.token_file)
        .arg(if fetching { "-o" } else { "-i" })
        .stderr(std::process::Stdio::piped());
    if moved.pipe() && fetching {
        // stdout, which a pipe would read: bytes written there stay
        cmd.arg("-").stdout(std::fs::File::create(&local).unwrap());
    } else if moved.pipe() {
        // stdin, read once as a pipe is
        cmd.arg("-")
            .stdin(std::fs::File::open(&local).unwrap())
            .stdout(std::process::Stdio::null());
    } else {
        cmd.arg(&local).stdout(std::process::Stdio::null());
    }
    let child = cmd.spawn().expect("p2p-rdma fetch or put");
    let child = tokio::task::spawn_blocking(move || child.wait_with_output());
    // cut it once the 4th MiB of either half (a stripe, with --qps 2) is where it goes: in the
    // fetched file (which a striped fetch sizes first), or in the region. The two stripes need
    // not move at the same pace. A put's bytes reach the region before the client counts them
    // put (up to its depth of 16 chunks of 1 MiB in flight): its cut waits for the 24th MiB,
    // so that it has put some
    let dest = if fetching { &local } else { file };
    let block = |end: usize| holds(dest, end as u64 - 4096, &content[end - 4096..end]);
    let mib = if fetching { 4 } else { 24 };
    let progressed = || block(mib << 20) || block((64 + mib) << 20);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !progressed() {
        assert!(Instant::now() < deadline, "the {op} did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    let whole = block(64 << 20) && block(128 << 20);
    assert!(
        !whole,
        "the {op} ended before the server was killed: this run tested nothing"
    );
    if moved.changed() {
        // another writer changed the first MiB of each half of the region while the server
        // was down: the half (the stripe) that had its 4th MiB moved kept bytes that differ
        // from the region's now. A fetch must end with the region's new bytes, a put with its
        // input's
        use std::io::{Seek as _, Write as _};
        let mut f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
        let other = data(1 << 20, 44);
        for at in [0usize, 64 << 20] {
            if fetching {
                content[at..at + (1 << 20)].copy_from_slice(&other);
            }
            f.seek(std::io::SeekFrom::Start(at as u64))
                .and_then(|_| f.write_all(&other))
                .unwrap();
        }
    }
    let _again = served.again(addr).await;
    if moved.pipe() && moved.changed() {
        // the first MiB, moved through the pipe before the server went down, differs from the
        // region's now and cannot be moved again: the transfer ends with a mismatch (exit 6)
        // that says why
        let done = tokio::time::timeout(Duration::from_secs(180), child)
            .await
            .unwrap_or_else(|_| panic!("the {op} ends"))
            .unwrap()
            .unwrap();
        let err = String::from_utf8_lossy(&done.stderr).into_owned();
        eprintln!("the {op} said:\n{err}");
        assert_eq!(done.status.code(), Some(6), "{err}");
        let why = if fetching {
            "two versions of it"
        } else {
            "lacks bytes of the source"
        };
        assert!(err.contains("retry 1 of 4") && err.contains(why), "{err}");
        figure(format!(
            "reliability: {op} {} --retries 4 of 128 MiB, its server killed mid-way and started again, the first MiB of each half of the region changed meanwhile: went on after the bytes moved through the pipe, then failed (exit 6): {}",
            if fetching { "-o -" } else { "-i -" },
            err.lines().find(|l| l.contains(why)).unwrap_or_default().trim_start_matches("p2p-rdma: error: ")
        ));
        let _ = std::fs::remove_dir_all(dir);
        return;
    }
    let err = succeeded(child, 180, op).await;
    // said once: not logged as a warning beside the line on stderr
    assert!(
        err.contains("connecting again") && err.matches("retry 1 of 4").count() == 1,
        "{err}"
    );
    assert!(err.contains("verified"), "{err}");
    let resumed = err.contains("p2p-rdma: resumed");
    let whole_again = err.contains("the whole range again");
    if moved.changed() {
        assert!(!resumed && whole_again, "{err}");
    } else {
        assert!(resumed && !whole_again, "{err}");
    }
    let piped = if fetching {
        "written to stdout before"
    } else {
        "put from stdin before"
    };
    assert_eq!(moved.pipe(), err.contains(piped), "{err}");
    let got = std::fs::read(if fetching { &local } else { file }).unwrap();
    assert!(got == content, "the bytes {op} moved differ");
    let tries = err.matches("connecting again").count();
    figure(format!(
        "reliability: {op}{} --retries 4 --qps {qps} of 128 MiB, its server killed mid-way and started again{}: done after {tries} retr{}, verified{}",
        match (moved.pipe(), fetching) {
            (false, _) => "",
            (true, true) => " -o -",
            (true, false) => " -i -",
        },
        if moved.changed() { ", the first MiB of each half of the region changed meanwhile" } else { "" },
        if tries == 1 { "y" } else { "ies" },
        match (resumed, whole_again) {
            (true, _) => format!(", {}", err.lines().find(|l| l.contains("p2p-rdma: resumed")).unwrap_or_default().trim_start_matches("p2p-rdma: ")),
            (_, true) => format!(", a kept part differed: {op} of the whole range again"),
            _ => ", started over".into(),
        }
    ));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_fetch_with_retries_outlives_a_server_restart() {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::Fetch, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_striped_cli_fetch_with_retries_outlives_a_server_restart() {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::Fetch, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_fetch_with_retries_fetches_again_what_changed_while_its_server_was_down(
) {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::FetchChanged, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_striped_cli_fetch_with_retries_fetches_again_what_changed_while_its_server_was_down(
) {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::FetchChanged, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_fetch_to_stdout_with_retries_goes_on_after_what_it_wrote() {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::FetchPipe, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_fetch_to_stdout_fails_if_what_it_wrote_changed_while_its_server_was_down(
) {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::FetchPipeChanged, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_put_from_stdin_with_retries_goes_on_after_what_it_put() {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::PutPipe, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_put_from_stdin_fails_if_what_it_put_changed_while_its_server_was_down(
) {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::PutPipeChanged, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_put_with_retries_outlives_a_server_restart() {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::Put, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_striped_cli_put_with_retries_outlives_a_server_restart() {
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::Put, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_put_with_retries_puts_again_what_changed_while_its_server_was_down()
{
    a_cli_transfer_with_retries_outlives_a_server_restart(Moved::PutChanged, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_fetch_with_retries_waits_for_a_server_not_up_yet() {
    // `fetch --retries` started before its server: the connection is refused, tried again
    // after 1 s, 2 s, …, and the fetch goes through once the server is up. Without --retries
    // the same start fails at once with exit 5 (unreachable)
    let dir = std::env::temp_dir().join(format!("p2p-retry-start-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let file = dir.join("region.bin");
    let content = data(4 << 20, 45);
    std::fs::write(&file, &content).unwrap();
    let spec = format!("f=file:{}", file.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let out = dir.join("out.bin");
    let fetch = |retries: &str| {
        Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
            .args([
                "fetch",
                &addr.to_string(),
                "f",
                "--verify",
                "--retries",
                retries,
            ])
            .arg("--token-file")
            .arg(&token_file)
            .arg("-o")
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("p2p-rdma fetch")
    };
    let at_once = fetch("0").wait_with_output().unwrap();
    assert_eq!(
        at_once.status.code(),
        Some(5),
        "without retries: {}",
        String::from_utf8_lossy(&at_once.stderr)
    );
    let waiting = fetch("5");
    let waiting = tokio::task::spawn_blocking(move || waiting.wait_with_output());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_server, _) = ServeProcess::start_at(addr, &spec, &token_file).await;
    let err = succeeded(waiting, 120, "fetch").await;
    assert!(
        err.contains("could not start the fetch") && err.contains("retry 1 of 5"),
        "{err}"
    );
    assert!(std::fs::read(&out).unwrap() == content, "the bytes differ");
    let tries = err.matches("could not start the fetch").count();
    figure(format!(
        "reliability: fetch --retries 5 started 1.5 s before its server: {tries} connection(s) refused, then fetched and verified; without --retries: exit 5 at once"
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fetch over `qps` connections killed (SIGKILL) mid-way, run again with --continue
/// --verify: it keeps the bytes in the file (one connection: as many as the file holds;
/// striped: the parts the record beside the file names) and fetches the rest. Then a file of
/// other bytes, continued: the kept part differs, and the whole range is fetched again.
async fn a_cli_fetch_killed_mid_way_goes_on_with_continue(qps: u16) {
    let dir = std::env::temp_dir().join(format!("p2p-continue-{qps}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let file = dir.join("region.bin");
    let content = data(128 << 20, 46);
    std::fs::write(&file, &content).unwrap();
    let (_server, addr) =
        ServeProcess::start(&format!("f=file:{}", file.display()), &token_file).await;
    let out = dir.join("out.bin");
    let record = dir.join("out.bin.p2p-rdma-partial");
    let fetch = |more: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
            .args(["fetch", &addr.to_string(), "f", "--verify", "--token-file"])
            .arg(&token_file)
            .arg("-o")
            .arg(&out)
            .args(["--qps", &qps.to_string()])
            .args(more)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("p2p-rdma fetch")
    };
    // slowed (one 64 KiB chunk in flight per connection), so that the record saved after a
    // second names parts of both stripes
    let mut first = fetch(&["--chunk", "64K", "--depth", "1"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let block = |end: usize| holds(&out, end as u64 - 4096, &content[end - 4096..end]);
    // striped: also until the record is there (saved once a second)
    while !((block(4 << 20) || block(68 << 20)) && (qps == 1 || record.exists())) {
        assert!(Instant::now() < deadline, "the fetch did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let had = std::fs::metadata(&out).unwrap().len();
    assert!(
        !(block(64 << 20) && block(128 << 20)),
        "the fetch ended before it was killed: this run tested nothing"
    );
    assert_eq!(
        qps > 1,
        record.exists(),
        "a record beside the file only when striped"
    );
    let done = fetch(&["--continue", "--json"]).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    eprintln!("the fetch with --continue said:\n{err}");
    assert!(done.status.success(), "{:?}: {err}", done.status);
    // the report covers the whole range: its CRC, and the bytes kept counted apart
    let rep: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
    let kept = rep["kept_bytes"].as_u64().unwrap_or(0);
    assert!(
        rep["verified"] == true
            && rep["offset"] == 0
            && rep["bytes"] == 128u64 << 20
            && rep["crc32c"] == crc32c::crc32c(&content)
            && kept > 0
            && kept <= had,
        "{rep}"
    );
    let keeping = if qps == 1 {
        "--continue: keeping the first"
    } else {
        "p2p-rdma-partial says"
    };
    assert!(
        err.contains(keeping) && err.contains("p2p-rdma: resumed"),
        "{err}"
    );
    assert!(std::fs::read(&out).unwrap() == content, "the bytes differ");
    assert!(
        !record.exists(),
        "the record is removed once the fetch is done"
    );
    // a file of other bytes (the pattern of seed 48: seeds 46 and 47 make the same bytes),
    // longer than the region: cut, found different, fetched again
    std::fs::write(&out, data(130 << 20, 48)).unwrap();
    let again = fetch(&["--continue"]).wait_with_output().unwrap();
    let err2 = String::from_utf8_lossy(&again.stderr);
    assert!(again.status.success(), "{:?}: {err2}", again.status);
    assert!(
        err2.contains("fetching the whole range again") && !err2.contains("p2p-rdma: resumed"),
        "{err2}"
    );
    assert!(std::fs::read(&out).unwrap() == content, "the bytes differ");
    figure(format!(
        "reliability: fetch --qps {qps} of 128 MiB killed (SIGKILL) with a file of {}, run again with --continue --verify: {}; a file of other bytes continued: fetched whole again",
        p2p_rdma::bridge::size::human(had),
        err.lines().find(|l| l.contains("p2p-rdma: resumed")).unwrap_or_default().trim_start_matches("p2p-rdma: ")
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_fetch_killed_mid_way_goes_on_with_continue() {
    a_cli_fetch_killed_mid_way_goes_on_with_continue(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_striped_cli_fetch_killed_mid_way_goes_on_with_continue() {
    a_cli_fetch_killed_mid_way_goes_on_with_continue(2).await;
}

/// A put over `qps` connections killed (SIGKILL) mid-way, run again with --continue --verify:
/// it finds what the region holds of each stripe's piece (chunk by chunk against the server's
/// checksum), puts the rest, and checks the kept bytes again. Run once more, it finds the whole
/// range held and puts nothing; into a region of other bytes, it finds nothing held and puts
/// it whole.
async fn a_cli_put_killed_mid_way_goes_on_with_continue(qps: u16) {
    let dir = std::env::temp_dir().join(format!("p2p-put-continue-{qps}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let file = dir.join("region.bin");
    std::fs::write(&file, vec![0u8; 128 << 20]).unwrap();
    let content = data(128 << 20, 50);
    let input = dir.join("in.bin");
    std::fs::write(&input, &content).unwrap();
    let (_server, addr) =
        ServeProcess::start(&format!("f=file:{}", file.display()), &token_file).await;
    let put = |more: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
            .args(["put", &addr.to_string(), "f", "--verify", "--token-file"])
            .arg(&token_file)
            .arg("-i")
            .arg(&input)
            .args(["--qps", &qps.to_string(), "--json"])
            .args(more)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("p2p-rdma put")
    };
    let mut first = put(&[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let block = |end: usize| holds(&file, end as u64 - 4096, &content[end - 4096..end]);
    while !(block(24 << 20) || block(88 << 20)) {
        assert!(Instant::now() < deadline, "the put did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(
        !(block(64 << 20) && block(128 << 20)),
        "the put ended before it was killed: this run tested nothing"
    );
    // the report covers the whole range: its CRC, and the bytes kept counted apart
    let crc = crc32c::crc32c(&content);
    let run = |more: &[&str]| {
        let out = put(more).wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        eprintln!("the put {more:?} said:\n{err}");
        assert!(out.status.success(), "{:?}: {err}", out.status);
        assert!(
            std::fs::read(&file).unwrap() == content,
            "the region's bytes differ"
        );
        let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(rep["verified"], true, "{rep}");
        assert_eq!(rep["offset"], 0, "{rep}");
        assert_eq!(rep["bytes"], 128u64 << 20, "{rep}");
        assert_eq!(rep["crc32c"], crc, "{rep}");
        let kept = rep["kept_bytes"].as_u64().unwrap_or(0);
        assert_eq!(
            rep["direct_bytes"].as_u64().unwrap() + rep["bounce_bytes"].as_u64().unwrap(),
            (128 << 20) - kept,
            "{rep}"
        );
        (err, kept)
    };
    let (err, kept) = run(&["--continue"]);
    assert!(kept > 0, "nothing kept: {err}");
    let found = err
        .lines()
        .find(|l| l.contains("--continue: the region holds"))
        .unwrap_or_else(|| panic!("{err}"))
        .to_string();
    assert!(
        !found.contains("holds none") && err.contains("p2p-rdma: resumed"),
        "{err}"
    );
    // everything held: nothing put, the whole range checked
    let (all, all_kept) = run(&["-c"]);
    assert!(
        all.contains("holds all 128.0 MiB") && all.contains("putting nothing"),
        "{all}"
    );
    assert_eq!(all_kept, 128 << 20);
    // a region of other bytes: nothing kept, put whole
    std::fs::write(&file, data(128 << 20, 52)).unwrap();
    let (none, none_kept) = run(&["--continue"]);
    assert!(
        none.contains("holds none") && !none.contains("p2p-rdma: resumed"),
        "{none}"
    );
    assert_eq!(none_kept, 0);
    figure(format!(
        "reliability: put --qps {qps} of 128 MiB killed (SIGKILL), run again with --continue --verify: {}; {}; again: everything held; into other bytes: put whole",
        found
            .trim_start_matches("p2p-rdma: --continue: ")
            .replace(&input.display().to_string(), "the input"),
        err.lines().find(|l| l.contains("p2p-rdma: resumed")).unwrap_or_default().trim_start_matches("p2p-rdma: ")
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_put_killed_mid_way_goes_on_with_continue() {
    a_cli_put_killed_mid_way_goes_on_with_continue(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_striped_cli_put_killed_mid_way_goes_on_with_continue() {
    a_cli_put_killed_mid_way_goes_on_with_continue(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab"]
async fn lab_reliability_a_cli_put_continue_scans_again_after_its_server_restarts() {
    // put --continue --retries into a region that holds the input already, in 4 KiB chunks
    // (16 compares of growing spans, where a compare of each chunk took 16,384), the server
    // killed mid-scan (once the client has read 2 MiB of its input) and started again: the
    // scan connects again, scans again, finds everything held and puts nothing
    let content = data(64 << 20, 54);
    let (served, mut server, addr) = ServedFile::start("p2p-put-scan", &content).await;
    let input = served.dir.join("in.bin");
    std::fs::write(&input, &content).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_p2p-rdma"))
        .args(["put", &addr.to_string(), "f", "--verify", "--continue"])
        .args([
            "--retries",
            "4",
            "--retry-wait",
            "1",
            "--chunk",
            "4K",
            "--token-file",
        ])
        .arg(&served.token_file)
        .arg("-i")
        .arg(&input)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("p2p-rdma put");
    let started = Instant::now();
    let io = format!("/proc/{}/io", child.id());
    let child = tokio::task::spawn_blocking(move || child.wait_with_output());
    // the bytes the client has read (its input, beside a few small files and replies)
    let read = || {
        let t = std::fs::read_to_string(&io).unwrap_or_default();
        t.lines()
            .find_map(|l| l.strip_prefix("rchar: ")?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    while read() < 2 << 20 {
        assert!(
            started.elapsed() < Duration::from_secs(60) && !child.is_finished(),
            "the client read no 2 MiB of its input in a minute"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let killed_at = started.elapsed();
    server.kill();
    let _again = served.again(addr).await;
    let err = succeeded(child, 240, "put").await;
    assert!(
        err.contains("the scan for --continue failed") && err.contains("connecting again"),
        "the server was not killed mid-scan: this run tested nothing\n{err}"
    );
    assert!(
        err.contains("holds all 64.0 MiB") && err.contains("putting nothing"),
        "{err}"
    );
    assert!(
        std::fs::read(&served.file).unwrap() == content,
        "the region's bytes differ"
    );
    figure(format!(
        "reliability: put --continue --retries 4 --chunk 4K of 64 MiB already held, its server killed mid-scan ({:.1} s in, 2 MiB of the input read) and started again: scanned again after {} retr{}, everything held, nothing put, verified ({:.1} s)",
        killed_at.as_secs_f64(),
        err.matches("connecting again").count(),
        if err.matches("connecting again").count() == 1 { "y" } else { "ies" },
        started.elapsed().as_secs_f64()
    ));
    let _ = std::fs::remove_dir_all(&served.dir);
}
