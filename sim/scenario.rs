//! The main scenario: seed → printed fault plan → safety phase (workload
//! under faults, invariants checked as it runs) → liveness phase (every
//! fault healed, nothing injected; the system must converge within bounds
//! of simulated time, or the run says which invariant did not and why).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvferry::transport::sim;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use crate::cluster::{Cluster, DECODE, NODES, PREFILL, Params, Shared};
use crate::faults::{self, Kind, Plan, Tally};
use crate::invariants::{self, Checker, Violation};
use crate::workload::{self, NAMESPACE, Request, WorkloadKnobs};

/// Length of the safety phase (simulated).
pub const SAFETY: Duration = Duration::from_secs(20);
/// Requests arrive within this span of the safety phase.
pub const ARRIVAL_SPAN_MS: u64 = 14_000;
/// Bound on the whole run (simulated); beyond it the run is a failure.
pub const RUN_LIMIT: Duration = Duration::from_secs(300);

/// What a passing run reports.
#[derive(Debug, Default)]
pub struct Summary {
    /// Requests that completed prefill and decode.
    pub requests_done: usize,
    /// Requests lost to a crash (prefill or decode node killed mid-request,
    /// or no live node of the role).
    pub requests_lost: usize,
    /// Blocks prefill nodes reused (local or fetched prefix).
    pub reused: usize,
    /// Blocks prefill nodes computed and saved.
    pub saved: usize,
    /// Blocks fetched by decode nodes.
    pub fetched: usize,
    /// Blocks verified byte by byte by decode nodes.
    pub verified: usize,
    /// Blocks recomputed by decode nodes.
    pub recomputed: usize,
    /// Faults per kind: (applied, skipped).
    pub faults: BTreeMap<&'static str, (u64, u64)>,
    /// Checks per invariant: (passed, failed).
    pub checks: BTreeMap<&'static str, (u64, u64)>,
    /// Whether the liveness phase had to restart the MetaServer to force a
    /// backfill (registrations were lost during the safety phase).
    pub repair_restart: bool,
    /// Whether the cancel probe held a lock when it was cancelled.
    pub probe_conclusive: bool,
    /// C10 bookkeeping: corruptions armed, sent (reached the wire), lost
    /// with a killed server, disarmed unsent by the heal; checksum
    /// rejections; extents poisoned on free (C11).
    pub corruption: (u64, u64, u64, u64, u64),
    /// Extents poisoned on free over the run (C11).
    pub poisoned_frees: u64,
    /// Issue 29's reach counters: fetches that sealed blocks and then
    /// stopped on a transport error (C8); fetches that ended on their
    /// deadline (C9); reads that reached an owner under an expired,
    /// not yet collected session (C13); buffer unregisters answered `Ok`
    /// and refused busy, and copy batches held in flight (C15).
    pub reach: Reach,
}

/// See [`Summary::reach`].
#[derive(Debug, Default)]
pub struct Reach {
    pub partial_read_errors: u64,
    pub deadline_fetches: u64,
    /// `fetch_into`s started from the decode's own MetaServer answer.
    pub known_owner_fetches: u64,
    /// Decode fetches that read from the prefill's transfer ticket.
    pub ticket_fetches: u64,
    /// `Engine::connect_peer` calls: connected, ended on their timeout,
    /// failed otherwise (C9's bound holds for each).
    pub connects: (u64, u64, u64),
    /// The longest any fetch ran past its deadline (µs).
    pub overrun_max_us: u64,
    pub expired_reads: u64,
    pub unregisters: u64,
    pub busy_refusals: u64,
    pub held_batches: u64,
    /// C19: device leases granted, their ends drained, device-direct reads.
    pub lease_grants: u64,
    pub lease_ends: u64,
    pub device_reads: u64,
    /// Issue 32: disk nodes; blocks staged from disk (C17's cases) and
    /// records recovered at restarts (C18's), from the trace events; the
    /// disk tiers' counters.
    pub disk_nodes: u64,
    pub disk_staged: u64,
    pub disk_recovered: u64,
    pub disk: crate::cluster::DiskTotals,
}

