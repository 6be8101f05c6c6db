//! The same-host shared pool through whole nodes (issue 28 items 3 and 5):
//! two host-backend nodes in one process fetch through the owner's pool
//! with every byte checked, the per-path counters showing which path moved
//! the blocks; forced TCP; a refused shared pool and a failed shared-pool
//! read falling back to TCP (counted); a forced shared pool that cannot be
//! used failing cleanly; `fetch_into` copying from the owner's mapped pool
//! straight into the caller's KV in one step; `Engine::connect_peer`
//! opening that pool before the first fetch.
#![cfg(target_os = "linux")]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use kvferry::engine::fetch::FetchError;
use kvferry::engine::{Engine, SharedPool};
use kvferry::metaserver::MetaServerHandle;
use kvferry::node::{NodeHandle, PathChoice, PathStats};
use kvferry::types::{BlockHash, NodeAddr};

const MIB: u64 = 1 << 20;
const N: u64 = 33;

async fn node_with(ms: &MetaServerHandle, path: PathChoice) -> NodeHandle {
    let mut cfg = node_cfg(ms.local_addr, 4 * MIB);
    cfg.path = path;
    start_node_cfg(cfg).await.0
}

async fn prefill(e: &Engine, kv: &Kv, hs: &[BlockHash]) {
    fill_and_save(e, kv, 0, hs).await;
    let fr = e.flush_saves_and_registrations(Duration::from_secs(3)).await;
    assert_eq!((fr.delivered, fr.dropped, fr.timed_out), (hs.len() as u64, 0, false), "{fr:?}");
}

fn stats(n: &NodeHandle) -> PathStats {
    n.path.as_ref().expect("a TCP node has paths").stats()
}

/// Prefill on `p`, fetch all on `d`, every byte verified on `d`'s device.
async fn fetch_all(p: &NodeHandle, d: &NodeHandle) {
    let kp = register_default(&p.engine, 40);
    let kd = register_default(&d.engine, 40);
    let hs = hashes(1..N + 1);
    prefill(&p.engine, &kp, &hs).await;
    let rep = d.engine.fetch(NS, &hs).await;
    assert_eq!((rep.available, rep.fetched), (N as usize, N as usize), "{rep:?}");
    assert_eq!(rep.bytes, N * BLOCK);
    assert_eq!(d.engine.metrics().checksum_failures.load(Ordering::Relaxed), 0);
    load_and_verify(&d.engine, &kd, 0, &hs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_nodes_fetch_through_the_shared_pool() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Auto).await;
        let d = node_with(&ms, PathChoice::Auto).await;
        assert!(p.engine.pool().shared_fd().is_some(), "Auto puts the pool in a memfd");
        fetch_all(&p, &d).await;
        let s = stats(&d);
        assert_eq!((s.shm.extents, s.shm.bytes), (N, N * BLOCK), "{s:?}");
        assert_eq!((s.tcp.extents, s.shm.fallbacks, s.shm.attach_failures), (0, 0, 0), "{s:?}");
        assert!(d.path.as_ref().unwrap().uses_shm(&p.node));
        // Not one byte over TCP; the owner handed its pool out once.
        assert_eq!(tcp(&p).hooks.reads_served.load(Ordering::Relaxed), 0);
        let shm = p.path.as_ref().unwrap().shm().expect("owner shares its pool");
        assert!(eventually(Duration::from_secs(1), || shm.hooks.fds_sent.load(Ordering::Relaxed) == 1).await);
        // The transfer lock was taken and released as over TCP.
        assert!(eventually(Duration::from_secs(1), || p.engine.gauges().active_transfer_locks == 0).await);
        assert_eq!(p.engine.metrics().transfer_locks_created.load(Ordering::Relaxed), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tcp_reads_over_tcp_and_keeps_a_private_pool() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Auto).await;
        let d = node_with(&ms, PathChoice::Tcp).await;
        assert!(d.engine.pool().shared_fd().is_none(), "Tcp keeps the heap arena");
        fetch_all(&p, &d).await;
        let s = stats(&d);
        assert_eq!((s.tcp.extents, s.tcp.bytes), (N, N * BLOCK), "{s:?}");
        assert_eq!((s.shm.extents, s.shm.reads, s.shm.attach_failures), (0, 0, 0), "{s:?}");
        assert!(tcp(&p).hooks.reads_served.load(Ordering::Relaxed) > 0);
        let shm = p.path.as_ref().unwrap().shm().unwrap();
        assert_eq!(shm.hooks.tokens_issued.load(Ordering::Relaxed), 0, "a TCP-only reader offers no same-host section");
    })
    .await;
}

/// An owner that does not hand out its pool (its socket stopped): the
/// reader's attach fails, is counted, and the fetch reads over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_shared_pool_falls_back_to_tcp() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Auto).await;
        let d = node_with(&ms, PathChoice::Auto).await;
        p.path.as_ref().unwrap().shutdown();
        fetch_all(&p, &d).await;
        let s = stats(&d);
        assert_eq!(s.shm.attach_failures, 1, "{s:?}");
        assert_eq!((s.tcp.extents, s.shm.extents), (N, 0), "{s:?}");
        assert!(!d.path.as_ref().unwrap().uses_shm(&p.node));
    })
    .await;
}

