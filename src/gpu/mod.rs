//! The `Gpu` door: device KV buffers plus batched scattered copies between
//! them and the pinned pool, shaped like CUDA streams (submit a batch, get a
//! completion).
//!
//! # Failure contract
//! - [`Gpu::submit`] takes ownership of the host extents a batch touches and
//!   its [`Completion`] hands every one of them back, on success and on error
//!   alike. A backend whose copies run asynchronously (DMA) must keep the
//!   extents alive until the hardware is done, even if the completion future
//!   is dropped: dropping or timing out a completion never frees memory a
//!   copy may still touch (contract C11).
//! - A batch either completes (`Ok`) or fails as a whole (`Err`): on error the
//!   caller must treat every destination of the batch as garbage. Copies are
//!   validated before anything runs (buffer ids, ranges), so a bad batch is
//!   an error, never an out-of-bounds access.
//! - Device buffers belong to the embedder (contract C15): it allocates its
//!   KV tensors, registers each range with [`Gpu::register_external`] and
//!   gets a [`DeviceBufferId`] that layouts name. Every backend keeps them
//!   in a [`BufferTable`]: ids are never reused, ranges never overlap, and a
//!   buffer an in-flight batch touches cannot be unregistered
//!   ([`Gpu::unregister`] answers [`BufferError::Busy`]). kvferry never frees
//!   external memory; a backend may allocate a buffer itself (its own
//!   `alloc`, tests and benchmarks), which is the same entry marked owned.
//!
//! # What the embedder keeps alive
//! A registered range must stay valid, writable and at the same address
//! from [`Gpu::register_external`] until [`Gpu::unregister`] returned `Ok`
//! for it. Unregister only after the layouts naming it are unregistered
//! (the engine refuses otherwise) and no save or load of them is running
//! (the backend refuses while a batch touches it).
//!
//! Backends: [`host`] (embedded default: the "device" is host memory; also
//! the simulator's GPU) and `cuda` (feature `cuda`, H200 runs), both opened
//! by name through [`open`], which every build has.

pub mod copy;
pub mod crc;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub mod open;
pub mod par;
pub mod peer;

pub use copy::{Completed, Completion, CopyBatch, CopyOp, Direction, ExternalMemoryError, GpuError, HostBuf};
pub use crc::ChecksumRange;

use crate::memory::DeviceBufferId;
pub use crate::memory::buffers::{BatchPin, BufferError, BufferTable};

/// Memory an embedder allocated for its KV cache, outside any backend's
/// buffer table — what an inference engine's own allocator hands it.
/// Dropping it frees it: keep it alive until its buffer is unregistered.
pub trait KvMemory: Send + Sync {
    /// First byte (a host address for [`HostMemory`], a device address on
    /// CUDA); aligned to [`crate::limits::DEVICE_BUFFER_ALIGN`].
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> u64;
    /// True when zero-length (never, for memory a backend allocated).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Zeroed, 16-byte aligned host memory owned by the caller: the `host`
/// backend's kind of "device" memory, as an embedder would allocate it.
pub struct HostMemory {
    words: Box<[u128]>,
    len: u64,
}

impl HostMemory {
    /// `len` zeroed bytes (at least one 16-byte word is allocated).
    ///
    /// # Errors
    /// [`GpuError::Alloc`] when the memory cannot be had.
    pub fn new(len: u64) -> Result<Self, GpuError> {
        let words = usize::try_from(len.div_ceil(16).max(1))
            .map_err(|_| GpuError::Alloc { bytes: len, reason: "larger than the address space".into() })?;
        let mut v: Vec<u128> = Vec::new();
        v.try_reserve_exact(words).map_err(|e| GpuError::Alloc { bytes: len, reason: e.to_string() })?;
        v.resize(words, 0);
        Ok(Self { words: v.into_boxed_slice(), len })
    }
}

impl KvMemory for HostMemory {
    fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    fn len(&self) -> u64 {
        self.len
    }
}

/// The GPU backend trait. See the module doc for the failure contract.
pub trait Gpu: Send + Sync + 'static {
    /// Backend name (`host`, `cuda`).
    fn name(&self) -> &'static str;

