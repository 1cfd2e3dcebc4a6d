//! `arenad.toml`: every key, its default, and the checks that stop a bad
//! value at startup with a message naming the key and the allowed range.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use ublk_metrics::events::LogFormat;

use crate::proto::{valid_volume_name, MAX_INLINE, MAX_RAILS};
pub use crate::service::config_file::ConfigError;
use crate::service::config_file::{invalid, listen_setting, load_toml, parse_toml};
use crate::service::size::{serde_size, HumanSize};

/// Where the packaged service looks for its config.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/arenad/arenad.toml";

/// The whole `arenad` configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ArenadConfig {
    /// `host:port` the control stream listens on.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// RAM arena size in bytes.
    #[serde(default = "default_arena", with = "serde_size")]
    pub arena_bytes: u64,
    /// Blob (slot) size: a power of two from 4K to 16M.
    #[serde(default = "default_blob", with = "serde_size")]
    pub blob_bytes: u64,
    /// Directory of the swap file and the index (journal + checkpoint).
    #[serde(default = "default_swap_dir")]
    pub swap_dir: PathBuf,
    /// Swap file capacity in bytes.
    #[serde(default = "default_swap", with = "serde_size")]
    pub swap_bytes: u64,
    /// Most reads of parts of cold blobs in flight on the swap's io_uring
    /// rings at once (over all worker threads); more wait for room. Each
    /// holds a buffer of the read's size while in flight.
    #[serde(default = "default_swap_reads_in_flight")]
    pub swap_reads_in_flight: u32,
    /// Most concurrent client connections; more are refused.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Most requests one connection may keep in flight (announced in CHALLENGE).
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u32,
    /// Seconds a new connection has to complete its HELLO.
    #[serde(default = "default_handshake_timeout")]
    pub handshake_timeout_secs: u64,
    /// RDMA: `"auto"` (register the arena when a device opens, else serve
    /// TCP and say so), `"on"` (a device or a startup error), `"off"`.
    #[serde(default)]
    pub rdma: crate::rdma::RdmaMode,
    /// RDMA device name (`rxe0`, `mlx5_0`); unset takes the first with an active port.
    #[serde(default)]
    pub rdma_device: Option<String>,
    /// Two RDMA devices, one per rail (a client names the rail its QP is
    /// for), instead of `rdma_device`; empty: one rail on `rdma_device`.
    #[serde(default)]
    pub rdma_rails: Vec<String>,
    /// RDMA port; unset takes the device's first active port.
    #[serde(default)]
    pub rdma_port: Option<u8>,
    /// GID index: 1 is the IPv4-mapped RoCEv2 GID on soft-RoCE.
    #[serde(default = "default_gid_index")]
    pub rdma_gid_index: u8,
    /// What an RDMA session's keys reach: `"lease"` (a protection domain
    /// per session, a memory region per lease over exactly its slot) or
    /// `"shared"` (one key to the whole arena for every session: no
    /// registration per lease, and every RDMA client is trusted with every
    /// volume). See OPERATIONS.md, *RDMA isolation*.
    #[serde(default)]
    pub rdma_isolation: crate::rdma::Isolation,
    /// `IP:port` of the metrics listener (`/metrics`, `/health`, `/live`,
    /// `/ready`, `/diagnostics`); `""` or `"off"` disables it.
    #[serde(default = "default_metrics_listen")]
    pub metrics_listen: String,
    /// `text` or `json` log lines on stderr (`--log-format` overrides it).
    #[serde(default = "default_log_format")]
    pub log_format: LogFormat,
    /// Log filter (`info`, `debug`, `target_rdma=debug,info`); `RUST_LOG`
    /// overrides it. Reloaded on SIGHUP.
    #[serde(default = "default_log_level")]
    pub log_level: String,
    // --- Multi-tenant serving: keys of the server's sessions. ---
    /// Accept protocol version 1 sessions (no frame tags, no membership
    /// epochs). Off by default: anyone on the path could otherwise inject
    /// frames into a session, or talk a client down to version 1.
    #[serde(default)]
    pub allow_protocol_v1: bool,
    /// Most connections still in their handshake (within
    /// `max_connections`): what unauthenticated sockets can hold. Unset:
    /// 64, or `max_connections` if that is smaller.
    #[serde(default)]
    pub max_unauthenticated: Option<u32>,
    /// IPv4 peers within one prefix of this length are one source of
    /// handshakes: when `max_unauthenticated` are all taken, a source
    /// holding fewer takes the oldest place of the source holding the most.
    /// 32: every address; 0: all of IPv4 one source.
    #[serde(default = "default_handshake_source_prefix_v4")]
    pub handshake_source_prefix_v4: u8,
    /// The same for IPv6 peers; 64: a host's usual subnet, since one host
    /// can easily use many of its addresses.
    #[serde(default = "default_handshake_source_prefix_v6")]
    pub handshake_source_prefix_v6: u8,
    /// Seconds a socket write to a client may block before the connection
    /// is ended (a client that does not read its answers).
    #[serde(default = "default_write_timeout")]
    pub write_timeout_secs: u64,
    // --- End of the multi-tenant serving keys. ---
    // --- Serving core: the event-driven server's bounds. ---
    /// Most frames (answers and REVOKEs) waiting in one connection's
    /// outbound queue. A REVOKE that finds it full disconnects the client
    /// (it is not reading); an answer waits for room.
    #[serde(default = "default_max_queued_frames")]
    pub max_queued_frames: u32,
    /// Most bytes waiting in one connection's outbound queue, and most
    /// bytes of request bodies one connection may have in flight: past it
    /// the connection's answers wait for room and its requests are not read.
    #[serde(default = "default_max_queued_bytes", with = "serde_size")]
    pub max_queued_bytes: u64,
    /// Threads that run the store calls that may block (a fault-in from
    /// swap, FLUSH, EPOCH, REMOVE, RAIL_CONNECT, a write that needs a slot);
    /// started with the server, so a thread limit cannot stop it later.
    #[serde(default = "default_blocking_threads")]
    pub blocking_threads: u32,
    /// A blob in swap that RDMA clients' GET_RESIDENTs find cold this many times
    /// while it is among the last blobs found cold is faulted into the
    /// arena in the background, so its reads go by RDMA again; until then
    /// each read is served inline at its own size from swap. 0: never.
    #[serde(default = "default_promote_cold_after")]
    pub promote_cold_after: u32,
    /// Seconds SIGTERM gives the connections to finish their requests and
    /// drain their answers before they are cut; the final flush follows.
    #[serde(default = "default_shutdown_timeout")]
    pub shutdown_timeout_secs: u64,
    // --- End of the serving core keys. ---
    // --- Metrics listener limits (HTTP endpoints). ---
    /// Connections the metrics listener holds open; past it a new one
    /// sheds the oldest that has not sent its request yet. One descriptor
    /// each.
    #[serde(default = "default_metrics_max_connections")]
    pub metrics_max_connections: usize,
    /// Seconds from accept to a complete request head on the metrics
    /// listener, however slowly it is sent; then the connection is closed.
    #[serde(default = "default_metrics_request_timeout")]
    pub metrics_request_timeout_secs: u64,
    /// Seconds from a complete request head until its answer has been
    /// built and read; then the connection is closed.
    #[serde(default = "default_metrics_write_timeout")]
    pub metrics_write_timeout_secs: u64,
    /// Label the per-volume families (`arenad_volume_*`) with each
    /// volume's name; `false` counts every volume under `_other`, for
    /// hosts whose volume names must not leave the host.
    #[serde(default = "default_true")]
    pub metrics_volume_labels: bool,
    /// Most volumes labelled by name, in the order they are first served
    /// (the configuration's order at start); the rest are counted together
    /// under `_other`, so the series stay bounded however many tenants
    /// there are.
    #[serde(default = "default_metrics_max_volume_labels")]
    pub metrics_max_volume_labels: usize,
    // --- End of the metrics listener limits. ---
    // --- Admin socket (arenactl). ---
    /// Path of the Unix socket `arenactl` talks to; `""` or `"off"`
    /// disables it. A socket that cannot be set up is logged and arenad
    /// serves without it.
    #[serde(default = "default_admin_socket")]
    pub admin_socket: String,
    /// Group whose members may use the admin socket (mode 0660); unset,
    /// root (or arenad's own user) only (0600).
    #[serde(default)]
    pub admin_socket_group: Option<String>,
    /// Admin connections served at once; more are closed at accept.
    #[serde(default = "default_admin_max_connections")]
    pub admin_max_connections: usize,
    // --- End of the admin socket keys. ---
    // --- Tenant fairness: how leases are shared. ---
    /// Leases a volume holds before its further leases are the first asked
    /// back for a volume under its own share. Unset: arena slots / served
    /// volumes (at least 1).
    #[serde(default)]
    pub volume_lease_share: Option<usize>,
    /// Most leases one connection holds at once. Unset: the arena's slots.
    #[serde(default)]
    pub connection_max_leases: Option<usize>,
    /// Milliseconds a revoked lease may stay out before it is ended by
    /// force (the holder's later COMMIT answers LEASE_LOST).
    #[serde(default = "default_revoke_deadline")]
    pub revoke_deadline_ms: u64,
    // --- End of the tenant fairness keys. ---
    /// The volumes this peer serves (SIGHUP adds, removes and rotates them).
    #[serde(default, rename = "volume")]
    pub volumes: Vec<VolumeConfig>,
}

