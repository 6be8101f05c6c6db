//! The disk tier: records in one preallocated file, an index from block
//! key to location, LRU eviction of disk space, a bounded write-behind
//! queue, reads that verify before they hand bytes back (C17), and
//! recovery on open that lists only records that verify (C18).
//!
//! # Shape
//!
//! [`Tier`] is a synchronous state machine over a [`DiskIo`] backend:
//! [`write`](Tier::write) and [`read`](Tier::read) never block (they queue
//! an operation and return), [`poll`](Tier::poll) collects completions
//! (blocking only when asked to) and returns [`TierEvent`]s. A node drives
//! it from one task or thread; the simulator drives it with the simulated
//! backend, whose clock is its own, so the same code runs in both.
//!
//! # Space
//!
//! The file is carved by the pool's best-fit
//! [`ExtentAllocator`](crate::memory::pool::ExtentAllocator) in 4 KiB
//! units; a record takes `header_area + align_up(payload)` bytes
//! ([`super::format`]). When a write finds no room, the least recently
//! used records that no operation is using are evicted until it fits; the
//! scan is bounded (`EVICTION_SCAN_MAX` entries), and a write that still
//! does not fit is refused and counted ([`WriteRefused::NoSpace`]), never
//! a crash. Every record that leaves the index — evicted, failed to write,
//! failed to read back — is reported once as [`TierEvent::Removed`], so
//! the node registers its removal at the MetaServer (C4, C17).
//!
//! # The write-behind queue
//!
//! A write copies the block into an aligned record buffer and queues it;
//! at most `write_queue_max` writes are accepted and not yet completed.
//! Beyond that a write is refused ([`WriteRefused::QueueFull`]) and
//! counted: the caller drops the block as it would without a disk tier.
//! Before copying, the block's bytes are checked against the slot
//! checksums the caller passes (taken at seal time, C10), so a block that
//! changed in memory since it was sealed is never written. A record is
//! readable from the moment its write is queued: a read of a record whose
//! write still waits in the queue copies it from the queue's buffer at
//! once; one whose write is at the backend waits for that write and is
//! served from the buffer the completion hands back (no disk read). Both
//! copies are verified as a disk read's (C17) and counted apart
//! ([`TierCounters::queue_reads`], [`TierCounters::after_write_reads`]).
//!
//! # What a read checks (C17)
//!
//! A completion must carry a tag the tier issued and has not seen complete
//! (else it is *stale* and ignored), the kind, offset, buffer address and
//! length it was submitted with (else it is *misdirected*), and a full
//! byte count (else *short*). Its bytes must then decode to a header whose
//! identity (namespace, hash, layout family, length, generation) is the
//! one the index holds and whose every slot CRC-32C matches. Any failure
//! drops the record from the index (its space is freed once no operation
//! uses it), counts it, and hands the reader an error; no unverified byte
//! is ever handed out.
//!
//! # Recovery (C18)
//!
//! [`Tier::open`] scans the file in [`DISK_RECOVERY_CHUNK_BYTES`] reads —
//! all of it, less what the backend knows was never written
//! ([`DiskIo::next_data`]: holes and unwritten preallocated space, which
//! hold no record) — and tries every 4 KiB boundary as a record start; a candidate is kept only when its header and every slot
//! checksum verify. Candidates are then taken newest generation first; one
//! that overlaps an already kept record or repeats its key is dropped. A
//! crash tears at most the writes in flight (records are written in one
//! operation, at locations no live record uses), so every record whose
//! write completed before the crash and that was still in the index is
//! found again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;

use super::buf::{AlignedBuf, BufError};
use super::format::{self, BlockKey, Expect, FormatError, RecordHeader, SlotSum};
use super::io::{BackendKind, Completion, DiskIo, ENOSPC, Errno, IoKind, IoOp, SubmitError};
use crate::canary::{self, Canary};
use crate::limits::{
    DISK_ALIGN_BYTES, DISK_RECORD_ALIGN_MAX, DISK_RECOVERY_CHUNK_BYTES, DISK_RECOVERY_READ_TIMEOUT_MS,
    DISK_SPARE_BUFFERS_MAX, DISK_WRITE_QUEUE_DEFAULT, DISK_WRITE_QUEUE_MAX, EVICTION_SCAN_MAX,
};
use crate::memory::pool::{ExtentAllocator, PoolError};

/// Bytes copied into a record buffer before the copy is checksummed (64
/// KiB: the piece is still in L2 when the check reads it).
const WRITE_CHECK_PIECE_BYTES: usize = 64 << 10;

/// `tracing` target of the event recovery emits for every record it finds
/// valid (`namespace`, `hash` in hex, `generation`, and `payload_crc`: the
/// CRC-32C of the payload bytes as they are on the medium), at TRACE
/// level. The payload CRC is computed only while the target is enabled
/// (the simulator's C18 check compares it with the bytes that were saved);
/// a record listed twice (an older generation) is dropped later.
pub const DISK_RECOVERED_TRACE_TARGET: &str = "kvferry::disk_recovered";

/// Emits [`DISK_RECOVERED_TRACE_TARGET`] for `record` (a record recovery
/// keeps as a candidate) when the target is enabled; always `true`.
fn trace_recovered(record: &[u8]) -> bool {
    if tracing::enabled!(target: DISK_RECOVERED_TRACE_TARGET, tracing::Level::TRACE) {
        if let Ok(h) = format::decode_header(record) {
            let from = h.header_area() as usize;
            let to = from.saturating_add(h.payload_len as usize).min(record.len());
            let payload_crc = crc32c::crc32c(record.get(from.min(to)..to).unwrap_or(&[]));
            tracing::trace!(
                target: DISK_RECOVERED_TRACE_TARGET,
                namespace = %h.key.namespace,
                hash = %hex::encode(h.key.hash.as_bytes()),
                generation = h.generation,
                payload_crc,
                "disk record recovered"
            );
        }
    }
    true
}

/// A record is padded to a larger unit only while the padding stays at
/// most 1/32 of the record (≈ 3 % more bytes written).
pub const RECORD_PAD_MAX_FRACTION: u64 = 32;

/// Bytes a record of `record_len` bytes takes on disk (and its write
/// moves) under [`TierConfig::record_align`] `record_align`: `record_len`
/// rounded up to the largest power of two `a` with `DISK_ALIGN_BYTES <= a
/// <= record_align` whose padding is at most `record_len /
/// RECORD_PAD_MAX_FRACTION` (to 4 KiB when none is). Saturates at
/// `u64::MAX`.
pub fn padded_record_len(record_len: u64, record_align: u64) -> u64 {
    let a = record_unit(record_len, record_align);
    record_len.div_ceil(a).saturating_mul(a)
}

