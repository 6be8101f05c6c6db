//! The `host` GPU backend: device KV buffers are plain host memory and a
//! "copy" is a `memcpy`. It is the embedded default (no GPU needed) and the
//! simulator's GPU.
//!
//! What it models: batched scattered copies with a completion, buffers
//! handed back by the completion, whole-batch failure. What it does not:
//! asynchrony (copies run inside `submit`, so the completion is ready at
//! once), PCIe bandwidth, device memory limits. Failure injection: a test can
//! make the next N batches fail ([`HostGpu::fail_next_batches`]).
//!
//! Speed (it is the embedded default's save and load): a save's slot
//! checksums are taken piece by piece right after each piece's copy, while
//! the bytes are still in cache, instead of reading the pool back afterwards;
//! and a large batch is split by host extent over several OS threads
//! ([`super::par`]; one thread under the simulator). A test can instead have
//! it checksum saves the way the CUDA backend does
//! ([`HostGpu::with_device_checksums`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{
    BatchPin, BufferTable, ChecksumRange, Completed, Completion, CopyBatch, CopyOp, Direction, Gpu, GpuError, HostBuf,
    HostMemory, KvMemory, checked_range, crc, par, peer, pin_and_validate,
};
use crate::memory::DeviceBufferId;

/// Host-memory "device": every buffer is a range of this process's memory
/// in a [`BufferTable`] — the embedder's (registered with
/// [`Gpu::register_external`]) or one this backend allocated
/// ([`HostGpu::alloc`]); a copy is a `memcpy` between raw pointers.
#[derive(Default)]
pub struct HostGpu {
    buffers: BufferTable,
    /// Allocations this backend owns, by buffer id (16-byte aligned words);
    /// freed when the buffer is unregistered or the backend drops.
    owned: Mutex<HashMap<u32, HostMemory>>,
    fail_next: AtomicU64,
    /// Batches to let through before `fail_next` applies.
    pass_first: AtomicU64,
    /// Model the CUDA backend's device checksums (see
    /// [`HostGpu::with_device_checksums`]).
    device_checksums: bool,
}

impl HostGpu {
    /// A backend with no buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend that answers a save's checksum ranges the way the CUDA
    /// backend does — pieces of the *source* bytes checksummed by the CPU
    /// model of the device kernel, folded per range — so the engine's
    /// device-checksum path runs without a GPU. Slower than letting the
    /// engine checksum; for tests.
    pub fn with_device_checksums() -> Self {
        Self { device_checksums: true, ..Self::default() }
    }

    /// Allocates a zeroed buffer of `bytes` that this backend owns (frees on
    /// [`Gpu::unregister`] or drop) and registers it: the same kind of entry
    /// as an embedder's memory, marked owned, for tests and the simulator
    /// (whose buffers must outlive every task of a killed node).
    ///
    /// # Errors
    /// [`GpuError::Alloc`], or the registration's [`GpuError::Buffer`].
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBufferId, GpuError> {
        let mem = HostMemory::new(bytes)?;
        let id = self.buffers.register(mem.addr(), bytes, true)?;
        self.owned.lock().expect("owned lock").insert(id.0, mem);
        Ok(id)
    }

    /// The buffer table (for wrappers that model asynchronous copies: a
    /// batch they hold back keeps its buffers pinned with
    /// [`BufferTable::pin_batch`] until it completes).
    pub fn buffers(&self) -> &BufferTable {
        &self.buffers
    }

    /// Makes the next `n` submitted batches fail with [`GpuError::Device`]
    /// (their host buffers still come back).
    pub fn fail_next_batches(&self, n: u64) {
        self.fail_next_batches_after(0, n);
    }

