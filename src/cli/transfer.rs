//! Shared pieces of the data-moving commands (`fetch`, `put`): client settings, the progress
//! line, the result report.

use std::io::IsTerminal as _;
use std::time::Duration;

use anyhow::Context as _;
use bridge::size::human;

use std::path::PathBuf;

use super::{emit, parse_size_arg};

pub(crate) fn client_config(addr: String, a: &ClientArgs) -> anyhow::Result<bridge::ClientConfig> {
    let mut cfg = bridge::ClientConfig::new(addr, a.token.load()?);
    cfg.device = a.device.clone();
    cfg.server_nic = a.server_nic.clone();
    cfg.chunk = usize::try_from(a.chunk).context("--chunk is too large")?;
    cfg.depth = a.depth;
    cfg.inline = a.inline;
    cfg.timeout = Duration::from_secs(a.timeout.max(1));
    cfg.qp_path = a.path.qp_path();
    cfg.transport = match a.transport {
        TransportArg::Auto => bridge::Transport::Auto,
        TransportArg::Rdma => bridge::Transport::Rdma,
        TransportArg::Tcp => bridge::Transport::Tcp,
    };
    Ok(cfg)
}

/// How a client's bytes travel (`--transport`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub(crate) enum TransportArg {
    /// RDMA when this host has an RDMA device, else TCP (said on stderr, with the reason).
    #[default]
    Auto,
    /// RDMA only.
    Rdma,
    /// Over the TCP control connection (no RDMA device needed; slower, the server copies).
    Tcp,
}

/// Clear the progress line, release the region and the connection, then report.
pub(crate) async fn finish_transfer(
    mut c: bridge::Client,
    r: &bridge::OpenRegion,
    rep: bridge::Result<bridge::TransferReport>,
    bar: Progress,
    json: bool,
) -> anyhow::Result<()> {
    bar.finish();
    if let Some(why) = c.tcp_reason() {
        // said whatever the outcome: the user should know why RDMA was not used
        eprintln!("p2p-rdma: the bytes went over TCP: {why}");
    }
    if let Some(nic) = c.server_nic() {
        let all: Vec<&str> = c.server_nics().iter().map(|n| n.name.as_str()).collect();
        eprintln!(
            "p2p-rdma: connected to the server's RDMA device {nic} (it serves from {})",
            all.join(", ")
        );
    }
    let mut rep = rep?;
    rep.open_ms = Some(r.open_ms);
    let _ = c.close(r).await;
    let _ = c.bye().await;
    print_report(&rep, json)
}

pub(crate) fn print_report(r: &bridge::TransferReport, json: bool) -> anyhow::Result<()> {
    if json {
        return emit(&format!("{}\n", serde_json::to_string(r)?));
    }
    eprintln!(
        "p2p-rdma: {} {} of '{}' at offset {}{} in {:.3} s ({:.2} MiB/s{}{}; direct {}, bounce {}{}{}){}",
        r.op,
        human(r.bytes),
        r.region,
        r.offset,
        if r.kept_bytes > 0 {
            format!(
                " ({} of them kept from before, moved {})",
                human(r.kept_bytes),
                human(r.bytes - r.kept_bytes)
            )
        } else {
            String::new()
        },
        r.seconds,
        r.mib_per_sec,
        match r.first_bytes_ms {
            Some(ms) => format!(", first bytes after {ms:.1} ms"),
            None => String::new(),
        },
        match r.open_ms {
            Some(ms) => format!(", after an open of {ms:.1} ms"),
            None => String::new(),
        },
        human(r.direct_bytes),
        human(r.bounce_bytes),
        if r.zero_copy_bytes > 0 {
            format!(
                " of which {} zero-copy (not copied by the server)",
                human(r.zero_copy_bytes)
            )
        } else {
            String::new()
        },
        if r.tcp_bytes > 0 {
            format!(", tcp {}", human(r.tcp_bytes))
        } else {
            String::new()
        },
        match (r.verified, r.crc32c) {
            (true, Some(c)) => format!(", CRC-32C {c:#010x} verified"),
            // pieces apart (a resumed striped fetch): each was verified on its own
            (true, None) if r.bytes > 0 => ", verified".into(),
            _ => String::new(),
        }
    );
    if r.reasked_chunks > 0 {
        eprintln!(
            "p2p-rdma: {} lent chunk(s) came too late to read within the server's ring hold \
             limit (this side was slow: its output blocked, say) and were asked for again",
            r.reasked_chunks
        );
    }
    Ok(())
}

/// `len` bytes of the file at `path` from byte `at`, buffered.
pub(crate) fn file_part(
    path: &str,
    at: u64,
    len: u64,
) -> std::io::Result<std::io::Take<std::io::BufReader<std::fs::File>>> {
    use std::io::{Read as _, Seek as _};
    let mut f = std::fs::File::open(path)?;
    f.seek(std::io::SeekFrom::Start(at))?;
    Ok(std::io::BufReader::with_capacity(1 << 20, f).take(len))
}