/// The unit a record of `record_len` bytes is padded to under
/// `record_align` (see [`padded_record_len`]): a power of two,
/// `DISK_ALIGN_BYTES..=max(record_align, DISK_ALIGN_BYTES)`.
pub fn record_unit(record_len: u64, record_align: u64) -> u64 {
    let up = |a: u64| record_len.div_ceil(a).saturating_mul(a);
    let mut a = record_align.max(DISK_ALIGN_BYTES);
    while a > DISK_ALIGN_BYTES && up(a) - record_len > record_len / RECORD_PAD_MAX_FRACTION {
        a /= 2;
    }
    a
}

/// Settings of a [`Tier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierConfig {
    /// Writes accepted and not yet completed, at most (blocks,
    /// `1..=DISK_WRITE_QUEUE_MAX`).
    pub write_queue_max: usize,
    /// The largest unit a record is padded to (bytes; a power of two,
    /// `DISK_ALIGN_BYTES..=DISK_RECORD_ALIGN_MAX`): each record takes, and
    /// its write moves, a multiple of the largest power of two up to this
    /// whose padding (zeros) is at most 1/[`RECORD_PAD_MAX_FRACTION`] of
    /// the record, 4 KiB at least ([`padded_record_len`]). A device (or a
    /// virtual disk) that rewrites larger units than it is written in is
    /// faster with that unit (64 KiB halved the write time of 2.25 MiB
    /// blocks on a virtio disk, `bench ssd`), while a small record padded
    /// to it would double the bytes written (a 64 KiB block's record, 68
    /// KiB, stays on 4 KiB).
    pub record_align: u64,
    /// Of the backend's queue depth, slots that writes leave to reads
    /// (count): at most `max(1, depth - read_slots)` writes are at the
    /// backend at once, so a read (reads go first) finds a free slot
    /// instead of waiting for a write to complete. 0: writes may fill the
    /// depth.
    pub read_slots: usize,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self { write_queue_max: DISK_WRITE_QUEUE_DEFAULT, record_align: DISK_ALIGN_BYTES, read_slots: 0 }
    }
}

/// Why a tier could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// A setting out of its bounds.
    #[error("bad disk tier setting {field} = {value} (allowed {allowed})")]
    BadConfig {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The allowed range, in words.
        allowed: &'static str,
    },
    /// The file is too small to carve.
    #[error("disk tier file: {0}")]
    Space(#[from] PoolError),
    /// An I/O buffer could not be allocated.
    #[error("disk tier buffer: {0}")]
    Buffer(#[from] BufError),
    /// The backend failed while recovery waited on it.
    #[error("disk tier backend failed during recovery: {0}")]
    Backend(Errno),
    /// A recovery read did not complete in time: the disk hangs. The
    /// backend, whose read still owns a buffer, is dropped on a thread of
    /// its own, so nothing waits for it.
    #[error("disk tier recovery: a read at byte {offset} did not complete (waited {waited_ms} ms; the disk hangs)")]
    RecoveryStalled {
        /// Where the read started (bytes into the tier's file).
        offset: u64,
        /// How long recovery waited (ms).
        waited_ms: u64,
    },
}

/// Why a write was not accepted. Each is counted; none blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteRefused {
    /// The write-behind queue is full.
    #[error("disk write queue full ({max} writes pending)")]
    QueueFull {
        /// The queue's bound (blocks).
        max: usize,
    },
    /// No room even after evicting every record not in use.
    #[error("no disk space for a {need} B record ({free} B free of {capacity} B)")]
    NoSpace {
        /// Bytes the record needs.
        need: u64,
        /// Bytes free after the eviction attempt.
        free: u64,
        /// The tier's size (bytes).
        capacity: u64,
    },
    /// The header cannot be encoded (bounds) or the slot lengths do not
    /// add up to the bytes given.
    #[error("bad block for the disk tier: {0}")]
    Format(#[from] FormatError),
    /// The bytes do not match the slot checksums the caller gave: the
    /// block changed since it was sealed, and is not written.
    #[error("block bytes do not match slot {slot}'s checksum ({stored:#010x} given, {computed:#010x} computed)")]
    InputChecksum {
        /// Slot index.
        slot: usize,
        /// The checksum given.
        stored: u32,
        /// The checksum of the bytes.
        computed: u32,
    },
    /// The record would be larger than the whole tier.
    #[error("a {need} B record does not fit a {capacity} B disk tier")]
    TooLarge {
        /// Bytes the record needs.
        need: u64,
        /// The tier's size (bytes).
        capacity: u64,
    },
    /// The record buffer could not be allocated.
    #[error("disk tier buffer: {0}")]
    Buffer(#[from] BufError),
}

/// Why a read was not started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadRefused {
    /// The block is not on disk.
    #[error("block not on disk")]
    NotFound,
    /// The record buffer could not be allocated.
    #[error("disk tier buffer: {0}")]
    Buffer(#[from] BufError),
}

/// Why an operation of the tier failed. A failed read or write drops the
/// record ([`TierEvent::Removed`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoFailure {
    /// The OS reported an error (`ENOSPC` on a write is counted as
    /// running out of space).
    #[error("{0}")]
    Os(Errno),
    /// Fewer bytes moved than the record has.
    #[error("short transfer: {done} of {len} B")]
    Short {
        /// Bytes moved.
        done: usize,
        /// Bytes of the operation.
        len: usize,
    },
    /// The completion carried another buffer, kind, offset or length than
    /// the operation it names.
    #[error("completion for the wrong buffer or operation")]
    Misdirected,
    /// The backend refused the submission.
    #[error("submission refused: {0}")]
    Submit(SubmitError),
    /// The bytes read do not verify (C17).
    #[error("record does not verify: {0}")]
    Verify(FormatError),
    /// The tier's own bookkeeping lost the record (a bug, counted in
    /// [`TierCounters::internal_errors`]).
    #[error("the tier's index lost the record")]
    Internal,
}

/// Why a record left the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    /// LRU eviction to make room for a write.
    Evicted,
    /// Its write failed.
    WriteFailed(IoFailure),
    /// A read of it failed.
    ReadFailed(IoFailure),
}

/// A verified block read from disk: the record buffer and where in it the
/// block's bytes are.
#[derive(Debug)]
pub struct ReadBlock {
    /// The whole record as read (give it back with [`Tier::recycle`]).
    pub buf: AlignedBuf,
    /// The block's bytes within `buf`.
    pub payload: Range<usize>,
    /// Its slots (lengths and CRC-32C), verified.
    pub slots: Vec<SlotSum>,
    /// The record's generation.
    pub generation: u64,
}

impl ReadBlock {
    /// The block's bytes (verified).
    pub fn bytes(&self) -> &[u8] {
        self.buf.as_slice().get(self.payload.clone()).unwrap_or(&[])
    }
}

