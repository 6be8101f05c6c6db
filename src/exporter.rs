//! `/health` and Prometheus `/metrics` over HTTP for the binary (the
//! MetaServer and the nodes of `kvferry pd`).
//!
//! The text format comes from the `prometheus-client` crate; the HTTP server
//! is `tiny_http` on its own OS thread (outside the simulator only). Values
//! are read from kvferry's plain atomic counters at scrape time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label pairs of a sample.
type Labels = Vec<(String, String)>;

/// One sample: metric name, help, kind, labels, value.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Metric name (without the `kvferry_` prefix).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Counter (monotonic) or gauge.
    pub counter: bool,
    /// Label pairs.
    pub labels: Vec<(String, String)>,
    /// Value.
    pub value: u64,
}

/// A source of samples, read at every scrape.
pub type Collect = Arc<dyn Fn() -> Vec<Sample> + Send + Sync>;

/// Renders samples in the Prometheus text format.
pub fn render(samples: &[Sample]) -> String {
    let mut reg = Registry::with_prefix("kvferry");
    let mut counters: Vec<(&'static str, Family<Labels, Counter<u64, AtomicU64>>)> = Vec::new();
    let mut gauges: Vec<(&'static str, Family<Labels, Gauge<u64, AtomicU64>>)> = Vec::new();
    for s in samples {
        if s.counter {
            family(&mut reg, &mut counters, s).get_or_create(&s.labels).inc_by(s.value);
        } else {
            family(&mut reg, &mut gauges, s).get_or_create(&s.labels).set(s.value);
        }
    }
    let mut out = String::new();
    let _ = encode(&mut out, &reg);
    out
}

/// The family registered under `s.name` in `known`, registering it in `reg`
/// on first sight.
fn family<M>(reg: &mut Registry, known: &mut Vec<(&'static str, Family<Labels, M>)>, s: &Sample) -> Family<Labels, M>
where
    M: prometheus_client::metrics::TypedMetric
        + prometheus_client::encoding::EncodeMetric
        + Default
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    if let Some((_, f)) = known.iter().find(|(n, _)| *n == s.name) {
        return f.clone();
    }
    let f = Family::default();
    reg.register(s.name, s.help, f.clone());
    known.push((s.name, f.clone()));
    f
}

/// Serves `/health` (200 `ok`) and `/metrics` on `addr` from an OS thread.
/// Binds now, so a taken port is an error before the caller says ready.
///
/// # Errors
/// The bind error as text.
pub fn serve(addr: SocketAddr, collect: Collect) -> Result<SocketAddr, String> {
    let listener = bind(addr)?;
    serve_on(listener, collect)
}

/// Binds the HTTP listener for [`serve_on`] (the CLI binds every listen
/// address it was given before any slow start-up work, so a taken port
/// fails at once).
///
/// # Errors
/// The bind error as text, naming the address.
pub fn bind(addr: SocketAddr) -> Result<std::net::TcpListener, String> {
    std::net::TcpListener::bind(addr).map_err(|e| format!("cannot bind HTTP address {addr}: {e}"))
}

/// [`serve`] on a listener bound already ([`bind`]).
///
/// # Errors
/// The listener's error as text.
pub fn serve_on(listener: std::net::TcpListener, collect: Collect) -> Result<SocketAddr, String> {
    let addr = listener.local_addr().map_err(|e| format!("HTTP listener: {e}"))?;
    let server = tiny_http::Server::from_listener(listener, None).map_err(|e| format!("HTTP address {addr}: {e}"))?;
    let local = server.server_addr().to_ip().unwrap_or(addr);
    std::thread::Builder::new()
        .name("kvferry-http".into())
        .spawn(move || {
            for req in server.incoming_requests() {
                let resp = match req.url() {
                    "/health" => tiny_http::Response::from_string("ok"),
                    "/metrics" => {
                        let body = render(&collect());
                        let ct = tiny_http::Header::from_bytes(
                            &b"Content-Type"[..],
                            &b"application/openmetrics-text; version=1.0.0; charset=utf-8"[..],
                        )
                        .expect("static header");
                        tiny_http::Response::from_string(body).with_header(ct)
                    }
                    _ => tiny_http::Response::from_string("not found").with_status_code(404),
                };
                let _ = req.respond(resp);
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(local)
}

/// Samples of a MetaServer.
pub fn metaserver_samples(h: &crate::metaserver::MetaServerHandle) -> Collect {
    let store = h.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let m = h.metrics.clone();
    let hooks = h.hooks.clone();
    Arc::new(move || {
        let st = crate::metaserver::service::read_store(&store, &m, |st| st.stats()).unwrap_or_default();
        let l = Vec::new;
        let c = |name, help, v: &AtomicU64| Sample {
            name,
            help,
            counter: true,
            labels: l(),
            value: v.load(Ordering::Relaxed),
        };
        vec![
            c("metaserver_heartbeats", "Heartbeats answered", &m.heartbeats),
            c("metaserver_inserted_hashes", "Block ownerships inserted", &m.inserted_hashes),
            c("metaserver_removed_hashes", "Block ownerships removed", &m.removed_hashes),
            c("metaserver_queries", "Prefix queries answered", &m.queries),
            c("metaserver_rejected", "Requests rejected with an error status", &m.rejected),
            c("metaserver_swept_nodes", "Nodes removed by the TTL sweep", &m.swept_nodes),
            c("metaserver_dropped_writes", "Writes dropped by the fault hook", &hooks.dropped_writes),
            c("metaserver_store_panics", "Store operations that panicked (request answered INTERNAL)", &m.store_panics),
            c("metaserver_poison_recoveries", "Poisoned store locks recovered", &m.poison_recoveries),
            c("metaserver_store_resets", "Stores reset to empty after a fault left them inconsistent", &m.store_resets),
            c(
                "metaserver_inserts_refused_no_memory",
                "Hashes an insert could not record: the index could not grow",
                &m.inserts_refused_no_memory,
            ),
            Sample { name: "metaserver_nodes", help: "Node records", counter: false, labels: l(), value: st.nodes },
            Sample {
                name: "metaserver_hashes",
                help: "Distinct block hashes",
                counter: false,
                labels: l(),
                value: st.hashes,
            },
            Sample {
                name: "metaserver_owner_entries",
                help: "Owner entries",
                counter: false,
                labels: l(),
                value: st.owner_entries,
            },
        ]
    })
}

/// Samples of an engine, labelled with its node address.
pub fn engine_samples(engine: &crate::engine::Engine) -> Vec<Sample> {
    let node = engine.node().to_string();
    let l = || vec![("node".to_string(), node.clone())];
    let m = engine.metrics();
    let q = engine.client().counters();
    let g = engine.gauges();
    let c =
        |name, help, v: &AtomicU64| Sample { name, help, counter: true, labels: l(), value: v.load(Ordering::Relaxed) };
    let cv = |name, help, value| Sample { name, help, counter: true, labels: l(), value };
    let gv = |name, help, value| Sample { name, help, counter: false, labels: l(), value };
    vec![
        c("engine_saves", "save calls", &m.saves),
        c("engine_saved_blocks", "Blocks sealed by saves", &m.saved_blocks),
        c("engine_loaded_blocks", "Blocks loaded to the device", &m.loaded_blocks),
        c("engine_load_failures", "Blocks that failed to load", &m.load_failures),
        c("engine_evicted_blocks", "Blocks evicted under pressure", &m.evicted),
        c("engine_removals_enqueued", "Removals enqueued for evictions", &m.removals_enqueued),
        c("engine_removals_dropped_at_enqueue", "Removals dropped at a full queue", &m.removals_dropped_at_enqueue),
        c("engine_fetched_blocks", "Blocks fetched from peers", &m.fetched_blocks),
        c("engine_fetched_bytes", "Bytes fetched from peers", &m.fetched_bytes),
        c("engine_checksum_failures", "Fetched blocks rejected by checksum", &m.checksum_failures),
        c("engine_transfer_locks_created", "Transfer sessions created", &m.transfer_locks_created),
        c("engine_transfer_locks_expired", "Transfer sessions expired by the GC", &m.transfer_locks_expired),
        cv("registrations_offered", "Registration commands offered", q.offered),
        cv("registrations_delivered", "Registration commands delivered", q.delivered),
        cv("registrations_dropped", "Registration commands dropped", q.dropped()),
        gv("registrations_pending", "Registration commands pending", q.pending),
        gv("pool_used_bytes", "Pinned pool bytes in use", g.pool_used_bytes),
        gv("pool_free_bytes", "Pinned pool bytes free", g.pool_free_bytes),
        gv("resident_blocks", "Sealed blocks resident", g.resident_blocks),
        gv("transfer_locks_active", "Live transfer sessions", g.active_transfer_locks),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_registers_each_family_once_with_every_label_set() {
        let l = |n: &str| vec![("node".to_string(), n.to_string())];
        let samples = vec![
            Sample { name: "saves", help: "save calls", counter: true, labels: l("a"), value: 3 },
            Sample { name: "saves", help: "save calls", counter: true, labels: l("b"), value: 5 },
            Sample { name: "pool_used_bytes", help: "pool bytes", counter: false, labels: l("a"), value: 42 },
        ];
        let text = render(&samples);
        assert_eq!(text.matches("# TYPE kvferry_saves counter").count(), 1, "{text}");
        assert!(text.contains("kvferry_saves_total{node=\"a\"} 3"), "{text}");
        assert!(text.contains("kvferry_saves_total{node=\"b\"} 5"), "{text}");
        assert!(text.contains("# TYPE kvferry_pool_used_bytes gauge"), "{text}");
        assert!(text.contains("kvferry_pool_used_bytes{node=\"a\"} 42"), "{text}");
    }
}
