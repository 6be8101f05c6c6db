//! A kvferry node: one [`Engine`] with its MetaServer client, its P2P
//! transfer gRPC service and its data-plane transport listener.
//!
//! [`start`] is the single start-up entry used by the binary, the tests, the
//! main job and the simulator (so a simulated restart reruns real start-up).
//! Both listeners are bound before anything is served: a taken port is an
//! error before the node says ready (C12).
//!
//! # Data plane
//!
//! [`NodeConfig::transport`] picks the backend the engine reads peers
//! through and serves them with: [`TransportChoice::Tcp`] (the default,
//! every build) or [`TransportChoice::Verbs`] (RDMA READ over RC queue
//! pairs; its device code exists only in builds with the `rdma` feature,
//! which a `--cfg madsim` build refuses). A verbs node that cannot run — a build
//! without the device code, a bad [`VerbsConfig`], no RDMA on the machine,
//! no device of that name — fails start-up with a [`NodeError`] before it
//! says ready, and leaves nothing running (no listener, no MetaServer
//! client heartbeating for it).
//!
//! With TCP, [`NodeConfig::path`] adds the same-host shared pool
//! (`transport::shm`) under the composite `transport::path`:
//! [`PathChoice::Auto`] (the default) puts the pool in a sealed memfd,
//! serves it to authenticated same-host peers and reads same-host owners'
//! pools from memory, falling back to TCP on any failure;
//! [`PathChoice::Shm`] requires it (a node that cannot share its pool fails
//! start-up with [`NodeError::Shm`]); [`PathChoice::Tcp`] keeps the pool
//! private and reads over TCP only. The verbs transport ignores it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use tokio::sync::watch;

use crate::client::{ClientConfig, ClientError, MetaServerClient, QueueConfig};
use crate::engine::{Engine, EngineConfig, EngineError};
use crate::gpu::Gpu;
use crate::p2p::P2pTransferService;
use crate::transport::Transport;
use crate::transport::path::PathTransport;
pub use crate::transport::path::{PathChoice, PathStats};
use crate::transport::tcp::TcpTransport;
use crate::transport::verbs::VerbsConfig;
use crate::transport::verbs::plan::PlanError;
use crate::transport::verbs::{VerbsError, VerbsTransport};
use crate::types::{NodeAddr, SessionId};

/// Whether this build contains the verbs device code
/// (`transport::verbs::VerbsTransport`).
const VERBS_BUILT: bool = cfg!(feature = "rdma");

/// The data-plane backend of a node (see the module doc).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// The TCP transport: [`NodeConfig::data_addr`] is bound and
    /// [`NodeConfig::tcp_connections_per_peer`] applies. Every build.
    #[default]
    Tcp,
    /// The RDMA verbs transport on the device and port the config names
    /// (`--rdma-device`); `data_addr` and `tcp_connections_per_peer` are
    /// unused. Needs a build with the `rdma` feature, not under `--cfg
    /// madsim`; every node of a cluster must use it (a peer speaking TCP
    /// is refused at the handshake).
    Verbs(VerbsConfig),
}

impl std::fmt::Display for TransportChoice {
    /// `tcp`, or `verbs` with the device and port (`verbs mlx5_0 port 1`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportChoice::Tcp => f.write_str("tcp"),
            TransportChoice::Verbs(v) => write!(f, "verbs {} port {}", v.device, v.port),
        }
    }
}

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
    /// Most TCP connections a fetch keeps open to one peer
    /// ([`TransportChoice::Tcp`] only), `1..=`[`crate::limits::TCP_CONNECTIONS_PER_PEER_MAX`];
    /// each read batch uses as many as its bytes need.
    pub tcp_connections_per_peer: usize,
    /// The data-plane backend.
    pub transport: TransportChoice,
    /// Which paths a TCP node reads host memory through: the same-host
    /// shared pool and/or TCP (see the module doc). Ignored with
    /// [`TransportChoice::Verbs`].
    pub path: PathChoice,
    /// Talk TLS to the MetaServer, trusting these CA certificates (feature
    /// `tls`; see [`crate::tls`]). `None`: plain text.
    pub metaserver_tls: Option<crate::tls::TlsTrust>,
}

