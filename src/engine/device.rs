//! The owner's half of device-direct reads on one host (contract C19): the
//! engine grants device leases on its KV blocks ([`Engine::grant_device_lease`]),
//! hands a same-host reader that locked those blocks for transfer the
//! device ranges and buffer exports to copy them from
//! ([`Engine::device_grant`]), and tells its embedder when each lease ended
//! ([`Engine::ended_device_leases`]). The lease rules are in
//! [`super::leases`]; the copies in [`crate::gpu::peer`]; the reader's half
//! in [`super::fetch`].
//!
//! Who gets device ranges (never assumed from an address):
//! - the reader must say which handle kind it opens (a kind it does not
//!   name is never sent);
//! - a reader that says it runs in this process gets [`PeerKind::Process`]
//!   handles, whatever the backend (they open only there: the export
//!   registry is per-process; a CUDA IPC handle would not open in the
//!   process that made it);
//! - a [`PeerKind::CudaIpc`] handle goes only to a reader of that kind the
//!   transport has proven to run on this host as this user (it redeemed a
//!   shared-pool token over the credential-checked local socket:
//!   [`crate::transport::Transport::proven_same_host`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::leases::{DeviceLeaseId, LeaseEnded, LeaseError};
use super::{Engine, EngineError};
use crate::gpu::peer::{BufferExport, PeerKind};
use crate::memory::DeviceBufferId;
use crate::types::BlockHash;

pub use super::leases::{DEVICE_LEASE_TRACE_TARGET, DEVICE_READ_TRACE_TARGET};

/// What a reader asks for with a transfer lock: the handle kind it opens,
/// its process id, and whether the transport proved it runs on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAsk {
    /// The kind it opens.
    pub kind: PeerKind,
    /// Its process id (as it says).
    pub pid: u32,
    /// The transport proved same host and user (credential-checked socket).
    pub proven_same_host: bool,
}

/// One (layer, segment) of a device layout as a reader sees it: segment
/// bytes of device block `b` are the `len` bytes at `offset + b * stride`
/// of export `export` (an index into the answer's exports). All in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportRun {
    /// Index of the export holding the segment.
    pub export: u32,
    /// Offset of block 0 inside the export's buffer.
    pub offset: u64,
    /// Distance between consecutive blocks.
    pub stride: u64,
    /// Bytes of one block's segment.
    pub len: u64,
}

/// The device half of a transfer lock's answer: the owner's layout once
/// (exports and one run per (layer, segment) in pool byte order) and each
/// locked block's device index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceGrant {
    /// Exports the runs name (by index).
    pub exports: Vec<BufferExport>,
    /// Blocks of the layout (valid device indices are `0..num_blocks`).
    pub num_blocks: u64,
    /// Per (layer, segment), in pool byte order (layer 0's K, its V,
    /// layer 1's K…): where that segment of every device block sits.
    pub runs: Vec<ExportRun>,
    /// Per locked block (same order), its device block index; `None` for
    /// a block no lease of this session covers.
    pub blocks: Vec<Option<u64>>,
    /// Time left on the earliest of the taken leases (ms).
    pub ms_left: u64,
}

impl Engine {
    /// Grants a device lease on `blocks` (`(hash, device block index)`) of
    /// `namespace` for `ttl`: until a reader that took it releases its
    /// transfer session, or `ttl` passes, or the engine ends it or
    /// unregisters the layout, the engine promises not to write those
    /// device blocks, and a same-host reader may copy them device to device
    /// ([`crate::gpu::peer`]). Grant after the blocks were saved (their
    /// checksums come from the save) and learn when to reuse them from
    /// [`Engine::ended_device_leases`].
    ///
    /// # Errors
    /// [`EngineError::UnknownNamespace`], [`EngineError::BlockIndex`],
    /// [`EngineError::Gpu`] with [`crate::gpu::GpuError::Unsupported`] when
    /// the backend has no peer copies, [`EngineError::Lease`] (bad count or
    /// ttl, a block already leased, too many leases); nothing changes.
    pub fn grant_device_lease(
        &self,
        namespace: &str,
        blocks: &[(BlockHash, u64)],
        ttl: Duration,
    ) -> Result<DeviceLeaseId, EngineError> {
        let (ns, layout) = self.layout(namespace)?;
        Self::check_indices(&layout, blocks.iter().map(|(_, i)| i))?;
        for (h, _) in blocks {
            h.validate()?;
        }
        if self.inner.gpu.peer_kind().is_none() {
            return Err(crate::gpu::GpuError::Unsupported(format!(
                "device leases: the {} backend has no peer copies",
                self.inner.gpu.name()
            ))
            .into());
        }
        let id = DeviceLeaseId(u128::from_le_bytes({
            let mut b = [0u8; 16];
            rand::RngCore::fill_bytes(&mut *self.inner.rng.lock().expect("rng lock"), &mut b);
            b
        }));
        let now = self.now_ms();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let mut leases = self.inner.leases.lock().expect("leases lock");
        leases.expire(now);
        leases.grant(id, ns, blocks.to_vec(), now, ttl_ms)?;
        tracing::trace!(
            target: DEVICE_LEASE_TRACE_TARGET,
            owner = %self.node(),
            lease = %id,
            blocks = blocks.len(),
            now_ms = now,
            expires_at_ms = now.saturating_add(ttl_ms),
            "granted"
        );
        Ok(id)
    }

