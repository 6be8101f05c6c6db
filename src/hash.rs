//! The shared block hash (version 1) and layout-family namespaces: one
//! definition every process, machine and language computes identically, so
//! a prefill engine and a decode engine — in Rust, in Python, on two hosts —
//! name the same KV block the same way.
//!
//! # Block hash v1
//!
//! A block is `block_tokens` consecutive token ids of a prompt. Its hash
//! identifies it *given its whole prefix* (a chain, as vLLM's prefix cache
//! and PegaFlow key blocks): block `i` of a prompt is
//!
//! ```text
//! H_i = SHA-256( "kvferry-block-v1"            16 ASCII bytes, no terminator
//!              ‖ u32le(len(namespace)) ‖ namespace (UTF-8)
//!              ‖ H_{i-1}                        32 bytes; 32 zero bytes for i = 0
//!              ‖ u32le(block_tokens)
//!              ‖ u32le(token) for each of the block's token ids )
//! ```
//!
//! Every field has a fixed width or a length prefix, so no two different
//! inputs encode to the same bytes. A partial last block (fewer than
//! `block_tokens` tokens) is never hashed: its KV is not shareable.
//! `docs/block-hash.md` spells out the encoding with test vectors (pinned by
//! this module's tests) and a five-line Python reference.
//!
//! # Namespaces
//!
//! A namespace names one KV layout family: blocks of different namespaces
//! never mix. [`KvFamily::namespace`] derives it from the family's fields as
//! `kvferry1|model=…|dtype=…|bt=…|tp=RANK/SIZE|layers=…`, with `%` and `|`
//! inside the string fields percent-escaped, so field boundaries are never
//! ambiguous.

use sha2::{Digest, Sha256};

use crate::types::{BlockHash, IdError, validate_namespace};

/// Domain tag of block hash version 1 (hashed first).
pub const BLOCK_HASH_V1_TAG: &[u8; 16] = b"kvferry-block-v1";

/// Bytes of a v1 block hash.
pub const BLOCK_HASH_V1_BYTES: usize = 32;

/// Why a hash could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// The namespace is empty or too long.
    #[error(transparent)]
    Namespace(#[from] IdError),
    /// `block_tokens` is 0.
    #[error("block_tokens must be at least 1")]
    ZeroBlockTokens,
    /// A block of the wrong number of tokens.
    #[error("a block has {got} tokens, blocks of this hasher have {block_tokens}")]
    BlockLength {
        /// Tokens given.
        got: usize,
        /// Tokens per block.
        block_tokens: usize,
    },
    /// A parent hash that is not 32 bytes (not a v1 hash).
    #[error("parent hash of {0} bytes (a v1 block hash has 32)")]
    Parent(usize),
    /// A [`KvFamily`] field out of range (the message names it).
    #[error("bad KV family: {0}")]
    Family(String),
}

impl HashError {
    /// The stable code of this error (`docs/design.md`, "Errors").
    pub fn code(&self) -> &'static str {
        match self {
            HashError::Namespace(_) => "hash_namespace",
            HashError::ZeroBlockTokens => "hash_zero_block_tokens",
            HashError::BlockLength { .. } => "hash_block_length",
            HashError::Parent(_) => "hash_parent",
            HashError::Family(_) => "hash_family",
        }
    }
}

/// Computes v1 block hashes for one namespace and block size (module doc).
#[derive(Clone, Debug)]
pub struct BlockHasher {
    /// `u32le(len) ‖ namespace`, the per-namespace part of every input.
    prefix: Vec<u8>,
    block_tokens: usize,
}

