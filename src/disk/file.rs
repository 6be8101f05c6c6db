//! The tier's file: one preallocated file under a directory the operator
//! names, opened with `O_DIRECT`, and the choice of backend over it
//! ([`open_backend`]): io_uring when the kernel and the container allow
//! it, else `pread`/`pwrite` on blocking threads.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::buf::AlignedBuf;
use crate::limits::{DISK_ALIGN_BYTES, DISK_CAPACITY_BYTES_MAX, DISK_CAPACITY_BYTES_MIN};

/// The tier's file name inside the operator's directory.
pub const TIER_FILE_NAME: &str = "kvferry-tier.0";

/// The lock file inside the operator's directory: the tier holds an
/// exclusive `flock` on it while open, so two nodes (in one process or
/// two) never use one directory at once.
pub const TIER_LOCK_NAME: &str = "kvferry-tier.lock";

/// `statfs` magic of tmpfs (`linux/magic.h`).
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Why the tier's file or backend could not be opened. Each names the
/// path and what to do.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The directory does not exist (it is never created: a typo must not
    /// fill another disk).
    #[error("disk tier directory {path} does not exist (create it, on the SSD, first)")]
    DirMissing {
        /// The directory.
        path: PathBuf,
    },
    /// The path is not a directory.
    #[error("disk tier path {path} is not a directory")]
    NotADir {
        /// The path.
        path: PathBuf,
    },
    /// A size outside the allowed range.
    #[error("disk tier size {bytes} B is outside {min}..={max} B")]
    BadSize {
        /// The size asked for (bytes).
        bytes: u64,
        /// Smallest (bytes).
        min: u64,
        /// Largest (bytes).
        max: u64,
    },
    /// A queue depth outside `1..=DISK_QUEUE_DEPTH_MAX`.
    #[error("disk tier queue depth {depth} is outside 1..={max}")]
    BadDepth {
        /// The depth asked for.
        depth: usize,
        /// Largest.
        max: usize,
    },
    /// The file system refuses `O_DIRECT` (e.g. tmpfs on older kernels, or
    /// some network and overlay file systems).
    #[error(
        "the file system of {path} refuses O_DIRECT ({source}); put the disk tier on a local SSD file system (ext4, xfs)"
    )]
    DirectIoRefused {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Another open tier (another node or process) holds the directory's
    /// lock.
    #[error(
        "disk tier directory {dir} is in use by another kvferry node or process (it holds {TIER_LOCK_NAME}); give each node its own directory"
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
    },
    /// The file could not be created or opened.
    #[error("cannot open disk tier file {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file's space could not be allocated (`fallocate`).
    #[error(
        "cannot allocate {bytes} B for disk tier file {path}: {source} (free space on that file system, or a smaller size)"
    )]
    Allocate {
        /// The file.
        path: PathBuf,
        /// The size asked for (bytes).
        bytes: u64,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A thread the tier needs (the thread backend's, or the open's probe
    /// read) could not be started.
    #[error("cannot start disk tier threads: {source}")]
    Threads {
        /// What the OS said.
        source: std::io::Error,
    },
    /// io_uring was asked for and is not available.
    #[error("io_uring is not available here ({source}); use the thread backend")]
    NoUring {
        /// What the OS said.
        source: std::io::Error,
    },
    /// Allocating the file's space or the probe read of its first page
    /// did not complete within `DISK_RECOVERY_READ_TIMEOUT_MS`: the disk
    /// hangs. The call is left to a thread of its own, which owns its file
    /// handle and buffer.
    #[error(
        "disk tier file {path}: allocating its space or reading its first page did not complete within {waited_ms} ms \
         (the disk hangs)"
    )]
    Hung {
        /// The file.
        path: PathBuf,
        /// How long the open waited (ms).
        waited_ms: u64,
    },
}

/// The open tier file.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    path: PathBuf,
    capacity: u64,
    /// The directory's lock file, locked (`flock`, exclusive) while this
    /// lives; `None` for the benchmark's raw baseline file.
    _lock: Option<File>,
}

/// Whether `dir` is on tmpfs (`statfs`).
///
/// # Errors
/// What `statfs` said (e.g. the path does not exist).
pub fn on_tmpfs(dir: &Path) -> std::io::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `statfs` fills the struct for a NUL-terminated path.
    if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // f_type's width differs by target
    Ok(st.f_type as i64 == TMPFS_MAGIC)
}

