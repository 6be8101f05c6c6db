//! The `kvferry` command line: the MetaServer, the P/D trace replay (the
//! main job) and the benchmarks. Not built under the simulator.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use kvferry::gpu::{self, Gpu};
use kvferry::metaserver::service::{ConfigField, StartError};
use kvferry::metaserver::{self, MetaServerConfig};
use kvferry::node::TransportChoice;
use kvferry::replay::pd::{self, Handoff, PdConfig, PdError, Prefetch, Routing, SsdRoles};
use kvferry::tls::TlsIdentity;
use kvferry::transport::verbs::VerbsConfig;

/// Exit status when stdout or stderr is a closed pipe: what a process
/// killed by `SIGPIPE` reports (128 + 13), without a panic message.
const EXIT_CLOSED_PIPE: i32 = 141;

/// Writes one line to `w`; a closed pipe (`kvferry pd | head -1`) ends the
/// process quietly with [`EXIT_CLOSED_PIPE`] instead of panicking as
/// `println!` does; other write errors are ignored (nothing can report
/// them).
fn emit_line(mut w: impl std::io::Write, args: std::fmt::Arguments<'_>) {
    let r = w.write_fmt(args).and_then(|()| w.write_all(b"\n")).and_then(|()| w.flush());
    if let Err(e) = r {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(EXIT_CLOSED_PIPE);
        }
    }
}

/// `println!` that survives a closed stdout (see [`emit_line`]).
macro_rules! outln {
    () => { emit_line(std::io::stdout().lock(), format_args!("")) };
    ($($t:tt)*) => { emit_line(std::io::stdout().lock(), format_args!($($t)*)) };
}

/// `eprintln!` that survives a closed stderr (see [`emit_line`]).
macro_rules! errln {
    () => { emit_line(std::io::stderr().lock(), format_args!("")) };
    ($($t:tt)*) => { emit_line(std::io::stderr().lock(), format_args!($($t)*)) };
}

#[derive(Parser)]
#[command(name = "kvferry", version, about = "KV-cache storage and transfer core for P/D disaggregated LLM serving")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the MetaServer (cluster-wide block index) until SIGINT/SIGTERM.
    ///
    /// It listens on loopback (127.0.0.1:50055) unless --addr says
    /// otherwise: the MetaServer has no authentication, so reaching it from
    /// other machines is an explicit choice (--addr 0.0.0.0:50055 for every
    /// interface, or one interface's address).
    Metaserver {
        /// gRPC listen address, HOST:PORT; HOST may be a name (resolved,
        /// first address used). Default: loopback only.
        #[arg(long, default_value = "127.0.0.1:50055")]
        addr: String,
        /// A node silent this long is invisible (s).
        #[arg(long, default_value_t = kvferry::limits::STALE_AFTER_SECS_DEFAULT)]
        stale_after_secs: u64,
        /// A node silent this long is deleted by the sweep (s).
        #[arg(long, default_value_t = kvferry::limits::NODE_TTL_SECS_DEFAULT)]
        ttl_secs: u64,
        /// Sweep period (s).
        #[arg(long, default_value_t = kvferry::limits::SWEEP_INTERVAL_SECS_DEFAULT)]
        sweep_interval_secs: u64,
        /// Serve /health and Prometheus /metrics here, HOST:PORT (HOST may be a name).
        #[arg(long)]
        http_addr: Option<String>,
        /// Distinct block hashes each namespace's index is sized for up front (roughly 100 bytes
        /// each, allocated when the namespace is first written, split over the shards): no index
        /// growth, hence no growth pause under a shard's lock, below it. 0: grow on demand.
        #[arg(long, default_value_t = 0)]
        capacity: u64,
        /// Store shards, each with its own lock: requests of many clients run on as many cores
        /// (1 to 4096).
        #[arg(long, default_value_t = kvferry::limits::METASERVER_SHARDS_DEFAULT)]
        shards: usize,
        /// Threads serving the gRPC connections, each with its own single-threaded runtime that a
        /// connection stays on (0 to 256; 0: one shared work-stealing runtime). Default: a quarter
        /// of the cores on 8 cores or more, else 0.
        #[arg(long)]
        io_threads: Option<usize>,
        /// Serve TLS with this certificate chain (PEM; with --tls-key). Needs a build with
        /// `--features tls`. Clients then need the CA that signed it.
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The private key (PEM) of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
    },
    /// Replay a request trace across an embedded P/D cluster (the main job).
    Pd(Box<PdArgs>),
    /// Benchmarks: ratios measured side by side in one run.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
        /// Write the figures and ratios as JSON here.
        #[arg(long, global = true)]
        json: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Host-backend save/load of a Qwen3-8B layout vs memcpy.
    Engine {
        /// Blocks (2.25 MiB each, at least 1).
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
        blocks: u64,
    },
    /// TCP fetch vs the best raw loopback copy over 1-16 connections (T4), and the shared-pool fetch vs the best memcpy.
    Transport {
        /// Blocks to fetch (at least 1).
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
        blocks: u64,
        /// MiB per block (1..=64, a TCP read's limit).
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
        block_mib: u64,
        /// Connection pools per peer to time the fetch with, e.g. 4,8,16
        /// (1..=16; the default pool is always timed too).
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=kvferry::limits::TCP_CONNECTIONS_PER_PEER_MAX as u64))]
        connections: Vec<u64>,
        /// Read parts the fetch keeps in flight (as `pd --reads-in-flight`).
        #[arg(long, allow_negative_numbers = true, default_value_t = kvferry::limits::FETCH_READS_IN_FLIGHT, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=64))]
        reads_in_flight: usize,
    },
    /// CUDA save/load through the engine vs raw pinned copies (T1–T3); needs the `cuda` feature and a GPU.
    Gpu {
        /// CUDA device.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// Device-direct copies between two processes on one GPU (CUDA IPC) vs the raw IPC device copy; needs the `cuda` feature and a GPU.
    Ipc {
        /// CUDA device.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Internal: run as the reader process of an export `HANDLE:OFFSET:LEN`.
        #[arg(long, hide = true)]
        child: Option<String>,
    },
    /// The round trips of a P/D handoff (registration barrier, MetaServer query, transfer lock) vs a raw TCP ping-pong on the same runtime.
    Rpc {
        /// Blocks (hashes) per lock, query and barrier (at most 1024: the owner holds them twice, 2.25 MiB each).
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1024))]
        blocks: u64,
        /// Timed calls of each kind (at least 100, so that p99 is not the maximum).
        #[arg(long, allow_negative_numbers = true, default_value_t = 200, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(100..=100_000))]
        calls: usize,
    },
    /// Disk tier write and read vs raw O_DIRECT of the same blocks at the same queue depth (issue 32); Linux.
    Ssd {
        /// Directory on the file system to measure (must exist; the tier file of --size is made in it, the raw baseline runs over the same file, and both it and the lock file are removed at the end unless they were there before).
        #[arg(long)]
        dir: PathBuf,
        /// Size of the tier file (e.g. 2GiB).
        #[arg(long, default_value = "2GiB", value_parser = parse_size)]
        size: u64,
        /// Bytes per block (default: the Qwen3-8B block of `bench engine`, 36 layers × 64 KiB).
        #[arg(long, default_value = "2304KiB", value_parser = parse_size)]
        block: u64,
        /// Checksummed slots per block (layers).
        #[arg(long, allow_negative_numbers = true, default_value_t = 36, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=kvferry::limits::DISK_SLOTS_MAX as i64))]
        slots: usize,
        /// Operations in flight, tier and raw alike.
        #[arg(long, allow_negative_numbers = true, default_value_t = kvferry::limits::DISK_QUEUE_DEPTH_DEFAULT, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=kvferry::limits::DISK_QUEUE_DEPTH_MAX as i64))]
        queue_depth: usize,
        /// Backend: auto (io_uring, else threads), io-uring, threads.
        #[arg(long, default_value = "auto", value_parser = parse_disk_backend)]
        backend: DiskBackendArg,
        /// Repetitions (ratios: median over repetitions).
        #[arg(long, allow_negative_numbers = true, default_value_t = 5, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=50))]
        reps: usize,
        /// The tier's largest record alignment (power of two, 4KiB..=16MiB): a record is padded to the largest power of two up to it that adds at most 1/32 of the record (4 KiB at least), as a node's tier does.
        #[arg(long, default_value = "64KiB", value_parser = parse_size)]
        record_align: u64,
    },
    /// MetaServer store and gRPC insert rates, unregister cost (T5–T7).
    Store {
        /// Keys inserted.
        #[arg(long, default_value_t = 1_000_000)]
        keys: u64,
    },
}

