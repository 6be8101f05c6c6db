//! The simulator's named invariants (design.md §3, starred contracts).
//!
//! Every check is a function `inv_*` returning `Result<_, Violation>`; the
//! [`Checker`] counts evaluations per name (so a run shows which checks were
//! exercised, not just that nothing failed) and keeps every violation.
//!
//! # What is checked
//! Every name below is counted separately (passes and failures) and printed
//! in the run's `SIM-SUMMARY ... checks=` field; `scripts/sim.sh` sums them
//! over the sweep and fails when an invariant of a starred contract checked
//! zero cases.
//! - `inv_flush_terminates` (C2), per flush: every
//!   `flush_saves_and_registrations(d)` returns within `d + FLUSH_SLACK`;
//!   every plain `client.flush()` within [`plain_flush_bound`] of *that*
//!   flush: one MetaServer RPC deadline per RPC it can wait on (two driver
//!   turns, each a heartbeat plus the backfill's RPCs for the blocks
//!   resident at the flush, plus three RPCs per chunk of the commands
//!   pending at the flush). Holds with the MetaServer down, stalled,
//!   partitioned or dropping writes.
//! - `inv_flush_visibility` (C1): right after a flush whose report says
//!   nothing timed out and nothing was dropped, every block the save made
//!   newly resident *and still resident* is visible at the MetaServer store
//!   (read directly, no RPC) with this node as an owner, and the node's
//!   session is the one the store knows. Skipped (and counted per reason,
//!   `inv_flush_visibility.skip.*`) when, with overlapping prefills, the
//!   node's client dropped any command in the window (a report covers its
//!   own flush window, so with concurrent flushers on one node a caller's
//!   drops may be credited to another caller's report), when the MetaServer
//!   restarted or was down in the window, a drop-registration fault was
//!   open in the window, a registration was dropped at the queue door, the
//!   node evicted anything in the window, or the node's session record is
//!   stale at check time (C5 hides stale owners by design).
//! - `inv_session_ids_unique` (C16): every transfer-session id any engine
//!   granted in the run (every node, every incarnation; seen through the
//!   trace event `kvferry::transfer_session`, collected by
//!   [`SessionGrants`]) is granted once; one case per grant. Not
//!   unpredictability (a seed fixes every id) — `tests/fetch.rs` does that.
//! - `inv_pins_exact` (C8), one case per grant: on the owner, the blocks the
//!   lock table pins for a `QueryBlocksForTransfer` session are exactly the
//!   requested blocks it found resident (trace event
//!   `kvferry::transfer_pins`: requested, found, and the lock table's
//!   content right after the grant).
//! - `inv_accounting` (C4), counters: on every live node at every tick,
//!   `offered == delivered + dropped + pending`, `evicted ==
//!   removals_enqueued + removals_dropped_at_enqueue + evicted_to_disk`,
//!   `offered_removes == evicted - evicted_to_disk + the disk tier's
//!   removals`, `dropped_queue_full_removes ==
//!   removals_dropped_at_enqueue + the disk tier's`,
//!   `offered_inserts <= saved_blocks + fetched_blocks + the disk tier's
//!   recovered and re-advertised blocks` (equality at the end). These identities are kept by the code they check, so they catch
//!   miscounting, not a lost command.
//! - `inv_index_matches_engine` (C4), what was delivered: once every fault
//!   is healed and every node flushed, before any repair, the MetaServer's
//!   entries for each live node equal what that node's engine holds
//!   (resident, so not removed); a difference no larger than the
//!   registrations the node counted dropped is counted as
//!   `inv_index_matches_engine.explained_by_drops`, a larger one fails.
//!   Skipped (counted per reason) after a MetaServer restart (its store
//!   starts empty; C6's backfill is checked by `inv_index_converges`) and
//!   for restarted nodes (earlier incarnations' drops are not in their
//!   counters) or nodes whose heartbeats failed or that backfilled (their
//!   session may have lapsed at the store, hiding or sweeping entries that
//!   only a backfill restores).
//! - `inv_fetch_integrity` (C9/C10): every block a fetch reports in its
//!   verified prefix (local hits included) is leased, loaded to the device
//!   (slots poisoned first) and compared byte by byte with `fill_kv`
//!   recomputation.
//! - `inv_corruption_rejected` (C10): every corrupted payload a server sent
//!   (counted server side once written and flushed, `TcpHooks::corrupt_sent`;
//!   armed corruptions the heal disarmed unsent, or that died with their
//!   server, are counted apart as `corrupt_disarmed` / `corrupt_lost`) was
//!   rejected by the fetcher that got it: at the end every block resident on
//!   every live node is loaded and compared with recomputation, so an
//!   accepted corruption is found whether or not the workload loaded it (one
//!   case per block checked, in runs that sent corruption; in runs that did
//!   not, the same check is `inv_no_early_free_resident`, C11). The
//!   fetcher's rejections (`checksum_rejected`) are printed beside the sends.
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
//! - `inv_no_lock_leak_eventual` (C8): after healing, every live node's
//!   `active_transfer_locks` reaches 0 within `lock_timeout + gc_interval +
//!   LOCK_SLACK` (requesters that died or were cut off are covered by expiry
//!   + the engine's own GC).
//! - `inv_no_lock_leak_prompt` (C8), in the fault-free liveness phase, with
//!   the real fetch and its real transfer guard: a completed fetch leaves no
//!   lock behind after `RELEASE_GRACE`, far below the lock timeout; and a
//!   fetch cancelled mid-read while holding a lock (the cancel probe tries
//!   up to four cancel points until one lands with a lock held;
//!   `cancel_probe.inconclusive` counts runs where none did) leaves none
//!   either. Nothing is excused: a lock granted to a lock RPC whose fetch
//!   had already ended (deadline or cancel; seed 2742: a safety-phase
//!   fetch's lock RPC landed 2 ms after its fetch ended), which no fetch
//!   ever saw, is released by the RPC's own task (issue 31).
//! - `inv_no_early_free_*` (C11), each its own name: `_pool`, on every live
//!   node at every tick, the allocator's own invariants and
//!   `pool used bytes >= resident blocks × block bytes`; `_lease`, with lease pressure on, a
//!   leased block survives `evict(everything)`; `_load`, a leased block
//!   loads; `_checksum`, every checksum rejection in the run is explained
//!   by a corrupted payload sent (`rejected <= corrupt_sent`); `_resident`
//!   (above). Freed pool memory is poisoned in the simulator
//!   (`Pool::set_poison_freed`, a run-time switch the harness turns on), so
//!   a read or copy of freed or freed-and-reused memory yields the poison
//!   pattern and fails a checksum or a byte comparison.
//! - `inv_embedder_memory` (C15): at the end, on every live node, the engine
//!   refuses to unregister the device buffer the sim layout names, and the
//!   buffer is still readable.
//! - `inv_lock_released_once` (C8, issue 29), every fetch on every path:
//!   every transfer lock a fetch saw granted (trace event
//!   `kvferry::fetch_lock`) got exactly one `ReleaseTransferLock` from it
//!   (`kvferry::fetch_release`), on completion, error (after a partial
//!   read too), deadline and cancellation alike; excused only when the
//!   requester was killed or isolated after the grant. One case per lock.
//! - `inv_no_lock_expiry_after_fetch` (C8, issue 29), owner side: a lock
//!   that ended by expiry (`kvferry::transfer_expired`, no release found
//!   it first) although its fetch ended (`kvferry::fetch_end`) more than
//!   [`RELEASE_GRACE`] before it expired is a leak, unless either node was
//!   killed or isolated, or their link clogged, between the grant and one
//!   peer RPC deadline after the fetch's end.
//! - `inv_no_read_after_expiry` (C13/C16, issue 29): no data-plane read is
//!   authorized (`kvferry::data_access`, on the owner's engine clock) at
//!   or after its session's expiry (`expires_at_ms` of the grant event),
//!   nor after the session was released or collected. One case per
//!   authorization; reads that reached an owner between expiry and
//!   collection are counted (`c13_expired_reads`): the expiry mix (1 s
//!   locks, a lock GC every 1.5..3 s) and `slow_owner` holds put them there.
//! - `inv_device_read_under_lease` (C19, issue 28): every device-direct copy
//!   a reader submitted (`kvferry::device_read`, with its transfer
//!   session) ran under the device leases that session took
//!   (`kvferry::device_lease` "taken"): before each lease's deadline (its
//!   grant's `expires_at_ms`, in simulated time) and not after the lease
//!   was released or revoked. One case per device read.
//! - `inv_lease_ends_once` (C19): every lease an owner reported ended
//!   ([`kvferry::engine::Engine::ended_device_leases`], drained by the
//!   workload) was granted by that owner and ends once; one case per end.
//! - `inv_no_access_after_unregister` (C15, issue 29): the simulated GPU
//!   (`cluster::SimGpu`: the host backend with asynchronous copies on the
//!   churned buffers) saw no copy, read or write reach a buffer after its
//!   unregister answered `Ok`, and no `Ok` unregister while copies were in
//!   flight on it; one case per `Ok` unregister of the buffer churn.
//! - `inv_disk_staged_verified` (C17, issue 32): every block any node
//!   staged from its simulated disk tier into its pool (lookup, `load`, a
//!   fetch's local part, a peer's lock request; every incarnation; trace
//!   event `kvferry::disk_staged` with the CRC-32C of the staged bytes) has
//!   exactly the bytes its prefill saved (`fill_kv` recomputation). One
//!   case per staged block.
//! - `inv_disk_recovery_verified` (C18, issue 32): every record a restarted
//!   disk node's recovery found valid (`kvferry::disk_recovered`, with the
//!   CRC-32C of the payload on the medium) holds exactly the bytes that
//!   were saved; one case per record. The fetch half of C18 (a block
//!   advertised from disk is fetched or degrades in time) is
//!   `inv_degrade_bounded` over fetches that stage disk blocks at owners
//!   (`c18_peer_disk_staged` counts them). `inv_fetch_progress` is skipped
//!   (`inv_fetch_progress.skip.disk_record_failed_verify`) when a listed
//!   owner's disk record failed verification during the probe (a bit a disk
//!   fault flipped in the safety phase: the block is dropped, C17), and
//!   (`inv_fetch_progress.skip.disk_dropped_listed`) when staging for the
//!   probe pushed listed blocks out of an owner's small pool and disk (a
//!   victim refused at a full write-behind queue, a record the disk's LRU
//!   evicted: dropped and unregistered, seed 4021).
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
/// Slack over the fetch deadline: scheduling only. Every step of a fetch
/// ends by its one deadline instant (query, handshake, lock RPC, reads,
/// checksum pass, `fetch_into`'s load tail; the release is handed off), and
/// the simulator's clock is virtual — a CRC pass or a host copy takes no
/// simulated time — so what a fetch may run past its deadline is a copy
/// into the caller's KV submitted before the deadline, which is awaited
/// (C11; the simulated GPU runs a batch on a held buffer 1–3 ms after its
/// submission, `SimGpu`), and the fetching task being polled after its
/// timer fired (under 1 ms). Largest overrun seen: 3.9 ms over 2,000 seeds
/// (a `fetch_into` whose last load was submitted just before its
/// deadline); 10 ms leaves more than twice that.
pub const FETCH_SLACK: Duration = Duration::from_millis(10);
/// Slack over lock timeout + GC interval.
pub const LOCK_SLACK: Duration = Duration::from_secs(2);
/// How long a cancelled fetch may take to release its lock.
pub const RELEASE_GRACE: Duration = Duration::from_secs(1);

