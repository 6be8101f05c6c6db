//! Wire format of the TCP data plane: one-sided READ over a byte stream.
//!
//! The TCP transport emulates an RDMA READ: a reader that holds a transfer
//! session (the `transfer_session_id` of a `QueryBlocksForTransfer` answer)
//! names a registered region, an offset inside it and a length; the serving
//! node answers with a header and, on success, exactly that many payload bytes.
//! The server never interprets anything else, so this codec is the whole
//! attack surface of the data plane (contract C13): every length on the wire
//! is bounded before it is used, and malformed input is a typed
//! [`FrameError`], never a panic.
//!
//! This module is sans-io: the async transport feeds it the bytes it has
//! buffered and acts on the decoded values. The decoders are incremental —
//! `Ok(None)` asks for more bytes — and reject a malformed frame as soon as
//! the offending field (for the magic, the offending byte) has arrived, so a
//! peer cannot make the server wait for bytes of a frame that is already known
//! to be bad. After any decode error the server answers [`Status::Malformed`]
//! (or [`Status::TooLarge`], see [`FrameError::status`]) and closes the
//! connection: the stream cannot be resynchronised.
//!
//! All integers are little-endian.
//!
//! # Request frame
//!
//! | offset | size | field | rule |
//! | --- | --- | --- | --- |
//! | 0 | 4 | magic `u32` | [`MAGIC`] (`0x5246_564B`, the bytes `"KVFR"`) |
//! | 4 | 1 | version `u8` | [`VERSION`] |
//! | 5 | 1 | kind `u8` | 1 = Read, 2 = Ping |
//! | 6 | 2 | flags `u16` | must be 0 |
//! | 8 | 8 | req_id `u64` | echoed in the response |
//!
//! A Ping has no body ([`REQUEST_HEADER_BYTES`] in all). A Read continues:
//!
//! | offset | size | field | rule |
//! | --- | --- | --- | --- |
//! | 16 | 2 | session_len `u16` | `1..=limits::SESSION_ID_BYTES_MAX` |
//! | 18 | session_len | session | ASCII `[A-Za-z0-9_.-]` |
//! | 18 + s | 4 | region `u32` | region id from the handshake |
//! | 22 + s | 8 | offset `u64` | bytes from the start of the region |
//! | 30 + s | 8 | len `u64` | `1..=limits::TCP_READ_BYTES_MAX`; `offset + len` must not overflow |
//!
//! # Response
//!
//! | offset | size | field | rule |
//! | --- | --- | --- | --- |
//! | 0 | 4 | magic `u32` | [`MAGIC`] |
//! | 4 | 1 | version `u8` | [`VERSION`] |
//! | 5 | 1 | status `u8` | [`Status`] |
//! | 6 | 2 | flags `u16` | must be 0 |
//! | 8 | 8 | req_id `u64` | the request's |
//! | 16 | 8 | len `u64` | payload bytes that follow |
//!
//! With [`Status::Ok`] the payload is the `len` bytes read (`len` equals the
//! request's; a Ping is answered `Ok` with `len` 0). With any other status it
//! is a UTF-8 error message of at most [`ERROR_MESSAGE_BYTES_MAX`] bytes.

use crate::limits;

/// Frame magic, first field of every request and response: the bytes `"KVFR"`
/// read as a little-endian `u32`.
pub const MAGIC: u32 = 0x5246_564B;

/// Wire-format version carried by every frame; any other value is rejected
/// with [`FrameError::BadVersion`].
pub const VERSION: u8 = 1;

/// Size of the common request header (magic, version, kind, flags, req_id),
/// in bytes. A Ping is exactly this long.
pub const REQUEST_HEADER_BYTES: usize = 16;

/// Size of the fixed part of a Read body (session_len, region, offset, len),
/// in bytes, not counting the session id itself.
pub const READ_BODY_FIXED_BYTES: usize = 2 + 4 + 8 + 8;

/// Largest possible request frame, in bytes: a Read with a session id of
/// `limits::SESSION_ID_BYTES_MAX` bytes. A server never needs to buffer more
/// than this to decode one request.
pub const REQUEST_BYTES_MAX: usize = REQUEST_HEADER_BYTES + READ_BODY_FIXED_BYTES + limits::SESSION_ID_BYTES_MAX;

/// Size of a response header, in bytes.
pub const RESPONSE_HEADER_BYTES: usize = 24;

/// Largest error message that may follow a non-`Ok` response header, in
/// bytes. A message says what went wrong for a log line; 1 KiB is plenty and
/// bounds what a client buffers for a failure. Module-local because only this
/// codec and its callers use it.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1024;

/// The magic as it appears on the wire.
const MAGIC_BYTES: [u8; 4] = MAGIC.to_le_bytes();
/// Request kind byte of a Read.
const KIND_READ: u8 = 1;
/// Request kind byte of a Ping.
const KIND_PING: u8 = 2;

/// One data-plane request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub enum Request {
    /// Read bytes of a region under a transfer session.
    Read(ReadRequest),
    /// Liveness probe; answered with [`Status::Ok`] and an empty payload.
    Ping {
        /// Caller-chosen id echoed in the response.
        req_id: u64,
    },
}

impl Request {
    /// The request id, whichever the kind.
    pub fn req_id(&self) -> u64 {
        match self {
            Request::Read(r) => r.req_id,
            Request::Ping { req_id } => *req_id,
        }
    }

