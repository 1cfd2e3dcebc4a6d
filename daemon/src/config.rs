//! `ublkd.toml`: every key, its default, and the checks that stop a bad
//! value at startup with a message naming the key and the reason.
//! `docs/OPERATIONS.md` documents the same keys for operators.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use target_rdma::service::size::{serde_size, HumanSize};
pub use ublk_metrics::events::LogFormat;

/// Where the packaged service looks for its config.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/ublkd/ublkd.toml";

/// Largest per-tag I/O buffer libublk accepts.
pub const MAX_IO_BUF: u64 = 1 << 20;
/// Largest queue depth the ublk driver accepts.
pub const MAX_DEPTH: u32 = 4096;
/// Most hardware queues the ublk driver accepts.
pub const MAX_QUEUES: u32 = 4096;
/// Most requests one device may have in flight (queues x depth): the size
/// bound of its request tracker table.
pub const MAX_TRACKED: usize = ublk_metrics::tracker::MAX_SLOTS;

pub use target_rdma::service::config_file::ConfigError;
use target_rdma::service::config_file::{invalid, listen_setting, parse_toml};

/// What SIGTERM does with live devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnShutdown {
    /// Leave the kernel devices in place (quiesced) so the next `ublkd`
    /// recovers them; I/O waits meanwhile instead of failing.
    Keep,
    /// Delete the devices and their definitions.
    Remove,
}

impl OnShutdown {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Remove => "remove",
        }
    }
}

impl std::fmt::Display for OnShutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The transport a device is configured for (`transport = tcp|rdma|auto`):
/// a choice, of which the data path it negotiates is one outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransportChoice {
    /// Inline on the TCP control stream.
    Tcp,
    /// One-sided RDMA, or a clear error when the device is added.
    Rdma,
    /// RDMA when a local device is present and the peer grants it, else TCP.
    Auto,
}

impl TransportChoice {
    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma => "rdma",
            Self::Auto => "auto",
        }
    }
}

/// The whole `ublkd` configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UblkdConfig {
    /// Device definitions live in `<state_dir>/devices/<id>.json`.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Control socket path.
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// Group allowed to use the socket (mode 0660); root only (0600) when unset.
    #[serde(default)]
    pub socket_group: Option<String>,
    /// Control-socket connections served at once (a thread each); more
    /// are closed at accept, so a script that leaks connections cannot
    /// exhaust threads.
    #[serde(default = "default_socket_max_connections")]
    pub socket_max_connections: usize,
    /// What SIGTERM does with devices.
    #[serde(default = "default_on_shutdown")]
    pub on_shutdown: OnShutdown,
    /// `text` or `json` log lines on stderr (`--log-format` overrides it).
    #[serde(default = "default_log_format")]
    pub log_format: LogFormat,
    /// Log filter (`info`, `debug`, `ublkd=debug,info`, ...); `RUST_LOG`
    /// overrides it. Reloaded on SIGHUP.
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Limit for connecting to and authenticating with `arenad`, in ms.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Limit for each arena request, in ms; a request past it fails with ETIMEDOUT.
    #[serde(default = "default_request_timeout")]
    pub request_timeout_ms: u64,
    /// How long a queue thread keeps looking for the answer (TCP) or the
    /// completion (RDMA) of a request in flight before it sleeps until one
    /// arrives, in µs (0: sleep at once). Spinning trades a core's time
    /// for latency: an answer that arrives within it costs no sleep and no
    /// wake-up.
    #[serde(default)]
    pub busy_poll_us: u64,
    /// Defaults for new devices.
    #[serde(default)]
    pub device: DeviceDefaults,
    /// The metrics listener and the request trackers.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Which RDMA device `rdma` and `auto` devices use.
    #[serde(default)]
    pub rdma: RdmaConfig,
    // --- replication ---
    /// The coordination service of replicated volumes; absent: the static
    /// fallback (memberships in the state dir, one host only).
    #[serde(default)]
    pub etcd: Option<crate::coordination::EtcdConfig>,
    /// How replicated devices wait and rebuild.
    #[serde(default)]
    pub replication: crate::coordination::ReplicationConfig,
    // --- end replication ---
    /// Sampled request spans.
    #[serde(default)]
    pub tracing: TracingConfig,
}

/// `[tracing]`: sampled spans of block requests (`span.request`,
/// `span.attempt` log records) and the exemplars they give
/// `/metrics/openmetrics`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// Off by default.
    #[serde(default)]
    pub enabled: bool,
    /// Requests per million kept by the head sample, besides every failed,
    /// timed-out, cancelled and slow (`[metrics] slow_threshold_ms`) one.
    #[serde(default = "default_sample_rate_ppm")]
    pub sample_rate_ppm: u32,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            sample_rate_ppm: default_sample_rate_ppm(),
        }
    }
}

