//! ublkd's replica-health families (replicated volumes): how
//! many members of its replicated devices hold every acknowledged write,
//! how many devices run with fewer than they were created with, rebuild
//! progress and outcomes, hedged reads, and writers fenced by a peer's
//! newer epoch. No device or peer
//! label: the sums are what an alert needs, and `ublkctl show` names the
//! device and the member.
//!
//! This crate cannot depend on the daemon, so the collector samples plain
//! numbers ([`ReplicaStats`]) from a source the daemon sets.

use crate::labels::{closed_enum, count_variants};
use crate::telemetry::{Collector, Telemetry};
use metrics::{Counter, Gauge};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

closed_enum! {
    /// Which member answered a hedged read first.
    HedgeOutcome {
        /// The second member, the read was hedged to.
        Won => "won",
        /// The first member, despite its delay.
        Lost => "lost",
    }
}

closed_enum! {
    /// Which way a writer role moved at a hand-over, seen from this ublkd.
    HandoverDirection {
        /// A standby of this ublkd took the role.
        In => "in",
        /// A writer of this ublkd handed it to another's standby.
        Out => "out",
    }
}

closed_enum! {
    /// How a rebuild (of a returning peer or a spare) ended.
    RebuildOutcome {
        /// The member caught up and was recorded healthy.
        Done => "done",
        /// A copy or a membership change failed: the member is out again
        /// and its peer is backed off.
        Failed => "failed",
        /// The device stopped while it ran.
        Abandoned => "abandoned",
    }
}

/// Replicated devices' state, summed over the devices, sampled at each
/// scrape. Totals are since ublkd started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaStats {
    /// Replicas the devices were created with (their `--replicas`).
    pub replicas: u64,
    /// Members that hold every acknowledged write (healthy).
    pub healthy: u64,
    /// Devices with fewer healthy members than replicas.
    pub degraded: u64,
    /// Blob bytes copied by rebuilds.
    pub rebuild_bytes: u64,
    /// Blob bytes the running rebuilds still have to copy.
    pub rebuild_remaining: u64,
    /// Bytes per second the running rebuilds copy, over their recent
    /// window (0 when none runs).
    #[serde(default)]
    pub rebuild_rate: u64,
    /// Writers fenced because a peer had seen a newer epoch.
    pub stale_epoch_fences: u64,
    /// Devices whose writer role the coordinator does not confirm now.
    pub unconfirmed: u64,
    /// Devices whose writer is fenced.
    pub fenced: u64,
    /// Members failed for answering too late after the others.
    pub stragglers: u64,
    /// Writer roles confirmed again after a lost lease.
    pub roles_regained: u64,
    /// Devices served as a standby (no writer role).
    #[serde(default)]
    pub standbys: u64,
    /// Writer roles moved by hand-overs, by [`HandoverDirection::index`].
    #[serde(default)]
    pub handovers: [u64; HandoverDirection::COUNT],
    /// How long the last hand-over into this ublkd took, from asking the
    /// writer to serving, in ms (0 before the first).
    #[serde(default)]
    pub last_handover_ms: u64,
    /// Reads sent to a second member, by [`HedgeOutcome::index`].
    pub hedged_reads: [u64; HedgeOutcome::COUNT],
    /// Rebuilds ended, by [`RebuildOutcome::index`].
    pub rebuilds: [u64; RebuildOutcome::COUNT],
}

impl ReplicaStats {
    /// Adds the totals of `other` (a device's, or those of devices gone),
    /// gauges included.
    pub fn add(&mut self, other: &ReplicaStats) {
        self.replicas += other.replicas;
        self.healthy += other.healthy;
        self.degraded += other.degraded;
        self.rebuild_bytes += other.rebuild_bytes;
        self.rebuild_remaining += other.rebuild_remaining;
        self.rebuild_rate += other.rebuild_rate;
        self.stale_epoch_fences += other.stale_epoch_fences;
        self.unconfirmed += other.unconfirmed;
        self.fenced += other.fenced;
        self.stragglers += other.stragglers;
        self.roles_regained += other.roles_regained;
        self.standbys += other.standbys;
        for (a, b) in self.handovers.iter_mut().zip(other.handovers) {
            *a += b;
        }
        self.last_handover_ms = self.last_handover_ms.max(other.last_handover_ms);
        for (a, b) in self.hedged_reads.iter_mut().zip(other.hedged_reads) {
            *a += b;
        }
        for (a, b) in self.rebuilds.iter_mut().zip(other.rebuilds) {
            *a += b;
        }
    }

    /// Only the totals (counters): what a device leaves behind when it
    /// goes, so that the counters summed over devices never go back.
    pub fn totals(&self) -> ReplicaStats {
        ReplicaStats {
            rebuild_bytes: self.rebuild_bytes,
            stale_epoch_fences: self.stale_epoch_fences,
            stragglers: self.stragglers,
            roles_regained: self.roles_regained,
            handovers: self.handovers,
            hedged_reads: self.hedged_reads,
            rebuilds: self.rebuilds,
            ..ReplicaStats::default()
        }
    }
}

type Source = Box<dyn Fn() -> ReplicaStats + Send + Sync>;

/// The families, refreshed from the source before each render.
pub struct ReplicaMetrics {
    replicas: Gauge,
    healthy: Gauge,
    degraded: Gauge,
    rebuild_bytes: Counter,
    rebuild_remaining: Gauge,
    rebuild_rate: Gauge,
    fences: Counter,
    unconfirmed: Gauge,
    fenced: Gauge,
    stragglers: Counter,
    roles_regained: Counter,
    standbys: Gauge,
    handovers: [Counter; HandoverDirection::COUNT],
    last_handover: Gauge,
    hedged_reads: [Counter; HedgeOutcome::COUNT],
    rebuilds: [Counter; RebuildOutcome::COUNT],
    source: Mutex<Option<Source>>,
}

