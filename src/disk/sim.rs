//! The simulated disk: an in-memory file behind [`DiskIo`] with faults
//! drawn from a seeded RNG, for the simulator (`cfg(madsim)`) and the unit
//! tests alike. No thread, no OS call and no wall-clock time: a logical
//! clock advances by one tick on every [`reap`](DiskIo::reap) and jumps to
//! the next due operation on a waiting one, so a seed fixes every
//! schedule.
//!
//! # Faults ([`SimFaults`], each a per-operation probability)
//!
//! - short reads and writes (a sector-aligned prefix moves, the count says
//!   so; a short read scribbles over the rest of the buffer);
//! - `EIO` on reads and writes (a failed write may have moved a prefix);
//!   `ENOSPC` on writes (nothing moved);
//! - silent corruption: one bit flipped in what a read returns, or in what
//!   a write leaves on the medium, with a count of `Ok(len)`;
//! - slow operations (a latency 50–200 ticks instead of 1–4);
//! - reordered completions (a reap hands its batch out shuffled);
//! - stale completions (a completion delivered again later, for a tag
//!   that already completed, carrying a junk buffer);
//! - misdirected completions (two completions of one batch swap their
//!   buffers);
//! - torn writes across a crash ([`SimDisk::crash`]): every write still in
//!   flight leaves a random subset of its 512-byte sectors on the medium.
//!
//! A write reaches the medium at the first reap after it became due (its
//! completion may still wait to be handed out), so a crash after that
//! keeps it whole even if nobody collected its completion.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::buf::AlignedBuf;
use super::io::{BackendKind, Completion, DiskIo, EIO, ENOSPC, Errno, IoKind, IoOp, Refused, check_op};

/// Bytes of one simulated sector: the unit a short or torn write moves.
pub const SIM_SECTOR_BYTES: usize = 512;

/// Bytes of one simulated file-system block: the unit in which the disk
/// remembers what was ever written, as `SEEK_DATA` reports data.
pub const SIM_DATA_GRANULE_BYTES: usize = 4096;

/// Per-operation fault probabilities (each `0.0..=1.0`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimFaults {
    /// A read moves a sector-aligned prefix and says so.
    pub short_read: f64,
    /// A write moves a sector-aligned prefix and says so.
    pub short_write: f64,
    /// A read fails with `EIO`.
    pub eio_read: f64,
    /// A write fails with `EIO` (after moving a random prefix).
    pub eio_write: f64,
    /// A write fails with `ENOSPC` (nothing moved).
    pub enospc_write: f64,
    /// A read returns `Ok(len)` with one bit flipped.
    pub corrupt_read: f64,
    /// A write returns `Ok(len)` but one bit flips on the medium.
    pub corrupt_write: f64,
    /// An operation takes 50–200 ticks instead of 1–4.
    pub slow: f64,
    /// A reap's batch comes out shuffled (per reap).
    pub reorder: f64,
    /// A completion is delivered once more, later, with a junk buffer.
    pub stale: f64,
    /// Two completions of one batch swap their buffers (per reap).
    pub misdirect: f64,
}

impl SimFaults {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// A fault mix drawn from `rng`: each kind on with probability 1/2, at
    /// a rate of 1–10 %. `silent` allows the silent-corruption kinds.
    pub fn random(rng: &mut impl Rng, silent: bool) -> Self {
        let mut p = |on: bool| if on && rng.random_bool(0.5) { rng.random_range(0.01..0.10) } else { 0.0 };
        Self {
            short_read: p(true),
            short_write: p(true),
            eio_read: p(true),
            eio_write: p(true),
            enospc_write: p(true),
            corrupt_read: p(silent),
            corrupt_write: p(silent),
            slow: p(true),
            reorder: p(true) * 5.0,
            stale: p(true),
            misdirect: p(true),
        }
    }
}

