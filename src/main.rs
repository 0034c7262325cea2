//! The `p2p-rdma` command line.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use p2p_rdma::loopback::{self, LoopbackConfig, Op};
use verbs::CqMode;

use bridge::size::human;

mod cli;

use cli::emit;
use cli::inspect::{devices, doctor, topo};

use cli::exit;

#[derive(Parser, Debug)]
#[command(
    name = "p2p-rdma",
    version,
    about = "Serve PCIe device memory (NVMe CMB, dma-buf, GPU) to remote hosts over RoCE",
    long_about = "p2p-rdma registers host and device memory as RDMA memory regions and moves it \
                  with one-sided RDMA over RC queue pairs, explaining every path decision.\n\n\
                  No RDMA hardware? soft-roce/lab runs everything inside a QEMU guest with \
                  soft-RoCE (rxe): e.g. `soft-roce/lab -- target/release/p2p-rdma devices`.",
    after_help = exit::help()
)]
struct Cli {
    /// Log format on stderr: text, or json (one JSON object per line).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve memory regions to remote clients over RDMA (one-sided READ/WRITE on RC QPs).
    ///
    /// Each client connection gets its own protection domain and QP; a region is registered for
    /// a connection when the client opens it, so its rkey is valid only there and dies when the
    /// client goes away. Settings come from flags and/or a TOML --config file.
    #[command(after_help = cli::serve::help())]
    Serve(cli::serve::ServeArgs),
    /// List the regions a server offers.
    #[command(
        after_help = "Examples:\n  P2P_RDMA_TOKEN=$(cat token) p2p-rdma ls 10.0.0.1:7471 --json\n  p2p-rdma ls etcd://10.0.0.9:2379/prod            # the whole cluster\n  p2p-rdma ls etcd://10.0.0.9:2379/prod --watch    # and then its changes"
    )]
    Ls(cli::ls::LsArgs),
    /// Read (part of) a remote region with RDMA READ into a file or stdout.
    #[command(
        after_help = "Examples:\n  p2p-rdma fetch 10.0.0.1:7471 ram -o ram.bin --token-file token --verify\n  p2p-rdma fetch 10.0.0.1:7471 img --offset 4K --length 1M -o - --token-file token | sha256sum\n  p2p-rdma fetch etcd://10.0.0.9:2379/prod img -o img.bin --token-file token\n\nBy name (an etcd:// catalog address): the nodes publishing the region are tried best first (direct\npath, then the fewest connections, then at random); one that cannot be reached or fails mid-way\nis skipped for the next (mid-way only when writing to a file, which starts over)."
    )]
    Fetch(cli::fetch::FetchArgs),
    /// Write a file or stdin into a remote region with RDMA WRITE.
    #[command(
        after_help = "Examples:\n  p2p-rdma put 10.0.0.1:7471 ram -i data.bin --token-file token --verify\n  tar c dir | p2p-rdma put 10.0.0.1:7471 ram -i - --offset 1M --token-file token\n  p2p-rdma put etcd://10.0.0.9:2379/prod scratch -i data.bin --node storage-7 --token-file token\n\nBy name, a region that several nodes publish needs --node: a put changes one replica only."
    )]
    Put(cli::put::PutArgs),
    /// Try to register memory the way `serve` would, and prove each strategy with a canary.
    ///
    /// For each strategy (dma-buf, pinned, ODP) in order: register, then RDMA WRITE and READ
    /// through that MR on a loopback QP pair over a range longer than one path MTU starting
    /// partway into a page, and compare the bytes (a successful completion is not trusted).
    /// `--reg` forces one strategy for diagnosis.
    #[command(
        after_help = "Examples:\n  p2p-rdma doctor --region host:1M\n  p2p-rdma doctor --region host:1M --reg odp --json\n\nExit status 0 when the chosen strategy works, 1 when none does."
    )]
    Doctor {
        /// Memory to try, as in `serve` without the name: host:SIZE, file:PATH, cmb:DEV:SIZE,
        /// dmabuf:SIZE, cuda:GPU:SIZE; its options (,reg= ,p2p= ,window=) apply as in `serve`.
        #[arg(long, value_name = "SPEC")]
        region: String,
        /// Registration strategy: auto tries dma-buf, pinned, then ODP; pinned, odp or dmabuf
        /// force one (a ,reg= in the spec wins, as in `serve`).
        #[arg(long = "reg", default_value = "auto", value_name = "STRATEGY")]
        reg: peermem::plan::RegChoice,
        /// RDMA device (default: the first one with an active port).
        #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
        device: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Explain, for every RDMA NIC and every memory device (NVMe, GPU, accelerator), whether
    /// peer-to-peer DMA can work and why not.
    ///
    /// Reads the PCIe tree from sysfs: the path between the two (SAME, PIX one switch, PXB
    /// several bridges, PHB through a host bridge, SYS across sockets), ACS on every bridge of
    /// the path, the IOMMU groups and ATS, the kernel's P2PDMA host-bridge whitelist and CPU
    /// rule, CONFIG_PCI_P2PDMA, and (live only) what the RDMA driver accepts: ODP and dma-buf
    /// MRs. The verdict follows the kernel's own rule (calc_map_type_and_dist in
    /// drivers/pci/p2pdma.c): direct (by bus address below a common bridge),
    /// through_host_bridge, not_supported, or unknown; each reason has a stable code, a
    /// message and the fix. Run it as root: ACS and ATS live in the extended configuration
    /// space, which only root can read.
    #[command(
        after_help = "Examples:\n  p2p-rdma topo\n  p2p-rdma topo --json | jq '.pairs[] | {rdma_device, device_pci, path, verdict}'\n  p2p-rdma topo --capture /tmp/topo        # attach /tmp/topo to a bug report\n  p2p-rdma topo --sysfs-root /tmp/topo     # replay someone's machine\n\nThe RDMA device of software RDMA (rxe, siw) is shown with its netdev's PCI device; its \"DMA\" is\nCPU copies in the kernel. A replayed tree reports the driver probes its capture recorded."
    )]
    Topo {
        /// Read sysfs from this directory instead of /sys (a fixture, or a --capture).
        #[arg(long, value_name = "DIR", default_value = "/sys")]
        sysfs_root: std::path::PathBuf,
        /// Print JSON: {"system", "rdma_devices", "memory_devices", "pairs": [{"rdma_device",
        /// "nic_pci", "device_pci", "path", "verdict", "reasons": [{"code", "message", "fix"}]}]}.
        #[arg(long)]
        json: bool,
        /// Copy exactly the sysfs files and links this report reads into DIR (which must not
        /// exist or be empty), with the live driver probes, for replay with --sysfs-root DIR.
        #[arg(long, value_name = "DIR", conflicts_with = "json")]
        capture: Option<std::path::PathBuf>,
    },
    /// Measure RDMA WRITE, READ or SEND bandwidth or latency between two hosts, like perftest.
    ///
    /// Without SERVER: wait for one client (like perftest's server side), serve its runs, exit.
    /// With SERVER: run against it and print perftest's table plus the path (direct / bounce)
    /// and registration strategy of the server's memory. Bandwidth runs keep --tx-depth work
    /// requests in flight per QP and post every free slot in one batch (one doorbell); latency
    /// runs ping-pong one message (WRITE with immediate / SEND, reported one way like
    /// ib_write_lat / ib_send_lat) or time single READs (full round trip, like ib_read_lat).
    #[command(
        after_help = "Examples:\n  server$ export P2P_RDMA_TOKEN=$(cat token)   (both sides: the server refuses other clients)\n  server$ p2p-rdma bench write\n  client$ p2p-rdma bench write 10.0.0.1 --size 1M --duration 5\n  server$ p2p-rdma bench read --mem cmb:nvme0:16M\n  client$ p2p-rdma bench read 10.0.0.1 --all --iters 1000 --validate --json\n  client$ p2p-rdma bench write 10.0.0.1 --lat --size 2\n\nThe server's --mem takes the region specs of `serve` (host:SIZE, file:PATH, cmb:DEV:SIZE,\ndmabuf:SIZE, cuda:GPU:SIZE). When that memory cannot be registered direct (the canary decides),\nthe server serves it through the bridge's bounce pipeline and the client measures put/fetch of\neach size on that path (bandwidth runs only). The client's buffers are host RAM.\n\nCompare with perftest on the same devices: soft-roce/compare (lab) prints the ratios."
    )]
    Bench(cli::bench::BenchArgs),
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
        #[arg(long, short = 's', default_value = "1M", value_parser = cli::parse_size_arg)]
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
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(
        after_help = "Examples:\n  p2p-rdma completions bash > /etc/bash_completion.d/p2p-rdma\n  p2p-rdma completions zsh > \"${fpath[1]}/_p2p-rdma\""
    )]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write man pages (p2p-rdma.1 and one per subcommand) into DIR, or the main page to stdout.
    #[command(
        after_help = "Examples:\n  p2p-rdma man --dir /usr/local/share/man/man1\n  p2p-rdma man | man -l -"
    )]
    Man {
        /// Directory to write the pages to.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OpArg {
    Write,
    Read,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("p2p-rdma: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILED);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            eprintln!("p2p-rdma: error: {}", exit::render_chain(&e));
            ExitCode::from(exit::code_of(&e))
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Devices { json } => devices(json),
        Cmd::Topo {
            sysfs_root,
            json,
            capture,
        } => topo(&sysfs_root, json, capture.as_deref()),
        Cmd::Doctor {
            region,
            reg,
            device,
            json,
        } => doctor(&region, reg, device.as_deref(), json).await,
        Cmd::Serve(args) => cli::serve::run(args).await,
        Cmd::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "p2p-rdma", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Man { dir } => {
            cli::man::write(<Cli as clap::CommandFactory>::command(), dir.as_deref())
        }
        Cmd::Ls(a) => cli::ls::run(a).await,
        Cmd::Fetch(a) => cli::fetch::fetch(a).await,
        Cmd::Put(a) => cli::put::put(a).await,
        Cmd::Bench(a) => cli::bench::run(a).await,
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
