//! Shared helpers of `tests/engine.rs` and `tests/fetch.rs`: a real
//! MetaServer, real nodes on loopback with short deadlines, deterministic KV
//! bytes on the (host) device, and a GPU whose completions can be held back.
#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::layout::{self, DeviceBufferId, LayerLayout};
use kvferry::engine::{Engine, EngineConfig, EngineError, SaveReport};
use kvferry::gpu::host::HostGpu;
use kvferry::gpu::{Completion, CopyBatch, Gpu, GpuError, KvMemory};
use kvferry::metaserver::{self, MetaServerConfig, MetaServerHandle};
use kvferry::node::{self, NodeConfig, NodeHandle};
use kvferry::replay::trace::{fill_kv, verify_kv};
use kvferry::transport::tcp::TcpTransport;
use kvferry::types::{BlockHash, NodeAddr};
use tokio::task::JoinHandle;

/// The namespace most tests use.
pub const NS: &str = "test/llama/bf16/tp1/bt16";

/// Small default block geometry: 4 layers x 2 segments x 4 KiB = 32 KiB.
pub const LAYERS: u32 = 4;
pub const SEG: u64 = 4 << 10;
pub const BLOCK: u64 = LAYERS as u64 * 2 * SEG;

/// Fetch deadline of every test engine.
pub const FETCH_DEADLINE: Duration = Duration::from_secs(2);
/// Transfer-lock timeout of every test engine (s).
pub const LOCK_TIMEOUT_SECS: u32 = 1;
/// MetaServer RPC deadline of every test node.
pub const RPC_TIMEOUT: Duration = Duration::from_millis(500);

/// Every test body runs under this bound: a hang is a failure, not a stuck CI job.
pub async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f).await.expect("test hung (60 s bound)")
}

/// Polls `f` every 10 ms until it holds or `within` passes; returns whether it held.
pub async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Engine settings with short deadlines.
pub fn engine_cfg(pool_bytes: u64) -> EngineConfig {
    EngineConfig {
        pool_bytes,
        lock_timeout_secs: LOCK_TIMEOUT_SECS,
        lock_gc_interval: Duration::from_millis(100),
        fetch_deadline: FETCH_DEADLINE,
        peer_rpc_timeout: Duration::from_millis(500),
        ..EngineConfig::default()
    }
}

/// A real MetaServer on an OS-picked loopback port.
pub async fn start_ms() -> MetaServerHandle {
    metaserver::start(MetaServerConfig::new("127.0.0.1:0".parse().expect("literal"))).await.expect("metaserver start")
}

/// Loopback node settings pointing at `ms`.
pub fn node_cfg(ms_addr: std::net::SocketAddr, pool_bytes: u64) -> NodeConfig {
    let mut c = NodeConfig::loopback(format!("http://{ms_addr}"));
    // These suites test the TCP data plane and drive its fault hooks (a
    // same-host shared pool would carry their reads instead); the default
    // path choice, the shared pool and the fallback are `tests/shm.rs`'s.
    c.path = kvferry::node::PathChoice::Tcp;
    c.engine = engine_cfg(pool_bytes);
    c.metaserver_rpc_timeout = RPC_TIMEOUT;
    c
}

/// A node with its own host "GPU"; the concrete GPU handle comes back too
/// (failure injection).
pub async fn start_node(ms: &MetaServerHandle, pool_bytes: u64) -> (NodeHandle, Arc<HostGpu>) {
    start_node_cfg(node_cfg(ms.local_addr, pool_bytes)).await
}

/// [`start_node`] with explicit settings.
pub async fn start_node_cfg(cfg: NodeConfig) -> (NodeHandle, Arc<HostGpu>) {
    let gpu = Arc::new(HostGpu::new());
    let n = node::start(cfg, gpu.clone() as Arc<dyn Gpu>).await.expect("node start");
    (n, gpu)
}

/// The TCP transport of a node started with the default data plane.
pub fn tcp(n: &NodeHandle) -> &Arc<TcpTransport> {
    n.tcp.as_ref().expect("a node with the TCP transport")
}

/// One registered KV layout on one device buffer: memory the test
/// allocated (as an embedder would), registered with the engine.
#[derive(Clone)]
pub struct Kv {
    pub ns: String,
    pub buffer: DeviceBufferId,
    pub layers: Vec<LayerLayout>,
    /// Kept alive as long as any clone of this `Kv` (tests drop it after
    /// their saves and loads completed).
    pub memory: Arc<Vec<Box<dyn KvMemory>>>,
}

impl Kv {
    /// Bytes of one block in the pool (all slots).
    pub fn block_bytes(&self) -> u64 {
        self.layers.iter().map(|l| u64::from(l.segments()) * l.bytes_per_block).sum()
    }

    pub fn num_blocks(&self) -> u64 {
        self.layers[0].num_blocks
    }
}