/// What the simulated disk did, by kind (counts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Operations completed (count).
    pub ops: u64,
    /// Short reads and writes injected.
    pub short: u64,
    /// `EIO` and `ENOSPC` injected.
    pub errors: u64,
    /// Bits flipped (reads and writes).
    pub corrupted: u64,
    /// Stale completions delivered.
    pub stale: u64,
    /// Buffer swaps.
    pub misdirected: u64,
    /// Reaps whose batch was shuffled.
    pub reordered: u64,
    /// Writes torn by a crash.
    pub torn: u64,
}

struct Flight {
    due: u64,
    seq: u64,
    op: IoOp,
}

/// An in-memory file with seeded faults; see the module doc.
pub struct SimDisk {
    medium: Vec<u8>,
    /// Per [`SIM_DATA_GRANULE_BYTES`] of the medium: whether any byte of
    /// it was ever written (torn and short writes included) — what a file
    /// system's `SEEK_DATA` tells apart from holes ([`DiskIo::next_data`]).
    written: Vec<bool>,
    depth: usize,
    rng: SmallRng,
    faults: SimFaults,
    now: u64,
    seq: u64,
    flights: Vec<Flight>,
    /// Completions whose effect happened (due), not yet handed out.
    done: VecDeque<Completion>,
    /// Completions to deliver again (tag, kind, offset, due).
    stale: Vec<(u64, IoKind, u64, u64)>,
    stats: SimStats,
    /// While set, no fault is injected whatever the mix (see
    /// [`SimDisk::heal_switch`]).
    healed: Arc<AtomicBool>,
    /// While set, nothing completes (see [`SimDisk::stall_switch`]).
    stalled: Arc<AtomicBool>,
}

impl SimDisk {
    /// A zeroed file of `capacity` bytes (rounded down to the alignment)
    /// taking up to `depth` operations at once, faults off, RNG seeded by
    /// `seed`.
    pub fn new(capacity: u64, depth: usize, seed: u64) -> Self {
        let cap = capacity & !(crate::limits::DISK_ALIGN_BYTES - 1);
        let healed = Arc::new(AtomicBool::new(false));
        let medium = (vec![0; cap as usize], vec![false; (cap as usize).div_ceil(SIM_DATA_GRANULE_BYTES)]);
        Self::over(medium, depth.max(1), SmallRng::seed_from_u64(seed), SimStats::default(), healed)
    }

    /// A switch that, once set, stops every fault of this disk (and of the
    /// disks [`crash`](Self::crash) makes of it) while an engine holds it:
    /// the simulator's liveness phase heals the disk through it.
    pub fn heal_switch(&self) -> Arc<AtomicBool> {
        self.healed.clone()
    }

    /// A switch that, while set, completes nothing: a reap hands out no
    /// completion and the disk's clock stands still (a device that hangs;
    /// tests hold operations in flight through it). Operations are still
    /// taken up to the depth. A disk [`crash`](Self::crash) makes has a
    /// switch of its own, unset.
    pub fn stall_switch(&self) -> Arc<AtomicBool> {
        self.stalled.clone()
    }

