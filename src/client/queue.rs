//! The registration queue: a pure state machine (no runtime, no I/O).
//!
//! Producers ([`RegistrationQueue::offer`]) never block: a full queue drops
//! the command and counts it. One consumer (the client's driver task) takes
//! *everything* queued as one `Batch` ([`RegistrationQueue::take_batch`]),
//! nets insert/remove per `(namespace, hash)` last-write-wins, cuts the result
//! into chunks of at most `chunk_hashes_max` hashes per RPC, sends them and
//! reports each chunk's outcome ([`RegistrationQueue::complete_chunk`]).
//! Draining the whole backlog before any network call keeps flush latency
//! independent of the backlog (a lesson from the madsim prototype: per-item
//! RPCs let it grow without bound).
//!
//! Flush tickets implement the barrier of contract C1: a ticket taken at
//! sequence `s` resolves once every command with a smaller sequence has a
//! fate (delivered, or dropped after a failed attempt). Each ticket reports
//! the fates of the commands in its window — those offered after the previous
//! ticket and before it — as a [`FlushReport`] (C3).
//!
//! Accounting (C4): `offered == delivered + dropped + pending` holds after
//! every call; [`QueueCounters::identity_holds`] checks it.
//!
//! Idea sources: PegaFlow's fire-and-forget MetaServer client (batching,
//! 16,384-hash chunks, flush); the sans-io shape follows tikv/raft-rs.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use crate::types::BlockHash;

/// Insert ("this node owns H") or remove ("no longer").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Advertise ownership.
    Insert,
    /// Withdraw ownership.
    Remove,
}

/// Why a command was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// The queue was at `depth_max` when offered.
    QueueFull,
    /// The RPC failed (transport error, deadline, server unavailable).
    RpcFailed,
    /// The MetaServer permanently rejected the hash (invalid argument).
    Rejected,
    /// The client shut down before it was sent.
    Shutdown,
}

/// The outcome the driver reports for one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkOutcome {
    /// The MetaServer applied the chunk.
    Delivered,
    /// The chunk was given up on.
    Dropped(DropReason),
}

/// What a flush covered: fates of the commands in its window (C3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Commands that reached the MetaServer.
    pub delivered: u64,
    /// Commands dropped (queue full, failed RPC, rejected, shutdown).
    pub dropped: u64,
    /// True when the flush gave up at its deadline before every covered
    /// command had a fate (only from `flush_with_deadline`).
    pub timed_out: bool,
}

impl FlushReport {
    /// Adds another report's counts.
    pub fn merge(&mut self, other: FlushReport) {
        self.delivered += other.delivered;
        self.dropped += other.dropped;
        self.timed_out |= other.timed_out;
    }
}

/// Counters of the queue (C4). All counts are commands, not RPCs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueCounters {
    /// Every command offered (accepted or dropped at the door).
    pub offered: u64,
    /// Offered inserts / removes, split by op (accepted or not).
    pub offered_inserts: u64,
    /// Offered removes.
    pub offered_removes: u64,
    /// Delivered to the MetaServer.
    pub delivered: u64,
    /// Dropped because the queue was full.
    pub dropped_queue_full: u64,
    /// Removes among `dropped_queue_full`.
    pub dropped_queue_full_removes: u64,
    /// Dropped after a failed RPC.
    pub dropped_rpc_failed: u64,
    /// Dropped because the server rejected them.
    pub dropped_rejected: u64,
    /// Dropped at shutdown.
    pub dropped_shutdown: u64,
    /// Waiting in the queue or in the batch in flight.
    pub pending: u64,
    /// Chunks (RPCs) produced by batches, bisection halves included.
    pub chunks: u64,
}

impl QueueCounters {
    /// All drops, every reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_queue_full + self.dropped_rpc_failed + self.dropped_rejected + self.dropped_shutdown
    }

    /// `offered == delivered + dropped + pending` (C4).
    pub fn identity_holds(&self) -> bool {
        self.offered == self.delivered + self.dropped() + self.pending
    }
}

/// Queue configuration.
#[derive(Clone, Copy, Debug)]
pub struct QueueConfig {
    /// Most commands waiting (not counting the batch in flight).
    pub depth_max: usize,
    /// Most hashes per chunk (RPC).
    pub chunk_hashes_max: usize,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            depth_max: crate::limits::REGISTRATION_QUEUE_DEPTH_DEFAULT,
            chunk_hashes_max: crate::limits::HASHES_PER_REQUEST_MAX,
        }
    }
}

/// Identifies a flush ticket.
pub type TicketId = u64;
/// Identifies a chunk of the batch in flight.
pub type ChunkId = u64;

/// One RPC's worth of work: same namespace, same op, ≤ `chunk_hashes_max`
/// distinct hashes.
#[derive(Clone, Debug)]
pub struct Chunk {
    /// Chunk id, to report its outcome.
    pub id: ChunkId,
    /// Namespace of every hash.
    pub namespace: Arc<str>,
    /// Insert or remove.
    pub op: Op,
    /// Distinct hashes, in first-offered order.
    pub hashes: Vec<BlockHash>,
}

/// The commands netted into each hash of a chunk, as one flat list
/// (compressed rows): hash `j` covers `offsets[ends[j - 1]..ends[j]]`, with
/// `ends[-1]` read as 0. Two vectors per chunk instead of one per hash: a
/// 16,384-hash chunk costs two allocations, not 16,384.
#[derive(Debug, Default)]
struct Covers {
    /// Offsets (from the batch start) of the covered commands, grouped by
    /// hash in chunk order.
    offsets: Vec<u32>,
    /// End of each hash's group in `offsets`; one entry per hash.
    ends: Vec<u32>,
}