/// One `[[volume]]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    /// Name clients open; `[A-Za-z0-9._-]`, at most 64 bytes.
    pub name: String,
    /// File holding the volume's secret (mode 0600 or stricter).
    pub secret_file: PathBuf,
    /// Most bytes of blobs the volume may hold (rounded up to whole blobs).
    #[serde(with = "serde_size")]
    pub quota: u64,
    /// Only sealed sessions (protocol version 3) may open it: a HELLO of
    /// an older version is refused `VERSION_MISMATCH`, after its MAC.
    #[serde(default)]
    pub confidential: bool,
}

fn default_listen() -> String {
    "127.0.0.1:7070".into()
}
fn default_arena() -> u64 {
    1 << 30
}
fn default_blob() -> u64 {
    1 << 20
}
fn default_swap_dir() -> PathBuf {
    PathBuf::from("/var/lib/arenad")
}
fn default_swap() -> u64 {
    16 << 30
}
fn default_swap_reads_in_flight() -> u32 {
    crate::store::DEFAULT_SWAP_READS_IN_FLIGHT
}
fn default_max_connections() -> u32 {
    256
}
fn default_max_inflight() -> u32 {
    128
}
fn default_gid_index() -> u8 {
    1
}
fn default_handshake_timeout() -> u64 {
    10
}
fn default_log_format() -> LogFormat {
    LogFormat::Text
}
fn default_log_level() -> String {
    "info".into()
}
fn default_handshake_source_prefix_v4() -> u8 {
    32
}
fn default_handshake_source_prefix_v6() -> u8 {
    64
}
fn default_write_timeout() -> u64 {
    5
}
fn default_max_queued_frames() -> u32 {
    4096
}
fn default_max_queued_bytes() -> u64 {
    16 << 20
}
fn default_blocking_threads() -> u32 {
    16
}
fn default_promote_cold_after() -> u32 {
    2
}
fn default_shutdown_timeout() -> u64 {
    20
}
fn default_metrics_max_connections() -> usize {
    ublk_metrics::http::DEFAULT_MAX_CONNECTIONS
}
fn default_metrics_request_timeout() -> u64 {
    ublk_metrics::http::DEFAULT_REQUEST_TIMEOUT_SECS
}
fn default_metrics_write_timeout() -> u64 {
    ublk_metrics::http::DEFAULT_WRITE_TIMEOUT_SECS
}
fn default_revoke_deadline() -> u64 {
    crate::store::DEFAULT_REVOKE_DEADLINE_MS
}
fn default_true() -> bool {
    true
}
fn default_metrics_max_volume_labels() -> usize {
    32
}
fn default_admin_socket() -> String {
    crate::admin::DEFAULT_SOCKET.into()
}
fn default_admin_max_connections() -> usize {
    16
}
fn default_metrics_listen() -> String {
    "127.0.0.1:9478".into()
}

