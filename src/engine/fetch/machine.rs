//! The fetch as a sans-io state machine: every decision of a fetch (owner
//! choice, stitching, lock, which parts to read, verification verdicts,
//! sealing in prefix order, freeing, release) is made here, in
//! `step(event) → actions`, with no I/O, no clock and no memory of its own.
//! The async driver in [`super`] performs the actions (MetaServer query,
//! handshake, `QueryBlocksForTransfer`, pool allocation, transport reads,
//! CRC passes, seal + register, `ReleaseTransferLock`) and feeds back what
//! happened. The queue, the MetaServer store and the lock table follow the
//! same split; it lets a property test drive the real machine through every
//! interleaving of outcomes and a cancellation after every event
//! (`tests` below), which an async function cannot offer.
//!
//! Guarantees, each asserted by the property test:
//! - every transfer lock taken is released exactly once, on every path
//!   (completion, error, deadline, cancellation through [`FetchMachine::abandon`]) (C8);
//! - what the report counts as fetched is a contiguous prefix of the
//!   request, every block of it read successfully and verified against the
//!   checksums its owner advertised (C9, C10);
//! - a block whose checksum mismatches is rejected and nothing after it
//!   (from that owner) is kept;
//! - every block slot handed out by an allocation is sealed or freed
//!   exactly once, and never while a read or a CRC pass still uses it (C11).
//!
//! Indices: *request indices* index the caller's hash list; *plan indices*
//! index the blocks locked from the current owner (plan index 0 is request
//! index `base`, the verified prefix length when the lock was asked for).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::engine::layout::LayoutFamily;
use crate::status::RpcFailure;
use crate::transport::TransportError;
use crate::transport::handshake::HandshakeError;
use crate::types::{BlockHash, NodeAddr};

/// What the machine needs to know about the fetching node and its policy.
#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// This node (never chosen as an owner).
    pub me: NodeAddr,
    /// The local layout's family: an owner's blocks must be of it (C15).
    pub family: LayoutFamily,
    /// Bytes of one block in the pool.
    pub block_bytes: u64,
    /// Blocks per read part (≥ 1): the unit of pipelining and of loss on a
    /// failed read.
    pub part_blocks: usize,
    /// Reads in flight at once (≥ 1); CRC passes of completed parts run
    /// beside them.
    pub reads_in_flight: usize,
    /// Owners asked at most per fetch ([`crate::limits::FETCH_OWNERS_MAX`]).
    pub owners_max: usize,
    /// An owner that may be picked twice in one fetch: the owner of the
    /// caller's transfer ticket, whose first lock came from the ticket
    /// (expired, or granting less than the owner holds by then), so a
    /// lock RPC may still get what the ticket did not.
    pub retry_owner: Option<NodeAddr>,
}

/// A granted transfer lock: the session id and the blocks it pins, as the
/// owner described them.
#[derive(Debug, Clone)]
pub struct LockGrant {
    /// The transfer session (non-empty).
    pub session: String,
    /// The pinned blocks, in any order.
    pub blocks: Vec<LockedBlock>,
}

/// One block an owner pinned for this fetch, as the machine and its driver
/// use it (the driver converts the owner's wire answer into this, in one
/// place: [`super`]'s lock task).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockedBlock {
    /// The block's hash (matched against the request's).
    pub hash: BlockHash,
    /// Per layer, where the slot sits in the owner's pool and its checksum.
    pub slots: Vec<LockedSlot>,
    /// The block's index in the owner's device KV (C19), already checked
    /// against the owner's device layout; `None` when no device lease of
    /// this fetch's session covers it or the owner's description of it was
    /// refused (the block is read from the pool).
    pub device_block: Option<u64>,
}

impl LockedBlock {
    /// The owner's slot checksums, one per layer.
    pub fn slot_crcs(&self) -> Arc<[u32]> {
        self.slots.iter().map(|s| s.crc32c).collect()
    }
}

/// One layer's slot of a [`LockedBlock`] in the owner's pool. Offsets and
/// lengths in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LockedSlot {
    /// Offset of the slot's K (or whole) segment in the owner's pool.
    pub k_offset: u64,
    /// Bytes of K (or of the whole slot).
    pub k_len: u64,
    /// Offset of V in the owner's pool (meaningless when `v_len` is 0).
    pub v_offset: u64,
    /// Bytes of V; 0 for a single-segment slot.
    pub v_len: u64,
    /// CRC-32C of the slot's bytes (K then V) taken at seal time (C10).
    pub crc32c: u32,
}

/// What happened, fed to [`FetchMachine::step`].
#[derive(Debug)]
pub enum Event {
    /// Answer to [`Action::QueryOwners`]: `(owner, prefix length)` in the
    /// MetaServer's order, or why the query failed.
    Owners(Result<Vec<(NodeAddr, u32)>, RpcFailure>),
    /// Answer to the first [`Action::QueryOwners`] from the caller's own,
    /// possibly older, MetaServer answer (as `Owners`, lengths counted
    /// from `from`): the owner chosen from it is asked for every block
    /// left, since it may hold more by now, and owes only the length the
    /// answer gave ([`crate::engine::Engine::fetch_into_with_owners`]).
    KnownOwners(Vec<(NodeAddr, u32)>),
    /// Answer to [`Action::Handshake`].
    Handshake(Result<(), FetchError>),
    /// Answer to [`Action::Lock`]; a lock answered with an empty session is
    /// `Err(FetchError::Stale)`.
    Locked(Result<LockGrant, FetchError>),
    /// Answer to [`Action::Alloc`]: slots for the first `n` plan blocks
    /// (fewer than asked: the pool had no room).
    Allocated(usize),
    /// A read part completed: one result per block of the part.
    ReadDone {
        /// Part number.
        part: usize,
        /// Per block of the part, in order. Shorter than the part when the
        /// driver had no pool slot for the rest (a part expected to go
        /// straight into the engine's KV fell back while the pool was
        /// full): the fetch stops at the first of them with
        /// [`FetchError::NoSpace`], keeping the blocks before it.
        results: Vec<Result<(), TransportError>>,
    },
    /// A CRC pass of a part completed: per block, its slot checksums (`None`
    /// for a block whose read failed). Shorter than the part when the pass
    /// did not finish (the runtime is shutting down).
    Verified {
        /// Part number.
        part: usize,
        /// Per block of the part, in order.
        sums: Vec<Option<Arc<[u32]>>>,
    },
    /// [`Action::Release`] was handed off: the engine's driver feeds it at
    /// once and releases on a task of its own (a driver may also feed it
    /// once the RPC answered, failed or timed out; the owner's lock timeout
    /// covers a release that never arrives).
    Released,
    /// The fetch deadline passed.
    Deadline,
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Ask the MetaServer for owners of request indices `from..`.
    QueryOwners {
        /// First request index asked for.
        from: usize,
    },
    /// Make sure a handshake with `owner` happened (single-flight per peer).
    Handshake {
        /// The owner.
        owner: NodeAddr,
    },
    /// `QueryBlocksForTransfer` for request indices `blocks` at `owner`.
    Lock {
        /// The owner.
        owner: NodeAddr,
        /// Request indices.
        blocks: Range<usize>,
    },
    /// Allocate pool slots for plan blocks `0..blocks`, in order, stopping
    /// at the first that does not fit.
    Alloc {
        /// Blocks.
        blocks: usize,
    },
    /// Read plan blocks `blocks` (part `part`) into their slots.
    Read {
        /// Part number.
        part: usize,
        /// Plan indices.
        blocks: Range<usize>,
    },
    /// Checksum the slots of part `part` whose read succeeded (`read_ok`).
    Verify {
        /// Part number.
        part: usize,
        /// Plan indices.
        blocks: Range<usize>,
        /// Per block: its read succeeded.
        read_ok: Vec<bool>,
    },
    /// Seal plan blocks `blocks` with `sums` and register them as owned
    /// here, in one synchronous step (no eviction between the two).
    Seal {
        /// Plan indices.
        blocks: Range<usize>,
        /// The same blocks' request indices.
        hashes: Range<usize>,
        /// Per block, its verified slot checksums.
        sums: Vec<Arc<[u32]>>,
    },
    /// Return plan blocks' slots to the pool (never read, read but not
    /// kept, or rejected).
    Free {
        /// Plan indices.
        blocks: Range<usize>,
    },
    /// Plan block `block`'s checksums differ from the advertised ones (C10):
    /// count it.
    Rejected {
        /// Plan index.
        block: usize,
        /// Its request index.
        hash: usize,
    },
    /// Forget the peer's gRPC client (and, with `disconnect`, its data-plane
    /// connections): its state is unknown after a failure.
    ForgetPeer {
        /// The owner.
        owner: NodeAddr,
        /// Also drop transport connections.
        disconnect: bool,
    },
    /// `ReleaseTransferLock(session)` at `owner`. Emitted exactly once per
    /// granted lock; the driver runs it to completion even if the fetch is
    /// dropped meanwhile.
    Release {
        /// The owner.
        owner: NodeAddr,
        /// The session.
        session: String,
    },
    /// The fetch is over: [`FetchMachine::report`] is final and nothing is
    /// in flight that the driver must wait for (an RPC still pending may be
    /// dropped).
    Done,
}