impl Covers {
    /// Splits off the rows of hashes `at..`, leaving `..at` in `self`.
    fn split_off(&mut self, at: usize) -> Covers {
        let cut = if at == 0 { 0 } else { self.ends[at - 1] };
        let offsets = self.offsets.split_off(cut as usize);
        let mut ends = self.ends.split_off(at);
        for e in &mut ends {
            *e -= cut;
        }
        Covers { offsets, ends }
    }
}

/// A chunk's hashes packed into one shared buffer: hash `j` is
/// `buf[ends[j - 1]..ends[j]]` (`ends[-1]` read as 0). The queue keeps this
/// form (one allocation, no reference count per hash) and hands out
/// [`BlockHash`]es that are slices of `buf`.
#[derive(Debug)]
struct Packed {
    buf: bytes::Bytes,
    ends: Vec<u32>,
}

impl Packed {
    fn new<'a>(hashes: impl Iterator<Item = &'a [u8]> + Clone) -> Self {
        let mut buf = bytes::BytesMut::with_capacity(hashes.clone().map(<[u8]>::len).sum());
        let ends = hashes
            .map(|h| {
                buf.extend_from_slice(h);
                u32_of(buf.len())
            })
            .collect();
        Packed { buf: buf.freeze(), ends }
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn start(&self, j: usize) -> u32 {
        if j == 0 { 0 } else { self.ends[j - 1] }
    }

    fn to_hashes(&self) -> Vec<BlockHash> {
        (0..self.len()).map(|j| BlockHash(self.buf.slice(self.start(j) as usize..self.ends[j] as usize))).collect()
    }

    /// Splits off hashes `at..`, leaving `..at` in `self`.
    fn split_off(&mut self, at: usize) -> Packed {
        let cut = self.start(at);
        let buf = self.buf.split_off(cut as usize);
        let mut ends = self.ends.split_off(at);
        for e in &mut ends {
            *e -= cut;
        }
        Packed { buf, ends }
    }
}

#[derive(Debug)]
struct ChunkState {
    namespace: Arc<str>,
    op: Op,
    hashes: Packed,
    /// For each hash of the chunk: offsets (from the batch start) of every
    /// command netted into it.
    covers: Covers,
}

/// The batch in flight: commands `[start_seq, end_seq)`.
#[derive(Debug)]
struct Batch {
    start_seq: u64,
    /// Fate of each command of the batch (None until its chunk completes).
    fates: Vec<Option<ChunkOutcome>>,
    open: HashMap<ChunkId, ChunkState>,
}

#[derive(Debug)]
struct Ticket {
    id: TicketId,
    window_start: u64,
    upto: u64,
    report: FlushReport,
}

/// A queued hash: 32-byte hashes (the common case) are copied inline, so an
/// offer touches neither an allocator nor the caller's reference count, and
/// netting compares them without chasing a pointer.
#[derive(Debug)]
enum QHash {
    B32([u8; 32]),
    Other(BlockHash),
}

impl QHash {
    fn new(h: &BlockHash) -> Self {
        match <[u8; 32]>::try_from(h.as_bytes()) {
            Ok(a) => QHash::B32(a),
            Err(_) => QHash::Other(h.clone()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            QHash::B32(a) => a,
            QHash::Other(h) => h.as_bytes(),
        }
    }
}

#[derive(Debug)]
struct Queued {
    namespace: Arc<str>,
    hash: QHash,
    op: Op,
}

/// One distinct `(namespace, hash)` of a batch after netting.
struct Netted {
    /// Index into the batch's namespace list.
    ns: u32,
    /// Offset of the first command with this key (its hash is taken from
    /// there).
    first: u32,
    /// Commands netted into this key.
    count: u32,
    /// The last command's op (last write wins).
    op: Op,
}

/// The registration queue state machine. See the module doc.
#[derive(Debug)]
pub struct RegistrationQueue {
    cfg: QueueConfig,
    pending: VecDeque<Queued>,
    /// Sequence number of `pending[0]`.
    pending_start: u64,
    next_seq: u64,
    batch: Option<Batch>,
    tickets: VecDeque<Ticket>,
    next_ticket: TicketId,
    next_chunk: ChunkId,
    /// Sequence where the next ticket's window starts.
    window_start: u64,
    /// Fates already known for the open window (commands offered since the
    /// newest ticket, door drops included); the next ticket takes them.
    open_window: FlushReport,
    counters: QueueCounters,
    closed: bool,
    /// Keyed hasher for netting (only the layout of scratch tables depends
    /// on it, never an output order).
    hasher: NetHasher,
}

impl RegistrationQueue {
    /// An empty queue.
    pub fn new(cfg: QueueConfig) -> Self {
        assert!(cfg.depth_max > 0 && cfg.chunk_hashes_max > 0, "queue bounds must be positive");
        assert!(u32::try_from(cfg.depth_max).is_ok(), "depth_max must fit batch offsets (u32)");
        Self {
            cfg,
            pending: VecDeque::new(),
            pending_start: 0,
            next_seq: 0,
            batch: None,
            tickets: VecDeque::new(),
            next_ticket: 0,
            next_chunk: 0,
            window_start: 0,
            open_window: FlushReport::default(),
            counters: QueueCounters::default(),
            closed: false,
            hasher: NetHasher::new(),
        }
    }

    /// Offers one command. Never blocks: returns `false` (and counts a
    /// `QueueFull` or `Shutdown` drop) when the queue is full or closed.
    pub fn offer(&mut self, namespace: &Arc<str>, hash: BlockHash, op: Op) -> bool {
        self.offer_ref(namespace, &hash, op)
    }

