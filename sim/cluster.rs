//! The simulated cluster: one MetaServer and `PREFILL + DECODE` kvferry nodes,
//! each a madsim node booted through the production entry points
//! (`metaserver::start`, `node::start`), so a kill + restart reruns real
//! start-up (new session id, empty pool, empty cache, fresh "GPU").
//!
//! # Address plan
//! | who | madsim node name | IP | ports |
//! | --- | --- | --- | --- |
//! | MetaServer | `metaserver` | 10.0.0.1 | gRPC 7000 |
//! | node i (1-based) | `node{i}` | 10.0.1.i | gRPC (P2P service) 7001, data plane (TCP transport) 7002 |
//!
//! Nodes `1..=PREFILL` are prefill nodes, the next `DECODE` are decode
//! nodes. The supervisor (madsim node 0, where the test body runs) has no IP:
//! it never talks over the network; it spawns workload tasks *on* the nodes
//! and reads their state directly.
//!
//! # Reaching into nodes
//! Each node's init closure publishes what the checker needs (engine,
//! transport, GPU) into an `Arc<Mutex<Option<NodeSlot>>>` on every (re)start;
//! the MetaServer's init closure publishes its store and hooks the same way.
//! [`Cluster::kill_node`]/[`Cluster::kill_metaserver`] empty the slot (after
//! folding the dying incarnation's counters into [`Retired`]), so nothing of
//! a dead process outlives it through the harness.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry::disk::sim::SimDisk;
use kvferry::engine::layout::{DeviceBufferId, LayerLayout, buffer_bytes_needed, contiguous};
use kvferry::engine::{DiskConfig, SimDiskSlot};
use kvferry::engine::{Engine, EngineConfig};
use kvferry::gpu::Gpu;
use kvferry::gpu::host::HostGpu;
use kvferry::metaserver::store::MetaStore;
use kvferry::metaserver::{self, MetaServerConfig, MetaServerHooks};
use kvferry::node::{self, NodeConfig};
use kvferry::transport::sim::SimTransport;
use madsim::net::NetSim;
use madsim::runtime::Handle;
use madsim::task::NodeId;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use crate::invariants::Checker;
use crate::workload;

/// Prefill nodes (indices `0..PREFILL`).
pub const PREFILL: usize = 2;
/// Decode nodes (indices `PREFILL..PREFILL + DECODE`).
pub const DECODE: usize = 2;
/// All kvferry nodes.
pub const NODES: usize = PREFILL + DECODE;
/// MetaServer gRPC port.
pub const MS_PORT: u16 = 7000;
/// Node gRPC (P2P service) port.
pub const GRPC_PORT: u16 = 7001;
/// Node data-plane port.
pub const DATA_PORT: u16 = 7002;

/// The MetaServer's IP.
pub fn ms_ip() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))
}

/// Node `index`'s IP (index is 0-based; the address plan is 1-based).
pub fn node_ip(index: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 1, (index + 1) as u8))
}

/// Timing and sizing knobs of one run (some drawn from the seed).
#[derive(Clone, Debug)]
pub struct Params {
    /// Seed of the run (also seeds the engines' and MetaServer's RNGs).
    pub seed: u64,
    /// Pool per node (bytes).
    pub pool_bytes: u64,
    /// Device layout: layer-first (true) or fused blocks (false).
    pub layer_first: bool,
    /// Engine fetch deadline.
    pub fetch_deadline: Duration,
    /// Peer RPC deadline inside a fetch.
    pub peer_rpc_timeout: Duration,
    /// Deadline of every MetaServer RPC.
    pub metaserver_rpc_timeout: Duration,
    /// Transfer-lock timeout (s).
    pub lock_timeout_secs: u32,
    /// Engine lock-GC period.
    pub lock_gc_interval: Duration,
    /// MetaServer `stale_after` (s).
    pub stale_after_secs: u64,
    /// MetaServer TTL (s).
    pub ttl_secs: u64,
    /// MetaServer sweep period (s).
    pub sweep_interval_secs: u64,
    /// Device blocks per node (request slots × blocks per request).
    pub device_blocks: u64,
    /// Issue 32: the disk tier plan (None: no node has one).
    pub disk: Option<crate::faults::DiskPlan>,
}

impl Params {
    /// Bytes of one block in the pool.
    pub fn block_bytes(&self) -> u64 {
        workload::block_bytes()
    }
}

/// What the MetaServer's init closure publishes.
#[derive(Clone)]
pub struct MsSlot {
    /// The index store (read directly by the checker).
    pub store: Arc<Mutex<MetaStore>>,
    /// Fault switches.
    pub hooks: Arc<MetaServerHooks>,
    /// The service's clock origin (its `now_ms` is `origin.elapsed()`).
    pub origin: Instant,
    /// 1 for the first start, +1 per restart.
    pub incarnation: u64,
}

impl MsSlot {
    /// The store's clock now (ms).
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }
}