/// A failed run.
#[derive(Debug)]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// Every violation, in order.
    pub violations: Vec<Violation>,
}

/// Log timestamps in simulated time since the run started.
struct SimTime;

impl tracing_subscriber::fmt::time::FormatTime for SimTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        write!(w, "{:>9.3}s", invariants::now_ms() as f64 / 1000.0)
    }
}

/// Feature flags of this build, for the replay command.
fn features() -> String {
    let on: Vec<&str> =
        [("canaries", cfg!(feature = "canaries"))].into_iter().filter_map(|(name, on)| on.then_some(name)).collect();
    if on.is_empty() { String::new() } else { format!(" --features {}", on.join(",")) }
}

/// The one command that replays `seed` (run from the repository root): the
/// main scenario, or, while a canary is switched on, that canary's test on
/// this seed alone.
pub fn replay_command(seed: u64) -> String {
    if let Some(c) = kvferry::canary::Canary::ALL.into_iter().find(|&c| kvferry::canary::active(c)) {
        let test = format!("broken_{}_is_caught", format!("{c:?}").to_lowercase());
        return format!(
            "SIM_CANARY_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target-sim cargo test --test sim{} -- {test} --exact --nocapture",
            features()
        );
    }
    format!(
        "MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target-sim cargo test --test sim{} -- main_scenario --exact --nocapture",
        features()
    )
}

/// Runs the scenario on the current madsim runtime (its seed drives
/// everything). Prints the seed, the plan and the replay command first.
pub async fn run() -> Result<Summary, Failure> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    // The run's own subscriber (this thread runs the whole simulation): the
    // session-grant collector (C16), plus library logs when SIM_LOG is set
    // (e.g. SIM_LOG=kvferry=debug), stamped with simulated time.
    let grants = invariants::SessionGrants::default();
    let disk_watch = invariants::DiskWatch::default();
    let logs = std::env::var("SIM_LOG").ok().map(|filter| {
        tracing_subscriber::fmt::layer()
            .with_timer(SimTime)
            .with_ansi(false)
            .with_filter(tracing_subscriber::EnvFilter::new(filter))
    });
    let _trace = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(grants.layer()).with(disk_watch.layer()).with(logs),
    );
    let seed = madsim::runtime::Handle::current().seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // The swarm density has its own stream: normal-density seeds draw the
    // plan and workload they drew before densities existed.
    let mut swarm = StdRng::seed_from_u64(seed ^ 0x5A4A_4D00_D315_1717);
    // Issue 29's mix has a third stream, for the same reason.
    let mut extra = StdRng::seed_from_u64(seed ^ 0x0029_C8C9_C13C_1500);
    // Issue 32's disk tier has a fourth stream, for the same reason.
    let mut disk = StdRng::seed_from_u64(seed ^ 0x0032_D15C_0017_0018);
    let plan = Plan::draw(&mut rng, &mut swarm, &mut extra, &mut disk);
    let requests = workload::generate(&mut rng, ARRIVAL_SPAN_MS);
    let blocks: usize = requests.iter().map(|r| r.hashes.len()).sum();
    println!("=== kvferry sim: seed {seed}");
    println!("replay: {}", replay_command(seed));
    print!("{plan}");
    println!(
        "workload: {} requests, {blocks} blocks of {} B, {PREFILL} prefill + {DECODE} decode nodes",
        requests.len(),
        workload::block_bytes()
    );
    let r = tokio::time::timeout(RUN_LIMIT, run_plan(seed, &plan, requests, &grants, &disk_watch)).await;
    let (summary, violations) = match r {
        Ok(v) => v,
        Err(_) => (
            Summary::default(),
            vec![invariants::violation("run_limit", format!("scenario did not finish within {RUN_LIMIT:?}"))],
        ),
    };
    if violations.is_empty() {
        println!("{}", summary_line(seed, &summary));
        Ok(summary)
    } else {
        println!("=== FAILED seed {seed}: {} violation(s)", violations.len());
        for v in &violations {
            println!("  {v}");
        }
        println!("replay: {}", replay_command(seed));
        Err(Failure { seed, violations })
    }
}