    /// Lets the next `pass` batches through, then fails the `n` after them
    /// (a failure in the middle of a save or load cut into several batches).
    pub fn fail_next_batches_after(&self, pass: u64, n: u64) {
        self.pass_first.store(pass, Ordering::SeqCst);
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Checksums of a save's ranges from the device bytes (see
    /// [`HostGpu::with_device_checksums`]); `None` when not tiled in order.
    fn device_side_checksums(batch: &CopyBatch, pin: &BatchPin) -> Option<Vec<u32>> {
        let index = crc::RangeIndex::new(&batch.checksums, batch.host.len())?;
        let tables = crc::kernel_tables();
        let mut folder = crc::RangeFolder::new(&batch.checksums);
        for op in &batch.ops {
            let (addr, _) = pin.get(op.buffer)?;
            crc::checksum_pieces(&index, op.extent, op.host_offset, op.len, |r, in_range, off, n| {
                // SAFETY: validated in range of a live, pinned buffer.
                let dev = unsafe { device_slice(addr, op.device_offset + off, n) };
                folder.add(r, in_range, n, crc::piece_raw_model(&tables, dev));
            });
        }
        folder.finish()
    }

    /// Runs a batch; returns the pin (so device-side checksums can read the
    /// same buffers before it is released) and, for a save whose checksum
    /// ranges each op tiles in host order, the standard CRC-32C of every
    /// range, taken piece by piece right after each piece's copy (see
    /// [`crate::limits::HOST_COPY_CHECKSUM_PIECE_BYTES`]). Large batches are
    /// split by host extent over several threads ([`par`]).
    fn run(&self, batch: &mut CopyBatch) -> Result<(BatchPin, Option<Vec<u32>>), GpuError> {
        let pin = pin_and_validate(&self.buffers, batch)?;
        let passing = self.pass_first.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if !passing && self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(GpuError::Device("injected failure".into()));
        }
        let CopyBatch { direction, ops, host, checksums } = batch;
        let direction = *direction;
        let dev: Vec<u64> = ops
            .iter()
            .map(|op| {
                pin.get(op.buffer).map(|(addr, _)| addr + op.device_offset).ok_or(GpuError::UnknownBuffer(op.buffer))
            })
            .collect::<Result<_, _>>()?;
        let fused = direction == Direction::DeviceToHost && !checksums.is_empty() && !self.device_checksums;
        let index = if fused { crc::RangeIndex::new(checksums, host.len()) } else { None };
        let sums = index.as_ref().map(|i| (i, &checksums[..]));
        let parts = split_parts(ops, &dev, host);
        let ranges = checksums.len();
        let done = crate::rt::map_parts(parts, |part| copy_part(part, direction, sums, ranges));
        let mut folds: Option<Vec<(u64, u32)>> = sums.map(|_| vec![(0, 0); ranges]);
        for part in done {
            let part = part?;
            match (&mut folds, part) {
                (Some(all), Some(mine)) => {
                    for (r, f) in mine.into_iter().enumerate() {
                        if f.0 > 0 {
                            // A range is one extent's, and an extent one part's.
                            all[r] = if all[r].0 == 0 { f } else { (u64::MAX, 0) };
                        }
                    }
                }
                _ => folds = None,
            }
        }
        let sums = folds.and_then(|f| {
            f.iter().zip(checksums.iter()).all(|(f, r)| f.0 == r.len).then(|| f.into_iter().map(|f| f.1).collect())
        });
        Ok((pin, sums))
    }

