//! `ublkd`: the ublk device daemon. Loads its config, starts the metrics
//! listener, brings back the persisted devices, serves the control socket,
//! tells systemd it is ready; SIGHUP reloads the config, SIGTERM keeps or
//! removes the devices as configured.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use ublk_metrics::events::{self, effective_filter, init_logging, LogFormat};
use ublk_metrics::{CoordinationMetrics, Daemon, ReplicaMetrics, Telemetry};
use ublkd::config::{OnShutdown, UblkdConfig, DEFAULT_CONFIG_PATH};
use ublkd::control_socket;
use ublkd::device::{Manager, UBLK_CONTROL};
use ublkd::observability::Observability;
use ublkd::reload::Runtime;

/// Serve ublk block devices backed by a remote arena (arenad).
#[derive(Parser, Debug)]
#[command(name = "ublkd", version)]
pub(crate) struct Args {
    /// Config file.
    #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Run every check a start makes (config, state_dir, control socket,
    /// ports, ublk driver, RDMA device), print the effective configuration
    /// and the findings, and exit: non-zero when a start would refuse.
    #[arg(long)]
    check_config: bool,
    /// Log lines as text or json [key: log_format].
    #[arg(long, value_parser = LogFormat::parse)]
    log_format: Option<LogFormat>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "ublkd: {}",
                target_rdma::service::error_chain::one_line(e.chain())
            );
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let mut cfg = UblkdConfig::load(&args.config)?;
    if let Some(f) = args.log_format {
        cfg.log_format = f;
    }
    if args.check_config {
        let findings = ublkd::check::run(&cfg);
        let code = target_rdma::service::preflight::print_check(&cfg, &args.config, &findings);
        return Ok(ExitCode::from(code));
    }
    let (filter, _) = effective_filter(&cfg.log_level);
    let log = init_logging(cfg.log_format, &filter).context("setting up logging")?;
    let socket = cfg.socket.clone();
    let group = cfg.socket_group.clone();
    let socket_max_connections = cfg.socket_max_connections;
    // Signals first, so a SIGTERM during a long restore is not lost, and a
    // SIGHUP meanwhile waits for the loop below instead of killing us.
    let mut signals =
        Signals::new([SIGTERM, SIGINT, SIGHUP]).context("installing signal handlers")?;
    let tel = Telemetry::install(Daemon::Ublkd, env!("CARGO_PKG_VERSION"))?;
    let obs = Observability::new(Arc::clone(&tel), &cfg.metrics, &cfg.tracing);
    obs.watch_driver(UBLK_CONTROL);
    let _scanner = obs
        .scanner()
        .spawn()
        .context("starting the tracker scanner")?;
    let runtime_cfg = cfg.clone();
    let with_etcd = cfg.etcd.is_some();
    // What can refuse a start comes before the metrics listener, so a
    // refused start does not announce one first.
    let manager = Arc::new(Manager::new(cfg, Arc::clone(&obs))?);
    let listener = control_socket::bind(&socket, group.as_deref())?;
    // Up before the restore, so /ready answers (503) while devices come back.
    let runtime = Runtime::start(
        args.config.clone(),
        runtime_cfg,
        log,
        Arc::clone(&tel),
        Arc::clone(&obs),
    );
    // --- replication ---
    let _coordination_metrics = with_etcd.then(|| {
        let m = CoordinationMetrics::new(&tel);
        let weak = Arc::downgrade(&manager);
        m.set_source(move || Some(weak.upgrade()?.coordination().ok()?.stats()));
        m
    });
    let replica_metrics = ReplicaMetrics::new(&tel);
    {
        let weak = Arc::downgrade(&manager);
        replica_metrics.set_source(move || {
            weak.upgrade()
                .map(|m| m.replica_stats())
                .unwrap_or_default()
        });
    }
    // --- end replication ---
    manager
        .spawn_peer_monitor()
        .context("starting the peer monitor")?;
    manager.restore()?;
    let runtime = Arc::new(runtime);
    let reload = {
        let runtime = Arc::clone(&runtime);
        move || {
            let _ = target_rdma::service::sd_notify::notify("RELOADING=1");
            let done = runtime.reload();
            let _ = target_rdma::service::sd_notify::notify("READY=1");
            done
        }
    };
    {
        let control = Arc::new(control_socket::Control {
            manager: Arc::clone(&manager),
            reload: Box::new(reload.clone()),
        });
        std::thread::Builder::new()
            .name("ublkd-accept".into())
            .spawn(move || control_socket::serve(listener, control, socket_max_connections))
            .context("starting the control socket thread")?;
    }
    obs.set_control_socket_up(true);
    if let Err(e) = target_rdma::service::sd_notify::notify("READY=1") {
        tracing::warn!(event = events::SD_NOTIFY_FAILED, error = %e);
    }
    tracing::info!(event = events::UBLKD_READY, socket = %socket.display(), devices = manager.list().len());
    for sig in signals.forever() {
        if sig == SIGHUP {
            // A bad config is logged by reload and changes nothing.
            let _ = reload();
            continue;
        }
        tracing::info!(event = events::UBLKD_SIGNAL, signal = sig);
        break;
    }
    let _ = target_rdma::service::sd_notify::notify("STOPPING=1");
    tel.begin_shutdown();
    let on_shutdown = runtime.on_shutdown();
    match on_shutdown {
        OnShutdown::Keep => manager.shutdown_keep(),
        OnShutdown::Remove => manager.shutdown_remove(),
    }
    let _ = std::fs::remove_file(&socket);
    tracing::info!(event = events::UBLKD_EXIT, on_shutdown = %on_shutdown);
    // Device threads are parked in the kernel; exiting closes their file
    // descriptors, which is what hands kept devices over to recovery.
    std::process::exit(0);
}
