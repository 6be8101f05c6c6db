//! Transfer tickets: a transfer lock granted ahead of the request.
//!
//! The P/D handoff's usual order has three round trips on the decode's
//! critical path after the prefill's "KV ready": the MetaServer query, the
//! owner's transfer lock, and the reads. In a P/D deployment the prefill
//! already knows who will read: so, as vLLM's P/D connectors pass the
//! decode `kv_transfer_params` (the remote engine, its block ids) with the
//! finished prefill, the prefill's engine can lock its blocks for that
//! reader itself ([`Engine::grant_transfer`]) and hand the answer — the
//! one the owner's `QueryBlocksForTransfer` would have given — to the
//! decode with its "KV ready". The decode then starts reading at once
//! ([`Engine::fetch_into_with_ticket`]): no query, no lock RPC.
//!
//! Nothing else changes: the ticket's session is a transfer session like
//! any other (C8: the reader releases it exactly once, whether it read or
//! not; it expires otherwise; C16: its id is unpredictable and grants the
//! reads), its device half goes only where a lock answer's would (C19:
//! the reader named in the ticket, same process or proven same host), and
//! the reader checks the answer exactly as it checks one from the wire.
//!
//! [`Engine::fetch_into_with_ticket`]: super::Engine::fetch_into_with_ticket

use prost::Message;

use super::device::DeviceAsk;
use super::locks::{PackedBlocks, slot_shapes, transfer_block_info};
use super::{Engine, EngineError};
use crate::gpu::peer::PeerKind;
use crate::limits;
use crate::proto::{
    DeviceBufferExport, DeviceCapability, DeviceLayout, DeviceRun, QueryBlocksForTransferResponse, ResponseStatus,
};
use crate::types::{BlockHash, IdError, NodeAddr, validate_namespace};

/// Who will read a ticket's blocks: the reader's node address and the
/// device-direct copies it can make. The reader makes it
/// ([`Engine::transfer_ask`]) and the embedder passes it to the owner with
/// the request (in a real pair, with the request's routing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferAsk {
    /// The reader's node address (its P2P service).
    pub requester: NodeAddr,
    /// Its device-copy capability (handle kind and process id); `None`:
    /// it copies nothing device to device.
    pub device: Option<DeviceCapability>,
}

/// A transfer lock an owner granted for one reader ahead of the request
/// ([`Engine::grant_transfer`]). Pass it to the reader's
/// [`Engine::fetch_into_with_ticket`] (in-process as is, across processes
/// as [`TransferTicket::encode`]'s bytes), which releases its session
/// exactly once; a ticket that never reaches its reader expires at the
/// owner after the lock timeout (C8), unless the owner ends it first with
/// [`Engine::release_transfer`]`(ticket.session())` (dropping the value
/// releases nothing: it may already be on its way to the reader).
///
/// [`Engine::fetch_into_with_ticket`]: super::Engine::fetch_into_with_ticket
///
/// The bytes are a bearer capability: whoever holds them can read the
/// locked blocks (and, on the owner's host, open its device handles) until
/// the lock ends. Send them to the one reader they name, over the channel
/// the engines already trust with requests, and nowhere else.
#[derive(Debug, PartialEq)]
pub struct TransferTicket {
    /// The owner (the node that granted it).
    pub owner: NodeAddr,
    /// The reader it was granted to.
    pub requester: NodeAddr,
    /// The blocks' namespace.
    pub namespace: String,
    /// The hashes asked for, in request order (the answer's packed indices
    /// point into them).
    pub hashes: Vec<BlockHash>,
    /// The owner's lock answer for `requester` (packed form).
    pub answer: QueryBlocksForTransferResponse,
    /// When the owner answered: ms since the Unix epoch, by its clock (a
    /// same-host reader ages the device lease by it).
    pub granted_unix_ms: u64,
    /// When the owner answered, on this process's monotonic clock: set by
    /// [`Engine::grant_transfer`], not carried by the bytes (`None` after
    /// [`TransferTicket::decode`]). A reader in the owner's process ages
    /// the ticket by it rather than by the wall clock.
    pub granted_at: Option<tokio::time::Instant>,
}

