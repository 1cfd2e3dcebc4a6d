//! The shipped unit files, checked with `systemd-analyze`: `verify` (the
//! units parse and name executables that exist) and `security --offline`
//! (the hardening exposure score does not get worse than recorded). The
//! units name the installed paths (/usr/local/bin/...); verify insists that
//! executables exist, so the test rewrites that prefix to a temp dir holding
//! the built `ublkd` and `ublkctl` (ublkd's ExecReload) and a stand-in
//! `arenad` (arenad lives in another crate).
//! Whether the `Documentation=` man pages and files exist is checked where
//! they are installed: the package test (scripts/test-package).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

fn systemd_analyze() -> Option<&'static str> {
    ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

/// Exposure scores of `systemd-analyze security --offline=yes` (systemd 252),
/// 0 (locked down) to 10. Lower them when the units get tighter; a change
/// that raises one must say why.
const EXPOSURE: [(&str, f64); 2] = [("ublkd.service", 2.8), ("arenad.service", 1.6)];

/// The unit files as installed, with executables that exist: returns the
/// temp dir (keep it alive) and the rewritten unit paths.
fn installed_units() -> (tempfile::TempDir, Vec<std::path::PathBuf>) {
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ublkd"), bin.join("ublkd")).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ublkctl"), bin.join("ublkctl")).unwrap();
    // arenad's binaries are another package's: stand-ins that exist.
    for name in ["arenad", "arenactl"] {
        std::fs::write(bin.join(name), "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(bin.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut paths = Vec::new();
    for name in ["ublkd.service", "arenad.service", "ublk-etcd.service"] {
        let text = std::fs::read_to_string(units.join(name)).unwrap();
        let text = text.replace("/usr/local/bin/", &format!("{}/", bin.display()));
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        paths.push(p);
    }
    (dir, paths)
}

#[test]
fn units_pass_systemd_analyze_verify() {
    let Some(analyze) = systemd_analyze() else {
        panic!("systemd-analyze is not installed (apt-get install systemd)");
    };
    let (_dir, paths) = installed_units();
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .args(&paths)
        .env("SYSTEMD_LOG_LEVEL", "warning")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Lines about other units on the build host (not ours) are not our problem.
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("ublkd") || l.contains("arenad") || l.contains("ublk-etcd"))
        .collect();
    assert!(
        out.status.success() && ours.is_empty(),
        "systemd-analyze verify failed (status {}):\n{stderr}",
        out.status
    );
}

#[test]
fn hardening_exposure_does_not_regress() {
    let analyze = systemd_analyze().expect("systemd-analyze is not installed");
    let (_dir, paths) = installed_units();
    for (unit, recorded) in EXPOSURE {
        let path = paths.iter().find(|p| p.ends_with(unit)).unwrap();
        let out = Command::new(analyze)
            .args(["security", "--offline=yes", "--no-pager"])
            .arg(path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let score: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("→ Overall exposure level for {unit}: ")))
            .and_then(|rest| rest.split(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "no exposure score for {unit}:\n{text}{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        assert!(
            score <= recorded,
            "{unit}: exposure {score} is above the recorded {recorded}:\n{text}"
        );
    }
}

/// `DeviceAllow=` takes a node path or a /proc/devices group (`char-NAME`,
/// `block-NAME`), and silently allows nothing for a path that does not exist
/// when the unit starts, such as a glob. PrivateDevices= would hide
/// /dev/infiniband and the run-time /dev/ublkcN nodes altogether.
#[test]
fn units_admit_the_ublk_and_rdma_device_nodes() {
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let want: [(&str, &[&str]); 2] = [
        (
            "ublkd.service",
            &[
                "/dev/ublk-control rw",
                "char-ublk-char rw",
                "block-blkext rw",
                "char-infiniband_verbs rw",
            ],
        ),
        ("arenad.service", &["char-infiniband_verbs rw"]),
    ];
    for (unit, allowed) in want {
        let text = std::fs::read_to_string(units.join(unit)).unwrap();
        let setting = |key: &str| -> Vec<&str> {
            text.lines()
                .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
                .collect()
        };
        assert!(
            !setting("PrivateDevices").contains(&"yes"),
            "{unit}: PrivateDevices=yes hides the device nodes"
        );
        assert_eq!(setting("DevicePolicy"), ["closed"], "{unit}");
        let got = setting("DeviceAllow");
        for a in allowed {
            assert!(got.contains(a), "{unit} lacks DeviceAllow={a}: {got:?}");
        }
        for g in &got {
            assert!(
                !g.contains(['*', '?'])
                    && (g.starts_with("/dev/")
                        || g.starts_with("char-")
                        || g.starts_with("block-")),
                "{unit}: DeviceAllow={g} cannot match at run time"
            );
        }
    }
}

#[test]
fn the_example_ublkd_config_is_accepted_by_the_daemon() {
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/ublkd.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_ublkd"))
        .arg("--config")
        .arg(&cfg)
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_bad_config_stops_the_daemon_with_the_key_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("ublkd.toml");
    std::fs::write(&cfg, "[device]\ndepth = 100000\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ublkd"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid config: device.depth = 100000: must be between 1 and 4096"),
        "{err}"
    );
}
