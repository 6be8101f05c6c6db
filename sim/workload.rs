//! A scaled-down P/D replay (design.md §6), drawn from the seed.
//!
//! Requests come from a few "conversations" that share system-prompt
//! prefixes (so prefix reuse, multi-owner fetches and eviction happen), with
//! block hashes from [`engine_block_hash`] and KV bytes from [`fill_kv`]
//! (tiny model preset, 4-token blocks: 1 KiB segments, 4 KiB blocks).
//!
//! Per request, on its prefill node: fetch-or-reuse the longest prefix
//! (verified like any fetch), "compute" the rest (write `fill_kv` bytes to
//! the device), `save`, `flush_saves_and_registrations`, then check flush
//! termination and visibility right after the flush returns. Then, on its
//! decode node: fetch, lease, load, read the device back and verify every
//! byte against recomputation, recompute the rest, and run a plain
//! `client.flush()`. Every bounded call runs under a watchdog of twice its
//! bound so a hang is reported, not waited on. Under the `fetch_cancel`
//! fault some fetches are dropped at a random point (the caller gives up)
//! and the request recomputes what it did not get.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvferry::engine::fetch::FetchReport;
use kvferry::engine::{TransferAsk, TransferTicket};
use kvferry::gpu::Gpu;
use kvferry::replay::trace::{self, ModelPreset, engine_block_hash, fill_kv, verify_kv};
use kvferry::types::{BlockHash, NodeAddr};
use rand::Rng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use crate::cluster::{DECODE, NodeSlot, PREFILL, Shared};
use crate::invariants::{self, FlushWindow};

/// Namespace of every simulated block.
pub const NAMESPACE: &str = "sim/tiny/bt4";
/// Tokens per block.
pub const BLOCK_TOKENS: u64 = 4;
/// Most blocks in one request (device slots reserved per request).
pub const BLOCKS_PER_REQUEST_MAX: usize = 12;
/// Most requests per run (device slots: one range per request + probe).
pub const REQUESTS_MAX: usize = 32;
/// Deadline passed to `flush_saves_and_registrations`.
pub const FLUSH_DEADLINE: Duration = Duration::from_secs(3);

/// The model preset (`tiny`).
pub fn preset() -> &'static ModelPreset {
    trace::preset("tiny").expect("tiny preset")
}

/// Bytes of one K (or V) segment.
pub fn segment_bytes() -> u64 {
    preset().segment_bytes(BLOCK_TOKENS)
}

/// Bytes of one block (all layers, K and V).
pub fn block_bytes() -> u64 {
    preset().block_bytes(BLOCK_TOKENS)
}

/// One request of the replay.
#[derive(Clone, Debug)]
pub struct Request {
    /// Index (also its device slot range).
    pub id: usize,
    /// Arrival, ms after the safety phase starts.
    pub arrival_ms: u64,
    /// Preferred prefill node (index).
    pub prefill: usize,
    /// Preferred decode node (index).
    pub decode: usize,
    /// Chained block hashes.
    pub hashes: Vec<BlockHash>,
}

impl Request {
    /// First device block of this request's slot range.
    pub fn slot_base(&self) -> u64 {
        (self.id * BLOCKS_PER_REQUEST_MAX) as u64
    }
}

