//! Maps kvferry's typed errors to `tonic::Status` — the one place where that
//! happens (house style 9), so every RPC answers the same code for the same
//! fault.

use tonic::{Code, Status};

use crate::metaserver::store::StoreError;
use crate::types::IdError;

/// Malformed ids, namespaces or hashes → `INVALID_ARGUMENT`.
pub fn from_id_error(e: IdError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// Store errors: unknown node / stale session → `FAILED_PRECONDITION` (the
/// client re-heartbeats); a different live session on the same address →
/// `ALREADY_EXISTS` (re-heartbeating would not help).
pub fn from_store_error(e: StoreError) -> Status {
    let code = match e {
        StoreError::UnknownNode { .. } | StoreError::StaleSession { .. } => Code::FailedPrecondition,
        StoreError::LiveSessionConflict { .. } => Code::AlreadyExists,
    };
    Status::new(code, e.to_string())
}
