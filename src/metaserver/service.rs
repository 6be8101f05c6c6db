//! gRPC MetaServer service (package `pegaflow`, wire-compatible with
//! PegaFlow; see wire.md) and its start-up entry.

use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::store::{HeartbeatOutcome, MetaStore, StoreConfig, StoreError};
use crate::limits;
use crate::proto::meta_server_server::{MetaServer, MetaServerServer};
use crate::proto::*;
use crate::status::{GrpcCode, to_status};
use crate::types::{BlockHash, IdError, NodeAddr, SessionId, validate_namespace};

/// Why the MetaServer service refused a request. Every refusal is one of
/// these, turned into its status by [`to_status`]; the code per RPC is the
/// table in `docs/wire.md`, pinned by `tests/metaserver_client.rs` and, per
/// variant, by `tests/status_codes.rs`.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A malformed node address, session id, namespace or hash.
    #[error(transparent)]
    Id(#[from] IdError),
    /// A query with no hashes.
    #[error("empty query: block_hashes has no entries")]
    EmptyQuery,
    /// More than `HASHES_PER_REQUEST_MAX` hashes in one request.
    #[error("{got} hashes in one request; the limit is {max}")]
    TooManyHashes {
        /// Hashes in the request.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// The store refused the write or heartbeat (sessions, C5).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The store panicked on this request (it was recovered; the server
    /// keeps serving).
    #[error("the metaserver failed on this request (store fault); it keeps serving")]
    StoreFault,
    /// The runtime ended under an offloaded write.
    #[error("metaserver write not completed: {0}")]
    WriteNotCompleted(String),
    /// Fault hook: the request arrived during a stall.
    #[error("request arrived during a stall (fault hook); not served")]
    Stalled,
    /// Fault hook: the registration was dropped.
    #[error("registration dropped by fault hook")]
    Dropped,
    /// Fault hook: the write names the rejected hash.
    #[error("hash {0:?} rejected")]
    HashRejected(BlockHash),
}

impl ServiceError {
    /// The stable code of this error (`docs/design.md`, "Errors"); an id or
    /// store error answers its own code.
    pub fn code(&self) -> &'static str {
        match self {
            ServiceError::Id(e) => e.code(),
            ServiceError::EmptyQuery => "metaserver_empty_query",
            ServiceError::TooManyHashes { .. } => "metaserver_too_many_hashes",
            ServiceError::Store(e) => e.code(),
            ServiceError::StoreFault => "metaserver_store_fault",
            ServiceError::WriteNotCompleted(_) => "metaserver_write_not_completed",
            ServiceError::Stalled => "metaserver_stalled",
            ServiceError::Dropped => "metaserver_dropped",
            ServiceError::HashRejected(_) => "metaserver_hash_rejected",
        }
    }
}

/// Bad input is `INVALID_ARGUMENT`, a session refusal
/// `FAILED_PRECONDITION` ([`StoreError`]), a store fault `INTERNAL`, and a
/// request not served (stall, drop, runtime ending) `UNAVAILABLE`.
impl GrpcCode for ServiceError {
    fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            ServiceError::Id(_)
            | ServiceError::EmptyQuery
            | ServiceError::TooManyHashes { .. }
            | ServiceError::HashRejected(_) => Code::InvalidArgument,
            ServiceError::Store(e) => e.grpc_code(),
            ServiceError::StoreFault => Code::Internal,
            ServiceError::WriteNotCompleted(_) | ServiceError::Stalled | ServiceError::Dropped => Code::Unavailable,
        }
    }
}

/// [`to_status`] of a [`ServiceError`] (or anything that converts into one).
fn refuse(e: impl Into<ServiceError>) -> Status {
    to_status(e.into())
}

/// MetaServer settings (the `kvferry metaserver` flags).
#[derive(Clone, Debug)]
pub struct MetaServerConfig {
    /// gRPC listen address.
    pub addr: SocketAddr,
    /// A node silent for longer is invisible (s).
    pub stale_after_secs: u64,
    /// A node silent for longer is deleted by the sweep (s).
    pub ttl_secs: u64,
    /// Sweep period (s).
    pub sweep_interval_secs: u64,
    /// Seed of the fault hooks' RNG (deterministic drops under a seed).
    pub seed: u64,
    /// Distinct block hashes each namespace's index is sized for up front
    /// (see [`MetaStore::with_capacity`]; at most
    /// [`limits::METASERVER_CAPACITY_HASHES_MAX`]). 0: grow on demand.
    pub capacity_hashes: u64,
    /// Store shards, each with its own lock (see [`MetaStore`]): 1 to
    /// [`limits::METASERVER_SHARDS_MAX`]; default
    /// [`limits::METASERVER_SHARDS_DEFAULT`].
    pub shards: usize,
    /// I/O threads serving the gRPC connections, each a single-threaded
    /// runtime its connections stay on (see
    /// [`crate::rt::serve_on_io_threads`]); 0 to
    /// [`limits::METASERVER_IO_THREADS_MAX`]. 0 (the library's default):
    /// serve on the caller's tokio runtime, starting no thread. `kvferry
    /// metaserver` defaults to [`limits::metaserver_io_threads_default`] of
    /// the host's cores.
    /// Ignored under the simulator.
    pub io_threads: usize,
    /// Serve TLS with this certificate and key (needs the `tls` feature;
    /// see [`crate::tls`]). `None`: plain text.
    pub tls: Option<crate::tls::TlsIdentity>,
}

