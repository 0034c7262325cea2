//! Transfers through pipes: `fetch -o -` (one stream to stdout) and `put -i -` (one stream
//! from stdin). Bytes written to a pipe cannot be taken back, and bytes read from one cannot be
//! read again, so a try that fails cannot start over as with a file: with `--retries` (which
//! needs `--verify` here) the next try goes on after what the failed one moved
//! (`Client::fetch_resuming`, `Client::put_resuming`), and a region that changed between tries
//! fails with a mismatch that says so.

use super::transfer::{finish_transfer, Progress, Retry};

/// Fetch `len` bytes at `offset` of `r` to stdout, going on after what each failed try wrote
/// (with `verify`; without it `retry` has no tries, which the caller ensures), and finish the
/// transfer (report, exit).
pub(crate) async fn to_stdout(
    mut c: bridge::Client,
    mut r: bridge::OpenRegion,
    range: (u64, u64),
    verify: bool,
    mut retry: Retry,
    mut bar: Progress,
    json: bool,
) -> anyhow::Result<()> {
    let mut sink = std::io::BufWriter::with_capacity(1 << 20, std::io::stdout());
    let rep = if verify {
        let rep = c
            .fetch_resuming(&mut r, range, &mut sink, &mut retry.0, &mut |d| {
                bar.update(d)
            })
            .await;
        said(rep, range.0, "written to stdout")
    } else {
        let (offset, len) = range;
        c.fetch(&r, offset, len, &mut sink, false, &mut |d| bar.update(d))
            .await
    };
    finish_transfer(c, &r, rep, bar, json).await
}

/// Put from stdin at `offset` of `r`, `limit` bytes or up to the end of the input, going on
/// after what each failed try put (with `verify`; without it `retry` has no tries, which the
/// caller ensures), and finish the transfer.
pub(crate) async fn from_stdin(
    mut c: bridge::Client,
    mut r: bridge::OpenRegion,
    (offset, limit): (u64, Option<u64>),
    verify: bool,
    mut retry: Retry,
    mut bar: Progress,
    json: bool,
) -> anyhow::Result<()> {
    let mut from = std::io::stdin();
    let rep = if verify {
        let rep = c
            .put_resuming(&mut r, offset, &mut from, limit, &mut retry.0, &mut |d| {
                bar.update(d)
            })
            .await;
        said(rep, offset, "put from stdin")
    } else {
        c.put(&r, offset, &mut from, limit, false, &mut |d| bar.update(d))
            .await
    };
    finish_transfer(c, &r, rep, bar, json).await
}

/// The report of a resumed transfer through a pipe, with the line that says what the failed
/// tries had `moved` (checked) when there were any; `offset`: the range's.
fn said(
    rep: bridge::Result<bridge::Resumed>,
    offset: u64,
    moved: &str,
) -> bridge::Result<bridge::TransferReport> {
    let done = rep?;
    if !done.earlier.is_empty() {
        eprintln!(
            "p2p-rdma: {}",
            super::resume::resumed(offset, &done.earlier, moved)
        );
    }
    Ok(done.report)
}
