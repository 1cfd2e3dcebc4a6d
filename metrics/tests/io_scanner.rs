//! Device I/O accounting, trackers and the scanner, on a manual clock.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use ublk_metrics::testing::{capture_json_logs, value};
use ublk_metrics::{
    Daemon, IoMetrics, IoOp, ManualClock, Scanner, ScannerConfig, TableSnapshot, Telemetry,
    TrackerConfig, TrackerError, TrackerTable,
};

fn table(
    clock: &Arc<ManualClock>,
    device: Option<u32>,
    slow: Option<Duration>,
) -> Arc<TrackerTable> {
    let cfg = TrackerConfig {
        target: "arena".into(),
        device,
        queues: 2,
        depth: 4,
        slow_threshold: slow,
    };
    Arc::new(TrackerTable::new(cfg, Some(7), clock.clone()).expect("table"))
}

fn render(t: &Telemetry) -> String {
    t.render().expect("render")
}

#[test]
fn io_counts_bytes_errors_and_buckets_exactly() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let io = IoMetrics::new(&t, "arena", None).unwrap();
    let tab = table(&clock, None, None);

    let g = tab.start(0, 0, IoOp::Read).unwrap();
    clock.advance(Duration::from_micros(40));
    assert_eq!(g.complete(&io, 4096, Ok(())), Duration::from_micros(40));

    let g = tab.start(0, 1, IoOp::Read).unwrap();
    clock.advance(Duration::from_millis(2));
    g.complete(&io, 8192, Ok(()));

    let g = tab.start(1, 3, IoOp::Write).unwrap();
    clock.advance(Duration::from_secs(31));
    g.complete(&io, 512, Err(-5));

    io.record(IoOp::Flush, 0, Err(28), Duration::from_millis(1));
    io.record(IoOp::Discard, 0, Err(-9999), Duration::from_millis(1));

    let m = render(&t);
    let rd = [("target", "arena"), ("op", "read")];
    let wr = [("target", "arena"), ("op", "write")];
    assert_eq!(value(&m, "ublk_io_requests_total", &rd), 2.0);
    assert_eq!(value(&m, "ublk_io_bytes_total", &rd), 12288.0);
    assert_eq!(value(&m, "ublk_io_requests_total", &wr), 1.0);
    assert_eq!(
        value(&m, "ublk_io_bytes_total", &wr),
        0.0,
        "failed requests move no bytes"
    );
    assert_eq!(
        value(
            &m,
            "ublk_io_errors_total",
            &[("target", "arena"), ("op", "write"), ("errno", "eio")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "ublk_io_errors_total",
            &[("target", "arena"), ("op", "flush"), ("errno", "enospc")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "ublk_io_errors_total",
            &[("target", "arena"), ("op", "discard"), ("errno", "other")]
        ),
        1.0
    );
    let b = |le: &str| {
        value(
            &m,
            "ublk_io_latency_seconds_bucket",
            &[("target", "arena"), ("op", "read"), ("le", le)],
        )
    };
    assert_eq!(b("0.000025"), 0.0);
    assert_eq!(b("0.00005"), 1.0);
    assert_eq!(b("0.001"), 1.0);
    assert_eq!(b("0.0025"), 2.0);
    assert_eq!(b("+Inf"), 2.0);
    assert_eq!(value(&m, "ublk_io_latency_seconds_count", &rd), 2.0);
    assert!((value(&m, "ublk_io_latency_seconds_sum", &rd) - 0.00204).abs() < 1e-12);
    let w = |le: &str| {
        value(
            &m,
            "ublk_io_latency_seconds_bucket",
            &[("target", "arena"), ("op", "write"), ("le", le)],
        )
    };
    assert_eq!(w("30"), 0.0, "31 s lands above the last finite bucket");
    assert_eq!(w("+Inf"), 1.0);
    assert!(!m.contains("device="), "no device label by default");
}

#[test]
fn per_device_labels_add_a_device_label() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let io = IoMetrics::new(&t, "arena", Some(3)).unwrap();
    let tab = table(&clock, Some(3), None);
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    tab.start(0, 0, IoOp::Write)
        .unwrap()
        .complete(&io, 1, Ok(()));
    let _g = tab.start(0, 1, IoOp::Read).unwrap();
    scanner.scan();
    let m = render(&t);
    assert_eq!(
        value(
            &m,
            "ublk_io_requests_total",
            &[("target", "arena"), ("op", "write"), ("device", "ublkb3")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "ublk_io_inflight",
            &[("target", "arena"), ("op", "read"), ("device", "ublkb3")]
        ),
        1.0
    );
}

#[test]
fn stall_boundary_is_exactly_the_threshold() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let tab = table(&clock, None, None);
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    let g = tab.start(1, 2, IoOp::Write).unwrap();
    let rd = [("target", "arena"), ("op", "write")];

    clock.advance(Duration::from_millis(29_900));
    let s = scanner.scan();
    assert_eq!((s.inflight, s.stalled), (1, 0));
    let m = render(&t);
    assert_eq!(value(&m, "ublk_io_inflight", &rd), 1.0);
    assert_eq!(value(&m, "ublk_io_stalled", &rd), 0.0);
    assert!(
        (value(
            &m,
            "ublk_io_oldest_inflight_seconds",
            &[("target", "arena")]
        ) - 29.9)
            .abs()
            < 1e-9
    );

    clock.advance(Duration::from_millis(100));
    let s = scanner.scan();
    assert_eq!((s.inflight, s.stalled), (1, 1), "30 s exactly is stalled");
    assert_eq!(s.oldest, Duration::from_secs(30));
    assert_eq!(value(&render(&t), "ublk_io_stalled", &rd), 1.0);

    drop(g);
    let s = scanner.scan();
    assert_eq!((s.inflight, s.stalled), (0, 0));
    let m = render(&t);
    assert_eq!(value(&m, "ublk_io_stalled", &rd), 0.0);
    assert_eq!(
        value(
            &m,
            "ublk_io_oldest_inflight_seconds",
            &[("target", "arena")]
        ),
        0.0
    );
}

