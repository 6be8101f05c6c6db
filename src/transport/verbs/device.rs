//! The device half of the verbs backend (feature `rdma`): `sideway` calls
//! driven by the pure plans of [`super::plan`]. See the parent module doc for
//! the protocol, the access model and the failure contract.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType, SetScatterGatherEntry,
    WorkRequestFlags,
};
use tokio::time::Instant;

use super::plan::{
    self, Completion, EffectiveLimits, InitAttrs, LocalBuf, LocalPort, OfferTable, PathMtu, PlanError, QpPlan, ReadWr,
    RemotePeer, Tracked, VerbsConfig, WrTracker,
};
use crate::limits;
use crate::memory::pool::{Extent, Pool};
use crate::rt::timeout_at;
use crate::transport::handshake::{HandshakeMetadata, LinkLayer, Region, TransportKind};
use crate::transport::{
    BadOp, DataSource, HandshakeRejected, NotConnected, ReadCompletion, ReadOp, Transport, TransportError,
    validate_local,
};
use crate::types::{NodeAddr, error_chain};

/// Why the verbs backend could not start. Each variant is a distinct
/// startup failure the operator can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// The device list could not be read at all: no `libibverbs.so.1`
    /// (`EOPNOTSUPP`), or no RDMA support in the kernel (`ENOSYS`). This is
    /// what every machine without an RDMA NIC reports.
    #[error(
        "no RDMA support on this machine ({reason}); the rdma backend needs libibverbs1 + ibverbs-providers, \
         the kernel's ib_uverbs and an RDMA device"
    )]
    NoRdma {
        /// The OS error text.
        reason: String,
        /// The errno, when there was one.
        errno: Option<i32>,
    },
    /// libibverbs works but lists no device at all (seen on a machine with
    /// `libibverbs1` installed and no RDMA NIC).
    #[error("no RDMA device on this machine (libibverbs lists none); wanted {name:?}")]
    NoDevices {
        /// The name asked for (`--rdma-device`).
        name: String,
    },
    /// There are RDMA devices, but none has this name.
    #[error("RDMA device {name:?} not found (devices present: {})", available.join(", "))]
    DeviceNotFound {
        /// The name asked for (`--rdma-device`).
        name: String,
        /// Names of the devices that exist.
        available: Vec<String>,
    },
    /// The configuration is out of range, or the device's caps are too small.
    #[error("verbs config: {0}")]
    Config(PlanError),
    /// The port is not usable.
    #[error("port {port} of {device}: {reason}")]
    Port {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// What is wrong (not active, unknown link layer, zero LID/GID…).
        reason: String,
    },
    /// A verbs call failed while starting.
    #[error("{step} on {device} failed: {reason}")]
    Device {
        /// Device name.
        device: String,
        /// The call (`ibv_open_device`, `ibv_reg_mr`, …).
        step: &'static str,
        /// The error chain.
        reason: String,
    },
}

impl VerbsError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            VerbsError::NoRdma { .. } => "verbs_no_rdma",
            VerbsError::NoDevices { .. } => "verbs_no_devices",
            VerbsError::DeviceNotFound { .. } => "verbs_device_not_found",
            VerbsError::Config(_) => "verbs_config",
            VerbsError::Port { .. } => "verbs_port",
            VerbsError::Device { .. } => "verbs_device",
        }
    }
}

impl From<VerbsError> for TransportError {
    /// Startup errors surfaced through the trait's error type (`Io`), for
    /// callers that only handle [`TransportError`].
    fn from(e: VerbsError) -> Self {
        TransportError::io(std::io::ErrorKind::Other, e.to_string())
    }
}

/// Counters of one verbs transport.
#[derive(Debug, Default)]
pub struct VerbsStats {
    /// Read batches started.
    pub batches: AtomicU64,
    /// READ work requests posted.
    pub wrs_posted: AtomicU64,
    /// Bytes of READs that completed successfully.
    pub bytes_read: AtomicU64,
    /// Error completions (and failed posts).
    pub wr_errors: AtomicU64,
    /// Completions that belonged to no pending WR (ignored).
    pub stray_completions: AtomicU64,
    /// Peers invalidated after an error or a deadline.
    pub invalidations: AtomicU64,
    /// Queue pairs destroyed because the flush drain bound passed.
    pub drain_timeouts: AtomicU64,
    /// Offers made (`local_metadata`).
    pub offers_made: AtomicU64,
    /// Offers dropped unanswered (expired or pushed out).
    pub offers_dropped: AtomicU64,
    /// Handshakes answered (`accept`).
    pub accepted: AtomicU64,
}

/// The names of the RDMA devices present.
///
/// # Errors
/// [`VerbsError::NoRdma`] when the device list cannot be read.
pub fn list_devices() -> Result<Vec<String>, VerbsError> {
    let list = device_list()?;
    Ok(list.iter().map(|d| d.name()).collect())
}

fn device_list() -> Result<DeviceList, VerbsError> {
    DeviceList::new().map_err(|e| {
        let (reason, errno) = match &e.0 {
            GetDeviceListErrorKind::Ibverbs(io) => (io.to_string(), io.raw_os_error()),
            other => (other.to_string(), None),
        };
        VerbsError::NoRdma { reason, errno }
    })
}

/// One QP with its own completion queue (requester side; the served side
/// shares one CQ that never sees a completion).
struct QpConn {
    // Field order is drop order: the QP before the CQ it is attached to.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
}

/// Our QPs connected to one peer we read from.
struct PeerConn {
    remote: RemotePeer,
    qps: Vec<Arc<tokio::sync::Mutex<Option<QpConn>>>>,
    valid: AtomicBool,
}

/// QPs we made for a peer that reads from us.
struct Served {
    _qps: Vec<BasicQueuePair>,
    accepted_at: StdInstant,
}

