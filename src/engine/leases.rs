//! Device leases (contract C19): the owner engine's promise to keep some of
//! its *device* KV blocks unchanged while a same-host decode engine copies
//! them device-to-device. Pure (no runtime; the caller passes `now_ms`).
//!
//! The P/D pattern (prefill engines in vLLM's P/D connectors, Mooncake and
//! NIXL keep a finished request's blocks until the decode side has pulled
//! them): when the prefill engine saves a request's blocks it also *grants*
//! a lease on the device blocks that hold them ([`DeviceLeases::grant`]),
//! bounded in time. A decode node that locks those blocks for transfer
//! ([`crate::engine::Engine::lock_for_transfer`]) *takes* the lease for its
//! transfer session: only one reader ever gets a lease, and only while it
//! is live. The lease then ends exactly once ([`LeaseEnd`]):
//! - **Released** when that transfer session is released (the reader is
//!   done, whatever path its bytes took);
//! - **Expired** when its deadline passes, taken or not;
//! - **Revoked** when the engine ends it itself ([`DeviceLeases::end`]) or
//!   unregisters the namespace's layout (a lease never outlives the buffer
//!   registration it names, C15).
//!
//! Every end is queued for the engine ([`DeviceLeases::drain_ended`]): that
//! is how it learns that it may reuse those device blocks. Nothing is ever
//! dropped from that queue: when it holds [`DEVICE_LEASES_ENDED_MAX`]
//! undrained ends, new grants are refused instead.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::limits::{DEVICE_LEASE_BLOCKS_MAX, DEVICE_LEASE_TTL_MS_MAX, DEVICE_LEASES_ENDED_MAX, DEVICE_LEASES_MAX};
use crate::types::BlockHash;

/// Trace target of the owner's lease events (`granted`: fields `lease`,
/// `now_ms`, `expires_at_ms`; `taken`: `session`, `leases`; `released`:
/// `session`; `revoked`: `leases`), which the simulator checks C19 with.
pub const DEVICE_LEASE_TRACE_TARGET: &str = "kvferry::device_lease";

/// Trace target of the reader's event as a device-direct copy is submitted
/// (fields `me`, `session`): no device read after its lease ended (C19).
pub const DEVICE_READ_TRACE_TARGET: &str = "kvferry::device_read";

/// A lease id: 128 bits from the engine's CSPRNG, shown as 32 hex
/// characters. Never reused within an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceLeaseId(pub u128);

impl std::fmt::Display for DeviceLeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// How a lease ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseEnd {
    /// The reader released the transfer session that took it.
    Released,
    /// Its deadline passed.
    Expired,
    /// The engine ended it, or unregistered the layout it names.
    Revoked,
}

impl LeaseEnd {
    /// `released`, `expired`, `revoked`.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseEnd::Released => "released",
            LeaseEnd::Expired => "expired",
            LeaseEnd::Revoked => "revoked",
        }
    }
}

/// A lease that ended: the device blocks the engine may reuse now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseEnded {
    /// The lease.
    pub id: DeviceLeaseId,
    /// Its namespace.
    pub namespace: Arc<str>,
    /// The engine's device block indices it covered, in grant order.
    pub blocks: Vec<u64>,
    /// How it ended.
    pub end: LeaseEnd,
    /// When (ms, engine clock).
    pub at_ms: u64,
}

/// Why a grant was refused (nothing changes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// No blocks, or more than [`DEVICE_LEASE_BLOCKS_MAX`].
    #[error("a device lease covers 1..={max} blocks, got {got}")]
    Blocks {
        /// Blocks given.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A time to live of 0 or above [`DEVICE_LEASE_TTL_MS_MAX`].
    #[error("a device lease lives 1..={max} ms, got {got} ms")]
    Ttl {
        /// Milliseconds given.
        got: u64,
        /// The limit.
        max: u64,
    },
    /// A block (hash or device index) is already under a live lease, or
    /// named twice.
    #[error("block {0} is already under a live device lease (or named twice)")]
    AlreadyLeased(String),
    /// [`DEVICE_LEASES_MAX`] live leases, or [`DEVICE_LEASES_ENDED_MAX`]
    /// ends the engine has not drained.
    #[error("too many device leases ({live} live, {ended} ended and not drained)")]
    TooMany {
        /// Live leases.
        live: usize,
        /// Undrained ends.
        ended: usize,
    },
    /// The id is already in use (RNG collision).
    #[error("duplicate device lease id")]
    Duplicate,
}

/// Counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LeaseStats {
    /// Leases granted.
    pub granted: u64,
    /// Leases taken by a reader.
    pub taken: u64,
    /// Ended by the reader's release.
    pub released: u64,
    /// Ended by their deadline.
    pub expired: u64,
    /// Ended by the engine.
    pub revoked: u64,
}

#[derive(Debug)]
struct Lease {
    namespace: Arc<str>,
    blocks: Vec<(BlockHash, u64)>,
    expires_ms: u64,
    /// The transfer session that took it.
    taken: Option<String>,
}

/// What a reader got from [`DeviceLeases::take`]: per requested hash that
/// a lease now held by the session covers, the owner's device block index.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Taken {
    /// `(index into the requested hashes, device block)`.
    pub blocks: Vec<(usize, u64)>,
    /// Earliest deadline among the taken leases (ms, engine clock).
    pub expires_ms: u64,
    /// The leases the session holds that cover requested hashes.
    pub leases: Vec<DeviceLeaseId>,
}

/// The lease table of one engine.
#[derive(Debug, Default)]
pub struct DeviceLeases {
    leases: HashMap<DeviceLeaseId, Lease>,
    /// namespace → hash → (lease, device block), looked up without a
    /// copy of the hash; and `(namespace, device block)` → lease.
    by_hash: HashMap<Arc<str>, HashMap<BlockHash, (DeviceLeaseId, u64)>>,
    by_block: HashMap<(Arc<str>, u64), DeviceLeaseId>,
    ended: VecDeque<LeaseEnded>,
    stats: LeaseStats,
}

impl DeviceLeases {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Live leases.
    pub fn live(&self) -> usize {
        self.leases.len()
    }

    /// Counters.
    pub fn stats(&self) -> LeaseStats {
        self.stats
    }

