//! The pinned host pool: one arena allocated once at start, registered once
//! with the GPU and the NIC, carved into block slots (design.md §1 "pinned
//! pool").
//!
//! # Why one arena
//!
//! Registering memory with a GPU (`cuMemHostRegister`) or a NIC
//! (`ibv_reg_mr`) is slow and pins pages, so it must happen once, not per
//! block. The pool therefore allocates a single zeroed, 4096-byte aligned
//! arena in [`Pool::new`], exposes it through [`Pool::base_ptr`] /
//! [`Pool::arena_len`] for that one registration, and from then on only hands
//! out *offsets* inside it. The bookkeeping lives in [`ExtentAllocator`], a
//! pure struct with no memory of its own, so it can be unit-tested, fuzzed and
//! simulated without touching the arena.
//!
//! # Holders and C11 (no early free)
//!
//! An allocation starts as an [`Extent`]: uniquely owned and writable (the
//! GPU → host copy of `save` lands here). Once every slot is written the
//! engine calls [`Extent::seal`], which turns it into a [`SealedExtent`]: a
//! cheap `Clone` (an `Arc`) that only gives `&[u8]`. Every party that must
//! keep the bytes alive — the cache index, a load lease, a transfer lock, an
//! in-flight transport read — holds its own clone. The bytes go back to the
//! allocator only when the last clone drops, so eviction (which merely drops
//! the cache's clone) can never free memory someone else still reads: that
//! is contract C11 by construction. [`SealedExtent::holders`] reports the
//! number of clones so eviction can skip blocks that are pinned
//! (`holders() > 1`) instead of dropping a clone that would not free
//! anything. Pool exhaustion is an error value ([`PoolError::Exhausted`]),
//! never a panic.
//!
//! # Soundness
//!
//! The only `unsafe` code turns `(arena base, offset, len)` into slices and
//! implements `Send`/`Sync` for the arena owner. It is sound because:
//!
//! 1. **Disjointness.** The allocator hands out pairwise disjoint ranges of
//!    `[0, capacity)` and `capacity <= arena_len`; a range is handed out again
//!    only after its previous holder returned it (the allocator keeps an exact
//!    record of live ranges and rejects any free that does not match one).
//! 2. **Exclusive writes.** An [`Extent`] is not `Clone`; `&mut [u8]` is only
//!    reachable through `&mut Extent`, so the borrow checker makes that access
//!    exclusive, and by (1) no other extent aliases those bytes.
//! 3. **Shared reads.** A [`SealedExtent`] only ever yields `&[u8]`; sealing
//!    consumes the `Extent`, so no `&mut` to those bytes can exist any more.
//! 4. **Lifetime.** Every extent holds an `Arc` to the pool internals, which
//!    own the arena. The arena is deallocated when the [`Pool`] handle and
//!    every extent (sealed or not) are gone — never while a slice into it can
//!    still be produced.
//! 5. **Initialisation.** The arena comes from `alloc_zeroed` (or, shared,
//!    from a fresh memfd, which reads as zeros), so every byte is
//!    initialised before any slice is formed. A shared arena's file is
//!    sealed against shrinking, so its pages can never disappear under a
//!    mapping; only this process's mapping may write it (`memfd.rs`).
//!
//! What Rust cannot check: the raw pointers given out ([`Pool::base_ptr`],
//! [`Extent::as_mut_ptr`], [`SealedExtent::as_ptr`]) are for DMA engines. The
//! caller must only let a device *write* into an unsealed [`Extent`] it holds
//! exclusively, and must keep the extent (or a sealed clone) alive until the
//! device operation has completed (a timeout never frees a buffer; only a
//! completion does — house style, doors shaped like the hardware).

use std::alloc::{self, Layout as AllocLayout};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Alignment of the arena's base address (bytes). A page, so the arena can be
/// registered with `cuMemHostRegister`/`ibv_reg_mr` without a partial first
/// page. A larger allocator `align` raises the arena alignment to match.
pub const ARENA_ALIGN_BYTES: u64 = 4096;

/// A pool configuration or operating error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The requested size or alignment cannot make a pool: zero capacity, an
    /// alignment that is zero or not a power of two, or a size that does not
    /// fit the address space once rounded.
    #[error("bad pool config: capacity {capacity_bytes} B, align {align} B: {reason}")]
    BadConfig {
        /// The requested capacity (bytes).
        capacity_bytes: u64,
        /// The requested allocation alignment (bytes).
        align: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The system allocator returned null for the arena.
    #[error("could not allocate a {bytes} B pool arena")]
    ArenaAlloc {
        /// The arena size that was asked for (bytes).
        bytes: u64,
    },
    /// No free extent is large enough for the request. `free` may exceed
    /// `requested` when the free space is fragmented (`largest_free` says by
    /// how much the largest run falls short).
    #[error("pool exhausted: requested {requested} B, free {free} B, largest free extent {largest_free} B")]
    Exhausted {
        /// The length asked for (bytes, before rounding to the alignment).
        requested: u64,
        /// Total free bytes at the time of the request.
        free: u64,
        /// Length of the largest free extent (bytes).
        largest_free: u64,
    },
    /// [`Pool::prefault`] was called while extents were live (it writes
    /// into the arena, so it runs only before the first allocation).
    #[error("cannot prefault a pool with {live_extents} live extents")]
    InUse {
        /// Extents live at the call.
        live_extents: usize,
    },
}

impl PoolError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            PoolError::BadConfig { .. } => "pool_bad_config",
            PoolError::ArenaAlloc { .. } => "pool_arena_alloc",
            PoolError::Exhausted { .. } => "pool_exhausted",
            PoolError::InUse { .. } => "pool_in_use",
        }
    }
}

/// A free that does not match a live allocation: an internal bug (double
/// free, free of a range that was never handed out, or a wrong length), never
/// the result of remote input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    /// No live allocation starts at `offset`.
    #[error("free of unallocated range at offset {offset} (len {len})")]
    NotAllocated {
        /// Offset passed to `free` (bytes).
        offset: u64,
        /// Length passed to `free` (bytes).
        len: u64,
    },
    /// A live allocation starts at `offset` but has another rounded length.
    #[error("free at offset {offset}: len {len} rounds to {rounded} B but {allocated} B were allocated")]
    LengthMismatch {
        /// Offset passed to `free` (bytes).
        offset: u64,
        /// Length passed to `free` (bytes).
        len: u64,
        /// `len` rounded up to the alignment (bytes).
        rounded: u64,
        /// Rounded length recorded at allocation (bytes).
        allocated: u64,
    },
}

impl FreeError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            FreeError::NotAllocated { .. } => "pool_free_not_allocated",
            FreeError::LengthMismatch { .. } => "pool_free_length_mismatch",
        }
    }
}