    /// [`RegistrationQueue::offer`] for each hash in order; returns how many
    /// were accepted. Same counting as one call per hash.
    pub fn offer_many(&mut self, namespace: &Arc<str>, hashes: &[BlockHash], op: Op) -> usize {
        let room = self.cfg.depth_max.saturating_sub(self.pending.len());
        self.pending.reserve(hashes.len().min(room));
        hashes.iter().filter(|h| self.offer_ref(namespace, h, op)).count()
    }

    fn offer_ref(&mut self, namespace: &Arc<str>, hash: &BlockHash, op: Op) -> bool {
        self.counters.offered += 1;
        match op {
            Op::Insert => self.counters.offered_inserts += 1,
            Op::Remove => self.counters.offered_removes += 1,
        }
        if self.closed {
            self.counters.dropped_shutdown += 1;
            self.open_window.dropped += 1;
            return false;
        }
        if self.pending.len() >= self.cfg.depth_max {
            self.counters.dropped_queue_full += 1;
            if op == Op::Remove {
                self.counters.dropped_queue_full_removes += 1;
            }
            self.open_window.dropped += 1;
            return false;
        }
        self.pending.push_back(Queued { namespace: namespace.clone(), hash: QHash::new(hash), op });
        self.next_seq += 1;
        self.counters.pending += 1;
        true
    }

    /// Commands an offer would still accept now (`depth_max` less those
    /// waiting); `None` once closed (every offer is dropped).
    pub fn room(&self) -> Option<usize> {
        (!self.closed).then(|| self.cfg.depth_max.saturating_sub(self.pending.len()))
    }

    /// Commands waiting (not counting the batch in flight).
    pub fn queued_len(&self) -> usize {
        self.pending.len()
    }

    /// True when a batch is in flight.
    pub fn batch_in_flight(&self) -> bool {
        self.batch.is_some()
    }

    /// True once [`RegistrationQueue::close`] ran.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Counter snapshot.
    pub fn counters(&self) -> QueueCounters {
        self.counters
    }

    /// Takes a flush ticket covering every command offered so far. Returns
    /// the report at once when nothing it covers is still pending (or the
    /// queue is closed); otherwise the ticket resolves later, out of
    /// [`RegistrationQueue::complete_chunk`] or [`RegistrationQueue::close`].
    pub fn flush(&mut self) -> Result<FlushReport, TicketId> {
        let t = Ticket {
            id: self.next_ticket,
            window_start: self.window_start,
            upto: self.next_seq,
            report: std::mem::take(&mut self.open_window),
        };
        self.next_ticket += 1;
        self.window_start = self.next_seq;
        if self.resolved_upto() >= t.upto {
            return Ok(t.report);
        }
        let id = t.id;
        self.tickets.push_back(t);
        Err(id)
    }

    /// Lowest sequence that has no fate yet (`next_seq` when none).
    fn resolved_upto(&self) -> u64 {
        if let Some(b) = &self.batch {
            b.start_seq
        } else if !self.pending.is_empty() {
            self.pending_start
        } else {
            self.next_seq
        }
    }

    /// Takes everything queued as one batch and returns its chunks, netted
    /// and cut. `None` when a batch is already in flight or nothing is
    /// queued. Chunks are ordered by namespace then op (removes first, so an
    /// eviction's withdrawal never trails a later re-advertisement of
    /// another key in the same RPC order).
    pub fn take_batch(&mut self) -> Option<Vec<Chunk>> {
        if self.batch.is_some() || self.pending.is_empty() {
            return None;
        }
        let start_seq = self.pending_start;
        // Work on the queue's own storage (no copy of the backlog); it is
        // cleared, capacity kept, at the end.
        let mut pending = std::mem::take(&mut self.pending);
        let cmds: &[Queued] = pending.make_contiguous();
        let n = cmds.len();
        self.pending_start = start_seq + n as u64;

        // Net: the last op per key wins. Keys are numbered in first-offered
        // order; `key_of` starts as "first command with my key" and is
        // rewritten in place to key numbers (a first command precedes its
        // duplicates, so its entry is already a key number when read).
        let (names, ns_of) = intern_namespaces(cmds);
        let mut key_of = first_of_key(cmds, &ns_of, &self.hasher);
        let mut keys: Vec<Netted> = Vec::with_capacity(n);
        for (i, c) in cmds.iter().enumerate() {
            let f = key_of[i] as usize;
            let k = if f == i {
                keys.push(Netted { ns: ns_of[i], first: u32_of(i), count: 0, op: c.op });
                u32_of(keys.len() - 1)
            } else {
                key_of[f]
            };
            let kn = &mut keys[k as usize];
            kn.count += 1;
            kn.op = c.op;
            key_of[i] = k;
        }
        drop(ns_of);

        // Commands covered by each key, grouped by key (counting sort). With
        // no duplicates key `k` covers exactly command `k`.
        let members: Option<(Vec<u32>, Vec<u32>)> = (keys.len() != n).then(|| {
            let mut starts = Vec::with_capacity(keys.len() + 1);
            starts.push(0u32);
            for kn in &keys {
                starts.push(starts.last().copied().unwrap_or(0) + kn.count);
            }
            let mut fill = starts.clone();
            let mut members = vec![0u32; n];
            for (i, &k) in key_of.iter().enumerate() {
                members[fill[k as usize] as usize] = u32_of(i);
                fill[k as usize] += 1;
            }
            (starts, members)
        });
        drop(key_of);

        // Group keys by (namespace, op) keeping first-offered order; group
        // `2 * ns + 1` holds inserts, `2 * ns` removes.
        let mut groups: Vec<Vec<u32>> = vec![Vec::new(); names.len() * 2];
        for (k, kn) in keys.iter().enumerate() {
            groups[kn.ns as usize * 2 + usize::from(kn.op == Op::Insert)].push(u32_of(k));
        }
        let mut order: Vec<usize> = (0..groups.len()).collect();
        order.sort_by(|&a, &b| (&*names[a / 2], a % 2).cmp(&(&*names[b / 2], b % 2)));

        let mut batch = Batch { start_seq, fates: vec![None; n], open: HashMap::new() };
        let mut out = Vec::new();
        for gi in order {
            let (ns, op) = (&names[gi / 2], if gi % 2 == 1 { Op::Insert } else { Op::Remove });
            for part in groups[gi].chunks(self.cfg.chunk_hashes_max) {
                let hashes = Packed::new(part.iter().map(|&k| cmds[keys[k as usize].first as usize].hash.as_bytes()));
                let mut covers =
                    Covers { offsets: Vec::with_capacity(part.len()), ends: Vec::with_capacity(part.len()) };
                for &k in part {
                    match &members {
                        None => covers.offsets.push(k),
                        Some((starts, members)) => covers
                            .offsets
                            .extend_from_slice(&members[starts[k as usize] as usize..starts[k as usize + 1] as usize]),
                    }
                    covers.ends.push(u32_of(covers.offsets.len()));
                }
                let st = ChunkState { namespace: ns.clone(), op, hashes, covers };
                let chunk = self.new_chunk(&st);
                batch.open.insert(chunk.id, st);
                out.push(chunk);
            }
        }
        pending.clear();
        self.pending = pending;
        self.batch = Some(batch);
        Some(out)
    }

