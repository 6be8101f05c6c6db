//! KV-cache layouts over the embedder's buffers, validated once at
//! registration so that every later copy between a device buffer and a host
//! block extent stays in bounds.
//!
//! # Vocabulary (design.md §1)
//!
//! Per layer a [`LayerLayout`] gives `num_blocks`, `bytes_per_block` (per
//! segment), `block_stride`, and where each segment's block 0 lives: a
//! [`SegmentBase`] (buffer, offset) for segment 0 (K, or the whole slot) and,
//! for split K/V, one for segment 1 (V). The device address of segment `s`
//! of block `b` is
//!
//! ```text
//! base[s].offset + b * block_stride        inside buffer base[s].buffer
//! ```
//!
//! Each (layer, segment) may live in its own buffer — K and V as separate
//! tensors, as engines allocate them — or share one. A *slot* is one layer of
//! a stored block. On the host a block is one pool extent of
//! [`Layout::block_bytes`] bytes holding every layer's slot concatenated in
//! layer order, each slot K then V ([`Layout::slot_offset`]). That host (and
//! wire) format depends only on the layout's [`LayoutFamily`] — per layer
//! the segment count and bytes per segment — never on the device buffers
//! (C15), so two engines that arrange the same model's tensors differently
//! exchange blocks. `docs/layouts.md` lists the supported shapes with their
//! address formulas.
//!
//! Shapes engines use (all expressible; constructors [`LayerLayout::paged`],
//! [`contiguous`]):
//! - *paged, one tensor per K and per V per layer* (vLLM/FlashInfer "NHD"
//!   `[num_blocks, block_tokens, kv_heads, head_dim]`): each segment its own
//!   buffer at offset 0, `block_stride = bytes_per_block`;
//! - *paged with a K/V axis* (`[2, num_blocks, …]` per layer): one buffer,
//!   V at offset `num_blocks * bytes_per_block`;
//! - *MLA* (one latent tensor per layer): a single segment;
//! - *layer-first* (all layers in one buffer, each layer's region holding all
//!   blocks' K then all blocks' V) and *fused* (each block holds every
//!   layer's K and V back to back — the segments of a block are contiguous
//!   on both sides and [`Layout::coalesced_copies`] collapses them into one
//!   copy).
//!
//! # Why validate up front
//!
//! Copies run on a GPU stream or a DMA engine where an out-of-bounds offset
//! is memory corruption, not an error. [`Layout::new`] therefore proves, once,
//! that every address computation fits `u64`, every byte range lies inside
//! its buffer, and no two (layer, segment, block) ranges on one buffer share a
//! byte (a save that wrote one layer's K over another's V would silently
//! corrupt the cache). After that the only input a copy needs checking is the
//! block index ([`Layout::check_block`]).
//!
//! # The overlap check
//!
//! Per layer and segment, the ranges form an arithmetic progression (start,
//! stride, count, length). Two progressions with the *same* stride
//! intersect iff some difference of block indices `k` in `[-(n-1), n-1]`
//! puts `k * stride` inside an open interval computed from their starts and
//! lengths, which is decided exactly in `O(1)`; when every progression on a
//! buffer shares one block stride (all standard shapes, whatever
//! `num_blocks`) the check is `O(P²)` in the number `P` of progressions on
//! that buffer (`P ≤ 2 * LAYERS_MAX`). Buffers whose progressions use
//! *different* strides fall back to an exact sweep over every range in
//! address order (a k-way merge of the progressions, `O(R log P)` time,
//! `O(P)` memory), bounded by [`OVERLAP_CHECK_RANGES_MAX`] ranges; above
//! that the layout is rejected with [`LayoutError::TooLarge`] rather than
//! validated slowly.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

pub use crate::memory::DeviceBufferId;

/// Most layers one layout may have. Real models have ≤ 128 layers (×TP ranks
/// registered separately); 1024 bounds registration work and the `O(P²)`
/// overlap check (`P ≤ 2048` progressions → ~2M constant-time pair tests).
pub const LAYERS_MAX: usize = 1024;

/// Most (layer, segment, block) ranges the exact overlap sweep enumerates
/// (4 Mi ranges, ~0.1–1 s). Only buffers whose progressions have different
/// block strides need the sweep; uniform-stride buffers are checked in
/// closed form at any size.
pub const OVERLAP_CHECK_RANGES_MAX: u64 = 4 << 20;

/// Where one segment of a layer starts: block 0 of the segment is at byte
/// `offset` of device buffer `buffer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentBase {
    /// The device buffer holding the segment.
    pub buffer: DeviceBufferId,
    /// Offset of block 0 inside `buffer` (bytes).
    pub offset: u64,
}

impl SegmentBase {
    /// Block 0 at `offset` in `buffer`.
    pub fn new(buffer: DeviceBufferId, offset: u64) -> Self {
        Self { buffer, offset }
    }
}

/// One layer's placement. All offsets and sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerLayout {
    /// Number of blocks (must be equal for every layer).
    pub num_blocks: u64,
    /// Bytes of one segment of one block (K or V, or the whole slot when
    /// there is one segment).
    pub bytes_per_block: u64,
    /// Distance between consecutive blocks of each segment.
    pub block_stride: u64,
    /// Segment 0: K, or the whole slot (MLA, or K and V fused per block).
    pub k: SegmentBase,
    /// Segment 1 (V) for split K/V; `None` for a single segment.
    pub v: Option<SegmentBase>,
}

impl LayerLayout {
    /// The paged layout engines allocate per layer: K (and V, when split) in
    /// buffers of their own, block `b` at `b * bytes_per_block` — vLLM's
    /// "NHD" `[num_blocks, block_tokens, kv_heads, head_dim]` tensors have
    /// `bytes_per_block = block_tokens * kv_heads * head_dim * dtype bytes`.
    pub fn paged(k: DeviceBufferId, v: Option<DeviceBufferId>, num_blocks: u64, bytes_per_block: u64) -> Self {
        Self {
            num_blocks,
            bytes_per_block,
            block_stride: bytes_per_block,
            k: SegmentBase::new(k, 0),
            v: v.map(|v| SegmentBase::new(v, 0)),
        }
    }

