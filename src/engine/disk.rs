//! The engine's disk tier (issue 32): the node's [`Tier`] below the pinned
//! pool, and the task that drives it.
//!
//! # What goes where
//!
//! - Pool eviction hands each victim to the tier's write-behind queue
//!   ([`DiskTier::write`]; the copy into the aligned record buffer, checked
//!   against the seal checksums, happens inside it, so the pool extent is
//!   free once it returns: C11 holds as for a plain eviction). An accepted
//!   write keeps the block advertised at the MetaServer; a refused one
//!   (queue full, no space, bad input) is counted and the engine registers
//!   the removal as it does without a tier (C4).
//! - A record that leaves the tier (disk LRU eviction, a failed write, a
//!   read that did not verify: [`TierEvent::Removed`]) has its removal
//!   registered by the driver, unless the block is resident in the pool
//!   again.
//! - Staging ([`DiskTier::read`]): a lookup, `load`, a fetch's local part or
//!   a peer's lock request that names a block on disk and not in the pool
//!   reads it (verified: identity and every slot CRC, C17), copies it into a
//!   fresh pool extent and seals it into the cache with the record's slot
//!   checksums. A read that fails or misses its deadline leaves the block
//!   absent; the caller degrades (C9).
//! - Recovery: [`Tier::open`] keeps only records that verify (C18); the
//!   engine re-advertises them at start and includes every written record
//!   in its backfill (C6).
//!
//! - Evicting ahead: with a tier, a pool victim costs a copy into a record
//!   buffer, so the driver keeps free room in the pool — once an
//!   allocation leaves less than [`DISK_EVICT_AHEAD_LOW_PER_1024`] of it
//!   free, the driver evicts LRU blocks one at a time (to the write-behind
//!   queue, as any eviction) until [`DISK_EVICT_AHEAD_HIGH_PER_1024`] is
//!   free, and a `save` rarely evicts on its own path. It evicts only while
//!   the queue has room (resuming as writes complete), so evicting ahead never drops a block the queue
//!   would refuse: such a block stays in the pool until it is needed.
//!
//! # The driver
//!
//! [`Tier`] is synchronous and never blocks unless asked to; the driver is
//! one loop per engine, on a thread of its own
//! ([`crate::rt::spawn_on_own_thread`]; a task under the simulator), that
//! polls it without waiting, hands out read results, registers removals
//! and evicts ahead. (As a task of the engine's runtime it waited for a
//! worker whenever requests kept them busy copying and checksumming, and
//! the write-behind queues filled with the disk far from busy.) It polls
//! again as soon as it is woken —
//! by a read or write queued, or by the backend's completion hint
//! ([`DiskIo::set_completion_hint`]: the io_uring backend's eventfd, the
//! thread backend's workers) — and otherwise every
//! [`DISK_POLL_INTERVAL_US`] while operations are in flight
//! ([`DISK_IDLE_POLL_MS`] when none are). Without the hint (the simulated
//! disk, or a kernel that refuses the eventfd) completions wait for that
//! timed poll, which bounded each node's disk to about a queue depth of
//! operations per timer tick (1 ms). Only runtime time and tasks are used
//! in the driver, so the same code runs on tokio and under the simulator.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::EngineInner;
use super::layout::LayoutFamily;
use crate::disk::io::{BackendKind, Completion, Errno, IoOp, Refused};
use crate::disk::sim::SimDisk;
use crate::disk::tier::{IoFailure, ReadBlock, ReadRefused, TierError, WriteOutcome, WriteRefused};
use crate::disk::{BlockKey, DiskIo, SlotSum, Tier, TierConfig, TierCounters, TierEvent};
use crate::limits::{
    DISK_EVICT_AHEAD_HIGH_PER_1024, DISK_EVICT_AHEAD_LOW_PER_1024, DISK_EVICT_AHEAD_YIELD_BLOCKS, DISK_IDLE_POLL_MS,
    DISK_POLL_INTERVAL_US, DISK_QUEUE_DEPTH_DEFAULT, DISK_READ_SLOTS, DISK_RECORD_ALIGN_DEFAULT,
    DISK_STAGE_DEADLINE_MS_DEFAULT, DISK_WRITE_QUEUE_DEFAULT, RECOVERED_READVERTISE_POLL_MS,
};
use crate::types::BlockHash;

/// `tracing` target of the event emitted for every block staged from the
/// disk tier into the pool (`node`, `namespace`, `hash` in hex,
/// `generation`, and `payload_crc`: the CRC-32C of the bytes copied into
/// the pool extent), at TRACE level, just before the block is sealed into
/// the cache. The CRC is computed only while the target is enabled (the
/// simulator's C17 check compares it with the bytes that were saved).
pub const DISK_STAGED_TRACE_TARGET: &str = "kvferry::disk_staged";

/// A simulated disk handed to an engine instead of a file (its
/// "directory"): the engine opens it at start and uses it in place; a
/// test or the simulator crashes it ([`SimDiskSlot::crash`]) when the
/// node's process "dies" — the writes in flight are torn, the dead
/// incarnation's handle is fenced off (it can do nothing more, whether or
/// not its engine was dropped) — and starts a node on it again.
#[derive(Clone, Default)]
pub struct SimDiskSlot(Arc<Mutex<SlotState>>);

#[derive(Default)]
struct SlotState {
    disk: Option<SimDisk>,
    /// Bumped by every crash: a handle of an older epoch is fenced.
    epoch: u64,
    /// An engine of the current epoch holds the disk.
    held: bool,
}

impl SimDiskSlot {
    /// A slot holding `disk`.
    pub fn new(disk: SimDisk) -> Self {
        Self(Arc::new(Mutex::new(SlotState { disk: Some(disk), epoch: 0, held: false })))
    }

    /// Takes the disk out (None while an engine of this epoch holds it).
    pub fn take(&self) -> Option<SimDisk> {
        let mut st = self.0.lock().expect("sim disk slot");
        if st.held { None } else { st.disk.take() }
    }

