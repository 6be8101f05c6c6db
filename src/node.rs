//! A kvferry node: one [`Engine`] with its MetaServer client, its P2P
//! transfer gRPC service and its data-plane transport listener.
//!
//! [`start`] is the single start-up entry used by the binary, the tests, the
//! main job and the simulator (so a simulated restart reruns real start-up).
//! Both listeners are bound before anything is served: a taken port is an
//! error before the node says ready (C12).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use tokio::sync::watch;

use crate::client::{ClientConfig, ClientError, MetaServerClient, QueueConfig};
use crate::engine::{Engine, EngineConfig, EngineError};
use crate::gpu::Gpu;
use crate::p2p::P2pTransferService;
use crate::transport::tcp::TcpTransport;
use crate::types::{NodeAddr, SessionId};

/// Node settings.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// gRPC (P2P service) bind address; port 0 picks one (real runs only).
    pub grpc_addr: SocketAddr,
    /// Data-plane (TCP transport) bind address; port 0 picks one.
    pub data_addr: SocketAddr,
    /// Host peers use to reach this node (advertise address host part).
    pub advertise_host: String,
    /// MetaServer address.
    pub metaserver: String,
    /// Engine settings.
    pub engine: EngineConfig,
    /// Registration queue bounds.
    pub queue: QueueConfig,
    /// Deadline of every MetaServer RPC.
    pub metaserver_rpc_timeout: Duration,
    /// TCP connections per peer.
    pub tcp_connections_per_peer: usize,
}

impl NodeConfig {
    /// Loopback defaults: both ports picked by the OS.
    pub fn loopback(metaserver: impl Into<String>) -> Self {
        Self {
            grpc_addr: "127.0.0.1:0".parse().expect("literal"),
            data_addr: "127.0.0.1:0".parse().expect("literal"),
            advertise_host: "127.0.0.1".into(),
            metaserver: metaserver.into(),
            engine: EngineConfig::default(),
            queue: QueueConfig::default(),
            metaserver_rpc_timeout: Duration::from_millis(crate::limits::METASERVER_RPC_TIMEOUT_MS_DEFAULT),
            tcp_connections_per_peer: crate::limits::TCP_CONNECTIONS_PER_PEER_DEFAULT,
        }
    }
}

/// Start-up errors.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The gRPC port could not be bound.
    #[error("cannot bind gRPC address {addr}: {source}")]
    BindGrpc {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// The data-plane port could not be bound.
    #[error("cannot bind data-plane address {addr}: {source}")]
    BindData {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// The advertise address is malformed.
    #[error(transparent)]
    Id(#[from] crate::types::IdError),
    /// The MetaServer client could not be created.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The engine could not be created (e.g. the pool allocation failed).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// A running node.
pub struct NodeHandle {
    /// The engine.
    pub engine: Engine,
    /// The bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// The advertise address registered at the MetaServer.
    pub node: NodeAddr,
    /// The TCP transport (hooks and counters).
    pub transport: Arc<TcpTransport>,
    shutdown: watch::Sender<bool>,
    serve: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl NodeHandle {
    /// Graceful stop: shuts the client down (best-effort unregister within
    /// `deadline`), stops the gRPC server. The data-plane listener stops when
    /// the last reference to the transport drops.
    pub async fn shutdown(self, deadline: Duration) {
        self.engine.client().shutdown(deadline).await;
        self.transport.shutdown();
        let _ = self.shutdown.send(true);
        let _ = tokio::time::timeout(deadline, self.serve).await;
    }

    /// Abrupt stop (a crash): the data plane and the gRPC server stop at
    /// once, no unregister is sent, the MetaServer keeps listing this node's
    /// blocks until its session goes stale.
    pub fn kill(self) {
        self.transport.shutdown();
        let _ = self.shutdown.send(true);
        self.serve.abort();
        self.engine.client().abort();
    }
}

/// Boots a node. See the module doc.
///
/// # Errors
/// [`NodeError`] — bind failures are reported before anything is served.
pub async fn start(cfg: NodeConfig, gpu: Arc<dyn Gpu>) -> Result<NodeHandle, NodeError> {
    let bound =
        crate::rt::bind(cfg.grpc_addr).await.map_err(|source| NodeError::BindGrpc { addr: cfg.grpc_addr, source })?;
    let grpc_addr = bound.local_addr;
    let node = NodeAddr::parse(&format!("{}:{}", cfg.advertise_host, grpc_addr.port()))?;
    let session = SessionId::random(&mut rand::rngs::StdRng::from_os_rng());
    let mut ccfg = ClientConfig::new(cfg.metaserver.clone(), node.clone(), session);
    ccfg.queue = cfg.queue;
    ccfg.rpc_timeout = cfg.metaserver_rpc_timeout;
    let client = MetaServerClient::start(ccfg)?;
    // A start that fails from here on must stop the client: its driver would
    // otherwise heartbeat forever for a node that never became ready, keeping
    // the address alive at the MetaServer (a later node on it is rejected).
    let engine = match Engine::new(node.clone(), cfg.engine.clone(), gpu, client.clone()) {
        Ok(e) => e,
        Err(e) => {
            client.shutdown(cfg.metaserver_rpc_timeout).await;
            return Err(e.into());
        }
    };
    let transport = match TcpTransport::start(
        cfg.data_addr,
        &cfg.advertise_host,
        node.clone(),
        engine.pool().arena_len(),
        engine.data_source(),
        cfg.tcp_connections_per_peer,
    )
    .await
    {
        Ok(t) => t,
        Err(source) => {
            client.shutdown(cfg.metaserver_rpc_timeout).await;
            return Err(NodeError::BindData { addr: cfg.data_addr, source });
        }
    };
    let transport = Arc::new(transport);
    engine.set_transport(transport.clone());
    let (tx, mut rx) = watch::channel(false);
    let router = P2pTransferService::new(engine.clone()).router();
    let serve = tokio::spawn(crate::rt::serve(router, bound, async move {
        let _ = rx.wait_for(|v| *v).await;
    }));
    tracing::info!(%node, data = transport.data_addr(), "node ready");
    Ok(NodeHandle { engine, grpc_addr, node, transport, shutdown: tx, serve })
}
