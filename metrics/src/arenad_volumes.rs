//! arenad's per-volume families (`arenad_volume_*`): which tenant fills
//! the arena, which one sends the operations, where the errors are.
//!
//! The volume is a label, so the series are bounded: the first
//! `max` volumes seen (arenad registers its configured volumes in order at
//! start) are labelled by name, every later one is counted under
//! [`OTHER`]; with labels off every volume is, for hosts whose volume
//! names must not leave the host. Counters are handles a session keeps
//! (no lookup per request); the sampled gauges are refreshed from the
//! store at each scrape.

use std::collections::HashMap;
use std::sync::Arc;

use metrics::{Counter, Gauge};
use parking_lot::Mutex;

use crate::arenad::{ArenaOp, ArenaOutcome};
use crate::shard::ShardedCounter;
use crate::telemetry::{Collector, Telemetry};

/// The label value of the volumes not labelled by name.
pub const OTHER: &str = "_other";

/// How volumes are labelled (arenad's `metrics_volume_labels` and
/// `metrics_max_volume_labels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeLabels {
    /// Label by name at all.
    pub enabled: bool,
    /// Most volumes labelled by name.
    pub max: usize,
}

impl Default for VolumeLabels {
    fn default() -> Self {
        Self {
            enabled: true,
            max: 32,
        }
    }
}

/// The counters of one label value, shared by the sessions of every volume
/// counted under it.
pub struct VolumeCounters {
    // Every answer of every session of the volume adds to these, from
    // every worker thread: sharded, or the threads fight over one cache
    // line (4 KiB reads over 8 connections of one volume lost 8% so).
    requests: [Arc<ShardedCounter>; ArenaOp::COUNT],
    bytes: [Arc<ShardedCounter>; ArenaOp::COUNT],
    errors: Counter,
    sessions: Gauge,
}

impl std::fmt::Debug for VolumeCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeCounters").finish_non_exhaustive()
    }
}

impl VolumeCounters {
    /// One request of `op` answered with `outcome`, `bytes` on the control
    /// stream both ways (request and answer frames).
    #[inline]
    pub fn answered(&self, op: ArenaOp, outcome: ArenaOutcome, bytes: u64) {
        self.requests[op.index()].increment(1);
        self.bytes[op.index()].increment(bytes);
        if matches!(
            outcome,
            ArenaOutcome::NoSpace | ArenaOutcome::Denied | ArenaOutcome::Error
        ) {
            self.errors.increment(1);
        }
    }

    /// A session of the volume completed its handshake.
    pub fn session_opened(&self) {
        self.sessions.increment(1.0);
    }

    /// A session of the volume ended.
    pub fn session_closed(&self) {
        self.sessions.decrement(1.0);
    }
}

/// One volume's state, sampled from the store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeSample {
    /// Its name.
    pub name: String,
    /// Bytes of its blobs in the RAM arena.
    pub resident_bytes: u64,
    /// Bytes of its blobs' images on swap.
    pub swap_bytes: u64,
    /// Leases pinning its blobs.
    pub leases: u64,
    /// Its quota in bytes.
    pub quota_bytes: u64,
}

/// The series of one label value.
struct Labelled {
    counters: Arc<VolumeCounters>,
    resident: Gauge,
    swap: Gauge,
    leases: Gauge,
    quota: Gauge,
}

type Source = Box<dyn Fn() -> Vec<VolumeSample> + Send + Sync>;

/// The per-volume families of one arenad.
pub struct VolumeMetrics {
    tel: Arc<Telemetry>,
    labels: VolumeLabels,
    /// Each volume's label value, fixed when first seen.
    assigned: Mutex<HashMap<String, String>>,
    by_label: Mutex<HashMap<String, Arc<Labelled>>>,
    source: Mutex<Option<Source>>,
}

impl std::fmt::Debug for VolumeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeMetrics")
            .field("labels", &self.labels)
            .finish_non_exhaustive()
    }
}

impl VolumeMetrics {
    /// The families, a collector of `telemetry`; no series until a volume
    /// is seen.
    pub fn new(telemetry: &Arc<Telemetry>, labels: VolumeLabels) -> Arc<Self> {
        let m = Arc::new(Self {
            tel: Arc::clone(telemetry),
            labels,
            assigned: Mutex::new(HashMap::new()),
            by_label: Mutex::new(HashMap::new()),
            source: Mutex::new(None),
        });
        telemetry.register_collector(&m);
        m
    }

    /// The label value of `volume`: its name while there is room, else
    /// [`OTHER`]. Fixed once given, so a volume's series never move.
    pub fn label(&self, volume: &str) -> String {
        let mut assigned = self.assigned.lock();
        if let Some(l) = assigned.get(volume) {
            return l.clone();
        }
        let named = assigned.values().filter(|l| *l != OTHER).count();
        let label = if self.labels.enabled && named < self.labels.max {
            volume.to_owned()
        } else {
            OTHER.to_owned()
        };
        assigned.insert(volume.to_owned(), label.clone());
        label
    }

