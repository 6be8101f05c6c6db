//! Property tests of the pure cores, each against a small model written here
//! (proptest; plain `cargo test --test properties`).
//!
//! What is checked — one property per item, named after what it asserts:
//! - [`netting_is_last_write_wins_per_key`]: every batch of the
//!   [`RegistrationQueue`] carries, per `(namespace, hash)`, exactly the op of
//!   the last accepted command for that key since the previous batch.
//! - [`chunking_loses_and_duplicates_nothing`]: the chunks of a batch (also
//!   after arbitrary splits) partition the netted keys — their union is the
//!   set of netted keys, no key appears twice, every chunk has
//!   `1..=chunk_hashes_max` hashes — and every accepted command gets exactly
//!   one fate (delivered count == accepted count).
//! - [`store_prefix_query_equals_model_contiguous_count`]: for every visible
//!   owner, [`MetaStore::query_prefix`] reports exactly the number of
//!   leading hashes (the contiguous count, as `Engine::query_prefix` counts
//!   for one cache) that the model says the owner holds; invisible (stale)
//!   owners and owners with count 0 are absent; the order is count
//!   descending then node ascending. With one owner this is exactly
//!   `take_while(owned).count()`.
//! - [`transfer_lock_release_is_exactly_once`]: under arbitrary interleavings
//!   of complete / error / cancel / duplicate release / expiry / authorize on
//!   a [`LockTable`], each session ends exactly once (released by its first
//!   release, or expired, never both, never twice), later releases return 0,
//!   reads after the end are refused with `UnknownSession`, and the pins on
//!   the blocks' memory ([`SealedExtent::holders`]) fall back exactly when the
//!   session ends.
//!
//! The requester's side of "exactly once" (every lock a fetch takes is
//! released once, on every path, cancellation included) is the fetch state
//! machine's own property test (`src/engine/fetch/machine.rs`), which drives
//! the real machine; here a requester of that shape (`Option::take` on an
//! explicit release, the rest on `Drop`) drives the real `LockTable`, and
//! the simulation tier's `inv_no_lock_leak_*` cover both end to end. Flush tickets and the
//! accounting identity are the registration-queue fuzz body's job
//! (`fuzz_registration_queue`); store fencing and sweep, `fuzz_store`'s.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use kvferry::client::queue::{Chunk, ChunkOutcome, Op, QueueConfig, RegistrationQueue};
use kvferry::engine::cache::CachedBlock;
use kvferry::engine::locks::{AccessError, LockTable, session_id};
use kvferry::engine::pool::{Pool, SealedExtent};
use kvferry::metaserver::store::{MetaStore, StoreConfig};
use kvferry::types::{BlockHash, NodeAddr, SessionId};
use proptest::prelude::*;

/// Cases per property: enough to hit the small universes below thoroughly,
/// few enough that the file runs in a couple of seconds in debug.
const CASES: u32 = 512;

fn hash_id(h: &BlockHash) -> u64 {
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("from_u64 hashes are 32 bytes"))
}

// ---------------------------------------------------------------------------
// Registration queue: netting and chunking.
// ---------------------------------------------------------------------------

/// Two namespaces, eight hashes: small enough that keys repeat a lot.
const NAMESPACES: [&str; 2] = ["a", "b"];

/// One offered command: (namespace index, hash id, remove?).
fn command() -> impl Strategy<Value = (usize, u64, bool)> {
    (0..NAMESPACES.len(), 0u64..8, any::<bool>())
}

/// Rounds of offers; each round ends with `take_batch` and delivery.
fn rounds() -> impl Strategy<Value = Vec<Vec<(usize, u64, bool)>>> {
    prop::collection::vec(prop::collection::vec(command(), 0..40), 1..5)
}

type Key = (String, u64);

/// Offers one round; returns the model's netted view of the accepted
/// commands (last op per key) and how many were accepted.
fn offer_round(q: &mut RegistrationQueue, ns: &[Arc<str>], round: &[(usize, u64, bool)]) -> (BTreeMap<Key, Op>, u64) {
    let mut last = BTreeMap::new();
    let mut accepted = 0;
    for &(n, h, remove) in round {
        let op = if remove { Op::Remove } else { Op::Insert };
        if q.offer(&ns[n], BlockHash::from_u64(h), op) {
            last.insert((ns[n].to_string(), h), op);
            accepted += 1;
        }
    }
    (last, accepted)
}