/// What a node's init closure publishes.
#[derive(Clone)]
pub struct NodeSlot {
    /// The engine.
    pub engine: Engine,
    /// The data plane (with the sim fault switches).
    pub transport: Arc<SimTransport>,
    /// The host "GPU" (wrapped: see [`SimGpu`]).
    pub gpu: Arc<SimGpu>,
    /// The KV device buffer.
    pub buffer: DeviceBufferId,
    /// The registered layers (to address device segments).
    pub layers: Arc<Vec<LayerLayout>>,
    /// 1 for the first start, +1 per restart.
    pub incarnation: u64,
}

/// Counters of dead incarnations (their engines are gone, their history is
/// not).
#[derive(Debug, Default, Clone, Copy)]
pub struct Retired {
    /// Checksum failures seen by fetchers.
    pub checksum_failures: u64,
    /// Registration commands dropped (any reason) by clients.
    pub registrations_dropped: u64,
    /// Corrupted payloads their servers sent (C10).
    pub corrupt_sent: u64,
    /// Corruptions armed on a server that died before sending them.
    pub corrupt_lost: u64,
    /// Extents poisoned on free (C11).
    pub poisoned_frees: u64,
    /// Disk tier counters (issue 32).
    pub disk: DiskTotals,
}

/// Disk tier counters summed over nodes and incarnations (issue 32).
#[derive(Debug, Default, Clone, Copy)]
pub struct DiskTotals {
    /// Pool victims the tier took (write-behind).
    pub evicted_to_disk: u64,
    /// Pool blocks the driver evicted ahead of demand.
    pub evicted_ahead: u64,
    /// Records written.
    pub written: u64,
    /// Pool victims refused (queue full, no space).
    pub write_refused: u64,
    /// Of those, refused at a full write-behind queue.
    pub write_queue_full: u64,
    /// Writes failed at the disk (EIO, ENOSPC, short, misdirected).
    pub write_failed: u64,
    /// Reads failed at the disk (EIO, short, misdirected).
    pub read_failed: u64,
    /// Reads whose bytes did not verify (C17: dropped, never served).
    pub verify_failures: u64,
    /// Records evicted from the disk (LRU).
    pub evicted: u64,
    /// Blocks staged into the pool, and those for peers' lock requests.
    pub staged: u64,
    pub peer_staged: u64,
    /// Stagings that failed or missed their deadline.
    pub stage_failures: u64,
    pub stage_timeouts: u64,
    /// Records recovered at a restart and re-advertised.
    pub recovered: u64,
    /// Stale completions ignored.
    pub stale: u64,
    /// Reads served from the buffer of a write still queued, and from
    /// that of a write at the disk once it completed (their stagings are
    /// judged by `inv_disk_staged_verified` as any other's).
    pub queue_reads: u64,
    pub after_write_reads: u64,
}

impl DiskTotals {
    /// Adds one engine's disk stats.
    pub fn add(&mut self, d: &kvferry::engine::DiskStats) {
        self.evicted_to_disk += d.evicted_to_disk;
        self.evicted_ahead += d.evicted_ahead;
        self.written += d.tier.written_blocks;
        self.write_refused += d.write_refused;
        self.write_queue_full += d.write_queue_full;
        self.write_failed += d.tier.write_failed;
        self.read_failed += d.tier.read_failed;
        self.verify_failures += d.tier.verify_failures;
        self.evicted += d.tier.evicted;
        self.staged += d.staged_blocks;
        self.peer_staged += d.peer_staged_blocks;
        self.stage_failures += d.stage_failures;
        self.stage_timeouts += d.stage_timeouts;
        self.recovered += d.recovered_advertised;
        self.stale += d.tier.stale_completions;
        self.queue_reads += d.tier.queue_reads;
        self.after_write_reads += d.tier.after_write_reads;
    }
}

impl Shared {
    /// The disk tier counters over the whole run (dead incarnations
    /// included).
    pub fn disk_totals(&self) -> DiskTotals {
        let mut t = self.retired.lock().expect("retired").disk;
        for i in 0..self.nodes.len() {
            if let Some(d) = self.node(i).and_then(|n| n.engine.disk_stats()) {
                t.add(&d);
            }
        }
        t
    }

    /// `(corrupted payloads sent, corruptions lost with their server,
    /// checksum rejections, extents poisoned on free)` over the whole run,
    /// dead incarnations included.
    pub fn corruption_totals(&self) -> (u64, u64, u64, u64) {
        let r = *self.retired.lock().expect("retired");
        let (mut sent, lost, mut rejected, mut poisoned) =
            (r.corrupt_sent, r.corrupt_lost, r.checksum_failures, r.poisoned_frees);
        for i in 0..self.nodes.len() {
            if let Some(n) = self.node(i) {
                sent += n.transport.hooks.corrupt_sent.load(Ordering::SeqCst);
                rejected += n.engine.metrics().checksum_failures.load(Ordering::SeqCst);
                poisoned += n.engine.pool().poisoned_frees();
            }
        }
        (sent, lost, rejected, poisoned)
    }
}

