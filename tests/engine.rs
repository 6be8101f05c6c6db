//! Engine core against a real MetaServer (issue "Engine core"): layouts,
//! save / seal / load, dedup, failed saves, pressure eviction, pool
//! exhaustion, validation errors, the P/D handoff barrier and the ownership
//! source.
//!
//! | test | contract |
//! | --- | --- |
//! | `round_trip_split_layer_first` | save → flush → query → load byte-identical (C1) |
//! | `round_trip_fused_single_segment` | same, fused 1-segment layout (one copy per block) |
//! | `dedup_skips_resident_blocks` | dedup, no new registration (C4 counters) |
//! | `failed_batch_leaves_nothing_resident` | partial save invisible, pool bytes back (C11) |
//! | `pressure_eviction_keeps_leased_and_locked_blocks` | eviction skips pinned blocks (C11), every removal accounted (C4) |
//! | `pool_exhaustion_is_an_error_value` | no panic, `no_space` |
//! | `layout_validation_rejects_each_bad_case` | one assertion per `LayoutError` variant |
//! | `block_index_out_of_range_is_rejected` | `EngineError::BlockIndex` |
//! | `unknown_namespace_is_rejected` | `EngineError::UnknownNamespace` |
//! | `handoff_barrier_sees_33_of_33_registered` | C1 (barrier over saves + registrations) |
//! | `handoff_barrier_covers_a_save_still_in_flight` | C1 (save running on another task) |
//! | `handoff_barrier_bounded_when_metaserver_drops_inserts` | C2, C3 |
//! | `ownership_source_lists_resident_blocks_per_namespace` | C6 source |
//! | `flush_saves_waits_for_a_save_on_another_task` | `flush_saves` |
//! | `device_checksums_seal_like_the_cpu_and_verify_at_a_peer` | C10 with the GPU checksumming the slots |
//! | `saves_and_loads_cut_into_batches_fail_per_batch` | pipelined copy batches: a save is all or nothing, a load fails per batch |
//! | `save_batches_completing_newest_first_seal_each_block_as_its_own` | batches sealed as they complete, in any order: right bytes and checksums per block, invisible until the last lands |
//! | `external_paged_kv_round_trip_and_unregister_rules` | C15: K and V tensors of the embedder's, unregister refused while named, ids never reused, a namespace keeps its family |
//! | `bad_external_memory_is_refused_and_nothing_registers` | C15: null, empty, unaligned, overlapping memory are typed errors |
//! | `a_buffer_under_an_in_flight_copy_cannot_be_unregistered` | C15/C11: `Busy` until the batch completes |
//! | `a_load_starts_no_copy_after_its_deadline_and_awaits_one_started` | C9 (load tail under the deadline, `fetch_into_with_deadline` too), C11 (a started copy is awaited) |

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use kvferry::engine::layout::{
    self, DeviceBufferId, LAYERS_MAX, LayerLayout, LayoutError, OVERLAP_CHECK_RANGES_MAX, SegmentBase,
};
use kvferry::engine::{EngineError, LoadError, SaveReport};
use kvferry::gpu::{BufferError, Gpu, GpuError, HostMemory, KvMemory};
use kvferry::node;
use kvferry::types::BlockHash;
use tokio::time::Instant;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_split_layer_first() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let kv = register_default(e, 16);
        let hs = hashes(1000..1008);
        fill_and_save(e, &kv, 0, &hs).await;
        let rep = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((rep.delivered, rep.dropped, rep.timed_out), (8, 0, false), "{rep:?}");
        assert_eq!(e.query_prefix(NS, &hs), 8);
        assert_eq!(ms_prefix(e, NS, &hs).await, vec![(n.node.clone(), 8)]);
        // Load into other device blocks so the bytes must come from the pool.
        load_and_verify(e, &kv, 8, &hs).await;
        // And back into the original slots after clearing them.
        load_and_verify(e, &kv, 0, &hs).await;
        assert_eq!(e.metrics().saved_blocks.load(Ordering::Relaxed), 8);
        assert_eq!(e.metrics().loaded_blocks.load(Ordering::Relaxed), 16);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_fused_single_segment() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let kv = register(e, NS, LAYERS, 16, 8 << 10, false, false);
        assert!(kv.layers.iter().all(|l| l.segments() == 1 && l.v.is_none()));
        let (_, lay) = e.layout(NS).unwrap();
        assert_eq!(lay.coalesced_copies(3).len(), 1, "fused layout: one copy per block");
        let hs = hashes(2000..2006);
        fill_and_save(e, &kv, 2, &hs).await;
        let rep = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((rep.delivered, rep.dropped, rep.timed_out), (6, 0, false), "{rep:?}");
        assert_eq!(e.query_prefix(NS, &hs), 6);
        assert_eq!(ms_prefix(e, NS, &hs).await, vec![(n.node.clone(), 6)]);
        load_and_verify(e, &kv, 9, &hs).await;
        // A block that is not resident is reported per block, the rest loads.
        let mut mixed: Vec<(BlockHash, u64)> = vec![(hs[0].clone(), 0), (BlockHash::from_u64(9), 1)];
        mixed.push((hs[1].clone(), 15));
        let lr = e.load(NS, &mixed).await.unwrap();
        assert_eq!(lr.results[1], Err(kvferry::engine::LoadError::NotResident));
        assert_eq!(lr.loaded(), 2);
        assert!(verify(e, &kv, 15, &hs[1]));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_skips_resident_blocks() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let kv = register_default(e, 16);
        let hs = hashes(1..7);
        fill_and_save(e, &kv, 0, &hs[..4]).await;
        e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        let used = e.gauges().pool_used_bytes;
        let inserts = e.client().counters().offered_inserts;
        let inserted_at_ms = ms.metrics.inserted_hashes.load(Ordering::Relaxed);

        // All four again: nothing copied, nothing registered.
        let again: Vec<(BlockHash, u64)> = hs[..4].iter().enumerate().map(|(i, h)| (h.clone(), i as u64)).collect();
        let rep = e.save(NS, &again).await.unwrap();
        assert_eq!(rep, SaveReport { saved: vec![], already_resident: 4, no_space: 0 });
        assert_eq!(e.gauges().pool_used_bytes, used);
        assert_eq!(e.client().counters().offered_inserts, inserts, "no registration for resident blocks");

        // Mixed: two resident, two new, one new duplicated within the request.
        for (i, h) in hs[4..].iter().enumerate() {
            fill(e, &kv, 4 + i as u64, h);
        }
        let mixed =
            vec![(hs[0].clone(), 0), (hs[4].clone(), 4), (hs[1].clone(), 1), (hs[5].clone(), 5), (hs[4].clone(), 4)];
        let rep = e.save(NS, &mixed).await.unwrap();
        assert_eq!(rep.saved, vec![hs[4].clone(), hs[5].clone()]);
        assert_eq!(rep.already_resident, 3);
        assert_eq!(rep.no_space, 0);
        assert_eq!(e.client().counters().offered_inserts, inserts + 2, "only the new blocks are registered");
        let fr = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((fr.delivered, fr.dropped), (2, 0), "{fr:?}");
        assert_eq!(ms.metrics.inserted_hashes.load(Ordering::Relaxed), inserted_at_ms + 2);
        assert_eq!(e.gauges().resident_blocks, 6);
        assert_eq!(e.gauges().pool_used_bytes, 6 * BLOCK);
        assert_eq!(e.metrics().saved_blocks.load(Ordering::Relaxed), 6);
        load_and_verify(e, &kv, 8, &hs).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_batch_leaves_nothing_resident() {
    bounded(async {
        let ms = start_ms().await;
        let (n, gpu) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let kv = register_default(e, 16);
        let first = hashes(10..12);
        fill_and_save(e, &kv, 0, &first).await;
        let before = e.gauges();
        let inserts = e.client().counters().offered_inserts;

        let hs = hashes(20..24);
        let blocks = fill_blocks(e, &kv, 4, &hs);
        gpu.fail_next_batches(1);
        let err = e.save(NS, &blocks).await.expect_err("the batch failed");
        assert!(matches!(err, EngineError::Gpu(GpuError::Device(_))), "{err:?}");
        // Nothing of the failed batch is visible, registered or holding pool memory.
        assert_eq!(e.query_prefix(NS, &hs), 0);
        assert_eq!(e.lease(NS, &hs[..1]).len(), 0);
        assert_eq!(e.gauges(), before, "pool bytes and residency back to the previous level");
        assert_eq!(e.client().counters().offered_inserts, inserts);
        assert_eq!(e.resident_blocks(), vec![(NS.to_string(), { first.clone() })]);
        let fr = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert!(!fr.timed_out, "a failed save does not block the barrier");
        assert_eq!(ms_prefix_of(e, NS, &hs, &n.node).await, 0);
        let lr = e.load(NS, &[(hs[0].clone(), 8)]).await.unwrap();
        assert_eq!(lr.results, vec![Err(kvferry::engine::LoadError::NotResident)]);

        // The retry succeeds from a clean state.
        let rep = e.save(NS, &blocks).await.unwrap();
        assert_eq!(rep.saved, hs);
        load_and_verify(e, &kv, 8, &hs).await;

        // A failed load reports every block with the copy error and changes nothing.
        gpu.fail_next_batches(1);
        let lr = e.load(NS, &[(hs[0].clone(), 12), (hs[1].clone(), 13)]).await.unwrap();
        assert_eq!(lr.loaded(), 0);
        assert!(lr.results.iter().all(|r| matches!(r, Err(kvferry::engine::LoadError::Copy(GpuError::Device(_))))));
        assert_eq!(e.gauges().resident_blocks, 6);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pressure_eviction_keeps_leased_and_locked_blocks() {
    bounded(async {
        let ms = start_ms().await;
        // Room for exactly 8 blocks.
        let (n, _) = start_node(&ms, 8 * BLOCK).await;
        let e = &n.engine;
        let kv = register_default(e, 16);
        let old = hashes(100..108);
        fill_and_save(e, &kv, 0, &old).await;
        assert_eq!(e.gauges().pool_free_bytes, 0);
        let fr = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(fr.delivered, 8);

        // Pin 0,1 by a lease and 2,3 by a transfer lock, then make 4..8 the
        // most recently used, so LRU order alone would pick the pinned ones.
        let lease = e.lease(NS, &old[0..2]);
        assert_eq!(lease.len(), 2);
        let (session, locked) = e.lock_for_transfer(NS, &old[2..4]).unwrap();
        let session = session.expect("session");
        assert_eq!(locked.len(), 2);
        drop(e.lease(NS, &old[4..8]));

        let new = hashes(200..204);
        fill_and_save(e, &kv, 8, &new).await;
        assert_eq!(e.query_prefix(NS, &old[0..4]), 4, "leased and locked blocks survive");
        for h in &old[4..8] {
            assert_eq!(e.query_prefix(NS, std::slice::from_ref(h)), 0, "unpinned LRU blocks are evicted");
        }
        assert_eq!(e.query_prefix(NS, &new), 4);
        let m = e.metrics();
        let evicted = m.evicted.load(Ordering::Relaxed);
        assert_eq!(evicted, 4);
        assert_eq!(
            evicted,
            m.removals_enqueued.load(Ordering::Relaxed) + m.removals_dropped_at_enqueue.load(Ordering::Relaxed),
            "C4: every eviction sends or counts a removal"
        );
        // The removals reach the MetaServer: evicted blocks are no longer listed.
        let fr = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((fr.dropped, fr.timed_out), (0, false), "{fr:?}");
        assert_eq!(ms_prefix_of(e, NS, &old[..4], &n.node).await, 4);
        assert_eq!(ms_prefix_of(e, NS, &old[4..], &n.node).await, 0);
        assert!(e.client().counters().identity_holds());
        // The pinned blocks still hold their bytes.
        load_and_verify(e, &kv, 12, &old[..4]).await;

        // Unpinned, they are evictable again.
        drop(lease);
        assert_eq!(e.release_transfer(&session), Ok(2));
        drop(locked);
        let newer = hashes(300..304);
        fill_and_save(e, &kv, 4, &newer).await;
        assert_eq!(e.query_prefix(NS, &newer), 4);
        let evicted = m.evicted.load(Ordering::Relaxed);
        assert_eq!(evicted, 8);
        assert_eq!(
            evicted,
            m.removals_enqueued.load(Ordering::Relaxed) + m.removals_dropped_at_enqueue.load(Ordering::Relaxed)
        );
        assert_eq!(e.gauges().resident_blocks, 8);
        let fr = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!(fr.dropped, 0);
        let mut listed = 0;
        for h in old.iter().chain(&new).chain(&newer) {
            listed += ms_prefix_of(e, NS, std::slice::from_ref(h), &n.node).await;
        }
        assert_eq!(listed, 8, "the MetaServer lists exactly the resident blocks");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_exhaustion_is_an_error_value() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * BLOCK).await;
        let e = &n.engine;
        let kv = register_default(e, 16);
        let hs = hashes(1..5);
        fill_and_save(e, &kv, 0, &hs).await;
        let lease = e.lease(NS, &hs[..2]);
        let (session, _) = e.lock_for_transfer(NS, &hs[2..]).unwrap();

        let more = hashes(10..13);
        let blocks: Vec<(BlockHash, u64)> = more.iter().enumerate().map(|(i, h)| (h.clone(), 4 + i as u64)).collect();
        for (h, idx) in &blocks {
            fill(e, &kv, *idx, h);
        }
        let rep = e.save(NS, &blocks).await.expect("pool exhaustion is a report, not an error");
        assert_eq!(rep, SaveReport { saved: vec![], already_resident: 0, no_space: 3 });
        assert_eq!(e.metrics().evicted.load(Ordering::Relaxed), 0);
        assert!(e.metrics().alloc_failures.load(Ordering::Relaxed) >= 1);
        assert_eq!(e.query_prefix(NS, &hs), 4, "pinned blocks untouched");
        assert_eq!(e.query_prefix(NS, &more), 0);
        assert_eq!(e.gauges().pool_used_bytes, 4 * BLOCK);

        // Release one pin set: two blocks can be made room for, the third cannot.
        e.release_transfer(&session.unwrap()).unwrap();
        let rep = e.save(NS, &blocks).await.unwrap();
        assert_eq!(rep.saved, more[..2].to_vec());
        assert_eq!(rep.no_space, 1);
        assert_eq!(e.query_prefix(NS, &hs[..2]), 2);
        drop(lease);
        load_and_verify(e, &kv, 8, &more[..2]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_validation_rejects_each_bad_case() {
    bounded(async {
        let ms = start_ms().await;
        let (n, gpu) = start_node(&ms, MIB).await;
        let e = &n.engine;
        let buf = gpu.alloc(64 << 10).unwrap();
        // A valid single-segment layer: 4 blocks of 1 KiB.
        let ok = LayerLayout::paged(buf, None, 4, 1024);
        let at = |offset: u64| LayerLayout { k: SegmentBase::new(buf, offset), ..ok };
        let reject = |layers: Vec<LayerLayout>| match e.register_layout("bad", layers) {
            Err(EngineError::Layout(l)) => l,
            other => panic!("expected a layout error, got {other:?}"),
        };

        assert_eq!(reject(vec![]), LayoutError::NoLayers);
        let many = layout::contiguous(buf, LAYERS_MAX as u32 + 1, 1, 8, false, true);
        assert_eq!(reject(many), LayoutError::TooManyLayers { n: LAYERS_MAX + 1 });
        let unknown = LayerLayout::paged(DeviceBufferId(999), None, 4, 1024);
        assert_eq!(
            reject(vec![ok, unknown]),
            LayoutError::UnknownBuffer { layer: 1, segment: 0, buffer: DeviceBufferId(999) }
        );
        assert_eq!(reject(vec![LayerLayout { num_blocks: 0, ..ok }]), LayoutError::ZeroBlocks { layer: 0 });
        let mismatch = LayerLayout { num_blocks: 5, ..at(8192) };
        assert_eq!(reject(vec![ok, mismatch]), LayoutError::BlockCountMismatch { layer: 1, expected: 4, got: 5 });
        assert_eq!(reject(vec![LayerLayout { bytes_per_block: 0, ..ok }]), LayoutError::ZeroBytes { layer: 0 });
        let split = LayerLayout { block_stride: 2048, v: Some(SegmentBase::new(buf, 1023)), ..ok };
        assert_eq!(reject(vec![split]), LayoutError::Overlap { a: (0, 0), b: (0, 1) });
        assert_eq!(
            reject(vec![LayerLayout { block_stride: 1023, ..ok }]),
            LayoutError::BlockStrideTooSmall { layer: 0, block_stride: 1023, bytes_per_block: 1024 }
        );
        assert_eq!(reject(vec![at(u64::MAX - 10)]), LayoutError::Overflow { layer: 0 });
        assert_eq!(
            reject(vec![at(61 << 10)]),
            LayoutError::OutOfBounds {
                layer: 0,
                segment: 0,
                buffer: buf,
                last_byte: (65 << 10) - 1,
                buffer_len: 64 << 10
            }
        );
        assert_eq!(reject(vec![ok, at(3 * 1024 + 512)]), LayoutError::Overlap { a: (0, 0), b: (1, 0) });
        // Two different block strides on one buffer with more ranges than the
        // exact sweep may enumerate.
        let nb = OVERLAP_CHECK_RANGES_MAX / 2 + 1;
        let big = gpu.alloc(6 * nb).unwrap();
        let l0 =
            LayerLayout { num_blocks: nb, bytes_per_block: 1, block_stride: 2, k: SegmentBase::new(big, 0), v: None };
        let l1 = LayerLayout { block_stride: 3, k: SegmentBase::new(big, 2 * nb), ..l0 };
        assert_eq!(reject(vec![l0, l1]), LayoutError::TooLarge { ranges: 2 * nb, max: OVERLAP_CHECK_RANGES_MAX });

        // Nothing of the above was registered; other namespace-level errors.
        assert!(matches!(e.layout("bad"), Err(EngineError::UnknownNamespace(_))));
        assert!(matches!(e.register_layout("", vec![ok]), Err(EngineError::Id(_))));
        // A KvFamily namespace names its layer count; another count is refused.
        let two = "kvferry1|model=m|dtype=bf16|bt=16|tp=0/1|layers=2";
        match e.register_layout(two, vec![ok]) {
            Err(EngineError::NamespaceMismatch { named: 2, given: 1, .. }) => {}
            other => panic!("expected NamespaceMismatch, got {other:?}"),
        }
        e.register_layout("good", vec![ok]).unwrap();
        e.register_layout("good", vec![ok]).expect("the same layout again is a no-op");
        let other = LayerLayout { num_blocks: 2, ..ok };
        assert!(matches!(e.register_layout("good", vec![other]), Err(EngineError::LayoutExists(_))));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_index_out_of_range_is_rejected() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, MIB).await;
        let e = &n.engine;
        let kv = register_default(e, 8);
        let h = BlockHash::from_u64(1);
        fill(e, &kv, 0, &h);
        let err = e.save(NS, &[(h.clone(), 0), (BlockHash::from_u64(2), 8)]).await.unwrap_err();
        assert!(matches!(err, EngineError::BlockIndex { idx: 8, num_blocks: 8 }), "{err:?}");
        assert_eq!(e.gauges().resident_blocks, 0, "a rejected request saves nothing, not even its valid part");
        assert_eq!(e.gauges().pool_used_bytes, 0);
        let err = e.save(NS, &[(h.clone(), u64::MAX)]).await.unwrap_err();
        assert!(matches!(err, EngineError::BlockIndex { idx: u64::MAX, num_blocks: 8 }), "{err:?}");
        e.save(NS, &[(h.clone(), 0)]).await.unwrap();
        let err = e.load(NS, &[(h.clone(), 1), (h.clone(), 9)]).await.unwrap_err();
        assert!(matches!(err, EngineError::BlockIndex { idx: 9, num_blocks: 8 }), "{err:?}");
        assert_eq!(e.metrics().loads.load(Ordering::Relaxed), 0);
        // An empty hash is rejected as an id error.
        let err = e.save(NS, &[(BlockHash::new(Vec::<u8>::new()), 1)]).await.unwrap_err();
        assert!(matches!(err, EngineError::Id(_)), "{err:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_namespace_is_rejected() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, MIB).await;
        let e = &n.engine;
        let _kv = register_default(e, 8);
        let h = BlockHash::from_u64(1);
        let err = e.save("nope", &[(h.clone(), 0)]).await.unwrap_err();
        assert!(matches!(err, EngineError::UnknownNamespace(ref s) if s == "nope"), "{err:?}");
        let err = e.load("nope", &[(h.clone(), 0)]).await.unwrap_err();
        assert!(matches!(err, EngineError::UnknownNamespace(_)), "{err:?}");
        assert!(matches!(e.layout("nope"), Err(EngineError::UnknownNamespace(_))));
        assert_eq!(e.query_prefix("nope", std::slice::from_ref(&h)), 0);
        assert!(e.lease("nope", std::slice::from_ref(&h)).is_empty());
        let (s, found) = e.lock_for_transfer("nope", std::slice::from_ref(&h)).unwrap();
        assert!(s.is_none() && found.is_empty());
        let rep = e.fetch("nope", &[h]).await;
        assert_eq!(rep.available, 0);
        assert_eq!(rep.stopped, Some(kvferry::engine::fetch::FetchError::UnknownNamespace));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_barrier_sees_33_of_33_registered() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let kv = register_default(e, 40);
        let hs = hashes(5000..5033);
        // Three saves of uneven size, then the barrier at once.
        fill_and_save(e, &kv, 0, &hs[..1]).await;
        fill_and_save(e, &kv, 1, &hs[1..20]).await;
        fill_and_save(e, &kv, 20, &hs[20..]).await;
        let rep = e.flush_saves_and_registrations(Duration::from_secs(2)).await;
        assert_eq!((rep.delivered, rep.dropped, rep.timed_out), (33, 0, false), "{rep:?}");
        // Right after it returns, the MetaServer answers 33 of 33 — over gRPC
        // and in its store.
        assert_eq!(ms_prefix(e, NS, &hs).await, vec![(n.node.clone(), 33)]);
        let entries = ms.store_for_testing().lock().unwrap().visible_entries(0);
        let mine = entries.iter().filter(|(ns, h, node)| ns == NS && hs.contains(h) && *node == n.node).count();
        assert_eq!(mine, 33);
        assert!(e.client().counters().identity_holds());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_barrier_covers_a_save_still_in_flight() {
    bounded(async {
        let ms = start_ms().await;
        let gpu = Arc::new(GatedGpu::new());
        let n = node::start(node_cfg(ms.local_addr, 4 * MIB), gpu.clone() as Arc<dyn Gpu>).await.unwrap();
        let e = n.engine.clone();
        let kv = register_default(&e, 40);
        let hs = hashes(7000..7033);
        let saver = spawn_save(&e, fill_blocks(&e, &kv, 0, &hs));
        assert!(eventually(Duration::from_secs(5), || gpu.held() == 1).await);
        assert_eq!(e.query_prefix(NS, &hs), 0, "nothing visible before the seal");
        let opener = {
            let gpu = gpu.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                gpu.set_open(true);
            })
        };
        let t0 = Instant::now();
        let rep = e.flush_saves_and_registrations(Duration::from_secs(3)).await;
        assert!(t0.elapsed() >= Duration::from_millis(150), "the barrier waited for the save");
        assert_eq!((rep.delivered, rep.dropped, rep.timed_out), (33, 0, false), "{rep:?}");
        assert_eq!(ms_prefix(&e, NS, &hs).await, vec![(n.node.clone(), 33)]);
        assert_eq!(saver.await.unwrap().unwrap().saved.len(), 33);
        opener.await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_barrier_bounded_when_metaserver_drops_inserts() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let kv = register_default(e, 40);
        ms.hooks.drop_writes_ppm.store(1_000_000, Ordering::SeqCst);
        let hs = hashes(9000..9033);
        fill_and_save(e, &kv, 0, &hs).await;
        let deadline = Duration::from_secs(1);
        let t0 = Instant::now();
        let rep = e.flush_saves_and_registrations(deadline).await;
        let took = t0.elapsed();
        assert!(took <= deadline + Duration::from_millis(250), "barrier took {took:?}");
        assert_eq!((rep.delivered, rep.dropped, rep.timed_out), (0, 33, false), "{rep:?}");
        assert!(ms.hooks.dropped_writes.load(Ordering::Relaxed) >= 1);
        assert!(ms_prefix(e, NS, &hs).await.is_empty(), "nothing was registered");
        // Still resident and loadable locally.
        assert_eq!(e.query_prefix(NS, &hs), 33);
        assert!(e.client().counters().identity_holds());

        // A stalled MetaServer: the barrier ends by its deadline.
        ms.hooks.drop_writes_ppm.store(0, Ordering::SeqCst);
        ms.hooks.stall.store(true, Ordering::SeqCst);
        let more = hashes(9100..9103);
        fill_and_save(e, &kv, 33, &more).await;
        let deadline = Duration::from_millis(300);
        let t0 = Instant::now();
        let rep = e.flush_saves_and_registrations(deadline).await;
        assert!(t0.elapsed() <= deadline + Duration::from_millis(250), "barrier took {:?}", t0.elapsed());
        assert!(rep.timed_out || rep.dropped == 3, "{rep:?}");
        assert_eq!(rep.delivered, 0);
        ms.hooks.stall.store(false, Ordering::SeqCst);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_source_lists_resident_blocks_per_namespace() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 10 * BLOCK).await;
        let e = &n.engine;
        assert!(e.resident_blocks().is_empty());
        let a = register(e, "ns-a", LAYERS, 8, SEG, true, true);
        let b = register(e, "ns-b", LAYERS, 8, SEG, false, false);
        let ha = hashes(30..34);
        let hb = hashes(20..22);
        fill_and_save(e, &a, 0, &ha).await;
        fill_and_save(e, &b, 0, &hb).await;
        // The same hash in two namespaces is two blocks.
        fill_and_save(e, &b, 2, &ha[..1]).await;
        let mut hb_all = hb.clone();
        hb_all.push(ha[0].clone());
        hb_all.sort();
        assert_eq!(e.resident_blocks(), vec![("ns-a".to_string(), ha.clone()), ("ns-b".to_string(), hb_all)]);
        assert_eq!(e.gauges().resident_blocks, 7);
        // After eviction the source follows the cache.
        let evicted = e.evict(u64::MAX);
        assert_eq!(evicted, 7);
        assert!(e.resident_blocks().is_empty());
        assert_eq!(e.gauges().pool_used_bytes, 0);
        let m = e.metrics();
        assert_eq!(
            m.evicted.load(Ordering::Relaxed),
            m.removals_enqueued.load(Ordering::Relaxed) + m.removals_dropped_at_enqueue.load(Ordering::Relaxed)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_saves_waits_for_a_save_on_another_task() {
    bounded(async {
        let ms = start_ms().await;
        let gpu = Arc::new(GatedGpu::new());
        let n = node::start(node_cfg(ms.local_addr, 4 * MIB), gpu.clone() as Arc<dyn Gpu>).await.unwrap();
        let e = n.engine.clone();
        let kv = register_default(&e, 8);
        let hs = hashes(40..44);
        let saver = spawn_save(&e, fill_blocks(&e, &kv, 0, &hs));
        assert!(eventually(Duration::from_secs(5), || gpu.held() == 1).await);
        // While the copy is not complete, flush_saves does not return.
        let blocked = tokio::time::timeout(Duration::from_millis(200), e.flush_saves()).await;
        assert!(blocked.is_err(), "flush_saves returned while a save was in flight");
        // Even if the saving task's caller goes away, the save finishes and the barrier lifts.
        saver.abort();
        let waiter = {
            let e = e.clone();
            tokio::spawn(async move { e.flush_saves().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        gpu.set_open(true);
        tokio::time::timeout(Duration::from_secs(2), waiter).await.expect("flush_saves returns").unwrap();
        assert_eq!(e.query_prefix(NS, &hs), 4, "after flush_saves the save is sealed");
        // Another save held in flight: flush_saves keeps waiting until its completion.
        gpu.set_open(false);
        let h2 = hashes(50..51);
        let late = spawn_save(&e, fill_blocks(&e, &kv, 5, &h2));
        assert!(eventually(Duration::from_secs(5), || gpu.held() == 1).await);
        tokio::time::timeout(Duration::from_secs(1), e.flush_saves())
            .await
            .expect_err("a save in flight when flush_saves is called is covered");
        gpu.set_open(true);
        late.await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_secs(1), e.flush_saves()).await.expect("nothing in flight");
    })
    .await;
}

/// The seal path the CUDA backend takes (slot checksums computed from the
/// device bytes by the backend, folded from pieces) gives the same
/// checksums as the CPU seal, and a peer fetching those blocks verifies
/// every one (C10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_checksums_seal_like_the_cpu_and_verify_at_a_peer() {
    bounded(async {
        let ms = start_ms().await;
        let gpu = Arc::new(kvferry::gpu::host::HostGpu::with_device_checksums());
        let p = node::start(node_cfg(ms.local_addr, 4 * MIB), gpu.clone() as Arc<dyn Gpu>).await.unwrap();
        let (d, _) = start_node(&ms, 4 * MIB).await;
        let kp = register_default(&p.engine, 16);
        let kd = register_default(&d.engine, 16);
        let hs = hashes(500..512);
        fill_and_save(&p.engine, &kp, 0, &hs).await;
        assert_eq!(p.engine.metrics().device_checksummed_blocks.load(Ordering::Relaxed), 12);
        let (_, layout) = p.engine.layout(NS).unwrap();
        let (sid, locked) = p.engine.lock_for_transfer(NS, &hs).unwrap();
        for (h, b) in &locked {
            assert_eq!(b.checksums, kvferry::engine::slot_checksums(&layout, b.extent.as_slice()), "{h:?}");
        }
        p.engine.release_transfer(&sid.unwrap()).unwrap();
        let fr = p.engine.flush_saves_and_registrations(Duration::from_secs(3)).await;
        assert_eq!((fr.delivered, fr.timed_out), (12, false), "{fr:?}");
        let rep = d.engine.fetch(NS, &hs).await;
        assert_eq!((rep.available, rep.fetched), (12, 12), "{rep:?}");
        assert_eq!(d.engine.metrics().checksum_failures.load(Ordering::Relaxed), 0);
        load_and_verify(&d.engine, &kd, 0, &hs).await;
        // The plain host backend leaves checksumming to the engine.
        assert_eq!(d.engine.metrics().device_checksummed_blocks.load(Ordering::Relaxed), 0);
    })
    .await;
}

/// Saves and loads of more than `limits::COPY_BATCH_OPS_FIRST` copy ops are
/// cut into several copy batches submitted back to back. A failure of any
/// batch fails the whole save (nothing resident, pool bytes back); a failed
/// load batch fails exactly its own blocks and the others land byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saves_and_loads_cut_into_batches_fail_per_batch() {
    bounded(async {
        let ms = start_ms().await;
        let (n, gpu) = start_node(&ms, 16 * MIB).await;
        let e = &n.engine;
        // 64 layers x K/V, layer-first: 128 copy ops per block, so batches
        // of 4, 8, 16... blocks.
        let kv = register(e, NS, 64, 40, 1 << 10, true, true);
        let per_block = e.layout(NS).unwrap().1.coalesced_copies(0).len();
        assert_eq!(kvferry::limits::COPY_BATCH_OPS_FIRST / per_block, 4);
        let hs = hashes(100..114);
        let blocks = fill_blocks(e, &kv, 0, &hs);
        let before = e.gauges();
        gpu.fail_next_batches_after(1, 1);
        let err = e.save(NS, &blocks).await.expect_err("the second batch failed");
        assert!(matches!(err, EngineError::Gpu(GpuError::Device(_))), "{err:?}");
        assert_eq!(e.query_prefix(NS, &hs), 0);
        assert_eq!(e.gauges(), before, "every extent of every batch back in the pool");

        let rep = e.save(NS, &blocks).await.unwrap();
        assert_eq!(rep.saved, hs);
        load_and_verify(e, &kv, 20, &hs).await;

        // Load into 20..34: batches of 4, 8 and 2 blocks; the second fails.
        let loads: Vec<(BlockHash, u64)> = hs.iter().enumerate().map(|(i, h)| (h.clone(), 20 + i as u64)).collect();
        for (_, idx) in &loads {
            clear(e, &kv, *idx);
        }
        gpu.fail_next_batches_after(1, 1);
        let lr = e.load(NS, &loads).await.unwrap();
        let failed: Vec<usize> = (0..loads.len()).filter(|&i| lr.results[i].is_err()).collect();
        assert_eq!(failed, (4..12).collect::<Vec<_>>(), "exactly the second batch's blocks: {:?}", lr.results);
        for (i, (h, idx)) in loads.iter().enumerate() {
            assert_eq!(verify(e, &kv, *idx, h), !failed.contains(&i), "block {i}");
        }
    })
    .await;
}

/// A save's copy batches are sealed as they complete, in whatever order:
/// completing newest first, every block still gets its own extent and slot
/// checksums, and none is visible before the last batch landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_batches_completing_newest_first_seal_each_block_as_its_own() {
    bounded(async {
        let ms = start_ms().await;
        let gpu = Arc::new(GatedGpu::with_device_checksums());
        let n = node::start(node_cfg(ms.local_addr, 16 * MIB), gpu.clone() as Arc<dyn Gpu>).await.unwrap();
        let e = n.engine.clone();
        // 128 copy ops per block: batches of 4, 8 and 2 blocks.
        let kv = register(&e, NS, 64, 40, 1 << 10, true, true);
        let hs = hashes(300..314);
        let saver = spawn_save(&e, fill_blocks(&e, &kv, 0, &hs));
        assert!(eventually(Duration::from_secs(5), || gpu.held() == 3).await, "three batches in flight");
        while gpu.release_newest() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if gpu.held() > 0 {
                assert_eq!(e.query_prefix(NS, &hs), 0, "visible before every batch landed");
            }
        }
        let rep = saver.await.unwrap().unwrap();
        assert_eq!(rep.saved, hs);
        gpu.set_open(true);
        assert_eq!(e.metrics().device_checksummed_blocks.load(Ordering::Relaxed), 14);
        let (_, layout) = e.layout(NS).unwrap();
        let (sid, locked) = e.lock_for_transfer(NS, &hs).unwrap();
        for (h, b) in &locked {
            assert_eq!(b.checksums, kvferry::engine::slot_checksums(&layout, b.extent.as_slice()), "{h:?}");
        }
        e.release_transfer(&sid.unwrap()).unwrap();
        load_and_verify(&e, &kv, 20, &hs).await;
    })
    .await;
}

// ------------------------------------------------------- C15 embedder memory

/// A paged K/V layout over memory the test allocated (per layer a K and a
/// V tensor of its own): round trip byte for byte, and the unregister
/// rules — refused while the layout names the buffer, fine after, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_paged_kv_round_trip_and_unregister_rules() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, 4 * MIB).await;
        let e = &n.engine;
        let (layers, blocks, seg) = (3usize, 8u64, 4096u64);
        let memory: Vec<HostMemory> = (0..2 * layers).map(|_| HostMemory::new(blocks * seg).unwrap()).collect();
        // SAFETY: `memory` outlives every registration (unregistered below).
        let ids: Vec<DeviceBufferId> =
            memory.iter().map(|m| unsafe { e.register_buffer(m.addr(), m.len()) }.unwrap()).collect();
        let ll: Vec<LayerLayout> =
            (0..layers).map(|l| LayerLayout::paged(ids[2 * l], Some(ids[2 * l + 1]), blocks, seg)).collect();
        e.register_layout(NS, ll.clone()).unwrap();
        let kv = Kv { ns: NS.into(), buffer: ids[0], layers: ll, memory: Arc::new(Vec::new()) };
        let hs = hashes(1..5);
        fill_and_save(e, &kv, 2, &hs).await;
        // The bytes are in the test's own memory, where the layout says.
        let mut want = vec![0u8; seg as usize];
        kvferry::replay::trace::fill_kv(NS, &hs[0], 1, 1, &mut want);
        // SAFETY: reading the test's own, live memory.
        let v1 = unsafe { std::slice::from_raw_parts((memory[3].addr() + 2 * seg) as *const u8, seg as usize) };
        assert_eq!(v1, &want[..], "layer 1 V of block 2 is at 2 * seg in the layer's V tensor");
        load_and_verify(e, &kv, 4, &hs).await;

        match e.unregister_buffer(ids[3]) {
            Err(EngineError::BufferInUse { buffer, namespace }) => {
                assert_eq!((buffer, namespace.as_str()), (ids[3], NS))
            }
            other => panic!("expected BufferInUse, got {other:?}"),
        }
        e.unregister_layout(NS).unwrap();
        assert!(matches!(e.unregister_layout(NS), Err(EngineError::UnknownNamespace(_))));
        for id in &ids {
            e.unregister_buffer(*id).unwrap();
        }
        assert!(matches!(
            e.unregister_buffer(ids[0]),
            Err(EngineError::Gpu(GpuError::Buffer(BufferError::Unknown(_))))
        ));
        // The cached blocks survived the layout: a layout of the same
        // family over new memory serves them again.
        let again = HostMemory::new(blocks * seg * 2 * layers as u64).unwrap();
        // SAFETY: `again` outlives the registration.
        let id = unsafe { e.register_buffer(again.addr(), again.len()) }.unwrap();
        assert!(!ids.contains(&id), "buffer ids are never reused");
        let kv2 = Kv {
            ns: NS.into(),
            buffer: id,
            layers: layout::contiguous(id, layers as u32, blocks, seg, true, true),
            memory: Arc::new(vec![Box::new(again) as Box<dyn KvMemory>]),
        };
        e.register_layout(NS, kv2.layers.clone()).unwrap();
        assert_eq!(e.query_prefix(NS, &hs), 4);
        load_and_verify(e, &kv2, 0, &hs).await;
        // …but not a layout of another family under the same namespace.
        e.unregister_layout(NS).unwrap();
        let other = layout::contiguous(id, layers as u32, blocks, seg, false, true);
        match e.register_layout(NS, other) {
            Err(EngineError::FamilyMismatch { had, got, .. }) => {
                assert_eq!(had.to_string(), "3 layers × 2 segment(s) × 4096 B");
                assert_eq!(got.to_string(), "3 layers × 1 segment(s) × 4096 B");
            }
            other => panic!("expected FamilyMismatch, got {other:?}"),
        }
    })
    .await;
}

/// Bad external memory is a typed error with the numbers in its message,
/// and nothing is registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_external_memory_is_refused_and_nothing_registers() {
    bounded(async {
        let ms = start_ms().await;
        let (n, _) = start_node(&ms, MIB).await;
        let e = &n.engine;
        let m = HostMemory::new(4096).unwrap();
        let refuse = |addr: u64, len: u64| -> BufferError {
            // SAFETY: every case is refused before anything is registered.
            match unsafe { e.register_buffer(addr, len) } {
                Err(EngineError::Gpu(GpuError::Buffer(b))) => b,
                other => panic!("expected a buffer error for [{addr:#x}, +{len}), got {other:?}"),
            }
        };
        assert_eq!(refuse(0, 64), BufferError::Null);
        assert_eq!(refuse(m.addr(), 0), BufferError::Empty { addr: m.addr() });
        let odd = refuse(m.addr() + 1, 64);
        assert_eq!(odd, BufferError::Unaligned { addr: m.addr() + 1, align: 16 });
        assert!(odd.to_string().contains("is not aligned to 16 bytes"), "{odd}");
        // SAFETY: `m` outlives the registration.
        let id = unsafe { e.register_buffer(m.addr(), m.len()) }.unwrap();
        let over = refuse(m.addr() + 1024, 4096);
        assert!(matches!(over, BufferError::Overlap { other, .. } if other == id), "{over}");
        assert!(over.to_string().contains(&format!("overlaps {id}")), "{over}");
        // The one good registration is the only one.
        assert_eq!(e.gpu().buffer_len(id), Some(4096));
        assert_eq!(e.gpu().buffer_len(DeviceBufferId(id.0 + 1)), None);
        e.unregister_buffer(id).unwrap();
    })
    .await;
}

/// A buffer an in-flight copy batch touches cannot be unregistered (the
/// gated GPU holds a save's completion, as a device holds its copy): the
/// layout can go, the buffer only once the batch completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_under_an_in_flight_copy_cannot_be_unregistered() {
    bounded(async {
        let ms = start_ms().await;
        let gpu = Arc::new(GatedGpu::new());
        let n = node::start(node_cfg(ms.local_addr, 4 * MIB), gpu.clone() as Arc<dyn Gpu>).await.unwrap();
        let e = n.engine.clone();
        let kv = register_default(&e, 8);
        let hs = hashes(1..3);
        let saver = spawn_save(&e, fill_blocks(&e, &kv, 0, &hs));
        assert!(eventually(Duration::from_secs(5), || gpu.held() == 1).await);
        e.unregister_layout(NS).unwrap();
        match e.unregister_buffer(kv.buffer) {
            Err(EngineError::Gpu(GpuError::Buffer(BufferError::Busy { id, batches }))) => {
                assert_eq!((id, batches), (kv.buffer, 1));
            }
            other => panic!("expected Busy, got {other:?}"),
        }
        gpu.set_open(true);
        assert_eq!(saver.await.unwrap().unwrap().saved.len(), 2, "the save finished on the old layout");
        e.unregister_buffer(kv.buffer).unwrap();
    })
    .await;
}

/// A load (and `fetch_into`'s load tail) submits no copy after its
/// deadline: those blocks are `LoadError::Deadline` and their KV blocks are
/// left untouched, so the report says exactly which blocks are in the
/// caller's KV. A copy submitted before the deadline and still running
/// after it is awaited (it writes the caller's KV, C11) and counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_starts_no_copy_after_its_deadline_and_awaits_one_started() {
    bounded(async {
        let ms = start_ms().await;
        let gpu = Arc::new(GatedGpu::new());
        gpu.set_open(true);
        let n = node::start(node_cfg(ms.local_addr, 4 * MIB), gpu.clone() as Arc<dyn Gpu>).await.unwrap();
        let e = n.engine.clone();
        let kv = register_default(&e, 40);
        let hs = hashes(7400..7404);
        fill_and_save(&e, &kv, 0, &hs).await;
        let to: Vec<(BlockHash, u64)> = hs.iter().cloned().zip(10u64..).collect();
        let untouched = |e: &kvferry::engine::Engine| (10..14).zip(&hs).all(|(i, h)| !verify(e, &kv, i, h));
        for i in 10..14 {
            clear(&e, &kv, i);
        }

        // The deadline has passed: nothing is copied.
        let r = e.load_with_deadline(NS, &to, Instant::now()).await.unwrap();
        assert!(r.results.iter().all(|r| *r == Err(LoadError::Deadline)), "{r:?}");
        assert!(untouched(&e), "no copy after the deadline");
        // The same for fetch_into's load tail: every block is resident
        // here (the fetch has nothing to do), none is loaded.
        let f = e.fetch_into_with_deadline(NS, &to, Instant::now()).await.unwrap();
        assert_eq!((f.fetch.available, f.ready()), (4, 0), "{f:?}");
        assert!(f.load.results.iter().all(|r| *r == Err(LoadError::Deadline)), "{f:?}");
        assert!(untouched(&e), "no copy after the deadline");

        // A copy submitted before the deadline, held past it: awaited.
        gpu.set_open(false);
        let deadline = Instant::now() + Duration::from_millis(100);
        let loader = {
            let (e, to) = (e.clone(), to.clone());
            tokio::spawn(async move { e.load_with_deadline(NS, &to, deadline).await })
        };
        assert!(eventually(Duration::from_secs(5), || gpu.held() >= 1).await);
        tokio::time::sleep_until(deadline + Duration::from_millis(100)).await;
        assert!(!loader.is_finished(), "a copy in flight is awaited past the deadline");
        gpu.set_open(true);
        let r = loader.await.unwrap().unwrap();
        assert_eq!(r.loaded(), 4, "{r:?}");
        assert!((10..14).zip(&hs).all(|(i, h)| verify(&e, &kv, i, h)));
    })
    .await;
}
