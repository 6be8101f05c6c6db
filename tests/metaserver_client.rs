//! Real-tokio integration tests of the MetaServer client against the real
//! MetaServer service (and, where a fake is needed, a fake MetaServer or a raw
//! TCP listener): contracts C1–C7 over the wire, plus the service's input
//! validation (wire.md) and a taken port (C12).
//!
//! | test | contract |
//! | --- | --- |
//! | `flush_delivers_inserts_and_removes_before_ack` | C1 |
//! | `flush_acks_a_permanently_rejected_hash_as_dropped` | C1, C3 |
//! | `flush_returns_at_once_after_shutdown` | C2, C4 |
//! | `flush_bounded_when_server_accepts_tcp_but_never_answers` | C2, C3 |
//! | `flush_bounded_when_server_stalls_then_recovers` | C2, C1 |
//! | `flush_bounded_when_server_is_down` | C2 |
//! | `flush_terminates_while_producers_keep_enqueueing` | C1, C2, C4 |
//! | `netting_and_chunking_exact_over_the_wire` | batching (§2.3), C1 |
//! | `accounting_identity_holds_after_each_phase` | C4, C3 |
//! | `backfill_after_metaserver_restart_on_same_port` | C6 |
//! | `wire_round_trip_two_clients_prefix_order` | C5, C7 |
//! | `bad_input_*` | wire.md errors, C5 |
//! | `start_on_taken_port_fails_with_bind_error` | C12 |
//! | `io_threads_serve_concurrent_clients_and_stop_on_shutdown` | C5, C7 (I/O threads, offloaded writes) |

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvferry::client::{ClientConfig, FlushReport, MetaServerClient, OwnershipSource, QueueConfig};
use kvferry::limits;
use kvferry::metaserver::service::StartError;
use kvferry::metaserver::{self, MetaServerConfig, MetaServerHandle};
use kvferry::proto;
use kvferry::proto::meta_server_client::MetaServerClient as RawClient;
use kvferry::types::{BlockHash, NodeAddr, SessionId};
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

const NS: &str = "qwen3-8b/bf16/tp1/bt16";

// ---------------------------------------------------------------- helpers

/// A real MetaServer plus a clock that is never behind the server's own
/// (taken just before `start`), for the store's `now_ms` arguments.
struct Server {
    handle: MetaServerHandle,
    t0: Instant,
}

impl Server {
    fn addr(&self) -> SocketAddr {
        self.handle.local_addr
    }

    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    fn owners(&self, ns: &str, h: &BlockHash) -> Vec<NodeAddr> {
        let now = self.now_ms();
        self.handle.store_for_testing().lock().unwrap().owners(ns, h, now)
    }

    fn visible(&self) -> BTreeSet<(String, BlockHash, NodeAddr)> {
        let now = self.now_ms();
        self.handle.store_for_testing().lock().unwrap().visible_entries(now)
    }
}

fn server_config(addr: SocketAddr, stale_after_secs: u64) -> MetaServerConfig {
    let mut cfg = MetaServerConfig::new(addr);
    cfg.stale_after_secs = stale_after_secs;
    cfg.ttl_secs = cfg.ttl_secs.max(stale_after_secs);
    cfg.seed = 7;
    cfg
}

async fn spawn_server_at(addr: SocketAddr, stale_after_secs: u64) -> Server {
    let t0 = Instant::now();
    let handle = metaserver::start(server_config(addr, stale_after_secs)).await.expect("metaserver starts");
    Server { handle, t0 }
}

async fn spawn_server() -> Server {
    spawn_server_at("127.0.0.1:0".parse().unwrap(), limits::STALE_AFTER_SECS_DEFAULT).await
}

fn node(i: u32) -> NodeAddr {
    NodeAddr::parse(&format!("10.0.0.{i}:7000")).unwrap()
}

fn session(tag: &str) -> SessionId {
    static N: AtomicU64 = AtomicU64::new(0);
    SessionId::parse(&format!("{tag}-{}", N.fetch_add(1, Ordering::Relaxed))).unwrap()
}

fn h(i: u64) -> BlockHash {
    BlockHash::from_u64(i)
}

fn hs(range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(h).collect()
}

fn client_config(metaserver: impl Into<String>, n: NodeAddr, rpc_ms: u64) -> ClientConfig {
    let mut cfg = ClientConfig::new(metaserver, n, session("c"));
    cfg.rpc_timeout = Duration::from_millis(rpc_ms);
    cfg
}

fn start_client(cfg: ClientConfig) -> MetaServerClient {
    MetaServerClient::start(cfg).expect("client starts")
}

/// Waits (bounded) until the client has had one successful heartbeat.
async fn registered(c: &MetaServerClient) {
    let t = Instant::now();
    while c.metrics().heartbeats_ok.load(Ordering::Relaxed) == 0 {
        assert!(t.elapsed() < Duration::from_secs(5), "client never heartbeated");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `f`, failing the test if it takes longer than `bound` ("does not hang").
async fn within<T>(bound: Duration, what: &str, f: impl std::future::Future<Output = T>) -> T {
    let t = Instant::now();
    let out = tokio::time::timeout(bound, f).await.unwrap_or_else(|_| panic!("{what} did not return within {bound:?}"));
    assert!(t.elapsed() <= bound, "{what} took {:?} (bound {bound:?})", t.elapsed());
    out
}

async fn raw(addr: SocketAddr) -> RawClient<Channel> {
    RawClient::connect(format!("http://{addr}")).await.expect("raw client connects")
}

fn heartbeat_req(n: &NodeAddr, s: &SessionId) -> proto::HeartbeatNodeRequest {
    proto::HeartbeatNodeRequest { node: n.0.clone(), node_id: s.0.clone() }
}

fn insert_req(n: &NodeAddr, s: &SessionId, hashes: &[BlockHash]) -> proto::InsertBlockHashesRequest {
    proto::InsertBlockHashesRequest {
        namespace: NS.into(),
        block_hashes: hashes.iter().map(|x| x.0.clone()).collect(),
        node: n.0.clone(),
        node_id: s.0.clone(),
    }
}

fn remove_req(n: &NodeAddr, s: &SessionId, hashes: &[BlockHash]) -> proto::RemoveBlockHashesRequest {
    proto::RemoveBlockHashesRequest {
        namespace: NS.into(),
        block_hashes: hashes.iter().map(|x| x.0.clone()).collect(),
        node: n.0.clone(),
        node_id: s.0.clone(),
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected an error status, got Ok({v:?})"),
        Err(s) => s.code(),
    }
}

// ---------------------------------------------------------------- C1

/// C1: after `flush()` returns, the store holds every insert and reflects
/// every remove offered before the call — checked right after the flush,
/// several rounds, with offers split over many calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_delivers_inserts_and_removes_before_ack() {
    let srv = spawn_server().await;
    let me = node(1);
    let c = start_client(client_config(srv.addr().to_string(), me.clone(), 500));
    let mut live: BTreeSet<u64> = BTreeSet::new();
    for round in 0..5u64 {
        let base = round * 1_000;
        for part in 0..10u64 {
            let ids = base + part * 50..base + part * 50 + 50;
            assert_eq!(c.try_register(NS, &hs(ids.clone())), 50);
            live.extend(ids);
            tokio::task::yield_now().await;
        }
        // Remove every third live hash (some from earlier rounds).
        let gone: Vec<u64> = live.iter().copied().filter(|i| i % 3 == round % 3).collect();
        let gone_h: Vec<BlockHash> = gone.iter().map(|&i| h(i)).collect();
        assert_eq!(c.try_unregister(NS, &gone_h), gone_h.len());
        for i in &gone {
            live.remove(i);
        }
        let report = within(Duration::from_secs(5), "flush", c.flush()).await;
        assert_eq!(report, FlushReport { delivered: 500 + gone.len() as u64, dropped: 0, timed_out: false });
        // No sleeping, no retry: the store must already show everything.
        let want: BTreeSet<(String, BlockHash, NodeAddr)> =
            live.iter().map(|&i| (NS.to_string(), h(i), me.clone())).collect();
        assert_eq!(srv.visible(), want, "round {round}: store after flush");
        for i in &gone {
            assert!(srv.owners(NS, &h(*i)).is_empty(), "removed hash {i} still visible");
        }
    }
    assert!(c.counters().identity_holds());
}

/// C1/C3 ack-on-drop: a hash the server permanently rejects is isolated by
/// bisection and dropped (counted once); its batch-mates are delivered and
/// visible when flush returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_acks_a_permanently_rejected_hash_as_dropped() {
    let srv = spawn_server().await;
    let poison = h(37);
    *srv.handle.hooks.reject_hash.lock().unwrap() = Some(poison.clone());
    let me = node(1);
    let c = start_client(client_config(srv.addr().to_string(), me.clone(), 500));
    registered(&c).await;
    let all = hs(0..100);
    assert_eq!(c.try_register(NS, &all), 100);
    let report = within(Duration::from_secs(10), "flush", c.flush()).await;
    assert_eq!(report, FlushReport { delivered: 99, dropped: 1, timed_out: false });
    let k = c.counters();
    assert_eq!(k.dropped_rejected, 1);
    assert_eq!(k.dropped(), 1);
    assert!(k.identity_holds() && k.pending == 0, "{k:?}");
    // Bisection took more than one RPC but far fewer than one per hash.
    let rpcs = c.metrics().chunk_rpcs.load(Ordering::Relaxed);
    assert!(rpcs > 1 && rpcs <= 1 + 2 * u64::from(limits::REJECT_BISECT_DEPTH_MAX), "chunk rpcs {rpcs}");
    for x in &all {
        let want = if *x == poison { vec![] } else { vec![me.clone()] };
        assert_eq!(srv.owners(NS, x), want, "{x:?}");
    }
}

