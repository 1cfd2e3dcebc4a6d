//! What operators read of both daemons, from the real processes: one JSON
//! log shape (the event's fields at the top level next to `timestamp`,
//! `level` and `target`), no ANSI colour codes when stderr is not a
//! terminal, and refusals to start that say each thing once, on one line,
//! without a backtrace even under `RUST_BACKTRACE=1`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use target_rdma::testing::{secret_file, SECRET_A};
use ublk_metrics::testing::spawn_with_log_lines;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `arenad` binary of this build, next to ublkd's. Cargo gives an
/// integration test only its own package's binaries, so this brings
/// arenad's up to date once (a no-op in a workspace run, which built it).
fn arenad_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let bin = Path::new(env!("CARGO_BIN_EXE_ublkd")).with_file_name("arenad");
            let profile = if bin.parent().is_some_and(|p| p.ends_with("release")) {
                "release"
            } else {
                "dev"
            };
            let ok = Command::new(env!("CARGO"))
                .args(["build", "--quiet", "-p", "target-rdma", "--bin", "arenad"])
                .args(["--profile", profile])
                .status()
                .unwrap()
                .success();
            assert!(ok && bin.exists(), "building {}", bin.display());
            bin
        })
        .clone()
}

/// The first stderr line of `cmd` containing `marker`.
fn line_with(cmd: &mut Command, marker: &str) -> String {
    let (child, lines) = spawn_with_log_lines(cmd.env_remove("RUST_LOG").env_remove("NO_COLOR"));
    let _child = Killed(child);
    let mut seen = Vec::new();
    loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no {marker} (or the daemon exited) after {seen:#?}"));
        if line.contains(marker) {
            return line;
        }
        seen.push(line);
    }
}

fn ublkd(dir: &Path, format: &str) -> String {
    let cfg = dir.join(format!("ublkd-{format}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\nsocket = \"{}\"\n[metrics]\nlisten = \"off\"\n",
            dir.join(format!("state-{format}")).display(),
            dir.join(format!("ublkd-{format}.sock")).display(),
        ),
    )
    .unwrap();
    line_with(
        Command::new(env!("CARGO_BIN_EXE_ublkd"))
            .arg("--config")
            .arg(&cfg)
            .args(["--log-format", format]),
        ublk_metrics::events::UBLKD_READY,
    )
}

fn arenad(dir: &Path, format: &str) -> String {
    let key = secret_file(dir, "a.key", SECRET_A);
    line_with(
        Command::new(arenad_bin())
            .args(["--config", "/dev/null", "--metrics-listen", "off"])
            .args(["--listen", "127.0.0.1:0", "--log-format", format])
            .args(["--arena-bytes", "1M", "--blob-bytes", "64K"])
            .args(["--swap-bytes", "8M", "--swap-dir"])
            .arg(dir.join(format!("swap-{format}")))
            .arg("--volume")
            .arg(format!("a:{}:4M", key.display())),
        target_rdma::arenad::events::ARENAD_READY,
    )
}

fn object(line: &str) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::from_str(line) {
        Ok(serde_json::Value::Object(m)) => m,
        other => panic!("not a JSON object ({other:?}): {line}"),
    }
}

#[test]
fn both_daemons_log_one_json_shape() {
    let dir = tempfile::tempdir().unwrap();
    let u = object(&ublkd(dir.path(), "json"));
    let a = object(&arenad(dir.path(), "json"));
    for (name, m) in [("ublkd", &u), ("arenad", &a)] {
        for key in ["timestamp", "level", "event"] {
            assert!(m[key].is_string(), "{name}: {key} missing: {m:?}");
        }
        assert!(!m.contains_key("fields"), "{name} nests fields: {m:?}");
        // No module path under `target`: events that name the I/O target
        // use that key.
        assert!(
            !m.contains_key("target"),
            "{name} has a module target: {m:?}"
        );
        assert_eq!(m["level"], "INFO", "{name}");
        // RFC 3339 in UTC, same precision.
        let ts = m["timestamp"].as_str().unwrap();
        assert!(
            ts.ends_with('Z') && ts.as_bytes()[10] == b'T',
            "{name}: {ts}"
        );
    }
    assert_eq!(
        u["timestamp"].as_str().unwrap().len(),
        a["timestamp"].as_str().unwrap().len(),
        "{u:?} / {a:?}"
    );
    let kinds = |m: &serde_json::Map<String, serde_json::Value>| {
        ["timestamp", "level", "event"].map(|k| m[k].is_string())
    };
    assert_eq!(kinds(&u), kinds(&a));
}

#[test]
fn text_logs_to_a_pipe_have_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    for line in [ublkd(dir.path(), "text"), arenad(dir.path(), "text")] {
        assert!(!line.contains('\u{1b}'), "escape codes in {line:?}");
        assert!(line.contains(" INFO "), "{line:?}");
    }
}

/// Runs `cmd` (expected to refuse) with `RUST_BACKTRACE=1` and returns its
/// stderr, checked: a failure status, one `<name>: ` line, no backtrace,
/// and no run of three words said twice.
fn refusal(name: &str, cmd: &mut Command) -> String {
    let out = cmd
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{name} accepted {cmd:?}: {err}");
    assert!(!err.contains("backtrace"), "{err}");
    let line = err.trim_end();
    assert!(
        line.starts_with(&format!("{name}: ")) && !line.contains('\n'),
        "{err}"
    );
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut seen = std::collections::HashSet::new();
    for w in words.windows(3) {
        assert!(seen.insert(w), "{:?} said twice in {line:?}", w.join(" "));
    }
    err
}

