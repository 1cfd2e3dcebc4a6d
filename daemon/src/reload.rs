//! SIGHUP: ublkd re-reads its config and applies what can change while
//! devices run (the log filter, `on_shutdown`, the `[metrics]` listener
//! and its limits, scan interval and thresholds); every other changed key is logged as
//! needing a restart. A config that does not load or validate changes
//! nothing: the running one stays, and the error is logged.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use target_rdma::service::config_file::{changes, log_changes, Change};
use ublk_metrics::events::{self, LogControl};
use ublk_metrics::{HttpConfig, MetricsServer, Telemetry};

use crate::config::{ConfigError, OnShutdown, UblkdConfig};
use crate::observability::Observability;

/// Keys a reload applies; a change of any other key needs a restart.
pub const RELOADABLE: &[&str] = &[
    "log_level",
    "on_shutdown",
    "metrics.listen",
    "metrics.max_connections",
    "metrics.request_timeout_secs",
    "metrics.write_timeout_secs",
    "metrics.scan_interval_secs",
    "metrics.stall_threshold_secs",
    "metrics.slow_threshold_ms",
];

/// What a reload did.
#[derive(Debug, Default)]
pub struct Reloaded {
    /// Changes now in force.
    pub applied: Vec<Change>,
    /// Changes that take effect only after a restart.
    pub restart_needed: Vec<Change>,
}

/// The settings of a running ublkd that SIGHUP may change, and the
/// config they came from.
pub struct Runtime {
    path: PathBuf,
    log: LogControl,
    tel: Arc<Telemetry>,
    obs: Arc<Observability>,
    metrics: Mutex<Option<MetricsServer>>,
    /// The config in force: the loaded file with only the reloadable keys
    /// of later reloads applied, so a pending restart keeps being reported.
    running: Mutex<UblkdConfig>,
}

impl Runtime {
    /// The runtime of a daemon started from `cfg` (read from `path`), and
    /// its metrics listener started (a listener that cannot bind is
    /// logged, not fatal: devices matter more than their metrics).
    pub fn start(
        path: PathBuf,
        cfg: UblkdConfig,
        log: LogControl,
        tel: Arc<Telemetry>,
        obs: Arc<Observability>,
    ) -> Self {
        let metrics = listen(cfg.metrics.listen_addr(), &tel, cfg.metrics.http());
        Self {
            path,
            log,
            tel,
            obs,
            metrics: Mutex::new(metrics),
            running: Mutex::new(cfg),
        }
    }

    /// What SIGTERM does with devices, as now configured.
    pub fn on_shutdown(&self) -> OnShutdown {
        self.running.lock().on_shutdown
    }

    /// Re-reads the config file and applies it; `Err` leaves everything as
    /// it was. Logs what changed and what needs a restart.
    pub fn reload(&self) -> Result<Reloaded, ConfigError> {
        let new = match UblkdConfig::load(&self.path) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(event = events::CONFIG_RELOAD_FAILED, path = %self.path.display(), error = %e, "keeping the running configuration");
                return Err(e);
            }
        };
        let mut running = self.running.lock();
        let mut done = Reloaded::default();
        for change in changes(&*running, &new) {
            if RELOADABLE.contains(&change.key.as_str()) {
                done.applied.push(change);
            } else {
                done.restart_needed.push(change);
            }
        }
        let changed = |key: &str| done.applied.iter().any(|c| c.key == key);
        if changed("log_level") {
            self.log.apply_log_level(&new.log_level);
            running.log_level = new.log_level.clone();
        }
        running.on_shutdown = new.on_shutdown;
        let listener_keys = [
            "metrics.listen",
            "metrics.max_connections",
            "metrics.request_timeout_secs",
            "metrics.write_timeout_secs",
        ];
        if listener_keys.iter().any(|k| changed(k)) {
            let mut metrics = self.metrics.lock();
            // The old listener goes first: the new address may share its port.
            drop(metrics.take());
            *metrics =
                listen(new.metrics.listen_addr(), &self.tel, new.metrics.http()).or_else(|| {
                    listen(
                        running.metrics.listen_addr(),
                        &self.tel,
                        running.metrics.http(),
                    )
                });
            if metrics.is_some() || new.metrics.listen_addr().is_none() {
                running.metrics.listen = new.metrics.listen.clone();
                running.metrics.max_connections = new.metrics.max_connections;
                running.metrics.request_timeout_secs = new.metrics.request_timeout_secs;
                running.metrics.write_timeout_secs = new.metrics.write_timeout_secs;
            }
        }
        running.metrics.scan_interval_secs = new.metrics.scan_interval_secs;
        running.metrics.stall_threshold_secs = new.metrics.stall_threshold_secs;
        running.metrics.slow_threshold_ms = new.metrics.slow_threshold_ms;
        self.obs.apply(&running.metrics);
        log_changes(&done.applied, &done.restart_needed, "ublkd");
        tracing::info!(
            event = events::CONFIG_RELOADED,
            path = %self.path.display(),
            applied = done.applied.len(),
            restart_needed = done.restart_needed.len()
        );
        Ok(done)
    }
}

/// Starts the metrics listener on `addr` (`None`: disabled).
fn listen(addr: Option<&str>, tel: &Arc<Telemetry>, http: HttpConfig) -> Option<MetricsServer> {
    let addr = addr?;
    match MetricsServer::start(addr, Arc::clone(tel), http) {
        Ok(m) => {
            tracing::info!(event = events::METRICS_LISTENING, addr = %m.local_addr());
            Some(m)
        }
        Err(e) => {
            tracing::error!(event = events::METRICS_LISTEN_FAILED, error = %e);
            None
        }
    }
}