// ---------------------------------------------------------------- C2

/// C2: after `shutdown`, flush returns at once, offers are dropped and
/// counted; a flush already waiting on a stalled server is released too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_returns_at_once_after_shutdown() {
    let srv = spawn_server().await;
    let c = start_client(client_config(srv.addr().to_string(), node(1), 400));
    registered(&c).await;
    // A flush stuck behind a stalled server (long RPC deadline).
    srv.handle.hooks.stall.store(true, Ordering::Relaxed);
    assert_eq!(c.try_register(NS, &hs(0..10)), 10);
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move { c.flush().await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    within(Duration::from_secs(2), "shutdown", c.shutdown(Duration::from_millis(200))).await;
    let r = within(Duration::from_secs(1), "waiting flush after shutdown", waiting).await.unwrap();
    assert_eq!(r, FlushReport { delivered: 0, dropped: 10, timed_out: false });
    srv.handle.hooks.stall.store(false, Ordering::Relaxed);

    let before = c.counters();
    assert_eq!(c.try_register(NS, &hs(100..105)), 0, "offers after shutdown are refused");
    assert_eq!(c.try_unregister(NS, &hs(0..2)), 0);
    let after = c.counters();
    assert_eq!(after.offered - before.offered, 7);
    assert_eq!(after.dropped_shutdown - before.dropped_shutdown, 7);
    let r = within(Duration::from_secs(1), "flush after shutdown", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 0, dropped: 7, timed_out: false });
    let r = within(Duration::from_secs(1), "flush_with_deadline after shutdown", async {
        c.flush_with_deadline(Duration::from_secs(30)).await
    })
    .await;
    assert_eq!(r, FlushReport::default());
    let k = c.counters();
    assert!(k.identity_holds() && k.pending == 0, "{k:?}");
    // Idempotent.
    within(Duration::from_secs(1), "second shutdown", c.shutdown(Duration::from_secs(5))).await;
}

/// Accepts TCP connections and never reads or writes a byte.
async fn black_hole() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

/// C2/C3: a server that accepts TCP and never answers: `flush_with_deadline`
/// and `flush` both return within a bound, and the report shows the drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_bounded_when_server_accepts_tcp_but_never_answers() {
    let (addr, hole) = black_hole().await;
    let rpc = Duration::from_millis(300);
    let c = start_client(client_config(addr.to_string(), node(1), rpc.as_millis() as u64));

    // A short deadline gives up with timed_out.
    assert_eq!(c.try_register(NS, &hs(0..5)), 5);
    let r = within(rpc * 3, "flush_with_deadline(100ms)", c.flush_with_deadline(Duration::from_millis(100))).await;
    assert!(r.timed_out, "{r:?}");

    // A long deadline: every covered command gets a fate (dropped).
    assert_eq!(c.try_register(NS, &hs(5..15)), 10);
    let r = within(Duration::from_secs(5), "flush_with_deadline(30s)", c.flush_with_deadline(Duration::from_secs(30)))
        .await;
    assert_eq!(r, FlushReport { delivered: 0, dropped: 10, timed_out: false });

    // Plain flush.
    assert_eq!(c.try_register(NS, &hs(15..35)), 20);
    let r = within(Duration::from_secs(5), "flush", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 0, dropped: 20, timed_out: false });
    let k = c.counters();
    assert_eq!(k.delivered, 0);
    assert_eq!(k.dropped_rpc_failed, 35);
    assert!(k.identity_holds() && k.pending == 0, "{k:?}");
    assert_eq!(c.metrics().heartbeats_ok.load(Ordering::Relaxed), 0);
    within(Duration::from_secs(2), "shutdown", c.shutdown(rpc)).await;
    hole.abort();
}

/// C2 then C1: while the real server stalls (accepts, never answers) flush
/// returns with drops; once it recovers, flush delivers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_bounded_when_server_stalls_then_recovers() {
    let srv = spawn_server().await;
    let me = node(1);
    let c = start_client(client_config(srv.addr().to_string(), me.clone(), 300));
    registered(&c).await;
    srv.handle.hooks.stall.store(true, Ordering::Relaxed);
    assert_eq!(c.try_register(NS, &hs(0..10)), 10);
    let r = within(Duration::from_secs(3), "flush_with_deadline", c.flush_with_deadline(Duration::from_secs(30))).await;
    assert_eq!(r, FlushReport { delivered: 0, dropped: 10, timed_out: false });
    assert_eq!(c.try_register(NS, &hs(10..20)), 10);
    let r = within(Duration::from_secs(3), "flush", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 0, dropped: 10, timed_out: false });
    assert!(srv.visible().is_empty());

    srv.handle.hooks.stall.store(false, Ordering::Relaxed);
    assert_eq!(c.try_register(NS, &hs(20..30)), 10);
    let r = within(Duration::from_secs(5), "flush after recovery", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 10, dropped: 0, timed_out: false });
    for x in hs(20..30) {
        assert_eq!(srv.owners(NS, &x), vec![me.clone()]);
    }
    assert!(c.counters().identity_holds());
}

