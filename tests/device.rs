//! Device-direct reads on one host (issue 28 item 2, contract C19), on the
//! host backend: two nodes in one process, the owner granting device leases
//! on its saved KV blocks, the decode node's `fetch_into` copying them
//! straight from the owner's KV into its own (the in-process peer kind of
//! `gpu::peer`; the CUDA IPC kind runs the same engine code on the H200).
//!
//! | test | contract |
//! | --- | --- |
//! | `leased_blocks_land_device_to_device_and_the_lease_ends_once` | C19 path, C10, C8/C19 released once |
//! | `a_device_direct_fetch_evicts_nothing_from_the_readers_pool` | C19 path takes no pool slots |
//! | `a_block_changed_under_its_lease_is_read_from_the_pool` | C10 on the device path, fallback (slots taken then) |
//! | `a_fallback_the_pool_cannot_serve_keeps_what_it_read_and_stops_with_no_space` | fallback with a full pool: C11, `NoSpace` |
//! | `expired_revoked_and_unleased_blocks_take_the_pool_path` | C19 expiry and revocation, C15 |
//! | `forced_paths_and_foreign_askers_get_no_device_ranges` | C19 who may read |
//! | `bad_grants_are_refused_and_change_nothing` | bad input |
//! | `malformed_device_answers_are_read_from_the_pool` | C19 bad input from the network, C10 |

#![cfg(real_os)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;
use kvferry::client::{ClientConfig, MetaServerClient};
use kvferry::engine::fetch::FetchError;
use kvferry::engine::leases::LeaseEnd;
use kvferry::engine::{Engine, EngineError};
use kvferry::gpu::Gpu;
use kvferry::gpu::host::HostGpu;
use kvferry::node::{NodeConfig, PathChoice};
use kvferry::p2p::P2pTransferService;
use kvferry::proto::engine_client::EngineClient;
use kvferry::proto::engine_server::{Engine as EngineRpc, EngineServer};
use kvferry::proto::*;
use kvferry::transport::tcp::TcpTransport;
use kvferry::types::{BlockHash, NodeAddr, SessionId};
use rand::SeedableRng;
use std::sync::Arc;
use tonic::{Request, Response, Status};

fn cfg(ms: &kvferry::metaserver::MetaServerHandle, path: PathChoice) -> NodeConfig {
    let mut c = node_cfg(ms.local_addr, 4 * MIB);
    c.path = path;
    c
}

/// `hs` paired with the caller's destination blocks `first..`.
fn wanted(hs: &[BlockHash], first: u64) -> Vec<(BlockHash, u64)> {
    hs.iter().cloned().zip(first..).collect()
}

/// Every block of `hs` landed byte-identical at destination `first + i`.
fn assert_landed(e: &Engine, kv: &Kv, hs: &[BlockHash], first: u64) {
    for (i, h) in hs.iter().enumerate() {
        assert!(verify(e, kv, first + i as u64, h), "block {i} byte-identical at destination {}", first + i as u64);
    }
}

/// Saves `hs` from device blocks `0..` of the owner, waits for their
/// registration, and grants a device lease on them.
async fn prefill_leased(
    e: &Engine,
    kv: &Kv,
    hs: &[BlockHash],
    ttl: Duration,
) -> kvferry::engine::leases::DeviceLeaseId {
    let blocks = fill_blocks(e, kv, 0, hs);
    let rep = e.save(NS, &blocks).await.expect("save");
    assert_eq!(rep.saved.len(), hs.len());
    let fr = e.flush_saves_and_registrations(Duration::from_secs(10)).await;
    assert_eq!(fr.delivered, hs.len() as u64, "{fr:?}");
    e.grant_device_lease(NS, &blocks, ttl).expect("grant")
}