#[derive(clap::Args)]
// A negative number is a bad value of its option (named in the error),
// not an unknown argument.
#[command(allow_negative_numbers = true)]
struct PdArgs {
    /// Trace file (JSON lines with timestamp, input_length, output_length, hash_ids; 512-token blocks).
    /// Default: data/conversation_trace.jsonl under the working directory, else the bundled trace
    /// of the source tree this binary was built from.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Model preset: qwen3-8b, llama3-8b or tiny.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Tokens per engine block (divides 512).
    #[arg(long, default_value_t = 64, value_parser = parse_block_tokens)]
    block_tokens: u64,
    /// Requests to replay (at least 1).
    #[arg(long, allow_negative_numbers = true, default_value_t = 400, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..))]
    requests: usize,
    /// First request of the window.
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// Replay this many seconds of trace time instead of --requests (the two conflict).
    #[arg(long, conflicts_with = "requests")]
    window_secs: Option<u64>,
    /// Prefill nodes.
    #[arg(long, default_value_t = 2)]
    prefill: usize,
    /// Decode nodes.
    #[arg(long, default_value_t = 2)]
    decode: usize,
    /// Pinned pool per node, e.g. 1GiB, 512MiB.
    #[arg(long, default_value = "1GiB", value_parser = parse_size, allow_hyphen_values = true)]
    pool_size: u64,
    /// Routing of requests to prefill nodes.
    #[arg(long, value_enum, default_value = "round-robin")]
    routing: Routing,
    /// Disk tier below each node's pool: an existing directory on an SSD; node i uses the subdirectory node-i (created).
    #[arg(long)]
    ssd_dir: Option<PathBuf>,
    /// Size of each node's disk tier, e.g. 8GiB (with --ssd-dir).
    #[arg(long, default_value = "8GiB", value_parser = parse_size, allow_hyphen_values = true, requires = "ssd_dir")]
    ssd_size: u64,
    /// Which nodes get a disk tier (with --ssd-dir): all, or prefill nodes only.
    #[arg(long, value_enum, default_value = "all", requires = "ssd_dir")]
    ssd_roles: SsdRoles,
    /// Write-behind queue of each node's disk tier (blocks, 1-16384, each holding a record buffer of the block's size; with --ssd-dir); a full queue drops the evicted block. Default: 256 MiB of blocks and at most 1/8 of --ssd-size, at most 16384 blocks.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=kvferry::limits::PD_SSD_WRITE_QUEUE_MAX as i64), requires = "ssd_dir")]
    ssd_write_queue: Option<usize>,
    /// Whether a decode fetch from a same-host owner's shared pool copies blocks straight from the mapped pool into the decode's KV (true: one copy) or into its own pool first and then loads them (false: the two-step path, for comparison).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    shm_direct: bool,
    /// Whether each decode node connects to each prefill node before the replay (handshake; on one host, opening the prefill's shared pool as a copy source, counted in the start-up time) or lazily on its first fetch (false).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    connect_peers: bool,
    /// When a request brings its reused KV into its prefill node's pool: `disk`, its disk-resident prefix staged while it waits for the node's device (with --ssd-dir), peers' blocks fetched holding the device; `fetch`, the whole fetch (disk staging, peers' blocks) before it queues for the device, as an engine loads a waiting request's KV asynchronously; `off`, everything holding the device.
    #[arg(long, value_enum, default_value_t = Prefetch::Disk)]
    prefetch: Prefetch,
    /// How a decode node learns where its request's KV is: `query`, it asks the MetaServer and locks the blocks at their owner (two round trips after "KV ready"); `ticket`, the prefill node locks its blocks for the decode node as it says "KV ready" and passes it the lock, so the decode reads at once.
    #[arg(long, value_enum, default_value_t = Handoff::Query)]
    handoff: Handoff,
    /// Read parts a decode fetch keeps in flight (each spread over the transport's connections).
    #[arg(long, allow_negative_numbers = true, default_value_t = kvferry::limits::FETCH_READS_IN_FLIGHT, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=64))]
    reads_in_flight: usize,
    /// Most bytes of blocks per read part of a decode fetch, e.g. 64MiB (rounded down to whole blocks, at least one); a fetch too small to fill its parts in flight twice uses smaller parts, but not below 1 MiB unless this asks for less.
    #[arg(long, default_value = "64MiB", value_parser = parse_part_size, allow_hyphen_values = true)]
    read_part_size: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..))]
    concurrency: usize,
    /// Keep only the first N blocks of each request (cheaper replay, same prefix structure).
    #[arg(long)]
    max_blocks: Option<u64>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Use an external MetaServer (http://host:port) instead of the embedded one.
    #[arg(long, value_parser = parse_metaserver)]
    metaserver: Option<String>,
    /// Kill the embedded MetaServer at this fraction of the run (restarted empty shortly after).
    #[arg(long)]
    kill_metaserver_at: Option<f64>,
    /// Kill prefill node 0 at this fraction of the run.
    #[arg(long)]
    kill_prefill_at: Option<f64>,
    /// Fraction of registration RPCs the embedded MetaServer drops.
    #[arg(long, default_value_t = 0.0)]
    drop_registrations: f64,
    /// Write the report as JSON here, once, at the end (atomically: a temporary file in the same
    /// directory, then a rename). The path is checked up front, without touching an existing file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Serve /health and Prometheus /metrics of every node here, HOST:PORT (HOST may be a name).
    #[arg(long)]
    http_addr: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    quiet: bool,
    /// GPU backend of every node: host (device = host memory) or cuda (needs the `cuda` build feature and a GPU).
    #[arg(long, value_enum, default_value = "host")]
    gpu: GpuChoice,
    /// CUDA devices of the prefill nodes (node i uses entry i mod len); default: round robin over all visible devices.
    #[arg(long, value_delimiter = ',')]
    prefill_devices: Vec<usize>,
    /// CUDA devices of the decode nodes (node i uses entry i mod len); default: round robin over all visible devices.
    #[arg(long, value_delimiter = ',')]
    decode_devices: Vec<usize>,
    /// Data plane of every node: tcp, or verbs (RDMA READ; needs the `rdma` build feature and an RDMA device).
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportArg,
    /// Paths a TCP node reads a peer's blocks through: auto (the owner's shared pool when it is on this host, else TCP, falling back to TCP), ipc (prefill nodes grant device leases and decode copies device to device from their KV, falling back as auto), shm (shared pool only), tcp (loopback TCP only).
    #[arg(long, default_value = "auto", value_parser = parse_path)]
    path: kvferry::node::PathChoice,
    /// RDMA device of every node with --transport verbs, as `ibv_devices` lists it (e.g. mlx5_0).
    #[arg(long, value_name = "NAME", required_if_eq("transport", "verbs"))]
    rdma_device: Option<String>,
    /// RC queue pairs per peer with --transport verbs.
    #[arg(
        long,
        value_name = "N",
        requires = "rdma_device",
        default_value_t = kvferry::limits::VERBS_QPS_PER_PEER_DEFAULT,
        allow_negative_numbers = true,
        value_parser = clap::builder::RangedI64ValueParser::<usize>::new().range(1..=kvferry::limits::VERBS_QPS_PER_PEER_MAX as i64)
    )]
    rdma_qps_per_peer: usize,
    /// Physical port of the RDMA device (1-based).
    #[arg(long, value_name = "N", requires = "rdma_device", default_value_t = 1)]
    rdma_port: u8,
    /// GID table index of the port (RoCE v2: usually 1 or 3, see `show_gids`; InfiniBand: 0).
    #[arg(long, value_name = "N", requires = "rdma_device", default_value_t = 0)]
    rdma_gid_index: u8,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum TransportArg {
    Tcp,
    Verbs,
}

