//! Decode-side fetch (design.md §5, contracts C8–C11, C14).
//!
//! `MetaServer.QueryPrefixBlocks` → choose an owner (never self; the
//! MetaServer's order — longest prefix, then node — is the deterministic
//! tie-break) → handshake once per peer (single-flight; a failure leaves no
//! state, so the next attempt starts clean) → `QueryBlocksForTransfer` →
//! READ into freshly allocated pool slots → verify each slot's CRC-32C
//! (in parts, each verified while the next is read) →
//! seal locally and register the fetched blocks as owned here (one
//! synchronous step, so no eviction can slip between them) → release the
//! transfer lock. When an owner delivers only part of what it advertised,
//! the next owner is asked for the rest (stitching one prefix from several
//! owners, C14), at most one transfer query per owner per fetch and at most
//! `FETCH_OWNERS_MAX` owners. Every step runs under the fetch's deadline.
//!
//! The result is "k of n": `available` counts the verified contiguous prefix
//! now resident here; the caller recomputes the rest (C9).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::rt::timeout_at;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tonic::transport::Channel;

use super::cache::CachedBlock;
use super::layout::LayoutFamily;
use super::pool::Extent;
use super::{Engine, slot_checksums};
use crate::proto::engine_client::EngineClient;
use crate::proto::{
    QueryBlocksForTransferRequest, RdmaHandshakeRequest, ReleaseTransferLockRequest, TransferBlockInfo,
};
use crate::transport::{HandshakeMetadata, ReadOp, TransportError};
use crate::types::{BlockHash, NodeAddr};

/// Per-peer state: its gRPC client and the single-flight handshake.
pub(crate) struct PeerState {
    grpc: EngineClient<Channel>,
    handshake: OnceCell<()>,
}

/// Peers this engine fetches from.
#[derive(Default)]
pub(crate) struct PeerTable {
    peers: Mutex<HashMap<NodeAddr, Arc<PeerState>>>,
}

impl PeerTable {
    fn get(&self, peer: &NodeAddr, timeout: Duration) -> Result<Arc<PeerState>, FetchError> {
        let mut map = self.peers.lock().expect("peers lock");
        if let Some(p) = map.get(peer) {
            return Ok(p.clone());
        }
        let ch = crate::rt::channel(&peer.0, timeout).map_err(|e| FetchError::Peer(e.to_string()))?;
        let grpc = EngineClient::new(ch)
            .max_decoding_message_size(crate::limits::GRPC_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(crate::limits::GRPC_MESSAGE_BYTES_MAX);
        let p = Arc::new(PeerState { grpc, handshake: OnceCell::new() });
        map.insert(peer.clone(), p.clone());
        Ok(p)
    }

    /// Forgets a peer (after a transport failure) if `p` is still its entry.
    fn invalidate(&self, peer: &NodeAddr, p: &Arc<PeerState>) {
        let mut map = self.peers.lock().expect("peers lock");
        if map.get(peer).is_some_and(|cur| Arc::ptr_eq(cur, p)) {
            map.remove(peer);
        }
    }

    /// Peers with a completed handshake.
    pub(crate) fn handshaken(&self) -> usize {
        self.peers.lock().expect("peers lock").values().filter(|p| p.handshake.initialized()).count()
    }
}

/// Why a fetch stopped short of `n`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// The MetaServer query failed (down, partitioned, stalled).
    #[error("metaserver query failed: {0}")]
    MetaServer(String),
    /// No owner (other than us) holds the next block.
    #[error("no remote owner for the next block")]
    NoOwner,
    /// A peer RPC failed.
    #[error("peer rpc failed: {0}")]
    Peer(String),
    /// The handshake failed.
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The owner no longer has the block (stale index entry).
    #[error("owner no longer holds the next block")]
    Stale,
    /// The read failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A slot's checksum did not match (C10).
    #[error("checksum mismatch in a fetched block")]
    Checksum,
    /// The peer described a block that does not fit our layout.
    #[error("peer block shape does not match the local layout: {0}")]
    Shape(String),
    /// No room in the local pool.
    #[error("local pool has no room")]
    NoSpace,
    /// The namespace has no local layout.
    #[error("namespace has no local layout")]
    UnknownNamespace,
    /// The fetch deadline passed.
    #[error("fetch deadline passed")]
    Deadline,
    /// `FETCH_OWNERS_MAX` owners were tried.
    #[error("owner budget exhausted")]
    OwnersExhausted,
    /// No transport is installed.
    #[error("no transport installed")]
    NoTransport,
}