/// Draws the requests: `2..=3` system prompts, `3..=5` conversations each on
/// one system prompt, `16..=REQUESTS_MAX` requests arriving over
/// `arrival_span_ms`; a conversation's next turn extends its previous one.
pub fn generate(rng: &mut StdRng, arrival_span_ms: u64) -> Vec<Request> {
    let systems = rng.random_range(2..=3u64);
    let convs = rng.random_range(3..=5u64);
    let conv_system: Vec<u64> = (0..convs).map(|_| rng.random_range(0..systems)).collect();
    let system_len: Vec<usize> = (0..systems).map(|_| rng.random_range(1..=4)).collect();
    let mut turns = vec![0usize; convs as usize];
    let n = rng.random_range(16..=REQUESTS_MAX);
    let mut arrivals: Vec<u64> = (0..n).map(|_| rng.random_range(0..arrival_span_ms)).collect();
    arrivals.sort_unstable();
    arrivals
        .into_iter()
        .enumerate()
        .map(|(id, arrival_ms)| {
            let c = rng.random_range(0..convs) as usize;
            turns[c] += 1;
            let s = conv_system[c];
            let sys = system_len[s as usize];
            let len = (sys + 2 * turns[c] + rng.random_range(0..2)).min(BLOCKS_PER_REQUEST_MAX);
            let hashes = (0..len)
                .map(|k| {
                    if k < sys { engine_block_hash(1_000 + s, k as u32) } else { engine_block_hash(c as u64, k as u32) }
                })
                .collect();
            Request {
                id,
                arrival_ms,
                prefill: rng.random_range(0..PREFILL),
                decode: PREFILL + rng.random_range(0..DECODE),
                hashes,
            }
        })
        .collect()
}

/// Writes block `hash`'s KV bytes into device block `slot`.
pub fn compute_block(n: &NodeSlot, slot: u64, hash: &BlockHash) {
    let mut buf = vec![0u8; segment_bytes() as usize];
    for (l, ly) in n.layers.iter().enumerate() {
        for s in 0..ly.segments() {
            fill_kv(NAMESPACE, hash, l as u32, u32::from(s), &mut buf);
            let off = ly.segment_offset(slot, s).expect("segment offset");
            n.gpu.write(n.buffer, off, &buf).expect("device write");
        }
    }
}

/// Whether device block `slot` holds exactly `hash`'s KV bytes.
pub fn device_block_ok(n: &NodeSlot, slot: u64, hash: &BlockHash) -> bool {
    let mut buf = vec![0u8; segment_bytes() as usize];
    n.layers.iter().enumerate().all(|(l, ly)| {
        (0..ly.segments()).all(|s| {
            let off = ly.segment_offset(slot, s).expect("segment offset");
            n.gpu.read(n.buffer, off, &mut buf).expect("device read");
            verify_kv(NAMESPACE, hash, l as u32, u32::from(s), &buf)
        })
    })
}

/// Per-run knobs of the workload drawn from the seed.
#[derive(Clone, Copy, Debug)]
pub struct WorkloadKnobs {
    /// Evict everything unpinned while holding a lease, then re-verify (C11).
    pub lease_pressure: bool,
    /// The `fetch_cancel` fault: cancel some fetches at random points.
    pub cancel_fetches: bool,
    /// One prefill at a time per node.
    pub serial_prefill: bool,
    /// Device leases (C19): prefills grant leases on what they saved (some
    /// short enough to expire before the decode comes), and half the
    /// decodes use `fetch_into`, which copies leased blocks device to
    /// device.
    pub device_leases: bool,
    /// Half the decodes first call `Engine::connect_peer` (its C9 bound):
    /// to the request's prefill node or to any other node, which may be
    /// down or cut off.
    pub connect_peers: bool,
}

/// Outcome of one fetch-and-verify.
#[derive(Clone, Debug, Default)]
pub struct Fetched {
    /// The engine's report (None when the watchdog fired).
    pub report: Option<FetchReport>,
    /// Blocks verified byte by byte.
    pub verified: usize,
}

/// Checks `inv_degrade_bounded` for a fetch that took `elapsed`, and keeps
/// the largest time any fetch ran past its deadline (`c9_overrun_max_us`).
fn check_bounded(
    shared: &Shared,
    node: usize,
    req: usize,
    r: &FetchReport,
    elapsed: Duration,
    resident: Option<usize>,
) {
    let over = elapsed.saturating_sub(shared.params.fetch_deadline);
    shared.fetch_overrun_max_us.fetch_max(over.as_micros() as u64, Ordering::SeqCst);
    let bound = invariants::fetch_bound(&shared.params);
    shared.checker.record(invariants::inv_degrade_bounded(node, req, r, elapsed, bound, resident));
}

