//! Embedding kvferry in an inference engine: a prefill engine and a decode
//! engine in one process, each owning its KV memory, moving one prompt's KV
//! through a MetaServer and the TCP data plane.
//!
//! Run: `cargo run --example embed_pd` (the test command runs it too).
//!
//! What an engine team copies:
//! 1. allocate the paged KV cache yourself — per layer a K and a V tensor
//!    `[num_blocks, block_tokens, kv_heads, head_dim]` ("NHD") — and register
//!    each tensor with [`Engine::register_buffer`], then the layout with
//!    [`Engine::register_layout`] under the namespace of its layout family;
//! 2. hash the prompt's full blocks with the shared hash
//!    ([`kvferry::hash::block_hashes`]);
//! 3. prefill: `save` the blocks, then `flush_saves_and_registrations`
//!    before saying "KV ready";
//! 4. decode: `fetch_into` your own block indices, recompute what did not
//!    arrive.
//!
//! Both nodes serve on listeners the example binds itself first
//! (bind-first embedding: a taken port fails at the embedder's own bind).

use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::Engine;
use kvferry::engine::layout::{DeviceBufferId, LayerLayout};
use kvferry::gpu::host::HostGpu;
use kvferry::hash::{KvFamily, block_hashes};
use kvferry::metaserver::{self, MetaServerConfig};
use kvferry::node::{self, NodeConfig, NodeHandle, NodeListeners};

const LAYERS: usize = 4;
const BLOCK_TOKENS: usize = 16;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
/// Bytes of one block of one K (or V) tensor: bf16 elements.
const BLOCK_BYTES: usize = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2;
const NUM_BLOCKS: usize = 32;

/// The engine's own paged KV cache: per layer a K and a V tensor, each
/// `NUM_BLOCKS * BLOCK_BYTES` bytes (16-byte aligned words, as a framework
/// allocator's tensors are aligned). kvferry never allocates or frees it.
struct PagedKv {
    /// `tensors[2 * layer + segment]`, segment 0 = K, 1 = V.
    tensors: Vec<Vec<u128>>,
    buffers: Vec<DeviceBufferId>,
}

impl PagedKv {
    fn new() -> Self {
        let words = NUM_BLOCKS * BLOCK_BYTES / 16;
        Self { tensors: (0..2 * LAYERS).map(|_| vec![0u128; words]).collect(), buffers: Vec::new() }
    }

    /// Registers every tensor, then the layout of `ns` over them.
    fn register(&mut self, engine: &Engine, ns: &str) -> Result<(), Box<dyn std::error::Error>> {
        for t in &mut self.tensors {
            // SAFETY: the tensor outlives its registration: `unregister`
            // runs before `PagedKv` is dropped.
            let id = unsafe { engine.register_buffer(t.as_mut_ptr() as u64, (t.len() * 16) as u64)? };
            self.buffers.push(id);
        }
        let layers = (0..LAYERS)
            .map(|l| {
                let (k, v) = (self.buffers[2 * l], self.buffers[2 * l + 1]);
                LayerLayout::paged(k, Some(v), NUM_BLOCKS as u64, BLOCK_BYTES as u64)
            })
            .collect();
        engine.register_layout(ns, layers)?;
        Ok(())
    }

    /// Undoes `register`: after this the memory is the engine's own again.
    fn unregister(&mut self, engine: &Engine, ns: &str) -> Result<(), Box<dyn std::error::Error>> {
        engine.unregister_layout(ns)?;
        for id in self.buffers.drain(..) {
            engine.unregister_buffer(id)?;
        }
        Ok(())
    }

    fn block(&self, layer: usize, segment: usize, block: usize) -> &[u8] {
        let t = &self.tensors[2 * layer + segment];
        // SAFETY: plain bytes of an owned, initialized Vec.
        let bytes = unsafe { std::slice::from_raw_parts(t.as_ptr().cast::<u8>(), t.len() * 16) };
        &bytes[block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES]
    }

    fn block_mut(&mut self, layer: usize, segment: usize, block: usize) -> &mut [u8] {
        let t = &mut self.tensors[2 * layer + segment];
        // SAFETY: as in `block`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(t.as_mut_ptr().cast::<u8>(), t.len() * 16) };
        &mut bytes[block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES]
    }
}