/// State shared by the supervisor, the fault injector and workload tasks
/// running on the nodes.
pub struct Shared {
    /// Run parameters.
    pub params: Params,
    /// The MetaServer, while up.
    pub ms: Arc<Mutex<Option<MsSlot>>>,
    /// Per node, while up.
    pub nodes: Vec<Arc<Mutex<Option<NodeSlot>>>>,
    /// Drop-registration fault windows opened so far.
    pub drop_windows: AtomicU64,
    /// Drop-registration fault windows open now.
    pub drop_active: AtomicU64,
    /// Per node: forced `evict(everything)` calls so far (eviction storms,
    /// lease pressure, the cancel probe).
    pub forced_evictions: Vec<AtomicU64>,
    /// Counters of dead incarnations.
    pub retired: Mutex<Retired>,
    /// Violations and check counts.
    pub checker: Checker,
    /// Draws of the workload made while it runs (e.g. when to cancel a
    /// fetch); deterministic because the simulation is.
    pub rng: Mutex<StdRng>,
    /// Fetches cancelled by the `fetch_cancel` fault.
    pub cancelled_fetches: AtomicU64,
    /// Payload corruptions armed by the `corruption` fault (C10).
    pub corrupt_armed: AtomicU64,
    /// Armed corruptions still unsent when the liveness phase healed them.
    pub corrupt_disarmed: AtomicU64,
    /// Per node: held by a prefill when prefills are serial.
    pub prefill_serial: Vec<Arc<tokio::sync::Mutex<()>>>,
    /// Node kills, isolations and node-to-node clogs so far: `(node, other
    /// node or None for "everyone", from ms, to ms)` (C8: a release that
    /// could not get through excuses a lock that expired).
    pub disruptions: Mutex<Vec<(usize, Option<usize>, u64, u64)>>,
    /// What every node's simulated GPU saw (C15), all incarnations.
    pub gpu_watch: Arc<GpuWatch>,
    /// Embedder memory the buffer churn unregistered: kept allocated until
    /// the run ends (the embedder "freed" it; the simulated GPU reports any
    /// access to it), so a late access is reported, never undefined.
    pub graveyard: Mutex<Vec<Box<dyn kvferry::gpu::KvMemory>>>,
    /// Fetches that sealed blocks and then stopped on a transport error
    /// (issue 29, C8's error path after a partial read).
    pub partial_read_errors: AtomicU64,
    /// Fetches that ended on their deadline (stopped by `Deadline` or a
    /// transport timeout; C9).
    pub deadline_fetches: AtomicU64,
    /// `fetch_into`s that started from the decode's own, possibly stale,
    /// MetaServer answer (`fetch_into_with_owners`; C9, C10, C14 hold for
    /// them as for any fetch).
    pub known_owner_fetches: AtomicU64,
    /// Decode fetches that started from the prefill's transfer ticket
    /// (`fetch_into_with_ticket`) and took its lock.
    pub ticket_fetches: AtomicU64,
    /// The longest any fetch ran past its deadline (µs; C9's slack).
    pub fetch_overrun_max_us: AtomicU64,
    /// `Engine::connect_peer` calls that connected, that ended on their
    /// timeout, and that failed otherwise.
    pub connects_ok: AtomicU64,
    /// See `connects_ok`.
    pub connects_deadline: AtomicU64,
    /// See `connects_ok`.
    pub connects_failed: AtomicU64,
    /// Device leases (C19): per node, the ids its engines granted and the
    /// ends drained so far.
    pub leases: Mutex<LeaseBook>,
    /// Issue 32: the simulated disks' heal switches (set by the liveness
    /// phase: no disk fault from then on).
    pub disk_heal: Vec<Arc<std::sync::atomic::AtomicBool>>,
}

/// What the workload knows of device leases (C19), per node index.
#[derive(Default)]
pub struct LeaseBook {
    /// Lease ids granted, per node.
    pub granted: Vec<std::collections::BTreeSet<String>>,
    /// Lease ids reported ended, per node.
    pub ended: Vec<std::collections::BTreeSet<String>>,
    /// Grants made.
    pub grants: u64,
    /// `fetch_into` calls (the only fetches that may copy device to device).
    pub fetch_intos: u64,
}

impl Shared {
    /// Records that node `a` (and only its link to `b`, if given) was cut
    /// off from now for `for_ms`.
    pub fn disrupted(&self, a: usize, b: Option<usize>, for_ms: u64) {
        let now = crate::invariants::now_ms();
        self.disruptions.lock().expect("disruptions").push((a, b, now, now + for_ms));
    }

    /// Whether the link between nodes `x` and `y` was cut (either one
    /// killed or isolated, or their link clogged) at any time in
    /// `[from, to]` (ms).
    pub fn cut(&self, x: usize, y: usize, from: u64, to: u64) -> bool {
        self.disruptions.lock().expect("disruptions").iter().any(|&(a, b, f, t)| {
            f <= to
                && from <= t
                && match b {
                    None => a == x || a == y,
                    Some(b) => (a == x && b == y) || (a == y && b == x),
                }
        })
    }

    /// Whether node `x` was killed or isolated at any time from `from` on.
    pub fn down_since(&self, x: usize, from: u64) -> bool {
        self.disruptions.lock().expect("disruptions").iter().any(|&(a, b, _, t)| b.is_none() && a == x && t >= from)
    }
}

impl Shared {
    /// The MetaServer slot, if up.
    pub fn ms(&self) -> Option<MsSlot> {
        self.ms.lock().expect("ms slot").clone()
    }

