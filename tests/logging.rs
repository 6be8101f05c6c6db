//! C12 embedding: `kvferry::logging::init` in a host that already installed
//! its own global subscriber never panics, leaves the host's subscriber in
//! place, and the host receives both its own events and kvferry's.
//!
//! One test per process on purpose: the global default can be set only once.

// Loopback tests on real tokio and tonic; the simulator tier lives in sim/.
#![cfg(real_os)]

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use kvferry::logging::{InitOutcome, init};
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};

type Log = Arc<Mutex<Vec<String>>>;

/// The host's layer: records `target: message k=v…` for every event.
struct Record(Log);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Record {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut f = Fields(format!("{}:", event.metadata().target()));
        event.record(&mut f);
        self.0.lock().unwrap().push(f.0);
    }
}

fn has(log: &Log, needle: &str) -> bool {
    log.lock().unwrap().iter().any(|l| l.contains(needle))
}

#[test]
fn init_with_host_subscriber_is_already_set_and_host_keeps_receiving() {
    let log: Log = Arc::default();
    let host = tracing_subscriber::registry().with(Record(log.clone()));
    tracing::subscriber::set_global_default(host).expect("host installs its subscriber first");

    tracing::info!("host event before init");
    assert!(has(&log, "host event before init"), "host layer records events: {:?}", log.lock().unwrap());

    // Twice, and once with a nonsense filter: never a panic, never a replacement.
    assert_eq!(init("info"), InitOutcome::AlreadySet);
    assert_eq!(init("info"), InitOutcome::AlreadySet);
    assert_eq!(init("not a [valid filter"), InitOutcome::AlreadySet);

    tracing::info!(marker = 42, "host event after init");
    assert!(has(&log, "host event after init marker=42"), "{:?}", log.lock().unwrap());

    // An event from inside kvferry reaches the host's layer too.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let addr = rt.block_on(async {
        let h = kvferry::metaserver::start(kvferry::metaserver::MetaServerConfig::new("127.0.0.1:0".parse().unwrap()))
            .await
            .expect("metaserver starts");
        let addr = h.local_addr;
        h.shutdown().await.expect("clean shutdown");
        addr
    });
    let lines = log.lock().unwrap().clone();
    let ours: Vec<&String> = lines.iter().filter(|l| l.starts_with("kvferry")).collect();
    assert!(
        ours.iter().any(|l| l.contains("metaserver listening") && l.contains(&addr.to_string())),
        "kvferry's event did not reach the host: {lines:?}"
    );
}
