//! Versioned handshake metadata: the opaque `handshake_metadata` bytes of the
//! `Engine.RdmaHandshake` RPC.
//!
//! Before reading from a peer, a node exchanges one [`HandshakeMetadata`] with
//! it: which transport it speaks, where its data plane listens, which memory
//! regions it registered (ids, address ranges, remote keys) and, for verbs,
//! how to connect queue pairs to it. PegaFlow's wire contract only says these
//! bytes are opaque, so the format is ours; it is versioned, and a decoder
//! rejects unknown versions and trailing bytes with a clear error rather than
//! guessing (wire.md).
//!
//! The bytes come from a remote peer, so [`HandshakeMetadata::decode`] bounds
//! every count before allocating, never panics, and ends with the same
//! [`HandshakeMetadata::validate`] that a node runs on the metadata it builds
//! for itself. `decode(encode(m))` returns `m` exactly when `m.validate()` is
//! `Ok`, and the encoding of a valid value is canonical (decode accepts
//! nothing else for it).
//!
//! # Layout (all integers little-endian)
//!
//! | size | field | rule |
//! | --- | --- | --- |
//! | 4 | magic | [`HANDSHAKE_MAGIC`] (`b"KVHS"`) |
//! | 1 | version `u8` | [`HANDSHAKE_VERSION`] |
//! | 1 | transport `u8` | [`TransportKind`] |
//! | 2 + n | node | `u16` byte length + UTF-8, n ≤ [`ADDR_BYTES_MAX`]; `host:port` |
//! | 2 + n | data_addr | `u16` byte length + UTF-8, n ≤ [`ADDR_BYTES_MAX`]; see [`HandshakeMetadata::data_addr`] |
//! | 2 | region count `u16` | ≤ `limits::HANDSHAKE_REGIONS_MAX` |
//! | 24 each | region | id `u32`, base `u64`, len `u64`, rkey `u32` |
//! | 1 | verbs flag `u8` | 1 iff transport is Verbs, else 0 |
//! | 1 | link_layer `u8` | verbs only: [`LinkLayer`] |
//! | 2 | lid `u16` | nonzero on InfiniBand |
//! | 16 | gid | raw bytes |
//! | 1 | qpn count `u8` | `1..=`[`QPNS_MAX`] |
//! | 4 each | qpn `u32` | < 2^24 |
//! | 4 | psn `u32` | < 2^24 |
//! | 4 | mtu `u32` | bytes: 256, 512, 1024, 2048 or 4096 |
//! | 1 | same-host flag `u8` | 1 iff a [`SameHost`] section follows, else 0 |
//! | 2 + n | host_id | `u16` byte length + printable ASCII, `1..=`[`HOST_ID_BYTES_MAX`] |
//! | 2 + n | socket | `u16` byte length + printable ASCII, `1..=`[`SOCKET_NAME_BYTES_MAX`] |
//! | 4 | region `u32` | id of one of the regions above |
//! | 16 | token | raw bytes |
//!
//! The largest valid encoding (two 280-byte strings, 1 024 regions, 64 QPNs,
//! a same-host section) is about 25 KiB, well under
//! `limits::HANDSHAKE_METADATA_BYTES_MAX`.
//!
//! Version 2 added the same-host section (the shared-pool path,
//! `transport::shm`); version 1 is refused like any unknown version.

use crate::limits;
use crate::types::NodeAddr;

/// First four bytes of every encoding.
pub const HANDSHAKE_MAGIC: [u8; 4] = *b"KVHS";

/// Format version written by [`HandshakeMetadata::encode`]; the only one
/// [`HandshakeMetadata::decode`] accepts.
pub const HANDSHAKE_VERSION: u8 = 2;

/// Longest `node` or `data_addr` string, in bytes: a DNS name plus port, the
/// same bound as `limits::NODE_ADDR_BYTES_MAX`.
pub const ADDR_BYTES_MAX: usize = limits::NODE_ADDR_BYTES_MAX;

/// Most queue pairs one verbs endpoint advertises
/// ([`crate::limits::HANDSHAKE_QPNS_MAX`]).
pub const QPNS_MAX: usize = crate::limits::HANDSHAKE_QPNS_MAX;

/// Queue pair numbers and packet sequence numbers are 24-bit on the wire of
/// InfiniBand and RoCE; values must be below this.
pub const PSN_QPN_LIMIT: u32 = 1 << 24;

/// Smallest path MTU, bytes (IB MTU 256).
pub const MTU_BYTES_MIN: u32 = 256;

/// Largest path MTU, bytes (IB MTU 4096).
pub const MTU_BYTES_MAX: u32 = 4096;

/// Longest [`SameHost::host_id`], bytes ([`limits::HOST_ID_BYTES_MAX`]).
pub const HOST_ID_BYTES_MAX: usize = limits::HOST_ID_BYTES_MAX;

/// Longest [`SameHost::socket`], bytes
/// ([`limits::SHM_SOCKET_NAME_BYTES_MAX`]).
pub const SOCKET_NAME_BYTES_MAX: usize = limits::SHM_SOCKET_NAME_BYTES_MAX;

/// Bytes of a [`SameHost::token`].
pub const TOKEN_BYTES: usize = 16;

/// Size of one region on the wire, bytes.
pub const REGION_WIRE_BYTES: usize = 4 + 8 + 8 + 4;

/// Which data-plane transport a node speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum TransportKind {
    /// Framed reads over TCP (`transport::frame`); `data_addr` is where to
    /// connect.
    Tcp = 1,
    /// RDMA verbs one-sided READ; the verbs section says how to connect.
    Verbs = 2,
    // 3 is reserved: an in-process simulated transport once had it. No
    // backend sends it (the simulator runs the TCP backend over madsim's
    // network), so it decodes as unknown.
}

impl TransportKind {
    /// Parses the wire byte; `None` for an unknown value.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(TransportKind::Tcp),
            2 => Some(TransportKind::Verbs),
            _ => None,
        }
    }

    /// The wire byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

/// Link layer of a verbs port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum LinkLayer {
    /// Native InfiniBand: addressed by LID (must be nonzero).
    InfiniBand = 1,
    /// RoCE: addressed by GID; the LID is unused (usually 0).
    Ethernet = 2,
}

impl LinkLayer {
    /// Parses the wire byte; `None` for an unknown value.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }

    /// The wire byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

/// One registered memory region a peer may read: bytes `[base, base + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub struct Region {
    /// Region id, unique within one metadata value; TCP reads name it.
    pub id: u32,
    /// Start address (verbs: the registered virtual address; tcp/sim: the
    /// address the transfer slot pointers are expressed in), bytes.
    pub base: u64,
    /// Length, bytes; nonzero, and `base + len` must fit in a `u64`.
    pub len: u64,
    /// Remote key for verbs READs; 0 by convention for tcp/sim (not checked:
    /// those transports ignore it).
    pub rkey: u32,
}

impl Region {
    /// One past the last byte (`base + len`), or `None` if it overflows.
    pub fn end(&self) -> Option<u64> {
        self.base.checked_add(self.len)
    }
}

