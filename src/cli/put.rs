//! `put`: a file (or stdin) into a region, by address or by catalog name (`--node`). With
//! `--retries` and `--verify` a put that failed part way goes on after what its streams put
//! (`super::resume`); with `--continue`, after what the region holds of the file already.

use anyhow::Context as _;

use super::exit::Usage;
use super::parse_size_arg;
use super::resume::{Left, Tried};
use super::stripe;
use super::transfer::{
    client_config, file_part, finish_transfer, kept_still_hold, whole, ClientArgs, Progress, Retry,
};

/// `put`: which bytes, where to.
#[derive(clap::Args, Debug)]
pub(crate) struct PutArgs {
    /// Server control address HOST:PORT, or a catalog etcd://HOST:PORT[,...]/PREFIX.
    pub(crate) addr: String,
    /// Region name.
    pub(crate) region: String,
    /// Start offset in the region (K/M/G suffixes).
    #[arg(long, default_value = "0", value_parser = parse_size_arg)]
    pub(crate) offset: u64,
    /// Bytes to put (default: the whole input; it must fit in the region).
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) length: Option<u64>,
    /// Input file, or - for stdin.
    #[arg(short = 'i', long = "input", value_name = "FILE|-")]
    pub(crate) input: String,
    /// Compare a CRC-32C of the bytes sent with the server's checksum of the range (and report
    /// it, `crc32c` in --json); a put without --verify does not compute it.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Put only what the region does not hold of the input yet: an earlier put of the same
    /// bytes to the same range that was interrupted (killed, or failed) put a start of each of
    /// its streams' pieces. The start of each piece that matches, in whole --chunk's, is found
    /// with the server's checksum (spans growing to 16 MiB, the first that differs halved to
    /// its first chunk that differs) and kept, and the rest is put; once it is
    /// in, the kept bytes are compared again (and flushed, where the server makes puts
    /// durable), and the whole range is put again if they changed meanwhile. Give the same
    /// --chunk and --qps as the earlier put to keep all it put. Needs -i FILE and --verify.
    #[arg(long = "continue", short = 'c')]
    pub(crate) keep: bool,
    /// Print a JSON result record.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