/// Bound of a whole fetch: its deadline plus [`FETCH_SLACK`]. Every step
/// of a fetch runs under the one deadline (issue 31); the slack covers the
/// scheduling of the fetching task. The sweep prints the largest overrun
/// seen (`c9_overrun_max_us`).
pub fn fetch_bound(p: &Params) -> Duration {
    p.fetch_deadline + FETCH_SLACK
}

/// Bound of one plain `client.flush()` that starts with `pending` commands
/// queued or in flight and `resident` blocks a backfill would re-advertise
/// (see the module doc): one MetaServer RPC deadline per RPC the flush can
/// wait on, i.e. for each of the two driver turns it may span (the batch in
/// flight, then its own), a heartbeat and the backfill's RPCs, plus up to
/// three RPCs (a chunk and its two bisection halves) per chunk of the
/// pending commands, each (namespace, op) group of each batch a chunk of
/// its own.
pub fn plain_flush_bound(p: &Params, pending: u64, resident: u64) -> Duration {
    let per = kvferry::limits::HASHES_PER_REQUEST_MAX as u64;
    let backfill = resident.div_ceil(per);
    let chunks = pending.div_ceil(per) + 2 * 2;
    let rpcs = 2 * (1 + backfill) + 3 * chunks;
    p.metaserver_rpc_timeout * rpcs as u32 + FLUSH_SLACK
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
    // With a disk tier, a victim the tier took keeps its registration, and
    // a record leaving the tier offers a removal of its own.
    let to_disk = ld(&m.evicted_to_disk);
    let (disk_enq, disk_door) =
        n.engine.disk_stats().map_or((0, 0), |d| (d.removals_enqueued, d.removals_dropped_at_enqueue));
    if evicted != enq + door + to_disk {
        bad.push(format!(
            "engine: evicted {evicted} != removals_enqueued {enq} + removals_dropped_at_enqueue {door} + evicted_to_disk {to_disk}"
        ));
    }
    if c.offered_removes != evicted - to_disk.min(evicted) + disk_enq + disk_door {
        bad.push(format!(
            "offered_removes {} != evicted {evicted} - evicted_to_disk {to_disk} + disk removals {disk_enq} + {disk_door}",
            c.offered_removes
        ));
    }
    if c.dropped_queue_full_removes != door + disk_door {
        bad.push(format!(
            "dropped_queue_full_removes {} != removals_dropped_at_enqueue {door} + disk {disk_door}",
            c.dropped_queue_full_removes
        ));
    }
    let (saved, fetched) = (ld(&m.saved_blocks), ld(&m.fetched_blocks));
    // A disk tier offers inserts of its own: the blocks recovery found at
    // start, and staged blocks whose record left the tier meanwhile.
    let disk_ins = n.engine.disk_stats().map_or(0, |d| d.recovered_advertised + d.readvertised);
    if c.offered_inserts > saved + fetched + disk_ins || (quiescent && c.offered_inserts != saved + fetched + disk_ins)
    {
        bad.push(format!(
            "offered_inserts {} != saved_blocks {saved} + fetched_blocks {fetched} + disk (recovered, re-advertised) {disk_ins}",
            c.offered_inserts
        ));
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

/// C9 for [`kvferry::engine::Engine::connect_peer`]: it returned within
/// its `timeout` (plus [`FETCH_SLACK`]), whether the peer was up, down or
/// cut off; a peer that does not answer is tried again only while time is
/// left.
pub fn inv_connect_bounded(node: usize, target: usize, elapsed: Duration, timeout: Duration) -> Result<(), Violation> {
    if elapsed <= timeout + FETCH_SLACK {
        COUNT.with(|c| c.borrow_mut().push("inv_connect_bounded"));
        return Ok(());
    }
    Err(violation(
        "inv_connect_bounded",
        format!("node{} connect_peer to node{} took {elapsed:?}, timeout {timeout:?}", node + 1, target + 1),
    ))
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

/// C8: no transfer lock on any live node. `name` is the half
/// (`inv_no_lock_leak_eventual` or `inv_no_lock_leak_prompt`), `what` says
/// which case was checked. Nothing is excused: a lock granted after its
/// fetch ended (an orphan grant) is released by the lock RPC's task
/// (`engine::fetch`'s `LateRelease`) like any other.
pub fn inv_no_lock_leak(
    shared: &Shared,
    name: &'static str,
    what: &str,
    locks: &[(usize, u64)],
) -> Result<(), Violation> {
    let held: Vec<String> =
        locks.iter().filter(|(_, n)| *n > 0).map(|(i, n)| format!("node{}: {n} session(s)", i + 1)).collect();
    if held.is_empty() {
        shared.checker.count(name, false);
        return Ok(());
    }
    Err(violation(name, format!("{what}: transfer locks still held: {}", held.join(", "))))
}

/// C11 (a): allocator consistency and cache memory allocated, on one node.
pub fn inv_no_early_free_pool(shared: &Shared, node: usize, n: &NodeSlot) -> Result<(), Violation> {
    n.engine.pool().check_invariants(); // panics on a corrupted allocator
    let g = n.engine.gauges();
    let block = shared.params.block_bytes().next_multiple_of(n.engine.pool().align());
    if g.pool_used_bytes < g.resident_blocks * block {
        return Err(violation(
            "inv_no_early_free_pool",
            format!(
                "node{}: pool used {} B < {} resident blocks × {block} B: cached memory was freed",
                node + 1,
                g.pool_used_bytes,
                g.resident_blocks
            ),
        ));
    }
    ok!(shared, "inv_no_early_free_pool")
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
            "inv_no_early_free_lease",
            format!(
                "node{} request {req}: {leased} leased blocks, {resident} still resident after evict(all), pool used {pool_used} B",
                node + 1
            ),
        ));
    }
    COUNT.with(|c| c.borrow_mut().push("inv_no_early_free_lease"));
    Ok(())
}

