//! The `shm` transport: a same-host reader reads the owner's pinned pool
//! straight from shared memory (issue 28 item 3, contract C19).
//!
//! # Why
//!
//! Two nodes on one host (several prefill and decode engines on one
//! machine) moved KV through TCP loopback: two copies through the kernel
//! and a socket stack per byte. With the pool in a sealed memfd
//! ([`crate::memory::pool::Pool::new_shared`]) the owner hands a
//! same-host reader the pool's descriptor once; each read is then one
//! `memcpy` from the owner's pool into the reader's, at the machine's copy
//! rate.
//!
//! # How a reader gets the pool (and who may)
//!
//! 1. **Same host, proven.** Every node's handshake metadata carries a
//!    [`SameHost`] section with its [`host_identity`]: the kernel's boot id
//!    (`/proc/sys/kernel/random/boot_id`, new at every boot, distinct per
//!    machine) and the network namespace (`/proc/self/ns/net`: the
//!    abstract socket below is reachable only inside one). An address is
//!    never compared. The owner issues a token only to a requester whose
//!    offer names the owner's own identity; the reader attaches only to an
//!    owner whose answer does.
//! 2. **Only a peer that passed the gRPC handshake.** The owner's answer
//!    carries a 128-bit one-time token drawn from an OS-seeded CSPRNG, bound
//!    to that requester, valid for [`limits::SHM_TOKEN_TTL_MS`]; at most
//!    [`limits::SHM_TOKENS_MAX`] are outstanding.
//! 3. **Only the same user.** The owner listens on an abstract Unix socket
//!    named `kvferry-shm-` + 128 random bits (no file, so no stale path
//!    and no directory permissions to get wrong; the name is unguessable,
//!    and it vanishes with the process). On each connection the owner
//!    checks the peer's credentials (`SO_PEERCRED`): a uid other than its
//!    own is refused and counted. The reader checks the owner's uid the
//!    same way before it trusts the answer.
//! 4. **Read-only.** The owner sends (`SCM_RIGHTS`) a descriptor reopened
//!    read-only through `/proc/self/fd` (so `mmap(PROT_WRITE, MAP_SHARED)`
//!    of it fails with `EACCES`), and the memfd is sealed with
//!    `F_SEAL_FUTURE_WRITE` where the kernel has it (a reader that reopens
//!    it read-write still cannot map it writable). The reader maps it
//!    `PROT_READ`, `MAP_SHARED`.
//! 5. **No `SIGBUS`.** The reader maps only a file that carries
//!    `F_SEAL_SHRINK` (checked with `F_GET_SEALS`) and whose size
//!    (`fstat`) equals the region the owner advertised: its pages can
//!    never vanish under the mapping.
//!
//! Every exchange is bounded: [`limits::SHM_CONNECTIONS_IN_FLIGHT_MAX`]
//! connections served at once (more are closed and counted), fixed-size
//! messages (24 bytes in, 16 out, one descriptor), and
//! [`limits::SHM_SOCKET_IO_MS`] (or the caller's deadline, if sooner) per
//! read or write.
//!
//! # Reads
//!
//! [`ShmTransport::read`] bounds-checks every op against the mapping
//! before copying anything (an op outside it fails the whole batch with
//! [`TransportError::BadOp`]: nothing is read, nothing faults), then copies
//! on up to [`limits::SHM_COPY_THREADS_MAX`] threads. What keeps the bytes
//! stable is the transfer lock the fetch took over gRPC
//! (`QueryBlocksForTransfer`, C8): the owner frees no locked block (C11).
//! The owner does not see these reads, so the transfer session is not
//! checked per read (C13 is the TCP server's contract; here the peer was
//! authenticated once, C19). A read after a lock expired can copy bytes the
//! owner reused: the fetch's checksums (C10) reject that block, as for TCP.
//!
//! # Failure
//!
//! An owner that dies leaves the reader's mapping valid (the file lives
//! while it is mapped): a read in flight completes with the bytes last
//! written, which the checksums judge; nothing crashes or hangs. The
//! reader holds a pidfd of the owner process (from `SO_PEERCRED`): once it
//! reads as exited, the next read drops the mapping and fails, so the
//! composite transport reads over TCP and the next handshake maps the
//! restarted owner's pool (an owner in the reader's own process — tests,
//! in-process clusters — is not watched this way: a node restarted in the
//! same process on the same address leaves a stale mapping whose bytes the
//! checksums reject until the peer is forgotten). A refused attach — not
//! the same host, no or a bad token, a wrong uid, an unsealed descriptor, a
//! size mismatch, an unreachable socket — is a typed [`ShmError`] and maps
//! nothing; the composite transport (`transport::path`) then reads over TCP.
//!
//! Linux only; never under the simulator (no memfd there:
//! [`ShmTransport::start`] answers [`ShmError::Unavailable`]).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rand::{RngCore, SeedableRng};
use tokio::time::Instant;

use super::handshake::{HandshakeMetadata, SameHost, TOKEN_BYTES, TransportKind};
use super::{
    BackendFailure, BadOp, HandshakeRejected, NotConnected, ReadCompletion, ReadOp, Transport, TransportError,
    validate_local,
};
use crate::limits;
use crate::memory::pool::{Extent, Pool};
use crate::types::NodeAddr;

/// First bytes of every request and answer on the shared-pool socket.
const MAGIC: [u8; 4] = *b"KVSM";
/// Protocol version of the socket exchange.
const VERSION: u8 = 1;
/// Request: magic, version, 3 zero bytes, token.
const REQUEST_BYTES: usize = 4 + 1 + 3 + TOKEN_BYTES;
/// Answer: magic, status, 3 zero bytes, file size `u64` (with the fd on OK).
const ANSWER_BYTES: usize = 4 + 1 + 3 + 8;

/// Answer status of the shared-pool socket (wire byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Refusal {
    /// Not a refusal: the descriptor follows.
    Ok = 0,
    /// Malformed request (magic, version, reserved bytes).
    BadRequest = 1,
    /// Unknown, expired or already redeemed token.
    BadToken = 2,
    /// The connecting process runs as another user.
    WrongUid = 3,
    /// Too many connections in flight.
    Busy = 4,
    /// The owner could not send its descriptor.
    Internal = 5,
}

impl Refusal {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Refusal::Ok,
            1 => Refusal::BadRequest,
            2 => Refusal::BadToken,
            3 => Refusal::WrongUid,
            4 => Refusal::Busy,
            5 => Refusal::Internal,
            _ => return None,
        })
    }
}

/// Why the shared-pool path was not set up (nothing is mapped after any).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShmError {
    /// This build or machine has no shared pools: the simulator, no memfd,
    /// or a pool that is not shared.
    #[error("shared pool unavailable: {0}")]
    Unavailable(String),
    /// The peer's metadata has no same-host section.
    #[error("peer offers no shared pool")]
    NoSection,
    /// The peer's host identity is not ours (or ours is unknown).
    #[error("peer runs on another host (host id {theirs:?}, ours {ours:?})")]
    NotSameHost {
        /// Our identity, when known.
        ours: Option<String>,
        /// The peer's.
        theirs: String,
    },
    /// The answer carries no token: the owner did not grant access.
    #[error("owner issued no shared-pool token")]
    NoToken,
    /// The section names a region the metadata lacks.
    #[error("shared region {0} not in the peer's metadata")]
    NoRegion(u32),
    /// The owner refused the request.
    #[error("owner refused the shared pool: {0:?}")]
    Refused(Refusal),
    /// The socket's other end runs as another user.
    #[error("peer process runs as uid {theirs}, we trust uid {ours}")]
    WrongUid {
        /// The uid we accept.
        ours: u32,
        /// The peer's uid (`SO_PEERCRED`).
        theirs: u32,
    },
    /// The received file is not sealed against shrinking.
    #[error("shared pool fd is not sealed against shrinking (seals {0:#x})")]
    Unsealed(i32),
    /// The received file's size is not the advertised region's.
    #[error("shared pool is {actual} bytes, the owner advertised {advertised}")]
    SizeMismatch {
        /// Region length in the handshake (bytes).
        advertised: u64,
        /// `fstat` size (bytes).
        actual: u64,
    },
    /// The answer said OK but carried no (or more than one) descriptor.
    #[error("owner answered without exactly one descriptor")]
    NoFd,
    /// Malformed answer.
    #[error("shared-pool protocol: {0}")]
    Protocol(String),
    /// A socket or mapping call failed.
    #[error("shared-pool i/o: {0}")]
    Io(String),
    /// The deadline passed.
    #[error("shared-pool attach deadline passed")]
    Timeout,
    /// [`limits::SHM_MAPPINGS_MAX`] peer pools are mapped already.
    #[error("too many mapped peer pools (limit {0})")]
    TooManyMappings(usize),
}

