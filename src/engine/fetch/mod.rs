//! Decode-side fetch (design.md §5, contracts C8–C11, C14).
//!
//! `MetaServer.QueryPrefixBlocks` → choose an owner (never self; the
//! MetaServer's order — longest prefix, then node — is the deterministic
//! tie-break) → handshake once per peer (single-flight; a failure leaves no
//! state, so the next attempt starts clean) → `QueryBlocksForTransfer` →
//! READ into freshly allocated pool slots, in parts (up to
//! `EngineConfig::fetch_reads_in_flight` parts in flight, each part spread
//! over the transport's connections) → verify each slot's CRC-32C (taken
//! by the transport as the bytes land, `Transport::read_summed`, a piece at
//! a time while it is in cache; else, and for an extent the transport could
//! not sum, by a pass over the part while the next ones are read) → seal each verified part
//! in prefix order and register it as owned here (one synchronous step, so
//! no eviction can slip between them) → release the transfer lock. When an owner delivers only part of what it advertised,
//! the next owner is asked for the rest (stitching one prefix from several
//! owners, C14), at most one transfer query per owner per fetch and at most
//! `FETCH_OWNERS_MAX` owners. Every step runs under the fetch's one
//! deadline instant: the query, handshake and reads take it; a lock RPC is
//! not sent after it and its late grant is released; no checksum pass
//! starts after it and a running one stops checking at it (the part is not
//! kept); `fetch_into`'s load tail submits no copy after it; the release is
//! handed off to a task of its own.
//!
//! The result is "k of n": `available` counts the verified contiguous prefix
//! now resident here; the caller recomputes the rest (C9).
//!
//! Every decision above is made by the sans-io [`FetchMachine`]
//! (`machine.rs`, property-tested through every outcome and cancellation);
//! this file is its async driver: it performs the machine's actions (RPCs,
//! allocation, reads, CRC passes, seal + register, release), feeds back
//! what happened, charges the wall time to phases ([`FetchPhases`]) and, for
//! [`Engine::fetch_into`], starts each sealed part's load into the caller's
//! blocks at once so the device copy runs behind the next reads.

mod device;
mod machine;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;
use tonic::transport::Channel;

pub use machine::{
    Action, Event, FetchError, FetchMachine, FetchPhases, FetchReport, HandshakeFailure, LockGrant, LockedBlock,
    LockedSlot, MachineConfig, PeerFailure, ShapeMismatch,
};

use super::cache::CachedBlock;
use super::layout::Layout;
use super::locks::PACKED_NO_DEVICE_BLOCK;
use super::peers::PeerState;
use super::pool::Extent;
use super::tickets::TransferTicket;
use super::{Engine, EngineError, LoadError, LoadReport, slot_checksums};
use crate::proto::engine_client::EngineClient;
use crate::proto::{
    QueryBlocksForTransferRequest, QueryBlocksForTransferResponse, RdmaHandshakeRequest, ReleaseTransferLockRequest,
    SlotShape, TransferBlockInfo,
};
use crate::rt::timeout_at;
use crate::status::RpcFailure;
use crate::transport::{
    HandshakeMetadata, NotConnected, ReadCompletion, ReadOp, SharedRegion, SlotEnds, Transport, TransportError,
};
use crate::types::{BlockHash, NodeAddr};

/// Result of [`Engine::fetch_into`].
#[derive(Debug)]
pub struct FetchIntoReport {
    /// The fetch: `available` of `requested` resident here, and why it
    /// stopped short.
    pub fetch: FetchReport,
    /// The load of the first `fetch.available` blocks.
    pub load: LoadReport,
}

/// How often [`Engine::connect_peer`] looks whether the peer's pool is
/// opened.
const SHARED_OPEN_POLL: Duration = Duration::from_millis(5);

/// Whether trying `e`'s handshake again may succeed: the peer is not up
/// yet or did not answer in time (its RPC channel, its transport), not an
/// answer that says no.
fn connect_retryable(e: &FetchError) -> bool {
    use tonic::Code;
    match e {
        FetchError::Handshake(HandshakeFailure::Rpc(r)) => matches!(
            r.code,
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::ResourceExhausted
        ),
        FetchError::Handshake(HandshakeFailure::Transport(_)) => true,
        _ => false,
    }
}

/// Why [`Engine::connect_peer`] failed: the error and, when its timeout
/// passed, the failure of the last try before it (what tells "nothing
/// listens" from "no such host" or "no answer in time").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}{}", .last_try.as_ref().map(|l| format!(" (last try: {l})")).unwrap_or_default())]
pub struct ConnectError {
    /// [`FetchError::Deadline`] when the timeout passed before a
    /// handshake succeeded; else the failure that trying again cannot fix.
    pub error: FetchError,
    /// With [`FetchError::Deadline`]: the last try's failure, if a try
    /// failed before the timeout.
    pub last_try: Option<FetchError>,
}

impl ConnectError {
    /// The stable code of [`ConnectError::error`].
    pub fn code(&self) -> &'static str {
        self.error.code()
    }
}

impl From<FetchError> for ConnectError {
    fn from(error: FetchError) -> Self {
        Self { error, last_try: None }
    }
}

/// The same-host shared pool of a peer after [`Engine::connect_peer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedPool {
    /// Not read through a mapping: another host, a transport without
    /// shared pools, or an engine without one-step copies
    /// (`EngineConfig::shared_pool_direct` off). Reads go over the
    /// transport.
    NotMapped,
    /// Opened: fetches into the KV copy straight from it.
    Ready,
    /// Still being opened when the timeout passed; it goes on in the
    /// background, and reads take the pool copy until it is done.
    Opening,
    /// The GPU backend refused it as a copy source (the reason is logged
    /// at debug); reads copy through this engine's pool.
    Refused,
}

impl FetchIntoReport {
    /// Leading blocks now on the device (fetched or already resident, and
    /// loaded): the caller recomputes every block after them.
    pub fn ready(&self) -> usize {
        self.load.results.iter().take_while(|r| r.is_ok()).count()
    }
}

impl Engine {
    /// Fetches `blocks` from peers ([`Engine::fetch`]) and loads the
    /// fetched (or already resident) prefix into the caller's block indices
    /// ([`Engine::load`]) in one call: the decode side of the P/D handoff.
    /// `blocks` pairs each hash (in prefix order) with the index of the
    /// embedder's paged cache it goes to. Loads are pipelined with the
    /// fetch: the resident prefix starts loading at once and each fetched
    /// part as soon as it is verified and sealed, so only the last part's
    /// copy follows the last read (`fetch.phases.load_tail`).
    ///
    /// [`FetchIntoReport::ready`] is how many leading blocks are now on the
    /// device; the caller recomputes the rest.
    ///
    /// # Errors
    /// Validation errors (unknown namespace, index out of range), before
    /// anything is fetched. Peer and copy failures are not errors: they end
    /// the ready prefix early (C9).
    pub async fn fetch_into(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
    ) -> Result<FetchIntoReport, EngineError> {
        self.fetch_into_inner(namespace, blocks, None, Known::Nothing).await
    }

    /// [`Engine::fetch_into`] that also ends by the caller's `deadline`
    /// (see [`Engine::fetch_with_deadline`]), load tail included: no copy
    /// into the caller's blocks is submitted after it (those blocks are
    /// [`LoadError::Deadline`], their KV blocks untouched). Copies already
    /// submitted when it passes are awaited, never abandoned: they write
    /// the caller's KV blocks (C11), and the report says exactly which
    /// blocks are in them.
    ///
    /// # Errors
    /// As [`Engine::fetch_into`].
    pub async fn fetch_into_with_deadline(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
        deadline: Instant,
    ) -> Result<FetchIntoReport, EngineError> {
        self.fetch_into_inner(namespace, blocks, Some(deadline), Known::Nothing).await
    }

    /// [`Engine::fetch_into_with_deadline`] for a caller that has just asked
    /// the MetaServer who holds `blocks`' prefix ([`MetaServerClient::query_prefix`]
    /// of the same hashes, from the first; `owners` is its answer, longest
    /// prefix first): the fetch starts from that answer instead of asking
    /// again, saving a MetaServer round trip on the handoff's critical
    /// path. The P/D pattern: the decode side's scheduler asks how much of
    /// a prompt is cached before it allocates KV blocks, then loads them
    /// (vLLM's connector does `get_num_new_matched_tokens`, then
    /// `start_load_kv`).
    ///
    /// Only the first query is answered from `owners`, and the owner picked
    /// from it (the first usable one) is asked for every block left, since
    /// it may have saved more since the answer; it owes only what the
    /// answer said. An owner that no longer holds that is refused by its
    /// own transfer lock (the authority), and the fetch asks the MetaServer
    /// for the rest as usual. An answer with no usable owner (empty, only
    /// this node, none past the local prefix) is not used at all.
    ///
    /// [`MetaServerClient::query_prefix`]: crate::client::MetaServerClient::query_prefix
    ///
    /// # Errors
    /// As [`Engine::fetch_into`].
    pub async fn fetch_into_with_owners(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
        owners: Vec<(NodeAddr, u32)>,
        deadline: Instant,
    ) -> Result<FetchIntoReport, EngineError> {
        self.fetch_into_inner(namespace, blocks, Some(deadline), Known::Owners(owners)).await
    }

    /// [`Engine::fetch_into_with_deadline`] starting from an owner's
    /// transfer ticket ([`Engine::grant_transfer`], see
    /// [`super::tickets`]): the lock the owner granted this engine when it
    /// said "KV ready", so the fetch skips the MetaServer query and the
    /// lock RPC and reads at once. The ticket is checked as a lock answer
    /// from the wire is (C10, C15, C19) and consumed: its session is
    /// released exactly once, read or not (C8).
    ///
    /// A ticket is read from only when it is this engine's (its
    /// requester), another node's (its owner), of `namespace`, with a
    /// session, younger than its lock timeout, its hashes and `blocks`'
    /// the same prompt (one a prefix of the other), and it grants blocks
    /// past what this engine holds
    /// already; else it is released unread
    /// ([`super::EngineMetrics::fetch_tickets_unused`]) and the fetch goes
    /// on as [`Engine::fetch_into_with_deadline`]. What the ticket does not
    /// bring (blocks it does not grant, a read its owner refused, say
    /// because the lock expired) is fetched as usual: a MetaServer query,
    /// which may name the ticket's owner once more (then asked with a lock
    /// RPC), and other owners. Device ranges in it are used only when this
    /// engine makes device-direct reads at all
    /// ([`super::EngineConfig::device_direct`]).
    ///
    /// The ticket is this call's from the start: a fetch dropped before it
    /// reads (cancelled, never polled) or refused (a validation error)
    /// still releases it.
    ///
    /// # Errors
    /// As [`Engine::fetch_into`].
    pub fn fetch_into_with_ticket<'a>(
        &'a self,
        namespace: &'a str,
        blocks: &'a [(BlockHash, u64)],
        ticket: TransferTicket,
        deadline: Instant,
    ) -> impl Future<Output = Result<FetchIntoReport, EngineError>> + Send + 'a {
        // Held before the future exists (an `async fn` would hold the bare
        // ticket until first polled, and a future dropped unpolled would
        // leak its lock until it expires).
        let hold = TicketHold::new(self, ticket);
        self.fetch_into_inner(namespace, blocks, Some(deadline), Known::Ticket(hold))
    }

    async fn fetch_into_inner(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
        until: Option<Instant>,
        known: Known,
    ) -> Result<FetchIntoReport, EngineError> {
        // (A ticket in `known` is released when it is dropped unread.)
        let (_, layout) = self.layout(namespace)?;
        Self::check_indices(&layout, blocks.iter().map(|(_, i)| i))?;
        let hashes: Vec<BlockHash> = blocks.iter().map(|(h, _)| h.clone()).collect();
        let (fetch, load) = self.fetch_inner(namespace, &hashes, Some(blocks), until, known).await;
        let load = load.unwrap_or_else(|| Ok(LoadReport { results: Vec::new() }))?;
        Ok(FetchIntoReport { fetch, load })
    }
}

/// Which one-step path copies a part into the engine's KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direct {
    /// Device to device from the owner's KV under a device lease (C19).
    Lease,
    /// From the owner's mapped shared pool (issue 28 item 3).
    Shared,
}

/// A part's one-step copy: each block's slot checksums once they matched
/// the owner's, or which path failed and why (the part is then read into
/// the pool).
type DirectCopy<'a> = Pin<Box<dyn Future<Output = Result<Vec<Arc<[u32]>>, (Direct, String)>> + Send + 'a>>;

