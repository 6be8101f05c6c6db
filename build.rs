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
    Ok(())
}
