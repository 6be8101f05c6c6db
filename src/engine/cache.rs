//! The block cache: sealed blocks by `(namespace, hash)` with LRU order.
//! Pure (no runtime).
//!
//! A block's memory is a [`SealedExtent`]; the cache holds one clone. Any
//! other clone — a lease, a transfer lock, an in-flight copy or read — makes
//! [`SealedExtent::holders`] exceed 1, and eviction skips the block (C11).
//! Eviction walks the LRU order oldest first and inspects at most
//! `scan_max` entries (bounded scan).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::pool::SealedExtent;
use crate::types::BlockHash;

/// A sealed block: its pool extent and one CRC-32C per slot (layer), taken at
/// seal time (C10).
#[derive(Clone, Debug)]
pub struct CachedBlock {
    /// Pool memory holding every slot of the block (layers concatenated).
    pub extent: SealedExtent,
    /// CRC-32C of each slot's bytes (K then V), by layer.
    pub checksums: Arc<[u32]>,
}

type Key = (Arc<str>, BlockHash);

#[derive(Debug)]
struct Entry {
    block: CachedBlock,
    tick: u64,
}

/// The cache. See the module doc.
#[derive(Debug, Default)]
pub struct BlockCache {
    map: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    next_tick: u64,
    bytes: u64,
}

impl BlockCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks resident.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes of pool memory the cache references.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// True when the block is resident (does not touch the LRU order).
    pub fn contains(&self, namespace: &Arc<str>, hash: &BlockHash) -> bool {
        self.map.contains_key(&(namespace.clone(), hash.clone()))
    }

    /// Inserts a sealed block. Returns `false` (and leaves the cache as it
    /// was) when the block is already resident: late duplicates change
    /// nothing and their extent is freed by the caller's drop.
    pub fn insert(&mut self, namespace: &Arc<str>, hash: BlockHash, block: CachedBlock) -> bool {
        let key = (namespace.clone(), hash);
        if self.map.contains_key(&key) {
            return false;
        }
        let tick = self.bump();
        self.bytes += block.extent.len();
        self.lru.insert(tick, key.clone());
        self.map.insert(key, Entry { block, tick });
        true
    }

    fn bump(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    /// Returns a clone of the block (a lease while it is held) and marks it
    /// most recently used.
    pub fn get(&mut self, namespace: &Arc<str>, hash: &BlockHash) -> Option<CachedBlock> {
        let key = (namespace.clone(), hash.clone());
        let tick = self.next_tick + 1;
        let e = self.map.get_mut(&key)?;
        self.lru.remove(&e.tick);
        e.tick = tick;
        self.next_tick = tick;
        self.lru.insert(tick, key);
        Some(e.block.clone())
    }

    /// Removes a block regardless of holders (its memory lives on while
    /// others hold it). Returns whether it was resident.
    pub fn remove(&mut self, namespace: &Arc<str>, hash: &BlockHash) -> bool {
        match self.map.remove(&(namespace.clone(), hash.clone())) {
            Some(e) => {
                self.lru.remove(&e.tick);
                self.bytes -= e.block.extent.len();
                true
            }
            None => false,
        }
    }

    /// Evicts least-recently-used blocks no one else holds until at least
    /// `bytes_wanted` bytes were released or `scan_max` entries were
    /// inspected. Returns the evicted keys (the caller enqueues a removal for
    /// each, C4).
    pub fn evict(&mut self, bytes_wanted: u64, scan_max: usize) -> Vec<(Arc<str>, BlockHash)> {
        self.evict_blocks(bytes_wanted, scan_max).into_iter().map(|(k, _)| k).collect()
    }

    /// [`evict`](Self::evict), also handing back each victim's block (its
    /// extent is freed when the caller drops it: e.g. after writing it to
    /// the disk tier).
    pub fn evict_blocks(&mut self, bytes_wanted: u64, scan_max: usize) -> Vec<((Arc<str>, BlockHash), CachedBlock)> {
        let mut released = 0u64;
        let mut victims = Vec::new();
        for (tick, key) in self.lru.iter().take(scan_max) {
            if released >= bytes_wanted {
                break;
            }
            let e = &self.map[key];
            if e.block.extent.holders() > 1 && !crate::canary::active(crate::canary::Canary::C11EvictHeld) {
                continue; // leased, locked or in flight
            }
            released += e.block.extent.len();
            victims.push((*tick, key.clone()));
        }
        victims
            .into_iter()
            .filter_map(|(tick, key)| {
                self.lru.remove(&tick);
                let e = self.map.remove(&key)?;
                self.bytes -= e.block.extent.len();
                Some((key, e.block))
            })
            .collect()
    }

    /// Resident hashes grouped by namespace (the backfill source, C6).
    pub fn resident(&self) -> Vec<(String, Vec<BlockHash>)> {
        let mut by_ns: BTreeMap<&str, Vec<BlockHash>> = BTreeMap::new();
        for (ns, h) in self.map.keys() {
            by_ns.entry(ns).or_default().push(h.clone());
        }
        by_ns
            .into_iter()
            .map(|(ns, mut v)| {
                v.sort();
                (ns.to_string(), v)
            })
            .collect()
    }
}