/// `--block-tokens`: as [`kvferry::replay::trace::check_block_tokens`] allows.
fn parse_block_tokens(s: &str) -> Result<u64, String> {
    let n: u64 = s.parse().map_err(|e| format!("{e}"))?;
    kvferry::replay::trace::check_block_tokens(n).map(|_| n).map_err(|e| e.to_string())
}

fn parse_path(s: &str) -> Result<kvferry::node::PathChoice, String> {
    s.parse()
}

/// The nodes' data plane from the `--transport` and `--rdma-*` flags.
fn transport_choice(a: &PdArgs) -> Result<TransportChoice, String> {
    match (a.transport, &a.rdma_device) {
        (TransportArg::Tcp, None) => Ok(TransportChoice::Tcp),
        (TransportArg::Tcp, Some(_)) => Err("--rdma-device and the other --rdma-* flags need --transport verbs".into()),
        (TransportArg::Verbs, None) => Err("--transport verbs needs --rdma-device NAME (e.g. mlx5_0)".into()),
        (TransportArg::Verbs, Some(device)) => {
            let mut v = VerbsConfig::new(device.clone());
            v.qps_per_peer = a.rdma_qps_per_peer;
            v.port = a.rdma_port;
            v.gid_index = a.rdma_gid_index;
            Ok(TransportChoice::Verbs(v))
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GpuChoice {
    Host,
    Cuda,
}

/// A node's GPU backend and its device label.
type LabelledGpu = (Arc<dyn Gpu>, String);

/// Builds the GPU factory of `kvferry pd`.
fn gpu_factory(
    choice: GpuChoice,
    prefill: Vec<usize>,
    decode: Vec<usize>,
    prefill_n: usize,
) -> Result<impl Fn(pd::Role, usize) -> Result<LabelledGpu, PdError>, String> {
    let visible = match choice {
        GpuChoice::Host => 0,
        GpuChoice::Cuda => gpu::open::device_count("cuda").map_err(|e| gpu_open_message(&e))?,
    };
    Ok(move |role: pd::Role, i: usize| -> Result<LabelledGpu, PdError> {
        match choice {
            GpuChoice::Host => Ok((Arc::new(gpu::host::HostGpu::new()) as Arc<dyn Gpu>, "host".to_string())),
            GpuChoice::Cuda => {
                let list = if role == pd::Role::Prefill { &prefill } else { &decode };
                let global = if role == pd::Role::Prefill { i } else { prefill_n + i };
                let dev = if list.is_empty() { global % visible.max(1) } else { list[i % list.len()] };
                gpu::open::open("cuda", dev)
                    .map(|g| (g, format!("cuda:{dev}")))
                    .map_err(|e| PdError::Device(gpu_open_message(&e)))
            }
        }
    })
}

/// `e` in words; where the backend was not built, with the command that
/// builds it.
fn gpu_open_message(e: &gpu::open::OpenError) -> String {
    match e {
        gpu::open::OpenError::NotBuilt { feature, .. } => {
            format!("{e}: rebuild with `cargo build --release --features {feature}`")
        }
        _ => e.to_string(),
    }
}

/// The refusal of a `bench` job that needs the `cuda` backend in a build
/// without it.
#[cfg(not(feature = "cuda"))]
fn no_cuda() -> String {
    gpu_open_message(&gpu::open::OpenError::NotBuilt { backend: "cuda", feature: "cuda" })
}

/// Parses sizes like `4GiB`, `512MiB`, `64KiB`, `1000` (bytes).
/// A byte size: `4GiB`, `512MiB`, `1.5GiB`, `1TiB` (binary units), `1GB`
/// (decimal, 10^9), or plain bytes.
fn parse_part_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err("a read part of 0 bytes reads nothing: give a size above 0 (it is rounded down to whole blocks, and at least one block is read per part)".into()),
        n => Ok(n),
    }
}

/// `bench ssd --backend` (a plain enum so the flag parses on every OS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DiskBackendArg {
    Auto,
    IoUring,
    Threads,
}

fn parse_disk_backend(s: &str) -> Result<DiskBackendArg, String> {
    match s {
        "auto" => Ok(DiskBackendArg::Auto),
        "io-uring" | "io_uring" => Ok(DiskBackendArg::IoUring),
        "threads" => Ok(DiskBackendArg::Threads),
        _ => Err(format!("bad disk backend {s:?}: auto, io-uring or threads")),
    }
}

