//! Driver statistics: what the data path really did.
//!
//! Choosing RDMA does not prove that payloads moved over RDMA: a request can
//! be declined, too large, or fall back to TCP after a registration failure.
//! Each data-path driver reports named counters and gauges through one
//! transport-neutral trait; this module sums them over devices, exports them
//! as `ublk_driver_*` families and writes the `ublkctl stats` summary.

use crate::families::Kind;
use crate::labels::{IoOp, Transport};
use crate::telemetry::{Collector, Telemetry};
use metrics::{Counter, Gauge};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;

pub use crate::families::driver_names as names;

/// Most distinct statistic families one registry exports; keeps a driver
/// that invents names from growing the exposition without bound.
pub const MAX_FAMILIES: usize = 128;

/// One counter value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterValue {
    /// snake_case name, without `_total`.
    pub name: Cow<'static, str>,
    /// Block op the count belongs to, when it is per op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<IoOp>,
    /// Sub-reason (e.g. why a payload went over TCP), exported as a `reason`
    /// label; must come from a closed set in the driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Cow<'static, str>>,
    /// Monotonic value since the driver started.
    pub value: u64,
}

/// One gauge value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GaugeValue {
    /// snake_case name.
    pub name: Cow<'static, str>,
    /// Current value.
    pub value: f64,
}

/// One RDMA rail of a device, over its queues (each queue has a QP on it).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RailValue {
    /// Its index (0 or 1), as RAIL_CONNECT names it.
    pub rail: u8,
    /// The local RDMA device it uses.
    pub rdma_device: String,
    /// Queues with this rail.
    pub queues: u32,
    /// Queues whose QP on it is up.
    pub queues_up: u32,
    /// Why it is off (it will not be used: no local device, not served by
    /// the peer), from the first queue where it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub off: Option<String>,
    /// Since when (Unix time, ms) the QP of the queue down longest is down;
    /// absent while it is up on every queue (or off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down_since_ms: Option<u64>,
    /// Transfers it moved (each half of a striped payload counts).
    pub transfers: u64,
    /// Payload bytes it moved.
    pub bytes: u64,
    /// Payload bytes posted on it and not completed yet.
    pub outstanding: u64,
    /// Times a QP on it failed under load (the rail was lost).
    pub lost: u64,
    /// QPs brought up on it (the first of each queue included).
    pub connects: u64,
}

impl RailValue {
    /// `up` (every queue), `degraded` (some), `down` (none), or `off`.
    pub fn state(&self) -> &'static str {
        match (self.off.is_some(), self.queues_up) {
            (true, 0) => "off",
            (_, 0) => "down",
            (_, n) if n < self.queues => "degraded",
            _ => "up",
        }
    }
}

/// A driver's statistics at one instant. Serializable so that `ublkctl`
/// can fetch it over the control socket.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DriverSnapshot {
    /// Driver name (`rdma`, `tcp`); becomes the `driver` label.
    pub driver: Cow<'static, str>,
    /// Counters.
    pub counters: Vec<CounterValue>,
    /// Gauges.
    pub gauges: Vec<GaugeValue>,
    /// RDMA rails, by index (none for a TCP driver).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rails: Vec<RailValue>,
}

impl DriverSnapshot {
    /// Whether it reports nothing.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty() && self.gauges.is_empty() && self.rails.is_empty()
    }

    /// Sum of a counter over ops and reasons, optionally for one op.
    pub fn counter(&self, name: &str, op: Option<IoOp>) -> u64 {
        self.counters
            .iter()
            .filter(|c| c.name == name && (op.is_none() || c.op == op))
            .fold(0u64, |a, c| a.saturating_add(c.value))
    }
}

/// Implemented by each data-path driver (TCP now, RDMA later).
pub trait DriverStats: Send + Sync {
    /// Current statistics. Called at scrape time and by `ublkctl stats`,
    /// never on the I/O path; it may allocate.
    fn snapshot(&self) -> DriverSnapshot;
}