    /// Puts a disk in (replacing any there).
    pub fn put(&self, disk: SimDisk) {
        self.0.lock().expect("sim disk slot").disk = Some(disk);
    }

    /// The process using the disk died: its writes in flight are torn and
    /// its completions lost ([`SimDisk::crash`]), and its handle is fenced
    /// (every later operation through it is refused, every reap empty).
    /// `faults` is the fault mix from now on (a crash switches faults
    /// off). Returns `false` when the slot holds no disk.
    pub fn crash(&self, faults: crate::disk::sim::SimFaults) -> bool {
        let mut st = self.0.lock().expect("sim disk slot");
        let Some(d) = st.disk.take() else { return false };
        let mut d = d.crash();
        d.set_faults(faults);
        st.disk = Some(d);
        st.epoch += 1;
        st.held = false;
        true
    }

    /// Opens the disk for an engine: `None` when the slot is empty or an
    /// engine of this epoch holds it.
    fn open(&self) -> Option<SimHandle> {
        let mut st = self.0.lock().expect("sim disk slot");
        if st.held || st.disk.is_none() {
            return None;
        }
        st.held = true;
        Some(SimHandle { slot: self.clone(), epoch: st.epoch, depth: st.disk.as_ref().map_or(1, |d| d.queue_depth()) })
    }
}

impl std::fmt::Debug for SimDiskSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (disk, held) = self.0.lock().map(|s| (s.disk.is_some(), s.held)).unwrap_or((false, false));
        f.debug_struct("SimDiskSlot").field("holds_disk", &disk).field("held", &held).finish()
    }
}

/// An engine's use of a [`SimDiskSlot`]'s disk, for one epoch.
struct SimHandle {
    slot: SimDiskSlot,
    epoch: u64,
    depth: usize,
}

impl SimHandle {
    /// Runs `f` on the disk while this handle's epoch is current; `None`
    /// once fenced (or without a disk).
    fn with<R>(&self, f: impl FnOnce(&mut SimDisk) -> R) -> Option<R> {
        let mut st = self.slot.0.lock().expect("sim disk slot");
        if st.epoch != self.epoch {
            return None;
        }
        st.disk.as_mut().map(f)
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        let mut st = self.slot.0.lock().expect("sim disk slot");
        if st.epoch == self.epoch {
            st.held = false;
        }
    }
}

impl DiskIo for SimHandle {
    fn kind(&self) -> BackendKind {
        BackendKind::Sim
    }
    fn capacity(&self) -> u64 {
        self.with(|d| d.capacity()).unwrap_or(0)
    }
    fn queue_depth(&self) -> usize {
        self.depth
    }
    fn in_flight(&self) -> usize {
        self.with(|d| d.in_flight()).unwrap_or(0)
    }
    fn submit(&mut self, op: IoOp) -> Result<(), Refused> {
        let mut guard = self.slot.0.lock().expect("sim disk slot");
        let st = &mut *guard;
        match st.disk.as_mut() {
            Some(d) if st.epoch == self.epoch => d.submit(op),
            // Fenced: the process this handle belonged to is dead.
            _ => Err(Refused { error: crate::disk::io::SubmitError::Broken(crate::disk::io::EIO), op }),
        }
    }
    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        self.with(|d| d.reap(wait, out)).unwrap_or(Ok(0))
    }
    fn reap_within(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        self.with(|d| d.reap_within(timeout, out)).unwrap_or(Ok(0))
    }
}

/// Settings of an engine's disk tier ([`super::EngineConfig::disk`]).
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// Directory of the tier's file (must exist; on the SSD). Ignored when
    /// `sim` is set.
    pub dir: PathBuf,
    /// Size of the tier's file (bytes; rounded down to 4 KiB).
    pub bytes: u64,
    /// Writes in flight at the backend, at most (count); a file-backed
    /// tier's backend has [`DISK_READ_SLOTS`] more slots, kept for reads.
    pub queue_depth: usize,
    /// Writes accepted and not completed, at most (blocks): the
    /// write-behind queue. An eviction beyond it drops the block.
    pub write_queue_max: usize,
    /// Largest record alignment (bytes, a power of two ≥ 4 KiB; default
    /// [`DISK_RECORD_ALIGN_DEFAULT`]; see [`TierConfig::record_align`]).
    pub record_align: u64,
    /// How long a local staging (lookup, `load`, a fetch's local part) may
    /// wait for disk reads.
    pub stage_deadline: Duration,
    /// Whether the tier's driver evicts pool blocks ahead of demand (see
    /// the module doc): `true` by default; `false` leaves every eviction to
    /// the allocation that needs the room.
    pub evict_ahead: bool,
    /// Use this simulated disk instead of a file (tests, the simulator).
    pub sim: Option<SimDiskSlot>,
}

impl DiskConfig {
    /// A tier of `bytes` in `dir`, other settings at their defaults.
    pub fn new(dir: impl Into<PathBuf>, bytes: u64) -> Self {
        Self {
            dir: dir.into(),
            bytes,
            queue_depth: DISK_QUEUE_DEPTH_DEFAULT,
            write_queue_max: DISK_WRITE_QUEUE_DEFAULT,
            record_align: DISK_RECORD_ALIGN_DEFAULT,
            stage_deadline: Duration::from_millis(DISK_STAGE_DEADLINE_MS_DEFAULT),
            evict_ahead: true,
            sim: None,
        }
    }

    /// A tier over a simulated disk of `bytes` held in `slot`.
    pub fn simulated(slot: SimDiskSlot, bytes: u64) -> Self {
        Self { sim: Some(slot), ..Self::new(PathBuf::new(), bytes) }
    }
}

