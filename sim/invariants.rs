//! The simulator's named invariants (design.md §3, starred contracts).
//!
//! Every check is a function `inv_*` returning `Result<_, Violation>`; the
//! [`Checker`] counts evaluations per name (so a run shows which checks were
//! exercised, not just that nothing failed) and keeps every violation.
//!
//! # What is checked
//! - `inv_flush_terminates` (C2): every `flush_saves_and_registrations(d)`
//!   returns within `d + FLUSH_SLACK`; every plain `client.flush()` returns
//!   within [`plain_flush_bound`] (20 MetaServer RPC deadlines: a flush
//!   waits for at most the batch in flight and its own batch, each a
//!   heartbeat, a backfill RPC and up to three RPCs per chunk). Holds with
//!   the MetaServer down, stalled, partitioned or dropping writes.
//! - `inv_flush_visibility` (C1): right after a flush whose report says
//!   nothing timed out and nothing was dropped, every block the save made
//!   newly resident *and still resident* is visible at the MetaServer store
//!   (read directly, no RPC) with this node as an owner, and the node's
//!   session is the one the store knows. Skipped (and counted per reason)
//!   when, with overlapping prefills, the node's client dropped any command
//!   in the window (a report covers its own flush window, so with
//!   concurrent flushers on one node a caller's drops may be credited to
//!   another caller's report; with serial prefills the report is exact), when
//!   the MetaServer restarted or was down in the window, a
//!   drop-registration fault was open in the window, a registration was
//!   dropped at the queue door, the node evicted anything in the window (an
//!   evicted block may be back with an insert the flush does not cover), or
//!   the node's session record is stale at check time (C5 hides stale
//!   owners by design).
//! - `inv_session_ids_unique` (C16): every transfer-session id any engine
//!   granted in the run (every node, every incarnation; seen through the
//!   trace event `kvferry::transfer_session` that
//!   [`kvferry::engine::Engine::lock_for_transfer`] emits, collected by
//!   [`SessionGrants`]) is granted once. Checked once per run, counting the
//!   grants it saw; it does not check unpredictability (a seed fixes every
//!   id by design) — the real-runtime tests in `tests/fetch.rs` do.
//! - `inv_accounting` (C4): on every live node at every checker tick, the
//!   queue identity `offered == delivered + dropped + pending`, the engine
//!   identity `evicted == removals_enqueued + removals_dropped_at_enqueue`,
//!   `offered_removes == evicted`, `dropped_queue_full_removes ==
//!   removals_dropped_at_enqueue` and `offered_inserts <= saved_blocks +
//!   fetched_blocks`; at the end (no work in flight) the last one must be an
//!   equality: every newly resident block was offered exactly once, cancels
//!   included.
//! - `inv_fetch_integrity` (C9/C10): every block a fetch reports in its
//!   verified prefix (local hits included) is leased, loaded to the device
//!   (slots poisoned first) and compared byte by byte with `fill_kv`
//!   recomputation.
//! - `inv_degrade_bounded` (C9): every fetch returns within
//!   [`fetch_bound`]; its report is coherent (`available <= requested`,
//!   `available == local_hits + fetched`, `stopped` set iff short); when no
//!   eviction ran on the node during the fetch, the `available` blocks are
//!   resident right after it returns. A watchdog at twice the bound turns a
//!   hang into a violation.
//! - `inv_fetch_progress` (C9 liveness): after healing, a fetch of a prefix
//!   the converged index lists at a live peer brings that prefix (two
//!   attempts: connections pooled before a peer restarted die on first
//!   use). Guards against a suite that passes because nothing is fetched.
//! - `inv_no_lock_leak` (C8), two halves. *Eventual*: after healing, every
//!   live node's `active_transfer_locks` reaches 0 within `lock_timeout +
//!   gc_interval + LOCK_SLACK` (requesters that died or were cut off are
//!   covered by expiry + the engine's own GC). *Prompt*: in the fault-free
//!   liveness phase a fetch cancelled mid-read (the cancel probe: slow reads,
//!   then the future is dropped) leaves no lock behind after
//!   `RELEASE_GRACE`, far below the lock timeout: the requester released on
//!   the cancel path.
//! - `inv_no_early_free` (C11): (a) on every live node at every tick, the
//!   pool allocator's own invariants hold and `pool used bytes >= resident
//!   blocks × block bytes` (a cached block's memory is allocated); (b) with
//!   lease pressure on, a block leased by a prefill/decode survives
//!   `evict(everything)` (still resident, its bytes still verify after
//!   other tasks ran and allocated); (c) with wire corruption off, no fetch
//!   in the whole run (dead incarnations included) sees a checksum
//!   mismatch: a transfer-locked block whose memory was freed and reused
//!   under a reader would show up there.
//! - `inv_index_converges` (C6): after liveness, the MetaServer's visible
//!   entries equal the union of the live nodes' resident blocks. When the
//!   run lost registrations (fire-and-forget drops are allowed by C1/C3),
//!   the liveness phase first restarts the MetaServer: the C6 backfill is
//!   then the only way back to convergence, and that is what is checked.
//!   Otherwise the index must converge by itself (inserts, removals).
//!
//! # What is NOT checked
//! - Concurrency below the task level: the simulator is single-threaded, so
//!   data races, lock ordering and memory ordering are out of scope (unit
//!   tests, fuzzing and loom-style tools cover those).
//! - The real network and kernel: madsim-tonic passes messages as objects
//!   (encoding, size limits and tower layers are not exercised), does not
//!   propagate a client's cancellation to the server, and the simulated TCP
//!   stream neither fragments nor applies back-pressure.
//! - GPU and RDMA asynchrony: the host GPU completes inside `submit` and the
//!   TCP transport has no DMA that outlives a cancelled read, so C11 for
//!   in-flight hardware operations is not exercised.
//! - That fetched blocks stay resident until the caller uses them under
//!   pool pressure: they are not pinned for the caller, so an eviction
//!   between the fetch's seal and its return may take them (the report is a
//!   snapshot); the caller then recomputes.
//! - C5 fencing details, C7 ordering, C12, C13 and C14 stitching order
//!   (unit and integration tests); C3 counts beyond `dropped == 0`.
//! - Visibility of registrations dropped during faults without a MetaServer
//!   restart (by design they stay invisible until a backfill).
//! - Performance: latencies are simulated and only bounded, never measured.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry::client::FlushReport;
use kvferry::engine::fetch::FetchReport;
use kvferry::types::{BlockHash, NodeAddr};