/// How to connect RC queue pairs to a verbs endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub struct VerbsEndpoint {
    /// Port link layer.
    pub link_layer: LinkLayer,
    /// Local identifier; nonzero on InfiniBand, unused on Ethernet.
    pub lid: u16,
    /// Port GID (raw 16 bytes).
    pub gid: [u8; 16],
    /// Queue pair numbers offered, `1..=QPNS_MAX` of them, each < 2^24.
    pub qpns: Vec<u32>,
    /// Initial packet sequence number, < 2^24.
    pub psn: u32,
    /// Path MTU in bytes: a power of two in `256..=4096`.
    pub mtu: u32,
}

/// The same-host section: what a node that can share its pool with a
/// reader on the same host (`transport::shm`) says about it. In an offer
/// (the requester's own metadata) it says where the requester runs; in an
/// answer the owner adds the one-time token that lets this requester
/// collect the pool's descriptor from `socket`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub struct SameHost {
    /// The host identity (`transport::shm::host_identity`: kernel boot id
    /// and network namespace), printable ASCII, `1..=HOST_ID_BYTES_MAX`
    /// bytes. Two nodes are on one host only when these are equal; an
    /// address never decides it.
    pub host_id: String,
    /// The abstract Unix socket name the owner hands its pool out on,
    /// printable ASCII, `1..=SOCKET_NAME_BYTES_MAX` bytes.
    pub socket: String,
    /// The region the shared pool backs (one of the metadata's regions).
    pub region: u32,
    /// In an answer: the 128-bit one-time token the owner issued to this
    /// requester. All zero in an offer.
    pub token: [u8; TOKEN_BYTES],
}

/// What one node tells a peer in `RdmaHandshake` (see the module doc for the
/// encoding).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub struct HandshakeMetadata {
    /// Transport the node serves reads with.
    pub transport: TransportKind,
    /// The node's advertise address (`host:port`, at most [`ADDR_BYTES_MAX`]
    /// bytes).
    pub node: String,
    /// `host:port` of the data plane, at most [`ADDR_BYTES_MAX`] bytes:
    /// required for Tcp, empty for Verbs, either for Sim.
    pub data_addr: String,
    /// Registered regions, at most `limits::HANDSHAKE_REGIONS_MAX`, with
    /// unique ids and pairwise disjoint address ranges; any order.
    pub regions: Vec<Region>,
    /// Present iff `transport` is [`TransportKind::Verbs`].
    pub verbs: Option<VerbsEndpoint>,
    /// Present when the node can share its pool with a same-host reader
    /// (any transport kind).
    pub same_host: Option<SameHost>,
}

/// Why handshake metadata was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The input is longer than `limits::HANDSHAKE_METADATA_BYTES_MAX`
    /// bytes; carries its length.
    #[error("handshake metadata is {0} bytes, more than {max}", max = limits::HANDSHAKE_METADATA_BYTES_MAX)]
    TooLong(usize),
    /// The first four bytes are not [`HANDSHAKE_MAGIC`].
    #[error("bad handshake magic {0:02x?} (want \"KVHS\")")]
    BadMagic([u8; 4]),
    /// A version other than [`HANDSHAKE_VERSION`].
    #[error("unsupported handshake version {0} (this build speaks {want})", want = HANDSHAKE_VERSION)]
    UnsupportedVersion(u8),
    /// An unknown transport byte.
    #[error("unknown transport {0} in handshake")]
    UnknownTransport(u8),
    /// The input ends in the middle of a field.
    #[error("handshake metadata truncated")]
    Truncated,
    /// Bytes left after the last field; carries how many.
    #[error("{0} trailing bytes after handshake metadata")]
    TrailingBytes(usize),
    /// A string field that is not UTF-8.
    #[error("handshake field {field} is not valid UTF-8")]
    InvalidUtf8 {
        /// `"node"` or `"data_addr"`.
        field: &'static str,
    },
    /// A string field longer than [`ADDR_BYTES_MAX`] bytes.
    #[error("handshake field {field} is {len} bytes, more than {max}", max = ADDR_BYTES_MAX)]
    StringTooLong {
        /// `"node"` or `"data_addr"`.
        field: &'static str,
        /// Its length, bytes.
        len: usize,
    },
    /// A string field that should be `host:port` and is not.
    #[error("handshake field {field} is not host:port")]
    BadAddr {
        /// `"node"` or `"data_addr"`.
        field: &'static str,
    },
    /// A verbs handshake with a nonempty `data_addr`.
    #[error("data_addr must be empty for the verbs transport")]
    DataAddrOnVerbs,
    /// More than `limits::HANDSHAKE_REGIONS_MAX` regions; carries the count.
    #[error("{0} regions in handshake, more than {max}", max = limits::HANDSHAKE_REGIONS_MAX)]
    TooManyRegions(usize),
    /// A region of length 0.
    #[error("region {id} has length 0")]
    ZeroLengthRegion {
        /// The region id.
        id: u32,
    },
    /// A region whose `base + len` overflows a `u64`.
    #[error("region {id}: base + len overflows")]
    RegionOverflow {
        /// The region id.
        id: u32,
    },
    /// Two regions with the same id.
    #[error("duplicate region id {0}")]
    DuplicateRegionId(u32),
    /// Two regions whose address ranges overlap; `a` is the one with the
    /// lower base.
    #[error("regions {a} and {b} overlap")]
    OverlappingRegions {
        /// Id of the region starting first.
        a: u32,
        /// Id of the region starting inside `a`.
        b: u32,
    },
    /// Transport is Verbs but there is no verbs section.
    #[error("verbs transport without a verbs section")]
    MissingVerbs,
    /// A verbs section on a non-verbs transport.
    #[error("verbs section present for transport {0:?}")]
    UnexpectedVerbs(TransportKind),
    /// The verbs flag byte is neither 0 nor 1.
    #[error("bad verbs flag {0} (want 0 or 1)")]
    BadVerbsFlag(u8),
    /// An unknown link-layer byte.
    #[error("unknown link layer {0}")]
    UnknownLinkLayer(u8),
    /// LID 0 on an InfiniBand port (unroutable).
    #[error("LID 0 on an InfiniBand port")]
    ZeroLidOnInfiniBand,
    /// An MTU (bytes) that is not a power of two in `256..=4096`.
    #[error("bad path MTU {0} (want 256, 512, 1024, 2048 or 4096)")]
    BadMtu(u32),
    /// A PSN of 2^24 or more.
    #[error("PSN {0:#x} does not fit in 24 bits")]
    BadPsn(u32),
    /// A QPN of 2^24 or more.
    #[error("QPN {0:#x} does not fit in 24 bits")]
    BadQpn(u32),
    /// A verbs section with no queue pairs.
    #[error("verbs section lists no QPNs")]
    NoQpns,
    /// More than [`QPNS_MAX`] queue pairs; carries the count.
    #[error("{0} QPNs, more than {max}", max = QPNS_MAX)]
    TooManyQpns(usize),
    /// The same-host flag byte is neither 0 nor 1.
    #[error("bad same-host flag {0} (want 0 or 1)")]
    BadSameHostFlag(u8),
    /// A same-host string that is empty, too long or not printable ASCII.
    #[error("same-host field {field} ({len} bytes) is empty, too long or not printable ASCII")]
    BadSameHostField {
        /// `"host_id"` or `"socket"`.
        field: &'static str,
        /// Its length, bytes.
        len: usize,
    },
    /// The same-host section names a region the metadata does not list.
    #[error("same-host section names region {0}, which is not listed")]
    SameHostRegionMissing(u32),
}

