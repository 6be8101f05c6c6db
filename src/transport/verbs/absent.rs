//! The verbs backend's place in a build without feature `rdma`: the names
//! `device` exports, so the node (and an embedder) reads the same in every
//! build. [`VerbsTransport::open`] answers [`VerbsError::NotBuilt`], and no
//! value of [`VerbsTransport`] can exist: it has no variants, so every
//! method below is unreachable by construction (`match *self {}`), not by
//! a runtime check.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::time::Instant;

use super::super::{DataSource, HandshakeMetadata, ReadCompletion, ReadOp, Transport, TransportError, TransportKind};
use super::VerbsConfig;
use crate::memory::pool::{Extent, Pool};
use crate::types::NodeAddr;

/// The verbs transport of an `rdma` build; in this build, a type with no
/// values.
#[derive(Debug)]
pub enum VerbsTransport {}

/// Why the verbs transport could not start: in this build, always because
/// it was not built.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// This build has no verbs backend.
    #[error("this build has no RDMA verbs backend: it was built without the `rdma` feature")]
    NotBuilt,
}

impl VerbsError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            VerbsError::NotBuilt => "verbs_not_built",
        }
    }
}

impl VerbsTransport {
    /// Refuses: the `rdma` build opens the device named by `cfg` here.
    ///
    /// # Errors
    /// Always [`VerbsError::NotBuilt`].
    pub fn open(
        _cfg: &VerbsConfig,
        _node: NodeAddr,
        _pool: &Pool,
        _source: Arc<dyn DataSource>,
    ) -> Result<Self, VerbsError> {
        Err(VerbsError::NotBuilt)
    }
}

#[async_trait]
impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        match *self {}
    }

    fn local_metadata(&self) -> HandshakeMetadata {
        match *self {}
    }

    async fn connect(
        &self,
        _peer: &NodeAddr,
        _remote: &HandshakeMetadata,
        _deadline: Instant,
    ) -> Result<(), TransportError> {
        match *self {}
    }

    fn disconnect(&self, _peer: &NodeAddr) {
        match *self {}
    }

    async fn read(
        &self,
        _peer: &NodeAddr,
        _session: &str,
        _ops: Vec<ReadOp>,
        _local: Vec<Extent>,
        _deadline: Instant,
    ) -> ReadCompletion {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opening refuses with the stable code, and the message names the
    /// feature that builds the backend.
    #[test]
    fn open_says_the_backend_is_not_built() {
        let pool = Pool::new(1 << 20, 256).unwrap();
        let cfg = VerbsConfig::new("mlx5_0");
        struct NoSource;
        impl DataSource for NoSource {
            fn authorize(
                &self,
                _session: &str,
                _region: u32,
                _offset: u64,
                _len: u64,
            ) -> Result<(crate::memory::pool::SealedExtent, u64), crate::transport::AccessError> {
                unreachable!("open refuses before anything is served")
            }
        }
        let e = VerbsTransport::open(&cfg, NodeAddr::parse("127.0.0.1:1").unwrap(), &pool, Arc::new(NoSource))
            .expect_err("no verbs backend in this build");
        assert_eq!(e.code(), "verbs_not_built");
        assert!(e.to_string().contains("`rdma` feature"), "{e}");
    }
}
