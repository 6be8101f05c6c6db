//! The pure core of the verbs backend: everything that decides *what* to ask
//! the NIC for, with no `sideway` import, so it compiles and is unit-tested in
//! every build (no feature, `--features rdma`, `--cfg madsim`).
//!
//! | part | what it decides |
//! | --- | --- |
//! | [`VerbsConfig`], [`DeviceCaps`], [`EffectiveLimits`] | the configured knobs, clamped to what the device reports |
//! | [`PathMtu`] | MTU bytes ↔ `ibv_mtu` codes, and the path MTU of a pair |
//! | [`LocalPort`], [`verbs_metadata`], [`accept_remote`], [`pair_qpns`] | handshake metadata ↔ endpoints: what we advertise, what we accept from a peer, which QP talks to which |
//! | [`RegionTable`] | rkey/address lookup of a `(region, offset, len)` read |
//! | [`plan_reads`], [`spread_over_qps`] | `ReadOp`s → chained RDMA READ work requests (coalesced, split at the SGE and message limits) → queue pairs |
//! | [`plan_qp`] | the RESET → INIT → RTR → RTS transition plan of one RC queue pair, as data |
//! | [`WrTracker`], [`wc_failure`], [`encode_wr_id`] | completions → per-WR and per-extent results |
//! | [`OfferTable`] | queue pairs offered in a handshake and not yet connected (bounded, expiring) |
//!
//! The device code (`verbs::device`, feature `rdma`) only translates these
//! values into verbs calls. The numeric bounds and defaults both use live in
//! [`crate::limits`] (`VERBS_*`), with the other limits.

use std::time::{Duration, Instant};

use super::super::handshake::{
    HandshakeError, HandshakeMetadata, LinkLayer, MTU_BYTES_MAX, MTU_BYTES_MIN, PSN_QPN_LIMIT, Region, TransportKind,
    VerbsEndpoint,
};
use super::super::{BackendFailure, BadOp, HandshakeRejected, ReadOp, TransportError};
use crate::limits::{
    VERBS_DEVICE_NAME_BYTES_MAX, VERBS_QP_RETRY_COUNT_DEFAULT, VERBS_QP_TIMEOUT_EXP_DEFAULT,
    VERBS_QPS_PER_PEER_DEFAULT, VERBS_QPS_PER_PEER_MAX, VERBS_READ_MESSAGE_BYTES_MAX,
    VERBS_READS_IN_FLIGHT_PER_QP_DEFAULT, VERBS_SEND_QUEUE_DEPTH_DEFAULT, VERBS_SGES_PER_WR_DEFAULT,
};

// ---------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------

/// Why a verbs plan could not be made. Every variant is a value; nothing here
/// panics on remote input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A configuration value out of range.
    #[error("bad verbs config: {0}")]
    BadConfig(String),
    /// The device reports a capability too small to work with.
    #[error("device capability {cap} is {value}, need at least {min}")]
    DeviceTooSmall {
        /// Capability name (`max_qp_wr`, `max_sge`, …).
        cap: &'static str,
        /// Reported value.
        value: i64,
        /// Smallest usable value.
        min: i64,
    },
    /// The peer's metadata is not for the verbs transport.
    #[error("peer speaks {0:?}, this node speaks verbs")]
    NotVerbs(TransportKind),
    /// The peer's metadata breaks the handshake format.
    #[error("peer metadata: {0}")]
    Metadata(#[from] HandshakeError),
    /// The two ports have different link layers (InfiniBand vs RoCE).
    #[error("link layer mismatch: local {local:?}, peer {remote:?}")]
    LinkLayerMismatch {
        /// This port.
        local: LinkLayer,
        /// The peer's port.
        remote: LinkLayer,
    },
    /// A RoCE port (local or peer) with an all-zero GID: unroutable.
    #[error("zero GID on a RoCE port ({0})")]
    ZeroGid(&'static str),
    /// An InfiniBand port (local) with LID 0: not yet configured by the
    /// subnet manager.
    #[error("local InfiniBand port has LID 0 (no subnet manager?)")]
    ZeroLocalLid,
    /// The two QPN lists differ in length.
    #[error("QPN count mismatch: {local} local, {remote} from the peer")]
    QpnCountMismatch {
        /// Ours.
        local: usize,
        /// The peer's.
        remote: usize,
    },
    /// A read names a region the peer did not advertise.
    #[error("peer has no region {0}")]
    UnknownRegion(u32),
    /// A read outside its region.
    #[error("read [{offset}, +{len}) outside region {region} of {region_len} bytes")]
    OutOfRegion {
        /// Region id.
        region: u32,
        /// Offset in the region.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// Two regions with one id in a table.
    #[error("duplicate region id {0}")]
    DuplicateRegion(u32),
    /// A read whose local side is not inside its local extent.
    #[error("read of {len} bytes at {offset} outside local extent {extent}")]
    LocalOutOfRange {
        /// Extent index.
        extent: usize,
        /// Offset in the extent.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// A zero-length read.
    #[error("zero-length read")]
    EmptyRead,
}

impl PlanError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            PlanError::BadConfig(_) => "verbs_plan_bad_config",
            PlanError::DeviceTooSmall { .. } => "verbs_plan_device_too_small",
            PlanError::NotVerbs(_) => "verbs_plan_not_verbs",
            PlanError::Metadata(_) => "verbs_plan_metadata",
            PlanError::LinkLayerMismatch { .. } => "verbs_plan_link_layer_mismatch",
            PlanError::ZeroGid(_) => "verbs_plan_zero_gid",
            PlanError::ZeroLocalLid => "verbs_plan_zero_local_lid",
            PlanError::QpnCountMismatch { .. } => "verbs_plan_qpn_count_mismatch",
            PlanError::UnknownRegion(_) => "verbs_plan_unknown_region",
            PlanError::OutOfRegion { .. } => "verbs_plan_out_of_region",
            PlanError::DuplicateRegion(_) => "verbs_plan_duplicate_region",
            PlanError::LocalOutOfRange { .. } => "verbs_plan_local_out_of_range",
            PlanError::EmptyRead => "verbs_plan_empty_read",
        }
    }
}

impl From<PlanError> for BackendFailure {
    fn from(e: PlanError) -> Self {
        BackendFailure { code: e.code(), message: e.to_string() }
    }
}

impl From<PlanError> for TransportError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::NotVerbs(_)
            | PlanError::Metadata(_)
            | PlanError::LinkLayerMismatch { .. }
            | PlanError::ZeroGid(_)
            | PlanError::ZeroLocalLid
            | PlanError::QpnCountMismatch { .. }
            | PlanError::DuplicateRegion(_) => TransportError::Handshake(HandshakeRejected::Plan(e.into())),
            _ => TransportError::BadOp(BadOp::Plan(e.into())),
        }
    }
}

// ---------------------------------------------------------------------------
// Configuration and device caps.
// ---------------------------------------------------------------------------

/// Send-side timing and depth knobs of every RC queue pair (IB spec names in
/// brackets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpTuning {
    /// Local ACK timeout exponent (verbs `timeout`), `0..=31`: 4.096 µs · 2^value.
    pub timeout_exp: u8,
    /// Transport retries (verbs `retry_cnt`), `0..=7`.
    pub retry_count: u8,
    /// Receiver-not-ready retries (verbs `rnr_retry`), `0..=7` (7 = forever; READs
    /// never hit RNR, the value only has to be legal).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer code (verbs `min_rnr_timer`), `0..=31`.
    pub min_rnr_timer: u8,
    /// Outstanding READs as initiator (verbs `max_rd_atomic`), `1..=255`.
    pub reads_in_flight: u8,
    /// Outstanding READs accepted as responder (verbs `max_dest_rd_atomic`), `1..=255`.
    pub dest_reads_in_flight: u8,
    /// Service level.
    pub service_level: u8,
    /// GRH hop limit (RoCE).
    pub hop_limit: u8,
    /// GRH traffic class (RoCE; DSCP << 2).
    pub traffic_class: u8,
    /// P_Key index.
    pub pkey_index: u16,
}

impl Default for QpTuning {
    fn default() -> Self {
        QpTuning {
            timeout_exp: VERBS_QP_TIMEOUT_EXP_DEFAULT,
            retry_count: VERBS_QP_RETRY_COUNT_DEFAULT,
            rnr_retry: 7,
            min_rnr_timer: 12,
            reads_in_flight: VERBS_READS_IN_FLIGHT_PER_QP_DEFAULT,
            dest_reads_in_flight: VERBS_READS_IN_FLIGHT_PER_QP_DEFAULT,
            service_level: 0,
            hop_limit: 64,
            traffic_class: 0,
            pkey_index: 0,
        }
    }
}

impl QpTuning {
    /// Checks every field's range.
    ///
    /// # Errors
    /// [`PlanError::BadConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |s: String| Err(PlanError::BadConfig(s));
        if self.timeout_exp > 31 {
            return bad(format!("timeout_exp {} > 31", self.timeout_exp));
        }
        if self.retry_count > 7 {
            return bad(format!("retry_count {} > 7", self.retry_count));
        }
        if self.rnr_retry > 7 {
            return bad(format!("rnr_retry {} > 7", self.rnr_retry));
        }
        if self.min_rnr_timer > 31 {
            return bad(format!("min_rnr_timer {} > 31", self.min_rnr_timer));
        }
        if self.reads_in_flight == 0 || self.dest_reads_in_flight == 0 {
            return bad("reads_in_flight and dest_reads_in_flight must be at least 1".into());
        }
        if self.service_level > 15 {
            return bad(format!("service_level {} > 15", self.service_level));
        }
        Ok(())
    }
}

/// How to open and drive the verbs backend (`--rdma-device mlx5_0` and
/// friends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Device name as `ibv_devices` lists it (`mlx5_0`).
    pub device: String,
    /// Physical port, 1-based.
    pub port: u8,
    /// GID table index (RoCE v2 is usually 1 or 3; InfiniBand 0).
    pub gid_index: u8,
    /// RC queue pairs per peer, `1..=`[`VERBS_QPS_PER_PEER_MAX`].
    pub qps_per_peer: usize,
    /// Work requests in flight per QP (send-queue and CQ depth).
    pub send_queue_depth: u32,
    /// Scatter/gather entries per READ (clamped to the device).
    pub sges_per_wr: u32,
    /// Largest READ message, bytes, `1..=`[`VERBS_READ_MESSAGE_BYTES_MAX`].
    pub read_message_bytes_max: u64,
    /// Queue pair timing and depths.
    pub tuning: QpTuning,
}