    /// Node `i`'s slot, if up.
    pub fn node(&self, i: usize) -> Option<NodeSlot> {
        self.nodes[i].lock().expect("node slot").clone()
    }

    /// Evicts every unpinned block on node `i` (a forced eviction).
    pub fn evict_all(&self, i: usize, n: &NodeSlot) -> usize {
        self.forced_evictions[i].fetch_add(1, Ordering::SeqCst);
        n.engine.evict(u64::MAX)
    }

    /// `(windows opened, windows open)` of the drop-registration fault.
    pub fn drop_state(&self) -> (u64, u64) {
        (self.drop_windows.load(Ordering::SeqCst), self.drop_active.load(Ordering::SeqCst))
    }
}

/// The cluster as the supervisor sees it.
pub struct Cluster {
    /// Shared state.
    pub shared: Arc<Shared>,
    /// madsim id of the MetaServer node.
    pub ms_id: NodeId,
    /// madsim ids of the kvferry nodes.
    pub node_ids: Vec<NodeId>,
    /// Issue 32: each node's simulated disk (its "directory"), if it has
    /// one; kept across incarnations.
    disk_slots: Vec<Option<SimDiskSlot>>,
    up: Mutex<Up>,
    net: Mutex<Clogs>,
}

/// Which processes are up.
struct Up {
    ms: bool,
    nodes: Vec<bool>,
}

/// Reference counts of clogs, so overlapping faults heal correctly.
#[derive(Default)]
struct Clogs {
    nodes: BTreeMap<NodeId, u32>,
    links: BTreeMap<(NodeId, NodeId), u32>,
}

/// A network endpoint of the address plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The MetaServer.
    Ms,
    /// Node index.
    Node(usize),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Ms => f.write_str("metaserver"),
            Target::Node(i) => write!(f, "node{}", i + 1),
        }
    }
}

impl Cluster {
    /// Boots the MetaServer and every node, then waits until each node has
    /// published its slot.
    pub async fn boot(params: Params, checker: Checker) -> Cluster {
        let handle = Handle::current();
        let ms_slot: Arc<Mutex<Option<MsSlot>>> = Arc::new(Mutex::new(None));
        let ms_incarnation = Arc::new(AtomicU64::new(0));
        let ms_id = {
            let (slot, inc, p) = (ms_slot.clone(), ms_incarnation.clone(), params.clone());
            handle
                .create_node()
                .name("metaserver")
                .ip(ms_ip())
                .init(move || {
                    let (slot, inc, p) = (slot.clone(), inc.clone(), p.clone());
                    async move {
                        let incarnation = inc.fetch_add(1, Ordering::SeqCst) + 1;
                        let mut cfg = MetaServerConfig::new(SocketAddr::new(ms_ip(), MS_PORT));
                        cfg.stale_after_secs = p.stale_after_secs;
                        cfg.ttl_secs = p.ttl_secs;
                        cfg.sweep_interval_secs = p.sweep_interval_secs;
                        cfg.seed = p.seed ^ (incarnation << 48);
                        let origin = Instant::now();
                        let h = metaserver::start(cfg).await.expect("metaserver start");
                        *slot.lock().expect("ms slot") =
                            Some(MsSlot { store: h.store_for_testing(), hooks: h.hooks.clone(), origin, incarnation });
                        std::future::pending::<()>().await;
                        drop(h);
                    }
                })
                .build()
                .id()
        };
        let mut nodes = Vec::with_capacity(NODES);
        let mut node_ids = Vec::with_capacity(NODES);
        let gpu_watch = Arc::new(GpuWatch::default());
        let mut disk_heal = Vec::new();
        let mut disk_slots = Vec::new();
        for i in 0..NODES {
            let slot: Arc<Mutex<Option<NodeSlot>>> = Arc::new(Mutex::new(None));
            let incarnations = Arc::new(AtomicU64::new(0));
            // Issue 32: the node's simulated disk, kept across its
            // incarnations (its "directory").
            let disk = params.disk.as_ref().filter(|d| d.nodes[i]).map(|d| {
                let mut sd = SimDisk::new(d.bytes, d.queue_depth, params.seed ^ ((i as u64 + 1) << 32) ^ 0xD15C);
                sd.set_faults(d.faults.clone());
                disk_heal.push(sd.heal_switch());
                SimDiskSlot::new(sd)
            });
            disk_slots.push(disk.clone());
            let (s, inc, p, w) = (slot.clone(), incarnations, params.clone(), gpu_watch.clone());
            let id = handle
                .create_node()
                .name(format!("node{}", i + 1))
                .ip(node_ip(i))
                .init(move || {
                    let (slot, inc, p, w, disk) = (s.clone(), inc.clone(), p.clone(), w.clone(), disk.clone());
                    async move {
                        let incarnation = inc.fetch_add(1, Ordering::SeqCst) + 1;
                        let published = boot_node(i, incarnation, &p, w, disk).await;
                        let keep = published.1;
                        *slot.lock().expect("node slot") = Some(published.0);
                        std::future::pending::<()>().await;
                        drop(keep);
                    }
                })
                .build()
                .id();
            nodes.push(slot);
            node_ids.push(id);
        }
        let rng = Mutex::new(StdRng::seed_from_u64(params.seed ^ 0x5EED_CA4C));
        let shared = Arc::new(Shared {
            params,
            ms: ms_slot,
            nodes,
            drop_windows: AtomicU64::new(0),
            drop_active: AtomicU64::new(0),
            forced_evictions: (0..NODES).map(|_| AtomicU64::new(0)).collect(),
            retired: Mutex::new(Retired::default()),
            rng,
            cancelled_fetches: AtomicU64::new(0),
            corrupt_armed: AtomicU64::new(0),
            corrupt_disarmed: AtomicU64::new(0),
            prefill_serial: (0..NODES).map(|_| Arc::new(tokio::sync::Mutex::new(()))).collect(),
            disruptions: Mutex::new(Vec::new()),
            gpu_watch,
            graveyard: Mutex::new(Vec::new()),
            partial_read_errors: AtomicU64::new(0),
            deadline_fetches: AtomicU64::new(0),
            known_owner_fetches: AtomicU64::new(0),
            ticket_fetches: AtomicU64::new(0),
            fetch_overrun_max_us: AtomicU64::new(0),
            connects_ok: AtomicU64::new(0),
            connects_deadline: AtomicU64::new(0),
            connects_failed: AtomicU64::new(0),
            disk_heal,
            leases: Mutex::new(LeaseBook {
                granted: vec![Default::default(); NODES],
                ended: vec![Default::default(); NODES],
                ..LeaseBook::default()
            }),
            checker,
        });
        let c = Cluster {
            shared,
            ms_id,
            node_ids,
            disk_slots,
            up: Mutex::new(Up { ms: true, nodes: vec![true; NODES] }),
            net: Mutex::new(Clogs::default()),
        };
        c.wait_published().await;
        c
    }