/// Why ticket bytes were refused ([`TransferTicket::decode`]); nothing is
/// read from such a ticket (and its session, unknown, expires at the
/// owner).
#[derive(Debug, thiserror::Error)]
pub enum TicketError {
    /// Not a ticket: the bytes do not decode.
    #[error("transfer ticket: {0}")]
    Decode(#[from] prost::DecodeError),
    /// Over [`limits::TICKET_BYTES_MAX`].
    #[error("transfer ticket of {got} bytes, at most {max}")]
    TooLarge {
        /// Bytes given.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// An owner, requester, namespace or hash that is not one (its own
    /// `id_*` or `hash_*` code).
    #[error("transfer ticket: {0}")]
    Field(#[from] IdError),
    /// More hashes than [`limits::HASHES_PER_REQUEST_MAX`].
    #[error("transfer ticket names {got} blocks, at most {max}")]
    TooManyBlocks {
        /// Hashes named.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// No answer in it.
    #[error("transfer ticket without an answer")]
    NoAnswer,
}

impl TicketError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            TicketError::Decode(_) => "ticket_decode",
            TicketError::TooLarge { .. } => "ticket_too_large",
            TicketError::Field(e) => e.code(),
            TicketError::TooManyBlocks { .. } => "ticket_too_many_blocks",
            TicketError::NoAnswer => "ticket_no_answer",
        }
    }
}

impl TransferTicket {
    /// The transfer session it holds; empty when the owner found none of
    /// the blocks (then there is nothing to read or release).
    pub fn session(&self) -> &str {
        &self.answer.transfer_session_id
    }

    /// Blocks the owner locked (and may hand device ranges for).
    pub fn granted(&self) -> usize {
        if self.answer.blocks.is_empty() { self.answer.packed_index.len() } else { self.answer.blocks.len() }
    }

    /// The ticket as bytes (the `TransferTicket` message of
    /// `proto/engine.proto`), for an embedder that sends it to a reader in
    /// another process.
    pub fn encode(&self) -> Vec<u8> {
        crate::proto::TransferTicket {
            owner_id: self.owner.0.clone(),
            requester_id: self.requester.0.clone(),
            namespace: self.namespace.clone(),
            block_hashes: self.hashes.iter().map(|h| h.0.clone()).collect(),
            answer: Some(self.answer.clone()),
            granted_unix_ms: self.granted_unix_ms,
        }
        .encode_to_vec()
    }

    /// Decodes [`TransferTicket::encode`]'s bytes, checking every id.
    /// The answer itself is checked where it is used, as a lock answer
    /// from the wire is.
    ///
    /// # Errors
    /// [`TicketError`]: bytes over [`limits::TICKET_BYTES_MAX`], not a
    /// ticket, a malformed owner, requester, namespace or hash, too many
    /// hashes, no answer.
    pub fn decode(bytes: &[u8]) -> Result<Self, TicketError> {
        if bytes.len() > limits::TICKET_BYTES_MAX {
            return Err(TicketError::TooLarge { got: bytes.len(), max: limits::TICKET_BYTES_MAX });
        }
        let t = crate::proto::TransferTicket::decode(bytes)?;
        if t.block_hashes.len() > limits::HASHES_PER_REQUEST_MAX {
            return Err(TicketError::TooManyBlocks { got: t.block_hashes.len(), max: limits::HASHES_PER_REQUEST_MAX });
        }
        validate_namespace(&t.namespace)?;
        let hashes = t
            .block_hashes
            .into_iter()
            .map(|b| {
                let h = BlockHash(b);
                h.validate().map(|_| h)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            owner: NodeAddr::parse(&t.owner_id)?,
            requester: NodeAddr::parse(&t.requester_id)?,
            namespace: t.namespace,
            hashes,
            answer: t.answer.ok_or(TicketError::NoAnswer)?,
            granted_unix_ms: t.granted_unix_ms,
            granted_at: None,
        })
    }

    /// How old the ticket is (ms): by this process's monotonic clock when
    /// it was granted here, else by the wall clock, which the owner and a
    /// same-host reader share (a ticket from the future is as old as none).
    pub(crate) fn age_ms(&self) -> u64 {
        match self.granted_at {
            Some(at) => u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX),
            None => unix_ms().saturating_sub(self.granted_unix_ms),
        }
    }

