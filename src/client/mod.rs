//! `MetaServerClient`: the fire-and-forget registration client with a flush
//! barrier (design.md §2.3, contracts C1–C6).
//!
//! Producers call [`MetaServerClient::try_register`] /
//! [`MetaServerClient::try_unregister`], which never block: they lock the pure
//! [`queue::RegistrationQueue`] for a moment and wake the driver. One driver
//! task owns all network I/O to the MetaServer: heartbeats (every
//! `stale_after / 2`, exponential backoff on failure), batches (drain all,
//! net, chunk, send with a per-RPC deadline), backfill after a MetaServer
//! restart (C6) and the best-effort unregister at shutdown. When to
//! heartbeat, when to backfill and what a refusal, a fenced write or a
//! close changes is decided by the pure [`session::SessionMachine`], which
//! sits beside the queue under the same lock; the driver performs its
//! actions and feeds back what happened.
//!
//! The driver is a task, not an OS thread, so the simulator can run it.

pub mod queue;
pub mod session;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot, watch};
use tonic::Code;
use tonic::transport::Channel;

use queue::{Chunk, ChunkOutcome, RegistrationQueue, TicketId};
pub use queue::{DropReason, FlushReport, Op, QueueConfig, QueueCounters};
use session::{Action, Answer, Beat, Event, Notice, SessionMachine, SessionPolicy};

use crate::canary::Canary;
use crate::limits;
use crate::proto::meta_server_client::MetaServerClient as GrpcMetaClient;
use crate::proto::*;
use crate::status::RpcFailure;
use crate::types::{BlockHash, NodeAddr, SessionId};

/// Where the client gets "every block this node still owns" for a backfill
/// (C6). The engine implements it over its cache.
pub trait OwnershipSource: Send + Sync {
    /// Resident (sealed) blocks, grouped by namespace.
    fn resident_blocks(&self) -> Vec<(String, Vec<BlockHash>)>;
}

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// MetaServer address (`host:port` or `http://host:port`).
    pub metaserver: String,
    /// This node's advertise address (its Engine gRPC address).
    pub node: NodeAddr,
    /// This process's session id.
    pub session: SessionId,
    /// Deadline of every MetaServer RPC.
    pub rpc_timeout: Duration,
    /// Queue bounds.
    pub queue: QueueConfig,
    /// Talk TLS to the MetaServer, trusting these CA certificates (needs
    /// the `tls` feature; see [`crate::tls`]). `None`: plain text.
    pub tls: Option<crate::tls::TlsTrust>,
}

impl ClientConfig {
    /// Defaults from [`crate::limits`].
    pub fn new(metaserver: impl Into<String>, node: NodeAddr, session: SessionId) -> Self {
        Self {
            metaserver: metaserver.into(),
            node,
            session,
            rpc_timeout: Duration::from_millis(limits::METASERVER_RPC_TIMEOUT_MS_DEFAULT),
            queue: QueueConfig::default(),
            tls: None,
        }
    }
}

/// Why a MetaServer address is refused ([`parse_metaserver_address`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// A scheme other than `http://` (or `https://`, TLS).
    #[error(
        "{addr:?}: scheme {scheme:?}:// is not one the MetaServer speaks; use host:port or http://host:port (https:// with TLS)"
    )]
    Scheme {
        /// The address given.
        addr: String,
        /// The scheme found.
        scheme: String,
    },
    /// No `:port`.
    #[error("{addr:?} has no port: want host:port (e.g. 127.0.0.1:50051)")]
    NoPort {
        /// The address given.
        addr: String,
    },
    /// The port is not a number in `1..=65535`.
    #[error("{addr:?}: port {port:?} is not a number in 1..=65535")]
    Port {
        /// The address given.
        addr: String,
        /// The port text.
        port: String,
    },
    /// The host is neither an IP address nor a DNS name.
    #[error("{addr:?}: host {host:?} is neither an IP address ([v6] in brackets) nor a host name")]
    Host {
        /// The address given.
        addr: String,
        /// The host text.
        host: String,
    },
    /// Something after `host:port` (a path, a query).
    #[error("{addr:?}: nothing may follow host:port (found {rest:?})")]
    Trailing {
        /// The address given.
        addr: String,
        /// What followed.
        rest: String,
    },
}

