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

use std::sync::Arc;

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

impl AccessError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            AccessError::UnknownSession => "access_unknown_session",
            AccessError::ForeignSession => "access_foreign_session",
            AccessError::OutOfRange { .. } => "access_out_of_range",
        }
    }
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

/// An OS-level failure: the [`std::io::ErrorKind`] (the cause, matchable)
/// and the text the OS or the runtime gave (free text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct IoFailure {
    /// The kind of the failure (`ConnectionRefused`, `ConnectionReset`,
    /// `UnexpectedEof`, …).
    pub kind: std::io::ErrorKind,
    /// The text that came with it.
    pub message: String,
}

impl IoFailure {
    /// A failure of `kind` with `message` (for failures kvferry detects
    /// itself: a connection lost earlier in a batch, an owner that exited).
    pub fn new(kind: std::io::ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }
}

impl From<&std::io::Error> for IoFailure {
    fn from(e: &std::io::Error) -> Self {
        Self { kind: e.kind(), message: e.to_string() }
    }
}

impl From<std::io::Error> for IoFailure {
    fn from(e: std::io::Error) -> Self {
        Self::from(&e)
    }
}

/// A backend's own error carried through the [`Transport`] door: the
/// backend error's stable code (`ShmError::code`, `PlanError::code`) and
/// its text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendFailure {
    /// The backend error's stable code (`shm_*`, `verbs_plan_*`).
    pub code: &'static str,
    /// Its text.
    pub message: String,
}

/// Why a backend rejected a peer's handshake metadata or could not set up
/// its side of the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeRejected {
    /// The peer speaks another backend.
    #[error("peer speaks {theirs:?}, we speak {ours:?}")]
    KindMismatch {
        /// This backend.
        ours: TransportKind,
        /// The peer's.
        theirs: TransportKind,
    },
    /// The peer's metadata names no data-plane address.
    #[error("peer sent no data-plane address")]
    NoDataAddress,
    /// The shared-pool path could not be set up (a `shm::ShmError`).
    #[error("shared pool: {0}")]
    SharedPool(BackendFailure),
    /// The shared-pool path was forced and this node has none.
    #[error("shared pool forced, but this node has none")]
    NoSharedPool,
    /// The verbs plan refused the peer's offer or answer (a
    /// `verbs::plan::PlanError`).
    #[error(transparent)]
    Plan(BackendFailure),
    /// A verbs call failed (the verbs library's text).
    #[error("verbs: {0}")]
    Verbs(String),
    /// A verbs answer matches no offer this node made.
    #[error(
        "the answer's PSN {psn:#x} matches no pending offer (expired, or the peer did not answer with \
         VerbsTransport::accept)"
    )]
    NoPendingOffer {
        /// The answer's packet sequence number.
        psn: u32,
    },
    /// Our own metadata could not be encoded.
    #[error(transparent)]
    Metadata(#[from] handshake::HandshakeError),
}

impl HandshakeRejected {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            HandshakeRejected::KindMismatch { .. } => "transport_handshake_kind_mismatch",
            HandshakeRejected::NoDataAddress => "transport_handshake_no_data_address",
            HandshakeRejected::SharedPool(_) => "transport_handshake_shared_pool",
            HandshakeRejected::NoSharedPool => "transport_handshake_no_shared_pool",
            HandshakeRejected::Plan(_) => "transport_handshake_plan",
            HandshakeRejected::Verbs(_) => "transport_handshake_verbs",
            HandshakeRejected::NoPendingOffer { .. } => "transport_handshake_no_pending_offer",
            HandshakeRejected::Metadata(_) => "transport_handshake_metadata",
        }
    }
}

/// Why a read is not connected to its peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotConnected {
    /// No handshake happened with this peer (or it was forgotten).
    #[error("not connected to {0}")]
    Peer(String),
    /// The fetch holds no transfer session to read under.
    #[error("not connected: no transfer session")]
    NoSession,
    /// An earlier error invalidated the connection (verbs).
    #[error("not connected: connection invalidated by an earlier error")]
    Invalidated,
    /// An earlier error destroyed the queue pair (verbs).
    #[error("not connected: queue pair destroyed by an earlier error")]
    QueuePairDestroyed,
}

impl NotConnected {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            NotConnected::Peer(_) => "transport_not_connected_peer",
            NotConnected::NoSession => "transport_not_connected_no_session",
            NotConnected::Invalidated => "transport_not_connected_invalidated",
            NotConnected::QueuePairDestroyed => "transport_not_connected_queue_pair_destroyed",
        }
    }
}

