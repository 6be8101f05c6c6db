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
//! The owner and the reader may arrange their KV differently (other
//! buffers, other strides; one family, C15): [`plan_part`] walks both
//! sides' ranges of each block in pool byte order and cuts a copy wherever
//! either side's range ends, so each copy is contiguous on both.

use std::ops::Range;
use std::sync::Arc;

use crate::engine::layout::Layout;
use crate::gpu::peer::{BufferExport, HANDLE_BYTES_MAX, PeerCopyOp, PeerKind};
use crate::proto::{DeviceBufferExport, TransferBlockInfo};

/// The device half of an owner's lock answer, as the reader keeps it.
pub(crate) struct DeviceSide {
    /// The owner's exports, by the index its segments use.
    pub exports: Vec<BufferExport>,
    /// The lease's end on this node's clock, less
    /// [`crate::limits::DEVICE_LEASE_MARGIN_MS`]: no copy starts after it.
    pub until: tokio::time::Instant,
}

impl DeviceSide {
    /// Parses an answer's exports; `None` when there are none or one is
    /// malformed (unknown kind, over-long handle): the pool path is used.
    pub fn from_answer(buffers: &[DeviceBufferExport], ms_left: u64, now: tokio::time::Instant) -> Option<Self> {
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
        let left = ms_left.checked_sub(crate::limits::DEVICE_LEASE_MARGIN_MS)?;
        Some(Self {
            exports,
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

/// Plans the device copy of `plan` (the owner's blocks, each with device
/// segments) into this node's device blocks `dst` (same order).
///
/// # Errors
/// A description of the first malformed block (segments that do not tile
/// the block, an export index out of range, a slot count other than the
/// layout's): the part is read from the pool instead.
pub(crate) fn plan_part(
    layout: &Layout,
    plan: &[&TransferBlockInfo],
    dst: &[u64],
    exports: usize,
) -> Result<PartPlan, String> {
    let mut out = PartPlan::default();
    let block_bytes = layout.block_bytes();
    for (b, &d) in plan.iter().zip(dst) {
        if b.device_segments.is_empty() {
            return Err("a block without device segments".into());
        }
        if b.slots.len() != layout.layers().len() {
            return Err(format!("{} slots, the layout has {} layers", b.slots.len(), layout.layers().len()));
        }
        layout.check_block(d).map_err(|e| e.to_string())?;
        let mut total = 0u64;
        for s in &b.device_segments {
            if s.buffer as usize >= exports {
                return Err(format!("segment names export {} of {exports}", s.buffer));
            }
            s.offset.checked_add(s.len).ok_or("segment past u64")?;
            total = total.checked_add(s.len).ok_or("segments past u64")?;
        }
        if total != block_bytes {
            return Err(format!("device segments cover {total} bytes, a block is {block_bytes}"));
        }
        out.expected.push(b.slots.iter().map(|s| s.crc32c).collect());
        // Walk the owner's segments alongside ours, in pool byte order.
        let mut src = b.device_segments.iter().map(|s| (s.buffer as usize, s.offset, s.len));
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
                out.ops.push(PeerCopyOp { src: buf, src_offset: off + used, dst: c.buffer, dst_offset: at, len: n });
                (need, at, used) = (need - n, at + n, used + n);
                if used == len {
                    (cur, used) = (src.next(), 0);
                }
            }
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
    use super::*;
    use crate::engine::layout::LayerLayout;
    use crate::memory::DeviceBufferId;
    use crate::proto::{DeviceSegment, TransferSlotInfo};

    fn block(segments: &[(u32, u64, u64)], crcs: &[u32]) -> TransferBlockInfo {
        TransferBlockInfo {
            block_hash: vec![1; 32].into(),
            slots: crcs.iter().map(|&crc32c| TransferSlotInfo { crc32c, ..Default::default() }).collect(),
            device_segments: segments
                .iter()
                .map(|&(buffer, offset, len)| DeviceSegment { buffer, offset, len })
                .collect(),
        }
    }

    /// Two layers, split K/V of 100 bytes each, K and V in buffers of their
    /// own per layer (ids 0..4), 8 blocks.
    fn layout() -> Layout {
        let layers = (0..2u32)
            .map(|l| LayerLayout::paged(DeviceBufferId(2 * l), Some(DeviceBufferId(2 * l + 1)), 8, 100))
            .collect();
        Layout::new(layers, |_| Some(800)).unwrap()
    }

    #[test]
    fn ranges_are_cut_where_either_side_ends_and_checksums_follow_slots() {
        let l = layout();
        // The owner holds the block as one 250-byte run and one 150-byte
        // run (another arrangement of the same family).
        let b = block(&[(0, 1000, 250), (1, 0, 150)], &[7, 8]);
        let p = plan_part(&l, &[&b], &[3], 2).unwrap();
        let ops: Vec<_> = p.ops.iter().map(|o| (o.src, o.src_offset, o.dst.0, o.dst_offset, o.len)).collect();
        assert_eq!(
            ops,
            vec![
                (0, 1000, 0, 300, 100),
                (0, 1100, 1, 300, 100),
                (0, 1200, 2, 300, 50),
                (1, 0, 2, 350, 50),
                (1, 50, 3, 300, 100)
            ]
        );
        assert_eq!(p.checksums, vec![0..2, 2..5]);
        assert_eq!(&*p.expected[0], &[7, 8]);
        assert_eq!(p.bytes, 400);
    }

    #[test]
    fn malformed_blocks_are_refused() {
        let l = layout();
        assert!(plan_part(&l, &[&block(&[(0, 0, 399)], &[1, 2])], &[0], 1).is_err(), "short");
        assert!(plan_part(&l, &[&block(&[(0, 0, 401)], &[1, 2])], &[0], 1).is_err(), "long");
        assert!(plan_part(&l, &[&block(&[(1, 0, 400)], &[1, 2])], &[0], 1).is_err(), "export index");
        assert!(plan_part(&l, &[&block(&[(0, 0, 400)], &[1])], &[0], 1).is_err(), "slot count");
        assert!(plan_part(&l, &[&block(&[(0, u64::MAX, 400)], &[1, 2])], &[0], 1).is_err(), "overflow");
        assert!(plan_part(&l, &[&block(&[], &[1, 2])], &[0], 1).is_err(), "no segments");
        assert!(plan_part(&l, &[&block(&[(0, 0, 400)], &[1, 2])], &[8], 1).is_err(), "our index");
        assert!(plan_part(&l, &[&block(&[(0, 0, 400)], &[1, 2])], &[7], 1).is_ok());
    }
}