/// A one-step part ready to submit: the copy, each block's slot checksums
/// as the owner took them, the bytes it moves and, for a device-lease read,
/// the transfer session (traced for the simulator's C19 check).
struct DirectBatch {
    batch: crate::gpu::peer::PeerCopyBatch,
    expected: Vec<Arc<[u32]>>,
    bytes: u64,
    lease_session: Option<String>,
}

/// Lets a fetch's one-step part tasks submit only while the fetch is live.
/// A task plans and submits inside [`Gate::run`]'s shared section;
/// [`Gate::close`], the first thing a dropped fetch does, waits for the
/// sections in progress and refuses every later one. So no copy starts
/// after the fetch ended and released its transfer lock and device lease
/// (C11, C19), while the parts in flight still submit side by side.
#[derive(Clone, Default)]
struct Gate(Arc<std::sync::RwLock<bool>>);

impl Gate {
    /// Runs `f` unless the gate is closed (then `None`); [`Gate::close`]
    /// waits until `f` returned.
    fn run<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let closed = self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        (!*closed).then(f)
    }

    /// Closes the gate, once every section in progress ended.
    fn close(&self) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = true;
    }
}

/// Plans a one-step part with `prepare` and submits it
/// ([`submit_direct`]), both on a task of its own: planning a 64 MiB
/// part of a Qwen3-8B-shaped KV (~2,000 copies) and submitting it take
/// ~0.25 ms of CPU, and on the fetch's driver task that work bounded a
/// device-lease read, which issued one part at a time and noticed a
/// finished part only between issues (docs/BENCHMARKS.md, session 31).
/// Here parts in flight are planned side by side on the runtime's
/// threads while the driver goes on. Both happen inside the fetch's
/// `gate` ([`Gate`]): once the fetch ended, a task that has not submitted
/// yet submits nothing. Dropping the returned completion also aborts a task
/// that has not started; a submitted copy is the GPU worker's to finish
/// (C11).
fn spawn_direct<'a>(
    engine: &Engine,
    gate: &Gate,
    kind: Direct,
    deadline: Instant,
    prepare: impl FnOnce() -> Result<DirectBatch, String> + Send + 'static,
) -> DirectCopy<'a> {
    /// Aborts the task when the completion is dropped.
    struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);
    impl<T> Drop for AbortOnDrop<T> {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let (engine, gate) = (engine.clone(), gate.clone());
    let mut task = AbortOnDrop(tokio::spawn(async move {
        match gate.run(|| prepare().map(|part| submit_direct(&engine, kind, part, deadline))) {
            None => Err((kind, "the fetch ended".to_string())),
            Some(Err(why)) => Err((kind, why)),
            Some(Ok(copy)) => copy.await,
        }
    }));
    Box::pin(async move {
        match (&mut task.0).await {
            Ok(r) => r,
            Err(e) => {
                if e.is_panic() {
                    tracing::error!(error = %e, "a one-step part's task panicked: the part is read from the pool");
                }
                Err((kind, format!("the part's copy task ended: {e}")))
            }
        }
    })
}

/// Submits a one-step copy batch now and returns its completion, which
/// checks the checksums the GPU backend took of the landed bytes against
/// the owner's (C10) and counts the part in `kind`'s metrics. No copy
/// starts after the fetch's `deadline`: a copy into the caller's KV is
/// awaited once started (C11), so the pool path then ends at once (C9).
fn submit_direct(
    engine: &Engine,
    kind: Direct,
    part: DirectBatch,
    deadline: Instant,
) -> impl Future<Output = Result<Vec<Arc<[u32]>>, (Direct, String)>> + Send + '_ {
    let DirectBatch { batch, expected, bytes, lease_session } = part;
    let t0 = Instant::now();
    let copy = if t0 >= deadline {
        None
    } else {
        if let Some(session) = lease_session {
            // The simulator checks this against the owner's lease events
            // (C19: no device read after the lease ended).
            tracing::trace!(target: super::leases::DEVICE_READ_TRACE_TARGET, me = %engine.node(), session, "device read");
        }
        Some(engine.gpu().submit_peer(batch))
    };
    async move {
        let copy = copy.ok_or((kind, "the fetch deadline passed".to_string()))?;
        let sums = copy.await.map_err(|e| (kind, format!("device copy: {e}")))?;
        tracing::debug!(
            target: crate::gpu::peer::PEER_TIMING_TRACE_TARGET,
            ?kind,
            bytes,
            observed = t0.elapsed().as_micros() as u64,
            "one-step part done"
        );
        let mut out = Vec::with_capacity(expected.len());
        let mut at = 0;
        for want in expected {
            let got = sums.get(at..at + want.len()).ok_or((kind, "too few checksums".to_string()))?;
            if got != &*want {
                engine.inner.metrics.checksum_failures.fetch_add(1, Ordering::Relaxed);
                return Err((kind, "a slot checksum differs from the owner's (C10)".to_string()));
            }
            at += want.len();
            out.push(want);
        }
        let m = &engine.inner.metrics;
        let (blocks, b, ns) = match kind {
            Direct::Lease => (&m.device_blocks, &m.device_bytes, &m.device_ns),
            Direct::Shared => (&m.shared_direct_blocks, &m.shared_direct_bytes, &m.shared_direct_ns),
        };
        blocks.fetch_add(out.len() as u64, Ordering::Relaxed);
        b.fetch_add(bytes, Ordering::Relaxed);
        ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(out)
    }
}

/// The sources of a device-lease part: the owner's `exports` its `ops`
/// read (`op.src` indexes `exports`), opened through the owner's peer entry
/// in first-use order, and `ops` with `src` rewritten to index them.
///
/// # Errors
/// Why an export would not open: the part is read from the pool instead.
fn open_exports(
    gpu: &dyn crate::gpu::Gpu,
    peer: &PeerState,
    exports: &[crate::gpu::peer::BufferExport],
    mut ops: Vec<crate::gpu::peer::PeerCopyOp>,
) -> Result<(Vec<Arc<dyn crate::gpu::peer::PeerBuffer>>, Vec<crate::gpu::peer::PeerCopyOp>), String> {
    // `at[export]`: its index among the sources. (A vector, not a map: this
    // runs once per op, ~70 per Qwen3-8B block.)
    let mut at: Vec<Option<usize>> = vec![None; exports.len()];
    let mut sources = Vec::new();
    let mut opened = peer.opened.lock().expect("opened lock");
    for op in &mut ops {
        // `plan_part` took `src` from the checked owner layout, whose runs
        // name exports below `exports.len()`.
        let slot = &mut at[op.src];
        op.src = match *slot {
            Some(i) => i,
            None => {
                let b = opened.get(gpu, &exports[op.src]).map_err(|e| format!("opening the owner's buffer: {e}"))?;
                sources.push(b);
                *slot = Some(sources.len() - 1);
                sources.len() - 1
            }
        };
    }
    Ok((sources, ops))
}

/// `plan`'s blocks as ranges of the owner's pool (source 0: its mapping),
/// in pool byte order: the ranges of `ops`, the part's [`read_ops`].
fn shared_blocks(plan: &[&LockedBlock], ops: &[ReadOp]) -> Vec<device::SourceBlock> {
    let mut out: Vec<device::SourceBlock> =
        plan.iter().map(|b| device::SourceBlock { ranges: Vec::new(), expected: b.slot_crcs() }).collect();
    for op in ops {
        out[op.local_extent].ranges.push((0, op.remote_offset, op.len));
    }
    out
}

/// The phase an action's synchronous work is charged to.
enum Phase {
    Lock,
    Read,
    Release,
    Seal,
}

/// The RPC a fetch is waiting on (at most one at a time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rpc {
    Query,
    Handshake,
    Lock,
}

/// What a pending driver operation ended with: a machine event, plus the
/// slots a read or a CRC pass had taken out of the slot table.
enum Outcome {
    Rpc(Event),
    /// The lock's answer, with its device half (C19) when it had one. A
    /// grant comes inside a [`LateRelease`] that releases it if the answer
    /// is dropped before the driver takes it (the fetch ended first).
    Locked(Result<Box<LateRelease>, FetchError>, Option<device::DeviceSide>),
    /// A part copied device to device and verified: the slots it did not
    /// use, and each block's slot checksums.
    DeviceRead {
        part: usize,
        first: usize,
        local: Vec<Extent>,
        sums: Vec<Arc<[u32]>>,
    },
    Read {
        part: usize,
        first: usize,
        done: ReadCompletion,
    },
    Verified {
        part: usize,
        first: usize,
        local: Vec<Extent>,
        sums: Vec<Option<Arc<[u32]>>>,
    },
}

type Pending<'a> = FuturesUnordered<Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>>;

/// Performs a [`FetchMachine`]'s actions for one [`Engine::fetch`]: the only
/// async part of a fetch (with the one-step part tasks it spawns,
/// [`spawn_direct`]). Dropping it (the fetch ended or was cancelled) first
/// closes its [`Gate`], so no part task submits a copy after that, then
/// releases a held transfer lock on a spawned task
/// ([`FetchMachine::abandon`]); every slot it holds goes back to the pool
/// with it.
struct Driver<'a> {
    engine: &'a Engine,
    namespace: &'a str,
    hashes: &'a [BlockHash],
    ns: Arc<str>,
    layout: Arc<Layout>,
    transport: Arc<dyn Transport>,
    deadline: Instant,
    m: FetchMachine,
    /// Pool slots of the current plan, by plan index (`None`: not allocated,
    /// in flight, sealed or freed).
    slots: Vec<Option<Extent>>,
    /// The current owner's peer entry (to forget exactly it after a failure).
    peer: Option<(NodeAddr, Arc<PeerState>)>,
    reads: usize,
    verifies: usize,
    rpc: Option<Rpc>,
    phases: FetchPhases,
    /// `fetch_into`: the caller's block indices, and each block's load
    /// result as its load finishes.
    load: Option<LoadPipe<'a>>,
    /// Transfer sessions granted to this fetch (for the end-of-fetch trace
    /// event the simulator checks C8 with).
    granted: Vec<String>,
    /// The current lock's device half (C19), if the owner offered one.
    device: Option<Arc<device::DeviceSide>>,
    /// Closed when the driver is dropped: one-step part tasks submit only
    /// while it is open.
    gate: Gate,
    /// Parts copied device to device, with their blocks' slot checksums,
    /// until their verify action takes them.
    device_parts: HashMap<usize, Vec<Arc<[u32]>>>,
    /// The current plan's pool slots were not taken at `Alloc`
    /// ([`Self::one_step_expected`]): a part that falls back takes its own.
    defer_slots: bool,
    /// Parts whose transport took slot checksums as the bytes landed
    /// ([`crate::transport::Transport::read_summed`]), per extent, until
    /// their verify action takes them.
    landed_sums: HashMap<usize, Vec<Option<Arc<[u32]>>>>,
    /// Where each slot of a block of `layout` ends, for the transport to
    /// sum slots as bytes land (`None`: the layout's slots do not tile its
    /// blocks; every part then goes through the checksum pass).
    slot_ends: Option<SlotEnds>,
    /// Request indices whose block landed device to device (sealed as
    /// loaded, never into the pool).
    device_done: std::collections::HashSet<usize>,
    /// Owners the caller already asked the MetaServer for
    /// ([`Engine::fetch_into_with_owners`]): answers the first query
    /// instead of an RPC, once.
    known_owners: Option<Vec<(NodeAddr, u32)>>,
    /// An owner's ticket ([`Engine::fetch_into_with_ticket`]): answers
    /// the first lock on its owner instead of an RPC, once (then
    /// `known_owners` came from it); released as the driver drops when no
    /// lock took it.
    ticket: Option<TicketHold>,
}

/// The loads of a [`Engine::fetch_into`], started part by part as blocks
/// are sealed (or found resident), so the device copies run behind the
/// network reads of the next parts.
struct LoadPipe<'a> {
    blocks: &'a [(BlockHash, u64)],
    /// The fetch's deadline: no copy batch is submitted after it.
    deadline: Instant,
    results: Vec<Option<Result<(), LoadError>>>,
    error: Option<EngineError>,
    running: Loads<'a>,
}

type Loads<'a> = FuturesUnordered<Pin<Box<dyn Future<Output = (usize, Result<LoadReport, EngineError>)> + Send + 'a>>>;

impl<'a> LoadPipe<'a> {
    fn start(&mut self, engine: &'a Engine, namespace: &'a str, range: std::ops::Range<usize>) {
        if range.is_empty() {
            return;
        }
        let at = range.start;
        let blocks = &self.blocks[range];
        let deadline = self.deadline;
        self.running.push(Box::pin(async move { (at, engine.load_with_deadline(namespace, blocks, deadline).await) }));
    }

