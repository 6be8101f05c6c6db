//! The embeddable `Engine` (design.md §2.1): layouts, the pinned pool, save /
//! seal / load, local prefix lookup, LRU eviction under pool pressure,
//! transfer locks with their own GC, and the P/D handoff barrier.
//!
//! Concurrency model: all state sits behind short `std::sync::Mutex`
//! sections that never await; the async parts (GPU completions, the lock
//! GC, fetch) are tasks, so the simulator runs the same code.

pub mod cache;
mod codes;
pub mod device;
mod disk;
pub mod fetch;
pub mod layout;
pub mod leases;
pub mod locks;
mod peers;
pub mod tickets;
pub use crate::memory::pool;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use rand::{RngCore, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::canary::{self, Canary};
use crate::client::{FlushReport, MetaServerClient, OwnershipSource};
use crate::gpu::{ChecksumRange, CopyBatch, CopyOp, Direction, Gpu, GpuError, HostBuf};
use crate::limits;
use crate::memory::DeviceBufferId;
use crate::transport::{DataSource, Transport};
use crate::types::{BlockHash, IdError, NodeAddr, validate_namespace};
use cache::{BlockCache, CachedBlock};
pub use disk::{DISK_STAGED_TRACE_TARGET, DiskConfig, DiskMetrics, DiskOpenError, DiskStats, SimDiskSlot, family_id};
pub use fetch::{ConnectError, FetchIntoReport, FetchReport, SharedPool};
use layout::{LayerLayout, Layout, LayoutError, LayoutFamily};
use locks::{AccessError, LockError, LockTable};
use pool::{Extent, Pool, PoolError, SealedExtent};
pub use tickets::{TicketError, TransferAsk, TransferTicket};

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Pinned pool size (bytes), allocated once at start.
    pub pool_bytes: u64,
    /// Commit every page of the pool at start ([`Pool::prefault`]; on by
    /// default): start-up pays the page faults once instead of the first
    /// saves and fetches into each page paying them on the critical path.
    /// Off where start-up time or resident memory matters more than the
    /// first requests' latency (it commits the whole pool at start).
    pub pool_prefault: bool,
    /// Pool allocation alignment (bytes, power of two).
    pub pool_align: u64,
    /// Put the pool in a sealed memfd ([`Pool::new_shared`]) so a same-host
    /// reader can map it (the `shm` transport); on by default. Where that
    /// is unavailable (the simulator, no memfd) the pool is private and
    /// [`Pool::shared_fd`] is `None`. A node with
    /// `PathChoice::Tcp` turns it off (a private heap arena, which gets
    /// transparent huge pages where shared memory does not).
    pub pool_shared: bool,
    /// How long a transfer lock lives without a release (s).
    pub lock_timeout_secs: u32,
    /// Period of the engine's own lock GC.
    pub lock_gc_interval: Duration,
    /// Deadline of a whole fetch.
    pub fetch_deadline: Duration,
    /// Deadline of each peer RPC inside a fetch.
    pub peer_rpc_timeout: Duration,
    /// Most bytes of blocks a fetch reads per transport call (a part); each
    /// part is checksummed while the next is read (see
    /// [`limits::FETCH_READ_PART_BYTES`]). A fetch too small to fill its
    /// parts in flight twice uses smaller parts, down to
    /// [`limits::FETCH_READ_PART_BYTES_MIN`].
    pub fetch_read_part_bytes: u64,
    /// Read parts a fetch keeps in flight at once (≥ 1; see
    /// [`limits::FETCH_READS_IN_FLIGHT`]): with more than one, a fetch's
    /// parts travel over several of the transport's connections at once.
    pub fetch_reads_in_flight: usize,
    /// Least bytes of a fetched part worth a checksum task of its own (see
    /// [`limits::FETCH_VERIFY_PART_BYTES_MIN`]), for the checksum pass over
    /// what the transport did not sum as it landed (every byte on a
    /// transport without `read_summed`); the simulator sets it low so its
    /// small parts take the spread-over-tasks path.
    pub fetch_verify_task_bytes_min: u64,
    /// Seed of the engine's RNG (its incarnation and transfer-session ids,
    /// C16). `None` (the default): drawn from OS entropy, so ids are
    /// unpredictable and differ between nodes and process incarnations.
    /// `Some` only for simulations and tests that must replay ids; two
    /// engines given the same seed issue the same ids.
    pub seed: Option<u64>,
    /// Let [`Engine::fetch_into`] copy blocks device to device from a
    /// same-host owner that granted a device lease on them (C19); on by
    /// default. A node whose path is forced to `shm` or `tcp` turns it off.
    pub device_direct: bool,
    /// Let [`Engine::fetch_into`] copy blocks from a same-host owner's
    /// mapped shared pool straight into the engine's KV (one copy by the
    /// GPU backend, checksums taken of the landed bytes) instead of into
    /// the pool and then loading them; on by default. Takes effect where
    /// the transport maps owners' pools (path `auto` or `shm`) and the
    /// backend can read mapped host memory ([`crate::gpu::Gpu::open_host_region`]).
    pub shared_pool_direct: bool,
    /// The disk tier below the pool (issue 32): evicted blocks are written
    /// to it and staged back on a lookup, `load`, fetch or a peer's lock
    /// request. `None` (the default): no tier, eviction drops blocks.
    pub disk: Option<DiskConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            pool_bytes: 256 << 20,
            pool_prefault: true,
            pool_align: 256,
            pool_shared: true,
            lock_timeout_secs: limits::TRANSFER_LOCK_TIMEOUT_SECS_DEFAULT,
            lock_gc_interval: Duration::from_millis(limits::TRANSFER_LOCK_GC_INTERVAL_MS_DEFAULT),
            fetch_deadline: Duration::from_millis(limits::FETCH_DEADLINE_MS_DEFAULT),
            peer_rpc_timeout: Duration::from_millis(limits::METASERVER_RPC_TIMEOUT_MS_DEFAULT),
            fetch_read_part_bytes: limits::FETCH_READ_PART_BYTES,
            fetch_reads_in_flight: limits::FETCH_READS_IN_FLIGHT,
            fetch_verify_task_bytes_min: limits::FETCH_VERIFY_PART_BYTES_MIN,
            seed: None,
            device_direct: true,
            shared_pool_direct: true,
            disk: None,
        }
    }
}