impl VerbsConfig {
    /// Defaults for `device`: port 1, GID index 0, the `*_DEFAULT` limits.
    pub fn new(device: impl Into<String>) -> Self {
        VerbsConfig {
            device: device.into(),
            port: 1,
            gid_index: 0,
            qps_per_peer: VERBS_QPS_PER_PEER_DEFAULT,
            send_queue_depth: VERBS_SEND_QUEUE_DEPTH_DEFAULT,
            sges_per_wr: VERBS_SGES_PER_WR_DEFAULT,
            read_message_bytes_max: VERBS_READ_MESSAGE_BYTES_MAX,
            tuning: QpTuning::default(),
        }
    }

    /// Checks every field's range (before touching any device).
    ///
    /// # Errors
    /// [`PlanError::BadConfig`].
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |s: String| Err(PlanError::BadConfig(s));
        if self.device.is_empty() || self.device.len() > VERBS_DEVICE_NAME_BYTES_MAX {
            return bad(format!("device name {:?} must be 1..={VERBS_DEVICE_NAME_BYTES_MAX} bytes", self.device));
        }
        if self.port == 0 {
            return bad("port numbers start at 1".into());
        }
        if !(1..=VERBS_QPS_PER_PEER_MAX).contains(&self.qps_per_peer) {
            return bad(format!("qps_per_peer {} not in 1..={VERBS_QPS_PER_PEER_MAX}", self.qps_per_peer));
        }
        if self.send_queue_depth == 0 {
            return bad("send_queue_depth must be at least 1".into());
        }
        if self.sges_per_wr == 0 {
            return bad("sges_per_wr must be at least 1".into());
        }
        if !(1..=VERBS_READ_MESSAGE_BYTES_MAX).contains(&self.read_message_bytes_max) {
            return bad(format!(
                "read_message_bytes_max {} not in 1..={VERBS_READ_MESSAGE_BYTES_MAX}",
                self.read_message_bytes_max
            ));
        }
        self.tuning.validate()
    }

    /// The config clamped to `caps` (what the device reports).
    ///
    /// # Errors
    /// [`PlanError::BadConfig`] from [`VerbsConfig::validate`];
    /// [`PlanError::DeviceTooSmall`] when a cap is below 1.
    pub fn effective(&self, caps: &DeviceCaps) -> Result<EffectiveLimits, PlanError> {
        self.validate()?;
        let at_least_1 = |cap: &'static str, value: i64| {
            if value < 1 { Err(PlanError::DeviceTooSmall { cap, value, min: 1 }) } else { Ok(value) }
        };
        let max_qp_wr = at_least_1("max_qp_wr", caps.max_qp_wr)?;
        let max_sge = at_least_1("max_sge", caps.max_sge)?;
        let max_cqe = at_least_1("max_cqe", caps.max_cqe)?;
        let rd = at_least_1("max_qp_init_rd_atom", caps.max_qp_init_rd_atom)?;
        let dest_rd = at_least_1("max_qp_rd_atom", caps.max_qp_rd_atom)?;
        let max_msg = at_least_1("max_msg_sz", caps.max_msg_bytes)?;
        let clamp_u32 = |want: u32, cap: i64| u32::try_from(cap.min(i64::from(want))).unwrap_or(want);
        let clamp_u8 = |want: u8, cap: i64| u8::try_from(cap.min(i64::from(want))).unwrap_or(want);
        let send_queue_depth = clamp_u32(clamp_u32(self.send_queue_depth, max_qp_wr), max_cqe);
        let mut tuning = self.tuning;
        tuning.reads_in_flight = clamp_u8(tuning.reads_in_flight, rd);
        tuning.dest_reads_in_flight = clamp_u8(tuning.dest_reads_in_flight, dest_rd);
        Ok(EffectiveLimits {
            send_queue_depth,
            plan: PlanLimits {
                sges_per_wr: clamp_u32(self.sges_per_wr, max_sge),
                message_bytes_max: self.read_message_bytes_max.min(u64::try_from(max_msg).unwrap_or(1)),
            },
            tuning,
        })
    }
}

/// The device capabilities the backend depends on (`ibv_query_device`), as
/// signed values because that is how verbs reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Work requests per queue.
    pub max_qp_wr: i64,
    /// Scatter/gather entries per send WR.
    pub max_sge: i64,
    /// Completion-queue entries.
    pub max_cqe: i64,
    /// Outstanding READs per QP as initiator.
    pub max_qp_init_rd_atom: i64,
    /// Outstanding READs per QP as responder.
    pub max_qp_rd_atom: i64,
    /// Largest message on the port (`ibv_port_attr.max_msg_sz`), bytes.
    pub max_msg_bytes: i64,
}

/// What the backend actually uses: [`VerbsConfig`] clamped to
/// [`DeviceCaps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveLimits {
    /// Work requests in flight per QP (= CQ depth: every WR is signaled).
    pub send_queue_depth: u32,
    /// Work-request planning limits.
    pub plan: PlanLimits,
    /// Queue pair timing and depths.
    pub tuning: QpTuning,
}

// ---------------------------------------------------------------------------
// MTU.
// ---------------------------------------------------------------------------

/// An InfiniBand path MTU. The discriminants are libibverbs' `enum ibv_mtu`
/// codes (checked against the bindings in the `rdma` build's tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum PathMtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl PathMtu {
    /// From bytes (the handshake's unit); `None` unless 256, 512, 1024, 2048
    /// or 4096.
    pub const fn from_bytes(bytes: u32) -> Option<Self> {
        match bytes {
            256 => Some(PathMtu::Mtu256),
            512 => Some(PathMtu::Mtu512),
            1024 => Some(PathMtu::Mtu1024),
            2048 => Some(PathMtu::Mtu2048),
            4096 => Some(PathMtu::Mtu4096),
            _ => None,
        }
    }

    /// In bytes.
    pub const fn bytes(self) -> u32 {
        match self {
            PathMtu::Mtu256 => 256,
            PathMtu::Mtu512 => 512,
            PathMtu::Mtu1024 => 1024,
            PathMtu::Mtu2048 => 2048,
            PathMtu::Mtu4096 => 4096,
        }
    }

    /// From the `ibv_mtu` code; `None` for anything else (never panics,
    /// unlike `sideway`'s `From<u32>`).
    pub const fn from_ibv(code: u32) -> Option<Self> {
        match code {
            1 => Some(PathMtu::Mtu256),
            2 => Some(PathMtu::Mtu512),
            3 => Some(PathMtu::Mtu1024),
            4 => Some(PathMtu::Mtu2048),
            5 => Some(PathMtu::Mtu4096),
            _ => None,
        }
    }

    /// The `ibv_mtu` code.
    pub const fn ibv(self) -> u32 {
        self as u32
    }
}

const _: () = assert!(PathMtu::Mtu256.bytes() == MTU_BYTES_MIN && PathMtu::Mtu4096.bytes() == MTU_BYTES_MAX);

// ---------------------------------------------------------------------------
// Endpoints and metadata.
// ---------------------------------------------------------------------------

/// What this node's port looks like (`ibv_query_port` + `ibv_query_gid`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalPort {
    /// Physical port, 1-based.
    pub port_num: u8,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID at `gid_index`.
    pub gid: [u8; 16],
    /// GID table index used as the source GID on RoCE.
    pub gid_index: u8,
    /// The port's active MTU.
    pub active_mtu: PathMtu,
}

impl LocalPort {
    /// Checks the port is addressable: a nonzero LID on InfiniBand, a nonzero
    /// GID on RoCE.
    ///
    /// # Errors
    /// [`PlanError::ZeroLocalLid`] / [`PlanError::ZeroGid`].
    pub fn validate(&self) -> Result<(), PlanError> {
        match self.link_layer {
            LinkLayer::InfiniBand if self.lid == 0 => Err(PlanError::ZeroLocalLid),
            LinkLayer::Ethernet if self.gid == [0; 16] => Err(PlanError::ZeroGid("local")),
            _ => Ok(()),
        }
    }

    /// The handshake endpoint offering `qpns` with initial PSN `psn`.
    pub fn endpoint(&self, qpns: Vec<u32>, psn: u32) -> VerbsEndpoint {
        VerbsEndpoint {
            link_layer: self.link_layer,
            lid: self.lid,
            gid: self.gid,
            qpns,
            psn,
            mtu: self.active_mtu.bytes(),
        }
    }
}

/// This node's verbs handshake metadata: `node`, the registered `regions`
/// (with rkeys) and `endpoint`; validated like a received one.
///
/// # Errors
/// Whatever [`HandshakeMetadata::validate`] rejects (an empty QPN list, a bad
/// node address, overlapping regions, …).
pub fn verbs_metadata(
    node: &str,
    regions: Vec<Region>,
    endpoint: VerbsEndpoint,
) -> Result<HandshakeMetadata, HandshakeError> {
    let m = HandshakeMetadata {
        transport: TransportKind::Verbs,
        node: node.to_string(),
        data_addr: String::new(),
        regions,
        verbs: Some(endpoint),
        same_host: None,
    };
    m.validate()?;
    Ok(m)
}

/// A peer's accepted verbs metadata: its endpoint and region table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePeer {
    /// How to reach its queue pairs.
    pub endpoint: VerbsEndpoint,
    /// Its regions by id, with rkeys.
    pub regions: RegionTable,
    /// Path MTU of the pair: the smaller of the two ports'.
    pub path_mtu: PathMtu,
}

/// Accepts a peer's metadata for a connection from `local`: it must be verbs,
/// valid (validated again: a value built in-process never went through
/// decode), on the same link layer, and addressable.
///
/// # Errors
/// [`PlanError::NotVerbs`], [`PlanError::Metadata`],
/// [`PlanError::LinkLayerMismatch`], [`PlanError::ZeroGid`].
pub fn accept_remote(meta: &HandshakeMetadata, local: &LocalPort) -> Result<RemotePeer, PlanError> {
    if meta.transport != TransportKind::Verbs {
        return Err(PlanError::NotVerbs(meta.transport));
    }
    meta.validate()?;
    let endpoint = meta.verbs.clone().ok_or(PlanError::Metadata(HandshakeError::MissingVerbs))?;
    if endpoint.link_layer != local.link_layer {
        return Err(PlanError::LinkLayerMismatch { local: local.link_layer, remote: endpoint.link_layer });
    }
    if endpoint.link_layer == LinkLayer::Ethernet && endpoint.gid == [0; 16] {
        return Err(PlanError::ZeroGid("peer"));
    }
    let remote_mtu =
        PathMtu::from_bytes(endpoint.mtu).ok_or(PlanError::Metadata(HandshakeError::BadMtu(endpoint.mtu)))?;
    let regions = RegionTable::new(&meta.regions)?;
    Ok(RemotePeer { endpoint, regions, path_mtu: remote_mtu.min(local.active_mtu) })
}