impl MetaServerConfig {
    /// Defaults from [`crate::limits`] on `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            stale_after_secs: limits::STALE_AFTER_SECS_DEFAULT,
            ttl_secs: limits::NODE_TTL_SECS_DEFAULT,
            sweep_interval_secs: limits::SWEEP_INTERVAL_SECS_DEFAULT,
            seed: 0,
            capacity_hashes: 0,
            shards: limits::METASERVER_SHARDS_DEFAULT,
            io_threads: 0,
            tls: None,
        }
    }
}

/// Fault-injection switches (tests, the simulator and `kvferry pd
/// --drop-registrations`). All off by default; cheap atomics on the hot path.
#[derive(Debug, Default)]
pub struct MetaServerHooks {
    /// While set, every RPC waits (accepts, never answers) — a stalled
    /// server. RPCs caught by a stall fail with `UNAVAILABLE` when it lifts
    /// and are never applied (as if their clients had reset them).
    pub stall: AtomicBool,
    /// Fraction (per million) of insert/remove RPCs answered `UNAVAILABLE`
    /// without touching the store: lost registrations.
    pub drop_writes_ppm: AtomicU32,
    /// A hash the server permanently rejects with `INVALID_ARGUMENT`
    /// (poison hash for the ack-on-drop test).
    pub reject_hash: Mutex<Option<BlockHash>>,
    /// Writes dropped by `drop_writes_ppm`.
    pub dropped_writes: AtomicU64,
    /// The next this-many store operations (any RPC, or the sweep) panic
    /// before touching the store: a fault
    /// injected to prove one failed request does not take the service down
    /// (the request answers `INTERNAL`, the service keeps serving).
    pub panic_store_ops: AtomicU32,
}

/// Counters a `/metrics` exporter reads.
#[derive(Debug, Default)]
pub struct MetaServerMetrics {
    /// Heartbeats answered OK.
    pub heartbeats: AtomicU64,
    /// Hashes newly inserted.
    pub inserted_hashes: AtomicU64,
    /// Ownerships removed.
    pub removed_hashes: AtomicU64,
    /// Prefix queries answered.
    pub queries: AtomicU64,
    /// Requests rejected with an error status.
    pub rejected: AtomicU64,
    /// Nodes removed by the TTL sweep.
    pub swept_nodes: AtomicU64,
    /// Store operations that panicked (a request answered `INTERNAL`, or a
    /// sweep skipped); the service kept serving.
    pub store_panics: AtomicU64,
    /// Times recovery found a store lock poisoned (a panic while it was
    /// held) and cleared it.
    pub poison_recoveries: AtomicU64,
    /// Times a fault left the store inconsistent and it was reset to empty
    /// (clients then re-heartbeat and backfill, as after a restart: C6).
    pub store_resets: AtomicU64,
    /// Hashes an insert could not record because the index could not grow
    /// (the allocator refused the memory); the insert answered `ok: false`
    /// naming the count, and the server kept serving.
    pub inserts_refused_no_memory: AtomicU64,
}

/// The tonic service. Cheap to clone.
#[derive(Clone)]
pub struct MetaServerService {
    store: MetaStore,
    origin: Instant,
    stale_after_secs: u64,
    hooks: Arc<MetaServerHooks>,
    metrics: Arc<MetaServerMetrics>,
    rng: Arc<Mutex<rand::rngs::SmallRng>>,
}

/// After a fault (a caught panic in a store call): [`MetaStore::recover`]
/// clears any poison and keeps the store if its indices agree, else resets
/// it to empty — a state the system already recovers from (clients
/// re-heartbeat and backfill, C6). Counted in
/// [`MetaServerMetrics::poison_recoveries`] and
/// [`MetaServerMetrics::store_resets`].
fn recover_store(store: &MetaStore, metrics: &MetaServerMetrics) {
    let r = store.recover();
    if r.poisoned {
        metrics.poison_recoveries.fetch_add(1, Ordering::Relaxed);
    }
    if let Some(e) = r.reset {
        tracing::error!(error = %e, "resetting the metaserver store to empty after a fault");
        metrics.store_resets.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs `op` on the store; a panic inside it (a bug, the
/// [`MetaServerHooks::panic_store_ops`] fault, or a lock another request
/// left poisoned, see [`crate::metaserver::store::POISONED`]) is caught:
/// the store is recovered ([`recover_store`]), the panic counted in
/// [`MetaServerMetrics::store_panics`], and `Err(())` returned for the
/// caller to refuse just that request. Later requests are served as usual.
fn guarded<T>(
    store: &MetaStore,
    hooks: &MetaServerHooks,
    metrics: &MetaServerMetrics,
    op: impl FnOnce(&MetaStore) -> T,
) -> Result<T, ()> {
    let res = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let injected =
            hooks.panic_store_ops.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
        if injected {
            panic!("injected store fault (MetaServerHooks::panic_store_ops)");
        }
        op(store)
    }));
    res.map_err(|_| {
        metrics.store_panics.fetch_add(1, Ordering::Relaxed);
        recover_store(store, metrics);
    })
}

