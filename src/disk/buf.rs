//! Owned, page-aligned I/O buffers ([`AlignedBuf`]): what the disk tier's
//! backends read into and write from.
//!
//! `O_DIRECT` moves bytes between the device and user memory with no page
//! cache in between, so the kernel demands that the buffer address, the
//! file offset and the length are multiples of the device's logical block
//! size. Every buffer here starts at a multiple of
//! [`DISK_ALIGN_BYTES`](crate::limits::DISK_ALIGN_BYTES) (4 KiB, which
//! covers 512 B and 4 KiB devices) and its length is always a multiple of
//! it too.
//!
//! # Ownership and the kernel
//!
//! A buffer is *moved* into a backend with the operation that uses it and
//! *moved back* with that operation's completion, so while the kernel (or a
//! worker thread) may touch its bytes nobody else can reach them, and it
//! cannot be freed before the completion: a backend that is dropped with
//! operations in flight waits for them first (house rule: a timeout never
//! frees a buffer, only a completion does).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::limits::DISK_ALIGN_BYTES;

const ALIGN: usize = DISK_ALIGN_BYTES as usize;

/// Why an [`AlignedBuf`] could not be made or resized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BufError {
    /// A length that is zero or not a multiple of
    /// [`DISK_ALIGN_BYTES`](crate::limits::DISK_ALIGN_BYTES).
    #[error("buffer length {len} B is not a positive multiple of {align} B")]
    Unaligned {
        /// The length asked for (bytes).
        len: usize,
        /// The alignment it must be a multiple of (bytes).
        align: usize,
    },
    /// [`AlignedBuf::set_len`] beyond the buffer's capacity.
    #[error("buffer length {len} B exceeds its capacity {capacity} B")]
    OverCapacity {
        /// The length asked for (bytes).
        len: usize,
        /// The buffer's capacity (bytes).
        capacity: usize,
    },
    /// The system allocator returned null.
    #[error("could not allocate a {bytes} B aligned buffer")]
    Alloc {
        /// The size asked for (bytes).
        bytes: usize,
    },
}

/// An owned, zero-initialised buffer whose address and length are
/// multiples of [`DISK_ALIGN_BYTES`](crate::limits::DISK_ALIGN_BYTES).
///
/// `len` (the bytes an I/O moves) may be lowered and raised again up to
/// the allocation's `capacity` without reallocating, so the tier can reuse
/// buffers across records of different sizes.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: an `AlignedBuf` uniquely owns its allocation (no aliasing handle
// exists), so moving it to another thread or sharing `&AlignedBuf` is as
// safe as for `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`; `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (capacity `len`).
    ///
    /// # Errors
    /// [`BufError::Unaligned`] when `len` is zero or not a multiple of the
    /// alignment; [`BufError::Alloc`] when the allocator fails.
    pub fn new(len: usize) -> Result<Self, BufError> {
        if len == 0 || !len.is_multiple_of(ALIGN) {
            return Err(BufError::Unaligned { len, align: ALIGN });
        }
        let layout = Layout::from_size_align(len, ALIGN).map_err(|_| BufError::Alloc { bytes: len })?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(BufError::Alloc { bytes: len })?;
        Ok(Self { ptr, len, capacity: len })
    }

    /// The bytes an I/O on this buffer moves.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer holds at least one aligned unit.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation's size (bytes); [`set_len`](Self::set_len) may go up
    /// to it.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the length an I/O moves. The bytes between the old and the new
    /// length keep whatever they held (zeros, or an earlier I/O's bytes).
    ///
    /// # Errors
    /// [`BufError::Unaligned`] for a zero or unaligned `len`,
    /// [`BufError::OverCapacity`] beyond the capacity.
    pub fn set_len(&mut self, len: usize) -> Result<(), BufError> {
        if len == 0 || !len.is_multiple_of(ALIGN) {
            return Err(BufError::Unaligned { len, align: ALIGN });
        }
        if len > self.capacity {
            return Err(BufError::OverCapacity { len, capacity: self.capacity });
        }
        self.len = len;
        Ok(())
    }

    /// The first `len` bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `capacity >= len` initialised bytes
        // (zeroed at allocation, only ever written through `&mut self`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The first `len` bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer's address, for a device or the kernel to read. The
    /// caller keeps the buffer alive (owns it) until that access ended.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The buffer's address, for a device or the kernel to write; see
    /// [`as_ptr`](Self::as_ptr).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The address as a number: what the tier compares a completion's
    /// buffer against to catch a completion carrying the wrong buffer.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this size and alignment.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.capacity, ALIGN)) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("addr", &format_args!("{:#x}", self.addr())).field("len", &self.len).finish()
    }
}

/// `n` rounded up to a multiple of
/// [`DISK_ALIGN_BYTES`](crate::limits::DISK_ALIGN_BYTES); `None` on
/// overflow.
pub fn align_up(n: u64) -> Option<u64> {
    n.checked_add(DISK_ALIGN_BYTES - 1).map(|v| v & !(DISK_ALIGN_BYTES - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_resizable() {
        let mut b = AlignedBuf::new(3 * ALIGN).unwrap();
        assert_eq!(b.addr() % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 7;
        b.set_len(ALIGN).unwrap();
        assert_eq!(b.len(), ALIGN);
        b.set_len(3 * ALIGN).unwrap();
        assert_eq!(b.as_slice()[5], 7, "shrinking keeps the bytes");
        assert_eq!(b.set_len(4 * ALIGN), Err(BufError::OverCapacity { len: 4 * ALIGN, capacity: 3 * ALIGN }));
        assert_eq!(b.set_len(100), Err(BufError::Unaligned { len: 100, align: ALIGN }));
        assert!(matches!(AlignedBuf::new(0), Err(BufError::Unaligned { .. })));
        assert!(matches!(AlignedBuf::new(ALIGN + 1), Err(BufError::Unaligned { .. })));
    }

    #[test]
    fn align_up_rounds() {
        assert_eq!(align_up(0), Some(0));
        assert_eq!(align_up(1), Some(4096));
        assert_eq!(align_up(4096), Some(4096));
        assert_eq!(align_up(4097), Some(8192));
        assert_eq!(align_up(u64::MAX), None);
    }
}