use crate::cluster::{NodeSlot, Params, Shared};
use crate::workload::NAMESPACE;

/// Slack over a flush deadline (scheduling of the waiting task).
pub const FLUSH_SLACK: Duration = Duration::from_millis(100);
/// Slack over the fetch deadline: the last step may overrun by one RPC
/// deadline's worth of cleanup (the release runs after the read).
pub const FETCH_SLACK: Duration = Duration::from_millis(100);
/// Slack over lock timeout + GC interval.
pub const LOCK_SLACK: Duration = Duration::from_secs(2);
/// How long a cancelled fetch may take to release its lock.
pub const RELEASE_GRACE: Duration = Duration::from_secs(1);

/// Bound of a whole fetch.
pub fn fetch_bound(p: &Params) -> Duration {
    // The release RPC after the read is bounded by the peer RPC deadline.
    p.fetch_deadline + p.peer_rpc_timeout + FETCH_SLACK
}

/// Bound of a plain `client.flush()` (see the module doc).
pub fn plain_flush_bound(p: &Params) -> Duration {
    p.metaserver_rpc_timeout * 20
}

/// One broken invariant.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The `inv_*` name.
    pub invariant: &'static str,
    /// Simulated time since the run started (ms).
    pub at_ms: u64,
    /// What was seen.
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{:>6} ms] {}: {}", self.at_ms, self.invariant, self.detail)
    }
}