    /// Grants lease `id` on `blocks` (`(hash, device block)`) of
    /// `namespace` until `now_ms + ttl_ms`. Call [`Self::expire`] first so
    /// that an expired lease's blocks can be leased again.
    ///
    /// # Errors
    /// [`LeaseError`]; nothing changes.
    pub fn grant(
        &mut self,
        id: DeviceLeaseId,
        namespace: Arc<str>,
        blocks: Vec<(BlockHash, u64)>,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<(), LeaseError> {
        if blocks.is_empty() || blocks.len() > DEVICE_LEASE_BLOCKS_MAX {
            return Err(LeaseError::Blocks { got: blocks.len(), max: DEVICE_LEASE_BLOCKS_MAX });
        }
        if ttl_ms == 0 || ttl_ms > DEVICE_LEASE_TTL_MS_MAX {
            return Err(LeaseError::Ttl { got: ttl_ms, max: DEVICE_LEASE_TTL_MS_MAX });
        }
        if self.leases.len() >= DEVICE_LEASES_MAX || self.ended.len() >= DEVICE_LEASES_ENDED_MAX {
            return Err(LeaseError::TooMany { live: self.leases.len(), ended: self.ended.len() });
        }
        if self.leases.contains_key(&id) {
            return Err(LeaseError::Duplicate);
        }
        let mut hashes = std::collections::HashSet::new();
        let mut indices = std::collections::HashSet::new();
        let leased = self.by_hash.get(&namespace);
        for (h, b) in &blocks {
            let key_b = (namespace.clone(), *b);
            if leased.is_some_and(|m| m.contains_key(h))
                || self.by_block.contains_key(&key_b)
                || !hashes.insert(h)
                || !indices.insert(*b)
            {
                return Err(LeaseError::AlreadyLeased(format!("{} (device block {b})", hex::encode(h.as_bytes()))));
            }
        }
        let by_hash = self.by_hash.entry(namespace.clone()).or_default();
        for (h, b) in &blocks {
            by_hash.insert(h.clone(), (id, *b));
            self.by_block.insert((namespace.clone(), *b), id);
        }
        self.leases.insert(id, Lease { namespace, blocks, expires_ms: now_ms.saturating_add(ttl_ms), taken: None });
        self.stats.granted += 1;
        Ok(())
    }

    /// Transfer session `session` takes every live, untaken lease that
    /// covers one of `hashes` of `namespace` (expired ones end first).
    /// Returns the device blocks of the requested hashes covered by leases
    /// this session holds now (including ones it took before).
    pub fn take(&mut self, namespace: &str, hashes: &[BlockHash], session: &str, now_ms: u64) -> Taken {
        // C19 canary: leases past their deadline are handed out until the
        // GC collects them.
        if !crate::canary::active(crate::canary::Canary::C19LeaseExpiryIgnored) {
            self.expire(now_ms);
        }
        // No lease in the namespace: nothing taken (as an empty take ends below).
        let Some(leased) = self.by_hash.get(namespace) else { return Taken::default() };
        let mut out = Taken { blocks: Vec::new(), expires_ms: u64::MAX, leases: Vec::new() };
        for (i, h) in hashes.iter().enumerate() {
            let Some(&(id, b)) = leased.get(h) else { continue };
            let lease = self.leases.get_mut(&id).expect("index names a live lease");
            match &lease.taken {
                None => {
                    lease.taken = Some(session.to_owned());
                    self.stats.taken += 1;
                }
                Some(s) if s == session => {}
                Some(_) => continue,
            }
            out.blocks.push((i, b));
            out.expires_ms = out.expires_ms.min(lease.expires_ms);
            if !out.leases.contains(&id) {
                out.leases.push(id);
            }
        }
        if out.blocks.is_empty() {
            out.expires_ms = 0;
        }
        out
    }

    /// Ends every lease `session` took ([`LeaseEnd::Released`]); returns how
    /// many.
    pub fn release_session(&mut self, session: &str, now_ms: u64) -> usize {
        let ids: Vec<DeviceLeaseId> =
            self.leases.iter().filter(|(_, l)| l.taken.as_deref() == Some(session)).map(|(id, _)| *id).collect();
        for id in &ids {
            self.finish(*id, LeaseEnd::Released, now_ms);
        }
        ids.len()
    }

    /// Ends lease `id` ([`LeaseEnd::Revoked`]); false when it is not live.
    pub fn end(&mut self, id: DeviceLeaseId, now_ms: u64) -> bool {
        self.leases.contains_key(&id) && {
            self.finish(id, LeaseEnd::Revoked, now_ms);
            true
        }
    }

    /// Ends every lease of `namespace` ([`LeaseEnd::Revoked`]: its layout is
    /// being unregistered); returns their ids.
    pub fn revoke_namespace(&mut self, namespace: &str, now_ms: u64) -> Vec<DeviceLeaseId> {
        let mut ids: Vec<DeviceLeaseId> =
            self.leases.iter().filter(|(_, l)| &*l.namespace == namespace).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        for id in &ids {
            self.finish(*id, LeaseEnd::Revoked, now_ms);
        }
        ids
    }

    /// Ends every lease whose deadline is at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut ids: Vec<DeviceLeaseId> =
            self.leases.iter().filter(|(_, l)| l.expires_ms <= now_ms).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        for id in &ids {
            self.finish(*id, LeaseEnd::Expired, now_ms);
        }
        ids.len()
    }

    /// Takes every queued end, oldest first.
    pub fn drain_ended(&mut self) -> Vec<LeaseEnded> {
        self.ended.drain(..).collect()
    }