impl TracingConfig {
    /// Checks every `[tracing]` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.sample_rate_ppm > ublk_metrics::trace::MAX_SAMPLE_RATE_PPM {
            return Err(invalid(
                "tracing.sample_rate_ppm",
                self.sample_rate_ppm,
                "must be between 0 and 1000000 (every request)",
            ));
        }
        Ok(())
    }
}

/// `[rdma]`: the local RDMA device of `transport = rdma|auto` devices.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RdmaConfig {
    /// Device name (`rxe0`, `mlx5_0`); unset takes the first device with an
    /// active port.
    #[serde(default)]
    pub device: Option<String>,
    /// Port number; unset takes the device's first active port.
    #[serde(default)]
    pub port: Option<u8>,
    /// GID table index; unset means 1 (the IPv4-mapped RoCEv2 GID on
    /// soft-RoCE; index 0, link-local, fails at connect).
    #[serde(default)]
    pub gid_index: Option<u8>,
    /// Two devices, one per rail (each on the link to the arena peer's
    /// device of the same rail), instead of `device`; empty: one rail.
    #[serde(default)]
    pub rails: Vec<String>,
    /// With two rails up, a payload of at least this many bytes is split
    /// across both.
    #[serde(default = "default_stripe_bytes", with = "serde_size")]
    pub stripe_bytes: u64,
    /// How long one RDMA transfer may take before its rail counts as lost
    /// (its QP is failed; the transfer moves to the other rail, or to
    /// TCP), in ms; unset: `request_timeout_ms`, at most 5000.
    #[serde(default)]
    pub transfer_timeout_ms: Option<u64>,
    /// Leases each queue keeps across requests: a READ or WRITE of a blob
    /// whose lease is cached moves its payload with no control round trip.
    /// Each pins an arena slot at the peer (which revokes them under
    /// pressure).
    #[serde(default = "default_lease_cache")]
    pub lease_cache: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: None,
            gid_index: None,
            rails: Vec::new(),
            stripe_bytes: default_stripe_bytes(),
            transfer_timeout_ms: None,
            lease_cache: DEFAULT_LEASE_CACHE,
        }
    }
}

fn default_lease_cache() -> usize {
    DEFAULT_LEASE_CACHE
}

fn default_stripe_bytes() -> u64 {
    128 << 10
}

/// An RDMA device name as sysfs holds it.
fn valid_device(d: &str) -> bool {
    !d.is_empty() && d.len() <= 64 && !d.contains('/')
}

/// Longest `busy_poll_us`: a spin past it costs more than it saves.
pub const MAX_BUSY_POLL_US: u64 = 10_000;
/// `[rdma] lease_cache` when unset.
pub const DEFAULT_LEASE_CACHE: usize = 256;
/// Largest `[rdma] lease_cache` (per queue).
pub const MAX_LEASE_CACHE: usize = 65_536;

impl RdmaConfig {
    /// The device of each rail these keys describe, by rail index.
    pub fn selectors(&self) -> Vec<target_rdma::rdma::DeviceSelector> {
        let d = target_rdma::rdma::DeviceSelector::default();
        let select = |device: Option<String>| target_rdma::rdma::DeviceSelector {
            device: device.or(d.device.clone()),
            port: self.port.or(d.port),
            gid_index: self.gid_index.unwrap_or(d.gid_index),
        };
        if self.rails.is_empty() {
            vec![select(self.device.clone())]
        } else {
            self.rails.iter().cloned().map(Some).map(select).collect()
        }
    }

    /// The limit for one RDMA transfer, given the request timeout.
    pub fn transfer_timeout(&self, request_timeout: std::time::Duration) -> std::time::Duration {
        self.transfer_timeout_ms.map_or(
            request_timeout.min(std::time::Duration::from_secs(5)),
            std::time::Duration::from_millis,
        )
    }