/// One machine-readable line per passing seed (aggregated by scripts/sim.sh).
fn summary_line(seed: u64, s: &Summary) -> String {
    let mut out = format!(
        "SIM-SUMMARY seed={seed} done={} lost={} reused={} saved={} fetched={} verified={} recomputed={} repair_restart={} probe={}",
        s.requests_done,
        s.requests_lost,
        s.reused,
        s.saved,
        s.fetched,
        s.verified,
        s.recomputed,
        s.repair_restart,
        s.probe_conclusive
    );
    let (armed, sent, lost, disarmed, rejected) = s.corruption;
    let _ = write!(
        out,
        " corrupt_armed={armed} corrupt_sent={sent} corrupt_lost={lost} corrupt_disarmed={disarmed} checksum_rejected={rejected} poisoned_frees={}",
        s.poisoned_frees
    );
    let r = &s.reach;
    let _ = write!(
        out,
        " c8_partial_read_errors={} c9_deadline_fetches={} c9_known_owner_fetches={} c8_ticket_fetches={} c9_overrun_max_us={} c9_connects_ok={} c9_connects_deadline={} c9_connects_failed={} c13_expired_reads={} c15_unregisters={} c15_busy_refusals={} c15_held_batches={} c19_lease_grants={} c19_lease_ends={} c19_device_reads={}",
        r.partial_read_errors,
        r.deadline_fetches,
        r.known_owner_fetches,
        r.ticket_fetches,
        r.overrun_max_us,
        r.connects.0,
        r.connects.1,
        r.connects.2,
        r.expired_reads,
        r.unregisters,
        r.busy_refusals,
        r.held_batches,
        r.lease_grants,
        r.lease_ends,
        r.device_reads
    );
    let d = &r.disk;
    let _ = write!(
        out,
        " c17_disk_staged={} c18_disk_recovered={} c18_peer_disk_staged={} disk_nodes={} disk_to_disk={} disk_evicted_ahead={} disk_written={} disk_write_refused={} disk_queue_full={} disk_write_failed={} disk_read_failed={} disk_verify_failures={} disk_evicted={} disk_stage_failures={} disk_stage_timeouts={} disk_recovered_advertised={} disk_stale={} disk_queue_reads={} disk_after_write_reads={}",
        r.disk_staged,
        r.disk_recovered,
        d.peer_staged,
        r.disk_nodes,
        d.evicted_to_disk,
        d.evicted_ahead,
        d.written,
        d.write_refused,
        d.write_queue_full,
        d.write_failed,
        d.read_failed,
        d.verify_failures,
        d.evicted,
        d.stage_failures,
        d.stage_timeouts,
        d.recovered,
        d.stale,
        d.queue_reads,
        d.after_write_reads
    );
    out.push_str(" faults=");
    let f: Vec<String> = s.faults.iter().map(|(k, (a, sk))| format!("{k}:{a}:{sk}")).collect();
    out.push_str(&f.join(","));
    out.push_str(" checks=");
    let c: Vec<String> = s.checks.iter().map(|(k, (p, _))| format!("{k}:{p}")).collect();
    out.push_str(&c.join(","));
    out
}

fn params(seed: u64, plan: &Plan) -> Params {
    Params {
        seed,
        // A disk seed always runs small pools, so eviction to disk and
        // staging back from it happen.
        pool_bytes: if plan.small_pool || plan.disk.is_some() {
            24 * workload::block_bytes()
        } else {
            256 * workload::block_bytes()
        },
        layer_first: plan.layer_first,
        fetch_deadline: Duration::from_secs(3),
        peer_rpc_timeout: Duration::from_secs(1),
        metaserver_rpc_timeout: Duration::from_secs(1),
        lock_timeout_secs: plan.lock_timeout_secs,
        lock_gc_interval: Duration::from_millis(plan.lock_gc_ms),
        stale_after_secs: 4,
        ttl_secs: 12,
        sweep_interval_secs: 2,
        device_blocks: ((workload::REQUESTS_MAX + 1) * workload::BLOCKS_PER_REQUEST_MAX) as u64,
        disk: plan.disk.clone(),
    }
}

