//! `SlotIndex`: the MetaServer store's `key hash → slot id` table, an
//! open-addressing hash table of 8-byte buckets with linear probing and
//! backward-shift deletion (Knuth, TAOCP vol. 3, §6.4, Algorithm R).
//!
//! Why not `std::collections::HashMap<key, slot id>`: at tens of millions of
//! keys a lookup there costs three dependent cache misses (the control
//! group, the bucket holding the key, then the slot the bucket names), and
//! `perf` put over half of the MetaServer's query time in them. Here a
//! bucket is `(32 bits of the key's hash, slot id)`, eight to a cache line:
//! a lookup reads one line of buckets, then the slot (where the caller keeps
//! the key) to confirm. Both addresses can be computed ahead, so a caller
//! walking many keys can prefetch them ([`prefetch`]) and overlap
//! the misses of different keys, which a `HashMap` offers no way to do.
//! The table also stores no key: 8 bytes a bucket at a load of 3/8 to 3/4
//! against roughly 70 for a `HashMap<[u8; 32], u32>`.
//!
//! The caller supplies every key's 64-bit hash (a keyed hash, so that
//! network input cannot pick colliding keys) and an equality test on slot
//! ids. A bucket's home is the low bits of the stored 32-bit hash, so the
//! table grows without rehashing keys; it holds at most 2³² buckets.

/// One bucket: `slot == EMPTY` marks a free one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bucket {
    /// The low 32 bits of the key's hash.
    hash: u32,
    /// The caller's slot id.
    slot: u32,
}

const EMPTY: u32 = u32::MAX;
const FREE: Bucket = Bucket { hash: 0, slot: EMPTY };
/// Smallest non-empty table, in buckets.
const MIN_BUCKETS: usize = 16;
/// Largest table, in buckets: a bucket's home comes from 32 hash bits.
#[cfg(target_pointer_width = "64")]
const MAX_BUCKETS: usize = 1 << 32;
#[cfg(not(target_pointer_width = "64"))]
const MAX_BUCKETS: usize = 1 << (usize::BITS - 4);

/// A `key → slot id` table; see the module docs. Slot ids are any `u32`
/// but `u32::MAX`.
#[derive(Debug, Default)]
pub(super) struct SlotIndex {
    buckets: Vec<Bucket>,
    len: usize,
}

impl SlotIndex {
    /// Entries stored.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries the table holds before it next grows.
    pub(super) fn capacity(&self) -> usize {
        max_len(self.buckets.len())
    }

    /// Grows the table (if needed) so that `additional` more entries fit
    /// without another growth.
    ///
    /// # Panics
    /// If the memory cannot be had (tests and benchmarks; the store uses
    /// [`SlotIndex::try_reserve`]).
    #[cfg(test)]
    pub(super) fn reserve(&mut self, additional: usize) {
        self.try_reserve(additional).expect("index growth");
    }