impl ShmError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ShmError::Unavailable(_) => "shm_unavailable",
            ShmError::NoSection => "shm_no_section",
            ShmError::NotSameHost { .. } => "shm_not_same_host",
            ShmError::NoToken => "shm_no_token",
            ShmError::NoRegion(_) => "shm_no_region",
            ShmError::Refused(_) => "shm_refused",
            ShmError::WrongUid { .. } => "shm_wrong_uid",
            ShmError::Unsealed(_) => "shm_unsealed",
            ShmError::SizeMismatch { .. } => "shm_size_mismatch",
            ShmError::NoFd => "shm_no_fd",
            ShmError::Protocol(_) => "shm_protocol",
            ShmError::Io(_) => "shm_io",
            ShmError::Timeout => "shm_timeout",
            ShmError::TooManyMappings(_) => "shm_too_many_mappings",
        }
    }
}

impl From<ShmError> for BackendFailure {
    fn from(e: ShmError) -> Self {
        BackendFailure { code: e.code(), message: e.to_string() }
    }
}

fn io_err(what: &str, e: std::io::Error) -> ShmError {
    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
        return ShmError::Timeout;
    }
    ShmError::Io(format!("{what}: {e}"))
}

/// This host's identity for [`SameHost::host_id`]: the kernel boot id and
/// the network namespace, `"<boot id>/<net ns>"` (e.g.
/// `04968113-…-fbde5136432d/net:[4026531833]`). Two processes see the same
/// string only on one machine, in one boot, in one network namespace (where
/// the abstract socket reaches). `None` when either cannot be read, or
/// under the simulator.
pub fn host_identity() -> Option<String> {
    if crate::rt::SIMULATED {
        return None;
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::read_link("/proc/self/ns/net").ok()?;
    let id = format!("{}/{}", boot.trim(), net.to_string_lossy());
    let ok = !id.is_empty() && id.len() <= limits::HOST_ID_BYTES_MAX && id.bytes().all(|b| b.is_ascii_graphic());
    ok.then_some(id)
}

/// The effective uid of this process.
pub fn our_uid() -> u32 {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() }
}

/// Counters of one shared-pool transport (both sides).
#[derive(Debug, Default)]
pub struct ShmHooks {
    /// Owner: descriptors sent.
    pub fds_sent: AtomicU64,
    /// Owner: connections refused for a uid other than ours.
    pub refused_uid: AtomicU64,
    /// Owner: requests refused for an unknown, expired or used token.
    pub refused_token: AtomicU64,
    /// Owner: malformed requests.
    pub refused_request: AtomicU64,
    /// Owner: connections closed at once, over
    /// [`limits::SHM_CONNECTIONS_IN_FLIGHT_MAX`].
    pub refused_busy: AtomicU64,
    /// Owner: tokens issued in handshake answers.
    pub tokens_issued: AtomicU64,
    /// Reader: peer pools mapped.
    pub attached: AtomicU64,
    /// Reader: read batches served from a mapping.
    pub reads: AtomicU64,
    /// Reader: bytes copied from mappings.
    pub bytes: AtomicU64,
    /// Reader, test hook: the next N read batches fail as a whole with
    /// [`TransportError::Io`] before copying anything (the composite
    /// transport's fallback to TCP is tested with it).
    pub fail_next_reads: AtomicU64,
}

/// Settings of a [`ShmTransport`].
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// The uid a peer (owner or reader) must run as: our effective uid by
    /// default ([`our_uid`]). Tests set another to see the refusal.
    pub trusted_uid: u32,
    /// Our [`host_identity`]; `None` disables the path.
    pub host_id: Option<String>,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self { trusted_uid: our_uid(), host_id: host_identity() }
    }
}

/// One outstanding token.
struct Grant {
    token: [u8; TOKEN_BYTES],
    requester: NodeAddr,
    issued: std::time::Instant,
}

/// Outstanding one-time tokens, oldest first; a plain struct (no I/O).
#[derive(Default)]
struct Grants {
    list: std::collections::VecDeque<Grant>,
    /// Requesters that redeemed a token (same host and user, proven by the
    /// socket and its credentials), newest last, at most
    /// [`limits::SHM_TOKENS_MAX`]: device handles go only to them (C19).
    proven: std::collections::VecDeque<NodeAddr>,
}

impl Grants {
    /// Adds a grant for `requester` (replacing its earlier one), forgetting
    /// the oldest beyond [`limits::SHM_TOKENS_MAX`].
    fn issue(&mut self, requester: &NodeAddr, token: [u8; TOKEN_BYTES], now: std::time::Instant) {
        self.list.retain(|g| &g.requester != requester);
        while self.list.len() >= limits::SHM_TOKENS_MAX {
            self.list.pop_front();
        }
        self.list.push_back(Grant { token, requester: requester.clone(), issued: now });
    }

    /// Removes and accepts `token` if it is outstanding and younger than
    /// [`limits::SHM_TOKEN_TTL_MS`]. Compares against every grant in
    /// constant time per grant (no early exit on a byte).
    fn redeem(&mut self, token: &[u8; TOKEN_BYTES], now: std::time::Instant) -> bool {
        let ttl = Duration::from_millis(limits::SHM_TOKEN_TTL_MS);
        self.list.retain(|g| now.duration_since(g.issued) < ttl);
        let mut found = None;
        for (i, g) in self.list.iter().enumerate() {
            let diff = g.token.iter().zip(token).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 {
                found = Some(i);
            }
        }
        let Some(g) = found.and_then(|i| self.list.remove(i)) else { return false };
        self.proven.retain(|p| *p != g.requester);
        if self.proven.len() >= limits::SHM_TOKENS_MAX {
            self.proven.pop_front();
        }
        self.proven.push_back(g.requester);
        true
    }
}

/// A peer's pool mapped read-only; unmapped when the last read using it
/// ends.
struct Mapping {
    ptr: *const u8,
    len: usize,
    region: u32,
    /// A pidfd of the owner process (`SO_PEERCRED`'s pid at attach), when
    /// the kernel has pidfds: readable once that process exited.
    owner: Option<OwnedFd>,
}

impl Mapping {
    /// Whether the owner process is known to have exited (its pidfd is
    /// readable). An owner in this very process never reads as exited.
    fn owner_exited(&self) -> bool {
        let Some(fd) = &self.owner else { return false };
        let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll of one live descriptor, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & libc::POLLIN != 0
    }
}

