//! The `cuda` GPU backend (feature `cuda`): device KV buffers in GPU memory,
//! the pinned pool registered with the driver once, and batched scattered
//! copies in both directions by one gather/scatter kernel launch per batch.
//!
//! Why a kernel: one `cuMemcpyAsync` per 32 KiB fragment is host-bound at
//! ≈ 10 GB/s, the driver's batched copy reached 20–28 GB/s from Rust, and a
//! gather/scatter kernel over mapped pinned memory ran at 51–52 GB/s for
//! fragments from 4 KiB (docs/perf.md, cuda.md measurements on the H200).
//! The kernel reads a descriptor table `(src, dst, len)` — device pointers on
//! both sides, the host side through the pool's mapped (UVA) address — with
//! one thread block per ≤ 64 KiB piece and 16-byte loads when aligned.
//!
//! Completion: the batch is launched on a per-direction stream from a
//! blocking worker thread that then waits on the stream and hands the host
//! buffers back. The buffers live in that worker until the GPU is done, so a
//! dropped completion future never frees memory a copy still touches (C11).
//!
//! Start-up errors are values: no libcuda / libnvrtc, no device, or a driver
//! too old for the CUDA 13.0 API become [`GpuError::Unavailable`] (cudarc
//! would panic at the first call into a missing library, so presence is
//! checked first).
//!
//! Not under the simulator: this module is `cfg(not(madsim))`.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result};

use super::{Completed, Completion, CopyBatch, Direction, Gpu, GpuError, HostBuf, validate_batch};
use crate::engine::layout::DeviceBufferId;

/// Pieces larger than this are split so work spreads over the SMs (bytes).
const PIECE_BYTES_MAX: u64 = 64 << 10;
/// Threads per block of the copy kernel.
const THREADS: u32 = 256;

const KERNEL: &str = r#"
extern "C" __global__ void kvferry_copy(const unsigned long long* __restrict__ desc, unsigned long long n) {
    for (unsigned long long op = blockIdx.x; op < n; op += gridDim.x) {
        unsigned long long src = desc[3 * op], dst = desc[3 * op + 1], len = desc[3 * op + 2];
        if (((src | dst | len) & 15ull) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* d = (uint4*)dst;
            unsigned long long nv = len >> 4;
            for (unsigned long long k = threadIdx.x; k < nv; k += blockDim.x) d[k] = s[k];
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (unsigned long long k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
        }
    }
}
"#;

fn unavailable(what: impl std::fmt::Display) -> GpuError {
    GpuError::Unavailable(what.to_string())
}

fn dev_err(e: impl std::fmt::Display) -> GpuError {
    GpuError::Device(e.to_string())
}

/// CUDA devices visible to this process.
///
/// # Errors
/// [`GpuError::Unavailable`] when the driver is missing or fails to init.
pub fn device_count() -> Result<usize, GpuError> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("libcuda not found: no NVIDIA driver on this machine"));
    }
    let n = CudaContext::device_count().map_err(|e| unavailable(format!("cuInit/cuDeviceGetCount: {e}")))?;
    if n <= 0 {
        return Err(unavailable("no CUDA device visible"));
    }
    Ok(n as usize)
}

/// A descriptor table: `cap` u64s of pinned host memory and its mapped
/// device address.
struct Table {
    host: *mut u64,
    cap: usize,
    device: sys::CUdeviceptr,
}

struct Registered {
    host: usize,
    len: usize,
    device: sys::CUdeviceptr,
}

struct Inner {
    ctx: Arc<CudaContext>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    kernel: CudaFunction,
    /// Device buffers: (device pointer, bytes).
    buffers: Mutex<Vec<(sys::CUdeviceptr, u64)>>,
    /// Host memory registered with the driver (the pool).
    registered: Mutex<Vec<Registered>>,
    /// Free descriptor tables in pinned, mapped host memory, reused across
    /// batches (no device allocation or synchronous copy per batch, which
    /// would serialize concurrent batches).
    tables: Mutex<Vec<Table>>,
    sm_count: u32,
}

// SAFETY: the raw device pointers are plain integers owned by this backend;
// the CUDA context, streams and function are `Send + Sync` in cudarc.
unsafe impl Send for Inner {}
// SAFETY: see above; all mutable state is behind mutexes.
unsafe impl Sync for Inner {}

