//! ublkd's coordination families (replicated volumes): epoch
//! changes by reason, writer leases lost, and whether this ublkd may
//! acknowledge writes of the volumes it coordinates on etcd.
//!
//! This crate cannot depend on the daemon, so the collector samples plain
//! numbers ([`CoordinationStats`]) from a source the daemon sets.

use crate::labels::{closed_enum, count_variants};
use crate::telemetry::{Collector, Telemetry};
use metrics::{Counter, Gauge};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

closed_enum! {
    /// Why a volume's membership epoch moved.
    EpochReason {
        /// The volume was created.
        Created => "created",
        /// A member left after a failure.
        MemberFailed => "member_failed",
        /// A member was taken out on purpose.
        MemberRemoved => "member_removed",
        /// A member (new or returning) started its rebuild.
        RebuildStarted => "rebuild_started",
        /// A syncing member caught up and became healthy.
        MemberRebuilt => "member_rebuilt",
        /// A new writer took the volume (same members, a new epoch).
        WriterChanged => "writer_changed",
        /// A spare caught up and took the place of a member that stayed
        /// failed (recorded removed in the same change).
        MemberReplaced => "member_replaced",
    }
}

/// The coordination service's state, sampled at each scrape. Totals are
/// since ublkd started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinationStats {
    /// Epoch changes this ublkd made, indexed by [`EpochReason::index`].
    pub epoch_changes: [u64; EpochReason::COUNT],
    /// Writer leases etcd no longer knew (expired or revoked).
    pub leases_lost: u64,
    /// Whether the writer lease's deadline lies ahead.
    pub lease_valid: bool,
}

type Source = Box<dyn Fn() -> Option<CoordinationStats> + Send + Sync>;

/// The families, refreshed from the source before each render.
pub struct CoordinationMetrics {
    epoch_changes: [Counter; EpochReason::COUNT],
    leases_lost: Counter,
    lease_valid: Gauge,
    source: Mutex<Option<Source>>,
}

impl std::fmt::Debug for CoordinationMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinationMetrics")
            .finish_non_exhaustive()
    }
}

impl CoordinationMetrics {
    /// Registers the families (zero until the source answers) and makes
    /// the result a collector of `telemetry`.
    pub fn new(telemetry: &Arc<Telemetry>) -> Arc<Self> {
        let t = &**telemetry;
        let m = Arc::new(Self {
            epoch_changes: EpochReason::ALL.map(|r| {
                t.counter(
                    "ublk_membership_epoch_changes_total",
                    &[("reason", r.as_str())],
                )
            }),
            leases_lost: t.counter("ublk_writer_leases_lost_total", &[]),
            lease_valid: t.gauge("ublk_writer_lease_valid", &[]),
            source: Mutex::new(None),
        });
        m.update_from(&CoordinationStats::default());
        telemetry.register_collector(&m);
        m
    }

    /// Publishes `s`; totals never go back.
    pub fn update_from(&self, s: &CoordinationStats) {
        for (c, &v) in self.epoch_changes.iter().zip(&s.epoch_changes) {
            c.absolute(v);
        }
        self.leases_lost.absolute(s.leases_lost);
        self.lease_valid.set(if s.lease_valid { 1.0 } else { 0.0 });
    }

    /// Sets what the scrape samples; `None` from it (etcd not reached yet)
    /// reports the lease invalid and leaves the totals.
    pub fn set_source(
        &self,
        source: impl Fn() -> Option<CoordinationStats> + Send + Sync + 'static,
    ) {
        *self.source.lock() = Some(Box::new(source));
    }
}

impl Collector for CoordinationMetrics {
    fn collect(&self) {
        let sampled = self.source.lock().as_ref().map(|f| f());
        match sampled {
            Some(Some(s)) => self.update_from(&s),
            Some(None) => self.lease_valid.set(0.0),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::Daemon;

    #[test]
    fn sampled_stats_render_with_closed_labels() {
        let tel = Telemetry::isolated(Daemon::Ublkd, "test");
        let m = CoordinationMetrics::new(&tel);
        let mut s = CoordinationStats::default();
        s.epoch_changes[EpochReason::MemberFailed.index()] = 2;
        s.leases_lost = 1;
        s.lease_valid = true;
        m.set_source(move || Some(s));
        let has = |sample: &str| tel.render().unwrap().lines().any(|l| l == sample);
        assert!(has(
            "ublk_membership_epoch_changes_total{reason=\"member_failed\"} 2"
        ));
        assert!(has(
            "ublk_membership_epoch_changes_total{reason=\"created\"} 0"
        ));
        assert!(has("ublk_writer_leases_lost_total 1"));
        assert!(has("ublk_writer_lease_valid 1"));
        m.set_source(|| None);
        assert!(has("ublk_writer_lease_valid 0"));
        assert!(has("ublk_writer_leases_lost_total 1"), "totals stay");
    }
}
