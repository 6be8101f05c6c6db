//! Stable codes of the engine's errors (`docs/design.md`, "Errors") and
//! the gRPC code each answers with when a service returns it
//! ([`crate::status::GrpcCode`]). Kept apart from the error definitions so
//! that the codes of one family read as one table.

use tonic::Code;

use super::EngineError;
use super::LoadError;
use super::layout::LayoutError;
use super::leases::LeaseError;
use super::locks::LockError;
use crate::memory::pool::PoolError;
use crate::status::GrpcCode;

impl EngineError {
    /// The stable code of this error. A variant wrapping another error
    /// answers that error's code (`EngineError::Gpu(e)` → `e.code()`).
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Id(e) => e.code(),
            EngineError::UnknownNamespace(_) => "engine_unknown_namespace",
            EngineError::LayoutExists(_) => "engine_layout_exists",
            EngineError::FamilyMismatch { .. } => "engine_family_mismatch",
            EngineError::NamespaceMismatch { .. } => "engine_namespace_mismatch",
            EngineError::BufferInUse { .. } => "engine_buffer_in_use",
            EngineError::Layout(e) => e.code(),
            EngineError::BlockIndex { .. } => "engine_block_index",
            EngineError::TooManyBlocks { .. } => "engine_too_many_blocks",
            EngineError::Pool(e) => e.code(),
            EngineError::Gpu(e) => e.code(),
            EngineError::Lock(e) => e.code(),
            EngineError::Lease(e) => e.code(),
            EngineError::Task(_) => "engine_task",
            EngineError::Disk(e) => e.code(),
        }
    }
}

/// Engine errors a service answers with: unknown namespaces are
/// `NOT_FOUND`; bad input (ids, layouts, indices, a lease's bounds) is
/// `INVALID_ARGUMENT`; a layout or buffer that conflicts with the engine's
/// state is `FAILED_PRECONDITION`; only a full pool or table is
/// `RESOURCE_EXHAUSTED`; a session-id collision is `ABORTED` (retry); a
/// device failure is `INTERNAL`; a save task lost with its runtime is
/// `UNAVAILABLE`.
impl GrpcCode for EngineError {
    fn grpc_code(&self) -> Code {
        match self {
            EngineError::Id(_)
            | EngineError::Layout(_)
            | EngineError::BlockIndex { .. }
            | EngineError::TooManyBlocks { .. }
            | EngineError::NamespaceMismatch { .. } => Code::InvalidArgument,
            EngineError::UnknownNamespace(_) => Code::NotFound,
            EngineError::LayoutExists(_) | EngineError::FamilyMismatch { .. } | EngineError::BufferInUse { .. } => {
                Code::FailedPrecondition
            }
            EngineError::Pool(PoolError::Exhausted { .. }) => Code::ResourceExhausted,
            EngineError::Pool(PoolError::InUse { .. }) => Code::FailedPrecondition,
            EngineError::Pool(PoolError::BadConfig { .. }) => Code::InvalidArgument,
            EngineError::Pool(PoolError::ArenaAlloc { .. }) => Code::ResourceExhausted,
            EngineError::Gpu(_) => Code::Internal,
            EngineError::Lock(l) => l.grpc_code(),
            EngineError::Lease(LeaseError::TooMany { .. }) => Code::ResourceExhausted,
            EngineError::Lease(LeaseError::AlreadyLeased(_)) => Code::FailedPrecondition,
            EngineError::Lease(LeaseError::Duplicate) => Code::Aborted,
            EngineError::Lease(LeaseError::Blocks { .. } | LeaseError::Ttl { .. }) => Code::InvalidArgument,
            EngineError::Task(_) => Code::Unavailable,
            EngineError::Disk(_) => Code::FailedPrecondition,
        }
    }
}

impl super::disk::DiskOpenError {
    /// The stable code of this error (a wrapped file or tier error answers
    /// its own).
    pub fn code(&self) -> &'static str {
        use super::disk::DiskOpenError;
        match self {
            #[cfg(target_os = "linux")]
            DiskOpenError::File(e) => e.code(),
            DiskOpenError::Tier(e) => e.code(),
            DiskOpenError::NoFileBackend => "disk_no_file_backend",
            DiskOpenError::SimDiskTaken => "disk_sim_taken",
        }
    }
}

impl LockError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            LockError::TooMany(_) => "lock_too_many",
            LockError::Duplicate => "lock_duplicate",
        }
    }
}

/// A full lock table is `RESOURCE_EXHAUSTED`; a session-id collision is
/// `ABORTED` (the requester may retry at once).
impl GrpcCode for LockError {
    fn grpc_code(&self) -> Code {
        match self {
            LockError::TooMany(_) => Code::ResourceExhausted,
            LockError::Duplicate => Code::Aborted,
        }
    }
}

impl LeaseError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            LeaseError::Blocks { .. } => "lease_blocks",
            LeaseError::Ttl { .. } => "lease_ttl",
            LeaseError::AlreadyLeased(_) => "lease_already_leased",
            LeaseError::TooMany { .. } => "lease_too_many",
            LeaseError::Duplicate => "lease_duplicate",
        }
    }
}

impl LayoutError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            LayoutError::NoLayers => "layout_no_layers",
            LayoutError::TooManyLayers { .. } => "layout_too_many_layers",
            LayoutError::UnknownBuffer { .. } => "layout_unknown_buffer",
            LayoutError::ZeroBlocks { .. } => "layout_zero_blocks",
            LayoutError::BlockCountMismatch { .. } => "layout_block_count_mismatch",
            LayoutError::ZeroBytes { .. } => "layout_zero_bytes",
            LayoutError::BlockStrideTooSmall { .. } => "layout_block_stride_too_small",
            LayoutError::Overflow { .. } => "layout_overflow",
            LayoutError::OutOfBounds { .. } => "layout_out_of_bounds",
            LayoutError::Overlap { .. } => "layout_overlap",
            LayoutError::TooLarge { .. } => "layout_too_large",
            LayoutError::BlockOutOfRange { .. } => "layout_block_out_of_range",
        }
    }
}

impl LoadError {
    /// The stable code of this error (a failed copy answers the GPU
    /// error's code).
    pub fn code(&self) -> &'static str {
        match self {
            LoadError::NotResident => "load_not_resident",
            LoadError::Deadline => "load_deadline",
            LoadError::Copy(e) => e.code(),
        }
    }
}