    /// A disk over `medium` with nothing in flight and faults off.
    fn over(
        (medium, written): (Vec<u8>, Vec<bool>),
        depth: usize,
        rng: SmallRng,
        stats: SimStats,
        healed: Arc<AtomicBool>,
    ) -> Self {
        Self {
            medium,
            written,
            depth,
            rng,
            faults: SimFaults::none(),
            now: 0,
            seq: 0,
            flights: Vec::new(),
            done: VecDeque::new(),
            stale: Vec::new(),
            stats,
            healed,
            stalled: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Sets the fault mix from now on.
    pub fn set_faults(&mut self, f: SimFaults) {
        self.faults = f;
    }

    /// What was injected so far.
    pub fn stats(&self) -> &SimStats {
        &self.stats
    }

    /// The medium's bytes (what a restart would find).
    pub fn medium(&self) -> &[u8] {
        &self.medium
    }

    /// The medium's bytes, writable (tests damage records directly).
    pub fn medium_mut(&mut self) -> &mut [u8] {
        &mut self.medium
    }

    /// The process dies: every operation not yet due is cut short — a
    /// write leaves a random subset of its sectors on the medium (possibly
    /// none, possibly all), a read leaves nothing — and every completion
    /// not yet reaped is lost. Returns a fresh disk over the same medium
    /// (no operation in flight, faults off, the RNG continuing), as a
    /// restarted process would open it.
    pub fn crash(mut self) -> SimDisk {
        let flights = std::mem::take(&mut self.flights);
        for f in flights {
            if f.op.kind == IoKind::Write {
                self.stats.torn += 1;
                let src = f.op.buf.as_slice();
                let base = f.op.offset as usize;
                for (i, sector) in src.chunks(SIM_SECTOR_BYTES).enumerate() {
                    if self.rng.random_bool(0.5) {
                        self.land(base + i * SIM_SECTOR_BYTES, sector);
                    }
                }
            }
        }
        let rng = SmallRng::seed_from_u64(self.rng.random());
        let medium = (std::mem::take(&mut self.medium), std::mem::take(&mut self.written));
        SimDisk::over(medium, self.depth, rng, std::mem::take(&mut self.stats), self.healed)
    }

    /// Puts `bytes` on the medium at `at`, remembering their granules as
    /// written.
    fn land(&mut self, at: usize, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.medium[at..at + bytes.len()].copy_from_slice(bytes);
        let (first, last) = (at / SIM_DATA_GRANULE_BYTES, (at + bytes.len() - 1) / SIM_DATA_GRANULE_BYTES);
        self.written[first..=last].fill(true);
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && !self.healed.load(Ordering::Relaxed) && self.rng.random_bool(p.min(1.0))
    }

    /// A sector-aligned count in `0..len` (strictly short).
    fn short_count(&mut self, len: usize) -> usize {
        let sectors = len / SIM_SECTOR_BYTES;
        self.rng.random_range(0..sectors.max(1)) * SIM_SECTOR_BYTES
    }

    /// Performs a due operation on the medium and queues its completion.
    fn perform(&mut self, mut op: IoOp) {
        self.stats.ops += 1;
        let len = op.buf.len();
        let at = op.offset as usize;
        let result = match op.kind {
            IoKind::Read => {
                if self.chance(self.faults.eio_read) {
                    self.stats.errors += 1;
                    let junk: u8 = self.rng.random();
                    op.buf.as_mut_slice().fill(junk);
                    Err(EIO)
                } else if self.chance(self.faults.short_read) {
                    self.stats.short += 1;
                    let n = self.short_count(len);
                    let junk: u8 = self.rng.random();
                    let s = op.buf.as_mut_slice();
                    s[..n].copy_from_slice(&self.medium[at..at + n]);
                    s[n..].fill(junk);
                    Ok(n)
                } else {
                    op.buf.as_mut_slice().copy_from_slice(&self.medium[at..at + len]);
                    if self.chance(self.faults.corrupt_read) {
                        self.stats.corrupted += 1;
                        let bit = self.rng.random_range(0..len * 8);
                        op.buf.as_mut_slice()[bit / 8] ^= 1 << (bit % 8);
                    }
                    Ok(len)
                }
            }
            IoKind::Write => {
                if self.chance(self.faults.enospc_write) {
                    self.stats.errors += 1;
                    Err(ENOSPC)
                } else if self.chance(self.faults.eio_write) {
                    self.stats.errors += 1;
                    let n = self.short_count(len);
                    self.land(at, &op.buf.as_slice()[..n]);
                    Err(EIO)
                } else if self.chance(self.faults.short_write) {
                    self.stats.short += 1;
                    let n = self.short_count(len);
                    self.land(at, &op.buf.as_slice()[..n]);
                    Ok(n)
                } else {
                    self.land(at, op.buf.as_slice());
                    if self.chance(self.faults.corrupt_write) {
                        self.stats.corrupted += 1;
                        let bit = self.rng.random_range(0..len * 8);
                        self.medium[at + bit / 8] ^= 1 << (bit % 8);
                    }
                    Ok(len)
                }
            }
        };
        if self.chance(self.faults.stale) {
            let later = self.now + self.rng.random_range(1..20);
            self.stale.push((op.tag, op.kind, op.offset, later));
        }
        self.done.push_back(Completion { tag: op.tag, kind: op.kind, offset: op.offset, buf: op.buf, result });
    }

    /// Performs every operation due by `now` (in due order) and every
    /// stale delivery due by then.
    fn advance(&mut self) {
        self.flights.sort_by_key(|f| (f.due, f.seq));
        let due = self.flights.iter().take_while(|f| f.due <= self.now).count();
        let ready: Vec<Flight> = self.flights.drain(..due).collect();
        for f in ready {
            self.perform(f.op);
        }
        let now = self.now;
        let mut i = 0;
        while i < self.stale.len() {
            if self.stale[i].3 <= now {
                let (tag, kind, offset, _) = self.stale.swap_remove(i);
                if let Ok(mut buf) = AlignedBuf::new(crate::limits::DISK_ALIGN_BYTES as usize) {
                    let junk: u8 = self.rng.random();
                    buf.as_mut_slice().fill(junk);
                    let len = buf.len();
                    self.stats.stale += 1;
                    self.done.push_back(Completion { tag, kind, offset, buf, result: Ok(len) });
                }
            } else {
                i += 1;
            }
        }
    }
}

impl DiskIo for SimDisk {
    fn kind(&self) -> BackendKind {
        BackendKind::Sim
    }

    fn capacity(&self) -> u64 {
        self.medium.len() as u64
    }

    fn queue_depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.flights.len() + self.done.len()
    }

    fn submit(&mut self, op: IoOp) -> Result<(), Refused> {
        if let Err(error) = check_op(&op, self.capacity(), self.in_flight(), self.depth) {
            return Err(Refused { error, op });
        }
        let slow = self.chance(self.faults.slow);
        let latency = if slow { self.rng.random_range(50..=200) } else { self.rng.random_range(1..=4) };
        self.seq += 1;
        self.flights.push(Flight { due: self.now + latency, seq: self.seq, op });
        Ok(())
    }

    /// Where data may start at or after `from`: `from` inside a granule
    /// ever written, else the start of the next such granule, `None` past
    /// the last — as `lseek(SEEK_DATA)` on a file whose unwritten blocks
    /// are holes, so recovery in the simulator skips them as on a real
    /// file.
    fn next_data(&self, from: u64) -> Option<u64> {
        let g = usize::try_from(from).ok()? / SIM_DATA_GRANULE_BYTES;
        let next = g + self.written.get(g..)?.iter().position(|&w| w)?;
        Some(from.max((next * SIM_DATA_GRANULE_BYTES) as u64))
    }

    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> Result<usize, Errno> {
        if self.stalled.load(Ordering::Relaxed) {
            return Ok(0);
        }
        self.now += 1;
        self.advance();
        if wait && self.done.is_empty() {
            let next = self.flights.iter().map(|f| f.due).chain(self.stale.iter().map(|s| s.3)).min();
            if let Some(t) = next {
                self.now = self.now.max(t);
                self.advance();
            }
        }
        let mut batch: Vec<Completion> = self.done.drain(..).collect();
        if batch.len() > 1 && self.chance(self.faults.reorder) {
            self.stats.reordered += 1;
            for i in (1..batch.len()).rev() {
                let j = self.rng.random_range(0..=i);
                batch.swap(i, j);
            }
        }
        if batch.len() > 1 && self.chance(self.faults.misdirect) {
            self.stats.misdirected += 1;
            let i = self.rng.random_range(0..batch.len());
            let j = (i + 1 + self.rng.random_range(0..batch.len() - 1)) % batch.len();
            let (a, b) = (i.min(j), i.max(j));
            let (left, right) = batch.split_at_mut(b);
            std::mem::swap(&mut left[a].buf, &mut right[0].buf);
        }
        let n = batch.len();
        out.extend(batch);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(tag: u64, kind: IoKind, offset: u64, fill: u8) -> IoOp {
        let mut buf = AlignedBuf::new(8192).unwrap();
        buf.as_mut_slice().fill(fill);
        IoOp { tag, kind, offset, buf }
    }

    #[test]
    fn writes_then_reads_back() {
        let mut d = SimDisk::new(1 << 20, 4, 1);
        d.submit(op(1, IoKind::Write, 4096, 0xab)).unwrap();
        let mut out = Vec::new();
        d.reap(true, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].result, Ok(8192));
        d.submit(op(2, IoKind::Read, 4096, 0)).unwrap();
        out.clear();
        d.reap(true, &mut out).unwrap();
        assert_eq!(out[0].tag, 2);
        assert!(out[0].buf.as_slice().iter().all(|&b| b == 0xab));
        assert_eq!(d.in_flight(), 0);
    }

    #[test]
    fn refuses_bad_ops() {
        let mut d = SimDisk::new(1 << 20, 1, 1);
        let e = d.submit(op(1, IoKind::Read, 100, 0)).unwrap_err();
        assert!(matches!(e.error, super::super::io::SubmitError::Unaligned { offset: 100, .. }));
        let e = d.submit(op(1, IoKind::Read, (1 << 20) - 4096, 0)).unwrap_err();
        assert!(matches!(e.error, super::super::io::SubmitError::OutOfRange { .. }));
        d.submit(op(1, IoKind::Read, 0, 0)).unwrap();
        let e = d.submit(op(2, IoKind::Read, 0, 0)).unwrap_err();
        assert!(matches!(e.error, super::super::io::SubmitError::QueueFull { depth: 1 }));
        assert_eq!(e.op.tag, 2, "the op comes back");
    }

    /// `next_data` answers as `SEEK_DATA` on a file whose unwritten blocks
    /// are holes: nothing on a fresh disk; a written range's granules are
    /// data (from its first granule's start, or `from` inside it), the
    /// rest is not; what a crash tears onto the medium counts as written.
    #[test]
    fn next_data_skips_what_was_never_written() {
        let g = SIM_DATA_GRANULE_BYTES as u64;
        let mut d = SimDisk::new(1 << 20, 4, 1);
        assert_eq!(d.next_data(0), None);
        d.submit(op(1, IoKind::Write, 16 * g, 0xab)).unwrap(); // 8 KiB: granules 16 and 17
        let mut out = Vec::new();
        d.reap(true, &mut out).unwrap();
        assert_eq!(d.next_data(0), Some(16 * g));
        assert_eq!(d.next_data(16 * g + 100), Some(16 * g + 100));
        assert_eq!(d.next_data(17 * g + 5), Some(17 * g + 5));
        assert_eq!(d.next_data(18 * g), None);
        assert_eq!(d.next_data(u64::MAX), None);
        // A write torn by a crash: over seeds, some leave data behind.
        let torn = (0..32).any(|seed| {
            let mut d = SimDisk::new(1 << 20, 4, seed);
            d.submit(op(1, IoKind::Write, 64 * g, 0xcd)).unwrap();
            let d = d.crash();
            d.next_data(0) == Some(64 * g) || d.next_data(0) == Some(65 * g)
        });
        assert!(torn);
        let d = SimDisk::new(1 << 20, 4, 2).crash();
        assert_eq!(d.next_data(0), None, "a crash with nothing in flight writes nothing");
    }

    /// A crash tears in-flight writes sector by sector: over many seeds
    /// some leave nothing, some a part, some everything.
    #[test]
    fn crash_tears_in_flight_writes() {
        let (mut none, mut part, mut all) = (0, 0, 0);
        for seed in 0..64 {
            let mut d = SimDisk::new(1 << 20, 4, seed);
            d.submit(op(1, IoKind::Write, 0, 0xcd)).unwrap();
            let d = d.crash();
            let n = d.medium()[..8192].iter().filter(|&&b| b == 0xcd).count();
            match n {
                0 => none += 1,
                8192 => all += 1,
                _ => part += 1,
            }
            assert_eq!(n % SIM_SECTOR_BYTES, 0);
        }
        assert!(part > 0, "none {none} part {part} all {all}");
    }
}