/// C11 (c): every checksum rejection in the run (dead incarnations
/// included) is explained by a corrupted payload a server actually sent:
/// `rejected <= corrupt_sent`. A rejection beyond that means a block's
/// bytes changed under a reader (its memory freed and reused, or poisoned
/// on free) or a seal recorded the wrong checksums.
pub fn inv_no_early_free_checksum(shared: &Shared, corrupt_sent: u64, rejected: u64) -> Result<(), Violation> {
    if rejected <= corrupt_sent {
        return ok!(shared, "inv_no_early_free_checksum");
    }
    Err(violation(
        "inv_no_early_free_checksum",
        format!(
            "{rejected} checksum rejection(s) but only {corrupt_sent} corrupted payload(s) sent: a locked block's memory changed under a reader"
        ),
    ))
}

/// C10: no block whose bytes differ from recomputation is resident on any
/// live node at the end of the run (checked block by block; counted once per
/// block checked) — so every corrupted payload that reached a fetcher was
/// rejected, whether or not the workload later loaded that block. `bad`
/// names the blocks that failed; `corrupt_sent` is how many corrupted
/// payloads servers sent in the run. Without any, a bad block is a C11
/// failure (memory freed or reused under a cached block), named
/// `inv_no_early_free_resident`.
pub fn inv_corruption_rejected(
    shared: &Shared,
    corrupt_sent: u64,
    checked: u64,
    bad: &[String],
) -> Result<(), Violation> {
    if bad.is_empty() {
        let name = if corrupt_sent > 0 { "inv_corruption_rejected" } else { "inv_no_early_free_resident" };
        for _ in 0..checked {
            shared.checker.count(name, false);
        }
        return Ok(());
    }
    let (name, why) = if corrupt_sent > 0 {
        ("inv_corruption_rejected", format!("{corrupt_sent} corrupted payload(s) were sent"))
    } else {
        ("inv_no_early_free_resident", "no corrupted payload was sent".to_string())
    };
    Err(violation(
        name,
        format!("{} of {checked} resident block(s) differ from recomputation ({why}): {}", bad.len(), bad.join(", ")),
    ))
}