    /// Checks the request can be put on the wire (see
    /// [`ReadRequest::validate`]; a Ping is always valid).
    ///
    /// # Errors
    /// As [`ReadRequest::validate`].
    pub fn validate(&self) -> Result<(), FrameError> {
        match self {
            Request::Read(r) => r.validate(),
            Request::Ping { .. } => Ok(()),
        }
    }
}

/// A one-sided READ: `len` bytes at `offset` (bytes from the region start) of
/// region `region`, under transfer session `session`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub struct ReadRequest {
    /// Caller-chosen id echoed in the response (pipelining).
    pub req_id: u64,
    /// Transfer session id: 1..=`limits::SESSION_ID_BYTES_MAX` bytes of
    /// `[A-Za-z0-9_.-]`.
    pub session: String,
    /// Region id as announced in the server's handshake metadata.
    pub region: u32,
    /// Start of the read, bytes from the start of the region.
    pub offset: u64,
    /// Bytes to read: 1..=`limits::TCP_READ_BYTES_MAX`.
    pub len: u64,
}

impl ReadRequest {
    /// Checks every field the decoder checks, so that an encodable request is
    /// exactly a decodable one.
    ///
    /// # Errors
    /// [`FrameError::SessionLength`], [`FrameError::SessionBytes`],
    /// [`FrameError::ZeroLength`], [`FrameError::TooLarge`] (`len` over
    /// `limits::TCP_READ_BYTES_MAX`) or [`FrameError::RangeOverflow`]
    /// (`offset + len` past `u64::MAX`).
    pub fn validate(&self) -> Result<(), FrameError> {
        let n = self.session.len();
        if n == 0 || n > limits::SESSION_ID_BYTES_MAX {
            return Err(FrameError::SessionLength(n));
        }
        check_session_bytes(self.session.as_bytes())?;
        check_read_range(self.offset, self.len)
    }
}

/// Outcome of a request, one byte on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
#[repr(u8)]
pub enum Status {
    /// Success; the payload is the bytes read (empty for a Ping).
    Ok = 0,
    /// The session is unknown, expired or released.
    UnknownSession = 1,
    /// The region is unknown, or `offset + len` lies outside it, or the range
    /// is not locked under the session.
    OutOfRange = 2,
    /// The request frame was malformed; the server closes the connection.
    Malformed = 3,
    /// The request asked for more than `limits::TCP_READ_BYTES_MAX` bytes.
    TooLarge = 4,
    /// The server failed for a reason of its own.
    Internal = 5,
}

impl Status {
    /// Parses the status byte; `None` for an unknown value.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Status::Ok),
            1 => Some(Status::UnknownSession),
            2 => Some(Status::OutOfRange),
            3 => Some(Status::Malformed),
            4 => Some(Status::TooLarge),
            5 => Some(Status::Internal),
            _ => None,
        }
    }

    /// The status byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// Largest `len` a response with this status may carry, in bytes:
    /// `limits::TCP_READ_BYTES_MAX` for [`Status::Ok`],
    /// [`ERROR_MESSAGE_BYTES_MAX`] otherwise.
    pub const fn payload_bytes_max(self) -> u64 {
        match self {
            Status::Ok => limits::TCP_READ_BYTES_MAX,
            _ => ERROR_MESSAGE_BYTES_MAX as u64,
        }
    }
}

/// Response header; `len` payload bytes follow it on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(any(test, fuzzing), derive(arbitrary::Arbitrary))]
pub struct ResponseHeader {
    /// The request's id.
    pub req_id: u64,
    /// Outcome.
    pub status: Status,
    /// Payload bytes that follow: the data for [`Status::Ok`] (at most
    /// `limits::TCP_READ_BYTES_MAX`), a UTF-8 message otherwise (at most
    /// [`ERROR_MESSAGE_BYTES_MAX`]).
    pub len: u64,
}

impl ResponseHeader {
    /// Checks `len` against [`Status::payload_bytes_max`].
    ///
    /// # Errors
    /// [`FrameError::TooLarge`].
    pub fn validate(&self) -> Result<(), FrameError> {
        let max = self.status.payload_bytes_max();
        if self.len > max {
            return Err(FrameError::TooLarge { len: self.len, max });
        }
        Ok(())
    }
}

/// A malformed frame. After any of these the stream cannot be trusted: the
/// server answers with [`FrameError::status`] and closes the connection; a
/// client fails every read in flight on that connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first bytes are not [`MAGIC`]. Carries the received bytes up to
    /// and including the first wrong one, read as a little-endian `u32` with
    /// the rest zero (so the value does not depend on how much was buffered).
    #[error("bad frame magic {0:#010x} (want {want:#010x})", want = MAGIC)]
    BadMagic(u32),
    /// Unsupported wire-format version.
    #[error("unsupported frame version {0} (want {want})", want = VERSION)]
    BadVersion(u8),
    /// Unknown request kind byte (want 1 = Read or 2 = Ping).
    #[error("unknown request kind {0} (want 1 = read or 2 = ping)")]
    BadKind(u8),
    /// Nonzero flags field.
    #[error("nonzero frame flags {0:#06x}")]
    BadFlags(u16),
    /// Unknown response status byte.
    #[error("unknown response status {0}")]
    BadStatus(u8),
    /// Session id length (bytes) outside `1..=limits::SESSION_ID_BYTES_MAX`.
    #[error("session id length {0} not in 1..={max}", max = limits::SESSION_ID_BYTES_MAX)]
    SessionLength(usize),
    /// Session id contains a byte outside `[A-Za-z0-9_.-]`.
    #[error("session id contains a byte outside [A-Za-z0-9_.-]")]
    SessionBytes,
    /// A Read of zero bytes.
    #[error("zero-length read")]
    ZeroLength,
    /// A length (bytes) over its bound: a Read `len` or an `Ok` response
    /// `len` over `limits::TCP_READ_BYTES_MAX`, or an error message over
    /// [`ERROR_MESSAGE_BYTES_MAX`].
    #[error("length {len} bytes exceeds the maximum {max}")]
    TooLarge {
        /// The length received, bytes.
        len: u64,
        /// The bound it broke, bytes.
        max: u64,
    },
    /// `offset + len` of a Read does not fit in a `u64`.
    #[error("read range overflows: offset {offset} + len {len}")]
    RangeOverflow {
        /// Requested offset, bytes.
        offset: u64,
        /// Requested length, bytes.
        len: u64,
    },
    /// An error-message payload that is not UTF-8.
    #[error("error message is not valid UTF-8")]
    MessageUtf8,
}