/// Pairs our QPNs with the peer's, index by index: `local[i]` talks to
/// `remote[i]`.
///
/// # Errors
/// [`PlanError::QpnCountMismatch`] when the lists differ in length (the
/// answering side makes exactly as many QPs as it was offered).
pub fn pair_qpns(local: &[u32], remote: &[u32]) -> Result<Vec<(u32, u32)>, PlanError> {
    if local.len() != remote.len() || local.is_empty() {
        return Err(PlanError::QpnCountMismatch { local: local.len(), remote: remote.len() });
    }
    Ok(local.iter().copied().zip(remote.iter().copied()).collect())
}

/// Picks an initial PSN from `random` (any `u32`), probing upward past the
/// values `taken` says are in use: offers are told apart by their PSN (see
/// the module doc of `verbs`), so pending ones must differ. Terminates after
/// at most `PSN_QPN_LIMIT` probes; with at most [`crate::limits::VERBS_PENDING_OFFERS_MAX`] taken
/// values it takes at most that many + 1.
pub fn pick_psn(random: u32, taken: impl Fn(u32) -> bool) -> u32 {
    let mut psn = random & (PSN_QPN_LIMIT - 1);
    for _ in 0..PSN_QPN_LIMIT {
        if !taken(psn) {
            return psn;
        }
        psn = (psn + 1) & (PSN_QPN_LIMIT - 1);
    }
    psn
}

// ---------------------------------------------------------------------------
// Regions and rkeys.
// ---------------------------------------------------------------------------

/// A remote address for one READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    /// Virtual address on the peer (`region.base + offset`).
    pub addr: u64,
    /// The region's rkey.
    pub rkey: u32,
}

/// A peer's regions by id: rkey and bounds lookup for every READ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionTable {
    /// Sorted by id, ids unique.
    by_id: Vec<Region>,
}

impl RegionTable {
    /// Builds the table (at most `limits::HANDSHAKE_REGIONS_MAX` regions in
    /// validated metadata).
    ///
    /// # Errors
    /// [`PlanError::DuplicateRegion`].
    pub fn new(regions: &[Region]) -> Result<Self, PlanError> {
        let mut by_id = regions.to_vec();
        by_id.sort_by_key(|r| r.id);
        if let Some(w) = by_id.windows(2).find(|w| w[0].id == w[1].id) {
            return Err(PlanError::DuplicateRegion(w[0].id));
        }
        Ok(RegionTable { by_id })
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether there are no regions.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The region with this id.
    pub fn get(&self, id: u32) -> Option<&Region> {
        self.by_id.binary_search_by_key(&id, |r| r.id).ok().map(|i| &self.by_id[i])
    }

    /// Address and rkey of `len` bytes at `offset` in region `region`.
    ///
    /// # Errors
    /// [`PlanError::UnknownRegion`], [`PlanError::OutOfRegion`] (overflow
    /// included), [`PlanError::EmptyRead`].
    pub fn lookup(&self, region: u32, offset: u64, len: u64) -> Result<RemoteRange, PlanError> {
        if len == 0 {
            return Err(PlanError::EmptyRead);
        }
        let r = self.get(region).ok_or(PlanError::UnknownRegion(region))?;
        let out = || PlanError::OutOfRegion { region, offset, len, region_len: r.len };
        match offset.checked_add(len) {
            Some(end) if end <= r.len => {}
            _ => return Err(out()),
        }
        let addr = r.base.checked_add(offset).ok_or_else(out)?;
        Ok(RemoteRange { addr, rkey: r.rkey })
    }
}

// ---------------------------------------------------------------------------
// Work-request planning.
// ---------------------------------------------------------------------------

/// One local extent as the NIC sees it: its address in the registered
/// arena and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalBuf {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// One scatter/gather entry (a local destination range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Local virtual address.
    pub addr: u64,
    /// Bytes (`≤ message_bytes_max`, so it fits the 32-bit field).
    pub len: u32,
    /// The local memory region's lkey.
    pub lkey: u32,
}

/// One RDMA READ work request: a contiguous remote range scattered, in
/// order, over `sges`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadWr {
    /// Remote start address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Local destinations, filled in order.
    pub sges: Vec<Sge>,
    /// Local extents this WR writes into (ascending, no duplicates): they
    /// fail if it fails.
    pub extents: Vec<usize>,
}

impl ReadWr {
    /// Bytes read (sum of the SGE lengths).
    pub fn len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Whether the WR reads nothing (never true for a planned WR).
    pub fn is_empty(&self) -> bool {
        self.sges.is_empty()
    }
}

/// Limits of one READ work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Scatter/gather entries per WR, ≥ 1.
    pub sges_per_wr: u32,
    /// Bytes per WR (and so per SGE), `1..=`[`VERBS_READ_MESSAGE_BYTES_MAX`].
    pub message_bytes_max: u64,
}

/// One resolved piece: `len` bytes from `remote` into local `addr`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    remote: RemoteRange,
    local: u64,
    len: u64,
    extent: usize,
}

/// Plans the READ work requests of one batch.
///
/// 1. Every op is resolved: remote `(region, offset, len)` → address + rkey
///    through `remote`, local `(extent, offset)` → address through `local`.
/// 2. Pieces are ordered by (rkey, remote address) — the order of READs
///    within a batch does not matter, and sorting puts neighbours next to
///    each other (stable: equal keys keep the caller's order).
/// 3. Each piece is split at `message_bytes_max`.
/// 4. Greedy coalescing into the current WR: a piece that continues the WR's
///    remote range (same rkey, adjacent address, total ≤
///    `message_bytes_max`) extends the last SGE when it is also locally
///    adjacent, else adds an SGE while fewer than `sges_per_wr`; otherwise
///    it starts a new WR.
///
/// Every byte of every op is read exactly once (the tests check this by
/// replaying the plan as memory copies).
///
/// # Errors
/// [`PlanError::BadConfig`] for limits of 0; per op: [`PlanError::EmptyRead`],
/// [`PlanError::LocalOutOfRange`], and the lookup errors of
/// [`RegionTable::lookup`]. Nothing is planned when any op is bad.
pub fn plan_reads(
    ops: &[ReadOp],
    remote: &RegionTable,
    local: &[LocalBuf],
    lkey: u32,
    limits: &PlanLimits,
) -> Result<Vec<ReadWr>, PlanError> {
    if limits.sges_per_wr == 0 || !(1..=VERBS_READ_MESSAGE_BYTES_MAX).contains(&limits.message_bytes_max) {
        return Err(PlanError::BadConfig(format!("plan limits {limits:?}")));
    }
    let mut pieces = Vec::with_capacity(ops.len());
    for op in ops {
        if op.len == 0 {
            return Err(PlanError::EmptyRead);
        }
        let bad_local = || PlanError::LocalOutOfRange { extent: op.local_extent, offset: op.local_offset, len: op.len };
        let buf = local.get(op.local_extent).ok_or_else(bad_local)?;
        match op.local_offset.checked_add(op.len) {
            Some(end) if end <= buf.len => {}
            _ => return Err(bad_local()),
        }
        let local_addr = buf.addr.checked_add(op.local_offset).ok_or_else(bad_local)?;
        let range = remote.lookup(op.region, op.remote_offset, op.len)?;
        pieces.push(Piece { remote: range, local: local_addr, len: op.len, extent: op.local_extent });
    }
    pieces.sort_by_key(|p| (p.remote.rkey, p.remote.addr));

    let max = limits.message_bytes_max;
    let mut wrs: Vec<ReadWr> = Vec::new();
    // Remote end and byte count of the WR being built (the last in `wrs`).
    let mut cur_end = 0u64;
    let mut cur_len = 0u64;
    for p in pieces {
        let mut done = 0u64;
        while done < p.len {
            let len = (p.len - done).min(max);
            let remote_addr = p.remote.addr + done; // ≤ base + region len: no overflow
            let local_addr = p.local + done;
            let sge_len = u32::try_from(len).expect("len ≤ message_bytes_max ≤ 2^30");
            let joins =
                wrs.last().is_some_and(|w| w.rkey == p.remote.rkey && cur_end == remote_addr && cur_len + len <= max);
            match wrs.last_mut() {
                Some(w) if joins => {
                    let last = w.sges.last_mut().expect("a planned WR has an SGE");
                    if last.addr + u64::from(last.len) == local_addr {
                        last.len += sge_len;
                    } else if w.sges.len() < limits.sges_per_wr as usize {
                        w.sges.push(Sge { addr: local_addr, len: sge_len, lkey });
                    } else {
                        wrs.push(new_wr(p.remote.rkey, remote_addr, local_addr, sge_len, lkey, p.extent));
                        cur_len = 0;
                    }
                    if let Some(w) = wrs.last_mut() {
                        if w.extents.last() != Some(&p.extent) {
                            w.extents.push(p.extent);
                        }
                    }
                }
                _ => {
                    wrs.push(new_wr(p.remote.rkey, remote_addr, local_addr, sge_len, lkey, p.extent));
                    cur_len = 0;
                }
            }
            cur_len += len;
            cur_end = remote_addr + len;
            done += len;
        }
    }
    for w in &mut wrs {
        w.extents.sort_unstable();
        w.extents.dedup();
    }
    Ok(wrs)
}

fn new_wr(rkey: u32, remote_addr: u64, local_addr: u64, len: u32, lkey: u32, extent: usize) -> ReadWr {
    ReadWr { remote_addr, rkey, sges: vec![Sge { addr: local_addr, len, lkey }], extents: vec![extent] }
}

/// Spreads WRs over `qps` queue pairs, balancing bytes: each WR (in plan
/// order) goes to the QP with the fewest bytes so far, ties to the first
/// counted from `start` (so successive batches start on different QPs).
/// Returns, per QP, the WR indices in plan order; `qps == 0` is treated as 1.
pub fn spread_over_qps(wrs: &[ReadWr], qps: usize, start: usize) -> Vec<Vec<usize>> {
    let qps = qps.max(1);
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); qps];
    let mut bytes = vec![0u64; qps];
    for (i, w) in wrs.iter().enumerate() {
        let q = (0..qps).map(|k| (start + k) % qps).min_by_key(|&q| bytes[q]).expect("qps ≥ 1");
        bytes[q] += w.len();
        out[q].push(i);
    }
    out
}