thread_local! {
    static ORIGIN: std::cell::Cell<Option<tokio::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// Sets the origin of `Violation::at_ms` (the start of the run).
pub fn set_origin() {
    ORIGIN.with(|o| o.set(Some(tokio::time::Instant::now())));
}

/// Simulated ms since [`set_origin`].
pub fn now_ms() -> u64 {
    ORIGIN.with(|o| o.get().map_or(0, |t| t.elapsed().as_millis() as u64))
}

/// Builds a violation stamped with the current simulated time.
pub fn violation(invariant: &'static str, detail: String) -> Violation {
    Violation { invariant, at_ms: now_ms(), detail }
}

/// Collects violations and counts checks per invariant.
#[derive(Default)]
pub struct Checker {
    violations: Mutex<Vec<Violation>>,
    counts: Mutex<BTreeMap<&'static str, (u64, u64)>>,
}

impl Checker {
    /// Records one evaluation.
    pub fn record(&self, r: Result<(), Violation>) {
        match r {
            Ok(()) => {}
            Err(v) => {
                self.count(v.invariant, true);
                eprintln!("VIOLATION {v}");
                self.violations.lock().expect("violations").push(v);
            }
        }
    }

    /// Counts one evaluation of `name` (`failed` when it was violated).
    pub fn count(&self, name: &'static str, failed: bool) {
        let mut c = self.counts.lock().expect("counts");
        let e = c.entry(name).or_default();
        if failed {
            e.1 += 1;
        } else {
            e.0 += 1;
        }
    }

    /// Violations so far.
    pub fn violations(&self) -> Vec<Violation> {
        self.violations.lock().expect("violations").clone()
    }

    /// `name -> (passed, failed)`.
    pub fn counts(&self) -> BTreeMap<&'static str, (u64, u64)> {
        self.counts.lock().expect("counts").clone()
    }
}

fn pass(c: &Checker, name: &'static str) -> Result<(), Violation> {
    c.count(name, false);
    Ok(())
}

// Every `inv_*` below counts itself as passed through `ok!`, or returns a
// violation that `Checker::record` counts as failed.
macro_rules! ok {
    ($shared:expr, $name:literal) => {
        pass(&$shared.checker, $name)
    };
}

/// C2: a flush returned within `bound`.
pub fn inv_flush_terminates(node: usize, what: &str, elapsed: Duration, bound: Duration) -> Result<(), Violation> {
    if elapsed > bound {
        return Err(violation(
            "inv_flush_terminates",
            format!("node{}: {what} took {elapsed:?}, bound {bound:?}", node + 1),
        ));
    }
    COUNT.with(|c| c.borrow_mut().push("inv_flush_terminates"));
    Ok(())
}

thread_local! {
    // Passed checks from functions that do not see the checker; drained
    // into it by `Checker::drain_passes` (keeps signatures small).
    static COUNT: std::cell::RefCell<Vec<&'static str>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Checker {
    /// Moves passed-check counts recorded by checker-less `inv_*` functions
    /// into the per-name table.
    pub fn drain_passes(&self) {
        let names = COUNT.with(|c| std::mem::take(&mut *c.borrow_mut()));
        for n in names {
            self.count(n, false);
        }
    }
}

/// The state a flush-visibility check compares against: taken before the
/// save whose registrations the flush covers.
pub struct FlushWindow {
    ms_incarnation: Option<u64>,
    drop_state: (u64, u64),
    door_drops: u64,
    client_drops: u64,
    evicted: u64,
    serial: bool,
}