    /// [`SlotIndex::reserve`], fallible: when the larger table cannot be
    /// allocated (or `additional` entries cannot fit in 2³² buckets) the
    /// table is left as it was.
    ///
    /// # Errors
    /// The allocator's refusal.
    pub(super) fn try_reserve(&mut self, additional: usize) -> Result<(), std::collections::TryReserveError> {
        let want = self.len.saturating_add(additional);
        if want <= self.capacity() {
            return Ok(());
        }
        let mut n = self.buckets.len().max(MIN_BUCKETS);
        while max_len(n) < want && n < MAX_BUCKETS {
            n *= 2;
        }
        if n != self.buckets.len() {
            let table = new_table(n)?;
            let old = std::mem::replace(&mut self.buckets, table);
            for b in old.into_iter().filter(|b| b.slot != EMPTY) {
                self.place(b);
            }
        }
        Ok(())
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    fn home(&self, hash: u32) -> usize {
        hash as usize & self.mask()
    }

    /// The slot id of the entry with `hash` for which `eq(slot)` holds, if
    /// any. `eq` is called only for entries whose stored hash bits match.
    pub(super) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let h = hash as u32;
        let mut i = self.home(h);
        loop {
            let b = self.buckets[i];
            if b.slot == EMPTY {
                return None;
            }
            if b.hash == h && eq(b.slot) {
                return Some(b.slot);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// The slot id of the first entry whose stored hash bits match `hash`
    /// (maybe another key's: a hint for prefetching, not an answer).
    pub(super) fn first_candidate(&self, hash: u64) -> Option<u32> {
        self.find(hash, |_| true)
    }

    /// The address and size of `hash`'s home bucket, for [`prefetch`]
    /// (`None` while the table is empty).
    pub(super) fn home_address(&self, hash: u64) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        Some((&self.buckets[self.home(hash as u32)] as *const Bucket as usize, std::mem::size_of::<Bucket>()))
    }

    /// Adds an entry; the caller makes sure no entry for the same key is
    /// present. May grow the table (O(entries), amortised O(1)).
    ///
    /// # Panics
    /// If `slot` is `u32::MAX`, or the table is full at 2³² buckets.
    #[cfg(test)]
    pub(super) fn insert(&mut self, hash: u64, slot: u32) {
        self.try_insert(hash, slot).expect("index growth");
    }

    /// [`SlotIndex::insert`], fallible: when the table must grow and the
    /// memory cannot be had, nothing changes.
    ///
    /// # Errors
    /// The allocator's refusal.
    ///
    /// # Panics
    /// If `slot` is `u32::MAX`, or the table is full at 2³² buckets.
    pub(super) fn try_insert(&mut self, hash: u64, slot: u32) -> Result<(), std::collections::TryReserveError> {
        assert_ne!(slot, EMPTY, "slot id u32::MAX is reserved");
        self.try_reserve(1)?;
        assert!(self.len < self.capacity(), "SlotIndex full at {} buckets", self.buckets.len());
        self.place(Bucket { hash: hash as u32, slot });
        self.len += 1;
        Ok(())
    }

    /// Puts `b` in the first free bucket from its home (there is one).
    fn place(&mut self, b: Bucket) {
        let mut i = self.home(b.hash);
        while self.buckets[i].slot != EMPTY {
            i = (i + 1) & self.mask();
        }
        self.buckets[i] = b;
    }

    /// Removes the entry of `slot` filed under `hash`; returns whether it was
    /// there. Later entries of its probe run move back, so no tombstone is
    /// left and lookups never slow down with churn.
    pub(super) fn remove(&mut self, hash: u64, slot: u32) -> bool {
        if self.len == 0 {
            return false;
        }
        let h = hash as u32;
        let mask = self.mask();
        let mut i = self.home(h);
        loop {
            let b = self.buckets[i];
            if b.slot == EMPTY {
                return false;
            }
            if b.slot == slot && b.hash == h {
                break;
            }
            i = (i + 1) & mask;
        }
        // Algorithm R: `i` is the hole; an entry further along the run moves
        // into it unless its home lies cyclically in (i, j].
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b.slot == EMPTY {
                break;
            }
            let k = self.home(b.hash);
            let stays = if i <= j { i < k && k <= j } else { i < k || k <= j };
            if !stays {
                self.buckets[i] = b;
                i = j;
            }
        }
        self.buckets[i] = FREE;
        self.len -= 1;
        if self.len == 0 {
            // Release the memory of a table that emptied.
            self.buckets = Vec::new();
        }
        true
    }

    /// Every entry as `(low 32 bits of its hash, slot id)`, in table order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.buckets.iter().filter(|b| b.slot != EMPTY).map(|b| (b.hash, b.slot))
    }

    /// Slot ids of every entry, in table order.
    pub(super) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries().map(|(_, s)| s)
    }
}

