//! The io_uring backend: reads and writes of the tier's `O_DIRECT` file
//! through one submission/completion ring (`io-uring` crate, opcodes
//! `IORING_OP_READ`/`IORING_OP_WRITE`, Linux 5.6+).
//!
//! Each operation's buffer stays in this struct's in-flight table from
//! submission until its completion is reaped, so the kernel never writes
//! into or reads from freed memory; dropping the backend waits for every
//! operation still in flight first (and leaks their buffers rather than
//! free them if the ring cannot be waited on any more).
//!
//! A completion hint ([`DiskIo::set_completion_hint`]) is delivered through
//! an `eventfd` registered with the ring (`IORING_REGISTER_EVENTFD`, Linux
//! 5.1+): the kernel signals it whenever it posts completions, and one
//! thread of ours blocks reading it and calls the hint. Where the
//! registration is refused the hint is declined and the driver polls.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};

use super::buf::AlignedBuf;
use super::file::DiskFile;
use super::io::{BackendKind, Completion, CompletionHint, DiskIo, Errno, IoKind, IoOp, Refused, SubmitError, check_op};

/// io_uring over the tier file; see the module doc.
pub struct UringDisk {
    ring: IoUring,
    file: DiskFile,
    depth: usize,
    seq: u64,
    /// Ring id → (tag, kind, offset, buffer).
    flight: HashMap<u64, (u64, IoKind, u64, AlignedBuf)>,
    /// The thread that turns the ring's eventfd into completion hints.
    waiter: Option<CqWaiter>,
}

/// An eventfd registered with the ring and the thread that blocks on it
/// and calls the completion hint ([`UringDisk::set_completion_hint`]).
struct CqWaiter {
    efd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CqWaiter {
    /// Stops the thread (sets the flag, signals the eventfd) and joins it.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an open eventfd.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), std::ptr::from_ref(&one).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The waiter thread: each read of the eventfd (blocking until the kernel
/// posted completions) is followed by one call of `hint`, until `stop`.
fn wait_for_completions(fd: RawFd, stop: &AtomicBool, hint: &CompletionHint) {
    let mut v = 0u64;
    loop {
        // SAFETY: reads 8 bytes into a live u64 from an eventfd kept open
        // (by the `Arc<OwnedFd>` this thread's closure holds) until it ends.
        let r = unsafe { libc::read(fd, std::ptr::from_mut(&mut v).cast(), 8) };
        if stop.load(Ordering::Acquire) {
            return;
        }
        if r == 8 {
            hint();
            continue;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        // The driver's timed poll still reaps everything; only the
        // prompt wake-up is lost.
        tracing::warn!(error = %e, "disk tier: reading the io_uring eventfd failed; completions are polled");
        return;
    }
}

impl std::fmt::Debug for UringDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringDisk").field("path", &self.file.path()).field("depth", &self.depth).finish()
    }
}

fn errno_of(e: &std::io::Error) -> Errno {
    Errno(e.raw_os_error().unwrap_or(libc::EIO))
}

impl UringDisk {
    /// A ring of `depth` entries over `file`, checked with one 4 KiB read
    /// at offset 0 (a kernel without `IORING_OP_READ` fails it).
    ///
    /// # Errors
    /// The file back and the OS error when the ring cannot be created
    /// (`ENOSYS`, `EPERM` under a seccomp filter) or the probe fails.
    pub fn new(file: DiskFile, depth: usize) -> Result<Self, (DiskFile, std::io::Error)> {
        let mut ring = match IoUring::new(depth.next_power_of_two() as u32) {
            Ok(r) => r,
            Err(e) => return Err((file, e)),
        };
        if let Err(e) = probe(&mut ring, file.file().as_raw_fd()) {
            return Err((file, e));
        }
        Ok(Self { ring, file, depth, seq: 0, flight: HashMap::new(), waiter: None })
    }

    /// Waits for every operation in flight (drop and teardown). When the
    /// ring cannot be waited on, the buffers are leaked, never freed.
    fn wait_all(&mut self) {
        let mut out = Vec::new();
        while !self.flight.is_empty() {
            if self.reap(true, &mut out).is_err() {
                for (_, (_, _, _, buf)) in self.flight.drain() {
                    std::mem::forget(buf);
                }
                return;
            }
            out.clear();
        }
    }
}

/// Waits until `ring` has at least one completion, or until `end` where
/// one is given and the kernel takes a timeout with the wait (5.11+;
/// before, the wait is unbounded). A signal restarts the wait with what is
/// left of the timeout. `Ok` once a completion arrived or the time ran out
/// (the completion queue then is empty).
fn wait_one(ring: &IoUring, end: Option<Instant>) -> std::io::Result<()> {
    let end = end.filter(|_| ring.params().is_feature_ext_arg());
    loop {
        let waited = match end {
            Some(end) => {
                let ts = types::Timespec::from(end.saturating_duration_since(Instant::now()));
                ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&ts))
            }
            None => ring.submit_and_wait(1),
        };
        match waited {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) if end.is_some() && e.raw_os_error() == Some(libc::ETIME) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// One 4 KiB read at offset 0 through `ring`, waited for.
fn probe(ring: &mut IoUring, fd: std::os::fd::RawFd) -> std::io::Result<()> {
    let len = crate::limits::DISK_ALIGN_BYTES as usize;
    let mut buf = AlignedBuf::new(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
    let entry = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), len as u32).offset(0).build().user_data(0);
    // SAFETY: `buf` outlives the operation: it is dropped only after the
    // completion was seen, and leaked when the ring cannot be waited on.
    if unsafe { ring.submission().push(&entry) }.is_err() {
        return Err(std::io::Error::other("io_uring submission queue full"));
    }
    // A probe that does not complete in time leaves no completion, and
    // its buffer is leaked below.
    let end = Instant::now() + Duration::from_millis(crate::limits::DISK_RECOVERY_READ_TIMEOUT_MS);
    if let Err(e) = wait_one(ring, Some(end)) {
        std::mem::forget(buf);
        return Err(e);
    }
    let res = ring.completion().next().map(|c| c.result());
    match res {
        Some(r) if r >= 0 => Ok(()),
        Some(r) => Err(std::io::Error::from_raw_os_error(-r)),
        None => {
            std::mem::forget(buf);
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "io_uring probe: no completion (the disk hangs)"))
        }
    }
}

