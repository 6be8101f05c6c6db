//! CRC-32C arithmetic for checksums computed where the bytes already are.
//!
//! A save seals every slot with its CRC-32C (C10). Computing it on the CPU
//! after a GPU copy reads the whole pool a second time and, at PCIe rates,
//! halves save throughput. Instead a backend can checksum the *source*
//! bytes in pieces (the CUDA backend does it in device memory, beside the
//! copy) and the host folds the piece checksums into slot checksums. This
//! module holds the parts of that which need no device:
//!
//! - GF(2) arithmetic modulo the CRC-32C polynomial in the reflected bit
//!   order ([`mul_mod`], [`x_pow_8n`], [`ShiftTable`]), the standard
//!   technique behind `crc32_combine` (zlib) and GPU/SIMD CRC folding:
//!   for raw CRCs (initial value 0, no final xor),
//!   `raw(A‖B) = raw(A) · x^(8·|B|) ⊕ raw(B)`.
//! - The table set the device kernel uploads once ([`kernel_tables`]) and a
//!   CPU model of the kernel's per-piece algorithm ([`piece_raw_model`]),
//!   tested against the `crc32c` crate so the arithmetic is checked in every
//!   build, not only on a GPU.
//! - Splitting copies into pieces that never straddle a checksum range
//!   ([`split_op`]) and folding piece checksums back into the standard
//!   CRC-32C of each range ([`RangeFolder`]).
//!
//! Bit order: a `u32` holds a polynomial of degree < 32 with bit 31 as the
//! coefficient of `x^0` (the reflected order the CRC-32C tables use).

use std::sync::{Arc, Mutex, OnceLock};

/// The CRC-32C (Castagnoli) polynomial without its `x^32` term, reflected.
pub const POLY: u32 = 0x82F6_3B78;

/// The polynomial `1` in the reflected order.
const ONE: u32 = 0x8000_0000;

/// Bytes each device thread checksums serially (one "chunk").
pub const CHUNK_BYTES: u64 = 256;

/// Threads per block of the device checksum kernel: one chunk each.
pub const CHUNKS_PER_PIECE: u64 = 256;

/// Largest piece the device kernel checksums in one thread block (bytes):
/// `CHUNK_BYTES * CHUNKS_PER_PIECE` = 64 KiB.
pub const PIECE_BYTES_MAX: u64 = CHUNK_BYTES * CHUNKS_PER_PIECE;

/// `a · b mod P` for reflected polynomials.
pub fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut p = 0;
    let mut m = ONE;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        // b · x: the x^31 coefficient (bit 0) leaves, x^32 reduces to POLY.
        b = (b >> 1) ^ (POLY & (b & 1).wrapping_neg());
        m >>= 1;
    }
    p
}

/// `x^(8·n) mod P`: the factor that appends `n` zero bytes to a raw CRC.
pub fn x_pow_8n(mut n: u64) -> u32 {
    let mut result = ONE;
    let mut square = ONE >> 8; // x^8
    while n != 0 {
        if n & 1 != 0 {
            result = mul_mod(result, square);
        }
        square = mul_mod(square, square);
        n >>= 1;
    }
    result
}

/// The byte-at-a-time table and the three further slicing-by-4 tables.
pub fn slicing_tables() -> [[u32; 256]; 4] {
    let mut t = [[0u32; 256]; 4];
    for i in 0..256u32 {
        let mut c = i;
        for _ in 0..8 {
            c = (c >> 1) ^ (POLY & (c & 1).wrapping_neg());
        }
        t[0][i as usize] = c;
    }
    for k in 1..4 {
        for i in 0..256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
        }
    }
    t
}

