//! TLS for the MetaServer's gRPC (cargo feature `tls`): the server presents
//! a certificate ([`TlsIdentity`]), clients verify it against the CA
//! certificates they are given ([`TlsTrust`]). Off by default: without the
//! feature (and always in the simulator) the types still exist, so
//! configurations stay the same shape, but a configuration that asks for
//! TLS fails at start with [`TlsError::NotBuilt`] instead of silently
//! talking plain text.
//!
//! What it gives: confidentiality and server authentication (a client only
//! talks to a server whose certificate chains to its CA). It does not
//! authenticate clients: anyone who can reach the port can still register
//! nodes; restrict who can reach it.

use std::path::Path;

/// A server's certificate chain and private key, both PEM (the key as
/// PKCS#8, PKCS#1 or SEC1).
#[derive(Clone)]
pub struct TlsIdentity {
    /// Certificate chain, leaf first, PEM.
    pub cert_pem: Vec<u8>,
    /// Private key of the leaf certificate, PEM.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("TlsIdentity").field("cert_pem_bytes", &self.cert_pem.len()).finish_non_exhaustive()
    }
}

impl TlsIdentity {
    /// Reads the certificate chain and key from PEM files.
    ///
    /// # Errors
    /// [`TlsError::Read`] naming the file that could not be read.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Ok(Self { cert_pem: read(cert)?, key_pem: read(key)? })
    }
}

/// The CA certificate(s), PEM, a client trusts to sign the server's
/// certificate. The name checked against the certificate is the host of
/// the address the client dials (a DNS name or an IP address).
#[derive(Clone, Debug)]
pub struct TlsTrust {
    /// One or more CA certificates, PEM.
    pub ca_pem: Vec<u8>,
}

impl TlsTrust {
    /// Reads the CA certificate(s) from a PEM file.
    ///
    /// # Errors
    /// [`TlsError::Read`] naming the file that could not be read.
    pub fn from_file(ca: &Path) -> Result<Self, TlsError> {
        Ok(Self { ca_pem: read(ca)? })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.display().to_string(), source })
}

/// Whether this build can speak TLS (feature `tls`, outside the simulator).
pub const AVAILABLE: bool = cfg!(feature = "tls");

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// An `https://` MetaServer address without a CA to trust
    /// (`ClientConfig::tls` / `NodeConfig::metaserver_tls`).
    #[error("{addr:?} asks for TLS but no CA to trust was given (ClientConfig::tls / NodeConfig::metaserver_tls)")]
    NoTrust {
        /// The address given.
        addr: String,
    },
    /// A certificate or key file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// TLS was asked for, but this build has no TLS.
    #[error("TLS was asked for but kvferry was built without it (build with `--features tls`)")]
    NotBuilt,
    /// The certificate, key or CA was refused (bad PEM, a key that does not
    /// match, an unsupported algorithm).
    #[error("bad TLS configuration: {0}")]
    Config(String),
}

impl TlsError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            TlsError::NoTrust { .. } => "tls_no_trust",
            TlsError::Read { .. } => "tls_read",
            TlsError::NotBuilt => "tls_not_built",
            TlsError::Config(_) => "tls_config",
        }
    }
}

/// Applies `identity` to a server builder.
///
/// # Errors
/// [`TlsError::Config`] for a certificate or key that cannot be used.
#[cfg(feature = "tls")]
pub(crate) fn server(
    builder: tonic::transport::Server,
    identity: &TlsIdentity,
) -> Result<tonic::transport::Server, TlsError> {
    use tonic::transport::{Identity, ServerTlsConfig};
    let id = Identity::from_pem(&identity.cert_pem, &identity.key_pem);
    builder.tls_config(ServerTlsConfig::new().identity(id)).map_err(|e| TlsError::Config(crate::types::error_chain(&e)))
}

/// A lazily connecting TLS channel to `addr` (`host:port` or `https://…`)
/// trusting `trust`, with the same deadlines and windows as
/// [`crate::rt::channel`].
///
/// # Errors
/// [`TlsError::Config`] for a malformed address or CA.
#[cfg(feature = "tls")]
pub(crate) fn channel(
    addr: &str,
    timeout: std::time::Duration,
    trust: &TlsTrust,
) -> Result<tonic::transport::Channel, TlsError> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let uri = match addr.strip_prefix("http://") {
        Some(rest) => format!("https://{rest}"),
        None if addr.starts_with("https://") => addr.to_string(),
        None => format!("https://{addr}"),
    };
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&trust.ca_pem));
    let ep = Endpoint::from_shared(uri)
        .and_then(|e| e.tls_config(tls))
        .map_err(|e| TlsError::Config(crate::types::error_chain(&e)))?;
    Ok(ep
        .timeout(timeout)
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(crate::limits::GRPC_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(crate::limits::GRPC_CONNECTION_WINDOW_BYTES)
        .connect_lazy())
}

/// [`server`] in a build without TLS.
///
/// # Errors
/// Always [`TlsError::NotBuilt`].
#[cfg(not(feature = "tls"))]
pub(crate) fn server(
    _builder: tonic::transport::Server,
    _identity: &TlsIdentity,
) -> Result<tonic::transport::Server, TlsError> {
    Err(TlsError::NotBuilt)
}

/// [`channel`] in a build without TLS.
///
/// # Errors
/// Always [`TlsError::NotBuilt`].
#[cfg(not(feature = "tls"))]
pub(crate) fn channel(
    _addr: &str,
    _timeout: std::time::Duration,
    _trust: &TlsTrust,
) -> Result<tonic::transport::Channel, TlsError> {
    Err(TlsError::NotBuilt)
}

/// The refusal of an `https://` address given no CA to trust:
/// [`TlsError::NoTrust`] where this build has TLS, else
/// [`TlsError::NotBuilt`] (the address asks for what the build lacks).
pub(crate) fn no_trust(addr: &str) -> TlsError {
    if cfg!(feature = "tls") { TlsError::NoTrust { addr: addr.to_string() } } else { TlsError::NotBuilt }
}
