//! `kvferry._native`: the Rust half of the `kvferry` Python package.
//!
//! The public, documented API is the pure-Python layer (`kvferry/`), which
//! turns tensors into addresses, reports into dataclasses and keeps
//! registered arrays alive. This module exposes:
//! - `MetaServer`: an in-process MetaServer on its own tokio runtime;
//! - `Node`: a kvferry node (engine, P2P service, transport) on its own
//!   tokio runtime, so two nodes in one process share nothing;
//! - `block_hashes`, `namespace`.
//!
//! Every blocking call releases the GIL, is bounded by a deadline, and
//! waits in slices of [`WAIT_SLICE`] between which it polls for signals, so
//! Ctrl-C interrupts a wait (the operation is then abandoned on the runtime,
//! which is safe: a save finishes on its own task, a fetch releases its
//! transfer lock from its guard). Errors are `kvferry.errors` exceptions
//! whose `code` is the Rust error's stable `code()`; the class is chosen
//! from the code (`kvferry.errors.CODE_CLASSES`), never from message text.

mod adapter;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvferry::client::ClientError;
use kvferry::engine::fetch::FetchReport;
use kvferry::engine::{ConnectError, Engine, EngineError, SharedPool};
use kvferry::gpu::GpuError;
use kvferry::metaserver::{MetaServerConfig, MetaServerHandle};
use kvferry::node::{NodeConfig, NodeError, NodeHandle};
use kvferry::status::Code;
use kvferry::types::BlockHash;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tokio::runtime::Runtime;

use adapter::{Backend, PyLayer};

/// Longest the GIL-free part of a wait lasts before signals are polled.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// Slack past a call's own deadline before the wait gives up on the
/// runtime (every engine call is bounded by itself; this guards a wedged
/// runtime).
const WAIT_GRACE: Duration = Duration::from_secs(2);
/// How long past its deadline a fetch or load may run before the binding
/// gives up on it as wedged (a `DeadlineError`). The engine ends every step
/// by the deadline (query, handshake, lock, reads, checksum pass, load
/// tail; the release is handed to a task of its own) except for copies
/// into the caller's cache already started, which are awaited (they write
/// its KV blocks): at most the parts in flight, milliseconds. The binding
/// adds no bound of its own and makes up no report.
const FETCH_OVERRUN_MAX: Duration = Duration::from_secs(1);
/// Most worker threads of each runtime. A fetch receives each of the
/// transport's connections to a peer (4 by default) on a task of its own
/// and checksums parts on further tasks, so it runs as fast as the workers
/// it gets (H200, 1.2 GB fetched: 243 ms with 2 workers); the rest of the
/// engine's work is I/O-bound. At most 8, at most the machine's cores, at
/// least 2, so the caller's model keeps cores of its own.
const RUNTIME_WORKERS_MAX: usize = 8;

/// An error on its way to Python: its stable code (the Rust error's
/// `code()`, or one of the binding's own), the message, and the
/// `kvferry.errors` class where the call site picks one (`None`: the class
/// `kvferry.errors.CODE_CLASSES` maps the code to). No text is parsed.
#[derive(Debug)]
struct Fail {
    class: Option<&'static str>,
    code: &'static str,
    msg: String,
}

impl Fail {
    /// A failure raised as `class` whatever its code.
    fn new(class: &'static str, code: &'static str, msg: impl Into<String>) -> Self {
        Self { class: Some(class), code, msg: msg.into() }
    }

    /// A failure raised as the class its code maps to.
    fn coded(code: &'static str, msg: impl Into<String>) -> Self {
        Self { class: None, code, msg: msg.into() }
    }
}

impl From<Fail> for PyErr {
    fn from(f: Fail) -> PyErr {
        Python::attach(|py| {
            let made = PyModule::import(py, "kvferry.errors")
                .and_then(|m| m.getattr("error_for"))
                .and_then(|make| make.call1((f.code, f.msg.clone(), f.class)));
            match made {
                Ok(v) => PyErr::from_value(v),
                Err(e) => e,
            }
        })
    }
}

fn gpu_fail(e: GpuError) -> Fail {
    let hint = match e {
        GpuError::Unavailable(_) => " (is the device visible and the driver loaded?)",
        GpuError::OutOfRange(_) | GpuError::UnknownBuffer(_) => {
            " (the registered tensor is smaller than the layout needs, or was unregistered)"
        }
        GpuError::External(_) => {
            " (pass a live CUDA tensor of this node's device: freed memory is no longer device memory)"
        }
        GpuError::Buffer(_) => {
            " (a buffer must be non-null, 16-byte aligned and must not overlap another registered buffer)"
        }
        _ => "",
    };
    Fail::coded(e.code(), format!("{e}{hint}"))
}

