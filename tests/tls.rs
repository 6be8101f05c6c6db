//! TLS for the MetaServer (feature `tls`): a client that trusts the CA
//! talks to a TLS server; a plain-text client and a client trusting another
//! CA are refused; a bad key fails at start. Without the feature, asking
//! for TLS is a clear start-up error on both sides. Certificates:
//! tests/data/tls (made by its make.sh).
#![cfg(real_os)]

use std::path::PathBuf;
use std::time::Duration;

use kvferry::client::{ClientConfig, ClientError, MetaServerClient};
use kvferry::metaserver::{self, MetaServerConfig};
use kvferry::tls::{TlsError, TlsIdentity, TlsTrust};
use kvferry::types::{NodeAddr, SessionId};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tls").join(name)
}

fn identity() -> TlsIdentity {
    TlsIdentity::from_files(&data("server.pem"), &data("server.key")).expect("test certificate")
}

fn tls_server_config() -> MetaServerConfig {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.tls = Some(identity());
    cfg
}

fn client(addr: String, tls: Option<TlsTrust>, i: u32) -> Result<MetaServerClient, ClientError> {
    let node = NodeAddr::parse(&format!("10.0.0.{i}:7000")).unwrap();
    let mut cfg = ClientConfig::new(addr, node, SessionId::parse(&format!("tls-{i}")).unwrap());
    cfg.rpc_timeout = Duration::from_secs(5);
    cfg.tls = tls;
    MetaServerClient::start(cfg)
}

#[cfg(feature = "tls")]
mod with_tls {
    use kvferry::types::BlockHash;

    use super::*;

    /// The full path over TLS: a client trusting the CA registers a block
    /// and a query (by the host name the certificate names) finds it.
    #[tokio::test]
    async fn a_client_trusting_the_ca_talks_to_a_tls_server() {
        trusted_client_round_trip(tls_server_config()).await;
    }

    /// The same over the server's own I/O threads (TLS is set up on the
    /// thread a connection is handed to).
    #[tokio::test]
    async fn a_client_trusting_the_ca_talks_to_a_tls_server_on_io_threads() {
        let mut cfg = tls_server_config();
        cfg.io_threads = 2;
        trusted_client_round_trip(cfg).await;
    }

    async fn trusted_client_round_trip(cfg: MetaServerConfig) {
        let h = metaserver::start(cfg).await.expect("tls server starts");
        let addr = format!("localhost:{}", h.local_addr.port());
        let trust = TlsTrust::from_file(&data("ca.pem")).unwrap();
        let c = client(addr, Some(trust), 1).expect("client");
        let hashes = [BlockHash::from_u64(1), BlockHash::from_u64(2)];
        assert_eq!(c.try_register("ns", &hashes), 2);
        let report = c.flush().await;
        assert!(report.delivered > 0 && report.dropped == 0 && !report.timed_out, "{report:?}");
        let got = c.query_prefix("ns", &hashes, Duration::from_secs(5)).await.expect("query over TLS");
        assert_eq!(got, vec![(c.node().clone(), 2)]);
        c.shutdown(Duration::from_secs(2)).await;
        h.shutdown().await.unwrap();
    }

    /// A plain-text client and a client trusting another CA get an error,
    /// never an answer; the latter's names the certificate.
    #[tokio::test]
    async fn plain_text_and_untrusting_clients_are_refused() {
        let h = metaserver::start(tls_server_config()).await.expect("tls server starts");
        let addr = format!("localhost:{}", h.local_addr.port());
        let hashes = [BlockHash::from_u64(1)];
        let plain = client(addr.clone(), None, 2).unwrap();
        let e = plain.query_prefix("ns", &hashes, Duration::from_secs(5)).await.expect_err("plain text refused");
        assert!(matches!(e, ClientError::Rpc(_) | ClientError::Timeout(_)), "{e}");
        let other = TlsTrust::from_file(&data("other-ca.pem")).unwrap();
        let wrong = client(addr, Some(other), 3).unwrap();
        let e = wrong.query_prefix("ns", &hashes, Duration::from_secs(5)).await.expect_err("unknown CA refused");
        let text = format!("{e} {e:?}").to_lowercase();
        assert!(text.contains("certificate") || text.contains("unknownissuer"), "{text}");
        plain.abort();
        wrong.abort();
        h.shutdown().await.unwrap();
    }

    /// A key that is not PEM fails at start with a TLS error.
    #[tokio::test]
    async fn a_bad_key_fails_at_start() {
        let mut cfg = tls_server_config();
        cfg.tls = Some(TlsIdentity { cert_pem: identity().cert_pem, key_pem: b"not a key".to_vec() });
        let e = metaserver::start(cfg).await.err().expect("start refused");
        assert!(matches!(e, metaserver::service::StartError::Tls(TlsError::Config(_))), "{e}");
    }
}

/// Without the feature, TLS asked for is refused at start on both sides,
/// never served or sent as plain text.
#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn without_the_feature_tls_is_refused_at_start() {
    let e = metaserver::start(tls_server_config()).await.err().expect("start refused");
    assert!(matches!(e, metaserver::service::StartError::Tls(TlsError::NotBuilt)), "{e}");
    assert!(e.to_string().contains("--features tls"), "{e}");
    let trust = TlsTrust::from_file(&data("ca.pem")).unwrap();
    let e = client("127.0.0.1:9".into(), Some(trust), 4).expect_err("client refused");
    assert!(matches!(e, ClientError::Tls(TlsError::NotBuilt)), "{e}");
    // An https:// address asks for TLS too: refused, never dialled in plain text.
    let e = client("https://127.0.0.1:9".into(), None, 4).expect_err("client refused");
    assert!(matches!(e, ClientError::Tls(TlsError::NotBuilt)), "{e}");
}

/// With the feature, an https:// address without a CA to trust is refused
/// at start (it would otherwise be dialled without the server checked).
#[cfg(feature = "tls")]
#[tokio::test]
async fn https_without_a_ca_is_refused_at_start() {
    let e = client("https://127.0.0.1:9".into(), None, 4).expect_err("client refused");
    assert!(matches!(e, ClientError::Tls(TlsError::NoTrust { .. })), "{e}");
}

/// A missing certificate file is named in the error.
#[test]
fn a_missing_file_is_named() {
    let e = TlsIdentity::from_files(&data("nope.pem"), &data("server.key")).unwrap_err();
    assert!(e.to_string().contains("nope.pem"), "{e}");
}