    /// Waits (bounded) until every up node and the MetaServer published
    /// their slots.
    pub async fn wait_published(&self) {
        for _ in 0..200 {
            let ok = {
                let up = self.up.lock().expect("up");
                (!up.ms || self.shared.ms().is_some())
                    && (0..NODES).all(|i| !up.nodes[i] || self.shared.node(i).is_some())
            };
            if ok {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("cluster did not finish start-up within 2 s of simulated time");
    }

    /// Whether node `i` is up (not killed).
    pub fn node_up(&self, i: usize) -> bool {
        self.up.lock().expect("up").nodes[i]
    }

    /// Kills node `i` (no graceful shutdown: a crash). Returns false when it
    /// was already down.
    pub fn kill_node(&self, i: usize) -> bool {
        {
            let mut up = self.up.lock().expect("up");
            if !up.nodes[i] {
                return false;
            }
            up.nodes[i] = false;
        }
        Handle::current().kill(self.node_ids[i]);
        // Issue 32: the process died with its disk writes in flight: they
        // are torn, and whatever is left of the dead incarnation can no
        // longer touch the disk.
        if let (Some(slot), Some(plan)) = (&self.disk_slots[i], &self.shared.params.disk) {
            slot.crash(plan.faults.clone());
        }
        if let Some(slot) = self.shared.nodes[i].lock().expect("node slot").take() {
            let m = slot.engine.metrics();
            let mut r = self.shared.retired.lock().expect("retired");
            r.checksum_failures += m.checksum_failures.load(Ordering::SeqCst);
            r.registrations_dropped += workload::registrations_dropped(&slot);
            r.corrupt_sent += slot.transport.hooks.corrupt_sent.load(Ordering::SeqCst);
            r.corrupt_lost += slot.transport.hooks.corrupt_next_reads.load(Ordering::SeqCst);
            r.poisoned_frees += slot.engine.pool().poisoned_frees();
            if let Some(d) = slot.engine.disk_stats() {
                r.disk.add(&d);
            }
        }
        true
    }

    /// Restarts node `i` (reruns its init: `node::start`). Returns false
    /// when it was up.
    pub async fn restart_node(&self, i: usize) -> bool {
        {
            let mut up = self.up.lock().expect("up");
            if up.nodes[i] {
                return false;
            }
            up.nodes[i] = true;
        }
        Handle::current().restart(self.node_ids[i]);
        self.wait_published().await;
        true
    }

    /// Kills the MetaServer (its state is lost). Returns false when down.
    pub fn kill_metaserver(&self) -> bool {
        {
            let mut up = self.up.lock().expect("up");
            if !up.ms {
                return false;
            }
            up.ms = false;
        }
        Handle::current().kill(self.ms_id);
        self.shared.ms.lock().expect("ms slot").take();
        true
    }

    /// Restarts the MetaServer with an empty store. Returns false when up.
    pub async fn restart_metaserver(&self) -> bool {
        {
            let mut up = self.up.lock().expect("up");
            if up.ms {
                return false;
            }
            up.ms = true;
        }
        Handle::current().restart(self.ms_id);
        self.wait_published().await;
        true
    }

    fn id(&self, t: Target) -> NodeId {
        match t {
            Target::Ms => self.ms_id,
            Target::Node(i) => self.node_ids[i],
        }
    }

    /// Isolates `t` from everyone (both directions) until a matching
    /// [`Cluster::unisolate`].
    pub fn isolate(&self, t: Target) {
        let id = self.id(t);
        let mut c = self.net.lock().expect("clogs");
        let n = c.nodes.entry(id).or_default();
        *n += 1;
        if *n == 1 {
            NetSim::current().clog_node(id);
        }
    }

    /// Undoes one [`Cluster::isolate`].
    pub fn unisolate(&self, t: Target) {
        let id = self.id(t);
        let mut c = self.net.lock().expect("clogs");
        if let Some(n) = c.nodes.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                c.nodes.remove(&id);
                NetSim::current().unclog_node(id);
            }
        }
    }