/// The decode node arranges its KV differently (one buffer, layer-first)
/// from the owner (a K and a V tensor per layer): the copy is cut where
/// either side's ranges end. Every block lands byte-identical at the
/// caller's index without touching the pool (nothing cached or advertised
/// by the reader), the metrics count the device path, and the owner's
/// lease ends exactly once, as released, listing the leased device blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_blocks_land_device_to_device_and_the_lease_ends_once() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let (d, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let kp = register_paged(&p.engine, NS, 32);
        let kd = register_default(&d.engine, 32);
        let hs = hashes(7100..7112);
        let lease = prefill_leased(&p.engine, &kp, &hs, Duration::from_secs(30)).await;
        assert_eq!(p.engine.device_leases_live(), 1);
        let wanted = wanted(&hs, 10);
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!((got.fetch.fetched, got.ready()), (12, 12), "{:?}", got.fetch);
        assert_landed(&d.engine, &kd, &hs, 10);
        let m = d.engine.metrics();
        assert_eq!(m.device_blocks.load(Ordering::Relaxed), 12);
        assert_eq!(m.device_bytes.load(Ordering::Relaxed), 12 * kd.block_bytes());
        assert_eq!(m.device_fallbacks.load(Ordering::Relaxed), 0);
        assert_eq!(m.fetched_bytes.load(Ordering::Relaxed), 0, "no block went through the pool");
        assert_eq!(d.engine.query_prefix(NS, &hs), 0, "device-direct blocks are not cached by the reader");
        assert!(
            eventually(Duration::from_secs(5), || p.engine.device_leases_live() == 0).await,
            "the reader's release ends the lease"
        );
        let ended = p.engine.ended_device_leases();
        assert_eq!(ended.len(), 1);
        assert_eq!((ended[0].id, ended[0].end), (lease, LeaseEnd::Released));
        assert_eq!(ended[0].blocks, (0..12).collect::<Vec<u64>>());
        assert!(p.engine.ended_device_leases().is_empty(), "ended exactly once");
        // A second reader finds no lease: the pool path serves it.
        let (e, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let ke = register_default(&e.engine, 32);
        let got = e.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!(got.ready(), 12);
        assert_eq!(e.engine.metrics().device_blocks.load(Ordering::Relaxed), 0);
        assert_landed(&e.engine, &ke, &hs, 10);
    })
    .await;
}

/// A device-direct fetch takes no pool slots: the reader's pool, full of
/// its own saved blocks, keeps every one of them (nothing evicted, nothing
/// unregistered) while the leased blocks land in its KV. (The slots a part
/// would need if it fell back are taken only then; the fallback is
/// `a_block_changed_under_its_lease_is_read_from_the_pool`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_direct_fetch_evicts_nothing_from_the_readers_pool() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let (d, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let kp = register_default(&p.engine, 32);
        // 32 KiB blocks: 12 fetched into 0..12, its own 128 saved from 32..
        let kd = register_default(&d.engine, 160);
        // The reader's own blocks, as many as its 4 MiB pool holds.
        let own = hashes(9000..9000 + 4 * MIB / kd.block_bytes());
        let rep = d.engine.save(NS, &fill_blocks(&d.engine, &kd, 32, &own)).await.expect("save");
        assert_eq!(rep.saved.len(), own.len(), "the pool holds them all");
        assert_eq!(d.engine.query_prefix(NS, &own), own.len());
        let hs = hashes(7400..7412);
        prefill_leased(&p.engine, &kp, &hs, Duration::from_secs(30)).await;
        let wanted = wanted(&hs, 0);
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!((got.fetch.fetched, got.ready()), (12, 12), "{:?}", got.fetch);
        assert_landed(&d.engine, &kd, &hs, 0);
        let m = d.engine.metrics();
        assert_eq!(m.device_blocks.load(Ordering::Relaxed), 12);
        assert_eq!(m.evicted.load(Ordering::Relaxed), 0, "no pool slot was taken for the device copy");
        assert_eq!(d.engine.query_prefix(NS, &own), own.len(), "the reader's own blocks are all resident");
    })
    .await;
}

/// The owner breaks its promise: it overwrites a leased device block
/// after the save. The device copy's slot checksums differ from the
/// owner's, the part falls back to the owner's pool (which kept the saved
/// bytes), and every block still lands byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_changed_under_its_lease_is_read_from_the_pool() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node_cfg(cfg(&ms, PathChoice::Auto)).await;
        let (d, _) = start_node_cfg(cfg(&ms, PathChoice::Auto)).await;
        let kp = register_default(&p.engine, 16);
        let kd = register_default(&d.engine, 16);
        let hs = hashes(7200..7206);
        prefill_leased(&p.engine, &kp, &hs, Duration::from_secs(30)).await;
        clear(&p.engine, &kp, 3);
        let wanted = wanted(&hs, 0);
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!(got.ready(), 6, "{:?}", got.fetch);
        assert_landed(&d.engine, &kd, &hs, 0);
        let m = d.engine.metrics();
        assert!(m.device_fallbacks.load(Ordering::Relaxed) >= 1);
        assert!(m.checksum_failures.load(Ordering::Relaxed) >= 1);
        assert!(m.fetched_bytes.load(Ordering::Relaxed) > 0, "the fallback read the pool");
    })
    .await;
}