/// Whether region `r` holds the `kept` parts of the range at `offset` (a resumed transfer's,
/// `super::resume`) as the file at `path` has them (its byte 0 is the range's first): the
/// server's checksum of each part against the file's bytes, each part given back with the
/// CRC-32C it matched by. With `put`, a region the server makes puts durable in then has each
/// part flushed (a resumed put's last try flushed only its own).
async fn kept_holds(
    c: &mut bridge::Client,
    r: &bridge::OpenRegion,
    (offset, kept): (u64, &[bridge::stripe::Stripe]),
    path: &str,
    put: bool,
) -> bridge::Result<Vec<(bridge::stripe::Stripe, u32)>> {
    let mut out = Vec::with_capacity(kept.len());
    for k in kept {
        let mut f = file_part(path, k.offset - offset, k.len)
            .map_err(|e| bridge::Error::io(format!("reading {path} again"), e))?;
        out.push((*k, c.compare(r, k.offset, k.len, &mut f).await?));
        if put && r.info.server_puts {
            c.flush(r, k.offset, k.len).await?;
        }
    }
    Ok(out)
}

/// After a try that moved the rest of a resumed transfer: whether its `kept` parts hold
/// ([`kept_holds`]; `put`: the transfer is a put), said on stderr: each with its CRC-32C, or
/// `Ok(None)` when a part differs, and the caller moves the whole range again (also said).
pub(crate) async fn kept_still_hold(
    c: &mut bridge::Client,
    r: &bridge::OpenRegion,
    (offset, kept): (u64, &[bridge::stripe::Stripe]),
    path: &str,
    put: bool,
) -> bridge::Result<Option<Vec<(bridge::stripe::Stripe, u32)>>> {
    match kept_holds(c, r, (offset, kept), path, put).await {
        Ok(held) => {
            let moved = if put { "put" } else { "fetched" };
            eprintln!("p2p-rdma: {}", super::resume::resumed(offset, kept, moved));
            Ok(Some(held))
        }
        Err(e @ bridge::Error::Mismatch { .. }) => {
            eprintln!(
                "p2p-rdma: a part kept from before differs from the region's bytes now ({e}); {} \
                 the whole range again",
                if put { "putting" } else { "fetching" }
            );
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The report of a file transfer's last try (`rep`) for the whole range: with the parts kept
/// from the tries before, once checked (`held`, each with its CRC-32C).
pub(crate) fn whole(
    rep: bridge::Result<super::resume::Tried>,
    held: &[(bridge::stripe::Stripe, u32)],
) -> anyhow::Result<bridge::Result<bridge::TransferReport>> {
    match rep {
        Ok(t) => Ok(Ok(t.whole(held).ok_or_else(|| {
            anyhow::anyhow!("a transfer whose try reported no piece")
        })?)),
        Err(e) => Ok(Err(e)),
    }
}

/// A progress line on stderr when it is a terminal (and no JSON was asked for).
pub(crate) struct Progress {
    total: u64,
    on: bool,
    start: std::time::Instant,
    last: std::time::Instant,
}

impl Progress {
    pub(crate) fn new(total: u64, json: bool) -> Progress {
        let now = std::time::Instant::now();
        Progress {
            total,
            on: !json && std::io::stderr().is_terminal(),
            start: now,
            last: now,
        }
    }

    pub(crate) fn update(&mut self, done: u64) {
        if !self.on || self.last.elapsed() < Duration::from_millis(100) {
            return;
        }
        self.last = std::time::Instant::now();
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let pct = if self.total > 0 {
            done as f64 * 100.0 / self.total as f64
        } else {
            100.0
        };
        eprint!(
            "\r{:>10} / {:<10} {:5.1}%  {:8.2} MiB/s ",
            human(done),
            human(self.total),
            pct,
            done as f64 / secs / f64::from(1 << 20)
        );
    }

    fn finish(&self) {
        if self.on {
            eprint!("\r{:60}\r", "");
        }
    }
}

/// How a client finds the token.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct TokenArgs {
    /// File holding the shared secret (surrounding whitespace is ignored). Default: the
    /// environment variable P2P_RDMA_TOKEN.
    #[arg(long, value_name = "FILE")]
    pub(crate) token_file: Option<PathBuf>,
}

impl TokenArgs {
    pub(crate) fn load(&self) -> anyhow::Result<String> {
        super::read_token(self.token_file.as_deref())
    }
}

/// Options every data-moving client command shares.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ClientArgs {
    /// RDMA device (default: the one that carries the route to the server's device, else the
    /// first one with an active port).
    #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
    pub(crate) device: Option<String>,
    /// On a server that serves from several RDMA devices, connect to this one (default: the
    /// one that serves the region; `ls` names it). Another one reaches the region through the
    /// server's bounce buffers.
    #[arg(long, value_name = "DEVICE")]
    pub(crate) server_nic: Option<String>,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    /// Bytes per RDMA work request (K/M/G suffixes).
    #[arg(long, default_value = "1M", value_parser = parse_size_arg)]
    pub(crate) chunk: u64,
    /// Stripe the transfer over N connections to the server, each with its own queue pair,
    /// in parts of whole --chunk's (at most 64; default 1: one stream), the connections opened
    /// at once. A file only (-o FILE, -i FILE), not a pipe; the CRC-32C and --verify cover the
    /// whole range. A server that takes fewer connections (its limit) leaves fewer stripes,
    /// said on stderr.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub(crate) qps: u16,
    /// Work requests in flight (capped by the server).
    #[arg(long, default_value_t = 16)]
    pub(crate) depth: usize,
    /// A put piece of at most BYTES into memory the server serves directly travels inline, in
    /// the work request itself, instead of being fetched by the NIC from a registered buffer
    /// (0: never). A device with less inline room gets a QP without, said with -v.
    #[arg(long, value_name = "BYTES", default_value_t = bridge::DEFAULT_INLINE,
          value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub(crate) inline: u32,
    /// Seconds to wait for the server at each step.
    #[arg(long, default_value_t = 30)]
    pub(crate) timeout: u64,
    /// When the transfer fails in a way a new connection may get past (the server restarted,
    /// went away or was busy; the link or the RDMA transport failed; the QP went down),
    /// connect again and start the transfer over, up to N times, each said on stderr. With
    /// --verify a fetch or put resumes after the bytes each of its streams moved instead (with
    /// --qps too), and checks them against the server's checksum at the end (moving the whole
    /// range again if they differ: the region changed meanwhile). With -o - or -i - (and
    /// --verify, which they need), a transfer goes on after the bytes the pipe moved, which
    /// cannot be moved again (a put keeps those it read until the server has them): it fails,
    /// saying so, if those differ from the region's at the end. A server not reached at the
    /// start (not up yet, busy) is tried again the same way. A refused request (an unknown
    /// region, a range, the token) or a checksum mismatch is not retried.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) retries: u32,
    /// Seconds before the first retry; each later one waits twice as long as the one before,
    /// at most 30 s.
    #[arg(long, value_name = "SECS", default_value_t = 1.0,
          value_parser = parse_retry_wait)]
    pub(crate) retry_wait: f64,
    #[command(flatten)]
    pub(crate) path: super::PathArgs,
    /// How the bytes travel: auto (RDMA when this host has an RDMA device, else TCP over the
    /// control connection, said on stderr), rdma, or tcp.
    #[arg(long, value_enum, default_value_t = super::transfer::TransportArg::Auto)]
    pub(crate) transport: super::transfer::TransportArg,
    /// With an etcd:// catalog address: use this node's copy of the region (default: the
    /// best replica that answers: direct path first, then the least loaded node).
    #[arg(long, value_name = "NODE")]
    pub(crate) node: Option<String>,
    #[command(flatten)]
    pub(crate) etcd: super::catalog::EtcdArgs,
}