/// Where a part of the current plan is.
#[derive(Debug, Clone)]
enum Part {
    /// Not read yet.
    Unread,
    /// A read is in flight.
    Reading,
    /// A CRC pass is in flight (the read results kept).
    Verifying(Vec<Result<(), TransportError>>),
    /// Judged: the first `good` blocks may be sealed; `bad` says why the
    /// rest may not.
    Judged { good: usize, sums: Vec<Arc<[u32]>>, bad: Option<FetchError> },
    /// Sealed and/or freed: its slots are back with their owner.
    Settled,
}

/// The blocks being read from one owner under one lock.
#[derive(Debug)]
struct Transfer {
    owner: NodeAddr,
    /// Request index of plan block 0.
    base: usize,
    /// Blocks this owner must deliver (it advertised them).
    asked: usize,
    plan: Vec<LockedBlock>,
    parts: Vec<(Range<usize>, Part)>,
    /// Parts before this one are settled; sealing continues here.
    next_settle: usize,
    /// Next part to read.
    next_read: usize,
    /// No more reads are started (a failed read, a rejected block, the
    /// deadline); unread parts are freed.
    halted: bool,
    /// The first part with a bad block (settled): nothing after it is kept.
    cut: Option<usize>,
    /// Why this owner's transfer stopped short, if it did.
    stop: Option<FetchError>,
}

#[derive(Debug)]
enum Stage {
    /// Waiting for the MetaServer's owners.
    Querying,
    /// Waiting for a handshake with the owner, who is asked for `ask`
    /// blocks and must deliver the first `promised` of them.
    Handshaking { owner: NodeAddr, ask: usize, promised: usize },
    /// Waiting for the lock.
    Locking { owner: NodeAddr, ask: usize, promised: usize },
    /// Waiting for slots.
    Allocating(Transfer),
    /// Reads and CRC passes in flight.
    Reading(Transfer),
    /// The release of the owner's lock was asked for; waiting for
    /// [`Event::Released`] (at once in the engine's driver).
    Releasing,
    /// Over.
    Done,
}

/// The fetch of one chained prefix: see the module doc.
#[derive(Debug)]
pub struct FetchMachine {
    cfg: MachineConfig,
    hashes: Vec<BlockHash>,
    rep: FetchReport,
    stage: Stage,
    /// A granted lock whose release has not been emitted yet.
    held: Option<(NodeAddr, String)>,
    deadline_passed: bool,
}

impl FetchMachine {
    /// A fetch of `hashes` of which the first `local` are already resident.
    /// Returns the machine and its first actions.
    pub fn start(cfg: MachineConfig, hashes: Vec<BlockHash>, local: usize) -> (Self, Vec<Action>) {
        let requested = hashes.len();
        let local = local.min(requested);
        let mut m = Self {
            cfg,
            hashes,
            rep: FetchReport { requested, available: local, local_hits: local, ..Default::default() },
            stage: Stage::Querying,
            held: None,
            deadline_passed: false,
        };
        let mut out = Vec::new();
        m.next_owner(&mut out);
        (m, out)
    }

    /// The report so far (final once [`Action::Done`] was emitted).
    pub fn report(&self) -> &FetchReport {
        &self.rep
    }

    /// The blocks locked from the current owner (plan indices), as it
    /// described them; empty outside a transfer.
    pub fn plan(&self) -> &[LockedBlock] {
        match &self.stage {
            Stage::Allocating(t) | Stage::Reading(t) => &t.plan,
            _ => &[],
        }
    }

    /// The request index of plan block 0 (the current transfer's base);
    /// `None` outside a transfer.
    pub fn plan_base(&self) -> Option<usize> {
        match &self.stage {
            Stage::Allocating(t) | Stage::Reading(t) => Some(t.base),
            _ => None,
        }
    }

    /// The owner and session of the granted lock being read under (until its
    /// release is emitted).
    pub fn transfer_session(&self) -> Option<(&NodeAddr, &str)> {
        self.held.as_ref().map(|(o, s)| (o, s.as_str()))
    }

    /// The fetch is being dropped: the actions that must still happen (at
    /// most one [`Action::Release`], for a granted lock whose release was
    /// not emitted yet). The slots the driver holds go back to the pool with
    /// it; slots inside a read in flight come back through the transport.
    pub fn abandon(&mut self) -> Vec<Action> {
        self.stage = Stage::Done;
        self.held.take().map(|(owner, session)| Action::Release { owner, session }).into_iter().collect()
    }

