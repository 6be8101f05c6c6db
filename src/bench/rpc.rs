//! `kvferry bench rpc`: the round trips a P/D handoff makes before its
//! first byte moves, each against the floor of any request and answer
//! between two tasks of the same runtime.
//!
//! A handoff (`kvferry pd`, T8) is the prefill's registration barrier,
//! the decode's MetaServer query, the transfer lock at the owner, the
//! read, and the release (off the critical path). The first three are
//! round trips whose cost does not shrink with the bytes moved, so for a
//! request whose KV crosses in well under a millisecond (device-direct on
//! one host) they bound T8 from below whatever the read does. This bench
//! measures them on loopback, on the runtime the command runs on (the
//! `kvferry pd` runtime), interleaved call by call:
//!
//! - `raw`: a 64-byte TCP ping-pong between two tasks (`TCP_NODELAY`):
//!   the floor of a request and its answer on this runtime;
//! - `health`: the P2P `Health` RPC (the gRPC stack alone);
//! - `query`: the MetaServer's `QueryPrefixBlocks` of `blocks` hashes
//!   (the decode's query);
//! - `lock`: the owner's `QueryBlocksForTransfer` of `blocks` resident
//!   blocks of the Qwen3-8B layout, packed answer, from the owner's pool
//!   (the transfer lock; its release follows, untimed). A device-direct
//!   lock also grants a device lease and sends the buffer exports, so
//!   this is a lower bound for it;
//! - `barrier`: `blocks` new registrations offered, then the flush that
//!   waits for the MetaServer's acknowledgement (the registration barrier;
//!   their removal follows, untimed, so the index keeps its size).
//!
//! Reported: each one's p50 and p99 in µs and its p50 ÷ the raw p50.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::gpu::host::HostGpu;
use crate::metaserver::{self, MetaServerConfig};
use crate::node::{self, NodeConfig, PathChoice};
use crate::proto::engine_client::EngineClient;
use crate::proto::{HealthRequest, QueryBlocksForTransferRequest, ReleaseTransferLockRequest};
use crate::types::BlockHash;

/// The round trips this bench times, in report order.
pub const RPC_KINDS: [&str; 5] = ["raw", "health", "query", "lock", "barrier"];

/// Calls of each kind that are discarded before timing starts.
const WARMUP: usize = 20;