/// C2: nothing listens on the MetaServer port at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_bounded_when_server_is_down() {
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let c = start_client(client_config(addr.to_string(), node(1), 300));
    assert_eq!(c.try_register(NS, &hs(0..10)), 10);
    let r = within(Duration::from_secs(3), "flush", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 0, dropped: 10, timed_out: false });
    let q =
        within(Duration::from_secs(1), "query_prefix", c.query_prefix(NS, &hs(0..3), Duration::from_millis(300))).await;
    assert!(q.is_err());
    assert!(c.counters().identity_holds());
}

/// C1/C2/C4: flush terminates while other tasks keep enqueueing (bounded
/// producers), and everything offered before a flush has a fate when it
/// returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_terminates_while_producers_keep_enqueueing() {
    let srv = spawn_server().await;
    let c = start_client(client_config(srv.addr().to_string(), node(1), 500));
    registered(&c).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut producers = Vec::new();
    for p in 0..3u64 {
        let (c, stop) = (c.clone(), stop.clone());
        producers.push(tokio::spawn(async move {
            let t = Instant::now();
            let mut next = p << 40;
            let mut offers = 0u64;
            // Bounded in count and time, whatever the flusher does.
            while !stop.load(Ordering::Relaxed) && offers < 2_000_000 && t.elapsed() < Duration::from_secs(20) {
                let batch: Vec<BlockHash> = (next..next + 32).map(h).collect();
                next += 32;
                offers += 32;
                c.try_register(NS, &batch);
                if next % 64 == 0 {
                    c.try_unregister(NS, &batch[..8]);
                    offers += 8;
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            offers
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    for i in 0..10 {
        let before = c.counters().offered;
        let r = within(Duration::from_secs(10), "flush under load", c.flush()).await;
        assert!(!r.timed_out);
        let k = c.counters();
        assert!(k.identity_holds(), "{k:?}");
        // Everything offered before the flush has a fate.
        assert!(k.delivered + k.dropped() >= before, "flush {i}: {k:?}, {before} offered before");
    }
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for p in producers {
        total += within(Duration::from_secs(5), "producer", p).await.unwrap();
    }
    within(Duration::from_secs(10), "final flush", c.flush()).await;
    let k = c.counters();
    assert_eq!(k.offered, total);
    assert!(k.identity_holds() && k.pending == 0, "{k:?}");
    assert!(k.delivered > 0);
}

// ---------------------------------------------------------------- batching over the wire

/// A fake MetaServer that records every write it receives; heartbeats wait
/// on a gate so a test can queue everything before the first batch.
#[derive(Clone)]
struct Recorder {
    inserts: Arc<Mutex<Vec<Vec<Bytes>>>>,
    removes: Arc<Mutex<Vec<Vec<Bytes>>>>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Recorder {
    /// A recorder whose heartbeat gate starts closed.
    fn gated() -> Self {
        Self { inserts: Arc::default(), removes: Arc::default(), gate: Arc::new(tokio::sync::Semaphore::new(0)) }
    }
}

#[tonic::async_trait]
impl proto::meta_server_server::MetaServer for Recorder {
    async fn heartbeat_node(
        &self,
        _r: tonic::Request<proto::HeartbeatNodeRequest>,
    ) -> Result<tonic::Response<proto::HeartbeatNodeResponse>, tonic::Status> {
        let _permit = self.gate.acquire().await.expect("gate open");
        Ok(tonic::Response::new(proto::HeartbeatNodeResponse { stale_after_secs: 30, new_session: true }))
    }
    async fn unregister_node(
        &self,
        _r: tonic::Request<proto::UnregisterNodeRequest>,
    ) -> Result<tonic::Response<proto::UnregisterNodeResponse>, tonic::Status> {
        Ok(tonic::Response::new(proto::UnregisterNodeResponse { removed_owners: 0 }))
    }
    async fn insert_block_hashes(
        &self,
        r: tonic::Request<proto::InsertBlockHashesRequest>,
    ) -> Result<tonic::Response<proto::InsertBlockHashesResponse>, tonic::Status> {
        let r = r.into_inner();
        let n = r.block_hashes.len() as u64;
        self.inserts.lock().unwrap().push(r.block_hashes);
        Ok(tonic::Response::new(proto::InsertBlockHashesResponse {
            status: Some(proto::ResponseStatus { ok: true, message: String::new() }),
            inserted_count: n,
            reclaimable_hashes: vec![],
        }))
    }
    async fn remove_block_hashes(
        &self,
        r: tonic::Request<proto::RemoveBlockHashesRequest>,
    ) -> Result<tonic::Response<proto::RemoveBlockHashesResponse>, tonic::Status> {
        let r = r.into_inner();
        let n = r.block_hashes.len() as u64;
        self.removes.lock().unwrap().push(r.block_hashes);
        Ok(tonic::Response::new(proto::RemoveBlockHashesResponse {
            status: Some(proto::ResponseStatus { ok: true, message: String::new() }),
            removed_count: n,
        }))
    }
    async fn query_prefix_blocks(
        &self,
        _r: tonic::Request<proto::QueryPrefixBlocksRequest>,
    ) -> Result<tonic::Response<proto::QueryPrefixBlocksResponse>, tonic::Status> {
        Ok(tonic::Response::new(proto::QueryPrefixBlocksResponse { nodes: vec![] }))
    }
}

async fn spawn_fake(fake: Recorder) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let bound = kvferry::rt::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = bound.local_addr;
    let svc = proto::meta_server_server::MetaServerServer::new(fake)
        .max_decoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX);
    let router = tonic::transport::Server::builder().add_service(svc);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(kvferry::rt::serve(router, bound, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// Batching: 10×16,384+1 distinct inserts (each offered twice), plus keys
/// inserted then removed, all in one batch → exactly 11 insert RPCs whose
/// union is the input with no hash sent twice, and one remove RPC carrying
/// exactly the netted removes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netting_and_chunking_exact_over_the_wire() {
    let fake = Recorder::gated();
    let (addr, _stop) = spawn_fake(fake.clone()).await;
    let n = 10 * limits::HASHES_PER_REQUEST_MAX as u64 + 1;
    let mut cfg = client_config(addr.to_string(), node(1), 10_000);
    cfg.queue = QueueConfig { depth_max: 2 * n as usize + 1_000, ..QueueConfig::default() };
    let c = start_client(cfg);
    // The driver is now blocked in its first heartbeat: queue everything.
    let inputs = hs(0..n);
    let netted_out = hs(1 << 40..(1 << 40) + 300);
    assert_eq!(c.try_register(NS, &inputs), n as usize);
    assert_eq!(c.try_register(NS, &netted_out), 300);
    assert_eq!(c.try_register(NS, &inputs), n as usize);
    assert_eq!(c.try_unregister(NS, &netted_out), 300);
    fake.gate.add_permits(1_000);
    let r = within(Duration::from_secs(60), "flush", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 2 * n + 600, dropped: 0, timed_out: false });

    let inserts = fake.inserts.lock().unwrap().clone();
    let removes = fake.removes.lock().unwrap().clone();
    assert_eq!(inserts.len(), 11, "insert RPCs");
    assert!(inserts.iter().all(|r| r.len() <= limits::HASHES_PER_REQUEST_MAX));
    let sent: usize = inserts.iter().map(Vec::len).sum();
    assert_eq!(sent as u64, n, "each distinct hash sent exactly once");
    let union: BTreeSet<Bytes> = inserts.iter().flatten().cloned().collect();
    let want: BTreeSet<Bytes> = inputs.iter().map(|x| x.0.clone()).collect();
    assert_eq!(union, want);
    assert_eq!(removes.len(), 1, "remove RPCs");
    let got: BTreeSet<Bytes> = removes[0].iter().cloned().collect();
    assert_eq!(got, netted_out.iter().map(|x| x.0.clone()).collect::<BTreeSet<_>>());
    assert_eq!(removes[0].len(), 300);
    assert_eq!(c.metrics().chunk_rpcs.load(Ordering::Relaxed), 12);
    assert!(c.counters().identity_holds());
}

// ---------------------------------------------------------------- C4

/// C4 (and C3): `offered == delivered + dropped + pending` after every phase
/// of a mixed workload with queue-full drops, dropped RPCs and a stall; each
/// completed flush reports exactly the commands of its window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounting_identity_holds_after_each_phase() {
    let srv = spawn_server().await;
    srv.handle.hooks.drop_writes_ppm.store(400_000, Ordering::Relaxed);
    let mut cfg = client_config(srv.addr().to_string(), node(1), 500);
    cfg.queue = QueueConfig { depth_max: 64, ..QueueConfig::default() };
    let c = start_client(cfg);
    registered(&c).await;
    let check = |phase: &str| {
        let k = c.counters();
        assert!(k.identity_holds(), "{phase}: {k:?}");
        k
    };

    // Phase 1: a burst larger than the queue.
    assert_eq!(c.try_register(NS, &hs(0..1_000)), 64);
    let k = check("burst");
    assert!(k.dropped_queue_full >= 1_000 - 64, "{k:?}");
    let r = within(Duration::from_secs(5), "flush 1", c.flush()).await;
    assert_eq!(r.delivered + r.dropped, 1_000, "{r:?}");
    check("flush 1");

    // Phase 2: many small rounds of inserts and removes with dropped RPCs.
    let mut offered_since = 0u64;
    for round in 0..30u64 {
        let ids = hs(10_000 + round * 40..10_000 + round * 40 + 40);
        c.try_register(NS, &ids);
        check("insert round");
        c.try_unregister(NS, &ids[..10]);
        check("remove round");
        offered_since += 50;
        if round % 3 == 2 {
            let r = within(Duration::from_secs(5), "flush 2", c.flush()).await;
            assert_eq!(r.delivered + r.dropped, offered_since, "{r:?}");
            offered_since = 0;
            check("flush 2");
        } else {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let k = check("phase 2");
    assert!(k.dropped_rpc_failed > 0, "drop_writes_ppm dropped nothing: {k:?}");
    assert!(k.delivered > 0, "{k:?}");
    assert!(srv.handle.hooks.dropped_writes.load(Ordering::Relaxed) > 0);

    // Phase 3: a stall; a short-deadline flush gives up with commands pending.
    srv.handle.hooks.stall.store(true, Ordering::Relaxed);
    c.try_register(NS, &hs(50_000..50_040));
    let r = within(Duration::from_secs(2), "flush 3", c.flush_with_deadline(Duration::from_millis(50))).await;
    assert!(r.timed_out);
    let k = check("stalled");
    assert!(k.pending > 0, "{k:?}");

    // Phase 4: recover; everything gets a fate.
    srv.handle.hooks.stall.store(false, Ordering::Relaxed);
    srv.handle.hooks.drop_writes_ppm.store(0, Ordering::Relaxed);
    c.try_register(NS, &hs(60_000..60_010));
    within(Duration::from_secs(5), "flush 4", c.flush()).await;
    let k = check("recovered");
    assert_eq!(k.pending, 0);
    assert_eq!(k.offered, k.offered_inserts + k.offered_removes);

    // Phase 5: shutdown with commands queued.
    srv.handle.hooks.stall.store(true, Ordering::Relaxed);
    c.try_register(NS, &hs(70_000..70_030));
    c.shutdown(Duration::from_millis(100)).await;
    let k = check("shutdown");
    assert_eq!(k.pending, 0);
    assert!(k.dropped_shutdown > 0, "{k:?}");
    srv.handle.hooks.stall.store(false, Ordering::Relaxed);
}

// ---------------------------------------------------------------- C6

struct Fixed(Vec<(String, Vec<BlockHash>)>);

impl OwnershipSource for Fixed {
    fn resident_blocks(&self) -> Vec<(String, Vec<BlockHash>)> {
        self.0.clone()
    }
}

/// C6: the MetaServer restarts (empty) on the same port; the client's next
/// heartbeat sees `new_session` and re-advertises every resident block with
/// no new offer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_after_metaserver_restart_on_same_port() {
    let srv = spawn_server_at("127.0.0.1:0".parse().unwrap(), 1).await;
    let addr = srv.addr();
    let me = node(1);
    let c = start_client(client_config(addr.to_string(), me.clone(), 300));
    let blocks = vec![(NS.to_string(), hs(0..40)), ("other-ns".to_string(), hs(500..520))];
    c.set_ownership_source(Arc::new(Fixed(blocks.clone())));
    registered(&c).await;
    for (ns, b) in &blocks {
        c.try_register(ns, b);
    }
    let r = within(Duration::from_secs(5), "flush", c.flush()).await;
    assert_eq!(r, FlushReport { delivered: 60, dropped: 0, timed_out: false });
    let want: BTreeSet<(String, BlockHash, NodeAddr)> =
        blocks.iter().flat_map(|(ns, b)| b.iter().map(|x| (ns.clone(), x.clone(), me.clone()))).collect();
    assert_eq!(srv.visible(), want);
    let offered = c.counters().offered;
    assert_eq!(c.metrics().backfills.load(Ordering::Relaxed), 0, "no backfill on first contact");

    srv.handle.shutdown().await.expect("clean shutdown");
    let srv2 = spawn_server_at(addr, 1).await;
    assert_eq!(srv2.addr(), addr);
    assert!(srv2.visible().is_empty());

    let t = Instant::now();
    loop {
        if srv2.visible() == want {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "blocks not backfilled: {:?}", srv2.visible().len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(c.counters().offered, offered, "backfill needs no new offers");
    assert!(c.metrics().backfills.load(Ordering::Relaxed) >= 1);
    assert!(c.metrics().backfilled_hashes.load(Ordering::Relaxed) >= 60);
    // Still there a few heartbeat periods later (the client keeps its new
    // session alive); polled, since a heartbeat late under load may make the
    // blocks invisible for a moment.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let t = Instant::now();
    while srv2.visible() != want {
        assert!(t.elapsed() < Duration::from_secs(3), "backfilled blocks vanished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.shutdown(Duration::from_millis(300)).await;
}

// ---------------------------------------------------------------- C5 / C7 round trip

/// Heartbeat, insert, query_prefix (A:4, B:3 ordering across two clients),
/// remove, unregister — client ↔ service over the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_round_trip_two_clients_prefix_order() {
    let srv = spawn_server().await;
    let (na, nb) = (node(1), node(2));
    let a = start_client(client_config(srv.addr().to_string(), na.clone(), 500));
    let b = start_client(client_config(format!("http://{}", srv.addr()), nb.clone(), 500));
    registered(&a).await;
    registered(&b).await;
    {
        let store = srv.handle.store_for_testing();
        let st = store.lock().unwrap();
        assert_eq!(st.node_session(&na).map(|x| x.0), Some(a.session().clone()));
        assert_eq!(st.node_session(&nb).map(|x| x.0), Some(b.session().clone()));
    }
    let q = [h(1), h(2), h(3), h(4)];
    a.try_register(NS, &q);
    b.try_register(NS, &[h(1), h(2), h(3), h(5)]);
    assert_eq!(a.flush().await.delivered, 4);
    assert_eq!(b.flush().await.delivered, 4);
    let d = Duration::from_secs(2);
    assert_eq!(a.query_prefix(NS, &q, d).await.unwrap(), vec![(na.clone(), 4), (nb.clone(), 3)]);
    assert_eq!(b.query_prefix(NS, &q, d).await.unwrap(), vec![(na.clone(), 4), (nb.clone(), 3)]);
    assert_eq!(a.query_prefix("no-such-ns", &q, d).await.unwrap(), vec![]);
    // An empty query is a client-visible error, not a panic or an empty answer.
    match a.query_prefix(NS, &[], d).await {
        Err(kvferry::client::ClientError::Rpc(s)) => assert_eq!(s.code(), Code::InvalidArgument),
        other => panic!("empty query: {other:?}"),
    }

    // Remove: A loses h2, so its prefix is 1.
    assert_eq!(a.try_unregister(NS, &[h(2)]), 1);
    assert_eq!(a.flush().await.delivered, 1);
    assert_eq!(a.query_prefix(NS, &q, d).await.unwrap(), vec![(nb.clone(), 3), (na.clone(), 1)]);

    // Unregister (shutdown): A's record and ownerships are gone.
    a.shutdown(d).await;
    assert_eq!(srv.handle.store_for_testing().lock().unwrap().node_session(&na), None);
    assert_eq!(b.query_prefix(NS, &q, d).await.unwrap(), vec![(nb.clone(), 3)]);
    assert_eq!(srv.owners(NS, &h(4)), vec![]);
    b.shutdown(d).await;
    assert!(srv.visible().is_empty());
}

// ---------------------------------------------------------------- bad input (raw tonic client)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_empty_query_is_invalid_argument() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let req = proto::QueryPrefixBlocksRequest { namespace: NS.into(), block_hashes: vec![] };
    assert_eq!(code(g.query_prefix_blocks(req).await), Code::InvalidArgument);
    // An empty namespace and an empty hash are malformed too.
    let req = proto::QueryPrefixBlocksRequest { namespace: String::new(), block_hashes: vec![h(1).0] };
    assert_eq!(code(g.query_prefix_blocks(req).await), Code::InvalidArgument);
    let req = proto::QueryPrefixBlocksRequest { namespace: NS.into(), block_hashes: vec![Bytes::new()] };
    assert_eq!(code(g.query_prefix_blocks(req).await), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_malformed_node_id_is_invalid_argument() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let n = node(1);
    let bad = SessionId("not a session!".into());
    assert_eq!(code(g.heartbeat_node(heartbeat_req(&n, &bad)).await), Code::InvalidArgument);
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &bad, &[h(1)])).await), Code::InvalidArgument);
    assert_eq!(code(g.remove_block_hashes(remove_req(&n, &bad, &[h(1)])).await), Code::InvalidArgument);
    let empty = SessionId(String::new());
    assert_eq!(code(g.heartbeat_node(heartbeat_req(&n, &empty)).await), Code::InvalidArgument);
    let long = SessionId("a".repeat(limits::SESSION_ID_BYTES_MAX + 1));
    assert_eq!(code(g.heartbeat_node(heartbeat_req(&n, &long)).await), Code::InvalidArgument);
    // A malformed node address too.
    let req = proto::HeartbeatNodeRequest { node: "no-port".into(), node_id: "s1".into() };
    assert_eq!(code(g.heartbeat_node(req).await), Code::InvalidArgument);
    assert!(srv.handle.store_for_testing().lock().unwrap().node_session(&n).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_unknown_node_write_is_failed_precondition() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let (n, s) = (node(1), session("s"));
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s, &[h(1)])).await), Code::FailedPrecondition);
    assert_eq!(code(g.remove_block_hashes(remove_req(&n, &s, &[h(1)])).await), Code::FailedPrecondition);
    assert!(srv.visible().is_empty());
    // After a heartbeat the same write succeeds.
    g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
    let r = g.insert_block_hashes(insert_req(&n, &s, &[h(1)])).await.unwrap().into_inner();
    assert_eq!(r.inserted_count, 1);
    assert_eq!(srv.owners(NS, &h(1)), vec![n]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_stale_session_write_is_failed_precondition() {
    let srv = spawn_server_at("127.0.0.1:0".parse().unwrap(), 1).await;
    let mut g = raw(srv.addr()).await;
    let (n, s1, s2) = (node(1), session("s"), session("s"));
    g.heartbeat_node(heartbeat_req(&n, &s1)).await.unwrap();
    g.insert_block_hashes(insert_req(&n, &s1, &[h(1)])).await.unwrap();
    // Another session on the node's address is fenced.
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s2, &[h(2)])).await), Code::FailedPrecondition);
    assert_eq!(code(g.remove_block_hashes(remove_req(&n, &s2, &[h(1)])).await), Code::FailedPrecondition);
    assert_eq!(srv.owners(NS, &h(1)), vec![n.clone()]);
    assert!(srv.owners(NS, &h(2)).is_empty());
    // The node's own session, once its record is stale, is fenced too.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s1, &[h(3)])).await), Code::FailedPrecondition);
    // A heartbeat refreshes it and writes pass again.
    g.heartbeat_node(heartbeat_req(&n, &s1)).await.unwrap();
    g.insert_block_hashes(insert_req(&n, &s1, &[h(3)])).await.unwrap();
    assert_eq!(srv.owners(NS, &h(3)), vec![n]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_too_many_hashes_is_invalid_argument_and_writes_nothing() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let (n, s) = (node(1), session("s"));
    g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
    let max = limits::HASHES_PER_REQUEST_MAX as u64;
    let too_many = hs(0..max + 1);
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s, &too_many)).await), Code::InvalidArgument);
    assert_eq!(srv.handle.store_for_testing().lock().unwrap().stats().hashes, 0, "nothing written");
    let req = proto::QueryPrefixBlocksRequest {
        namespace: NS.into(),
        block_hashes: too_many.iter().map(|x| x.0.clone()).collect(),
    };
    assert_eq!(code(g.query_prefix_blocks(req).await), Code::InvalidArgument);
    // One malformed hash poisons the whole request: all or nothing.
    let mut mixed: Vec<BlockHash> = hs(0..10);
    mixed.push(BlockHash::new(vec![0u8; limits::BLOCK_HASH_BYTES_MAX + 1]));
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s, &mixed)).await), Code::InvalidArgument);
    assert_eq!(srv.handle.store_for_testing().lock().unwrap().stats().hashes, 0, "nothing written");
    // Exactly at the limit is accepted.
    let r = g.insert_block_hashes(insert_req(&n, &s, &too_many[..max as usize])).await.unwrap().into_inner();
    assert_eq!(r.inserted_count, max);
    assert_eq!(code(g.remove_block_hashes(remove_req(&n, &s, &too_many)).await), Code::InvalidArgument);
    assert_eq!(
        srv.handle.store_for_testing().lock().unwrap().stats().hashes,
        max,
        "remove over the limit removed nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_oversized_message_is_resource_exhausted() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await.max_encoding_message_size(usize::MAX);
    let req = proto::QueryPrefixBlocksRequest {
        namespace: "n".repeat(limits::GRPC_MESSAGE_BYTES_MAX + (1 << 20)),
        block_hashes: vec![h(1).0],
    };
    let c = within(Duration::from_secs(30), "oversized query", g.query_prefix_blocks(req)).await;
    assert_eq!(code(c), Code::ResourceExhausted);
    // The server stays healthy.
    let req = proto::QueryPrefixBlocksRequest { namespace: NS.into(), block_hashes: vec![h(1).0] };
    let mut g = raw(srv.addr()).await;
    assert!(g.query_prefix_blocks(req).await.unwrap().into_inner().nodes.is_empty());
}