/// A part that falls back while the reader's pool cannot give it every
/// slot: the reader's own blocks fill the pool and all but two are held
/// by a transfer lock (nothing frees their memory). The part expected to
/// go device to device fails its checksums (a leased block changed), takes
/// the two slots it can get, reads those two blocks from the owner's pool
/// and keeps them; the fetch stops at the third with `NoSpace` (before,
/// the short part failed whole, as a transport error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_the_pool_cannot_serve_keeps_what_it_read_and_stops_with_no_space() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node_cfg(cfg(&ms, PathChoice::Auto)).await;
        let (d, _) = start_node_cfg(cfg(&ms, PathChoice::Auto)).await;
        let kp = register_default(&p.engine, 16);
        let kd = register_default(&d.engine, 160);
        let own = hashes(9100..9100 + 4 * MIB / kd.block_bytes());
        let rep = d.engine.save(NS, &fill_blocks(&d.engine, &kd, 32, &own)).await.expect("save");
        assert_eq!(rep.saved.len(), own.len(), "the pool holds them all");
        let (session, held) = d.engine.lock_for_transfer(NS, &own[2..]).expect("lock");
        assert_eq!(held.len(), own.len() - 2);
        let hs = hashes(7500..7506);
        prefill_leased(&p.engine, &kp, &hs, Duration::from_secs(30)).await;
        clear(&p.engine, &kp, 3);
        let wanted = wanted(&hs, 0);
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!(got.fetch.stopped, Some(FetchError::NoSpace), "{:?}", got.fetch);
        assert_eq!((got.fetch.available, got.ready()), (2, 2), "{:?}", got.fetch);
        assert_landed(&d.engine, &kd, &hs[..2], 0);
        let m = d.engine.metrics();
        assert_eq!(m.device_fallbacks.load(Ordering::Relaxed), 1);
        assert_eq!(m.fetched_blocks.load(Ordering::Relaxed), 2, "the two blocks with slots came through the pool");
        d.engine.release_transfer(&session.expect("a session")).expect("release");
        drop(held);
    })
    .await;
}

/// A lease that expired before the fetch, one the owner revoked by
/// unregistering its layout, and blocks never leased: the fetch reads the
/// pool, the ends are reported as expired and revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_revoked_and_unleased_blocks_take_the_pool_path() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let (d, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
        let kp = register_default(&p.engine, 16);
        let kd = register_default(&d.engine, 16);
        let hs = hashes(7300..7304);
        let lease = prefill_leased(&p.engine, &kp, &hs, Duration::from_millis(1)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let wanted = wanted(&hs, 0);
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!(got.ready(), 4);
        assert_eq!(d.engine.metrics().device_blocks.load(Ordering::Relaxed), 0);
        let ended = p.engine.ended_device_leases();
        assert_eq!(ended.iter().map(|e| (e.id, e.end)).collect::<Vec<_>>(), vec![(lease, LeaseEnd::Expired)]);
        assert_landed(&d.engine, &kd, &hs, 0);
        // Revocation: unregistering the layout ends the lease at once.
        let lease = p.engine.grant_device_lease(NS, &[(hs[0].clone(), 0)], Duration::from_secs(30)).unwrap();
        p.engine.unregister_layout(NS).unwrap();
        let ended = p.engine.ended_device_leases();
        assert_eq!(ended.iter().map(|e| (e.id, e.end)).collect::<Vec<_>>(), vec![(lease, LeaseEnd::Revoked)]);
        assert!(!p.engine.end_device_lease(lease), "a lease ends once");
    })
    .await;
}

