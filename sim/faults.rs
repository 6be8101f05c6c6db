//! The fault plan: drawn from the seed, printed before anything runs, then
//! played against the cluster during the safety phase.
//!
//! Swarm testing (Groce et al., "Swarm Testing", ISSTA 2012; TigerBeetle's
//! VOPR does the same): each fault *kind* is switched on or off per seed
//! with probability 1/2, so some seeds hammer one mechanism alone and others
//! mix several. Each enabled kind then gets a few events at random times in
//! `[FAULTS_FROM_MS, FAULTS_UNTIL_MS)`, each lasting a drawn duration; every
//! event ends before the safety phase does. Overlaps are allowed (a node
//! killed while partitioned, a MetaServer stalled then restarted): clogs are
//! reference-counted, kills of a dead process are skipped and counted as
//! such, and a MetaServer restart clears its hook faults (fresh process).
//!
//! | kind | what happens |
//! | --- | --- |
//! | `ms_restart` | MetaServer killed, restarted after the duration with an empty store |
//! | `ms_stall` | `hooks.stall`: every RPC accepted, none answered |
//! | `node_restart` | node killed (crash, no unregister), restarted through `node::start` |
//! | `partition` | one process (MetaServer or node) isolated (`NetSim::clog_node`) |
//! | `link_clog` | one link clogged both ways (`NetSim::clog_link`) |
//! | `drop_writes` | `hooks.drop_writes_ppm`: registration RPCs answered UNAVAILABLE |
//! | `read_errors` | transport: a node's next N read ops fail mid-read |
//! | `read_delay` | transport: a node's read ops are slowed |
//! | `corruption` | transport: a node serves N reads with one byte flipped |
//! | `eviction_storm` | a node evicts every unpinned block at once |
//! | `fetch_cancel` | not timed: each fetch is cancelled (its future dropped) with probability 1/4 after 1..300 ms |
//! | `slow_owner` | transport, server side: a node's data plane holds each read request for a delay before authorizing and serving it (a stalled owner mid-read, C9; a read that reaches the owner after its lock expired, C13) |
//!
//! # Issue 29's mix (its own RNG stream, outside the swarm)
//! Drawn after the swarm plan from a third RNG stream, so the swarm plan
//! and workload of every seed are what they were before it existed:
//! - `slow_owner` events (2..=4, each for 4..8 s), mostly on prefill nodes
//!   (the usual owners): a hold of 3.5..6 s (longer than the
//!   fetch deadline: the fetch must end by its deadline, C9), or in expiry
//!   seeds a hold just past the lock timeout (lock timeout + 100..700 ms:
//!   the read reaches the owner after expiry, before the GC collects it);
//! - `expiry` (p = 1/2): transfer locks of 1 s and a lock GC every
//!   1.5..3 s (a late GC), so reads after expiry and before collection are
//!   common;
//! - `buffer_churn` (p = 3/4): each node's embedder registers a fresh
//!   device buffer and a layout over it, starts a save, a load and a fetch
//!   into it, and unregisters the layout and then the buffer while they are
//!   in flight (retrying while the backend answers busy), over and over
//!   (C15).
//!
//! Swarm: each kind is on with p = 1/2 (1..=3 events each), then a density
//! drawn from a second RNG stream ([`Density`]) thins the plan (sparse:
//! each kind kept with p = 2/5, one event each), leaves it (normal) or
//! thickens it (dense: up to 3 extra events per event, 3x the reads hit by
//! read errors and corruption), so some seeds run few faults and some many.
//! The density is printed with the plan.
//!
//! Besides the faults, the seed draws four knobs: a small pool (eviction
//! pressure), the device layout (layer-first or fused), lease pressure
//! (evict-all while a lease is held, C11) and serial prefill (one prefill
//! at a time per node, which makes each flush report speak for exactly one
//! request's registrations; otherwise prefills overlap).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvferry::transport::sim;
use rand::Rng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use crate::cluster::{Cluster, NODES, PREFILL, Target};

