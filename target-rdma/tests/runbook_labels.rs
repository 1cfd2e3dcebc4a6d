//! The runbook and the alert rules name only what the daemons export: every
//! `label="value"` they write is a value of that label's closed set in the
//! code, and every metric they name is a catalogued family. (A runbook that
//! tells an operator to look for a reason no daemon emits sends them
//! nowhere.) This lives here because the reasons of TCP payload requests
//! belong to the RDMA transport, the others to the metrics crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use target_rdma::client::{RdmaDriverStats, RdmaStats, TcpReason};
use ublk_metrics::{
    families, ArenaOp, ArenaOutcome, DriverSnapshot, DriverStats as _, EpochReason, ErrnoClass,
    HedgeOutcome, IoOp, NotReadyReason, Outcome, Phase, ProtocolErrorClass, Reason, RebuildOutcome,
    SlotState, Transport,
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
    add("reason", &Reason::ALL.map(Reason::as_str));
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
    add("phase", &Phase::ALL.map(Phase::as_str));
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
    add("transport", &Transport::ALL.map(Transport::as_str));
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