/// Counts what a fetch's report shows for issue 29's counters: a fetch
/// that sealed blocks and then stopped on a transport error (C8's error path
/// after a partial read) and a fetch that ended on its deadline (C9).
fn count_report(shared: &Shared, r: &FetchReport) {
    use kvferry::engine::fetch::FetchError;
    use kvferry::transport::TransportError;
    if r.fetched > 0 && matches!(r.stopped, Some(FetchError::Transport(_))) {
        shared.partial_read_errors.fetch_add(1, Ordering::SeqCst);
    }
    if matches!(r.stopped, Some(FetchError::Deadline | FetchError::Transport(TransportError::Timeout))) {
        shared.deadline_fetches.fetch_add(1, Ordering::SeqCst);
    }
}

/// Fetch (local prefix first, then peers), lease what is resident, load it,
/// read it back from the device and verify every byte. Checks
/// `inv_degrade_bounded`, `inv_fetch_integrity` and the lease half of
/// `inv_no_early_free`.
pub async fn fetch_and_verify(
    shared: &Shared,
    n: &NodeSlot,
    node: usize,
    req: &Request,
    knobs: WorkloadKnobs,
    pressure_pause: Duration,
) -> Fetched {
    let bound = invariants::fetch_bound(&shared.params);
    let evicted0 = n.engine.metrics().evicted.load(Ordering::SeqCst);
    let cancel_after = if knobs.cancel_fetches {
        let mut rng = shared.rng.lock().expect("rng");
        rng.random_bool(0.25).then(|| Duration::from_millis(rng.random_range(1..300)))
    } else {
        None
    };
    let t0 = Instant::now();
    if let Some(after) = cancel_after {
        // The caller gives up: the fetch future is dropped wherever it is
        // (C8: the lock must still be released; C4: counts stay exact).
        if let Ok(report) = tokio::time::timeout(after, n.engine.fetch(NAMESPACE, &req.hashes)).await {
            count_report(shared, &report);
            let lease = n.engine.lease(NAMESPACE, &req.hashes[..report.available]);
            check_bounded(shared, node, req.id, &report, t0.elapsed(), None);
            let k = lease.len().min(report.available);
            let verified = verify_resident(shared, n, node, req, k, "after fetch").await;
            return Fetched { report: Some(report), verified };
        }
        shared.cancelled_fetches.fetch_add(1, Ordering::SeqCst);
        return Fetched::default();
    }
    let report = match tokio::time::timeout(bound * 2, n.engine.fetch(NAMESPACE, &req.hashes)).await {
        Ok(r) => r,
        Err(_) => {
            shared.checker.record(Err(invariants::violation(
                "inv_degrade_bounded",
                format!(
                    "node{} request {}: fetch still running after {:?} (bound {:?})",
                    node + 1,
                    req.id,
                    bound * 2,
                    bound
                ),
            )));
            return Fetched::default();
        }
    };
    let elapsed = t0.elapsed();
    count_report(shared, &report);
    // No await between the fetch's return and the lease: nothing can evict.
    let lease = n.engine.lease(NAMESPACE, &req.hashes[..report.available]);
    // Fetched blocks are not pinned for the caller: any eviction on this
    // node during the fetch (pool pressure, a forced evict-all) may
    // legitimately take them, so residency is checked only without one.
    let evicted = n.engine.metrics().evicted.load(Ordering::SeqCst) != evicted0;
    let resident = (!evicted).then_some(lease.len());
    check_bounded(shared, node, req.id, &report, elapsed, resident);
    let k = lease.len().min(report.available);
    let verified = verify_resident(shared, n, node, req, k, "after fetch").await;
    if knobs.lease_pressure && k > 0 {
        // C11: evict everything unpinned while the lease holds k blocks, let
        // other tasks allocate (and write) freed memory, then re-check.
        shared.evict_all(node, n);
        tokio::time::sleep(pressure_pause).await;
        let resident = n.engine.query_prefix(NAMESPACE, &req.hashes[..k]);
        let used = n.engine.pool().used_bytes();
        shared.checker.record(invariants::inv_no_early_free_lease(
            node,
            req.id,
            k,
            resident,
            used,
            shared.params.block_bytes(),
        ));
        verify_resident(shared, n, node, req, k, "after eviction pressure under lease").await;
    }
    drop(lease);
    Fetched { report: Some(report), verified }
}

