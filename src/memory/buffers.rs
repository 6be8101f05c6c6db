//! The registry of device buffers a GPU backend copies between (contract
//! C15, embedder memory).
//!
//! A *device buffer* is a byte range `[addr, addr + len)` of memory the
//! copies reach: GPU memory on the `cuda` backend, host memory on the `host`
//! backend. The embedder (an inference engine) usually owns it — its paged
//! K/V tensors — and registers it; a backend may also allocate a buffer
//! itself (tests, benchmarks), which is the same entry with an owner flag.
//! Layouts name buffers by [`DeviceBufferId`].
//!
//! What the table guarantees, for every backend alike:
//! - ids are never reused within a backend's life, so a stale id (from a
//!   layout or a batch built before an unregister) names nothing instead of
//!   a newer buffer;
//! - live ranges never overlap, are never empty and start at a non-null
//!   address aligned to [`crate::limits::DEVICE_BUFFER_ALIGN`];
//! - a buffer that a submitted batch touches is *busy* from the batch's
//!   validation ([`BufferTable::pin_batch`]) until its completion drops the
//!   returned [`BatchPin`]; [`BufferTable::unregister`] refuses a busy
//!   buffer, so an unregister can never race a copy into freed memory.
//!
//! Pure: no runtime, no driver calls (the `cuda` backend checks the driver's
//! pointer attributes before it registers).

use std::sync::{Arc, Mutex};

use crate::limits::{DEVICE_BUFFER_ALIGN, DEVICE_BUFFERS_MAX};

/// A device buffer (one registered range of device memory) that layouts
/// point into. Issued by a backend's buffer table; never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceBufferId(pub u32);

impl std::fmt::Display for DeviceBufferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "buffer {}", self.0)
    }
}

/// Why a registration or unregistration was refused. Nothing changes on
/// error. Addresses in messages are hexadecimal, lengths in bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    /// The address is 0.
    #[error("null buffer address")]
    Null,
    /// The length is 0.
    #[error("zero-length buffer at {addr:#x}")]
    Empty {
        /// Address given.
        addr: u64,
    },
    /// The address is not a multiple of [`DEVICE_BUFFER_ALIGN`].
    #[error("buffer address {addr:#x} is not aligned to {align} bytes")]
    Unaligned {
        /// Address given.
        addr: u64,
        /// Required alignment (bytes).
        align: u64,
    },
    /// `addr + len` overflows the address space.
    #[error("buffer [{addr:#x}, +{len}) wraps the address space")]
    Wraps {
        /// Address given.
        addr: u64,
        /// Length given.
        len: u64,
    },
    /// The range overlaps a live registration.
    #[error("buffer [{addr:#x}, +{len}) overlaps {other} at [{other_addr:#x}, +{other_len})")]
    Overlap {
        /// Address given.
        addr: u64,
        /// Length given.
        len: u64,
        /// The live buffer it overlaps.
        other: DeviceBufferId,
        /// That buffer's address.
        other_addr: u64,
        /// That buffer's length.
        other_len: u64,
    },
    /// [`DEVICE_BUFFERS_MAX`] buffers are live, or every id was issued.
    #[error("too many device buffers ({live} live, at most {max})")]
    TooMany {
        /// Live buffers.
        live: usize,
        /// The limit.
        max: usize,
    },
    /// No live buffer has this id (never issued, or unregistered).
    #[error("unknown device {0}")]
    Unknown(DeviceBufferId),
    /// An in-flight copy batch touches the buffer (C15): retry once it
    /// completed.
    #[error("device {id} is in use by {batches} in-flight copy batch(es)")]
    Busy {
        /// The buffer.
        id: DeviceBufferId,
        /// Batches touching it now.
        batches: u32,
    },
}