/// The CUDA backend on one device.
pub struct CudaGpu {
    inner: Arc<Inner>,
}

impl CudaGpu {
    /// Opens device `ordinal`: loads the driver and NVRTC, creates a context,
    /// two streams (one per direction) and compiles the copy kernel.
    ///
    /// # Errors
    /// [`GpuError::Unavailable`] with the reason (no driver library, no such
    /// device, NVRTC missing, compile failure).
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        // SAFETY: only probes whether the shared libraries can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable("libcuda not found: no NVIDIA driver on this machine"));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unavailable("libnvrtc not found: the CUDA runtime compiler is needed for the copy kernel"));
        }
        let count = CudaContext::device_count().map_err(|e| unavailable(format!("cuInit/cuDeviceGetCount: {e}")))?;
        if count <= 0 || ordinal >= count as usize {
            return Err(unavailable(format!("device {ordinal} requested, {count} visible")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("context on device {ordinal}: {e}")))?;
        // We order work ourselves (one stream per direction, explicit waits).
        // SAFETY: no cudarc-managed allocation exists yet.
        unsafe { ctx.disable_event_tracking() };
        let d2h = ctx.new_stream().map_err(|e| unavailable(format!("stream: {e}")))?;
        let h2d = ctx.new_stream().map_err(|e| unavailable(format!("stream: {e}")))?;
        let ptx = cudarc::nvrtc::compile_ptx(KERNEL).map_err(|e| unavailable(format!("nvrtc: {e:?}")))?;
        let module = ctx.load_module(ptx).map_err(|e| unavailable(format!("load module: {e}")))?;
        let kernel = module.load_function("kvferry_copy").map_err(|e| unavailable(format!("load kernel: {e}")))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| unavailable(format!("attribute: {e}")))? as u32;
        Ok(Self {
            inner: Arc::new(Inner {
                ctx,
                d2h,
                h2d,
                kernel,
                buffers: Mutex::new(Vec::new()),
                registered: Mutex::new(Vec::new()),
                tables: Mutex::new(Vec::new()),
                sm_count,
            }),
        })
    }

    /// Device name.
    pub fn device_name(&self) -> String {
        self.inner.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// Raw device pointer of a buffer (benchmarks).
    pub fn device_ptr(&self, id: DeviceBufferId) -> Option<u64> {
        self.inner.buffers.lock().expect("buffers lock").get(id.0 as usize).map(|b| b.0)
    }

    /// Times one contiguous copy of `len` bytes between pinned host memory at
    /// `host` (inside a registered region) and device memory at `device`, on
    /// the direction's stream, with events. Returns seconds.
    ///
    /// # Errors
    /// Driver errors.
    pub fn time_raw_copy(
        &self,
        dir: Direction,
        host: *mut u8,
        device: u64,
        len: usize,
        reps: usize,
    ) -> Result<f64, GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let stream = match dir {
            Direction::DeviceToHost => &i.d2h,
            Direction::HostToDevice => &i.h2d,
        };
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = i.ctx.new_event(timing).map_err(dev_err)?;
        let end = i.ctx.new_event(timing).map_err(dev_err)?;
        let mut best = f64::MAX;
        for _ in 0..reps {
            start.record(stream).map_err(dev_err)?;
            // SAFETY: `host..host+len` lies in registered (pinned) memory the
            // caller owns for the duration; `device..device+len` is ours.
            unsafe {
                match dir {
                    Direction::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(host.cast(), device, len, stream.cu_stream())
                        .result()
                        .map_err(dev_err)?,
                    Direction::HostToDevice => sys::cuMemcpyHtoDAsync_v2(device, host.cast(), len, stream.cu_stream())
                        .result()
                        .map_err(dev_err)?,
                }
            }
            end.record(stream).map_err(dev_err)?;
            end.synchronize().map_err(dev_err)?;
            best = best.min(f64::from(start.elapsed_ms(&end).map_err(dev_err)?) / 1e3);
        }
        Ok(best)
    }

    /// Times `len`-byte copies in both directions at once (bidirectional
    /// peak), returning seconds for the pair.
    ///
    /// # Errors
    /// Driver errors.
    pub fn time_raw_bidir(
        &self,
        host_a: *mut u8,
        host_b: *mut u8,
        dev_a: u64,
        dev_b: u64,
        len: usize,
        reps: usize,
    ) -> Result<f64, GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let mut best = f64::MAX;
        for _ in 0..reps {
            i.ctx.synchronize().map_err(dev_err)?;
            let t = std::time::Instant::now();
            // SAFETY: as in `time_raw_copy`.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host_a.cast(), dev_a, len, i.d2h.cu_stream()).result().map_err(dev_err)?;
                sys::cuMemcpyHtoDAsync_v2(dev_b, host_b.cast(), len, i.h2d.cu_stream()).result().map_err(dev_err)?;
            }
            i.d2h.synchronize().map_err(dev_err)?;
            i.h2d.synchronize().map_err(dev_err)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    }
}