#[cfg(target_os = "linux")]
async fn bench_ssd(
    dir: PathBuf,
    size: u64,
    block: u64,
    slots: usize,
    depth: usize,
    backend: DiskBackendArg,
    (reps, record_align): (usize, u64),
) -> Result<serde_json::Value, String> {
    use kvferry::disk::backend::BackendChoice;
    let backend = match backend {
        DiskBackendArg::Auto => BackendChoice::Auto,
        DiskBackendArg::IoUring => BackendChoice::IoUring,
        DiskBackendArg::Threads => BackendChoice::Pio,
    };
    tokio::task::spawn_blocking(move || {
        let a = kvferry::bench::ssd::SsdBench { dir: &dir, size, block, slots, depth, backend, reps, record_align };
        kvferry::bench::ssd::ssd(&a)
    })
    .await
    .map_err(|e| format!("bench ssd task: {e}"))?
}

#[cfg(not(target_os = "linux"))]
async fn bench_ssd(
    _dir: PathBuf,
    _size: u64,
    _block: u64,
    _slots: usize,
    _depth: usize,
    _backend: DiskBackendArg,
    _reps: (usize, u64),
) -> Result<serde_json::Value, String> {
    Err("bench ssd needs Linux (O_DIRECT, io_uring)".into())
}

fn parse_size(s: &str) -> Result<u64, String> {
    if s.trim().starts_with('-') {
        return Err(format!("bad size {s:?}: a size cannot be negative (e.g. 4GiB, 512MiB)"));
    }
    parse_size::parse_size(s.trim()).map_err(|e| format!("bad size {s:?}: {e} (e.g. 4GiB, 512MiB)"))
}

/// An external MetaServer's address, checked before anything starts
/// (`http://host:port`, `host:port`; another scheme or a malformed
/// host or port is refused naming it).
fn parse_metaserver(s: &str) -> Result<String, String> {
    kvferry::client::parse_metaserver_address(s).map(|_| s.to_string()).map_err(|e| e.to_string())
}

struct Bar(indicatif::ProgressBar);

impl pd::Progress for Bar {
    fn start(&self, total: u64) {
        self.0.set_length(total);
    }
    fn tick(&self, bytes: u64) {
        self.0.inc(1);
        self.0.set_message(format!("{:.2} GiB moved", bytes as f64 / (1u64 << 30) as f64));
    }
    fn fault(&self, what: &str) {
        self.0.println(format!("fault: {what}"));
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Writes to stdout, ignoring a closed pipe (`kvferry pd | head`).
/// Writes `text` to stdout; a closed pipe ends the process as
/// [`emit_line`] does.
fn out(text: &str) {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    if o.write_all(text.as_bytes()).and_then(|_| o.flush()).is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) {
        std::process::exit(EXIT_CLOSED_PIPE);
    }
}

fn print_report(r: &pd::PdReport) {
    out(&report_text(r));
}

fn report_text(r: &pd::PdReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    macro_rules! println {
        ($($t:tt)*) => {{ let _ = writeln!(s, $($t)*); }};
    }
    let gib = r.bytes_transferred as f64 / (1u64 << 30) as f64;
    println!(
        "kvferry pd — {} request{}{}, model {} ({} tokens/block, {} KiB/block), transport {}, path {}, prefetch {}, handoff {}",
        r.requests,
        if r.requests == 1 { "" } else { "s" },
        if r.interrupted { " (INTERRUPTED: the figures cover the requests replayed)" } else { "" },
        r.model,
        r.block_tokens,
        r.block_bytes >> 10,
        r.transport,
        r.path,
        r.prefetch.name(),
        r.handoff.name()
    );
    println!(
        "  prefix hit rate        {:>8.1} %   (oracle for this window {:.1} %)",
        r.prefix_hit_rate * 100.0,
        r.oracle_hit_rate * 100.0
    );
    println!("    prefill local hits   {:>8} blocks", r.prefill_local_hits);
    println!("    prefill peer fetches {:>8} blocks", r.prefill_fetched);
    println!(
        "  pools                  {:>12} per node ({} blocks), {} blocks evicted (all nodes)",
        pd::size_text(r.pool_bytes),
        r.pool_bytes / r.block_bytes.max(1),
        r.evicted_blocks
    );
    if let Some(d) = &r.ssd {
        println!(
            "  ssd                    {:>12} per node on {} nodes ({}): {} blocks written, {} read ({} of them from the write queue, {} from a write under way; {} hits, {} staged), {} evicted, {} verify failures, {} recovered at start",
            pd::size_text(d.bytes_per_node),
            d.nodes,
            d.backend,
            d.written_blocks,
            d.read_blocks,
            d.queue_reads,
            d.after_write_reads,
            d.hits,
            d.staged_blocks,
            d.evicted,
            d.verify_failures,
            d.recovered
        );
        println!(
            "    ssd throughput       write {:.2} GB/s, read {:.2} GB/s (over the replay), read latency {:.2} ms mean; {} writes refused ({} no space, {} write queue full), {} stagings failed ({} for want of pool room)",
            d.write_gbps,
            d.read_gbps,
            d.read_ms_mean,
            d.write_refused,
            d.write_refused_no_space,
            d.write_refused_queue_full,
            d.stage_failures,
            d.stage_no_room
        );
    }
    println!("  decode blocks          {:>8}", r.blocks_total);
    println!("    fetched from peers   {:>8}", r.blocks_fetched);
    println!("    already local        {:>8}", r.blocks_decode_local);
    println!("    recomputed           {:>8}", r.blocks_recomputed);
    println!(
        "    verified             {:>8}   ({})",
        r.blocks_verified,
        if r.blocks_verified == r.blocks_total { "all" } else { "MISMATCH" }
    );
    println!(
        "  bytes moved            {:>8.2} GiB at {:.2} GB/s (over {:.2} s with a fetch in flight)",
        gib, r.transport_gbps, r.fetch_busy_s
    );
    for p in &r.paths {
        println!(
            "    path {:<4} (--path {}) {:>8} blocks, {:>8.2} GiB, {:.2} GB/s over the fetch time, {} fallbacks, {} refused set-ups",
            p.path,
            r.path,
            p.blocks,
            p.bytes as f64 / (1u64 << 30) as f64,
            p.gbps,
            p.fallbacks,
            p.attach_failures
        );
    }
    if let Some(c) = &r.connect_peers {
        println!(
            "  connected at start-up  {} of {} decode→prefill pairs in {:.2} s (ready {}, not_mapped {}, opening {}, refused {}, failed {})",
            c.pairs - c.failed,
            c.pairs,
            c.seconds,
            c.ready,
            c.not_mapped,
            c.opening,
            c.refused,
            c.failed
        );
    }
    println!("  handoff (barrier → fetch end) p50 {:.2} ms, p99 {:.2} ms", r.handoff_p50_ms, r.handoff_p99_ms);
    match r.raw_gbps {
        Some(raw) => {
            if r.raw_path == "device" || r.raw_path == "h2d" {
                let (label, what) = if r.raw_path == "device" {
                    ("raw device copy       ", "one device-to-device copy")
                } else {
                    ("raw pinned h2d copy   ", "one pinned host-to-device copy")
                };
                println!(
                    "  {label} {raw:>8.2} GB/s   ({what} of {:.1} MiB into a fresh allocation, best of {}, at start-up)",
                    r.raw_copy_bytes as f64 / (1u64 << 20) as f64,
                    kvferry::limits::PD_RAW_COPY_REPS
                );
            } else {
                println!(
                    "  raw {}      {raw:>8.2} GB/s   (best of 1-16 {}: {}; {:.1} MiB between buffers of that size, at start-up)",
                    if r.raw_path == "shm" { "memcpy (shm)  " } else { "loopback copy " },
                    if r.raw_path == "shm" { "threads" } else { "connections" },
                    r.raw_connections,
                    r.raw_copy_bytes as f64 / (1u64 << 20) as f64
                );
            }
            println!(
                "  fetch aggregate        {:>8.2} GB/s = {:.3} x raw   (all fetched bytes / union of fetch intervals)",
                r.fetch_gbps_aggregate,
                if raw > 0.0 { r.fetch_gbps_aggregate / raw } else { 0.0 }
            );
        }
        None => println!("  raw loopback copy             -   (not measured: the nodes do not use the TCP transport)"),
    }
    match (r.t8_p50, r.t8_p99) {
        // T8 is defined at --concurrency 1: above it requests queue for
        // each other's nodes, so the ratio is no verdict on the handoff.
        _ if r.concurrency != 1 => println!(
            "  T8 handoff / wire time  -   (not measured at this concurrency: T8 is defined at --concurrency 1, \
             this run {}; read the fetch aggregate)",
            r.concurrency
        ),
        (Some(p50), Some(p99)) => {
            let missed = if p50 <= 1.5 && p99 <= 3.0 { "" } else { ": MISSED" };
            println!(
                "  T8 handoff / wire time p50 {p50:.2}, p99 {p99:.2}   (target p50 <= 1.5, p99 <= 3{missed}; {} requests fetching >= 1 MiB)",
                r.t8_requests
            )
        }
        _ => println!("  T8 handoff / wire time  -   ({} requests fetching >= 1 MiB)", r.t8_requests),
    }
    if !r.handoff_phases_ms.is_empty() {
        println!(
            "  handoff phases (ms)         p50       p99      mean   (barrier call to load end; {} requests fetching >= 1 MiB)",
            r.t8_requests
        );
        let names = pd::HANDOFF_PHASES.iter().chain(std::iter::once(&"total"));
        for name in names {
            if let Some(p) = r.handoff_phases_ms.get(*name) {
                println!("    {:<20} {:>9.2} {:>9.2} {:>9.2}", name.replace('_', " "), p.p50, p.p99, p.mean);
            }
            if *name == "fetch" {
                // load_tail is the `load` row below, not part of the fetch.
                for (sub, _) in kvferry::engine::fetch::FetchPhases::default()
                    .named()
                    .into_iter()
                    .filter(|(n, _)| *n != "load_tail")
                {
                    if let Some(p) = r.fetch_phases_ms.get(sub) {
                        println!("      {:<18} {:>9.2} {:>9.2} {:>9.2}", sub, p.p50, p.p99, p.mean);
                    }
                }
            }
        }
    }
    if !r.request_steps_s.is_empty() {
        // One line: where the nodes' time went, summed over all requests.
        let steps: Vec<String> = pd::REQUEST_STEPS
            .iter()
            .filter_map(|n| r.request_steps_s.get(*n).map(|s| format!("{} {s:.2}", n.replace('_', " "))))
            .collect();
        println!("  request steps (s, summed) {}", steps.join(", "));
    }
    println!(
        "  prefill registry cmds  {} delivered, {} dropped (block inserts + eviction removals, at the handoff barriers)",
        r.registrations_delivered, r.registrations_dropped
    );
    println!("  checksum rejections    {}", r.checksum_failures);
    if r.handoff == Handoff::Ticket {
        println!(
            "  transfer tickets       {} read from, {} released unread (their fetch asked the MetaServer)",
            r.tickets_used, r.tickets_unused
        );
    }
    if r.faults.is_empty() {
        println!("  faults                 none");
    } else {
        for f in &r.faults {
            println!("  fault                  {f}");
        }
    }
    for n in &r.nodes {
        let save = if n.save_bytes == 0 {
            format!("{:<28}", "save  -")
        } else {
            format!("save {:>7.2} GB/s ({:.2} GiB)", n.save_gbps, n.save_bytes as f64 / (1u64 << 30) as f64)
        };
        let load = if n.load_bytes == 0 {
            "load  -".to_string()
        } else {
            format!("load {:>7.2} GB/s ({:.2} GiB)", n.load_gbps, n.load_bytes as f64 / (1u64 << 30) as f64)
        };
        println!("  {:<7} {} on {:<7}  {save}   {load}", n.role, n.index, n.device);
    }
    println!(
        "  wall                   {:.1} s   (start-up {:.1} s, replay {:.1} s)",
        r.wall_s, r.startup_s, r.replay_s
    );
    s
}

/// Where a JSON report goes: a temporary file next to `path` (same
/// directory, so the final rename is atomic).
fn report_temp_path(path: &Path) -> Result<PathBuf, String> {
    let name = path.file_name().ok_or_else(|| format!("cannot write {}: not a file path", path.display()))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok(dir.join(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id())))
}