    fn finished(&mut self, (at, res): (usize, Result<LoadReport, EngineError>)) {
        match res {
            Ok(r) => {
                for (i, r) in r.results.into_iter().enumerate() {
                    self.results[at + i] = Some(r);
                }
            }
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }
}

/// What the caller of a fetch already knows when it starts.
pub(crate) enum Known {
    /// Nothing: the fetch asks the MetaServer.
    Nothing,
    /// The MetaServer's answer ([`Engine::fetch_into_with_owners`]).
    Owners(Vec<(NodeAddr, u32)>),
    /// An owner's ticket ([`Engine::fetch_into_with_ticket`]).
    Ticket(TicketHold),
}

/// A transfer ticket a fetch was handed, until a lock takes it: dropped
/// unread (the fetch ended first, was cancelled or never polled, did not
/// need it), it releases the ticket's session, on a task of its own as
/// every release of a fetch (C8: a ticket is consumed either way).
pub(crate) struct TicketHold {
    engine: Engine,
    ticket: Option<Box<TransferTicket>>,
    /// Leading request blocks the ticket grants (what its owner owes).
    promised: usize,
}

impl TicketHold {
    fn new(engine: &Engine, t: TransferTicket) -> Self {
        let a = &t.answer;
        // The leading blocks it grants: packed indices 0, 1, 2… (an owner
        // answers in request order), or per-block records of those hashes.
        let promised = if a.blocks.is_empty() {
            a.packed_index.iter().zip(0u32..).take_while(|(i, n)| *i == n).count()
        } else {
            a.blocks.iter().zip(&t.hashes).take_while(|(b, h)| b.block_hash == h.0).count()
        };
        if !t.session().is_empty() {
            // From here the ticket's lock is this fetch's to release, read
            // or not (the simulator checks it, C8).
            tracing::trace!(target: FETCH_LOCK_TRACE_TARGET, me = %engine.node(), session = t.session(), "ticket handed to fetch");
        }
        Self { engine: engine.clone(), ticket: Some(Box::new(t)), promised }
    }

    /// The ticket's owner.
    fn owner(&self) -> Option<&NodeAddr> {
        self.ticket.as_ref().map(|t| &t.owner)
    }

    /// Whether a fetch of `hashes` in `namespace` holding the first `local`
    /// of them reads from this ticket (see [`Engine::fetch_into_with_ticket`]).
    fn usable(&self, namespace: &str, hashes: &[BlockHash], local: usize) -> bool {
        let Some(t) = &self.ticket else { return false };
        let me = self.engine.node();
        // The ticket and the fetch name the same prompt: one's hashes are
        // a prefix of the other's (a decode that computes the prompt's
        // last block itself fetches one block fewer than the prefill saved).
        let common = t.hashes.len().min(hashes.len());
        let young = t.age_ms() < u64::from(t.answer.lock_timeout_secs) * 1000;
        t.requester == *me
            && t.owner != *me
            && t.namespace == namespace
            && !t.session().is_empty()
            && young
            && t.hashes[..common] == hashes[..common]
            && self.promised.min(hashes.len()) > local
    }

    /// The ticket, now a lock's to release (C8).
    fn take(mut self) -> Box<TransferTicket> {
        self.ticket.take().expect("a TicketHold holds its ticket until taken")
    }
}

impl Drop for TicketHold {
    fn drop(&mut self) {
        let Some(t) = self.ticket.take() else { return };
        let e = &self.engine;
        // C8 canary: an unread ticket is dropped, its lock left to expire.
        if t.session().is_empty() || crate::canary::active(crate::canary::Canary::C8TicketUnreleased) {
            return;
        }
        e.inner.metrics.fetch_tickets_unused.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(owner = %t.owner, session = t.session(), "a transfer ticket not read from is released");
        if t.owner == *e.node() {
            tracing::trace!(target: FETCH_RELEASE_TRACE_TARGET, session = t.session(), "release sent");
            let _ = e.release_transfer(t.session());
        } else if let Ok(p) = e.inner.peers.get(&t.owner, e.inner.cfg.peer_rpc_timeout) {
            spawn_release(p.grpc.clone(), t.answer.transfer_session_id, e.inner.cfg.peer_rpc_timeout);
        }
        // (No client for the owner: the lock expires there.)
    }
}

impl Engine {
    /// Fetches the missing part of `hashes` (a chained prefix) from peers.
    /// Never fails and never hangs: it ends by the engine's fetch deadline
    /// with "k of n" (C9). See the module doc.
    pub async fn fetch(&self, namespace: &str, hashes: &[BlockHash]) -> FetchReport {
        self.fetch_inner(namespace, hashes, None, None, Known::Nothing).await.0
    }

    /// [`Engine::fetch`] that also ends by the caller's `deadline` (the
    /// earlier of it and the engine's own fetch deadline): an embedder's
    /// timeout, passed down so that every step of the fetch — query,
    /// handshake, lock RPC (not sent once the deadline passed; a grant that
    /// arrives after it is released at once), reads, checksum pass — runs
    /// under that one instant instead of the caller cutting the fetch from
    /// outside. The release is handed to a task of its own and not waited
    /// for. A part read but not checked by the deadline is not kept.
    pub async fn fetch_with_deadline(&self, namespace: &str, hashes: &[BlockHash], deadline: Instant) -> FetchReport {
        self.fetch_inner(namespace, hashes, None, Some(deadline), Known::Nothing).await.0
    }

    /// [`Engine::fetch`]; with `load`, also loads each block into the
    /// caller's index as soon as it is resident (see [`Engine::fetch_into`]):
    /// returns the per-block load results of the available prefix. The
    /// fetch ends by the earlier of `until` and the engine's fetch deadline.
    pub(crate) async fn fetch_inner<'a>(
        &'a self,
        namespace: &'a str,
        hashes: &'a [BlockHash],
        load: Option<&'a [(BlockHash, u64)]>,
        until: Option<Instant>,
        known: Known,
    ) -> (FetchReport, Option<Result<LoadReport, EngineError>>) {
        self.inner.metrics.fetches.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        // C9 canary: the deadline is a thousand times the configured one.
        let own = if crate::canary::active(crate::canary::Canary::C9FetchDeadlineStretched) {
            started + self.inner.cfg.fetch_deadline * 1000
        } else {
            started + self.inner.cfg.fetch_deadline
        };
        let deadline = until.map_or(own, |u| u.min(own));
        let local = self.stage_local_prefix(namespace, hashes, deadline).await;
        let staged = started.elapsed();
        let mut pipe = load.map(|blocks| LoadPipe {
            blocks,
            deadline,
            results: vec![None; blocks.len()],
            error: None,
            running: FuturesUnordered::new(),
        });
        if let Some(p) = &mut pipe {
            p.start(self, namespace, 0..local);
        }
        let mut rep =
            FetchReport { requested: hashes.len(), available: local, local_hits: local, ..Default::default() };
        let setup = match (self.layout(namespace), self.transport()) {
            _ if local == hashes.len() => None,
            (Err(_), _) => {
                rep.stopped = Some(FetchError::UnknownNamespace);
                None
            }
            (_, None) => {
                rep.stopped = Some(FetchError::NoTransport);
                None
            }
            (Ok((ns, layout)), Some(t)) => Some((ns, layout, t.clone())),
        };
        // What the caller knows: the MetaServer's answer, or an owner's
        // ticket (its owner then answers the first query, and its grant
        // the first lock on that owner); a ticket not read from is
        // released as it drops.
        let (owners, ticket) = match known {
            Known::Nothing => (None, None),
            Known::Owners(o) => (Some(o), None),
            Known::Ticket(h) if setup.is_some() && h.usable(namespace, hashes, local) => {
                let owner = h.owner().cloned().expect("a usable ticket");
                let promised = h.promised.min(hashes.len());
                (Some(vec![(owner, u32::try_from(promised).unwrap_or(u32::MAX))]), Some(h))
            }
            Known::Ticket(_) => (None, None),
        };
        if let Some((ns, layout, transport)) = setup {
            let block_bytes = layout.block_bytes().max(1);
            let cfg = MachineConfig {
                me: self.node().clone(),
                family: layout.family(),
                block_bytes,
                part_blocks: part_blocks(
                    hashes.len() - local,
                    block_bytes,
                    self.inner.cfg.fetch_read_part_bytes,
                    self.inner.cfg.fetch_reads_in_flight,
                ),
                reads_in_flight: self.inner.cfg.fetch_reads_in_flight.max(1),
                owners_max: crate::limits::FETCH_OWNERS_MAX,
                // The ticket's lock may have expired, or granted less than
                // its owner holds by now: that owner may be asked once more.
                retry_owner: ticket.as_ref().and_then(|h| h.owner().cloned()),
            };
            let (m, first) = FetchMachine::start(cfg, hashes.to_vec(), local);
            let ends = slot_ends(&layout);
            let mut d = Driver {
                engine: self,
                namespace,
                hashes,
                ns,
                layout,
                transport,
                deadline,
                m,
                slots: Vec::new(),
                peer: None,
                reads: 0,
                verifies: 0,
                rpc: None,
                phases: FetchPhases::default(),
                load: pipe.take(),
                granted: Vec::new(),
                device: None,
                gate: Gate::default(),
                device_parts: HashMap::new(),
                defer_slots: false,
                landed_sums: HashMap::new(),
                slot_ends: ends,
                device_done: std::collections::HashSet::new(),
                known_owners: owners,
                ticket,
            };
            d.run(first).await;
            rep = d.m.report().clone();
            rep.phases = d.phases;
            pipe = d.load.take();
        }
        rep.phases.stage = staged;
        let Some(mut p) = pipe else { return (rep, None) };
        // The loads still running after the last part.
        let tail = Instant::now();
        while let Some(done) = p.running.next().await {
            p.finished(done);
        }
        rep.phases.load_tail += tail.elapsed();
        if let Some(e) = p.error {
            return (rep, Some(Err(e)));
        }
        let results =
            p.results[..rep.available].iter().map(|r| r.clone().unwrap_or(Err(LoadError::NotResident))).collect();
        (rep, Some(Ok(LoadReport { results })))
    }

    /// Up to `n` pool slots of `bytes` each, fewer when the pool (after
    /// eviction) has no room for more.
    fn alloc_slots(&self, bytes: u64, n: usize) -> Vec<Extent> {
        (0..n).map_while(|_| self.alloc(bytes).ok()).collect()
    }

    /// `owner`'s pool as a source of one-step copies into the KV: the
    /// shared region `transport` mapped for it, region 0 (the owner's pool,
    /// which every pool read names, see `read_ops`), when this engine
    /// copies from shared pools in one step
    /// ([`super::EngineConfig::shared_pool_direct`]).
    fn one_step_pool_region(&self, transport: &dyn Transport, owner: &NodeAddr) -> Option<SharedRegion> {
        if !self.inner.cfg.shared_pool_direct {
            return None;
        }
        transport.shared_region(owner).filter(|r| r.region == 0)
    }

