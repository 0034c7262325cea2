//! The `p2p-rdma` command line.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use p2p_rdma::loopback::{self, LoopbackConfig, Op};
use verbs::CqMode;

use bridge::size::{human, parse_size};

mod cli;

use cli::emit;
use cli::inspect::{devices, doctor, topo};
use cli::transfer::{client_config, finish_transfer, Progress};

use cli::exit::{self, BenchMismatch, Usage};

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
    Ls {
        /// Server control address HOST:PORT, or a catalog etcd://HOST:PORT[,...]/PREFIX:
        /// every region of the cluster, with the node serving it and its path (no token
        /// needed: the catalog holds no secret).
        addr: String,
        #[command(flatten)]
        token: TokenArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Seconds to wait for the server.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        /// With a catalog: after the listing, print regions and nodes as they come and go.
        #[arg(long)]
        watch: bool,
        #[command(flatten)]
        etcd: cli::catalog::EtcdArgs,
    },
    /// Read (part of) a remote region with RDMA READ into a file or stdout.
    #[command(
        after_help = "Examples:\n  p2p-rdma fetch 10.0.0.1:7471 ram -o ram.bin --token-file token --verify\n  p2p-rdma fetch 10.0.0.1:7471 img --offset 4K --length 1M -o - --token-file token | sha256sum\n  p2p-rdma fetch etcd://10.0.0.9:2379/prod img -o img.bin --token-file token\n\nBy name (an etcd:// catalog address): the nodes publishing the region are tried best first (direct\npath, then the fewest connections, then at random); one that cannot be reached or fails mid-way\nis skipped for the next (mid-way only when writing to a file, which starts over)."
    )]
    Fetch {
        /// Server control address HOST:PORT, or a catalog etcd://HOST:PORT[,...]/PREFIX to
        /// fetch from a node that serves the region.
        addr: String,
        /// Region name.
        region: String,
        /// Start offset in the region (K/M/G suffixes).
        #[arg(long, default_value = "0", value_parser = parse_size_arg)]
        offset: u64,
        /// Bytes to fetch (default: to the end of the region).
        #[arg(long, value_parser = parse_size_arg)]
        length: Option<u64>,
        /// Output file, or - for stdout.
        #[arg(short = 'o', long = "output", value_name = "FILE|-")]
        output: String,
        /// Compare a CRC-32C of the bytes received with the server's.
        #[arg(long)]
        verify: bool,
        /// Print a JSON result record.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Write a file or stdin into a remote region with RDMA WRITE.
    #[command(
        after_help = "Examples:\n  p2p-rdma put 10.0.0.1:7471 ram -i data.bin --token-file token --verify\n  tar c dir | p2p-rdma put 10.0.0.1:7471 ram -i - --offset 1M --token-file token\n  p2p-rdma put etcd://10.0.0.9:2379/prod scratch -i data.bin --node storage-7 --token-file token\n\nBy name, a region that several nodes publish needs --node: a put changes one replica only."
    )]
    Put {
        /// Server control address HOST:PORT, or a catalog etcd://HOST:PORT[,...]/PREFIX.
        addr: String,
        /// Region name.
        region: String,
        /// Start offset in the region (K/M/G suffixes).
        #[arg(long, default_value = "0", value_parser = parse_size_arg)]
        offset: u64,
        /// Bytes to put (default: the whole input; it must fit in the region).
        #[arg(long, value_parser = parse_size_arg)]
        length: Option<u64>,
        /// Input file, or - for stdin.
        #[arg(short = 'i', long = "input", value_name = "FILE|-")]
        input: String,
        /// Compare a CRC-32C of the bytes sent with the server's checksum of the range.
        #[arg(long)]
        verify: bool,
        /// Print a JSON result record.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
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
    Bench {
        /// write, read or send.
        #[arg(value_enum)]
        op: BenchOpArg,
        /// The server to run against (HOST or HOST:PORT); none: be the server.
        server: Option<String>,
        /// TCP port of the control connection (perftest's default).
        #[arg(long, short = 'p', default_value_t = 18515)]
        port: u16,
        /// Message size (K/M/G suffixes).
        #[arg(long, short = 's', value_parser = parse_size_arg, conflicts_with = "all")]
        size: Option<u64>,
        /// Every size from 2 B to 8 MiB in powers of two.
        #[arg(long, short = 'a')]
        all: bool,
        /// Messages per QP per size (default 5000, 1000 with --lat).
        #[arg(long, short = 'n', conflicts_with = "duration")]
        iters: Option<u64>,
        /// Seconds per size instead of --iters.
        #[arg(long, short = 'D')]
        duration: Option<f64>,
        /// With --duration: seconds not measured at each end (warm-up, drain), as perftest's
        /// --margin (default: a quarter of --duration, perftest's default too).
        #[arg(long, requires = "duration")]
        margin: Option<f64>,
        /// Work requests in flight per QP.
        #[arg(long, short = 't', default_value_t = 128)]
        tx_depth: u32,
        /// Ask for a completion every N work requests (like perftest's --cq-mod); the ones
        /// between complete with it. Default: one per 256 KiB moved, at most --tx-depth/4
        /// apart (messages of 256 KiB and more: each). 1: every one.
        #[arg(long = "cq-mod", short = 'Q')]
        cq_mod: Option<u32>,
        /// Busy-poll the completion queues on both sides, as perftest does by default, instead
        /// of sleeping on completion events (perftest's --use_event): no interrupt and wake-up
        /// per completion, but one core spins on each host while a run lasts.
        #[arg(long)]
        poll: bool,
        /// Queue pairs.
        #[arg(long, short = 'q', default_value_t = 1)]
        qps: u32,
        /// Messages of at most this many bytes travel inside their work request (perftest's
        /// --inline_size). Default as perftest: 220 for write --lat, 236 for send --lat, else 0.
        #[arg(long = "inline-size", short = 'I', value_name = "BYTES")]
        inline: Option<u32>,
        /// Both directions at once (write and read).
        #[arg(long, short = 'b')]
        bidir: bool,
        /// Latency instead of bandwidth.
        #[arg(long)]
        lat: bool,
        /// Server: the memory to benchmark (a region spec of `serve`, without the name).
        #[arg(long, value_name = "SPEC")]
        mem: Option<String>,
        /// The shared secret, the same on both sides (default: $P2P_RDMA_TOKEN); the server
        /// refuses a client without it.
        #[arg(long, value_name = "FILE")]
        token_file: Option<std::path::PathBuf>,
        /// Server: P2P policy for --mem.
        #[arg(long, default_value = "preferred", value_name = "POLICY")]
        p2p: peermem::plan::P2pPolicy,
        /// Server: registration strategy for --mem.
        #[arg(long = "reg", default_value = "auto", value_name = "STRATEGY")]
        reg: peermem::plan::RegChoice,
        /// Check the data at the end of each size (like perftest's --data_validation).
        #[arg(long)]
        validate: bool,
        /// Bandwidth in Gb/s instead of MiB/s.
        #[arg(long)]
        report_gbits: bool,
        /// One JSON object per line per size.
        #[arg(long)]
        json: bool,
        /// RDMA device.
        #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
        device: Option<String>,
        #[command(flatten)]
        path: cli::PathArgs,
        /// Device port.
        #[arg(long, short = 'i')]
        ib_port: Option<u8>,
    },
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

/// How a client finds the token.
#[derive(clap::Args, Debug, Clone)]
struct TokenArgs {
    /// File holding the shared secret (surrounding whitespace is ignored). Default: the
    /// environment variable P2P_RDMA_TOKEN.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
}

impl TokenArgs {
    fn load(&self) -> anyhow::Result<String> {
        cli::read_token(self.token_file.as_deref())
    }
}

/// Options every data-moving client command shares.
#[derive(clap::Args, Debug, Clone)]
struct ClientArgs {
    /// RDMA device (default: the one that carries the route to the server's device, else the
    /// first one with an active port).
    #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
    device: Option<String>,
    /// On a server that serves from several RDMA devices, connect to this one (default: the
    /// one that serves the region; `ls` names it). Another one reaches the region through the
    /// server's bounce buffers.
    #[arg(long, value_name = "DEVICE")]
    server_nic: Option<String>,
    #[command(flatten)]
    token: TokenArgs,
    /// Bytes per RDMA work request (K/M/G suffixes).
    #[arg(long, default_value = "1M", value_parser = parse_size_arg)]
    chunk: u64,
    /// Work requests in flight (capped by the server).
    #[arg(long, default_value_t = 16)]
    depth: usize,
    /// Seconds to wait for the server at each step.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    #[command(flatten)]
    path: cli::PathArgs,
    /// How the bytes travel: auto (RDMA when this host has an RDMA device, else TCP over the
    /// control connection, said on stderr), rdma, or tcp.
    #[arg(long, value_enum, default_value_t = cli::transfer::TransportArg::Auto)]
    transport: cli::transfer::TransportArg,
    /// With an etcd:// catalog address: use this node's copy of the region (default: the
    /// best replica that answers: direct path first, then the least loaded node).
    #[arg(long, value_name = "NODE")]
    node: Option<String>,
    #[command(flatten)]
    etcd: cli::catalog::EtcdArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OpArg {
    Write,
    Read,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum BenchOpArg {
    Write,
    Read,
    Send,
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
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
        Cmd::Ls {
            addr,
            token,
            json,
            timeout,
            watch,
            etcd,
        } => {
            if catalog::CatalogUrl::is_catalog(&addr) {
                let url = cli::catalog::url(&addr)?;
                let o = etcd.options(&Default::default())?;
                return cli::catalog::ls(&url, &o, json, watch).await;
            }
            if watch {
                return Err(
                    Usage("--watch follows a catalog: give an etcd:// address".into()).into(),
                );
            }
            let mut cfg = bridge::ClientConfig::new(addr, token.load()?);
            cfg.timeout = Duration::from_secs(timeout.max(1));
            let mut c = bridge::Client::connect(cfg).await?;
            let regions = c.list().await?;
            let _ = c.bye().await;
            if json {
                emit(&format!("{}\n", serde_json::to_string_pretty(&regions)?))
            } else {
                let mut o = format!(
                    "{:<16} {:>14} {:>10}  {:<6} {:<8} {:<7} {}\n",
                    "REGION", "BYTES", "SIZE", "ACCESS", "KIND", "PATH", "STRATEGY"
                );
                for r in regions {
                    o.push_str(&format!(
                        "{:<16} {:>14} {:>10}  {:<6} {:<8} {:<7} {}\n",
                        r.name,
                        r.size,
                        human(r.size),
                        r.access.to_string(),
                        r.kind,
                        r.path.to_string(),
                        r.strategy.as_deref().unwrap_or("-")
                    ));
                    if r.extents.len() > 1 {
                        for e in &r.extents {
                            o.push_str(&format!(
                                "    bytes {}..{}: {}\n",
                                e.offset,
                                e.offset + e.len,
                                e.path
                            ));
                        }
                    }
                    if !r.reason.is_empty() {
                        o.push_str(&format!("    why: {}\n", r.reason));
                    }
                    if let Some(res) = &r.residency {
                        o.push_str(&format!("    residency: {res}\n"));
                    }
                    if let Some(nic) = &r.nic {
                        o.push_str(&format!("    served from: {nic}\n"));
                    }
                }
                emit(&o)
            }
        }
        Cmd::Fetch {
            addr,
            region,
            offset,
            length,
            output,
            verify,
            json,
            client,
        } => {
            let base = client_config(String::new(), &client)?;
            let cli::catalog::Target {
                client: mut c,
                region: r,
                mut rest,
            } = cli::catalog::open(&addr, &region, false, &base, &client).await?;
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
            let mut sink: Box<dyn std::io::Write + Send> = if output == "-" {
                Box::new(std::io::BufWriter::with_capacity(
                    1 << 20,
                    std::io::stdout(),
                ))
            } else {
                Box::new(
                    std::fs::File::create(&output)
                        .with_context(|| format!("cannot create the output file {output}"))?,
                )
            };
            let mut bar = Progress::new(len, json);
            let mut rep = c
                .fetch(&r, offset, len, sink.as_mut(), verify, &mut |d| {
                    bar.update(d)
                })
                .await;
            let mut r = r;
            // by name, into a file: a node that fails mid-way is left for the next replica,
            // which writes the file again from the start
            while let Err(e) = &rep {
                if output == "-" || rest.is_empty() {
                    break;
                }
                eprintln!("p2p-rdma: catalog: node failed mid-way ({e}); trying the next replica");
                let b = match cli::catalog::next(&region, std::mem::take(&mut rest), false, &base)
                    .await
                {
                    Ok(b) => b,
                    Err(e2) => {
                        eprintln!("p2p-rdma: {e2:#}");
                        break;
                    }
                };
                (c, r, rest) = (b.client, b.region, b.rest);
                sink = Box::new(
                    std::fs::File::create(&output)
                        .with_context(|| format!("cannot create the output file {output}"))?,
                );
                rep = c
                    .fetch(&r, offset, len, sink.as_mut(), verify, &mut |d| {
                        bar.update(d)
                    })
                    .await;
            }
            finish_transfer(c, &r, rep, bar, json).await
        }
        Cmd::Put {
            addr,
            region,
            offset,
            length,
            input,
            verify,
            json,
            client,
        } => {
            let (mut source, size): (Box<dyn std::io::Read + Send>, Option<u64>) = if input == "-" {
                (Box::new(std::io::stdin()), None)
            } else {
                let f = std::fs::File::open(&input)
                    .with_context(|| format!("cannot open the input file {input}"))?;
                let n = f
                    .metadata()
                    .with_context(|| format!("cannot stat {input}"))?
                    .len();
                (
                    Box::new(std::io::BufReader::with_capacity(1 << 20, f)),
                    Some(n),
                )
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
            let base = client_config(String::new(), &client)?;
            let cli::catalog::Target {
                client: mut c,
                region: r,
                ..
            } = cli::catalog::open(&addr, &region, true, &base, &client).await?;
            let mut bar = Progress::new(limit.unwrap_or(r.info.size.saturating_sub(offset)), json);
            let rep = c
                .put(&r, offset, source.as_mut(), limit, verify, &mut |d| {
                    bar.update(d)
                })
                .await;
            finish_transfer(c, &r, rep, bar, json).await
        }
        Cmd::Bench {
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
            qps,
            inline,
            bidir,
            lat,
            mem,
            token_file,
            p2p,
            reg,
            validate,
            report_gbits,
            json,
            device,
            path,
            ib_port,
        } => {
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
                    token: bridge::Token::new(cli::read_token(token_file.as_deref())?),
                    spec: mem,
                    p2p,
                    reg,
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
            };
            params.check().map_err(|e| anyhow::anyhow!("{e}"))?;
            let token = bridge::Token::new(cli::read_token(token_file.as_deref())?);
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