/// Checks, before any work, that a report can be written to `path`: it is
/// not a directory and its directory takes a new file (created and removed
/// again). `path` itself is neither created nor changed, so a run that then
/// fails leaves a previous report as it was.
///
/// # Errors
/// One line naming `path` and the cause.
fn check_report_path(path: &Path) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!("cannot write {}: it is a directory", path.display()));
    }
    if let Ok(meta) = std::fs::metadata(path) {
        // The report replaces the file by a rename: never a device, a pipe
        // or a socket.
        if !meta.is_file() {
            return Err(format!("cannot write {}: it is not a regular file", path.display()));
        }
    }
    let tmp = report_temp_path(path)?;
    let dir = tmp.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| {
        let exists = if path.exists() { "it exists, but " } else { "" };
        format!(
            "cannot write {}: {exists}the report is written as a new file in {} and renamed over it, and no file \
             can be created there ({e})",
            path.display(),
            dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

/// Writes `text` to `path` atomically: a temporary file in the same
/// directory, synced, then renamed over `path`. On failure `path` is
/// unchanged and the temporary file removed.
///
/// # Errors
/// One line naming `path` and the cause.
fn write_report(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    let tmp = report_temp_path(path)?;
    let res = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|_| f.sync_all()))
        .and_then(|_| std::fs::rename(&tmp, path));
    res.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

/// Exit status of a replay stopped by Ctrl-C (128 + SIGINT, the shell's
/// convention), after its partial report was printed and written.
const EXIT_INTERRUPTED: u8 = 130;

/// Turns the first Ctrl-C into a stop request for the replay (the
/// requests in flight finish, then the report of what was measured); a
/// second Ctrl-C exits at once with [`EXIT_INTERRUPTED`].
fn stop_on_ctrl_c() -> (tokio::sync::watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        errln!("\ninterrupted: finishing the requests in flight, then the report (Ctrl-C again quits at once)");
        let _ = tx.send(true);
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        }
    });
    (rx, task)
}