    /// 1, or 2 for split K/V.
    pub fn segments(&self) -> u8 {
        if self.v.is_some() { 2 } else { 1 }
    }

    /// Segment `segment`'s base (0 = K or whole, 1 = V), `None` past the
    /// last.
    pub fn segment(&self, segment: u8) -> Option<SegmentBase> {
        match segment {
            0 => Some(self.k),
            1 => self.v,
            _ => None,
        }
    }

    /// The layer's segments, in order.
    pub fn segment_bases(&self) -> impl Iterator<Item = SegmentBase> + '_ {
        std::iter::once(self.k).chain(self.v)
    }

    /// Device offset of `segment` of block `block_idx` inside its buffer,
    /// or `None` on `u64` overflow or a missing segment. Does not check the
    /// block index against the layout.
    pub fn segment_offset(&self, block_idx: u64, segment: u8) -> Option<u64> {
        self.segment(segment)?.offset.checked_add(block_idx.checked_mul(self.block_stride)?)
    }

    /// One past the last byte `segment` touches in its buffer
    /// (`offset + (n-1)*block_stride + bytes_per_block`), or `None` on
    /// overflow, a missing segment, or `num_blocks == 0`.
    pub fn end_offset(&self, segment: u8) -> Option<u64> {
        self.segment_offset(self.num_blocks.checked_sub(1)?, segment)?.checked_add(self.bytes_per_block)
    }

    /// Host bytes of this layer's slot (`segments * bytes_per_block`), or
    /// `None` on overflow.
    pub fn slot_bytes(&self) -> Option<u64> {
        u64::from(self.segments()).checked_mul(self.bytes_per_block)
    }

    /// Block stride as far as overlaps are concerned: irrelevant (0) when the
    /// layer has a single block.
    fn effective_stride(&self) -> u64 {
        if self.num_blocks > 1 { self.block_stride } else { 0 }
    }
}

/// What a block looks like on the host and on the wire: per layer, the
/// segment count and the bytes of each segment. Two layouts of one family
/// exchange blocks whatever their device buffers (C15).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayoutFamily {
    /// Per layer `(segments, bytes_per_block)`.
    pub slots: Vec<(u8, u64)>,
}

impl std::fmt::Display for LayoutFamily {
    /// `36 layers × 2 segments × 32768 B`, or the per-layer list when the
    /// layers differ.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.slots.first() {
            Some(first) if self.slots.iter().all(|s| s == first) => {
                write!(f, "{} layers × {} segment(s) × {} B", self.slots.len(), first.0, first.1)
            }
            _ => write!(f, "layers (segments, B) {:?}", self.slots),
        }
    }
}

/// Why a layout was rejected. `layer` is an index into the `layers` passed to
/// [`Layout::new`]; `segment` is 0 (K, or the only segment) or 1 (V).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The layout has no layers.
    #[error("layout has no layers")]
    NoLayers,
    /// More than [`LAYERS_MAX`] layers.
    #[error("layout has {n} layers (max {LAYERS_MAX})")]
    TooManyLayers {
        /// Number of layers given.
        n: usize,
    },
    /// A segment's buffer is not registered.
    #[error("layer {layer} segment {segment}: unknown device {buffer}")]
    UnknownBuffer {
        /// Offending layer.
        layer: usize,
        /// Offending segment.
        segment: u8,
        /// The buffer named.
        buffer: DeviceBufferId,
    },
    /// `num_blocks == 0`.
    #[error("layer {layer}: zero blocks")]
    ZeroBlocks {
        /// Offending layer.
        layer: usize,
    },
    /// The layer's `num_blocks` differs from layer 0's.
    #[error("layer {layer}: {got} blocks, layer 0 has {expected}")]
    BlockCountMismatch {
        /// Offending layer.
        layer: usize,
        /// Layer 0's block count.
        expected: u64,
        /// This layer's block count.
        got: u64,
    },
    /// `bytes_per_block == 0`.
    #[error("layer {layer}: zero bytes per block")]
    ZeroBytes {
        /// Offending layer.
        layer: usize,
    },
    /// Two different blocks of one segment share a byte (`block_stride <
    /// bytes_per_block` with more than one block).
    #[error("layer {layer}: block_stride {block_stride} is smaller than bytes_per_block {bytes_per_block}")]
    BlockStrideTooSmall {
        /// Offending layer.
        layer: usize,
        /// The stride given.
        block_stride: u64,
        /// The segment size given.
        bytes_per_block: u64,
    },
    /// An address or size computation overflows `u64`.
    #[error("layer {layer}: address computation overflows u64")]
    Overflow {
        /// Offending layer.
        layer: usize,
    },
    /// A segment's last byte lies outside its buffer.
    #[error("layer {layer} segment {segment}: last byte {last_byte} outside {buffer} of {buffer_len} B")]
    OutOfBounds {
        /// Offending layer.
        layer: usize,
        /// Offending segment.
        segment: u8,
        /// The buffer.
        buffer: DeviceBufferId,
        /// Offset of the segment's last byte (inclusive).
        last_byte: u64,
        /// Length of the buffer (bytes).
        buffer_len: u64,
    },
    /// Two different (layer, segment, block) ranges on one buffer intersect
    /// (K and V of one layer included); `a` and `b` are the (layer, segment)
    /// of the two, `a < b`.
    #[error("ranges of (layer, segment) {a:?} and {b:?} overlap")]
    Overlap {
        /// First (layer, segment).
        a: (usize, u8),
        /// Second (layer, segment).
        b: (usize, u8),
    },
    /// Buffers shared by progressions with different block strides hold
    /// more than [`OVERLAP_CHECK_RANGES_MAX`] ranges: too many to check
    /// exactly.
    #[error("{ranges} ranges on mixed-stride buffers exceed the overlap check bound {max}")]
    TooLarge {
        /// Ranges the sweep would have to enumerate.
        ranges: u64,
        /// The bound ([`OVERLAP_CHECK_RANGES_MAX`]).
        max: u64,
    },
    /// A block index at or past [`Layout::num_blocks`] (from
    /// [`Layout::check_block`]).
    #[error("block index {block_idx} out of range (layout has {num_blocks} blocks)")]
    BlockOutOfRange {
        /// The index asked for.
        block_idx: u64,
        /// Blocks in the layout.
        num_blocks: u64,
    },
}