/// Best-fit allocator over `[0, capacity)`; pure bookkeeping, no memory.
///
/// Every extent starts at a multiple of `align` and occupies its length
/// rounded up to a multiple of `align` (a zero-length request takes one unit,
/// so every live extent has a distinct offset). Free space is a
/// `BTreeMap<offset, len>` of maximal free extents (always coalesced: no two
/// are adjacent) plus a `BTreeSet<(len, offset)>` size index, so `alloc` is
/// `O(log n)` best fit: the smallest free extent that fits, ties broken by the
/// lowest offset; the request is carved from that extent's start. Live
/// extents are recorded exactly (`BTreeMap<offset, rounded len>`) so a double
/// free or a free of a range that was never handed out is detected
/// ([`FreeError`]) instead of corrupting the free lists.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    capacity: u64,
    align: u64,
    /// Free extents: offset → length (bytes). Coalesced, disjoint.
    free: BTreeMap<u64, u64>,
    /// Size index of `free`: (length, offset).
    by_size: BTreeSet<(u64, u64)>,
    /// Live extents: offset → rounded length (bytes).
    live: BTreeMap<u64, u64>,
    /// Sum of the rounded lengths in `live` (bytes).
    used: u64,
}

impl ExtentAllocator {
    /// An allocator over `[0, capacity)` handing out `align`-aligned extents.
    /// `capacity` is rounded *down* to a multiple of `align` (a tail shorter
    /// than one unit can never be allocated); [`capacity`](Self::capacity)
    /// reports the rounded value. All sizes are bytes.
    ///
    /// # Errors
    /// [`PoolError::BadConfig`] when `align` is not a power of two or the
    /// rounded capacity is zero.
    pub fn new(capacity: u64, align: u64) -> Result<Self, PoolError> {
        let bad = |reason| PoolError::BadConfig { capacity_bytes: capacity, align, reason };
        if !align.is_power_of_two() {
            return Err(bad("align must be a power of two"));
        }
        let usable = capacity & !(align - 1);
        if usable == 0 {
            return Err(bad("capacity must hold at least one aligned unit"));
        }
        let mut a = Self {
            capacity: usable,
            align,
            free: BTreeMap::new(),
            by_size: BTreeSet::new(),
            live: BTreeMap::new(),
            used: 0,
        };
        a.insert_free(0, usable);
        Ok(a)
    }

    /// Managed size (bytes, a multiple of [`align`](Self::align)).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Alignment of every offset and granularity of every length (bytes).
    pub fn align(&self) -> u64 {
        self.align
    }

    /// The bytes a request of `len` occupies: `len` rounded up to the
    /// alignment, at least one unit; `None` if that overflows `u64`.
    pub fn rounded_len(&self, len: u64) -> Option<u64> {
        let units = len.div_ceil(self.align).max(1);
        units.checked_mul(self.align)
    }

    /// Allocates `len` bytes (rounded up, see [`rounded_len`](Self::rounded_len))
    /// best fit and returns the offset; `None` when no free extent is large
    /// enough (the state is then unchanged).
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let need = self.rounded_len(len)?;
        let &(free_len, offset) = self.by_size.range((need, 0)..).next()?;
        self.remove_free(offset, free_len);
        if free_len > need {
            self.insert_free(offset + need, free_len - need);
        }
        self.live.insert(offset, need);
        self.used += need;
        Some(offset)
    }

    /// Allocates exactly `[offset, offset + rounded_len(len))`, for a
    /// caller that rebuilds a known layout (the disk tier's recovery).
    /// Returns `false`, with the state unchanged, when `offset` is not
    /// aligned or the range is not wholly inside one free extent.
    pub fn reserve(&mut self, offset: u64, len: u64) -> bool {
        let Some(need) = self.rounded_len(len) else { return false };
        if !offset.is_multiple_of(self.align) {
            return false;
        }
        let Some((&free_off, &free_len)) = self.free.range(..=offset).next_back() else { return false };
        let Some(end) = offset.checked_add(need) else { return false };
        if end > free_off + free_len {
            return false;
        }
        self.remove_free(free_off, free_len);
        if offset > free_off {
            self.insert_free(free_off, offset - free_off);
        }
        if free_off + free_len > end {
            self.insert_free(end, free_off + free_len - end);
        }
        self.live.insert(offset, need);
        self.used += need;
        true
    }

    /// Returns the extent at `offset` that was allocated with length `len`
    /// (the same `len` passed to [`alloc`](Self::alloc)), coalescing it with
    /// free neighbours.
    ///
    /// # Errors
    /// [`FreeError`] when no live extent starts at `offset` or its length
    /// differs; the state is then unchanged.
    pub fn free(&mut self, offset: u64, len: u64) -> Result<(), FreeError> {
        let Some(&allocated) = self.live.get(&offset) else {
            return Err(FreeError::NotAllocated { offset, len });
        };
        let rounded = self.rounded_len(len).unwrap_or(u64::MAX);
        if rounded != allocated {
            return Err(FreeError::LengthMismatch { offset, len, rounded, allocated });
        }
        self.live.remove(&offset);
        self.used -= allocated;

        let mut start = offset;
        let mut end = offset + allocated;
        // Coalesce with the free extent ending exactly at `start`.
        if let Some((&prev_off, &prev_len)) = self.free.range(..start).next_back() {
            debug_assert!(prev_off + prev_len <= start, "free extent overlaps a live one");
            if prev_off + prev_len == start {
                self.remove_free(prev_off, prev_len);
                start = prev_off;
            }
        }
        // Coalesce with the free extent starting exactly at `end`.
        if let Some(&next_len) = self.free.get(&end) {
            self.remove_free(end, next_len);
            end += next_len;
        }
        self.insert_free(start, end - start);
        Ok(())
    }

    /// Total free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used
    }

    /// Total allocated bytes (rounded lengths).
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Length of the largest free extent (bytes); 0 when full.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Number of free extents (1 when empty and fully coalesced).
    pub fn free_extents(&self) -> usize {
        self.free.len()
    }

    /// Number of live allocations.
    pub fn live_extents(&self) -> usize {
        self.live.len()
    }

    /// Checks every internal invariant, panicking with a description on the
    /// first violation: free and live extents are aligned, in bounds and
    /// pairwise disjoint, together tile `[0, capacity)`, no two free extents
    /// are adjacent, the size index mirrors the free map, and the byte
    /// counters agree. `O(n)`; for tests and fuzzing.
    pub fn check_invariants(&self) {
        assert_eq!(self.free.len(), self.by_size.len(), "size index out of sync");
        for (&off, &len) in &self.free {
            assert!(self.by_size.contains(&(len, off)), "size index lacks ({len}, {off})");
        }
        let live_sum: u64 = self.live.values().sum();
        assert_eq!(live_sum, self.used, "used counter out of sync");
        let mut all: Vec<(u64, u64, bool)> = self
            .free
            .iter()
            .map(|(&o, &l)| (o, l, true))
            .chain(self.live.iter().map(|(&o, &l)| (o, l, false)))
            .collect();
        all.sort_unstable();
        let mut cursor = 0u64;
        let mut prev_free = false;
        for (off, len, is_free) in all {
            assert!(len > 0 && len % self.align == 0 && off % self.align == 0, "misaligned extent {off}+{len}");
            assert_eq!(off, cursor, "gap or overlap at {off} (expected {cursor})");
            assert!(!(is_free && prev_free), "adjacent free extents at {off}");
            prev_free = is_free;
            cursor = off + len;
        }
        assert_eq!(cursor, self.capacity, "extents do not tile the capacity");
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.free.insert(offset, len);
        self.by_size.insert((len, offset));
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.free.remove(&offset);
        self.by_size.remove(&(len, offset));
    }
}