    /// Connects to `peer` ahead of any fetch: the transfer handshake (the
    /// one a fetch would make, single-flight per peer) and, when the peer
    /// is on this host and its pool is mapped here, the opening of that
    /// pool as a source of one-step copies into the KV (for `cuda`,
    /// registering it: ≈ 60 ms per GiB on the H200, which stalls other
    /// copies of this process while it runs). Engines call it at start-up
    /// for the peers they will read from, as vLLM's P/D connectors
    /// handshake their remote agents before the first request, so no
    /// request pays for it. Waits at most `timeout` for both: a peer that is not up yet
    /// (nothing listens, the RPC times out, its transport refuses the
    /// connection) is tried again after
    /// [`crate::limits::CONNECT_PEER_RETRY_MIN`], the pause doubling to
    /// [`crate::limits::CONNECT_PEER_RETRY_MAX`], until `timeout`, so
    /// engines started in any order can call it at start-up; each try is
    /// bounded by the engine's peer RPC timeout.
    ///
    /// The pause before a try shrinks to half the time left when that is
    /// shorter, so the last try comes within
    /// [`crate::limits::CONNECT_PEER_RETRY_MIN`] of the timeout: a peer
    /// that comes up just before it is still found.
    ///
    /// # Errors
    /// [`FetchError::Deadline`] when `timeout` passed before a handshake
    /// succeeded, with the last try's failure
    /// ([`ConnectError::last_try`]); at once, a failure that trying again
    /// cannot fix: an address that is not one ([`FetchError::Peer`]), an
    /// owner that refused the handshake or sent metadata that does not
    /// decode ([`FetchError::Handshake`]), no transport
    /// ([`FetchError::NoTransport`]). A failed connect leaves no state
    /// behind, and a later fetch tries again.
    pub async fn connect_peer(&self, peer: &NodeAddr, timeout: Duration) -> Result<SharedPool, ConnectError> {
        let stretch = if crate::canary::active(crate::canary::Canary::C9ConnectPastTimeout) {
            Duration::from_secs(5)
        } else {
            Duration::ZERO
        };
        let deadline = Instant::now() + timeout + stretch;
        let mut pause = crate::limits::CONNECT_PEER_RETRY_MIN;
        let p = loop {
            let p = self
                .inner
                .peers
                .get(peer, self.inner.cfg.peer_rpc_timeout)
                .map_err(|e| FetchError::Peer(PeerFailure::Endpoint(e.to_string())))?;
            let e = match self.handshake(peer, &p, deadline).await {
                Ok(()) => break p,
                Err(e) => e,
            };
            self.inner.peers.invalidate(peer, &p);
            if !connect_retryable(&e) {
                return Err(e.into());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left < crate::limits::CONNECT_PEER_RETRY_MIN {
                tracing::info!(peer = %peer.0, ?timeout, last = %e, "connect_peer: no handshake within the timeout");
                return Err(ConnectError { error: FetchError::Deadline, last_try: Some(e) });
            }
            let nap = pause.min(left / 2);
            tracing::debug!(peer = %peer.0, error = %e, ?nap, "connect_peer: handshake failed, trying again");
            tokio::time::sleep(nap).await;
            pause = (pause * 2).min(crate::limits::CONNECT_PEER_RETRY_MAX);
        };
        let region = self.transport().and_then(|t| self.one_step_pool_region(t.as_ref(), peer));
        let Some(region) = region else { return Ok(SharedPool::NotMapped) };
        loop {
            if p.shared_source(self.gpu(), region.clone()).is_some() {
                return Ok(SharedPool::Ready);
            }
            if p.shared_opened(&region) == Some(false) {
                return Ok(SharedPool::Refused);
            }
            if Instant::now() >= deadline {
                return Ok(SharedPool::Opening);
            }
            tokio::time::sleep(SHARED_OPEN_POLL).await;
        }
    }

    async fn handshake(&self, owner: &NodeAddr, p: &PeerState, deadline: Instant) -> Result<(), FetchError> {
        let transport = self.transport().ok_or(FetchError::NoTransport)?.clone();
        p.handshake
            .get_or_try_init(|| async {
                let req = RdmaHandshakeRequest {
                    requester_id: self.node().0.clone(),
                    handshake_metadata: transport.local_metadata().encode().into(),
                };
                let mut grpc = p.grpc.clone();
                let resp = timeout_at(deadline, grpc.rdma_handshake(req))
                    .await
                    .map_err(|_| FetchError::Deadline)?
                    .map_err(|s| FetchError::Handshake(HandshakeFailure::Rpc(RpcFailure::from_status(&s))))?
                    .into_inner();
                if !resp.status.as_ref().is_some_and(|s| s.ok) {
                    let msg = resp.status.map(|s| s.message).unwrap_or_default();
                    return Err(FetchError::Handshake(HandshakeFailure::Refused(msg)));
                }
                let meta = HandshakeMetadata::decode(&resp.handshake_metadata)
                    .map_err(|e| FetchError::Handshake(HandshakeFailure::Metadata(e)))?;
                transport
                    .connect(owner, &meta, deadline)
                    .await
                    .map_err(|e| FetchError::Handshake(HandshakeFailure::Transport(e)))
            })
            .await
            .map(|_| ())
    }
}

impl<'a> Driver<'a> {
    /// Performs actions and feeds outcomes back until the machine is done.
    async fn run(&mut self, first: Vec<Action>) {
        let mut queue: VecDeque<Action> = first.into();
        let mut pending: Pending<'a> = FuturesUnordered::new();
        let mut deadline_fed = false;
        loop {
            while let Some(action) = queue.pop_front() {
                if action == Action::Done {
                    return;
                }
                let t0 = Instant::now();
                // Issuing a read (its pool reads; a one-step part is
                // planned and submitted on a task of its own) is part of the
                // read; the rest is `seal`'s bookkeeping.
                let phase = match action {
                    Action::Release { .. } => Phase::Release,
                    Action::Read { .. } => Phase::Read,
                    Action::Lock { .. } => Phase::Lock,
                    _ => Phase::Seal,
                };
                if let Some(ev) = self.perform(action, &mut pending) {
                    queue.extend(self.m.step(ev));
                }
                let p = &mut self.phases;
                *(match phase {
                    Phase::Release => &mut p.release,
                    Phase::Lock => &mut p.lock,
                    Phase::Read => &mut p.read,
                    Phase::Seal => &mut p.seal,
                }) += t0.elapsed();
            }
            let t0 = Instant::now();
            let deadline = self.deadline;
            if !deadline_fed && t0 >= deadline {
                // Before any outcome that is ready too: a part read or
                // checked by now is judged as after the deadline (no CRC
                // pass starts, C9), and a stream of ready outcomes cannot
                // hold the deadline back.
                deadline_fed = true;
                queue.extend(self.m.step(Event::Deadline));
                continue;
            }
            let loading = self.load.as_ref().is_some_and(|p| !p.running.is_empty());
            let load = &mut self.load;
            // (select! drops every branch's future before a handler runs.)
            let outcome = tokio::select! {
                biased;
                Some(o) = pending.next() => Some(o),
                Some(done) = async { load.as_mut()?.running.next().await }, if loading => {
                    if let Some(p) = load {
                        p.finished(done);
                    }
                    None
                }
                () = tokio::time::sleep_until(deadline), if !deadline_fed => {
                    deadline_fed = true;
                    Some(Outcome::Rpc(Event::Deadline))
                }
                else => {
                    // Nothing in flight and no event to come: a machine bug.
                    debug_assert!(false, "fetch machine waits with nothing in flight");
                    return;
                }
            };
            let waited = t0.elapsed();
            *self.blocking_phase() += waited;
            let Some(outcome) = outcome else { continue };
            let ev = self.absorb(outcome);
            if let Event::Locked(Ok(grant)) = &ev {
                // The simulator checks that every lock a fetch saw granted
                // is released exactly once by it (C8).
                tracing::trace!(
                    target: FETCH_LOCK_TRACE_TARGET,
                    me = %self.engine.node(),
                    session = %grant.session,
                    "lock granted to fetch"
                );
                self.granted.push(grant.session.clone());
            }
            queue.extend(self.m.step(ev));
        }
    }

    /// The phase the last wait is charged to.
    fn blocking_phase(&mut self) -> &mut Duration {
        let p = &mut self.phases;
        if self.reads > 0 {
            return &mut p.read;
        }
        if self.verifies > 0 {
            return &mut p.verify;
        }
        match self.rpc {
            Some(Rpc::Query) => &mut p.query,
            Some(Rpc::Handshake) => &mut p.handshake,
            Some(Rpc::Lock) => &mut p.lock,
            // Nothing but loads of sealed parts in flight.
            None => &mut p.load_tail,
        }
    }

    /// Puts slots back into the table and turns an outcome into an event.
    fn absorb(&mut self, outcome: Outcome) -> Event {
        match outcome {
            Outcome::Rpc(ev) => {
                if !matches!(ev, Event::Deadline) {
                    self.rpc = None;
                }
                ev
            }
            Outcome::Locked(res, device) => {
                self.rpc = None;
                self.device = device.map(Arc::new);
                // The machine owns the grant from here (it releases it, C8).
                Event::Locked(res.map(|g| g.take()))
            }
            Outcome::DeviceRead { part, first, local, sums } => {
                self.reads -= 1;
                self.put_back(first, local);
                let results = vec![Ok(()); sums.len()];
                self.device_parts.insert(part, sums);
                Event::ReadDone { part, results }
            }
            Outcome::Read { part, first, done } => {
                self.reads -= 1;
                self.put_back(first, done.local);
                // Keyed by part index, which a later owner's parts reuse:
                // never leave an earlier read's sums behind.
                if done.sums.iter().any(Option::is_some) {
                    self.landed_sums.insert(part, done.sums);
                } else {
                    self.landed_sums.remove(&part);
                }
                Event::ReadDone { part, results: done.results }
            }
            Outcome::Verified { part, first, local, sums } => {
                self.verifies -= 1;
                self.put_back(first, local);
                Event::Verified { part, sums }
            }
        }
    }

    fn put_back(&mut self, first: usize, local: Vec<Extent>) {
        for (i, e) in local.into_iter().enumerate() {
            if let Some(slot) = self.slots.get_mut(first + i) {
                *slot = Some(e);
            }
        }
    }

    fn take(&mut self, blocks: &std::ops::Range<usize>) -> Vec<Extent> {
        self.slots[blocks.clone()].iter_mut().filter_map(Option::take).collect()
    }