fn engine_fail(e: EngineError) -> Fail {
    let code = e.code();
    match e {
        EngineError::UnknownNamespace(ns) => Fail::coded(
            code,
            format!("no KV layout registered for namespace {ns:?}: call Node.register_kv_cache first"),
        ),
        EngineError::LayoutExists(ns) => Fail::coded(
            code,
            format!("namespace {ns:?} already has a different layout: use another namespace or the same tensors"),
        ),
        EngineError::Layout(l) => Fail::coded(
            code,
            format!("layout rejected: {l} (check the tensors' shapes and that every buffer is large enough)"),
        ),
        EngineError::BlockIndex { idx, num_blocks } => {
            Fail::coded(code, format!("block index {idx} out of range: the registered cache has {num_blocks} blocks"))
        }
        EngineError::Pool(p) => Fail::new(
            "PoolFullError",
            code,
            format!("{p}: the pinned pool is full even after eviction; start the node with a larger pool_bytes"),
        ),
        EngineError::Gpu(g) => gpu_fail(g),
        e @ EngineError::Lease(kvferry::engine::leases::LeaseError::TooMany { .. }) => {
            Fail::coded(code, format!("{e}: drain Node.ended_device_leases()"))
        }
        e @ EngineError::NamespaceMismatch { .. } => {
            Fail::coded(code, format!("{e}: register one K (and V) tensor per layer the namespace names"))
        }
        other => Fail::coded(code, other.to_string()),
    }
}

fn node_fail(e: NodeError) -> Fail {
    let code = e.code();
    match e {
        NodeError::Engine(EngineError::Gpu(g)) => gpu_fail(g),
        NodeError::Engine(e @ EngineError::Disk(_)) => Fail::new(
            "StartError",
            code,
            format!(
                "{e} (ssd_dir: an existing directory on a local SSD file system, one per node; ssd_bytes: its size)"
            ),
        ),
        NodeError::Client(c) => {
            Fail::new("ConfigError", code, format!("{c}: pass the MetaServer as host:port (e.g. MetaServer().address)"))
        }
        other => Fail::new("StartError", code, format!("node start failed: {other}")),
    }
}

fn closed() -> Fail {
    Fail::coded("closed", "this object was shut down; create a new one")
}

fn runtime() -> Result<Runtime, Fail> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, RUNTIME_WORKERS_MAX))
        .thread_name("kvferry-rt")
        .enable_all()
        .build()
        .map_err(|e| Fail::coded("runtime", format!("cannot start the tokio runtime: {e}")))
}

/// Runs `fut` on `rt` bounded by `timeout`, with the GIL released, polling
/// signals every [`WAIT_SLICE`]. `Ok(None)` when `timeout` passed first.
fn wait<T, F>(py: Python<'_>, rt: &Runtime, timeout: Duration, fut: F) -> PyResult<Option<T>>
where
    T: Send + 'static,
    F: Future<Output = T> + Send + 'static,
{
    let (tx, mut rx) = std::sync::mpsc::sync_channel(1);
    let task = rt.spawn(async move {
        let _ = tx.send(tokio::time::timeout(timeout, fut).await.ok());
    });
    let give_up = Instant::now() + timeout + WAIT_GRACE;
    loop {
        let (got, back) = py.detach(move || {
            let got = rx.recv_timeout(WAIT_SLICE);
            (got, rx)
        });
        rx = back;
        match got {
            Ok(v) => return Ok(v),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Fail::coded("task_lost", "the operation's task ended without a result").into());
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Err(e) = py.check_signals() {
                    task.abort();
                    return Err(e);
                }
                if Instant::now() >= give_up {
                    task.abort();
                    return Ok(None);
                }
            }
        }
    }
}

fn deadline_fail(what: &str, timeout: Duration) -> Fail {
    Fail::coded(
        "deadline",
        format!(
            "{what} did not finish within {:.3} s; raise the timeout or check the MetaServer and peers",
            timeout.as_secs_f64()
        ),
    )
}

fn secs(timeout_s: f64) -> PyResult<Duration> {
    if !(timeout_s.is_finite() && timeout_s > 0.0 && timeout_s <= 86_400.0) {
        return Err(
            Fail::coded("bad_timeout", format!("timeout must be in (0, 86400] seconds, got {timeout_s}")).into()
        );
    }
    Ok(Duration::from_secs_f64(timeout_s))
}

fn hashes(list: Vec<Vec<u8>>) -> PyResult<Vec<BlockHash>> {
    list.into_iter()
        .map(|b| {
            let h = BlockHash::new(Bytes::from(b));
            h.validate().map_err(|e| Fail::coded(e.code(), e.to_string()))?;
            Ok(h)
        })
        .collect()
}

fn pairs(hs: Vec<Vec<u8>>, idx: Vec<u64>) -> PyResult<Vec<(BlockHash, u64)>> {
    if hs.len() != idx.len() {
        return Err(Fail::coded(
            "length_mismatch",
            format!("{} hashes but {} block indices: pass one block index per hash", hs.len(), idx.len()),
        )
        .into());
    }
    Ok(hashes(hs)?.into_iter().zip(idx).collect())
}

