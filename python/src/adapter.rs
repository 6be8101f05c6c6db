//! The one place the package maps Python calls onto kvferry's Rust API.
//!
//! Everything that depends on the exact shape of the engine API (argument
//! order of save/load, the layout struct, external buffer registration, the
//! shared block hash, namespace naming) lives here, so a change of that API
//! touches this file only.
//!
//! INTERIM until issue 15 ("Embedding for real") lands on main — each item
//! says what it becomes:
//! - buffers: the `host` backend is [`crate::external_host::ExternalHostGpu`]
//!   → `HostGpu::register_external` via `Engine::register_buffer`; the
//!   `cuda` backend cannot register caller memory yet → `CudaGpu` via
//!   `Engine::register_buffer`;
//! - layouts: K and V of a layer become two single-segment kvferry layers
//!   (K of layer i = kvferry layer 2i, V = 2i+1); the pool bytes of a block
//!   are the same (every layer's K then V) → one `LayerLayout { k, v }`;
//! - hash and namespace: a local SHA-256 chain and name → `kvferry::hash`;
//! - `fetch_into`: fetch then load → `Engine::fetch_into`;
//! - unregistering a layout: refused → `Engine::unregister_layout`.

use std::sync::Arc;

use bytes::Bytes;
use kvferry::engine::layout::{DeviceBufferId, LayerLayout};
use kvferry::engine::{Engine, EngineError, LoadReport, SaveReport};
use kvferry::gpu::{Gpu, GpuError};
use kvferry::types::BlockHash;
use sha2::{Digest, Sha256};

use crate::external_host::ExternalHostGpu;

/// The GPU backend a node runs with, kept concrete so buffers can be
/// registered through it.
#[derive(Clone)]
pub enum Backend {
    /// Caller host memory.
    Host(Arc<ExternalHostGpu>),
    /// A CUDA device (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(Arc<kvferry::gpu::cuda::CudaGpu>),
}

/// Why a buffer could not be registered.
#[derive(Debug)]
pub enum RegisterError {
    /// The backend refused the range.
    Gpu(GpuError),
    /// This build of kvferry cannot do it yet (the message says what).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Unsupported(&'static str),
}

impl Backend {
    /// Opens `kind` (`host` or `cuda`) on `device`.
    pub fn open(kind: &str, device: usize) -> Result<Self, String> {
        match kind {
            "host" => Ok(Backend::Host(Arc::new(ExternalHostGpu::new()))),
            #[cfg(feature = "cuda")]
            "cuda" => {
                kvferry::gpu::cuda::CudaGpu::new(device).map(|g| Backend::Cuda(Arc::new(g))).map_err(|e| e.to_string())
            }
            #[cfg(not(feature = "cuda"))]
            "cuda" => {
                let _ = device;
                Err("this kvferry wheel was built without CUDA; build it with `maturin build --release --features cuda`".into())
            }
            other => Err(format!("unknown gpu backend {other:?} (use \"host\" or \"cuda\")")),
        }
    }

    /// The backend as the engine sees it.
    pub fn gpu(&self) -> Arc<dyn Gpu> {
        match self {
            Backend::Host(g) => g.clone(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.clone(),
        }
    }

    /// Registers caller memory `[addr, addr + len)`.
    ///
    /// # Safety
    /// The memory stays valid until [`Backend::unregister`].
    pub unsafe fn register(&self, _engine: &Engine, addr: u64, len: u64) -> Result<DeviceBufferId, RegisterError> {
        match self {
            // SAFETY: forwarded contract.
            Backend::Host(g) => unsafe { g.register_external(addr, len) }.map_err(RegisterError::Gpu),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Err(RegisterError::Unsupported(
                "registering caller CUDA memory needs kvferry's Gpu::register_external (issue 15), not in this build",
            )),
        }
    }

    /// Forgets a registered buffer.
    pub fn unregister(&self, _engine: &Engine, id: DeviceBufferId) -> Result<(), GpuError> {
        match self {
            Backend::Host(g) => g.unregister(id),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Err(GpuError::UnknownBuffer(id)),
        }
    }
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
    let seg = |(buf, off): (u32, u64), l: &PyLayer| LayerLayout {
        buffer: DeviceBufferId(buf),
        base_offset: off,
        num_blocks: l.num_blocks,
        bytes_per_block: l.bytes_per_block,
        segments: 1,
        block_stride: l.block_stride,
        kv_stride: 0,
    };
    layers.iter().flat_map(|l| std::iter::once(seg(l.k, l)).chain(l.v.map(|v| seg(v, l)))).collect()
}

/// Registers a namespace's layout.
pub fn register_layout(engine: &Engine, namespace: &str, layers: &[PyLayer]) -> Result<(), EngineError> {
    engine.register_layout(namespace, engine_layers(layers))
}

/// Saves `(hash, block index)` pairs.
pub async fn save(engine: &Engine, namespace: &str, blocks: Vec<(BlockHash, u64)>) -> Result<SaveReport, EngineError> {
    let pairs: Vec<(u64, BlockHash)> = blocks.into_iter().map(|(h, i)| (i, h)).collect();
    engine.save(namespace, &pairs).await
}

/// Loads `(hash, block index)` pairs.
pub async fn load(engine: &Engine, namespace: &str, blocks: Vec<(BlockHash, u64)>) -> Result<LoadReport, EngineError> {
    engine.load(namespace, &blocks).await
}

/// Domain tag of the interim chained hash.
const HASH_DOMAIN: &[u8] = b"kvferry-block-v0\0";

/// Chained hashes of the full `block_tokens`-token blocks of `tokens` in
/// `namespace`: block i's hash covers the namespace and every token up to
/// the end of block i.
pub fn block_hashes(namespace: &str, tokens: &[u32], block_tokens: usize) -> Vec<BlockHash> {
    let mut prev: Option<[u8; 32]> = None;
    tokens
        .chunks_exact(block_tokens.max(1))
        .map(|chunk| {
            let mut h = Sha256::new();
            h.update(HASH_DOMAIN);
            match prev {
                Some(p) => h.update(p),
                None => {
                    h.update((namespace.len() as u64).to_le_bytes());
                    h.update(namespace.as_bytes());
                }
            }
            for t in chunk {
                h.update(t.to_le_bytes());
            }
            let out: [u8; 32] = h.finalize().into();
            prev = Some(out);
            BlockHash::new(Bytes::copy_from_slice(&out))
        })
        .collect()
}

/// The namespace naming one KV layout family.
pub fn namespace(model: &str, dtype: &str, block_tokens: u32, tp_rank: u32, tp_size: u32, layers: u32) -> String {
    format!("{model}|{dtype}|bt{block_tokens}|tp{tp_rank}/{tp_size}|l{layers}")
}
