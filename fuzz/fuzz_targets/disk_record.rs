//! cargo-fuzz target `disk_record`: only calls the library body
//! [`kvferry::disk::format::fuzz_record_decode`], whose doc says what it checks.
//! `cargo test` replays the same body from fixed seeds and from every file in
//! `fuzz/regressions/disk_record/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry::disk::format::fuzz_record_decode(data));
