//! The node's data-plane choice (`NodeConfig::transport`, `kvferry pd
//! --transport`): TCP stays the default, and a verbs node that cannot run
//! here fails start-up with a clear error value and leaves nothing behind.
//!
//! These tests hold on every machine: without the `rdma` feature the error
//! is "built without rdma"; with it, no machine of ours has an RDMA device
//! (and a machine that has one has no device named [`NO_SUCH_DEVICE`]), so
//! opening fails with `NoRdma`, `NoDevices` or `DeviceNotFound`. Reads over
//! a real device are `scripts/hw-rdma.sh`'s job.

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvferry::gpu::host::HostGpu;
use kvferry::metaserver::MetaServerConfig;
use kvferry::node::{self, NodeConfig, NodeError, TransportChoice};
use kvferry::transport::verbs::VerbsConfig;
#[cfg(feature = "rdma")]
use kvferry::transport::verbs::VerbsError;
use kvferry::transport::verbs::plan::PlanError;
use kvferry::types::NodeAddr;

/// A device name no machine has.
const NO_SUCH_DEVICE: &str = "kvferry-no-such-device";

const MIB: u64 = 1 << 20;

/// The error a verbs node start must end with on a machine without the
/// device [`NO_SUCH_DEVICE`], in this build.
#[cfg(not(feature = "rdma"))]
fn assert_no_verbs(e: &NodeError) {
    assert!(matches!(e, NodeError::RdmaNotBuilt), "{e:?}");
    assert!(e.to_string().contains("rebuild with --features rdma"), "{e}");
}

/// The error a verbs node start must end with on a machine without the
/// device [`NO_SUCH_DEVICE`], in this build.
#[cfg(feature = "rdma")]
fn assert_no_verbs(e: &NodeError) {
    match e {
        NodeError::Verbs(VerbsError::NoRdma { .. } | VerbsError::NoDevices { .. }) => {}
        NodeError::Verbs(VerbsError::DeviceNotFound { name, available }) => {
            assert_eq!(name, NO_SUCH_DEVICE);
            assert!(!available.contains(name), "{available:?}");
        }
        e => panic!("expected NoRdma, NoDevices or DeviceNotFound, got {e:?}"),
    }
}

fn verbs(device: &str) -> TransportChoice {
    TransportChoice::Verbs(VerbsConfig::new(device))
}