/// Runs a read-only `op` (the exporter's, an embedder's: `stats`,
/// `visible_entries`, …) on `store`, recovering it ([`MetaStore::recover`],
/// counted in `metrics`) and retrying once if a fault left it poisoned.
/// `None` if `op` panics again.
pub fn read_store<T>(store: &MetaStore, metrics: &MetaServerMetrics, op: impl Fn(&MetaStore) -> T) -> Option<T> {
    for _ in 0..2 {
        match std::panic::catch_unwind(AssertUnwindSafe(|| op(store))) {
            Ok(v) => return Some(v),
            Err(_) => recover_store(store, metrics),
        }
    }
    None
}

impl MetaServerService {
    /// [`guarded`] on this service's store: a panicking operation answers
    /// `INTERNAL` (counted as rejected too) and the service keeps serving.
    fn with_store<T>(&self, op: impl FnOnce(&MetaStore) -> T) -> Result<T, Status> {
        guarded(&self.store, &self.hooks, &self.metrics, op).or_else(|()| self.reject(refuse(ServiceError::StoreFault)))
    }

    fn now_ms(&self) -> u64 {
        crate::rt::elapsed_ms(self.origin)
    }

    /// The `stall` hook. An RPC that meets a stall is never served: it
    /// waits until the stall lifts, then fails with `UNAVAILABLE` without
    /// touching the store. A real tonic server drops the handler of a
    /// request whose client gave up (stream reset); releasing gated writes
    /// instead let a write the client had already counted as dropped land
    /// after a newer one (a stale removal undid a delivered insert: C1,
    /// found by the simulator, which does not propagate cancellation).
    async fn gate(&self) -> Result<(), Status> {
        if !self.hooks.stall.load(Ordering::Relaxed) {
            return Ok(());
        }
        while self.hooks.stall.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(refuse(ServiceError::Stalled))
    }

    fn drop_write(&self) -> bool {
        let ppm = self.hooks.drop_writes_ppm.load(Ordering::Relaxed);
        if ppm == 0 {
            return false;
        }
        let roll: u32 = self.rng.lock().unwrap_or_else(PoisonError::into_inner).random_range(0..1_000_000);
        if roll < ppm {
            self.hooks.dropped_writes.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    fn reject<T>(&self, s: Status) -> Result<T, Status> {
        self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        Err(s)
    }

    /// The shared path of insert and remove: validate everything (all or
    /// nothing), apply the fault hook, then run `op` on the store. A write
    /// of at least [`limits::METASERVER_OFFLOAD_HASHES`] hashes runs on the
    /// blocking pool ([`crate::rt::run_blocking`]), so the thread serving the connection goes on
    /// answering others meanwhile; once started it completes even if the
    /// client gives up (as a write run in place does). Every rejection is
    /// counted.
    async fn apply_write<T: Send + 'static>(
        &self,
        namespace: String,
        hashes: Vec<bytes::Bytes>,
        node: &str,
        node_id: &str,
        op: impl FnOnce(&MetaStore, &str, &[BlockHash], &NodeAddr, &SessionId, u64) -> Result<T, StoreError>
        + Send
        + 'static,
    ) -> Result<T, Status> {
        let (node, session, hashes) = match self.check_write(&namespace, hashes, node, node_id) {
            Ok(v) => v,
            Err(s) => return self.reject(s),
        };
        if self.drop_write() {
            return Err(refuse(ServiceError::Dropped));
        }
        let now = self.now_ms();
        let offload = hashes.len() >= limits::METASERVER_OFFLOAD_HASHES;
        let write = move |svc: &Self| svc.with_store(|st| op(st, &namespace, &hashes, &node, &session, now));
        let res = if offload {
            let svc = self.clone();
            match crate::rt::run_blocking(move || write(&svc)).await {
                Ok(res) => res,
                // `with_store` catches the store's panics; this is the
                // runtime shutting down under the write.
                Err(e) => self.reject(refuse(ServiceError::WriteNotCompleted(e.0))),
            }
        } else {
            write(self)
        };
        res?.or_else(|e| self.reject(refuse(e)))
    }

    /// Validates a write's identity, namespace and hashes: all or nothing.
    fn check_write(
        &self,
        namespace: &str,
        hashes: Vec<bytes::Bytes>,
        node: &str,
        node_id: &str,
    ) -> Result<(NodeAddr, SessionId, Vec<BlockHash>), Status> {
        let (node, session) = identity(node, node_id)?;
        validate_namespace(namespace).map_err(refuse)?;
        let hashes = check_hashes(hashes)?;
        if let Some(poison) = self.hooks.reject_hash.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            if hashes.contains(poison) {
                return Err(refuse(ServiceError::HashRejected(poison.clone())));
            }
        }
        Ok((node, session, hashes))
    }
}

