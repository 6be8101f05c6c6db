//! P2P transfer service, TCP transport and decode-side fetch (issue "P2P
//! transfer service, TCP transport, fetch"): real nodes and a real MetaServer
//! on loopback.
//!
//! | test | contract |
//! | --- | --- |
//! | `fetch_33_blocks_byte_identical_then_third_node_fetches_from_decode` | §5, C10, C8 release, re-advertise |
//! | `stale_owner_degrades_fast` | C9 (stale owner) |
//! | `owner_killed_mid_read_degrades_within_deadline` | C9 (owner dead), C11, C14 |
//! | `requester_dropped_mid_fetch_releases_or_expires_the_lock` | C8 (cancel → guard; dead requester → GC) |
//! | `metaserver_down_fetch_returns_zero_quickly` | C9 (MetaServer down) |
//! | `fetch_into_with_owners_starts_from_the_callers_answer` | C9, C14 (the caller's MetaServer answer; stale owner) |
//! | `corrupted_byte_on_the_wire_rejects_the_block` | C10, C9 (verified prefix), C14 |
//! | `concurrent_and_mutual_handshakes_are_single_flight` | §5 single-flight handshake |
//! | `stitches_one_prefix_from_two_owners` | C14 |
//! | `taken_port_fails_before_ready` | C12 |
//! | `failed_start_leaves_no_ghost_node_at_the_metaserver` | C12, C5 |
//! | `data_plane_rejects_bad_input_and_keeps_serving` | C13 |
//! | `p2p_grpc_surface` | §2.4, wire.md, C8 idempotent release |
//! | `first_fetch_after_the_owner_restarts_moves_every_block` | §5: a pooled data connection found dead is replaced within the read |
//! | `fetch_reads_in_parts_and_a_bad_part_ends_it` | C10 per part, C11 (extents back), reads pipelined with checksums |
//!
//! Where a test needs an owner to die or freeze at an exact point of a read,
//! the owner is assembled from the same parts as `node::start` on its own
//! one-worker runtime, with a data-plane access policy that can stop the
//! world at the N-th authorized read (`Freeze`); killing that runtime is a
//! process death as far as its peers can tell (sockets closed, no
//! unregister, no lock release).

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use kvferry::client::{ClientConfig, MetaServerClient};
use kvferry::engine::fetch::FetchError;
use kvferry::engine::locks::AccessError;
use kvferry::engine::pool::SealedExtent;
use kvferry::engine::{Engine, slot_checksums};
use kvferry::gpu::Gpu;
use kvferry::gpu::host::HostGpu;
use kvferry::limits;
use kvferry::metaserver::MetaServerConfig;
use kvferry::node::{self, NodeError};
use kvferry::p2p::P2pTransferService;
use kvferry::proto::engine_client::EngineClient;
use kvferry::proto::engine_server::EngineServer;
use kvferry::proto::*;
use kvferry::replay::trace::fill_kv;
use kvferry::transport::frame::{self, ReadRequest, Request, ResponseHeader, Status};
use kvferry::transport::tcp::TcpTransport;
use kvferry::transport::{DataSource, HandshakeMetadata, Transport};
use kvferry::types::{BlockHash, NodeAddr, SessionId};
use rand::SeedableRng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tonic::Code;

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------- helpers

/// Saves `hs` at device blocks `0..` on `e` and waits until they are
/// registered at the MetaServer.
async fn prefill(e: &Engine, kv: &Kv, hs: &[BlockHash]) {
    fill_and_save(e, kv, 0, hs).await;
    let fr = e.flush_saves_and_registrations(Duration::from_secs(3)).await;
    assert_eq!((fr.delivered, fr.dropped, fr.timed_out), (hs.len() as u64, 0, false), "{fr:?}");
}

/// What to do when a frozen read is let go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resume {
    /// Serve it normally.
    Continue,
    /// Unwind the serving task (its connection drops) — used right after the
    /// owner's runtime was shut down.
    Die,
}

#[derive(Default)]
struct FreezeState {
    calls: u64,
    arm_at: Option<u64>,
    frozen: bool,
    resume: Option<Resume>,
}

/// Stops the owner's data plane (and, since the owner runs on one worker,
/// the whole owner) inside the N-th read authorization.
#[derive(Default)]
struct Freeze {
    st: Mutex<FreezeState>,
    cv: Condvar,
}

impl Freeze {
    /// Lets `ok_reads` more reads through, then freezes the next one.
    fn arm_after(&self, ok_reads: u64) {
        let mut st = self.st.lock().unwrap();
        st.arm_at = Some(st.calls + ok_reads + 1);
        st.frozen = false;
        st.resume = None;
    }

    fn is_frozen(&self) -> bool {
        self.st.lock().unwrap().frozen
    }

    fn calls(&self) -> u64 {
        self.st.lock().unwrap().calls
    }

    fn resume(&self, r: Resume) {
        self.st.lock().unwrap().resume = Some(r);
        self.cv.notify_all();
    }
}

struct FreezingSource {
    inner: Arc<dyn DataSource>,
    freeze: Arc<Freeze>,
}

impl DataSource for FreezingSource {
    fn authorize(&self, session: &str, region: u32, offset: u64, len: u64) -> Result<(SealedExtent, u64), AccessError> {
        let mut st = self.freeze.st.lock().unwrap();
        st.calls += 1;
        if st.arm_at == Some(st.calls) {
            st.arm_at = None;
            st.frozen = true;
            // Bounded, so a failing test cannot wedge the owner thread forever.
            let (mut st, _) =
                self.freeze.cv.wait_timeout_while(st, Duration::from_secs(30), |s| s.resume.is_none()).unwrap();
            st.frozen = false;
            let r = st.resume.take();
            drop(st);
            if r == Some(Resume::Die) {
                std::panic::resume_unwind(Box::new("owner killed"));
            }
        } else {
            drop(st);
        }
        self.inner.authorize(session, region, offset, len)
    }
}

/// A node assembled from the parts `node::start` uses, on its own one-worker
/// runtime, serving its data plane through a [`FreezingSource`].
struct Owner {
    rt: Option<tokio::runtime::Runtime>,
    engine: Engine,
    node: NodeAddr,
    transport: Arc<TcpTransport>,
    freeze: Arc<Freeze>,
}

impl Owner {
    /// Starts the owner and prefills `hs` (default small layout, registered).
    async fn start(ms_addr: std::net::SocketAddr, hs: Vec<BlockHash>) -> Owner {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("owner-node")
            .enable_all()
            .build()
            .unwrap();
        let freeze = Arc::new(Freeze::default());
        let f = freeze.clone();
        let (engine, node, transport) = rt
            .spawn(async move {
                let bound = kvferry::rt::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
                let port = bound.local_addr.port();
                let node = NodeAddr::parse(&format!("127.0.0.1:{port}")).unwrap();
                let session = SessionId::random(&mut rand::rngs::StdRng::seed_from_u64(u64::from(port)));
                let mut cc = ClientConfig::new(format!("http://{ms_addr}"), node.clone(), session);
                cc.rpc_timeout = RPC_TIMEOUT;
                let client = MetaServerClient::start(cc).unwrap();
                let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
                let engine = Engine::new(node.clone(), engine_cfg(4 * MIB), gpu, client).unwrap();
                let source = Arc::new(FreezingSource { inner: engine.data_source(), freeze: f });
                let transport = TcpTransport::start(
                    "127.0.0.1:0".parse().unwrap(),
                    "127.0.0.1",
                    node.clone(),
                    engine.pool().arena_len(),
                    source,
                    limits::TCP_CONNECTIONS_PER_PEER_DEFAULT,
                )
                .await
                .unwrap();
                let transport = Arc::new(transport);
                engine.set_transport(transport.clone());
                let router = tonic::transport::Server::builder()
                    .add_service(EngineServer::new(P2pTransferService::new(engine.clone())));
                tokio::spawn(kvferry::rt::serve(router, bound, std::future::pending()));
                let kv = register_default(&engine, 64);
                prefill(&engine, &kv, &hs).await;
                (engine, node, transport)
            })
            .await
            .unwrap();
        Owner { rt: Some(rt), engine, node, transport, freeze }
    }

    /// Process death: every task of the owner is dropped (sockets close), the
    /// frozen read unwinds. No unregister, no release.
    fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        self.freeze.resume(Resume::Die);
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.freeze.resume(Resume::Continue);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Reads one data-plane response (header + payload).
async fn read_response(s: &mut TcpStream) -> (ResponseHeader, Vec<u8>) {
    let mut hdr = [0u8; frame::RESPONSE_HEADER_BYTES];
    tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut hdr))
        .await
        .expect("a response in time")
        .expect("response header");
    let (h, used) = frame::decode_response_header(&hdr).expect("valid header").expect("complete header");
    assert_eq!(used, frame::RESPONSE_HEADER_BYTES);
    let mut payload = vec![0u8; h.len as usize];
    tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut payload))
        .await
        .expect("payload in time")
        .expect("payload");
    (h, payload)
}

