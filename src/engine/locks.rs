//! Transfer locks (contract C8): sessions that pin exactly the blocks a peer
//! asked for while it reads them, with a timeout. Pure (no runtime; the
//! caller passes `now_ms`).
//!
//! A session holds clones of the blocks' [`SealedExtent`]s, so eviction
//! skips them and their memory cannot be freed while locked (C11). The
//! table is also the data plane's access policy (C13): a read is allowed
//! only inside a block locked under the session it names.
//!
//! Beyond PegaFlow: the engine runs the expiry GC itself.

use std::collections::HashMap;

use super::cache::CachedBlock;
use super::layout::Layout;
use super::pool::SealedExtent;
use crate::proto::{SlotShape, TransferBlockInfo, TransferSlotInfo};
pub use crate::transport::AccessError;
use crate::types::BlockHash;

/// One transfer session.
#[derive(Debug)]
struct Session {
    /// Locked blocks sorted by extent offset (for range authorization).
    blocks: Vec<(BlockHash, CachedBlock)>,
    expires_at_ms: u64,
}

/// Lock-table errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// The table holds `TRANSFER_SESSIONS_MAX` sessions.
    #[error("too many transfer sessions ({0})")]
    TooMany(usize),
    /// The session id is already in use (RNG collision).
    #[error("duplicate transfer session id")]
    Duplicate,
}

/// Lock-table counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LockStats {
    /// Sessions created.
    pub created: u64,
    /// Sessions released by their requester.
    pub released: u64,
    /// Sessions expired by the GC.
    pub expired: u64,
}

/// Hex characters of the incarnation prefix of a session id.
const INCARNATION_HEX: usize = 16;

/// The lock table.
#[derive(Debug)]
pub struct LockTable {
    sessions: HashMap<String, Session>,
    max_sessions: usize,
    stats: LockStats,
    /// This table's incarnation (see [`session_id`]).
    incarnation: u64,
    /// The incarnation as 16 lowercase hex characters: the prefix of every
    /// id this table issues.
    prefix: String,
    /// Sessions issued so far (the middle part of the next id).
    issued: u64,
}

/// A transfer-session id (C16): `incarnation ‖ sequence ‖ secret` as
/// 16 + 16 + 32 = 64 lowercase hex characters
/// ([`crate::limits::SESSION_ID_BYTES_MAX`]).
///
/// - The incarnation (64 random bits drawn when the engine starts) makes ids
///   of two nodes, or of two processes on one address, disjoint, and lets a
///   table refuse another incarnation's id before looking it up.
/// - The sequence (the table's count of issued sessions) makes an id never
///   repeat within an incarnation, by construction rather than by chance.
/// - The secret (128 random bits from the engine's RNG: OS entropy outside
///   the simulator) makes an id unguessable even to a peer that holds other
///   ids of the same node: it is the capability the data plane checks (C13).
pub fn session_id(incarnation: u64, sequence: u64, secret: u128) -> String {
    format!("{incarnation:016x}{sequence:016x}{secret:032x}")
}

impl LockTable {
    /// A table holding at most `max_sessions` sessions, issuing ids of
    /// `incarnation` (see [`session_id`]).
    pub fn new(max_sessions: usize, incarnation: u64) -> Self {
        Self {
            sessions: HashMap::new(),
            max_sessions,
            stats: LockStats::default(),
            incarnation,
            prefix: format!("{incarnation:016x}"),
            issued: 0,
        }
    }

    /// The id of the next session, with the caller's `secret` (128 random
    /// bits); consumed by [`LockTable::create`] when that succeeds.
    pub fn next_id(&self, secret: u128) -> String {
        session_id(self.incarnation, self.issued, secret)
    }

    /// Whether `id` was issued by this incarnation (prefix check only).
    ///
    /// # Errors
    /// [`AccessError::ForeignSession`].
    pub fn check_issuer(&self, id: &str) -> Result<(), AccessError> {
        if id.len() == 2 * INCARNATION_HEX + 32 && id.starts_with(&self.prefix) {
            Ok(())
        } else {
            Err(AccessError::ForeignSession)
        }
    }

    /// Active sessions.
    pub fn active(&self) -> usize {
        self.sessions.len()
    }

    /// Hashes session `id` pins (empty for an unknown id), in pin order.
    pub fn pinned(&self, id: &str) -> Vec<BlockHash> {
        self.sessions.get(id).map(|s| s.blocks.iter().map(|(h, _)| h.clone()).collect()).unwrap_or_default()
    }

    /// Blocks pinned across all sessions.
    pub fn pinned_blocks(&self) -> usize {
        self.sessions.values().map(|s| s.blocks.len()).sum()
    }

    /// Counters.
    pub fn stats(&self) -> LockStats {
        self.stats
    }

