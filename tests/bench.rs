//! `kvferry bench` on tiny sizes: the JSON carries every figure the table
//! prints, and each ratio is the quotient of the rates it names.

// Loopback tests on real tokio; the simulator tier lives in sim/.
#![cfg(real_os)]

use std::process::Command;

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn bench_transport_reports_t4_against_the_best_raw_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("t4.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "--json"])
        .arg(&json)
        .args(["transport", "--blocks", "4", "--block-mib", "1", "--connections", "1,2,2"])
        .output()
        .expect("run kvferry");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("T4 = fetch (default pool) / best raw copy") && text.contains("<- best"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(num(&v, "bytes"), (4u64 << 20) as f64);
    // Every raw count was tried, and the baseline is the fastest of them.
    let raw_runs = v["raw_by_connections"].as_array().expect("raw_by_connections");
    let counts: Vec<f64> = raw_runs.iter().map(|r| num(r, "connections")).collect();
    assert_eq!(counts, vec![1.0, 2.0, 4.0, 8.0, 16.0], "{v}");
    let raw = num(&v, "raw_gbps");
    let fastest = raw_runs.iter().map(|r| num(r, "gbps")).fold(0.0, f64::max);
    assert_eq!(raw, fastest, "{v}");
    let winner = raw_runs.iter().find(|r| num(r, "gbps") == fastest).expect("a winner");
    assert_eq!(num(&v, "raw_connections"), num(winner, "connections"));
    // The fetch was timed with each pool asked for (once) plus the default one.
    let pools: Vec<f64> = v["fetch_by_connections"]
        .as_array()
        .expect("fetch_by_connections")
        .iter()
        .map(|r| num(r, "connections"))
        .collect();
    assert_eq!(pools, vec![1.0, 2.0, num(&v, "connections")], "{v}");
    let fetch = num(&v, "fetch_gbps");
    assert!(raw > 0.0 && fetch > 0.0, "{v}");
    let t4 = num(&v, "T4");
    assert!((t4 - fetch / raw).abs() < 1e-9 * t4.max(1.0), "T4 {t4} is fetch {fetch} / raw {raw}");
    // The shared-pool fetch against the best memcpy, side by side.
    let (shm, mem) = (num(&v, "shm_fetch_gbps"), num(&v, "memcpy_gbps"));
    assert!(shm > 0.0 && mem > 0.0, "{v}");
    let r = num(&v, "shm_fetch_ratio");
    assert!((r - shm / mem).abs() < 1e-9 * r.max(1.0), "{v}");
}

#[test]
fn bench_transport_refuses_out_of_range_sizes_naming_the_flag() {
    for (flag, bad) in [("--connections", "0"), ("--connections", "17"), ("--blocks", "0"), ("--block-mib", "0")] {
        let mut args = vec!["bench", "transport"];
        for (f, v) in [("--blocks", "1"), ("--block-mib", "1")] {
            if f != flag {
                args.extend([f, v]);
            }
        }
        args.extend([flag, bad]);
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry")).args(&args).output().expect("run kvferry");
        assert!(!out.status.success(), "{flag} {bad} was accepted");
        assert!(String::from_utf8_lossy(&out.stderr).contains(flag), "{out:?}");
    }
}

/// `bench ssd` removes the tier file (and lock file) it made, a zero
/// `--block` is refused naming `--block`, not `--slots`, and a directory
/// that already holds a tier file is refused, the file untouched.
#[test]
fn bench_ssd_cleans_up_and_names_a_zero_block() {
    let dir = tempfile::Builder::new().prefix(".bench-ssd-test-").tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let d = dir.path().to_str().expect("utf8 path");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "ssd", "--dir", d, "--size", "4MiB", "--block", "64KiB", "--slots", "4", "--reps", "1"])
        .output()
        .expect("run kvferry");
    assert!(out.status.success(), "{out:?}");
    let left: Vec<_> =
        std::fs::read_dir(dir.path()).expect("read dir").map(|e| e.expect("entry").file_name()).collect();
    assert!(left.is_empty(), "bench ssd left {left:?} behind");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "ssd", "--dir", d, "--size", "4MiB", "--block", "0"])
        .output()
        .expect("run kvferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--block") && !err.contains("--slots"), "{err}");
    let left = std::fs::read_dir(dir.path()).expect("read dir").count();
    assert_eq!(left, 0, "a failed bench ssd left files behind");
    // A directory that holds a node's tier is refused and left as it was.
    let tier = dir.path().join("kvferry-tier.0");
    std::fs::write(&tier, b"a node's records").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "ssd", "--dir", d, "--size", "4MiB", "--block", "64KiB", "--slots", "4", "--reps", "1"])
        .output()
        .expect("run kvferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("already holds a disk tier"), "{err}");
    assert_eq!(std::fs::read(&tier).expect("read"), b"a node's records", "the tier file is untouched");
}

/// `bench rpc` times every round trip it names, and each `x_raw` is that
/// kind's p50 over the raw ping-pong's p50 of the same run.
#[test]
fn bench_rpc_reports_each_round_trip_against_the_raw_ping_pong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("rpc.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "--json"])
        .arg(&json)
        .args(["rpc", "--blocks", "8", "--calls", "100"])
        .output()
        .expect("run kvferry");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((num(&v, "blocks"), num(&v, "calls")), (8.0, 100.0), "{v}");
    let raw = num(&v["raw"], "p50_us");
    for kind in ["raw", "health", "query", "lock", "barrier"] {
        let (p50, p99) = (num(&v[kind], "p50_us"), num(&v[kind], "p99_us"));
        assert!(p50 > 0.0 && p99 >= p50, "{kind}: {v}");
        let x = num(&v[kind], "x_raw");
        assert!((x - p50 / raw).abs() < 1e-9 * x.max(1.0), "{kind}: x_raw {x} is not {p50} / {raw}");
        assert!(text.lines().any(|l| l.trim_start().starts_with(&format!("{kind} "))), "no {kind} line in {text}");
    }
    for (flag, bad) in [("--blocks", "0"), ("--blocks", "1025"), ("--calls", "99")] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry")).args(["bench", "rpc", flag, bad]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag} {bad} was accepted");
        assert!(String::from_utf8_lossy(&out.stderr).contains(flag), "{out:?}");
    }
}