    /// Checks every `[rdma]` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.device {
            if !valid_device(d) {
                return Err(invalid(
                    "rdma.device",
                    d,
                    "must be an RDMA device name such as \"rxe0\" or \"mlx5_0\"",
                ));
            }
        }
        if self.port == Some(0) {
            return Err(invalid("rdma.port", 0, "must be between 1 and 255"));
        }
        self.validate_rails()?;
        if !(4096..=16 << 20).contains(&self.stripe_bytes) {
            return Err(invalid(
                "rdma.stripe_bytes",
                HumanSize(self.stripe_bytes),
                "must be from 4K to 16M",
            ));
        }
        if let Some(ms) = self
            .transfer_timeout_ms
            .filter(|ms| !(10..=60_000).contains(ms))
        {
            return Err(invalid(
                "rdma.transfer_timeout_ms",
                ms,
                "must be in 10..=60000",
            ));
        }
        if self.lease_cache > MAX_LEASE_CACHE {
            return Err(invalid(
                "rdma.lease_cache",
                self.lease_cache,
                format!("must be at most {MAX_LEASE_CACHE}"),
            ));
        }
        Ok(())
    }

    fn validate_rails(&self) -> Result<(), ConfigError> {
        let rails = &self.rails;
        if rails.is_empty() {
            return Ok(());
        }
        let shown = format!("{rails:?}");
        let problem = if self.device.is_some() {
            Some("names the rails' devices: leave rdma.device unset")
        } else if rails.len() != target_rdma::proto::MAX_RAILS {
            Some("must name two devices, one per rail (one rail: set rdma.device)")
        } else if rails.iter().any(|d| !valid_device(d)) || rails[0] == rails[1] {
            Some("must name two different RDMA devices such as [\"mlx5_0\", \"mlx5_1\"]")
        } else {
            None
        };
        match problem {
            Some(p) => Err(invalid("rdma.rails", shown, p)),
            None => Ok(()),
        }
    }

    /// Leases each queue caches.
    pub fn lease_cache(&self) -> usize {
        self.lease_cache
    }
}

/// `[metrics]`: the Prometheus/health listener and the request trackers.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `IP:port` of the metrics listener (`/metrics`, `/health`, `/live`,
    /// `/ready`, `/diagnostics`); `""` or `"off"` disables it.
    #[serde(default = "default_metrics_listen")]
    pub listen: String,
    /// Adds a `device` label to the device I/O families (small hosts only:
    /// it multiplies their series by the number of devices).
    #[serde(default)]
    pub per_device_labels: bool,
    /// Seconds between two scans of the in-flight request trackers.
    #[serde(default = "default_scan_interval")]
    pub scan_interval_secs: u64,
    /// Age in seconds at which an in-flight request counts as stalled.
    #[serde(default = "default_stall_threshold")]
    pub stall_threshold_secs: u64,
    /// Requests completing at or above this many ms log `request.slow`
    /// (and, with `[tracing] enabled`, keep their spans); 0 disables both.
    #[serde(default = "default_slow_threshold")]
    pub slow_threshold_ms: u64,
    /// Serves `/metrics/openmetrics` (OpenMetrics 1.0 with exemplars of
    /// retained traces); `/metrics` stays the Prometheus text format.
    #[serde(default)]
    pub openmetrics: bool,
    /// Connections the metrics listener holds open; past it a new one
    /// sheds the oldest that has not sent its request yet. One descriptor
    /// each.
    #[serde(default = "default_http_max_connections")]
    pub max_connections: usize,
    /// Seconds from accept to a complete request head, however slowly
    /// the client sends it; then the connection is closed (408).
    #[serde(default = "default_http_request_timeout")]
    pub request_timeout_secs: u64,
    /// Seconds from a complete request head until its answer has been
    /// built and read by the client; then the connection is closed.
    #[serde(default = "default_http_write_timeout")]
    pub write_timeout_secs: u64,
}

impl MetricsConfig {
    /// The listener address, `None` when the listener is disabled (or,
    /// before [`validate`](Self::validate), not an address).
    pub fn listen_addr(&self) -> Option<&str> {
        listen_setting("metrics.listen", &self.listen, "127.0.0.1:9477")
            .ok()
            .flatten()
    }

    /// The listener limits these keys set.
    pub fn http(&self) -> ublk_metrics::HttpConfig {
        ublk_metrics::HttpConfig::with_limits(
            self.max_connections,
            self.request_timeout_secs,
            self.write_timeout_secs,
        )
    }

    /// Checks every `[metrics]` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        listen_setting("metrics.listen", &self.listen, "127.0.0.1:9477")?;
        if !(1..=65_536).contains(&self.max_connections) {
            return Err(invalid(
                "metrics.max_connections",
                self.max_connections,
                "must be between 1 and 65536",
            ));
        }
        for (key, v) in [
            ("metrics.request_timeout_secs", self.request_timeout_secs),
            ("metrics.write_timeout_secs", self.write_timeout_secs),
        ] {
            if !(1..=300).contains(&v) {
                return Err(invalid(key, v, "must be between 1 and 300"));
            }
        }
        if !(1..=300).contains(&self.scan_interval_secs) {
            return Err(invalid(
                "metrics.scan_interval_secs",
                self.scan_interval_secs,
                "must be between 1 and 300",
            ));
        }
        if !(1..=86_400).contains(&self.stall_threshold_secs) {
            return Err(invalid(
                "metrics.stall_threshold_secs",
                self.stall_threshold_secs,
                "must be between 1 and 86400",
            ));
        }
        if self.slow_threshold_ms > 3_600_000 {
            return Err(invalid(
                "metrics.slow_threshold_ms",
                self.slow_threshold_ms,
                "must be between 0 (off) and 3600000",
            ));
        }
        Ok(())
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        // Same as an empty `[metrics]` table.
        toml::from_str("").unwrap_or_else(|_| unreachable!("every key has a default"))
    }
}

