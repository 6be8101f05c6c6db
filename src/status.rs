//! Maps kvferry's typed errors to `tonic::Status` — the one place where a
//! status is built from an error (house style 9), so every RPC answers the
//! same code for the same fault. An error that a service answers implements
//! [`GrpcCode`] beside its definition (its code per variant, a stable part
//! of the wire contract: the table per RPC is in `docs/wire.md`);
//! [`to_status`] turns it into the status.

use tonic::{Code, Status};

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

/// Malformed ids, namespaces or hashes → `INVALID_ARGUMENT`.
impl GrpcCode for IdError {
    fn grpc_code(&self) -> Code {
        Code::InvalidArgument
    }
}

/// [`to_status`] of an [`IdError`].
pub fn from_id_error(e: IdError) -> Status {
    to_status(e)
}

/// Wraps a tonic service so a request over the decode limit answers
/// `RESOURCE_EXHAUSTED` (the gRPC convention for "message larger than the
/// configured limit") instead of tonic's `OUT_OF_RANGE`. Only that one
/// status is rewritten (matched by tonic's message); everything else passes
/// through. Real builds only: madsim's simulated tonic has no HTTP layer.
#[cfg(not(madsim))]
#[derive(Clone, Debug)]
pub struct LimitAsResourceExhausted<S>(pub S);

#[cfg(not(madsim))]
impl<S: tonic::server::NamedService> tonic::server::NamedService for LimitAsResourceExhausted<S> {
    const NAME: &'static str = S::NAME;
}

#[cfg(not(madsim))]
impl<S, B, RB> tonic::codegen::Service<tonic::codegen::http::Request<B>> for LimitAsResourceExhausted<S>
where
    S: tonic::codegen::Service<tonic::codegen::http::Request<B>, Response = tonic::codegen::http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tonic::codegen::BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let fut = self.0.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let over_limit = resp.extensions().get::<Status>().is_some_and(|s| {
                s.code() == Code::OutOfRange && s.message().starts_with("Error, decoded message length too large")
            });
            if over_limit {
                let code = (Code::ResourceExhausted as i32).to_string();
                if let Ok(v) = tonic::codegen::http::HeaderValue::from_str(&code) {
                    resp.headers_mut().insert(Status::GRPC_STATUS, v);
                }
            }
            Ok(resp)
        })
    }
}