    /// A peer batch, synchronously: every source pinned in its owner's
    /// table and every destination in ours for the whole copy (neither side
    /// can unregister and free a buffer under it, C15), then a `memcpy` per
    /// op and the CRC-32C of each checksum range over the destination bytes.
    /// Injected failures ([`HostGpu::fail_next_batches`]) apply here too.
    fn run_peer(&self, batch: &peer::PeerCopyBatch) -> Result<Vec<u32>, GpuError> {
        peer::validate_peer_batch(batch)?;
        // Each source's address: an in-process owner's buffer pinned in its
        // table ([`peer::pin_process_sources`]), a mapped host region kept
        // alive by the batch's own `Arc`.
        let process = peer::pin_process_sources(&batch.sources)?;
        let mut src = Vec::with_capacity(batch.sources.len());
        for (s, process_addr) in batch.sources.iter().zip(&process.addrs) {
            match (s.as_any().downcast_ref::<peer::HostRegionBuffer>(), process_addr) {
                (Some(h), _) => src.push(h.addr() as u64),
                (None, Some(addr)) => src.push(*addr),
                (None, None) => return Err(GpuError::Unsupported("a peer buffer another backend opened".into())),
            }
        }
        let pin = self.buffers.pin_batch(batch.ops.iter().map(|op| op.dst));
        let mut dst = Vec::with_capacity(batch.ops.len());
        for op in &batch.ops {
            let (addr, len) = pin.get(op.dst).ok_or(GpuError::UnknownBuffer(op.dst))?;
            checked_range(op.dst_offset, op.len, len)?;
            dst.push(addr + op.dst_offset);
        }
        let passing = self.pass_first.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if !passing && self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(GpuError::Device("injected failure".into()));
        }
        for (op, &to) in batch.ops.iter().zip(&dst) {
            let from = src[op.src] + op.src_offset;
            // SAFETY: both ranges validated inside live buffers pinned for
            // the copy; registered memory is valid (C15); a peer's buffer and
            // ours are different registrations (an engine never reads its own
            // buffers this way, and overlapping ranges are refused by each
            // table), so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, op.len as usize) };
        }
        let sums = batch
            .checksums
            .iter()
            .map(|r| {
                r.clone().fold(0u32, |c, i| {
                    // SAFETY: as above; the copy is done and nothing writes it.
                    let d = unsafe { device_slice(dst[i], 0, batch.ops[i].len) };
                    crc32c::crc32c_append(c, d)
                })
            })
            .collect();
        drop(process);
        drop(pin);
        Ok(sums)
    }

    /// `(addr, len)` of a live buffer, with `offset..offset+n` checked.
    fn checked(&self, id: DeviceBufferId, offset: u64, n: usize) -> Result<u64, GpuError> {
        let e = self.buffers.get(id).ok_or(GpuError::UnknownBuffer(id))?;
        checked_range(offset, n as u64, e.len)?;
        Ok(e.addr + offset)
    }
}

/// `n` device bytes at `addr + offset` as a slice.
///
/// # Safety
/// The range must lie in a live buffer (validated), not written meanwhile.
unsafe fn device_slice<'a>(addr: u64, offset: u64, n: u64) -> &'a [u8] {
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts((addr + offset) as *const u8, n as usize) }
}

/// One thread's share of a batch: a run of the batch's host extents (the
/// first at index `first_extent`) and the ops naming them, with each op's
/// device address.
struct Part<'a> {
    first_extent: usize,
    host: &'a mut [HostBuf],
    ops: &'a [CopyOp],
    dev: &'a [u64],
}

/// Cuts a batch into [`par::parts_for`] parts of about equal bytes at host
/// extent boundaries (one part when the ops do not name extents in
/// non-decreasing order, or the batch is small).
fn split_parts<'a>(ops: &'a [CopyOp], dev: &'a [u64], host: &'a mut [HostBuf]) -> Vec<Part<'a>> {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let want = par::parts_for(total);
    let in_order = ops.windows(2).all(|w| w[0].extent <= w[1].extent);
    // (first extent, first op) of each part.
    let mut cuts = vec![(0usize, 0usize)];
    if want > 1 && in_order {
        let share = total.div_ceil(want as u64);
        let mut acc = 0u64;
        for (i, op) in ops.iter().enumerate() {
            if i > 0 && op.extent != ops[i - 1].extent && cuts.len() < want && acc >= share * cuts.len() as u64 {
                cuts.push((op.extent, i));
            }
            acc += op.len;
        }
    }
    let mut parts = Vec::with_capacity(cuts.len());
    let mut rest = host;
    for (j, &(ext, op)) in cuts.iter().enumerate() {
        let (ext_end, op_end) = cuts.get(j + 1).copied().unwrap_or((ext + rest.len(), ops.len()));
        let (mine, tail) = rest.split_at_mut(ext_end - ext);
        rest = tail;
        parts.push(Part { first_extent: ext, host: mine, ops: &ops[op..op_end], dev: &dev[op..op_end] });
    }
    parts
}

