//! Runtime glue: the one place that knows whether we run on real tokio or
//! under the madsim simulator (`--cfg madsim`).
//!
//! Real builds bind a listener first and serve from it, so a taken port is an
//! error *before* anything reports ready (C12); madsim-tonic has no
//! `serve_with_incoming`, so under the simulator the server binds at serve
//! time on a fixed address from the harness's address plan.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::limits;

/// A bound (real) or reserved (simulated) server address.
#[derive(Debug)]
pub struct BoundListener {
    /// The address actually bound (the real port when asked for port 0).
    pub local_addr: SocketAddr,
    #[cfg(not(madsim))]
    listener: tokio::net::TcpListener,
}

/// Binds `addr` now.
///
/// # Errors
/// The bind error (e.g. `AddrInUse`) — before anything is served.
pub async fn bind(addr: SocketAddr) -> std::io::Result<BoundListener> {
    #[cfg(not(madsim))]
    {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        Ok(BoundListener { local_addr, listener })
    }
    #[cfg(madsim)]
    {
        Ok(BoundListener { local_addr: addr })
    }
}

#[cfg(not(madsim))]
impl BoundListener {
    /// Wraps a listener the embedder already bound (bind-first serving).
    ///
    /// # Errors
    /// When the listener's local address cannot be read.
    pub fn from_listener(listener: tokio::net::TcpListener) -> std::io::Result<Self> {
        let local_addr = listener.local_addr()?;
        Ok(Self { local_addr, listener })
    }
}

/// Serves a tonic router on a bound listener until `shutdown` resolves.
///
/// # Errors
/// The transport error that ended serving.
pub async fn serve(
    router: tonic::transport::server::Router,
    bound: BoundListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    #[cfg(not(madsim))]
    {
        let incoming = tonic::transport::server::TcpIncoming::from(bound.listener).with_nodelay(Some(true));
        router.serve_with_incoming_shutdown(incoming, shutdown).await
    }
    #[cfg(madsim)]
    {
        router.serve_with_shutdown(bound.local_addr, shutdown).await
    }
}

/// A lazily connecting gRPC channel to `addr` (`host:port` or a full
/// `http://` URI) whose every RPC is bounded by `timeout` (connect included;
/// without it an RPC over a clogged simulated link waits forever).
///
/// # Errors
/// A malformed address.
pub fn channel(addr: &str, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let uri = if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    Ok(Endpoint::from_shared(uri)?
        .timeout(timeout)
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(limits::GRPC_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(limits::GRPC_CONNECTION_WINDOW_BYTES)
        .connect_lazy())
}

/// A gRPC server builder with this crate's HTTP/2 flow-control windows
/// (see [`limits::GRPC_STREAM_WINDOW_BYTES`]); every service starts from it.
pub fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .initial_stream_window_size(limits::GRPC_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(limits::GRPC_CONNECTION_WINDOW_BYTES)
}

/// Worker threads that CPU-bound work (e.g. a fetch's checksum pass) may
/// spread over: the machine's parallelism on real tokio; 1 under the
/// simulator, which runs every task on one thread anyway, so that a seed
/// replays identically whatever host runs it.
pub fn cpu_parallelism() -> usize {
    #[cfg(not(madsim))]
    {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
    #[cfg(madsim)]
    {
        1
    }
}

/// Milliseconds since `origin` on the runtime clock (simulated under madsim).
pub fn elapsed_ms(origin: tokio::time::Instant) -> u64 {
    origin.elapsed().as_millis() as u64
}

/// The deadline passed before the future finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadlineElapsed;

/// Runs `f` until `deadline` (runtime clock). Works on both runtimes
/// (madsim has no `timeout_at`).
///
/// # Errors
/// [`DeadlineElapsed`] when the deadline passed first (`f` is dropped).
pub async fn timeout_at<F: Future>(deadline: tokio::time::Instant, f: F) -> Result<F::Output, DeadlineElapsed> {
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    tokio::time::timeout(left, f).await.map_err(|_| DeadlineElapsed)
}
