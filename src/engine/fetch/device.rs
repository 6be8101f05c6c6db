//! The reader's half of device-direct reads on one host (contract C19):
//! when an owner's answer to `QueryBlocksForTransfer` names its device
//! buffers and where each locked block sits in them (because a device lease
//! covers it and this node proved it is on the owner's host), a
//! [`super::super::Engine::fetch_into`] copies those blocks straight from
//! the owner's device KV into its own KV blocks with one
//! [`crate::gpu::Gpu::submit_peer`] batch per read part, and checks the
//! destination's slot checksums against the owner's (C10). Anything that
//! goes wrong — a handle that does not open, a failed copy, a checksum that
//! differs, too little lease left — falls back to reading the same part
//! from the owner's pool (shared pool or TCP) into the slots the fetch
//! already holds, within the fetch's deadline: never a wrong byte.
//!
//! The owner describes its device layout once per answer (one run per
//! layer and segment: export, block 0's offset, stride, length) and each
//! block by its device index; [`OwnerLayout::check`] validates that
//! description against the owner's exports and this node's layout family
//! before any of it is used, and [`plan_part`] derives each block's copies
//! from it. The owner and the reader may arrange their KV differently
//! (other buffers, other strides; one family, C15), but each run is one of
//! this node's segments, so [`plan_part`] pairs them one for one. Ranges
//! of any other cut (the owner's pool, read by the shared-pool path) go
//! through [`plan_copies`], which walks both sides' ranges of each block in
//! pool byte order and cuts a copy wherever either side's range ends, so
//! each copy is contiguous on both.

use std::ops::Range;
use std::sync::Arc;

use super::machine::LockedBlock;
use crate::engine::device::ExportRun;
use crate::engine::layout::{LAYERS_MAX, Layout};
use crate::gpu::peer::{BufferExport, HANDLE_BYTES_MAX, PeerCopyOp, PeerKind};
use crate::limits::DEVICE_LAYOUT_RUNS_MAX;
use crate::proto::{DeviceBufferExport, DeviceLayout};

// A layout of `LAYERS_MAX` split layers fits the runs limit.
const _: () = assert!(DEVICE_LAYOUT_RUNS_MAX == 2 * LAYERS_MAX);

/// The device half of an owner's lock answer, as the reader keeps it:
/// every field checked ([`DeviceSide::from_answer`]).
pub(crate) struct DeviceSide {
    /// The owner's exports, by the index its runs use.
    pub exports: Vec<BufferExport>,
    /// The owner's device layout.
    pub layout: OwnerLayout,
    /// The lease's end on this node's clock, less
    /// [`crate::limits::DEVICE_LEASE_MARGIN_MS`]: no copy starts after it.
    pub until: tokio::time::Instant,
}

/// An owner's device layout, checked against its exports and this node's
/// layout family: every block index below `num_blocks` yields in-bounds,
/// overflow-free ranges that tile one block in pool byte order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OwnerLayout {
    num_blocks: u64,
    runs: Vec<ExportRun>,
}