/// One copy between a device buffer and a host block extent. Offsets and
/// `len` in bytes; the host side is relative to the start of the block's
/// extent (which is [`Layout::block_bytes`] long).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentCopy {
    /// Layer of the (first) segment covered.
    pub layer: usize,
    /// Segment of the (first) segment covered: 0 = K or whole, 1 = V.
    pub segment: u8,
    /// Device buffer.
    pub buffer: DeviceBufferId,
    /// Offset in `buffer`.
    pub device_offset: u64,
    /// Offset inside the host block extent.
    pub host_offset_in_block: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// A validated layout: every address any block index `< num_blocks()` yields
/// is in bounds, overflow-free and overlap-free (module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    layers: Vec<LayerLayout>,
    /// Host offset of each layer's slot inside a block extent.
    slot_offsets: Vec<u64>,
    block_bytes: u64,
    num_blocks: u64,
}

impl Layout {
    /// Validates `layers` against the device buffers. `buffer_len(id)` gives
    /// each device buffer's length in bytes (`None` = unknown buffer).
    ///
    /// Checks run layer by layer in the order of the error list below, then
    /// the overlap check across every (layer, segment); the first failure is
    /// returned.
    ///
    /// # Errors
    /// [`LayoutError::NoLayers`], [`TooManyLayers`](LayoutError::TooManyLayers),
    /// then per layer [`ZeroBlocks`](LayoutError::ZeroBlocks),
    /// [`BlockCountMismatch`](LayoutError::BlockCountMismatch),
    /// [`ZeroBytes`](LayoutError::ZeroBytes),
    /// [`BlockStrideTooSmall`](LayoutError::BlockStrideTooSmall), then per
    /// segment [`UnknownBuffer`](LayoutError::UnknownBuffer),
    /// [`Overflow`](LayoutError::Overflow),
    /// [`OutOfBounds`](LayoutError::OutOfBounds); then
    /// [`Overlap`](LayoutError::Overlap) or [`TooLarge`](LayoutError::TooLarge).
    pub fn new(
        layers: Vec<LayerLayout>,
        buffer_len: impl Fn(DeviceBufferId) -> Option<u64>,
    ) -> Result<Layout, LayoutError> {
        if layers.is_empty() {
            return Err(LayoutError::NoLayers);
        }
        if layers.len() > LAYERS_MAX {
            return Err(LayoutError::TooManyLayers { n: layers.len() });
        }
        let expected = layers[0].num_blocks;
        let mut slot_offsets = Vec::with_capacity(layers.len());
        let mut host = 0u64;
        for (layer, l) in layers.iter().enumerate() {
            validate_layer(layer, l, expected, &buffer_len)?;
            let slot = l.slot_bytes().ok_or(LayoutError::Overflow { layer })?;
            slot_offsets.push(host);
            host = host.checked_add(slot).ok_or(LayoutError::Overflow { layer })?;
        }
        check_overlaps(&layers)?;
        Ok(Layout { layers, slot_offsets, block_bytes: host, num_blocks: expected })
    }

    /// The validated layers, in registration order.
    pub fn layers(&self) -> &[LayerLayout] {
        &self.layers
    }

    /// The host/wire format of this layout's blocks (module doc).
    pub fn family(&self) -> LayoutFamily {
        LayoutFamily { slots: self.layers.iter().map(|l| (l.segments(), l.bytes_per_block)).collect() }
    }

    /// Whether the layout names `buffer` in any segment.
    pub fn names_buffer(&self, buffer: DeviceBufferId) -> bool {
        self.layers.iter().any(|l| l.segment_bases().any(|s| s.buffer == buffer))
    }

    /// Blocks per layer (equal for every layer; validated).
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Host bytes of one block: `Σ segments * bytes_per_block` over layers.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Host bytes of `layer`'s slot (`segments * bytes_per_block`).
    ///
    /// # Panics
    /// If `layer >= layers().len()`.
    pub fn slot_bytes(&self, layer: usize) -> u64 {
        let l = &self.layers[layer];
        u64::from(l.segments()) * l.bytes_per_block
    }

    /// Where `layer`'s slot starts inside a host block extent (bytes): slots
    /// are concatenated in layer order, each K then V.
    ///
    /// # Panics
    /// If `layer >= layers().len()`.
    pub fn slot_offset(&self, layer: usize) -> u64 {
        self.slot_offsets[layer]
    }

    /// Checks a block index taken from outside (a request) before it is
    /// passed to [`segment_copies`](Self::segment_copies).
    ///
    /// # Errors
    /// [`LayoutError::BlockOutOfRange`] when `block_idx >= num_blocks()`.
    pub fn check_block(&self, block_idx: u64) -> Result<(), LayoutError> {
        if block_idx < self.num_blocks {
            Ok(())
        } else {
            Err(LayoutError::BlockOutOfRange { block_idx, num_blocks: self.num_blocks })
        }
    }

    /// The copies that move block `block_idx` between the device and a host
    /// block extent: one per (layer, segment), in host order (so the host
    /// offsets are increasing and contiguous, covering `[0, block_bytes())`).
    ///
    /// # Panics
    /// If `block_idx >= num_blocks()`; check untrusted indices with
    /// [`check_block`](Self::check_block) first.
    pub fn segment_copies(&self, block_idx: u64) -> impl Iterator<Item = SegmentCopy> {
        assert!(block_idx < self.num_blocks, "block index {block_idx} out of range ({} blocks)", self.num_blocks);
        self.layers.iter().zip(&self.slot_offsets).enumerate().flat_map(move |(layer, (l, &host))| {
            l.segment_bases().enumerate().map(move |(segment, base)| SegmentCopy {
                layer,
                segment: segment as u8,
                buffer: base.buffer,
                // Cannot overflow: `block_idx <= num_blocks - 1` and
                // `Layout::new` checked the last address of every segment.
                device_offset: base.offset + block_idx * l.block_stride,
                host_offset_in_block: host + segment as u64 * l.bytes_per_block,
                len: l.bytes_per_block,
            })
        })
    }

