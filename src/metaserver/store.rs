//! The MetaServer's in-memory index (design contracts C5, C7): which nodes
//! hold which blocks, fenced by node sessions.
//!
//! The store maps `(namespace, block hash)` to a set of owners; an owner is a
//! `(node, session)` pair. Every node has at most one record `{ session,
//! last_heartbeat_ms }`. An owner is *visible* only while its node's record
//! exists, carries the owner's session and is fresh
//! (`now_ms - last_heartbeat_ms <= stale_after_ms`).
//!
//! The store is pure: no clock, no I/O, no async. Every call takes the
//! caller's `now_ms` (milliseconds on any monotonic clock the caller picks).
//!
//! Layout, chosen for insert speed, for bounded per-call work and for
//! requests of many clients running on many cores (see [`MetaStore`] for
//! the locks and the consistency they give):
//! - hashes are spread over shards by a fixed mix of their bytes; each
//!   shard has its own lock, its own namespaces and its own part of every
//!   node's reverse index;
//! - nodes are interned to `u32` indices in one node table (recycled once
//!   removed, so memory follows the live set); namespaces are interned per
//!   shard (recycled once empty there);
//! - each namespace of a shard keeps a [`SlotIndex`] (`hash → slot id`, an
//!   open-addressing table of 8-byte buckets under a keyed SipHash of the
//!   hash bytes) plus a slab of slots, and a slot holds the hash and a small
//!   inline vector of owners `(node index, session generation,
//!   back-pointer)`: a lookup is one line of buckets and one slot, and a
//!   prefix query prefetches both for many hashes ahead of its walk;
//! - each shard keeps, per node, a vector of the `(namespace, slot)` of that
//!   shard the node owns; owners and reverse entries point at each other, so
//!   removing one ownership is O(1) and dropping a node is O(shards + blocks
//!   it owns).
//!
//! Invariant: every owner entry in the index belongs to the *current* session
//! of an existing node record. Takeover, unregister and sweep drop the old
//! entries eagerly through the reverse index, so no scan of the whole index
//! is ever needed. Visibility still checks the session generation, as a
//! second line of defence.
//!
//! Inputs are not validated here (hash lengths, namespace length, request
//! size): the gRPC layer does that against [`crate::limits`] before calling.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tonic::Code;

use super::index::{SlotIndex, prefetch};
use crate::limits;
use crate::status::GrpcCode;
use crate::types::{BlockHash, NodeAddr, SessionId};

/// Timing knobs of a [`MetaStore`], in milliseconds on the caller's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// A node whose last heartbeat is more than this many ms before `now_ms`
    /// is *stale*: its ownerships are invisible, its writes are fenced and a
    /// new session may take its address over.
    pub stale_after_ms: u64,
    /// A node whose last heartbeat is more than this many ms before `now_ms`
    /// is deleted by [`MetaStore::sweep`], with all its ownerships. Meant to
    /// be `>= stale_after_ms`; not enforced.
    pub ttl_ms: u64,
}

impl Default for StoreConfig {
    /// [`limits::STALE_AFTER_SECS_DEFAULT`] and [`limits::NODE_TTL_SECS_DEFAULT`],
    /// converted to ms.
    fn default() -> Self {
        Self { stale_after_ms: limits::STALE_AFTER_SECS_DEFAULT * 1_000, ttl_ms: limits::NODE_TTL_SECS_DEFAULT * 1_000 }
    }
}

/// What a successful [`MetaStore::heartbeat`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatOutcome {
    /// The node had no record; one was created for this session.
    Registered,
    /// The node's record already carried this session; its heartbeat time
    /// was refreshed (which makes a stale node visible again).
    Refreshed,
    /// The node's record carried another session that was stale; this
    /// session replaced it and the old session's ownerships were dropped.
    TookOver,
}

/// Result of a successful [`MetaStore::insert`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertOutcome {
    /// How many hashes this node newly owns (count of hashes; re-inserting a
    /// hash it already owned, or a duplicate within the request, is not
    /// counted).
    pub inserted: u64,
    /// Hashes that at least two *other* visible owners also hold, so this
    /// node's copy is the third-or-later live one and the caller may reclaim
    /// it. In request order, without duplicates.
    pub reclaimable: Vec<BlockHash>,
    /// Hashes not recorded because the index could not grow (the allocator
    /// refused the memory): the store keeps serving, those registrations
    /// are lost as if dropped.
    pub refused_no_memory: u64,
}

/// Result of [`MetaStore::sweep`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Node records deleted because their last heartbeat was older than
    /// `ttl_ms`.
    pub nodes_removed: u64,
    /// Owner entries (one per `(namespace, hash, node)`) deleted with them.
    pub owners_removed: u64,
}

/// Bytes one namespace's index takes when sized for `capacity_hashes` over
/// `shards` shards ([`MetaStore::with_shards`]): per shard the bucket table
/// and the slot table of its share.
pub fn capacity_bytes(capacity_hashes: u64, shards: usize) -> u64 {
    if capacity_hashes == 0 {
        return 0;
    }
    let per_shard = shard_capacity(usize::try_from(capacity_hashes).unwrap_or(usize::MAX), shards.max(1));
    let slots = (per_shard as u64).saturating_mul(mem::size_of::<Slot>() as u64);
    super::index::table_bytes(per_shard).saturating_add(slots).saturating_mul(shards.max(1) as u64)
}

/// Checks that one namespace's index of `capacity_hashes` over `shards`
/// shards can be allocated now: allocates that much (without touching it,
/// so no page is committed) and frees it. A capacity the process cannot
/// have (an address-space limit, `ulimit -v`, or a heuristic overcommit
/// refusal) is refused at start instead of aborting the first insert.
///
/// # Errors
/// `(bytes, the allocator's refusal)`.
pub fn check_capacity(capacity_hashes: u64, shards: usize) -> Result<(), (u64, String)> {
    let bytes = capacity_bytes(capacity_hashes, shards);
    if bytes == 0 {
        return Ok(());
    }
    let fail = |reason: String| (bytes, reason);
    let len = usize::try_from(bytes).map_err(|_| fail("more than the address space".into()))?;
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(len).map_err(|e| fail(e.to_string()))?;
    drop(probe);
    Ok(())
}

/// Sizes of a [`MetaStore`], all counts, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Node records (live or stale, not yet swept or unregistered).
    pub nodes: u64,
    /// Namespaces holding at least one hash.
    pub namespaces: u64,
    /// Distinct `(namespace, hash)` keys with at least one owner entry.
    pub hashes: u64,
    /// Owner entries, i.e. `(namespace, hash, node)` triples, visible or not.
    pub owner_entries: u64,
}

/// Why a [`MetaStore`] call was refused. A refused call changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A write named a node that has no record: it must heartbeat first.
    #[error("node {node} is not registered; send a heartbeat first")]
    UnknownNode {
        /// The node the write named.
        node: NodeAddr,
    },
    /// A write was fenced: the node's record carries another session, or is
    /// stale.
    #[error(
        "write from node {node} with session {got} is fenced: {}",
        describe_expected(expected.as_ref())
    )]
    StaleSession {
        /// The node the write named.
        node: NodeAddr,
        /// The session the record would accept now: `Some` when the record
        /// is fresh (and so carries a different session), `None` when the
        /// record is stale (whatever its session).
        expected: Option<SessionId>,
        /// The session the write carried.
        got: SessionId,
    },
    /// A heartbeat carried a new session while another session of the same
    /// node is still fresh: two processes claim one address.
    #[error(
        "node {node} already has live session {live_session}; \
         a new session may take over only after it goes stale"
    )]
    LiveSessionConflict {
        /// The node the heartbeat named.
        node: NodeAddr,
        /// The fresh session that holds the node.
        live_session: SessionId,
    },
}

impl StoreError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::UnknownNode { .. } => "store_unknown_node",
            StoreError::StaleSession { .. } => "store_stale_session",
            StoreError::LiveSessionConflict { .. } => "store_live_session_conflict",
        }
    }
}

/// Store errors → `FAILED_PRECONDITION`, all three of them, as the peer
/// MetaServer (pegaflow-metaserver) answers: an unknown node or a stale
/// session on a write, and a heartbeat from a different session while the
/// address's registered session is still live. That is the one code the
/// peer's clients act on (they reset their "registered" flag and heartbeat
/// again, with backoff); a conflicting heartbeat succeeds once the other
/// session goes stale. The message names which case it was. The full table
/// of codes per RPC is in `docs/wire.md`.
impl GrpcCode for StoreError {
    fn grpc_code(&self) -> Code {
        match self {
            StoreError::UnknownNode { .. }
            | StoreError::StaleSession { .. }
            | StoreError::LiveSessionConflict { .. } => Code::FailedPrecondition,
        }
    }
}

/// The store's indices disagree (see [`MetaStore::check_consistency`]):
/// what was found, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metaserver store is inconsistent: {0}")]
pub struct Inconsistency(pub String);

fn describe_expected(expected: Option<&SessionId>) -> String {
    match expected {
        Some(s) => format!("the node's live session is {s}"),
        None => "the node's record is stale; heartbeat again first".to_string(),
    }
}

/// A block hash as stored: 32-byte hashes inline (the common case, no
/// allocation), others boxed. Owning a copy keeps us from pinning the
/// caller's (possibly large, shared) request buffer.
#[derive(Clone, PartialEq, Eq)]
enum HKey {
    B32([u8; 32]),
    Var(Box<[u8]>),
}

impl HKey {
    /// Placeholder left in freed slots (allocation-free).
    const EMPTY: HKey = HKey::B32([0; 32]);

    fn new(b: &[u8]) -> Self {
        match <[u8; 32]>::try_from(b) {
            Ok(a) => HKey::B32(a),
            Err(_) => HKey::Var(b.into()),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            HKey::B32(a) => a,
            HKey::Var(b) => b,
        }
    }

    fn to_block_hash(&self) -> BlockHash {
        BlockHash::new(self.as_slice().to_vec())
    }
}

/// One owner entry of a slot.
#[derive(Clone, Copy, Default, Debug)]
struct Owner {
    /// Index into the node table.
    node: u32,
    /// The node slot's session generation when the entry was written.
    generation: u32,
    /// Position of the matching `(namespace, slot)` in the node's reverse
    /// list of this shard (`Shard::owned`).
    rev: u32,
}

const INLINE_OWNERS: usize = 2;

/// A small vector of owners: up to [`INLINE_OWNERS`] inline, then on the heap.
enum Owners {
    Inline { len: u8, buf: [Owner; INLINE_OWNERS] },
    Heap(Vec<Owner>),
}

impl Owners {
    const EMPTY: Owners = Owners::Inline { len: 0, buf: [Owner { node: 0, generation: 0, rev: 0 }; INLINE_OWNERS] };