struct Shared {
    node: NodeAddr,
    device: String,
    port: LocalPort,
    limits: EffectiveLimits,
    qps_per_peer: usize,
    regions: Vec<Region>,
    lkey: u32,
    arena_base: u64,
    arena_len: u64,
    stats: VerbsStats,
    rng: Mutex<StdRng>,
    next_generation: AtomicU32,
    next_start: AtomicUsize,
    // Field order is drop order: every QP (offers, peers, served) before the
    // CQs and the MR, the MR before the pool's arena.
    offers: Mutex<OfferTable<Vec<QpConn>>>,
    peers: Mutex<HashMap<NodeAddr, Arc<PeerConn>>>,
    served: Mutex<HashMap<NodeAddr, Served>>,
    served_cq: Arc<BasicCompletionQueue>,
    mr: Arc<MemoryRegion>,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
    /// Held so the registered arena outlives the MR.
    _pool: Pool,
    /// Not consulted: the NIC serves READs without us (module doc, Access).
    /// Held so both backends start from the same inputs.
    _source: Arc<dyn DataSource>,
}

/// The RDMA verbs transport of one node: one device port, one protection
/// domain, the pinned pool registered once, RC queue pairs per peer.
///
/// `Send + Sync`; cheap to share behind an `Arc` like the TCP transport.
pub struct VerbsTransport {
    shared: Arc<Shared>,
}

fn dev_err(device: &str, step: &'static str, e: &dyn std::error::Error) -> VerbsError {
    VerbsError::Device { device: device.to_string(), step, reason: error_chain(e) }
}

impl VerbsTransport {
    /// Opens `cfg.device`, checks the port, allocates a protection domain,
    /// registers the pool's arena once (local write + remote read; region 0
    /// of the handshake, at its virtual address, with its rkey) and a shared
    /// CQ for served QPs. `node` is this node's advertise address (it goes
    /// into the handshake metadata); `source` is held but not consulted (see
    /// the module doc, Access).
    ///
    /// # Errors
    /// [`VerbsError::Config`] (checked first, no device touched),
    /// [`VerbsError::NoRdma`], [`VerbsError::NoDevices`],
    /// [`VerbsError::DeviceNotFound`],
    /// [`VerbsError::Port`], [`VerbsError::Device`].
    pub fn open(
        cfg: &VerbsConfig,
        node: NodeAddr,
        pool: &Pool,
        source: Arc<dyn DataSource>,
    ) -> Result<Self, VerbsError> {
        cfg.validate().map_err(VerbsError::Config)?;
        let name = cfg.device.as_str();
        let ctx = {
            let list = device_list()?;
            if list.is_empty() {
                return Err(VerbsError::NoDevices { name: name.to_string() });
            }
            let dev = list.iter().find(|d| d.name() == name).ok_or_else(|| VerbsError::DeviceNotFound {
                name: name.to_string(),
                available: list.iter().map(|d| d.name()).collect(),
            })?;
            dev.open().map_err(|e| dev_err(name, "ibv_open_device", &e))?
        };
        let dattr = ctx.query_device().map_err(|e| dev_err(name, "ibv_query_device", &e))?;
        let pattr = ctx.query_port(cfg.port).map_err(|e| dev_err(name, "ibv_query_port", &e))?;
        let port_err = |reason: String| VerbsError::Port { device: name.to_string(), port: cfg.port, reason };
        // Raw fields, not sideway's enum conversions: those panic on values
        // they do not know.
        const IBV_PORT_ACTIVE: u32 = 4;
        if pattr.attr.state != IBV_PORT_ACTIVE {
            return Err(port_err(format!("not active (ibv_port_state {})", pattr.attr.state)));
        }
        let link_layer = match pattr.attr.link_layer {
            0 | 1 => LinkLayer::InfiniBand, // 0 = unspecified: libibverbs treats it as IB
            2 => LinkLayer::Ethernet,
            other => return Err(port_err(format!("unknown link layer {other}"))),
        };
        let active_mtu = PathMtu::from_ibv(pattr.attr.active_mtu)
            .ok_or_else(|| port_err(format!("unknown active MTU code {}", pattr.attr.active_mtu)))?;
        let gid = ctx
            .query_gid(cfg.port, u32::from(cfg.gid_index))
            .map_err(|e| port_err(format!("GID index {}: {}", cfg.gid_index, error_chain(&e))))?;
        let port = LocalPort {
            port_num: cfg.port,
            link_layer,
            lid: pattr.lid(),
            gid: gid.raw,
            gid_index: cfg.gid_index,
            active_mtu,
        };
        port.validate().map_err(|e| port_err(e.to_string()))?;
        let caps = plan::DeviceCaps {
            max_qp_wr: i64::from(dattr.max_qp_wr()),
            max_sge: i64::from(dattr.max_sge()),
            max_cqe: i64::from(dattr.max_cqe()),
            max_qp_init_rd_atom: i64::from(dattr.max_qp_init_rd_atom()),
            max_qp_rd_atom: i64::from(dattr.max_qp_rd_atom()),
            max_msg_bytes: i64::from(pattr.attr.max_msg_sz),
        };
        let limits = cfg.effective(&caps).map_err(VerbsError::Config)?;

        let pd = ctx.alloc_pd().map_err(|e| dev_err(name, "ibv_alloc_pd", &e))?;
        let arena_base = pool.base_ptr() as u64;
        let arena_len = pool.arena_len();
        let len = usize::try_from(arena_len).map_err(|_| VerbsError::Config(PlanError::BadConfig("pool".into())))?;
        // SAFETY: `[base, base + len)` is the pool's arena, allocated and
        // initialised for as long as a `Pool` clone lives; `Shared` holds
        // one and drops it after the MR (field order), so the registration
        // never outlives the memory. The NIC only writes into it through
        // READ work requests whose SGEs lie in extents a batch owns
        // exclusively (`read`), and peers only read it.
        let mr = unsafe { pd.reg_mr(arena_base as usize, len, AccessFlags::LocalWrite | AccessFlags::RemoteRead) }
            .map_err(|e| dev_err(name, "ibv_reg_mr", &e))?;
        let served_cq = ctx.create_cq_builder().setup_cqe(1).build().map_err(|e| dev_err(name, "ibv_create_cq", &e))?;
        let regions = vec![Region { id: 0, base: arena_base, len: arena_len, rkey: mr.rkey() }];
        let shared = Shared {
            node,
            device: name.to_string(),
            port,
            limits,
            qps_per_peer: cfg.qps_per_peer,
            regions,
            lkey: mr.lkey(),
            arena_base,
            arena_len,
            stats: VerbsStats::default(),
            rng: Mutex::new(StdRng::from_os_rng()),
            next_generation: AtomicU32::new(1),
            next_start: AtomicUsize::new(0),
            offers: Mutex::new(OfferTable::new(
                limits::VERBS_PENDING_OFFERS_MAX,
                Duration::from_millis(limits::VERBS_OFFER_TTL_MS),
            )),
            peers: Mutex::new(HashMap::new()),
            served: Mutex::new(HashMap::new()),
            served_cq,
            mr,
            pd,
            ctx,
            _pool: pool.clone(),
            _source: source,
        };
        // What we advertise must pass our own validation (node address, regions).
        plan::verbs_metadata(&shared.node.0, shared.regions.clone(), shared.port.endpoint(vec![1], 0))
            .map_err(|e| VerbsError::Config(PlanError::Metadata(e)))?;
        tracing::info!(
            device = %shared.device, port = shared.port.port_num, link_layer = ?shared.port.link_layer,
            lid = shared.port.lid, mtu = shared.port.active_mtu.bytes(), arena_bytes = arena_len,
            rkey = shared.mr.rkey(), limits = ?shared.limits, "rdma verbs transport open"
        );
        Ok(VerbsTransport { shared: Arc::new(shared) })
    }

