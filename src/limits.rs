//! Every bound in one place, units last, with the reason for each number.
//!
//! A full queue drops and counts; it never grows past its bound (house
//! style 7). Per-request limits are enforced by the servers and respected by
//! the clients.

/// Largest block hash accepted anywhere (bytes). Real hashes are 32 bytes;
/// 64 leaves room for a 512-bit digest without letting a peer send megabytes.
pub const BLOCK_HASH_BYTES_MAX: usize = 64;

/// Largest namespace string (bytes): model/dtype/TP/block-size tags fit easily.
pub const NAMESPACE_BYTES_MAX: usize = 256;

/// Largest advertise address (bytes): a DNS name plus port.
pub const NODE_ADDR_BYTES_MAX: usize = 280;

/// Largest session id (bytes); the transfer-session ids we mint are exactly
/// this long (`engine::locks::session_id`: 64 hex characters).
pub const SESSION_ID_BYTES_MAX: usize = 64;

/// Most device buffers one GPU backend holds at once (C15). An engine
/// registers one buffer per K and per V tensor per layer — 2 × 128 layers
/// for the deepest models we know, times the models it serves — so 8192 is
/// generous; the bound keeps registration's overlap scan (linear in live
/// buffers) and the per-batch table snapshot small.
pub const DEVICE_BUFFERS_MAX: usize = 8192;

/// Required alignment (bytes) of a device buffer's first byte. Framework
/// allocators hand out 256- or 512-byte aligned tensors, and slices of them
/// at element granularity; 16 is what the CUDA copy kernel's vector accesses
/// need for their fast path and rules out a pointer that is plainly not a
/// tensor's (an odd address).
pub const DEVICE_BUFFER_ALIGN: u64 = 16;

/// Most hashes in one MetaServer insert/remove/query request, and the chunk
/// size the client sends (PegaFlow's batch size). At 32 B per hash a chunk is
/// ~0.6 MiB on the wire: far below the message limit, large enough to amortise
/// an RPC.
pub const HASHES_PER_REQUEST_MAX: usize = 16_384;

/// Default depth of the registration queue (commands). At ~24 blocks per
/// request a full queue is ~170 requests of backlog: enough to ride out a
/// short MetaServer stall, small enough that a dead MetaServer costs bounded
/// memory.
pub const REGISTRATION_QUEUE_DEPTH_DEFAULT: usize = 4096;

/// gRPC message limit (bytes), both directions, both services: transfer
/// responses for long prompts carry many slot descriptors.
pub const GRPC_MESSAGE_BYTES_MAX: usize = 64 << 20;

/// Largest transfer ticket a reader decodes (bytes): a lock answer's
/// limit, which a ticket carries ([`crate::engine::tickets`]).
pub const TICKET_BYTES_MAX: usize = GRPC_MESSAGE_BYTES_MAX;

/// Chunk RPCs of one batch group the client keeps in flight at once. Two
/// already hide one RPC's encode/transfer/decode behind the server's store
/// work on the previous chunk; four absorb scheduling jitter. Each in-flight
/// chunk holds ~0.6 MiB on each side, so this also bounds that memory.
pub const METASERVER_CHUNKS_IN_FLIGHT_MAX: usize = 4;

/// HTTP/2 stream flow-control window (bytes) of every gRPC client and
/// server. hyper's server default (1 MiB per stream and per connection)
/// holds fewer than two ~0.6 MiB registration chunks, so pipelined chunk
/// RPCs waited on WINDOW_UPDATE round trips (measured: ~12 % of T6 on 2
/// cores). A window is a limit on unread bytes, not an allocation.
pub const GRPC_STREAM_WINDOW_BYTES: u32 = 4 << 20;

/// HTTP/2 connection flow-control window (bytes): room for
/// `METASERVER_CHUNKS_IN_FLIGHT_MAX` full streams at once.
pub const GRPC_CONNECTION_WINDOW_BYTES: u32 = 16 << 20;

/// Default per-RPC deadline for MetaServer calls (ms). Loopback RPCs take
/// well under a millisecond; 2 s survives a loaded 2-core machine.
pub const METASERVER_RPC_TIMEOUT_MS_DEFAULT: u64 = 2_000;

/// Default `stale_after` (s): a node that missed heartbeats for this long is
/// invisible. Heartbeats go every `stale_after / 2`.
pub const STALE_AFTER_SECS_DEFAULT: u64 = 30;

/// Default TTL (s) after which the sweep deletes a silent node's records.
pub const NODE_TTL_SECS_DEFAULT: u64 = 120;

/// Default sweep interval (s).
pub const SWEEP_INTERVAL_SECS_DEFAULT: u64 = 10;