/// The "model": KV bytes of `tokens` at one layer and segment.
fn compute_kv(tokens: &[u32], layer: usize, segment: usize, out: &mut [u8]) {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ ((layer as u64) << 8 | segment as u64);
    for t in tokens {
        x = (x ^ u64::from(*t)).wrapping_mul(0x100_0000_01B3);
    }
    for b in out {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// A node on listeners bound here first.
async fn start_node(metaserver: &str) -> Result<(NodeHandle, Arc<HostGpu>), Box<dyn std::error::Error>> {
    let listeners = NodeListeners {
        grpc: tokio::net::TcpListener::bind("127.0.0.1:0").await?,
        data: tokio::net::TcpListener::bind("127.0.0.1:0").await?,
    };
    let gpu = Arc::new(HostGpu::new());
    let node = node::start_on(NodeConfig::loopback(metaserver), gpu.clone(), listeners).await?;
    Ok((node, gpu))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ms = metaserver::start(MetaServerConfig::new("127.0.0.1:0".parse()?)).await?;
    let url = format!("http://{}", ms.local_addr);
    let family = KvFamily {
        model: "example/tiny".into(),
        dtype: "bf16".into(),
        block_tokens: BLOCK_TOKENS as u32,
        tp_rank: 0,
        tp_size: 1,
        layers: LAYERS as u32,
    };
    let ns = family.namespace()?;
    let prompt: Vec<u32> = (0..100u32).map(|i| i * 7919 % 32_000).collect();
    let hashes = block_hashes(&ns, &prompt, BLOCK_TOKENS)?; // 6 full blocks; the 4-token tail is never shared

    // Prefill: compute the prompt's KV into its own cache (blocks 10..16),
    // save, and call the handoff barrier before saying "KV ready".
    let (prefill, _) = start_node(&url).await?;
    let mut p_kv = PagedKv::new();
    p_kv.register(&prefill.engine, &ns)?;
    let p_blocks: Vec<usize> = (10..10 + hashes.len()).collect();
    for (i, &b) in p_blocks.iter().enumerate() {
        let upto = &prompt[..(i + 1) * BLOCK_TOKENS];
        for l in 0..LAYERS {
            for s in 0..2 {
                compute_kv(upto, l, s, p_kv.block_mut(l, s, b));
            }
        }
    }
    let to_save: Vec<_> = hashes.iter().cloned().zip(p_blocks.iter().map(|&b| b as u64)).collect();
    let saved = prefill.engine.save(&ns, &to_save).await?;
    let barrier = prefill.engine.flush_saves_and_registrations(Duration::from_secs(5)).await;
    println!("prefill: saved {} blocks, registrations {barrier:?}", saved.saved.len());

    // Decode: fetch straight into its own block indices (different ones).
    let (decode, _) = start_node(&url).await?;
    let mut d_kv = PagedKv::new();
    d_kv.register(&decode.engine, &ns)?;
    let d_blocks: Vec<usize> = (0..hashes.len()).map(|i| 2 * i + 1).collect();
    let owners = decode.engine.client().query_prefix(&ns, &hashes, Duration::from_secs(2)).await?;
    println!("decode: the MetaServer lists {owners:?}");
    let wanted: Vec<_> = hashes.iter().cloned().zip(d_blocks.iter().map(|&b| b as u64)).collect();
    let got = decode.engine.fetch_into(&ns, &wanted).await?;
    let ready = got.ready();
    println!(
        "decode: {ready} of {} blocks ready ({} bytes fetched from {:?}); recompute the other {}",
        hashes.len(),
        got.fetch.bytes,
        got.fetch.owners,
        hashes.len() - ready
    );

    // Every byte of every fetched block equals the prefill's.
    for (i, (&pb, &db)) in p_blocks.iter().zip(&d_blocks).enumerate().take(ready) {
        for l in 0..LAYERS {
            for s in 0..2 {
                if p_kv.block(l, s, pb) != d_kv.block(l, s, db) {
                    return Err(format!("block {i} layer {l} segment {s} differs").into());
                }
            }
        }
    }
    if ready != hashes.len() {
        return Err(format!("only {ready} of {} blocks arrived", hashes.len()).into());
    }
    println!("decode: all {ready} blocks byte-identical to the prefill's");

    // Shutdown: the engines let go of the memory before it is freed.
    d_kv.unregister(&decode.engine, &ns)?;
    p_kv.unregister(&prefill.engine, &ns)?;
    decode.shutdown(Duration::from_secs(2)).await;
    prefill.shutdown(Duration::from_secs(2)).await;
    ms.shutdown().await?;
    Ok(())
}
