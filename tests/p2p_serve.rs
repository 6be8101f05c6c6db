//! Embedding the P2P transfer service (C12): bind-first serving on the
//! embedder's listener, and a taken port reported before anything serves.

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

use std::sync::Arc;
use std::time::Duration;

use kvferry::client::{ClientConfig, MetaServerClient};
use kvferry::engine::{Engine, EngineConfig};
use kvferry::gpu::host::HostGpu;
use kvferry::p2p::{P2pTransferService, ServeError};
use kvferry::proto::HealthRequest;
use kvferry::proto::engine_client::EngineClient;
use kvferry::types::{NodeAddr, SessionId};

fn engine() -> Engine {
    let node = NodeAddr::parse("127.0.0.1:1").expect("addr");
    // No MetaServer listens there: registrations are dropped, which these tests do not need.
    let client =
        MetaServerClient::start(ClientConfig::new("127.0.0.1:9", node.clone(), SessionId::parse("t").expect("id")))
            .expect("client");
    Engine::new(node, EngineConfig { pool_bytes: 1 << 20, ..EngineConfig::default() }, Arc::new(HostGpu::new()), client)
        .expect("engine")
}

#[tokio::test]
async fn serve_with_incoming_serves_on_the_embedders_listener() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(P2pTransferService::new(engine()).serve_with_incoming(listener, async {
        let _ = rx.await;
    }));
    let ch = kvferry::rt::channel(&addr.to_string(), Duration::from_secs(2)).expect("channel");
    let resp = EngineClient::new(ch).health(HealthRequest {}).await.expect("health").into_inner();
    assert!(resp.status.expect("status").ok);
    tx.send(()).expect("shutdown");
    task.await.expect("join").expect("clean shutdown");
}

#[tokio::test]
async fn serve_on_a_taken_port_is_a_bind_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        P2pTransferService::new(engine()).serve(addr, std::future::pending()),
    )
    .await
    .expect("returns at once, before serving");
    assert!(matches!(r, Err(ServeError::Bind(ref e)) if e.kind() == std::io::ErrorKind::AddrInUse), "{r:?}");
}