/// What [`Tier::poll`] reports.
#[derive(Debug)]
pub enum TierEvent {
    /// A queued write completed: the block is on disk and readable.
    Written {
        /// The block.
        key: BlockKey,
        /// Its record's generation.
        generation: u64,
    },
    /// A read finished: verified bytes, or why not (the record was then
    /// dropped and a [`TierEvent::Removed`] follows).
    Read {
        /// The tag [`Tier::read`] returned.
        tag: u64,
        /// The block.
        key: BlockKey,
        /// The bytes, or the failure.
        result: Result<ReadBlock, IoFailure>,
    },
    /// A record left the index: register the block's removal unless it is
    /// resident elsewhere on this node.
    Removed {
        /// The block.
        key: BlockKey,
        /// Its record's generation.
        generation: u64,
        /// Why.
        why: Removal,
    },
}

/// What a [`Tier::write`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Queued; a [`TierEvent::Written`] or [`TierEvent::Removed`] follows.
    Queued {
        /// The record's generation.
        generation: u64,
    },
    /// The block is already on disk (or being written); nothing queued.
    AlreadyOnDisk {
        /// The existing record's generation.
        generation: u64,
    },
}

/// Counters of a tier (monotonic; bytes are block bytes, headers not
/// included).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierCounters {
    /// Writes accepted into the queue.
    pub writes_queued: u64,
    /// Records written (completed and verified by count).
    pub written_blocks: u64,
    /// Block bytes written.
    pub written_bytes: u64,
    /// Writes skipped because the block was already on disk.
    pub write_dedup: u64,
    /// Writes refused: queue full.
    pub write_refused_queue_full: u64,
    /// Writes refused: no space after eviction.
    pub write_refused_no_space: u64,
    /// Writes refused: bad input (format bounds, checksums, size).
    pub write_refused_input: u64,
    /// Writes that failed at the device (error, short, misdirected).
    pub write_failed: u64,
    /// Of those, `ENOSPC` from the device.
    pub write_enospc: u64,
    /// Reads started on a block found in the index (on disk, or being
    /// written: waiting in the write-behind queue or at the backend).
    pub hits: u64,
    /// Reads of a block not on disk.
    pub misses: u64,
    /// Reads that returned verified bytes.
    pub read_blocks: u64,
    /// Of those, reads served from a record still waiting in the
    /// write-behind queue (copied from its buffer and verified as a disk
    /// read is), not from the disk.
    pub queue_reads: u64,
    /// Of those, reads of a record whose write was at the backend: each
    /// waited for that write and was served from the buffer its completion
    /// handed back (verified likewise), not from the disk.
    pub after_write_reads: u64,
    /// Block bytes returned by verified reads.
    pub read_bytes: u64,
    /// Reads failed at the device (error, short, misdirected).
    pub read_failed: u64,
    /// Reads whose bytes did not verify (C17).
    pub verify_failures: u64,
    /// Completions naming the wrong buffer, kind, offset or length.
    pub misdirected_completions: u64,
    /// Completions of a tag not in flight (ignored).
    pub stale_completions: u64,
    /// Records evicted (LRU).
    pub evicted: u64,
    /// Records recovered on open.
    pub recovered: u64,
    /// Candidates refused on open: a header with the magic that does not
    /// verify, a payload that does not, or an overlap.
    pub recovery_rejected: u64,
    /// Verified records on open superseded by a newer one of the same key.
    pub recovery_superseded: u64,
    /// Reads of recovery that failed (their range was skipped).
    pub recovery_io_errors: u64,
    /// Bookkeeping that disagreed with itself (a bug; logged, never a
    /// panic).
    pub internal_errors: u64,
}

/// One block found by recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredBlock {
    /// The block.
    pub key: BlockKey,
    /// Its record's generation.
    pub generation: u64,
    /// Its bytes (length).
    pub payload_len: u64,
}

/// What [`Tier::open`] found.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// Every block that verified and was kept, oldest generation first:
    /// what the node re-advertises.
    pub blocks: Vec<RecoveredBlock>,
    /// Candidates refused (see [`TierCounters::recovery_rejected`]).
    pub rejected: u64,
    /// Older records of a key kept in a newer one.
    pub superseded: u64,
    /// Bytes scanned.
    pub scanned_bytes: u64,
    /// Bytes not read because the backend knew them never written
    /// ([`DiskIo::next_data`]: a fresh or partly used file's holes).
    pub skipped_bytes: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    offset: u64,
    /// Bytes allocated (the record rounded up to the record alignment).
    record_len: u64,
    /// Bytes a read moves (the record itself).
    read_len: u64,
    generation: u64,
    payload_len: u64,
    tick: u64,
    written: bool,
    /// The tag of the record's write (meaningful while `!written`).
    write_tag: u64,
}

/// A read of a record whose write is at the backend: served from the
/// write's buffer when it completes.
#[derive(Debug)]
struct AfterWrite {
    tag: u64,
    key: BlockKey,
    /// The read's own buffer, of the record's read length.
    buf: AlignedBuf,
}

#[derive(Debug, Clone)]
struct Pending {
    kind: IoKind,
    key: BlockKey,
    offset: u64,
    len: usize,
    generation: u64,
    payload_len: u64,
    addr: usize,
    /// Handed to the backend (not only built).
    submitted: bool,
}

/// The disk tier over backend `D`; see the module doc.
pub struct Tier<D: DiskIo> {
    io: D,
    write_queue_max: usize,
    record_align: u64,
    space: ExtentAllocator,
    index: HashMap<BlockKey, Entry>,
    lru: BTreeMap<u64, BlockKey>,
    tick: u64,
    next_generation: u64,
    next_tag: u64,
    /// Every operation issued and not completed, by tag.
    ops: HashMap<u64, Pending>,
    /// Tags of operations built and not yet taken by the backend (reads
    /// first).
    waiting: VecDeque<u64>,
    /// Those operations, by tag.
    built: HashMap<u64, IoOp>,
    /// Reads waiting for a write at the backend, by the write's tag.
    after_write: HashMap<u64, Vec<AfterWrite>>,
    /// Record offset → operations using it.
    pins: HashMap<u64, u32>,
    /// Record offset → length, to free when its last operation ends.
    doomed: HashMap<u64, u64>,
    writes_pending: usize,
    /// Writes the backend holds now (count).
    device_writes: usize,
    /// `device_writes`' bound (see [`TierConfig::read_slots`]).
    device_writes_max: usize,
    /// Buffers kept for reuse, by capacity (bytes).
    spare: BTreeMap<usize, Vec<AlignedBuf>>,
    /// Buffers in `spare` (count).
    spare_count: usize,
    /// `spare_count`'s bound: [`DISK_SPARE_BUFFERS_MAX`], or the writes
    /// the queue may hold plus the backend's depth when that is more.
    spare_max: usize,
    events: Vec<TierEvent>,
    counters: TierCounters,
}