/// C4 (index vs engine): after liveness, the MetaServer's entries for a live
/// node equal what that node's engine holds and has not removed, unless the
/// difference is explained by registrations the node counted as dropped
/// (`dropped`: its client's drops plus its door drops this incarnation).
pub fn inv_index_matches_engine(
    shared: &Shared,
    node: usize,
    at_store: &BTreeSet<BlockHash>,
    resident: &BTreeSet<BlockHash>,
    dropped: u64,
) -> Result<(), Violation> {
    let missing = resident.difference(at_store).count() as u64;
    let extra = at_store.difference(resident).count() as u64;
    if missing == 0 && extra == 0 {
        return ok!(shared, "inv_index_matches_engine");
    }
    if missing + extra <= dropped {
        return ok!(shared, "inv_index_matches_engine.explained_by_drops");
    }
    let short = |h: &BlockHash| hex::encode(&h.as_bytes()[..12]);
    Err(violation(
        "inv_index_matches_engine",
        format!(
            "node{}: {missing} resident block(s) not at the store, {extra} store entr(ies) not resident (e.g. {:?} / {:?}), only {dropped} registration(s) counted dropped",
            node + 1,
            resident.difference(at_store).next().map(short),
            at_store.difference(resident).next().map(short),
        ),
    ))
}

