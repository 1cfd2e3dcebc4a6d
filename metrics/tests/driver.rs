//! Driver statistics: aggregation, monotonicity, partial, summary.

use parking_lot::Mutex;
use std::borrow::Cow;
use std::sync::Arc;
use ublk_metrics::driver::{names, CounterValue, GaugeValue, RailValue};
use ublk_metrics::testing::{exact_sample as sample, value};
use ublk_metrics::{
    summarize, Daemon, DeviceDriverReport, DriverSnapshot, DriverStats, DriverStatsRegistry, IoOp,
    Telemetry, Transport,
};

struct Fake(Mutex<DriverSnapshot>);

impl Fake {
    fn new(driver: &'static str) -> Arc<Fake> {
        Arc::new(Fake(Mutex::new(DriverSnapshot {
            driver: Cow::Borrowed(driver),
            counters: Vec::new(),
            gauges: Vec::new(),
            rails: Vec::new(),
        })))
    }
    fn set(&self, name: &'static str, op: Option<IoOp>, reason: Option<&'static str>, v: u64) {
        let mut s = self.0.lock();
        s.counters
            .retain(|c| !(c.name == name && c.op == op && c.reason.as_deref() == reason));
        s.counters.push(CounterValue {
            name: Cow::Borrowed(name),
            op,
            reason: reason.map(Cow::Borrowed),
            value: v,
        });
    }
    fn gauge(&self, name: &'static str, v: f64) {
        let mut s = self.0.lock();
        s.gauges.retain(|g| g.name != name);
        s.gauges.push(GaugeValue {
            name: Cow::Borrowed(name),
            value: v,
        });
    }
}

impl DriverStats for Fake {
    fn snapshot(&self) -> DriverSnapshot {
        self.0.lock().clone()
    }
}

#[test]
fn sums_devices_and_never_goes_backwards() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let reg = DriverStatsRegistry::new(&t);
    let a = Fake::new("rdma");
    let b = Fake::new("rdma");
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 10);
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Write), None, 5);
    b.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 7);
    b.set(
        names::TCP_PAYLOAD_REQUESTS,
        Some(IoOp::Read),
        Some("too_large"),
        2,
    );
    a.gauge(names::BUFFER_POOL_FREE, 3.0);
    b.gauge(names::BUFFER_POOL_FREE, 4.0);
    reg.add_device(0, Transport::Rdma, a.clone());
    reg.add_device(1, Transport::Rdma, b.clone());

    let m = t.render().unwrap();
    let rdma = [("driver", "rdma")];
    assert_eq!(value(&m, "ublk_driver_rdma_transferred_total", &rdma), 22.0);
    assert_eq!(
        value(
            &m,
            "ublk_driver_tcp_payload_requests_total",
            &[("driver", "rdma"), ("reason", "too_large")]
        ),
        2.0
    );
    assert_eq!(value(&m, "ublk_driver_buffer_pool_free", &rdma), 7.0);
    assert_eq!(value(&m, "ublk_driver_reporting", &[]), 2.0);
    assert_eq!(value(&m, "ublk_driver_partial", &[]), 0.0);

    // Device 1 is removed: its 7 transfers stay in the total.
    b.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 9);
    reg.remove_device(1);
    let m = t.render().unwrap();
    assert_eq!(value(&m, "ublk_driver_rdma_transferred_total", &rdma), 24.0);
    assert_eq!(value(&m, "ublk_driver_reporting", &[]), 1.0);

    // Device 0's driver restarts and its counter resets to 1: the total
    // grows by 1 instead of dropping.
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 1);
    let m = t.render().unwrap();
    assert_eq!(value(&m, "ublk_driver_rdma_transferred_total", &rdma), 25.0);
}