impl ArenadConfig {
    /// Reads and parses a TOML file (not yet validated).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        load_toml(path)
    }

    /// Parses TOML text; `path` only labels errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        parse_toml(text, path)
    }

    /// A config with every default and no volumes.
    pub fn defaults() -> Self {
        Self::parse("", Path::new("<defaults>")).expect("the empty config parses")
    }

    /// `max_unauthenticated`, or its default.
    pub fn max_unauthenticated(&self) -> u32 {
        self.max_unauthenticated
            .unwrap_or(64.min(self.max_connections))
    }

    /// The device of each rail the `rdma_*` keys describe, by rail index.
    pub fn rdma_selectors(&self) -> Vec<crate::rdma::DeviceSelector> {
        let select = |device| crate::rdma::DeviceSelector {
            device,
            port: self.rdma_port,
            gid_index: self.rdma_gid_index,
        };
        if self.rdma_rails.is_empty() {
            vec![select(self.rdma_device.clone())]
        } else {
            self.rdma_rails
                .iter()
                .cloned()
                .map(Some)
                .map(select)
                .collect()
        }
    }

    /// The metrics listener address, `None` when it is disabled (or, before
    /// [`validate`](Self::validate), not an address).
    pub fn metrics_listen_addr(&self) -> Option<&str> {
        listen_setting("metrics_listen", &self.metrics_listen, "127.0.0.1:9478")
            .ok()
            .flatten()
    }

    /// How the per-volume families label volumes.
    pub fn volume_labels(&self) -> ublk_metrics::VolumeLabels {
        ublk_metrics::VolumeLabels {
            enabled: self.metrics_volume_labels,
            max: self.metrics_max_volume_labels,
        }
    }

    /// The admin socket's path, `None` when it is disabled.
    pub fn admin_socket_path(&self) -> Option<PathBuf> {
        match self.admin_socket.as_str() {
            "" | "off" => None,
            p => Some(PathBuf::from(p)),
        }
    }

    /// The metrics listener limits the `metrics_*` keys set.
    pub fn metrics_http(&self) -> ublk_metrics::HttpConfig {
        ublk_metrics::HttpConfig::with_limits(
            self.metrics_max_connections,
            self.metrics_request_timeout_secs,
            self.metrics_write_timeout_secs,
        )
    }

    /// The lease sharing the fairness keys set.
    pub fn lease_limits(&self) -> crate::store::LeaseLimits {
        crate::store::LeaseLimits {
            volume_share: self.volume_lease_share,
            connection_max: self.connection_max_leases,
            revoke_deadline: std::time::Duration::from_millis(self.revoke_deadline_ms),
        }
    }

    /// Checks every value; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("volume_lease_share", self.volume_lease_share),
            ("connection_max_leases", self.connection_max_leases),
        ] {
            if v == Some(0) {
                return Err(invalid(
                    key,
                    0,
                    "must be at least 1 (or unset for the default)",
                ));
            }
        }
        if !(10..=600_000).contains(&self.revoke_deadline_ms) {
            return Err(invalid(
                "revoke_deadline_ms",
                self.revoke_deadline_ms,
                "must be in 10..=600000",
            ));
        }
        listen_setting("metrics_listen", &self.metrics_listen, "127.0.0.1:9478")?;
        self.validate_rails()?;
        if !(1..=1024).contains(&self.admin_max_connections) {
            return Err(invalid(
                "admin_max_connections",
                self.admin_max_connections,
                "must be in 1..=1024",
            ));
        }
        if self.metrics_max_volume_labels > 4096 {
            return Err(invalid(
                "metrics_max_volume_labels",
                self.metrics_max_volume_labels,
                "must be at most 4096",
            ));
        }
        if let Some(p) = self.admin_socket_path() {
            if !p.is_absolute() {
                return Err(invalid(
                    "admin_socket",
                    p.display(),
                    "must be an absolute path, or \"off\"",
                ));
            }
        }
        if !(1..=65_536).contains(&self.metrics_max_connections) {
            return Err(invalid(
                "metrics_max_connections",
                self.metrics_max_connections,
                "must be in 1..=65536",
            ));
        }
        for (key, v) in [
            (
                "metrics_request_timeout_secs",
                self.metrics_request_timeout_secs,
            ),
            (
                "metrics_write_timeout_secs",
                self.metrics_write_timeout_secs,
            ),
        ] {
            if !(1..=300).contains(&v) {
                return Err(invalid(key, v, "must be in 1..=300"));
            }
        }
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "listen",
                format!("{:?}", self.listen),
                "must be an IP:port address such as 127.0.0.1:7070",
            ));
        }
        let b = self.blob_bytes;
        if !b.is_power_of_two() || !(4096..=u64::from(MAX_INLINE)).contains(&b) {
            return Err(invalid(
                "blob_bytes",
                HumanSize(b),
                "must be a power of two from 4K to 16M",
            ));
        }
        if self.arena_bytes < 2 * b || !self.arena_bytes.is_multiple_of(b) {
            return Err(invalid(
                "arena_bytes",
                HumanSize(self.arena_bytes),
                format!(
                    "must be a multiple of blob_bytes ({}) and hold at least 2 blobs",
                    HumanSize(b)
                ),
            ));
        }
        if self.swap_bytes < self.arena_bytes || !self.swap_bytes.is_multiple_of(b) {
            return Err(invalid(
                "swap_bytes",
                HumanSize(self.swap_bytes),
                format!(
                    "must be a multiple of blob_bytes ({}) and at least arena_bytes ({})",
                    HumanSize(b),
                    HumanSize(self.arena_bytes)
                ),
            ));
        }
        let reads = self.swap_reads_in_flight;
        if !(1..=crate::store::MAX_SWAP_READS_IN_FLIGHT).contains(&reads) {
            return Err(invalid(
                "swap_reads_in_flight",
                reads,
                format!("must be in 1..={}", crate::store::MAX_SWAP_READS_IN_FLIGHT),
            ));
        }
        if !(1..=65536).contains(&self.max_connections) {
            return Err(invalid(
                "max_connections",
                self.max_connections,
                "must be in 1..=65536",
            ));
        }
        if !(1..=4096).contains(&self.max_inflight) {
            return Err(invalid(
                "max_inflight",
                self.max_inflight,
                "must be in 1..=4096",
            ));
        }
        if !(1..=600).contains(&self.handshake_timeout_secs) {
            return Err(invalid(
                "handshake_timeout_secs",
                self.handshake_timeout_secs,
                "must be in 1..=600",
            ));
        }
        if let Err(why) = ublk_metrics::events::check_filter(&self.log_level) {
            return Err(invalid("log_level", format!("{:?}", self.log_level), why));
        }
        if !(1..=self.max_connections).contains(&self.max_unauthenticated()) {
            return Err(invalid(
                "max_unauthenticated",
                self.max_unauthenticated(),
                format!("must be in 1..=max_connections ({})", self.max_connections),
            ));
        }
        for (key, v, bits) in [
            (
                "handshake_source_prefix_v4",
                self.handshake_source_prefix_v4,
                32,
            ),
            (
                "handshake_source_prefix_v6",
                self.handshake_source_prefix_v6,
                128,
            ),
        ] {
            if v > bits {
                return Err(invalid(
                    key,
                    v,
                    format!("must be a prefix length in 0..={bits}"),
                ));
            }
        }
        if !(1..=600).contains(&self.write_timeout_secs) {
            return Err(invalid(
                "write_timeout_secs",
                self.write_timeout_secs,
                "must be in 1..=600",
            ));
        }
        self.validate_serving_core()?;
        if self.volumes.is_empty() {
            return Err(invalid(
                "volume",
                "[]",
                "at least one [[volume]] with name, secret_file and quota is required",
            ));
        }
        let mut seen = HashSet::new();
        for (i, v) in self.volumes.iter().enumerate() {
            if !valid_volume_name(&v.name) {
                return Err(invalid(
                    format!("volume[{i}].name"),
                    format!("{:?}", v.name),
                    "must be 1..=64 bytes of [A-Za-z0-9._-]",
                ));
            }
            if !seen.insert(&v.name) {
                return Err(invalid(
                    format!("volume[{i}].name"),
                    format!("{:?}", v.name),
                    "volume names must be unique",
                ));
            }
            if v.quota < b {
                return Err(invalid(
                    format!("volume[{i}].quota"),
                    HumanSize(v.quota),
                    format!("must be at least one blob ({})", HumanSize(b)),
                ));
            }
        }
        Ok(())
    }
}