/// A pidfd of process `pid`, `None` where the kernel has none (Linux < 5.3)
/// or the process is gone already.
fn pidfd_of(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: the pidfd_open syscall with no flags.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a fresh descriptor we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

// SAFETY: a read-only shared mapping with no thread affinity; only ever read
// through raw-pointer copies.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the range mapped in `map_received`; no copy is
        // running (every copy holds an `Arc` to this mapping).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// The owner's side: what the socket serves.
struct Serving {
    stop: Arc<AtomicBool>,
    listener: Arc<UnixListener>,
}

/// The shared-pool transport of one node: owner side (the socket that
/// hands out the pool) and reader side (the peers' mapped pools).
pub struct ShmTransport {
    cfg: ShmConfig,
    base: HandshakeMetadata,
    socket: String,
    region: u32,
    grants: Arc<Mutex<Grants>>,
    rng: Mutex<rand::rngs::StdRng>,
    peers: Mutex<HashMap<NodeAddr, Arc<Mapping>>>,
    serving: Serving,
    /// Counters.
    pub hooks: Arc<ShmHooks>,
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl ShmTransport {
    /// Starts the owner side for `pool` (which must be shared:
    /// [`Pool::new_shared`]), extending `base` (the node's primary
    /// transport's metadata; region `region` must be the pool's, with
    /// offsets relative to the arena). Binds the abstract socket and serves
    /// it on a thread of its own until [`ShmTransport::shutdown`].
    ///
    /// # Errors
    /// [`ShmError::Unavailable`] under the simulator, without a host
    /// identity, for a private pool, or when `base` lacks `region` or its
    /// length differs from the pool's; [`ShmError::Io`] when the socket or
    /// the read-only descriptor cannot be made.
    pub fn start(pool: &Pool, base: HandshakeMetadata, region: u32, cfg: ShmConfig) -> Result<Self, ShmError> {
        if crate::rt::SIMULATED {
            return Err(ShmError::Unavailable("the simulator has no shared memory".into()));
        }
        if cfg.host_id.is_none() {
            return Err(ShmError::Unavailable("no host identity (boot id, net namespace)".into()));
        }
        let Some(fd) = pool.shared_fd() else {
            return Err(ShmError::Unavailable("the pool is not in a memfd".into()));
        };
        match base.region(region) {
            Some(r) if r.base == 0 && r.len == pool.arena_len() => {}
            _ => return Err(ShmError::Unavailable(format!("region {region} is not the pool's arena"))),
        }
        let ro = reopen_read_only(fd)?;
        let mut rng = rand::rngs::StdRng::from_os_rng();
        let mut name = [0u8; 16];
        rng.fill_bytes(&mut name);
        let socket = format!("kvferry-shm-{}", hex::encode(name));
        let addr = SocketAddr::from_abstract_name(socket.as_bytes()).map_err(|e| io_err("socket name", e))?;
        let listener = Arc::new(UnixListener::bind_addr(&addr).map_err(|e| io_err("bind", e))?);
        let hooks = Arc::new(ShmHooks::default());
        let stop = Arc::new(AtomicBool::new(false));
        let t = Self {
            cfg,
            base,
            socket,
            region,
            grants: Arc::new(Mutex::new(Grants::default())),
            rng: Mutex::new(rng),
            peers: Mutex::new(HashMap::new()),
            serving: Serving { stop: stop.clone(), listener: listener.clone() },
            hooks: hooks.clone(),
        };
        let server = Server { ro: Arc::new(ro), len: pool.arena_len(), uid: t.cfg.trusted_uid, hooks };
        let grants = t.grants.clone();
        std::thread::Builder::new()
            .name("kvferry-shm".into())
            .spawn(move || server.accept_loop(&listener, &stop, &grants))
            .map_err(|e| io_err("thread", e))?;
        Ok(t)
    }

    /// Whether `peer` redeemed a token this node issued to it: it reached
    /// the abstract socket (same host, same net namespace) as this user.
    pub fn proven_same_host(&self, peer: &NodeAddr) -> bool {
        self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner).proven.contains(peer)
    }

    /// Stops serving: the socket closes; peers already attached keep their
    /// mappings (the bytes stay readable to them).
    pub fn shutdown(&self) {
        if !self.serving.stop.swap(true, Ordering::SeqCst) {
            // Wakes the blocked `accept` (EINVAL) so the thread sees `stop`.
            // SAFETY: shutdown on our own listening socket.
            unsafe { libc::shutdown(self.serving.listener.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }

    /// The abstract socket name the pool is handed out on.
    pub fn socket_name(&self) -> &str {
        &self.socket
    }

    /// Peers whose pool is mapped.
    pub fn attached_peers(&self) -> usize {
        self.peers.lock().expect("peers lock").len()
    }

    /// Whether `peer`'s pool is mapped (reads from it go through memory).
    pub fn is_attached(&self, peer: &NodeAddr) -> bool {
        self.peers.lock().expect("peers lock").contains_key(peer)
    }

    /// Our same-host section for an offer (no token).
    pub fn offer_section(&self) -> Option<SameHost> {
        Some(SameHost {
            host_id: self.cfg.host_id.clone()?,
            socket: self.socket.clone(),
            region: self.region,
            token: [0; TOKEN_BYTES],
        })
    }

    /// The owner's same-host section for its answer to `requester`: with a
    /// fresh one-time token when the offer names our host identity, `None`
    /// (no token issued) otherwise or after [`ShmTransport::shutdown`].
    pub fn answer_section(&self, requester: &NodeAddr, offer: &HandshakeMetadata) -> Option<SameHost> {
        let ours = self.cfg.host_id.as_ref()?;
        let theirs = offer.same_host.as_ref()?;
        if &theirs.host_id != ours || self.serving.stop.load(Ordering::SeqCst) {
            return None;
        }
        let mut token = [0u8; TOKEN_BYTES];
        while token == [0; TOKEN_BYTES] {
            self.rng.lock().expect("rng lock").fill_bytes(&mut token);
        }
        self.grants.lock().expect("grants lock").issue(requester, token, std::time::Instant::now());
        self.hooks.tokens_issued.fetch_add(1, Ordering::Relaxed);
        Some(SameHost { token, ..self.offer_section()? })
    }

    /// The reader's side of a handshake: maps `peer`'s pool when `remote`
    /// (its answer) proves the same host and carries a token, after the
    /// checks of the module doc. Replaces an earlier mapping of `peer`.
    ///
    /// # Errors
    /// [`ShmError`]; nothing is mapped after any.
    pub async fn attach(&self, peer: &NodeAddr, remote: &HandshakeMetadata, deadline: Instant) -> Result<(), ShmError> {
        let section = remote.same_host.as_ref().ok_or(ShmError::NoSection)?;
        match &self.cfg.host_id {
            Some(ours) if *ours == section.host_id => {}
            ours => return Err(ShmError::NotSameHost { ours: ours.clone(), theirs: section.host_id.clone() }),
        }
        if section.token == [0; TOKEN_BYTES] {
            return Err(ShmError::NoToken);
        }
        let region = remote.region(section.region).ok_or(ShmError::NoRegion(section.region))?;
        {
            let peers = self.peers.lock().expect("peers lock");
            if !peers.contains_key(peer) && peers.len() >= limits::SHM_MAPPINGS_MAX {
                return Err(ShmError::TooManyMappings(limits::SHM_MAPPINGS_MAX));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ShmError::Timeout);
        }
        let io = left.min(Duration::from_millis(limits::SHM_SOCKET_IO_MS));
        let (socket, token, uid, want) = (section.socket.clone(), section.token, self.cfg.trusted_uid, region.len);
        let id = region.id;
        let (fd, owner) = crate::rt::run_blocking(move || fetch_fd_and_owner(&socket, &token, uid, io))
            .await
            .map_err(|e| ShmError::Io(e.0))??;
        let mut mapping = map_received(fd, want, id)?;
        // Where the owner runs in another process, a read notices when it
        // exited (a restarted owner's blocks are elsewhere): see `read`.
        mapping.owner = owner;
        self.peers.lock().expect("peers lock").insert(peer.clone(), Arc::new(mapping));
        self.hooks.attached.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The owner's socket server (runs on its own thread).
struct Server {
    /// The pool's memfd, reopened read-only.
    ro: Arc<OwnedFd>,
    /// Its size (bytes), sent with it.
    len: u64,
    /// The uid a peer must run as.
    uid: u32,
    hooks: Arc<ShmHooks>,
}

/// Releases a connection's place in the in-flight count.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Server {
    /// Accepts until `stop`; each admitted connection is served on a
    /// thread of its own (at most [`limits::SHM_CONNECTIONS_IN_FLIGHT_MAX`]
    /// at once, each bounded by [`limits::SHM_SOCKET_IO_MS`] per step).
    fn accept_loop(self, listener: &UnixListener, stop: &AtomicBool, grants: &Arc<Mutex<Grants>>) {
        let server = Arc::new(self);
        let in_flight = Arc::new(AtomicUsize::new(0));
        while !stop.load(Ordering::SeqCst) {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(_) if stop.load(Ordering::SeqCst) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "shared-pool accept failed");
                    std::thread::sleep(Duration::from_millis(limits::ACCEPT_RETRY_MS));
                    continue;
                }
            };
            if in_flight.fetch_add(1, Ordering::SeqCst) >= limits::SHM_CONNECTIONS_IN_FLIGHT_MAX {
                in_flight.fetch_sub(1, Ordering::SeqCst);
                server.hooks.refused_busy.fetch_add(1, Ordering::Relaxed);
                continue; // dropping the stream closes it
            }
            let slot = InFlight(in_flight.clone());
            let (server, grants) = (server.clone(), grants.clone());
            let spawned = std::thread::Builder::new().name("kvferry-shm-conn".into()).spawn(move || {
                let _slot = slot;
                server.serve(stream, &grants);
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "shared-pool connection thread");
            }
        }
    }

    /// One exchange: uid check, request, token, answer with the descriptor.
    fn serve(&self, mut s: UnixStream, grants: &Mutex<Grants>) {
        let io = Some(Duration::from_millis(limits::SHM_SOCKET_IO_MS));
        if s.set_read_timeout(io).is_err() || s.set_write_timeout(io).is_err() {
            return;
        }
        let refuse = |mut s: UnixStream, why: Refusal, counter: &AtomicU64| {
            counter.fetch_add(1, Ordering::Relaxed);
            let _ = s.write_all(&answer(why, 0));
        };
        match peer_uid(&s) {
            Ok(uid) if uid == self.uid => {}
            Ok(uid) => {
                tracing::warn!(uid, "shared-pool request from another user refused");
                return refuse(s, Refusal::WrongUid, &self.hooks.refused_uid);
            }
            Err(_) => return refuse(s, Refusal::WrongUid, &self.hooks.refused_uid),
        }
        let mut req = [0u8; REQUEST_BYTES];
        if s.read_exact(&mut req).is_err() {
            self.hooks.refused_request.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if req[..4] != MAGIC || req[4] != VERSION || req[5..8] != [0, 0, 0] {
            return refuse(s, Refusal::BadRequest, &self.hooks.refused_request);
        }
        let mut token = [0u8; TOKEN_BYTES];
        token.copy_from_slice(&req[8..]);
        let ok =
            grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner).redeem(&token, std::time::Instant::now());
        if !ok {
            return refuse(s, Refusal::BadToken, &self.hooks.refused_token);
        }
        match send_with_fd(&s, &answer(Refusal::Ok, self.len), self.ro.as_fd()) {
            Ok(()) => {
                self.hooks.fds_sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(error = %e, "shared-pool answer not sent"),
        }
    }
}

/// An answer: magic, status, 3 zero bytes, size.
fn answer(status: Refusal, len: u64) -> [u8; ANSWER_BYTES] {
    let mut a = [0u8; ANSWER_BYTES];
    a[..4].copy_from_slice(&MAGIC);
    a[4] = status as u8;
    a[8..].copy_from_slice(&len.to_le_bytes());
    a
}

/// Sends `bytes` with `fd` attached (`SCM_RIGHTS`), in one message.
fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut cmsg = [0u64; 4];
    // SAFETY: a zeroed msghdr pointing at live buffers; the control buffer
    // (32 bytes) holds one `SCM_RIGHTS` header and descriptor.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd.as_raw_fd());
        let n = libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n as usize != bytes.len() {
            return Err(std::io::Error::other("short send"));
        }
    }
    Ok(())
}

/// Opens `fd`'s file again, read-only, through `/proc/self/fd`: a new open
/// file description whose mappings cannot be writable.
fn reopen_read_only(fd: BorrowedFd<'_>) -> Result<OwnedFd, ShmError> {
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    // SAFETY: a NUL-terminated path.
    let raw = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(io_err("reopen read-only", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// The uid of the process at the other end of `s` (`SO_PEERCRED`).
fn peer_uid(s: &UnixStream) -> Result<u32, ShmError> {
    peer_cred(s).map(|c| c.uid)
}

/// The credentials of the process at the other end of `s` (`SO_PEERCRED`).
fn peer_cred(s: &UnixStream) -> Result<libc::ucred, ShmError> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized struct.
    let r = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len)
    };
    if r != 0 {
        return Err(io_err("SO_PEERCRED", std::io::Error::last_os_error()));
    }
    Ok(cred)
}

/// Reader: connects to `socket`, checks the owner's uid, presents `token`
/// and receives the descriptor, each step within `io`; with it a pidfd of
/// the owner process when the kernel has one.
fn fetch_fd_and_owner(
    socket: &str,
    token: &[u8; TOKEN_BYTES],
    uid: u32,
    io: Duration,
) -> Result<(OwnedFd, Option<OwnedFd>), ShmError> {
    let addr = SocketAddr::from_abstract_name(socket.as_bytes()).map_err(|e| io_err("socket name", e))?;
    let mut s = UnixStream::connect_addr(&addr).map_err(|e| io_err("connect", e))?;
    s.set_read_timeout(Some(io)).map_err(|e| io_err("timeout", e))?;
    s.set_write_timeout(Some(io)).map_err(|e| io_err("timeout", e))?;
    let cred = peer_cred(&s)?;
    if cred.uid != uid {
        return Err(ShmError::WrongUid { ours: uid, theirs: cred.uid });
    }
    let owner = pidfd_of(cred.pid);
    let mut req = [0u8; REQUEST_BYTES];
    req[..4].copy_from_slice(&MAGIC);
    req[4] = VERSION;
    req[8..].copy_from_slice(token);
    // An owner that refuses on credentials alone answers and closes
    // without reading the request: a send that finds the socket closed
    // still reads that answer (else the refusal shows up as a broken pipe).
    let sent = s.write_all(&req);
    let (answer, fds) = match (sent, recv_with_fds(&s)) {
        (_, Ok(got)) => got,
        (Err(e), Err(_)) => return Err(io_err("send request", e)),
        (Ok(()), Err(e)) => return Err(e),
    };
    let mut fds = fds.into_iter();
    let (first, extra) = (fds.next(), fds.next());
    if answer[..4] != MAGIC || answer[5..8] != [0, 0, 0] {
        return Err(ShmError::Protocol("bad answer header".into()));
    }
    let status = Refusal::from_u8(answer[4]).ok_or_else(|| ShmError::Protocol(format!("status {}", answer[4])))?;
    if status != Refusal::Ok {
        return Err(ShmError::Refused(status));
    }
    match (first, extra) {
        (Some(fd), None) => Ok((fd, owner)),
        _ => Err(ShmError::NoFd),
    }
}

/// Receives one answer (exactly [`ANSWER_BYTES`]) with up to two
/// descriptors (a second one is an error the caller reports; both are
/// closed when dropped).
fn recv_with_fds(s: &UnixStream) -> Result<([u8; ANSWER_BYTES], Vec<OwnedFd>), ShmError> {
    let mut buf = [0u8; ANSWER_BYTES];
    // Room for two descriptors: the second, if any, is detected and closed.
    let mut cmsg = [0u64; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: a zeroed msghdr pointing at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE((2 * std::mem::size_of::<RawFd>()) as u32) } as usize;
    // SAFETY: recvmsg into the buffers above (sized as declared).
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_WAITALL) };
    if n < 0 {
        return Err(io_err("receive answer", std::io::Error::last_os_error()));
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, with the libc
    // macros, reading only `SCM_RIGHTS` payloads of the length declared.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(ShmError::NoFd);
    }
    if n as usize != ANSWER_BYTES {
        return Err(ShmError::Protocol(format!("answer of {n} bytes")));
    }
    Ok((buf, fds))
}