/// Outcome of [`Engine::fetch`]: "k of n".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchReport {
    /// `n`: hashes asked for.
    pub requested: usize,
    /// `k`: the verified contiguous prefix now resident here (local hits
    /// included). The caller recomputes `requested - available` blocks.
    pub available: usize,
    /// Blocks that were already resident before the fetch.
    pub local_hits: usize,
    /// Blocks read from peers, verified and sealed here.
    pub fetched: usize,
    /// Bytes read for them.
    pub bytes: u64,
    /// Owners asked, in order.
    pub owners: Vec<NodeAddr>,
    /// Why it stopped short (None when `available == requested`).
    pub stopped: Option<FetchError>,
}

/// Releases a transfer lock exactly once on every path (C8): explicitly via
/// [`TransferGuard::release`], or from `Drop` (error, cancel, panic) on a
/// spawned task.
struct TransferGuard {
    grpc: EngineClient<Channel>,
    session: Option<String>,
    timeout: Duration,
}

impl TransferGuard {
    async fn release(mut self) {
        if let Some(session) = self.session.take() {
            let req = ReleaseTransferLockRequest { transfer_session_id: session };
            let _ = tokio::time::timeout(self.timeout, self.grpc.release_transfer_lock(req)).await;
        }
    }
}

impl Drop for TransferGuard {
    fn drop(&mut self) {
        #[cfg(feature = "broken-release")]
        {
            // Deliberately broken build: the guard forgets the lock on error
            // and cancel paths; `inv_no_lock_leak` must notice.
            self.session = None;
        }
        if let Some(session) = self.session.take() {
            let mut grpc = self.grpc.clone();
            let timeout = self.timeout;
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let req = ReleaseTransferLockRequest { transfer_session_id: session };
                    let _ = tokio::time::timeout(timeout, grpc.release_transfer_lock(req)).await;
                });
            }
        }
    }
}

