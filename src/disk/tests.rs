//! Tests of the tier over the simulated disk (deterministic cases, the
//! seeded C17/C18 sweep, the canaries) and over the real backends in a
//! temporary directory.

use std::sync::Arc;

use super::check::{DiskChecks, run_disk_seed};
use super::format::{BlockKey, FormatError, SlotSum};
use super::io::{DiskIo, EIO, ENOSPC};
use super::sim::{SimDisk, SimFaults};
use super::tier::{IoFailure, ReadRefused, Removal, Tier, TierConfig, TierEvent, WriteOutcome, WriteRefused};
use crate::types::BlockHash;

fn key(i: u64) -> BlockKey {
    BlockKey { namespace: Arc::from("ns"), hash: BlockHash::from_u64(i), family: 7 }
}

/// A block of `slots` slots of `slot_len` bytes, contents from `seed`.
fn block(seed: u64, slots: usize, slot_len: usize) -> (Vec<SlotSum>, Vec<u8>) {
    let mut st = seed;
    let bytes: Vec<u8> = (0..slots * slot_len).map(|_| crate::testing::splitmix64(&mut st) as u8).collect();
    let sums = bytes.chunks(slot_len).map(|c| SlotSum { len: c.len() as u32, crc32c: crc32c::crc32c(c) }).collect();
    (sums, bytes)
}

fn tier(capacity: u64, depth: usize, queue: usize) -> Tier<SimDisk> {
    let (t, rec) =
        Tier::open(SimDisk::new(capacity, depth, 1), TierConfig { write_queue_max: queue, ..TierConfig::default() })
            .unwrap();
    assert!(rec.blocks.is_empty());
    t
}

/// Reads `k` and waits for its event: the bytes, or the failure.
fn read_now<D: DiskIo>(t: &mut Tier<D>, k: &BlockKey) -> (Result<Vec<u8>, IoFailure>, Vec<TierEvent>) {
    let tag = t.read(k).unwrap();
    let evs = t.drain().unwrap();
    let mut res = None;
    let mut rest = Vec::new();
    for ev in evs {
        match ev {
            TierEvent::Read { tag: g, result, .. } if g == tag => res = Some(result.map(|b| b.bytes().to_vec())),
            other => rest.push(other),
        }
    }
    (res.expect("the read's event"), rest)
}

#[test]
fn write_then_read_returns_the_bytes() {
    let mut t = tier(1 << 20, 4, 8);
    let (s, b) = block(1, 3, 10_000);
    assert_eq!(t.write(&key(1), &s, &b), Ok(WriteOutcome::Queued { generation: 1 }));
    let evs = t.drain().unwrap();
    assert!(matches!(&evs[..], [TierEvent::Written { generation: 1, .. }]), "{evs:?}");
    assert_eq!(t.write(&key(1), &s, &b), Ok(WriteOutcome::AlreadyOnDisk { generation: 1 }));
    let (got, _) = read_now(&mut t, &key(1));
    assert_eq!(got.unwrap(), b);
    assert_eq!(t.read(&key(2)), Err(ReadRefused::NotFound));
    let c = t.counters();
    assert_eq!((c.written_blocks, c.written_bytes, c.read_blocks, c.read_bytes), (1, 30_000, 1, 30_000));
    assert_eq!((c.hits, c.misses, c.write_dedup, c.queue_reads, c.after_write_reads), (1, 1, 1, 0, 0));
}

/// The bytes of read `tag` among `evs`, if its event is there.
fn read_event(evs: &[TierEvent], tag: u64) -> Option<Result<Vec<u8>, IoFailure>> {
    evs.iter().find_map(|ev| match ev {
        TierEvent::Read { tag: g, result, .. } if *g == tag => {
            Some(result.as_ref().map(|b| b.bytes().to_vec()).map_err(Clone::clone))
        }
        _ => None,
    })
}

/// A record is readable from the moment its write is queued: one whose
/// write still waits in the write-behind queue is copied from the queue's
/// buffer at once; one whose write is at the backend is served, when that
/// write completes, from the buffer it wrote. Both verified (the bytes
/// saved) and counted apart; neither is a disk read.
#[test]
fn a_record_being_written_is_read_from_its_write_buffer() {
    let mut t = tier(1 << 20, 1, 8);
    let blocks: Vec<_> = (0..3).map(|i| block(40 + i, 2, 5_000)).collect();
    for (i, (s, b)) in blocks.iter().enumerate() {
        assert!(matches!(t.write(&key(i as u64), s, b), Ok(WriteOutcome::Queued { .. })));
    }
    assert_eq!(t.io_mut().in_flight(), 1, "depth 1: the first write is at the backend, two wait");
    let at_backend = t.read(&key(0)).expect("a record whose write is at the backend is readable");
    let queued = t.read(&key(2)).expect("a queued record is readable");
    assert_eq!(t.io_mut().in_flight(), 1, "neither read went to the backend");
    let evs = t.poll(false).unwrap();
    assert_eq!(read_event(&evs, queued).expect("its event comes with the next poll").unwrap(), blocks[2].1);
    assert_eq!(t.counters().queue_reads, 1);
    let mut evs = evs;
    evs.extend(t.drain().unwrap());
    let waited = read_event(&evs, at_backend).expect("its event comes with the write's completion");
    assert_eq!(waited.unwrap(), blocks[0].1);
    let c = t.counters();
    assert_eq!((c.queue_reads, c.after_write_reads, c.read_blocks, c.hits), (1, 1, 2, 2));
    assert_eq!(t.io_mut().stats().ops, 3, "the three writes, no read, reached the disk");
    // Every write still lands, and the disk's copy reads back the same.
    assert_eq!(evs.iter().filter(|e| matches!(e, TierEvent::Written { .. })).count(), 3);
    assert_eq!(read_now(&mut t, &key(2)).0.unwrap(), blocks[2].1);
    assert_eq!((t.counters().queue_reads, t.counters().after_write_reads), (1, 1), "the last read came from the disk");
}