    /// Creates a session pinning exactly `blocks` until `now_ms + timeout_ms`.
    ///
    /// # Errors
    /// [`LockError::TooMany`], [`LockError::Duplicate`].
    pub fn create(
        &mut self,
        id: String,
        mut blocks: Vec<(BlockHash, CachedBlock)>,
        now_ms: u64,
        timeout_ms: u64,
    ) -> Result<(), LockError> {
        if self.sessions.len() >= self.max_sessions {
            return Err(LockError::TooMany(self.sessions.len()));
        }
        if self.sessions.contains_key(&id) || self.check_issuer(&id).is_err() {
            return Err(LockError::Duplicate);
        }
        // C16 canary: the sequence never advances, so the engine's next id
        // repeats once this one is gone.
        if !crate::canary::active(crate::canary::Canary::C16SessionIdsRepeat) {
            self.issued += 1;
        }
        blocks.sort_by_key(|(_, b)| b.extent.offset());
        self.sessions.insert(id, Session { blocks, expires_at_ms: now_ms.saturating_add(timeout_ms) });
        self.stats.created += 1;
        Ok(())
    }

    /// Releases a session; idempotent: an unknown (already released or
    /// expired) id of this incarnation returns `Ok(0)`.
    ///
    /// # Errors
    /// [`AccessError::ForeignSession`] for an id another node or incarnation
    /// issued (nothing is released).
    pub fn release(&mut self, id: &str) -> Result<usize, AccessError> {
        self.check_issuer(id)?;
        Ok(match self.sessions.remove(id) {
            Some(s) => {
                self.stats.released += 1;
                s.blocks.len()
            }
            None => 0,
        })
    }

    /// Drops every session whose deadline passed. Returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.expire_ids(now_ms).len()
    }

    /// Drops every session whose deadline passed. Returns their ids (in no
    /// particular order).
    pub fn expire_ids(&mut self, now_ms: u64) -> Vec<String> {
        let gone: Vec<String> =
            self.sessions.iter().filter(|(_, s)| s.expires_at_ms <= now_ms).map(|(id, _)| id.clone()).collect();
        for id in &gone {
            self.sessions.remove(id);
        }
        self.stats.expired += gone.len() as u64;
        gone
    }

    /// Oldest deadline among live sessions (for invariants).
    pub fn max_expiry_ms(&self) -> Option<u64> {
        self.sessions.values().map(|s| s.expires_at_ms).max()
    }

    /// Authorizes a data-plane read of `[offset, offset+len)` in region 0 (the
    /// pool) under session `id`: returns the block's extent (a clone, which
    /// pins the memory for the duration of the read) and the offset of the
    /// range inside it.
    ///
    /// # Errors
    /// [`AccessError::ForeignSession`], [`AccessError::UnknownSession`] (also
    /// for an expired-but-not-yet-GC'd session), [`AccessError::OutOfRange`].
    pub fn authorize(
        &self,
        id: &str,
        region: u32,
        offset: u64,
        len: u64,
        now_ms: u64,
    ) -> Result<(SealedExtent, u64), AccessError> {
        self.check_issuer(id)?;
        // C13 canary: an expired session that the GC has not collected yet
        // still authorizes reads.
        let ignore_expiry = crate::canary::active(crate::canary::Canary::C13ServeExpiredSession);
        let s = self
            .sessions
            .get(id)
            .filter(|s| ignore_expiry || s.expires_at_ms > now_ms)
            .ok_or(AccessError::UnknownSession)?;
        let oor = AccessError::OutOfRange { region, offset, len };
        if region != 0 || len == 0 {
            return Err(oor);
        }
        let end = offset.checked_add(len).ok_or_else(|| oor.clone())?;
        // Last block starting at or before `offset`.
        let idx = s.blocks.partition_point(|(_, b)| b.extent.offset() <= offset);
        let (_, b) = s.blocks.get(idx.checked_sub(1).ok_or_else(|| oor.clone())?).ok_or_else(|| oor.clone())?;
        let start = b.extent.offset();
        if end > start + b.extent.len() {
            return Err(oor);
        }
        Ok((b.extent.clone(), offset - start))
    }
}

/// The slots of a block of `layout`, relative to the block's start in the
/// pool, in layer order: one [`SlotShape`] per layer (K then V where the
/// layer splits them). Sent once per compact `QueryBlocksForTransfer`
/// answer.
pub fn slot_shapes(layout: &Layout) -> Vec<SlotShape> {
    layout
        .layers()
        .iter()
        .enumerate()
        .map(|(l, ly)| {
            let k_offset = layout.slot_offset(l);
            let seg = ly.bytes_per_block;
            let split = ly.v.is_some();
            SlotShape {
                k_offset,
                k_size: seg,
                v_offset: if split { k_offset + seg } else { 0 },
                v_size: if split { seg } else { 0 },
            }
        })
        .collect()
}

/// `device_block` of a block without one in a packed answer's
/// `packed_device_block` column.
pub const PACKED_NO_DEVICE_BLOCK: u64 = u64::MAX;