impl OwnerLayout {
    /// Checks the owner's `wire` layout. Refused (the reason in words):
    /// more than [`DEVICE_LAYOUT_RUNS_MAX`] runs; zero blocks; runs whose
    /// lengths are not this node's family, per (layer, segment) in pool
    /// byte order (`local`: the same model's blocks, C15); a run naming an
    /// export past `exports`; a run whose last block's end overflows `u64`
    /// or passes its export's length.
    pub fn check(wire: &DeviceLayout, exports: &[BufferExport], local: &Layout) -> Result<Self, String> {
        if wire.runs.len() > DEVICE_LAYOUT_RUNS_MAX {
            return Err(format!("{} runs (max {DEVICE_LAYOUT_RUNS_MAX})", wire.runs.len()));
        }
        let last = wire.num_blocks.checked_sub(1).ok_or("a layout of zero blocks")?;
        let family = local.layers().iter().flat_map(|l| std::iter::repeat_n(l.bytes_per_block, l.segments().into()));
        if !wire.runs.iter().map(|r| r.len).eq(family) {
            return Err("its runs are not this node's layout family".into());
        }
        let mut runs = Vec::with_capacity(wire.runs.len());
        for r in &wire.runs {
            let e = exports.get(r.buffer as usize).ok_or_else(|| format!("a run names export {}", r.buffer))?;
            let end =
                last.checked_mul(r.stride).and_then(|o| o.checked_add(r.offset)).and_then(|o| o.checked_add(r.len));
            match end {
                Some(end) if end <= e.len => {}
                _ => return Err(format!("a run passes export {} ({} B)", r.buffer, e.len)),
            }
            runs.push(ExportRun { export: r.buffer, offset: r.offset, stride: r.stride, len: r.len });
        }
        Ok(Self { num_blocks: wire.num_blocks, runs })
    }

    /// Whether `block` is a device block of this layout.
    pub fn has_block(&self, block: u64) -> bool {
        block < self.num_blocks
    }

    /// Device block `block`'s ranges `(export, offset, len)` in pool byte
    /// order, merged where contiguous in one export; `None` past the
    /// layout. (What the general walk, [`plan_copies`], would take: the
    /// tests hold [`plan_part`] to it.)
    #[cfg(test)]
    fn segments(&self, block: u64) -> Option<Vec<(usize, u64, u64)>> {
        if !self.has_block(block) {
            return None;
        }
        let mut out: Vec<(usize, u64, u64)> = Vec::with_capacity(self.runs.len());
        for r in &self.runs {
            // In bounds and overflow-free: `check` bounded the last block.
            let (buf, off) = (r.export as usize, r.offset + block * r.stride);
            match out.last_mut() {
                Some((b, o, l)) if *b == buf && *o + *l == off => *l += r.len,
                _ => out.push((buf, off, r.len)),
            }
        }
        Some(out)
    }
}