/// Asserts the server closed the connection (EOF or reset) within 2 s.
async fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(2), s.read(&mut b)).await {
        Ok(Ok(0)) | Ok(Err(_)) => {}
        other => panic!("connection still open: {other:?}"),
    }
}

fn read_req(req_id: u64, session: &str, region: u32, offset: u64, len: u64) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_request(
        &Request::Read(ReadRequest { req_id, session: session.into(), region, offset, len }),
        &mut out,
    )
    .expect("encodable");
    out
}

async fn connect_raw(addr: &str) -> TcpStream {
    TcpStream::connect(addr).await.expect("connect data plane")
}

// ------------------------------------------------------------------ tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_33_blocks_byte_identical_then_third_node_fetches_from_decode() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let (t, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 40);
        let kd = register_default(&d.engine, 40);
        let kt = register_default(&t.engine, 40);
        let hs = hashes(1..34);
        prefill(&p.engine, &kp, &hs).await;

        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!(rep.requested, 33);
        assert_eq!(rep.available, 33, "{rep:?}");
        assert_eq!((rep.local_hits, rep.fetched), (0, 33));
        assert_eq!(rep.bytes, 33 * BLOCK);
        assert_eq!(rep.owners, vec![p.node.clone()]);
        assert_eq!(rep.stopped, None);
        assert_eq!(d.engine.metrics().fetched_blocks.load(Ordering::Relaxed), 33);
        assert_eq!(d.engine.metrics().checksum_failures.load(Ordering::Relaxed), 0);
        assert_eq!(d.engine.handshaken_peers(), 1);
        // The holder's lock was released by the requester (not left to the GC).
        assert_eq!(p.engine.metrics().transfer_locks_created.load(Ordering::Relaxed), 1);
        assert!(eventually(Duration::from_secs(1), || p.engine.gauges().active_transfer_locks == 0).await);
        assert_eq!(p.engine.metrics().transfer_locks_expired.load(Ordering::Relaxed), 0);
        // Byte-identical on the decode node's device.
        assert_eq!(d.engine.query_prefix(NS, &hs), 33);
        load_and_verify(&d.engine, &kd, 0, &hs).await;
        // The fetched slots carry the checksums of the bytes.
        let (_, layout) = d.engine.layout(NS).unwrap();
        let (sid, locked) = d.engine.lock_for_transfer(NS, &hs[..1]).unwrap();
        assert_eq!(locked[0].1.checksums, slot_checksums(&layout, locked[0].1.extent.as_slice()));
        d.engine.release_transfer(&sid.unwrap()).unwrap();

        // Registered as owned by the decode node after its barrier.
        let fr = d.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((fr.delivered, fr.dropped, fr.timed_out), (33, 0, false), "{fr:?}");
        let mut owners = ms_prefix(&d.engine, NS, &hs).await;
        owners.sort();
        let mut want = vec![(p.node.clone(), 33), (d.node.clone(), 33)];
        want.sort();
        assert_eq!(owners, want);

        // Fetching again is all local.
        let again = d.engine.fetch(NS, &hs).await;
        assert_eq!((again.available, again.local_hits, again.fetched), (33, 33, 0));
        assert!(again.owners.is_empty());

        // The prefill node leaves; a third node fetches everything from the decode node.
        p.shutdown(Duration::from_secs(1)).await;
        assert_eq!(ms_prefix(&t.engine, NS, &hs).await, vec![(d.node.clone(), 33)]);
        let rep = t.engine.fetch(NS, &hs).await;
        assert_eq!((rep.available, rep.fetched), (33, 33), "{rep:?}");
        assert_eq!(rep.owners, vec![d.node.clone()]);
        load_and_verify(&t.engine, &kt, 0, &hs).await;
        assert!(eventually(Duration::from_secs(1), || d.engine.gauges().active_transfer_locks == 0).await);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_degrades_fast() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 16);
        let _kd = register_default(&d.engine, 16);
        let hs = hashes(1..11);
        prefill(&p.engine, &kp, &hs).await;
        // Evict everything while the MetaServer drops the removals.
        ms.hooks.drop_writes_ppm.store(1_000_000, Ordering::SeqCst);
        assert_eq!(p.engine.evict(u64::MAX), 10);
        let fr = p.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((fr.delivered, fr.dropped), (0, 10), "{fr:?}");
        ms.hooks.drop_writes_ppm.store(0, Ordering::SeqCst);
        assert_eq!(ms_prefix(&d.engine, NS, &hs).await, vec![(p.node.clone(), 10)], "the index is stale");

        let t0 = Instant::now();
        let rep = d.engine.fetch(NS, &hs).await;
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(1), "stale owner took {took:?}");
        assert_eq!(rep.available, 0, "{rep:?}");
        assert_eq!(rep.fetched, 0);
        assert_eq!(rep.owners, vec![p.node.clone()]);
        assert_eq!(rep.stopped, Some(FetchError::Stale));
        // Nothing was locked on the owner and nothing leaked on the requester.
        assert_eq!(p.engine.metrics().transfer_locks_created.load(Ordering::Relaxed), 0);
        assert_eq!(p.engine.gauges().active_transfer_locks, 0);
        assert_eq!(d.engine.gauges().pool_used_bytes, 0);
        assert_eq!(d.engine.gauges().resident_blocks, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_killed_mid_read_degrades_within_deadline() {
    bounded(async {
        let ms = start_ms().await;
        let n = 32usize;
        let hs = hashes(1..1 + n as u64);
        let mut owner = Owner::start(ms.local_addr, hs.clone()).await;
        // One connection, so the owner serves the blocks in order.
        let mut dcfg = node_cfg(ms.local_addr, 4 * MIB);
        dcfg.tcp_connections_per_peer = 1;
        let (d, _) = start_node_cfg(dcfg).await;
        let kd = register_default(&d.engine, 64);

        owner.freeze.arm_after(8);
        let fetch = {
            let e = d.engine.clone();
            let hs = hs.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let rep = e.fetch(NS, &hs).await;
                (rep, t0.elapsed())
            })
        };
        assert!(eventually(Duration::from_secs(5), || owner.freeze.is_frozen()).await, "the 9th read never came");
        assert_eq!(owner.engine.gauges().active_transfer_locks, 1);
        // Let the requester drain what was served, then the owner dies mid-batch.
        tokio::time::sleep(Duration::from_millis(100)).await;
        owner.kill();
        let (rep, took) = fetch.await.unwrap();
        assert!(took <= FETCH_DEADLINE + Duration::from_millis(500), "fetch took {took:?}");
        assert_eq!(owner.transport.hooks.reads_served.load(Ordering::Relaxed), 8);
        assert_eq!(rep.available, 8, "the 8 served blocks are the verified prefix: {rep:?}");
        assert!(matches!(rep.stopped, Some(FetchError::Transport(_))), "{rep:?}");
        assert_eq!(rep.owners, vec![owner.node.clone()]);
        // Every accepted block is byte-identical; nothing else is resident.
        assert_eq!(d.engine.query_prefix(NS, &hs), 8);
        assert_eq!(d.engine.gauges().resident_blocks, 8);
        load_and_verify(&d.engine, &kd, 0, &hs[..8]).await;
        // No leak on the live side: no lock, and no pool bytes beyond the 8 blocks.
        assert_eq!(d.engine.gauges().active_transfer_locks, 0);
        assert_eq!(d.engine.gauges().pool_used_bytes, 8 * BLOCK);

        // The dead owner is still listed: a second fetch degrades fast too.
        let t0 = Instant::now();
        let rep2 = d.engine.fetch(NS, &hs).await;
        assert!(t0.elapsed() <= FETCH_DEADLINE + Duration::from_millis(500), "took {:?}", t0.elapsed());
        assert_eq!((rep2.available, rep2.local_hits, rep2.fetched), (8, 8, 0), "{rep2:?}");
        assert!(rep2.stopped.is_some());
        assert_eq!(d.engine.gauges().pool_used_bytes, 8 * BLOCK);

        // A third node skips the dead owner and takes the prefix from the decode node.
        let fr = d.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(fr.dropped, 0);
        let (t, _) = start_node(&ms, 4 * MIB).await;
        let kt = register_default(&t.engine, 64);
        let rep3 = t.engine.fetch(NS, &hs).await;
        assert_eq!(rep3.owners, vec![owner.node.clone(), d.node.clone()], "{rep3:?}");
        assert_eq!(rep3.available, 8, "{rep3:?}");
        load_and_verify(&t.engine, &kt, 0, &hs[..8]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requester_dropped_mid_fetch_releases_or_expires_the_lock() {
    bounded(async {
        let ms = start_ms().await;
        let hs = hashes(1..17);
        let owner = Owner::start(ms.local_addr, hs.clone()).await;
        let pe = owner.engine.clone();

        // (a) The fetch task is aborted mid-read: the guard releases the lock.
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let _kd = register_default(&d.engine, 64);
        owner.freeze.arm_after(3);
        let task = {
            let e = d.engine.clone();
            let hs = hs.clone();
            tokio::spawn(async move { e.fetch(NS, &hs).await })
        };
        assert!(eventually(Duration::from_secs(5), || owner.freeze.is_frozen()).await);
        assert_eq!(pe.gauges().active_transfer_locks, 1);
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        owner.freeze.resume(Resume::Continue);
        assert!(
            eventually(Duration::from_millis(800), || pe.gauges().active_transfer_locks == 0).await,
            "the cancelled requester's guard released the lock before it could expire"
        );
        assert_eq!(pe.metrics().transfer_locks_expired.load(Ordering::Relaxed), 0);
        // The cancelled fetch left nothing half-written behind on the requester.
        assert!(
            eventually(Duration::from_secs(1), || d.engine.gauges().pool_used_bytes
                == d.engine.gauges().resident_blocks * BLOCK)
            .await
        );
        assert_eq!(d.engine.gauges().resident_blocks, 0);

        // (b) The requester process dies mid-read: nobody releases, the owner's GC expires the lock.
        let d2_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dying-requester")
            .enable_all()
            .build()
            .unwrap();
        let ms_addr = ms.local_addr;
        let d2 = d2_rt
            .spawn(async move {
                let (n, _) = start_node_cfg(node_cfg(ms_addr, 4 * MIB)).await;
                let _ = register_default(&n.engine, 64);
                n
            })
            .await
            .unwrap();
        let created = pe.metrics().transfer_locks_created.load(Ordering::Relaxed);
        // Let (a)'s last served connections wind down before re-arming.
        loop {
            let c = owner.freeze.calls();
            tokio::time::sleep(Duration::from_millis(100)).await;
            if owner.freeze.calls() == c {
                break;
            }
        }
        owner.freeze.arm_after(3);
        {
            let e = d2.engine.clone();
            let hs = hs.clone();
            d2_rt.spawn(async move { e.fetch(NS, &hs).await });
        }
        assert!(eventually(Duration::from_secs(5), || owner.freeze.is_frozen()).await);
        assert_eq!(pe.metrics().transfer_locks_created.load(Ordering::Relaxed), created + 1);
        assert_eq!(pe.gauges().active_transfer_locks, 1);
        let killed_at = Instant::now();
        d2_rt.shutdown_background();
        owner.freeze.resume(Resume::Continue);
        let within = Duration::from_secs(u64::from(LOCK_TIMEOUT_SECS)) + Duration::from_secs(1);
        assert!(
            eventually(within, || pe.gauges().active_transfer_locks == 0).await,
            "the lock of a dead requester expires"
        );
        assert!(killed_at.elapsed() >= Duration::from_millis(500), "freed by expiry, not by a release");
        assert_eq!(pe.metrics().transfer_locks_expired.load(Ordering::Relaxed), 1);
        // The owner keeps serving.
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!(rep.available, 16, "{rep:?}");
        drop(d2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metaserver_down_fetch_returns_zero_quickly() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 16);
        let _kd = register_default(&d.engine, 16);
        let hs = hashes(1..9);
        prefill(&p.engine, &kp, &hs).await;
        let _ = tokio::time::timeout(Duration::from_secs(3), ms.shutdown()).await;

        let t0 = Instant::now();
        let rep = d.engine.fetch(NS, &hs).await;
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(1), "fetch took {took:?} with the MetaServer down");
        assert_eq!((rep.requested, rep.available, rep.fetched), (8, 0, 0), "{rep:?}");
        assert!(matches!(rep.stopped, Some(FetchError::MetaServer(_))), "{rep:?}");
        assert!(rep.owners.is_empty());
        assert_eq!(p.engine.metrics().transfer_locks_created.load(Ordering::Relaxed), 0);
        assert_eq!(d.engine.gauges().pool_used_bytes, 0);
    })
    .await;
}

/// `fetch_into_with_owners` starts from the caller's own MetaServer
/// answer: with the MetaServer gone after the query, the fetch still moves
/// every block (no second query); a stale answer (an owner holding
/// nothing) is refused by that owner's lock and the fetch asks the
/// MetaServer for the rest; an answer older than the owner's last save
/// (fewer blocks than it holds now) still gets every block; an answer with
/// no usable owner is not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_with_owners_starts_from_the_callers_answer() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (empty, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let (d2, _) = start_node(&ms, 4 * MIB).await;
        let (d3, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 16);
        let kd3 = register_default(&d3.engine, 16);
        let _ke = register_default(&empty.engine, 16);
        let kd = register_default(&d.engine, 16);
        let kd2 = register_default(&d2.engine, 16);
        let hs = hashes(1..9);
        prefill(&p.engine, &kp, &hs[..3]).await;
        let short = d3.engine.client().query_prefix(NS, &hs, Duration::from_secs(3)).await.unwrap();
        assert_eq!(short, vec![(p.node.clone(), 3)]);
        fill_and_save(&p.engine, &kp, 3, &hs[3..]).await;
        assert_eq!(p.engine.flush_saves_and_registrations(Duration::from_secs(3)).await.delivered, 5);
        let wanted: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(0u64..).collect();
        let until = || tokio::time::Instant::now() + Duration::from_secs(5);
        let owners = d.engine.client().query_prefix(NS, &hs, Duration::from_secs(3)).await.unwrap();
        assert_eq!(owners, vec![(p.node.clone(), 8)]);

        // Older than the owner's last save: the owner is asked for all 8.
        let got = d3.engine.fetch_into_with_owners(NS, &wanted, short, until()).await.unwrap();
        assert_eq!((got.ready(), got.fetch.owners.clone()), (8, vec![p.node.clone()]), "{:?}", got.fetch);
        for (h, i) in &wanted {
            assert!(verify(&d3.engine, &kd3, *i, h), "block {i}");
        }

        // Stale: the named owner holds nothing; the MetaServer names `p`.
        let stale = vec![(empty.node.clone(), 8)];
        let got = d.engine.fetch_into_with_owners(NS, &wanted, stale, until()).await.unwrap();
        assert_eq!(got.ready(), 8, "{:?}", got.fetch);
        // (Then an owner the MetaServer names: `p`, or `d3` by now.)
        assert_eq!((got.fetch.owners.len(), &got.fetch.owners[0]), (2, &empty.node));
        assert_eq!(d.engine.metrics().fetch_known_owners.load(Ordering::Relaxed), 1);
        for (h, i) in &wanted {
            assert!(verify(&d.engine, &kd, *i, h), "block {i}");
        }

        let _ = tokio::time::timeout(Duration::from_secs(3), ms.shutdown()).await;
        // No usable owner in the answer (only the asker, or nothing past
        // zero blocks): asked of the MetaServer, which is down.
        let useless = vec![(d2.node.clone(), 8), (p.node.clone(), 0)];
        let got = d2.engine.fetch_into_with_owners(NS, &wanted, useless, until()).await.unwrap();
        assert_eq!(got.ready(), 0, "{:?}", got.fetch);
        assert!(matches!(got.fetch.stopped, Some(FetchError::MetaServer(_))), "{:?}", got.fetch);
        assert_eq!(d2.engine.metrics().fetch_known_owners.load(Ordering::Relaxed), 0);
        // The answer from before the MetaServer went down: every block.
        let got = d2.engine.fetch_into_with_owners(NS, &wanted, owners, until()).await.unwrap();
        assert_eq!(got.ready(), 8, "{:?}", got.fetch);
        assert_eq!(got.fetch.phases.query, Duration::ZERO, "no MetaServer query");
        assert_eq!(d2.engine.metrics().fetch_known_owners.load(Ordering::Relaxed), 1);
        for (h, i) in &wanted {
            assert!(verify(&d2.engine, &kd2, *i, h), "block {i}");
        }
    })
    .await;
}