/// An in-process MetaServer on its own runtime.
#[pyclass(module = "kvferry._native")]
struct MetaServer {
    state: Mutex<Option<(Runtime, MetaServerHandle)>>,
    #[pyo3(get)]
    address: String,
}

#[pymethods]
impl MetaServer {
    #[new]
    #[pyo3(signature = (addr, stale_after_s, ttl_s, sweep_interval_s))]
    fn new(py: Python<'_>, addr: &str, stale_after_s: u64, ttl_s: u64, sweep_interval_s: u64) -> PyResult<Self> {
        let sock = addr
            .parse()
            .map_err(|e| Fail::coded("addr_parse", format!("bad MetaServer address {addr:?}: {e} (want ip:port)")))?;
        let mut cfg = MetaServerConfig::new(sock);
        cfg.stale_after_secs = stale_after_s;
        cfg.ttl_secs = ttl_s;
        cfg.sweep_interval_secs = sweep_interval_s;
        let rt = runtime()?;
        let started = py.detach(|| rt.block_on(kvferry::metaserver::start(cfg)));
        let h = started.map_err(|e| Fail::new("StartError", e.code(), format!("MetaServer start failed: {e}")))?;
        let address = h.local_addr.to_string();
        Ok(Self { state: Mutex::new(Some((rt, h))), address })
    }

    /// Stops serving within `timeout_s`; idempotent.
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let t = secs(timeout_s)?;
        let Some((rt, h)) = self.state.lock().expect("state lock").take() else { return Ok(()) };
        py.detach(move || {
            let _ = rt.block_on(async move { tokio::time::timeout(t, h.shutdown()).await });
            rt.shutdown_timeout(t);
        });
        Ok(())
    }

    /// True while serving.
    fn running(&self) -> bool {
        self.state.lock().expect("state lock").is_some()
    }

    /// The store's and service's counters.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let guard = self.state.lock().expect("state lock");
        let Some((_, h)) = guard.as_ref() else { return Err(closed().into()) };
        let s = h.stats().unwrap_or_default();
        d.set_item("store", format!("{s:?}"))?;
        d.set_item("metrics", format!("{:?}", h.metrics))?;
        Ok(d)
    }
}

impl Drop for MetaServer {
    fn drop(&mut self) {
        if let Some((rt, h)) = self.state.get_mut().ok().and_then(Option::take) {
            drop(h);
            rt.shutdown_background();
        }
    }
}

struct Live {
    rt: Arc<Runtime>,
    handle: NodeHandle,
}

/// A kvferry node on its own runtime.
#[pyclass(module = "kvferry._native")]
struct Node {
    live: Mutex<Option<Live>>,
    #[pyo3(get)]
    address: String,
    #[pyo3(get)]
    gpu: String,
}

impl Node {
    fn engine(&self) -> Result<(Arc<Runtime>, Engine), Fail> {
        let g = self.live.lock().expect("live lock");
        let l = g.as_ref().ok_or_else(closed)?;
        Ok((l.rt.clone(), l.handle.engine.clone()))
    }
}

fn fetch_dict<'py>(py: Python<'py>, r: &FetchReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("requested", r.requested)?;
    d.set_item("available", r.available)?;
    d.set_item("local_hits", r.local_hits)?;
    d.set_item("fetched", r.fetched)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("owners", r.owners.iter().map(|o| o.0.clone()).collect::<Vec<_>>())?;
    d.set_item("stopped", r.stopped.as_ref().map(|e| e.to_string()))?;
    d.set_item("stopped_code", r.stopped.as_ref().map(|e| e.code()))?;
    let phases = PyDict::new(py);
    for (name, t) in r.phases.named() {
        phases.set_item(name, t.as_secs_f64() * 1e3)?;
    }
    d.set_item("phases_ms", phases)?;
    Ok(d)
}

fn load_dict<'py>(py: Python<'py>, r: &kvferry::engine::LoadReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("loaded", r.loaded())?;
    let failed = PyList::empty(py);
    for (i, res) in r.results.iter().enumerate() {
        if let Err(e) = res {
            failed.append((i, e.to_string(), e.code()))?;
        }
    }
    d.set_item("failed", failed)?;
    Ok(d)
}