/// Parses a request's `node` (advertise address) and `node_id` (session).
fn identity(node: &str, node_id: &str) -> Result<(NodeAddr, SessionId), Status> {
    let node = NodeAddr::parse(node).map_err(refuse)?;
    let session = SessionId::parse(node_id).map_err(refuse)?;
    Ok((node, session))
}

/// Validates a hash list: at most `HASHES_PER_REQUEST_MAX`, each well formed.
/// Takes the request's list by value and rewraps it in place (`BlockHash` is
/// a newtype over `Bytes`): no allocation and no reference-count traffic per
/// hash on the hot insert path.
fn check_hashes(hashes: Vec<bytes::Bytes>) -> Result<Vec<BlockHash>, Status> {
    if hashes.len() > limits::HASHES_PER_REQUEST_MAX {
        return Err(refuse(ServiceError::TooManyHashes { got: hashes.len(), max: limits::HASHES_PER_REQUEST_MAX }));
    }
    let hashes: Vec<BlockHash> = hashes.into_iter().map(BlockHash).collect();
    if let Some(bad) = hashes.iter().find_map(|h| h.validate().err()) {
        return Err(refuse(bad));
    }
    Ok(hashes)
}

#[tonic::async_trait]
impl MetaServer for MetaServerService {
    async fn heartbeat_node(
        &self,
        request: Request<HeartbeatNodeRequest>,
    ) -> Result<Response<HeartbeatNodeResponse>, Status> {
        self.gate().await?;
        let r = request.into_inner();
        let (node, session) = match identity(&r.node, &r.node_id) {
            Ok(v) => v,
            Err(e) => return self.reject(e),
        };
        let now = self.now_ms();
        let outcome = self.with_store(|st| st.heartbeat(&node, &session, now))?;
        match outcome {
            Ok(o) => {
                self.metrics.heartbeats.fetch_add(1, Ordering::Relaxed);
                Ok(Response::new(HeartbeatNodeResponse {
                    stale_after_secs: self.stale_after_secs,
                    new_session: !matches!(o, HeartbeatOutcome::Refreshed),
                }))
            }
            Err(e) => self.reject(refuse(e)),
        }
    }

    async fn unregister_node(
        &self,
        request: Request<UnregisterNodeRequest>,
    ) -> Result<Response<UnregisterNodeResponse>, Status> {
        self.gate().await?;
        let r = request.into_inner();
        let (node, session) = match identity(&r.node, &r.node_id) {
            Ok(v) => v,
            Err(e) => return self.reject(e),
        };
        let removed_owners = self.with_store(|st| st.unregister(&node, &session))?;
        Ok(Response::new(UnregisterNodeResponse { removed_owners }))
    }

    async fn insert_block_hashes(
        &self,
        request: Request<InsertBlockHashesRequest>,
    ) -> Result<Response<InsertBlockHashesResponse>, Status> {
        self.gate().await?;
        let mut r = request.into_inner();
        let hashes = std::mem::take(&mut r.block_hashes);
        let namespace = std::mem::take(&mut r.namespace);
        let out = self.apply_write(namespace, hashes, &r.node, &r.node_id, MetaStore::insert).await?;
        self.metrics.inserted_hashes.fetch_add(out.inserted, Ordering::Relaxed);
        let status = if out.refused_no_memory == 0 {
            ResponseStatus { ok: true, message: String::new() }
        } else {
            self.metrics.inserts_refused_no_memory.fetch_add(out.refused_no_memory, Ordering::Relaxed);
            ResponseStatus {
                ok: false,
                message: format!(
                    "{} of the hashes were not recorded: the index could not grow (out of memory)",
                    out.refused_no_memory
                ),
            }
        };
        Ok(Response::new(InsertBlockHashesResponse {
            status: Some(status),
            inserted_count: out.inserted,
            reclaimable_hashes: out.reclaimable.into_iter().map(|h| h.0).collect(),
        }))
    }

    async fn remove_block_hashes(
        &self,
        request: Request<RemoveBlockHashesRequest>,
    ) -> Result<Response<RemoveBlockHashesResponse>, Status> {
        self.gate().await?;
        let mut r = request.into_inner();
        let hashes = std::mem::take(&mut r.block_hashes);
        let namespace = std::mem::take(&mut r.namespace);
        let removed_count = self.apply_write(namespace, hashes, &r.node, &r.node_id, MetaStore::remove).await?;
        self.metrics.removed_hashes.fetch_add(removed_count, Ordering::Relaxed);
        Ok(Response::new(RemoveBlockHashesResponse {
            status: Some(ResponseStatus { ok: true, message: String::new() }),
            removed_count,
        }))
    }