impl NodeConfig {
    /// Loopback defaults: both ports picked by the OS, the TCP transport.
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
            transport: TransportChoice::Tcp,
            path: PathChoice::Auto,
            metaserver_tls: None,
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
    /// [`TransportChoice::Verbs`] in a build without the verbs device code
    /// (no `rdma` feature; the simulator's build never has it). Reported before
    /// anything is bound.
    #[error("this binary was built without the `rdma` feature; rebuild with --features rdma")]
    RdmaNotBuilt,
    /// [`NodeConfig::tcp_connections_per_peer`] is 0 or above
    /// [`crate::limits::TCP_CONNECTIONS_PER_PEER_MAX`]. Reported before
    /// anything is bound.
    #[error("tcp_connections_per_peer {0} is outside 1..={max}", max = crate::limits::TCP_CONNECTIONS_PER_PEER_MAX)]
    TcpConnections(usize),
    /// The [`VerbsConfig`] is out of range ([`PlanError::BadConfig`]).
    /// Reported before anything is bound.
    #[error(transparent)]
    VerbsConfig(PlanError),
    /// The verbs transport could not open its device: no RDMA on this
    /// machine (`VerbsError::NoRdma` in an `rdma` build), no device at all
    /// (`VerbsError::NoDevices`), no device of that name
    /// (`VerbsError::DeviceNotFound`, listing the names present), an
    /// unusable port, or a failed verbs call. The MetaServer client is shut
    /// down before this is returned.
    #[error("verbs transport: {0}")]
    Verbs(#[source] VerbsError),
    /// [`PathChoice::Shm`] on a node that cannot share its pool (the
    /// simulator, no memfd, no host identity, the socket could not be
    /// bound). The MetaServer client is shut down before this is returned.
    #[error("shared pool (--path shm): {0}")]
    Shm(String),
}

impl NodeError {
    /// The stable code of this error (`docs/design.md`, "Errors"); a
    /// wrapped id, client or engine error answers its own code.
    pub fn code(&self) -> &'static str {
        match self {
            NodeError::BindGrpc { .. } => "node_bind_grpc",
            NodeError::BindData { .. } => "node_bind_data",
            NodeError::Id(e) => e.code(),
            NodeError::Client(e) => e.code(),
            NodeError::Engine(e) => e.code(),
            NodeError::RdmaNotBuilt => "node_rdma_not_built",
            NodeError::TcpConnections(_) => "node_tcp_connections",
            NodeError::VerbsConfig(_) => "node_verbs_config",
            NodeError::Verbs(_) => "node_verbs",
            NodeError::Shm(_) => "node_shm",
        }
    }
}

/// A running node.
pub struct NodeHandle {
    /// The engine.
    pub engine: Engine,
    /// The bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// The advertise address registered at the MetaServer.
    pub node: NodeAddr,
    /// The TCP transport (hooks and counters); `None` when the node runs
    /// [`TransportChoice::Verbs`].
    pub tcp: Option<Arc<TcpTransport>>,
    /// The composite over TCP and the shared pool (per-path counters:
    /// [`PathTransport::stats`]); `None` with [`TransportChoice::Verbs`].
    pub path: Option<Arc<PathTransport>>,
    /// The verbs transport (device, limits, counters); `None` when the node
    /// runs [`TransportChoice::Tcp`], and always in a build without `rdma`
    /// (whose `VerbsTransport` has no values).
    pub verbs: Option<Arc<VerbsTransport>>,
    shutdown: watch::Sender<bool>,
    serve: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl NodeHandle {
    /// Graceful stop within `deadline` altogether: shuts the client down
    /// (best-effort unregister), stops the TCP data plane (waiting until
    /// its listener is closed, so its port can be bound again) and the
    /// gRPC server, each step given what is left of `deadline`. The verbs
    /// transport has no listener to stop: its queue pairs are destroyed
    /// when the last reference to it (the engine's) drops.
    pub async fn shutdown(self, deadline: Duration) {
        let end = tokio::time::Instant::now() + deadline;
        // (madsim's tokio has no `timeout_at`.)
        let left = || end.saturating_duration_since(tokio::time::Instant::now());
        self.engine.client().shutdown(deadline).await;
        if let Some(p) = &self.path {
            p.shutdown();
        }
        if let Some(t) = &self.tcp {
            t.shutdown();
            let _ = tokio::time::timeout(left(), t.listener_closed()).await;
        }
        let _ = self.shutdown.send(true);
        let _ = tokio::time::timeout(left(), self.serve).await;
    }

    /// Abrupt stop (a crash): the TCP data plane and the gRPC server stop at
    /// once, no unregister is sent, the MetaServer keeps listing this node's
    /// blocks until its session goes stale. With verbs, peers already
    /// connected can still READ the pool through the NIC until the engine
    /// is dropped; they can no longer handshake or lock blocks (both are
    /// gRPC calls).
    pub fn kill(self) {
        if let Some(p) = &self.path {
            p.shutdown();
        }
        if let Some(t) = &self.tcp {
            t.shutdown();
        }
        let _ = self.shutdown.send(true);
        self.serve.abort();
        self.engine.client().abort();
    }
}

/// The started data plane.
enum DataPlane {
    Tcp(Arc<TcpTransport>, Arc<PathTransport>),
    Verbs(Arc<VerbsTransport>),
}

impl DataPlane {
    fn as_transport(&self) -> Arc<dyn Transport> {
        match self {
            DataPlane::Tcp(_, p) => p.clone(),
            DataPlane::Verbs(t) => t.clone(),
        }
    }

