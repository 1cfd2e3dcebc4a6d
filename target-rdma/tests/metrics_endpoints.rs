//! The real `arenad` binary's metrics listener: `/metrics` passes
//! `promtool check metrics` and counts what clients did, `/ready` is 200
//! once the store is open, and `/diagnostics` leaks no secret, volume name
//! or address from the config; the listener keeps answering `/health`
//! under a slowloris and closes a trickler at its request deadline.

use std::process::{Child, Command};
use std::time::Duration;
use ublk_metrics::testing::{
    addr_after, assert_survives_slowloris, http_get as get,
    promtool_check_metrics as promtool_check, spawn_with_log_lines,
};

use target_rdma::arenad::events as arenad_events;
use target_rdma::client::{ArenaClient, ClientConfig};
use target_rdma::testing::{secret, secret_file};
use ublk_metrics::events;

const SECRET: &str = "arenad-endpoint-test-secret-7f3a9c";
const VOLUME: &str = "vol-endpoint-test";

struct Arenad {
    child: Child,
    metrics: String,
    data: String,
}

impl Drop for Arenad {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_arenad(dir: &std::path::Path) -> Arenad {
    start_arenad_with(dir, "")
}

/// [`start_arenad`] with extra top-level config `keys`.
fn start_arenad_with(dir: &std::path::Path, keys: &str) -> Arenad {
    let key = secret_file(dir, "vol.key", SECRET);
    let cfg = dir.join("arenad.toml");
    std::fs::write(
        &cfg,
        format!(
            "{keys}\nlisten = \"127.0.0.1:0\"\narena_bytes = \"4M\"\nblob_bytes = \"64K\"\n\
             swap_dir = \"{}\"\nswap_bytes = \"16M\"\nmetrics_listen = \"127.0.0.1:0\"\n\
             [[volume]]\nname = \"{VOLUME}\"\nsecret_file = \"{}\"\nquota = \"16M\"\n",
            dir.join("swap").display(),
            key.display()
        ),
    )
    .unwrap();
    let (child, rx) = spawn_with_log_lines(
        Command::new(env!("CARGO_BIN_EXE_arenad"))
            .arg("--config")
            .arg(&cfg)
            .env("RUST_LOG", "info"),
    );
    let (mut metrics, mut data) = (None, None);
    while metrics.is_none() || data.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("arenad logs its listeners (or exited)");
        metrics = metrics.or_else(|| addr_after(&line, events::METRICS_LISTENING));
        data = data.or_else(|| addr_after(&line, arenad_events::ARENAD_READY));
    }
    Arenad {
        child,
        metrics: metrics.unwrap(),
        data: data.unwrap(),
    }
}

#[test]
fn arenad_serves_metrics_readiness_and_redacted_diagnostics() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_arenad(dir.path());

    // Some traffic: inline write, read, flush; and a refused HELLO.
    let cfg = ClientConfig::new(d.data.clone(), VOLUME, secret(SECRET));
    let client = ArenaClient::connect(cfg).expect("client connects");
    futures::executor::block_on(async {
        client.write(3, 0, &[7u8; 4096]).await.unwrap();
        let mut buf = [0u8; 4096];
        assert!(client.read_found(3, 0, &mut buf).await.unwrap());
        client.flush().await.unwrap();
    });
    let bad = ClientConfig::new(d.data.clone(), VOLUME, secret("not-the-secret-0123456789"));
    assert!(ArenaClient::connect(bad).is_err());

    let (code, text) = get(&d.metrics, "/metrics");
    assert_eq!(code, 200);
    promtool_check(&text);
    for want in [
        "arenad_ops_total{op=\"write\",outcome=\"ok\"} 1",
        "arenad_ops_total{op=\"read\",outcome=\"ok\"} 1",
        "arenad_ops_total{op=\"flush\",outcome=\"ok\"} 1",
        "arenad_ops_total{op=\"hello\",outcome=\"ok\"} 1",
        "arenad_auth_failures_total 1",
        "arenad_flush_latency_seconds_count 1",
        // The FLUSH journaled the write: one journal append was timed.
        "arenad_journal_latency_seconds_count 1",
        "arenad_slots{state=\"dirty\"}",
        // The client's session, and the sizes configured above.
        "arenad_sessions 1",
        "arenad_capacity_bytes{tier=\"arena\"} 4194304",
        "arenad_capacity_bytes{tier=\"swap\"} 16777216",
        // The one blob written: one 64K slot.
        "arenad_used_bytes{tier=\"arena\"} 65536",
        "arenad_ready 1",
        "arenad_build_info{version=",
        "process_start_time_seconds ",
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_max_fds ",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }

    let (code, body) = get(&d.metrics, "/ready");
    assert_eq!(
        (code, body.trim()),
        (200, r#"{"ready":true,"reasons":[],"schema_version":1}"#)
    );

    let (code, diag) = get(&d.metrics, "/diagnostics");
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&diag).unwrap();
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["details"]["volumes"], 1);
    assert_eq!(v["details"]["connections"], 1);
    for secret in [SECRET, VOLUME, "127.0.0.1", dir.path().to_str().unwrap()] {
        assert!(
            !diag.contains(secret),
            "/diagnostics leaks {secret:?}: {diag}"
        );
    }
    drop(client);
}

#[test]
fn arenad_health_answers_under_a_slowloris_and_a_trickler_meets_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_arenad_with(dir.path(), "metrics_request_timeout_secs = 2");
    // Otherwise the defaults: 256 connections.
    assert_survives_slowloris(&d.metrics, d.child.id(), "arenad", 256);
}