/// Why the disk tier could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskOpenError {
    /// The file or backend could not be opened.
    #[cfg(target_os = "linux")]
    #[error(transparent)]
    File(#[from] crate::disk::file::OpenError),
    /// The tier refused its settings or recovery failed.
    #[error(transparent)]
    Tier(#[from] TierError),
    /// A file-backed tier was asked for where only the simulated disk
    /// exists: off Linux, or under the simulator ([`crate::rt::SIMULATED`]).
    #[error("no file-backed disk tier in this build (off Linux or under the simulator); use a simulated disk")]
    NoFileBackend,
    /// The simulated disk's slot was empty (another engine holds it).
    #[error("the simulated disk is held by another engine")]
    SimDiskTaken,
}

/// The backend an engine's tier runs on.
enum NodeDisk {
    #[cfg(target_os = "linux")]
    Real(crate::disk::backend::RealDisk),
    Sim(SimHandle),
}

impl DiskIo for NodeDisk {
    fn kind(&self) -> BackendKind {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.kind(),
            NodeDisk::Sim(d) => d.kind(),
        }
    }
    fn capacity(&self) -> u64 {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.capacity(),
            NodeDisk::Sim(d) => d.capacity(),
        }
    }
    fn queue_depth(&self) -> usize {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.queue_depth(),
            NodeDisk::Sim(d) => d.queue_depth(),
        }
    }
    fn in_flight(&self) -> usize {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.in_flight(),
            NodeDisk::Sim(d) => d.in_flight(),
        }
    }
    fn submit(&mut self, op: IoOp) -> Result<(), Refused> {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.submit(op),
            NodeDisk::Sim(d) => d.submit(op),
        }
    }
    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.reap(wait, out),
            NodeDisk::Sim(d) => d.reap(wait, out),
        }
    }
    fn reap_within(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.reap_within(timeout, out),
            NodeDisk::Sim(d) => d.reap_within(timeout, out),
        }
    }
    fn set_completion_hint(&mut self, hint: crate::disk::io::CompletionHint) -> bool {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.set_completion_hint(hint),
            NodeDisk::Sim(d) => d.set_completion_hint(hint),
        }
    }
    fn next_data(&self, from: u64) -> Option<u64> {
        match self {
            #[cfg(target_os = "linux")]
            NodeDisk::Real(d) => d.next_data(from),
            NodeDisk::Sim(d) => d.next_data(from),
        }
    }
}

/// Counters of the engine's use of its disk tier (monotonic); the tier's
/// own counters are in [`TierCounters`].
#[derive(Debug, Default)]
pub struct DiskMetrics {
    /// Pool victims the tier refused (queue full, no space, bad input):
    /// dropped, their removal registered.
    pub write_refused: AtomicU64,
    /// Removals enqueued for records that left the tier.
    pub removals_enqueued: AtomicU64,
    /// Removals of records that left the tier dropped at a full queue.
    pub removals_dropped_at_enqueue: AtomicU64,
    /// Records that left the tier while a newer record of the block was
    /// already queued (no removal: the block is still on disk).
    pub removals_skipped_rewritten: AtomicU64,
    /// Records that left the tier while the block was resident in the pool
    /// (no removal).
    pub removals_skipped_resident: AtomicU64,
    /// Pool blocks the driver evicted ahead of demand (a subset of the
    /// engine's evictions; see the module doc).
    pub evicted_ahead: AtomicU64,
    /// Blocks staged from disk into the pool (verified, sealed).
    pub staged_blocks: AtomicU64,
    /// Stagings that failed: the read failed or did not verify, the record
    /// left the tier before its read, or no pool room.
    pub stage_failures: AtomicU64,
    /// Of those, stagings that found no room in the pool (every block
    /// pinned, or held by the staging itself).
    pub stage_no_room: AtomicU64,
    /// Stagings that missed their deadline.
    pub stage_timeouts: AtomicU64,
    /// Blocks staged for a peer's transfer-lock request (a subset of
    /// `staged_blocks`: disk blocks served to peers).
    pub peer_staged_blocks: AtomicU64,
    /// Pool victims refused because the write-behind queue was full (a
    /// subset of `write_refused`).
    pub write_queue_full: AtomicU64,
    /// Blocks found by recovery at start and advertised again (inserts
    /// offered, as the registration queue had room: see
    /// `readvertise_recovered`; any it still refused are in the engine's
    /// `registrations_dropped_at_enqueue`).
    pub recovered_advertised: AtomicU64,
    /// Staged blocks whose record left the tier (its removal registered)
    /// while they were being staged, advertised again from the pool
    /// (inserts offered).
    pub readvertised: AtomicU64,
    /// Nanoseconds from a staging read's start to its verified bytes
    /// (summed over reads).
    pub read_ns: AtomicU64,
}

/// A point-in-time view of the tier: its counters, the engine's, and
/// gauges.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DiskStats {
    /// Which backend runs (its display name).
    pub backend: String,
    /// The tier's counters.
    pub tier: TierCounters,
    /// Pool victims the tier took (see
    /// [`super::EngineMetrics::evicted_to_disk`]).
    pub evicted_to_disk: u64,
    /// See [`DiskMetrics::write_refused`].
    pub write_refused: u64,
    /// See [`DiskMetrics::removals_enqueued`].
    pub removals_enqueued: u64,
    /// See [`DiskMetrics::removals_dropped_at_enqueue`].
    pub removals_dropped_at_enqueue: u64,
    /// See [`DiskMetrics::evicted_ahead`].
    pub evicted_ahead: u64,
    /// See [`DiskMetrics::staged_blocks`].
    pub staged_blocks: u64,
    /// See [`DiskMetrics::stage_failures`].
    pub stage_failures: u64,
    /// See [`DiskMetrics::stage_no_room`].
    pub stage_no_room: u64,
    /// See [`DiskMetrics::stage_timeouts`].
    pub stage_timeouts: u64,
    /// See [`DiskMetrics::peer_staged_blocks`].
    pub peer_staged_blocks: u64,
    /// See [`DiskMetrics::write_queue_full`].
    pub write_queue_full: u64,
    /// See [`DiskMetrics::recovered_advertised`].
    pub recovered_advertised: u64,
    /// See [`DiskMetrics::readvertised`].
    pub readvertised: u64,
    /// See [`DiskMetrics::read_ns`].
    pub read_ns: u64,
    /// Records indexed now (count).
    pub records: u64,
    /// Bytes records take now.
    pub used_bytes: u64,
    /// The tier's size (bytes).
    pub capacity_bytes: u64,
}

