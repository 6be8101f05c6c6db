//! The `tcp` transport: one-sided READ semantics over plain TCP sockets — the
//! embedded default data plane.
//!
//! Each node runs one data-plane listener. A reader keeps a pool of up to
//! `TCP_CONNECTIONS_PER_PEER_DEFAULT` connections per peer (opened on first
//! use); each read batch is spread over as many of them as its bytes need
//! (`TCP_CONNECTION_SHARE_BYTES_MIN` each), idle ones first, so the parts a
//! fetch keeps in flight together use the whole pool. It pipelines its
//! reads: per connection a writer half streams every request frame while
//! the reader half receives the responses in order straight into the local
//! pool extents (no intermediate copy). The server answers requests in
//! order, sending payload bytes straight from the locked block's memory.
//! A pooled connection that turns out dead before answering anything (the
//! peer restarted while it sat idle) is replaced and its share of the batch
//! sent again, once, within the same deadline: reads are idempotent.
//!
//! Access is by capability (C13): every request names a transfer session;
//! the server asks its [`DataSource`] (the engine's lock table) whether the
//! range lies inside a block locked by that session. Unknown sessions and
//! out-of-range reads get an error frame and the connection stays usable; a
//! malformed frame gets an error frame and the connection is closed. Input
//! from the network never panics and never allocates by an unchecked length.
//!
//! The server bounds its connections per peer IP and in total
//! ([`ConnLimits`], defaults in `limits`): a connection beyond either bound
//! gets one [`Status::Internal`] error frame with `req_id` 0 naming the
//! bound, is closed, and is counted in [`TcpHooks::connections_refused`].

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::rt::timeout_at;
use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::AccessError;
use super::frame::{self, ReadRequest, Request, ResponseHeader, Status};
use super::handshake::{HandshakeMetadata, Region, TransportKind};
use super::{
    BadOp, DataSource, HandshakeRejected, IoFailure, NotConnected, ProtocolViolation, RawCopy, RawCopyRun,
    ReadCompletion, ReadOp, SlotEnds, SlotSummer, Transport, TransportError, validate_local,
};
use crate::limits;
use crate::memory::pool::Extent;
use crate::types::NodeAddr;

/// Largest request frame the server buffers before deciding it is malformed.
const REQUEST_BUFFER_BYTES_MAX: usize = 64 << 10;

/// Counters and fault switches of a TCP transport.
#[derive(Debug, Default)]
pub struct TcpHooks {
    /// Flip one payload byte in each of the next N served reads (test hook:
    /// corruption on the wire must be caught by the fetcher's checksums).
    pub corrupt_next_reads: AtomicU64,
    /// Reads served with the flipped byte of `corrupt_next_reads`, counted
    /// once the corrupted payload was written and flushed to the reader
    /// (what reached the wire, not what was armed).
    pub corrupt_sent: AtomicU64,
    /// Reads served OK.
    pub reads_served: AtomicU64,
    /// Payload bytes served.
    pub bytes_served: AtomicU64,
    /// Error frames sent (unknown session, out of range, malformed).
    pub errors_sent: AtomicU64,
    /// Connections accepted (admitted under the [`ConnLimits`]).
    pub connections_accepted: AtomicU64,
    /// Connections refused by the [`ConnLimits`] (per IP or total).
    pub connections_refused: AtomicU64,
    /// Client side, test hook: the next N read ops fail as if the connection
    /// reset mid-read (the stream is dropped and the rest of its batch fails
    /// with [`TransportError::Io`]). Used by the simulator (`transport::sim`).
    pub fail_next_reads: AtomicU64,
    /// Client side, test hook: every read op waits this many ms before taking
    /// its response (a slow peer or link); the wait counts against the read
    /// deadline. 0 = off.
    pub read_delay_ms: AtomicU64,
    /// Read ops failed by `fail_next_reads`.
    pub injected_read_errors: AtomicU64,
    /// Server side, test hook: each read request waits this many ms before
    /// it is authorized and served (a stalled or slow owner). 0 = off.
    pub serve_delay_ms: AtomicU64,
}

/// Bounds on the connections the data-plane server holds open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections from one peer IP (IPv4-mapped IPv6 counts as IPv4).
    pub per_ip_max: usize,
    /// Connections in total.
    pub total_max: usize,
}

impl Default for ConnLimits {
    /// [`limits::TCP_SERVER_CONNECTIONS_PER_IP_MAX`] and
    /// [`limits::TCP_SERVER_CONNECTIONS_MAX`].
    fn default() -> Self {
        Self { per_ip_max: limits::TCP_SERVER_CONNECTIONS_PER_IP_MAX, total_max: limits::TCP_SERVER_CONNECTIONS_MAX }
    }
}

/// Why the server refused a connection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConnRefusal {
    /// The peer IP already holds `limit` connections.
    #[error("too many data-plane connections from {ip} (limit {limit} per IP)")]
    PerIp {
        /// The peer's IP.
        ip: IpAddr,
        /// [`ConnLimits::per_ip_max`].
        limit: usize,
    },
    /// The server already holds `limit` connections.
    #[error("too many data-plane connections (limit {limit} in total)")]
    Total {
        /// [`ConnLimits::total_max`].
        limit: usize,
    },
}

/// The open-connection counts behind [`ConnLimits`]: a plain struct (no
/// I/O), so its rules are unit-tested without sockets.
#[derive(Debug)]
struct ConnTable {
    limits: ConnLimits,
    per_ip: HashMap<IpAddr, usize>,
    total: usize,
}

impl ConnTable {
    fn new(limits: ConnLimits) -> Self {
        Self { limits, per_ip: HashMap::new(), total: 0 }
    }

