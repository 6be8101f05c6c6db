//! The disk tier: an SSD below the pinned pool (issue 32), checksummed end
//! to end (C17) and kept across restarts (C18).
//!
//! Layer: beside [`memory`](crate::memory) (layer 1). It imports only
//! `types`, `limits`, `canary` and `memory` (the pool's extent allocator
//! carves the file); nothing below imports it.
//!
//! - [`buf`]: owned, 4 KiB-aligned I/O buffers.
//! - [`io`]: the door ([`DiskIo`]): submit reads and writes of owned
//!   buffers at an offset; completions carry the tag and hand the buffer
//!   back, short counts and errors included.
//! - [`format`]: the on-disk record — identity (namespace, block hash,
//!   layout family, length, generation), per-slot CRC-32C, header CRC —
//!   and its never-panicking decoder (fuzz target `disk_record`).
//! - [`tier`]: the tier — space allocator over the file, index, LRU
//!   eviction, bounded write-behind queue, verified reads, counters,
//!   recovery on open.
//! - [`sim`]: the simulated disk with seeded faults (short and torn
//!   writes, stale, reordered and misdirected completions, `EIO`,
//!   `ENOSPC`, silent corruption, slow I/O); [`check`]: the per-seed
//!   invariants of C17 and C18 over it.
//! - `file`, `uring`, `pio` (Linux builds, the simulator's included; the
//!   engine refuses to open them under the simulator, see
//!   [`crate::rt::SIMULATED`]): the tier's preallocated `O_DIRECT` file,
//!   the io_uring backend and the `pread`/`pwrite` thread backend used
//!   when io_uring is refused.
//!
//! Why not `foyer`: docs/design.md §8, "Disk tier".

#[cfg(target_os = "linux")]
pub mod backend;
pub mod buf;
pub mod check;
mod codes;
#[cfg(target_os = "linux")]
pub mod file;
pub mod format;
pub mod io;
#[cfg(target_os = "linux")]
pub mod pio;
pub mod sim;
pub mod tier;
#[cfg(target_os = "linux")]
pub mod uring;

pub use buf::AlignedBuf;
pub use format::{BlockKey, SlotSum};
pub use io::{BackendKind, DiskIo};
pub use tier::{Tier, TierConfig, TierCounters, TierEvent};

#[cfg(test)]
mod tests;