/// Loads blocks `0..k` of `req` (which the caller keeps leased) into the
/// device and verifies each against recomputation.
async fn verify_resident(shared: &Shared, n: &NodeSlot, node: usize, req: &Request, k: usize, when: &str) -> usize {
    if k == 0 {
        return 0;
    }
    let blocks: Vec<(BlockHash, u64)> = (0..k).map(|i| (req.hashes[i].clone(), req.slot_base() + i as u64)).collect();
    // Poison the device slots first so a load that silently copies nothing
    // cannot pass as correct bytes.
    for (_, slot) in &blocks {
        poison_block(n, *slot);
    }
    let load = n.engine.load(NAMESPACE, &blocks).await.expect("valid load");
    let mut ok = 0;
    for (i, r) in load.results.iter().enumerate() {
        let hash = &req.hashes[i];
        match r {
            Err(e) => shared.checker.record(Err(invariants::violation(
                "inv_no_early_free_load",
                format!("node{} request {} block {i}: leased block failed to load {when}: {e}", node + 1, req.id),
            ))),
            Ok(()) => {
                shared.checker.count("inv_no_early_free_load", false);
                let good = device_block_ok(n, req.slot_base() + i as u64, hash);
                shared.checker.record(invariants::inv_fetch_integrity(node, req.id, i, good, when));
                ok += usize::from(good);
            }
        }
    }
    ok
}

fn poison_block(n: &NodeSlot, slot: u64) {
    let junk = vec![0xA5u8; segment_bytes() as usize];
    for ly in n.layers.iter() {
        for s in 0..ly.segments() {
            let off = ly.segment_offset(slot, s).expect("segment offset");
            n.gpu.write(n.buffer, off, &junk).expect("device write");
        }
    }
}

/// What a prefill produced.
#[derive(Clone, Debug, Default)]
pub struct PrefillOutcome {
    /// Blocks reused or fetched.
    pub reused: usize,
    /// Blocks newly saved.
    pub saved: usize,
}

/// The prefill side of one request. Runs on the prefill node.
pub async fn prefill(
    shared: Arc<Shared>,
    n: NodeSlot,
    node: usize,
    req: Request,
    knobs: WorkloadKnobs,
) -> PrefillOutcome {
    let serial = shared.prefill_serial[node].clone();
    let _one_at_a_time = if knobs.serial_prefill { Some(serial.lock_owned().await) } else { None };
    let f = fetch_and_verify(&shared, &n, node, &req, knobs, Duration::from_millis(5)).await;
    let k = f.verified;
    for i in k..req.hashes.len() {
        compute_block(&n, req.slot_base() + i as u64, &req.hashes[i]);
    }
    let window = FlushWindow::open(&shared, &n, knobs.serial_prefill);
    let blocks: Vec<(BlockHash, u64)> =
        (k..req.hashes.len()).map(|i| (req.hashes[i].clone(), req.slot_base() + i as u64)).collect();
    let saved =
        if blocks.is_empty() { Vec::new() } else { n.engine.save(NAMESPACE, &blocks).await.expect("valid save").saved };
    if knobs.device_leases {
        grant_and_drain_leases(&shared, &n, node, &blocks, &saved);
    }
    let bound = FLUSH_DEADLINE + invariants::FLUSH_SLACK;
    let t0 = Instant::now();
    let report = tokio::time::timeout(bound * 2, n.engine.flush_saves_and_registrations(FLUSH_DEADLINE)).await.ok();
    let elapsed = t0.elapsed();
    shared.checker.record(invariants::inv_flush_terminates(node, "flush_saves_and_registrations", elapsed, bound));
    if let Some(report) = report {
        // Synchronously, right after the flush returned.
        let r = invariants::inv_flush_visibility(&shared, &n, node, req.id, &report, &saved, &window);
        shared.checker.record(r.map(|_| ()));
    }
    PrefillOutcome { reused: k, saved: saved.len() }
}