    fn as_slice(&self) -> &[Owner] {
        match self {
            Owners::Inline { len, buf } => &buf[..usize::from(*len)],
            Owners::Heap(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [Owner] {
        match self {
            Owners::Inline { len, buf } => &mut buf[..usize::from(*len)],
            Owners::Heap(v) => v,
        }
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    fn position(&self, node: u32) -> Option<usize> {
        self.as_slice().iter().position(|o| o.node == node)
    }

    fn push(&mut self, o: Owner) {
        match self {
            Owners::Inline { len, buf } if usize::from(*len) < INLINE_OWNERS => {
                buf[usize::from(*len)] = o;
                *len += 1;
            }
            Owners::Inline { len, buf } => {
                let mut v = Vec::with_capacity(INLINE_OWNERS * 2);
                v.extend_from_slice(&buf[..usize::from(*len)]);
                v.push(o);
                *self = Owners::Heap(v);
            }
            Owners::Heap(v) => v.push(o),
        }
    }

    fn swap_remove(&mut self, i: usize) -> Owner {
        match self {
            Owners::Inline { len, buf } => {
                let last = usize::from(*len) - 1;
                let o = buf[i];
                buf[i] = buf[last];
                *len -= 1;
                o
            }
            Owners::Heap(v) => v.swap_remove(i),
        }
    }
}

/// One `(namespace, hash)` key with its owners.
struct Slot {
    key: HKey,
    owners: Owners,
}

/// One interned namespace.
struct Namespace {
    name: String,
    /// `hash → slot id`, keyed by [`Shard::key_hash`].
    index: SlotIndex,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
}

impl Namespace {
    fn new(name: String) -> Self {
        Self { name, index: SlotIndex::default(), slots: Vec::new(), free_slots: Vec::new() }
    }

    /// The slot id of `key` (hashed to `h`), if stored.
    fn find(&self, key: &[u8], h: u64) -> Option<u32> {
        self.index.find(h, |s| self.slots.get(s as usize).is_some_and(|x| x.key.as_slice() == key))
    }
}

/// A node's record. The heartbeat time is atomic so that a refresh (the
/// common heartbeat) needs only the node table's read lock.
struct NodeRec {
    session: SessionId,
    last_hb_ms: AtomicU64,
}

/// An interned node address and its record (`None` while the slot sits on
/// the free list).
struct NodeSlot {
    addr: NodeAddr,
    /// Bumped every time the slot gets a new session, so owner entries of an
    /// older session never match.
    generation: u32,
    rec: Option<NodeRec>,
}

/// The node table: interned addresses and their records.
#[derive(Default)]
struct Nodes {
    ids: HashMap<NodeAddr, u32>,
    slots: Vec<NodeSlot>,
    free: Vec<u32>,
}

impl Nodes {
    fn rec(&self, idx: u32) -> &NodeRec {
        self.slots[idx as usize].rec.as_ref().expect("interned node has a record")
    }

    fn owner_visible(&self, o: &Owner, now_ms: u64, stale_after_ms: u64) -> bool {
        let slot = &self.slots[o.node as usize];
        slot.generation == o.generation && slot.rec.as_ref().is_some_and(|r| is_fresh(r, now_ms, stale_after_ms))
    }

    fn register(&mut self, node: &NodeAddr, session: &SessionId, now_ms: u64) {
        let rec = NodeRec { session: session.clone(), last_hb_ms: AtomicU64::new(now_ms) };
        let idx = match self.free.pop() {
            Some(idx) => {
                let slot = &mut self.slots[idx as usize];
                slot.addr = node.clone();
                slot.generation = slot.generation.wrapping_add(1);
                slot.rec = Some(rec);
                idx
            }
            None => {
                self.slots.push(NodeSlot { addr: node.clone(), generation: 0, rec: Some(rec) });
                to_u32(self.slots.len() - 1)
            }
        };
        self.ids.insert(node.clone(), idx);
    }

    /// Deletes the record of node `idx` (its ownerships must be gone).
    fn release(&mut self, idx: u32) {
        let slot = &mut self.slots[idx as usize];
        slot.rec = None;
        self.ids.remove(&slot.addr);
        self.free.push(idx);
    }
}

fn is_fresh(rec: &NodeRec, now_ms: u64, stale_after_ms: u64) -> bool {
    now_ms.saturating_sub(rec.last_hb_ms.load(Ordering::Relaxed)) <= stale_after_ms
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).expect("MetaStore index exceeds u32")
}

/// The shard a hash lives in, out of `shards`: a fixed mix of its bytes
/// (no per-process seed, so a run is reproducible). Every namespace's copy
/// of a hash lives in the same shard.
fn shard_index(key: &[u8], shards: usize) -> usize {
    if shards == 1 {
        return 0;
    }
    let mut h = key.len() as u64;
    for chunk in key.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(31);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    ((u128::from(h) * shards as u128) >> 64) as usize
}

/// Hashes one shard's part of a namespace is sized for when the whole
/// namespace is sized for `capacity` over `shards` shards: the even share
/// plus a margin of four standard deviations (+64) for the unevenness of a
/// uniform spread, at most `capacity`. 0 stays 0 (grow on demand).
fn shard_capacity(capacity: usize, shards: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let share = capacity.div_ceil(shards);
    let margin = 4 * (share as f64).sqrt().ceil() as usize + 64;
    (share + margin).min(capacity)
}

/// One shard: the namespaces' `hash → owners` entries of the hashes that
/// [`shard_index`] puts here, and this shard's part of every node's reverse
/// index. Owner back-pointers (`Owner::rev`) index this shard's lists only,
/// so a shard is consistent on its own.
struct Shard {
    ns_ids: HashMap<String, u32>,
    namespaces: Vec<Namespace>,
    free_namespaces: Vec<u32>,
    /// By node index: every `(namespace, slot)` of this shard that the
    /// node's current session owns.
    owned: Vec<Vec<(u32, u32)>>,
    /// Hashes each namespace of this shard is sized for when created.
    capacity: usize,
    /// The keyed hash of the [`SlotIndex`]es (the store's, shared by every
    /// shard, so a query hashes each key once, outside the locks).
    hasher: RandomState,
}

impl Shard {
    fn new(capacity: usize, hasher: RandomState) -> Self {
        Self {
            ns_ids: HashMap::new(),
            namespaces: Vec::new(),
            free_namespaces: Vec::new(),
            owned: Vec::new(),
            capacity,
            hasher,
        }
    }

    fn key_hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn intern_namespace(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ns_ids.get(name) {
            return id;
        }
        let id = match self.free_namespaces.pop() {
            Some(id) => {
                self.namespaces[id as usize].name = name.to_string();
                id
            }
            None => {
                self.namespaces.push(Namespace::new(name.to_string()));
                to_u32(self.namespaces.len() - 1)
            }
        };
        self.ns_ids.insert(name.to_string(), id);
        let ns = &mut self.namespaces[id as usize];
        // Sized up front where the memory can be had; where it cannot, the
        // namespace grows on demand and each growth is fallible (`insert`).
        let _ = ns.index.try_reserve(self.capacity);
        let _ = ns.slots.try_reserve_exact(self.capacity);
        id
    }

    /// The owner entries of `key` (hashed to `h` by [`Shard::key_hash`]) in
    /// `namespace` (empty when unknown); `ns_guess` as for
    /// [`Shard::namespace_id`].
    fn owners_of(&self, namespace: &str, ns_guess: u32, key: &[u8], h: u64) -> &[Owner] {
        let Some(ns_id) = self.namespace_id(namespace, ns_guess) else {
            return &[];
        };
        let ns = &self.namespaces[ns_id as usize];
        match ns.find(key, h) {
            Some(slot_id) => ns.slots[slot_id as usize].owners.as_slice(),
            None => &[],
        }
    }

    /// The id of `namespace` here, if it has one. `guess` (any value) is
    /// tried first: a namespace usually has the same id in every shard, so
    /// a query's prefetch round passes the id the previous hash's shard
    /// gave (and its walk the id this shard gave then), and a right guess
    /// costs a name comparison instead of a hash lookup. A live namespace's
    /// entry carries its name; a recycled one carries an empty name, which
    /// never matches (not even an empty `namespace`).
    fn namespace_id(&self, namespace: &str, guess: u32) -> Option<u32> {
        match self.namespaces.get(guess as usize) {
            Some(ns) if !ns.name.is_empty() && ns.name == namespace => Some(guess),
            _ => self.ns_ids.get(namespace).copied(),
        }
    }

    /// Where a lookup of the key hashed to `h` in namespace `ns_id` (as
    /// [`Shard::namespace_id`] gave it, maybe changed since: a wrong hint
    /// costs a wasted load, never a wrong answer) reads first: the key's
    /// home bucket, as `(address, bytes)` for [`prefetch`].
    fn bucket_address(&self, ns_id: u32, h: u64) -> Option<(usize, usize)> {
        self.namespaces.get(ns_id as usize)?.index.home_address(h)
    }

    /// What the same lookup reads next, once its bucket line has arrived:
    /// the slot the first bucket with matching hash bits names.
    fn slot_address(&self, ns_id: u32, h: u64) -> Option<(usize, usize)> {
        let ns = self.namespaces.get(ns_id as usize)?;
        let slot = ns.slots.get(ns.index.first_candidate(h)? as usize)?;
        Some((slot as *const Slot as usize, mem::size_of::<Slot>()))
    }

    /// Records node `idx` (of `nodes`) as an owner of each `(position,
    /// hash)` of `items`, all of this shard, counting other owners visible
    /// at `now_ms` (stale after `stale_after_ms`); pushes the request positions
    /// of reclaimable hashes (first occurrence only) to `reclaim`. Returns
    /// how many are newly owned, and how many were refused because the
    /// index could not grow (those and every later item of `items`: a
    /// refused growth changes nothing).
    fn insert<'h>(
        &mut self,
        namespace: &str,
        items: impl Iterator<Item = (usize, &'h BlockHash)>,
        idx: u32,
        (nodes, now_ms, stale_after_ms): (&Nodes, u64, u64),
        reclaim: &mut Vec<usize>,
    ) -> (u64, u64) {
        let mut items = items.peekable();
        let ns_id = self.intern_namespace(namespace);
        let generation = nodes.slots[idx as usize].generation;
        if self.owned.len() <= idx as usize {
            self.owned.resize_with(idx as usize + 1, Vec::new);
        }
        let Self { namespaces, owned, hasher, .. } = self;
        let owned = &mut owned[idx as usize];
        let ns = &mut namespaces[ns_id as usize];
        // Slots already reported as reclaimable; only built when needed.
        let mut reported: Option<HashSet<u32>> = None;
        let mut inserted = 0;
        while let Some((pos, h)) = items.next() {
            let key = h.as_bytes();
            let kh = hasher.hash_one(key);
            // Every growth this item may need, before anything changes.
            let found = ns.find(key, kh);
            let grown = owned.try_reserve(1).and_then(|()| match found {
                Some(_) => Ok(()),
                None => ns.slots.try_reserve(1).and_then(|()| ns.index.try_reserve(1)),
            });
            if grown.is_err() {
                return (inserted, 1 + items.count() as u64);
            }
            let slot_id = match found {
                Some(id) => id,
                None => {
                    let slot = Slot { key: HKey::new(key), owners: Owners::EMPTY };
                    let id = match ns.free_slots.pop() {
                        Some(id) => {
                            ns.slots[id as usize] = slot;
                            id
                        }
                        None => {
                            ns.slots.push(slot);
                            to_u32(ns.slots.len() - 1)
                        }
                    };
                    ns.index.try_insert(kh, id).expect("reserved above");
                    id
                }
            };
            let slot = &mut ns.slots[slot_id as usize];
            let mut mine = false;
            let mut others_visible = 0usize;
            for o in slot.owners.as_slice() {
                if o.node == idx {
                    mine = true;
                } else if nodes.owner_visible(o, now_ms, stale_after_ms) {
                    others_visible += 1;
                }
            }
            if !mine {
                slot.owners.push(Owner { node: idx, generation, rev: to_u32(owned.len()) });
                owned.push((ns_id, slot_id));
                inserted += 1;
            }
            if others_visible >= 2 && reported.get_or_insert_default().insert(slot_id) {
                reclaim.push(pos);
            }
        }
        (inserted, 0)
    }

    /// Removes node `idx`'s ownership of each of `hashes` (all of this
    /// shard) in `namespace`. Returns how many were removed.
    fn remove<'h>(&mut self, namespace: &str, hashes: impl Iterator<Item = &'h BlockHash>, idx: u32) -> u64 {
        let Some(&ns_id) = self.ns_ids.get(namespace) else {
            return 0;
        };
        let mut removed = 0;
        for h in hashes {
            // If the namespace empties mid-loop it is recycled with an empty
            // index, so later lookups simply miss.
            let ns = &self.namespaces[ns_id as usize];
            let kh = self.key_hash(h.as_bytes());
            let Some(slot_id) = ns.find(h.as_bytes(), kh) else {
                continue;
            };
            let Some(pos) = ns.slots[slot_id as usize].owners.position(idx) else {
                continue;
            };
            self.remove_owner(ns_id, slot_id, kh, pos);
            removed += 1;
        }
        removed
    }

    /// Drops every ownership of node `idx` in this shard through its
    /// reverse list. Returns how many were dropped.
    fn drop_node(&mut self, idx: u32) -> u64 {
        let owned = match self.owned.get_mut(idx as usize) {
            Some(list) => mem::take(list),
            None => return 0,
        };
        let n = owned.len() as u64;
        for (ns_id, slot_id) in owned {
            let owners = &mut self.namespaces[ns_id as usize].slots[slot_id as usize].owners;
            let pos = owners.position(idx).expect("reverse index points at an owner entry");
            // Moving another owner within this slot leaves its `rev` valid.
            owners.swap_remove(pos);
            if owners.is_empty() {
                let kh = self.key_hash(self.namespaces[ns_id as usize].slots[slot_id as usize].key.as_slice());
                self.free_slot(ns_id, slot_id, kh);
            }
        }
        n
    }

    /// Removes the owner at `pos` of a slot (whose key hashes to `kh`),
    /// keeping the reverse index and back-pointers consistent. O(owners of
    /// one hash).
    fn remove_owner(&mut self, ns_id: u32, slot_id: u32, kh: u64, pos: usize) {
        let o = self.namespaces[ns_id as usize].slots[slot_id as usize].owners.swap_remove(pos);
        let owned = &mut self.owned[o.node as usize];
        let rev = o.rev as usize;
        owned.swap_remove(rev);
        if let Some(&(mns, mslot)) = owned.get(rev) {
            let moved = &mut self.namespaces[mns as usize].slots[mslot as usize].owners;
            let p = moved.position(o.node).expect("reverse index points at an owner entry");
            moved.as_mut_slice()[p].rev = o.rev;
        }
        if self.namespaces[ns_id as usize].slots[slot_id as usize].owners.is_empty() {
            self.free_slot(ns_id, slot_id, kh);
        }
    }

    /// Frees an ownerless slot, whose key hashes to `kh`; recycles the
    /// namespace when it empties.
    fn free_slot(&mut self, ns_id: u32, slot_id: u32, kh: u64) {
        let ns = &mut self.namespaces[ns_id as usize];
        let slot = &mut ns.slots[slot_id as usize];
        slot.key = HKey::EMPTY;
        slot.owners = Owners::EMPTY;
        let listed = ns.index.remove(kh, slot_id);
        debug_assert!(listed, "a live slot is in its namespace's index");
        ns.free_slots.push(slot_id);
        if ns.index.is_empty() {
            let name = mem::take(&mut ns.name);
            // Release the memory: a recycled namespace starts from scratch.
            *ns = Namespace::new(String::new());
            self.ns_ids.remove(&name);
            self.free_namespaces.push(ns_id);
        }
    }

    fn owner_entries(&self) -> u64 {
        self.owned.iter().map(|l| l.len() as u64).sum()
    }

    /// Checks this shard (number `me` of `shards`) against `nodes`: forward
    /// and reverse entries agree exactly and every hash is in its shard.
    /// Returns the number of owner entries.
    fn check(&self, me: usize, shards: usize, nodes: &Nodes) -> Result<u64, Inconsistency> {
        fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), Inconsistency> {
            if ok { Ok(()) } else { Err(Inconsistency(what())) }
        }
        let mut entries = 0u64;
        for (name, &ns_id) in &self.ns_ids {
            let ns = self
                .namespaces
                .get(ns_id as usize)
                .ok_or_else(|| Inconsistency(format!("shard {me}: namespace id {ns_id} of {name} out of range")))?;
            ensure(&ns.name == name, || format!("shard {me}: namespace {name} interned as {}", ns.name))?;
            ensure(!ns.index.is_empty(), || format!("shard {me}: interned namespace {name} is empty"))?;
            let live = ns
                .slots
                .len()
                .checked_sub(ns.free_slots.len())
                .ok_or_else(|| Inconsistency(format!("shard {me}: {name} has more free slots than slots")))?;
            ensure(ns.index.len() == live, || {
                format!("shard {me}: {name} indexes {} hashes, {live} slots are live", ns.index.len())
            })?;
            let mut seen = HashSet::with_capacity(live);
            for (stored_hash, slot_id) in ns.index.entries() {
                ensure(seen.insert(slot_id), || format!("shard {me}: slot {slot_id} of {name} indexed twice"))?;
                let slot = ns
                    .slots
                    .get(slot_id as usize)
                    .ok_or_else(|| Inconsistency(format!("shard {me}: slot {slot_id} of {name} out of range")))?;
                let key = &slot.key;
                let kh = self.key_hash(key.as_slice());
                ensure(kh as u32 == stored_hash && ns.find(key.as_slice(), kh) == Some(slot_id), || {
                    format!("shard {me}: slot {slot_id} of {name}: filed under another hash, or not found by it")
                })?;
                ensure(shard_index(key.as_slice(), shards) == me, || {
                    format!("shard {me}: slot {slot_id} of {name} holds a hash of another shard")
                })?;
                ensure(!slot.owners.is_empty(), || format!("shard {me}: ownerless slot {slot_id} in {name}"))?;
                for o in slot.owners.as_slice() {
                    let node = nodes
                        .slots
                        .get(o.node as usize)
                        .ok_or_else(|| Inconsistency(format!("owner node {} out of range", o.node)))?;
                    ensure(node.generation == o.generation, || {
                        format!("superseded owner {} kept in {name}", node.addr)
                    })?;
                    ensure(node.rec.is_some(), || format!("owner {} of {name} is a released node", node.addr))?;
                    let back = self.owned.get(o.node as usize).and_then(|l| l.get(o.rev as usize));
                    ensure(back == Some(&(ns_id, slot_id)), || {
                        format!(
                            "shard {me}: reverse entry {} of {} does not point back to {name}/{slot_id}",
                            o.rev, node.addr
                        )
                    })?;
                    let dups = slot.owners.as_slice().iter().filter(|x| x.node == o.node).count();
                    ensure(dups == 1, || format!("node {} owns slot {slot_id} of {name} {dups} times", node.addr))?;
                    entries += 1;
                }
            }
        }
        let reverse = self.owner_entries();
        ensure(entries == reverse, || {
            format!("shard {me}: forward index has {entries} owner entries, reverse index {reverse}")
        })?;
        Ok(entries)
    }
}

/// Hashes of a prefix query whose lookups are prefetched together (see
/// [`MetaStore::query_prefix`]): enough to keep a core's dozen or so
/// outstanding cache misses busy, few enough that a walk stopping early
/// wastes little.
const QUERY_PREFETCH_WINDOW: usize = 32;

/// What [`MetaStore::recover`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// A lock of the store was poisoned (a panic while it was held); the
    /// poison is cleared.
    pub poisoned: bool,
    /// The store's indices disagreed, so it was reset to empty: what was
    /// found. `None`: kept as it was.
    pub reset: Option<Inconsistency>,
}

