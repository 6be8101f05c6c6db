//! The Mooncake FAST'25 request trace: parsing, the infinite-cache oracle,
//! expansion of 512-token trace blocks into engine blocks, deterministic KV
//! bytes and the model presets that size them.
//!
//! The trace (`conversation_trace.jsonl`, one JSON request per line) names
//! every 512-token prompt block by a prefix-chained id: equal ids mean the
//! same reusable prefix. A replay splits each trace block into
//! `512 / block_tokens` engine blocks whose 32-byte [`BlockHash`] is a pure
//! function of `(trace_id, sub)`, and fills their KV segments with bytes that
//! are a pure function of `(namespace, hash, layer, segment, position)`, so any
//! reader can verify what it fetched without keeping a copy.

use std::collections::HashSet;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::types::BlockHash;

/// Tokens per trace block (`hash_ids` entry) in the Mooncake trace.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// Longest accepted trace line (bytes, without its newline). Real lines are
/// at most a few KiB (247 ids); 16 MiB bounds the memory a corrupt file with
/// no newlines can make the parser take.
pub const TRACE_LINE_BYTES_MAX: usize = 16 << 20;

/// The bundled Mooncake conversation trace (Apache-2.0, see `data/NOTICE`),
/// as an absolute path inside the source tree this binary was built from.
pub const DEFAULT_TRACE_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/conversation_trace.jsonl");

/// The bundled trace relative to a repository root.
pub const RELATIVE_TRACE_PATH: &str = "data/conversation_trace.jsonl";

/// The trace `kvferry pd` replays when none is named:
/// [`RELATIVE_TRACE_PATH`] under the working directory when it exists (a
/// binary carried to another machine and run from a checkout there), else
/// [`DEFAULT_TRACE_PATH`] (the source tree the binary was built from).
pub fn default_trace_path() -> std::path::PathBuf {
    let relative = Path::new(RELATIVE_TRACE_PATH);
    if relative.is_file() { relative.to_path_buf() } else { std::path::PathBuf::from(DEFAULT_TRACE_PATH) }
}

/// Length of the engine block hashes built by [`engine_block_hash`] (bytes).
pub const ENGINE_BLOCK_HASH_BYTES: usize = 32;

/// A trace that cannot be loaded, or a replay parameter that does not fit it.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be opened or read.
    #[error("trace {path}: {source}", path = path.display())]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Reading from the trace reader failed (no file path known).
    #[error("trace line {line}: read error: {source}")]
    Read {
        /// 1-based line being read when the error happened.
        line: usize,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is not a valid request object.
    #[error("trace line {line}: malformed request: {source}")]
    Json {
        /// 1-based line number.
        line: usize,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// A request with no `hash_ids`.
    #[error("trace line {line}: empty hash_ids")]
    EmptyHashIds {
        /// 1-based line number.
        line: usize,
    },
    /// `input_length` does not match its `hash_ids` (one per started
    /// 512-token block: more tokens than they cover, or so few that the
    /// last id covers none), or exceeds [`crate::limits::TRACE_INPUT_TOKENS_MAX`].
    #[error("trace line {line}: input_length {input_length} does not fit {blocks} hash_ids of 512 tokens (one per started block, at most {max} tokens)", max = crate::limits::TRACE_INPUT_TOKENS_MAX)]
    InputLength {
        /// 1-based line number.
        line: usize,
        /// The claimed prompt length.
        input_length: u64,
        /// Number of `hash_ids`.
        blocks: usize,
    },
    /// A line longer than [`TRACE_LINE_BYTES_MAX`].
    #[error("trace line {line}: longer than {max} bytes", max = TRACE_LINE_BYTES_MAX)]
    LineTooLong {
        /// 1-based line number.
        line: usize,
    },
    /// The trace holds no requests at all.
    #[error("trace holds no requests")]
    Empty,
    /// An engine block size that is 0 or does not divide [`TRACE_BLOCK_TOKENS`].
    #[error("block_tokens {0} must be >= 1 and divide {TRACE_BLOCK_TOKENS}")]
    BlockTokens(u64),
    /// A model preset name that is not in [`PRESETS`].
    #[error("unknown model preset {0:?} (known: qwen3-8b, llama3-8b, tiny)")]
    UnknownModel(String),
}

impl TraceError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            TraceError::Io { .. } => "trace_io",
            TraceError::Read { .. } => "trace_read",
            TraceError::Json { .. } => "trace_json",
            TraceError::EmptyHashIds { .. } => "trace_empty_hash_ids",
            TraceError::InputLength { .. } => "trace_input_length",
            TraceError::LineTooLong { .. } => "trace_line_too_long",
            TraceError::Empty => "trace_empty",
            TraceError::BlockTokens(_) => "trace_block_tokens",
            TraceError::UnknownModel(_) => "trace_unknown_model",
        }
    }
}

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time, ms from the trace start (JSON `timestamp`).
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Prefix-chained ids of the prompt's 512-token blocks (the last one is
    /// usually partial).
    pub hash_ids: Vec<u64>,
}

