//! `ublkd`: the ublk device daemon. Loads its config, starts the metrics
//! listener, brings back the persisted devices, serves the control socket,
//! tells systemd it is ready, and on SIGTERM keeps or removes the devices as
//! configured.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use ublk_metrics::events::{init_logging_from_env, LogFormat};
use ublk_metrics::{CoordinationMetrics, Daemon, HttpConfig, MetricsServer, Telemetry};
use ublkd::config::{OnShutdown, UblkdConfig, DEFAULT_CONFIG_PATH};
use ublkd::control_socket;
use ublkd::device::Manager;
use ublkd::observability::Observability;

/// Serve ublk block devices backed by a remote arena (arenad).
#[derive(Parser, Debug)]
#[command(version)]
pub(crate) struct Args {
    /// Config file.
    #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Check the config and exit.
    #[arg(long)]
    check_config: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cfg = UblkdConfig::load(&args.config)?;
    if args.check_config {
        println!("{}: ok", args.config.display());
        return Ok(());
    }
    let format = if cfg.log_format == "json" {
        LogFormat::Json
    } else {
        LogFormat::Text
    };
    init_logging_from_env(format).context("setting up logging (RUST_LOG)")?;
    let on_shutdown = cfg.on_shutdown;
    let socket = cfg.socket.clone();
    let group = cfg.socket_group.clone();
    // Signals first, so a SIGTERM during a long restore is not lost.
    let mut signals = Signals::new([SIGTERM, SIGINT]).context("installing signal handlers")?;
    let tel = Telemetry::install(Daemon::Ublkd, env!("CARGO_PKG_VERSION"))?;
    let obs = Observability::new(Arc::clone(&tel), &cfg.metrics, &cfg.tracing);
    let _scanner = obs
        .scanner()
        .spawn()
        .context("starting the tracker scanner")?;
    // Up before the restore, so /ready answers (503) while devices come back.
    let _metrics = match cfg.metrics.listen_addr() {
        Some(addr) => match MetricsServer::start(addr, Arc::clone(&tel), HttpConfig::default()) {
            Ok(m) => {
                tracing::info!(event = "metrics.listening", addr = %m.local_addr());
                Some(m)
            }
            // Devices matter more than their metrics: keep serving, and let
            // the failed scrapes (and this event) say so.
            Err(e) => {
                tracing::error!(event = "metrics.listen_failed", error = %e);
                None
            }
        },
        None => None,
    };
    let with_etcd = cfg.etcd.is_some();
    let manager = Arc::new(Manager::new(cfg, Arc::clone(&obs))?);
    // --- replication (issue 11) ---
    let _coordination_metrics = with_etcd.then(|| {
        let m = CoordinationMetrics::new(&tel);
        let weak = Arc::downgrade(&manager);
        m.set_source(move || Some(weak.upgrade()?.coordination().ok()?.stats()));
        m
    });
    // --- end replication ---
    manager
        .spawn_peer_monitor()
        .context("starting the peer monitor")?;
    let listener = control_socket::bind(&socket, group.as_deref())?;
    manager.restore()?;
    {
        let m = Arc::clone(&manager);
        std::thread::Builder::new()
            .name("ublkd-accept".into())
            .spawn(move || control_socket::serve(listener, m))
            .context("starting the control socket thread")?;
    }
    obs.set_control_socket_up(true);
    if let Err(e) = target_rdma::sd_notify::notify("READY=1") {
        tracing::warn!(event = "sd_notify.failed", error = %e);
    }
    tracing::info!(event = "ublkd.ready", socket = %socket.display(), devices = manager.list().len());
    if let Some(sig) = signals.forever().next() {
        tracing::info!(event = "ublkd.signal", signal = sig);
    }
    let _ = target_rdma::sd_notify::notify("STOPPING=1");
    tel.begin_shutdown();
    match on_shutdown {
        OnShutdown::Keep => manager.shutdown_keep(),
        OnShutdown::Remove => manager.shutdown_remove(),
    }
    let _ = std::fs::remove_file(&socket);
    tracing::info!(event = "ublkd.exit", on_shutdown = ?on_shutdown);
    // Device threads are parked in the kernel; exiting closes their file
    // descriptors, which is what hands kept devices over to recovery.
    std::process::exit(0);
}
