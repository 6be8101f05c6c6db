//! The on-disk record: a checksummed header carrying the block's identity
//! and its per-slot checksums, then the block's bytes (C17).
//!
//! # Layout (all integers little-endian)
//!
//! ```text
//! offset  size  field
//!      0     4  magic            0x4453_464B ("KFSD" read as bytes)
//!      4     2  version          1
//!      6     2  flags            0 (anything else is refused)
//!      8     4  header_len       bytes of the header, trailing CRC included
//!     12     4  slot_count       1..=DISK_SLOTS_MAX
//!     16     8  generation       the tier's write sequence number
//!     24     8  family           layout-family id (the caller's hash of it)
//!     32     8  payload_len      bytes of the block = sum of the slot lengths
//!     40     2  namespace_len    1..=NAMESPACE_BYTES_MAX
//!     42     2  hash_len         1..=BLOCK_HASH_BYTES_MAX
//!     44     4  reserved         0
//!     48     .  namespace        UTF-8
//!      .     .  block hash       raw bytes
//!      .  8*n   slots            per slot: len u32, CRC-32C u32 of its bytes
//!      .     4  header CRC-32C   over every header byte before it
//! ```
//!
//! The header is padded with zeros to a multiple of
//! [`DISK_ALIGN_BYTES`](crate::limits::DISK_ALIGN_BYTES) (its *area*); the
//! payload follows at that offset and is padded to the alignment too, so a
//! record is `header_area + align_up(payload_len)` bytes and can be written
//! and read with `O_DIRECT` in one operation.
//!
//! # What is checked, and against what
//!
//! [`decode_header`] accepts only a header whose magic, version, flags,
//! reserved field, every length and bound, its own length arithmetic and
//! its CRC agree. [`verify_record`] then checks that the buffer holds the
//! whole payload and that every slot's CRC-32C matches its bytes, and,
//! when the caller says what it expected, that the identity (namespace,
//! hash, family, length, generation) is exactly that. A short read, a torn
//! write (header of one write, payload of another or of none), a buffer
//! that belongs to another record, a flipped bit anywhere: each fails one
//! of these checks with its own [`FormatError`]. Nothing here panics on any
//! input (`fuzz/fuzz_targets/disk_record.rs`).
//!
//! The slot checksums are CRC-32C like the pool's seal-time checksums
//! (C10, `engine::cache::CachedBlock::checksums`), so the checksum taken
//! when the block was sealed is the one stored on disk and checked when it
//! comes back.

use std::sync::Arc;

use crate::limits::{
    BLOCK_HASH_BYTES_MAX, DISK_ALIGN_BYTES, DISK_RECORD_PAYLOAD_BYTES_MAX, DISK_SLOTS_MAX, NAMESPACE_BYTES_MAX,
};
use crate::types::BlockHash;

/// The record magic (bytes `K F S D` in file order).
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"KFSD");
/// The record format version this build writes and reads.
pub const RECORD_VERSION: u16 = 1;
/// Bytes of the fixed part of the header (before the namespace).
pub const HEADER_FIXED_BYTES: usize = 48;
/// Bytes per slot entry (length, CRC).
pub const SLOT_ENTRY_BYTES: usize = 8;
/// The longest header (bytes, unpadded).
pub const HEADER_BYTES_MAX: usize =
    HEADER_FIXED_BYTES + NAMESPACE_BYTES_MAX + BLOCK_HASH_BYTES_MAX + SLOT_ENTRY_BYTES * DISK_SLOTS_MAX + 4;

/// Which block a record holds: its namespace, block hash and layout
/// family. Two records with equal keys hold the same bytes (a block hash
/// names its content given its prefix).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    /// The layout-family namespace (1..=`NAMESPACE_BYTES_MAX` bytes).
    pub namespace: Arc<str>,
    /// The block hash (1..=`BLOCK_HASH_BYTES_MAX` bytes).
    pub hash: BlockHash,
    /// A 64-bit id of the block's layout family (per layer segments and
    /// bytes), chosen by the caller; a record is served only to a caller
    /// naming the same family.
    pub family: u64,
}