// ---------------------------------------------------------------------------
// Queue pair state plan.
// ---------------------------------------------------------------------------

/// RESET → INIT attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttrs {
    /// Physical port.
    pub port_num: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// Whether peers may READ through this QP (always: the QP serves READs
    /// on the responder side).
    pub remote_read: bool,
}

/// The global route header of a RoCE (or routed InfiniBand) address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grh {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Source GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
}

/// Where the peer QP is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// Destination LID (InfiniBand; 0 on RoCE).
    pub dlid: u16,
    /// Service level.
    pub service_level: u8,
    /// Local physical port.
    pub port_num: u8,
    /// Global route: required on RoCE, absent on a local IB subnet.
    pub grh: Option<Grh>,
}

/// INIT → RTR (ready to receive) attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttrs {
    /// Path MTU of the pair.
    pub path_mtu: PathMtu,
    /// The peer's QPN.
    pub dest_qpn: u32,
    /// Expected PSN of the peer's first request (its initial PSN).
    pub rq_psn: u32,
    /// Outstanding READs we accept as responder.
    pub max_dest_rd_atomic: u8,
    /// Minimal RNR NAK timer.
    pub min_rnr_timer: u8,
    /// The peer's address.
    pub av: AddressVector,
}

/// RTR → RTS (ready to send) attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttrs {
    /// Our initial send PSN.
    pub sq_psn: u32,
    /// Local ACK timeout exponent.
    pub timeout_exp: u8,
    /// Transport retries.
    pub retry_count: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// Outstanding READs as initiator.
    pub max_rd_atomic: u8,
}

/// Queue pair states the plan walks through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Bound to a port; can be connected.
    Init,
    /// Connected to the peer QP; serves READs as responder.
    ReadyToReceive,
    /// Can also post READs.
    ReadyToSend,
}

/// The whole RESET → INIT → RTR → RTS plan of one RC queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpPlan {
    /// RESET → INIT.
    pub init: InitAttrs,
    /// INIT → RTR.
    pub rtr: RtrAttrs,
    /// RTR → RTS.
    pub rts: RtsAttrs,
}

impl QpPlan {
    /// The transitions in the order they must be applied.
    pub const TRANSITIONS: [(QpState, QpState); 3] = [
        (QpState::Reset, QpState::Init),
        (QpState::Init, QpState::ReadyToReceive),
        (QpState::ReadyToReceive, QpState::ReadyToSend),
    ];
}

/// RESET → INIT attributes for a QP on `local` (done when the QP is created,
/// before its peer is known).
pub fn plan_qp_init(local: &LocalPort, tuning: &QpTuning) -> InitAttrs {
    InitAttrs { port_num: local.port_num, pkey_index: tuning.pkey_index, remote_read: true }
}

/// Plans one RC queue pair of `local` (initial PSN `local_psn`) talking to
/// the peer QP `remote_qpn` of `remote`.
///
/// RoCE addresses the peer by GID (a GRH with `local.gid_index` as source),
/// InfiniBand by LID. Both PSN directions come from the handshake: our send
/// PSN is `local_psn`, the PSN we expect is the peer's.
///
/// # Errors
/// [`PlanError::BadConfig`] from [`QpTuning::validate`],
/// [`PlanError::Metadata`] for a QPN or PSN out of 24 bits,
/// [`PlanError::LinkLayerMismatch`], [`PlanError::ZeroGid`],
/// [`PlanError::ZeroLocalLid`].
pub fn plan_qp(
    local: &LocalPort,
    local_psn: u32,
    remote: &RemotePeer,
    remote_qpn: u32,
    tuning: &QpTuning,
) -> Result<QpPlan, PlanError> {
    tuning.validate()?;
    local.validate()?;
    if local_psn >= PSN_QPN_LIMIT {
        return Err(PlanError::Metadata(HandshakeError::BadPsn(local_psn)));
    }
    if remote_qpn >= PSN_QPN_LIMIT {
        return Err(PlanError::Metadata(HandshakeError::BadQpn(remote_qpn)));
    }
    let ep = &remote.endpoint;
    if ep.psn >= PSN_QPN_LIMIT {
        return Err(PlanError::Metadata(HandshakeError::BadPsn(ep.psn)));
    }
    if ep.link_layer != local.link_layer {
        return Err(PlanError::LinkLayerMismatch { local: local.link_layer, remote: ep.link_layer });
    }
    let grh = match ep.link_layer {
        LinkLayer::Ethernet if ep.gid == [0; 16] => return Err(PlanError::ZeroGid("peer")),
        LinkLayer::Ethernet => Some(Grh {
            dgid: ep.gid,
            sgid_index: local.gid_index,
            hop_limit: tuning.hop_limit,
            traffic_class: tuning.traffic_class,
            flow_label: 0,
        }),
        LinkLayer::InfiniBand => None,
    };
    let dlid = match ep.link_layer {
        LinkLayer::InfiniBand => ep.lid,
        LinkLayer::Ethernet => 0,
    };
    Ok(QpPlan {
        init: plan_qp_init(local, tuning),
        rtr: RtrAttrs {
            path_mtu: remote.path_mtu.min(local.active_mtu),
            dest_qpn: remote_qpn,
            rq_psn: ep.psn,
            max_dest_rd_atomic: tuning.dest_reads_in_flight,
            min_rnr_timer: tuning.min_rnr_timer,
            av: AddressVector { dlid, service_level: tuning.service_level, port_num: local.port_num, grh },
        },
        rts: RtsAttrs {
            sq_psn: local_psn,
            timeout_exp: tuning.timeout_exp,
            retry_count: tuning.retry_count,
            rnr_retry: tuning.rnr_retry,
            max_rd_atomic: tuning.reads_in_flight,
        },
    })
}

// ---------------------------------------------------------------------------
// Completions.
// ---------------------------------------------------------------------------

/// A work-request id: the batch generation in the high 32 bits, the WR's
/// index in the batch in the low 32 (a completion of another batch is then
/// recognised, not misattributed).
pub const fn encode_wr_id(generation: u32, index: u32) -> u64 {
    ((generation as u64) << 32) | index as u64
}

/// Inverse of [`encode_wr_id`]: `(generation, index)`.
pub const fn decode_wr_id(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32)
}

/// libibverbs' `IBV_WC_SUCCESS`.
pub const WC_SUCCESS: u32 = 0;
/// libibverbs' `IBV_WC_WR_FLUSH_ERR`: flushed because the QP failed earlier.
pub const WC_WR_FLUSH_ERR: u32 = 5;
/// libibverbs' `IBV_WC_REM_ACCESS_ERR`: the peer NIC refused the rkey/range.
pub const WC_REM_ACCESS_ERR: u32 = 10;
/// libibverbs' `IBV_WC_RETRY_EXC_ERR`: no answer from the peer.
pub const WC_RETRY_EXC_ERR: u32 = 12;

/// Name of a work-completion status code (`enum ibv_wc_status`); never
/// panics (unlike `sideway`'s `From<u32>`), unknown codes are `"UNKNOWN"`.
pub const fn wc_status_name(status: u32) -> &'static str {
    match status {
        0 => "SUCCESS",
        1 => "LOC_LEN_ERR",
        2 => "LOC_QP_OP_ERR",
        3 => "LOC_EEC_OP_ERR",
        4 => "LOC_PROT_ERR",
        5 => "WR_FLUSH_ERR",
        6 => "MW_BIND_ERR",
        7 => "BAD_RESP_ERR",
        8 => "LOC_ACCESS_ERR",
        9 => "REM_INV_REQ_ERR",
        10 => "REM_ACCESS_ERR",
        11 => "REM_OP_ERR",
        12 => "RETRY_EXC_ERR",
        13 => "RNR_RETRY_EXC_ERR",
        14 => "LOC_RDD_VIOL_ERR",
        15 => "REM_INV_RD_REQ_ERR",
        16 => "REM_ABORT_ERR",
        17 => "INV_EECN_ERR",
        18 => "INV_EEC_STATE_ERR",
        19 => "FATAL_ERR",
        20 => "RESP_TIMEOUT_ERR",
        21 => "GENERAL_ERR",
        22 => "TM_ERR",
        23 => "TM_RNDV_INCOMPLETE",
        _ => "UNKNOWN",
    }
}

/// The transport error of a failed work completion. Every error completion
/// leaves the QP in the error state, so every one is an
/// [`TransportError::Io`] (the connection is gone), with a hint for the
/// common ones.
pub fn wc_failure(status: u32, vendor_err: u32) -> TransportError {
    let hint = match status {
        WC_WR_FLUSH_ERR => ": flushed, the queue pair failed earlier",
        WC_REM_ACCESS_ERR => ": the peer NIC refused the rkey or address range (peer restarted or re-registered?)",
        WC_RETRY_EXC_ERR => ": no answer from the peer (down, or its queue pair is gone)",
        9 => ": the peer rejected the request (READ not enabled, or too many outstanding READs)",
        4 | 8 => ": the local buffer is not in the registered region",
        _ => "",
    };
    TransportError::io(
        std::io::ErrorKind::ConnectionAborted,
        format!(
            "rdma work completion {} (status {status}, vendor error {vendor_err:#x}){hint}",
            wc_status_name(status)
        ),
    )
}

/// One completion as polled from the CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Work-request id ([`encode_wr_id`]).
    pub wr_id: u64,
    /// `ibv_wc_status` code.
    pub status: u32,
    /// Vendor syndrome.
    pub vendor_err: u32,
}

/// What a completion did to the tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tracked {
    /// Counted; the WR succeeded.
    Ok,
    /// Counted; the WR failed (the QP is now in the error state).
    Failed,
    /// Not ours (another generation, an index out of range, or a second
    /// completion for the same WR): ignored.
    Stray,
}

/// The completion state of one batch of WRs on one QP (pure: the device
/// code feeds it polled completions).
///
/// Two things are tracked per WR, separately: its *result* (set by its
/// completion, or earlier by [`WrTracker::fail`] when the batch gives up on
/// it, e.g. at the deadline), and whether the *hardware* is done with it (its
/// completion arrived). The device code must not let go of the local
/// buffers before every posted WR is done in hardware (C11), even when the
/// results were settled long before.
#[derive(Debug, Clone)]
pub struct WrTracker {
    generation: u32,
    results: Vec<Option<Result<(), TransportError>>>,
    hw_done: Vec<bool>,
    hw_completed: usize,
    settled: usize,
    failed: usize,
}