/// C15: the engine refuses to unregister the device buffer the sim layout
/// names (the embedder's memory stays registered and readable).
pub fn inv_embedder_memory(shared: &Shared, node: usize, n: &NodeSlot) -> Result<(), Violation> {
    use kvferry::gpu::Gpu as _;
    let refused = matches!(n.engine.unregister_buffer(n.buffer), Err(kvferry::engine::EngineError::BufferInUse { .. }));
    let mut probe = [0u8; 1];
    let readable = n.gpu.read(n.buffer, 0, &mut probe).is_ok();
    if refused && readable {
        return ok!(shared, "inv_embedder_memory");
    }
    Err(violation(
        "inv_embedder_memory",
        format!(
            "node{}: unregistering the device buffer a layout names was {} (buffer still readable: {readable})",
            node + 1,
            if refused { "refused" } else { "NOT refused" }
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

/// What the engines' trace events told about the run's transfer sessions:
/// every id granted (C16) and, per grant, what was requested, found and
/// pinned (C8).
#[derive(Default)]
struct Grants {
    ids: BTreeSet<String>,
    reused: Vec<String>,
    pins_checked: u64,
    pins_bad: Vec<String>,
    /// Every session's life, by id (issue 29: C8 release, C13 expiry).
    lives: BTreeMap<String, Life>,
    /// Data-plane authorizations seen (C13).
    accesses: u64,
    /// Authorizations that reached an owner under an expired session not
    /// yet collected by its GC (the window the C13 check is about).
    expired_reads: u64,
    /// Authorizations granted under an expired or released session.
    served_expired: Vec<String>,
    /// Device leases by id (C19): deadline and end, in simulated ms.
    leases: BTreeMap<String, (u64, Option<u64>)>,
    /// Leases each transfer session took.
    session_leases: BTreeMap<String, Vec<String>>,
    /// Device-direct copies seen, and those outside their leases.
    device_reads: u64,
    device_bad: Vec<String>,
}

/// One transfer session, from the engines' trace events. Times: `*_sim`
/// are simulated ms since the run started ([`now_ms`]); `*_ms` are on the
/// owner's engine clock.
#[derive(Default, Debug)]
struct Life {
    /// The owner's advertise address.
    owner: String,
    granted_sim: u64,
    granted_ms: u64,
    expires_at_ms: u64,
    /// The fetch that saw the grant (requester address) and when.
    requester: Option<String>,
    locked_sim: u64,
    /// When that fetch ended (returned or dropped).
    fetch_end_sim: Option<u64>,
    /// `ReleaseTransferLock`s the requester sent.
    releases_sent: u32,
    /// `ReleaseTransferLock`s the owner received.
    releases_received: u32,
    /// A release that found the session (it ended by release).
    released: bool,
    /// The GC expired it (it ended by expiry).
    expired_sim: Option<u64>,
}

/// Every transfer-session grant in a run, collected from the engines' trace
/// events (a `tracing` layer installed for the run's thread).
#[derive(Clone, Default)]
pub struct SessionGrants(Arc<Mutex<Grants>>);

impl SessionGrants {
    /// The `tracing` layer that records grants into `self`.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        use tracing_subscriber::Layer as _;
        let grants = self.clone();
        GrantLayer(grants).with_filter(tracing_subscriber::filter::filter_fn(|m| {
            [
                kvferry::engine::TRANSFER_SESSION_TRACE_TARGET,
                kvferry::engine::TRANSFER_PINS_TRACE_TARGET,
                kvferry::engine::TRANSFER_RELEASE_TRACE_TARGET,
                kvferry::engine::TRANSFER_EXPIRED_TRACE_TARGET,
                kvferry::engine::DATA_ACCESS_TRACE_TARGET,
                kvferry::engine::fetch::FETCH_LOCK_TRACE_TARGET,
                kvferry::engine::fetch::FETCH_RELEASE_TRACE_TARGET,
                kvferry::engine::fetch::FETCH_END_TRACE_TARGET,
                kvferry::engine::device::DEVICE_LEASE_TRACE_TARGET,
                kvferry::engine::device::DEVICE_READ_TRACE_TARGET,
            ]
            .contains(&m.target())
        }))
    }
}

struct GrantLayer(SessionGrants);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for GrantLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields(BTreeMap<&'static str, String>);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                self.0.insert(f.name(), format!("{v:?}"));
            }
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                self.0.insert(f.name(), v.to_string());
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut g = (self.0).0.lock().expect("grants");
        let target = event.metadata().target();
        if target != kvferry::engine::TRANSFER_SESSION_TRACE_TARGET
            && target != kvferry::engine::TRANSFER_PINS_TRACE_TARGET
        {
            life_event(&mut g, target, &fields.0);
            return;
        }
        if target == kvferry::engine::TRANSFER_PINS_TRACE_TARGET {
            let list = |k: &str| -> Vec<String> {
                fields
                    .0
                    .get(k)
                    .map(|v| v.split(',').filter(|x| !x.is_empty()).map(str::to_string).collect())
                    .unwrap_or_default()
            };
            let (requested, found, pinned) = (list("requested"), list("found"), list("pinned"));
            g.pins_checked += 1;
            if let Some(bad) = pins_mismatch(&requested, &found, &pinned) {
                let session = fields.0.get("session").cloned().unwrap_or_default();
                g.pins_bad.push(format!("session {session}: {bad}"));
            }
            return;
        }
        if let Some(id) = fields.0.remove("session") {
            let num = |k: &str| fields.0.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let life = Life {
                owner: fields.0.get("owner").cloned().unwrap_or_default(),
                granted_sim: now_ms(),
                granted_ms: num("now_ms"),
                expires_at_ms: num("expires_at_ms"),
                ..Life::default()
            };
            g.lives.insert(id.clone(), life);
            if !g.ids.insert(id.clone()) {
                g.reused.push(id);
            }
        }
    }
}

/// Folds one session-life event (every target but the grant and pins) into
/// `g`. Authorizations are judged here, as they happen (C13).
fn life_event(g: &mut Grants, target: &str, f: &BTreeMap<&'static str, String>) {
    let num = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let now = now_ms();
    if target == kvferry::engine::device::DEVICE_LEASE_TRACE_TARGET
        || target == kvferry::engine::device::DEVICE_READ_TRACE_TARGET
    {
        lease_event(g, target, f, now, num("now_ms"), num("expires_at_ms"));
        return;
    }
    if target == kvferry::engine::fetch::FETCH_END_TRACE_TARGET {
        for s in f.get("sessions").map(String::as_str).unwrap_or("").split(',').filter(|s| !s.is_empty()) {
            if let Some(l) = g.lives.get_mut(s) {
                l.fetch_end_sim.get_or_insert(now);
            }
        }
        return;
    }
    let Some(session) = f.get("session").cloned() else { return };
    let Some(l) = g.lives.get_mut(&session) else { return };
    match target {
        kvferry::engine::fetch::FETCH_LOCK_TRACE_TARGET => {
            l.requester = f.get("me").cloned();
            l.locked_sim = now;
        }
        kvferry::engine::fetch::FETCH_RELEASE_TRACE_TARGET => l.releases_sent += 1,
        kvferry::engine::TRANSFER_RELEASE_TRACE_TARGET => {
            l.releases_received += 1;
            l.released |= l.expired_sim.is_none() && num("released") > 0;
        }
        kvferry::engine::TRANSFER_EXPIRED_TRACE_TARGET => l.expired_sim = Some(now),
        kvferry::engine::DATA_ACCESS_TRACE_TARGET => {
            let at = num("now_ms");
            let ok = f.get("ok").is_some_and(|v| v == "true");
            let expired = at >= l.expires_at_ms;
            g.accesses += 1;
            if expired && l.expired_sim.is_none() && !l.released {
                g.expired_reads += 1;
            }
            if ok && (expired || l.released || l.expired_sim.is_some()) {
                let why = if expired {
                    format!(
                        "{} ms past its expiry (granted at {} ms, expires at {} ms)",
                        at - l.expires_at_ms,
                        l.granted_ms,
                        l.expires_at_ms
                    )
                } else {
                    "after it was released or collected".to_string()
                };
                g.served_expired
                    .push(format!("owner {} served a read under session {session} at {at} ms: {why}", l.owner));
            }
        }
        _ => {}
    }
}

/// Folds one C19 event into `g`; judges device reads as they happen.
fn lease_event(g: &mut Grants, target: &str, f: &BTreeMap<&'static str, String>, now: u64, at_ms: u64, until_ms: u64) {
    let list = |k: &str| -> Vec<String> {
        f.get(k).map(|v| v.split(',').filter(|x| !x.is_empty()).map(str::to_string).collect()).unwrap_or_default()
    };
    let session = f.get("session").cloned().unwrap_or_default();
    if target == kvferry::engine::device::DEVICE_READ_TRACE_TARGET {
        g.device_reads += 1;
        let leases = g.session_leases.get(&session).cloned().unwrap_or_default();
        if leases.is_empty() {
            g.device_bad.push(format!("device read at {now} ms under session {session}, which took no lease"));
        }
        for l in leases {
            match g.leases.get(&l) {
                Some(&(deadline, ended)) if now < deadline && ended.is_none_or(|e| now <= e) => {}
                Some(&(deadline, ended)) => g.device_bad.push(format!(
                    "device read at {now} ms under session {session}: lease {l} ends at {deadline} ms, ended {ended:?}"
                )),
                None => g.device_bad.push(format!("device read under unknown lease {l}")),
            }
        }
        return;
    }
    let message = f.get("message").map(String::as_str).unwrap_or("");
    if let Some(id) = f.get("lease") {
        g.leases.insert(id.clone(), (now + until_ms.saturating_sub(at_ms), None));
    } else if message == "taken" {
        g.session_leases.entry(session).or_default().extend(list("leases"));
    } else if message == "released" {
        for l in g.session_leases.get(&session).cloned().unwrap_or_default() {
            if let Some(e) = g.leases.get_mut(&l) {
                e.1.get_or_insert(now);
            }
        }
    } else if message == "revoked" {
        for l in list("leases") {
            if let Some(e) = g.leases.get_mut(&l) {
                e.1.get_or_insert(now);
            }
        }
    }
}

/// C19 (issue 28): no device-direct copy outside the leases its session
/// took; one case per device read. Returns the reads seen.
pub fn inv_device_read_under_lease(shared: &Shared, grants: &SessionGrants) -> (Result<(), Violation>, u64) {
    let g = grants.0.lock().expect("grants");
    if let Some(first) = g.device_bad.first() {
        let v = violation(
            "inv_device_read_under_lease",
            format!("{} bad device read(s); first: {first}", g.device_bad.len()),
        );
        return (Err(v), g.device_reads);
    }
    for _ in 0..g.device_reads {
        shared.checker.count("inv_device_read_under_lease", false);
    }
    (Ok(()), g.device_reads)
}

/// C19: each lease end an owner reported names a lease that owner granted
/// and was not reported before (`granted`: lease ids per node; `ended`:
/// ids drained so far per node). One case per end.
pub fn inv_lease_ends_once(
    node: usize,
    granted: &BTreeSet<String>,
    ended: &mut BTreeSet<String>,
    now_ended: &[String],
) -> Result<(), Violation> {
    for id in now_ended {
        if !granted.contains(id) || !ended.insert(id.clone()) {
            return Err(violation(
                "inv_lease_ends_once",
                format!("node{}: lease {id} reported ended twice or never granted", node + 1),
            ));
        }
    }
    Ok(())
}

/// Node index of an advertise address of the address plan (`10.0.1.i:port`).
fn node_of(addr: &str) -> Option<usize> {
    let ip = addr.split(':').next()?;
    let last: usize = ip.rsplit('.').next()?.parse().ok()?;
    ip.starts_with("10.0.1.").then(|| last.checked_sub(1)).flatten()
}

/// C13/C16 (issue 29): no data-plane read was authorized under a session
/// whose lock had expired (even if not yet collected) or was released; one
/// case per authorization seen. Also returns how many authorizations
/// reached an owner in the window between expiry and collection.
pub fn inv_no_read_after_expiry(shared: &Shared, grants: &SessionGrants) -> (Result<(), Violation>, u64) {
    let g = grants.0.lock().expect("grants");
    if let Some(first) = g.served_expired.first() {
        let v = violation(
            "inv_no_read_after_expiry",
            format!(
                "{} read(s) authorized under an expired or released session; first: {first}",
                g.served_expired.len()
            ),
        );
        return (Err(v), g.expired_reads);
    }
    for _ in 0..g.accesses {
        shared.checker.count("inv_no_read_after_expiry", false);
    }
    (Ok(()), g.expired_reads)
}

/// C8 (issue 29), requester side, every fetch on every path: each lock a
/// fetch saw granted got exactly one `ReleaseTransferLock` from it, unless
/// the requester was killed or cut off after the grant (its release task
/// died with it). One case per lock.
pub fn inv_lock_released_once(shared: &Shared, grants: &SessionGrants) -> Result<(), Violation> {
    let g = grants.0.lock().expect("grants");
    let mut bad = Vec::new();
    for (id, l) in &g.lives {
        let Some(req) = &l.requester else { continue };
        let excused = node_of(req).is_none_or(|r| shared.down_since(r, l.locked_sim));
        if l.releases_sent == 1 || (l.releases_sent == 0 && excused) {
            shared.checker.count("inv_lock_released_once", false);
            continue;
        }
        bad.push(format!(
            "fetch on {req} was granted session {} by {} at {} ms, ended at {:?} ms and sent {} release(s)",
            &id[..id.len().min(40)],
            l.owner,
            l.locked_sim,
            l.fetch_end_sim,
            l.releases_sent
        ));
    }
    if bad.is_empty() {
        return Ok(());
    }
    Err(violation("inv_lock_released_once", format!("{} lock(s); first: {}", bad.len(), bad[0])))
}

/// C8 (issue 29), owner side: a lock that ended by expiry although the
/// fetch it was granted to ended more than [`RELEASE_GRACE`] before it
/// expired is a leak — unless the release could not get through (either
/// node killed or isolated, or their link clogged, from the fetch's end for
/// one peer RPC deadline). One case per lock whose fetch ended.
pub fn inv_no_lock_expiry_after_fetch(shared: &Shared, grants: &SessionGrants) -> Result<(), Violation> {
    let g = grants.0.lock().expect("grants");
    let rpc = shared.params.peer_rpc_timeout.as_millis() as u64 + 200;
    let mut bad = Vec::new();
    for (id, l) in &g.lives {
        let (Some(req), Some(end)) = (&l.requester, l.fetch_end_sim) else { continue };
        let expiry_sim = l.granted_sim + l.expires_at_ms.saturating_sub(l.granted_ms);
        let leaked = l.expired_sim.is_some() && !l.released;
        if leaked && end + (RELEASE_GRACE.as_millis() as u64) < expiry_sim {
            let cut = match (node_of(req), node_of(&l.owner)) {
                (Some(r), Some(o)) => shared.cut(r, o, l.locked_sim, end + rpc),
                _ => true,
            };
            if !cut {
                bad.push(format!(
                    "session {} granted by {} to a fetch on {req} at {} ms; the fetch ended at {end} ms, the lock expired at {expiry_sim} ms (collected at {:?} ms) with {} release(s) received",
                    &id[..id.len().min(40)],
                    l.owner,
                    l.locked_sim,
                    l.expired_sim,
                    l.releases_received
                ));
                continue;
            }
        }
        shared.checker.count("inv_no_lock_expiry_after_fetch", false);
    }
    if bad.is_empty() {
        return Ok(());
    }
    Err(violation("inv_no_lock_expiry_after_fetch", format!("{} lock(s); first: {}", bad.len(), bad[0])))
}

/// C15 (issue 29): no simulated GPU saw an access to a buffer after its
/// unregister answered `Ok`, nor an `Ok` unregister while its copies were
/// in flight (see `cluster::SimGpu`); one case per `Ok` unregister.
pub fn inv_no_access_after_unregister(shared: &Shared) -> Result<(), Violation> {
    let w = &shared.gpu_watch;
    let v = w.violations.lock().expect("violations");
    if let Some(first) = v.first() {
        return Err(violation("inv_no_access_after_unregister", format!("{} access(es); first: {first}", v.len())));
    }
    for _ in 0..w.unregisters_ok.load(Ordering::SeqCst) {
        shared.checker.count("inv_no_access_after_unregister", false);
    }
    Ok(())
}

/// Why a grant's pins are not exactly its found blocks (None when they
/// are): the found blocks must be requested blocks in request order, and the
/// lock table must pin each found block exactly once and nothing else.
fn pins_mismatch(requested: &[String], found: &[String], pinned: &[String]) -> Option<String> {
    let mut rest = requested.iter();
    if !found.iter().all(|f| rest.any(|r| r == f)) {
        return Some(format!("found {found:?} is not a subsequence of requested {requested:?}"));
    }
    let (mut f, mut p) = (found.to_vec(), pinned.to_vec());
    f.sort();
    p.sort();
    (f != p).then(|| format!("pinned {pinned:?} but found {found:?}"))
}

/// C16: no transfer-session id was granted twice in the run (module doc).
pub fn inv_session_ids_unique(shared: &Shared, grants: &SessionGrants) -> Result<(), Violation> {
    let g = grants.0.lock().expect("grants");
    if let Some(id) = g.reused.first() {
        return Err(violation(
            "inv_session_ids_unique",
            format!("{} of {} grants reused an id, first {id}", g.reused.len(), g.ids.len() + g.reused.len()),
        ));
    }
    for _ in 0..g.ids.len() {
        shared.checker.count("inv_session_ids_unique", false);
    }
    Ok(())
}

/// C8: every `QueryBlocksForTransfer` grant in the run pinned exactly the
/// blocks it found (owner side: the request's hashes, the resident ones
/// among them, and what the lock table then held for the session).
pub fn inv_pins_exact(shared: &Shared, grants: &SessionGrants) -> Result<(), Violation> {
    let g = grants.0.lock().expect("grants");
    if let Some(first) = g.pins_bad.first() {
        return Err(violation(
            "inv_pins_exact",
            format!(
                "{} of {} grants did not pin exactly the found blocks; first: {first}",
                g.pins_bad.len(),
                g.pins_checked
            ),
        ));
    }
    for _ in 0..g.pins_checked {
        shared.checker.count("inv_pins_exact", false);
    }
    Ok(())
}

/// What the disk tiers told about the run (issue 32), from the trace
/// events the production code emits: every block staged from disk into a
/// pool (`kvferry::disk_staged`, C17) and every record recovery found
/// valid on a node's restart (`kvferry::disk_recovered`, C18), each with
/// the CRC-32C of its bytes. Judged at the end against recomputation
/// ([`inv_disk_staged_verified`], [`inv_disk_recovery_verified`]).
#[derive(Clone, Default)]
pub struct DiskWatch(Arc<Mutex<DiskSeen>>);

/// One disk event: `(namespace, hash hex, payload crc, node or "")`.
type DiskSeenBlock = (String, String, u32, String);

#[derive(Default)]
struct DiskSeen {
    staged: Vec<DiskSeenBlock>,
    recovered: Vec<DiskSeenBlock>,
}

impl DiskWatch {
    /// The `tracing` layer that records the disk events into `self`.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        use tracing_subscriber::Layer as _;
        DiskLayer(self.clone()).with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target() == kvferry::engine::DISK_STAGED_TRACE_TARGET
                || m.target() == kvferry::disk::tier::DISK_RECOVERED_TRACE_TARGET
        }))
    }

    /// `(blocks staged from disk, records recovered)` seen so far.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.0.lock().expect("disk watch");
        (s.staged.len() as u64, s.recovered.len() as u64)
    }
}