/// One slot's length (bytes) and CRC-32C.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotSum {
    /// Bytes of the slot.
    pub len: u32,
    /// CRC-32C of those bytes.
    pub crc32c: u32,
}

/// A decoded record header: the block's full identity and its slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    /// Namespace, hash, family.
    pub key: BlockKey,
    /// The tier's write sequence number: a later write of the same key has
    /// a larger one (recovery keeps the largest).
    pub generation: u64,
    /// Bytes of the block (the sum of the slot lengths).
    pub payload_len: u64,
    /// Per slot, in block order.
    pub slots: Vec<SlotSum>,
}

/// A header or record that does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Fewer bytes than the header or record needs.
    #[error("truncated: {need} B needed, {have} B present")]
    Truncated {
        /// Bytes needed (bytes).
        need: u64,
        /// Bytes present (bytes).
        have: u64,
    },
    /// Not a record (wrong magic).
    #[error("bad magic {found:#010x}")]
    BadMagic {
        /// The first four bytes, little-endian.
        found: u32,
    },
    /// A version this build does not read.
    #[error("unsupported record version {found} (this build reads {RECORD_VERSION})")]
    Version {
        /// The version found.
        found: u16,
    },
    /// A field out of its bounds, or lengths that do not add up.
    #[error("bad header field {field}: {value}")]
    Field {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The namespace is not UTF-8.
    #[error("namespace is not UTF-8")]
    NamespaceUtf8,
    /// The header's CRC does not match its bytes.
    #[error("header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    HeaderChecksum {
        /// The CRC stored in the header.
        stored: u32,
        /// The CRC of the header bytes.
        computed: u32,
    },
    /// A slot's bytes do not match its stored CRC.
    #[error("slot {slot} checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    SlotChecksum {
        /// Slot index.
        slot: usize,
        /// The CRC stored in the header.
        stored: u32,
        /// The CRC of the slot's bytes.
        computed: u32,
    },
    /// The record verifies but is not the one the caller asked for (a
    /// completion that carried another record's buffer, or a record
    /// overwritten since).
    #[error("identity mismatch: {what} differs from the expected record")]
    Identity {
        /// Which part of the identity differs.
        what: &'static str,
    },
}

/// Bytes of the header of `key` with `slots` slots (unpadded).
pub fn header_len(key: &BlockKey, slots: usize) -> usize {
    HEADER_FIXED_BYTES + key.namespace.len() + key.hash.as_bytes().len() + SLOT_ENTRY_BYTES * slots + 4
}

/// `len` rounded up to the alignment (saturating: the bounds checked
/// before every use keep it far from overflow).
fn pad(len: u64) -> u64 {
    len.div_ceil(DISK_ALIGN_BYTES).saturating_mul(DISK_ALIGN_BYTES)
}

impl RecordHeader {
    /// Bytes of the padded header: where the payload starts.
    pub fn header_area(&self) -> u64 {
        pad(header_len(&self.key, self.slots.len()) as u64)
    }

    /// Bytes of the whole record on disk (padded header + padded payload).
    pub fn record_len(&self) -> u64 {
        self.header_area() + pad(self.payload_len)
    }

