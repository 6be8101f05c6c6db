//! One choice of path, automatic (issue 28 item 5, host memory): a
//! composite [`Transport`] over the node's TCP transport and, where the
//! owner is on this host, its shared pool (`transport::shm`).
//!
//! # Choosing
//!
//! Paths in preference order: shared pool, then TCP. Per owner the
//! handshake decides: with [`PathChoice::Auto`] the reader maps the owner's
//! pool when same host is proven (host identity in both handshake
//! metadata, token, peer credentials; see `shm`) and otherwise reads over
//! TCP; TCP is connected too, as the fallback. [`PathChoice::Shm`] insists
//! on the shared pool (a handshake that cannot map it fails, no TCP);
//! [`PathChoice::Tcp`] never offers or uses it.
//!
//! # Falling back
//!
//! Reads are idempotent. When a shared-pool read fails for some extents
//! (with `Auto`), those extents are read again over TCP within the *same*
//! deadline — never past it — and counted as fallbacks. The bytes are
//! judged by the fetch's checksums either way (C10).
//!
//! # Counters
//!
//! [`PathTransport::stats`] returns a [`PathStats`] snapshot: per path the
//! read batches, extents (blocks, for the fetch: one extent per block),
//! bytes and, for the shared pool, fallbacks and refused attaches.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use tokio::time::Instant;

use super::handshake::{HandshakeMetadata, TransportKind};
#[cfg(target_os = "linux")]
use super::shm::ShmTransport;
use super::{HandshakeRejected, ReadCompletion, ReadOp, Transport, TransportError};
use crate::memory::pool::Extent;
use crate::types::NodeAddr;

/// Which data paths a node may read host memory through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PathChoice {
    /// The fastest available per owner: the shared pool where same host is
    /// proven, else TCP; a failed shared-pool read falls back to TCP.
    #[default]
    Auto,
    /// The shared pool only: a node that cannot share its pool fails at
    /// start, a handshake with an owner whose pool cannot be mapped fails,
    /// and a failed read is not retried over TCP (for benchmarks).
    Shm,
    /// TCP only (no shared pool offered or used).
    Tcp,
    /// Device to device from a same-host owner's KV wherever the owner
    /// granted a device lease (C19; [`crate::gpu::peer`]), everything else
    /// as [`PathChoice::Auto`]. `Auto` copies device to device too; `Shm`
    /// and `Tcp` never do (for benchmarks of those paths).
    Ipc,
}

impl std::fmt::Display for PathChoice {
    /// `auto`, `shm` or `tcp`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PathChoice::Auto => "auto",
            PathChoice::Shm => "shm",
            PathChoice::Tcp => "tcp",
            PathChoice::Ipc => "ipc",
        })
    }
}

impl std::str::FromStr for PathChoice {
    type Err = String;

    /// `auto`, `shm` or `tcp`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PathChoice::Auto),
            "shm" => Ok(PathChoice::Shm),
            "tcp" => Ok(PathChoice::Tcp),
            "ipc" => Ok(PathChoice::Ipc),
            _ => Err(format!("unknown path {s:?} (want auto, ipc, shm or tcp)")),
        }
    }
}

/// Counters of one path (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PathCounters {
    /// Read batches served on this path (count).
    pub reads: u64,
    /// Extents read successfully on this path (count; the fetch reads one
    /// extent per block).
    pub extents: u64,
    /// Bytes read successfully on this path.
    pub bytes: u64,
    /// Extents whose read on this path failed and that were read again on
    /// the next path (count; shared pool only).
    pub fallbacks: u64,
    /// Handshakes in which this path could not be set up (count; shared
    /// pool only: not same host, refused, unmappable).
    pub attach_failures: u64,
}