    async fn query_prefix_blocks(
        &self,
        request: Request<QueryPrefixBlocksRequest>,
    ) -> Result<Response<QueryPrefixBlocksResponse>, Status> {
        self.gate().await?;
        let mut r = request.into_inner();
        if r.block_hashes.is_empty() {
            return self.reject(refuse(ServiceError::EmptyQuery));
        }
        if let Err(e) = validate_namespace(&r.namespace) {
            return self.reject(refuse(e));
        }
        let hashes = match check_hashes(std::mem::take(&mut r.block_hashes)) {
            Ok(h) => h,
            Err(s) => return self.reject(s),
        };
        let now = self.now_ms();
        let owners = self.with_store(|st| st.query_prefix(&r.namespace, &hashes, now))?;
        self.metrics.queries.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(QueryPrefixBlocksResponse {
            nodes: owners.into_iter().map(|(node, prefix_len)| NodePrefixResult { node: node.0, prefix_len }).collect(),
        }))
    }
}

/// A running MetaServer.
pub struct MetaServerHandle {
    /// The bound gRPC address.
    pub local_addr: SocketAddr,
    /// The store. [`MetaStore`] is a handle that locks itself; the `Mutex`
    /// guards only this copy of the handle — lock it just to clone the
    /// handle out. Not public: embedders read [`MetaServerHandle::stats`];
    /// the simulator's checker reads it through
    /// [`MetaServerHandle::store_for_testing`].
    pub(crate) store: Arc<Mutex<MetaStore>>,
    /// Fault switches.
    pub hooks: Arc<MetaServerHooks>,
    /// Counters.
    pub metrics: Arc<MetaServerMetrics>,
    shutdown: watch::Sender<bool>,
    serve: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    sweep: tokio::task::JoinHandle<()>,
}

/// Why a MetaServer stopped serving other than by
/// [`MetaServerHandle::shutdown`]'s request.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The gRPC transport failed while serving (the source is the
    /// transport's own error).
    #[error("metaserver serving failed: {0}")]
    Transport(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl ServeError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::Transport(_) => "metaserver_serve",
        }
    }
}

/// The serving task's end as the handle reports it; a task that was
/// cancelled or panicked (the join error, of whichever runtime) counts as
/// stopped.
fn serve_result<J>(r: Result<Result<(), tonic::transport::Error>, J>) -> Result<(), ServeError> {
    match r {
        Ok(Ok(())) | Err(_) => Ok(()),
        Ok(Err(e)) => Err(ServeError::Transport(Box::new(e))),
    }
}

impl MetaServerHandle {
    /// Stops serving (graceful: in-flight RPCs finish) and waits for it.
    /// Shut the nodes using this MetaServer down first when the whole
    /// cluster stops (their unregisters then still land).
    ///
    /// # Errors
    /// [`ServeError::Transport`]: the transport failed while serving.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        let _ = self.shutdown.send(true);
        self.sweep.abort();
        serve_result(self.serve.await)
    }

    /// Waits until serving ends on its own (e.g. a transport error).
    ///
    /// # Errors
    /// [`ServeError::Transport`]: the transport error that ended serving.
    pub async fn wait(&mut self) -> Result<(), ServeError> {
        serve_result((&mut self.serve).await)
    }

    /// The index's statistics now (namespaces, hashes, owner entries,
    /// nodes, …); `None` only if reading it failed twice (a panic inside
    /// the store, counted in `metrics`).
    pub fn stats(&self) -> Option<crate::metaserver::store::StoreStats> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        read_store(&store, &self.metrics, |st| st.stats())
    }

    /// The store itself: a test seam for the simulator's invariant checker,
    /// which inspects the index directly. Not part of the supported API —
    /// embedders use [`MetaServerHandle::stats`] and the gRPC surface.
    #[doc(hidden)]
    pub fn store_for_testing(&self) -> Arc<Mutex<MetaStore>> {
        self.store.clone()
    }
}

/// Errors of MetaServer start-up.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The listen address could not be bound (e.g. the port is taken).
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The I/O threads could not be started.
    #[error("cannot start the metaserver's I/O threads: {0}")]
    IoThreads(std::io::Error),
    /// A setting is out of range.
    #[error("bad configuration: {0}")]
    Config(#[from] ConfigError),
    /// TLS was asked for and cannot be set up (not built in, or a
    /// certificate or key refused).
    #[error("metaserver TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

impl StartError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            StartError::Bind { .. } => "metaserver_bind",
            StartError::IoThreads(_) => "metaserver_io_threads",
            StartError::Config(_) => "metaserver_config",
            StartError::Tls(_) => "metaserver_tls",
        }
    }
}

/// A [`MetaServerConfig`] duration setting, named in [`ConfigError`] so a
/// front end can name its own flag for it (the CLI says `--ttl-secs`, not
/// `ttl_secs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigField {
    /// [`MetaServerConfig::stale_after_secs`].
    StaleAfterSecs,
    /// [`MetaServerConfig::ttl_secs`].
    TtlSecs,
    /// [`MetaServerConfig::sweep_interval_secs`].
    SweepIntervalSecs,
    /// [`MetaServerConfig::capacity_hashes`].
    CapacityHashes,
    /// [`MetaServerConfig::shards`].
    Shards,
    /// [`MetaServerConfig::io_threads`].
    IoThreads,
}

