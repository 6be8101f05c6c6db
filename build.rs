//! Compiles `proto/*.proto` with the vendored protoc (no system protoc needed).
//! madsim-tonic-build writes both the real and the simulated stubs;
//! `tonic::include_proto!` picks the right ones per `cfg(madsim)`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    config.bytes(["."]);
    tonic_build::configure().compile_protos_with_config(
        config,
        &["proto/metaserver.proto", "proto/engine.proto"],
        &["proto"],
    )?;
    println!("cargo:rerun-if-changed=proto");
    // `RUSTFLAGS="--cfg madsim"` reaches rustc but not rustdoc, which
    // compiles this crate again for its doc-tests (and then fails against
    // dependencies built for the simulator). A cfg emitted here reaches
    // both, so the madsim convention `RUSTFLAGS="--cfg madsim" cargo test`
    // runs the doc-tests too, without RUSTDOCFLAGS.
    //
    // `real_os` is every build but the simulator's: it gates only what
    // needs the real OS and tokio to *run*, not to compile — the binary's
    // command line and the test modules that drive real sockets on tokio.
    // Production modules never test either cfg; they read
    // `kvferry::rt::SIMULATED` (src/rt.rs is the one place that knows).
    if std::env::var_os("CARGO_CFG_MADSIM").is_some() {
        println!("cargo:rustc-cfg=madsim");
    } else {
        println!("cargo:rustc-cfg=real_os");
    }
    Ok(())
}
