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
#![cfg(not(madsim))]

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
        let session = || ms.store.lock().unwrap().node_session(&addr);
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
