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

impl BoundListener {
    /// Wraps a listener the embedder already bound (bind-first serving).
    /// Under the simulator the listener only names the address: it is
    /// closed here and madsim-tonic binds the address when serving starts.
    ///
    /// # Errors
    /// When the listener's local address cannot be read.
    pub fn from_listener(listener: tokio::net::TcpListener) -> std::io::Result<Self> {
        let local_addr = listener.local_addr()?;
        #[cfg(not(madsim))]
        {
            Ok(Self { local_addr, listener })
        }
        #[cfg(madsim)]
        {
            drop(listener);
            Ok(Self { local_addr })
        }
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

/// Whether this build runs under the simulator (`--cfg madsim`). Production
/// modules branch on this value, never on the cfg itself, so they compile and
/// read the same in both builds; a backend the simulator cannot run (the disk
/// tier's file backends, the shared pool's socket and memfd hand-off) is
/// refused at run time where it is opened, with its error's
/// "unavailable" variant.
pub const SIMULATED: bool = cfg!(madsim);

/// Worker tasks that CPU-bound work (e.g. a fetch's checksum pass) may
/// spread over: the machine's parallelism on real tokio; a fixed
/// [`SIM_CPU_PARALLELISM`] under the simulator, so that the same
/// spread-over-tasks path runs there and a seed replays identically
/// whatever host runs it.
pub fn cpu_parallelism() -> usize {
    #[cfg(not(madsim))]
    {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
    #[cfg(madsim)]
    {
        SIM_CPU_PARALLELISM
    }
}

/// [`cpu_parallelism`] under the simulator.
pub const SIM_CPU_PARALLELISM: usize = 4;

/// `f` over every part, results in the parts' order: the parts after the
/// first on scoped OS threads (joined before returning) while the calling
/// thread runs the first, on real builds; one part after the other on the
/// calling thread under the simulator, where OS threads are not allowed
/// (same parts, same results). The one place kvferry starts OS threads for
/// CPU-bound work.
///
/// # Panics
/// Re-raises a panic of `f` on any part.
pub fn map_parts<T: Send, R: Send>(parts: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    #[cfg(not(madsim))]
    if parts.len() > 1 {
        let f = &f;
        return std::thread::scope(|s| {
            let mut parts = parts.into_iter();
            let first = parts.next();
            let handles: Vec<_> = parts.map(|p| s.spawn(move || f(p))).collect();
            let mut out = Vec::with_capacity(handles.len() + 1);
            out.extend(first.map(f));
            for h in handles {
                match h.join() {
                    Ok(r) => out.push(r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            out
        });
    }
    parts.into_iter().map(f).collect()
}

/// Acknowledges received data at once on one TCP socket: re-arms Linux's
/// `TCP_QUICKACK` before each receive (the kernel drops back to delayed
/// ACKs on its own, so one `setsockopt` per receive keeps it on).
///
/// Why: a data-plane reader receives a stream of large responses; with
/// delayed ACKs (up to 40 ms each on Linux) a sender whose congestion window
/// shrank — on a busy loopback, after reordering that looked like loss —
/// waits for those ACKs, and a fetch of a few MiB stalls for tens of
/// milliseconds. Measured on the 2-core dev box (`kvferry pd --concurrency
/// 1`, `docs/BENCHMARKS.md`): read p99 121 ms without, 39 ms with.
/// A no-op under the simulator (its streams have no socket) and off Linux;
/// a failed `setsockopt` is ignored (the option is a hint).
///
/// Crate-private: it holds a raw fd with no lifetime, so only code that
/// keeps the stream open while arming it may have one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QuickAck {
    #[cfg(all(target_os = "linux", not(madsim)))]
    fd: std::os::fd::RawFd,
}

impl QuickAck {
    /// For `stream` (valid while the stream is open: use it only on reads of
    /// that stream).
    pub(crate) fn of(stream: &tokio::net::TcpStream) -> Self {
        let _ = stream; // unused where there is no socket option to set
        Self {
            #[cfg(all(target_os = "linux", not(madsim)))]
            fd: std::os::fd::AsRawFd::as_raw_fd(stream),
        }
    }

    /// Re-arms quick ACKs; call before each receive.
    pub(crate) fn arm(&self) {
        #[cfg(all(target_os = "linux", not(madsim)))]
        {
            let on: libc::c_int = 1;
            // SAFETY: a socket option of an open socket (the caller's stream
            // owns the fd for as long as it reads), from a live `c_int`.
            unsafe {
                libc::setsockopt(
                    self.fd,
                    libc::IPPROTO_TCP,
                    libc::TCP_QUICKACK,
                    std::ptr::from_ref(&on).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
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

/// Work that did not complete: [`run_to_completion`]'s future polled again
/// after it finished, or [`run_blocking`]'s work that panicked or was cut
/// off by the runtime's shutdown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskEnded(pub String);

/// Runs the CPU-bound `f` off the caller's thread, on tokio's blocking
/// pool, and waits for it; under the simulator it runs in place (madsim
/// has no blocking pool: its `spawn_blocking` is deprecated), so a seed
/// replays the same whatever the host's threads do.
///
/// # Errors
/// [`TaskEnded`] when `f` did not complete: it panicked, or the runtime
/// shut down under it.
pub async fn run_blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Result<R, TaskEnded> {
    #[cfg(not(madsim))]
    {
        tokio::task::spawn_blocking(f).await.map_err(|e| TaskEnded(e.to_string()))
    }
    #[cfg(madsim)]
    {
        Ok(f())
    }
}

/// Runs `fut`, a service loop that must keep its pace while the caller's
/// runtime is busy, on a thread of its own (named `name`, a current-thread
/// runtime with timers) rather than as a task of the current runtime: a
/// task shares its worker threads with whatever else runs there, and a
/// runtime whose tasks copy and checksum megabytes between awaits can hold
/// it off for milliseconds (the disk tier's driver: in `kvferry pd` on a
/// 2-core machine, as a task, its write-behind queues filled with the disk
/// at a third of its rate and dropped 9,156 victims; on its own thread, 0
/// to 211; docs/BENCHMARKS.md, session 20). The thread ends with `fut`.
/// If the thread or its runtime cannot be started, `fut` becomes a task of
/// the current runtime (logged at warn). Under the simulator it is always
/// a task, so a seed replays the same schedule.
pub fn spawn_on_own_thread<F>(name: &str, fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    #[cfg(not(madsim))]
    {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_time().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!(thread = name, error = %e, "cannot build a service thread's runtime; running it as a task");
                tokio::spawn(fut);
                return;
            }
        };
        // The future travels to the thread through a channel, so a thread
        // that cannot start leaves it here for the fallback.
        type Loop = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Loop>(1);
        let started = std::thread::Builder::new().name(name.to_string()).spawn(move || {
            if let Ok(fut) = rx.recv() {
                rt.block_on(fut);
            }
        });
        match started {
            Ok(_) => {
                let _ = tx.send(Box::pin(fut));
            }
            Err(e) => {
                tracing::warn!(thread = name, error = %e, "cannot start a service thread; running it as a task");
                tokio::spawn(fut);
            }
        }
    }
    #[cfg(madsim)]
    {
        let _ = name;
        tokio::spawn(fut);
    }
}

/// Drives `fut` to completion even when the returned future is dropped
/// first: `fut` runs inline in the caller's task (no extra task hop — two
/// thread wake-ups fewer on the critical path), and only a future dropped
/// half way has its rest spawned onto the current runtime. The same code
/// runs under the simulator (madsim's tokio has the runtime handle and its
/// `spawn`), so the simulated schedule is the production one.
///
/// # Errors
/// [`TaskEnded`] only when polled after completion (a caller bug); a panic
/// in `fut` propagates to the caller.
pub fn run_to_completion<F>(fut: F) -> impl Future<Output = Result<F::Output, TaskEnded>> + Send
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    Detachable { fut: Some(Box::pin(fut)) }
}

/// See [`run_to_completion`]: polls its future inline; spawns the rest of it
/// when dropped before it finished.
struct Detachable<F: Future + Send + 'static>
where
    F::Output: Send + 'static,
{
    fut: Option<std::pin::Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> Future for Detachable<F>
where
    F::Output: Send + 'static,
{
    type Output = Result<F::Output, TaskEnded>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        // Out of `self` while polled: if `fut` panics it unwinds with this
        // frame and is never spawned (nor polled) again.
        let Some(mut fut) = self.fut.take() else {
            return std::task::Poll::Ready(Err(TaskEnded("polled after completion".into())));
        };
        match fut.as_mut().poll(cx) {
            std::task::Poll::Ready(out) => std::task::Poll::Ready(Ok(out)),
            std::task::Poll::Pending => {
                self.fut = Some(fut);
                std::task::Poll::Pending
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Detachable<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        // `fut` is here only between polls, so this drop is the caller
        // going away (cancelled, or unwinding from a panic elsewhere).
        let Some(fut) = self.fut.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    fut.await;
                });
            }
            // No runtime left (it is shutting down): nothing could complete it.
            Err(_) => tracing::warn!("a detached operation was dropped outside a runtime and abandoned"),
        }
    }
}

/// A gRPC server's service as it is served: on real builds wrapped in
/// [`LimitAsResourceExhausted`] (a request over the decode limit answers
/// `RESOURCE_EXHAUSTED`, as `status` maps every other refusal); under the
/// simulator the service itself (madsim's tonic has no HTTP layer to wrap). A
/// service module reads the same under both cfgs by passing its server
/// through here.
#[cfg(not(madsim))]
pub fn grpc_service<S>(svc: S) -> LimitAsResourceExhausted<S> {
    LimitAsResourceExhausted(svc)
}

/// See the real build's `grpc_service`: the identity under the simulator.
#[cfg(madsim)]
pub fn grpc_service<S>(svc: S) -> S {
    svc
}

/// Wraps a tonic service so a request over the decode limit answers
/// `RESOURCE_EXHAUSTED` (the gRPC convention for "message larger than the
/// configured limit") instead of tonic's `OUT_OF_RANGE`. Only that one
/// status is rewritten (matched by tonic's message); everything else passes
/// through. Real builds only: madsim's simulated tonic has no HTTP layer
/// (see [`grpc_service`]).
#[cfg(not(madsim))]
#[derive(Clone, Debug)]
pub struct LimitAsResourceExhausted<S>(pub S);

#[cfg(not(madsim))]
impl<S: tonic::server::NamedService> tonic::server::NamedService for LimitAsResourceExhausted<S> {
    const NAME: &'static str = S::NAME;
}

#[cfg(not(madsim))]
impl<S, B, RB> tonic::codegen::Service<tonic::codegen::http::Request<B>> for LimitAsResourceExhausted<S>
where
    S: tonic::codegen::Service<tonic::codegen::http::Request<B>, Response = tonic::codegen::http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tonic::codegen::BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let fut = self.0.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let over_limit = resp.extensions().get::<tonic::Status>().is_some_and(|s| {
                s.code() == tonic::Code::OutOfRange
                    && s.message().starts_with("Error, decoded message length too large")
            });
            if over_limit {
                let code = (tonic::Code::ResourceExhausted as i32).to_string();
                if let Ok(v) = tonic::codegen::http::HeaderValue::from_str(&code) {
                    resp.headers_mut().insert(tonic::Status::GRPC_STATUS, v);
                }
            }
            Ok(resp)
        })
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::run_to_completion;

    // Multi-threaded: a spawned task would run on a worker, not here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_inline_and_returns_the_output() {
        let caller = std::thread::current().id();
        let ran_on = run_to_completion(async { std::thread::current().id() }).await.unwrap();
        assert_eq!(ran_on, caller, "on real tokio the future runs in the caller's task");
    }

    #[tokio::test]
    async fn a_dropped_future_still_finishes() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let finished = Arc::new(AtomicBool::new(false));
        let f = finished.clone();
        let op = run_to_completion(async move {
            let _ = wait.await;
            f.store(true, Ordering::SeqCst);
        });
        // Polled once (it starts), then dropped half way.
        assert!(tokio::time::timeout(Duration::from_millis(20), op).await.is_err());
        go.send(()).unwrap();
        for _ in 0..200 {
            if finished.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the dropped operation was abandoned");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn finishes_when_its_caller_unwinds_from_a_panic_elsewhere() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let finished = Arc::new(AtomicBool::new(false));
        let f = finished.clone();
        let caller = tokio::spawn(async move {
            let op = run_to_completion(async move {
                let _ = wait.await;
                f.store(true, Ordering::SeqCst);
            });
            let elsewhere = async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                panic!("a sibling future of the operation panics");
            };
            tokio::join!(op, elsewhere);
        });
        assert!(caller.await.expect_err("the caller panicked").is_panic());
        go.send(()).expect("the operation still waits for the signal");
        for _ in 0..200 {
            if finished.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the operation was abandoned with its caller");
    }
}

/// A server running: resolves when it has stopped, with the transport
/// error that ended it, if any.
pub type Serving = std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// Serves `router` on `threads` I/O threads (0 is taken as 1) of their own, each a
/// single-threaded tokio runtime, until `shutdown` resolves: the caller's
/// runtime only accepts, and hands every connection to the thread with the
/// fewest open (ties in turn), where it stays. A connection's HTTP/2 task,
/// its requests' tasks and their answers then share one thread and its
/// caches, with no work-stealing hand-off or cross-thread wake-up per
/// request. On the 16-core H200 host under msload, four such threads gave
/// the MetaServer a lower query p99 than one shared work-stealing runtime
/// in 6 of 8 alternated rounds (0.30–0.41 ms in the quietest, against
/// 0.61 ms and more), on a host noisy enough that the two ranges overlap
/// (docs/BENCHMARKS.md, session 8). The threads and
/// runtimes are started here, so a failure to start them is an error now,
/// not while serving. The returned future accepts and, once `shutdown`
/// resolves, stops accepting, lets every thread finish its in-flight
/// requests (graceful), and resolves with the first thread's serving error.
/// Dropping it stops the threads too.
///
/// Under the simulator there are no threads: the returned future is
/// [`serve`]'s (the same service code answers either way).
///
/// # Errors
/// Now: a runtime or thread that cannot be started. From the future: the
/// transport error that ended a thread's serving.
pub fn serve_on_io_threads(
    router: tonic::transport::server::Router,
    bound: BoundListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    threads: usize,
) -> std::io::Result<Serving> {
    #[cfg(not(madsim))]
    {
        io_threads::start(router, bound.listener, shutdown, threads.max(1))
    }
    #[cfg(madsim)]
    {
        let _ = threads;
        Ok(Box::pin(serve(router, bound, shutdown)))
    }
}

#[cfg(not(madsim))]
mod io_threads {
    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll};
    use std::time::Duration;

    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio::sync::{mpsc, oneshot, watch};
    use tokio_stream::StreamExt;
    use tonic::transport::server::{Connected, Router, TcpConnectInfo};

