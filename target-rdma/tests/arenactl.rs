//! `arenactl` against the real `arenad` process over its admin socket:
//! volumes and sessions as an operator sees them, sessions ended by id,
//! volume and peer (logged and counted), a reload that fails with the
//! reason while arenad keeps serving, a check that changes nothing.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::arenad::{terminate, Arenad};
use common::log_lines::until;
use common::*;
use futures::executor::block_on;
use serde_json::Value;
use target_rdma::arenad::events as arenad_events;
use target_rdma::blob::BlobIo;

const BLOB: usize = 64 << 10;

fn arenactl(p: &Arenad, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arenactl"))
        .arg("--socket")
        .arg(&p.admin)
        .args(args)
        .output()
        .unwrap()
}

/// `arenactl --json ARGS`, which must succeed.
fn json(p: &Arenad, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = arenactl(p, &all);
    assert!(
        out.status.success(),
        "arenactl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn sessions(p: &Arenad, volume: Option<&str>) -> Vec<Value> {
    let mut args = vec!["sessions"];
    if let Some(v) = volume {
        args.extend(["--volume", v]);
    }
    json(p, &args)["sessions"].as_array().unwrap().clone()
}

fn volume<'a>(all: &'a Value, name: &str) -> &'a Value {
    all["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name} in {all}"))
}