    /// Counts a new connection from `ip`, or refuses it (nothing changes).
    fn admit(&mut self, ip: IpAddr) -> Result<(), ConnRefusal> {
        let ip = ip.to_canonical();
        if self.total >= self.limits.total_max {
            return Err(ConnRefusal::Total { limit: self.limits.total_max });
        }
        let n = self.per_ip.entry(ip).or_insert(0);
        if *n >= self.limits.per_ip_max {
            return Err(ConnRefusal::PerIp { ip, limit: self.limits.per_ip_max });
        }
        *n += 1;
        self.total += 1;
        Ok(())
    }

    /// Uncounts a connection `admit` counted.
    fn release(&mut self, ip: IpAddr) {
        let ip = ip.to_canonical();
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
            self.total -= 1;
        }
    }
}

/// An admitted connection's place in the [`ConnTable`], given back when the
/// connection's task ends (however it ends).
struct ConnSlot {
    table: Arc<Mutex<ConnTable>>,
    ip: IpAddr,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner).release(self.ip);
    }
}

struct Peer {
    data_addr: String,
    conns: Vec<tokio::sync::Mutex<Option<TcpStream>>>,
    next: AtomicUsize,
}

impl Peer {
    /// The connections (indices into `conns`) a batch of `bytes` is spread
    /// over: `ceil(bytes / TCP_CONNECTION_SHARE_BYTES_MIN)` of them, at least
    /// one, at most the pool; idle ones first (another batch in flight holds
    /// the busy ones), from a rotating start so that batches take turns.
    /// Never empty.
    fn choose_conns(&self, bytes: u64) -> Vec<usize> {
        let k = self.conns.len().max(1);
        let want =
            usize::try_from(bytes.div_ceil(limits::TCP_CONNECTION_SHARE_BYTES_MIN)).unwrap_or(usize::MAX).clamp(1, k);
        let start = self.next.fetch_add(want, Ordering::Relaxed);
        let order = (0..k).map(|i| (start + i) % k);
        let (idle, busy): (Vec<usize>, Vec<usize>) = order.partition(|&c| self.conns[c].try_lock().is_ok());
        idle.into_iter().chain(busy).take(want).collect()
    }
}

/// The TCP transport of one node (server and client sides).
pub struct TcpTransport {
    local: HandshakeMetadata,
    peers: Mutex<HashMap<NodeAddr, Arc<Peer>>>,
    conns_per_peer: usize,
    next_req: AtomicU64,
    /// Counters and fault switches.
    pub hooks: Arc<TcpHooks>,
    stop: watch::Sender<bool>,
    /// Closed (its sender dropped) once the listener is.
    listener_closed: watch::Receiver<()>,
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl TcpTransport {
    /// Binds the data-plane listener on `bind` (a taken port is an error
    /// here, before anything is served) and starts serving reads of the
    /// pool (region 0, `pool_len` bytes) authorized by `source`.
    /// `advertise_host` is the host peers use to reach us.
    ///
    /// # Errors
    /// The bind error.
    pub async fn start(
        bind: SocketAddr,
        advertise_host: &str,
        node: NodeAddr,
        pool_len: u64,
        source: Arc<dyn DataSource>,
        conns_per_peer: usize,
    ) -> std::io::Result<Self> {
        Self::start_with_limits(bind, advertise_host, node, pool_len, source, conns_per_peer, ConnLimits::default())
            .await
    }

    /// [`TcpTransport::start`] with explicit bounds on the connections the
    /// server holds open ([`ConnLimits`]).
    ///
    /// # Errors
    /// The bind error.
    pub async fn start_with_limits(
        bind: SocketAddr,
        advertise_host: &str,
        node: NodeAddr,
        pool_len: u64,
        source: Arc<dyn DataSource>,
        conns_per_peer: usize,
        conn_limits: ConnLimits,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(bind).await?;
        Self::start_on(listener, advertise_host, node, pool_len, source, conns_per_peer, conn_limits)
    }

    /// [`TcpTransport::start_with_limits`] on a listener the embedder
    /// already bound (bind-first serving: a taken port failed at its bind,
    /// before anything was started).
    ///
    /// # Errors
    /// When the listener's local address cannot be read.
    pub fn start_on(
        listener: TcpListener,
        advertise_host: &str,
        node: NodeAddr,
        pool_len: u64,
        source: Arc<dyn DataSource>,
        conns_per_peer: usize,
        conn_limits: ConnLimits,
    ) -> std::io::Result<Self> {
        let port = listener.local_addr()?.port();
        let hooks = Arc::new(TcpHooks::default());
        let local = HandshakeMetadata {
            transport: TransportKind::Tcp,
            node: node.0.clone(),
            data_addr: format!("{advertise_host}:{port}"),
            regions: vec![Region { id: 0, base: 0, len: pool_len, rkey: 0 }],
            verbs: None,
            same_host: None,
        };
        let (stop, stop_rx) = watch::channel(false);
        let (closed_tx, listener_closed) = watch::channel(());
        let accepting = accept_loop(listener, source, hooks.clone(), conn_limits, stop_rx);
        tokio::spawn(async move {
            accepting.await; // the listener is dropped with the loop
            drop(closed_tx);
        });
        Ok(Self {
            local,
            peers: Mutex::new(HashMap::new()),
            conns_per_peer: conns_per_peer.clamp(1, limits::TCP_CONNECTIONS_PER_PEER_MAX),
            next_req: AtomicU64::new(1),
            hooks,
            stop,
            listener_closed,
        })
    }

    /// Stops serving: the listener closes and every served connection is
    /// dropped at its next request (a killed node's data plane). Reads this
    /// node posts to peers are unaffected.
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Resolves once the listener is closed after [`TcpTransport::shutdown`]
    /// (its port can be bound again: a node restarted on the same address
    /// right after a shutdown found it still taken when the accept loop had
    /// not run yet).
    pub async fn listener_closed(&self) {
        let mut closed = self.listener_closed.clone();
        while closed.changed().await.is_ok() {}
    }

    /// The data-plane address peers connect to.
    pub fn data_addr(&self) -> &str {
        &self.local.data_addr
    }

    /// Peers with an established handshake.
    pub fn connected_peers(&self) -> usize {
        self.peers.lock().expect("peers lock").len()
    }
}

async fn accept_loop(
    listener: TcpListener,
    source: Arc<dyn DataSource>,
    hooks: Arc<TcpHooks>,
    conn_limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
) {
    let table = Arc::new(Mutex::new(ConnTable::new(conn_limits)));
    let refusing = Arc::new(AtomicUsize::new(0));
    loop {
        // `biased` (stop first) here and below: an unbiased select! draws
        // from tokio's thread RNG, seeded with a process-global counter,
        // which breaks seed replay in the simulator.
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let admitted = table.lock().unwrap_or_else(std::sync::PoisonError::into_inner).admit(peer.ip());
                if let Err(why) = admitted {
                    hooks.connections_refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, %why, "data-plane connection refused");
                    refuse(stream, why, &hooks, &refusing);
                    continue;
                }
                let slot = ConnSlot { table: table.clone(), ip: peer.ip() };
                let _ = stream.set_nodelay(true);
                hooks.connections_accepted.fetch_add(1, Ordering::Relaxed);
                let (source, hooks, mut stop) = (source.clone(), hooks.clone(), stop.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    tokio::select! {
                        biased;
                        _ = stop.wait_for(|s| *s) => {}
                        _ = serve_conn(stream, source, hooks) => {}
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "data-plane accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(limits::ACCEPT_RETRY_MS)).await;
            }
        }
    }
}