/// C19: leases the device blocks of what this prefill saved, for a ttl
/// drawn short (often expired before the decode comes) or long; then
/// drains the node's ended leases and checks `inv_lease_ends_once`.
fn grant_and_drain_leases(
    shared: &Shared,
    n: &NodeSlot,
    node: usize,
    blocks: &[(BlockHash, u64)],
    saved: &[BlockHash],
) {
    let leased: Vec<(BlockHash, u64)> = blocks.iter().filter(|(h, _)| saved.contains(h)).cloned().collect();
    let ttl = {
        let mut rng = shared.rng.lock().expect("rng");
        if rng.random_bool(0.5) { rng.random_range(1..400) } else { rng.random_range(1_000..3_000) }
    };
    if !leased.is_empty() {
        match n.engine.grant_device_lease(NAMESPACE, &leased, Duration::from_millis(ttl)) {
            Ok(id) => {
                let mut book = shared.leases.lock().expect("leases");
                book.granted[node].insert(id.to_string());
                book.grants += 1;
            }
            // A block still under a lease from an earlier request of this
            // node: the engine refuses, nothing changes.
            Err(kvferry::engine::EngineError::Lease(_)) => {}
            Err(e) => shared.checker.record(Err(invariants::violation(
                "inv_lease_ends_once",
                format!("node{}: a valid device lease was refused: {e}", node + 1),
            ))),
        }
    }
    drain_leases(shared, n, node);
}

/// Drains the node's ended leases into the book, checking each ends once.
pub fn drain_leases(shared: &Shared, n: &NodeSlot, node: usize) {
    let ends: Vec<String> = n.engine.ended_device_leases().iter().map(|e| e.id.to_string()).collect();
    let mut book = shared.leases.lock().expect("leases");
    let book = &mut *book;
    let r = invariants::inv_lease_ends_once(node, &book.granted[node], &mut book.ended[node], &ends);
    for _ in 0..ends.len() {
        shared.checker.count("inv_lease_ends_once", false);
    }
    shared.checker.record(r);
}

/// The prefill node's transfer ticket for the decode node that will read
/// the request (`Engine::grant_transfer`); `None` when it locked nothing
/// or its lock table was full.
pub async fn grant_ticket(n: NodeSlot, req: Request, to: TransferAsk) -> Option<TransferTicket> {
    let t = n.engine.grant_transfer(NAMESPACE, &req.hashes, &to).await.ok()?;
    (!t.session().is_empty()).then_some(t)
}