/// Where the arena's memory came from (given back on drop).
enum Backing {
    /// A heap allocation `arena` sits in.
    Heap { raw: NonNull<u8>, raw_layout: AllocLayout },
    /// A sealed memfd mapped shared at `arena` (see [`Pool::new_shared`]).
    #[cfg(target_os = "linux")]
    Memfd(super::memfd::SharedArena),
}

/// What every handle shares: the arena and its allocator.
struct PoolInner {
    /// Start of the arena; valid for `arena_layout.size()` bytes until drop.
    arena: NonNull<u8>,
    arena_layout: AllocLayout,
    /// The memory `arena` sits in (freed on drop).
    backing: Backing,
    /// Copies of the allocator's constants, readable without the lock.
    capacity: u64,
    align: u64,
    allocator: Mutex<ExtentAllocator>,
    /// Fill every extent with [`POISON_BYTE`] when it is freed (a run-time
    /// switch for simulation and tests: [`Pool::set_poison_freed`]).
    poison_freed: AtomicBool,
    /// Extents poisoned on free so far.
    poisoned: AtomicU64,
}

/// The byte a freed extent is filled with while [`Pool::set_poison_freed`]
/// is on: a read or copy of memory after its free (before or after reuse)
/// yields this pattern, not the block's bytes, so checksums and byte
/// comparisons catch it (C11).
pub const POISON_BYTE: u8 = 0xDB;

// SAFETY: `PoolInner` owns its arena (a plain heap allocation with no thread
// affinity). The allocator state is behind a `Mutex`. The arena bytes are
// only reached through `Extent`/`SealedExtent`, whose ranges are disjoint and
// whose `&mut` access requires unique ownership (module doc, "Soundness"), so
// sharing or sending the owner between threads creates no data race.
unsafe impl Send for PoolInner {}
// SAFETY: see the `Send` impl above; `&PoolInner` only exposes the raw base
// pointer (dereferencing it is the caller's `unsafe` responsibility) and the
// mutex-protected allocator.
unsafe impl Sync for PoolInner {}

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, ExtentAllocator> {
        // Allocator methods validate before they mutate and never panic half
        // way, so a poisoned lock still guards a consistent state.
        self.allocator.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pointer to byte `offset` of the arena.
    fn ptr_at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset <= self.arena_layout.size() as u64);
        // SAFETY: `offset` comes from the allocator, which only hands out
        // offsets below `capacity <= arena_layout.size()`, so the result stays
        // inside (or one past the end of) the arena allocation; the offset fits
        // `usize` because the arena size does.
        unsafe { self.arena.as_ptr().add(offset as usize) }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        match &self.backing {
            // SAFETY: `raw` was returned by `alloc_zeroed(raw_layout)` and is
            // freed exactly once, here, when the last handle (pool or extent)
            // is gone, so no slice into the arena can outlive this call.
            Backing::Heap { raw, raw_layout } => unsafe { alloc::dealloc(raw.as_ptr(), *raw_layout) },
            // Unmapped by its own drop, which runs right after this one.
            #[cfg(target_os = "linux")]
            Backing::Memfd(_) => {}
        }
    }
}

/// The pinned host pool: one arena plus its [`ExtentAllocator`].
///
/// Cheap to clone (an `Arc`), `Send + Sync`. The arena is freed when the last
/// `Pool` clone and every [`Extent`]/[`SealedExtent`] carved from it are gone.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

impl Pool {
    /// Allocates the arena once (zeroed, aligned to
    /// `max(ARENA_ALIGN_BYTES, align)`) and an allocator over it.
    /// `capacity_bytes` is rounded up to a multiple of `align` (that is
    /// [`capacity`](Self::capacity)); the arena itself is rounded up to a
    /// multiple of its alignment (that is [`arena_len`](Self::arena_len)), so
    /// it can be registered in whole pages.
    ///
    /// # Errors
    /// - [`PoolError::BadConfig`]: `capacity_bytes == 0`, `align` not a power
    ///   of two, or the rounded size overflows the address space.
    /// - [`PoolError::ArenaAlloc`]: the system allocator returned null.
    pub fn new(capacity_bytes: u64, align: u64) -> Result<Pool, PoolError> {
        Self::build(capacity_bytes, align, false)
    }

    /// [`Pool::new`] with the arena in a sealed memfd that the owner can
    /// hand to a same-host reader ([`Pool::shared_fd`]; the `shm`
    /// transport): `memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)`,
    /// `ftruncate` to [`arena_len`](Self::arena_len), mapped `MAP_SHARED`
    /// read-write at the same alignment as a heap arena, then sealed
    /// against shrinking and growing (so no reader's mapping can ever fault
    /// past the end of the file: no `SIGBUS`), against any *later* writable
    /// mapping or `write` (`F_SEAL_FUTURE_WRITE`, where the kernel has it:
    /// only this mapping can write the pool, a reader that reopens the fd
    /// read-write still cannot map it writable), and against new seals.
    /// Zeroed like a heap arena (a fresh file reads as zeros).
    ///
    /// Where memfd is unavailable (not Linux, the simulator, a kernel or
    /// sandbox that refuses `memfd_create` or sealing) it falls back to the
    /// heap arena of [`Pool::new`], and [`Pool::shared_fd`] is `None`.
    ///
    /// # Errors
    /// As [`Pool::new`]; a memfd failure is not an error (the fallback).
    pub fn new_shared(capacity_bytes: u64, align: u64) -> Result<Pool, PoolError> {
        Self::build(capacity_bytes, align, true)
    }

