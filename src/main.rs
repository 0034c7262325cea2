//! The `p2p-rdma` command line.
#![forbid(unsafe_code)]

mod cli;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use p2p_rdma::loopback::{self, LoopbackConfig, Op};
use verbs::CqMode;

use cli::size::{human, parse_size};

/// Exit status: success.
const EXIT_OK: u8 = 0;
/// Exit status: the operation failed (transfer error, data mismatch, verbs error).
const EXIT_FAILED: u8 = 1;
/// Exit status: no RDMA device, or libibverbs is missing (sysexits EX_UNAVAILABLE).
const EXIT_UNAVAILABLE: u8 = 69;

#[derive(Parser, Debug)]
#[command(
    name = "p2p-rdma",
    version,
    about = "Serve PCIe device memory (NVMe CMB, dma-buf, GPU) to remote hosts over RoCE",
    long_about = "p2p-rdma registers host and device memory as RDMA memory regions and moves it \
                  with one-sided RDMA over RC queue pairs, explaining every path decision.\n\n\
                  No RDMA hardware? soft-roce/lab runs everything inside a QEMU guest with \
                  soft-RoCE (rxe): e.g. `soft-roce/lab -- target/release/p2p-rdma devices`.",
    after_help = "Exit status: 0 success, 1 failure, 2 bad usage, 69 no RDMA device or libibverbs missing.\n\
                  Logging: RUST_LOG=p2p_rdma=debug,verbs=debug for details."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List RDMA devices with their ports, GID tables and capabilities.
    #[command(
        after_help = "Examples:\n  p2p-rdma devices\n  p2p-rdma devices --json | jq '.[0].ports[0].gids'"
    )]
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Move data between two RC queue pairs of one device and report throughput.
    ///
    /// The smoke test of a node's RDMA stack (connect, register, one-sided WRITE/READ with data
    /// verification) and the verbs layer's own ib_write_bw / ib_read_bw-style loop: run both on
    /// the same device and compare the numbers.
    #[command(
        after_help = "Examples:\n  p2p-rdma loopback --verify\n  p2p-rdma loopback --op read --size 1M --depth 32 --duration 5\n  p2p-rdma loopback --json --iters 1000 --size 64K"
    )]
    Loopback {
        /// RDMA device (default: the first one with an active port).
        #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
        device: Option<String>,
        /// Operation to loop.
        #[arg(long, value_enum, default_value_t = OpArg::Write)]
        op: OpArg,
        /// Bytes per work request (K/M/G suffixes).
        #[arg(long, short = 's', default_value = "1M", value_parser = parse_size_arg)]
        size: u64,
        /// Work requests kept in flight.
        #[arg(long, default_value_t = 16)]
        depth: usize,
        /// Stop after this many work requests (default: run for --duration).
        #[arg(long, short = 'n', conflicts_with = "duration")]
        iters: Option<u64>,
        /// Seconds to run (default 3 unless --iters is given).
        #[arg(long, short = 'D')]
        duration: Option<f64>,
        /// Busy-poll the CQ instead of sleeping on completion events.
        #[arg(long)]
        poll: bool,
        /// First WRITE and READ a pattern and compare every byte.
        #[arg(long)]
        verify: bool,
        /// Print a JSON record instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OpArg {
    Write,
    Read,
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("p2p-rdma: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(e) => {
            eprintln!("p2p-rdma: error: {}", render_chain(&e));
            let unavailable = e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<verbs::Error>(),
                    Some(
                        verbs::Error::NoDevice { .. }
                            | verbs::Error::LibraryMissing { .. }
                            | verbs::Error::DeviceNotFound { .. }
                    )
                )
            });
            ExitCode::from(if unavailable {
                EXIT_UNAVAILABLE
            } else {
                EXIT_FAILED
            })
        }
    }
}