impl AddressError {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            AddressError::Scheme { .. } => "address_scheme",
            AddressError::NoPort { .. } => "address_no_port",
            AddressError::Port { .. } => "address_port",
            AddressError::Host { .. } => "address_host",
            AddressError::Trailing { .. } => "address_trailing",
        }
    }
}

/// A MetaServer address taken apart: `host:port` or `scheme://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaServerAddress<'a> {
    /// `http` or `https`, `None` when the address has no scheme.
    pub scheme: Option<&'a str>,
    /// Host name or IP (an IPv6 address without its brackets).
    pub host: &'a str,
    /// Port, `1..=65535`.
    pub port: u16,
}

/// Checks a MetaServer address before anything dials it, so a typo fails at
/// start naming what is wrong instead of as a DNS error or dropped
/// registrations later: `host:port`, `http://host:port` or
/// `https://host:port` (with TLS), host an IPv4 address, a bracketed IPv6
/// address or a DNS name, port `1..=65535`, one trailing `/` at most.
///
/// # Errors
/// [`AddressError`], naming the part at fault.
pub fn parse_metaserver_address(addr: &str) -> Result<MetaServerAddress<'_>, AddressError> {
    let own = || addr.to_string();
    let (scheme, rest) = match addr.split_once("://") {
        Some((scheme, rest)) => {
            if scheme != "http" && scheme != "https" {
                return Err(AddressError::Scheme { addr: own(), scheme: scheme.to_string() });
            }
            (Some(scheme), rest)
        }
        None => (None, addr),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if let Some(i) = rest.find(['/', '?', '#']) {
        return Err(AddressError::Trailing { addr: own(), rest: rest[i..].to_string() });
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(|| AddressError::Host { addr: own(), host: rest.into() })?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(AddressError::Host { addr: own(), host: host.to_string() });
        }
        let port = after.strip_prefix(':').ok_or_else(|| AddressError::NoPort { addr: own() })?;
        (host, port)
    } else {
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| AddressError::NoPort { addr: own() })?;
        let name_ok = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if !name_ok {
            return Err(AddressError::Host { addr: own(), host: host.to_string() });
        }
        (host, port)
    };
    let port_num = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| AddressError::Port { addr: own(), port: port.to_string() })?;
    Ok(MetaServerAddress { scheme, host, port: port_num })
}

/// Errors of the client's synchronous calls.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The MetaServer address is malformed.
    #[error("bad metaserver address {addr:?}: {source}")]
    Address {
        /// The address given.
        addr: String,
        /// Parse error.
        source: tonic::transport::Error,
    },
    /// The MetaServer address is not `host:port` or `http(s)://host:port`
    /// ([`parse_metaserver_address`]).
    #[error("bad metaserver address {0}")]
    BadAddress(#[from] AddressError),
    /// TLS was asked for and cannot be set up.
    #[error("metaserver TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// The RPC failed or missed its deadline.
    #[error("metaserver rpc failed: {}", status_text(.0))]
    Rpc(#[from] tonic::Status),
    /// The RPC missed its deadline.
    #[error("metaserver rpc timed out after {0:?}")]
    Timeout(Duration),
    /// The client was shut down.
    #[error("client is shut down")]
    Shutdown,
}

impl ClientError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ClientError::Address { .. } | ClientError::BadAddress(_) => "client_address",
            ClientError::Tls(_) => "client_tls",
            ClientError::Rpc(_) => "client_rpc",
            ClientError::Timeout(_) => "client_timeout",
            ClientError::Shutdown => "client_shutdown",
        }
    }

    /// This error as the failure of an RPC: the status's code and message
    /// for [`ClientError::Rpc`], `DEADLINE_EXCEEDED` for a missed deadline,
    /// `CANCELLED` after shutdown, `INVALID_ARGUMENT` for a bad address or
    /// TLS setting (no RPC was sent).
    pub fn rpc_failure(&self) -> RpcFailure {
        match self {
            ClientError::Rpc(s) => RpcFailure::from_status(s),
            ClientError::Timeout(_) => RpcFailure::new(Code::DeadlineExceeded, self.to_string()),
            ClientError::Shutdown => RpcFailure::new(Code::Cancelled, self.to_string()),
            ClientError::Address { .. } | ClientError::BadAddress(_) | ClientError::Tls(_) => {
                RpcFailure::new(Code::InvalidArgument, self.to_string())
            }
        }
    }
}