    /// [`segment_copies`](Self::segment_copies) with consecutive copies merged
    /// when they are contiguous on both sides (same buffer, the next device
    /// offset and the next host offset each start where the previous copy
    /// ends). A merged copy keeps the `layer`/`segment` of its first piece.
    /// A fused layout collapses to one copy per block.
    ///
    /// # Panics
    /// If `block_idx >= num_blocks()`.
    pub fn coalesced_copies(&self, block_idx: u64) -> Vec<SegmentCopy> {
        let mut out: Vec<SegmentCopy> = Vec::new();
        for c in self.segment_copies(block_idx) {
            if let Some(prev) = out.last_mut()
                && prev.buffer == c.buffer
                && prev.device_offset + prev.len == c.device_offset
                && prev.host_offset_in_block + prev.len == c.host_offset_in_block
            {
                prev.len += c.len;
                continue;
            }
            out.push(c);
        }
        out
    }
}

/// Per-layer checks (everything except cross-segment overlaps), in the
/// documented order.
fn validate_layer(
    layer: usize,
    l: &LayerLayout,
    expected: u64,
    buffer_len: &impl Fn(DeviceBufferId) -> Option<u64>,
) -> Result<(), LayoutError> {
    if l.num_blocks == 0 {
        return Err(LayoutError::ZeroBlocks { layer });
    }
    if l.num_blocks != expected {
        return Err(LayoutError::BlockCountMismatch { layer, expected, got: l.num_blocks });
    }
    if l.bytes_per_block == 0 {
        return Err(LayoutError::ZeroBytes { layer });
    }
    if l.num_blocks > 1 && l.block_stride < l.bytes_per_block {
        return Err(LayoutError::BlockStrideTooSmall {
            layer,
            block_stride: l.block_stride,
            bytes_per_block: l.bytes_per_block,
        });
    }
    for (segment, base) in l.segment_bases().enumerate() {
        let segment = segment as u8;
        let len = buffer_len(base.buffer).ok_or(LayoutError::UnknownBuffer { layer, segment, buffer: base.buffer })?;
        let end = l.end_offset(segment).ok_or(LayoutError::Overflow { layer })?;
        if end > len {
            return Err(LayoutError::OutOfBounds {
                layer,
                segment,
                buffer: base.buffer,
                last_byte: end - 1,
                buffer_len: len,
            });
        }
    }
    Ok(())
}

/// Whether `{[s1 + i*stride, +len1) : i < n}` and `{[s2 + j*stride, +len2) : j < n}`
/// share a byte. Exact, `O(1)`: they do iff some `k = i - j` in `[-(n-1), n-1]`
/// has `s2 - s1 - len1 < k*stride < s2 - s1 + len2`. Requires
/// `(n-1) * stride` to fit `u64` (validated per layer), so every product fits
/// `i128`.
fn progressions_overlap(s1: u64, len1: u64, s2: u64, len2: u64, stride: u64, n: u64) -> bool {
    let d = i128::from(s2) - i128::from(s1);
    let lo = d - i128::from(len1);
    let hi = d + i128::from(len2);
    if stride == 0 || n <= 1 {
        return lo < 0 && 0 < hi;
    }
    let (stride, max_k) = (i128::from(stride), i128::from(n - 1));
    // Smallest k with k*stride > lo, clamped to the feasible range.
    let k = (lo.div_euclid(stride) + 1).max(-max_k);
    k <= max_k && k * stride < hi
}

/// One (layer, segment) progression of ranges on a buffer.
#[derive(Clone, Copy)]
struct Progression {
    layer: usize,
    segment: u8,
    start: u64,
    len: u64,
    stride: u64,
    count: u64,
}

impl Progression {
    fn id(&self) -> (usize, u8) {
        (self.layer, self.segment)
    }
}

/// The overlap check across every (layer, segment) (module doc, "The
/// overlap check"). Blocks of one progression were already kept apart by
/// `validate_layer` (`block_stride >= bytes_per_block`).
fn check_overlaps(layers: &[LayerLayout]) -> Result<(), LayoutError> {
    let mut by_buffer: BTreeMap<DeviceBufferId, Vec<Progression>> = BTreeMap::new();
    for (layer, l) in layers.iter().enumerate() {
        for (segment, base) in l.segment_bases().enumerate() {
            by_buffer.entry(base.buffer).or_default().push(Progression {
                layer,
                segment: segment as u8,
                start: base.offset,
                len: l.bytes_per_block,
                stride: l.effective_stride(),
                count: l.num_blocks,
            });
        }
    }
    let mut swept = 0u64;
    for progs in by_buffer.values() {
        let uniform = progs.windows(2).all(|w| w[0].stride == w[1].stride);
        if uniform {
            check_uniform(progs)?;
        } else {
            let ranges = progs.iter().map(|p| p.count).fold(0u64, u64::saturating_add);
            swept = swept.saturating_add(ranges);
            if swept > OVERLAP_CHECK_RANGES_MAX {
                return Err(LayoutError::TooLarge { ranges: swept, max: OVERLAP_CHECK_RANGES_MAX });
            }
            check_sweep(progs)?;
        }
    }
    Ok(())
}

/// Pairwise closed-form check for progressions sharing one stride and count.
fn check_uniform(progs: &[Progression]) -> Result<(), LayoutError> {
    for (i, a) in progs.iter().enumerate() {
        for b in &progs[i + 1..] {
            if progressions_overlap(a.start, a.len, b.start, b.len, a.stride, a.count) {
                return Err(LayoutError::Overlap { a: a.id(), b: b.id() });
            }
        }
    }
    Ok(())
}

/// Exact sweep over every range in address order (k-way merge of the
/// progressions, each already sorted because `stride >= len > 0`).
fn check_sweep(progs: &[Progression]) -> Result<(), LayoutError> {
    // (start, progression, block index)
    let mut heap: BinaryHeap<Reverse<(u64, usize, u64)>> =
        progs.iter().enumerate().map(|(i, p)| Reverse((p.start, i, 0))).collect();
    let mut reach: Option<(u64, usize)> = None; // (max end so far, its progression)
    while let Some(Reverse((start, i, block))) = heap.pop() {
        let p = &progs[i];
        if let Some((max_end, owner)) = reach
            && start < max_end
        {
            let (a, b) = (progs[owner].id().min(p.id()), progs[owner].id().max(p.id()));
            return Err(LayoutError::Overlap { a, b });
        }
        let end = start + p.len;
        if reach.is_none_or(|(max_end, _)| end > max_end) {
            reach = Some((end, i));
        }
        if block + 1 < p.count {
            heap.push(Reverse((start + p.stride, i, block + 1)));
        }
    }
    Ok(())
}