    /// Registers `len` bytes of memory the embedder allocated at `addr` (a
    /// device address on `cuda`, a host address on `host`) and returns the
    /// id layouts name it by. The backend validates what it can (non-null,
    /// aligned to [`crate::limits::DEVICE_BUFFER_ALIGN`], no overlap with a
    /// live buffer; on `cuda`, the driver's pointer attributes: device
    /// memory of this device, inside one allocation) and registers nothing
    /// on error.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory the copies may read and write,
    /// valid at the same address until [`Gpu::unregister`] returned `Ok`
    /// for the id (module doc, "What the embedder keeps alive"). kvferry
    /// never frees it.
    ///
    /// # Errors
    /// [`GpuError::Buffer`] (null, empty, unaligned, overlapping, too many),
    /// [`GpuError::External`] (`cuda`: not this device's memory, or past the
    /// end of its allocation).
    unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, GpuError>;

    /// Forgets a buffer; an owned one (allocated by the backend) is freed,
    /// external memory never is.
    ///
    /// # Errors
    /// [`GpuError::Buffer`] with [`BufferError::Unknown`] or
    /// [`BufferError::Busy`] (an in-flight batch touches it); nothing
    /// changes.
    fn unregister(&self, id: DeviceBufferId) -> Result<(), GpuError>;

    /// Length of a buffer in bytes, `None` if unknown.
    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64>;

    /// The allocation holding `addr` as `(start, len)` in bytes, as this
    /// backend's allocator or driver knows it: on `cuda` the driver's
    /// pointer attributes (`RANGE_START_ADDR`, `RANGE_SIZE`) of any device
    /// memory of the process (PyTorch's and CuPy's included). `None`: the
    /// backend cannot tell (default; `host`, which sees plain host memory
    /// from any allocator; an address the driver does not know). Used by
    /// [`group_by_allocation`] so touching tensors are registered as one
    /// buffer only when they share an allocation.
    ///
    /// # Errors
    /// The driver's refusal to answer ([`ExternalMemoryError::Query`]).
    fn allocation_range(&self, addr: u64) -> Result<Option<(u64, u64)>, GpuError> {
        let _ = addr;
        Ok(None)
    }

    /// Allocates `bytes` of this backend's kind of memory the way an
    /// embedder's allocator would — zeroed where the backend can, *not*
    /// registered, owned by the caller — for the replay, tests and
    /// benchmarks that play the embedder. Register it with
    /// [`Gpu::register_external`].
    ///
    /// # Errors
    /// [`GpuError::Alloc`].
    fn alloc_kv_memory(&self, bytes: u64) -> Result<Box<dyn KvMemory>, GpuError>;

    /// Registers host memory (the pinned pool, once at start) so copies can
    /// reach it. The host backend needs nothing; CUDA pins and maps it.
    ///
    /// # Errors
    /// [`GpuError::Unavailable`] when the memory cannot be registered.
    fn register_host(&self, _base: *mut u8, _len: u64) -> Result<(), GpuError> {
        Ok(())
    }

    /// Submits a batch; the completion resolves when every copy landed or
    /// the batch failed, and returns the host buffers.
    fn submit(&self, batch: CopyBatch) -> Completion;

    /// Whether [`Gpu::submit`] answers a save's [`CopyBatch::checksums`]
    /// (when the ops tile each range in host order). Default: no.
    fn checksums_on_device(&self) -> bool {
        false
    }

    /// The best plain device-to-device copy of `bytes` this backend's device
    /// can do, for benchmarks' baselines: one driver copy between two fresh
    /// allocations, no kvferry code in between, best of `reps`; seconds.
    /// `None` where the backend has no device of its own (`host`: its
    /// baseline is a host memcpy).
    ///
    /// # Errors
    /// Allocation and driver failures.
    fn time_raw_device_copy(&self, _bytes: u64, _reps: usize) -> Result<Option<f64>, GpuError> {
        Ok(None)
    }