/// Whether `e` holds no transfer lock within 500 ms (half the tests' lock
/// timeout) and none of its locks expired meanwhile: every lock was
/// released by its reader, not collected.
async fn no_locks_left(e: &Engine) -> bool {
    let expired = e.metrics().transfer_locks_expired.load(Ordering::Relaxed);
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while e.gauges().active_transfer_locks > 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    e.gauges().active_transfer_locks == 0 && e.metrics().transfer_locks_expired.load(Ordering::Relaxed) == expired
}

/// A transfer ticket (`grant_transfer` → `fetch_into_with_ticket`): the
/// reader moves every block with no MetaServer query and no lock RPC (the
/// owner creates exactly the ticket's lock) and releases it; the ticket
/// survives its bytes. A ticket whose session the owner no longer holds
/// gets its reads refused, and the same owner is then asked with a lock
/// RPC: every block still arrives. A ticket for one block more than the
/// fetch asks for is read from. A ticket granted to another reader, for
/// another prompt, for blocks the reader holds already, or dropped with a
/// fetch that never ran, is released unread.
/// Bad ticket bytes and bad grants are clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_with_ticket_reads_without_query_or_lock_rpc() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let mut d = Vec::new();
        for _ in 0..6 {
            let (n, _) = start_node(&ms, 4 * MIB).await;
            let kv = register_default(&n.engine, 16);
            d.push((n, kv));
        }
        let kp = register_default(&p.engine, 16);
        let hs = hashes(1..9);
        prefill(&p.engine, &kp, &hs).await;
        let wanted: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(0u64..).collect();
        let until = || tokio::time::Instant::now() + Duration::from_secs(5);
        let created = || p.engine.metrics().transfer_locks_created.load(Ordering::Relaxed);
        let metric = |e: &Engine, f: fn(&kvferry::engine::EngineMetrics) -> &std::sync::atomic::AtomicU64| {
            f(e.metrics()).load(Ordering::Relaxed)
        };
        let all_verified = |e: &Engine, kv: &Kv| wanted.iter().all(|(h, i)| verify(e, kv, *i, h));

        // Its session released at the owner (the lock expired, say), with
        // no other copy anywhere: the reads are refused, and the owner is
        // asked again with a lock RPC.
        let (d0, k0) = &d[0];
        let t = p.engine.grant_transfer(NS, &hs, &d0.engine.transfer_ask()).await.unwrap();
        assert_eq!(p.engine.release_transfer(t.session()).unwrap(), 8);
        let got = d0.engine.fetch_into_with_ticket(NS, &wanted, t, until()).await.unwrap();
        assert_eq!((got.ready(), got.fetch.owners.clone()), (8, vec![p.node.clone(); 2]), "{:?}", got.fetch);
        assert!(all_verified(&d0.engine, k0));
        assert!(no_locks_left(&p.engine).await, "the retry's lock was released");

        // Granted to `d1`, through its bytes: every block, no query, one lock.
        let (d1, k1) = &d[1];
        let t = p.engine.grant_transfer(NS, &hs, &d1.engine.transfer_ask()).await.unwrap();
        assert_eq!((t.granted(), t.owner.clone(), t.session().is_empty()), (8, p.node.clone(), false));
        let t = kvferry::engine::TransferTicket::decode(&t.encode()).unwrap();
        let before = created();
        let got = d1.engine.fetch_into_with_ticket(NS, &wanted, t, until()).await.unwrap();
        assert_eq!((got.ready(), got.fetch.owners.clone()), (8, vec![p.node.clone()]), "{:?}", got.fetch);
        assert_eq!(got.fetch.phases.query, Duration::ZERO, "no MetaServer query");
        assert_eq!(created(), before, "no lock RPC: the ticket's lock is the only one");
        assert_eq!(metric(&d1.engine, |m| &m.fetch_tickets), 1);
        assert_eq!(metric(&d1.engine, |m| &m.fetch_known_owners), 0, "a ticket is not a caller's query answer");
        assert!(all_verified(&d1.engine, k1));
        assert!(no_locks_left(&p.engine).await, "the reader released the ticket's lock");

        // Granted to `d1`, handed to `d2`: released unread, fetched as usual.
        let (d2, k2) = &d[2];
        let t = p.engine.grant_transfer(NS, &hs, &d1.engine.transfer_ask()).await.unwrap();
        let got = d2.engine.fetch_into_with_ticket(NS, &wanted, t, until()).await.unwrap();
        assert_eq!(got.ready(), 8, "{:?}", got.fetch);
        assert_eq!(metric(&d2.engine, |m| &m.fetch_tickets_unused), 1);
        assert_eq!(metric(&d2.engine, |m| &m.fetch_tickets), 0);
        assert!(all_verified(&d2.engine, k2));
        assert!(no_locks_left(&p.engine).await, "the unused ticket and the fetch's own lock were released");

        // The reader holds every block the ticket grants: released unread.
        let t = p.engine.grant_transfer(NS, &hs, &d2.engine.transfer_ask()).await.unwrap();
        let got = d2.engine.fetch_into_with_ticket(NS, &wanted, t, until()).await.unwrap();
        assert_eq!((got.ready(), got.fetch.local_hits), (8, 8), "{:?}", got.fetch);
        assert_eq!(metric(&d2.engine, |m| &m.fetch_tickets_unused), 2);
        assert!(no_locks_left(&p.engine).await);

        // Other hashes than the fetch's: released unread.
        let (d3, _) = &d[3];
        let t = p.engine.grant_transfer(NS, &hs[1..], &d3.engine.transfer_ask()).await.unwrap();
        let got = d3.engine.fetch_into_with_ticket(NS, &wanted[..4], t, until()).await.unwrap();
        assert_eq!(got.ready(), 4, "{:?}", got.fetch);
        assert_eq!(metric(&d3.engine, |m| &m.fetch_tickets_unused), 1);
        assert!(no_locks_left(&p.engine).await);

        // A ticket for the whole prompt, a fetch of one block fewer (a
        // decode that computes the last block itself): read from.
        let (d5, k5) = &d[5];
        let t = p.engine.grant_transfer(NS, &hs, &d5.engine.transfer_ask()).await.unwrap();
        let got = d5.engine.fetch_into_with_ticket(NS, &wanted[..7], t, until()).await.unwrap();
        assert_eq!((got.ready(), got.fetch.phases.query), (7, Duration::ZERO), "{:?}", got.fetch);
        assert_eq!(metric(&d5.engine, |m| &m.fetch_tickets), 1);
        assert!(wanted[..7].iter().all(|(h, i)| verify(&d5.engine, k5, *i, h)));
        assert!(no_locks_left(&p.engine).await);

        // A fetch dropped before it ran still releases its ticket.
        let (d4, _) = &d[4];
        let t = p.engine.grant_transfer(NS, &hs, &d4.engine.transfer_ask()).await.unwrap();
        assert_eq!(p.engine.gauges().active_transfer_locks, 1);
        drop(d4.engine.fetch_into_with_ticket(NS, &wanted, t, until()));
        assert_eq!(metric(&d4.engine, |m| &m.fetch_tickets_unused), 1);
        assert!(no_locks_left(&p.engine).await, "the dropped fetch released the ticket");

        // Bad input: clear errors, nothing locked.
        assert_eq!(kvferry::engine::TransferTicket::decode(b"not a ticket").unwrap_err().code(), "ticket_decode");
        let mut t = p.engine.grant_transfer(NS, &hs, &d1.engine.transfer_ask()).await.unwrap();
        p.engine.release_transfer(t.session()).unwrap();
        t.requester = NodeAddr("no port".into());
        assert!(kvferry::engine::TransferTicket::decode(&t.encode()).is_err(), "a malformed requester");
        let bad_reader = kvferry::engine::TransferAsk { requester: NodeAddr("no port".into()), device: None };
        let e = p.engine.grant_transfer(NS, &hs, &bad_reader).await.unwrap_err();
        assert!(e.code().starts_with("id_"), "{e}");
        let too_many = vec![hs[0].clone(); kvferry::limits::HASHES_PER_REQUEST_MAX + 1];
        let e = p.engine.grant_transfer(NS, &too_many, &d1.engine.transfer_ask()).await.unwrap_err();
        assert_eq!(e.code(), "engine_too_many_blocks");
        let e = p.engine.grant_transfer("no-such-ns", &hs, &d1.engine.transfer_ask()).await.unwrap_err();
        assert_eq!(e.code(), "engine_unknown_namespace");
        assert_eq!(p.engine.gauges().active_transfer_locks, 0);
        // A ticket for blocks the owner does not hold locks nothing.
        let t = p.engine.grant_transfer(NS, &hashes(50..52), &d1.engine.transfer_ask()).await.unwrap();
        assert_eq!((t.granted(), t.session()), (0, ""));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_byte_on_the_wire_rejects_the_block() {
    bounded(async {
        let ms = start_ms().await;
        let (a, _) = start_node(&ms, 4 * MIB).await;
        let (b, _) = start_node(&ms, 4 * MIB).await;
        let mut dcfg = node_cfg(ms.local_addr, 4 * MIB);
        dcfg.tcp_connections_per_peer = 1; // B serves its blocks in order
        let (d, _) = start_node_cfg(dcfg).await;
        let ka = register_default(&a.engine, 16);
        let kb = register_default(&b.engine, 16);
        let kd = register_default(&d.engine, 16);
        let hs = hashes(1..9);
        // A advertises 0..8 but holds only 0..4 (removals of 4..8 lost); B holds 4..8.
        prefill(&a.engine, &ka, &hs).await;
        let keep = a.engine.lease(NS, &hs[..4]);
        ms.hooks.drop_writes_ppm.store(1_000_000, Ordering::SeqCst);
        assert_eq!(a.engine.evict(u64::MAX), 4);
        a.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        ms.hooks.drop_writes_ppm.store(0, Ordering::SeqCst);
        drop(keep);
        fill_and_save(&b.engine, &kb, 4, &hs[4..]).await;
        b.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;

        tcp(&b).hooks.corrupt_next_reads.store(1, Ordering::SeqCst);
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!(rep.owners, vec![a.node.clone(), b.node.clone()], "{rep:?}");
        assert_eq!((rep.available, rep.fetched), (4, 4), "the prefix before the bad block is accepted: {rep:?}");
        assert_eq!(rep.stopped, Some(FetchError::Checksum));
        assert_eq!(d.engine.metrics().checksum_failures.load(Ordering::Relaxed), 1);
        assert_eq!(tcp(&b).hooks.corrupt_next_reads.load(Ordering::SeqCst), 0, "the corruption happened");
        assert_eq!(d.engine.query_prefix(NS, &hs), 4, "the corrupted block was not sealed");
        assert_eq!(d.engine.gauges().resident_blocks, 4);
        assert_eq!(d.engine.gauges().pool_used_bytes, 4 * BLOCK);
        load_and_verify(&d.engine, &kd, 0, &hs[..4]).await;
        assert!(eventually(Duration::from_secs(1), || b.engine.gauges().active_transfer_locks == 0).await);

        // Without corruption the rest arrives intact.
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!((rep.available, rep.local_hits, rep.fetched), (8, 4, 4), "{rep:?}");
        assert_eq!(d.engine.metrics().checksum_failures.load(Ordering::Relaxed), 1);
        load_and_verify(&d.engine, &kd, 8, &hs).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_and_mutual_handshakes_are_single_flight() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 32);
        let kd = register_default(&d.engine, 32);
        let hs = hashes(1..17);
        prefill(&p.engine, &kp, &hs).await;

        // Eight fetches from one decode node to one peer at once.
        let tasks: Vec<_> = (1..=8)
            .map(|i| {
                let e = d.engine.clone();
                let want = hs[..2 * i].to_vec();
                tokio::spawn(async move { e.fetch(NS, &want).await })
            })
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            let rep = t.await.expect("no panic");
            assert_eq!(rep.available, 2 * (i + 1), "{rep:?}");
        }
        assert_eq!(d.engine.handshaken_peers(), 1);
        assert_eq!(tcp(&d).connected_peers(), 1);
        let conns = tcp(&p).hooks.connections_accepted.load(Ordering::Relaxed);
        assert!(
            conns as usize <= limits::TCP_CONNECTIONS_PER_PEER_DEFAULT,
            "{conns} data-plane connections: more than one handshake's worth"
        );
        load_and_verify(&d.engine, &kd, 0, &hs).await;
        assert_eq!(d.engine.gauges().pool_used_bytes, 16 * BLOCK, "duplicate fetches left no extents behind");
        assert!(eventually(Duration::from_secs(1), || p.engine.gauges().active_transfer_locks == 0).await);

        // A and B fetch from each other at the same moment.
        let (a, _) = start_node(&ms, 4 * MIB).await;
        let (b, _) = start_node(&ms, 4 * MIB).await;
        let ka = register(&a.engine, "mutual", LAYERS, 16, SEG, true, true);
        let kb = register(&b.engine, "mutual", LAYERS, 16, SEG, true, true);
        let ha = hashes(100..108);
        let hb = hashes(200..208);
        prefill(&a.engine, &ka, &ha).await;
        prefill(&b.engine, &kb, &hb).await;
        let (ra, rb) = tokio::join!(a.engine.fetch("mutual", &hb), b.engine.fetch("mutual", &ha));
        assert_eq!((ra.available, rb.available), (8, 8), "{ra:?} {rb:?}");
        assert_eq!((a.engine.handshaken_peers(), b.engine.handshaken_peers()), (1, 1));
        load_and_verify(&a.engine, &ka, 8, &hb).await;
        load_and_verify(&b.engine, &kb, 8, &ha).await;
        // And again: no second handshake.
        let more = a.engine.fetch("mutual", &hb).await;
        assert_eq!(more.local_hits, 8);
        assert_eq!(a.engine.handshaken_peers(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stitches_one_prefix_from_two_owners() {
    bounded(async {
        let ms = start_ms().await;
        let (a, _) = start_node(&ms, 4 * MIB).await;
        let (b, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let ka = register_default(&a.engine, 32);
        let kb = register_default(&b.engine, 32);
        let kd = register_default(&d.engine, 32);
        let hs = hashes(1..21);
        // A advertises 0..20 but evicted 10..20 with the removals lost.
        prefill(&a.engine, &ka, &hs).await;
        let keep = a.engine.lease(NS, &hs[..10]);
        ms.hooks.drop_writes_ppm.store(1_000_000, Ordering::SeqCst);
        assert_eq!(a.engine.evict(u64::MAX), 10);
        let fr = a.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(fr.dropped, 10);
        ms.hooks.drop_writes_ppm.store(0, Ordering::SeqCst);
        drop(keep);
        // B holds only 10..20: it cannot serve the prefix on its own.
        fill_and_save(&b.engine, &kb, 10, &hs[10..]).await;
        b.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(ms_prefix(&d.engine, NS, &hs).await, vec![(a.node.clone(), 20)]);

        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!(rep.owners, vec![a.node.clone(), b.node.clone()], "{rep:?}");
        assert_eq!(rep.owners.len(), 2);
        assert_eq!((rep.available, rep.fetched), (20, 20), "{rep:?}");
        assert_eq!(rep.stopped, None);
        load_and_verify(&d.engine, &kd, 0, &hs).await;
        assert!(
            eventually(Duration::from_secs(1), || a.engine.gauges().active_transfer_locks == 0
                && b.engine.gauges().active_transfer_locks == 0)
            .await
        );
        // The stitched prefix is advertised by the decode node as a whole.
        d.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(ms_prefix_of(&d.engine, NS, &hs, &d.node).await, 20);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taken_port_fails_before_ready() {
    bounded(async {
        let ms = start_ms().await;
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();

        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.grpc_addr = addr;
        match node::start(cfg, Arc::new(HostGpu::new())).await {
            Ok(_) => panic!("a node started on a taken gRPC port"),
            Err(e) => assert!(matches!(e, NodeError::BindGrpc { addr: a, .. } if a == addr), "{e}"),
        }
        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.data_addr = addr;
        match node::start(cfg, Arc::new(HostGpu::new())).await {
            Ok(_) => panic!("a node started on a taken data-plane port"),
            Err(e) => assert!(matches!(e, NodeError::BindData { addr: a, .. } if a == addr), "{e}"),
        }
        // The port's owner is undisturbed, and a node on free ports starts.
        let (n, _) = start_node(&ms, MIB).await;
        assert_ne!(n.grpc_addr, addr);
        drop(taken);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_start_leaves_no_ghost_node_at_the_metaserver() {
    bounded(async {
        // Short staleness so a leftover heartbeat loop would be visible quickly.
        let mut mc = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        mc.stale_after_secs = 1;
        let ms = kvferry::metaserver::start(mc).await.unwrap();
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();

        // The gRPC port binds, the data-plane port is taken: start fails…
        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.grpc_addr = grpc;
        cfg.data_addr = taken.local_addr().unwrap();
        match node::start(cfg, Arc::new(HostGpu::new())).await {
            Ok(_) => panic!("a node started on a taken data-plane port"),
            Err(e) => assert!(matches!(e, NodeError::BindData { .. }), "{e}"),
        }
        // …and must not leave a client behind that keeps the address alive at
        // the MetaServer: once any session it announced is stale, a node
        // started on the same address registers normally.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.grpc_addr = grpc;
        let (n, _) = start_node_cfg(cfg).await;
        let kv = register_default(&n.engine, 4);
        let hs = hashes(1..2);
        fill_and_save(&n.engine, &kv, 0, &hs).await;
        let fr = n.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((fr.delivered, fr.dropped), (1, 0), "{fr:?}");
        assert_eq!(ms_prefix(&n.engine, NS, &hs).await, vec![(n.node.clone(), 1)]);
        drop(taken);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_plane_rejects_bad_input_and_keeps_serving() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 16);
        let kd = register_default(&d.engine, 16);
        let hs = hashes(1..9);
        prefill(&p.engine, &kp, &hs).await;
        let addr = tcp(&p).data_addr().to_string();

        // Garbage: Malformed (req_id 0), then the server closes the connection.
        let mut s = connect_raw(&addr).await;
        s.write_all(b"GARBAGE-GARBAGE-GARBAGE-GARBAGE-").await.unwrap();
        let (h, msg) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::Malformed, 0));
        assert!(frame::decode_error_message(&msg).is_ok());
        assert_closed(&mut s).await;

        // A Read naming an unknown session: an error reply, the connection stays usable.
        let mut s = connect_raw(&addr).await;
        s.write_all(&read_req(7, "no-such-session", 0, 0, 64)).await.unwrap();
        let (h, _) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::UnknownSession, 7));
        let mut ping = Vec::new();
        frame::encode_request(&Request::Ping { req_id: 8 }, &mut ping).unwrap();
        s.write_all(&ping).await.unwrap();
        let (h, payload) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id, payload.len()), (Status::Ok, 8, 0));

        // Under a valid session: the locked block reads back, anything else is OutOfRange.
        let (sid, found) = p.engine.lock_for_transfer(NS, &hs[..1]).unwrap();
        let sid = sid.unwrap();
        let off = found[0].1.extent.offset();
        drop(found);
        s.write_all(&read_req(9, &sid, 0, off, BLOCK)).await.unwrap();
        let (h, payload) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id, h.len), (Status::Ok, 9, BLOCK));
        let mut k0 = vec![0u8; SEG as usize];
        fill_kv(NS, &hs[0], 0, 0, &mut k0);
        assert_eq!(&payload[..SEG as usize], &k0[..], "slot 0 K as sealed");
        for (id, region, offset, len) in [
            (10, 0, off, BLOCK + 1),
            (11, 0, off + BLOCK, 8),
            (12, 1, off, 8),
            (13, 0, off + BLOCK - 8, 16),
            (14, 0, u64::MAX - 16, 16),
        ] {
            s.write_all(&read_req(id, &sid, region, offset, len)).await.unwrap();
            let (h, _) = read_response(&mut s).await;
            assert_eq!((h.status, h.req_id), (Status::OutOfRange, id), "read {id}");
        }
        // Pipelined: an in-range read after the refusals is still answered in order.
        let mut two = read_req(15, &sid, 0, off + 100, 10);
        two.extend(read_req(16, "no-such-session", 0, off, 10));
        s.write_all(&two).await.unwrap();
        let (h, payload) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::Ok, 15));
        assert_eq!(payload, k0[100..110].to_vec());
        let (h, _) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::UnknownSession, 16));
        // Released: the session no longer authorizes anything.
        assert_eq!(p.engine.release_transfer(&sid), Ok(1));
        s.write_all(&read_req(17, &sid, 0, off, 8)).await.unwrap();
        let (h, _) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::UnknownSession, 17));

        // A read longer than the frame limit: TooLarge, then the connection closes.
        let mut big = read_req(18, "abc", 0, 0, 1);
        let n = big.len();
        big[n - 8..].copy_from_slice(&(limits::TCP_READ_BYTES_MAX + 1).to_le_bytes());
        let mut s2 = connect_raw(&addr).await;
        s2.write_all(&big).await.unwrap();
        let (h, _) = read_response(&mut s2).await;
        assert_eq!(h.status, Status::TooLarge);
        assert_closed(&mut s2).await;

        // Other malformed frames, each on its own connection.
        let mut bad_version = ping.clone();
        bad_version[4] = 9;
        let mut bad_kind = ping.clone();
        bad_kind[5] = 7;
        let mut bad_flags = ping.clone();
        bad_flags[6] = 1;
        let mut bad_session = read_req(19, "abc", 0, 0, 8);
        bad_session[18] = b'/';
        let mut zero_len = read_req(20, "abc", 0, 0, 8);
        let n = zero_len.len();
        zero_len[n - 8..].copy_from_slice(&0u64.to_le_bytes());
        let mut overflow = read_req(21, "abc", 0, 0, 8);
        overflow[n - 16..n - 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut empty_session = ping.clone();
        empty_session[5] = 1; // a Read…
        empty_session.extend_from_slice(&0u16.to_le_bytes()); // …with a 0-byte session
        for (name, bytes) in [
            ("version", bad_version),
            ("kind", bad_kind),
            ("flags", bad_flags),
            ("session bytes", bad_session),
            ("zero length", zero_len),
            ("range overflow", overflow),
            ("empty session", empty_session),
        ] {
            let mut c = connect_raw(&addr).await;
            c.write_all(&bytes).await.unwrap();
            let (h, _) = read_response(&mut c).await;
            assert_eq!(h.status, Status::Malformed, "{name}");
            assert_closed(&mut c).await;
        }
        // A peer that sends half a frame and vanishes.
        let mut c = connect_raw(&addr).await;
        c.write_all(&ping[..5]).await.unwrap();
        drop(c);
        assert!(tcp(&p).hooks.errors_sent.load(Ordering::Relaxed) >= 17);

        // The server still serves a real fetch.
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!(rep.available, 8, "{rep:?}");
        load_and_verify(&d.engine, &kd, 0, &hs).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_grpc_surface() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 16);
        let hs = hashes(1..5);
        prefill(&p.engine, &kp, &hs).await;
        let mut c = EngineClient::connect(format!("http://{}", p.grpc_addr)).await.unwrap();

        let h = c.health(HealthRequest {}).await.unwrap().into_inner();
        assert!(h.status.unwrap().ok);

        // Every Engine RPC outside the P2P four is UNIMPLEMENTED.
        let code = |r: Result<tonic::Response<SimpleResponse>, tonic::Status>| r.unwrap_err().code();
        assert_eq!(code(c.save(SaveRequest {}).await), Code::Unimplemented);
        assert_eq!(code(c.load(LoadRequest {}).await), Code::Unimplemented);
        assert_eq!(code(c.register_context_batch(RegisterContextBatchRequest {}).await), Code::Unimplemented);
        assert_eq!(code(c.query_prefetch(QueryPrefetchRequest {}).await), Code::Unimplemented);
        assert_eq!(code(c.release(ReleaseRequest {}).await), Code::Unimplemented);
        assert_eq!(code(c.unregister_context(UnregisterContextRequest {}).await), Code::Unimplemented);
        assert_eq!(code(c.shutdown(ShutdownRequest {}).await), Code::Unimplemented);
        assert_eq!(c.session(SessionRequest {}).await.unwrap_err().code(), Code::Unimplemented);

        // QueryBlocksForTransfer: bad input is INVALID_ARGUMENT and locks nothing.
        let q = |hashes: Vec<bytes::Bytes>, ns: &str| QueryBlocksForTransferRequest {
            namespace: ns.into(),
            block_hashes: hashes,
            requester_id: d.node.0.clone(),
            device: None,
            compact_slots: false,
            packed_blocks: false,
        };
        let err = c.query_blocks_for_transfer(q(vec![], NS)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = c.query_blocks_for_transfer(q(vec![bytes::Bytes::new()], NS)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = c.query_blocks_for_transfer(q(vec![hs[0].0.clone()], "")).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let too_many = vec![hs[0].0.clone(); limits::HASHES_PER_REQUEST_MAX + 1];
        let err = c.query_blocks_for_transfer(q(too_many, NS)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        // Unknown namespace / unknown blocks: OK with no session.
        let r = c.query_blocks_for_transfer(q(vec![hs[0].0.clone()], "elsewhere")).await.unwrap().into_inner();
        assert!(r.transfer_session_id.is_empty() && r.blocks.is_empty());
        let r = c.query_blocks_for_transfer(q(vec![BlockHash::from_u64(99).0], NS)).await.unwrap().into_inner();
        assert!(r.transfer_session_id.is_empty() && r.blocks.is_empty());
        assert_eq!(p.engine.gauges().active_transfer_locks, 0);

        // Exactly the found blocks are locked (not a prefix scan): a gap is skipped.
        let ask = vec![hs[0].0.clone(), BlockHash::from_u64(99).0, hs[2].0.clone(), hs[3].0.clone()];
        let r = c.query_blocks_for_transfer(q(ask, NS)).await.unwrap().into_inner();
        assert!(r.status.unwrap().ok);
        assert!(!r.transfer_session_id.is_empty());
        assert_eq!(r.lock_timeout_secs, LOCK_TIMEOUT_SECS);
        let got: Vec<_> = r.blocks.iter().map(|b| b.block_hash.clone()).collect();
        assert_eq!(got, vec![hs[0].0.clone(), hs[2].0.clone(), hs[3].0.clone()]);
        for b in &r.blocks {
            assert_eq!(b.slots.len(), LAYERS as usize);
            for s in &b.slots {
                assert_eq!((s.k_size, s.v_size, s.v_ptr), (SEG, SEG, s.k_ptr + SEG));
            }
        }
        assert_eq!(p.engine.gauges().active_transfer_locks, 1);
        assert!(r.slot_shapes.is_empty(), "an answer with slots sends no shapes");

        // The compact answer (kvferry's own requesters ask for it): the
        // shapes once, each block its pool offset and slot checksums, the
        // same places and checksums as the slots above.
        let ask = vec![hs[0].0.clone(), BlockHash::from_u64(99).0, hs[2].0.clone(), hs[3].0.clone()];
        let compact = QueryBlocksForTransferRequest { compact_slots: true, ..q(ask, NS) };
        let rc = c.query_blocks_for_transfer(compact).await.unwrap().into_inner();
        assert!(!rc.transfer_session_id.is_empty() && rc.transfer_session_id != r.transfer_session_id);
        assert_eq!(rc.slot_shapes.len(), LAYERS as usize);
        assert_eq!(rc.blocks.len(), r.blocks.len());
        for (bc, b) in rc.blocks.iter().zip(&r.blocks) {
            assert_eq!(bc.block_hash, b.block_hash);
            assert!(bc.slots.is_empty());
            let base = bc.pool_offset.expect("a compact block names its pool offset");
            assert_eq!(bc.slot_crc32c, b.slots.iter().map(|s| s.crc32c).collect::<Vec<_>>());
            for (shape, s) in rc.slot_shapes.iter().zip(&b.slots) {
                assert_eq!(
                    (base + shape.k_offset, shape.k_size, base + shape.v_offset, shape.v_size),
                    (s.k_ptr, s.k_size, s.v_ptr, s.v_size)
                );
            }
        }
        let rel1 = ReleaseTransferLockRequest { transfer_session_id: rc.transfer_session_id.clone() };
        assert_eq!(c.release_transfer_lock(rel1).await.unwrap().into_inner().released_blocks, 3);
        // The packed answer (what kvferry's fetch asks for): the same as
        // columns, each block named by its index in the request (the gap
        // at index 1 skipped); no device block without a device ask.
        let ask = vec![hs[0].0.clone(), BlockHash::from_u64(99).0, hs[2].0.clone(), hs[3].0.clone()];
        let packed = QueryBlocksForTransferRequest { packed_blocks: true, ..q(ask, NS) };
        let rp = c.query_blocks_for_transfer(packed).await.unwrap().into_inner();
        assert!(rp.blocks.is_empty(), "a packed answer has no per-block records");
        assert_eq!(rp.slot_shapes, rc.slot_shapes);
        assert_eq!(rp.packed_index, vec![0, 2, 3]);
        let offsets: Vec<u64> = rc.blocks.iter().map(|b| b.pool_offset.unwrap()).collect();
        assert_eq!(rp.packed_pool_offset, offsets);
        let crcs: Vec<u32> = rc.blocks.iter().flat_map(|b| b.slot_crc32c.iter().copied()).collect();
        assert_eq!(rp.packed_slot_crc32c, crcs);
        assert!(rp.packed_device_block.is_empty());
        let rel2 = ReleaseTransferLockRequest { transfer_session_id: rp.transfer_session_id.clone() };
        assert_eq!(c.release_transfer_lock(rel2).await.unwrap().into_inner().released_blocks, 3);

        // Release is idempotent.
        let rel = |sid: &str| ReleaseTransferLockRequest { transfer_session_id: sid.into() };
        let r1 = c.release_transfer_lock(rel(&r.transfer_session_id)).await.unwrap().into_inner();
        assert_eq!(r1.released_blocks, 3);
        assert!(r1.status.unwrap().ok);
        let r2 = c.release_transfer_lock(rel(&r.transfer_session_id)).await.unwrap().into_inner();
        assert_eq!(r2.released_blocks, 0);
        assert!(r2.status.unwrap().ok);
        let r3 = c.release_transfer_lock(rel("never-issued")).await.unwrap().into_inner();
        assert_eq!(r3.released_blocks, 0);
        assert!(!r3.status.unwrap().ok, "an id this node never issued is refused (C16)");
        assert_eq!(p.engine.gauges().active_transfer_locks, 0);

        // RdmaHandshake: garbage metadata and a malformed requester are INVALID_ARGUMENT.
        let hs_req = |requester: &str, meta: Vec<u8>| RdmaHandshakeRequest {
            requester_id: requester.into(),
            handshake_metadata: meta.into(),
        };
        let err = c.rdma_handshake(hs_req(&d.node.0, b"garbage".to_vec())).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = c.rdma_handshake(hs_req(&d.node.0, vec![])).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let mut trailing = tcp(&d).local_metadata().encode().to_vec();
        trailing.push(0);
        let err = c.rdma_handshake(hs_req(&d.node.0, trailing)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let good = tcp(&d).local_metadata().encode().to_vec();
        let err = c.rdma_handshake(hs_req("not an address", good.clone())).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = c.rdma_handshake(hs_req(&d.node.0, vec![0u8; limits::HANDSHAKE_METADATA_BYTES_MAX + 1])).await;
        assert_eq!(err.unwrap_err().code(), Code::InvalidArgument);
        // A valid one answers with the server's own metadata.
        let ok = c.rdma_handshake(hs_req(&d.node.0, good)).await.unwrap().into_inner();
        assert!(ok.status.unwrap().ok);
        let meta = HandshakeMetadata::decode(&ok.handshake_metadata).unwrap();
        assert_eq!(meta.data_addr, tcp(&p).data_addr());
        assert_eq!(meta, tcp(&p).local_metadata());

        // Still healthy after all of the above.
        assert!(c.health(HealthRequest {}).await.unwrap().into_inner().status.unwrap().ok);
    })
    .await;
}

/// An owner restarts (a fresh process on the same gRPC and data addresses):
/// the requester's pooled data connections to the old process are dead, and
/// its first fetch from the new one still moves every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_fetch_after_the_owner_restarts_moves_every_block() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 40);
        register_default(&d.engine, 40);
        let hs = hashes(9000..9008);
        prefill(&p.engine, &kp, &hs).await;
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!((rep.available, rep.fetched), (8, 8), "{rep:?}");

        let mut cfg = node_cfg(ms.local_addr, 4 * MIB);
        cfg.grpc_addr = p.grpc_addr;
        cfg.data_addr = tcp(&p).data_addr().parse().unwrap();
        // A clean stop (a crashed node's session would fence the new one at
        // the MetaServer until it went stale, C5), then a new process.
        p.shutdown(Duration::from_secs(1)).await;
        let mut p2 = None;
        for _ in 0..200 {
            match node::start(cfg.clone(), Arc::new(HostGpu::new())).await {
                Ok(n) => {
                    p2 = Some(n);
                    break;
                }
                Err(NodeError::BindGrpc { .. } | NodeError::BindData { .. }) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("restart: {e}"),
            }
        }
        let p2 = p2.expect("the old addresses free up within 2 s");
        let kp2 = register_default(&p2.engine, 40);
        let hs2 = hashes(9100..9108);
        prefill(&p2.engine, &kp2, &hs2).await;
        let rep = d.engine.fetch(NS, &hs2).await;
        assert_eq!((rep.available, rep.fetched), (8, 8), "first fetch after the restart: {rep:?}");
    })
    .await;
}