    /// The series of label value `label`, registered the first time.
    fn series(&self, label: &str) -> Arc<Labelled> {
        let mut by_label = self.by_label.lock();
        if let Some(l) = by_label.get(label) {
            return Arc::clone(l);
        }
        let t = &*self.tel;
        let v = [("volume", label)];
        let per_op = |family: &'static str| {
            ArenaOp::ALL
                .map(|op| t.sharded_counter(family, &[("volume", label), ("op", op.as_str())]))
        };
        let errors = t.counter("arenad_volume_errors_total", &v);
        errors.increment(0);
        let l = Arc::new(Labelled {
            counters: Arc::new(VolumeCounters {
                requests: per_op("arenad_volume_requests_total"),
                bytes: per_op("arenad_volume_bytes_total"),
                errors,
                sessions: t.gauge("arenad_volume_sessions", &v),
            }),
            resident: t.gauge("arenad_volume_resident_bytes", &v),
            swap: t.gauge("arenad_volume_swap_bytes", &v),
            leases: t.gauge("arenad_volume_leases", &v),
            quota: t.gauge("arenad_volume_quota_bytes", &v),
        });
        by_label.insert(label.to_owned(), Arc::clone(&l));
        l
    }

    /// The counters `volume`'s sessions count into (registering its series
    /// the first time).
    pub fn counters(&self, volume: &str) -> Arc<VolumeCounters> {
        Arc::clone(&self.series(&self.label(volume)).counters)
    }

    /// Sets the function sampled at each scrape for the gauges (cheap: it
    /// runs on the scrape thread).
    pub fn set_source(&self, source: impl Fn() -> Vec<VolumeSample> + Send + Sync + 'static) {
        *self.source.lock() = Some(Box::new(source));
    }
}

impl Collector for VolumeMetrics {
    fn collect(&self) {
        let Some(samples) = self.source.lock().as_ref().map(|f| f()) else {
            return;
        };
        // Summed per label value: the volumes under `_other` together.
        let mut sums: HashMap<String, VolumeSample> = HashMap::new();
        for s in samples {
            let l = self.label(&s.name);
            let sum = sums.entry(l).or_default();
            sum.resident_bytes += s.resident_bytes;
            sum.swap_bytes += s.swap_bytes;
            sum.leases += s.leases;
            sum.quota_bytes += s.quota_bytes;
        }
        for label in sums.keys() {
            drop(self.series(label));
        }
        for (label, l) in self.by_label.lock().iter() {
            let s = sums.get(label).cloned().unwrap_or_default();
            l.resident.set(s.resident_bytes as f64);
            l.swap.set(s.swap_bytes as f64);
            l.leases.set(s.leases as f64);
            l.quota.set(s.quota_bytes as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::Daemon;

    fn sample(name: &str, resident: u64) -> VolumeSample {
        VolumeSample {
            name: name.into(),
            resident_bytes: resident,
            swap_bytes: 2 * resident,
            leases: 1,
            quota_bytes: 1 << 30,
        }
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn volumes_past_the_cap_are_counted_together_under_other() {
        let tel = Telemetry::isolated(Daemon::Arenad, "test");
        let m = VolumeMetrics::new(
            &tel,
            VolumeLabels {
                enabled: true,
                max: 2,
            },
        );
        for v in ["vm1", "vm2", "vm3", "vm4"] {
            m.counters(v)
                .answered(ArenaOp::Write, ArenaOutcome::Ok, 100);
        }
        m.counters("vm4")
            .answered(ArenaOp::Alloc, ArenaOutcome::NoSpace, 10);
        m.set_source(|| vec![sample("vm1", 4096), sample("vm3", 10), sample("vm4", 20)]);
        let text = tel.render().unwrap();
        let w = |v: &str| format!("arenad_volume_requests_total{{volume=\"{v}\",op=\"write\"}}");
        assert_eq!(value(&text, &w("vm1")), Some(1.0), "{text}");
        assert_eq!(value(&text, &w("vm2")), Some(1.0));
        assert_eq!(value(&text, &w(OTHER)), Some(2.0));
        assert_eq!(value(&text, &w("vm3")), None);
        assert_eq!(
            value(
                &text,
                "arenad_volume_bytes_total{volume=\"_other\",op=\"write\"}"
            ),
            Some(200.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_errors_total{volume=\"_other\"}"),
            Some(1.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_errors_total{volume=\"vm1\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_resident_bytes{volume=\"vm1\"}"),
            Some(4096.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_resident_bytes{volume=\"_other\"}"),
            Some(30.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_swap_bytes{volume=\"_other\"}"),
            Some(60.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_resident_bytes{volume=\"vm2\"}"),
            Some(0.0)
        );
    }

    #[test]
    fn with_labels_off_no_volume_name_is_exported() {
        let tel = Telemetry::isolated(Daemon::Arenad, "test");
        let m = VolumeMetrics::new(
            &tel,
            VolumeLabels {
                enabled: false,
                max: 32,
            },
        );
        let c = m.counters("secret-tenant");
        c.session_opened();
        c.answered(ArenaOp::Read, ArenaOutcome::Ok, 5);
        m.set_source(|| vec![sample("another-tenant", 1)]);
        let text = tel.render().unwrap();
        assert!(!text.contains("tenant"), "{text}");
        assert_eq!(
            value(&text, "arenad_volume_sessions{volume=\"_other\"}"),
            Some(1.0)
        );
        assert_eq!(
            value(&text, "arenad_volume_leases{volume=\"_other\"}"),
            Some(1.0)
        );
    }
}