    /// Clogs the link between `a` and `b`, both directions.
    pub fn clog(&self, a: Target, b: Target) {
        let (a, b) = (self.id(a), self.id(b));
        let mut c = self.net.lock().expect("clogs");
        for (s, d) in [(a, b), (b, a)] {
            let n = c.links.entry((s, d)).or_default();
            *n += 1;
            if *n == 1 {
                NetSim::current().clog_link(s, d);
            }
        }
    }

    /// Undoes one [`Cluster::clog`].
    pub fn unclog(&self, a: Target, b: Target) {
        let (a, b) = (self.id(a), self.id(b));
        let mut c = self.net.lock().expect("clogs");
        for (s, d) in [(a, b), (b, a)] {
            if let Some(n) = c.links.get_mut(&(s, d)) {
                *n -= 1;
                if *n == 0 {
                    c.links.remove(&(s, d));
                    NetSim::current().unclog_link(s, d);
                }
            }
        }
    }

    /// Removes every clog (liveness).
    pub fn heal_network(&self) {
        let mut c = self.net.lock().expect("clogs");
        let net = NetSim::current();
        for (id, _) in std::mem::take(&mut c.nodes) {
            net.unclog_node(id);
        }
        for ((s, d), _) in std::mem::take(&mut c.links) {
            net.unclog_link(s, d);
        }
    }

    /// Spawns `fut` as a task on node `i` (it dies with the node).
    pub fn spawn_on<F>(&self, i: usize, fut: F) -> madsim::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        Handle::current().get_node(self.node_ids[i]).expect("node exists").spawn(fut)
    }
}

/// Starts one node through `node::start` and registers the sim namespace.
/// Returns the published slot and the handle to keep alive.
async fn boot_node(
    i: usize,
    incarnation: u64,
    p: &Params,
    watch: Arc<GpuWatch>,
    disk: Option<SimDiskSlot>,
) -> (NodeSlot, node::NodeHandle) {
    // Half the nodes (alternating with the seed) seal with slot checksums
    // taken the way the CUDA backend takes them (device pieces folded per
    // slot), so C10 is checked over both seal paths; no RNG draw is spent.
    let gpu = Arc::new(SimGpu::new(
        if (p.seed.wrapping_add(i as u64)) % 2 == 1 { HostGpu::with_device_checksums() } else { HostGpu::new() },
        i,
        watch,
    ));
    let (layers_n, seg) = (workload::preset().layers, workload::segment_bytes());
    // The buffer id does not change the size; the first buffer is id 0.
    let bytes =
        buffer_bytes_needed(&contiguous(DeviceBufferId(0), layers_n, p.device_blocks, seg, true, p.layer_first));
    let buffer = gpu.host().alloc(bytes).expect("device buffer");
    let layers = contiguous(buffer, layers_n, p.device_blocks, seg, true, p.layer_first);
    let mut cfg = NodeConfig::loopback(format!("{}:{MS_PORT}", ms_ip()));
    cfg.grpc_addr = SocketAddr::new(node_ip(i), GRPC_PORT);
    cfg.data_addr = SocketAddr::new(node_ip(i), DATA_PORT);
    cfg.advertise_host = node_ip(i).to_string();
    cfg.metaserver_rpc_timeout = p.metaserver_rpc_timeout;
    cfg.tcp_connections_per_peer = 2;
    cfg.engine = EngineConfig {
        pool_bytes: p.pool_bytes,
        // Production's start-up path (the pools here are small).
        pool_prefault: true,
        pool_align: 256,
        // Production's default; the simulator has no memfd, so the pool is
        // private and the path choice (Auto) reads over TCP: the shared
        // pool is not simulated (its failures end in the same TCP fallback).
        pool_shared: true,
        lock_timeout_secs: p.lock_timeout_secs,
        lock_gc_interval: p.lock_gc_interval,
        fetch_deadline: p.fetch_deadline,
        peer_rpc_timeout: p.peer_rpc_timeout,
        // Fetches of more than 4 blocks read in parts (each checksummed
        // while the next is read), so faults also land mid multi-part fetch.
        fetch_read_part_bytes: 4 * p.block_bytes(),
        // One to three parts in flight (from the seed and the node, no RNG
        // draw spent), and checksum tasks of two blocks: the simulator
        // takes production's pipelined, spread-over-tasks verify path.
        fetch_reads_in_flight: 1 + ((p.seed / 2).wrapping_add(i as u64) % 3) as usize,
        fetch_verify_task_bytes_min: 2 * p.block_bytes(),
        seed: Some(p.seed ^ ((i as u64 + 1) << 40) ^ (incarnation << 56)),
        // Production's default: `fetch_into` copies device to device where
        // an owner granted a device lease (C19; the host backend's
        // in-process kind, every simulated node being in this process).
        device_direct: true,
        // The simulator maps no shared pools: nothing to copy from.
        shared_pool_direct: true,
        // Issue 32: production's disk tier over the node's simulated disk.
        disk: disk.zip(p.disk.as_ref()).map(|(slot, d)| DiskConfig {
            queue_depth: d.queue_depth,
            write_queue_max: d.write_queue_max,
            record_align: d.record_align,
            stage_deadline: Duration::from_millis(d.stage_deadline_ms),
            evict_ahead: d.evict_ahead,
            ..DiskConfig::simulated(slot, d.bytes)
        }),
    };
    let h = node::start(cfg, gpu.clone() as Arc<dyn Gpu>).await.expect("node start");
    // C11: freed pool memory is poisoned, so a read of freed (or freed and
    // reused) memory yields the poison pattern, never a block's old bytes.
    h.engine.pool().set_poison_freed(true);
    h.engine.register_layout(workload::NAMESPACE, layers.clone()).expect("sim layout");
    let slot = NodeSlot {
        engine: h.engine.clone(),
        transport: h.tcp.clone().expect("simulated nodes run the TCP transport"),
        gpu,
        buffer,
        layers: Arc::new(layers),
        incarnation,
    };
    (slot, h)
}