async fn run_pd(a: PdArgs) -> Result<ExitCode, String> {
    let transport = transport_choice(&a)?;
    if let Some(path) = &a.json {
        // Fail on an unwritable report path before the run, not after it.
        check_report_path(path)?;
    }
    // Every listen address the user gave is bound before anything slow
    // (the raw copy baseline, the pools): a taken port fails at once. The
    // nodes and the embedded MetaServer listen on ports the OS picks.
    let http = match &a.http_addr {
        Some(addr) => {
            let resolved = resolve_listen_addr("--http-addr", addr).await?;
            Some(kvferry::exporter::bind(resolved).map_err(|e| format!("--http-addr: {e}"))?)
        }
        None => None,
    };
    let (stop, sigint) = stop_on_ctrl_c();
    let cfg = PdConfig {
        trace: a.trace.unwrap_or_else(kvferry::replay::trace::default_trace_path),
        model: a.model,
        block_tokens: a.block_tokens,
        first: a.first,
        requests: if a.window_secs.is_some() { None } else { Some(a.requests) },
        window_secs: a.window_secs,
        prefill: a.prefill,
        decode: a.decode,
        pool_bytes: a.pool_size,
        ssd_dir: a.ssd_dir,
        ssd_bytes: a.ssd_size,
        ssd_roles: a.ssd_roles,
        ssd_write_queue: a.ssd_write_queue,
        prefetch: a.prefetch,
        handoff: a.handoff,
        connect_peers: a.connect_peers,
        fetch_reads_in_flight: a.reads_in_flight,
        fetch_read_part_bytes: a.read_part_size,
        shared_pool_direct: a.shm_direct,
        routing: a.routing,
        seed: a.seed,
        metaserver: a.metaserver,
        kill_metaserver_at: a.kill_metaserver_at,
        kill_prefill_at: a.kill_prefill_at,
        drop_registrations: a.drop_registrations,
        concurrency: a.concurrency,
        max_blocks: a.max_blocks,
        transport,
        path: a.path,
        stop: Some(stop),
        ..PdConfig::default()
    };
    let bar = indicatif::ProgressBar::new(0);
    if a.quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests, {msg}")
            .expect("static template"),
    );
    if matches!(a.gpu, GpuChoice::Host) && !(a.prefill_devices.is_empty() && a.decode_devices.is_empty()) {
        return Err("--prefill-devices and --decode-devices need --gpu cuda".into());
    }
    let gpu = gpu_factory(a.gpu, a.prefill_devices, a.decode_devices, a.prefill)?;
    let report = pd::run_with_observer(cfg, gpu, &Bar(bar), move |engines| {
        if let Some(listener) = http {
            let engines = engines.to_vec();
            let collect: kvferry::exporter::Collect =
                Arc::new(move || engines.iter().flat_map(kvferry::exporter::engine_samples).collect());
            kvferry::exporter::serve_on(listener, collect)
                .map(|local| errln!("metrics on http://{local}/metrics"))
                .map_err(|e| format!("--http-addr: {e}"))
        } else {
            Ok(())
        }
    })
    .await;
    sigint.abort();
    let report = match report {
        Ok(r) => r,
        Err(e @ pd::PdError::Interrupted(_)) => {
            errln!("{e}");
            return Ok(ExitCode::from(EXIT_INTERRUPTED));
        }
        Err(e) => return Err(e.to_string()),
    };
    print_report(&report);
    if let Some(path) = a.json {
        let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        write_report(&path, &json)?;
    }
    if report.blocks_verified != report.blocks_total {
        return Err(format!(
            "{} of {} blocks failed verification",
            report.blocks_total - report.blocks_verified,
            report.blocks_total
        ));
    }
    Ok(if report.interrupted { ExitCode::from(EXIT_INTERRUPTED) } else { ExitCode::SUCCESS })
}

#[cfg(feature = "cuda")]
async fn bench_gpu(device: usize) -> Result<serde_json::Value, String> {
    kvferry::bench::gpu(device).await
}

#[cfg(not(feature = "cuda"))]
async fn bench_gpu(_device: usize) -> Result<serde_json::Value, String> {
    Err(no_cuda())
}

#[cfg(feature = "cuda")]
async fn bench_ipc(device: usize) -> Result<serde_json::Value, String> {
    kvferry::bench::ipc::run(device).await
}

#[cfg(not(feature = "cuda"))]
async fn bench_ipc(_device: usize) -> Result<serde_json::Value, String> {
    Err(no_cuda())
}

#[cfg(feature = "cuda")]
async fn bench_ipc_child(device: usize, export: &str) -> Result<serde_json::Value, String> {
    kvferry::bench::ipc::child(device, export).await
}

#[cfg(not(feature = "cuda"))]
async fn bench_ipc_child(_device: usize, _export: &str) -> Result<serde_json::Value, String> {
    Err(no_cuda())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Resolves the listen address `addr` of the command-line flag `flag`
/// (`HOST:PORT`, HOST an IP or a name; the first address the resolver
/// returns is used).
///
/// # Errors
/// One line naming the flag: not `HOST:PORT`, or a name that does not resolve.
async fn resolve_listen_addr(flag: &str, addr: &str) -> Result<SocketAddr, String> {
    let mut found = tokio::net::lookup_host(addr).await.map_err(|e| format!("{flag} {addr}: {e} (want HOST:PORT)"))?;
    found.next().ok_or_else(|| format!("{flag} {addr}: the name resolved to no address"))
}

/// The `--flag` of a MetaServer setting.
fn metaserver_flag(f: ConfigField) -> String {
    match f {
        ConfigField::CapacityHashes => "--capacity".to_string(),
        _ => format!("--{}", f.name().replace('_', "-")),
    }
}

/// A MetaServer start-up error in the command line's words (flags, not
/// config fields).
fn metaserver_error_text(e: &StartError) -> String {
    match e {
        StartError::Config(c) => c.render(metaserver_flag),
        StartError::Bind { addr, source } => format!("cannot bind --addr {addr}: {source}"),
        StartError::Tls(e) => format!("--tls-cert/--tls-key: {e}"),
        StartError::IoThreads(e) => format!("cannot start --io-threads: {e}"),
    }
}

async fn run_metaserver(
    addr: &str,
    stale_after_secs: u64,
    ttl_secs: u64,
    sweep_interval_secs: u64,
    http_addr: Option<String>,
    (capacity_hashes, shards, io_threads): (u64, usize, Option<usize>),
    tls: Option<(PathBuf, PathBuf)>,
) -> Result<ExitCode, String> {
    let addr = resolve_listen_addr("--addr", addr).await?;
    let http_addr = match &http_addr {
        Some(a) => Some(resolve_listen_addr("--http-addr", a).await?),
        None => None,
    };
    let tls = match tls {
        Some((cert, key)) => {
            Some(TlsIdentity::from_files(&cert, &key).map_err(|e| format!("--tls-cert/--tls-key: {e}"))?)
        }
        None => None,
    };
    let cfg = MetaServerConfig {
        addr,
        stale_after_secs,
        ttl_secs,
        sweep_interval_secs,
        seed: 0,
        capacity_hashes,
        shards,
        io_threads: io_threads
            .unwrap_or_else(|| kvferry::limits::metaserver_io_threads_default(kvferry::rt::cpu_parallelism())),
        tls,
    };
    let mut h = metaserver::start(cfg).await.map_err(|e| metaserver_error_text(&e))?;
    if let Some(http) = http_addr {
        let local = kvferry::exporter::serve(http, kvferry::exporter::metaserver_samples(&h))
            .map_err(|e| format!("--http-addr: {e}"))?;
        out(&format!("metrics and health on http://{local}/metrics, /health\n"));
    }
    out(&format!("metaserver ready on {}\n", h.local_addr));
    let r = tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            h.shutdown().await.map_err(|e| e.to_string())
        }
        r = h.wait() => r.map_err(|e| e.to_string()),
    };
    r.map(|()| ExitCode::SUCCESS)
}