/// Readers that must not get device ranges do not: a node forced to TCP,
/// and — straight over gRPC — an asker of another process (not proven on
/// this host) or of an unknown handle kind. The lease stays untaken for a reader that may.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_paths_and_foreign_askers_get_no_device_ranges() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node_cfg(cfg(&ms, PathChoice::Auto)).await;
        let (t, _) = start_node_cfg(cfg(&ms, PathChoice::Tcp)).await;
        let kp = register_default(&p.engine, 16);
        let _kt = register_default(&t.engine, 16);
        let hs = hashes(7400..7403);
        prefill_leased(&p.engine, &kp, &hs, Duration::from_secs(30)).await;
        let wanted = wanted(&hs, 0);
        assert_eq!(t.engine.fetch_into(NS, &wanted).await.unwrap().ready(), 3);
        assert_eq!(
            t.engine.metrics().device_blocks.load(Ordering::Relaxed),
            0,
            "--path tcp never copies device to device"
        );
        let mut c = EngineClient::connect(format!("http://{}", p.node.0)).await.unwrap();
        let ask = |kind, pid| QueryBlocksForTransferRequest {
            namespace: NS.into(),
            block_hashes: hs.iter().map(|h| h.0.clone()).collect(),
            requester_id: t.node.0.clone(),
            device: Some(DeviceCapability { kind, pid }),
            compact_slots: false,
            packed_blocks: false,
        };
        let other = std::process::id() + 1;
        for (kind, pid) in [(1, other), (2, other), (99, std::process::id())] {
            let r = c.query_blocks_for_transfer(ask(kind, pid)).await.unwrap().into_inner();
            assert!(!r.transfer_session_id.is_empty());
            assert!(r.device_buffers.is_empty(), "kind {kind} pid {pid}");
            assert!(r.device_layout.is_none() && r.blocks.iter().all(|b| b.device_block.is_none()));
        }
        assert_eq!(p.engine.device_leases_live(), 1);
        // The right asker gets every block's ranges: a reader in this
        // process, as an in-process token even when it opens CUDA IPC
        // handles (those do not open in the process that made them).
        let r = c.query_blocks_for_transfer(ask(1, std::process::id())).await.unwrap().into_inner();
        assert_eq!(r.device_buffers.len(), 1);
        assert_eq!(r.device_buffers[0].kind, 2, "an in-process token");
        assert!(r.device_lease_ms_left > 0);
        assert!(r.blocks.iter().all(|b| b.device_block.is_some()));
        let dl = r.device_layout.as_ref().expect("a device layout");
        assert_eq!((dl.num_blocks, dl.runs.len()), (16, 2 * kp.layers.len()), "one run per layer and segment, once");
        // ...and a second session asking again gets none: one reader.
        let r = c.query_blocks_for_transfer(ask(2, std::process::id())).await.unwrap().into_inner();
        assert!(r.device_buffers.is_empty());
    })
    .await;
}

/// Bad grants: unknown namespace, an index past the layout, a ttl of 0 or
/// past the limit, a block named twice or already leased — each a typed
/// error, and nothing leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grants_are_refused_and_change_nothing() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 8);
        let hs = hashes(7500..7502);
        let e = &p.engine;
        let sec = Duration::from_secs(1);
        assert!(matches!(
            e.grant_device_lease("nope", &[(hs[0].clone(), 0)], sec),
            Err(EngineError::UnknownNamespace(_))
        ));
        assert!(matches!(e.grant_device_lease(NS, &[(hs[0].clone(), 8)], sec), Err(EngineError::BlockIndex { .. })));
        assert!(matches!(e.grant_device_lease(NS, &[(hs[0].clone(), 0)], Duration::ZERO), Err(EngineError::Lease(_))));
        assert!(matches!(
            e.grant_device_lease(NS, &[(hs[0].clone(), 0)], Duration::from_secs(3600)),
            Err(EngineError::Lease(_))
        ));
        assert!(matches!(e.grant_device_lease(NS, &[], sec), Err(EngineError::Lease(_))));
        assert!(matches!(
            e.grant_device_lease(NS, &[(hs[0].clone(), 0), (hs[1].clone(), 0)], sec),
            Err(EngineError::Lease(_))
        ));
        assert_eq!(e.device_leases_live(), 0);
        e.grant_device_lease(NS, &[(hs[0].clone(), 0)], sec).unwrap();
        assert!(matches!(e.grant_device_lease(NS, &[(hs[0].clone(), 1)], sec), Err(EngineError::Lease(_))));
        assert_eq!(e.device_leases_live(), 1);
        drop(kp);
    })
    .await;
}

/// How a [`Tampering`] owner rewrites its transfer answers (given the
/// request's block hashes).
type Tamper = fn(&mut QueryBlocksForTransferResponse, &[bytes::Bytes]);