#[derive(Default)]
struct Outcome {
    done: bool,
    reused: usize,
    saved: usize,
    fetched: usize,
    verified: usize,
    recomputed: usize,
}

/// First live node of `role` starting at the preferred one.
fn pick(c: &Cluster, preferred: usize, role: std::ops::Range<usize>) -> Option<usize> {
    let len = role.len();
    (0..len)
        .map(|k| role.start + (preferred - role.start + k) % len)
        .find(|&i| c.node_up(i) && c.shared.node(i).is_some())
}

async fn drive(c: Arc<Cluster>, req: Request, knobs: WorkloadKnobs, start: Instant) -> Outcome {
    tokio::time::sleep_until(start + Duration::from_millis(req.arrival_ms)).await;
    let Some(p) = pick(&c, req.prefill, 0..PREFILL) else { return Outcome::default() };
    let Some(slot) = c.shared.node(p) else { return Outcome::default() };
    let Ok(pre) = c.spawn_on(p, workload::prefill(c.shared.clone(), slot, p, req.clone(), knobs)).await else {
        return Outcome::default(); // prefill node crashed mid-request
    };
    let Some(d) = pick(&c, req.decode, PREFILL..NODES) else { return Outcome::default() };
    let Some(slot) = c.shared.node(d) else { return Outcome::default() };
    // With device leases on, every other request's "KV ready" carries a
    // transfer ticket for the decode node, granted on the prefill node.
    let ticket = match c.shared.node(p) {
        Some(ps) if knobs.device_leases && req.id.is_multiple_of(2) => {
            let ask = slot.engine.transfer_ask();
            c.spawn_on(p, workload::grant_ticket(ps, req.clone(), ask)).await.ok().flatten()
        }
        _ => None,
    };
    match c.spawn_on(d, workload::decode(c.shared.clone(), slot, d, p, req, knobs, ticket)).await {
        Ok(o) => Outcome {
            done: true,
            reused: pre.reused,
            saved: pre.saved,
            fetched: o.fetched,
            verified: o.verified,
            recomputed: o.recomputed,
        },
        Err(_) => Outcome { reused: pre.reused, saved: pre.saved, ..Outcome::default() },
    }
}