/// Refuses a connection over the [`ConnLimits`]: one error frame
/// ([`Status::Internal`], `req_id` 0, the reason), then close, all within
/// [`limits::TCP_SERVER_REFUSAL_WRITE_MS`]. With
/// [`limits::TCP_SERVER_REFUSALS_IN_FLIGHT_MAX`] refusals already writing,
/// the connection is closed at once instead.
fn refuse(mut stream: TcpStream, why: ConnRefusal, hooks: &Arc<TcpHooks>, refusing: &Arc<AtomicUsize>) {
    if refusing.fetch_add(1, Ordering::Relaxed) >= limits::TCP_SERVER_REFUSALS_IN_FLIGHT_MAX {
        refusing.fetch_sub(1, Ordering::Relaxed);
        return; // dropping the stream closes it
    }
    let (hooks, refusing) = (hooks.clone(), refusing.clone());
    tokio::spawn(async move {
        let deadline = Instant::now() + std::time::Duration::from_millis(limits::TCP_SERVER_REFUSAL_WRITE_MS);
        // Frame, FIN, then drain what the peer already sent: closing a
        // socket with unread input sends a reset, which can destroy the
        // frame before the peer reads it.
        let _ = timeout_at(deadline, async {
            send_error(&mut stream, &hooks, 0, Status::Internal, &why.to_string()).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 1024];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<(), std::io::Error>(())
        })
        .await;
        refusing.fetch_sub(1, Ordering::Relaxed);
    });
}

async fn send_error(
    wr: &mut TcpStream,
    hooks: &TcpHooks,
    req_id: u64,
    status: Status,
    msg: &str,
) -> std::io::Result<()> {
    hooks.errors_sent.fetch_add(1, Ordering::Relaxed);
    let msg = &msg.as_bytes()[..msg.len().min(frame::ERROR_MESSAGE_BYTES_MAX)];
    let mut out = Vec::with_capacity(frame::RESPONSE_HEADER_BYTES + msg.len());
    frame::encode_response_header(&ResponseHeader { req_id, status, len: msg.len() as u64 }, &mut out)
        .map_err(std::io::Error::other)?;
    out.extend_from_slice(msg);
    wr.write_all(&out).await?;
    wr.flush().await
}

async fn serve_conn(mut stream: TcpStream, source: Arc<dyn DataSource>, hooks: Arc<TcpHooks>) {
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    loop {
        match frame::decode_request(&buf) {
            Ok(Some((req, used))) => {
                buf.drain(..used);
                let r = match req {
                    Request::Ping { req_id } => {
                        let mut out = Vec::new();
                        match frame::encode_response_header(
                            &ResponseHeader { req_id, status: Status::Ok, len: 0 },
                            &mut out,
                        ) {
                            Ok(()) => match stream.write_all(&out).await {
                                Ok(()) => stream.flush().await,
                                Err(e) => Err(e),
                            },
                            Err(e) => Err(std::io::Error::other(e)),
                        }
                    }
                    Request::Read(rr) => serve_read(&mut stream, &*source, &hooks, rr).await,
                };
                if r.is_err() {
                    return;
                }
            }
            Ok(None) => {
                if buf.len() > REQUEST_BUFFER_BYTES_MAX {
                    let _ = send_error(&mut stream, &hooks, 0, Status::Malformed, "request frame too long").await;
                    return;
                }
                match stream.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
            Err(e) => {
                let _ = send_error(&mut stream, &hooks, 0, e.status(), &e.to_string()).await;
                return;
            }
        }
    }
}

async fn serve_read(
    stream: &mut TcpStream,
    source: &dyn DataSource,
    hooks: &TcpHooks,
    rr: ReadRequest,
) -> std::io::Result<()> {
    let delay_ms = hooks.serve_delay_ms.load(Ordering::Relaxed);
    if delay_ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
    }
    let (extent, off) = match source.authorize(&rr.session, rr.region, rr.offset, rr.len) {
        Ok(v) => v,
        Err(e) => {
            let status = match e {
                AccessError::UnknownSession | AccessError::ForeignSession => Status::UnknownSession,
                AccessError::OutOfRange { .. } => Status::OutOfRange,
            };
            return send_error(stream, hooks, rr.req_id, status, &e.to_string()).await;
        }
    };
    // `extent` (a clone) pins the block's memory until the bytes are sent (C11).
    let start = off as usize;
    let payload = &extent.as_slice()[start..start + rr.len as usize];
    let mut hdr = Vec::with_capacity(frame::RESPONSE_HEADER_BYTES);
    frame::encode_response_header(&ResponseHeader { req_id: rr.req_id, status: Status::Ok, len: rr.len }, &mut hdr)
        .map_err(std::io::Error::other)?;
    let corrupted = hooks.on_serve(payload);
    let sent = corrupted.as_deref().unwrap_or(payload);
    // Header and payload leave in one vectored write (one syscall, and with
    // TCP_NODELAY no lone header segment for the reader to wake up for);
    // where vectored writes are not supported this writes them in turn.
    stream.write_all_buf(&mut bytes::Buf::chain(&hdr[..], sent)).await?;
    // A no-op on real sockets; madsim's simulated stream sends buffered
    // bytes only on flush.
    stream.flush().await?;
    if corrupted.is_some() {
        hooks.corrupt_sent.fetch_add(1, Ordering::SeqCst);
    }
    hooks.reads_served.fetch_add(1, Ordering::Relaxed);
    hooks.bytes_served.fetch_add(rr.len, Ordering::Relaxed);
    Ok(())
}