fn parse_retry_wait(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("'{s}' is not a number of seconds from 0 to 3600")),
    }
}

/// `--retries`: a failed transfer tried again on a new connection, after a wait that doubles
/// (`bridge::Retries`, each retry said on stderr).
#[derive(Debug)]
pub(crate) struct Retry(pub(crate) bridge::Retries);

impl Retry {
    pub(crate) fn new(a: &ClientArgs) -> Retry {
        Retry(
            bridge::Retries::new(a.retries, Duration::from_secs_f64(a.retry_wait))
                .saying(|s| eprintln!("p2p-rdma: {s}")),
        )
    }

    /// The first connection and open of the transfer `what`: `open` again, after the same
    /// waits, while it fails in a way a new connection may get past (the server not up yet)
    /// and tries are left. The tries count against the same N as the later ones.
    pub(crate) async fn start<T, F>(
        &mut self,
        what: &str,
        mut open: impl FnMut() -> F,
    ) -> anyhow::Result<T>
    where
        F: std::future::Future<Output = anyhow::Result<T>>,
    {
        loop {
            let e = match open().await {
                Ok(t) => return Ok(t),
                Err(e) => e,
            };
            let transient = e
                .downcast_ref::<bridge::Error>()
                .is_some_and(bridge::Error::is_transient);
            if !transient || self.0.left() == 0 {
                return Err(e);
            }
            self.0
                .take_turn(&format!("could not start the {what} ({e}); trying again"))
                .await;
        }
    }

    /// After `e` ended the transfer `what`: if it is worth another try and tries are left,
    /// wait, connect `c` again and open `region` again for `purpose`. None: give up with `e`
    /// (not transient, no try left, or the new connection's open was refused outright).
    pub(crate) async fn again(
        &mut self,
        c: &mut bridge::Client,
        e: &bridge::Error,
        what: &str,
        region: &str,
        purpose: bridge::OpenFor,
    ) -> Option<bridge::OpenRegion> {
        self.0.again(c, e, what, region, purpose).await
    }
}