    fn finish(&mut self, id: DeviceLeaseId, end: LeaseEnd, now_ms: u64) {
        let Some(lease) = self.leases.remove(&id) else { return };
        if let Some(m) = self.by_hash.get_mut(&lease.namespace) {
            for (h, _) in &lease.blocks {
                m.remove(h);
            }
            if m.is_empty() {
                self.by_hash.remove(&lease.namespace);
            }
        }
        for (_, b) in &lease.blocks {
            self.by_block.remove(&(lease.namespace.clone(), *b));
        }
        match end {
            LeaseEnd::Released => self.stats.released += 1,
            LeaseEnd::Expired => self.stats.expired += 1,
            LeaseEnd::Revoked => self.stats.revoked += 1,
        }
        self.ended.push_back(LeaseEnded {
            id,
            namespace: lease.namespace,
            blocks: lease.blocks.into_iter().map(|(_, b)| b).collect(),
            end,
            at_ms: now_ms,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash(vec![i; 32].into())
    }

    fn ns() -> Arc<str> {
        Arc::from("m")
    }

    #[test]
    fn a_lease_goes_to_one_reader_and_ends_once_on_release() {
        let mut t = DeviceLeases::new();
        t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 10), (h(2), 11)], 0, 1000).unwrap();
        let a = t.take("m", &[h(0), h(1), h(2)], "s1", 5);
        assert_eq!(a.blocks, vec![(1, 10), (2, 11)]);
        assert_eq!(a.expires_ms, 1000);
        // A second reader gets nothing; the first asking again keeps it.
        assert!(t.take("m", &[h(1)], "s2", 6).blocks.is_empty());
        assert_eq!(t.take("m", &[h(2)], "s1", 6).blocks, vec![(0, 11)]);
        assert_eq!(t.release_session("s2", 7), 0);
        assert_eq!(t.release_session("s1", 7), 1);
        assert_eq!(t.release_session("s1", 8), 0, "released exactly once");
        let ended = t.drain_ended();
        assert_eq!(ended.len(), 1);
        assert_eq!((ended[0].end, ended[0].blocks.clone(), ended[0].at_ms), (LeaseEnd::Released, vec![10, 11], 7));
        assert!(t.drain_ended().is_empty());
        // The blocks may be leased again.
        t.grant(DeviceLeaseId(2), ns(), vec![(h(1), 10)], 8, 10).unwrap();
    }

    #[test]
    fn take_names_each_hashs_own_device_block_per_namespace() {
        let mut t = DeviceLeases::new();
        let blocks: Vec<(BlockHash, u64)> = (0..200u8).map(|i| (h(i), 1000 + u64::from(i))).collect();
        t.grant(DeviceLeaseId(1), ns(), blocks, 0, 100).unwrap();
        t.grant(DeviceLeaseId(2), Arc::from("x"), vec![(h(7), 5)], 0, 100).unwrap();
        // Asked in reverse, with a hash no lease covers in between.
        let asked: Vec<BlockHash> = [199u8, 250, 7, 0].iter().map(|&i| h(i)).collect();
        assert_eq!(t.take("m", &asked, "s", 1).blocks, vec![(0, 1199), (2, 1007), (3, 1000)]);
        assert_eq!(t.take("x", &asked, "s", 1).blocks, vec![(2, 5)]);
        assert_eq!(t.take("none", &asked, "s", 1), Taken::default());
        // Once ended, a lease's hashes name nothing, in its namespace only.
        assert_eq!(t.release_session("s", 2), 2);
        assert!(t.take("m", &asked, "s2", 3).blocks.is_empty());
        t.grant(DeviceLeaseId(3), ns(), vec![(h(7), 9)], 3, 100).unwrap();
        assert_eq!(t.take("m", &asked, "s2", 3).blocks, vec![(2, 9)]);
    }

    #[test]
    fn expiry_ends_taken_and_untaken_leases_and_nothing_is_read_after() {
        let mut t = DeviceLeases::new();
        t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, 100).unwrap();
        t.grant(DeviceLeaseId(2), ns(), vec![(h(2), 2)], 0, 200).unwrap();
        assert_eq!(t.take("m", &[h(1)], "s", 50).blocks, vec![(0, 1)]);
        assert_eq!(t.expire(100), 1);
        assert!(t.take("m", &[h(1)], "s", 100).blocks.is_empty(), "an expired lease is never handed out");
        assert!(t.take("m", &[h(2)], "s2", 200).blocks.is_empty());
        assert_eq!(t.release_session("s", 201), 0, "an expired lease is not released again");
        let ends: Vec<_> = t.drain_ended().into_iter().map(|e| (e.id, e.end)).collect();
        assert_eq!(ends, vec![(DeviceLeaseId(1), LeaseEnd::Expired), (DeviceLeaseId(2), LeaseEnd::Expired)]);
        assert_eq!(t.stats(), LeaseStats { granted: 2, taken: 1, released: 0, expired: 2, revoked: 0 });
    }

    #[test]
    fn bad_grants_are_refused_and_change_nothing() {
        let mut t = DeviceLeases::new();
        assert!(matches!(t.grant(DeviceLeaseId(1), ns(), vec![], 0, 10), Err(LeaseError::Blocks { .. })));
        assert!(matches!(t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, 0), Err(LeaseError::Ttl { .. })));
        assert!(matches!(
            t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, DEVICE_LEASE_TTL_MS_MAX + 1),
            Err(LeaseError::Ttl { .. })
        ));
        assert!(matches!(
            t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1), (h(2), 1)], 0, 10),
            Err(LeaseError::AlreadyLeased(_))
        ));
        t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, 10).unwrap();
        assert_eq!(t.grant(DeviceLeaseId(1), ns(), vec![(h(3), 3)], 0, 10), Err(LeaseError::Duplicate));
        assert!(matches!(t.grant(DeviceLeaseId(2), ns(), vec![(h(9), 1)], 0, 10), Err(LeaseError::AlreadyLeased(_))));
        assert!(matches!(t.grant(DeviceLeaseId(2), ns(), vec![(h(1), 9)], 0, 10), Err(LeaseError::AlreadyLeased(_))));
        // Another namespace is independent.
        t.grant(DeviceLeaseId(2), Arc::from("other"), vec![(h(1), 1)], 0, 10).unwrap();
        assert_eq!(t.live(), 2);
    }

    #[test]
    fn revocation_ends_a_namespace_and_undrained_ends_stop_new_grants() {
        let mut t = DeviceLeases::new();
        t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, 10).unwrap();
        t.grant(DeviceLeaseId(2), Arc::from("x"), vec![(h(1), 1)], 0, 10).unwrap();
        assert_eq!(t.take("m", &[h(1)], "s", 1).blocks.len(), 1);
        assert_eq!(t.revoke_namespace("m", 2), vec![DeviceLeaseId(1)]);
        assert_eq!(t.release_session("s", 3), 0, "a revoked lease is not released again");
        assert!(t.end(DeviceLeaseId(2), 3));
        assert!(!t.end(DeviceLeaseId(2), 4));
        assert_eq!(t.drain_ended().iter().map(|e| e.end).collect::<Vec<_>>(), vec![LeaseEnd::Revoked; 2]);
        for i in 0..DEVICE_LEASES_ENDED_MAX as u128 {
            t.grant(DeviceLeaseId(100 + i), ns(), vec![(h(1), 1)], 0, 10).unwrap();
            t.end(DeviceLeaseId(100 + i), 0);
        }
        assert!(matches!(t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, 10), Err(LeaseError::TooMany { .. })));
        assert_eq!(t.drain_ended().len(), DEVICE_LEASES_ENDED_MAX);
        t.grant(DeviceLeaseId(1), ns(), vec![(h(1), 1)], 0, 10).unwrap();
    }
}