/// The panic message of a store operation that meets a lock poisoned by an
/// earlier fault: it refuses to read a possibly half-updated index (the
/// caller runs [`MetaStore::recover`]).
pub const POISONED: &str = "metaserver store lock poisoned by an earlier fault; recover() first";

#[cold]
fn poisoned() -> ! {
    panic!("{POISONED}")
}

struct Inner {
    cfg: StoreConfig,
    capacity_hashes: usize,
    shard_capacity: usize,
    nodes: RwLock<Nodes>,
    shards: Box<[Mutex<Shard>]>,
    /// Every shard's [`Shard::key_hash`] (a copy of it).
    hasher: RandomState,
    drop_work: AtomicU64,
}

/// The MetaServer's index: `(namespace, block hash) → owners`, plus node
/// records that fence writes by session (contracts C5, C7). A handle:
/// clones share one index, and every method takes `&self` (the index locks
/// itself), so requests from many clients run on many cores.
///
/// # Sharding and locks
/// Hashes are spread over `shards` shards by [`shard_index`] of their bytes
/// (a fixed mix, the same for every namespace); each shard has its own
/// mutex, its own namespaces and its own part of every node's reverse
/// index. The node table (addresses, sessions, heartbeat times,
/// generations) has a read-write lock, always taken *before* any shard
/// lock; shard locks are taken one at a time (a bulk drop walks them in
/// ascending order), so there is no lock-order cycle.
///
/// - `insert`/`remove` hold the node table's read lock (the fence stays
///   true for the whole call) and take each touched shard's lock once, in
///   ascending shard order, for that shard's part of the request;
/// - `query_prefix`/`owners` hold the read lock and take one shard lock at
///   a time: a query visits each hash's shard three times (two prefetch
///   hints, then the lookup the answer comes from);
/// - a heartbeat that refreshes (or is refused) needs only the read lock;
///   register, takeover, `unregister` and `sweep` take the write lock, so
///   they are atomic to every other call.
///
/// # Consistency
/// Every call is linearizable on its own *per hash*, and node events are
/// atomic: a query never sees part of an unregister, takeover or sweep, and
/// no write of a superseded session lands after its takeover. A write that
/// spans several shards is applied shard by shard, so a query running at
/// the same time may see some shards' part of it and not others' — the
/// answer is one the store would give had that write been sent as several
/// smaller requests (which a client may do anyway). Calls made one after
/// another give exactly the answers of one unsharded index, whatever the
/// shard count (property-tested against a reference model), so C7's order
/// (prefix length descending, then node) is unchanged.
///
/// # Faults
/// A panic while a lock is held poisons it; a later call that meets the
/// poison panics with [`POISONED`] instead of reading a possibly
/// half-updated index, until [`MetaStore::recover`] (run by the service
/// after any caught panic) checks the indices, resets the store if they
/// disagree and clears the poison.
///
/// Costs: `insert`, `remove` and `query_prefix` are O(hashes in the call)
/// (times the owners per hash, a small number); `unregister` and a takeover
/// are O(shards + blocks the node owns); `sweep` is O(nodes) when nothing
/// expired; `visible_entries` is O(everything) and meant for tests.
#[derive(Clone)]
pub struct MetaStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for MetaStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetaStore")
            .field("config", &self.inner.cfg)
            .field("shards", &self.inner.shards.len())
            .finish_non_exhaustive()
    }
}

impl MetaStore {
    /// An empty store with the given timing knobs and
    /// [`limits::METASERVER_SHARDS_DEFAULT`] shards; namespaces grow on
    /// demand.
    pub fn new(cfg: StoreConfig) -> Self {
        Self::with_capacity(cfg, 0)
    }

    /// An empty store whose namespaces are each sized, when created, for
    /// `capacity_hashes` distinct hashes (hash index and slot table), with
    /// [`limits::METASERVER_SHARDS_DEFAULT`] shards. See
    /// [`MetaStore::with_shards`].
    pub fn with_capacity(cfg: StoreConfig, capacity_hashes: usize) -> Self {
        Self::with_shards(cfg, capacity_hashes, limits::METASERVER_SHARDS_DEFAULT)
    }

    /// An empty store of `shards` shards whose namespaces are each sized
    /// for `capacity_hashes` distinct hashes: each shard's part of a
    /// namespace is sized, when first written, for its share plus a margin
    /// for uneven spread ([`shard_capacity`]). An index that grows on
    /// demand doubles, moving every entry of that shard's table (and the
    /// slab of slots) while the shard is locked; sized up front it
    /// practically never grows below the capacity. Costs roughly 100 bytes
    /// per hash of capacity per namespace. `capacity_hashes` 0: grow on demand.
    ///
    /// # Panics
    /// When `shards` is 0 or above [`limits::METASERVER_SHARDS_MAX`] (the
    /// service validates its setting before).
    pub fn with_shards(cfg: StoreConfig, capacity_hashes: usize, shards: usize) -> Self {
        assert!(
            (1..=limits::METASERVER_SHARDS_MAX).contains(&shards),
            "MetaStore shards must be 1..={}, got {shards}",
            limits::METASERVER_SHARDS_MAX
        );
        let shard_capacity = shard_capacity(capacity_hashes, shards);
        let hasher = RandomState::new();
        Self {
            inner: Arc::new(Inner {
                cfg,
                capacity_hashes,
                shard_capacity,
                nodes: RwLock::new(Nodes::default()),
                shards: (0..shards).map(|_| Mutex::new(Shard::new(shard_capacity, hasher.clone()))).collect(),
                hasher,
                drop_work: AtomicU64::new(0),
            }),
        }
    }

    /// The timing knobs this store was built with.
    pub fn config(&self) -> StoreConfig {
        self.inner.cfg
    }

    /// The per-namespace capacity this store was built with
    /// ([`MetaStore::with_capacity`]).
    pub fn capacity_hashes(&self) -> usize {
        self.inner.capacity_hashes
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.inner.shards.len()
    }