/// Shared-pool reads that fail after the pool was mapped: their extents
/// are read again over TCP within the fetch's deadline, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_shared_pool_reads_fall_back_to_tcp() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Auto).await;
        let d = node_with(&ms, PathChoice::Auto).await;
        let shm = d.path.as_ref().unwrap().shm().unwrap().clone();
        shm.hooks.fail_next_reads.store(1000, Ordering::SeqCst);
        fetch_all(&p, &d).await;
        let s = stats(&d);
        assert_eq!((s.shm.fallbacks, s.shm.extents), (N, 0), "{s:?}");
        assert_eq!((s.tcp.extents, s.tcp.bytes), (N, N * BLOCK), "{s:?}");
        assert!(s.shm.reads >= 1 && s.shm.reads == s.tcp.reads, "{s:?}");
        assert!(tcp(&p).hooks.reads_served.load(Ordering::Relaxed) > 0);
    })
    .await;
}

/// `Shm` forced against an owner that does not hand out its pool: the
/// handshake fails (nothing read over TCP), the fetch degrades to 0 of n.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_shared_pool_that_cannot_be_used_fails_cleanly() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Auto).await;
        let d = node_with(&ms, PathChoice::Shm).await;
        p.path.as_ref().unwrap().shutdown();
        let kp = register_default(&p.engine, 40);
        register_default(&d.engine, 40);
        let hs = hashes(1..9);
        prefill(&p.engine, &kp, &hs).await;
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!(rep.available, 0, "{rep:?}");
        let s = stats(&d);
        assert!(s.shm.attach_failures >= 1, "{s:?}");
        assert_eq!((s.tcp.reads, s.shm.reads), (0, 0), "{s:?}");
        assert_eq!(tcp(&p).hooks.reads_served.load(Ordering::Relaxed), 0);
    })
    .await;
}

/// Issue 28 item 3, "copied host → device in one step": once the reader's
/// GPU backend opened the owner's mapped pool as a copy source (in the
/// background, after the first `fetch_into` asked), `fetch_into` copies
/// blocks from that mapping straight into the caller's KV blocks: every
/// byte lands at the caller's index, nothing goes through the reader's
/// pool (no pool read, nothing cached or advertised), and the one-step
/// metrics count the blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_copies_from_the_mapped_pool_in_one_step() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Shm).await;
        let d = node_with(&ms, PathChoice::Shm).await;
        let kp = register_default(&p.engine, 40);
        let kd = register_default(&d.engine, 40);
        let hs = hashes(1..N + 1);
        prefill(&p.engine, &kp, &hs).await;
        let m = d.engine.metrics();
        let direct = || m.shared_direct_blocks.load(Ordering::Relaxed);
        // One block at a time until the mapping is open as a copy source
        // (the blocks before that take the pool copy and then a load).
        let mut next = 0usize;
        while direct() == 0 {
            assert!(next < 10, "the mapped pool never became a copy source");
            let got = d.engine.fetch_into(NS, &[(hs[next].clone(), next as u64)]).await.unwrap();
            assert_eq!(got.ready(), 1, "{:?}", got.fetch);
            next += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let pooled_before = m.fetched_bytes.load(Ordering::Relaxed);
        let shm_before = stats(&d).shm.extents;
        let direct_before = direct();
        let rest: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(0u64..).skip(next).collect();
        let got = d.engine.fetch_into(NS, &rest).await.unwrap();
        assert_eq!(got.ready(), rest.len(), "{:?}", got.fetch);
        for (h, i) in &rest {
            assert!(verify(&d.engine, &kd, *i, h), "block {i} byte-identical at its index");
        }
        assert_eq!(direct() - direct_before, rest.len() as u64, "every block in one step");
        assert_eq!(m.shared_direct_bytes.load(Ordering::Relaxed), direct() * BLOCK);
        assert_eq!(m.shared_direct_fallbacks.load(Ordering::Relaxed), 0);
        assert_eq!(m.fetched_bytes.load(Ordering::Relaxed), pooled_before, "no block went through the pool");
        assert_eq!(stats(&d).shm.extents, shm_before, "no pool copy from the mapping");
        let rest_hashes: Vec<BlockHash> = rest.iter().map(|(h, _)| h.clone()).collect();
        assert_eq!(d.engine.query_prefix(NS, &rest_hashes), 0, "one-step blocks are not cached by the reader");
        assert_eq!(m.checksum_failures.load(Ordering::Relaxed), 0);
        // The transfer locks were all released.
        assert!(eventually(Duration::from_secs(2), || p.engine.gauges().active_transfer_locks == 0).await);
    })
    .await;
}

