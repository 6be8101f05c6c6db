//! Device-direct copies between two engines on one host (issue 28 item 2,
//! contract C19): a decode engine copies KV blocks straight out of the
//! owner engine's device buffers into its own, with no host staging and no
//! socket.
//!
//! The owner *exports* a registered buffer ([`Gpu::export_buffer`]): a
//! [`BufferExport`] names what to map and where the buffer sits in it. The
//! reader *opens* it ([`Gpu::open_peer_buffer`]), which succeeds only where
//! the handle means something — the same host for CUDA IPC (the driver
//! refuses a handle from another machine), the same process for
//! [`PeerKind::Process`] — and gets a [`PeerBuffer`]. A [`PeerCopyBatch`]
//! then copies from opened peer buffers into this backend's registered
//! buffers and, in the same pass, answers the CRC-32C of chosen runs of
//! destination bytes (the slot checksums the owner advertised, C10), so a
//! block whose source changed under the copy is caught.
//!
//! Who may read is not decided here: the engine hands exports only to a
//! peer that asked for them under a transfer lock and holds a *device
//! lease* the owner's engine granted (the engine's `leases` module, a layer
//! above this one); this module only maps and copies.
//!
//! Backends:
//! - `cuda`: `cuIpcGetMemHandle` of the allocation that holds the buffer
//!   (the handle covers the whole `cudaMalloc` allocation, so `offset` is
//!   the buffer's start minus the allocation's) and `cuIpcOpenMemHandle` on
//!   the reader (one mapping per allocation, shared by every buffer in it).
//!   The idea of handing a peer process an IPC handle to the engine's KV
//!   comes from the CUDA IPC paths of Mooncake's transfer engine and NIXL
//!   (`../shared/docs/perf.md`).
//! - `host` (the embedded default and the simulator's GPU):
//!   [`PeerKind::Process`] — the "device" is this process's memory, so an
//!   export is a random 128-bit token in a process-wide registry and only an
//!   engine of the same process can open it (in-process clusters, tests,
//!   the simulator). Each copy pins the owner's buffer in the owner's own
//!   buffer table, so the owner cannot unregister (and free) it while the
//!   copy reads it (C15).

use std::collections::HashMap;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};

use super::GpuError;
use crate::memory::DeviceBufferId;
use crate::memory::buffers::WeakBufferTable;

/// Longest handle a [`BufferExport`] may carry (bytes): a CUDA IPC handle
/// is 64 bytes; anything longer from the network is refused.
pub const HANDLE_BYTES_MAX: usize = 64;

/// What kind of handle a [`BufferExport`] carries (wire values 1 and 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerKind {
    /// A CUDA IPC memory handle (`CUipcMemHandle`, 64 bytes) of the
    /// allocation holding the buffer: opens on the same host.
    CudaIpc,
    /// A token of this process's export registry (`host` backend): 4 bytes
    /// of process id (little-endian) then 16 random bytes; opens only in
    /// the same process.
    Process,
}

impl PeerKind {
    /// Wire value.
    pub fn to_u32(self) -> u32 {
        match self {
            PeerKind::CudaIpc => 1,
            PeerKind::Process => 2,
        }
    }

    /// From a wire value; `None` for an unknown one.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(PeerKind::CudaIpc),
            2 => Some(PeerKind::Process),
            _ => None,
        }
    }
}

/// A registered device buffer as the owner offers it to a same-host reader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferExport {
    /// Kind of `handle`.
    pub kind: PeerKind,
    /// The handle (at most [`HANDLE_BYTES_MAX`] bytes; layout per
    /// [`PeerKind`]).
    pub handle: Vec<u8>,
    /// Where the buffer starts inside what the handle maps (bytes).
    pub offset: u64,
    /// Length of the buffer (bytes): no read may pass `offset + len`.
    pub len: u64,
}

