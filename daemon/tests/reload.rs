//! SIGHUP against the real `ublkd` process (no devices: this host has no
//! ublk driver): `[metrics]` settings, `log_level` and `on_shutdown`
//! applied while running, keys that need a restart named, a bad config
//! kept out, no exit 129.

mod common;

use std::path::Path;
use std::process::{Child, Command};

use common::log_lines::{has, until};
use ublk_metrics::events;
use ublk_metrics::testing::{addr_after, http_get as get, spawn_with_log_lines};

struct Ublkd(Child);

impl Ublkd {
    fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.0.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
}

impl Drop for Ublkd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn config(dir: &Path, extra: &str, metrics: &str) -> String {
    format!(
        "state_dir = \"{}\"\nsocket = \"{}\"\nlog_format = \"json\"\n{extra}\n[metrics]\n{metrics}\n",
        dir.join("state").display(),
        dir.join("ublkd.sock").display(),
    )
}

fn diag_metrics(addr: &str) -> serde_json::Value {
    let (code, body) = get(addr, "/diagnostics");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["details"]["metrics"].clone()
}

#[test]
fn sighup_applies_metrics_settings_and_keeps_a_bad_config_out() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("ublkd.toml");
    std::fs::write(&cfg, config(dir.path(), "", "listen = \"127.0.0.1:0\"")).unwrap();
    let (child, lines) = spawn_with_log_lines(
        Command::new(env!("CARGO_BIN_EXE_ublkd"))
            .arg("--config")
            .arg(&cfg)
            .env_remove("RUST_LOG"),
    );
    let daemon = Ublkd(child);
    let seen = until(&lines, events::UBLKD_READY);
    let first = seen
        .iter()
        .find_map(|l| addr_after(l, events::METRICS_LISTENING))
        .expect("metrics.listening before ublkd.ready");
    assert_eq!(
        diag_metrics(&first)["slow_threshold_ms"],
        5000,
        "the default"
    );

    // New thresholds, a listener on another port, a changed log level and
    // on_shutdown; state_dir needs a restart.
    let port = target_rdma::testing::free_port();
    let moved = config(
        dir.path(),
        "log_level = \"debug\"\non_shutdown = \"remove\"",
        &format!(
            "listen = \"127.0.0.1:{port}\"\nslow_threshold_ms = 250\nstall_threshold_secs = 7"
        ),
    )
    .replace("/state\"", "/elsewhere\"");
    std::fs::write(&cfg, &moved).unwrap();
    daemon.signal("HUP");
    let seen = until(&lines, events::CONFIG_RELOADED);
    let second = format!("127.0.0.1:{port}");
    let m = diag_metrics(&second);
    assert_eq!(
        (&m["slow_threshold_ms"], &m["stall_threshold_seconds"]),
        (&serde_json::json!(250), &serde_json::json!(7)),
        "{m}"
    );
    assert!(
        std::net::TcpStream::connect(&first).is_err(),
        "the old listener is closed"
    );
    for key in ["log_level", "on_shutdown", "metrics.slow_threshold_ms"] {
        assert!(
            has(&seen, events::CONFIG_CHANGED, &format!("\"key\":\"{key}\"")),
            "{key}: {seen:#?}"
        );
    }
    assert!(
        has(
            &seen,
            events::CONFIG_RESTART_NEEDED,
            "\"key\":\"state_dir\""
        ),
        "{seen:#?}"
    );

    // A config that does not validate changes nothing, and says why.
    std::fs::write(&cfg, moved.replace("= 250", "= 99999999")).unwrap();
    daemon.signal("HUP");
    let seen = until(&lines, events::CONFIG_RELOAD_FAILED);
    assert!(
        seen.last().unwrap().contains("metrics.slow_threshold_ms"),
        "{seen:#?}"
    );
    assert_eq!(diag_metrics(&second)["slow_threshold_ms"], 250);

    // SIGTERM does what the reloaded on_shutdown says, logged in its
    // config spelling.
    daemon.signal("TERM");
    let seen = until(&lines, events::UBLKD_EXIT);
    assert!(
        seen.last().unwrap().contains("\"on_shutdown\":\"remove\""),
        "{seen:#?}"
    );
}

/// `ublkctl reload` (the units' ExecReload) answers with the reload's
/// outcome: exit 0 listing what it applied and what needs a restart, exit
/// 1 naming what is wrong with a file that does not validate, after which
/// ublkd still serves with its running configuration.
#[test]
fn ublkctl_reload_reports_the_outcome_and_fails_on_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("ublkd.toml");
    std::fs::write(&cfg, config(dir.path(), "", "listen = \"off\"")).unwrap();
    let (child, lines) = spawn_with_log_lines(
        Command::new(env!("CARGO_BIN_EXE_ublkd"))
            .arg("--config")
            .arg(&cfg)
            .env_remove("RUST_LOG"),
    );
    let _daemon = Ublkd(child);
    until(&lines, events::UBLKD_READY);
    let ublkctl = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ublkctl"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap()
    };
    std::fs::write(
        &cfg,
        config(dir.path(), "on_shutdown = \"remove\"", "listen = \"off\"")
            .replace("/state\"", "/elsewhere\""),
    )
    .unwrap();
    let out = ublkctl(&["reload"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("applied         on_shutdown: keep -> remove"),
        "{text}"
    );
    assert!(text.contains("restart needed  state_dir: "), "{text}");

    // Wrong in one key; its `socket` still leads ublkctl to ublkd.
    std::fs::write(
        &cfg,
        config(
            dir.path(),
            "on_shutdown = \"sometimes\"",
            "listen = \"off\"",
        ),
    )
    .unwrap();
    let out = ublkctl(&["--json", "reload"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "config", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("on_shutdown") && message.contains("the running configuration stays"),
        "{message}"
    );
    // Still serving, on the running configuration (the socket it read
    // from the first file).
    let out = Command::new(env!("CARGO_BIN_EXE_ublkctl"))
        .arg("--socket")
        .arg(dir.path().join("ublkd.sock"))
        .arg("list")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