/// Takes the exclusive lock of tier directory `dir` (creating its lock
/// file); held as long as the returned file is open.
fn lock_dir(dir: &Path) -> Result<File, OpenError> {
    let path = dir.join(TIER_LOCK_NAME);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| OpenError::Open { path: path.clone(), source })?;
    // SAFETY: plain syscall on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let source = std::io::Error::last_os_error();
        return Err(if source.raw_os_error() == Some(libc::EWOULDBLOCK) {
            OpenError::Locked { dir: dir.to_path_buf() }
        } else {
            OpenError::Open { path, source }
        });
    }
    Ok(f)
}

impl DiskFile {
    /// Opens (creating if needed) `dir/TIER_FILE_NAME` with `O_DIRECT`,
    /// allocates `bytes` (rounded down to the alignment) with `fallocate`,
    /// and checks with one aligned read that direct I/O works. An existing
    /// larger file is left as it is; only its first `bytes` are used.
    ///
    /// # Errors
    /// [`OpenError`], naming the path: a missing directory, a size out of
    /// range, `O_DIRECT` refused, the space not allocatable.
    pub fn open(dir: &Path, bytes: u64) -> Result<Self, OpenError> {
        check_dir(dir)?;
        let lock = lock_dir(dir)?;
        if on_tmpfs(dir).unwrap_or(false) {
            tracing::warn!(
                dir = %dir.display(),
                "disk tier directory is on tmpfs: the tier is held in RAM (it competes with the pool for memory, \
                 O_DIRECT is a plain copy there, and nothing survives a reboot); put it on a local SSD"
            );
        }
        let mut f = Self::open_named(dir, TIER_FILE_NAME, bytes)?;
        f._lock = Some(lock);
        Ok(f)
    }

