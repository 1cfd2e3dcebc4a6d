//! The real `ublkd` binary for a test: started on a config of its own in a
//! temp dir, its metrics listener on a free port, killed when dropped.

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use ublk_metrics::events;
use ublk_metrics::testing::{addr_after, spawn_with_log_lines};

/// A running ublkd.
pub struct Ublkd {
    child: Child,
    /// Where its metrics listener answers.
    pub metrics: String,
}

impl Ublkd {
    /// Starts ublkd with its state dir and control socket (`ublkd.sock`) in
    /// `dir`, metrics on 127.0.0.1:0, plus `extra` config lines; returns
    /// once it logged `ublkd.ready`.
    pub fn start(dir: &Path, extra: &str) -> Self {
        let cfg = dir.join("ublkd.toml");
        std::fs::write(
            &cfg,
            format!(
                "state_dir = \"{}\"\nsocket = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n{extra}",
                dir.join("state").display(),
                dir.join("ublkd.sock").display()
            ),
        )
        .unwrap();
        let (child, rx) = spawn_with_log_lines(
            Command::new(env!("CARGO_BIN_EXE_ublkd"))
                .arg("--config")
                .arg(&cfg)
                .env("RUST_LOG", "info"),
        );
        let mut metrics = None;
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("ublkd logs its start (or exited)");
            metrics = metrics.or_else(|| addr_after(&line, events::METRICS_LISTENING));
            if line.contains(events::UBLKD_READY) {
                break;
            }
        }
        Self {
            child,
            metrics: metrics.expect("metrics.listening logged before ublkd.ready"),
        }
    }
}

impl Ublkd {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Ublkd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