/// Runs one part's copies. With `sums` (a save's checksum ranges, indexed),
/// each op is copied in pieces that never straddle a range boundary and
/// each piece in a range is folded into that range's CRC-32C right after
/// its copy; returns per range `(bytes folded, CRC so far)` — zero bytes for
/// ranges of other parts — or `None` when a range's pieces did not arrive
/// in host order (the caller then checksums on the CPU).
fn copy_part(
    part: Part<'_>,
    direction: Direction,
    sums: Option<(&crc::RangeIndex, &[ChecksumRange])>,
    ranges: usize,
) -> Result<Option<Vec<(u64, u32)>>, GpuError> {
    let mut folds: Option<Vec<(u64, u32)>> = sums.map(|_| vec![(0, 0); ranges]);
    for (op, &dev) in part.ops.iter().zip(part.dev) {
        let (h0, n) = (op.host_offset as usize, op.len as usize);
        match (direction, &mut part.host[op.extent - part.first_extent]) {
            (Direction::DeviceToHost, HostBuf::Writable(ext)) => {
                let dst = &mut ext.as_mut_slice()[h0..h0 + n];
                let Some((index, ranges)) = sums else {
                    // SAFETY: `validate_batch` proved both ranges in bounds;
                    // the buffer is pinned (cannot be unregistered) and the
                    // embedder keeps registered memory valid (C15).
                    unsafe { std::ptr::copy_nonoverlapping(dev as *const u8, dst.as_mut_ptr(), n) };
                    continue;
                };
                let piece_max = crate::limits::HOST_COPY_CHECKSUM_PIECE_BYTES;
                crc::split_op(index, op.extent, op.host_offset, op.len, piece_max, |off, len, range| {
                    let piece = &mut dst[off as usize..(off + len) as usize];
                    // SAFETY: a piece of the op validated above.
                    unsafe { std::ptr::copy_nonoverlapping((dev + off) as *const u8, piece.as_mut_ptr(), piece.len()) };
                    let (Some(r), Some(f)) = (range, folds.as_mut()) else { return };
                    let r = r as usize;
                    let at = op.host_offset + off - ranges[r].offset;
                    if f[r].0 == at {
                        f[r] = (at + len, crc32c::crc32c_append(f[r].1, piece));
                    } else {
                        folds = None;
                    }
                });
            }
            (Direction::HostToDevice, HostBuf::Sealed(ext)) => {
                // SAFETY: as above.
                unsafe { streaming_copy(ext.as_slice()[h0..h0 + n].as_ptr(), dev as *mut u8, n) };
            }
            _ => return Err(GpuError::WrongHostKind(direction)),
        }
    }
    Ok(folds)
}

/// Copies below this many bytes use a plain `memcpy` in
/// [`streaming_copy`].
const STREAMING_COPY_BYTES_MIN: usize = 4096;

/// Copies `n` bytes from `src` to `dst` (a load into the embedder's KV
/// memory, which the copy does not read back): on x86-64 the body with
/// non-temporal stores, which write whole cache lines without first
/// reading them (a plain `memcpy` of a 32 KiB fragment reads every
/// destination line before writing it: a third more memory traffic; glibc
/// streams only copies of several MiB, so one large `memcpy` does not pay
/// it); elsewhere, and for short copies, `memcpy`.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: both ranges valid for `n` bytes
/// and not overlapping.
unsafe fn streaming_copy(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAMING_COPY_BYTES_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Head up to a 16-byte aligned destination, then 64-byte lines,
        // then the tail.
        let head = dst.align_offset(16).min(n);
        let body = (n - head) / 64 * 64;
        // SAFETY: every access lies in `[0, n)` of both ranges (caller);
        // `dst + head` is 16-byte aligned, as `_mm_stream_si128` needs;
        // SSE2 is part of x86-64.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            for i in (0..body).step_by(64) {
                let (s, d) = (s.add(i) as *const __m128i, d.add(i) as *mut __m128i);
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            // Streaming stores are weakly ordered: fence before the
            // completion says the bytes are there.
            _mm_sfence();
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), n - head - body);
        }
        return;
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