    /// Numbers a new open chunk and returns its public form.
    fn new_chunk(&mut self, st: &ChunkState) -> Chunk {
        let id = self.next_chunk;
        self.next_chunk += 1;
        self.counters.chunks += 1;
        Chunk { id, namespace: st.namespace.clone(), op: st.op, hashes: st.hashes.to_hashes() }
    }

    /// Splits an open chunk in two halves (used to isolate a hash the server
    /// rejects). Returns the two new chunks, or `None` if the chunk is not
    /// open or has a single hash.
    pub fn split_chunk(&mut self, id: ChunkId) -> Option<(Chunk, Chunk)> {
        let mut a = self.batch.as_mut()?.open.remove(&id)?;
        if a.hashes.len() < 2 {
            self.batch.as_mut()?.open.insert(id, a);
            return None;
        }
        let mid = a.hashes.len() / 2;
        let b = ChunkState {
            namespace: a.namespace.clone(),
            op: a.op,
            hashes: a.hashes.split_off(mid),
            covers: a.covers.split_off(mid),
        };
        let (ca, cb) = (self.new_chunk(&a), self.new_chunk(&b));
        let batch = self.batch.as_mut()?;
        batch.open.insert(ca.id, a);
        batch.open.insert(cb.id, b);
        Some((ca, cb))
    }

    /// Records a chunk's outcome. When it was the batch's last open chunk,
    /// the batch completes and the tickets it satisfies are returned with
    /// their reports. Unknown chunk ids (e.g. after `close`) are ignored.
    pub fn complete_chunk(&mut self, id: ChunkId, outcome: ChunkOutcome) -> Vec<(TicketId, FlushReport)> {
        let Some(batch) = self.batch.as_mut() else { return Vec::new() };
        let Some(st) = batch.open.remove(&id) else { return Vec::new() };
        for &off in &st.covers.offsets {
            batch.fates[off as usize] = Some(outcome);
        }
        let n = st.covers.offsets.len() as u64;
        let open = !batch.open.is_empty();
        self.count_fates(outcome, n);
        if open {
            return Vec::new();
        }
        self.finish_batch()
    }

    fn finish_batch(&mut self) -> Vec<(TicketId, FlushReport)> {
        let Some(batch) = self.batch.take() else { return Vec::new() };
        // Credit each fate to the ticket whose window holds the command, or
        // to the open window when no ticket covers it yet. Tickets are
        // ordered by window and sequences ascend, so one cursor suffices.
        let mut ti = 0usize;
        for (off, fate) in batch.fates.iter().enumerate() {
            let seq = batch.start_seq + off as u64;
            // A command never reported (only possible via `close`) is a shutdown drop.
            let fate = fate.unwrap_or_else(|| {
                let f = ChunkOutcome::Dropped(DropReason::Shutdown);
                self.count_fates(f, 1);
                f
            });
            let delivered = fate == ChunkOutcome::Delivered;
            while ti < self.tickets.len() && self.tickets[ti].upto <= seq {
                ti += 1;
            }
            let report = match self.tickets.get_mut(ti) {
                Some(t) if t.window_start <= seq => &mut t.report,
                _ => &mut self.open_window,
            };
            if delivered {
                report.delivered += 1;
            } else {
                report.dropped += 1;
            }
        }
        self.resolve_tickets()
    }

    /// Moves `n` commands from pending to their fate's counter.
    fn count_fates(&mut self, outcome: ChunkOutcome, n: u64) {
        self.counters.pending -= n;
        let c = &mut self.counters;
        match outcome {
            ChunkOutcome::Delivered => c.delivered += n,
            ChunkOutcome::Dropped(DropReason::QueueFull) => c.dropped_queue_full += n,
            ChunkOutcome::Dropped(DropReason::RpcFailed) => c.dropped_rpc_failed += n,
            ChunkOutcome::Dropped(DropReason::Rejected) => c.dropped_rejected += n,
            ChunkOutcome::Dropped(DropReason::Shutdown) => c.dropped_shutdown += n,
        }
    }

    fn resolve_tickets(&mut self) -> Vec<(TicketId, FlushReport)> {
        let upto = self.resolved_upto();
        let mut done = Vec::new();
        while self.tickets.front().is_some_and(|t| t.upto <= upto) {
            let t = self.tickets.pop_front().expect("front checked");
            done.push((t.id, t.report));
        }
        done
    }