struct State {
    tier: Tier<NodeDisk>,
    /// Reads in flight, by tag: who waits for the bytes.
    readers: HashMap<u64, (oneshot::Sender<Result<ReadBlock, IoFailure>>, Instant)>,
}

/// An engine's disk tier; see the module doc.
pub(crate) struct DiskTier {
    state: Mutex<State>,
    pub(crate) wake: Arc<Notify>,
    metrics: DiskMetrics,
    pub(crate) stage_deadline: Duration,
    evict_ahead: bool,
    /// The driver evicts ahead until the high mark: set when the pool fell
    /// below the low mark, cleared at the high mark.
    evicting_ahead: AtomicBool,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").finish_non_exhaustive()
    }
}

/// The queue depth a real backend is opened with for a configured depth of
/// `depth`: `depth` + [`DISK_READ_SLOTS`] (at most
/// [`DISK_QUEUE_DEPTH_MAX`](crate::limits::DISK_QUEUE_DEPTH_MAX)); a
/// depth outside `1..=DISK_QUEUE_DEPTH_MAX` is passed on as it is, for the
/// backend to refuse.
pub(crate) fn backend_depth(depth: usize) -> usize {
    let max = crate::limits::DISK_QUEUE_DEPTH_MAX;
    if depth == 0 || depth > max { depth } else { (depth + DISK_READ_SLOTS).min(max) }
}

/// The key a block of namespace `ns` and layout family `family` has on disk.
pub(crate) fn block_key(ns: &Arc<str>, hash: &BlockHash, family: u64) -> BlockKey {
    BlockKey { namespace: ns.clone(), hash: hash.clone(), family }
}

/// A stable 64-bit id of a layout family (FNV-1a over the per-layer
/// segments and bytes): what disk records carry, the same in every process.
pub fn family_id(f: &LayoutFamily) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&(f.slots.len() as u64).to_le_bytes());
    for (segments, bytes) in &f.slots {
        eat(&[*segments]);
        eat(&bytes.to_le_bytes());
    }
    h
}

/// The slot lengths and seal checksums of a block of family `f`, as the
/// tier takes them; `None` when the counts disagree or a slot exceeds 4 GiB.
pub(crate) fn slot_sums(f: &LayoutFamily, checksums: &[u32]) -> Option<Vec<SlotSum>> {
    if f.slots.len() != checksums.len() {
        return None;
    }
    f.slots
        .iter()
        .zip(checksums)
        .map(|((segments, bytes), crc)| {
            let len = u64::from(*segments).checked_mul(*bytes)?;
            Some(SlotSum { len: u32::try_from(len).ok()?, crc32c: *crc })
        })
        .collect()
}

/// How a staging read ended.
pub(crate) enum ReadEnd {
    /// Verified bytes.
    Block(ReadBlock),
    /// The tier holds no record of the block (it left since the lookup).
    Absent,
    /// The read failed or did not verify (the record was dropped).
    Failed,
    /// The deadline passed.
    TimedOut,
}

impl DiskTier {
    /// Opens the tier per `cfg` (scanning for records, C18); returns it and
    /// the blocks recovery kept.
    pub(crate) fn open(cfg: &DiskConfig) -> Result<(Self, Vec<BlockKey>), DiskOpenError> {
        let mut io = match &cfg.sim {
            Some(slot) => NodeDisk::Sim(slot.open().ok_or(DiskOpenError::SimDiskTaken)?),
            None => Self::open_file(cfg)?,
        };
        let wake = Arc::new(Notify::new());
        let w = wake.clone();
        let hinted = io.set_completion_hint(Arc::new(move || w.notify_one()));
        // A real backend is opened with `DISK_READ_SLOTS` slots beyond the
        // configured depth, kept for reads; the simulated disk's depth is
        // its own, and all of it is shared.
        let read_slots = if cfg.sim.is_some() { 0 } else { DISK_READ_SLOTS };
        let tcfg = TierConfig { write_queue_max: cfg.write_queue_max, record_align: cfg.record_align, read_slots };
        let (tier, rec) = Tier::open(io, tcfg)?;
        tracing::info!(
            backend = %tier.backend(),
            capacity = tier.capacity(),
            recovered = rec.blocks.len(),
            rejected = rec.rejected,
            scanned_bytes = rec.scanned_bytes,
            skipped_bytes = rec.skipped_bytes,
            completions = if hinted { "woken" } else { "polled" },
            "disk tier open"
        );
        let keys = rec.blocks.into_iter().map(|b| b.key).collect();
        Ok((
            Self {
                state: Mutex::new(State { tier, readers: HashMap::new() }),
                wake,
                metrics: DiskMetrics::default(),
                stage_deadline: cfg.stage_deadline,
                evict_ahead: cfg.evict_ahead,
                evicting_ahead: AtomicBool::new(false),
            },
            keys,
        ))
    }

    #[cfg(target_os = "linux")]
    fn open_file(cfg: &DiskConfig) -> Result<NodeDisk, DiskOpenError> {
        if crate::rt::SIMULATED {
            // Real I/O threads and io_uring rings would run outside the
            // simulator's clock and scheduler.
            return Err(DiskOpenError::NoFileBackend);
        }
        let d = crate::disk::backend::open_backend(
            &cfg.dir,
            cfg.bytes,
            backend_depth(cfg.queue_depth),
            crate::disk::backend::BackendChoice::Auto,
        )?;
        Ok(NodeDisk::Real(d))
    }

