//! The exposition, alert rules, dashboard and reference docs, checked with
//! the tools operators use (promtool) and against the family catalogue.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use ublk_metrics::driver::{names, CounterValue, GaugeValue, RailValue};
use ublk_metrics::families;
use ublk_metrics::testing::{parse_openmetrics, run_promtool};
use ublk_metrics::{
    ArenaMetrics, ArenaOp, ArenaOutcome, ArenaStats, CorrelationId, Daemon, DriverSnapshot,
    DriverStats, DriverStatsRegistry, FailureCause, IoMetrics, IoOp, ManualClock,
    ProtocolErrorClass, RequestAccounting, Scanner, ScannerConfig, TcpInfoSample, TcpLinks,
    Telemetry, TraceId, TrackerConfig, TrackerTable, Transport,
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
            rails: (0..2u8)
                .map(|rail| RailValue {
                    rail,
                    rdma_device: format!("mlx5_{rail}"),
                    queues: 2,
                    queues_up: 2 - u32::from(rail),
                    transfers: 10,
                    bytes: 40960,
                    outstanding: 4096,
                    lost: u64::from(rail),
                    connects: 2,
                    ..RailValue::default()
                })
                .collect(),
        }
    }
}

/// A ublkd exposition with every family populated.
fn ublkd_exposition() -> String {
    ublkd_expositions().text
}

/// The same ublkd state rendered as Prometheus text and as OpenMetrics, and
/// the trace ids made exemplars.
struct Expositions {
    text: String,
    openmetrics: String,
    /// Exemplar of `ublk_io_latency_seconds{op="read"}`'s 0.0005 bucket.
    io_trace: TraceId,
    /// Exemplar of `ublk_attempt_latency_seconds{op="read",transport="rdma"}`'s
    /// 0.0025 bucket.
    attempt_trace: TraceId,
}

/// The tracker table of one queue of depth 8 of an "arena" device.
fn tracker_table(clock: Arc<ManualClock>) -> Arc<TrackerTable> {
    Arc::new(
        TrackerTable::new(
            TrackerConfig {
                target: "arena".into(),
                device: None,
                queues: 1,
                depth: 8,
                slow_threshold: None,
            },
            Some(0),
            clock,
        )
        .unwrap(),
    )
}

fn ublkd_expositions() -> Expositions {
    let t = Telemetry::isolated(Daemon::Ublkd, "0.1.0");
    let clock = Arc::new(ManualClock::new());
    let io = IoMetrics::new(&t, "arena", None).unwrap();
    let tab = tracker_table(clock.clone());
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    let mut io_trace = None;
    for (tag, op) in IoOp::ALL.into_iter().enumerate() {
        let g = tab.start(0, tag as u16, op).unwrap();
        let corr = g.correlation_id();
        clock.advance(Duration::from_micros(300));
        g.complete(&io, 4096, if tag % 2 == 0 { Ok(()) } else { Err(-110) });
        if op == IoOp::Read {
            io.latency(op).exemplar(300_000, corr);
            io_trace = Some(TraceId::of(corr));
        }
    }
    let links = TcpLinks::new(&t);
    let mut link = links.open();
    link.sample(TcpInfoSample {
        total_retrans: 3,
        rtt_us: 250,
        cwnd: 10,
    });
    let _held = tab.start(0, 7, IoOp::Write).unwrap();
    clock.advance(Duration::from_secs(31));
    scanner.scan();
    let reg = DriverStatsRegistry::new(&t);
    reg.add_device(0, Transport::Rdma, Arc::new(EveryStat));
    let acct = RequestAccounting::new(&t);
    let corr = CorrelationId::next();
    let mut r = acct.start_request(IoOp::Read, Transport::Rdma, corr);
    let rdma = r.attempt(Transport::Rdma);
    let tcp = r.fail_over(rdma, Some(2_000_000), Transport::Tcp);
    acct.attempt_latency(IoOp::Read, Transport::Rdma)
        .exemplar(2_000_000, corr);
    tcp.succeed(3_000_000);
    r.succeed();
    acct.start_request(IoOp::Write, Transport::Tcp, CorrelationId::next())
        .fail(FailureCause::PollTimeout);
    let coord = ublk_metrics::CoordinationMetrics::new(&t);
    coord.update_from(&ublk_metrics::CoordinationStats {
        epoch_changes: [1, 2, 0, 1, 1, 0, 1],
        leases_lost: 1,
        lease_valid: true,
    });
    ublk_metrics::ReplicaMetrics::new(&t).update_from(&ublk_metrics::ReplicaStats {
        replicas: 3,
        healthy: 2,
        degraded: 1,
        rebuild_bytes: 1 << 20,
        rebuild_remaining: 65536,
        rebuild_rate: 1 << 20,
        stale_epoch_fences: 0,
        unconfirmed: 1,
        fenced: 0,
        stragglers: 1,
        roles_regained: 1,
        standbys: 1,
        handovers: [1, 0],
        last_handover_ms: 120,
        hedged_reads: [3, 1],
        rebuilds: [1, 2, 0],
    });
    t.enable_openmetrics();
    Expositions {
        text: t.render().unwrap(),
        openmetrics: t.render_openmetrics().unwrap(),
        io_trace: io_trace.unwrap(),
        attempt_trace: TraceId::of(corr),
    }
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
        revocations: 3,
        leases_force_ended: 1,
        writebacks: 3,
        fault_ins: 1,
        swap_read_bytes: 4096,
        swap_written_bytes: 8192,
        swap_used_bytes: 50,
        swap_capacity_bytes: 100,
        arena_used_bytes: 10,
        arena_capacity_bytes: 20,
        sessions: 3,
        integrity_errors: [1, 0],
    });
    let v = ublk_metrics::VolumeMetrics::new(&t, ublk_metrics::VolumeLabels::default());
    let vm1 = v.counters("vm1");
    vm1.session_opened();
    vm1.answered(ArenaOp::Write, ArenaOutcome::Ok, 4096 + 24);
    v.set_source(|| {
        vec![ublk_metrics::VolumeSample {
            name: "vm1".into(),
            resident_bytes: 1 << 20,
            swap_bytes: 2 << 20,
            leases: 1,
            quota_bytes: 1 << 30,
        }]
    });
    t.render().unwrap()
}

fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or_default().to_string())
        .collect()
}

/// `/metrics/openmetrics` is real OpenMetrics: the reference parser takes
/// it, it holds exactly the samples of the Prometheus text, and each
/// exemplar sits on the bucket its latency falls in.
#[test]
fn the_openmetrics_exposition_parses_and_carries_exemplars_on_their_buckets() {
    let e = ublkd_expositions();
    assert!(e.openmetrics.ends_with("\n# EOF\n"));
    assert!(!e.text.contains("trace_id"), "no exemplars in format 0.0.4");
    let parsed = parse_openmetrics(&e.openmetrics);
    let samples: BTreeSet<&str> = parsed
        .lines()
        .map(|l| l.split(' ').nth(1).unwrap())
        .collect();
    assert_eq!(
        samples,
        sample_names(&e.text).iter().map(String::as_str).collect(),
        "both expositions list the same samples"
    );
    let with_exemplar: Vec<&str> = parsed.lines().filter(|l| !l.ends_with(" - -")).collect();
    assert_eq!(with_exemplar.len(), 2, "{with_exemplar:#?}");
    let io = format!("{}", e.io_trace);
    assert!(
        with_exemplar.iter().any(
            |l| l.starts_with("histogram ublk_io_latency_seconds_bucket ")
                && l.contains(r#""le":"0.0005""#)
                && l.contains(r#""op":"read""#)
                && l.ends_with(&format!(" {io} 0.0003"))
        ),
        "{with_exemplar:#?}"
    );
    let attempt = format!("{}", e.attempt_trace);
    assert!(
        with_exemplar.iter().any(|l| l
            .starts_with("histogram ublk_attempt_latency_seconds_bucket ")
            && l.contains(r#""le":"0.0025""#)
            && l.contains(r#""transport":"rdma""#)
            && l.ends_with(&format!(" {attempt} 0.002"))),
        "{with_exemplar:#?}"
    );
    assert!(
        parsed
            .lines()
            .any(|l| l.starts_with("counter ublk_tcp_retransmissions_total {} 3 ")),
        "counter families keep their _total samples:\n{parsed}"
    );
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
        .filter(|l| {
            !l.trim_start().starts_with('#')
                && !l.contains("summary:")
                && !l.contains("description:")
        })
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

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(repo().join("dashboards/ublk.json")).unwrap();
    serde_json::from_str(&text).expect("dashboard JSON parses")
}

fn str_at<'a>(v: &'a serde_json::Value, path: &[&str]) -> &'a str {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_str()
        .unwrap_or_default()
}

/// Panels that draw data (rows only group them).
fn data_panels(dash: &serde_json::Value) -> Vec<&serde_json::Value> {
    dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .filter(|p| p["type"] != "row")
        .collect()
}

/// Identifiers outside string literals, with the byte offset after each.
fn identifiers(expr: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_string = false;
    for (i, ch) in expr
        .char_indices()
        .chain(std::iter::once((expr.len(), ' ')))
    {
        if ch == '"' {
            in_string = !in_string;
        }
        if !in_string && (ch.is_ascii_alphanumeric() || ch == '_' || ch == ':') {
            cur.push(ch);
        } else if !cur.is_empty() {
            out.push((std::mem::take(&mut cur), i));
        }
    }
    out
}

/// The families with a `device` label (optional or not), from the
/// catalogue.
fn per_device_families() -> BTreeSet<&'static str> {
    [
        families::IO,
        families::ACCOUNTING,
        families::TCP,
        families::DRIVER,
        families::COORDINATION,
        families::ARENA,
        families::PROCESS,
        families::SELF,
    ]
    .into_iter()
    .flatten()
    .filter(|f| {
        f.labels
            .iter()
            .any(|l| l.trim_matches(['[', ']']) == "device")
    })
    .map(|f| f.name)
    .collect()
}

/// The family a sample name belongs to (a histogram's `_bucket`, `_sum`
/// and `_count` belong to the histogram).
fn family_of(sample: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| sample.strip_suffix(s))
        .filter(|f| {
            families::IO
                .iter()
                .chain(families::ACCOUNTING)
                .chain(families::ARENA)
                .any(|fam| fam.name == *f && fam.kind == families::Kind::Histogram)
        })
        .unwrap_or(sample)
}

