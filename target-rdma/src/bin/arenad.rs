//! `arenad`: serves volumes of fixed-size blobs from a RAM arena backed by
//! an NVMe swap file, over the paging protocol (docs/PROTOCOL.md). SIGHUP
//! reloads the volumes, their secrets and the log filter; SIGTERM stops
//! after a final FLUSH.

use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tracing::{error, info};
use ublk_metrics::events::{effective_filter, init_logging, LogFormat};
use ublk_metrics::MetricsServer;

use target_rdma::arenad::admin_socket::{self, Admin};
use target_rdma::arenad::config::{ArenadConfig, DEFAULT_CONFIG_PATH};
use target_rdma::arenad::epochs::Epochs;
use target_rdma::arenad::events;
use target_rdma::arenad::listener::Reserved;
use target_rdma::arenad::observability::ArenadObservability;
use target_rdma::arenad::reload::{read_secrets, served, Runtime};
use target_rdma::arenad::server::{ServedRails, Server, ServerLimits, ServerRdma};
use target_rdma::rdma::open_provider;
use target_rdma::service::local_socket;
use target_rdma::service::sd_notify;
use target_rdma::service::size::parse_size;
use target_rdma::store::Store;

/// Remote RAM arena peer for ublkd: blobs in RAM, cold ones paged to a swap
/// file, FLUSHed data durable across crashes.
///
/// Settings come from the TOML config; each flag below overrides its key.
#[derive(Parser, Debug, Clone)]
#[command(name = "arenad", version)]
pub(crate) struct Args {
    /// Config file (TOML). Missing is an error unless it is the default path
    /// and the flags supply at least one --volume.
    #[arg(short, long, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Control-stream address, host:port [key: listen].
    #[arg(long)]
    listen: Option<String>,
    /// RAM arena size, e.g. 1G [key: arena_bytes].
    #[arg(long, value_parser = parse_size)]
    arena_bytes: Option<u64>,
    /// Blob size, power of two 4K..16M [key: blob_bytes].
    #[arg(long, value_parser = parse_size)]
    blob_bytes: Option<u64>,
    /// Directory for the swap file and index [key: swap_dir].
    #[arg(long)]
    swap_dir: Option<PathBuf>,
    /// Swap capacity, e.g. 64G [key: swap_bytes].
    #[arg(long, value_parser = parse_size)]
    swap_bytes: Option<u64>,
    /// Most concurrent connections [key: max_connections].
    #[arg(long)]
    max_connections: Option<u32>,
    /// Pipeline depth per connection [key: max_inflight].
    #[arg(long)]
    max_inflight: Option<u32>,
    /// Metrics listener, IP:port or "off" [key: metrics_listen].
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Add a volume: NAME:SECRET_FILE:QUOTA, e.g. vm1:/etc/arenad/vm1.key:64G
    /// [table: [[volume]]].
    #[arg(long = "volume", value_name = "NAME:SECRET_FILE:QUOTA")]
    volumes: Vec<String>,
    /// Log lines as text or json [key: log_format].
    #[arg(long, value_parser = LogFormat::parse)]
    log_format: Option<LogFormat>,
    /// Same as --log-format json (kept for existing scripts).
    #[arg(long, hide = true, conflicts_with = "log_format")]
    log_json: bool,
    /// Run every check a start makes (config, secret files, RDMA device
    /// for rdma = "on", swap_dir writable with room for its files and not
    /// in use, the store's index, journal, extent table and swap file read
    /// as a start reads them and nothing written, the epochs file, ports),
    /// print the effective configuration and the findings, and exit:
    /// non-zero when a start would refuse.
    #[arg(long)]
    check: bool,
    /// Rebuild the index of swap_dir from its extent headers (after arenad
    /// refused to start over a damaged or missing index), print what was and
    /// was not recovered, and exit: 0 when nothing was lost, 2 when some
    /// blobs could not be recovered. arenad must not be running.
    #[arg(long, conflicts_with = "check")]
    repair: bool,
}