/// A fetch reads in parts, each checksummed while the next is read; a bad
/// part ends it: the part read meanwhile is dropped, later parts are never
/// asked for, and every extent goes back to the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_reads_in_parts_and_a_bad_part_ends_it() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let mut dcfg = node_cfg(ms.local_addr, 4 * MIB);
        dcfg.tcp_connections_per_peer = 1; // the owner serves the reads in order
        dcfg.engine.fetch_read_part_bytes = 2 * BLOCK;
        dcfg.engine.fetch_reads_in_flight = 1; // one part read while the previous one is checked
        let (d, _) = start_node_cfg(dcfg).await;
        let kp = register_default(&p.engine, 40);
        let kd = register_default(&d.engine, 40);
        let served = || tcp(&p).hooks.reads_served.load(Ordering::SeqCst);
        // The owner counts a read once its bytes are written, which can be
        // after the reader already has them: wait (bounded) for the count
        // to reach `want`, then a little longer so that an extra read would
        // show too.
        let settled = |from: u64, want: u64| async move {
            let until = tokio::time::Instant::now() + Duration::from_secs(2);
            while served() - from < want && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            served() - from
        };

        let hs = hashes(9200..9208);
        prefill(&p.engine, &kp, &hs).await;
        let before = served();
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!((rep.available, rep.fetched), (8, 8), "{rep:?}");
        load_and_verify(&d.engine, &kd, 0, &hs).await;
        let whole = settled(before, 8).await;
        assert_eq!(whole, 8, "one read per block (a block is one extent on each side)");

        let hs2 = hashes(9300..9308);
        prefill(&p.engine, &kp, &hs2).await;
        let gauges = d.engine.gauges();
        tcp(&p).hooks.corrupt_next_reads.store(1, Ordering::SeqCst);
        let before = served();
        let rep = d.engine.fetch(NS, &hs2).await;
        assert_eq!((rep.available, rep.fetched), (0, 0), "{rep:?}");
        assert_eq!(rep.stopped, Some(FetchError::Checksum));
        let bad = settled(before, 4).await;
        assert_eq!(bad, 4, "parts 1 and 2 read (2 while 1 was checked), parts 3 and 4 never asked for");
        assert_eq!(d.engine.gauges(), gauges, "nothing sealed, every extent back in the pool");
    })
    .await;
}