    /// Performs one action: synchronous ones return their event at once,
    /// async ones join `pending`.
    fn perform(&mut self, action: Action, pending: &mut Pending<'a>) -> Option<Event> {
        let engine = self.engine;
        match action {
            Action::QueryOwners { from } => {
                if let Some(known) = self.known_owners.take() {
                    // The caller's answer counts from the first hash; the
                    // machine asks from `from` (past the local prefix).
                    let me = engine.node();
                    let rest: Vec<(NodeAddr, u32)> = known
                        .into_iter()
                        .filter_map(|(n, k)| Some((n, k.checked_sub(u32::try_from(from).ok()?)?)))
                        .filter(|(n, k)| *k > 0 && n != me)
                        .collect();
                    if !rest.is_empty() {
                        if self.ticket.is_none() {
                            engine.inner.metrics.fetch_known_owners.fetch_add(1, Ordering::Relaxed);
                        }
                        return Some(Event::KnownOwners(rest));
                    }
                }
                let left = self.deadline.saturating_duration_since(Instant::now());
                let (ns, rest) = (self.namespace, &self.hashes[from..]);
                self.rpc = Some(Rpc::Query);
                pending.push(Box::pin(async move {
                    let res = engine.client().query_prefix(ns, rest, left).await.map_err(|e| e.rpc_failure());
                    Outcome::Rpc(Event::Owners(res))
                }));
                None
            }
            Action::Handshake { owner } => {
                let p = match engine
                    .inner
                    .peers
                    .get(&owner, engine.inner.cfg.peer_rpc_timeout)
                    .map_err(|e| FetchError::Peer(PeerFailure::Endpoint(e.to_string())))
                {
                    Ok(p) => p,
                    Err(e) => return Some(Event::Handshake(Err(e))),
                };
                self.peer = Some((owner.clone(), p.clone()));
                let deadline = self.deadline;
                self.rpc = Some(Rpc::Handshake);
                pending.push(Box::pin(async move {
                    Outcome::Rpc(Event::Handshake(engine.handshake(&owner, &p, deadline).await))
                }));
                None
            }
            Action::Lock { owner, blocks } => {
                let Some(mut grpc) = self.grpc(&owner) else {
                    return Some(Event::Locked(Err(FetchError::Peer(PeerFailure::NoClient))));
                };
                // Device ranges are asked for only where they can land: a
                // fetch into the engine's KV, a backend with peer copies.
                let device = self.load.as_ref().and_then(|_| engine.device_capability());
                let covers = |h: &mut TicketHold| h.owner() == Some(&owner) && blocks.start < h.promised;
                if let Some(h) = self.ticket.take_if(covers) {
                    // The owner's grant is here already: the same answer
                    // its lock RPC gives, checked the same way, its device
                    // lease aged now and used only where a lock RPC would
                    // have asked for one.
                    engine.inner.metrics.fetch_tickets.fetch_add(1, Ordering::Relaxed);
                    self.rpc = Some(Rpc::Lock);
                    self.device = None;
                    let t = h.take();
                    let ms_left = t.device_ms_left();
                    let TransferTicket { hashes, mut answer, .. } = *t;
                    answer.device_lease_ms_left = ms_left;
                    if device.is_none() {
                        answer.device_buffers.clear();
                        answer.device_layout = None;
                    }
                    let (grant, device) = from_answer(answer, &hashes, &self.layout, Instant::now());
                    let timeout = engine.inner.cfg.peer_rpc_timeout;
                    let locked = Outcome::Locked(Ok(Box::new(LateRelease::new(grant, grpc, timeout))), device);
                    pending.push(Box::pin(std::future::ready(locked)));
                    return None;
                }
                // The packed answer names each block by its index here.
                let requested: Vec<BlockHash> = self.hashes[blocks].to_vec();
                let req = QueryBlocksForTransferRequest {
                    namespace: self.namespace.to_string(),
                    block_hashes: requested.iter().map(|h| h.0.clone()).collect(),
                    requester_id: engine.node().0.clone(),
                    device,
                    compact_slots: true,
                    packed_blocks: true,
                };
                if Instant::now() >= self.deadline {
                    // Not sent: no answer could arrive in time.
                    return Some(Event::Locked(Err(FetchError::Deadline)));
                }
                self.rpc = Some(Rpc::Lock);
                self.device = None;
                // The RPC runs in a task of its own, bounded by the peer RPC
                // timeout rather than the fetch's deadline: when the fetch
                // ends first (deadline, cancel), the task still gets the
                // owner's answer and a grant nobody took is released at
                // once instead of waiting out the owner's lock timeout (C8).
                let rpc_timeout = engine.inner.cfg.peer_rpc_timeout;
                let layout = self.layout.clone();
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let t0 = Instant::now();
                    let answer = tokio::time::timeout(rpc_timeout, grpc.query_blocks_for_transfer(req)).await;
                    let answered = t0.elapsed();
                    let (res, device) = match answer {
                        Err(_) => (Err(FetchError::Peer(PeerFailure::Timeout)), None),
                        Ok(Err(s)) => (Err(FetchError::Peer(PeerFailure::Rpc(RpcFailure::from_status(&s)))), None),
                        Ok(Ok(r)) => {
                            let r = r.into_inner();
                            if r.transfer_session_id.is_empty() {
                                (Err(FetchError::Stale), None)
                            } else {
                                let (grant, device) = from_answer(r, &requested, &layout, Instant::now());
                                (Ok(Box::new(LateRelease::new(grant, grpc, rpc_timeout))), device)
                            }
                        }
                    };
                    tracing::debug!(
                        target: crate::gpu::peer::PEER_TIMING_TRACE_TARGET,
                        answered = answered.as_micros() as u64,
                        parsed = (t0.elapsed() - answered).as_micros() as u64,
                        "transfer lock answer"
                    );
                    // A send to a fetch that ended drops the outcome, whose
                    // `LateRelease` then releases the grant.
                    let _ = tx.send(Outcome::Locked(res, device));
                });
                pending.push(Box::pin(async move {
                    rx.await.unwrap_or(Outcome::Locked(Err(FetchError::Peer(PeerFailure::TaskEnded)), None))
                }));
                None
            }
            Action::Alloc { blocks } => {
                // Where every part is expected to go straight into the
                // engine's KV, the pool slots would only serve a fallback:
                // they are taken when a part falls back instead, so a
                // one-step fetch neither evicts the pool's blocks nor pays
                // for slots it never fills.
                self.defer_slots = self.one_step_expected();
                if self.defer_slots {
                    self.slots = (0..blocks).map(|_| None).collect();
                } else {
                    let bytes = self.layout.block_bytes();
                    self.slots = engine.alloc_slots(bytes, blocks).into_iter().map(Some).collect();
                }
                Some(Event::Allocated(self.slots.len()))
            }
            Action::Read { part, blocks } => {
                let Some((owner, session)) = self.m.transfer_session() else {
                    let results = vec![Err(TransportError::NotConnected(NotConnected::NoSession)); blocks.len()];
                    return Some(Event::ReadDone { part, results });
                };
                let t0 = Instant::now();
                let (owner, session) = (owner.clone(), session.to_string());
                let plan: Vec<&LockedBlock> = self.m.plan()[blocks.clone()].iter().collect();
                let ops = read_ops(&self.layout, &plan);
                let direct = self.device_copy(&blocks, &plan, &ops);
                tracing::debug!(
                    target: crate::gpu::peer::PEER_TIMING_TRACE_TARGET,
                    blocks = blocks.len(),
                    issued = t0.elapsed().as_micros() as u64,
                    "read part issued"
                );
                let local = self.take(&blocks);
                let (transport, deadline, ends) = (self.transport.clone(), self.deadline, self.slot_ends.clone());
                // Slots deferred at `Alloc`: taken now if this part falls
                // back; any the pool cannot give fail the part's reads.
                let defer = self.defer_slots.then(|| (self.layout.block_bytes(), blocks.len()));
                self.reads += 1;
                let first = blocks.start;
                pending.push(Box::pin(async move {
                    if let Some(copy) = direct {
                        match copy.await {
                            Ok(sums) => return Outcome::DeviceRead { part, first, local, sums },
                            Err((kind, e)) => {
                                let m = &engine.inner.metrics;
                                match kind {
                                    Direct::Lease => m.device_fallbacks.fetch_add(1, Ordering::Relaxed),
                                    Direct::Shared => m.shared_direct_fallbacks.fetch_add(1, Ordering::Relaxed),
                                };
                                tracing::debug!(error = %e, ?kind, "one-step part falls back to the pool path");
                            }
                        }
                    }
                    let (local, ops) = match defer {
                        Some((bytes, n)) => {
                            if Instant::now() >= deadline {
                                // No slot is taken (and nothing evicted) for
                                // a read the deadline already refuses.
                                let results = vec![Err(TransportError::Timeout); n];
                                return Outcome::Read {
                                    part,
                                    first,
                                    done: ReadCompletion::unsummed(Vec::new(), results),
                                };
                            }
                            let local = engine.alloc_slots(bytes, n);
                            // Blocks the pool had no slot for are not read:
                            // the completion comes back shorter than the
                            // part, which stops the fetch there with
                            // `NoSpace` and keeps the blocks before.
                            let got = local.len();
                            (local, ops.into_iter().filter(|op| op.local_extent < got).collect())
                        }
                        None => (local, ops),
                    };
                    if local.is_empty() {
                        return Outcome::Read { part, first, done: ReadCompletion::unsummed(local, Vec::new()) };
                    }
                    let done = transport.read_summed(&owner, &session, ops, local, ends, deadline).await;
                    Outcome::Read { part, first, done }
                }));
                None
            }
            Action::Verify { part, blocks, read_ok } => {
                if let Some(sums) = self.device_parts.remove(&part) {
                    // Checked on the device against the owner's checksums
                    // as they landed in this engine's KV.
                    let base = self.m.plan_base().unwrap_or(0);
                    self.device_done.extend(blocks.clone().map(|i| base + i));
                    return Some(Event::Verified { part, sums: sums.into_iter().map(Some).collect() });
                }
                let local = self.take(&blocks);
                let layout = self.layout.clone();
                let landed = self.landed_sums.remove(&part);
                let task_bytes_min = engine.inner.cfg.fetch_verify_task_bytes_min;
                // C10 canary: the fetcher takes the owner's checksums for
                // what it read, so nothing is ever rejected.
                let trusted: Option<Vec<Arc<[u32]>>> = crate::canary::active(crate::canary::Canary::C10WeakChecksum)
                    .then(|| self.m.plan()[blocks.clone()].iter().map(|b| b.slot_crcs()).collect());
                self.verifies += 1;
                let deadline = self.deadline;
                pending.push(Box::pin(async move {
                    let (local, mut sums) = match landed {
                        // Summed as the bytes landed: only an extent the
                        // transport could not sum goes through the pass.
                        Some(landed) => {
                            let landed: Vec<Option<Arc<[u32]>>> =
                                landed.into_iter().chain(std::iter::repeat(None)).take(local.len()).collect();
                            let need: Vec<bool> =
                                read_ok.iter().zip(&landed).map(|(ok, l)| *ok && l.is_none()).collect();
                            if need.contains(&true) {
                                let (local, passed) =
                                    verify_slots(&layout, local, need.clone(), task_bytes_min, deadline).await;
                                (local, merge_sums(&read_ok, &need, landed, passed))
                            } else {
                                (local, merge_sums(&read_ok, &need, landed, Vec::new()))
                            }
                        }
                        None => verify_slots(&layout, local, read_ok, task_bytes_min, deadline).await,
                    };
                    if let Some(trusted) = trusted {
                        for (s, t) in sums.iter_mut().zip(trusted) {
                            if s.is_some() {
                                *s = Some(t);
                            }
                        }
                    }
                    Outcome::Verified { part, first: blocks.start, local, sums }
                }));
                None
            }
            Action::Seal { blocks, hashes, sums } => {
                let mut bytes = 0;
                let mut pooled = Vec::new();
                for ((i, h), sums) in blocks.clone().zip(hashes.clone()).zip(sums) {
                    let Some(ext) = self.slots[i].take() else { continue };
                    if self.device_done.contains(&h) {
                        // Already in the engine's KV, verified there: the
                        // slot was only the fallback's.
                        drop(ext);
                        continue;
                    }
                    bytes += ext.len();
                    let block = CachedBlock { extent: ext.seal(), checksums: sums };
                    engine.insert_sealed(&self.ns, self.hashes[h].clone(), block);
                    pooled.push(h);
                }
                // Registered in the same synchronous step that sealed them
                // (as `save` does): deferring it let an eviction in between
                // enqueue the removal before the insert, leaving a stale
                // owner entry; a cancel there left resident blocks never
                // registered (found by the simulator).
                let advertised: Vec<BlockHash> = pooled.iter().map(|&h| self.hashes[h].clone()).collect();
                engine.advertise(&self.ns, &advertised);
                if let Some(p) = &mut self.load {
                    for h in hashes.clone().filter(|h| self.device_done.contains(h)) {
                        p.results[h] = Some(Ok(()));
                    }
                    for run in runs(&pooled) {
                        p.start(engine, self.namespace, run);
                    }
                }
                let m = &engine.inner.metrics;
                m.fetched_blocks.fetch_add(pooled.len() as u64, Ordering::Relaxed);
                m.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
                None
            }
            Action::Free { blocks } => {
                drop(self.take(&blocks));
                None
            }
            Action::Rejected { hash, .. } => {
                engine.inner.metrics.checksum_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    target: FETCH_REJECT_TRACE_TARGET,
                    block = ?self.hashes[hash],
                    "fetched block rejected: its checksums differ from the owner's (C10)"
                );
                None
            }
            Action::ForgetPeer { owner, disconnect } => {
                if let Some((addr, p)) = &self.peer {
                    if *addr == owner {
                        engine.inner.peers.invalidate(&owner, p);
                    }
                }
                if disconnect {
                    self.transport.disconnect(&owner);
                }
                None
            }
            Action::Release { owner, session } => {
                // C8 canary: locks taken by a fetch that stopped short are
                // never released.
                if crate::canary::active(crate::canary::Canary::C8ReleaseForgotten) && self.m.report().stopped.is_some()
                {
                    return Some(Event::Released);
                }
                let Some(grpc) = self.grpc(&owner) else { return Some(Event::Released) };
                // Off the critical path: by now every part of this lock was
                // read and verified (or given up), nothing waits for the
                // owner's answer (release is idempotent and its outcome
                // unused, C8), so the fetch goes on at once while a task of
                // its own releases exactly once, even after the fetch
                // returned or was dropped. (Awaited, it was one more RPC
                // round trip in every handoff.)
                spawn_release(grpc, session, engine.inner.cfg.peer_rpc_timeout);
                Some(Event::Released)
            }
            Action::Done => None,
        }
    }

    /// The one-step copy of read part `blocks` (plan indices) into the
    /// engine's KV, when this is a fetch into it ([`Engine::fetch_into`]):
    /// device to device when the current lock offered device ranges for
    /// every block of the part and enough of the lease is left (C19), else
    /// straight from the owner's mapped shared pool when the GPU backend
    /// opened it as a copy source (issue 28 item 3). One peer batch either
    /// way, resolving to each block's slot checksums once they match the
    /// owner's (C10), or to why the part must be read into the pool
    /// instead. `None`: no one-step path for this part. `plan` and `ops`:
    /// the part's blocks and their pool reads ([`read_ops`]).
    fn device_copy(
        &self,
        blocks: &std::ops::Range<usize>,
        plan: &[&LockedBlock],
        ops: &[ReadOp],
    ) -> Option<DirectCopy<'a>> {
        let load = self.load.as_ref()?;
        let base = self.m.plan_base()?;
        let (owner, peer) = self.peer.as_ref().map(|(a, p)| (a.clone(), p.clone()))?;
        let dst: Vec<u64> = blocks.clone().map(|i| load.blocks[base + i].1).collect();
        let gpu = self.engine.gpu().clone();
        let layout = self.layout.clone();
        let offered = self.device.as_ref().filter(|_| plan.iter().all(|b| b.device_block.is_some()));
        let Some(side) = offered else {
            let region = self.engine.one_step_pool_region(self.transport.as_ref(), &owner)?;
            let source = peer.shared_source(&gpu, region)?;
            let sources = shared_blocks(plan, ops);
            return Some(spawn_direct(self.engine, &self.gate, Direct::Shared, self.deadline, move || {
                let plan = device::plan_copies(&layout, &sources, &dst)
                    .map_err(|e| format!("the owner's pool ranges: {e}"))?;
                let batch =
                    crate::gpu::peer::PeerCopyBatch { sources: vec![source], ops: plan.ops, checksums: plan.checksums };
                Ok(DirectBatch { batch, expected: plan.expected, bytes: plan.bytes, lease_session: None })
            }));
        };
        let (side, until) = (side.clone(), side.until);
        let lease_left = move || {
            if Instant::now() >= until { Err("too little of the device lease is left".to_string()) } else { Ok(()) }
        };
        if let Err(why) = lease_left() {
            return Some(Box::pin(std::future::ready(Err((Direct::Lease, why)))));
        }
        let owned: Vec<device::LeaseBlock> = plan.iter().map(|&b| b.into()).collect();
        let session = self.m.transfer_session().map(|(_, s)| s.to_string()).unwrap_or_default();
        Some(spawn_direct(self.engine, &self.gate, Direct::Lease, self.deadline, move || {
            let t0 = Instant::now();
            let plan = device::plan_part(&layout, &side.layout, &owned, &dst)
                .map_err(|e| format!("owner's device ranges: {e}"))?;
            tracing::debug!(
                target: crate::gpu::peer::PEER_TIMING_TRACE_TARGET,
                ops = plan.ops.len(),
                planned = t0.elapsed().as_micros() as u64,
                "device part planned"
            );
            let (sources, ops) = open_exports(gpu.as_ref(), &peer, &side.exports, plan.ops)?;
            // Checked again after planning: no copy starts after the lease.
            lease_left()?;
            let batch = crate::gpu::peer::PeerCopyBatch { sources, ops, checksums: plan.checksums };
            Ok(DirectBatch { batch, expected: plan.expected, bytes: plan.bytes, lease_session: Some(session) })
        }))
    }

    /// Whether every part of the current plan is expected to take a
    /// one-step path into the engine's KV ([`Self::device_copy`]): a fetch
    /// into it, and either device ranges offered for every planned block
    /// with lease left, or the owner's pool open as a copy source. Only a
    /// forecast: a part that falls back still gets pool slots.
    fn one_step_expected(&self) -> bool {
        if self.load.is_none() {
            return false;
        }
        let plan = self.m.plan();
        if let Some(side) = &self.device
            && Instant::now() < side.until
            && plan.iter().all(|b| b.device_block.is_some())
        {
            return true;
        }
        let Some((owner, peer)) = &self.peer else { return false };
        // Without opening it (that is the read's to start).
        self.engine
            .one_step_pool_region(self.transport.as_ref(), owner)
            .is_some_and(|r| peer.shared_opened(&r) == Some(true))
    }

    /// The gRPC client of `owner` (the current peer entry, else the table's).
    fn grpc(&self, owner: &NodeAddr) -> Option<EngineClient<Channel>> {
        match &self.peer {
            Some((addr, p)) if addr == owner => Some(p.grpc.clone()),
            _ => {
                self.engine.inner.peers.get(owner, self.engine.inner.cfg.peer_rpc_timeout).ok().map(|p| p.grpc.clone())
            }
        }
    }
}