impl<D: DiskIo> std::fmt::Debug for Tier<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier")
            .field("backend", &self.io.kind())
            .field("records", &self.index.len())
            .field("used", &self.space.used_bytes())
            .field("capacity", &self.space.capacity())
            .finish()
    }
}

impl<D: DiskIo> Tier<D> {
    /// Opens the tier over `io`: scans the file and keeps every record
    /// that verifies (see the module doc, "Recovery"). Returns the tier and
    /// what recovery found.
    ///
    /// # Errors
    /// [`TierError::BadConfig`] for a queue bound outside
    /// `1..=DISK_WRITE_QUEUE_MAX`; [`TierError::Space`] when the file is
    /// smaller than one unit; [`TierError::Buffer`] when a scan buffer
    /// cannot be allocated; [`TierError::Backend`] when the backend fails
    /// while recovery waits on it; [`TierError::RecoveryStalled`] when a
    /// recovery read does not complete within
    /// [`DISK_RECOVERY_READ_TIMEOUT_MS`] (a disk that hangs: the open
    /// fails instead of hanging the caller). A read error or short read
    /// during the scan only skips that range (counted).
    pub fn open(io: D, cfg: TierConfig) -> Result<(Self, Recovery), TierError>
    where
        D: 'static,
    {
        if cfg.write_queue_max == 0 || cfg.write_queue_max > DISK_WRITE_QUEUE_MAX {
            return Err(TierError::BadConfig {
                field: "write_queue_max",
                value: cfg.write_queue_max as u64,
                allowed: "1..=16384",
            });
        }
        let ra = cfg.record_align;
        if !ra.is_power_of_two() || !(DISK_ALIGN_BYTES..=DISK_RECORD_ALIGN_MAX).contains(&ra) {
            return Err(TierError::BadConfig {
                field: "record_align",
                value: ra,
                allowed: "a power of two in 4096..=16777216",
            });
        }
        let space = ExtentAllocator::new(io.capacity() & !(ra - 1), DISK_ALIGN_BYTES)?;
        let io_depth = io.queue_depth();
        let mut t = Tier {
            io,
            write_queue_max: cfg.write_queue_max,
            record_align: ra,
            space,
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            next_generation: 1,
            next_tag: 1,
            ops: HashMap::new(),
            waiting: VecDeque::new(),
            built: HashMap::new(),
            after_write: HashMap::new(),
            pins: HashMap::new(),
            doomed: HashMap::new(),
            writes_pending: 0,
            device_writes: 0,
            device_writes_max: io_depth.saturating_sub(cfg.read_slots).max(1),
            spare: BTreeMap::new(),
            spare_count: 0,
            spare_max: DISK_SPARE_BUFFERS_MAX.max(cfg.write_queue_max + io_depth),
            events: Vec::new(),
            counters: TierCounters::default(),
        };
        match t.recover() {
            Ok(rec) => Ok((t, rec)),
            Err(e) => {
                if t.io.in_flight() > 0 && !crate::rt::SIMULATED {
                    // Dropping a real backend waits for its operations,
                    // and the disk may never finish them.
                    // Where no thread can be started, the closure is
                    // dropped unrun and the backend is leaked.
                    let io = std::mem::ManuallyDrop::new(t.io);
                    let _ = std::thread::Builder::new()
                        .name("kvferry-disk-abandoned".into())
                        .spawn(move || drop(std::mem::ManuallyDrop::into_inner(io)));
                }
                Err(e)
            }
        }
    }

    /// Which backend runs.
    pub fn backend(&self) -> BackendKind {
        self.io.kind()
    }

    /// The counters so far.
    pub fn counters(&self) -> &TierCounters {
        &self.counters
    }

    /// Records in the index (written or being written).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no record is indexed.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The tier's size (bytes).
    pub fn capacity(&self) -> u64 {
        self.space.capacity()
    }

    /// Bytes taken by records (padded headers and payloads).
    pub fn used_bytes(&self) -> u64 {
        self.space.used_bytes()
    }

    /// Writes accepted and not completed (blocks).
    pub fn writes_pending(&self) -> usize {
        self.writes_pending
    }

    /// Writes the write-behind queue still accepts before it refuses
    /// (blocks).
    pub fn write_queue_room(&self) -> usize {
        self.write_queue_max.saturating_sub(self.writes_pending)
    }

    /// Operations issued and not completed (count).
    pub fn ops_pending(&self) -> usize {
        self.ops.len()
    }

    /// The generation of `key`'s record and whether its write completed;
    /// `None` when not indexed. Does not touch the LRU order.
    pub fn lookup(&self, key: &BlockKey) -> Option<(u64, bool)> {
        self.index.get(key).map(|e| (e.generation, e.written))
    }

    /// Every indexed block (written or being written).
    pub fn keys(&self) -> Vec<BlockKey> {
        self.index.keys().cloned().collect()
    }

    /// Every indexed block whose write completed, with its generation.
    pub fn written_keys(&self) -> Vec<(BlockKey, u64)> {
        self.index.iter().filter(|(_, e)| e.written).map(|(k, e)| (k.clone(), e.generation)).collect()
    }

    /// Buffers kept for reuse now (count; see
    /// [`DISK_SPARE_BUFFERS_MAX`]).
    pub fn spare_buffers(&self) -> usize {
        self.spare_count
    }

    /// The backend (tests inject faults through it).
    pub fn io_mut(&mut self) -> &mut D {
        &mut self.io
    }

    /// Gives the backend back (operations still in it stay in it).
    pub fn into_io(self) -> D {
        self.io
    }

    /// Hands a buffer back for reuse (e.g. a [`ReadBlock`]'s once its bytes
    /// were copied into the pool).
    pub fn recycle(&mut self, buf: AlignedBuf) {
        if self.spare_count < self.spare_max {
            self.spare.entry(buf.capacity()).or_default().push(buf);
            self.spare_count += 1;
        }
    }