fn load_config(args: &Args) -> Result<ArenadConfig> {
    let mut cfg = if args.config.exists()
        || args.config.as_os_str() != DEFAULT_CONFIG_PATH
        || args.volumes.is_empty()
    {
        ArenadConfig::load(&args.config)?
    } else {
        ArenadConfig::defaults()
    };
    if let Some(v) = &args.listen {
        cfg.listen = v.clone();
    }
    macro_rules! set {
        ($($f:ident),*) => {$( if let Some(v) = args.$f { cfg.$f = v; } )*};
    }
    set!(
        arena_bytes,
        blob_bytes,
        swap_bytes,
        max_connections,
        max_inflight
    );
    if let Some(v) = &args.swap_dir {
        cfg.swap_dir = v.clone();
    }
    if let Some(v) = &args.metrics_listen {
        cfg.metrics_listen = v.clone();
    }
    if let Some(f) = args.log_format {
        cfg.log_format = f;
    } else if args.log_json {
        cfg.log_format = LogFormat::Json;
    }
    for spec in &args.volumes {
        let parts: Vec<&str> = spec.splitn(3, ':').collect();
        let [name, file, quota] = parts[..] else {
            bail!("--volume {spec:?}: expected NAME:SECRET_FILE:QUOTA");
        };
        let quota = parse_size(quota).with_context(|| format!("--volume {spec:?}"))?;
        cfg.volumes.push(target_rdma::arenad::config::VolumeConfig {
            name: name.into(),
            secret_file: file.into(),
            quota,
            confidential: false,
        });
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Installs the metrics recorder and starts the listener (before the store
/// opens, so `/ready` says why it is not ready yet). A listener that cannot
/// bind is logged, not fatal: the arena matters more than its metrics.
fn start_observability(
    cfg: &ArenadConfig,
) -> Result<(Arc<ArenadObservability>, Option<MetricsServer>)> {
    let obs = ArenadObservability::install(env!("CARGO_PKG_VERSION"), cfg.volume_labels())?;
    let listener =
        cfg.metrics_listen_addr()
            .and_then(|addr| match obs.listen(addr, cfg.metrics_http()) {
                Ok(l) => {
                    info!(event = ublk_metrics::events::METRICS_LISTENING, addr = %l.local_addr());
                    Some(l)
                }
                Err(e) => {
                    error!(event = ublk_metrics::events::METRICS_LISTEN_FAILED, error = %e);
                    None
                }
            });
    Ok((obs, listener))
}

/// The config read again for a reload, or why it could not be.
fn reload_config(args: &Args) -> Result<ArenadConfig, String> {
    load_config(args).map_err(|e| target_rdma::service::error_chain::one_line(e.chain()))
}

/// Binds the admin socket and serves it on a thread of its own. One that
/// cannot be set up is logged, not fatal (like the metrics listener): the
/// arena matters more than its admin socket. The socket file is removed
/// when the returned guard drops, at a clean stop.
fn start_admin(
    path: &Path,
    group: Option<&str>,
    max_connections: usize,
    server: &Arc<Server>,
    runtime: &Arc<Runtime>,
    args: &Args,
) -> Option<SocketFile> {
    let listener = match local_socket::bind("arenad", path, group) {
        Ok(l) => l,
        Err(e) => {
            error!(event = events::ADMIN_UNAVAILABLE, error = %e, "serving without the admin socket: arenactl cannot reach this arenad");
            return None;
        }
    };
    let (runtime, args) = (Arc::clone(runtime), args.clone());
    let admin = Arc::new(Admin {
        server: Arc::clone(server),
        reload: Box::new(move |apply| {
            let cfg = reload_config(&args);
            if apply {
                runtime.reload(cfg)
            } else {
                runtime.check(cfg)
            }
        }),
        max_connections,
    });
    let spawned = std::thread::Builder::new()
        .name("arenad-admin".into())
        .spawn(move || admin_socket::serve(listener, admin));
    if let Err(e) = spawned {
        error!(event = events::ADMIN_UNAVAILABLE, error = %e, "serving without the admin socket: arenactl cannot reach this arenad");
        return None;
    }
    info!(event = events::ADMIN_LISTENING, path = %path.display());
    Some(SocketFile(path.to_owned()))
}

/// Removes the admin socket's file when dropped.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "arenad: {}",
                target_rdma::service::error_chain::one_line(e.chain())
            );
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<ExitCode> {
    let cfg = load_config(args)?;
    if args.check {
        let findings = target_rdma::arenad::check::run(&cfg);
        let code = target_rdma::service::preflight::print_check(&cfg, &args.config, &findings);
        return Ok(ExitCode::from(code));
    }
    let (filter, _) = effective_filter(&cfg.log_level);
    let log = init_logging(cfg.log_format, &filter).context("setting up logging")?;
    let secrets = read_secrets(&cfg.volumes)?;
    let (store_cfg, specs) = target_rdma::arenad::check::store_of(&cfg);
    if args.repair {
        let report = Store::repair(&store_cfg, &specs).context("repairing the arena store")?;
        println!("{report}");
        return Ok(ExitCode::from(if report.complete() { 0 } else { 2 }));
    }
    // Signals first: a SIGHUP or SIGTERM during the seconds of start-up
    // waits for the loop below instead of killing the process.
    let mut signals =
        Signals::new([SIGTERM, SIGINT, SIGHUP]).context("installing signal handlers")?;
    // Bound now (a port in use stops us before the metrics listener and
    // the work below), listening only once the server runs: until then
    // clients are refused at once.
    let listen: SocketAddr = cfg.listen.parse().context("listen")?;
    let reserved = Reserved::bind(listen).with_context(|| format!("listen on {listen}"))?;
    // 0700 whatever the umask, like the 0600 files the store creates in it.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cfg.swap_dir)
        .with_context(|| format!("swap_dir {}", cfg.swap_dir.display()))?;
    let (obs, _metrics) = start_observability(&cfg)?;
    let store = Arc::new(Store::open(store_cfg, &specs).context("opening the arena store")?);
    store.set_lease_limits(cfg.lease_limits());
    let epochs = Epochs::open(&cfg.swap_dir).context("loading the volumes' epochs")?;
    epochs
        .prepare()
        .context("allocating the volumes' epochs file")?;
    obs.store_opened(&store, cfg.volumes.len());
    let selectors = cfg.rdma_selectors();
    let mut rails = Vec::with_capacity(selectors.len());
    for (rail, sel) in selectors.iter().enumerate() {
        let opened =
            open_provider(cfg.rdma, sel).with_context(|| format!("rdma = \"on\": rail {rail}"))?;
        rails.push(match opened {
            Ok(provider) => {
                let r = ServerRdma::register(
                    provider,
                    &store,
                    cfg.max_inflight.max(16),
                    cfg.rdma_isolation,
                )
                .with_context(|| format!("registering the arena for RDMA on rail {rail}"))?;
                info!(event = events::RDMA_ENABLED, rail, device = %r.device_name(), isolation = r.isolation().name());
                Some(r)
            }
            Err(why) => {
                info!(event = events::RDMA_DISABLED, rail, reason = %why, "RDMA on this rail is declined; clients use the other rail or TCP");
                None
            }
        });
    }
    let rdma = ServedRails::new(rails).map_err(anyhow::Error::msg)?;
    let server = Server::new(
        Arc::clone(&store),
        served(&store, &cfg, &secrets)?,
        epochs,
        ServerLimits {
            max_connections: cfg.max_connections,
            max_inflight: cfg.max_inflight,
            handshake_timeout: Duration::from_secs(cfg.handshake_timeout_secs),
            allow_v1: cfg.allow_protocol_v1,
            max_unauthenticated: cfg.max_unauthenticated(),
            handshake_source_prefix_v4: cfg.handshake_source_prefix_v4,
            handshake_source_prefix_v6: cfg.handshake_source_prefix_v6,
            write_timeout: Duration::from_secs(cfg.write_timeout_secs),
            max_queued_frames: cfg.max_queued_frames as usize,
            max_queued_bytes: cfg.max_queued_bytes as usize,
            blocking_threads: cfg.blocking_threads as usize,
            promote_cold_after: cfg.promote_cold_after,
            shutdown_timeout: Duration::from_secs(cfg.shutdown_timeout_secs),
        },
        rdma,
        Arc::clone(&obs),
    )
    .context("starting the server")?;
    let admin = cfg.admin_socket_path().map(|path| {
        (
            path,
            cfg.admin_socket_group.clone(),
            cfg.admin_max_connections,
        )
    });
    let runtime = Arc::new(Runtime::new(
        cfg,
        secrets,
        log,
        Arc::clone(&store),
        Arc::clone(&server),
        Arc::clone(&obs),
    ));
    let _admin = admin.and_then(|(path, group, max_connections)| {
        start_admin(
            &path,
            group.as_deref(),
            max_connections,
            &server,
            &runtime,
            args,
        )
    });
    let stopper = Arc::clone(&server);
    let stopping = Arc::clone(&obs);
    let reload_args = args.clone();
    std::thread::spawn(move || {
        for sig in signals.forever() {
            if sig == SIGHUP {
                let _ = sd_notify::notify("RELOADING=1");
                // A bad config is logged by reload and changes nothing.
                let _ = runtime.reload(reload_config(&reload_args));
                let _ = sd_notify::notify("READY=1");
                continue;
            }
            info!(event = events::SHUTDOWN_REQUESTED, signal = sig);
            stopping.begin_shutdown();
            stopper.shutdown();
            return;
        }
    });
    let listener = reserved
        .listen()
        .with_context(|| format!("listen on {listen}"))?;
    obs.serving();
    info!(event = events::ARENAD_READY, listen = %listener.local_addr()?, generation = store.generation());
    sd_notify::notify("READY=1").context("notifying systemd")?;
    server.serve(listener).context("serving")?;
    sd_notify::notify("STOPPING=1").ok();
    store.flush().context("final flush")?;
    info!(event = events::ARENAD_STOPPED);
    Ok(ExitCode::SUCCESS)
}