/// Per-path counters of a [`PathTransport`] (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PathStats {
    /// The shared pool (same host).
    pub shm: PathCounters,
    /// TCP.
    pub tcp: PathCounters,
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    extents: AtomicU64,
    bytes: AtomicU64,
    fallbacks: AtomicU64,
    attach_failures: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> PathCounters {
        PathCounters {
            reads: self.reads.load(Ordering::Relaxed),
            extents: self.extents.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            fallbacks: self.fallbacks.load(Ordering::Relaxed),
            attach_failures: self.attach_failures.load(Ordering::Relaxed),
        }
    }

    /// Counts a batch's successful extents and their bytes.
    fn count(&self, ops: &[ReadOp], results: &[Result<(), TransportError>]) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let ok = results.iter().filter(|r| r.is_ok()).count() as u64;
        let bytes: u64 =
            ops.iter().filter(|op| results.get(op.local_extent).is_some_and(Result::is_ok)).map(|op| op.len).sum();
        self.extents.fetch_add(ok, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// The shared-pool backend, where this build has one.
#[cfg(target_os = "linux")]
type Shm = Arc<ShmTransport>;
/// No shared-pool backend off Linux.
#[cfg(not(target_os = "linux"))]
type Shm = std::convert::Infallible;

/// The composite transport (see the module doc).
pub struct PathTransport {
    choice: PathChoice,
    tcp: Arc<dyn Transport>,
    shm: Option<Shm>,
    shm_counters: Counters,
    tcp_counters: Counters,
}

impl PathTransport {
    /// Paths over `tcp` (the base: its kind and metadata) and, unless
    /// `choice` is [`PathChoice::Tcp`], the shared pool `shm` (`None`: this
    /// node does not share or map pools).
    pub fn new(choice: PathChoice, tcp: Arc<dyn Transport>, shm: Option<Shm>) -> Self {
        let shm = if choice == PathChoice::Tcp { None } else { shm };
        Self { choice, tcp, shm, shm_counters: Counters::default(), tcp_counters: Counters::default() }
    }

    /// The configured choice.
    pub fn choice(&self) -> PathChoice {
        self.choice
    }

    /// Per-path counters.
    pub fn stats(&self) -> PathStats {
        PathStats { shm: self.shm_counters.snapshot(), tcp: self.tcp_counters.snapshot() }
    }

    /// The shared-pool backend, when this node has one.
    #[cfg(target_os = "linux")]
    pub fn shm(&self) -> Option<&Arc<ShmTransport>> {
        self.shm.as_ref()
    }

    /// Stops serving the shared pool (a node's shutdown or crash); peers
    /// already attached keep their mappings.
    pub fn shutdown(&self) {
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            s.shutdown();
        }
    }

    /// Whether `peer` proved it runs on this host as this user (it attached
    /// to this node's shared pool).
    pub fn proves_same_host(&self, peer: &NodeAddr) -> bool {
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            return s.proven_same_host(peer);
        }
        let _ = peer;
        false
    }

    /// Whether reads from `peer` go through its shared pool.
    pub fn uses_shm(&self, peer: &NodeAddr) -> bool {
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            return s.is_attached(peer);
        }
        let _ = peer;
        false
    }
}

/// `results` with the extents at `retry` replaced by those of a second
/// read: the failed extents and their ops re-indexed from 0.
fn retry_subset(
    ops: &[ReadOp],
    local: Vec<Extent>,
    results: &[Result<(), TransportError>],
) -> (Vec<usize>, Vec<ReadOp>, Vec<Extent>, Vec<Option<Extent>>) {
    let failed: Vec<usize> = results.iter().enumerate().filter(|(_, r)| r.is_err()).map(|(i, _)| i).collect();
    let mut new_index = vec![usize::MAX; local.len()];
    for (k, &i) in failed.iter().enumerate() {
        new_index[i] = k;
    }
    let sub_ops = ops
        .iter()
        .filter(|op| new_index.get(op.local_extent).is_some_and(|&k| k != usize::MAX))
        .map(|op| ReadOp { local_extent: new_index[op.local_extent], ..*op })
        .collect();
    let mut kept: Vec<Option<Extent>> = Vec::with_capacity(local.len());
    let mut sub = Vec::with_capacity(failed.len());
    for (i, ext) in local.into_iter().enumerate() {
        if new_index[i] == usize::MAX {
            kept.push(Some(ext));
        } else {
            kept.push(None);
            sub.push(ext);
        }
    }
    (failed, sub_ops, sub, kept)
}

#[async_trait]
impl Transport for PathTransport {
    fn kind(&self) -> TransportKind {
        self.tcp.kind()
    }

    fn proven_same_host(&self, peer: &NodeAddr) -> bool {
        self.proves_same_host(peer)
    }