struct DiskLayer(DiskWatch);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for DiskLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields(BTreeMap<&'static str, String>);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                self.0.insert(f.name(), format!("{v:?}"));
            }
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                self.0.insert(f.name(), v.to_string());
            }
        }
        let mut f = Fields::default();
        event.record(&mut f);
        let get = |k: &str| f.0.get(k).cloned().unwrap_or_default();
        let crc = get("payload_crc").parse::<u32>().unwrap_or(0);
        let seen = (get("namespace"), get("hash"), crc, get("node"));
        let mut w = (self.0).0.lock().expect("disk watch");
        if event.metadata().target() == kvferry::engine::DISK_STAGED_TRACE_TARGET {
            w.staged.push(seen);
        } else {
            w.recovered.push(seen);
        }
    }
}

/// The CRC-32C of block `hash_hex`'s bytes in namespace `ns` as its
/// prefill saved them (recomputation: `fill_kv` per layer and segment,
/// slots in layer order, K then V, as the pool holds them); `None` for a
/// hash that does not parse.
fn saved_crc(layers: &[kvferry::engine::layout::LayerLayout], ns: &str, hash_hex: &str) -> Option<u32> {
    let hash = BlockHash::new(hex::decode(hash_hex).ok()?);
    let mut buf = vec![0u8; crate::workload::segment_bytes() as usize];
    let mut crc = 0u32;
    for (l, ly) in layers.iter().enumerate() {
        for s in 0..ly.segments() {
            kvferry::replay::trace::fill_kv(ns, &hash, l as u32, u32::from(s), &mut buf);
            crc = crc32c::crc32c_append(crc, &buf);
        }
    }
    Some(crc)
}