/// Every selector of a series must follow the dashboard's variables (and
/// a per-device family its `$device` too), and every aggregation keep
/// `instance`: a fleet dashboard shows each host, never one sum over all of
/// them.
fn check_fleet_expr(title: &str, expr: &str) {
    let per_device = per_device_families();
    const AGGREGATIONS: [&str; 6] = ["sum", "max", "min", "avg", "count", "quantile"];
    let mut series = 0;
    for (ident, end) in identifiers(expr) {
        let rest = expr[end..].trim_start();
        let ours = ["ublk_", "ublkd_", "arenad_"]
            .iter()
            .any(|p| ident.starts_with(p));
        if ours || (ident == "up" && rest.starts_with('{')) {
            series += 1;
            let matchers = rest
                .strip_prefix('{')
                .and_then(|r| r.split_once('}'))
                .map(|(m, _)| m)
                .unwrap_or_else(|| panic!("{title}: {ident} has no label matchers in {expr:?}"));
            let device = per_device
                .contains(family_of(&ident))
                .then_some(r#"device=~"$device""#);
            for want in [r#"job=~"$job""#, r#"instance=~"$instance""#]
                .into_iter()
                .chain(device)
            {
                assert!(
                    matchers.contains(want),
                    "{title}: {ident} lacks {want} in {expr:?}"
                );
            }
        }
        if AGGREGATIONS.contains(&ident.as_str()) {
            let by = rest
                .strip_prefix("by")
                .map(str::trim_start)
                .and_then(|r| r.strip_prefix('('))
                .and_then(|r| r.split_once(')'))
                .map(|(labels, _)| labels)
                .unwrap_or_else(|| {
                    panic!("{title}: `{ident}` without `by (instance, ...)` in {expr:?}")
                });
            assert!(
                by.split(',').any(|l| l.trim() == "instance"),
                "{title}: `{ident} by ({by})` sums over instances in {expr:?}"
            );
        }
    }
    assert!(series > 0, "{title}: {expr:?} reads no series");
}

#[test]
fn dashboard_is_a_fleet_dashboard_with_variables_units_and_descriptions() {
    let dash = dashboard();
    let text = dash.to_string();
    assert!(
        dash.get("__inputs").is_none() && !text.contains("${DS_"),
        "import-time inputs do not resolve under file provisioning: use $datasource"
    );
    let vars = dash["templating"]["list"].as_array().expect("templating");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no ${name} variable"))
    };
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    for name in ["job", "instance"] {
        let v = var(name);
        assert_eq!(v["type"], "query", "${name}");
        assert_eq!(
            str_at(v, &["datasource", "uid"]),
            "${datasource}",
            "${name}"
        );
        assert!(v["multi"] == true && v["includeAll"] == true, "${name}");
        assert!(
            str_at(v, &["query", "query"]).contains("_build_info"),
            "${name}"
        );
    }
    assert!(str_at(var("instance"), &["query", "query"]).contains(r#"job=~"$job""#));
    let device = var("device");
    assert_eq!(device["type"], "query");
    assert_eq!(str_at(device, &["datasource", "uid"]), "${datasource}");
    assert!(device["multi"] == true && device["includeAll"] == true);
    // Devices have a label only with `metrics.per_device_labels`; `.*`
    // (unlike `.+`) also matches series without one, so All shows them.
    assert_eq!(device["allValue"], ".*");
    let query = str_at(device, &["query", "query"]);
    let family = query
        .strip_prefix("label_values(")
        .and_then(|q| q.split_once('{'))
        .map(|(f, _)| f)
        .unwrap_or_else(|| panic!("$device: {query:?} is not label_values(family{{..}}, device)"));
    assert!(
        per_device_families().contains(family),
        "$device reads {family}, which has no device label"
    );
    assert!(
        query.ends_with(", device)") && query.contains(r#"instance=~"$instance""#),
        "$device: {query:?}"
    );

    let panels = data_panels(&dash);
    assert!(panels.len() >= 20, "{} panels", panels.len());
    for p in panels {
        let title = str_at(p, &["title"]);
        assert_eq!(
            str_at(p, &["datasource", "uid"]),
            "${datasource}",
            "{title}"
        );
        assert!(
            str_at(p, &["description"]).len() >= 40,
            "{title}: needs a description saying what it shows"
        );
        let unit = str_at(p, &["fieldConfig", "defaults", "unit"]);
        assert!(!unit.is_empty(), "{title}: no unit");
        let overrides = p["fieldConfig"]["overrides"].to_string();
        assert!(
            !overrides.contains("\"unit\""),
            "{title}: one unit per panel, not overrides with others"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        // A byte count and a byte rate are two units: two panels.
        let rates = targets
            .iter()
            .filter(|t| str_at(t, &["expr"]).contains("rate("))
            .count();
        match unit {
            "bytes" => assert_eq!(rates, 0, "{title}: unit bytes, but a query is a rate"),
            "Bps" | "binBps" => assert_eq!(
                rates,
                targets.len(),
                "{title}: unit bytes/s, but a query is not a rate"
            ),
            _ => {}
        }
        for t in targets {
            assert_eq!(
                str_at(t, &["datasource", "uid"]),
                "${datasource}",
                "{title}"
            );
            assert!(
                str_at(t, &["legendFormat"]).contains("{{instance}}"),
                "{title}: the legend must name the instance"
            );
            check_fleet_expr(title, str_at(t, &["expr"]));
        }
    }
}

/// promtool parses every panel query (as a recording rule, with the
/// variables replaced by what Grafana substitutes).
#[test]
fn dashboard_queries_are_valid_promql() {
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut n = 0;
    for p in data_panels(&dashboard()) {
        for t in p["targets"].as_array().unwrap() {
            let expr = str_at(t, &["expr"])
                .replace("$__rate_interval", "1m")
                .replace("$job", ".+")
                .replace("$instance", ".+")
                .replace("$device", ".*");
            n += 1;
            rules.push_str(&format!(
                "      - record: dashboard:query{n}\n        expr: {}\n",
                serde_json::Value::String(expr)
            ));
        }
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::write(dir.join("dashboard.rules.yml"), rules).unwrap();
    let out = run_promtool(&["check", "rules", "dashboard.rules.yml"], None, dir);
    assert!(out.contains(&format!("SUCCESS: {n} rules found")), "{out}");
}

/// One alert rule of alerts.yml: name, expression and annotations.
struct Alert {
    name: String,
    expr: String,
    annotations: Vec<String>,
}

fn alerts() -> Vec<Alert> {
    let text = std::fs::read_to_string(repo().join("dashboards/alerts.yml")).unwrap();
    let mut out: Vec<Alert> = Vec::new();
    let mut in_expr = false;
    let mut in_annotations = false;
    for line in text.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("- alert: ") {
            out.push(Alert {
                name: name.into(),
                expr: String::new(),
                annotations: Vec::new(),
            });
            (in_expr, in_annotations) = (false, false);
            continue;
        }
        let Some(a) = out.last_mut() else { continue };
        if let Some(e) = t.strip_prefix("expr:") {
            a.expr = e.trim().trim_start_matches('|').to_string();
            in_expr = true;
        } else if t.starts_with("for:") || t.starts_with("labels:") {
            in_expr = false;
        } else if t.starts_with("annotations:") {
            in_annotations = true;
        } else if in_expr {
            a.expr.push(' ');
            a.expr.push_str(t);
        } else if in_annotations {
            if let Some((key, _)) = t.split_once(':') {
                a.annotations.push(key.to_string());
            }
        }
    }
    out
}

/// The comparison an alert's expression ends with: `> 0.9`, `== 0`.
fn final_comparison(expr: &str) -> (&str, f64) {
    let (op, pos) = [">", "=="]
        .iter()
        .filter_map(|op| expr.rfind(op).map(|p| (*op, p)))
        .max_by_key(|(_, p)| *p)
        .unwrap_or_else(|| panic!("no comparison in {expr:?}"));
    let value = expr[pos + op.len()..]
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{expr:?} does not end with a number"));
    (op, value)
}

#[test]
fn alerts_have_descriptions_runbook_urls_and_dashboard_thresholds() {
    let dash = dashboard();
    let panels = data_panels(&dash);
    let alerts = alerts();
    assert!(alerts.len() >= 9, "{} alerts", alerts.len());
    for a in &alerts {
        for key in ["summary", "description", "runbook_url"] {
            assert!(
                a.annotations.iter().any(|k| k == key),
                "{}: no {key}",
                a.name
            );
        }
        let named = format!("`{}`", a.name);
        let panel = panels
            .iter()
            .find(|p| str_at(p, &["description"]).contains(&named))
            .unwrap_or_else(|| panic!("no panel describes alert {}", a.name));
        let title = str_at(panel, &["title"]);
        let steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
            .as_array()
            .unwrap_or_else(|| panic!("{title} (alert {}) has no thresholds", a.name));
        let (op, value) = final_comparison(&a.expr);
        let step_values: Vec<(f64, &str)> = steps
            .iter()
            .skip(1)
            .map(|s| (s["value"].as_f64().unwrap(), s["color"].as_str().unwrap()))
            .collect();
        let base = steps[0]["color"].as_str().unwrap();
        // Grafana colours from each step's value upwards.
        let ok = match op {
            // `> N` on counts is `>= N + 1`, on ratios `>= N`.
            ">" => step_values
                .iter()
                .any(|(v, c)| *v >= value && *v <= value + 1.0 && *c != "green"),
            // `== 0`: red up to the first step above 0.
            _ => {
                value == 0.0
                    && base == "red"
                    && step_values
                        .iter()
                        .any(|(v, c)| *v > 0.0 && *v <= 1.0 && *c == "green")
            }
        };
        assert!(
            ok,
            "{title}: thresholds {step_values:?} (base {base}) do not match alert {} ({op} {value})",
            a.name
        );
    }
}

/// The example scrape config (job names the alerts and $job expect) loads.
#[test]
fn example_prometheus_config_passes_promtool() {
    let out = run_promtool(
        &["check", "config", "prometheus.yml"],
        None,
        &repo().join("dashboards"),
    );
    assert!(out.contains("SUCCESS"), "{out}");
    let config = std::fs::read_to_string(repo().join("dashboards/prometheus.yml")).unwrap();
    let alerts = std::fs::read_to_string(repo().join("dashboards/alerts.yml")).unwrap();
    for job in ["ublkd", "arenad"] {
        assert!(config.contains(&format!("job_name: {job}")), "{job}");
        assert!(alerts.contains(job), "{job}");
    }
}

/// The provisioning example names the keys Grafana's file provider needs.
#[test]
fn grafana_provisioning_example_points_at_a_dashboard_directory() {
    let text = std::fs::read_to_string(repo().join("dashboards/provisioning/ublk.yaml")).unwrap();
    let value = |key: &str| {
        text.lines()
            .find_map(|l| {
                l.trim()
                    .trim_start_matches("- ")
                    .strip_prefix(key)?
                    .strip_prefix(':')
            })
            .map(str::trim)
            .unwrap_or_else(|| panic!("provisioning example lacks {key}"))
    };
    assert_eq!(value("apiVersion"), "1");
    assert_eq!(value("type"), "file");
    assert!(
        value("path").starts_with('/'),
        "options.path must be absolute"
    );
    assert!(!value("name").is_empty());
}

/// The latency panels show exemplars, the panels of the TCP and
/// protocol-integrity families exist, and the runbook section the latency
/// panel points to walks from the exemplar to the log lines.
#[test]
fn latency_panels_lead_to_the_request_behind_a_spike() {
    let dash = dashboard();
    let panels = data_panels(&dash);
    let queries = |family: &str| -> Vec<&serde_json::Value> {
        panels
            .iter()
            .flat_map(|p| p["targets"].as_array().unwrap())
            .filter(|t| str_at(t, &["expr"]).contains(family))
            .collect()
    };
    for family in [
        "ublk_io_latency_seconds_bucket",
        "ublk_attempt_latency_seconds_bucket",
    ] {
        let q = queries(family);
        assert!(!q.is_empty(), "no panel reads {family}");
        assert!(
            q.iter().all(|t| t["exemplar"] == true),
            "{family}: every quantile query shows exemplars"
        );
    }
    for family in [
        "ublk_tcp_retransmissions_total",
        "ublk_tcp_rtt_max_seconds",
        "ublk_tcp_cwnd_min_segments",
        "ublk_driver_frame_errors_total",
        "ublk_driver_response_id_mismatches_total",
        "ublk_driver_length_mismatches_total",
    ] {
        assert!(!queries(family).is_empty(), "no panel reads {family}");
    }
    let runbook = std::fs::read_to_string(repo().join("docs/RUNBOOK.md")).unwrap();
    let section = runbook
        .split("\n## ")
        .find(|s| s.starts_with("A latency spike: find the request\n"))
        .expect("runbook section");
    for step in [
        "--enable-feature=exemplar-storage",
        "/metrics/openmetrics",
        "/api/v1/query_exemplars",
        "\"trace_id\":\"<id>\"",
        "span.request",
        "span.attempt",
        "\"corr\":<corr>",
        "Arena TCP retransmissions",
    ] {
        assert!(section.contains(step), "runbook section lacks {step:?}");
    }
    let latency_panel = panels
        .iter()
        .find(|p| p["title"] == "Block latency p50 and p99")
        .unwrap();
    assert!(str_at(latency_panel, &["description"]).contains("A latency spike: find the request"));
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

/// A panel or alert over a family with no series reads "No data" (or never
/// fires) on a healthy host: every family they read renders on an idle
/// ublkd and arenad, at zero. The `ublk_driver_*` families are the
/// drivers' own snapshots, rendered once a device reports one.
#[test]
fn every_family_the_dashboard_and_alerts_read_renders_when_idle() {
    let t = Telemetry::isolated(Daemon::Ublkd, "0.1.0");
    let _io = IoMetrics::new(&t, "arena", None).unwrap();
    let tab = tracker_table(Arc::new(ManualClock::new()));
    let scanner = Scanner::new(t.clone(), ScannerConfig::default());
    scanner.register(&tab);
    scanner.scan();
    let _links = TcpLinks::new(&t);
    let _drivers = DriverStatsRegistry::new(&t);
    let _acct = RequestAccounting::new(&t);
    let _coord = ublk_metrics::CoordinationMetrics::new(&t);
    let _replicas = ublk_metrics::ReplicaMetrics::new(&t);
    let a = Telemetry::isolated(Daemon::Arenad, "0.1.0");
    let _arena = ArenaMetrics::new(&a);
    // One configured volume, no session yet (arenad registers its
    // configured volumes' series at start).
    let volumes = ublk_metrics::VolumeMetrics::new(&a, ublk_metrics::VolumeLabels::default());
    volumes.counters("vm1");
    let mut rendered = sample_names(&t.render().unwrap());
    rendered.extend(sample_names(&a.render().unwrap()));

    let mut exprs = Vec::new();
    collect_exprs(&dashboard(), &mut exprs);
    exprs.extend(alerts().into_iter().map(|a| a.expr));
    let mut read = 0;
    for name in exprs.iter().flat_map(|e| our_metric_names(e)) {
        if name.starts_with("ublk_driver_") {
            continue;
        }
        read += 1;
        assert!(
            rendered.contains(&name),
            "{name} has no series until it first moves"
        );
    }
    assert!(read >= 40, "only {read} families read");
}