/// An RDMA device as a label value: its name as sysfs holds it, with the
/// port and GID index the driver uses (`mlx5_0:1/gid3`).
fn valid_rdma_device(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 80
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':' | b'/'))
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.as_bytes()[0].is_ascii_lowercase()
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

// (name, op, reason)
type StatKey = (String, Option<IoOp>, Option<String>);

struct Device {
    configured: Transport,
    source: Arc<dyn DriverStats>,
    driver: String,
    /// Its rails at the last look (their counters go to the retired totals
    /// when it goes).
    rails: Vec<RailValue>,
    // Per statistic: last raw value seen and the monotonic total derived
    // from it (a driver restart that resets its counters adds, never
    // subtracts).
    seen: BTreeMap<StatKey, (u64, u64)>,
}

impl Device {
    fn absorb(&mut self, snap: &DriverSnapshot) {
        self.driver = snap.driver.to_string();
        for c in &snap.counters {
            let key = (
                c.name.to_string(),
                c.op,
                c.reason.as_ref().map(|r| r.to_string()),
            );
            let e = self.seen.entry(key).or_insert((0, 0));
            let delta = if c.value >= e.0 {
                c.value - e.0
            } else {
                c.value
            };
            e.0 = c.value;
            e.1 = e.1.saturating_add(delta);
        }
    }
}

/// Most `(rail, rdma_device)` label sets of the `ublk_driver_rail_*`
/// families: two rails on a few devices a host has.
pub const MAX_RAIL_SERIES: usize = 8;

/// A rail's label set: its index and its RDMA device.
type RailKey = (u8, String);

/// The `ublk_driver_rail_*` counters of removed devices, and the handles.
#[derive(Default)]
struct RailSeries {
    retired: BTreeMap<RailKey, [u64; 3]>,
    counters: BTreeMap<(RailKey, &'static str), Counter>,
    gauges: BTreeMap<(RailKey, &'static str), Gauge>,
}

/// The rail counters, in `RailSeries::retired` order.
const RAIL_COUNTERS: [&str; 3] = [
    "ublk_driver_rail_transfers_total",
    "ublk_driver_rail_bytes_total",
    "ublk_driver_rail_lost_total",
];

/// The rail gauges.
const RAIL_GAUGES: [&str; 3] = [
    "ublk_driver_rail_queues",
    "ublk_driver_rail_queues_up",
    "ublk_driver_rail_outstanding_bytes",
];

fn rail_counts(r: &RailValue) -> [u64; 3] {
    [r.transfers, r.bytes, r.lost]
}

#[derive(Default)]
struct Inner {
    devices: BTreeMap<u32, Device>,
    rails: RailSeries,
    // (driver, name, reason) -> totals of removed devices.
    retired: BTreeMap<(String, String, Option<String>), u64>,
    counters: BTreeMap<(String, String, Option<String>), Counter>,
    gauges: BTreeMap<(String, String), Gauge>,
    families: BTreeSet<String>,
}

/// Per-device driver statistics and their Prometheus export (ublkd).
pub struct DriverStatsRegistry {
    telemetry: Arc<Telemetry>,
    reporting: Gauge,
    partial: Gauge,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for DriverStatsRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverStatsRegistry")
            .finish_non_exhaustive()
    }
}

/// One device's entry in the `ublkctl stats` summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceDriverReport {
    /// Device id (N of `/dev/ublkbN`).
    pub device: u32,
    /// Transport the device was configured for (`auto` devices pass the
    /// transport they prefer, normally RDMA).
    pub configured: Transport,
    /// Its statistics, `None` when the driver reports nothing.
    pub stats: Option<DriverSnapshot>,
}

impl DriverStatsRegistry {
    /// Creates the registry and registers it as a collector of `telemetry`,
    /// so every scrape refreshes the `ublk_driver_*` families.
    pub fn new(telemetry: &Arc<Telemetry>) -> Arc<Self> {
        let reg = Arc::new(DriverStatsRegistry {
            telemetry: Arc::clone(telemetry),
            reporting: telemetry.gauge("ublk_driver_reporting", &[]),
            partial: telemetry.gauge("ublk_driver_partial", &[]),
            inner: Mutex::new(Inner::default()),
        });
        telemetry.register_collector(&reg);
        reg
    }