impl FlushWindow {
    /// Opens the window (call before `save`); `serial`: no other prefill
    /// runs on this node until the check.
    pub fn open(shared: &Shared, n: &NodeSlot, serial: bool) -> Self {
        FlushWindow {
            ms_incarnation: shared.ms().map(|m| m.incarnation),
            drop_state: shared.drop_state(),
            door_drops: n.engine.metrics().registrations_dropped_at_enqueue.load(Ordering::SeqCst),
            client_drops: n.engine.client().counters().dropped(),
            evicted: n.engine.metrics().evicted.load(Ordering::SeqCst),
            serial,
        }
    }
}

/// C1: after a clean flush the saved, still-resident blocks are visible.
/// `Ok(true)`: checked; `Ok(false)`: skipped (see the module doc).
pub fn inv_flush_visibility(
    shared: &Shared,
    n: &NodeSlot,
    node: usize,
    req: usize,
    report: &FlushReport,
    saved: &[BlockHash],
    w: &FlushWindow,
) -> Result<bool, Violation> {
    let skip = |why: &'static str| {
        shared.checker.count(why, false);
        Ok(false)
    };
    if report.timed_out || report.dropped > 0 {
        return skip("inv_flush_visibility.skip.flush_timed_out_or_dropped");
    }
    if !w.serial && n.engine.client().counters().dropped() != w.client_drops {
        // A report covers its flush window only: with concurrent flushes on
        // one node, this caller's dropped commands may be credited to
        // another caller's window. Judge by the node-wide counter instead.
        return skip("inv_flush_visibility.skip.node_dropped_in_window");
    }
    let Some(ms) = shared.ms() else { return skip("inv_flush_visibility.skip.metaserver_down") };
    if w.ms_incarnation != Some(ms.incarnation) {
        return skip("inv_flush_visibility.skip.metaserver_restarted");
    }
    let drop_now = shared.drop_state();
    if w.drop_state.1 > 0 || drop_now.1 > 0 || drop_now.0 != w.drop_state.0 {
        return skip("inv_flush_visibility.skip.drop_fault_in_window");
    }
    if n.engine.metrics().registrations_dropped_at_enqueue.load(Ordering::SeqCst) != w.door_drops {
        return skip("inv_flush_visibility.skip.door_drop");
    }
    if n.engine.metrics().evicted.load(Ordering::SeqCst) != w.evicted {
        // An evicted block may be resident again (re-saved or re-fetched
        // after the flush began): its removal was covered, its new insert
        // not.
        return skip("inv_flush_visibility.skip.eviction_in_window");
    }
    let me = n.engine.node().clone();
    let session = n.engine.client().session().clone();
    let store = ms.store.lock().expect("store");
    let now = ms.now_ms();
    let stale_after_ms = store.config().stale_after_ms;
    match store.node_session(&me) {
        Some((s, last_hb)) if s == session && now.saturating_sub(last_hb) <= stale_after_ms => {}
        Some((s, _)) if s == session => return skip("inv_flush_visibility.skip.session_stale"),
        _ if saved.is_empty() => return skip("inv_flush_visibility.skip.nothing_saved"),
        other => {
            return Err(violation(
                "inv_flush_visibility",
                format!(
                    "node{} request {req}: flush reported {report:?} but the store has no live record of session {} (record: {:?})",
                    node + 1,
                    session.as_str(),
                    other.map(|(s, hb)| (s.0, hb))
                ),
            ));
        }
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for h in saved {
        if n.engine.query_prefix(NAMESPACE, std::slice::from_ref(h)) == 0 {
            continue; // evicted since: a removal may be queued
        }
        checked += 1;
        if !store.owners(NAMESPACE, h, now).contains(&me) {
            missing.push(hex::encode(&h.as_bytes()[..12]));
        }
    }
    if !missing.is_empty() {
        return Err(violation(
            "inv_flush_visibility",
            format!(
                "node{} request {req}: flush returned {report:?} but {} of {checked} saved blocks are not visible at the store: {}",
                node + 1,
                missing.len(),
                missing.join(",")
            ),
        ));
    }
    if checked == 0 {
        return skip("inv_flush_visibility.skip.nothing_saved");
    }
    shared.checker.count("inv_flush_visibility", false);
    Ok(true)
}