impl Gpu for HostGpu {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, GpuError> {
        Ok(self.buffers.register(addr, len, false)?)
    }

    fn unregister(&self, id: DeviceBufferId) -> Result<(), GpuError> {
        let entry = self.buffers.unregister(id)?;
        peer::revoke_process(&self.buffers, id);
        if entry.owned {
            self.owned.lock().expect("owned lock").remove(&id.0);
        }
        Ok(())
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.buffers.get(id).map(|e| e.len)
    }

    fn alloc_kv_memory(&self, bytes: u64) -> Result<Box<dyn KvMemory>, GpuError> {
        Ok(Box::new(HostMemory::new(bytes)?))
    }

    fn submit(&self, mut batch: CopyBatch) -> Completion {
        let (result, checksums) = match self.run(&mut batch) {
            Ok((pin, fused)) => {
                let device_side = self.device_checksums && batch.direction == Direction::DeviceToHost;
                let sums = if device_side && !batch.checksums.is_empty() {
                    Self::device_side_checksums(&batch, &pin)
                } else {
                    fused
                };
                (Ok(()), sums)
            }
            Err(e) => (Err(e), None),
        };
        Box::pin(std::future::ready(Completed { host: batch.host, result, checksums }))
    }

    /// Always: a save's ranges are checksummed as they are copied (or,
    /// [`HostGpu::with_device_checksums`], by the model of the CUDA kernel).
    fn checksums_on_device(&self) -> bool {
        true
    }

    fn peer_kind(&self) -> Option<peer::PeerKind> {
        Some(peer::PeerKind::Process)
    }

    fn export_buffer(&self, id: DeviceBufferId, kind: peer::PeerKind) -> Result<peer::BufferExport, GpuError> {
        match kind {
            peer::PeerKind::Process => peer::export_process(&self.buffers, id),
            other => Err(GpuError::Unsupported(format!("{other:?} exports on the host backend"))),
        }
    }

    fn open_peer_buffer(&self, export: &peer::BufferExport) -> Result<Arc<dyn peer::PeerBuffer>, GpuError> {
        peer::open_process(export)
    }

    fn open_host_region(
        &self,
        addr: usize,
        len: u64,
        keep: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<Arc<dyn peer::PeerBuffer>, GpuError> {
        Ok(Arc::new(peer::HostRegionBuffer::new(addr, len, keep)?))
    }

    fn submit_peer(&self, batch: peer::PeerCopyBatch) -> peer::PeerCompletion {
        Box::pin(std::future::ready(self.run_peer(&batch)))
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        let at = self.checked(id, offset, data.len())?;
        // SAFETY: in range of a live buffer (checked); registered memory is
        // valid and writable (C15).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at as *mut u8, data.len()) };
        Ok(())
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let at = self.checked(id, offset, out.len())?;
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::streaming_copy;

    /// Every length around the streaming threshold and the 64-byte line,
    /// from and to every alignment, lands byte for byte and touches nothing
    /// outside the destination range.
    #[test]
    fn streaming_copy_lands_exact_bytes_at_any_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
        for n in [0usize, 1, 63, 4095, 4096, 4097, 4096 + 63, 8191, 12_345] {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 1), (7, 13), (15, 3)] {
                let mut dst = vec![0xAAu8; n + 64];
                // SAFETY: both ranges in bounds, distinct vectors.
                unsafe { streaming_copy(src[s_off..].as_ptr(), dst[d_off..].as_mut_ptr(), n) };
                assert_eq!(&dst[d_off..d_off + n], &src[s_off..s_off + n], "n {n} at {s_off}/{d_off}");
                assert!(dst[..d_off].iter().chain(&dst[d_off + n..]).all(|&b| b == 0xAA), "n {n}: wrote outside");
            }
        }
    }
}