    /// Queues a write of one block (write-behind): `payload` is the block's
    /// bytes, `slots` its slot lengths and seal-time CRC-32C (in order,
    /// lengths adding up to `payload.len()`). Never blocks; the result of
    /// the write comes later from [`poll`](Self::poll). Records evicted to
    /// make room are reported there too ([`TierEvent::Removed`]).
    ///
    /// # Errors
    /// [`WriteRefused`], each counted: queue full, no space, a block that
    /// does not fit the format's bounds or the tier, or bytes that do not
    /// match `slots` (checked on the copy that is written; records evicted
    /// to make room before that check are still reported).
    pub fn write(&mut self, key: &BlockKey, slots: &[SlotSum], payload: &[u8]) -> Result<WriteOutcome, WriteRefused> {
        if let Some(e) = self.index.get(key) {
            let generation = e.generation;
            self.touch(key);
            self.counters.write_dedup += 1;
            return Ok(WriteOutcome::AlreadyOnDisk { generation });
        }
        if self.writes_pending >= self.write_queue_max {
            self.counters.write_refused_queue_full += 1;
            return Err(WriteRefused::QueueFull { max: self.write_queue_max });
        }
        let header = RecordHeader {
            key: key.clone(),
            generation: self.next_generation,
            payload_len: payload.len() as u64,
            slots: slots.to_vec(),
        };
        if let Err(e) = header.validate() {
            self.counters.write_refused_input += 1;
            return Err(e.into());
        }
        // Within the capacity, so no overflow.
        let need = padded_record_len(header.record_len(), self.record_align);
        if need > self.space.capacity() {
            self.counters.write_refused_input += 1;
            return Err(WriteRefused::TooLarge { need, capacity: self.space.capacity() });
        }
        let Some(offset) = self.make_room(need) else {
            self.counters.write_refused_no_space += 1;
            // Counted every time; logged at warn on the first refusal and on
            // every power of two from 1024 on (a tier whose space the write
            // queue's records hold refuses thousands), else at debug.
            let n = self.counters.write_refused_no_space;
            if n == 1 || n.is_power_of_two() && n >= 1024 {
                tracing::warn!(
                    refusals = n,
                    need,
                    free = self.space.free_bytes(),
                    capacity = self.space.capacity(),
                    "disk tier: no space for a record even after eviction (records still being written are not evictable: a tier far larger than its write queue avoids this); the block is dropped"
                );
            } else {
                tracing::debug!(refusals = n, need, "disk tier: no space for a record; the block is dropped");
            }
            return Err(WriteRefused::NoSpace { need, free: self.space.free_bytes(), capacity: self.space.capacity() });
        };
        let mut buf = match self.take_buf(need as usize) {
            Ok(b) => b,
            Err(e) => {
                self.free_space(offset, need);
                return Err(e.into());
            }
        };
        // Header, then each slot copied and checked against its given
        // checksum on the copy itself (the bytes that go to disk), a piece
        // at a time so the check reads what the copy just left in cache.
        let enc = match header.encode() {
            Ok(e) => e,
            Err(e) => {
                // Validated above; kept as an error, never a panic.
                self.counters.internal_errors += 1;
                self.free_space(offset, need);
                self.recycle(buf);
                return Err(e.into());
            }
        };
        let area = header.header_area() as usize;
        let out = buf.as_mut_slice();
        out[..enc.len()].copy_from_slice(&enc);
        out[enc.len()..area].fill(0);
        let mut at = 0usize;
        let mut bad = None;
        for (slot, s) in slots.iter().enumerate() {
            let len = s.len as usize;
            let mut crc = 0u32;
            let mut done = 0usize;
            while done < len {
                let n = (len - done).min(WRITE_CHECK_PIECE_BYTES);
                let dst = &mut out[area + at + done..area + at + done + n];
                dst.copy_from_slice(&payload[at + done..at + done + n]);
                crc = crc32c::crc32c_append(crc, dst);
                done += n;
            }
            if crc != s.crc32c {
                bad = Some(WriteRefused::InputChecksum { slot, stored: s.crc32c, computed: crc });
                break;
            }
            at += len;
        }
        if let Some(e) = bad {
            self.counters.write_refused_input += 1;
            self.free_space(offset, need);
            self.recycle(buf);
            return Err(e);
        }
        out[area + at..].fill(0);
        let generation = self.next_generation;
        self.next_generation += 1;
        let tag = self.issue(IoKind::Write, key.clone(), offset, generation, header.payload_len, buf);
        let tick = self.bump();
        self.lru.insert(tick, key.clone());
        self.index.insert(
            key.clone(),
            Entry {
                offset,
                record_len: need,
                read_len: header.record_len(),
                generation,
                payload_len: header.payload_len,
                tick,
                written: false,
                write_tag: tag,
            },
        );
        self.writes_pending += 1;
        self.counters.writes_queued += 1;
        self.waiting.push_back(tag);
        self.pump();
        Ok(WriteOutcome::Queued { generation })
    }

    /// Starts a read of `key`'s record; returns the tag its
    /// [`TierEvent::Read`] will carry. Reads go to the backend ahead of
    /// queued writes. Never blocks.
    ///
    /// # Errors
    /// [`ReadRefused::NotFound`] (a miss, counted),
    /// [`ReadRefused::Buffer`]. A record whose write has not completed is
    /// read from that write's buffer: at once while the write waits in the
    /// queue (its event comes with the next poll), else when the write
    /// completes (a failed write fails the read).
    pub fn read(&mut self, key: &BlockKey) -> Result<u64, ReadRefused> {
        let Some(e) = self.index.get(key) else {
            self.counters.misses += 1;
            return Err(ReadRefused::NotFound);
        };
        let (offset, len, generation, payload_len) = (e.offset, e.read_len, e.generation, e.payload_len);
        let write_tag = (!e.written).then_some(e.write_tag);
        if write_tag.is_some_and(|w| !self.ops.contains_key(&w)) {
            // An unwritten record always has its write pending.
            self.counters.internal_errors += 1;
            return Err(ReadRefused::NotFound);
        }
        let buf = self.take_buf(len as usize)?;
        self.counters.hits += 1;
        self.touch(key);
        let Some(write_tag) = write_tag else {
            let tag = self.issue(IoKind::Read, key.clone(), offset, generation, payload_len, buf);
            self.waiting.push_front(tag);
            self.pump();
            return Ok(tag);
        };
        let tag = self.next_tag;
        self.next_tag += 1;
        match self.built.remove(&write_tag) {
            // The write waits in the queue: copy from its buffer now. A
            // copy that does not verify (the buffer changed since it was
            // checked on write) fails the write too, so it never lands.
            Some(op) => match self.read_from_write(tag, key.clone(), buf, &op.buf, generation, payload_len) {
                Ok(()) => {
                    self.counters.queue_reads += 1;
                    self.built.insert(write_tag, op);
                }
                Err(f) => {
                    // Never written: the write fails (counted), its record
                    // is dropped and its removal reported.
                    self.waiting.retain(|&t| t != write_tag);
                    self.fail(write_tag, op.buf, f);
                }
            },
            None => self.after_write.entry(write_tag).or_default().push(AfterWrite { tag, key: key.clone(), buf }),
        }
        Ok(tag)
    }