/// Parses a JSON-lines trace. Blank (whitespace-only) lines are skipped;
/// unknown fields are ignored.
///
/// # Errors
/// [`TraceError::Read`] when the reader fails, [`TraceError::LineTooLong`],
/// [`TraceError::Json`], [`TraceError::EmptyHashIds`] (1-based line numbers,
/// blank lines counted) and [`TraceError::Empty`] when no request was found.
pub fn parse_trace(reader: impl BufRead) -> Result<Vec<TraceRequest>, TraceError> {
    parse_trace_capped(reader, TRACE_LINE_BYTES_MAX)
}

/// [`parse_trace`] with an explicit line-length cap (the tests use a small one).
fn parse_trace_capped(mut reader: impl BufRead, max_line: usize) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0usize;
    loop {
        line += 1;
        buf.clear();
        // Read at most one byte past the cap so a newline-free file cannot
        // make the buffer grow without bound.
        let limit = u64::try_from(max_line).unwrap_or(u64::MAX).saturating_add(1);
        let n = (&mut reader)
            .take(limit)
            .read_until(b'\n', &mut buf)
            .map_err(|source| TraceError::Read { line, source })?;
        if n == 0 {
            break;
        }
        let content = match buf.strip_suffix(b"\n") {
            Some(c) => c,
            None if buf.len() > max_line => return Err(TraceError::LineTooLong { line }),
            None => &buf[..],
        };
        if content.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let req: TraceRequest = serde_json::from_slice(content).map_err(|source| TraceError::Json { line, source })?;
        if req.hash_ids.is_empty() {
            return Err(TraceError::EmptyHashIds { line });
        }
        let covered = (req.hash_ids.len() as u64).saturating_mul(TRACE_BLOCK_TOKENS);
        let fits = req.input_length <= covered && req.input_length > covered - TRACE_BLOCK_TOKENS;
        if !fits || req.input_length > crate::limits::TRACE_INPUT_TOKENS_MAX {
            return Err(TraceError::InputLength { line, input_length: req.input_length, blocks: req.hash_ids.len() });
        }
        out.push(req);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// Loads and parses a trace file (see [`parse_trace`]).
///
/// # Errors
/// [`TraceError::Io`] (with the path) when the file cannot be opened or read,
/// otherwise as [`parse_trace`].
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let io = |source| TraceError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    parse_trace(std::io::BufReader::with_capacity(1 << 16, file)).map_err(|e| match e {
        TraceError::Read { source, .. } => io(source),
        other => other,
    })
}

/// Leading-prefix hit counts of an infinite cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OracleStats {
    /// Block references that were leading-prefix hits.
    pub hits: u64,
    /// All block references.
    pub total: u64,
}

impl OracleStats {
    /// `hits / total`, or 0 when there were no references.
    pub fn hit_rate(&self) -> f64 {
        if self.total == 0 { 0.0 } else { self.hits as f64 / self.total as f64 }
    }
}

/// Leading-prefix oracle over a sequence of per-request key lists: a key is a
/// hit iff it and every key before it in its request appeared in an earlier
/// request.
fn prefix_oracle<K, I, R>(requests: R) -> OracleStats
where
    K: Eq + std::hash::Hash,
    I: IntoIterator<Item = K>,
    R: IntoIterator<Item = I>,
{
    let mut seen: HashSet<K> = HashSet::new();
    let mut stats = OracleStats::default();
    let mut fresh = Vec::new();
    for keys in requests {
        let mut prefix = true;
        for k in keys {
            stats.total += 1;
            if prefix && seen.contains(&k) {
                stats.hits += 1;
            } else {
                prefix = false;
                fresh.push(k);
            }
        }
        // Only this request's new keys are added, after it is scored, so a
        // key repeated inside one request is never its own hit.
        seen.extend(fresh.drain(..));
    }
    stats
}

/// The infinite-cache oracle at trace-block granularity: a `hash_ids` entry
/// is a hit iff it and every entry before it in its request occurred in some
/// earlier request.
pub fn oracle(requests: &[TraceRequest]) -> OracleStats {
    prefix_oracle(requests.iter().map(|r| r.hash_ids.iter().copied()))
}

/// Checks an engine block size: `1 <= block_tokens` and it divides
/// [`TRACE_BLOCK_TOKENS`]. Returns the number of engine blocks per trace block.
///
/// # Errors
/// [`TraceError::BlockTokens`].
pub fn check_block_tokens(block_tokens: u64) -> Result<u32, TraceError> {
    if block_tokens == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(block_tokens) {
        return Err(TraceError::BlockTokens(block_tokens));
    }
    // At most 512, so the conversion cannot fail.
    u32::try_from(TRACE_BLOCK_TOKENS / block_tokens).map_err(|_| TraceError::BlockTokens(block_tokens))
}