/// How a peer broke the data-plane protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolViolation {
    /// The stream ended inside a response header.
    #[error("short response header")]
    ShortHeader,
    /// A malformed response frame.
    #[error(transparent)]
    Frame(#[from] frame::FrameError),
    /// A response for another request than the one expected.
    #[error("response for request {got} while expecting {want}")]
    OutOfOrder {
        /// The response's request id.
        got: u64,
        /// The id expected.
        want: u64,
    },
    /// A response of another length than the read asked for.
    #[error("served {served} bytes for a read of {asked}")]
    WrongLength {
        /// Bytes the peer announced.
        served: u64,
        /// Bytes asked for.
        asked: u64,
    },
}

impl ProtocolViolation {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ProtocolViolation::ShortHeader => "transport_protocol_short_header",
            ProtocolViolation::Frame(_) => "transport_protocol_frame",
            ProtocolViolation::OutOfOrder { .. } => "transport_protocol_out_of_order",
            ProtocolViolation::WrongLength { .. } => "transport_protocol_wrong_length",
        }
    }
}

/// Why a read batch is malformed on the local side (nothing was read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadOp {
    /// An op names a local extent the batch does not have.
    #[error("local extent {index} of {extents}")]
    NoExtent {
        /// The index named.
        index: usize,
        /// Extents in the batch.
        extents: usize,
    },
    /// An op's range is empty or leaves its local extent.
    #[error("[{offset}, +{len}) outside local extent of {extent_len}")]
    OutsideExtent {
        /// Offset in the extent.
        offset: u64,
        /// Length.
        len: u64,
        /// The extent's length.
        extent_len: u64,
    },
    /// An op reads more than one frame may carry.
    #[error("read of {len} bytes over the frame limit")]
    OverFrameLimit {
        /// Bytes asked for.
        len: u64,
    },
    /// The request could not be framed (a malformed session id, from a peer).
    #[error(transparent)]
    Frame(frame::FrameError),
    /// An op's remote range is outside the peer's shared pool.
    #[error("[{offset}, +{len}) of region {region} outside the shared pool ({pool_len} bytes, region {pool_region})")]
    OutsideSharedPool {
        /// Remote offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region named.
        region: u32,
        /// The mapping's length.
        pool_len: u64,
        /// The mapping's region.
        pool_region: u32,
    },
    /// A local extent is not in the registered pool (verbs).
    #[error("local extent {0} is not in the registered pool")]
    NotRegistered(usize),
    /// The verbs plan refused the batch (a `verbs::plan::PlanError`).
    #[error(transparent)]
    Plan(BackendFailure),
}

impl BadOp {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            BadOp::NoExtent { .. } => "transport_bad_op_no_extent",
            BadOp::OutsideExtent { .. } => "transport_bad_op_outside_extent",
            BadOp::OverFrameLimit { .. } => "transport_bad_op_over_frame_limit",
            BadOp::Frame(_) => "transport_bad_op_frame",
            BadOp::OutsideSharedPool { .. } => "transport_bad_op_outside_shared_pool",
            BadOp::NotRegistered(_) => "transport_bad_op_not_registered",
            BadOp::Plan(_) => "transport_bad_op_plan",
        }
    }
}

/// Transport errors. Every variant carries a typed cause; [`Self::code`]
/// names the variant stably.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// Could not reach the peer's data plane.
    #[error("connect to {addr} failed: {cause}")]
    Connect {
        /// Data-plane address.
        addr: String,
        /// The OS's failure.
        cause: IoFailure,
    },
    /// The peer's metadata is unusable for this backend.
    #[error("handshake rejected: {0}")]
    Handshake(HandshakeRejected),
    /// No usable connection to this peer.
    #[error("{0}")]
    NotConnected(NotConnected),
    /// The peer refused the read.
    #[error("peer refused read: {status:?} ({message})")]
    Refused {
        /// The response frame's status.
        status: frame::Status,
        /// Peer's message.
        message: String,
    },
    /// I/O error mid-read (peer died, connection reset).
    #[error("i/o error: {0}")]
    Io(IoFailure),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(ProtocolViolation),
    /// The deadline passed.
    #[error("read deadline passed")]
    Timeout,
    /// The read batch itself is malformed (local ranges).
    #[error("bad read op: {0}")]
    BadOp(BadOp),
}

