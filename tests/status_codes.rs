//! The error → gRPC status table, one row per variant of every error a
//! service answers with (`kvferry::status` is the one place statuses are
//! built; each error's `GrpcCode` sits beside its definition). Also pins
//! each variant's stable code (`docs/design.md`, "Errors").

use kvferry::engine::EngineError;
use kvferry::engine::layout::{LayoutError, LayoutFamily};
use kvferry::engine::leases::LeaseError;
use kvferry::engine::locks::LockError;
use kvferry::gpu::GpuError;
use kvferry::memory::DeviceBufferId;
use kvferry::memory::pool::PoolError;
use kvferry::metaserver::service::ServiceError;
use kvferry::metaserver::store::StoreError;
use kvferry::p2p::P2pError;
use kvferry::status::{GrpcCode, to_status};
use kvferry::transport::handshake::HandshakeError;
use kvferry::transport::{TransportError, TransportKind};
use kvferry::types::{BlockHash, IdError, NodeAddr, SessionId};
use tonic::Code;

/// Checks one row: the status `to_status` builds has `code` and the
/// error's message, and the error's stable code is `stable`.
fn row<E: GrpcCode>(e: E, stable: &str, got_stable: &str, code: Code) {
    let msg = e.to_string();
    let s = to_status(e);
    assert_eq!(s.code(), code, "{msg}");
    assert_eq!(s.message(), msg);
    assert_eq!(got_stable, stable, "{msg}");
    assert!(
        stable.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "{stable} is not snake_case"
    );
}

fn node() -> NodeAddr {
    NodeAddr("10.0.0.1:5000".into())
}

fn session() -> SessionId {
    SessionId("s1".into())
}

fn engine_rows() -> Vec<(EngineError, &'static str, Code)> {
    vec![
        (EngineError::Id(IdError::HashLength(0)), "id_hash_length", Code::InvalidArgument),
        (EngineError::UnknownNamespace("ns".into()), "engine_unknown_namespace", Code::NotFound),
        (EngineError::LayoutExists("ns".into()), "engine_layout_exists", Code::FailedPrecondition),
        (
            EngineError::FamilyMismatch {
                namespace: "ns".into(),
                had: LayoutFamily { slots: vec![(1, 8)] },
                got: LayoutFamily { slots: vec![(2, 8)] },
            },
            "engine_family_mismatch",
            Code::FailedPrecondition,
        ),
        (
            EngineError::NamespaceMismatch { namespace: "ns".into(), named: 2, given: 3 },
            "engine_namespace_mismatch",
            Code::InvalidArgument,
        ),
        (
            EngineError::BufferInUse { buffer: DeviceBufferId(1), namespace: "ns".into() },
            "engine_buffer_in_use",
            Code::FailedPrecondition,
        ),
        (EngineError::Layout(LayoutError::NoLayers), "layout_no_layers", Code::InvalidArgument),
        (EngineError::BlockIndex { idx: 9, num_blocks: 4 }, "engine_block_index", Code::InvalidArgument),
        (EngineError::TooManyBlocks { got: 9, max: 8 }, "engine_too_many_blocks", Code::InvalidArgument),
        (
            EngineError::Pool(PoolError::Exhausted { requested: 8, free: 0, largest_free: 0 }),
            "pool_exhausted",
            Code::ResourceExhausted,
        ),
        (EngineError::Pool(PoolError::ArenaAlloc { bytes: 8 }), "pool_arena_alloc", Code::ResourceExhausted),
        (
            EngineError::Pool(PoolError::BadConfig { capacity_bytes: 0, align: 0, reason: "zero" }),
            "pool_bad_config",
            Code::InvalidArgument,
        ),
        (EngineError::Pool(PoolError::InUse { live_extents: 1 }), "pool_in_use", Code::FailedPrecondition),
        (EngineError::Gpu(GpuError::Device("boom".into())), "gpu_device", Code::Internal),
        (EngineError::Lock(LockError::TooMany(8)), "lock_too_many", Code::ResourceExhausted),
        (EngineError::Lock(LockError::Duplicate), "lock_duplicate", Code::Aborted),
        (EngineError::Lease(LeaseError::TooMany { live: 1, ended: 1 }), "lease_too_many", Code::ResourceExhausted),
        (EngineError::Lease(LeaseError::AlreadyLeased("h".into())), "lease_already_leased", Code::FailedPrecondition),
        (EngineError::Lease(LeaseError::Duplicate), "lease_duplicate", Code::Aborted),
        (EngineError::Lease(LeaseError::Blocks { got: 0, max: 1 }), "lease_blocks", Code::InvalidArgument),
        (EngineError::Lease(LeaseError::Ttl { got: 0, max: 1 }), "lease_ttl", Code::InvalidArgument),
        (EngineError::Task("gone".into()), "engine_task", Code::Unavailable),
    ]
}