/// The keys a set of chunks carries, with their op, failing on a key that
/// appears twice.
fn chunk_keys(chunks: &[Chunk]) -> Result<BTreeMap<Key, Op>, TestCaseError> {
    let mut seen = BTreeMap::new();
    for c in chunks {
        for h in &c.hashes {
            let key = (c.namespace.to_string(), hash_id(h));
            prop_assert!(seen.insert(key.clone(), c.op).is_none(), "key {key:?} in two chunks (or twice in one)");
        }
    }
    Ok(seen)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Netting is last-write-wins per key, batch by batch.
    #[test]
    fn netting_is_last_write_wins_per_key(
        depth_max in 1usize..64,
        chunk_hashes_max in 1usize..6,
        rounds in rounds(),
    ) {
        let mut q = RegistrationQueue::new(QueueConfig { depth_max, chunk_hashes_max });
        let ns: Vec<Arc<str>> = NAMESPACES.iter().map(|&s| Arc::from(s)).collect();
        for round in &rounds {
            let (want, _) = offer_round(&mut q, &ns, round);
            let chunks = q.take_batch().unwrap_or_default();
            let got = chunk_keys(&chunks)?;
            prop_assert_eq!(&got, &want, "batch ops per key differ from the last write");
            for c in &chunks {
                q.complete_chunk(c.id, ChunkOutcome::Delivered);
            }
            prop_assert!(!q.batch_in_flight());
        }
    }

    /// Chunking loses and duplicates nothing, also after arbitrary splits.
    #[test]
    fn chunking_loses_and_duplicates_nothing(
        depth_max in 1usize..64,
        chunk_hashes_max in 1usize..6,
        rounds in rounds(),
        splits in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let mut q = RegistrationQueue::new(QueueConfig { depth_max, chunk_hashes_max });
        let ns: Vec<Arc<str>> = NAMESPACES.iter().map(|&s| Arc::from(s)).collect();
        let mut accepted_total = 0;
        for round in &rounds {
            let (netted, accepted) = offer_round(&mut q, &ns, round);
            accepted_total += accepted;
            let mut chunks = q.take_batch().unwrap_or_default();
            for c in &chunks {
                prop_assert!(!c.hashes.is_empty(), "empty chunk {}", c.id);
                prop_assert!(c.hashes.len() <= chunk_hashes_max, "chunk of {} > {chunk_hashes_max}", c.hashes.len());
            }
            let union: BTreeSet<Key> = chunk_keys(&chunks)?.into_keys().collect();
            let want: BTreeSet<Key> = netted.keys().cloned().collect();
            prop_assert_eq!(&union, &want, "union of chunks != netted keys");
            // Bisection (used to isolate a rejected hash) keeps the partition.
            for ix in &splits {
                if chunks.is_empty() {
                    break;
                }
                let i = ix.index(chunks.len());
                if let Some((l, r)) = q.split_chunk(chunks[i].id) {
                    prop_assert_eq!(l.hashes.len() + r.hashes.len(), chunks[i].hashes.len());
                    chunks.swap_remove(i);
                    chunks.push(l);
                    chunks.push(r);
                }
            }
            let union: BTreeSet<Key> = chunk_keys(&chunks)?.into_keys().collect();
            prop_assert_eq!(&union, &want, "union after splits != netted keys");
            for c in &chunks {
                q.complete_chunk(c.id, ChunkOutcome::Delivered);
            }
        }
        let c = q.counters();
        prop_assert_eq!(c.delivered, accepted_total, "every accepted command delivered exactly once: {:?}", c);
        prop_assert_eq!(c.pending, 0);
        prop_assert!(c.identity_holds(), "{:?}", c);
    }
}

// ---------------------------------------------------------------------------
// MetaServer store: prefix query.
// ---------------------------------------------------------------------------

const STALE_AFTER_MS: u64 = 100;
const STORE_HASHES: u64 = 12;