    fn read_nodes(&self) -> RwLockReadGuard<'_, Nodes> {
        self.inner.nodes.read().unwrap_or_else(|_| poisoned())
    }

    fn write_nodes(&self) -> RwLockWriteGuard<'_, Nodes> {
        self.inner.nodes.write().unwrap_or_else(|_| poisoned())
    }

    fn shard(&self, i: usize) -> MutexGuard<'_, Shard> {
        self.inner.shards[i].lock().unwrap_or_else(|_| poisoned())
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        shard_index(key, self.inner.shards.len())
    }

    /// Request positions of `hashes` grouped by shard: `(shard, positions
    /// in request order)`, shards ascending, empty shards left out.
    fn group_by_shard(&self, hashes: &[BlockHash]) -> Vec<(usize, Vec<usize>)> {
        let n = self.inner.shards.len();
        if n == 1 {
            return vec![(0, (0..hashes.len()).collect())];
        }
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (pos, h) in hashes.iter().enumerate() {
            groups[shard_index(h.as_bytes(), n)].push(pos);
        }
        groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()).collect()
    }

    /// Registers or refreshes `node` under `session` at `now_ms`.
    ///
    /// - no record: creates one ([`HeartbeatOutcome::Registered`]);
    /// - same session: sets the heartbeat time to `max(previous, now_ms)`
    ///   ([`HeartbeatOutcome::Refreshed`]);
    /// - another session that is stale: replaces it and drops all its
    ///   ownerships, O(shards + blocks it owned)
    ///   ([`HeartbeatOutcome::TookOver`]).
    ///
    /// # Errors
    /// [`StoreError::LiveSessionConflict`] when another session of `node` is
    /// still fresh; nothing changes.
    pub fn heartbeat(&self, node: &NodeAddr, session: &SessionId, now_ms: u64) -> Result<HeartbeatOutcome, StoreError> {
        if let Some(done) = self.heartbeat_shared(&self.read_nodes(), node, session, now_ms) {
            return done;
        }
        let mut nodes = self.write_nodes();
        // Decided again: the table may have changed between the locks.
        if let Some(done) = self.heartbeat_shared(&nodes, node, session, now_ms) {
            return done;
        }
        let Some(&idx) = nodes.ids.get(node) else {
            nodes.register(node, session, now_ms);
            return Ok(HeartbeatOutcome::Registered);
        };
        self.drop_ownerships(&mut nodes, idx);
        let slot = &mut nodes.slots[idx as usize];
        slot.generation = slot.generation.wrapping_add(1);
        slot.rec = Some(NodeRec { session: session.clone(), last_hb_ms: AtomicU64::new(now_ms) });
        Ok(HeartbeatOutcome::TookOver)
    }

    /// The heartbeat outcomes that change no table entry (refresh, live
    /// conflict), decided under any lock of the node table; `None` when the
    /// heartbeat registers or takes over (write lock needed).
    fn heartbeat_shared(
        &self,
        nodes: &Nodes,
        node: &NodeAddr,
        session: &SessionId,
        now_ms: u64,
    ) -> Option<Result<HeartbeatOutcome, StoreError>> {
        let &idx = nodes.ids.get(node)?;
        let rec = nodes.rec(idx);
        if rec.session == *session {
            rec.last_hb_ms.fetch_max(now_ms, Ordering::Relaxed);
            return Some(Ok(HeartbeatOutcome::Refreshed));
        }
        if is_fresh(rec, now_ms, self.inner.cfg.stale_after_ms) {
            return Some(Err(StoreError::LiveSessionConflict {
                node: node.clone(),
                live_session: rec.session.clone(),
            }));
        }
        None
    }

    /// Records that `node` (session `session`) holds `hashes` in `namespace`
    /// (upsert; duplicates within the request are fine).
    ///
    /// Returns how many hashes are newly owned and which ones are
    /// reclaimable (see [`InsertOutcome`]). O(`hashes.len()`).
    ///
    /// # Errors
    /// [`StoreError::UnknownNode`] when `node` has no record;
    /// [`StoreError::StaleSession`] when its record carries another session
    /// or is stale. On error nothing changes.
    pub fn insert(
        &self,
        namespace: &str,
        hashes: &[BlockHash],
        node: &NodeAddr,
        session: &SessionId,
        now_ms: u64,
    ) -> Result<InsertOutcome, StoreError> {
        let nodes = self.read_nodes();
        let idx = self.fence(&nodes, node, session, now_ms)?;
        let mut out = InsertOutcome::default();
        if hashes.is_empty() {
            return Ok(out);
        }
        let stale_after = self.inner.cfg.stale_after_ms;
        let mut reclaim = Vec::new();
        for (s, group) in self.group_by_shard(hashes) {
            let items = group.into_iter().map(|p| (p, &hashes[p]));
            let (inserted, refused) =
                self.shard(s).insert(namespace, items, idx, (&nodes, now_ms, stale_after), &mut reclaim);
            out.inserted += inserted;
            out.refused_no_memory += refused;
        }
        reclaim.sort_unstable();
        out.reclaimable = reclaim.into_iter().map(|p| hashes[p].clone()).collect();
        Ok(out)
    }

    /// Removes `node`'s (session `session`) ownership of `hashes` in
    /// `namespace`; other owners are untouched. Returns how many ownerships
    /// were removed (hashes it did not own count 0). O(`hashes.len()`).
    ///
    /// # Errors
    /// As [`MetaStore::insert`]; on error nothing changes.
    pub fn remove(
        &self,
        namespace: &str,
        hashes: &[BlockHash],
        node: &NodeAddr,
        session: &SessionId,
        now_ms: u64,
    ) -> Result<u64, StoreError> {
        let nodes = self.read_nodes();
        let idx = self.fence(&nodes, node, session, now_ms)?;
        let mut removed = 0;
        for (s, group) in self.group_by_shard(hashes) {
            removed += self.shard(s).remove(namespace, group.into_iter().map(|p| &hashes[p]), idx);
        }
        Ok(removed)
    }

    /// Deletes `node`'s record and all its ownerships, but only when the
    /// record carries `session`. Returns the number of owner entries removed;
    /// a late call from an older session, or for an unknown node, is a no-op
    /// returning 0. O(shards + blocks the node owns).
    pub fn unregister(&self, node: &NodeAddr, session: &SessionId) -> u64 {
        let mut nodes = self.write_nodes();
        let Some(&idx) = nodes.ids.get(node) else {
            return 0;
        };
        if nodes.rec(idx).session != *session {
            return 0;
        }
        let n = self.drop_ownerships(&mut nodes, idx);
        nodes.release(idx);
        n
    }

    /// The visible owners that hold a prefix of `hashes` in `namespace`, as
    /// `(node, prefix_len)` where `prefix_len` counts the consecutive hashes
    /// from the first that the node visibly owns.
    ///
    /// The walk stops at the first hash with no visible owner at all. Only
    /// owners with `prefix_len >= 1` are returned, ordered by `prefix_len`
    /// descending, then node ascending. O(`hashes.len()`). Each hash's
    /// owners are read under its shard's lock (see the type's docs for what
    /// a concurrent write may show).
    pub fn query_prefix(&self, namespace: &str, hashes: &[BlockHash], now_ms: u64) -> Vec<(NodeAddr, u32)> {
        let nodes = self.read_nodes();
        let stale_after = self.inner.cfg.stale_after_ms;
        // (node index, prefix length so far): only owners of the first hash
        // can have a prefix at all.
        let mut cands: Vec<(u32, u32)> = Vec::new();
        // Per hash of the current window: (shard, key hash, namespace id).
        let mut window: Vec<(usize, u64, u32)> = Vec::with_capacity(QUERY_PREFETCH_WINDOW);
        'walk: for (w, chunk) in hashes.chunks(QUERY_PREFETCH_WINDOW).enumerate() {
            self.prefetch_window(namespace, chunk, &mut window);
            for (j, h) in chunk.iter().enumerate() {
                let i = w * QUERY_PREFETCH_WINDOW + j;
                let (s, kh, ns_guess) = window[j];
                let shard = self.shard(s);
                let mut grew = false;
                for o in shard.owners_of(namespace, ns_guess, h.as_bytes(), kh) {
                    if !nodes.owner_visible(o, now_ms, stale_after) {
                        continue;
                    }
                    if i == 0 {
                        cands.push((o.node, 1));
                        grew = true;
                    } else if let Some(c) = cands.iter_mut().find(|c| c.0 == o.node && c.1 as usize == i) {
                        c.1 += 1;
                        grew = true;
                    }
                }
                // No candidate extended its prefix: either this hash has no
                // visible owner (the stop rule) or no later hash can change
                // the answer.
                if !grew {
                    break 'walk;
                }
            }
        }
        let mut out: Vec<(NodeAddr, u32)> =
            cands.into_iter().map(|(n, len)| (nodes.slots[n as usize].addr.clone(), len)).collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    /// Fills `window` with `(shard, key hash, namespace id there)` for each
    /// of `chunk`, and starts loading what their lookups will read, in two
    /// rounds (home buckets, then slots) so that the cache misses of all
    /// the chunk's hashes overlap instead of following one another. Each
    /// hint takes its shard's lock briefly; the walk that follows looks
    /// every hash up again under the lock, so a write in between can cost
    /// a wasted prefetch, never a wrong answer.
    fn prefetch_window(&self, namespace: &str, chunk: &[BlockHash], window: &mut Vec<(usize, u64, u32)>) {
        window.clear();
        let mut ns_guess = u32::MAX;
        for h in chunk {
            let key = h.as_bytes();
            let (s, kh) = (self.shard_of(key), self.inner.hasher.hash_one(key));
            let (ns, at) = {
                let shard = self.shard(s);
                let ns = shard.namespace_id(namespace, ns_guess).unwrap_or(u32::MAX);
                (ns, shard.bucket_address(ns, kh))
            };
            // Issued after the unlock: the lock is not held while it misses.
            if let Some((at, len)) = at {
                prefetch(at, len);
            }
            if ns != u32::MAX {
                ns_guess = ns;
            }
            window.push((s, kh, ns));
        }
        if chunk.len() > 1 {
            for &(s, kh, ns) in window.iter() {
                // Reads the bucket line (a hit, if the first round's load
                // arrived) under the lock; the slot is prefetched after it.
                let at = self.shard(s).slot_address(ns, kh);
                if let Some((at, len)) = at {
                    prefetch(at, len);
                }
            }
        }
    }

    /// Deletes every node record whose last heartbeat is more than `ttl_ms`
    /// before `now_ms`, with all its ownerships (through the reverse index).
    ///
    /// Owner entries of superseded sessions never survive a takeover or an
    /// unregister, so no further scan is needed. O(nodes) under the read
    /// lock when nothing expired; else O(nodes + shards × expired nodes +
    /// blocks they own) under the write lock.
    pub fn sweep(&self, now_ms: u64) -> SweepReport {
        let ttl = self.inner.cfg.ttl_ms;
        let expired = |r: &NodeRec| now_ms.saturating_sub(r.last_hb_ms.load(Ordering::Relaxed)) > ttl;
        if !self.read_nodes().slots.iter().filter_map(|s| s.rec.as_ref()).any(expired) {
            return SweepReport::default();
        }
        let mut report = SweepReport::default();
        let mut nodes = self.write_nodes();
        for idx in 0..nodes.slots.len() {
            if nodes.slots[idx].rec.as_ref().is_some_and(expired) {
                let idx = to_u32(idx);
                report.owners_removed += self.drop_ownerships(&mut nodes, idx);
                nodes.release(idx);
                report.nodes_removed += 1;
            }
        }
        report
    }

    /// The visible owners of `hash` in `namespace`, sorted ascending.
    pub fn owners(&self, namespace: &str, hash: &BlockHash, now_ms: u64) -> Vec<NodeAddr> {
        let nodes = self.read_nodes();
        let shard = self.shard(self.shard_of(hash.as_bytes()));
        let mut out: Vec<NodeAddr> = shard
            .owners_of(namespace, u32::MAX, hash.as_bytes(), self.inner.hasher.hash_one(hash.as_bytes()))
            .iter()
            .filter(|o| nodes.owner_visible(o, now_ms, self.inner.cfg.stale_after_ms))
            .map(|o| nodes.slots[o.node as usize].addr.clone())
            .collect();
        out.sort();
        out
    }

    /// Every visible ownership as `(namespace, hash, node)`. O(everything):
    /// for the simulator's convergence invariant and tests, not for serving.
    pub fn visible_entries(&self, now_ms: u64) -> BTreeSet<(String, BlockHash, NodeAddr)> {
        let nodes = self.read_nodes();
        let mut out = BTreeSet::new();
        for i in 0..self.inner.shards.len() {
            let shard = self.shard(i);
            for (name, &ns_id) in &shard.ns_ids {
                let ns = &shard.namespaces[ns_id as usize];
                for slot_id in ns.index.slots() {
                    let slot = &ns.slots[slot_id as usize];
                    for o in slot.owners.as_slice() {
                        if nodes.owner_visible(o, now_ms, self.inner.cfg.stale_after_ms) {
                            let addr = nodes.slots[o.node as usize].addr.clone();
                            out.insert((name.clone(), slot.key.to_block_hash(), addr));
                        }
                    }
                }
            }
        }
        out
    }

    /// Current sizes. O(nodes + shards × namespaces). Shards are read one
    /// at a time, so under concurrent writes the figures are of nearby
    /// moments, not one.
    pub fn stats(&self) -> StoreStats {
        let nodes = self.read_nodes();
        let (mut hashes, mut owner_entries) = (0u64, 0u64);
        let mut names: HashSet<String> = HashSet::new();
        for i in 0..self.inner.shards.len() {
            let shard = self.shard(i);
            hashes += shard.ns_ids.values().map(|&id| shard.namespaces[id as usize].index.len() as u64).sum::<u64>();
            owner_entries += shard.owner_entries();
            for name in shard.ns_ids.keys() {
                if !names.contains(name) {
                    names.insert(name.clone());
                }
            }
        }
        StoreStats { nodes: nodes.ids.len() as u64, namespaces: names.len() as u64, hashes, owner_entries }
    }

    /// `node`'s record as `(session, last heartbeat in ms)`, fresh or stale;
    /// `None` when it has none.
    pub fn node_session(&self, node: &NodeAddr) -> Option<(SessionId, u64)> {
        let nodes = self.read_nodes();
        let &idx = nodes.ids.get(node)?;
        let rec = nodes.slots[idx as usize].rec.as_ref()?;
        Some((rec.session.clone(), rec.last_hb_ms.load(Ordering::Relaxed)))
    }

    /// Owner entries visited by bulk drops (unregister, takeover, sweep)
    /// since the store was created: a cost probe showing those are
    /// O(blocks the node owned), for tests and metrics.
    pub fn drop_work(&self) -> u64 {
        self.inner.drop_work.load(Ordering::Relaxed)
    }

    /// Checks the write fence; returns the node index.
    fn fence(&self, nodes: &Nodes, node: &NodeAddr, session: &SessionId, now_ms: u64) -> Result<u32, StoreError> {
        let Some(&idx) = nodes.ids.get(node) else {
            return Err(StoreError::UnknownNode { node: node.clone() });
        };
        let rec = nodes.rec(idx);
        let fresh = is_fresh(rec, now_ms, self.inner.cfg.stale_after_ms);
        if rec.session != *session || !fresh {
            return Err(StoreError::StaleSession {
                node: node.clone(),
                expected: fresh.then(|| rec.session.clone()),
                got: session.clone(),
            });
        }
        Ok(idx)
    }

    /// Drops every ownership of node `idx` through its reverse index, shard
    /// by shard in ascending order; the record stays. The node table's write
    /// guard (`_held`) proves no insert, remove or query is running. Returns
    /// how many were dropped.
    fn drop_ownerships(&self, _held: &mut Nodes, idx: u32) -> u64 {
        let n: u64 = (0..self.inner.shards.len()).map(|s| self.shard(s).drop_node(idx)).sum();
        self.inner.drop_work.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// Takes every lock (node table first, then the shards in order),
    /// tolerating poison: exclusive access for checks and recovery. Returns
    /// the guards and whether any lock was poisoned (the flags are cleared).
    fn lock_all(&self) -> (RwLockWriteGuard<'_, Nodes>, Vec<MutexGuard<'_, Shard>>, bool) {
        let inner = &self.inner;
        let mut poisoned = inner.nodes.is_poisoned();
        let nodes = inner.nodes.write().unwrap_or_else(PoisonError::into_inner);
        inner.nodes.clear_poison();
        let shards = inner
            .shards
            .iter()
            .map(|m| {
                let g = m.lock().unwrap_or_else(|e| {
                    poisoned = true;
                    e.into_inner()
                });
                m.clear_poison();
                g
            })
            .collect();
        (nodes, shards, poisoned)
    }

    fn check_locked(nodes: &Nodes, shards: &[MutexGuard<'_, Shard>]) -> Result<(), Inconsistency> {
        fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), Inconsistency> {
            if ok { Ok(()) } else { Err(Inconsistency(what())) }
        }
        for (s, shard) in shards.iter().enumerate() {
            shard.check(s, shards.len(), nodes)?;
            for (idx, list) in shard.owned.iter().enumerate() {
                let live = nodes.slots.get(idx).is_some_and(|n| n.rec.is_some());
                ensure(live || list.is_empty(), || format!("shard {s}: released node {idx} still owns entries"))?;
            }
        }
        for (addr, &idx) in &nodes.ids {
            let slot = nodes
                .slots
                .get(idx as usize)
                .ok_or_else(|| Inconsistency(format!("node id {idx} of {addr} out of range")))?;
            ensure(&slot.addr == addr, || format!("node {addr} interned as {}", slot.addr))?;
            ensure(slot.rec.is_some(), || format!("interned node {addr} has no record"))?;
        }
        let live = nodes.slots.iter().filter(|n| n.rec.is_some()).count();
        ensure(live == nodes.ids.len(), || format!("{live} node records but {} interned addresses", nodes.ids.len()))
    }

    /// Panics unless the forward and reverse indices agree exactly.
    #[cfg(any(test, fuzzing))]
    fn assert_consistent(&self) {
        if let Err(e) = self.check_consistency() {
            panic!("{e}");
        }
    }

    /// Checks that the forward index (shard → namespace → hash → owners),
    /// the reverse index (shard → node → owned slots) and the node table
    /// agree exactly, and that every hash sits in its shard, without
    /// panicking on any state (a poisoned lock is read through). Takes
    /// every lock: O(everything), a fault path, not a hot one.
    ///
    /// # Errors
    /// [`Inconsistency`] naming the first disagreement found.
    pub fn check_consistency(&self) -> Result<(), Inconsistency> {
        let inner = &self.inner;
        let nodes = inner.nodes.write().unwrap_or_else(PoisonError::into_inner);
        let shards: Vec<_> = inner.shards.iter().map(|m| m.lock().unwrap_or_else(PoisonError::into_inner)).collect();
        Self::check_locked(&nodes, &shards)
    }

    /// After a fault (a caught panic in a store call, or a poisoned lock):
    /// takes every lock, clears any poison, and checks the indices; if they
    /// disagree, resets the store to empty with the same configuration. An
    /// empty store is a state the system already recovers from — a
    /// MetaServer restart: writes of unknown nodes answer
    /// `FAILED_PRECONDITION`, clients re-heartbeat and backfill (C6) —
    /// whereas a half-updated index could answer owners that do not hold a
    /// block. O(everything).
    pub fn recover(&self) -> Recovery {
        let (mut nodes, mut shards, poisoned) = self.lock_all();
        let reset = match Self::check_locked(&nodes, &shards) {
            Ok(()) => None,
            Err(e) => {
                *nodes = Nodes::default();
                for g in &mut shards {
                    **g = Shard::new(self.inner.shard_capacity, self.inner.hasher.clone());
                }
                Some(e)
            }
        };
        Recovery { poisoned, reset }
    }

    /// Test-only: breaks the reverse index of the first node that owns
    /// anything (or interns a record-less address when none does), so the
    /// service's fault recovery can be tested against a store a panic left
    /// half-updated.
    #[cfg(test)]
    pub(crate) fn corrupt_for_test(&self) {
        let (mut nodes, mut shards, _) = self.lock_all();
        Self::corrupt_locked(&mut nodes, &mut shards);
    }

    #[cfg(test)]
    fn corrupt_locked(nodes: &mut Nodes, shards: &mut [MutexGuard<'_, Shard>]) {
        for shard in shards.iter_mut() {
            if let Some(list) = shard.owned.iter_mut().find(|l| !l.is_empty()) {
                list.pop();
                return;
            }
        }
        nodes.ids.insert(NodeAddr("10.255.255.255:1".into()), u32::MAX);
    }

    /// Test-only: per shard, `(hashes, hash index capacity, slot table
    /// capacity)` of `namespace` there (`None` where the shard has none).
    #[cfg(test)]
    fn ns_sizes_for_test(&self, namespace: &str) -> Vec<Option<(usize, usize, usize)>> {
        (0..self.shards())
            .map(|i| {
                let shard = self.shard(i);
                let &id = shard.ns_ids.get(namespace)?;
                let ns = &shard.namespaces[id as usize];
                Some((ns.index.len(), ns.index.capacity(), ns.slots.capacity()))
            })
            .collect()
    }

    /// Test-only: (node slots allocated, most namespace slots allocated in
    /// any shard), to show recycling.
    #[cfg(test)]
    fn table_sizes_for_test(&self) -> (usize, usize) {
        let ns = (0..self.shards()).map(|i| self.shard(i).namespaces.len()).max().unwrap_or(0);
        (self.read_nodes().slots.len(), ns)
    }

    /// Test-only: a holder of every lock corrupts the store (when `corrupt`)
    /// and panics, leaving the locks poisoned.
    #[cfg(test)]
    pub(crate) fn poison_for_test(&self, corrupt: bool) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (mut nodes, mut shards, _) = self.lock_all();
            if corrupt {
                Self::corrupt_locked(&mut nodes, &mut shards);
            }
            panic!("injected: a holder of the store's locks panics");
        }));
    }
}