    /// [`open`](Self::open) with another file name in `dir` (the
    /// benchmark's raw baseline file).
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_named(dir: &Path, name: &str, bytes: u64) -> Result<Self, OpenError> {
        let capacity = bytes & !(DISK_ALIGN_BYTES - 1);
        if !(DISK_CAPACITY_BYTES_MIN..=DISK_CAPACITY_BYTES_MAX).contains(&capacity) {
            return Err(OpenError::BadSize { bytes, min: DISK_CAPACITY_BYTES_MIN, max: DISK_CAPACITY_BYTES_MAX });
        }
        check_dir(dir)?;
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| {
                if source.raw_os_error() == Some(libc::EINVAL) {
                    OpenError::DirectIoRefused { path: path.clone(), source }
                } else {
                    OpenError::Open { path: path.clone(), source }
                }
            })?;
        // Allocation and a probe read run on a thread of their own, within a
        // bound: a disk that hangs (in `fallocate`, or in the read) fails
        // the open instead of hanging the caller. On a timeout the thread
        // is left blocked; it owns its file handle and buffer.
        let worker = file.try_clone().map_err(|source| OpenError::Open { path: path.clone(), source })?;
        let (tx, rx) = std::sync::mpsc::channel();
        let worker_path = path.clone();
        let started = std::thread::Builder::new().name("kvferry-disk-probe".into()).spawn(move || {
            let _ = tx.send(allocate_and_probe(&worker, worker_path, capacity));
        });
        if let Err(source) = started {
            return Err(OpenError::Threads { source });
        }
        let timeout = std::time::Duration::from_millis(crate::limits::DISK_RECOVERY_READ_TIMEOUT_MS);
        let t0 = std::time::Instant::now();
        match rx.recv_timeout(timeout) {
            Ok(r) => r?,
            Err(_) => return Err(OpenError::Hung { path, waited_ms: t0.elapsed().as_millis() as u64 }),
        }
        Ok(Self { file, path, capacity, _lock: None })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The usable size (bytes).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// [`DiskIo::next_data`](super::io::DiskIo::next_data) for this file:
    /// `lseek(SEEK_DATA)` from `from`; `None` at `ENXIO` (no data after
    /// `from`), `Some(from)` when the file system cannot tell.
    pub fn next_data(&self, from: u64) -> Option<u64> {
        let Ok(at) = libc::off_t::try_from(from) else { return Some(from) };
        // SAFETY: lseek on a descriptor this file owns; it moves only the
        // file offset, which no I/O of the tier uses (all positioned).
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), at, libc::SEEK_DATA) };
        if r >= 0 {
            return Some((r as u64).max(from));
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ENXIO) => None,
            _ => Some(from),
        }
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// Gives `file` its `capacity` bytes (`fallocate`, refused up front when
/// the file system lacks the space; a sparse file where `fallocate` is not
/// supported) and checks that one aligned direct read of its first page
/// works. Runs on the open's probe thread.
fn allocate_and_probe(file: &File, path: PathBuf, capacity: u64) -> Result<(), OpenError> {
    let have = file.metadata().map_err(|source| OpenError::Open { path: path.clone(), source })?.len();
    if have < capacity {
        // Refuse before allocating what the file system does not have:
        // a failing fallocate first fills it (ext4 keeps the extents it
        // got until the file is truncated), starving its other users.
        let free = free_bytes(file).map_err(|source| OpenError::Open { path: path.clone(), source })?;
        if capacity - have > free {
            if have == 0 {
                let _ = std::fs::remove_file(&path);
            }
            return Err(OpenError::Allocate {
                path,
                bytes: capacity,
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        // SAFETY: plain syscall on an fd we own.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, capacity as libc::off_t) };
        if r != 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::EOPNOTSUPP) {
                // A file system without fallocate: a sparse file; a
                // later ENOSPC is a counted write failure.
                tracing::warn!(path = %path.display(), "disk tier: fallocate unsupported, the file is sparse");
                file.set_len(capacity).map_err(|source| OpenError::Allocate {
                    path: path.clone(),
                    bytes: capacity,
                    source,
                })?;
            } else {
                // Give back what a failed fallocate kept (ext4 keeps
                // the extents it got before ENOSPC): the file returns
                // to its old length, and a file this call created goes.
                let _ = file.set_len(have);
                if have == 0 {
                    let _ = std::fs::remove_file(&path);
                }
                return Err(OpenError::Allocate { path, bytes: capacity, source });
            }
        }
    }
    let mut probe = AlignedBuf::new(DISK_ALIGN_BYTES as usize).map_err(|_| OpenError::Allocate {
        path: path.clone(),
        bytes: DISK_ALIGN_BYTES,
        source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
    })?;
    file.read_at(probe.as_mut_slice(), 0).map(drop).map_err(|source| OpenError::DirectIoRefused { path, source })
}

/// `dir` exists and is a directory.
fn check_dir(dir: &Path) -> Result<(), OpenError> {
    match std::fs::metadata(dir) {
        Err(_) => Err(OpenError::DirMissing { path: dir.to_path_buf() }),
        Ok(m) if !m.is_dir() => Err(OpenError::NotADir { path: dir.to_path_buf() }),
        Ok(_) => Ok(()),
    }
}

/// Bytes an unprivileged writer may still allocate on the file system that
/// holds `dir` (`statvfs`), for checks before any tier file is made (e.g.
/// several nodes' tiers under one directory).
///
/// # Errors
/// The `statvfs` failure (a missing directory, a path with a NUL byte).
pub fn free_bytes_at(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a NUL-terminated path and a struct for the call to fill.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Bytes an unprivileged writer may still allocate on `file`'s file system
/// (`fstatvfs`: available blocks × fragment size).
fn free_bytes(file: &File) -> std::io::Result<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `fstatvfs` fills the struct for an fd we own.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_in_use_is_refused_naming_it() {
        let dir = tempfile::Builder::new().prefix(".disk-file-lock-").tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let first = DiskFile::open(dir.path(), 1 << 20).expect("first open");
        let err = DiskFile::open(dir.path(), 1 << 20).expect_err("second open of a locked directory");
        assert!(matches!(err, OpenError::Locked { .. }), "{err}");
        assert!(err.to_string().contains(&dir.path().display().to_string()), "{err}");
        drop(first);
        DiskFile::open(dir.path(), 1 << 20).expect("open after the first closed");
    }

    #[test]
    fn tmpfs_is_recognised() {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            assert!(on_tmpfs(shm).expect("statfs /dev/shm"));
        }
        assert!(on_tmpfs(Path::new("/nonexistent-kvferry-dir")).is_err());
    }
}