/// One write to the store: (node, insert?, hash ids).
fn store_write(nodes: usize) -> impl Strategy<Value = (usize, bool, Vec<u64>)> {
    (0..nodes, prop::bool::weighted(0.75), prop::collection::vec(0..STORE_HASHES, 0..8))
}

/// The contiguous count: how many leading `query` hashes `owned` holds (what
/// `Engine::query_prefix` computes for one cache).
fn contiguous_count(owned: &BTreeSet<u64>, query: &[u64]) -> u32 {
    query.iter().take_while(|h| owned.contains(h)).count() as u32
}

fn node(i: usize) -> NodeAddr {
    NodeAddr(format!("node-{i}:7000"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// `query_prefix` equals the model's contiguous count per visible owner.
    #[test]
    fn store_prefix_query_equals_model_contiguous_count(
        nodes in 1usize..4,
        writes in prop::collection::vec(store_write(3), 0..24),
        // Last heartbeat per node, ms; the query runs at 150 ms, so a node
        // whose heartbeat is older than 50 ms is stale and invisible.
        heartbeats in prop::collection::vec(0u64..150, 3),
        query in prop::collection::vec(0..STORE_HASHES + 2, 0..12),
    ) {
        const NOW_MS: u64 = 150;
        let st = MetaStore::new(StoreConfig { stale_after_ms: STALE_AFTER_MS, ttl_ms: 10_000 });
        let session = SessionId("s-1".to_string());
        let mut model: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); nodes];
        for i in 0..nodes {
            st.heartbeat(&node(i), &session, 0).expect("first heartbeat registers");
        }
        for (n, insert, ids) in &writes {
            let n = n % nodes;
            let hs: Vec<BlockHash> = ids.iter().map(|&h| BlockHash::from_u64(h)).collect();
            if *insert {
                st.insert("ns", &hs, &node(n), &session, 0).expect("fresh node inserts");
                model[n].extend(ids);
            } else {
                st.remove("ns", &hs, &node(n), &session, 0).expect("fresh node removes");
                for h in ids {
                    model[n].remove(h);
                }
            }
        }
        for (i, &hb_ms) in heartbeats.iter().enumerate().take(nodes) {
            st.heartbeat(&node(i), &session, hb_ms).expect("same session refreshes");
        }
        let qh: Vec<BlockHash> = query.iter().map(|&h| BlockHash::from_u64(h)).collect();
        let got = st.query_prefix("ns", &qh, NOW_MS);

        let mut want: Vec<(NodeAddr, u32)> = (0..nodes)
            .filter(|&i| NOW_MS - heartbeats[i] <= STALE_AFTER_MS)
            .map(|i| (node(i), contiguous_count(&model[i], &query)))
            .filter(|(_, k)| *k > 0)
            .collect();
        want.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        prop_assert_eq!(&got, &want, "query {:?}", query);

        // One owner: the answer is exactly the contiguous count.
        if nodes == 1 {
            let k = got.first().map_or(0, |(_, k)| *k);
            let visible = NOW_MS - heartbeats[0] <= STALE_AFTER_MS;
            prop_assert_eq!(k, if visible { contiguous_count(&model[0], &query) } else { 0 });
        }
        // No owner's prefix is longer than the contiguous count of the union.
        let union: BTreeSet<u64> = model.iter().flatten().copied().collect();
        for (_, k) in &got {
            prop_assert!(*k <= contiguous_count(&union, &query));
        }
    }
}

// ---------------------------------------------------------------------------
// Transfer locks: release exactly once.
// ---------------------------------------------------------------------------

const SESSIONS: usize = 4;
const BLOCKS: usize = 6;
const BLOCK_BYTES: u64 = 256;
const LOCK_TIMEOUT_MS: u64 = 1_000;

/// How one transfer ends, as `fetch` sees it.
#[derive(Debug, Clone, Copy)]
enum Ending {
    /// Reads succeeded: the guard is released explicitly, then dropped.
    Complete,
    /// A read failed: the guard is dropped on the error path.
    Error,
    /// The fetch future was dropped mid-flight: the guard's `Drop` runs.
    Cancel,
}