impl Engine {
    /// Fetches the missing part of `hashes` (a chained prefix) from peers.
    /// Never fails and never hangs: it ends by the engine's fetch deadline
    /// with "k of n" (C9). See the module doc.
    pub async fn fetch(&self, namespace: &str, hashes: &[BlockHash]) -> FetchReport {
        let deadline = Instant::now() + self.inner.cfg.fetch_deadline;
        self.inner.metrics.fetches.fetch_add(1, Ordering::Relaxed);
        let local = self.query_prefix(namespace, hashes);
        let mut rep =
            FetchReport { requested: hashes.len(), available: local, local_hits: local, ..Default::default() };
        if local == hashes.len() {
            return rep;
        }
        if self.layout(namespace).is_err() {
            rep.stopped = Some(FetchError::UnknownNamespace);
            return rep;
        }
        let me = self.node().clone();
        while rep.available < hashes.len() {
            if rep.owners.len() >= crate::limits::FETCH_OWNERS_MAX {
                rep.stopped = Some(FetchError::OwnersExhausted);
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                rep.stopped = Some(FetchError::Deadline);
                break;
            }
            let rest = &hashes[rep.available..];
            let owners = match self.client().query_prefix(namespace, rest, left).await {
                Ok(o) => o,
                Err(e) => {
                    rep.stopped = Some(FetchError::MetaServer(e.to_string()));
                    break;
                }
            };
            let pick = owners.into_iter().find(|(n, len)| *n != me && *len > 0 && !rep.owners.contains(n));
            let Some((owner, len)) = pick else {
                // Keep why the last owner stopped short (stale, checksum,
                // transport, …): "no owner" only when none failed before.
                rep.stopped = Some(rep.stopped.take().unwrap_or(FetchError::NoOwner));
                break;
            };
            rep.owners.push(owner.clone());
            let want = &rest[..(len as usize).min(rest.len())];
            let (got, bytes, err) = self.fetch_from(&owner, namespace, want, deadline).await;
            rep.available += got;
            rep.fetched += got;
            rep.bytes += bytes;
            if let Some(e) = err {
                tracing::debug!(%owner, error = %e, got, "fetch from owner stopped short");
                rep.stopped = Some(e);
            } else {
                rep.stopped = None;
            }
        }
        if rep.available == hashes.len() {
            rep.stopped = None;
        }
        rep
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
                    .map_err(|s| FetchError::Handshake(s.to_string()))?
                    .into_inner();
                if !resp.status.as_ref().is_some_and(|s| s.ok) {
                    let msg = resp.status.map(|s| s.message).unwrap_or_default();
                    return Err(FetchError::Handshake(msg));
                }
                let meta = HandshakeMetadata::decode(&resp.handshake_metadata)
                    .map_err(|e| FetchError::Handshake(e.to_string()))?;
                transport.connect(owner, &meta, deadline).await.map_err(|e| FetchError::Handshake(e.to_string()))
            })
            .await
            .map(|_| ())
    }

    /// Fetches a prefix of `want` from one owner. Returns (blocks sealed,
    /// bytes, why it stopped short).
    async fn fetch_from(
        &self,
        owner: &NodeAddr,
        namespace: &str,
        want: &[BlockHash],
        deadline: Instant,
    ) -> (usize, u64, Option<FetchError>) {
        let timeout = self.inner.cfg.peer_rpc_timeout;
        let p = match self.inner.peers.get(owner, timeout) {
            Ok(p) => p,
            Err(e) => return (0, 0, Some(e)),
        };
        if let Err(e) = self.handshake(owner, &p, deadline).await {
            self.inner.peers.invalidate(owner, &p);
            return (0, 0, Some(e));
        }
        let req = QueryBlocksForTransferRequest {
            namespace: namespace.to_string(),
            block_hashes: want.iter().map(|h| h.0.clone()).collect(),
            requester_id: self.node().0.clone(),
        };
        let mut grpc = p.grpc.clone();
        let asked = Instant::now();
        let resp = match timeout_at(deadline, grpc.query_blocks_for_transfer(req)).await {
            Err(_) => return (0, 0, Some(FetchError::Deadline)),
            Ok(Err(s)) => {
                self.inner.peers.invalidate(owner, &p);
                return (0, 0, Some(FetchError::Peer(s.to_string())));
            }
            Ok(Ok(r)) => r.into_inner(),
        };
        if resp.transfer_session_id.is_empty() {
            return (0, 0, Some(FetchError::Stale));
        }
        let guard = TransferGuard { grpc: p.grpc.clone(), session: Some(resp.transfer_session_id.clone()), timeout };
        let locked = Instant::now();
        let out = self.read_locked(owner, namespace, want, resp.blocks, &resp.transfer_session_id, deadline).await;
        let read = Instant::now();
        if matches!(out.2, Some(FetchError::Transport(ref e)) if !matches!(e, TransportError::Refused { .. })) {
            // The connection state is unknown: start clean next time.
            self.inner.peers.invalidate(owner, &p);
            if let Some(t) = self.transport() {
                t.disconnect(owner);
            }
        }
        guard.release().await;
        tracing::debug!(
            %owner,
            blocks = out.0,
            bytes = out.1,
            lock_us = (locked - asked).as_micros() as u64,
            read_and_verify_us = (read - locked).as_micros() as u64,
            release_us = read.elapsed().as_micros() as u64,
            "fetch from owner"
        );
        out
    }

    async fn read_locked(
        &self,
        owner: &NodeAddr,
        namespace: &str,
        want: &[BlockHash],
        blocks: Vec<TransferBlockInfo>,
        session: &str,
        deadline: Instant,
    ) -> (usize, u64, Option<FetchError>) {
        let Ok((ns, layout)) = self.layout(namespace) else { return (0, 0, Some(FetchError::UnknownNamespace)) };
        if self.transport().is_none() {
            return (0, 0, Some(FetchError::NoTransport));
        }
        let by_hash: HashMap<&[u8], &TransferBlockInfo> = blocks.iter().map(|b| (&b.block_hash[..], b)).collect();
        // The contiguous prefix the owner actually locked, shape-checked.
        let mut plan: Vec<&TransferBlockInfo> = Vec::new();
        let mut stop: Option<FetchError> = None;
        for h in want {
            let Some(b) = by_hash.get(h.as_bytes()) else {
                stop = Some(FetchError::Stale);
                break;
            };
            if let Err(why) = check_shape(&layout, b) {
                stop = Some(FetchError::Shape(why));
                break;
            }
            plan.push(b);
        }
        let mut extents = Vec::with_capacity(plan.len());
        for _ in &plan {
            match self.alloc(layout.block_bytes()) {
                Ok(e) => extents.push(e),
                Err(_) => {
                    stop = Some(FetchError::NoSpace);
                    break;
                }
            }
        }
        plan.truncate(extents.len());
        if plan.is_empty() {
            return (0, 0, stop);
        }
        let (checked, short) = self.read_and_verify(owner, session, &layout, &plan, extents, deadline).await;
        // Seal in prefix order, stopping at the first failed read or mismatch.
        let mut got = 0usize;
        let mut bytes = 0u64;
        if checked.len() < plan.len() {
            stop = short.or(stop);
        }
        for ((ext, res, sums), b) in checked.into_iter().zip(&plan) {
            if let Err(e) = res {
                stop = Some(FetchError::Transport(e));
                break;
            }
            let sums = sums.expect("a successful read is checksummed");
            if !as_advertised(&sums, b) {
                self.inner.metrics.checksum_failures.fetch_add(1, Ordering::Relaxed);
                stop = Some(FetchError::Checksum);
                break;
            }
            bytes += ext.len();
            let hash = BlockHash(b.block_hash.clone());
            let block = CachedBlock { extent: ext.seal(), checksums: sums };
            self.insert_sealed(&ns, hash, block);
            got += 1;
        }
        self.inner.metrics.fetched_blocks.fetch_add(got as u64, Ordering::Relaxed);
        self.inner.metrics.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
        // Register in the same synchronous section that sealed them (as
        // `save` does): deferring it past the release RPC let an eviction
        // in between enqueue the removal *before* the insert, leaving a
        // stale owner entry the index never withdraws; a cancel there left
        // resident blocks never registered (found by the simulator).
        self.advertise(&ns, &want[..got]);
        if got < want.len() && stop.is_none() {
            stop = Some(FetchError::Stale);
        }
        (got, bytes, stop)
    }

    /// Reads `plan` (block `i` into `extents[i]`) in parts of about
    /// [`super::EngineConfig::fetch_read_part_bytes`], each part checksummed
    /// while the next one is read, so only the last part's CRC pass follows
    /// the last byte. Returns the verified prefix in order; a part with a
    /// failed read or a checksum mismatch is the last one kept (the part read
    /// meanwhile is dropped, later parts are not read; their extents go back
    /// to the pool). When the list is short of `plan` without a failed or
    /// mismatched entry in it, the second value says why (the deadline
    /// passed between parts, or the runtime shut down under a checksum task).
    async fn read_and_verify(
        &self,
        owner: &NodeAddr,
        session: &str,
        layout: &Arc<super::layout::Layout>,
        plan: &[&TransferBlockInfo],
        extents: Vec<Extent>,
        deadline: Instant,
    ) -> (Vec<Verified>, Option<FetchError>) {
        let Some(transport) = self.transport() else { return (Vec::new(), Some(FetchError::NoTransport)) };
        let part_bytes = self.inner.cfg.fetch_read_part_bytes;
        let per_part = usize::try_from(part_bytes / layout.block_bytes().max(1)).unwrap_or(usize::MAX).max(1);
        let started = Instant::now();
        let mut extents = extents.into_iter();
        let mut read_part = |blocks: &[&TransferBlockInfo]| {
            let local: Vec<Extent> = extents.by_ref().take(blocks.len()).collect();
            transport.read(owner, session, read_ops(layout, blocks), local, deadline)
        };
        let mut parts = plan.chunks(per_part);
        let mut out = Vec::with_capacity(plan.len());
        let mut short = None;
        let Some(first) = parts.next() else { return (out, short) };
        let mut prev = (first, read_part(first).await);
        let mut read = Instant::now();
        loop {
            let (blocks, done) = prev;
            // After a failed read, or past the deadline, nothing more is read.
            let read_ok = done.results.iter().all(Result::is_ok);
            let next = parts.next().filter(|_| read_ok);
            if next.is_some() && Instant::now() >= deadline {
                short = Some(FetchError::Deadline);
            }
            let (verified, next) = match next.filter(|_| short.is_none()) {
                Some(n) => {
                    // The read first: its requests leave before an inline
                    // checksum pass (small parts, one core) holds the task.
                    let (d, v) = tokio::join!(read_part(n), verify_reads(layout, done.local, done.results));
                    read = Instant::now();
                    (v, Some((n, d)))
                }
                None => (verify_reads(layout, done.local, done.results).await, None),
            };
            let intact = verified.len() == blocks.len()
                && verified
                    .iter()
                    .zip(blocks)
                    .all(|((_, res, sums), b)| res.is_ok() && sums.as_ref().is_some_and(|s| as_advertised(s, b)));
            if verified.len() < blocks.len() {
                short = Some(FetchError::Transport(TransportError::Io("checksum task did not finish".into())));
            }
            out.extend(verified);
            match next {
                Some(n) if intact => prev = n,
                _ => break,
            }
        }
        tracing::debug!(
            blocks = out.len(),
            read_us = (read - started).as_micros() as u64,
            verify_tail_us = read.elapsed().as_micros() as u64,
            "fetch read"
        );
        (out, short)
    }
}

