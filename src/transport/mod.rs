//! The `Transport` door: one-sided READ of a peer's registered memory, shaped
//! like RDMA verbs — register regions once at start, exchange versioned
//! handshake metadata, post a batch of reads, get a completion that hands
//! the local buffers back.
//!
//! # Failure contract
//! - [`Transport::read`] takes ownership of the local extents and its
//!   [`ReadCompletion`] returns every one of them with a per-extent result.
//!   A deadline or a peer failure fails the affected extents; it never frees
//!   a buffer a read may still write into (C11): backends with DMA (verbs)
//!   keep the extents until the hardware completion arrives.
//! - An extent whose result is `Ok` holds exactly the bytes the peer served
//!   (integrity is still checked by the caller against the seal-time
//!   checksums, C10).
//! - Any error on a connection invalidates that connection; the next read
//!   reconnects. [`Transport::disconnect`] forgets a peer entirely so the next
//!   handshake starts clean.
//! - The serving side authorizes every read against the transfer session it
//!   names (C13) through a [`DataSource`]; anything else is an error reply
//!   and the server stays healthy.
//!
//! Backends: [`tcp`] (embedded default, real sockets), [`shm`] (a same-host
//! owner's pool, shared read-only through a sealed memfd; Linux), [`path`]
//! (the composite that picks shm or tcp per owner and falls back), [`sim`] (the simulator:
//! the TCP backend over madsim's network, with typed handles on its fault
//! seam) and [`verbs`] (RDMA READ over RC queue pairs; its device
//! code is behind the `rdma` feature).

pub mod frame;
pub mod handshake;
pub mod path;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod sim;
pub mod tcp;
pub mod verbs;

use async_trait::async_trait;
use tokio::time::Instant;

pub use handshake::{HandshakeMetadata, Region, TransportKind};

use crate::memory::pool::{Extent, SealedExtent};
use crate::types::NodeAddr;

/// Why a data-plane read was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No such session (never existed, released or expired).
    #[error("unknown transfer session")]
    UnknownSession,
    /// The id was not issued by this incarnation of the engine: another
    /// node's, or an earlier process's on the same address (C16). Refused
    /// before the table is looked at.
    #[error("transfer session issued by another node or incarnation")]
    ForeignSession,
    /// The range is not inside one block of the session.
    #[error("range [{offset}, +{len}) of region {region} is not inside a block locked by this session")]
    OutOfRange {
        /// Region id.
        region: u32,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
    },
}

/// The serving side's access policy and memory: authorizes a read under a
/// transfer session and returns the block extent (a clone that pins the
/// memory while the bytes are sent) with the range's offset inside it.
pub trait DataSource: Send + Sync + 'static {
    /// See the trait doc.
    ///
    /// # Errors
    /// [`AccessError`] for an unknown session or an out-of-range read.
    fn authorize(&self, session: &str, region: u32, offset: u64, len: u64) -> Result<(SealedExtent, u64), AccessError>;
}

/// One remote read: `len` bytes at `(region, remote_offset)` on the peer into
/// `local[local_extent][local_offset..]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadOp {
    /// Peer region id (from its handshake metadata).
    pub region: u32,
    /// Offset in that region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
    /// Index of the local extent.
    pub local_extent: usize,
    /// Offset inside the local extent.
    pub local_offset: u64,
}

/// Transport errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// Could not reach the peer's data plane.
    #[error("connect to {addr} failed: {reason}")]
    Connect {
        /// Data-plane address.
        addr: String,
        /// OS error text.
        reason: String,
    },
    /// The peer's metadata is unusable for this backend.
    #[error("handshake rejected: {0}")]
    Handshake(String),
    /// No handshake happened with this peer.
    #[error("not connected to {0}")]
    NotConnected(String),
    /// The peer refused the read.
    #[error("peer refused read: {status} ({message})")]
    Refused {
        /// Frame status name.
        status: String,
        /// Peer's message.
        message: String,
    },
    /// I/O error mid-read (peer died, connection reset).
    #[error("i/o error: {0}")]
    Io(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The deadline passed.
    #[error("read deadline passed")]
    Timeout,
    /// The read batch itself is malformed (local ranges).
    #[error("bad read op: {0}")]
    BadOp(String),
}