/// `fetch_into` the request's device slots (the path that may copy device
/// to device from a same-host owner, C19) and verify every ready block's
/// bytes in place. Half the time the decode first asks the MetaServer who
/// holds the prefix, as an engine's scheduler does, waits a drawn while
/// (the answer may go stale: owners die, evict, are cut off) and starts
/// the fetch from that answer (`fetch_into_with_owners`). With the
/// prefill's `ticket`, the fetch starts from it instead
/// (`fetch_into_with_ticket`). Checks `inv_degrade_bounded` and
/// `inv_fetch_integrity`.
async fn fetch_into_and_verify(
    shared: &Shared,
    n: &NodeSlot,
    node: usize,
    req: &Request,
    ticket: Option<TransferTicket>,
) -> Fetched {
    let bound = invariants::fetch_bound(&shared.params);
    let blocks: Vec<(BlockHash, u64)> =
        req.hashes.iter().enumerate().map(|(i, h)| (h.clone(), req.slot_base() + i as u64)).collect();
    for (_, slot) in &blocks {
        poison_block(n, *slot);
    }
    shared.leases.lock().expect("leases").fetch_intos += 1;
    let ask_first = {
        let mut rng = shared.rng.lock().expect("rng");
        rng.random_bool(0.5).then(|| Duration::from_millis(rng.random_range(0..200)))
    };
    let mut owners = None;
    if let Some(pause) = ask_first {
        let rpc = shared.params.metaserver_rpc_timeout;
        owners = n.engine.client().query_prefix(NAMESPACE, &req.hashes, rpc).await.ok();
        tokio::time::sleep(pause).await;
    }
    let known0 = n.engine.metrics().fetch_known_owners.load(Ordering::SeqCst);
    let tickets0 = n.engine.metrics().fetch_tickets.load(Ordering::SeqCst);
    let t0 = Instant::now();
    let fetch = async {
        match (ticket, owners) {
            (Some(t), _) => n.engine.fetch_into_with_ticket(NAMESPACE, &blocks, t, t0 + bound).await,
            (None, Some(o)) => n.engine.fetch_into_with_owners(NAMESPACE, &blocks, o, t0 + bound).await,
            (None, None) => n.engine.fetch_into(NAMESPACE, &blocks).await,
        }
    };
    let got = match tokio::time::timeout(bound * 2, fetch).await {
        Ok(r) => r.expect("valid fetch_into"),
        Err(_) => {
            shared.checker.record(Err(invariants::violation(
                "inv_degrade_bounded",
                format!("node{} request {}: fetch_into still running after {:?}", node + 1, req.id, bound * 2),
            )));
            return Fetched::default();
        }
    };
    count_report(shared, &got.fetch);
    check_bounded(shared, node, req.id, &got.fetch, t0.elapsed(), None);
    if n.engine.metrics().fetch_known_owners.load(Ordering::SeqCst) > known0 {
        shared.known_owner_fetches.fetch_add(1, Ordering::SeqCst);
    }
    if n.engine.metrics().fetch_tickets.load(Ordering::SeqCst) > tickets0 {
        shared.ticket_fetches.fetch_add(1, Ordering::SeqCst);
    }
    let mut ok = 0;
    for i in 0..got.ready() {
        let good = device_block_ok(n, req.slot_base() + i as u64, &req.hashes[i]);
        shared.checker.record(invariants::inv_fetch_integrity(node, req.id, i, good, "after fetch_into"));
        if !good {
            break;
        }
        ok += 1;
    }
    Fetched { report: Some(got.fetch), verified: ok }
}

/// What a decode produced.
#[derive(Clone, Debug, Default)]
pub struct DecodeOutcome {
    /// Blocks fetched from peers.
    pub fetched: usize,
    /// Blocks verified (local hits + fetched).
    pub verified: usize,
    /// Blocks recomputed.
    pub recomputed: usize,
}

/// `Engine::connect_peer` from `node` to a drawn peer (half the time
/// `prefill`, the node that saved the request, else any other node: it may
/// be down or cut off) with a drawn timeout; checks `inv_connect_bounded`
/// and counts how it ended.
async fn connect_peer(shared: &Shared, n: &NodeSlot, node: usize, prefill: usize) {
    let (target, timeout) = {
        let mut rng = shared.rng.lock().expect("rng");
        let target = if rng.random_bool(0.5) {
            prefill
        } else {
            let other = rng.random_range(0..crate::cluster::NODES - 1);
            if other >= node { other + 1 } else { other }
        };
        let max_ms = 2 * shared.params.fetch_deadline.as_millis() as u64;
        (target, Duration::from_millis(rng.random_range(10..=max_ms.max(11))))
    };
    let addr = NodeAddr(format!("{}:{}", crate::cluster::node_ip(target), crate::cluster::GRPC_PORT));
    let t0 = Instant::now();
    let watchdog = timeout + shared.params.fetch_deadline + Duration::from_secs(10);
    let res = tokio::time::timeout(watchdog, n.engine.connect_peer(&addr, timeout)).await;
    let elapsed = t0.elapsed();
    let counter = match &res {
        Ok(Ok(_)) => &shared.connects_ok,
        Ok(Err(e)) if e.error == kvferry::engine::fetch::FetchError::Deadline => &shared.connects_deadline,
        _ => &shared.connects_failed,
    };
    counter.fetch_add(1, Ordering::SeqCst);
    shared.checker.record(invariants::inv_connect_bounded(node, target, elapsed, timeout));
}

