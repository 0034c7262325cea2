//! `bench`: perftest-style bandwidth and latency runs, server or client side.

use clap::ValueEnum;

use super::exit::BenchMismatch;
use super::{emit, parse_size_arg};

#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum BenchOpArg {
    Write,
    Read,
    Send,
}

/// `bench`: perftest's options, plus the server's memory.
#[derive(clap::Args, Debug)]
pub(crate) struct BenchArgs {
    /// write, read or send.
    #[arg(value_enum)]
    pub(crate) op: BenchOpArg,
    /// The server to run against (HOST or HOST:PORT); none: be the server.
    pub(crate) server: Option<String>,
    /// TCP port of the control connection (perftest's default).
    #[arg(long, short = 'p', default_value_t = 18515)]
    pub(crate) port: u16,
    /// Message size (K/M/G suffixes).
    #[arg(long, short = 's', value_parser = parse_size_arg, conflicts_with = "all")]
    pub(crate) size: Option<u64>,
    /// Every size from 2 B to 8 MiB in powers of two.
    #[arg(long, short = 'a')]
    pub(crate) all: bool,
    /// Messages per QP per size (default 5000, 1000 with --lat).
    #[arg(long, short = 'n', conflicts_with = "duration")]
    pub(crate) iters: Option<u64>,
    /// Seconds per size instead of --iters.
    #[arg(long, short = 'D')]
    pub(crate) duration: Option<f64>,
    /// With --duration: seconds not measured at each end (warm-up, drain), as perftest's
    /// --margin (default: a quarter of --duration, perftest's default too).
    #[arg(long, requires = "duration")]
    pub(crate) margin: Option<f64>,
    /// Work requests in flight per QP.
    #[arg(long, short = 't', default_value_t = 128)]
    pub(crate) tx_depth: u32,
    /// Ask for a completion every N work requests (like perftest's --cq-mod); the ones
    /// between complete with it. Default: one per 256 KiB moved, at most --tx-depth/4
    /// apart (messages of 256 KiB and more: each). 1: every one.
    #[arg(long = "cq-mod", short = 'Q')]
    pub(crate) cq_mod: Option<u32>,
    /// Busy-poll the completion queues on both sides, as perftest does by default, instead
    /// of sleeping on completion events (perftest's --use_event): no interrupt and wake-up
    /// per completion, but one core spins on each host while a run lasts. A bandwidth run's
    /// spin calls sched_yield after each poll that did not complete what it waits for, so that
    /// kernel work on its CPU (a soft-RoCE device's workers) is not held up. A latency run
    /// (--lat) then spins on a thread of its own on each side and writes each next message
    /// into the send queue before the last one completes; the poll that sees the completion
    /// rings its doorbell. A WRITE ping-pong then goes as ib_write_lat: plain WRITEs, each
    /// side polling the message's last byte in its own memory (cq "memory" in the report;
    /// without --poll, WRITEs with immediate data awaited as receive completions). Without
    /// --poll the client's latency loop also runs on a thread of its own, sleeping on the
    /// completion channel between completions, as perftest's --use_event.
    #[arg(long)]
    pub(crate) poll: bool,
    /// RDMA READs in flight at once per QP (perftest's --outs); the server accepts as many.
    /// Default: as many as the device allows (perftest's default too; rxe: 128). Each READ
    /// in flight holds a responder resource on the server.
    #[arg(long, short = 'o', value_name = "N")]
    pub(crate) outs: Option<u32>,
    /// Queue pairs.
    #[arg(long, short = 'q', default_value_t = 1)]
    pub(crate) qps: u32,
    /// Messages of at most this many bytes travel inside their work request (perftest's
    /// --inline_size). Default as perftest: 220 for write --lat, 236 for send --lat, else 0.
    #[arg(long = "inline-size", short = 'I', value_name = "BYTES")]
    pub(crate) inline: Option<u32>,
    /// Both directions at once (write and read).
    #[arg(long, short = 'b')]
    pub(crate) bidir: bool,
    /// Latency instead of bandwidth.
    #[arg(long)]
    pub(crate) lat: bool,
    /// Server: the memory to benchmark (a region spec of `serve`, without the name).
    #[arg(long, value_name = "SPEC")]
    pub(crate) mem: Option<String>,
    /// The shared secret, the same on both sides (default: $P2P_RDMA_TOKEN); the server
    /// refuses a client without it.
    #[arg(long, value_name = "FILE")]
    pub(crate) token_file: Option<std::path::PathBuf>,
    /// Server: P2P policy for --mem.
    #[arg(long, default_value = "preferred", value_name = "POLICY")]
    pub(crate) p2p: peermem::plan::P2pPolicy,
    /// Server: registration strategy for --mem.
    #[arg(long = "reg", default_value = "auto", value_name = "STRATEGY")]
    pub(crate) reg: peermem::plan::RegChoice,
    /// Server: let the benchmark write into --mem memory that holds data (a file, or a block
    /// device's range: `nvme:/dev/nvme1n1:0:1G`), as `fio --rw=write` would; its bytes in the
    /// range are lost. Without it, a write (or bidirectional) benchmark of such memory is
    /// refused, and a read benchmark reads what it holds.
    #[arg(long, requires = "mem")]
    pub(crate) overwrite: bool,
    /// Check the data at the end of each size (like perftest's --data_validation).
    #[arg(long)]
    pub(crate) validate: bool,
    /// Bandwidth in Gb/s instead of MiB/s.
    #[arg(long)]
    pub(crate) report_gbits: bool,
    /// One JSON object per line per size.
    #[arg(long)]
    pub(crate) json: bool,
    /// RDMA device.
    #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
    pub(crate) device: Option<String>,
    #[command(flatten)]
    pub(crate) path: super::PathArgs,
    /// Device port.
    #[arg(long, short = 'i')]
    pub(crate) ib_port: Option<u8>,
}

