//! The peers this engine fetches from: per owner, its gRPC client, the
//! single-flight handshake, the device buffers this node opened from it
//! (C19) and its shared pool as this node's GPU backend opened it for
//! one-step copies. The engine keeps the table; [`super::fetch`] drives it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OnceCell;
use tonic::transport::Channel;

use crate::gpu::peer::{BufferExport, PeerBuffer};
use crate::gpu::{Gpu, GpuError};
use crate::proto::engine_client::EngineClient;
use crate::types::NodeAddr;

/// Per-peer state: its gRPC client and the single-flight handshake.
pub(crate) struct PeerState {
    pub grpc: EngineClient<Channel>,
    pub handshake: OnceCell<()>,
    /// Its device buffers this node opened (C19), kept while the entry is.
    pub opened: Mutex<Opened>,
    /// Its shared pool opened as a peer-copy source (see
    /// [`PeerState::shared_source`]).
    pub shared: Mutex<SharedSource>,
}

/// Where opening a peer's mapped shared pool as a peer-copy source stands,
/// per mapping (keyed by the address of the mapping's keep-alive, so a
/// restarted owner's new mapping is opened afresh).
#[derive(Default)]
pub(crate) enum SharedSource {
    /// Never asked.
    #[default]
    Unopened,
    /// Being opened on a blocking thread.
    Opening(usize),
    /// Opened: copies may read it.
    Ready(usize, Arc<dyn PeerBuffer>),
    /// The backend refused it (no host-region support, registration
    /// refused): the pool copy serves this mapping.
    Refused(usize),
}

/// The identity of a mapping of a peer's pool: the address of its
/// keep-alive (a restarted owner's new mapping gets a new one).
fn mapping_key(region: &crate::transport::SharedRegion) -> usize {
    Arc::as_ptr(&region.keep).cast::<()>() as usize
}

impl PeerState {
    /// Whether the peer's mapped pool `region` is a copy source now:
    /// `Some(true)` opened, `Some(false)` refused by the backend, `None`
    /// not asked yet or still being opened.
    pub fn shared_opened(&self, region: &crate::transport::SharedRegion) -> Option<bool> {
        let key = mapping_key(region);
        match &*self.shared.lock().expect("shared source lock") {
            SharedSource::Ready(k, _) if *k == key => Some(true),
            SharedSource::Refused(k) if *k == key => Some(false),
            _ => None,
        }
    }

    /// The peer's mapped shared pool `region` as a source of
    /// [`Gpu::submit_peer`] batches, once opened. The first call for a
    /// mapping starts opening it on a blocking thread (pinning a large pool
    /// takes time, issue 28 item 3) and answers `None`, as does every call
    /// until it is ready or after the backend refused it: meanwhile reads
    /// take the pool copy.
    pub fn shared_source(
        self: &Arc<Self>,
        gpu: &Arc<dyn Gpu>,
        region: crate::transport::SharedRegion,
    ) -> Option<Arc<dyn PeerBuffer>> {
        let key = mapping_key(&region);
        let mut st = self.shared.lock().expect("shared source lock");
        match &*st {
            SharedSource::Ready(k, b) if *k == key => return Some(b.clone()),
            SharedSource::Opening(k) | SharedSource::Refused(k) if *k == key => return None,
            _ => {}
        }
        *st = SharedSource::Opening(key);
        drop(st);
        let (me, gpu) = (self.clone(), gpu.clone());
        tokio::spawn(async move {
            let opened =
                crate::rt::run_blocking(move || gpu.open_host_region(region.addr, region.len, region.keep)).await;
            let mut st = me.shared.lock().expect("shared source lock");
            if matches!(*st, SharedSource::Opening(k) if k == key) {
                *st = match opened {
                    Ok(Ok(b)) => SharedSource::Ready(key, b),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "the peer's shared pool cannot be a device-copy source; pool copies serve it");
                        SharedSource::Refused(key)
                    }
                    // The runtime is shutting down.
                    Err(_) => SharedSource::Unopened,
                };
            }
        });
        None
    }
}

/// Peers this engine fetches from.
#[derive(Default)]
pub(crate) struct PeerTable {
    peers: Mutex<HashMap<NodeAddr, Arc<PeerState>>>,
}

impl PeerTable {
    /// The entry of `peer`, made (with a lazily connecting channel) if
    /// there is none.
    ///
    /// # Errors
    /// The peer's address is not a valid endpoint.
    pub fn get(&self, peer: &NodeAddr, timeout: Duration) -> Result<Arc<PeerState>, tonic::transport::Error> {
        let mut map = self.peers.lock().expect("peers lock");
        if let Some(p) = map.get(peer) {
            return Ok(p.clone());
        }
        let ch = crate::rt::channel(&peer.0, timeout)?;
        let grpc = EngineClient::new(ch)
            .max_decoding_message_size(crate::limits::GRPC_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(crate::limits::GRPC_MESSAGE_BYTES_MAX);
        let p = Arc::new(PeerState {
            grpc,
            handshake: OnceCell::new(),
            opened: Mutex::default(),
            shared: Mutex::default(),
        });
        map.insert(peer.clone(), p.clone());
        Ok(p)
    }

    /// Forgets a peer (after a transport failure) if `p` is still its entry.
    pub fn invalidate(&self, peer: &NodeAddr, p: &Arc<PeerState>) {
        let mut map = self.peers.lock().expect("peers lock");
        if map.get(peer).is_some_and(|cur| Arc::ptr_eq(cur, p)) {
            map.remove(peer);
        }
    }

    /// Peers with a completed handshake.
    pub fn handshaken(&self) -> usize {
        self.peers.lock().expect("peers lock").values().filter(|p| p.handshake.initialized()).count()
    }
}

/// Opened peer buffers of one owner, by export (kept across parts and
/// fetches so a handle is opened once per owner incarnation).
#[derive(Default)]
pub(crate) struct Opened {
    map: HashMap<(Vec<u8>, u64, u64), Arc<dyn PeerBuffer>>,
}

/// Most opened peer buffers kept per owner.
const OPENED_MAX: usize = 4096;

impl Opened {
    /// The opened buffer of `e`, opening it with `gpu` if needed.
    ///
    /// # Errors
    /// The backend's refusal.
    pub fn get(&mut self, gpu: &dyn Gpu, e: &BufferExport) -> Result<Arc<dyn PeerBuffer>, GpuError> {
        let key = (e.handle.clone(), e.offset, e.len);
        if let Some(b) = self.map.get(&key) {
            return Ok(b.clone());
        }
        let b = gpu.open_peer_buffer(e)?;
        if self.map.len() >= OPENED_MAX {
            self.map.clear();
        }
        self.map.insert(key, b.clone());
        Ok(b)
    }
}