/// With several parts in flight, `fetch_into` puts every block
/// byte-identical into the caller's indices, loading each part as it is
/// sealed; the phase split accounts for the fetch's time (it adds up to no
/// more than the call's wall time, and a fetch that read charges `read`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_with_parts_in_flight_loads_part_by_part() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let mut dcfg = node_cfg(ms.local_addr, 4 * MIB);
        dcfg.engine.fetch_read_part_bytes = 2 * BLOCK;
        dcfg.engine.fetch_reads_in_flight = 3;
        let (d, _) = start_node_cfg(dcfg).await;
        let kp = register_default(&p.engine, 40);
        let kd = register_default(&d.engine, 40);
        let hs = hashes(9400..9411);
        prefill(&p.engine, &kp, &hs).await;
        // The first three blocks are already resident on the decode node.
        fill_and_save(&d.engine, &kd, 30, &hs[..3]).await;
        let wanted: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(20u64..).collect();
        let t0 = std::time::Instant::now();
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        let wall = t0.elapsed();
        assert_eq!((got.fetch.local_hits, got.fetch.fetched, got.ready()), (3, 8, 11), "{:?}", got.fetch);
        for (i, h) in hs.iter().enumerate() {
            assert!(verify(&d.engine, &kd, 20 + i as u64, h), "block {i} byte-identical at its index");
        }
        let ph = got.fetch.phases;
        assert!(ph.read > Duration::ZERO, "{ph:?}");
        assert!(ph.total() <= wall, "phases {ph:?} exceed the call's wall time {wall:?}");
    })
    .await;
}