    /// The best plain pinned host → device copy of `bytes` this backend's
    /// device can do (one driver copy from freshly pinned host memory into
    /// a fresh allocation, best of `reps`; seconds): the limit of a copy
    /// from host memory, which the one-step shared-pool read is measured
    /// against (issue 28 item 3). `None` where the backend has no device.
    ///
    /// # Errors
    /// Allocation, pinning and driver failures.
    fn time_raw_host_to_device_copy(&self, _bytes: u64, _reps: usize) -> Result<Option<f64>, GpuError> {
        Ok(None)
    }

    /// The kind of handle this backend exports and opens for device-direct
    /// copies between engines on one host ([`peer`]); `None`: no such
    /// copies.
    fn peer_kind(&self) -> Option<peer::PeerKind> {
        None
    }

    /// Exports registered buffer `id` as a handle of `kind` for a peer to
    /// open ([`peer::BufferExport`]): [`peer::PeerKind::Process`] for a
    /// reader in this process, [`peer::PeerKind::CudaIpc`] for another
    /// process on this host.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] (default, or a kind this backend does not
    /// export), [`GpuError::UnknownBuffer`], or the driver's refusal.
    fn export_buffer(&self, id: DeviceBufferId, kind: peer::PeerKind) -> Result<peer::BufferExport, GpuError> {
        Err(GpuError::Unsupported(format!("exporting buffer {id:?} as {kind:?}: {} has no peer copies", self.name())))
    }

    /// Opens a peer's export for [`Gpu::submit_peer`].
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] (default, or a kind this backend does not
    /// open), [`GpuError::Peer`] (malformed, foreign, revoked).
    fn open_peer_buffer(&self, export: &peer::BufferExport) -> Result<std::sync::Arc<dyn peer::PeerBuffer>, GpuError> {
        let _ = export;
        Err(GpuError::Unsupported(format!("{} has no peer copies", self.name())))
    }

    /// Opens host memory mapped into this process — a same-host owner's
    /// shared pool, `len` bytes at `addr`, valid while `keep` lives — as a
    /// source of [`Gpu::submit_peer`] batches, so blocks go from the
    /// owner's pool into this engine's device KV in one copy. The `host`
    /// backend reads it as is; `cuda` registers it (`cuMemHostRegister`,
    /// read-only, mapped) until the returned buffer drops. Registering a
    /// large pool takes time (pages are pinned): callers open it once per
    /// mapping and off the async runtime.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] (default), [`GpuError::OutOfRange`] for an
    /// empty or wrapping range, [`GpuError::Unavailable`] when the driver
    /// refuses the registration.
    fn open_host_region(
        &self,
        addr: usize,
        len: u64,
        keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<std::sync::Arc<dyn peer::PeerBuffer>, GpuError> {
        let _ = (addr, len, keep);
        Err(GpuError::Unsupported(format!("{} cannot copy from mapped host memory", self.name())))
    }

    /// Copies from opened peer buffers into this backend's buffers and
    /// checksums the destination runs the batch names ([`peer`]).
    fn submit_peer(&self, batch: peer::PeerCopyBatch) -> peer::PeerCompletion {
        drop(batch);
        let name = self.name();
        Box::pin(std::future::ready(Err(GpuError::Unsupported(format!("{name} has no peer copies")))))
    }

    /// Writes `data` into a device buffer synchronously (workload set-up:
    /// the replay "computes" KV this way; tests use it).
    ///
    /// # Errors
    /// Unknown buffer or out of range.
    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError>;

    /// Reads device bytes back synchronously (verification).
    ///
    /// # Errors
    /// Unknown buffer or out of range.
    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError>;
}

/// One buffer to register for several of the embedder's memory ranges:
/// `[start, start + len)` covers every range of `members` (indices into the
/// slice given to [`group_by_allocation`]), each an offset into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeGroup {
    /// First byte of the buffer.
    pub start: u64,
    /// Bytes.
    pub len: u64,
    /// Indices of the ranges it covers, in address order.
    pub members: Vec<usize>,
}