    #[cfg(not(target_os = "linux"))]
    fn open_file(_cfg: &DiskConfig) -> Result<NodeDisk, DiskOpenError> {
        Err(DiskOpenError::NoFileBackend)
    }

    pub(crate) fn metrics(&self) -> &DiskMetrics {
        &self.metrics
    }

    /// Whether `key` has a record: on disk, or being written (readable
    /// too: the tier serves it from its write's buffer).
    pub(crate) fn indexed(&self, key: &BlockKey) -> bool {
        self.generation(key).is_some()
    }

    /// The generation of `key`'s record, if the tier has one.
    pub(crate) fn generation(&self, key: &BlockKey) -> Option<u64> {
        self.state.lock().expect("disk lock").tier.lookup(key).map(|(g, _)| g)
    }

    /// Every block with a record, written or being written (the
    /// backfill: each is readable).
    pub(crate) fn keys(&self) -> Vec<BlockKey> {
        self.state.lock().expect("disk lock").tier.keys()
    }

    /// Hands a pool victim to the write-behind queue. `true` when the tier
    /// holds it (queued or already on disk): it stays advertised.
    pub(crate) fn write(&self, key: &BlockKey, slots: &[SlotSum], bytes: &[u8]) -> bool {
        let r = self.state.lock().expect("disk lock").tier.write(key, slots, bytes);
        self.wake.notify_one();
        match r {
            Ok(WriteOutcome::Queued { .. } | WriteOutcome::AlreadyOnDisk { .. }) => true,
            Err(e) => {
                self.metrics.write_refused.fetch_add(1, Ordering::Relaxed);
                match e {
                    WriteRefused::QueueFull { .. } => {
                        let n = self.metrics.write_queue_full.fetch_add(1, Ordering::Relaxed) + 1;
                        // Counted every time; logged at debug per refusal, and
                        // at info on the first and on every power of two
                        // from 1024 on (rate-limited: a full queue under a
                        // burst of evictions refuses thousands).
                        if n == 1 || n.is_power_of_two() && n >= 1024 {
                            tracing::info!(
                                refusals = n,
                                "disk tier: write-behind queue full, evicted block dropped (raise --ssd-write-queue?)"
                            );
                        } else {
                            tracing::debug!(refusals = n, "disk tier: write queue full, block dropped");
                        }
                    }
                    // Logged by the tier, rate-limited.
                    WriteRefused::NoSpace { .. } => {}
                    e => tracing::warn!(error = %e, "disk tier: write refused, block dropped"),
                }
                false
            }
        }
    }

    /// Reads `key`'s record (verified, C17) by `deadline`.
    pub(crate) async fn read(&self, key: &BlockKey, deadline: Instant) -> ReadEnd {
        let started = Instant::now();
        let rx = {
            let mut st = self.state.lock().expect("disk lock");
            match st.tier.read(key) {
                Ok(tag) => {
                    let (tx, rx) = oneshot::channel();
                    st.readers.insert(tag, (tx, started));
                    rx
                }
                Err(ReadRefused::NotFound) => return ReadEnd::Absent,
                Err(ReadRefused::Buffer(e)) => {
                    tracing::warn!(error = %e, "disk tier: no read buffer");
                    return ReadEnd::Failed;
                }
            }
        };
        self.wake.notify_one();
        match crate::rt::timeout_at(deadline, rx).await {
            Ok(Ok(Ok(block))) => {
                self.metrics.read_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                ReadEnd::Block(block)
            }
            Ok(Ok(Err(_)) | Err(_)) => ReadEnd::Failed,
            Err(_) => ReadEnd::TimedOut,
        }
    }

    /// Offers the inserts of those of `keys` (all of namespace `ns`) whose
    /// record is still in the tier, checked and offered under the tier's
    /// lock (see [`readvertise_recovered`]); returns (offered, accepted).
    fn offer_recovered(&self, client: &crate::client::MetaServerClient, ns: &str, keys: &[BlockKey]) -> (u64, u64) {
        let st = self.state.lock().expect("disk lock");
        let hashes: Vec<BlockHash> =
            keys.iter().filter(|k| st.tier.lookup(k).is_some()).map(|k| k.hash.clone()).collect();
        let accepted = client.try_register(ns, &hashes);
        (hashes.len() as u64, accepted as u64)
    }

    /// Gives a read buffer back for reuse.
    pub(crate) fn recycle(&self, block: ReadBlock) {
        self.state.lock().expect("disk lock").tier.recycle(block.buf);
    }

    /// Writes the write-behind queue still accepts (blocks).
    fn write_queue_room(&self) -> usize {
        self.state.lock().expect("disk lock").tier.write_queue_room()
    }

    /// Operations issued and not completed (count).
    pub(crate) fn ops_pending(&self) -> usize {
        self.state.lock().expect("disk lock").tier.ops_pending()
    }

    /// A snapshot of the counters and gauges.
    pub(crate) fn stats(&self) -> DiskStats {
        let (backend, tier, records, used, cap) = {
            let st = self.state.lock().expect("disk lock");
            let t = &st.tier;
            (t.backend().to_string(), t.counters().clone(), t.len() as u64, t.used_bytes(), t.capacity())
        };
        let m = &self.metrics;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskStats {
            backend,
            tier,
            evicted_to_disk: 0,
            write_refused: ld(&m.write_refused),
            removals_enqueued: ld(&m.removals_enqueued),
            removals_dropped_at_enqueue: ld(&m.removals_dropped_at_enqueue),
            evicted_ahead: ld(&m.evicted_ahead),
            staged_blocks: ld(&m.staged_blocks),
            stage_failures: ld(&m.stage_failures),
            stage_no_room: ld(&m.stage_no_room),
            stage_timeouts: ld(&m.stage_timeouts),
            peer_staged_blocks: ld(&m.peer_staged_blocks),
            write_queue_full: ld(&m.write_queue_full),
            recovered_advertised: ld(&m.recovered_advertised),
            readvertised: ld(&m.readvertised),
            read_ns: ld(&m.read_ns),
            records,
            used_bytes: used,
            capacity_bytes: cap,
        }
    }