    /// Checks every bound an encoded header must meet (what
    /// [`decode_header`] checks of the fields).
    ///
    /// # Errors
    /// [`FormatError::Field`] naming the first field out of bounds.
    pub fn validate(&self) -> Result<(), FormatError> {
        let f = |field, value: usize| Err(FormatError::Field { field, value: value as u64 });
        let ns = self.key.namespace.len();
        if ns == 0 || ns > NAMESPACE_BYTES_MAX {
            return f("namespace_len", ns);
        }
        let h = self.key.hash.as_bytes().len();
        if h == 0 || h > BLOCK_HASH_BYTES_MAX {
            return f("hash_len", h);
        }
        let n = self.slots.len();
        if n == 0 || n > DISK_SLOTS_MAX {
            return f("slot_count", n);
        }
        if self.payload_len > DISK_RECORD_PAYLOAD_BYTES_MAX {
            return Err(FormatError::Field { field: "payload_len", value: self.payload_len });
        }
        let sum: u64 = self.slots.iter().map(|s| u64::from(s.len)).sum();
        if sum != self.payload_len {
            return Err(FormatError::Field { field: "payload_len (sum of slots)", value: self.payload_len });
        }
        Ok(())
    }

    /// Encodes the header (unpadded, `header_len` bytes, CRC last).
    ///
    /// # Errors
    /// What [`validate`](Self::validate) finds.
    pub fn encode(&self) -> Result<Vec<u8>, FormatError> {
        self.validate()?;
        let len = header_len(&self.key, self.slots.len());
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
        out.extend_from_slice(&RECORD_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&(self.slots.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.key.family.to_le_bytes());
        out.extend_from_slice(&self.payload_len.to_le_bytes());
        out.extend_from_slice(&(self.key.namespace.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.key.hash.as_bytes().len() as u16).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(self.key.namespace.as_bytes());
        out.extend_from_slice(self.key.hash.as_bytes());
        for s in &self.slots {
            out.extend_from_slice(&s.len.to_le_bytes());
            out.extend_from_slice(&s.crc32c.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        debug_assert_eq!(out.len(), len);
        Ok(out)
    }
}

/// A little-endian reader over a slice that never panics.
struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).and_then(|s| s.try_into().ok()).map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes)
    }
}

/// Decodes and checks the header at the start of `buf` (see the module
/// doc). Bytes after the header are not looked at.
///
/// # Errors
/// [`FormatError`]: [`Truncated`](FormatError::Truncated) when `buf` is
/// shorter than the fixed part or than `header_len`, else the first check
/// that fails. Never panics.
pub fn decode_header(buf: &[u8]) -> Result<RecordHeader, FormatError> {
    let have = buf.len() as u64;
    let trunc = |need: usize| FormatError::Truncated { need: need as u64, have };
    let mut r = Rd { b: buf, at: 0 };
    let magic = r.u32().ok_or(trunc(HEADER_FIXED_BYTES))?;
    if magic != RECORD_MAGIC {
        return Err(FormatError::BadMagic { found: magic });
    }
    let version = r.u16().ok_or(trunc(HEADER_FIXED_BYTES))?;
    if version != RECORD_VERSION {
        return Err(FormatError::Version { found: version });
    }
    if buf.len() < HEADER_FIXED_BYTES {
        return Err(trunc(HEADER_FIXED_BYTES));
    }
    let fixed = |o: Option<u64>| o.ok_or(trunc(HEADER_FIXED_BYTES));
    let flags = fixed(r.u16().map(u64::from))?;
    let hlen = fixed(r.u32().map(u64::from))?;
    let slot_count = fixed(r.u32().map(u64::from))?;
    let generation = fixed(r.u64())?;
    let family = fixed(r.u64())?;
    let payload_len = fixed(r.u64())?;
    let ns_len = fixed(r.u16().map(u64::from))?;
    let hash_len = fixed(r.u16().map(u64::from))?;
    let reserved = fixed(r.u32().map(u64::from))?;
    let bad = |field, value| Err(FormatError::Field { field, value });
    if flags != 0 {
        return bad("flags", flags);
    }
    if reserved != 0 {
        return bad("reserved", reserved);
    }
    if ns_len == 0 || ns_len > NAMESPACE_BYTES_MAX as u64 {
        return bad("namespace_len", ns_len);
    }
    if hash_len == 0 || hash_len > BLOCK_HASH_BYTES_MAX as u64 {
        return bad("hash_len", hash_len);
    }
    if slot_count == 0 || slot_count > DISK_SLOTS_MAX as u64 {
        return bad("slot_count", slot_count);
    }
    if payload_len > DISK_RECORD_PAYLOAD_BYTES_MAX {
        return bad("payload_len", payload_len);
    }
    // Bounded above, so no overflow: at most HEADER_BYTES_MAX.
    let want = HEADER_FIXED_BYTES as u64 + ns_len + hash_len + SLOT_ENTRY_BYTES as u64 * slot_count + 4;
    if hlen != want {
        return bad("header_len", hlen);
    }
    let hlen = want as usize;
    if buf.len() < hlen {
        return Err(trunc(hlen));
    }
    let body = buf.get(..hlen - 4).ok_or(trunc(hlen))?;
    let stored = buf.get(hlen - 4..hlen).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes).ok_or(trunc(hlen))?;
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(FormatError::HeaderChecksum { stored, computed });
    }
    let ns = r.take(ns_len as usize).ok_or(trunc(hlen))?;
    let ns = std::str::from_utf8(ns).map_err(|_| FormatError::NamespaceUtf8)?;
    let hash = r.take(hash_len as usize).ok_or(trunc(hlen))?;
    let mut slots = Vec::with_capacity(slot_count as usize);
    let mut sum = 0u64;
    for _ in 0..slot_count {
        let len = r.u32().ok_or(trunc(hlen))?;
        let crc32c = r.u32().ok_or(trunc(hlen))?;
        sum += u64::from(len);
        slots.push(SlotSum { len, crc32c });
    }
    if sum != payload_len {
        return bad("payload_len (sum of slots)", payload_len);
    }
    let key = BlockKey { namespace: Arc::from(ns), hash: BlockHash::new(hash.to_vec()), family };
    Ok(RecordHeader { key, generation, payload_len, slots })
}