/// Groups `ranges` (`(addr, len)` in bytes, e.g. the spans of an engine's
/// per-layer K and V tensors) into the buffers to register, one
/// [`Gpu::register_external`] each:
///
/// - ranges that **overlap** (share a byte: K and V as strided views of one
///   `[num_blocks, 2, …]` tensor) share one buffer — registered buffers may
///   not overlap, and a shared byte proves one allocation;
/// - ranges that only **touch** (one ends where the next starts) share a
///   buffer only when [`Gpu::allocation_range`] places both in the same
///   allocation (K and V halves of one `[2, num_blocks, …]` tensor). Separate
///   allocations that an allocator happened to place back to back (PyTorch's
///   caching allocator does, for per-layer tensors) stay separate buffers:
///   the `cuda` backend refuses a buffer spanning two allocations. When the
///   backend cannot tell (`None`, e.g. `host`), touching ranges stay
///   separate — always correct, at the price of one buffer more;
/// - ranges with a gap between them are separate buffers.
///
/// A zero-length range outside every other range is a group of its own
/// (its registration is then refused with the usual error). The result is
/// in address order.
///
/// # Errors
/// [`GpuError::OutOfRange`] for a range whose end overflows `u64`; the
/// backend's error from [`Gpu::allocation_range`].
pub fn group_by_allocation(gpu: &dyn Gpu, ranges: &[(u64, u64)]) -> Result<Vec<RangeGroup>, GpuError> {
    group_ranges(ranges, |addr| gpu.allocation_range(addr))
}

/// [`group_by_allocation`] with the allocation lookup passed in (the pure
/// core, unit-tested with made-up allocators).
///
/// # Errors
/// As [`group_by_allocation`]; `allocation`'s error is passed on.
pub fn group_ranges(
    ranges: &[(u64, u64)],
    mut allocation: impl FnMut(u64) -> Result<Option<(u64, u64)>, GpuError>,
) -> Result<Vec<RangeGroup>, GpuError> {
    let mut order: Vec<(u64, u64, usize)> = Vec::with_capacity(ranges.len());
    for (i, &(addr, len)) in ranges.iter().enumerate() {
        let end = addr.checked_add(len).ok_or_else(|| {
            GpuError::OutOfRange(format!("range {i} [{addr:#x}, +{len}) overflows the address space"))
        })?;
        order.push((addr, end, i));
    }
    order.sort_unstable();
    let mut groups: Vec<RangeGroup> = Vec::new();
    // The allocation of the current group's first range, asked lazily (only
    // when a touching range might join it).
    let mut group_alloc: Option<Option<(u64, u64)>> = None;
    for (start, end, i) in order {
        let joins = match groups.last() {
            Some(g) if g.len > 0 && start < g.start + g.len => true,
            Some(g) if g.len > 0 && start == g.start + g.len && end > start => {
                let here = match group_alloc {
                    Some(a) => a,
                    None => {
                        let a = allocation(g.start)?;
                        group_alloc = Some(a);
                        a
                    }
                };
                here.is_some() && here == allocation(start)?
            }
            _ => false,
        };
        match groups.last_mut() {
            Some(g) if joins => {
                g.len = g.len.max(end - g.start);
                g.members.push(i);
            }
            _ => {
                groups.push(RangeGroup { start, len: end - start, members: vec![i] });
                group_alloc = None;
            }
        }
    }
    Ok(groups)
}

/// `offset..offset+len` as a checked range inside a buffer of `total` bytes.
///
/// # Errors
/// [`GpuError::OutOfRange`] on overflow or when the range ends past `total`.
pub fn checked_range(offset: u64, len: u64, total: u64) -> Result<std::ops::Range<usize>, GpuError> {
    match offset.checked_add(len) {
        Some(end) if end <= total => Ok(offset as usize..end as usize),
        _ => Err(GpuError::OutOfRange(format!("[{offset}, +{len}) beyond {total}"))),
    }
}