impl ConfigField {
    /// The config field's name (`stale_after_secs`, …).
    pub fn name(self) -> &'static str {
        match self {
            ConfigField::StaleAfterSecs => "stale_after_secs",
            ConfigField::TtlSecs => "ttl_secs",
            ConfigField::SweepIntervalSecs => "sweep_interval_secs",
            ConfigField::CapacityHashes => "capacity_hashes",
            ConfigField::Shards => "shards",
            ConfigField::IoThreads => "io_threads",
        }
    }
}

/// Why a [`MetaServerConfig`] was refused. The texts name the config fields;
/// [`ConfigError::render`] names them any other way.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The setting must be at least 1 s.
    #[error("{} must be at least 1 (s)", .0.name())]
    Zero(ConfigField),
    /// A node would be swept before it goes stale.
    #[error("ttl_secs ({ttl_secs}) must be >= stale_after_secs ({stale_after_secs})")]
    TtlBelowStaleAfter {
        /// The TTL asked for (s).
        ttl_secs: u64,
        /// The staleness bound asked for (s).
        stale_after_secs: u64,
    },
    /// [`MetaServerConfig::capacity_hashes`] exceeds
    /// [`limits::METASERVER_CAPACITY_HASHES_MAX`].
    #[error("capacity_hashes ({value}) must be at most {max}")]
    CapacityTooLarge {
        /// The capacity asked for (hashes).
        value: u64,
        /// The bound (hashes).
        max: u64,
    },
    /// The memory [`MetaServerConfig::capacity_hashes`] needs (one
    /// namespace's index sized up front) cannot be allocated now.
    #[error("capacity_hashes ({value}) needs about {bytes} bytes per namespace, which cannot be allocated: {reason}")]
    CapacityUnavailable {
        /// The capacity asked for (hashes).
        value: u64,
        /// Bytes one namespace's index of that capacity takes.
        bytes: u64,
        /// The allocator's refusal.
        reason: String,
    },
    /// [`MetaServerConfig::shards`] is 0 or exceeds
    /// [`limits::METASERVER_SHARDS_MAX`].
    #[error("shards ({value}) must be 1 to {max}")]
    Shards {
        /// The shard count asked for.
        value: usize,
        /// The bound.
        max: usize,
    },
    /// [`MetaServerConfig::io_threads`] exceeds
    /// [`limits::METASERVER_IO_THREADS_MAX`].
    #[error("io_threads ({value}) must be at most {max}")]
    IoThreads {
        /// The thread count asked for.
        value: usize,
        /// The bound.
        max: usize,
    },
    /// The setting exceeds [`limits::METASERVER_DURATION_SECS_MAX`].
    #[error("{} ({value}) must be at most {max} (s)", field.name())]
    TooLong {
        /// Which setting.
        field: ConfigField,
        /// Its value (s).
        value: u64,
        /// The bound (s).
        max: u64,
    },
}

impl ConfigError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ConfigError::Zero(_) => "metaserver_config_zero",
            ConfigError::TtlBelowStaleAfter { .. } => "metaserver_config_ttl_below_stale_after",
            ConfigError::CapacityTooLarge { .. } => "metaserver_config_capacity_too_large",
            ConfigError::CapacityUnavailable { .. } => "metaserver_config_capacity_unavailable",
            ConfigError::Shards { .. } => "metaserver_config_shards",
            ConfigError::IoThreads { .. } => "metaserver_config_io_threads",
            ConfigError::TooLong { .. } => "metaserver_config_too_long",
        }
    }
}

impl ConfigError {
    /// The message with each setting named by `name` (e.g. a flag).
    pub fn render(&self, name: impl Fn(ConfigField) -> String) -> String {
        match self {
            ConfigError::Zero(f) => format!("{} must be at least 1 (s)", name(*f)),
            ConfigError::TtlBelowStaleAfter { ttl_secs, stale_after_secs } => format!(
                "{} ({ttl_secs}) must be >= {} ({stale_after_secs})",
                name(ConfigField::TtlSecs),
                name(ConfigField::StaleAfterSecs)
            ),
            ConfigError::TooLong { field, value, max } => {
                format!("{} ({value}) must be at most {max} (s)", name(*field))
            }
            ConfigError::CapacityTooLarge { value, max } => {
                format!("{} ({value}) must be at most {max}", name(ConfigField::CapacityHashes))
            }
            ConfigError::CapacityUnavailable { value, bytes, reason } => format!(
                "{} ({value}) needs about {bytes} bytes per namespace, which cannot be allocated ({reason}): give a \
                 smaller capacity, or 0 to grow on demand",
                name(ConfigField::CapacityHashes)
            ),
            ConfigError::Shards { value, max } => format!("{} ({value}) must be 1 to {max}", name(ConfigField::Shards)),
            ConfigError::IoThreads { value, max } => {
                format!("{} ({value}) must be at most {max}", name(ConfigField::IoThreads))
            }
        }
    }
}