/// Bisection depth when the MetaServer rejects a chunk as invalid: log2 of
/// the chunk size, so one bad hash costs at most ~2·14 extra RPCs and never
/// takes its batch-mates down with it.
pub const REJECT_BISECT_DEPTH_MAX: u32 = 15;

/// Heartbeat retry backoff bounds (ms).
pub const HEARTBEAT_BACKOFF_MS_MIN: u64 = 100;
/// Upper bound of the heartbeat retry backoff (ms).
pub const HEARTBEAT_BACKOFF_MS_MAX: u64 = 5_000;

/// Default transfer-lock timeout (s): a requester that died mid-read pins
/// blocks for at most this long (plus one GC interval).
pub const TRANSFER_LOCK_TIMEOUT_SECS_DEFAULT: u32 = 30;

/// Default interval (ms) of the engine's own transfer-lock GC.
pub const TRANSFER_LOCK_GC_INTERVAL_MS_DEFAULT: u64 = 1_000;

/// Most transfer sessions one engine holds at once; beyond this
/// `QueryBlocksForTransfer` answers RESOURCE_EXHAUSTED instead of growing.
pub const TRANSFER_SESSIONS_MAX: usize = 65_536;

/// Most live device leases one engine holds (C19): a grant beyond this is
/// refused ([`crate::engine::leases::LeaseError::TooMany`]).
pub const DEVICE_LEASES_MAX: usize = 65_536;

/// Most lease ends queued for the engine to drain
/// ([`crate::engine::Engine::ended_device_leases`]); while this many wait,
/// new grants are refused (an end is never dropped).
pub const DEVICE_LEASES_ENDED_MAX: usize = 65_536;

/// Most blocks one device lease covers (one request's prefix: as many
/// hashes as one transfer request may name).
pub const DEVICE_LEASE_BLOCKS_MAX: usize = HASHES_PER_REQUEST_MAX;

/// Longest a device lease may live (ms): a reader that never comes keeps
/// the engine's blocks at most this long.
pub const DEVICE_LEASE_TTL_MS_MAX: u64 = 600_000;

/// A reader starts a device-direct copy only while at least this much of
/// its lease is left (ms), so a copy does not run into the lease's end;
/// otherwise it reads the owner's pool.
pub const DEVICE_LEASE_MARGIN_MS: u64 = 50;

/// Most exported device buffers one transfer answer names.
pub const DEVICE_EXPORTS_PER_ANSWER_MAX: usize = 4_096;

/// Most runs (one per layer and segment) in the device layout of one
/// transfer answer: two segments of each of at most 1,024 layers (the
/// layout module's `LAYERS_MAX`). A reader refuses a larger layout (and
/// reads the owner's pool) before walking it.
pub const DEVICE_LAYOUT_RUNS_MAX: usize = 2_048;

/// Most blocks an eviction pass inspects before giving up (bounded scan): a
/// pool full of pinned blocks fails an allocation fast instead of walking
/// millions of entries.
pub const EVICTION_SCAN_MAX: usize = 4_096;

/// Copy ops (contiguous runs) in the first copy batch a save or load
/// submits; later batches double up to [`COPY_BATCH_OPS_MAX`]. Cutting a
/// large save or load into batches submitted as they are built lets the
/// device copy while the engine and the backend still prepare the rest
/// (preparing costs per op); the first batch is small so the device starts
/// within microseconds.
pub const COPY_BATCH_OPS_FIRST: usize = 512;

/// Most copy ops in one batch (a single block with more is one batch).
pub const COPY_BATCH_OPS_MAX: usize = 8_192;

/// Bytes in the first copy batch (the limit that cuts contiguous layouts,
/// whose blocks are one op each); later batches double up to
/// [`COPY_BATCH_BYTES_MAX`].
pub const COPY_BATCH_BYTES_FIRST: u64 = 32 << 20;

/// Most bytes in one copy batch (a single larger block is one batch).
pub const COPY_BATCH_BYTES_MAX: u64 = 1 << 30;

/// Bytes of copies below which the `host` GPU backend runs a batch on the
/// calling thread alone; larger batches are split by host extent over up to
/// [`HOST_COPY_THREADS_MAX`] OS threads (outside the simulator), each
/// getting at least this many bytes. A thread costs tens of µs to start;
/// 8 MiB of copies take ~1 ms on one core.
pub const HOST_COPY_BYTES_PER_THREAD_MIN: u64 = 8 << 20;

/// Most OS threads one `host` backend batch is split over (count).
pub const HOST_COPY_THREADS_MAX: usize = 8;