/// `[device]`: parameters of new devices. `ublkctl add` overrides queues,
/// depth, io_buf, blob_size and transport per device, and `--confidential`
/// makes one device confidential.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceDefaults {
    /// Hardware queues (one thread and one arena connection each).
    #[serde(default = "default_queues")]
    pub queues: u32,
    /// Requests in flight per queue.
    #[serde(default = "default_depth")]
    pub depth: u32,
    /// Per-request buffer; also the largest I/O the kernel sends.
    #[serde(default = "default_io_buf", with = "serde_size")]
    pub io_buf: u64,
    /// Blob size asked of the volume; 0 accepts the volume's own.
    #[serde(default, with = "serde_size")]
    pub blob_size: u64,
    /// `tcp`, `rdma` or `auto`.
    #[serde(default = "default_transport")]
    pub transport: TransportChoice,
    /// New devices are confidential: every frame of their sessions sealed
    /// (protocol version 3, TCP only). `ublkctl add --confidential` sets it
    /// for one device.
    #[serde(default)]
    pub confidential: bool,
    /// Logical block size: 512, 1024, 2048 or 4096.
    #[serde(default = "default_lbs")]
    pub logical_block_size: u32,
    /// Physical block size: a power of two from the logical block size to 64K.
    #[serde(default = "default_pbs")]
    pub physical_block_size: u32,
    /// Largest request the kernel may send; at most `io_buf`. 0 means `io_buf`.
    #[serde(default, with = "serde_size")]
    pub max_io_size: u64,
    /// Advertise DISCARD.
    #[serde(default = "yes")]
    pub discard: bool,
    /// Largest DISCARD; a multiple of 512.
    #[serde(default = "default_max_discard", with = "serde_size")]
    pub max_discard_size: u64,
    /// Advertise WRITE_ZEROES.
    #[serde(default = "yes")]
    pub write_zeroes: bool,
    /// Largest WRITE_ZEROES; a multiple of 512.
    #[serde(default = "default_max_discard", with = "serde_size")]
    pub max_write_zeroes_size: u64,
    /// Advertise a volatile write cache, so FLUSH is the durability point.
    #[serde(default = "yes")]
    pub write_cache: bool,
    /// Advertise FUA (needs `write_cache`).
    #[serde(default = "yes")]
    pub fua: bool,
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/ublkd")
}
fn default_socket() -> PathBuf {
    PathBuf::from("/run/ublkd/ublkd.sock")
}
fn default_socket_max_connections() -> usize {
    64
}
fn default_on_shutdown() -> OnShutdown {
    OnShutdown::Keep
}
fn default_log_format() -> LogFormat {
    LogFormat::Text
}
fn default_log_level() -> String {
    "info".into()
}
fn default_connect_timeout() -> u64 {
    5000
}
fn default_request_timeout() -> u64 {
    30000
}
fn default_http_max_connections() -> usize {
    ublk_metrics::http::DEFAULT_MAX_CONNECTIONS
}
fn default_http_request_timeout() -> u64 {
    ublk_metrics::http::DEFAULT_REQUEST_TIMEOUT_SECS
}
fn default_http_write_timeout() -> u64 {
    ublk_metrics::http::DEFAULT_WRITE_TIMEOUT_SECS
}
fn default_metrics_listen() -> String {
    "127.0.0.1:9477".into()
}
fn default_scan_interval() -> u64 {
    5
}
fn default_stall_threshold() -> u64 {
    30
}
fn default_slow_threshold() -> u64 {
    5000
}
fn default_sample_rate_ppm() -> u32 {
    100
}
fn default_queues() -> u32 {
    1
}
fn default_depth() -> u32 {
    64
}
fn default_io_buf() -> u64 {
    512 << 10
}
fn default_transport() -> TransportChoice {
    TransportChoice::Auto
}
fn default_lbs() -> u32 {
    512
}
fn default_pbs() -> u32 {
    4096
}
fn default_max_discard() -> u64 {
    1 << 30
}
fn yes() -> bool {
    true
}

impl Default for DeviceDefaults {
    fn default() -> Self {
        // Same as an empty `[device]` table.
        toml::from_str("").unwrap_or_else(|_| unreachable!("every key has a default"))
    }
}