/// Allocates memory for [`layout::contiguous`] (the test plays the
/// embedder) and registers it as a buffer, then the layout.
pub fn register(
    engine: &Engine,
    ns: &str,
    layers: u32,
    num_blocks: u64,
    seg: u64,
    split: bool,
    layer_first: bool,
) -> Kv {
    let ll = layout::contiguous(DeviceBufferId(u32::MAX), layers, num_blocks, seg, split, layer_first);
    let need = layout::buffer_bytes_needed(&ll);
    let memory = engine.gpu().alloc_kv_memory(need).expect("device alloc");
    // SAFETY: `memory` lives in the returned `Kv` for as long as the test
    // uses the layout.
    let buffer = unsafe { engine.register_buffer(memory.addr(), memory.len()) }.expect("register buffer");
    let ll = layout::contiguous(buffer, layers, num_blocks, seg, split, layer_first);
    engine.register_layout(ns, ll.clone()).expect("register layout");
    Kv { ns: ns.to_string(), buffer, layers: ll, memory: Arc::new(vec![memory]) }
}

/// The default geometry as an engine allocates it: per layer a K and a V
/// tensor of their own ("NHD" paged), allocated by the test.
pub fn register_paged(engine: &Engine, ns: &str, num_blocks: u64) -> Kv {
    let mut memory = Vec::new();
    let mut tensor = || {
        let m = engine.gpu().alloc_kv_memory(num_blocks * SEG).expect("device alloc");
        // SAFETY: `m` lives in the returned `Kv`.
        let id = unsafe { engine.register_buffer(m.addr(), m.len()) }.expect("register buffer");
        memory.push(m);
        id
    };
    let ll: Vec<LayerLayout> =
        (0..LAYERS).map(|_| LayerLayout::paged(tensor(), Some(tensor()), num_blocks, SEG)).collect();
    engine.register_layout(ns, ll.clone()).expect("register layout");
    Kv { ns: ns.to_string(), buffer: ll[0].k.buffer, layers: ll, memory: Arc::new(memory) }
}

/// The default small split layer-first layout (4 x 2 x 4 KiB).
pub fn register_default(engine: &Engine, num_blocks: u64) -> Kv {
    register(engine, NS, LAYERS, num_blocks, SEG, true, true)
}

/// Writes the deterministic KV of `hash` into device block `idx`.
pub fn fill(engine: &Engine, kv: &Kv, idx: u64, hash: &BlockHash) {
    for (l, ly) in kv.layers.iter().enumerate() {
        for s in 0..ly.segments() {
            let mut data = vec![0u8; ly.bytes_per_block as usize];
            fill_kv(&kv.ns, hash, l as u32, u32::from(s), &mut data);
            let off = ly.segment_offset(idx, s).expect("offset");
            engine.gpu().write(ly.segment(s).expect("segment").buffer, off, &data).expect("device write");
        }
    }
}

/// Zeroes device block `idx`.
pub fn clear(engine: &Engine, kv: &Kv, idx: u64) {
    for ly in &kv.layers {
        for s in 0..ly.segments() {
            let zeros = vec![0u8; ly.bytes_per_block as usize];
            engine
                .gpu()
                .write(ly.segment(s).expect("segment").buffer, ly.segment_offset(idx, s).expect("offset"), &zeros)
                .expect("device write");
        }
    }
}

/// Whether device block `idx` holds exactly the KV of `hash`.
pub fn verify(engine: &Engine, kv: &Kv, idx: u64, hash: &BlockHash) -> bool {
    kv.layers.iter().enumerate().all(|(l, ly)| {
        (0..ly.segments()).all(|s| {
            let mut data = vec![0u8; ly.bytes_per_block as usize];
            engine
                .gpu()
                .read(ly.segment(s).expect("segment").buffer, ly.segment_offset(idx, s).expect("offset"), &mut data)
                .expect("device read");
            verify_kv(&kv.ns, hash, l as u32, u32::from(s), &data)
        })
    })
}

/// `BlockHash::from_u64` over a range.
pub fn hashes(ids: std::ops::Range<u64>) -> Vec<BlockHash> {
    ids.map(BlockHash::from_u64).collect()
}

/// Fills device blocks `first_idx..` with the KV bytes of `hs`; returns
/// the `(hash, device block)` list a save of them takes.
pub fn fill_blocks(engine: &Engine, kv: &Kv, first_idx: u64, hs: &[BlockHash]) -> Vec<(BlockHash, u64)> {
    let blocks: Vec<(BlockHash, u64)> = hs.iter().enumerate().map(|(i, h)| (h.clone(), first_idx + i as u64)).collect();
    for (h, idx) in &blocks {
        fill(engine, kv, *idx, h);
    }
    blocks
}

/// Saves `blocks` of namespace [`NS`] from a task of its own (which the test
/// may abort half way).
pub fn spawn_save(engine: &Engine, blocks: Vec<(BlockHash, u64)>) -> JoinHandle<Result<SaveReport, EngineError>> {
    let e = engine.clone();
    tokio::spawn(async move { e.save(NS, &blocks).await })
}