/// Builds the two standard shapes in one buffer, starting at offset 0, with
/// `layers` layers of `num_blocks` blocks and `segment_bytes` bytes per
/// segment (K or V when `split`, the whole slot otherwise):
///
/// - `layer_first`: layer `l` owns the region
///   `[l * R, (l+1) * R)` with `R = segments * num_blocks * segment_bytes`;
///   inside it all blocks' K, then (when `split`) all blocks' V:
///   `block_stride = segment_bytes`, K at `l * R`, V at
///   `l * R + num_blocks * segment_bytes`.
/// - fused (`!layer_first`): block `b` occupies
///   `[b * B, (b+1) * B)` with `B = layers * segments * segment_bytes`,
///   holding layer 0's K (V), layer 1's K (V), …: `block_stride = B`, K at
///   `l * segments * segment_bytes`, V `segment_bytes` after it.
///
/// The buffer must be at least [`buffer_bytes_needed`] bytes. Sizes whose
/// products overflow `u64` saturate, and [`Layout::new`] then rejects them.
pub fn contiguous(
    buffer: DeviceBufferId,
    layers: u32,
    num_blocks: u64,
    segment_bytes: u64,
    split: bool,
    layer_first: bool,
) -> Vec<LayerLayout> {
    let segments: u64 = if split { 2 } else { 1 };
    let slot = segments.saturating_mul(segment_bytes);
    (0..u64::from(layers))
        .map(|l| {
            let (base_offset, block_stride, kv_stride) = if layer_first {
                let region = slot.saturating_mul(num_blocks);
                (l.saturating_mul(region), segment_bytes, num_blocks.saturating_mul(segment_bytes))
            } else {
                let block = slot.saturating_mul(u64::from(layers));
                (l.saturating_mul(slot), block, segment_bytes)
            };
            LayerLayout {
                num_blocks,
                bytes_per_block: segment_bytes,
                block_stride,
                k: SegmentBase::new(buffer, base_offset),
                v: split.then(|| SegmentBase::new(buffer, base_offset.saturating_add(kv_stride))),
            }
        })
        .collect()
}