impl std::fmt::Debug for ReplicaMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaMetrics").finish_non_exhaustive()
    }
}

impl ReplicaMetrics {
    /// Registers the families (zero until the source answers) and makes
    /// the result a collector of `telemetry`.
    pub fn new(telemetry: &Arc<Telemetry>) -> Arc<Self> {
        let t = &**telemetry;
        let m = Arc::new(Self {
            replicas: t.gauge("ublk_replicas", &[]),
            healthy: t.gauge("ublk_replicas_healthy", &[]),
            degraded: t.gauge("ublk_devices_degraded", &[]),
            rebuild_bytes: t.counter("ublk_rebuild_bytes_total", &[]),
            rebuild_remaining: t.gauge("ublk_rebuild_remaining_bytes", &[]),
            rebuild_rate: t.gauge("ublk_rebuild_bytes_per_second", &[]),
            fences: t.counter("ublk_writer_stale_epoch_fences_total", &[]),
            unconfirmed: t.gauge("ublk_replica_writers_unconfirmed", &[]),
            fenced: t.gauge("ublk_replica_writers_fenced", &[]),
            stragglers: t.counter("ublk_replica_stragglers_total", &[]),
            roles_regained: t.counter("ublk_replica_roles_regained_total", &[]),
            standbys: t.gauge("ublk_replica_standbys", &[]),
            handovers: HandoverDirection::ALL
                .map(|d| t.counter("ublk_replica_handovers_total", &[("direction", d.as_str())])),
            last_handover: t.gauge("ublk_replica_last_handover_seconds", &[]),
            hedged_reads: HedgeOutcome::ALL.map(|o| {
                t.counter(
                    "ublk_replica_hedged_reads_total",
                    &[("outcome", o.as_str())],
                )
            }),
            rebuilds: RebuildOutcome::ALL
                .map(|o| t.counter("ublk_rebuilds_total", &[("outcome", o.as_str())])),
            source: Mutex::new(None),
        });
        m.update_from(&ReplicaStats::default());
        telemetry.register_collector(&m);
        m
    }

    /// Publishes `s`; totals never go back.
    pub fn update_from(&self, s: &ReplicaStats) {
        self.replicas.set(s.replicas as f64);
        self.healthy.set(s.healthy as f64);
        self.degraded.set(s.degraded as f64);
        self.rebuild_bytes.absolute(s.rebuild_bytes);
        self.rebuild_remaining.set(s.rebuild_remaining as f64);
        self.rebuild_rate.set(s.rebuild_rate as f64);
        self.fences.absolute(s.stale_epoch_fences);
        self.unconfirmed.set(s.unconfirmed as f64);
        self.fenced.set(s.fenced as f64);
        self.stragglers.absolute(s.stragglers);
        self.roles_regained.absolute(s.roles_regained);
        self.standbys.set(s.standbys as f64);
        for (c, v) in self.handovers.iter().zip(s.handovers) {
            c.absolute(v);
        }
        self.last_handover.set(s.last_handover_ms as f64 / 1000.0);
        for (c, v) in self.hedged_reads.iter().zip(s.hedged_reads) {
            c.absolute(v);
        }
        for (c, v) in self.rebuilds.iter().zip(s.rebuilds) {
            c.absolute(v);
        }
    }

    /// Sets what the scrape samples.
    pub fn set_source(&self, source: impl Fn() -> ReplicaStats + Send + Sync + 'static) {
        *self.source.lock() = Some(Box::new(source));
    }
}

impl Collector for ReplicaMetrics {
    fn collect(&self) {
        let sampled = self.source.lock().as_ref().map(|f| f());
        if let Some(s) = sampled {
            self.update_from(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::Daemon;

    #[test]
    fn sampled_stats_render_without_device_labels() {
        let tel = Telemetry::isolated(Daemon::Ublkd, "test");
        let m = ReplicaMetrics::new(&tel);
        let has = |sample: &str| tel.render().unwrap().lines().any(|l| l == sample);
        assert!(has("ublk_devices_degraded 0"));
        m.set_source(|| ReplicaStats {
            replicas: 5,
            healthy: 4,
            degraded: 1,
            rebuild_bytes: 1 << 20,
            rebuild_remaining: 4096,
            rebuild_rate: 8 << 20,
            stale_epoch_fences: 1,
            unconfirmed: 2,
            fenced: 1,
            stragglers: 3,
            roles_regained: 1,
            standbys: 1,
            handovers: [2, 1],
            last_handover_ms: 150,
            hedged_reads: [2, 5],
            rebuilds: [1, 3, 0],
        });
        for s in [
            "ublk_replicas 5",
            "ublk_replicas_healthy 4",
            "ublk_devices_degraded 1",
            "ublk_rebuild_bytes_total 1048576",
            "ublk_rebuild_remaining_bytes 4096",
            "ublk_rebuild_bytes_per_second 8388608",
            "ublk_writer_stale_epoch_fences_total 1",
            "ublk_replica_writers_unconfirmed 2",
            "ublk_replica_writers_fenced 1",
            "ublk_replica_stragglers_total 3",
            "ublk_replica_roles_regained_total 1",
            "ublk_replica_standbys 1",
            "ublk_replica_handovers_total{direction=\"in\"} 2",
            "ublk_replica_handovers_total{direction=\"out\"} 1",
            "ublk_replica_last_handover_seconds 0.15",
            "ublk_replica_hedged_reads_total{outcome=\"won\"} 2",
            "ublk_replica_hedged_reads_total{outcome=\"lost\"} 5",
            "ublk_rebuilds_total{outcome=\"failed\"} 3",
        ] {
            assert!(has(s), "{s}");
        }
    }
}