/// An obviously-correct reference model (BTreeMaps, O(n) scans) and a driver
/// that replays an op sequence against both it and [`MetaStore`].
#[cfg(any(test, fuzzing))]
mod model {
    use std::collections::{BTreeMap, BTreeSet};

    use arbitrary::Unstructured;

    use super::{HeartbeatOutcome, InsertOutcome, MetaStore, StoreConfig, StoreError, StoreStats, SweepReport};
    use crate::types::{BlockHash, NodeAddr, SessionId};

    type Key = (String, BlockHash);

    /// The specification, written as directly as possible.
    pub(super) struct Model {
        cfg: StoreConfig,
        nodes: BTreeMap<NodeAddr, (SessionId, u64)>,
        owners: BTreeMap<Key, BTreeSet<(NodeAddr, SessionId)>>,
    }

    impl Model {
        pub(super) fn new(cfg: StoreConfig) -> Self {
            Self { cfg, nodes: BTreeMap::new(), owners: BTreeMap::new() }
        }

        fn fresh(&self, node: &NodeAddr, now: u64) -> bool {
            self.nodes.get(node).is_some_and(|(_, hb)| now.saturating_sub(*hb) <= self.cfg.stale_after_ms)
        }

        fn visible(&self, node: &NodeAddr, session: &SessionId, now: u64) -> bool {
            self.nodes.get(node).is_some_and(|(s, _)| s == session) && self.fresh(node, now)
        }

        /// Drops owner entries not matching a record (all of them, by scan).
        fn drop_unmatched(&mut self) -> u64 {
            let mut removed = 0;
            let nodes = &self.nodes;
            for set in self.owners.values_mut() {
                let before = set.len();
                set.retain(|(n, s)| nodes.get(n).is_some_and(|(rs, _)| rs == s));
                removed += (before - set.len()) as u64;
            }
            self.owners.retain(|_, set| !set.is_empty());
            removed
        }

        pub(super) fn heartbeat(
            &mut self,
            node: &NodeAddr,
            session: &SessionId,
            now: u64,
        ) -> Result<HeartbeatOutcome, StoreError> {
            let fresh = self.fresh(node, now);
            match self.nodes.get_mut(node) {
                None => {
                    self.nodes.insert(node.clone(), (session.clone(), now));
                    Ok(HeartbeatOutcome::Registered)
                }
                Some((s, hb)) if s == session => {
                    *hb = (*hb).max(now);
                    Ok(HeartbeatOutcome::Refreshed)
                }
                Some((s, _)) if fresh => {
                    Err(StoreError::LiveSessionConflict { node: node.clone(), live_session: s.clone() })
                }
                Some(rec) => {
                    *rec = (session.clone(), now);
                    self.drop_unmatched();
                    Ok(HeartbeatOutcome::TookOver)
                }
            }
        }

        fn fence(&self, node: &NodeAddr, session: &SessionId, now: u64) -> Result<(), StoreError> {
            let Some((s, _)) = self.nodes.get(node) else {
                return Err(StoreError::UnknownNode { node: node.clone() });
            };
            let fresh = self.fresh(node, now);
            if s != session || !fresh {
                return Err(StoreError::StaleSession {
                    node: node.clone(),
                    expected: if fresh { Some(s.clone()) } else { None },
                    got: session.clone(),
                });
            }
            Ok(())
        }

        pub(super) fn insert(
            &mut self,
            ns: &str,
            hashes: &[BlockHash],
            node: &NodeAddr,
            session: &SessionId,
            now: u64,
        ) -> Result<InsertOutcome, StoreError> {
            self.fence(node, session, now)?;
            let mut out = InsertOutcome::default();
            for h in hashes {
                let key = (ns.to_string(), h.clone());
                let set = self.owners.entry(key.clone()).or_default();
                if set.insert((node.clone(), session.clone())) {
                    out.inserted += 1;
                }
                let set = self.owners[&key].clone();
                let others = set.iter().filter(|(n, s)| n != node && self.visible(n, s, now)).count();
                if others >= 2 && !out.reclaimable.contains(h) {
                    out.reclaimable.push(h.clone());
                }
            }
            Ok(out)
        }

        pub(super) fn remove(
            &mut self,
            ns: &str,
            hashes: &[BlockHash],
            node: &NodeAddr,
            session: &SessionId,
            now: u64,
        ) -> Result<u64, StoreError> {
            self.fence(node, session, now)?;
            let mut removed = 0;
            for h in hashes {
                let key = (ns.to_string(), h.clone());
                if let Some(set) = self.owners.get_mut(&key) {
                    if set.remove(&(node.clone(), session.clone())) {
                        removed += 1;
                    }
                    if set.is_empty() {
                        self.owners.remove(&key);
                    }
                }
            }
            Ok(removed)
        }

        pub(super) fn unregister(&mut self, node: &NodeAddr, session: &SessionId) -> u64 {
            if self.nodes.get(node).is_none_or(|(s, _)| s != session) {
                return 0;
            }
            self.nodes.remove(node);
            self.drop_unmatched()
        }

        pub(super) fn sweep(&mut self, now: u64) -> SweepReport {
            let ttl = self.cfg.ttl_ms;
            let before = self.nodes.len();
            self.nodes.retain(|_, (_, hb)| now.saturating_sub(*hb) <= ttl);
            SweepReport { nodes_removed: (before - self.nodes.len()) as u64, owners_removed: self.drop_unmatched() }
        }

        pub(super) fn owners(&self, ns: &str, h: &BlockHash, now: u64) -> Vec<NodeAddr> {
            let key = (ns.to_string(), h.clone());
            let mut v: Vec<NodeAddr> = self
                .owners
                .get(&key)
                .into_iter()
                .flatten()
                .filter(|(n, s)| self.visible(n, s, now))
                .map(|(n, _)| n.clone())
                .collect();
            v.sort();
            v
        }

        pub(super) fn query_prefix(&self, ns: &str, hashes: &[BlockHash], now: u64) -> Vec<(NodeAddr, u32)> {
            let per_hash: Vec<Vec<NodeAddr>> = hashes.iter().map(|h| self.owners(ns, h, now)).collect();
            let scanned = per_hash.iter().take_while(|o| !o.is_empty()).count();
            let all: BTreeSet<&NodeAddr> = per_hash[..scanned].iter().flatten().collect();
            let mut out: Vec<(NodeAddr, u32)> = all
                .into_iter()
                .map(|n| {
                    let len = per_hash[..scanned].iter().take_while(|o| o.contains(n)).count();
                    (n.clone(), len as u32)
                })
                .filter(|(_, len)| *len >= 1)
                .collect();
            out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            out
        }

        pub(super) fn visible_entries(&self, now: u64) -> BTreeSet<(String, BlockHash, NodeAddr)> {
            let mut out = BTreeSet::new();
            for ((ns, h), set) in &self.owners {
                for (n, s) in set {
                    if self.visible(n, s, now) {
                        out.insert((ns.clone(), h.clone(), n.clone()));
                    }
                }
            }
            out
        }

        pub(super) fn stats(&self) -> StoreStats {
            let namespaces: BTreeSet<&String> = self.owners.keys().map(|(ns, _)| ns).collect();
            StoreStats {
                nodes: self.nodes.len() as u64,
                namespaces: namespaces.len() as u64,
                hashes: self.owners.len() as u64,
                owner_entries: self.owners.values().map(|s| s.len() as u64).sum(),
            }
        }

        pub(super) fn node_session(&self, node: &NodeAddr) -> Option<(SessionId, u64)> {
            self.nodes.get(node).cloned()
        }
    }

    /// Which session an op uses: mostly the node's current one (so writes
    /// get through), sometimes a fixed index (old, new or foreign).
    #[derive(Debug, Clone)]
    pub(super) enum Sess {
        Current,
        Index(u8),
    }

    /// Which hashes an op names: a run (prefix-shaped, as real requests are)
    /// or a scattered list.
    #[derive(Debug, Clone)]
    pub(super) enum Hashes {
        Run { start: u8, len: u8 },
        List(Vec<u8>),
    }

