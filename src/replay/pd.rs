//! `kvferry pd`: the P/D replay of a real trace across an embedded cluster
//! (design.md §6).
//!
//! One MetaServer (embedded, or external with `metaserver`), `prefill` +
//! `decode` nodes, each a real [`crate::node`] with its own gRPC server and
//! data plane on loopback (TCP, or RDMA verbs on one device with
//! [`PdConfig::transport`]). Per request: route to a prefill node, reuse
//! its longest cached prefix (local, else fetched from a peer), "compute"
//! the rest (KV bytes from [`fill_kv`], a pure function of namespace, block
//! hash, layer and segment, so any node can recompute them), save,
//! `flush_saves_and_registrations`, signal a decode node; the decode node
//! fetches, loads, verifies every byte against recomputation and recomputes
//! what it could not fetch.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::Serialize;
use tokio::time::Instant;

use super::trace::{self, ModelPreset, TraceError, TraceRequest, fill_kv, verify_kv};
use crate::engine::fetch::{FetchPhases, FetchReport};
use crate::engine::layout::{DeviceBufferId, LayerLayout};
use crate::engine::{Engine, EngineConfig, SharedPool};
use crate::gpu::{Gpu, KvMemory};
use crate::limits;
use crate::metaserver::{self, MetaServerConfig, MetaServerHandle};
use crate::node::{self, NodeConfig, NodeHandle, PathChoice, TransportChoice};
use crate::types::BlockHash;

/// Largest device KV region one replay node allocates (bytes).
const DEVICE_BYTES_MAX: u64 = 32 << 30;

/// Deadline of one node's graceful stop (unregister, gRPC server) at the
/// end of a replay or after a failed start.
const NODE_STOP_DEADLINE: Duration = Duration::from_millis(500);

/// How requests pick a prefill node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Routing {
    /// Request i goes to live prefill node i mod P.
    RoundRobin,
    /// The live prefill node with the longest local prefix (ties: round robin).
    PrefixAware,
}

/// Which nodes of the replay get a disk tier (`--ssd-roles`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum SsdRoles {
    /// Every node.
    #[default]
    All,
    /// Prefill nodes only: decode nodes hold copies of what prefill nodes
    /// saved, so their disk writes duplicate the prefill nodes' and share
    /// the same device's bandwidth.
    Prefill,
}

/// When a request brings its reused KV into its prefill node's pool
/// (`--prefetch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Prefetch {
    /// Everything on the request's own path, holding the prefill node's
    /// device: disk staging, the peers' blocks, the load.
    Off,
    /// The disk-resident part of the prefix is staged into the pool while
    /// the request waits for the device (`Engine::prefetch`); the peers'
    /// blocks are fetched holding it. The default.
    #[default]
    Disk,
    /// The whole fetch (disk staging and the peers' blocks, `Engine::fetch`)
    /// before the request queues for the device, which it then holds only
    /// to load, compute and save: an engine that loads a waiting request's
    /// external KV asynchronously while it runs others (vLLM's KV
    /// connectors: a request stays in `WAITING_FOR_REMOTE_KVS`, out of the
    /// running batch, until its load finished).
    Fetch,
}

impl Prefetch {
    /// `off`, `disk` or `fetch` (the flag's value and the JSON's).
    pub fn name(self) -> &'static str {
        match self {
            Prefetch::Off => "off",
            Prefetch::Disk => "disk",
            Prefetch::Fetch => "fetch",
        }
    }
}

/// How a decode node learns where its request's KV is (`--handoff`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Handoff {
    /// The prefill says "KV ready"; the decode asks the MetaServer who
    /// holds the prompt's blocks and locks them at that owner
    /// (`Engine::fetch_into`: query, lock RPC, reads). The default.
    #[default]
    Query,
    /// The prefill locks its blocks for the decode node as it says "KV
    /// ready" and passes the decode the lock (`Engine::grant_transfer`),
    /// which reads at once (`Engine::fetch_into_with_ticket`): no query,
    /// no lock RPC on the decode's path.
    Ticket,
}

impl Handoff {
    /// `query` or `ticket` (the flag's value and the JSON's).
    pub fn name(self) -> &'static str {
        match self {
            Handoff::Query => "query",
            Handoff::Ticket => "ticket",
        }
    }
}

/// A node's role in the replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Role {
    /// Computes and saves KV.
    Prefill,
    /// Fetches and loads KV.
    Decode,
}

impl Role {
    /// `prefill` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One data path's share of the replay's fetches (summed over the nodes
/// still running at the end).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PathLine {
    /// `ipc` (device to device from a same-host owner's KV: blocks
    /// copied, parts that fell back), `shm` or `tcp`.
    pub path: String,
    /// Blocks read on this path.
    pub blocks: u64,
    /// Bytes read on this path.
    pub bytes: u64,
    /// `bytes` ÷ the seconds with a fetch in flight (GB/s); the aggregate
    /// rate when one path moved everything.
    pub gbps: f64,
    /// Blocks whose read on this path failed and went to the next path.
    pub fallbacks: u64,
    /// Handshakes in which this path could not be set up.
    pub attach_failures: u64,
}

/// The start-up connections of decode engines to prefill engines
/// (`--connect-peers`, [`Engine::connect_peer`]), one per pair.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ConnectLine {
    /// Decode × prefill pairs tried.
    pub pairs: u64,
    /// Pairs whose prefill pool is open for one-step copies.
    pub ready: u64,
    /// Pairs that read over the transport (no mapping: forced TCP,
    /// another host, or no one-step copies).
    pub not_mapped: u64,
    /// Pairs whose pool was still being opened at the timeout.
    pub opening: u64,
    /// Pairs whose pool the GPU backend refused as a copy source.
    pub refused: u64,
    /// Pairs whose handshake failed (logged with both nodes; they connect
    /// on their first fetch instead).
    pub failed: u64,
    /// Seconds the step took (all pairs at once; part of `startup_s`).
    pub seconds: f64,
}

/// Per-node copy statistics (device save/load rates, timed submit to
/// completion).
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeStat {
    /// `prefill` or `decode`.
    pub role: String,
    /// Index within the role.
    pub index: usize,
    /// Device label (`host`, `cuda:0`, …).
    pub device: String,
    /// Bytes copied device → pool.
    pub save_bytes: u64,
    /// Save copy rate (GB/s).
    pub save_gbps: f64,
    /// Bytes copied pool → device.
    pub load_bytes: u64,
    /// Load copy rate (GB/s).
    pub load_gbps: f64,
    /// Blocks this node's pool evicted to make room (LRU).
    pub evicted_blocks: u64,
}

/// The phases of one P/D handoff, in order. They tile it: from the prefill
/// node's barrier call to the end of the decode node's load, each phase
/// starts where the previous one ended, so per request they add up to the
/// handoff exactly.
///
/// - `save_barrier`: [`Engine::flush_saves`] on the prefill node (the
///   request's own save was awaited before, so this is the wait for other
///   saves in flight);
/// - `registration_barrier`: the MetaServer flush of the prefill node's
///   registration queue (C1);
/// - `ticket`: with `--handoff ticket`, the prefill node's transfer lock
///   for the decode node ([`Engine::grant_transfer`]; 0 otherwise);
/// - `decode_wait`: waiting for the decode node's device (another request
///   holds it; 0 at `--concurrency 1`);
/// - `fetch`: the decode node's local lookup and [`Engine::fetch_into`] up
///   to its last read part (MetaServer query, handshake, transfer lock,
///   read, verify, seal, release: split in [`FetchPhases`]); the loads of
///   all parts but the last run inside it, behind the reads;
/// - `load`: the load of the last part, after the fetch ended
///   ([`FetchPhases::load_tail`]).
pub const HANDOFF_PHASES: [&str; 6] =
    ["save_barrier", "registration_barrier", "ticket", "decode_wait", "fetch", "load"];

/// The steps of one request on its two nodes, in order; per request they
/// tile the time from the request's start to the end of its decode
/// verification, so their sums over all requests ([`PdReport::request_steps_s`])
/// say where the replay's node time goes (a node runs one request's device
/// step at a time, so such a step's sum over one node's requests is that
/// node's busy time in it).
///
/// - `prefill_wait`: waiting for the prefill node's device (another
///   request holds it), with `--prefetch disk` staging the request's
///   disk-resident prefix meanwhile, and for its device leases to end;
/// - `prefill_lookup`: the local prefix lookup;
/// - `prefill_fetch`: the prefill node's fetch of the prefix it lacks
///   (with `--prefetch fetch`, most of it before the request queues for
///   the device: requests fetch side by side);
/// - `prefill_load`: loading the reused prefix (staging from disk
///   included);
/// - `prefill_compute`: "computing" the rest;
/// - `prefill_save`: saving every block (pool eviction and the disk
///   tier's write-behind hand-off included);
/// - `prefill_barrier`: save and registration barriers (and a lease grant;
///   with `--handoff ticket`, the decode's transfer ticket);
/// - `decode_wait`: waiting for the decode node's device;
/// - `decode_fetch`: the decode node's lookup and `fetch_into` (load
///   included);
/// - `decode_verify`: recomputing what was not fetched and verifying
///   every block.
pub const REQUEST_STEPS: [&str; 10] = [
    "prefill_wait",
    "prefill_lookup",
    "prefill_fetch",
    "prefill_load",
    "prefill_compute",
    "prefill_save",
    "prefill_barrier",
    "decode_wait",
    "decode_fetch",
    "decode_verify",
];

/// One phase's distribution over the T8 requests (ms).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PhaseMs {
    /// Median (ms).
    pub p50: f64,
    /// 99th percentile (ms).
    pub p99: f64,
    /// Mean (ms): the means of [`HANDOFF_PHASES`] add up to the mean
    /// handoff, which percentiles do not.
    pub mean: f64,
}