/// Engine errors (typed; tests match variants).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A malformed namespace or hash.
    #[error(transparent)]
    Id(#[from] IdError),
    /// No layout registered for the namespace.
    #[error("no layout registered for namespace {0:?}")]
    UnknownNamespace(String),
    /// The namespace already has a (different) layout: unregister it first.
    #[error("namespace {0:?} already has a different layout; unregister it first")]
    LayoutExists(String),
    /// A layout of another [`LayoutFamily`] than the one this namespace had:
    /// its cached blocks, and its peers' blocks, have the old shape. A
    /// namespace names one layout family (see [`crate::hash::KvFamily`]).
    #[error("namespace {namespace:?} holds blocks of {had}, the new layout has {got}: use another namespace")]
    FamilyMismatch {
        /// The namespace.
        namespace: String,
        /// Its family so far.
        had: LayoutFamily,
        /// The new layout's.
        got: LayoutFamily,
    },
    /// A [`crate::hash::KvFamily`] namespace names another layer count than
    /// the layout has.
    #[error("namespace {namespace:?} names {named} layers, the layout has {given}")]
    NamespaceMismatch {
        /// The namespace.
        namespace: String,
        /// Layers the namespace names.
        named: u64,
        /// Layers in the layout.
        given: usize,
    },
    /// The buffer is named by a registered layout (C15): unregister the
    /// layout first.
    #[error("{buffer} is named by the layout of namespace {namespace:?}; unregister the layout first")]
    BufferInUse {
        /// The buffer.
        buffer: DeviceBufferId,
        /// A namespace whose layout names it.
        namespace: String,
    },
    /// The layout failed validation.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// More blocks in one request than [`crate::limits::HASHES_PER_REQUEST_MAX`].
    #[error("{got} blocks in one request, at most {max}")]
    TooManyBlocks {
        /// Blocks given.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A block index beyond the layout's `num_blocks`.
    #[error("block index {idx} out of range (layout has {num_blocks} blocks)")]
    BlockIndex {
        /// Index given.
        idx: u64,
        /// Blocks in the layout.
        num_blocks: u64,
    },
    /// The pool has no room even after eviction.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The GPU backend failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The transfer-lock table refused.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The disk tier could not be opened.
    #[error("disk tier: {0}")]
    Disk(#[from] DiskOpenError),
    /// A device lease was refused (C19).
    #[error(transparent)]
    Lease(leases::LeaseError),
    /// The task finishing a save ended without a result (only under the
    /// simulator, where the save runs on a task of its own: its node was
    /// killed; see [`crate::rt::run_to_completion`]).
    #[error("save task failed: {0}")]
    Task(String),
}

/// Result of a save.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveReport {
    /// Blocks copied, sealed and newly resident.
    pub saved: Vec<BlockHash>,
    /// Blocks skipped because they were already resident (or duplicated in
    /// the request, or sealed by a racing save).
    pub already_resident: usize,
    /// Blocks not saved because the pool had no room (after eviction).
    pub no_space: usize,
}

/// Per-block load failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The block is not resident.
    #[error("block not resident")]
    NotResident,
    /// The copy batch failed.
    #[error("copy failed: {0}")]
    Copy(GpuError),
    /// The caller's deadline passed before the block's copy was submitted
    /// ([`Engine::load_with_deadline`], the load tail of
    /// [`Engine::fetch_into_with_deadline`]): not copied, the caller's KV
    /// block untouched.
    #[error("not loaded: the deadline passed before its copy started")]
    Deadline,
}

/// Result of a load: one entry per requested block, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadReport {
    /// Per block: `Ok` when its bytes are on the device.
    pub results: Vec<Result<(), LoadError>>,
}

impl LoadReport {
    /// Blocks loaded.
    pub fn loaded(&self) -> usize {
        self.results.iter().filter(|r| r.is_ok()).count()
    }
}

/// Plain counters and gauges an exporter reads.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    /// `save` calls.
    pub saves: AtomicU64,
    /// Blocks newly sealed by saves.
    pub saved_blocks: AtomicU64,
    /// `load` calls.
    pub loads: AtomicU64,
    /// Blocks loaded to the device.
    pub loaded_blocks: AtomicU64,
    /// Blocks that failed to load.
    pub load_failures: AtomicU64,
    /// Blocks evicted under pressure (C4: `evicted == removals_enqueued +
    /// removals_dropped_at_enqueue + evicted_to_disk`).
    pub evicted: AtomicU64,
    /// Evicted blocks the disk tier took (they stay advertised; no removal).
    pub evicted_to_disk: AtomicU64,
    /// Removals enqueued for evicted blocks.
    pub removals_enqueued: AtomicU64,
    /// Removals dropped at the door (queue full) for evicted blocks.
    pub removals_dropped_at_enqueue: AtomicU64,
    /// Registrations dropped at the door (queue full) for new blocks.
    pub registrations_dropped_at_enqueue: AtomicU64,
    /// Allocations that failed even after eviction.
    pub alloc_failures: AtomicU64,
    /// Fetch calls.
    pub fetches: AtomicU64,
    /// Fetches whose first MetaServer query the caller's own answer
    /// replaced ([`Engine::fetch_into_with_owners`]).
    pub fetch_known_owners: AtomicU64,
    /// Fetches that started from an owner's transfer ticket instead of a
    /// MetaServer query and a lock RPC ([`Engine::fetch_into_with_ticket`]).
    pub fetch_tickets: AtomicU64,
    /// Tickets a fetch was given but did not read from (another namespace
    /// or request, another reader, nothing left to fetch): released unread.
    pub fetch_tickets_unused: AtomicU64,
    /// Blocks fetched from peers into the pool (verified and sealed);
    /// blocks copied device to device count in `device_blocks` instead.
    pub fetched_blocks: AtomicU64,
    /// Bytes read from peers for fetched blocks.
    pub fetched_bytes: AtomicU64,
    /// Blocks rejected by checksum verification.
    pub checksum_failures: AtomicU64,
    /// Transfer sessions created for peers.
    pub transfer_locks_created: AtomicU64,
    /// Transfer sessions expired by the GC.
    pub transfer_locks_expired: AtomicU64,
    /// Bytes copied device → pool by save batches.
    pub save_copy_bytes: AtomicU64,
    /// Nanoseconds save batches spent from submit to completion.
    pub save_copy_ns: AtomicU64,
    /// Saved blocks whose slot checksums the GPU backend computed from the
    /// device bytes (the rest were checksummed on the CPU after the copy).
    pub device_checksummed_blocks: AtomicU64,
    /// Bytes copied pool → device by load batches.
    pub load_copy_bytes: AtomicU64,
    /// Nanoseconds load batches spent from submit to completion.
    pub load_copy_ns: AtomicU64,
    /// Owner side: transfer locks whose reader took device leases (C19).
    pub device_leases_taken: AtomicU64,
    /// Reader side: blocks copied device to device from a same-host owner
    /// and verified (path `ipc`).
    pub device_blocks: AtomicU64,
    /// Bytes of those blocks.
    pub device_bytes: AtomicU64,
    /// Nanoseconds device-direct batches took, submit to verified.
    pub device_ns: AtomicU64,
    /// Device-direct parts that fell back to the pool path (copy failed,
    /// a checksum differed, the lease was too short, a handle did not open).
    pub device_fallbacks: AtomicU64,
    /// Reader side: blocks copied in one step from a same-host owner's
    /// mapped shared pool into this engine's KV and verified (path `shm`,
    /// issue 28 item 3).
    pub shared_direct_blocks: AtomicU64,
    /// Bytes of those blocks.
    pub shared_direct_bytes: AtomicU64,
    /// Nanoseconds those batches took, submit to verified.
    pub shared_direct_ns: AtomicU64,
    /// One-step shared-pool parts that fell back to the pool copy (copy
    /// failed, a checksum differed, the owner's ranges were malformed).
    pub shared_direct_fallbacks: AtomicU64,
}