impl UblkdConfig {
    /// `busy_poll_us` as a duration.
    pub fn busy_poll(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.busy_poll_us)
    }

    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let cfg: Self = target_rdma::service::config_file::load_toml(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses and validates `text` (read from `path`, named in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: Self = parse_toml(text, path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration with every default.
    pub fn defaults() -> Self {
        toml::from_str("").unwrap_or_else(|_| unreachable!("every key has a default"))
    }

    /// Checks every key; the first bad one is reported.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.state_dir.is_absolute() {
            return Err(invalid(
                "state_dir",
                self.state_dir.display(),
                "must be an absolute path",
            ));
        }
        if !self.socket.is_absolute() {
            return Err(invalid(
                "socket",
                self.socket.display(),
                "must be an absolute path",
            ));
        }
        if let Some(g) = &self.socket_group {
            if g.is_empty() {
                return Err(invalid(
                    "socket_group",
                    "\"\"",
                    "must name a group; leave the key out for root-only access",
                ));
            }
        }
        if !(1..=1024).contains(&self.socket_max_connections) {
            return Err(invalid(
                "socket_max_connections",
                self.socket_max_connections,
                "must be in 1..=1024",
            ));
        }
        if let Err(why) = ublk_metrics::events::check_filter(&self.log_level) {
            return Err(invalid("log_level", format!("{:?}", self.log_level), why));
        }
        if !(100..=600_000).contains(&self.connect_timeout_ms) {
            return Err(invalid(
                "connect_timeout_ms",
                self.connect_timeout_ms,
                "must be between 100 and 600000",
            ));
        }
        if self.busy_poll_us > MAX_BUSY_POLL_US {
            return Err(invalid(
                "busy_poll_us",
                self.busy_poll_us,
                format!("must be at most {MAX_BUSY_POLL_US}"),
            ));
        }
        if !(100..=600_000).contains(&self.request_timeout_ms) {
            return Err(invalid(
                "request_timeout_ms",
                self.request_timeout_ms,
                "must be between 100 and 600000",
            ));
        }
        self.device.validate()?;
        self.rdma.validate()?;
        self.tracing.validate()?;
        // --- replication ---
        if let Some(e) = &self.etcd {
            e.validate()?;
        }
        self.replication.validate()?;
        // --- end replication ---
        self.metrics.validate()
    }
}

/// Checks queues, depth, io_buf and blob_size, which `ublkctl add` may
/// override and which therefore are checked again per request.
pub fn check_geometry(
    queues: u32,
    depth: u32,
    io_buf: u64,
    blob_size: u64,
) -> Result<(), ConfigError> {
    if !(1..=MAX_QUEUES).contains(&queues) {
        return Err(invalid(
            "device.queues",
            queues,
            format!("must be between 1 and {MAX_QUEUES}"),
        ));
    }
    if !(1..=MAX_DEPTH).contains(&depth) {
        return Err(invalid(
            "device.depth",
            depth,
            format!("must be between 1 and {MAX_DEPTH}"),
        ));
    }
    if u64::from(queues) * u64::from(depth) > MAX_TRACKED as u64 {
        return Err(invalid(
            "device.depth",
            depth,
            format!("queues x depth must be at most {MAX_TRACKED} (one request tracker slot each)"),
        ));
    }
    if !(4096..=MAX_IO_BUF).contains(&io_buf) || !io_buf.is_multiple_of(4096) {
        return Err(invalid(
            "device.io_buf",
            HumanSize(io_buf),
            "must be a multiple of 4K between 4K and 1M",
        ));
    }
    if blob_size != 0 && (!blob_size.is_power_of_two() || !(4096..=16 << 20).contains(&blob_size)) {
        return Err(invalid(
            "device.blob_size",
            HumanSize(blob_size),
            "must be 0 (the volume's) or a power of two from 4K to 16M",
        ));
    }
    Ok(())
}

