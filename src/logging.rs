//! Logging for binaries (contract C12).
//!
//! The library only emits `tracing` events and never installs a global
//! subscriber. [`init`] is for binaries: it uses `try_init`, so calling it
//! in a host process that already installed a subscriber (or calling it
//! twice) is fine — the host's subscriber stays and receives our records.

use tracing_subscriber::EnvFilter;

/// What [`init`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitOutcome {
    /// Our fmt subscriber is now the global default.
    Installed,
    /// A global subscriber already existed; it was left in place.
    AlreadySet,
}

/// Installs a stderr fmt subscriber filtered by `RUST_LOG` (default
/// `default_filter`, e.g. `"info"`), unless one is already installed.
/// Never panics.
pub fn init(default_filter: &str) -> InitOutcome {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // A closed stderr (`2>&1 | head -1`) drops log lines: tracing's own
    // report of the failed write would go to stderr too, and panic there.
    match tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .log_internal_errors(false)
        .try_init()
    {
        Ok(()) => InitOutcome::Installed,
        Err(_) => InitOutcome::AlreadySet,
    }
}