impl Inner {
    fn mapped(&self, host: *const u8, len: u64) -> Result<u64, GpuError> {
        let h = host as usize;
        let regs = self.registered.lock().expect("registered lock");
        for r in regs.iter() {
            if h >= r.host && h + len as usize <= r.host + r.len {
                return Ok(r.device + (h - r.host) as u64);
            }
        }
        Err(GpuError::OutOfRange(format!("host range {h:#x}+{len} is not in registered pinned memory")))
    }

    fn run(&self, batch: &CopyBatch) -> Result<(), GpuError> {
        let mut desc: Vec<u64> = Vec::with_capacity(batch.ops.len() * 3);
        {
            let bufs = self.buffers.lock().expect("buffers lock");
            for op in &batch.ops {
                let (dev_base, _) = bufs[op.buffer.0 as usize];
                let host_ptr = match &batch.host[op.extent] {
                    HostBuf::Writable(e) => e.as_ptr(),
                    HostBuf::Sealed(e) => e.as_ptr(),
                };
                // SAFETY: validate_batch checked `host_offset + len <= extent len`.
                let host = self.mapped(unsafe { host_ptr.add(op.host_offset as usize) }, op.len)?;
                let dev = dev_base + op.device_offset;
                let (src, dst) = match batch.direction {
                    Direction::DeviceToHost => (dev, host),
                    Direction::HostToDevice => (host, dev),
                };
                let mut off = 0;
                while off < op.len {
                    let n = (op.len - off).min(PIECE_BYTES_MAX);
                    desc.extend_from_slice(&[src + off, dst + off, n]);
                    off += n;
                }
            }
        }
        let pieces = (desc.len() / 3) as u64;
        if pieces == 0 {
            return Ok(());
        }
        let stream = match batch.direction {
            Direction::DeviceToHost => &self.d2h,
            Direction::HostToDevice => &self.h2d,
        };
        self.ctx.bind_to_thread().map_err(dev_err)?;
        let table = self.take_table(desc.len())?;
        // SAFETY: the table holds at least `desc.len()` u64s and is ours
        // until `put_table`.
        unsafe { std::ptr::copy_nonoverlapping(desc.as_ptr(), table.host, desc.len()) };
        let res = (|| {
            let grid = (pieces as u32).min(self.sm_count * 32).max(1);
            let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&self.kernel);
            b.arg(&table.device);
            b.arg(&pieces);
            // SAFETY: every descriptor was validated against its buffer and
            // a registered host region; the kernel touches only those ranges.
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
            // Wait for this batch only (other batches may share the stream).
            let done = stream.record_event(None).map_err(dev_err)?;
            done.synchronize().map_err(dev_err)
        })();
        if res.is_err() {
            // Do not reuse a table a failed launch might still read.
            let _ = stream.synchronize();
        }
        self.put_table(table);
        res
    }

    /// Device address of `[offset, offset+len)` in buffer `id`, range
    /// checked, with the context bound to this thread.
    fn checked_ptr(&self, id: DeviceBufferId, offset: u64, len: u64) -> Result<sys::CUdeviceptr, GpuError> {
        let (ptr, total) = self
            .buffers
            .lock()
            .expect("buffers lock")
            .get(id.0 as usize)
            .copied()
            .ok_or(GpuError::UnknownBuffer(id))?;
        super::checked_range(offset, len, total)?;
        self.ctx.bind_to_thread().map_err(dev_err)?;
        Ok(ptr + offset)
    }

    fn take_table(&self, n: usize) -> Result<Table, GpuError> {
        let mut free = self.tables.lock().expect("tables lock");
        if let Some(i) = free.iter().position(|t| t.cap >= n) {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        let cap = n.next_power_of_two().max(3 * 1024);
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh pinned allocation of `cap` u64s.
        let host = unsafe { result::malloc_host(cap * 8, flags) }.map_err(dev_err)? as *mut u64;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) }.result().map_err(dev_err)?;
        Ok(Table { host, cap, device })
    }

    fn put_table(&self, t: Table) {
        self.tables.lock().expect("tables lock").push(t);
    }
}