/// A heartbeat of a different session while the address's session is live
/// answers FAILED_PRECONDITION, as the peer MetaServer does (its clients
/// reset their registered flag and heartbeat again); the live session keeps
/// the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_second_live_session_is_failed_precondition() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let (n, s1, s2) = (node(1), session("s"), session("s"));
    let r = g.heartbeat_node(heartbeat_req(&n, &s1)).await.unwrap().into_inner();
    assert!(r.new_session);
    assert_eq!(r.stale_after_secs, limits::STALE_AFTER_SECS_DEFAULT);
    let refused = g.heartbeat_node(heartbeat_req(&n, &s2)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains("live session"), "{}", refused.message());
    let r = g.heartbeat_node(heartbeat_req(&n, &s1)).await.unwrap().into_inner();
    assert!(!r.new_session, "a refresh is not a new session");
    assert_eq!(srv.handle.store_for_testing().lock().unwrap().node_session(&n).map(|x| x.0), Some(s1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_late_unregister_of_old_session_is_a_noop() {
    let srv = spawn_server_at("127.0.0.1:0".parse().unwrap(), 1).await;
    let mut g = raw(srv.addr()).await;
    let (n, old, new) = (node(1), session("old"), session("new"));
    g.heartbeat_node(heartbeat_req(&n, &old)).await.unwrap();
    g.insert_block_hashes(insert_req(&n, &old, &hs(0..5))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_300)).await; // old goes stale
    let r = g.heartbeat_node(heartbeat_req(&n, &new)).await.unwrap().into_inner();
    assert!(r.new_session, "takeover after the old session went stale");
    g.insert_block_hashes(insert_req(&n, &new, &hs(3..8))).await.unwrap();
    let r = g
        .unregister_node(proto::UnregisterNodeRequest { node: n.0.clone(), node_id: old.0.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.removed_owners, 0);
    assert_eq!(srv.handle.store_for_testing().lock().unwrap().node_session(&n).map(|x| x.0), Some(new.clone()));
    g.heartbeat_node(heartbeat_req(&n, &new)).await.unwrap(); // stay fresh for the checks below
    for x in hs(3..8) {
        assert_eq!(srv.owners(NS, &x), vec![n.clone()]);
    }
    for x in hs(0..3) {
        assert!(srv.owners(NS, &x).is_empty(), "old session's blocks dropped at takeover");
    }
    // The live session's unregister does remove.
    let r = g
        .unregister_node(proto::UnregisterNodeRequest { node: n.0.clone(), node_id: new.0.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.removed_owners, 5);
    assert!(srv.visible().is_empty());
}

// ---------------------------------------------------------------- C12

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_on_taken_port_fails_with_bind_error() {
    let srv = spawn_server().await;
    let taken = srv.addr();
    match metaserver::start(server_config(taken, 30)).await {
        Err(StartError::Bind { addr, source }) => {
            assert_eq!(addr, taken);
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(h) => panic!("second server bound {}", h.local_addr),
    }
    // A port held by a plain listener, too.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let held = l.local_addr().unwrap();
    assert!(matches!(metaserver::start(server_config(held, 30)).await, Err(StartError::Bind { .. })));
    // The first server is unaffected.
    let mut g = raw(taken).await;
    g.heartbeat_node(heartbeat_req(&node(1), &session("s"))).await.unwrap();
}

// ---------------------------------------------------------------- wire status table

/// One row of the status table in docs/wire.md: an RPC in a situation and
/// the gRPC code the peer MetaServer's clients expect for it.
fn expect_code<T: std::fmt::Debug>(row: &str, got: Result<tonic::Response<T>, tonic::Status>, want: Code) {
    let got = match got {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    };
    assert_eq!(got, want, "status table row {row:?}");
}

/// Pins every status code of every MetaServer RPC (the table in
/// docs/wire.md, section "Status codes"), row by row, over the wire. The
/// oversized-message row is `bad_input_oversized_message_is_resource_exhausted`
/// and the fault rows (`INTERNAL`, `UNAVAILABLE`) are the `fault_*` tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_status_table_every_metaserver_rpc() {
    let srv = spawn_server_at("127.0.0.1:0".parse().unwrap(), 1).await;
    let mut g = raw(srv.addr()).await;
    let (n, s1, s2) = (node(1), session("s"), session("s"));
    let bad_id = SessionId("not a session!".into());
    let bad_node = NodeAddr("no-port".into());
    let with_ns = |mut r: proto::InsertBlockHashesRequest, ns: &str| {
        r.namespace = ns.into();
        r
    };
    let too_many = hs(0..limits::HASHES_PER_REQUEST_MAX as u64 + 1);
    let long_hash = [BlockHash::new(vec![1u8; limits::BLOCK_HASH_BYTES_MAX + 1])];

    // HeartbeatNode
    expect_code("heartbeat: new node", g.heartbeat_node(heartbeat_req(&n, &s1)).await, Code::Ok);
    expect_code("heartbeat: same session", g.heartbeat_node(heartbeat_req(&n, &s1)).await, Code::Ok);
    expect_code(
        "heartbeat: other live session",
        g.heartbeat_node(heartbeat_req(&n, &s2)).await,
        Code::FailedPrecondition,
    );
    expect_code(
        "heartbeat: malformed node_id",
        g.heartbeat_node(heartbeat_req(&n, &bad_id)).await,
        Code::InvalidArgument,
    );
    expect_code(
        "heartbeat: malformed node",
        g.heartbeat_node(heartbeat_req(&bad_node, &s1)).await,
        Code::InvalidArgument,
    );

    // InsertBlockHashes
    expect_code("insert: live session", g.insert_block_hashes(insert_req(&n, &s1, &hs(0..4))).await, Code::Ok);
    expect_code("insert: no hashes", g.insert_block_hashes(insert_req(&n, &s1, &[])).await, Code::Ok);
    expect_code(
        "insert: unknown node",
        g.insert_block_hashes(insert_req(&node(2), &s1, &hs(0..1))).await,
        Code::FailedPrecondition,
    );
    expect_code(
        "insert: other session",
        g.insert_block_hashes(insert_req(&n, &s2, &hs(0..1))).await,
        Code::FailedPrecondition,
    );
    expect_code(
        "insert: malformed node_id",
        g.insert_block_hashes(insert_req(&n, &bad_id, &hs(0..1))).await,
        Code::InvalidArgument,
    );
    expect_code(
        "insert: malformed node",
        g.insert_block_hashes(insert_req(&bad_node, &s1, &hs(0..1))).await,
        Code::InvalidArgument,
    );
    expect_code(
        "insert: empty namespace",
        g.insert_block_hashes(with_ns(insert_req(&n, &s1, &hs(0..1)), "")).await,
        Code::InvalidArgument,
    );
    expect_code(
        "insert: too many hashes",
        g.insert_block_hashes(insert_req(&n, &s1, &too_many)).await,
        Code::InvalidArgument,
    );
    expect_code(
        "insert: hash too long",
        g.insert_block_hashes(insert_req(&n, &s1, &long_hash)).await,
        Code::InvalidArgument,
    );

    // RemoveBlockHashes
    expect_code("remove: live session", g.remove_block_hashes(remove_req(&n, &s1, &hs(3..4))).await, Code::Ok);
    expect_code("remove: not owned", g.remove_block_hashes(remove_req(&n, &s1, &hs(90..91))).await, Code::Ok);
    expect_code(
        "remove: unknown node",
        g.remove_block_hashes(remove_req(&node(2), &s1, &hs(0..1))).await,
        Code::FailedPrecondition,
    );
    expect_code(
        "remove: other session",
        g.remove_block_hashes(remove_req(&n, &s2, &hs(0..1))).await,
        Code::FailedPrecondition,
    );
    expect_code(
        "remove: malformed node_id",
        g.remove_block_hashes(remove_req(&n, &bad_id, &hs(0..1))).await,
        Code::InvalidArgument,
    );
    expect_code(
        "remove: too many hashes",
        g.remove_block_hashes(remove_req(&n, &s1, &too_many)).await,
        Code::InvalidArgument,
    );

    // QueryPrefixBlocks
    let query = |ns: &str, hashes: &[BlockHash]| proto::QueryPrefixBlocksRequest {
        namespace: ns.into(),
        block_hashes: hashes.iter().map(|x| x.0.clone()).collect(),
    };
    expect_code("query: prefix", g.query_prefix_blocks(query(NS, &hs(0..3))).await, Code::Ok);
    expect_code("query: nothing owned", g.query_prefix_blocks(query(NS, &hs(50..53))).await, Code::Ok);
    expect_code("query: no hashes", g.query_prefix_blocks(query(NS, &[])).await, Code::InvalidArgument);
    expect_code("query: empty namespace", g.query_prefix_blocks(query("", &hs(0..1))).await, Code::InvalidArgument);
    expect_code("query: too many hashes", g.query_prefix_blocks(query(NS, &too_many)).await, Code::InvalidArgument);
    expect_code("query: hash too long", g.query_prefix_blocks(query(NS, &long_hash)).await, Code::InvalidArgument);

    // UnregisterNode: a no-op, never an error, for anything well formed.
    let unreg = |n: &NodeAddr, s: &SessionId| proto::UnregisterNodeRequest { node: n.0.clone(), node_id: s.0.clone() };
    expect_code("unregister: other session", g.unregister_node(unreg(&n, &s2)).await, Code::Ok);
    expect_code("unregister: unknown node", g.unregister_node(unreg(&node(2), &s1)).await, Code::Ok);
    expect_code("unregister: malformed node_id", g.unregister_node(unreg(&n, &bad_id)).await, Code::InvalidArgument);

    // Stale: writes of the stale session are fenced; a new session takes over.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    expect_code(
        "insert: stale session",
        g.insert_block_hashes(insert_req(&n, &s1, &hs(0..1))).await,
        Code::FailedPrecondition,
    );
    expect_code("heartbeat: other session after stale", g.heartbeat_node(heartbeat_req(&n, &s2)).await, Code::Ok);
    expect_code("unregister: own session", g.unregister_node(unreg(&n, &s2)).await, Code::Ok);
    assert_eq!(srv.handle.store_for_testing().lock().unwrap().node_session(&n), None, "unregistered");
}

// ---------------------------------------------------------------- client vs a refused heartbeat

/// A client whose address is held by another live session is refused with
/// FAILED_PRECONDITION: it is not registered, heartbeats again on its
/// backoff schedule (not in a tight loop, not once per fenced write), and
/// takes over once the other session goes stale, then re-advertises its
/// resident blocks (the registrations fenced meanwhile were dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_refused_heartbeat_backs_off_then_takes_over_and_backfills() {
    let srv = spawn_server_at("127.0.0.1:0".parse().unwrap(), 1).await;
    let mut g = raw(srv.addr()).await;
    let me = node(1);
    let squatter = session("squatter");
    g.heartbeat_node(heartbeat_req(&me, &squatter)).await.unwrap();
    // The squatter stays live for 2.5 s.
    let keep = tokio::spawn({
        let mut g = g.clone();
        let (me, squatter) = (me.clone(), squatter.clone());
        async move {
            for _ in 0..10 {
                let _ = g.heartbeat_node(heartbeat_req(&me, &squatter)).await;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    let c = start_client(client_config(srv.addr().to_string(), me.clone(), 300));
    c.set_ownership_source(Arc::new(Fixed(vec![(NS.to_string(), hs(0..8))])));
    let t = Instant::now();
    while c.metrics().heartbeats_refused.load(Ordering::Relaxed) == 0 {
        assert!(t.elapsed() < Duration::from_secs(3), "heartbeat never refused");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!c.is_registered());
    // Fenced registrations are dropped, and do not each send a heartbeat.
    for i in 0..20 {
        c.try_register(NS, &hs(i..i + 1));
        let r = within(Duration::from_secs(3), "flush while refused", c.flush()).await;
        assert_eq!((r.delivered, r.dropped), (0, 1));
    }
    keep.await.unwrap();
    let refused = c.metrics().heartbeats_refused.load(Ordering::Relaxed);
    // 2.5 s of refusals on a 100 ms doubling backoff is about 5 heartbeats;
    // a tight loop, or one per fenced write, would be hundreds (or >= 20).
    assert!((1..=10).contains(&refused), "{refused} refused heartbeats in 2.5 s");
    assert_eq!(c.metrics().heartbeats_ok.load(Ordering::Relaxed), 0);
    // The squatter goes stale; the client takes over and backfills.
    let want: BTreeSet<(String, BlockHash, NodeAddr)> =
        hs(0..8).into_iter().map(|x| (NS.to_string(), x, me.clone())).collect();
    let t = Instant::now();
    while srv.visible() != want {
        assert!(t.elapsed() < Duration::from_secs(10), "no takeover + backfill: {:?}", srv.visible());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.is_registered());
    assert_eq!(
        srv.handle.store_for_testing().lock().unwrap().node_session(&me).map(|x| x.0),
        Some(c.session().clone())
    );
    c.shutdown(Duration::from_millis(300)).await;
}

// ---------------------------------------------------------------- faults inside the MetaServer

/// A request that panics while holding the store lock answers INTERNAL and
/// is counted; the lock is not poisoned, the store keeps its data, and every
/// later RPC (and the sweep) is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_panic_in_a_request_answers_internal_and_service_keeps_serving() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let (n, s) = (node(1), session("s"));
    g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
    g.insert_block_hashes(insert_req(&n, &s, &hs(0..4))).await.unwrap();
    let hooks = &srv.handle.hooks;
    let m = &srv.handle.metrics;
    // One fault per RPC kind.
    hooks.panic_store_ops.store(1, Ordering::Relaxed);
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s, &hs(4..8))).await), Code::Internal);
    hooks.panic_store_ops.store(1, Ordering::Relaxed);
    assert_eq!(code(g.heartbeat_node(heartbeat_req(&n, &s)).await), Code::Internal);
    hooks.panic_store_ops.store(1, Ordering::Relaxed);
    let q = proto::QueryPrefixBlocksRequest { namespace: NS.into(), block_hashes: vec![h(0).0] };
    assert_eq!(code(g.query_prefix_blocks(q.clone()).await), Code::Internal);
    assert_eq!(m.store_panics.load(Ordering::Relaxed), 3);
    assert!(!srv.handle.store_for_testing().is_poisoned());
    assert_eq!(m.store_resets.load(Ordering::Relaxed), 0, "a consistent store is kept");
    // Still serving, data intact.
    g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
    g.insert_block_hashes(insert_req(&n, &s, &hs(4..8))).await.unwrap();
    let r = g.query_prefix_blocks(q).await.unwrap().into_inner();
    assert_eq!(r.nodes.len(), 1);
    assert_eq!(srv.owners(NS, &h(7)), vec![n.clone()]);
    assert_eq!(srv.visible().len(), 8);
}

