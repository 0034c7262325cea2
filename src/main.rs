//! The `p2p-rdma` command line.
#![forbid(unsafe_code)]

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use p2p_rdma::loopback::{self, LoopbackConfig, Op};
use verbs::CqMode;

use bridge::size::{human, parse_size};

/// Exit status: success.
const EXIT_OK: u8 = 0;
/// Exit status: the operation failed (transfer error, data mismatch, verbs error).
const EXIT_FAILED: u8 = 1;
/// Exit status: the server refused the request (unknown region, out of range, read-only, busy).
const EXIT_REFUSED: u8 = 3;
/// Exit status: authentication failed (wrong or missing token) or protocol versions differ.
const EXIT_AUTH: u8 = 4;
/// Exit status: the server cannot be reached (not running, wrong address, timeout).
const EXIT_UNREACHABLE: u8 = 5;
/// Exit status: `--verify` found different checksums.
const EXIT_MISMATCH: u8 = 6;
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
    after_help = "Exit status: 0 success, 1 failure, 2 bad usage, 3 request refused by the server (unknown region, \
                  out of range, read-only, busy), 4 wrong/missing token or protocol version mismatch, 5 server \
                  unreachable, 6 --verify mismatch, 69 no RDMA device or libibverbs missing.\n\
                  Logging: RUST_LOG=p2p_rdma=debug,verbs=debug for details."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve memory regions to remote clients over RDMA (one-sided READ/WRITE on RC QPs).
    ///
    /// Each client connection gets its own protection domain and QP; a region is registered for
    /// a connection when the client opens it, so its rkey is valid only there and dies when the
    /// client closes it or goes away. SIGINT/SIGTERM stop accepting, let connections finish
    /// (10 s at most) and release everything.
    #[command(
        after_help = "Region specs (NAME=KIND:ARGS[,OPTION=VALUE]...):\n  NAME=host:SIZE          zeroed RAM (K/M/G suffixes)\n  NAME=host:SIZE:huge     from huge pages (vm.nr_hugepages must be set)\n  NAME=file:PATH          a file, mapped shared: puts change the file (it must not shrink while served)\n  NAME=file:PATH:ro       read-only: registered without remote write, so the NIC itself refuses puts\n  NAME=cmb:DEV:SIZE       peer memory of a PCI device through P2PDMA (an NVMe CMB): DEV is a PCI\n                          address (0000:03:00.0) or a controller (nvme0); needs Linux >= 6.2 with\n                          CONFIG_PCI_P2PDMA, as root\n  NAME=dmabuf:SIZE        a dma-buf from the built-in exporter (memfd + /dev/udmabuf)\n  NAME=devpriv:memfd:SIZE device-private memory emulated by a memfd this process never maps: copy\n                          engine pread/pwrite, a P2P window of udmabuf exports (,window=SIZE),\n                          ,policy=copy (bounce, stays on the device) or migrate (to host RAM)\n  NAME=devpriv:hmm:SIZE   real device-private pages of the kernel's HMM test driver (test_hmm,\n                          /dev/hmm_dmirror0): migrated to the device at start; ODP preferred\n  NAME=devpriv:cuda:GPU:SIZE  GPU memory as device-private memory (--features cuda): copy engine\n                          cuMemcpy, a P2P window of dma-buf exports of 64 KiB units (,window=SIZE)\n  NAME=cuda:GPU:SIZE      memory of CUDA GPU number GPU (build with --features cuda; libcuda.so.1 is\n                          loaded at run time), registered through its dma-buf export (needs NVIDIA's\n                          open kernel modules) and otherwise served by cuMemcpy through bounce buffers\n  options: ,p2p=required|preferred|disabled  ,reg=auto|pinned|odp|dmabuf  ,window=SIZE (only the\n           first SIZE bytes direct, the rest through bounce buffers)\n\nPaths: for each region the server tries dma-buf, pinned and ODP registration (or the one --reg\nnames) and proves the first that registers with a canary transfer (RDMA WRITE + READ compared\nbyte for byte). A region that no strategy serves goes through bounce buffers: the server copies\nwith the memory's copy engine into registered host staging buffers and RDMA-writes them to the\nclient (or reads the client's for a put). --p2p required refuses such a region (and says why);\n--p2p disabled forces bounce. The path and its reason are printed at start and shown by `ls`.\nDevice-private regions: units mapped in the P2P window move zero-copy (RDMA straight from or to\nMRs of their window mappings) when a canary on one mapped unit proves a strategy; `ls` says so\nafter \"window units:\", and fetch/put --json count them as zero_copy_bytes.\n\nExample:\n  head -c 32 /dev/urandom | base64 > token\n  p2p-rdma serve --listen 0.0.0.0:7471 --token-file token --region ram=host:1G --region img=file:/data/img.bin:ro --region cmb=cmb:nvme0:16M"
    )]
    Serve {
        /// RDMA device (default: the first one with an active port).
        #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
        device: Option<String>,
        /// Control address to listen on.
        #[arg(long, default_value = "0.0.0.0:7471")]
        listen: std::net::SocketAddr,
        #[command(flatten)]
        token: TokenArgs,
        /// A region to serve (repeatable): NAME=host:SIZE[:huge], NAME=file:PATH[:ro],
        /// NAME=cmb:DEV:SIZE, NAME=dmabuf:SIZE or NAME=cuda:GPU:SIZE (see below).
        #[arg(long = "region", short = 'r', required = true, value_name = "SPEC")]
        regions: Vec<bridge::RegionSpec>,
        /// Peer-to-peer policy: required (refuse regions that cannot go direct), preferred
        /// (bounce when no strategy works), disabled (always bounce).
        #[arg(long, default_value = "preferred", value_name = "POLICY")]
        p2p: peermem::plan::P2pPolicy,
        /// Registration strategy: auto tries dma-buf, pinned, then ODP; pinned, odp or dmabuf
        /// force one (the canary still runs).
        #[arg(long = "reg", default_value = "auto", value_name = "STRATEGY")]
        reg: peermem::plan::RegChoice,
        /// Bytes per bounce staging buffer (the largest bounce request).
        #[arg(long, default_value = "1M", value_parser = parse_size_arg)]
        bounce_chunk: u64,
        /// Bounce staging buffers per connection (copies and transfers in flight).
        #[arg(long, default_value_t = 8)]
        bounce_depth: usize,
        /// Most concurrent client connections.
        #[arg(long, default_value_t = 64)]
        max_connections: usize,
        /// RDMA operations a client may keep in flight.
        #[arg(long, default_value_t = 16)]
        max_outstanding: u32,
    },
    /// List the regions a server offers.
    #[command(
        after_help = "Example:\n  P2P_RDMA_TOKEN=$(cat token) p2p-rdma ls 10.0.0.1:7471 --json"
    )]
    Ls {
        /// Server control address HOST:PORT.
        addr: String,
        #[command(flatten)]
        token: TokenArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Seconds to wait for the server.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
    },
    /// Read (part of) a remote region with RDMA READ into a file or stdout.
    #[command(
        after_help = "Examples:\n  p2p-rdma fetch 10.0.0.1:7471 ram -o ram.bin --token-file token --verify\n  p2p-rdma fetch 10.0.0.1:7471 img --offset 4K --length 1M -o - --token-file token | sha256sum"
    )]
    Fetch {
        /// Server control address HOST:PORT.
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
        after_help = "Examples:\n  p2p-rdma put 10.0.0.1:7471 ram -i data.bin --token-file token --verify\n  tar c dir | p2p-rdma put 10.0.0.1:7471 ram -i - --offset 1M --token-file token"
    )]
    Put {
        /// Server control address HOST:PORT.
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
        /// dmabuf:SIZE, cuda:GPU:SIZE.
        #[arg(long, value_name = "SPEC")]
        region: String,
        /// Registration strategy: auto tries dma-buf, pinned, then ODP; pinned, odp or dmabuf
        /// force one.
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
        after_help = "Examples:\n  server$ p2p-rdma bench write\n  client$ p2p-rdma bench write 10.0.0.1 --size 1M --duration 5\n  server$ p2p-rdma bench read --mem cmb:nvme0:16M\n  client$ p2p-rdma bench read 10.0.0.1 --all --iters 1000 --validate --json\n  client$ p2p-rdma bench write 10.0.0.1 --lat --size 2\n\nThe server's --mem takes the region specs of `serve` (host:SIZE, file:PATH, cmb:DEV:SIZE,\ndmabuf:SIZE, cuda:GPU:SIZE). When that memory cannot be registered direct (the canary decides),\nthe server serves it through the bridge's bounce pipeline and the client measures put/fetch of\neach size on that path (bandwidth runs only). The client's buffers are host RAM.\n\nCompare with perftest on the same devices: soft-roce/compare (lab) prints the ratios."
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
        /// Both directions at once (write and read).
        #[arg(long, short = 'b')]
        bidir: bool,
        /// Latency instead of bandwidth.
        #[arg(long)]
        lat: bool,
        /// Server: the memory to benchmark (a region spec of `serve`, without the name).
        #[arg(long, value_name = "SPEC")]
        mem: Option<String>,
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
        /// GID index (default: RoCE v2 with an IPv4-mapped address).
        #[arg(long, short = 'x')]
        gid_index: Option<u32>,
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
        let t = match &self.token_file {
            Some(p) => std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the token file {}", p.display()))?,
            None => std::env::var("P2P_RDMA_TOKEN").map_err(|_| anyhow::anyhow!(MissingToken))?,
        };
        let t = t.trim().to_string();
        if t.is_empty() {
            anyhow::bail!(MissingToken);
        }
        Ok(t)
    }
}