impl Drop for Driver<'_> {
    fn drop(&mut self) {
        // Before any release: a part task planning now submits before this
        // returns, or never.
        self.gate.close();
        if !self.granted.is_empty() {
            tracing::trace!(
                target: FETCH_END_TRACE_TARGET,
                me = %self.engine.node(),
                sessions = %self.granted.join(","),
                "fetch over"
            );
        }
        // A fetch dropped half way (cancelled, or unwinding): release what
        // the machine still holds (C8). Slots go back to the pool with
        // `self.slots`; slots inside a read in flight come back through the
        // transport when that read completes (C11).
        for action in self.m.abandon() {
            let Action::Release { owner, session } = action else { continue };
            if crate::canary::active(crate::canary::Canary::C8ReleaseForgotten) {
                continue;
            }
            let Some(grpc) = self.grpc(&owner) else { continue };
            spawn_release(grpc, session, self.engine.inner.cfg.peer_rpc_timeout);
        }
    }
}

/// An owner's lock answer in the fetch machine's terms: the one place the
/// wire's block descriptions are converted. The device half is checked
/// whole ([`device::DeviceSide::from_answer`]: exports, the owner's device
/// layout against `layout`'s family, the lease left); a block keeps its
/// device index only when that half was accepted and the index lies inside
/// the owner's layout, so every other block — and any part holding one —
/// is read from the owner's pool.
fn from_answer(
    r: QueryBlocksForTransferResponse,
    requested: &[BlockHash],
    layout: &Layout,
    now: Instant,
) -> (LockGrant, Option<device::DeviceSide>) {
    let device = device::DeviceSide::from_answer(
        &r.device_buffers,
        r.device_layout.as_ref(),
        r.device_lease_ms_left,
        layout,
        now,
    );
    let mut refused = 0usize;
    let mut checked = |index: Option<u64>| {
        index.filter(|&i| {
            let ok = device.as_ref().is_some_and(|d| d.layout.has_block(i));
            refused += usize::from(!ok && device.is_some());
            ok
        })
    };
    let blocks = if r.blocks.is_empty() && !r.packed_index.is_empty() {
        packed_blocks(&r, requested)
            .unwrap_or_default()
            .into_iter()
            .map(|(hash, slots, device_block)| LockedBlock { hash, slots, device_block: checked(device_block) })
            .collect()
    } else if r.blocks.len() > requested.len() {
        // More blocks than asked for: not an owner's answer (each grants
        // a requested block at most once); none is read.
        tracing::debug!(
            blocks = r.blocks.len(),
            requested = requested.len(),
            "a lock answer with more blocks than requested: none is read"
        );
        Vec::new()
    } else {
        r.blocks
            .iter()
            .map(|b| LockedBlock {
                hash: BlockHash(b.block_hash.clone()),
                slots: locked_slots(b, &r.slot_shapes),
                device_block: checked(b.device_block),
            })
            .collect()
    };
    if refused > 0 {
        tracing::debug!(
            refused,
            "device block indices past the owner's device layout: those blocks are read from the pool"
        );
    }
    (LockGrant { session: r.transfer_session_id, blocks }, device)
}

/// A block's slots as the owner described them: one `TransferSlotInfo`
/// per slot (PegaFlow's form), or, in a compact answer, the answer's
/// `shapes` placed at the block's `pool_offset` with its `slot_crc32c`
/// ([`slots_at`]).
fn locked_slots(b: &TransferBlockInfo, shapes: &[SlotShape]) -> Vec<LockedSlot> {
    if !b.slots.is_empty() {
        return b
            .slots
            .iter()
            .map(|s| LockedSlot {
                k_offset: s.k_ptr,
                k_len: s.k_size,
                v_offset: s.v_ptr,
                v_len: s.v_size,
                crc32c: s.crc32c,
            })
            .collect();
    }
    b.pool_offset.map_or_else(Vec::new, |base| slots_at(base, &b.slot_crc32c, shapes))
}

/// The slots of a block of a compact or packed answer: `shapes` placed
/// at `base` with `crcs`. A block whose checksums do not match the shapes
/// one for one, or whose offsets overflow, gets no slots, which the shape
/// check (C15) refuses: that block is not read.
fn slots_at(base: u64, crcs: &[u32], shapes: &[SlotShape]) -> Vec<LockedSlot> {
    if crcs.len() != shapes.len() {
        return Vec::new();
    }
    let mut slots = Vec::with_capacity(shapes.len());
    for (s, &crc32c) in shapes.iter().zip(crcs) {
        let k_offset = base.checked_add(s.k_offset);
        let v_offset = if s.v_size == 0 { Some(0) } else { base.checked_add(s.v_offset) };
        let (Some(k_offset), Some(v_offset)) = (k_offset, v_offset) else { return Vec::new() };
        slots.push(LockedSlot { k_offset, k_len: s.k_size, v_offset, v_len: s.v_size, crc32c });
    }
    slots
}

/// The blocks of a packed answer (`packed_*` columns): `(hash, slots,
/// device block)` each, the hash taken from `requested` at the block's
/// index. `None` — no block of the answer is read — unless the answer is
/// what an owner builds ([`crate::engine::locks::PackedBlocks`]): indices
/// strictly increasing and inside the request (so at most one block per
/// requested hash: a hostile owner cannot make the reader allocate per
/// repeated index), every column of its length, at least one slot shape.
fn packed_blocks(
    r: &QueryBlocksForTransferResponse,
    requested: &[BlockHash],
) -> Option<Vec<(BlockHash, Vec<LockedSlot>, Option<u64>)>> {
    let n = r.packed_index.len();
    let per = r.slot_shapes.len();
    let increasing = r.packed_index.windows(2).all(|w| w[0] < w[1]);
    let inside = r.packed_index.last().is_none_or(|&last| (last as usize) < requested.len());
    let whole = per > 0
        && r.packed_pool_offset.len() == n
        && per.checked_mul(n) == Some(r.packed_slot_crc32c.len())
        && (r.packed_device_block.is_empty() || r.packed_device_block.len() == n);
    if !(increasing && inside && whole) {
        tracing::debug!(
            blocks = n,
            requested = requested.len(),
            increasing,
            inside,
            pool_offsets = r.packed_pool_offset.len(),
            slot_crcs = r.packed_slot_crc32c.len(),
            slot_shapes = per,
            device_blocks = r.packed_device_block.len(),
            "a packed lock answer not as an owner builds it: none of its blocks is read"
        );
        return None;
    }
    let blocks = r.packed_index.iter().enumerate().map(|(i, &at)| {
        let slots = slots_at(r.packed_pool_offset[i], &r.packed_slot_crc32c[i * per..(i + 1) * per], &r.slot_shapes);
        let device_block = r.packed_device_block.get(i).copied().filter(|&d| d != PACKED_NO_DEVICE_BLOCK);
        (requested[at as usize].clone(), slots, device_block)
    });
    Some(blocks.collect())
}