    /// The sealed memfd the arena lives in (see [`Pool::new_shared`]), for
    /// sending to a same-host reader; `None` for a heap arena. Offset `o`
    /// of the file is byte `o` of the arena; its size is
    /// [`arena_len`](Self::arena_len).
    #[cfg(unix)]
    pub fn shared_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.inner.backing {
            Backing::Heap { .. } => None,
            #[cfg(target_os = "linux")]
            Backing::Memfd(m) => Some(m.fd()),
        }
    }

    fn build(capacity_bytes: u64, align: u64, shared: bool) -> Result<Pool, PoolError> {
        let bad = |reason| PoolError::BadConfig { capacity_bytes, align, reason };
        if capacity_bytes == 0 {
            return Err(bad("capacity must be non-zero"));
        }
        if !align.is_power_of_two() {
            return Err(bad("align must be a power of two"));
        }
        let capacity = capacity_bytes.checked_next_multiple_of(align).ok_or(bad("capacity overflows u64"))?;
        let arena_align = align.max(ARENA_ALIGN_BYTES);
        let arena_bytes = capacity.checked_next_multiple_of(arena_align).ok_or(bad("capacity overflows u64"))?;
        let size = usize::try_from(arena_bytes).map_err(|_| bad("capacity exceeds the address space"))?;
        let align_usize = usize::try_from(arena_align).map_err(|_| bad("align exceeds the address space"))?;
        let arena_layout =
            AllocLayout::from_size_align(size, align_usize).map_err(|_| bad("capacity or align too large"))?;
        let allocator = ExtentAllocator::new(capacity, align)?;
        let make = |arena: NonNull<u8>, backing: Backing| Pool {
            inner: Arc::new(PoolInner {
                arena,
                arena_layout,
                backing,
                capacity,
                align,
                allocator: Mutex::new(allocator.clone()),
                poison_freed: AtomicBool::new(false),
                poisoned: AtomicU64::new(0),
            }),
        };
        #[cfg(target_os = "linux")]
        if shared {
            match super::memfd::SharedArena::create(size, align_usize) {
                Ok(m) => return Ok(make(m.base(), Backing::Memfd(m))),
                Err(e) => tracing::warn!(error = %e, "shared pool unavailable (memfd); using a private arena"),
            }
        }
        let _ = shared;
        // Over-allocate with the allocator's natural alignment and align by
        // hand: `alloc_zeroed` with a large alignment goes through
        // `posix_memalign` + memset, touching (and committing) every page of a
        // multi-GiB arena up front; with a small alignment it is `calloc`,
        // whose large blocks are fresh zero pages mapped on first touch.
        let raw_size = size.checked_add(align_usize).ok_or(bad("capacity exceeds the address space"))?;
        let raw_layout = AllocLayout::from_size_align(raw_size, 16).map_err(|_| bad("capacity too large"))?;
        // SAFETY: `raw_layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(raw_layout) };
        let raw = NonNull::new(raw).ok_or(PoolError::ArenaAlloc { bytes: arena_bytes })?;
        let pad = raw.as_ptr().align_offset(align_usize);
        if pad >= align_usize {
            // SAFETY: `raw` was just allocated with `raw_layout`.
            unsafe { alloc::dealloc(raw.as_ptr(), raw_layout) };
            return Err(PoolError::ArenaAlloc { bytes: arena_bytes });
        }
        // SAFETY: `pad < align_usize`, so `raw + pad .. raw + pad + size` lies
        // inside the `size + align_usize` bytes allocated.
        let arena = unsafe { NonNull::new_unchecked(raw.as_ptr().add(pad)) };
        Ok(make(arena, Backing::Heap { raw, raw_layout }))
    }

    /// Turns poisoning of freed extents on or off (off by default). On, every
    /// extent is filled with [`POISON_BYTE`] as it is freed, so a read of
    /// freed (or freed and reused) memory cannot return a block's old bytes:
    /// the simulator turns it on for every node (C11). Costs one memset per
    /// free; production leaves it off.
    pub fn set_poison_freed(&self, on: bool) {
        self.inner.poison_freed.store(on, Ordering::Relaxed);
    }

    /// Extents poisoned on free so far (see [`set_poison_freed`](Self::set_poison_freed)).
    pub fn poisoned_frees(&self) -> u64 {
        self.inner.poisoned.load(Ordering::Relaxed)
    }

    /// Allocates a writable extent of `len` bytes (occupying `len` rounded up
    /// to [`align`](Self::align), at least one unit). Its bytes hold whatever
    /// the previous holder left (zero on first use).
    ///
    /// # Errors
    /// [`PoolError::Exhausted`] when no free extent is large enough; the pool
    /// is unchanged.
    pub fn alloc(&self, len: u64) -> Result<Extent, PoolError> {
        let mut a = self.inner.lock();
        match a.alloc(len) {
            Some(offset) => {
                drop(a);
                Ok(Extent { slot: Slot { pool: Arc::clone(&self.inner), offset, len } })
            }
            None => Err(PoolError::Exhausted { requested: len, free: a.free_bytes(), largest_free: a.largest_free() }),
        }
    }

    /// Bytes the allocator manages (the requested capacity rounded up to the
    /// alignment).
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Alignment of every extent's offset and granularity of its size (bytes).
    pub fn align(&self) -> u64 {
        self.inner.align
    }

    /// Bytes held by live extents (rounded lengths).
    pub fn used_bytes(&self) -> u64 {
        self.inner.lock().used_bytes()
    }

    /// Bytes not held by any extent (`capacity - used_bytes`).
    pub fn free_bytes(&self) -> u64 {
        self.inner.lock().free_bytes()
    }

    /// Length of the largest free extent (bytes): the largest `alloc` that can
    /// succeed right now.
    pub fn largest_free(&self) -> u64 {
        self.inner.lock().largest_free()
    }

    /// Number of live extents (sealed extents count once however many clones
    /// they have).
    pub fn live_extents(&self) -> usize {
        self.inner.lock().live_extents()
    }

    /// Start of the arena, for registering it once with a GPU or NIC. Valid
    /// for [`arena_len`](Self::arena_len) bytes while this pool or any extent
    /// of it is alive. Writing through it is `unsafe` and only sound inside an
    /// [`Extent`] the caller holds exclusively (module doc, "Soundness").
    pub fn base_ptr(&self) -> *mut u8 {
        self.inner.arena.as_ptr()
    }

    /// Length of the arena (bytes): [`capacity`](Self::capacity) rounded up to
    /// the arena alignment. The region to register is
    /// `base_ptr()..base_ptr() + arena_len()`.
    pub fn arena_len(&self) -> u64 {
        self.inner.arena_layout.size() as u64
    }

    /// Commits every page of the arena now, so that no save or fetch pays a
    /// first-touch page fault on the critical path. The arena comes from
    /// `calloc`, whose large blocks are fresh zero pages the kernel maps on
    /// first write: filling a never-touched 1 GiB pool costs 262,144 page
    /// faults (4 KiB pages), which the first saves and fetches into each
    /// page would otherwise pay inside their copy and read times. On Linux
    /// the arena is first advised to use transparent huge pages
    /// (`madvise(MADV_HUGEPAGE)`, honoured when THP is in `madvise` or
    /// `always` mode): one fault per 2 MiB, and fewer TLB misses for every
    /// later copy. One byte of every 4 KiB page is written with zero, on up
    /// to [`crate::rt::cpu_parallelism`] threads (at most 16); returns the
    /// bytes covered. It blocks its caller (an engine's start) meanwhile.
    /// (The CUDA backend's `cuMemHostRegister` commits the pages too.)
    ///
    /// # Errors
    /// [`PoolError::InUse`] when any extent is live: the pool is untouched.
    /// Call it right after [`Pool::new`].
    pub fn prefault(&self) -> Result<u64, PoolError> {
        // Held while touching: no extent can be handed out (and written)
        // until every page has been written with its zero.
        let a = self.inner.lock();
        if a.live_extents() > 0 {
            return Err(PoolError::InUse { live_extents: a.live_extents() });
        }
        let (base, len) = (self.inner.arena.as_ptr() as usize, self.inner.arena_layout.size());
        #[cfg(target_os = "linux")]
        // SAFETY: advice only, on the arena's own range; it changes no byte.
        unsafe {
            libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        const PAGE: usize = 4096;
        let parts = crate::rt::cpu_parallelism().clamp(1, 16);
        let share = len.div_ceil(parts).next_multiple_of(PAGE);
        let ranges: Vec<(usize, usize)> =
            (0..parts).map(|i| (i * share, ((i + 1) * share).min(len))).filter(|r| r.0 < r.1).collect();
        crate::rt::map_parts(ranges, |(from, to)| {
            for at in (from..to).step_by(PAGE) {
                // SAFETY: inside the arena; no extent is live and none can be
                // allocated while the allocator lock is held, so no one else
                // reads or writes these bytes, and bytes outside every extent
                // carry nothing (an extent's first holder sees zero only on
                // a fresh pool, where this writes the zero already there).
                unsafe { ((base + at) as *mut u8).write_volatile(0) };
            }
        });
        drop(a);
        Ok(len as u64)
    }

    /// Runs [`ExtentAllocator::check_invariants`] on the allocator (tests).
    pub fn check_invariants(&self) {
        self.inner.lock().check_invariants();
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.inner.lock();
        f.debug_struct("Pool")
            .field("base", &self.inner.arena)
            .field("capacity", &a.capacity())
            .field("used", &a.used_bytes())
            .field("largest_free", &a.largest_free())
            .finish()
    }
}