#[derive(Debug)]
struct BenchMismatch;
impl std::fmt::Display for BenchMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("--validate: the data did not match (see the rows marked DATA MISMATCH)")
    }
}
impl std::error::Error for BenchMismatch {}

#[derive(Debug)]
struct MissingToken;
impl std::fmt::Display for MissingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no token: give --token-file FILE or set P2P_RDMA_TOKEN (the token file must not be empty)")
    }
}
impl std::error::Error for MissingToken {}

/// Options every data-moving client command shares.
#[derive(clap::Args, Debug, Clone)]
struct ClientArgs {
    /// RDMA device (default: the first one with an active port).
    #[arg(long, short = 'd', env = "P2P_RDMA_DEVICE")]
    device: Option<String>,
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
            ExitCode::from(exit_code(&e))
        }
    }
}

fn exit_code(e: &anyhow::Error) -> u8 {
    use bridge::protocol::ErrorCode;
    for c in e.chain() {
        if c.downcast_ref::<MissingToken>().is_some() {
            return EXIT_AUTH;
        }
        if c.downcast_ref::<BenchMismatch>().is_some() {
            return EXIT_MISMATCH;
        }
        if let Some(b) = c.downcast_ref::<p2p_rdma::bench::BenchError>() {
            match b {
                p2p_rdma::bench::BenchError::Verbs(
                    verbs::Error::NoDevice { .. }
                    | verbs::Error::LibraryMissing { .. }
                    | verbs::Error::DeviceNotFound { .. },
                ) => return EXIT_UNAVAILABLE,
                p2p_rdma::bench::BenchError::Unreachable(_) => return EXIT_UNREACHABLE,
                _ => {}
            }
        }
        if let Some(v) = c.downcast_ref::<verbs::Error>() {
            if matches!(
                v,
                verbs::Error::NoDevice { .. }
                    | verbs::Error::LibraryMissing { .. }
                    | verbs::Error::DeviceNotFound { .. }
            ) {
                return EXIT_UNAVAILABLE;
            }
        }
        if let Some(b) = c.downcast_ref::<bridge::Error>() {
            return match b {
                bridge::Error::Connect { .. } | bridge::Error::Timeout { .. } => EXIT_UNREACHABLE,
                bridge::Error::Version { .. } => EXIT_AUTH,
                bridge::Error::Server { code, .. } => match code {
                    ErrorCode::Unauthorized | ErrorCode::BadVersion => EXIT_AUTH,
                    _ => EXIT_REFUSED,
                },
                bridge::Error::Mismatch { .. } => EXIT_MISMATCH,
                bridge::Error::Verbs(
                    verbs::Error::NoDevice { .. }
                    | verbs::Error::LibraryMissing { .. }
                    | verbs::Error::DeviceNotFound { .. },
                ) => EXIT_UNAVAILABLE,
                _ => EXIT_FAILED,
            };
        }
    }
    EXIT_FAILED
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
        Cmd::Serve {
            device,
            listen,
            token,
            regions,
            max_connections,
            max_outstanding,
            p2p,
            reg,
            bounce_chunk,
            bounce_depth,
        } => {
            let mut cfg = bridge::ServerConfig::new(listen, token.load()?, regions);
            cfg.device = device;
            cfg.max_connections = max_connections;
            cfg.max_outstanding = max_outstanding.max(1);
            cfg.p2p = p2p;
            cfg.reg = reg;
            cfg.bounce_chunk = usize::try_from(bounce_chunk)
                .ok()
                .filter(|&c| (1..=1 << 30).contains(&c))
                .context("--bounce-chunk must be 1 byte to 1 GiB")?;
            anyhow::ensure!(bounce_depth >= 1, "--bounce-depth must be at least 1");
            cfg.bounce_depth = bounce_depth;
            let server = bridge::Server::bind(cfg).await?;
            let addr = server.local_addr()?;
            eprintln!(
                "p2p-rdma: serving on {addr} with RDMA device {}:",
                server.device()
            );
            for r in server.reports() {
                let i = &r.info;
                eprintln!(
                    "  {:<16} {:>12}  {}  {:<9} {}{}",
                    i.name,
                    human(i.size),
                    i.access,
                    i.kind,
                    i.path,
                    i.strategy
                        .as_deref()
                        .map(|s| format!(" ({s})"))
                        .unwrap_or_default()
                );
                eprintln!("      why: {}", i.reason);
            }
            server.run(shutdown_signal()).await?;
            eprintln!("p2p-rdma: stopped");
            Ok(())
        }
        Cmd::Ls {
            addr,
            token,
            json,
            timeout,
        } => {
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
            let mut c = bridge::Client::connect(client_config(addr, &client)?).await?;
            let r = c.open(&region, false).await?;
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
            let rep = c
                .fetch(&r, offset, len, sink.as_mut(), verify, &mut |d| {
                    bar.update(d)
                })
                .await;
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
                    anyhow::bail!("--length {l} is more than the {n} bytes of {input}")
                }
                (Some(l), _) => Some(l),
                (None, n) => n,
            };
            let mut c = bridge::Client::connect(client_config(addr, &client)?).await?;
            let r = c.open(&region, true).await?;
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
            tx_depth,
            cq_mod,
            poll,
            qps,
            bidir,
            lat,
            mem,
            p2p,
            reg,
            validate,
            report_gbits,
            json,
            device,
            gid_index,
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
                gid_index,
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
            };
            params.check().map_err(|e| anyhow::anyhow!("{e}"))?;
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