/// Pins the buffers a batch names in `table` ([`BufferTable::pin_batch`])
/// and validates the batch against the pinned snapshot, so a buffer cannot
/// be unregistered between validation and the copies.
///
/// # Errors
/// The first bad op as [`GpuError`] (the pin is dropped with it).
pub fn pin_and_validate(table: &BufferTable, batch: &CopyBatch) -> Result<BatchPin, GpuError> {
    let pin = table.pin_batch(batch.ops.iter().map(|op| op.buffer));
    validate_batch(batch, |id| pin.get(id).map(|(_, len)| len))?;
    Ok(pin)
}

/// Checks every op of a batch against buffer lengths and host extents.
///
/// # Errors
/// The first bad op as [`GpuError`].
pub fn validate_batch(batch: &CopyBatch, buffer_len: impl Fn(DeviceBufferId) -> Option<u64>) -> Result<(), GpuError> {
    for h in &batch.host {
        match (batch.direction, h) {
            (Direction::DeviceToHost, HostBuf::Sealed(_)) | (Direction::HostToDevice, HostBuf::Writable(_)) => {
                return Err(GpuError::WrongHostKind(batch.direction));
            }
            _ => {}
        }
    }
    for op in &batch.ops {
        let blen = buffer_len(op.buffer).ok_or(GpuError::UnknownBuffer(op.buffer))?;
        let dev_end = op.device_offset.checked_add(op.len);
        if dev_end.is_none_or(|e| e > blen) {
            return Err(GpuError::OutOfRange(format!(
                "device {:?} [{}, +{}) beyond {blen}",
                op.buffer, op.device_offset, op.len
            )));
        }
        let hlen =
            batch.host.get(op.extent).map(HostBuf::len).ok_or_else(|| {
                GpuError::OutOfRange(format!("host extent index {} of {}", op.extent, batch.host.len()))
            })?;
        let host_end = op.host_offset.checked_add(op.len);
        if host_end.is_none_or(|e| e > hlen) {
            return Err(GpuError::OutOfRange(format!(
                "host extent {} [{}, +{}) beyond {hlen}",
                op.extent, op.host_offset, op.len
            )));
        }
    }
    Ok(())
}

/// Fragment size of the conformance body's scattered copies (bytes).
const CONFORMANCE_FRAG: u64 = 32 << 10;
/// Fragments per direction in the conformance body.
const CONFORMANCE_FRAGS: u64 = 64;
/// Bytes of the device buffer [`conformance`] needs (4 MiB).
pub const CONFORMANCE_BUFFER_BYTES: u64 = 2 * CONFORMANCE_FRAG * CONFORMANCE_FRAGS;