impl FrameError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            FrameError::BadMagic(_) => "frame_bad_magic",
            FrameError::BadVersion(_) => "frame_bad_version",
            FrameError::BadKind(_) => "frame_bad_kind",
            FrameError::BadFlags(_) => "frame_bad_flags",
            FrameError::BadStatus(_) => "frame_bad_status",
            FrameError::SessionLength(_) => "frame_session_length",
            FrameError::SessionBytes => "frame_session_bytes",
            FrameError::ZeroLength => "frame_zero_length",
            FrameError::TooLarge { .. } => "frame_too_large",
            FrameError::RangeOverflow { .. } => "frame_range_overflow",
            FrameError::MessageUtf8 => "frame_message_utf8",
        }
    }
}

impl FrameError {
    /// The status a server answers this decode error with:
    /// [`Status::TooLarge`] for [`FrameError::TooLarge`], [`Status::Malformed`]
    /// for everything else.
    pub fn status(&self) -> Status {
        match self {
            FrameError::TooLarge { .. } => Status::TooLarge,
            _ => Status::Malformed,
        }
    }
}

/// Appends the wire form of `req` to `out`.
///
/// # Errors
/// As [`Request::validate`]; nothing is appended then. A request that encodes
/// decodes back to itself (and nothing else decodes).
pub fn encode_request(req: &Request, out: &mut Vec<u8>) -> Result<(), FrameError> {
    req.validate()?;
    match req {
        Request::Ping { req_id } => {
            out.reserve(REQUEST_HEADER_BYTES);
            put_header(out, KIND_PING, *req_id);
        }
        Request::Read(r) => {
            let session_len = u16::try_from(r.session.len()).map_err(|_| FrameError::SessionLength(r.session.len()))?;
            out.reserve(REQUEST_HEADER_BYTES + READ_BODY_FIXED_BYTES + r.session.len());
            put_header(out, KIND_READ, r.req_id);
            out.extend_from_slice(&session_len.to_le_bytes());
            out.extend_from_slice(r.session.as_bytes());
            out.extend_from_slice(&r.region.to_le_bytes());
            out.extend_from_slice(&r.offset.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
    }
    Ok(())
}

/// Decodes one request from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` is a valid but incomplete prefix of a frame
/// (read more and call again with the bytes extended), and
/// `Ok(Some((request, consumed)))` for a complete frame, `consumed` being its
/// size in bytes (at most [`REQUEST_BYTES_MAX`]); bytes after it are left
/// alone. Each field is checked as soon as it has arrived (the magic byte by
/// byte), so a bad frame is an error however few of its bytes are buffered.
///
/// # Errors
/// [`FrameError::BadMagic`], [`FrameError::BadVersion`],
/// [`FrameError::BadKind`], [`FrameError::BadFlags`],
/// [`FrameError::SessionLength`], [`FrameError::SessionBytes`],
/// [`FrameError::ZeroLength`], [`FrameError::TooLarge`],
/// [`FrameError::RangeOverflow`].
pub fn decode_request(buf: &[u8]) -> Result<Option<(Request, usize)>, FrameError> {
    check_magic_prefix(buf)?;
    let mut c = Cursor::new(buf);
    let Some(_magic) = c.u32() else {
        return Ok(None);
    };
    let Some(version) = c.u8() else {
        return Ok(None);
    };
    check_version(version)?;
    let Some(kind) = c.u8() else {
        return Ok(None);
    };
    if kind != KIND_READ && kind != KIND_PING {
        return Err(FrameError::BadKind(kind));
    }
    let Some(flags) = c.u16() else {
        return Ok(None);
    };
    check_flags(flags)?;
    let Some(req_id) = c.u64() else {
        return Ok(None);
    };
    if kind == KIND_PING {
        return Ok(Some((Request::Ping { req_id }, c.pos)));
    }

    let Some(session_len) = c.u16() else {
        return Ok(None);
    };
    let session_len = usize::from(session_len);
    if session_len == 0 || session_len > limits::SESSION_ID_BYTES_MAX {
        return Err(FrameError::SessionLength(session_len));
    }
    // Check the session bytes that have arrived before asking for the rest.
    let arrived = c.rest();
    check_session_bytes(arrived.get(..session_len).unwrap_or(arrived))?;
    let Some(session) = c.take(session_len) else {
        return Ok(None);
    };
    let Some(region) = c.u32() else {
        return Ok(None);
    };
    let Some(offset) = c.u64() else {
        return Ok(None);
    };
    let Some(len) = c.u64() else {
        return Ok(None);
    };
    check_read_range(offset, len)?;
    // Every byte is ASCII (checked above), so this cannot fail; map anyway
    // rather than unwrap.
    let session = String::from_utf8(session.to_vec()).map_err(|_| FrameError::SessionBytes)?;
    let req = ReadRequest { req_id, session, region, offset, len };
    Ok(Some((Request::Read(req), c.pos)))
}

/// Appends the [`RESPONSE_HEADER_BYTES`]-byte wire form of `h` to `out`; the
/// caller then writes the `h.len` payload bytes.
///
/// # Errors
/// As [`ResponseHeader::validate`]; nothing is appended then.
pub fn encode_response_header(h: &ResponseHeader, out: &mut Vec<u8>) -> Result<(), FrameError> {
    h.validate()?;
    out.reserve(RESPONSE_HEADER_BYTES);
    out.extend_from_slice(&MAGIC_BYTES);
    out.push(VERSION);
    out.push(h.status.as_u8());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&h.req_id.to_le_bytes());
    out.extend_from_slice(&h.len.to_le_bytes());
    Ok(())
}

/// Decodes one response header from the front of `buf` (incremental, like
/// [`decode_request`]): `Ok(None)` asks for more bytes,
/// `Ok(Some((header, RESPONSE_HEADER_BYTES)))` is a complete header. The
/// payload is not consumed; the caller reads `header.len` more bytes, which
/// the decoder has bounded by [`Status::payload_bytes_max`].
///
/// # Errors
/// [`FrameError::BadMagic`], [`FrameError::BadVersion`],
/// [`FrameError::BadStatus`], [`FrameError::BadFlags`],
/// [`FrameError::TooLarge`].
pub fn decode_response_header(buf: &[u8]) -> Result<Option<(ResponseHeader, usize)>, FrameError> {
    check_magic_prefix(buf)?;
    let mut c = Cursor::new(buf);
    let Some(_magic) = c.u32() else {
        return Ok(None);
    };
    let Some(version) = c.u8() else {
        return Ok(None);
    };
    check_version(version)?;
    let Some(status) = c.u8() else {
        return Ok(None);
    };
    let status = Status::from_u8(status).ok_or(FrameError::BadStatus(status))?;
    let Some(flags) = c.u16() else {
        return Ok(None);
    };
    check_flags(flags)?;
    let Some(req_id) = c.u64() else {
        return Ok(None);
    };
    let Some(len) = c.u64() else {
        return Ok(None);
    };
    let h = ResponseHeader { req_id, status, len };
    h.validate()?;
    Ok(Some((h, c.pos)))
}

/// The longest prefix of `msg` that fits in [`ERROR_MESSAGE_BYTES_MAX`]
/// bytes and ends on a character boundary: what a server sends as the
/// payload of an error response.
pub fn truncate_error_message(msg: &str) -> &str {
    let mut end = msg.len().min(ERROR_MESSAGE_BYTES_MAX);
    while !msg.is_char_boundary(end) {
        // `end > 0` here: 0 is always a char boundary.
        end = end.saturating_sub(1);
    }
    msg.get(..end).unwrap_or("")
}

/// Checks and returns the error message carried by a non-`Ok` response.
///
/// # Errors
/// [`FrameError::TooLarge`] over [`ERROR_MESSAGE_BYTES_MAX`] bytes,
/// [`FrameError::MessageUtf8`] when not UTF-8.
pub fn decode_error_message(payload: &[u8]) -> Result<&str, FrameError> {
    if payload.len() > ERROR_MESSAGE_BYTES_MAX {
        return Err(FrameError::TooLarge {
            len: u64::try_from(payload.len()).unwrap_or(u64::MAX),
            max: ERROR_MESSAGE_BYTES_MAX as u64,
        });
    }
    std::str::from_utf8(payload).map_err(|_| FrameError::MessageUtf8)
}

/// Appends magic, version, kind, zero flags and `req_id`.
fn put_header(out: &mut Vec<u8>, kind: u8, req_id: u64) {
    out.extend_from_slice(&MAGIC_BYTES);
    out.push(VERSION);
    out.push(kind);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&req_id.to_le_bytes());
}