/// A read waiting for a write that fails fails with the write's error;
/// the record is removed once, and a later read misses.
#[test]
fn a_failed_write_fails_the_reads_waiting_for_it() {
    let mut t = tier(1 << 20, 1, 8);
    t.io_mut().set_faults(SimFaults { eio_write: 1.0, ..SimFaults::none() });
    let (s, b) = block(7, 2, 5_000);
    assert!(matches!(t.write(&key(0), &s, &b), Ok(WriteOutcome::Queued { .. })));
    let tags = [t.read(&key(0)).unwrap(), t.read(&key(0)).unwrap()];
    let evs = t.drain().unwrap();
    for tag in tags {
        assert_eq!(read_event(&evs, tag).expect("each read's event"), Err(IoFailure::Os(EIO)));
    }
    let removed = evs.iter().filter(|e| matches!(e, TierEvent::Removed { why: Removal::WriteFailed(_), .. })).count();
    assert_eq!(removed, 1, "{evs:?}");
    assert_eq!(t.read(&key(0)), Err(ReadRefused::NotFound));
    let c = t.counters();
    assert_eq!((c.read_failed, c.read_blocks, c.write_failed), (2, 0, 1));
}

/// With `read_slots`, writes never take the last slots of the backend's
/// depth: a read started behind a long write queue goes to the backend at
/// once, and every write still lands.
#[test]
fn writes_leave_read_slots_free() {
    let cfg = TierConfig { write_queue_max: 16, read_slots: 2, ..TierConfig::default() };
    let (mut t, _) = Tier::open(SimDisk::new(1 << 20, 4, 1), cfg).unwrap();
    let (s0, b0) = block(100, 1, 4000);
    t.write(&key(100), &s0, &b0).unwrap();
    t.drain().unwrap();
    for i in 0..10 {
        let (s, b) = block(i, 1, 4000);
        assert!(matches!(t.write(&key(i), &s, &b), Ok(WriteOutcome::Queued { .. })));
    }
    assert_eq!(t.io_mut().in_flight(), 2, "writes hold depth 4 - 2 read slots");
    assert_eq!(t.writes_pending(), 10);
    t.read(&key(100)).unwrap();
    assert_eq!(t.io_mut().in_flight(), 3, "the read went to the backend without waiting for a write");
    let evs = t.drain().unwrap();
    assert_eq!(evs.iter().filter(|e| matches!(e, TierEvent::Written { .. })).count(), 10);
    let read = evs.iter().find_map(|e| match e {
        TierEvent::Read { result, .. } => Some(result.as_ref().map(|b| b.bytes().to_vec())),
        _ => None,
    });
    assert_eq!(read.expect("the read's event").unwrap(), b0);
    // Without read slots the writes fill the depth.
    let mut t = tier(1 << 20, 4, 16);
    for i in 0..10 {
        let (s, b) = block(i, 1, 4000);
        t.write(&key(i), &s, &b).unwrap();
    }
    assert_eq!(t.io_mut().in_flight(), 4);
}

/// A tier keeps as many spare buffers as its write queue and depth can
/// use (not just `DISK_SPARE_BUFFERS_MAX`), and the next writes take them
/// instead of allocating.
#[test]
fn spare_buffers_cover_the_write_queue() {
    let n = crate::limits::DISK_SPARE_BUFFERS_MAX + 86;
    let mut t = tier(4 << 20, 4, 200);
    for i in 0..n as u64 {
        let (s, b) = block(i, 1, 4000);
        t.write(&key(i), &s, &b).unwrap();
    }
    assert_eq!(t.spare_buffers(), 0);
    t.drain().unwrap();
    assert_eq!(t.spare_buffers(), n, "every completed write's buffer is kept");
    for i in 0..n as u64 {
        let (s, b) = block(1000 + i, 1, 4000);
        t.write(&key(1000 + i), &s, &b).unwrap();
    }
    assert_eq!(t.spare_buffers(), 0, "the writes reused them");
    t.drain().unwrap();
    for i in 0..n as u64 {
        let (got, _) = read_now(&mut t, &key(1000 + i));
        assert_eq!(got.unwrap(), block(1000 + i, 1, 4000).1);
    }
}

/// The write-behind queue never blocks: past its bound a write is refused
/// and counted, and accepted again once writes complete.
#[test]
fn full_queue_refuses_and_counts() {
    let mut t = tier(1 << 20, 1, 2);
    for i in 0..2 {
        let (s, b) = block(i, 1, 4096);
        assert!(matches!(t.write(&key(i), &s, &b), Ok(WriteOutcome::Queued { .. })));
    }
    let (s, b) = block(9, 1, 4096);
    assert_eq!(t.write(&key(9), &s, &b), Err(WriteRefused::QueueFull { max: 2 }));
    assert_eq!(t.counters().write_refused_queue_full, 1);
    t.drain().unwrap();
    assert!(matches!(t.write(&key(9), &s, &b), Ok(WriteOutcome::Queued { .. })));
}