/// Bytes the `host` backend copies before checksumming them, when a save
/// asks for slot checksums: the piece is checksummed right after its copy,
/// while it is still in the core's cache (64 KiB fits L2 with room to
/// spare), so the pool bytes are not read back from memory.
pub const HOST_COPY_CHECKSUM_PIECE_BYTES: u64 = 64 << 10;

/// Largest raw loopback socket copy `kvferry pd` times at start-up as T8's
/// baseline (bytes): the copy moves a fetch's bytes (the longest request's
/// blocks) between buffers of that size, so it allocates twice this much
/// for a moment.
pub const PD_RAW_COPY_BYTES_MAX: u64 = 1 << 30;

/// Smallest raw loopback copy `kvferry pd` times (bytes): below this the
/// copy is mostly connection set-up, not throughput.
pub const PD_RAW_COPY_BYTES_MIN: u64 = 8 << 20;

/// Longest `kvferry pd` waits for one decode engine's start-up connection
/// to one prefill engine (`Engine::connect_peer`: handshake and, on one
/// host, opening the prefill's shared pool; an 8 GiB pool takes ≈ 0.5 s
/// to register on the H200).
pub const PD_CONNECT_PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Longest `kvferry pd` waits, after the replay, for each node's disk tier
/// to finish its queued writes before the report takes the tiers' figures.
pub const PD_SSD_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The first pause of `Engine::connect_peer` before it tries a handshake
/// that failed because the peer is not up yet; the pause doubles up to
/// [`CONNECT_PEER_RETRY_MAX`] and shrinks to half the time left near the
/// timeout, so the last try comes within this of it.
pub const CONNECT_PEER_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(50);

/// The longest pause of `Engine::connect_peer` between handshake tries.
pub const CONNECT_PEER_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// Raw loopback copies `kvferry pd` times at start-up (count); the
/// fastest is T8's baseline, which makes T8 conservative.
pub const PD_RAW_COPY_REPS: usize = 3;

/// Fewest bytes a request's decode-side fetch must move for `kvferry pd` to
/// compute its T8 (bytes): smaller handoffs are dominated by fixed costs
/// (barriers, RPCs), not by the wire.
pub const PD_T8_FETCH_BYTES_MIN: u64 = 1 << 20;

/// Largest data-plane read (bytes) one TCP frame may ask for. A 16-token
/// Qwen3-8B block is 2.25 MiB; 64 MiB leaves room for 512-token blocks of
/// small models while bounding the server's per-request buffer.
pub const TCP_READ_BYTES_MAX: u64 = 64 << 20;

/// Reads in flight per TCP connection (pipelining depth).
pub const TCP_PIPELINE_DEPTH: usize = 32;

/// TCP connections a reader keeps at most per peer (the pool its reads are
/// spread over; opened on first use). One read batch uses as many of them as
/// its bytes need ([`TCP_CONNECTION_SHARE_BYTES_MIN`] each), idle ones
/// first, so parts in flight together use the whole pool. On a 16-core H200
/// host (2026-12-02, `bench transport`, 512 MiB in 8 MiB blocks) the fetch
/// reached 8.7 GB/s with 4 connections, 11.5-14.3 with 8 and 15.3-15.5 with
/// 16, against a best plain loopback copy of 21.4-22.1 GB/s (16
/// connections); on the 2-core box every count is within noise.
pub const TCP_CONNECTIONS_PER_PEER_DEFAULT: usize = 16;

/// Largest per-peer connection pool a node may be configured with
/// (`NodeConfig::tcp_connections_per_peer`).
pub const TCP_CONNECTIONS_PER_PEER_MAX: usize = 16;

/// Smallest share of a read batch (bytes) worth a connection of its own: a
/// batch of `b` bytes uses `ceil(b / this)` connections, at most the pool.
pub const TCP_CONNECTION_SHARE_BYTES_MIN: u64 = 4 << 20;

/// Connection counts the raw loopback copy (T4's and T8's baseline) tries;
/// the fastest is the baseline.
pub const TCP_RAW_COPY_CONNECTIONS: [usize; 5] = [1, 2, 4, 8, 16];

/// Data-plane connections the TCP transport's server accepts from one peer
/// IP at once. A host runs up to 8 engines (one per GPU), each pooling up to
/// `TCP_CONNECTIONS_PER_PEER_DEFAULT` (16) connections to us: 128 in steady
/// state; 2x headroom covers pooled connections being replaced (a dead one
/// is redialled before the server has reaped it) and loopback clusters
/// (`kvferry pd`, tests) where every node shares 127.0.0.1. Beyond it a new
/// connection gets an error frame and is closed (counted): one host cannot
/// take every connection slot.
pub const TCP_SERVER_CONNECTIONS_PER_IP_MAX: usize = 256;