#[pymethods]
impl Node {
    #[new]
    #[pyo3(signature = (metaserver, pool_bytes, gpu, device, transport, host, grpc_port, data_port, fetch_timeout_s, rpc_timeout_s, ssd_dir=None, ssd_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        metaserver: &str,
        pool_bytes: u64,
        gpu: &str,
        device: usize,
        transport: &str,
        host: &str,
        grpc_port: u16,
        data_port: u16,
        fetch_timeout_s: f64,
        rpc_timeout_s: f64,
        ssd_dir: Option<std::path::PathBuf>,
        ssd_bytes: u64,
    ) -> PyResult<Self> {
        if transport != "tcp" {
            return Err(Fail::coded(
                "bad_transport",
                format!("transport {transport:?} is not available from Python: use \"tcp\""),
            )
            .into());
        }
        let bind = |port: u16| {
            format!("{host}:{port}")
                .parse()
                .map_err(|e| Fail::coded("addr_parse", format!("bad host {host:?}: {e} (want an IP address)")))
        };
        let mut cfg = NodeConfig::loopback(metaserver.to_string());
        cfg.grpc_addr = bind(grpc_port)?;
        cfg.data_addr = bind(data_port)?;
        cfg.advertise_host = host.to_string();
        cfg.engine.pool_bytes = pool_bytes;
        if ssd_dir.is_none() && ssd_bytes != 0 {
            return Err(Fail::new(
                "ConfigError",
                "ssd_dir",
                format!("ssd_bytes = {ssd_bytes} is set but ssd_dir is not: the disk tier needs both"),
            )
            .into());
        }
        cfg.engine.disk = ssd_dir.map(|dir| kvferry::engine::DiskConfig::new(dir, ssd_bytes));
        cfg.engine.fetch_deadline = secs(fetch_timeout_s)?;
        cfg.engine.peer_rpc_timeout = secs(rpc_timeout_s)?;
        cfg.metaserver_rpc_timeout = secs(rpc_timeout_s)?;
        let backend = Backend::open(gpu, device).map_err(|(code, m)| Fail::new("StartError", code, m))?;
        let rt = runtime()?;
        let g = backend.gpu();
        let started = py.detach(|| rt.block_on(kvferry::node::start(cfg, g)));
        let handle = started.map_err(node_fail)?;
        let address = handle.node.0.clone();
        Ok(Self { live: Mutex::new(Some(Live { rt: Arc::new(rt), handle })), address, gpu: gpu.to_string() })
    }

    /// Registers caller memory `[addr, addr + nbytes)`; returns its id.
    /// The caller keeps the memory alive until `unregister_buffer`.
    fn register_buffer(&self, addr: u64, nbytes: u64) -> PyResult<u32> {
        let (_, engine) = self.engine()?;
        // SAFETY: the Python layer holds a reference to the object owning
        // this memory until it unregisters the buffer.
        let r = unsafe { adapter::register_buffer(&engine, addr, nbytes) };
        r.map(|id| id.0).map_err(|e| {
            let mut f = engine_fail(e);
            f.class = Some("BufferError");
            f.msg = format!("cannot register [{addr:#x}, +{nbytes}): {}", f.msg);
            f.into()
        })
    }

    /// The buffers to register for caller ranges `[(addr, nbytes)]`:
    /// `[(start, nbytes, [member index])]` in address order; touching
    /// ranges share one only inside one allocation.
    fn group_buffers(&self, ranges: Vec<(u64, u64)>) -> PyResult<Vec<(u64, u64, Vec<usize>)>> {
        let (_, engine) = self.engine()?;
        adapter::group_buffers(&engine, &ranges).map_err(|e| {
            let mut f = gpu_fail(e);
            f.class = Some("BufferError");
            f.into()
        })
    }

    /// Forgets a registered buffer (refused while a layout names it).
    fn unregister_buffer(&self, id: u32) -> PyResult<()> {
        let (_, engine) = self.engine()?;
        adapter::unregister_buffer(&engine, id).map_err(|e| engine_fail(e).into())
    }

    /// Forgets a namespace's layout.
    fn unregister_layout(&self, namespace: &str) -> PyResult<()> {
        let (_, engine) = self.engine()?;
        adapter::unregister_layout(&engine, namespace).map_err(|e| engine_fail(e).into())
    }

    /// Registers a namespace's layout. `layers`: per layer
    /// `(k_buf, k_off, v_buf | None, v_off, num_blocks, bytes_per_block, block_stride)`.
    fn register_layout(
        &self,
        namespace: &str,
        layers: Vec<(u32, u64, Option<u32>, u64, u64, u64, u64)>,
    ) -> PyResult<()> {
        let (_, engine) = self.engine()?;
        let layers: Vec<PyLayer> = layers
            .into_iter()
            .map(|(kb, ko, vb, vo, num_blocks, bytes_per_block, block_stride)| PyLayer {
                k: (kb, ko),
                v: vb.map(|b| (b, vo)),
                num_blocks,
                bytes_per_block,
                block_stride,
            })
            .collect();
        adapter::register_layout(&engine, namespace, &layers).map_err(|e| engine_fail(e).into())
    }

    /// Saves blocks (device → pool); a dict report.
    fn save<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        hashes: Vec<Vec<u8>>,
        blocks: Vec<u64>,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let p = pairs(hashes, blocks)?;
        let r = wait(py, &rt, t, async move { adapter::save(&engine, &namespace, p).await })?
            .ok_or_else(|| deadline_fail("save", t))?
            .map_err(engine_fail)?;
        let d = PyDict::new(py);
        d.set_item("saved", r.saved.len())?;
        d.set_item("already_resident", r.already_resident)?;
        d.set_item("no_space", r.no_space)?;
        Ok(d)
    }

    /// The P/D handoff barrier; `(delivered, dropped, timed_out)`.
    fn flush_saves_and_registrations(&self, py: Python<'_>, timeout_s: f64) -> PyResult<(u64, u64, bool)> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let r = wait(py, &rt, t + WAIT_SLICE, async move { engine.flush_saves_and_registrations(t).await })?;
        Ok(match r {
            Some(r) => (r.delivered, r.dropped, r.timed_out),
            None => (0, 0, true),
        })
    }

    /// Resident prefix length here.
    fn query_prefix(&self, namespace: &str, hashes: Vec<Vec<u8>>) -> PyResult<usize> {
        let (_, engine) = self.engine()?;
        Ok(engine.query_prefix(namespace, &self::hashes(hashes)?))
    }

    /// The MetaServer's answer: `[(node, prefix_len)]`, longest first.
    fn query_prefix_remote(
        &self,
        py: Python<'_>,
        namespace: String,
        hashes: Vec<Vec<u8>>,
        timeout_s: f64,
    ) -> PyResult<Vec<(String, u32)>> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let hs = self::hashes(hashes)?;
        let r = wait(py, &rt, t, async move { engine.client().query_prefix(&namespace, &hs, t).await })?
            .ok_or_else(|| deadline_fail("MetaServer query", t))?;
        match r {
            Ok(v) => Ok(v.into_iter().map(|(n, k)| (n.0, k)).collect()),
            Err(ClientError::Timeout(_)) => Err(deadline_fail("MetaServer query", t).into()),
            // The channel's own request timeout surfaces as a status.
            Err(ClientError::Rpc(s)) if matches!(s.code(), Code::Cancelled | Code::DeadlineExceeded) => {
                Err(deadline_fail("MetaServer query", t).into())
            }
            Err(e) => Err(Fail::new(
                "MetaServerError",
                e.code(),
                format!("{e}: is the MetaServer running at the address this node was given?"),
            )
            .into()),
        }
    }

    /// Fetches the missing prefix of `hashes` from peers; a report dict
    /// ("k of n"). Never raises for a fetch that stops short.
    fn fetch<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        hashes: Vec<Vec<u8>>,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let hs = self::hashes(hashes)?;
        // The timeout is the fetch's own deadline (the engine ends every
        // step by it and reports "k of n"); the wait only guards a wedged
        // runtime.
        let r = wait(py, &rt, t + FETCH_OVERRUN_MAX, async move {
            engine.fetch_with_deadline(&namespace, &hs, tokio::time::Instant::now() + t).await
        })?
        .ok_or_else(|| deadline_fail("fetch", t + FETCH_OVERRUN_MAX))?;
        fetch_dict(py, &r)
    }

    /// Loads blocks (pool → device); a report dict.
    fn load<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        hashes: Vec<Vec<u8>>,
        blocks: Vec<u64>,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let p = pairs(hashes, blocks)?;
        // The timeout is the load's own deadline (no copy starts after it;
        // one started is awaited, it writes the caller's cache); the wait
        // only guards a wedged runtime.
        let r = wait(py, &rt, t + FETCH_OVERRUN_MAX, async move {
            adapter::load(&engine, &namespace, p, tokio::time::Instant::now() + t).await
        })?
        .ok_or_else(|| deadline_fail("load", t + FETCH_OVERRUN_MAX))?
        .map_err(engine_fail)?;
        load_dict(py, &r)
    }

    /// Fetch, then load the available prefix into `blocks`; `(fetch, load)`
    /// report dicts. `owners`: `query_prefix_remote`'s answer for the same
    /// hashes, which the fetch starts from instead of asking again.
    /// `ticket`: an owner's transfer ticket for this node (`grant_transfer`'s
    /// bytes), which the fetch starts from instead (no query, no lock RPC).
    #[pyo3(signature = (namespace, hashes, blocks, timeout_s, owners=None, ticket=None))]
    #[allow(clippy::too_many_arguments)]
    fn fetch_into<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        hashes: Vec<Vec<u8>>,
        blocks: Vec<u64>,
        timeout_s: f64,
        owners: Option<Vec<(String, u32)>>,
        ticket: Option<&[u8]>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let p = pairs(hashes, blocks)?;
        let known = match (owners, ticket) {
            (Some(_), Some(_)) => {
                return Err(Fail::coded("bad_known", "pass owners or a ticket, not both".to_string()).into());
            }
            (Some(o), None) => {
                adapter::Known::Owners(o.into_iter().map(|(n, k)| (kvferry::types::NodeAddr(n), k)).collect())
            }
            (None, Some(b)) => adapter::Known::Ticket(Box::new(
                kvferry::engine::TransferTicket::decode(b)
                    .map_err(|e| Fail::coded(e.code(), format!("transfer ticket: {e}")))?,
            )),
            (None, None) => adapter::Known::Nothing,
        };
        // As in `fetch`: the timeout is the fetch's own deadline.
        let r = wait(py, &rt, t + FETCH_OVERRUN_MAX, async move {
            adapter::fetch_into(&engine, &namespace, p, known, tokio::time::Instant::now() + t).await
        })?
        .ok_or_else(|| deadline_fail("fetch_into", t + FETCH_OVERRUN_MAX))?
        .map_err(engine_fail)?;
        Ok((fetch_dict(py, &r.fetch)?, load_dict(py, &r.load)?))
    }

    /// Handshakes with the peer at `addr` and opens its same-host shared
    /// pool as a copy source ([`kvferry::engine::Engine::connect_peer`]);
    /// `ready`, `not_mapped`, `opening` or `refused`.
    fn connect_peer(&self, py: Python<'_>, addr: String, timeout_s: f64) -> PyResult<&'static str> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let peer = kvferry::types::NodeAddr(addr.clone());
        let r = wait(py, &rt, t + FETCH_OVERRUN_MAX, async move { engine.connect_peer(&peer, t).await })?
            .ok_or_else(|| deadline_fail("connect_peer", t + FETCH_OVERRUN_MAX))?;
        match r {
            Ok(SharedPool::Ready) => Ok("ready"),
            Ok(SharedPool::NotMapped) => Ok("not_mapped"),
            Ok(SharedPool::Opening) => Ok("opening"),
            Ok(SharedPool::Refused) => Ok("refused"),
            Err(e @ ConnectError { error: kvferry::engine::fetch::FetchError::Deadline, .. }) => {
                let mut msg = format!("no handshake with peer {addr} within {:.3} s", t.as_secs_f64());
                if let Some(last) = &e.last_try {
                    msg += &format!("; the last try: {last}");
                }
                Err(Fail::coded(e.code(), msg).into())
            }
            Err(e) => Err(Fail::coded(e.code(), format!("connecting to peer {addr}: {e}")).into()),
        }
    }

    /// This node as a ticket's reader: `(address, device)`, `device` the
    /// `(handle kind, pid)` it copies device to device from, if any.
    fn transfer_ask(&self) -> PyResult<(String, Option<(u32, u32)>)> {
        let (_, engine) = self.engine()?;
        let a = engine.transfer_ask();
        Ok((a.requester.0, a.device.map(|d| (d.kind, d.pid))))
    }

    /// Locks the resident blocks among `hashes` for the reader `requester`
    /// (with its `device` capability) and returns the transfer ticket's
    /// bytes ([`kvferry::engine::Engine::grant_transfer`]).
    fn grant_transfer<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        hashes: Vec<Vec<u8>>,
        requester: String,
        device: Option<(u32, u32)>,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let t = secs(timeout_s)?;
        let (rt, engine) = self.engine()?;
        let requester = kvferry::types::NodeAddr::parse(&requester)
            .map_err(|e| Fail::coded(e.code(), format!("requester: {e}")))?;
        let hashes: Vec<BlockHash> = hashes.into_iter().map(|h| BlockHash(h.into())).collect();
        let to = kvferry::engine::TransferAsk {
            requester,
            device: device.map(|(kind, pid)| kvferry::proto::DeviceCapability { kind, pid }),
        };
        let ticket = wait(py, &rt, t, async move { engine.grant_transfer(&namespace, &hashes, &to).await })?
            .ok_or_else(|| deadline_fail("grant_transfer", t))?
            .map_err(engine_fail)?;
        Ok(PyBytes::new(py, &ticket.encode()))
    }

    /// Ends the lock of a ticket this node granted (`grant_transfer`'s
    /// bytes) that will not reach its reader; the blocks it released
    /// (0 when the reader or the lock timeout already ended it).
    fn release_ticket(&self, ticket: &[u8]) -> PyResult<usize> {
        let (_, engine) = self.engine()?;
        let t = kvferry::engine::TransferTicket::decode(ticket)
            .map_err(|e| Fail::coded(e.code(), format!("transfer ticket: {e}")))?;
        if t.owner != *engine.node() {
            return Err(Fail::coded(
                "bad_ticket",
                format!("a ticket of {} is not this node's ({}) to release", t.owner, engine.node()),
            )
            .into());
        }
        if t.session().is_empty() {
            return Ok(0);
        }
        engine
            .release_transfer(t.session())
            .map_err(|e| Fail::coded(e.code(), format!("releasing the ticket's lock: {e}")).into())
    }

    /// Grants a device lease on `blocks` (this engine's block indices) of
    /// `hashes` for `ttl_s` seconds; its id as 32 hex characters.
    fn grant_device_lease(
        &self,
        namespace: &str,
        hashes: Vec<Vec<u8>>,
        blocks: Vec<u64>,
        ttl_s: f64,
    ) -> PyResult<String> {
        let ttl = secs(ttl_s)?;
        let (_, engine) = self.engine()?;
        let p = pairs(hashes, blocks)?;
        engine.grant_device_lease(namespace, &p, ttl).map(|id| id.to_string()).map_err(|e| engine_fail(e).into())
    }

    /// Ends a device lease early; false when it already ended or `id` is
    /// not one of this node's.
    fn end_device_lease(&self, id: &str) -> PyResult<bool> {
        let (_, engine) = self.engine()?;
        let Ok(n) = u128::from_str_radix(id, 16) else {
            return Err(
                Fail::coded("bad_lease_id", format!("{id:?} is not a device lease id (32 hex characters)")).into()
            );
        };
        Ok(id.len() == 32 && engine.end_device_lease(kvferry::engine::leases::DeviceLeaseId(n)))
    }

    /// Device leases that ended since the last call:
    /// `[(id, namespace, blocks, how)]`, `how` one of `released`,
    /// `expired`, `revoked`.
    fn ended_device_leases(&self) -> PyResult<Vec<(String, String, Vec<u64>, &'static str)>> {
        let (_, engine) = self.engine()?;
        Ok(engine
            .ended_device_leases()
            .into_iter()
            .map(|e| (e.id.to_string(), e.namespace.to_string(), e.blocks, e.end.as_str()))
            .collect())
    }

    /// Counters and gauges; with the TCP data plane also `path_{shm,tcp}_{blocks,bytes,fallbacks}` (which path moved the fetched blocks; `path_shm_*` includes the shared pool's one-step copies into the KV, `path_shm_direct_*`), and `path_ipc_*` for blocks copied device to device from a same-host owner.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (_, engine) = self.engine()?;
        let m = engine.metrics();
        let d = PyDict::new(py);
        let c = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        for (k, v) in [
            ("saves", c(&m.saves)),
            ("saved_blocks", c(&m.saved_blocks)),
            ("loads", c(&m.loads)),
            ("loaded_blocks", c(&m.loaded_blocks)),
            ("load_failures", c(&m.load_failures)),
            ("evicted", c(&m.evicted)),
            ("alloc_failures", c(&m.alloc_failures)),
            ("fetches", c(&m.fetches)),
            ("fetch_known_owners", c(&m.fetch_known_owners)),
            ("fetch_tickets", c(&m.fetch_tickets)),
            ("fetch_tickets_unused", c(&m.fetch_tickets_unused)),
            ("fetched_blocks", c(&m.fetched_blocks)),
            ("fetched_bytes", c(&m.fetched_bytes)),
            ("checksum_failures", c(&m.checksum_failures)),
            ("transfer_locks_created", c(&m.transfer_locks_created)),
            ("transfer_locks_expired", c(&m.transfer_locks_expired)),
            ("save_copy_bytes", c(&m.save_copy_bytes)),
            ("load_copy_bytes", c(&m.load_copy_bytes)),
            ("path_ipc_blocks", c(&m.device_blocks)),
            ("path_ipc_bytes", c(&m.device_bytes)),
            ("path_ipc_fallbacks", c(&m.device_fallbacks)),
            ("path_ipc_ns", c(&m.device_ns)),
            ("path_shm_direct_blocks", c(&m.shared_direct_blocks)),
            ("path_shm_direct_bytes", c(&m.shared_direct_bytes)),
            ("path_shm_direct_fallbacks", c(&m.shared_direct_fallbacks)),
            ("path_shm_direct_ns", c(&m.shared_direct_ns)),
            ("device_leases_taken", c(&m.device_leases_taken)),
        ] {
            d.set_item(k, v)?;
        }
        let g = engine.gauges();
        d.set_item("pool_used_bytes", g.pool_used_bytes)?;
        d.set_item("pool_free_bytes", g.pool_free_bytes)?;
        d.set_item("resident_blocks", g.resident_blocks)?;
        d.set_item("active_transfer_locks", g.active_transfer_locks)?;
        let q = engine.client().counters();
        d.set_item("registrations_offered", q.offered)?;
        d.set_item("registrations_delivered", q.delivered)?;
        d.set_item("registrations_pending", q.pending)?;
        d.set_item(
            "registrations_dropped",
            q.dropped_queue_full + q.dropped_rpc_failed + q.dropped_rejected + q.dropped_shutdown,
        )?;
        // The disk tier, when the node has one (`ssd_*`).
        if let Some(ds) = engine.disk_stats() {
            for (k, v) in [
                ("ssd_records", ds.records),
                ("ssd_used_bytes", ds.used_bytes),
                ("ssd_written_blocks", ds.tier.written_blocks),
                ("ssd_read_blocks", ds.tier.read_blocks),
                ("ssd_staged_blocks", ds.staged_blocks),
                ("ssd_evicted", ds.tier.evicted),
                ("ssd_verify_failures", ds.tier.verify_failures),
                ("ssd_write_refused", ds.write_refused),
                ("ssd_recovered", ds.tier.recovered),
                ("ssd_recovered_advertised", ds.recovered_advertised),
            ] {
                d.set_item(k, v)?;
            }
        }
        // Per data path (shared pool, TCP): blocks, bytes, fallbacks. The
        // shared pool's figures hold its one-step copies into the KV too
        // (`path_shm_direct_*` alone), as `kvferry pd` reports them.
        let paths =
            self.live.lock().expect("live lock").as_ref().and_then(|l| l.handle.path.as_ref().map(|p| p.stats()));
        if let Some(s) = paths {
            let direct = [c(&m.shared_direct_blocks), c(&m.shared_direct_bytes), c(&m.shared_direct_fallbacks)];
            for (name, p, add) in [("shm", s.shm, direct), ("tcp", s.tcp, [0; 3])] {
                d.set_item(format!("path_{name}_blocks"), p.extents + add[0])?;
                d.set_item(format!("path_{name}_bytes"), p.bytes + add[1])?;
                d.set_item(format!("path_{name}_fallbacks"), p.fallbacks + add[2])?;
            }
        }
        Ok(d)
    }

    /// Graceful stop within `timeout_s`; idempotent.
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let t = secs(timeout_s)?;
        let Some(Live { rt, handle }) = self.live.lock().expect("live lock").take() else { return Ok(()) };
        py.detach(move || {
            rt.block_on(handle.shutdown(t));
            if let Ok(rt) = Arc::try_unwrap(rt) {
                rt.shutdown_timeout(t);
            }
        });
        Ok(())
    }

    /// Abrupt stop, as a crash (tests): no unregister is sent.
    fn kill(&self) {
        if let Some(Live { rt, handle }) = self.live.lock().expect("live lock").take() {
            let _g = rt.enter();
            handle.kill();
        }
    }

    /// True until shut down or killed.
    fn running(&self) -> bool {
        self.live.lock().expect("live lock").is_some()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(Live { rt, handle }) = self.live.get_mut().ok().and_then(Option::take) {
            {
                let _g = rt.enter();
                handle.kill();
            }
            if let Ok(rt) = Arc::try_unwrap(rt) {
                rt.shutdown_background();
            }
        }
    }
}