/// Smallest buffer length (bytes) that holds every given segment: the
/// largest [`LayerLayout::end_offset`] over the layers' segments, whatever
/// their buffer (so for segments spread over several buffers it is an upper
/// bound for each). Saturates at `u64::MAX` on overflow; 0 for no layers.
pub fn buffer_bytes_needed(layers: &[LayerLayout]) -> u64 {
    layers.iter().flat_map(|l| (0..l.segments()).map(move |s| l.end_offset(s).unwrap_or(u64::MAX))).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const B0: DeviceBufferId = DeviceBufferId(0);
    const B1: DeviceBufferId = DeviceBufferId(1);

    fn one_buffer(len: u64) -> impl Fn(DeviceBufferId) -> Option<u64> {
        move |id| (id == B0).then_some(len)
    }

    fn big(_: DeviceBufferId) -> Option<u64> {
        Some(u64::MAX)
    }

    /// A valid single-segment layer: 4 blocks of 100 B, stride 100, at `base`.
    fn at(base: u64) -> LayerLayout {
        LayerLayout { num_blocks: 4, bytes_per_block: 100, block_stride: 100, k: SegmentBase::new(B0, base), v: None }
    }

    fn layer() -> LayerLayout {
        at(0)
    }

    /// `l` split into K and V, V `kv` bytes after K in the same buffer.
    fn split(l: LayerLayout, kv: u64) -> LayerLayout {
        LayerLayout { v: Some(SegmentBase::new(l.k.buffer, l.k.offset + kv)), ..l }
    }

    /// `l` with every segment moved to `buffer`.
    fn on(l: LayerLayout, buffer: DeviceBufferId) -> LayerLayout {
        LayerLayout { k: SegmentBase { buffer, ..l.k }, v: l.v.map(|v| SegmentBase { buffer, ..v }), ..l }
    }

    fn err(layers: Vec<LayerLayout>) -> LayoutError {
        Layout::new(layers, big).unwrap_err()
    }

    #[test]
    fn rejects_no_layers() {
        assert_eq!(Layout::new(vec![], big).unwrap_err(), LayoutError::NoLayers);
    }

    #[test]
    fn rejects_too_many_layers() {
        let layers = contiguous(B0, LAYERS_MAX as u32 + 1, 1, 8, false, true);
        assert_eq!(err(layers), LayoutError::TooManyLayers { n: LAYERS_MAX + 1 });
        let layers = contiguous(B0, LAYERS_MAX as u32, 1, 8, true, false);
        assert!(Layout::new(layers, big).is_ok());
    }

    #[test]
    fn rejects_unknown_buffer() {
        let l = on(layer(), B1);
        let e = Layout::new(vec![layer(), l], one_buffer(1 << 20)).unwrap_err();
        assert_eq!(e, LayoutError::UnknownBuffer { layer: 1, segment: 0, buffer: B1 });
        // V alone in an unknown buffer.
        let l = LayerLayout { v: Some(SegmentBase::new(B1, 0)), ..at(400) };
        let e = Layout::new(vec![l], one_buffer(1 << 20)).unwrap_err();
        assert_eq!(e, LayoutError::UnknownBuffer { layer: 0, segment: 1, buffer: B1 });
        assert_eq!(e.to_string(), "layer 0 segment 1: unknown device buffer 1");
    }

    #[test]
    fn rejects_zero_blocks() {
        let l = LayerLayout { num_blocks: 0, ..layer() };
        assert_eq!(err(vec![l]), LayoutError::ZeroBlocks { layer: 0 });
    }

    #[test]
    fn rejects_block_count_mismatch() {
        let l = LayerLayout { num_blocks: 5, ..at(1 << 20) };
        assert_eq!(err(vec![layer(), l]), LayoutError::BlockCountMismatch { layer: 1, expected: 4, got: 5 });
    }

    #[test]
    fn rejects_zero_bytes() {
        let l = LayerLayout { bytes_per_block: 0, ..layer() };
        assert_eq!(err(vec![l]), LayoutError::ZeroBytes { layer: 0 });
    }

    #[test]
    fn k_and_v_of_one_layer_may_not_overlap() {
        let l = split(LayerLayout { block_stride: 200, ..layer() }, 99);
        assert_eq!(err(vec![l]), LayoutError::Overlap { a: (0, 0), b: (0, 1) });
        let ok = split(LayerLayout { block_stride: 200, ..layer() }, 100);
        assert!(Layout::new(vec![ok], big).is_ok());
        // K of block 1 lands on V of block 0: V 150 after K, block_stride 100.
        assert_eq!(err(vec![split(layer(), 150)]), LayoutError::Overlap { a: (0, 0), b: (0, 1) });
        // V 400 = num_blocks * bytes after K: the layer-first split shape.
        assert!(Layout::new(vec![split(layer(), 400)], big).is_ok());
        // K and V in buffers of their own never overlap.
        let apart = LayerLayout { v: Some(SegmentBase::new(B1, 0)), ..layer() };
        assert!(Layout::new(vec![apart], big).is_ok());
    }

    #[test]
    fn rejects_block_stride_too_small() {
        let l = LayerLayout { block_stride: 99, ..layer() };
        assert_eq!(err(vec![l]), LayoutError::BlockStrideTooSmall { layer: 0, block_stride: 99, bytes_per_block: 100 });
        // Stride is irrelevant with one block.
        let single = LayerLayout { num_blocks: 1, block_stride: 0, ..layer() };
        assert!(Layout::new(vec![single], big).is_ok());
    }

    #[test]
    fn rejects_overflow() {
        assert_eq!(err(vec![at(u64::MAX - 50)]), LayoutError::Overflow { layer: 0 });
        let l = LayerLayout { block_stride: u64::MAX / 2, ..layer() };
        assert_eq!(err(vec![l]), LayoutError::Overflow { layer: 0 });
        let l = LayerLayout { v: Some(SegmentBase::new(B1, u64::MAX - 10)), ..layer() };
        assert_eq!(err(vec![l]), LayoutError::Overflow { layer: 0 });
        // Host-side: Σ slot bytes overflows.
        let half = u64::MAX / 2 + 1;
        let a = LayerLayout { num_blocks: 1, bytes_per_block: half, block_stride: 0, ..layer() };
        let b = on(a, B1);
        assert_eq!(err(vec![a, b]), LayoutError::Overflow { layer: 1 });
    }

    #[test]
    fn rejects_out_of_bounds() {
        let e = Layout::new(vec![layer()], one_buffer(399)).unwrap_err();
        assert_eq!(e, LayoutError::OutOfBounds { layer: 0, segment: 0, buffer: B0, last_byte: 399, buffer_len: 399 });
        assert!(Layout::new(vec![layer()], one_buffer(400)).is_ok());
        // The V segment of its own buffer, one byte short.
        let lens = |id: DeviceBufferId| Some(if id == B0 { 400 } else { 399 });
        let l = LayerLayout { v: Some(SegmentBase::new(B1, 0)), ..layer() };
        let e = Layout::new(vec![l], lens).unwrap_err();
        assert_eq!(e, LayoutError::OutOfBounds { layer: 0, segment: 1, buffer: B1, last_byte: 399, buffer_len: 399 });
    }

    #[test]
    fn rejects_overlap_between_layers() {
        // Layer 1 starts inside layer 0's last block.
        assert_eq!(err(vec![layer(), at(350)]), LayoutError::Overlap { a: (0, 0), b: (1, 0) });
        // Interleaved without a gap is fine: stride 200, layer 1 at +100.
        let l0 = LayerLayout { block_stride: 200, ..layer() };
        let l1 = LayerLayout { k: SegmentBase::new(B0, 100), ..l0 };
        assert!(Layout::new(vec![l0, l1], big).is_ok());
        // …but one byte further and layer 1's block 0 hits layer 0's block 1.
        let l1 = LayerLayout { k: SegmentBase::new(B0, 101), ..l0 };
        assert_eq!(err(vec![l0, l1]), LayoutError::Overlap { a: (0, 0), b: (1, 0) });
        // Layer 1's V on layer 0's K.
        let l1 = LayerLayout { v: Some(SegmentBase::new(B0, 300)), ..on(layer(), B1) };
        assert_eq!(err(vec![layer(), l1]), LayoutError::Overlap { a: (0, 0), b: (1, 1) });
        // Different buffers never overlap.
        assert!(Layout::new(vec![layer(), on(layer(), B1)], big).is_ok());
    }

    #[test]
    fn rejects_overlap_with_mixed_strides() {
        // Layer 0: blocks at 0, 300, 600, 900 (stride 300).
        let l0 = LayerLayout { block_stride: 300, ..layer() };
        // Layer 1, stride 100 from 1000: past layer 0's end.
        assert!(Layout::new(vec![l0, at(1000)], big).is_ok());
        // Layer 1, stride 600 from 100: 100, 700, 1300, 1900 — in layer 0's gaps.
        let l1 = LayerLayout { block_stride: 600, ..at(100) };
        assert!(Layout::new(vec![l0, l1], big).is_ok());
        // Layer 1, stride 100 from 150: its block 1 (250..350) hits layer 0's
        // block 1 (300..400).
        assert_eq!(err(vec![l0, at(150)]), LayoutError::Overlap { a: (0, 0), b: (1, 0) });
        // Reported in (layer, segment) order even when the later layer comes
        // first in address order.
        let l0 = LayerLayout { block_stride: 300, ..at(250) };
        let l1 = split(layer(), 400);
        assert_eq!(err(vec![l0, l1]), LayoutError::Overlap { a: (0, 0), b: (1, 0) });
    }

    #[test]
    fn rejects_too_large_mixed_stride_buffer() {
        let n = OVERLAP_CHECK_RANGES_MAX / 2 + 1;
        let l0 = LayerLayout { num_blocks: n, bytes_per_block: 1, block_stride: 2, ..layer() };
        let l1 = LayerLayout { block_stride: 3, k: SegmentBase::new(B0, 1 << 40), ..l0 };
        assert_eq!(err(vec![l0, l1]), LayoutError::TooLarge { ranges: 2 * n, max: OVERLAP_CHECK_RANGES_MAX });
        // The same count with one stride per buffer is checked in closed form.
        let l1 = LayerLayout { block_stride: 2, ..l1 };
        assert!(Layout::new(vec![l0, l1], big).is_ok());
    }

    #[test]
    fn large_uniform_layouts_validate_fast() {
        // 36 layers × 2 segments × 100k blocks = 7.2M ranges, over the sweep bound.
        let layers = contiguous(B0, 36, 100_000, 32 << 10, true, true);
        let need = buffer_bytes_needed(&layers);
        assert_eq!(need, 36 * 2 * 100_000 * (32 << 10));
        let layout = Layout::new(layers, one_buffer(need)).unwrap();
        assert_eq!(layout.num_blocks(), 100_000);
    }

    #[test]
    fn block_index_is_checked() {
        let layout = Layout::new(vec![layer()], big).unwrap();
        assert_eq!(layout.check_block(3), Ok(()));
        assert_eq!(layout.check_block(4), Err(LayoutError::BlockOutOfRange { block_idx: 4, num_blocks: 4 }));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn segment_copies_panic_past_the_end() {
        let layout = Layout::new(vec![layer()], big).unwrap();
        let _ = layout.segment_copies(4).count();
    }

    #[test]
    fn layer_first_split_addresses() {
        let (layers, n, seg) = (3u32, 5u64, 64u64);
        let ll = contiguous(B0, layers, n, seg, true, true);
        let need = buffer_bytes_needed(&ll);
        assert_eq!(need, u64::from(layers) * 2 * n * seg);
        let layout = Layout::new(ll, one_buffer(need)).unwrap();
        assert!(Layout::new(layout.layers().to_vec(), one_buffer(need - 1)).is_err());
        assert_eq!(layout.block_bytes(), u64::from(layers) * 2 * seg);
        for b in 0..n {
            let copies: Vec<_> = layout.segment_copies(b).collect();
            assert_eq!(copies.len(), 2 * layers as usize);
            for (i, c) in copies.iter().enumerate() {
                let (l, s) = ((i / 2) as u64, (i % 2) as u64);
                assert_eq!((c.layer, c.segment), (l as usize, s as u8));
                assert_eq!(c.buffer, B0);
                assert_eq!(c.len, seg);
                // Layer region l: K of all blocks, then V of all blocks.
                assert_eq!(c.device_offset, l * 2 * n * seg + s * n * seg + b * seg);
                assert_eq!(c.host_offset_in_block, (2 * l + s) * seg);
            }
            // Nothing is contiguous on both sides: 2 × layers copies.
            assert_eq!(layout.coalesced_copies(b), copies);
        }
    }

    #[test]
    fn fused_split_addresses_and_one_copy_per_block() {
        let (layers, n, seg) = (4u32, 3u64, 32u64);
        let ll = contiguous(B0, layers, n, seg, true, false);
        let need = buffer_bytes_needed(&ll);
        let block = u64::from(layers) * 2 * seg;
        assert_eq!(need, n * block);
        let layout = Layout::new(ll, one_buffer(need)).unwrap();
        assert_eq!(layout.block_bytes(), block);
        for b in 0..n {
            for (i, c) in layout.segment_copies(b).enumerate() {
                let i = i as u64;
                assert_eq!(c.device_offset, b * block + i * seg);
                assert_eq!(c.host_offset_in_block, i * seg);
            }
            let co = layout.coalesced_copies(b);
            assert_eq!(
                co,
                vec![SegmentCopy {
                    layer: 0,
                    segment: 0,
                    buffer: B0,
                    device_offset: b * block,
                    host_offset_in_block: 0,
                    len: block,
                }]
            );
        }
    }

    #[test]
    fn unsplit_shapes() {
        let ll = contiguous(B0, 2, 3, 10, false, true);
        assert_eq!(ll[1].k.offset, 30);
        assert_eq!((ll[1].segments(), ll[1].v, ll[1].block_stride), (1, None, 10));
        let layout = Layout::new(ll, one_buffer(60)).unwrap();
        let c = layout.coalesced_copies(2);
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].device_offset, c[1].device_offset), (20, 50));
        assert_eq!((c[0].host_offset_in_block, c[1].host_offset_in_block), (0, 10));

        let ll = contiguous(B0, 2, 3, 10, false, false);
        let layout = Layout::new(ll, one_buffer(60)).unwrap();
        let c = layout.coalesced_copies(2);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].device_offset, c[0].len), (40, 20));
    }

    #[test]
    fn layers_in_separate_buffers() {
        let mut ll = contiguous(B0, 2, 8, 16, true, true);
        ll[1] = LayerLayout { k: SegmentBase::new(B1, 0), v: Some(SegmentBase::new(B1, 128)), ..ll[1] };
        let lens = |id: DeviceBufferId| [Some(256), Some(256)].get(id.0 as usize).copied().flatten();
        let layout = Layout::new(ll, lens).unwrap();
        let c = layout.coalesced_copies(7);
        assert_eq!(c.len(), 4);
        assert_eq!(c[2].buffer, B1);
        assert_eq!((c[2].device_offset, c[3].device_offset), (7 * 16, 128 + 7 * 16));
    }

    /// The vLLM/FlashInfer "NHD" shape: per layer a K and a V tensor
    /// `[num_blocks, block_tokens, kv_heads, head_dim]`, four buffers for two
    /// layers; block `b` of each at `b * bytes_per_block`.
    #[test]
    fn paged_k_and_v_tensors_per_layer() {
        let (block_tokens, kv_heads, head_dim, elem) = (16u64, 8, 128, 2);
        let bpb = block_tokens * kv_heads * head_dim * elem;
        let n = 10;
        let ids: Vec<DeviceBufferId> = (0..4).map(DeviceBufferId).collect();
        let ll =
            vec![LayerLayout::paged(ids[0], Some(ids[1]), n, bpb), LayerLayout::paged(ids[2], Some(ids[3]), n, bpb)];
        let layout = Layout::new(ll.clone(), |_| Some(n * bpb)).unwrap();
        assert_eq!(layout.block_bytes(), 4 * bpb);
        let c: Vec<_> = layout.segment_copies(7).map(|c| (c.buffer, c.device_offset, c.host_offset_in_block)).collect();
        assert_eq!(
            c,
            vec![(ids[0], 7 * bpb, 0), (ids[1], 7 * bpb, bpb), (ids[2], 7 * bpb, 2 * bpb), (ids[3], 7 * bpb, 3 * bpb)]
        );
        // One byte short in the last V tensor.
        let short = |id: DeviceBufferId| Some(if id == ids[3] { n * bpb - 1 } else { n * bpb });
        assert!(matches!(Layout::new(ll, short), Err(LayoutError::OutOfBounds { layer: 1, segment: 1, .. })));
    }

    /// The same model's blocks have one family however each side arranged
    /// its buffers (C15): K and V as separate tensors, `[2, num_blocks, …]`
    /// in one tensor, or every layer in one region.
    #[test]
    fn buffer_arrangements_share_a_family() {
        let (n, bpb) = (6u64, 64u64);
        let separate: Vec<_> = (0..3)
            .map(|l| LayerLayout::paged(DeviceBufferId(2 * l), Some(DeviceBufferId(2 * l + 1)), n, bpb))
            .collect();
        let kv_axis: Vec<_> =
            (0..3).map(|l| split(on(LayerLayout::paged(B0, None, n, bpb), DeviceBufferId(l)), n * bpb)).collect();
        let one_region = contiguous(B0, 3, n, bpb, true, true);
        let family = |ll: Vec<LayerLayout>| Layout::new(ll, big).unwrap().family();
        let f = family(separate);
        assert_eq!(f, family(kv_axis));
        assert_eq!(f, family(one_region));
        assert_eq!(f.to_string(), "3 layers × 2 segment(s) × 64 B");
        // MLA (one segment) is another family.
        let mla = contiguous(B0, 3, n, 2 * bpb, false, true);
        assert_ne!(f, family(mla));
    }

    #[test]
    fn slot_offsets_concatenate() {
        // Mixed slot sizes: split 100-byte, single 30-byte, split 7-byte.
        let l0 = split(layer(), 400);
        let l1 =
            LayerLayout { num_blocks: 4, bytes_per_block: 30, block_stride: 30, k: SegmentBase::new(B1, 0), v: None };
        let l2 = split(LayerLayout { bytes_per_block: 7, block_stride: 7, ..at(800) }, 28);
        let layout = Layout::new(vec![l0, l1, l2], big).unwrap();
        assert_eq!((layout.slot_bytes(0), layout.slot_bytes(1), layout.slot_bytes(2)), (200, 30, 14));
        assert_eq!((layout.slot_offset(0), layout.slot_offset(1), layout.slot_offset(2)), (0, 200, 230));
        assert_eq!(layout.block_bytes(), 244);
        let copies: Vec<_> = layout.segment_copies(1).collect();
        let host: Vec<_> = copies.iter().map(|c| (c.host_offset_in_block, c.len)).collect();
        assert_eq!(host, vec![(0, 100), (100, 100), (200, 30), (230, 7), (237, 7)]);
        assert_eq!(copies[4].device_offset, 800 + 7 + 28);
        assert!(layout.names_buffer(B1) && !layout.names_buffer(DeviceBufferId(2)));
    }

    /// Brute force: do any two distinct (layer, segment, block) ranges on the
    /// same buffer intersect?
    fn brute_overlap(layers: &[LayerLayout]) -> bool {
        let mut ranges = Vec::new();
        for l in layers {
            for b in 0..l.num_blocks {
                for s in 0..l.segments() {
                    let start = l.segment_offset(b, s).unwrap();
                    ranges.push((l.segment(s).unwrap().buffer, start, start + l.bytes_per_block));
                }
            }
        }
        ranges.sort_unstable();
        ranges.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
    }

    fn arb_layer() -> impl Strategy<Value = LayerLayout> {
        (0u32..2, 0u64..64, 1u64..12, any::<bool>(), 0u32..2, 0u64..24, 0u64..64).prop_map(
            |(buf, base, bpb, split, vbuf, bs, vbase)| LayerLayout {
                num_blocks: 0, // set by the caller
                bytes_per_block: bpb,
                block_stride: bs,
                k: SegmentBase::new(DeviceBufferId(buf), base),
                v: split.then(|| SegmentBase::new(DeviceBufferId(vbuf), vbase)),
            },
        )
    }

    proptest! {
        /// The closed-form and sweep checks agree with brute force, and every
        /// copy of a valid layout is in bounds and tiles the host block.
        #[test]
        fn overlap_check_is_exact(
            mut layers in proptest::collection::vec(arb_layer(), 1..5),
            n in 1u64..6,
            same_stride in any::<bool>(),
        ) {
            let s0 = layers[0].block_stride;
            for l in &mut layers {
                l.num_blocks = n;
                if same_stride {
                    l.block_stride = s0;
                }
            }
            let lens = |_: DeviceBufferId| Some(256u64);
            match Layout::new(layers.clone(), lens) {
                Ok(layout) => {
                    prop_assert!(!brute_overlap(&layers));
                    for b in 0..n {
                        let mut host = 0;
                        for c in layout.segment_copies(b) {
                            prop_assert!(c.device_offset + c.len <= 256);
                            prop_assert_eq!(c.host_offset_in_block, host);
                            host += c.len;
                        }
                        prop_assert_eq!(host, layout.block_bytes());
                        let total: u64 = layout.coalesced_copies(b).iter().map(|c| c.len).sum();
                        prop_assert_eq!(total, layout.block_bytes());
                    }
                }
                Err(LayoutError::Overlap { .. } | LayoutError::BlockStrideTooSmall { .. }) => {
                    prop_assert!(brute_overlap(&layers))
                }
                Err(LayoutError::OutOfBounds { .. }) => {}
                Err(e) => prop_assert!(false, "unexpected {e:?}"),
            }
        }
    }
}
