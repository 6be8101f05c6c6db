//! # kvferry
//!
//! A KV-cache storage and transfer core for disaggregated (prefill/decode)
//! LLM serving. A prefill node copies sealed KV blocks from the GPU into a
//! pinned host pool and registers them in a cluster-wide MetaServer index; a
//! decode node fetches them from the owner over a one-sided-READ transport,
//! verifying every slot's checksum — or, when anything fails, degrades to
//! recompute with no hang, no crash and no wrong byte.
//!
//! Vocabulary and contracts (C1–C14) follow `docs/design.md`; the gRPC
//! surface is wire-compatible with PegaFlow (package `pegaflow`).
//!
//! ## Layout
//! - [`client`]: the registration queue (pure, [`client::queue`]), the
//!   session lifecycle (pure, [`client::session`]) and their async driver
//!   with the flush barrier.
//! - [`metaserver`]: the index store (pure, [`metaserver::store`]) and the
//!   gRPC service.
//! - [`memory`]: the bottom layer — the pinned pool and its extents, the
//!   registry of device buffers.
//! - [`disk`]: the SSD tier below the pool (beside `memory`): records with
//!   their identity and per-slot checksums, verified on every read and on
//!   recovery.
//! - [`engine`]: layouts, cache, transfer locks, save/load, fetch.
//! - [`gpu`]: the `Gpu` door and its backends.
//! - [`hash`]: the shared, versioned block hash and layout-family
//!   namespaces.
//! - [`transport`]: the `Transport` door, wire codecs and backends.
//! - [`p2p`]: the P2P transfer gRPC service.
//! - [`node`]: `start(config)` for a whole node.
//! - [`replay`]: the main job (`kvferry pd`).
//!
//! ## Threads and tasks
//! Everything that runs in the simulator is a tokio task: the client driver,
//! the MetaServer sweep, the engine's lock GC, save/seal, fetch, the gRPC
//! services and the TCP transport (madsim provides a simulated `TcpStream`).
//! Under `--cfg madsim` no OS thread is spawned and no std timed wait is
//! used; all time comes from `tokio::time` and all ids from seeded or
//! runtime-provided RNGs, so a seed fixes a run. OS threads are allowed only
//! outside the simulator: the binary's HTTP exporter (`/metrics`,
//! `/health`) and GPU backends whose drivers block (`cuda`). Std mutexes are
//! held only for short, non-awaiting sections.

// The simulator runs the embedded defaults only: the real GPU backend, RDMA
// verbs and TLS talk to hardware or to a TLS stack madsim does not model,
// so a `--cfg madsim` build refuses them here, once, and the modules gate on
// the feature alone.
#[cfg(all(madsim, any(feature = "cuda", feature = "rdma", feature = "tls")))]
compile_error!("the simulator (--cfg madsim) builds none of the features `cuda`, `rdma`, `tls`: drop them");

#[cfg(all(feature = "cli", real_os))]
pub mod bench;
pub mod canary;
pub mod client;
pub mod disk;
pub mod engine;
#[cfg(all(feature = "cli", real_os))]
pub mod exporter;
pub mod gpu;
pub mod hash;
pub mod limits;
#[cfg(feature = "cli")]
pub mod logging;
pub mod memory;
pub mod metaserver;
pub mod node;
pub mod p2p;
pub mod replay;
pub mod rt;
pub mod status;
pub mod tls;
pub mod transport;
pub mod types;

#[cfg(any(test, fuzzing))]
pub mod testing;

/// Generated gRPC messages and stubs (package `pegaflow`).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    tonic::include_proto!("pegaflow");
}