/// The full engine blocks of one request as `(trace_id, sub)` keys, in prompt
/// order. `per` must come from [`check_block_tokens`].
fn engine_keys(req: &TraceRequest, block_tokens: u64, per: u32) -> impl Iterator<Item = (u64, u32)> + '_ {
    req.hash_ids.iter().enumerate().flat_map(move |(i, &id)| {
        let start = (i as u64).saturating_mul(TRACE_BLOCK_TOKENS);
        let room = req.input_length.saturating_sub(start);
        let full = (room / block_tokens).min(u64::from(per));
        // `full <= per <= 512`, so it fits a u32.
        (0..full as u32).map(move |j| (id, j))
    })
}

/// One engine block: sub-block `sub` of trace block `trace_id`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EngineBlock {
    /// The trace block (`hash_ids` entry) it belongs to.
    pub trace_id: u64,
    /// Index inside the trace block, `0..512 / block_tokens`.
    pub sub: u32,
    /// Its hash, see [`engine_block_hash`].
    pub hash: BlockHash,
}

/// The 32-byte hash of engine block `(trace_id, sub)`: `trace_id` (u64 LE),
/// `sub` (u32 LE), then 20 pseudo-random bytes derived from both. A pure
/// function; distinct inputs give distinct hashes (the first 12 bytes already
/// differ). Because trace ids are prefix-chained, the pair names the whole
/// prefix.
pub fn engine_block_hash(trace_id: u64, sub: u32) -> BlockHash {
    let mut b = [0u8; ENGINE_BLOCK_HASH_BYTES];
    b[..8].copy_from_slice(&trace_id.to_le_bytes());
    b[8..12].copy_from_slice(&sub.to_le_bytes());
    let seed = mix64(trace_id ^ mix64(u64::from(sub) ^ ENGINE_HASH_DOMAIN));
    let words = [
        mix64(seed.wrapping_add(GAMMA)),
        mix64(seed.wrapping_add(GAMMA.wrapping_mul(2))),
        mix64(seed.wrapping_add(GAMMA.wrapping_mul(3))),
    ];
    b[12..20].copy_from_slice(&words[0].to_le_bytes());
    b[20..28].copy_from_slice(&words[1].to_le_bytes());
    b[28..32].copy_from_slice(&words[2].to_le_bytes()[..4]);
    BlockHash::new(bytes::Bytes::copy_from_slice(&b))
}

/// Expands a request into its FULL engine blocks of `block_tokens` tokens:
/// trace block `i` yields sub-blocks `j` in `0..512 / block_tokens` for which
/// `i * 512 + (j + 1) * block_tokens <= input_length`.
///
/// # Errors
/// [`TraceError::BlockTokens`] when `block_tokens` is 0 or does not divide 512.
pub fn engine_blocks(req: &TraceRequest, block_tokens: u64) -> Result<Vec<EngineBlock>, TraceError> {
    let per = check_block_tokens(block_tokens)?;
    Ok(engine_keys(req, block_tokens, per)
        .map(|(trace_id, sub)| EngineBlock { trace_id, sub, hash: engine_block_hash(trace_id, sub) })
        .collect())
}

/// The infinite-cache leading-prefix oracle over engine blocks (see
/// [`engine_blocks`]): the hit rate a replay with `block_tokens`-token blocks
/// and an unbounded cache would measure.
///
/// # Panics
/// When `block_tokens` is invalid; validate it first with
/// [`check_block_tokens`] (or [`engine_blocks`]).
pub fn oracle_engine_blocks(requests: &[TraceRequest], block_tokens: u64) -> OracleStats {
    let per = match check_block_tokens(block_tokens) {
        Ok(p) => p,
        Err(e) => panic!("oracle_engine_blocks: {e}"),
    };
    prefix_oracle(requests.iter().map(|r| engine_keys(r, block_tokens, per)))
}

/// Weyl increment of splitmix64 (2^64 / golden ratio).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
/// Domain separator for engine block hashes.
const ENGINE_HASH_DOMAIN: u64 = 0x6B76_6665_7272_7931; // "kvferry1"
/// Domain separator for KV byte seeds.
const KV_DOMAIN: u64 = 0x6B76_6279_7465_7331; // "kvbytes1"
/// Words compared per chunk by [`verify_kv`] (4 KiB).
const VERIFY_CHUNK_WORDS: usize = 512;

/// The splitmix64 finaliser: a bijection on u64 with good avalanche.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Folds a byte string into a running 64-bit state (length-terminated, so
/// different strings of zero padding do not collide).
fn absorb(mut h: u64, bytes: &[u8]) -> u64 {
    for c in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h = mix64(h.wrapping_add(GAMMA) ^ u64::from_le_bytes(w));
    }
    mix64(h.wrapping_add(GAMMA) ^ bytes.len() as u64)
}

/// The 64-bit seed of one KV segment.
fn kv_seed(namespace: &str, hash: &BlockHash, layer: u32, segment: u32) -> u64 {
    let h = absorb(KV_DOMAIN, namespace.as_bytes());
    let h = absorb(h, hash.as_bytes());
    mix64(h.wrapping_add(GAMMA) ^ (u64::from(layer) << 32 | u64::from(segment)))
}

