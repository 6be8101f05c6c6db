//! cargo-fuzz target `registration_queue`: only calls the library body
//! [`kvferry::client::queue::fuzz_registration_queue`], whose doc says what it checks.
//! `cargo test` replays the same body from fixed seeds and from every file in
//! `fuzz/regressions/registration_queue/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry::client::queue::fuzz_registration_queue(data));