/// C4 on one live node.
///
/// `quiescent`: no save or fetch is in flight. A fetch counts its blocks in
/// `fetched_blocks` before it offers their registrations (after releasing
/// the transfer lock), so while work is in flight only `offered_inserts <=
/// saved_blocks + fetched_blocks` holds.
pub fn inv_accounting(shared: &Shared, node: usize, n: &NodeSlot, quiescent: bool) -> Result<(), Violation> {
    let c = n.engine.client().counters();
    let m = n.engine.metrics();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::SeqCst);
    let (evicted, enq, door) = (ld(&m.evicted), ld(&m.removals_enqueued), ld(&m.removals_dropped_at_enqueue));
    let mut bad = Vec::new();
    if !c.identity_holds() {
        bad.push(format!(
            "queue: offered {} != delivered {} + dropped {} + pending {}",
            c.offered,
            c.delivered,
            c.dropped(),
            c.pending
        ));
    }
    if evicted != enq + door {
        bad.push(format!("engine: evicted {evicted} != removals_enqueued {enq} + removals_dropped_at_enqueue {door}"));
    }
    if c.offered_removes != evicted {
        bad.push(format!("offered_removes {} != evicted {evicted}", c.offered_removes));
    }
    if c.dropped_queue_full_removes != door {
        bad.push(format!(
            "dropped_queue_full_removes {} != removals_dropped_at_enqueue {door}",
            c.dropped_queue_full_removes
        ));
    }
    let (saved, fetched) = (ld(&m.saved_blocks), ld(&m.fetched_blocks));
    if c.offered_inserts > saved + fetched || (quiescent && c.offered_inserts != saved + fetched) {
        bad.push(format!("offered_inserts {} != saved_blocks {saved} + fetched_blocks {fetched}", c.offered_inserts));
    }
    if bad.is_empty() {
        return ok!(shared, "inv_accounting");
    }
    Err(violation("inv_accounting", format!("node{} (incarnation {}): {}", node + 1, n.incarnation, bad.join("; "))))
}

/// C9/C10: one block's bytes after load.
pub fn inv_fetch_integrity(node: usize, req: usize, block: usize, good: bool, when: &str) -> Result<(), Violation> {
    if good {
        COUNT.with(|c| c.borrow_mut().push("inv_fetch_integrity"));
        return Ok(());
    }
    Err(violation(
        "inv_fetch_integrity",
        format!("node{} request {req} block {block}: device bytes differ from recomputation {when}", node + 1),
    ))
}

/// C9: one fetch ended in bound with a coherent "k of n".
pub fn inv_degrade_bounded(
    node: usize,
    req: usize,
    r: &FetchReport,
    elapsed: Duration,
    bound: Duration,
    resident_after: Option<usize>,
) -> Result<(), Violation> {
    let mut bad = Vec::new();
    if elapsed > bound {
        bad.push(format!("took {elapsed:?}, bound {bound:?}"));
    }
    if r.available > r.requested {
        bad.push(format!("available {} > requested {}", r.available, r.requested));
    }
    if r.available != r.local_hits + r.fetched {
        bad.push(format!("available {} != local_hits {} + fetched {}", r.available, r.local_hits, r.fetched));
    }
    if (r.available < r.requested) != r.stopped.is_some() {
        bad.push(format!("stopped {:?} with {} of {}", r.stopped, r.available, r.requested));
    }
    if let Some(resident) = resident_after.filter(|&k| k < r.available) {
        bad.push(format!("reported {} available but only {resident} resident right after", r.available));
    }
    if bad.is_empty() {
        COUNT.with(|c| c.borrow_mut().push("inv_degrade_bounded"));
        return Ok(());
    }
    Err(violation("inv_degrade_bounded", format!("node{} request {req}: {}", node + 1, bad.join("; "))))
}