impl HandshakeError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            HandshakeError::TooLong(_) => "handshake_too_long",
            HandshakeError::BadMagic(_) => "handshake_bad_magic",
            HandshakeError::UnsupportedVersion(_) => "handshake_unsupported_version",
            HandshakeError::UnknownTransport(_) => "handshake_unknown_transport",
            HandshakeError::Truncated => "handshake_truncated",
            HandshakeError::TrailingBytes(_) => "handshake_trailing_bytes",
            HandshakeError::InvalidUtf8 { .. } => "handshake_invalid_utf8",
            HandshakeError::StringTooLong { .. } => "handshake_string_too_long",
            HandshakeError::BadAddr { .. } => "handshake_bad_addr",
            HandshakeError::DataAddrOnVerbs => "handshake_data_addr_on_verbs",
            HandshakeError::TooManyRegions(_) => "handshake_too_many_regions",
            HandshakeError::ZeroLengthRegion { .. } => "handshake_zero_length_region",
            HandshakeError::RegionOverflow { .. } => "handshake_region_overflow",
            HandshakeError::DuplicateRegionId(_) => "handshake_duplicate_region_id",
            HandshakeError::OverlappingRegions { .. } => "handshake_overlapping_regions",
            HandshakeError::MissingVerbs => "handshake_missing_verbs",
            HandshakeError::UnexpectedVerbs(_) => "handshake_unexpected_verbs",
            HandshakeError::BadVerbsFlag(_) => "handshake_bad_verbs_flag",
            HandshakeError::UnknownLinkLayer(_) => "handshake_unknown_link_layer",
            HandshakeError::ZeroLidOnInfiniBand => "handshake_zero_lid_on_infini_band",
            HandshakeError::BadMtu(_) => "handshake_bad_mtu",
            HandshakeError::BadPsn(_) => "handshake_bad_psn",
            HandshakeError::BadQpn(_) => "handshake_bad_qpn",
            HandshakeError::NoQpns => "handshake_no_qpns",
            HandshakeError::TooManyQpns(_) => "handshake_too_many_qpns",
            HandshakeError::BadSameHostFlag(_) => "handshake_bad_same_host_flag",
            HandshakeError::BadSameHostField { .. } => "handshake_bad_same_host_field",
            HandshakeError::SameHostRegionMissing(_) => "handshake_same_host_region_missing",
        }
    }
}

impl HandshakeMetadata {
    /// The region with this id, if any (linear scan; at most
    /// `limits::HANDSHAKE_REGIONS_MAX` regions).
    pub fn region(&self, id: u32) -> Option<&Region> {
        self.regions.iter().find(|r| r.id == id)
    }

    /// Checks every rule of the format (see the field docs); decode runs it
    /// last, and a node runs it on the metadata it builds before sending.
    ///
    /// # Errors
    /// [`HandshakeError::StringTooLong`], [`HandshakeError::BadAddr`],
    /// [`HandshakeError::DataAddrOnVerbs`],
    /// [`HandshakeError::TooManyRegions`],
    /// [`HandshakeError::ZeroLengthRegion`],
    /// [`HandshakeError::RegionOverflow`],
    /// [`HandshakeError::DuplicateRegionId`],
    /// [`HandshakeError::OverlappingRegions`],
    /// [`HandshakeError::MissingVerbs`], [`HandshakeError::UnexpectedVerbs`],
    /// the verbs-section errors of [`VerbsEndpoint::validate`], then
    /// [`HandshakeError::BadSameHostField`] and
    /// [`HandshakeError::SameHostRegionMissing`]; checked in that order, the
    /// first failure wins.
    pub fn validate(&self) -> Result<(), HandshakeError> {
        check_str_len("node", &self.node)?;
        check_str_len("data_addr", &self.data_addr)?;
        check_addr("node", &self.node)?;
        match self.transport {
            TransportKind::Tcp => check_addr("data_addr", &self.data_addr)?,
            TransportKind::Verbs if !self.data_addr.is_empty() => {
                return Err(HandshakeError::DataAddrOnVerbs);
            }
            TransportKind::Verbs => {}
        }
        validate_regions(&self.regions)?;
        match (self.transport, &self.verbs) {
            (TransportKind::Verbs, Some(v)) => v.validate()?,
            (TransportKind::Verbs, None) => return Err(HandshakeError::MissingVerbs),
            (t, Some(_)) => return Err(HandshakeError::UnexpectedVerbs(t)),
            (_, None) => {}
        }
        if let Some(h) = &self.same_host {
            check_same_host_str("host_id", &h.host_id, HOST_ID_BYTES_MAX)?;
            check_same_host_str("socket", &h.socket, SOCKET_NAME_BYTES_MAX)?;
            if self.region(h.region).is_none() {
                return Err(HandshakeError::SameHostRegionMissing(h.region));
            }
        }
        Ok(())
    }