/// The decode side of one request. Runs on the decode node; `prefill` is
/// the node that served its prefill.
pub async fn decode(
    shared: Arc<Shared>,
    n: NodeSlot,
    node: usize,
    prefill: usize,
    req: Request,
    knobs: WorkloadKnobs,
    ticket: Option<TransferTicket>,
) -> DecodeOutcome {
    if knobs.connect_peers && shared.rng.lock().expect("rng").random_bool(0.5) {
        connect_peer(&shared, &n, node, prefill).await;
    }
    let into = knobs.device_leases && shared.rng.lock().expect("rng").random_bool(0.5);
    let f = if into || ticket.is_some() {
        fetch_into_and_verify(&shared, &n, node, &req, ticket).await
    } else {
        fetch_and_verify(&shared, &n, node, &req, knobs, Duration::from_millis(20)).await
    };
    let k = f.verified;
    for i in k..req.hashes.len() {
        compute_block(&n, req.slot_base() + i as u64, &req.hashes[i]);
    }
    // C2 for the plain flush (no deadline of its own): bounded by the
    // per-RPC deadlines.
    let pending = n.engine.client().counters().pending;
    let bound = invariants::plain_flush_bound(&shared.params, pending, resident_count(&n));
    let t0 = Instant::now();
    let _ = tokio::time::timeout(bound * 2, n.engine.client().flush()).await;
    shared.checker.record(invariants::inv_flush_terminates(node, "client.flush", t0.elapsed(), bound));
    DecodeOutcome { fetched: f.report.as_ref().map_or(0, |r| r.fetched), verified: k, recomputed: req.hashes.len() - k }
}

/// Total registration commands dropped so far by a live node (client drops
/// plus door drops).
pub fn registrations_dropped(n: &NodeSlot) -> u64 {
    n.engine.client().counters().dropped() + n.engine.metrics().registrations_dropped_at_enqueue.load(Ordering::SeqCst)
}

/// Blocks resident on a node (all namespaces).
pub fn resident_count(n: &NodeSlot) -> u64 {
    n.engine.resident_blocks().iter().map(|(_, h)| h.len() as u64).sum()
}

/// Loads every block resident on node `n` (leased, in groups of a request's
/// worth, into the device slots no request uses) and compares its bytes with
/// recomputation. Returns `(blocks checked, blocks that differ)`.
pub async fn verify_all_resident(n: &NodeSlot) -> (u64, Vec<String>) {
    let base = (REQUESTS_MAX * BLOCKS_PER_REQUEST_MAX) as u64;
    let hashes: Vec<BlockHash> =
        n.engine.resident_blocks().into_iter().filter(|(ns, _)| ns == NAMESPACE).flat_map(|(_, h)| h).collect();
    let (mut checked, mut bad) = (0u64, Vec::new());
    for group in hashes.chunks(BLOCKS_PER_REQUEST_MAX) {
        let leases: Vec<_> = group.iter().map(|h| (h, n.engine.lease(NAMESPACE, std::slice::from_ref(h)))).collect();
        let held: Vec<BlockHash> = leases.iter().filter(|(_, l)| l.len() == 1).map(|(h, _)| (*h).clone()).collect();
        let blocks: Vec<(BlockHash, u64)> = held.iter().cloned().zip(base..).collect();
        for (_, slot) in &blocks {
            poison_block(n, *slot);
        }
        let Ok(load) = n.engine.load(NAMESPACE, &blocks).await else { continue };
        for ((hash, slot), r) in blocks.iter().zip(&load.results) {
            if r.is_ok() {
                checked += 1;
                if !device_block_ok(n, *slot, hash) {
                    bad.push(hex::encode(&hash.as_bytes()[..12]));
                }
            }
        }
        drop(leases);
    }
    (checked, bad)
}