    /// Closes the queue (shutdown): every queued command and every open chunk
    /// is dropped with reason `Shutdown`, every ticket resolves now, and
    /// later flushes return at once.
    pub fn close(&mut self) -> Vec<(TicketId, FlushReport)> {
        self.closed = true;
        let mut done = Vec::new();
        if let Some(b) = self.batch.as_mut() {
            let ids: Vec<ChunkId> = b.open.keys().copied().collect();
            for id in ids {
                done.extend(self.complete_chunk(id, ChunkOutcome::Dropped(DropReason::Shutdown)));
            }
        }
        // Queued commands become one batch whose every chunk is dropped.
        if self.take_batch().is_some() {
            if let Some(b) = self.batch.as_mut() {
                b.open.clear();
            }
            done.extend(self.finish_batch());
        }
        done.extend(self.tickets.drain(..).map(|t| (t.id, t.report)));
        done
    }
}

/// `n` as a `u32`: batch offsets fit because a batch holds at most
/// `depth_max` commands, and a queue deeper than `u32::MAX` is refused.
fn u32_of(n: usize) -> u32 {
    u32::try_from(n).expect("batch offsets fit in u32 (depth_max <= u32::MAX)")
}

/// Interns a batch's namespaces (by content): the distinct names in
/// first-seen order and each command's index into them.
fn intern_namespaces(cmds: &[Queued]) -> (Vec<Arc<str>>, Vec<u32>) {
    let mut names: Vec<Arc<str>> = Vec::new();
    let mut ids: HashMap<Arc<str>, u32> = HashMap::new();
    let mut prev: Option<(&Arc<str>, u32)> = None;
    let ns_of = cmds
        .iter()
        .map(|c| match prev {
            // Producers offer many hashes under one `Arc`: skip the lookup.
            Some((p, id)) if Arc::ptr_eq(p, &c.namespace) => id,
            _ => {
                let id = *ids.entry(c.namespace.clone()).or_insert_with(|| {
                    names.push(c.namespace.clone());
                    u32_of(names.len() - 1)
                });
                prev = Some((&c.namespace, id));
                id
            }
        })
        .collect();
    (names, ns_of)
}

/// Keyed 64-bit hash of a netting key `(namespace index, hash bytes)`.
///
/// 32-byte hashes (the common case) take a folded-multiply hash of their four
/// words under random per-queue keys (the construction of foldhash/wyhash):
/// a few nanoseconds instead of SipHash's ~25. Other lengths use SipHash.
/// The value only places commands in scratch tables: a poor spread costs
/// probes, never a wrong netting, and no output order depends on it.
#[derive(Debug, Clone)]
struct NetHasher {
    keys: [u64; 5],
    fallback: RandomState,
}

impl NetHasher {
    fn new() -> Self {
        let fallback = RandomState::new();
        let mut keys = [0u64; 5];
        for (i, k) in keys.iter_mut().enumerate() {
            // Odd, so a multiply by it is a bijection.
            *k = fallback.hash_one(i) | 1;
        }
        Self { keys, fallback }
    }