impl ArenadConfig {
    /// The serving core's keys (see their block above).
    fn validate_rails(&self) -> Result<(), ConfigError> {
        let rails = &self.rdma_rails;
        let shown = || format!("{rails:?}");
        if rails.is_empty() {
            return Ok(());
        }
        if self.rdma_device.is_some() {
            return Err(invalid(
                "rdma_rails",
                shown(),
                "names the rails' devices: leave rdma_device unset",
            ));
        }
        if rails.len() != MAX_RAILS {
            return Err(invalid(
                "rdma_rails",
                shown(),
                "must name two devices, one per rail (one rail: set rdma_device)",
            ));
        }
        if rails.iter().any(String::is_empty) || rails[0] == rails[1] {
            return Err(invalid(
                "rdma_rails",
                shown(),
                "must name two different devices",
            ));
        }
        Ok(())
    }

    fn validate_serving_core(&self) -> Result<(), ConfigError> {
        if !(16..=1 << 20).contains(&self.max_queued_frames) {
            return Err(invalid(
                "max_queued_frames",
                self.max_queued_frames,
                "must be in 16..=1048576",
            ));
        }
        if !(64 << 10..=1 << 30).contains(&self.max_queued_bytes) {
            return Err(invalid(
                "max_queued_bytes",
                HumanSize(self.max_queued_bytes),
                "must be from 64K to 1G",
            ));
        }
        if self.promote_cold_after > 1024 {
            return Err(invalid(
                "promote_cold_after",
                self.promote_cold_after,
                "must be in 0..=1024",
            ));
        }
        if !(1..=1024).contains(&self.blocking_threads) {
            return Err(invalid(
                "blocking_threads",
                self.blocking_threads,
                "must be in 1..=1024",
            ));
        }
        // systemd/arenad.service stops the process after TimeoutStopSec=60s:
        // the drain must leave the final flush time below that.
        if !(1..=50).contains(&self.shutdown_timeout_secs) {
            return Err(invalid(
                "shutdown_timeout_secs",
                self.shutdown_timeout_secs,
                "must be in 1..=50 (below the unit's TimeoutStopSec=60s, leaving time for the final flush)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
listen = "127.0.0.1:7171"
arena_bytes = "64M"
blob_bytes = "1M"
swap_dir = "/tmp/x"
swap_bytes = "1G"
[[volume]]
name = "vm1"
secret_file = "/etc/arenad/vm1.key"
quota = "10G"
"#;

    fn parse(text: &str) -> Result<ArenadConfig, ConfigError> {
        let c = ArenadConfig::parse(text, Path::new("test.toml"))?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn good_config_parses_with_units() {
        let c = parse(GOOD).unwrap();
        assert_eq!(
            (c.arena_bytes, c.blob_bytes, c.swap_bytes),
            (64 << 20, 1 << 20, 1 << 30)
        );
        assert_eq!(c.volumes[0].quota, 10 << 30);
        assert_eq!(c.max_inflight, 128);
        assert_eq!(c.swap_reads_in_flight, 128);
        let c = parse(&format!("swap_reads_in_flight = 512\n{GOOD}")).unwrap();
        assert_eq!(c.swap_reads_in_flight, 512);
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn bad_values_name_the_key_and_the_range() {
        let e = err(&GOOD.replace("\"1M\"", "\"3000\""));
        assert!(
            e.contains("blob_bytes = 3000") && e.contains("power of two from 4K to 16M"),
            "{e}"
        );
        let e = err(&GOOD.replace("\"64M\"", "\"1M\""));
        assert!(
            e.starts_with("invalid config: arena_bytes = 1M: ") && e.contains("at least 2 blobs"),
            "{e}"
        );
        let e = err(&GOOD.replace("\"1G\"", "\"32M\""));
        assert!(e.starts_with("invalid config: swap_bytes = 32M: "), "{e}");
        let e = err(&GOOD.replace("\"10G\"", "\"4K\""));
        assert!(
            e.starts_with("invalid config: volume[0].quota = 4K: "),
            "{e}"
        );
        let e = err(&GOOD.replace("vm1\"", "vm/1\""));
        assert!(
            e.starts_with("invalid config: volume[0].name = \"vm/1\": "),
            "{e}"
        );
        let e = err(&format!("revoke_deadline_ms = 5\n{GOOD}"));
        assert_eq!(
            e,
            "invalid config: revoke_deadline_ms = 5: must be in 10..=600000"
        );
        let e = err(&format!("volume_lease_share = 0\n{GOOD}"));
        assert!(
            e.starts_with("invalid config: volume_lease_share = 0: "),
            "{e}"
        );
        let e = err(&format!("metrics_request_timeout_secs = 0\n{GOOD}"));
        assert_eq!(
            e,
            "invalid config: metrics_request_timeout_secs = 0: must be in 1..=300"
        );
        let e = err(&format!("swap_reads_in_flight = 0\n{GOOD}"));
        assert_eq!(
            e,
            "invalid config: swap_reads_in_flight = 0: must be in 1..=4096"
        );
        let e = err(&format!("handshake_source_prefix_v4 = 33\n{GOOD}"));
        assert_eq!(
            e,
            "invalid config: handshake_source_prefix_v4 = 33: must be a prefix length in 0..=32"
        );
        let e = err(&format!("handshake_source_prefix_v6 = 129\n{GOOD}"));
        assert_eq!(
            e,
            "invalid config: handshake_source_prefix_v6 = 129: must be a prefix length in 0..=128"
        );
        let e = err(&format!("max_inflight = 0\n{GOOD}"));
        assert!(
            e == "invalid config: max_inflight = 0: must be in 1..=4096",
            "{e}"
        );
        let e = err(&GOOD.replace("127.0.0.1:7171", "nowhere"));
        assert!(
            e.starts_with("invalid config: listen = \"nowhere\": "),
            "{e}"
        );
        let e = err(&format!(
            "{GOOD}\n[[volume]]\nname = \"vm1\"\nsecret_file = \"/x\"\nquota = \"1G\"\n"
        ));
        assert!(e.contains("unique"), "{e}");
        let e = err("listen = \"127.0.0.1:1\"");
        assert!(e.contains("at least one [[volume]]"), "{e}");
        let e = err(&format!("metrics_listen = \"metrics.local:80\"\n{GOOD}"));
        assert_eq!(
            e,
            "invalid config: metrics_listen = \"metrics.local:80\": must be IP:port (e.g. \"127.0.0.1:9478\"), or \"off\" to disable the listener"
        );
    }

    #[test]
    fn the_shipped_example_config_is_valid_and_sets_the_defaults() {
        let text = include_str!("../../../systemd/arenad.toml");
        let c = parse(text).unwrap();
        let d = parse(GOOD).unwrap();
        assert_eq!(
            c.metrics_http().max_connections,
            d.metrics_http().max_connections
        );
        assert_eq!(c.lease_limits(), d.lease_limits());
        assert_eq!(d.lease_limits(), crate::store::LeaseLimits::default());
        assert_eq!(c.swap_reads_in_flight, d.swap_reads_in_flight);
        assert_eq!(
            (c.handshake_source_prefix_v4, c.handshake_source_prefix_v6),
            (d.handshake_source_prefix_v4, d.handshake_source_prefix_v6)
        );
        assert_eq!(
            (d.handshake_source_prefix_v4, d.handshake_source_prefix_v6),
            (32, 64)
        );
    }

    #[test]
    fn a_volume_is_confidential_only_when_it_says_so() {
        assert!(!parse(GOOD).unwrap().volumes[0].confidential);
        let c = parse(&format!("{GOOD}confidential = true\n")).unwrap();
        assert!(c.volumes[0].confidential);
        let e = err(&format!("{GOOD}confidential = \"yes\"\n"));
        assert!(e.contains("confidential"), "{e}");
    }

    #[test]
    fn the_metrics_listener_defaults_on_and_can_be_turned_off() {
        assert_eq!(
            parse(GOOD).unwrap().metrics_listen_addr(),
            Some("127.0.0.1:9478")
        );
        for off in ["", "off"] {
            let c = parse(&format!("metrics_listen = \"{off}\"\n{GOOD}")).unwrap();
            assert_eq!(c.metrics_listen_addr(), None);
        }
    }

    #[test]
    fn rdma_rails_name_two_different_devices_instead_of_rdma_device() {
        let devices = |c: ArenadConfig| -> Vec<Option<String>> {
            c.rdma_selectors().into_iter().map(|s| s.device).collect()
        };
        assert_eq!(devices(parse(GOOD).unwrap()), [None]);
        let one = parse(&format!("rdma_device = \"rxe0\"\n{GOOD}")).unwrap();
        assert_eq!(devices(one), [Some("rxe0".to_owned())]);
        let two = parse(&format!("rdma_rails = [\"rxe0\", \"rxe1\"]\n{GOOD}")).unwrap();
        assert_eq!(
            devices(two),
            [Some("rxe0".to_owned()), Some("rxe1".to_owned())]
        );
        for (bad, says) in [
            ("rdma_rails = [\"rxe0\"]", "two devices"),
            ("rdma_rails = [\"a\", \"b\", \"c\"]", "two devices"),
            ("rdma_rails = [\"rxe0\", \"rxe0\"]", "different"),
            ("rdma_rails = [\"rxe0\", \"\"]", "different"),
            (
                "rdma_device = \"rxe0\"\nrdma_rails = [\"a\", \"b\"]",
                "leave rdma_device unset",
            ),
        ] {
            let e = err(&format!("{bad}\n{GOOD}"));
            assert!(e.contains("rdma_rails") && e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn rdma_isolation_defaults_to_lease_and_names_its_values() {
        use crate::rdma::Isolation;
        assert_eq!(parse(GOOD).unwrap().rdma_isolation, Isolation::Lease);
        for (v, want) in [("lease", Isolation::Lease), ("shared", Isolation::Shared)] {
            let c = parse(&format!("rdma_isolation = \"{v}\"\n{GOOD}")).unwrap();
            assert_eq!((c.rdma_isolation, c.rdma_isolation.name()), (want, v));
        }
        let e = err(&format!("rdma_isolation = \"none\"\n{GOOD}"));
        assert!(
            e.contains("rdma_isolation") && e.contains("lease") && e.contains("shared"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_and_bad_sizes_are_parse_errors() {
        let e = err(&format!("arena_size = 1\n{GOOD}"));
        assert!(e.contains("test.toml") && e.contains("arena_size"), "{e}");
        let e = err(&GOOD.replace("\"64M\"", "\"64Q\""));
        assert!(e.contains("64Q") && e.contains("unknown unit"), "{e}");
    }
}