pub(crate) async fn run(a: BenchArgs) -> anyhow::Result<()> {
    let BenchArgs {
        op,
        server,
        port,
        size,
        all,
        iters,
        duration,
        margin,
        tx_depth,
        cq_mod,
        poll,
        outs,
        qps,
        inline,
        bidir,
        lat,
        mem,
        token_file,
        p2p,
        reg,
        overwrite,
        validate,
        report_gbits,
        json,
        device,
        path,
        ib_port,
    } = a;
    use p2p_rdma::bench::{self, BenchOp, BenchParams, Side};
    let op = match op {
        BenchOpArg::Write => BenchOp::Write,
        BenchOpArg::Read => BenchOp::Read,
        BenchOpArg::Send => BenchOp::Send,
    };
    let side = Side {
        device,
        path: path.qp_path(),
        ib_port,
    };
    let Some(server) = server else {
        let listen: std::net::SocketAddr = ([0, 0, 0, 0], port).into();
        if !json {
            eprintln!(
                "p2p-rdma bench: waiting for a client on port {port} ({} {})",
                op.perftest(lat),
                if lat {
                    "style"
                } else {
                    "style; run the client with the same op"
                }
            );
        }
        let mem = bench::ServerMem {
            token: bridge::Token::new(super::read_token(token_file.as_deref())?),
            spec: mem,
            p2p,
            reg,
            overwrite,
        };
        return bench::serve_one(listen, &side, &mem)
            .await
            .map_err(Into::into);
    };
    if mem.as_deref().is_some_and(|m| !m.starts_with("host:")) {
        anyhow::bail!(
            "--mem on the client: its buffers are host RAM; give --mem to the server (the memory the operations target)"
        );
    }
    let sizes = if all {
        bench::all_sizes()
    } else {
        vec![size.unwrap_or(if lat { 2 } else { 65536 })]
    };
    let params = BenchParams {
        op,
        sizes,
        iters: if duration.is_some() {
            None
        } else {
            Some(iters.unwrap_or(if lat { 1000 } else { 5000 }))
        },
        duration,
        margin,
        tx_depth,
        qps,
        bidir,
        lat,
        validate,
        cq_mod: match cq_mod {
            Some(0) => anyhow::bail!("--cq-mod must be at least 1"),
            Some(n) => n,
            None => 0,
        },
        poll,
        inline,
        outs,
    };
    params.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    let token = bridge::Token::new(super::read_token(token_file.as_deref())?);
    let server = if server.contains(':') {
        server
    } else {
        format!("{server}:{port}")
    };
    if !json {
        emit(&bench::header(lat, report_gbits))?;
    }
    let mut failed = false;
    let results = bench::run_client(
        &bench::ClientOpts {
            server,
            token,
            side,
            params,
        },
        &mut |r| {
            failed |= r.validated == Some(false);
            let line = if json {
                format!("{}\n", serde_json::to_string(r).unwrap_or_default())
            } else {
                bench::row(r, report_gbits)
            };
            let _ = emit(&line);
        },
    )
    .await?;
    if !json {
        emit(&format!("{}\n", "-".repeat(100)))?;
    }
    if failed || results.iter().any(|r| r.validated == Some(false)) {
        anyhow::bail!(BenchMismatch);
    }
    Ok(())
}
