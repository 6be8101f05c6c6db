//! Test support shared by the fuzz bodies' seeded replays (compiled only for
//! tests and fuzzing).
//!
//! One generator ([`splitmix64`], wrapped by [`SplitMix64`]) and one replay
//! of `fuzz/regressions/TARGET/` ([`replay_regressions`]) for every body, so
//! the seeded inputs of `cargo test` and the regression directory a cargo-fuzz
//! target is named after cannot drift apart per module.

use std::path::{Path, PathBuf};

/// splitmix64 (Steele, Lea, Flood 2014): a tiny, well-mixed generator for
/// seeded fuzz inputs (xorshift's low bytes miss multi-byte magics; splitmix
/// does not).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// [`splitmix64`] as a stateful generator with the few helpers the
/// structured seeded replays need (ranges, byte strings).
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        splitmix64(&mut self.0)
    }

    /// A value in `0..n` (0 when `n == 0`); modulo bias is irrelevant here.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// [`SplitMix64::below`] for lengths and indices.
    pub fn below_usize(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).expect("below n fits usize")
    }

    /// `n` random bytes (one draw each: low bytes are as good as high ones).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// Runs `body` over `count` pseudo-random inputs (seeds `0..count`, lengths
/// `0..=max_len`) and then over every file in `fuzz/regressions/TARGET/`, so a
/// crash once minimized and saved there fails plain `cargo test` forever.
pub fn run_fuzz_seeded(target: &str, count: u64, max_len: usize, body: fn(&[u8])) {
    for seed in 0..count {
        let mut st = seed;
        let len = (splitmix64(&mut st) % (max_len as u64 + 1)) as usize;
        let mut buf = Vec::with_capacity(len + 8);
        while buf.len() < len {
            buf.extend_from_slice(&splitmix64(&mut st).to_le_bytes());
        }
        buf.truncate(len);
        body(&buf);
    }
    replay_regressions(target, body);
}

/// The regression inputs of `target`, sorted: every plain file in
/// `fuzz/regressions/TARGET/` except dotfiles (`.gitkeep`) and `README*`.
///
/// # Panics
/// When the directory does not exist: `target` must be the cargo-fuzz target
/// name (`fuzz/fuzz_targets/TARGET.rs`), and a misspelt one would otherwise
/// replay nothing, silently.
pub fn regression_inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions").join(target);
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!("regression dir {} of fuzz target {target:?}: {e} (is the target name right?)", dir.display())
    });
    let mut paths: Vec<PathBuf> = entries
        .map(|e| e.unwrap_or_else(|e| panic!("read {}: {e}", dir.display())).path())
        .filter(|p| p.is_file())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            !name.starts_with('.') && !name.starts_with("README")
        })
        .collect();
    paths.sort();
    paths
}

/// Replays every input of [`regression_inputs`]`(target)` through `body`,
/// naming each on stderr first so a failure says which file broke.
pub fn replay_regressions(target: &str, body: fn(&[u8])) {
    for p in regression_inputs(target) {
        let data = std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        eprintln!("replaying regression {}", p.display());
        body(&data);
    }
}
