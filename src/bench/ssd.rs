//! `kvferry bench ssd`: the disk tier's write and read throughput against
//! raw `O_DIRECT` transfers of the same block sizes at the same queue
//! depth, on the same file and backend, measured in the same run: each
//! repetition measures raw (write, read) and tier (write, read) back to
//! back (odd repetitions run the tier first), and the headline ratio is the median
//! over repetitions of each repetition's tier ÷ raw (a virtual or shared
//! disk's speed drifts between repetitions far more than within one); the
//! best of each figure and their ratio are printed too.
//!
//! - raw write: `blocks` writes of `align_up(block)` bytes at consecutive
//!   offsets of the tier's own file (a second descriptor; the same extents
//!   the tier writes), `depth` in flight, from preallocated aligned
//!   buffers;
//! - tier write: `blocks` [`Tier::write`]s of the same blocks (each
//!   checked against its slot checksums, copied into a record buffer
//!   behind its 4 KiB header), a write-behind queue of `depth`, timed until
//!   every write completed;
//! - raw read / tier read: the same, reading back (the tier verifies the
//!   identity and every slot checksum of each record).
//!
//! Throughput counts block bytes only (the tier's headers are its
//! overhead). Ratios are tier ÷ raw; issue 32's target is ≥ 0.9.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use crate::disk::backend::{BackendChoice, backend_over};
use crate::disk::file::{DiskFile, TIER_FILE_NAME, TIER_LOCK_NAME};
use crate::disk::format::{BlockKey, SlotSum};
use crate::disk::io::{DiskIo, IoKind, IoOp};
use crate::disk::tier::{Tier, TierConfig, TierEvent, WriteOutcome, WriteRefused};
use crate::disk::{AlignedBuf, buf::align_up};
use crate::types::BlockHash;

/// Settings of one `bench ssd` run.
#[derive(Debug, Clone)]
pub struct SsdBench<'a> {
    /// Directory on the file system to measure (exists).
    pub dir: &'a Path,
    /// Bytes of the tier file (the raw side runs over the same file).
    pub size: u64,
    /// Bytes per block (payload).
    pub block: u64,
    /// Slots per block (the block is cut into this many checksummed
    /// slots, as a layout's layers).
    pub slots: usize,
    /// Operations in flight (both sides).
    pub depth: usize,
    /// Backend.
    pub backend: BackendChoice,
    /// Repetitions (best of).
    pub reps: usize,
    /// The tier's record alignment ([`TierConfig::record_align`]).
    pub record_align: u64,
}