/// Fills device blocks `first_idx..` with `hs` and saves them; panics unless
/// every one was newly saved.
pub async fn fill_and_save(engine: &Engine, kv: &Kv, first_idx: u64, hs: &[BlockHash]) {
    let blocks = fill_blocks(engine, kv, first_idx, hs);
    let rep = engine.save(&kv.ns, &blocks).await.expect("save");
    assert_eq!(rep.saved.len(), hs.len(), "save report {rep:?}");
}

/// Clears device blocks `first_idx..`, loads `hs` into them and verifies
/// every byte against recomputation.
pub async fn load_and_verify(engine: &Engine, kv: &Kv, first_idx: u64, hs: &[BlockHash]) {
    let blocks: Vec<(BlockHash, u64)> = hs.iter().enumerate().map(|(i, h)| (h.clone(), first_idx + i as u64)).collect();
    for (_, idx) in &blocks {
        clear(engine, kv, *idx);
    }
    let rep = engine.load(&kv.ns, &blocks).await.expect("load");
    assert_eq!(rep.loaded(), hs.len(), "load report {rep:?}");
    for (h, idx) in &blocks {
        assert!(verify(engine, kv, *idx, h), "block {h:?} at device index {idx} differs from recomputation");
    }
}

/// The MetaServer's prefix answer for `hs`, as the engine's client sees it.
pub async fn ms_prefix(engine: &Engine, ns: &str, hs: &[BlockHash]) -> Vec<(NodeAddr, u32)> {
    engine.client().query_prefix(ns, hs, Duration::from_secs(2)).await.expect("metaserver query")
}

/// The prefix length the MetaServer lists for `node` (0 when not listed).
pub async fn ms_prefix_of(engine: &Engine, ns: &str, hs: &[BlockHash], node: &NodeAddr) -> u32 {
    ms_prefix(engine, ns, hs).await.into_iter().find(|(n, _)| n == node).map_or(0, |(_, l)| l)
}

/// A host GPU whose completions are held back while its gate is closed
/// (the copies themselves run at submit): a save stays "in flight" as long
/// as the test wants. Held batches complete when the gate opens, or one at
/// a time newest first ([`GatedGpu::release_newest`]), so a save's copy
/// batches can complete in the reverse of their submission order.
pub struct GatedGpu {
    pub inner: Arc<HostGpu>,
    /// Whether the gate is open, and the completions held while closed.
    gate: std::sync::Mutex<(bool, Vec<tokio::sync::oneshot::Sender<()>>)>,
}

impl GatedGpu {
    /// A closed gate over a fresh host GPU.
    pub fn new() -> Self {
        Self::over(HostGpu::new())
    }

    /// A closed gate over a host GPU that checksums save slots itself.
    pub fn with_device_checksums() -> Self {
        Self::over(HostGpu::with_device_checksums())
    }

    fn over(gpu: HostGpu) -> Self {
        Self { inner: Arc::new(gpu), gate: Default::default() }
    }

    /// Opens (every held completion goes) or closes the gate.
    pub fn set_open(&self, open: bool) {
        let mut gate = self.gate.lock().unwrap();
        gate.0 = open;
        if open {
            for tx in gate.1.drain(..) {
                let _ = tx.send(());
            }
        }
    }

    /// Completions held back.
    pub fn held(&self) -> usize {
        self.gate.lock().unwrap().1.len()
    }

    /// Lets the most recently submitted held batch complete; `false` when
    /// none is held.
    pub fn release_newest(&self) -> bool {
        self.gate.lock().unwrap().1.pop().map(|tx| tx.send(())).is_some()
    }
}

impl Gpu for GatedGpu {
    fn name(&self) -> &'static str {
        "gated-host"
    }

    unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, GpuError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.register_external(addr, len) }
    }

    fn unregister(&self, id: DeviceBufferId) -> Result<(), GpuError> {
        self.inner.unregister(id)
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.inner.buffer_len(id)
    }

    fn alloc_kv_memory(&self, bytes: u64) -> Result<Box<dyn KvMemory>, GpuError> {
        self.inner.alloc_kv_memory(bytes)
    }

    /// A held batch keeps its buffers pinned (busy) until it completes, as
    /// the CUDA backend's batches do while the device copies.
    fn submit(&self, batch: CopyBatch) -> Completion {
        let pin = self.inner.buffers().pin_batch(batch.ops.iter().map(|op| op.buffer));
        let done = self.inner.submit(batch);
        let mut gate = self.gate.lock().unwrap();
        if gate.0 {
            return done;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        gate.1.push(tx);
        Box::pin(async move {
            let _ = rx.await;
            let done = done.await;
            drop(pin);
            done
        })
    }

    fn checksums_on_device(&self) -> bool {
        self.inner.checksums_on_device()
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        self.inner.write(id, offset, data)
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError> {
        self.inner.read(id, offset, out)
    }
}