    /// Advances the machine by one event.
    pub fn step(&mut self, ev: Event) -> Vec<Action> {
        let mut out = Vec::new();
        let stage = std::mem::replace(&mut self.stage, Stage::Done);
        match (stage, ev) {
            (Stage::Done, _) => {}
            (Stage::Reading(t), Event::Deadline) => {
                // `pump` halts the reads and records why.
                self.deadline_passed = true;
                self.pump(t, &mut out);
            }
            (stage @ (Stage::Releasing | Stage::Allocating(_)), Event::Deadline) => {
                // The release is handed off (and runs under its own RPC
                // timeout); an allocation answers at once and `pump` then
                // sees the deadline.
                self.deadline_passed = true;
                self.stage = stage;
            }
            (_, Event::Deadline) => {
                // An RPC was pending (query, handshake, lock): give up on it.
                // A lock granted after this point expires at the owner.
                self.deadline_passed = true;
                self.rep.stopped = Some(FetchError::Deadline);
                self.finish(&mut out);
            }
            (Stage::Querying, Event::Owners(res)) => self.on_owners(res, false, &mut out),
            (Stage::Querying, Event::KnownOwners(list)) => self.on_owners(Ok(list), true, &mut out),
            (Stage::Handshaking { owner, ask, promised }, Event::Handshake(res)) => match res {
                Ok(()) => {
                    let from = self.rep.available;
                    out.push(Action::Lock { owner: owner.clone(), blocks: from..from + ask });
                    self.stage = Stage::Locking { owner, ask, promised };
                }
                Err(e) => {
                    out.push(Action::ForgetPeer { owner, disconnect: false });
                    self.rep.stopped = Some(e);
                    self.next_owner(&mut out);
                }
            },
            (Stage::Locking { owner, ask, promised }, Event::Locked(res)) => match res {
                Ok(grant) => self.on_locked(owner, ask, promised, grant, &mut out),
                Err(e) => {
                    if matches!(e, FetchError::Peer(_)) {
                        out.push(Action::ForgetPeer { owner, disconnect: false });
                    }
                    self.rep.stopped = Some(e);
                    self.next_owner(&mut out);
                }
            },
            (Stage::Allocating(mut t), Event::Allocated(n)) => {
                if n < t.plan.len() {
                    t.stop.get_or_insert(FetchError::NoSpace);
                    t.plan.truncate(n);
                }
                let per = self.cfg.part_blocks.max(1);
                t.parts =
                    (0..t.plan.len()).step_by(per).map(|s| (s..(s + per).min(t.plan.len()), Part::Unread)).collect();
                self.pump(t, &mut out);
            }
            (Stage::Reading(mut t), Event::ReadDone { part, results }) => {
                let past_cut = t.cut.is_some_and(|c| part > c);
                if let Some((blocks, p @ Part::Reading)) = t.parts.get_mut(part) {
                    if past_cut {
                        // Nothing after a rejected block is kept.
                        out.push(Action::Free { blocks: blocks.clone() });
                        *p = Part::Settled;
                    } else if self.deadline_passed {
                        // No checksum pass starts after the deadline: the
                        // part is not kept, nor anything after it (the
                        // parts before it are still sealed as they are
                        // judged; `pump` recorded the deadline as why).
                        out.push(Action::Free { blocks: blocks.clone() });
                        *p = Part::Settled;
                        t.cut = Some(part);
                    } else {
                        let read_ok: Vec<bool> =
                            (0..blocks.len()).map(|i| results.get(i).is_some_and(Result::is_ok)).collect();
                        if read_ok.iter().any(|ok| !ok) {
                            // Nothing after a failed read is read.
                            t.halted = true;
                        }
                        out.push(Action::Verify { part, blocks: blocks.clone(), read_ok });
                        *p = Part::Verifying(results);
                    }
                }
                self.pump(t, &mut out);
            }
            (Stage::Reading(mut t), Event::Verified { part, sums }) => {
                if let Some((blocks, p @ Part::Verifying(_))) = t.parts.get_mut(part) {
                    let Part::Verifying(results) = std::mem::replace(p, Part::Settled) else { unreachable!() };
                    let mut good = Vec::new();
                    let mut bad = None;
                    for (i, b) in blocks.clone().enumerate() {
                        match (results.get(i), sums.get(i)) {
                            (Some(Err(e)), _) => bad = Some(FetchError::Transport(e.clone())),
                            // No pool slot for this block (see `Event::ReadDone`).
                            (None, _) => bad = Some(FetchError::NoSpace),
                            (Some(Ok(())), Some(Some(s))) if as_advertised(s, &t.plan[b]) => {
                                good.push(s.clone());
                                continue;
                            }
                            (Some(Ok(())), Some(Some(_))) => {
                                out.push(Action::Rejected { block: b, hash: t.base + b });
                                bad = Some(FetchError::Checksum);
                            }
                            // The pass stopped at the deadline (or its
                            // runtime shut down) before this block.
                            _ if self.deadline_passed => bad = Some(FetchError::Deadline),
                            _ => {
                                bad = Some(FetchError::Transport(TransportError::io(
                                    std::io::ErrorKind::Interrupted,
                                    "checksum pass did not finish",
                                )))
                            }
                        }
                        break;
                    }
                    if bad.is_some() {
                        t.halted = true;
                    }
                    *p = Part::Judged { good: good.len(), sums: good, bad };
                }
                self.pump(t, &mut out);
            }
            (Stage::Releasing, Event::Released) => self.next_owner(&mut out),
            (stage, _) => {
                // An event this stage does not wait for (a driver bug):
                // ignore it rather than lose track of a lock.
                debug_assert!(false, "fetch machine: unexpected event in {stage:?}");
                self.stage = stage;
            }
        }
        out
    }

    /// `known`: the list is the caller's own answer ([`Event::KnownOwners`]).
    fn on_owners(&mut self, res: Result<Vec<(NodeAddr, u32)>, RpcFailure>, known: bool, out: &mut Vec<Action>) {
        let owners = match res {
            Ok(o) => o,
            Err(e) => {
                self.rep.stopped = Some(FetchError::MetaServer(e));
                return self.finish(out);
            }
        };
        let me = &self.cfg.me;
        let tried = &self.rep.owners;
        let retry =
            |n: &NodeAddr| self.cfg.retry_owner.as_ref() == Some(n) && tried.iter().filter(|t| *t == n).count() < 2;
        let pick = owners.into_iter().find(|(n, len)| n != me && *len > 0 && (!tried.contains(n) || retry(n)));
        let Some((owner, len)) = pick else {
            // Keep why the last owner stopped short (stale, checksum, …):
            // "no owner" only when none failed before.
            self.rep.stopped = Some(self.rep.stopped.take().unwrap_or(FetchError::NoOwner));
            return self.finish(out);
        };
        self.rep.owners.push(owner.clone());
        let rest = self.hashes.len() - self.rep.available;
        let promised = usize::try_from(len).unwrap_or(usize::MAX).min(rest);
        // The caller's answer may be older than the owner's registrations:
        // the owner is asked for everything left (it is asked once per
        // fetch) and owes only what the answer promised.
        let ask = if known { rest } else { promised };
        out.push(Action::Handshake { owner: owner.clone() });
        self.stage = Stage::Handshaking { owner, ask, promised };
    }

    /// `ask`: the blocks asked for; the first `promised` of them must all
    /// be granted (else the owner is stale), the rest are welcome.
    fn on_locked(&mut self, owner: NodeAddr, ask: usize, promised: usize, grant: LockGrant, out: &mut Vec<Action>) {
        self.held = Some((owner.clone(), grant.session));
        let base = self.rep.available;
        let mut plan = Vec::with_capacity(ask.min(grant.blocks.len()));
        let mut stop = None;
        // The owner answers in request order: each block is looked for at
        // the cursor first, and only an answer out of order builds an
        // index (a linear search per block was quadratic: ~130,000 hash
        // comparisons for a 511-block lock, outside every phase).
        let mut offered: Vec<Option<LockedBlock>> = grant.blocks.into_iter().map(Some).collect();
        let mut index: Option<HashMap<BlockHash, usize>> = None;
        let mut next = 0;
        for (i, h) in self.hashes[base..base + ask].iter().enumerate() {
            let at_cursor = offered.get(next).and_then(Option::as_ref).is_some_and(|b| b.hash == *h);
            let pos = if at_cursor {
                Some(next)
            } else {
                let index = index.get_or_insert_with(|| {
                    offered.iter().enumerate().filter_map(|(j, b)| Some((b.as_ref()?.hash.clone(), j))).collect()
                });
                index.get(h).copied().filter(|&j| offered[j].is_some())
            };
            let Some(b) = pos.and_then(|j| offered[j].take()) else {
                if i < promised {
                    stop = Some(FetchError::Stale);
                }
                break;
            };
            next = pos.map_or(next, |j| j + 1);
            if let Err(why) = check_shape_family(&self.cfg.family, &b) {
                stop = Some(FetchError::Shape(why));
                break;
            }
            plan.push(b);
        }
        let t = Transfer {
            owner,
            base,
            asked: promised,
            plan,
            parts: Vec::new(),
            next_settle: 0,
            next_read: 0,
            halted: false,
            cut: None,
            stop,
        };
        if t.plan.is_empty() {
            self.pump(t, out);
        } else {
            out.push(Action::Alloc { blocks: t.plan.len() });
            self.stage = Stage::Allocating(t);
        }
    }