#[test]
fn stuck_is_logged_once_per_request_and_slow_on_completion() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let io = IoMetrics::new(&t, "arena", None).unwrap();
    let tab = table(&clock, None, Some(Duration::from_secs(1)));
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);

    let ((first, second, corr), logs) = capture_json_logs(|| {
        let g = tab.start(0, 3, IoOp::Read).unwrap();
        let corr = g.correlation_id();
        clock.advance(Duration::from_secs(30));
        let first = scanner.scan().newly_stuck;
        clock.advance(Duration::from_secs(5));
        let second = scanner.scan().newly_stuck;
        g.complete(&io, 4096, Ok(()));
        // A fast request logs nothing.
        tab.start(0, 3, IoOp::Read)
            .unwrap()
            .complete(&io, 4096, Ok(()));
        (first, second, corr)
    });
    assert_eq!((first, second), (1, 0));
    let events = |name: &str| -> Vec<&serde_json::Value> {
        logs.iter().filter(|r| r["event"] == name).collect()
    };
    let stuck = events(ublk_metrics::events::REQUEST_STUCK);
    assert_eq!(stuck.len(), 1, "{logs:?}");
    assert_eq!(stuck[0]["corr"], corr.get(), "{}", stuck[0]);
    assert_eq!(stuck[0]["op"], "read");
    assert_eq!(stuck[0]["device"], 7);
    assert_eq!(stuck[0]["age_ms"], 30000);
    let slow = events(ublk_metrics::events::REQUEST_SLOW);
    assert_eq!(slow.len(), 1, "{logs:?}");
    assert_eq!(slow[0]["latency_ms"], 35000);
}

#[test]
fn guard_clears_on_completion() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let io = IoMetrics::new(&t, "arena", None).unwrap();
    let tab = table(&clock, None, None);
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    let g = tab.start_shared(0, 0, IoOp::Flush).unwrap();
    assert_eq!(scanner.scan().inflight, 1);
    assert_eq!(
        tab.start(0, 0, IoOp::Read).unwrap_err(),
        TrackerError::SlotBusy { queue: 0, tag: 0 }
    );
    g.complete(&io, 0, Ok(()));
    assert_eq!(scanner.scan().inflight, 0);
    assert!(
        tab.start(0, 0, IoOp::Read).is_ok(),
        "slot reusable after completion"
    );
}

#[test]
fn guard_clears_when_the_future_holding_it_is_cancelled() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let tab = table(&clock, None, None);
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    {
        let tab2 = tab.clone();
        let fut = async move {
            let _guard = tab2.start_shared(1, 1, IoOp::Read).unwrap();
            std::future::pending::<()>().await;
        };
        let mut fut = pin!(fut);
        let mut cx = Context::from_waker(Waker::noop());
        assert_eq!(fut.as_mut().poll(&mut cx), Poll::Pending);
        assert_eq!(scanner.scan().inflight, 1);
        // The future is dropped here without completing.
    }
    assert_eq!(scanner.scan().inflight, 0);
}