/// C9 liveness: with every fault healed, a fetch of a prefix that the
/// converged index lists at another live node brings at least that prefix
/// (within two attempts: see the scenario's progress probe).
/// Guards against a suite that passes because nothing ever gets fetched.
pub fn inv_fetch_progress(node: usize, req: usize, listed: usize, r: Option<&FetchReport>) -> Result<(), Violation> {
    match r {
        Some(r) if r.available >= listed && listed > 0 => {
            COUNT.with(|c| c.borrow_mut().push("inv_fetch_progress"));
            Ok(())
        }
        _ => Err(violation(
            "inv_fetch_progress",
            format!(
                "node{} request {req}: fault-free fetch of a prefix of {listed} block(s) listed at a live peer returned {:?}",
                node + 1,
                r.map(|r| (r.available, r.stopped.clone()))
            ),
        )),
    }
}

/// C8: no transfer lock on any live node (`what` names the half).
pub fn inv_no_lock_leak(shared: &Shared, what: &str, locks: &[(usize, u64)]) -> Result<(), Violation> {
    let held: Vec<String> =
        locks.iter().filter(|(_, n)| *n > 0).map(|(i, n)| format!("node{}: {n} session(s)", i + 1)).collect();
    if held.is_empty() {
        return ok!(shared, "inv_no_lock_leak");
    }
    Err(violation("inv_no_lock_leak", format!("{what}: transfer locks still held: {}", held.join(", "))))
}

/// C11 (a): allocator consistency and cache memory allocated, on one node.
pub fn inv_no_early_free_pool(shared: &Shared, node: usize, n: &NodeSlot) -> Result<(), Violation> {
    n.engine.pool().check_invariants(); // panics on a corrupted allocator
    let g = n.engine.gauges();
    let block = shared.params.block_bytes().next_multiple_of(n.engine.pool().align());
    if g.pool_used_bytes < g.resident_blocks * block {
        return Err(violation(
            "inv_no_early_free",
            format!(
                "node{}: pool used {} B < {} resident blocks × {block} B: cached memory was freed",
                node + 1,
                g.pool_used_bytes,
                g.resident_blocks
            ),
        ));
    }
    ok!(shared, "inv_no_early_free")
}

/// C11 (b): leased blocks survived eviction pressure.
pub fn inv_no_early_free_lease(
    node: usize,
    req: usize,
    leased: usize,
    resident: usize,
    pool_used: u64,
    block_bytes: u64,
) -> Result<(), Violation> {
    if resident < leased || pool_used < leased as u64 * block_bytes {
        return Err(violation(
            "inv_no_early_free",
            format!(
                "node{} request {req}: {leased} leased blocks, {resident} still resident after evict(all), pool used {pool_used} B",
                node + 1
            ),
        ));
    }
    COUNT.with(|c| c.borrow_mut().push("inv_no_early_free"));
    Ok(())
}

/// C10/C11 (c): no checksum failure without injected corruption.
pub fn inv_no_checksum_failures(shared: &Shared, corruption_on: bool, failures: u64) -> Result<(), Violation> {
    if corruption_on || failures == 0 {
        return ok!(shared, "inv_no_early_free");
    }
    Err(violation(
        "inv_no_early_free",
        format!(
            "{failures} checksum failure(s) with wire corruption off: a locked block's memory changed under a reader"
        ),
    ))
}

/// Visible entries vs resident blocks: `(missing at the store, extra at the store)`.
pub type IndexDiff = (Vec<(NodeAddr, String)>, Vec<(NodeAddr, String)>);