    /// One round of the driver: polls the tier without waiting, hands out
    /// read results and returns the blocks whose records left the tier and
    /// whether operations are still in flight.
    fn round(&self) -> (Vec<BlockKey>, bool) {
        let mut st = self.state.lock().expect("disk lock");
        let events = match st.tier.poll(false) {
            Ok(ev) => ev,
            Err(e) => {
                tracing::error!(error = %e, "disk tier: backend cannot be polled");
                Vec::new()
            }
        };
        let mut removed = Vec::new();
        for ev in events {
            match ev {
                TierEvent::Written { .. } => {}
                TierEvent::Read { tag, result, .. } => match st.readers.remove(&tag) {
                    Some((tx, _)) => {
                        if let Err(Ok(block)) = tx.send(result) {
                            st.tier.recycle(block.buf); // the reader gave up
                        }
                    }
                    None => {
                        if let Ok(block) = result {
                            st.tier.recycle(block.buf);
                        }
                    }
                },
                // A newer record of the block was queued after this one
                // left (the pool evicted the block again before this
                // poll): the block stays on disk and advertised; that
                // record's own removal, if it fails, comes as its own
                // event.
                TierEvent::Removed { key, generation, .. }
                    if st.tier.lookup(&key).is_some_and(|(g, _)| g != generation) =>
                {
                    self.metrics.removals_skipped_rewritten.fetch_add(1, Ordering::Relaxed);
                }
                TierEvent::Removed { key, .. } => removed.push(key),
            }
        }
        (removed, st.tier.ops_pending() > 0)
    }
}

/// Advertises the blocks recovery kept (C18) through the registration
/// queue, a share of its free room at a time: a tier recovers far more
/// blocks than the queue holds (tens of thousands against
/// `REGISTRATION_QUEUE_DEPTH_DEFAULT`, 4,096), and one offer of them all
/// dropped everything past the first queue's worth. Each round offers at
/// most half the free room (the engine's own saves and removals keep the
/// rest), and only blocks whose record is still in the tier, checked and
/// offered under the tier's lock ([`DiskTier::offer_recovered`]): a record
/// evicted after that check has its removal registered by the driver after
/// the insert, one evicted before it is not advertised — an insert never
/// follows its own removal. While the queue has no room it polls every
/// [`RECOVERED_READVERTISE_POLL_MS`] (never a flush, which would take the
/// report of drops owed to the engine's own next flush, C3). Ends once
/// every block was considered, or when the engine is gone or its client
/// shut down.
pub(crate) async fn readvertise_recovered(engine: Weak<EngineInner>, keys: Vec<BlockKey>) {
    let mut by_ns: HashMap<Arc<str>, Vec<BlockKey>> = HashMap::new();
    for k in keys {
        by_ns.entry(k.namespace.clone()).or_default().push(k);
    }
    for (ns, keys) in by_ns {
        let mut at = 0;
        while at < keys.len() {
            let Some(e) = engine.upgrade() else { return };
            let Some(d) = e.disk.as_ref() else { return };
            let Some(room) = e.client.queue_room() else { return };
            let share = room / 2;
            if share == 0 {
                drop(e); // do not keep the engine alive while waiting
                tokio::time::sleep(Duration::from_millis(RECOVERED_READVERTISE_POLL_MS)).await;
                continue;
            }
            let part = &keys[at..(at + share).min(keys.len())];
            let (offered, accepted) = d.offer_recovered(&e.client, &ns, part);
            d.metrics().recovered_advertised.fetch_add(offered, Ordering::Relaxed);
            // Another offer may have taken the room meanwhile.
            e.metrics.registrations_dropped_at_enqueue.fetch_add(offered - accepted, Ordering::Relaxed);
            at += part.len();
        }
    }
}

/// The driver loop of `engine`'s tier (see the module doc); ends when the
/// engine is gone. `wake` is the tier's wake-up (held here so an idle
/// driver does not keep the engine alive).
pub(crate) async fn drive(engine: Weak<EngineInner>, wake: Arc<Notify>) {
    loop {
        let busy = {
            let Some(e) = engine.upgrade() else { return };
            let Some(disk) = e.disk.as_ref() else { return };
            let (removed, busy) = disk.round();
            if !removed.is_empty() {
                e.disk_removed(&removed);
            }
            if e.evict_ahead_wanted() {
                disk.evicting_ahead.store(true, Ordering::Relaxed);
            }
            if disk.evicting_ahead.load(Ordering::Relaxed) {
                let engine = super::Engine { inner: e.clone() };
                // One victim at a time (`evict(1)`: the LRU block), up to the
                // high mark; at a full write-behind queue it resumes in a
                // later round, once writes completed.
                let mut evicted = 0u64;
                while disk.write_queue_room() > 0 {
                    if engine.inner.evict_ahead_room() == 0 || engine.evict(1) == 0 {
                        // At the high mark, or every block pinned.
                        disk.evicting_ahead.store(false, Ordering::Relaxed);
                        break;
                    }
                    disk.metrics.evicted_ahead.fetch_add(1, Ordering::Relaxed);
                    evicted += 1;
                    if evicted.is_multiple_of(DISK_EVICT_AHEAD_YIELD_BLOCKS) {
                        tokio::task::yield_now().await;
                    }
                }
            }
            busy
        };
        // A read or write queued, or (from a backend that hints) an
        // operation completed, wakes the driver at once; the timer is the
        // fallback.
        let nap =
            if busy { Duration::from_micros(DISK_POLL_INTERVAL_US) } else { Duration::from_millis(DISK_IDLE_POLL_MS) };
        let _ = tokio::time::timeout(nap, wake.notified()).await;
    }
}