    /// Seals judged parts in prefix order, frees what may not be kept,
    /// starts reads up to the window, and ends the transfer when nothing is
    /// in flight and every part is settled.
    fn pump(&mut self, mut t: Transfer, out: &mut Vec<Action>) {
        if self.deadline_passed && !t.halted {
            t.halted = true;
            t.stop.get_or_insert(FetchError::Deadline);
        }
        // Seal judged parts in order, up to the first part with a bad block
        // (or the first read that ended after the deadline).
        while t.cut.is_none_or(|c| t.next_settle < c) {
            let Some((blocks, part @ Part::Judged { .. })) = t.parts.get_mut(t.next_settle) else { break };
            let Part::Judged { good, sums, bad } = std::mem::replace(part, Part::Settled) else { unreachable!() };
            let blocks = blocks.clone();
            if good > 0 {
                let at = t.base + blocks.start;
                out.push(Action::Seal { blocks: blocks.start..blocks.start + good, hashes: at..at + good, sums });
                self.rep.available += good;
                self.rep.fetched += good;
                self.rep.bytes += good as u64 * self.cfg.block_bytes;
            }
            if good < blocks.len() {
                out.push(Action::Free { blocks: blocks.start + good..blocks.end });
            }
            if let Some(e) = bad {
                t.cut = Some(t.next_settle);
                t.stop = Some(e);
                t.halted = true;
            }
            t.next_settle += 1;
        }
        // Parts that will never be read, and judged parts past a cut.
        let cut = t.cut;
        for (i, (blocks, part)) in t.parts.iter_mut().enumerate() {
            let free = match part {
                Part::Unread => t.halted,
                Part::Judged { .. } => cut.is_some_and(|c| i > c),
                _ => false,
            };
            if free {
                out.push(Action::Free { blocks: blocks.clone() });
                *part = Part::Settled;
            }
        }
        if !t.halted {
            let in_flight = t.parts.iter().filter(|(_, p)| matches!(p, Part::Reading)).count();
            let mut room = self.cfg.reads_in_flight.max(1).saturating_sub(in_flight);
            while room > 0 && t.next_read < t.parts.len() {
                let i = t.next_read;
                out.push(Action::Read { part: i, blocks: t.parts[i].0.clone() });
                t.parts[i].1 = Part::Reading;
                t.next_read += 1;
                room -= 1;
            }
        }
        if !t.parts.iter().all(|(_, p)| matches!(p, Part::Settled)) {
            self.stage = Stage::Reading(t);
            return;
        }
        // The transfer is over: release the lock, then the next owner.
        let got = self.rep.available - t.base;
        let mut stop = t.stop;
        if got < t.asked && stop.is_none() {
            // The owner delivered fewer blocks than it advertised.
            stop = Some(FetchError::Stale);
        }
        if let Some(FetchError::Transport(e)) = &stop {
            if !matches!(e, TransportError::Refused { .. }) {
                // The connection state is unknown: start clean next time.
                out.push(Action::ForgetPeer { owner: t.owner.clone(), disconnect: true });
            }
        }
        let code = stop.as_ref().map(FetchError::code);
        tracing::debug!(owner = %t.owner, got, code, stop = ?stop, "fetch from owner");
        self.rep.stopped = stop;
        // C8 canary: an owner that delivered part of the blocks and then
        // failed on the transport is never sent its release.
        let skip_release = got > 0
            && matches!(self.rep.stopped, Some(FetchError::Transport(_)))
            && crate::canary::active(crate::canary::Canary::C8ReleaseSkippedAfterPartialRead);
        match self.held.take() {
            Some(_) if skip_release => self.next_owner(out),
            Some((owner, session)) => {
                out.push(Action::Release { owner, session });
                self.stage = Stage::Releasing;
            }
            None => self.next_owner(out),
        }
    }

    /// After an owner: ask for the next one, or end.
    fn next_owner(&mut self, out: &mut Vec<Action>) {
        if self.rep.available == self.hashes.len() {
            self.rep.stopped = None;
            return self.finish(out);
        }
        if self.deadline_passed {
            self.rep.stopped = Some(FetchError::Deadline);
            return self.finish(out);
        }
        if self.rep.owners.len() >= self.cfg.owners_max {
            self.rep.stopped = Some(FetchError::OwnersExhausted);
            return self.finish(out);
        }
        out.push(Action::QueryOwners { from: self.rep.available });
        self.stage = Stage::Querying;
    }

    fn finish(&mut self, out: &mut Vec<Action>) {
        if self.rep.available == self.rep.requested {
            self.rep.stopped = None;
        }
        if let Some((owner, session)) = self.held.take() {
            // Never reached (every path releases before it ends); should a
            // future path end holding a lock, it is still released once.
            debug_assert!(false, "fetch machine ended holding a lock");
            out.push(Action::Release { owner, session });
        }
        out.push(Action::Done);
        self.stage = Stage::Done;
    }
}

/// Whether a fetched block's slot checksums are the ones its owner advertised
/// for it (C10).
fn as_advertised(sums: &[u32], b: &LockedBlock) -> bool {
    sums.iter().copied().eq(b.slots.iter().map(|s| s.crc32c))
}

/// Why a peer RPC of a fetch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerFailure {
    /// No channel could be made for the owner's address (the channel
    /// library's text).
    #[error("bad peer endpoint: {0}")]
    Endpoint(String),
    /// The peer's channel was forgotten before the lock was asked for.
    #[error("no client for the owner")]
    NoClient,
    /// The lock RPC did not answer within the peer RPC timeout.
    #[error("lock rpc timed out")]
    Timeout,
    /// The lock RPC answered an error status.
    #[error(transparent)]
    Rpc(RpcFailure),
    /// The task running the lock RPC ended without an answer (runtime
    /// shutting down).
    #[error("lock task ended")]
    TaskEnded,
}

impl PeerFailure {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            PeerFailure::Endpoint(_) => "peer_endpoint",
            PeerFailure::NoClient => "peer_no_client",
            PeerFailure::Timeout => "peer_timeout",
            PeerFailure::Rpc(_) => "peer_rpc",
            PeerFailure::TaskEnded => "peer_task_ended",
        }
    }
}

/// Why the handshake with an owner failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeFailure {
    /// The handshake RPC answered an error status.
    #[error(transparent)]
    Rpc(RpcFailure),
    /// The owner answered with a not-ok status (its message).
    #[error("refused by the owner: {0}")]
    Refused(String),
    /// The owner's handshake metadata does not decode.
    #[error("owner's metadata: {0}")]
    Metadata(HandshakeError),
    /// This node's transport could not connect with the owner's metadata.
    #[error(transparent)]
    Transport(TransportError),
}

impl HandshakeFailure {
    /// The stable code of this cause (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            HandshakeFailure::Rpc(_) => "handshake_rpc",
            HandshakeFailure::Refused(_) => "handshake_refused",
            HandshakeFailure::Metadata(_) => "handshake_metadata",
            HandshakeFailure::Transport(_) => "handshake_transport",
        }
    }
}

/// A peer's block is not of the local layout's family (C15).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the owner's blocks are {owner}, this node's layout is {local}: the namespace names two different KV layouts (a \
     namespace must name one layout family, see kvferry::hash::KvFamily)"
)]
pub struct ShapeMismatch {
    /// The family the owner's block description has.
    pub owner: LayoutFamily,
    /// The local layout's family.
    pub local: LayoutFamily,
    /// Whether a split slot has K and V of different sizes (which no
    /// family describes).
    pub split_unequal: bool,
}

/// Why a fetch stopped short of `n`. Every variant carries a typed cause;
/// [`Self::code`] names it stably.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// The MetaServer query failed (down, partitioned, stalled).
    #[error("metaserver query failed: {0}")]
    MetaServer(RpcFailure),
    /// No owner (other than us) holds the next block.
    #[error("no remote owner for the next block")]
    NoOwner,
    /// A peer RPC failed.
    #[error("peer rpc failed: {0}")]
    Peer(PeerFailure),
    /// The handshake failed.
    #[error("handshake failed: {0}")]
    Handshake(HandshakeFailure),
    /// The owner no longer has the block (stale index entry).
    #[error("owner no longer holds the next block")]
    Stale,
    /// The read failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A slot's checksum did not match (C10).
    #[error("checksum mismatch in a fetched block")]
    Checksum,
    /// The peer described a block that does not fit our layout.
    #[error("peer block shape does not match the local layout: {0}")]
    Shape(ShapeMismatch),
    /// No room in the local pool.
    #[error("local pool has no room")]
    NoSpace,
    /// The namespace has no local layout.
    #[error("namespace has no local layout")]
    UnknownNamespace,
    /// The fetch deadline passed.
    #[error("fetch deadline passed")]
    Deadline,
    /// `FETCH_OWNERS_MAX` owners were tried.
    #[error("owner budget exhausted")]
    OwnersExhausted,
    /// No transport is installed.
    #[error("no transport installed")]
    NoTransport,
}