    /// Counts a thread's open connections while it lives.
    struct Open(Arc<AtomicUsize>);

    impl Open {
        fn new(count: &Arc<AtomicUsize>) -> Self {
            count.fetch_add(1, Ordering::Relaxed);
            Self(count.clone())
        }
    }

    impl Drop for Open {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A connection served on one I/O thread.
    pub(super) struct PinnedConn {
        io: tokio::net::TcpStream,
        _open: Open,
    }

    impl Connected for PinnedConn {
        type ConnectInfo = TcpConnectInfo;
        fn connect_info(&self) -> TcpConnectInfo {
            self.io.connect_info()
        }
    }

    impl AsyncRead for PinnedConn {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for PinnedConn {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.io).poll_write(cx, buf)
        }
        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
        }
        fn is_write_vectored(&self) -> bool {
            self.io.is_write_vectored()
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    /// The thread for the next connection: the one with the fewest open,
    /// the first such from `turn` on (so equal threads take turns).
    pub(super) fn pick(open: &[usize], turn: usize) -> usize {
        let n = open.len();
        (0..n).map(|k| (turn % n + k) % n).min_by_key(|&i| open[i]).unwrap_or(0)
    }

    /// One I/O thread as the acceptor sees it.
    struct Lane {
        conns: mpsc::UnboundedSender<(std::net::TcpStream, Open)>,
        open: Arc<AtomicUsize>,
    }

    type Served = Result<(), tonic::transport::Error>;

    pub(super) fn start(
        router: Router,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
        threads: usize,
    ) -> io::Result<super::Serving> {
        // Dropped (on an error below, or with the future) it stops the
        // threads started so far.
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut lanes = Vec::with_capacity(threads);
        let mut done: Vec<oneshot::Receiver<Served>> = Vec::with_capacity(threads);
        for i in 0..threads {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let (conns, rx) = mpsc::unbounded_channel::<(std::net::TcpStream, Open)>();
            let (done_tx, done_rx) = oneshot::channel();
            let (router, mut stop) = (router.clone(), stop_rx.clone());
            std::thread::Builder::new().name(format!("kvferry-io-{i}")).spawn(move || {
                let served = rt.block_on(async move {
                    // Registered with this thread's reactor here, inside its
                    // runtime; a stream that cannot be is skipped.
                    let incoming = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
                        .map(|(s, open)| tokio::net::TcpStream::from_std(s).map(|io| PinnedConn { io, _open: open }));
                    router
                        .serve_with_incoming_shutdown(incoming, async move {
                            let _ = stop.wait_for(|v| *v).await;
                        })
                        .await
                });
                let _ = done_tx.send(served);
            })?;
            lanes.push(Lane { conns, open: Arc::new(AtomicUsize::new(0)) });
            done.push(done_rx);
        }
        Ok(Box::pin(async move {
            tokio::pin!(shutdown);
            let mut turn = 0usize;
            loop {
                let accepted = tokio::select! {
                    () = &mut shutdown => break,
                    r = listener.accept() => r,
                };
                let stream = match accepted.and_then(|(s, _)| {
                    s.set_nodelay(true)?;
                    s.into_std()
                }) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "gRPC accept failed; retrying");
                        tokio::time::sleep(Duration::from_millis(crate::limits::ACCEPT_RETRY_MS)).await;
                        continue;
                    }
                };
                let open: Vec<usize> = lanes.iter().map(|l| l.open.load(Ordering::Relaxed)).collect();
                let lane = &lanes[pick(&open, turn)];
                turn = turn.wrapping_add(1);
                // A thread that ended drops the connection (the client sees
                // it closed and retries).
                let _ = lane.conns.send((stream, Open::new(&lane.open)));
            }
            drop(listener);
            let _ = stop_tx.send(true);
            let mut served = Ok(());
            for d in done {
                if let Ok(Err(e)) = d.await {
                    if served.is_ok() {
                        served = Err(e);
                    }
                }
            }
            served
        }))
    }

    #[cfg(test)]
    mod tests {
        use super::pick;

        #[test]
        fn a_connection_goes_to_the_thread_with_fewest_open_ties_in_turn() {
            assert_eq!(pick(&[3, 1, 2], 0), 1);
            assert_eq!(pick(&[3, 1, 2], 2), 1);
            assert_eq!(pick(&[0, 0, 0], 0), 0);
            assert_eq!(pick(&[0, 0, 0], 1), 1);
            assert_eq!(pick(&[0, 0, 0], 5), 2);
            assert_eq!(pick(&[2, 0, 0, 2], 3), 1);
            assert_eq!(pick(&[7], 9), 0);
        }
    }
}