/// Raw CRC-32C (initial 0, no final xor) of `data` continuing from `crc`,
/// four bytes at a time — the loop each device thread runs.
pub fn raw_update(t: &[[u32; 256]; 4], mut crc: u32, data: &[u8]) -> u32 {
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        crc ^= u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        crc = t[3][(crc & 0xff) as usize]
            ^ t[2][((crc >> 8) & 0xff) as usize]
            ^ t[1][((crc >> 16) & 0xff) as usize]
            ^ t[0][(crc >> 24) as usize];
    }
    for &b in words.remainder() {
        crc = t[0][((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

/// Standard CRC-32C (initial and final xor `0xFFFF_FFFF`, as the `crc32c`
/// crate and the seal use) of `len` bytes whose raw CRC is `raw`.
pub fn raw_to_standard(raw: u32, len: u64) -> u32 {
    raw ^ mul_mod(!0, x_pow_8n(len)) ^ !0
}

/// Multiplication by one constant `x^(8·n)` as four byte-indexed tables
/// (linearity: `v · c = ⊕_j (byte_j(v) · x^(8j)) · c`), so shifting a raw
/// CRC past `n` bytes costs four lookups.
pub struct ShiftTable([[u32; 256]; 4]);

impl ShiftTable {
    /// Table for shifting past `n` bytes.
    pub fn new(n: u64) -> Self {
        let c = x_pow_8n(n);
        let mut t = [[0u32; 256]; 4];
        for (j, row) in t.iter_mut().enumerate() {
            for (b, v) in row.iter_mut().enumerate() {
                *v = mul_mod((b as u32) << (8 * j), c);
            }
        }
        Self(t)
    }

    /// `v · x^(8n) mod P`.
    pub fn apply(&self, v: u32) -> u32 {
        let t = &self.0;
        t[0][(v & 0xff) as usize]
            ^ t[1][((v >> 8) & 0xff) as usize]
            ^ t[2][((v >> 16) & 0xff) as usize]
            ^ t[3][(v >> 24) as usize]
    }
}

/// Shift tables and zero-run CRCs by length, shared by every fold in the
/// process (a deployment sees a handful of piece and slot lengths; building
/// a table costs 1,024 multiplications, about the time of folding a
/// thousand pieces).
fn cached(len: u64) -> Arc<(ShiftTable, u32)> {
    const ENTRIES_MAX: usize = 64;
    static CACHE: OnceLock<Mutex<Vec<(u64, Arc<(ShiftTable, u32)>)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some((_, t)) = cache.lock().expect("crc cache lock").iter().find(|(n, _)| *n == len) {
        return t.clone();
    }
    let t = Arc::new((ShiftTable::new(len), raw_to_standard(0, len)));
    let mut c = cache.lock().expect("crc cache lock");
    if c.len() >= ENTRIES_MAX {
        c.remove(0);
    }
    c.push((len, t.clone()));
    t
}

/// Bytes one thread block of the fused copy-and-checksum kernel moves per
/// step (a *stripe*): 256 threads × 32 bytes. A piece the fused kernel
/// takes is a whole number of stripes.
pub const STRIPE_BYTES: u64 = 8192;

/// Bytes of a stripe each thread checksums (its *lane chunk*).
const LANE_BYTES: u64 = STRIPE_BYTES / CHUNKS_PER_PIECE;

/// Where the fused kernel's constants start in [`kernel_tables`]: the
/// shift past one stripe less a lane chunk (four byte-indexed tables, as
/// [`ShiftTable`]), then each thread's final shift.
pub const STRIPE_SHIFT_AT: usize = 1024 + CHUNKS_PER_PIECE as usize + CHUNK_BYTES as usize + 1;

/// Start of `end_shift[t] = x^(8·(STRIPE_BYTES − 32·t − 32))` in
/// [`kernel_tables`], for thread `t < 256`.
pub const END_SHIFT_AT: usize = STRIPE_SHIFT_AT + 1024;

/// Entries of [`kernel_tables`]: slicing tables, chunk shifts, byte
/// shifts, then the fused kernel's stripe shift table and end shifts.
pub const KERNEL_TABLE_WORDS: usize = END_SHIFT_AT + CHUNKS_PER_PIECE as usize;

/// The constants the device kernels read, `KERNEL_TABLE_WORDS` `u32`s:
/// `[0, 1024)` the slicing-by-4 tables (table `k` at `256·k`);
/// `[1024, 1280)` `chunk_shift[k] = x^(8·CHUNK_BYTES·k)` for `k < 256`;
/// `[1280, 1537)` `byte_shift[r] = x^(8·r)` for `r ≤ CHUNK_BYTES`;
/// `[STRIPE_SHIFT_AT, +1024)` the [`ShiftTable`] of
/// `STRIPE_BYTES − 32` bytes; `[END_SHIFT_AT, +256)` the end shifts.
pub fn kernel_tables() -> Vec<u32> {
    let mut v: Vec<u32> = slicing_tables().iter().flatten().copied().collect();
    v.extend((0..CHUNKS_PER_PIECE).map(|k| x_pow_8n(CHUNK_BYTES * k)));
    v.extend((0..=CHUNK_BYTES).map(x_pow_8n));
    v.extend(ShiftTable::new(STRIPE_BYTES - LANE_BYTES).0.iter().flatten());
    v.extend((0..CHUNKS_PER_PIECE).map(|t| x_pow_8n(STRIPE_BYTES - LANE_BYTES * t - LANE_BYTES)));
    v
}

/// CPU model of the fused copy-and-checksum kernel on one *item* (on
/// sm_80 and later a run of pieces of one checksum range, together a whole
/// number of stripes, any length; on older devices one piece): the kernel
/// reads each stripe with coalesced loads, and thread `t` folds bytes
/// `[32t, 32t+32)` of every stripe into its accumulator, first shifting
/// the accumulator past the stripe less its own 32 bytes
/// (`acc' = raw_update(acc · x^(8·(STRIPE−32)), lane chunk)`, i.e.
/// `acc · x^(8·STRIPE) ⊕ raw(lane chunk)`); at the end each accumulator is
/// shifted to the item's end (`end_shift[t]`, the same for every length)
/// and all are xored — linearity of the raw CRC. Where the item's pieces
/// end does not matter.
pub fn fused_piece_raw_model(tables: &[u32], item: &[u8]) -> u32 {
    let len = item.len() as u64;
    assert!(len > 0 && len.is_multiple_of(STRIPE_BYTES), "item length {len}");
    let mut t = [[0u32; 256]; 4];
    for (k, row) in t.iter_mut().enumerate() {
        row.copy_from_slice(&tables[256 * k..256 * (k + 1)]);
    }
    let mut shift = [[0u32; 256]; 4];
    for (k, row) in shift.iter_mut().enumerate() {
        row.copy_from_slice(&tables[STRIPE_SHIFT_AT + 256 * k..STRIPE_SHIFT_AT + 256 * (k + 1)]);
    }
    let shift = ShiftTable(shift);
    let lane = LANE_BYTES as usize;
    (0..CHUNKS_PER_PIECE as usize).fold(0, |x, tid| {
        let acc = item
            .chunks(STRIPE_BYTES as usize)
            .fold(0, |acc, stripe| raw_update(&t, shift.apply(acc), &stripe[lane * tid..lane * (tid + 1)]));
        x ^ mul_mod(acc, tables[END_SHIFT_AT + tid])
    })
}

/// CPU model of the device kernel on one piece (`1..=PIECE_BYTES_MAX`
/// bytes): thread `t` takes the raw CRC of chunk `t`; every chunk but the
/// last is shifted to the end of the full-chunk prefix and xor-reduced;
/// the prefix is shifted past the last chunk and the last chunk's CRC added.
pub fn piece_raw_model(tables: &[u32], piece: &[u8]) -> u32 {
    assert!(!piece.is_empty() && piece.len() as u64 <= PIECE_BYTES_MAX, "piece length {}", piece.len());
    let mut t = [[0u32; 256]; 4];
    for (k, row) in t.iter_mut().enumerate() {
        row.copy_from_slice(&tables[256 * k..256 * (k + 1)]);
    }
    let chunk_shift = &tables[1024..1024 + CHUNKS_PER_PIECE as usize];
    let byte_shift = &tables[1024 + CHUNKS_PER_PIECE as usize..];
    let chunks: Vec<&[u8]> = piece.chunks(CHUNK_BYTES as usize).collect();
    let last = chunks.len() - 1;
    let prefix = chunks[..last]
        .iter()
        .enumerate()
        .fold(0, |acc, (i, c)| acc ^ mul_mod(raw_update(&t, 0, c), chunk_shift[last - 1 - i]));
    mul_mod(prefix, byte_shift[chunks[last].len()]) ^ raw_update(&t, 0, chunks[last])
}

/// One host range whose CRC-32C a save wants (a slot of a block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChecksumRange {
    /// Index of the host extent in the batch.
    pub extent: usize,
    /// Byte offset in that extent.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Checksum ranges grouped by extent and sorted by offset, for [`split_op`].
pub struct RangeIndex {
    /// Per extent: `(start, end, range index)`, sorted, non-overlapping.
    by_extent: Vec<Vec<(u64, u64, u32)>>,
    /// Start offset of each range (by range index).
    starts: Vec<u64>,
}

impl RangeIndex {
    /// Indexes `ranges` of a batch with `extents` host extents. `None` when
    /// a range names a missing extent, is empty, or overlaps another (the
    /// caller then checksums on the CPU instead).
    pub fn new(ranges: &[ChecksumRange], extents: usize) -> Option<Self> {
        let mut by_extent: Vec<Vec<(u64, u64, u32)>> = vec![Vec::new(); extents];
        for (i, r) in ranges.iter().enumerate() {
            let end = r.offset.checked_add(r.len)?;
            if r.len == 0 || r.extent >= extents {
                return None;
            }
            by_extent[r.extent].push((r.offset, end, u32::try_from(i).ok()?));
        }
        for v in &mut by_extent {
            v.sort_unstable();
            if v.windows(2).any(|w| w[0].1 > w[1].0) {
                return None;
            }
        }
        Some(Self { by_extent, starts: ranges.iter().map(|r| r.offset).collect() })
    }
}

/// Splits the host span `[offset, offset+len)` of `extent` into pieces of
/// at most `piece_max` bytes that never straddle a checksum range boundary,
/// calling `out(offset_in_span, piece_len, range)` in order; `range` is the
/// index of the range holding the piece, if any.
pub fn split_op(
    index: &RangeIndex,
    extent: usize,
    offset: u64,
    len: u64,
    piece_max: u64,
    mut out: impl FnMut(u64, u64, Option<u32>),
) {
    let ranges = index.by_extent.get(extent).map_or(&[][..], Vec::as_slice);
    // First range ending after `offset`.
    let mut i = ranges.partition_point(|r| r.1 <= offset);
    let (mut pos, end) = (offset, offset + len);
    while pos < end {
        let (limit, range) = match ranges.get(i) {
            Some(&(s, e, r)) if s <= pos => (e, Some(r)),
            Some(&(s, _, _)) => (s, None),
            None => (end, None),
        };
        let n = (limit.min(end) - pos).min(piece_max);
        out(pos - offset, n, range);
        pos += n;
        if ranges.get(i).is_some_and(|r| r.1 <= pos) {
            i += 1;
        }
    }
}

/// The checksummed pieces of the host span `[offset, offset+len)` of
/// `extent` ([`split_op`] at [`PIECE_BYTES_MAX`], pieces outside every range
/// skipped): `out(range, offset_in_range, offset_in_span, piece_len)`, in
/// order — what a backend checksums and then hands to
/// [`RangeFolder::add`].
pub fn checksum_pieces(
    index: &RangeIndex,
    extent: usize,
    offset: u64,
    len: u64,
    mut out: impl FnMut(u32, u64, u64, u64),
) {
    split_op(index, extent, offset, len, PIECE_BYTES_MAX, |off, n, range| {
        if let Some(r) = range {
            out(r, offset + off - index.starts[r as usize], off, n);
        }
    });
}

/// Folds raw piece CRCs into the standard CRC-32C of each range. Pieces of
/// a range must arrive in host order and tile it exactly; anything else
/// makes [`RangeFolder::finish`] answer `None`.
pub struct RangeFolder<'a> {
    ranges: &'a [ChecksumRange],
    /// Per range: (bytes folded so far, raw CRC so far).
    state: Vec<(u64, u32)>,
    /// The last length's shift table (a batch's pieces mostly share one).
    last: Option<(u64, Arc<(ShiftTable, u32)>)>,
    broken: bool,
}

impl<'a> RangeFolder<'a> {
    /// A folder for `ranges`.
    pub fn new(ranges: &'a [ChecksumRange]) -> Self {
        Self { ranges, state: vec![(0, 0); ranges.len()], last: None, broken: false }
    }

    /// Adds the raw CRC of the piece of `range` starting `offset` bytes
    /// into the range, `len` bytes long.
    pub fn add(&mut self, range: u32, offset: u64, len: u64, raw: u32) {
        let Some(s) = self.state.get_mut(range as usize) else {
            self.broken = true;
            return;
        };
        if s.0 != offset {
            self.broken = true;
            return;
        }
        if self.last.as_ref().is_none_or(|(n, _)| *n != len) {
            self.last = Some((len, cached(len)));
        }
        let shift = &self.last.as_ref().expect("just set").1.0;
        s.1 = shift.apply(s.1) ^ raw;
        s.0 += len;
    }

    /// Standard CRC-32C per range, or `None` if a range was not tiled.
    pub fn finish(self) -> Option<Vec<u32>> {
        if self.broken {
            return None;
        }
        let mut last: Option<(u64, u32)> = None;
        self.ranges
            .iter()
            .zip(self.state)
            .map(|(r, (done, raw))| {
                let zero = match last {
                    Some((n, z)) if n == r.len => z,
                    _ => {
                        let z = cached(r.len).1;
                        last = Some((r.len, z));
                        z
                    }
                };
                (done == r.len).then_some(raw ^ zero)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random()).collect()
    }

    #[test]
    fn raw_update_matches_the_crc32c_crate() {
        let t = slicing_tables();
        for n in [0usize, 1, 3, 4, 5, 255, 256, 257, 4096, 65_536, 100_003] {
            let d = bytes(n, n as u64);
            assert_eq!(raw_to_standard(raw_update(&t, 0, &d), n as u64), crc32c::crc32c(&d), "len {n}");
        }
    }

    #[test]
    fn shifting_by_x_pow_8n_appends_zero_bytes() {
        let t = slicing_tables();
        let d = bytes(1000, 7);
        let raw = raw_update(&t, 0, &d);
        for n in [0u64, 1, 7, 256, 32_768, 65_536, 1 << 20] {
            let zeros = vec![0u8; n as usize];
            let want = raw_update(&t, raw, &zeros);
            assert_eq!(mul_mod(raw, x_pow_8n(n)), want, "n {n}");
            assert_eq!(ShiftTable::new(n).apply(raw), want, "table n {n}");
        }
    }

    #[test]
    fn kernel_model_matches_the_crc32c_crate_for_every_piece_shape() {
        let tables = kernel_tables();
        assert_eq!(tables.len(), KERNEL_TABLE_WORDS);
        let d = bytes(PIECE_BYTES_MAX as usize, 1);
        let mut lens: Vec<usize> = vec![1, 2, 255, 256, 257, 511, 512, 4096, 32_768, 65_535, 65_536];
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        lens.extend((0..50).map(|_| rng.random_range(1..=PIECE_BYTES_MAX as usize)));
        for n in lens {
            let raw = piece_raw_model(&tables, &d[..n]);
            assert_eq!(raw_to_standard(raw, n as u64), crc32c::crc32c(&d[..n]), "len {n}");
        }
    }

    #[test]
    fn fused_kernel_model_matches_the_crc32c_crate_for_every_stripe_count() {
        let tables = kernel_tables();
        for seed in 0..3 {
            let d = bytes(PIECE_BYTES_MAX as usize, 10 + seed);
            for stripes in 1..=(PIECE_BYTES_MAX / STRIPE_BYTES) as usize {
                let n = stripes * STRIPE_BYTES as usize;
                let raw = fused_piece_raw_model(&tables, &d[..n]);
                assert_eq!(raw_to_standard(raw, n as u64), crc32c::crc32c(&d[..n]), "len {n}");
                assert_eq!(raw, piece_raw_model(&tables, &d[..n]), "agrees with the two-pass kernel's model");
            }
        }
    }

    #[test]
    fn a_fused_item_longer_than_a_piece_is_the_crc_of_its_bytes() {
        let tables = kernel_tables();
        // 37 stripes: several 64 KiB pieces and a shorter one, as an item
        // of scattered segments is.
        let d = bytes(37 * STRIPE_BYTES as usize, 77);
        let raw = fused_piece_raw_model(&tables, &d);
        assert_eq!(raw_to_standard(raw, d.len() as u64), crc32c::crc32c(&d));
    }

    fn ranges_of(spec: &[(usize, u64, u64)]) -> Vec<ChecksumRange> {
        spec.iter().map(|&(extent, offset, len)| ChecksumRange { extent, offset, len }).collect()
    }

    #[test]
    fn split_op_cuts_at_range_boundaries_and_piece_size() {
        let ranges = ranges_of(&[(0, 100, 50), (0, 150, 30), (0, 300, 10), (1, 0, 8)]);
        let idx = RangeIndex::new(&ranges, 2).unwrap();
        let mut got = Vec::new();
        split_op(&idx, 0, 90, 230, 20, |o, n, r| got.push((o, n, r)));
        assert_eq!(
            got,
            vec![
                (0, 10, None),     // 90..100 before any range
                (10, 20, Some(0)), // 100..120
                (30, 20, Some(0)), // 120..140
                (50, 10, Some(0)), // 140..150 end of range 0
                (60, 20, Some(1)), // 150..170
                (80, 10, Some(1)), // 170..180
                (90, 20, None),    // 180..200 gap
                (110, 20, None),
                (130, 20, None),
                (150, 20, None),
                (170, 20, None),
                (190, 20, None),    // 280..300 gap end
                (210, 10, Some(2)), // 300..310
                (220, 10, None),    // 310..320 after the last range
            ]
        );
        let total: u64 = got.iter().map(|g| g.1).sum();
        assert_eq!(total, 230);
        // A span starting inside a range.
        let mut got = Vec::new();
        split_op(&idx, 0, 160, 15, 64, |o, n, r| got.push((o, n, r)));
        assert_eq!(got, vec![(0, 15, Some(1))]);
        // Extent without ranges, and an extent index past the table.
        let mut got = Vec::new();
        split_op(&idx, 5, 0, 50, 64, |o, n, r| got.push((o, n, r)));
        assert_eq!(got, vec![(0, 50, None)]);
    }

    #[test]
    fn range_index_rejects_overlaps_empty_ranges_and_missing_extents() {
        assert!(RangeIndex::new(&ranges_of(&[(0, 0, 10), (0, 5, 10)]), 1).is_none());
        assert!(RangeIndex::new(&ranges_of(&[(0, 0, 0)]), 1).is_none());
        assert!(RangeIndex::new(&ranges_of(&[(1, 0, 4)]), 1).is_none());
        assert!(RangeIndex::new(&ranges_of(&[(0, u64::MAX, 4)]), 1).is_none());
        assert!(RangeIndex::new(&ranges_of(&[(0, 0, 10), (0, 10, 10)]), 1).is_some());
    }

    /// The whole host-side path: split ops into pieces, checksum each piece
    /// like the kernel, fold — equals the crate's CRC of every range.
    #[test]
    fn folding_kernel_pieces_gives_each_range_checksum() {
        let tables = kernel_tables();
        let ext = bytes(300_000, 3);
        let ranges = ranges_of(&[(0, 0, 65_536), (0, 65_536, 100_000), (0, 165_536, 7), (0, 170_000, 130_000)]);
        let idx = RangeIndex::new(&ranges, 1).unwrap();
        let mut folder = RangeFolder::new(&ranges);
        // Two ops covering the extent, split at an odd point.
        for (op_off, op_len) in [(0u64, 123_457u64), (123_457, 300_000 - 123_457)] {
            checksum_pieces(&idx, 0, op_off, op_len, |r, in_range, o, n| {
                let at = op_off + o;
                assert_eq!(at, ranges[r as usize].offset + in_range);
                let raw = piece_raw_model(&tables, &ext[at as usize..(at + n) as usize]);
                folder.add(r, in_range, n, raw);
            });
        }
        let got = folder.finish().expect("every range tiled");
        let want: Vec<u32> =
            ranges.iter().map(|r| crc32c::crc32c(&ext[r.offset as usize..(r.offset + r.len) as usize])).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn folder_refuses_gaps_and_out_of_order_pieces() {
        let ranges = ranges_of(&[(0, 0, 100)]);
        let mut f = RangeFolder::new(&ranges);
        f.add(0, 0, 50, 1);
        assert!(f.finish().is_none(), "half a range is not a checksum");
        let mut f = RangeFolder::new(&ranges);
        f.add(0, 50, 50, 1);
        f.add(0, 0, 50, 1);
        assert!(f.finish().is_none(), "out of order");
        let mut f = RangeFolder::new(&ranges);
        f.add(3, 0, 100, 1);
        assert!(f.finish().is_none(), "unknown range");
    }
}