impl FetchError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            FetchError::MetaServer(_) => "fetch_metaserver",
            FetchError::NoOwner => "fetch_no_owner",
            FetchError::Peer(_) => "fetch_peer",
            FetchError::Handshake(_) => "fetch_handshake",
            FetchError::Stale => "fetch_stale",
            FetchError::Transport(_) => "fetch_transport",
            FetchError::Checksum => "fetch_checksum",
            FetchError::Shape(_) => "fetch_shape",
            FetchError::NoSpace => "fetch_no_space",
            FetchError::UnknownNamespace => "fetch_unknown_namespace",
            FetchError::Deadline => "fetch_deadline",
            FetchError::OwnersExhausted => "fetch_owners_exhausted",
            FetchError::NoTransport => "fetch_no_transport",
        }
    }
}

/// Outcome of [`Engine::fetch`](crate::engine::Engine::fetch): "k of n".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchReport {
    /// `n`: hashes asked for.
    pub requested: usize,
    /// `k`: the verified contiguous prefix now resident here (local hits
    /// included). The caller recomputes `requested - available` blocks.
    pub available: usize,
    /// Blocks that were already resident before the fetch.
    pub local_hits: usize,
    /// Blocks read from peers, verified and sealed here.
    pub fetched: usize,
    /// Bytes read for them.
    pub bytes: u64,
    /// Owners asked, in order.
    pub owners: Vec<NodeAddr>,
    /// Why it stopped short (None when `available == requested`).
    pub stopped: Option<FetchError>,
    /// Where the fetch's wall time went.
    pub phases: FetchPhases,
}

/// Where a fetch's wall time went, phase by phase (issue 17's handoff
/// split). The driver attributes every interval between two events to the
/// one phase that was blocking it: a read in flight counts as `read` even
/// while a CRC pass runs beside it, a CRC pass alone as `verify`, and so on;
/// `seal` is the synchronous bookkeeping (slot allocation, seal + register,
/// frees) and `read` includes issuing each read.
/// The phases therefore add up to the fetch's wall time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchPhases {
    /// Staging the disk-resident part of the local prefix into the pool
    /// and counting that prefix, before anything is asked of the
    /// MetaServer (without a disk tier, only the count: microseconds).
    pub stage: Duration,
    /// MetaServer `QueryPrefixBlocks`.
    pub query: Duration,
    /// Handshake with an owner (zero once the peer is known).
    pub handshake: Duration,
    /// `QueryBlocksForTransfer` (the transfer lock).
    pub lock: Duration,
    /// Data-plane reads in flight, and issuing them (a one-step part is
    /// planned and submitted on a task of its own, while the read is in
    /// flight).
    pub read: Duration,
    /// CRC-32C passes not hidden behind a read.
    pub verify: Duration,
    /// Slot allocation, seal and register, frees.
    pub seal: Duration,
    /// Handing `ReleaseTransferLock` to a task of its own: the RPC itself
    /// runs behind the rest of the fetch, so this is the spawn alone.
    pub release: Duration,
    /// [`Engine::fetch_into`](crate::engine::Engine::fetch_into) only: waiting for loads of sealed parts with
    /// nothing else in flight. In practice that is after the fetch ended:
    /// the loads of the last parts (loads of earlier parts run behind
    /// reads).
    pub load_tail: Duration,
}

impl FetchPhases {
    /// Sum of all phases (the fetch's wall time, up to rounding).
    pub fn total(&self) -> Duration {
        self.stage
            + self.query
            + self.handshake
            + self.lock
            + self.read
            + self.verify
            + self.seal
            + self.release
            + self.load_tail
    }