impl Drop for UringDisk {
    fn drop(&mut self) {
        self.wait_all();
        if let Some(mut w) = self.waiter.take() {
            w.stop();
        }
    }
}

impl DiskIo for UringDisk {
    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }
    fn next_data(&self, from: u64) -> Option<u64> {
        self.file.next_data(from)
    }

    fn capacity(&self) -> u64 {
        self.file.capacity()
    }

    fn queue_depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.flight.len()
    }

    fn submit(&mut self, mut op: IoOp) -> Result<(), Refused> {
        if let Err(error) = check_op(&op, self.capacity(), self.flight.len(), self.depth) {
            return Err(Refused { error, op });
        }
        let Ok(len) = u32::try_from(op.buf.len()) else {
            let error =
                SubmitError::OutOfRange { offset: op.offset, len: op.buf.len() as u64, capacity: u64::from(u32::MAX) };
            return Err(Refused { error, op });
        };
        let fd = types::Fd(self.file.file().as_raw_fd());
        self.seq += 1;
        let id = self.seq;
        let entry = match op.kind {
            IoKind::Read => opcode::Read::new(fd, op.buf.as_mut_ptr(), len).offset(op.offset).build(),
            IoKind::Write => opcode::Write::new(fd, op.buf.as_ptr(), len).offset(op.offset).build(),
        }
        .user_data(id);
        // SAFETY: the buffer is valid for `len` bytes and is kept alive
        // (owned by `flight`) until this entry's completion is reaped.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            // The ring is sized to the depth, so it is never full while
            // fewer than `depth` operations are in flight; refuse anyway.
            return Err(Refused { error: SubmitError::QueueFull { depth: self.depth }, op });
        }
        self.flight.insert(id, (op.tag, op.kind, op.offset, op.buf));
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) || e.raw_os_error() == Some(libc::EBUSY) => {
                    // Stays queued in the ring; the next enter submits it.
                    return Ok(());
                }
                Err(e) => {
                    // The entry may or may not have reached the kernel: keep
                    // its buffer in flight (reaped or leaked, never freed).
                    tracing::error!(error = %e, "disk tier: io_uring submit failed");
                    return Ok(());
                }
            }
        }
    }

    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        if wait && !self.flight.is_empty() && self.ring.completion().is_empty() {
            wait_one(&self.ring, None).map_err(|e| errno_of(&e))?;
        }
        let mut n = 0;
        let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (id, res) in done {
            let Some((tag, kind, offset, buf)) = self.flight.remove(&id) else { continue };
            let result = if res < 0 { Err(Errno(-res)) } else { Ok(res as usize) };
            out.push(Completion { tag, kind, offset, buf, result });
            n += 1;
        }
        Ok(n)
    }

    fn reap_within(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        if !self.flight.is_empty() && self.ring.completion().is_empty() {
            wait_one(&self.ring, Some(Instant::now() + timeout)).map_err(|e| errno_of(&e))?;
        }
        self.reap(false, out)
    }

    fn set_completion_hint(&mut self, hint: CompletionHint) -> bool {
        if self.waiter.is_some() {
            return false;
        }
        // SAFETY: eventfd(2) with valid flags; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            tracing::info!(error = %std::io::Error::last_os_error(), "disk tier: no eventfd; completions are polled");
            return false;
        }
        // SAFETY: `raw` is a new descriptor owned by nobody else.
        let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        if let Err(e) = self.ring.submitter().register_eventfd(raw) {
            tracing::info!(error = %e, "disk tier: io_uring refused an eventfd; completions are polled");
            return false;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (fd, st) = (efd.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("kvferry-disk-cq".into())
            .spawn(move || wait_for_completions(fd.as_raw_fd(), &st, &hint));
        match spawned {
            Ok(t) => {
                self.waiter = Some(CqWaiter { efd, stop, thread: Some(t) });
                true
            }
            Err(e) => {
                let _ = self.ring.submitter().unregister_eventfd();
                tracing::info!(error = %e, "disk tier: no completion thread; completions are polled");
                false
            }
        }
    }
}
