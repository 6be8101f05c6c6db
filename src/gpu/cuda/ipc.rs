//! Device-direct copies of the `cuda` backend ([`super::super::peer`],
//! contract C19): exports as CUDA IPC handles, opened peer allocations
//! cached per handle, and peer batches copied and checksummed on the device.
//!
//! - **Export** ([`PeerKind::CudaIpc`]): `cuIpcGetMemHandle` of the
//!   allocation that holds the buffer (the driver's `RANGE_START_ADDR`), so
//!   the export's `offset` is the buffer's start minus the allocation's.
//!   A reader in this very process gets a [`PeerKind::Process`] token
//!   instead (an IPC handle does not open in the process that made it).
//! - **Open**: `cuIpcOpenMemHandle` with lazy peer access, one mapping per
//!   allocation shared by every buffer in it (the driver maps a handle once
//!   per context); the mapping's size from the driver bounds the export's
//!   `offset + len`, so a peer that lies about its buffer cannot make a
//!   copy run past what was mapped. The mapping closes when the last
//!   [`PeerBuffer`] of it and the last batch using it are gone.
//! - **Copy**: ops of at least [`super::CudaConfig::dma_min_bytes`] go to
//!   `cuMemcpyDtoDAsync` (the copy the raw baseline uses), smaller ones
//!   (KV segments: 32 KiB for Qwen3-8B) become ≤ 64 KiB pieces of one copy
//!   kernel launch per chunk, so a scattered block costs no driver call per
//!   segment. The checksum kernel reads the *destination* bytes of each
//!   finished chunk on its own stream while the next chunk copies, and the
//!   host folds piece CRCs into the batch's ranges ([`super::super::crc`]).
//!
//! The idea of mapping the owner's device KV into the reader with CUDA IPC
//! comes from the intra-node paths of Mooncake's transfer engine and NIXL
//! (`../shared/docs/perf.md`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::sys;

use super::{FUSED_BLOCKS_PER_SM, Inner, Table, dev_err, write3};
use crate::gpu::crc::{ChecksumRange, PIECE_BYTES_MAX, RangeFolder, STRIPE_BYTES};
use crate::gpu::peer::{self, BufferExport, PEER_TIMING_TRACE_TARGET, PeerBuffer, PeerCopyBatch, PeerKind, RangesByOp};
use crate::gpu::{GpuError, checked_range};
use crate::memory::DeviceBufferId;
use crate::memory::buffers::BatchPin;

/// Bytes of a CUDA IPC memory handle.
const IPC_HANDLE_BYTES: usize = 64;

/// Copy bytes per chunk: the checksum kernel of a chunk runs while the next
/// chunk copies.
const CHUNK_BYTES: u64 = 64 << 20;

/// Mapped peer allocations by handle (weak: a mapping closes with its last
/// user).
pub(super) type Mappings = Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Weak<Mapping>>>;

/// A peer allocation mapped into this context.
pub(super) struct Mapping {
    ctx: Arc<cudarc::driver::CudaContext>,
    base: sys::CUdeviceptr,
    size: u64,
}

// SAFETY: a device address and a context handle (`Send + Sync` in cudarc).
unsafe impl Send for Mapping {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: opened by `open_ipc`, closed once; no batch uses it (every
        // batch holds an `Arc` of its buffers until the device finished).
        unsafe {
            let _ = sys::cuIpcCloseMemHandle(self.base);
        }
    }
}

/// A [`PeerKind::CudaIpc`] buffer opened by the `cuda` backend: `len` bytes
/// at `offset` of a mapped peer allocation.
pub struct CudaPeerBuffer {
    map: Arc<Mapping>,
    offset: u64,
    len: u64,
}

