//! The shared pool arena: a sealed memfd (Linux, outside the simulator).
//!
//! # Why a memfd
//!
//! A same-host reader (the `shm` transport) reads an owner's pool straight
//! from memory instead of through a socket. The owner hands it a file
//! descriptor; a memfd is an anonymous file with no name in any file system,
//! so nothing but the descriptor reaches it.
//!
//! # Why the seals
//!
//! A reader that maps a file faults (`SIGBUS`) on any page past the end of
//! the file. If the owner (or anyone with the descriptor) could shrink the
//! file, a bug on its side would crash every reader. `F_SEAL_SHRINK` and
//! `F_SEAL_GROW` fix the size for the file's life; `F_SEAL_FUTURE_WRITE`
//! (Linux 5.1+) refuses every *later* writable mapping and `write`, so only
//! the owner's mapping, made before the seal, can change the bytes — a
//! reader that reopens `/proc/self/fd/N` read-write still cannot map it
//! writable; `F_SEAL_SEAL` forbids adding or testing more seals later. A
//! reader checks the seals it relies on (`F_GET_SEALS`) before mapping.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// The seals every shared arena carries (`F_SEAL_FUTURE_WRITE` is added on
/// top where the kernel has it).
pub const ARENA_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A memfd mapped shared, read-write, at an aligned address; unmapped on
/// drop (the file lives on while another process holds a mapping or a
/// descriptor of it).
pub struct SharedArena {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping has no thread affinity; `SharedArena` only hands out
// the base pointer (dereferencing it is the pool's responsibility, see its
// "Soundness") and the descriptor.
unsafe impl Send for SharedArena {}
// SAFETY: as above; no method mutates through `&self`.
unsafe impl Sync for SharedArena {}

fn last_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The system page size (bytes).
pub fn page_bytes() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|n| n.is_power_of_two()).unwrap_or(4096)
}

impl SharedArena {
    /// A sealed memfd of `len` bytes (a multiple of the page size, nonzero)
    /// mapped at an address that is a multiple of `align` (a power of two).
    ///
    /// # Errors
    /// The failing call (`memfd_create`, `ftruncate`, `mmap`, `F_ADD_SEALS`)
    /// with its OS error; nothing is left mapped or open.
    pub fn create(len: usize, align: usize) -> io::Result<Self> {
        let page = page_bytes();
        if len == 0 || !len.is_multiple_of(page) || !align.is_power_of_two() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "length must be whole pages, align a power of 2"));
        }
        const NAME: &CStr = c"kvferry-pool";
        // SAFETY: a valid C string and flags.
        let raw = unsafe { libc::memfd_create(NAME.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(last_err("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let off_len = libc::off_t::try_from(len).map_err(|_| io::Error::other("arena too large"))?;
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), off_len) } != 0 {
            return Err(last_err("ftruncate"));
        }
        let base = map_aligned(&fd, len, align)?;
        let arena = SharedArena { fd, base, len };
        let fd = arena.fd.as_raw_fd();
        // SAFETY: fcntl on our descriptor.
        let future = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, ARENA_SEALS | libc::F_SEAL_FUTURE_WRITE) };
        // SAFETY: as above (older kernels refuse F_SEAL_FUTURE_WRITE with EINVAL).
        if future != 0 && unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, ARENA_SEALS) } != 0 {
            return Err(last_err("F_ADD_SEALS")); // `arena` drops: unmapped, closed
        }
        Ok(arena)
    }

    /// The mapping's first byte (aligned as asked).
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Length of the file and the mapping (bytes).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (see [`SharedArena::create`]).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for SharedArena {
    fn drop(&mut self) {
        // SAFETY: exactly the range `map_aligned` mapped; the pool drops its
        // arena only when no slice into it can be produced any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Maps `fd` (`len` bytes, shared, read-write) at a multiple of `align`:
/// directly when a page suffices, else inside a reserved range of
/// `len + align` bytes whose unaligned ends are given back.
fn map_aligned(fd: &OwnedFd, len: usize, align: usize) -> io::Result<NonNull<u8>> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    if align <= page_bytes() {
        // SAFETY: a fresh mapping chosen by the kernel; checked below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(last_err("mmap"));
        }
        return NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"));
    }
    let span = len.checked_add(align).ok_or_else(|| io::Error::other("arena too large"))?;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: reserving address space only (PROT_NONE).
    let r = unsafe { libc::mmap(std::ptr::null_mut(), span, libc::PROT_NONE, flags, -1, 0) };
    if r == libc::MAP_FAILED {
        return Err(last_err("mmap (reserve)"));
    }
    let start = r as usize;
    let at = start.next_multiple_of(align);
    // SAFETY: `[at, at + len)` lies inside the reservation we own, so
    // MAP_FIXED replaces only our own PROT_NONE pages.
    let p = unsafe {
        libc::mmap(at as *mut libc::c_void, len, prot, libc::MAP_SHARED | libc::MAP_FIXED, fd.as_raw_fd(), 0)
    };
    if p == libc::MAP_FAILED {
        let e = last_err("mmap (fixed)");
        // SAFETY: the whole reservation is ours.
        unsafe { libc::munmap(r, span) };
        return Err(e);
    }
    // SAFETY: give back the reservation's head and tail (ours, unused).
    unsafe {
        if at > start {
            libc::munmap(r, at - start);
        }
        let end = at + len;
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, start + span - end);
        }
    }
    NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seals(fd: BorrowedFd<'_>) -> libc::c_int {
        // SAFETY: fcntl on a live descriptor.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }
    }

    /// Sealed, sized, aligned, zeroed, writable through its own mapping;
    /// nobody can shrink it or map it writable again.
    #[test]
    fn arena_is_sealed_sized_aligned_and_zeroed() {
        let page = page_bytes();
        for align in [page, 1 << 16, 1 << 21] {
            let a = SharedArena::create(4 * page, align).unwrap();
            assert_eq!(a.base().as_ptr() as usize % align, 0, "align {align}");
            let s = seals(a.fd());
            assert_eq!(s & ARENA_SEALS, ARENA_SEALS, "seals {s:#x}");
            // SAFETY: the mapping is ours, `len` bytes, read-write.
            let bytes = unsafe { std::slice::from_raw_parts_mut(a.base().as_ptr(), a.len()) };
            assert!(bytes.iter().all(|&b| b == 0));
            bytes[page + 3] = 7;
            // SAFETY: fstat into a zeroed struct.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            assert_eq!(unsafe { libc::fstat(a.fd().as_raw_fd(), &mut st) }, 0);
            assert_eq!(st.st_size as usize, 4 * page);
            // SAFETY: syscalls on our descriptor; each must be refused.
            assert_ne!(unsafe { libc::ftruncate(a.fd().as_raw_fd(), page as libc::off_t) }, 0, "shrink refused");
            assert_ne!(unsafe { libc::ftruncate(a.fd().as_raw_fd(), (8 * page) as libc::off_t) }, 0, "grow refused");
            if s & libc::F_SEAL_FUTURE_WRITE != 0 {
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        page,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        a.fd().as_raw_fd(),
                        0,
                    )
                };
                assert_eq!(p, libc::MAP_FAILED, "a second writable mapping is refused");
                // The owner's own mapping still writes.
                bytes[0] = 1;
            }
        }
        assert!(SharedArena::create(0, page).is_err());
        assert!(SharedArena::create(page + 1, page).is_err());
    }
}
