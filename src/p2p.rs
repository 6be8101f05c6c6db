//! `P2pTransferService`: the minimal Engine gRPC surface a serving peer
//! exposes (design.md §2.4): `RdmaHandshake`, `QueryBlocksForTransfer`,
//! `ReleaseTransferLock`, `Health`. Every other Engine RPC answers
//! `UNIMPLEMENTED`. Input is validated before anything is locked; bad input
//! gets `INVALID_ARGUMENT`, never a panic.

use std::pin::Pin;

use tonic::{Request, Response, Status};

use crate::engine::Engine;
use crate::engine::EngineError;
use crate::limits;
use crate::proto::engine_server::{Engine as EngineRpc, EngineServer};
use crate::proto::*;
use crate::status::{GrpcCode, to_status};
use crate::transport::handshake::HandshakeError;
use crate::transport::{HandshakeMetadata, TransportError, TransportKind};
use crate::types::{BlockHash, IdError, NodeAddr, validate_namespace};

/// The service over an [`Engine`].
#[derive(Clone)]
pub struct P2pTransferService {
    engine: Engine,
}

impl P2pTransferService {
    /// Wraps an engine.
    pub fn new(engine: Engine) -> Self {
        Self { engine }
    }

    /// The tonic router serving this service with 64 MiB message limits.
    pub fn router(self) -> tonic::transport::server::Router {
        let svc = EngineServer::new(self)
            .max_decoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(limits::GRPC_MESSAGE_BYTES_MAX);
        crate::rt::server_builder().add_service(svc)
    }

    /// Serves on a listener the embedder already bound (bind-first: the
    /// embedder learns about a taken port from its own bind) until
    /// `shutdown` resolves.
    ///
    /// # Errors
    /// [`ServeError::Bind`] if the listener's address cannot be read,
    /// [`ServeError::Transport`] when serving fails.
    pub async fn serve_with_incoming(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let bound = crate::rt::BoundListener::from_listener(listener).map_err(ServeError::Bind)?;
        crate::rt::serve(self.router(), bound, shutdown).await.map_err(ServeError::Transport)
    }

    /// Binds `addr` first — a taken port is [`ServeError::Bind`] before
    /// anything is served — then serves until `shutdown` resolves.
    ///
    /// # Errors
    /// [`ServeError::Bind`], [`ServeError::Transport`].
    pub async fn serve(
        self,
        addr: std::net::SocketAddr,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let bound = crate::rt::bind(addr).await.map_err(ServeError::Bind)?;
        crate::rt::serve(self.router(), bound, shutdown).await.map_err(ServeError::Transport)
    }
}

/// Errors of serving the P2P service.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound (e.g. the port is taken).
    #[error("cannot bind: {0}")]
    Bind(std::io::Error),
    /// The gRPC server failed.
    #[error("serving failed: {0}")]
    Transport(tonic::transport::Error),
}

impl ServeError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::Bind(_) => "p2p_serve_bind",
            ServeError::Transport(_) => "p2p_serve_transport",
        }
    }
}