/// A point-in-time view of the engine's gauges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineGauges {
    /// Pool bytes allocated (cache, in-flight saves/fetches, locked blocks).
    pub pool_used_bytes: u64,
    /// Pool bytes free.
    pub pool_free_bytes: u64,
    /// Sealed blocks in the cache.
    pub resident_blocks: u64,
    /// Live transfer sessions.
    pub active_transfer_locks: u64,
}

/// Registered layouts, and the family each namespace ever had (kept after
/// an unregister: cached blocks keep their shape).
#[derive(Default)]
struct Layouts {
    live: HashMap<Arc<str>, Arc<Layout>>,
    families: HashMap<Arc<str>, LayoutFamily>,
}

#[derive(Default)]
struct SaveTracker {
    next: u64,
    inflight: BTreeSet<u64>,
}

pub(crate) struct EngineInner {
    node: NodeAddr,
    cfg: EngineConfig,
    pool: Pool,
    gpu: Arc<dyn Gpu>,
    layouts: RwLock<Layouts>,
    cache: Mutex<BlockCache>,
    locks: Mutex<LockTable>,
    client: MetaServerClient,
    transport: OnceLock<Arc<dyn Transport>>,
    rng: Mutex<rand::rngs::StdRng>,
    origin: Instant,
    saves: Mutex<SaveTracker>,
    saves_done: watch::Sender<u64>,
    metrics: EngineMetrics,
    pub(crate) peers: peers::PeerTable,
    /// Device leases granted on this engine's KV blocks (C19).
    leases: Mutex<leases::DeviceLeases>,
    /// Exports of this engine's device buffers, made once per buffer and
    /// kind.
    exports: Mutex<HashMap<(DeviceBufferId, crate::gpu::peer::PeerKind), crate::gpu::peer::BufferExport>>,
    /// The disk tier below the pool, if configured.
    disk: Option<disk::DiskTier>,
}

/// The engine. Cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<EngineInner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("node", &self.inner.node).finish()
    }
}

/// A new transfer session (None when nothing was found) and the blocks it
/// pins, in request order.
pub type TransferLock = (Option<String>, Vec<(BlockHash, CachedBlock)>);

/// A lease: pins blocks (their memory cannot be evicted or reused) until
/// dropped.
#[derive(Debug)]
pub struct Lease {
    blocks: Vec<CachedBlock>,
}

impl Lease {
    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Removes a save from the in-flight set when it ends, however it ends.
struct SaveGuard {
    engine: Arc<EngineInner>,
    seq: u64,
}

impl Drop for SaveGuard {
    fn drop(&mut self) {
        self.engine.saves.lock().expect("saves lock").inflight.remove(&self.seq);
        self.engine.saves_done.send_modify(|n| *n += 1);
    }
}

struct Source(Weak<EngineInner>);

impl OwnershipSource for Source {
    fn resident_blocks(&self) -> Vec<(String, Vec<BlockHash>)> {
        match self.0.upgrade() {
            Some(e) => e.resident_blocks(),
            None => Vec::new(),
        }
    }
}

struct LockSource(Weak<EngineInner>);

impl DataSource for LockSource {
    fn authorize(&self, session: &str, region: u32, offset: u64, len: u64) -> Result<(SealedExtent, u64), AccessError> {
        let e = self.0.upgrade().ok_or(AccessError::UnknownSession)?;
        let now = crate::rt::elapsed_ms(e.origin);
        let r = e.locks.lock().expect("locks lock").authorize(session, region, offset, len, now);
        // The simulator checks every authorization against the session's
        // grant and end (C13: no byte under an expired or released session).
        tracing::trace!(target: DATA_ACCESS_TRACE_TARGET, session, now_ms = now, ok = r.is_ok(), "data access");
        r
    }
}

impl Engine {
    /// Creates an engine: allocates the pinned pool once, installs itself as
    /// the client's backfill source and spawns its transfer-lock GC. Call
    /// inside a runtime.
    ///
    /// # Errors
    /// [`EngineError::Pool`] when the pool cannot be allocated.
    pub fn new(
        node: NodeAddr,
        cfg: EngineConfig,
        gpu: Arc<dyn Gpu>,
        client: MetaServerClient,
    ) -> Result<Self, EngineError> {
        let pool = if cfg.pool_shared {
            Pool::new_shared(cfg.pool_bytes, cfg.pool_align)?
        } else {
            Pool::new(cfg.pool_bytes, cfg.pool_align)?
        };
        if cfg.pool_prefault {
            pool.prefault()?;
        }
        gpu.register_host(pool.base_ptr(), pool.arena_len())?;
        let (saves_done, _) = watch::channel(0);
        let mut rng = match cfg.seed {
            Some(seed) => rand::rngs::StdRng::seed_from_u64(seed),
            None => rand::rngs::StdRng::from_os_rng(),
        };
        let incarnation = rng.next_u64();
        let (disk, recovered) = match &cfg.disk {
            Some(d) => {
                let (t, keys) = disk::DiskTier::open(d)?;
                (Some(t), keys)
            }
            None => (None, Vec::new()),
        };
        let inner = Arc::new(EngineInner {
            node,
            pool,
            gpu,
            layouts: RwLock::new(Layouts::default()),
            cache: Mutex::new(BlockCache::new()),
            locks: Mutex::new(LockTable::new(limits::TRANSFER_SESSIONS_MAX, incarnation)),
            client: client.clone(),
            transport: OnceLock::new(),
            rng: Mutex::new(rng),
            origin: Instant::now(),
            saves: Mutex::new(SaveTracker::default()),
            saves_done,
            metrics: EngineMetrics::default(),
            peers: peers::PeerTable::default(),
            leases: Mutex::new(leases::DeviceLeases::new()),
            exports: Mutex::new(HashMap::new()),
            disk,
            cfg,
        });
        client.set_ownership_source(Arc::new(Source(Arc::downgrade(&inner))));
        tokio::spawn(lock_gc(Arc::downgrade(&inner)));
        if let Some(d) = &inner.disk {
            // Its own thread: it must submit and reap at the disk's pace
            // however busy this runtime's workers are.
            crate::rt::spawn_on_own_thread("kvferry-disk", disk::drive(Arc::downgrade(&inner), d.wake.clone()));
            // C18: what recovery verified is advertised again.
            if !recovered.is_empty() {
                tokio::spawn(disk::readvertise_recovered(Arc::downgrade(&inner), recovered));
            }
        }
        Ok(Self { inner })
    }

    /// The data-plane access policy over this engine's lock table (for a
    /// transport's server side).
    pub fn data_source(&self) -> Arc<dyn DataSource> {
        Arc::new(LockSource(Arc::downgrade(&self.inner)))
    }

    /// Installs the transport (once, at start).
    pub fn set_transport(&self, t: Arc<dyn Transport>) {
        let _ = self.inner.transport.set(t);
    }

    /// The transport, if installed.
    pub fn transport(&self) -> Option<&Arc<dyn Transport>> {
        self.inner.transport.get()
    }

    /// This node's advertise address.
    pub fn node(&self) -> &NodeAddr {
        &self.inner.node
    }

    /// The registration client.
    pub fn client(&self) -> &MetaServerClient {
        &self.inner.client
    }

    /// The GPU backend.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.inner.gpu
    }

