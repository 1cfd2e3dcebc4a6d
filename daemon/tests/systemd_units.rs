//! `systemd-analyze verify` on the shipped unit files. The units name the
//! installed paths (/usr/local/bin/...); verify insists that executables
//! exist, so the test rewrites that prefix to a temp dir holding the built
//! `ublkd` and a stand-in `arenad` (arenad lives in another crate).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

fn systemd_analyze() -> Option<&'static str> {
    ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

#[test]
fn units_pass_systemd_analyze_verify() {
    let Some(analyze) = systemd_analyze() else {
        eprintln!("SKIP: systemd-analyze is not installed (apt-get install systemd); unit files not verified");
        return;
    };
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ublkd"), bin.join("ublkd")).unwrap();
    std::fs::write(bin.join("arenad"), "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(bin.join("arenad"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut paths = Vec::new();
    for name in ["ublkd.service", "arenad.service"] {
        let text = std::fs::read_to_string(units.join(name)).unwrap();
        let text = text.replace("/usr/local/bin/", &format!("{}/", bin.display()));
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        paths.push(p);
    }
    let out = Command::new(analyze)
        .arg("verify")
        .args(&paths)
        .env("SYSTEMD_LOG_LEVEL", "warning")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Lines about other units on the build host (not ours) are not our problem.
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("ublkd") || l.contains("arenad"))
        .collect();
    assert!(
        out.status.success() && ours.is_empty(),
        "systemd-analyze verify failed (status {}):\n{stderr}",
        out.status
    );
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