/// What the simulated GPUs saw (C15), over every node and incarnation.
#[derive(Default)]
pub struct GpuWatch {
    /// Accesses to a buffer after its unregister answered `Ok` (each a
    /// violation of C15), with what was seen.
    pub violations: Mutex<Vec<String>>,
    /// Unregisters answered `Ok`.
    pub unregisters_ok: AtomicU64,
    /// Unregisters refused because copies were in flight on the buffer.
    pub busy_refusals: AtomicU64,
    /// Copy batches held in flight (asynchronous copies).
    pub held_batches: AtomicU64,
}

/// The simulator's GPU: the production `host` backend, plus what a real
/// device has and the host backend does not, so C15 is observable.
///
/// - **Asynchronous copies** on buffers marked with [`SimGpu::hold_copies`]
///   (the buffer churn's): `submit` pins the batch's buffers at once (as a
///   DMA engine would, through the backend's own table:
///   [`kvferry::gpu::BufferTable::pin_batch`]) and runs the copy 1..3 ms
///   later, so a batch is in flight while the embedder tries to unregister.
/// - **Loud use after unregister**: the embedder may free a buffer's memory
///   once its unregister answered `Ok`; from then on any copy batch, read or
///   write that would touch the buffer, and any `Ok` unregister while held
///   copies are still in flight on it, is recorded in [`GpuWatch`] (checked
///   by `inv_no_access_after_unregister`). The memory itself stays
///   allocated in the harness's graveyard, so nothing undefined happens.
pub struct SimGpu(Arc<SimGpuInner>);

struct SimGpuInner {
    host: HostGpu,
    node: usize,
    watch: Arc<GpuWatch>,
    /// Buffers whose copies are asynchronous.
    held: Mutex<std::collections::BTreeSet<u32>>,
    /// Per buffer: held batches in flight.
    in_flight: Mutex<BTreeMap<u32, u32>>,
    /// Buffers whose unregister answered `Ok`.
    gone: Mutex<std::collections::BTreeSet<u32>>,
    batches: AtomicU64,
}

impl SimGpu {
    /// Wraps `host` for node `node`.
    pub fn new(host: HostGpu, node: usize, watch: Arc<GpuWatch>) -> Self {
        SimGpu(Arc::new(SimGpuInner {
            host,
            node,
            watch,
            held: Mutex::new(Default::default()),
            in_flight: Mutex::new(BTreeMap::new()),
            gone: Mutex::new(Default::default()),
            batches: AtomicU64::new(0),
        }))
    }

    /// The production backend inside.
    pub fn host(&self) -> &HostGpu {
        &self.0.host
    }

    /// Makes `id`'s copies asynchronous (see the type doc).
    pub fn hold_copies(&self, id: DeviceBufferId) {
        self.0.held.lock().expect("held").insert(id.0);
    }
}

impl SimGpuInner {
    /// Reports an access by `what` to any of `ids` whose unregister
    /// answered `Ok` while the backend would still reach its memory.
    fn check_access(&self, ids: &[u32], what: &str) {
        let gone = self.gone.lock().expect("gone");
        for &id in ids {
            if gone.contains(&id) && self.host.buffer_len(DeviceBufferId(id)).is_some() {
                self.watch.violations.lock().expect("violations").push(format!(
                    "node{}: {what} reaches buffer {id}, whose unregister answered Ok (the embedder freed it)",
                    self.node + 1
                ));
            }
        }
    }
}