/// Fills `out` with deterministic pseudo-random KV bytes: byte `p` is a pure
/// function of `(namespace, hash, layer, segment, p)`, so a buffer of length
/// `n` is a prefix of one of length `m > n`. Counter based (splitmix64 of the
/// word index), several GB/s on one core.
pub fn fill_kv(namespace: &str, hash: &BlockHash, layer: u32, segment: u32, out: &mut [u8]) {
    // Word i is mix64(seed + i * GAMMA); the counter advances by addition so
    // the hot loop has no multiply-by-index and no overflow check.
    let mut z = kv_seed(namespace, hash, layer, segment);
    let mut words = out.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&mix64(z).to_le_bytes());
        z = z.wrapping_add(GAMMA);
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        tail.copy_from_slice(&mix64(z).to_le_bytes()[..tail.len()]);
    }
}

/// Whether `data` equals what [`fill_kv`] writes for these inputs (and this
/// length). Compares in 4 KiB chunks without allocating; any changed byte is
/// detected.
pub fn verify_kv(namespace: &str, hash: &BlockHash, layer: u32, segment: u32, data: &[u8]) -> bool {
    let mut z = kv_seed(namespace, hash, layer, segment);
    let mut chunks = data.chunks_exact(8 * VERIFY_CHUNK_WORDS);
    for chunk in &mut chunks {
        if !verify_words(&mut z, chunk) {
            return false;
        }
    }
    let rest = chunks.remainder();
    let whole = rest.len() - rest.len() % 8;
    if !verify_words(&mut z, &rest[..whole]) {
        return false;
    }
    let tail = &rest[whole..];
    tail.is_empty() || tail == &mix64(z).to_le_bytes()[..tail.len()]
}

/// Compares whole 8-byte words against the stream at counter `z` (advanced
/// past them).
#[inline(always)]
fn verify_words(z: &mut u64, data: &[u8]) -> bool {
    let mut diff = 0u64;
    let mut c = *z;
    for w in data.chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        diff |= u64::from_le_bytes(b) ^ mix64(c);
        c = c.wrapping_add(GAMMA);
    }
    *z = c;
    diff == 0
}

/// The KV geometry of a model: sizes one engine block's segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPreset {
    /// Preset name (`--model`).
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads (after GQA).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element (bf16 = 2).
    pub dtype_bytes: u32,
}

impl ModelPreset {
    /// Bytes of one segment: the K (or V) cache of one layer of one block,
    /// `block_tokens * kv_heads * head_dim * dtype_bytes`.
    pub fn segment_bytes(&self, block_tokens: u64) -> u64 {
        block_tokens
            .saturating_mul(u64::from(self.kv_heads))
            .saturating_mul(u64::from(self.head_dim))
            .saturating_mul(u64::from(self.dtype_bytes))
    }

    /// Bytes of one whole block: `layers * 2 * segment_bytes` (K and V).
    pub fn block_bytes(&self, block_tokens: u64) -> u64 {
        u64::from(self.layers).saturating_mul(2).saturating_mul(self.segment_bytes(block_tokens))
    }
}

/// The known model presets.
pub const PRESETS: &[ModelPreset] = &[
    ModelPreset { name: "qwen3-8b", layers: 36, kv_heads: 8, head_dim: 128, dtype_bytes: 2 },
    ModelPreset { name: "llama3-8b", layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 },
    ModelPreset { name: "tiny", layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2 },
];

/// Looks a preset up by name.
///
/// # Errors
/// [`TraceError::UnknownModel`].
pub fn preset(name: &str) -> Result<&'static ModelPreset, TraceError> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| TraceError::UnknownModel(name.to_string()))
}

/// `count` requests starting at index `first` (all the rest when `None`),
/// clamped to the trace.
pub fn window(requests: &[TraceRequest], first: usize, count: Option<usize>) -> &[TraceRequest] {
    let start = first.min(requests.len());
    let end = match count {
        Some(c) => start.saturating_add(c).min(requests.len()),
        None => requests.len(),
    };
    &requests[start..end]
}