/// The error and its causes, each cause only if the text so far does not already say it.
fn render_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for c in e.chain() {
        let t = c.to_string();
        if out.contains(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
    }
    out
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Devices { json } => devices(json),
        Cmd::Loopback {
            device,
            op,
            size,
            depth,
            iters,
            duration,
            poll,
            verify,
            json,
        } => {
            let duration = match (iters, duration) {
                (None, None) => Some(Duration::from_secs(3)),
                (_, Some(d)) if !(d.is_finite() && d > 0.0) => {
                    anyhow::bail!("--duration must be a positive number of seconds")
                }
                (_, d) => d.map(Duration::from_secs_f64),
            };
            let cfg = LoopbackConfig {
                device,
                size: usize::try_from(size).context("--size does not fit in memory")?,
                depth,
                iters,
                duration,
                op: match op {
                    OpArg::Write => Op::Write,
                    OpArg::Read => Op::Read,
                },
                cq_mode: if poll {
                    CqMode::Polling
                } else {
                    CqMode::Events
                },
                verify,
            };
            let r = loopback::run(&cfg)
                .await
                .context("loopback transfer failed")?;
            if json {
                emit(&format!("{}\n", serde_json::to_string(&r)?))?;
            } else {
                emit(&format!(
                    "{} loopback on {}: {} x {} ({} in flight, path MTU {}){}\n  {} in {:.3} s: {:.2} MiB/s, {:.0} ops/s\n",
                    match r.op {
                        Op::Write => "RDMA WRITE",
                        Op::Read => "RDMA READ",
                    },
                    r.device,
                    r.iterations,
                    human(r.size as u64),
                    r.depth,
                    r.path_mtu,
                    if r.verified { ", data verified" } else { "" },
                    human(r.bytes),
                    r.seconds,
                    r.mib_per_sec,
                    r.ops_per_sec
                ))?;
            }
            Ok(())
        }
    }
}

/// Write to stdout; a closed pipe (`| head`) is not an error worth a panic.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn devices(json: bool) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let devs = verbs::devices()?;
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&devs)?))?;
    }
    if devs.is_empty() {
        return Err(verbs::no_device_error().into());
    }
    if json {
        return Ok(());
    }
    let mut o = String::new();
    for d in &devs {
        writeln!(
            o,
            "{}  node GUID {}  vendor {:#x}:{}  fw {}{}",
            d.name,
            d.node_guid,
            d.vendor_id,
            d.vendor_part_id,
            if d.fw_ver.is_empty() { "-" } else { &d.fw_ver },
            if d.software {
                "  (software RDMA: its DMA is CPU copies in the kernel)"
            } else {
                ""
            }
        )?;
        let c = &d.caps;
        writeln!(o,
            "  caps: max MR {}, {} MRs, {} QPs x {} WRs, {} CQEs, {} SGEs, rd_atom {}/{}, atomics {}",
            human(c.max_mr_size),
            c.max_mr,
            c.max_qp,
            c.max_qp_wr,
            c.max_cqe,
            c.max_sge,
            c.max_qp_rd_atom,
            c.max_qp_init_rd_atom,
            c.atomic
        )?;
        writeln!(
            o,
            "  ODP: {}",
            if !c.odp.supported {
                "not supported".to_string()
            } else {
                format!(
                    "supported{} (RC: read {}, write {}, send {}, recv {})",
                    if c.odp.implicit { ", implicit" } else { "" },
                    c.odp.rc_read,
                    c.odp.rc_write,
                    c.odp.rc_send,
                    c.odp.rc_recv
                )
            }
        )?;
        for p in &d.ports {
            writeln!(
                o,
                "  port {}: {} ({}), MTU {} active / {} max, LID {}",
                p.port, p.state, p.link_layer, p.active_mtu, p.max_mtu, p.lid
            )?;
            for g in &p.gids {
                writeln!(
                    o,
                    "    GID[{}] {:<40} {:<10} {}",
                    g.index,
                    g.gid.to_string(),
                    serde_json::to_value(g.kind)
                        .ok()
                        .and_then(|v| v.as_str().map(String::from))
                        .unwrap_or_default(),
                    g.netdev.as_deref().unwrap_or("-")
                )?;
            }
        }
    }
    emit(&o)?;
    Ok(())
}