#[test]
fn different_drivers_export_partial_and_no_new_sums() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let reg = DriverStatsRegistry::new(&t);
    let a = Fake::new("rdma");
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 10);
    reg.add_device(0, Transport::Rdma, a.clone());
    let m = t.render().unwrap();
    assert_eq!(
        value(
            &m,
            "ublk_driver_rdma_transferred_total",
            &[("driver", "rdma")]
        ),
        10.0
    );

    let b = Fake::new("tcp");
    b.set(
        names::TCP_PAYLOAD_REQUESTS,
        Some(IoOp::Read),
        Some("transport_tcp"),
        3,
    );
    reg.add_device(1, Transport::Tcp, b);
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 20);
    let m = t.render().unwrap();
    assert_eq!(value(&m, "ublk_driver_partial", &[]), 1.0);
    assert_eq!(value(&m, "ublk_driver_reporting", &[]), 2.0);
    assert_eq!(
        value(
            &m,
            "ublk_driver_rdma_transferred_total",
            &[("driver", "rdma")]
        ),
        10.0,
        "no sums while drivers differ; the last value stays"
    );
    assert!(sample(
        &m,
        "ublk_driver_tcp_payload_requests_total",
        &[("driver", "tcp"), ("reason", "transport_tcp")]
    )
    .is_none());

    reg.remove_device(1);
    let m = t.render().unwrap();
    assert_eq!(value(&m, "ublk_driver_partial", &[]), 0.0);
    assert_eq!(
        value(
            &m,
            "ublk_driver_rdma_transferred_total",
            &[("driver", "rdma")]
        ),
        20.0
    );
}

#[test]
fn invalid_names_are_not_exported() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let reg = DriverStatsRegistry::new(&t);
    let a = Fake::new("rdma");
    a.set("Bad-Name", None, None, 1);
    a.set("ok_name", None, Some("Bad Reason"), 1);
    reg.add_device(0, Transport::Rdma, a);
    let m = t.render().unwrap();
    assert!(!m.contains("Bad"), "{m}");
}

#[test]
fn summary_reports_transfers_problems_and_warnings() {
    let a = Fake::new("rdma");
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Read), None, 237);
    a.set(
        names::TCP_PAYLOAD_REQUESTS,
        Some(IoOp::Read),
        Some("too_large"),
        3,
    );
    a.set(names::RDMA_TRANSFERRED, Some(IoOp::Write), None, 5);
    a.set(names::RDMA_TIMED_OUT, Some(IoOp::Write), None, 2);
    a.set(names::REGISTRATION_FAILURES, None, None, 0);
    a.0.lock().rails = vec![rail(0, "mlx5_0", 2, 8192), rail(1, "mlx5_1", 1, 4096)];
    let b = Fake::new("rdma");
    b.set(
        names::TCP_PAYLOAD_REQUESTS,
        Some(IoOp::Write),
        Some("rdma_unavailable"),
        9,
    );
    let reports = vec![
        DeviceDriverReport {
            device: 0,
            configured: Transport::Rdma,
            stats: Some(a.snapshot()),
        },
        DeviceDriverReport {
            device: 1,
            configured: Transport::Rdma,
            stats: Some(b.snapshot()),
        },
        DeviceDriverReport {
            device: 2,
            configured: Transport::Tcp,
            stats: None,
        },
    ];
    // The report travels over the control socket as JSON.
    let wire = serde_json::to_string(&reports).unwrap();
    let back: Vec<DeviceDriverReport> = serde_json::from_str(&wire).unwrap();
    let text = summarize(&back);
    let expected = "\
ublkb0: RDMA data path - Read: 237 transfers over RDMA, 3 payload requests over TCP
ublkb0: RDMA data path - Write: 5 transfers over RDMA, 0 payload requests over TCP
ublkb0:   rail 0 (mlx5_0) up, 2/2 queues up: 8192 bytes in 2 transfers, 0 lost
ublkb0:   rail 1 (mlx5_1) degraded, 1/2 queues up: 4096 bytes in 1 transfers, 1 lost
ublkb0:   rdma_timed_out (write): 2
ublkb1: RDMA data path - Write: 0 transfers over RDMA, 9 payload requests over TCP
ublkb1: warning: configured for RDMA but moved no payload over RDMA
ublkb2: warning: no driver statistics reported
";
    assert_eq!(text, expected);
}