/// One line for a failed RPC: the gRPC code, its message and the innermost
/// cause (`Unavailable: tcp connect error (Connection refused (os error
/// 111))`), instead of tonic's nested debug dump.
fn status_text(status: &tonic::Status) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    let mut root = None;
    while let Some(c) = cause {
        root = Some(c);
        cause = c.source();
    }
    match root {
        Some(r) => format!("{:?}: {} ({r})", status.code(), status.message()),
        None => format!("{:?}: {}", status.code(), status.message()),
    }
}

/// Client-side counters beyond the queue's (heartbeats, backfills).
#[derive(Debug, Default)]
pub struct ClientMetrics {
    /// Heartbeats answered OK.
    pub heartbeats_ok: AtomicU64,
    /// Heartbeats that failed (any reason, refusals included).
    pub heartbeats_failed: AtomicU64,
    /// Heartbeats refused with `FAILED_PRECONDITION`: another live session
    /// holds this node's address (two processes on one address, or a
    /// restart before the old session went stale). The client keeps
    /// heartbeating with backoff and takes over once the other goes stale.
    pub heartbeats_refused: AtomicU64,
    /// Backfills completed.
    pub backfills: AtomicU64,
    /// Hashes re-advertised by backfills.
    pub backfilled_hashes: AtomicU64,
    /// RPCs sent for chunks (including retries and bisection halves).
    pub chunk_rpcs: AtomicU64,
}

struct Core {
    queue: RegistrationQueue,
    /// The session lifecycle, beside the queue so a heartbeat's answer sees
    /// the queue's drops under the same lock.
    session: SessionMachine,
    waiters: HashMap<TicketId, oneshot::Sender<FlushReport>>,
}

struct Inner {
    cfg: ClientConfig,
    core: Mutex<Core>,
    wake: Notify,
    grpc: GrpcMetaClient<Channel>,
    source: Mutex<Option<Arc<dyn OwnershipSource>>>,
    /// Time zero of the session machine's clock.
    origin: tokio::time::Instant,
    stop: watch::Sender<bool>,
    metrics: ClientMetrics,
}

/// The registration client. Cheap to clone; all clones share one queue and
/// one driver task.
#[derive(Clone)]
pub struct MetaServerClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MetaServerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaServerClient").field("node", &self.inner.cfg.node).finish()
    }
}

