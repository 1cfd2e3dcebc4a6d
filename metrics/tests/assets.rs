//! The exposition, alert rules, dashboard and reference docs, checked with
//! the tools operators use (promtool) and against the family catalogue.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use ublk_metrics::driver::{names, CounterValue, GaugeValue};
use ublk_metrics::families;
use ublk_metrics::testing::run_promtool;
use ublk_metrics::{
    ArenaMetrics, ArenaOp, ArenaOutcome, ArenaStats, CorrelationId, Daemon, DriverSnapshot,
    DriverStats, DriverStatsRegistry, IoMetrics, IoOp, ManualClock, Phase, ProtocolErrorClass,
    Reason, RequestAccounting, Scanner, ScannerConfig, Telemetry, TrackerConfig, TrackerTable,
    Transport,
};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct EveryStat;

impl DriverStats for EveryStat {
    fn snapshot(&self) -> DriverSnapshot {
        let mut counters: Vec<CounterValue> = names::COUNTERS
            .iter()
            .map(|n| CounterValue {
                name: Cow::Borrowed(n),
                op: Some(IoOp::Read),
                reason: None,
                value: 3,
            })
            .collect();
        counters.push(CounterValue {
            name: Cow::Borrowed(names::TCP_PAYLOAD_REQUESTS),
            op: Some(IoOp::Write),
            reason: Some(Cow::Borrowed("too_large")),
            value: 1,
        });
        DriverSnapshot {
            driver: Cow::Borrowed("rdma"),
            counters,
            gauges: names::GAUGES
                .iter()
                .map(|n| GaugeValue {
                    name: Cow::Borrowed(n),
                    value: 2.0,
                })
                .collect(),
        }
    }
}

/// A ublkd exposition with every family populated.
fn ublkd_exposition() -> String {
    let t = Telemetry::isolated(Daemon::Ublkd, "0.1.0");
    let clock = Arc::new(ManualClock::new());
    let io = IoMetrics::new(&t, "arena", None).unwrap();
    let tab = Arc::new(
        TrackerTable::new(
            TrackerConfig {
                target: "arena".into(),
                device: None,
                queues: 1,
                depth: 8,
                slow_threshold: None,
            },
            Some(0),
            clock.clone(),
        )
        .unwrap(),
    );
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    for (tag, op) in IoOp::ALL.into_iter().enumerate() {
        let g = tab.start(0, tag as u16, op).unwrap();
        clock.advance(Duration::from_micros(300));
        g.complete(&io, 4096, if tag % 2 == 0 { Ok(()) } else { Err(-110) });
    }
    let _held = tab.start(0, 7, IoOp::Write).unwrap();
    clock.advance(Duration::from_secs(31));
    scanner.scan();
    let reg = DriverStatsRegistry::new(&t);
    reg.add_device(0, Transport::Rdma, Arc::new(EveryStat));
    let acct = RequestAccounting::new(&t);
    let mut r = acct.start_request(IoOp::Read, Transport::Rdma, CorrelationId::next());
    r.attempt(Transport::Rdma)
        .fail(Phase::Completion, Reason::WcError);
    r.failover(Transport::Tcp);
    r.attempt(Transport::Tcp).succeed();
    r.succeed();
    acct.start_request(IoOp::Write, Transport::Tcp, CorrelationId::next())
        .fail(Phase::Commit, Reason::Timeout);
    t.render().unwrap()
}

/// An arenad exposition with every family populated.
fn arenad_exposition() -> String {
    let t = Telemetry::isolated(Daemon::Arenad, "0.1.0");
    let a = ArenaMetrics::new(&t);
    a.record_op(ArenaOp::Get, ArenaOutcome::Ok, Duration::from_micros(80));
    a.record_op(
        ArenaOp::Alloc,
        ArenaOutcome::NoSpace,
        Duration::from_micros(20),
    );
    a.record_journal(Duration::from_millis(2));
    a.record_checkpoint(Duration::from_millis(200));
    a.record_flush(Duration::from_millis(3));
    a.protocol_error(ProtocolErrorClass::Opcode);
    a.auth_failure();
    a.set_source(|| ArenaStats {
        slots: [10, 5, 3, 2],
        leases_held: 2,
        evictions: 4,
        writebacks: 3,
        fault_ins: 1,
        swap_read_bytes: 4096,
        swap_written_bytes: 8192,
        swap_used_bytes: 50,
        swap_capacity_bytes: 100,
        arena_used_bytes: 10,
        arena_capacity_bytes: 20,
    });
    t.render().unwrap()
}

fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn rendered_expositions_pass_promtool_check_metrics() {
    for text in [ublkd_exposition(), arenad_exposition()] {
        run_promtool(&["check", "metrics"], Some(&text), &repo());
    }
}

/// Families come from the exporter and from the native (sharded) renderers:
/// each must be described exactly once, with the catalogue's type.
#[test]
fn every_family_is_typed_once_with_its_catalogued_type() {
    let kinds: std::collections::BTreeMap<String, families::Kind> =
        families::exported().into_iter().collect();
    for text in [ublkd_exposition(), arenad_exposition()] {
        let mut typed = BTreeSet::new();
        for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut parts = line["# TYPE ".len()..].split(' ');
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            assert!(typed.insert(name.to_string()), "{name} is typed twice");
            let want = match kinds.get(name) {
                Some(families::Kind::Counter) => "counter",
                Some(families::Kind::Gauge) => "gauge",
                Some(families::Kind::Histogram) => "histogram",
                None => panic!("{name} is not in the catalogue"),
            };
            assert_eq!(kind, want, "{name}");
        }
    }
}

