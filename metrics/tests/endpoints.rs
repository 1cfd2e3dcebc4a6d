//! The HTTP endpoints on a real socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use ublk_metrics::testing::http_get as get;
use ublk_metrics::testing::value;
use ublk_metrics::{
    Daemon, HttpConfig, MetricsServer, NotReadyReason, NotReadySet, Probes, Telemetry,
};

/// ublkd-style probes: one device whose peer connection the test toggles.
struct Daemonish {
    peer_up: AtomicBool,
}

const SECRET: &str = "hunter2-volume-key";

impl Probes for Daemonish {
    fn check_ready(&self, failing: &mut NotReadySet) {
        if !self.peer_up.load(Ordering::Acquire) {
            failing.insert(NotReadyReason::PeerDisconnected);
        }
    }
    fn diagnostics(&self) -> serde_json::Value {
        serde_json::json!({
            "devices": [{"id": 0, "state": "running", "queues": 2, "depth": 128,
                         "peer": if self.peer_up.load(Ordering::Acquire) { "connected" } else { "disconnected" }}],
        })
    }
}

#[test]
fn endpoints_answer_and_ready_follows_the_peer() {
    let t = Telemetry::isolated(Daemon::Ublkd, "9.9.9");
    let server =
        MetricsServer::start("127.0.0.1:0", t.clone(), HttpConfig::default()).expect("start");
    let addr = server.local_addr();

    assert_eq!(get(addr, "/health"), (200, "ok\n".to_string()));
    let (s, live) = get(addr, "/live");
    assert_eq!(s, 200);
    assert!(live.contains("\"live\":true"));

    // No probes yet: still starting.
    let (s, body) = get(addr, "/ready");
    assert_eq!(s, 503);
    assert!(body.contains("\"starting\""), "{body}");

    let probes = Arc::new(Daemonish {
        peer_up: AtomicBool::new(false),
    });
    t.set_probes(probes.clone());
    let (s, body) = get(addr, "/ready");
    assert_eq!(s, 503);
    assert!(
        body.contains("\"reasons\":[\"peer_disconnected\"]"),
        "{body}"
    );

    let (s, metrics) = get(addr, "/metrics");
    assert_eq!(s, 200);
    assert_eq!(value(&metrics, "ublkd_ready", &[]), 0.0);
    assert_eq!(
        value(
            &metrics,
            "ublkd_not_ready",
            &[("reason", "peer_disconnected")]
        ),
        1.0
    );
    assert_eq!(value(&metrics, "ublkd_metrics_http_server_up", &[]), 1.0);
    assert_eq!(
        value(
            &metrics,
            "ublkd_build_info",
            &[("version", "9.9.9"), ("revision", ublk_metrics::REVISION)]
        ),
        1.0
    );
    // Built from this git checkout: its commit, not "unknown".
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    if let (Some(head), Err(_)) = (head, std::env::var("UBLK_GIT_REVISION")) {
        assert_eq!(
            ublk_metrics::REVISION,
            head,
            "rebuilt since the last commit?"
        );
    }

    probes.peer_up.store(true, Ordering::Release);
    let (s, body) = get(addr, "/ready");
    assert_eq!(s, 200, "{body}");
    assert!(body.contains("\"ready\":true"));

    let (s, diag) = get(addr, "/diagnostics");
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&diag).expect("json");
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["details"]["devices"][0]["peer"], "connected");
    assert!(!diag.contains(SECRET));

    t.begin_shutdown();
    let (s, body) = get(addr, "/ready");
    assert_eq!(s, 503);
    assert!(body.contains("shutting_down"));

    assert_eq!(get(addr, "/nope").0, 404);
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 405"));

    drop(server);
    let m = t.render().unwrap();
    assert_eq!(value(&m, "ublkd_metrics_http_server_up", &[]), 0.0);
}

#[test]
fn oversized_requests_are_refused() {
    let t = Telemetry::isolated(Daemon::Arenad, "1");
    let cfg = HttpConfig {
        max_request_bytes: 64,
        ..HttpConfig::default()
    };
    let server = MetricsServer::start("127.0.0.1:0", t, cfg).unwrap();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    let _ = write!(
        s,
        "GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(500)
    );
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
}

#[test]
fn bind_failure_is_reported_and_counted() {
    let t = Telemetry::isolated(Daemon::Ublkd, "1");
    let first = MetricsServer::start("127.0.0.1:0", t.clone(), HttpConfig::default()).unwrap();
    let taken = first.local_addr().to_string();
    let err = MetricsServer::start(&taken, t.clone(), HttpConfig::default()).unwrap_err();
    assert!(err.to_string().contains(&taken), "{err}");
    let m = t.render().unwrap();
    assert_eq!(
        value(&m, "ublkd_metrics_http_start_failures_total", &[]),
        1.0
    );
}

/// A collector stuck the way one waiting on a lock of a wedged daemon
/// would be, until the test lets it go.
struct Stuck(std::sync::Mutex<std::sync::mpsc::Receiver<()>>);

impl ublk_metrics::Collector for Stuck {
    fn collect(&self) {
        let _ = self.0.lock().unwrap().recv();
    }
}

#[test]
fn a_stuck_render_holds_up_neither_health_nor_the_listener() {
    let t = Telemetry::isolated(Daemon::Arenad, "1");
    let (release, stuck) = std::sync::mpsc::channel();
    let collector = Arc::new(Stuck(std::sync::Mutex::new(stuck)));
    t.register_collector(&collector);
    let server = MetricsServer::start("127.0.0.1:0", t.clone(), HttpConfig::default()).unwrap();
    let addr = server.local_addr();
    // Two scrapes occupy both render workers, forever for all they know.
    let scrapes: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(move || get(addr, "/metrics")))
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    for _ in 0..10 {
        assert_eq!(get(addr, "/health"), (200, "ok\n".to_string()));
        let (code, body) = get(addr, "/live");
        assert_eq!(code, 200, "{body}");
    }
    // Release both renders: the stuck scrapes get their answers.
    for _ in 0..2 {
        release.send(()).unwrap();
    }
    for s in scrapes {
        assert_eq!(s.join().unwrap().0, 200);
    }
}
