//! `[replication]` in `ublkd.toml`: how a replicated device waits and how
//! fast it rebuilds (docs/OPERATIONS.md documents the keys). Every key has
//! a default; the section may be left out.

use std::time::Duration;

use serde::Deserialize;
use target_rdma::replica::ReplicaConfig;
use target_rdma::service::config_file::{invalid, ConfigError};

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
    /// A member failed for longer than this is replaced by a spare from
    /// the placement pool (etcd only), in ms; until then only its own
    /// peer, once back, is rebuilt.
    #[serde(default = "default_replace_after")]
    pub replace_after_ms: u64,
    /// Longest pause before another rebuild of a peer whose rebuilds keep
    /// failing, in ms: the pause doubles from `rebuild_check_ms` with each
    /// failure in a row, up to this.
    #[serde(default = "default_rebuild_backoff_max")]
    pub rebuild_backoff_max_ms: u64,
    /// How long a write or flush waits for a member once another member
    /// answered it, in ms; 0 derives it from the members' recent latency
    /// (`straggler_factor` times the slowest answering member's p99, at
    /// least `straggler_floor_ms`). A member that has not answered by then
    /// is failed like a dead one and rebuilt when it answers again.
    #[serde(default)]
    pub straggler_after_ms: u64,
    /// The least a derived straggler bound waits, in ms.
    #[serde(default = "default_straggler_floor")]
    pub straggler_floor_ms: u64,
    /// How many of its p99 write latencies a member may take beyond the
    /// others.
    #[serde(default = "default_straggler_factor")]
    pub straggler_factor: u32,
    /// Rebuild copies in flight at once, 1..=256.
    #[serde(default = "default_rebuild_inflight")]
    pub rebuild_inflight: u32,
    /// While the device has more guest requests in flight than this, its
    /// rebuild copies one blob at a time.
    #[serde(default = "default_rebuild_yield_above")]
    pub rebuild_yield_above: u64,
}

fn default_straggler_floor() -> u64 {
    500
}
fn default_straggler_factor() -> u32 {
    4
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
fn default_replace_after() -> u64 {
    300_000
}
fn default_rebuild_backoff_max() -> u64 {
    300_000
}
fn default_rebuild_inflight() -> u32 {
    target_rdma::replica::DEFAULT_INFLIGHT as u32
}
fn default_rebuild_yield_above() -> u64 {
    4
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        Self {
            hedge_after_us: default_hedge_after(),
            change_deadline_ms: default_change_deadline(),
            coord_timeout_ms: default_coord_timeout(),
            rebuild_bytes_per_sec: default_rebuild_rate(),
            rebuild_check_ms: default_rebuild_check(),
            replace_after_ms: default_replace_after(),
            rebuild_backoff_max_ms: default_rebuild_backoff_max(),
            straggler_after_ms: 0,
            straggler_floor_ms: default_straggler_floor(),
            straggler_factor: default_straggler_factor(),
            rebuild_inflight: default_rebuild_inflight(),
            rebuild_yield_above: default_rebuild_yield_above(),
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
            straggler_after: (self.straggler_after_ms > 0)
                .then(|| Duration::from_millis(self.straggler_after_ms)),
            straggler_floor: Duration::from_millis(self.straggler_floor_ms),
            straggler_factor: self.straggler_factor,
            ..ReplicaConfig::default()
        }
    }

    /// How often a device looks for a member to rebuild.
    pub fn rebuild_check(&self) -> Duration {
        Duration::from_millis(self.rebuild_check_ms)
    }

    /// How long a member stays failed before a spare replaces it.
    pub fn replace_after(&self) -> Duration {
        Duration::from_millis(self.replace_after_ms)
    }

    /// The pause before the next rebuild of a peer whose last `failures`
    /// rebuilds in a row failed: `rebuild_check` doubled per failure, at
    /// most `rebuild_backoff_max_ms`.
    pub fn rebuild_backoff(&self, failures: u32) -> Duration {
        let max = self.rebuild_backoff_max_ms.max(self.rebuild_check_ms);
        let ms = self
            .rebuild_check_ms
            .saturating_mul(1u64 << failures.min(32))
            .min(max);
        Duration::from_millis(ms)
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
        for (key, v) in [
            ("replication.replace_after_ms", self.replace_after_ms),
            (
                "replication.rebuild_backoff_max_ms",
                self.rebuild_backoff_max_ms,
            ),
        ] {
            if !(100..=86_400_000).contains(&v) {
                return Err(invalid(key, v, "must be between 100 and 86400000"));
            }
        }
        if !(10..=600_000).contains(&self.straggler_floor_ms) {
            return Err(invalid(
                "replication.straggler_floor_ms",
                self.straggler_floor_ms,
                "must be between 10 and 600000",
            ));
        }
        if self.straggler_after_ms != 0 && !(10..=600_000).contains(&self.straggler_after_ms) {
            return Err(invalid(
                "replication.straggler_after_ms",
                self.straggler_after_ms,
                "must be 0 (derived from latency) or between 10 and 600000",
            ));
        }
        if !(1..=100).contains(&self.straggler_factor) {
            return Err(invalid(
                "replication.straggler_factor",
                self.straggler_factor,
                "must be between 1 and 100",
            ));
        }
        if !(1..=256).contains(&self.rebuild_inflight) {
            return Err(invalid(
                "replication.rebuild_inflight",
                self.rebuild_inflight,
                "must be between 1 and 256",
            ));
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

    #[test]
    fn the_rebuild_backoff_doubles_up_to_its_bound() {
        let c = ReplicationConfig {
            rebuild_check_ms: 1000,
            rebuild_backoff_max_ms: 5000,
            ..ReplicationConfig::default()
        };
        let ms = |n| c.rebuild_backoff(n).as_millis();
        assert_eq!(
            [ms(0), ms(1), ms(2), ms(3), ms(40)],
            [1000, 2000, 4000, 5000, 5000]
        );
    }
}