    fn hash(&self, ns: u32, h: &QHash) -> u64 {
        fn fold(a: u64, b: u64) -> u64 {
            let r = u128::from(a) * u128::from(b);
            (r as u64) ^ ((r >> 64) as u64)
        }
        match h {
            QHash::B32(a) => {
                let w = |i: usize| u64::from_le_bytes(a[i * 8..i * 8 + 8].try_into().expect("8-byte word"));
                let k = &self.keys;
                let x = fold(w(0) ^ k[0], w(1) ^ k[1]) ^ fold(w(2) ^ k[2], w(3) ^ k[3]);
                fold(x ^ u64::from(ns), k[4])
            }
            QHash::Other(b) => self.fallback.hash_one((ns, b.as_bytes())),
        }
    }
}

/// Target keys per netting partition: its probe table (16 B a slot, two
/// slots a key) then stays within a core's L2 cache.
const NET_PARTITION_KEYS: usize = 2_048;

/// For each command, the offset of the first command of the batch with the
/// same `(namespace, hash)` (itself when it is the first).
///
/// One big hash table probed once per command is memory-bound: at a million
/// commands every probe misses cache and TLB, which measured ~0.8 µs a
/// command on a 2-core VM. Instead the commands' 64-bit keyed hashes are
/// radix-partitioned (one sequential scatter) into partitions of about
/// [`NET_PARTITION_KEYS`], each netted with a small linear-probing table
/// that stays in cache. Equal hashes are confirmed by comparing the keys,
/// so a hash collision costs a probe, never a wrong netting.
fn first_of_key(cmds: &[Queued], ns_of: &[u32], hasher: &NetHasher) -> Vec<u32> {
    let n = cmds.len();
    let hashes: Vec<u64> = cmds.iter().zip(ns_of).map(|(c, &ns)| hasher.hash(ns, &c.hash)).collect();
    // Partition by bits 32.. of the hash; slots are indexed by the low bits,
    // so the two never correlate.
    let parts = (n / NET_PARTITION_KEYS).max(1).next_power_of_two().min(1 << 16);
    let part_of = |h: u64| (h >> 32) as usize & (parts - 1);
    let mut starts = vec![0usize; parts + 1];
    for &h in &hashes {
        starts[part_of(h) + 1] += 1;
    }
    for p in 0..parts {
        starts[p + 1] += starts[p];
    }
    let mut fill = starts.clone();
    let mut scattered: Vec<(u64, u32)> = vec![(0, 0); n];
    for (i, &h) in hashes.iter().enumerate() {
        let p = part_of(h);
        scattered[fill[p]] = (h, u32_of(i));
        fill[p] += 1;
    }
    drop(hashes);
    let same_key = |a: u32, b: u32| {
        let (a, b) = (a as usize, b as usize);
        ns_of[a] == ns_of[b] && cmds[a].hash.as_bytes() == cmds[b].hash.as_bytes()
    };
    const EMPTY: u32 = u32::MAX;
    let mut first = vec![EMPTY; n];
    let mut table: Vec<(u64, u32)> = Vec::new();
    for p in 0..parts {
        let part = &scattered[starts[p]..starts[p + 1]];
        let size = (part.len() * 2).max(16).next_power_of_two();
        table.clear();
        table.resize(size, (0, EMPTY));
        for &(h, i) in part {
            let mut at = h as usize & (size - 1);
            // Terminates: the table is at most half full.
            loop {
                let (sh, si) = table[at];
                if si == EMPTY {
                    table[at] = (h, i);
                    first[i as usize] = i;
                    break;
                }
                if sh == h && same_key(si, i) {
                    // Within a partition commands ascend, so `si` came first.
                    first[i as usize] = si;
                    break;
                }
                at = (at + 1) & (size - 1);
            }
        }
    }
    first
}

/// Fuzz body: drives the queue with an arbitrary event sequence and checks
/// C1 (a resolved ticket covers only commands with a fate), C3 (its report
/// equals the fates of its window) and C4 (the accounting identity) after
/// every step, against a per-command reference model.
#[cfg(any(test, fuzzing))]
pub fn fuzz_registration_queue(data: &[u8]) {
    use arbitrary::Unstructured;
    let mut u = Unstructured::new(data);
    let depth_max = u.int_in_range(1..=8usize).unwrap_or(4);
    let chunk_hashes_max = u.int_in_range(1..=4usize).unwrap_or(2);
    let mut q = RegistrationQueue::new(QueueConfig { depth_max, chunk_hashes_max });
    let namespaces: [Arc<str>; 2] = [Arc::from("a"), Arc::from("b")];
    // Model: per sequence number, (key, op, fate). Door drops are tracked per window.
    let mut model: Vec<((usize, u64), Op, Option<bool>)> = Vec::new();
    let mut tickets: HashMap<TicketId, (u64, u64, u64)> = HashMap::new(); // id -> (window_start, upto, door_drops)
    let mut window_start = 0u64;
    let mut door_drops = 0u64;
    let mut open_chunks: Vec<Chunk> = Vec::new();
    let mut batch_start = 0u64;
    let mut batch_end = 0u64;
    let check = |q: &RegistrationQueue,
                 model: &Vec<((usize, u64), Op, Option<bool>)>,
                 id: TicketId,
                 rep: FlushReport,
                 t: (u64, u64, u64)| {
        let (ws, upto, dd) = t;
        let mut d = 0;
        let mut x = 0;
        for (seq, m) in model.iter().enumerate() {
            let seq = seq as u64;
            if seq < upto {
                assert!(m.2.is_some() || q.is_closed(), "ticket {id} resolved with seq {seq} unresolved (C1)");
            }
            if seq >= ws && seq < upto {
                match m.2 {
                    Some(true) => d += 1,
                    _ => x += 1,
                }
            }
        }
        assert_eq!(rep.delivered, d, "ticket {id} delivered count (C3)");
        assert_eq!(rep.dropped, x + dd, "ticket {id} dropped count (C3)");
    };
    for _ in 0..256 {
        let Ok(kind) = u.int_in_range(0..=6u8) else { break };
        let mut resolved: Vec<(TicketId, FlushReport)> = Vec::new();
        match kind {
            0 | 1 => {
                let ns = u.int_in_range(0..=1usize).unwrap_or(0);
                let h = u.int_in_range(0..=5u64).unwrap_or(0);
                let op = if u.arbitrary::<bool>().unwrap_or(false) { Op::Remove } else { Op::Insert };
                if q.offer(&namespaces[ns], BlockHash::from_u64(h), op) {
                    model.push(((ns, h), op, None));
                } else {
                    door_drops += 1;
                }
            }
            2 => match q.flush() {
                Ok(rep) => {
                    let t = (window_start, model.len() as u64, door_drops);
                    check(&q, &model, u64::MAX, rep, t);
                    window_start = model.len() as u64;
                    door_drops = 0;
                }
                Err(id) => {
                    tickets.insert(id, (window_start, model.len() as u64, door_drops));
                    window_start = model.len() as u64;
                    door_drops = 0;
                }
            },
            3 => {
                if let Some(chunks) = q.take_batch() {
                    batch_start = model.iter().position(|m| m.2.is_none()).unwrap_or(model.len()) as u64;
                    batch_end = model.len() as u64;
                    // Netting: each chunk hash carries the last op for its key in the batch.
                    for c in &chunks {
                        assert!(c.hashes.len() <= chunk_hashes_max);
                        let ns = namespaces.iter().position(|n| *n == c.namespace).expect("known ns");
                        for h in &c.hashes {
                            let id = u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"));
                            let last = model[batch_start as usize..batch_end as usize]
                                .iter()
                                .rev()
                                .find(|m| m.0 == (ns, id))
                                .expect("hash came from the batch");
                            assert_eq!(last.1, c.op, "last write wins");
                        }
                    }
                    open_chunks = chunks;
                }
            }
            4 | 5 => {
                if open_chunks.is_empty() {
                    continue;
                }
                let i = u.choose_index(open_chunks.len()).unwrap_or(0);
                let c = open_chunks.swap_remove(i);
                if kind == 5 && c.hashes.len() > 1 && u.arbitrary::<bool>().unwrap_or(false) {
                    let (a, b) = q.split_chunk(c.id).expect("open chunk splits");
                    open_chunks.push(a);
                    open_chunks.push(b);
                    continue;
                }
                let ok = kind == 4;
                let outcome = if ok { ChunkOutcome::Delivered } else { ChunkOutcome::Dropped(DropReason::RpcFailed) };
                let ns = namespaces.iter().position(|n| *n == c.namespace).expect("known ns");
                for h in &c.hashes {
                    let id = u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"));
                    for m in model[batch_start as usize..batch_end as usize].iter_mut() {
                        if m.0 == (ns, id) && m.2.is_none() {
                            m.2 = Some(ok);
                        }
                    }
                }
                resolved = q.complete_chunk(c.id, outcome);
            }
            _ => {
                if u.int_in_range(0..=7u8).unwrap_or(0) == 0 {
                    for m in model.iter_mut() {
                        if m.2.is_none() {
                            m.2 = Some(false);
                        }
                    }
                    open_chunks.clear();
                    resolved = q.close();
                }
            }
        }
        for (id, rep) in resolved {
            let t = tickets.remove(&id).expect("resolved ticket was issued");
            check(&q, &model, id, rep, t);
        }
        let c = q.counters();
        assert!(c.identity_holds(), "accounting identity (C4): {c:?}");
        let pending_model = model.iter().filter(|m| m.2.is_none()).count() as u64;
        assert_eq!(c.pending, pending_model, "pending count");
        assert!(q.queued_len() <= depth_max, "queue never grows past its bound");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    fn deliver_all(q: &mut RegistrationQueue) -> Vec<(TicketId, FlushReport)> {
        let mut out = Vec::new();
        while let Some(chunks) = q.take_batch() {
            for c in chunks {
                out.extend(q.complete_chunk(c.id, ChunkOutcome::Delivered));
            }
        }
        out
    }

    #[test]
    fn netting_is_last_write_wins() {
        let mut q = RegistrationQueue::new(QueueConfig::default());
        let a = ns("a");
        q.offer(&a, BlockHash::from_u64(1), Op::Insert);
        q.offer(&a, BlockHash::from_u64(1), Op::Remove);
        q.offer(&a, BlockHash::from_u64(2), Op::Remove);
        q.offer(&a, BlockHash::from_u64(2), Op::Insert);
        let chunks = q.take_batch().expect("batch");
        let removes: Vec<_> = chunks.iter().filter(|c| c.op == Op::Remove).flat_map(|c| c.hashes.clone()).collect();
        let inserts: Vec<_> = chunks.iter().filter(|c| c.op == Op::Insert).flat_map(|c| c.hashes.clone()).collect();
        assert_eq!(removes, vec![BlockHash::from_u64(1)]);
        assert_eq!(inserts, vec![BlockHash::from_u64(2)]);
    }

    #[test]
    fn chunking_exact_10x16384_plus_1() {
        let n = 10 * 16_384 + 1;
        let mut q = RegistrationQueue::new(QueueConfig { depth_max: n, chunk_hashes_max: 16_384 });
        let a = ns("a");
        for i in 0..n as u64 {
            assert!(q.offer(&a, BlockHash::from_u64(i), Op::Insert));
        }
        let chunks = q.take_batch().expect("batch");
        assert_eq!(chunks.len(), 11);
        let mut all: Vec<u64> = chunks
            .iter()
            .flat_map(|c| c.hashes.iter().map(|h| u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap())))
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..n as u64).collect::<Vec<_>>());
    }

    #[test]
    fn flush_waits_for_pending_and_reports_its_window() {
        let mut q = RegistrationQueue::new(QueueConfig::default());
        let a = ns("a");
        for i in 0..3 {
            q.offer(&a, BlockHash::from_u64(i), Op::Insert);
        }
        let t1 = q.flush().expect_err("pending");
        q.offer(&a, BlockHash::from_u64(9), Op::Insert);
        q.offer(&a, BlockHash::from_u64(10), Op::Insert);
        let t2 = q.flush().expect_err("pending");
        let done = deliver_all(&mut q);
        assert_eq!(
            done,
            vec![
                (t1, FlushReport { delivered: 3, dropped: 0, timed_out: false }),
                (t2, FlushReport { delivered: 2, dropped: 0, timed_out: false })
            ]
        );
        assert_eq!(q.flush(), Ok(FlushReport::default()));
    }

    #[test]
    fn full_queue_drops_and_counts() {
        let mut q = RegistrationQueue::new(QueueConfig { depth_max: 2, chunk_hashes_max: 8 });
        let a = ns("a");
        assert!(q.offer(&a, BlockHash::from_u64(1), Op::Insert));
        assert!(q.offer(&a, BlockHash::from_u64(2), Op::Insert));
        assert!(!q.offer(&a, BlockHash::from_u64(3), Op::Remove));
        let c = q.counters();
        assert_eq!((c.offered, c.pending, c.dropped_queue_full, c.dropped_queue_full_removes), (3, 2, 1, 1));
        assert!(c.identity_holds());
        let t = q.flush().expect_err("pending");
        let chunks = q.take_batch().unwrap();
        let done = q.complete_chunk(chunks[0].id, ChunkOutcome::Dropped(DropReason::RpcFailed));
        assert_eq!(done, vec![(t, FlushReport { delivered: 0, dropped: 3, timed_out: false })]);
        assert!(q.counters().identity_holds());
    }

    #[test]
    fn split_isolates_a_rejected_hash() {
        let mut q = RegistrationQueue::new(QueueConfig::default());
        let a = ns("a");
        for i in 0..5 {
            q.offer(&a, BlockHash::from_u64(i), Op::Insert);
        }
        let t = q.flush().expect_err("pending");
        let chunks = q.take_batch().unwrap();
        let mut work = vec![chunks[0].clone()];
        let poison = BlockHash::from_u64(3);
        let mut done = Vec::new();
        while let Some(c) = work.pop() {
            if c.hashes.contains(&poison) {
                match q.split_chunk(c.id) {
                    Some((l, r)) => {
                        work.push(l);
                        work.push(r);
                    }
                    None => done.extend(q.complete_chunk(c.id, ChunkOutcome::Dropped(DropReason::Rejected))),
                }
            } else {
                done.extend(q.complete_chunk(c.id, ChunkOutcome::Delivered));
            }
        }
        assert_eq!(done, vec![(t, FlushReport { delivered: 4, dropped: 1, timed_out: false })]);
        assert_eq!(q.counters().dropped_rejected, 1);
    }

    #[test]
    fn close_resolves_everything_and_later_flushes_return_at_once() {
        let mut q = RegistrationQueue::new(QueueConfig::default());
        let a = ns("a");
        q.offer(&a, BlockHash::from_u64(1), Op::Insert);
        let _chunks = q.take_batch().unwrap();
        q.offer(&a, BlockHash::from_u64(2), Op::Insert);
        let t = q.flush().expect_err("pending");
        let done = q.close();
        assert_eq!(done, vec![(t, FlushReport { delivered: 0, dropped: 2, timed_out: false })]);
        assert!(q.flush().is_ok());
        assert!(!q.offer(&a, BlockHash::from_u64(3), Op::Insert));
        let c = q.counters();
        assert!(c.identity_holds());
        assert_eq!(c.pending, 0);
    }

    /// Netting at a scale that uses many partitions, with duplicates,
    /// hashes of other lengths than 32 bytes and equal namespaces behind
    /// distinct `Arc`s, against a plain reference; then every command must
    /// be covered exactly once (split halves included).
    #[test]
    fn netting_at_scale_matches_reference() {
        let n = 40_000usize;
        let mut q = RegistrationQueue::new(QueueConfig { depth_max: n, chunk_hashes_max: 1_000 });
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut cmds = Vec::new();
        for _ in 0..n {
            let r = next();
            let ns = if r % 3 == 0 { ns("b") } else { ns("a") }; // a fresh Arc every time
            let id = (r >> 8) % 9_000;
            let hash = match id % 10 {
                0 => BlockHash::new(id.to_le_bytes().to_vec()),      // 8 bytes
                1 => BlockHash::new([id.to_le_bytes(); 6].concat()), // 48 bytes
                _ => BlockHash::from_u64(id),
            };
            let op = if (r >> 40) % 4 == 0 { Op::Remove } else { Op::Insert };
            assert!(q.offer(&ns, hash.clone(), op));
            cmds.push((ns, hash, op));
        }
        // Reference: last op per key; keys in first-offered order per group.
        let mut last: HashMap<(String, BlockHash), Op> = HashMap::new();
        let mut order: Vec<(String, BlockHash)> = Vec::new();
        for (ns, h, op) in &cmds {
            let key = (ns.to_string(), h.clone());
            if last.insert(key.clone(), *op).is_none() {
                order.push(key);
            }
        }
        let mut want: Vec<((String, bool), Vec<BlockHash>)> = Vec::new();
        for g in [("a", false), ("a", true), ("b", false), ("b", true)] {
            let op = if g.1 { Op::Insert } else { Op::Remove };
            let hs: Vec<BlockHash> =
                order.iter().filter(|k| k.0 == g.0 && last[*k] == op).map(|k| k.1.clone()).collect();
            want.push(((g.0.to_string(), g.1), hs));
        }
        let t = q.flush().expect_err("pending");
        let chunks = q.take_batch().expect("batch");
        let mut got: Vec<((String, bool), Vec<BlockHash>)> = Vec::new();
        for c in &chunks {
            let g = (c.namespace.to_string(), c.op == Op::Insert);
            match got.last_mut() {
                Some((lg, hs)) if *lg == g => hs.extend(c.hashes.iter().cloned()),
                _ => got.push((g, c.hashes.clone())),
            }
        }
        assert_eq!(got, want);
        // Split every other chunk once, deliver everything.
        let mut done = Vec::new();
        for (i, c) in chunks.into_iter().enumerate() {
            match (i % 2 == 0).then(|| q.split_chunk(c.id)).flatten() {
                Some((l, r)) => {
                    done.extend(q.complete_chunk(l.id, ChunkOutcome::Delivered));
                    done.extend(q.complete_chunk(r.id, ChunkOutcome::Dropped(DropReason::Rejected)));
                }
                None => done.extend(q.complete_chunk(c.id, ChunkOutcome::Delivered)),
            }
        }
        assert_eq!(done.len(), 1);
        let (id, rep) = done[0];
        assert_eq!(id, t);
        assert_eq!(rep.delivered + rep.dropped, n as u64, "every command covered once");
        let c = q.counters();
        assert!(c.identity_holds());
        assert_eq!(c.pending, 0);
        assert_eq!(c.dropped_rejected, rep.dropped);
    }

    /// A hasher that sends every 32-byte key to the same value: netting must
    /// still be exact (equal hashes are confirmed by comparing keys).
    #[test]
    fn netting_survives_total_hash_collisions() {
        let hasher = NetHasher { keys: [0; 5], fallback: RandomState::new() };
        let a = ns("a");
        let cmds: Vec<Queued> = (0..300u64)
            .map(|i| Queued { namespace: a.clone(), hash: QHash::new(&BlockHash::from_u64(i % 70)), op: Op::Insert })
            .collect();
        assert!(cmds.windows(2).all(|w| hasher.hash(0, &w[0].hash) == hasher.hash(0, &w[1].hash)));
        let first = first_of_key(&cmds, &vec![0; cmds.len()], &hasher);
        let want: Vec<u32> = (0..300u32).map(|i| i % 70).collect();
        assert_eq!(first, want);
    }

    #[test]
    fn fuzz_registration_queue_seeded() {
        crate::testing::run_fuzz_seeded("registration_queue", 4000, 512, fuzz_registration_queue);
    }
}
