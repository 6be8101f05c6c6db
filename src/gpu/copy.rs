//! The copy vocabulary every backend speaks: directions, ops, batches of
//! them with their host side, completions, and the errors a copy or a
//! registration answers. Re-exported by [`crate::gpu`], whose [`Gpu`] trait
//! takes and returns these.
//!
//! [`Gpu`]: crate::gpu::Gpu

use std::future::Future;
use std::pin::Pin;

use super::crc::ChecksumRange;
use crate::memory::DeviceBufferId;
use crate::memory::buffers::BufferError;
use crate::memory::pool::Extent;

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
    Sealed(crate::memory::pool::SealedExtent),
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
    /// that does not checksum ignores it.
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
    /// order, when the backend computed them from the bytes it moved (so
    /// the caller need not read the destination again); `None` otherwise, and
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
    /// A buffer registration or unregistration was refused (the message
    /// carries the addresses and lengths).
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Memory handed to [`Gpu::register_external`] is not device memory of
    /// this backend's device inside one allocation.
    #[error(transparent)]
    External(#[from] ExternalMemoryError),
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
    /// The backend cannot do this (e.g. device-direct peer copies on a
    /// backend without them, or a handle kind it does not open).
    #[error("not supported by this gpu backend: {0}")]
    Unsupported(String),
    /// A peer's exported buffer cannot be opened or read (malformed,
    /// another host's or process's handle, revoked, its owner gone).
    #[error("peer buffer: {0}")]
    Peer(String),
}

impl GpuError {
    /// The stable code of this error (`docs/design.md`, "Errors"); a
    /// wrapped buffer or external-memory error answers its own code.
    pub fn code(&self) -> &'static str {
        match self {
            GpuError::UnknownBuffer(_) => "gpu_unknown_buffer",
            GpuError::OutOfRange(_) => "gpu_out_of_range",
            GpuError::WrongHostKind(_) => "gpu_wrong_host_kind",
            GpuError::Buffer(e) => e.code(),
            GpuError::External(e) => e.code(),
            GpuError::Alloc { .. } => "gpu_alloc",
            GpuError::Unavailable(_) => "gpu_unavailable",
            GpuError::Device(_) => "gpu_device",
            GpuError::Unsupported(_) => "gpu_unsupported",
            GpuError::Peer(_) => "gpu_peer",
        }
    }
}

/// Why the `cuda` backend refused an external range (checked with the
/// driver's pointer attributes before anything is registered).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExternalMemoryError {
    /// The address is not device memory (a host pointer, or unknown to the
    /// driver).
    #[error("{addr:#x} is not device memory ({memory_type})")]
    NotDeviceMemory {
        /// Address given.
        addr: u64,
        /// What the driver says it is.
        memory_type: String,
    },
    /// Device memory of another device.
    #[error("{addr:#x} is memory of device {device}, this backend runs on device {backend_device}")]
    OtherDevice {
        /// Address given.
        addr: u64,
        /// Its device ordinal.
        device: i64,
        /// The backend's device ordinal.
        backend_device: usize,
    },
    /// `[addr, addr + len)` runs past the allocation that holds `addr`.
    #[error(
        "[{addr:#x}, +{len}) overruns its allocation [{allocation_start:#x}, +{allocation_len}) by {} bytes",
        addr + len - allocation_start - allocation_len
    )]
    OutsideAllocation {
        /// Address given.
        addr: u64,
        /// Length given.
        len: u64,
        /// Start of the allocation holding `addr`.
        allocation_start: u64,
        /// Its length.
        allocation_len: u64,
    },
    /// The driver could not answer for the address.
    #[error("pointer attributes of {addr:#x}: {reason}")]
    Query {
        /// Address given.
        addr: u64,
        /// Driver error.
        reason: String,
    },
}

impl ExternalMemoryError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            ExternalMemoryError::NotDeviceMemory { .. } => "gpu_external_not_device_memory",
            ExternalMemoryError::OtherDevice { .. } => "gpu_external_other_device",
            ExternalMemoryError::OutsideAllocation { .. } => "gpu_external_outside_allocation",
            ExternalMemoryError::Query { .. } => "gpu_external_query",
        }
    }
}