/// The conformance body every backend must pass (run against `host` in
/// `cargo test`, against `cuda` by `kvferry bench gpu` on the H200): scattered
/// device→host and host→device copies land byte for byte, buffers come back
/// with their completion on success and on error, bad batches are errors,
/// and a buffer is unregistered exactly once.
///
/// `dev` is a registered buffer of at least [`CONFORMANCE_BUFFER_BYTES`] that
/// the caller allocated (the embedder's memory: the body never allocates
/// device memory, so a backend that only adopts memory runs it too); its
/// contents are overwritten, and it is unregistered at the end.
///
/// # Errors
/// The first violated expectation, as text.
pub async fn conformance(gpu: &dyn Gpu, dev: DeviceBufferId) -> Result<(), String> {
    use crate::memory::pool::Pool;
    const FRAG: u64 = CONFORMANCE_FRAG;
    const FRAGS: u64 = CONFORMANCE_FRAGS;
    match gpu.buffer_len(dev) {
        Some(len) if len >= CONFORMANCE_BUFFER_BYTES => {}
        other => return Err(format!("conformance needs {dev} of {CONFORMANCE_BUFFER_BYTES} bytes, found {other:?}")),
    }
    let pool = Pool::new(4 * FRAG * FRAGS, 256).map_err(|e| e.to_string())?;
    gpu.register_host(pool.base_ptr(), pool.arena_len()).map_err(|e| e.to_string())?;
    let pattern: Vec<u8> = (0..FRAG * FRAGS).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    gpu.write(dev, 0, &pattern).map_err(|e| e.to_string())?;
    // Save: fragment i of the device goes to slot (FRAGS-1-i) of one extent (shuffled), plus an odd-sized tail op.
    let ext = pool.alloc(FRAG * FRAGS).map_err(|e| e.to_string())?;
    let mut ops: Vec<CopyOp> = (0..FRAGS)
        .map(|i| CopyOp {
            buffer: dev,
            device_offset: i * FRAG,
            extent: 0,
            host_offset: (FRAGS - 1 - i) * FRAG,
            len: FRAG,
        })
        .collect();
    ops[3].len = FRAG - 7; // unaligned length
    let done = gpu.submit(CopyBatch::new(Direction::DeviceToHost, ops.clone(), vec![HostBuf::Writable(ext)])).await;
    done.result.map_err(|e| format!("save batch failed: {e}"))?;
    let Some(HostBuf::Writable(ext)) = done.host.into_iter().next() else { return Err("buffer not returned".into()) };
    for op in &ops {
        let h = &ext.as_slice()[op.host_offset as usize..(op.host_offset + op.len) as usize];
        let d = &pattern[op.device_offset as usize..(op.device_offset + op.len) as usize];
        if h != d {
            return Err(format!("device->host fragment at {} differs", op.device_offset));
        }
    }
    // Load: copy the extent back into the second half of the device buffer, same shuffle.
    let sealed = ext.seal();
    let back: Vec<CopyOp> =
        ops.iter().map(|op| CopyOp { device_offset: op.device_offset + FRAG * FRAGS, ..*op }).collect();
    let done = gpu.submit(CopyBatch::new(Direction::HostToDevice, back, vec![HostBuf::Sealed(sealed)])).await;
    done.result.map_err(|e| format!("load batch failed: {e}"))?;
    if done.host.len() != 1 {
        return Err("load did not return its buffer".into());
    }
    let mut out = vec![0u8; (FRAG * FRAGS) as usize];
    gpu.read(dev, FRAG * FRAGS, &mut out).map_err(|e| e.to_string())?;
    for op in &ops {
        let a = &out[op.device_offset as usize..(op.device_offset + op.len) as usize];
        let b = &pattern[op.device_offset as usize..(op.device_offset + op.len) as usize];
        if a != b {
            return Err(format!("host->device fragment at {} differs", op.device_offset));
        }
    }
    // Checksummed save: slots of mixed sizes, ops in host order but cut at
    // points that are not slot boundaries, scattered on the device.
    let len = FRAG * FRAGS;
    let ext = pool.alloc(len).map_err(|e| e.to_string())?;
    let cuts = [0, 100_003, 777_777, len];
    let ops: Vec<CopyOp> = cuts
        .windows(2)
        .enumerate()
        .map(|(i, w)| CopyOp {
            buffer: dev,
            device_offset: (i as u64 * 300_001) % (len - (w[1] - w[0])),
            extent: 0,
            host_offset: w[0],
            len: w[1] - w[0],
        })
        .collect();
    let bounds = [0, 65_536, 135_536, 135_543, 1_000_000, len];
    let checksums: Vec<ChecksumRange> =
        bounds.windows(2).map(|w| ChecksumRange { extent: 0, offset: w[0], len: w[1] - w[0] }).collect();
    let mut batch = CopyBatch::new(Direction::DeviceToHost, ops.clone(), vec![HostBuf::Writable(ext)]);
    batch.checksums = checksums.clone();
    let done = gpu.submit(batch).await;
    done.result.map_err(|e| format!("checksummed save failed: {e}"))?;
    let Some(HostBuf::Writable(ext)) = done.host.first() else { return Err("buffer not returned".into()) };
    let want: Vec<u32> = checksums
        .iter()
        .map(|r| crc32c::crc32c(&ext.as_slice()[r.offset as usize..(r.offset + r.len) as usize]))
        .collect();
    match done.checksums {
        Some(got) if got != want => return Err(format!("device checksums {got:08x?} != {want:08x?}")),
        None if gpu.checksums_on_device() => return Err("backend promised device checksums, gave none".into()),
        _ => {}
    }
    // And back (large and odd-sized ops both ways) into the upper half.
    let Some(HostBuf::Writable(ext)) = done.host.into_iter().next() else { return Err("buffer not returned".into()) };
    let sealed = ext.seal();
    let back: Vec<CopyOp> = ops.iter().map(|op| CopyOp { device_offset: op.device_offset + len, ..*op }).collect();
    let done = gpu.submit(CopyBatch::new(Direction::HostToDevice, back.clone(), vec![HostBuf::Sealed(sealed)])).await;
    done.result.map_err(|e| format!("large load batch failed: {e}"))?;
    let Some(HostBuf::Sealed(sealed)) = done.host.first() else { return Err("buffer not returned".into()) };
    for op in &back {
        let mut out = vec![0u8; op.len as usize];
        gpu.read(dev, op.device_offset, &mut out).map_err(|e| e.to_string())?;
        if out[..] != sealed.as_slice()[op.host_offset as usize..(op.host_offset + op.len) as usize] {
            return Err(format!("host->device op of {} bytes at {} differs", op.len, op.device_offset));
        }
    }
    drop(done.host);
    // Bad batches: an error, and the buffers still come back.
    let ext = pool.alloc(FRAG).map_err(|e| e.to_string())?;
    let bad = CopyOp { buffer: dev, device_offset: 2 * FRAG * FRAGS - 1, extent: 0, host_offset: 0, len: 2 };
    let done = gpu.submit(CopyBatch::new(Direction::DeviceToHost, vec![bad], vec![HostBuf::Writable(ext)])).await;
    if !matches!(done.result, Err(GpuError::OutOfRange(_))) || done.host.len() != 1 {
        return Err(format!("out-of-range op not rejected cleanly: {:?}", done.result));
    }
    let unknown = CopyOp { buffer: DeviceBufferId(u32::MAX), device_offset: 0, extent: 0, host_offset: 0, len: 1 };
    let unknown_dev = CopyOp { buffer: dev, ..unknown };
    let done = gpu.submit(CopyBatch::new(Direction::DeviceToHost, vec![unknown], done.host)).await;
    if !matches!(done.result, Err(GpuError::UnknownBuffer(_))) || done.host.len() != 1 {
        return Err(format!("unknown buffer not rejected cleanly: {:?}", done.result));
    }
    let len = gpu.buffer_len(dev).unwrap_or_default();
    if gpu.write(dev, len, &[1]).is_ok() {
        return Err("write past the end accepted".into());
    }
    // Unregister: once, then the id names nothing.
    gpu.unregister(dev).map_err(|e| format!("unregister: {e}"))?;
    if gpu.buffer_len(dev).is_some() || !matches!(gpu.unregister(dev), Err(GpuError::Buffer(BufferError::Unknown(_)))) {
        return Err("a buffer unregistered twice, or still known".into());
    }
    let done = gpu.submit(CopyBatch::new(Direction::DeviceToHost, vec![unknown_dev], done.host)).await;
    if !matches!(done.result, Err(GpuError::UnknownBuffer(_))) {
        return Err(format!("a batch naming an unregistered buffer ran: {:?}", done.result));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{
        CONFORMANCE_BUFFER_BYTES, Gpu, GpuError, RangeGroup, group_by_allocation, group_ranges, host::HostGpu,
    };

    /// A made-up allocator: allocations `[start, start + len)`.
    fn allocator(allocs: &[(u64, u64)]) -> impl FnMut(u64) -> Result<Option<(u64, u64)>, GpuError> + '_ {
        |addr| Ok(allocs.iter().copied().find(|&(s, l)| s <= addr && addr < s + l))
    }

    fn group(start: u64, len: u64, members: &[usize]) -> RangeGroup {
        RangeGroup { start, len, members: members.to_vec() }
    }

    /// Issue 30: per-layer tensors a caching allocator placed back to back
    /// (separate allocations) stay separate buffers; the old rule merged
    /// every touching range into one buffer, which `cuda` refuses.
    #[test]
    fn touching_separate_allocations_stay_separate() {
        let mb = 1 << 20;
        // K0, V0, K1, V1 of 64 MiB each, back to back, each its own allocation.
        let allocs: Vec<(u64, u64)> = (0..4).map(|i| (0x1000_0000 + i * 64 * mb, 64 * mb)).collect();
        let groups = group_ranges(&allocs, allocator(&allocs)).unwrap();
        let want: Vec<RangeGroup> = allocs.iter().enumerate().map(|(i, &(s, l))| group(s, l, &[i])).collect();
        assert_eq!(groups, want);
    }

    #[test]
    fn touching_ranges_of_one_allocation_share_a_buffer() {
        // K and V halves of one [2, num_blocks, ...] tensor, given V first.
        let allocs = [(0x4000, 0x2000)];
        let ranges = [(0x5000, 0x1000), (0x4000, 0x1000)];
        assert_eq!(group_ranges(&ranges, allocator(&allocs)).unwrap(), vec![group(0x4000, 0x2000, &[1, 0])]);
    }

    #[test]
    fn unknown_allocations_merge_only_overlaps() {
        let unknown = |_| Ok(None);
        // K and V strided views of one [num_blocks, 2, ...] tensor overlap;
        // a third range touches their union; a fourth lies apart.
        let ranges = [(0x1000, 0x300), (0x1100, 0x300), (0x1400, 0x100), (0x2000, 0x10)];
        let groups = group_ranges(&ranges, unknown).unwrap();
        assert_eq!(groups, vec![group(0x1000, 0x400, &[0, 1]), group(0x1400, 0x100, &[2]), group(0x2000, 0x10, &[3])]);
        // The host backend cannot tell, so it takes the same rule.
        assert_eq!(group_by_allocation(&HostGpu::new(), &ranges).unwrap(), groups);
    }

    #[test]
    fn a_range_past_the_address_space_is_refused() {
        let r = group_ranges(&[(u64::MAX - 1, 4)], |_| Ok(None));
        assert!(matches!(r, Err(GpuError::OutOfRange(_))), "{r:?}");
    }

    /// On memory the test allocated and registered (the embedder's).
    #[tokio::test]
    async fn host_backend_conforms_on_external_memory() {
        let gpu = HostGpu::new();
        let mut mem = vec![0u128; (CONFORMANCE_BUFFER_BYTES / 16) as usize];
        // SAFETY: `mem` outlives the registration (the body unregisters it).
        let dev = unsafe { gpu.register_external(mem.as_mut_ptr() as u64, CONFORMANCE_BUFFER_BYTES) }.unwrap();
        super::conformance(&gpu, dev).await.expect("host backend conformance");
        drop(mem);
    }

    /// On a buffer the backend allocated itself (the same table entry,
    /// marked owned).
    #[tokio::test]
    async fn host_backend_conforms_on_owned_memory() {
        let gpu = HostGpu::new();
        let dev = gpu.alloc(CONFORMANCE_BUFFER_BYTES).unwrap();
        super::conformance(&gpu, dev).await.expect("host backend conformance");
    }

    /// The conformance body's checksum check with a backend that answers it
    /// (the path the CUDA backend takes, modelled on the CPU).
    #[tokio::test]
    async fn host_backend_with_device_checksums_conforms() {
        let gpu = HostGpu::with_device_checksums();
        let dev = gpu.alloc(CONFORMANCE_BUFFER_BYTES).unwrap();
        super::conformance(&gpu, dev).await.expect("host backend conformance with device checksums");
    }
}