async fn run_plan(
    seed: u64,
    plan: &Plan,
    requests: Vec<Request>,
    grants: &invariants::SessionGrants,
    disk_watch: &invariants::DiskWatch,
) -> (Summary, Vec<Violation>) {
    invariants::set_origin();
    let cluster = Arc::new(Cluster::boot(params(seed, plan), Checker::default()).await);
    let shared = cluster.shared.clone();
    tokio::time::sleep(Duration::from_secs(1)).await; // first heartbeats
    let knobs = WorkloadKnobs {
        lease_pressure: plan.lease_pressure,
        cancel_fetches: plan.has(Kind::FetchCancel),
        serial_prefill: plan.serial_prefill,
        // Every other seed (not drawn from the plan's streams, so a seed's
        // faults are what they were before device leases existed).
        device_leases: seed.is_multiple_of(2),
        // Every third seed, likewise.
        connect_peers: seed.is_multiple_of(3),
    };

    // ---- safety phase
    let start = Instant::now();
    let tally = Arc::new(Tally::default());
    let injectors = faults::start(cluster.clone(), plan, start, tally.clone());
    let ticker = {
        let shared = shared.clone();
        madsim::task::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                invariants::tick(&shared, false);
            }
        })
    };
    let drivers: Vec<_> =
        requests.iter().cloned().map(|r| madsim::task::spawn(drive(cluster.clone(), r, knobs, start))).collect();
    // Issue 29 (C15): the embedder's buffer churn on every node.
    let churn: Vec<_> = if plan.buffer_churn {
        (0..NODES)
            .filter_map(|i| shared.node(i).map(|n| (i, n)))
            .map(|(i, n)| {
                cluster.spawn_on(i, workload::buffer_churn(shared.clone(), n, plan.layer_first, start + SAFETY))
            })
            .collect()
    } else {
        Vec::new()
    };
    tokio::time::sleep_until(start + SAFETY).await;

    // ---- liveness phase: heal everything, inject nothing more
    faults::heal(&cluster, injectors).await;
    let mut summary = Summary { faults: tally.counts(), ..Summary::default() };
    // Requests still in flight finish without faults; each step is bounded
    // by its own watchdog, so this bound only guards the harness.
    let drain_bound = Duration::from_secs(60);
    let drain_start = Instant::now();
    for d in drivers {
        let left = drain_bound.saturating_sub(drain_start.elapsed());
        match tokio::time::timeout(left, d).await {
            Ok(Ok(o)) => {
                if o.done {
                    summary.requests_done += 1;
                } else {
                    summary.requests_lost += 1;
                }
                summary.reused += o.reused;
                summary.saved += o.saved;
                summary.fetched += o.fetched;
                summary.verified += o.verified;
                summary.recomputed += o.recomputed;
            }
            Ok(Err(_)) => summary.requests_lost += 1,
            Err(_) => shared.checker.record(Err(invariants::violation(
                "liveness",
                format!("a request was still running {drain_bound:?} after healing"),
            ))),
        }
    }
    for h in churn {
        // Bounded: each round's work ends by its deadlines; a killed node's
        // churn ended with it.
        let _ = tokio::time::timeout(Duration::from_secs(30), h).await;
    }
    ticker.abort();
    let cancelled = shared.cancelled_fetches.load(Ordering::SeqCst);
    if plan.has(Kind::FetchCancel) {
        summary.faults.insert(Kind::FetchCancel.name(), (cancelled, 0));
    }
    liveness(&cluster, &requests, &mut summary).await;

    // ---- final safety checks
    invariants::tick(&shared, true);
    let (sent, lost, rejected, poisoned) = shared.corruption_totals();
    summary.corruption = (
        shared.corrupt_armed.load(Ordering::SeqCst),
        sent,
        lost,
        shared.corrupt_disarmed.load(Ordering::SeqCst),
        rejected,
    );
    summary.poisoned_frees = poisoned;
    shared.checker.record(invariants::inv_no_early_free_checksum(&shared, sent, rejected));
    let (mut checked, mut bad) = (0, Vec::new());
    for i in 0..NODES {
        if let Some(n) = shared.node(i) {
            if let Ok((c, b)) = cluster.spawn_on(i, async move { workload::verify_all_resident(&n).await }).await {
                checked += c;
                bad.extend(b.into_iter().map(|h| format!("node{}:{h}", i + 1)));
            }
        }
    }
    shared.checker.record(invariants::inv_corruption_rejected(&shared, sent, checked, &bad));
    shared.checker.record(invariants::inv_session_ids_unique(&shared, grants));
    shared.checker.record(invariants::inv_pins_exact(&shared, grants));
    // Issue 29: every fetch's locks released exactly once (C8), no read
    // under an expired session (C13/C16), no access after unregister (C15).
    shared.checker.record(invariants::inv_lock_released_once(&shared, grants));
    shared.checker.record(invariants::inv_no_lock_expiry_after_fetch(&shared, grants));
    let (r, expired_reads) = invariants::inv_no_read_after_expiry(&shared, grants);
    shared.checker.record(r);
    // Issue 28: device-direct copies only under their leases (C19).
    let (r, device_reads) = invariants::inv_device_read_under_lease(&shared, grants);
    shared.checker.record(r);
    for i in 0..shared.nodes.len() {
        if let Some(n) = shared.node(i) {
            workload::drain_leases(&shared, &n, i);
        }
    }
    let (lease_grants, lease_ends) = {
        let book = shared.leases.lock().expect("leases");
        (book.grants, book.ended.iter().map(std::collections::BTreeSet::len).sum::<usize>() as u64)
    };
    shared.checker.record(invariants::inv_no_access_after_unregister(&shared));
    // Issue 32: what was staged from disk and recovered (C17, C18).
    if let Some(n) = (0..NODES).find_map(|i| shared.node(i)) {
        shared.checker.record(invariants::inv_disk_staged_verified(&shared, disk_watch, &n.layers));
        shared.checker.record(invariants::inv_disk_recovery_verified(&shared, disk_watch, &n.layers));
    }
    let (disk_staged, disk_recovered) = disk_watch.counts();
    let w = &shared.gpu_watch;
    summary.reach = Reach {
        partial_read_errors: shared.partial_read_errors.load(Ordering::SeqCst),
        deadline_fetches: shared.deadline_fetches.load(Ordering::SeqCst),
        known_owner_fetches: shared.known_owner_fetches.load(Ordering::SeqCst),
        ticket_fetches: shared.ticket_fetches.load(Ordering::SeqCst),
        overrun_max_us: shared.fetch_overrun_max_us.load(Ordering::SeqCst),
        connects: (
            shared.connects_ok.load(Ordering::SeqCst),
            shared.connects_deadline.load(Ordering::SeqCst),
            shared.connects_failed.load(Ordering::SeqCst),
        ),
        expired_reads,
        unregisters: w.unregisters_ok.load(Ordering::SeqCst),
        busy_refusals: w.busy_refusals.load(Ordering::SeqCst),
        held_batches: w.held_batches.load(Ordering::SeqCst),
        lease_grants,
        lease_ends,
        device_reads,
        disk_nodes: plan.disk.as_ref().map_or(0, |d| d.nodes.iter().filter(|&&b| b).count() as u64),
        disk_staged,
        disk_recovered,
        disk: shared.disk_totals(),
    };
    // Last: under the C15 canary this unregisters the nodes' device buffers.
    for i in 0..NODES {
        if let Some(n) = shared.node(i) {
            shared.checker.record(invariants::inv_embedder_memory(&shared, i, &n));
        }
    }
    shared.checker.drain_passes();
    summary.checks = shared.checker.counts();
    (summary, shared.checker.violations())
}