/// Why the P2P service refused a request. Every refusal is one of these,
/// turned into its status by [`to_status`] (the codes are pinned by
/// `tests/status_codes.rs` and listed in `docs/wire.md`).
#[derive(Debug, thiserror::Error)]
pub enum P2pError {
    /// An Engine RPC this service does not serve.
    #[error("{0} is not served by the P2P transfer service")]
    Unimplemented(&'static str),
    /// The handshake metadata is over `HANDSHAKE_METADATA_BYTES_MAX`.
    #[error("handshake metadata too large")]
    MetadataTooLarge,
    /// This node has no transport installed.
    #[error("no transport installed")]
    NoTransport,
    /// The requester's handshake metadata does not decode.
    #[error("handshake metadata: {0}")]
    Metadata(HandshakeError),
    /// The requester speaks another transport than this node.
    #[error("requester speaks {requester:?}, this node {ours:?}")]
    TransportMismatch {
        /// The requester's transport.
        requester: TransportKind,
        /// This node's.
        ours: TransportKind,
    },
    /// A malformed requester id, namespace or hash.
    #[error(transparent)]
    Id(#[from] IdError),
    /// This node's transport could not answer the requester's offer.
    #[error("handshake: {0}")]
    Answer(TransportError),
    /// A lock request with no hashes.
    #[error("empty block_hashes")]
    EmptyHashes,
    /// A lock request with more than `HASHES_PER_REQUEST_MAX` hashes.
    #[error("{got} hashes; the limit is {max}")]
    TooManyHashes {
        /// Hashes in the request.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// The engine refused to lock (a full lock table, an id collision).
    #[error(transparent)]
    Lock(EngineError),
    /// A transfer-session id over `SESSION_ID_BYTES_MAX`.
    #[error("transfer_session_id too long")]
    SessionIdTooLong,
}

impl P2pError {
    /// The stable code of this error (`docs/design.md`, "Errors"); an
    /// engine refusal answers the engine error's code.
    pub fn code(&self) -> &'static str {
        match self {
            P2pError::Unimplemented(_) => "p2p_unimplemented",
            P2pError::MetadataTooLarge => "p2p_metadata_too_large",
            P2pError::NoTransport => "p2p_no_transport",
            P2pError::Metadata(_) => "p2p_metadata",
            P2pError::TransportMismatch { .. } => "p2p_transport_mismatch",
            P2pError::Id(e) => e.code(),
            P2pError::Answer(_) => "p2p_answer",
            P2pError::EmptyHashes => "p2p_empty_hashes",
            P2pError::TooManyHashes { .. } => "p2p_too_many_hashes",
            P2pError::Lock(e) => e.code(),
            P2pError::SessionIdTooLong => "p2p_session_id_too_long",
        }
    }
}

/// Bad input is `INVALID_ARGUMENT`; a node that cannot serve the request
/// as configured (no transport, another transport, an offer its transport
/// refuses) is `UNAVAILABLE` / `FAILED_PRECONDITION`; an engine refusal
/// answers the engine error's own code ([`EngineError`]'s `GrpcCode`:
/// `RESOURCE_EXHAUSTED` only for a full table).
impl GrpcCode for P2pError {
    fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            P2pError::Unimplemented(_) => Code::Unimplemented,
            P2pError::MetadataTooLarge
            | P2pError::Metadata(_)
            | P2pError::Id(_)
            | P2pError::EmptyHashes
            | P2pError::TooManyHashes { .. }
            | P2pError::SessionIdTooLong => Code::InvalidArgument,
            P2pError::NoTransport => Code::Unavailable,
            P2pError::TransportMismatch { .. } | P2pError::Answer(_) => Code::FailedPrecondition,
            P2pError::Lock(e) => e.grpc_code(),
        }
    }
}

fn ok() -> Option<ResponseStatus> {
    Some(ResponseStatus { ok: true, message: String::new() })
}

fn unimplemented<T>(name: &'static str) -> Result<Response<T>, Status> {
    Err(to_status(P2pError::Unimplemented(name)))
}

type SessionStream = Pin<Box<dyn futures::Stream<Item = Result<SessionEvent, Status>> + Send>>;