/// Earliest fault start (ms after the safety phase starts).
pub const FAULTS_FROM_MS: u64 = 1_000;
/// Latest fault start.
pub const FAULTS_UNTIL_MS: u64 = 13_000;

/// A fault kind (the swarm unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// MetaServer kill + restart.
    MsRestart,
    /// MetaServer stall.
    MsStall,
    /// Node kill + restart.
    NodeRestart,
    /// One process isolated.
    Partition,
    /// One link clogged.
    LinkClog,
    /// Registration RPCs dropped.
    DropWrites,
    /// Transport read errors.
    ReadErrors,
    /// Slow transport reads.
    ReadDelay,
    /// Corrupted payload on the wire.
    Corruption,
    /// Evict everything unpinned.
    EvictionStorm,
    /// The workload cancels fetches (drops the future) at random points.
    FetchCancel,
    /// A node's data plane holds each read request before serving it
    /// (issue 29's mix; not in [`KINDS`], so not a swarm draw).
    SlowOwner,
}

/// Every kind, in plan order.
pub const KINDS: [Kind; 11] = [
    Kind::MsRestart,
    Kind::MsStall,
    Kind::NodeRestart,
    Kind::Partition,
    Kind::LinkClog,
    Kind::DropWrites,
    Kind::ReadErrors,
    Kind::ReadDelay,
    Kind::Corruption,
    Kind::EvictionStorm,
    Kind::FetchCancel,
];

impl Kind {
    /// Snake-case name (as printed).
    pub fn name(self) -> &'static str {
        match self {
            Kind::MsRestart => "ms_restart",
            Kind::MsStall => "ms_stall",
            Kind::NodeRestart => "node_restart",
            Kind::Partition => "partition",
            Kind::LinkClog => "link_clog",
            Kind::DropWrites => "drop_writes",
            Kind::ReadErrors => "read_errors",
            Kind::ReadDelay => "read_delay",
            Kind::Corruption => "corruption",
            Kind::EvictionStorm => "eviction_storm",
            Kind::FetchCancel => "fetch_cancel",
            Kind::SlowOwner => "slow_owner",
        }
    }
}

/// One fault event.
#[derive(Clone, Debug)]
pub enum Action {
    /// Kill the MetaServer; restart it at the end.
    MsRestart,
    /// Stall the MetaServer until the end.
    MsStall,
    /// Kill node; restart it at the end.
    NodeRestart(usize),
    /// Isolate a process until the end.
    Partition(Target),
    /// Clog a link until the end.
    LinkClog(Target, Target),
    /// Drop this fraction (ppm) of registration writes until the end.
    DropWrites(u32),
    /// Fail the node's next N read ops.
    ReadErrors(usize, u64),
    /// Delay the node's read ops by this many ms until the end.
    ReadDelay(usize, u64),
    /// The node serves its next N reads corrupted.
    Corruption(usize, u64),
    /// The node evicts everything unpinned.
    EvictionStorm(usize),
    /// The node's data plane holds each read request this many ms until
    /// the end.
    SlowOwner(usize, u64),
}

