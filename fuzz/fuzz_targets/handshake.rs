//! cargo-fuzz target `handshake`: only calls the library body
//! [`kvferry::transport::handshake::fuzz_handshake_decode`], whose doc says what it checks.
//! `cargo test` replays the same body from fixed seeds and from every file in
//! `fuzz/regressions/handshake/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry::transport::handshake::fuzz_handshake_decode(data));