#[tonic::async_trait]
impl EngineRpc for P2pTransferService {
    async fn register_context_batch(
        &self,
        _: Request<RegisterContextBatchRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("RegisterContextBatch")
    }
    async fn save(&self, _: Request<SaveRequest>) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("Save")
    }
    async fn load(&self, _: Request<LoadRequest>) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("Load")
    }
    async fn query_prefetch(&self, _: Request<QueryPrefetchRequest>) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("QueryPrefetch")
    }
    async fn release(&self, _: Request<ReleaseRequest>) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("Release")
    }
    async fn unregister_context(
        &self,
        _: Request<UnregisterContextRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("UnregisterContext")
    }
    async fn shutdown(&self, _: Request<ShutdownRequest>) -> Result<Response<SimpleResponse>, Status> {
        unimplemented("Shutdown")
    }

    type SessionStream = SessionStream;

    async fn session(&self, _: Request<SessionRequest>) -> Result<Response<Self::SessionStream>, Status> {
        unimplemented("Session")
    }

    async fn rdma_handshake(
        &self,
        request: Request<RdmaHandshakeRequest>,
    ) -> Result<Response<RdmaHandshakeResponse>, Status> {
        let r = request.into_inner();
        if r.handshake_metadata.len() > limits::HANDSHAKE_METADATA_BYTES_MAX {
            return Err(to_status(P2pError::MetadataTooLarge));
        }
        let Some(transport) = self.engine.transport() else {
            return Err(to_status(P2pError::NoTransport));
        };
        // Validate the requester's metadata (versioned; unknown versions and
        // trailing bytes are rejected). TCP needs nothing back-connected.
        let remote = HandshakeMetadata::decode(&r.handshake_metadata).map_err(|e| to_status(P2pError::Metadata(e)))?;
        if remote.transport != transport.kind() {
            return Err(to_status(P2pError::TransportMismatch { requester: remote.transport, ours: transport.kind() }));
        }
        let requester = NodeAddr::parse(&r.requester_id).map_err(|e| to_status(P2pError::Id(e)))?;
        let deadline =
            tokio::time::Instant::now() + std::time::Duration::from_millis(limits::METASERVER_RPC_TIMEOUT_MS_DEFAULT);
        let answer = transport.answer(&requester, &remote, deadline).map_err(|e| to_status(P2pError::Answer(e)))?;
        Ok(Response::new(RdmaHandshakeResponse { status: ok(), handshake_metadata: answer.encode().into() }))
    }

    async fn query_blocks_for_transfer(
        &self,
        request: Request<QueryBlocksForTransferRequest>,
    ) -> Result<Response<QueryBlocksForTransferResponse>, Status> {
        let r = request.into_inner();
        validate_namespace(&r.namespace).map_err(|e| to_status(P2pError::Id(e)))?;
        if r.block_hashes.is_empty() {
            return Err(to_status(P2pError::EmptyHashes));
        }
        if r.block_hashes.len() > limits::HASHES_PER_REQUEST_MAX {
            return Err(to_status(P2pError::TooManyHashes {
                got: r.block_hashes.len(),
                max: limits::HASHES_PER_REQUEST_MAX,
            }));
        }
        let hashes: Vec<BlockHash> = r
            .block_hashes
            .into_iter()
            .map(|b| {
                let h = BlockHash(b);
                h.validate().map(|_| h).map_err(|e| to_status(P2pError::Id(e)))
            })
            .collect::<Result<_, _>>()?;
        let answer = self
            .engine
            .answer_transfer(
                &r.namespace,
                &hashes,
                &r.requester_id,
                r.device.as_ref(),
                r.compact_slots,
                r.packed_blocks,
            )
            .await
            .map_err(|e| to_status(P2pError::Lock(e)))?;
        Ok(Response::new(answer))
    }

    async fn release_transfer_lock(
        &self,
        request: Request<ReleaseTransferLockRequest>,
    ) -> Result<Response<ReleaseTransferLockResponse>, Status> {
        let r = request.into_inner();
        if r.transfer_session_id.len() > limits::SESSION_ID_BYTES_MAX {
            return Err(to_status(P2pError::SessionIdTooLong));
        }
        let (status, released) = match self.engine.release_transfer(&r.transfer_session_id) {
            Ok(n) => (ok(), n as u64),
            Err(e) => (Some(ResponseStatus { ok: false, message: e.to_string() }), 0),
        };
        Ok(Response::new(ReleaseTransferLockResponse { status, released_blocks: released }))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse { status: ok() }))
    }
}