/// Replay settings (the `kvferry pd` flags).
#[derive(Clone, Debug)]
pub struct PdConfig {
    /// Trace file (JSON lines: timestamp, input_length, output_length, hash_ids).
    pub trace: PathBuf,
    /// Model preset name (`qwen3-8b`, `llama3-8b`, `tiny`).
    pub model: String,
    /// Tokens per engine block (divides 512).
    pub block_tokens: u64,
    /// First request of the window.
    pub first: usize,
    /// Requests to replay (None: all from `first`, or the time window).
    pub requests: Option<usize>,
    /// Replay the requests of this many seconds of trace time instead.
    pub window_secs: Option<u64>,
    /// Prefill nodes.
    pub prefill: usize,
    /// Decode nodes.
    pub decode: usize,
    /// Pinned pool per node (bytes).
    pub pool_bytes: u64,
    /// Read parts a decode fetch keeps in flight
    /// (`EngineConfig::fetch_reads_in_flight`).
    pub fetch_reads_in_flight: usize,
    /// Decode fetches from a same-host owner's shared pool copy straight
    /// into the decode's KV (`EngineConfig::shared_pool_direct`).
    pub shared_pool_direct: bool,
    /// Bytes of blocks per read part (`EngineConfig::fetch_read_part_bytes`).
    pub fetch_read_part_bytes: u64,
    /// Decode engines connect to the prefill engines before the replay
    /// ([`Engine::connect_peer`]); false: on their first fetch.
    pub connect_peers: bool,
    /// Routing policy.
    pub routing: Routing,
    /// Seed (node RNGs, fault hooks).
    pub seed: u64,
    /// External MetaServer (`http://host:port`); None embeds one.
    pub metaserver: Option<String>,
    /// Kill (and later restart, empty) the embedded MetaServer at this
    /// fraction of the requests.
    pub kill_metaserver_at: Option<f64>,
    /// Kill prefill node 0 at this fraction of the requests.
    pub kill_prefill_at: Option<f64>,
    /// Fraction of registration RPCs the embedded MetaServer drops.
    pub drop_registrations: f64,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Keep only the first N engine blocks of each request (a cheaper
    /// replay with the same prefix structure; the oracle is computed on the
    /// truncated requests too).
    pub max_blocks: Option<u64>,
    /// Deadline of one handoff flush.
    pub flush_deadline: Duration,
    /// Deadline of one fetch.
    pub fetch_deadline: Duration,
    /// Data plane of every node (`--transport`, `--rdma-device`): all nodes
    /// share it, so with verbs they all open the same device.
    pub transport: TransportChoice,
    /// Which paths the TCP nodes read each other's pools through
    /// (`--path`): all nodes of the replay run on this host, so with
    /// [`PathChoice::Auto`] (the default) every fetch goes through the
    /// owner's shared pool; [`PathChoice::Tcp`] forces TCP loopback.
    pub path: PathChoice,
    /// Disk tier below each node's pool (`--ssd-dir`): node `i` keeps its
    /// file in the subdirectory `node-i` (created). None: no disk tier.
    pub ssd_dir: Option<PathBuf>,
    /// Size of each node's disk tier (bytes, `--ssd-size`).
    pub ssd_bytes: u64,
    /// Which nodes get a disk tier (`--ssd-roles`).
    pub ssd_roles: SsdRoles,
    /// Write-behind queue of each node's disk tier (blocks,
    /// `--ssd-write-queue`); `None`: [`limits::PD_SSD_WRITE_QUEUE_BYTES`]
    /// of blocks, 1 to [`limits::PD_SSD_WRITE_QUEUE_MAX`].
    pub ssd_write_queue: Option<usize>,
    /// When a request brings its reused KV into its prefill node's pool
    /// (`--prefetch`).
    pub prefetch: Prefetch,
    /// How the decode node learns where the KV is (`--handoff`).
    pub handoff: Handoff,
    /// When this turns true (the binary's Ctrl-C), no further request is
    /// started; the requests in flight finish (each bounded by its flush
    /// and fetch deadlines) and the report covers the requests replayed so
    /// far, with [`PdReport::interrupted`] set. None: run to the end.
    pub stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            trace: trace::default_trace_path(),
            model: "tiny".into(),
            block_tokens: 64,
            first: 0,
            requests: Some(400),
            window_secs: None,
            prefill: 2,
            decode: 2,
            pool_bytes: 1 << 30,
            fetch_reads_in_flight: limits::FETCH_READS_IN_FLIGHT,
            shared_pool_direct: true,
            fetch_read_part_bytes: limits::FETCH_READ_PART_BYTES,
            connect_peers: true,
            routing: Routing::RoundRobin,
            seed: 0,
            metaserver: None,
            kill_metaserver_at: None,
            kill_prefill_at: None,
            drop_registrations: 0.0,
            concurrency: 4,
            max_blocks: None,
            flush_deadline: Duration::from_secs(5),
            fetch_deadline: Duration::from_secs(5),
            transport: TransportChoice::Tcp,
            path: PathChoice::Auto,
            ssd_dir: None,
            ssd_bytes: 8 << 30,
            ssd_roles: SsdRoles::All,
            ssd_write_queue: None,
            prefetch: Prefetch::Disk,
            handoff: Handoff::Query,
            stop: None,
        }
    }
}

/// The final report (`--json` writes it; keys are stable).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PdReport {
    /// Requests replayed (fewer than the window's when interrupted).
    pub requests: u64,
    /// True when the replay was stopped early ([`PdConfig::stop`]): every
    /// figure covers the requests replayed, the oracle included.
    pub interrupted: bool,
    /// Engine blocks across all requests (decode side).
    pub blocks_total: u64,
    /// Blocks whose bytes on the decode device equal recomputation (= all).
    pub blocks_verified: u64,
    /// Blocks the decode nodes fetched from peers.
    pub blocks_fetched: u64,
    /// Blocks the decode nodes recomputed (not fetched).
    pub blocks_recomputed: u64,
    /// Blocks decode nodes already held locally.
    pub blocks_decode_local: u64,
    /// Prefill-side prefix hits: blocks reused from the node's own cache.
    pub prefill_local_hits: u64,
    /// Prefill-side prefix hits: blocks fetched from a peer.
    pub prefill_fetched: u64,
    /// Bytes moved through the transport (all fetches).
    pub bytes_transferred: u64,
    /// Wall-clock seconds during which at least one fetch (prefill or
    /// decode side) was in flight: the union of the fetch intervals, so
    /// concurrent fetches are not counted twice.
    pub fetch_busy_s: f64,
    /// Transport throughput: `bytes_transferred` ÷ `fetch_busy_s` (GB/s,
    /// 1e9 B/s): the aggregate rate of the concurrent fetches.
    pub transport_gbps: f64,
    /// Prefill prefix hit rate (local + fetched) over all blocks.
    pub prefix_hit_rate: f64,
    /// The trace window's infinite-cache oracle at engine-block granularity.
    pub oracle_hit_rate: f64,
    /// Handoff latency (flush + query + fetch) percentiles (ms).
    pub handoff_p50_ms: f64,
    /// 99th percentile.
    pub handoff_p99_ms: f64,
    /// Requests in flight at once (`--concurrency`): T8 is defined at 1.
    pub concurrency: usize,
    /// When requests brought their reused KV into the prefill pools
    /// (`--prefetch`: `off`, `disk` or `fetch`).
    pub prefetch: Prefetch,
    /// How decode nodes learned where the KV was (`--handoff`: `query` or
    /// `ticket`).
    pub handoff: Handoff,
    /// T8's baseline, measured at start-up (GB/s, 1e9 B/s): the best plain
    /// copy of `raw_copy_bytes` on the fetches' path (`raw_path`): with
    /// `--path tcp` [`crate::transport::tcp::raw_loopback_copy`] over 1-16
    /// connections, else (the replay's nodes share this host, so they read
    /// each other's pools) [`crate::transport::shm::raw_memcpy`] on 1-16
    /// threads; the count that won is `raw_connections`, the fastest of
    /// [`crate::limits::PD_RAW_COPY_REPS`] each. With `--path ipc` on a
    /// backend with a device (`cuda`), that device's own best copy
    /// ([`crate::gpu::Gpu::time_raw_device_copy`]); with `--path shm` and
    /// the one-step shared pool on such a backend, its pinned host → device
    /// copy ([`crate::gpu::Gpu::time_raw_host_to_device_copy`]). `None`
    /// with verbs.
    pub raw_gbps: Option<f64>,
    /// Bytes of the raw copy: the longest request's blocks, within
    /// [`crate::limits::PD_RAW_COPY_BYTES_MIN`]..=[`crate::limits::PD_RAW_COPY_BYTES_MAX`].
    pub raw_copy_bytes: u64,
    /// Connections (tcp) or threads (shm) of the fastest raw copy (0 when
    /// not measured).
    pub raw_connections: usize,
    /// The path of the raw copy: `tcp` (loopback), `shm` (memcpy), `device`
    /// (device to device), `h2d` (pinned host → device) or empty.
    pub raw_path: String,
    /// Aggregate fetch throughput: all fetched bytes ÷ the union of the
    /// fetch intervals (GB/s; the same figure as `transport_gbps`), to be
    /// read next to `raw_gbps`.
    pub fetch_gbps_aggregate: f64,
    /// Requests whose decode-side fetch moved at least
    /// [`crate::limits::PD_T8_FETCH_BYTES_MIN`] bytes: the ones T8 and the
    /// phase split cover.
    pub t8_requests: u64,
    /// T8 median: per request, handoff time (barriers through load, the
    /// sum of [`HANDOFF_PHASES`]) ÷ (decode bytes fetched ÷ raw rate).
    /// Meaningful at `--concurrency 1`. `None` without a raw rate or a T8
    /// request.
    pub t8_p50: Option<f64>,
    /// T8 99th percentile.
    pub t8_p99: Option<f64>,
    /// Per phase of [`HANDOFF_PHASES`], and `total` (the whole handoff, as
    /// T8 times it): p50, p99 and mean over the T8 requests (ms).
    pub handoff_phases_ms: BTreeMap<String, PhaseMs>,
    /// The `fetch` phase split into [`FetchPhases::named`] (ms), over the
    /// same requests (without `load_tail`, which is the `load` phase).
    pub fetch_phases_ms: BTreeMap<String, PhaseMs>,
    /// Seconds per step of [`REQUEST_STEPS`], summed over every request:
    /// where the nodes' time went (with `--concurrency` above 1 the waits
    /// overlap other requests' work).
    pub request_steps_s: BTreeMap<String, f64>,
    /// Registry commands dropped, from the prefill nodes' flush reports at
    /// the handoff barriers: inserts of saved blocks and the removals that
    /// pool eviction queued (so more than the blocks saved is possible).
    /// The key keeps its historical name.
    pub registrations_dropped: u64,
    /// Registry commands delivered, counted as `registrations_dropped`.
    pub registrations_delivered: u64,
    /// Blocks rejected by checksum.
    pub checksum_failures: u64,
    /// With `--handoff ticket`: decode fetches that read from the
    /// prefill's ticket, and tickets released unread (their fetch went the
    /// query way: blocks already local, the ticket expired, ...), summed
    /// over the nodes (`EngineMetrics::fetch_tickets`, `fetch_tickets_unused`).
    pub tickets_used: u64,
    /// See `tickets_used`.
    pub tickets_unused: u64,
    /// Faults injected, in order.
    pub faults: Vec<String>,
    /// Model preset.
    pub model: String,
    /// Data plane of the nodes (`tcp`, or `verbs DEVICE port N`).
    pub transport: String,
    /// The `--path` choice (`auto`, `shm`, `tcp`).
    pub path: String,
    /// Per data path (shared pool, TCP): blocks, bytes, GB/s, fallbacks.
    pub paths: Vec<PathLine>,
    /// The start-up connections (`--connect-peers`); `None` when off.
    pub connect_peers: Option<ConnectLine>,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Pinned pool of each node (bytes, `--pool-size`).
    pub pool_bytes: u64,
    /// Blocks evicted from the pools, all nodes (LRU, to make room): with
    /// the pool size, what reconciles the prefix hit rate with the oracle.
    pub evicted_blocks: u64,
    /// Per-node device copy statistics.
    pub nodes: Vec<NodeStat>,
    /// The disk tier below the pools (`--ssd-dir`), all nodes; None
    /// without one.
    pub ssd: Option<SsdLine>,
    /// Wall-clock seconds, start-up and shut-down included.
    pub wall_s: f64,
    /// Of `wall_s`, seconds before the first request started: the
    /// oracle, T8's raw baseline and the nodes' start-up (with a disk
    /// tier, opening each node's file and its recovery scan).
    pub startup_s: f64,
    /// Of `wall_s`, seconds from the first request's start to the last
    /// one's end: the replay itself (issue 32's wall-time target compares
    /// this, with and without the tier).
    pub replay_s: f64,
}

