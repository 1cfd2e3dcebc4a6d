//! ublkd's metrics listener, without the ublk kernel module:
//!
//! - the real `ublkd` binary with its control socket and metrics listener
//!   and no devices: `/metrics` passes `promtool check metrics`, `/ready`
//!   is 200, `ublkctl stats` answers; `/health` keeps answering under a
//!   slowloris and a trickler is closed at its request deadline;
//! - the device side in process, against a real (in-process) arena server:
//!   I/O through the queue's `serve` is counted and passes promtool, `/ready`
//!   goes 503 `peer_disconnected` when the peer stops and back to 200 when
//!   it returns, `/diagnostics` leaks no secret, volume or address, and the
//!   driver summary shows the TCP data path and its RDMA warning;
//! - with tracing and `/metrics/openmetrics` on, a request over a real arena
//!   connection is an exemplar whose trace id names its spans in the log,
//!   and the connection's TCP_INFO reaches the `ublk_tcp_*` gauges.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use ublk_metrics::testing::{
    assert_survives_slowloris, capture_json_logs, http_get_typed, parse_openmetrics, sample,
};

use common::ublkd::Ublkd;
use ublk_metrics::events;
use ublk_metrics::testing::{http_get as get, promtool_check_metrics as promtool_check};

use libublk::sys;
use target_rdma::block::ArenaTarget;
use target_rdma::client::{ArenaClient, ClientConfig, Session};
use target_rdma::testing::{secret, Peer, PeerOpts};
use ublk_metrics::{summarize, Daemon, HttpConfig, MetricsServer, Telemetry};
use ublkd::config::{MetricsConfig, TracingConfig, TransportChoice};
use ublkd::device::check_peer;
use ublkd::io::{serve, IoDesc};
use ublkd::observability::{DevState, DeviceObs, DeviceShape, Observability};
use ublkd::queue_io::negotiated;
use ublkd::queue_io::{QueueIo, TagBuffers};

const SECRET: &str = "ublkd-endpoint-test-secret-41c2e8";
const VOLUME: &str = "vol-ublkd-endpoint";

#[test]
fn the_ublkd_binary_serves_metrics_and_readiness_without_devices() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ublkd.sock");
    let daemon = Ublkd::start(dir.path(), "");
    let metrics = daemon.metrics.clone();

    // Ready only where devices can be added: with the ublk driver loaded.
    // This host (and CI's container) has none; the VM suite has it.
    let driver = std::path::Path::new(ublkd::device::UBLK_CONTROL).exists();
    let (code, body) = get(&metrics, "/ready");
    let (want_code, want_body, want_ready) = if driver {
        (
            200,
            r#"{"ready":true,"reasons":[],"schema_version":1}"#,
            "ublkd_ready 1",
        )
    } else {
        (
            503,
            r#"{"ready":false,"reasons":["ublk_driver_missing"],"schema_version":1}"#,
            "ublkd_ready 0",
        )
    };
    assert_eq!((code, body.trim()), (want_code, want_body));
    let (code, text) = get(&metrics, "/metrics");
    assert_eq!(code, 200);
    promtool_check(&text);
    for want in [
        want_ready,
        "ublkd_metrics_http_server_up 1",
        "ublkd_build_info{version=",
        "process_start_time_seconds ",
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_max_fds ",
        "ublkd_scanner_runs_total",
        "ublk_requests_started_total{op=\"read\",transport=\"tcp\"} 0",
        "ublk_driver_reporting 0",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    let (code, diag) = get(&metrics, "/diagnostics");
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&diag).unwrap();
    assert_eq!(v["details"]["control_socket"], "up");
    assert_eq!(v["details"]["devices"], serde_json::json!([]));

    let out = Command::new(env!("CARGO_BIN_EXE_ublkctl"))
        .arg("--socket")
        .arg(&sock)
        .arg("stats")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    // ublkctl finds the socket from $UBLKCTL_SOCKET, or from ublkd's
    // config, without --socket; `del --all` of no devices is a success.
    let ctl = |args: &[&str], env: Option<&std::path::Path>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ublkctl"));
        c.args(args).env_remove("UBLKCTL_SOCKET");
        if let Some(e) = env {
            c.env("UBLKCTL_SOCKET", e);
        }
        c.output().unwrap()
    };
    let cfg = dir.path().join("ublkd.toml");
    let cfg_arg = cfg.to_str().unwrap();
    for out in [
        ctl(&["list"], Some(&sock)),
        ctl(&["--config", cfg_arg, "list"], None),
        ctl(&["--config", cfg_arg, "del", "--all"], None),
    ] {
        assert!(out.status.success(), "{out:?}");
    }
    let out = ctl(&["--config", "/nonexistent.toml", "list"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/run/ublkd/ublkd.sock does not exist"),
        "{err}"
    );
    // The add flags parse (a refusal from ublkd, not a clap panic).
    let out = ctl(
        &[
            "--config",
            cfg_arg,
            "add",
            "-n",
            "7",
            "--read-only",
            "--cpus",
            "0,2-3",
            "--peer",
            "127.0.0.1:1",
            "--volume",
            "v",
            "--secret-file",
            "/x",
            "--size",
            "4M",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("ublkctl: "),
        "{out:?}"
    );
    let out = ctl(&["--version"], None);
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("ublkctl "),
        "{out:?}"
    );
    // `features` asks the driver, not ublkd.
    let out = ctl(&["--socket", "/nonexistent.sock", "features"], None);
    if std::path::Path::new(ublkd::device::UBLK_CONTROL).exists() {
        assert!(out.status.success(), "{out:?}");
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("ublk driver is not loaded"), "{err}");
    }
    drop(daemon);
}

