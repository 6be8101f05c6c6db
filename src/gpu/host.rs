//! The `host` GPU backend: device KV buffers are plain host memory and a
//! "copy" is a `memcpy`. It is the embedded default (no GPU needed) and the
//! simulator's GPU.
//!
//! What it models: batched scattered copies with a completion, buffers
//! handed back by the completion, whole-batch failure. What it does not:
//! asynchrony (copies run inside `submit`, so the completion is ready at
//! once), PCIe bandwidth, device memory limits. Failure injection: a test can
//! make the next N batches fail ([`HostGpu::fail_next_batches`]). A test can
//! also have it checksum saves the way the CUDA backend does
//! ([`HostGpu::with_device_checksums`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::{Completed, Completion, CopyBatch, Direction, Gpu, GpuError, HostBuf, checked_range, crc, validate_batch};
use crate::engine::layout::DeviceBufferId;

/// Host-memory "device".
#[derive(Default)]
pub struct HostGpu {
    buffers: RwLock<Vec<Arc<RwLock<Vec<u8>>>>>,
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

    fn buffer(&self, id: DeviceBufferId) -> Option<Arc<RwLock<Vec<u8>>>> {
        self.buffers.read().expect("buffers lock").get(id.0 as usize).cloned()
    }

    /// Checksums of a save's ranges from the device bytes (see
    /// [`HostGpu::with_device_checksums`]); `None` when not tiled in order.
    fn device_side_checksums(&self, batch: &CopyBatch) -> Option<Vec<u32>> {
        let index = crc::RangeIndex::new(&batch.checksums, batch.host.len())?;
        let tables = crc::kernel_tables();
        let mut folder = crc::RangeFolder::new(&batch.checksums);
        for op in &batch.ops {
            let buf = self.buffer(op.buffer)?;
            let dev = buf.read().expect("device buffer lock");
            crc::checksum_pieces(&index, op.extent, op.host_offset, op.len, |r, in_range, off, n| {
                let at = (op.device_offset + off) as usize;
                folder.add(r, in_range, n, crc::piece_raw_model(&tables, &dev[at..at + n as usize]));
            });
        }
        folder.finish()
    }

    fn run(&self, batch: &mut CopyBatch) -> Result<(), GpuError> {
        validate_batch(batch, |id| self.buffer_len(id))?;
        let passing = self.pass_first.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if !passing && self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(GpuError::Device("injected failure".into()));
        }
        for op in &batch.ops {
            let buf = self.buffer(op.buffer).ok_or(GpuError::UnknownBuffer(op.buffer))?;
            let (d0, h0, n) = (op.device_offset as usize, op.host_offset as usize, op.len as usize);
            match (batch.direction, &mut batch.host[op.extent]) {
                (Direction::DeviceToHost, HostBuf::Writable(ext)) => {
                    let dev = buf.read().expect("device buffer lock");
                    ext.as_mut_slice()[h0..h0 + n].copy_from_slice(&dev[d0..d0 + n]);
                }
                (Direction::HostToDevice, HostBuf::Sealed(ext)) => {
                    let mut dev = buf.write().expect("device buffer lock");
                    dev[d0..d0 + n].copy_from_slice(&ext.as_slice()[h0..h0 + n]);
                }
                _ => return Err(GpuError::WrongHostKind(batch.direction)),
            }
        }
        Ok(())
    }
}

impl Gpu for HostGpu {
    fn name(&self) -> &'static str {
        "host"
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBufferId, GpuError> {
        let len = usize::try_from(bytes)
            .map_err(|_| GpuError::Alloc { bytes, reason: "larger than the address space".into() })?;
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|e| GpuError::Alloc { bytes, reason: e.to_string() })?;
        v.resize(len, 0);
        let mut bufs = self.buffers.write().expect("buffers lock");
        let id = DeviceBufferId(
            u32::try_from(bufs.len()).map_err(|_| GpuError::Alloc { bytes, reason: "too many buffers".into() })?,
        );
        bufs.push(Arc::new(RwLock::new(v)));
        Ok(id)
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.buffer(id).map(|b| b.read().expect("device buffer lock").len() as u64)
    }

    fn submit(&self, mut batch: CopyBatch) -> Completion {
        let result = self.run(&mut batch);
        let device_side = self.device_checksums && result.is_ok() && batch.direction == Direction::DeviceToHost;
        let checksums =
            if device_side && !batch.checksums.is_empty() { self.device_side_checksums(&batch) } else { None };
        Box::pin(std::future::ready(Completed { host: batch.host, result, checksums }))
    }

    fn checksums_on_device(&self) -> bool {
        self.device_checksums
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        let buf = self.buffer(id).ok_or(GpuError::UnknownBuffer(id))?;
        let mut dev = buf.write().expect("device buffer lock");
        let range = checked_range(offset, data.len() as u64, dev.len() as u64)?;
        dev[range].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let buf = self.buffer(id).ok_or(GpuError::UnknownBuffer(id))?;
        let dev = buf.read().expect("device buffer lock");
        let range = checked_range(offset, out.len() as u64, dev.len() as u64)?;
        out.copy_from_slice(&dev[range]);
        Ok(())
    }
}