/// Reader: checks the received file (sealed against shrinking, `want`
/// bytes) and maps it read-only. Nothing is mapped on an error; `fd` is
/// closed either way (the mapping keeps the file).
fn map_received(fd: OwnedFd, want: u64, region: u32) -> Result<Mapping, ShmError> {
    // SAFETY: fcntl on a live descriptor.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(ShmError::Unsealed(seals));
    }
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io_err("fstat", std::io::Error::last_os_error()));
    }
    let actual = u64::try_from(st.st_size).unwrap_or(0);
    if actual != want || want == 0 {
        return Err(ShmError::SizeMismatch { advertised: want, actual });
    }
    let len = usize::try_from(want).map_err(|_| ShmError::SizeMismatch { advertised: want, actual })?;
    // SAFETY: a fresh read-only shared mapping of the whole (sealed) file.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(io_err("mmap", std::io::Error::last_os_error()));
    }
    Ok(Mapping { ptr: p as *const u8, len, region, owner: None })
}

#[async_trait]
impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        self.base.transport
    }

    fn local_metadata(&self) -> HandshakeMetadata {
        HandshakeMetadata { same_host: self.offer_section(), ..self.base.clone() }
    }

    fn answer(
        &self,
        requester: &NodeAddr,
        offer: &HandshakeMetadata,
        _deadline: Instant,
    ) -> Result<HandshakeMetadata, TransportError> {
        Ok(HandshakeMetadata { same_host: self.answer_section(requester, offer), ..self.base.clone() })
    }

    async fn connect(
        &self,
        peer: &NodeAddr,
        remote: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        self.attach(peer, remote, deadline)
            .await
            .map_err(|e| TransportError::Handshake(HandshakeRejected::SharedPool(e.into())))
    }

    fn disconnect(&self, peer: &NodeAddr) {
        self.peers.lock().expect("peers lock").remove(peer);
    }

    fn shared_region(&self, peer: &NodeAddr) -> Option<super::SharedRegion> {
        let mut peers = self.peers.lock().expect("peers lock");
        let map = peers.get(peer)?.clone();
        if map.owner_exited() {
            // As in `read`: the successor's blocks are in another pool.
            peers.remove(peer);
            return None;
        }
        Some(super::SharedRegion { region: map.region, addr: map.ptr as usize, len: map.len as u64, keep: map })
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

    /// With `ends`, each extent's slot checksums are taken as its pieces
    /// are copied.
    async fn read_summed(
        &self,
        peer: &NodeAddr,
        _session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        ends: Option<super::SlotEnds>,
        deadline: Instant,
    ) -> ReadCompletion {
        let fail_all = ReadCompletion::all_failed;
        if let Err(e) = validate_local(&ops, &local) {
            return fail_all(local, e);
        }
        let Some(map) = self.peers.lock().expect("peers lock").get(peer).cloned() else {
            return fail_all(local, TransportError::NotConnected(NotConnected::Peer(peer.0.clone())));
        };
        if let Some(op) = ops.iter().find(|op| !in_mapping(&map, op)) {
            return fail_all(
                local,
                TransportError::BadOp(BadOp::OutsideSharedPool {
                    offset: op.remote_offset,
                    len: op.len,
                    region: op.region,
                    pool_len: map.len as u64,
                    pool_region: map.region,
                }),
            );
        }
        if Instant::now() >= deadline {
            return fail_all(local, TransportError::Timeout);
        }
        if map.owner_exited() {
            // The owner process is gone: its successor (same address) has
            // its blocks in another pool. Forget this mapping; the next
            // handshake maps the new one, TCP serves meanwhile.
            self.peers.lock().expect("peers lock").remove(peer);
            return fail_all(
                local,
                TransportError::io(std::io::ErrorKind::BrokenPipe, "shared-pool owner process exited"),
            );
        }
        if self.hooks.fail_next_reads.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return fail_all(
                local,
                TransportError::io(std::io::ErrorKind::Other, "injected shared-pool read error (test hook)"),
            );
        }
        let total: u64 = ops.iter().map(|op| op.len).sum();
        let n = local.len();
        let parts = split_parts(local, ops, total);
        let summed = ends.is_some();
        let copied = crate::rt::run_blocking(move || {
            crate::rt::map_parts(parts, |part| {
                part.into_iter()
                    .map(|(i, mut ext, ops)| {
                        let sums = copy_ops(&map, &mut ext, &ops, ends.as_ref());
                        (i, ext, sums)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .await;
        let Ok(parts) = copied else {
            // The runtime is shutting down: the extents went with the task.
            return ReadCompletion::unsummed(Vec::new(), Vec::new());
        };
        let mut slots: Vec<Option<(Extent, Option<Arc<[u32]>>)>> = (0..n).map(|_| None).collect();
        for (i, ext, sums) in parts.into_iter().flatten() {
            slots[i] = Some((ext, sums));
        }
        let (local, mut sums): (Vec<Extent>, Vec<Option<Arc<[u32]>>>) = slots.into_iter().map_while(|s| s).unzip();
        if !summed {
            sums.clear();
        }
        self.hooks.reads.fetch_add(1, Ordering::Relaxed);
        self.hooks.bytes.fetch_add(total, Ordering::Relaxed);
        let results = vec![Ok(()); local.len()];
        ReadCompletion { local, results, sums }
    }
}

/// Whether `op` lies inside the mapping (region and bytes).
fn in_mapping(map: &Mapping, op: &ReadOp) -> bool {
    op.region == map.region && op.remote_offset.checked_add(op.len).is_some_and(|end| end <= map.len as u64)
}

/// One copy thread's work: extents (with their batch index) and their ops.
type Part = Vec<(usize, Extent, Vec<ReadOp>)>;

/// Groups ops by extent and deals extents into parts of at least
/// [`limits::SHM_COPY_BYTES_PER_THREAD_MIN`] bytes, at most
/// [`limits::SHM_COPY_THREADS_MAX`] of them (and no more than the cores).
fn split_parts(local: Vec<Extent>, ops: Vec<ReadOp>, total: u64) -> Vec<Part> {
    let mut per_ext: Vec<Vec<ReadOp>> = vec![Vec::new(); local.len()];
    for op in ops {
        per_ext[op.local_extent].push(op);
    }
    let threads = (total / limits::SHM_COPY_BYTES_PER_THREAD_MIN)
        .clamp(1, limits::SHM_COPY_THREADS_MAX.min(crate::rt::cpu_parallelism()) as u64);
    let share = total.div_ceil(threads).max(1);
    let mut parts: Vec<Part> = vec![Vec::new()];
    let mut filled = 0u64;
    for (i, (ext, ops)) in local.into_iter().zip(per_ext).enumerate() {
        let bytes: u64 = ops.iter().map(|op| op.len).sum();
        if filled >= share && (parts.len() as u64) < threads {
            parts.push(Vec::new());
            filled = 0;
        }
        filled += bytes;
        parts.last_mut().expect("one part at least").push((i, ext, ops));
    }
    parts
}

/// Copies `ops` (checked against the mapping and the extent) from the
/// mapping into `ext`; with `ends`, a piece at a time
/// ([`limits::READ_SUM_PIECE_BYTES`]), each summed right after its copy
/// (still in cache), and returns the extent's slot checksums (`None`
/// without `ends` or when the ops did not fill the extent in order).
fn copy_ops(map: &Mapping, ext: &mut Extent, ops: &[ReadOp], ends: Option<&super::SlotEnds>) -> Option<Arc<[u32]>> {
    let mut summer = ends.map(super::SlotSummer::new);
    let piece = if summer.is_some() { limits::READ_SUM_PIECE_BYTES } else { usize::MAX };
    let dst = ext.as_mut_slice();
    for op in ops {
        let (src, len, at) = (op.remote_offset as usize, op.len as usize, op.local_offset as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(piece);
            let dst = &mut dst[at + done..at + done + n];
            // SAFETY: `[src, src + len)` lies inside the mapping
            // (`in_mapping`, checked for every op before any copy), which
            // lives while `map` does. The source is another process's
            // memory it may still write (a lock that expired): copied
            // through a raw pointer, never borrowed as `&[u8]`, and the
            // fetch's checksums (taken here on the copy) judge the result.
            unsafe { std::ptr::copy_nonoverlapping(map.ptr.add(src + done), dst.as_mut_ptr(), n) };
            if let Some(s) = summer.as_mut() {
                s.landed((at + done) as u64, dst);
            }
            done += n;
        }
    }
    summer.and_then(super::SlotSummer::finish)
}

/// The shared-pool path's baseline: the best plain host copy this machine
/// does of `total` bytes, for each count in `threads` (e.g.
/// [`limits::TCP_RAW_COPY_CONNECTIONS`]) that many OS threads each copying
/// its own `total / count` bytes from one buffer into another (`memcpy` of a
/// slice), both touched before the clock starts; the fastest of `reps` per
/// count. A shared-pool read is one such copy from the owner's pool into
/// the reader's, so T8 over this path (`kvferry pd --path shm`) divides by
/// the best of these.
///
/// # Errors
/// A count of 0, or a size larger than memory can address.
pub fn raw_memcpy(total: u64, threads: &[usize], reps: usize) -> std::io::Result<super::RawCopy> {
    let total = usize::try_from(total).map_err(|_| std::io::Error::other("raw copy larger than memory"))?;
    let src = vec![0x5Au8; total];
    let mut dst = vec![1u8; total];
    let mut runs = Vec::new();
    for &n in threads {
        if n == 0 {
            return Err(std::io::Error::other("a raw copy on 0 threads"));
        }
        let per = (total / n).max(1);
        let mut best = f64::MAX;
        for _ in 0..reps.max(1) {
            let go = std::sync::Barrier::new(n + 1);
            let secs = std::thread::scope(|scope| {
                // Each thread clocks its own copy (the main thread may run
                // only after the workers on a busy machine).
                let hs: Vec<_> = dst
                    .chunks_mut(per)
                    .zip(src.chunks(per))
                    .take(n)
                    .map(|(d, s)| {
                        let go = &go;
                        scope.spawn(move || {
                            go.wait();
                            let t = std::time::Instant::now();
                            d.copy_from_slice(s);
                            (t, std::time::Instant::now())
                        })
                    })
                    .collect();
                go.wait();
                let spans: Vec<_> = hs.into_iter().filter_map(|h| h.join().ok()).collect();
                match (spans.iter().map(|s| s.0).min(), spans.iter().map(|s| s.1).max()) {
                    (Some(a), Some(b)) => (b - a).as_secs_f64(),
                    _ => 0.0,
                }
            });
            best = best.min(secs);
        }
        runs.push(super::RawCopyRun { streams: n, bytes: (per * n).min(total) as u64, secs: best });
    }
    std::hint::black_box(&dst);
    Ok(super::RawCopy { runs })
}

// Real sockets, memfds and processes on the real tokio runtime: the
// simulator has none of them (the shared pool is unavailable there, see the
// module doc), so these tests are built where `cfg(real_os)` is (build.rs).
#[cfg(all(test, real_os))]
mod tests {
    use super::*;

    /// [`fetch_fd_and_owner`] without the owner's pidfd.
    fn fetch_fd(socket: &str, token: &[u8; TOKEN_BYTES], uid: u32, io: Duration) -> Result<OwnedFd, ShmError> {
        fetch_fd_and_owner(socket, token, uid, io).map(|(fd, _)| fd)
    }
    use crate::memory::pool::SealedExtent;
    use crate::transport::handshake::Region;

    const POOL: u64 = 8 << 20;

    fn node(port: u16) -> NodeAddr {
        NodeAddr::parse(&format!("127.0.0.1:{port}")).unwrap()
    }

    fn base(n: &NodeAddr, pool: &Pool) -> HandshakeMetadata {
        HandshakeMetadata {
            transport: TransportKind::Tcp,
            node: n.0.clone(),
            data_addr: "127.0.0.1:1".into(),
            regions: vec![Region { id: 0, base: 0, len: pool.arena_len(), rkey: 0 }],
            verbs: None,
            same_host: None,
        }
    }

    /// An owner or reader: a shared pool and its transport.
    struct Side {
        node: NodeAddr,
        pool: Pool,
        t: ShmTransport,
    }

    fn side(port: u16, cfg: ShmConfig) -> Side {
        side_of(port, POOL, cfg)
    }

    fn side_of(port: u16, pool_bytes: u64, cfg: ShmConfig) -> Side {
        let node = node(port);
        let pool = Pool::new_shared(pool_bytes, 256).unwrap();
        let t = ShmTransport::start(&pool, base(&node, &pool), 0, cfg).unwrap();
        Side { node, pool, t }
    }

    /// A sealed block of `len` bytes in `pool` holding `f(i)` at byte `i`.
    fn block(pool: &Pool, len: u64, f: impl Fn(usize) -> u8) -> SealedExtent {
        let mut e = pool.alloc(len).unwrap();
        for (i, b) in e.as_mut_slice().iter_mut().enumerate() {
            *b = f(i);
        }
        e.seal()
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// The owner's answer to the reader's offer.
    fn answer_for(owner: &Side, reader: &Side) -> HandshakeMetadata {
        owner.t.answer(&reader.node, &reader.t.local_metadata(), later()).unwrap()
    }

    async fn read_into(reader: &Side, owner: &NodeAddr, ops: Vec<ReadOp>, lens: &[u64]) -> ReadCompletion {
        let local: Vec<Extent> = lens.iter().map(|&l| reader.pool.alloc(l).unwrap()).collect();
        reader.t.read(owner, "session", ops, local, later()).await
    }

    fn op(remote_offset: u64, len: u64, local_extent: usize, local_offset: u64) -> ReadOp {
        ReadOp { region: 0, remote_offset, len, local_extent, local_offset }
    }

    #[test]
    fn grants_are_one_time_bounded_and_expire() {
        let mut g = Grants::default();
        let t0 = std::time::Instant::now();
        g.issue(&node(1), [1; 16], t0);
        g.issue(&node(2), [2; 16], t0);
        assert!(!g.redeem(&[3; 16], t0));
        assert!(g.redeem(&[1; 16], t0));
        assert!(!g.redeem(&[1; 16], t0), "one time");
        // A new grant for the same requester replaces its old one.
        g.issue(&node(2), [4; 16], t0);
        assert!(!g.redeem(&[2; 16], t0));
        // Expiry.
        let late = t0 + Duration::from_millis(limits::SHM_TOKEN_TTL_MS);
        assert!(!g.redeem(&[4; 16], late));
        // Bound: the oldest is forgotten.
        for i in 0..=limits::SHM_TOKENS_MAX {
            let mut t = [0u8; 16];
            t[..8].copy_from_slice(&(i as u64 + 10).to_le_bytes());
            g.issue(&node(i as u16 + 100), t, t0);
        }
        assert_eq!(g.list.len(), limits::SHM_TOKENS_MAX);
        let mut first = [0u8; 16];
        first[..8].copy_from_slice(&10u64.to_le_bytes());
        assert!(!g.redeem(&first, t0));
    }

    /// The whole path: offer, answer with a token, attach, read every byte
    /// (several extents and ops, a batch large enough for several copy
    /// threads); the token is one-time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn attach_and_read_every_byte() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let big = block(&owner.pool, 6 << 20, |i| (i * 31 + 7) as u8);
        let small = block(&owner.pool, 4096, |i| (i ^ 0x5A) as u8);
        let answer = answer_for(&owner, &reader);
        assert_ne!(answer.same_host.as_ref().unwrap().token, [0; 16]);
        assert_eq!(answer.same_host.as_ref().unwrap().socket, owner.t.socket_name());
        reader.t.attach(&owner.node, &answer, later()).await.unwrap();
        assert!(reader.t.is_attached(&owner.node));
        // The owner counts the descriptor after its send returns, which can
        // be after the reader already has it: wait for the count (bounded).
        let until = std::time::Instant::now() + Duration::from_secs(2);
        while owner.t.hooks.fds_sent.load(Ordering::Relaxed) == 0 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(owner.t.hooks.fds_sent.load(Ordering::Relaxed), 1);
        let ops = vec![
            op(big.offset(), 3 << 20, 0, 0),
            op(big.offset() + (3 << 20), 3 << 20, 0, 3 << 20),
            op(small.offset() + 96, 4000, 1, 0),
        ];
        let done = read_into(&reader, &owner.node, ops, &[6 << 20, 4000]).await;
        assert!(done.results.iter().all(Result::is_ok), "{:?}", done.results);
        assert_eq!(done.local[0].as_slice(), big.as_slice());
        assert_eq!(done.local[1].as_slice(), &small.as_slice()[96..]);
        assert_eq!(reader.t.hooks.bytes.load(Ordering::Relaxed), (6 << 20) + 4000);
        // The same token again: refused, counted, nothing new mapped.
        reader.t.disconnect(&owner.node);
        let again = reader.t.attach(&owner.node, &answer, later()).await;
        assert_eq!(again, Err(ShmError::Refused(Refusal::BadToken)));
        assert_eq!(owner.t.hooks.refused_token.load(Ordering::Relaxed), 1);
        assert!(!reader.t.is_attached(&owner.node));
    }

    /// `read_summed` hands back each extent's slot checksums, taken on the
    /// copy: equal to the CRC-32C of each slot of the bytes that landed,
    /// across copy pieces and ops (an extent filled by two ops, slots that
    /// straddle both); an extent whose ops do not fill it in order gets
    /// none, and plain `read` takes none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn read_summed_takes_each_slot_checksum_as_it_copies() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let len = 3 * crate::limits::READ_SUM_PIECE_BYTES as u64 + 12_345;
        let b = block(&owner.pool, len, |i| (i * 13 + 1) as u8);
        reader.t.attach(&owner.node, &answer_for(&owner, &reader), later()).await.unwrap();
        let ends = super::super::SlotEnds(vec![1000, len / 2 + 17, len].into());
        let want: Vec<u32> = [0..1000, 1000..len / 2 + 17, len / 2 + 17..len]
            .iter()
            .map(|r| crc32c::crc32c(&b.as_slice()[r.start as usize..r.end as usize]))
            .collect();
        let half = len / 3;
        let ops = vec![
            op(b.offset(), half, 0, 0),
            op(b.offset() + half, len - half, 0, half),
            // Extent 1 filled back to front: no sums.
            op(b.offset() + half, len - half, 1, half),
            op(b.offset(), half, 1, 0),
        ];
        let local: Vec<Extent> = (0..2).map(|_| reader.pool.alloc(len).unwrap()).collect();
        let done = reader.t.read_summed(&owner.node, "s", ops.clone(), local, Some(ends), later()).await;
        assert!(done.results.iter().all(Result::is_ok), "{:?}", done.results);
        assert_eq!(done.local[0].as_slice(), b.as_slice());
        assert_eq!(done.local[1].as_slice(), b.as_slice());
        assert_eq!(done.sums.len(), 2);
        assert_eq!(done.sums[0].as_deref(), Some(&want[..]));
        assert_eq!(done.sums[1], None, "out-of-order ops cannot be summed as they land");
        let local: Vec<Extent> = (0..2).map(|_| reader.pool.alloc(len).unwrap()).collect();
        assert!(reader.t.read(&owner.node, "s", ops, local, later()).await.sums.is_empty());
    }

    /// Refusals before any socket: another host, no section, no token, a
    /// missing region; the owner issues no token to another host.
    #[tokio::test]
    async fn refuses_other_hosts_and_missing_tokens() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let mut offer = reader.t.local_metadata();
        offer.same_host.as_mut().unwrap().host_id = "another-boot/net:[1]".into();
        assert_eq!(owner.t.answer_section(&reader.node, &offer), None);
        assert_eq!(owner.t.hooks.tokens_issued.load(Ordering::Relaxed), 0);
        let mut ans = answer_for(&owner, &reader);
        ans.same_host.as_mut().unwrap().host_id = "another-boot/net:[1]".into();
        assert!(matches!(reader.t.attach(&owner.node, &ans, later()).await, Err(ShmError::NotSameHost { .. })));
        let mut ans = answer_for(&owner, &reader);
        ans.same_host = None;
        assert_eq!(reader.t.attach(&owner.node, &ans, later()).await, Err(ShmError::NoSection));
        let mut ans = answer_for(&owner, &reader);
        ans.same_host.as_mut().unwrap().token = [0; 16];
        assert_eq!(reader.t.attach(&owner.node, &ans, later()).await, Err(ShmError::NoToken));
        let mut ans = answer_for(&owner, &reader);
        ans.same_host.as_mut().unwrap().region = 9;
        assert_eq!(reader.t.attach(&owner.node, &ans, later()).await, Err(ShmError::NoRegion(9)));
        // A wrong token (right host): refused by the owner.
        let mut ans = answer_for(&owner, &reader);
        ans.same_host.as_mut().unwrap().token = [7; 16];
        assert_eq!(reader.t.attach(&owner.node, &ans, later()).await, Err(ShmError::Refused(Refusal::BadToken)));
        // A passed deadline.
        let ans = answer_for(&owner, &reader);
        assert_eq!(reader.t.attach(&owner.node, &ans, Instant::now()).await, Err(ShmError::Timeout));
        assert_eq!(reader.t.attached_peers(), 0);
    }

    /// Peer credentials, both ways: an owner trusting another uid refuses
    /// us (counted); a reader trusting another uid refuses the owner.
    #[tokio::test]
    async fn refuses_other_users_both_ways() {
        let other = ShmConfig { trusted_uid: our_uid().wrapping_add(1), ..ShmConfig::default() };
        let owner = side(1, other.clone());
        let reader = side(2, ShmConfig::default());
        let ans = answer_for(&owner, &reader);
        assert_eq!(reader.t.attach(&owner.node, &ans, later()).await, Err(ShmError::Refused(Refusal::WrongUid)));
        assert_eq!(owner.t.hooks.refused_uid.load(Ordering::Relaxed), 1);
        let owner = side(3, ShmConfig::default());
        let reader = side(4, other);
        let ans = answer_for(&owner, &reader);
        let got = reader.t.attach(&owner.node, &ans, later()).await;
        assert_eq!(got, Err(ShmError::WrongUid { ours: our_uid().wrapping_add(1), theirs: our_uid() }));
        assert_eq!(owner.t.hooks.fds_sent.load(Ordering::Relaxed), 0, "no fd before the uid check");
        assert_eq!(reader.t.attached_peers(), 0);
    }

    fn memfd(len: u64, seals: libc::c_int) -> OwnedFd {
        // SAFETY: plain syscalls on a fresh descriptor.
        unsafe {
            let fd = libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            if seals != 0 {
                assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, seals), 0);
            }
            OwnedFd::from_raw_fd(fd)
        }
    }

    /// The reader maps only a file sealed against shrinking, of exactly the
    /// advertised size.
    #[test]
    fn maps_only_sealed_files_of_the_advertised_size() {
        assert!(matches!(map_received(memfd(1 << 20, 0), 1 << 20, 0), Err(ShmError::Unsealed(_))));
        assert!(matches!(map_received(memfd(1 << 20, libc::F_SEAL_GROW), 1 << 20, 0), Err(ShmError::Unsealed(_))));
        assert_eq!(
            map_received(memfd(1 << 20, libc::F_SEAL_SHRINK), 2 << 20, 0).err(),
            Some(ShmError::SizeMismatch { advertised: 2 << 20, actual: 1 << 20 })
        );
        let m = map_received(memfd(1 << 20, libc::F_SEAL_SHRINK), 1 << 20, 0).unwrap();
        assert_eq!(m.len, 1 << 20);
    }

    /// The descriptor a reader receives cannot be mapped writable, not even
    /// after reopening it read-write.
    #[tokio::test]
    async fn received_fd_cannot_be_mapped_writable() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let ans = answer_for(&owner, &reader);
        let h = ans.same_host.unwrap();
        let fd = fetch_fd(&h.socket, &h.token, our_uid(), Duration::from_secs(2)).unwrap();
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: mapping attempts that must fail (and unmapped if not).
        let try_map = |fd: RawFd| unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 4096, rw, libc::MAP_SHARED, fd, 0);
            if p != libc::MAP_FAILED {
                libc::munmap(p, 4096);
            }
            p != libc::MAP_FAILED
        };
        assert!(!try_map(fd.as_raw_fd()), "a read-only descriptor maps writable");
        // SAFETY: fcntl on a live descriptor.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals & libc::F_SEAL_FUTURE_WRITE != 0 {
            let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
            // SAFETY: a NUL-terminated path.
            let rw_fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
            if rw_fd >= 0 {
                // SAFETY: a descriptor we own.
                let rw_fd = unsafe { OwnedFd::from_raw_fd(rw_fd) };
                assert!(!try_map(rw_fd.as_raw_fd()), "reopened read-write, it maps writable");
            }
        }
    }

    /// An op outside the mapping fails the whole batch, and nothing is
    /// written into any local extent.
    #[tokio::test]
    async fn out_of_range_reads_fail_and_read_nothing() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let b = block(&owner.pool, 4096, |_| 0xAB);
        reader.t.attach(&owner.node, &answer_for(&owner, &reader), later()).await.unwrap();
        let end = owner.pool.arena_len();
        for bad in
            [op(end - 100, 200, 1, 0), op(u64::MAX - 10, 100, 1, 0), ReadOp { region: 3, ..op(b.offset(), 100, 1, 0) }]
        {
            let ops = vec![op(b.offset(), 4096, 0, 0), bad];
            let local: Vec<Extent> = (0..2)
                .map(|_| {
                    let mut e = reader.pool.alloc(4096).unwrap();
                    e.as_mut_slice().fill(0xEE);
                    e
                })
                .collect();
            let done = reader.t.read(&owner.node, "s", ops, local, later()).await;
            assert!(done.results.iter().all(|r| matches!(r, Err(TransportError::BadOp(_)))), "{:?}", done.results);
            assert!(done.local.iter().all(|e| e.as_slice().iter().all(|&x| x == 0xEE)), "nothing read");
        }
        // Not attached, or past the deadline.
        let local = vec![reader.pool.alloc(4096).unwrap()];
        let done = reader.t.read(&node(9), "s", vec![op(b.offset(), 4096, 0, 0)], local, later()).await;
        assert!(matches!(done.results[0], Err(TransportError::NotConnected(_))));
        let local = vec![reader.pool.alloc(4096).unwrap()];
        let done = reader.t.read(&owner.node, "s", vec![op(b.offset(), 4096, 0, 0)], local, Instant::now()).await;
        assert_eq!(done.results[0], Err(TransportError::Timeout));
    }

    /// An owner that goes away (its transport, pool and every extent
    /// dropped) leaves the reader's mapping valid: reads still complete,
    /// with the bytes last written, and nothing crashes or hangs. A new
    /// attach then fails (the socket is gone) with a clear error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn owner_gone_mid_life_neither_crashes_nor_hangs_the_reader() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let b = block(&owner.pool, 1 << 20, |i| (i % 251) as u8);
        let (off, want) = (b.offset(), b.as_slice().to_vec());
        reader.t.attach(&owner.node, &answer_for(&owner, &reader), later()).await.unwrap();
        let spare = answer_for(&owner, &reader);
        let owner_node = owner.node.clone();
        drop(b);
        drop(owner);
        let done = read_into(&reader, &owner_node, vec![op(off, 1 << 20, 0, 0)], &[1 << 20]).await;
        assert_eq!(done.results, vec![Ok(())]);
        assert_eq!(done.local[0].as_slice(), &want[..]);
        let again = tokio::time::timeout(Duration::from_secs(5), reader.t.attach(&owner_node, &spare, later())).await;
        assert!(matches!(again, Ok(Err(ShmError::Io(_)))), "{again:?}");
    }

    /// After `shutdown` no token is issued and the socket refuses.
    #[tokio::test]
    async fn shutdown_stops_serving() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let ans = answer_for(&owner, &reader);
        owner.t.shutdown();
        assert_eq!(owner.t.answer_section(&reader.node, &reader.t.local_metadata()), None);
        let got = tokio::time::timeout(Duration::from_secs(5), reader.t.attach(&owner.node, &ans, later())).await;
        assert!(matches!(got, Ok(Err(_))), "{got:?}");
        assert_eq!(owner.t.hooks.fds_sent.load(Ordering::Relaxed), 0);
    }

    /// Connections beyond the in-flight bound are closed at once and
    /// counted; a malformed request is refused.
    #[test]
    fn bounds_connections_and_refuses_malformed_requests() {
        let owner = side(1, ShmConfig::default());
        let addr = SocketAddr::from_abstract_name(owner.t.socket_name().as_bytes()).unwrap();
        let held: Vec<UnixStream> =
            (0..limits::SHM_CONNECTIONS_IN_FLIGHT_MAX).map(|_| UnixStream::connect_addr(&addr).unwrap()).collect();
        let t0 = std::time::Instant::now();
        while owner.t.hooks.refused_busy.load(Ordering::Relaxed) == 0 {
            let mut extra = UnixStream::connect_addr(&addr).unwrap();
            extra.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = [0u8; 1];
            let _ = extra.read(&mut buf);
            assert!(t0.elapsed() < Duration::from_secs(limits::SHM_SOCKET_IO_MS / 1000 + 10), "never refused");
        }
        drop(held);
        // Malformed: wrong magic, once the slots are free again.
        let t0 = std::time::Instant::now();
        loop {
            let mut s = UnixStream::connect_addr(&addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            // A connection still refused busy (its slot not yet freed) is
            // closed at once: the write or the read fails, and it is tried
            // again.
            let mut a = [0u8; ANSWER_BYTES];
            if s.write_all(&[0u8; REQUEST_BYTES]).is_ok() && s.read_exact(&mut a).is_ok() {
                assert_eq!(a[4], Refusal::BadRequest as u8);
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(owner.t.hooks.refused_request.load(Ordering::Relaxed) >= 1);
    }

    /// An owner process that exited: the next read drops the mapping and
    /// fails (the composite then reads over TCP), before copying anything.
    #[tokio::test]
    async fn an_exited_owner_process_drops_the_mapping() {
        let owner = side(1, ShmConfig::default());
        let reader = side(2, ShmConfig::default());
        let b = block(&owner.pool, 4096, |_| 0x11);
        reader.t.attach(&owner.node, &answer_for(&owner, &reader), later()).await.unwrap();
        // In-process owner: watched by a pidfd of this process, never exited.
        let own = reader.t.peers.lock().unwrap().get(&owner.node).unwrap().owner.is_some();
        let done = read_into(&reader, &owner.node, vec![op(b.offset(), 4096, 0, 0)], &[4096]).await;
        assert_eq!(done.results, vec![Ok(())]);
        // Stand in another process for the owner, then let it exit.
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let Some(pidfd) = pidfd_of(child.id() as libc::pid_t) else {
            assert!(!own, "pidfds on one call and not the other");
            let _ = child.kill();
            let _ = child.wait();
            return; // a kernel without pidfds: nothing watched
        };
        {
            let mut peers = reader.t.peers.lock().unwrap();
            let m = peers.get_mut(&owner.node).unwrap();
            Arc::get_mut(m).unwrap().owner = Some(pidfd);
        }
        let done = read_into(&reader, &owner.node, vec![op(b.offset(), 4096, 0, 0)], &[4096]).await;
        assert_eq!(done.results, vec![Ok(())], "alive: read");
        child.kill().unwrap();
        child.wait().unwrap();
        let mut local = vec![reader.pool.alloc(4096).unwrap()];
        local[0].as_mut_slice().fill(0xEE);
        let done = reader.t.read(&owner.node, "s", vec![op(b.offset(), 4096, 0, 0)], local, later()).await;
        assert!(matches!(done.results[0], Err(TransportError::Io(_))), "{:?}", done.results);
        assert!(done.local[0].as_slice().iter().all(|&x| x == 0xEE), "nothing read");
        assert!(!reader.t.is_attached(&owner.node), "the mapping is dropped");
    }

    /// Host identity: boot id and net namespace, printable, bounded.
    #[test]
    fn host_identity_is_boot_id_and_net_namespace() {
        let id = host_identity().expect("Linux has both");
        assert!(id.contains("/net:["), "{id}");
        assert!(id.len() <= limits::HOST_ID_BYTES_MAX);
        assert_eq!(host_identity(), Some(id));
    }

    /// Rates on this machine (run by hand: `cargo test --lib
    /// shm_read_rate -- --ignored --nocapture`): a plain `memcpy` of 256 MiB
    /// between two buffers, and a shared-pool read of the same bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement, not a test"]
    async fn shm_read_rate() {
        const N: u64 = 256 << 20;
        let owner = side_of(1, N + (1 << 20), ShmConfig::default());
        let reader = side_of(2, N + (1 << 20), ShmConfig::default());
        reader.pool.prefault().unwrap();
        let b = block(&owner.pool, N, |i| i as u8);
        reader.t.attach(&owner.node, &answer_for(&owner, &reader), later()).await.unwrap();
        let src = vec![1u8; N as usize];
        let mut dst = vec![0u8; N as usize];
        dst.copy_from_slice(&src);
        for _ in 0..3 {
            let t = std::time::Instant::now();
            dst.copy_from_slice(&src);
            let memcpy = N as f64 / t.elapsed().as_secs_f64() / 1e9;
            let parts = 64u64;
            let ops: Vec<ReadOp> =
                (0..parts).map(|i| op(b.offset() + i * (N / parts), N / parts, i as usize, 0)).collect();
            let local: Vec<Extent> = (0..parts).map(|_| reader.pool.alloc(N / parts).unwrap()).collect();
            let t = std::time::Instant::now();
            let done = reader.t.read(&owner.node, "s", ops, local, later()).await;
            let shm = N as f64 / t.elapsed().as_secs_f64() / 1e9;
            assert!(done.results.iter().all(Result::is_ok));
            drop(done);
            // The same copy from the mapping on this thread alone.
            let map = reader.t.peers.lock().unwrap().get(&owner.node).unwrap().clone();
            let mut one = reader.pool.alloc(N).unwrap();
            let t = std::time::Instant::now();
            copy_ops(&map, &mut one, &[op(b.offset(), N, 0, 0)], None);
            let mapped = N as f64 / t.elapsed().as_secs_f64() / 1e9;
            drop(one);
            // The read again, right after.
            let ops: Vec<ReadOp> =
                (0..parts).map(|i| op(b.offset() + i * (N / parts), N / parts, i as usize, 0)).collect();
            let local: Vec<Extent> = (0..parts).map(|_| reader.pool.alloc(N / parts).unwrap()).collect();
            let t = std::time::Instant::now();
            let done = reader.t.read(&owner.node, "s", ops, local, later()).await;
            let shm2 = N as f64 / t.elapsed().as_secs_f64() / 1e9;
            drop(done);
            println!("  shm read again {shm2:.2} GB/s");
            println!(
                "memcpy 1 thread {memcpy:.2} GB/s, from the mapping 1 thread {mapped:.2} GB/s, shm read {shm:.2} GB/s ({} cores)",
                crate::rt::cpu_parallelism()
            );
        }
    }
}