    /// Answers a reader's handshake (the serving side, see the module doc):
    /// validates its offer, creates one QP per offered QPN, connects each to
    /// its partner (INIT → RTR → RTS, initial PSN = the offer's) and returns
    /// the metadata to send back. Replaces the QPs an earlier handshake of
    /// the same requester got; beyond `limits::VERBS_SERVED_PEERS_MAX`
    /// requesters the longest-served one is dropped (its next read fails and
    /// it handshakes again).
    ///
    /// # Errors
    /// [`TransportError::Timeout`] when `deadline` passed before starting;
    /// [`TransportError::Handshake`] for an unusable offer or a failed verbs
    /// call.
    pub fn accept(
        &self,
        requester: &NodeAddr,
        offer: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<HandshakeMetadata, TransportError> {
        if Instant::now() >= deadline {
            return Err(TransportError::Timeout);
        }
        let s = &*self.shared;
        let remote = plan::accept_remote(offer, &s.port)?;
        let psn = remote.endpoint.psn;
        let mut qps = Vec::with_capacity(remote.endpoint.qpns.len());
        for &rq in &remote.endpoint.qpns {
            let plan = plan::plan_qp(&s.port, psn, &remote, rq, &s.limits.tuning)?;
            let mut qp = s.create_qp(&s.served_cq, 1, 1).map_err(verbs_rejected)?;
            apply_plan(&mut qp, &plan).map_err(verbs_rejected)?;
            qps.push(qp);
        }
        let qpns = qps.iter().map(|q| q.qp_number()).collect();
        let answer = plan::verbs_metadata(&s.node.0, s.regions.clone(), s.port.endpoint(qpns, psn))
            .map_err(|e| TransportError::Handshake(HandshakeRejected::Metadata(e)))?;
        let evicted = {
            let mut served = s.served.lock().expect("served lock");
            let mut evicted = None;
            if !served.contains_key(requester) && served.len() >= limits::VERBS_SERVED_PEERS_MAX {
                let oldest = served.iter().min_by_key(|(_, v)| v.accepted_at).map(|(k, _)| k.clone());
                evicted = oldest.and_then(|k| served.remove(&k));
            }
            let old = served.insert(requester.clone(), Served { _qps: qps, accepted_at: StdInstant::now() });
            (evicted, old)
        };
        drop(evicted); // destroys QPs outside the lock
        s.stats.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(answer)
    }

    /// Drops the QPs serving `requester` (its reads fail until it handshakes
    /// again). For when the node is known to be gone.
    pub fn forget_served(&self, requester: &NodeAddr) {
        let gone = self.shared.served.lock().expect("served lock").remove(requester);
        drop(gone);
    }

    /// The device name.
    pub fn device(&self) -> &str {
        &self.shared.device
    }

    /// The port in use.
    pub fn port(&self) -> &LocalPort {
        &self.shared.port
    }

    /// The limits in force (config clamped to the device).
    pub fn limits(&self) -> &EffectiveLimits {
        &self.shared.limits
    }

    /// Counters.
    pub fn stats(&self) -> &VerbsStats {
        &self.shared.stats
    }

    /// Peers we hold connected QPs to (we read from them).
    pub fn connected_peers(&self) -> usize {
        self.shared.peers.lock().expect("peers lock").len()
    }

    /// Peers we serve (answered handshakes).
    pub fn served_peers(&self) -> usize {
        self.shared.served.lock().expect("served lock").len()
    }

    /// Offers waiting for an answer.
    pub fn pending_offers(&self) -> usize {
        self.shared.offers.lock().expect("offers lock").len()
    }
}

/// Maps the plan's MTU onto sideway's.
fn mtu(m: PathMtu) -> Mtu {
    match m {
        PathMtu::Mtu256 => Mtu::Mtu256,
        PathMtu::Mtu512 => Mtu::Mtu512,
        PathMtu::Mtu1024 => Mtu::Mtu1024,
        PathMtu::Mtu2048 => Mtu::Mtu2048,
        PathMtu::Mtu4096 => Mtu::Mtu4096,
    }
}

fn modify(qp: &mut BasicQueuePair, attr: &QueuePairAttribute, what: &str) -> Result<(), String> {
    qp.modify(attr).map_err(|e| format!("ibv_modify_qp to {what}: {}", error_chain(&e)))
}

fn apply_init(qp: &mut BasicQueuePair, a: &InitAttrs) -> Result<(), String> {
    let mut attr = QueuePairAttribute::new();
    let access = if a.remote_read { AccessFlags::RemoteRead } else { AccessFlags::none() };
    attr.setup_state(QueuePairState::Init)
        .setup_pkey_index(a.pkey_index)
        .setup_port(a.port_num)
        .setup_access_flags(access);
    modify(qp, &attr, "INIT")
}

/// Applies INIT → RTR → RTS (the QP is already in INIT).
/// A failed verbs call during a handshake (the library's text).
fn verbs_rejected(why: String) -> TransportError {
    TransportError::Handshake(HandshakeRejected::Verbs(why))
}

fn apply_plan(qp: &mut BasicQueuePair, p: &QpPlan) -> Result<(), String> {
    let mut ah = AddressHandleAttribute::new();
    ah.setup_dest_lid(p.rtr.av.dlid).setup_service_level(p.rtr.av.service_level).setup_port(p.rtr.av.port_num);
    if let Some(g) = p.rtr.av.grh {
        ah.setup_grh(&Gid { raw: g.dgid }, g.flow_label, g.sgid_index, g.hop_limit, g.traffic_class);
    }
    let mut rtr = QueuePairAttribute::new();
    rtr.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu(p.rtr.path_mtu))
        .setup_dest_qp_num(p.rtr.dest_qpn)
        .setup_rq_psn(p.rtr.rq_psn)
        .setup_max_dest_read_atomic(p.rtr.max_dest_rd_atomic)
        .setup_min_rnr_timer(p.rtr.min_rnr_timer)
        .setup_address_vector(&ah);
    modify(qp, &rtr, "RTR")?;
    let mut rts = QueuePairAttribute::new();
    rts.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(p.rts.sq_psn)
        .setup_timeout(p.rts.timeout_exp)
        .setup_retry_cnt(p.rts.retry_count)
        .setup_rnr_retry(p.rts.rnr_retry)
        .setup_max_read_atomic(p.rts.max_rd_atomic);
    modify(qp, &rts, "RTS")
}

