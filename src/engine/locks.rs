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
use super::pool::SealedExtent;
use crate::types::BlockHash;

/// One transfer session.
#[derive(Debug)]
struct Session {
    /// Locked blocks sorted by extent offset (for range authorization).
    blocks: Vec<(BlockHash, CachedBlock)>,
    expires_at_ms: u64,
}

/// Why a data-plane read was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No such session (never existed, released or expired).
    #[error("unknown transfer session")]
    UnknownSession,
    /// The range is not inside one block of the session.
    #[error("range [{offset}, +{len}) of region {region} is not inside a block locked by this session")]
    OutOfRange {
        /// Region id.
        region: u32,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
    },
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

/// The lock table.
#[derive(Debug)]
pub struct LockTable {
    sessions: HashMap<String, Session>,
    max_sessions: usize,
    stats: LockStats,
}

impl LockTable {
    /// A table holding at most `max_sessions` sessions.
    pub fn new(max_sessions: usize) -> Self {
        Self { sessions: HashMap::new(), max_sessions, stats: LockStats::default() }
    }

    /// Active sessions.
    pub fn active(&self) -> usize {
        self.sessions.len()
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
        if self.sessions.contains_key(&id) {
            return Err(LockError::Duplicate);
        }
        blocks.sort_by_key(|(_, b)| b.extent.offset());
        self.sessions.insert(id, Session { blocks, expires_at_ms: now_ms.saturating_add(timeout_ms) });
        self.stats.created += 1;
        Ok(())
    }

    /// Releases a session; idempotent: an unknown (already released or
    /// expired) id returns 0.
    pub fn release(&mut self, id: &str) -> usize {
        match self.sessions.remove(id) {
            Some(s) => {
                self.stats.released += 1;
                s.blocks.len()
            }
            None => 0,
        }
    }

    /// Drops every session whose deadline passed. Returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let before = self.sessions.len();
        self.sessions.retain(|_, s| s.expires_at_ms > now_ms);
        let n = before - self.sessions.len();
        self.stats.expired += n as u64;
        n
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
    /// [`AccessError::UnknownSession`] (also for an expired-but-not-yet-GC'd
    /// session), [`AccessError::OutOfRange`].
    pub fn authorize(
        &self,
        id: &str,
        region: u32,
        offset: u64,
        len: u64,
        now_ms: u64,
    ) -> Result<(SealedExtent, u64), AccessError> {
        let s = self.sessions.get(id).filter(|s| s.expires_at_ms > now_ms).ok_or(AccessError::UnknownSession)?;
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