impl BlockHasher {
    /// A hasher of `block_tokens`-token blocks in `namespace`.
    ///
    /// # Errors
    /// [`HashError::Namespace`] (empty or over
    /// [`crate::limits::NAMESPACE_BYTES_MAX`] bytes),
    /// [`HashError::ZeroBlockTokens`].
    pub fn new(namespace: &str, block_tokens: usize) -> Result<Self, HashError> {
        validate_namespace(namespace)?;
        if block_tokens == 0 || u32::try_from(block_tokens).is_err() {
            return Err(HashError::ZeroBlockTokens);
        }
        let mut prefix = Vec::with_capacity(4 + namespace.len());
        prefix.extend_from_slice(&(namespace.len() as u32).to_le_bytes());
        prefix.extend_from_slice(namespace.as_bytes());
        Ok(Self { prefix, block_tokens })
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The hash of one block whose prefix ends with `parent` (`None` for the
    /// first block of a prompt).
    ///
    /// # Errors
    /// [`HashError::BlockLength`] unless `tokens.len() == block_tokens`;
    /// [`HashError::Parent`] for a parent that is not 32 bytes.
    pub fn hash_block(&self, parent: Option<&BlockHash>, tokens: &[u32]) -> Result<BlockHash, HashError> {
        if tokens.len() != self.block_tokens {
            return Err(HashError::BlockLength { got: tokens.len(), block_tokens: self.block_tokens });
        }
        let parent = match parent {
            Some(p) if p.as_bytes().len() == BLOCK_HASH_V1_BYTES => p.as_bytes(),
            Some(p) => return Err(HashError::Parent(p.as_bytes().len())),
            None => &[0u8; BLOCK_HASH_V1_BYTES],
        };
        let mut h = Sha256::new();
        h.update(BLOCK_HASH_V1_TAG);
        h.update(&self.prefix);
        h.update(parent);
        h.update((self.block_tokens as u32).to_le_bytes());
        let mut buf = [0u8; 4 * 256];
        for chunk in tokens.chunks(256) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        Ok(BlockHash::new(h.finalize().to_vec()))
    }

    /// The chained hashes of every *full* block of a prompt, in order
    /// (`tokens.len() / block_tokens` of them; a partial tail is skipped).
    pub fn hash_prompt(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / self.block_tokens);
        for block in tokens.chunks_exact(self.block_tokens) {
            let h = self.hash_block(out.last(), block).expect("full block, 32-byte parent");
            out.push(h);
        }
        out
    }
}

/// The chained v1 hashes of every full block of `tokens` (see
/// [`BlockHasher::hash_prompt`]).
///
/// # Errors
/// As [`BlockHasher::new`].
pub fn block_hashes(namespace: &str, tokens: &[u32], block_tokens: usize) -> Result<Vec<BlockHash>, HashError> {
    Ok(BlockHasher::new(namespace, block_tokens)?.hash_prompt(tokens))
}

/// The fields that make a KV layout family: blocks are exchangeable exactly
/// when all of them agree. [`KvFamily::namespace`] names the family.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvFamily {
    /// Model identifier (e.g. `Qwen/Qwen3-8B`, or a checkpoint digest).
    pub model: String,
    /// KV dtype (e.g. `bf16`, `fp8_e4m3`).
    pub dtype: String,
    /// Tokens per block.
    pub block_tokens: u32,
    /// This engine's tensor-parallel rank (its shard of the KV heads).
    pub tp_rank: u32,
    /// Tensor-parallel world size.
    pub tp_size: u32,
    /// Layers in the layout.
    pub layers: u32,
}

impl KvFamily {
    /// The namespace string of this family (module doc):
    /// `kvferry1|model=M|dtype=D|bt=B|tp=R/S|layers=L`, `%` and `|` in `M`
    /// and `D` escaped as `%25` and `%7C`.
    ///
    /// # Errors
    /// [`HashError::Namespace`] when the model name is empty or the result
    /// exceeds [`crate::limits::NAMESPACE_BYTES_MAX`] bytes (a very long
    /// model name); [`HashError::Family`] for an empty dtype, zero block
    /// tokens, layers or TP size, or a TP rank not below the size.
    pub fn namespace(&self) -> Result<String, HashError> {
        fn escape(s: &str) -> String {
            s.replace('%', "%25").replace('|', "%7C")
        }
        if self.model.is_empty() {
            return Err(HashError::Namespace(IdError::Namespace(0)));
        }
        let bad = |what: String| Err(HashError::Family(what));
        if self.dtype.is_empty() {
            return bad("empty dtype".into());
        }
        if self.block_tokens == 0 || self.layers == 0 || self.tp_size == 0 {
            return bad(format!(
                "block_tokens {}, layers {} and tp_size {} must each be at least 1",
                self.block_tokens, self.layers, self.tp_size
            ));
        }
        if self.tp_rank >= self.tp_size {
            return bad(format!("tp_rank {} is not below tp_size {}", self.tp_rank, self.tp_size));
        }
        let ns = format!(
            "kvferry1|model={}|dtype={}|bt={}|tp={}/{}|layers={}",
            escape(&self.model),
            escape(&self.dtype),
            self.block_tokens,
            self.tp_rank,
            self.tp_size,
            self.layers
        );
        validate_namespace(&ns)?;
        Ok(ns)
    }
}