/// The requests with `start_ms <= timestamp_ms < start_ms + duration_ms`.
/// `requests` must be sorted by time (the trace is).
pub fn window_by_time(requests: &[TraceRequest], start_ms: u64, duration_ms: u64) -> &[TraceRequest] {
    let end_ms = start_ms.saturating_add(duration_ms);
    let lo = requests.partition_point(|r| r.timestamp_ms < start_ms);
    let hi = requests.partition_point(|r| r.timestamp_ms < end_ms).max(lo);
    &requests[lo..hi]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Cursor;

    fn req(ts: u64, input: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest { timestamp_ms: ts, input_length: input, output_length: 1, hash_ids: ids.to_vec() }
    }

    /// Tests run from the crate root, where the bundled trace lies at its
    /// relative path: that one is chosen (not the build-time absolute one).
    #[test]
    fn default_trace_prefers_the_working_directory() {
        assert!(Path::new(RELATIVE_TRACE_PATH).is_file(), "tests run from the crate root");
        assert_eq!(default_trace_path(), Path::new(RELATIVE_TRACE_PATH));
    }

    fn real_trace() -> Option<Vec<TraceRequest>> {
        let p = Path::new(DEFAULT_TRACE_PATH);
        if !p.exists() {
            println!("skipping: {DEFAULT_TRACE_PATH} absent");
            return None;
        }
        Some(load_trace(p).expect("real trace parses"))
    }

    #[test]
    fn parses_lines_and_skips_blanks() {
        let text = "\n{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 7, \"hash_ids\": [0, 1]}\r\n  \n{\"timestamp\":9,\"input_length\":10,\"output_length\":0,\"hash_ids\":[0],\"extra\":1}";
        let got = parse_trace(Cursor::new(text)).unwrap();
        let want = vec![
            TraceRequest { timestamp_ms: 5, input_length: 600, output_length: 7, hash_ids: vec![0, 1] },
            TraceRequest { timestamp_ms: 9, input_length: 10, output_length: 0, hash_ids: vec![0] },
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn malformed_line_reports_its_number() {
        let text = "{\"timestamp\":1,\"input_length\":1,\"output_length\":1,\"hash_ids\":[0]}\n\n{\"timestamp\":1,\n";
        match parse_trace(Cursor::new(text)) {
            Err(TraceError::Json { line, .. }) => assert_eq!(line, 3),
            other => panic!("{other:?}"),
        }
        // A missing field is malformed too.
        let text = "{\"timestamp\":1,\"input_length\":1,\"hash_ids\":[0]}\n";
        assert!(matches!(parse_trace(Cursor::new(text)), Err(TraceError::Json { line: 1, .. })));
        // Negative numbers do not fit u64.
        let text = "{\"timestamp\":-1,\"input_length\":1,\"output_length\":1,\"hash_ids\":[0]}\n";
        assert!(matches!(parse_trace(Cursor::new(text)), Err(TraceError::Json { line: 1, .. })));
    }

    #[test]
    fn empty_hash_ids_rejected() {
        let text = "{\"timestamp\":1,\"input_length\":1,\"output_length\":1,\"hash_ids\":[0]}\n{\"timestamp\":2,\"input_length\":0,\"output_length\":1,\"hash_ids\":[]}\n";
        assert!(matches!(parse_trace(Cursor::new(text)), Err(TraceError::EmptyHashIds { line: 2 })));
    }

    #[test]
    fn empty_trace_rejected() {
        assert!(matches!(parse_trace(Cursor::new("")), Err(TraceError::Empty)));
        assert!(matches!(parse_trace(Cursor::new("\n  \n\r\n")), Err(TraceError::Empty)));
    }

    #[test]
    fn line_too_long_rejected() {
        let ok = "{\"timestamp\":1,\"input_length\":1,\"output_length\":1,\"hash_ids\":[0]}";
        let cap = ok.len();
        // Exactly at the cap (with or without newline) is fine.
        assert_eq!(parse_trace_capped(Cursor::new(format!("{ok}\n")), cap).unwrap().len(), 1);
        assert_eq!(parse_trace_capped(Cursor::new(ok), cap).unwrap().len(), 1);
        let long = format!("{ok}\n{ok}      \n");
        assert!(matches!(parse_trace_capped(Cursor::new(long), cap), Err(TraceError::LineTooLong { line: 2 })));
        // The real cap: a 16 MiB + 1 line without newline.
        let mut big = vec![b' '; TRACE_LINE_BYTES_MAX + 1];
        big.extend_from_slice(b"\n");
        assert!(matches!(parse_trace(Cursor::new(big)), Err(TraceError::LineTooLong { line: 1 })));
    }

    #[test]
    fn input_length_beyond_its_blocks_is_rejected() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 1, \"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [0, 1]}\n";
        assert!(matches!(
            parse_trace(Cursor::new(text)),
            Err(TraceError::InputLength { line: 2, input_length: 1025, blocks: 2 })
        ));
    }

    #[test]
    fn hash_ids_beyond_the_input_are_rejected() {
        // 512 tokens start one block: a second id covers nothing.
        let text = "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 1, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0, 1]}\n";
        assert!(matches!(
            parse_trace(Cursor::new(text)),
            Err(TraceError::InputLength { line: 2, input_length: 512, blocks: 2 })
        ));
        let zero = "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": [0]}\n";
        assert!(matches!(parse_trace(Cursor::new(zero)), Err(TraceError::InputLength { line: 1, .. })));
    }

    #[test]
    fn read_and_open_errors() {
        struct Failing;
        impl Read for Failing {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("boom"))
            }
        }
        assert!(matches!(parse_trace(std::io::BufReader::new(Failing)), Err(TraceError::Read { line: 1, .. })));
        let missing = Path::new("/nonexistent/dir/trace.jsonl");
        match load_trace(missing) {
            Err(TraceError::Io { path, .. }) => assert_eq!(path, missing),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn load_trace_reads_a_file() {
        let dir = std::env::temp_dir().join(format!("kvferry-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(&p, "{\"timestamp\":3,\"input_length\":1024,\"output_length\":2,\"hash_ids\":[0,1]}\n").unwrap();
        let got = load_trace(&p).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got,
            vec![{
                let mut r = req(3, 1024, &[0, 1]);
                r.output_length = 2;
                r
            }]
        );
    }

    #[test]
    fn oracle_counts_leading_prefix_hits() {
        let reqs = [
            req(0, 2048, &[0, 1, 2, 3]),
            req(1, 2048, &[0, 1, 4, 5]), // 0, 1 hit
            req(2, 2048, &[0, 6, 2, 3]), // 0 hit; 2, 3 seen but not leading
            req(3, 1536, &[0, 6, 7]),    // 0, 6 hit
            req(4, 512, &[9]),           // miss
        ];
        let s = oracle(&reqs);
        assert_eq!(s, OracleStats { hits: 5, total: 16 });
        assert!((s.hit_rate() - 5.0 / 16.0).abs() < 1e-12);
        assert_eq!(OracleStats::default().hit_rate(), 0.0);
        // A repeated id inside one request is not its own hit.
        assert_eq!(oracle(&[req(0, 1024, &[5, 5])]).hits, 0);
    }

    /// Brute-force restatement of the oracle definition.
    fn naive_oracle(keys: &[Vec<u64>]) -> OracleStats {
        let mut s = OracleStats::default();
        for (r, ks) in keys.iter().enumerate() {
            let earlier: HashSet<u64> = keys[..r].iter().flatten().copied().collect();
            for i in 0..ks.len() {
                s.total += 1;
                let hit = ks[..=i].iter().all(|k| earlier.contains(k));
                s.hits += u64::from(hit);
            }
        }
        s
    }

    proptest! {
        #[test]
        fn oracle_matches_definition(keys in prop::collection::vec(
            prop::collection::vec(0u64..12, 1..8), 0..12)) {
            let reqs: Vec<_> = keys.iter().map(|k| req(0, 512 * k.len() as u64, k)).collect();
            prop_assert_eq!(oracle(&reqs), naive_oracle(&keys));
            // With whole 512-token blocks each trace-level hit is
            // 512 / block_tokens engine-level hits.
            let base = oracle(&reqs);
            for bt in [16u64, 128, 512] {
                let per = 512 / bt;
                prop_assert_eq!(oracle_engine_blocks(&reqs, bt),
                    OracleStats { hits: base.hits * per, total: base.total * per });
            }
        }

        #[test]
        fn engine_oracle_matches_definition(
            reqs in prop::collection::vec(
                (prop::collection::vec(0u64..6, 1..5), 0u64..2600), 0..10),
            bt_pow in 2u32..10,
        ) {
            let bt = 1u64 << bt_pow;
            let reqs: Vec<_> = reqs.iter().map(|(ids, len)| req(0, *len, ids)).collect();
            let keys: Vec<Vec<u64>> = reqs
                .iter()
                .map(|r| engine_blocks(r, bt).unwrap().iter()
                    .map(|b| b.trace_id * 1024 + u64::from(b.sub)).collect())
                .collect();
            prop_assert_eq!(oracle_engine_blocks(&reqs, bt), naive_oracle(&keys));
        }
    }

    #[test]
    fn real_trace_oracle() {
        let Some(reqs) = real_trace() else { return };
        assert_eq!(reqs.len(), 12_031);
        assert!(reqs.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
        for r in &reqs {
            assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(TRACE_BLOCK_TOKENS));
            assert_eq!(r.hash_ids[0], 0);
        }
        let s = oracle(&reqs);
        assert_eq!(s.total, 288_500);
        assert_eq!(format!("{:.1}", s.hit_rate() * 100.0), "36.6");
        println!("trace blocks, whole trace: {s:?} = {:.3} %", s.hit_rate() * 100.0);
        let head = window(&reqs, 0, Some(2000));
        let h = oracle(head);
        println!("trace blocks, first 2000: {h:?} = {:.3} %", h.hit_rate() * 100.0);
        for bt in [16u64, 128] {
            let e = oracle_engine_blocks(&reqs, bt);
            let eh = oracle_engine_blocks(head, bt);
            println!("engine blocks {bt}, whole trace: {e:?} = {:.3} %", e.hit_rate() * 100.0);
            println!("engine blocks {bt}, first 2000: {eh:?} = {:.3} %", eh.hit_rate() * 100.0);
            // Full engine blocks only: never more than 512/bt per trace block.
            assert!(e.total <= s.total * (512 / bt));
            let expect: u64 = reqs.iter().map(|r| r.input_length / bt).sum();
            assert_eq!(e.total, expect);
            // Finer blocks can only reuse more of the partial tails.
            assert!(e.hit_rate() > 0.3 && e.hit_rate() < 0.45);
        }
    }

    #[test]
    fn engine_blocks_expand_full_blocks_only() {
        let r = req(0, 512 + 100, &[7, 8]);
        let b = engine_blocks(&r, 16).unwrap();
        // 32 full from block 7, then floor(100 / 16) = 6 from block 8.
        assert_eq!(b.len(), 32 + 6);
        assert!(b[..32].iter().enumerate().all(|(j, e)| e.trace_id == 7 && e.sub == j as u32));
        assert!(b[32..].iter().enumerate().all(|(j, e)| e.trace_id == 8 && e.sub == j as u32));
        // Rule: (i*512 + (j+1)*bt) <= input_length, checked exhaustively.
        for input in [0u64, 1, 15, 16, 511, 512, 513, 1023, 1024, 2000] {
            let r = req(0, input, &[1, 2, 3]);
            for bt in [1u64, 2, 16, 64, 128, 256, 512] {
                let got: Vec<(u64, u32)> = engine_blocks(&r, bt).unwrap().iter().map(|e| (e.trace_id, e.sub)).collect();
                let mut want = Vec::new();
                for (i, &id) in r.hash_ids.iter().enumerate() {
                    for j in 0..(512 / bt) {
                        if i as u64 * 512 + (j + 1) * bt <= input {
                            want.push((id, j as u32));
                        }
                    }
                }
                assert_eq!(got, want, "input {input} bt {bt}");
            }
        }
        // input_length past the listed ids emits nothing extra.
        assert_eq!(engine_blocks(&req(0, 1 << 40, &[1]), 128).unwrap().len(), 4);
    }

    #[test]
    fn engine_block_tokens_validated() {
        let r = req(0, 1024, &[1, 2]);
        for bad in [0u64, 3, 100, 513, 1024] {
            assert!(matches!(engine_blocks(&r, bad), Err(TraceError::BlockTokens(n)) if n == bad));
        }
        assert_eq!(check_block_tokens(16).unwrap(), 32);
        assert_eq!(check_block_tokens(512).unwrap(), 1);
        assert!(std::panic::catch_unwind(|| oracle_engine_blocks(std::slice::from_ref(&r), 0)).is_err());
    }

    #[test]
    fn engine_block_hash_layout() {
        let h = engine_block_hash(0x0102_0304_0506_0708, 0x0a0b_0c0d);
        let b = h.as_bytes();
        assert_eq!(b.len(), 32);
        assert_eq!(&b[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&b[8..12], &0x0a0b_0c0du32.to_le_bytes());
        assert!(h.validate().is_ok());
        // Pure function, and what engine_blocks emits.
        assert_eq!(engine_block_hash(5, 3), engine_block_hash(5, 3));
        let e = engine_blocks(&req(0, 512, &[5]), 128).unwrap();
        assert_eq!(e[3].hash, engine_block_hash(5, 3));
        // Distinct and random-looking tails.
        let mut seen = HashSet::new();
        for id in 0..200u64 {
            for sub in 0..32u32 {
                let h = engine_block_hash(id, sub);
                assert!(seen.insert(h.as_bytes()[12..].to_vec()));
            }
        }
        let t = engine_block_hash(0, 0);
        assert!(t.as_bytes()[12..].iter().filter(|&&x| x == 0).count() < 5);
        assert_ne!(t, BlockHash::from_u64(0));
    }

    #[test]
    fn kv_bytes_are_deterministic() {
        let h = engine_block_hash(42, 1);
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 4095, 4096, 4097, 70_001] {
            let mut a = vec![0u8; len];
            let mut b = vec![0xffu8; len];
            fill_kv("ns", &h, 3, 1, &mut a);
            fill_kv("ns", &h, 3, 1, &mut b);
            assert_eq!(a, b);
            assert!(verify_kv("ns", &h, 3, 1, &a));
            // Pure function of position: shorter buffers are prefixes.
            let mut long = vec![0u8; len + 13];
            fill_kv("ns", &h, 3, 1, &mut long);
            assert_eq!(&long[..len], &a[..]);
        }
    }

    #[test]
    fn kv_bytes_differ_by_input() {
        let h = engine_block_hash(42, 1);
        let gen_kv = |ns: &str, h: &BlockHash, l: u32, s: u32| {
            let mut v = vec![0u8; 64];
            fill_kv(ns, h, l, s, &mut v);
            v
        };
        let variants = [
            gen_kv("ns", &h, 3, 1),
            gen_kv("ns2", &h, 3, 1),
            gen_kv("n", &h, 3, 1),
            gen_kv("ns", &engine_block_hash(42, 2), 3, 1),
            gen_kv("ns", &engine_block_hash(43, 1), 3, 1),
            gen_kv("ns", &h, 4, 1),
            gen_kv("ns", &h, 3, 0),
            gen_kv("ns", &h, 1, 3),
            gen_kv("ns\0", &h, 3, 1),
            gen_kv("ns", &BlockHash::new(vec![0u8; 31]), 3, 1),
            gen_kv("ns", &BlockHash::new(vec![0u8; 32]), 3, 1),
        ];
        for (i, a) in variants.iter().enumerate() {
            for b in &variants[i + 1..] {
                assert_ne!(a, b);
            }
            // Every 8-byte word differs from its neighbours (not constant).
            assert_ne!(a[..8], a[8..16]);
        }
        assert!(!verify_kv("ns2", &h, 3, 1, &variants[0]));
        assert!(!verify_kv("ns", &h, 3, 2, &variants[0]));
    }

    #[test]
    fn kv_any_flipped_byte_detected() {
        let h = engine_block_hash(7, 0);
        for len in [1usize, 13, 4096 + 11, 3 * 4096] {
            let mut data = vec![0u8; len];
            fill_kv("m", &h, 0, 1, &mut data);
            for pos in 0..len {
                for flip in [0x01u8, 0x80] {
                    data[pos] ^= flip;
                    assert!(!verify_kv("m", &h, 0, 1, &data), "len {len} pos {pos}");
                    data[pos] ^= flip;
                }
            }
            assert!(verify_kv("m", &h, 0, 1, &data));
            // Truncation or extension does not verify either unless it is a
            // prefix (prefixes are valid by design).
            assert!(verify_kv("m", &h, 0, 1, &data[..len - 1]));
            let mut longer = data.clone();
            longer.push(0);
            let mut real = vec![0u8; len + 1];
            fill_kv("m", &h, 0, 1, &mut real);
            assert_eq!(verify_kv("m", &h, 0, 1, &longer), longer == real);
        }
    }

    proptest! {
        #[test]
        fn kv_flip_detected_prop(len in 1usize..10_000, pos_frac in 0.0f64..1.0, bit in 0u8..8,
                                  layer in 0u32..64, seg in 0u32..4, id in any::<u64>()) {
            let h = engine_block_hash(id, 0);
            let mut data = vec![0u8; len];
            fill_kv("p", &h, layer, seg, &mut data);
            prop_assert!(verify_kv("p", &h, layer, seg, &data));
            let pos = ((len as f64 * pos_frac) as usize).min(len - 1);
            data[pos] ^= 1 << bit;
            prop_assert!(!verify_kv("p", &h, layer, seg, &data));
        }
    }

    #[test]
    fn presets_size_blocks() {
        let q = preset("qwen3-8b").unwrap();
        assert_eq!((q.layers, q.kv_heads, q.head_dim, q.dtype_bytes), (36, 8, 128, 2));
        assert_eq!(q.segment_bytes(16), 32 << 10);
        assert_eq!(q.block_bytes(16), 36 * ((32 << 10) + (32 << 10)));
        assert_eq!(q.block_bytes(16), 2_359_296); // 2.25 MiB
        // One 512-token trace block is 72 MiB (README).
        assert_eq!(q.block_bytes(512), 72 << 20);
        let l = preset("llama3-8b").unwrap();
        assert_eq!((l.layers, l.kv_heads, l.head_dim, l.dtype_bytes), (32, 8, 128, 2));
        assert_eq!(l.block_bytes(16), 2 << 20);
        let t = preset("tiny").unwrap();
        assert_eq!(t.segment_bytes(16), 16 * 2 * 64 * 2);
        assert_eq!(t.block_bytes(16), 2 * 2 * 4096);
        assert_eq!(PRESETS.len(), 3);
        assert!(matches!(preset("gpt-5"), Err(TraceError::UnknownModel(n)) if n == "gpt-5"));
    }

    #[test]
    fn windows_clamp() {
        let reqs: Vec<_> = (0..10u64).map(|i| req(i * 100, 512, &[i])).collect();
        assert_eq!(window(&reqs, 0, None).len(), 10);
        assert_eq!(window(&reqs, 3, Some(4)), &reqs[3..7]);
        assert_eq!(window(&reqs, 8, Some(5)), &reqs[8..]);
        assert!(window(&reqs, 20, Some(5)).is_empty());
        assert!(window(&reqs, 2, Some(0)).is_empty());
        assert_eq!(window(&reqs, 2, Some(usize::MAX)), &reqs[2..]);

        assert_eq!(window_by_time(&reqs, 0, 300), &reqs[0..3]);
        assert_eq!(window_by_time(&reqs, 150, 200), &reqs[2..4]);
        assert_eq!(window_by_time(&reqs, 200, 1), &reqs[2..3]);
        assert!(window_by_time(&reqs, 200, 0).is_empty());
        assert!(window_by_time(&reqs, 5000, 10).is_empty());
        assert_eq!(window_by_time(&reqs, 0, u64::MAX), &reqs[..]);
        assert_eq!(window_by_time(&reqs, u64::MAX, u64::MAX).len(), 0);
        // Equal timestamps are kept together.
        let dup = [req(5, 1, &[0]), req(5, 1, &[1]), req(6, 1, &[2])];
        assert_eq!(window_by_time(&dup, 5, 1).len(), 2);
    }

    #[test]
    fn real_trace_time_window() {
        let Some(reqs) = real_trace() else { return };
        let all = window_by_time(&reqs, 0, u64::MAX);
        assert_eq!(all.len(), reqs.len());
        let minute = window_by_time(&reqs, 60_000, 60_000);
        assert!(!minute.is_empty());
        assert!(minute.iter().all(|r| (60_000..120_000).contains(&r.timestamp_ms)));
    }
}
