//! The MetaServer: a gRPC service over the in-memory [`store::MetaStore`]
//! index of (namespace, block hash) → owners, with node sessions, prefix
//! queries and a TTL sweep (design.md §2.2, contracts C5 and C7).
//!
//! [`start`] is the single entry the binary, the tests and the simulator use,
//! so a simulated restart reruns real start-up.

mod index;
pub mod service;
pub mod store;

pub use service::{MetaServerConfig, MetaServerHandle, MetaServerHooks, ServeError, start};