/// The layer count a [`KvFamily::namespace`] string names (`…|layers=N`
/// at its end), `None` for any other namespace.
pub fn namespace_layers(namespace: &str) -> Option<u64> {
    if !namespace.starts_with("kvferry1|") {
        return None;
    }
    namespace.rsplit_once("|layers=")?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(h: &BlockHash) -> String {
        hex::encode(h.as_bytes())
    }

    /// The test vectors of `docs/block-hash.md`: any implementation in any
    /// language must reproduce them.
    #[test]
    fn v1_test_vectors() {
        let ns = "kvferry1|model=test|dtype=bf16|bt=4|tp=0/1|layers=2";
        let hs = block_hashes(ns, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4).unwrap();
        assert_eq!(hs.len(), 2, "the partial third block is not hashed");
        assert_eq!(hex(&hs[0]), VECTOR_0);
        assert_eq!(hex(&hs[1]), VECTOR_1);
        let one = block_hashes("n", &[0], 1).unwrap();
        assert_eq!(hex(&one[0]), VECTOR_2);
    }

    // Computed with the Python reference of docs/block-hash.md (hashlib).
    const VECTOR_0: &str = "726d2da1c87699eef98c012015b957de6bd0c719569154d9e0f6bdbb06c7268d";
    const VECTOR_1: &str = "676bd1a00ff9a69ec88251d1d77766180b56c6538f27fb2c306a1597bc13c9c3";
    const VECTOR_2: &str = "0af1f7381c2ab5e5c01e4f0c2b86bb942a9275c80c161334e34e16bc13ee160c";

    #[test]
    fn hashes_chain_and_depend_on_every_input() {
        let h = BlockHasher::new("ns", 2).unwrap();
        let a = h.hash_prompt(&[1, 2, 3, 4]);
        let b = h.hash_prompt(&[1, 2, 3, 5]);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // The same second block after a different first block differs (chained).
        let c = h.hash_prompt(&[9, 2, 3, 4]);
        assert_ne!(a[1], c[1]);
        assert_eq!(h.hash_block(Some(&a[0]), &[3, 4]).unwrap(), a[1]);
        // Namespace and block size are inputs.
        assert_ne!(BlockHasher::new("nt", 2).unwrap().hash_prompt(&[1, 2])[0], a[0]);
        assert_ne!(BlockHasher::new("ns", 1).unwrap().hash_prompt(&[1])[0], a[0]);
        assert!(a.iter().all(|h| h.as_bytes().len() == BLOCK_HASH_V1_BYTES && h.validate().is_ok()));
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        assert_eq!(BlockHasher::new("", 4).unwrap_err(), HashError::Namespace(IdError::Namespace(0)));
        let long = "x".repeat(crate::limits::NAMESPACE_BYTES_MAX + 1);
        assert!(matches!(BlockHasher::new(&long, 4), Err(HashError::Namespace(_))));
        assert_eq!(BlockHasher::new("ns", 0).unwrap_err(), HashError::ZeroBlockTokens);
        let h = BlockHasher::new("ns", 4).unwrap();
        let e = h.hash_block(None, &[1, 2, 3]).unwrap_err();
        assert_eq!(e, HashError::BlockLength { got: 3, block_tokens: 4 });
        assert_eq!(e.to_string(), "a block has 3 tokens, blocks of this hasher have 4");
        let short = BlockHash::new(vec![0u8; 8]);
        assert_eq!(h.hash_block(Some(&short), &[1, 2, 3, 4]).unwrap_err(), HashError::Parent(8));
        assert!(h.hash_prompt(&[1, 2, 3]).is_empty());
    }

    #[test]
    fn namespaces_have_unambiguous_fields() {
        let f = KvFamily {
            model: "Qwen/Qwen3-8B".into(),
            dtype: "bf16".into(),
            block_tokens: 16,
            tp_rank: 0,
            tp_size: 1,
            layers: 36,
        };
        assert_eq!(f.namespace().unwrap(), "kvferry1|model=Qwen/Qwen3-8B|dtype=bf16|bt=16|tp=0/1|layers=36");
        assert_eq!(namespace_layers(&f.namespace().unwrap()), Some(36));
        assert_eq!(namespace_layers("my-own/ns|layers=3"), None, "only kvferry1 namespaces are read");
        // A separator inside a field cannot forge another field.
        let a = KvFamily { model: "m|dtype=x".into(), dtype: "y".into(), ..f.clone() };
        let b = KvFamily { model: "m".into(), dtype: "x|dtype=y".into(), ..f.clone() };
        assert_ne!(a.namespace().unwrap(), b.namespace().unwrap());
        assert_eq!(a.namespace().unwrap(), "kvferry1|model=m%7Cdtype=x|dtype=y|bt=16|tp=0/1|layers=36");
        let pct = KvFamily { model: "m%7C".into(), ..f.clone() };
        assert_eq!(pct.namespace().unwrap(), "kvferry1|model=m%257C|dtype=bf16|bt=16|tp=0/1|layers=36");
        assert_ne!(KvFamily { tp_rank: 1, tp_size: 2, ..f.clone() }.namespace(), f.namespace());
        assert!(KvFamily { model: "x".repeat(300), ..f.clone() }.namespace().is_err());
        assert!(KvFamily { model: String::new(), ..f.clone() }.namespace().is_err());
        for bad in [
            KvFamily { dtype: String::new(), ..f.clone() },
            KvFamily { block_tokens: 0, ..f.clone() },
            KvFamily { layers: 0, ..f.clone() },
            KvFamily { tp_size: 0, ..f.clone() },
            KvFamily { tp_rank: 2, tp_size: 2, ..f.clone() },
        ] {
            assert!(matches!(bad.namespace(), Err(HashError::Family(_))), "{bad:?}");
        }
        assert_eq!(
            KvFamily { tp_rank: 5, tp_size: 2, ..f }.namespace().unwrap_err().to_string(),
            "bad KV family: tp_rank 5 is not below tp_size 2"
        );
    }
}