/// Maximal runs of consecutive indices in `v` (ascending).
fn runs(v: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for &i in v {
        match out.last_mut() {
            Some(r) if r.end == i => r.end += 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// A transfer lock granted to a fetch, on its way from the lock RPC's task
/// to the fetch's driver. Dropped untaken — the fetch ended (deadline,
/// cancel) before the owner's answer arrived or before the driver took it —
/// it releases the lock at once (`ReleaseTransferLock` in a task of its
/// own, bounded by the peer RPC timeout), so a late grant is not held until
/// the owner's lock timeout (C8).
struct LateRelease {
    grant: Option<LockGrant>,
    grpc: EngineClient<Channel>,
    timeout: Duration,
}

impl LateRelease {
    fn new(grant: LockGrant, grpc: EngineClient<Channel>, timeout: Duration) -> Self {
        Self { grant: Some(grant), grpc, timeout }
    }

    /// The grant, now the fetch machine's to release.
    fn take(mut self) -> LockGrant {
        self.grant.take().expect("a LateRelease holds its grant until taken")
    }
}

impl Drop for LateRelease {
    fn drop(&mut self) {
        let Some(grant) = self.grant.take() else { return };
        tracing::trace!(target: FETCH_LATE_GRANT_TRACE_TARGET, session = %grant.session, "late grant released");
        spawn_release(self.grpc.clone(), grant.session, self.timeout);
    }
}

/// The `tracing` target of the trace-level event emitted when a transfer
/// lock granted after its fetch ended is released ([`LateRelease`]; field
/// `session`).
pub const FETCH_LATE_GRANT_TRACE_TARGET: &str = "kvferry::fetch_late_grant";

/// [`release_lock`] on a task of its own, when a runtime is there to run
/// it (a fetch dropped as its runtime shuts down cannot release: its lock
/// expires at the owner, C8). Every release a fetch sends goes through it:
/// on its path, when it is dropped half way, and for a late grant.
fn spawn_release(grpc: EngineClient<Channel>, session: String, timeout: Duration) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(release_lock(grpc, session, timeout));
    }
}

/// `ReleaseTransferLock(session)`, bounded by `timeout`; the outcome is not
/// needed (release is idempotent and an unreleased lock expires, C8).
async fn release_lock(mut grpc: EngineClient<Channel>, session: String, timeout: Duration) {
    tracing::trace!(target: FETCH_RELEASE_TRACE_TARGET, session = %session, "release sent");
    let req = ReleaseTransferLockRequest { transfer_session_id: session };
    let _ = tokio::time::timeout(timeout, grpc.release_transfer_lock(req)).await;
}

/// The `tracing` target of the trace-level event a fetch emits when an
/// owner grants it a transfer lock (fields `me`, `session`).
pub const FETCH_LOCK_TRACE_TARGET: &str = "kvferry::fetch_lock";

/// The `tracing` target of the trace-level event emitted as a fetch's
/// `ReleaseTransferLock` leaves (field `session`).
pub const FETCH_RELEASE_TRACE_TARGET: &str = "kvferry::fetch_release";

/// The `tracing` target of the trace-level event a fetch that was granted
/// locks emits when it ends, returned or dropped (fields `me`, `sessions`:
/// comma separated).
pub const FETCH_END_TRACE_TARGET: &str = "kvferry::fetch_end";

/// The `tracing` target of the event logged when a fetched block is
/// rejected for a checksum mismatch (C10); the simulator counts them.
pub const FETCH_REJECT_TRACE_TARGET: &str = "kvferry::fetch::reject";

/// The CRC-32C of each slot of each extent whose read succeeded (`None` for
/// the others), with the extents handed back in order. The pass ends at
/// `deadline` (C9): no block is checked once it passed, so the sums may be
/// a strict prefix (the machine keeps no block without its sums).
///
/// The CRC pass reads every fetched byte once more, from memory rather than
/// cache (a part is far larger than any cache by the time it completes): at
/// ~10 GB/s a core that is 15-25 % of a large loopback fetch (T4). Large
/// parts are therefore split into contiguous pieces of at least
/// `task_bytes_min` ([`super::EngineConfig::fetch_verify_task_bytes_min`]), one task each (at most one per core and
/// `FETCH_VERIFY_TASKS_MAX`), which run on otherwise idle workers. The
/// result is shorter than `local` only if the runtime shut down under a
/// task (its extents went back to the pool with it).
async fn verify_slots(
    layout: &Arc<Layout>,
    local: Vec<Extent>,
    read_ok: Vec<bool>,
    task_bytes_min: u64,
    deadline: Instant,
) -> (Vec<Extent>, Vec<Option<Arc<[u32]>>>) {
    /// The piece's extents, and the sums of its blocks up to the first one
    /// reached at or after `deadline` (all of them when none was).
    fn check(layout: &Layout, part: Vec<(Extent, bool)>, deadline: Instant) -> (Vec<Extent>, Vec<Option<Arc<[u32]>>>) {
        let mut sums = Vec::with_capacity(part.len());
        let mut cut = false;
        let extents = part
            .into_iter()
            .map(|(e, ok)| {
                cut = cut || Instant::now() >= deadline;
                if !cut {
                    sums.push(ok.then(|| slot_checksums(layout, e.as_slice())));
                }
                e
            })
            .collect();
        (extents, sums)
    }
    let bytes: u64 = local.iter().zip(&read_ok).filter(|(_, ok)| **ok).map(|(e, _)| e.len()).sum();
    let by_size = usize::try_from(bytes / task_bytes_min.max(1)).unwrap_or(usize::MAX);
    let tasks =
        crate::rt::cpu_parallelism().min(crate::limits::FETCH_VERIFY_TASKS_MAX).min(by_size).min(local.len()).max(1);
    let mut items: Vec<(Extent, bool)> = local.into_iter().zip(read_ok).collect();
    if tasks == 1 {
        return check(layout, items, deadline);
    }
    let per = items.len().div_ceil(tasks);
    let mut handles = Vec::with_capacity(tasks);
    while !items.is_empty() {
        let rest = items.split_off(per.min(items.len()));
        let part = std::mem::replace(&mut items, rest);
        let layout = layout.clone();
        handles.push((part.len(), tokio::spawn(async move { check(&layout, part, deadline) })));
    }
    let (mut extents, mut sums) = (Vec::new(), Vec::new());
    // Sums stay a prefix: none is kept after a piece cut short.
    let mut whole = true;
    for (len, h) in handles {
        match h.await {
            Ok((e, s)) => {
                if whole {
                    whole = s.len() == len;
                    sums.extend(s);
                }
                extents.extend(e);
            }
            // Only a runtime shutdown cancels the task (the closure cannot
            // panic short of a bug); the verified list ends here.
            Err(e) if e.is_panic() => panic!("checksum task panicked: {e}"),
            Err(_) => break,
        }
    }
    (extents, sums)
}

/// A part's sums from the transport's (`landed`) and from the pass over the
/// extents it could not sum (`need`; `passed`, a prefix when the pass
/// stopped at the deadline): each read extent's, up to the first one the
/// pass did not reach (the sums stay a prefix, as [`verify_slots`]'s).
fn merge_sums(
    read_ok: &[bool],
    need: &[bool],
    landed: Vec<Option<Arc<[u32]>>>,
    passed: Vec<Option<Arc<[u32]>>>,
) -> Vec<Option<Arc<[u32]>>> {
    let mut out = Vec::with_capacity(landed.len());
    for (i, l) in landed.into_iter().enumerate() {
        if need[i] {
            match passed.get(i) {
                Some(s) => out.push(s.clone()),
                None => break,
            }
        } else {
            out.push(if read_ok[i] { l } else { None });
        }
    }
    out
}

/// Where each slot of a block of `layout` ends, for a transport that sums
/// slots as bytes land; `None` unless the slots tile the block from its
/// first byte to its last (concatenated in layer order, as
/// [`super::layout::Layout::slot_offset`] places them), so a summed run of
/// bytes is exactly the slots the owner checksummed.
fn slot_ends(layout: &super::layout::Layout) -> Option<SlotEnds> {
    let mut ends = Vec::with_capacity(layout.layers().len());
    let mut at = 0u64;
    for l in 0..layout.layers().len() {
        if layout.slot_offset(l) != at {
            return None;
        }
        at = at.checked_add(layout.slot_bytes(l))?;
        ends.push(at);
    }
    (at == layout.block_bytes() && !ends.is_empty()).then(|| SlotEnds(ends.into()))
}

/// Blocks per read part of a fetch of `missing` blocks of `block_bytes`:
/// about `missing / (2 * reads_in_flight)` blocks, so that every part in
/// flight is followed by a second one and only the last, small part's
/// load (and, on a transport that does not sum as bytes land, its
/// checksum pass) trails the reads; never more than
/// `part_bytes_max` ([`super::EngineConfig::fetch_read_part_bytes`]) nor
/// less than [`crate::limits::FETCH_READ_PART_BYTES_MIN`] of blocks, and
/// at least one block. A fetch of 512 MiB or more with 4 parts in flight
/// keeps 64 MiB parts; a 10 MiB one is read in ~1.3 MiB parts instead of
/// one part whose whole CRC pass and load followed its read
/// (`docs/BENCHMARKS.md`).
fn part_blocks(missing: usize, block_bytes: u64, part_bytes_max: u64, reads_in_flight: usize) -> usize {
    let block_bytes = block_bytes.max(1);
    let spread = (missing as u64).saturating_mul(block_bytes) / (reads_in_flight.max(1) as u64).saturating_mul(2);
    let bytes = spread.max(crate::limits::FETCH_READ_PART_BYTES_MIN).min(part_bytes_max);
    usize::try_from(bytes / block_bytes).unwrap_or(usize::MAX).max(1)
}

/// The read ops that fill `blocks[i]` into local extent `i` (slot by slot,
/// coalesced where contiguous on both sides).
fn read_ops(layout: &super::layout::Layout, blocks: &[&LockedBlock]) -> Vec<ReadOp> {
    let mut ops: Vec<ReadOp> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        for (l, s) in b.slots.iter().enumerate() {
            let base = layout.slot_offset(l);
            push_coalesced(
                &mut ops,
                ReadOp { region: 0, remote_offset: s.k_offset, len: s.k_len, local_extent: i, local_offset: base },
            );
            if s.v_len > 0 {
                push_coalesced(
                    &mut ops,
                    ReadOp {
                        region: 0,
                        remote_offset: s.v_offset,
                        len: s.v_len,
                        local_extent: i,
                        local_offset: base + s.k_len,
                    },
                );
            }
        }
    }
    ops
}