impl MetaServerClient {
    /// Creates the client and spawns its driver task (which heartbeats at
    /// once). Must be called inside a runtime.
    ///
    /// # Errors
    /// [`ClientError::BadAddress`] or [`ClientError::Address`] for a
    /// malformed MetaServer address, [`ClientError::Tls`] when TLS is asked
    /// for (a [`ClientConfig::tls`], or an `https://` address) and cannot be
    /// set up: an `https://` address without a CA to trust, or a build
    /// without the `tls` feature — never a plain-text fallback.
    pub fn start(cfg: ClientConfig) -> Result<Self, ClientError> {
        let addr = parse_metaserver_address(&cfg.metaserver)?;
        if addr.scheme == Some("https") && cfg.tls.is_none() {
            // `https://` asks for TLS: never dial it in plain text.
            return Err(crate::tls::no_trust(&cfg.metaserver).into());
        }
        let channel = match &cfg.tls {
            None => crate::rt::channel(&cfg.metaserver, cfg.rpc_timeout)
                .map_err(|source| ClientError::Address { addr: cfg.metaserver.clone(), source })?,
            Some(trust) => crate::tls::channel(&cfg.metaserver, cfg.rpc_timeout, trust)?,
        };
        let grpc = GrpcMetaClient::new(channel)
            .max_decoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX);
        let (stop, stop_rx) = watch::channel(false);
        let inner = Arc::new(Inner {
            core: Mutex::new(Core {
                queue: RegistrationQueue::new(cfg.queue),
                session: SessionMachine::new(SessionPolicy::default()),
                waiters: HashMap::new(),
            }),
            cfg,
            wake: Notify::new(),
            grpc,
            source: Mutex::new(None),
            origin: tokio::time::Instant::now(),
            stop,
            metrics: ClientMetrics::default(),
        });
        tokio::spawn(drive(inner.clone(), stop_rx));
        Ok(Self { inner })
    }

    /// Installs the backfill source (C6).
    pub fn set_ownership_source(&self, source: Arc<dyn OwnershipSource>) {
        *self.inner.source.lock().expect("source lock") = Some(source);
    }

    /// This client's node address.
    pub fn node(&self) -> &NodeAddr {
        &self.inner.cfg.node
    }

    /// Whether the MetaServer accepted this client's session at its last
    /// answered heartbeat (false before the first accepted one, and after a
    /// refused one until the next is accepted).
    pub fn is_registered(&self) -> bool {
        self.inner.core.lock().expect("core lock").session.is_registered()
    }

    /// This client's session id.
    pub fn session(&self) -> &SessionId {
        &self.inner.cfg.session
    }

    fn offer(&self, namespace: &str, hashes: &[BlockHash], op: Op) -> usize {
        let ns: Arc<str> = Arc::from(namespace);
        let accepted = {
            let mut core = self.inner.core.lock().expect("core lock");
            core.queue.offer_many(&ns, hashes, op)
        };
        if accepted > 0 {
            self.inner.wake.notify_one();
        }
        accepted
    }

    /// Enqueues "this node owns `hashes` in `namespace`". Never blocks;
    /// returns how many were accepted (the rest were dropped and counted).
    pub fn try_register(&self, namespace: &str, hashes: &[BlockHash]) -> usize {
        self.offer(namespace, hashes, Op::Insert)
    }

    /// Enqueues the withdrawal of this node's ownership. Never blocks;
    /// returns how many were accepted.
    pub fn try_unregister(&self, namespace: &str, hashes: &[BlockHash]) -> usize {
        self.offer(namespace, hashes, Op::Remove)
    }

    /// Registration commands the queue would still accept now; `None`
    /// after shutdown. A caller with more to offer than this waits (e.g.
    /// on [`flush`](Self::flush)) instead of having the rest dropped.
    pub fn queue_room(&self) -> Option<usize> {
        self.inner.core.lock().expect("core lock").queue.room()
    }

    /// Queue counters (C4).
    pub fn counters(&self) -> QueueCounters {
        self.inner.core.lock().expect("core lock").queue.counters()
    }

    /// Heartbeat/backfill counters.
    pub fn metrics(&self) -> &ClientMetrics {
        &self.inner.metrics
    }

    /// The barrier (C1–C3): resolves once every command offered before the
    /// call was delivered or dropped after a failed attempt. Bounded because
    /// every RPC has a deadline (C2); returns at once after shutdown.
    pub async fn flush(&self) -> FlushReport {
        self.flush_inner(None).await
    }

    /// [`MetaServerClient::flush`] that gives up at `deadline` with
    /// `timed_out: true` (the covered commands keep their place in the queue).
    pub async fn flush_with_deadline(&self, deadline: Duration) -> FlushReport {
        self.flush_inner(Some(deadline)).await
    }

    async fn flush_inner(&self, deadline: Option<Duration>) -> FlushReport {
        let (id, rx) = {
            let mut core = self.inner.core.lock().expect("core lock");
            match core.queue.flush() {
                Ok(report) => return report,
                Err(id) => {
                    let (tx, rx) = oneshot::channel();
                    core.waiters.insert(id, tx);
                    (id, rx)
                }
            }
        };
        self.inner.wake.notify_one();
        if crate::canary::active(Canary::C1FlushAcksEarly) {
            // Ack before the batch is sent: `inv_flush_visibility` must catch it.
            self.inner.core.lock().expect("core lock").waiters.remove(&id);
            return FlushReport::default();
        }
        if let Some(d) = deadline.filter(|_| crate::canary::active(Canary::C2FlushUnbounded)) {
            // Overrun the deadline: `inv_flush_terminates` must catch it.
            tokio::time::sleep(d * 3).await;
        }
        match deadline {
            None => rx.await.unwrap_or(FlushReport { delivered: 0, dropped: 0, timed_out: true }),
            Some(d) => match tokio::time::timeout(d, rx).await {
                Ok(r) => r.unwrap_or(FlushReport { delivered: 0, dropped: 0, timed_out: true }),
                Err(_) => {
                    self.inner.core.lock().expect("core lock").waiters.remove(&id);
                    FlushReport { delivered: 0, dropped: 0, timed_out: true }
                }
            },
        }
    }

    /// Asks the MetaServer which nodes hold a prefix of `hashes` (C7):
    /// `(node, prefix_len)` ordered by prefix length desc, then node.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] / [`ClientError::Timeout`].
    pub async fn query_prefix(
        &self,
        namespace: &str,
        hashes: &[BlockHash],
        deadline: Duration,
    ) -> Result<Vec<(NodeAddr, u32)>, ClientError> {
        let req = QueryPrefixBlocksRequest {
            namespace: namespace.to_string(),
            block_hashes: hashes.iter().map(|h| h.0.clone()).collect(),
        };
        let mut grpc = self.inner.grpc.clone();
        let resp = tokio::time::timeout(deadline, grpc.query_prefix_blocks(req))
            .await
            .map_err(|_| ClientError::Timeout(deadline))??;
        Ok(resp.into_inner().nodes.into_iter().map(|n| (NodeAddr(n.node), n.prefix_len)).collect())
    }

    /// Shuts down: drops every queued command (counted as `Shutdown`),
    /// resolves every waiting flush, stops the driver and sends a
    /// best-effort `UnregisterNode` bounded by `deadline`. Afterwards
    /// `flush()` returns at once and offers are dropped.
    pub async fn shutdown(&self, deadline: Duration) {
        if !self.abort() {
            return;
        }
        let req =
            UnregisterNodeRequest { node: self.inner.cfg.node.0.clone(), node_id: self.inner.cfg.session.0.clone() };
        let mut grpc = self.inner.grpc.clone();
        match tokio::time::timeout(deadline, grpc.unregister_node(req)).await {
            Ok(Ok(r)) => tracing::debug!(removed = r.into_inner().removed_owners, "unregistered"),
            Ok(Err(e)) => tracing::debug!(error = %e, "unregister failed"),
            Err(_) => tracing::debug!("unregister timed out"),
        }
    }
}