impl EngineInner {
    /// With a tier, wakes its driver when the pool's free room fell below
    /// the evict-ahead low mark (called after each allocation).
    pub(crate) fn nudge_evict_ahead(&self) {
        if self.evict_ahead_wanted()
            && let Some(d) = &self.disk
        {
            d.wake.notify_one();
        }
    }

    /// Whether the tier evicts ahead and the pool's free room is below the
    /// low mark.
    fn evict_ahead_wanted(&self) -> bool {
        if !self.disk.as_ref().is_some_and(|d| d.evict_ahead) {
            return false;
        }
        let cap = self.pool.capacity();
        self.pool.free_bytes() < cap / 1024 * DISK_EVICT_AHEAD_LOW_PER_1024
    }

    /// Bytes to evict to reach the evict-ahead high mark (0 at or above it).
    fn evict_ahead_room(&self) -> u64 {
        let cap = self.pool.capacity();
        (cap / 1024 * DISK_EVICT_AHEAD_HIGH_PER_1024).saturating_sub(self.pool.free_bytes())
    }

    /// Resident blocks per namespace: the pool's and, with a disk tier,
    /// every block with a record, written or being written (the backfill
    /// source, C6, C18).
    pub(crate) fn resident_blocks(&self) -> Vec<(String, Vec<BlockHash>)> {
        let pool = self.cache.lock().expect("cache lock").resident();
        let Some(d) = &self.disk else { return pool };
        let mut by_ns: std::collections::BTreeMap<String, std::collections::BTreeSet<BlockHash>> =
            pool.into_iter().map(|(ns, v)| (ns, v.into_iter().collect())).collect();
        for k in d.keys() {
            by_ns.entry(k.namespace.to_string()).or_default().insert(k.hash);
        }
        by_ns.into_iter().map(|(ns, set)| (ns, set.into_iter().collect())).collect()
    }