/// Runs the peer monitor's check of `io` until `/ready` answers `want`.
fn ready_becomes(dev: &DeviceObs, io: &QueueIo, metrics: &str, want: u16) -> String {
    loop {
        check_peer(dev, std::slice::from_ref(io));
        let (code, body) = get(metrics, "/ready");
        if code == want {
            return body;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn desc(op: u32, sector: u64, sectors: u32) -> IoDesc {
    IoDesc {
        op_flags: op,
        start_sector: sector,
        nr_sectors: sectors,
    }
}

#[test]
fn ublkd_health_answers_under_a_slowloris_and_a_trickler_meets_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let extra = "max_connections = 64\nrequest_timeout_secs = 2\n";
    let daemon = Ublkd::start(dir.path(), extra);
    assert_survives_slowloris(&daemon.metrics, daemon.pid(), "ublkd", 64);
}

#[test]
fn readiness_follows_the_peer_and_diagnostics_stay_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let mut peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 4 << 20,
            swap_bytes: 16 << 20,
            quota_blobs: 256,
            max_inflight: 32,
            volumes: vec![(VOLUME.into(), SECRET.into())],
            ..PeerOpts::default()
        },
    );
    let tel = Telemetry::isolated(Daemon::Ublkd, "test");
    let obs = Observability::new(
        Arc::clone(&tel),
        &MetricsConfig::default(),
        &TracingConfig::default(),
    );
    let http =
        MetricsServer::start("127.0.0.1:0", Arc::clone(&tel), HttpConfig::default()).unwrap();
    let metrics = http.local_addr().to_string();

    // Not ready until the control socket is up.
    let (code, body) = get(&metrics, "/ready");
    assert_eq!(code, 503);
    assert!(body.contains("control_socket_down"), "{body}");
    obs.set_control_socket_up(true);

    let cc = ClientConfig::new(peer.addr.to_string(), VOLUME, secret(SECRET));
    let payload = Arc::clone(&cc.stats);
    let client = ArenaClient::connect(cc).expect("connect to the peer");
    let io = QueueIo::single(Session::Tcp(client), Arc::new(TagBuffers::new(4, 64 << 10)));
    let dev = obs
        .register(
            DeviceShape {
                id: 5,
                queues: 1,
                depth: 4,
                // Set to RDMA while its session serves TCP: the driver
                // summary must warn.
                transport: TransportChoice::Rdma,
            },
            DevState::Starting,
            Arc::default(),
            negotiated(std::slice::from_ref(&io)),
            payload,
        )
        .unwrap();
    let (code, body) = get(&metrics, "/ready");
    assert_eq!(code, 503);
    assert!(body.contains("device_not_running"), "{body}");
    dev.set_state(DevState::Live);
    assert_eq!(get(&metrics, "/ready").0, 200);

    // I/O as a queue thread serves it.
    let target = ArenaTarget::new(io.session(), 64 << 20);
    let mut buf = vec![0x5au8; 64 << 10];
    futures::executor::block_on(async {
        let w = desc(sys::UBLK_IO_OP_WRITE, 0, 16);
        assert_eq!(serve(&target, &w, &mut buf, &dev, 0, 0).await, 8192);
        let r = desc(sys::UBLK_IO_OP_READ, 0, 16);
        assert_eq!(serve(&target, &r, &mut buf, &dev, 0, 1).await, 8192);
        let f = desc(sys::UBLK_IO_OP_FLUSH, u64::MAX, 0);
        assert_eq!(serve(&target, &f, &mut buf, &dev, 0, 2).await, 0);
    });
    // `ublkctl stats` gets this device's own latency per op (whatever
    // per_device_labels says): one write, one read, one flush, each with
    // a p99 no smaller than its p50.
    let snap = dev.stats().snapshot();
    for (i, op) in ublk_metrics::IoOp::ALL.iter().enumerate() {
        let h = &snap.latency[i];
        let want = u64::from(matches!(
            op,
            ublk_metrics::IoOp::Read | ublk_metrics::IoOp::Write | ublk_metrics::IoOp::Flush
        ));
        assert_eq!(h.count(), want, "{op:?}");
        if want == 1 {
            assert!(h.quantile(0.5).unwrap() <= h.quantile(0.99).unwrap());
        }
    }
    obs.scanner().scan();
    let (_, text) = get(&metrics, "/metrics");
    promtool_check(&text);
    for want in [
        "ublk_io_requests_total{target=\"arena\",op=\"write\"} 1",
        "ublk_io_requests_total{target=\"arena\",op=\"read\"} 1",
        "ublk_io_requests_total{target=\"arena\",op=\"flush\"} 1",
        "ublk_io_bytes_total{target=\"arena\",op=\"write\"} 8192",
        "ublk_io_inflight{target=\"arena\",op=\"read\"} 0",
        "ublk_driver_tcp_payload_requests_total{driver=\"tcp\",reason=\"configured_tcp\"}",
        "ublk_driver_reporting 1",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    let summary = summarize(&obs.driver_reports(Some(5)));
    assert!(
        summary.contains(
            "ublkb5: TCP data path - Write: 0 transfers over RDMA, 1 payload requests over TCP"
        ),
        "{summary}"
    );
    assert!(
        summary.contains("ublkb5: warning: configured for RDMA but moved no payload over RDMA"),
        "{summary}"
    );

    // The peer goes away: not ready, peer_disconnected.
    peer.pause();
    let body = ready_becomes(&dev, &io, &metrics, 503);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["reasons"], serde_json::json!(["peer_disconnected"]));
    let (_, diag) = get(&metrics, "/diagnostics");
    let d: serde_json::Value = serde_json::from_str(&diag).unwrap();
    assert_eq!(d["details"]["devices"][0]["peer_connected"], false);
    assert_eq!(d["details"]["devices"][0]["state"], "live");
    assert_eq!(d["details"]["devices"][0]["queue_depth"], 4);
    let addr = peer.addr.to_string();
    for secret in [SECRET, VOLUME, addr.as_str(), "127.0.0.1"] {
        assert!(
            !diag.contains(secret),
            "/diagnostics leaks {secret:?}: {diag}"
        );
    }

    // It comes back: the monitor reconnects the idle device, ready again.
    peer.resume();
    let body = ready_becomes(&dev, &io, &metrics, 200);
    assert!(body.contains("\"ready\":true"), "{body}");

    // Removing the device prunes it: gone from readiness and diagnostics.
    drop(io);
    obs.unregister(5);
    drop(dev);
    obs.scanner().scan();
    let (_, diag) = get(&metrics, "/diagnostics");
    assert!(diag.contains("\"devices\":[]"), "{diag}");
    let (_, text) = get(&metrics, "/metrics");
    assert!(text.contains("ublk_driver_reporting 0"), "{text}");
    assert!(
        text.contains(
            "ublk_driver_tcp_payload_requests_total{driver=\"tcp\",reason=\"configured_tcp\"} 2"
        ),
        "removed devices' counts stay: {text}"
    );
}

