//! `kvferry bench` on tiny sizes: the JSON carries every figure the table
//! prints, and each ratio is the quotient of the rates it names.

// Loopback tests on real tokio; the simulator tier lives in sim/.
#![cfg(not(madsim))]

use std::process::Command;

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn bench_transport_reports_t4_and_both_raw_copies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("t4.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "--json"])
        .arg(&json)
        .args(["transport", "--blocks", "4", "--block-mib", "1"])
        .output()
        .expect("run kvferry");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("T4 = fetch / raw") && text.contains("raw, cache-resident"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(num(&v, "bytes"), (4u64 << 20) as f64);
    let (raw, cached, fetch) =
        (num(&v, "raw_socket_gbps"), num(&v, "raw_socket_cache_resident_gbps"), num(&v, "fetch_gbps"));
    assert!(raw > 0.0 && cached > 0.0 && fetch > 0.0, "{v}");
    let t4 = num(&v, "T4");
    assert!((t4 - fetch / raw).abs() < 1e-9 * t4.max(1.0), "T4 {t4} is fetch {fetch} / raw {raw}");
}