impl TransportError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            TransportError::Connect { .. } => "transport_connect",
            TransportError::Handshake(_) => "transport_handshake",
            TransportError::NotConnected(_) => "transport_not_connected",
            TransportError::Refused { .. } => "transport_refused",
            TransportError::Io(_) => "transport_io",
            TransportError::Protocol(_) => "transport_protocol",
            TransportError::Timeout => "transport_timeout",
            TransportError::BadOp(_) => "transport_bad_op",
        }
    }

    /// An I/O error of `kind` that kvferry detected itself.
    pub fn io(kind: std::io::ErrorKind, message: impl Into<String>) -> Self {
        TransportError::Io(IoFailure::new(kind, message))
    }
}

impl From<std::io::Error> for TransportError {
    fn from(e: std::io::Error) -> Self {
        TransportError::Io(IoFailure::from(e))
    }
}

/// Completion of a read batch: every local extent, each with its result.
pub struct ReadCompletion {
    /// The local extents, in the order given.
    pub local: Vec<Extent>,
    /// Per extent: `Ok` when all its ops landed.
    pub results: Vec<Result<(), TransportError>>,
    /// Per extent, from [`Transport::read_summed`] where the transport
    /// took them: the CRC-32C of each slot of the bytes as they landed in
    /// the extent (`None` for an extent it could not sum: a failed read,
    /// ops that did not fill it in order). Empty after a plain read
    /// ([`Transport::read`], or `read_summed` without slot ends) and from a
    /// transport that never sums.
    pub sums: Vec<Option<Arc<[u32]>>>,
}

impl ReadCompletion {
    /// Every extent of `local` handed back failed with `e` (nothing was read).
    pub fn all_failed(local: Vec<Extent>, e: TransportError) -> Self {
        Self { results: vec![Err(e); local.len()], local, sums: Vec::new() }
    }

    /// The extents with their results, no sums.
    pub fn unsummed(local: Vec<Extent>, results: Vec<Result<(), TransportError>>) -> Self {
        Self { local, results, sums: Vec::new() }
    }
}

/// The checksum layout of every extent of a read batch: where each slot
/// ends (bytes from the extent's start, ascending; slot `i` spans
/// `ends[i - 1]..ends[i]`, the first from 0) — a block's layer slots,
/// concatenated. A transport that takes sums as bytes land
/// ([`Transport::read_summed`]) computes one CRC-32C per slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotEnds(pub Arc<[u64]>);

/// The running CRC-32C of one extent's slots as its bytes land, in order
/// from offset 0 ([`SlotEnds`]). Bytes that land anywhere but where the
/// last ones ended break the run: the extent then has no sums and is
/// checked by a separate pass.
///
/// The checksum is taken while the bytes are still in cache (the
/// transport sums each piece right after it landed), instead of a pass
/// that reads the whole part again from memory after the read: on the
/// H200 host T4 0.72–0.79 with that pass against 0.83–0.92 summed as the
/// bytes land, alternating in one lease (`bench transport`, 1 GiB;
/// `docs/BENCHMARKS.md`).
#[derive(Debug)]
pub(crate) struct SlotSummer<'a> {
    ends: &'a [u64],
    at: u64,
    slot: usize,
    crc: u32,
    sums: Vec<u32>,
    broken: bool,
}

impl<'a> SlotSummer<'a> {
    pub(crate) fn new(ends: &'a SlotEnds) -> Self {
        Self { ends: &ends.0, at: 0, slot: 0, crc: 0, sums: Vec::with_capacity(ends.0.len()), broken: false }
    }

    /// `bytes` landed at extent offset `at`.
    pub(crate) fn landed(&mut self, at: u64, mut bytes: &[u8]) {
        if self.broken || at != self.at {
            self.broken = true;
            return;
        }
        while !bytes.is_empty() {
            let Some(&end) = self.ends.get(self.slot) else {
                self.broken = true; // past the last slot
                return;
            };
            let take = usize::try_from(end.saturating_sub(self.at)).unwrap_or(usize::MAX).min(bytes.len());
            self.crc = crc32c::crc32c_append(self.crc, &bytes[..take]);
            self.at += take as u64;
            bytes = &bytes[take..];
            if self.at == end {
                self.sums.push(self.crc);
                self.crc = 0;
                self.slot += 1;
            }
        }
    }