#[test]
fn pruning_a_dropped_table_zeroes_its_gauges() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    let tab = table(&clock, Some(9), None);
    scanner.register(&tab);
    let g = tab.start_shared(0, 0, IoOp::Write).unwrap();
    clock.advance(Duration::from_secs(40));
    scanner.scan();
    let l = [("target", "arena"), ("op", "write"), ("device", "ublkb9")];
    assert_eq!(value(&render(&t), "ublk_io_stalled", &l), 1.0);
    // The device goes away with a request still pending: the guard keeps
    // the table alive until it is dropped too.
    drop(tab);
    drop(g);
    let s = scanner.scan();
    assert_eq!(s.pruned, 1);
    let m = render(&t);
    assert_eq!(value(&m, "ublk_io_inflight", &l), 0.0);
    assert_eq!(value(&m, "ublk_io_stalled", &l), 0.0);
    assert_eq!(
        value(
            &m,
            "ublk_io_oldest_inflight_seconds",
            &[("target", "arena"), ("device", "ublkb9")]
        ),
        0.0
    );
    assert_eq!(value(&m, "ublkd_scanner_runs_total", &[]), 2.0);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let clock = Arc::new(ManualClock::new());
    let tab = table(&clock, None, None);
    assert!(matches!(
        tab.start(2, 0, IoOp::Read),
        Err(TrackerError::OutOfRange { .. })
    ));
    assert!(matches!(
        tab.start(0, 4, IoOp::Read),
        Err(TrackerError::OutOfRange { .. })
    ));
    assert!(IoMetrics::new(&t, "Bad Target", None).is_err());
    let cfg = TrackerConfig {
        target: "arena".into(),
        device: None,
        queues: 0,
        depth: 4,
        slow_threshold: None,
    };
    assert!(matches!(
        TrackerTable::new(cfg, None, clock),
        Err(TrackerError::Geometry {
            queues: 0,
            depth: 4
        })
    ));
}

#[test]
fn spawned_scanner_stops_when_dropped() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let scanner = Scanner::new(
        t.clone(),
        ScannerConfig {
            interval: Duration::from_secs(3600),
            stall_threshold: Duration::from_secs(30),
        },
    );
    let th = scanner.spawn().unwrap();
    drop(th); // joins; must not wait for the interval
    assert!(value(&render(&t), "ublkd_scanner_runs_total", &[]) >= 1.0);
}

#[test]
fn a_table_snapshot_counts_inflight_stalled_and_the_oldest() {
    let clock = Arc::new(ManualClock::new());
    let tab = table(&clock, None, None);
    let threshold = Duration::from_secs(30);
    assert_eq!(tab.snapshot(threshold), TableSnapshot::default());
    let old = tab.start(0, 1, IoOp::Read).unwrap();
    clock.advance(Duration::from_millis(29_900));
    let young = tab.start(1, 3, IoOp::Flush).unwrap();
    let s = tab.snapshot(threshold);
    assert_eq!((s.inflight, s.stalled), (2, 0));
    assert_eq!(s.oldest, Duration::from_millis(29_900));
    clock.advance(Duration::from_millis(100));
    let s = tab.snapshot(threshold);
    assert_eq!((s.inflight, s.stalled), (2, 1), "30 s exactly is stalled");
    assert_eq!(s.oldest, Duration::from_secs(30));
    drop(old);
    drop(young);
    assert_eq!(tab.snapshot(threshold), TableSnapshot::default());
}

#[test]
fn a_reused_device_id_starts_its_series_from_zero() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let labels = |op| [("target", "arena"), ("op", op), ("device", "ublkb0")];
    let errors = [
        ("target", "arena"),
        ("op", "write"),
        ("errno", "eio"),
        ("device", "ublkb0"),
    ];
    let old = IoMetrics::new(&t, "arena", Some(0)).unwrap();
    let other = IoMetrics::new(&t, "arena", Some(10)).unwrap();
    old.record(IoOp::Write, 0, Err(5), Duration::from_millis(1));
    old.record(IoOp::Read, 4096, Ok(()), Duration::from_millis(1));
    other.record(IoOp::Read, 4096, Ok(()), Duration::from_millis(1));
    let m = render(&t);
    assert_eq!(value(&m, "ublk_io_errors_total", &errors), 1.0);
    assert_eq!(value(&m, "ublk_io_bytes_total", &labels("read")), 4096.0);

    // Device 0 is deleted; a new device 0 (another volume) comes.
    t.forget_device(0);
    drop(old);
    let new = IoMetrics::new(&t, "arena", Some(0)).unwrap();
    new.record(IoOp::Read, 512, Ok(()), Duration::from_millis(1));
    let m = render(&t);
    assert_eq!(value(&m, "ublk_io_errors_total", &errors), 0.0);
    assert_eq!(value(&m, "ublk_io_bytes_total", &labels("read")), 512.0);
    assert_eq!(value(&m, "ublk_io_requests_total", &labels("write")), 0.0);
    let count = [("target", "arena"), ("op", "read"), ("device", "ublkb0")];
    assert_eq!(value(&m, "ublk_io_latency_seconds_count", &count), 1.0);
    // Device 10 (whose label starts like device 1's) kept its counts.
    let ten = [("target", "arena"), ("op", "read"), ("device", "ublkb10")];
    assert_eq!(value(&m, "ublk_io_bytes_total", &ten), 4096.0);
}