/// The disk tier's figures over the replay, summed over nodes (the pd
/// report's `ssd` line and JSON object).
#[derive(Clone, Debug, Default, Serialize)]
pub struct SsdLine {
    /// Size of each node's tier (bytes).
    pub bytes_per_node: u64,
    /// Nodes with a tier (`--ssd-roles`: every node, or the prefill
    /// nodes); the figures below are summed over them.
    pub nodes: u64,
    /// Which backend ran (`io_uring + O_DIRECT`, threads, simulated).
    pub backend: String,
    /// Blocks written (records completed).
    pub written_blocks: u64,
    /// Block bytes written.
    pub written_bytes: u64,
    /// Blocks read back and verified.
    pub read_blocks: u64,
    /// Block bytes read back and verified.
    pub read_bytes: u64,
    /// Reads started on a block the tier holds (on disk, or being
    /// written: waiting in its write-behind queue or at the disk).
    pub hits: u64,
    /// Of the blocks read, those served from the write-behind queue's
    /// buffer (their write had not started yet).
    pub queue_reads: u64,
    /// Of the blocks read, those whose write was under way at the disk:
    /// served from that write's buffer once it completed.
    pub after_write_reads: u64,
    /// Blocks staged into a pool from disk (local lookups, loads, peers'
    /// lock requests).
    pub staged_blocks: u64,
    /// Records evicted from the disk (its LRU).
    pub evicted: u64,
    /// Reads whose bytes did not verify (C17): never served.
    pub verify_failures: u64,
    /// Pool evictions the tier refused (queue full, no space): dropped.
    pub write_refused: u64,
    /// Of those, for want of disk space.
    pub write_refused_no_space: u64,
    /// Of those, at a full write-behind queue (`--ssd-write-queue`).
    pub write_refused_queue_full: u64,
    /// Stagings that failed or missed their deadline.
    pub stage_failures: u64,
    /// Of those, stagings that found no room in the pool.
    pub stage_no_room: u64,
    /// Records recovered at start (a directory reused from a previous run).
    pub recovered: u64,
    /// Write throughput averaged over the replay (`replay_s`; GB/s).
    pub write_gbps: f64,
    /// Read throughput averaged over the replay (`replay_s`; GB/s).
    pub read_gbps: f64,
    /// Mean time from a read's request to its verified record (ms): the
    /// disk's latency under the replay's write-behind load, queueing
    /// included.
    pub read_ms_mean: f64,
}

/// Replay errors: all are configuration or input problems, reported before
/// the cluster starts where possible.
#[derive(Debug, thiserror::Error)]
pub enum PdError {
    /// The trace could not be read or parsed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A flag is out of range.
    #[error("{0}")]
    Config(String),
    /// A node or the MetaServer failed to start.
    #[error("start-up failed: {0}")]
    Start(String),
    /// A device operation failed.
    #[error("device error: {0}")]
    Device(String),
    /// [`PdConfig::stop`] was raised during start-up (Ctrl-C): nothing was
    /// replayed, and what had started was stopped.
    #[error("interrupted during start-up ({0}); nothing was replayed")]
    Interrupted(&'static str),
}

impl PdError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            PdError::Trace(_) => "pd_trace",
            PdError::Config(_) => "pd_config",
            PdError::Start(_) => "pd_start",
            PdError::Device(_) => "pd_device",
            PdError::Interrupted(_) => "pd_interrupted",
        }
    }
}

/// Progress callbacks (the binary draws a bar; tests pass `()`).
pub trait Progress: Send + Sync {
    /// Called once with the number of requests.
    fn start(&self, _total: u64) {}
    /// Called after each request.
    fn tick(&self, _bytes_so_far: u64) {}
    /// Called when a fault is injected.
    fn fault(&self, _what: &str) {}
    /// Called at the end.
    fn finish(&self) {}
}

impl Progress for () {}

/// A node of the replay and its device KV region.
struct PdNode {
    role: Role,
    index: usize,
    device_label: String,
    handle: std::sync::Mutex<Option<NodeHandle>>,
    engine: Engine,
    /// The node's KV cache: memory the replay (the embedder) allocated and
    /// registered, never the backend's.
    kv: KvCache,
    /// Serializes use of the device region (block slots are per request).
    device: tokio::sync::Mutex<()>,
}

struct Shape {
    ns: String,
    model: &'static ModelPreset,
    seg: u64,
    device_blocks: u64,
}

/// A node's paged KV cache as an engine keeps it: per layer a K and a V
/// tensor `[device_blocks, block_tokens, kv_heads, head_dim]` ("NHD"), each
/// its own allocation, registered with the engine as a device buffer.
struct KvCache {
    layers: Vec<LayerLayout>,
    engine: Engine,
    ns: String,
    /// Each tensor's memory and buffer id, freed on drop only once the
    /// engine let go of it (C15).
    memory: Vec<(DeviceBufferId, Box<dyn KvMemory>)>,
}

impl Drop for KvCache {
    /// What an engine must do before it frees its KV tensors: unregister
    /// the layout, then each buffer; a buffer the engine still uses (a copy
    /// in flight) is leaked rather than freed under it.
    fn drop(&mut self) {
        let _ = self.engine.unregister_layout(&self.ns);
        for (id, m) in self.memory.drain(..) {
            if let Err(e) = self.engine.unregister_buffer(id) {
                tracing::warn!(%id, error = %e, "KV memory still in use at shutdown: leaked, not freed");
                std::mem::forget(m);
            }
        }
    }
}

impl KvCache {
    /// Allocates the tensors on `engine`'s device, registers each as a
    /// buffer and the namespace's layout over them. On error everything
    /// allocated so far is unregistered and freed (`Drop`).
    fn allocate(engine: &Engine, shape: &Shape) -> Result<Self, PdError> {
        let mut kv = Self { layers: Vec::new(), engine: engine.clone(), ns: shape.ns.clone(), memory: Vec::new() };
        for _ in 0..shape.model.layers {
            let (k, v) = (kv.tensor(shape)?, kv.tensor(shape)?);
            kv.layers.push(LayerLayout::paged(k, Some(v), shape.device_blocks, shape.seg));
        }
        engine.register_layout(&shape.ns, kv.layers.clone()).map_err(|e| PdError::Start(e.to_string()))?;
        Ok(kv)
    }

    /// One `[device_blocks, …]` tensor of `shape.seg` bytes per block.
    fn tensor(&mut self, shape: &Shape) -> Result<DeviceBufferId, PdError> {
        let bytes = shape.device_blocks * shape.seg;
        let m = self.engine.gpu().alloc_kv_memory(bytes).map_err(|e| PdError::Device(e.to_string()))?;
        // SAFETY: `m` lives in `self.memory` and is freed only after the
        // engine unregistered it (`Drop`).
        let id =
            unsafe { self.engine.register_buffer(m.addr(), m.len()) }.map_err(|e| PdError::Device(e.to_string()))?;
        self.memory.push((id, m));
        Ok(id)
    }
}