impl Action {
    fn kind(&self) -> Kind {
        match self {
            Action::MsRestart => Kind::MsRestart,
            Action::MsStall => Kind::MsStall,
            Action::NodeRestart(_) => Kind::NodeRestart,
            Action::Partition(_) => Kind::Partition,
            Action::LinkClog(..) => Kind::LinkClog,
            Action::DropWrites(_) => Kind::DropWrites,
            Action::ReadErrors(..) => Kind::ReadErrors,
            Action::ReadDelay(..) => Kind::ReadDelay,
            Action::Corruption(..) => Kind::Corruption,
            Action::EvictionStorm(_) => Kind::EvictionStorm,
            Action::SlowOwner(..) => Kind::SlowOwner,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = |i: &usize| format!("node{}", i + 1);
        match self {
            Action::MsRestart => write!(f, "ms_restart"),
            Action::MsStall => write!(f, "ms_stall"),
            Action::NodeRestart(i) => write!(f, "node_restart {}", n(i)),
            Action::Partition(t) => write!(f, "partition {t}"),
            Action::LinkClog(a, b) => write!(f, "link_clog {a}<->{b}"),
            Action::DropWrites(ppm) => write!(f, "drop_writes {ppm}ppm"),
            Action::ReadErrors(i, k) => write!(f, "read_errors {} next {k} ops", n(i)),
            Action::ReadDelay(i, ms) => write!(f, "read_delay {} {ms}ms/op", n(i)),
            Action::Corruption(i, k) => write!(f, "corruption {} next {k} served reads", n(i)),
            Action::EvictionStorm(i) => write!(f, "eviction_storm {}", n(i)),
            Action::SlowOwner(i, ms) => write!(f, "slow_owner {} {ms}ms/read", n(i)),
        }
    }
}

/// A timed event.
#[derive(Clone, Debug)]
pub struct Event {
    /// Start, ms after the safety phase starts.
    pub at_ms: u64,
    /// Duration (0 for instantaneous faults).
    pub for_ms: u64,
    /// What.
    pub action: Action,
}

/// The plan of one seed.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Enabled kinds.
    pub enabled: Vec<Kind>,
    /// Events by start time.
    pub events: Vec<Event>,
    /// Small pool (eviction pressure).
    pub small_pool: bool,
    /// Layer-first device layout (else fused).
    pub layer_first: bool,
    /// Evict-all under lease, then re-verify (C11).
    pub lease_pressure: bool,
    /// One prefill at a time per node (each flush window then holds only
    /// that request's commands, so its report speaks for them).
    pub serial_prefill: bool,
    /// The swarm density this seed drew.
    pub density: Density,
    /// Issue 29's expiry mix: short transfer locks, a late lock GC.
    pub expiry: bool,
    /// Transfer-lock timeout (s) of every engine.
    pub lock_timeout_secs: u32,
    /// Period of every engine's lock GC (ms).
    pub lock_gc_ms: u64,
    /// Issue 29's buffer churn (C15).
    pub buffer_churn: bool,
    /// Issue 32's disk tier (C17, C18), when this seed runs one.
    pub disk: Option<DiskPlan>,
}

/// Issue 32: which nodes run a simulated disk tier under their pool, its
/// shape and the faults its disk injects (drawn from its own RNG stream).
#[derive(Clone, Debug)]
pub struct DiskPlan {
    /// Per node index: runs a disk tier.
    pub nodes: Vec<bool>,
    /// Disk size per node (bytes; the tier's minimum, 1 MiB).
    pub bytes: u64,
    /// Record alignment (bytes): 4, 16 or 64 KiB, so the 1 MiB disk holds
    /// 128, 64 or 16 blocks of the workload (disk LRU eviction happens).
    pub record_align: u64,
    /// Operations in flight at the simulated disk, at most.
    pub queue_depth: usize,
    /// The write-behind queue bound (blocks).
    pub write_queue_max: usize,
    /// Deadline of local staging (ms).
    pub stage_deadline_ms: u64,
    /// Whether the driver evicts pool blocks ahead of demand
    /// (`DiskConfig::evict_ahead`): in the seeds of odd depth, so that no
    /// draw of its own changes the plans earlier seeds had.
    pub evict_ahead: bool,
    /// What the disk injects ([`SimFaults::random`]; silent corruption of
    /// reads and writes in half the disk seeds).
    pub faults: kvferry::disk::sim::SimFaults,
}