/// An address on which nothing listens now.
fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_without_the_device_fails_start_up_and_leaves_nothing_behind() {
    bounded(async {
        // Heartbeats every 0.5 s: a client left running would show quickly.
        let mut mc = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        mc.stale_after_secs = 1;
        let ms = kvferry::metaserver::start(mc).await.unwrap();
        let grpc = free_addr();
        let addr = NodeAddr(format!("127.0.0.1:{}", grpc.port()));

        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.grpc_addr = grpc;
        cfg.transport = verbs(NO_SUCH_DEVICE);
        match node::start(cfg, Arc::new(HostGpu::new())).await {
            Ok(_) => panic!("a verbs node started on device {NO_SUCH_DEVICE:?}"),
            Err(e) => assert_no_verbs(&e),
        }

        // No heartbeat loop outlived the failed start: the address has no
        // record at the MetaServer, or (a first heartbeat that raced the
        // unregister) one that no heartbeat refreshes.
        let session = || ms.store_for_testing().lock().unwrap().node_session(&addr);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let before = session();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(session(), before, "something kept heartbeating for the failed node");

        // The gRPC port was released and the address is free to take over:
        // a TCP node starts on it and registers.
        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.grpc_addr = grpc;
        let (n, _) = start_node_cfg(cfg).await;
        assert_eq!(n.node, addr);
        assert!(
            eventually(Duration::from_secs(5), || session().is_some_and(|s| Some(&s) != before.as_ref())).await,
            "the TCP node on the same address never registered"
        );
        n.shutdown(Duration::from_secs(1)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_verbs_settings_fail_before_anything_is_bound() {
    bounded(async {
        let ms = start_ms().await;
        // The gRPC port is taken: a start that bound first would fail with
        // BindGrpc instead of the verbs error.
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut v = VerbsConfig::new("mlx5_0");
        v.qps_per_peer = 0;
        let mut cfg = node_cfg(ms.local_addr, MIB);
        cfg.grpc_addr = taken.local_addr().unwrap();
        cfg.transport = TransportChoice::Verbs(v);
        let e = node::start(cfg, Arc::new(HostGpu::new())).await.err().expect("a verbs node with 0 QPs per peer");
        if cfg!(feature = "rdma") {
            assert!(matches!(e, NodeError::VerbsConfig(PlanError::BadConfig(_))), "{e:?}");
            assert!(e.to_string().contains("qps_per_peer"), "{e}");
        } else {
            assert!(matches!(e, NodeError::RdmaNotBuilt), "{e:?}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_is_the_default_data_plane() {
    bounded(async {
        let ms = start_ms().await;
        let cfg = node_cfg(ms.local_addr, MIB);
        assert_eq!(cfg.transport, TransportChoice::Tcp);
        assert_eq!(NodeConfig::loopback("http://127.0.0.1:1").transport, TransportChoice::Tcp);
        let (n, _) = start_node_cfg(cfg).await;
        assert!(n.tcp.is_some());
        #[cfg(feature = "rdma")]
        assert!(n.verbs.is_none());
        assert_eq!(
            n.engine.transport().map(|t| t.kind()),
            Some(kvferry::transport::TransportKind::Tcp),
            "the engine reads through the TCP transport"
        );
        n.shutdown(Duration::from_secs(1)).await;
    })
    .await;
}

/// Runs `kvferry ARGS` to completion within 60 s (killed and failed past it).
fn run_kvferry(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kvferry");
    let end = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() >= end {
            let _ = child.kill();
            panic!("kvferry {args:?} still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn pd_over_verbs_without_the_device_exits_with_one_clear_line() {
    let out = run_kvferry(&[
        "pd",
        "--quiet",
        "--requests",
        "4",
        "--max-blocks",
        "2",
        "--pool-size",
        "64MiB",
        "--transport",
        "verbs",
        "--rdma-device",
        NO_SUCH_DEVICE,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty(), "a report was printed: {}", String::from_utf8_lossy(&out.stdout));
    // libibverbs may print its own warnings first; the error is the last line.
    let last = err.lines().last().unwrap_or("");
    assert!(last.starts_with("error: start-up failed: prefill node 0: "), "{err}");
    if cfg!(feature = "rdma") {
        assert!(
            ["no RDMA support", "no RDMA device", "not found"].iter().any(|s| last.contains(s)),
            "unexpected error: {err}"
        );
    } else {
        assert!(last.contains("built without the `rdma` feature"), "{err}");
    }
}

#[test]
fn pd_transport_flags_are_checked() {
    let out = run_kvferry(&["pd", "--quiet", "--transport", "verbs"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a usage error: {err}");
    assert!(err.contains("--rdma-device"), "{err}");

    let out = run_kvferry(&["pd", "--quiet", "--rdma-device", "mlx5_0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("need --transport verbs"), "{err}");

    // Likewise device lists without the CUDA backend, rather than ignored.
    let out = run_kvferry(&["pd", "--quiet", "--prefill-devices", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("need --gpu cuda"), "{err}");
}

// ---------------------------------------------------------------- data-plane connection limits

/// A data source that holds no blocks (the limit test only pings).
struct NoBlocks;

impl kvferry::transport::DataSource for NoBlocks {
    fn authorize(
        &self,
        _session: &str,
        _region: u32,
        _offset: u64,
        _len: u64,
    ) -> Result<(kvferry::memory::pool::SealedExtent, u64), kvferry::transport::AccessError> {
        Err(kvferry::transport::AccessError::UnknownSession)
    }
}

/// Connects from `source_ip` to `addr`.
async fn connect_from(source_ip: &str, addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{source_ip}:0").parse().unwrap()).unwrap();
    sock.connect(addr).await.unwrap()
}

/// Sends a Ping and returns the answer's status and message (or `None` when
/// the server closed the connection without a frame).
async fn ping(s: &mut tokio::net::TcpStream, req_id: u64) -> Option<(kvferry::transport::frame::Status, String)> {
    use kvferry::transport::frame;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = Vec::new();
    frame::encode_request(&frame::Request::Ping { req_id }, &mut out).unwrap();
    let _ = s.write_all(&out).await;
    let mut hdr = [0u8; frame::RESPONSE_HEADER_BYTES];
    let read =
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut hdr)).await.expect("an answer or a close");
    read.ok()?;
    let (h, _) = frame::decode_response_header(&hdr).unwrap().unwrap();
    let mut msg = vec![0u8; h.len as usize];
    s.read_exact(&mut msg).await.unwrap();
    Some((h.status, String::from_utf8_lossy(&msg).into_owned()))
}

/// The TCP data plane bounds its connections per peer IP and in total: one
/// over a bound gets an error frame naming it and is closed, counted; the
/// admitted connections keep working, and a slot freed by a close is reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_server_bounds_connections_per_ip_and_in_total() {
    use kvferry::transport::frame::Status;
    use kvferry::transport::tcp::{ConnLimits, TcpTransport};
    use std::sync::atomic::Ordering;
    let limits = ConnLimits { per_ip_max: 2, total_max: 3 };
    let t = TcpTransport::start_with_limits(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1",
        NodeAddr::parse("127.0.0.1:1").unwrap(),
        4096,
        Arc::new(NoBlocks),
        1,
        limits,
    )
    .await
    .unwrap();
    let addr: std::net::SocketAddr = t.data_addr().parse().unwrap();
    let mut a1 = connect_from("127.0.0.1", addr).await;
    let mut a2 = connect_from("127.0.0.1", addr).await;
    assert_eq!(ping(&mut a1, 1).await.map(|x| x.0), Some(Status::Ok));
    assert_eq!(ping(&mut a2, 2).await.map(|x| x.0), Some(Status::Ok));
    // A third from the same IP: refused by the per-IP bound.
    let mut a3 = connect_from("127.0.0.1", addr).await;
    let (status, msg) = ping(&mut a3, 3).await.expect("an error frame before the close");
    assert_eq!(status, Status::Internal);
    assert!(msg.contains("per IP"), "{msg}");
    assert_eq!(ping(&mut a3, 4).await, None, "closed after the refusal");
    assert_eq!(t.hooks.connections_refused.load(Ordering::Relaxed), 1);
    // Another IP (127.0.0.2 is loopback too) gets the last total slot...
    let mut b1 = connect_from("127.0.0.2", addr).await;
    assert_eq!(ping(&mut b1, 5).await.map(|x| x.0), Some(Status::Ok));
    // ...and a fourth connection is refused by the total bound.
    let mut b2 = connect_from("127.0.0.2", addr).await;
    let (status, msg) = ping(&mut b2, 6).await.expect("an error frame before the close");
    assert_eq!(status, Status::Internal);
    assert!(msg.contains("in total"), "{msg}");
    assert_eq!(t.hooks.connections_refused.load(Ordering::Relaxed), 2);
    assert_eq!(t.hooks.connections_accepted.load(Ordering::Relaxed), 3);
    // The admitted connections still work; closing one frees its slot.
    assert_eq!(ping(&mut a1, 7).await.map(|x| x.0), Some(Status::Ok));
    drop(a2);
    let t0 = Instant::now();
    loop {
        let mut a4 = connect_from("127.0.0.1", addr).await;
        if ping(&mut a4, 8).await.map(|x| x.0) == Some(Status::Ok) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the closed connection's slot was never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.shutdown();
}