/// Validates the configuration and loads the trace window.
fn prepare(cfg: &PdConfig) -> Result<(Vec<TraceRequest>, &'static ModelPreset), PdError> {
    if cfg.prefill == 0 || cfg.decode == 0 {
        return Err(PdError::Config(format!(
            "need at least one prefill and one decode node (got {} prefill, {} decode)",
            cfg.prefill, cfg.decode
        )));
    }
    if cfg.concurrency == 0 {
        return Err(PdError::Config("concurrency must be at least 1".into()));
    }
    if !(0.0..=1.0).contains(&cfg.drop_registrations) {
        return Err(PdError::Config(format!("--drop-registrations {} not in [0, 1]", cfg.drop_registrations)));
    }
    for (name, f) in [("--kill-metaserver-at", cfg.kill_metaserver_at), ("--kill-prefill-at", cfg.kill_prefill_at)] {
        if let Some(f) = f {
            if !(0.0..1.0).contains(&f) {
                return Err(PdError::Config(format!(
                    "{name} {f} not in [0, 1): the fault must fire before the run ends"
                )));
            }
        }
    }
    if cfg.metaserver.is_some() && (cfg.kill_metaserver_at.is_some() || cfg.drop_registrations > 0.0) {
        return Err(PdError::Config(
            "--kill-metaserver-at and --drop-registrations need the embedded MetaServer (omit --metaserver)".into(),
        ));
    }
    if cfg.kill_prefill_at.is_some() && cfg.prefill < 2 {
        return Err(PdError::Config("--kill-prefill-at needs at least 2 prefill nodes".into()));
    }
    let model = trace::preset(&cfg.model)?;
    trace::check_block_tokens(cfg.block_tokens)?;
    let block_bytes = model.block_bytes(cfg.block_tokens);
    if cfg.pool_bytes < block_bytes {
        return Err(PdError::Config(format!(
            "--pool-size {} bytes is smaller than one block ({block_bytes} bytes for {} at {} tokens/block)",
            cfg.pool_bytes, model.name, cfg.block_tokens
        )));
    }
    let all = trace::load_trace(&cfg.trace)?;
    let reqs = match cfg.window_secs {
        Some(secs) => {
            let start = all.get(cfg.first).map(|r| r.timestamp_ms).unwrap_or(0);
            trace::window_by_time(&all, start, secs * 1000).to_vec()
        }
        None => trace::window(&all, cfg.first, cfg.requests).to_vec(),
    };
    if reqs.is_empty() {
        return Err(PdError::Config(format!(
            "the selected trace window holds no requests (the trace holds {}, the window starts at request {})",
            all.len(),
            cfg.first
        )));
    }
    let reqs = match cfg.max_blocks {
        Some(0) => return Err(PdError::Config("--max-blocks must be at least 1".into())),
        Some(m) => reqs.into_iter().map(|r| truncate(r, m * cfg.block_tokens)).collect(),
        None => reqs,
    };
    Ok((reqs, model))
}

/// Cuts a request to its first `tokens` prompt tokens (whole trace blocks kept
/// as far as they are covered).
fn truncate(mut r: TraceRequest, tokens: u64) -> TraceRequest {
    if r.input_length > tokens {
        r.input_length = tokens;
        let keep = tokens.div_ceil(trace::TRACE_BLOCK_TOKENS) as usize;
        r.hash_ids.truncate(keep.max(1));
    }
    r
}

/// Where segment `seg` of block `slot` of layer `ly` lives.
fn segment_at(ly: &LayerLayout, slot: u64, seg: u8) -> (DeviceBufferId, u64) {
    let base = ly.segment(seg).expect("the replay's layers are split K/V");
    (base.buffer, base.offset + slot * ly.block_stride)
}

/// Fills device slot `slot` with the KV of `hash` (the "compute").
fn compute_block(gpu: &dyn Gpu, shape: &Shape, kv: &KvCache, slot: u64, hash: &BlockHash) -> Result<(), PdError> {
    let mut buf = vec![0u8; shape.seg as usize];
    for (l, ly) in kv.layers.iter().enumerate() {
        for seg in 0..2u8 {
            fill_kv(&shape.ns, hash, l as u32, u32::from(seg), &mut buf);
            let (buffer, off) = segment_at(ly, slot, seg);
            gpu.write(buffer, off, &buf).map_err(|e| PdError::Device(e.to_string()))?;
        }
    }
    Ok(())
}