    /// `(name, duration)` for each phase, in handoff order.
    pub fn named(&self) -> [(&'static str, Duration); 9] {
        [
            ("stage", self.stage),
            ("query", self.query),
            ("handshake", self.handshake),
            ("lock", self.lock),
            ("read", self.read),
            ("verify", self.verify),
            ("seal", self.seal),
            ("release", self.release),
            ("load_tail", self.load_tail),
        ]
    }
}

/// Checks a peer's block description against the local layout's family:
/// the two must be of one [`LayoutFamily`] (per layer the segment count and
/// bytes), whatever buffers each side registered (C15).
pub(crate) fn check_shape_family(local: &LayoutFamily, b: &LockedBlock) -> Result<(), ShapeMismatch> {
    let shape = |s: &LockedSlot| (if s.v_len == 0 { 1 } else { 2 }, s.k_len);
    let split_unequal = b.slots.iter().any(|s| s.v_len != 0 && s.v_len != s.k_len);
    // Compared in place: the peer's family is only built for the error.
    let same = b.slots.len() == local.slots.len() && b.slots.iter().zip(&local.slots).all(|(s, l)| shape(s) == *l);
    if !same || split_unequal {
        let owner = LayoutFamily { slots: b.slots.iter().map(shape).collect() };
        return Err(ShapeMismatch { owner, local: local.clone(), split_unequal });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The real machine driven by a scripted world: every outcome of every
    //! action (RPC failures, partial grants, wrong shapes, short allocations,
    //! failed reads, corrupted checksums, deadlines) and every completion
    //! order of the reads and CRC passes in flight is drawn from a byte
    //! script, and the fetch is cancelled after an arbitrary event.
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    const SEG: u64 = 64;

    fn family() -> LayoutFamily {
        LayoutFamily { slots: vec![(2, SEG), (2, SEG)] }
    }

    fn hash(i: usize) -> BlockHash {
        BlockHash::new(vec![i as u8; 4])
    }

    /// The advertised checksums of request block `i` (what a correct read
    /// verifies to).
    fn sums(i: usize) -> Arc<[u32]> {
        Arc::from(vec![i as u32 * 7 + 1, i as u32 * 7 + 2])
    }

    fn info(i: usize, seg: u64) -> LockedBlock {
        let s = sums(i);
        let slot = |c: u32| LockedSlot { k_offset: 0, k_len: seg, v_offset: seg, v_len: seg, crc32c: c };
        LockedBlock { hash: hash(i), slots: vec![slot(s[0]), slot(s[1])], device_block: None }
    }

    /// Draws from the script; once it runs out every draw is "nothing goes
    /// wrong, first in line", so every run ends.
    struct Script<'a>(&'a [u8], usize);

    impl Script<'_> {
        fn next(&mut self) -> Option<u8> {
            let b = self.0.get(self.1).copied();
            self.1 += 1;
            b
        }
        /// True with probability about `pct` %.
        fn chance(&mut self, pct: u32) -> bool {
            self.next().is_some_and(|b| u32::from(b) * 100 < pct * 256)
        }
        fn below(&mut self, n: usize) -> usize {
            match self.next() {
                Some(b) if n > 0 => usize::from(b) % n,
                _ => 0,
            }
        }
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Slot {
        Held,
        InRead,
        InVerify,
        Sealed,
        Freed,
    }

    /// What the world checks while the machine runs.
    #[derive(Default)]
    struct World {
        grants: Vec<String>,
        releases: Vec<String>,
        /// Slot states of the current transfer, by plan index.
        slots: Vec<Slot>,
        /// Per plan index of the current transfer: read ok, verified sums correct.
        read_ok: HashMap<usize, bool>,
        corrupt: HashMap<usize, bool>,
        /// Request indices sealed, in order.
        sealed: Vec<usize>,
        rejected: usize,
        /// Completions in flight, with the slots they hand back and whether
        /// they are a CRC pass.
        pending: Vec<(Event, Vec<usize>, bool)>,
        /// Plan indices whose CRC pass came back.
        verified: std::collections::HashSet<usize>,
        lock_held: bool,
        sessions: usize,
        /// The first query was answered with the caller's own answer.
        known: bool,
    }

    /// Which paths a run took (to show the scripts reach them all).
    #[derive(Default, Debug)]
    struct Paths {
        sealed: usize,
        rejected: usize,
        cancelled_holding_a_lock: usize,
        deadline_mid_read: usize,
        read_done_after_deadline: usize,
        stitched: usize,
        completed: usize,
        from_known_owners: usize,
    }

    fn run(
        script: &[u8],
        n: usize,
        local: usize,
        part_blocks: usize,
        window: usize,
        cancel_after: Option<usize>,
    ) -> Paths {
        let mut paths = Paths::default();
        let mut s = Script(script, 0);
        let me = NodeAddr("me:1".into());
        let owners: Vec<NodeAddr> = (0..4).map(|i| NodeAddr(format!("owner{i}:1"))).collect();
        let cfg = MachineConfig {
            me: me.clone(),
            family: family(),
            block_bytes: 4 * SEG,
            part_blocks,
            reads_in_flight: window,
            owners_max: crate::limits::FETCH_OWNERS_MAX,
            // Half the runs: the first owner's lock may be retried (as a
            // ticket's owner is).
            retry_owner: n.is_multiple_of(2).then(|| owners[0].clone()),
        };
        let hashes: Vec<BlockHash> = (0..n).map(hash).collect();
        let (mut m, first) = FetchMachine::start(cfg, hashes, local);
        let mut w = World::default();
        let mut queue: std::collections::VecDeque<Action> = first.into();
        let mut events = 0usize;
        let mut done = false;
        let mut base = local;
        loop {
            while let Some(a) = queue.pop_front() {
                assert!(!done, "action {a:?} after Done");
                let ev = perform(&mut w, &mut s, &m, &owners, &me, &mut base, a, &mut done);
                if let Some(ev) = ev {
                    events += 1;
                    queue.extend(m.step(ev));
                }
            }
            if done {
                break;
            }
            if cancel_after.is_some_and(|c| events >= c) {
                paths.cancelled_holding_a_lock += usize::from(w.lock_held);
                for a in m.abandon() {
                    let Action::Release { session, .. } = a else { panic!("abandon emitted {a:?}") };
                    w.releases.push(session);
                }
                break;
            }
            // The next completion: a deadline now and then, else any pending
            // one; the slots a read or CRC pass had come back with it.
            let ev = if s.chance(3) {
                paths.deadline_mid_read += usize::from(matches!(m.stage, Stage::Reading(_)));
                Event::Deadline
            } else {
                assert!(!w.pending.is_empty(), "the machine waits with nothing in flight");
                let i = s.below(w.pending.len());
                let (ev, back, verified) = w.pending.swap_remove(i);
                if m.deadline_passed && matches!(ev, Event::ReadDone { .. }) && matches!(m.stage, Stage::Reading(_)) {
                    paths.read_done_after_deadline += 1;
                }
                if let Event::Locked(Ok(g)) = &ev {
                    // A grant counts once the fetcher learns of it; one
                    // still in flight at a deadline or cancel expires at
                    // the owner.
                    w.grants.push(g.session.clone());
                    w.lock_held = true;
                }
                for j in back {
                    w.slots[j] = Slot::Held;
                    if verified {
                        w.verified.insert(j);
                    }
                }
                ev
            };
            events += 1;
            queue.extend(m.step(ev));
        }
        // C8: exactly one release per lock taken, naming its session.
        let mut g = w.grants.clone();
        let mut r = w.releases.clone();
        g.sort();
        r.sort();
        assert_eq!(g, r, "locks granted vs released");
        // C9: what is reported fetched is the contiguous prefix sealed here.
        let rep = m.report();
        let expect: Vec<usize> = (local..rep.available).collect();
        assert_eq!(w.sealed, expect, "sealed blocks are not the reported contiguous prefix");
        assert_eq!(rep.fetched, rep.available - local);
        assert!(rep.available <= n);
        if done {
            // C11: every slot sealed or freed, exactly once (checked in
            // `perform`), none left held or in flight.
            assert!(w.slots.iter().all(|s| matches!(s, Slot::Sealed | Slot::Freed)), "slots left: {:?}", w.slots);
            assert!(rep.available == n || rep.stopped.is_some(), "short without a reason");
            paths.completed += usize::from(rep.available == n && rep.fetched > 0);
        }
        paths.sealed += w.sealed.len();
        paths.rejected += w.rejected;
        paths.stitched += usize::from(w.grants.len() > 1 && rep.fetched > 0);
        paths.from_known_owners += usize::from(w.known && rep.fetched > 0);
        paths
    }

    #[allow(clippy::too_many_arguments)]
    fn perform(
        w: &mut World,
        s: &mut Script<'_>,
        m: &FetchMachine,
        owners: &[NodeAddr],
        me: &NodeAddr,
        base: &mut usize,
        a: Action,
        done: &mut bool,
    ) -> Option<Event> {
        match a {
            Action::QueryOwners { from } => {
                let ev = if s.chance(10) {
                    Event::Owners(Err(RpcFailure::new(tonic::Code::Unavailable, "metaserver down")))
                } else {
                    let k = s.below(4);
                    let mut list = Vec::new();
                    if s.chance(30) {
                        list.push((me.clone(), 99));
                    }
                    for o in owners.iter().take(k + 1) {
                        list.push((o.clone(), s.below(9) as u32));
                    }
                    let _ = from;
                    if m.report().owners.is_empty() && s.chance(25) {
                        // The caller's own answer (`fetch_into_with_owners`).
                        w.known = true;
                        Event::KnownOwners(list)
                    } else {
                        Event::Owners(Ok(list))
                    }
                };
                w.pending.push((ev, Vec::new(), false));
                None
            }
            Action::Handshake { owner } => {
                assert_ne!(&owner, me, "chose itself as an owner");
                let res = if s.chance(10) {
                    Err(FetchError::Handshake(HandshakeFailure::Refused("refused".into())))
                } else {
                    Ok(())
                };
                w.pending.push((Event::Handshake(res), Vec::new(), false));
                None
            }
            Action::Lock { blocks, .. } => {
                assert!(!w.lock_held, "a second lock while one is held");
                assert!(
                    blocks.start == m.report().available && blocks.end <= m.report().requested && !blocks.is_empty()
                );
                let ev = match s.next().map_or(9, |b| b % 10) {
                    0 => Event::Locked(Err(FetchError::Peer(PeerFailure::Rpc(RpcFailure::new(
                        tonic::Code::Unavailable,
                        "down",
                    ))))),
                    1 => Event::Locked(Err(FetchError::Stale)),
                    _ => {
                        w.sessions += 1;
                        let session = format!("s{}", w.sessions);
                        // The owner pins the asked blocks it still has, in any order, maybe one of a wrong shape.
                        let mut pinned: Vec<LockedBlock> = Vec::new();
                        for i in blocks.clone() {
                            if !s.chance(10) {
                                pinned.push(info(i, if s.chance(3) { SEG / 2 } else { SEG }));
                            }
                        }
                        if pinned.len() > 1 && s.chance(50) {
                            let j = s.below(pinned.len());
                            pinned.swap(0, j);
                        }
                        Event::Locked(Ok(LockGrant { session, blocks: pinned }))
                    }
                };
                w.pending.push((ev, Vec::new(), false));
                None
            }
            Action::Alloc { blocks } => {
                *base = m.report().available;
                let got = if s.chance(10) { s.below(blocks + 1) } else { blocks };
                w.slots = vec![Slot::Held; got];
                w.read_ok.clear();
                w.corrupt.clear();
                w.verified.clear();
                Some(Event::Allocated(got))
            }
            Action::Read { part, blocks } => {
                let mut results = Vec::new();
                for i in blocks.clone() {
                    assert_eq!(w.slots[i], Slot::Held, "read into slot {i} that is {:?}", w.slots[i]);
                    w.slots[i] = Slot::InRead;
                    let ok = !s.chance(8);
                    w.read_ok.insert(i, ok);
                    results.push(if ok {
                        Ok(())
                    } else {
                        Err(TransportError::io(std::io::ErrorKind::ConnectionReset, "reset"))
                    });
                }
                w.pending.push((Event::ReadDone { part, results }, blocks.collect(), false));
                None
            }
            Action::Verify { part, blocks, read_ok } => {
                // C9: every step ends by the deadline; a CRC pass is not
                // started after it.
                assert!(!m.deadline_passed, "a checksum pass started after the deadline");
                let mut sums_out = Vec::new();
                for (k, i) in blocks.clone().enumerate() {
                    assert_eq!(w.slots[i], Slot::Held, "verify of slot {i} that is {:?}", w.slots[i]);
                    w.slots[i] = Slot::InVerify;
                    assert_eq!(read_ok[k], w.read_ok[&i]);
                    let corrupt = read_ok[k] && s.chance(8);
                    w.corrupt.insert(i, corrupt);
                    let good = sums(*base + i);
                    sums_out
                        .push(read_ok[k].then(|| if corrupt { Arc::from(vec![good[0] ^ 1, good[1]]) } else { good }));
                }
                if s.chance(3) {
                    sums_out.truncate(s.below(sums_out.len() + 1));
                }
                w.pending.push((Event::Verified { part, sums: sums_out }, blocks.collect(), true));
                None
            }
            Action::Seal { blocks, hashes, sums: got } => {
                assert_eq!(got.len(), blocks.len());
                assert_eq!(hashes, *base + blocks.start..*base + blocks.end);
                for (i, g) in blocks.zip(got) {
                    assert_eq!(w.slots[i], Slot::Held, "seal of slot {i} that is {:?}", w.slots[i]);
                    assert!(w.verified.contains(&i), "sealed block {i} before its CRC pass came back");
                    assert!(w.read_ok[&i] && !w.corrupt[&i], "sealed a failed or corrupted block {i}");
                    assert_eq!(*g, *sums(*base + i), "sealed with other checksums");
                    w.slots[i] = Slot::Sealed;
                    w.sealed.push(*base + i);
                }
                None
            }
            Action::Free { blocks } => {
                for i in blocks {
                    assert_eq!(
                        w.slots[i],
                        Slot::Held,
                        "free of slot {i} that is {:?} (in flight, or twice)",
                        w.slots[i]
                    );
                    w.slots[i] = Slot::Freed;
                }
                None
            }
            Action::Rejected { block, hash } => {
                assert_eq!(hash, *base + block);
                assert!(w.corrupt[&block], "rejected an intact block");
                w.rejected += 1;
                None
            }
            Action::ForgetPeer { .. } => None,
            Action::Release { session, .. } => {
                assert!(w.lock_held);
                w.lock_held = false;
                assert!(
                    w.slots.iter().all(|s| !matches!(s, Slot::InRead | Slot::InVerify)),
                    "released while a read or CRC pass is in flight: {:?}",
                    w.slots
                );
                w.releases.push(session);
                w.pending.push((Event::Released, Vec::new(), false));
                None
            }
            Action::Done => {
                *done = true;
                None
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Exactly one release per lock, a verified contiguous prefix, no
        /// slot freed twice or while in flight, every slot settled — under
        /// any outcomes, completion orders, deadlines and cancellation.
        #[test]
        fn fetch_machine_invariants(
            script in proptest::collection::vec(any::<u8>(), 0..400),
            n in 1usize..14,
            local in 0usize..4,
            part_blocks in 1usize..4,
            window in 1usize..4,
            cancel in proptest::option::of(0usize..60),
        ) {
            run(&script, n, local.min(n), part_blocks, window, cancel);
        }
    }

    /// The scripted world reaches every path the property is about (so the
    /// property cannot pass by never getting there).
    #[test]
    fn the_scripts_reach_every_path() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut total = Paths::default();
        for _ in 0..3000 {
            let script: Vec<u8> = (0..(rand() % 300)).map(|_| rand() as u8).collect();
            let n = 1 + (rand() % 13) as usize;
            let cancel = (rand() % 3 == 0).then(|| (rand() % 40) as usize);
            let p = run(
                &script,
                n,
                (rand() % 3) as usize % n,
                1 + (rand() % 3) as usize,
                1 + (rand() % 3) as usize,
                cancel,
            );
            total.sealed += p.sealed;
            total.rejected += p.rejected;
            total.cancelled_holding_a_lock += p.cancelled_holding_a_lock;
            total.deadline_mid_read += p.deadline_mid_read;
            total.read_done_after_deadline += p.read_done_after_deadline;
            total.stitched += p.stitched;
            total.from_known_owners += p.from_known_owners;
            total.completed += p.completed;
        }
        let t = &total;
        for (what, count) in [
            ("sealed", t.sealed),
            ("rejected", t.rejected),
            ("cancelled holding a lock", t.cancelled_holding_a_lock),
            ("deadline mid-read", t.deadline_mid_read),
            ("read done after the deadline", t.read_done_after_deadline),
            ("stitched from two owners", t.stitched),
            ("fetched from the caller's own answer", t.from_known_owners),
            ("completed", t.completed),
        ] {
            assert!(count > 0, "no run {what}: {t:?}");
        }
    }

    /// The scripted tests' machine: parts of 2 blocks, 2 in flight.
    fn two_by_two() -> MachineConfig {
        MachineConfig {
            me: NodeAddr("me:1".into()),
            family: family(),
            block_bytes: 4 * SEG,
            part_blocks: 2,
            reads_in_flight: 2,
            owners_max: 4,
            retry_owner: None,
        }
    }

    /// A corrupted block at a known position: everything before it is kept,
    /// it is rejected, nothing after it is kept, and the lock is released.
    #[test]
    fn a_corrupted_block_is_rejected_and_nothing_after_it_kept() {
        let cfg = two_by_two();
        let owner = NodeAddr("owner:1".into());
        let (mut m, a) = FetchMachine::start(cfg, (0..6).map(hash).collect(), 0);
        assert_eq!(a, vec![Action::QueryOwners { from: 0 }]);
        let a = m.step(Event::Owners(Ok(vec![(owner.clone(), 6)])));
        assert_eq!(a, vec![Action::Handshake { owner: owner.clone() }]);
        let a = m.step(Event::Handshake(Ok(())));
        assert_eq!(a, vec![Action::Lock { owner: owner.clone(), blocks: 0..6 }]);
        let grant = LockGrant { session: "s".into(), blocks: (0..6).map(|i| info(i, SEG)).collect() };
        assert_eq!(m.step(Event::Locked(Ok(grant))), vec![Action::Alloc { blocks: 6 }]);
        let a = m.step(Event::Allocated(6));
        assert_eq!(a, vec![Action::Read { part: 0, blocks: 0..2 }, Action::Read { part: 1, blocks: 2..4 }]);
        // Part 1 completes first; block 3 (second of part 1) arrives corrupted.
        let a = m.step(Event::ReadDone { part: 1, results: vec![Ok(()), Ok(())] });
        assert_eq!(
            a,
            vec![
                Action::Verify { part: 1, blocks: 2..4, read_ok: vec![true, true] },
                Action::Read { part: 2, blocks: 4..6 }
            ]
        );
        let bad: Arc<[u32]> = Arc::from(vec![0u32, 0]);
        let a = m.step(Event::Verified { part: 1, sums: vec![Some(sums(2)), Some(bad)] });
        assert_eq!(a, vec![Action::Rejected { block: 3, hash: 3 }], "nothing sealed before part 0 is judged");
        let a = m.step(Event::ReadDone { part: 0, results: vec![Ok(()), Ok(())] });
        assert_eq!(a, vec![Action::Verify { part: 0, blocks: 0..2, read_ok: vec![true, true] }]);
        let a = m.step(Event::Verified { part: 0, sums: vec![Some(sums(0)), Some(sums(1))] });
        assert_eq!(
            a,
            vec![
                Action::Seal { blocks: 0..2, hashes: 0..2, sums: vec![sums(0), sums(1)] },
                Action::Seal { blocks: 2..3, hashes: 2..3, sums: vec![sums(2)] },
                Action::Free { blocks: 3..4 },
            ]
        );
        // Part 2 was in flight: it comes back and is freed, then the release.
        let a = m.step(Event::ReadDone { part: 2, results: vec![Ok(()), Ok(())] });
        assert_eq!(a, vec![Action::Free { blocks: 4..6 }, Action::Release { owner, session: "s".into() }]);
        // The rest is asked of another owner; the MetaServer names only the
        // one already tried: the fetch ends, keeping why that owner stopped.
        assert_eq!(m.step(Event::Released), vec![Action::QueryOwners { from: 3 }]);
        assert_eq!(m.step(Event::Owners(Ok(vec![(NodeAddr("owner:1".into()), 3)]))), vec![Action::Done]);
        assert_eq!(m.report().available, 3);
        assert_eq!(m.report().stopped, Some(FetchError::Checksum));
    }

    /// The caller's own answer says the owner holds 2 blocks; by now it
    /// holds all 4: it is asked for all 4 and every one is kept (asked
    /// only for 2, the fetch would stop there: the MetaServer names the
    /// same owner again, which a fetch never asks twice). An owner that
    /// grants fewer than the answer promised is stale, as always.
    #[test]
    fn a_short_known_answer_asks_the_owner_for_everything_left() {
        let cfg = two_by_two();
        let owner = NodeAddr("owner:1".into());
        let (mut m, _) = FetchMachine::start(cfg.clone(), (0..4).map(hash).collect(), 0);
        m.step(Event::KnownOwners(vec![(owner.clone(), 2)]));
        let a = m.step(Event::Handshake(Ok(())));
        assert_eq!(a, vec![Action::Lock { owner: owner.clone(), blocks: 0..4 }]);
        let grant = LockGrant { session: "s".into(), blocks: (0..4).map(|i| info(i, SEG)).collect() };
        assert_eq!(m.step(Event::Locked(Ok(grant))), vec![Action::Alloc { blocks: 4 }]);
        m.step(Event::Allocated(4));
        m.step(Event::ReadDone { part: 0, results: vec![Ok(()), Ok(())] });
        m.step(Event::ReadDone { part: 1, results: vec![Ok(()), Ok(())] });
        m.step(Event::Verified { part: 0, sums: vec![Some(sums(0)), Some(sums(1))] });
        let a = m.step(Event::Verified { part: 1, sums: vec![Some(sums(2)), Some(sums(3))] });
        assert_eq!(a.last(), Some(&Action::Release { owner: owner.clone(), session: "s".into() }));
        assert_eq!(m.step(Event::Released), vec![Action::Done]);
        assert_eq!((m.report().available, m.report().stopped.clone()), (4, None));

        // It holds only the first block of the 2 promised: stale.
        let (mut m, _) = FetchMachine::start(cfg, (0..4).map(hash).collect(), 0);
        m.step(Event::KnownOwners(vec![(owner.clone(), 2)]));
        m.step(Event::Handshake(Ok(())));
        let grant = LockGrant { session: "s".into(), blocks: vec![info(0, SEG)] };
        assert_eq!(m.step(Event::Locked(Ok(grant))), vec![Action::Alloc { blocks: 1 }]);
        m.step(Event::Allocated(1));
        m.step(Event::ReadDone { part: 0, results: vec![Ok(())] });
        m.step(Event::Verified { part: 0, sums: vec![Some(sums(0))] });
        assert_eq!(m.step(Event::Released), vec![Action::QueryOwners { from: 1 }]);
        assert_eq!(m.step(Event::Owners(Ok(vec![(owner, 4)]))), vec![Action::Done]);
        assert_eq!((m.report().available, m.report().stopped.clone()), (1, Some(FetchError::Stale)));
    }

    /// A part whose read came back shorter than the part (the driver had
    /// no pool slot for its last block): the blocks read are judged and
    /// kept, nothing after is read, and the fetch stops with `NoSpace`.
    #[test]
    fn a_short_read_stops_the_fetch_with_no_space_keeping_the_blocks_before() {
        let cfg = two_by_two();
        let owner = NodeAddr("owner:1".into());
        let (mut m, _) = FetchMachine::start(cfg, (0..4).map(hash).collect(), 0);
        m.step(Event::Owners(Ok(vec![(owner.clone(), 4)])));
        m.step(Event::Handshake(Ok(())));
        let grant = LockGrant { session: "s".into(), blocks: (0..4).map(|i| info(i, SEG)).collect() };
        m.step(Event::Locked(Ok(grant)));
        let a = m.step(Event::Allocated(4));
        assert_eq!(a, vec![Action::Read { part: 0, blocks: 0..2 }, Action::Read { part: 1, blocks: 2..4 }]);
        let a = m.step(Event::ReadDone { part: 0, results: vec![Ok(())] });
        assert_eq!(a, vec![Action::Verify { part: 0, blocks: 0..2, read_ok: vec![true, false] }]);
        let a = m.step(Event::Verified { part: 0, sums: vec![Some(sums(0))] });
        assert_eq!(
            a,
            vec![Action::Seal { blocks: 0..1, hashes: 0..1, sums: vec![sums(0)] }, Action::Free { blocks: 1..2 }]
        );
        let a = m.step(Event::ReadDone { part: 1, results: vec![Ok(()), Ok(())] });
        assert_eq!(a, vec![Action::Free { blocks: 2..4 }, Action::Release { owner, session: "s".into() }]);
        m.step(Event::Released);
        assert_eq!((m.report().available, m.report().stopped.clone()), (1, Some(FetchError::NoSpace)));
    }

    /// The deadline passes with part 0 in its CRC pass and part 1 still
    /// reading, parts 2 unread: the unread part is freed at once; part 1's
    /// read, done after the deadline, gets no CRC pass (freed); part 0's
    /// pass, cut by the deadline after its first block, keeps that block
    /// only; the lock is released and the report says `Deadline`.
    #[test]
    fn the_deadline_cuts_reads_and_checksum_passes() {
        let cfg = two_by_two();
        let owner = NodeAddr("owner:1".into());
        let (mut m, _) = FetchMachine::start(cfg, (0..6).map(hash).collect(), 0);
        m.step(Event::Owners(Ok(vec![(owner.clone(), 6)])));
        m.step(Event::Handshake(Ok(())));
        let grant = LockGrant { session: "s".into(), blocks: (0..6).map(|i| info(i, SEG)).collect() };
        m.step(Event::Locked(Ok(grant)));
        let a = m.step(Event::Allocated(6));
        assert_eq!(a, vec![Action::Read { part: 0, blocks: 0..2 }, Action::Read { part: 1, blocks: 2..4 }]);
        let a = m.step(Event::ReadDone { part: 0, results: vec![Ok(()), Ok(())] });
        assert_eq!(
            a,
            vec![
                Action::Verify { part: 0, blocks: 0..2, read_ok: vec![true, true] },
                Action::Read { part: 2, blocks: 4..6 }
            ]
        );
        // Part 2's read is in flight too; the deadline frees nothing in
        // flight and starts nothing.
        assert_eq!(m.step(Event::Deadline), vec![]);
        let a = m.step(Event::ReadDone { part: 1, results: vec![Ok(()), Ok(())] });
        assert_eq!(a, vec![Action::Free { blocks: 2..4 }], "no CRC pass after the deadline");
        let a = m.step(Event::ReadDone { part: 2, results: vec![Ok(()), Ok(())] });
        assert_eq!(a, vec![Action::Free { blocks: 4..6 }]);
        // The CRC pass stopped at the deadline after block 0.
        let a = m.step(Event::Verified { part: 0, sums: vec![Some(sums(0))] });
        assert_eq!(
            a,
            vec![
                Action::Seal { blocks: 0..1, hashes: 0..1, sums: vec![sums(0)] },
                Action::Free { blocks: 1..2 },
                Action::Release { owner, session: "s".into() },
            ]
        );
        assert_eq!(m.step(Event::Released), vec![Action::Done]);
        assert_eq!((m.report().available, m.report().stopped.clone()), (1, Some(FetchError::Deadline)));
    }
}
