//! The `verbs` transport: one-sided RDMA READ over RC queue pairs — the data
//! plane for machines with an RDMA NIC (cargo feature `rdma`).
//!
//! # Why `sideway`, not `ibverbs`
//!
//! The design needs a one-sided READ with a remote address and an rkey. The
//! released `ibverbs` crate (0.9) only posts SEND and RECV — READ exists on
//! its unreleased master only — so this backend uses `sideway` 0.4.3, whose
//! work requests have `setup_read(rkey, remote_addr)`. `sideway` also builds
//! without `libibverbs-dev` (its `rdma-mummy-sys` loads `libibverbs.so.1` at
//! run time and answers `EOPNOTSUPP` when it is absent, so a binary built
//! with `rdma` still starts on a machine without RDMA and reports that
//! clearly). Never link both crates into one binary: both define the
//! `ibv_*` symbols. (Facts checked in `docs/verbs.md` of the shared notes.)
//!
//! # Layout
//!
//! - [`plan`] — always compiled, no `sideway` import: configuration and its
//!   clamping to device caps, MTU mapping, endpoint ↔ handshake metadata,
//!   rkey/region lookup, READ work-request planning (coalescing contiguous
//!   segments into chained WRs within the SGE and message-size limits), the
//!   RESET → INIT → RTR → RTS plan as data, completion tracking and the
//!   handshake offer table. Unit-tested in every build.
//! - `absent` — every build without feature `rdma`: the same
//!   `VerbsTransport` and `VerbsError` names, a transport type with no values
//!   whose `open` answers `VerbsError::NotBuilt`, so the node reads the same
//!   in every build.
//! - `device` — feature `rdma` (which `lib.rs` refuses under the simulator): `VerbsTransport`,
//!   which opens the device by name, registers the pinned pool once and turns
//!   the plans into verbs calls. Tests that need a device are `#[ignore]`d
//!   and named `verbs_hw_*`; `scripts/hw-rdma.sh` runs them.
//!
//! # Connecting queue pairs through the handshake
//!
//! An RC queue pair talks to exactly one peer QP, so both ends must learn
//! the other's QPN before either can move to RTR. The handshake is one round
//! trip started by the reader, and [`super::Transport::local_metadata`] has no
//! peer argument, so:
//!
//! 1. The reader's `local_metadata()` creates `qps_per_peer` fresh QPs
//!    (moved to INIT) and *offers* them: the metadata lists their QPNs and a
//!    fresh initial PSN, unique among pending offers. The offer waits in a
//!    bounded, expiring table ([`plan::OfferTable`]).
//! 2. The serving side answers with `VerbsTransport::accept(requester,
//!    offer)`: it creates one QP per offered QPN, connects each to its
//!    partner (INIT → RTR → RTS) and answers with its own QPNs and **the
//!    offer's PSN** (both directions of a pair start at that PSN, which the
//!    protocol allows). Its `local_metadata()` would be a fresh offer, not an
//!    answer: the serving side's `RdmaHandshake` handler (`crate::p2p`)
//!    answers through [`super::Transport::answer`], which this backend
//!    implements as `accept`.
//! 3. The reader's `connect(peer, answer)` finds its offer by the echoed PSN
//!    and connects its QPs to the answer's, index by index
//!    ([`plan::pair_qpns`]).
//!
//! The serving side is then passive: its NIC serves READs with no CPU work.
//!
//! # Access (C13) — what is and is not enforced
//!
//! The TCP transport checks every read against the transfer session it
//! names ([`super::DataSource`]). RDMA READ is served by the NIC, which only
//! checks that the request carries the rkey of a registered region and stays
//! inside it. This backend registers the whole pinned pool as one region, so
//! **a peer that completed a handshake can read any byte of the pool, with
//! or without a transfer session**; the session id passed to `read` is not
//! sent anywhere. What still holds: reads outside the registered arena fail
//! in the NIC (remote access error), a peer must pass our handshake (accept)
//! to get QPs at all, and transfer locks still pin the blocks a session
//! reads, so a well-behaved reader never sees memory being reused under it
//! (C11 on the serving side). Reads of unlocked memory can return bytes of
//! blocks being evicted or rewritten; the reader's seal-time checksums (C10)
//! catch that as a checksum failure, never as wrong accepted bytes.
//!
//! A production deployment that must not trust its peers would bind a
//! memory window (type 2, `ibv_bind_mw`) per transfer session over exactly
//! the locked blocks and send its rkey in the `QueryBlocksForTransfer`
//! answer, invalidating it on release or expiry; or register per-session
//! MRs (slow). Neither is done here.
//!
//! # Failures (the trait's contract)
//!
//! - Every WR is signaled; the batch owns the local extents (in a spawned
//!   task, so a cancelled `read` still waits for the NIC) and hands them back
//!   only when the hardware is done with every posted WR (C11).
//! - An error completion (or a failed post) moves the QP to the error state,
//!   drains the flushed WRs, destroys the QP and invalidates the peer: the
//!   affected extents fail with [`super::TransportError::Io`], the next
//!   `read` answers `NotConnected`, and the fetch degrades (C9) and
//!   handshakes again next time.
//! - A passed deadline fails the unfinished WRs with
//!   [`super::TransportError::Timeout`] and takes the same path; if the
//!   flush drain does not finish within
//!   [`crate::limits::VERBS_FLUSH_DRAIN_MS_MAX`], the QP is destroyed, which
//!   per the verbs semantics stops its DMA, before the extents are released.
//! - Startup errors of `VerbsTransport::open` are distinct values: no RDMA
//!   at all (`NoRdma`: the device list fails with `EOPNOTSUPP` without
//!   `libibverbs1`, `ENOSYS` without kernel support), no device
//!   (`NoDevices`: libibverbs lists none — the H200 machine), a wrong name
//!   (`DeviceNotFound`, listing the names present), an unusable port, a
//!   failed verbs call.

pub mod plan;

#[cfg(not(feature = "rdma"))]
mod absent;
#[cfg(feature = "rdma")]
mod device;

#[cfg(not(feature = "rdma"))]
pub use absent::{VerbsError, VerbsTransport};
#[cfg(feature = "rdma")]
pub use device::{VerbsError, VerbsStats, VerbsTransport, list_devices};
pub use plan::VerbsConfig;