    /// The wire form (see the module doc). Never panics. Meant for values
    /// that pass [`HandshakeMetadata::validate`]; an invalid value still
    /// encodes (counts that do not fit their field are saturated), and
    /// [`HandshakeMetadata::decode`] rejects the result.
    pub fn encode(&self) -> Vec<u8> {
        let verbs_len = self.verbs.as_ref().map_or(0, |v| 1 + 2 + 16 + 1 + 4 * v.qpns.len().min(QPNS_MAX) + 4 + 4);
        let cap = 4
            + 1
            + 1
            + 2
            + self.node.len().min(ADDR_BYTES_MAX)
            + 2
            + self.data_addr.len().min(ADDR_BYTES_MAX)
            + 2
            + REGION_WIRE_BYTES * self.regions.len().min(limits::HANDSHAKE_REGIONS_MAX)
            + 1
            + verbs_len
            + 1
            + self.same_host.as_ref().map_or(0, |h| 2 + h.host_id.len() + 2 + h.socket.len() + 4 + TOKEN_BYTES);
        let mut out = Vec::with_capacity(cap);
        out.extend_from_slice(&HANDSHAKE_MAGIC);
        out.push(HANDSHAKE_VERSION);
        out.push(self.transport.as_u8());
        put_str(&mut out, &self.node);
        put_str(&mut out, &self.data_addr);
        put_u16(&mut out, saturate_u16(self.regions.len()));
        for r in &self.regions {
            out.extend_from_slice(&r.id.to_le_bytes());
            out.extend_from_slice(&r.base.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.extend_from_slice(&r.rkey.to_le_bytes());
        }
        match &self.verbs {
            None => out.push(0),
            Some(v) => {
                out.push(1);
                out.push(v.link_layer.as_u8());
                put_u16(&mut out, v.lid);
                out.extend_from_slice(&v.gid);
                out.push(u8::try_from(v.qpns.len()).unwrap_or(u8::MAX));
                for q in &v.qpns {
                    out.extend_from_slice(&q.to_le_bytes());
                }
                out.extend_from_slice(&v.psn.to_le_bytes());
                out.extend_from_slice(&v.mtu.to_le_bytes());
            }
        }
        match &self.same_host {
            None => out.push(0),
            Some(h) => {
                out.push(1);
                put_str(&mut out, &h.host_id);
                put_str(&mut out, &h.socket);
                out.extend_from_slice(&h.region.to_le_bytes());
                out.extend_from_slice(&h.token);
            }
        }
        out
    }

    /// Parses and validates bytes received from a peer. The whole input must
    /// be one encoding.
    ///
    /// # Errors
    /// [`HandshakeError::TooLong`] (checked first, before reading anything),
    /// [`HandshakeError::BadMagic`], [`HandshakeError::UnsupportedVersion`],
    /// [`HandshakeError::UnknownTransport`], [`HandshakeError::Truncated`],
    /// [`HandshakeError::StringTooLong`], [`HandshakeError::InvalidUtf8`],
    /// [`HandshakeError::TooManyRegions`], [`HandshakeError::BadVerbsFlag`],
    /// [`HandshakeError::UnknownLinkLayer`], [`HandshakeError::NoQpns`],
    /// [`HandshakeError::TooManyQpns`], [`HandshakeError::BadSameHostFlag`],
    /// [`HandshakeError::BadSameHostField`] (a length out of range, before
    /// the bytes are read), [`HandshakeError::TrailingBytes`],
    /// then anything [`HandshakeMetadata::validate`] reports. Fields are
    /// checked in wire order, so a truncated valid encoding is always
    /// `Truncated`.
    pub fn decode(bytes: &[u8]) -> Result<Self, HandshakeError> {
        if bytes.len() > limits::HANDSHAKE_METADATA_BYTES_MAX {
            return Err(HandshakeError::TooLong(bytes.len()));
        }
        let mut c = Cursor { buf: bytes, pos: 0 };
        let magic: [u8; 4] = c.array()?;
        if magic != HANDSHAKE_MAGIC {
            return Err(HandshakeError::BadMagic(magic));
        }
        let version = c.u8()?;
        if version != HANDSHAKE_VERSION {
            return Err(HandshakeError::UnsupportedVersion(version));
        }
        let t = c.u8()?;
        let transport = TransportKind::from_u8(t).ok_or(HandshakeError::UnknownTransport(t))?;
        let node = c.string("node")?;
        let data_addr = c.string("data_addr")?;

        let count = usize::from(c.u16()?);
        if count > limits::HANDSHAKE_REGIONS_MAX {
            return Err(HandshakeError::TooManyRegions(count));
        }
        // `count` is bounded above, so this allocation is at most 24 KiB.
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            regions.push(Region { id: c.u32()?, base: c.u64()?, len: c.u64()?, rkey: c.u32()? });
        }

        let verbs = match c.u8()? {
            0 => None,
            1 => Some(decode_verbs(&mut c)?),
            flag => return Err(HandshakeError::BadVerbsFlag(flag)),
        };
        let same_host = match c.u8()? {
            0 => None,
            1 => Some(SameHost {
                host_id: c.bounded_ascii("host_id", HOST_ID_BYTES_MAX)?,
                socket: c.bounded_ascii("socket", SOCKET_NAME_BYTES_MAX)?,
                region: c.u32()?,
                token: c.array()?,
            }),
            flag => return Err(HandshakeError::BadSameHostFlag(flag)),
        };
        let trailing = c.remaining();
        if trailing != 0 {
            return Err(HandshakeError::TrailingBytes(trailing));
        }
        let m = HandshakeMetadata { transport, node, data_addr, regions, verbs, same_host };
        m.validate()?;
        Ok(m)
    }
}

impl VerbsEndpoint {
    /// Checks the verbs section on its own.
    ///
    /// # Errors
    /// [`HandshakeError::ZeroLidOnInfiniBand`], [`HandshakeError::NoQpns`],
    /// [`HandshakeError::TooManyQpns`], [`HandshakeError::BadQpn`],
    /// [`HandshakeError::BadPsn`], [`HandshakeError::BadMtu`], in that order.
    pub fn validate(&self) -> Result<(), HandshakeError> {
        if self.link_layer == LinkLayer::InfiniBand && self.lid == 0 {
            return Err(HandshakeError::ZeroLidOnInfiniBand);
        }
        check_qpn_count(self.qpns.len())?;
        if let Some(&q) = self.qpns.iter().find(|&&q| q >= PSN_QPN_LIMIT) {
            return Err(HandshakeError::BadQpn(q));
        }
        if self.psn >= PSN_QPN_LIMIT {
            return Err(HandshakeError::BadPsn(self.psn));
        }
        let mtu_ok = self.mtu.is_power_of_two() && (MTU_BYTES_MIN..=MTU_BYTES_MAX).contains(&self.mtu);
        if !mtu_ok {
            return Err(HandshakeError::BadMtu(self.mtu));
        }
        Ok(())
    }
}

/// Parses the verbs section (after its flag byte); the cross-field checks
/// are left to [`VerbsEndpoint::validate`].
fn decode_verbs(c: &mut Cursor<'_>) -> Result<VerbsEndpoint, HandshakeError> {
    let ll = c.u8()?;
    let link_layer = LinkLayer::from_u8(ll).ok_or(HandshakeError::UnknownLinkLayer(ll))?;
    let lid = c.u16()?;
    let gid: [u8; 16] = c.array()?;
    let n = usize::from(c.u8()?);
    check_qpn_count(n)?;
    let mut qpns = Vec::with_capacity(n);
    for _ in 0..n {
        qpns.push(c.u32()?);
    }
    Ok(VerbsEndpoint { link_layer, lid, gid, qpns, psn: c.u32()?, mtu: c.u32()? })
}

fn check_qpn_count(n: usize) -> Result<(), HandshakeError> {
    if n == 0 {
        return Err(HandshakeError::NoQpns);
    }
    if n > QPNS_MAX {
        return Err(HandshakeError::TooManyQpns(n));
    }
    Ok(())
}

/// Nonempty, at most `max` bytes, printable ASCII (no spaces, no NUL).
fn check_same_host_str(field: &'static str, s: &str, max: usize) -> Result<(), HandshakeError> {
    if s.is_empty() || s.len() > max || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(HandshakeError::BadSameHostField { field, len: s.len() });
    }
    Ok(())
}

fn check_str_len(field: &'static str, s: &str) -> Result<(), HandshakeError> {
    if s.len() > ADDR_BYTES_MAX {
        return Err(HandshakeError::StringTooLong { field, len: s.len() });
    }
    Ok(())
}

/// `host:port` with a numeric port, the rule of [`NodeAddr::parse`].
fn check_addr(field: &'static str, s: &str) -> Result<(), HandshakeError> {
    NodeAddr::parse(s).map(|_| ()).map_err(|_| HandshakeError::BadAddr { field })
}