/// A panic elsewhere while holding the handle's `store` mutex (an embedder
/// or exporter) does not reach the service: the index locks itself, so the
/// next RPC is served with nothing to recover. (A poisoned lock *inside*
/// the index is recovered by the service: unit tests in
/// `metaserver::service`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_poisoned_handle_mutex_does_not_stop_serving() {
    let srv = spawn_server().await;
    let mut g = raw(srv.addr()).await;
    let (n, s) = (node(1), session("s"));
    g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
    g.insert_block_hashes(insert_req(&n, &s, &hs(0..4))).await.unwrap();
    let store = srv.handle.store_for_testing();
    let _ = std::thread::spawn(move || {
        let _guard = store.lock().unwrap();
        panic!("injected: a holder of the store lock panics");
    })
    .join();
    assert!(srv.handle.store_for_testing().is_poisoned());
    g.insert_block_hashes(insert_req(&n, &s, &hs(4..6))).await.unwrap();
    assert_eq!(srv.handle.metrics.poison_recoveries.load(Ordering::Relaxed), 0);
    assert_eq!(srv.handle.metrics.store_resets.load(Ordering::Relaxed), 0);
    let index = srv.handle.store_for_testing().lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    assert_eq!(index.visible_entries(0).len(), 6);
}

// ---------------------------------------------------------------- I/O threads