/// What a caller expects a record to be: its key and generation.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    /// The key asked for.
    pub key: &'a BlockKey,
    /// The generation the tier wrote it with.
    pub generation: u64,
    /// Its payload length (bytes).
    pub payload_len: u64,
}

/// Decodes the header at the start of `buf`, checks that `buf` holds the
/// whole payload and that every slot's CRC-32C matches, and, with
/// `expect`, that the identity is exactly the expected one. Returns the
/// header and the payload's byte range in `buf`.
///
/// # Errors
/// The first [`FormatError`] found. Never panics.
pub fn verify_record(
    buf: &[u8],
    expect: Option<Expect<'_>>,
) -> Result<(RecordHeader, std::ops::Range<usize>), FormatError> {
    let h = decode_header(buf)?;
    if let Some(e) = expect {
        if h.key.namespace != e.key.namespace {
            return Err(FormatError::Identity { what: "namespace" });
        }
        if h.key.hash != e.key.hash {
            return Err(FormatError::Identity { what: "block hash" });
        }
        if h.key.family != e.key.family {
            return Err(FormatError::Identity { what: "layout family" });
        }
        if h.payload_len != e.payload_len {
            return Err(FormatError::Identity { what: "length" });
        }
        if h.generation != e.generation {
            return Err(FormatError::Identity { what: "generation" });
        }
    }
    let start = h.header_area();
    let end = start + h.payload_len;
    if (buf.len() as u64) < end {
        return Err(FormatError::Truncated { need: end, have: buf.len() as u64 });
    }
    let mut at = start as usize;
    for (slot, s) in h.slots.iter().enumerate() {
        let next = at + s.len as usize;
        let bytes = buf.get(at..next).ok_or(FormatError::Truncated { need: next as u64, have: buf.len() as u64 })?;
        let computed = crc32c::crc32c(bytes);
        if computed != s.crc32c {
            return Err(FormatError::SlotChecksum { slot, stored: s.crc32c, computed });
        }
        at = next;
    }
    Ok((h, start as usize..end as usize))
}