/// `bench rpc`: `calls` timed round trips of each of [`RPC_KINDS`], the
/// lock, query and barrier over `blocks` blocks (hashes). Returns the JSON
/// it printed: per kind `p50_us`, `p99_us` and `x_raw` (p50 ÷ raw p50).
///
/// # Errors
/// Set-up failures and failed calls as text.
pub async fn rpc(blocks: u64, calls: usize) -> Result<serde_json::Value, String> {
    let ms = metaserver::start(MetaServerConfig::new("127.0.0.1:0".parse().expect("literal")))
        .await
        .map_err(|x| x.to_string())?;
    // The owner: `blocks` resident blocks of `bench engine`'s Qwen3-8B KV.
    let gpu = Arc::new(HostGpu::new());
    let (shape, _, block_bytes) = super::qwen3_host_kv(&gpu, blocks)?;
    let mut cfg = NodeConfig::loopback(format!("http://{}", ms.local_addr));
    cfg.engine.pool_bytes = blocks * block_bytes + (64 << 20);
    cfg.path = PathChoice::Tcp;
    // Room for a whole barrier (and its removal) in the registration queue.
    cfg.queue.depth_max = cfg.queue.depth_max.max(2 * blocks as usize);
    let owner = node::start(cfg, gpu.clone()).await.map_err(|x| x.to_string())?;
    owner.engine.register_layout("bench", shape).map_err(|x| x.to_string())?;
    let hashes: Vec<BlockHash> = (0..blocks).map(BlockHash::from_u64).collect();
    let items: Vec<(BlockHash, u64)> = hashes.iter().cloned().zip(0..).collect();
    owner.engine.save("bench", &items).await.map_err(|x| x.to_string())?;
    let fr = owner.engine.flush_saves_and_registrations(Duration::from_secs(10)).await;
    if fr.dropped > 0 || fr.timed_out {
        return Err(format!("registration failed: {fr:?}"));
    }
    let mut grpc = EngineClient::new(
        crate::rt::channel(&owner.grpc_addr.to_string(), Duration::from_secs(10)).map_err(|x| x.to_string())?,
    )
    .max_decoding_message_size(crate::limits::GRPC_MESSAGE_BYTES_MAX);
    let client = owner.engine.client().clone();
    let (mut ping, pong) = ping_pair().await.map_err(|x| x.to_string())?;

    let mut times: [Vec<f64>; 5] = Default::default();
    let mut fresh = blocks; // hash counter for the barrier's new registrations
    for i in 0..WARMUP + calls {
        let mut lap = [0f64; 5];
        let t = Instant::now();
        ping.write_all(&[7u8; 64]).await.map_err(|x| x.to_string())?;
        ping.read_exact(&mut [0u8; 64]).await.map_err(|x| x.to_string())?;
        lap[0] = t.elapsed().as_secs_f64();
        let t = Instant::now();
        grpc.health(HealthRequest::default()).await.map_err(|x| x.to_string())?;
        lap[1] = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let owners = client.query_prefix("bench", &hashes, Duration::from_secs(10)).await.map_err(|x| x.to_string())?;
        lap[2] = t.elapsed().as_secs_f64();
        if owners.first().map(|o| u64::from(o.1)) != Some(blocks) {
            return Err(format!("the MetaServer answered {owners:?}, not the owner of all {blocks} blocks"));
        }
        let req = QueryBlocksForTransferRequest {
            namespace: "bench".into(),
            block_hashes: hashes.iter().map(|h| h.0.clone()).collect(),
            requester_id: "127.0.0.1:1".into(),
            compact_slots: true,
            packed_blocks: true,
            ..Default::default()
        };
        let t = Instant::now();
        let answer = grpc.query_blocks_for_transfer(req).await.map_err(|x| x.to_string())?.into_inner();
        lap[3] = t.elapsed().as_secs_f64();
        if answer.transfer_session_id.is_empty() {
            return Err("the owner locked nothing".into());
        }
        grpc.release_transfer_lock(ReleaseTransferLockRequest { transfer_session_id: answer.transfer_session_id })
            .await
            .map_err(|x| x.to_string())?;
        let new: Vec<BlockHash> = (fresh..fresh + blocks).map(BlockHash::from_u64).collect();
        fresh += blocks;
        let t = Instant::now();
        let offered = client.try_register("bench", &new);
        let fr = client.flush_with_deadline(Duration::from_secs(10)).await;
        lap[4] = t.elapsed().as_secs_f64();
        if offered != new.len() || fr.dropped > 0 || fr.timed_out {
            return Err(format!("registration barrier: offered {offered} of {}, {fr:?}", new.len()));
        }
        client.try_unregister("bench", &new);
        client.flush_with_deadline(Duration::from_secs(10)).await;
        if i >= WARMUP {
            for (v, s) in times.iter_mut().zip(lap) {
                v.push(s * 1e6);
            }
        }
    }
    drop((ping, pong));
    owner.shutdown(Duration::from_millis(300)).await;
    let _ = ms.shutdown().await;

    let stats: Vec<(f64, f64)> = times
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            (super::nearest_rank(v, 0.5), super::nearest_rank(v, 0.99))
        })
        .collect();
    let raw = stats[0].0;
    outln!(
        "bench rpc (loopback, this runtime: {} worker threads), {blocks} blocks, {calls} calls each, interleaved",
        crate::rt::cpu_parallelism()
    );
    outln!("  (raw: a 64-byte TCP echo between two tasks; x raw: p50 / raw p50; lock: from the pool, no device lease)");
    outln!("  {:<8} {:>10} {:>10} {:>8}", "call", "p50 us", "p99 us", "x raw");
    let mut out = serde_json::Map::new();
    for (name, (p50, p99)) in RPC_KINDS.iter().zip(&stats) {
        outln!("  {name:<8} {p50:>10.1} {p99:>10.1} {:>8.2}", p50 / raw);
        out.insert((*name).to_string(), json!({"p50_us": p50, "p99_us": p99, "x_raw": p50 / raw}));
    }
    out.insert("blocks".into(), json!(blocks));
    out.insert("calls".into(), json!(calls));
    Ok(serde_json::Value::Object(out))
}

/// A connected loopback TCP pair whose far end echoes every 64 bytes it
/// reads, on a task of its own (it ends when the near end closes).
async fn ping_pair() -> std::io::Result<(tokio::net::TcpStream, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let near = tokio::net::TcpStream::connect(listener.local_addr()?).await?;
    near.set_nodelay(true)?;
    let (mut far, _) = listener.accept().await?;
    far.set_nodelay(true)?;
    let echo = tokio::spawn(async move {
        let mut b = [0u8; 64];
        while far.read_exact(&mut b).await.is_ok() {
            if far.write_all(&b).await.is_err() {
                return;
            }
        }
    });
    Ok((near, echo))
}