impl DiskPlan {
    /// Draws the disk plan of a seed (p = 1/2 that it has one); `events`
    /// gets 1..=2 restarts of disk nodes (crash, torn writes, recovery,
    /// re-advertise).
    fn draw(rng: &mut StdRng, events: &mut Vec<Event>) -> Option<DiskPlan> {
        if !rng.random_bool(0.5) {
            return None;
        }
        let mut nodes: Vec<bool> = (0..NODES).map(|_| rng.random_bool(0.7)).collect();
        if !nodes.iter().any(|&b| b) {
            nodes[rng.random_range(0..PREFILL)] = true;
        }
        let silent = rng.random_bool(0.5);
        let record_align = 4096 << (2 * rng.random_range(0..=2u32));
        let queue_depth = rng.random_range(1..=8);
        let plan = DiskPlan {
            bytes: kvferry::limits::DISK_CAPACITY_BYTES_MIN,
            record_align,
            queue_depth,
            evict_ahead: queue_depth % 2 == 1,
            write_queue_max: rng.random_range(1..=16),
            stage_deadline_ms: [100, 500, 2_000][rng.random_range(0..3)],
            faults: kvferry::disk::sim::SimFaults::random(rng, silent),
            nodes,
        };
        let with: Vec<usize> = (0..NODES).filter(|&i| plan.nodes[i]).collect();
        for _ in 0..rng.random_range(1..=2) {
            let node = with[rng.random_range(0..with.len())];
            let at_ms = rng.random_range(FAULTS_FROM_MS..FAULTS_UNTIL_MS);
            events.push(Event { at_ms, for_ms: rng.random_range(200..2_000), action: Action::NodeRestart(node) });
        }
        Some(plan)
    }
}

/// How many faults a seed runs (the swarm's second draw, from its own RNG
/// stream so that a `Normal` seed's plan and workload are exactly what
/// they were before densities existed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Density {
    /// Each enabled kind stays on with p = 2/5, with one event at most: few
    /// faults, so long fault-free stretches and clean flushes.
    Sparse,
    /// The base draw: each kind on with p = 1/2, 1..=3 events each.
    Normal,
    /// Each enabled kind gets 1..=3 more events (later, so overlapping
    /// more), and counted faults (read errors, corruptions) hit 3x as
    /// many reads: many faults at once.
    Dense,
}

thread_local! {
    static FORCE_DENSITY: std::cell::Cell<Option<Density>> = const { std::cell::Cell::new(None) };
}

/// Overrides the drawn density for runs on this thread (`None`: draw it).
/// The regression seeds pin [`Density::Normal`]: their plan and workload are
/// then exactly the ones they drew when they were found, before densities.
pub fn force_density(d: Option<Density>) {
    FORCE_DENSITY.with(|f| f.set(d));
}

impl Density {
    /// Draws a density: sparse 1/4, normal 1/2, dense 1/4.
    pub fn draw(rng: &mut StdRng) -> Density {
        match rng.random_range(0..4) {
            0 => Density::Sparse,
            3 => Density::Dense,
            _ => Density::Normal,
        }
    }
}

fn target(rng: &mut StdRng) -> Target {
    if rng.random_range(0..4) == 0 { Target::Ms } else { Target::Node(rng.random_range(0..NODES)) }
}

impl Plan {
    /// Draws the plan (swarm: each kind on with probability 1/2, then the
    /// density drawn from `swarm` thins or thickens it).
    pub fn draw(rng: &mut StdRng, swarm: &mut StdRng, extra: &mut StdRng, disk: &mut StdRng) -> Plan {
        let mut plan = Plan::draw_base(rng);
        let drawn = Density::draw(swarm);
        plan.density = FORCE_DENSITY.with(|f| f.get()).unwrap_or(drawn);
        plan.apply_density(swarm);
        plan.draw_extra(extra);
        plan.disk = DiskPlan::draw(disk, &mut plan.events);
        plan.events.sort_by_key(|e| e.at_ms);
        plan
    }

