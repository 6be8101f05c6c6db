//! The disk tier inside the engine (issue 32, items 2–4), on real tokio
//! and tonic against a real MetaServer.
//!
//! | test | contract |
//! | --- | --- |
//! | `evicted_blocks_go_to_disk_stay_advertised_and_load_back` | write-behind on eviction; disk blocks stay advertised; local lookup and `load` stage them with the saved bytes (C17) |
//! | `a_peer_fetches_a_disk_only_block` | a peer's lock request stages a disk block; the fetch verifies every byte (C17, C18) |
//! | `a_corrupt_record_is_never_served_and_its_removal_is_registered` | reads that do not verify serve nothing, drop the record, register its removal (C17, C4) |
//! | `a_full_write_queue_drops_and_registers_removals` | refused writes register removals; `evicted == removals + evicted_to_disk` (C4) |
//! | `a_restart_on_the_same_directory_recovers_and_readvertises` | a new node on the directory advertises the verified records again and serves them (C18) |
//! | `the_driver_evicts_ahead_and_the_victims_stay_on_disk` | a full pool is evicted ahead of demand by the tier's driver, victims written (stay advertised, C4 balance) |
//! | `evicting_ahead_waits_for_room_in_the_write_queue` | evicting ahead never drops a block at a full write-behind queue (C4: no removal) |
//! | `prefetch_stages_the_disk_prefix_into_the_pool` | `Engine::prefetch` stages the disk-resident prefix (verified, C17), stops at a gap, is a lookup without a tier |
//! | `a_second_node_on_the_same_directory_is_refused` | the tier locks its directory: a second node fails at start naming it |
//! | `staging_into_a_small_pool_keeps_its_own_prefix` | a staging holds what it found and staged until its caller's lock or load: it never evicts its own prefix for its tail |
//! | `a_block_being_written_is_found_and_loaded` | a block is found (lookup, MetaServer) and loads with the saved bytes from the moment its write is queued: from the queue's buffer, or from the buffer of its write at the disk once that completes (C17) |
//! | `the_driver_writes_while_every_runtime_worker_is_busy` | the tier's driver has a thread of its own: queued writes land while the runtime's workers are held |

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use kvferry::disk::sim::{SimDisk, SimFaults};
use kvferry::engine::{DiskConfig, SimDiskSlot};
use kvferry::node::NodeConfig;
use kvferry::types::BlockHash;

/// Pool of this many default blocks (so saving more evicts).
const POOL_BLOCKS: u64 = 4;
/// Size of every test tier (bytes).
const DISK_BYTES: u64 = 8 << 20;

fn sim_slot(faults: SimFaults, seed: u64) -> SimDiskSlot {
    let mut d = SimDisk::new(DISK_BYTES, 8, seed);
    d.set_faults(faults);
    SimDiskSlot::new(d)
}

fn disk_node_cfg(ms: &kvferry::metaserver::MetaServerHandle, disk: DiskConfig) -> NodeConfig {
    let mut c = node_cfg(ms.local_addr, POOL_BLOCKS * BLOCK);
    c.engine.disk = Some(disk);
    c
}

/// Starts a node with tier `disk` and a pool of `pool_blocks` default blocks.
async fn start_disk_node(
    ms: &kvferry::metaserver::MetaServerHandle,
    disk: DiskConfig,
    pool_blocks: u64,
) -> kvferry::node::NodeHandle {
    let mut ncfg = disk_node_cfg(ms, disk);
    ncfg.engine.pool_bytes = pool_blocks * BLOCK;
    start_node_cfg(ncfg).await.0
}