/// Data-plane connections the TCP transport's server accepts in total at
/// once. Each open connection holds a task, a 64 KiB request buffer at most
/// and one file descriptor; 1024 is 8 hosts of 8 engines with full pools in
/// steady state (readers open connections only as their batches need them).
/// The process needs an open-files limit above it plus the node's gRPC
/// server, MetaServer channel and outbound connections (the common soft
/// limit of 1024 is too low for a node serving that many; raise `nofile`).
pub const TCP_SERVER_CONNECTIONS_MAX: usize = 1024;

/// Pause after a failed accept (e.g. out of file descriptors) before an
/// accept loop tries again, so it does not spin while the condition lasts
/// (ms). Both the data-plane server and the MetaServer's I/O-thread
/// acceptor use it.
pub const ACCEPT_RETRY_MS: u64 = 10;

/// Refusals (error frame, then close) the TCP server has in flight at once;
/// connections refused beyond it are closed without the frame, so a flood of
/// connects costs no more than this many short tasks.
pub const TCP_SERVER_REFUSALS_IN_FLIGHT_MAX: usize = 16;

/// How long a refusal may take to write its error frame and close cleanly
/// (ms); then the connection is dropped whatever its state.
pub const TCP_SERVER_REFUSAL_WRITE_MS: u64 = 200;

/// Default of `EngineConfig::fetch_read_part_bytes`: bytes of blocks a
/// fetch reads per transport call. Each part is
/// checksummed while the next one is read (so the CRC pass overlaps the
/// wire instead of following it), and a part costs one round trip of
/// pipeline refill per connection (≈ 0.1 ms on loopback against ≈ 12 ms
/// for 64 MiB at 5 GB/s).
pub const FETCH_READ_PART_BYTES: u64 = 64 << 20;
/// Smallest read part a fetch cuts itself into (bytes of blocks), when it
/// spreads a small fetch over its parts in flight: each part costs a
/// pipeline refill per connection and a completion hand-off, so parts stay
/// at least this large. 1 MiB was the best of the sizes tried (dev box,
/// tiny model, one run each: T8 p50 1.85 with 1 MiB parts, 2.09 with 2 MiB,
/// 2.54 with 4 MiB, 2.67 with one 64 MiB part); smaller ones were not
/// measured.
pub const FETCH_READ_PART_BYTES_MIN: u64 = 1 << 20;
/// Read parts a fetch keeps in flight by default
/// (`EngineConfig::fetch_reads_in_flight`), each spread over the transport's
/// connections, while completed parts are checksummed. On the H200 host,
/// with the TCP transport receiving each connection's share on a task of its
/// own (`kvferry pd --gpu cuda --model qwen3-8b --concurrency 1`,
/// docs/BENCHMARKS.md), 4 in flight took T8 p50 from 1.53 (1 in flight) to
/// 0.94.
pub const FETCH_READS_IN_FLIGHT: usize = 4;

/// Smallest share of a fetched batch (bytes) worth its own checksum task:
/// a core checksums ~10 MB in about a millisecond from memory, against
/// microseconds for the task hand-off. 8 MiB lets a 64 MiB part spread
/// over 8 tasks: on the H200 host (`kvferry pd --gpu cuda --model qwen3-8b
/// --concurrency 1`, docs/BENCHMARKS.md) the last part's unhidden CRC pass
/// went from 9.5 to 2.4 ms and the handoff p50 from 98-105 to 76-77 ms
/// against 32 MiB (2 tasks).
pub const FETCH_VERIFY_PART_BYTES_MIN: u64 = 8 << 20;

/// Most checksum tasks one fetch spreads its verification over: memory
/// bandwidth, not cores, bounds the CRC pass beyond a handful.
pub const FETCH_VERIFY_TASKS_MAX: usize = 8;

/// Most owners one fetch will try (C14 stitching): one transfer query per
/// owner per request, so this bounds the RPCs a fetch can cost.
pub const FETCH_OWNERS_MAX: usize = 4;

/// Default deadline (ms) for a whole fetch (query + handshake + lock + read).
pub const FETCH_DEADLINE_MS_DEFAULT: u64 = 5_000;

/// Largest handshake metadata blob (bytes) we decode.
pub const HANDSHAKE_METADATA_BYTES_MAX: usize = 64 << 10;

/// Most regions a handshake may describe.
pub const HANDSHAKE_REGIONS_MAX: usize = 1_024;

/// Longest MetaServer duration setting (s): a week. Bounds `stale_after`,
/// TTL and sweep interval so their millisecond forms cannot overflow.
pub const METASERVER_DURATION_SECS_MAX: u64 = 7 * 24 * 3600;