impl DeviceDefaults {
    /// Checks every `[device]` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_geometry(self.queues, self.depth, self.io_buf, self.blob_size)?;
        if ![512, 1024, 2048, 4096].contains(&self.logical_block_size) {
            return Err(invalid(
                "device.logical_block_size",
                self.logical_block_size,
                "must be 512, 1024, 2048 or 4096",
            ));
        }
        let pbs = self.physical_block_size;
        if !pbs.is_power_of_two() || pbs < self.logical_block_size || pbs > 65536 {
            return Err(invalid(
                "device.physical_block_size",
                pbs,
                "must be a power of two from logical_block_size to 65536",
            ));
        }
        if self.max_io_size != 0
            && (self.max_io_size > self.io_buf
                || !self
                    .max_io_size
                    .is_multiple_of(u64::from(self.logical_block_size)))
        {
            return Err(invalid(
                "device.max_io_size",
                HumanSize(self.max_io_size),
                "must be 0 (io_buf) or a multiple of logical_block_size no larger than io_buf",
            ));
        }
        for (key, v) in [
            ("device.max_discard_size", self.max_discard_size),
            ("device.max_write_zeroes_size", self.max_write_zeroes_size),
        ] {
            if v == 0 || !v.is_multiple_of(512) || v >> 9 > u64::from(u32::MAX) {
                return Err(invalid(
                    key,
                    HumanSize(v),
                    "must be a non-zero multiple of 512 below 2T",
                ));
            }
        }
        if self.confidential && self.transport == TransportChoice::Rdma {
            return Err(invalid(
                "device.confidential",
                true,
                "needs device.transport = \"tcp\" or \"auto\" (a confidential device's payloads stay on the sealed TCP stream; RDMA moves them in the clear)",
            ));
        }
        if self.fua && !self.write_cache {
            return Err(invalid(
                "device.fua",
                true,
                "needs device.write_cache = true (FUA means nothing without a volatile cache)",
            ));
        }
        Ok(())
    }

    /// The largest request the kernel may send.
    pub fn effective_max_io(&self, io_buf: u64) -> u64 {
        if self.max_io_size == 0 {
            io_buf
        } else {
            self.max_io_size.min(io_buf)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        UblkdConfig::parse(text, Path::new("/etc/ublkd/ublkd.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn empty_file_gives_documented_defaults() {
        let c = UblkdConfig::parse("", Path::new("x")).unwrap();
        assert_eq!(c.state_dir, Path::new("/var/lib/ublkd"));
        assert_eq!(c.socket, Path::new("/run/ublkd/ublkd.sock"));
        assert_eq!(c.on_shutdown, OnShutdown::Keep);
        assert_eq!(c.socket_group, None);
        assert_eq!(c.device.queues, 1);
        assert_eq!(c.device.depth, 64);
        assert_eq!(c.device.io_buf, 512 << 10);
        assert_eq!(c.device.transport, TransportChoice::Auto);
        assert!(c.device.write_cache && c.device.fua && c.device.discard);
        assert_eq!(c.metrics.listen_addr(), Some("127.0.0.1:9477"));
        assert!(!c.metrics.per_device_labels);
        assert_eq!(c.metrics.scan_interval_secs, 5);
        assert_eq!(c.metrics.stall_threshold_secs, 30);
        assert_eq!(c.metrics.slow_threshold_ms, 5000);
        assert!(!c.metrics.openmetrics);
        assert_eq!(
            (
                c.metrics.max_connections,
                c.metrics.request_timeout_secs,
                c.metrics.write_timeout_secs
            ),
            (256, 5, 10)
        );
        assert!(!c.tracing.enabled);
        assert_eq!(c.tracing.sample_rate_ppm, 100);
    }

    #[test]
    fn the_sample_rate_is_at_most_every_request() {
        let c = UblkdConfig::parse(
            "[tracing]\nenabled = true\nsample_rate_ppm = 1000000\n",
            Path::new("x"),
        )
        .unwrap();
        assert!(c.tracing.enabled);
        assert_eq!(
            err("[tracing]\nsample_rate_ppm = 1000001\n"),
            "invalid config: tracing.sample_rate_ppm = 1000001: \
             must be between 0 and 1000000 (every request)"
        );
    }

    #[test]
    fn the_rdma_device_keys_select_and_are_checked() {
        let c = UblkdConfig::parse("", Path::new("x")).unwrap();
        assert_eq!(
            c.rdma.selectors(),
            [target_rdma::rdma::DeviceSelector::default()]
        );
        let c = UblkdConfig::parse(
            "[rdma]\ndevice = \"rxe0\"\nport = 1\ngid_index = 3\n",
            Path::new("x"),
        )
        .unwrap();
        let sel = &c.rdma.selectors()[0];
        assert_eq!(
            (sel.device.as_deref(), sel.port, sel.gid_index),
            (Some("rxe0"), Some(1), 3)
        );
        assert_eq!(
            err("[rdma]\nport = 0\n"),
            "invalid config: rdma.port = 0: must be between 1 and 255"
        );
        assert!(err("[rdma]\ndevice = \"\"\n").starts_with("invalid config: rdma.device = : "));
        assert!(err("[rdma]\nspeed = 1\n").contains("speed"));
    }

    #[test]
    fn two_rails_name_two_devices_and_their_keys_are_checked() {
        let c = UblkdConfig::parse(
            "[rdma]\nrails = [\"rxe0\", \"rxe1\"]\ngid_index = 1\nstripe_bytes = \"256K\"\ntransfer_timeout_ms = 500\n",
            Path::new("x"),
        )
        .unwrap();
        let devices: Vec<_> = c.rdma.selectors().into_iter().map(|s| s.device).collect();
        assert_eq!(devices, [Some("rxe0".into()), Some("rxe1".into())]);
        assert_eq!(c.rdma.stripe_bytes, 256 << 10);
        let request = std::time::Duration::from_secs(30);
        assert_eq!(
            c.rdma.transfer_timeout(request),
            std::time::Duration::from_millis(500)
        );
        let one = UblkdConfig::parse("", Path::new("x")).unwrap();
        assert_eq!(
            one.rdma.transfer_timeout(request),
            std::time::Duration::from_secs(5),
            "unset: the request timeout, at most 5 s"
        );
        for (bad, says) in [
            ("rails = [\"rxe0\"]", "two devices"),
            ("rails = [\"rxe0\", \"rxe0\"]", "two different"),
            ("rails = [\"rxe0\", \"a/b\"]", "two different"),
            (
                "device = \"rxe0\"\nrails = [\"a\", \"b\"]",
                "leave rdma.device unset",
            ),
            ("stripe_bytes = 100", "from 4K to 16M"),
            ("transfer_timeout_ms = 5", "10..=60000"),
        ] {
            let e = err(&format!("[rdma]\n{bad}\n"));
            assert!(e.contains("rdma.") && e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_queue_polling_keys_default_and_are_bounded() {
        let c = UblkdConfig::parse("", Path::new("x")).unwrap();
        assert_eq!(c.busy_poll(), std::time::Duration::ZERO);
        assert_eq!(c.rdma.lease_cache(), DEFAULT_LEASE_CACHE);
        let c = UblkdConfig::parse(
            "busy_poll_us = 50\n[rdma]\nlease_cache = 0\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(c.busy_poll(), std::time::Duration::from_micros(50));
        assert_eq!(c.rdma.lease_cache(), 0, "0 caches no lease");
        assert_eq!(
            err("busy_poll_us = 10001\n"),
            "invalid config: busy_poll_us = 10001: must be at most 10000"
        );
        assert_eq!(
            err("[rdma]\nlease_cache = 65537\n"),
            "invalid config: rdma.lease_cache = 65537: must be at most 65536"
        );
    }

    #[test]
    fn the_metrics_listener_can_be_turned_off() {
        for off in ["\"\"", "\"off\""] {
            let c = UblkdConfig::parse(&format!("[metrics]\nlisten = {off}\n"), Path::new("x"))
                .unwrap();
            assert_eq!(c.metrics.listen_addr(), None);
        }
        let c = UblkdConfig::parse("[metrics]\nlisten = \"[::1]:0\"\n", Path::new("x")).unwrap();
        assert_eq!(c.metrics.listen_addr(), Some("[::1]:0"));
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let text = include_str!("../../systemd/ublkd.toml");
        UblkdConfig::parse(text, Path::new("systemd/ublkd.toml")).unwrap();
    }

    #[test]
    fn sizes_accept_strings_and_integers() {
        let c = UblkdConfig::parse(
            "[device]\nio_buf = \"256K\"\nblob_size = 65536\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(c.device.io_buf, 256 << 10);
        assert_eq!(c.device.blob_size, 65536);
    }

    #[test]
    fn bad_values_name_the_key_and_the_reason() {
        assert_eq!(
            err("[device]\ndepth = 0"),
            "invalid config: device.depth = 0: must be between 1 and 4096"
        );
        assert_eq!(
            err("[device]\nqueues = 512\ndepth = 4096"),
            "invalid config: device.depth = 4096: queues x depth must be at most 1048576 (one request tracker slot each)"
        );
        assert_eq!(
            err("[device]\nqueues = 5000"),
            "invalid config: device.queues = 5000: must be between 1 and 4096"
        );
        assert_eq!(
            err("[device]\nio_buf = \"2M\""),
            "invalid config: device.io_buf = 2M: must be a multiple of 4K between 4K and 1M"
        );
        assert_eq!(
            err("[device]\nblob_size = \"3K\""),
            "invalid config: device.blob_size = 3K: must be 0 (the volume's) or a power of two from 4K to 16M"
        );
        assert_eq!(
            err("[device]\nlogical_block_size = 520"),
            "invalid config: device.logical_block_size = 520: must be 512, 1024, 2048 or 4096"
        );
        assert_eq!(
            err("[device]\nphysical_block_size = 256"),
            "invalid config: device.physical_block_size = 256: must be a power of two from logical_block_size to 65536"
        );
        assert_eq!(
            err("[device]\nmax_io_size = \"1M\""),
            "invalid config: device.max_io_size = 1M: must be 0 (io_buf) or a multiple of logical_block_size no larger than io_buf"
        );
        assert_eq!(
            err("[device]\nmax_discard_size = 100"),
            "invalid config: device.max_discard_size = 100: must be a non-zero multiple of 512 below 2T"
        );
        assert_eq!(
            err("[device]\nwrite_cache = false"),
            "invalid config: device.fua = true: needs device.write_cache = true (FUA means nothing without a volatile cache)"
        );
        assert_eq!(
            err("state_dir = \"var/lib\""),
            "invalid config: state_dir = var/lib: must be an absolute path"
        );
        assert_eq!(
            err("socket = \"ublkd.sock\""),
            "invalid config: socket = ublkd.sock: must be an absolute path"
        );
        assert_eq!(
            err("socket_group = \"\""),
            "invalid config: socket_group = \"\": must name a group; leave the key out for root-only access"
        );
        assert_eq!(
            err("socket_max_connections = 0"),
            "invalid config: socket_max_connections = 0: must be in 1..=1024"
        );
        let e = err("log_format = \"xml\"");
        assert!(
            e.contains("unknown variant `xml`, expected `text` or `json`"),
            "{e}"
        );
        let e = err("log_level = \"ublkd=loud\"");
        assert!(
            e.starts_with("invalid config: log_level = \"ublkd=loud\": "),
            "{e}"
        );
        assert_eq!(
            err("request_timeout_ms = 5"),
            "invalid config: request_timeout_ms = 5: must be between 100 and 600000"
        );
        assert_eq!(
            err("connect_timeout_ms = 0"),
            "invalid config: connect_timeout_ms = 0: must be between 100 and 600000"
        );
        assert_eq!(
            err("[metrics]\nlisten = \"localhost:9477\""),
            "invalid config: metrics.listen = \"localhost:9477\": must be IP:port (e.g. \"127.0.0.1:9477\"), or \"off\" to disable the listener"
        );
        assert_eq!(
            err("[metrics]\nmax_connections = 0"),
            "invalid config: metrics.max_connections = 0: must be between 1 and 65536"
        );
        assert_eq!(
            err("[metrics]\nrequest_timeout_secs = 0"),
            "invalid config: metrics.request_timeout_secs = 0: must be between 1 and 300"
        );
        assert_eq!(
            err("[metrics]\nscan_interval_secs = 0"),
            "invalid config: metrics.scan_interval_secs = 0: must be between 1 and 300"
        );
        assert_eq!(
            err("[metrics]\nstall_threshold_secs = 0"),
            "invalid config: metrics.stall_threshold_secs = 0: must be between 1 and 86400"
        );
        assert_eq!(
            err("[metrics]\nslow_threshold_ms = 3600001"),
            "invalid config: metrics.slow_threshold_ms = 3600001: must be between 0 (off) and 3600000"
        );
        let e = err("[metrics]\nper_device_labels = \"yes\"");
        assert!(e.contains("invalid type"), "{e}");
    }

    #[test]
    fn schema_errors_name_the_file_and_the_key() {
        let e = err("on_shutdown = \"explode\"");
        assert!(
            e.starts_with(
                "invalid config /etc/ublkd/ublkd.toml:1:15: on_shutdown: unknown variant `explode`"
            ),
            "{e}"
        );
        assert!(e.contains("expected `keep` or `remove`"), "{e}");
        let e = err("colour = 1");
        assert!(e.contains("unknown field `colour`"), "{e}");
        let e = err("[device]\ntransport = \"udp\"");
        assert!(e.contains("unknown variant `udp`"), "{e}");
        let e = err("[device]\nio_buf = \"12Q\"");
        assert!(e.contains("invalid size \"12Q\": unknown unit"), "{e}");
    }

    #[test]
    fn confidential_is_off_by_default_and_refuses_rdma() {
        let c = UblkdConfig::parse("", Path::new("x")).unwrap();
        assert!(!c.device.confidential);
        for transport in ["tcp", "auto"] {
            let c = UblkdConfig::parse(
                &format!("[device]\nconfidential = true\ntransport = \"{transport}\"\n"),
                Path::new("x"),
            )
            .unwrap();
            assert!(c.device.confidential, "{transport}");
        }
        assert_eq!(
            err("[device]\nconfidential = true\ntransport = \"rdma\"\n"),
            "invalid config: device.confidential = true: needs device.transport = \"tcp\" or \"auto\" \
             (a confidential device's payloads stay on the sealed TCP stream; RDMA moves them in the clear)"
        );
        let e = err("[device]\nconfidential = \"yes\"");
        assert!(e.contains("device.confidential: invalid type"), "{e}");
    }

    #[test]
    fn a_missing_file_is_a_read_error_naming_the_path() {
        let e = UblkdConfig::load(Path::new("/nonexistent/ublkd.toml")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot read config /nonexistent/ublkd.toml: "),
            "{e}"
        );
    }
}
