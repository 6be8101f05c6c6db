//! The choice of real backend over the tier's file ([`open_backend`]):
//! io_uring when the kernel and the container allow it, else `pread` /
//! `pwrite` on blocking threads; [`RealDisk`] is whichever runs.

use std::path::Path;

use super::file::{DiskFile, OpenError};
use super::io::{BackendKind, Completion, CompletionHint, DiskIo, Errno, IoOp, Refused};
use super::pio::PioDisk;
use super::uring::UringDisk;
use crate::limits::DISK_QUEUE_DEPTH_MAX;

/// Which backend to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// io_uring, or threads when io_uring is refused (logged).
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// `pread`/`pwrite` on threads.
    Pio,
}

/// A real backend: io_uring or threads.
#[derive(Debug)]
pub enum RealDisk {
    /// io_uring + `O_DIRECT` (boxed: the ring is large).
    Uring(Box<UringDisk>),
    /// `pread`/`pwrite` + `O_DIRECT` on threads.
    Pio(PioDisk),
}

/// Opens `dir`'s tier file (see [`DiskFile::open`]) of `bytes` and a
/// backend of queue depth `depth` over it.
///
/// # Errors
/// [`OpenError`]; with [`BackendChoice::IoUring`], also
/// [`OpenError::NoUring`] when the kernel or a seccomp filter refuses it.
pub fn open_backend(dir: &Path, bytes: u64, depth: usize, choice: BackendChoice) -> Result<RealDisk, OpenError> {
    let file = DiskFile::open(dir, bytes)?;
    backend_over(file, depth, choice)
}

/// A backend of queue depth `depth` over an open file.
///
/// # Errors
/// As [`open_backend`].
pub fn backend_over(file: DiskFile, depth: usize, choice: BackendChoice) -> Result<RealDisk, OpenError> {
    if depth == 0 || depth > DISK_QUEUE_DEPTH_MAX {
        return Err(OpenError::BadDepth { depth, max: DISK_QUEUE_DEPTH_MAX });
    }
    match choice {
        BackendChoice::Pio => pio(file, depth),
        BackendChoice::IoUring => UringDisk::new(file, depth)
            .map(|u| RealDisk::Uring(Box::new(u)))
            .map_err(|(_, source)| OpenError::NoUring { source }),
        BackendChoice::Auto => match UringDisk::new(file, depth) {
            Ok(u) => Ok(RealDisk::Uring(Box::new(u))),
            Err((file, e)) => {
                tracing::info!(error = %e, "disk tier: io_uring unavailable, using pread/pwrite threads");
                pio(file, depth)
            }
        },
    }
}

fn pio(file: DiskFile, depth: usize) -> Result<RealDisk, OpenError> {
    PioDisk::new(file, depth).map(RealDisk::Pio).map_err(|source| OpenError::Threads { source })
}

impl DiskIo for RealDisk {
    fn kind(&self) -> BackendKind {
        match self {
            RealDisk::Uring(d) => d.kind(),
            RealDisk::Pio(d) => d.kind(),
        }
    }
    fn capacity(&self) -> u64 {
        match self {
            RealDisk::Uring(d) => d.capacity(),
            RealDisk::Pio(d) => d.capacity(),
        }
    }
    fn queue_depth(&self) -> usize {
        match self {
            RealDisk::Uring(d) => d.queue_depth(),
            RealDisk::Pio(d) => d.queue_depth(),
        }
    }
    fn in_flight(&self) -> usize {
        match self {
            RealDisk::Uring(d) => d.in_flight(),
            RealDisk::Pio(d) => d.in_flight(),
        }
    }
    fn submit(&mut self, op: IoOp) -> Result<(), Refused> {
        match self {
            RealDisk::Uring(d) => d.submit(op),
            RealDisk::Pio(d) => d.submit(op),
        }
    }
    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        match self {
            RealDisk::Uring(d) => d.reap(wait, out),
            RealDisk::Pio(d) => d.reap(wait, out),
        }
    }
    fn reap_within(&mut self, timeout: std::time::Duration, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        match self {
            RealDisk::Uring(d) => d.reap_within(timeout, out),
            RealDisk::Pio(d) => d.reap_within(timeout, out),
        }
    }
    fn set_completion_hint(&mut self, hint: CompletionHint) -> bool {
        match self {
            RealDisk::Uring(d) => d.set_completion_hint(hint),
            RealDisk::Pio(d) => d.set_completion_hint(hint),
        }
    }
    fn next_data(&self, from: u64) -> Option<u64> {
        match self {
            RealDisk::Uring(d) => d.next_data(from),
            RealDisk::Pio(d) => d.next_data(from),
        }
    }
}