/// Largest `--capacity` of the MetaServer (distinct hashes each namespace
/// is sized for up front). At roughly 100 bytes per hash this is ~25 GiB: a
/// large host's budget for one index; a mistyped capacity (extra zeros)
/// fails at start instead of the process dying of memory on the first
/// write.
pub const METASERVER_CAPACITY_HASHES_MAX: u64 = 1 << 28;

/// Default number of MetaServer store shards (`--shards`). Each shard has
/// its own lock, so requests of many clients run on as many cores; 64 is
/// four times the 16 cores of the H200 host, so two writers rarely meet on
/// one shard, while a 16,384-hash insert still puts ~256 hashes in each
/// shard it locks (one lock per shard per request, not per hash).
pub const METASERVER_SHARDS_DEFAULT: usize = 64;

/// Most MetaServer store shards (`--shards`): beyond this a bulk drop
/// (unregister, takeover) pays more for visiting shards than for the
/// blocks it drops, and a large insert locks each shard for a handful of
/// hashes.
pub const METASERVER_SHARDS_MAX: usize = 4_096;

/// Most MetaServer I/O threads (`--io-threads`): a thread each, with its
/// own runtime; far more than any host's cores is a typo.
pub const METASERVER_IO_THREADS_MAX: usize = 256;

/// The `kvferry metaserver` default for `--io-threads`: on a host of 8 or
/// more cores a quarter of them (4 on the 16-core H200 host); below that
/// 0, one shared work-stealing runtime. Measured, not derived: on the H200
/// host 4 threads answered prefix queries with a lower p99 than the shared
/// runtime in 6 of 8 alternated rounds, and no worse than 2, 8 or 16
/// threads, with inserts at the same rate; on a 2-core
/// box one I/O thread lowered the query p99 by ≈ 15 % but doubled the
/// insert p99 (the one thread decoding every insert competes for two cores
/// with the writes themselves), so small hosts keep the shared runtime
/// (docs/BENCHMARKS.md, session 8).
pub fn metaserver_io_threads_default(cores: usize) -> usize {
    if cores >= 8 { cores / 4 } else { 0 }
}

/// Inserts and removals of at least this many hashes run on tokio's
/// blocking pool rather than the thread serving the connection: a
/// 16,384-hash insert holds its thread for milliseconds, which would
/// otherwise delay every query on the connections sharing it, and on the
/// pool concurrent large writes use as many cores as they need (on the
/// 2-core box this alone took the insert p99 from ≈ 3.3 × to ≈ 2.4 × the
/// median under msload's four 16,384-hash writers).
pub const METASERVER_OFFLOAD_HASHES: usize = 1024;

/// Most prompt tokens one trace request may claim (the replay sizes device
/// buffers from it): 4 × the longest request of the bundled trace.
pub const TRACE_INPUT_TOKENS_MAX: u64 = 1 << 19;

// ---------------------------------------------------------------------------
// RDMA verbs backend (`transport::verbs`; the device code is feature `rdma`).
// ---------------------------------------------------------------------------

/// Default RC queue pairs per peer (`--rdma-qps-per-peer`). Two let one
/// batch's reads of a peer run on two QPs (two NIC processing engines) while
/// staying far below the per-device QP budget (tens of thousands).
pub const VERBS_QPS_PER_PEER_DEFAULT: usize = 2;

/// Most queue pairs one verbs endpoint advertises in its handshake. One QP
/// per peer connection is the common case; 64 leaves room to spread reads
/// over many QPs while keeping the count in one byte and the section small.
pub const HANDSHAKE_QPNS_MAX: usize = 64;

/// Most RC queue pairs per peer: the handshake carries at most
/// [`HANDSHAKE_QPNS_MAX`] QPNs.
pub const VERBS_QPS_PER_PEER_MAX: usize = HANDSHAKE_QPNS_MAX;

/// Longest RDMA device name (bytes, `--rdma-device`): libibverbs keeps
/// device names in 64-byte buffers (`IBV_SYSFS_NAME_MAX`).
pub const VERBS_DEVICE_NAME_BYTES_MAX: usize = 64;

/// Default send-queue depth (work requests in flight per QP). 256 READs of
/// even 64 KiB keep ~16 MiB in flight per QP, well past a 400 Gb/s
/// bandwidth-delay product; the completion queue is sized to match.
pub const VERBS_SEND_QUEUE_DEPTH_DEFAULT: u32 = 256;

