//! The README's "Embedding kvferry" snippet, whole and compiled: the lines
//! between `README-BEGIN` and `README-END` are the README's, verbatim
//! (`tests/readme.rs` checks they stay the same). `cargo test --all-targets`
//! builds it; `cargo run --example embed_readme` runs it (the test command
//! does). `examples/embed_pd.rs` is the longer walk-through that checks
//! every byte.

use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::layout::LayerLayout;
use kvferry::gpu::host::HostGpu;
use kvferry::gpu::{Gpu, KvMemory};
use kvferry::hash::{KvFamily, block_hashes};
use kvferry::metaserver::{self, MetaServerConfig};
use kvferry::node::{self, NodeConfig, NodeHandle, NodeListeners};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // README-BEGIN
    // Once per cluster: a MetaServer (or run `kvferry metaserver` and dial its address).
    let ms = metaserver::start(MetaServerConfig::new("127.0.0.1:0".parse()?)).await?;
    let metaserver_url = format!("http://{}", ms.local_addr);

    // Once per engine: a node on listeners you bound (a taken port fails here, at your bind).
    let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new()); // feature `cuda`: Arc::new(CudaGpu::new(device)?)
    async fn start_node(url: &str, gpu: Arc<dyn Gpu>) -> Result<NodeHandle, Box<dyn std::error::Error>> {
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let data = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        Ok(node::start_on(NodeConfig::loopback(url), gpu, NodeListeners { grpc, data }).await?)
    }
    let prefill = start_node(&metaserver_url, gpu.clone()).await?;
    let decode = start_node(&metaserver_url, gpu.clone()).await?; // normally another process

    // The layout family names the namespace; `layers` must match the layers you register.
    let family = KvFamily {
        model: "my-model".into(),
        dtype: "bf16".into(),
        block_tokens: 16,
        tp_rank: 0,
        tp_size: 1,
        layers: 2,
    };
    let ns = family.namespace()?;

    // Your paged KV cache: per layer a K and a V tensor [num_blocks, 16 tokens, 8 heads, 128] bf16.
    // Addresses, lengths and block indices are u64 (bytes, blocks). Here the backend allocates it as
    // your framework would; with PyTorch it is `tensor.data_ptr()` and its byte length.
    let (num_blocks, block_bytes): (u64, u64) = (64, 16 * 8 * 128 * 2);
    let mut caches = Vec::new(); // (engine, memory, buffer ids) per node
    for n in [&prefill, &decode] {
        let memory: Vec<Box<dyn KvMemory>> =
            (0..2 * 2).map(|_| gpu.alloc_kv_memory(num_blocks * block_bytes)).collect::<Result<_, _>>()?;
        let mut ids = Vec::new();
        for m in &memory {
            // SAFETY: `memory` stays alive, at the same address, until the buffer is unregistered below.
            ids.push(unsafe { n.engine.register_buffer(m.addr(), m.len())? }); // one buffer per allocation
        }
        let layers = (0..2).map(|l| LayerLayout::paged(ids[2 * l], Some(ids[2 * l + 1]), num_blocks, block_bytes));
        n.engine.register_layout(&ns, layers.collect())?;
        caches.push((n.engine.clone(), memory, ids));
    }

    // Per request, prefill: hash the full blocks, save from your block indices, barrier, then "KV ready".
    let prompt_tokens: Vec<u32> = (0..100).collect();
    let hashes = block_hashes(&ns, &prompt_tokens, 16)?; // 6 full blocks; the 4-token tail is never shared
    let prefill_blocks: Vec<u64> = (10..16).collect();
    prefill.engine.save(&ns, &hashes.iter().cloned().zip(prefill_blocks).collect::<Vec<_>>()).await?;
    let barrier = prefill.engine.flush_saves_and_registrations(Duration::from_secs(2)).await;
    assert!(!barrier.timed_out && barrier.dropped == 0); // else say "KV ready" only for what was delivered

    // Per request, decode: fetch into your block indices; recompute from `ready` on.
    let decode_blocks: Vec<u64> = (0..6).collect();
    let got = decode.engine.fetch_into(&ns, &hashes.iter().cloned().zip(decode_blocks).collect::<Vec<_>>()).await?;
    let ready = got.ready();
    println!("{ready} of {} blocks ready, recompute the rest", hashes.len());

    // Shutdown, in this order: layouts, buffers (then the memory is yours to free), nodes, MetaServer.
    for (engine, memory, ids) in caches {
        engine.unregister_layout(&ns)?;
        for id in ids {
            engine.unregister_buffer(id)?;
        }
        drop(memory);
    }
    decode.shutdown(Duration::from_secs(2)).await;
    prefill.shutdown(Duration::from_secs(2)).await;
    ms.shutdown().await?;
    // README-END
    assert_eq!(ready, hashes.len());
    Ok(())
}
