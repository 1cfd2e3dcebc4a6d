//! The runbook and the alert rules name only what the daemons export: every
//! `label="value"` they write is a value of that label's closed set in the
//! code, and every metric they name is a catalogued family. (A runbook that
//! tells an operator to look for a reason no daemon emits sends them
//! nowhere.) The same holds for log events: every event name the docs
//! write is one of the daemons' event constants, and every constant is
//! described in the docs. This lives here because the reasons of TCP
//! payload requests belong to the RDMA transport, the others to the
//! metrics crate, and because this crate sees both event lists
//! (`ublk_metrics::events`, `target_rdma::arenad::events`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use target_rdma::client::{RdmaDriverStats, RdmaStats, TcpReason};
use ublk_metrics::{
    families, ArenaOp, ArenaOutcome, ConnectionRefusal, DriverSnapshot, DriverStats as _,
    EpochReason, ErrnoClass, FailureCause, HedgeOutcome, IoOp, NotReadyReason, Outcome, Phase,
    ProtocolErrorClass, Reason, RebuildOutcome, SlotState, Transport,
};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// What the RDMA transport reports: every counter and gauge, each reason.
fn rdma_snapshot() -> DriverSnapshot {
    RdmaDriverStats::new("rdma", vec![Arc::new(RdmaStats::default())], Arc::default()).snapshot()
}

/// Label name -> every value the daemons export for it.
fn closed_labels() -> BTreeMap<&'static str, BTreeSet<String>> {
    let mut m: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let mut add = |label, values: &[&str]| {
        m.entry(label)
            .or_default()
            .extend(values.iter().map(|v| v.to_string()));
    };
    // The failure families carry the taxonomy's causes and the failed-over
    // RDMA attempt's completion/wc_error; no other phase or reason.
    add("reason", &FailureCause::ALL.map(|c| c.reason().as_str()));
    add("reason", &[Reason::WcError.as_str()]);
    add("reason", &TcpReason::ALL.map(TcpReason::name));
    let snap = rdma_snapshot();
    let driver_reasons: Vec<&str> = snap
        .counters
        .iter()
        .filter_map(|c| c.reason.as_deref())
        .collect();
    add("reason", &driver_reasons);
    add("reason", &NotReadyReason::ALL.map(NotReadyReason::as_str));
    add("reason", &EpochReason::ALL.map(EpochReason::as_str));
    add(
        "reason",
        &ConnectionRefusal::ALL.map(ConnectionRefusal::as_str),
    );
    add("phase", &FailureCause::ALL.map(|c| c.phase().as_str()));
    add("phase", &[Phase::Completion.as_str()]);
    add("errno", &ErrnoClass::ALL.map(ErrnoClass::as_str));
    add("op", &IoOp::ALL.map(IoOp::as_str));
    add("op", &ArenaOp::ALL.map(ArenaOp::as_str));
    add("outcome", &Outcome::ALL.map(Outcome::as_str));
    add("outcome", &ArenaOutcome::ALL.map(ArenaOutcome::as_str));
    add("outcome", &RebuildOutcome::ALL.map(RebuildOutcome::as_str));
    add("outcome", &HedgeOutcome::ALL.map(HedgeOutcome::as_str));
    add(
        "class",
        &ProtocolErrorClass::ALL.map(ProtocolErrorClass::as_str),
    );
    add("state", &SlotState::ALL.map(SlotState::as_str));
    add("transport", &Transport::SERVED.map(Transport::as_str));
    m
}

/// Every `label="value"` / `label!="value"` in `text`.
fn label_pairs(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("=\"") {
        let name: String = rest[..i]
            .trim_end_matches('!')
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let after = &rest[i + 2..];
        let Some(end) = after.find('"') else { break };
        if !name.is_empty() {
            out.push((name, after[..end].to_string()));
        }
        rest = &after[end + 1..];
    }
    out
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[test]
fn the_runbook_names_only_exported_label_values() {
    let labels = closed_labels();
    let runbook = read("docs/RUNBOOK.md");
    let pairs = label_pairs(&runbook);
    assert!(
        pairs.len() >= 20,
        "only {} label values in the runbook",
        pairs.len()
    );
    for (name, value) in pairs {
        let values = labels.get(name.as_str()).unwrap_or_else(|| {
            panic!("RUNBOOK.md: {name}=\"{value}\": {name} is not a closed label")
        });
        assert!(
            values.contains(&value),
            "RUNBOOK.md: {name}=\"{value}\" is never exported; {name} is one of {values:?}"
        );
    }
}

#[test]
fn alert_rules_and_their_tests_use_exported_label_values() {
    let labels = closed_labels();
    for file in ["dashboards/alerts.yml", "dashboards/alerts.test.yml"] {
        for (name, value) in label_pairs(&read(file)) {
            // instance, job, target, driver, severity: free or our own values.
            if let Some(values) = labels.get(name.as_str()) {
                assert!(
                    values.contains(&value),
                    "{file}: {name}=\"{value}\" is never exported"
                );
            }
        }
    }
}

#[test]
fn the_runbook_names_only_exported_metrics() {
    let mut known: BTreeSet<String> = families::exported_sample_names().into_iter().collect();
    let snap = rdma_snapshot();
    known.extend(
        snap.counters
            .iter()
            .map(|c| format!("ublk_driver_{}_total", c.name)),
    );
    known.extend(
        snap.gauges
            .iter()
            .map(|g| format!("ublk_driver_{}", g.name)),
    );
    // Readiness reasons are label values, not metric names, but some
    // begin like one (`ublk_driver_missing`).
    let reasons: BTreeSet<&str> = ublk_metrics::NotReadyReason::ALL
        .iter()
        .map(|r| r.as_str())
        .collect();
    let runbook = read("docs/RUNBOOK.md");
    let mut named = 0;
    for word in runbook.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if ["ublk_", "ublkd_", "arenad_"]
            .iter()
            .any(|p| word.starts_with(p))
            && !reasons.contains(word)
        {
            assert!(
                known.contains(word),
                "RUNBOOK.md names {word}, which is not exported"
            );
            named += 1;
        }
    }
    assert!(named >= 15, "only {named} metric names in the runbook");
}