impl BufferError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            BufferError::Null => "gpu_buffer_null",
            BufferError::Empty { .. } => "gpu_buffer_empty",
            BufferError::Unaligned { .. } => "gpu_buffer_unaligned",
            BufferError::Wraps { .. } => "gpu_buffer_wraps",
            BufferError::Overlap { .. } => "gpu_buffer_overlap",
            BufferError::TooMany { .. } => "gpu_buffer_too_many",
            BufferError::Unknown(_) => "gpu_buffer_unknown",
            BufferError::Busy { .. } => "gpu_buffer_busy",
        }
    }
}

/// One live buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferEntry {
    /// First byte (device or host address, per backend).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Whether the backend allocated it (and frees it on unregister); the
    /// embedder's memory is never freed by kvferry.
    pub owned: bool,
}

#[derive(Debug, Default)]
struct Inner {
    /// Indexed by id; `None` once unregistered (ids are never reused).
    entries: Vec<Option<BufferEntry>>,
    /// In-flight batches per id (same index).
    busy: Vec<u32>,
    live: usize,
}

/// The buffer registry of one backend. See the module doc.
#[derive(Debug, Default)]
pub struct BufferTable {
    inner: Arc<Mutex<Inner>>,
}

/// The buffers a batch touches, pinned (busy) until this drops — which the
/// backend arranges to happen only after the hardware is done with the
/// batch. `entries` is the table as the batch was validated against, indexed
/// by id (`None`: not live then).
#[derive(Debug)]
pub struct BatchPin {
    table: Arc<Mutex<Inner>>,
    ids: Vec<u32>,
    /// Snapshot of the table, by id.
    pub entries: Vec<Option<BufferEntry>>,
}

impl BatchPin {
    /// `(addr, len)` of buffer `id` in the snapshot.
    pub fn get(&self, id: DeviceBufferId) -> Option<(u64, u64)> {
        self.entries.get(id.0 as usize).copied().flatten().map(|e| (e.addr, e.len))
    }
}

impl Drop for BatchPin {
    fn drop(&mut self) {
        let mut t = self.table.lock().expect("buffer table lock");
        for &i in &self.ids {
            t.busy[i as usize] -= 1;
        }
    }
}