impl WrTracker {
    /// `n` pending WRs of batch `generation`.
    pub fn new(generation: u32, n: usize) -> Self {
        WrTracker {
            generation,
            results: vec![None; n],
            hw_done: vec![false; n],
            hw_completed: 0,
            settled: 0,
            failed: 0,
        }
    }

    /// The id of WR `index` ([`encode_wr_id`]).
    pub fn wr_id(&self, index: usize) -> u64 {
        encode_wr_id(self.generation, u32::try_from(index).unwrap_or(u32::MAX))
    }

    /// Records a completion: the hardware is done with the WR, and its result
    /// is the completion's status unless it was settled before.
    pub fn on_completion(&mut self, c: Completion) -> Tracked {
        let (generation, index) = decode_wr_id(c.wr_id);
        let i = index as usize;
        if generation != self.generation || i >= self.hw_done.len() || self.hw_done[i] {
            return Tracked::Stray;
        }
        self.hw_done[i] = true;
        self.hw_completed += 1;
        if c.status == WC_SUCCESS {
            self.settle(i, Ok(()));
            Tracked::Ok
        } else {
            self.settle(i, Err(wc_failure(c.status, c.vendor_err)));
            Tracked::Failed
        }
    }

    fn settle(&mut self, i: usize, r: Result<(), TransportError>) {
        if let Some(slot @ None) = self.results.get_mut(i) {
            if r.is_err() {
                self.failed += 1;
            }
            *slot = Some(r);
            self.settled += 1;
        }
    }

    /// Settles WR `index` as failed with `e` unless it already has a result
    /// (the hardware may still be working on it).
    pub fn fail(&mut self, index: usize, e: TransportError) {
        self.settle(index, Err(e));
    }

    /// Settles every WR without a result as failed with `e`.
    pub fn fail_pending(&mut self, e: &TransportError) {
        for i in 0..self.results.len() {
            self.fail(i, e.clone());
        }
    }

    /// WRs whose completion arrived.
    pub fn hw_completed(&self) -> usize {
        self.hw_completed
    }

    /// Whether every WR has a result.
    pub fn all_settled(&self) -> bool {
        self.settled == self.results.len()
    }

    /// Whether any WR failed.
    pub fn any_failed(&self) -> bool {
        self.failed > 0
    }

    /// WR `index`'s result; `None` while pending.
    pub fn result(&self, index: usize) -> Option<Result<(), TransportError>> {
        self.results.get(index).cloned().flatten()
    }

    /// Every WR's result, in index order.
    pub fn into_results(self) -> Vec<Option<Result<(), TransportError>>> {
        self.results
    }
}