/// The topology doctor's verdict for the pair (RDMA device, the memory's PCI device), when the
/// memory lives on a PCI device.
fn topology_plan(provider: &dyn peermem::Provider, rdma: &str) -> Option<peermem::topology::Pair> {
    use peermem::topology::{Extra, Sysfs, Topology};
    let bdf = provider.pci_device()?;
    let extra = Extra {
        probes: driver_probes()
            .into_iter()
            .filter(|(n, _)| n == rdma)
            .collect(),
        kernel_config_p2pdma: Extra::read_kernel_config(),
    };
    let topo = Topology::read(&Sysfs::new("/sys"), &extra);
    let r = topo.rdma.iter().find(|r| r.name == rdma)?;
    Some(topo.pair(r, topo.device(&bdf)?))
}

/// Driver probes for every RDMA device the live system has (ODP caps, dma-buf MR probe).
fn driver_probes() -> std::collections::BTreeMap<String, peermem::topology::DriverProbe> {
    use peermem::topology::{DriverProbe, Support};
    let mut out = std::collections::BTreeMap::new();
    let Ok(names) = verbs::device_names() else {
        return out;
    };
    for name in names {
        let probe = match verbs::Context::open(Some(&name)) {
            Ok(ctx) => {
                let odp = ctx.info().caps.odp;
                let (dmabuf_mr, why) = match verbs::ProtectionDomain::new(&ctx) {
                    Ok(pd) => match pd.probe_dmabuf_mr() {
                        verbs::DmabufSupport::Supported => (
                            Support::Supported,
                            "ibv_reg_dmabuf_mr(fd=-1): EBADF".to_string(),
                        ),
                        verbs::DmabufSupport::Unsupported => (
                            Support::Unsupported,
                            "ibv_reg_dmabuf_mr(fd=-1): EOPNOTSUPP".to_string(),
                        ),
                        verbs::DmabufSupport::Unknown(d) => (Support::Unknown, d),
                    },
                    Err(e) => (Support::Unknown, format!("no protection domain: {e}")),
                };
                DriverProbe {
                    odp: if odp.rc_rdma() {
                        Support::Supported
                    } else {
                        Support::Unsupported
                    },
                    dmabuf_mr,
                    detail: format!(
                        "odp general_caps {:#x} rc_odp_caps {:#x}; {why}",
                        odp.general_caps, odp.rc_odp_caps
                    ),
                }
            }
            Err(e) => DriverProbe {
                odp: Support::Unknown,
                dmabuf_mr: Support::Unknown,
                detail: format!("cannot open {name}: {e}"),
            },
        };
        out.insert(name, probe);
    }
    out
}