/// Fuzz body of the `disk_record` target: [`decode_header`] and
/// [`verify_record`] never panic on any input; a header that decodes
/// re-encodes to exactly the bytes it was decoded from, every strict
/// prefix of those bytes is [`FormatError::Truncated`], and a record that
/// verifies has every slot's CRC matching its bytes. Panics (the fuzzer's
/// signal) only when one of these properties is broken.
#[cfg(any(test, fuzzing))]
pub fn fuzz_record_decode(data: &[u8]) {
    let res = decode_header(data);
    if let Ok(h) = &res {
        let enc = h.encode().expect("a decoded header re-encodes");
        assert_eq!(Some(enc.as_slice()), data.get(..enc.len()), "re-encoding differs");
        for cut in 0..enc.len() {
            let prefix = enc.get(..cut).expect("cut < len");
            assert!(
                matches!(decode_header(prefix), Err(FormatError::Truncated { .. })),
                "prefix {cut} of {} decodes as {:?}",
                enc.len(),
                decode_header(prefix)
            );
        }
    }
    if let Ok((h, range)) = verify_record(data, None) {
        assert_eq!(res.as_ref().ok(), Some(&h));
        assert_eq!((range.end - range.start) as u64, h.payload_len);
        let mut at = range.start;
        for s in &h.slots {
            let bytes = data.get(at..at + s.len as usize).expect("verified payload in range");
            assert_eq!(crc32c::crc32c(bytes), s.crc32c);
            at += s.len as usize;
        }
    }
    // The same bytes read as a record body: a header built from them
    // round-trips when it validates.
    if data.len() >= 2 {
        let ns_len = 1 + (data[0] as usize % 8);
        let n = 1 + (data[1] as usize % 4);
        let rest = &data[2..];
        if let (Some(ns), Some(hash)) = (rest.get(..ns_len), rest.get(ns_len..ns_len + 4)) {
            if let Ok(ns) = std::str::from_utf8(ns) {
                let key = BlockKey { namespace: Arc::from(ns), hash: BlockHash::new(hash.to_vec()), family: 7 };
                let payload: Vec<u8> = rest.iter().skip(ns_len + 4).copied().collect();
                let per = payload.len() / n;
                let slots: Vec<SlotSum> = (0..n)
                    .map(|i| {
                        let end = if i + 1 == n { payload.len() } else { (i + 1) * per };
                        let b = &payload[i * per..end];
                        SlotSum { len: b.len() as u32, crc32c: crc32c::crc32c(b) }
                    })
                    .collect();
                let h = RecordHeader { key, generation: 3, payload_len: payload.len() as u64, slots };
                let rec = encode_record_vec(&h, &payload).expect("a valid header encodes");
                let e = Expect { key: &h.key, generation: 3, payload_len: h.payload_len };
                let (got, range) = verify_record(&rec, Some(e)).expect("an encoded record verifies");
                assert_eq!(got, h);
                assert_eq!(rec.get(range), Some(payload.as_slice()));
            }
        }
    }
}

/// Writes the record of `header` with `payload` into `out`, which must be
/// exactly [`RecordHeader::record_len`] bytes: header, zero padding,
/// payload, zero padding.
///
/// # Errors
/// What [`RecordHeader::validate`] finds; [`FormatError::Field`] when the
/// payload's length differs from the header's or `out` has the wrong size.
pub fn encode_record_into(header: &RecordHeader, payload: &[u8], out: &mut [u8]) -> Result<(), FormatError> {
    let enc = header.encode()?;
    if payload.len() as u64 != header.payload_len {
        return Err(FormatError::Field { field: "payload length", value: payload.len() as u64 });
    }
    if out.len() as u64 != header.record_len() {
        return Err(FormatError::Field { field: "record buffer length", value: out.len() as u64 });
    }
    let area = header.header_area() as usize;
    let (head, body) = out.split_at_mut(area);
    head[..enc.len()].copy_from_slice(&enc);
    head[enc.len()..].fill(0);
    body[..payload.len()].copy_from_slice(payload);
    body[payload.len()..].fill(0);
    Ok(())
}