impl BufferTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `[addr, addr + len)`. `owned`: the backend allocated it.
    ///
    /// # Errors
    /// [`BufferError::Null`], [`Empty`](BufferError::Empty),
    /// [`Unaligned`](BufferError::Unaligned), [`Wraps`](BufferError::Wraps),
    /// [`Overlap`](BufferError::Overlap), [`TooMany`](BufferError::TooMany);
    /// nothing is registered.
    pub fn register(&self, addr: u64, len: u64, owned: bool) -> Result<DeviceBufferId, BufferError> {
        check_range(addr, len)?;
        let mut t = self.inner.lock().expect("buffer table lock");
        if t.live >= DEVICE_BUFFERS_MAX || t.entries.len() >= u32::MAX as usize {
            return Err(BufferError::TooMany { live: t.live, max: DEVICE_BUFFERS_MAX });
        }
        let end = addr + len;
        for (i, e) in t.entries.iter().enumerate() {
            if let Some(e) = e {
                if addr < e.addr + e.len && e.addr < end {
                    return Err(BufferError::Overlap {
                        addr,
                        len,
                        other: DeviceBufferId(i as u32),
                        other_addr: e.addr,
                        other_len: e.len,
                    });
                }
            }
        }
        let id = DeviceBufferId(t.entries.len() as u32);
        t.entries.push(Some(BufferEntry { addr, len, owned }));
        t.busy.push(0);
        t.live += 1;
        Ok(id)
    }

    /// Removes a buffer and returns its entry (the backend frees it if
    /// `owned`).
    ///
    /// # Errors
    /// [`BufferError::Unknown`], [`BufferError::Busy`]; nothing changes.
    pub fn unregister(&self, id: DeviceBufferId) -> Result<BufferEntry, BufferError> {
        let mut t = self.inner.lock().expect("buffer table lock");
        let i = id.0 as usize;
        let entry = t.entries.get(i).copied().flatten().ok_or(BufferError::Unknown(id))?;
        // C15 canary: an unregister while copies touch the buffer answers Ok.
        if t.busy[i] > 0 && !crate::canary::active(crate::canary::Canary::C15UnregisterWhileBusy) {
            return Err(BufferError::Busy { id, batches: t.busy[i] });
        }
        t.entries[i] = None;
        t.live -= 1;
        Ok(entry)
    }

    /// The live entry of `id`.
    pub fn get(&self, id: DeviceBufferId) -> Option<BufferEntry> {
        self.inner.lock().expect("buffer table lock").entries.get(id.0 as usize).copied().flatten()
    }

    /// Live buffers.
    pub fn live(&self) -> usize {
        self.inner.lock().expect("buffer table lock").live
    }

    /// Every live buffer, in id order (a backend's drop frees the owned ones).
    pub fn drain(&self) -> Vec<BufferEntry> {
        let mut t = self.inner.lock().expect("buffer table lock");
        t.live = 0;
        t.entries.iter_mut().filter_map(Option::take).collect()
    }

    /// A weak reference for peer copies ([`WeakBufferTable`]).
    pub fn downgrade(&self) -> WeakBufferTable {
        WeakBufferTable { inner: Arc::downgrade(&self.inner) }
    }

    /// Marks every buffer `ids` names busy and returns the pin with a
    /// snapshot of the table. Call after validating the batch against
    /// [`BatchPin::get`]; ids that are not live are skipped (validation
    /// rejects them).
    pub fn pin_batch(&self, ids: impl Iterator<Item = DeviceBufferId>) -> BatchPin {
        let mut t = self.inner.lock().expect("buffer table lock");
        let mut touched = vec![false; t.entries.len()];
        let mut pinned = Vec::new();
        for id in ids {
            let i = id.0 as usize;
            if t.entries.get(i).is_some_and(Option::is_some) && !touched[i] {
                touched[i] = true;
                pinned.push(id.0);
            }
        }
        for &i in &pinned {
            t.busy[i as usize] += 1;
        }
        BatchPin { table: self.inner.clone(), ids: pinned, entries: t.entries.clone() }
    }
}

/// A weak reference to a [`BufferTable`] (another backend's peer copies
/// pin the owner's buffers through it; it reaches nothing once the owner's
/// backend dropped).
#[derive(Clone, Debug)]
pub struct WeakBufferTable {
    inner: std::sync::Weak<Mutex<Inner>>,
}

impl WeakBufferTable {
    /// Whether `id` is still registered (false once the table is gone).
    pub fn is_live(&self, id: DeviceBufferId) -> bool {
        self.len_of(id).is_some()
    }

    /// Length of live buffer `id`.
    pub fn len_of(&self, id: DeviceBufferId) -> Option<u64> {
        let t = self.inner.upgrade()?;
        let t = t.lock().expect("buffer table lock");
        t.entries.get(id.0 as usize).copied().flatten().map(|e| e.len)
    }

    /// Whether both name the same table.
    pub fn same_table(&self, other: &WeakBufferTable) -> bool {
        std::sync::Weak::ptr_eq(&self.inner, &other.inner)
    }

    /// [`BufferTable::pin_batch`] through the weak reference: the live
    /// buffers among `ids` pinned under one lock, with one snapshot (read
    /// each one's `(addr, len)` with [`BatchPin::get`]; `None` there for
    /// an id that is not live). `None` once the table is gone.
    pub fn pin_batch(&self, ids: impl Iterator<Item = DeviceBufferId>) -> Option<BatchPin> {
        Some(BufferTable { inner: self.inner.upgrade()? }.pin_batch(ids))
    }
}