    /// Ends lease `id` early (the engine needs its blocks back); false when
    /// it already ended. A reader that took it may have copies in flight:
    /// their bytes are judged by the block checksums (C10).
    pub fn end_device_lease(&self, id: DeviceLeaseId) -> bool {
        let now = self.now_ms();
        self.inner.leases.lock().expect("leases lock").end(id, now)
    }

    /// Every lease that ended since the last call (oldest first): the
    /// device blocks the engine may write again. Expires due leases first.
    /// Drain it regularly: while [`crate::limits::DEVICE_LEASES_ENDED_MAX`]
    /// ends wait, new grants are refused.
    pub fn ended_device_leases(&self) -> Vec<LeaseEnded> {
        let now = self.now_ms();
        let mut leases = self.inner.leases.lock().expect("leases lock");
        leases.expire(now);
        leases.drain_ended()
    }

    /// Live device leases.
    pub fn device_leases_live(&self) -> usize {
        self.inner.leases.lock().expect("leases lock").live()
    }

    /// The device half of a transfer lock for `session` (which locked
    /// `found`, in request order): takes the leases covering them for the
    /// session and describes this engine's device layout (once) and each
    /// leased block's index in it. `None` when the asker may not have device ranges
    /// (module doc), no lease covers a found block, or a buffer cannot be
    /// exported (the reader then reads the pool).
    pub fn device_grant(
        &self,
        namespace: &str,
        found: &[BlockHash],
        session: &str,
        ask: &DeviceAsk,
    ) -> Option<DeviceGrant> {
        let mine = self.inner.gpu.peer_kind()?;
        // The kind of export: a reader in this very process gets a process
        // token (a CUDA IPC handle does not open in the process that made
        // it), a proven same-host reader of our kind gets our kind.
        let same_process = ask.pid == std::process::id();
        let kind = match (mine, ask.kind) {
            _ if same_process => PeerKind::Process,
            (PeerKind::CudaIpc, PeerKind::CudaIpc) if ask.proven_same_host => PeerKind::CudaIpc,
            _ => return None,
        };
        let (_, layout) = self.layout(namespace).ok()?;
        // Export every buffer the layout names before any lease is taken,
        // so a failed export takes nothing.
        let mut index: HashMap<DeviceBufferId, u32> = HashMap::new();
        let mut exports = Vec::new();
        {
            let mut cache = self.inner.exports.lock().expect("exports lock");
            for l in layout.layers() {
                for base in l.segment_bases() {
                    if index.contains_key(&base.buffer) {
                        continue;
                    }
                    let e = match cache.get(&(base.buffer, kind)) {
                        Some(e) => e.clone(),
                        None => {
                            let e = self.inner.gpu.export_buffer(base.buffer, kind).ok()?;
                            cache.insert((base.buffer, kind), e.clone());
                            e
                        }
                    };
                    index.insert(base.buffer, exports.len() as u32);
                    exports.push(e);
                }
            }
        }
        if exports.len() > crate::limits::DEVICE_EXPORTS_PER_ANSWER_MAX {
            return None;
        }
        let now = self.now_ms();
        let taken = self.inner.leases.lock().expect("leases lock").take(namespace, found, session, now);
        if taken.blocks.is_empty() {
            return None;
        }
        // The layout once per answer; each block only names its index
        // (the reader derives the ranges: `super::fetch::device`).
        let runs = layout
            .layers()
            .iter()
            .flat_map(|l| {
                l.segment_bases().map(|base| ExportRun {
                    export: index[&base.buffer],
                    offset: base.offset,
                    stride: l.block_stride,
                    len: l.bytes_per_block,
                })
            })
            .collect();
        let mut blocks = vec![None; found.len()];
        for &(i, b) in &taken.blocks {
            if layout.check_block(b).is_ok() {
                blocks[i] = Some(b);
            }
        }
        self.inner.metrics.device_leases_taken.fetch_add(1, Ordering::Relaxed);
        if tracing::enabled!(target: DEVICE_LEASE_TRACE_TARGET, tracing::Level::TRACE) {
            let ids: Vec<String> = taken.leases.iter().map(ToString::to_string).collect();
            tracing::trace!(
                target: DEVICE_LEASE_TRACE_TARGET,
                owner = %self.node(),
                session,
                leases = %ids.join(","),
                blocks = taken.blocks.len(),
                now_ms = now,
                expires_at_ms = taken.expires_ms,
                "taken"
            );
        }
        // C19 canary: the reader is told a fresh lease's time left.
        let ms_left = if crate::canary::active(crate::canary::Canary::C19LeaseExpiryIgnored) {
            crate::limits::DEVICE_LEASE_TTL_MS_MAX
        } else {
            taken.expires_ms.saturating_sub(now)
        };
        Some(DeviceGrant { exports, num_blocks: layout.num_blocks(), runs, blocks, ms_left })
    }

    /// Ends the leases `session` took (its reader released it).
    pub(crate) fn release_device_leases(&self, session: &str) {
        let now = self.now_ms();
        let n = self.inner.leases.lock().expect("leases lock").release_session(session, now);
        if n > 0 {
            tracing::trace!(target: DEVICE_LEASE_TRACE_TARGET, owner = %self.node(), session, leases = n, now_ms = now, "released");
        }
    }

    /// Forgets the cached export of `buffer` (it is being unregistered).
    pub(crate) fn forget_export(&self, buffer: DeviceBufferId) {
        self.inner.exports.lock().expect("exports lock").retain(|(b, _), _| *b != buffer);
    }
}

impl From<LeaseError> for EngineError {
    fn from(e: LeaseError) -> Self {
        EngineError::Lease(e)
    }
}