#[test]
fn a_traced_request_is_the_exemplar_and_its_connection_reports_tcp_info() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            volumes: vec![(VOLUME.into(), SECRET.into())],
            ..PeerOpts::default()
        },
    );
    let tel = Telemetry::isolated(Daemon::Ublkd, "test");
    let metrics_cfg = MetricsConfig {
        openmetrics: true,
        ..MetricsConfig::default()
    };
    // Every request head-sampled.
    let tracing_cfg = TracingConfig {
        enabled: true,
        sample_rate_ppm: 1_000_000,
    };
    let obs = Observability::new(Arc::clone(&tel), &metrics_cfg, &tracing_cfg);
    let http =
        MetricsServer::start("127.0.0.1:0", Arc::clone(&tel), HttpConfig::default()).unwrap();
    let metrics = http.local_addr().to_string();
    let mut cc = ClientConfig::new(peer.addr.to_string(), VOLUME, secret(SECRET));
    cc.tcp_links = Arc::clone(obs.tcp_links());
    let stats = Arc::clone(&cc.stats);
    let io = QueueIo::single(
        Session::Tcp(ArenaClient::connect(cc).unwrap()),
        Arc::new(TagBuffers::new(4, 64 << 10)),
    );
    let dev = obs
        .register(
            DeviceShape {
                id: 0,
                queues: 1,
                depth: 4,
                transport: TransportChoice::Tcp,
            },
            DevState::Live,
            Arc::default(),
            negotiated(std::slice::from_ref(&io)),
            stats,
        )
        .unwrap();
    let target = ArenaTarget::new(io.session(), 64 << 20);
    let mut buf = vec![0x3cu8; 64 << 10];
    let (read, logs) = capture_json_logs(|| {
        futures::executor::block_on(async {
            let w = desc(sys::UBLK_IO_OP_WRITE, 0, 8);
            assert_eq!(serve(&target, &w, &mut buf, &dev, 0, 0).await, 4096);
            let r = desc(sys::UBLK_IO_OP_READ, 0, 8);
            serve(&target, &r, &mut buf, &dev, 0, 1).await
        })
    });
    assert_eq!(read, 4096);

    let (code, content_type, om) = http_get_typed(&metrics, "/metrics/openmetrics");
    assert_eq!(code, 200);
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(om.ends_with("# EOF\n"));
    let parsed = parse_openmetrics(&om);
    let exemplar = parsed
        .lines()
        .find(|l| {
            l.starts_with("histogram ublk_io_latency_seconds_bucket ")
                && l.contains(r#""op":"read""#)
                && !l.ends_with(" - -")
        })
        .unwrap_or_else(|| panic!("no exemplar on the read latency:\n{parsed}"));
    let trace_id = exemplar.split(' ').nth_back(1).unwrap();
    let spans: Vec<&str> = logs
        .iter()
        .filter(|r| r["trace_id"] == trace_id)
        .map(|r| r["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        spans,
        [events::SPAN_REQUEST, events::SPAN_ATTEMPT],
        "{logs:#?}"
    );
    let root = logs.iter().find(|r| r["trace_id"] == trace_id).unwrap();
    assert_eq!(
        (&root["op"], &root["retention"]),
        (
            &serde_json::json!("read"),
            &serde_json::json!("head_sampled")
        )
    );
    assert!(parsed.lines().any(|l| {
        l.starts_with("histogram ublk_attempt_latency_seconds_bucket ")
            && l.contains(r#""transport":"tcp""#)
            && l.contains(trace_id)
    }));

    // The Prometheus text has the same samples, no exemplars, and the TCP
    // connection's kernel view.
    let (_, text) = get(&metrics, "/metrics");
    promtool_check(&text);
    assert!(!text.contains("trace_id"));
    assert_eq!(sample(&text, "ublk_tcp_connections", &[]), 1.0);
    assert!(
        sample(&text, "ublk_tcp_rtt_max_seconds", &[]) > 0.0,
        "{text}"
    );
    assert!(sample(&text, "ublk_tcp_cwnd_min_segments", &[]) > 0.0);
    assert_eq!(sample(&text, "ublk_tcp_retransmissions_total", &[]), 0.0);
}