    /// One step of a random run; indices are reduced modulo the universe.
    #[derive(Debug, Clone)]
    pub(super) enum Op {
        Heartbeat {
            node: u8,
            session: Sess,
        },
        /// Advance past `stale_after`, then heartbeat with a fixed session
        /// index (a likely takeover).
        Takeover {
            node: u8,
            session: u8,
        },
        Insert {
            ns: u8,
            hashes: Hashes,
            node: u8,
            session: Sess,
        },
        Remove {
            ns: u8,
            hashes: Hashes,
            node: u8,
            session: Sess,
        },
        Unregister {
            node: u8,
            session: Sess,
        },
        Sweep,
        /// Advance the clock by `ms / 4` ms (short steps).
        Advance {
            ms: u8,
        },
        /// Advance the clock by `ms % 1024` ms (long steps).
        Jump {
            ms: u16,
        },
        Query {
            ns: u8,
            hashes: Hashes,
        },
        Owners {
            ns: u8,
            hash: u8,
        },
    }

    /// Decodes one op, a byte or a few per field, weighted like the
    /// proptest strategy so random bytes make productive runs.
    pub(super) fn decode_op(u: &mut Unstructured<'_>) -> arbitrary::Result<Op> {
        fn sess(u: &mut Unstructured<'_>) -> arbitrary::Result<Sess> {
            let b = u.arbitrary::<u8>()?;
            Ok(if b < 192 { Sess::Current } else { Sess::Index(b % 3) })
        }
        fn hashes(u: &mut Unstructured<'_>) -> arbitrary::Result<Hashes> {
            let b = u.arbitrary::<u8>()?;
            if b & 1 == 0 {
                let len = u.arbitrary::<u8>()?;
                Ok(Hashes::Run { start: b >> 1, len })
            } else {
                let n = usize::from(b >> 1) % 8;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(u.arbitrary::<u8>()?);
                }
                Ok(Hashes::List(v))
            }
        }
        let kind = u.arbitrary::<u8>()? % 24;
        Ok(match kind {
            0..=3 => Op::Heartbeat { node: u.arbitrary()?, session: sess(u)? },
            4 => Op::Takeover { node: u.arbitrary()?, session: u.arbitrary()? },
            5..=10 => Op::Insert { ns: u.arbitrary()?, hashes: hashes(u)?, node: u.arbitrary()?, session: sess(u)? },
            11..=12 => Op::Remove { ns: u.arbitrary()?, hashes: hashes(u)?, node: u.arbitrary()?, session: sess(u)? },
            13 => Op::Unregister { node: u.arbitrary()?, session: sess(u)? },
            14 => Op::Sweep,
            15..=16 => Op::Advance { ms: u.arbitrary()? },
            17 => Op::Jump { ms: u.arbitrary()? },
            18..=21 => Op::Query { ns: u.arbitrary()?, hashes: hashes(u)? },
            _ => Op::Owners { ns: u.arbitrary()?, hash: u.arbitrary()? },
        })
    }

    pub(super) const NODES: usize = 4;
    pub(super) const SESSIONS: usize = 3;
    pub(super) const NAMESPACES: usize = 2;
    pub(super) const HASHES: usize = 16;
    const HASHES_PER_OP_MAX: usize = 12;

    /// The small universe the ops name.
    struct Universe {
        nodes: Vec<NodeAddr>,
        sessions: Vec<Vec<SessionId>>,
        namespaces: Vec<String>,
        hashes: Vec<BlockHash>,
    }

    impl Universe {
        fn new() -> Self {
            Self {
                nodes: (0..NODES).map(|i| NodeAddr(format!("10.0.0.{i}:7000"))).collect(),
                sessions: (0..NODES).map(|i| (0..SESSIONS).map(|j| SessionId(format!("s{i}-{j}"))).collect()).collect(),
                namespaces: (0..NAMESPACES).map(|i| format!("ns{i}")).collect(),
                // Two odd lengths exercise the boxed key path.
                hashes: (0..HASHES as u64)
                    .map(|i| match i {
                        14 => BlockHash::new(vec![0xab; 5]),
                        15 => BlockHash::new(vec![0xcd; 64]),
                        _ => BlockHash::from_u64(i),
                    })
                    .collect(),
            }
        }

        fn node(&self, n: u8) -> &NodeAddr {
            &self.nodes[usize::from(n) % NODES]
        }

        /// Resolves a session choice; `Current` reads the *model's* record,
        /// so both sides get the same input.
        fn session(&self, model: &Model, n: u8, s: &Sess) -> SessionId {
            let fixed = |i: u8| self.sessions[usize::from(n) % NODES][usize::from(i) % SESSIONS].clone();
            match s {
                Sess::Current => model.node_session(self.node(n)).map_or_else(|| fixed(0), |(s, _)| s),
                Sess::Index(i) => fixed(*i),
            }
        }

        fn ns(&self, ns: u8) -> &str {
            &self.namespaces[usize::from(ns) % NAMESPACES]
        }

        fn hash(&self, i: u8) -> BlockHash {
            self.hashes[usize::from(i) % HASHES].clone()
        }

        fn hashes(&self, sel: &Hashes) -> Vec<BlockHash> {
            match sel {
                Hashes::Run { start, len } => {
                    let start = usize::from(*start) % 8;
                    let len = usize::from(*len) % (HASHES_PER_OP_MAX + 1);
                    (start..(start + len).min(HASHES)).map(|i| self.hashes[i].clone()).collect()
                }
                Hashes::List(idx) => idx.iter().take(HASHES_PER_OP_MAX).map(|&i| self.hash(i)).collect(),
            }
        }
    }

    /// Replays `ops` against a [`MetaStore`] of `shards` shards and the
    /// [`Model`]; panics on the first difference in a result or in the
    /// observable state.
    pub(super) fn run_ops(cfg: StoreConfig, shards: usize, ops: &[Op]) {
        let u = Universe::new();
        let store = MetaStore::with_shards(cfg, 0, shards);
        let mut model = Model::new(cfg);
        let mut now: u64 = 1_000;
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Takeover { .. } => now += cfg.stale_after_ms + 1,
                Op::Advance { ms } => now += u64::from(*ms / 4),
                Op::Jump { ms } => now += u64::from(*ms % 1024),
                _ => {}
            }
            let ctx = || format!("step {step}: {op:?} at {now}");
            match op {
                Op::Heartbeat { node, session } => {
                    let (n, s) = (u.node(*node), u.session(&model, *node, session));
                    let got = store.heartbeat(n, &s, now);
                    assert_eq!(got, model.heartbeat(n, &s, now), "{}", ctx());
                }
                Op::Takeover { node, session } => {
                    let n = u.node(*node);
                    let s = u.session(&model, *node, &Sess::Index(*session));
                    let got = store.heartbeat(n, &s, now);
                    assert_eq!(got, model.heartbeat(n, &s, now), "{}", ctx());
                }
                Op::Insert { ns, hashes, node, session } => {
                    let (n, s) = (u.node(*node), u.session(&model, *node, session));
                    let (ns, hs) = (u.ns(*ns), u.hashes(hashes));
                    let got = store.insert(ns, &hs, n, &s, now);
                    assert_eq!(got, model.insert(ns, &hs, n, &s, now), "{}", ctx());
                }
                Op::Remove { ns, hashes, node, session } => {
                    let (n, s) = (u.node(*node), u.session(&model, *node, session));
                    let (ns, hs) = (u.ns(*ns), u.hashes(hashes));
                    let got = store.remove(ns, &hs, n, &s, now);
                    assert_eq!(got, model.remove(ns, &hs, n, &s, now), "{}", ctx());
                }
                Op::Unregister { node, session } => {
                    let (n, s) = (u.node(*node), u.session(&model, *node, session));
                    let got = store.unregister(n, &s);
                    assert_eq!(got, model.unregister(n, &s), "{}", ctx());
                }
                Op::Sweep => assert_eq!(store.sweep(now), model.sweep(now), "{}", ctx()),
                Op::Advance { .. } | Op::Jump { .. } => {}
                Op::Query { ns, hashes } => {
                    let (ns, hs) = (u.ns(*ns), u.hashes(hashes));
                    let got = store.query_prefix(ns, &hs, now);
                    assert_eq!(got, model.query_prefix(ns, &hs, now), "{}", ctx());
                }
                Op::Owners { ns, hash } => {
                    let (ns, h) = (u.ns(*ns), u.hash(*hash));
                    let got = store.owners(ns, &h, now);
                    assert_eq!(got, model.owners(ns, &h, now), "{}", ctx());
                }
            }
            store.assert_consistent();
            assert_eq!(store.stats(), model.stats(), "{}", ctx());
            let got = store.visible_entries(now);
            assert_eq!(got, model.visible_entries(now), "{}", ctx());
            for n in &u.nodes {
                assert_eq!(store.node_session(n), model.node_session(n), "{}", ctx());
            }
        }
    }
}