/// Waits (bounded) until the driver evicted ahead up to the high mark of a
/// pool of `pool_blocks` default blocks.
async fn wait_for_evict_ahead(e: &kvferry::engine::Engine, pool_blocks: u64) {
    let high = pool_blocks * BLOCK / 1024 * kvferry::limits::DISK_EVICT_AHEAD_HIGH_PER_1024;
    for _ in 0..500 {
        if e.pool().free_bytes() >= high {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the driver did not evict ahead: {:?}", e.disk_stats());
}

/// Saves `hs` two at a time from device blocks `0..` (so the pool evicts
/// the oldest to disk), then waits for the tier's writes.
async fn save_in_pairs(e: &kvferry::engine::Engine, kv: &Kv, hs: &[BlockHash]) {
    for (i, pair) in hs.chunks(2).enumerate() {
        fill_and_save(e, kv, 2 * i as u64, pair).await;
    }
    let rep = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
    assert!(!rep.timed_out, "{rep:?}");
    assert!(e.disk_drain(Duration::from_secs(5)).await, "disk writes did not land");
}

/// Loads `hs` two at a time into device blocks `first..` and verifies every
/// byte; returns blocks loaded.
async fn load_pairs(e: &kvferry::engine::Engine, kv: &Kv, first: u64, hs: &[BlockHash]) -> usize {
    let mut loaded = 0;
    for (i, pair) in hs.chunks(2).enumerate() {
        let blocks: Vec<(BlockHash, u64)> =
            pair.iter().enumerate().map(|(j, h)| (h.clone(), first + 2 * i as u64 + j as u64)).collect();
        for (_, idx) in &blocks {
            clear(e, kv, *idx);
        }
        let rep = e.load(&kv.ns, &blocks).await.expect("load");
        for ((h, idx), r) in blocks.iter().zip(&rep.results) {
            if r.is_ok() {
                assert!(verify(e, kv, *idx, h), "block {h:?} loaded from disk differs from what was saved");
                loaded += 1;
            }
        }
    }
    loaded
}

fn removals_balance(e: &kvferry::engine::Engine) {
    let m = e.metrics();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    assert_eq!(
        ld(&m.evicted),
        ld(&m.removals_enqueued) + ld(&m.removals_dropped_at_enqueue) + ld(&m.evicted_to_disk),
        "C4 with a disk tier"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_blocks_go_to_disk_stay_advertised_and_load_back() {
    bounded(async {
        let ms = start_ms().await;
        let slot = sim_slot(SimFaults::none(), 1);
        let (n, _) = start_node_cfg(disk_node_cfg(&ms, DiskConfig::simulated(slot, DISK_BYTES))).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(100..112);
        save_in_pairs(e, &kv, &hs).await;
        let st = e.disk_stats().expect("a disk tier");
        assert!(st.evicted_to_disk >= 8, "{st:?}");
        assert_eq!(e.metrics().removals_enqueued.load(Ordering::Relaxed), 0);
        removals_balance(e);
        // Every block is found locally and stays advertised.
        assert_eq!(e.resident_prefix(NS, &hs), 0, "the oldest are on disk only");
        assert_eq!(e.query_prefix(NS, &hs), hs.len());
        assert_eq!(ms_prefix_of(e, NS, &hs, &n.node).await, hs.len() as u32);
        let backfill: usize = e.resident_blocks().iter().map(|(_, v)| v.len()).sum();
        assert_eq!(backfill, hs.len(), "the backfill lists pool and disk blocks");
        // Loads stage from disk with the saved bytes.
        assert_eq!(load_pairs(e, &kv, 16, &hs).await, hs.len());
        let st = e.disk_stats().expect("a disk tier");
        assert!(st.staged_blocks >= 8 && st.tier.read_blocks >= 8, "{st:?}");
        assert_eq!(st.tier.verify_failures, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_being_written_is_found_and_loaded() {
    bounded(async {
        let ms = start_ms().await;
        // Depth 2 and a disk that completes nothing until released: two
        // writes at the disk, the other six waiting in the queue.
        let disk = SimDisk::new(DISK_BYTES, 2, 11);
        let stall = disk.stall_switch();
        let cfg = DiskConfig { evict_ahead: false, ..DiskConfig::simulated(SimDiskSlot::new(disk), DISK_BYTES) };
        let n = start_disk_node(&ms, cfg, 8).await;
        stall.store(true, Ordering::Relaxed); // after the recovery scan at start
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(700..708);
        fill_and_save(e, &kv, 0, &hs).await;
        assert!(!e.flush_saves_and_registrations(Duration::from_secs(2)).await.timed_out);
        assert_eq!(e.evict(8 * BLOCK), 8);
        let st = e.disk_stats().expect("a disk tier");
        assert_eq!((st.evicted_to_disk, st.tier.written_blocks), (8, 0), "{st:?}");
        // Not one write completed, yet every block is found and advertised.
        assert_eq!(e.resident_prefix(NS, &hs), 0);
        assert_eq!(e.query_prefix(NS, &hs), hs.len());
        assert_eq!(ms_prefix_of(e, NS, &hs, &n.node).await, hs.len() as u32);
        // The disk comes back while the loads wait for its two writes.
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            stall.store(false, Ordering::Relaxed);
        });
        // One load of all eight: the queued six are copied at once, the
        // two at the disk wait for their writes.
        let blocks: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(16u64..).collect();
        let rep = e.load(&kv.ns, &blocks).await.expect("load");
        assert!(rep.results.iter().all(|r| r.is_ok()), "{:?}", rep.results);
        for (h, idx) in &blocks {
            assert!(verify(e, &kv, *idx, h), "block {h:?} differs from what was saved");
        }
        release.await.expect("release task");
        let st = e.disk_stats().expect("a disk tier");
        let t = &st.tier;
        assert_eq!(t.read_blocks, 8, "{st:?}");
        assert_eq!((t.queue_reads, t.after_write_reads), (6, 2), "none read from the disk: {st:?}");
        assert_eq!(t.verify_failures, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_fetches_a_disk_only_block() {
    bounded(async {
        let ms = start_ms().await;
        let slot = sim_slot(SimFaults::none(), 2);
        let (a, _) = start_node_cfg(disk_node_cfg(&ms, DiskConfig::simulated(slot, DISK_BYTES))).await;
        let (b, _) = start_node(&ms, 32 * BLOCK).await;
        let kva = register_default(&a.engine, 32);
        let kvb = register_default(&b.engine, 32);
        let hs = hashes(200..210);
        save_in_pairs(&a.engine, &kva, &hs).await;
        assert!(a.engine.resident_prefix(NS, &hs) == 0, "the prefix is on A's disk only");
        let wanted: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(0u64..).collect();
        // A's pool holds 4 blocks: fetch them in pairs.
        for pair in wanted.chunks(2) {
            let got = b.engine.fetch_into(NS, pair).await.expect("fetch_into");
            assert_eq!(got.load.loaded(), 2, "{got:?}");
        }
        for (h, idx) in &wanted {
            assert!(verify(&b.engine, &kvb, *idx, h), "block {h:?} fetched from A's disk differs");
        }
        let st = a.engine.disk_stats().expect("a disk tier");
        assert!(st.staged_blocks >= 6, "{st:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_record_is_never_served_and_its_removal_is_registered() {
    bounded(async {
        let ms = start_ms().await;
        // Every read returns one flipped bit.
        let faults = SimFaults { corrupt_read: 1.0, ..SimFaults::none() };
        let slot = sim_slot(faults, 3);
        let (a, _) = start_node_cfg(disk_node_cfg(&ms, DiskConfig::simulated(slot, DISK_BYTES))).await;
        let (b, _) = start_node(&ms, 32 * BLOCK).await;
        let e = &a.engine;
        let kv = register_default(e, 32);
        let kvb = register_default(&b.engine, 32);
        let hs = hashes(300..310);
        save_in_pairs(e, &kv, &hs).await;
        let on_disk = hs.len() - e.resident_prefix(NS, &hs);
        assert!(on_disk >= 6);
        // A peer's fetch gets nothing wrong: the disk blocks are not served.
        let wanted: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(0u64..).collect();
        let got = b.engine.fetch_into(NS, &wanted[..2]).await.expect("fetch_into");
        for (j, r) in got.load.results.iter().enumerate() {
            if r.is_ok() {
                assert!(verify(&b.engine, &kvb, j as u64, &hs[j]), "a corrupt block was served");
            }
        }
        // A local load serves nothing wrong either (a flip that lands in a
        // record's padding leaves the block's bytes intact: those load, and
        // `load_pairs` checks every byte).
        load_pairs(e, &kv, 16, &hs[2..4]).await;
        let st = e.disk_stats().expect("a disk tier");
        assert!(st.tier.verify_failures >= 2, "{st:?}");
        assert_eq!(st.tier.verify_failures + st.staged_blocks, 4, "{st:?}");
        // Their removals reach the MetaServer.
        let failed = st.tier.verify_failures;
        assert!(
            eventually(Duration::from_secs(2), || e.disk_stats().is_some_and(|s| s.removals_enqueued >= failed)).await,
            "{:?}",
            e.disk_stats()
        );
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        for h in &hs[..4] {
            let one = std::slice::from_ref(h);
            if e.query_prefix(NS, one) == 0 {
                assert_eq!(ms_prefix_of(e, NS, one, &a.node).await, 0, "a dropped record is still advertised");
            }
        }
        removals_balance(e);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_write_queue_drops_and_registers_removals() {
    bounded(async {
        let ms = start_ms().await;
        // Slow writes and a queue of one: most evictions are refused.
        let slot = sim_slot(SimFaults { slow: 1.0, ..SimFaults::none() }, 4);
        // No eviction ahead: the test's own eviction empties the pool.
        let cfg = DiskConfig { write_queue_max: 1, evict_ahead: false, ..DiskConfig::simulated(slot, DISK_BYTES) };
        let n = start_disk_node(&ms, cfg, 8).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(400..408);
        fill_and_save(e, &kv, 0, &hs).await;
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        // One eviction of the whole pool at once.
        assert_eq!(e.evict(8 * BLOCK), 8);
        let st = e.disk_stats().expect("a disk tier");
        assert!(st.write_refused >= 6 && st.tier.write_refused_queue_full >= 6, "{st:?}");
        // Counted where the report and metrics read them.
        assert_eq!(st.write_queue_full, st.tier.write_refused_queue_full, "{st:?}");
        assert_eq!(e.metrics().removals_enqueued.load(Ordering::Relaxed), st.write_refused);
        removals_balance(e);
        assert!(e.disk_drain(Duration::from_secs(10)).await);
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        // What the tier took stays advertised; what it refused does not.
        let listed = ms_prefix(e, NS, &hs).await;
        let kept = st.evicted_to_disk as usize;
        assert_eq!(e.query_prefix(NS, &hs), kept.min(hs.len()));
        assert!(listed.iter().all(|(_, l)| *l as usize <= kept), "{listed:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_the_same_directory_recovers_and_readvertises() {
    bounded(async {
        let dir = tempfile::Builder::new().prefix(".disk-engine-test-").tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let ms = start_ms().await;
        let hs = hashes(500..510);
        let (first, on_disk) = {
            let (n, _) = start_node_cfg(disk_node_cfg(&ms, DiskConfig::new(dir.path(), DISK_BYTES))).await;
            let kv = register_default(&n.engine, 32);
            save_in_pairs(&n.engine, &kv, &hs).await;
            let on_disk: Vec<BlockHash> =
                hs.iter().filter(|h| n.engine.resident_prefix(NS, std::slice::from_ref(h)) == 0).cloned().collect();
            assert!(on_disk.len() >= 6, "{on_disk:?}");
            let node = n.node.clone();
            n.shutdown(Duration::from_secs(2)).await;
            (node, on_disk)
        };
        // A new process on the same directory (another address), whose
        // registration queue holds fewer commands than the tier recovers:
        // the re-advertising waits for room instead of dropping the rest.
        let mut cfg = disk_node_cfg(&ms, DiskConfig::new(dir.path(), DISK_BYTES));
        cfg.queue.depth_max = 2;
        let (n, _) = start_node_cfg(cfg).await;
        assert_ne!(n.node, first);
        let e = &n.engine;
        let st = e.disk_stats().expect("a disk tier");
        assert_eq!(st.tier.recovered as usize, on_disk.len(), "{st:?}");
        let all_offered = || e.disk_stats().is_some_and(|s| s.recovered_advertised as usize == on_disk.len());
        assert!(eventually(Duration::from_secs(10), all_offered).await, "{:?}", e.disk_stats());
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(e.metrics().registrations_dropped_at_enqueue.load(Ordering::Relaxed), 0);
        assert_eq!(ms_prefix_of(e, NS, &on_disk, &n.node).await, on_disk.len() as u32, "re-advertised");
        let kv = register_default(e, 32);
        assert_eq!(load_pairs(e, &kv, 0, &on_disk).await, on_disk.len());
        n.shutdown(Duration::from_secs(2)).await;
    })
    .await;
}

/// Two nodes never share a tier directory: the second fails at start with
/// an error naming the directory; once the first is gone, the directory
/// can be used again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_on_the_same_directory_is_refused() {
    bounded(async {
        let dir = tempfile::Builder::new().prefix(".disk-lock-test-").tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let ms = start_ms().await;
        let (first, _) = start_node_cfg(disk_node_cfg(&ms, DiskConfig::new(dir.path(), DISK_BYTES))).await;
        let gpu: Arc<dyn kvferry::gpu::Gpu> = Arc::new(kvferry::gpu::host::HostGpu::new());
        let err = match kvferry::node::start(disk_node_cfg(&ms, DiskConfig::new(dir.path(), DISK_BYTES)), gpu).await {
            Ok(_) => panic!("a second node started on a directory in use"),
            Err(e) => e,
        };
        let msg = err.to_string();
        assert!(msg.contains("in use") && msg.contains(&dir.path().display().to_string()), "{msg}");
        assert_eq!(err.code(), "disk_open_locked");
        first.shutdown(Duration::from_secs(2)).await;
        let (again, _) = start_node_cfg(disk_node_cfg(&ms, DiskConfig::new(dir.path(), DISK_BYTES))).await;
        assert!(again.engine.disk_stats().is_some());
        again.shutdown(Duration::from_secs(2)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_evicts_ahead_and_the_victims_stay_on_disk() {
    bounded(async {
        let ms = start_ms().await;
        let slot = sim_slot(SimFaults::none(), 7);
        let n = start_disk_node(&ms, DiskConfig::simulated(slot, DISK_BYTES), 16).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(700..716);
        // The save fills the pool: the allocation of its last block leaves
        // less than the low mark free and wakes the driver.
        fill_and_save(e, &kv, 0, &hs).await;
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        wait_for_evict_ahead(e, 16).await;
        let st = e.disk_stats().expect("a disk tier");
        assert!(st.evicted_ahead >= 1, "{st:?}");
        assert_eq!(st.evicted_ahead, st.evicted_to_disk, "no save evicted on its own path: {st:?}");
        assert!(e.resident_prefix(NS, &hs) < hs.len(), "the oldest block left the pool");
        assert!(e.disk_drain(Duration::from_secs(5)).await);
        // Every block is still found locally and advertised.
        assert_eq!(e.query_prefix(NS, &hs), hs.len());
        assert_eq!(ms_prefix_of(e, NS, &hs, &n.node).await, hs.len() as u32);
        removals_balance(e);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_ahead_waits_for_room_in_the_write_queue() {
    bounded(async {
        let ms = start_ms().await;
        // Slow writes and a queue of one: evicting the pool's 1/8 at once
        // would have the queue refuse (and drop) all but one victim.
        let slot = sim_slot(SimFaults { slow: 1.0, ..SimFaults::none() }, 9);
        let cfg = DiskConfig { write_queue_max: 1, ..DiskConfig::simulated(slot, DISK_BYTES) };
        let n = start_disk_node(&ms, cfg, 16).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        fill_and_save(e, &kv, 0, &hashes(900..916)).await;
        wait_for_evict_ahead(e, 16).await;
        let st = e.disk_stats().expect("a disk tier");
        assert!(st.evicted_ahead >= 2, "{st:?}");
        assert_eq!(st.write_refused, 0, "evicting ahead dropped a block at a full queue: {st:?}");
        assert_eq!(e.metrics().removals_enqueued.load(Ordering::Relaxed), 0);
        removals_balance(e);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_stages_the_disk_prefix_into_the_pool() {
    bounded(async {
        let ms = start_ms().await;
        let slot = sim_slot(SimFaults::none(), 8);
        let cfg = DiskConfig { evict_ahead: false, ..DiskConfig::simulated(slot, DISK_BYTES) };
        let n = start_disk_node(&ms, cfg, 8).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(800..804);
        fill_and_save(e, &kv, 0, &hs).await;
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(e.evict(u64::MAX), hs.len(), "every block to disk");
        assert!(e.disk_drain(Duration::from_secs(5)).await);
        assert_eq!(e.resident_prefix(NS, &hs), 0);
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        // A gap (a block in neither place) ends the prefix.
        let gapped = [hs[0].clone(), BlockHash::from_u64(899), hs[1].clone()];
        assert_eq!(e.prefetch(NS, &gapped, until).await, 1);
        assert_eq!(e.prefetch(NS, &hs, until).await, hs.len());
        assert_eq!(e.resident_prefix(NS, &hs), hs.len());
        let st = e.disk_stats().expect("a disk tier");
        assert_eq!(st.staged_blocks, hs.len() as u64, "each block read once: {st:?}");
        assert_eq!(st.tier.verify_failures, 0);
        // The staged bytes are the saved ones.
        assert_eq!(load_pairs(e, &kv, 16, &hs).await, hs.len());
        assert_eq!(e.disk_stats().expect("a disk tier").staged_blocks, hs.len() as u64, "loads found them resident");

        // Without a tier: the resident prefix, nothing read.
        let (m, _) = start_node(&ms, 8 * BLOCK).await;
        let kv2 = register_default(&m.engine, 8);
        fill_and_save(&m.engine, &kv2, 0, &hs[..2]).await;
        assert_eq!(m.engine.prefetch(NS, &hs, until).await, 2);
        assert!(m.engine.disk_stats().is_none());
    })
    .await;
}

/// The tier's driver runs on a thread of its own: while synchronous work
/// holds every worker of the engine's runtime, the writes an eviction
/// queues still reach the disk (as a task of that runtime the driver would
/// wait for a free worker, and a busy runtime filled its queues: docs/
/// BENCHMARKS.md, session 20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_writes_while_every_runtime_worker_is_busy() {
    bounded(async {
        let ms = start_ms().await;
        let slot = sim_slot(SimFaults::none(), 9);
        let cfg = DiskConfig { evict_ahead: false, ..DiskConfig::simulated(slot, DISK_BYTES) };
        let n = start_disk_node(&ms, cfg, 16).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(900..912);
        fill_and_save(e, &kv, 0, &hs).await;
        assert!(e.disk_drain(Duration::from_secs(5)).await);
        let before = e.disk_stats().expect("a disk tier").tier.written_blocks;
        // Both workers sleep (synchronously) for 800 ms once they started;
        // this test's body runs on its own thread (the runtime's block_on).
        let started = Arc::new(std::sync::Barrier::new(3));
        let hold: Vec<_> = (0..2)
            .map(|_| {
                let started = started.clone();
                tokio::spawn(async move {
                    started.wait();
                    std::thread::sleep(Duration::from_millis(800));
                })
            })
            .collect();
        started.wait();
        let t0 = std::time::Instant::now();
        let evicted = e.evict(u64::MAX) as u64;
        assert!(evicted >= hs.len() as u64, "every block was unpinned: {evicted}");
        let mut written = before;
        while t0.elapsed() < Duration::from_millis(500) && written < before + evicted {
            std::thread::sleep(Duration::from_millis(5));
            written = e.disk_stats().expect("a disk tier").tier.written_blocks;
        }
        let busy = t0.elapsed() < Duration::from_millis(800);
        for h in hold {
            h.await.expect("holding task");
        }
        assert!(busy, "the workers were still held while the writes were checked");
        assert_eq!(written, before + evicted, "every queued write landed while the runtime was busy");
        assert_eq!(e.query_prefix(NS, &hs), hs.len(), "the victims stay found locally (on disk)");
    })
    .await;
}

/// A staging holds what it staged until its caller is done: a prefix of
/// six disk blocks staged into a pool of four keeps the first four (the
/// last two find no room) instead of evicting its own first blocks to make
/// room for its last ones, which left no prefix at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_into_a_small_pool_keeps_its_own_prefix() {
    bounded(async {
        let ms = start_ms().await;
        let slot = sim_slot(SimFaults::none(), 10);
        let cfg = DiskConfig { evict_ahead: false, ..DiskConfig::simulated(slot, DISK_BYTES) };
        let n = start_disk_node(&ms, cfg, 4).await;
        let e = &n.engine;
        let kv = register_default(e, 32);
        let hs = hashes(1000..1006);
        save_in_pairs(e, &kv, &hs).await;
        e.evict(u64::MAX);
        assert!(e.disk_drain(Duration::from_secs(5)).await);
        assert_eq!(e.resident_prefix(NS, &hs), 0, "all six on disk only");
        assert_eq!(e.query_prefix(NS, &hs), hs.len());
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        assert_eq!(e.prefetch(NS, &hs, until).await, 4, "the pool's worth, from the first block");
        let st = e.disk_stats().expect("a disk tier");
        assert_eq!((st.staged_blocks, st.stage_failures, st.stage_no_room), (4, 2, 2), "{st:?}");
        // A load of all six stages nothing it would evict again: the first
        // four load, the last two are not resident.
        let rep = e.load(NS, &hs.iter().cloned().zip(16u64..).collect::<Vec<_>>()).await.unwrap();
        let ok: Vec<bool> = rep.results.iter().map(|r| r.is_ok()).collect();
        assert_eq!(ok, [true, true, true, true, false, false], "{:?}", rep.results);
        for (i, h) in hs[..4].iter().enumerate() {
            assert!(verify(e, &kv, 16 + i as u64, h), "block {i} loaded with its saved bytes");
        }
    })
    .await;
}