/// Waits until `volume` has `n` sessions (a disconnected session leaves
/// the table once its connection task ends).
fn wait_sessions(p: &Arenad, volume: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = sessions(p, Some(volume)).len();
        if now == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{volume} kept {now} sessions, want {n}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_operator_sees_volumes_and_sessions_and_ends_them() {
    let dir = tempfile::tempdir().unwrap();
    let p = Arenad::new(dir.path(), "512K", "64K", "64M", None);
    let (proc_, lines) = p.spawn_logged(&[]);
    until(&lines, arenad_events::ADMIN_LISTENING);
    let mode = std::fs::metadata(&p.admin).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "root-only without admin_socket_group");

    let a1 = p.connect("a");
    let a2 = p.connect("a");
    let b = p.connect("b");
    // More blobs than the 8-slot arena holds: some live on swap only.
    for key in 0..12 {
        block_on(a1.write(key, 0, &pattern(key, 1, BLOB))).unwrap();
    }
    block_on(b.write(1, 0, &pattern(1, 2, BLOB))).unwrap();
    assert_eq!(block_on(b.raise_epoch(3)).unwrap(), 3);
    block_on(a1.flush()).unwrap();

    let all = json(&p, &["volumes"]);
    let a = volume(&all, "a");
    assert_eq!(a["blobs"], 12);
    assert_eq!(a["sessions"], 2);
    assert_eq!(a["quota_bytes"], 1u64 << 30);
    assert_eq!(a["served"], true);
    assert_eq!(a["confidential"], false);
    let (resident, on_swap) = (
        a["resident"].as_u64().unwrap(),
        a["on_swap"].as_u64().unwrap(),
    );
    assert!(resident <= 8, "{a}");
    assert!(
        resident + on_swap >= 12,
        "every blob is in RAM or on swap: {a}"
    );
    assert_eq!(volume(&all, "b")["blobs"], 1);
    assert_eq!(
        (a["epoch"].as_u64(), volume(&all, "b")["epoch"].as_u64()),
        (Some(0), Some(3))
    );
    // The same per volume in /metrics.
    let a_ = [("volume", "a")];
    assert_eq!(p.metric("arenad_volume_sessions", &a_), 2.0);
    assert_eq!(p.metric("arenad_volume_sessions", &[("volume", "b")]), 1.0);
    assert_eq!(
        p.metric(
            "arenad_volume_requests_total",
            &[("volume", "a"), ("op", "write")]
        ),
        12.0
    );
    assert!(
        p.metric(
            "arenad_volume_bytes_total",
            &[("volume", "a"), ("op", "write")]
        ) >= (12 * BLOB) as f64
    );
    // Sampled at the scrape, after the listing: the cleaner may have moved
    // blobs since, never lost one.
    let ram = p.metric("arenad_volume_resident_bytes", &a_);
    let swap = p.metric("arenad_volume_swap_bytes", &a_);
    assert!(
        ram <= (8 * BLOB) as f64 && ram + swap >= (12 * BLOB) as f64,
        "{ram} {swap}"
    );
    assert_eq!(
        p.metric("arenad_volume_quota_bytes", &a_),
        (1u64 << 30) as f64
    );
    assert_eq!(p.metric("arenad_volume_errors_total", &a_), 0.0);
    assert_eq!(volume(&all, "b")["sessions"], 1);
    let text = String::from_utf8(arenactl(&p, &["volumes"]).stdout).unwrap();
    assert!(text.starts_with("VOLUME"), "{text}");
    assert!(
        text.lines().next().unwrap().contains("CONFIDENTIAL"),
        "{text}"
    );
    assert!(text.lines().any(|l| l.starts_with("a ")), "{text}");

    let of_a = sessions(&p, Some("a"));
    assert_eq!(of_a.len(), 2, "{of_a:?}");
    let writer = of_a
        .iter()
        .max_by_key(|s| s["bytes_in"].as_u64().unwrap())
        .unwrap();
    assert!(
        writer["bytes_in"].as_u64().unwrap() >= 12 * BLOB as u64,
        "{writer}"
    );
    assert_eq!(writer["transport"], "tcp");
    assert_eq!(writer["volume"], "a");
    assert!(writer["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert_eq!(sessions(&p, None).len(), 3);

    // One session by id: it ends, the other of "a" goes on.
    let id = writer["id"].as_u64().unwrap().to_string();
    let out = arenactl(&p, &["disconnect", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("ended 1 session(s): {id}\n")
    );
    wait_sessions(&p, "a", 1);
    let other = if writer["id"] == of_a[0]["id"] {
        &a2
    } else {
        &a1
    };
    let mut out = vec![0u8; BLOB];
    block_on(other.read(0, 0, &mut out)).unwrap();
    assert_eq!(out, pattern(0, 1, BLOB));
    assert_eq!(p.metric("arenad_sessions_disconnected_total", &[]), 1.0);

    // A whole volume; a peer that holds nothing; an unknown id or volume.
    let ended = json(&p, &["disconnect", "--volume", "b"]);
    assert_eq!(ended["sessions"].as_array().unwrap().len(), 1);
    wait_sessions(&p, "b", 0);
    assert_eq!(p.metric("arenad_volume_sessions", &[("volume", "b")]), 0.0);
    let none = json(&p, &["disconnect", "--peer", "127.0.0.2"]);
    assert_eq!(none["sessions"].as_array().unwrap().len(), 0);
    for args in [
        &["disconnect", "999999"][..],
        &["sessions", "--volume", "zz"],
    ] {
        let out = arenactl(&p, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("see `arenactl"),
            "{args:?}"
        );
    }
    let out = arenactl(&p, &["disconnect", "--peer", "not-an-address"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(p.metric("arenad_sessions_disconnected_total", &[]), 2.0);
    drop((a1, a2, b));

    let stats = json(&p, &["stats"]);
    assert_eq!(stats["stats"]["details"]["store"], "open", "{stats}");
    terminate(proc_);
    assert!(!p.admin.exists(), "a clean stop removes the socket");
}

#[test]
fn reload_reports_its_outcome_and_check_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = Arenad::new(dir.path(), "512K", "64K", "64M", None);
    let (proc_, lines) = p.spawn_logged(&[]);
    until(&lines, arenad_events::ADMIN_LISTENING);
    let good = std::fs::read_to_string(&p.cfg).unwrap();

    let out = arenactl(&p, &["reload"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "reloaded: nothing changed\n"
    );

    // A broken file: check and reload both fail with the reason, and
    // arenad goes on serving the running configuration.
    std::fs::write(&p.cfg, format!("{good}\nblob_bytes = \"3K\"\n")).unwrap();
    for cmd in ["check", "reload"] {
        let out = arenactl(&p, &[cmd]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("blob_bytes"), "{cmd}: {err}");
        assert!(
            err.contains("the running configuration stays"),
            "{cmd}: {err}"
        );
    }
    // Found through the broken file itself (its admin_socket line), as
    // the unit's ExecReload does: the reason is arenad's.
    let out = Command::new(env!("CARGO_BIN_EXE_arenactl"))
        .arg("--config")
        .arg(&p.cfg)
        .args(["--json", "reload"])
        .env_remove("ARENACTL_SOCKET")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "config", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("running configuration stays"));
    drop(p.connect("a"));

    // A volume added: check says so and changes nothing; reload applies it.
    let c = secret_file(dir.path(), "c.key", "secret-of-volume-c-added-by-arenactl");
    std::fs::write(
        &p.cfg,
        format!(
            "{good}\n[[volume]]\nname = \"c\"\nsecret_file = \"{}\"\nquota = \"1M\"\n",
            c.display()
        ),
    )
    .unwrap();
    let check = String::from_utf8(arenactl(&p, &["check"]).stdout).unwrap();
    assert_eq!(check, "would apply: volume \"c\" added\n");
    let names = |v: &Value| -> Vec<String> {
        v["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(names(&json(&p, &["volumes"])), ["a", "b"]);
    let reload = String::from_utf8(arenactl(&p, &["reload"]).stdout).unwrap();
    assert_eq!(reload, "applied: volume \"c\" added\n");
    assert_eq!(names(&json(&p, &["volumes"])), ["a", "b", "c"]);
    terminate(proc_);
}

#[test]
fn arenactl_without_a_daemon_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_arenactl"))
        .arg("--socket")
        .arg(dir.path().join("none.sock"))
        .arg("volumes")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("arenad is not running"), "{err}");
}