    /// Serves read `tag` of `key` from `src`, the buffer of the record's
    /// write: copies the record (`buf`'s length) into `buf` and settles it
    /// as a disk read ([`settle_read`](Self::settle_read)).
    ///
    /// # Errors
    /// The copy's failure (the caller drops the record).
    fn read_from_write(
        &mut self,
        tag: u64,
        key: BlockKey,
        mut buf: AlignedBuf,
        src: &AlignedBuf,
        generation: u64,
        payload_len: u64,
    ) -> Result<(), IoFailure> {
        let len = buf.len();
        let Some(s) = src.as_slice().get(..len) else {
            // A record longer than its own write's buffer: a bug, reported
            // as a short read.
            self.counters.internal_errors += 1;
            let f = IoFailure::Short { done: src.len(), len };
            self.events.push(TierEvent::Read { tag, key, result: Err(f.clone()) });
            self.recycle(buf);
            return Err(f);
        };
        buf.as_mut_slice().copy_from_slice(s);
        self.settle_read(tag, key, buf, generation, payload_len)
    }

    /// Verifies read `tag`'s record in `buf` (C17) and queues its
    /// [`TierEvent::Read`]: the verified block, or the failure (the buffer
    /// is recycled); counts either. Every read ends here, from the disk or
    /// from a write's buffer.
    ///
    /// # Errors
    /// The verification's failure (the caller drops the record).
    fn settle_read(
        &mut self,
        tag: u64,
        key: BlockKey,
        buf: AlignedBuf,
        generation: u64,
        payload_len: u64,
    ) -> Result<(), IoFailure> {
        match self.verify_read(&buf, &key, generation, payload_len) {
            Ok((slots, payload)) => {
                self.counters.read_blocks += 1;
                self.counters.read_bytes += payload_len;
                let block = ReadBlock { buf, payload, slots, generation };
                self.events.push(TierEvent::Read { tag, key, result: Ok(block) });
                Ok(())
            }
            Err(e) => {
                self.counters.verify_failures += 1;
                tracing::warn!(error = %e, "disk tier: a record read does not verify; it is dropped");
                let f = IoFailure::Verify(e);
                self.events.push(TierEvent::Read { tag, key, result: Err(f.clone()) });
                self.recycle(buf);
                Err(f)
            }
        }
    }

    /// The record in `buf` checked against the index's identity of `key`
    /// (C17): its slot sums and where its payload lies in `buf`.
    fn verify_read(
        &self,
        buf: &AlignedBuf,
        key: &BlockKey,
        generation: u64,
        payload_len: u64,
    ) -> Result<(Vec<SlotSum>, Range<usize>), FormatError> {
        if canary::active(Canary::C17DiskReadUnverified) {
            // The canary: trust the index and the header, hand out the
            // bytes where the payload should be (with the header's slot
            // sums, so the engine stages them) without checking them.
            let (start, slots) =
                format::decode_header(buf.as_slice()).map_or((0, Vec::new()), |h| (h.header_area() as usize, h.slots));
            let end = (start + payload_len as usize).min(buf.len());
            return Ok((slots, start.min(end)..end));
        }
        let expect = Expect { key, generation, payload_len };
        format::verify_record(buf.as_slice(), Some(expect)).map(|(h, r)| (h.slots, r))
    }

    /// Submits what waits, collects completions (with `wait`, blocks until
    /// at least one arrives when any operation is in flight) and returns
    /// the events since the last poll.
    ///
    /// # Errors
    /// The backend's [`Errno`] when it cannot be waited on; the tier's
    /// operations in it then never complete.
    pub fn poll(&mut self, wait: bool) -> Result<Vec<TierEvent>, Errno> {
        self.pump();
        let mut done = Vec::new();
        if self.io.in_flight() > 0 || !wait {
            self.io.reap(wait && self.io.in_flight() > 0, &mut done)?;
        }
        for c in done {
            self.complete(c);
        }
        self.pump();
        Ok(std::mem::take(&mut self.events))
    }

    /// Polls (waiting) until no operation of the tier is pending; returns
    /// every event.
    ///
    /// # Errors
    /// As [`poll`](Self::poll).
    pub fn drain(&mut self) -> Result<Vec<TierEvent>, Errno> {
        let mut all = Vec::new();
        while !self.ops.is_empty() {
            all.extend(self.poll(true)?);
        }
        all.extend(std::mem::take(&mut self.events));
        Ok(all)
    }

    // ---- internals -----------------------------------------------------

