//! The `sim` transport backend: the [`tcp`](super::tcp) transport running over
//! madsim's simulated network, plus typed handles on the fault seam
//! ([`TcpHooks`]). Compiled in every build (it holds no simulator-only
//! code: the switches are plain atomics the TCP transport consults through
//! two `TcpHooks` methods, one per side); only the simulator uses it.
//!
//! Why not a separate implementation: under `--cfg madsim`, `tokio::net`
//! *is* madsim's simulated `TcpStream`/`TcpListener`, so the production
//! framing, pipelining, access checks (C13) and buffer hand-back (C11) run
//! unchanged. A second, simulator-only data plane would test itself, not the
//! code we ship. The node boots through [`crate::node::start`] exactly as in
//! production; this module only names the backend and gives the simulator
//! typed handles on the fault switches that live in [`TcpHooks`].
//!
//! # What it models
//! - One-sided READ of a peer's pool under a transfer session, over
//!   reliable, ordered simulated streams with simulated latency.
//! - **Peer death mid-read**: killing a simulated node drops its sockets; the
//!   reader sees end-of-stream, the affected extents complete with
//!   [`TransportError::Io`](super::TransportError::Io) and the connection is
//!   discarded (the next read redials).
//! - **Partitions and clogs**: opening a connection over a clogged link fails
//!   at once ([`TransportError::Connect`](super::TransportError::Connect));
//!   bytes on an established connection are delayed, not lost, so a clogged
//!   read ends at its deadline ([`TransportError::Timeout`](super::TransportError::Timeout)).
//! - **Completion errors** ([`inject_read_errors`]): the next N read ops fail
//!   as a connection reset mid-read would (the stream is dropped).
//! - **Slow reads** ([`set_read_delay`]): every read op waits before taking
//!   its response, counted against the read deadline.
//! - **Corruption on the wire** ([`corrupt_next_reads`], server side): one
//!   payload byte flipped; the fetcher's seal-time checksums must reject the
//!   block (C10).
//!
//! # What it rejects
//! Exactly what the TCP backend rejects: reads under an unknown or expired
//! session, ranges outside a block locked by the session (error frames, the
//! connection stays usable), malformed frames (error frame, connection
//! closed), local ranges outside their extent (`BadOp`, nothing sent).
//!
//! # What it does not model
//! RDMA semantics (memory registration, rkeys, queue-pair errors, DMA that
//! outlives a cancelled future): a cancelled TCP read simply stops writing
//! into the extent it owns. Bandwidth, partial writes and send-buffer limits
//! are not simulated (madsim buffers a write until flush and delivers it
//! whole).

use std::sync::atomic::Ordering;
use std::time::Duration;

pub use super::tcp::{TcpHooks, TcpTransport};

/// The simulator's transport: the TCP backend over madsim's network.
pub type SimTransport = TcpTransport;

/// Makes the next `n` read ops posted by `t` (as a reader) fail with an I/O
/// error, as if the connection reset mid-read.
pub fn inject_read_errors(t: &SimTransport, n: u64) {
    t.hooks.fail_next_reads.fetch_add(n, Ordering::SeqCst);
}

/// Delays every read op posted by `t` by `delay` (zero turns it off).
pub fn set_read_delay(t: &SimTransport, delay: Duration) {
    t.hooks.read_delay_ms.store(delay.as_millis() as u64, Ordering::SeqCst);
}

/// Flips one payload byte in each of the next `n` reads `t` serves.
pub fn corrupt_next_reads(t: &SimTransport, n: u64) {
    t.hooks.corrupt_next_reads.fetch_add(n, Ordering::SeqCst);
}
