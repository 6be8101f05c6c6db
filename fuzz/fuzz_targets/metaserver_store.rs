//! cargo-fuzz target `metaserver_store`: only calls the library body
//! [`kvferry::metaserver::store::fuzz_store`], whose doc says what it checks.
//! `cargo test` replays the same body from fixed seeds and from every file in
//! `fuzz/regressions/metaserver_store/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry::metaserver::store::fuzz_store(data));
