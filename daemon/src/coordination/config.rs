//! `[etcd]` in `ublkd.toml`: where the coordination service is and how
//! long this ublkd's writer lease lives. Absent, ublkd coordinates alone
//! (the static fallback: memberships recorded in the state dir, no
//! placement pool, no cross-host writer exclusion); `docs/OPERATIONS.md`
//! documents the keys.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use target_rdma::service::config_file::{invalid, ConfigError};

/// `[etcd]`.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdConfig {
    /// Client URLs of the etcd cluster, `http://host:port` or `host:port`.
    pub endpoints: Vec<String>,
    /// Every key ublkd reads or writes starts with it, so one etcd can
    /// serve several fleets (or other users).
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Limit for establishing a connection to an endpoint, in ms.
    #[serde(default = "default_dial_timeout")]
    pub dial_timeout_ms: u64,
    /// Limit for each etcd request, in ms.
    #[serde(default = "default_request_timeout")]
    pub request_timeout_ms: u64,
    /// TTL of the writer lease: how long after this ublkd's last
    /// successful keepalive etcd hands its volumes to another writer.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl_secs: u64,
    /// Taken off the lease's expiry when deciding whether writes may still
    /// be acknowledged, for the clock drift between this host and etcd.
    #[serde(default = "default_lease_margin")]
    pub lease_margin_ms: u64,
    /// Most etcd requests in flight at once; more fail at once ("busy").
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u32,
    /// This ublkd's name in the writer keys (and in the error a second
    /// writer gets); the host name when unset.
    #[serde(default)]
    pub host_id: Option<String>,
    /// etcd user (with `password_file`), for clusters with authentication.
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the etcd user's password (first line).
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// How often a writer looks for standbys asking for its volumes (one
    /// etcd range read per ublkd, only while it serves a replicated
    /// volume), in ms: part of the pause a hand-over costs.
    #[serde(default = "default_handover_poll")]
    pub handover_poll_ms: u64,
}

fn default_prefix() -> String {
    "/ublk/".into()
}
fn default_dial_timeout() -> u64 {
    2000
}
fn default_request_timeout() -> u64 {
    2000
}
fn default_lease_ttl() -> u64 {
    10
}
fn default_lease_margin() -> u64 {
    2000
}
fn default_max_inflight() -> u32 {
    256
}
fn default_handover_poll() -> u64 {
    50
}

impl EtcdConfig {
    /// A config with every default for these endpoints.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            prefix: default_prefix(),
            dial_timeout_ms: default_dial_timeout(),
            request_timeout_ms: default_request_timeout(),
            lease_ttl_secs: default_lease_ttl(),
            lease_margin_ms: default_lease_margin(),
            max_inflight: default_max_inflight(),
            host_id: None,
            username: None,
            password_file: None,
            handover_poll_ms: default_handover_poll(),
        }
    }

    /// How often a writer looks for hand-over requests.
    pub fn handover_poll(&self) -> Duration {
        Duration::from_millis(self.handover_poll_ms)
    }

    /// The writer lease's TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// How often the lease is kept alive: a third of its TTL, so two
    /// keepalives in a row may fail before it expires.
    pub fn keepalive_interval(&self) -> Duration {
        self.lease_ttl() / 3
    }

    /// Checks every `[etcd]` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() || self.endpoints.len() > 16 {
            return Err(invalid(
                "etcd.endpoints",
                format!("{:?}", self.endpoints),
                "must list 1 to 16 etcd client URLs, e.g. [\"http://10.0.0.9:2379\"]",
            ));
        }
        for e in &self.endpoints {
            check_endpoint(e)?;
        }
        if !self.prefix.starts_with('/') || !self.prefix.ends_with('/') || self.prefix.len() > 128 {
            return Err(invalid(
                "etcd.prefix",
                &self.prefix,
                "must start and end with '/' (e.g. \"/ublk/\"), at most 128 bytes",
            ));
        }
        if !(10..=10_000).contains(&self.handover_poll_ms) {
            return Err(invalid(
                "etcd.handover_poll_ms",
                self.handover_poll_ms,
                "must be between 10 and 10000",
            ));
        }
        for (key, v) in [
            ("etcd.dial_timeout_ms", self.dial_timeout_ms),
            ("etcd.request_timeout_ms", self.request_timeout_ms),
        ] {
            if !(100..=60_000).contains(&v) {
                return Err(invalid(key, v, "must be between 100 and 60000"));
            }
        }
        if !(2..=600).contains(&self.lease_ttl_secs) {
            return Err(invalid(
                "etcd.lease_ttl_secs",
                self.lease_ttl_secs,
                "must be between 2 (etcd's smallest) and 600",
            ));
        }
        // After a keepalive the lease counts as valid for ttl - margin; the
        // next keepalive comes ttl/3 later, so the margin must leave more
        // than that or writes would pause between two good keepalives.
        let window = self.lease_ttl_secs * 1000 * 2 / 3;
        if self.lease_margin_ms >= window {
            return Err(invalid(
                "etcd.lease_margin_ms",
                self.lease_margin_ms,
                format!("must be below two thirds of lease_ttl_secs ({window} ms)"),
            ));
        }
        if !(1..=65_536).contains(&self.max_inflight) {
            return Err(invalid(
                "etcd.max_inflight",
                self.max_inflight,
                "must be between 1 and 65536",
            ));
        }
        if let Some(h) = &self.host_id {
            if h.is_empty() || h.len() > 128 || h.chars().any(char::is_control) {
                return Err(invalid(
                    "etcd.host_id",
                    format!("{h:?}"),
                    "must be 1 to 128 printable characters",
                ));
            }
        }
        match (&self.username, &self.password_file) {
            (Some(_), None) | (None, Some(_)) => Err(invalid(
                "etcd.username",
                format!("{:?}", self.username),
                "etcd.username and etcd.password_file go together",
            )),
            (_, Some(p)) if !p.is_absolute() => Err(invalid(
                "etcd.password_file",
                p.display(),
                "must be an absolute path",
            )),
            _ => Ok(()),
        }
    }
}