impl PeerBuffer for CudaPeerBuffer {
    fn len(&self) -> u64 {
        self.len
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl CudaPeerBuffer {
    /// Device address of the buffer's first byte in this context.
    pub fn device_ptr(&self) -> u64 {
        self.map.base + self.offset
    }
}

/// Host memory mapped into this process (a same-host owner's shared pool)
/// and registered with this context, read-only, so the copy kernels read
/// it straight over PCIe ([`crate::gpu::Gpu::open_host_region`]).
/// Unregistered on drop, which waits for no batch: every batch holds an
/// `Arc` of its sources until the device finished with them.
pub struct CudaHostRegion {
    ctx: Arc<cudarc::driver::CudaContext>,
    host: peer::HostRegionBuffer,
    device: sys::CUdeviceptr,
    /// Bytes registered so far, from the start, in pieces of
    /// [`HOST_REGISTER_PIECE_BYTES`] (each unregistered on drop).
    registered: u64,
    /// Bytes per registration call: [`HOST_REGISTER_PIECE_BYTES`], or the
    /// whole region where pieces would not form one device range.
    piece: u64,
}

/// Bytes of a shared pool registered per `cuMemHostRegister` call. The
/// driver holds a lock of the context through each call (pinning takes
/// ≈ 60 ms per GiB), which stalls every other CUDA call of the process:
/// registering an 8 GiB pool in one call stalled the first fetches'
/// copies by ≈ 0.45 s on the H200 (session 15, `pd --path shm` read p99).
/// In 64 MiB pieces each stall is a few ms. The pieces are one device
/// range only where the device uses the host address for registered
/// memory (`CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`, every x86-64 and
/// Grace system); elsewhere the region is registered in one call.
pub const HOST_REGISTER_PIECE_BYTES: u64 = 64 << 20;

/// Pause between two registration pieces, so other threads' CUDA calls
/// (a fetch's copies while a pool registers in the background) take the
/// driver's lock between them instead of queueing behind the whole pool.
const HOST_REGISTER_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

// SAFETY: a registered host range, its device alias and a context handle;
// no interior mutability.
unsafe impl Send for CudaHostRegion {}
// SAFETY: as above.
unsafe impl Sync for CudaHostRegion {}

impl Drop for CudaHostRegion {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let mut at = 0;
        while at < self.registered {
            // SAFETY: each piece was registered in `open_host_region` and
            // is unregistered once; no batch reads it any more (each holds
            // an `Arc` of this buffer).
            unsafe {
                let _ = sys::cuMemHostUnregister((self.host.addr() + at as usize) as *mut std::ffi::c_void);
            }
            at += self.piece;
        }
    }
}

impl PeerBuffer for CudaHostRegion {
    fn len(&self) -> u64 {
        self.host.len()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A batch's sources resolved to device addresses, with the pins that
/// keep in-process sources registered in their owners' tables (a mapped
/// source stays open through the batch's own `Arc`s, which the worker
/// holds until the device is done).
pub(super) struct Sources {
    addrs: Vec<u64>,
    _pins: peer::ProcessPins,
}

impl Inner {
    /// [`crate::gpu::Gpu::export_buffer`] of this backend.
    pub(super) fn export(&self, id: DeviceBufferId, kind: PeerKind) -> Result<BufferExport, GpuError> {
        match kind {
            PeerKind::Process => peer::export_process(&self.buffers, id),
            PeerKind::CudaIpc => {
                let b = self.buffers.get(id).ok_or(GpuError::UnknownBuffer(id))?;
                let (_, _, start, _) = self.pointer_attributes(b.addr)?;
                let mut h = sys::CUipcMemHandle_st { reserved: [0; IPC_HANDLE_BYTES] };
                // SAFETY: `start` is the base of a live device allocation
                // (the registered buffer lies in it: checked at registration).
                unsafe { sys::cuIpcGetMemHandle(&mut h, start) }
                    .result()
                    .map_err(|e| GpuError::Unsupported(format!("cuIpcGetMemHandle of buffer {id:?}: {e}")))?;
                Ok(BufferExport {
                    kind,
                    handle: h.reserved.iter().map(|&c| c as u8).collect(),
                    offset: b.addr - start,
                    len: b.len,
                })
            }
        }
    }

    /// [`crate::gpu::Gpu::open_peer_buffer`] of this backend.
    pub(super) fn open(&self, e: &BufferExport) -> Result<Arc<dyn PeerBuffer>, GpuError> {
        match e.kind {
            PeerKind::Process => peer::open_process(e),
            PeerKind::CudaIpc => {
                let handle: [u8; IPC_HANDLE_BYTES] = e.handle.as_slice().try_into().map_err(|_| {
                    GpuError::Peer(format!("CUDA IPC handle of {} bytes, want {IPC_HANDLE_BYTES}", e.handle.len()))
                })?;
                let map = self.map_ipc(handle)?;
                if e.offset.checked_add(e.len).is_none_or(|end| end > map.size) {
                    return Err(GpuError::Peer(format!(
                        "export [{}, +{}) overruns the peer allocation of {} bytes",
                        e.offset, e.len, map.size
                    )));
                }
                Ok(Arc::new(CudaPeerBuffer { map, offset: e.offset, len: e.len }))
            }
        }
    }

    /// [`crate::gpu::Gpu::open_host_region`] of this backend: registers
    /// the range read-only and device-mapped, in pieces of
    /// [`HOST_REGISTER_PIECE_BYTES`] where the device addresses the pieces
    /// at their host addresses (one contiguous device range), else whole.
    pub(super) fn open_host_region(
        &self,
        addr: usize,
        len: u64,
        keep: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<Arc<dyn PeerBuffer>, GpuError> {
        let host = peer::HostRegionBuffer::new(addr, len, keep)?;
        self.ctx.bind_to_thread().map_err(dev_err)?;
        let host_pointer = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM;
        let piece = match self.ctx.attribute(host_pointer) {
            Ok(1) => HOST_REGISTER_PIECE_BYTES,
            _ => len,
        };
        // Unregistered on drop (piece by piece), also when a call below fails.
        let mut region = CudaHostRegion { ctx: self.ctx.clone(), host, device: 0, registered: 0, piece };
        let flags =
            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_READ_ONLY;
        while region.registered < len {
            if region.registered > 0 {
                std::thread::sleep(HOST_REGISTER_PAUSE);
            }
            let at = addr + region.registered as usize;
            let n = piece.min(len - region.registered);
            // SAFETY: `addr..addr+len` is a live read-only mapping that
            // `keep` (now owned by `region.host`) holds until this
            // registration is undone; `[at, at+n)` lies in it.
            unsafe { sys::cuMemHostRegister_v2(at as *mut std::ffi::c_void, n as usize, flags) }.result().map_err(
                |e| GpuError::Unavailable(format!("cuMemHostRegister of {n} bytes of a {len}-byte shared pool: {e}")),
            )?;
            region.registered += n;
            let mut device: sys::CUdeviceptr = 0;
            // SAFETY: `at` was just registered with DEVICEMAP.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, at as *mut std::ffi::c_void, 0) }
                .result()
                .map_err(|e| GpuError::Unavailable(format!("cuMemHostGetDevicePointer of a shared pool: {e}")))?;
            if region.registered == n {
                region.device = device;
            } else if device != region.device + (at - addr) as u64 {
                // Pieces that are not one device range: the copy kernels
                // could not read across their seams.
                return Err(GpuError::Unavailable(format!(
                    "a shared pool registered in pieces is not one device range ({device:#x} at offset {})",
                    at - addr
                )));
            }
        }
        Ok(Arc::new(region))
    }

    /// The mapping of `handle`, opened once and shared while in use.
    fn map_ipc(&self, handle: [u8; IPC_HANDLE_BYTES]) -> Result<Arc<Mapping>, GpuError> {
        let mut maps = self.ipc_maps.lock().expect("ipc maps lock");
        maps.retain(|_, m| m.strong_count() > 0);
        if let Some(m) = maps.get(&handle).and_then(Weak::upgrade) {
            return Ok(m);
        }
        self.ctx.bind_to_thread().map_err(dev_err)?;
        let h = sys::CUipcMemHandle_st { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: the driver validates the handle; `base` receives the
        // mapping's address.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, flags) }
            .result()
            .map_err(|e| GpuError::Peer(format!("cuIpcOpenMemHandle: {e}")))?;
        // Closed on drop, also when the checks below fail.
        let mut map = Mapping { ctx: self.ctx.clone(), base, size: 0 };
        let (_, _, start, size) = self.pointer_attributes(base)?;
        if start != base || size == 0 {
            return Err(GpuError::Peer(format!("mapped peer allocation at {base:#x} reads as [{start:#x}, +{size})")));
        }
        map.size = size;
        let map = Arc::new(map);
        maps.insert(handle, Arc::downgrade(&map));
        Ok(map)
    }

    /// Resolves a validated batch's sources to device addresses of this
    /// device, keeping each alive for the batch.
    pub(super) fn resolve_sources(&self, batch: &PeerCopyBatch) -> Result<Sources, GpuError> {
        let process = peer::pin_process_sources(&batch.sources)?;
        let mut addrs = Vec::with_capacity(batch.sources.len());
        for (src, process_addr) in batch.sources.iter().zip(&process.addrs) {
            let any = src.as_any();
            if let Some(c) = any.downcast_ref::<CudaPeerBuffer>() {
                addrs.push(c.device_ptr());
            } else if let Some(h) = any.downcast_ref::<CudaHostRegion>() {
                if h.ctx.cu_ctx() != self.ctx.cu_ctx() {
                    return Err(GpuError::Unsupported("a host region registered with another context".into()));
                }
                addrs.push(h.device);
            } else if let (Some(p), &Some(addr)) = (any.downcast_ref::<peer::ProcessPeerBuffer>(), process_addr) {
                // Same process: the owner's buffer must be device memory of
                // this device (another backend's table says nothing of it).
                // Checked with the driver once per opened buffer: a KV
                // tensor per layer and K/V made that 72 driver calls per
                // peer batch.
                if p.device_checked.get() != Some(&self.ordinal) {
                    let (memory_type, ordinal, _, _) = self.pointer_attributes(addr)?;
                    if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
                        || ordinal < 0
                        || ordinal as usize != self.ordinal
                    {
                        return Err(GpuError::Unsupported(format!(
                            "an in-process peer buffer that is not memory of device {}",
                            self.ordinal
                        )));
                    }
                    let _ = p.device_checked.set(self.ordinal);
                }
                addrs.push(addr);
            } else {
                return Err(GpuError::Unsupported("a peer buffer another backend opened".into()));
            }
        }
        Ok(Sources { addrs, _pins: process })
    }

    /// Runs one peer batch to completion (on a worker thread): `src` and
    /// `dst` hold the sources and destinations for its whole run.
    ///
    /// Each batch's host timings go out as a debug event of target
    /// [`peer::PEER_TIMING_TRACE_TARGET`] (µs): `prep` (`submit_peer`'s own
    /// checks: the batch's bounds, its sources, the destination pins),
    /// `queued` (submitted → this
    /// worker started), `pre` (the pass before planning), `plan` (planning
    /// and launches), `wait` (after the last launch until the device was
    /// done) and `fold`.
    pub(super) fn run_peer(
        &self,
        batch: &PeerCopyBatch,
        src: &Sources,
        dst: &BatchPin,
        (called, submitted): (std::time::Instant, std::time::Instant),
    ) -> Result<Vec<u32>, GpuError> {
        let started = std::time::Instant::now();
        // One pass before the first launch: destinations checked, each
        // range's length (the sum of its ops') and the descriptor bounds.
        let by_op = RangesByOp::of(batch);
        let mut walk = by_op.walk();
        let mut lens = vec![0u64; batch.checksums.len()];
        let mut dst_addr = Vec::with_capacity(batch.ops.len());
        let pieces = |len: u64| len.div_ceil(PIECE_BYTES_MAX) as usize;
        let (mut copy_bound, mut crc_bound, mut bytes) = (0, 0, 0);
        for (i, op) in batch.ops.iter().enumerate() {
            let (addr, len) = dst.get(op.dst).ok_or(GpuError::UnknownBuffer(op.dst))?;
            checked_range(op.dst_offset, op.len, len)?;
            dst_addr.push(addr + op.dst_offset);
            let in_ranges = walk.next(i, op.len);
            for &(r, at) in in_ranges {
                lens[r as usize] = at + op.len;
            }
            if !in_ranges.is_empty() {
                crc_bound += pieces(op.len);
            }
            if op.len < self.cfg.dma_min_bytes {
                copy_bound += pieces(op.len);
            }
            bytes += op.len;
        }
        let ranges: Vec<ChecksumRange> =
            lens.into_iter().map(|len| ChecksumRange { extent: 0, offset: 0, len }).collect();
        if bytes == 0 {
            // Nothing to copy or checksum: every range is empty (CRC 0).
            return Ok(vec![0; ranges.len()]);
        }
        self.ctx.bind_to_thread().map_err(dev_err)?;
        // Copies, checksum pieces, fused pieces (at most one per checksum
        // piece), the u32 outputs, then the fused items' starts and end.
        let words = 3 * copy_bound + 6 * crc_bound + crc_bound.div_ceil(2) + 1 + crc_bound + 1;
        let table = self.take_table(words)?;
        let plan = PeerPlan {
            batch,
            src,
            dst_addr: &dst_addr,
            in_ranges: &by_op,
            table: &table,
            copy_bound,
            crc_bound,
            times: (called, submitted, started),
        };
        let res = self.enqueue_peer(&plan, &ranges);
        if res.is_err() {
            // Do not reuse a table a failed batch might still touch.
            let _ = self.ctx.synchronize();
        }
        self.put_table(table);
        res
    }

    /// Enqueues a peer batch chunk by chunk and waits for it. A
    /// checksummed op whose length is a whole number of stripes and whose
    /// ends are 16-byte aligned goes to the fused copy-and-checksum kernel
    /// (one pass over HBM: coalesced loads into a shared-memory ring of
    /// stripes, `cp.async` on sm_80 and later, coalesced stores, the
    /// checksum from the ring). On sm_80 and later its work comes in
    /// *items*: consecutive pieces of one checksum range, up to
    /// [`super::FUSED_ITEM_BYTES`], checksummed as one run with one
    /// output, so the 72 scattered 32 KiB segments of a Qwen3-8B block pay
    /// one reduction per item instead of one per segment, and the host
    /// folds one checksum per item.
    /// Otherwise small ops go to the copy kernel, large ones to
    /// `cuMemcpyDtoDAsync`, and the checksum kernel reads each chunk's
    /// destination bytes on its own stream once the chunk landed.
    ///
    /// A first fused variant, in which each thread stored the 256-byte
    /// chunk it checksummed, measured 0.15 × the raw copy on the H200
    /// against copy-then-checksum's 0.37 (thread-strided stores).
    fn enqueue_peer(&self, p: &PeerPlan<'_>, ranges: &[ChecksumRange]) -> Result<Vec<u32>, GpuError> {
        let planning = std::time::Instant::now();
        let table = p.table;
        let (copy_at, crc_at) = (0, 3 * p.copy_bound);
        let (fused_at, out_at) = (crc_at + 3 * p.crc_bound, crc_at + 6 * p.crc_bound);
        let items_at = out_at + p.crc_bound.div_ceil(2) + 1;
        // Descriptors written: copy pieces, checksum pieces, fused pieces,
        // fused items (runs of fused pieces with one output), outputs.
        let mut n = Counts::default();
        // Launched so far: (copy, checksum, fused item) descriptors.
        let mut launched = (0usize, 0usize, 0usize);
        // (range, offset in range, bytes, output index).
        let mut folds: Vec<(u32, u64, u64, usize)> = Vec::with_capacity(p.crc_bound);
        // The open fused item's fold (a single-range item: its range, its
        // start there and its bytes so far are the fold's).
        let mut open: Option<usize> = None;
        // The kernel for older devices takes one piece per item.
        let item_max = if self.fused_items { super::FUSED_ITEM_BYTES } else { 0 };
        let mut chunk = 0u64;
        let stream = &self.peer;
        let per_sm = self.cfg.peer_blocks_per_sm;
        // Launches the copies and checksums written since the last flush.
        // Checksum pieces and fused items share the output index (`n.out`),
        // each kernel reading it from its descriptor.
        let flush = |n: &Counts, launched: &mut (usize, usize, usize)| {
            if n.items > launched.2 {
                let (out, tables) = (table.device + 8 * out_at as u64, self.crc_tables);
                let count = n.items - launched.2;
                if self.fused_items {
                    // The last item's end (the next item, if any, starts
                    // there and rewrites the same value).
                    // SAFETY: `n.items <= crc_bound`: the table holds
                    // `crc_bound + 1` item words.
                    unsafe { table.host.add(items_at + n.items).write(n.fused as u64) };
                    let desc = table.device + 8 * fused_at as u64;
                    let items = table.device + 8 * (items_at + launched.2) as u64;
                    self.launch_items(stream, desc, items, count, out)?;
                } else {
                    let desc = table.device + 8 * (fused_at + 3 * launched.2) as u64;
                    self.launch(stream, &self.copy_crc_kernel, desc, count, &[out, tables], FUSED_BLOCKS_PER_SM)?;
                }
                launched.2 = n.items;
            }
            if n.copy > launched.0 {
                let desc = table.device + 8 * (copy_at + 3 * launched.0) as u64;
                self.launch(stream, &self.copy_kernel, desc, n.copy - launched.0, &[0, 0], per_sm)?;
                launched.0 = n.copy;
            }
            if n.sum > launched.1 {
                let desc = table.device + 8 * (crc_at + 3 * launched.1) as u64;
                let out = table.device + 8 * out_at as u64;
                self.crc.wait(&stream.record_event(None).map_err(dev_err)?).map_err(dev_err)?;
                let (tables, grid) = (self.crc_tables, self.cfg.blocks_per_sm);
                self.launch(&self.crc, &self.crc_kernel, desc, n.sum - launched.1, &[out, tables], grid)?;
                launched.1 = n.sum;
            }
            Ok::<(), GpuError>(())
        };
        let mut walk = p.in_ranges.walk();
        for (i, op) in p.batch.ops.iter().enumerate() {
            let (from, to) = (p.src.addrs[op.src] + op.src_offset, p.dst_addr[i]);
            let in_ranges = walk.next(i, op.len);
            let fused = !in_ranges.is_empty()
                && self.cfg.peer_fused_checksums
                && op.len.is_multiple_of(STRIPE_BYTES)
                && (from | to).is_multiple_of(16);
            if fused {
                // Copied by the fused kernel below, piece by piece.
            } else if op.len >= self.cfg.dma_min_bytes {
                // Earlier kernel pieces first: one stream keeps the order.
                flush(&n, &mut launched)?;
                open = None;
                // SAFETY: the source lies in a mapped (or pinned) peer
                // buffer, the destination in a pinned buffer of ours, both
                // validated; they are different allocations.
                unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, op.len as usize, stream.cu_stream()) }
                    .result()
                    .map_err(dev_err)?;
            } else {
                let mut off = 0;
                while off < op.len {
                    let len = (op.len - off).min(PIECE_BYTES_MAX);
                    // SAFETY: `n.copy < copy_bound`: the bound counts these pieces.
                    unsafe { write3(table.host, copy_at + 3 * n.copy, [from + off, to + off, len]) };
                    n.copy += 1;
                    off += len;
                }
            }
            // One output per checksum piece (the checksum kernel reading
            // the landed destination) or per fused item (the fused kernel,
            // which copies it too); a fused op's pieces are whole stripes.
            let mut off = 0;
            while !in_ranges.is_empty() && off < op.len {
                let len = (op.len - off).min(PIECE_BYTES_MAX);
                if !fused {
                    // SAFETY: `n.sum <= n.out < crc_bound`: the bound counts these pieces.
                    unsafe { write3(table.host, crc_at + 3 * n.sum, [to + off, n.out as u64, len]) };
                    n.sum += 1;
                    for &(r, at) in in_ranges {
                        folds.push((r, at + off, len, n.out));
                    }
                    n.out += 1;
                    off += len;
                    continue;
                }
                // The fused kernels' producer and consumer walk the same
                // stripes only if every piece has at least one.
                debug_assert!(len > 0 && len.is_multiple_of(STRIPE_BYTES), "fused piece of {len} bytes");
                // A piece of one range right after the open item's last
                // piece in that range joins the item while it is short.
                let joins = open.filter(|&fold| {
                    let (r, start, bytes, _) = folds[fold];
                    let next = start + bytes;
                    matches!(in_ranges, &[(range, at)] if r == range && next == at + off && bytes + len <= item_max)
                });
                let out = if let Some(fold) = joins {
                    folds[fold].2 += len;
                    folds[fold].3
                } else {
                    // SAFETY: `n.items < crc_bound`: at most one item per piece.
                    unsafe { table.host.add(items_at + n.items).write(n.fused as u64) };
                    n.items += 1;
                    open = (in_ranges.len() == 1).then_some(folds.len());
                    for &(r, at) in in_ranges {
                        folds.push((r, at + off, len, n.out));
                    }
                    n.out += 1;
                    n.out - 1
                };
                // SAFETY: `n.fused < crc_bound`: the bound counts these pieces.
                unsafe { write3(table.host, fused_at + 3 * n.fused, [from + off, to + off, len | (out as u64) << 32]) };
                n.fused += 1;
                off += len;
            }
            chunk += op.len;
            if chunk >= CHUNK_BYTES {
                flush(&n, &mut launched)?;
                open = None;
                chunk = 0;
            }
        }
        flush(&n, &mut launched)?;
        let planned = std::time::Instant::now();
        let copied = stream.record_event(None).map_err(dev_err)?;
        let summed = self.crc.record_event(None).map_err(dev_err)?;
        copied.synchronize().map_err(dev_err)?;
        summed.synchronize().map_err(dev_err)?;
        let waited = std::time::Instant::now();
        // SAFETY: the checksum kernels finished writing `n.out` u32s at `out_at`.
        let out = unsafe { std::slice::from_raw_parts(table.host.add(out_at).cast::<u32>(), n.out) };
        // Each range's pieces and items were written in op order, as the
        // folder wants.
        let mut folder = RangeFolder::new(ranges);
        for &(r, off, len, k) in &folds {
            folder.add(r, off, len, out[k]);
        }
        let sums = folder.finish().ok_or_else(|| GpuError::Device("peer checksum pieces did not tile".into()));
        let (called, submitted, started) = p.times;
        let us = |a: std::time::Instant, b: std::time::Instant| (b - a).as_micros() as u64;
        tracing::debug!(
            target: PEER_TIMING_TRACE_TARGET,
            ops = p.batch.ops.len(),
            items = n.items,
            prep = us(called, submitted),
            queued = us(submitted, started),
            pre = us(started, planning),
            plan = us(planning, planned),
            wait = us(planned, waited),
            fold = us(waited, std::time::Instant::now()),
            "peer batch"
        );
        sums
    }
}

/// Descriptors [`Inner::enqueue_peer`] wrote so far.
#[derive(Default)]
struct Counts {
    copy: usize,
    sum: usize,
    fused: usize,
    items: usize,
    out: usize,
}

/// What [`Inner::enqueue_peer`] works from.
pub(super) struct PeerPlan<'a> {
    batch: &'a PeerCopyBatch,
    src: &'a Sources,
    dst_addr: &'a [u64],
    in_ranges: &'a RangesByOp<'a>,
    table: &'a Table,
    copy_bound: usize,
    crc_bound: usize,
    /// When `submit_peer` was called, when it handed the batch to a
    /// worker, and when that worker started.
    times: (std::time::Instant, std::time::Instant, std::time::Instant),
}

/// Raw peer copy timing for `kvferry bench ipc`: `cuMemcpyDtoDAsync` of
/// every `(src offset, dst offset, bytes)` part from an opened peer buffer
/// into a local buffer, back to back on one stream; best of `reps`, in
/// seconds, by device events and by the caller's clock (enqueue to done).
///
/// # Errors
/// [`GpuError::Unsupported`] for a buffer another backend opened, range and
/// driver errors.
pub fn time_raw_peer_copy(
    gpu: &super::CudaGpu,
    src: &Arc<dyn PeerBuffer>,
    dst: DeviceBufferId,
    parts: &[(u64, u64, u64)],
    reps: usize,
) -> Result<(f64, f64), GpuError> {
    let i = &gpu.inner;
    let s = src
        .as_any()
        .downcast_ref::<CudaPeerBuffer>()
        .ok_or_else(|| GpuError::Unsupported("a peer buffer the cuda backend did not open".into()))?;
    let d = i.buffers.get(dst).ok_or(GpuError::UnknownBuffer(dst))?;
    for &(so, doff, n) in parts {
        checked_range(so, n, s.len)?;
        checked_range(doff, n, d.len)?;
    }
    i.ctx.bind_to_thread().map_err(dev_err)?;
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = i.ctx.new_event(timing).map_err(dev_err)?;
    let end = i.ctx.new_event(timing).map_err(dev_err)?;
    let (mut best_ev, mut best_wall) = (f64::MAX, f64::MAX);
    for _ in 0..reps {
        i.peer.synchronize().map_err(dev_err)?;
        let t = std::time::Instant::now();
        start.record(&i.peer).map_err(dev_err)?;
        for &(so, doff, n) in parts {
            // SAFETY: both ranges checked above; different allocations.
            unsafe { sys::cuMemcpyDtoDAsync_v2(d.addr + doff, s.device_ptr() + so, n as usize, i.peer.cu_stream()) }
                .result()
                .map_err(dev_err)?;
        }
        end.record(&i.peer).map_err(dev_err)?;
        end.synchronize().map_err(dev_err)?;
        best_wall = best_wall.min(t.elapsed().as_secs_f64());
        best_ev = best_ev.min(f64::from(start.elapsed_ms(&end).map_err(dev_err)?) / 1e3);
    }
    Ok((best_ev, best_wall))
}

/// The peer-copy checks `kvferry bench gpu` runs on a real device (C19's
/// bad inputs): an in-process export copies and checksums like the host
/// backend; a CUDA IPC handle does not open in the process that made it,
/// and malformed or forged handles and an export that overruns its
/// allocation are refused with [`GpuError::Peer`], nothing copied. Returns
/// one line per check.
///
/// # Errors
/// The first check that went the wrong way, as text.
pub async fn peer_checks(gpu: &super::CudaGpu) -> Result<Vec<String>, String> {
    use crate::gpu::Gpu;
    let s = |e: GpuError| e.to_string();
    let mut out = Vec::new();
    let (a, b) = (gpu.alloc(1 << 20).map_err(s)?, gpu.alloc(1 << 20).map_err(s)?);
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    gpu.write(a, 0, &data).map_err(s)?;
    let e = gpu.export_buffer(a, PeerKind::Process).map_err(s)?;
    let src = gpu.open_peer_buffer(&e).map_err(s)?;
    let op = |so: u64, d: u64, len: u64| peer::PeerCopyOp { src: 0, src_offset: so, dst: b, dst_offset: d, len };
    // Runs a batch and checks its checksums and bytes against `data`.
    let check = |ops: Vec<peer::PeerCopyOp>, ranges: Vec<std::ops::Range<usize>>| {
        let (src, data) = (src.clone(), &data);
        async move {
            let batch = PeerCopyBatch { sources: vec![src], ops: ops.clone(), checksums: ranges.clone() };
            let sums = gpu.submit_peer(batch).await.map_err(s)?;
            let mut back = vec![0u8; 1 << 20];
            gpu.read(b, 0, &mut back).map_err(s)?;
            let want: Vec<u32> = ranges
                .iter()
                .map(|r| {
                    ops[r.clone()].iter().fold(0, |c, o| {
                        let (so, d, n) = (o.src_offset as usize, o.dst_offset as usize, o.len as usize);
                        if back[d..d + n] != data[so..so + n] {
                            return u32::MAX;
                        }
                        crc32c::crc32c_append(c, &data[so..so + n])
                    })
                })
                .collect();
            if sums != want || want.contains(&u32::MAX) {
                return Err(format!("checksums {sums:?}, want {want:?} (or the bytes differ)"));
            }
            Ok::<_, String>(back)
        }
    };
    let ops = vec![op(0, 4096, 300_000), op(500_000, 0, 4096), op(600_000, 400_000, 3 << 16)];
    check(ops, vec![0..2, 2..3]).await.map_err(|e| format!("in-process peer batch: {e}"))?;
    out.push("in-process export: 3 ops copied, 2 destination checksums and the bytes verified".to_string());
    // Scattered whole-stripe segments, as KV layouts are: the fused
    // kernel's items join a range's consecutive segments and end at an op
    // that is not whole stripes, at the item limit and at the range's end.
    let mut ops: Vec<_> = (0..10u64).map(|k| op(((k * 7) % 10) << 15, 4096 + (k << 15), 1 << 15)).collect();
    ops.push(op(340_000, 400_000, 5000));
    ops.extend((0..2u64).map(|k| op(700_000 + (k << 14), 420_000 + ((1 - k) << 14), 1 << 14)));
    ops.push(op(800_000, 480_000, 3 * PIECE_BYTES_MAX + STRIPE_BYTES));
    ops.push(op(123_456, 720_000, 4096));
    let mut back = check(ops, vec![0..13, 13..14, 14..15]).await.map_err(|e| format!("scattered peer batch: {e}"))?;
    out.push(
        "scattered segments: 15 ops in 3 ranges copied and checksummed in items, checksums and bytes verified".into(),
    );
    let ipc = gpu.export_buffer(a, PeerKind::CudaIpc).map_err(s)?;
    let mut expect = |what: &str, e: &BufferExport| match gpu.open_peer_buffer(e) {
        Err(err @ GpuError::Peer(_)) => {
            out.push(format!("{what}: refused ({err})"));
            Ok(())
        }
        Err(err) => Err(format!("{what}: refused for the wrong reason: {err}")),
        Ok(_) => Err(format!("{what}: opened")),
    };
    expect("a CUDA IPC handle opened in the process that made it", &ipc)?;
    expect("a 63-byte handle", &BufferExport { handle: vec![7; 63], ..ipc.clone() })?;
    expect("a forged handle", &BufferExport { handle: vec![0x5a; IPC_HANDLE_BYTES], ..ipc.clone() })?;
    let mut forged = e.clone();
    forged.handle[4] ^= 1;
    match gpu.open_peer_buffer(&forged) {
        Err(GpuError::Peer(m)) => out.push(format!("a process token that was never issued: refused ({m})")),
        other => return Err(format!("a process token that was never issued: {:?}", other.map(|_| ()))),
    }
    // A batch reading past its peer buffer copies nothing.
    let before = back.clone();
    let bad =
        PeerCopyBatch { sources: vec![src], ops: vec![op(0, 0, 4096), op((1 << 20) - 8, 8192, 16)], checksums: vec![] };
    match gpu.submit_peer(bad).await {
        Err(GpuError::OutOfRange(m)) => out.push(format!("an op past the peer buffer: refused ({m})")),
        other => return Err(format!("an op past the peer buffer: {other:?}")),
    }
    gpu.read(b, 0, &mut back).map_err(s)?;
    if back != before {
        return Err("a refused peer batch wrote to its destination".into());
    }
    gpu.unregister(a).map_err(s)?;
    gpu.unregister(b).map_err(s)?;
    Ok(out)
}