fn to_error_state(qp: &mut BasicQueuePair) -> Result<(), String> {
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Error);
    modify(qp, &attr, "ERR")
}

/// `ibv_sge` as the C header lays it out (`uint64_t addr; uint32_t length;
/// uint32_t lkey;`); `sideway` takes `&[ibv_sge]` for multi-SGE work
/// requests but does not re-export the type, so a slice of this is passed
/// with its element type inferred from `setup_sge_list`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawSge {
    addr: u64,
    length: u32,
    lkey: u32,
}

impl Shared {
    /// An RC QP on `cq` in INIT.
    fn create_qp(&self, cq: &Arc<BasicCompletionQueue>, send_wr: u32, send_sge: u32) -> Result<BasicQueuePair, String> {
        let mut qp = self
            .pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(send_wr)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(send_sge)
            .setup_max_recv_sge(1)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build()
            .map_err(|e| format!("ibv_create_qp: {}", error_chain(&e)))?;
        apply_init(&mut qp, &plan::plan_qp_init(&self.port, &self.limits.tuning))?;
        Ok(qp)
    }

    /// A requester QP with its own CQ, sized for a full send queue.
    fn create_requester_qp(&self) -> Result<QpConn, String> {
        let depth = self.limits.send_queue_depth;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth)
            .build()
            .map_err(|e| format!("ibv_create_cq: {}", error_chain(&e)))?;
        let qp = self.create_qp(&cq, depth, self.limits.plan.sges_per_wr)?;
        Ok(QpConn { qp, cq })
    }

    /// Creates and records an offer; returns its metadata.
    fn offer(&self) -> Result<HandshakeMetadata, String> {
        let qps = (0..self.qps_per_peer).map(|_| self.create_requester_qp()).collect::<Result<Vec<_>, _>>()?;
        let qpns: Vec<u32> = qps.iter().map(|q| q.qp.qp_number()).collect();
        let random = self.rng.lock().expect("rng lock").next_u32();
        let dropped = {
            let mut offers = self.offers.lock().expect("offers lock");
            let psn = plan::pick_psn(random, |p| offers.contains(p));
            let dropped = offers.insert(psn, qps, StdInstant::now());
            (psn, dropped)
        };
        let (psn, dropped) = dropped;
        self.stats.offers_made.fetch_add(1, Ordering::Relaxed);
        self.stats.offers_dropped.fetch_add(dropped.len() as u64, Ordering::Relaxed);
        drop(dropped); // destroys QPs outside the lock
        plan::verbs_metadata(&self.node.0, self.regions.clone(), self.port.endpoint(qpns, psn))
            .map_err(|e| e.to_string())
    }

    /// Marks `peer` unusable and forgets it if it is still the current one.
    fn invalidate(&self, addr: &NodeAddr, peer: &Arc<PeerConn>) {
        if peer.valid.swap(false, Ordering::SeqCst) {
            self.stats.invalidations.fetch_add(1, Ordering::Relaxed);
        }
        let mut peers = self.peers.lock().expect("peers lock");
        if peers.get(addr).is_some_and(|p| Arc::ptr_eq(p, peer)) {
            peers.remove(addr);
        }
    }
}

