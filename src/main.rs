//! The `kvferry` binary. Its command line lives in `cli.rs`; under the
//! simulator (`--cfg madsim`) the binary is an empty shell, because cargo
//! builds every binary for integration tests and the CLI uses real OS
//! facilities (signals, an HTTP exporter thread, a progress bar).

#[cfg(not(madsim))]
mod cli;

#[cfg(not(madsim))]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(madsim)]
fn main() {
    eprintln!("kvferry: this build is for the simulator (--cfg madsim); build without it to run the CLI");
}
