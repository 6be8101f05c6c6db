//! The thread backend: `pread`/`pwrite` on the tier's `O_DIRECT` file from
//! up to [`DISK_THREADS_MAX`] blocking threads, for hosts where io_uring
//! is refused (containers often filter it out with seccomp).
//!
//! An operation goes to a shared job queue, reads ahead of every queued
//! write (the tier keeps read slots free of writes, `TierConfig::read_slots`;
//! with more operations queued than workers, a FIFO queue would still make a
//! read wait behind the writes before it); a worker takes it, makes one
//! `pread` or `pwrite` call (a short count is passed up as it is, never
//! retried) and sends the completion back, then calls the completion hint
//! if one was set ([`DiskIo::set_completion_hint`]). Dropping the backend closes the
//! queue and joins the workers, so no buffer is freed while a worker holds
//! it.

use std::collections::VecDeque;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

use super::file::DiskFile;
use super::io::{
    BackendKind, Completion, CompletionHint, DiskIo, EIO, Errno, IoKind, IoOp, Refused, SubmitError, check_op,
};
use crate::limits::DISK_THREADS_MAX;

/// The workers' job queue: reads are taken before writes, each kind in
/// submission order; closed when the backend drops.
#[derive(Default)]
struct Jobs {
    state: Mutex<JobState>,
    ready: Condvar,
}

#[derive(Default)]
struct JobState {
    reads: VecDeque<IoOp>,
    writes: VecDeque<IoOp>,
    closed: bool,
}

impl Jobs {
    /// Queues `op`; gives it back once the queue is closed (or poisoned).
    fn push(&self, op: IoOp) -> Result<(), IoOp> {
        let Ok(mut st) = self.state.lock() else { return Err(op) };
        if st.closed {
            return Err(op);
        }
        match op.kind {
            IoKind::Read => st.reads.push_back(op),
            IoKind::Write => st.writes.push_back(op),
        }
        drop(st);
        self.ready.notify_one();
        Ok(())
    }

    /// The next operation, a queued read first; waits while the queue is
    /// empty; `None` once it is closed and empty.
    fn pop(&self) -> Option<IoOp> {
        let mut st = self.state.lock().ok()?;
        loop {
            if let Some(op) = st.reads.pop_front().or_else(|| st.writes.pop_front()) {
                return Some(op);
            }
            if st.closed {
                return None;
            }
            st = self.ready.wait(st).ok()?;
        }
    }

    /// Closes the queue: workers finish what is queued, then stop.
    fn close(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.closed = true;
        }
        self.ready.notify_all();
    }
}

/// `pread`/`pwrite` on threads; see the module doc.
pub struct PioDisk {
    file: Arc<DiskFile>,
    depth: usize,
    jobs: Arc<Jobs>,
    done: Receiver<Completion>,
    workers: Vec<JoinHandle<()>>,
    in_flight: usize,
    /// Called by a worker after each completion it sent, once set.
    hint: Arc<OnceLock<CompletionHint>>,
}

impl std::fmt::Debug for PioDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PioDisk").field("path", &self.file.path()).field("depth", &self.depth).finish()
    }
}

impl PioDisk {
    /// `min(depth, DISK_THREADS_MAX)` workers over `file`, accepting up to
    /// `depth` operations at once.
    ///
    /// # Errors
    /// The OS error when a thread cannot be started (the ones started are
    /// stopped again).
    pub fn new(file: DiskFile, depth: usize) -> std::io::Result<Self> {
        let file = Arc::new(file);
        let jobs = Arc::new(Jobs::default());
        let (tx_done, done) = channel();
        let hint = Arc::new(OnceLock::new());
        let mut me = Self { file, depth: depth.max(1), jobs, done, workers: Vec::new(), in_flight: 0, hint };
        for i in 0..depth.clamp(1, DISK_THREADS_MAX) {
            let rx = me.jobs.clone();
            let tx = tx_done.clone();
            let file = me.file.clone();
            let hint = me.hint.clone();
            // On error `me` drops: the queue closes and the started workers
            // are joined.
            let w = std::thread::Builder::new()
                .name(format!("kvferry-disk-{i}"))
                .spawn(move || worker(&file, &rx, &tx, &hint))?;
            me.workers.push(w);
        }
        Ok(me)
    }
}

fn worker(file: &DiskFile, jobs: &Jobs, tx: &Sender<Completion>, hint: &OnceLock<CompletionHint>) {
    while let Some(mut op) = jobs.pop() {
        let r = match op.kind {
            IoKind::Read => file.file().read_at(op.buf.as_mut_slice(), op.offset),
            IoKind::Write => file.file().write_at(op.buf.as_slice(), op.offset),
        };
        let result = r.map_err(|e| Errno(e.raw_os_error().unwrap_or(EIO.0)));
        if tx.send(Completion { tag: op.tag, kind: op.kind, offset: op.offset, buf: op.buf, result }).is_err() {
            return;
        }
        if let Some(h) = hint.get() {
            h();
        }
    }
}

impl Drop for PioDisk {
    fn drop(&mut self) {
        self.jobs.close();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl DiskIo for PioDisk {
    fn kind(&self) -> BackendKind {
        BackendKind::Pio
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
        self.in_flight
    }

    fn submit(&mut self, op: IoOp) -> Result<(), Refused> {
        if let Err(error) = check_op(&op, self.capacity(), self.in_flight, self.depth) {
            return Err(Refused { error, op });
        }
        match self.jobs.push(op) {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(op) => Err(Refused { error: SubmitError::Broken(EIO), op }),
        }
    }

    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        let mut n = 0;
        if wait && self.in_flight > 0 {
            match self.done.recv() {
                Ok(c) => {
                    out.push(c);
                    n += 1;
                }
                Err(_) => return Err(EIO),
            }
        }
        loop {
            match self.done.try_recv() {
                Ok(c) => {
                    out.push(c);
                    n += 1;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if self.in_flight > n {
                        return Err(EIO);
                    }
                    break;
                }
            }
        }
        self.in_flight -= n;
        Ok(n)
    }

    fn reap_within(&mut self, timeout: std::time::Duration, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        if self.in_flight == 0 {
            return self.reap(false, out);
        }
        match self.done.recv_timeout(timeout) {
            Ok(c) => {
                out.push(c);
                self.in_flight -= 1;
                Ok(1 + self.reap(false, out)?)
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Ok(0),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(EIO),
        }
    }

    fn set_completion_hint(&mut self, hint: CompletionHint) -> bool {
        // Set once; a second hint is refused (the first stays).
        self.hint.set(hint).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::AlignedBuf;

    fn op(kind: IoKind, tag: u64) -> IoOp {
        IoOp { tag, kind, offset: 0, buf: AlignedBuf::new(4096).unwrap() }
    }

    /// Reads leave the queue before every queued write, each kind in
    /// submission order; a closed queue drains what it holds, then ends and
    /// refuses more.
    #[test]
    fn reads_leave_the_queue_before_queued_writes() {
        let q = Jobs::default();
        for (kind, tag) in
            [(IoKind::Write, 1), (IoKind::Write, 2), (IoKind::Read, 3), (IoKind::Write, 4), (IoKind::Read, 5)]
        {
            q.push(op(kind, tag)).unwrap();
        }
        q.close();
        let order: Vec<u64> = std::iter::from_fn(|| q.pop()).map(|o| o.tag).collect();
        assert_eq!(order, [3, 5, 1, 2, 4]);
        assert_eq!(q.push(op(IoKind::Read, 6)).unwrap_err().tag, 6);
    }
}