#[derive(Debug, Clone)]
enum LockEvent {
    /// Create session `s` over a subset (bit mask) of the blocks.
    Create { s: usize, mask: u8 },
    /// End session `s`'s transfer through its guard.
    End { s: usize, how: Ending },
    /// A late, duplicate release of session `s` (a retried RPC).
    ReleaseAgain { s: usize },
    /// Advance the clock by `ms` and run the expiry GC.
    Expire { ms: u64 },
    /// A data-plane read of block `b` under session `s`.
    Authorize { s: usize, b: usize },
}

fn lock_event() -> impl Strategy<Value = LockEvent> {
    let ending = prop_oneof![Just(Ending::Complete), Just(Ending::Error), Just(Ending::Cancel)];
    prop_oneof![
        3 => (0..SESSIONS, 1u8..(1 << BLOCKS)).prop_map(|(s, mask)| LockEvent::Create { s, mask }),
        3 => (0..SESSIONS, ending).prop_map(|(s, how)| LockEvent::End { s, how }),
        1 => (0..SESSIONS).prop_map(|s| LockEvent::ReleaseAgain { s }),
        1 => (0u64..700).prop_map(|ms| LockEvent::Expire { ms }),
        2 => (0..SESSIONS, 0..BLOCKS).prop_map(|(s, b)| LockEvent::Authorize { s, b }),
    ]
}

/// A requester's guard: the session is taken on an explicit release, and
/// released on `Drop` otherwise (the fetch driver's `abandon` path). It counts
/// the release calls it makes, per session.
struct Guard<'t> {
    table: &'t RefCell<LockTable>,
    calls: &'t RefCell<HashMap<String, u32>>,
    session: Option<String>,
}

impl Guard<'_> {
    fn release(mut self) -> usize {
        self.session.take().map_or(0, |s| self.release_now(s))
    }

    fn release_now(&self, s: String) -> usize {
        *self.calls.borrow_mut().entry(s.clone()).or_default() += 1;
        self.table.borrow_mut().release(&s).expect("ids of this table's incarnation")
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            self.release_now(s);
        }
    }
}