/// Count, per-region rules, unique ids, disjoint ranges. Sorting copies at
/// most `HANDSHAKE_REGIONS_MAX` small tuples.
fn validate_regions(regions: &[Region]) -> Result<(), HandshakeError> {
    if regions.len() > limits::HANDSHAKE_REGIONS_MAX {
        return Err(HandshakeError::TooManyRegions(regions.len()));
    }
    // (base, end, id) of every region, with each region checked on its own.
    let mut spans = Vec::with_capacity(regions.len());
    for r in regions {
        if r.len == 0 {
            return Err(HandshakeError::ZeroLengthRegion { id: r.id });
        }
        let end = r.end().ok_or(HandshakeError::RegionOverflow { id: r.id })?;
        spans.push((r.base, end, r.id));
    }
    let mut ids: Vec<u32> = regions.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(HandshakeError::DuplicateRegionId(w.first().copied().unwrap_or(0)));
    }
    // Sorted by base, some pair overlaps iff some adjacent pair does: if
    // region i reaches past the base of a later j, it also reaches past the
    // base of every region between them.
    spans.sort_unstable();
    for w in spans.windows(2) {
        if let [(_, a_end, a), (b_base, _, b)] = *w
            && a_end > b_base
        {
            return Err(HandshakeError::OverlappingRegions { a, b });
        }
    }
    Ok(())
}

fn saturate_u16(n: usize) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// `u16` length + bytes. A string over `u16::MAX` bytes gets a saturated
/// length; the encoding is then over the size limit and decode rejects it.
fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u16(out, saturate_u16(s.len()));
    out.extend_from_slice(s.as_bytes());
}

/// Bounds-checked little-endian reader; running out is
/// [`HandshakeError::Truncated`].
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], HandshakeError> {
        let end = self.pos.checked_add(n).ok_or(HandshakeError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(HandshakeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], HandshakeError> {
        self.take(N)?.try_into().map_err(|_| HandshakeError::Truncated)
    }

    fn u8(&mut self) -> Result<u8, HandshakeError> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Result<u16, HandshakeError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, HandshakeError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, HandshakeError> {
        self.array().map(u64::from_le_bytes)
    }

    /// `u16` length (checked against [`ADDR_BYTES_MAX`] before the bytes are
    /// read) + UTF-8 bytes.
    fn string(&mut self, field: &'static str) -> Result<String, HandshakeError> {
        let len = usize::from(self.u16()?);
        if len > ADDR_BYTES_MAX {
            return Err(HandshakeError::StringTooLong { field, len });
        }
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| HandshakeError::InvalidUtf8 { field })
    }

    /// `u16` length (checked against `1..=max` before the bytes are read)
    /// + printable ASCII bytes.
    fn bounded_ascii(&mut self, field: &'static str, max: usize) -> Result<String, HandshakeError> {
        let len = usize::from(self.u16()?);
        if len == 0 || len > max {
            return Err(HandshakeError::BadSameHostField { field, len });
        }
        let bytes = self.take(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) if bytes.iter().all(u8::is_ascii_graphic) => Ok(s.to_owned()),
            _ => Err(HandshakeError::BadSameHostField { field, len }),
        }
    }
}