/// A peer's buffer opened by this backend. Dropping the last reference
/// unmaps it (CUDA: `cuIpcCloseMemHandle` once no buffer of that allocation
/// is open). Backend-specific; a backend accepts only its own kind in
/// [`PeerCopyBatch::sources`].
pub trait PeerBuffer: Send + Sync + 'static {
    /// Readable bytes (the export's `len`).
    fn len(&self) -> u64;
    /// True when zero-length.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// For the backend's downcast.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// One contiguous copy from an opened peer buffer into a local one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCopyOp {
    /// Index into [`PeerCopyBatch::sources`].
    pub src: usize,
    /// Byte offset in that peer buffer.
    pub src_offset: u64,
    /// Local destination buffer.
    pub dst: DeviceBufferId,
    /// Byte offset in it.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A batch of peer → local device copies.
pub struct PeerCopyBatch {
    /// Opened peer buffers the ops read from.
    pub sources: Vec<Arc<dyn PeerBuffer>>,
    /// The copies (any order; destinations must not overlap).
    pub ops: Vec<PeerCopyOp>,
    /// Runs of ops (index ranges into `ops`) whose *destination* bytes, in
    /// op order, the completion checksums (standard CRC-32C, as
    /// [`crc32c::crc32c`]): one slot per range when the engine asks for slot
    /// checksums.
    pub checksums: Vec<Range<usize>>,
}

/// A pending peer batch: the CRC-32C of each [`PeerCopyBatch::checksums`]
/// range, in order, once every copy landed; an error fails the whole batch
/// (treat every destination as garbage). Dropping it early never frees
/// memory a copy may still touch (C11): the backend keeps the sources and
/// its destination pins until the hardware is done.
pub type PeerCompletion = Pin<Box<dyn Future<Output = Result<Vec<u32>, GpuError>> + Send>>;

/// Checks a batch's shape before anything is copied: every op names a
/// source, stays inside it, and every checksum range lies inside `ops`.
/// Destinations are checked by the backend against its buffer table.
///
/// # Errors
/// [`GpuError::OutOfRange`] naming the first bad op or range.
pub fn validate_peer_batch(batch: &PeerCopyBatch) -> Result<(), GpuError> {
    // Each source's length once (a batch has few sources and many ops).
    let lens: Vec<u64> = batch.sources.iter().map(|s| s.len()).collect();
    for (i, op) in batch.ops.iter().enumerate() {
        let &len = lens.get(op.src).ok_or_else(|| {
            GpuError::OutOfRange(format!("peer op {i}: source {} of {}", op.src, batch.sources.len()))
        })?;
        if op.src_offset.checked_add(op.len).is_none_or(|e| e > len) {
            return Err(GpuError::OutOfRange(format!(
                "peer op {i}: [{}, +{}) beyond the peer buffer's {len} bytes",
                op.src_offset, op.len
            )));
        }
    }
    for r in &batch.checksums {
        if r.start > r.end || r.end > batch.ops.len() {
            return Err(GpuError::OutOfRange(format!("checksum range {r:?} of {} ops", batch.ops.len())));
        }
    }
    Ok(())
}

/// The `host` backend's export registry: token → the owner's buffer table
/// (weak: a dropped backend's exports open nothing) and buffer id. One per
/// process.
fn registry() -> &'static Mutex<HashMap<[u8; 16], (WeakBufferTable, DeviceBufferId)>> {
    static R: OnceLock<Mutex<HashMap<[u8; 16], (WeakBufferTable, DeviceBufferId)>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// Most exports the process registry holds (tokens of buffers that were
/// unregistered are dropped when their backend forgets them).
pub const PROCESS_EXPORTS_MAX: usize = 1 << 16;

