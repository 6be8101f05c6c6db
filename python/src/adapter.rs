//! The one place the package maps Python calls onto kvferry's Rust API:
//! backends, buffer and layout registration, save/load/fetch argument
//! shapes, the shared block hash and namespace naming. A change of that API
//! touches this file only.

use std::sync::Arc;

use kvferry::engine::layout::{DeviceBufferId, LayerLayout, SegmentBase};
use kvferry::engine::{Engine, EngineError, FetchIntoReport, LoadReport, SaveReport};
use kvferry::gpu::{Gpu, GpuError};
use kvferry::hash::{HashError, KvFamily};
use kvferry::types::{BlockHash, NodeAddr};

/// The GPU backend a node runs with.
#[derive(Clone)]
pub struct Backend(Arc<dyn Gpu>);

impl Backend {
    /// Opens `kind` (`host` or `cuda`) on `device`.
    ///
    /// # Errors
    /// The error's stable code (`gpu_open_*`) and its message, with how to
    /// get a backend the wheel was built without.
    pub fn open(kind: &str, device: usize) -> Result<Self, (&'static str, String)> {
        use kvferry::gpu::open::{self, OpenError};
        open::open(kind, device).map(Backend).map_err(|e| {
            let message = match &e {
            OpenError::NotBuilt { .. } => {
                format!("{e}: build the wheel with `maturin build --release --features cuda` (scripts/build-wheel.sh --cuda)")
            }
            OpenError::Device { .. } | OpenError::Driver { .. } => {
                format!("{e} (is the NVIDIA driver loaded and cuda:{device} visible?)")
            }
            OpenError::Unknown(_) => e.to_string(),
            };
            (e.code(), message)
        })
    }

    /// The backend as the engine sees it.
    pub fn gpu(&self) -> Arc<dyn Gpu> {
        self.0.clone()
    }
}

/// Registers caller memory `[addr, addr + len)` with the engine's backend.
///
/// # Safety
/// The memory stays valid until [`unregister_buffer`] returned `Ok`.
pub unsafe fn register_buffer(engine: &Engine, addr: u64, len: u64) -> Result<DeviceBufferId, EngineError> {
    // SAFETY: forwarded contract.
    unsafe { engine.register_buffer(addr, len) }
}

/// The buffers to register for caller ranges `(addr, len)`: `(start, len,
/// members)` per buffer, members indexing `ranges`. Touching ranges share a
/// buffer only inside one allocation (`kvferry::gpu::group_by_allocation`).
pub fn group_buffers(engine: &Engine, ranges: &[(u64, u64)]) -> Result<Vec<(u64, u64, Vec<usize>)>, GpuError> {
    let groups = kvferry::gpu::group_by_allocation(engine.gpu().as_ref(), ranges)?;
    Ok(groups.into_iter().map(|g| (g.start, g.len, g.members)).collect())
}

/// Forgets a registered buffer (refused while a layout names it).
pub fn unregister_buffer(engine: &Engine, id: u32) -> Result<(), EngineError> {
    engine.unregister_buffer(DeviceBufferId(id))
}

/// One layer of a KV cache as the Python side describes it: K (and V) as
/// (buffer, offset of block 0), blocks of `bytes_per_block` every
/// `block_stride` bytes.
#[derive(Clone, Copy, Debug)]
pub struct PyLayer {
    /// K segment: buffer id and offset of block 0.
    pub k: (u32, u64),
    /// V segment, `None` for a single-segment (MLA) layer.
    pub v: Option<(u32, u64)>,
    /// Blocks.
    pub num_blocks: u64,
    /// Bytes of one block of one segment.
    pub bytes_per_block: u64,
    /// Distance between consecutive blocks.
    pub block_stride: u64,
}

/// The engine layers for `layers`.
pub fn engine_layers(layers: &[PyLayer]) -> Vec<LayerLayout> {
    let base = |(buf, off): (u32, u64)| SegmentBase::new(DeviceBufferId(buf), off);
    layers
        .iter()
        .map(|l| LayerLayout {
            num_blocks: l.num_blocks,
            bytes_per_block: l.bytes_per_block,
            block_stride: l.block_stride,
            k: base(l.k),
            v: l.v.map(base),
        })
        .collect()
}

/// Registers a namespace's layout.
pub fn register_layout(engine: &Engine, namespace: &str, layers: &[PyLayer]) -> Result<(), EngineError> {
    engine.register_layout(namespace, engine_layers(layers))
}

/// Forgets a namespace's layout (its resident blocks stay in the pool).
pub fn unregister_layout(engine: &Engine, namespace: &str) -> Result<(), EngineError> {
    engine.unregister_layout(namespace)
}

/// Saves `(hash, block index)` pairs.
pub async fn save(engine: &Engine, namespace: &str, blocks: Vec<(BlockHash, u64)>) -> Result<SaveReport, EngineError> {
    engine.save(namespace, &blocks).await
}

/// Loads `(hash, block index)` pairs, submitting no copy after `deadline`.
pub async fn load(
    engine: &Engine,
    namespace: &str,
    blocks: Vec<(BlockHash, u64)>,
    deadline: tokio::time::Instant,
) -> Result<LoadReport, EngineError> {
    engine.load_with_deadline(namespace, &blocks, deadline).await
}

/// Fetches, by `deadline`, then loads the available prefix into the given
/// block indices, starting from what the caller `known`s: its MetaServer
/// answer for the same hashes, or an owner's transfer ticket.
pub async fn fetch_into(
    engine: &Engine,
    namespace: &str,
    blocks: Vec<(BlockHash, u64)>,
    known: Known,
    deadline: tokio::time::Instant,
) -> Result<FetchIntoReport, EngineError> {
    match known {
        Known::Owners(o) => engine.fetch_into_with_owners(namespace, &blocks, o, deadline).await,
        Known::Ticket(t) => engine.fetch_into_with_ticket(namespace, &blocks, *t, deadline).await,
        Known::Nothing => engine.fetch_into_with_deadline(namespace, &blocks, deadline).await,
    }
}

/// What a `fetch_into` starts from.
pub enum Known {
    /// Nothing: the fetch asks the MetaServer.
    Nothing,
    /// The caller's MetaServer answer.
    Owners(Vec<(NodeAddr, u32)>),
    /// An owner's transfer ticket for this node.
    Ticket(Box<kvferry::engine::TransferTicket>),
}

/// The shared chained hashes (kvferry's v1) of the full blocks of `tokens`.
pub fn block_hashes(namespace: &str, tokens: &[u32], block_tokens: usize) -> Result<Vec<BlockHash>, HashError> {
    kvferry::hash::block_hashes(namespace, tokens, block_tokens)
}

/// The namespace naming one KV layout family.
pub fn namespace(
    model: &str,
    dtype: &str,
    block_tokens: u32,
    tp_rank: u32,
    tp_size: u32,
    layers: u32,
) -> Result<String, HashError> {
    KvFamily { model: model.into(), dtype: dtype.into(), block_tokens, tp_rank, tp_size, layers }.namespace()
}