/// Work of one connection: extents (with their batch index) and their ops.
type ConnWork = Vec<(usize, Extent, Vec<ReadOp>)>;

/// One extent of a share as it ended: its index in the batch, the extent,
/// its result and, when asked for and the reads filled it in order, its
/// slot checksums taken as the bytes landed.
type ExtentDone = (usize, Extent, Result<(), TransportError>, Option<Arc<[u32]>>);

fn io_err(e: std::io::Error) -> TransportError {
    TransportError::from(e)
}

/// Every extent of a connection's share, failed with `e`.
fn fail_share(work: ConnWork, e: &TransportError) -> Vec<ExtentDone> {
    work.into_iter().map(|(i, ext, _)| (i, ext, Err(e.clone()), None)).collect()
}

/// How one connection's share of a batch ended.
struct ConnOutcome {
    /// Every extent of the share, in order, with its result (and sums).
    out: Vec<ExtentDone>,
    /// The stream, when it is still in sync (reusable).
    stream: Option<TcpStream>,
    /// The socket failed before any response arrived (EOF, reset): a pooled
    /// connection that died while idle, e.g. because the peer restarted.
    dead_before_any_response: bool,
}

/// Runs one connection's share of a batch. Always returns every extent.
async fn run_conn(
    stream: TcpStream,
    hooks: &TcpHooks,
    session: &str,
    work: ConnWork,
    (first_req, ends): (u64, Option<&SlotEnds>),
    deadline: Instant,
) -> ConnOutcome {
    let mut wire = Vec::new();
    let mut req_id = first_req;
    for (_, _, ops) in &work {
        for op in ops {
            let req = Request::Read(ReadRequest {
                req_id,
                session: session.to_string(),
                region: op.region,
                offset: op.remote_offset,
                len: op.len,
            });
            if let Err(e) = frame::encode_request(&req, &mut wire) {
                // A malformed session id (it came from a peer): nothing was sent.
                let out = fail_share(work, &TransportError::BadOp(BadOp::Frame(e)));
                return ConnOutcome { out, stream: Some(stream), dead_before_any_response: false };
            }
            req_id += 1;
        }
    }
    let quick_ack = crate::rt::QuickAck::of(&stream);
    let (mut rd, mut wr) = tokio::io::split(stream);
    let writer = async {
        let write = async {
            wr.write_all(&wire).await?;
            // A no-op on real sockets; madsim's simulated stream sends
            // buffered bytes only on flush.
            wr.flush().await
        };
        match timeout_at(deadline, write).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(io_err(e)),
            Err(_) => Err(TransportError::Timeout),
        }
    };
    let reader = async {
        let mut out = Vec::with_capacity(work.len());
        let mut healthy = true;
        let (mut answered, mut dead_early) = (false, false);
        let mut expect = first_req;
        for (idx, mut ext, ops) in work {
            let mut result = Ok(());
            let mut summer = ends.map(SlotSummer::new);
            for op in ops {
                let id = expect;
                expect += 1;
                if !healthy {
                    result =
                        Err(TransportError::io(ErrorKind::ConnectionAborted, "connection lost earlier in the batch"));
                    continue;
                }
                if let Err(fatal) = hooks.before_read_op(deadline).await {
                    healthy = false;
                    result = Err(fatal);
                    continue;
                }
                match read_one(&mut rd, quick_ack, (&mut ext, summer.as_mut()), &op, id, deadline).await {
                    Ok(Ok(())) => answered = true,
                    Ok(Err(refused)) => {
                        answered = true;
                        result = Err(refused);
                    }
                    Err(fatal) => {
                        healthy = false;
                        dead_early = !answered && matches!(fatal, TransportError::Io(_));
                        result = Err(fatal);
                    }
                }
            }
            let sums = if result.is_ok() { summer.and_then(SlotSummer::finish) } else { None };
            out.push((idx, ext, result, sums));
        }
        (out, healthy, dead_early)
    };
    let (w, (out, healthy, dead_before_any_response)) = tokio::join!(writer, reader);
    let stream = rd.unsplit(wr);
    ConnOutcome { out, stream: (healthy && w.is_ok()).then_some(stream), dead_before_any_response }
}