    /// Issue 29's mix (module doc), from its own stream.
    fn draw_extra(&mut self, extra: &mut StdRng) {
        self.expiry = extra.random_bool(0.5);
        if self.expiry {
            self.lock_timeout_secs = 1;
            self.lock_gc_ms = extra.random_range(1_500..3_000);
        }
        self.buffer_churn = extra.random_bool(0.75);
        let n = extra.random_range(2..=4);
        for _ in 0..n {
            let node =
                if extra.random_bool(0.75) { extra.random_range(0..PREFILL) } else { extra.random_range(0..NODES) };
            let at_ms = extra.random_range(FAULTS_FROM_MS..FAULTS_UNTIL_MS);
            let for_ms = extra.random_range(4_000..8_000);
            let hold = if self.expiry && extra.random_bool(0.6) {
                u64::from(self.lock_timeout_secs) * 1_000 + extra.random_range(100..700)
            } else {
                extra.random_range(3_500..6_000)
            };
            self.events.push(Event { at_ms, for_ms, action: Action::SlowOwner(node, hold) });
        }
        if n > 0 {
            self.enabled.push(Kind::SlowOwner);
        }
        self.events.sort_by_key(|e| e.at_ms);
    }

    fn apply_density(&mut self, swarm: &mut StdRng) {
        match self.density {
            Density::Normal => {}
            Density::Sparse => {
                self.enabled.retain(|_| swarm.random_bool(0.4));
                let mut seen = Vec::new();
                self.events.retain(|e| {
                    let k = e.action.kind();
                    let keep = self.enabled.contains(&k) && !seen.contains(&k);
                    if keep {
                        seen.push(k);
                    }
                    keep
                });
            }
            Density::Dense => {
                let mut more = Vec::new();
                for e in &self.events {
                    if swarm.random_bool(0.5) {
                        continue;
                    }
                    for _ in 0..swarm.random_range(1..=3) {
                        let mut x = e.clone();
                        x.at_ms = swarm.random_range(e.at_ms..FAULTS_UNTIL_MS);
                        more.push(x);
                    }
                }
                self.events.extend(more);
                for e in &mut self.events {
                    match &mut e.action {
                        Action::ReadErrors(_, k) | Action::Corruption(_, k) => *k *= 3,
                        _ => {}
                    }
                }
                self.events.sort_by_key(|e| e.at_ms);
            }
        }
    }

    fn draw_base(rng: &mut StdRng) -> Plan {
        let enabled: Vec<Kind> = KINDS.iter().copied().filter(|_| rng.random_bool(0.5)).collect();
        let mut events = Vec::new();
        for &k in enabled.iter().filter(|&&k| k != Kind::FetchCancel) {
            let count = match k {
                Kind::MsRestart => rng.random_range(1..=2),
                _ => rng.random_range(1..=3),
            };
            for _ in 0..count {
                let at_ms = rng.random_range(FAULTS_FROM_MS..FAULTS_UNTIL_MS);
                let node = rng.random_range(0..NODES);
                let (for_ms, action) = match k {
                    Kind::MsRestart => (rng.random_range(200..3_000), Action::MsRestart),
                    Kind::MsStall => (rng.random_range(500..4_000), Action::MsStall),
                    Kind::NodeRestart => (rng.random_range(200..3_000), Action::NodeRestart(node)),
                    Kind::Partition => (rng.random_range(500..5_000), Action::Partition(target(rng))),
                    Kind::LinkClog => {
                        let a = target(rng);
                        let mut b = target(rng);
                        while b == a {
                            b = target(rng);
                        }
                        (rng.random_range(500..5_000), Action::LinkClog(a, b))
                    }
                    Kind::DropWrites => {
                        let ppm = [200_000, 500_000, 1_000_000][rng.random_range(0..3)];
                        (rng.random_range(1_000..6_000), Action::DropWrites(ppm))
                    }
                    Kind::ReadErrors => (0, Action::ReadErrors(node, rng.random_range(1..=4))),
                    Kind::ReadDelay => {
                        (rng.random_range(1_000..5_000), Action::ReadDelay(node, rng.random_range(100..1_500)))
                    }
                    Kind::Corruption => (0, Action::Corruption(node, rng.random_range(1..=3))),
                    Kind::EvictionStorm => (0, Action::EvictionStorm(node)),
                    Kind::FetchCancel | Kind::SlowOwner => unreachable!("not a swarm event"),
                };
                events.push(Event { at_ms, for_ms, action });
            }
        }
        events.sort_by_key(|e| e.at_ms);
        Plan {
            enabled,
            events,
            small_pool: rng.random_bool(1.0 / 3.0),
            layer_first: rng.random_bool(0.5),
            lease_pressure: rng.random_bool(0.5),
            serial_prefill: rng.random_bool(0.5),
            density: Density::Normal,
            expiry: false,
            lock_timeout_secs: 8,
            lock_gc_ms: 500,
            buffer_churn: false,
            disk: None,
        }
    }

