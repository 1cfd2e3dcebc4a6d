//! `[replication]` in `ublkd.toml`: how a replicated device waits and how
//! fast it rebuilds (docs/OPERATIONS.md documents the keys). Every key has
//! a default; the section may be left out.

use std::time::Duration;

use serde::Deserialize;
use target_rdma::config_file::{invalid, ConfigError};
use target_rdma::replica::ReplicaConfig;

/// `[replication]`.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicationConfig {
    /// A read not answered after this long is also sent to a second
    /// healthy member, in microseconds.
    #[serde(default = "default_hedge_after")]
    pub hedge_after_us: u64,
    /// Longest a request waits for a membership change (the removal of a
    /// member that failed it) before it fails unacknowledged, in ms.
    #[serde(default = "default_change_deadline")]
    pub change_deadline_ms: u64,
    /// Longest wait for one coordination request, in ms.
    #[serde(default = "default_coord_timeout")]
    pub coord_timeout_ms: u64,
    /// Rebuild copy rate per device, in bytes per second (0: unlimited).
    #[serde(default = "default_rebuild_rate")]
    pub rebuild_bytes_per_sec: u64,
    /// How often a device looks for a failed member whose peer answers
    /// again (and rebuilds it), in ms.
    #[serde(default = "default_rebuild_check")]
    pub rebuild_check_ms: u64,
}

fn default_hedge_after() -> u64 {
    2000
}
fn default_change_deadline() -> u64 {
    5000
}
fn default_coord_timeout() -> u64 {
    1000
}
fn default_rebuild_rate() -> u64 {
    256 << 20
}
fn default_rebuild_check() -> u64 {
    2000
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        Self {
            hedge_after_us: default_hedge_after(),
            change_deadline_ms: default_change_deadline(),
            coord_timeout_ms: default_coord_timeout(),
            rebuild_bytes_per_sec: default_rebuild_rate(),
            rebuild_check_ms: default_rebuild_check(),
        }
    }
}

impl ReplicationConfig {
    /// The replication core's settings.
    pub fn core(&self) -> ReplicaConfig {
        ReplicaConfig {
            hedge_after: Duration::from_micros(self.hedge_after_us),
            change_deadline: Duration::from_millis(self.change_deadline_ms),
            coord_timeout: Duration::from_millis(self.coord_timeout_ms),
            ..ReplicaConfig::default()
        }
    }

    /// How often a device looks for a member to rebuild.
    pub fn rebuild_check(&self) -> Duration {
        Duration::from_millis(self.rebuild_check_ms)
    }

    /// Checks every `[replication]` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(10..=10_000_000).contains(&self.hedge_after_us) {
            return Err(invalid(
                "replication.hedge_after_us",
                self.hedge_after_us,
                "must be between 10 and 10000000",
            ));
        }
        for (key, v) in [
            ("replication.change_deadline_ms", self.change_deadline_ms),
            ("replication.coord_timeout_ms", self.coord_timeout_ms),
            ("replication.rebuild_check_ms", self.rebuild_check_ms),
        ] {
            if !(100..=600_000).contains(&v) {
                return Err(invalid(key, v, "must be between 100 and 600000"));
            }
        }
        if self.coord_timeout_ms > self.change_deadline_ms {
            return Err(invalid(
                "replication.coord_timeout_ms",
                self.coord_timeout_ms,
                "must not exceed replication.change_deadline_ms",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        let d = ReplicationConfig::default();
        d.validate().unwrap();
        assert_eq!(d.core().hedge_after, Duration::from_millis(2));
        let e = ReplicationConfig {
            coord_timeout_ms: 9000,
            ..d
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("replication.coord_timeout_ms"), "{e}");
    }
}