    /// The pinned pool.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// Counters.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.inner.metrics
    }

    /// Gauges now.
    pub fn gauges(&self) -> EngineGauges {
        EngineGauges {
            pool_used_bytes: self.inner.pool.used_bytes(),
            pool_free_bytes: self.inner.pool.free_bytes(),
            resident_blocks: self.inner.cache.lock().expect("cache lock").len() as u64,
            active_transfer_locks: self.inner.locks.lock().expect("locks lock").active() as u64,
        }
    }

    /// Milliseconds since the engine started (runtime clock).
    pub fn now_ms(&self) -> u64 {
        crate::rt::elapsed_ms(self.inner.origin)
    }

    /// Registers `len` bytes of the embedder's memory at `addr` (a device
    /// address on the `cuda` backend, a host address on `host`) as a device
    /// buffer that layouts can name. kvferry never frees it. See
    /// [`Gpu::register_external`] for what is validated.
    ///
    /// One buffer must lie inside one allocation: tensors that overlap share
    /// a buffer, tensors that merely touch share one only inside one
    /// allocation (separate per-layer tensors an allocator placed back to
    /// back do not; `cuda` refuses such a buffer).
    /// [`crate::gpu::group_by_allocation`] groups a set of ranges by that
    /// rule (`docs/layouts.md`, "Which tensors share a buffer").
    ///
    /// # Safety
    /// The range must stay valid and writable, at the same address, until
    /// [`Engine::unregister_buffer`] returned `Ok` for the id (the engine
    /// refuses while a layout names the buffer, the backend while a copy
    /// touches it).
    ///
    /// # Errors
    /// [`EngineError::Gpu`] (null, empty, unaligned, overlapping, not this
    /// device's memory, past its allocation); nothing is registered.
    pub unsafe fn register_buffer(&self, addr: u64, len: u64) -> Result<DeviceBufferId, EngineError> {
        // SAFETY: forwarded to the caller.
        Ok(unsafe { self.inner.gpu.register_external(addr, len) }?)
    }

    /// Forgets a device buffer (C15). After `Ok` the embedder may free the
    /// memory.
    ///
    /// # Errors
    /// [`EngineError::BufferInUse`] while a registered layout names it;
    /// [`EngineError::Gpu`] for an unknown buffer or one an in-flight copy
    /// batch touches (retry after the save or load finished). Nothing
    /// changes on error.
    pub fn unregister_buffer(&self, buffer: DeviceBufferId) -> Result<(), EngineError> {
        // Held across the backend call so no layout naming the buffer can
        // be registered meanwhile.
        let layouts = self.inner.layouts.read().expect("layouts lock");
        if let Some((ns, _)) = layouts
            .live
            .iter()
            .find(|(_, l)| l.names_buffer(buffer))
            .filter(|_| !canary::active(Canary::C15UnregisterInUse))
        {
            return Err(EngineError::BufferInUse { buffer, namespace: ns.to_string() });
        }
        self.inner.gpu.unregister(buffer)?;
        self.forget_export(buffer);
        Ok(())
    }

    /// Registers the layout of a namespace, validated against the device
    /// buffers so later copies cannot go out of bounds. Registering the same
    /// layout again is a no-op.
    ///
    /// # Errors
    /// [`EngineError::Id`], [`EngineError::Layout`] (specific variant),
    /// [`EngineError::NamespaceMismatch`] when a [`crate::hash::KvFamily`]
    /// namespace names another layer count, [`EngineError::LayoutExists`]
    /// for a different layout (unregister the old one first),
    /// [`EngineError::FamilyMismatch`] when the namespace held a layout of
    /// another family.
    pub fn register_layout(&self, namespace: &str, layers: Vec<LayerLayout>) -> Result<(), EngineError> {
        validate_namespace(namespace)?;
        if let Some(named) = crate::hash::namespace_layers(namespace) {
            if named != layers.len() as u64 {
                return Err(EngineError::NamespaceMismatch {
                    namespace: namespace.to_string(),
                    named,
                    given: layers.len(),
                });
            }
        }
        let mut map = self.inner.layouts.write().expect("layouts lock");
        let gpu = self.inner.gpu.clone();
        let layout = Layout::new(layers, |id| gpu.buffer_len(id))?;
        if let Some(existing) = map.live.get(namespace) {
            if existing.layers() == layout.layers() {
                return Ok(());
            }
            return Err(EngineError::LayoutExists(namespace.to_string()));
        }
        let family = layout.family();
        match map.families.get(namespace) {
            Some(had) if *had != family => {
                return Err(EngineError::FamilyMismatch {
                    namespace: namespace.to_string(),
                    had: had.clone(),
                    got: family,
                });
            }
            Some(_) => {}
            None => {
                map.families.insert(Arc::from(namespace), family);
            }
        }
        map.live.insert(Arc::from(namespace), Arc::new(layout));
        Ok(())
    }

    /// Unregisters a namespace's layout so its buffers can be unregistered
    /// or it can be registered anew over other buffers (same family). Saves
    /// and loads already running finish on the old layout (their buffers
    /// stay pinned until their batches complete); new saves, loads, fetches
    /// and peers' lock requests treat the namespace as unknown until a
    /// layout is registered again. The cached blocks stay and are served
    /// again then (the pool format depends only on the family).
    ///
    /// # Errors
    /// [`EngineError::UnknownNamespace`].
    pub fn unregister_layout(&self, namespace: &str) -> Result<(), EngineError> {
        let mut map = self.inner.layouts.write().expect("layouts lock");
        map.live.remove(namespace).ok_or_else(|| EngineError::UnknownNamespace(namespace.to_string()))?;
        // A device lease never outlives the layout it names (C15, C19).
        let now = self.now_ms();
        let ids = self.inner.leases.lock().expect("leases lock").revoke_namespace(namespace, now);
        if !ids.is_empty() {
            let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
            tracing::trace!(
                target: leases::DEVICE_LEASE_TRACE_TARGET,
                owner = %self.node(),
                namespace,
                leases = %ids.join(","),
                now_ms = now,
                "revoked"
            );
        }
        Ok(())
    }

    /// The layout of a namespace.
    ///
    /// # Errors
    /// [`EngineError::UnknownNamespace`].
    pub fn layout(&self, namespace: &str) -> Result<(Arc<str>, Arc<Layout>), EngineError> {
        let map = self.inner.layouts.read().expect("layouts lock");
        map.live
            .get_key_value(namespace)
            .map(|(k, v)| (k.clone(), v.clone()))
            .ok_or_else(|| EngineError::UnknownNamespace(namespace.to_string()))
    }

    fn check_indices<'a>(layout: &Layout, idx: impl Iterator<Item = &'a u64>) -> Result<(), EngineError> {
        let num_blocks = layout.num_blocks();
        for &i in idx {
            if i >= num_blocks {
                return Err(EngineError::BlockIndex { idx: i, num_blocks });
            }
        }
        Ok(())
    }

    /// Allocates `len` pool bytes, evicting LRU blocks (bounded) under
    /// pressure.
    pub(crate) fn alloc(&self, len: u64) -> Result<Extent, EngineError> {
        const EVICTION_ROUNDS_MAX: usize = 8;
        let mut last = None;
        for _ in 0..=EVICTION_ROUNDS_MAX {
            match self.inner.pool.alloc(len) {
                Ok(e) => {
                    self.inner.nudge_evict_ahead();
                    return Ok(e);
                }
                Err(e) => last = Some(e),
            }
            if self.evict(len) == 0 {
                break;
            }
        }
        self.inner.metrics.alloc_failures.fetch_add(1, Ordering::Relaxed);
        Err(EngineError::Pool(last.expect("at least one attempt")))
    }

    /// Evicts unpinned LRU blocks worth at least `bytes` (bounded scan).
    /// With a disk tier each victim is handed to its write-behind queue
    /// and stays advertised when taken; every other victim gets a removal
    /// enqueued (C4). Returns blocks evicted.
    pub fn evict(&self, bytes: u64) -> usize {
        let victims = self.inner.cache.lock().expect("cache lock").evict_blocks(bytes, limits::EVICTION_SCAN_MAX);
        let m = &self.inner.metrics;
        let n = victims.len();
        for (i, ((ns, hash), block)) in victims.into_iter().enumerate() {
            if i + 1 == n && canary::active(Canary::C4RemovalLost) {
                continue; // C4 canary: neither counted nor offered
            }
            m.evicted.fetch_add(1, Ordering::Relaxed);
            if self.write_to_disk(&ns, &hash, &block) {
                m.evicted_to_disk.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            drop(block);
            if self.inner.client.try_unregister(&ns, std::slice::from_ref(&hash)) == 1 {
                m.removals_enqueued.fetch_add(1, Ordering::Relaxed);
            } else {
                m.removals_dropped_at_enqueue.fetch_add(1, Ordering::Relaxed);
            }
        }
        n
    }

    /// Saves blocks: skips resident ones, allocates pool slots, copies
    /// device → pool in copy batches submitted as they are built (growing
    /// from [`limits::COPY_BATCH_OPS_FIRST`] ops), then seals (checksum per
    /// slot, C10, taken by the GPU backend from the device bytes when it
    /// can, else on the CPU), inserts into the cache and enqueues
    /// registrations of the newly resident blocks. A block becomes visible
    /// only once sealed; a failed or racing save leaves nothing behind. The
    /// copy-and-seal part runs inline but is finished on a task of its own
    /// if this future is dropped ([`crate::rt::run_to_completion`]), so a
    /// cancelled caller never abandons a save half way.
    ///
    /// `blocks` pairs each block's hash with its index in the namespace's
    /// layout (the embedder's paged cache), as [`Engine::load`] does.
    ///
    /// # Errors
    /// Validation errors (nothing is saved), [`EngineError::Gpu`] when any
    /// copy batch failed (nothing is saved).
    pub async fn save(&self, namespace: &str, blocks: &[(BlockHash, u64)]) -> Result<SaveReport, EngineError> {
        let called = Instant::now();
        let (ns, layout) = self.layout(namespace)?;
        Self::check_indices(&layout, blocks.iter().map(|(_, i)| i))?;
        for (h, _) in blocks {
            h.validate()?;
        }
        self.inner.metrics.saves.fetch_add(1, Ordering::Relaxed);
        let seq = {
            let mut s = self.inner.saves.lock().expect("saves lock");
            s.next += 1;
            let seq = s.next;
            s.inflight.insert(seq);
            seq
        };
        let guard = SaveGuard { engine: self.inner.clone(), seq };
        let mut report = SaveReport::default();
        let mut todo: Vec<(u64, BlockHash)> = Vec::with_capacity(blocks.len());
        {
            let cache = self.inner.cache.lock().expect("cache lock");
            let mut seen = HashSet::with_capacity(blocks.len());
            for (h, idx) in blocks {
                if cache.contains(&ns, h) || !seen.insert(h.clone()) {
                    report.already_resident += 1;
                } else {
                    todo.push((*idx, h.clone()));
                }
            }
        }
        if todo.is_empty() {
            return Ok(report);
        }
        let engine = self.clone();
        // Finished even if this future is dropped (see above).
        let sealed = crate::rt::run_to_completion(async move {
            let _guard = guard;
            engine.copy_and_seal(&ns, &layout, todo, called).await
        })
        .await
        .map_err(|e| EngineError::Task(e.0))??;
        report.saved = sealed.saved;
        report.already_resident += sealed.raced;
        report.no_space = sealed.no_space;
        Ok(report)
    }

    /// Allocates pool slots for `todo`, submits the device → pool copies in
    /// batches growing from [`limits::COPY_BATCH_OPS_FIRST`] ops (each starts
    /// on the device while the next is prepared), seals each batch's blocks
    /// as it completes (in any order) and — only if every batch landed —
    /// inserts them all into the cache.
    async fn copy_and_seal(
        &self,
        ns: &Arc<str>,
        layout: &Layout,
        todo: Vec<(u64, BlockHash)>,
        called: Instant,
    ) -> Result<Sealed, EngineError> {
        let layers = layout.layers().len();
        let block_bytes = layout.block_bytes();
        let mut no_space = 0;
        // In flight: (first block of the batch in `todo`, completion).
        let mut pending = futures::stream::FuturesUnordered::new();
        let mut batches = 0;
        let mut next = 0;
        let mut submitted = None;
        while next < todo.len() && no_space == 0 {
            let first = next;
            let mut host = Vec::new();
            let mut ops = Vec::new();
            let limits = batch_limits(batches);
            while next < todo.len() && (host.is_empty() || batch_has_room(&ops, host.len(), block_bytes, limits)) {
                let ext = match self.alloc(block_bytes) {
                    Ok(e) => e,
                    Err(EngineError::Pool(_)) => {
                        no_space = todo.len() - next;
                        break;
                    }
                    Err(e) => return Err(e),
                };
                push_block_ops(layout, todo[next].0, host.len(), &mut ops);
                host.push(HostBuf::Writable(ext));
                next += 1;
            }
            if host.is_empty() {
                break;
            }
            let mut batch = CopyBatch::new(Direction::DeviceToHost, ops, host);
            batch.checksums = slot_ranges(layout, batch.host.len());
            submitted.get_or_insert_with(Instant::now);
            let done = self.inner.gpu.submit(batch);
            pending.push(async move { (first, done.await) });
            batches += 1;
        }
        let prepared = submitted.map(|t| t - called).unwrap_or_default();
        let m = &self.inner.metrics;
        let mut failed = None;
        // Each batch is sealed (extent frozen, checksums attached) as it
        // completes, in whatever order, so only the last one's blocks and
        // the cache inserts remain once the last byte landed. The blocks stay
        // invisible until every batch landed; a failed batch drops them all.
        let mut blocks: Vec<Option<CachedBlock>> = (0..next).map(|_| None).collect();
        while let Some((first, done)) = futures::StreamExt::next(&mut pending).await {
            if let Err(e) = done.result {
                failed.get_or_insert(e);
                continue;
            }
            if failed.is_some() {
                continue; // the save fails: its extents just go back to the pool
            }
            let exts: Vec<Extent> = done
                .host
                .into_iter()
                .map(|b| match b {
                    HostBuf::Writable(e) => e,
                    HostBuf::Sealed(_) => unreachable!("save batches hold writable extents"),
                })
                .collect();
            let sums: Vec<Arc<[u32]>> = match done.checksums {
                Some(sums) if sums.len() == exts.len() * layers => {
                    m.device_checksummed_blocks.fetch_add(exts.len() as u64, Ordering::Relaxed);
                    sums.chunks(layers.max(1)).map(Arc::from).collect()
                }
                _ => checksum_blocks(layout, &exts),
            };
            for (slot, (ext, checksums)) in blocks[first..].iter_mut().zip(exts.into_iter().zip(sums)) {
                *slot = Some(CachedBlock { extent: ext.seal(), checksums });
            }
        }
        // A failed batch fails the save: every extent drops back to the pool.
        if let Some(e) = failed {
            return Err(e.into());
        }
        let copied = Instant::now();
        if let Some(t) = submitted {
            m.save_copy_bytes.fetch_add(blocks.len() as u64 * block_bytes, Ordering::Relaxed);
            m.save_copy_ns.fetch_add((copied - t).as_nanos() as u64, Ordering::Relaxed);
        }
        let mut saved = Vec::with_capacity(blocks.len());
        let mut raced = 0;
        {
            let mut cache = self.inner.cache.lock().expect("cache lock");
            for ((_, hash), block) in todo.into_iter().zip(blocks) {
                let block = block.expect("every batch landed, so every block is sealed");
                if cache.insert(ns, hash.clone(), block) {
                    saved.push(hash);
                } else {
                    raced += 1;
                }
            }
        }
        self.advertise(ns, &saved);
        m.saved_blocks.fetch_add(saved.len() as u64, Ordering::Relaxed);
        tracing::debug!(
            blocks = saved.len(),
            prepare_us = prepared.as_micros() as u64,
            copy_us = submitted.map(|t| (copied - t).as_micros() as u64).unwrap_or_default(),
            seal_us = copied.elapsed().as_micros() as u64,
            "save"
        );
        Ok(Sealed { saved, raced, no_space })
    }

    /// Enqueues registrations for newly resident blocks, counting door
    /// drops; returns how many were accepted.
    pub(crate) fn advertise(&self, ns: &str, hashes: &[BlockHash]) -> usize {
        if hashes.is_empty() {
            return 0;
        }
        let accepted = self.inner.client.try_register(ns, hashes);
        let dropped = (hashes.len() - accepted) as u64;
        self.inner.metrics.registrations_dropped_at_enqueue.fetch_add(dropped, Ordering::Relaxed);
        accepted
    }

    /// Seals a fetched block into the cache (used by fetch). Returns `false`
    /// when it was already resident (the extent is then freed).
    pub(crate) fn insert_sealed(&self, ns: &Arc<str>, hash: BlockHash, block: CachedBlock) -> bool {
        self.inner.cache.lock().expect("cache lock").insert(ns, hash, block)
    }

    /// Waits until every save started before this call has sealed (and
    /// enqueued its registrations) or failed.
    pub async fn flush_saves(&self) {
        let target = self.inner.saves.lock().expect("saves lock").next;
        let mut rx = self.inner.saves_done.subscribe();
        loop {
            let done = {
                let s = self.inner.saves.lock().expect("saves lock");
                s.inflight.first().is_none_or(|&first| first > target)
            };
            if done {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// The P/D handoff barrier: [`Engine::flush_saves`], then the MetaServer
    /// flush, all within `deadline`. After it returns, a prefill node may say
    /// "KV ready": every delivered registration is visible to a query (C1),
    /// and the report says how many were dropped (C3).
    pub async fn flush_saves_and_registrations(&self, deadline: Duration) -> FlushReport {
        self.flush_saves_and_registrations_timed(deadline).await.0
    }

    /// [`Engine::flush_saves_and_registrations`], also returning how long
    /// its first half, the save barrier ([`Engine::flush_saves`]), took
    /// (runtime clock; the whole `deadline` when it timed out there). The
    /// rest of the call's time is the registration barrier.
    pub async fn flush_saves_and_registrations_timed(&self, deadline: Duration) -> (FlushReport, Duration) {
        let start = Instant::now();
        if tokio::time::timeout(deadline, self.flush_saves()).await.is_err() {
            return (FlushReport { delivered: 0, dropped: 0, timed_out: true }, start.elapsed());
        }
        let saves = start.elapsed();
        let left = deadline.saturating_sub(saves);
        (self.inner.client.flush_with_deadline(left).await, saves)
    }

    /// How many hashes, from the first, are resident here (a gap ends it).
    /// With a disk tier a block with a record counts too (on disk, or
    /// still being written: the tier reads it from the write's buffer): a
    /// `load`, a fetch or a peer's lock request stages it into the pool.
    pub fn query_prefix(&self, namespace: &str, hashes: &[BlockHash]) -> usize {
        let Ok((ns, layout)) = self.layout(namespace) else { return 0 };
        let cache = self.inner.cache.lock().expect("cache lock");
        match &self.inner.disk {
            None => hashes.iter().take_while(|h| cache.contains(&ns, h)).count(),
            Some(d) => {
                let family = disk::family_id(&layout.family());
                hashes
                    .iter()
                    .take_while(|h| cache.contains(&ns, h) || d.indexed(&disk::block_key(&ns, h, family)))
                    .count()
            }
        }
    }

    /// How many hashes, from the first, are in the pool (disk not
    /// consulted).
    pub fn resident_prefix(&self, namespace: &str, hashes: &[BlockHash]) -> usize {
        let Ok((ns, _)) = self.layout(namespace) else { return 0 };
        let cache = self.inner.cache.lock().expect("cache lock");
        hashes.iter().take_while(|h| cache.contains(&ns, h)).count()
    }

    /// Pins the resident prefix of `hashes` (LRU-touched) until the lease
    /// drops.
    pub fn lease(&self, namespace: &str, hashes: &[BlockHash]) -> Lease {
        let Ok((ns, _)) = self.layout(namespace) else { return Lease { blocks: Vec::new() } };
        let mut cache = self.inner.cache.lock().expect("cache lock");
        let blocks = hashes.iter().map_while(|h| cache.get(&ns, h)).collect();
        Lease { blocks }
    }

    /// Copies blocks pool → device in copy batches submitted as they are
    /// built (as [`Engine::save`]) and reports per-block failure
    /// (`NotResident`, or the copy error of the block's batch).
    ///
    /// # Errors
    /// Validation errors (unknown namespace, index out of range).
    pub async fn load(&self, namespace: &str, blocks: &[(BlockHash, u64)]) -> Result<LoadReport, EngineError> {
        self.load_inner(namespace, blocks, None).await
    }

    /// [`Engine::load`] that submits no copy batch after `deadline`: the
    /// blocks of batches not submitted by then are
    /// [`LoadError::Deadline`] (never copied, the caller's KV blocks
    /// untouched). A batch submitted before it is awaited however long it
    /// takes — it writes the caller's KV blocks (C11, C15) — so the report
    /// says exactly which blocks are on the device. Staging from a disk
    /// tier ends by the deadline too. An embedder's timeout passed down
    /// (the fetch's load tail runs under the fetch's deadline this way).
    ///
    /// # Errors
    /// As [`Engine::load`].
    pub async fn load_with_deadline(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
        deadline: Instant,
    ) -> Result<LoadReport, EngineError> {
        self.load_inner(namespace, blocks, Some(deadline)).await
    }

    async fn load_inner(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
        until: Option<Instant>,
    ) -> Result<LoadReport, EngineError> {
        let called = Instant::now();
        let (ns, layout) = self.layout(namespace)?;
        Self::check_indices(&layout, blocks.iter().map(|(_, i)| i))?;
        self.inner.metrics.loads.fetch_add(1, Ordering::Relaxed);
        let past = |now: Instant| until.is_some_and(|u| now >= u);
        // Held (with a tier) until the leases below are taken.
        let _staged = match &self.inner.disk {
            Some(d) => {
                let hashes: Vec<BlockHash> = blocks.iter().map(|(h, _)| h.clone()).collect();
                let stage_until = Instant::now() + d.stage_deadline;
                self.stage(&ns, &layout, &hashes, false, until.map_or(stage_until, |u| u.min(stage_until))).await.1
            }
            None => Vec::new(),
        };
        let mut results: Vec<Result<(), LoadError>> = Vec::with_capacity(blocks.len());
        // Leases on the resident blocks (the cache lock is held only here).
        let mut hits: Vec<(usize, SealedExtent, u64)> = Vec::with_capacity(blocks.len());
        {
            let mut cache = self.inner.cache.lock().expect("cache lock");
            for (i, (hash, idx)) in blocks.iter().enumerate() {
                match cache.get(&ns, hash) {
                    Some(b) => {
                        hits.push((i, b.extent, *idx));
                        results.push(Ok(()));
                    }
                    None => results.push(Err(LoadError::NotResident)),
                }
            }
        }
        // Batches submitted as they are built (see `limits::COPY_BATCH_OPS_FIRST`).
        let block_bytes = layout.block_bytes();
        let mut pending = Vec::new();
        let mut hits = hits.into_iter().peekable();
        let submitted = Instant::now();
        while hits.peek().is_some() {
            if past(Instant::now()) {
                // C9: nothing is submitted after the deadline.
                for (i, _, _) in hits.by_ref() {
                    results[i] = Err(LoadError::Deadline);
                }
                break;
            }
            let (mut host, mut ops, mut which) = (Vec::new(), Vec::new(), Vec::new());
            let limits = batch_limits(pending.len() as u32);
            while let Some((i, ext, idx)) =
                hits.next_if(|_| host.is_empty() || batch_has_room(&ops, host.len(), block_bytes, limits))
            {
                push_block_ops(&layout, idx, host.len(), &mut ops);
                host.push(HostBuf::Sealed(ext));
                which.push(i);
            }
            pending.push((which, self.inner.gpu.submit(CopyBatch::new(Direction::HostToDevice, ops, host))));
        }
        if !pending.is_empty() {
            let prepared = submitted - called;
            let mut bytes = 0;
            for (which, done) in pending {
                let done = done.await;
                match done.result {
                    Ok(()) => bytes += which.len() as u64 * block_bytes,
                    Err(e) => {
                        for i in which {
                            results[i] = Err(LoadError::Copy(e.clone()));
                        }
                    }
                }
            }
            let m = &self.inner.metrics;
            m.load_copy_bytes.fetch_add(bytes, Ordering::Relaxed);
            m.load_copy_ns.fetch_add(submitted.elapsed().as_nanos() as u64, Ordering::Relaxed);
            tracing::debug!(
                blocks = bytes / block_bytes.max(1),
                prepare_us = prepared.as_micros() as u64,
                copy_us = submitted.elapsed().as_micros() as u64,
                "load"
            );
        }
        let report = LoadReport { results };
        let ok = report.loaded() as u64;
        self.inner.metrics.loaded_blocks.fetch_add(ok, Ordering::Relaxed);
        self.inner.metrics.load_failures.fetch_add(blocks.len() as u64 - ok, Ordering::Relaxed);
        Ok(report)
    }

    /// Resident blocks per namespace (the backfill source, C6).
    /// With a disk tier, also every block whose record is on disk (C18).
    pub fn resident_blocks(&self) -> Vec<(String, Vec<BlockHash>)> {
        self.inner.resident_blocks()
    }

    /// Locks exactly the resident blocks among `hashes` for a peer's read
    /// (C8): returns the new session id (None when nothing was found) and the
    /// found blocks in request order.
    ///
    /// # Errors
    /// [`EngineError::Lock`] when the table is full.
    pub fn lock_for_transfer(&self, namespace: &str, hashes: &[BlockHash]) -> Result<TransferLock, EngineError> {
        let Ok((ns, _)) = self.layout(namespace) else { return Ok((None, Vec::new())) };
        let found: Vec<(BlockHash, CachedBlock)> = {
            let mut cache = self.inner.cache.lock().expect("cache lock");
            hashes.iter().filter_map(|h| cache.get(&ns, h).map(|b| (h.clone(), b))).collect()
        };
        if found.is_empty() {
            return Ok((None, Vec::new()));
        }
        let secret = {
            let mut b = [0u8; 16];
            self.inner.rng.lock().expect("rng lock").fill_bytes(&mut b);
            u128::from_le_bytes(b)
        };
        // C16 canary: no secret either.
        let secret = if canary::active(Canary::C16SessionIdsRepeat) { 0 } else { secret };
        let now = self.now_ms();
        let timeout_ms = u64::from(self.inner.cfg.lock_timeout_secs) * 1000;
        let id = {
            let mut locks = self.inner.locks.lock().expect("locks lock");
            let id = locks.next_id(secret);
            let mut pin = found.clone();
            if pin.len() > 1 && canary::active(Canary::C8PinsTooFew) {
                pin.pop(); // C8 canary: the last found block is not pinned
            }
            locks.create(id.clone(), pin, now, timeout_ms)?;
            id
        };
        self.inner.metrics.transfer_locks_created.fetch_add(1, Ordering::Relaxed);
        // The simulator collects these events to check that no id is ever
        // granted twice in a run (C16).
        tracing::trace!(
            target: TRANSFER_SESSION_TRACE_TARGET,
            session = %id,
            blocks = found.len(),
            owner = %self.node(),
            now_ms = now,
            expires_at_ms = now + timeout_ms,
            "granted"
        );
        // The simulator compares what the lock table pinned with what was
        // requested and found (C8 "pins exactly the found blocks").
        if tracing::enabled!(target: TRANSFER_PINS_TRACE_TARGET, tracing::Level::TRACE) {
            let short = |h: &BlockHash| hex::encode(&h.as_bytes()[..8]);
            let join = |v: &mut dyn Iterator<Item = String>| v.collect::<Vec<_>>().join(",");
            let pinned = self.inner.locks.lock().expect("locks lock").pinned(&id);
            tracing::trace!(
                target: TRANSFER_PINS_TRACE_TARGET,
                session = %id,
                requested = %join(&mut hashes.iter().map(short)),
                found = %join(&mut found.iter().map(|(h, _)| short(h))),
                pinned = %join(&mut pinned.iter().map(short)),
                "pinned"
            );
        }
        Ok((Some(id), found))
    }

    /// Releases a transfer session; idempotent (an unknown id of this
    /// incarnation releases 0).
    ///
    /// # Errors
    /// [`AccessError::ForeignSession`] for an id this engine incarnation did
    /// not issue (another node's, or a previous process's on the same
    /// address): nothing is released (C16).
    pub fn release_transfer(&self, session: &str) -> Result<usize, AccessError> {
        let r = self.inner.locks.lock().expect("locks lock").release(session);
        if r.is_ok() {
            self.release_device_leases(session);
        }
        // The simulator counts the releases each session gets (C8: exactly
        // one, by its requester).
        tracing::trace!(
            target: TRANSFER_RELEASE_TRACE_TARGET,
            session,
            now_ms = self.now_ms(),
            released = r.as_ref().map_or(0, |n| *n),
            "release received"
        );
        r
    }

    /// Lock timeout in seconds.
    pub fn lock_timeout_secs(&self) -> u32 {
        self.inner.cfg.lock_timeout_secs
    }

    /// Latest expiry among live transfer sessions (ms on the engine clock).
    pub fn transfer_locks_max_expiry_ms(&self) -> Option<u64> {
        self.inner.locks.lock().expect("locks lock").max_expiry_ms()
    }

    /// Configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }
}

/// `tracing` target of the trace-level event each granted transfer session
/// emits (field `session`): how the simulator sees every id granted in a run.
pub const TRANSFER_SESSION_TRACE_TARGET: &str = "kvferry::transfer_session";

/// `tracing` target of the trace-level event each granted transfer session
/// emits with the short hashes it was asked for (`requested`), found
/// resident (`found`) and the lock table then held pinned (`pinned`), comma
/// separated: how the simulator checks that a lock pins exactly the found
/// blocks (C8). Computed only while a subscriber listens at trace level.
pub const TRANSFER_PINS_TRACE_TARGET: &str = "kvferry::transfer_pins";

/// `tracing` target of the trace-level event an owner emits for every
/// `ReleaseTransferLock` it receives (fields `session`, `now_ms`,
/// `released`): how the simulator counts each session's releases (C8).
pub const TRANSFER_RELEASE_TRACE_TARGET: &str = "kvferry::transfer_release";

/// `tracing` target of the trace-level event the lock GC emits for each
/// session it expires (fields `session`, `now_ms`): how the simulator tells
/// a lock that ended by expiry from one its requester released (C8).
pub const TRANSFER_EXPIRED_TRACE_TARGET: &str = "kvferry::transfer_expired";

/// `tracing` target of the trace-level event the data plane's access policy
/// emits for every read it authorizes or refuses (fields `session`,
/// `now_ms` on the owner's engine clock, `ok`): how the simulator checks
/// that no byte is served under an expired or released session (C13/C16).
pub const DATA_ACCESS_TRACE_TARGET: &str = "kvferry::data_access";

/// What [`Engine::copy_and_seal`] did.
struct Sealed {
    saved: Vec<BlockHash>,
    raced: usize,
    no_space: usize,
}

/// The size limits of the `n`th copy batch of a save or load (0-based):
/// `(ops, bytes)`, doubling from the first batch's (see
/// [`limits::COPY_BATCH_OPS_FIRST`]).
fn batch_limits(n: u32) -> (usize, u64) {
    let grow = 1u64 << n.min(20);
    (
        (limits::COPY_BATCH_OPS_FIRST as u64).saturating_mul(grow).min(limits::COPY_BATCH_OPS_MAX as u64) as usize,
        limits::COPY_BATCH_BYTES_FIRST.saturating_mul(grow).min(limits::COPY_BATCH_BYTES_MAX),
    )
}

/// Whether a copy batch holding `ops` for `blocks` blocks takes one more
/// block under `limits` (from [`batch_limits`]).
fn batch_has_room(ops: &[CopyOp], blocks: usize, block_bytes: u64, limits: (usize, u64)) -> bool {
    ops.len() < limits.0 && (blocks as u64 + 1) * block_bytes <= limits.1
}

/// The seal checksum ranges of `blocks` block extents of `layout` (one per
/// slot, in the order [`slot_checksums`] returns them), for a save batch.
pub(crate) fn slot_ranges(layout: &Layout, blocks: usize) -> Vec<ChecksumRange> {
    (0..blocks)
        .flat_map(|extent| {
            (0..layout.layers().len()).map(move |l| ChecksumRange {
                extent,
                offset: layout.slot_offset(l),
                len: layout.slot_bytes(l),
            })
        })
        .collect()
}

/// Appends the coalesced copies of block `idx` of `layout`, against host
/// extent `extent` of the batch being built.
pub(crate) fn push_block_ops(layout: &Layout, idx: u64, extent: usize, ops: &mut Vec<CopyOp>) {
    ops.extend(layout.coalesced_copies(idx).into_iter().map(|c| CopyOp {
        buffer: c.buffer,
        device_offset: c.device_offset,
        extent,
        host_offset: c.host_offset_in_block,
        len: c.len,
    }));
}

/// Bytes of blocks above which seal-time checksums are computed on several
/// threads: CRC-32C runs at ~10 GB/s per core, a GPU copies at ~55 GB/s, so
/// one core would be the save bottleneck.
const PARALLEL_CHECKSUM_BYTES_MIN: u64 = 16 << 20;

/// Seal-time checksums of many blocks, in order; spread over up to 16
/// threads for large batches ([`crate::rt::map_parts`]).
pub fn checksum_blocks(layout: &Layout, blocks: &[Extent]) -> Vec<Arc<[u32]>> {
    let total: u64 = blocks.iter().map(|e| e.len()).sum();
    let threads = if total >= PARALLEL_CHECKSUM_BYTES_MIN { crate::rt::cpu_parallelism().min(16) } else { 1 };
    let per = blocks.len().div_ceil(threads.max(1)).max(1);
    let parts: Vec<&[Extent]> = blocks.chunks(per).collect();
    crate::rt::map_parts(parts, |c| c.iter().map(|e| slot_checksums(layout, e.as_slice())).collect::<Vec<_>>())
        .into_iter()
        .flatten()
        .collect()
}

/// CRC-32C of each slot (layer) of a block laid out per `layout`.
pub fn slot_checksums(layout: &Layout, block: &[u8]) -> Arc<[u32]> {
    (0..layout.layers().len())
        .map(|l| {
            let off = layout.slot_offset(l) as usize;
            let len = layout.slot_bytes(l) as usize;
            crc32c::crc32c(&block[off..off + len])
        })
        .collect()
}

async fn lock_gc(engine: Weak<EngineInner>) {
    loop {
        let period = match engine.upgrade() {
            Some(e) => e.cfg.lock_gc_interval,
            None => return,
        };
        tokio::time::sleep(period).await;
        let Some(e) = engine.upgrade() else { return };
        let now = crate::rt::elapsed_ms(e.origin);
        let gone = e.locks.lock().expect("locks lock").expire_ids(now);
        e.leases.lock().expect("leases lock").expire(now);
        for session in &gone {
            tracing::trace!(target: TRANSFER_EXPIRED_TRACE_TARGET, session = %session, now_ms = now, "expired");
        }
        let n = gone.len();
        if n > 0 {
            e.metrics.transfer_locks_expired.fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(expired = n, "transfer locks expired");
        }
    }
}

impl Engine {
    /// Peers with a completed handshake (single-flight: one per peer).
    pub fn handshaken_peers(&self) -> usize {
        self.inner.peers.handshaken()
    }
}