/// Default scatter/gather entries per READ: one contiguous remote range may
/// land in up to this many local extents (adjacent blocks on the server,
/// separate slots here). Clamped to the device's `max_sge`.
pub const VERBS_SGES_PER_WR_DEFAULT: u32 = 4;

/// Largest RDMA READ message (bytes). InfiniBand allows 2^31; ConnectX
/// ports report 1 GiB (`max_msg_sz`), which `sideway` does not expose, so the
/// smaller value is the default. Every SGE is also at most this long (its
/// length field is 32-bit).
pub const VERBS_READ_MESSAGE_BYTES_MAX: u64 = 1 << 30;

/// Outstanding RDMA READs per QP (count), as initiator (`max_rd_atomic`) and
/// as responder (`max_dest_rd_atomic`). 16 is the ConnectX limit; both sides
/// of a pair use the same default so the initiator never exceeds what the
/// responder accepts. Clamped to the device's caps.
pub const VERBS_READS_IN_FLIGHT_PER_QP_DEFAULT: u8 = 16;

/// Handshake offers (QP sets created by `local_metadata` and not yet
/// connected) kept at once; the oldest is dropped beyond this. Each fetch
/// handshakes once per peer, so this bounds concurrent first contacts, and
/// with it the QPs held for answers that may never come
/// (`64 × qps_per_peer`).
pub const VERBS_PENDING_OFFERS_MAX: usize = 64;

/// How long an offer waits for its answer (ms). The answer comes within one
/// fetch deadline ([`FETCH_DEADLINE_MS_DEFAULT`], 5 s); 30 s leaves room for
/// longer configured deadlines and a slow peer, after which the offer's QPs
/// are destroyed.
pub const VERBS_OFFER_TTL_MS: u64 = 30_000;

/// Peers this node serves at once (QP sets made by `accept`). A peer that
/// handshakes again replaces its own set; beyond this the longest-served
/// peer's set is dropped (it handshakes again on its next read).
pub const VERBS_SERVED_PEERS_MAX: usize = 1_024;

/// After an error or a passed deadline the QP is moved to the error state and
/// its outstanding work requests are flushed by the NIC; this bounds that
/// drain (ms). A flush takes microseconds on a healthy NIC; if the bound
/// passes, the QP is destroyed, which also stops its DMA.
pub const VERBS_FLUSH_DRAIN_MS_MAX: u64 = 1_000;

/// Empty completion polls answered with `yield_now` before the poller sleeps
/// between polls ([`VERBS_POLL_SLEEP_US`]): short reads finish on the spin,
/// long ones do not burn a core.
pub const VERBS_POLL_SPINS_MAX: u32 = 64;

/// Sleep between empty completion polls once spinning stopped (µs): at
/// 400 Gb/s a 64 KiB READ takes ~1.3 µs, so 50 µs costs a sleeping batch at
/// most a few dozen READ times of latency while leaving the core free.
pub const VERBS_POLL_SLEEP_US: u64 = 50;

/// Local ACK timeout exponent (IB `timeout`, no unit): 4.096 µs · 2^14 ≈
/// 67 ms per try.
pub const VERBS_QP_TIMEOUT_EXP_DEFAULT: u8 = 14;

/// Transport retries before an error completion (count; the IB maximum, 7):
/// with the timeout above a dead peer is reported after ≈ 0.5 s.
pub const VERBS_QP_RETRY_COUNT_DEFAULT: u8 = 7;

/// Longest host identity in handshake metadata (bytes): a 36-byte boot id,
/// a network-namespace id (`net:[4026531840]`, ~17 bytes) and separators,
/// with room to spare (`transport::shm::host_identity`).
pub const HOST_ID_BYTES_MAX: usize = 128;

/// Longest shared-pool socket name in handshake metadata (bytes): an
/// abstract Unix socket name must fit `sun_path` (108 bytes with the
/// leading NUL); ours are `kvferry-shm-` + 32 hex digits (44).
pub const SHM_SOCKET_NAME_BYTES_MAX: usize = 100;

/// Connections the shared-pool socket serves at once (count). Each gets one
/// request, one answer with the pool's fd, then closes, all within
/// [`SHM_SOCKET_IO_MS`]; beyond this a connection is closed at once and
/// counted, so a flood costs bounded threads and memory.
pub const SHM_CONNECTIONS_IN_FLIGHT_MAX: usize = 16;

/// Bound on each read or write of a shared-pool socket exchange (ms): the
/// messages are a few dozen bytes between processes of one host, so any
/// wait longer than this is a stuck or hostile peer.
pub const SHM_SOCKET_IO_MS: u64 = 2_000;

