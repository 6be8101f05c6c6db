//! cargo-fuzz target `tcp_frame`: only calls the library body
//! [`kvferry::transport::frame::fuzz_frame_decode`], whose doc says what it checks.
//! `cargo test` replays the same body from fixed seeds and from every file in
//! `fuzz/regressions/tcp_frame/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry::transport::frame::fuzz_frame_decode(data));