/// Namespace of the buffer churn's blocks (issue 29, C15).
pub const CHURN_NAMESPACE: &str = "sim/tiny/bt4/churn";
/// Blocks of the churn's device buffer.
pub const CHURN_BLOCKS: u64 = 4;

/// The embedder's buffer churn on one node until `until` (issue 29, C15):
/// over and over, register a fresh device buffer (memory the embedder
/// allocated) and a layout over it, write KV into it, start a save, a load
/// and a `fetch_into` on it, then tear down while they are in flight —
/// unregister the layout, then the buffer, retrying while the backend
/// answers busy — and hand the memory to the graveyard (the embedder "frees"
/// it; the simulated GPU reports any access after the `Ok`).
pub async fn buffer_churn(shared: Arc<Shared>, n: NodeSlot, layer_first: bool, until: Instant) {
    use kvferry::engine::layout::{DeviceBufferId, buffer_bytes_needed, contiguous};
    let hashes: Vec<BlockHash> = (0..CHURN_BLOCKS).map(|k| engine_block_hash(9_000, k as u32)).collect();
    let blocks: Vec<(BlockHash, u64)> = hashes.iter().cloned().zip(0..).collect();
    let (layers_n, seg) = (preset().layers, segment_bytes());
    let bytes = buffer_bytes_needed(&contiguous(DeviceBufferId(0), layers_n, CHURN_BLOCKS, seg, true, layer_first));
    let mut buf = vec![0u8; seg as usize];
    while Instant::now() < until {
        let (pause, settle) = {
            let mut rng = shared.rng.lock().expect("rng");
            (rng.random_range(150..600), rng.random_range(0..3u64))
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let Ok(mem) = n.gpu.alloc_kv_memory(bytes) else { continue };
        // SAFETY: `mem` stays allocated until the run ends (graveyard).
        let Ok(id) = (unsafe { n.engine.register_buffer(mem.addr(), mem.len()) }) else { continue };
        shared.graveyard.lock().expect("graveyard").push(mem);
        n.gpu.hold_copies(id);
        let layers = contiguous(id, layers_n, CHURN_BLOCKS, seg, true, layer_first);
        if n.engine.register_layout(CHURN_NAMESPACE, layers.clone()).is_err() {
            let _ = n.engine.unregister_buffer(id);
            continue;
        }
        for (slot, h) in hashes.iter().enumerate() {
            for (l, ly) in layers.iter().enumerate() {
                for s in 0..ly.segments() {
                    fill_kv(CHURN_NAMESPACE, h, l as u32, u32::from(s), &mut buf);
                    let off = ly.segment_offset(slot as u64, s).expect("segment offset");
                    n.gpu.write(id, off, &buf).expect("device write");
                }
            }
        }
        let (e1, e2, e3) = (n.engine.clone(), n.engine.clone(), n.engine.clone());
        let (b1, b2, b3) = (blocks.clone(), blocks.clone(), blocks.clone());
        let save = tokio::spawn(async move {
            let _ = e1.save(CHURN_NAMESPACE, &b1).await;
        });
        let load = tokio::spawn(async move {
            let _ = e2.load(CHURN_NAMESPACE, &b2).await;
        });
        let fetch = tokio::spawn(async move {
            let _ = e3.fetch_into(CHURN_NAMESPACE, &b3).await;
        });
        if settle == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(settle)).await;
        }
        // Tear down while the work is in flight: the layout, then the buffer.
        let _ = n.engine.unregister_layout(CHURN_NAMESPACE);
        for _ in 0..2_000 {
            match n.engine.unregister_buffer(id) {
                Err(kvferry::engine::EngineError::Gpu(kvferry::gpu::GpuError::Buffer(
                    kvferry::gpu::BufferError::Busy { .. },
                ))) => tokio::time::sleep(Duration::from_millis(1)).await,
                _ => break,
            }
        }
        let _ = save.await;
        let _ = load.await;
        let _ = fetch.await;
    }
}
