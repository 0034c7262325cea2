//! `fetch`: one transfer into a file or stdout, by address or by catalog name (it goes on
//! with the next replica when a node fails mid-way into a file).

use anyhow::Context as _;

use bridge::stripe::Stripe;

use super::exit::Usage;
use super::parse_size_arg;
use super::partial;
use super::resume::{Left, Tried};
use super::stripe;
use super::transfer::{
    client_config, finish_transfer, kept_still_hold, whole, ClientArgs, Progress, Retry,
};

/// `fetch`: where from, which bytes, where to.
#[derive(clap::Args, Debug)]
pub(crate) struct FetchArgs {
    /// Server control address HOST:PORT, or a catalog etcd://HOST:PORT[,...]/PREFIX to
    /// fetch from a node that serves the region.
    pub(crate) addr: String,
    /// Region name.
    pub(crate) region: String,
    /// Start offset in the region (K/M/G suffixes).
    #[arg(long, default_value = "0", value_parser = parse_size_arg)]
    pub(crate) offset: u64,
    /// Bytes to fetch (default: to the end of the region).
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) length: Option<u64>,
    /// Output file, or - for stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE|-")]
    pub(crate) output: String,
    /// Compare a CRC-32C of the bytes received with the server's (and report it, `crc32c` in
    /// --json). The sum is a pass of the CPU over every byte, so a fetch without --verify
    /// does not compute it.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Keep the bytes already in the output file (an earlier fetch of the same range into it
    /// that was interrupted: killed, or failed) and fetch only the rest: as many as the file
    /// holds, or after a striped fetch (--qps), the parts that FILE.p2p-rdma-partial beside it
    /// names (a striped fetch keeps that record while it runs). Once the rest is in, the kept
    /// bytes are compared with the server's checksum of them, and the whole range is fetched
    /// again if they differ (the region changed, or the file held other bytes). Needs -o FILE
    /// and --verify.
    #[arg(long = "continue", short = 'c')]
    pub(crate) keep: bool,
    /// Print a JSON result record: bytes, seconds, MiB/s, the bytes of each path, and
    /// `first_bytes_ms`, the time to first byte (on the bounce path it holds the server's
    /// staging of the first chunk and a control round trip).
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

pub(crate) async fn fetch(a: FetchArgs) -> anyhow::Result<()> {
    let FetchArgs {
        addr,
        region,
        offset,
        length,
        output,
        verify,
        keep,
        json,
        client,
    } = a;
    if keep && output == "-" {
        return Err(Usage(
            "--continue keeps what an earlier fetch wrote into the output file: give -o FILE, \
             not -"
                .into(),
        )
        .into());
    }
    if keep && !verify {
        return Err(Usage(
            "--continue keeps bytes fetched before, which only --verify checks against the \
             server's (the region may have changed since): add --verify"
                .into(),
        )
        .into());
    }
    // what the output file holds already, kept with --continue (read before connecting: a
    // file that cannot be read is a local error, said at once)
    let had = match std::fs::metadata(&output) {
        _ if !keep => 0,
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e).with_context(|| format!("cannot read {output} to continue it")),
    };
    if client.qps > 1 && output == "-" {
        return Err(Usage(
            "--qps writes the stripes at their own offsets of a file at once: give -o FILE, not -"
                .into(),
        )
        .into());
    }
    if client.retries > 0 && output == "-" && !verify {
        return Err(Usage(
            "--retries with -o - goes on after the bytes a failed try wrote to the pipe (they \
             cannot be taken back), which only --verify checks against the region's: add \
             --verify"
                .into(),
        )
        .into());
    }
    let base = client_config(String::new(), &client)?;
    // the range named with the open (its first chunk is staged with it, on the bounce path);
    // with --qps, the first stripe starts with the same piece
    let purpose = bridge::OpenFor::Fetch {
        offset,
        len: length.unwrap_or(u64::MAX),
    };
    let mut retry = Retry::new(&client);
    let super::catalog::Target {
        client: mut c,
        region: r,
        mut rest,
    } = retry
        .start("fetch", || {
            super::catalog::open(&addr, &region, purpose, &base, &client)
        })
        .await?;
    let len = match length {
        Some(l) => l,
        None => r
            .info
            .size
            .checked_sub(offset)
            .ok_or_else(|| bridge::Error::Server {
                code: bridge::protocol::ErrorCode::OutOfRange,
                message: format!(
                    "offset {offset} is beyond the end of region '{region}' ({} bytes)",
                    r.info.size
                ),
            })?,
    };
    let mut bar = Progress::new(len, json);
    let qps = usize::from(client.qps);
    let mut r = r;
    if output == "-" {
        let range = (offset, len);
        return super::pipe::to_stdout(c, r, range, verify, retry, bar, json).await;
    }
    let mut rep;
    // the kept parts once they are checked, each with its CRC-32C, for the report
    let mut held = Vec::new();
    // the parts of the range the tries before wrote into the file, kept (with --verify) for
    // the next try to fetch only the rest: one part at the start with one connection, one per
    // stripe with --qps
    let mut left = Left::new(offset, len);
    if !keep {
        // a record of an earlier striped fetch into this file no longer says what it holds
        partial::remove(&output)?;
    } else if let Some(l) = partial::load(&output, &region, (offset, len), had) {
        // --continue after a striped fetch: the parts its record says were fetched are kept
        left = l;
        eprintln!(
            "p2p-rdma: --continue: keeping {} of {output} in {} part(s), as {} says, fetching \
             the other {}",
            bridge::size::human(left.kept_bytes()),
            left.kept().len(),
            partial::path(&output),
            bridge::size::human(len - left.kept_bytes())
        );
    } else if had > 0 {
        // --continue: the file's first bytes are kept, as if a try had written them
        left.wrote(&[Stripe { offset, len }], &[had.min(len)]);
        if had > len {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&output)
                .and_then(|f| f.set_len(len))
                .with_context(|| format!("cannot cut {output} to the {len} bytes fetched"))?;
        }
        eprintln!(
            "p2p-rdma: --continue: keeping the first {} of {output}, fetching the other {}",
            bridge::size::human(had.min(len)),
            bridge::size::human(len - had.min(len))
        );
    }
    loop {
        let kept = left.kept();
        (c, r, rep) = into_file(
            c,
            r,
            &base,
            &region,
            (&output, &mut left),
            verify,
            qps,
            &mut bar,
        )
        .await?;
        if let (Ok(_), false) = (&rep, kept.is_empty()) {
            // the kept parts moved before the failure: they must still be the region's bytes
            match kept_still_hold(&mut c, &r, (offset, &kept), &output, false).await {
                Ok(Some(crcs)) => {
                    held = crcs;
                    break;
                }
                Ok(None) => {
                    left = Left::new(offset, len);
                    continue;
                }
                Err(e) => rep = Err(e),
            }
        }
        let Err(e) = &rep else { break };
        // --retries: the same node again, on a new connection; with --verify it resumes
        // after what this try wrote, else it starts over
        if !verify {
            left = Left::new(offset, len);
        }
        let first = left.first();
        let rest_of_it = bridge::OpenFor::Fetch {
            offset: first.offset,
            len: first.len,
        };
        if let Some(again) = retry.again(&mut c, e, "fetch", &region, rest_of_it).await {
            r = again;
            continue;
        }
        // by name: a node that fails mid-way is left for the next replica, which goes on as a
        // retry does (after what was written, where the fetch is verified: the kept parts are
        // then checked against that replica's bytes)
        if rest.is_empty() {
            break;
        }
        eprintln!("p2p-rdma: catalog: node failed mid-way ({e}); trying the next replica");
        match super::catalog::next(&region, std::mem::take(&mut rest), rest_of_it, &base).await {
            Ok(b) => (c, r, rest) = (b.client, b.region, b.rest),
            Err(e2) => {
                eprintln!("p2p-rdma: {e2:#}");
                break;
            }
        }
    }
    if rep.is_ok() {
        partial::remove(&output)?;
    }
    finish_transfer(c, &r, whole(rep, &held)?, bar, json).await
}