// ------------------------------------------------------- C16 capability ids

/// Two nodes started with the default configuration issue disjoint,
/// different transfer-session ids, and an id one node issued opens nothing
/// on the other: its data plane answers UnknownSession for a read of a block
/// the other node locked for someone else, and its ReleaseTransferLock
/// refuses it without touching that lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_of_one_node_open_nothing_on_another() {
    bounded(async {
        let ms = start_ms().await;
        let (a, _) = start_node(&ms, 4 * MIB).await;
        let (b, _) = start_node(&ms, 4 * MIB).await;
        let (ka, kb) = (register_default(&a.engine, 8), register_default(&b.engine, 8));
        let hs = hashes(1..5);
        // Same blocks saved the same way: the same pool offsets on both nodes.
        fill_and_save(&a.engine, &ka, 0, &hs).await;
        fill_and_save(&b.engine, &kb, 0, &hs).await;
        let mut ids_a = Vec::new();
        let mut ids_b = Vec::new();
        for _ in 0..8 {
            let (sa, _) = a.engine.lock_for_transfer(NS, &hs).unwrap();
            let (sb, _) = b.engine.lock_for_transfer(NS, &hs).unwrap();
            ids_a.push(sa.unwrap());
            ids_b.push(sb.unwrap());
        }
        let all: std::collections::BTreeSet<&String> = ids_a.iter().chain(&ids_b).collect();
        assert_eq!(all.len(), 16, "every id differs: {ids_a:?} {ids_b:?}");
        assert_eq!(all.iter().map(|s| s.len()).max(), Some(limits::SESSION_ID_BYTES_MAX));
        for id in &ids_b {
            assert_eq!(b.engine.release_transfer(id), Ok(4));
        }
        // B holds a lock for "someone else"; A's id at the same offset is refused.
        let (sid_b, found) = b.engine.lock_for_transfer(NS, &hs).unwrap();
        let off = found[0].1.extent.offset();
        drop(found);
        let from_a = &ids_a[0];
        assert_eq!(b.engine.data_source().authorize(from_a, 0, off, BLOCK).unwrap_err(), AccessError::ForeignSession);
        let mut s = connect_raw(tcp(&b).data_addr()).await;
        s.write_all(&read_req(1, from_a, 0, off, BLOCK)).await.unwrap();
        let (h, _) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::UnknownSession, 1));
        let before = b.engine.gauges().active_transfer_locks;
        let mut c = EngineClient::connect(format!("http://{}", b.grpc_addr)).await.unwrap();
        let r = c
            .release_transfer_lock(ReleaseTransferLockRequest { transfer_session_id: from_a.clone() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.released_blocks, 0);
        let status = r.status.unwrap();
        assert!(!status.ok && status.message.contains("another node or incarnation"), "{status:?}");
        assert_eq!(b.engine.gauges().active_transfer_locks, before, "B's locks untouched");
        // B's own id still reads.
        s.write_all(&read_req(2, sid_b.as_ref().unwrap(), 0, off, BLOCK)).await.unwrap();
        let (h, _) = read_response(&mut s).await;
        assert_eq!((h.status, h.req_id), (Status::Ok, 2));
    })
    .await;
}