#[test]
fn every_rendered_sample_is_in_the_catalogue_and_vice_versa() {
    let known: BTreeSet<String> = families::exported_sample_names().into_iter().collect();
    let mut seen = BTreeSet::new();
    for text in [ublkd_exposition(), arenad_exposition()] {
        for name in sample_names(&text) {
            assert!(
                known.contains(&name),
                "{name} is exported but not in families::exported()"
            );
            seen.insert(name);
        }
    }
    for (name, kind) in families::exported() {
        let probe = if kind == families::Kind::Histogram {
            format!("{name}_count")
        } else {
            name.clone()
        };
        // arenad has no scanner: its scanner families exist only by name.
        if name.starts_with("arenad_scanner") {
            continue;
        }
        assert!(
            seen.contains(&probe),
            "{name} is catalogued but never rendered"
        );
    }
}

#[test]
fn alert_rules_pass_promtool_check_rules() {
    let out = run_promtool(&["check", "rules", "dashboards/alerts.yml"], None, &repo());
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn alert_rules_pass_promtool_unit_tests() {
    run_promtool(
        &["test", "rules", "alerts.test.yml"],
        None,
        &repo().join("dashboards"),
    );
}

/// Identifiers in a PromQL expression that name one of our families.
fn our_metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_string = false;
    for ch in expr.chars().chain(std::iter::once(' ')) {
        if ch == '"' {
            in_string = !in_string;
            cur.clear();
            continue;
        }
        if !in_string && (ch.is_ascii_alphanumeric() || ch == '_' || ch == ':') {
            cur.push(ch);
            continue;
        }
        if ["ublk_", "ublkd_", "arenad_"]
            .iter()
            .any(|p| cur.starts_with(p))
        {
            out.push(std::mem::take(&mut cur));
        }
        cur.clear();
    }
    out
}

fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn dashboard_and_alerts_query_only_exported_metrics() {
    let known: BTreeSet<String> = families::exported_sample_names().into_iter().collect();
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("dashboards/ublk.json")).unwrap(),
    )
    .expect("dashboard JSON parses");
    let mut exprs = Vec::new();
    collect_exprs(&dash, &mut exprs);
    assert!(
        exprs.len() >= 20,
        "dashboard has {} expressions",
        exprs.len()
    );
    let alerts = std::fs::read_to_string(repo().join("dashboards/alerts.yml")).unwrap();
    let alert_exprs: Vec<String> = alerts
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.contains("summary:"))
        .map(str::to_string)
        .collect();
    let mut used = BTreeSet::new();
    for e in exprs.iter().chain(&alert_exprs) {
        for name in our_metric_names(e) {
            assert!(
                known.contains(&name),
                "{name} in {e:?} is not an exported metric"
            );
            used.insert(name);
        }
    }
    for must in [
        "ublk_io_requests_total",
        "ublk_io_bytes_total",
        "ublk_io_latency_seconds_bucket",
        "ublk_io_inflight",
        "ublk_io_stalled",
        "ublk_io_errors_total",
        "ublk_driver_rdma_transferred_total",
        "ublk_driver_tcp_payload_requests_total",
        "arenad_arena_utilisation_ratio",
        "arenad_swap_read_bytes_total",
        "ublkd_ready",
    ] {
        assert!(used.contains(must), "dashboard lacks {must}");
    }
}

#[test]
fn metrics_doc_describes_every_family_and_reason() {
    let doc = std::fs::read_to_string(repo().join("docs/METRICS.md")).expect("docs/METRICS.md");
    for (name, _) in families::exported() {
        let generic = name.strip_prefix("ublkd_").or_else(|| {
            name.strip_prefix("arenad_")
                .filter(|_| families::SELF.iter().any(|f| name.ends_with(f.name)))
        });
        let documented = doc.contains(&format!("`{name}`"))
            || generic.is_some_and(|g| doc.contains(&format!("`<prefix>_{g}`")));
        assert!(documented, "docs/METRICS.md does not document `{name}`");
    }
    for r in ublk_metrics::NotReadyReason::ALL {
        assert!(
            doc.contains(&format!("`{}`", r.as_str())),
            "reason {r} undocumented"
        );
    }
    for e in ublk_metrics::events::ALL {
        assert!(doc.contains(&format!("`{e}`")), "event {e} undocumented");
    }
}

/// GitHub-style anchor of a Markdown heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_alert_links_to_a_runbook_section() {
    let runbook = std::fs::read_to_string(repo().join("docs/RUNBOOK.md")).expect("docs/RUNBOOK.md");
    let anchors: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(slug)
        .collect();
    let alerts = std::fs::read_to_string(repo().join("dashboards/alerts.yml")).unwrap();
    let mut links = 0;
    for line in alerts.lines() {
        if let Some((_, anchor)) = line.split_once("docs/RUNBOOK.md#") {
            let anchor = anchor.trim_end_matches('"');
            assert!(
                anchors.contains(anchor),
                "alert links to missing runbook section #{anchor}"
            );
            links += 1;
        }
    }
    assert!(links >= 9, "{links} alert runbook links");
}