/// Completion of a read batch: every local extent, each with its result.
pub struct ReadCompletion {
    /// The local extents, in the order given.
    pub local: Vec<Extent>,
    /// Per extent: `Ok` when all its ops landed.
    pub results: Vec<Result<(), TransportError>>,
}

impl ReadCompletion {
    /// Every extent of `local` handed back failed with `e` (nothing was read).
    pub fn all_failed(local: Vec<Extent>, e: TransportError) -> Self {
        Self { results: vec![Err(e); local.len()], local }
    }
}

/// The transport trait. See the module doc for the failure contract.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Backend kind.
    fn kind(&self) -> TransportKind;

    /// Metadata describing this node's data plane (regions registered at
    /// start), sent in the handshake.
    fn local_metadata(&self) -> HandshakeMetadata;

    /// Prepares reads from `peer` described by `remote` (validate, open
    /// connections / queue pairs), bounded by `deadline`.
    ///
    /// # Errors
    /// [`TransportError::Handshake`] / [`TransportError::Connect`] /
    /// [`TransportError::Timeout`].
    async fn connect(
        &self,
        peer: &NodeAddr,
        remote: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// The serving side of a handshake: the metadata to answer `requester`
    /// with, given its offer. Backends that need per-peer state on the
    /// serving side (verbs: queue pairs connected to the requester's) build
    /// it here; the default answers with [`Transport::local_metadata`].
    ///
    /// # Errors
    /// [`TransportError::Handshake`] when the offer cannot be served.
    fn answer(
        &self,
        _requester: &NodeAddr,
        _offer: &HandshakeMetadata,
        _deadline: Instant,
    ) -> Result<HandshakeMetadata, TransportError> {
        Ok(self.local_metadata())
    }

    /// Forgets a peer (connections, metadata).
    fn disconnect(&self, peer: &NodeAddr);

    /// Posts a batch of reads from `peer` under transfer session `session`.
    async fn read(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        deadline: Instant,
    ) -> ReadCompletion;

    /// Whether `peer` proved it runs on this host as this user (the shared
    /// pool's credential-checked local socket: it redeemed a token this
    /// node issued to it). Device handles go only to such peers (C19).
    /// Default: never.
    fn proven_same_host(&self, peer: &NodeAddr) -> bool {
        let _ = peer;
        false
    }
}

/// One stream count's result of a raw-copy baseline
/// ([`tcp::raw_loopback_copy`], [`shm::raw_memcpy`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawCopyRun {
    /// Parallel streams: TCP connections (each its own sender and receiver
    /// thread) or copying threads.
    pub streams: usize,
    /// Bytes moved in all (`total / streams * streams`).
    pub bytes: u64,
    /// The fastest of the repetitions: first byte copied to last byte
    /// landed, connections open and memory touched before (seconds).
    pub secs: f64,
}

impl RawCopyRun {
    /// Rate in GB/s (10^9 B/s).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9) / 1e9
    }
}

/// A raw-copy baseline's answer: every stream count tried, and the best.
#[derive(Debug, Clone, PartialEq)]
pub struct RawCopy {
    /// Per stream count, in the order tried.
    pub runs: Vec<RawCopyRun>,
}

impl RawCopy {
    /// The fastest count (the baseline's denominator); `None` when no
    /// count was tried.
    pub fn best(&self) -> Option<RawCopyRun> {
        self.runs.iter().copied().max_by(|a, b| a.gbps().total_cmp(&b.gbps()))
    }
}

/// Validates that every op lands inside its local extent.
///
/// # Errors
/// [`TransportError::BadOp`].
pub fn validate_local(ops: &[ReadOp], local: &[Extent]) -> Result<(), TransportError> {
    for op in ops {
        let ext = local
            .get(op.local_extent)
            .ok_or_else(|| TransportError::BadOp(format!("local extent {} of {}", op.local_extent, local.len())))?;
        match op.local_offset.checked_add(op.len) {
            Some(end) if end <= ext.len() && op.len > 0 => {}
            _ => {
                return Err(TransportError::BadOp(format!(
                    "[{}, +{}) outside local extent of {}",
                    op.local_offset,
                    op.len,
                    ext.len()
                )));
            }
        }
    }
    Ok(())
}
