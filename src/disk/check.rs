//! Seeded checks of the disk tier over the simulated disk: C17 and C18 as
//! named invariants that count their cases, run per seed by the unit tests
//! (and usable from the simulator's binary, which links the library
//! without `cfg(test)`).
//!
//! One seed draws a small tier (256 KiB – 2 MiB, so eviction is constant),
//! a queue depth, a write-queue bound, a fault mix ([`SimFaults::random`],
//! silent corruption on in half the seeds) and 300 steps of writes, reads,
//! polls and crashes with restart. Every block's bytes are chosen by the
//! checker and remembered by (key, generation).
//!
//! - `inv_disk_read_verified` (C17): every read that returns `Ok` returns
//!   exactly the bytes saved under that key and generation.
//! - `inv_disk_recovery_verified` (C18): after a crash, every block that
//!   recovery lists was saved under that key and generation, and reads
//!   back (faults off) as exactly those bytes.
//! - `inv_disk_recovery_complete` (C18): after a crash, every block whose
//!   write had completed and that was still indexed is listed, with its
//!   generation. Checked only in seeds without silent write corruption
//!   (a flipped bit on the medium rightly loses its record).
//!
//! Not checked here: the node's use of the tier (registrations, staging
//! into the pool, fetch deadlines) — that comes with the integration.

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::format::{BlockKey, SlotSum};
use super::io::DiskIo;
use super::sim::{SimDisk, SimFaults};
use super::tier::{Tier, TierConfig, TierEvent, WriteOutcome};
use crate::types::BlockHash;

/// Cases each invariant checked in one seed (or summed over many).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskChecks {
    /// `inv_disk_read_verified`: verified reads compared byte for byte.
    pub read_verified: u64,
    /// `inv_disk_recovery_verified`: recovered blocks read back and
    /// compared.
    pub recovery_verified: u64,
    /// `inv_disk_recovery_complete`: completed, indexed writes looked for
    /// after a crash.
    pub recovery_complete: u64,
    /// Reads that failed (dropped records): the faults reached the tier.
    pub read_failures: u64,
    /// Crashes simulated.
    pub crashes: u64,
    /// Reads served from the write-behind queue's buffer (reach: their
    /// events are judged by `inv_disk_read_verified` like any read's,
    /// unless a crash came before the next poll).
    pub queue_reads: u64,
    /// Reads served, when the write they waited for completed, from that
    /// write's buffer (reach, as `queue_reads`).
    pub after_write_reads: u64,
}

impl DiskChecks {
    /// Adds `o`'s counts.
    pub fn add(&mut self, o: &DiskChecks) {
        self.read_verified += o.read_verified;
        self.recovery_verified += o.recovery_verified;
        self.recovery_complete += o.recovery_complete;
        self.read_failures += o.read_failures;
        self.crashes += o.crashes;
        self.queue_reads += o.queue_reads;
        self.after_write_reads += o.after_write_reads;
    }
}

/// An invariant that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskViolation {
    /// The invariant's name (`inv_disk_*`).
    pub invariant: &'static str,
    /// The seed.
    pub seed: u64,
    /// What was seen.
    pub detail: String,
}

impl std::fmt::Display for DiskViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} violated at seed {}: {} (replay: DISK_SEED={} cargo test --lib disk::tests::replay_disk_seed -- --nocapture)",
            self.invariant, self.seed, self.detail, self.seed
        )
    }
}

type Truth = HashMap<(BlockKey, u64), Vec<u8>>;

fn key_of(i: u64) -> BlockKey {
    let ns = if i.is_multiple_of(3) { "ns-b" } else { "ns-a" };
    BlockKey { namespace: Arc::from(ns), hash: BlockHash::from_u64(i), family: 1 + i % 2 }
}

fn block_of(rng: &mut SmallRng) -> (Vec<SlotSum>, Vec<u8>) {
    let n = rng.random_range(1..=5usize);
    let mut bytes = Vec::new();
    let mut slots = Vec::with_capacity(n);
    for _ in 0..n {
        let len = rng.random_range(1..=12_000usize);
        let start = bytes.len();
        bytes.extend((0..len).map(|_| rng.random::<u8>()));
        slots.push(SlotSum { len: len as u32, crc32c: crc32c::crc32c(&bytes[start..]) });
    }
    (slots, bytes)
}

struct Run {
    seed: u64,
    truth: Truth,
    checks: DiskChecks,
}

impl Run {
    fn violation(&self, invariant: &'static str, detail: String) -> DiskViolation {
        DiskViolation { invariant, seed: self.seed, detail }
    }