/// Judges `blocks` against recomputation; returns the bad ones, described.
fn disk_bad(layers: &[kvferry::engine::layout::LayerLayout], blocks: &[DiskSeenBlock]) -> Vec<String> {
    let mut memo: BTreeMap<(String, String), Option<u32>> = BTreeMap::new();
    blocks
        .iter()
        .filter(|(ns, h, crc, _)| {
            let want = *memo.entry((ns.clone(), h.clone())).or_insert_with(|| saved_crc(layers, ns, h));
            want != Some(*crc)
        })
        .map(|(ns, h, crc, node)| format!("{node} {ns}/{} (payload crc {crc:08x})", &h[..h.len().min(24)]))
        .collect()
}

/// C17 (issue 32): every block any node staged from its disk tier into its
/// pool — for a local lookup, `load`, a fetch's local part or a peer's
/// transfer-lock request, every incarnation — has exactly the bytes its
/// prefill saved (the CRC-32C of the staged bytes equals recomputation).
/// One case per staged block. `layers`: the sim layout (every node's
/// family is the same).
pub fn inv_disk_staged_verified(
    shared: &Shared,
    watch: &DiskWatch,
    layers: &[kvferry::engine::layout::LayerLayout],
) -> Result<(), Violation> {
    let staged = watch.0.lock().expect("disk watch").staged.clone();
    disk_saved_bytes(shared, "inv_disk_staged_verified", "block(s) staged from disk into a pool", layers, &staged)
}

