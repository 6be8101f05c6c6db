//! The peers this engine fetches from: per owner, its gRPC client, the
//! single-flight handshake and the device buffers this node opened from it
//! (C19). The engine keeps the table; [`super::fetch`] drives it.

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
        let p = Arc::new(PeerState { grpc, handshake: OnceCell::new(), opened: Mutex::default() });
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