/// Whether a fetched block's slot checksums are the ones its owner advertised
/// for it (C10).
fn as_advertised(sums: &[u32], b: &TransferBlockInfo) -> bool {
    sums.iter().copied().eq(b.slots.iter().map(|s| s.crc32c))
}

/// A completed read's extent, its result and, for a successful read, the
/// CRC-32C of each of its slots (`None` when the read failed).
type Verified = (Extent, Result<(), TransportError>, Option<Arc<[u32]>>);

/// Checksums the slots of every successfully read extent.
///
/// The CRC pass reads every fetched byte once more, from memory rather than
/// cache (the batch is far larger than any cache by the time it completes):
/// at ~10 GB/s a core that is 15-25 % of a large loopback fetch (T4). Large
/// batches are therefore split into contiguous parts of at least
/// `FETCH_VERIFY_PART_BYTES_MIN`, one task each (at most one per core and
/// `FETCH_VERIFY_TASKS_MAX`), which run on otherwise idle workers; results
/// come back in order (possibly short, only if the runtime shuts down under
/// us). Small batches, and every batch under the simulator
/// ([`crate::rt::cpu_parallelism`] is 1 there), are checksummed inline.
async fn verify_reads(
    layout: &Arc<super::layout::Layout>,
    local: Vec<Extent>,
    results: Vec<Result<(), TransportError>>,
) -> Vec<Verified> {
    fn check(layout: &super::layout::Layout, ext: Extent, res: Result<(), TransportError>) -> Verified {
        let sums = res.is_ok().then(|| slot_checksums(layout, ext.as_slice()));
        (ext, res, sums)
    }
    let bytes: u64 = local.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(e, _)| e.len()).sum();
    let cores = crate::rt::cpu_parallelism();
    let by_size = usize::try_from(bytes / crate::limits::FETCH_VERIFY_PART_BYTES_MIN).unwrap_or(usize::MAX);
    let parts = cores.min(crate::limits::FETCH_VERIFY_TASKS_MAX).min(by_size).min(local.len());
    if parts <= 1 {
        return local.into_iter().zip(results).map(|(e, r)| check(layout, e, r)).collect();
    }
    let per_part = local.len().div_ceil(parts);
    let mut items = local.into_iter().zip(results);
    let mut tasks = Vec::with_capacity(parts);
    loop {
        let part: Vec<_> = items.by_ref().take(per_part).collect();
        if part.is_empty() {
            break;
        }
        let layout = layout.clone();
        tasks.push(tokio::spawn(async move {
            part.into_iter().map(|(e, r)| check(&layout, e, r)).collect::<Vec<Verified>>()
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        match task.await {
            Ok(part) => out.extend(part),
            // Only a runtime shutdown cancels the task (the closure cannot
            // panic short of a bug); its extents went with it, so the
            // verified prefix ends here and the caller sees a short list.
            Err(e) if e.is_panic() => panic!("checksum task panicked: {e}"),
            Err(_) => break,
        }
    }
    out
}

/// The read ops that fill `blocks[i]` into local extent `i` (slot by slot,
/// coalesced where contiguous on both sides).
fn read_ops(layout: &super::layout::Layout, blocks: &[&TransferBlockInfo]) -> Vec<ReadOp> {
    let mut ops: Vec<ReadOp> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        for (l, s) in b.slots.iter().enumerate() {
            let base = layout.slot_offset(l);
            push_coalesced(
                &mut ops,
                ReadOp { region: 0, remote_offset: s.k_ptr, len: s.k_size, local_extent: i, local_offset: base },
            );
            if s.v_size > 0 {
                push_coalesced(
                    &mut ops,
                    ReadOp {
                        region: 0,
                        remote_offset: s.v_ptr,
                        len: s.v_size,
                        local_extent: i,
                        local_offset: base + s.k_size,
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

/// Checks a peer's block description against the local layout: the two
/// must be of one [`LayoutFamily`] (per layer the segment count and bytes),
/// whatever buffers each side registered (C15).
fn check_shape(layout: &super::layout::Layout, b: &TransferBlockInfo) -> Result<(), String> {
    let peer = LayoutFamily { slots: b.slots.iter().map(|s| (if s.v_size == 0 { 1 } else { 2 }, s.k_size)).collect() };
    let split_unequal = b.slots.iter().position(|s| s.v_size != 0 && s.v_size != s.k_size);
    let local = layout.family();
    if peer != local || split_unequal.is_some() {
        return Err(format!(
            "the owner's blocks are {peer}, this node's layout is {local}: the namespace names two different KV \
             layouts (a namespace must name one layout family, see kvferry::hash::KvFamily)"
        ));
    }
    Ok(())
}

/// Builds the slot descriptors of a locked block for `QueryBlocksForTransfer`.
pub fn transfer_block_info(layout: &super::layout::Layout, hash: &BlockHash, block: &CachedBlock) -> TransferBlockInfo {
    let base = block.extent.offset();
    let slots = layout
        .layers()
        .iter()
        .enumerate()
        .map(|(l, ly)| {
            let k_ptr = base + layout.slot_offset(l);
            let seg = ly.bytes_per_block;
            let split = ly.v.is_some();
            crate::proto::TransferSlotInfo {
                k_ptr,
                k_size: seg,
                v_ptr: if split { k_ptr + seg } else { 0 },
                v_size: if split { seg } else { 0 },
                numa_node: 0,
                crc32c: block.checksums[l],
            }
        })
        .collect();
    TransferBlockInfo { block_hash: hash.0.clone(), slots }
}