/// Tokens (pool fd grants) an owner holds at once, one per requester that
/// passed the gRPC handshake and has not collected its fd yet; beyond this
/// the oldest is forgotten (that requester handshakes again, or reads over
/// TCP).
pub const SHM_TOKENS_MAX: usize = 1_024;

/// How long a shared-pool token stays valid after the handshake answer
/// that issued it (ms). The requester redeems it right after that answer,
/// within its fetch deadline ([`FETCH_DEADLINE_MS_DEFAULT`]); 30 s leaves
/// room for longer configured deadlines.
pub const SHM_TOKEN_TTL_MS: u64 = 30_000;

/// Peer pools one reader keeps mapped at once (count): each mapping is
/// address space, not memory, but a bound keeps a reader that meets many
/// restarted owners from collecting them. Beyond it the new owner is read
/// over TCP.
pub const SHM_MAPPINGS_MAX: usize = 256;

/// Bytes of one shared-pool read batch below which it is copied on the
/// calling thread alone; larger batches are split over up to
/// [`SHM_COPY_THREADS_MAX`] threads, each with at least this many bytes (a
/// thread costs tens of µs to start; 4 MiB copies in ~0.5 ms on one core).
pub const SHM_COPY_BYTES_PER_THREAD_MIN: u64 = 4 << 20;

/// Most threads one shared-pool read batch is copied on (count).
pub const SHM_COPY_THREADS_MAX: usize = 8;

// ---- Disk tier (`disk`, issue 32) ----------------------------------------

/// Alignment of every disk-tier buffer address, file offset and I/O length
/// (bytes): a page, which covers every logical block size `O_DIRECT`
/// demands (512 B or 4 KiB on NVMe).
pub const DISK_ALIGN_BYTES: u64 = 4096;

/// Slots (checksummed pieces, one per layer) one disk record may carry
/// (count). A model with 4 096 layers does not exist; the bound keeps a
/// corrupt header from asking for a huge slot table.
pub const DISK_SLOTS_MAX: usize = 4_096;

/// Payload bytes one disk record may carry (1 GiB): a block of every
/// layer of a very large model is tens of MiB.
pub const DISK_RECORD_PAYLOAD_BYTES_MAX: u64 = 1 << 30;

/// Bytes a transport receives or copies before it checksums them, when it
/// takes a read's slot checksums as the bytes land
/// (`Transport::read_summed`): 128 KiB, well inside a core's L2, so the
/// checksum reads the piece from cache rather than memory.
pub const READ_SUM_PIECE_BYTES: usize = 128 << 10;

/// How often a restarted node's re-advertising of its recovered disk
/// blocks looks again for room in a full registration queue (ms).
pub const RECOVERED_READVERTISE_POLL_MS: u64 = 5;

/// Record alignment of an engine's disk tier by default (bytes, 64 KiB;
/// `DiskConfig::record_align`): a record is padded to it only while the
/// padding stays under 1/32 of the record (`disk::tier::padded_record_len`),
/// so large blocks (a Qwen3-8B block, 2.25 MiB) are written in 64 KiB
/// units, which halved their write time on a virtio disk, and small ones
/// (64 KiB) in 4 KiB units.
pub const DISK_RECORD_ALIGN_DEFAULT: u64 = 64 << 10;

/// Largest record alignment of the disk tier (bytes): 16 MiB (larger
/// units than any SSD's erase block or a virtual disk's cluster).
pub const DISK_RECORD_ALIGN_MAX: u64 = 16 << 20;

/// Smallest disk tier (bytes): 1 MiB, room for a few small records.
pub const DISK_CAPACITY_BYTES_MIN: u64 = 1 << 20;

/// Largest disk tier (bytes): 64 TiB.
pub const DISK_CAPACITY_BYTES_MAX: u64 = 1 << 46;

/// Writes the tier holds accepted but not yet completed by default
/// (blocks): the write-behind queue; beyond it a write is refused and
/// counted, never waited for.
pub const DISK_WRITE_QUEUE_DEFAULT: usize = 64;

/// Largest write-behind queue (blocks; each queued block holds a record
/// buffer of its size: 1 GiB of 64 KiB blocks). 4,096 until session 26:
/// `pd --prefetch fetch` on an H100 host refused 10,099 / 11,160 victims
/// at a queue of 4,096; queues of 8,192 and 16,384 refused few or none
/// there but did not raise its hit rate (docs/BENCHMARKS.md, session 27).
pub const DISK_WRITE_QUEUE_MAX: usize = 16_384;

/// I/O operations the tier keeps in flight at the backend by default
/// (count; the queue depth).
pub const DISK_QUEUE_DEPTH_DEFAULT: usize = 32;