#[test]
fn refusals_say_each_thing_once_without_backtraces() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let key = secret_file(d, "a.key", SECRET_A);
    let open = secret_file(d, "open.key", SECRET_A);
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let short = secret_file(d, "short.key", "x");
    let file = d.join("a-file");
    std::fs::write(&file, "").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let toml = |name: &str, text: &str| {
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };

    let arenad = |args: &[&str], volume: &Path, listen: &str, swap: &Path| {
        let mut c = Command::new(arenad_bin());
        c.args(["--config", "/dev/null", "--metrics-listen", "off"])
            .args([
                "--listen",
                listen,
                "--arena-bytes",
                "1M",
                "--blob-bytes",
                "64K",
            ])
            .args(["--swap-bytes", "8M", "--swap-dir"])
            .arg(swap)
            .arg("--volume")
            .arg(format!("a:{}:4M", volume.display()))
            .args(args);
        c
    };
    let swap = d.join("swap");
    let lo = "127.0.0.1:0";
    let missing = d.join("missing.key");
    for (mut cmd, want) in [
        (arenad(&[], &missing, lo, &swap), "secret file"),
        (arenad(&[], &open, lo, &swap), "mode 0644"),
        (arenad(&[], &short, lo, &swap), "holds 1 bytes"),
        (arenad(&[], &key, &taken, &swap), "Address already in use"),
        // With metrics on: a port in use refuses before the metrics
        // listener is up, so no `metrics.listening` line comes first.
        (
            {
                let mut c = Command::new(arenad_bin());
                c.args(["--config", "/dev/null", "--metrics-listen", "127.0.0.1:0"])
                    .args(["--listen", &taken, "--arena-bytes", "1M"])
                    .args(["--blob-bytes", "64K", "--swap-bytes", "8M", "--swap-dir"])
                    .arg(&swap)
                    .arg("--volume")
                    .arg(format!("a:{}:4M", key.display()));
                c
            },
            "Address already in use",
        ),
        (arenad(&[], &key, lo, &file), "swap_dir"),
        (arenad(&["--check"], &missing, lo, &swap), "problem"),
        (
            {
                let mut c = Command::new(arenad_bin());
                c.arg("--config").arg(d.join("nope.toml"));
                c
            },
            "cannot read config",
        ),
        (
            {
                let mut c = Command::new(arenad_bin());
                c.arg("--config")
                    .arg(toml("bad-type.toml", "arena_bytes = true\n"));
                c
            },
            "bad-type.toml:1:15: arena_bytes: invalid type: boolean `true`, expected a size",
        ),
        (
            {
                let mut c = Command::new(env!("CARGO_BIN_EXE_ublkd"));
                c.arg("--config").arg(d.join("nope.toml"));
                c
            },
            "cannot read config",
        ),
        (
            {
                let mut c = Command::new(env!("CARGO_BIN_EXE_ublkd"));
                c.arg("--config")
                    .arg(toml("u.toml", "[device]\nio_buf = [1]\n"));
                c
            },
            "u.toml:2:10: device.io_buf: invalid type: sequence, expected a size",
        ),
        // A control socket that cannot be bound refuses the start before
        // the metrics listener is up.
        (
            {
                let mut c = Command::new(env!("CARGO_BIN_EXE_ublkd"));
                let text = format!(
                    "socket = \"{}/u.sock\"\nstate_dir = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
                    file.display(),
                    d.join("state").display()
                );
                c.arg("--config").arg(toml("sock.toml", &text));
                c
            },
            "a-file is not a directory",
        ),
        (
            {
                let mut c = Command::new(env!("CARGO_BIN_EXE_ublkctl"));
                c.arg("--socket").arg(d.join("none.sock")).arg("list");
                c
            },
            "ublkd is not running",
        ),
    ] {
        let name = Path::new(cmd.get_program())
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if want == "problem" {
            // --check prints its findings on stdout and exits 1.
            let out = cmd.output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(1), "{text}");
            let line = text.lines().find(|l| l.starts_with("problem: ")).unwrap();
            assert_eq!(line.matches("secret file").count(), 1, "{line}");
            continue;
        }
        let err = refusal(&name, &mut cmd);
        assert!(err.contains(want), "{want:?} not in {err}");
    }
}

/// With `--json`, a failure is one JSON object on stdout whatever failed:
/// ublkd's refusal carries its class, a failure of ublkctl itself (here no
/// daemon) the class `client`; the exit status is 1 and stderr says it
/// for people. A usage error exits 2.
#[test]
fn ublkctl_json_failures_are_json() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ublkctl"))
        .arg("--socket")
        .arg(dir.path().join("none.sock"))
        .args(["--json", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(v["error"]["kind"], "client", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("ublkd is not running")),
        "{v}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("ublkctl: "));
    let out = Command::new(env!("CARGO_BIN_EXE_ublkctl"))
        .args(["add", "--transport", "udp"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
}
