//! INTERIM (until issue 15 lands on main): a `host` GPU backend over memory
//! the caller owns (numpy arrays, bytearrays), registered by address.
//!
//! kvferry's own `HostGpu` gains `register_external` with issue 15; then
//! [`crate::adapter`] switches to it and this file goes. Until then this
//! backend lets the package save from and load into the caller's arrays
//! today.
//!
//! What it models: batched copies between caller memory and the pinned pool,
//! validated against registered lengths before anything is touched. What it
//! does not: device memory (the "device" is host memory), asynchrony.
//!
//! Safety contract: whoever registers `[addr, addr + len)` keeps that memory
//! alive and unmoved until it is unregistered (the Python `Node` holds a
//! reference to every registered array for that reason).

use std::sync::RwLock;

use kvferry::engine::layout::DeviceBufferId;
use kvferry::gpu::{
    Completed, Completion, CopyBatch, Direction, Gpu, GpuError, HostBuf, checked_range, validate_batch,
};

/// Caller-owned host memory by address.
#[derive(Default)]
pub struct ExternalHostGpu {
    /// Index = buffer id; `None` once unregistered (ids are never reused).
    buffers: RwLock<Vec<Option<(u64, u64)>>>,
}

impl ExternalHostGpu {
    /// A backend with no buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    /// The range must stay valid, writable host memory until
    /// [`ExternalHostGpu::unregister`].
    pub unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, GpuError> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(GpuError::OutOfRange(format!("external range [{addr:#x}, +{len}) is empty or wraps")));
        }
        let mut bufs = self.buffers.write().expect("buffers lock");
        let id =
            u32::try_from(bufs.len()).map_err(|_| GpuError::Alloc { bytes: len, reason: "too many buffers".into() })?;
        bufs.push(Some((addr, len)));
        Ok(DeviceBufferId(id))
    }

    /// Forgets a buffer (the caller made sure no layout names it).
    pub fn unregister(&self, id: DeviceBufferId) -> Result<(), GpuError> {
        let mut bufs = self.buffers.write().expect("buffers lock");
        match bufs.get_mut(id.0 as usize) {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(GpuError::UnknownBuffer(id)),
        }
    }

    fn range(&self, id: DeviceBufferId) -> Option<(u64, u64)> {
        self.buffers.read().expect("buffers lock").get(id.0 as usize).copied().flatten()
    }

    fn run(&self, batch: &mut CopyBatch) -> Result<(), GpuError> {
        validate_batch(batch, |id| self.buffer_len(id))?;
        for op in &batch.ops {
            let (addr, _) = self.range(op.buffer).ok_or(GpuError::UnknownBuffer(op.buffer))?;
            let dev = (addr + op.device_offset) as *mut u8;
            let (h0, n) = (op.host_offset as usize, op.len as usize);
            match (batch.direction, &mut batch.host[op.extent]) {
                (Direction::DeviceToHost, HostBuf::Writable(ext)) => {
                    // SAFETY: validated in range of a registered buffer the
                    // caller keeps alive (see the module doc).
                    let src = unsafe { std::slice::from_raw_parts(dev as *const u8, n) };
                    ext.as_mut_slice()[h0..h0 + n].copy_from_slice(src);
                }
                (Direction::HostToDevice, HostBuf::Sealed(ext)) => {
                    // SAFETY: as above.
                    let dst = unsafe { std::slice::from_raw_parts_mut(dev, n) };
                    dst.copy_from_slice(&ext.as_slice()[h0..h0 + n]);
                }
                _ => return Err(GpuError::WrongHostKind(batch.direction)),
            }
        }
        Ok(())
    }
}

impl Gpu for ExternalHostGpu {
    fn name(&self) -> &'static str {
        "host"
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBufferId, GpuError> {
        Err(GpuError::Alloc { bytes, reason: "this backend only registers caller memory".into() })
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.range(id).map(|(_, len)| len)
    }

    fn submit(&self, mut batch: CopyBatch) -> Completion {
        let result = self.run(&mut batch);
        Box::pin(std::future::ready(Completed { host: batch.host, result, checksums: None }))
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        let (addr, len) = self.range(id).ok_or(GpuError::UnknownBuffer(id))?;
        let r = checked_range(offset, data.len() as u64, len)?;
        // SAFETY: in range of a registered buffer (module doc).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (addr as usize + r.start) as *mut u8, data.len()) };
        Ok(())
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let (addr, len) = self.range(id).ok_or(GpuError::UnknownBuffer(id))?;
        let r = checked_range(offset, out.len() as u64, len)?;
        // SAFETY: in range of a registered buffer (module doc).
        unsafe { std::ptr::copy_nonoverlapping((addr as usize + r.start) as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}