/// Liveness: locks drain, the index converges, a cancelled fetch releases
/// its lock promptly.
async fn liveness(c: &Cluster, requests: &[Request], summary: &mut Summary) {
    let s = &c.shared;
    let p = &s.params;

    // 1. Eventual lock release (C8 expiry + engine GC).
    let bound = Duration::from_secs(u64::from(p.lock_timeout_secs)) + p.lock_gc_interval + invariants::LOCK_SLACK;
    let t0 = Instant::now();
    loop {
        let locks = active_locks(s);
        let quiet = locks.iter().all(|(_, n)| *n == 0);
        if quiet || t0.elapsed() >= bound {
            s.checker.record(invariants::inv_no_lock_leak(
                s,
                "inv_no_lock_leak_eventual",
                &format!("eventual (waited {:?}, bound lock_timeout + gc + slack = {bound:?})", t0.elapsed()),
                &locks,
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // C4, what was delivered: before any repair, once queued registrations
    // were flushed, the store holds for each live node what its engine holds
    // (up to the registrations the node counted dropped).
    flush_all(c).await;
    index_matches_engine(c);

    // 2. Index convergence (C6). Lost registrations are repaired only by a
    //    backfill, which a MetaServer restart triggers.
    let lost = s.retired.lock().expect("retired").registrations_dropped
        + (0..NODES).filter_map(|i| s.node(i)).map(|n| workload::registrations_dropped(&n)).sum::<u64>();
    let why = if lost > 0 {
        summary.repair_restart = true;
        c.kill_metaserver();
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.restart_metaserver().await;
        format!(
            "{lost} registration(s) were dropped during safety, so the MetaServer was restarted to force the C6 backfill"
        )
    } else {
        "no registration was dropped; no repair restart".to_string()
    };
    let bound = Duration::from_secs(2 * p.stale_after_secs + 15);
    let t0 = Instant::now();
    loop {
        // Let queued registrations reach the MetaServer before comparing.
        flush_all(c).await;
        let diff = match s.ms() {
            Some(ms) => {
                let visible = ms.store.lock().expect("store").visible_entries(ms.now_ms());
                invariants::index_diff(&visible, &invariants::resident_union(s))
            }
            None => (Vec::new(), Vec::new()),
        };
        let converged = diff.0.is_empty() && diff.1.is_empty();
        if converged || t0.elapsed() >= bound {
            s.checker.record(invariants::inv_index_converges(s, &diff, t0.elapsed(), &why));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // 3. Prompt release on cancel (C8 "every path"): the cancel probe.
    summary.probe_conclusive = cancel_probe(c, requests).await;
    s.checker
        .count(if summary.probe_conclusive { "cancel_probe.conclusive" } else { "cancel_probe.inconclusive" }, false);
}

/// C4 per live node: the store's entries for the node vs what its engine
/// holds (resident, so not removed), after a flush and before any repair.
/// Judged only where the counters can explain a difference: not after a
/// MetaServer restart (its store started empty; only C6's backfill brings
/// entries back) nor for a restarted node (its earlier incarnations' drops
/// are not its own counters'); those skips are counted by reason.
fn index_matches_engine(c: &Cluster) {
    let s = &c.shared;
    let Some(ms) = s.ms() else { return };
    if ms.incarnation > 1 {
        s.checker.count("inv_index_matches_engine.skip.metaserver_restarted", false);
        return;
    }
    let entries = ms.store.lock().expect("store").visible_entries(ms.now_ms());
    for i in 0..NODES {
        let Some(n) = s.node(i) else { continue };
        if n.incarnation > 1 {
            s.checker.count("inv_index_matches_engine.skip.node_restarted", false);
            continue;
        }
        let m = n.engine.client().metrics();
        if m.heartbeats_failed.load(Ordering::SeqCst) > 0 || m.backfills.load(Ordering::SeqCst) > 0 {
            // The session may have lapsed at the store (its entries hidden
            // or swept, restored only by a backfill: C6, not counters).
            s.checker.count("inv_index_matches_engine.skip.session_may_have_lapsed", false);
            continue;
        }
        let me = n.engine.node().clone();
        let at_store =
            entries.iter().filter(|(ns, _, o)| ns == NAMESPACE && *o == me).map(|(_, h, _)| h.clone()).collect();
        let resident =
            n.engine.resident_blocks().into_iter().filter(|(ns, _)| ns == NAMESPACE).flat_map(|(_, h)| h).collect();
        let dropped = workload::registrations_dropped(&n);
        s.checker.record(invariants::inv_index_matches_engine(s, i, &at_store, &resident, dropped));
    }
}

fn active_locks(s: &Shared) -> Vec<(usize, u64)> {
    (0..NODES).filter_map(|i| s.node(i).map(|n| (i, n.engine.gauges().active_transfer_locks))).collect()
}

/// Plain flush on every live node (bounded by C2; failures are not this
/// step's business).
async fn flush_all(c: &Cluster) {
    for i in 0..NODES {
        if let Some(n) = c.shared.node(i) {
            let pending = n.engine.client().counters().pending;
            let bound = invariants::plain_flush_bound(&c.shared.params, pending, workload::resident_count(&n));
            let h = c.spawn_on(i, async move {
                let _ = tokio::time::timeout(bound, n.engine.client().flush()).await;
            });
            let _ = h.await;
        }
    }
}

/// Starts a fetch on a decode node that must read from a peer, slows its
/// reads, cancels it mid-read, and checks that no transfer lock is left
/// `RELEASE_GRACE` later. Returns whether a lock was held at cancel time.
async fn cancel_probe(c: &Cluster, requests: &[Request]) -> bool {
    let s = &c.shared;
    let Some(ms) = s.ms() else { return false };
    for d in PREFILL..NODES {
        let Some(n) = s.node(d) else { continue };
        let me = n.engine.node().clone();
        // A request whose first block some other node visibly owns.
        let target = requests.iter().find(|r| {
            let store = ms.store.lock().expect("store");
            store.query_prefix(NAMESPACE, &r.hashes, ms.now_ms()).iter().any(|(o, len)| *o != me && *len > 0)
        });
        let Some(req) = target.cloned() else { continue };
        // Progress first: with no fault left, a fetch from a live owner that
        // the (converged) index lists must bring the whole listed prefix.
        s.evict_all(d, &n);
        let listed = {
            let store = ms.store.lock().expect("store");
            store
                .query_prefix(NAMESPACE, &req.hashes, ms.now_ms())
                .iter()
                .filter(|(o, _)| *o != me)
                .map(|(_, l)| *l as usize)
                .max()
                .unwrap_or(0)
        };
        // Two attempts: connections pooled before a peer restarted are found
        // dead by the first read on them (which drops them), so the first
        // fault-free fetch may still fail once per restarted peer.
        let engine = n.engine.clone();
        let hashes = req.hashes.clone();
        // Issue 32: what an owner's disk tier may legitimately lose during
        // the probe — a record that fails verification when staged (a bit
        // a disk fault flipped on the medium in the safety phase, found
        // only now), a staged block's pool victim refused at a full
        // write-behind queue, a record the disk's LRU evicted to make room.
        let dropped = |s: &Shared| {
            let t = s.disk_totals();
            (t.verify_failures, t.write_refused, t.evicted)
        };
        let d0 = dropped(s);
        let got = c
            .spawn_on(d, async move {
                let first = engine.fetch(NAMESPACE, &hashes).await;
                if first.stopped.is_none() {
                    return first;
                }
                engine.fetch(NAMESPACE, &hashes).await
            })
            .await;
        let short = got.as_ref().map_or(true, |r| r.available < listed);
        let d1 = dropped(s);
        if short && d1.0 > d0.0 {
            // The block is dropped and its removal registered; the fetch
            // degrades (C17).
            s.checker.count("inv_fetch_progress.skip.disk_record_failed_verify", false);
        } else if short && (d1.1 > d0.1 || d1.2 > d0.2) {
            // Staging the owner's disk blocks for this very fetch pushed
            // other listed blocks out of its small pool and disk (seed 4021:
            // a write-behind queue of one): dropped and unregistered, so
            // the index no longer lists them (C4), and the fetch stops at
            // them (C9 degrade).
            s.checker.count("inv_fetch_progress.skip.disk_dropped_listed", false);
        } else {
            s.checker.record(invariants::inv_fetch_progress(d, req.id, listed, got.as_ref().ok()));
        }
        // Prompt release on the success path: a completed fetch leaves no
        // lock on its owners once the release RPC had time to land.
        tokio::time::sleep(invariants::RELEASE_GRACE).await;
        s.checker.record(invariants::inv_no_lock_leak(
            s,
            "inv_no_lock_leak_prompt",
            &format!("prompt (fetch on node{} completed {:?} ago)", d + 1, invariants::RELEASE_GRACE),
            &active_locks(s),
        ));
        let created = |s: &Shared| -> u64 {
            (0..NODES)
                .filter_map(|i| s.node(i))
                .map(|x| x.engine.metrics().transfer_locks_created.load(Ordering::SeqCst))
                .sum()
        };
        // The cancel path: a fetch dropped while its owner holds a lock.
        // Cancelling at a fixed time may land before the lock is taken, so
        // try a few cancel points until one cancels with a lock held.
        let mut held = false;
        for cancel_ms in [500, 250, 900, 1_400] {
            s.evict_all(d, &n); // force a remote read
            let before = created(s);
            sim::set_read_delay(&n.transport, Duration::from_secs(2));
            let (engine, hashes) = (n.engine.clone(), req.hashes.clone());
            let probe = c.spawn_on(d, async move {
                // Cancelled (dropped) mid-read by the timeout.
                tokio::time::timeout(Duration::from_millis(cancel_ms), engine.fetch(NAMESPACE, &hashes)).await.is_err()
            });
            let cancelled = probe.await.unwrap_or(false);
            held = cancelled && created(s) > before && active_locks(s).iter().any(|&(_, k)| k > 0);
            sim::set_read_delay(&n.transport, Duration::ZERO);
            tokio::time::sleep(invariants::RELEASE_GRACE).await;
            if held {
                let mut what = String::new();
                let _ = write!(
                    what,
                    "prompt (fetch on node{} cancelled mid-read after {cancel_ms} ms, {:?} ago, holding a lock)",
                    d + 1,
                    invariants::RELEASE_GRACE
                );
                s.checker.record(invariants::inv_no_lock_leak(s, "inv_no_lock_leak_prompt", &what, &active_locks(s)));
                break;
            }
        }
        return held;
    }
    false
}