/// How many of this process's threads are MetaServer I/O threads.
fn io_thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|n| n.starts_with("kvferry-io-"))
                .count()
        })
        .unwrap_or(0)
}

/// The I/O thread count once it is `n`, or after 5 s.
async fn io_threads_become(n: usize) -> usize {
    let t = Instant::now();
    while io_thread_count() != n && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    io_thread_count()
}

/// A server on two I/O threads answers many clients at once (each on its
/// own connection, so both threads serve), runs writes of at least
/// `METASERVER_OFFLOAD_HASHES` hashes off them with the same answers and
/// fault handling, and on shutdown stops its threads and its port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_threads_serve_concurrent_clients_and_stop_on_shutdown() {
    let mut cfg = server_config("127.0.0.1:0".parse().unwrap(), limits::STALE_AFTER_SECS_DEFAULT);
    cfg.io_threads = 2;
    let t0 = Instant::now();
    let srv = Server { handle: metaserver::start(cfg).await.expect("metaserver starts"), t0 };
    let addr = srv.addr();
    // A thread names itself once it runs: wait (bounded) for both.
    assert_eq!(io_threads_become(2).await, 2, "two I/O threads started");
    let big = limits::METASERVER_OFFLOAD_HASHES as u64 * 2;
    let clients: Vec<_> = (0..6u32)
        .map(|i| {
            tokio::spawn(async move {
                let mut g = raw(addr).await;
                let (n, s) = (node(10 + i), session("io"));
                let base = u64::from(i) << 32;
                g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
                let r = g.insert_block_hashes(insert_req(&n, &s, &hs(base..base + big))).await.unwrap();
                assert_eq!(r.into_inner().inserted_count, big, "offloaded insert");
                let q = proto::QueryPrefixBlocksRequest {
                    namespace: NS.into(),
                    block_hashes: hs(base..base + 64).into_iter().map(|x| x.0).collect(),
                };
                for _ in 0..20 {
                    let got = g.query_prefix_blocks(q.clone()).await.unwrap().into_inner().nodes;
                    assert_eq!(got.len(), 1);
                    assert_eq!((got[0].node.as_str(), got[0].prefix_len), (n.0.as_str(), 64));
                }
                let r = g.remove_block_hashes(remove_req(&n, &s, &hs(base + 10..base + big))).await.unwrap();
                assert_eq!(r.into_inner().removed_count, big - 10, "offloaded removal");
                let got = g.query_prefix_blocks(q).await.unwrap().into_inner().nodes;
                assert_eq!(got[0].prefix_len, 10);
            })
        })
        .collect();
    for c in clients {
        within(Duration::from_secs(30), "a client of the I/O threads", c).await.expect("client task");
    }
    assert_eq!(srv.visible().len(), 6 * 10);

    // A fault inside an offloaded write answers INTERNAL and loses nothing.
    let mut g = raw(addr).await;
    let (n, s) = (node(1), session("s"));
    g.heartbeat_node(heartbeat_req(&n, &s)).await.unwrap();
    srv.handle.hooks.panic_store_ops.store(1, Ordering::Relaxed);
    assert_eq!(code(g.insert_block_hashes(insert_req(&n, &s, &hs(0..big))).await), Code::Internal);
    assert_eq!(srv.handle.metrics.store_panics.load(Ordering::Relaxed), 1);
    g.insert_block_hashes(insert_req(&n, &s, &hs(0..big))).await.unwrap();
    assert_eq!(srv.visible().len(), 6 * 10 + big as usize);
    drop(g);

    within(Duration::from_secs(10), "shutdown", srv.handle.shutdown()).await.expect("clean shutdown");
    assert_eq!(io_threads_become(0).await, 0, "I/O threads ended");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "port closed after shutdown");
}