#[test]
fn every_engine_error_variant_maps_to_its_status() {
    for (e, stable, code) in engine_rows() {
        let got = e.code();
        row(e, stable, got, code);
    }
}

#[test]
fn every_p2p_error_variant_maps_to_its_status() {
    let rows: Vec<(P2pError, &str, Code)> = vec![
        (P2pError::Unimplemented("Save"), "p2p_unimplemented", Code::Unimplemented),
        (P2pError::MetadataTooLarge, "p2p_metadata_too_large", Code::InvalidArgument),
        (P2pError::NoTransport, "p2p_no_transport", Code::Unavailable),
        (P2pError::Metadata(HandshakeError::Truncated), "p2p_metadata", Code::InvalidArgument),
        (
            P2pError::TransportMismatch { requester: TransportKind::Verbs, ours: TransportKind::Tcp },
            "p2p_transport_mismatch",
            Code::FailedPrecondition,
        ),
        (P2pError::Id(IdError::Namespace(0)), "id_namespace", Code::InvalidArgument),
        (P2pError::Answer(TransportError::Timeout), "p2p_answer", Code::FailedPrecondition),
        (P2pError::EmptyHashes, "p2p_empty_hashes", Code::InvalidArgument),
        (P2pError::TooManyHashes { got: 2, max: 1 }, "p2p_too_many_hashes", Code::InvalidArgument),
        (P2pError::SessionIdTooLong, "p2p_session_id_too_long", Code::InvalidArgument),
    ];
    for (e, stable, code) in rows {
        let got = e.code();
        row(e, stable, got, code);
    }
    // An engine refusal answers the engine error's own status: only a full
    // table is RESOURCE_EXHAUSTED.
    for (e, stable, code) in engine_rows() {
        let e = P2pError::Lock(e);
        let got = e.code();
        row(e, stable, got, code);
    }
}

#[test]
fn every_metaserver_error_variant_maps_to_its_status() {
    let rows: Vec<(ServiceError, &str, Code)> = vec![
        (ServiceError::Id(IdError::NodeAddr("x".into())), "id_node_addr", Code::InvalidArgument),
        (ServiceError::Id(IdError::SessionId("".into())), "id_session_id", Code::InvalidArgument),
        (ServiceError::EmptyQuery, "metaserver_empty_query", Code::InvalidArgument),
        (ServiceError::TooManyHashes { got: 2, max: 1 }, "metaserver_too_many_hashes", Code::InvalidArgument),
        (ServiceError::Store(StoreError::UnknownNode { node: node() }), "store_unknown_node", Code::FailedPrecondition),
        (
            ServiceError::Store(StoreError::StaleSession { node: node(), expected: None, got: session() }),
            "store_stale_session",
            Code::FailedPrecondition,
        ),
        (
            ServiceError::Store(StoreError::LiveSessionConflict { node: node(), live_session: session() }),
            "store_live_session_conflict",
            Code::FailedPrecondition,
        ),
        (ServiceError::StoreFault, "metaserver_store_fault", Code::Internal),
        (ServiceError::WriteNotCompleted("shutdown".into()), "metaserver_write_not_completed", Code::Unavailable),
        (ServiceError::Stalled, "metaserver_stalled", Code::Unavailable),
        (ServiceError::Dropped, "metaserver_dropped", Code::Unavailable),
        (
            ServiceError::HashRejected(BlockHash(bytes::Bytes::from_static(b"h"))),
            "metaserver_hash_rejected",
            Code::InvalidArgument,
        ),
    ];
    for (e, stable, code) in rows {
        let got = e.code();
        row(e, stable, got, code);
    }
}

#[test]
fn a_received_status_becomes_a_typed_failure() {
    let s = tonic::Status::unavailable("owner down");
    let f = kvferry::status::RpcFailure::from_status(&s);
    assert_eq!(f.code, Code::Unavailable);
    assert_eq!(f.code_name(), "unavailable");
    assert_eq!(f.message, "owner down");
    assert_eq!(f.to_string(), "unavailable: owner down");
}