    /// Whether `k` is on for this seed.
    pub fn has(&self, k: Kind) -> bool {
        self.enabled.contains(&k)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on: Vec<&str> = self.enabled.iter().map(|k| k.name()).collect();
        writeln!(
            f,
            "fault kinds on: [{}] (swarm density {:?}, {} timed events)",
            on.join(", "),
            self.density,
            self.events.len()
        )?;
        if self.has(Kind::FetchCancel) {
            writeln!(f, "  fetch_cancel: each fetch cancelled with p=1/4 after 1..300 ms")?;
        }
        writeln!(
            f,
            "knobs: small_pool={} layer_first={} lease_pressure={} serial_prefill={}",
            self.small_pool, self.layer_first, self.lease_pressure, self.serial_prefill
        )?;
        writeln!(
            f,
            "issue 29 mix: expiry={} (lock timeout {} s, lock gc every {} ms) buffer_churn={}",
            self.expiry, self.lock_timeout_secs, self.lock_gc_ms, self.buffer_churn
        )?;
        match &self.disk {
            None => writeln!(f, "issue 32 disk tier: off")?,
            Some(d) => writeln!(
                f,
                "issue 32 disk tier on nodes [{}]: {} B, record align {} B, depth {}, write queue {}, stage deadline {} ms, evict ahead {}, faults {:?}",
                (0..NODES).filter(|&i| d.nodes[i]).map(|i| format!("node{}", i + 1)).collect::<Vec<_>>().join(", "),
                d.bytes,
                d.record_align,
                d.queue_depth,
                d.write_queue_max,
                d.stage_deadline_ms,
                d.evict_ahead,
                d.faults
            )?,
        }
        for e in &self.events {
            writeln!(
                f,
                "  t={:>6}ms {:>6} {}",
                e.at_ms,
                if e.for_ms > 0 { format!("+{}ms", e.for_ms) } else { String::new() },
                e.action
            )?;
        }
        Ok(())
    }
}

/// Faults applied (and skipped: target already down) per kind.
#[derive(Default)]
pub struct Tally {
    counts: Mutex<BTreeMap<&'static str, (u64, u64)>>,
}

impl Tally {
    fn add(&self, k: Kind, applied: bool) {
        let mut c = self.counts.lock().expect("tally");
        let e = c.entry(k.name()).or_default();
        if applied {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }

    /// `kind -> (applied, skipped)`.
    pub fn counts(&self) -> BTreeMap<&'static str, (u64, u64)> {
        self.counts.lock().expect("tally").clone()
    }
}

/// Starts one task per event; returns their handles (abort them to stop).
pub fn start(
    cluster: Arc<Cluster>,
    plan: &Plan,
    start: Instant,
    tally: Arc<Tally>,
) -> Vec<madsim::task::JoinHandle<()>> {
    plan.events
        .iter()
        .cloned()
        .map(|e| {
            let (cluster, tally) = (cluster.clone(), tally.clone());
            madsim::task::spawn(async move {
                tokio::time::sleep_until(start + Duration::from_millis(e.at_ms)).await;
                let applied = apply(&cluster, &e).await;
                tally.add(e.action.kind(), applied);
            })
        })
        .collect()
}