/// The locked blocks of a packed `QueryBlocksForTransfer` answer, as the
/// answer's columns (proto fields `packed_index` .. `packed_device_block`):
/// per block its index in the request, its pool offset, its slot
/// checksums (concatenated, one per slot) and, once a device grant was
/// made, its device block index ([`PACKED_NO_DEVICE_BLOCK`] for none).
/// One answer of 511 Qwen3-8B blocks decodes in about a quarter of the
/// time of a `TransferBlockInfo` per block (dev machine: 40 against
/// 158 µs).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PackedBlocks {
    /// Index of each block's hash in the request's `block_hashes`.
    pub index: Vec<u32>,
    /// Where each block starts in the owner's pool, in bytes.
    pub pool_offset: Vec<u64>,
    /// Each block's slot checksums, block after block.
    pub slot_crc32c: Vec<u32>,
    /// Each block's device block index; empty when no block has one.
    pub device_block: Vec<u64>,
}

impl PackedBlocks {
    /// The columns of `found`, the blocks a lock pinned out of
    /// `requested`, in request order as
    /// [`Engine::lock_for_transfer`](super::Engine::lock_for_transfer)
    /// returns them (a block not found in that order, which that function
    /// never returns, gets index `u32::MAX`, which makes a reader refuse
    /// the whole answer).
    pub fn new(requested: &[BlockHash], found: &[(BlockHash, CachedBlock)]) -> Self {
        let slots = found.first().map_or(0, |(_, b)| b.checksums.len());
        let mut p = Self {
            index: Vec::with_capacity(found.len()),
            pool_offset: Vec::with_capacity(found.len()),
            slot_crc32c: Vec::with_capacity(found.len() * slots),
            device_block: Vec::new(),
        };
        let mut at = 0;
        for (h, b) in found {
            match requested.get(at..).and_then(|rest| rest.iter().position(|r| r == h)) {
                Some(k) => {
                    at += k;
                    p.index.push(u32::try_from(at).unwrap_or(u32::MAX));
                    at += 1;
                }
                None => p.index.push(u32::MAX),
            }
            p.pool_offset.push(b.extent.offset());
            p.slot_crc32c.extend_from_slice(&b.checksums);
        }
        p
    }

    /// Records a device grant: `blocks[i]` is block `i`'s device index
    /// (the column stays empty when none has one).
    pub fn set_device_blocks(&mut self, blocks: &[Option<u64>]) {
        self.device_block = if blocks.iter().any(Option::is_some) {
            blocks.iter().map(|b| b.unwrap_or(PACKED_NO_DEVICE_BLOCK)).collect()
        } else {
            Vec::new()
        };
    }
}

/// Describes a locked block for `QueryBlocksForTransfer`: `compact`, its
/// pool offset and slot checksums only (the answer carries `shapes` once);
/// otherwise one `TransferSlotInfo` per slot (PegaFlow's form), placed by
/// `shapes`, the layout's [`slot_shapes`].
pub fn transfer_block_info(
    shapes: &[SlotShape],
    compact: bool,
    hash: &BlockHash,
    block: &CachedBlock,
) -> TransferBlockInfo {
    let base = block.extent.offset();
    let mut info = TransferBlockInfo { block_hash: hash.0.clone(), ..Default::default() };
    if compact {
        info.pool_offset = Some(base);
        info.slot_crc32c = block.checksums.to_vec();
        return info;
    }
    info.slots = shapes
        .iter()
        .zip(block.checksums.iter())
        .map(|(s, &crc32c)| TransferSlotInfo {
            k_ptr: base + s.k_offset,
            k_size: s.k_size,
            v_ptr: if s.v_size == 0 { 0 } else { base + s.v_offset },
            v_size: s.v_size,
            numa_node: 0,
            crc32c,
        })
        .collect();
    info
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::PackedBlocks;
    use crate::engine::cache::CachedBlock;
    use crate::engine::pool::Pool;
    use crate::types::BlockHash;

    /// The packed columns of a lock's found blocks: each block's index in
    /// the request (strictly increasing, what a reader requires), its
    /// pool offset and its checksums in order — also when the request
    /// names a hash twice (each occurrence its own index) or a block in
    /// between was not found.
    #[test]
    fn packed_indices_follow_the_request_and_only_increase() {
        let pool = Pool::new(1 << 16, 64).unwrap();
        let block =
            |crc: u32| CachedBlock { extent: pool.alloc(64).unwrap().seal(), checksums: Arc::from(vec![crc, crc + 1]) };
        let (a, b, c) = (BlockHash::from_u64(1), BlockHash::from_u64(2), BlockHash::from_u64(3));
        let requested = vec![a.clone(), b.clone(), a.clone(), c.clone()];
        // b was not found; a twice (the request's two occurrences), then c.
        let found = vec![(a.clone(), block(10)), (a.clone(), block(20)), (c.clone(), block(30))];
        let p = PackedBlocks::new(&requested, &found);
        assert_eq!(p.index, vec![0, 2, 3]);
        assert_eq!(p.pool_offset, found.iter().map(|(_, b)| b.extent.offset()).collect::<Vec<_>>());
        assert_eq!(p.slot_crc32c, vec![10, 11, 20, 21, 30, 31]);
        assert!(p.device_block.is_empty());
    }
}
