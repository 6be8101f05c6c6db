//! The door to the disk: submit reads and writes of owned, aligned buffers
//! at an offset; completions hand the buffers back ([`DiskIo`]).
//!
//! The trait is shaped like io_uring (Axboe, "Efficient IO with io_uring",
//! 2019): a submission carries a caller-chosen 64-bit tag, a completion
//! carries the same tag and the operation's result, and completions may
//! arrive in any order. Unlike a raw ring, the buffer travels *inside* the
//! operation and comes back inside its completion, so a buffer the kernel
//! may still touch is never reachable (or freeable) by the caller.
//!
//! A completion's `result` is the byte count the kernel reported, which
//! may be *short* (less than the buffer's length): the backend passes it up
//! unchanged and never retries or pads, so the tier above sees every short
//! read or write and treats it as a failure of that operation.
//!
//! Backends: [`super::uring`] (io_uring + `O_DIRECT`),
//! [`super::pio`] (`pread`/`pwrite` + `O_DIRECT` on blocking threads, when
//! io_uring is refused), [`super::sim`] (in memory, seeded faults, the
//! simulator's and the unit tests').

use std::sync::Arc;

use super::buf::AlignedBuf;

/// A completion hint ([`DiskIo::set_completion_hint`]): called, from any
/// thread, after operations completed, so whoever drives the backend reaps
/// them now instead of at its next timed poll. A hint may be spurious or
/// cover several completions; it carries no data.
pub type CompletionHint = Arc<dyn Fn() + Send + Sync>;

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoKind {
    /// Device → buffer.
    Read,
    /// Buffer → device.
    Write,
}

/// One operation: move `buf.len()` bytes between `buf` and the file at
/// `offset` (bytes; a multiple of
/// [`DISK_ALIGN_BYTES`](crate::limits::DISK_ALIGN_BYTES)).
#[derive(Debug)]
pub struct IoOp {
    /// Caller-chosen id, returned in the completion.
    pub tag: u64,
    /// Read or write.
    pub kind: IoKind,
    /// File offset (bytes, aligned).
    pub offset: u64,
    /// The buffer, owned by the backend until the completion.
    pub buf: AlignedBuf,
}

/// An OS error number (`errno`), e.g. [`EIO`] or [`ENOSPC`]; displayed
/// with the OS's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

/// `EIO` (Linux): an I/O error from the device.
pub const EIO: Errno = Errno(5);
/// `ENOSPC` (Linux): no space left on the device.
pub const ENOSPC: Errno = Errno(28);
/// `EINVAL` (Linux): e.g. an unaligned `O_DIRECT` transfer.
pub const EINVAL: Errno = Errno(22);

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (errno {})", std::io::Error::from_raw_os_error(self.0), self.0)
    }
}

impl std::error::Error for Errno {}

/// A finished operation: its tag, what it was, and the buffer back.
#[derive(Debug)]
pub struct Completion {
    /// The tag of the operation (as submitted; a misbehaving backend may
    /// report one that was never submitted, or twice).
    pub tag: u64,
    /// Read or write.
    pub kind: IoKind,
    /// File offset of the operation (bytes).
    pub offset: u64,
    /// The buffer handed back. For a read, bytes past a short count hold
    /// no meaning.
    pub buf: AlignedBuf,
    /// Bytes moved (possibly fewer than `buf.len()`: a short transfer), or
    /// the OS error.
    pub result: Result<usize, Errno>,
}

/// Which backend runs: what `bench ssd` and the node's log report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// io_uring with `O_DIRECT` ([`super::uring`]).
    IoUring,
    /// `pread`/`pwrite` with `O_DIRECT` on blocking threads
    /// ([`super::pio`]).
    Pio,
    /// In memory with seeded faults ([`super::sim`]).
    Sim,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::IoUring => "io_uring + O_DIRECT",
            BackendKind::Pio => "pread/pwrite + O_DIRECT (threads)",
            BackendKind::Sim => "simulated",
        })
    }
}