pub(crate) async fn put(a: PutArgs) -> anyhow::Result<()> {
    let PutArgs {
        addr,
        region,
        offset,
        length,
        input,
        verify,
        keep,
        json,
        client,
    } = a;
    if keep && input == "-" {
        return Err(Usage(
            "--continue compares the input with what the region holds, and puts the rest from \
             where it is in the input: give -i FILE, not -"
                .into(),
        )
        .into());
    }
    if keep && !verify {
        return Err(Usage(
            "--continue keeps bytes put before, which only --verify checks against the \
             server's once the rest is in (the region may change meanwhile): add --verify"
                .into(),
        )
        .into());
    }
    let size = if input == "-" {
        None
    } else {
        let f = std::fs::File::open(&input)
            .with_context(|| format!("cannot open the input file {input}"))?;
        let n = f
            .metadata()
            .with_context(|| format!("cannot stat {input}"))?
            .len();
        Some(n)
    };
    let limit = match (length, size) {
        (Some(l), Some(n)) if l > n => {
            return Err(Usage(format!(
                "--length {l} is more than the {n} bytes of {input}"
            ))
            .into())
        }
        (Some(l), _) => Some(l),
        (None, n) => n,
    };
    if client.qps > 1 && input == "-" {
        return Err(Usage(
            "--qps reads the stripes from their own offsets of a file at once: give -i FILE, not -"
                .into(),
        )
        .into());
    }
    if client.retries > 0 && input == "-" && !verify {
        return Err(Usage(
            "--retries with -i - goes on after the bytes a failed try put (those read from a \
             pipe cannot be read again), which only --verify checks against the region's: add \
             --verify"
                .into(),
        )
        .into());
    }
    let base = client_config(String::new(), &client)?;
    let mut retry = Retry::new(&client);
    let super::catalog::Target {
        client: mut c,
        region: mut r,
        ..
    } = retry
        .start("put", || {
            super::catalog::open(&addr, &region, bridge::OpenFor::Write, &base, &client)
        })
        .await?;
    let mut bar = Progress::new(limit.unwrap_or(r.info.size.saturating_sub(offset)), json);
    let Some(len) = limit.filter(|_| input != "-") else {
        // stdin: one stream (--qps was refused above)
        let range = (offset, limit);
        return super::pipe::from_stdin(c, r, range, verify, retry, bar, json).await;
    };
    let qps = usize::from(client.qps);
    // the parts of the range the tries before put, kept (with --verify) for the next try to
    // put only the rest
    let mut left = Left::new(offset, len);
    // (--retries: a scan cut by a failure a new connection may get past starts again)
    if keep {
        loop {
            match held_already(&mut c, &r, &input, &left, (qps, base.chunk as u64)).await {
                Ok(l) => {
                    left = l;
                    break;
                }
                Err(e) => match retry
                    .again(
                        &mut c,
                        &e,
                        "scan for --continue",
                        &region,
                        bridge::OpenFor::Write,
                    )
                    .await
                {
                    Some(again) => r = again,
                    None => return Err(e.into()),
                },
            }
        }
    }
    let mut rep;
    // the kept parts once they are checked, each with its CRC-32C, for the report
    let mut held = Vec::new();
    loop {
        let kept = left.kept();
        (c, r, rep) = from_file(
            c,
            r,
            &base,
            &region,
            (&input, &mut left),
            verify,
            qps,
            &mut bar,
        )
        .await?;
        if let (Ok(_), false) = (&rep, kept.is_empty()) {
            // the kept parts moved before the failure: they must still be the region's bytes
            match kept_still_hold(&mut c, &r, (offset, &kept), &input, true).await {
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
        // --retries: on a new connection, after what this try put where it is verified, else
        // the same bytes again from the start (a put of the same bytes to the same place twice
        // leaves them once)
        if !verify {
            left = Left::new(offset, len);
        }
        match retry
            .again(&mut c, e, "put", &region, bridge::OpenFor::Write)
            .await
        {
            Some(again) => r = again,
            None => break,
        }
    }
    finish_transfer(c, &r, whole(rep, &held)?, bar, json).await
}

/// One try at putting from the file `input` what `left` says is left of the range, over `qps`
/// connections (each piece read from where it is in the file); `left` then says what is still
/// left.
#[allow(clippy::too_many_arguments)]
async fn from_file(
    mut c: bridge::Client,
    r: bridge::OpenRegion,
    base: &bridge::ClientConfig,
    region: &str,
    (input, left): (&str, &mut Left),
    verify: bool,
    qps: usize,
    bar: &mut Progress,
) -> anyhow::Result<(bridge::Client, bridge::OpenRegion, bridge::Result<Tried>)> {
    let offset = left.range().0;
    if qps <= 1 && left.one_stream() {
        // one stream: what is left is one part, at the end of the range
        let piece = left.first();
        let before = left.kept_bytes();
        let mut f = file_part(input, piece.offset - offset, piece.len)
            .with_context(|| format!("cannot read the input file {input}"))?;
        let mut put = 0;
        let rep = c
            .put(
                &r,
                piece.offset,
                &mut f,
                Some(piece.len),
                verify,
                &mut |d| {
                    put = d;
                    bar.update(before + d)
                },
            )
            .await;
        left.wrote(&[piece], &[put]);
        return Ok((c, r, rep.map(Tried::one)));
    }
    let n = qps.max(left.parts());
    let (mut lanes, pieces) =
        stripe::lanes_for((c, r), (base, region), left, n, |_| bridge::OpenFor::Write).await;
    let before = left.kept_bytes();
    let (rep, moved) = stripe::put(&mut lanes, offset, &pieces, input, verify, bar, before).await?;
    left.wrote(&pieces, &moved);
    let (c, r) = lanes.close_rest().await;
    Ok((c, r, rep))
}

/// `put --continue`: what is left of the range `all` after the start of each of its pieces
/// (cut as a put over `qps` connections cuts them, in `chunk`'s) that the region holds as
/// `input` has it, up to the first chunk that differs (a put interrupted part way put a start
/// of each of its streams' pieces), found by comparing growing spans with the server's
/// checksum and halving the first that differs (`super::scan`), and said.
async fn held_already(
    c: &mut bridge::Client,
    r: &bridge::OpenRegion,
    input: &str,
    all: &Left,
    (qps, chunk): (usize, u64),
) -> bridge::Result<Left> {
    let (offset, len) = all.range();
    let pieces = all.spread(qps, chunk).unwrap_or_default();
    let mut have = Vec::with_capacity(pieces.len());
    for p in &pieces {
        let mut scan = super::scan::Scan::new(p.len, chunk);
        while let Some((at, n)) = scan.next() {
            let mut f = file_part(input, p.offset - offset + at, n)
                .map_err(|e| bridge::Error::io(format!("reading the input file {input}"), e))?;
            match c.compare(r, p.offset + at, n, &mut f).await {
                Ok(_) => scan.answer(true),
                Err(bridge::Error::Mismatch { .. }) => scan.answer(false),
                Err(e) => return Err(e),
            }
        }
        have.push(scan.held());
    }
    let mut left = all.clone();
    left.wrote(&pieces, &have);
    let human = bridge::size::human;
    let kept = left.kept();
    let (k, rest) = (left.kept_bytes(), len - left.kept_bytes());
    let what = match kept.as_slice() {
        [] => format!(
            "none of the range as {input} has it, putting all {}",
            human(len)
        ),
        _ if rest == 0 => format!(
            "all {} of the range as {input} has it, putting nothing",
            human(len)
        ),
        [one] if one.offset == offset => format!(
            "the first {} of the range as {input} has it, putting the other {}",
            human(k),
            human(rest)
        ),
        _ => format!(
            "{} of the range as {input} has it, in {} parts, putting the other {}",
            human(k),
            kept.len(),
            human(rest)
        ),
    };
    eprintln!("p2p-rdma: --continue: the region holds {what}");
    Ok(left)
}