impl TcpHooks {
    /// The fault seam, server side: called once per read about to be
    /// served with its payload; returns the bytes to send instead when a
    /// corruption is armed (`corrupt_next_reads`: one byte flipped), `None`
    /// to send the payload as it is (always, unless a test armed one).
    fn on_serve(&self, payload: &[u8]) -> Option<Vec<u8>> {
        self.corrupt_next_reads.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).ok()?;
        let mut copy = payload.to_vec();
        let mid = copy.len() / 2;
        if let Some(b) = copy.get_mut(mid) {
            *b ^= 0x5A;
        }
        Some(copy)
    }

    /// The fault seam, client side: called before each read op; applies the
    /// configured delay (bounded by `deadline`), then an armed connection
    /// failure. `Ok(())` at once unless a test set one.
    async fn before_read_op(&self, deadline: Instant) -> Result<(), TransportError> {
        let delay_ms = self.read_delay_ms.load(Ordering::Relaxed);
        if delay_ms > 0
            && timeout_at(deadline, tokio::time::sleep(std::time::Duration::from_millis(delay_ms))).await.is_err()
        {
            return Err(TransportError::Timeout);
        }
        if self.fail_next_reads.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            self.injected_read_errors.fetch_add(1, Ordering::Relaxed);
            return Err(TransportError::io(ErrorKind::Other, "injected read error (test hook)"));
        }
        Ok(())
    }
}