impl MetaServerConfig {
    /// Checks the settings: each duration at least 1 s and at most
    /// [`limits::METASERVER_DURATION_SECS_MAX`], the capacity and the shard
    /// count and the I/O threads within their limits, and
    /// `ttl_secs >= stale_after_secs`.
    ///
    /// # Errors
    /// The first [`ConfigError`] found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let max = limits::METASERVER_DURATION_SECS_MAX;
        for (field, value) in [
            (ConfigField::StaleAfterSecs, self.stale_after_secs),
            (ConfigField::TtlSecs, self.ttl_secs),
            (ConfigField::SweepIntervalSecs, self.sweep_interval_secs),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(field));
            }
            if value > max {
                return Err(ConfigError::TooLong { field, value, max });
            }
        }
        if self.capacity_hashes > limits::METASERVER_CAPACITY_HASHES_MAX {
            return Err(ConfigError::CapacityTooLarge {
                value: self.capacity_hashes,
                max: limits::METASERVER_CAPACITY_HASHES_MAX,
            });
        }
        if !(1..=limits::METASERVER_SHARDS_MAX).contains(&self.shards) {
            return Err(ConfigError::Shards { value: self.shards, max: limits::METASERVER_SHARDS_MAX });
        }
        if self.io_threads > limits::METASERVER_IO_THREADS_MAX {
            return Err(ConfigError::IoThreads { value: self.io_threads, max: limits::METASERVER_IO_THREADS_MAX });
        }
        if self.ttl_secs < self.stale_after_secs {
            return Err(ConfigError::TtlBelowStaleAfter {
                ttl_secs: self.ttl_secs,
                stale_after_secs: self.stale_after_secs,
            });
        }
        Ok(())
    }
}

/// The server builder, with TLS when `tls` is given (an error in a build
/// without TLS: [`crate::tls::TlsError::NotBuilt`]).
fn tls_server_builder(tls: Option<&crate::tls::TlsIdentity>) -> Result<tonic::transport::Server, StartError> {
    let builder = crate::rt::server_builder();
    Ok(match tls {
        Some(id) => crate::tls::server(builder, id)?,
        None => builder,
    })
}