/// splitmix64's output step, one byte of it: fast, reproducible filler.
fn mix(st: &mut u64) -> u8 {
    *st = st.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *st;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (z ^ (z >> 27)) as u8
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Raw transfers of `n` buffers of `len` bytes, the `i`-th at `i *
/// stride` (the tier's record stride: the same aligned offsets the tier's
/// records start at, so the raw side moves the payload alone with the
/// tier's alignment), `depth` in flight; returns seconds.
fn raw_pass<D: DiskIo>(
    io: &mut D,
    kind: IoKind,
    n: u64,
    (len, stride): (usize, u64),
    bufs: &mut Vec<AlignedBuf>,
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut next = 0u64;
    let mut done = 0u64;
    let mut out = Vec::new();
    while done < n {
        while next < n {
            let Some(buf) = bufs.pop() else { break };
            let op = IoOp { tag: next, kind, offset: next * stride, buf };
            if let Err(r) = io.submit(op) {
                bufs.push(r.op.buf);
                if matches!(r.error, crate::disk::io::SubmitError::QueueFull { .. }) {
                    break;
                }
                return Err(format!("raw {kind:?} submit: {}", r.error));
            }
            next += 1;
        }
        io.reap(true, &mut out).map_err(|e| format!("raw reap: {e}"))?;
        for c in out.drain(..) {
            match c.result {
                Ok(m) if m == len => {}
                Ok(m) => return Err(format!("raw {kind:?}: short transfer {m} of {len} B")),
                Err(e) => return Err(format!("raw {kind:?}: {e}")),
            }
            bufs.push(c.buf);
            done += 1;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// `n` tier writes (block `i` cycles through `payloads`), a write-behind
/// queue's worth in flight, timed until every one completed; seconds.
fn tier_write_pass<D: DiskIo>(
    tier: &mut Tier<D>,
    n: u64,
    payloads: &[(Vec<SlotSum>, Vec<u8>)],
    key: impl Fn(u64) -> BlockKey,
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut i = 0u64;
    let mut written = 0u64;
    while written < n {
        while i < n {
            let (s, b) = &payloads[(i as usize) % payloads.len()];
            match tier.write(&key(i), s, b) {
                Ok(WriteOutcome::Queued { .. }) => i += 1,
                // No write would follow (and no `Written` event): never
                // wait for one.
                Ok(WriteOutcome::AlreadyOnDisk { .. }) => return Err(format!("tier write {i}: key already on disk")),
                Err(WriteRefused::QueueFull { .. }) => break,
                Err(e) => return Err(format!("tier write {i}: {e}")),
            }
        }
        for ev in tier.poll(true).map_err(|e| format!("tier poll: {e}"))? {
            match ev {
                TierEvent::Written { .. } => written += 1,
                TierEvent::Removed { why: crate::disk::tier::Removal::Evicted, .. } => {}
                TierEvent::Removed { why, .. } => return Err(format!("tier write failed: {why:?}")),
                TierEvent::Read { .. } => {}
            }
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// `n` verified tier reads, `depth` in flight; seconds.
fn tier_read_pass<D: DiskIo>(
    tier: &mut Tier<D>,
    n: u64,
    depth: usize,
    key: impl Fn(u64) -> BlockKey,
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut i = 0u64;
    let mut read = 0u64;
    while read < n {
        while i < n && tier.ops_pending() < depth {
            tier.read(&key(i)).map_err(|e| format!("tier read {i}: {e}"))?;
            i += 1;
        }
        for ev in tier.poll(true).map_err(|e| format!("tier poll: {e}"))? {
            if let TierEvent::Read { result, .. } = ev {
                let b = result.map_err(|e| format!("tier read failed: {e}"))?;
                read += 1;
                tier.recycle(b.buf);
            }
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Removes, when dropped, the tier file and lock file of a directory that
/// did not exist before [`Cleanup::of`] (a lock file left by a node stays).
struct Cleanup(Vec<std::path::PathBuf>);

impl Cleanup {
    fn of(dir: &std::path::Path) -> Self {
        Self([TIER_FILE_NAME, TIER_LOCK_NAME].iter().map(|n| dir.join(n)).filter(|p| !p.exists()).collect())
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Runs the benchmark; prints the table and returns it as JSON.
///
/// # Errors
/// Set-up and I/O failures as text (naming the file or the step).
pub fn ssd(a: &SsdBench<'_>) -> Result<serde_json::Value, String> {
    if a.block == 0 {
        return Err("--block must be at least 1 byte (e.g. 2304KiB)".to_string());
    }
    if a.slots == 0 || a.block < a.slots as u64 {
        return Err(format!("--slots {} must be in 1..=--block bytes ({})", a.slots, a.block));
    }
    let slot_len = a.block / a.slots as u64;
    let block = slot_len * a.slots as u64;
    let padded = align_up(block).ok_or("block too large")? as usize;
    // A record: one header page (36 slots fit in it) + the padded payload.
    let unpadded = padded as u64 + crate::limits::DISK_ALIGN_BYTES * (1 + (a.slots as u64 * 8) / 4000);
    let record = crate::disk::tier::padded_record_len(unpadded, a.record_align);
    let unit = crate::disk::tier::record_unit(unpadded, a.record_align);
    let n = (a.size / record).saturating_sub(1).max(1);
    let bytes = n * block;
    // A node's tier (even a stopped one's) is never overwritten: its
    // records would be lost to the benchmark's writes.
    if a.dir.join(TIER_FILE_NAME).exists() {
        return Err(format!(
            "--dir {} already holds a disk tier ({TIER_FILE_NAME}), which the benchmark would overwrite: give it an empty directory",
            a.dir.display()
        ));
    }
    // What this run creates goes when it ends, on every path.
    let _cleanup = Cleanup::of(a.dir);
    let tier_file = DiskFile::open(a.dir, a.size).map_err(|e| e.to_string())?;
    // The raw side writes and reads the tier's own file through a second
    // descriptor (the tier holds the directory's lock), over the same
    // extents the tier uses (a virtual disk's speed differs between files
    // and regions), never between a tier write and its read.
    let raw_file = DiskFile::open_named(a.dir, TIER_FILE_NAME, a.size).map_err(|e| e.to_string())?;
    let mut raw = backend_over(raw_file, a.depth, a.backend).map_err(|e| e.to_string())?;
    let disk = backend_over(tier_file, a.depth, a.backend).map_err(|e| e.to_string())?;
    let backend = disk.kind();
    let (mut tier, _) =
        Tier::open(disk, TierConfig { write_queue_max: a.depth, record_align: a.record_align, read_slots: 0 })
            .map_err(|e| format!("tier open: {e}"))?;
    outln!(
        "bench ssd: {} in {}, {n} blocks of {block} B ({} slots), queue depth {}, {} per file, records of {record} B in {} KiB units (--record-align {} KiB: the largest unit that pads a record by at most 1/32)",
        backend,
        a.dir.display(),
        a.slots,
        a.depth,
        format_args!("{} MiB", a.size >> 20),
        unit >> 10,
        a.record_align >> 10
    );

    // Distinct payloads, cycled; their slot checksums computed once (the
    // tier still checks every write against them).
    let variants = 8usize;
    let mut st = 0x55u64;
    let payloads: Vec<(Vec<SlotSum>, Vec<u8>)> = (0..variants)
        .map(|_| {
            let b: Vec<u8> = (0..block).map(|_| mix(&mut st)).collect();
            let s = b
                .chunks(slot_len as usize)
                .map(|c| SlotSum { len: c.len() as u32, crc32c: crc32c::crc32c(c) })
                .collect();
            (s, b)
        })
        .collect();
    let mut raw_bufs: Vec<AlignedBuf> = Vec::new();
    for i in 0..a.depth {
        let mut b = AlignedBuf::new(padded).map_err(|e| e.to_string())?;
        b.as_mut_slice()[..block as usize].copy_from_slice(&payloads[i % variants].1);
        raw_bufs.push(b);
    }
    // Keys of this run only: a tier file left by an earlier run in the
    // same directory is recovered at open, and a key it already holds
    // would be a dedup hit, not a write.
    let run = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let ns: Arc<str> = Arc::from(format!("bench-ssd-{run:016x}"));
    let key = |rep: usize, i: u64| BlockKey {
        namespace: ns.clone(),
        hash: BlockHash::from_u64(((rep as u64) << 40) | i),
        family: 1,
    };

    // Per repetition: (raw write, tier write, raw read, tier read) seconds.
    let mut times: Vec<[f64; 4]> = Vec::new();
    for rep in 0..a.reps.max(1) {
        // Odd repetitions run the tier first, so a drift of the
        // device's speed within a run does not favour one side.
        let tier_first = rep % 2 == 1;
        let mut t = [0f64; 4];
        for side in [tier_first, !tier_first] {
            if side {
                t[1] = tier_write_pass(&mut tier, n, &payloads, |i| key(rep, i))?;
                t[3] = tier_read_pass(&mut tier, n, a.depth, |i| key(rep, i))?;
            } else {
                t[0] = raw_pass(&mut raw, IoKind::Write, n, (padded, record), &mut raw_bufs)?;
                t[2] = raw_pass(&mut raw, IoKind::Read, n, (padded, record), &mut raw_bufs)?;
            }
        }
        outln!(
            "  rep {rep}: raw write {:.3}  tier write {:.3}  raw read {:.3}  tier read {:.3} GB/s",
            gbps(bytes, t[0]),
            gbps(bytes, t[1]),
            gbps(bytes, t[2]),
            gbps(bytes, t[3])
        );
        times.push(t);
    }
    let best = |k: usize| times.iter().map(|t| t[k]).fold(f64::MAX, f64::min);
    let (best_rw, best_tw, best_rr, best_tr) = (best(0), best(1), best(2), best(3));
    // The ratio of each repetition's adjacent measurements, median over
    // repetitions: the headline (this device's speed drifts between runs).
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let m = v.len() / 2;
        if v.len().is_multiple_of(2) { (v[m - 1] + v[m]) / 2.0 } else { v[m] }
    };
    let wratio = median(times.iter().map(|t| t[0] / t[1]).collect());
    let rratio = median(times.iter().map(|t| t[2] / t[3]).collect());
    let (rw, tw, rr, tr) = (gbps(bytes, best_rw), gbps(bytes, best_tw), gbps(bytes, best_rr), gbps(bytes, best_tr));
    outln!("  best of {}:", times.len());
    outln!("  raw O_DIRECT write  {rw:>7.3} GB/s");
    let judge = |r: f64| if r >= 0.9 { "(target >= 0.9)" } else { "(target >= 0.9: MISSED)" };
    outln!(
        "  tier write          {tw:>7.3} GB/s   ratio (median per rep) {wratio:.3}   best/best {:.3}   {}",
        tw / rw,
        judge(wratio)
    );
    outln!("  raw O_DIRECT read   {rr:>7.3} GB/s");
    outln!(
        "  tier read (+verify) {tr:>7.3} GB/s   ratio (median per rep) {rratio:.3}   best/best {:.3}   {}",
        tr / rr,
        judge(rratio)
    );
    let c = tier.counters();
    outln!(
        "  tier counters: written {} read {} evicted {} verify failures {}",
        c.written_blocks,
        c.read_blocks,
        c.evicted,
        c.verify_failures
    );
    Ok(json!({
        "bench": "ssd",
        "backend": backend,
        "dir": a.dir.display().to_string(),
        "file_bytes": a.size,
        "block_bytes": block,
        "slots": a.slots,
        "blocks": n,
        "queue_depth": a.depth,
        "record_align": a.record_align,
        "record_bytes": record,
        "reps": a.reps.max(1),
        "raw_write_gbps": rw,
        "tier_write_gbps": tw,
        "write_ratio": wratio,
        "raw_read_gbps": rr,
        "tier_read_gbps": tr,
        "read_ratio": rratio,
        "write_ratio_best": tw / rw,
        "read_ratio_best": tr / rr,
        "reps_gbps": times.iter().map(|t| [gbps(bytes, t[0]), gbps(bytes, t[1]), gbps(bytes, t[2]), gbps(bytes, t[3])]).collect::<Vec<_>>(),
        "counters": c,
    }))
}