/// Bytes that changed since they were sealed are never written.
#[test]
fn bytes_not_matching_their_checksums_are_refused() {
    let mut t = tier(1 << 20, 1, 2);
    let (s, mut b) = block(1, 2, 5000);
    b[7000] ^= 1;
    assert!(matches!(t.write(&key(1), &s, &b), Err(WriteRefused::InputChecksum { slot: 1, .. })));
    let (s, b) = block(1, 2, 5000);
    assert!(matches!(t.write(&key(1), &s, &b[..9999]), Err(WriteRefused::Format(_))));
    assert_eq!(t.counters().write_refused_input, 2);
    assert!(t.is_empty());
}

/// Space is evicted least recently used first (a read refreshes a
/// record), each eviction reported once as a removal.
#[test]
fn eviction_is_lru_and_reported() {
    // Each record: 1 header page + 2 payload pages = 12 KiB; 10 fit.
    let mut t = tier(10 * 12 * 1024, 2, 16);
    for i in 0..10 {
        let (s, b) = block(i, 2, 4096);
        t.write(&key(i), &s, &b).unwrap();
    }
    t.drain().unwrap();
    let _ = read_now(&mut t, &key(0)); // 0 is now the most recent
    let (s, b) = block(10, 2, 4096);
    t.write(&key(10), &s, &b).unwrap();
    let evs = t.drain().unwrap();
    let removed: Vec<_> = evs
        .iter()
        .filter_map(|e| match e {
            TierEvent::Removed { key, why: Removal::Evicted, .. } => Some(key.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(removed, vec![key(1)]);
    assert_eq!(t.read(&key(1)), Err(ReadRefused::NotFound));
    assert!(t.lookup(&key(0)).is_some());
    assert_eq!(t.counters().evicted, 1);
}

/// A record a read is using is never evicted; with nothing evictable the
/// write is refused as out of space (counted), never a crash.
#[test]
fn no_space_when_everything_is_in_use() {
    let mut t = tier(2 * 12 * 1024, 2, 16);
    for i in 0..2 {
        let (s, b) = block(i, 2, 4096);
        t.write(&key(i), &s, &b).unwrap();
    }
    t.drain().unwrap();
    t.read(&key(0)).unwrap();
    t.read(&key(1)).unwrap();
    let (s, b) = block(5, 2, 4096);
    assert!(matches!(t.write(&key(5), &s, &b), Err(WriteRefused::NoSpace { need: 12288, .. })));
    assert_eq!(t.counters().write_refused_no_space, 1);
    let evs = t.drain().unwrap();
    assert_eq!(evs.iter().filter(|e| matches!(e, TierEvent::Read { result: Ok(_), .. })).count(), 2);
    let (s, b) = block(6, 40, 4096);
    assert!(matches!(t.write(&key(6), &s, &b), Err(WriteRefused::TooLarge { .. })));
}

/// A bit flipped on the medium: the read fails verification, the record
/// is dropped and its removal reported, nothing is handed out.
#[test]
fn corruption_on_the_medium_is_caught_and_dropped() {
    let mut t = tier(1 << 20, 2, 4);
    let (s, b) = block(3, 2, 6000);
    t.write(&key(3), &s, &b).unwrap();
    t.drain().unwrap();
    t.io_mut().medium_mut()[4096 + 7000] ^= 0x10;
    let (got, rest) = read_now(&mut t, &key(3));
    assert!(matches!(got, Err(IoFailure::Verify(FormatError::SlotChecksum { slot: 1, .. }))), "{got:?}");
    assert!(
        matches!(&rest[..], [TierEvent::Removed { why: Removal::ReadFailed(IoFailure::Verify(_)), .. }]),
        "{rest:?}"
    );
    assert_eq!(t.counters().verify_failures, 1);
    assert_eq!(t.read(&key(3)), Err(ReadRefused::NotFound));
    assert_eq!(t.used_bytes(), 0, "the space is freed");
}

/// Short reads, misdirected and stale completions, ENOSPC: each is
/// caught, counted, and drops the record (stale ones are ignored).
#[test]
fn injected_faults_are_caught() {
    let (s, b) = block(1, 1, 8192);
    let (s2, b2) = block(2, 1, 8192);
    let prep = |faults: SimFaults| {
        let mut t = tier(1 << 20, 4, 4);
        t.write(&key(1), &s, &b).unwrap();
        t.write(&key(2), &s2, &b2).unwrap();
        t.drain().unwrap();
        t.io_mut().set_faults(faults);
        t
    };
    // Short read.
    let mut t = prep(SimFaults { short_read: 1.0, ..SimFaults::none() });
    let (got, _) = read_now(&mut t, &key(1));
    assert!(matches!(got, Err(IoFailure::Short { .. })), "{got:?}");
    assert_eq!(t.counters().read_failed, 1);
    // Misdirected: two reads completing in one batch swap buffers.
    let mut t = prep(SimFaults { misdirect: 1.0, ..SimFaults::none() });
    t.read(&key(1)).unwrap();
    t.read(&key(2)).unwrap();
    let evs = t.drain().unwrap();
    let misdirected =
        evs.iter().filter(|e| matches!(e, TierEvent::Read { result: Err(IoFailure::Misdirected), .. })).count();
    let ok = evs.iter().filter(|e| matches!(e, TierEvent::Read { result: Ok(_), .. })).count();
    assert_eq!(misdirected + ok, 2);
    assert_eq!(t.counters().misdirected_completions as usize, misdirected);
    // Stale completions: ignored and counted; the reads still verify.
    let mut t = prep(SimFaults { stale: 1.0, ..SimFaults::none() });
    let (got, _) = read_now(&mut t, &key(1));
    assert_eq!(got.unwrap(), b);
    for _ in 0..40 {
        t.poll(false).unwrap();
    }
    assert!(t.counters().stale_completions >= 1);
    // ENOSPC on a write.
    let mut t = prep(SimFaults { enospc_write: 1.0, ..SimFaults::none() });
    let (s3, b3) = block(3, 1, 4096);
    t.write(&key(3), &s3, &b3).unwrap();
    let evs = t.drain().unwrap();
    assert!(
        matches!(&evs[..], [TierEvent::Removed { why: Removal::WriteFailed(IoFailure::Os(ENOSPC)), .. }]),
        "{evs:?}"
    );
    assert_eq!((t.counters().write_failed, t.counters().write_enospc), (1, 1));
}

/// Restart: every completed record is recovered with its generation; a
/// damaged one is not listed; new generations continue above the old.
#[test]
fn recovery_keeps_what_verifies() {
    let mut t = tier(1 << 20, 4, 16);
    let mut saved = Vec::new();
    for i in 0..8 {
        let (s, b) = block(i, 2, 3000 + i as usize);
        t.write(&key(i), &s, &b).unwrap();
        saved.push(b);
    }
    t.drain().unwrap();
    let mut disk = t.into_io().crash();
    // Damage record 5's payload.
    let off = 5 * (4096 + 8192) + 4096 + 100;
    disk.medium_mut()[off] ^= 1;
    let (mut t, rec) = Tier::open(disk, TierConfig::default()).unwrap();
    let mut keys: Vec<u64> = rec.blocks.iter().map(|b| b.generation).collect();
    keys.sort();
    assert_eq!(keys, vec![1, 2, 3, 4, 5, 7, 8], "generation 6 (key 5) was damaged");
    assert_eq!(rec.rejected, 1);
    assert_eq!(t.counters().recovered, 7);
    for i in [0u64, 7] {
        let (got, _) = read_now(&mut t, &key(i));
        assert_eq!(got.unwrap(), saved[i as usize]);
    }
    let (s, b) = block(99, 1, 100);
    assert_eq!(t.write(&key(99), &s, &b), Ok(WriteOutcome::Queued { generation: 9 }));
}

/// A disk that hangs during the recovery scan: the read never completes,
/// and the open fails with `RecoveryStalled` (naming where) instead of
/// waiting for ever (the simulated disk reports its stall at once).
#[test]
fn recovery_on_a_hung_disk_fails_instead_of_waiting() {
    let mut t = tier(1 << 20, 4, 16);
    for i in 0..4 {
        let (s, b) = block(i, 2, 3000 + i as usize);
        t.write(&key(i), &s, &b).unwrap();
    }
    t.drain().unwrap();
    let disk = t.into_io().crash();
    let stall = disk.stall_switch();
    stall.store(true, std::sync::atomic::Ordering::Relaxed);
    let e = Tier::open(disk, TierConfig::default()).expect_err("a hung disk cannot be recovered");
    assert!(matches!(e, super::tier::TierError::RecoveryStalled { offset: 0, .. }), "{e}");
    assert!(e.to_string().contains("did not complete"), "{e}");
}

/// A bad write-behind bound is refused, and the error names the range
/// the limit allows.
#[test]
fn a_write_queue_out_of_range_names_the_allowed_range() {
    let bad = TierConfig { write_queue_max: crate::limits::DISK_WRITE_QUEUE_MAX + 1, ..TierConfig::default() };
    let e = Tier::open(SimDisk::new(1 << 20, 4, 3), bad).expect_err("out of range");
    assert!(e.to_string().contains(&format!("1..={}", crate::limits::DISK_WRITE_QUEUE_MAX)), "{e}");
}

/// With a record alignment, records whose padding to it stays small take
/// a multiple of it (records of one size thus also start on it); reads and
/// recovery work the same.
#[test]
fn records_honour_the_record_alignment() {
    let cfg = TierConfig { write_queue_max: 8, record_align: 64 << 10, read_slots: 0 };
    let (mut t, _) = Tier::open(SimDisk::new(16 << 20, 4, 3), cfg.clone()).unwrap();
    let mut saved = Vec::new();
    // 3 slots of 700,000 B behind a 4 KiB header: 2,104,096 B, padded to
    // 33 × 64 KiB (58,592 B of padding, under 1/32 of the record).
    let stride = 33usize << 16;
    for i in 0..5 {
        let (s, b) = block(i, 3, 700_000);
        t.write(&key(i), &s, &b).unwrap();
        saved.push(b);
    }
    t.drain().unwrap();
    assert_eq!(t.used_bytes(), 5 * stride as u64);
    let disk = t.into_io();
    for i in 0..5usize {
        // Each record's magic sits at a 64 KiB boundary.
        assert_eq!(&disk.medium()[i * stride..i * stride + 4], b"KFSD");
    }
    let (mut t, rec) = Tier::open(disk.crash(), cfg).unwrap();
    assert_eq!(rec.blocks.len(), 5);
    let (got, _) = read_now(&mut t, &key(4));
    assert_eq!(got.unwrap(), saved[4]);
    let bad = TierConfig { write_queue_max: 8, record_align: 3 << 12, read_slots: 0 };
    assert!(matches!(Tier::open(SimDisk::new(1 << 20, 4, 3), bad), Err(super::tier::TierError::BadConfig { .. })));
}

/// A record that padding to the record alignment would grow by more than
/// 1/32 is padded to a smaller power of two (4 KiB at least): a 64 KiB
/// block's record is not written as 128 KiB.
#[test]
fn small_records_are_not_padded_to_a_large_alignment() {
    assert_eq!(super::tier::padded_record_len(68 << 10, 64 << 10), 68 << 10);
    assert_eq!(super::tier::padded_record_len((68 << 10) + 1, 64 << 10), 72 << 10);
    assert_eq!(super::tier::padded_record_len(2_363_392, 64 << 10), 37 << 16);
    assert_eq!(super::tier::padded_record_len(2_363_392, 4 << 10), 577 << 12);
    assert_eq!(super::tier::padded_record_len(1, 16 << 20), 4 << 10);
    let cfg = TierConfig { write_queue_max: 8, record_align: 64 << 10, read_slots: 0 };
    let (mut t, _) = Tier::open(SimDisk::new(1 << 20, 4, 3), cfg).unwrap();
    for i in 0..5 {
        // 3 × 7,000 B behind a 4 KiB header: 25,096 B, 7 pages.
        let (s, b) = block(i, 3, 7000);
        t.write(&key(i), &s, &b).unwrap();
    }
    t.drain().unwrap();
    assert_eq!(t.used_bytes(), 5 * (7 << 12));
}

/// A crash in the middle of writes loses at most the writes in flight.
#[test]
fn crash_mid_write_loses_only_the_writes_in_flight() {
    for seed in 0..32 {
        let (mut t, _) =
            Tier::open(SimDisk::new(1 << 20, 4, seed), TierConfig { write_queue_max: 16, ..TierConfig::default() })
                .unwrap();
        for i in 0..6 {
            let (s, b) = block(i, 2, 5000);
            t.write(&key(i), &s, &b).unwrap();
        }
        t.drain().unwrap();
        for i in 6..10 {
            let (s, b) = block(i, 2, 5000);
            t.write(&key(i), &s, &b).unwrap();
        }
        let (_, rec) = Tier::open(t.into_io().crash(), TierConfig::default()).unwrap();
        let mut got: Vec<u64> = rec.blocks.iter().map(|b| b.generation).collect();
        got.sort();
        assert!(got.starts_with(&[1, 2, 3, 4, 5, 6]), "seed {seed}: {got:?}");
        assert!(got.iter().all(|&g| g <= 10));
    }
}

/// Enough seeds that every invariant checks cases and the faults reach
/// the tier; any violation fails with the seed and its replay command.
#[test]
fn disk_sweep_c17_c18() {
    let mut sum = DiskChecks::default();
    for seed in 0..150 {
        match run_disk_seed(seed) {
            Ok(c) => sum.add(&c),
            Err(v) => panic!("{v}"),
        }
    }
    println!("disk sweep: {sum:?}");
    assert!(sum.read_verified > 1000, "{sum:?}");
    assert!(sum.recovery_verified > 100, "{sum:?}");
    assert!(sum.recovery_complete > 100, "{sum:?}");
    assert!(sum.read_failures > 50, "{sum:?}");
    assert!(sum.crashes > 100, "{sum:?}");
    assert!(sum.queue_reads > 50, "reads served from the write-behind queue: {sum:?}");
    assert!(sum.after_write_reads > 50, "reads served from a completed write's buffer: {sum:?}");
}

/// `DISK_SEED=N cargo test --lib disk::tests::replay_disk_seed -- --nocapture`
#[test]
fn replay_disk_seed() {
    let Ok(seed) = std::env::var("DISK_SEED") else { return };
    let seed: u64 = seed.parse().expect("DISK_SEED is a number");
    println!("{:?}", run_disk_seed(seed));
}

#[cfg(feature = "canaries")]
fn canary_caught(c: crate::canary::Canary, names: &[&str]) {
    crate::canary::activate(Some(c));
    let caught = (0..50).find_map(|seed| run_disk_seed(seed).err().filter(|v| names.contains(&v.invariant)));
    crate::canary::activate(None);
    let v = caught.unwrap_or_else(|| panic!("canary {c:?} NOT caught by {names:?} in seeds 0..50"));
    println!("CANARY {} {c:?} caught by seed {} ({})", c.contract(), v.seed, v.invariant);
}

/// C17: reads handed out unverified are caught by `inv_disk_read_verified`.
#[cfg(feature = "canaries")]
#[test]
fn broken_c17diskreadunverified_is_caught() {
    canary_caught(crate::canary::Canary::C17DiskReadUnverified, &["inv_disk_read_verified"]);
}

/// C18: recovery that keeps records without checking their slots is
/// caught by `inv_disk_recovery_verified`.
#[cfg(feature = "canaries")]
#[test]
fn broken_c18recoverunverified_is_caught() {
    canary_caught(
        crate::canary::Canary::C18RecoverUnverified,
        &["inv_disk_recovery_verified", "inv_disk_recovery_complete"],
    );
}

#[cfg(target_os = "linux")]
mod real {
    use super::*;
    use crate::disk::backend::{BackendChoice, RealDisk, backend_over, open_backend};
    use crate::disk::file::{DiskFile, OpenError};

    /// A temporary directory on the repository's file system (`/tmp` may
    /// be tmpfs, which can refuse `O_DIRECT`).
    fn dir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix(".disk-test-").tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap()
    }

    /// A backend over a tier file in `dir`, or `None` (printed as
    /// SKIPPED) where this machine refuses `O_DIRECT` or io_uring.
    fn open_or_skip(dir: &std::path::Path, bytes: u64, depth: usize, choice: BackendChoice) -> Option<RealDisk> {
        match open_backend(dir, bytes, depth, choice) {
            Ok(x) => Some(x),
            Err(e @ (OpenError::DirectIoRefused { .. } | OpenError::NoUring { .. })) => {
                println!("SKIPPED ({choice:?}): {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    fn round_trip(choice: BackendChoice) {
        let d = dir();
        let Some(disk) = open_or_skip(d.path(), 8 << 20, 8, choice) else { return };
        println!("backend: {}", disk.kind());
        let (mut t, rec) = Tier::open(disk, TierConfig { write_queue_max: 32, ..TierConfig::default() }).unwrap();
        assert!(rec.blocks.is_empty());
        let mut saved = Vec::new();
        for i in 0..20 {
            let (s, b) = block(i, 4, 20_000 + i as usize);
            t.write(&key(i), &s, &b).unwrap();
            saved.push(b);
        }
        // Read before any completion was reaped: each from its write's
        // buffer (queued, or at the backend once it completes).
        let tags: Vec<u64> = (0..20).map(|i| t.read(&key(i)).unwrap()).collect();
        let evs = t.drain().unwrap();
        assert_eq!(evs.iter().filter(|e| matches!(e, TierEvent::Written { .. })).count(), 20, "{evs:?}");
        for (i, tag) in tags.into_iter().enumerate() {
            assert_eq!(read_event(&evs, tag).expect("each read's event").unwrap(), saved[i], "block {i}");
        }
        let c = t.counters();
        assert_eq!(c.queue_reads + c.after_write_reads, 20, "{c:?}");
        assert!(c.after_write_reads > 0, "some writes were at the backend: {c:?}");
        for i in 0..20 {
            let (got, _) = read_now(&mut t, &key(i));
            assert_eq!(got.unwrap(), saved[i as usize]);
        }
        drop(t);
        // Restart on the same directory.
        let disk = open_backend(d.path(), 8 << 20, 8, choice).unwrap();
        let (mut t, rec) = Tier::open(disk, TierConfig::default()).unwrap();
        assert_eq!(rec.blocks.len(), 20);
        let (got, _) = read_now(&mut t, &key(13));
        assert_eq!(got.unwrap(), saved[13]);
    }

    /// `reap_within` hands back a finished read, and returns at once with
    /// nothing in flight, on every real backend.
    #[test]
    fn reap_within_returns_a_completion_and_does_not_wait_for_nothing() {
        for choice in [BackendChoice::IoUring, BackendChoice::Pio] {
            let d = dir();
            let Some(mut disk) = open_or_skip(d.path(), 1 << 20, 4, choice) else { continue };
            let mut out = Vec::new();
            let t0 = std::time::Instant::now();
            assert_eq!(disk.reap_within(std::time::Duration::from_secs(5), &mut out).unwrap(), 0);
            assert!(t0.elapsed() < std::time::Duration::from_secs(1), "{choice:?} waited with nothing in flight");
            let buf = crate::disk::buf::AlignedBuf::new(4096).unwrap();
            disk.submit(crate::disk::io::IoOp { tag: 7, kind: crate::disk::io::IoKind::Read, offset: 8192, buf })
                .unwrap();
            while out.is_empty() {
                disk.reap_within(std::time::Duration::from_secs(5), &mut out).unwrap();
            }
            assert_eq!((out[0].tag, out[0].result), (7, Ok(4096)), "{choice:?}");
            assert_eq!(disk.in_flight(), 0);
        }
    }

    /// Recovery reads only what was ever written: a fresh file (allocated,
    /// never written) is skipped whole where the file system tells holes
    /// (`SEEK_DATA`), and after a few records at its start only their
    /// region is read — every record still found. On a file system that
    /// cannot tell, everything is read and still every record found.
    #[test]
    fn recovery_skips_what_was_never_written() {
        let d = dir();
        let cap = 64u64 << 20;
        let open = || open_or_skip(d.path(), cap, 8, BackendChoice::Pio);
        // Whether this file system tells never-written preallocated space
        // from data, asked of a file of the test's own (allocated as the
        // tier's is): then the tier must skip it.
        let probe = d.path().join("probe");
        let f = std::fs::File::create(&probe).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        // SAFETY: fallocate and lseek on a descriptor this test owns.
        let holes = unsafe { libc::fallocate(fd, 0, 0, 1 << 20) } == 0
            && unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) } < 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
        println!("the file system tells unwritten space: {holes}");
        drop(f);
        std::fs::remove_file(&probe).unwrap();
        let Some(disk) = open() else { return };
        let (mut t, fresh) = Tier::open(disk, TierConfig { write_queue_max: 32, ..TierConfig::default() }).unwrap();
        println!("fresh: scanned {} skipped {}", fresh.scanned_bytes, fresh.skipped_bytes);
        if holes {
            assert_eq!(fresh.scanned_bytes, 0, "a never-written file is not read: {fresh:?}");
        } else {
            assert_eq!(fresh.scanned_bytes, cap, "{fresh:?}");
        }
        for i in 0..20 {
            let (s, b) = block(i, 4, 20_000);
            t.write(&key(i), &s, &b).unwrap();
        }
        t.drain().unwrap();
        drop(t);
        let Some(disk) = open() else { return };
        let (_t, rec) = Tier::open(disk, TierConfig::default()).unwrap();
        println!("after 20 records: scanned {} skipped {}", rec.scanned_bytes, rec.skipped_bytes);
        assert_eq!(rec.blocks.len(), 20, "{rec:?}");
        assert_eq!(rec.scanned_bytes + rec.skipped_bytes, cap, "every byte is read or ruled out: {rec:?}");
        if holes {
            assert!(rec.scanned_bytes < cap / 4, "only the written start is read: {rec:?}");
        }
    }

    /// A real backend calls the completion hint when operations complete,
    /// without being polled, and dropping it stops its hint thread.
    fn completion_hint(choice: BackendChoice) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let d = dir();
        let Some(mut disk) = open_or_skip(d.path(), 8 << 20, 8, choice) else { return };
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        if !disk.set_completion_hint(Arc::new(move || {
            h.fetch_add(1, Ordering::SeqCst);
        })) {
            println!("SKIPPED ({choice:?}): the backend declined the hint");
            return;
        }
        assert!(!disk.set_completion_hint(Arc::new(|| {})), "a second hint is declined");
        let (mut t, _) = Tier::open(disk, TierConfig { write_queue_max: 8, ..TierConfig::default() }).unwrap();
        let before = hits.load(Ordering::SeqCst);
        let (s, b) = block(1, 2, 30_000);
        t.write(&key(1), &s, &b).unwrap();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while hits.load(Ordering::SeqCst) == before && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(hits.load(Ordering::SeqCst) > before, "no hint within 10 s of a write");
        let evs = t.drain().unwrap();
        assert!(matches!(&evs[..], [TierEvent::Written { .. }]), "{evs:?}");
        drop(t);
    }

    #[test]
    fn uring_completion_hint() {
        completion_hint(BackendChoice::IoUring);
    }

    #[test]
    fn threads_completion_hint() {
        completion_hint(BackendChoice::Pio);
    }

    #[test]
    fn uring_round_trip_and_restart() {
        round_trip(BackendChoice::IoUring);
    }

    #[test]
    fn threads_round_trip_and_restart() {
        round_trip(BackendChoice::Pio);
    }

    /// A byte flipped in the real file between two runs: recovery drops
    /// exactly that record (C18), and the others read back.
    #[test]
    fn damaged_file_recovers_only_what_verifies() {
        use std::os::unix::fs::FileExt;
        let d = dir();
        let Some(disk) = open_or_skip(d.path(), 8 << 20, 4, BackendChoice::Auto) else { return };
        let (mut t, _) = Tier::open(disk, TierConfig::default()).unwrap();
        for i in 0..10 {
            let (s, b) = block(i, 2, 8192);
            t.write(&key(i), &s, &b).unwrap();
        }
        t.drain().unwrap();
        drop(t);
        // Record 3: 1 header page + 4 payload pages, at 3 * 5 pages.
        let f = std::fs::OpenOptions::new().write(true).open(d.path().join(crate::disk::file::TIER_FILE_NAME)).unwrap();
        f.write_at(&[0xff], 3 * 5 * 4096 + 4096 + 77).unwrap();
        f.sync_all().unwrap();
        let disk = open_backend(d.path(), 8 << 20, 4, BackendChoice::Auto).unwrap();
        let (mut t, rec) = Tier::open(disk, TierConfig::default()).unwrap();
        let mut gens: Vec<u64> = rec.blocks.iter().map(|b| b.generation).collect();
        gens.sort();
        assert_eq!(gens, vec![1, 2, 3, 5, 6, 7, 8, 9, 10]);
        assert_eq!(rec.rejected, 1);
        let (got, _) = read_now(&mut t, &key(4));
        assert_eq!(got.unwrap(), block(4, 2, 8192).1);
    }

    /// The child half of `sigkill_mid_write_recovers_every_completed_write`:
    /// writes blocks until killed, printing `W <i> <generation>` for each
    /// completed write and `E <i>` for each eviction. Does nothing unless
    /// `KVFERRY_DISK_CHILD_DIR` is set.
    #[test]
    fn sigkill_child() {
        use std::io::Write;
        let Ok(dir) = std::env::var("KVFERRY_DISK_CHILD_DIR") else { return };
        let disk = open_backend(std::path::Path::new(&dir), 64 << 20, 16, BackendChoice::Auto).unwrap();
        let (mut t, _) = Tier::open(disk, TierConfig { write_queue_max: 16, ..TierConfig::default() }).unwrap();
        let mut out = std::io::stdout().lock();
        let mut i = 0u64;
        loop {
            let (s, b) = block(i, 4, 50_000);
            if t.write(&key(i), &s, &b).is_ok() {
                i += 1;
            }
            for ev in t.poll(true).unwrap() {
                match ev {
                    TierEvent::Written { key, generation } => {
                        let n = u64::from_le_bytes(key.hash.as_bytes()[..8].try_into().unwrap());
                        writeln!(out, "W {n} {generation}").unwrap();
                    }
                    TierEvent::Removed { key, .. } => {
                        let n = u64::from_le_bytes(key.hash.as_bytes()[..8].try_into().unwrap());
                        writeln!(out, "E {n}").unwrap();
                    }
                    TierEvent::Read { .. } => {}
                }
            }
            out.flush().unwrap();
        }
    }

    /// C18 with a real crash: a child process writing through the tier is
    /// SIGKILLed mid-stream; a restart on its directory recovers every
    /// block whose write it saw complete and had not evicted (save the oldest
    /// few, whose eviction the kill may have kept it from reporting), each
    /// verified, with the bytes the child wrote.
    #[test]
    fn sigkill_mid_write_recovers_every_completed_write() {
        /// Records one write's eviction may take (same-sized records: one,
        /// more only when free space is split), reported after the kill.
        const UNREPORTED_EVICTIONS_MAX: usize = 4;
        use std::collections::HashMap;
        use std::io::BufRead;
        let d = dir();
        if let Err(e @ OpenError::DirectIoRefused { .. }) = DiskFile::open(d.path(), 64 << 20) {
            return println!("SKIPPED: {e}");
        }
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "disk::tests::real::sigkill_child", "--nocapture", "--test-threads=1"])
            .env("KVFERRY_DISK_CHILD_DIR", d.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let mut live: HashMap<u64, u64> = HashMap::new();
        let mut seen = 0;
        let handle = |l: &str, live: &mut HashMap<u64, u64>| {
            let f: Vec<&str> = l.split(' ').collect();
            match f.as_slice() {
                ["W", i, g] => {
                    live.insert(i.parse().unwrap(), g.parse().unwrap());
                    1
                }
                ["E", i] => {
                    live.remove(&i.parse().unwrap());
                    0
                }
                _ => 0,
            }
        };
        // Past 64 MiB of writes, so eviction is running too.
        while seen < 400 {
            let Some(Ok(l)) = lines.next() else { break };
            seen += handle(&l, &mut live);
        }
        child.kill().unwrap(); // SIGKILL
        for l in lines.map_while(Result::ok) {
            handle(&l, &mut live);
        }
        let status = child.wait();
        if seen < 400 {
            // The child ended on its own: say why (its panic, if any).
            let mut why = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut why);
            let tail: String = why.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
            panic!("the child wrote only {seen} blocks before it ended ({status:?}); its stderr ends:\n{tail}");
        }
        let disk = open_backend(d.path(), 64 << 20, 16, BackendChoice::Auto).unwrap();
        let (mut t, rec) = Tier::open(disk, TierConfig::default()).unwrap();
        let got: HashMap<u64, u64> = rec
            .blocks
            .iter()
            .map(|b| (u64::from_le_bytes(b.key.hash.as_bytes()[..8].try_into().unwrap()), b.generation))
            .collect();
        let mut missing: Vec<u64> = live.iter().filter(|(i, g)| got.get(i) != Some(g)).map(|(i, _)| *i).collect();
        missing.sort();
        println!("sigkill: {} completed and live, {} recovered, {} missing", live.len(), got.len(), missing.len());
        // The kill can land after a write evicted the LRU record (and its
        // space was overwritten) but before the child printed that `E`:
        // such a record is gone by design, not lost by the crash. With no
        // reads, LRU is write order, so those can only be the oldest live
        // records, and one write evicts at most a few. Any other record
        // missing is a completed write the restart lost.
        let mut oldest: Vec<u64> = live.keys().copied().collect();
        oldest.sort();
        oldest.truncate(UNREPORTED_EVICTIONS_MAX);
        assert!(
            missing.len() <= UNREPORTED_EVICTIONS_MAX && missing.iter().all(|i| oldest.contains(i)),
            "completed writes not recovered: {missing:?} (only the {UNREPORTED_EVICTIONS_MAX} oldest live, {oldest:?}, may be evictions the kill kept the child from printing)"
        );
        let mut sample: Vec<u64> = got.keys().copied().collect();
        sample.sort();
        for &i in sample.iter().step_by(7) {
            let (bytes, _) = read_now(&mut t, &key(i));
            assert_eq!(bytes.unwrap(), block(i, 4, 50_000).1, "block {i}");
        }
    }

    #[test]
    fn open_errors_name_the_problem() {
        let d = dir();
        let missing = d.path().join("nope");
        assert!(matches!(DiskFile::open(&missing, 8 << 20), Err(OpenError::DirMissing { .. })));
        assert!(matches!(DiskFile::open(d.path(), 4096), Err(OpenError::BadSize { .. })));
        let f = d.path().join("plain");
        std::fs::write(&f, b"x").unwrap();
        assert!(matches!(DiskFile::open(&f, 8 << 20), Err(OpenError::NotADir { .. })));
        match DiskFile::open(d.path(), 8 << 20) {
            Ok(file) => {
                assert!(matches!(backend_over(file, 0, BackendChoice::Pio), Err(OpenError::BadDepth { depth: 0, .. })))
            }
            Err(e) => println!("SKIPPED depth check: {e}"),
        }
        let e = DiskFile::open(&missing, 8 << 20).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn a_size_beyond_the_free_space_is_refused_and_leaves_no_file() {
        let d = dir();
        let free = super::super::file::free_bytes_at(d.path()).unwrap();
        let ask = (free + (1 << 30)) & !(crate::limits::DISK_ALIGN_BYTES - 1);
        if ask > crate::limits::DISK_CAPACITY_BYTES_MAX {
            return println!("SKIPPED: {free} B free is more than a tier may take");
        }
        match DiskFile::open(d.path(), ask) {
            Err(OpenError::Allocate { bytes, source, .. }) => {
                assert_eq!(bytes, ask);
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{source}");
            }
            Err(e @ OpenError::DirectIoRefused { .. }) => return println!("SKIPPED: {e}"),
            other => panic!("{ask} B on a file system with {free} B free: {other:?}"),
        }
        assert!(!d.path().join(super::super::file::TIER_FILE_NAME).exists(), "the refused file was left behind");
    }
}