    fn path(&self) -> Option<Arc<PathTransport>> {
        match self {
            DataPlane::Tcp(_, p) => Some(p.clone()),
            DataPlane::Verbs(_) => None,
        }
    }

    fn tcp(&self) -> Option<Arc<TcpTransport>> {
        match self {
            DataPlane::Tcp(t, _) => Some(t.clone()),
            DataPlane::Verbs(_) => None,
        }
    }

    fn verbs(&self) -> Option<Arc<VerbsTransport>> {
        match self {
            DataPlane::Tcp(..) => None,
            DataPlane::Verbs(t) => Some(t.clone()),
        }
    }
}

/// Starts the data plane `cfg.transport` names for `engine`; with TCP on
/// `data`, the listener bound before anything started.
fn start_data_plane(
    cfg: &NodeConfig,
    node: &NodeAddr,
    engine: &Engine,
    data: Option<tokio::net::TcpListener>,
) -> Result<DataPlane, NodeError> {
    match &cfg.transport {
        TransportChoice::Tcp => {
            let listener = data.expect("a TCP node's data listener is bound before start-up");
            let tcp = TcpTransport::start_on(
                listener,
                &cfg.advertise_host,
                node.clone(),
                engine.pool().arena_len(),
                engine.data_source(),
                cfg.tcp_connections_per_peer,
                crate::transport::tcp::ConnLimits::default(),
            )
            .map(Arc::new)
            .map_err(|source| NodeError::BindData { addr: cfg.data_addr, source })?;
            let shm = start_shm(cfg.path, engine, tcp.local_metadata())?;
            let path = Arc::new(PathTransport::new(cfg.path, tcp.clone(), shm));
            Ok(DataPlane::Tcp(tcp, path))
        }
        // A build without `rdma` refused this choice in `preflight`; its
        // `VerbsTransport` opens nothing (`transport::verbs`, `absent`).
        TransportChoice::Verbs(v) => VerbsTransport::open(v, node.clone(), engine.pool(), engine.data_source())
            .map(|t| DataPlane::Verbs(Arc::new(t)))
            .map_err(NodeError::Verbs),
    }
}

/// The shared pool for `choice`: `None` with [`PathChoice::Tcp`], or with
/// [`PathChoice::Auto`] where it cannot start (logged).
#[cfg(target_os = "linux")]
fn start_shm(
    choice: PathChoice,
    engine: &Engine,
    base: crate::transport::HandshakeMetadata,
) -> Result<Option<Arc<crate::transport::shm::ShmTransport>>, NodeError> {
    use crate::transport::shm::{ShmConfig, ShmTransport};
    if choice == PathChoice::Tcp {
        return Ok(None);
    }
    match ShmTransport::start(engine.pool(), base, 0, ShmConfig::default()) {
        Ok(s) => Ok(Some(Arc::new(s))),
        Err(e) if choice == PathChoice::Shm => Err(NodeError::Shm(e.to_string())),
        Err(e) => {
            tracing::debug!(error = %e, "no shared pool; same-host peers read over TCP");
            Ok(None)
        }
    }
}

/// No shared pool off Linux.
#[cfg(not(target_os = "linux"))]
fn start_shm(
    choice: PathChoice,
    _engine: &Engine,
    _base: crate::transport::HandshakeMetadata,
) -> Result<Option<std::convert::Infallible>, NodeError> {
    match choice {
        PathChoice::Shm => Err(NodeError::Shm("shared pools need Linux".into())),
        _ => Ok(None),
    }
}

/// Checks the transport choice before anything is bound.
fn preflight(cfg: &NodeConfig) -> Result<(), NodeError> {
    if !(1..=crate::limits::TCP_CONNECTIONS_PER_PEER_MAX).contains(&cfg.tcp_connections_per_peer) {
        return Err(NodeError::TcpConnections(cfg.tcp_connections_per_peer));
    }
    if let TransportChoice::Verbs(v) = &cfg.transport {
        if !VERBS_BUILT {
            return Err(NodeError::RdmaNotBuilt);
        }
        v.validate().map_err(NodeError::VerbsConfig)?;
    }
    Ok(())
}

/// Boots a node, binding [`NodeConfig::grpc_addr`] and (TCP)
/// [`NodeConfig::data_addr`] first. See the module doc.
///
/// # Errors
/// [`NodeError`] — bind failures are reported before anything is started.
/// With [`TransportChoice::Verbs`]: [`NodeError::RdmaNotBuilt`] and
/// [`NodeError::VerbsConfig`] before anything is bound or announced;
/// [`NodeError::Verbs`] when the device cannot be opened,
/// after the MetaServer client was shut down.
pub async fn start(cfg: NodeConfig, gpu: Arc<dyn Gpu>) -> Result<NodeHandle, NodeError> {
    preflight(&cfg)?;
    let bound =
        crate::rt::bind(cfg.grpc_addr).await.map_err(|source| NodeError::BindGrpc { addr: cfg.grpc_addr, source })?;
    let data = match cfg.transport {
        TransportChoice::Tcp => Some(
            tokio::net::TcpListener::bind(cfg.data_addr)
                .await
                .map_err(|source| NodeError::BindData { addr: cfg.data_addr, source })?,
        ),
        TransportChoice::Verbs(_) => None,
    };
    start_bound(cfg, gpu, bound, data).await
}

/// Listeners an embedder bound itself for [`start_on`] (bind-first
/// serving: a taken port fails at the embedder's own bind, before any
/// kvferry state exists).
pub struct NodeListeners {
    /// The P2P transfer gRPC listener; its port is the node's advertise
    /// port.
    pub grpc: tokio::net::TcpListener,
    /// The TCP data-plane listener (unused, and closed, with
    /// [`TransportChoice::Verbs`]).
    pub data: tokio::net::TcpListener,
}

/// [`start`] on listeners the embedder bound: [`NodeConfig::grpc_addr`]
/// and [`NodeConfig::data_addr`] are ignored, everything else applies. One
/// [`NodeHandle`] stops the whole node.
///
/// # Errors
/// As [`start`], without the bind errors.
pub async fn start_on(cfg: NodeConfig, gpu: Arc<dyn Gpu>, listeners: NodeListeners) -> Result<NodeHandle, NodeError> {
    preflight(&cfg)?;
    let addr = listeners.grpc.local_addr().map_err(|source| NodeError::BindGrpc { addr: cfg.grpc_addr, source })?;
    let bound = crate::rt::BoundListener::from_listener(listeners.grpc)
        .map_err(|source| NodeError::BindGrpc { addr, source })?;
    let data = matches!(cfg.transport, TransportChoice::Tcp).then_some(listeners.data);
    start_bound(cfg, gpu, bound, data).await
}

/// Start-up after the listeners are bound.
async fn start_bound(
    cfg: NodeConfig,
    gpu: Arc<dyn Gpu>,
    bound: crate::rt::BoundListener,
    data: Option<tokio::net::TcpListener>,
) -> Result<NodeHandle, NodeError> {
    let grpc_addr = bound.local_addr;
    let node = NodeAddr::parse(&format!("{}:{}", cfg.advertise_host, grpc_addr.port()))?;
    let session = SessionId::random(&mut rand::rngs::StdRng::from_os_rng());
    let mut ccfg = ClientConfig::new(cfg.metaserver.clone(), node.clone(), session);
    ccfg.queue = cfg.queue;
    ccfg.rpc_timeout = cfg.metaserver_rpc_timeout;
    ccfg.tls = cfg.metaserver_tls.clone();
    let client = MetaServerClient::start(ccfg)?;
    // A start that fails from here on must stop the client: its driver would
    // otherwise heartbeat forever for a node that never became ready, keeping
    // the address alive at the MetaServer (a later node on it is rejected).
    let mut ecfg = cfg.engine.clone();
    // Only a pool that may be shared goes into a memfd (a private heap arena
    // gets transparent huge pages where shared memory may not).
    ecfg.pool_shared &= cfg.path != PathChoice::Tcp && matches!(cfg.transport, TransportChoice::Tcp);
    ecfg.device_direct &= matches!(cfg.path, PathChoice::Auto | PathChoice::Ipc);
    let engine = match Engine::new(node.clone(), ecfg, gpu, client.clone()) {
        Ok(e) => e,
        Err(e) => {
            client.shutdown(cfg.metaserver_rpc_timeout).await;
            return Err(e.into());
        }
    };
    let data_plane = match start_data_plane(&cfg, &node, &engine, data) {
        Ok(d) => d,
        Err(e) => {
            client.shutdown(cfg.metaserver_rpc_timeout).await;
            return Err(e);
        }
    };
    engine.set_transport(data_plane.as_transport());
    let (tx, mut rx) = watch::channel(false);
    let router = P2pTransferService::new(engine.clone()).router();
    let serve = tokio::spawn(crate::rt::serve(router, bound, async move {
        let _ = rx.wait_for(|v| *v).await;
    }));
    let data = match &data_plane {
        DataPlane::Tcp(t, p) => format!("tcp {} (path {})", t.data_addr(), p.choice()),
        DataPlane::Verbs(_) => cfg.transport.to_string(),
    };
    tracing::info!(%node, data, "node ready");
    Ok(NodeHandle {
        engine,
        grpc_addr,
        node,
        tcp: data_plane.tcp(),
        path: data_plane.path(),
        verbs: data_plane.verbs(),
        shutdown: tx,
        serve,
    })
}
