//! The `kvferry` binary. Its command line lives in `cli.rs`; in the
//! simulator's build (`--cfg madsim`, where build.rs sets no `real_os`) the
//! binary is an empty shell, because cargo builds every binary for
//! integration tests and the CLI uses real OS facilities (signals, an HTTP
//! exporter thread, a progress bar).

#[cfg(real_os)]
mod cli;

#[cfg(real_os)]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(not(real_os))]
fn main() {
    eprintln!("kvferry: this build is for the simulator (--cfg madsim); build without it to run the CLI");
}