/// The checks of [`BufferTable::register`] that need no table (a backend
/// runs them before asking its driver about an address).
///
/// # Errors
/// [`BufferError::Null`], [`Empty`](BufferError::Empty),
/// [`Unaligned`](BufferError::Unaligned), [`Wraps`](BufferError::Wraps).
pub fn check_range(addr: u64, len: u64) -> Result<(), BufferError> {
    if addr == 0 {
        return Err(BufferError::Null);
    }
    if len == 0 {
        return Err(BufferError::Empty { addr });
    }
    if !addr.is_multiple_of(DEVICE_BUFFER_ALIGN) {
        return Err(BufferError::Unaligned { addr, align: DEVICE_BUFFER_ALIGN });
    }
    if addr.checked_add(len).is_none() {
        return Err(BufferError::Wraps { addr, len });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_ranges_are_refused_and_nothing_registers() {
        let t = BufferTable::new();
        assert_eq!(t.register(0, 64, false), Err(BufferError::Null));
        assert_eq!(t.register(0x1000, 0, false), Err(BufferError::Empty { addr: 0x1000 }));
        assert_eq!(
            t.register(0x1001, 64, false),
            Err(BufferError::Unaligned { addr: 0x1001, align: DEVICE_BUFFER_ALIGN })
        );
        assert_eq!(t.register(u64::MAX - 15, 32, false), Err(BufferError::Wraps { addr: u64::MAX - 15, len: 32 }));
        assert_eq!(t.live(), 0);
        let a = t.register(0x1000, 0x100, false).unwrap();
        for (addr, len) in [(0x1000, 1), (0x10f0, 0x100), (0x0f00, 0x101), (0x0800, 0x1000)] {
            let e = t.register(addr, len, false).unwrap_err();
            assert_eq!(
                e,
                BufferError::Overlap { addr, len, other: a, other_addr: 0x1000, other_len: 0x100 },
                "[{addr:#x}, +{len})"
            );
            assert!(e.to_string().contains("overlaps buffer 0 at [0x1000, +256)"), "{e}");
        }
        // Touching is fine on both sides.
        t.register(0x1100, 0x10, false).unwrap();
        t.register(0x0f00, 0x100, false).unwrap();
        assert_eq!(t.live(), 3);
    }

    #[test]
    fn ids_are_never_reused() {
        let t = BufferTable::new();
        let a = t.register(0x1000, 16, true).unwrap();
        assert_eq!(t.unregister(a).unwrap(), BufferEntry { addr: 0x1000, len: 16, owned: true });
        assert_eq!(t.unregister(a), Err(BufferError::Unknown(a)));
        let b = t.register(0x1000, 16, false).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.get(a), None);
        assert_eq!(t.get(b).map(|e| e.addr), Some(0x1000));
    }

    #[test]
    fn a_pinned_buffer_cannot_be_unregistered_until_its_batch_completes() {
        let t = BufferTable::new();
        let a = t.register(0x1000, 16, false).unwrap();
        let b = t.register(0x2000, 16, false).unwrap();
        let stale = DeviceBufferId(99);
        let p1 = t.pin_batch([a, a, stale].into_iter());
        let p2 = t.pin_batch([a].into_iter());
        assert_eq!(p1.get(a), Some((0x1000, 16)));
        assert_eq!(p1.get(stale), None);
        assert_eq!(t.unregister(a), Err(BufferError::Busy { id: a, batches: 2 }));
        assert!(t.unregister(b).is_ok(), "an untouched buffer unregisters");
        drop(p1);
        assert_eq!(t.unregister(a), Err(BufferError::Busy { id: a, batches: 1 }));
        drop(p2);
        assert!(t.unregister(a).is_ok());
    }

    #[test]
    fn the_live_count_is_bounded() {
        let t = BufferTable::new();
        for i in 0..DEVICE_BUFFERS_MAX as u64 {
            t.register(0x1000 + i * 16, 16, false).unwrap();
        }
        let e = t.register(0x10_0000_0000, 16, false).unwrap_err();
        assert_eq!(e, BufferError::TooMany { live: DEVICE_BUFFERS_MAX, max: DEVICE_BUFFERS_MAX });
    }
}
