//! Test support shared by the fuzz bodies' seeded replays (compiled only for
//! tests and fuzzing).

/// splitmix64: a tiny, well-mixed generator for seeded fuzz inputs (xorshift's
/// low bytes miss multi-byte magics; splitmix does not).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Runs `body` over `count` pseudo-random inputs (seeds `0..count`, lengths
/// `0..max_len`) and then over every file in `fuzz/regressions/TARGET/`, so a
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

/// Replays every file under `fuzz/regressions/TARGET/` through `body`.
pub fn replay_regressions(target: &str, body: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions").join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
    paths.sort();
    for p in paths {
        let data = std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        eprintln!("replaying regression {}", p.display());
        body(&data);
    }
}
