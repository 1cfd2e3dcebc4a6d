//! `ublkctl peer` end to end, without the ublk kernel module: the real
//! `ublkd` binary configured with `[etcd]` against a real etcd on loopback,
//! and the real `ublkctl` registering, listing and unregistering arena
//! peers; the records are the documented keys `etcdctl` reads. The
//! coordination metrics show the writer lease valid, and a revoked lease
//! counted lost and replaced. A ublkd without `[etcd]` refuses the
//! commands naming the missing section and exports no such family.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::etcd::{eventually, EtcdServer};
use common::ublkd::Ublkd;
use ublk_metrics::testing::http_get;

fn ublkctl(dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ublkctl"))
        .arg("--socket")
        .arg(dir.join("ublkd.sock"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn peers_are_registered_listed_and_removed_through_ublkd() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = Ublkd::start(
        dir.path(),
        &format!(
            "[etcd]\nendpoints = [\"{}\"]\nhost_id = \"h1\"\n",
            etcd.endpoint()
        ),
    );
    let metrics = d.metrics.clone();
    // The connection starts in the background: wait for it.
    eventually(Duration::from_secs(30), "ublkd reaches etcd", || {
        ublkctl(dir.path(), &["peer", "list"]).status.success()
    });
    let add = |id: &str, dom: &str| {
        ublkctl(
            dir.path(),
            &[
                "peer",
                "add",
                "--id",
                id,
                "--addr",
                "10.0.0.7:7070",
                "--capacity",
                "64G",
                "--failure-domain",
                dom,
            ],
        )
    };
    let o = add("mem1", "rack-a");
    assert!(o.status.success(), "{}", text(&o));
    assert!(add("mem2", "rack-b").status.success());
    let o = add("mem1", "rack-c");
    assert!(!o.status.success());
    assert!(
        text(&o).contains("peer \"mem1\" is already registered"),
        "{}",
        text(&o)
    );
    let o = ublkctl(dir.path(), &["peer", "list"]);
    let out = text(&o);
    assert!(
        out.contains("mem1") && out.contains("rack-b") && out.contains("64G"),
        "{out}"
    );
    let o = ublkctl(dir.path(), &["--json", "peer", "list"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["peers"][1]["id"], "mem2");
    assert_eq!(v["peers"][1]["used"], 0);
    let (ok, out) = etcd.etcdctl(&["get", "/ublk/peers/mem2", "--print-value-only"]);
    assert!(ok && out.contains("\"failure_domain\":\"rack-b\""), "{out}");
    let o = ublkctl(dir.path(), &["peer", "del", "mem1"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = ublkctl(dir.path(), &["peer", "del", "mem1"]);
    assert!(
        text(&o).contains("no peer \"mem1\" is registered"),
        "{}",
        text(&o)
    );
    let o = ublkctl(dir.path(), &["--json", "peer", "list"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["peers"].as_array().unwrap().len(), 1);
    // The writer lease is this ublkd's: its id is in the state dir, and
    // the metrics say it is valid; revoked, it is counted lost and a new
    // one is taken.
    let scrape = || http_get(&metrics, "/metrics").1;
    let has = |body: &str, sample: &str| body.lines().any(|l| l == sample);
    let body = scrape();
    assert!(has(&body, "ublk_writer_lease_valid 1"), "{body}");
    assert!(has(&body, "ublk_writer_leases_lost_total 0"), "{body}");
    assert!(
        has(
            &body,
            "ublk_membership_epoch_changes_total{reason=\"created\"} 0"
        ),
        "{body}"
    );
    let lease: i64 = std::fs::read_to_string(dir.path().join("state/writer-lease"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let (ok, out) = etcd.etcdctl(&["lease", "revoke", &format!("{lease:x}")]);
    assert!(ok, "{out}");
    eventually(Duration::from_secs(30), "the loss is counted", || {
        has(&scrape(), "ublk_writer_leases_lost_total 1")
    });
    eventually(Duration::from_secs(30), "a new lease is valid", || {
        has(&scrape(), "ublk_writer_lease_valid 1")
    });
    let renewed = std::fs::read_to_string(dir.path().join("state/writer-lease")).unwrap();
    assert_ne!(renewed.trim(), lease.to_string());
}

#[test]
fn without_etcd_the_peer_commands_name_the_missing_section() {
    let dir = tempfile::tempdir().unwrap();
    let d = Ublkd::start(dir.path(), "");
    let metrics = d.metrics.clone();
    let (_, body) = http_get(&metrics, "/metrics");
    assert!(
        !body.contains("ublk_writer_lease_valid"),
        "no [etcd], no family"
    );
    let o = ublkctl(dir.path(), &["--json", "peer", "list"]);
    assert!(!o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "bad_request");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no [etcd] section"),
        "{v}"
    );
}