/// Largest queue depth (count): the io_uring submission ring is sized to
/// it, and the thread backend starts at most [`DISK_THREADS_MAX`] threads.
pub const DISK_QUEUE_DEPTH_MAX: usize = 256;

/// Threads of the blocking `pread`/`pwrite` backend, at most (count).
pub const DISK_THREADS_MAX: usize = 16;

/// Bytes recovery reads at once while scanning the tier's file on open
/// (8 MiB: large sequential reads; a record longer than what is left of a
/// chunk is read by itself).
pub const DISK_RECOVERY_CHUNK_BYTES: u64 = 8 << 20;

/// How long recovery waits for one read before it gives up on the disk
/// (ms): a disk that hangs during the recovery scan fails the tier's open
/// with `TierError::RecoveryStalled` instead of hanging the node's start.
/// A failing disk usually returns EIO before it (NVMe and SCSI command
/// timeouts are 30 s by default), though retries can take longer.
pub const DISK_RECOVERY_READ_TIMEOUT_MS: u64 = 120_000;

/// Spare I/O buffers the tier keeps for reuse after their operation
/// completed (count), at least; a tier whose write-behind queue plus
/// backend depth is larger keeps that many, so a steady eviction stream
/// reuses record buffers instead of allocating (and faulting in) one per
/// record. More are freed.
pub const DISK_SPARE_BUFFERS_MAX: usize = 64;

/// Queue slots an engine's real disk backend has beyond its configured
/// depth, kept for reads (count): writes fill at most the configured depth
/// ([`crate::disk::TierConfig::read_slots`]), so a staging read never
/// waits behind a full queue of write-behind records for a slot.
pub const DISK_READ_SLOTS: usize = 8;

/// How long the engine's disk driver waits between polls of the tier while
/// operations are in flight (µs). The tokio timer rounds it up to its 1 ms
/// tick; a disk read of a multi-MiB block takes about that long anyway.
pub const DISK_POLL_INTERVAL_US: u64 = 500;

/// How long the engine's disk driver sleeps when nothing is in flight and
/// nothing woke it (ms): the period at which an idle driver notices its
/// engine is gone.
pub const DISK_IDLE_POLL_MS: u64 = 100;

/// With a disk tier, the pool's free bytes below which the disk driver
/// evicts ahead of demand (a fraction of the pool, in 1/1024ths): victims
/// go to the write-behind queue from the driver task, so a `save` whose
/// allocation would otherwise evict (and copy each victim into a record
/// buffer on its own path) finds room already free.
pub const DISK_EVICT_AHEAD_LOW_PER_1024: u64 = 64;
/// The pool's free bytes the driver evicts up to once it started evicting
/// ahead ([`DISK_EVICT_AHEAD_LOW_PER_1024`]), in 1/1024ths of the pool.
pub const DISK_EVICT_AHEAD_HIGH_PER_1024: u64 = 128;
/// Blocks the driver evicts ahead before it yields to other tasks (the
/// victims' copies into record buffers run on its thread).
pub const DISK_EVICT_AHEAD_YIELD_BLOCKS: u64 = 64;

/// Deadline of staging blocks from the disk tier into the pool for a local
/// `load` or lookup, by default (ms); a peer's lock request uses the
/// smaller of this and half its RPC timeout.
pub const DISK_STAGE_DEADLINE_MS_DEFAULT: u64 = 2_000;

/// Disk reads one staging keeps in flight at once (blocks): each holds a
/// record buffer of a block's size until its bytes are copied into the
/// pool.
pub const DISK_STAGE_READS_IN_FLIGHT: usize = 64;

/// Record buffers the write-behind queue of each `kvferry pd` node's disk
/// tier may hold by default (bytes, and at most 1/8 of `--ssd-size`;
/// `--ssd-write-queue` sets a block count instead): the queue is this many
/// bytes of blocks, at most
/// [`PD_SSD_WRITE_QUEUE_MAX`] blocks, so bursts of evictions (a long
/// request's saves) are absorbed while the disk catches up. On the H200
/// host (`pd --requests 1500 --ssd-size 8GiB`, 64 KiB blocks,
/// docs/BENCHMARKS.md) a queue of 1,024 refused 29,287 victims and reached
/// 0.948 × the oracle's hit rate, one of 4,096 (this budget) refused none
/// and reached 0.993 ×; Qwen3-8B's 2.3 MB blocks get a queue of 113.
pub const PD_SSD_WRITE_QUEUE_BYTES: u64 = 256 << 20;
/// Most blocks in a `kvferry pd` node's write-behind queue
/// (`--ssd-write-queue` accepts 1 to this).
pub const PD_SSD_WRITE_QUEUE_MAX: usize = 16_384;