/// Reads one response (quick ACKs re-armed before its header and before its
/// payload, see [`crate::rt::QuickAck`]); with a summer, the payload a piece
/// ([`limits::READ_SUM_PIECE_BYTES`]) at a time, each summed as it landed.
/// `Ok(Err(_))`: the peer refused this read, the stream is still in sync.
/// `Err(_)`: the stream is unusable.
async fn read_one(
    rd: &mut tokio::io::ReadHalf<TcpStream>,
    quick_ack: crate::rt::QuickAck,
    (ext, mut summer): (&mut Extent, Option<&mut SlotSummer<'_>>),
    op: &ReadOp,
    id: u64,
    deadline: Instant,
) -> Result<Result<(), TransportError>, TransportError> {
    let mut hdr = [0u8; frame::RESPONSE_HEADER_BYTES];
    quick_ack.arm();
    match timeout_at(deadline, rd.read_exact(&mut hdr)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(io_err(e)),
        Err(_) => return Err(TransportError::Timeout),
    }
    let h = match frame::decode_response_header(&hdr) {
        Ok(Some((h, _))) => h,
        Ok(None) => return Err(TransportError::Protocol(ProtocolViolation::ShortHeader)),
        Err(e) => return Err(TransportError::Protocol(ProtocolViolation::Frame(e))),
    };
    if h.req_id == 0 && h.status != Status::Ok {
        // A connection-level error (a malformed frame, or the server's
        // connection limits): the server closes the connection after it.
        let n = (h.len as usize).min(frame::ERROR_MESSAGE_BYTES_MAX);
        let mut msg = vec![0u8; n];
        let _ = timeout_at(deadline, rd.read_exact(&mut msg)).await;
        return Err(TransportError::Refused { status: h.status, message: String::from_utf8_lossy(&msg).into_owned() });
    }
    if h.req_id != id {
        // Anything out of order is a broken peer.
        return Err(TransportError::Protocol(ProtocolViolation::OutOfOrder { got: h.req_id, want: id }));
    }
    if h.status != Status::Ok {
        let n = (h.len as usize).min(frame::ERROR_MESSAGE_BYTES_MAX);
        let mut msg = vec![0u8; n];
        match timeout_at(deadline, rd.read_exact(&mut msg)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(io_err(e)),
            Err(_) => return Err(TransportError::Timeout),
        }
        return Ok(Err(TransportError::Refused {
            status: h.status,
            message: String::from_utf8_lossy(&msg).into_owned(),
        }));
    }
    if h.len != op.len {
        return Err(TransportError::Protocol(ProtocolViolation::WrongLength { served: h.len, asked: op.len }));
    }
    let dst = &mut ext.as_mut_slice()[op.local_offset as usize..(op.local_offset + op.len) as usize];
    quick_ack.arm();
    let piece = if summer.is_some() { limits::READ_SUM_PIECE_BYTES } else { dst.len().max(1) };
    let mut at = op.local_offset;
    for chunk in dst.chunks_mut(piece) {
        match timeout_at(deadline, rd.read_exact(chunk)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(io_err(e)),
            Err(_) => return Err(TransportError::Timeout),
        }
        if let Some(s) = summer.as_deref_mut() {
            s.landed(at, chunk);
        }
        at += chunk.len() as u64;
    }
    Ok(Ok(()))
}

async fn dial(addr: &str, deadline: Instant) -> Result<TcpStream, TransportError> {
    let err = |cause: IoFailure| TransportError::Connect { addr: addr.to_string(), cause };
    match timeout_at(deadline, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(err(IoFailure::from(e))),
        Err(_) => Err(TransportError::Timeout),
    }
}

#[async_trait]
impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn local_metadata(&self) -> HandshakeMetadata {
        self.local.clone()
    }

    async fn connect(
        &self,
        peer: &NodeAddr,
        remote: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if remote.transport != TransportKind::Tcp {
            return Err(TransportError::Handshake(HandshakeRejected::KindMismatch {
                ours: TransportKind::Tcp,
                theirs: remote.transport,
            }));
        }
        if remote.data_addr.is_empty() {
            return Err(TransportError::Handshake(HandshakeRejected::NoDataAddress));
        }
        let first = dial(&remote.data_addr, deadline).await?;
        let conns: Vec<_> = (0..self.conns_per_peer).map(|_| tokio::sync::Mutex::new(None)).collect();
        *conns[0].try_lock().expect("fresh mutex") = Some(first);
        let p = Arc::new(Peer { data_addr: remote.data_addr.clone(), conns, next: AtomicUsize::new(0) });
        self.peers.lock().expect("peers lock").insert(peer.clone(), p);
        Ok(())
    }

    fn disconnect(&self, peer: &NodeAddr) {
        self.peers.lock().expect("peers lock").remove(peer);
    }

    async fn read(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        deadline: Instant,
    ) -> ReadCompletion {
        self.read_summed(peer, session, ops, local, None, deadline).await
    }

    async fn read_summed(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        ends: Option<SlotEnds>,
        deadline: Instant,
    ) -> ReadCompletion {
        let n = local.len();
        let fail_all = ReadCompletion::all_failed;
        let deadline = if crate::canary::active(crate::canary::Canary::C9ReadPastDeadline) {
            deadline + std::time::Duration::from_secs(5) // C9 canary: the deadline is not honoured
        } else {
            deadline
        };
        if let Err(e) = validate_local(&ops, &local) {
            return fail_all(local, e);
        }
        if let Some(op) = ops.iter().find(|op| op.len > limits::TCP_READ_BYTES_MAX) {
            return fail_all(local, TransportError::BadOp(BadOp::OverFrameLimit { len: op.len }));
        }
        let Some(p) = self.peers.lock().expect("peers lock").get(peer).cloned() else {
            return fail_all(local, TransportError::NotConnected(NotConnected::Peer(peer.0.clone())));
        };
        // Group ops by extent, spread extents over the connections.
        let mut per_ext: Vec<Vec<ReadOp>> = vec![Vec::new(); n];
        for op in ops {
            per_ext[op.local_extent].push(op);
        }
        let batch_bytes: u64 = per_ext.iter().flatten().map(|op| op.len).sum();
        let chosen = p.choose_conns(batch_bytes);
        let mut works: Vec<ConnWork> = (0..p.conns.len()).map(|_| Vec::new()).collect();
        for (i, (ext, ops)) in local.into_iter().zip(per_ext).enumerate() {
            works[chosen[i % chosen.len()]].push((i, ext, ops));
        }
        let total_ops: u64 = works.iter().flatten().map(|(_, _, o)| o.len() as u64).sum();
        let mut req = self.next_req.fetch_add(total_ops, Ordering::Relaxed);
        let session: Arc<str> = Arc::from(session);
        // Each connection's share runs as a task of its own (owning its
        // extents until its reads complete): a batch's connections receive
        // on as many cores as the runtime has, as the raw socket copy does,
        // instead of all on the caller's task.
        let shares: Vec<_> = works
            .into_iter()
            .enumerate()
            .filter(|(_, w)| !w.is_empty())
            .map(|(ci, w)| {
                let first = req;
                req += w.iter().map(|(_, _, o)| o.len() as u64).sum::<u64>();
                let p = p.clone();
                let hooks = self.hooks.clone();
                let session = session.clone();
                let ends = ends.clone();
                tokio::spawn(async move {
                    // Another batch may hold this connection: wait for it
                    // only until this batch's deadline.
                    let Ok(mut guard) = timeout_at(deadline, p.conns[ci].lock()).await else {
                        return fail_share(w, &TransportError::Timeout);
                    };
                    let (stream, pooled) = match guard.take() {
                        Some(s) => (s, true),
                        None => match dial(&p.data_addr, deadline).await {
                            Ok(s) => (s, false),
                            Err(e) => return fail_share(w, &e),
                        },
                    };
                    // Reads are idempotent: a pooled connection found dead
                    // before any answer gets its whole share again, once, on
                    // a new one.
                    let retry_ops: Option<Vec<Vec<ReadOp>>> =
                        pooled.then(|| w.iter().map(|(_, _, o)| o.clone()).collect());
                    // An unhealthy stream is dropped: its state is unknown,
                    // reconnect next time.
                    let mut done = run_conn(stream, &hooks, &session, w, (first, ends.as_ref()), deadline).await;
                    if let (true, Some(ops)) = (done.dead_before_any_response, retry_ops)
                        && let Ok(fresh) = dial(&p.data_addr, deadline).await
                    {
                        tracing::debug!(peer = %p.data_addr, "pooled data connection was dead; retrying on a new one");
                        let w = done.out.into_iter().zip(ops).map(|((i, ext, _, _), ops)| (i, ext, ops)).collect();
                        done = run_conn(fresh, &hooks, &session, w, (first, ends.as_ref()), deadline).await;
                    }
                    *guard = done.stream;
                    done.out
                })
            })
            .collect();
        let mut slots: Vec<Option<ExtentDone>> = (0..n).map(|_| None).collect();
        for share in shares {
            match share.await {
                Ok(part) => {
                    for done in part {
                        let i = done.0;
                        slots[i] = Some(done);
                    }
                }
                Err(e) if e.is_panic() => panic!("a transport read task panicked: {e}"),
                // The runtime is shutting down (or the simulator killed the
                // node): that share's extents went with its task.
                Err(_) => {}
            }
        }
        // Every extent comes back, in order, unless a share's task was
        // cancelled: then the completion ends before its first extent.
        let (mut local, mut results, mut sums) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for (_, ext, r, s) in slots.into_iter().map_while(|s| s) {
            local.push(ext);
            results.push(r);
            sums.push(s);
        }
        if ends.is_none() {
            sums.clear();
        }
        ReadCompletion { local, results, sums }
    }
}