/// A held batch's pin and in-flight count (see [`SimGpu::submit`]).
struct Held {
    inner: Arc<SimGpuInner>,
    ids: Vec<u32>,
    pin: Option<kvferry::gpu::BatchPin>,
}

impl Drop for Held {
    fn drop(&mut self) {
        drop(self.pin.take());
        let mut f = self.inner.in_flight.lock().expect("in flight");
        for &i in &self.ids {
            if let Some(n) = f.get_mut(&i) {
                *n -= 1;
            }
        }
    }
}

impl Gpu for SimGpu {
    fn name(&self) -> &'static str {
        self.0.host.name()
    }

    unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, kvferry::gpu::GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.0.host.register_external(addr, len) }
    }

    fn unregister(&self, id: DeviceBufferId) -> Result<(), kvferry::gpu::GpuError> {
        let r = self.0.host.unregister(id);
        let w = &self.0.watch;
        match &r {
            Ok(()) => {
                w.unregisters_ok.fetch_add(1, Ordering::SeqCst);
                self.0.gone.lock().expect("gone").insert(id.0);
                let n = self.0.in_flight.lock().expect("in flight").get(&id.0).copied().unwrap_or(0);
                if n > 0 {
                    w.violations.lock().expect("violations").push(format!(
                        "node{}: unregister of buffer {} answered Ok while {n} copy batch(es) in flight touch it",
                        self.0.node + 1,
                        id.0
                    ));
                }
            }
            Err(kvferry::gpu::GpuError::Buffer(kvferry::gpu::BufferError::Busy { .. })) => {
                w.busy_refusals.fetch_add(1, Ordering::SeqCst);
            }
            Err(_) => {}
        }
        r
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.0.host.buffer_len(id)
    }

    fn alloc_kv_memory(&self, bytes: u64) -> Result<Box<dyn kvferry::gpu::KvMemory>, kvferry::gpu::GpuError> {
        self.0.host.alloc_kv_memory(bytes)
    }

    fn register_host(&self, base: *mut u8, len: u64) -> Result<(), kvferry::gpu::GpuError> {
        self.0.host.register_host(base, len)
    }

    // Device-direct copies between simulated nodes (C19): the host
    // backend's in-process kind (every simulated node lives in this
    // process); the owner's buffers stay pinned in its own table for the
    // copy.
    fn peer_kind(&self) -> Option<kvferry::gpu::peer::PeerKind> {
        self.0.host.peer_kind()
    }

    fn export_buffer(
        &self,
        id: DeviceBufferId,
        kind: kvferry::gpu::peer::PeerKind,
    ) -> Result<kvferry::gpu::peer::BufferExport, kvferry::gpu::GpuError> {
        self.0.host.export_buffer(id, kind)
    }

    fn open_peer_buffer(
        &self,
        export: &kvferry::gpu::peer::BufferExport,
    ) -> Result<Arc<dyn kvferry::gpu::peer::PeerBuffer>, kvferry::gpu::GpuError> {
        self.0.host.open_peer_buffer(export)
    }

    fn submit_peer(&self, batch: kvferry::gpu::peer::PeerCopyBatch) -> kvferry::gpu::peer::PeerCompletion {
        let mut ids: Vec<u32> = batch.ops.iter().map(|o| o.dst.0).collect();
        ids.sort_unstable();
        ids.dedup();
        self.0.check_access(&ids, "a peer copy batch");
        self.0.host.submit_peer(batch)
    }

    fn submit(&self, batch: kvferry::gpu::CopyBatch) -> kvferry::gpu::Completion {
        let mut ids: Vec<u32> = batch.ops.iter().map(|o| o.buffer.0).collect();
        ids.sort_unstable();
        ids.dedup();
        self.0.check_access(&ids, "a submitted copy batch");
        let held = {
            let h = self.0.held.lock().expect("held");
            ids.iter().any(|i| h.contains(i))
        };
        if !held {
            return self.0.host.submit(batch);
        }
        // Asynchronous: pinned now (the backend's own table), copied later.
        let pin = self.0.host.buffers().pin_batch(ids.iter().map(|&i| DeviceBufferId(i)));
        {
            let mut f = self.0.in_flight.lock().expect("in flight");
            for &i in &ids {
                *f.entry(i).or_default() += 1;
            }
        }
        self.0.watch.held_batches.fetch_add(1, Ordering::SeqCst);
        let hold = Duration::from_millis(1 + self.0.batches.fetch_add(1, Ordering::SeqCst) % 3);
        // Unpinned and uncounted when the copy ran, or when its completion
        // is dropped (a killed node's tasks).
        let held = Held { inner: self.0.clone(), ids, pin: Some(pin) };
        Box::pin(async move {
            tokio::time::sleep(hold).await;
            held.inner.check_access(&held.ids, "a copy batch in flight");
            held.inner.host.submit(batch).await
        })
    }

    fn checksums_on_device(&self) -> bool {
        self.0.host.checksums_on_device()
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), kvferry::gpu::GpuError> {
        self.0.check_access(&[id.0], "a device write");
        self.0.host.write(id, offset, data)
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), kvferry::gpu::GpuError> {
        self.0.check_access(&[id.0], "a device read");
        self.0.host.read(id, offset, out)
    }
}