    /// The device lease's time left as the reader sees it now: the
    /// answer's, less the ticket's age.
    pub(crate) fn device_ms_left(&self) -> u64 {
        self.answer.device_lease_ms_left.saturating_sub(self.age_ms())
    }
}

/// Milliseconds since the Unix epoch (0 before it).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Engine {
    /// What this engine tells an owner about itself for a ticket
    /// ([`Engine::grant_transfer`]): its address and, when device-direct
    /// reads are on and its GPU backend makes peer copies, its device-copy
    /// capability.
    pub fn transfer_ask(&self) -> TransferAsk {
        TransferAsk { requester: self.node().clone(), device: self.device_capability() }
    }

    /// The device-direct copies this engine makes as a reader: its GPU
    /// backend's peer-copy kind and this process's id, when device-direct
    /// reads are on ([`super::EngineConfig::device_direct`]) and the
    /// backend makes peer copies; else `None`. What its lock requests and
    /// its [`TransferAsk`] say, and the condition for using a ticket's
    /// device half.
    pub(crate) fn device_capability(&self) -> Option<DeviceCapability> {
        let kind = self.inner.cfg.device_direct.then(|| self.gpu().peer_kind()).flatten()?;
        Some(DeviceCapability { kind: kind.to_u32(), pid: std::process::id() })
    }

    /// What a requester's [`DeviceCapability`] asks for, with the
    /// transport's word on whether it runs on this host (C19); `None` for an
    /// unknown kind or a malformed requester id.
    fn device_ask(&self, d: &DeviceCapability, requester: &str) -> Option<DeviceAsk> {
        let kind = PeerKind::from_u32(d.kind)?;
        let requester = NodeAddr::parse(requester).ok()?;
        let proven_same_host = self.transport().is_some_and(|t| t.proven_same_host(&requester));
        Some(DeviceAsk { kind, pid: d.pid, proven_same_host })
    }

    /// Locks `hashes` of `namespace` for `requester` and builds the lock
    /// answer: the owner's half of `QueryBlocksForTransfer` (the P2P
    /// service's, and a ticket's). `hashes` are validated by the caller.
    /// `compact`, `packed`: the answer's forms (slot shapes once; blocks as
    /// columns). The device half (C19) only for a `device` capability this
    /// engine grants ([`Engine::device_grant`]). An unknown namespace
    /// answers with no session (nothing to lock).
    ///
    /// # Errors
    /// [`EngineError::Lock`] when the lock table is full.
    pub(crate) async fn answer_transfer(
        &self,
        namespace: &str,
        hashes: &[BlockHash],
        requester: &str,
        device: Option<&DeviceCapability>,
        compact: bool,
        packed: bool,
    ) -> Result<QueryBlocksForTransferResponse, EngineError> {
        let t0 = std::time::Instant::now();
        let ok = Some(ResponseStatus { ok: true, message: String::new() });
        let Ok((_, layout)) = self.layout(namespace) else {
            return Ok(QueryBlocksForTransferResponse { status: ok, ..Default::default() });
        };
        let (session, found) = self.lock_for_transfer_staged(namespace, hashes).await?;
        let locked = t0.elapsed();
        let shapes = slot_shapes(&layout);
        // Three forms of the answer: packed columns, a compact record per
        // block, or PegaFlow's slots per block (what the requester asked).
        let compact = compact || packed;
        let mut packed = packed.then(|| PackedBlocks::new(hashes, &found));
        let mut blocks: Vec<_> = if packed.is_some() {
            Vec::new()
        } else {
            found.iter().map(|(h, b)| transfer_block_info(&shapes, compact, h, b)).collect()
        };
        let grant = match (&session, device.and_then(|d| self.device_ask(d, requester))) {
            (Some(s), Some(ask)) => {
                let hashes: Vec<BlockHash> = found.iter().map(|(h, _)| h.clone()).collect();
                self.device_grant(namespace, &hashes, s, &ask)
            }
            _ => None,
        };
        let (device_buffers, device_lease_ms_left, device_layout) = match grant {
            None => (Vec::new(), 0, None),
            Some(g) => {
                match packed.as_mut() {
                    Some(p) => p.set_device_blocks(&g.blocks),
                    None => {
                        for (b, &index) in blocks.iter_mut().zip(&g.blocks) {
                            b.device_block = index;
                        }
                    }
                }
                let layout = DeviceLayout {
                    num_blocks: g.num_blocks,
                    runs: g
                        .runs
                        .iter()
                        .map(|r| DeviceRun { buffer: r.export, offset: r.offset, stride: r.stride, len: r.len })
                        .collect(),
                };
                let exports = g
                    .exports
                    .into_iter()
                    .map(|e| DeviceBufferExport {
                        kind: e.kind.to_u32(),
                        handle: e.handle.into(),
                        offset: e.offset,
                        len: e.len,
                    })
                    .collect();
                (exports, g.ms_left, Some(layout))
            }
        };
        let packed = packed.unwrap_or_default();
        tracing::debug!(
            target: crate::gpu::peer::PEER_TIMING_TRACE_TARGET,
            blocks = found.len(),
            locked = locked.as_micros() as u64,
            answered = t0.elapsed().as_micros() as u64,
            "transfer lock answered"
        );
        Ok(QueryBlocksForTransferResponse {
            status: ok,
            blocks,
            transfer_session_id: session.unwrap_or_default(),
            lock_timeout_secs: self.lock_timeout_secs(),
            device_buffers,
            device_lease_ms_left,
            device_layout,
            slot_shapes: if compact { shapes } else { Vec::new() },
            packed_index: packed.index,
            packed_pool_offset: packed.pool_offset,
            packed_slot_crc32c: packed.slot_crc32c,
            packed_device_block: packed.device_block,
        })
    }

    /// Locks the resident blocks among `hashes` of `namespace` for the
    /// reader `to` and returns the lock as a [`TransferTicket`] (see the
    /// module doc): what this node's `QueryBlocksForTransfer` would answer
    /// that reader, device ranges included where C19 allows them (a reader
    /// in this process; a CUDA IPC reader the transport proved to run on
    /// this host — so a reader that never handshook gets none, and its
    /// ticket reads from the pool). Blocks on the disk tier are staged
    /// first, as for a peer's lock. Call it once the blocks are saved (and,
    /// for device reads, leased: [`Engine::grant_device_lease`]); a ticket
    /// whose [`TransferTicket::session`] is empty locked nothing.
    ///
    /// # Errors
    /// [`EngineError::Id`] for a malformed namespace, hash or requester,
    /// [`EngineError::TooManyBlocks`] past
    /// [`limits::HASHES_PER_REQUEST_MAX`], [`EngineError::UnknownNamespace`],
    /// [`EngineError::Lock`] when the lock table is full; nothing is locked.
    pub async fn grant_transfer(
        &self,
        namespace: &str,
        hashes: &[BlockHash],
        to: &TransferAsk,
    ) -> Result<TransferTicket, EngineError> {
        validate_namespace(namespace)?;
        NodeAddr::parse(&to.requester.0)?;
        if hashes.len() > limits::HASHES_PER_REQUEST_MAX {
            return Err(EngineError::TooManyBlocks { got: hashes.len(), max: limits::HASHES_PER_REQUEST_MAX });
        }
        for h in hashes {
            h.validate()?;
        }
        self.layout(namespace)?;
        // Before the answer: the lease's time left is counted from here.
        let (granted_unix_ms, granted_at) = (unix_ms(), tokio::time::Instant::now());
        let answer = if hashes.is_empty() {
            QueryBlocksForTransferResponse::default()
        } else {
            self.answer_transfer(namespace, hashes, &to.requester.0, to.device.as_ref(), true, true).await?
        };
        Ok(TransferTicket {
            owner: self.node().clone(),
            requester: to.requester.clone(),
            namespace: namespace.to_string(),
            hashes: hashes.to_vec(),
            answer,
            granted_unix_ms,
            granted_at: Some(granted_at),
        })
    }
}
