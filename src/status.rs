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

/// Store errors → `FAILED_PRECONDITION`, all three of them, as the peer
/// MetaServer (pegaflow-metaserver) answers: an unknown node or a stale
/// session on a write, and a heartbeat from a different session while the
/// address's registered session is still live. That is the one code the
/// peer's clients act on (they reset their "registered" flag and heartbeat
/// again, with backoff); a conflicting heartbeat succeeds once the other
/// session goes stale. The message names which case it was. The full table
/// of codes per RPC is in `docs/wire.md`.
pub fn from_store_error(e: StoreError) -> Status {
    let code = match e {
        StoreError::UnknownNode { .. } | StoreError::StaleSession { .. } | StoreError::LiveSessionConflict { .. } => {
            Code::FailedPrecondition
        }
    };
    Status::new(code, e.to_string())
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