/// One try at fetching into the file `output` what `left` says is left of the range, over
/// `qps` connections (each piece of it where it goes in the file); `left` then says what is
/// still left. With nothing kept the file is created again; with one connection the kept part
/// is a start of the file, which is cut after it.
#[allow(clippy::too_many_arguments)]
async fn into_file(
    mut c: bridge::Client,
    r: bridge::OpenRegion,
    base: &bridge::ClientConfig,
    region: &str,
    (output, left): (&str, &mut Left),
    verify: bool,
    qps: usize,
    bar: &mut Progress,
) -> anyhow::Result<(bridge::Client, bridge::OpenRegion, bridge::Result<Tried>)> {
    let (offset, len) = left.range();
    if qps <= 1 && left.one_stream() {
        // one stream: what the tries before kept is the start of the file, and what is left
        // its one part at the end
        let piece = left.first();
        let at = piece.offset - offset;
        let mut f = if at > 0 {
            use std::io::Seek as _;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(output)
                .with_context(|| format!("cannot open the output file {output} to resume"))?;
            f.set_len(at)
                .and_then(|()| f.seek(std::io::SeekFrom::Start(at)))
                .with_context(|| format!("cannot resume {output} after byte {at}"))?;
            f
        } else {
            std::fs::File::create(output)
                .with_context(|| format!("cannot create the output file {output}"))?
        };
        let mut written = 0;
        let rep = c
            .fetch(&r, piece.offset, piece.len, &mut f, verify, &mut |d| {
                written = d;
                bar.update(at + d)
            })
            .await;
        left.wrote(&[piece], &[written]);
        return Ok((c, r, rep.map(Tried::one)));
    }
    // each further lane opens naming its piece; a connection for each part left at least
    // (--continue after a striped fetch, with fewer --qps)
    let n = qps.max(left.parts());
    let (mut lanes, pieces) = stripe::lanes_for((c, r), (base, region), left, n, |p| {
        bridge::OpenFor::Fetch {
            offset: p.offset,
            len: p.len,
        }
    })
    .await;
    let before = left.kept_bytes();
    // the record of what is left, every 100 ms while the stripes move and after a failed try,
    // for a --continue later
    let start = left.clone();
    let mut warned = false;
    let mut note = |moved: &[u64]| {
        let mut now = start.clone();
        now.wrote(&pieces, moved);
        partial::save(output, region, &now, &mut warned);
    };
    let (rep, moved) = stripe::fetch(
        &mut lanes,
        (offset, len),
        &pieces,
        (output, before == 0),
        verify,
        (bar, before, &mut note),
    )
    .await?;
    left.wrote(&pieces, &moved);
    if rep.is_err() {
        // (a try that went through leaves nothing to record: the fetch removes the record)
        partial::save(output, region, left, &mut warned);
    }
    let (c, r) = lanes.close_rest().await;
    Ok((c, r, rep))
}