impl DeviceSide {
    /// Parses and checks an answer's device half; `None` when it has none
    /// or any of it is malformed — an unknown handle kind, an over-long
    /// handle, too many exports, no layout or one [`OwnerLayout::check`]
    /// refuses, too little lease left: the pool path is used.
    pub fn from_answer(
        buffers: &[DeviceBufferExport],
        layout: Option<&DeviceLayout>,
        ms_left: u64,
        local: &Layout,
        now: tokio::time::Instant,
    ) -> Option<Self> {
        if buffers.is_empty() || buffers.len() > crate::limits::DEVICE_EXPORTS_PER_ANSWER_MAX {
            return None;
        }
        let exports = buffers
            .iter()
            .map(|b| {
                let kind = PeerKind::from_u32(b.kind)?;
                (b.handle.len() <= HANDLE_BYTES_MAX).then(|| BufferExport {
                    kind,
                    handle: b.handle.to_vec(),
                    offset: b.offset,
                    len: b.len,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let layout = match layout.map(|l| OwnerLayout::check(l, &exports, local)) {
            Some(Ok(l)) => l,
            Some(Err(why)) => {
                tracing::debug!(%why, "the owner's device layout is refused: its blocks are read from the pool");
                return None;
            }
            None => return None,
        };
        let left = ms_left.checked_sub(crate::limits::DEVICE_LEASE_MARGIN_MS)?;
        Some(Self {
            exports,
            layout,
            until: now + std::time::Duration::from_millis(left.min(crate::limits::DEVICE_LEASE_TTL_MS_MAX)),
        })
    }
}

/// A part's device copy: ops reading source `i` of the exports (as indexed
/// by the owner), checksum ranges (one per slot of each block, in order),
/// and the owner's slot checksums each range must match.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct PartPlan {
    /// Copies; `src` indexes the owner's exports.
    pub ops: Vec<PeerCopyOp>,
    /// One op range per slot of each block.
    pub checksums: Vec<Range<usize>>,
    /// Per block, the owner's slot checksums.
    pub expected: Vec<Arc<[u32]>>,
    /// Bytes copied.
    pub bytes: u64,
}

/// One block of a part as [`plan_copies`] takes it: the source ranges
/// `(source index, offset, len)` that hold it, in pool byte order (slot 0's
/// K, slot 0's V, slot 1's K…), and the owner's slot checksums.
pub(crate) struct SourceBlock {
    pub ranges: Vec<(usize, u64, u64)>,
    pub expected: Arc<[u32]>,
}

/// One block of a device-lease part as [`plan_part`] takes it: where the
/// owner holds it (its device block index, if the answer gave one) and the
/// owner's slot checksums. Owned, so a part is planned off the fetch's
/// driver task.
#[derive(Clone, Debug)]
pub(crate) struct LeaseBlock {
    pub device_block: Option<u64>,
    pub expected: Arc<[u32]>,
}

impl From<&LockedBlock> for LeaseBlock {
    fn from(b: &LockedBlock) -> Self {
        Self { device_block: b.device_block, expected: b.slot_crcs() }
    }
}

/// Plans the device copy of `plan` (the owner's blocks, each with a device
/// block index in `owner`) into this node's device blocks `dst` (same
/// order): one op per (layer, segment) of each block, one checksum range
/// per slot.
///
/// [`OwnerLayout::check`] proved the owner's runs are this node's
/// segments, one for one, in pool byte order, so run `i` of a block pairs
/// with segment `i` of its destination — the ops the general walk
/// ([`plan_copies`]) cuts, computed directly: a few ns a copy instead of
/// ~30 (a 64 MiB part of a Qwen3-8B-shaped KV is ~2,000 copies).
///
/// # Errors
/// A description of the first malformed block (no device index, one past
/// the owner's layout, a slot count other than the layout's, a destination
/// index past this node's layout): the part is read from the pool instead.
pub(crate) fn plan_part(
    layout: &Layout,
    owner: &OwnerLayout,
    plan: &[LeaseBlock],
    dst: &[u64],
) -> Result<PartPlan, String> {
    // (source run, destination segment base, its stride), and the ops of
    // each layer (its slot's checksum range).
    let pairs: Vec<(&ExportRun, crate::engine::layout::SegmentBase, u64)> = owner
        .runs
        .iter()
        .zip(layout.layers().iter().flat_map(|l| l.segment_bases().map(move |b| (b, l.block_stride))))
        .map(|(r, (b, stride))| (r, b, stride))
        .collect();
    let per_layer: Vec<usize> = layout.layers().iter().map(|l| usize::from(l.segments())).collect();
    if pairs.len() != owner.runs.len() || per_layer.iter().sum::<usize>() != pairs.len() {
        // `owner` was checked against another layout than `layout`.
        return Err("the owner's runs are not this layout's segments".into());
    }
    let mut out = PartPlan {
        ops: Vec::with_capacity(plan.len() * pairs.len()),
        checksums: Vec::with_capacity(plan.len() * per_layer.len()),
        expected: Vec::with_capacity(plan.len()),
        bytes: 0,
    };
    for (b, &d) in plan.iter().zip(dst) {
        let index = b.device_block.ok_or("a block without a device index")?;
        if !owner.has_block(index) {
            return Err(format!("device block {index} is past the owner's layout"));
        }
        check_destination(layout, &b.expected, d)?;
        // In bounds and overflow-free on both sides: `check` bounded the
        // owner's last block, `Layout::new` this node's.
        out.ops.extend(pairs.iter().map(|&(r, base, stride)| PeerCopyOp {
            src: r.export as usize,
            src_offset: r.offset + index * r.stride,
            dst: base.buffer,
            dst_offset: base.offset + d * stride,
            len: r.len,
        }));
        let mut at = out.ops.len() - pairs.len();
        for &n in &per_layer {
            out.checksums.push(at..at + n);
            at += n;
        }
        out.expected.push(b.expected.clone());
        out.bytes += layout.block_bytes();
    }
    Ok(out)
}

/// Checks one block of a part against this node's layout: one owner
/// checksum per layer (`expected`), and a destination index `d` inside it.
fn check_destination(layout: &Layout, expected: &[u32], d: u64) -> Result<(), String> {
    if expected.len() != layout.layers().len() {
        return Err(format!("{} slots, the layout has {} layers", expected.len(), layout.layers().len()));
    }
    layout.check_block(d).map_err(|e| e.to_string())
}

/// Plans the copy of `blocks` into this node's device blocks `dst` (same
/// order): walks each block's source ranges alongside its own
/// [`Layout::segment_copies`] in pool byte order and cuts a copy wherever
/// either side's range ends, with one checksum range per slot. Source
/// indices and bounds are the batch's to check
/// ([`crate::gpu::peer::validate_peer_batch`]).
///
/// # Errors
/// A description of the first malformed block (a slot count other than the
/// layout's, ranges that do not tile one block, a destination index past
/// this node's layout): the part is read from the pool instead.
pub(crate) fn plan_copies(layout: &Layout, blocks: &[SourceBlock], dst: &[u64]) -> Result<PartPlan, String> {
    let block_bytes = layout.block_bytes();
    // One op per segment when both sides cut blocks alike (the usual case).
    let segments: usize = layout.layers().iter().map(|l| usize::from(l.segments())).sum();
    let mut out = PartPlan {
        ops: Vec::with_capacity(blocks.len() * segments),
        checksums: Vec::with_capacity(blocks.len() * layout.layers().len()),
        expected: Vec::with_capacity(blocks.len()),
        bytes: 0,
    };
    for (b, &d) in blocks.iter().zip(dst) {
        check_destination(layout, &b.expected, d)?;
        out.expected.push(b.expected.clone());
        // Walk the source ranges alongside ours, in pool byte order.
        let mut src = b.ranges.iter().copied();
        let (mut cur, mut used) = (src.next(), 0u64);
        let mut layer_start: Option<(usize, usize)> = None;
        for c in layout.segment_copies(d) {
            if layer_start.is_none_or(|(l, _)| l != c.layer) {
                if let Some((_, start)) = layer_start {
                    out.checksums.push(start..out.ops.len());
                }
                layer_start = Some((c.layer, out.ops.len()));
            }
            let mut need = c.len;
            let mut at = c.device_offset;
            while need > 0 {
                let (buf, off, len) = cur.ok_or("device segments end early")?;
                let n = need.min(len - used);
                let src_offset = off.checked_add(used).ok_or("a source range past u64")?;
                out.ops.push(PeerCopyOp { src: buf, src_offset, dst: c.buffer, dst_offset: at, len: n });
                (need, at, used) = (need - n, at + n, used + n);
                if used == len {
                    (cur, used) = (src.next(), 0);
                }
            }
        }
        if cur.is_some() {
            return Err("device segments longer than a block".into());
        }
        if let Some((_, start)) = layer_start {
            out.checksums.push(start..out.ops.len());
        }
        out.bytes += block_bytes;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::engine::fetch::machine::LockedSlot;
    use crate::engine::layout::LayerLayout;
    use crate::memory::DeviceBufferId;
    use crate::proto::DeviceRun;
    use crate::types::BlockHash;

    fn block(device_block: Option<u64>, crcs: &[u32]) -> LockedBlock {
        LockedBlock {
            hash: BlockHash::new(vec![1; 32]),
            slots: crcs.iter().map(|&crc32c| LockedSlot { crc32c, ..Default::default() }).collect(),
            device_block,
        }
    }

    fn lease(device_block: Option<u64>, crcs: &[u32]) -> LeaseBlock {
        (&block(device_block, crcs)).into()
    }

    /// Two layers, split K/V of 100 bytes each, K and V in buffers of their
    /// own per layer (ids 0..4), 8 blocks.
    fn layout() -> Layout {
        let layers = (0..2u32)
            .map(|l| LayerLayout::paged(DeviceBufferId(2 * l), Some(DeviceBufferId(2 * l + 1)), 8, 100))
            .collect();
        Layout::new(layers, |_| Some(800)).unwrap()
    }

    fn exports(lens: &[u64]) -> Vec<BufferExport> {
        lens.iter().map(|&len| BufferExport { kind: PeerKind::Process, handle: vec![0; 8], offset: 0, len }).collect()
    }

    /// The owner of the same family arranged differently: layer 0's K and
    /// V and layer 1's K back to back per block in export 0 (stride 400
    /// from 1000), layer 1's V paged in export 1; 4 blocks.
    fn owner_wire() -> DeviceLayout {
        let run = |buffer, offset, stride| DeviceRun { buffer, offset, stride, len: 100 };
        DeviceLayout {
            num_blocks: 4,
            runs: vec![run(0, 1000, 400), run(0, 1100, 400), run(0, 1200, 400), run(1, 0, 100)],
        }
    }

    /// Export lengths `owner_wire` just fits.
    const FIT: [u64; 2] = [1000 + 3 * 400 + 300, 400];

    #[test]
    fn ranges_come_from_the_layout_once_and_checksums_follow_slots() {
        let l = layout();
        let owner = OwnerLayout::check(&owner_wire(), &exports(&FIT), &l).unwrap();
        // Owner block 2: one 300-byte range in export 0 (three runs merged),
        // one in export 1; cut at this node's 100-byte segments (block 3).
        assert_eq!(owner.segments(2).unwrap(), vec![(0, 1800, 300), (1, 200, 100)]);
        let p = plan_part(&l, &owner, &[lease(Some(2), &[7, 8])], &[3]).unwrap();
        let ops: Vec<_> = p.ops.iter().map(|o| (o.src, o.src_offset, o.dst.0, o.dst_offset, o.len)).collect();
        assert_eq!(
            ops,
            vec![(0, 1800, 0, 300, 100), (0, 1900, 1, 300, 100), (0, 2000, 2, 300, 100), (1, 200, 3, 300, 100)]
        );
        assert_eq!(p.checksums, vec![0..2, 2..4]);
        assert_eq!(&*p.expected[0], &[7, 8]);
        assert_eq!(p.bytes, 400);
    }

    /// Every malformed layout from the network is refused before use:
    /// too many runs, zero blocks, another family, an export index out of
    /// range, a last block past its export or past `u64`.
    #[test]
    fn malformed_layouts_are_refused() {
        let l = layout();
        let ex = exports(&FIT);
        let check = |f: &dyn Fn(&mut DeviceLayout)| {
            let mut w = owner_wire();
            f(&mut w);
            OwnerLayout::check(&w, &ex, &l)
        };
        assert!(check(&|_| {}).is_ok());
        let too_many = DeviceRun { buffer: 0, offset: 0, stride: 0, len: 100 };
        assert!(check(&|w| w.runs = vec![too_many; DEVICE_LAYOUT_RUNS_MAX + 1]).is_err(), "runs limit");
        assert!(check(&|w| w.num_blocks = 0).is_err(), "zero blocks");
        assert!(check(&|w| w.runs[3].len = 99).is_err(), "family: a short segment");
        assert!(check(&|w| w.runs.truncate(3)).is_err(), "family: a missing segment");
        assert!(check(&|w| w.runs.push(w.runs[3])).is_err(), "family: an extra segment");
        assert!(check(&|w| w.runs[3].buffer = 2).is_err(), "export index");
        assert!(check(&|w| w.runs[2].offset += 1).is_err(), "one byte past export 0");
        assert!(check(&|w| w.num_blocks = 5).is_err(), "a block past export 0");
        assert!(check(&|w| w.runs[3].offset = u64::MAX - 50).is_err(), "offset overflow");
        assert!(check(&|w| w.runs[3].stride = u64::MAX / 2).is_err(), "stride overflow");
        assert!(OwnerLayout::check(&owner_wire(), &exports(&[FIT[0], FIT[1] - 1]), &l).is_err(), "export 1 short");
        // One block of the owner's layout is fine whatever the stride.
        assert!(
            check(&|w| {
                w.num_blocks = 1;
                w.runs[0].stride = u64::MAX
            })
            .is_ok()
        );
    }

    #[test]
    fn malformed_blocks_are_refused() {
        let l = layout();
        let owner = OwnerLayout::check(&owner_wire(), &exports(&FIT), &l).unwrap();
        assert!(plan_part(&l, &owner, &[lease(None, &[1, 2])], &[0]).is_err(), "no device index");
        assert!(plan_part(&l, &owner, &[lease(Some(4), &[1, 2])], &[0]).is_err(), "past the owner's layout");
        assert!(plan_part(&l, &owner, &[lease(Some(u64::MAX), &[1, 2])], &[0]).is_err(), "far past");
        assert!(plan_part(&l, &owner, &[lease(Some(3), &[1])], &[0]).is_err(), "slot count");
        assert!(plan_part(&l, &owner, &[lease(Some(3), &[1, 2])], &[8]).is_err(), "our index");
        assert!(plan_part(&l, &owner, &[lease(Some(3), &[1, 2])], &[7]).is_ok());
    }

    proptest! {
        /// For every layout the check accepts, the direct plan of any block
        /// into any destination is the general walk's, op for op, checksum
        /// range for range. This node's layout varies (1-4 layers, each
        /// split K/V or fused, 64-128-byte segments); the owner's runs are
        /// either placed anywhere in up to three exports, or packed back to
        /// back per block in export 0 so that the walk merges them.
        #[test]
        fn the_direct_plan_is_the_walks(
            local in proptest::collection::vec((any::<bool>(), prop_oneof![Just(64u64), Just(100), Just(128)]), 1..5),
            packed in any::<bool>(),
            placed in proptest::collection::vec((0u32..3, 0u64..1500, 0u64..500), 8),
            num_blocks in 1u64..6,
            picks in proptest::collection::vec((any::<u64>(), 0u64..8), 1..4),
        ) {
            let layers: Vec<LayerLayout> = local
                .iter()
                .enumerate()
                .map(|(i, &(split, bytes))| {
                    let k = DeviceBufferId(2 * i as u32);
                    LayerLayout::paged(k, split.then_some(DeviceBufferId(2 * i as u32 + 1)), 8, bytes)
                })
                .collect();
            let l = Layout::new(layers, |_| Some(8 * 128)).unwrap();
            let family: Vec<u64> =
                l.layers().iter().flat_map(|x| std::iter::repeat_n(x.bytes_per_block, x.segments().into())).collect();
            let runs: Vec<DeviceRun> = if packed {
                // Block b's segments back to back from b * block_bytes.
                let mut at = 0;
                family
                    .iter()
                    .map(|&len| {
                        let r = DeviceRun { buffer: 0, offset: at, stride: l.block_bytes(), len };
                        at += len;
                        r
                    })
                    .collect()
            } else {
                family
                    .iter()
                    .zip(&placed)
                    .map(|(&len, &(buffer, offset, stride))| DeviceRun { buffer, offset, stride, len })
                    .collect()
            };
            let wire = DeviceLayout { num_blocks, runs };
            // Each export just long enough for its runs' last block.
            let lens: Vec<u64> = (0..3)
                .map(|e| wire.runs.iter().filter(|r| r.buffer == e).map(|r| r.offset + (num_blocks - 1) * r.stride + r.len).max().unwrap_or(0))
                .collect();
            let owner = OwnerLayout::check(&wire, &exports(&lens), &l).unwrap();
            let crcs: Vec<u32> = (0..l.layers().len() as u32).collect();
            let blocks: Vec<LeaseBlock> = picks.iter().map(|&(b, _)| lease(Some(b % num_blocks), &crcs)).collect();
            let dst: Vec<u64> = picks.iter().map(|&(_, d)| d).collect();
            let walked: Vec<SourceBlock> = blocks
                .iter()
                .map(|b| SourceBlock { ranges: owner.segments(b.device_block.unwrap()).unwrap(), expected: b.expected.clone() })
                .collect();
            if packed {
                // One merged range per block for the walk to cut.
                prop_assert!(walked.iter().all(|w| w.ranges.len() == 1));
            }
            prop_assert_eq!(plan_part(&l, &owner, &blocks, &dst).unwrap(), plan_copies(&l, &walked, &dst).unwrap());
        }

        /// Whatever an owner sends, the check does not panic, and a layout
        /// it accepts yields, for every block index, ranges inside their
        /// exports that tile exactly one block.
        #[test]
        fn accepted_layouts_stay_in_bounds(
            num_blocks in prop_oneof![4 => 0u64..6, 1 => any::<u64>()],
            runs in proptest::collection::vec(
                (0u32..3, prop_oneof![4 => 0u64..1500, 1 => any::<u64>()],
                 prop_oneof![4 => 0u64..300, 1 => any::<u64>()], prop_oneof![8 => Just(100u64), 1 => any::<u64>()]),
                3..6,
            ),
            lens in proptest::collection::vec(0u64..4000, 0..4),
            block in any::<u64>(),
        ) {
            let l = layout();
            let wire = DeviceLayout {
                num_blocks,
                runs: runs.iter().map(|&(buffer, offset, stride, len)| DeviceRun { buffer, offset, stride, len }).collect(),
            };
            let ex = exports(&lens);
            if let Ok(owner) = OwnerLayout::check(&wire, &ex, &l) {
                for b in [0, num_blocks - 1, block % num_blocks] {
                    let segs = owner.segments(b).unwrap();
                    prop_assert_eq!(segs.iter().map(|s| s.2).sum::<u64>(), l.block_bytes());
                    for (e, off, len) in segs {
                        prop_assert!(off + len <= ex[e].len);
                    }
                    let plan = plan_part(&l, &owner, &[lease(Some(b), &[1, 2])], &[0]).unwrap();
                    for op in &plan.ops {
                        prop_assert!(op.src_offset + op.len <= ex[op.src].len);
                    }
                }
                prop_assert!(owner.segments(num_blocks).is_none());
            }
        }
    }

    /// The answer's device half is accepted whole or not at all.
    #[test]
    fn answers_with_a_bad_layout_have_no_device_side() {
        let l = layout();
        let now = tokio::time::Instant::now();
        let wire: Vec<DeviceBufferExport> = FIT
            .iter()
            .map(|&len| DeviceBufferExport {
                kind: PeerKind::Process.to_u32(),
                handle: vec![0; 8].into(),
                offset: 0,
                len,
            })
            .collect();
        let good = owner_wire();
        assert!(DeviceSide::from_answer(&wire, Some(&good), 10_000, &l, now).is_some());
        assert!(DeviceSide::from_answer(&wire, None, 10_000, &l, now).is_none(), "no layout");
        let mut bad = owner_wire();
        bad.runs[2].offset = 1 << 40;
        assert!(DeviceSide::from_answer(&wire, Some(&bad), 10_000, &l, now).is_none(), "a run past its export");
        assert!(DeviceSide::from_answer(&wire[..1], Some(&good), 10_000, &l, now).is_none(), "a missing export");
    }
}