/// Per-extent results of a batch: an extent is `Ok` when every WR writing
/// into it succeeded (an extent no WR touches is `Ok`, as in the TCP
/// backend); otherwise it carries the error of its first failed WR in plan
/// order. `wr_results[i]` is WR `i`'s result; a missing result counts as
/// failed with `missing`.
pub fn extent_results(
    wrs: &[ReadWr],
    wr_results: &[Option<Result<(), TransportError>>],
    n_extents: usize,
    missing: &TransportError,
) -> Vec<Result<(), TransportError>> {
    let mut out: Vec<Result<(), TransportError>> = vec![Ok(()); n_extents];
    for (i, w) in wrs.iter().enumerate() {
        let r = match wr_results.get(i) {
            Some(Some(r)) => r.clone(),
            _ => Err(missing.clone()),
        };
        if let Err(e) = r {
            for &x in &w.extents {
                if let Some(slot @ Ok(())) = out.get_mut(x) {
                    *slot = Err(e.clone());
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Handshake offers.
// ---------------------------------------------------------------------------

/// Queue pairs offered in a handshake (`local_metadata`) and waiting for the
/// answer that connects them, keyed by the offer's PSN (the answering side
/// echoes it). Bounded: at most `cap` offers, each at most `ttl` old; what
/// falls out is handed back to be dropped (destroying its QPs).
#[derive(Debug)]
pub struct OfferTable<T> {
    offers: Vec<(u32, Instant, T)>,
    cap: usize,
    ttl: Duration,
}

impl<T> OfferTable<T> {
    /// An empty table (`cap` ≥ 1).
    pub fn new(cap: usize, ttl: Duration) -> Self {
        OfferTable { offers: Vec::new(), cap: cap.max(1), ttl }
    }

    /// Pending offers.
    pub fn len(&self) -> usize {
        self.offers.len()
    }

    /// Whether none is pending.
    pub fn is_empty(&self) -> bool {
        self.offers.is_empty()
    }

    /// Whether an offer with this PSN is pending.
    pub fn contains(&self, psn: u32) -> bool {
        self.offers.iter().any(|(p, _, _)| *p == psn)
    }

    /// Removes offers older than the TTL at `now`; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<T> {
        let ttl = self.ttl;
        let (keep, gone): (Vec<_>, Vec<_>) = std::mem::take(&mut self.offers)
            .into_iter()
            .partition(|(_, at, _)| now.saturating_duration_since(*at) < ttl);
        self.offers = keep;
        gone.into_iter().map(|(_, _, t)| t).collect()
    }

    /// Adds an offer (its PSN must not be pending: use [`pick_psn`] with
    /// [`OfferTable::contains`]); expires old ones and drops the oldest
    /// beyond the cap. Returns what fell out.
    pub fn insert(&mut self, psn: u32, item: T, now: Instant) -> Vec<T> {
        let mut out = self.expire(now);
        if let Some(i) = self.offers.iter().position(|(p, _, _)| *p == psn) {
            out.push(self.offers.remove(i).2);
        }
        while self.offers.len() >= self.cap {
            out.push(self.offers.remove(0).2);
        }
        self.offers.push((psn, now, item));
        out
    }

    /// Takes the offer with this PSN, if pending and not expired at `now`.
    pub fn take(&mut self, psn: u32, now: Instant) -> Option<T> {
        let i = self.offers.iter().position(|(p, _, _)| *p == psn)?;
        let (_, at, item) = self.offers.remove(i);
        (now.saturating_duration_since(at) < self.ttl).then_some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::SplitMix64;

    fn ib_port() -> LocalPort {
        LocalPort {
            port_num: 1,
            link_layer: LinkLayer::InfiniBand,
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            gid_index: 0,
            active_mtu: PathMtu::Mtu4096,
        }
    }

    fn roce_port() -> LocalPort {
        LocalPort {
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2],
            gid_index: 3,
            active_mtu: PathMtu::Mtu1024,
            ..ib_port()
        }
    }

    fn region(id: u32, base: u64, len: u64, rkey: u32) -> Region {
        Region { id, base, len, rkey }
    }

    fn op(region: u32, remote_offset: u64, len: u64, local_extent: usize, local_offset: u64) -> ReadOp {
        ReadOp { region, remote_offset, len, local_extent, local_offset }
    }

    const LIMITS: PlanLimits = PlanLimits { sges_per_wr: 4, message_bytes_max: VERBS_READ_MESSAGE_BYTES_MAX };

    // -- config ------------------------------------------------------------

    #[test]
    fn config_defaults_validate_and_bad_values_are_named() {
        let c = VerbsConfig::new("mlx5_0");
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.qps_per_peer, VERBS_QPS_PER_PEER_DEFAULT);
        let cases: Vec<(VerbsConfig, &str)> = vec![
            (VerbsConfig::new(""), "device name"),
            (VerbsConfig { port: 0, ..c.clone() }, "port"),
            (VerbsConfig { qps_per_peer: 0, ..c.clone() }, "qps_per_peer"),
            (VerbsConfig { qps_per_peer: VERBS_QPS_PER_PEER_MAX + 1, ..c.clone() }, "qps_per_peer"),
            (VerbsConfig { send_queue_depth: 0, ..c.clone() }, "send_queue_depth"),
            (VerbsConfig { sges_per_wr: 0, ..c.clone() }, "sges_per_wr"),
            (VerbsConfig { read_message_bytes_max: 0, ..c.clone() }, "read_message_bytes_max"),
            (VerbsConfig { read_message_bytes_max: VERBS_READ_MESSAGE_BYTES_MAX + 1, ..c.clone() }, "read_message"),
            (VerbsConfig { tuning: QpTuning { timeout_exp: 32, ..c.tuning }, ..c.clone() }, "timeout_exp"),
            (VerbsConfig { tuning: QpTuning { retry_count: 8, ..c.tuning }, ..c.clone() }, "retry_count"),
            (VerbsConfig { tuning: QpTuning { rnr_retry: 8, ..c.tuning }, ..c.clone() }, "rnr_retry"),
            (VerbsConfig { tuning: QpTuning { min_rnr_timer: 32, ..c.tuning }, ..c.clone() }, "min_rnr_timer"),
            (VerbsConfig { tuning: QpTuning { reads_in_flight: 0, ..c.tuning }, ..c.clone() }, "reads_in_flight"),
            (VerbsConfig { tuning: QpTuning { service_level: 16, ..c.tuning }, ..c.clone() }, "service_level"),
        ];
        for (cfg, field) in cases {
            match cfg.validate() {
                Err(PlanError::BadConfig(msg)) => assert!(msg.contains(field), "{msg} should name {field}"),
                other => panic!("{cfg:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn effective_limits_clamp_to_device_caps() {
        let caps = DeviceCaps {
            max_qp_wr: 128,
            max_sge: 2,
            max_cqe: 100,
            max_qp_init_rd_atom: 8,
            max_qp_rd_atom: 4,
            max_msg_bytes: 1 << 20,
        };
        let e = VerbsConfig::new("mlx5_0").effective(&caps).unwrap();
        assert_eq!(e.send_queue_depth, 100);
        assert_eq!(e.plan.sges_per_wr, 2);
        assert_eq!(e.plan.message_bytes_max, 1 << 20);
        assert_eq!(e.tuning.reads_in_flight, 8);
        assert_eq!(e.tuning.dest_reads_in_flight, 4);
        // Large caps leave the config alone.
        let big = DeviceCaps {
            max_qp_wr: 1 << 15,
            max_sge: 30,
            max_cqe: 1 << 22,
            max_qp_init_rd_atom: 64,
            max_qp_rd_atom: 64,
            max_msg_bytes: 1 << 31,
        };
        let e = VerbsConfig::new("mlx5_0").effective(&big).unwrap();
        assert_eq!(e.send_queue_depth, VERBS_SEND_QUEUE_DEPTH_DEFAULT);
        assert_eq!(e.plan.message_bytes_max, VERBS_READ_MESSAGE_BYTES_MAX);
        assert_eq!(e.plan.sges_per_wr, VERBS_SGES_PER_WR_DEFAULT);
        assert_eq!(e.tuning, QpTuning::default());
        // A zero cap is a clear error.
        assert_eq!(
            VerbsConfig::new("mlx5_0").effective(&DeviceCaps { max_sge: 0, ..big }),
            Err(PlanError::DeviceTooSmall { cap: "max_sge", value: 0, min: 1 })
        );
        assert_eq!(
            VerbsConfig::new("mlx5_0").effective(&DeviceCaps { max_qp_rd_atom: -1, ..big }),
            Err(PlanError::DeviceTooSmall { cap: "max_qp_rd_atom", value: -1, min: 1 })
        );
    }

    // -- MTU ---------------------------------------------------------------

    #[test]
    fn mtu_maps_bytes_and_ibv_codes_both_ways() {
        let all = [PathMtu::Mtu256, PathMtu::Mtu512, PathMtu::Mtu1024, PathMtu::Mtu2048, PathMtu::Mtu4096];
        for (i, m) in all.iter().enumerate() {
            assert_eq!(m.bytes(), 256 << i);
            assert_eq!(m.ibv(), i as u32 + 1);
            assert_eq!(PathMtu::from_bytes(m.bytes()), Some(*m));
            assert_eq!(PathMtu::from_ibv(m.ibv()), Some(*m));
        }
        for bad in [0, 1, 128, 255, 257, 1000, 8192, u32::MAX] {
            assert_eq!(PathMtu::from_bytes(bad), None, "{bad}");
        }
        for bad in [0, 6, 7, u32::MAX] {
            assert_eq!(PathMtu::from_ibv(bad), None, "{bad}");
        }
        assert!(PathMtu::Mtu1024 < PathMtu::Mtu4096);
        assert_eq!(PathMtu::Mtu4096.min(PathMtu::Mtu1024), PathMtu::Mtu1024);
    }

    // -- endpoint ↔ metadata -------------------------------------------------

    #[test]
    fn local_metadata_round_trips_through_the_wire_format() {
        let port = ib_port();
        let regions = vec![region(0, 0x7f00_0000_0000, 1 << 30, 0xabcd)];
        let m = verbs_metadata("10.0.0.1:50055", regions.clone(), port.endpoint(vec![0x11, 0x12], 0x4242)).unwrap();
        assert_eq!(m.transport, TransportKind::Verbs);
        assert!(m.data_addr.is_empty());
        let v = m.verbs.as_ref().unwrap();
        assert_eq!((v.lid, v.gid, v.mtu, v.psn), (7, port.gid, 4096, 0x4242));
        assert_eq!(v.qpns, vec![0x11, 0x12]);
        assert_eq!(HandshakeMetadata::decode(&m.encode()), Ok(m.clone()));
        // And the peer side accepts it.
        let r = accept_remote(&m, &ib_port()).unwrap();
        assert_eq!(r.endpoint, *v);
        assert_eq!(r.regions.get(0), Some(&regions[0]));
        assert_eq!(r.path_mtu, PathMtu::Mtu4096);
    }

    #[test]
    fn local_metadata_is_validated() {
        let port = ib_port();
        let r = vec![region(0, 0x1000, 0x1000, 1)];
        assert_eq!(verbs_metadata("10.0.0.1:1", r.clone(), port.endpoint(vec![], 1)), Err(HandshakeError::NoQpns));
        assert_eq!(
            verbs_metadata("10.0.0.1:1", r.clone(), port.endpoint(vec![PSN_QPN_LIMIT], 1)),
            Err(HandshakeError::BadQpn(PSN_QPN_LIMIT))
        );
        assert_eq!(
            verbs_metadata("no-port", r, port.endpoint(vec![1], 1)),
            Err(HandshakeError::BadAddr { field: "node" })
        );
        let mut p = ib_port();
        p.lid = 0;
        assert_eq!(p.validate(), Err(PlanError::ZeroLocalLid));
        let mut p = roce_port();
        assert_eq!(p.validate(), Ok(()));
        p.gid = [0; 16];
        assert_eq!(p.validate(), Err(PlanError::ZeroGid("local")));
    }

    #[test]
    fn accept_remote_rejects_what_it_cannot_connect_to() {
        let good = verbs_metadata("10.0.0.2:1", vec![region(0, 0, 64, 9)], roce_port().endpoint(vec![5], 6)).unwrap();
        assert!(accept_remote(&good, &roce_port()).is_ok());
        // Path MTU is the smaller one.
        let mut big = roce_port();
        big.active_mtu = PathMtu::Mtu4096;
        assert_eq!(accept_remote(&good, &big).unwrap().path_mtu, PathMtu::Mtu1024);
        // Link layer.
        assert_eq!(
            accept_remote(&good, &ib_port()),
            Err(PlanError::LinkLayerMismatch { local: LinkLayer::InfiniBand, remote: LinkLayer::Ethernet })
        );
        // Not verbs.
        let tcp = HandshakeMetadata {
            transport: TransportKind::Tcp,
            node: "10.0.0.2:1".into(),
            data_addr: "10.0.0.2:2".into(),
            regions: vec![],
            verbs: None,
            same_host: None,
        };
        assert_eq!(accept_remote(&tcp, &roce_port()), Err(PlanError::NotVerbs(TransportKind::Tcp)));
        // Invalid (built in-process, never decoded): overlapping regions, zero LID.
        let mut bad = good.clone();
        bad.regions.push(region(1, 32, 64, 9));
        assert_eq!(
            accept_remote(&bad, &roce_port()),
            Err(PlanError::Metadata(HandshakeError::OverlappingRegions { a: 0, b: 1 }))
        );
        let mut bad = verbs_metadata("10.0.0.2:1", vec![], ib_port().endpoint(vec![5], 6)).unwrap();
        bad.verbs.as_mut().unwrap().lid = 0;
        assert_eq!(accept_remote(&bad, &ib_port()), Err(PlanError::Metadata(HandshakeError::ZeroLidOnInfiniBand)));
        // A RoCE peer with a zero GID cannot be routed to.
        let mut bad = good;
        bad.verbs.as_mut().unwrap().gid = [0; 16];
        assert_eq!(accept_remote(&bad, &roce_port()), Err(PlanError::ZeroGid("peer")));
        // Errors map to handshake errors of the trait.
        assert!(matches!(TransportError::from(PlanError::ZeroGid("peer")), TransportError::Handshake(_)));
        assert!(matches!(TransportError::from(PlanError::UnknownRegion(3)), TransportError::BadOp(_)));
    }

    #[test]
    fn qpns_pair_index_by_index() {
        assert_eq!(pair_qpns(&[1, 2], &[10, 20]), Ok(vec![(1, 10), (2, 20)]));
        assert_eq!(pair_qpns(&[1, 2], &[10]), Err(PlanError::QpnCountMismatch { local: 2, remote: 1 }));
        assert_eq!(pair_qpns(&[], &[]), Err(PlanError::QpnCountMismatch { local: 0, remote: 0 }));
    }

    #[test]
    fn psn_picking_is_24_bit_and_skips_taken_values() {
        assert_eq!(pick_psn(5, |_| false), 5);
        assert_eq!(pick_psn(u32::MAX, |_| false), PSN_QPN_LIMIT - 1);
        assert_eq!(pick_psn(5, |p| p == 5 || p == 6), 7);
        // Wraps inside 24 bits.
        assert_eq!(pick_psn(PSN_QPN_LIMIT - 1, |p| p == PSN_QPN_LIMIT - 1), 0);
    }

    // -- regions -----------------------------------------------------------

    #[test]
    fn region_lookup_checks_id_bounds_and_overflow() {
        let t = RegionTable::new(&[region(7, 0x1000, 0x100, 70), region(2, u64::MAX - 0xff, 0x100, 20)]).unwrap();
        assert_eq!(t.len(), 2);
        assert!(!t.is_empty());
        assert_eq!(t.lookup(7, 0, 0x100), Ok(RemoteRange { addr: 0x1000, rkey: 70 }));
        assert_eq!(t.lookup(7, 0xff, 1), Ok(RemoteRange { addr: 0x10ff, rkey: 70 }));
        assert_eq!(t.lookup(2, 0xff, 1), Ok(RemoteRange { addr: u64::MAX, rkey: 20 }));
        assert_eq!(t.lookup(3, 0, 1), Err(PlanError::UnknownRegion(3)));
        assert_eq!(t.lookup(7, 0, 0), Err(PlanError::EmptyRead));
        let oor = |offset, len| PlanError::OutOfRegion { region: 7, offset, len, region_len: 0x100 };
        assert_eq!(t.lookup(7, 0x100, 1), Err(oor(0x100, 1)));
        assert_eq!(t.lookup(7, 1, 0x100), Err(oor(1, 0x100)));
        assert_eq!(t.lookup(7, u64::MAX, 2), Err(oor(u64::MAX, 2)));
        assert_eq!(RegionTable::new(&[region(1, 0, 1, 0), region(1, 8, 1, 0)]), Err(PlanError::DuplicateRegion(1)));
        assert!(RegionTable::new(&[]).unwrap().is_empty());
    }

    // -- work-request planning ----------------------------------------------

    /// Replays a plan as memory copies from a fake remote memory into fake
    /// local memory, and checks every op's bytes landed where it asked.
    fn check_plan_moves_every_byte(ops: &[ReadOp], regions: &[Region], local: &[LocalBuf], wrs: &[ReadWr]) {
        // Fake memories: remote byte at address a = hash(a); local starts 0.
        let remote_byte = |a: u64| (a.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8;
        let mut mem: std::collections::HashMap<u64, u8> = Default::default();
        for w in wrs {
            let mut ra = w.remote_addr;
            for s in &w.sges {
                for i in 0..u64::from(s.len) {
                    assert!(mem.insert(s.addr + i, remote_byte(ra + i)).is_none(), "local byte written twice");
                }
                ra += u64::from(s.len);
            }
        }
        let table = RegionTable::new(regions).unwrap();
        let mut expected = 0usize;
        for o in ops {
            let r = table.lookup(o.region, o.remote_offset, o.len).unwrap();
            let la = local[o.local_extent].addr + o.local_offset;
            for i in 0..o.len {
                assert_eq!(mem.get(&(la + i)), Some(&remote_byte(r.addr + i)), "op {o:?} byte {i}");
            }
            expected += o.len as usize;
        }
        assert_eq!(mem.len(), expected, "bytes written outside the ops");
    }

    fn check_limits(wrs: &[ReadWr], limits: &PlanLimits, lkey: u32) {
        for w in wrs {
            assert!(!w.is_empty());
            assert!(w.sges.len() <= limits.sges_per_wr as usize);
            assert!(w.len() <= limits.message_bytes_max);
            assert!(w.sges.iter().all(|s| s.len > 0 && s.lkey == lkey));
            assert!(w.extents.windows(2).all(|x| x[0] < x[1]));
        }
    }

    #[test]
    fn one_op_one_wr() {
        let regions = [region(0, 0x10_0000, 0x1_0000, 0x77)];
        let local = [LocalBuf { addr: 0x90_0000, len: 0x1000 }];
        let t = RegionTable::new(&regions).unwrap();
        let ops = [op(0, 0x100, 0x800, 0, 0x10)];
        let wrs = plan_reads(&ops, &t, &local, 0x55, &LIMITS).unwrap();
        assert_eq!(
            wrs,
            vec![ReadWr {
                remote_addr: 0x10_0100,
                rkey: 0x77,
                sges: vec![Sge { addr: 0x90_0010, len: 0x800, lkey: 0x55 }],
                extents: vec![0],
            }]
        );
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
    }

    #[test]
    fn contiguous_on_both_sides_coalesces_into_one_sge() {
        let regions = [region(0, 0, 1 << 20, 1)];
        let local = [LocalBuf { addr: 1 << 30, len: 4096 }];
        let t = RegionTable::new(&regions).unwrap();
        // K then V of one slot, given out of order.
        let ops = [op(0, 2048, 2048, 0, 2048), op(0, 0, 2048, 0, 0)];
        let wrs = plan_reads(&ops, &t, &local, 9, &LIMITS).unwrap();
        assert_eq!(wrs.len(), 1);
        assert_eq!(wrs[0].sges, vec![Sge { addr: 1 << 30, len: 4096, lkey: 9 }]);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
    }

    #[test]
    fn remote_contiguous_local_scattered_becomes_one_wr_with_several_sges() {
        // Three adjacent blocks on the server, three separate extents here.
        let regions = [region(0, 0x1000, 0x10_0000, 3)];
        let local: Vec<LocalBuf> = (0..3).map(|i| LocalBuf { addr: 0x80_0000 + i * 0x1_0000, len: 0x400 }).collect();
        let t = RegionTable::new(&regions).unwrap();
        let ops: Vec<ReadOp> = (0..3).map(|i| op(0, i * 0x400, 0x400, i as usize, 0)).collect();
        let wrs = plan_reads(&ops, &t, &local, 1, &LIMITS).unwrap();
        assert_eq!(wrs.len(), 1);
        assert_eq!(wrs[0].remote_addr, 0x1000);
        assert_eq!(wrs[0].sges.len(), 3);
        assert_eq!(wrs[0].extents, vec![0, 1, 2]);
        assert_eq!(wrs[0].len(), 0xC00);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
        // With one SGE per WR: three WRs.
        let one = PlanLimits { sges_per_wr: 1, ..LIMITS };
        let wrs = plan_reads(&ops, &t, &local, 1, &one).unwrap();
        assert_eq!(wrs.len(), 3);
        check_limits(&wrs, &one, 1);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
    }

    #[test]
    fn sge_limit_starts_a_new_wr() {
        let regions = [region(0, 0, 1 << 20, 3)];
        let local: Vec<LocalBuf> = (0..10).map(|i| LocalBuf { addr: 0x80_0000 + i * 0x1_0000, len: 0x100 }).collect();
        let t = RegionTable::new(&regions).unwrap();
        let ops: Vec<ReadOp> = (0..10).map(|i| op(0, i * 0x100, 0x100, i as usize, 0)).collect();
        let wrs = plan_reads(&ops, &t, &local, 1, &LIMITS).unwrap();
        assert_eq!(wrs.iter().map(|w| w.sges.len()).collect::<Vec<_>>(), vec![4, 4, 2]);
        assert_eq!(wrs[1].remote_addr, 0x400);
        check_limits(&wrs, &LIMITS, 1);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
    }

    #[test]
    fn message_limit_splits_long_reads_and_caps_coalescing() {
        let regions = [region(0, 0, 1 << 20, 3)];
        let local = [LocalBuf { addr: 1 << 40, len: 10_000 }];
        let t = RegionTable::new(&regions).unwrap();
        let lim = PlanLimits { sges_per_wr: 4, message_bytes_max: 4096 };
        let ops = [op(0, 0, 10_000, 0, 0)];
        let wrs = plan_reads(&ops, &t, &local, 1, &lim).unwrap();
        assert_eq!(wrs.iter().map(ReadWr::len).collect::<Vec<_>>(), vec![4096, 4096, 1808]);
        assert_eq!(wrs.iter().map(|w| w.remote_addr).collect::<Vec<_>>(), vec![0, 4096, 8192]);
        check_limits(&wrs, &lim, 1);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
        // Two adjacent ops that together exceed the limit stay apart.
        let ops = [op(0, 0, 3000, 0, 0), op(0, 3000, 3000, 0, 3000)];
        let wrs = plan_reads(&ops, &t, &local, 1, &lim).unwrap();
        assert_eq!(wrs.iter().map(ReadWr::len).collect::<Vec<_>>(), vec![3000, 3000]);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
    }

    #[test]
    fn different_regions_or_gaps_never_coalesce() {
        let regions = [region(0, 0, 0x1000, 1), region(1, 0x1000, 0x1000, 2)];
        let local = [LocalBuf { addr: 0x10_0000, len: 0x3000 }];
        let t = RegionTable::new(&regions).unwrap();
        // Adjacent addresses but different rkeys; then a gap in one region.
        let ops = [op(0, 0xf00, 0x100, 0, 0), op(1, 0, 0x100, 0, 0x100), op(1, 0x200, 0x100, 0, 0x200)];
        let wrs = plan_reads(&ops, &t, &local, 1, &LIMITS).unwrap();
        assert_eq!(wrs.len(), 3);
        assert_eq!(wrs.iter().map(|w| w.rkey).collect::<Vec<_>>(), vec![1, 2, 2]);
        check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
    }

    #[test]
    fn bad_ops_plan_nothing() {
        let regions = [region(0, 0, 0x1000, 1)];
        let local = [LocalBuf { addr: 0x10_0000, len: 0x100 }];
        let t = RegionTable::new(&regions).unwrap();
        let plan = |ops: &[ReadOp]| plan_reads(ops, &t, &local, 1, &LIMITS);
        assert_eq!(plan(&[op(0, 0, 0, 0, 0)]), Err(PlanError::EmptyRead));
        assert_eq!(plan(&[op(0, 0, 1, 1, 0)]), Err(PlanError::LocalOutOfRange { extent: 1, offset: 0, len: 1 }));
        assert_eq!(
            plan(&[op(0, 0, 0x10, 0, 0xf8)]),
            Err(PlanError::LocalOutOfRange { extent: 0, offset: 0xf8, len: 0x10 })
        );
        assert_eq!(
            plan(&[op(0, 0, 1, 0, u64::MAX)]),
            Err(PlanError::LocalOutOfRange { extent: 0, offset: u64::MAX, len: 1 })
        );
        assert_eq!(plan(&[op(0, 0, 1, 0, 0), op(5, 0, 1, 0, 1)]), Err(PlanError::UnknownRegion(5)));
        assert!(matches!(plan(&[op(0, 0xfff, 2, 0, 0)]), Err(PlanError::OutOfRegion { .. })));
        let zero = PlanLimits { sges_per_wr: 0, ..LIMITS };
        assert!(matches!(plan_reads(&[], &t, &local, 1, &zero), Err(PlanError::BadConfig(_))));
        let huge = PlanLimits { message_bytes_max: VERBS_READ_MESSAGE_BYTES_MAX + 1, ..LIMITS };
        assert!(matches!(plan_reads(&[], &t, &local, 1, &huge), Err(PlanError::BadConfig(_))));
        assert_eq!(plan(&[]), Ok(vec![]));
    }

    /// Random batches (shapes like fetch's: per-block slots, K/V halves,
    /// blocks adjacent or not on the server, random limits): every plan
    /// respects its limits and moves exactly the requested bytes.
    #[test]
    fn random_batches_move_every_byte_within_limits() {
        let mut rng = SplitMix64(0x7665_7262_7331);
        for _ in 0..300 {
            let n_regions = 1 + rng.below_usize(3);
            let regions: Vec<Region> = (0..n_regions as u32)
                .map(|i| region(i, u64::from(i) * 0x10_0000 + rng.below(2) * 0x8_0000, 0x8_0000, 100 + i))
                .collect();
            let n_ext = 1 + rng.below_usize(6);
            let ext_len = 64 + rng.below(512);
            // Extents adjacent or with gaps between them.
            let mut next = 0x4000_0000u64;
            let local: Vec<LocalBuf> = (0..n_ext)
                .map(|_| {
                    let b = LocalBuf { addr: next, len: ext_len };
                    next += ext_len + rng.below(2) * 64;
                    b
                })
                .collect();
            let mut ops = Vec::new();
            for (e, buf) in local.iter().enumerate() {
                // Cut the extent into 1..4 pieces read from random places.
                let mut at = 0;
                while at < buf.len {
                    let len = (1 + rng.below(buf.len)).min(buf.len - at);
                    let r = &regions[rng.below_usize(regions.len())];
                    let remote_offset =
                        if rng.below(2) == 0 { at + e as u64 * ext_len } else { rng.below(r.len - len) };
                    ops.push(op(r.id, remote_offset, len, e, at));
                    at += len;
                }
            }
            let lim = PlanLimits { sges_per_wr: 1 + rng.below(4) as u32, message_bytes_max: 1 + rng.below(1024) };
            let t = RegionTable::new(&regions).unwrap();
            let wrs = plan_reads(&ops, &t, &local, 42, &lim).unwrap();
            check_limits(&wrs, &lim, 42);
            check_plan_moves_every_byte(&ops, &regions, &local, &wrs);
        }
    }

    #[test]
    fn spreading_balances_bytes_over_qps() {
        let wr =
            |len: u32| ReadWr { remote_addr: 0, rkey: 0, sges: vec![Sge { addr: 0, len, lkey: 0 }], extents: vec![0] };
        let wrs = vec![wr(100), wr(10), wr(10), wr(10), wr(100)];
        // 100 → q0; the 10s → q1 (30 bytes); the last 100 → q1 (30 < 100).
        assert_eq!(spread_over_qps(&wrs, 2, 0), vec![vec![0], vec![1, 2, 3, 4]]);
        // Ties go to the first QP counted from `start`.
        assert_eq!(spread_over_qps(&wrs, 2, 1), vec![vec![1, 2, 3, 4], vec![0]]);
        let even = vec![wr(10), wr(10), wr(10), wr(10)];
        assert_eq!(spread_over_qps(&even, 2, 0), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(spread_over_qps(&wrs, 1, 7), vec![vec![0, 1, 2, 3, 4]]);
        assert_eq!(spread_over_qps(&wrs, 0, 0), vec![vec![0, 1, 2, 3, 4]]);
        let s = spread_over_qps(&wrs, 8, 3);
        assert_eq!(s.len(), 8);
        assert_eq!(s.iter().map(Vec::len).sum::<usize>(), 5);
        assert_eq!(spread_over_qps(&[], 3, 0), vec![Vec::<usize>::new(); 3]);
    }

    // -- QP state plan -------------------------------------------------------

    #[test]
    fn qp_plan_on_infiniband_uses_the_lid() {
        let peer = accept_remote(
            &verbs_metadata("10.0.0.2:1", vec![], ib_port().endpoint(vec![0x99], 0x1234)).unwrap(),
            &ib_port(),
        )
        .unwrap();
        let t = QpTuning::default();
        let p = plan_qp(&ib_port(), 0x4321, &peer, 0x99, &t).unwrap();
        assert_eq!(p.init, InitAttrs { port_num: 1, pkey_index: 0, remote_read: true });
        assert_eq!(p.rtr.dest_qpn, 0x99);
        assert_eq!(p.rtr.rq_psn, 0x1234);
        assert_eq!(p.rtr.path_mtu, PathMtu::Mtu4096);
        assert_eq!(p.rtr.av, AddressVector { dlid: 7, service_level: 0, port_num: 1, grh: None });
        assert_eq!(p.rtr.max_dest_rd_atomic, t.dest_reads_in_flight);
        assert_eq!(p.rts.sq_psn, 0x4321);
        assert_eq!(
            (p.rts.timeout_exp, p.rts.retry_count, p.rts.rnr_retry, p.rts.max_rd_atomic),
            (14, 7, 7, VERBS_READS_IN_FLIGHT_PER_QP_DEFAULT)
        );
        assert_eq!(
            QpPlan::TRANSITIONS,
            [
                (QpState::Reset, QpState::Init),
                (QpState::Init, QpState::ReadyToReceive),
                (QpState::ReadyToReceive, QpState::ReadyToSend)
            ]
        );
    }

    #[test]
    fn qp_plan_on_roce_uses_a_grh_and_the_smaller_mtu() {
        let mut remote_port = roce_port();
        remote_port.gid[15] = 3;
        remote_port.active_mtu = PathMtu::Mtu4096;
        let peer = accept_remote(
            &verbs_metadata("10.0.0.3:1", vec![], remote_port.endpoint(vec![8], 77)).unwrap(),
            &roce_port(),
        )
        .unwrap();
        let p = plan_qp(&roce_port(), 78, &peer, 8, &QpTuning::default()).unwrap();
        assert_eq!(p.rtr.path_mtu, PathMtu::Mtu1024);
        assert_eq!(p.rtr.av.dlid, 0);
        assert_eq!(
            p.rtr.av.grh,
            Some(Grh { dgid: remote_port.gid, sgid_index: 3, hop_limit: 64, traffic_class: 0, flow_label: 0 })
        );
    }

    #[test]
    fn qp_plan_rejects_bad_inputs() {
        let peer = accept_remote(
            &verbs_metadata("10.0.0.2:1", vec![], ib_port().endpoint(vec![0x99], 0x1234)).unwrap(),
            &ib_port(),
        )
        .unwrap();
        let t = QpTuning::default();
        assert_eq!(
            plan_qp(&ib_port(), PSN_QPN_LIMIT, &peer, 1, &t),
            Err(PlanError::Metadata(HandshakeError::BadPsn(PSN_QPN_LIMIT)))
        );
        assert_eq!(
            plan_qp(&ib_port(), 1, &peer, PSN_QPN_LIMIT, &t),
            Err(PlanError::Metadata(HandshakeError::BadQpn(PSN_QPN_LIMIT)))
        );
        assert!(matches!(
            plan_qp(&ib_port(), 1, &peer, 1, &QpTuning { retry_count: 9, ..t }),
            Err(PlanError::BadConfig(_))
        ));
        assert!(matches!(plan_qp(&roce_port(), 1, &peer, 1, &t), Err(PlanError::LinkLayerMismatch { .. })));
        let mut p = ib_port();
        p.lid = 0;
        assert_eq!(plan_qp(&p, 1, &peer, 1, &t), Err(PlanError::ZeroLocalLid));
        let mut bad_peer = peer;
        bad_peer.endpoint.psn = PSN_QPN_LIMIT;
        assert_eq!(
            plan_qp(&ib_port(), 1, &bad_peer, 1, &t),
            Err(PlanError::Metadata(HandshakeError::BadPsn(PSN_QPN_LIMIT)))
        );
    }

    // -- completions -----------------------------------------------------------

    #[test]
    fn wr_ids_round_trip() {
        for (g, i) in [(0, 0), (1, 2), (u32::MAX, u32::MAX), (0xdead, 7)] {
            assert_eq!(decode_wr_id(encode_wr_id(g, i)), (g, i));
        }
        assert_eq!(encode_wr_id(1, 2), (1 << 32) | 2);
    }

    #[test]
    fn wc_status_names_and_failures() {
        assert_eq!(wc_status_name(WC_SUCCESS), "SUCCESS");
        assert_eq!(wc_status_name(WC_WR_FLUSH_ERR), "WR_FLUSH_ERR");
        assert_eq!(wc_status_name(WC_REM_ACCESS_ERR), "REM_ACCESS_ERR");
        assert_eq!(wc_status_name(WC_RETRY_EXC_ERR), "RETRY_EXC_ERR");
        assert_eq!(wc_status_name(23), "TM_RNDV_INCOMPLETE");
        assert_eq!(wc_status_name(24), "UNKNOWN");
        assert_eq!(wc_status_name(u32::MAX), "UNKNOWN");
        for s in 1..30 {
            assert!(matches!(wc_failure(s, 0x51), TransportError::Io(_)), "{s}");
        }
        match wc_failure(WC_REM_ACCESS_ERR, 0x88) {
            TransportError::Io(m) => {
                let m = &m.message;
                assert!(m.contains("REM_ACCESS_ERR") && m.contains("0x88") && m.contains("rkey"))
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn tracker_counts_each_wr_once_and_ignores_strays() {
        let mut t = WrTracker::new(9, 3);
        let c = |i: usize, status| Completion { wr_id: encode_wr_id(9, i as u32), status, vendor_err: 0 };
        assert_eq!(t.wr_id(2), encode_wr_id(9, 2));
        assert_eq!(t.on_completion(c(0, WC_SUCCESS)), Tracked::Ok);
        assert_eq!(t.on_completion(c(0, WC_SUCCESS)), Tracked::Stray, "second completion for one WR");
        assert_eq!(t.on_completion(c(3, WC_SUCCESS)), Tracked::Stray, "index out of range");
        assert_eq!(
            t.on_completion(Completion { wr_id: encode_wr_id(8, 1), status: 0, vendor_err: 0 }),
            Tracked::Stray,
            "another batch"
        );
        assert_eq!(t.hw_completed(), 1);
        assert!(!t.any_failed());
        assert_eq!(t.result(1), None);
        assert_eq!(t.on_completion(c(1, WC_REM_ACCESS_ERR)), Tracked::Failed);
        assert!(t.any_failed());
        assert!(!t.all_settled());
        // The deadline settles what is left; the hardware is not done with it.
        t.fail_pending(&TransportError::Timeout);
        assert!(t.all_settled());
        assert_eq!(t.hw_completed(), 2);
        // Its flush completion arrives later: counted for the drain, the
        // result stays the timeout.
        assert_eq!(t.on_completion(c(2, WC_WR_FLUSH_ERR)), Tracked::Failed);
        assert_eq!(t.hw_completed(), 3);
        assert_eq!(t.result(0), Some(Ok(())));
        assert!(matches!(t.result(1), Some(Err(TransportError::Io(_)))));
        assert_eq!(t.result(2), Some(Err(TransportError::Timeout)));
        // Failing a settled WR changes nothing.
        t.fail(0, TransportError::Timeout);
        assert_eq!(t.result(0), Some(Ok(())));
        assert_eq!(t.result(3), None);
        assert_eq!(t.into_results().len(), 3);
    }

    #[test]
    fn extents_fail_when_any_wr_touching_them_fails() {
        let wr = |extents: Vec<usize>| ReadWr {
            remote_addr: 0,
            rkey: 0,
            sges: vec![Sge { addr: 0, len: 1, lkey: 0 }],
            extents,
        };
        let wrs = vec![wr(vec![0, 1]), wr(vec![1]), wr(vec![2]), wr(vec![3])];
        let io = TransportError::io(std::io::ErrorKind::Other, "x");
        let results = vec![Some(Ok(())), Some(Err(io.clone())), Some(Ok(())), None];
        let out = extent_results(&wrs, &results, 5, &TransportError::Timeout);
        assert_eq!(out, vec![Ok(()), Err(io), Ok(()), Err(TransportError::Timeout), Ok(())]);
    }

    // -- offers --------------------------------------------------------------------

    #[test]
    fn offers_are_taken_once_expire_and_stay_bounded() {
        let t0 = Instant::now();
        let ttl = Duration::from_millis(crate::limits::VERBS_OFFER_TTL_MS);
        let mut o: OfferTable<&str> = OfferTable::new(2, ttl);
        assert!(o.insert(1, "a", t0).is_empty());
        assert!(o.insert(2, "b", t0).is_empty());
        assert!(o.contains(1) && o.contains(2) && !o.contains(3));
        // Over the cap: the oldest falls out.
        assert_eq!(o.insert(3, "c", t0 + Duration::from_millis(1)), vec!["a"]);
        assert_eq!(o.len(), 2);
        assert_eq!(o.take(2, t0), Some("b"));
        assert_eq!(o.take(2, t0), None, "taken once");
        // Expired offers are not handed out, and are reaped.
        assert_eq!(o.take(3, t0 + ttl + Duration::from_millis(1)), None);
        assert!(o.is_empty());
        o.insert(4, "d", t0);
        assert_eq!(o.expire(t0 + ttl), vec!["d"]);
        // Re-using a PSN replaces the old offer.
        o.insert(5, "e", t0);
        assert_eq!(o.insert(5, "f", t0), vec!["e"]);
        assert_eq!(o.take(5, t0), Some("f"));
        assert_eq!(pick_psn(5, |p| o.contains(p)), 5);
    }
}