fn topo(
    root: &std::path::Path,
    json: bool,
    capture: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    use peermem::topology::{Extra, Sysfs, Topology, CAPTURE_FILE};
    if !root.is_dir() {
        anyhow::bail!(
            "--sysfs-root {}: not a directory (give /sys, a fixture, or a directory made by --capture)",
            root.display()
        );
    }
    let fs = if capture.is_some() {
        Sysfs::recording(root)
    } else {
        Sysfs::new(root)
    };
    let extra = if fs.is_live() {
        Extra {
            probes: driver_probes(),
            kernel_config_p2pdma: Extra::read_kernel_config(),
        }
    } else {
        Extra::load(root).map_err(|e| anyhow::anyhow!("{e}"))?
    };
    let topo = Topology::read(&fs, &extra);
    let report = topo.report();
    if let Some(dir) = capture {
        if dir.exists()
            && std::fs::read_dir(dir)
                .with_context(|| format!("--capture {}", dir.display()))?
                .next()
                .is_some()
        {
            anyhow::bail!(
                "--capture {}: the directory is not empty (give a new directory)",
                dir.display()
            );
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let n = fs
            .capture_into(dir)
            .with_context(|| format!("copying sysfs into {}", dir.display()))?;
        std::fs::write(dir.join(CAPTURE_FILE), serde_json::to_vec_pretty(&extra)?)
            .with_context(|| format!("writing {}", dir.join(CAPTURE_FILE).display()))?;
        emit(&format!(
            "captured {n} sysfs entries ({} PCI functions, {} RDMA devices) and the driver probes into {}\nreplay: p2p-rdma topo --sysfs-root {}\n",
            topo.devices().count(),
            topo.rdma.len(),
            dir.display(),
            dir.display()
        ))?;
        return Ok(());
    }
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        emit(&report.render())?;
    }
    Ok(())
}