impl Gpu for CudaGpu {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBufferId, GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let len = usize::try_from(bytes).map_err(|_| GpuError::Alloc { bytes, reason: "too large".into() })?;
        // SAFETY: a plain device allocation of `len` bytes, zeroed next.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| GpuError::Alloc { bytes, reason: e.to_string() })?;
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(|e| GpuError::Alloc { bytes, reason: e.to_string() })?;
        let mut bufs = i.buffers.lock().expect("buffers lock");
        let id = DeviceBufferId(
            u32::try_from(bufs.len()).map_err(|_| GpuError::Alloc { bytes, reason: "too many buffers".into() })?,
        );
        bufs.push((ptr, bytes));
        Ok(id)
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.inner.buffers.lock().expect("buffers lock").get(id.0 as usize).map(|b| b.1)
    }

    fn register_host(&self, base: *mut u8, len: u64) -> Result<(), GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `base..base+len` is memory the caller owns for the
        // backend's lifetime (the pool arena); registering pins it.
        unsafe { sys::cuMemHostRegister_v2(base.cast(), len as usize, flags) }
            .result()
            .map_err(|e| unavailable(format!("cuMemHostRegister of {len} bytes: {e}")))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `base` was just registered with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, base.cast(), 0) }
            .result()
            .map_err(|e| unavailable(format!("cuMemHostGetDevicePointer: {e}")))?;
        i.registered.lock().expect("registered lock").push(Registered {
            host: base as usize,
            len: len as usize,
            device: dptr,
        });
        Ok(())
    }

    fn submit(&self, batch: CopyBatch) -> Completion {
        if let Err(e) = validate_batch(&batch, |id| self.buffer_len(id)) {
            return Box::pin(std::future::ready(Completed { host: batch.host, result: Err(e) }));
        }
        let inner = self.inner.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The worker owns the batch (and so the host buffers) until the GPU
        // finished with them, whatever happens to the completion future.
        std::thread::spawn(move || {
            let result = inner.run(&batch);
            let _ = tx.send(Completed { host: batch.host, result });
        });
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| Completed {
                host: Vec::new(),
                result: Err(GpuError::Device("copy worker died".into())),
            })
        })
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        let ptr = self.inner.checked_ptr(id, offset, data.len() as u64)?;
        // SAFETY: `checked_ptr` bounds the range inside the buffer.
        unsafe { result::memcpy_htod_sync(ptr, data) }.map_err(dev_err)
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let ptr = self.inner.checked_ptr(id, offset, out.len() as u64)?;
        // SAFETY: `checked_ptr` bounds the range inside the buffer.
        unsafe { result::memcpy_dtoh_sync(out, ptr) }.map_err(dev_err)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        for (ptr, _) in self.buffers.lock().expect("buffers lock").drain(..) {
            // SAFETY: allocated by `alloc`, freed once, device idle.
            unsafe {
                let _ = result::free_sync(ptr);
            }
        }
        for t in self.tables.lock().expect("tables lock").drain(..) {
            // SAFETY: allocated by `take_table`, device idle.
            unsafe {
                let _ = result::free_host(t.host.cast());
            }
        }
        for r in self.registered.lock().expect("registered lock").drain(..) {
            // SAFETY: registered by `register_host`, device idle.
            unsafe {
                let _ = sys::cuMemHostUnregister(r.host as *mut std::ffi::c_void);
            }
        }
    }
}
