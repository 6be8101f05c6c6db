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
//! - Device buffers are allocated once (at layout registration) and live as
//!   long as the backend.
//!
//! Backends: [`host`] (embedded default: the "device" is host memory; also
//! the simulator's GPU) and `cuda` (feature `cuda`, H200 runs).

pub mod crc;
#[cfg(all(feature = "cuda", not(madsim)))]
pub mod cuda;
pub mod host;

pub use crc::ChecksumRange;

use std::future::Future;
use std::pin::Pin;

use crate::engine::layout::DeviceBufferId;
use crate::engine::pool::Extent;

/// Copy direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Device → pinned pool (save).
    DeviceToHost,
    /// Pinned pool → device (load).
    HostToDevice,
}

/// One contiguous copy of `len` bytes between a device buffer and one of the
/// batch's host extents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    /// Device buffer.
    pub buffer: DeviceBufferId,
    /// Byte offset in the device buffer.
    pub device_offset: u64,
    /// Index of the host extent in the batch's extent list.
    pub extent: usize,
    /// Byte offset inside that extent.
    pub host_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// Host memory a batch reads from or writes into.
pub enum HostBuf {
    /// A writable (unsealed) extent: destination of a save.
    Writable(Extent),
    /// A sealed extent: source of a load (held as a lease for the copy).
    Sealed(crate::engine::pool::SealedExtent),
}

impl HostBuf {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            HostBuf::Writable(e) => e.len(),
            HostBuf::Sealed(e) => e.len(),
        }
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A batch of copies in one direction.
pub struct CopyBatch {
    /// Direction of every op.
    pub direction: Direction,
    /// The copies.
    pub ops: Vec<CopyOp>,
    /// Host buffers, referenced by `CopyOp::extent`.
    pub host: Vec<HostBuf>,
    /// Host ranges (of a save's destinations) whose standard CRC-32C the
    /// backend may compute from the bytes it moves, returned in
    /// [`Completed::checksums`] in this order. Empty for loads. A backend
    /// that does not checksum (the host backend) ignores it.
    pub checksums: Vec<ChecksumRange>,
}

impl CopyBatch {
    /// A batch with no checksum ranges.
    pub fn new(direction: Direction, ops: Vec<CopyOp>, host: Vec<HostBuf>) -> Self {
        Self { direction, ops, host, checksums: Vec::new() }
    }
}

/// What a completion returns: the host buffers (always) and the outcome.
pub struct Completed {
    /// Every host buffer of the batch, in order.
    pub host: Vec<HostBuf>,
    /// `Ok` when every copy landed.
    pub result: Result<(), GpuError>,
    /// CRC-32C of each of the batch's [`CopyBatch::checksums`] ranges, in
    /// order, when the backend computed them from the source bytes (so the
    /// caller need not read the destination again); `None` otherwise, and
    /// always `None` when `result` is an error.
    pub checksums: Option<Vec<u32>>,
}

/// A pending batch.
pub type Completion = Pin<Box<dyn Future<Output = Completed> + Send>>;

/// GPU errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// A copy names a buffer that does not exist.
    #[error("unknown device buffer {0:?}")]
    UnknownBuffer(DeviceBufferId),
    /// A copy range falls outside its device buffer or host extent.
    #[error("copy out of range: {0}")]
    OutOfRange(String),
    /// A save targets a sealed extent or a load sources a writable one.
    #[error("host buffer of the wrong kind for a {0:?} copy")]
    WrongHostKind(Direction),
    /// Device memory could not be allocated.
    #[error("device allocation of {bytes} bytes failed: {reason}")]
    Alloc {
        /// Requested bytes.
        bytes: u64,
        /// Backend message.
        reason: String,
    },
    /// No usable device / driver (startup).
    #[error("gpu unavailable: {0}")]
    Unavailable(String),
    /// The backend reported a failure while copying.
    #[error("device copy failed: {0}")]
    Device(String),
}

/// The GPU backend trait. See the module doc for the failure contract.
pub trait Gpu: Send + Sync + 'static {
    /// Backend name (`host`, `cuda`).
    fn name(&self) -> &'static str;

    /// Allocates a zeroed device buffer of `bytes`.
    ///
    /// # Errors
    /// [`GpuError::Alloc`].
    fn alloc(&self, bytes: u64) -> Result<DeviceBufferId, GpuError>;

    /// Length of a buffer in bytes, `None` if unknown.
    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64>;

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

/// The conformance body every backend must pass (run against `host` in
/// `cargo test`, against `cuda` by `kvferry bench gpu` on the H200): scattered
/// device→host and host→device copies land byte for byte, buffers come back
/// with their completion on success and on error, bad batches are errors.
///
/// # Errors
/// The first violated expectation, as text.
pub async fn conformance(gpu: &dyn Gpu) -> Result<(), String> {
    use crate::engine::pool::Pool;
    const FRAG: u64 = 32 << 10;
    const FRAGS: u64 = 64;
    let pool = Pool::new(4 * FRAG * FRAGS, 256).map_err(|e| e.to_string())?;
    gpu.register_host(pool.base_ptr(), pool.arena_len()).map_err(|e| e.to_string())?;
    let dev = gpu.alloc(2 * FRAG * FRAGS).map_err(|e| e.to_string())?;
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
    let done = gpu.submit(CopyBatch::new(Direction::DeviceToHost, vec![unknown], done.host)).await;
    if !matches!(done.result, Err(GpuError::UnknownBuffer(_))) || done.host.len() != 1 {
        return Err(format!("unknown buffer not rejected cleanly: {:?}", done.result));
    }
    if gpu.write(dev, 2 * FRAG * FRAGS, &[1]).is_ok() {
        return Err("write past the end accepted".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn host_backend_conforms() {
        let gpu = super::host::HostGpu::new();
        super::conformance(&gpu).await.expect("host backend conformance");
    }

    /// The conformance body's checksum check with a backend that answers it
    /// (the path the CUDA backend takes, modelled on the CPU).
    #[tokio::test]
    async fn host_backend_with_device_checksums_conforms() {
        let gpu = super::host::HostGpu::with_device_checksums();
        super::conformance(&gpu).await.expect("host backend conformance with device checksums");
    }
}