/// Fails as soon as one received byte differs from [`MAGIC_BYTES`].
fn check_magic_prefix(buf: &[u8]) -> Result<(), FrameError> {
    let Some(bad) = buf.iter().zip(MAGIC_BYTES.iter()).position(|(got, want)| got != want) else {
        return Ok(());
    };
    // Keep the bytes up to and including the first wrong one, so the error
    // does not depend on how many bytes happened to be buffered.
    let mut got = [0u8; 4];
    for (dst, src) in got.iter_mut().zip(buf.iter()).take(bad.saturating_add(1)) {
        *dst = *src;
    }
    Err(FrameError::BadMagic(u32::from_le_bytes(got)))
}

fn check_version(v: u8) -> Result<(), FrameError> {
    if v == VERSION { Ok(()) } else { Err(FrameError::BadVersion(v)) }
}

fn check_flags(flags: u16) -> Result<(), FrameError> {
    if flags == 0 { Ok(()) } else { Err(FrameError::BadFlags(flags)) }
}

/// Every byte is one of `[A-Za-z0-9_.-]` (the `SessionId` alphabet).
fn check_session_bytes(bytes: &[u8]) -> Result<(), FrameError> {
    let ok = bytes.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok { Ok(()) } else { Err(FrameError::SessionBytes) }
}