/// A table of `buckets` free buckets. On Linux, a table of at least
/// [`HUGE_PAGE_BYTES`] is first advised to use transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`, honoured when THP is in `madvise` or `always`
/// mode), before a byte of it is written so that its first-touch faults
/// map 2 MiB pages. Why: lookups of random keys touch a random page of the
/// table each; at tens of millions of keys (hundreds of MiB of buckets)
/// almost every one misses the TLB with 4 KiB pages, and the page walks
/// queued behind the query walk's prefetches were a quarter of its time
/// (`perf`, session 8); with huge pages the whole table fits the TLB.
///
/// # Errors
/// The allocator's refusal (nothing is allocated then).
fn new_table(buckets: usize) -> Result<Vec<Bucket>, std::collections::TryReserveError> {
    let mut table: Vec<Bucket> = Vec::new();
    table.try_reserve_exact(buckets)?;
    #[cfg(target_os = "linux")]
    if let Some((at, len)) = whole_pages(table.as_ptr() as usize, buckets * std::mem::size_of::<Bucket>()) {
        // SAFETY: advice only, on whole pages inside the table's own
        // allocation; it changes no byte and cannot fail in a way that
        // matters (a refusal leaves 4 KiB pages).
        unsafe {
            libc::madvise(at as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
    }
    table.resize(buckets, FREE);
    Ok(table)
}

/// Bytes of the bucket table that holds `entries` without growing.
pub(super) fn table_bytes(entries: usize) -> u64 {
    let mut n = MIN_BUCKETS;
    while max_len(n) < entries && n < MAX_BUCKETS {
        n *= 2;
    }
    (n as u64).saturating_mul(std::mem::size_of::<Bucket>() as u64)
}

/// Tables smaller than this (one x86-64 huge page) are not advised.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// The whole 4 KiB pages inside the `len` bytes at `at`, as `(start, len)`,
/// when they span at least [`HUGE_PAGE_BYTES`]. `madvise` refuses (EINVAL)
/// a start that is not page-aligned, and a large `Vec` starts just past
/// its allocator's header, so the advice covers the pages inside.
fn whole_pages(at: usize, len: usize) -> Option<(usize, usize)> {
    const PAGE: usize = 4096;
    let start = at.checked_next_multiple_of(PAGE)?;
    let end = at.checked_add(len)? & !(PAGE - 1);
    (end >= start.checked_add(HUGE_PAGE_BYTES)?).then(|| (start, end - start))
}

/// Entries a table of `buckets` buckets holds: a load of at most 3/4 keeps
/// linear probing short (≈ 2.5 buckets read by a hit, 8.5 by a miss).
fn max_len(buckets: usize) -> usize {
    buckets / 4 * 3
}

/// Asks the CPU to start loading the cache lines of the `len` bytes at
/// address `at` (`len` ≥ 1) into every cache level (a no-op on other
/// architectures than x86-64). Any address is fine, even one freed since it
/// was taken: a prefetch is a hint that never faults and changes no value
/// the program reads.
#[inline]
pub(super) fn prefetch(at: usize, len: usize) {
    const LINE: usize = 64;
    let last = at.saturating_add(len.max(1) - 1) & !(LINE - 1);
    let mut line = at & !(LINE - 1);
    loop {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: PREFETCHT0 reads nothing into the program and cannot
        // fault, whatever the address (Intel SDM vol. 2B, PREFETCHh).
        #[allow(unused_unsafe)]
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(line as *const i8);
        }
        if line >= last {
            break;
        }
        line += LINE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn huge_page_advice_covers_the_whole_pages_inside_a_large_table_only() {
        const MIB: usize = 1 << 20;
        // A Vec's block starts just past the allocator's 16-byte header.
        let at = 0x7f00_0000_0010;
        let (start, len) = whole_pages(at, 8 * MIB).unwrap();
        assert_eq!(start, 0x7f00_0000_1000, "first whole page");
        assert_eq!(start + len, (at + 8 * MIB) & !4095, "last whole page");
        assert!(start >= at && start + len <= at + 8 * MIB, "inside the table");
        assert_eq!(whole_pages(0x7f00_0000_0000, 4 * MIB), Some((0x7f00_0000_0000, 4 * MIB)));
        // Smaller than a huge page once trimmed to whole pages: no advice.
        assert_eq!(whole_pages(at, 2 * MIB), None);
        assert_eq!(whole_pages(at, 64 * 1024), None);
        // Address arithmetic near the top cannot overflow.
        assert_eq!(whole_pages(usize::MAX - 100, 8 * MIB), None);
    }

    #[test]
    fn a_table_larger_than_a_huge_page_works_as_any_other() {
        let mut t = SlotIndex::default();
        t.reserve(1 << 19); // 2^20 buckets, 8 MiB: advised.
        assert!(t.buckets.len() * std::mem::size_of::<Bucket>() >= 4 * HUGE_PAGE_BYTES);
        assert!(t.buckets.iter().all(|b| *b == FREE));
        for s in 0..1000u32 {
            t.insert(u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15), s);
        }
        assert!((0..1000u32).all(|s| t.find(u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15), |x| x == s) == Some(s)));
    }

    #[test]
    fn finds_what_was_inserted_and_forgets_what_was_removed() {
        let mut t = SlotIndex::default();
        assert_eq!(t.find(7, |_| true), None);
        for s in 0..1000u32 {
            t.insert(u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15), s);
        }
        assert_eq!(t.len(), 1000);
        assert!(t.capacity() >= 1000 && t.buckets.len().is_power_of_two());
        for s in 0..1000u32 {
            let h = u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            assert_eq!(t.find(h, |x| x == s), Some(s));
            assert_eq!(t.first_candidate(h), Some(s), "distinct 32-bit hashes here");
        }
        for s in (0..1000u32).step_by(2) {
            assert!(t.remove(u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15), s));
            assert!(!t.remove(u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15), s), "removed once");
        }
        for s in 0..1000u32 {
            let h = u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            assert_eq!(t.find(h, |x| x == s), (s % 2 == 1).then_some(s));
        }
        for s in (1..1000u32).step_by(2) {
            assert!(t.remove(u64::from(s).wrapping_mul(0x9e37_79b9_7f4a_7c15), s));
        }
        assert!(t.is_empty() && t.buckets.is_empty(), "an emptied table frees its buckets");
    }

    #[test]
    fn colliding_hashes_are_told_apart_by_eq() {
        let mut t = SlotIndex::default();
        for s in 0..20u32 {
            t.insert(42, s); // one hash for all: one long probe run
        }
        for s in 0..20u32 {
            assert_eq!(t.find(42, |x| x == s), Some(s));
        }
        assert!(t.remove(42, 3));
        assert_eq!(t.find(42, |x| x == 3), None);
        assert_eq!(t.find(42, |x| x == 19), Some(19));
    }

    #[test]
    fn reserve_sizes_up_front() {
        let mut t = SlotIndex::default();
        t.reserve(10_000);
        let buckets = t.buckets.len();
        assert!(t.capacity() >= 10_000);
        for s in 0..10_000u32 {
            t.insert(u64::from(s).wrapping_mul(0x2545_f491_4f6c_dd1d), s);
        }
        assert_eq!(t.buckets.len(), buckets, "no growth below the reserved size");
    }

    proptest! {
        /// Against a `HashMap` model, with hashes from a tiny range so that
        /// probe runs collide, wrap around the table's end and shift back.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((any::<bool>(), 0u32..64, 0u64..48), 1..400)) {
            let mut t = SlotIndex::default();
            let mut model: HashMap<u32, u64> = HashMap::new();
            for (add, slot, hash) in ops {
                // Hashes spread over the table's top buckets too (wrap-around).
                let hash = hash.wrapping_mul(0x0101_0101) | 0xf;
                if add {
                    if let std::collections::hash_map::Entry::Vacant(e) = model.entry(slot) {
                        e.insert(hash);
                        t.insert(hash, slot);
                    }
                } else if let Some(h) = model.remove(&slot) {
                    prop_assert!(t.remove(h, slot));
                } else {
                    prop_assert!(!t.remove(hash, slot));
                }
                prop_assert_eq!(t.len(), model.len());
                for (&s, &h) in &model {
                    prop_assert_eq!(t.find(h, |x| x == s), Some(s));
                }
                let mut listed: Vec<u32> = t.slots().collect();
                listed.sort_unstable();
                let mut want: Vec<u32> = model.keys().copied().collect();
                want.sort_unstable();
                prop_assert_eq!(listed, want);
            }
        }
    }
}