/// Exports `id` of `table` as a [`PeerKind::Process`] handle with a fresh
/// unpredictable token (the `host` backend's [`Gpu::export_buffer`]).
///
/// # Errors
/// [`GpuError::UnknownBuffer`]; [`GpuError::Unavailable`] when the registry
/// is full.
pub fn export_process(table: &super::BufferTable, id: DeviceBufferId) -> Result<BufferExport, GpuError> {
    let entry = table.get(id).ok_or(GpuError::UnknownBuffer(id))?;
    let mut token = [0u8; 16];
    rand::RngCore::fill_bytes(&mut <rand::rngs::StdRng as rand::SeedableRng>::from_os_rng(), &mut token);
    let mut r = registry().lock().expect("export registry lock");
    r.retain(|_, (t, id)| t.is_live(*id));
    if r.len() >= PROCESS_EXPORTS_MAX {
        return Err(GpuError::Unavailable(format!("{PROCESS_EXPORTS_MAX} buffer exports outstanding")));
    }
    r.insert(token, (table.downgrade(), id));
    let mut handle = std::process::id().to_le_bytes().to_vec();
    handle.extend_from_slice(&token);
    Ok(BufferExport { kind: PeerKind::Process, handle, offset: 0, len: entry.len })
}

/// A [`PeerKind::Process`] buffer opened by the `host` backend.
pub struct ProcessPeerBuffer {
    /// The owner's buffer table (weak: the owner's backend may be gone).
    pub table: WeakBufferTable,
    /// The owner's buffer.
    pub id: DeviceBufferId,
    /// Its length at export.
    pub len: u64,
    /// The CUDA device whose check this buffer passed (the `cuda` backend
    /// verifies once, not per batch, that an in-process owner's buffer is
    /// memory of its device: a buffer id is never reused, so while `id`
    /// still pins, it names the allocation that was checked, unless the
    /// embedder freed registered memory, which C15 forbids and which a
    /// check per batch would only have caught by chance).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the cuda backend only
    pub(crate) device_checked: std::sync::OnceLock<usize>,
}