    /// Adds a device's driver. Replaces an earlier source for the same
    /// device id (its counts so far are retired first, so nothing is lost).
    pub fn add_device(&self, device: u32, configured: Transport, source: Arc<dyn DriverStats>) {
        let mut inner = self.inner.lock();
        if let Some(old) = inner.devices.remove(&device) {
            Self::retire(&mut inner, old);
        }
        inner.devices.insert(
            device,
            Device {
                configured,
                source,
                driver: String::new(),
                rails: Vec::new(),
                seen: BTreeMap::new(),
            },
        );
    }

    /// Removes a device, folding its final counts into the totals so that
    /// exported counters do not drop.
    pub fn remove_device(&self, device: u32) {
        let mut inner = self.inner.lock();
        if let Some(dev) = inner.devices.remove(&device) {
            Self::retire(&mut inner, dev);
        }
    }

    fn retire(inner: &mut Inner, mut dev: Device) {
        let snap = dev.source.snapshot();
        dev.absorb(&snap);
        for r in &snap.rails {
            let e = inner
                .rails
                .retired
                .entry((r.rail, r.rdma_device.clone()))
                .or_default();
            for (t, v) in e.iter_mut().zip(rail_counts(r)) {
                *t = t.saturating_add(v);
            }
        }
        for ((name, _op, reason), (_, total)) in dev.seen {
            let e = inner
                .retired
                .entry((dev.driver.clone(), name, reason))
                .or_insert(0);
            *e = e.saturating_add(total);
        }
    }

    /// Snapshots of every device, for `ublkctl stats` (send them over the
    /// control socket, then call [`summarize`]).
    pub fn reports(&self) -> Vec<DeviceDriverReport> {
        let inner = self.inner.lock();
        inner
            .devices
            .iter()
            .map(|(id, d)| {
                let snap = d.source.snapshot();
                let empty = snap.is_empty();
                DeviceDriverReport {
                    device: *id,
                    configured: d.configured,
                    stats: (!empty).then_some(snap),
                }
            })
            .collect()
    }

