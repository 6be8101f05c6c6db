//! Memory types at the bottom of the crate: the pinned pool and its extents
//! ([`pool`]), and the registry of device buffers ([`buffers`]) the GPU
//! backends copy between. `gpu`, `transport` and `engine` all import from
//! here; nothing here imports any of them.

pub mod buffers;
#[cfg(target_os = "linux")]
pub mod memfd;
pub mod pool;

pub use buffers::{BufferError, BufferTable, DeviceBufferId};
