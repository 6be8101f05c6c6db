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

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    BatchPin, BufferTable, Completed, Completion, CopyBatch, Direction, Gpu, GpuError, HostBuf, HostMemory, KvMemory,
    checked_range, crc, pin_and_validate,
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

    /// Runs a batch; returns the pin so device-side checksums can read the
    /// same buffers before it is released.
    fn run(&self, batch: &mut CopyBatch) -> Result<BatchPin, GpuError> {
        let pin = pin_and_validate(&self.buffers, batch)?;
        let passing = self.pass_first.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if !passing && self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(GpuError::Device("injected failure".into()));
        }
        for op in &batch.ops {
            let (addr, _) = pin.get(op.buffer).ok_or(GpuError::UnknownBuffer(op.buffer))?;
            let (h0, n) = (op.host_offset as usize, op.len as usize);
            let dev = (addr + op.device_offset) as *mut u8;
            match (batch.direction, &mut batch.host[op.extent]) {
                (Direction::DeviceToHost, HostBuf::Writable(ext)) => {
                    // SAFETY: `validate_batch` proved both ranges in bounds;
                    // the buffer is pinned (cannot be unregistered) and the
                    // embedder keeps registered memory valid (C15).
                    unsafe { std::ptr::copy_nonoverlapping(dev, ext.as_mut_slice()[h0..h0 + n].as_mut_ptr(), n) };
                }
                (Direction::HostToDevice, HostBuf::Sealed(ext)) => {
                    // SAFETY: as above.
                    unsafe { std::ptr::copy_nonoverlapping(ext.as_slice()[h0..h0 + n].as_ptr(), dev, n) };
                }
                _ => return Err(GpuError::WrongHostKind(batch.direction)),
            }
        }
        Ok(pin)
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

impl Gpu for HostGpu {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, GpuError> {
        Ok(self.buffers.register(addr, len, false)?)
    }

    fn unregister(&self, id: DeviceBufferId) -> Result<(), GpuError> {
        let entry = self.buffers.unregister(id)?;
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
            Ok(pin) => {
                let device_side = self.device_checksums && batch.direction == Direction::DeviceToHost;
                let sums = if device_side && !batch.checksums.is_empty() {
                    Self::device_side_checksums(&batch, &pin)
                } else {
                    None
                };
                (Ok(()), sums)
            }
            Err(e) => (Err(e), None),
        };
        Box::pin(std::future::ready(Completed { host: batch.host, result, checksums }))
    }

    fn checksums_on_device(&self) -> bool {
        self.device_checksums
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