    fn local_metadata(&self) -> HandshakeMetadata {
        let mut m = self.tcp.local_metadata();
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            m.same_host = s.offer_section();
        }
        m
    }

    fn answer(
        &self,
        requester: &NodeAddr,
        offer: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<HandshakeMetadata, TransportError> {
        #[allow(unused_mut)]
        let mut m = self.tcp.answer(requester, offer, deadline)?;
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            m.same_host = s.answer_section(requester, offer);
        }
        Ok(m)
    }

    async fn connect(
        &self,
        peer: &NodeAddr,
        remote: &HandshakeMetadata,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        #[allow(unused_mut)]
        let mut shm_ok = false;
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            match s.attach(peer, remote, deadline).await {
                Ok(()) => shm_ok = true,
                Err(e) => {
                    self.shm_counters.attach_failures.fetch_add(1, Ordering::Relaxed);
                    if self.choice == PathChoice::Shm {
                        return Err(TransportError::Handshake(HandshakeRejected::SharedPool(e.into())));
                    }
                    tracing::debug!(%peer, error = %e, "shared pool not used; reading over TCP");
                }
            }
        }
        if self.choice == PathChoice::Shm {
            if shm_ok {
                return Ok(());
            }
            return Err(TransportError::Handshake(HandshakeRejected::NoSharedPool));
        }
        match self.tcp.connect(peer, remote, deadline).await {
            Ok(()) => Ok(()),
            // The pool is mapped: reads work without the fallback.
            Err(e) if shm_ok => {
                tracing::debug!(%peer, error = %e, "TCP fallback not connected");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn shared_region(&self, peer: &NodeAddr) -> Option<super::SharedRegion> {
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            return s.shared_region(peer);
        }
        let _ = peer;
        None
    }

    fn disconnect(&self, peer: &NodeAddr) {
        #[cfg(target_os = "linux")]
        if let Some(s) = &self.shm {
            s.disconnect(peer);
        }
        self.tcp.disconnect(peer);
    }

    async fn read(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        deadline: Instant,
    ) -> ReadCompletion {
        self.read_summed(peer, session, ops, local, None, deadline).await
    }

    /// The path chosen for `peer`: the shared pool when attached, TCP for
    /// what it could not read; with `ends`, each path takes the extents'
    /// slot checksums as the bytes land.
    async fn read_summed(
        &self,
        peer: &NodeAddr,
        session: &str,
        ops: Vec<ReadOp>,
        local: Vec<Extent>,
        ends: Option<super::SlotEnds>,
        deadline: Instant,
    ) -> ReadCompletion {
        #[cfg(target_os = "linux")]
        if let Some(s) = self.shm.as_ref().filter(|s| s.is_attached(peer)) {
            let done = s.read_summed(peer, session, ops.clone(), local, ends.clone(), deadline).await;
            self.shm_counters.count(&ops, &done.results);
            if self.choice == PathChoice::Shm || done.results.iter().all(Result::is_ok) {
                return done;
            }
            if done.local.len() != done.results.len() {
                return done; // cut off by a runtime shutdown: nothing to retry
            }
            let (failed, sub_ops, sub, mut kept) = retry_subset(&ops, done.local, &done.results);
            self.shm_counters.fallbacks.fetch_add(failed.len() as u64, Ordering::Relaxed);
            tracing::debug!(%peer, extents = failed.len(), "shared-pool read failed; reading those over TCP");
            let again = self.tcp.read_summed(peer, session, sub_ops.clone(), sub, ends.clone(), deadline).await;
            self.tcp_counters.count(&sub_ops, &again.results);
            let mut results = done.results;
            let mut sums = done.sums;
            sums.resize(results.len(), None);
            let mut again_sums = again.sums.into_iter();
            let mut back = again.local.into_iter().zip(again.results);
            for &i in &failed {
                match back.next() {
                    Some((ext, r)) => {
                        kept[i] = Some(ext);
                        results[i] = r;
                        sums[i] = again_sums.next().flatten();
                    }
                    None => break, // the TCP read was cut off: the rest is gone
                }
            }
            // Every extent, in order, up to the first one that did not come back.
            let (mut local, mut kept_results, mut kept_sums) = (Vec::new(), Vec::new(), Vec::new());
            for ((e, r), s) in kept.into_iter().zip(results).zip(sums) {
                let Some(e) = e else { break };
                local.push(e);
                kept_results.push(r);
                kept_sums.push(s);
            }
            if ends.is_none() {
                kept_sums.clear();
            }
            return ReadCompletion { local, results: kept_results, sums: kept_sums };
        }
        let done = self.tcp.read_summed(peer, session, ops.clone(), local, ends, deadline).await;
        self.tcp_counters.count(&ops, &done.results);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::pool::Pool;

    /// The failed extents and only their ops go to the retry, re-indexed
    /// from 0 in order; the others stay in place.
    #[test]
    fn retry_subset_takes_exactly_the_failed_extents() {
        let pool = Pool::new(1 << 20, 256).unwrap();
        let local: Vec<Extent> = (0..4).map(|_| pool.alloc(1024).unwrap()).collect();
        let offsets: Vec<u64> = local.iter().map(Extent::offset).collect();
        let op = |e: usize, at: u64| ReadOp { region: 0, remote_offset: at, len: 8, local_extent: e, local_offset: at };
        let ops = vec![op(0, 0), op(1, 8), op(1, 16), op(2, 24), op(3, 32)];
        let results =
            vec![Ok(()), Err(TransportError::Timeout), Ok(()), Err(TransportError::io(std::io::ErrorKind::Other, "x"))];
        let (failed, sub_ops, sub, kept) = retry_subset(&ops, local, &results);
        assert_eq!(failed, vec![1, 3]);
        assert_eq!(sub_ops, vec![op(0, 8), op(0, 16), op(1, 32)]);
        assert_eq!(sub.iter().map(Extent::offset).collect::<Vec<_>>(), vec![offsets[1], offsets[3]]);
        assert_eq!(
            kept.iter().map(|e| e.as_ref().map(Extent::offset)).collect::<Vec<_>>(),
            vec![Some(offsets[0]), None, Some(offsets[2]), None]
        );
    }

    #[test]
    fn path_choice_parses_and_prints() {
        for c in [PathChoice::Auto, PathChoice::Shm, PathChoice::Tcp, PathChoice::Ipc] {
            assert_eq!(c.to_string().parse::<PathChoice>(), Ok(c));
        }
        assert!("rdma".parse::<PathChoice>().is_err());
        assert!("".parse::<PathChoice>().is_err());
        assert_eq!(PathChoice::default(), PathChoice::Auto);
    }
}