impl MetaServerClient {
    /// Stops without telling the MetaServer (a crash, as far as it can
    /// tell): queued commands are dropped (`Shutdown`), waiting flushes
    /// resolve, the driver stops. Returns false if already stopped.
    pub fn abort(&self) -> bool {
        let mut core = self.inner.core.lock().expect("core lock");
        let actions = core.session.on(Event::Close, now(&self.inner));
        for a in &actions {
            match a {
                Action::FailPending => {
                    let done = core.queue.close();
                    hand_out(&mut core, done);
                }
                Action::Stop => {
                    let _ = self.inner.stop.send(true);
                }
                other => debug_assert!(false, "close asked for {other:?}"),
            }
        }
        !actions.is_empty()
    }
}

/// Runs `f` on the core, then hands resolved tickets to their waiters.
fn resolve(inner: &Inner, f: impl FnOnce(&mut Core) -> Vec<(TicketId, FlushReport)>) {
    let mut core = inner.core.lock().expect("core lock");
    let done = f(&mut core);
    hand_out(&mut core, done);
}

/// Hands resolved tickets to their waiters.
fn hand_out(core: &mut Core, done: Vec<(TicketId, FlushReport)>) {
    for (id, report) in done {
        if let Some(tx) = core.waiters.remove(&id) {
            let _ = tx.send(report);
        }
    }
}

/// The session machine's clock: time since the client started.
fn now(inner: &Inner) -> Duration {
    tokio::time::Instant::now().saturating_duration_since(inner.origin)
}

/// Feeds the session machine one event, now.
fn session_on(inner: &Inner, ev: Event) -> Vec<Action> {
    inner.core.lock().expect("core lock").session.on(ev, now(inner))
}