/// C18 (issue 32): every record a restarted node's recovery found valid
/// (what it re-advertises; older generations of a key are dropped after
/// the scan, and are judged too) holds exactly the bytes that were saved
/// for its block. One case per record.
pub fn inv_disk_recovery_verified(
    shared: &Shared,
    watch: &DiskWatch,
    layers: &[kvferry::engine::layout::LayerLayout],
) -> Result<(), Violation> {
    let recovered = watch.0.lock().expect("disk watch").recovered.clone();
    disk_saved_bytes(
        shared,
        "inv_disk_recovery_verified",
        "record(s) recovery kept after a restart",
        layers,
        &recovered,
    )
}

/// The check of C17 and C18 alike: every one of `seen` (blocks named `what`)
/// holds the bytes its prefill saved; one case of `name` per block.
fn disk_saved_bytes(
    shared: &Shared,
    name: &'static str,
    what: &str,
    layers: &[kvferry::engine::layout::LayerLayout],
    seen: &[DiskSeenBlock],
) -> Result<(), Violation> {
    let bad = disk_bad(layers, seen);
    if bad.is_empty() {
        for _ in 0..seen.len() {
            shared.checker.count(name, false);
        }
        return Ok(());
    }
    Err(violation(
        name,
        format!(
            "{} of {} {what} differ from what was saved: {}",
            bad.len(),
            seen.len(),
            bad.iter().take(8).cloned().collect::<Vec<_>>().join(", ")
        ),
    ))
}