async fn doctor(
    spec: &str,
    reg: peermem::plan::RegChoice,
    device: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    use peermem::plan::{decide, P2pPolicy, PathKind};
    let parsed: bridge::RegionSpec = format!("doctor={spec}").parse().map_err(|e: String| {
        anyhow::anyhow!("--region {spec}: {}", e.replace("region 'doctor': ", ""))
    })?;
    let (provider, _) = parsed.open(std::path::Path::new("/sys"))?;
    let ctx = verbs::Context::open(device)?;
    let pd = verbs::ProtectionDomain::new(&ctx)?;
    let len = provider.len();
    let window = parsed.options.window.map_or(len, |w| w.min(len));
    let plan = topology_plan(provider.as_ref(), ctx.name());
    let residency_before = provider.residency();
    let planned = decide(&pd, &provider, 0..window, reg, P2pPolicy::Preferred)
        .await
        .map_err(|r| anyhow::anyhow!("{r}"))?;
    let residency_after = provider.residency();
    let window_proof = match provider.as_device_private() {
        Some(dp) if dp.window_size() > 0 => {
            Some(peermem::plan::prove_window(&pd, dp, reg, P2pPolicy::Preferred).await)
        }
        _ => None,
    };
    let d = &planned.decision;
    let direct = d.path == PathKind::Direct;
    if json {
        emit(&format!(
            "{}\n",
            serde_json::json!({
                "device": ctx.name(),
                "plan": plan,
                "memory": provider.kind(),
                "describe": provider.describe(),
                "size": len,
                "attempts": d.attempts,
                "chosen": d.mode,
                "path": d.path,
                "reason": d.reason,
                "copy_engine": provider.copy_engine(),
                "residency_before": residency_before,
                "residency_after": residency_after,
                "window": window_proof,
            })
        ))?;
    } else {
        let mut o = format!("{} on {}:\n", provider.describe(), ctx.name());
        match &plan {
            Some(p) => {
                o.push_str(&format!(
                    "  plan (PCIe topology): {} -> {}: {} {}\n",
                    p.nic_pci.as_deref().unwrap_or("no PCI device"),
                    p.device_pci,
                    p.path.map(|c| c.as_str()).unwrap_or("-"),
                    p.verdict.as_str()
                ));
                for r in p
                    .reasons
                    .iter()
                    .filter(|r| r.severity != peermem::topology::Severity::Info)
                {
                    o.push_str(&format!("    [{}] {}\n", r.code, r.message));
                }
            }
            None => o.push_str("  plan: host memory, no PCIe peer path involved\n"),
        }
        if let Some(r) = &residency_before {
            o.push_str(&format!("  residency before the attempts: {r}\n"));
        }
        for a in &d.attempts {
            o.push_str(&format!("  {a}\n"));
        }
        if let Some(r) = &residency_after {
            o.push_str(&format!("  residency after the attempts: {r}\n"));
        }
        if let Some(w) = &window_proof {
            o.push_str("  P2P window, on the mapping of one unit:\n");
            for a in &w.attempts {
                o.push_str(&format!("    {a}\n"));
            }
            o.push_str(&format!("  window units: {}\n", w.reason));
        }
        o.push_str(&match d.mode {
            Some(m) if direct => format!("=> direct: {m} registration works\n"),
            _ => format!(
                "=> no direct strategy works: served through bounce buffers (copy engine: {})\n",
                provider.copy_engine()
            ),
        });
        emit(&o)?;
    }
    if direct {
        Ok(())
    } else {
        Err(anyhow::anyhow!(
            "no registration strategy passed: {}",
            d.attempts
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        ))
    }
}