/// Why a submission was refused; the operation (and its buffer) comes
/// back with it ([`Refused`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The offset is not a multiple of the alignment.
    #[error("offset {offset} is not a multiple of {align} B")]
    Unaligned {
        /// The operation's offset (bytes).
        offset: u64,
        /// The alignment (bytes).
        align: u64,
    },
    /// `[offset, offset + len)` does not lie within the file.
    #[error("range {offset}+{len} B lies beyond the file's {capacity} B")]
    OutOfRange {
        /// The operation's offset (bytes).
        offset: u64,
        /// Its length (bytes).
        len: u64,
        /// The file's size (bytes).
        capacity: u64,
    },
    /// As many operations as the backend's queue depth are in flight.
    #[error("{depth} operations already in flight (the queue depth)")]
    QueueFull {
        /// The backend's queue depth (count).
        depth: usize,
    },
    /// The backend cannot take operations any more (its ring or its
    /// threads failed).
    #[error("the disk backend failed: {0}")]
    Broken(Errno),
}

/// A refused submission: the error and the operation, buffer included.
#[derive(Debug)]
pub struct Refused {
    /// Why.
    pub error: SubmitError,
    /// The operation, handed back untouched.
    pub op: IoOp,
}

/// The disk door. Every method is non-blocking except
/// [`reap`](DiskIo::reap) with `wait = true` and
/// [`reap_within`](DiskIo::reap_within).
pub trait DiskIo: Send {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Usable file size (bytes, a multiple of the alignment); every
    /// operation lies within `[0, capacity)`.
    fn capacity(&self) -> u64;

    /// Operations that may be in flight at once (count).
    fn queue_depth(&self) -> usize;

    /// Operations submitted and not yet reaped (count).
    fn in_flight(&self) -> usize;

    /// Starts one operation.
    ///
    /// # Errors
    /// [`Refused`] (with the operation handed back) for an unaligned or
    /// out-of-range operation, a full queue, or a broken backend.
    fn submit(&mut self, op: IoOp) -> Result<(), Refused>;

    /// Appends finished operations to `out` and returns how many. With
    /// `wait`, blocks until at least one finished when any is in flight
    /// (a simulated backend advances its own clock instead of blocking);
    /// without, returns what is ready.
    ///
    /// # Errors
    /// [`Errno`] when the backend cannot be waited on any more (its
    /// operations' buffers stay owned by it and are released on drop,
    /// after the kernel finished with them).
    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno>;

    /// As [`reap`](DiskIo::reap) with `wait`, but waits at most `timeout`
    /// for the first completion: `Ok(0)` with operations in flight means
    /// none finished in time (a disk that hangs). The default waits as
    /// `reap` does (the simulated backend, which returns `Ok(0)` at once
    /// while it is stalled); io_uring on kernels before 5.11 (no timeout
    /// with its wait) waits unbounded too.
    ///
    /// # Errors
    /// As [`reap`](DiskIo::reap).
    fn reap_within(&mut self, timeout: std::time::Duration, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        let _ = timeout;
        self.reap(true, out)
    }

    /// Asks the backend to call `hint` whenever operations complete (see
    /// [`CompletionHint`]); returns whether it will. A backend that cannot
    /// (the simulated one: its clock moves only when it is reaped) returns
    /// `false`, and its driver keeps polling on a timer. Only the first
    /// call can succeed; later ones return `false` and change nothing.
    fn set_completion_hint(&mut self, hint: CompletionHint) -> bool {
        let _ = hint;
        false
    }

    /// Where data may start at or after byte `from` of the medium: `from`
    /// itself unless the backend knows the range from `from` holds nothing
    /// ever written (a file's holes and unwritten preallocated extents,
    /// `lseek(SEEK_DATA)`); `None` when nothing at or after `from` was ever
    /// written. Recovery skips what this rules out, so a fresh or partly
    /// used tier is not read end to end at start. Default: everything may
    /// be data (`Some(from)`). A backend that answers wrongly can only make
    /// recovery miss records (never accept one: each still verifies, C18).
    fn next_data(&self, from: u64) -> Option<u64> {
        Some(from)
    }
}

/// Checks `op`'s alignment and range against `capacity` and the queue
/// against `depth`: the checks every backend makes before touching it.
pub(crate) fn check_op(op: &IoOp, capacity: u64, in_flight: usize, depth: usize) -> Result<(), SubmitError> {
    let align = crate::limits::DISK_ALIGN_BYTES;
    if !op.offset.is_multiple_of(align) {
        return Err(SubmitError::Unaligned { offset: op.offset, align });
    }
    let len = op.buf.len() as u64;
    if op.offset.checked_add(len).is_none_or(|end| end > capacity) {
        return Err(SubmitError::OutOfRange { offset: op.offset, len, capacity });
    }
    if in_flight >= depth {
        return Err(SubmitError::QueueFull { depth });
    }
    Ok(())
}
