//! The `host` GPU backend: device KV buffers are plain host memory and a
//! "copy" is a `memcpy`. It is the embedded default (no GPU needed) and the
//! simulator's GPU.
//!
//! What it models: batched scattered copies with a completion, buffers
//! handed back by the completion, whole-batch failure. What it does not:
//! asynchrony (copies run inside `submit`, so the completion is ready at
//! once), PCIe bandwidth, device memory limits. Failure injection: a test can
//! make the next N batches fail ([`HostGpu::fail_next_batches`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::{Completed, Completion, CopyBatch, Direction, Gpu, GpuError, HostBuf, checked_range, validate_batch};
use crate::engine::layout::DeviceBufferId;

/// Host-memory "device".
#[derive(Default)]
pub struct HostGpu {
    buffers: RwLock<Vec<Arc<RwLock<Vec<u8>>>>>,
    fail_next: AtomicU64,
}

impl HostGpu {
    /// A backend with no buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `n` submitted batches fail with [`GpuError::Device`]
    /// (their host buffers still come back).
    pub fn fail_next_batches(&self, n: u64) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    fn buffer(&self, id: DeviceBufferId) -> Option<Arc<RwLock<Vec<u8>>>> {
        self.buffers.read().expect("buffers lock").get(id.0 as usize).cloned()
    }

    fn run(&self, batch: &mut CopyBatch) -> Result<(), GpuError> {
        validate_batch(batch, |id| self.buffer_len(id))?;
        if self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
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
        Box::pin(std::future::ready(Completed { host: batch.host, result }))
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