/// Checks device slot `slot` holds exactly the KV of `hash`.
fn verify_block(gpu: &dyn Gpu, shape: &Shape, kv: &KvCache, slot: u64, hash: &BlockHash) -> Result<bool, PdError> {
    let mut buf = vec![0u8; shape.seg as usize];
    for (l, ly) in kv.layers.iter().enumerate() {
        for seg in 0..2u8 {
            let (buffer, off) = segment_at(ly, slot, seg);
            gpu.read(buffer, off, &mut buf).map_err(|e| PdError::Device(e.to_string()))?;
            if !verify_kv(&shape.ns, hash, l as u32, u32::from(seg), &buf) {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Per-request outcome.
#[derive(Default)]
struct ReqOutcome {
    blocks: u64,
    prefill_local: u64,
    prefill_fetched: u64,
    decode_local: u64,
    decode_fetched: u64,
    verified: u64,
    bytes: u64,
    /// (start, end) of each fetch this request ran (prefill and decode).
    fetch_intervals: Vec<(Instant, Instant)>,
    handoff: Duration,
    /// Bytes the decode node's fetch moved.
    decode_fetch_bytes: u64,
    /// Barrier call to load end: the sum of `phases`.
    handoff_total: Duration,
    /// Per [`HANDOFF_PHASES`].
    phases: [Duration; 6],
    /// The decode fetch's sub-phases.
    fetch_phases: Option<FetchPhases>,
    /// Per [`REQUEST_STEPS`].
    steps: [Duration; REQUEST_STEPS.len()],
    delivered: u64,
    dropped: u64,
}

async fn start_metaserver(addr: SocketAddr, cfg: &PdConfig) -> Result<MetaServerHandle, PdError> {
    let mut mcfg = MetaServerConfig::new(addr);
    mcfg.seed = cfg.seed;
    mcfg.stale_after_secs = 4;
    mcfg.ttl_secs = 30;
    mcfg.sweep_interval_secs = 2;
    let h = metaserver::start(mcfg).await.map_err(|e| PdError::Start(e.to_string()))?;
    h.hooks.drop_writes_ppm.store((cfg.drop_registrations * 1e6) as u32, Ordering::Relaxed);
    Ok(h)
}

/// Runs the replay. See the module doc.
///
/// # Errors
/// [`PdError`] for bad flags, an unreadable trace, or a start-up failure.
pub async fn run(
    cfg: PdConfig,
    gpu_factory: impl Fn(Role, usize) -> Result<(Arc<dyn Gpu>, String), PdError>,
    progress: &dyn Progress,
) -> Result<PdReport, PdError> {
    run_with_observer(cfg, gpu_factory, progress, |_| Ok(())).await
}

/// [`run`], calling `on_ready` with every node's engine once the cluster is
/// up (the binary starts its metrics exporter there).
///
/// # Errors
/// As [`run`]; an `on_ready` error aborts the run as [`PdError::Start`].
pub async fn run_with_observer(
    cfg: PdConfig,
    gpu_factory: impl Fn(Role, usize) -> Result<(Arc<dyn Gpu>, String), PdError>,
    progress: &dyn Progress,
    on_ready: impl FnOnce(&[Engine]) -> Result<(), String>,
) -> Result<PdReport, PdError> {
    let (reqs, model) = prepare(&cfg)?;
    let wall = Instant::now();
    let oracle = trace::oracle_engine_blocks(&reqs, cfg.block_tokens);
    let max_blocks = reqs.iter().map(|r| r.input_length / cfg.block_tokens).max().unwrap_or(1).max(1);
    let device_bytes = max_blocks.saturating_mul(model.block_bytes(cfg.block_tokens));
    if device_bytes > DEVICE_BYTES_MAX {
        return Err(PdError::Config(format!(
            "the longest request needs a {:.1} GiB device KV region per node (limit {} GiB): use --max-blocks or a smaller model",
            device_bytes as f64 / (1u64 << 30) as f64,
            DEVICE_BYTES_MAX >> 30
        )));
    }
    if device_bytes > cfg.pool_bytes {
        tracing::warn!(
            longest_request = %size_text(device_bytes),
            pool = %size_text(cfg.pool_bytes),
            "the longest request's KV is larger than a node's pool: its prefill evicts the request's first blocks while saving the rest, and the decode recomputes what it cannot fetch (raise --pool-size, or cut requests with --max-blocks)"
        );
    }
    let shape = Arc::new(Shape {
        ns: format!("{}-bf16-tp1-bt{}", model.name, cfg.block_tokens),
        model,
        seg: model.segment_bytes(cfg.block_tokens),
        device_blocks: max_blocks,
    });

    // T8's baseline, before any node runs: the best plain copy of the
    // longest request's bytes on the path the fetches take (every node of
    // the replay is on this host, so `--path auto` reads shared pools):
    // over TCP loopback with 1-16 connections, or a memcpy on 1-16 threads.
    let raw_copy_bytes = device_bytes.clamp(limits::PD_RAW_COPY_BYTES_MIN, limits::PD_RAW_COPY_BYTES_MAX);
    let raw_path = match (&cfg.transport, cfg.path) {
        (TransportChoice::Tcp, PathChoice::Tcp) => RawPath::Tcp,
        (TransportChoice::Tcp, _) => RawPath::Shm,
        _ => RawPath::None,
    };
    let stopped = || cfg.stop.as_ref().is_some_and(|s| *s.borrow());
    if stopped() {
        return Err(PdError::Interrupted("before the raw copy baseline"));
    }
    let (raw_gbps, raw_connections) = match raw_path {
        RawPath::None => (None, 0),
        path => {
            let (gbps, streams) = raw_copy_gbps(raw_copy_bytes, path).await?;
            (Some(gbps), streams)
        }
    };

    if stopped() {
        return Err(PdError::Interrupted("before the cluster started"));
    }
    check_ssd_space(&cfg)?;
    let mut faults = Vec::new();
    let mut ms: Option<MetaServerHandle> = None;
    let ms_url = match &cfg.metaserver {
        Some(url) => url.clone(),
        None => {
            let h = start_metaserver("127.0.0.1:0".parse().expect("literal"), &cfg).await?;
            let url = format!("http://{}", h.local_addr);
            ms = Some(h);
            url
        }
    };
    let ms_addr = ms.as_ref().map(|h| h.local_addr);

    let mut nodes: Vec<Arc<PdNode>> = Vec::new();
    for i in 0..cfg.prefill + cfg.decode {
        // Each node allocates (and commits) its pool: honour a Ctrl-C
        // before the next one rather than after all of them.
        if stopped() {
            stop_cluster(&nodes, ms).await;
            return Err(PdError::Interrupted("while starting the nodes, before their pools were allocated"));
        }
        match start_node(i, &cfg, &ms_url, &shape, &gpu_factory).await {
            Ok(n) => nodes.push(n),
            Err(e) => {
                // Nothing may outlive a failed start (heartbeating clients
                // of the nodes already up, the embedded MetaServer).
                stop_cluster(&nodes, ms).await;
                return Err(e);
            }
        }
    }
    let engines: Vec<Engine> = nodes.iter().map(|n| n.engine.clone()).collect();
    on_ready(&engines).map_err(PdError::Start)?;
    if cfg.metaserver.is_some() {
        // An explicit MetaServer that cannot be reached is a configuration
        // error, not a silent all-recompute run.
        let probe = [BlockHash::from_u64(0)];
        if let Err(e) = engines[0].client().query_prefix(&shape.ns, &probe, Duration::from_secs(3)).await {
            for node in &nodes {
                node.engine.client().abort();
            }
            return Err(PdError::Start(format!("MetaServer {ms_url} is unreachable: {e}")));
        }
    }
    if cfg.drop_registrations > 0.0 {
        let msg = format!("metaserver drops {:.1} % of registration RPCs", cfg.drop_registrations * 100.0);
        progress.fault(&msg);
        faults.push(msg);
    }
    // `--path ipc` on a backend with a device copies device to device: T8
    // then divides by that device's own best plain copy (one driver copy
    // between two fresh allocations), measured on the first decode node's
    // device now that it is up and before any request runs. On `host` the
    // memcpy above stands.
    // Likewise `--path shm` with `--shm-direct true` on a device: the
    // shared pool is copied host → device in one step, so T8 divides by
    // that device's pinned host → device copy.
    let (mut raw_gbps, mut raw_connections, mut raw_path) = (raw_gbps, raw_connections, raw_path);
    let device_baseline = match cfg.path {
        PathChoice::Ipc => Some(RawPath::Device),
        PathChoice::Shm if cfg.shared_pool_direct => Some(RawPath::HostToDevice),
        _ => None,
    };
    if let Some(path) = device_baseline {
        let gpu = engines[cfg.prefill].gpu().clone();
        let (bytes, reps) = (raw_copy_bytes, limits::PD_RAW_COPY_REPS);
        let timed = crate::rt::run_blocking(move || match path {
            RawPath::Device => gpu.time_raw_device_copy(bytes, reps),
            _ => gpu.time_raw_host_to_device_copy(bytes, reps),
        })
        .await
        .map_err(|e| e.0)
        .and_then(|r| r.map_err(|e| e.to_string()));
        match timed {
            Ok(Some(secs)) if secs > 0.0 => {
                (raw_gbps, raw_connections, raw_path) = (Some(raw_copy_bytes as f64 / secs / 1e9), 1, path);
            }
            Ok(_) => {}
            Err(e) => {
                stop_cluster(&nodes, ms).await;
                return Err(PdError::Start(format!("raw device copy (T8 baseline): {e}")));
            }
        }
    }
    let connect_line = if cfg.connect_peers {
        Some(connect_decode_to_prefill(&engines[cfg.prefill..], &engines[..cfg.prefill]).await)
    } else {
        None
    };
    let prefill: Vec<Arc<PdNode>> = nodes[..cfg.prefill].to_vec();
    let decode: Vec<Arc<PdNode>> = nodes[cfg.prefill..].to_vec();

    let n = reqs.len();
    progress.start(n as u64);
    let kill_ms_at = cfg.kill_metaserver_at.map(|f| ((n as f64) * f) as usize);
    let restart_ms_at = kill_ms_at.map(|k| k + (n / 20).max(1));
    let kill_prefill_at = cfg.kill_prefill_at.map(|f| ((n as f64) * f) as usize);
    let prefill_alive: Arc<Vec<std::sync::atomic::AtomicBool>> =
        Arc::new((0..cfg.prefill).map(|_| std::sync::atomic::AtomicBool::new(true)).collect());

    let mut outcomes: Vec<ReqOutcome> = Vec::with_capacity(n);
    let mut assigned = vec![0u64; cfg.prefill];
    // Spawned request tasks (madsim has no `JoinSet`; a `FuturesUnordered` of
    // join handles works on both runtimes).
    let mut inflight: FuturesUnordered<tokio::task::JoinHandle<Result<ReqOutcome, PdError>>> = FuturesUnordered::new();
    let mut bytes_so_far = 0u64;
    let mut started = 0usize;
    let mut interrupted = false;
    let replay_start = Instant::now();
    for (i, req) in reqs.iter().enumerate() {
        if cfg.stop.as_ref().is_some_and(|s| *s.borrow()) {
            interrupted = true;
            break;
        }
        // Faults fire between requests, with earlier requests possibly in flight.
        if Some(i) == kill_ms_at {
            if let Some(h) = ms.take() {
                let _ = h.shutdown().await;
                let msg = format!("metaserver killed at request {i}");
                progress.fault(&msg);
                faults.push(msg);
            }
        }
        if Some(i) == restart_ms_at {
            if let Some(addr) = ms_addr {
                // Restart empty on the same port; nodes re-heartbeat and backfill (C6).
                match start_metaserver(addr, &cfg).await {
                    Ok(h) => {
                        ms = Some(h);
                        let msg = format!("metaserver restarted empty at request {i}");
                        progress.fault(&msg);
                        faults.push(msg);
                    }
                    Err(e) => faults.push(format!("metaserver restart failed at request {i}: {e}")),
                }
            }
        }
        if Some(i) == kill_prefill_at {
            // Wait for in-flight requests so the node is not mid-save.
            while let Some(r) = inflight.next().await {
                outcomes.push(r.map_err(|e| PdError::Start(e.to_string()))??);
            }
            prefill_alive[0].store(false, Ordering::SeqCst);
            if let Some(h) = prefill[0].handle.lock().expect("handle lock").take() {
                h.kill();
            }
            let msg = format!("prefill node 0 killed at request {i}");
            progress.fault(&msg);
            faults.push(msg);
        }
        while inflight.len() >= cfg.concurrency {
            if let Some(r) = inflight.next().await {
                let o = r.map_err(|e| PdError::Start(e.to_string()))??;
                bytes_so_far += o.bytes;
                progress.tick(bytes_so_far);
                outcomes.push(o);
            }
        }
        let hashes: Vec<BlockHash> = trace::engine_blocks(req, cfg.block_tokens)?.into_iter().map(|b| b.hash).collect();
        let p = pick_prefill(&prefill, &prefill_alive, &mut assigned, cfg.routing, i, &shape.ns, &hashes);
        let d = decode[i % decode.len()].clone();
        let p = prefill[p].clone();
        let shape = shape.clone();
        let flush_deadline = cfg.flush_deadline;
        let how =
            Serve { flush_deadline, lease: cfg.path == PathChoice::Ipc, prefetch: cfg.prefetch, handoff: cfg.handoff };
        inflight.push(tokio::spawn(async move { serve_request(&p, &d, &shape, hashes, how).await }));
        started = i + 1;
    }
    while let Some(r) = inflight.next().await {
        let o = r.map_err(|e| PdError::Start(e.to_string()))??;
        bytes_so_far += o.bytes;
        progress.tick(bytes_so_far);
        outcomes.push(o);
    }
    let replay_s = replay_start.elapsed().as_secs_f64();
    progress.finish();
    // Interrupted: the figures cover the requests started (all of which
    // finished), a prefix of the window, so the oracle is recomputed on it.
    let oracle = if started < n { trace::oracle_engine_blocks(&reqs[..started], cfg.block_tokens) } else { oracle };

    let mut rep = PdReport {
        requests: started as u64,
        interrupted,
        concurrency: cfg.concurrency,
        prefetch: cfg.prefetch,
        handoff: cfg.handoff,
        raw_gbps,
        raw_copy_bytes,
        raw_connections,
        raw_path: match raw_path {
            RawPath::Tcp => "tcp",
            RawPath::Shm => "shm",
            RawPath::Device => "device",
            RawPath::HostToDevice => "h2d",
            RawPath::None => "",
        }
        .to_string(),
        model: model.name.to_string(),
        transport: cfg.transport.to_string(),
        path: cfg.path.to_string(),
        block_tokens: cfg.block_tokens,
        block_bytes: model.block_bytes(cfg.block_tokens),
        pool_bytes: cfg.pool_bytes,
        oracle_hit_rate: oracle.hit_rate(),
        faults,
        ..Default::default()
    };
    let mut handoffs: Vec<f64> = Vec::with_capacity(n);
    let mut fetch_intervals: Vec<(Instant, Instant)> = Vec::new();
    for o in &outcomes {
        rep.blocks_total += o.blocks;
        rep.blocks_verified += o.verified;
        rep.blocks_fetched += o.decode_fetched;
        rep.blocks_decode_local += o.decode_local;
        rep.blocks_recomputed += o.blocks - o.decode_fetched - o.decode_local;
        rep.prefill_local_hits += o.prefill_local;
        rep.prefill_fetched += o.prefill_fetched;
        rep.bytes_transferred += o.bytes;
        rep.registrations_delivered += o.delivered;
        rep.registrations_dropped += o.dropped;
        fetch_intervals.extend_from_slice(&o.fetch_intervals);
        for (name, d) in REQUEST_STEPS.iter().zip(o.steps) {
            *rep.request_steps_s.entry((*name).to_string()).or_default() += d.as_secs_f64();
        }
        handoffs.push(o.handoff.as_secs_f64() * 1e3);
    }
    rep.prefix_hit_rate = if rep.blocks_total == 0 {
        0.0
    } else {
        (rep.prefill_local_hits + rep.prefill_fetched) as f64 / rep.blocks_total as f64
    };
    let busy = union_duration(&mut fetch_intervals);
    rep.fetch_busy_s = busy.as_secs_f64();
    rep.transport_gbps = if busy.is_zero() { 0.0 } else { rep.bytes_transferred as f64 / busy.as_secs_f64() / 1e9 };
    handoffs.sort_by(|a, b| a.total_cmp(b));
    rep.handoff_p50_ms = percentile(&handoffs, 0.50);
    rep.handoff_p99_ms = percentile(&handoffs, 0.99);
    rep.fetch_gbps_aggregate = rep.transport_gbps;
    t8_figures(&mut rep, &outcomes);
    // The tiers' queued writes land before any node's figures are taken,
    // so `written` counts every record a restart on the directories finds,
    // and the pools' eviction counts include what the drivers evicted
    // ahead meanwhile (only evicted blocks are written).
    for n in &nodes {
        if !n.engine.disk_drain(limits::PD_SSD_DRAIN_TIMEOUT).await {
            tracing::warn!(node = %n.engine.node().0, "disk tier still writing after the drain timeout");
        }
    }
    rep.checksum_failures = nodes.iter().map(|n| n.engine.metrics().checksum_failures.load(Ordering::Relaxed)).sum();
    rep.tickets_used = nodes.iter().map(|n| n.engine.metrics().fetch_tickets.load(Ordering::Relaxed)).sum();
    rep.tickets_unused = nodes.iter().map(|n| n.engine.metrics().fetch_tickets_unused.load(Ordering::Relaxed)).sum();
    let rate = |b: u64, ns: u64| if ns == 0 { 0.0 } else { b as f64 / ns as f64 };
    rep.nodes = nodes
        .iter()
        .map(|n| {
            let m = n.engine.metrics();
            let (sb, sn) = (m.save_copy_bytes.load(Ordering::Relaxed), m.save_copy_ns.load(Ordering::Relaxed));
            let (lb, ln) = (m.load_copy_bytes.load(Ordering::Relaxed), m.load_copy_ns.load(Ordering::Relaxed));
            NodeStat {
                role: n.role.name().to_string(),
                index: n.index,
                device: n.device_label.clone(),
                save_bytes: sb,
                save_gbps: rate(sb, sn),
                load_bytes: lb,
                load_gbps: rate(lb, ln),
                evicted_blocks: m.evicted.load(Ordering::Relaxed),
            }
        })
        .collect();
    rep.evicted_blocks = rep.nodes.iter().map(|n| n.evicted_blocks).sum();

    let mut sum = crate::node::PathStats::default();
    for n in &nodes {
        if let Some(p) = n.handle.lock().expect("handle lock").as_ref().and_then(|h| h.path.clone()) {
            let s = p.stats();
            for (acc, x) in [(&mut sum.shm, s.shm), (&mut sum.tcp, s.tcp)] {
                acc.reads += x.reads;
                acc.extents += x.extents;
                acc.bytes += x.bytes;
                acc.fallbacks += x.fallbacks;
                acc.attach_failures += x.attach_failures;
            }
        }
    }
    let busy_gbps = |bytes: u64| if rep.fetch_busy_s > 0.0 { bytes as f64 / rep.fetch_busy_s / 1e9 } else { 0.0 };
    // Device to device from a same-host owner's KV (C19), before the pool
    // paths it falls back to.
    let (mut ipc_blocks, mut ipc_bytes, mut ipc_fallbacks) = (0, 0, 0);
    for n in &nodes {
        let m = n.engine.metrics();
        ipc_blocks += m.device_blocks.load(Ordering::Relaxed);
        ipc_bytes += m.device_bytes.load(Ordering::Relaxed);
        ipc_fallbacks += m.device_fallbacks.load(Ordering::Relaxed);
        // One-step copies from an owner's mapped pool are the shm path's
        // too (issue 28 item 3); their fallbacks read the pool instead.
        sum.shm.extents += m.shared_direct_blocks.load(Ordering::Relaxed);
        sum.shm.bytes += m.shared_direct_bytes.load(Ordering::Relaxed);
        sum.shm.fallbacks += m.shared_direct_fallbacks.load(Ordering::Relaxed);
    }
    rep.paths = std::iter::once(PathLine {
        path: "ipc".into(),
        blocks: ipc_blocks,
        bytes: ipc_bytes,
        gbps: busy_gbps(ipc_bytes),
        fallbacks: ipc_fallbacks,
        attach_failures: 0,
    })
    .chain([("shm", sum.shm), ("tcp", sum.tcp)].into_iter().map(|(name, c)| PathLine {
        path: name.to_string(),
        blocks: c.extents,
        bytes: c.bytes,
        gbps: busy_gbps(c.bytes),
        fallbacks: c.fallbacks,
        attach_failures: c.attach_failures,
    }))
    .collect();
    rep.connect_peers = connect_line;

    let ssd_stats: Vec<crate::engine::DiskStats> = nodes.iter().filter_map(|n| n.engine.disk_stats()).collect();
    stop_cluster(&nodes, ms).await;
    rep.wall_s = wall.elapsed().as_secs_f64();
    rep.startup_s = (replay_start - wall).as_secs_f64();
    rep.replay_s = replay_s;
    if let Some(first) = ssd_stats.first() {
        let mut l = SsdLine {
            bytes_per_node: first.capacity_bytes,
            nodes: ssd_stats.len() as u64,
            backend: first.backend.clone(),
            ..Default::default()
        };
        let mut read_ns = 0u64;
        for st in &ssd_stats {
            read_ns += st.read_ns;
            let t = &st.tier;
            l.written_blocks += t.written_blocks;
            l.written_bytes += t.written_bytes;
            l.read_blocks += t.read_blocks;
            l.read_bytes += t.read_bytes;
            l.hits += t.hits;
            l.queue_reads += t.queue_reads;
            l.after_write_reads += t.after_write_reads;
            l.evicted += t.evicted;
            l.verify_failures += t.verify_failures;
            l.write_refused += st.write_refused;
            l.write_refused_no_space += t.write_refused_no_space;
            l.write_refused_queue_full += st.write_queue_full;
            l.staged_blocks += st.staged_blocks;
            l.stage_failures += st.stage_failures + st.stage_timeouts;
            l.stage_no_room += st.stage_no_room;
            l.recovered += t.recovered;
        }
        let gbps = |b: u64| if rep.replay_s > 0.0 { b as f64 / rep.replay_s / 1e9 } else { 0.0 };
        l.write_gbps = gbps(l.written_bytes);
        l.read_gbps = gbps(l.read_bytes);
        l.read_ms_mean = if l.read_blocks == 0 { 0.0 } else { read_ns as f64 / l.read_blocks as f64 / 1e6 };
        rep.ssd = Some(l);
    }
    Ok(rep)
}

/// Checks `--ssd-dir` (an existing directory) and `--ssd-size` (the tier's
/// bounds), then refuses a disk tier the file system cannot hold for every
/// node at once (each node's `node-i` subdirectory of `--ssd-dir`, less
/// what tier files from an earlier run already hold), before any node
/// allocates one: a start that failed half way would leave the first
/// nodes' files behind. A no-op without `--ssd-dir`; the space check only
/// on Linux.
///
/// # Errors
/// [`PdError::Config`] for the settings, [`PdError::Start`] for the space.
fn check_ssd_space(cfg: &PdConfig) -> Result<(), PdError> {
    if let Some(dir) = &cfg.ssd_dir {
        // DIR itself is never created: a typo must not preallocate tier
        // files on another disk (`docs` and `--help` say so).
        if !dir.exists() {
            return Err(PdError::Config(format!(
                "--ssd-dir {} does not exist (create it, on the SSD, first)",
                dir.display()
            )));
        }
        if !dir.is_dir() {
            return Err(PdError::Config(format!("--ssd-dir {} is not a directory", dir.display())));
        }
        let (min, max) = (limits::DISK_CAPACITY_BYTES_MIN, limits::DISK_CAPACITY_BYTES_MAX);
        if !(min..=max).contains(&(cfg.ssd_bytes & !(limits::DISK_ALIGN_BYTES - 1))) {
            return Err(PdError::Config(format!(
                "--ssd-size {} ({} B) is outside the disk tier's 1 MiB to 64 TiB per node ({min}..={max} B)",
                size_text(cfg.ssd_bytes),
                cfg.ssd_bytes
            )));
        }
    }
    #[cfg(target_os = "linux")]
    if let Some(dir) = &cfg.ssd_dir {
        let nodes = if cfg.ssd_roles == SsdRoles::Prefill { cfg.prefill } else { cfg.prefill + cfg.decode };
        let have = |i: usize| {
            std::fs::metadata(dir.join(format!("node-{i}")).join(crate::disk::file::TIER_FILE_NAME))
                .map_or(0, |m| m.len())
        };
        let need: u64 = (0..nodes).map(|i| cfg.ssd_bytes.saturating_sub(have(i))).fold(0, u64::saturating_add);
        let free = crate::disk::file::free_bytes_at(dir)
            .map_err(|e| PdError::Start(format!("--ssd-dir {}: {e}", dir.display())))?;
        if need > free {
            return Err(PdError::Start(format!(
                "--ssd-dir {}: {nodes} node tier(s) of --ssd-size {} need {:.2} GiB beyond what their files already hold, the file system has {:.2} GiB free (lower --ssd-size, or --ssd-roles prefill)",
                dir.display(),
                size_text(cfg.ssd_bytes),
                need as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            )));
        }
    }
    let _ = cfg;
    Ok(())
}

/// Starts node `i` of the replay (prefill nodes first) with its device KV
/// region and the replay's layout registered. A node that started and then
/// failed to allocate or register is shut down before the error returns.
async fn start_node(
    i: usize,
    cfg: &PdConfig,
    ms_url: &str,
    shape: &Shape,
    gpu_factory: &impl Fn(Role, usize) -> Result<(Arc<dyn Gpu>, String), PdError>,
) -> Result<Arc<PdNode>, PdError> {
    let mut ncfg = NodeConfig::loopback(ms_url);
    ncfg.engine = EngineConfig {
        pool_bytes: cfg.pool_bytes,
        fetch_deadline: cfg.fetch_deadline,
        fetch_reads_in_flight: cfg.fetch_reads_in_flight.max(1),
        fetch_read_part_bytes: cfg.fetch_read_part_bytes.max(1),
        shared_pool_direct: cfg.shared_pool_direct,
        lock_timeout_secs: 10,
        disk: match &cfg.ssd_dir {
            Some(_) if cfg.ssd_roles == SsdRoles::Prefill && i >= cfg.prefill => None,
            Some(dir) => {
                let sub = dir.join(format!("node-{i}"));
                std::fs::create_dir_all(&sub).map_err(|e| {
                    let why = if std::fs::symlink_metadata(&sub).is_ok() && !sub.is_dir() {
                        "it exists and is not a directory (a file or a dangling link)".to_string()
                    } else {
                        e.to_string()
                    };
                    PdError::Start(format!("--ssd-dir: cannot create node {i}'s directory {}: {why}", sub.display()))
                })?;
                Some(crate::engine::DiskConfig {
                    write_queue_max: cfg.ssd_write_queue.unwrap_or_else(|| {
                        // Records still being written cannot be evicted: a
                        // queue as large as the tier itself would leave no
                        // room (a 256 MiB tier refused thousands of writes
                        // for want of space), so it holds at most 1/8 of it.
                        let block = shape.model.block_bytes(cfg.block_tokens).max(1);
                        let bytes = limits::PD_SSD_WRITE_QUEUE_BYTES.min(cfg.ssd_bytes / 8);
                        usize::try_from(bytes / block).unwrap_or(usize::MAX).clamp(1, limits::PD_SSD_WRITE_QUEUE_MAX)
                    }),
                    ..crate::engine::DiskConfig::new(sub, cfg.ssd_bytes)
                })
            }
            None => None,
        },
        ..EngineConfig::default()
    };
    ncfg.metaserver_rpc_timeout = Duration::from_millis(1000);
    ncfg.transport = cfg.transport.clone();
    ncfg.path = cfg.path;
    let (role, index) = if i < cfg.prefill { (Role::Prefill, i) } else { (Role::Decode, i - cfg.prefill) };
    let (gpu, device_label) = gpu_factory(role, index)?;
    let disk_dir = ncfg.engine.disk.as_ref().map(|d| d.dir.clone());
    let handle = node::start(ncfg, gpu).await.map_err(|e| match (&e, &disk_dir) {
        (node::NodeError::Engine(crate::engine::EngineError::Disk(_)), Some(dir)) => {
            PdError::Start(format!("{} node {index}: --ssd-dir {}: {e}", role.name(), dir.display()))
        }
        _ => PdError::Start(format!("{} node {index}: {e}", role.name())),
    })?;
    let engine = handle.engine.clone();
    let kv = match KvCache::allocate(&engine, shape) {
        Ok(b) => b,
        Err(e) => {
            handle.shutdown(NODE_STOP_DEADLINE).await;
            return Err(e);
        }
    };
    Ok(Arc::new(PdNode {
        role,
        index,
        device_label,
        handle: std::sync::Mutex::new(Some(handle)),
        engine,
        kv,
        device: tokio::sync::Mutex::new(()),
    }))
}

/// Gracefully stops every node still running, then the embedded MetaServer.
async fn stop_cluster(nodes: &[Arc<PdNode>], ms: Option<MetaServerHandle>) {
    for node in nodes {
        let h = node.handle.lock().expect("handle lock").take();
        if let Some(h) = h {
            h.shutdown(NODE_STOP_DEADLINE).await;
        }
    }
    if let Some(h) = ms {
        let _ = h.shutdown().await;
    }
}

/// Every decode engine connects to every prefill engine before the
/// replay ([`Engine::connect_peer`], all pairs at once): handshakes, and
/// on one host the opening of each prefill pool as a one-step copy source,
/// so the first requests do not pay for them (counted in `startup_s`). A
/// pair that fails is logged and left to connect lazily on its first
/// fetch, as without this step. Returns what each pair ended in.
async fn connect_decode_to_prefill(decode: &[Engine], prefill: &[Engine]) -> ConnectLine {
    let t0 = Instant::now();
    let tries: FuturesUnordered<_> = decode
        .iter()
        .flat_map(|d| prefill.iter().map(move |p| (d, p)))
        .map(|(d, p)| async move {
            (d.node().clone(), p.node().clone(), d.connect_peer(p.node(), limits::PD_CONNECT_PEER_TIMEOUT).await)
        })
        .collect();
    let done: Vec<_> = tries.collect().await;
    let mut line = ConnectLine { pairs: done.len() as u64, ..ConnectLine::default() };
    for (d, p, res) in done {
        match res {
            Ok(state) => {
                let count = match state {
                    SharedPool::Ready => &mut line.ready,
                    SharedPool::NotMapped => &mut line.not_mapped,
                    SharedPool::Opening => &mut line.opening,
                    SharedPool::Refused => &mut line.refused,
                };
                *count += 1;
                if matches!(state, SharedPool::Opening | SharedPool::Refused) {
                    tracing::debug!(decode = %d.0, prefill = %p.0, ?state, "shared pool not opened at start-up");
                }
            }
            Err(e) => {
                line.failed += 1;
                tracing::warn!(decode = %d.0, prefill = %p.0, error = %e, "could not connect at start-up");
            }
        }
    }
    line.seconds = t0.elapsed().as_secs_f64();
    line
}

/// Which plain copy T8 divides by.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RawPath {
    /// Not measured (verbs).
    None,
    /// [`crate::transport::tcp::raw_loopback_copy`].
    Tcp,
    /// [`crate::transport::shm::raw_memcpy`].
    Shm,
    /// [`crate::gpu::Gpu::time_raw_device_copy`] (`--path ipc` on a device).
    Device,
    /// [`crate::gpu::Gpu::time_raw_host_to_device_copy`] (`--path shm`,
    /// one step, on a device).
    HostToDevice,
}

/// The raw copy of `bytes` on `path` over each of
/// [`limits::TCP_RAW_COPY_CONNECTIONS`] connections or threads, the fastest
/// of [`limits::PD_RAW_COPY_REPS`] each: the best rate (GB/s) and the count
/// that reached it.
async fn raw_copy_gbps(bytes: u64, path: RawPath) -> Result<(f64, usize), PdError> {
    let fail = |e: String| PdError::Start(format!("raw copy (T8 baseline): {e}"));
    let (counts, reps) = (limits::TCP_RAW_COPY_CONNECTIONS, limits::PD_RAW_COPY_REPS);
    let raw = crate::rt::run_blocking(move || match path {
        RawPath::Shm => crate::transport::shm::raw_memcpy(bytes, &counts, reps),
        _ => crate::transport::tcp::raw_loopback_copy(bytes, &counts, reps),
    })
    .await
    .map_err(|e| fail(e.0))?
    .map_err(|e| fail(e.to_string()))?;
    let best = raw.best().ok_or_else(|| fail("no count tried".into()))?;
    Ok((best.gbps(), best.streams))
}

/// p50, p99 and mean of `values` (ms; sorted in place).
fn phase_ms(values: &mut [f64]) -> PhaseMs {
    values.sort_by(f64::total_cmp);
    let mean = if values.is_empty() { 0.0 } else { values.iter().sum::<f64>() / values.len() as f64 };
    PhaseMs { p50: percentile(values, 0.50), p99: percentile(values, 0.99), mean }
}

/// Fills T8 and the handoff phase split from the requests whose decode
/// fetch moved at least [`limits::PD_T8_FETCH_BYTES_MIN`] bytes.
fn t8_figures(rep: &mut PdReport, outcomes: &[ReqOutcome]) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let covered: Vec<&ReqOutcome> =
        outcomes.iter().filter(|o| o.decode_fetch_bytes >= limits::PD_T8_FETCH_BYTES_MIN).collect();
    rep.t8_requests = covered.len() as u64;
    if covered.is_empty() {
        return;
    }
    if let Some(raw) = rep.raw_gbps.filter(|r| *r > 0.0) {
        let mut t8: Vec<f64> = covered
            .iter()
            .map(|o| o.handoff_total.as_secs_f64() / (o.decode_fetch_bytes as f64 / (raw * 1e9)))
            .collect();
        t8.sort_by(f64::total_cmp);
        rep.t8_p50 = Some(percentile(&t8, 0.50));
        rep.t8_p99 = Some(percentile(&t8, 0.99));
    }
    for (i, name) in HANDOFF_PHASES.iter().enumerate() {
        let mut v: Vec<f64> = covered.iter().map(|o| ms(o.phases[i])).collect();
        rep.handoff_phases_ms.insert((*name).to_string(), phase_ms(&mut v));
    }
    let mut total: Vec<f64> = covered.iter().map(|o| ms(o.handoff_total)).collect();
    rep.handoff_phases_ms.insert("total".into(), phase_ms(&mut total));
    let split: Vec<FetchPhases> = covered.iter().filter_map(|o| o.fetch_phases).collect();
    // `load_tail` is the handoff's `load` phase, not part of `fetch`.
    let names: Vec<&str> =
        FetchPhases::default().named().map(|(n, _)| n).into_iter().filter(|n| *n != "load_tail").collect();
    if split.len() == covered.len() {
        for (i, name) in names.iter().enumerate() {
            let mut v: Vec<f64> = split.iter().map(|f| ms(f.named()[i].1)).collect();
            rep.fetch_phases_ms.insert((*name).to_string(), phase_ms(&mut v));
        }
    }
}

/// The wall-clock time covered by at least one of `intervals` (their
/// union's length); sorts them in place. Concurrent fetches overlap, and
/// a rate of concurrent work is bytes over this, not over the sum.
fn union_duration(intervals: &mut [(Instant, Instant)]) -> Duration {
    intervals.sort_by_key(|&(start, _)| start);
    let mut total = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for &(start, end) in intervals.iter() {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total += e - s;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = current {
        total += e - s;
    }
    total
}

/// `bytes` for a person: in GiB from 1 GiB on, else in MiB (a small pool
/// or tier is not "0.00 GiB"), two decimals.
pub fn size_text(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Picks a prefill node. Prefix-aware routing sends a request to the live
/// node with the longest local prefix, among the nodes under a load bound
/// of 1.25 × the fair share of requests so far (bounded-load placement,
/// after Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded
/// Loads", SODA 2018); ties go round robin. Without the bound, the block
/// every request shares (the system prompt) would pull all traffic to the
/// first node that cached it.
fn pick_prefill(
    prefill: &[Arc<PdNode>],
    alive: &[std::sync::atomic::AtomicBool],
    assigned: &mut [u64],
    routing: Routing,
    i: usize,
    ns: &str,
    hashes: &[BlockHash],
) -> usize {
    let live: Vec<usize> = (0..prefill.len()).filter(|&p| alive[p].load(Ordering::SeqCst)).collect();
    let rr = live[i % live.len()];
    let pick = match routing {
        Routing::RoundRobin => rr,
        Routing::PrefixAware => {
            let total: u64 = live.iter().map(|&p| assigned[p]).sum::<u64>() + 1;
            let cap = (total as f64 * 1.25 / live.len() as f64).ceil() as u64;
            let eligible: Vec<(usize, usize)> = live
                .iter()
                .filter(|&&p| assigned[p] < cap)
                .map(|&p| (prefill[p].engine.query_prefix(ns, hashes), p))
                .collect();
            let best = eligible.iter().map(|(h, _)| *h).max().unwrap_or(0);
            let tied: Vec<usize> = eligible.iter().filter(|(h, _)| *h == best).map(|(_, p)| *p).collect();
            if tied.is_empty() { rr } else { tied[i % tied.len()] }
        }
    };
    assigned[pick] += 1;
    pick
}

/// How long a prefill's device lease lives (`--path ipc`): far longer than
/// a handoff; the next request on that prefill node waits for the decode's
/// release (or this) before it writes the leased blocks again.
const PD_DEVICE_LEASE_TTL: Duration = Duration::from_secs(10);

/// Waits until no device lease of `e` is live (its blocks may be written),
/// draining the ends; at most [`PD_DEVICE_LEASE_TTL`] and a little.
async fn wait_for_leases(e: &Engine) {
    let end = Instant::now() + PD_DEVICE_LEASE_TTL + Duration::from_millis(100);
    while {
        e.ended_device_leases();
        e.device_leases_live() > 0
    } && Instant::now() < end
    {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// How [`serve_request`] serves a request.
#[derive(Clone, Copy)]
struct Serve {
    /// Deadline of the handoff flush.
    flush_deadline: Duration,
    /// A device lease on the saved blocks (`--path ipc`).
    lease: bool,
    prefetch: Prefetch,
    handoff: Handoff,
}

/// One request: prefill (reuse, compute, save, barrier; with `lease`, a
/// device lease on the saved blocks: `--path ipc`; with
/// [`Handoff::Ticket`], a transfer lock for the decode node), then decode
/// (`fetch_into`, or `fetch_into_with_ticket`, verify, recompute the rest).
async fn serve_request(
    p: &PdNode,
    d: &PdNode,
    shape: &Shape,
    hashes: Vec<BlockHash>,
    how: Serve,
) -> Result<ReqOutcome, PdError> {
    let Serve { flush_deadline, lease, prefetch, handoff } = how;
    let n = hashes.len();
    let mut o = ReqOutcome { blocks: n as u64, ..Default::default() };
    if n == 0 {
        return Ok(o);
    }
    let pe = &p.engine;
    let gpu = pe.gpu().clone();
    // Each step's end: the next one starts there (REQUEST_STEPS).
    let mut mark = Instant::now();
    let mut step = |o: &mut ReqOutcome, i: usize| {
        let now = Instant::now();
        o.steps[i] += now - mark;
        mark = now;
    };
    // Prefill: reuse the longest cached prefix (local, else fetched), compute the rest, save.
    let handoff_start;
    let save_barrier;
    let mut leased = None;
    {
        // With `Prefetch::Fetch` the request brings its reused KV into the
        // pool before it queues for the device (REQUEST_STEPS: its
        // `prefill_lookup` and `prefill_fetch`), as an engine that loads a
        // waiting request's KV asynchronously; a block evicted again before
        // the device is free is fetched (or recomputed) on the request's path.
        let early = if prefetch == Prefetch::Fetch {
            let t = Instant::now();
            let f = pe.fetch(&shape.ns, &hashes).await;
            if f.available > f.local_hits {
                o.fetch_intervals.push((t, Instant::now()));
            }
            o.bytes += f.bytes;
            step(&mut o, 2);
            Some(f)
        } else {
            None
        };
        // With `Prefetch::Disk`, while it waits for the device, the request's
        // disk-resident prefix is staged into the pool (part of `prefill_wait`).
        let _dev = if prefetch == Prefetch::Disk && pe.disk_stats().is_some() {
            let until = Instant::now() + Duration::from_millis(limits::FETCH_DEADLINE_MS_DEFAULT);
            tokio::join!(p.device.lock(), pe.prefetch(&shape.ns, &hashes, until)).0
        } else {
            p.device.lock().await
        };
        // The blocks an earlier request leased stay untouched until the
        // lease ended (C19).
        wait_for_leases(pe).await;
        step(&mut o, 0);
        let local = pe.query_prefix(&shape.ns, &hashes);
        step(&mut o, 1);
        let fetched = if local < n {
            let t = Instant::now();
            let f = pe.fetch(&shape.ns, &hashes).await;
            o.fetch_intervals.push((t, Instant::now()));
            f
        } else {
            Default::default()
        };
        o.bytes += fetched.bytes;
        let reuse = local.max(fetched.available);
        // Peer fetches: the blocks this request's fetches brought from
        // peers; local hits the rest of the reuse (the node's own blocks,
        // staged from its disk included, and with `Prefetch::Fetch` those
        // another request saved while this one waited for the device).
        let peers = |f: &FetchReport| f.available.saturating_sub(f.local_hits);
        let from_peers = (early.as_ref().map_or(0, peers) + peers(&fetched)).min(reuse);
        o.prefill_local = (reuse - from_peers) as u64;
        o.prefill_fetched = from_peers as u64;
        step(&mut o, 2);
        let reused: Vec<(BlockHash, u64)> = hashes[..reuse].iter().cloned().zip(0u64..).collect();
        if !reused.is_empty() {
            let rep = pe.load(&shape.ns, &reused).await.map_err(|e| PdError::Device(e.to_string()))?;
            // A block evicted between the lookup and the load is recomputed.
            for (j, r) in rep.results.iter().enumerate() {
                if r.is_err() {
                    compute_block(&*gpu, shape, &p.kv, j as u64, &hashes[j])?;
                }
            }
        }
        step(&mut o, 3);
        for (j, h) in hashes.iter().enumerate().skip(reuse) {
            compute_block(&*gpu, shape, &p.kv, j as u64, h)?;
        }
        step(&mut o, 4);
        let to_save: Vec<(BlockHash, u64)> = hashes.iter().cloned().zip(0u64..).collect();
        pe.save(&shape.ns, &to_save).await.map_err(|e| PdError::Device(e.to_string()))?;
        step(&mut o, 5);
        handoff_start = Instant::now();
        let (fr, saves) = pe.flush_saves_and_registrations_timed(flush_deadline).await;
        save_barrier = saves;
        if lease {
            leased = Some(
                pe.grant_device_lease(&shape.ns, &to_save, PD_DEVICE_LEASE_TTL)
                    .map_err(|e| PdError::Device(format!("device lease: {e}")))?,
            );
        }
        o.delivered += fr.delivered;
        o.dropped += fr.dropped;
    }
    let barriers_done = Instant::now();
    // "KV ready" carries the decode's transfer lock (`--handoff ticket`).
    // One the prefill could not grant (its lock table full) leaves the
    // decode to query and lock as usual.
    let de = &d.engine;
    let ticket = if handoff == Handoff::Ticket {
        match pe.grant_transfer(&shape.ns, &hashes, &de.transfer_ask()).await {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "no transfer ticket: the decode node queries and locks");
                None
            }
        }
    } else {
        None
    };
    step(&mut o, 6);
    // The `ticket` phase is the grant's alone (0 without one).
    let granted = if handoff == Handoff::Ticket { Instant::now() } else { barriers_done };
    // Decode: query + fetch, load, verify every byte, recompute the rest.
    let dgpu = de.gpu().clone();
    let _dev = d.device.lock().await;
    step(&mut o, 7);
    let waited = Instant::now();
    let local = de.query_prefix(&shape.ns, &hashes);
    let t = Instant::now();
    // fetch_into: each fetched part is loaded while the next is read; only
    // the last part's load (`load_tail`) follows the fetch.
    let wanted: Vec<(BlockHash, u64)> = hashes.iter().cloned().zip(0u64..).collect();
    let got = match ticket {
        Some(t) => {
            let deadline = Instant::now() + de.config().fetch_deadline;
            de.fetch_into_with_ticket(&shape.ns, &wanted, t, deadline).await
        }
        None => de.fetch_into(&shape.ns, &wanted).await,
    }
    .map_err(|e| PdError::Device(e.to_string()))?;
    let load_end = Instant::now();
    step(&mut o, 8);
    // The request is done with the prefill's blocks: end the lease if the
    // fetch did not (it takes a lease only when it locks a leased block,
    // and a decode that had the prefix in its own pool locks none), as an
    // engine's "request finished" on the decode side would.
    if let Some(id) = leased {
        pe.end_device_lease(id);
    }
    let fetched = &got.fetch;
    let fetch_end = load_end - fetched.phases.load_tail.min(load_end - t);
    o.fetch_intervals.push((t, fetch_end));
    o.handoff = fetch_end - handoff_start;
    o.bytes += fetched.bytes;
    o.decode_fetch_bytes = fetched.bytes;
    o.fetch_phases = Some(fetched.phases);
    let mut loaded = vec![false; n];
    for (j, r) in got.load.results.iter().enumerate() {
        loaded[j] = r.is_ok();
    }
    o.handoff_total = load_end - handoff_start;
    let barriers = barriers_done - handoff_start;
    o.phases = [
        save_barrier.min(barriers),
        barriers.saturating_sub(save_barrier),
        granted - barriers_done,
        waited - granted,
        fetch_end - waited,
        load_end - fetch_end,
    ];
    // A block evicted between the fetch and the load counts as recomputed.
    o.decode_local = loaded[..local].iter().filter(|l| **l).count() as u64;
    o.decode_fetched = loaded[local..].iter().filter(|l| **l).count() as u64;
    for (j, h) in hashes.iter().enumerate() {
        if !loaded[j] {
            compute_block(&*dgpu, shape, &d.kv, j as u64, h)?;
        }
        if verify_block(&*dgpu, shape, &d.kv, j as u64, h)? {
            o.verified += 1;
        }
    }
    step(&mut o, 9);
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Overlapping fetch intervals count once: the union, not the sum.
    #[test]
    fn union_duration_counts_overlap_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // [0,10) and [5,20) overlap → 20; [30,40) apart → +10; [32,35) inside → +0.
        let mut v = vec![(at(30), at(40)), (at(0), at(10)), (at(32), at(35)), (at(5), at(20))];
        assert_eq!(union_duration(&mut v), Duration::from_millis(30));
        assert_eq!(union_duration(&mut []), Duration::ZERO);
        // Four fully concurrent fetches of 10 ms take 10 ms of wall clock, not 40.
        let mut same = vec![(at(0), at(10)); 4];
        assert_eq!(union_duration(&mut same), Duration::from_millis(10));
    }
}