/// The owner's real P2P service with its `QueryBlocksForTransfer` answers
/// rewritten on the way out: what a broken or hostile same-host owner
/// could send. Everything else is passed through.
struct Tampering {
    inner: P2pTransferService,
    tamper: Tamper,
}

#[tonic::async_trait]
impl EngineRpc for Tampering {
    async fn register_context_batch(
        &self,
        r: Request<RegisterContextBatchRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        self.inner.register_context_batch(r).await
    }
    async fn save(&self, r: Request<SaveRequest>) -> Result<Response<SimpleResponse>, Status> {
        self.inner.save(r).await
    }
    async fn load(&self, r: Request<LoadRequest>) -> Result<Response<SimpleResponse>, Status> {
        self.inner.load(r).await
    }
    async fn query_prefetch(&self, r: Request<QueryPrefetchRequest>) -> Result<Response<SimpleResponse>, Status> {
        self.inner.query_prefetch(r).await
    }
    async fn release(&self, r: Request<ReleaseRequest>) -> Result<Response<SimpleResponse>, Status> {
        self.inner.release(r).await
    }
    async fn unregister_context(
        &self,
        r: Request<UnregisterContextRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        self.inner.unregister_context(r).await
    }
    async fn shutdown(&self, r: Request<ShutdownRequest>) -> Result<Response<SimpleResponse>, Status> {
        self.inner.shutdown(r).await
    }
    type SessionStream = <P2pTransferService as EngineRpc>::SessionStream;
    async fn session(&self, r: Request<SessionRequest>) -> Result<Response<Self::SessionStream>, Status> {
        self.inner.session(r).await
    }
    async fn rdma_handshake(
        &self,
        r: Request<RdmaHandshakeRequest>,
    ) -> Result<Response<RdmaHandshakeResponse>, Status> {
        self.inner.rdma_handshake(r).await
    }
    async fn query_blocks_for_transfer(
        &self,
        r: Request<QueryBlocksForTransferRequest>,
    ) -> Result<Response<QueryBlocksForTransferResponse>, Status> {
        let asked = r.get_ref().block_hashes.clone();
        let mut answer = self.inner.query_blocks_for_transfer(r).await?.into_inner();
        (self.tamper)(&mut answer, &asked);
        Ok(Response::new(answer))
    }
    async fn release_transfer_lock(
        &self,
        r: Request<ReleaseTransferLockRequest>,
    ) -> Result<Response<ReleaseTransferLockResponse>, Status> {
        self.inner.release_transfer_lock(r).await
    }
    async fn health(&self, r: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        self.inner.health(r).await
    }
}

/// An owner assembled from the parts `node::start` uses (engine, TCP data
/// plane, P2P service), serving through [`Tampering`]; its KV is the
/// paged shape (a K and a V tensor per layer; returned, to keep its memory
/// alive) with `hs` saved in device blocks `0..` under a device lease.
async fn tampering_owner(ms: &kvferry::metaserver::MetaServerHandle, hs: &[BlockHash], tamper: Tamper) -> (Engine, Kv) {
    let bound = kvferry::rt::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let port = bound.local_addr.port();
    let node = NodeAddr::parse(&format!("127.0.0.1:{port}")).unwrap();
    let session = SessionId::random(&mut rand::rngs::StdRng::seed_from_u64(u64::from(port)));
    let mut cc = ClientConfig::new(format!("http://{}", ms.local_addr), node.clone(), session);
    // Longer than the shared RPC_TIMEOUT: this owner's first registration
    // (which also opens the channel) must land for the cases to mean
    // anything, and on a loaded 2-core box it took over 500 ms (dropped: 6).
    cc.rpc_timeout = Duration::from_secs(5);
    let client = MetaServerClient::start(cc).unwrap();
    let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
    let engine = Engine::new(node.clone(), engine_cfg(4 * MIB), gpu, client).unwrap();
    let transport = TcpTransport::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1",
        node,
        engine.pool().arena_len(),
        engine.data_source(),
        kvferry::limits::TCP_CONNECTIONS_PER_PEER_DEFAULT,
    )
    .await
    .unwrap();
    engine.set_transport(Arc::new(transport));
    let svc = Tampering { inner: P2pTransferService::new(engine.clone()), tamper };
    let router = kvferry::rt::server_builder().add_service(EngineServer::new(svc));
    tokio::spawn(kvferry::rt::serve(router, bound, std::future::pending()));
    let kv = register_paged(&engine, NS, 16);
    prefill_leased(&engine, &kv, hs, Duration::from_secs(30)).await;
    (engine, kv)
}