async fn drive(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    loop {
        // A turn: a scheduled heartbeat if due, a backfill if owed (both
        // the session machine's call), then one batch.
        if !perform(&inner, session_on(&inner, Event::Turn)).await {
            return;
        }
        let batch = inner.core.lock().expect("core lock").queue.take_batch();
        if let Some(chunks) = batch {
            send_batch(&inner, chunks).await;
            continue; // more may have queued meanwhile
        }
        let until = match session_on(&inner, Event::Idle).as_slice() {
            [Action::Sleep { until }] => inner.origin + *until,
            _ => return, // `Stop`: closed
        };
        // `biased`: an unbiased select! draws from tokio's thread RNG, whose
        // seed mixes a process-global counter, so a simulation seed would
        // replay differently depending on what ran before it in the process.
        tokio::select! {
            biased;
            _ = stop.changed() => {}
            _ = inner.wake.notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// Performs a turn's session actions in order, feeding each outcome back
/// to the machine. Returns false on [`Action::Stop`].
async fn perform(inner: &Inner, actions: Vec<Action>) -> bool {
    let mut todo = std::collections::VecDeque::from(actions);
    while let Some(action) = todo.pop_front() {
        match action {
            Action::SendHeartbeat(beat) => todo.extend(heartbeat(inner, beat).await.1),
            Action::Backfill => {
                if let Err(fenced) = backfill(inner).await {
                    todo.extend(session_on(inner, Event::BackfillFailed { fenced }));
                }
            }
            Action::Stop => return false,
            // A turn's events ask for none of these.
            Action::Sleep { .. } | Action::FailPending | Action::Notice(_) => {
                debug_assert!(false, "a turn asked for {action:?}")
            }
        }
    }
    true
}

/// One heartbeat, its answer fed to the session machine. Returns whether
/// it was accepted, and the actions the answer asks for.
async fn heartbeat(inner: &Inner, beat: Beat) -> (bool, Vec<Action>) {
    let req = HeartbeatNodeRequest { node: inner.cfg.node.0.clone(), node_id: inner.cfg.session.0.clone() };
    let mut grpc = inner.grpc.clone();
    let res = tokio::time::timeout(inner.cfg.rpc_timeout, grpc.heartbeat_node(req)).await;
    let mut refusal = None;
    let answer = match res {
        Ok(Ok(resp)) => {
            let r = resp.into_inner();
            inner.metrics.heartbeats_ok.fetch_add(1, Ordering::Relaxed);
            let stale_after = Duration::from_secs(r.stale_after_secs.max(1));
            // `registrations_lost` is read from the queue under the core
            // lock, when the answer is fed.
            Answer::Accepted { new_session: r.new_session, stale_after, registrations_lost: false }
        }
        Ok(Err(status)) if status.code() == Code::FailedPrecondition => {
            // Another live session holds our address (the peer MetaServer's
            // answer, and ours): the machine stops trusting our session and
            // heartbeats on the backoff schedule until the other session
            // goes stale and ours takes over.
            inner.metrics.heartbeats_failed.fetch_add(1, Ordering::Relaxed);
            inner.metrics.heartbeats_refused.fetch_add(1, Ordering::Relaxed);
            refusal = Some(status);
            Answer::Refused
        }
        Ok(Err(status)) => {
            inner.metrics.heartbeats_failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%status, "heartbeat failed");
            Answer::NoAnswer
        }
        Err(_) => {
            inner.metrics.heartbeats_failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("heartbeat timed out");
            Answer::NoAnswer
        }
    };
    let accepted = matches!(answer, Answer::Accepted { .. });
    let actions = {
        let mut core = inner.core.lock().expect("core lock");
        let answer = match answer {
            Answer::Accepted { new_session, stale_after, .. } => {
                let registrations_lost = core.queue.counters().dropped() > 0;
                Answer::Accepted { new_session, stale_after, registrations_lost }
            }
            other => other,
        };
        core.session.on(Event::Heartbeat { beat, answer }, now(inner))
    };
    let mut rest = Vec::with_capacity(actions.len());
    for a in actions {
        match a {
            Action::Notice(Notice::SessionLost) => {
                tracing::info!(node = %inner.cfg.node, "metaserver lost our session; backfilling");
            }
            Action::Notice(Notice::Refused) => {
                if let Some(status) = &refusal {
                    tracing::warn!(node = %inner.cfg.node, %status, "metaserver refused our heartbeat; retrying with backoff");
                }
            }
            other => rest.push(other),
        }
    }
    (accepted, rest)
}

/// Re-advertises every resident block (C6). On a failed RPC stops and
/// returns `Err(fenced)` (`fenced`: the failure was `FAILED_PRECONDITION`);
/// the session machine then owes the backfill again.
async fn backfill(inner: &Inner) -> Result<(), bool> {
    let source = inner.source.lock().expect("source lock").clone();
    let Some(source) = source else {
        return Ok(());
    };
    let mut sent = 0u64;
    let mut resident = source.resident_blocks();
    if crate::canary::active(Canary::C6NoBackfill) {
        resident.clear(); // C6 canary: nothing re-advertised, success reported
    }
    for (namespace, hashes) in resident {
        for part in hashes.chunks(limits::HASHES_PER_REQUEST_MAX) {
            let req = InsertBlockHashesRequest {
                namespace: namespace.clone(),
                block_hashes: part.iter().map(|h| h.0.clone()).collect(),
                node: inner.cfg.node.0.clone(),
                node_id: inner.cfg.session.0.clone(),
            };
            let mut grpc = inner.grpc.clone();
            match tokio::time::timeout(inner.cfg.rpc_timeout, grpc.insert_block_hashes(req)).await {
                Ok(Ok(_)) => sent += part.len() as u64,
                Ok(Err(status)) => {
                    tracing::debug!(%status, "backfill rpc failed");
                    return Err(status.code() == Code::FailedPrecondition);
                }
                Err(_) => return Err(false),
            }
        }
    }
    inner.metrics.backfills.fetch_add(1, Ordering::Relaxed);
    inner.metrics.backfilled_hashes.fetch_add(sent, Ordering::Relaxed);
    Ok(())
}

async fn rpc_chunk(inner: &Inner, chunk: &Chunk) -> Result<(), tonic::Status> {
    inner.metrics.chunk_rpcs.fetch_add(1, Ordering::Relaxed);
    let hashes: Vec<bytes::Bytes> = chunk.hashes.iter().map(|h| h.0.clone()).collect();
    let mut grpc = inner.grpc.clone();
    let node = inner.cfg.node.0.clone();
    let node_id = inner.cfg.session.0.clone();
    let namespace = chunk.namespace.to_string();
    let t = inner.cfg.rpc_timeout;
    let res = match chunk.op {
        Op::Insert => {
            let req = InsertBlockHashesRequest { namespace, block_hashes: hashes, node, node_id };
            tokio::time::timeout(t, grpc.insert_block_hashes(req)).await.map(|r| r.map(|_| ()))
        }
        Op::Remove => {
            let req = RemoveBlockHashesRequest { namespace, block_hashes: hashes, node, node_id };
            tokio::time::timeout(t, grpc.remove_block_hashes(req)).await.map(|r| r.map(|_| ()))
        }
    };
    res.unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("metaserver rpc deadline")))
}