    /// Every slot's CRC-32C, if the bytes covered them all in order.
    pub(crate) fn finish(self) -> Option<Arc<[u32]>> {
        (!self.broken && self.slot == self.ends.len()).then(|| self.sums.into())
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

    /// As [`read`](Self::read), and with `ends`, where the transport can,
    /// takes each extent's slot checksums as the bytes land
    /// ([`ReadCompletion::sums`]), so the caller need not read them again;
    /// `None` is a plain read. Default: a plain read, no sums.
    async fn read_summed(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        ends: Option<SlotEnds>,
        deadline: Instant,
    ) -> ReadCompletion {
        let _ = ends;
        self.read(peer, session, ops, local, deadline).await
    }

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

    /// `peer`'s pool as this process has it mapped (the shared-pool path,
    /// read-only), so a GPU backend can copy from it straight into device
    /// memory (`Gpu::open_host_region`); `None` when reads from `peer` do
    /// not go through a mapping of its pool, or its owner process exited.
    /// Default: never.
    fn shared_region(&self, peer: &NodeAddr) -> Option<SharedRegion> {
        let _ = peer;
        None
    }
}

/// A peer's pool mapped into this process (see
/// [`Transport::shared_region`]): `len` readable bytes at address `addr`,
/// standing for handshake region `region` (its offsets are offsets into
/// this mapping). The mapping stays valid while `keep` is alive, whatever
/// the owner does (a memfd sealed against shrinking, C19); what it holds
/// is judged by the fetch's checksums, as any read (C10).
#[derive(Clone)]
pub struct SharedRegion {
    /// The handshake region this mapping is.
    pub region: u32,
    /// Address of the mapping's first byte in this process.
    pub addr: usize,
    /// Bytes mapped.
    pub len: u64,
    /// Keeps the mapping alive; also its identity (a new mapping of a
    /// restarted owner is a different `keep`).
    pub keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRegion")
            .field("region", &self.region)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
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
            .ok_or(TransportError::BadOp(BadOp::NoExtent { index: op.local_extent, extents: local.len() }))?;
        match op.local_offset.checked_add(op.len) {
            Some(end) if end <= ext.len() && op.len > 0 => {}
            _ => {
                return Err(TransportError::BadOp(BadOp::OutsideExtent {
                    offset: op.local_offset,
                    len: op.len,
                    extent_len: ext.len(),
                }));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{SlotEnds, SlotSummer};

    fn sums_of(bytes: &[u8], ends: &[u64]) -> Vec<u32> {
        let mut from = 0;
        ends.iter()
            .map(|&e| {
                let c = crc32c::crc32c(&bytes[from..e as usize]);
                from = e as usize;
                c
            })
            .collect()
    }

    /// Bytes landing in order, in pieces of any size that cross slot
    /// boundaries, sum to each slot's CRC-32C.
    #[test]
    fn summer_takes_each_slot_crc_across_pieces() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let ends = SlotEnds(vec![1, 4096, 4097, 9000, 10_000].into());
        for piece in [1usize, 7, 4096, 5000, 10_000] {
            let mut s = SlotSummer::new(&ends);
            for (i, chunk) in bytes.chunks(piece).enumerate() {
                s.landed((i * piece) as u64, chunk);
            }
            assert_eq!(s.finish().as_deref(), Some(&sums_of(&bytes, &ends.0)[..]), "piece {piece}");
        }
    }

    /// A gap, an overlap, bytes past the last slot or a short run: no sums.
    #[test]
    fn summer_gives_none_unless_the_bytes_tile_the_slots_in_order() {
        let bytes = [9u8; 100];
        let ends = SlotEnds(vec![40, 100].into());
        let run = |pieces: &[(u64, usize)]| {
            let mut s = SlotSummer::new(&ends);
            for &(at, len) in pieces {
                s.landed(at, &bytes[..len]);
            }
            s.finish()
        };
        assert!(run(&[(0, 50), (50, 50)]).is_some());
        assert_eq!(run(&[(0, 50), (60, 40)]), None, "gap");
        assert_eq!(run(&[(0, 50), (40, 60)]), None, "overlap");
        assert_eq!(run(&[(0, 100), (100, 1)]), None, "past the last slot");
        assert_eq!(run(&[(0, 99)]), None, "short");
        assert_eq!(run(&[(10, 90)]), None, "not from the start");
    }
}
