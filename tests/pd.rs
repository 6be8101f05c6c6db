//! The main job end to end: `kvferry pd` on a small window of the bundled
//! trace, with and without faults, and its bad-input errors.

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(not(madsim))]

use std::process::Command;

fn kvferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("report.json");
    let out = kvferry()
        .args([
            "pd",
            "--quiet",
            "--model",
            "tiny",
            "--block-tokens",
            "64",
            "--max-blocks",
            "12",
            "--pool-size",
            "64MiB",
        ])
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kvferry");
    assert!(
        out.status.success(),
        "kvferry pd failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).expect("report written")).expect("report is JSON")
}

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("report lacks numeric key {key}: {v}"))
}

#[test]
fn small_replay_verifies_every_block_and_stays_under_the_oracle() {
    let r = run_json(&["--requests", "300"]);
    for key in [
        "requests",
        "blocks_total",
        "blocks_verified",
        "blocks_fetched",
        "blocks_recomputed",
        "bytes_transferred",
        "prefix_hit_rate",
        "oracle_hit_rate",
        "handoff_p50_ms",
        "handoff_p99_ms",
        "wall_s",
    ] {
        assert!(r.get(key).is_some(), "missing key {key}");
    }
    assert_eq!(num(&r, "requests"), 300.0);
    assert!(num(&r, "blocks_total") > 0.0);
    assert_eq!(num(&r, "blocks_verified"), num(&r, "blocks_total"), "every block verified");
    assert!(num(&r, "blocks_fetched") > 0.0, "decode fetched from prefill");
    assert!(num(&r, "bytes_transferred") > 0.0);
    assert!(
        num(&r, "prefix_hit_rate") <= num(&r, "oracle_hit_rate") + 1e-9,
        "hit rate above the infinite-cache oracle: {r}"
    );
    assert!(num(&r, "oracle_hit_rate") > 0.0);
}

#[test]
fn replay_with_faults_still_verifies_everything_and_recomputes() {
    let r = run_json(&["--requests", "300", "--kill-metaserver-at", "0.5", "--drop-registrations", "0.1"]);
    assert_eq!(num(&r, "blocks_verified"), num(&r, "blocks_total"), "every block verified under faults");
    assert!(num(&r, "blocks_recomputed") > 0.0, "faults must force some recomputation: {r}");
    let faults = r["faults"].as_array().expect("faults list");
    assert!(faults.iter().any(|f| f.as_str().unwrap_or("").contains("metaserver killed")), "{faults:?}");
}

#[test]
fn replay_survives_a_killed_prefill_node() {
    let r = run_json(&["--requests", "120", "--kill-prefill-at", "0.5"]);
    assert_eq!(num(&r, "blocks_verified"), num(&r, "blocks_total"));
    let faults = r["faults"].as_array().expect("faults list");
    assert!(faults.iter().any(|f| f.as_str().unwrap_or("").contains("prefill node 0 killed")));
}

fn fails_with(args: &[&str], needle: &str) {
    let out = kvferry().args(args).output().expect("run kvferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure for {args:?}");
    assert!(err.contains(needle), "stderr for {args:?} lacks {needle:?}: {err}");
}

#[test]
fn bad_inputs_give_clear_errors() {
    fails_with(&["pd", "--quiet", "--trace", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl");
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [0, 1]}\n{not json\n",
    )
    .expect("write");
    fails_with(&["pd", "--quiet", "--trace", bad.to_str().expect("utf8 path")], "line 2");
    fails_with(&["pd", "--quiet", "--prefill", "0"], "at least one prefill");
    fails_with(&["pd", "--quiet", "--decode", "0"], "at least one prefill and one decode");
    fails_with(&["pd", "--quiet", "--pool-size", "1KiB"], "smaller than one block");
    fails_with(&["pd", "--quiet", "--model", "gpt-9"], "gpt-9");
    fails_with(&["pd", "--quiet", "--block-tokens", "100"], "100");
}

#[test]
fn metaserver_port_taken_is_a_clear_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    fails_with(&["metaserver", "--addr", &addr], "cannot bind");
}