/// Sends a batch's chunks. Chunks of one `(namespace, op)` group go up to
/// [`limits::METASERVER_CHUNKS_IN_FLIGHT_MAX`] at a time: netting made their
/// hashes distinct and their op the same, so the order in which the
/// MetaServer applies them cannot matter, and overlapping them hides the
/// per-RPC encode/transfer/decode time behind the server's store work.
/// Groups go strictly one after another, so a group's removes are applied
/// before the next group's inserts begin (the order `take_batch` promises).
/// Returns once every chunk has an outcome, so a flush still resolves only
/// after all of them (C1).
async fn send_batch(inner: &Inner, chunks: Vec<Chunk>) {
    use futures::stream::StreamExt;
    let mut chunks = chunks.into_iter().peekable();
    while let Some(first) = chunks.next() {
        let mut group = vec![first];
        while let Some(c) = chunks.next_if(|c| c.op == group[0].op && c.namespace == group[0].namespace) {
            group.push(c);
        }
        futures::stream::iter(group)
            .for_each_concurrent(limits::METASERVER_CHUNKS_IN_FLIGHT_MAX, |c| send_chunk(inner, c))
            .await;
    }
}

/// Sends one chunk: on FAILED_PRECONDITION re-heartbeats and retries once;
/// on INVALID_ARGUMENT bisects to isolate the rejected hashes; any other
/// failure drops the chunk (fire-and-forget; C1 counts it as dropped).
async fn send_chunk(inner: &Inner, chunk: Chunk) {
    let mut work = vec![(chunk, 0u32)];
    while let Some((chunk, depth)) = work.pop() {
        if inner.core.lock().expect("core lock").session.is_closed() {
            resolve(inner, |core| core.queue.complete_chunk(chunk.id, ChunkOutcome::Dropped(DropReason::Shutdown)));
            continue;
        }
        let mut res = rpc_chunk(inner, &chunk).await;
        if let Err(status) = &res {
            if status.code() == Code::FailedPrecondition {
                // The server lost or fenced our session (e.g. it
                // restarted): the machine asks for an inline heartbeat,
                // unless our heartbeats are being refused (then the
                // backoff decides), and an accepted one earns a retry.
                let inline = session_on(inner, Event::ChunkFenced).contains(&Action::SendHeartbeat(Beat::Inline));
                if inline && heartbeat(inner, Beat::Inline).await.0 {
                    res = rpc_chunk(inner, &chunk).await;
                }
            }
        }
        let outcome = match res {
            Ok(()) => ChunkOutcome::Delivered,
            Err(status) if status.code() == Code::InvalidArgument && depth < limits::REJECT_BISECT_DEPTH_MAX => {
                let split = inner.core.lock().expect("core lock").queue.split_chunk(chunk.id);
                match split {
                    Some((a, b)) => {
                        work.push((b, depth + 1));
                        work.push((a, depth + 1));
                        continue;
                    }
                    None => ChunkOutcome::Dropped(DropReason::Rejected),
                }
            }
            Err(status) if status.code() == Code::InvalidArgument => ChunkOutcome::Dropped(DropReason::Rejected),
            Err(status) => {
                tracing::debug!(%status, hashes = chunk.hashes.len(), "registration chunk dropped");
                ChunkOutcome::Dropped(DropReason::RpcFailed)
            }
        };
        resolve(inner, |core| core.queue.complete_chunk(chunk.id, outcome));
    }
}