/// `len` in `1..=TCP_READ_BYTES_MAX` and `offset + len` representable.
fn check_read_range(offset: u64, len: u64) -> Result<(), FrameError> {
    if len == 0 {
        return Err(FrameError::ZeroLength);
    }
    if len > limits::TCP_READ_BYTES_MAX {
        return Err(FrameError::TooLarge { len, max: limits::TCP_READ_BYTES_MAX });
    }
    if offset.checked_add(len).is_none() {
        return Err(FrameError::RangeOverflow { offset, len });
    }
    Ok(())
}

/// Bounds-checked little-endian reader; every accessor returns `None` when
/// the bytes have not arrived, and then consumes nothing.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or(&[])
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Fuzz body (cargo-fuzz target `tcp_frame`, and the replay test below).
///
/// Treats `data` as a byte stream and decodes requests from it until an error
/// or an incomplete frame, then does the same for responses (skipping each
/// payload). For every decoded frame it checks: re-encoding gives back the
/// exact bytes consumed; every strict prefix of those bytes decodes to
/// `Ok(None)`; appending a byte never changes a complete or failed decode.
/// Finally it builds a [`Request`] and a [`ResponseHeader`] from `data` with
/// `arbitrary` and checks that encoding succeeds exactly when `validate` does
/// and then decodes back to the same value. Panics (the fuzzer's signal) only
/// when one of these properties is broken.
#[cfg(any(test, fuzzing))]
pub fn fuzz_frame_decode(data: &[u8]) {
    // Requests. Each decoded frame consumes at least 16 bytes, so the bound
    // is never reached; it is there so the loop has one.
    let mut rest = data;
    for _ in 0..=data.len() {
        let res = decode_request(rest);
        check_extension_stable(rest, &res, decode_request);
        let Ok(Some((req, n))) = res else { break };
        assert!(n > 0 && n <= REQUEST_BYTES_MAX, "bad consumed {n}");
        let frame = rest.get(..n).expect("consumed within input");
        let mut again = Vec::new();
        encode_request(&req, &mut again).expect("decoded request re-encodes");
        assert_eq!(again, frame, "re-encoding differs");
        assert_eq!(decode_request(&again), Ok(Some((req, n))));
        for cut in 0..n {
            let prefix = frame.get(..cut).expect("cut < n");
            assert_eq!(decode_request(prefix), Ok(None), "prefix {cut} of {n}");
        }
        rest = rest.get(n..).unwrap_or(&[]);
    }

    // Responses: header, then `len` payload bytes.
    let mut rest = data;
    for _ in 0..=data.len() {
        let res = decode_response_header(rest);
        check_extension_stable(rest, &res, decode_response_header);
        let Ok(Some((h, n))) = res else { break };
        assert_eq!(n, RESPONSE_HEADER_BYTES);
        assert!(h.len <= h.status.payload_bytes_max());
        let frame = rest.get(..n).expect("consumed within input");
        let mut again = Vec::new();
        encode_response_header(&h, &mut again).expect("decoded header re-encodes");
        assert_eq!(again, frame, "re-encoding differs");
        for cut in 0..n {
            let prefix = frame.get(..cut).expect("cut < n");
            assert_eq!(decode_response_header(prefix), Ok(None));
        }
        let Some(end) = usize::try_from(h.len).ok().and_then(|l| n.checked_add(l)) else {
            break;
        };
        let Some(payload) = rest.get(n..end) else {
            break;
        };
        if h.status != Status::Ok {
            // Any outcome is fine; it must not panic.
            let _ = decode_error_message(payload);
        }
        rest = rest.get(end..).unwrap_or(&[]);
    }

    // Structured: encode succeeds iff validate does, and round-trips.
    let mut u = arbitrary::Unstructured::new(data);
    if let Ok(req) = u.arbitrary::<Request>() {
        let mut out = Vec::new();
        match encode_request(&req, &mut out) {
            Ok(()) => {
                assert_eq!(decode_request(&out), Ok(Some((req, out.len()))));
            }
            Err(e) => {
                assert!(out.is_empty(), "failed encode appended bytes");
                assert_eq!(req.validate(), Err(e));
            }
        }
    }
    if let Ok(h) = u.arbitrary::<ResponseHeader>() {
        let mut out = Vec::new();
        match encode_response_header(&h, &mut out) {
            Ok(()) => assert_eq!(decode_response_header(&out), Ok(Some((h, out.len())))),
            Err(e) => {
                assert!(out.is_empty(), "failed encode appended bytes");
                assert_eq!(h.validate(), Err(e));
            }
        }
    }
}

/// What an incremental decoder returns.
#[cfg(any(test, fuzzing))]
type Decoded<T> = Result<Option<(T, usize)>, FrameError>;