    /// Registers the removal of each block whose record left the tier,
    /// unless it is resident in the pool again (C4, C17).
    fn disk_removed(&self, keys: &[BlockKey]) {
        let Some(d) = &self.disk else { return };
        let m = d.metrics();
        for k in keys {
            if self.cache.lock().expect("cache lock").contains(&k.namespace, &k.hash) {
                m.removals_skipped_resident.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // Evicted from the pool and queued to disk again since the
            // poll that reported this removal (another thread's eviction).
            if d.indexed(k) {
                m.removals_skipped_rewritten.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if self.client.try_unregister(&k.namespace, std::slice::from_ref(&k.hash)) == 1 {
                m.removals_enqueued.fetch_add(1, Ordering::Relaxed);
            } else {
                m.removals_dropped_at_enqueue.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl super::Engine {
    /// Hands a pool victim to the disk tier's write-behind queue; `true`
    /// when the tier took it (the block stays advertised).
    pub(crate) fn write_to_disk(&self, ns: &Arc<str>, hash: &BlockHash, block: &super::CachedBlock) -> bool {
        let Some(d) = &self.inner.disk else { return false };
        let family = match self.inner.layouts.read().expect("layouts lock").families.get(ns) {
            Some(f) => f.clone(),
            None => return false,
        };
        let Some(slots) = slot_sums(&family, &block.checksums) else {
            tracing::warn!(namespace = %ns, "disk tier: block's checksums do not match its family; dropped");
            return false;
        };
        d.write(&block_key(ns, hash, family_id(&family)), &slots, block.extent.as_slice())
    }

    /// Stages blocks among `hashes` that are on disk and not in the pool:
    /// reads them (verified, C17), copies each into a fresh pool extent and
    /// seals it into the cache with the record's slot checksums. With
    /// `prefix`, stops at the first block in neither place. Gives up on
    /// whatever is not done by `deadline` (the block stays absent).
    ///
    /// Returns blocks staged, and holds on every block of `hashes` that is
    /// in the pool — those found there (LRU-touched) and those staged —
    /// until the caller drops them (after its lock or its load): a staging
    /// into a small pool would otherwise evict the very blocks it is
    /// staging for, the resident ones first (least recently used) and then
    /// its own earlier stagings, and the caller would find a gap.
    pub(crate) async fn stage(
        &self,
        ns: &Arc<str>,
        layout: &super::Layout,
        hashes: &[BlockHash],
        prefix: bool,
        deadline: Instant,
    ) -> (usize, Vec<super::CachedBlock>) {
        let Some(d) = &self.inner.disk else { return (0, Vec::new()) };
        let family = family_id(&layout.family());
        let mut want = Vec::new();
        let mut held = Vec::new();
        for h in hashes {
            if let Some(b) = self.inner.cache.lock().expect("cache lock").get(ns, h) {
                held.push(b);
                continue;
            }
            let k = block_key(ns, h, family);
            if d.indexed(&k) {
                want.push(k);
            } else if prefix {
                break;
            }
        }
        let m = d.metrics();
        let mut staged = 0;
        for chunk in want.chunks(crate::limits::DISK_STAGE_READS_IN_FLIGHT) {
            let ends = futures::future::join_all(chunk.iter().map(|k| d.read(k, deadline))).await;
            for (k, end) in chunk.iter().zip(ends) {
                match end {
                    ReadEnd::Block(b) => {
                        if let Some(b) = self.seal_from_disk(ns, layout, k, b) {
                            held.push(b);
                            staged += 1;
                            m.staged_blocks.fetch_add(1, Ordering::Relaxed);
                        } else {
                            m.stage_failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    ReadEnd::Absent | ReadEnd::Failed => {
                        m.stage_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    ReadEnd::TimedOut => {
                        m.stage_timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        (staged, held)
    }

    /// Copies a verified disk block into a fresh pool extent and seals it
    /// into the cache; returns a hold on the block. `None` when its shape
    /// is not the layout's or the pool has no room.
    fn seal_from_disk(
        &self,
        ns: &Arc<str>,
        layout: &super::Layout,
        key: &BlockKey,
        b: ReadBlock,
    ) -> Option<super::CachedBlock> {
        let d = self.inner.disk.as_ref()?;
        let len = layout.block_bytes();
        if b.bytes().len() as u64 != len || b.slots.len() != layout.layers().len() {
            // The family id matched, so this is a bug or a hash collision.
            tracing::warn!(namespace = %ns, "disk tier: a verified record has another shape than the layout");
            d.recycle(b);
            return None;
        }
        let mut ext = match self.alloc(len) {
            Ok(e) => e,
            Err(_) => {
                d.metrics().stage_no_room.fetch_add(1, Ordering::Relaxed);
                d.recycle(b);
                return None;
            }
        };
        ext.as_mut_slice().copy_from_slice(b.bytes());
        if tracing::enabled!(target: DISK_STAGED_TRACE_TARGET, tracing::Level::TRACE) {
            tracing::trace!(
                target: DISK_STAGED_TRACE_TARGET,
                node = %self.inner.node,
                namespace = %ns,
                hash = %hex::encode(key.hash.as_bytes()),
                generation = b.generation,
                payload_crc = crc32c::crc32c(ext.as_slice()),
                "disk block staged"
            );
        }
        let checksums: Arc<[u32]> = b.slots.iter().map(|s| s.crc32c).collect();
        let read_generation = b.generation;
        d.recycle(b);
        let block = super::CachedBlock { extent: ext.seal(), checksums };
        let held = block.clone();
        let inserted = self.insert_sealed(ns, key.hash.clone(), block);
        // The record read may have left the tier meanwhile, its removal
        // registered: the pool holds the block now, so advertise it again.
        // A newer record of the block (the pool evicted it again since)
        // does not mean the block is still advertised: that eviction
        // assumed so.
        if inserted && d.generation(key) != Some(read_generation) {
            let n = self.advertise(ns, std::slice::from_ref(&key.hash));
            d.metrics().readvertised.fetch_add(n as u64, Ordering::Relaxed);
        }
        Some(held)
    }

    /// A fetch's local part: stages the disk-resident prefix of `hashes`
    /// (by the earlier of `until` and the tier's staging deadline) and
    /// returns how many hashes from the first are in the pool now.
    pub(crate) async fn stage_local_prefix(&self, namespace: &str, hashes: &[BlockHash], until: Instant) -> usize {
        // Held until the prefix is counted.
        let _held = match (&self.inner.disk, self.layout(namespace)) {
            (Some(d), Ok((ns, layout))) => {
                let deadline = until.min(Instant::now() + d.stage_deadline);
                self.stage(&ns, &layout, hashes, true, deadline).await.1
            }
            _ => Vec::new(),
        };
        self.resident_prefix(namespace, hashes)
    }

    /// Stages the disk-resident part of `hashes`' prefix into the pool
    /// ahead of use, so that a later [`load`](Self::load),
    /// [`fetch`](Self::fetch) or peer's lock finds those blocks resident
    /// instead of reading the disk on its own path: what an engine calls
    /// when a request is queued, while it waits for its turn (the pattern
    /// of vLLM's KV connectors, which load a waiting request's external KV
    /// asynchronously). Reads stop at the first block in neither the pool
    /// nor the disk tier and by the earlier of `until` and the tier's
    /// staging deadline; every block read is verified before it enters the
    /// pool (C17). Pool pressure may evict a staged block again before it
    /// is used (it stays on disk). Returns how many hashes, from the first,
    /// are in the pool now; without a disk tier, only that count.
    pub async fn prefetch(&self, namespace: &str, hashes: &[BlockHash], until: Instant) -> usize {
        self.stage_local_prefix(namespace, hashes, until).await
    }

    /// [`lock_for_transfer`](Self::lock_for_transfer) for a peer's request:
    /// first stages the requested blocks that are on disk (C18), by the
    /// smaller of the tier's staging deadline and half the peer RPC
    /// timeout (the requester's deadline for this call), so a slow disk
    /// makes the blocks absent, never the call late.
    ///
    /// # Errors
    /// As [`lock_for_transfer`](Self::lock_for_transfer).
    pub async fn lock_for_transfer_staged(
        &self,
        namespace: &str,
        hashes: &[BlockHash],
    ) -> Result<super::TransferLock, super::EngineError> {
        // Held until the lock pinned them.
        let _held = match (&self.inner.disk, self.layout(namespace)) {
            (Some(d), Ok((ns, layout))) => {
                let budget = d.stage_deadline.min(self.inner.cfg.peer_rpc_timeout / 2);
                let (staged, held) = self.stage(&ns, &layout, hashes, false, Instant::now() + budget).await;
                d.metrics().peer_staged_blocks.fetch_add(staged as u64, Ordering::Relaxed);
                held
            }
            _ => Vec::new(),
        };
        self.lock_for_transfer(namespace, hashes)
    }

    /// The disk tier's counters and gauges; `None` without a tier.
    pub fn disk_stats(&self) -> Option<DiskStats> {
        let d = self.inner.disk.as_ref()?;
        let mut s = d.stats();
        s.evicted_to_disk = self.inner.metrics.evicted_to_disk.load(Ordering::Relaxed);
        Some(s)
    }

    /// Waits until the disk tier has no operation in flight (queued writes
    /// landed), at most `deadline`; `true` when it drained. Without a tier,
    /// `true` at once.
    pub async fn disk_drain(&self, deadline: Duration) -> bool {
        let Some(d) = &self.inner.disk else { return true };
        let end = Instant::now() + deadline;
        loop {
            d.wake.notify_one();
            if d.ops_pending() == 0 {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}