/// One allocated range of the arena; gives it back on drop.
struct Slot {
    pool: Arc<PoolInner>,
    offset: u64,
    /// Requested length (bytes); the allocator rounds it the same way again.
    len: u64,
}

impl Slot {
    fn ptr(&self) -> *mut u8 {
        self.pool.ptr_at(self.offset)
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `[offset, offset + len)` lies inside the arena (allocator
        // bounds), is initialised (zeroed arena), and is disjoint from every
        // other live slot; `&mut` to it exists only through `&mut Extent`,
        // which cannot coexist with this `&self` borrow. The arena lives as
        // long as `self.pool`, hence as long as the returned borrow. `len`
        // fits `usize` because it is at most the arena size.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len as usize) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.pool.poison_freed.load(Ordering::Relaxed) {
            // SAFETY: this slot is being dropped, so no `Extent` or
            // `SealedExtent` borrows its range any more (they own the slot),
            // and the range is still allocated (freed just below), hence
            // disjoint from every other live slot; it lies inside the arena.
            unsafe { std::ptr::write_bytes(self.ptr(), POISON_BYTE, self.len as usize) };
            self.pool.poisoned.fetch_add(1, Ordering::Relaxed);
        }
        let result = self.pool.lock().free(self.offset, self.len);
        // Unreachable through the safe API: a slot is created once per
        // allocation and dropped once. Panic (outside the lock) rather than
        // continue with a corrupted allocator.
        if let Err(e) = result {
            panic!("pool invariant broken: {e}");
        }
    }
}

/// A uniquely owned, writable allocation in the pool. Dropping it returns the
/// memory; [`seal`](Self::seal) turns it into a shareable read-only
/// [`SealedExtent`].
pub struct Extent {
    slot: Slot,
}

impl Extent {
    /// Offset of the first byte inside the arena (a multiple of the pool's
    /// alignment). With a transport that registers the arena, this is the
    /// offset a peer reads at.
    pub fn offset(&self) -> u64 {
        self.slot.offset
    }

    /// Requested length in bytes (not the rounded length the allocator holds).
    pub fn len(&self) -> u64 {
        self.slot.len
    }

    /// Whether the extent is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.slot.len == 0
    }

    /// The extent's bytes, `len()` long.
    pub fn as_slice(&self) -> &[u8] {
        self.slot.as_slice()
    }

    /// The extent's bytes for writing, `len()` long.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `Slot::as_slice`; in addition `&mut self` proves this
        // is the only live borrow of this unique (non-Clone) extent, and no
        // other extent overlaps its range, so the `&mut` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.slot.ptr(), self.slot.len as usize) }
    }

    /// Pointer to the first byte, for a DMA engine to read.
    pub fn as_ptr(&self) -> *const u8 {
        self.slot.ptr()
    }

    /// Pointer to the first byte, for a DMA engine (GPU copy, RDMA READ) to
    /// write `len()` bytes. Valid while this extent lives; the device
    /// operation must complete before the extent is dropped or sealed.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.slot.ptr()
    }

    /// Freezes the contents: the returned handle is shareable and read-only.
    pub fn seal(self) -> SealedExtent {
        SealedExtent { slot: Arc::new(self.slot) }
    }
}

impl fmt::Debug for Extent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extent").field("offset", &self.slot.offset).field("len", &self.slot.len).finish()
    }
}

/// A sealed, read-only allocation. `Clone` is an `Arc` clone: every holder
/// (cache, lease, transfer lock, in-flight read) keeps one, and the memory
/// returns to the pool only when the last clone drops (contract C11).
#[derive(Clone)]
pub struct SealedExtent {
    slot: Arc<Slot>,
}