/// The best plain loopback copy this machine does of `total` bytes: for each
/// count in `connections` (e.g. [`limits::TCP_RAW_COPY_CONNECTIONS`]), that
/// many TCP connections on 127.0.0.1, each with its own sender and receiver
/// OS thread (blocking sockets, no runtime) and its own `total / count`
/// bytes of source and destination memory, no framing, no checksums — the
/// same bytes a fetch of `total` bytes moves, from one buffer into another.
/// Memory is allocated and touched and every connection is open before the
/// clock starts; the clock stops when the last receiver has its last byte.
/// The fastest of `reps` per count. This is the denominator of T4 (`bench
/// transport`) and T8 (`kvferry pd`): the measurement on a 16-core
/// host found 1 connection at 5.65 GB/s and 8 at 29.6, so a baseline over
/// one fixed count understates the machine.
///
/// # Errors
/// A socket error (bind, connect, accept, read, write) or a count of 0.
pub fn raw_loopback_copy(total: u64, connections: &[usize], reps: usize) -> std::io::Result<RawCopy> {
    use std::io::{Read, Write};
    let total = usize::try_from(total).map_err(|_| std::io::Error::other("raw copy larger than memory"))?;
    // One source and one destination arena, touched before any clock
    // starts; each connection copies its own disjoint slice of them.
    let src = vec![0x5Au8; total];
    let mut dst = vec![1u8; total];
    let mut runs = Vec::new();
    for &conns in connections {
        if conns == 0 {
            return Err(std::io::Error::other("a raw copy over 0 connections"));
        }
        let per = total / conns;
        let mut best = f64::MAX;
        for _ in 0..reps.max(1) {
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
            let addr = listener.local_addr()?;
            let mut receivers = Vec::with_capacity(conns);
            let mut senders = Vec::with_capacity(conns);
            for _ in 0..conns {
                let r = std::net::TcpStream::connect(addr)?;
                r.set_nodelay(true)?;
                let (s, _) = listener.accept()?;
                s.set_nodelay(true)?;
                receivers.push(r);
                senders.push(s);
            }
            // Everything open: the threads wait on one barrier, then copy.
            let go = std::sync::Barrier::new(2 * conns + 1);
            let secs = std::thread::scope(|scope| -> std::io::Result<f64> {
                let mut hs = Vec::with_capacity(2 * conns);
                // Each thread clocks its own copy (the main thread may run
                // only after the workers on a busy machine): the copy took
                // from the first start to the last end.
                for (mut s, chunk) in senders.drain(..).zip(src.chunks(per.max(1))) {
                    let go = &go;
                    hs.push(scope.spawn(move || {
                        go.wait();
                        let t = std::time::Instant::now();
                        s.write_all(&chunk[..per.min(chunk.len())]).map(|()| (t, std::time::Instant::now()))
                    }));
                }
                for (mut r, chunk) in receivers.drain(..).zip(dst.chunks_mut(per.max(1))) {
                    let go = &go;
                    hs.push(scope.spawn(move || {
                        go.wait();
                        let t = std::time::Instant::now();
                        let n = per.min(chunk.len());
                        r.read_exact(&mut chunk[..n]).map(|()| (t, std::time::Instant::now()))
                    }));
                }
                go.wait();
                let mut span: Option<(std::time::Instant, std::time::Instant)> = None;
                let mut first_err = None;
                for h in hs {
                    match h.join().unwrap_or_else(|_| Err(std::io::Error::other("a raw copy thread panicked"))) {
                        Ok((a, b)) => span = Some(span.map_or((a, b), |(s0, e0)| (s0.min(a), e0.max(b)))),
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                match (first_err, span) {
                    (Some(e), _) => Err(e),
                    (None, Some((a, b))) => Ok((b - a).as_secs_f64()),
                    (None, None) => Ok(0.0),
                }
            })?;
            best = best.min(secs);
        }
        runs.push(RawCopyRun { streams: conns, bytes: (per * conns) as u64, secs: best });
    }
    std::hint::black_box(&dst);
    Ok(RawCopy { runs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(k: usize) -> Peer {
        Peer {
            data_addr: "127.0.0.1:1".into(),
            conns: (0..k).map(|_| tokio::sync::Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
        }
    }

    #[test]
    fn a_batch_takes_connections_by_its_bytes_idle_first() {
        let share = limits::TCP_CONNECTION_SHARE_BYTES_MIN;
        let p = peer(8);
        assert_eq!(p.choose_conns(1).len(), 1);
        assert_eq!(p.choose_conns(0).len(), 1, "never empty");
        assert_eq!(p.choose_conns(share * 3 - 1).len(), 3);
        let all = p.choose_conns(share * 100);
        let mut sorted = all.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>(), "a large batch uses the whole pool, each once");
        // Connections held by another batch come last.
        let held: Vec<_> = (0..6).map(|c| p.conns[c].try_lock().expect("free")).collect();
        let got = p.choose_conns(share * 2);
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|&c| c >= 6), "idle connections first: {got:?}");
        let got = p.choose_conns(share * 4);
        assert_eq!(&got[..2].iter().filter(|&&c| c >= 6).count(), &2, "{got:?}");
        drop(held);
    }

    #[test]
    fn raw_loopback_copy_reports_each_count_and_the_fastest() {
        let r = raw_loopback_copy(3 << 20, &[1, 2, 4], 2).expect("loopback copy");
        assert_eq!(r.runs.iter().map(|x| x.streams).collect::<Vec<_>>(), vec![1, 2, 4]);
        assert!(r.runs.iter().all(|x| x.bytes == (3 << 20) / x.streams as u64 * x.streams as u64));
        assert!(r.runs.iter().all(|x| x.secs > 0.0 && x.gbps() > 0.0));
        let best = r.best().expect("a best count");
        assert!(r.runs.iter().all(|x| x.gbps() <= best.gbps()));
        assert!(raw_loopback_copy(1 << 20, &[0], 1).is_err(), "0 connections is an error");
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Serves one sealed block (region 0, from offset 0) under session "s".
    #[cfg(real_os)]
    struct OneBlock(crate::memory::pool::SealedExtent);

    #[cfg(real_os)]
    impl DataSource for OneBlock {
        fn authorize(
            &self,
            session: &str,
            region: u32,
            offset: u64,
            len: u64,
        ) -> Result<(crate::memory::pool::SealedExtent, u64), AccessError> {
            if session != "s" {
                return Err(AccessError::UnknownSession);
            }
            if region != 0 || offset.checked_add(len).is_none_or(|end| end > self.0.len()) {
                return Err(AccessError::OutOfRange { region, offset, len });
            }
            Ok((self.0.clone(), offset))
        }
    }

    /// `read_summed` over real sockets, one batch of four extents: one
    /// filled in order by two ops (its slot sums are the CRC-32C of each
    /// slot, slots straddling the ops and the 128 KiB sum pieces), one
    /// filled back to front (read, but no sums: the fetch checks it by a
    /// pass), one whose second op the owner refuses (out of range: that
    /// extent fails and has no sums, the others are untouched), and one in
    /// order again after the failure. The owner answers each op, so one
    /// refused op costs only its extent.
    #[cfg(real_os)]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn read_summed_sums_whole_extents_and_fails_only_the_refused_one() {
        let len = 3 * limits::READ_SUM_PIECE_BYTES as u64 + 12_345;
        let owner_pool = crate::memory::pool::Pool::new(len.next_multiple_of(4096), 4096).unwrap();
        let mut e = owner_pool.alloc(len).unwrap();
        for (i, b) in e.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 31 + 7) as u8;
        }
        let block = e.seal();
        let bytes = block.as_slice().to_vec();
        let reader_pool = crate::memory::pool::Pool::new(6 * len.next_multiple_of(4096), 4096).unwrap();
        let owner_node = NodeAddr::parse("127.0.0.1:1").unwrap();
        let owner = TcpTransport::start(
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1",
            owner_node.clone(),
            owner_pool.arena_len(),
            Arc::new(OneBlock(block)),
            2,
        )
        .await
        .unwrap();
        let reader = TcpTransport::start(
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1",
            NodeAddr::parse("127.0.0.1:2").unwrap(),
            4096,
            Arc::new(OneBlock(reader_pool.alloc(16).unwrap().seal())),
            2,
        )
        .await
        .unwrap();
        let later = Instant::now() + std::time::Duration::from_secs(10);
        reader.connect(&owner_node, &owner.local_metadata(), later).await.unwrap();
        let cut = len / 2 + 17;
        let ends = SlotEnds(vec![1000, cut, len].into());
        let want: Vec<u32> = [0..1000, 1000..cut, cut..len]
            .iter()
            .map(|r| crc32c::crc32c(&bytes[r.start as usize..r.end as usize]))
            .collect();
        let op = |remote_offset, len, local_extent, local_offset| ReadOp {
            region: 0,
            remote_offset,
            len,
            local_extent,
            local_offset,
        };
        let third = len / 3;
        let ops = vec![
            op(0, third, 0, 0),
            op(third, len - third, 0, third),
            op(third, len - third, 1, third),
            op(0, third, 1, 0),
            op(0, third, 2, 0),
            op(len, 64, 2, third), // past the owner's block: refused
            op(0, len, 3, 0),
        ];
        let local: Vec<Extent> = (0..4).map(|_| reader_pool.alloc(len).unwrap()).collect();
        let done = reader.read_summed(&owner_node, "s", ops, local, Some(ends), later).await;
        assert_eq!(done.results.len(), 4);
        assert!(done.results[0].is_ok() && done.results[1].is_ok() && done.results[3].is_ok(), "{:?}", done.results);
        assert!(matches!(done.results[2], Err(TransportError::Refused { .. })), "{:?}", done.results[2]);
        for i in [0, 1, 3] {
            assert_eq!(done.local[i].as_slice(), &bytes[..], "extent {i} holds the owner's bytes");
        }
        assert_eq!(done.sums.len(), 4);
        assert_eq!(done.sums[0].as_deref(), Some(&want[..]));
        assert_eq!(done.sums[1], None, "filled back to front: no sums");
        assert_eq!(done.sums[2], None, "a failed extent has no sums");
        assert_eq!(done.sums[3].as_deref(), Some(&want[..]));
        // Another session: every extent refused, nothing summed.
        let local: Vec<Extent> = (0..1).map(|_| reader_pool.alloc(len).unwrap()).collect();
        let ends = SlotEnds(vec![len].into());
        let done = reader.read_summed(&owner_node, "other", vec![op(0, len, 0, 0)], local, Some(ends), later).await;
        assert!(done.results[0].is_err() && done.sums.iter().all(Option::is_none), "{:?}", done.results);
        owner.shutdown();
        reader.shutdown();
    }

    /// The per-IP bound, then the total bound; a refusal changes nothing;
    /// a release frees exactly one slot; IPv4-mapped IPv6 counts as IPv4.
    #[test]
    fn conn_table_bounds_per_ip_and_total() {
        let mut t = ConnTable::new(ConnLimits { per_ip_max: 2, total_max: 3 });
        let (a, b, c) = (ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3"));
        t.admit(a).unwrap();
        t.admit(ip("::ffff:10.0.0.1")).unwrap();
        assert_eq!(t.admit(a), Err(ConnRefusal::PerIp { ip: a, limit: 2 }));
        t.admit(b).unwrap();
        assert_eq!(t.admit(c), Err(ConnRefusal::Total { limit: 3 }));
        assert_eq!((t.total, t.per_ip.len()), (3, 2), "refusals change nothing");
        t.release(a);
        t.admit(c).unwrap();
        assert_eq!(t.admit(a), Err(ConnRefusal::Total { limit: 3 }));
        t.release(b);
        t.release(c);
        t.release(c); // not counted any more: a no-op
        assert_eq!((t.total, t.per_ip.get(&a)), (1, Some(&1)));
        assert!(!t.per_ip.contains_key(&c), "an IP with no connection is forgotten");
    }
}