#[cfg(test)]
mod tests {
    use super::{AddressError, ClientError, MetaServerAddress, parse_metaserver_address};

    /// Issue 30: each of these used to start a node that failed later.
    #[test]
    fn bad_metaserver_addresses_are_refused_naming_the_part() {
        let p = parse_metaserver_address;
        assert!(matches!(p("not-an-address:xx"), Err(AddressError::Port { port, .. }) if port == "xx"));
        assert!(matches!(p("127.0.0.1:99999"), Err(AddressError::Port { port, .. }) if port == "99999"));
        assert!(matches!(p("127.0.0.1:0"), Err(AddressError::Port { .. })));
        assert!(matches!(p("127.0.0.1:+5"), Err(AddressError::Port { .. })));
        assert!(matches!(p("127.0.0.1"), Err(AddressError::NoPort { .. })));
        assert!(matches!(p("foo"), Err(AddressError::NoPort { .. })));
        assert!(matches!(p("[::1]:x"), Err(AddressError::Port { .. })));
        assert!(matches!(p("[::1]"), Err(AddressError::NoPort { .. })));
        assert!(matches!(p("[::g]:5"), Err(AddressError::Host { .. })));
        assert!(matches!(p("a b:5"), Err(AddressError::Host { .. })));
        assert!(matches!(p(":5"), Err(AddressError::Host { .. })));
        assert!(matches!(p("ftp://10.0.0.1:21"), Err(AddressError::Scheme { scheme, .. }) if scheme == "ftp"));
        assert!(matches!(p("http://h:5/x"), Err(AddressError::Trailing { .. })));
        let e = p("ftp://10.0.0.1:21").unwrap_err().to_string();
        assert!(e.contains("\"ftp\"://"), "{e}");
    }

    #[test]
    fn good_metaserver_addresses_parse() {
        let p = |a| parse_metaserver_address(a).unwrap();
        assert_eq!(p("127.0.0.1:5"), MetaServerAddress { scheme: None, host: "127.0.0.1", port: 5 });
        assert_eq!(
            p("http://meta-0.cluster:50051/"),
            MetaServerAddress { scheme: Some("http"), host: "meta-0.cluster", port: 50051 }
        );
        assert_eq!(p("https://[::1]:443"), MetaServerAddress { scheme: Some("https"), host: "::1", port: 443 });
        assert_eq!(p("localhost:65535").port, 65535);
    }

    #[test]
    fn rpc_errors_render_as_one_line_with_the_root_cause() {
        let plain = ClientError::Rpc(tonic::Status::unavailable("tcp connect error"));
        assert_eq!(plain.to_string(), "metaserver rpc failed: Unavailable: tcp connect error");
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let nested = ClientError::Rpc(tonic::Status::from_error(Box::new(refused)));
        let text = nested.to_string();
        assert!(text.ends_with("(connection refused)"), "{text}");
        assert!(!text.contains("source:"), "no debug dump: {text}");
    }
}