/// `Engine::connect_peer` handshakes and opens a same-host owner's mapped
/// pool before any fetch, so the first `fetch_into` already copies every
/// block in one step (without it the first blocks take the pool copy, as
/// the test above shows); over forced TCP there is no mapping to open; an
/// address where nothing listens is a clear error within the timeout and
/// leaves nothing behind. The one-step fetch takes no slots of the
/// reader's pool, full of its own blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_peer_opens_the_shared_pool_before_the_first_fetch() {
    bounded(async {
        let ms = start_ms().await;
        let p = node_with(&ms, PathChoice::Shm).await;
        let d = node_with(&ms, PathChoice::Shm).await;
        let kp = register_default(&p.engine, 40);
        // The reader's own blocks fill its pool (device blocks 40..): a
        // one-step fetch takes no pool slots, so it evicts none of them.
        let kd = register_default(&d.engine, 40 + 4 * MIB / BLOCK);
        let own = hashes(5000..5000 + 4 * MIB / BLOCK);
        fill_and_save(&d.engine, &kd, 40, &own).await;
        assert_eq!(d.engine.query_prefix(NS, &own), own.len(), "the pool holds them all");
        let hs = hashes(1..N + 1);
        prefill(&p.engine, &kp, &hs).await;
        assert_eq!(d.engine.handshaken_peers(), 0);
        let state = d.engine.connect_peer(&p.node, Duration::from_secs(5)).await.unwrap();
        assert_eq!(state, SharedPool::Ready);
        assert_eq!(d.engine.handshaken_peers(), 1);
        let m = d.engine.metrics();
        let all: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(0u64..).collect();
        let got = d.engine.fetch_into(NS, &all).await.unwrap();
        assert_eq!(got.ready(), all.len(), "{:?}", got.fetch);
        for (h, i) in &all {
            assert!(verify(&d.engine, &kd, *i, h), "block {i} byte-identical at its index");
        }
        assert_eq!(m.shared_direct_blocks.load(Ordering::Relaxed), N, "every block in one step");
        assert_eq!(m.fetched_bytes.load(Ordering::Relaxed), 0, "no block went through the pool");
        assert_eq!(m.evicted.load(Ordering::Relaxed), 0, "no pool slot was taken for the one-step copy");
        assert_eq!(d.engine.query_prefix(NS, &own), own.len(), "the reader's own blocks are all resident");
        // Connecting again is the same single-flight handshake.
        assert_eq!(d.engine.connect_peer(&p.node, Duration::from_secs(5)).await.unwrap(), SharedPool::Ready);
        assert_eq!(d.engine.handshaken_peers(), 1);

        let t = node_with(&ms, PathChoice::Tcp).await;
        assert_eq!(t.engine.connect_peer(&p.node, Duration::from_secs(5)).await.unwrap(), SharedPool::NotMapped);

        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = NodeAddr(gone.local_addr().unwrap().to_string());
        drop(gone);
        let t0 = std::time::Instant::now();
        let err = d.engine.connect_peer(&addr, Duration::from_secs(2)).await.unwrap_err();
        let took = t0.elapsed();
        // Tried again until the timeout (each try is refused at once), the
        // last try within CONNECT_PEER_RETRY_MIN of it, and not past it.
        let last_try_by = Duration::from_secs(2) - kvferry::limits::CONNECT_PEER_RETRY_MIN;
        assert!(took >= last_try_by && took < Duration::from_millis(2100), "{took:?}");
        assert_eq!(err.error, FetchError::Deadline, "{err}");
        let last = err.last_try.as_ref().expect("the last try's failure");
        assert!(matches!(last, FetchError::Handshake(_)), "{last}");
        assert!(err.to_string().contains("last try"), "{err}");
        assert_eq!(d.engine.handshaken_peers(), 1, "a failed connect leaves no peer behind");
    })
    .await;
}

/// A decode engine may start before its prefill peer: `connect_peer`
/// tries the handshake again until the peer is up (here 1 s after the
/// call, on the address it was told), then opens its shared pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_peer_waits_for_a_peer_that_starts_later() {
    bounded(async {
        let ms = start_ms().await;
        let d = node_with(&ms, PathChoice::Shm).await;
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let grpc = free.local_addr().unwrap();
        drop(free);
        let connect = {
            let e = d.engine.clone();
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                (e.connect_peer(&NodeAddr(grpc.to_string()), Duration::from_secs(10)).await, t0.elapsed())
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut cfg = node_cfg(ms.local_addr, 4 * MIB);
        cfg.path = PathChoice::Shm;
        cfg.grpc_addr = grpc;
        let p = start_node_cfg(cfg).await.0;
        assert_eq!(p.node.0, grpc.to_string());
        let (state, took) = connect.await.unwrap();
        assert_eq!(state.unwrap(), SharedPool::Ready, "connected once the peer was up");
        assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(5), "{took:?}");
        assert_eq!(d.engine.handshaken_peers(), 1);
    })
    .await;
}