    /// Refreshes the exported families from every device's driver.
    pub fn publish(&self) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut gauge_sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut reporting = 0u32;
        for dev in inner.devices.values_mut() {
            let snap = dev.source.snapshot();
            if snap.is_empty() {
                continue;
            }
            reporting += 1;
            dev.absorb(&snap);
            dev.rails = snap.rails;
            for g in &snap.gauges {
                *gauge_sums.entry(g.name.to_string()).or_insert(0.0) += g.value;
            }
        }
        self.publish_rails(inner);
        let drivers: BTreeSet<String> = inner
            .devices
            .values()
            .filter(|d| !d.driver.is_empty())
            .map(|d| d.driver.clone())
            .collect();
        self.reporting.set(f64::from(reporting));
        if drivers.len() > 1 {
            // Sums over different drivers mean nothing; keep the last
            // exported values (counters must not go back) and say so.
            self.partial.set(1.0);
            return;
        }
        self.partial.set(0.0);
        let mut totals: BTreeMap<(String, String, Option<String>), u64> =
            inner.retired.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for dev in inner.devices.values() {
            for ((name, _op, reason), (_, total)) in &dev.seen {
                let e = totals
                    .entry((dev.driver.clone(), name.clone(), reason.clone()))
                    .or_insert(0);
                *e = e.saturating_add(*total);
            }
        }
        for ((driver, name, reason), value) in totals {
            if let Some(c) = self.counter_handle(inner, &driver, &name, reason.as_deref()) {
                // absolute() keeps the maximum, so the series never drops.
                c.absolute(value);
            }
        }
        if let Some(driver) = drivers.into_iter().next() {
            for (name, value) in gauge_sums {
                if let Some(g) = self.gauge_handle(inner, &driver, &name) {
                    g.set(value);
                }
            }
        }
    }

    /// The `ublk_driver_rail_*` families, summed over devices by rail and
    /// RDMA device (a label set not seen this time reads 0 in the gauges).
    fn publish_rails(&self, inner: &mut Inner) {
        let mut gauges: BTreeMap<RailKey, [u64; 3]> = BTreeMap::new();
        let mut counts: BTreeMap<RailKey, [u64; 3]> = inner.rails.retired.clone();
        for r in inner.devices.values().flat_map(|d| &d.rails) {
            let key = (r.rail, r.rdma_device.clone());
            let g = gauges.entry(key.clone()).or_default();
            for (t, v) in
                g.iter_mut()
                    .zip([u64::from(r.queues), u64::from(r.queues_up), r.outstanding])
            {
                *t = t.saturating_add(v);
            }
            let c = counts.entry(key).or_default();
            for (t, v) in c.iter_mut().zip(rail_counts(r)) {
                *t = t.saturating_add(v);
            }
        }
        let series = &mut inner.rails;
        for ((key, _), g) in &series.gauges {
            if !gauges.contains_key(key) {
                g.set(0.0);
            }
        }
        let tel = &self.telemetry;
        for (key, values) in gauges {
            for (family, v) in RAIL_GAUGES.into_iter().zip(values) {
                let admitted = Self::rail_admits(series, &key);
                let make = |labels: &[(&'static str, &str)]| tel.gauge(family, labels);
                if let Some(g) = Self::rail_handle(&mut series.gauges, admitted, &key, family, make)
                {
                    g.set(v as f64);
                }
            }
        }
        for (key, values) in counts {
            for (family, v) in RAIL_COUNTERS.into_iter().zip(values) {
                let admitted = Self::rail_admits(series, &key);
                let make = |labels: &[(&'static str, &str)]| tel.counter(family, labels);
                if let Some(c) =
                    Self::rail_handle(&mut series.counters, admitted, &key, family, make)
                {
                    c.absolute(v);
                }
            }
        }
    }

    fn rail_labels(key: &RailKey) -> Option<(String, &str)> {
        valid_rdma_device(&key.1).then(|| (key.0.to_string(), key.1.as_str()))
    }

    /// Whether another label set fits (see [`MAX_RAIL_SERIES`]).
    fn rail_admits(series: &RailSeries, key: &RailKey) -> bool {
        let mut keys: BTreeSet<&RailKey> = series.gauges.keys().map(|(k, _)| k).collect();
        keys.extend(series.counters.keys().map(|(k, _)| k));
        keys.contains(key) || keys.len() < MAX_RAIL_SERIES
    }

    /// The handle of `family` for `key`, made by `make` with its labels
    /// the first time (`admitted`: the label set fits the bound).
    fn rail_handle<T: Clone>(
        handles: &mut BTreeMap<(RailKey, &'static str), T>,
        admitted: bool,
        key: &RailKey,
        family: &'static str,
        make: impl FnOnce(&[(&'static str, &str)]) -> T,
    ) -> Option<T> {
        if let Some(h) = handles.get(&(key.clone(), family)) {
            return Some(h.clone());
        }
        let (rail, device) = Self::rail_labels(key)?;
        if !admitted {
            return None;
        }
        let h = make(&[("rail", &rail), ("rdma_device", device)]);
        handles.insert((key.clone(), family), h.clone());
        Some(h)
    }

    fn admit_family(inner: &mut Inner, family: &str) -> bool {
        if inner.families.contains(family) {
            return true;
        }
        if inner.families.len() >= MAX_FAMILIES {
            return false;
        }
        inner.families.insert(family.to_string());
        true
    }

    fn counter_handle(
        &self,
        inner: &mut Inner,
        driver: &str,
        name: &str,
        reason: Option<&str>,
    ) -> Option<Counter> {
        let key = (
            driver.to_string(),
            name.to_string(),
            reason.map(str::to_string),
        );
        if let Some(c) = inner.counters.get(&key) {
            return Some(c.clone());
        }
        if !valid_name(name) || !valid_name(driver) || reason.is_some_and(|r| !valid_name(r)) {
            return None;
        }
        let base = name.strip_suffix("_total").unwrap_or(name);
        let family = format!("ublk_driver_{base}_total");
        if !Self::admit_family(inner, &family) {
            return None;
        }
        self.telemetry
            .describe(family.clone(), Kind::Counter, names::help(base));
        let mut labels: Vec<(&'static str, &str)> = vec![("driver", driver)];
        if let Some(r) = reason {
            labels.push(("reason", r));
        }
        let c = self.telemetry.counter(family, &labels);
        inner.counters.insert(key, c.clone());
        Some(c)
    }

    fn gauge_handle(&self, inner: &mut Inner, driver: &str, name: &str) -> Option<Gauge> {
        let key = (driver.to_string(), name.to_string());
        if let Some(g) = inner.gauges.get(&key) {
            return Some(g.clone());
        }
        if !valid_name(name) || !valid_name(driver) {
            return None;
        }
        let family = format!("ublk_driver_{name}");
        if !Self::admit_family(inner, &family) {
            return None;
        }
        self.telemetry
            .describe(family.clone(), Kind::Gauge, names::help(name));
        let g = self.telemetry.gauge(family, &[("driver", driver)]);
        inner.gauges.insert(key, g.clone());
        Some(g)
    }
}

impl Collector for DriverStatsRegistry {
    fn collect(&self) {
        self.publish();
    }
}

fn driver_title(driver: &str) -> String {
    match driver {
        "rdma" => "RDMA".to_string(),
        "tcp" => "TCP".to_string(),
        other => other.to_string(),
    }
}

/// The `ublkctl stats` driver block: per device and op, transfers over RDMA
/// and payload requests over TCP; one line per non-zero problem counter; a
/// warning for an RDMA device that moved nothing over RDMA and for a device
/// with no statistics. Counts only: a percentage would hide small numbers.
pub fn summarize(reports: &[DeviceDriverReport]) -> String {
    let mut out = String::new();
    for r in reports {
        let dev = format!("ublkb{}", r.device);
        let Some(s) = &r.stats else {
            let _ = writeln!(out, "{dev}: warning: no driver statistics reported");
            continue;
        };
        let title = driver_title(&s.driver);
        let mut any_op = false;
        for op in IoOp::ALL {
            let rdma = s.counter(names::RDMA_TRANSFERRED, Some(op));
            let tcp = s.counter(names::TCP_PAYLOAD_REQUESTS, Some(op));
            if rdma == 0 && tcp == 0 {
                continue;
            }
            any_op = true;
            let _ = writeln!(
                out,
                "{dev}: {title} data path - {}: {rdma} transfers over RDMA, {tcp} payload requests over TCP",
                op.title()
            );
        }
        if !any_op {
            let _ = writeln!(out, "{dev}: {title} data path - no payload requests");
        }
        for r in &s.rails {
            let _ = writeln!(
                out,
                "{dev}:   rail {} ({}) {}, {}/{} queues up: {} bytes in {} transfers, {} lost",
                r.rail,
                r.rdma_device,
                r.state(),
                r.queues_up,
                r.queues,
                r.bytes,
                r.transfers,
                r.lost
            );
        }
        for problem in names::PROBLEMS {
            for c in s
                .counters
                .iter()
                .filter(|c| c.name == *problem && c.value > 0)
            {
                let op =
                    c.op.map(|o| format!(" ({})", o.as_str()))
                        .unwrap_or_default();
                let reason = c
                    .reason
                    .as_ref()
                    .map(|r| format!(" [{r}]"))
                    .unwrap_or_default();
                let _ = writeln!(out, "{dev}:   {problem}{op}{reason}: {}", c.value);
            }
        }
        if r.configured == Transport::Rdma && s.counter(names::RDMA_TRANSFERRED, None) == 0 {
            let _ = writeln!(
                out,
                "{dev}: warning: configured for RDMA but moved no payload over RDMA"
            );
        }
    }
    out
}