async fn apply(c: &Cluster, e: &Event) -> bool {
    let dur = Duration::from_millis(e.for_ms);
    let s = &c.shared;
    match &e.action {
        Action::MsRestart => {
            if !c.kill_metaserver() {
                return false;
            }
            tokio::time::sleep(dur).await;
            c.restart_metaserver().await;
        }
        Action::MsStall => {
            let Some(ms) = s.ms() else { return false };
            ms.hooks.stall.store(true, Ordering::SeqCst);
            tokio::time::sleep(dur).await;
            ms.hooks.stall.store(false, Ordering::SeqCst);
        }
        Action::NodeRestart(i) => {
            if !c.kill_node(*i) {
                return false;
            }
            s.disrupted(*i, None, e.for_ms);
            tokio::time::sleep(dur).await;
            c.restart_node(*i).await;
        }
        Action::Partition(t) => {
            if let Target::Node(i) = t {
                s.disrupted(*i, None, e.for_ms);
            }
            c.isolate(*t);
            tokio::time::sleep(dur).await;
            c.unisolate(*t);
        }
        Action::LinkClog(a, b) => {
            if let (Target::Node(x), Target::Node(y)) = (a, b) {
                s.disrupted(*x, Some(*y), e.for_ms);
            }
            c.clog(*a, *b);
            tokio::time::sleep(dur).await;
            c.unclog(*a, *b);
        }
        Action::DropWrites(ppm) => {
            let Some(ms) = s.ms() else { return false };
            s.drop_windows.fetch_add(1, Ordering::SeqCst);
            s.drop_active.fetch_add(1, Ordering::SeqCst);
            ms.hooks.drop_writes_ppm.store(*ppm, Ordering::SeqCst);
            tokio::time::sleep(dur).await;
            ms.hooks.drop_writes_ppm.store(0, Ordering::SeqCst);
            s.drop_active.fetch_sub(1, Ordering::SeqCst);
        }
        Action::ReadErrors(i, k) => {
            let Some(n) = s.node(*i) else { return false };
            sim::inject_read_errors(&n.transport, *k);
        }
        Action::ReadDelay(i, ms) => {
            let Some(n) = s.node(*i) else { return false };
            sim::set_read_delay(&n.transport, Duration::from_millis(*ms));
            tokio::time::sleep(dur).await;
            sim::set_read_delay(&n.transport, Duration::ZERO);
        }
        Action::Corruption(i, k) => {
            let Some(n) = s.node(*i) else { return false };
            sim::corrupt_next_reads(&n.transport, *k);
            s.corrupt_armed.fetch_add(*k, Ordering::SeqCst);
        }
        Action::EvictionStorm(i) => {
            let Some(n) = s.node(*i) else { return false };
            s.evict_all(*i, &n);
        }
        Action::SlowOwner(i, ms) => {
            let Some(n) = s.node(*i) else { return false };
            n.transport.hooks.serve_delay_ms.store(*ms, Ordering::SeqCst);
            tokio::time::sleep(dur).await;
            n.transport.hooks.serve_delay_ms.store(0, Ordering::SeqCst);
        }
    }
    true
}

/// Liveness: stop every fault and undo its effects.
pub async fn heal(c: &Cluster, injectors: Vec<madsim::task::JoinHandle<()>>) {
    for h in injectors {
        h.abort();
    }
    c.heal_network();
    let s = &c.shared;
    // Issue 32: the simulated disks inject nothing more.
    for h in &s.disk_heal {
        h.store(true, Ordering::SeqCst);
    }
    s.drop_active.store(0, Ordering::SeqCst);
    c.restart_metaserver().await;
    if let Some(ms) = s.ms() {
        ms.hooks.stall.store(false, Ordering::SeqCst);
        ms.hooks.drop_writes_ppm.store(0, Ordering::SeqCst);
    }
    for i in 0..NODES {
        c.restart_node(i).await;
        if let Some(n) = s.node(i) {
            n.transport.hooks.fail_next_reads.store(0, Ordering::SeqCst);
            n.transport.hooks.serve_delay_ms.store(0, Ordering::SeqCst);
            // Heal disarms what was armed and never sent: counted, not lost.
            let unsent = n.transport.hooks.corrupt_next_reads.swap(0, Ordering::SeqCst);
            s.corrupt_disarmed.fetch_add(unsent, Ordering::SeqCst);
            sim::set_read_delay(&n.transport, Duration::ZERO);
        }
    }
}