/// Rewrites a packed answer as an owner that does not know the packed
/// form answers: a compact `TransferBlockInfo` per block.
fn unpack(r: &mut QueryBlocksForTransferResponse, asked: &[bytes::Bytes]) {
    let per = r.slot_shapes.len();
    r.blocks = r
        .packed_index
        .iter()
        .enumerate()
        .map(|(i, &at)| TransferBlockInfo {
            block_hash: asked[at as usize].clone(),
            pool_offset: Some(r.packed_pool_offset[i]),
            slot_crc32c: r.packed_slot_crc32c[i * per..(i + 1) * per].to_vec(),
            device_block: r.packed_device_block.get(i).copied(),
            ..Default::default()
        })
        .collect();
    assert!(!r.blocks.is_empty(), "the fetch asked for the packed answer");
    r.packed_index.clear();
    r.packed_pool_offset.clear();
    r.packed_slot_crc32c.clear();
    r.packed_device_block.clear();
}

/// A same-host owner's device half is input from the network: a layout
/// run past its export, an export shorter than the layout, a layout of
/// another family, too many runs, zero blocks, a block index past the
/// layout — each refused before any copy, and every block read from the
/// owner's pool instead, byte-identical. A layout that is in bounds but
/// points every block at the next one's bytes is copied, fails the slot
/// checksums (C10) and is re-read from the pool. The untampered owner
/// (first case) copies device to device, so each case can fail; so does
/// an owner that answers a record per block instead of the packed
/// columns the fetch asked for (an owner without that form).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_device_answers_are_read_from_the_pool() {
    // (what the owner does, blocks expected device to device)
    let cases: [(&str, Tamper, u64); 9] = [
        ("untampered", |_, _| {}, 6),
        ("a record per block (an owner without the packed answer)", unpack, 6),
        ("a run past its export", |r, _| r.device_layout.as_mut().unwrap().runs[5].offset += 1, 0),
        ("an export shorter than the layout", |r, _| r.device_buffers.iter_mut().for_each(|b| b.len -= 1), 0),
        ("another family", |r, _| r.device_layout.as_mut().unwrap().runs[0].len *= 2, 0),
        (
            "too many runs",
            |r, _| {
                let l = r.device_layout.as_mut().unwrap();
                l.runs = vec![l.runs[0]; kvferry::limits::DEVICE_LAYOUT_RUNS_MAX + 1];
            },
            0,
        ),
        ("zero blocks", |r, _| r.device_layout.as_mut().unwrap().num_blocks = 0, 0),
        (
            "block indices past the layout",
            |r, _| {
                // kvferry's fetch asks for the packed answer (columns).
                let n = r.device_layout.as_ref().unwrap().num_blocks;
                r.packed_device_block.iter_mut().for_each(|b| *b = n);
            },
            0,
        ),
        ("every block pointed at the next one", |r, _| r.packed_device_block.iter_mut().for_each(|b| *b += 1), 0),
    ];
    bounded(async {
        let ms = start_ms().await;
        for (i, (name, tamper, device)) in cases.into_iter().enumerate() {
            let hs = hashes(7600 + 100 * i as u64..7606 + 100 * i as u64);
            let _owner = tampering_owner(&ms, &hs, tamper).await;
            let (d, _) = start_node_cfg(cfg(&ms, PathChoice::Ipc)).await;
            let kd = register_default(&d.engine, 16);
            let wanted = wanted(&hs, 0);
            let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
            assert_eq!(got.ready(), 6, "{name}: {:?}", got.fetch);
            for (j, h) in hs.iter().enumerate() {
                assert!(verify(&d.engine, &kd, j as u64, h), "{name}: block {j} byte-identical");
            }
            let m = d.engine.metrics();
            assert_eq!(m.device_blocks.load(Ordering::Relaxed), device, "{name}");
            if device == 0 {
                assert!(m.fetched_bytes.load(Ordering::Relaxed) >= 6 * kd.block_bytes(), "{name}: read from the pool");
            }
            if name == "every block pointed at the next one" {
                assert!(m.checksum_failures.load(Ordering::Relaxed) >= 1, "{name}: the copy was judged (C10)");
                assert!(m.device_fallbacks.load(Ordering::Relaxed) >= 1, "{name}");
            }
        }
    })
    .await;
}