/// [`encode_record_into`] into a fresh `Vec` (tests and fuzzing).
///
/// # Errors
/// As [`encode_record_into`].
pub fn encode_record_vec(header: &RecordHeader, payload: &[u8]) -> Result<Vec<u8>, FormatError> {
    let mut out = vec![0u8; header.record_len() as usize];
    encode_record_into(header, payload, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(payload: &[u8], slots: usize) -> RecordHeader {
        let per = payload.len() / slots;
        let sums = (0..slots)
            .map(|i| {
                let end = if i + 1 == slots { payload.len() } else { (i + 1) * per };
                let b = &payload[i * per..end];
                SlotSum { len: b.len() as u32, crc32c: crc32c::crc32c(b) }
            })
            .collect();
        RecordHeader {
            key: BlockKey { namespace: Arc::from("qwen3-8b/bf16/tp1"), hash: BlockHash::from_u64(42), family: 0xfeed },
            generation: 9,
            payload_len: payload.len() as u64,
            slots: sums,
        }
    }

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + 7) as u8).collect()
    }

    #[test]
    fn round_trip() {
        let p = payload(10_000);
        let h = sample(&p, 3);
        let rec = encode_record_vec(&h, &p).unwrap();
        assert_eq!(rec.len() as u64, h.record_len());
        assert_eq!(rec.len() % 4096, 0);
        let e = Expect { key: &h.key, generation: 9, payload_len: 10_000 };
        let (got, range) = verify_record(&rec, Some(e)).unwrap();
        assert_eq!(got, h);
        assert_eq!(&rec[range], &p[..]);
        assert_eq!(decode_header(&rec).unwrap(), h);
    }

    /// Every single-bit flip in the header and in the payload is detected
    /// (header CRC or a field check, or the slot CRC), and never accepted.
    #[test]
    fn every_bit_flip_is_detected() {
        let p = payload(300);
        let h = sample(&p, 2);
        let rec = encode_record_vec(&h, &p).unwrap();
        let hlen = header_len(&h.key, 2);
        let area = h.header_area() as usize;
        let mut checked = 0;
        for byte in (0..hlen).chain(area..area + p.len()) {
            for bit in 0..8 {
                let mut bad = rec.clone();
                bad[byte] ^= 1 << bit;
                assert!(verify_record(&bad, None).is_err(), "flip of byte {byte} bit {bit} accepted");
                checked += 1;
            }
        }
        assert_eq!(checked, 8 * (hlen + p.len()));
    }

    /// A short read (any cut of the record before the payload's end) is
    /// refused as truncated; bytes past the payload (padding) do not
    /// matter.
    #[test]
    fn truncations_are_detected() {
        let p = payload(5000);
        let h = sample(&p, 4);
        let rec = encode_record_vec(&h, &p).unwrap();
        let end = h.header_area() as usize + p.len();
        for cut in (0..end).step_by(97).chain([end - 1]) {
            assert!(
                matches!(verify_record(&rec[..cut], None), Err(FormatError::Truncated { .. })),
                "cut {cut}: {:?}",
                verify_record(&rec[..cut], None)
            );
        }
        assert!(verify_record(&rec[..end], None).is_ok());
    }

    /// A torn write: the header of one record over the payload of another
    /// (same key, other bytes) fails a slot checksum; a record of another
    /// key or generation fails the identity check.
    #[test]
    fn torn_and_misdirected_records_are_detected() {
        let p1 = payload(8192);
        let mut p2 = p1.clone();
        p2[5000] ^= 0xff;
        let h1 = sample(&p1, 2);
        let r1 = encode_record_vec(&h1, &p1).unwrap();
        let mut torn = r1.clone();
        let area = h1.header_area() as usize;
        torn[area..area + p2.len()].copy_from_slice(&p2);
        assert!(matches!(verify_record(&torn, None), Err(FormatError::SlotChecksum { slot: 1, .. })));
        // Half the payload zero (never written).
        let mut half = r1.clone();
        half[area + 4096..].fill(0);
        assert!(matches!(verify_record(&half, None), Err(FormatError::SlotChecksum { .. })));

        let mut other_key = h1.key.clone();
        other_key.hash = BlockHash::from_u64(43);
        for (e, what) in [
            (Expect { key: &other_key, generation: 9, payload_len: 8192 }, "block hash"),
            (Expect { key: &h1.key, generation: 10, payload_len: 8192 }, "generation"),
            (Expect { key: &h1.key, generation: 9, payload_len: 8191 }, "length"),
        ] {
            assert_eq!(verify_record(&r1, Some(e)).unwrap_err(), FormatError::Identity { what });
        }
        let mut fam = h1.key.clone();
        fam.family = 1;
        let e = Expect { key: &fam, generation: 9, payload_len: 8192 };
        assert_eq!(verify_record(&r1, Some(e)).unwrap_err(), FormatError::Identity { what: "layout family" });
        let mut ns = h1.key.clone();
        ns.namespace = Arc::from("other");
        let e = Expect { key: &ns, generation: 9, payload_len: 8192 };
        assert_eq!(verify_record(&r1, Some(e)).unwrap_err(), FormatError::Identity { what: "namespace" });
    }

    #[test]
    fn zeros_and_garbage_are_not_records() {
        assert!(matches!(decode_header(&[0u8; 4096]), Err(FormatError::BadMagic { found: 0 })));
        assert!(matches!(decode_header(&[]), Err(FormatError::Truncated { .. })));
        let p = payload(10);
        let h = sample(&p, 1);
        let mut rec = encode_record_vec(&h, &p).unwrap();
        rec[4] = 2;
        assert_eq!(decode_header(&rec).unwrap_err(), FormatError::Version { found: 2 });
    }

    #[test]
    fn bad_headers_are_refused_at_encode() {
        let p = payload(10);
        let mut h = sample(&p, 1);
        h.payload_len = 11;
        assert!(matches!(h.encode(), Err(FormatError::Field { field: "payload_len (sum of slots)", .. })));
        let mut h = sample(&p, 1);
        h.slots.clear();
        h.payload_len = 0;
        assert!(matches!(h.encode(), Err(FormatError::Field { field: "slot_count", .. })));
        let mut h = sample(&p, 1);
        h.key.namespace = Arc::from("");
        assert!(matches!(h.encode(), Err(FormatError::Field { field: "namespace_len", .. })));
    }

    /// The Python seed writer (`fuzz/gen_seeds.py`) and this decoder agree
    /// on the format: its valid seed verifies, its torn one does not.
    #[test]
    fn python_seeds_agree_with_the_format() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/disk_record");
        let valid = std::fs::read(dir.join("valid_three_slots")).unwrap();
        let (h, range) = verify_record(&valid, None).unwrap();
        assert_eq!((&*h.key.namespace, h.key.family, h.generation, h.slots.len()), ("qwen3-8b", 0xFEED, 7, 3));
        assert_eq!(&valid[range][..300], &[0u8; 300][..]);
        let torn = std::fs::read(dir.join("torn_payload")).unwrap();
        assert!(matches!(verify_record(&torn, None), Err(FormatError::SlotChecksum { slot: 1, .. })));
        for f in ["valid_three_slots", "header_only", "torn_payload"] {
            fuzz_record_decode(&std::fs::read(dir.join(f)).unwrap());
        }
    }

    #[test]
    fn fuzz_body_seeded() {
        // Valid records as seeds too, so the body's deep checks run.
        let p = payload(700);
        fuzz_record_decode(&encode_record_vec(&sample(&p, 3), &p).unwrap());
        crate::testing::run_fuzz_seeded("disk_record", 3000, 9000, fuzz_record_decode);
    }
}