/// Each family has a HELP text of its own: every well-known statistic,
/// reported, renders a distinct, non-empty `# HELP` line.
#[test]
fn every_family_has_its_own_help_text() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let reg = DriverStatsRegistry::new(&t);
    let a = Fake::new("rdma");
    for name in names::COUNTERS {
        a.set(name, Some(IoOp::Read), None, 1);
    }
    for name in names::GAUGES {
        a.gauge(name, 1.0);
    }
    reg.add_device(0, Transport::Rdma, a.clone());
    let text = t.render().unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# HELP ") else {
            continue;
        };
        let (family, help) = rest.split_once(' ').unwrap_or((rest, ""));
        assert!(!help.trim().is_empty(), "{family} has no HELP text");
        if let Some(other) = seen.insert(help.to_owned(), family.to_owned()) {
            panic!("{family} and {other} share the HELP text {help:?}");
        }
    }
    for name in names::COUNTERS {
        let family = format!("ublk_driver_{name}_total");
        assert!(
            seen.values().any(|f| *f == family),
            "{family} not rendered:\n{text}"
        );
    }
}

fn rail(rail: u8, device: &str, queues_up: u32, bytes: u64) -> RailValue {
    RailValue {
        rail,
        rdma_device: device.into(),
        queues: 2,
        queues_up,
        transfers: bytes / 4096,
        bytes,
        lost: u64::from(2 - queues_up),
        ..RailValue::default()
    }
}

/// Rails are summed over devices by rail and RDMA device; a removed
/// device's counts stay in the counters and leave the gauges; a device
/// name that is no label value and label sets past the bound are dropped.
#[test]
fn rails_are_summed_by_rail_and_rdma_device_and_bounded() {
    let t = Telemetry::isolated(Daemon::Ublkd, "test");
    let reg = DriverStatsRegistry::new(&t);
    let a = Fake::new("rdma");
    let b = Fake::new("rdma");
    a.0.lock().rails = vec![rail(0, "mlx5_0", 2, 8192), rail(1, "mlx5_1", 1, 4096)];
    b.0.lock().rails = vec![rail(0, "mlx5_0", 2, 4096), rail(1, "mlx5_1", 2, 4096)];
    reg.add_device(0, Transport::Rdma, a.clone());
    reg.add_device(1, Transport::Rdma, b.clone());
    let m = t.render().unwrap();
    let r1 = [("rail", "1"), ("rdma_device", "mlx5_1")];
    assert_eq!(value(&m, "ublk_driver_rail_queues", &r1), 4.0);
    assert_eq!(value(&m, "ublk_driver_rail_queues_up", &r1), 3.0);
    assert_eq!(value(&m, "ublk_driver_rail_lost_total", &r1), 1.0);
    assert_eq!(
        value(
            &m,
            "ublk_driver_rail_bytes_total",
            &[("rail", "0"), ("rdma_device", "mlx5_0")]
        ),
        12288.0
    );

    reg.remove_device(1);
    let m = t.render().unwrap();
    assert_eq!(value(&m, "ublk_driver_rail_bytes_total", &r1), 8192.0);
    assert_eq!(value(&m, "ublk_driver_rail_queues", &r1), 2.0);

    a.0.lock().rails = (0..12u8)
        .map(|i| rail(i % 2, &format!("dev{i}"), 2, 0))
        .chain([rail(0, "bad device", 2, 0)])
        .collect();
    let m = t.render().unwrap();
    let sets: std::collections::BTreeSet<&str> = m
        .lines()
        .filter(|l| l.starts_with("ublk_driver_rail_queues{"))
        .collect();
    assert_eq!(sets.len(), ublk_metrics::driver::MAX_RAIL_SERIES);
    assert!(!m.contains("bad device"));
}
