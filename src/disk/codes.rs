//! Stable codes of the disk tier's errors (`docs/design.md`, "Errors"),
//! one table per error, kept apart from the definitions.

use super::buf::BufError;
use super::format::FormatError;
use super::io::SubmitError;
use super::tier::TierError;

#[cfg(target_os = "linux")]
impl super::file::OpenError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        use super::file::OpenError;
        match self {
            OpenError::DirMissing { .. } => "disk_open_dir_missing",
            OpenError::NotADir { .. } => "disk_open_not_a_dir",
            OpenError::BadSize { .. } => "disk_open_bad_size",
            OpenError::BadDepth { .. } => "disk_open_bad_depth",
            OpenError::DirectIoRefused { .. } => "disk_open_direct_io_refused",
            OpenError::Locked { .. } => "disk_open_locked",
            OpenError::Open { .. } => "disk_open_open",
            OpenError::Allocate { .. } => "disk_open_allocate",
            OpenError::Threads { .. } => "disk_open_threads",
            OpenError::NoUring { .. } => "disk_open_no_uring",
            OpenError::Hung { .. } => "disk_open_hung",
        }
    }
}

impl SubmitError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            SubmitError::Unaligned { .. } => "disk_submit_unaligned",
            SubmitError::OutOfRange { .. } => "disk_submit_out_of_range",
            SubmitError::QueueFull { .. } => "disk_submit_queue_full",
            SubmitError::Broken(_) => "disk_submit_broken",
        }
    }
}

impl BufError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            BufError::Unaligned { .. } => "disk_buf_unaligned",
            BufError::OverCapacity { .. } => "disk_buf_over_capacity",
            BufError::Alloc { .. } => "disk_buf_alloc",
        }
    }
}

impl FormatError {
    /// The stable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            FormatError::Truncated { .. } => "disk_format_truncated",
            FormatError::BadMagic { .. } => "disk_format_bad_magic",
            FormatError::Version { .. } => "disk_format_version",
            FormatError::Field { .. } => "disk_format_field",
            FormatError::HeaderChecksum { .. } => "disk_format_header_checksum",
            FormatError::SlotChecksum { .. } => "disk_format_slot_checksum",
            FormatError::Identity { .. } => "disk_format_identity",
            FormatError::NamespaceUtf8 => "disk_format_namespace_utf8",
        }
    }
}

impl TierError {
    /// The stable code of this error; a wrapped pool or buffer error
    /// answers its own code.
    pub fn code(&self) -> &'static str {
        match self {
            TierError::BadConfig { .. } => "disk_tier_bad_config",
            TierError::Space(e) => e.code(),
            TierError::Buffer(e) => e.code(),
            TierError::Backend(_) => "disk_tier_backend",
            TierError::RecoveryStalled { .. } => "disk_tier_recovery_stalled",
        }
    }
}