/// A node restarted on the same address issues ids unlike its previous
/// incarnation's, and a late ReleaseTransferLock carrying an id from before
/// the restart releases nothing of a lock taken after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_from_before_a_restart_releases_nothing() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 8);
        let hs = hashes(1..5);
        fill_and_save(&p.engine, &kp, 0, &hs).await;
        let (old, _) = p.engine.lock_for_transfer(NS, &hs).unwrap();
        let old = old.unwrap();
        let (grpc, data) = (p.grpc_addr, tcp(&p).data_addr().parse().unwrap());
        p.shutdown(Duration::from_secs(1)).await;

        let mut cfg = node_cfg(ms.local_addr, 4 * MIB);
        (cfg.grpc_addr, cfg.data_addr) = (grpc, data);
        let (p2, _) = start_node_cfg(cfg).await;
        let kp2 = register_default(&p2.engine, 8);
        fill_and_save(&p2.engine, &kp2, 0, &hs).await;
        let (new, found) = p2.engine.lock_for_transfer(NS, &hs).unwrap();
        assert_eq!(found.len(), 4);
        drop(found);
        let new = new.unwrap();
        assert_ne!(new, old);
        assert_ne!(new[..16], old[..16], "incarnation prefixes differ");
        let mut c = EngineClient::connect(format!("http://{grpc}")).await.unwrap();
        let r = c
            .release_transfer_lock(ReleaseTransferLockRequest { transfer_session_id: old.clone() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.released_blocks, 0);
        assert!(!r.status.unwrap().ok);
        assert_eq!(p2.engine.gauges().active_transfer_locks, 1, "the new lock is still held");
        assert_eq!(p2.engine.release_transfer(&new), Ok(4));
    })
    .await;
}