impl SealedExtent {
    /// Offset of the first byte inside the arena (bytes).
    pub fn offset(&self) -> u64 {
        self.slot.offset
    }

    /// Requested length in bytes.
    pub fn len(&self) -> u64 {
        self.slot.len
    }

    /// Whether the extent is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.slot.len == 0
    }

    /// The sealed bytes, `len()` long.
    pub fn as_slice(&self) -> &[u8] {
        self.slot.as_slice()
    }

    /// Pointer to the first byte, for a DMA engine to *read* (never write).
    pub fn as_ptr(&self) -> *const u8 {
        self.slot.ptr()
    }

    /// Number of live clones of this extent (the `Arc` strong count).
    /// `holders() > 1` means someone besides the caller — a lease, a transfer
    /// lock, an in-flight operation — pins it; eviction skips such blocks. A
    /// racy snapshot: another thread may clone or drop concurrently.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.slot)
    }
}

impl fmt::Debug for SealedExtent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedExtent")
            .field("offset", &self.slot.offset)
            .field("len", &self.slot.len)
            .field("holders", &self.holders())
            .finish()
    }
}

// Compile-time check of the thread-safety promises above.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Pool>();
    assert_send_sync::<Extent>();
    assert_send_sync::<SealedExtent>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `reserve` takes exactly the range asked for, out of one free
    /// extent, and refuses a range that overlaps a live one or is
    /// misaligned; what it took frees like an allocation.
    #[test]
    fn reserve_takes_exact_ranges() {
        let mut a = ExtentAllocator::new(64 * 4096, 4096).unwrap();
        assert!(a.reserve(8 * 4096, 3 * 4096));
        assert!(a.reserve(0, 4096));
        assert!(!a.reserve(9 * 4096, 4096), "inside a live range");
        assert!(!a.reserve(7 * 4096, 2 * 4096), "overlaps the start of a live range");
        assert!(!a.reserve(100, 4096), "misaligned");
        assert!(!a.reserve(63 * 4096, 2 * 4096), "past the end");
        a.check_invariants();
        assert_eq!(a.used_bytes(), 4 * 4096);
        assert_eq!(a.alloc(4096), Some(4096), "best fit before the reserved range");
        a.free(8 * 4096, 3 * 4096).unwrap();
        a.free(0, 4096).unwrap();
        a.free(4096, 4096).unwrap();
        a.check_invariants();
        assert_eq!(a.free_extents(), 1);
    }

    #[test]
    fn prefault_commits_a_fresh_pool_and_refuses_one_in_use() {
        let pool = Pool::new(8 << 20, 256).unwrap();
        assert_eq!(pool.prefault().unwrap(), pool.arena_len());
        // Every byte still reads zero, and the pool still allocates.
        let mut e = pool.alloc(4096).unwrap();
        assert!(e.as_slice().iter().all(|&b| b == 0));
        e.as_mut_slice().fill(0xAB);
        // With an extent live, prefault refuses and writes nothing.
        assert_eq!(pool.prefault(), Err(PoolError::InUse { live_extents: 1 }));
        assert!(e.as_slice().iter().all(|&b| b == 0xAB));
        drop(e);
        assert_eq!(pool.prefault().unwrap(), pool.arena_len());
    }

    /// A shared pool behaves like a private one (zeroed, aligned, sealed
    /// memfd of `arena_len` bytes whose bytes are the arena's); a pool made
    /// with `new` has no fd.
    #[cfg(target_os = "linux")]
    #[test]
    fn shared_pool_is_a_sealed_memfd_of_the_arena() {
        use std::os::fd::AsRawFd;
        assert!(Pool::new(1 << 20, 256).unwrap().shared_fd().is_none());
        for align in [256, 4096, 1 << 16] {
            let pool = Pool::new_shared((1 << 20) + 5, align).unwrap();
            let fd = pool.shared_fd().expect("memfd on Linux");
            assert_eq!(pool.base_ptr() as u64 % align.max(ARENA_ALIGN_BYTES), 0);
            // SAFETY: fstat/fcntl on a live descriptor.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
            assert_eq!(st.st_size as u64, pool.arena_len());
            let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
            assert_ne!(seals & libc::F_SEAL_SHRINK, 0);
            pool.prefault().unwrap();
            let mut e = pool.alloc(4096).unwrap();
            assert!(e.as_slice().iter().all(|&b| b == 0));
            e.as_mut_slice().fill(0x5C);
            // The file holds the arena's bytes at the extent's offset.
            let mut back = [0u8; 16];
            let n = unsafe { libc::pread(fd.as_raw_fd(), back.as_mut_ptr().cast(), 16, e.offset() as libc::off_t) };
            assert_eq!(n, 16);
            assert_eq!(back, [0x5C; 16]);
        }
    }

    const A: u64 = 256;

    #[test]
    fn freed_extents_are_poisoned_only_when_switched_on() {
        let pool = Pool::new(A, A).unwrap();
        let mut e = pool.alloc(A).unwrap();
        e.as_mut_slice().fill(7);
        drop(e);
        assert!(pool.alloc(A).unwrap().as_slice().iter().all(|&b| b == 7), "off: bytes left as they were");
        pool.set_poison_freed(true);
        let mut e = pool.alloc(A).unwrap();
        e.as_mut_slice().fill(7);
        let sealed = e.seal();
        let reader = sealed.clone();
        drop(sealed);
        assert_eq!(pool.poisoned_frees(), 0, "a holder left: not freed, not poisoned");
        drop(reader);
        assert_eq!(pool.poisoned_frees(), 1);
        assert!(pool.alloc(A).unwrap().as_slice().iter().all(|&b| b == POISON_BYTE), "on: freed bytes poisoned");
    }

    #[test]
    fn alloc_free_coalesce() {
        let mut a = ExtentAllocator::new(4 * A, A).unwrap();
        let x = a.alloc(A).unwrap();
        let y = a.alloc(1).unwrap(); // rounds to one unit
        let z = a.alloc(A + 1).unwrap(); // rounds to two units
        assert_eq!((x, y, z), (0, A, 2 * A));
        assert_eq!(a.used_bytes(), 4 * A);
        assert_eq!(a.free_bytes(), 0);
        assert_eq!(a.largest_free(), 0);
        assert_eq!(a.alloc(1), None);
        a.check_invariants();

        a.free(y, 1).unwrap();
        assert_eq!(a.free_extents(), 1);
        a.free(x, A).unwrap(); // coalesces with y's hole
        assert_eq!(a.free_extents(), 1);
        assert_eq!(a.largest_free(), 2 * A);
        a.free(z, A + 1).unwrap(); // coalesces into one extent
        assert_eq!(a.free_extents(), 1);
        assert_eq!(a.largest_free(), 4 * A);
        assert_eq!(a.used_bytes(), 0);
        a.check_invariants();
    }

    #[test]
    fn best_fit_prefers_smallest_then_lowest() {
        let mut a = ExtentAllocator::new(16 * A, A).unwrap();
        let offs: Vec<u64> = (0..8).map(|_| a.alloc(2 * A).unwrap()).collect();
        // Free holes of 2 units at 0, 4 (coalesce 4..8 with 6 → 4 units at 4*A..),
        // and 2 units at 12*A.
        a.free(offs[0], 2 * A).unwrap();
        a.free(offs[2], 2 * A).unwrap();
        a.free(offs[3], 2 * A).unwrap();
        a.free(offs[6], 2 * A).unwrap();
        a.check_invariants();
        // One unit: smallest holes are the 2-unit ones at 0 and 12*A → lowest.
        assert_eq!(a.alloc(A), Some(0));
        // Three units: only the 4-unit hole fits.
        assert_eq!(a.alloc(3 * A), Some(4 * A));
        // Two units: the 2-unit hole at 12*A is the best fit.
        assert_eq!(a.alloc(2 * A), Some(12 * A));
        a.check_invariants();
    }

    #[test]
    fn double_free_and_foreign_free_are_detected() {
        let mut a = ExtentAllocator::new(8 * A, A).unwrap();
        let x = a.alloc(2 * A).unwrap();
        assert_eq!(a.free(x + A, A), Err(FreeError::NotAllocated { offset: x + A, len: A }));
        assert!(matches!(a.free(x, A), Err(FreeError::LengthMismatch { allocated, .. }) if allocated == 2 * A));
        assert!(matches!(a.free(5 * A, A), Err(FreeError::NotAllocated { .. })));
        a.free(x, 2 * A).unwrap();
        assert!(matches!(a.free(x, 2 * A), Err(FreeError::NotAllocated { .. })));
        a.check_invariants();
        assert_eq!(a.free_bytes(), 8 * A);
    }

    #[test]
    fn allocator_config_errors() {
        assert!(matches!(ExtentAllocator::new(1024, 3), Err(PoolError::BadConfig { .. })));
        assert!(matches!(ExtentAllocator::new(1024, 0), Err(PoolError::BadConfig { .. })));
        assert!(matches!(ExtentAllocator::new(100, 256), Err(PoolError::BadConfig { .. })));
        let a = ExtentAllocator::new(1000, 256).unwrap();
        assert_eq!(a.capacity(), 768);
        let mut a = ExtentAllocator::new(1024, 256).unwrap();
        assert_eq!(a.alloc(u64::MAX), None);
        assert_eq!(a.alloc(1025), None);
    }

    #[test]
    fn pool_config_errors() {
        assert!(matches!(Pool::new(0, 256), Err(PoolError::BadConfig { .. })));
        assert!(matches!(Pool::new(4096, 0), Err(PoolError::BadConfig { .. })));
        assert!(matches!(Pool::new(4096, 384), Err(PoolError::BadConfig { .. })));
        assert!(matches!(Pool::new(u64::MAX, 256), Err(PoolError::BadConfig { .. })));
        let p = Pool::new(1000, 256).unwrap();
        assert_eq!(p.capacity(), 1024);
        assert_eq!(p.arena_len(), 4096);
        assert_eq!(p.base_ptr() as usize % 4096, 0);
        let p = Pool::new(8192, 8192).unwrap();
        assert_eq!(p.base_ptr() as usize % 8192, 0);
    }

    #[test]
    fn arena_allocation_failure_is_an_error() {
        // 4 EiB: representable as a `Layout`, larger than any address space.
        let bytes = 1u64 << 62;
        assert_eq!(Pool::new(bytes, 256).unwrap_err(), PoolError::ArenaAlloc { bytes });
    }

    #[test]
    fn exhaustion_is_an_error_with_numbers() {
        let pool = Pool::new(8 * A, A).unwrap();
        let _a = pool.alloc(3 * A).unwrap();
        let b = pool.alloc(2 * A).unwrap();
        let _c = pool.alloc(3 * A).unwrap();
        drop(b); // 2 units free, in one hole
        let e = pool.alloc(2 * A + 1).unwrap_err();
        assert_eq!(e, PoolError::Exhausted { requested: 2 * A + 1, free: 2 * A, largest_free: 2 * A });
        assert_eq!(pool.used_bytes(), 6 * A);
        let _d = pool.alloc(2 * A).unwrap();
        let e = pool.alloc(0).unwrap_err();
        assert_eq!(e, PoolError::Exhausted { requested: 0, free: 0, largest_free: 0 });
        pool.check_invariants();
    }

    #[test]
    fn fragmentation_then_coalescing_back_to_one_extent() {
        let pool = Pool::new(64 * A, A).unwrap();
        let mut exts: Vec<Option<Extent>> = (0..64).map(|_| Some(pool.alloc(A).unwrap())).collect();
        assert_eq!(pool.free_bytes(), 0);
        // Free every other unit: 32 units free, but no 2-unit run.
        for e in exts.iter_mut().step_by(2) {
            *e = None;
        }
        assert_eq!(pool.free_bytes(), 32 * A);
        assert_eq!(pool.largest_free(), A);
        assert!(matches!(pool.alloc(2 * A), Err(PoolError::Exhausted { free, largest_free, .. })
            if free == 32 * A && largest_free == A));
        pool.check_invariants();
        // Free the rest in a scrambled order: everything coalesces.
        for i in (1..64).step_by(2).rev() {
            exts[i] = None;
        }
        pool.check_invariants();
        assert_eq!(pool.free_bytes(), 64 * A);
        assert_eq!(pool.largest_free(), 64 * A);
        assert_eq!(pool.live_extents(), 0);
        let big = pool.alloc(64 * A).unwrap();
        assert_eq!(big.offset(), 0);
    }

    #[test]
    fn memory_returns_only_when_last_sealed_clone_drops() {
        let pool = Pool::new(4 * A, A).unwrap();
        let sealed = pool.alloc(4 * A).unwrap().seal();
        assert_eq!(sealed.holders(), 1);
        let lease = sealed.clone();
        let lock = sealed.clone();
        assert_eq!(sealed.holders(), 3);
        assert_eq!(lease.holders(), 3);
        drop(sealed); // "eviction" drops the cache's clone
        assert_eq!(lease.holders(), 2);
        assert_eq!(pool.free_bytes(), 0);
        assert!(matches!(pool.alloc(1), Err(PoolError::Exhausted { .. })));
        drop(lease);
        assert_eq!(lock.holders(), 1);
        assert_eq!(pool.free_bytes(), 0);
        drop(lock);
        assert_eq!(pool.free_bytes(), 4 * A);
        assert_eq!(pool.live_extents(), 0);
    }

    #[test]
    fn bytes_written_are_read_back_after_seal() {
        let pool = Pool::new(16 * A, A).unwrap();
        let mut e = pool.alloc(1000).unwrap();
        assert_eq!(e.len(), 1000);
        assert!(e.as_slice().iter().all(|&b| b == 0), "arena starts zeroed");
        for (i, b) in e.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // SAFETY: the pointer is valid for `len()` bytes and `e` is held
        // exclusively here.
        unsafe { e.as_mut_ptr().add(999).write(0xAB) };
        let off = e.offset();
        let s = e.seal();
        assert_eq!(s.offset(), off);
        assert_eq!(s.len(), 1000);
        assert_eq!(s.as_slice().len(), 1000);
        assert!(s.as_slice()[..999].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        assert_eq!(s.as_slice()[999], 0xAB);
        assert_eq!(s.as_ptr() as usize, pool.base_ptr() as usize + off as usize);
    }

    #[test]
    fn extents_outlive_the_pool_handle() {
        let pool = Pool::new(4 * A, A).unwrap();
        let mut e = pool.alloc(A).unwrap();
        drop(pool);
        e.as_mut_slice().fill(7);
        let s = e.seal();
        let s2 = s.clone();
        drop(s);
        assert!(s2.as_slice().iter().all(|&b| b == 7));
    }

    #[test]
    fn zero_length_extents_are_distinct() {
        let pool = Pool::new(4 * A, A).unwrap();
        let a = pool.alloc(0).unwrap();
        let b = pool.alloc(0).unwrap();
        assert!(a.is_empty() && a.as_slice().is_empty());
        assert_ne!(a.offset(), b.offset());
        assert_eq!(pool.used_bytes(), 2 * A);
    }

    #[test]
    fn threads_write_disjoint_extents_concurrently() {
        const THREADS: usize = 4;
        const PER_THREAD: usize = 32;
        let pool = Pool::new((THREADS * PER_THREAD) as u64 * 2 * A, A).unwrap();
        let sealed: Vec<Vec<SealedExtent>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let pool = pool.clone();
                    s.spawn(move || {
                        let mut out = Vec::new();
                        for i in 0..PER_THREAD {
                            let mut e = pool.alloc(A + (i as u64 % 3) * 100).unwrap();
                            let tag = (t * PER_THREAD + i) as u8;
                            e.as_mut_slice().fill(tag);
                            out.push(e.seal());
                        }
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (t, v) in sealed.iter().enumerate() {
            for (i, s) in v.iter().enumerate() {
                let tag = (t * PER_THREAD + i) as u8;
                assert!(s.as_slice().iter().all(|&b| b == tag), "extent {t}/{i} was overwritten");
            }
        }
        pool.check_invariants();
        // Readers on several threads, then everything goes back.
        std::thread::scope(|s| {
            for v in &sealed {
                let v = v.clone();
                s.spawn(move || v.iter().map(|e| e.as_slice().iter().map(|&b| b as u64).sum::<u64>()).sum::<u64>());
            }
        });
        drop(sealed);
        assert_eq!(pool.used_bytes(), 0);
        assert_eq!(pool.largest_free(), pool.capacity());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        Seal(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                3 => (0u64..5 * A).prop_map(Op::Alloc),
                2 => any::<usize>().prop_map(Op::Free),
                1 => any::<usize>().prop_map(Op::Seal),
            ],
            0..200,
        )
    }

    proptest! {
        /// Random alloc/free sequences on the pure allocator: live extents
        /// never overlap, used + free == capacity, free space stays coalesced.
        #[test]
        fn allocator_disjointness(ops in ops()) {
            let mut a = ExtentAllocator::new(32 * A, A).unwrap();
            let mut live: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let before = (a.largest_free(), a.free_bytes());
                        match a.alloc(len) {
                            Some(off) => live.push((off, len)),
                            None => {
                                prop_assert!(a.rounded_len(len).unwrap() > before.0);
                                prop_assert_eq!((a.largest_free(), a.free_bytes()), before);
                            }
                        }
                    }
                    Op::Free(i) | Op::Seal(i) if !live.is_empty() => {
                        let (off, len) = live.swap_remove(i % live.len());
                        prop_assert_eq!(a.free(off, len), Ok(()));
                    }
                    _ => {}
                }
                prop_assert_eq!(a.used_bytes() + a.free_bytes(), a.capacity());
                let mut spans: Vec<(u64, u64)> =
                    live.iter().map(|&(o, l)| (o, o + a.rounded_len(l).unwrap())).collect();
                spans.sort_unstable();
                for w in spans.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                prop_assert!(spans.last().is_none_or(|s| s.1 <= a.capacity()));
                a.check_invariants();
            }
        }

        /// The same on a real pool: each live extent (sealed or not) keeps the
        /// pattern written into it, so no two extents share a byte.
        #[test]
        fn pool_disjointness(ops in ops()) {
            let pool = Pool::new(32 * A, A).unwrap();
            enum Live { W(Extent), S(SealedExtent) }
            let mut live: Vec<(Live, u8)> = Vec::new();
            let mut tag = 0u8;
            for op in ops {
                match op {
                    Op::Alloc(len) => match pool.alloc(len) {
                        Ok(mut e) => {
                            tag = tag.wrapping_add(1);
                            e.as_mut_slice().fill(tag);
                            live.push((Live::W(e), tag));
                        }
                        Err(PoolError::Exhausted { requested, free, largest_free }) => {
                            prop_assert_eq!(requested, len);
                            prop_assert_eq!(free, pool.free_bytes());
                            prop_assert!(largest_free < len.div_ceil(A).max(1) * A);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    },
                    Op::Free(i) if !live.is_empty() => {
                        let n = live.len();
                        live.swap_remove(i % n);
                    }
                    Op::Seal(i) if !live.is_empty() => {
                        let n = live.len();
                        let (l, t) = live.swap_remove(i % n);
                        let s = match l { Live::W(e) => e.seal(), Live::S(s) => s };
                        live.push((Live::S(s.clone()), t));
                        live.push((Live::S(s), t)); // a second holder
                    }
                    _ => {}
                }
                prop_assert_eq!(pool.used_bytes() + pool.free_bytes(), pool.capacity());
                for (l, t) in &live {
                    let bytes = match l { Live::W(e) => e.as_slice(), Live::S(s) => s.as_slice() };
                    prop_assert!(bytes.iter().all(|b| b == t));
                }
                pool.check_invariants();
            }
            drop(live);
            prop_assert_eq!(pool.free_bytes(), pool.capacity());
        }
    }
}