/// Appends `op`, merging it into the previous one when both sides are
/// contiguous (fused layouts collapse to one read per block).
fn push_coalesced(ops: &mut Vec<ReadOp>, op: ReadOp) {
    if let Some(last) = ops.last_mut() {
        if last.local_extent == op.local_extent
            && last.region == op.region
            && last.remote_offset.checked_add(last.len) == Some(op.remote_offset)
            && last.local_offset + last.len == op.local_offset
            && last.len + op.len <= crate::limits::TCP_READ_BYTES_MAX
        {
            last.len += op.len;
            return;
        }
    }
    ops.push(op);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{part_blocks, verify_slots};
    use crate::engine::layout::{DeviceBufferId, LayerLayout, Layout};
    use crate::engine::pool::Pool;
    use crate::limits::FETCH_READ_PART_BYTES_MIN;

    /// `layers` paged layers (separate K and V buffers, 8 blocks of 100
    /// bytes per segment) on buffers of 800 bytes: the layout of these
    /// tests' lock answers.
    fn paged_layout(layers: u32) -> Layout {
        let layers =
            (0..layers).map(|l| LayerLayout::paged(DeviceBufferId(2 * l), Some(DeviceBufferId(2 * l + 1)), 8, 100));
        Layout::new(layers.collect(), |_| Some(800)).unwrap()
    }

    /// The checksum pass ends at the fetch's deadline (C9): before it every
    /// block whose read succeeded is checked; once it passed none is, on
    /// one task or several, and every slot comes back to be freed (C11).
    /// Sums taken as the bytes landed are kept for read extents; an extent
    /// the transport could not sum takes the pass's; where the pass stopped
    /// (its sums a prefix), the part's sums stop too, so no block after an
    /// unchecked one is kept; a failed read has none.
    #[test]
    fn landed_and_passed_sums_merge_into_a_prefix() {
        let s = |x: u32| Some(Arc::<[u32]>::from(vec![x]));
        let read_ok = [true, false, true, true, true];
        let landed = vec![s(1), s(2), None, s(4), None];
        let need = [false, false, true, false, true];
        // The pass reached every extent.
        let all = super::merge_sums(&read_ok, &need, landed.clone(), vec![None, None, s(30), None, s(50)]);
        assert_eq!(all, vec![s(1), None, s(30), s(4), s(50)]);
        // The pass stopped after extent 3: extent 4 (needing it) and
        // everything after it are cut.
        let cut = super::merge_sums(&read_ok, &need, landed.clone(), vec![None, None, s(30), None]);
        assert_eq!(cut, vec![s(1), None, s(30), s(4)]);
        // Stopped before extent 2: the prefix ends there.
        let early = super::merge_sums(&read_ok, &need, landed, vec![None, None]);
        assert_eq!(early, vec![s(1), None]);
    }

    /// A fetch's gate runs sections while open; closing it waits for the
    /// section in progress (a part task planning or submitting) and
    /// refuses every later one.
    #[test]
    fn a_closed_gate_waits_for_the_section_in_progress_and_refuses_later_ones() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let gate = super::Gate::default();
        assert_eq!(gate.run(|| 1), Some(1));
        let (entered_tx, entered) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let ended = Arc::new(AtomicBool::new(false));
        let section = {
            let (g, ended) = (gate.clone(), ended.clone());
            std::thread::spawn(move || {
                g.run(|| {
                    entered_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                    ended.store(true, SeqCst);
                })
            })
        };
        entered.recv().unwrap();
        let closer = {
            let (g, ended) = (gate.clone(), ended.clone());
            std::thread::spawn(move || {
                g.close();
                ended.load(SeqCst)
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        go.send(()).unwrap();
        assert!(closer.join().unwrap(), "close returned before the section in progress ended");
        assert_eq!(section.join().unwrap(), Some(()));
        assert_eq!(gate.run(|| 2), None, "a closed gate runs nothing");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checksum_pass_stops_at_the_deadline() {
        let layout = Arc::new(paged_layout(2));
        let pool = Pool::new(1 << 20, 64).unwrap();
        let slots = || (0..4).map(|_| pool.alloc(layout.block_bytes()).unwrap()).collect::<Vec<_>>();
        let later = Instant::now() + Duration::from_secs(60);
        // One task (`u64::MAX` bytes per task), then as many as allowed.
        for per_task in [u64::MAX, 1] {
            let (back, sums) = verify_slots(&layout, slots(), vec![true, false, true, true], per_task, later).await;
            assert_eq!((back.len(), sums.len()), (4, 4));
            assert_eq!(sums.iter().map(Option::is_some).collect::<Vec<_>>(), vec![true, false, true, true]);
            let (back, sums) = verify_slots(&layout, slots(), vec![true; 4], per_task, Instant::now()).await;
            assert_eq!((back.len(), sums.len()), (4, 0), "nothing checked after the deadline");
        }
        assert_eq!(pool.used_bytes(), 0, "every slot went back to the pool");
    }

    /// Small fetches spread over twice the parts in flight, never below the
    /// minimum part; large ones keep the configured part; never 0 blocks.
    #[test]
    fn part_size_spreads_small_fetches_and_caps_large_ones() {
        let (kib64, max) = (64 << 10, 64 << 20);
        // 160 blocks of 64 KiB (10 MiB), 4 in flight: 20 blocks (1.25 MiB).
        assert_eq!(part_blocks(160, kib64, max, 4), 20);
        // 20 blocks: a 1 MiB part (16 blocks), not 2 or 3 blocks.
        assert_eq!(part_blocks(20, kib64, max, 4), (FETCH_READ_PART_BYTES_MIN / kib64) as usize);
        // 256 blocks of 2.25 MiB (576 MiB), 4 in flight: the 64 MiB cap
        // (28 blocks), not 72 MiB (32 blocks); 200 blocks: 56 MiB (25).
        let big = 9 << 18;
        assert_eq!(part_blocks(256, big, max, 4), (max / big) as usize);
        assert_eq!(part_blocks(200, big, max, 4), 25);
        // One block larger than the cap: one block; nothing missing: the
        // minimum part.
        assert_eq!(part_blocks(3, 128 << 20, max, 4), 1);
        assert_eq!(part_blocks(0, kib64, max, 4), 16);
        // Absurd settings saturate instead of overflowing.
        assert_eq!(part_blocks(usize::MAX, u64::MAX, max, usize::MAX), 1);
        assert_eq!(part_blocks(1000, 0, max, 0), FETCH_READ_PART_BYTES_MIN as usize);
        // A cap below the minimum wins (a caller asked for small parts).
        assert_eq!(part_blocks(160, kib64, 128 << 10, 4), 2);
    }

    /// A compact lock answer (shapes once, per block its pool offset and
    /// slot checksums) describes the same slots as PegaFlow's form; a
    /// compact block that does not match the shapes, or whose offsets
    /// overflow, gets no slots (the shape check then refuses it).
    #[test]
    fn compact_answer_blocks_read_as_their_full_form() {
        use super::locked_slots;
        use crate::engine::locks::slot_shapes;
        use crate::proto::{TransferBlockInfo, TransferSlotInfo};
        let layout = paged_layout(3);
        let shapes = slot_shapes(&layout);
        let base = 7 * layout.block_bytes();
        let crcs = vec![11, 22, 33];
        let full = TransferBlockInfo {
            slots: shapes
                .iter()
                .zip(&crcs)
                .map(|(s, &crc32c)| TransferSlotInfo {
                    k_ptr: base + s.k_offset,
                    k_size: s.k_size,
                    v_ptr: base + s.v_offset,
                    v_size: s.v_size,
                    numa_node: 0,
                    crc32c,
                })
                .collect(),
            ..Default::default()
        };
        let compact = TransferBlockInfo { pool_offset: Some(base), slot_crc32c: crcs.clone(), ..Default::default() };
        let want = locked_slots(&full, &[]);
        assert_eq!(want.len(), 3);
        assert_eq!((want[1].k_offset, want[1].k_len, want[1].v_offset), (base + 200, 100, base + 300));
        assert_eq!(locked_slots(&compact, &shapes), want);
        // Malformed compact blocks: no slots.
        let short = TransferBlockInfo { slot_crc32c: crcs[..2].to_vec(), ..compact.clone() };
        assert!(locked_slots(&short, &shapes).is_empty());
        let no_offset = TransferBlockInfo { pool_offset: None, ..compact.clone() };
        assert!(locked_slots(&no_offset, &shapes).is_empty());
        let overflow = TransferBlockInfo { pool_offset: Some(u64::MAX - 50), ..compact.clone() };
        assert!(locked_slots(&overflow, &shapes).is_empty());
        assert!(locked_slots(&compact, &[]).is_empty(), "a compact block in an answer without shapes");
    }

    /// A packed answer (columns) reads as the compact one: each block's
    /// hash from its index in the request, its slots from the shapes, its
    /// device block unless marked none. An answer not as an owner builds
    /// it — an index past the request, indices repeated or out of order,
    /// more indices than requested, columns of the wrong lengths, no
    /// shapes — reads as no block at all.
    #[test]
    fn packed_answer_blocks_read_as_their_compact_form() {
        use super::{PACKED_NO_DEVICE_BLOCK, packed_blocks, slots_at};
        use crate::engine::locks::slot_shapes;
        use crate::proto::QueryBlocksForTransferResponse;
        use crate::types::BlockHash;
        let layout = paged_layout(3);
        let shapes = slot_shapes(&layout);
        let bb = layout.block_bytes();
        let requested: Vec<BlockHash> = (0..4).map(BlockHash::from_u64).collect();
        let answer = QueryBlocksForTransferResponse {
            slot_shapes: shapes.clone(),
            packed_index: vec![0, 2, 3],
            packed_pool_offset: vec![5 * bb, bb, 9 * bb],
            packed_slot_crc32c: (1..=9).collect(),
            packed_device_block: vec![4, PACKED_NO_DEVICE_BLOCK, 6],
            ..Default::default()
        };
        let got = packed_blocks(&answer, &requested).expect("an owner's answer");
        let want = vec![
            (requested[0].clone(), slots_at(5 * bb, &[1, 2, 3], &shapes), Some(4)),
            (requested[2].clone(), slots_at(bb, &[4, 5, 6], &shapes), None),
            (requested[3].clone(), slots_at(9 * bb, &[7, 8, 9], &shapes), Some(6)),
        ];
        assert!(want.iter().all(|(_, s, _)| s.len() == 3));
        assert_eq!(got, want);
        // No device column: no device blocks.
        let plain = QueryBlocksForTransferResponse { packed_device_block: Vec::new(), ..answer.clone() };
        assert!(packed_blocks(&plain, &requested).unwrap().iter().all(|(_, s, d)| s.len() == 3 && d.is_none()));
        let with_index = |packed_index: Vec<u32>| {
            let n = packed_index.len();
            QueryBlocksForTransferResponse {
                packed_index,
                packed_pool_offset: vec![bb; n],
                packed_slot_crc32c: vec![7; 3 * n],
                packed_device_block: Vec::new(),
                ..answer.clone()
            }
        };
        assert_eq!(packed_blocks(&with_index(vec![0, 1, 2, 3]), &requested).map(|b| b.len()), Some(4));
        let bad = [
            with_index(vec![0, 4, 3]),       // past the request
            with_index(vec![0, 2, 2]),       // a block twice
            with_index(vec![3, 2]),          // out of order
            with_index(vec![0, 1, 2, 3, 4]), // more than requested
            with_index(vec![0; 100_000]),    // a hostile owner's many repeats
            QueryBlocksForTransferResponse { packed_slot_crc32c: (1..=8).collect(), ..answer.clone() },
            QueryBlocksForTransferResponse { packed_pool_offset: vec![0; 2], ..answer.clone() },
            QueryBlocksForTransferResponse { packed_device_block: vec![4], ..answer.clone() },
            QueryBlocksForTransferResponse {
                slot_shapes: Vec::new(),
                packed_slot_crc32c: Vec::new(),
                ..answer.clone()
            },
        ];
        for bad in bad {
            assert_eq!(packed_blocks(&bad, &requested), None, "{:?}", bad.packed_index.len());
        }
    }

    /// A lock answer with more blocks than the fetch asked for (each
    /// owner grants a requested block at most once) reads as no block:
    /// a hostile owner's repeats cost the reader nothing per repeat.
    #[tokio::test]
    async fn an_answer_with_more_blocks_than_requested_reads_none() {
        use super::from_answer;
        use crate::proto::{QueryBlocksForTransferResponse, TransferBlockInfo};
        use crate::types::BlockHash;
        let layout = paged_layout(3);
        let shapes = crate::engine::locks::slot_shapes(&layout);
        let requested: Vec<BlockHash> = (0..2).map(BlockHash::from_u64).collect();
        let block = |h: &BlockHash| TransferBlockInfo {
            block_hash: h.0.clone(),
            pool_offset: Some(0),
            slot_crc32c: vec![1, 2, 3],
            ..Default::default()
        };
        let answer = |blocks: Vec<TransferBlockInfo>| QueryBlocksForTransferResponse {
            transfer_session_id: "s".into(),
            slot_shapes: shapes.clone(),
            blocks,
            ..Default::default()
        };
        let now = Instant::now();
        let ok = from_answer(answer(requested.iter().map(block).collect()), &requested, &layout, now).0;
        assert_eq!(ok.blocks.len(), 2);
        assert!(ok.blocks.iter().all(|b| b.slots.len() == 3));
        let repeated = answer(vec![block(&requested[0]); 3]);
        assert!(from_answer(repeated, &requested, &layout, now).0.blocks.is_empty());
    }

    proptest::proptest! {
        /// Any packed columns an owner may send (input from the network):
        /// no panic; at most one block per requested hash is read, each a
        /// requested hash with all its slots.
        #[test]
        fn any_packed_columns_read_without_panic(
            index in proptest::collection::vec(0u32..8, 0..12),
            offsets in proptest::collection::vec(proptest::prelude::any::<u64>(), 0..12),
            crcs in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..40),
            devices in proptest::collection::vec(proptest::prelude::any::<u64>(), 0..12),
            shapes in 0usize..4,
        ) {
            use super::packed_blocks;
            use crate::engine::locks::slot_shapes;
            let layout = paged_layout(3);
            let requested: Vec<crate::types::BlockHash> = (0..5).map(crate::types::BlockHash::from_u64).collect();
            let answer = crate::proto::QueryBlocksForTransferResponse {
                slot_shapes: slot_shapes(&layout).into_iter().take(shapes).collect(),
                packed_index: index.clone(),
                packed_pool_offset: offsets,
                packed_slot_crc32c: crcs,
                packed_device_block: devices,
                ..Default::default()
            };
            let got = packed_blocks(&answer, &requested).unwrap_or_default();
            proptest::prop_assert!(got.len() <= requested.len());
            for (h, slots, _) in &got {
                proptest::prop_assert!(requested.contains(h));
                proptest::prop_assert_eq!(slots.len(), shapes);
            }
        }

        /// Transfer-ticket bytes (input an embedder relays from another
        /// process): any bytes, and a real ticket's bytes with bytes
        /// overwritten or cut, decode or are refused without a panic, and
        /// a decoded ticket's answer reads as at most one block per hash it
        /// names, each of those hashes, with its device half checked.
        #[test]
        fn any_ticket_bytes_decode_and_read_without_panic(
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            flips in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 0..8),
            cut in proptest::prelude::any::<usize>(),
        ) {
            use super::from_answer;
            use crate::engine::TransferTicket;
            use crate::engine::locks::slot_shapes;
            let layout = paged_layout(3);
            let hashes: Vec<crate::types::BlockHash> = (0..5).map(crate::types::BlockHash::from_u64).collect();
            let real = TransferTicket {
                owner: crate::types::NodeAddr("127.0.0.1:7000".into()),
                requester: crate::types::NodeAddr("127.0.0.1:7001".into()),
                namespace: "ns".into(),
                hashes: hashes.clone(),
                answer: crate::proto::QueryBlocksForTransferResponse {
                    transfer_session_id: "s".into(),
                    slot_shapes: slot_shapes(&layout),
                    packed_index: vec![0, 1, 3],
                    packed_pool_offset: vec![0, 600, 1200],
                    packed_slot_crc32c: vec![7; 9],
                    packed_device_block: vec![0, 1, u64::MAX],
                    device_lease_ms_left: 5_000,
                    ..Default::default()
                },
                granted_unix_ms: 0,
                granted_at: None,
            };
            let mut mutated = real.encode();
            for (at, b) in flips {
                if !mutated.is_empty() {
                    let n = mutated.len();
                    mutated[at % n] = b;
                }
            }
            let n = mutated.len();
            mutated.truncate(cut % (n + 1));
            for bytes in [noise, mutated] {
                if let Ok(t) = TransferTicket::decode(&bytes) {
                    let (grant, _) = from_answer(t.answer, &t.hashes, &layout, Instant::now());
                    proptest::prop_assert!(grant.blocks.len() <= t.hashes.len());
                    for b in &grant.blocks {
                        proptest::prop_assert!(t.hashes.contains(&b.hash));
                    }
                }
            }
            // The real ticket's bytes read back as the three blocks it grants.
            let t = TransferTicket::decode(&real.encode()).unwrap();
            let (grant, _) = from_answer(t.answer, &t.hashes, &layout, Instant::now());
            let got: Vec<_> = grant.blocks.iter().map(|b| b.hash.clone()).collect();
            proptest::prop_assert_eq!(got, vec![hashes[0].clone(), hashes[1].clone(), hashes[3].clone()]);
        }
    }
}