/// Fuzz body: decodes a timing config, a shard count (1 to 4) and up to
/// 256 ops from `data` and replays them against [`MetaStore`] and an
/// independent reference model
/// (4 nodes × 3 sessions, 2 namespaces, 16 hashes), checking every result
/// and the whole observable state after each op.
///
/// # Panics
/// On any difference between the store and the model, or when the store's
/// forward and reverse indices disagree.
#[cfg(any(test, fuzzing))]
pub fn fuzz_store(data: &[u8]) {
    let mut u = arbitrary::Unstructured::new(data);
    let cfg = StoreConfig {
        stale_after_ms: u.int_in_range(20..=200).unwrap_or(100),
        ttl_ms: u.int_in_range(0..=600).unwrap_or(300),
    };
    let shards = u.int_in_range(1..=4).unwrap_or(1);
    let mut ops = Vec::new();
    while ops.len() < 256 && !u.is_empty() {
        match model::decode_op(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    model::run_ops(cfg, shards, &ops);
}

#[cfg(test)]
mod tests {
    use super::model::{self, Hashes, Op, Sess};
    use super::*;
    use proptest::prelude::*;

    /// Issue 30: a capacity whose index cannot be allocated is refused by
    /// the start-up check instead of aborting the first insert. (A real
    /// refusal under `ulimit -v` cannot be staged here; a capacity beyond
    /// the address space is refused on any machine.)
    #[test]
    fn capacity_check_refuses_what_cannot_be_allocated() {
        assert_eq!(capacity_bytes(0, 64), 0);
        assert_eq!(check_capacity(0, 64), Ok(()));
        let small = capacity_bytes(10_000, 64);
        assert!(small >= 10_000 * mem::size_of::<Slot>() as u64, "{small}");
        assert!(capacity_bytes(1 << 20, 64) > 64 * small / 2, "grows with the capacity");
        assert_eq!(check_capacity(10_000, 64), Ok(()));
        let (bytes, reason) = check_capacity(u64::MAX, 64).unwrap_err();
        assert!(bytes > isize::MAX as u64 / 2, "{bytes}");
        assert!(!reason.is_empty());
    }

    const CFG: StoreConfig = StoreConfig { stale_after_ms: 100, ttl_ms: 1_000 };

    fn n(s: &str) -> NodeAddr {
        NodeAddr(format!("{s}:1"))
    }

    fn s(x: &str) -> SessionId {
        SessionId(x.to_string())
    }

    fn h(i: u64) -> BlockHash {
        BlockHash::from_u64(i)
    }

    fn hs(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().map(|&i| h(i)).collect()
    }

    #[test]
    fn heartbeat_registers_refreshes_takes_over_and_rejects_live_conflict() {
        let st = MetaStore::new(CFG);
        let a = n("a");
        assert_eq!(st.heartbeat(&a, &s("s1"), 0), Ok(HeartbeatOutcome::Registered));
        assert_eq!(st.heartbeat(&a, &s("s1"), 50), Ok(HeartbeatOutcome::Refreshed));
        assert_eq!(st.node_session(&a), Some((s("s1"), 50)));
        // s1 is fresh until 150: a second session is refused.
        assert_eq!(
            st.heartbeat(&a, &s("s2"), 150),
            Err(StoreError::LiveSessionConflict { node: a.clone(), live_session: s("s1") })
        );
        assert_eq!(st.node_session(&a), Some((s("s1"), 50)));
        // Stale at 151: s2 takes over.
        assert_eq!(st.heartbeat(&a, &s("s2"), 151), Ok(HeartbeatOutcome::TookOver));
        assert_eq!(st.node_session(&a), Some((s("s2"), 151)));
        // The old session can no longer come back while s2 is fresh.
        assert!(matches!(st.heartbeat(&a, &s("s1"), 160), Err(StoreError::LiveSessionConflict { .. })));
    }

    #[test]
    fn writes_are_fenced_unknown_old_session_and_stale() {
        let st = MetaStore::new(CFG);
        let a = n("a");
        assert_eq!(st.insert("ns", &hs(&[1]), &a, &s("s1"), 0), Err(StoreError::UnknownNode { node: a.clone() }));
        st.heartbeat(&a, &s("s1"), 0).unwrap();
        st.heartbeat(&a, &s("s2"), 200).unwrap(); // takeover
        let old = StoreError::StaleSession { node: a.clone(), expected: Some(s("s2")), got: s("s1") };
        assert_eq!(st.insert("ns", &hs(&[1]), &a, &s("s1"), 200), Err(old.clone()));
        assert_eq!(st.remove("ns", &hs(&[1]), &a, &s("s1"), 200), Err(old));
        // Same session, but stale: fenced with no live session to expect.
        let stale = StoreError::StaleSession { node: a.clone(), expected: None, got: s("s2") };
        assert_eq!(st.insert("ns", &hs(&[1]), &a, &s("s2"), 301), Err(stale.clone()));
        assert_eq!(st.remove("ns", &hs(&[1]), &a, &s("s2"), 301), Err(stale));
        assert!(st.insert("ns", &hs(&[1]), &a, &s("s2"), 300).is_ok());
        // Messages name the node and sessions.
        let msg = st.insert("ns", &hs(&[1]), &a, &s("s1"), 300).unwrap_err().to_string();
        assert!(msg.contains("a:1") && msg.contains("s1") && msg.contains("s2"), "{msg}");
    }

    #[test]
    fn failed_write_changes_nothing() {
        let st = MetaStore::new(CFG);
        let (a, b) = (n("a"), n("b"));
        st.heartbeat(&a, &s("s1"), 0).unwrap();
        st.heartbeat(&b, &s("t1"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2]), &a, &s("s1"), 0).unwrap();
        st.insert("ns", &hs(&[1]), &b, &s("t1"), 0).unwrap();
        let before = (st.visible_entries(10), st.stats(), st.node_session(&a));
        assert!(st.insert("ns", &hs(&[3, 4]), &a, &s("bad"), 10).is_err());
        assert!(st.insert("other", &hs(&[3]), &a, &s("bad"), 10).is_err());
        assert!(st.insert("ns", &hs(&[3]), &n("c"), &s("x"), 10).is_err());
        assert!(st.remove("ns", &hs(&[1, 2]), &a, &s("bad"), 10).is_err());
        assert!(st.remove("ns", &hs(&[1]), &b, &s("t1"), 500).is_err()); // stale
        assert_eq!(before, (st.visible_entries(10), st.stats(), st.node_session(&a)));
        st.assert_consistent();
    }

    #[test]
    fn insert_is_idempotent_and_remove_touches_only_own_ownership() {
        let st = MetaStore::new(CFG);
        let (a, b) = (n("a"), n("b"));
        st.heartbeat(&a, &s("s1"), 0).unwrap();
        st.heartbeat(&b, &s("t1"), 0).unwrap();
        let out = st.insert("ns", &hs(&[1, 2, 1, 2]), &a, &s("s1"), 0).unwrap();
        assert_eq!(out.inserted, 2);
        assert_eq!(st.insert("ns", &hs(&[2, 3]), &a, &s("s1"), 0).unwrap().inserted, 1);
        st.insert("ns", &hs(&[1]), &b, &s("t1"), 0).unwrap();
        assert_eq!(st.remove("ns", &hs(&[1, 1, 9]), &a, &s("s1"), 0), Ok(1));
        assert_eq!(st.owners("ns", &h(1), 0), vec![b.clone()]);
        assert_eq!(st.remove("nope", &hs(&[1]), &a, &s("s1"), 0), Ok(0));
        assert_eq!(st.stats(), StoreStats { nodes: 2, namespaces: 1, hashes: 3, owner_entries: 3 });
        st.assert_consistent();
    }

    #[test]
    fn late_unregister_of_old_session_is_noop() {
        let st = MetaStore::new(CFG);
        let a = n("a");
        st.heartbeat(&a, &s("s1"), 0).unwrap();
        st.insert("ns", &hs(&[1]), &a, &s("s1"), 0).unwrap();
        st.heartbeat(&a, &s("s2"), 500).unwrap();
        st.insert("ns", &hs(&[2, 3]), &a, &s("s2"), 500).unwrap();
        assert_eq!(st.unregister(&a, &s("s1")), 0);
        assert_eq!(st.unregister(&n("zz"), &s("s1")), 0);
        assert_eq!(st.node_session(&a), Some((s("s2"), 500)));
        assert_eq!(st.owners("ns", &h(2), 500), vec![a.clone()]);
        assert_eq!(st.unregister(&a, &s("s2")), 2);
        assert_eq!(st.node_session(&a), None);
        assert_eq!(st.stats(), StoreStats::default());
    }

    #[test]
    fn superseded_owners_invisible_at_once_after_takeover() {
        let st = MetaStore::new(CFG);
        let a = n("a");
        st.heartbeat(&a, &s("s1"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2]), &a, &s("s1"), 0).unwrap();
        assert_eq!(st.heartbeat(&a, &s("s2"), 101), Ok(HeartbeatOutcome::TookOver));
        // The new session is fresh, but none of the old session's blocks show.
        assert!(st.owners("ns", &h(1), 101).is_empty());
        assert!(st.query_prefix("ns", &hs(&[1, 2]), 101).is_empty());
        assert!(st.visible_entries(101).is_empty());
        assert_eq!(st.stats().owner_entries, 0);
        assert_eq!(st.insert("ns", &hs(&[1]), &a, &s("s2"), 101).unwrap().inserted, 1);
    }

    #[test]
    fn prefix_stops_at_first_hash_without_visible_owner() {
        let st = MetaStore::new(CFG);
        let (a, b) = (n("a"), n("b"));
        st.heartbeat(&a, &s("s"), 0).unwrap();
        st.heartbeat(&b, &s("t"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2, 4, 5]), &a, &s("s"), 0).unwrap();
        st.insert("ns", &hs(&[1, 3]), &b, &s("t"), 0).unwrap();
        // h3 has a visible owner (b), so the walk goes on; a misses h3.
        assert_eq!(st.query_prefix("ns", &hs(&[1, 2, 3, 4, 5]), 0), vec![(a.clone(), 2), (b.clone(), 1)]);
        // h9 has no owner: nothing after it counts even though a owns h4, h5.
        assert_eq!(st.query_prefix("ns", &hs(&[1, 2, 9, 4, 5]), 0), vec![(a.clone(), 2), (b.clone(), 1)]);
        // An owner that misses the first hash (b misses h2) has no prefix.
        assert_eq!(st.query_prefix("ns", &hs(&[2, 1]), 0), vec![(a.clone(), 2)]);
        // A hash whose only owner is stale stops the walk too.
        st.heartbeat(&a, &s("s"), 150).unwrap();
        assert_eq!(st.query_prefix("ns", &hs(&[1, 4, 5]), 150), vec![(a.clone(), 3)]);
        assert_eq!(st.query_prefix("ns", &hs(&[]), 150), vec![]);
        assert_eq!(st.query_prefix("missing", &hs(&[1]), 150), vec![]);
    }

    #[test]
    fn long_prefixes_walk_across_prefetch_windows_and_namespaces() {
        // Longer than several prefetch windows, in stores of 1 and 64
        // shards, with a second namespace whose ids differ from the first's
        // in some shards (so a shard's namespace-id guess is sometimes wrong).
        for shards in [1, 64] {
            let st = MetaStore::with_shards(CFG, 0, shards);
            let (a, b) = (n("a"), n("b"));
            st.heartbeat(&a, &s("s"), 0).unwrap();
            st.heartbeat(&b, &s("t"), 0).unwrap();
            let len = QUERY_PREFETCH_WINDOW * 3 + 5;
            let ids: Vec<u64> = (1000..1000 + len as u64).collect();
            st.insert("other", &hs(&ids[..7]), &b, &s("t"), 0).unwrap();
            st.insert("ns", &hs(&ids), &a, &s("s"), 0).unwrap();
            let cut = QUERY_PREFETCH_WINDOW + 3;
            st.insert("ns", &hs(&ids[..cut]), &b, &s("t"), 0).unwrap();
            let want_full = vec![(a.clone(), len as u32), (b.clone(), cut as u32)];
            assert_eq!(st.query_prefix("ns", &hs(&ids), 0), want_full, "{shards} shards");
            assert_eq!(st.query_prefix("other", &hs(&ids), 0), vec![(b.clone(), 7)], "{shards} shards");
            // A hash nobody owns, in the third window, stops the walk there.
            let mut holed = ids.clone();
            let stop = QUERY_PREFETCH_WINDOW * 2 + 1;
            holed[stop] = 7;
            assert_eq!(
                st.query_prefix("ns", &hs(&holed), 0),
                vec![(a.clone(), stop as u32), (b.clone(), cut as u32)],
                "{shards} shards"
            );
            // Removing b's first window moves nothing for a, ends b's prefix.
            st.remove("ns", &hs(&ids[..1]), &b, &s("t"), 0).unwrap();
            assert_eq!(st.query_prefix("ns", &hs(&ids), 0), vec![(a.clone(), len as u32)], "{shards} shards");
            st.assert_consistent();
        }
    }

    #[test]
    fn prefix_example_a_b() {
        let st = MetaStore::new(CFG);
        let (a, b) = (n("A"), n("B"));
        st.heartbeat(&a, &s("s"), 0).unwrap();
        st.heartbeat(&b, &s("t"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2, 3, 4]), &a, &s("s"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2, 3, 5]), &b, &s("t"), 0).unwrap();
        assert_eq!(st.query_prefix("ns", &hs(&[1, 2, 3, 4]), 0), vec![(a.clone(), 4), (b.clone(), 3)]);
        // Missing h2 but owning h3 still gives prefix 1.
        let c = n("C");
        st.heartbeat(&c, &s("u"), 0).unwrap();
        st.insert("ns", &hs(&[1, 3]), &c, &s("u"), 0).unwrap();
        assert_eq!(st.query_prefix("ns", &hs(&[1, 2, 3, 4]), 0), vec![(a, 4), (b, 3), (c, 1)]);
    }

    #[test]
    fn prefix_order_is_deterministic_with_ties_broken_by_node() {
        let st = MetaStore::new(CFG);
        let nodes = [n("d"), n("b"), n("c"), n("a")];
        for (i, node) in nodes.iter().enumerate() {
            st.heartbeat(node, &s("s"), 0).unwrap();
            let len = if i % 2 == 0 { 2 } else { 3 };
            let ids: Vec<u64> = (1..=len).collect();
            st.insert("ns", &hs(&ids), node, &s("s"), 0).unwrap();
        }
        let want = vec![(n("a"), 3), (n("b"), 3), (n("c"), 2), (n("d"), 2)];
        assert_eq!(st.query_prefix("ns", &hs(&[1, 2, 3]), 0), want);
        assert_eq!(st.owners("ns", &h(1), 0), vec![n("a"), n("b"), n("c"), n("d")]);
    }

    #[test]
    fn reclaimable_only_for_third_or_later_live_owner() {
        let st = MetaStore::new(CFG);
        let (a, b, c, d) = (n("a"), n("b"), n("c"), n("d"));
        for x in [&a, &b, &c, &d] {
            st.heartbeat(x, &s("s"), 0).unwrap();
        }
        assert!(st.insert("ns", &hs(&[1, 2]), &a, &s("s"), 0).unwrap().reclaimable.is_empty());
        assert!(st.insert("ns", &hs(&[1]), &b, &s("s"), 0).unwrap().reclaimable.is_empty());
        // c is the third owner of h1 (not of h2); duplicates reported once.
        let out = st.insert("ns", &hs(&[2, 1, 1, 3]), &c, &s("s"), 0).unwrap();
        assert_eq!(out.reclaimable, hs(&[1]));
        assert_eq!(out.inserted, 3);
        // Re-inserting as an existing owner still reports it.
        let out = st.insert("ns", &hs(&[1]), &a, &s("s"), 0).unwrap();
        assert_eq!((out.inserted, out.reclaimable), (0, hs(&[1])));
        // Stale owners do not count: at 150 only d (refreshed) and b are live.
        st.heartbeat(&b, &s("s"), 150).unwrap();
        st.heartbeat(&d, &s("s"), 150).unwrap();
        assert!(st.insert("ns", &hs(&[1]), &d, &s("s"), 150).unwrap().reclaimable.is_empty());
    }

    #[test]
    fn stale_node_invisible_then_visible_after_refresh() {
        let st = MetaStore::new(CFG);
        let a = n("a");
        st.heartbeat(&a, &s("s"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2]), &a, &s("s"), 0).unwrap();
        assert_eq!(st.owners("ns", &h(1), 100), vec![a.clone()]);
        assert!(st.owners("ns", &h(1), 101).is_empty());
        assert!(st.query_prefix("ns", &hs(&[1, 2]), 101).is_empty());
        assert!(st.visible_entries(101).is_empty());
        assert_eq!(st.stats().owner_entries, 2);
        assert_eq!(st.heartbeat(&a, &s("s"), 500), Ok(HeartbeatOutcome::Refreshed));
        assert_eq!(st.query_prefix("ns", &hs(&[1, 2]), 500), vec![(a.clone(), 2)]);
        assert_eq!(st.visible_entries(500).len(), 2);
    }

    /// Each shard's part of a namespace of a store built `with_capacity(n)`
    /// is sized for its share of n (plus a margin) when created and does not
    /// grow (no rehash) while the namespace holds n spread hashes; a
    /// recycled namespace is sized again; capacity 0 grows on demand.
    #[test]
    fn capacity_presizes_each_namespace_so_it_never_grows_below_it() {
        let (cap, shards) = (10_000usize, 16);
        let st = MetaStore::with_shards(CFG, cap, shards);
        let a = n("a");
        st.heartbeat(&a, &s("s1"), 0).unwrap();
        let all: Vec<u64> = (0..cap as u64).collect();
        let mut chunks = all.chunks(997);
        st.insert("ns", &hs(chunks.next().unwrap()), &a, &s("s1"), 0).unwrap();
        let first = st.ns_sizes_for_test("ns");
        let share = shard_capacity(cap, shards);
        assert!(share >= cap / shards && share < cap / 4, "{share}");
        for sz in &first {
            let (_, map_cap, slots_cap) = sz.expect("997 spread hashes touch every shard");
            assert!(map_cap >= share && slots_cap >= share, "{map_cap} {slots_cap}");
        }
        for part in chunks {
            st.insert("ns", &hs(part), &a, &s("s1"), 0).unwrap();
        }
        let full = st.ns_sizes_for_test("ns");
        assert_eq!(full.iter().map(|sz| sz.unwrap().0).sum::<usize>(), cap);
        for (f, g) in first.iter().zip(&full) {
            let ((_, m0, s0), (_, m1, s1)) = (f.unwrap(), g.unwrap());
            assert_eq!((m0, s0), (m1, s1), "a shard grew below its capacity");
        }
        // Emptied and recycled: the next namespace is sized again.
        st.remove("ns", &hs(&all), &a, &s("s1"), 0).unwrap();
        assert!(st.ns_sizes_for_test("ns").iter().all(Option::is_none));
        st.insert("other", &hs(&[1]), &a, &s("s1"), 0).unwrap();
        let other = st.ns_sizes_for_test("other").into_iter().flatten().next().unwrap();
        assert!(other.1 >= share && other.2 >= share);
        // Without a capacity a namespace starts small.
        let small = MetaStore::with_shards(CFG, 0, shards);
        small.heartbeat(&a, &s("s1"), 0).unwrap();
        small.insert("ns", &hs(&[0]), &a, &s("s1"), 0).unwrap();
        assert!(small.ns_sizes_for_test("ns").into_iter().flatten().all(|(_, m, _)| m < share));
        assert_eq!(small.capacity_hashes(), 0);
    }

    /// Concurrent writers (one node each, 8 shards) and readers: during the
    /// run every query about a chain nobody else's writes can touch gives
    /// its full answer in C7's order; afterwards the store is consistent and
    /// equal to the same writes made one after another on an unsharded
    /// store (writes of different nodes commute).
    #[test]
    fn concurrent_writers_and_readers_keep_stable_answers_and_end_as_sequential() {
        let st = MetaStore::with_shards(CFG, 0, 8);
        let stable = n("stable");
        let chain = hs(&(0..64).collect::<Vec<_>>());
        let writers: Vec<NodeAddr> = (0..3).map(|i| n(&format!("w{i}"))).collect();
        // Each writer's ops, in its order: (insert?, hashes).
        let ops = |i: usize| -> Vec<(bool, Vec<BlockHash>)> {
            let mut v = Vec::new();
            for round in 0..150u64 {
                let mine: Vec<u64> = (0..32).map(|k| 1000 * (i as u64 + 1) + (round * 7 + k) % 100).collect();
                v.push((true, hs(&mine)));
                v.push((true, chain[..16 + (round % 48) as usize].to_vec()));
                v.push((false, chain[..(round % 64) as usize].to_vec()));
                v.push((false, hs(&mine[..16])));
            }
            v
        };
        let setup = |st: &MetaStore| {
            st.heartbeat(&stable, &s("s"), 0).unwrap();
            st.insert("ns", &chain, &stable, &s("s"), 0).unwrap();
            for w in &writers {
                st.heartbeat(w, &s("s"), 0).unwrap();
            }
        };
        let apply = |st: &MetaStore, w: &NodeAddr, (insert, hashes): &(bool, Vec<BlockHash>)| {
            if *insert {
                st.insert("ns", hashes, w, &s("s"), 0).unwrap();
            } else {
                st.remove("ns", hashes, w, &s("s"), 0).unwrap();
            }
        };
        setup(&st);
        std::thread::scope(|sc| {
            for (i, w) in writers.iter().enumerate() {
                let (st, ops) = (st.clone(), ops(i));
                sc.spawn(move || ops.iter().for_each(|op| apply(&st, w, op)));
            }
            for _ in 0..2 {
                sc.spawn(|| {
                    for _ in 0..300 {
                        let got = st.query_prefix("ns", &chain, 0);
                        assert_eq!(got.first(), Some(&(stable.clone(), 64)), "{got:?}");
                        assert!(got.windows(2).all(|p| p[0].1 > p[1].1 || (p[0].1 == p[1].1 && p[0].0 < p[1].0)));
                    }
                });
            }
        });
        st.assert_consistent();
        let seq = MetaStore::with_shards(CFG, 0, 1);
        setup(&seq);
        for (i, w) in writers.iter().enumerate() {
            ops(i).iter().for_each(|op| apply(&seq, w, op));
        }
        assert_eq!(st.visible_entries(0), seq.visible_entries(0));
        assert_eq!(st.stats(), seq.stats());
        assert_eq!(st.query_prefix("ns", &chain, 0), seq.query_prefix("ns", &chain, 0));
    }

    /// Node events are atomic to queries: while 100 nodes, each owning a
    /// 64-hash chain spread over every shard, are unregistered one by one,
    /// every answer lists each node with its whole chain or not at all.
    #[test]
    fn a_query_never_sees_part_of_an_unregister() {
        let st = MetaStore::with_shards(CFG, 0, 8);
        let chain = hs(&(0..64).collect::<Vec<_>>());
        let nodes: Vec<NodeAddr> = (0..100).map(|i| n(&format!("u{i:03}"))).collect();
        for x in &nodes {
            st.heartbeat(x, &s("s"), 0).unwrap();
            st.insert("ns", &chain, x, &s("s"), 0).unwrap();
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    let got = st.query_prefix("ns", &chain, 0);
                    assert!(got.iter().all(|(_, len)| *len == 64), "part of an unregister seen: {got:?}");
                }
            });
            for x in &nodes {
                assert_eq!(st.unregister(x, &s("s")), 64);
            }
            done.store(true, Ordering::Relaxed);
        });
        assert_eq!(st.stats(), StoreStats::default());
    }

    /// The shard of a hash depends on its bytes only, spreads hashes evenly,
    /// and puts consecutive hashes of a chain in different shards.
    #[test]
    fn shard_index_is_fixed_and_even() {
        let keys: Vec<BlockHash> = (0..64_000).map(h).collect();
        let mut counts = [0usize; 64];
        for k in &keys {
            counts[shard_index(k.as_bytes(), 64)] += 1;
        }
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*lo > 850 && *hi < 1150, "{lo}..{hi}");
        let copy: [u8; 32] = h(7).as_bytes().try_into().unwrap();
        assert_eq!(shard_index(h(7).as_bytes(), 64), shard_index(&copy, 64));
        assert_eq!(shard_index(h(7).as_bytes(), 1), 0);
        let same = keys.windows(2).filter(|w| shard_index(w[0].as_bytes(), 8) == shard_index(w[1].as_bytes(), 8));
        assert!(same.count() < keys.len() / 4);
        assert!(shard_index(&[0xab; 5], 3) < 3 && shard_index(&[0xcd; 64], 3) < 3);
    }

    /// A store that met a panicking holder: calls refuse (panic with
    /// [`POISONED`]) until `recover`, which keeps a consistent store and
    /// resets a corrupted one.
    #[test]
    fn poison_refuses_until_recover_keeps_or_resets() {
        let st = MetaStore::with_shards(CFG, 0, 4);
        let a = n("a");
        st.heartbeat(&a, &s("s"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2, 3]), &a, &s("s"), 0).unwrap();
        st.poison_for_test(false);
        let err = std::panic::catch_unwind(|| st.owners("ns", &h(1), 0)).unwrap_err();
        assert_eq!(err.downcast_ref::<String>().map(String::as_str), Some(POISONED));
        assert_eq!(st.recover(), Recovery { poisoned: true, reset: None });
        assert_eq!(st.owners("ns", &h(1), 0), vec![a.clone()]);
        st.poison_for_test(true);
        let r = st.recover();
        assert!(r.poisoned && r.reset.is_some(), "{r:?}");
        assert_eq!(st.stats(), StoreStats::default());
        assert_eq!(st.recover(), Recovery { poisoned: false, reset: None });
        assert_eq!(st.heartbeat(&a, &s("s"), 0), Ok(HeartbeatOutcome::Registered));
    }

    #[test]
    fn sweep_removes_after_ttl() {
        let st = MetaStore::new(CFG);
        let (a, b) = (n("a"), n("b"));
        st.heartbeat(&a, &s("s"), 0).unwrap();
        st.heartbeat(&b, &s("t"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2, 3]), &a, &s("s"), 0).unwrap();
        st.insert("ns", &hs(&[3, 4]), &b, &s("t"), 0).unwrap();
        st.heartbeat(&b, &s("t"), 900).unwrap();
        assert_eq!(st.sweep(1_000), SweepReport::default());
        assert_eq!(st.sweep(1_001), SweepReport { nodes_removed: 1, owners_removed: 3 });
        assert_eq!(st.node_session(&a), None);
        assert_eq!(st.insert("ns", &hs(&[1]), &a, &s("s"), 1_001), Err(StoreError::UnknownNode { node: a.clone() }));
        assert_eq!(st.stats(), StoreStats { nodes: 1, namespaces: 1, hashes: 2, owner_entries: 2 });
        // The address may register again, with any session.
        assert_eq!(st.heartbeat(&a, &s("s9"), 1_001), Ok(HeartbeatOutcome::Registered));
        st.assert_consistent();
    }

    #[test]
    fn unregister_cost_touches_only_owned_keys() {
        let st = MetaStore::new(CFG);
        let (a, big) = (n("a"), n("big"));
        st.heartbeat(&a, &s("s"), 0).unwrap();
        st.heartbeat(&big, &s("t"), 0).unwrap();
        let many: Vec<BlockHash> = (0..10_000).map(h).collect();
        st.insert("ns", &many, &big, &s("t"), 0).unwrap();
        st.insert("ns", &hs(&[1, 2, 20_000, 20_001, 20_002]), &a, &s("s"), 0).unwrap();
        let work = st.drop_work();
        assert_eq!(st.unregister(&a, &s("s")), 5);
        // Exactly the 5 owned entries were visited, not the 10 005 keys.
        assert_eq!(st.drop_work() - work, 5);
        assert_eq!(st.stats().hashes, 10_000);
        assert_eq!(st.owners("ns", &h(1), 0), vec![big.clone()]);
        st.assert_consistent();
    }

    #[test]
    fn empty_namespaces_and_nodes_are_recycled() {
        let st = MetaStore::new(CFG);
        for round in 0..3u64 {
            let a = n(&format!("a{round}"));
            st.heartbeat(&a, &s("s"), 0).unwrap();
            st.insert(&format!("ns{round}"), &hs(&[1, 2]), &a, &s("s"), 0).unwrap();
            assert_eq!(st.unregister(&a, &s("s")), 2);
            assert_eq!(st.stats(), StoreStats::default());
        }
        assert_eq!(st.table_sizes_for_test(), (1, 1));
    }

    #[test]
    fn odd_length_hashes_round_trip() {
        let st = MetaStore::new(CFG);
        let a = n("a");
        st.heartbeat(&a, &s("s"), 0).unwrap();
        let odd = vec![BlockHash::new(vec![7u8; 5]), BlockHash::new(vec![9u8; 64])];
        assert_eq!(st.insert("ns", &odd, &a, &s("s"), 0).unwrap().inserted, 2);
        assert_eq!(st.query_prefix("ns", &odd, 0), vec![(a.clone(), 2)]);
        let entries: Vec<BlockHash> = st.visible_entries(0).into_iter().map(|e| e.1).collect();
        assert_eq!(entries, odd);
    }

    fn op_strategy() -> impl Strategy<Value = Op> {
        let sess = || {
            prop_oneof![
                3 => Just(Sess::Current),
                1 => (0u8..3).prop_map(Sess::Index),
            ]
        };
        let hashes = || {
            prop_oneof![
                (0u8..8, 0u8..13).prop_map(|(start, len)| Hashes::Run { start, len }),
                prop::collection::vec(0u8..model::HASHES as u8, 0..8).prop_map(Hashes::List),
            ]
        };
        prop_oneof![
            3 => (0u8..4, sess()).prop_map(|(node, session)| Op::Heartbeat { node, session }),
            1 => (0u8..4, 0u8..3).prop_map(|(node, session)| Op::Takeover { node, session }),
            5 => (0u8..2, hashes(), 0u8..4, sess()).prop_map(|(ns, hashes, node, session)| {
                Op::Insert { ns, hashes, node, session }
            }),
            2 => (0u8..2, hashes(), 0u8..4, sess()).prop_map(|(ns, hashes, node, session)| {
                Op::Remove { ns, hashes, node, session }
            }),
            1 => (0u8..4, sess()).prop_map(|(node, session)| Op::Unregister { node, session }),
            1 => Just(Op::Sweep),
            2 => any::<u8>().prop_map(|ms| Op::Advance { ms }),
            1 => any::<u16>().prop_map(|ms| Op::Jump { ms }),
            3 => (0u8..2, hashes()).prop_map(|(ns, hashes)| Op::Query { ns, hashes }),
            1 => (0u8..2, 0u8..16).prop_map(|(ns, hash)| Op::Owners { ns, hash }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        /// Whatever the shard count (1: the unsharded index; 2, 3: the
        /// 16 hashes of the universe spread so that consecutive hashes of
        /// a chain sit in different shards; 64: the default), calls made
        /// one after another give the reference model's answers.
        fn matches_reference_model(
            stale in 20u64..200,
            ttl in 0u64..600,
            shards in prop_oneof![Just(1usize), Just(2), Just(3), Just(limits::METASERVER_SHARDS_DEFAULT)],
            ops in prop::collection::vec(op_strategy(), 1..120),
        ) {
            model::run_ops(StoreConfig { stale_after_ms: stale, ttl_ms: ttl }, shards, &ops);
        }
    }

    #[test]
    fn fuzz_store_seeded() {
        crate::testing::run_fuzz_seeded("metaserver_store", 3_000, 512, fuzz_store);
    }
}