// ------------------------------------------------------- C15 layout families

/// Blocks of one layout family move between engines that arranged their
/// buffers differently (prefill: per layer a K and a V tensor; decode: all
/// layers in one layer-first buffer), straight into the decode's own block
/// indices; a node whose layout of the namespace has another family is
/// refused at fetch time with both families named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_different_buffer_arrangements_exchange_blocks() {
    bounded(async {
        let ms = start_ms().await;
        let (p, _) = start_node(&ms, 4 * MIB).await;
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_paged(&p.engine, NS, 16);
        let kd = register_default(&d.engine, 16);
        let hs = hashes(1..9);
        prefill(&p.engine, &kp, &hs).await;
        let wanted: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(8u64..).collect();
        let got = d.engine.fetch_into(NS, &wanted).await.unwrap();
        assert_eq!((got.fetch.fetched, got.ready()), (8, 8), "{:?}", got.fetch);
        for (i, h) in hs.iter().enumerate() {
            assert!(verify(&d.engine, &kd, 8 + i as u64, h), "block {i} byte-identical");
        }
        // Another family under the same namespace: one segment per layer.
        let (t, _) = start_node(&ms, 4 * MIB).await;
        let _kt = register(&t.engine, NS, LAYERS, 16, 2 * SEG, false, true);
        let rep = t.engine.fetch(NS, &hs).await;
        assert_eq!(rep.available, 0);
        match rep.stopped {
            Some(FetchError::Shape(m)) => {
                let msg = m.to_string();
                assert!(msg.contains("4 layers × 2 segment(s) × 4096 B"), "{msg}");
                assert!(msg.contains("4 layers × 1 segment(s) × 8192 B"), "{msg}");
            }
            other => panic!("expected a shape refusal, got {other:?}"),
        }
    })
    .await;
}