/// Model state of one session id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Live { expires_at_ms: u64, mask: u8 },
    Released,
    Expired,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Transfer-lock release is exactly-once under arbitrary interleavings of
    /// complete / error / cancel, duplicate releases, expiry and reads.
    #[test]
    fn transfer_lock_release_is_exactly_once(events in prop::collection::vec(lock_event(), 1..60)) {
        let pool = Pool::new(BLOCK_BYTES * BLOCKS as u64, 64).expect("small pool");
        let blocks: Vec<(BlockHash, CachedBlock)> = (0..BLOCKS)
            .map(|i| {
                let extent: SealedExtent = pool.alloc(BLOCK_BYTES).expect("pool fits every block").seal();
                (BlockHash::from_u64(i as u64), CachedBlock { extent, checksums: Arc::from(vec![0u32]) })
            })
            .collect();
        const INCARNATION: u64 = 0x7e57;
        let table = RefCell::new(LockTable::new(SESSIONS, INCARNATION));
        let calls = RefCell::new(HashMap::new());
        // Session ids are never reused (the engine's ids carry a sequence
        // number): generation `g` of slot `s` has the secret `(g, s)`.
        let mut generation = [0u32; SESSIONS];
        let mut lives: BTreeMap<String, Life> = BTreeMap::new();
        // Sessions whose transfer ended (guard released or dropped).
        let mut ended: BTreeSet<String> = BTreeSet::new();
        let mut now_ms = 0u64;
        let id = |s: usize, g: u32| session_id(INCARNATION, 0, (u128::from(g) << 32) | s as u128);

        for ev in &events {
            match *ev {
                LockEvent::Create { s, mask } => {
                    let live_here = matches!(lives.get(&id(s, generation[s])), Some(Life::Live { .. }));
                    if live_here {
                        continue; // one transfer per slot at a time
                    }
                    generation[s] += 1;
                    let sid = id(s, generation[s]);
                    let chosen: Vec<_> =
                        blocks.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, b)| b.clone()).collect();
                    table.borrow_mut().create(sid.clone(), chosen, now_ms, LOCK_TIMEOUT_MS)
                        .expect("at most SESSIONS live, ids unique");
                    lives.insert(sid, Life::Live { expires_at_ms: now_ms + LOCK_TIMEOUT_MS, mask });
                }
                LockEvent::End { s, how } => {
                    let sid = id(s, generation[s]);
                    let Some(&life) = lives.get(&sid) else { continue };
                    if !ended.insert(sid.clone()) {
                        continue; // this transfer's guard is gone already
                    }
                    let guard = Guard { table: &table, calls: &calls, session: Some(sid.clone()) };
                    let released = match how {
                        Ending::Complete => guard.release(),
                        Ending::Error | Ending::Cancel => {
                            let before = table.borrow().stats().released;
                            drop(guard);
                            usize::from(table.borrow().stats().released > before)
                        }
                    };
                    match life {
                        Life::Live { mask, .. } => {
                            if matches!(how, Ending::Complete) {
                                prop_assert_eq!(released, mask.count_ones() as usize, "first release frees the session's blocks");
                            } else {
                                prop_assert_eq!(released, 1, "drop path released the live session");
                            }
                            lives.insert(sid.clone(), Life::Released);
                        }
                        Life::Expired => prop_assert_eq!(released, 0, "release after expiry frees nothing"),
                        Life::Released => unreachable!(),
                    }
                    prop_assert_eq!(calls.borrow()[&sid], 1, "the guard calls release exactly once");
                }
                LockEvent::ReleaseAgain { s } => {
                    let sid = id(s, generation[s]);
                    if let Some(life) = lives.get(&sid) {
                        if !matches!(life, Life::Live { .. }) {
                            prop_assert_eq!(table.borrow_mut().release(&sid), Ok(0), "second release is a no-op");
                        }
                    }
                }
                LockEvent::Expire { ms } => {
                    now_ms += ms;
                    let n = table.borrow_mut().expire(now_ms);
                    let mut want = 0;
                    for life in lives.values_mut() {
                        if let Life::Live { expires_at_ms, .. } = *life {
                            if expires_at_ms <= now_ms {
                                *life = Life::Expired;
                                want += 1;
                            }
                        }
                    }
                    prop_assert_eq!(n, want, "expired sessions");
                }
                LockEvent::Authorize { s, b } => {
                    let sid = id(s, generation[s]);
                    let offset = blocks[b].1.extent.offset();
                    let got = table.borrow().authorize(&sid, 0, offset, BLOCK_BYTES, now_ms);
                    match lives.get(&sid) {
                        Some(Life::Live { mask, .. }) if mask & (1 << b) != 0 => {
                            let (extent, at) = got.expect("read inside a locked block");
                            prop_assert_eq!((extent.offset(), at), (offset, 0));
                        }
                        Some(Life::Live { .. }) => {
                            prop_assert!(matches!(got, Err(AccessError::OutOfRange { .. })), "{:?}", got);
                        }
                        _ => prop_assert_eq!(got.map(|_| ()), Err(AccessError::UnknownSession)),
                    }
                }
            }

            // Each session ended at most once and in exactly one way.
            let t = table.borrow();
            let stats = t.stats();
            let count = |f: fn(&Life) -> bool| lives.values().filter(|l| f(l)).count() as u64;
            let live = count(|l| matches!(l, Life::Live { .. }));
            prop_assert_eq!(stats.created, lives.len() as u64);
            prop_assert_eq!(stats.released, count(|l| *l == Life::Released));
            prop_assert_eq!(stats.expired, count(|l| *l == Life::Expired));
            prop_assert_eq!(t.active() as u64, live);
            prop_assert_eq!(stats.created, stats.released + stats.expired + live);
            // The memory pins follow: our clone + one per live session holding the block.
            for (i, (_, b)) in blocks.iter().enumerate() {
                let pins = lives.values().filter(|l| matches!(l, Life::Live { mask, .. } if mask & (1 << i) != 0)).count();
                prop_assert_eq!(b.extent.holders(), 1 + pins, "block {} pins", i);
            }
            prop_assert_eq!(t.pinned_blocks(), lives.values().map(|l| match l {
                Life::Live { mask, .. } => mask.count_ones() as usize,
                _ => 0,
            }).sum::<usize>());
        }
        // Every release call the guards made was for a distinct transfer.
        prop_assert!(calls.borrow().values().all(|&n| n == 1));
    }
}