/// Fuzz body (cargo-fuzz target `handshake`, and the replay test below).
///
/// Decodes `data`; on success checks that the value validates and re-encodes
/// to exactly `data`. Then builds a [`HandshakeMetadata`] from `data` with
/// `arbitrary` and checks that `decode(encode(m))` is `Ok(m)` exactly when
/// `m.validate()` is `Ok`. Panics (the fuzzer's signal) only when one of these
/// properties is broken.
#[cfg(any(test, fuzzing))]
pub fn fuzz_handshake_decode(data: &[u8]) {
    if let Ok(m) = HandshakeMetadata::decode(data) {
        assert_eq!(m.validate(), Ok(()));
        assert_eq!(m.encode(), data, "re-encoding differs from the input");
    }
    let mut u = arbitrary::Unstructured::new(data);
    if let Ok(m) = u.arbitrary::<HandshakeMetadata>() {
        let decoded = HandshakeMetadata::decode(&m.encode());
        match m.validate() {
            Ok(()) => assert_eq!(decoded, Ok(m)),
            Err(e) => assert!(decoded.is_err(), "invalid value {e:?} decoded"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::testing::SplitMix64;

    fn tcp_sample() -> HandshakeMetadata {
        HandshakeMetadata {
            transport: TransportKind::Tcp,
            node: "10.0.0.1:50055".into(),
            data_addr: "10.0.0.1:50056".into(),
            regions: vec![
                Region { id: 1, base: 0x1000, len: 0x1000, rkey: 0 },
                Region { id: 2, base: 0x2000, len: 0x10, rkey: 0 },
            ],
            verbs: None,
            same_host: None,
        }
    }

    fn same_host_sample() -> HandshakeMetadata {
        HandshakeMetadata {
            same_host: Some(SameHost {
                host_id: "04968113-364b-49b4-89cd-fbde5136432d/net:[4026531833]".into(),
                socket: "kvferry-shm-00112233445566778899aabbccddeeff".into(),
                region: 2,
                token: [0xA5; TOKEN_BYTES],
            }),
            ..tcp_sample()
        }
    }

    fn verbs_sample() -> HandshakeMetadata {
        HandshakeMetadata {
            transport: TransportKind::Verbs,
            node: "node-a:7000".into(),
            data_addr: String::new(),
            regions: vec![Region { id: 0, base: 0x7f00_0000_0000, len: 1 << 30, rkey: 0xABCD }],
            verbs: Some(VerbsEndpoint {
                link_layer: LinkLayer::InfiniBand,
                lid: 17,
                gid: [0xFE; 16],
                qpns: vec![0x1234, 0xFF_FFFF],
                psn: 0xFF_FFFF,
                mtu: 4096,
            }),
            same_host: None,
        }
    }

    /// The error from both `validate` and a wire round trip.
    fn rejects(m: &HandshakeMetadata, want: HandshakeError) {
        assert_eq!(m.validate(), Err(want.clone()), "validate");
        assert_eq!(HandshakeMetadata::decode(&m.encode()), Err(want), "decode");
    }

    /// Byte offset of the region count in `tcp_sample()`'s encoding.
    fn tcp_sample_regions_at() -> usize {
        let m = tcp_sample();
        4 + 1 + 1 + 2 + m.node.len() + 2 + m.data_addr.len()
    }

    fn addr_strategy() -> impl Strategy<Value = String> {
        (
            proptest::collection::vec(
                proptest::sample::select(b"abcdefghijklmnopqrstuvwxyz0123456789.-[]:".as_slice()),
                1..40,
            ),
            any::<u16>(),
        )
            .prop_map(|(h, p)| format!("{}:{p}", String::from_utf8(h).unwrap()))
    }

    fn regions_strategy() -> impl Strategy<Value = Vec<Region>> {
        proptest::collection::btree_set(any::<u32>(), 0..12)
            .prop_flat_map(|ids| {
                let n = ids.len();
                (
                    Just(ids),
                    proptest::collection::vec((0u64..1 << 20, 1u64..1 << 40, any::<u32>()), n),
                    any::<u64>(),
                    any::<bool>(),
                )
            })
            .prop_map(|(ids, shapes, start, high)| {
                // Lay the regions out left to right from `start` (or ending at
                // u64::MAX when `high`), then shuffle by id order.
                let total: u64 = shapes.iter().map(|(g, l, _)| g + l).sum();
                let mut base = if high { u64::MAX - total } else { start % (u64::MAX - total) };
                let mut out = Vec::new();
                for (id, (gap, len, rkey)) in ids.into_iter().zip(shapes) {
                    base += gap;
                    out.push(Region { id, base, len, rkey });
                    base += len;
                }
                out
            })
            .prop_shuffle()
    }

    fn verbs_strategy() -> impl Strategy<Value = VerbsEndpoint> {
        (
            any::<bool>(),
            any::<u16>(),
            any::<[u8; 16]>(),
            proptest::collection::vec(0u32..PSN_QPN_LIMIT, 1..=QPNS_MAX),
            0u32..PSN_QPN_LIMIT,
            0u32..5,
        )
            .prop_map(|(ib, lid, gid, qpns, psn, mtu_log)| VerbsEndpoint {
                link_layer: if ib { LinkLayer::InfiniBand } else { LinkLayer::Ethernet },
                lid: if ib { lid.max(1) } else { lid },
                gid,
                qpns,
                psn,
                mtu: 256 << mtu_log,
            })
    }

    fn ascii_strategy(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(0x21u8..0x7F, 1..=max).prop_map(|b| String::from_utf8(b).unwrap())
    }

    fn same_host_strategy() -> impl Strategy<Value = (String, String, usize, [u8; TOKEN_BYTES])> {
        (ascii_strategy(HOST_ID_BYTES_MAX), ascii_strategy(SOCKET_NAME_BYTES_MAX), any::<usize>(), any::<[u8; 16]>())
    }

    fn metadata_strategy() -> impl Strategy<Value = HandshakeMetadata> {
        (
            0u8..2,
            addr_strategy(),
            addr_strategy(),
            regions_strategy(),
            verbs_strategy(),
            proptest::option::of(same_host_strategy()),
        )
            .prop_map(|(t, node, addr, regions, verbs, same_host)| {
                let transport = TransportKind::from_u8(t + 1).unwrap();
                let data_addr = match transport {
                    TransportKind::Tcp => addr,
                    TransportKind::Verbs => String::new(),
                };
                let verbs = (transport == TransportKind::Verbs).then_some(verbs);
                // A same-host section names one of the regions (none without regions).
                let same_host = same_host.filter(|_| !regions.is_empty()).map(|(host_id, socket, i, token)| SameHost {
                    host_id,
                    socket,
                    region: regions[i % regions.len()].id,
                    token,
                });
                HandshakeMetadata { transport, node, data_addr, regions, verbs, same_host }
            })
    }

    proptest! {
        // Never write regression files next to the source.
        #![proptest_config(ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn round_trip(m in metadata_strategy()) {
            prop_assert_eq!(m.validate(), Ok(()));
            let b = m.encode();
            prop_assert!(b.len() <= limits::HANDSHAKE_METADATA_BYTES_MAX);
            prop_assert_eq!(HandshakeMetadata::decode(&b), Ok(m.clone()));
            for r in &m.regions {
                prop_assert_eq!(m.region(r.id), Some(r));
            }
        }

        #[test]
        fn every_truncation_is_truncated(m in metadata_strategy()) {
            let b = m.encode();
            for cut in 0..b.len() {
                prop_assert_eq!(HandshakeMetadata::decode(&b[..cut]), Err(HandshakeError::Truncated));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            fuzz_handshake_decode(&data);
        }
    }

    #[test]
    fn samples_round_trip_and_layout() {
        for m in [tcp_sample(), verbs_sample()] {
            assert_eq!(HandshakeMetadata::decode(&m.encode()), Ok(m));
        }
        let b = tcp_sample().encode();
        assert_eq!(&b[..4], b"KVHS");
        assert_eq!(b[4], HANDSHAKE_VERSION);
        assert_eq!(b[5], 1);
        assert_eq!(&b[6..8], &14u16.to_le_bytes());
        assert_eq!(&b[8..22], b"10.0.0.1:50055");
        let at = tcp_sample_regions_at();
        assert_eq!(&b[at..at + 2], &2u16.to_le_bytes());
        assert_eq!(b.len(), at + 2 + 2 * REGION_WIRE_BYTES + 1 + 1);
        assert_eq!(&b[b.len() - 2..], &[0, 0], "no verbs, no same-host section");
        // The same-host section: flag, two strings, region, token, at the end.
        let m = same_host_sample();
        let b = m.encode();
        assert_eq!(HandshakeMetadata::decode(&b), Ok(m.clone()));
        let h = m.same_host.as_ref().unwrap();
        let tail = 1 + 2 + h.host_id.len() + 2 + h.socket.len() + 4 + TOKEN_BYTES;
        assert_eq!(b.len(), at + 2 + 2 * REGION_WIRE_BYTES + 1 + tail);
        assert_eq!(b[b.len() - tail], 1);
        assert_eq!(&b[b.len() - TOKEN_BYTES..], &[0xA5; TOKEN_BYTES]);
        assert_eq!(&b[b.len() - TOKEN_BYTES - 4..b.len() - TOKEN_BYTES], &2u32.to_le_bytes());
        assert_eq!(tcp_sample().region(2).map(|r| r.len), Some(0x10));
        assert_eq!(tcp_sample().region(3), None);
        // Zero regions.
        let mut m = tcp_sample();
        m.regions.clear();
        assert_eq!(HandshakeMetadata::decode(&m.encode()), Ok(m));
    }

    #[test]
    fn every_truncation_of_samples() {
        for m in [tcp_sample(), verbs_sample(), same_host_sample()] {
            let b = m.encode();
            for cut in 0..b.len() {
                assert_eq!(HandshakeMetadata::decode(&b[..cut]), Err(HandshakeError::Truncated), "cut {cut}");
            }
        }
    }

    #[test]
    fn largest_valid_value_round_trips() {
        let host = "h".repeat(ADDR_BYTES_MAX - 6);
        let addr = format!("{host}:65535");
        assert_eq!(addr.len(), ADDR_BYTES_MAX);
        let regions = (0..limits::HANDSHAKE_REGIONS_MAX as u32)
            .map(|i| Region { id: u32::MAX - i, base: u64::from(i) << 32, len: 1 << 32, rkey: i })
            .collect();
        let m = HandshakeMetadata {
            transport: TransportKind::Verbs,
            node: addr,
            data_addr: String::new(),
            regions,
            verbs: Some(VerbsEndpoint { qpns: (0..QPNS_MAX as u32).collect(), ..verbs_sample().verbs.unwrap() }),
            same_host: Some(SameHost {
                host_id: "h".repeat(HOST_ID_BYTES_MAX),
                socket: "s".repeat(SOCKET_NAME_BYTES_MAX),
                region: u32::MAX,
                token: [0xFF; TOKEN_BYTES],
            }),
        };
        let b = m.encode();
        assert!(b.len() < limits::HANDSHAKE_METADATA_BYTES_MAX / 2);
        assert_eq!(HandshakeMetadata::decode(&b), Ok(m));
    }

    #[test]
    fn rejects_too_long_input() {
        let mut b = tcp_sample().encode();
        b.resize(limits::HANDSHAKE_METADATA_BYTES_MAX + 1, 0);
        assert_eq!(
            HandshakeMetadata::decode(&b),
            Err(HandshakeError::TooLong(limits::HANDSHAKE_METADATA_BYTES_MAX + 1))
        );
        // An oversized string saturates its length field and the result is
        // rejected rather than misread.
        let mut m = tcp_sample();
        m.node = "n".repeat(usize::from(u16::MAX) + 10);
        assert!(matches!(HandshakeMetadata::decode(&m.encode()), Err(HandshakeError::TooLong(_))));
    }

    #[test]
    fn rejects_bad_magic() {
        let mut b = tcp_sample().encode();
        b[0] = b'X';
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::BadMagic(*b"XVHS")));
    }

    #[test]
    fn rejects_unknown_version() {
        let mut b = tcp_sample().encode();
        b[4] = 3;
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::UnsupportedVersion(3)));
        // Checked before anything after it.
        assert_eq!(HandshakeMetadata::decode(&b[..5]), Err(HandshakeError::UnsupportedVersion(3)));
        // Version 1 (before the same-host section) is refused, not misread.
        b[4] = 1;
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::UnsupportedVersion(1)));
    }

    #[test]
    fn rejects_unknown_transport() {
        let mut b = tcp_sample().encode();
        // 3 is reserved (see `TransportKind`): no backend sends it.
        for t in [0u8, 3, 4, 255] {
            b[5] = t;
            assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::UnknownTransport(t)));
        }
    }

    #[test]
    fn rejects_truncated() {
        assert_eq!(HandshakeMetadata::decode(&[]), Err(HandshakeError::Truncated));
        assert_eq!(HandshakeMetadata::decode(b"KVHS"), Err(HandshakeError::Truncated));
        // A region count promising more regions than there are bytes.
        let mut b = tcp_sample().encode();
        let at = tcp_sample_regions_at();
        b[at..at + 2].copy_from_slice(&3u16.to_le_bytes());
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::Truncated));
    }

    #[test]
    fn rejects_trailing_bytes() {
        let mut b = verbs_sample().encode();
        b.extend_from_slice(&[0, 0, 0]);
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::TrailingBytes(3)));
    }

    #[test]
    fn rejects_invalid_utf8() {
        let mut b = tcp_sample().encode();
        b[8] = 0xFF; // first byte of `node`
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::InvalidUtf8 { field: "node" }));
        let mut b = tcp_sample().encode();
        b[8 + 14 + 2] = 0xC0; // first byte of `data_addr`
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::InvalidUtf8 { field: "data_addr" }));
    }

    #[test]
    fn rejects_long_strings() {
        let mut b = tcp_sample().encode();
        b[6..8].copy_from_slice(&281u16.to_le_bytes());
        // Rejected on the length alone, before the bytes.
        assert_eq!(HandshakeMetadata::decode(&b[..8]), Err(HandshakeError::StringTooLong { field: "node", len: 281 }));
        let mut m = tcp_sample();
        m.data_addr = format!("{}:1", "d".repeat(ADDR_BYTES_MAX));
        rejects(&m, HandshakeError::StringTooLong { field: "data_addr", len: ADDR_BYTES_MAX + 2 });
    }

    #[test]
    fn rejects_bad_addresses() {
        let mut m = tcp_sample();
        m.node = "no-port".into();
        rejects(&m, HandshakeError::BadAddr { field: "node" });
        let mut m = tcp_sample();
        m.node.clear();
        rejects(&m, HandshakeError::BadAddr { field: "node" });
        let mut m = tcp_sample();
        m.data_addr.clear();
        rejects(&m, HandshakeError::BadAddr { field: "data_addr" });
        let mut m = tcp_sample();
        m.data_addr = "h:99999".into();
        rejects(&m, HandshakeError::BadAddr { field: "data_addr" });
        let mut m = verbs_sample();
        m.data_addr = "10.0.0.1:1".into();
        rejects(&m, HandshakeError::DataAddrOnVerbs);
    }

    #[test]
    fn rejects_too_many_regions() {
        let mut m = tcp_sample();
        m.regions = (0..=limits::HANDSHAKE_REGIONS_MAX as u32)
            .map(|i| Region { id: i, base: u64::from(i) * 8, len: 8, rkey: 0 })
            .collect();
        rejects(&m, HandshakeError::TooManyRegions(limits::HANDSHAKE_REGIONS_MAX + 1));
        // On the wire: rejected on the count alone, nothing allocated.
        let mut b = tcp_sample().encode();
        let at = tcp_sample_regions_at();
        b[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(HandshakeMetadata::decode(&b[..at + 2]), Err(HandshakeError::TooManyRegions(usize::from(u16::MAX))));
    }

    #[test]
    fn rejects_zero_length_region() {
        let mut m = tcp_sample();
        m.regions[1].len = 0;
        rejects(&m, HandshakeError::ZeroLengthRegion { id: 2 });
    }

    #[test]
    fn rejects_region_overflow() {
        let mut m = tcp_sample();
        m.regions[0].base = u64::MAX - 1;
        m.regions[0].len = 2;
        rejects(&m, HandshakeError::RegionOverflow { id: 1 });
        // Ending exactly at u64::MAX is fine.
        m.regions[0].len = 1;
        assert_eq!(m.validate(), Ok(()));
    }

    #[test]
    fn rejects_duplicate_region_id() {
        let mut m = tcp_sample();
        m.regions[1].id = 1;
        rejects(&m, HandshakeError::DuplicateRegionId(1));
    }

    #[test]
    fn rejects_overlapping_regions() {
        let mut m = tcp_sample();
        m.regions[1].base = 0x1FFF; // region 1 is [0x1000, 0x2000)
        rejects(&m, HandshakeError::OverlappingRegions { a: 1, b: 2 });
        // Non-adjacent in input order, nested, reported by base order.
        let mut m = tcp_sample();
        m.regions.push(Region { id: 9, base: 0x800, len: 0x1000, rkey: 0 });
        rejects(&m, HandshakeError::OverlappingRegions { a: 9, b: 1 });
        let mut m = tcp_sample();
        m.regions[1] = Region { id: 2, base: 0x1800, len: 1, rkey: 0 };
        rejects(&m, HandshakeError::OverlappingRegions { a: 1, b: 2 });
        // Touching is not overlapping.
        let mut m = tcp_sample();
        m.regions[1].base = 0x2000;
        assert_eq!(m.validate(), Ok(()));
    }

    #[test]
    fn rejects_verbs_section_mismatch() {
        let mut m = verbs_sample();
        m.verbs = None;
        rejects(&m, HandshakeError::MissingVerbs);
        let mut m = tcp_sample();
        m.verbs = verbs_sample().verbs;
        rejects(&m, HandshakeError::UnexpectedVerbs(TransportKind::Tcp));
        let mut b = tcp_sample().encode();
        let at = b.len() - 2;
        b[at] = 2;
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::BadVerbsFlag(2)));
    }

    #[test]
    fn rejects_unknown_link_layer() {
        let m = verbs_sample();
        let mut b = m.encode();
        let flag_at = b.len() - (1 + 2 + 16 + 1 + 4 * 2 + 4 + 4) - 1 - 1;
        assert_eq!(b[flag_at], 1);
        b[flag_at + 1] = 3;
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::UnknownLinkLayer(3)));
    }

    #[test]
    fn rejects_zero_lid_on_infiniband() {
        let mut m = verbs_sample();
        m.verbs.as_mut().unwrap().lid = 0;
        rejects(&m, HandshakeError::ZeroLidOnInfiniBand);
        // Fine on Ethernet (RoCE).
        m.verbs.as_mut().unwrap().link_layer = LinkLayer::Ethernet;
        assert_eq!(HandshakeMetadata::decode(&m.encode()), Ok(m));
    }

    #[test]
    fn rejects_bad_mtu() {
        for mtu in [0, 128, 255, 257, 1000, 3000, 8192, u32::MAX] {
            let mut m = verbs_sample();
            m.verbs.as_mut().unwrap().mtu = mtu;
            rejects(&m, HandshakeError::BadMtu(mtu));
        }
        for mtu in [256, 512, 1024, 2048, 4096] {
            let mut m = verbs_sample();
            m.verbs.as_mut().unwrap().mtu = mtu;
            assert_eq!(m.validate(), Ok(()));
        }
    }

    #[test]
    fn rejects_bad_psn() {
        let mut m = verbs_sample();
        m.verbs.as_mut().unwrap().psn = PSN_QPN_LIMIT;
        rejects(&m, HandshakeError::BadPsn(PSN_QPN_LIMIT));
    }

    #[test]
    fn rejects_bad_qpns() {
        let mut m = verbs_sample();
        m.verbs.as_mut().unwrap().qpns.clear();
        rejects(&m, HandshakeError::NoQpns);
        let mut m = verbs_sample();
        m.verbs.as_mut().unwrap().qpns = vec![1; QPNS_MAX + 1];
        rejects(&m, HandshakeError::TooManyQpns(QPNS_MAX + 1));
        // More than fit in the count byte: saturated, still rejected.
        m.verbs.as_mut().unwrap().qpns = vec![1; 300];
        assert_eq!(HandshakeMetadata::decode(&m.encode()), Err(HandshakeError::TooManyQpns(255)));
        let mut m = verbs_sample();
        m.verbs.as_mut().unwrap().qpns.push(PSN_QPN_LIMIT);
        rejects(&m, HandshakeError::BadQpn(PSN_QPN_LIMIT));
    }

    #[test]
    fn rejects_bad_same_host_sections() {
        let mut b = tcp_sample().encode();
        *b.last_mut().unwrap() = 2;
        assert_eq!(HandshakeMetadata::decode(&b), Err(HandshakeError::BadSameHostFlag(2)));
        let set = |f: &dyn Fn(&mut SameHost)| {
            let mut m = same_host_sample();
            f(m.same_host.as_mut().unwrap());
            m
        };
        rejects(&set(&|h| h.host_id.clear()), HandshakeError::BadSameHostField { field: "host_id", len: 0 });
        rejects(&set(&|h| h.socket.clear()), HandshakeError::BadSameHostField { field: "socket", len: 0 });
        rejects(
            &set(&|h| h.host_id = "h".repeat(HOST_ID_BYTES_MAX + 1)),
            HandshakeError::BadSameHostField { field: "host_id", len: HOST_ID_BYTES_MAX + 1 },
        );
        rejects(
            &set(&|h| h.socket = "s".repeat(SOCKET_NAME_BYTES_MAX + 1)),
            HandshakeError::BadSameHostField { field: "socket", len: SOCKET_NAME_BYTES_MAX + 1 },
        );
        for bad in ["a b", "nul\0", "é"] {
            let m = set(&|h| h.socket = bad.to_string());
            rejects(&m, HandshakeError::BadSameHostField { field: "socket", len: bad.len() });
        }
        rejects(&set(&|h| h.region = 7), HandshakeError::SameHostRegionMissing(7));
        // On the wire an out-of-range length is refused before its bytes.
        let m = same_host_sample();
        let b = m.encode();
        let h = m.same_host.as_ref().unwrap();
        let at = b.len() - (2 + h.host_id.len() + 2 + h.socket.len() + 4 + TOKEN_BYTES);
        let mut cut = b[..at + 2].to_vec();
        cut[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(
            HandshakeMetadata::decode(&cut),
            Err(HandshakeError::BadSameHostField { field: "host_id", len: usize::from(u16::MAX) })
        );
    }

    #[test]
    fn error_texts_render() {
        assert!(HandshakeError::UnsupportedVersion(9).to_string().contains("version 9"));
        assert!(HandshakeError::BadMagic(*b"abcd").to_string().contains("61, 62"));
    }

    fn random_valid(rng: &mut SplitMix64) -> HandshakeMetadata {
        let mut m = match rng.below(3) {
            0 => tcp_sample(),
            1 => verbs_sample(),
            _ => same_host_sample(),
        };
        m.node = format!("n{}:{}", rng.next_u64(), rng.below(65536));
        let n = rng.below_usize(5);
        m.regions = (0..n as u64)
            .map(|i| Region {
                id: rng.next_u64() as u32 ^ (i as u32),
                base: i << 40,
                len: 1 + rng.below(1 << 40),
                rkey: rng.next_u64() as u32,
            })
            .collect();
        if let Some(h) = m.same_host.as_mut() {
            match m.regions.first() {
                Some(r) => h.region = r.id,
                None => m.same_host = None,
            }
        }
        m
    }

    /// Replays seeded inputs — random bytes, and valid encodings with random
    /// bytes flipped, truncated or extended so decode gets deep — then every
    /// saved regression input.
    #[test]
    fn fuzz_replay() {
        let mut rng = SplitMix64(0x6b76_6873_0000_0001);
        for _ in 0..5000 {
            let mut data = match rng.below(3) {
                0 => {
                    let n = rng.below_usize(256);
                    (0..n).map(|_| rng.next_u64() as u8).collect()
                }
                1 => {
                    let mut d = HANDSHAKE_MAGIC.to_vec();
                    d.push(HANDSHAKE_VERSION);
                    let n = rng.below_usize(250);
                    d.extend((0..n).map(|_| rng.next_u64() as u8));
                    d
                }
                _ => random_valid(&mut rng).encode(),
            };
            for _ in 0..rng.below(4) {
                if !data.is_empty() {
                    let i = rng.below_usize(data.len());
                    data[i] ^= 1 << rng.below(8);
                }
            }
            match rng.below(6) {
                0 => {
                    let keep = rng.below_usize(data.len() + 1);
                    data.truncate(keep);
                }
                1 => data.push(rng.next_u64() as u8),
                _ => {}
            }
            fuzz_handshake_decode(&data);
        }
        crate::testing::replay_regressions("handshake", fuzz_handshake_decode);
    }
}