/// Runs one QP's share of a batch: posts its WRs in send-queue-sized
/// windows as chained work requests, polls its CQ, and on an error or a
/// passed deadline moves the QP to the error state, drains, and destroys
/// it. Returns the (WR index in the batch, result) pairs and whether the
/// connection must be invalidated. Returns only when the hardware is done
/// with every posted WR or the QP is destroyed (C11).
async fn run_qp(
    shared: &Shared,
    peer: &PeerConn,
    qp_slot: Arc<tokio::sync::Mutex<Option<QpConn>>>,
    wrs: &[ReadWr],
    idxs: Vec<usize>,
    deadline: Instant,
) -> (Vec<(usize, Result<(), TransportError>)>, bool) {
    // Nothing was posted on these paths: the connection is no worse for it.
    let fail_all = |e: TransportError| (idxs.iter().map(|&i| (i, Err(e.clone()))).collect(), false);
    let Ok(mut slot) = timeout_at(deadline, qp_slot.lock_owned()).await else {
        return fail_all(TransportError::Timeout);
    };
    if !peer.valid.load(Ordering::SeqCst) {
        return fail_all(TransportError::NotConnected(NotConnected::Invalidated));
    }
    let Some(conn) = slot.as_mut() else {
        return fail_all(TransportError::NotConnected(NotConnected::QueuePairDestroyed));
    };
    let n = idxs.len();
    let generation = shared.next_generation.fetch_add(1, Ordering::Relaxed);
    let mut tr = WrTracker::new(generation, n);
    let depth = shared.limits.send_queue_depth as usize;
    let mut posted = 0usize;
    // Set when the QP was moved to the error state (the drain started).
    let mut failing: Option<StdInstant> = None;
    let mut destroyed = false;
    let mut spins = 0u32;
    let mut completions = Vec::with_capacity(32);
    loop {
        // Post the next window while healthy.
        if failing.is_none() && posted < n {
            let inflight = posted - tr.hw_completed();
            let k = (depth.saturating_sub(inflight)).min(n - posted);
            if k > 0 {
                let mut guard = conn.qp.start_post_send();
                for j in posted..posted + k {
                    let w = &wrs[idxs[j]];
                    let h =
                        guard.construct_wr(tr.wr_id(j), WorkRequestFlags::Signaled).setup_read(w.rkey, w.remote_addr);
                    // SAFETY: every SGE lies in an extent this batch owns
                    // exclusively (moved into the task running it) inside
                    // the registered arena (checked in `read`); the extents
                    // are released only after the hardware is done with this
                    // WR or the QP is destroyed (below).
                    unsafe {
                        if let [s] = w.sges[..] {
                            h.setup_sge(s.lkey, s.addr, s.len);
                        } else {
                            let raw: Vec<RawSge> =
                                w.sges.iter().map(|s| RawSge { addr: s.addr, length: s.len, lkey: s.lkey }).collect();
                            // `RawSge` has `ibv_sge`'s exact layout (repr(C), same field types and order).
                            h.setup_sge_list(std::slice::from_raw_parts(raw.as_ptr().cast(), raw.len()));
                        }
                    }
                }
                match guard.post() {
                    Ok(()) => {
                        shared.stats.wrs_posted.fetch_add(k as u64, Ordering::Relaxed);
                        posted += k;
                    }
                    Err(e) => {
                        // Some WRs of the chain may have been posted (the
                        // failing one is not reported): count the whole
                        // window as in flight and drain.
                        shared.stats.wr_errors.fetch_add(1, Ordering::Relaxed);
                        let err = TransportError::io(
                            std::io::ErrorKind::Other,
                            format!("ibv_post_send: {}", error_chain(&e)),
                        );
                        for j in posted..posted + k {
                            tr.fail(j, err.clone());
                        }
                        posted += k;
                        failing = Some(StdInstant::now());
                        if to_error_state(&mut conn.qp).is_err() {
                            destroyed = true;
                        }
                    }
                }
            }
        }
        // Poll.
        completions.clear();
        if !destroyed {
            match conn.cq.start_poll() {
                Ok(poller) => {
                    for wc in poller {
                        completions.push(Completion {
                            wr_id: wc.wr_id(),
                            status: wc.status(),
                            vendor_err: wc.vendor_err(),
                        });
                    }
                }
                Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
                Err(e) => {
                    tr.fail_pending(&TransportError::io(
                        std::io::ErrorKind::Other,
                        format!("ibv_poll_cq: {}", error_chain(&e)),
                    ));
                    failing.get_or_insert_with(StdInstant::now);
                    destroyed = true; // cannot learn when the NIC is done: destroy to stop it
                }
            }
        }
        for c in &completions {
            match tr.on_completion(*c) {
                Tracked::Ok => {
                    let j = plan::decode_wr_id(c.wr_id).1 as usize;
                    shared.stats.bytes_read.fetch_add(wrs[idxs[j]].len(), Ordering::Relaxed);
                }
                Tracked::Failed => {
                    shared.stats.wr_errors.fetch_add(1, Ordering::Relaxed);
                    if failing.is_none() {
                        failing = Some(StdInstant::now());
                        if to_error_state(&mut conn.qp).is_err() {
                            destroyed = true;
                        }
                    }
                }
                Tracked::Stray => {
                    shared.stats.stray_completions.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if failing.is_none() && posted == n && tr.hw_completed() == n {
            break; // all done, QP healthy
        }
        if failing.is_none() && Instant::now() >= deadline {
            tr.fail_pending(&TransportError::Timeout);
            failing = Some(StdInstant::now());
            if to_error_state(&mut conn.qp).is_err() {
                destroyed = true;
            }
        }
        if let Some(since) = failing {
            // Nothing more is posted; what never was fails now (and never
            // completes: the drain waits for the `posted` ones only).
            for j in posted..n {
                tr.fail(
                    j,
                    TransportError::io(
                        std::io::ErrorKind::ConnectionAborted,
                        "not posted: the queue pair failed earlier in the batch",
                    ),
                );
            }
            let drained = tr.hw_completed() >= posted;
            let bound = since.elapsed() >= Duration::from_millis(limits::VERBS_FLUSH_DRAIN_MS_MAX);
            if drained || destroyed || bound {
                if !drained {
                    shared.stats.drain_timeouts.fetch_add(1, Ordering::Relaxed);
                    tr.fail_pending(&TransportError::io(
                        std::io::ErrorKind::ConnectionAborted,
                        "queue pair destroyed before its completions arrived",
                    ));
                }
                // Destroying the QP (dropping it) ends its DMA; only then are
                // the extents released by the caller.
                *slot = None;
                break;
            }
        }
        if completions.is_empty() {
            spins += 1;
            if spins < limits::VERBS_POLL_SPINS_MAX {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(limits::VERBS_POLL_SLEEP_US)).await;
            }
        } else {
            spins = 0;
        }
    }
    let failed = tr.any_failed() || failing.is_some();
    let results = tr.into_results();
    let out = idxs
        .iter()
        .zip(results)
        .map(|(&i, r)| (i, r.unwrap_or_else(|| Err(TransportError::io(std::io::ErrorKind::Other, "no completion")))))
        .collect();
    (out, failed)
}

#[async_trait]
impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn answer(
        &self,
        requester: &NodeAddr,
        offer: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<HandshakeMetadata, TransportError> {
        self.accept(requester, offer, deadline)
    }

    /// A fresh *offer*: `qps_per_peer` new QPs in INIT and a PSN unique among
    /// pending offers (module doc). If the QPs cannot be created the
    /// metadata lists no QPNs, which every peer rejects (`NoQpns`): the
    /// handshake fails and the fetch degrades.
    fn local_metadata(&self) -> HandshakeMetadata {
        match self.shared.offer() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, device = %self.shared.device, "cannot create queue pairs for a handshake offer");
                let s = &self.shared;
                HandshakeMetadata {
                    transport: TransportKind::Verbs,
                    node: s.node.0.clone(),
                    data_addr: String::new(),
                    regions: s.regions.clone(),
                    verbs: Some(s.port.endpoint(Vec::new(), 0)),
                    same_host: None,
                }
            }
        }
    }

    /// Connects the offer the answer refers to (by its echoed PSN) to the
    /// answer's QPs (INIT → RTR → RTS) and records the peer.
    async fn connect(
        &self,
        peer: &NodeAddr,
        remote: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if Instant::now() >= deadline {
            return Err(TransportError::Timeout);
        }
        let s = &*self.shared;
        let rp = plan::accept_remote(remote, &s.port)?;
        let psn = rp.endpoint.psn;
        let taken = s.offers.lock().expect("offers lock").take(psn, StdInstant::now());
        let Some(mut qps) = taken else {
            return Err(TransportError::Handshake(HandshakeRejected::NoPendingOffer { psn }));
        };
        let local_qpns: Vec<u32> = qps.iter().map(|q| q.qp.qp_number()).collect();
        let pairs = plan::pair_qpns(&local_qpns, &rp.endpoint.qpns)?;
        for (conn, (_, rq)) in qps.iter_mut().zip(pairs) {
            let p = plan::plan_qp(&s.port, psn, &rp, rq, &s.limits.tuning)?;
            apply_plan(&mut conn.qp, &p).map_err(verbs_rejected)?;
        }
        let conn = Arc::new(PeerConn {
            remote: rp,
            qps: qps.into_iter().map(|q| Arc::new(tokio::sync::Mutex::new(Some(q)))).collect(),
            valid: AtomicBool::new(true),
        });
        let old = s.peers.lock().expect("peers lock").insert(peer.clone(), conn);
        if let Some(old) = old {
            old.valid.store(false, Ordering::SeqCst);
        }
        Ok(())
    }

    fn disconnect(&self, peer: &NodeAddr) {
        let old = self.shared.peers.lock().expect("peers lock").remove(peer);
        if let Some(old) = old {
            old.valid.store(false, Ordering::SeqCst);
        }
    }

    /// Plans the batch ([`plan::plan_reads`]), spreads its WRs over the
    /// peer's QPs and runs them in a spawned task that owns `local` until
    /// the NIC is done with it. `session` is not used: the NIC checks rkeys
    /// only (module doc, Access).
    async fn read(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        mut local: Vec<Extent>,
        deadline: Instant,
    ) -> ReadCompletion {
        let _ = session;
        let fail_all = |local: Vec<Extent>, e: TransportError| ReadCompletion::all_failed(local, e);
        if let Err(e) = validate_local(&ops, &local) {
            return fail_all(local, e);
        }
        let s = self.shared.clone();
        let conn = s.peers.lock().expect("peers lock").get(peer).cloned();
        let Some(conn) = conn.filter(|c| c.valid.load(Ordering::SeqCst)) else {
            return fail_all(local, TransportError::NotConnected(NotConnected::Peer(peer.0.clone())));
        };
        let bufs: Vec<LocalBuf> =
            local.iter_mut().map(|e| LocalBuf { addr: e.as_mut_ptr() as u64, len: e.len() }).collect();
        if let Some(i) = bufs.iter().position(|b| b.addr < s.arena_base || b.addr + b.len > s.arena_base + s.arena_len)
        {
            return fail_all(local, TransportError::BadOp(BadOp::NotRegistered(i)));
        }
        let wrs = match plan::plan_reads(&ops, &conn.remote.regions, &bufs, s.lkey, &s.limits.plan) {
            Ok(w) => w,
            Err(e) => return fail_all(local, e.into()),
        };
        if wrs.is_empty() {
            let n = local.len();
            return ReadCompletion::unsummed(local, vec![Ok(()); n]);
        }
        s.stats.batches.fetch_add(1, Ordering::Relaxed);
        let start = s.next_start.fetch_add(1, Ordering::Relaxed);
        let groups = plan::spread_over_qps(&wrs, conn.qps.len(), start);
        let addr = peer.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The task owns the extents: dropping this future (cancellation) does
        // not release memory the NIC may still write into (C11).
        tokio::spawn(async move {
            let futs = groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()).map(|(q, idxs)| {
                let slot = conn.qps[q].clone();
                run_qp(&s, &conn, slot, &wrs, idxs, deadline)
            });
            let parts = futures::future::join_all(futs).await;
            let mut wr_results: Vec<Option<Result<(), TransportError>>> = vec![None; wrs.len()];
            let mut failed = false;
            for (part, f) in parts {
                failed |= f;
                for (i, r) in part {
                    wr_results[i] = Some(r);
                }
            }
            if failed {
                s.invalidate(&addr, &conn);
            }
            let results = plan::extent_results(
                &wrs,
                &wr_results,
                local.len(),
                &TransportError::io(std::io::ErrorKind::Other, "no completion"),
            );
            let _ = tx.send(ReadCompletion::unsummed(local, results));
        });
        match rx.await {
            Ok(done) => done,
            Err(_) => {
                // The task panicked: its extents were dropped there (after
                // the QP it held was destroyed by unwinding). Nothing to hand back.
                tracing::error!(peer = %peer.0, "rdma read task died");
                ReadCompletion::unsummed(Vec::new(), Vec::new())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::pool::SealedExtent;
    use crate::transport::AccessError;
    use sideway::ibverbs::completion::WorkCompletionStatus;

    struct NoAccess;
    impl DataSource for NoAccess {
        fn authorize(&self, _: &str, _: u32, _: u64, _: u64) -> Result<(SealedExtent, u64), AccessError> {
            Err(AccessError::UnknownSession)
        }
    }

    fn node(s: &str) -> NodeAddr {
        NodeAddr(s.to_string())
    }

    /// Without `libibverbs1` (CI, developers) opening fails with `NoRdma`;
    /// with it and no NIC (the H200 machine) with `NoDevices`; on a machine
    /// with RDMA a name that does not exist fails with `DeviceNotFound`.
    /// Always a clear value, never a panic.
    #[test]
    fn open_without_the_device_is_a_clear_error() {
        let pool = Pool::new(1 << 20, 4096).unwrap();
        let cfg = VerbsConfig::new("kvferry-no-such-device");
        match VerbsTransport::open(&cfg, node("10.0.0.1:1"), &pool, Arc::new(NoAccess)) {
            Err(e @ VerbsError::NoRdma { .. }) => eprintln!("as expected without RDMA: {e}"),
            Err(e @ VerbsError::NoDevices { .. }) => eprintln!("as expected without an RDMA device: {e}"),
            Err(VerbsError::DeviceNotFound { name, available }) => {
                eprintln!("as expected with RDMA: no device {name:?} among {available:?}");
                assert_eq!(name, "kvferry-no-such-device");
                assert!(!available.contains(&name));
            }
            Err(e) => panic!("unexpected error {e:?}"),
            Ok(_) => panic!("a device named kvferry-no-such-device exists?"),
        }
        match list_devices() {
            Ok(names) => assert!(!names.iter().any(|n| n == "kvferry-no-such-device")),
            Err(e) => assert!(matches!(e, VerbsError::NoRdma { .. })),
        }
    }

    #[test]
    fn bad_config_fails_before_touching_the_device() {
        let pool = Pool::new(1 << 20, 4096).unwrap();
        let mut cfg = VerbsConfig::new("mlx5_0");
        cfg.qps_per_peer = 0;
        assert!(matches!(
            VerbsTransport::open(&cfg, node("10.0.0.1:1"), &pool, Arc::new(NoAccess)),
            Err(VerbsError::Config(PlanError::BadConfig(_)))
        ));
    }

    #[test]
    fn startup_errors_render_and_map_to_transport_errors() {
        let e = VerbsError::NoRdma { reason: "Function not implemented (os error 38)".into(), errno: Some(38) };
        assert!(e.to_string().contains("no RDMA support") && e.to_string().contains("libibverbs1"));
        assert!(matches!(TransportError::from(e), TransportError::Io(_)));
        let e = VerbsError::DeviceNotFound { name: "mlx5_9".into(), available: vec!["mlx5_0".into(), "mlx5_1".into()] };
        assert!(e.to_string().contains("mlx5_9") && e.to_string().contains("mlx5_0, mlx5_1"));
        let e = VerbsError::NoDevices { name: "mlx5_0".into() };
        assert!(e.to_string().contains("no RDMA device") && e.to_string().contains("mlx5_0"));
    }

    /// The plan's codes are libibverbs' (checked against the bindings).
    #[test]
    fn plan_codes_match_the_bindings() {
        for m in [PathMtu::Mtu256, PathMtu::Mtu512, PathMtu::Mtu1024, PathMtu::Mtu2048, PathMtu::Mtu4096] {
            assert_eq!(mtu(m) as u32, m.ibv());
        }
        assert_eq!(WorkCompletionStatus::Success as u32, plan::WC_SUCCESS);
        assert_eq!(WorkCompletionStatus::WorkRequestFlushedError as u32, plan::WC_WR_FLUSH_ERR);
        assert_eq!(WorkCompletionStatus::RemoteAccessError as u32, plan::WC_REM_ACCESS_ERR);
        assert_eq!(WorkCompletionStatus::RetryCounterExceededError as u32, plan::WC_RETRY_EXC_ERR);
        assert_eq!(WorkCompletionStatus::TagMatchingRendezvousIncomplete as u32, 23);
        assert_eq!(plan::wc_status_name(WorkCompletionStatus::FatalError as u32), "FATAL_ERR");
        assert_eq!(std::mem::size_of::<RawSge>(), 16);
    }

    // ---- Tests that need an RDMA device: `scripts/hw-rdma.sh` ----------

    fn hw_config() -> VerbsConfig {
        let mut cfg = VerbsConfig::new(std::env::var("KVFERRY_RDMA_DEVICE").unwrap_or_else(|_| "mlx5_0".into()));
        if let Some(p) = std::env::var("KVFERRY_RDMA_PORT").ok().and_then(|v| v.parse().ok()) {
            cfg.port = p;
        }
        if let Some(g) = std::env::var("KVFERRY_RDMA_GID_INDEX").ok().and_then(|v| v.parse().ok()) {
            cfg.gid_index = g;
        }
        cfg
    }

    struct Pair {
        a: VerbsTransport,
        b: VerbsTransport,
        pool_a: Pool,
        pool_b: Pool,
    }

    /// Two transports on one device (loopback), `a` connected to read `b`.
    async fn hw_pair() -> Pair {
        let pool_a = Pool::new(16 << 20, 4096).unwrap();
        let pool_b = Pool::new(16 << 20, 4096).unwrap();
        let cfg = hw_config();
        let a = VerbsTransport::open(&cfg, node("10.0.0.1:1"), &pool_a, Arc::new(NoAccess)).expect("open a");
        let b = VerbsTransport::open(&cfg, node("10.0.0.2:1"), &pool_b, Arc::new(NoAccess)).expect("open b");
        let deadline = Instant::now() + Duration::from_secs(5);
        let offer = a.local_metadata();
        assert_eq!(HandshakeMetadata::decode(&offer.encode()), Ok(offer.clone()));
        assert_eq!(a.pending_offers(), 1);
        let answer = b.accept(&node("10.0.0.1:1"), &offer, deadline).expect("accept");
        assert_eq!(answer.verbs.as_ref().unwrap().psn, offer.verbs.as_ref().unwrap().psn);
        a.connect(&node("10.0.0.2:1"), &answer, deadline).await.expect("connect");
        assert_eq!((a.pending_offers(), a.connected_peers(), b.served_peers()), (0, 1, 1));
        Pair { a, b, pool_a, pool_b }
    }

    /// Fills `n` extents of `pool` with a pattern; returns them sealed.
    fn served_blocks(pool: &Pool, n: usize, len: u64) -> Vec<SealedExtent> {
        (0..n)
            .map(|i| {
                let mut e = pool.alloc(len).unwrap();
                for (k, b) in e.as_mut_slice().iter_mut().enumerate() {
                    *b = (k as u8).wrapping_mul(31).wrapping_add(i as u8);
                }
                e.seal()
            })
            .collect()
    }

    #[tokio::test]
    #[ignore = "needs an RDMA device; run scripts/hw-rdma.sh"]
    async fn verbs_hw_open_registers_the_pool_once() {
        let pool = Pool::new(4 << 20, 4096).unwrap();
        let t = VerbsTransport::open(&hw_config(), node("10.0.0.1:1"), &pool, Arc::new(NoAccess)).expect("open");
        let m = t.local_metadata();
        assert_eq!(m.validate(), Ok(()));
        assert_eq!(m.regions.len(), 1);
        assert_eq!(m.regions[0].base, pool.base_ptr() as u64);
        assert_eq!(m.regions[0].len, pool.arena_len());
        assert_eq!(m.verbs.as_ref().unwrap().qpns.len(), limits::VERBS_QPS_PER_PEER_DEFAULT);
        // A second offer reuses the same registration.
        let m2 = t.local_metadata();
        assert_eq!(m2.regions, m.regions);
        assert_ne!(m2.verbs.as_ref().unwrap().psn, m.verbs.as_ref().unwrap().psn);
    }

    #[tokio::test]
    #[ignore = "needs an RDMA device; run scripts/hw-rdma.sh"]
    async fn verbs_hw_loopback_read_moves_the_bytes() {
        let p = hw_pair().await;
        let len = 64 << 10;
        let blocks = served_blocks(&p.pool_b, 8, len);
        let local: Vec<Extent> = (0..8).map(|_| p.pool_a.alloc(len).unwrap()).collect();
        // Two ops per block (K/V halves), like fetch builds them.
        let ops: Vec<ReadOp> = blocks
            .iter()
            .enumerate()
            .flat_map(|(i, b)| {
                [
                    ReadOp { region: 0, remote_offset: b.offset(), len: len / 2, local_extent: i, local_offset: 0 },
                    ReadOp {
                        region: 0,
                        remote_offset: b.offset() + len / 2,
                        len: len / 2,
                        local_extent: i,
                        local_offset: len / 2,
                    },
                ]
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        let done = p.a.read(&node("10.0.0.2:1"), "s", ops, local, deadline).await;
        assert_eq!(done.local.len(), 8);
        for (i, (ext, r)) in done.local.iter().zip(&done.results).enumerate() {
            assert_eq!(r, &Ok(()), "extent {i}");
            assert_eq!(ext.as_slice(), blocks[i].as_slice(), "extent {i}");
        }
        assert_eq!(p.a.stats().bytes_read.load(Ordering::Relaxed), 8 * len);
        drop(p.b);
    }

    #[tokio::test]
    #[ignore = "needs an RDMA device; run scripts/hw-rdma.sh"]
    async fn verbs_hw_bad_rkey_fails_and_invalidates_the_connection() {
        let pool_a = Pool::new(4 << 20, 4096).unwrap();
        let pool_b = Pool::new(4 << 20, 4096).unwrap();
        let cfg = hw_config();
        let a = VerbsTransport::open(&cfg, node("10.0.0.1:1"), &pool_a, Arc::new(NoAccess)).unwrap();
        let b = VerbsTransport::open(&cfg, node("10.0.0.2:1"), &pool_b, Arc::new(NoAccess)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let offer = a.local_metadata();
        let mut answer = b.accept(&node("10.0.0.1:1"), &offer, deadline).unwrap();
        answer.regions[0].rkey ^= 0x5a5a; // a key the peer NIC does not know
        a.connect(&node("10.0.0.2:1"), &answer, deadline).await.unwrap();
        let local = vec![pool_a.alloc(4096).unwrap(), pool_a.alloc(4096).unwrap()];
        let ops = vec![
            ReadOp { region: 0, remote_offset: 0, len: 4096, local_extent: 0, local_offset: 0 },
            ReadOp { region: 0, remote_offset: 8192, len: 4096, local_extent: 1, local_offset: 0 },
        ];
        let done = a.read(&node("10.0.0.2:1"), "s", ops.clone(), local, deadline).await;
        assert_eq!(done.local.len(), 2, "every extent comes back");
        assert!(done.results.iter().all(|r| matches!(r, Err(TransportError::Io(_)))), "{:?}", done.results);
        assert_eq!(a.connected_peers(), 0, "the connection is invalidated");
        let again = a.read(&node("10.0.0.2:1"), "s", ops, done.local, deadline).await;
        assert!(again.results.iter().all(|r| matches!(r, Err(TransportError::NotConnected(_)))));
    }

    #[tokio::test]
    #[ignore = "needs an RDMA device; run scripts/hw-rdma.sh"]
    async fn verbs_hw_passed_deadline_returns_every_extent() {
        let p = hw_pair().await;
        let blocks = served_blocks(&p.pool_b, 4, 1 << 20);
        let local: Vec<Extent> = (0..4).map(|_| p.pool_a.alloc(1 << 20).unwrap()).collect();
        let ops: Vec<ReadOp> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| ReadOp {
                region: 0,
                remote_offset: b.offset(),
                len: 1 << 20,
                local_extent: i,
                local_offset: 0,
            })
            .collect();
        let done = p.a.read(&node("10.0.0.2:1"), "s", ops, local, Instant::now()).await;
        assert_eq!(done.local.len(), 4);
        assert!(done.results.iter().all(|r| r.is_err()));
        assert_eq!(p.a.connected_peers(), 0);
    }

    #[tokio::test]
    #[ignore = "needs an RDMA device; run scripts/hw-rdma.sh"]
    async fn verbs_hw_answer_without_offer_is_rejected() {
        let p = hw_pair().await;
        let deadline = Instant::now() + Duration::from_secs(5);
        // `b`'s plain local_metadata is an offer, not an answer to `a`.
        let not_an_answer = p.b.local_metadata();
        assert!(matches!(
            p.a.connect(&node("10.0.0.2:1"), &not_an_answer, deadline).await,
            Err(TransportError::Handshake(_))
        ));
    }
}
