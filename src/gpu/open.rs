//! The backend registry: every GPU backend by name, in every build. The
//! backends a build was compiled without are still named here and answer
//! [`OpenError::NotBuilt`], so callers (the binary, the Python binding, an
//! embedder's own configuration) open a backend from a string and read the
//! same whatever features they were built with; `cfg(feature = "cuda")`
//! appears here and on the `cuda` module only.

use std::sync::Arc;

use super::{Gpu, GpuError};

/// The backends this crate knows, by the name [`open`] takes.
pub const BACKENDS: [&str; 2] = ["host", "cuda"];

/// Why [`open`] or [`device_count`] answered no backend.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// `name` is not one of [`BACKENDS`].
    #[error("unknown gpu backend {0:?} (known: {known})", known = BACKENDS.join(", "))]
    Unknown(String),
    /// The backend exists but this build was compiled without it.
    #[error("this build has no `{backend}` backend: it was compiled without the `{feature}` feature")]
    NotBuilt {
        /// The backend asked for (`cuda`).
        backend: &'static str,
        /// The cargo feature that builds it.
        feature: &'static str,
    },
    /// The backend is built but could not open device `device` (no driver,
    /// no such device, a failed context or kernel compile).
    #[error("{backend} device {device}: {source}")]
    Device {
        /// The backend asked for.
        backend: &'static str,
        /// The device ordinal asked for.
        device: usize,
        /// The backend's own error.
        #[source]
        source: GpuError,
    },
    /// The backend is built but its driver could not list devices (not
    /// loaded, failed to initialise).
    #[error("{backend} driver: {source}")]
    Driver {
        /// The backend asked for.
        backend: &'static str,
        /// The backend's own error.
        #[source]
        source: GpuError,
    },
}

impl OpenError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            OpenError::Unknown(_) => "gpu_open_unknown",
            OpenError::NotBuilt { .. } => "gpu_open_not_built",
            OpenError::Device { .. } => "gpu_open_device",
            OpenError::Driver { .. } => "gpu_open_driver",
        }
    }
}

/// Whether this build contains backend `name` (`host` always; `cuda` with
/// feature `cuda`). An unknown name is not built.
pub fn built(name: &str) -> bool {
    name == "host" || (name == "cuda" && cfg!(feature = "cuda"))
}

/// Opens backend `name` on device ordinal `device` (`host` has one device
/// and ignores the ordinal).
///
/// # Errors
/// [`OpenError::Unknown`], [`OpenError::NotBuilt`], or
/// [`OpenError::Device`] with the backend's error.
pub fn open(name: &str, device: usize) -> Result<Arc<dyn Gpu>, OpenError> {
    match name {
        "host" => Ok(Arc::new(super::host::HostGpu::new())),
        "cuda" => open_cuda(device),
        other => Err(OpenError::Unknown(other.to_string())),
    }
}

/// Devices backend `name` can open: 1 for `host`; the devices the CUDA
/// driver lists for `cuda`.
///
/// # Errors
/// [`OpenError::Unknown`], [`OpenError::NotBuilt`], or
/// [`OpenError::Driver`] when the driver cannot list its devices.
pub fn device_count(name: &str) -> Result<usize, OpenError> {
    match name {
        "host" => Ok(1),
        "cuda" => cuda_device_count(),
        other => Err(OpenError::Unknown(other.to_string())),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(device: usize) -> Result<Arc<dyn Gpu>, OpenError> {
    super::cuda::CudaGpu::new(device).map(|g| Arc::new(g) as Arc<dyn Gpu>).map_err(|source| OpenError::Device {
        backend: "cuda",
        device,
        source,
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_device: usize) -> Result<Arc<dyn Gpu>, OpenError> {
    Err(OpenError::NotBuilt { backend: "cuda", feature: "cuda" })
}

#[cfg(feature = "cuda")]
fn cuda_device_count() -> Result<usize, OpenError> {
    super::cuda::device_count().map_err(|source| OpenError::Driver { backend: "cuda", source })
}

#[cfg(not(feature = "cuda"))]
fn cuda_device_count() -> Result<usize, OpenError> {
    Err(OpenError::NotBuilt { backend: "cuda", feature: "cuda" })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name resolves to a backend, a "not built" refusal that names
    /// its feature, or an "unknown" refusal — never a panic; the host
    /// backend always opens and copies.
    #[test]
    fn every_name_opens_or_says_why() {
        let host = open("host", 7).expect("host always opens");
        assert_eq!(host.name(), "host");
        assert_eq!(device_count("host").unwrap(), 1);
        assert!(built("host"));
        match open("cuda", 0) {
            Err(e @ OpenError::NotBuilt { .. }) => {
                assert!(!built("cuda"));
                assert_eq!(e.code(), "gpu_open_not_built");
                assert!(e.to_string().contains("`cuda` feature"), "{e}");
            }
            // A cuda build: opens where a device is, else says why.
            Ok(g) => assert_eq!(g.name(), "cuda"),
            Err(e) => assert!(built("cuda") && e.code() == "gpu_open_device", "{e}"),
        }
        match device_count("cuda") {
            Err(e @ OpenError::NotBuilt { .. }) => assert!(!built("cuda"), "{e}"),
            Ok(_) => assert!(built("cuda")),
            Err(e) => assert!(built("cuda") && e.code() == "gpu_open_driver", "{e}"),
        }
        for bad in ["", "Host", "rocm"] {
            let e = open(bad, 0).err().expect("unknown name");
            assert_eq!(e.code(), "gpu_open_unknown");
            assert!(e.to_string().contains("known: host, cuda"), "{e}");
            assert!(matches!(device_count(bad), Err(OpenError::Unknown(_))));
            assert!(!built(bad));
        }
    }
}
