//! Newtype identifiers shared by every component (and [`error_chain`], the
//! one-line text of an error and its causes).
//!
//! Vocabulary follows design.md §1: a *block hash* names a block given its
//! whole prefix, a *namespace* names a KV layout family, a *node* is an
//! advertise address (`ip:port`) and a *session* (`node_id` on the wire) is
//! the per-process id that fences writes of a restarted process.

use std::fmt;

use bytes::Bytes;

use crate::limits;

/// A block hash: opaque bytes (usually 32) identifying a block given its whole
/// prefix (chained). Cheap to clone (`Bytes`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub Bytes);

impl BlockHash {
    /// Wraps bytes without validation; see [`BlockHash::validate`].
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Self(bytes.into())
    }

    /// Builds a 32-byte hash from a `u64` (little-endian, zero padded): the
    /// form the trace replay and the tests use for synthetic chained ids.
    pub fn from_u64(id: u64) -> Self {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&id.to_le_bytes());
        Self(Bytes::copy_from_slice(&b))
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Checks the length is within `1..=limits::BLOCK_HASH_BYTES_MAX`.
    ///
    /// # Errors
    /// [`IdError::HashLength`] with the offending length.
    pub fn validate(&self) -> Result<(), IdError> {
        let n = self.0.len();
        if n == 0 || n > limits::BLOCK_HASH_BYTES_MAX {
            return Err(IdError::HashLength(n));
        }
        Ok(())
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len().min(8);
        write!(f, "BlockHash({}", hex::encode(&self.0[..n]))?;
        if self.0.len() > n {
            write!(f, "…")?;
        }
        write!(f, ")")
    }
}

/// A node's advertise address (`host:port` of its Engine gRPC service).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr(pub String);

impl NodeAddr {
    /// Checks the address is `host:port` with a numeric port and at most
    /// `limits::NODE_ADDR_BYTES_MAX` bytes.
    ///
    /// # Errors
    /// [`IdError::NodeAddr`].
    pub fn parse(s: &str) -> Result<Self, IdError> {
        let bad = || IdError::NodeAddr(s.chars().take(80).collect());
        if s.is_empty() || s.len() > limits::NODE_ADDR_BYTES_MAX {
            return Err(bad());
        }
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad());
        }
        Ok(Self(s.to_string()))
    }

    /// The address as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A node session id (`node_id` on the wire): fences writes of a restarted
/// process. Format: 1..=64 characters of `[A-Za-z0-9_.-]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub String);

impl SessionId {
    /// Validates the wire form.
    ///
    /// # Errors
    /// [`IdError::SessionId`] when empty, longer than
    /// `limits::SESSION_ID_BYTES_MAX` or containing another character.
    pub fn parse(s: &str) -> Result<Self, IdError> {
        let ok = !s.is_empty()
            && s.len() <= limits::SESSION_ID_BYTES_MAX
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
        if ok { Ok(Self(s.to_string())) } else { Err(IdError::SessionId(s.chars().take(80).collect())) }
    }

    /// A fresh random session id (32 hex characters) from the given RNG, so
    /// the simulator's seed fixes it.
    pub fn random(rng: &mut impl rand::RngCore) -> Self {
        let mut b = [0u8; 16];
        rng.fill_bytes(&mut b);
        Self(hex::encode(b))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks a namespace string: 1..=`limits::NAMESPACE_BYTES_MAX` bytes.
///
/// # Errors
/// [`IdError::Namespace`].
pub fn validate_namespace(ns: &str) -> Result<(), IdError> {
    if ns.is_empty() || ns.len() > limits::NAMESPACE_BYTES_MAX {
        return Err(IdError::Namespace(ns.len()));
    }
    Ok(())
}

/// A malformed identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// A block hash of length 0 or over the limit.
    #[error("block hash length {0} not in 1..={max}", max = limits::BLOCK_HASH_BYTES_MAX)]
    HashLength(usize),
    /// A node address that is not `host:port`.
    #[error("malformed node address {0:?} (want host:port)")]
    NodeAddr(String),
    /// A malformed session id.
    #[error("malformed node_id {0:?} (want 1..=64 chars of [A-Za-z0-9_.-])")]
    SessionId(String),
    /// An empty or oversized namespace.
    #[error("namespace length {0} not in 1..={max}", max = limits::NAMESPACE_BYTES_MAX)]
    Namespace(usize),
}

impl IdError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            IdError::HashLength(_) => "id_hash_length",
            IdError::NodeAddr(_) => "id_node_addr",
            IdError::SessionId(_) => "id_session_id",
            IdError::Namespace(_) => "id_namespace",
        }
    }
}

/// `e` and its sources, joined by `": "` (one line for an error whose cause
/// sits several `source()` levels down, e.g. a TLS or verbs setup failure).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_id_rules() {
        assert!(SessionId::parse("abc-12.x_Y").is_ok());
        assert!(matches!(SessionId::parse(""), Err(IdError::SessionId(_))));
        assert!(matches!(SessionId::parse("a b"), Err(IdError::SessionId(_))));
        assert!(SessionId::parse(&"a".repeat(65)).is_err());
    }

    #[test]
    fn node_addr_rules() {
        assert!(NodeAddr::parse("127.0.0.1:80").is_ok());
        assert!(NodeAddr::parse("[::1]:80").is_ok());
        assert!(NodeAddr::parse("127.0.0.1").is_err());
        assert!(NodeAddr::parse(":80").is_err());
        assert!(NodeAddr::parse("h:99999").is_err());
    }

    #[test]
    fn hash_length_rules() {
        assert!(BlockHash::from_u64(7).validate().is_ok());
        assert_eq!(BlockHash::new(Vec::new()).validate(), Err(IdError::HashLength(0)));
        assert_eq!(BlockHash::new(vec![0u8; 65]).validate(), Err(IdError::HashLength(65)));
    }
}