    fn events(&mut self, evs: Vec<TierEvent>, tier: &mut Tier<SimDisk>) -> Result<(), DiskViolation> {
        for ev in evs {
            if let TierEvent::Read { key, result, .. } = ev {
                match result {
                    Ok(block) => {
                        self.checks.read_verified += 1;
                        let ok = self
                            .truth
                            .get(&(key.clone(), block.generation))
                            .is_some_and(|b| b.as_slice() == block.bytes());
                        if !ok {
                            return Err(self.violation(
                                "inv_disk_read_verified",
                                format!(
                                    "read of {:?} gen {} returned bytes that were not saved",
                                    key.hash, block.generation
                                ),
                            ));
                        }
                        tier.recycle(block.buf);
                    }
                    Err(_) => self.checks.read_failures += 1,
                }
            }
        }
        Ok(())
    }
}

/// Runs one seed (see the module doc); returns the cases checked or the
/// first violation.
pub fn run_disk_seed(seed: u64) -> Result<DiskChecks, DiskViolation> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0xd15c_7e57);
    let capacity = rng.random_range(64..=512u64) * 4096;
    let depth = rng.random_range(1..=8usize);
    // `read_slots` from the seed, not the RNG, so every other draw (and
    // each kept seed's scenario) stays what it was.
    let cfg = TierConfig {
        write_queue_max: rng.random_range(1..=16),
        record_align: 4096 << rng.random_range(0..=2u32),
        read_slots: (seed % 3) as usize,
    };
    let silent = rng.random_bool(0.5);
    let faults = SimFaults::random(&mut rng, silent);
    let mut disk = SimDisk::new(capacity, depth, rng.random());
    disk.set_faults(faults.clone());
    let mut run = Run { seed, truth: HashMap::new(), checks: DiskChecks::default() };
    let open = |d: SimDisk, run: &Run| {
        Tier::open(d, cfg.clone()).map_err(|e| run.violation("inv_disk_open", format!("open failed: {e}")))
    };
    let (mut tier, _) = open(disk, &run)?;
    let keys = 48u64;
    for _ in 0..300 {
        match rng.random_range(0..100) {
            0..=44 => {
                let key = key_of(rng.random_range(0..keys));
                let (slots, bytes) = block_of(&mut rng);
                if let Ok(WriteOutcome::Queued { generation }) = tier.write(&key, &slots, &bytes) {
                    run.truth.insert((key, generation), bytes);
                }
            }
            45..=74 => {
                let _ = tier.read(&key_of(rng.random_range(0..keys)));
            }
            75..=96 => {
                let wait = rng.random_bool(0.5);
                let evs = tier.poll(wait).map_err(|e| run.violation("inv_disk_open", format!("poll: {e}")))?;
                run.events(evs, &mut tier)?;
            }
            _ => {
                // Crash and restart.
                run.checks.crashes += 1;
                run.checks.queue_reads += tier.counters().queue_reads;
                run.checks.after_write_reads += tier.counters().after_write_reads;
                let expected = tier.written_keys();
                let disk = tier.into_io().crash();
                let (t, rec) = open(disk, &run)?;
                tier = t;
                let listed: HashMap<BlockKey, u64> = rec.blocks.iter().map(|b| (b.key.clone(), b.generation)).collect();
                if faults.corrupt_write == 0.0 {
                    for (k, g) in &expected {
                        run.checks.recovery_complete += 1;
                        if listed.get(k) != Some(g) {
                            return Err(run.violation(
                                "inv_disk_recovery_complete",
                                format!(
                                    "completed write of {:?} gen {g} not recovered (listed {:?})",
                                    k.hash,
                                    listed.get(k)
                                ),
                            ));
                        }
                    }
                }
                for b in &rec.blocks {
                    run.checks.recovery_verified += 1;
                    let Some(want) = run.truth.get(&(b.key.clone(), b.generation)).cloned() else {
                        return Err(run.violation(
                            "inv_disk_recovery_verified",
                            format!("recovered {:?} gen {} was never saved", b.key.hash, b.generation),
                        ));
                    };
                    let got = read_back(&mut tier, &b.key);
                    if got.as_deref() != Some(want.as_slice()) {
                        return Err(run.violation(
                            "inv_disk_recovery_verified",
                            format!("recovered {:?} gen {} does not read back as saved", b.key.hash, b.generation),
                        ));
                    }
                }
                tier.io_mut().set_faults(faults.clone());
            }
        }
    }
    let evs = tier.drain().map_err(|e| run.violation("inv_disk_open", format!("drain: {e}")))?;
    run.events(evs, &mut tier)?;
    run.checks.queue_reads += tier.counters().queue_reads;
    run.checks.after_write_reads += tier.counters().after_write_reads;
    Ok(run.checks)
}

/// Reads `key` back with faults off (the caller restores them); `None`
/// when the read fails.
fn read_back<D: DiskIo>(tier: &mut Tier<D>, key: &BlockKey) -> Option<Vec<u8>> {
    let tag = tier.read(key).ok()?;
    let evs = tier.drain().ok()?;
    let mut out = None;
    for ev in evs {
        if let TierEvent::Read { tag: t, result: Ok(block), .. } = ev {
            if t == tag {
                out = Some(block.bytes().to_vec());
            }
        }
    }
    out
}