impl PeerBuffer for ProcessPeerBuffer {
    fn len(&self) -> u64 {
        self.len
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The in-process owners' buffers among a batch's `sources`
/// ([`ProcessPeerBuffer`]), pinned until this drops (C15).
pub struct ProcessPins {
    /// Per source: the owner's buffer's address, `None` for a source of
    /// another kind.
    pub addrs: Vec<Option<u64>>,
    _pins: Vec<crate::memory::buffers::BatchPin>,
}

/// Pins the [`ProcessPeerBuffer`]s among `sources` one owner table at a
/// time: one lock and one snapshot a table, not one a buffer (a KV tensor
/// per layer and K/V is 72 sources a batch).
///
/// # Errors
/// [`GpuError::Peer`] when an owner's buffer is no longer registered or
/// its length differs from the export's.
pub fn pin_process_sources(sources: &[Arc<dyn PeerBuffer>]) -> Result<ProcessPins, GpuError> {
    fn process(s: &Arc<dyn PeerBuffer>) -> Option<&ProcessPeerBuffer> {
        s.as_any().downcast_ref()
    }
    let gone = || GpuError::Peer("the owner's buffer is no longer registered".into());
    let mut tables: Vec<(&WeakBufferTable, crate::memory::buffers::BatchPin)> = Vec::new();
    let mut addrs = Vec::with_capacity(sources.len());
    for src in sources {
        let Some(p) = process(src) else {
            addrs.push(None);
            continue;
        };
        let at = match tables.iter().position(|(t, _)| t.same_table(&p.table)) {
            Some(i) => i,
            None => {
                let ids = sources.iter().filter_map(process).filter(|q| q.table.same_table(&p.table)).map(|q| q.id);
                tables.push((&p.table, p.table.pin_batch(ids).ok_or_else(gone)?));
                tables.len() - 1
            }
        };
        let (addr, len) = tables[at].1.get(p.id).ok_or_else(gone)?;
        if len != p.len {
            return Err(GpuError::Peer(format!("the owner's buffer is {len} bytes, exported as {}", p.len)));
        }
        addrs.push(Some(addr));
    }
    Ok(ProcessPins { addrs, _pins: tables.into_iter().map(|(_, pin)| pin).collect() })
}

/// Host memory mapped into this process that peer batches may read: a
/// same-host owner's shared pool, mapped read-only by the shared-pool
/// transport (issue 28 item 3, "copied host → device in one step"). The
/// `host` backend copies from `addr` directly; the `cuda` backend
/// registers the range first ([`Gpu::open_host_region`]). `keep` holds the
/// mapping alive for as long as any batch may read it.
pub struct HostRegionBuffer {
    addr: usize,
    len: u64,
    _keep: Arc<dyn std::any::Any + Send + Sync>,
}

impl HostRegionBuffer {
    /// `len` readable bytes at `addr`, alive while `keep` is.
    ///
    /// # Errors
    /// [`GpuError::OutOfRange`] for a null address, an empty range or one
    /// that wraps the address space.
    pub fn new(addr: usize, len: u64, keep: Arc<dyn std::any::Any + Send + Sync>) -> Result<Self, GpuError> {
        if addr == 0 || len == 0 || (addr as u64).checked_add(len).is_none() {
            return Err(GpuError::OutOfRange(format!("host region [{addr:#x}, +{len})")));
        }
        Ok(Self { addr, len, _keep: keep })
    }

    /// Address of the first byte in this process.
    pub fn addr(&self) -> usize {
        self.addr
    }
}

impl PeerBuffer for HostRegionBuffer {
    fn len(&self) -> u64 {
        self.len
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Opens a [`PeerKind::Process`] export (the `host` backend's
/// [`Gpu::open_peer_buffer`]).
///
/// # Errors
/// [`GpuError::Unsupported`] for another kind; [`GpuError::Peer`] for a
/// malformed handle, another process's handle, an unknown or revoked token,
/// or a length that disagrees with the owner's buffer.
pub fn open_process(e: &BufferExport) -> Result<Arc<dyn PeerBuffer>, GpuError> {
    if e.kind != PeerKind::Process {
        return Err(GpuError::Unsupported(format!("{:?} handles on the host backend", e.kind)));
    }
    if e.handle.len() != 20 {
        return Err(GpuError::Peer(format!("process handle of {} bytes, want 20", e.handle.len())));
    }
    let pid = u32::from_le_bytes(e.handle[..4].try_into().expect("4 bytes"));
    if pid != std::process::id() {
        return Err(GpuError::Peer(format!(
            "handle of process {pid}: only process {} can open it",
            std::process::id()
        )));
    }
    let token: [u8; 16] = e.handle[4..].try_into().expect("16 bytes");
    let (table, id) = registry()
        .lock()
        .expect("export registry lock")
        .get(&token)
        .cloned()
        .ok_or_else(|| GpuError::Peer("unknown or revoked export token".into()))?;
    let live = table.len_of(id).ok_or_else(|| GpuError::Peer("the exported buffer is no longer registered".into()))?;
    if e.offset != 0 || e.len != live {
        return Err(GpuError::Peer(format!("export says [{}, +{}), the buffer has {live} bytes", e.offset, e.len)));
    }
    Ok(Arc::new(ProcessPeerBuffer { table, id, len: live, device_checked: std::sync::OnceLock::new() }))
}

/// Drops every export token of `id` in `table`'s registry entries (the
/// owner unregistered the buffer: its handles open nothing afterwards).
pub fn revoke_process(table: &super::BufferTable, id: DeviceBufferId) {
    let weak = table.downgrade();
    registry().lock().expect("export registry lock").retain(|_, (t, i)| !(t.same_table(&weak) && *i == id));
}

/// Target of the debug events that time peer copies and the handoff steps
/// around them (µs; e.g. `RUST_LOG=kvferry_peer_timing=debug`): the cuda
/// backend's per-batch host timings; a fetch's read parts (issuing one on
/// the driver, planning a device part, submit to completion observed); and
/// the transfer lock (the owner's handler, the reader's wait and parse).
pub const PEER_TIMING_TRACE_TARGET: &str = "kvferry_peer_timing";

/// Per op of a [`PeerCopyBatch`], the checksum ranges holding it and its
/// offset in each, produced in op order by [`RangesByOp::walk`] (a
/// backend planning the batch's copies and checksum pieces). The engine's
/// batches give each block one span of ops, in order and without overlap:
/// those are walked with a cursor over the spans, with nothing built per
/// op; any other batch gets compressed rows (three vectors of about one
/// entry per op).
pub struct RangesByOp<'a> {
    /// The batch's checksum spans.
    spans: &'a [Range<usize>],
    /// `None` for spans in op order, none overlapping the next; else the
    /// rows: op `i`'s entries are `entries[start[i]..start[i + 1]]`.
    rows: Option<Rows>,
}

/// [`RangesByOp`]'s compressed rows.
struct Rows {
    start: Vec<usize>,
    entries: Vec<(u32, u64)>,
}

impl<'a> RangesByOp<'a> {
    /// The ranges of a batch that passed [`validate_peer_batch`].
    pub fn of(batch: &'a PeerCopyBatch) -> Self {
        let spans = &batch.checksums[..];
        if spans.windows(2).all(|w| w[0].end <= w[1].start) {
            return RangesByOp { spans, rows: None };
        }
        let mut start = vec![0usize; batch.ops.len() + 1];
        for span in spans {
            for i in span.clone() {
                start[i + 1] += 1;
            }
        }
        for i in 0..batch.ops.len() {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut entries = vec![(0u32, 0u64); start[batch.ops.len()]];
        for (r, span) in spans.iter().enumerate() {
            let mut off = 0;
            for i in span.clone() {
                entries[fill[i]] = (r as u32, off);
                fill[i] += 1;
                off += batch.ops[i].len;
            }
        }
        RangesByOp { spans, rows: Some(Rows { start, entries }) }
    }

    /// A walk over the batch's ops, from op 0.
    pub fn walk(&self) -> RangeWalk<'_> {
        RangeWalk { by_op: self, span: 0, off: 0, one: [(0, 0)] }
    }
}

/// [`RangesByOp`] op by op.
pub struct RangeWalk<'a> {
    by_op: &'a RangesByOp<'a>,
    /// Sorted spans: the first span not yet behind the walk, and the bytes
    /// of its ops walked so far.
    span: usize,
    off: u64,
    one: [(u32, u64); 1],
}

impl RangeWalk<'_> {
    /// The ranges holding op `i`, of `len` bytes, as `(range index, offset
    /// of the op in the range)`; called for ops 0, 1, 2, … in order.
    pub fn next(&mut self, i: usize, len: u64) -> &[(u32, u64)] {
        let Some(Rows { start, entries }) = &self.by_op.rows else {
            while self.by_op.spans.get(self.span).is_some_and(|s| s.end <= i) {
                self.span += 1;
                self.off = 0;
            }
            return match self.by_op.spans.get(self.span) {
                Some(s) if s.start <= i => {
                    self.one = [(self.span as u32, self.off)];
                    self.off += len;
                    &self.one
                }
                _ => &[],
            };
        };
        &entries[start[i]..start[i + 1]]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pin_process_sources` pins every in-process source's buffer, one
    /// owner table at a time, until it drops, gives each its address (none
    /// for another kind), and refuses an unregistered buffer or a length
    /// that differs from the export's, leaving nothing pinned.
    #[test]
    fn process_sources_are_pinned_per_owner_table_until_dropped() {
        use crate::memory::buffers::BufferTable;
        let (a, b) = (BufferTable::default(), BufferTable::default());
        let at = |n: u64| n * crate::limits::DEVICE_BUFFER_ALIGN;
        let a0 = a.register(at(16), 4096, false).unwrap();
        let a1 = a.register(at(1024), 8192, false).unwrap();
        let b0 = b.register(at(16), 4096, false).unwrap();
        let src = |t: &BufferTable, id, len| -> Arc<dyn PeerBuffer> {
            Arc::new(ProcessPeerBuffer { table: t.downgrade(), id, len, device_checked: OnceLock::new() })
        };
        let region: Arc<dyn PeerBuffer> = Arc::new(HostRegionBuffer::new(at(1) as usize, 64, Arc::new(())).unwrap());
        let sources = vec![src(&a, a1, 8192), src(&b, b0, 4096), region, src(&a, a0, 4096)];
        let pins = pin_process_sources(&sources).expect("all live");
        assert_eq!(pins.addrs, vec![Some(at(1024)), Some(at(16)), None, Some(at(16))]);
        for (t, id) in [(&a, a0), (&a, a1), (&b, b0)] {
            assert!(t.unregister(id).is_err(), "{id} is pinned");
        }
        drop(pins);
        assert!(matches!(pin_process_sources(&[src(&a, a0, 1)]), Err(GpuError::Peer(_))), "length differs");
        a.unregister(a0).expect("not pinned any more");
        let gone = pin_process_sources(&[src(&a, a1, 8192), src(&a, a0, 4096)]);
        assert!(matches!(gone, Err(GpuError::Peer(_))), "a0 unregistered");
        a.unregister(a1).expect("the refused call left nothing pinned");
        b.unregister(b0).expect("not pinned");
    }

    /// Every op's ranges by brute force: `(range, offset)` for each span
    /// holding it, in span order.
    fn brute(lens: &[u64], spans: &[Range<usize>]) -> Vec<Vec<(u32, u64)>> {
        (0..lens.len())
            .map(|i| {
                spans
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.contains(&i))
                    .map(|(r, s)| (r as u32, lens[s.start..i].iter().sum()))
                    .collect()
            })
            .collect()
    }

    fn walked(lens: &[u64], spans: Vec<Range<usize>>) -> (bool, Vec<Vec<(u32, u64)>>) {
        let table = crate::memory::buffers::BufferTable::default();
        let src = ProcessPeerBuffer {
            table: table.downgrade(),
            id: DeviceBufferId(0),
            len: 1 << 40,
            device_checked: std::sync::OnceLock::new(),
        };
        let ops = lens
            .iter()
            .map(|&len| PeerCopyOp { src: 0, src_offset: 0, dst: DeviceBufferId(0), dst_offset: 0, len })
            .collect();
        let batch = PeerCopyBatch { sources: vec![Arc::new(src)], ops, checksums: spans };
        validate_peer_batch(&batch).expect("a valid batch");
        let by_op = RangesByOp::of(&batch);
        let mut walk = by_op.walk();
        let got = lens.iter().enumerate().map(|(i, &len)| walk.next(i, len).to_vec()).collect();
        (by_op.rows.is_none(), got)
    }

    #[test]
    fn walking_sorted_spans_gives_each_op_its_range_and_offset_as_rows_do() {
        let lens: Vec<u64> = (0..40).map(|i| (i * 7919 % 13) * 512).collect();
        let cases: Vec<(Vec<Range<usize>>, bool)> = vec![
            // The engine's shape: one span per block, back to back.
            ((0..10).map(|b| 4 * b..4 * b + 4).collect(), true),
            // Gaps, empty spans at a boundary, ops in no span at either end.
            (vec![2..5, 5..5, 5..9, 12..12, 20..31], true),
            (std::iter::once(0..40).collect(), true),
            (Vec::new(), true),
            // Overlapping or out of order: rows.
            (vec![0..10, 5..15], false),
            (vec![20..30, 0..10], false),
            (vec![0..40, 3..4, 3..4], false),
        ];
        for (spans, sorted) in cases {
            let (was_sorted, got) = walked(&lens, spans.clone());
            assert_eq!(was_sorted, sorted, "{spans:?}");
            assert_eq!(got, brute(&lens, &spans), "{spans:?}");
        }
    }
}