/// Dotted backticked words in the docs that are not events (config keys).
const NOT_EVENTS: &[&str] = &["metrics.per_device_labels"];

/// How file names in the docs end: `accept.rs`, `swap.meta`, ...
const FILE_EXTENSIONS: &[&str] = &[
    "rs", "sh", "toml", "service", "log", "json", "env", "dat", "meta", "ckpt", "journal", "tmp",
];

/// Every event name of both daemons, each with the list that defines it.
fn event_names() -> Vec<(&'static str, &'static str)> {
    let shared = ublk_metrics::events::ALL
        .iter()
        .map(|e| (*e, "ublk_metrics::events"));
    let arenad = target_rdma::arenad::events::ALL
        .iter()
        .map(|e| (*e, "target_rdma::arenad::events"));
    shared.chain(arenad).collect()
}

/// Every `docs/*.md`, by file name.
fn docs() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&p).unwrap();
            (name, text)
        })
        .collect();
    out.sort();
    out
}

/// Every backticked `word.word` in `text` (lower-case, digits, `_`).
fn dotted_words(text: &str) -> Vec<&str> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            w.split_once('.').is_some_and(|(a, b)| {
                [a, b].iter().all(|p| {
                    p.starts_with(|c: char| c.is_ascii_lowercase())
                        && p.chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                })
            })
        })
        .collect()
}

#[test]
fn no_event_name_is_defined_twice() {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, list) in event_names() {
        if let Some(first) = seen.insert(name, list) {
            panic!("event {name} is defined in {first} and in {list}");
        }
    }
    assert!(seen.len() >= 150, "only {} events", seen.len());
}

#[test]
fn the_docs_name_only_emitted_events() {
    let events: BTreeSet<&str> = event_names().into_iter().map(|(e, _)| e).collect();
    let prefixes: BTreeSet<&str> = events
        .iter()
        .filter_map(|e| e.split_once('.').map(|(p, _)| p))
        .collect();
    let mut named = 0;
    for (doc, text) in docs() {
        for word in dotted_words(&text) {
            let (prefix, suffix) = word.split_once('.').unwrap();
            if !prefixes.contains(prefix)
                || FILE_EXTENSIONS.contains(&suffix)
                || NOT_EVENTS.contains(&word)
            {
                continue;
            }
            assert!(
                events.contains(word),
                "docs/{doc} names the event `{word}`, which no daemon emits"
            );
            named += 1;
        }
    }
    assert!(named >= 150, "only {named} event names in the docs");
}

#[test]
fn every_event_is_described_in_the_docs() {
    let docs = docs();
    for (name, list) in event_names() {
        let quoted = format!("`{name}`");
        assert!(
            docs.iter().any(|(_, text)| text.contains(&quoted)),
            "{list}: event {name} is described in no docs/*.md"
        );
    }
}

/// Every dashboard panel the runbook cites (dashboard "X", panel *X*) is
/// a panel of `dashboards/ublk.json`.
#[test]
fn the_runbook_cites_only_panels_of_the_dashboard() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("dashboards/ublk.json")).expect("the dashboard is JSON");
    let mut titles = BTreeSet::new();
    let mut todo = vec![&dashboard];
    while let Some(v) = todo.pop() {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::String(t)) = m.get("title") {
                    titles.insert(t.clone());
                }
                todo.extend(m.values());
            }
            serde_json::Value::Array(a) => todo.extend(a),
            _ => {}
        }
    }
    let runbook = read("docs/RUNBOOK.md").replace('\n', " ");
    // A title follows each of these and ends at the quote or star after it.
    let mut cited = Vec::new();
    for (open, close) in [
        ("panel *", '*'),
        ("ashboard \"", '"'),
        ("\" (or \"", '"'),
        (" lines) and \"", '"'),
        ("dashboard's \"", '"'),
        ("`tcp`: \"", '"'),
        ("retransmissions\" and \"", '"'),
    ] {
        let mut rest = runbook.as_str();
        while let Some(i) = rest.find(open) {
            rest = &rest[i + open.len()..];
            let Some(j) = rest.find(close) else { break };
            cited.push(rest[..j].to_owned());
            rest = &rest[j..];
        }
    }
    assert!(cited.len() >= 8, "only {cited:?} cited");
    for c in &cited {
        assert!(
            titles.contains(c),
            "docs/RUNBOOK.md cites the panel {c:?}, which dashboards/ublk.json lacks"
        );
    }
}
