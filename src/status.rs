//! Maps kvferry's typed errors to `tonic::Status` and back — the one place
//! where a status is built from an error (house style 9), so every RPC
//! answers the same code for the same fault, and the one place where a
//! status received from a peer becomes a typed cause ([`RpcFailure`]).
//!
//! An error that a service answers implements [`GrpcCode`] beside its
//! definition (its code per variant, a stable part of the wire contract:
//! the table per RPC is in `docs/wire.md`; the table test of every variant
//! is `tests/status_codes.rs`); [`to_status`] turns it into the status. No
//! service builds a `Status` inline. The one status rewritten below the
//! services — a request over the decode limit answers `RESOURCE_EXHAUSTED`
//! rather than tonic's `OUT_OF_RANGE` — is an HTTP-layer wrapper that only
//! real builds have, so it lives in `rt` (`rt::grpc_service`).

use tonic::Status;

/// The gRPC status code, re-exported so embedders (the Python binding)
/// match codes as values without a tonic dependency of their own.
pub use tonic::Code;

use crate::types::IdError;

/// An error a gRPC service answers with: one code per variant.
pub trait GrpcCode: std::fmt::Display {
    /// The code this error answers.
    fn grpc_code(&self) -> Code;
}

/// The status for `e`: its [`GrpcCode`] and its message.
pub fn to_status<E: GrpcCode>(e: E) -> Status {
    Status::new(e.grpc_code(), e.to_string())
}

/// The stable snake_case name of a gRPC code (`"unavailable"`,
/// `"deadline_exceeded"`, …): the code's name in the gRPC spec, lower case.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// A failed RPC as a typed cause: the gRPC code (what callers match on)
/// and the message (free text from the peer, or from the local channel).
/// Built from a `tonic::Status` by [`RpcFailure::from_status`] only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code_name(*code))]
pub struct RpcFailure {
    /// The status code.
    pub code: Code,
    /// The status message, with the innermost local cause appended in
    /// parentheses when the channel failed (`tcp connect error (Connection
    /// refused (os error 111))`).
    pub message: String,
}

impl RpcFailure {
    /// A failure with `code` and `message` (for failures the caller
    /// detects itself: a deadline it enforced, a client shut down).
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// The failure a received status describes.
    pub fn from_status(status: &Status) -> Self {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
        let mut root = None;
        while let Some(c) = cause {
            root = Some(c);
            cause = c.source();
        }
        let message = match root {
            Some(r) => format!("{} ({r})", status.message()),
            None => status.message().to_string(),
        };
        Self { code: status.code(), message }
    }

    /// The snake_case name of [`Self::code`] ([`code_name`]).
    pub fn code_name(&self) -> &'static str {
        code_name(self.code)
    }
}

impl From<&Status> for RpcFailure {
    fn from(s: &Status) -> Self {
        Self::from_status(s)
    }
}

impl From<Status> for RpcFailure {
    fn from(s: Status) -> Self {
        Self::from_status(&s)
    }
}

/// Malformed ids, namespaces or hashes → `INVALID_ARGUMENT`.
impl GrpcCode for IdError {
    fn grpc_code(&self) -> Code {
        Code::InvalidArgument
    }
}