/// C6: the index equals the union of resident blocks.
pub fn index_diff(
    visible: &BTreeSet<(String, BlockHash, NodeAddr)>,
    resident: &BTreeSet<(String, BlockHash, NodeAddr)>,
) -> IndexDiff {
    let short = |h: &BlockHash| hex::encode(&h.as_bytes()[..12]);
    let missing = resident.difference(visible).map(|(_, h, n)| (n.clone(), short(h))).collect();
    let extra = visible.difference(resident).map(|(_, h, n)| (n.clone(), short(h))).collect();
    (missing, extra)
}

/// C6 verdict after the convergence wait.
pub fn inv_index_converges(shared: &Shared, diff: &IndexDiff, waited: Duration, why: &str) -> Result<(), Violation> {
    if diff.0.is_empty() && diff.1.is_empty() {
        return ok!(shared, "inv_index_converges");
    }
    let fmt = |v: &[(NodeAddr, String)]| {
        let mut by: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (n, h) in v {
            by.entry(n.as_str()).or_default().push(h);
        }
        by.iter()
            .map(|(n, hs)| format!("{n}: {} ({})", hs.len(), hs.iter().take(3).copied().collect::<Vec<_>>().join(",")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(violation(
        "inv_index_converges",
        format!(
            "not converged after {waited:?} ({why}): {} resident block(s) not visible [{}], {} visible entr(ies) not resident [{}]",
            diff.0.len(),
            fmt(&diff.0),
            diff.1.len(),
            fmt(&diff.1)
        ),
    ))
}

/// Resident `(namespace, hash, node)` over the live nodes.
pub fn resident_union(shared: &Shared) -> BTreeSet<(String, BlockHash, NodeAddr)> {
    let mut out = BTreeSet::new();
    for i in 0..shared.nodes.len() {
        if let Some(n) = shared.node(i) {
            for (ns, hashes) in n.engine.resident_blocks() {
                for h in hashes {
                    out.insert((ns.clone(), h, n.engine.node().clone()));
                }
            }
        }
    }
    out
}

/// The periodic safety checks on every live node (`quiescent`: no workload
/// in flight).
pub fn tick(shared: &Shared, quiescent: bool) {
    for i in 0..shared.nodes.len() {
        if let Some(n) = shared.node(i) {
            shared.checker.record(inv_accounting(shared, i, &n, quiescent));
            shared.checker.record(inv_no_early_free_pool(shared, i, &n));
        }
    }
    shared.checker.drain_passes();
}

/// Every transfer-session id granted in a run, collected from the engines'
/// trace events (a `tracing` layer installed for the run's thread).
#[derive(Clone, Default)]
pub struct SessionGrants(Arc<Mutex<(BTreeSet<String>, Vec<String>)>>);

impl SessionGrants {
    /// The `tracing` layer that records grants into `self`.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        use tracing_subscriber::Layer as _;
        let grants = self.clone();
        GrantLayer(grants).with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target() == kvferry::engine::TRANSFER_SESSION_TRACE_TARGET
        }))
    }
}

struct GrantLayer(SessionGrants);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for GrantLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Field(Option<String>);
        impl tracing::field::Visit for Field {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "session" {
                    self.0 = Some(format!("{v:?}"));
                }
            }
        }
        let mut field = Field(None);
        event.record(&mut field);
        if let Some(id) = field.0 {
            let mut g = (self.0).0.lock().expect("grants");
            if !g.0.insert(id.clone()) {
                g.1.push(id);
            }
        }
    }
}

/// C16: no transfer-session id was granted twice in the run (module doc).
pub fn inv_session_ids_unique(shared: &Shared, grants: &SessionGrants) -> Result<(), Violation> {
    let g = grants.0.lock().expect("grants");
    if let Some(id) = g.1.first() {
        return Err(violation(
            "inv_session_ids_unique",
            format!("{} of {} grants reused an id, first {id}", g.1.len(), g.0.len() + g.1.len()),
        ));
    }
    for _ in 0..g.0.len() {
        shared.checker.count("inv_session_ids_unique", false);
    }
    Ok(())
}