/// Chained block hashes (32 bytes each) of the full blocks of `tokens`.
#[pyfunction]
fn block_hashes<'py>(
    py: Python<'py>,
    namespace: &str,
    tokens: Vec<u32>,
    block_tokens: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if block_tokens == 0 {
        return Err(Fail::coded("bad_block_tokens", "block_tokens must be at least 1").into());
    }
    let hs = py
        .detach(|| adapter::block_hashes(namespace, &tokens, block_tokens))
        .map_err(|e| Fail::coded(e.code(), e.to_string()))?;
    Ok(hs.iter().map(|h| PyBytes::new(py, h.as_bytes())).collect())
}

/// The namespace string of one KV layout family.
#[pyfunction]
fn namespace(model: &str, dtype: &str, block_tokens: u32, tp_rank: u32, tp_size: u32, layers: u32) -> PyResult<String> {
    adapter::namespace(model, dtype, block_tokens, tp_rank, tp_size, layers)
        .map_err(|e| Fail::coded(e.code(), e.to_string()).into())
}

/// Checks a node's MetaServer address (`host:port`, no scheme: the Python
/// API dials plain text) before the node starts; `ConfigError` naming the
/// `metaserver` argument.
#[pyfunction]
fn check_metaserver_address(addr: &str) -> PyResult<()> {
    let fail = |why: String| Fail::coded("client_address", format!("metaserver: {why}"));
    match kvferry::client::parse_metaserver_address(addr) {
        Ok(a) if a.scheme.is_some() => Err(fail(format!(
            "{addr:?}: pass the MetaServer as host:port without a scheme (e.g. {}:{}, or MetaServer().address)",
            if a.host.contains(':') { format!("[{}]", a.host) } else { a.host.to_string() },
            a.port
        ))
        .into()),
        Ok(_) => Ok(()),
        Err(e) => Err(fail(e.to_string()).into()),
    }
}

/// Whether this build has the CUDA backend.
#[pyfunction]
fn cuda_built() -> bool {
    kvferry::gpu::open::built("cuda")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MetaServer>()?;
    m.add_class::<Node>()?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(namespace, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_built, m)?)?;
    m.add_function(wrap_pyfunction!(check_metaserver_address, m)?)?;
    Ok(())
}