    fn bump(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn touch(&mut self, key: &BlockKey) {
        let tick = self.bump();
        if let Some(e) = self.index.get_mut(key) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, key.clone());
        }
    }

    fn take_buf(&mut self, len: usize) -> Result<AlignedBuf, BufError> {
        // The smallest spare that fits (a capacity's list is never left
        // empty in the map).
        let fits = self.spare.range(len..).next().map(|(c, _)| *c);
        if let Some(cap) = fits {
            let (buf, emptied) = match self.spare.get_mut(&cap) {
                Some(l) => (l.pop(), l.is_empty()),
                None => (None, false),
            };
            if emptied {
                self.spare.remove(&cap);
            }
            if let Some(mut b) = buf {
                self.spare_count -= 1;
                b.set_len(len)?;
                return Ok(b);
            }
        }
        AlignedBuf::new(len)
    }

    /// Records an operation and builds it; returns its tag (the operation
    /// waits in `built` until [`pump`](Self::pump) submits it).
    fn issue(
        &mut self,
        kind: IoKind,
        key: BlockKey,
        offset: u64,
        generation: u64,
        payload_len: u64,
        buf: AlignedBuf,
    ) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        *self.pins.entry(offset).or_insert(0) += 1;
        self.ops.insert(
            tag,
            Pending { kind, key, offset, len: buf.len(), generation, payload_len, addr: buf.addr(), submitted: false },
        );
        self.built.insert(tag, IoOp { tag, kind, offset, buf });
        tag
    }

    /// Hands waiting operations to the backend while it takes them (reads
    /// first; a write only while fewer than `device_writes_max` are at the
    /// backend).
    fn pump(&mut self) {
        while self.io.in_flight() < self.io.queue_depth() {
            let Some(&tag) = self.waiting.front() else { break };
            let is_write = self.built.get(&tag).is_some_and(|op| op.kind == IoKind::Write);
            if is_write && self.device_writes >= self.device_writes_max {
                break;
            }
            self.waiting.pop_front();
            let Some(op) = self.built.remove(&tag) else {
                self.counters.internal_errors += 1;
                continue;
            };
            let res = self.io.submit(op);
            if res.is_ok() {
                if let Some(p) = self.ops.get_mut(&tag) {
                    p.submitted = true;
                }
                if is_write {
                    self.device_writes += 1;
                }
            }
            if let Err(r) = res {
                if matches!(r.error, SubmitError::QueueFull { .. }) {
                    self.built.insert(tag, r.op);
                    self.waiting.push_front(tag);
                    break;
                }
                self.fail(tag, r.op.buf, IoFailure::Submit(r.error));
            }
        }
    }

    /// Finds room for `need` bytes, evicting LRU records no operation
    /// uses; `None` when the bounded scan found none to evict.
    fn make_room(&mut self, need: u64) -> Option<u64> {
        loop {
            if let Some(off) = self.space.alloc(need) {
                return Some(off);
            }
            let victim = self
                .lru
                .iter()
                .take(EVICTION_SCAN_MAX)
                .map(|(_, k)| k)
                .find(|k| self.index.get(*k).is_some_and(|e| e.written && !self.pins.contains_key(&e.offset)))
                .cloned()?;
            let e = self.index.remove(&victim)?;
            self.lru.remove(&e.tick);
            self.free_space(e.offset, e.record_len);
            self.counters.evicted += 1;
            self.events.push(TierEvent::Removed { key: victim, generation: e.generation, why: Removal::Evicted });
        }
    }

    /// Bookkeeping of an operation that ended: a write the backend had
    /// leaves the device's count.
    fn left_device(&mut self, p: &Pending) {
        if p.submitted && p.kind == IoKind::Write {
            self.device_writes = self.device_writes.saturating_sub(1);
        }
    }

    fn free_space(&mut self, offset: u64, len: u64) {
        if self.pins.contains_key(&offset) {
            self.doomed.insert(offset, len);
            return;
        }
        if let Err(e) = self.space.free(offset, len) {
            self.counters.internal_errors += 1;
            tracing::error!(offset, len, error = %e, "disk tier: freeing a record's space failed (a bug)");
        }
    }

    fn unpin(&mut self, offset: u64) {
        let left = match self.pins.get_mut(&offset) {
            Some(n) => {
                *n -= 1;
                *n
            }
            None => {
                self.counters.internal_errors += 1;
                return;
            }
        };
        if left == 0 {
            self.pins.remove(&offset);
            if let Some(len) = self.doomed.remove(&offset) {
                self.free_space(offset, len);
            }
        }
    }

    /// Drops `key`'s record if it is still the one of `generation`.
    fn drop_record(&mut self, key: &BlockKey, generation: u64, why: Removal) {
        let same = self.index.get(key).is_some_and(|e| e.generation == generation);
        if !same {
            return;
        }
        if let Some(e) = self.index.remove(key) {
            self.lru.remove(&e.tick);
            self.free_space(e.offset, e.record_len);
            self.events.push(TierEvent::Removed { key: key.clone(), generation, why });
        }
    }

    fn complete(&mut self, c: Completion) {
        let Some(p) = self.ops.get(&c.tag) else {
            self.counters.stale_completions += 1;
            tracing::debug!(tag = c.tag, "disk tier: completion of a tag not in flight, ignored");
            return;
        };
        if p.kind != c.kind || p.offset != c.offset || p.addr != c.buf.addr() || p.len != c.buf.len() {
            self.counters.misdirected_completions += 1;
            tracing::warn!(
                tag = c.tag,
                "disk tier: completion for the wrong buffer or operation; the record is dropped"
            );
            // The buffer is another operation's: never reused, never read.
            let tag = c.tag;
            drop(c);
            self.fail_without_buf(tag, IoFailure::Misdirected);
            return;
        }
        let failure = match c.result {
            Err(e) => Some(IoFailure::Os(e)),
            Ok(n) if n != p.len => Some(IoFailure::Short { done: n, len: p.len }),
            Ok(_) => None,
        };
        if let Some(f) = failure {
            self.fail(c.tag, c.buf, f);
            return;
        }
        let Some(p) = self.ops.remove(&c.tag) else { return };
        self.left_device(&p);
        self.unpin(p.offset);
        match p.kind {
            IoKind::Write => {
                self.writes_pending -= 1;
                match self.index.get_mut(&p.key) {
                    Some(e) if e.generation == p.generation => {
                        e.written = true;
                        self.counters.written_blocks += 1;
                        self.counters.written_bytes += p.payload_len;
                        self.events.push(TierEvent::Written { key: p.key.clone(), generation: p.generation });
                        // Reads that waited for this write: served from
                        // the buffer it wrote.
                        for r in self.after_write.remove(&c.tag).unwrap_or_default() {
                            match self.read_from_write(r.tag, r.key, r.buf, &c.buf, p.generation, p.payload_len) {
                                Ok(()) => self.counters.after_write_reads += 1,
                                Err(f) => self.drop_record(&p.key, p.generation, Removal::ReadFailed(f)),
                            }
                        }
                    }
                    _ => {
                        self.counters.internal_errors += 1;
                        self.fail_reads_after(c.tag, &IoFailure::Internal);
                    }
                }
                self.recycle(c.buf);
            }
            IoKind::Read => {
                if let Err(f) = self.settle_read(c.tag, p.key.clone(), c.buf, p.generation, p.payload_len) {
                    self.drop_record(&p.key, p.generation, Removal::ReadFailed(f));
                }
            }
        }
    }

    /// An operation failed with its own buffer back.
    fn fail(&mut self, tag: u64, buf: AlignedBuf, f: IoFailure) {
        self.fail_without_buf(tag, f);
        self.recycle(buf);
    }

    fn fail_without_buf(&mut self, tag: u64, f: IoFailure) {
        let Some(p) = self.ops.remove(&tag) else { return };
        self.left_device(&p);
        self.unpin(p.offset);
        match p.kind {
            IoKind::Write => {
                self.writes_pending -= 1;
                self.counters.write_failed += 1;
                self.fail_reads_after(tag, &f);
                if f == IoFailure::Os(ENOSPC) {
                    self.counters.write_enospc += 1;
                    tracing::warn!("disk tier: the device is out of space (ENOSPC); the block is dropped");
                }
                self.drop_record(&p.key, p.generation, Removal::WriteFailed(f));
            }
            IoKind::Read => {
                self.counters.read_failed += 1;
                self.events.push(TierEvent::Read { tag, key: p.key.clone(), result: Err(f.clone()) });
                self.drop_record(&p.key, p.generation, Removal::ReadFailed(f));
            }
        }
    }

    /// Fails every read waiting for write `write_tag` with `f`.
    fn fail_reads_after(&mut self, write_tag: u64, f: &IoFailure) {
        for r in self.after_write.remove(&write_tag).unwrap_or_default() {
            self.counters.read_failed += 1;
            self.events.push(TierEvent::Read { tag: r.tag, key: r.key, result: Err(f.clone()) });
            self.recycle(r.buf);
        }
    }

    // ---- recovery ------------------------------------------------------

    /// One synchronous operation (recovery only): submit and wait for its
    /// completion. Another tag's completion cannot arrive (nothing else is
    /// in flight); a stale one is ignored.
    fn sync_read(&mut self, offset: u64, buf: AlignedBuf) -> Result<(AlignedBuf, Result<usize, IoFailure>), TierError> {
        let tag = self.next_tag;
        self.next_tag += 1;
        let addr = buf.addr();
        if let Err(r) = self.io.submit(IoOp { tag, kind: IoKind::Read, offset, buf }) {
            return Ok((r.op.buf, Err(IoFailure::Submit(r.error))));
        }
        let mut out = Vec::new();
        let timeout = std::time::Duration::from_millis(DISK_RECOVERY_READ_TIMEOUT_MS);
        let t0 = std::time::Instant::now();
        loop {
            if self.io.reap_within(timeout, &mut out).map_err(TierError::Backend)? == 0 && self.io.in_flight() > 0 {
                let waited_ms = t0.elapsed().as_millis() as u64;
                return Err(TierError::RecoveryStalled { offset, waited_ms });
            }
            let mut mine = None;
            for c in out.drain(..) {
                if c.tag == tag && mine.is_none() {
                    mine = Some(c);
                } else {
                    self.counters.stale_completions += 1;
                }
            }
            if let Some(c) = mine {
                if c.buf.addr() != addr || c.offset != offset || c.kind != IoKind::Read {
                    self.counters.misdirected_completions += 1;
                    return Ok((c.buf, Err(IoFailure::Misdirected)));
                }
                let len = c.buf.len();
                let r = match c.result {
                    Ok(n) if n == len => Ok(n),
                    Ok(n) => Err(IoFailure::Short { done: n, len }),
                    Err(e) => Err(IoFailure::Os(e)),
                };
                return Ok((c.buf, r));
            }
            if self.io.in_flight() == 0 {
                // The completion never came (a broken backend): give up
                // on this range.
                let b = AlignedBuf::new(DISK_ALIGN_BYTES as usize)?;
                return Ok((b, Err(IoFailure::Misdirected)));
            }
        }
    }

    fn recover(&mut self) -> Result<Recovery, TierError> {
        let cap = self.space.capacity();
        let page = DISK_ALIGN_BYTES;
        let mut rec = Recovery::default();
        // (generation, offset, record_len, header)
        let mut found: Vec<(u64, u64, u64, RecordHeader)> = Vec::new();
        let mut chunk: Option<(u64, AlignedBuf, u64)> = None; // (start, buf, valid bytes)
        let mut pos = 0u64;
        while pos < cap {
            let in_chunk = chunk.as_ref().is_some_and(|(s, _, v)| pos >= *s && pos + page <= s + v);
            if !in_chunk {
                // What was never written holds no record: skip to where
                // data starts (a record starts inside data, on a page).
                match self.io.next_data(pos) {
                    None => {
                        rec.skipped_bytes += cap - pos;
                        break;
                    }
                    Some(d) if d & !(page - 1) > pos => {
                        rec.skipped_bytes += (d & !(page - 1)).min(cap) - pos;
                        pos = d & !(page - 1);
                        continue;
                    }
                    Some(_) => {}
                }
                let len = DISK_RECOVERY_CHUNK_BYTES.min(cap - pos);
                let buf = match chunk.take() {
                    Some((_, mut b, _)) if b.capacity() >= len as usize => {
                        b.set_len(len as usize)?;
                        b
                    }
                    _ => AlignedBuf::new(len as usize)?,
                };
                let (buf, r) = self.sync_read(pos, buf)?;
                let valid = match r {
                    Ok(n) => n as u64,
                    Err(IoFailure::Short { done, .. }) => {
                        self.counters.recovery_io_errors += 1;
                        (done as u64) & !(page - 1)
                    }
                    Err(_) => {
                        self.counters.recovery_io_errors += 1;
                        0
                    }
                };
                rec.scanned_bytes += valid;
                if valid == 0 {
                    // Skip the range this read covered.
                    pos += len;
                    chunk = Some((pos, buf, 0));
                    continue;
                }
                chunk = Some((pos, buf, valid));
            }
            let Some((start, buf, valid)) = chunk.as_ref() else { break };
            let (start, valid) = (*start, *valid);
            let here = (pos - start) as usize;
            let window = buf.as_slice().get(here..valid as usize).unwrap_or(&[]);
            match format::decode_header(window) {
                Err(FormatError::BadMagic { .. }) => {}
                Err(FormatError::Truncated { .. }) if start != pos && start + valid < cap => {
                    // The header runs past this chunk: read from here.
                    chunk = None;
                    continue;
                }
                Err(_) => rec.rejected += 1,
                Ok(h) => {
                    let rl = h.record_len();
                    let fits = pos.checked_add(rl).is_some_and(|end| end <= cap);
                    let ok = if !fits {
                        false
                    } else if pos + rl <= start + valid {
                        let bytes = window.get(..rl as usize).unwrap_or(&[]);
                        self.recovery_verifies(bytes) && trace_recovered(bytes)
                    } else {
                        let b = self.take_buf(rl as usize)?;
                        let (b, r) = self.sync_read(pos, b)?;
                        let ok = r.is_ok() && self.recovery_verifies(b.as_slice()) && trace_recovered(b.as_slice());
                        if r.is_err() {
                            self.counters.recovery_io_errors += 1;
                        }
                        self.recycle(b);
                        ok
                    };
                    if ok {
                        found.push((h.generation, pos, rl, h));
                    } else {
                        rec.rejected += 1;
                    }
                }
            }
            pos += page;
        }
        // Newest first; drop repeats of a key and overlaps.
        found.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut kept: Vec<(u64, u64, u64, RecordHeader)> = Vec::new();
        for (generation, offset, rl, h) in found {
            self.next_generation = self.next_generation.max(generation + 1);
            if self.index.contains_key(&h.key) {
                rec.superseded += 1;
                continue;
            }
            if !self.space.reserve(offset, rl) {
                rec.rejected += 1;
                continue;
            }
            self.index.insert(
                h.key.clone(),
                Entry {
                    offset,
                    record_len: rl,
                    read_len: rl,
                    generation,
                    payload_len: h.payload_len,
                    tick: 0,
                    written: true,
                    write_tag: 0,
                },
            );
            kept.push((generation, offset, rl, h));
        }
        kept.reverse();
        for (generation, _, _, h) in kept {
            let tick = self.bump();
            if let Some(e) = self.index.get_mut(&h.key) {
                e.tick = tick;
            }
            self.lru.insert(tick, h.key.clone());
            rec.blocks.push(RecoveredBlock { key: h.key, generation, payload_len: h.payload_len });
        }
        self.counters.recovered = rec.blocks.len() as u64;
        self.counters.recovery_rejected = rec.rejected;
        self.counters.recovery_superseded = rec.superseded;
        Ok(rec)
    }

    fn recovery_verifies(&self, bytes: &[u8]) -> bool {
        if canary::active(Canary::C18RecoverUnverified) {
            // The canary: a header that decodes is enough.
            return format::decode_header(bytes).is_ok();
        }
        format::verify_record(bytes, None).is_ok()
    }
}