/// `http://host:port` or `host:port`; TLS is not built in.
fn check_endpoint(e: &str) -> Result<(), ConfigError> {
    if e.starts_with("https://") {
        return Err(invalid(
            "etcd.endpoints",
            e,
            "https is not supported by this build: reach etcd over a trusted management network or a local proxy",
        ));
    }
    let hostport = e.strip_prefix("http://").unwrap_or(e);
    let ok = match hostport.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p != 0)
        }
        None => false,
    };
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "etcd.endpoints",
            e,
            "must be http://HOST:PORT or HOST:PORT (e.g. \"http://10.0.0.9:2379\")",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Result<EtcdConfig, String> {
        let c: EtcdConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate().map(|()| c).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_documented_ones() {
        let c = parsed("endpoints = [\"127.0.0.1:2379\"]").unwrap();
        assert_eq!(c.prefix, "/ublk/");
        assert_eq!(c.lease_ttl(), Duration::from_secs(10));
        assert_eq!(c.keepalive_interval(), Duration::from_nanos(3_333_333_333));
        assert_eq!((c.dial_timeout_ms, c.request_timeout_ms), (2000, 2000));
        assert_eq!((c.lease_margin_ms, c.max_inflight), (2000, 256));
    }

    #[test]
    fn bad_values_name_the_key() {
        let e = |t: &str| parsed(t).unwrap_err();
        assert!(e("endpoints = []").starts_with("invalid config: etcd.endpoints = []: must list"));
        assert!(e("endpoints = [\"https://h:1\"]").contains("https is not supported"));
        assert!(e("endpoints = [\"h\"]").contains("must be http://HOST:PORT"));
        assert!(e("endpoints = [\"http://h:0\"]").contains("must be http://HOST:PORT"));
        assert_eq!(
            e("endpoints = [\"h:1\"]\nprefix = \"ublk\""),
            "invalid config: etcd.prefix = ublk: must start and end with '/' (e.g. \"/ublk/\"), at most 128 bytes"
        );
        assert_eq!(
            e("endpoints = [\"h:1\"]\nlease_ttl_secs = 1"),
            "invalid config: etcd.lease_ttl_secs = 1: must be between 2 (etcd's smallest) and 600"
        );
        assert_eq!(
            e("endpoints = [\"h:1\"]\nlease_ttl_secs = 3\nlease_margin_ms = 2000"),
            "invalid config: etcd.lease_margin_ms = 2000: must be below two thirds of lease_ttl_secs (2000 ms)"
        );
        assert!(e("endpoints = [\"h:1\"]\nusername = \"u\"").contains("go together"));
        assert!(e("endpoints = [\"h:1\"]\ncolour = 1").contains("unknown field `colour`"));
    }
}