fn client_config(addr: String, a: &ClientArgs) -> anyhow::Result<bridge::ClientConfig> {
    let mut cfg = bridge::ClientConfig::new(addr, a.token.load()?);
    cfg.device = a.device.clone();
    cfg.chunk = usize::try_from(a.chunk).context("--chunk is too large")?;
    cfg.depth = a.depth;
    cfg.timeout = Duration::from_secs(a.timeout.max(1));
    Ok(cfg)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    eprintln!("p2p-rdma: shutting down (no new connections; letting current ones finish)");
}

/// Clear the progress line, release the region and the connection, then report.
async fn finish_transfer(
    mut c: bridge::Client,
    r: &bridge::OpenRegion,
    rep: bridge::Result<bridge::TransferReport>,
    bar: Progress,
    json: bool,
) -> anyhow::Result<()> {
    bar.finish();
    let rep = rep?;
    let _ = c.close(r).await;
    let _ = c.bye().await;
    print_report(&rep, json)
}

fn print_report(r: &bridge::TransferReport, json: bool) -> anyhow::Result<()> {
    if json {
        return emit(&format!("{}\n", serde_json::to_string(r)?));
    }
    eprintln!(
        "p2p-rdma: {} {} of '{}' at offset {} in {:.3} s ({:.2} MiB/s; direct {}, bounce {}{}){}",
        r.op,
        human(r.bytes),
        r.region,
        r.offset,
        r.seconds,
        r.mib_per_sec,
        human(r.direct_bytes),
        human(r.bounce_bytes),
        if r.zero_copy_bytes > 0 {
            format!(
                " of which {} zero-copy from the device's P2P window",
                human(r.zero_copy_bytes)
            )
        } else {
            String::new()
        },
        if r.verified {
            format!(", CRC-32C {:#010x} verified", r.crc32c)
        } else {
            String::new()
        }
    );
    Ok(())
}

/// A progress line on stderr when it is a terminal (and no JSON was asked for).
struct Progress {
    total: u64,
    on: bool,
    start: std::time::Instant,
    last: std::time::Instant,
}

impl Progress {
    fn new(total: u64, json: bool) -> Progress {
        let now = std::time::Instant::now();
        Progress {
            total,
            on: !json && std::io::stderr().is_terminal(),
            start: now,
            last: now,
        }
    }

    fn update(&mut self, done: u64) {
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