/// Binds, then serves the MetaServer and runs its TTL sweep. Returns once the
/// port is bound, so a taken port is an error before anything is served.
///
/// # Errors
/// [`StartError::Bind`] for a taken or invalid address, [`StartError::Config`]
/// for zero/inconsistent durations (see [`MetaServerConfig::validate`]),
/// [`StartError::Tls`] when TLS is asked for and cannot be set up,
/// [`StartError::IoThreads`] when the I/O threads cannot be started.
pub async fn start(config: MetaServerConfig) -> Result<MetaServerHandle, StartError> {
    config.validate()?;
    // The first insert of a namespace sizes its index for the capacity: if
    // that memory cannot be had, refuse now rather than say ready and fail
    // (or abort) on the first insert.
    crate::metaserver::store::check_capacity(config.capacity_hashes, config.shards)
        .map_err(|(bytes, reason)| ConfigError::CapacityUnavailable { value: config.capacity_hashes, bytes, reason })?;
    let mut builder = tls_server_builder(config.tls.as_ref())?;
    let bound = crate::rt::bind(config.addr).await.map_err(|source| StartError::Bind { addr: config.addr, source })?;
    let local_addr = bound.local_addr;
    let store = MetaStore::with_shards(
        StoreConfig { stale_after_ms: config.stale_after_secs * 1000, ttl_ms: config.ttl_secs * 1000 },
        config.capacity_hashes as usize,
        config.shards,
    );
    let hooks = Arc::new(MetaServerHooks::default());
    let metrics = Arc::new(MetaServerMetrics::default());
    let origin = Instant::now();
    let svc = MetaServerService {
        store: store.clone(),
        origin,
        stale_after_secs: config.stale_after_secs,
        hooks: hooks.clone(),
        metrics: metrics.clone(),
        rng: Arc::new(Mutex::new(rand::rngs::SmallRng::seed_from_u64(config.seed))),
    };
    let (tx, mut rx) = watch::channel(false);
    let server = MetaServerServer::new(svc)
        .max_decoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX);
    let router = builder.add_service(crate::rt::grpc_service(server));
    let stopped = async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let serve = if config.io_threads == 0 {
        tokio::spawn(crate::rt::serve(router, bound, stopped))
    } else {
        let serving =
            crate::rt::serve_on_io_threads(router, bound, stopped, config.io_threads).map_err(StartError::IoThreads)?;
        tokio::spawn(serving)
    };
    let sweep_store = store.clone();
    let sweep_metrics = metrics.clone();
    let sweep_hooks = hooks.clone();
    let period = Duration::from_secs(config.sweep_interval_secs);
    let sweep = tokio::spawn(async move {
        loop {
            tokio::time::sleep(period).await;
            let now = crate::rt::elapsed_ms(origin);
            // A panicking sweep is counted and skipped; the next period retries.
            let Ok(rep) = guarded(&sweep_store, &sweep_hooks, &sweep_metrics, |st| st.sweep(now)) else {
                continue;
            };
            if rep.nodes_removed > 0 {
                sweep_metrics.swept_nodes.fetch_add(rep.nodes_removed, Ordering::Relaxed);
                tracing::info!(nodes = rep.nodes_removed, owners = rep.owners_removed, "ttl sweep");
            }
        }
    });
    tracing::info!(%local_addr, "metaserver listening");
    let store = Arc::new(Mutex::new(store));
    Ok(MetaServerHandle { local_addr, store, hooks, metrics, shutdown: tx, serve, sweep })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{BlockHash, NodeAddr, SessionId};

    fn store_with_one_block() -> MetaStore {
        let st = MetaStore::with_shards(StoreConfig { stale_after_ms: 1_000, ttl_ms: 5_000 }, 0, 4);
        let (n, s) = (NodeAddr("10.0.0.1:7000".into()), SessionId("s1".into()));
        st.heartbeat(&n, &s, 0).unwrap();
        st.insert("ns", &[BlockHash::from_u64(1)], &n, &s, 0).unwrap();
        st
    }

    /// A panic that leaves the store half-updated is caught, and the store
    /// is reset to empty instead of serving a wrong index; counted.
    #[test]
    fn a_panic_that_corrupts_the_store_resets_it() {
        let store = store_with_one_block();
        let (hooks, metrics) = (MetaServerHooks::default(), MetaServerMetrics::default());
        let r: Result<(), ()> = guarded(&store, &hooks, &metrics, |st| {
            st.corrupt_for_test();
            panic!("injected: a bug halfway through an update");
        });
        assert_eq!(r, Err(()));
        assert_eq!(metrics.store_panics.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.store_resets.load(Ordering::Relaxed), 1);
        assert_eq!(guarded(&store, &hooks, &metrics, |st| st.stats().nodes), Ok(0), "reset to empty");
        assert_eq!(store.check_consistency(), Ok(()));
    }

    /// A panic before any change keeps the store as it was.
    #[test]
    fn a_panic_that_changed_nothing_keeps_the_store() {
        let store = store_with_one_block();
        let (hooks, metrics) = (MetaServerHooks::default(), MetaServerMetrics::default());
        hooks.panic_store_ops.store(1, Ordering::Relaxed);
        assert_eq!(guarded(&store, &hooks, &metrics, |st| st.stats().hashes), Err(()));
        assert_eq!(guarded(&store, &hooks, &metrics, |st| st.stats().hashes), Ok(1), "one injected fault only");
        assert_eq!(metrics.store_panics.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.store_resets.load(Ordering::Relaxed), 0);
    }

    /// Locks poisoned elsewhere over a corrupted store: the first request
    /// that meets the poison is refused, the store recovered (checked,
    /// reset, poison cleared), and the next request served.
    #[test]
    fn a_poisoned_lock_over_a_corrupted_store_is_recovered_and_reset() {
        let store = store_with_one_block();
        let (hooks, metrics) = (MetaServerHooks::default(), MetaServerMetrics::default());
        store.poison_for_test(true);
        assert_eq!(guarded(&store, &hooks, &metrics, |st| st.stats().nodes), Err(()));
        assert_eq!(guarded(&store, &hooks, &metrics, |st| st.stats().nodes), Ok(0));
        assert_eq!(metrics.poison_recoveries.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.store_resets.load(Ordering::Relaxed), 1);
        assert_eq!(store.check_consistency(), Ok(()));
    }

    /// The exporter's read path recovers a poisoned (consistent) store and
    /// answers on its retry.
    #[test]
    fn read_store_recovers_a_poisoned_store_and_answers() {
        let store = store_with_one_block();
        let metrics = MetaServerMetrics::default();
        store.poison_for_test(false);
        assert_eq!(read_store(&store, &metrics, |st| st.stats().hashes), Some(1));
        assert_eq!(metrics.poison_recoveries.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.store_resets.load(Ordering::Relaxed), 0);
    }

    /// A shard count outside 1..=METASERVER_SHARDS_MAX is refused.
    #[test]
    fn shards_setting_is_validated() {
        let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        assert_eq!(cfg.validate(), Ok(()));
        cfg.shards = 0;
        let max = limits::METASERVER_SHARDS_MAX;
        assert_eq!(cfg.validate(), Err(ConfigError::Shards { value: 0, max }));
        cfg.shards = max + 1;
        assert_eq!(cfg.validate().unwrap_err().to_string(), format!("shards ({}) must be 1 to {max}", max + 1));
        cfg.shards = 1;
        assert_eq!(cfg.validate(), Ok(()));
    }

    #[test]
    fn io_threads_setting_is_validated() {
        let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        let max = limits::METASERVER_IO_THREADS_MAX;
        for ok in [0, 1, max] {
            cfg.io_threads = ok;
            assert_eq!(cfg.validate(), Ok(()), "io_threads {ok}");
        }
        cfg.io_threads = max + 1;
        assert_eq!(cfg.validate(), Err(ConfigError::IoThreads { value: max + 1, max }));
        assert_eq!(
            cfg.validate().unwrap_err().render(|f| format!("--{}", f.name().replace('_', "-"))),
            format!("--io-threads ({}) must be at most {max}", max + 1)
        );
    }
}