/// A complete or failed decode depends only on the bytes already examined:
/// appending a byte must give the same answer.
#[cfg(any(test, fuzzing))]
fn check_extension_stable<T: PartialEq + std::fmt::Debug>(
    buf: &[u8],
    res: &Decoded<T>,
    decode: fn(&[u8]) -> Decoded<T>,
) {
    if matches!(res, Ok(None)) {
        return;
    }
    let mut longer = buf.to_vec();
    longer.push(0xA5);
    assert_eq!(&decode(&longer), res, "decode changed when a byte was appended");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::testing::SplitMix64;

    const SESSION_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.";

    fn random_request(rng: &mut SplitMix64) -> Request {
        if rng.below(4) == 0 {
            return Request::Ping { req_id: rng.next_u64() };
        }
        let n = 1 + rng.below_usize(limits::SESSION_ID_BYTES_MAX);
        let session = (0..n).map(|_| char::from(SESSION_ALPHABET[rng.below_usize(SESSION_ALPHABET.len())])).collect();
        let len = 1 + rng.below(limits::TCP_READ_BYTES_MAX);
        let offset = if rng.below(2) == 0 { rng.below(1 << 32) } else { rng.below(u64::MAX - len + 1) };
        Request::Read(ReadRequest { req_id: rng.next_u64(), session, region: rng.next_u64() as u32, offset, len })
    }

    fn random_response(rng: &mut SplitMix64, out: &mut Vec<u8>) {
        let status = Status::from_u8(rng.below(6) as u8).unwrap();
        let len = rng.below(40);
        let h = ResponseHeader { req_id: rng.next_u64(), status, len };
        encode_response_header(&h, out).unwrap();
        out.extend(rng.bytes(len as usize));
    }

    fn encoded(req: &Request) -> Vec<u8> {
        let mut out = Vec::new();
        encode_request(req, &mut out).unwrap();
        out
    }

    fn read(session: &str, offset: u64, len: u64) -> ReadRequest {
        ReadRequest { req_id: 7, session: session.to_string(), region: 3, offset, len }
    }

    fn sample_read_bytes() -> Vec<u8> {
        encoded(&Request::Read(read("sess-01", 4096, 512)))
    }

    fn sample_response_bytes() -> Vec<u8> {
        let mut out = Vec::new();
        let h = ResponseHeader { req_id: 9, status: Status::Ok, len: 100 };
        encode_response_header(&h, &mut out).unwrap();
        out
    }

    fn session_strategy() -> impl Strategy<Value = String> {
        proptest::collection::vec(proptest::sample::select(SESSION_ALPHABET), 1..=64)
            .prop_map(|v| String::from_utf8(v).unwrap())
    }

    fn request_strategy() -> impl Strategy<Value = Request> {
        let read = (any::<u64>(), session_strategy(), any::<u32>(), 1..=limits::TCP_READ_BYTES_MAX, any::<u64>())
            .prop_map(|(req_id, session, region, len, off)| {
                let offset = off % (u64::MAX - len + 1);
                Request::Read(ReadRequest { req_id, session, region, offset, len })
            });
        prop_oneof![any::<u64>().prop_map(|req_id| Request::Ping { req_id }), read]
    }

    fn response_strategy() -> impl Strategy<Value = ResponseHeader> {
        (any::<u64>(), 0u8..6, any::<u64>()).prop_map(|(req_id, s, len)| {
            let status = Status::from_u8(s).unwrap();
            let len = len % (status.payload_bytes_max() + 1);
            ResponseHeader { req_id, status, len }
        })
    }

    proptest! {
        // Never write regression files next to the source.
        #![proptest_config(ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn request_round_trip(req in request_strategy(), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut buf = encoded(&req);
            let n = buf.len();
            prop_assert!(n <= REQUEST_BYTES_MAX);
            buf.extend(tail);
            prop_assert_eq!(decode_request(&buf), Ok(Some((req, n))));
        }

        #[test]
        fn response_round_trip(h in response_strategy(), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut buf = Vec::new();
            encode_response_header(&h, &mut buf).unwrap();
            prop_assert_eq!(buf.len(), RESPONSE_HEADER_BYTES);
            buf.extend(tail);
            prop_assert_eq!(decode_response_header(&buf), Ok(Some((h, RESPONSE_HEADER_BYTES))));
        }

        #[test]
        fn request_split_points(req in request_strategy()) {
            let buf = encoded(&req);
            for cut in 0..buf.len() {
                prop_assert_eq!(decode_request(&buf[..cut]), Ok(None));
            }
            prop_assert_eq!(decode_request(&buf), Ok(Some((req, buf.len()))));
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..128)) {
            fuzz_frame_decode(&data);
        }
    }

    #[test]
    fn wire_layout_is_as_documented() {
        let b = sample_read_bytes();
        assert_eq!(&b[..4], b"KVFR");
        assert_eq!(b[4], 1);
        assert_eq!(b[5], 1);
        assert_eq!(&b[6..8], &[0, 0]);
        assert_eq!(&b[8..16], &7u64.to_le_bytes());
        assert_eq!(&b[16..18], &7u16.to_le_bytes());
        assert_eq!(&b[18..25], b"sess-01");
        assert_eq!(&b[25..29], &3u32.to_le_bytes());
        assert_eq!(&b[29..37], &4096u64.to_le_bytes());
        assert_eq!(&b[37..45], &512u64.to_le_bytes());
        assert_eq!(b.len(), REQUEST_HEADER_BYTES + READ_BODY_FIXED_BYTES + 7);
        let p = encoded(&Request::Ping { req_id: 1 });
        assert_eq!(p.len(), REQUEST_HEADER_BYTES);
        assert_eq!(p[5], 2);
        let r = sample_response_bytes();
        assert_eq!(&r[..4], b"KVFR");
        assert_eq!(r[5], 0);
        assert_eq!(&r[16..24], &100u64.to_le_bytes());
    }

    #[test]
    fn every_split_point_of_each_frame_is_incomplete() {
        for frame in [sample_read_bytes(), encoded(&Request::Ping { req_id: u64::MAX })] {
            for cut in 0..frame.len() {
                assert_eq!(decode_request(&frame[..cut]), Ok(None), "cut {cut}");
            }
            assert!(decode_request(&frame).unwrap().is_some());
        }
        let r = sample_response_bytes();
        for cut in 0..r.len() {
            assert_eq!(decode_response_header(&r[..cut]), Ok(None), "cut {cut}");
        }
    }

    #[test]
    fn two_frames_back_to_back() {
        let a = Request::Read(read("a", 0, 1));
        let b = Request::Ping { req_id: 42 };
        let mut buf = encoded(&a);
        let first = buf.len();
        encode_request(&b, &mut buf).unwrap();
        let (got, n) = decode_request(&buf).unwrap().unwrap();
        assert_eq!((got, n), (a, first));
        let (got, m) = decode_request(&buf[n..]).unwrap().unwrap();
        assert_eq!((got, m), (b, REQUEST_HEADER_BYTES));
        assert_eq!(n + m, buf.len());

        let mut rbuf = Vec::new();
        let h1 = ResponseHeader { req_id: 1, status: Status::Ok, len: 3 };
        let h2 = ResponseHeader { req_id: 2, status: Status::OutOfRange, len: 2 };
        encode_response_header(&h1, &mut rbuf).unwrap();
        rbuf.extend_from_slice(b"abc");
        encode_response_header(&h2, &mut rbuf).unwrap();
        rbuf.extend_from_slice(b"no");
        let (g1, n1) = decode_response_header(&rbuf).unwrap().unwrap();
        assert_eq!(g1, h1);
        let rest = &rbuf[n1 + 3..];
        let (g2, n2) = decode_response_header(rest).unwrap().unwrap();
        assert_eq!(g2, h2);
        assert_eq!(decode_error_message(&rest[n2..]), Ok("no"));
    }

    #[test]
    fn bad_magic_detected_from_first_byte() {
        assert_eq!(decode_request(b"G"), Err(FrameError::BadMagic(u32::from(b'G'))));
        assert_eq!(decode_request(b"GET "), Err(FrameError::BadMagic(u32::from(b'G'))));
        assert_eq!(decode_request(b"KVGR"), Err(FrameError::BadMagic(u32::from_le_bytes(*b"KVG\0"))));
        assert_eq!(decode_request(b"KVF"), Ok(None));
        assert_eq!(decode_request(b"KVFX"), Err(FrameError::BadMagic(u32::from_le_bytes(*b"KVFX"))));
        assert_eq!(decode_response_header(b"KX"), Err(FrameError::BadMagic(u32::from_le_bytes(*b"KX\0\0"))));
        assert_eq!(decode_request(b""), Ok(None));
    }

    #[test]
    fn bad_version_kind_flags() {
        let mut b = sample_read_bytes();
        b[4] = 2;
        assert_eq!(decode_request(&b[..5]), Err(FrameError::BadVersion(2)));
        let mut b = sample_read_bytes();
        b[5] = 3;
        assert_eq!(decode_request(&b[..6]), Err(FrameError::BadKind(3)));
        b[5] = 0;
        assert_eq!(decode_request(&b), Err(FrameError::BadKind(0)));
        let mut b = sample_read_bytes();
        b[7] = 0x80;
        assert_eq!(decode_request(&b[..8]), Err(FrameError::BadFlags(0x8000)));

        let mut r = sample_response_bytes();
        r[4] = 0;
        assert_eq!(decode_response_header(&r[..5]), Err(FrameError::BadVersion(0)));
        let mut r = sample_response_bytes();
        r[6] = 1;
        assert_eq!(decode_response_header(&r), Err(FrameError::BadFlags(1)));
    }

    #[test]
    fn bad_status() {
        let mut r = sample_response_bytes();
        r[5] = 6;
        assert_eq!(decode_response_header(&r[..6]), Err(FrameError::BadStatus(6)));
        r[5] = 0xFF;
        assert_eq!(decode_response_header(&r), Err(FrameError::BadStatus(0xFF)));
        for v in 0..=u8::MAX {
            match Status::from_u8(v) {
                Some(s) => assert_eq!(s.as_u8(), v),
                None => assert!(v > 5),
            }
        }
    }

    #[test]
    fn session_length_errors() {
        let mut b = sample_read_bytes();
        b[16..18].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(decode_request(&b[..18]), Err(FrameError::SessionLength(0)));
        b[16..18].copy_from_slice(&65u16.to_le_bytes());
        assert_eq!(decode_request(&b[..18]), Err(FrameError::SessionLength(65)));
        b[16..18].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(decode_request(&b), Err(FrameError::SessionLength(usize::from(u16::MAX))));
        let long = "x".repeat(65);
        let mut out = Vec::new();
        assert_eq!(encode_request(&Request::Read(read(&long, 0, 1)), &mut out), Err(FrameError::SessionLength(65)));
        assert_eq!(encode_request(&Request::Read(read("", 0, 1)), &mut out), Err(FrameError::SessionLength(0)));
        assert!(out.is_empty());
        // The longest legal session id is accepted.
        let max = "y".repeat(limits::SESSION_ID_BYTES_MAX);
        let req = Request::Read(read(&max, 0, 1));
        let b = encoded(&req);
        assert_eq!(b.len(), REQUEST_BYTES_MAX);
        assert_eq!(decode_request(&b), Ok(Some((req, REQUEST_BYTES_MAX))));
    }

    #[test]
    fn session_bytes_errors() {
        let mut b = sample_read_bytes();
        b[19] = b' ';
        // Detected as soon as the bad byte has arrived.
        assert_eq!(decode_request(&b[..20]), Err(FrameError::SessionBytes));
        assert_eq!(decode_request(&b[..19]), Ok(None));
        let mut b = sample_read_bytes();
        b[18] = 0xC3;
        b[19] = 0xA9; // "é": UTF-8 but not in the alphabet
        assert_eq!(decode_request(&b), Err(FrameError::SessionBytes));
        let mut out = Vec::new();
        for bad in ["a b", "é", "a/b", "a\0"] {
            assert_eq!(
                encode_request(&Request::Read(read(bad, 0, 1)), &mut out),
                Err(FrameError::SessionBytes),
                "{bad:?}"
            );
        }
        assert!(out.is_empty());
    }

    #[test]
    fn length_errors() {
        let len_at = sample_read_bytes().len() - 8;
        let off_at = len_at - 8;
        let mut b = sample_read_bytes();
        b[len_at..].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(decode_request(&b), Err(FrameError::ZeroLength));
        let too = limits::TCP_READ_BYTES_MAX + 1;
        b[len_at..].copy_from_slice(&too.to_le_bytes());
        let e = decode_request(&b).unwrap_err();
        assert_eq!(e, FrameError::TooLarge { len: too, max: limits::TCP_READ_BYTES_MAX });
        assert_eq!(e.status(), Status::TooLarge);
        b[len_at..].copy_from_slice(&limits::TCP_READ_BYTES_MAX.to_le_bytes());
        assert!(decode_request(&b).unwrap().is_some());
        b[off_at..len_at].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            decode_request(&b),
            Err(FrameError::RangeOverflow { offset: u64::MAX, len: limits::TCP_READ_BYTES_MAX })
        );
        assert_eq!(FrameError::ZeroLength.status(), Status::Malformed);

        let mut out = Vec::new();
        assert_eq!(encode_request(&Request::Read(read("s", 0, 0)), &mut out), Err(FrameError::ZeroLength));
        assert_eq!(
            encode_request(&Request::Read(read("s", u64::MAX, 1)), &mut out),
            Err(FrameError::RangeOverflow { offset: u64::MAX, len: 1 })
        );
        assert!(out.is_empty());
        // The last representable byte is a legal range.
        let req = Request::Read(read("s", u64::MAX - 1, 1));
        assert!(decode_request(&encoded(&req)).unwrap().is_some());
    }

    #[test]
    fn response_length_errors() {
        let mut r = sample_response_bytes();
        let too = limits::TCP_READ_BYTES_MAX + 1;
        r[16..24].copy_from_slice(&too.to_le_bytes());
        assert_eq!(decode_response_header(&r), Err(FrameError::TooLarge { len: too, max: limits::TCP_READ_BYTES_MAX }));
        r[5] = Status::Internal.as_u8();
        r[16..24].copy_from_slice(&1025u64.to_le_bytes());
        assert_eq!(decode_response_header(&r), Err(FrameError::TooLarge { len: 1025, max: 1024 }));
        r[16..24].copy_from_slice(&1024u64.to_le_bytes());
        assert!(decode_response_header(&r).unwrap().is_some());
        let mut out = Vec::new();
        let h = ResponseHeader { req_id: 0, status: Status::UnknownSession, len: 5000 };
        assert!(encode_response_header(&h, &mut out).is_err());
        assert!(out.is_empty());
        // A Ping answer: Ok with an empty payload.
        let h = ResponseHeader { req_id: 0, status: Status::Ok, len: 0 };
        encode_response_header(&h, &mut out).unwrap();
        assert_eq!(decode_response_header(&out), Ok(Some((h, RESPONSE_HEADER_BYTES))));
    }

    #[test]
    fn error_messages() {
        assert_eq!(decode_error_message(b"fine"), Ok("fine"));
        assert_eq!(decode_error_message(&[0xFF, 0xFE]), Err(FrameError::MessageUtf8));
        assert_eq!(decode_error_message(&[b'a'; 1025]), Err(FrameError::TooLarge { len: 1025, max: 1024 }));
        let long = "é".repeat(600); // 1200 bytes, 2 per char
        let t = truncate_error_message(&long);
        assert_eq!(t.len(), 1024);
        let odd = format!("a{long}");
        let t = truncate_error_message(&odd);
        assert_eq!(t.len(), 1023);
        assert!(decode_error_message(t.as_bytes()).is_ok());
        assert_eq!(truncate_error_message("short"), "short");
        // Error texts render.
        assert!(FrameError::BadMagic(1).to_string().contains("0x5246564b"));
    }

    /// Replays seeded inputs — random bytes, and valid frames with random
    /// bytes flipped and random truncation so the decoders get deep — then
    /// every saved regression input.
    #[test]
    fn fuzz_replay() {
        let mut rng = SplitMix64(0x6b76_6672_7900_0001);
        for _ in 0..5000 {
            let data = match rng.below(4) {
                0 => {
                    let n = rng.below_usize(256);
                    rng.bytes(n)
                }
                1 => {
                    let mut d = MAGIC_BYTES.to_vec();
                    let n = rng.below_usize(252);
                    d.extend(rng.bytes(n));
                    d
                }
                2 => {
                    let mut d = Vec::new();
                    for _ in 0..1 + rng.below(3) {
                        encode_request(&random_request(&mut rng), &mut d).unwrap();
                    }
                    d
                }
                _ => {
                    let mut d = Vec::new();
                    for _ in 0..1 + rng.below(3) {
                        random_response(&mut rng, &mut d);
                    }
                    d
                }
            };
            let mut data = data;
            for _ in 0..rng.below(4) {
                if !data.is_empty() {
                    let i = rng.below_usize(data.len());
                    data[i] ^= 1 << rng.below(8);
                }
            }
            if rng.below(4) == 0 {
                let keep = rng.below_usize(data.len() + 1);
                data.truncate(keep);
            }
            fuzz_frame_decode(&data);
        }
        crate::testing::replay_regressions("tcp_frame", fuzz_frame_decode);
    }
}