pub fn main() -> ExitCode {
    kvferry::logging::init("warn");
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            errln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.cmd {
            Cmd::Metaserver {
                addr,
                stale_after_secs,
                ttl_secs,
                sweep_interval_secs,
                http_addr,
                capacity,
                shards,
                io_threads,
                tls_cert,
                tls_key,
            } => {
                let tls = tls_cert.zip(tls_key);
                let sizes = (capacity, shards, io_threads);
                run_metaserver(&addr, stale_after_secs, ttl_secs, sweep_interval_secs, http_addr, sizes, tls).await
            }
            Cmd::Pd(a) => run_pd(*a).await,
            Cmd::Bench { which, json } => {
                if let Some(path) = &json {
                    // Before the benchmark, not after it.
                    check_report_path(path)?;
                }
                let v = match which {
                    BenchCmd::Engine { blocks } => kvferry::bench::engine(blocks).await,
                    BenchCmd::Transport { blocks, block_mib, connections, reads_in_flight } => {
                        let pools: Vec<usize> = connections.iter().map(|&c| c as usize).collect();
                        kvferry::bench::transport(blocks, block_mib, &pools, reads_in_flight).await
                    }
                    BenchCmd::Store { keys } => kvferry::bench::store(keys).await,
                    BenchCmd::Rpc { blocks, calls } => kvferry::bench::rpc::rpc(blocks, calls).await,
                    BenchCmd::Ssd { dir, size, block, slots, queue_depth, backend, reps, record_align } => {
                        bench_ssd(dir, size, block, slots, queue_depth, backend, (reps, record_align)).await
                    }
                    BenchCmd::Gpu { device } => bench_gpu(device).await,
                    BenchCmd::Ipc { device, child: Some(export) } => {
                        // The reader process: one JSON line for the parent.
                        let v = bench_ipc_child(device, &export).await?;
                        outln!("{v}");
                        return Ok(ExitCode::SUCCESS);
                    }
                    BenchCmd::Ipc { device, child: None } => bench_ipc(device).await,
                }?;
                if let Some(path) = json {
                    let text = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
                    write_report(&path, &text)?;
                }
                Ok(ExitCode::SUCCESS)
            }
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            errln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 30: each bad flag value is refused at parse time, naming the
    /// flag and the mistake.
    #[test]
    fn bad_flag_values_name_the_flag() {
        let err = |args: &[&str]| Cli::try_parse_from(args).err().expect("refused").to_string();
        let e = err(&["kvferry", "pd", "--pool-size", "-1GiB"]);
        assert!(e.contains("--pool-size") && e.contains("cannot be negative"), "{e}");
        let e = err(&["kvferry", "pd", "--read-part-size", "-64MiB"]);
        assert!(e.contains("--read-part-size") && e.contains("cannot be negative"), "{e}");
        let e = err(&["kvferry", "pd", "--metaserver", "ftp://10.0.0.1:21"]);
        assert!(e.contains("--metaserver") && e.contains("scheme \"ftp\""), "{e}");
        let e = err(&["kvferry", "pd", "--metaserver", "http://10.0.0.1"]);
        assert!(e.contains("--metaserver") && e.contains("no port"), "{e}");
        for which in ["transport", "engine"] {
            let e = err(&["kvferry", "bench", which, "--blocks", "0"]);
            assert!(e.contains("--blocks"), "{e}");
        }
        assert!(Cli::try_parse_from(["kvferry", "pd", "--metaserver", "http://meta-0:50055"]).is_ok());
        // A negative count names the allowed range (not "invalid digit").
        let e = err(&["kvferry", "pd", "--ssd-dir", "/tmp", "--ssd-write-queue", "-5"]);
        assert!(e.contains("--ssd-write-queue") && e.contains("-5 is not in 1..=16384"), "{e}");
        let e = err(&["kvferry", "pd", "--requests", "-3"]);
        assert!(e.contains("--requests") && e.contains("-3 is not in 1.."), "{e}");
    }

    /// Issue 30: the report's T8 line, pool line and node lines.
    #[test]
    fn report_says_what_was_not_measured() {
        let node = |role: &str, load_bytes| pd::NodeStat {
            role: role.into(),
            device: "host".into(),
            save_bytes: if role == "prefill" { 1 << 30 } else { 0 },
            save_gbps: 5.0,
            load_bytes,
            load_gbps: if load_bytes == 0 { 0.0 } else { 5.0 },
            evicted_blocks: 7,
            ..Default::default()
        };
        let mut r = pd::PdReport {
            concurrency: 4,
            t8_p50: Some(2.0),
            t8_p99: Some(9.0),
            t8_requests: 10,
            raw_gbps: Some(10.0),
            pool_bytes: 1 << 30,
            block_bytes: 1 << 20,
            evicted_blocks: 14,
            nodes: vec![node("prefill", 0), node("decode", 0)],
            ..Default::default()
        };
        let text = report_text(&r);
        assert!(text.contains("not measured at this concurrency"), "{text}");
        assert!(!text.contains("MISSED"), "{text}");
        assert!(text.contains("1.00 GiB per node (1024 blocks), 14 blocks evicted"), "{text}");
        assert!(text.contains("save  -") && text.contains("load  -"), "{text}");
        assert!(!text.contains("load    0.00"), "{text}");
        r.concurrency = 1;
        r.ssd = Some(pd::SsdLine { bytes_per_node: 16 << 20, ..Default::default() });
        let text = report_text(&r);
        assert!(text.contains("p50 2.00, p99 9.00") && text.contains("MISSED"), "{text}");
        assert!(text.contains("16.00 MiB per node"), "a small tier in MiB: {text}");
        r.ssd = Some(pd::SsdLine { bytes_per_node: 8 << 30, nodes: 2, ..Default::default() });
        assert!(report_text(&r).contains("8.00 GiB per node on 2 nodes"), "{}", report_text(&r));
    }

    /// Issue 30: an existing file that cannot be replaced is not "No such
    /// file or directory".
    #[cfg(target_os = "linux")]
    #[test]
    fn report_path_errors_say_what_is_wrong() {
        let e = check_report_path(Path::new("/proc/version")).unwrap_err();
        assert!(e.contains("it exists, but") && e.contains("no file can be created there"), "{e}");
        let e = check_report_path(Path::new("/dev/null")).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }

    /// Issue 30: a taken --http-addr fails before the replay allocates
    /// anything (it used to fail after 10-15 s and 4 GB of pools).
    #[tokio::test]
    async fn taken_http_addr_fails_before_the_replay_starts() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let Cmd::Pd(args) = Cli::try_parse_from(["kvferry", "pd", "--quiet", "--http-addr", &addr]).unwrap().cmd else {
            panic!("parsed as another command")
        };
        let t = std::time::Instant::now();
        let e = run_pd(*args).await.expect_err("a taken port is an error");
        assert!(e.starts_with("--http-addr: cannot bind"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "took {:?}", t.elapsed());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("4XB").is_err());
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert!(parse_size("GiB").is_err());
    }

    fn pd_transport(args: &[&str]) -> Result<TransportChoice, String> {
        let cli = Cli::try_parse_from(["kvferry", "pd"].iter().chain(args)).map_err(|e| e.to_string())?;
        match cli.cmd {
            Cmd::Pd(a) => transport_choice(&a),
            _ => panic!("parsed as another command"),
        }
    }

    #[test]
    fn transport_flags() {
        assert_eq!(pd_transport(&[]), Ok(TransportChoice::Tcp));
        assert_eq!(pd_transport(&["--transport", "tcp"]), Ok(TransportChoice::Tcp));
        assert_eq!(
            pd_transport(&["--transport", "verbs", "--rdma-device", "mlx5_1"]),
            Ok(TransportChoice::Verbs(VerbsConfig::new("mlx5_1")))
        );
        let mut want = VerbsConfig::new("rxe0");
        (want.qps_per_peer, want.port, want.gid_index) = (4, 2, 3);
        let got = pd_transport(&[
            "--transport",
            "verbs",
            "--rdma-device",
            "rxe0",
            "--rdma-qps-per-peer",
            "4",
            "--rdma-port",
            "2",
            "--rdma-gid-index",
            "3",
        ]);
        assert_eq!(got, Ok(TransportChoice::Verbs(want)));
        // Missing device: refused by clap, naming the flag.
        let e = pd_transport(&["--transport", "verbs"]).unwrap_err();
        assert!(e.contains("--rdma-device"), "{e}");
        // RDMA flags without verbs.
        let e = pd_transport(&["--rdma-device", "mlx5_0"]).unwrap_err();
        assert!(e.contains("--transport verbs"), "{e}");
        let e = pd_transport(&["--rdma-qps-per-peer", "4"]).unwrap_err();
        assert!(e.contains("--rdma-device"), "{e}");
        // Out of range.
        for n in ["0", &(kvferry::limits::VERBS_QPS_PER_PEER_MAX + 1).to_string()] {
            let e =
                pd_transport(&["--transport", "verbs", "--rdma-device", "x", "--rdma-qps-per-peer", n]).unwrap_err();
            assert!(e.contains("--rdma-qps-per-peer"), "{n}: {e}");
        }
    }

    #[test]
    fn window_secs_conflicts_with_requests() {
        let e =
            Cli::try_parse_from(["kvferry", "pd", "--requests", "5", "--window-secs", "3"]).err().expect("a conflict");
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert!(e.to_string().contains("--window-secs"), "{e}");
        // Each alone is fine (the default of --requests is no conflict).
        assert!(Cli::try_parse_from(["kvferry", "pd", "--window-secs", "3"]).is_ok());
        assert!(Cli::try_parse_from(["kvferry", "pd", "--requests", "5"]).is_ok());
    }

    #[test]
    fn metaserver_listens_on_loopback_unless_told() {
        match Cli::try_parse_from(["kvferry", "metaserver"]).unwrap().cmd {
            Cmd::Metaserver { addr, .. } => assert_eq!(addr, "127.0.0.1:50055"),
            _ => panic!("parsed as another command"),
        }
    }

    #[tokio::test]
    async fn listen_addrs_take_host_names_and_errors_name_the_flag() {
        let a = resolve_listen_addr("--addr", "localhost:50055").await.expect("localhost resolves");
        assert!(a.ip().is_loopback(), "{a}");
        assert_eq!(a.port(), 50055);
        assert_eq!(resolve_listen_addr("--addr", "0.0.0.0:7").await, Ok("0.0.0.0:7".parse().unwrap()));
        let e = resolve_listen_addr("--addr", "no-port").await.unwrap_err();
        assert!(e.starts_with("--addr no-port"), "{e}");
        let e = resolve_listen_addr("--http-addr", "no-port").await.unwrap_err();
        assert!(e.starts_with("--http-addr no-port"), "{e}");
        // --http-addr of both commands is parsed as text and resolved the same way.
        for cmd in [
            &["kvferry", "metaserver", "--http-addr", "localhost:9100"][..],
            &["kvferry", "pd", "--http-addr", "localhost:9100"],
        ] {
            let cli = Cli::try_parse_from(cmd).expect("a host name parses");
            let http = match cli.cmd {
                Cmd::Metaserver { http_addr, .. } => http_addr,
                Cmd::Pd(a) => a.http_addr,
                _ => panic!("parsed as another command"),
            };
            assert_eq!(http.as_deref(), Some("localhost:9100"));
        }
    }

    #[test]
    fn metaserver_config_errors_name_flags() {
        use kvferry::metaserver::service::ConfigError;
        let e = StartError::Config(ConfigError::TtlBelowStaleAfter { ttl_secs: 1, stale_after_secs: 5 });
        let text = metaserver_error_text(&e);
        assert_eq!(text, "--ttl-secs (1) must be >= --stale-after-secs (5)");
        let e = StartError::Config(ConfigError::Zero(ConfigField::SweepIntervalSecs));
        assert_eq!(metaserver_error_text(&e), "--sweep-interval-secs must be at least 1 (s)");
        let e = StartError::Config(ConfigError::CapacityTooLarge { value: 1 << 40, max: 1 << 28 });
        assert_eq!(metaserver_error_text(&e), format!("--capacity ({}) must be at most {}", 1u64 << 40, 1u64 << 28));
        let e = StartError::Config(ConfigError::Shards { value: 0, max: 4096 });
        assert_eq!(metaserver_error_text(&e), "--shards (0) must be 1 to 4096");
    }

    #[test]
    fn report_path_is_checked_without_clobbering_and_written_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        std::fs::write(&path, "previous").unwrap();
        check_report_path(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "previous", "the check changes nothing");
        let fresh = dir.path().join("new.json");
        check_report_path(&fresh).unwrap();
        assert!(!fresh.exists(), "the check creates nothing");
        write_report(&path, "{\"x\": 1}").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"x\": 1}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("r.json")], "no temporary file left");
        // Unwritable: a missing directory, a directory.
        let e = check_report_path(&dir.path().join("missing/r.json")).unwrap_err();
        assert!(e.contains("missing/r.json"), "{e}");
        assert!(check_report_path(dir.path()).unwrap_err().contains("is a directory"));
    }
}
