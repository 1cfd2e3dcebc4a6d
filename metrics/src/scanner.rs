//! The scanner: turns tracker slots into in-flight, stalled and oldest-age
//! gauges.
//!
//! Completion latency cannot show a request that never completes; sampling
//! every slot every few seconds can. One scanner per process aggregates all
//! tables by label set, so devices sharing a target label share series.

use crate::correlation::CorrelationId;
use crate::events;
use crate::labels::IoOp;
use crate::telemetry::Telemetry;
use crate::tracker::TrackerTable;
use metrics::Gauge;
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// Scanner settings.
#[derive(Debug, Clone, Copy)]
pub struct ScannerConfig {
    /// Time between scans (default 5 s).
    pub interval: Duration,
    /// Age at which an in-flight request counts as stalled (default 30 s).
    pub stall_threshold: Duration,
}

impl Default for ScannerConfig {
    fn default() -> Self {
        ScannerConfig {
            interval: Duration::from_secs(5),
            stall_threshold: Duration::from_secs(30),
        }
    }
}

/// Totals of one scan, over all live tables.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanSummary {
    /// Requests in flight.
    pub inflight: u64,
    /// Requests at or past the stall threshold.
    pub stalled: u64,
    /// Age of the oldest in-flight request.
    pub oldest: Duration,
    /// Requests that crossed the threshold for the first time in this scan
    /// (one `request.stuck` event each).
    pub newly_stuck: u64,
    /// Tables dropped since the previous scan.
    pub pruned: usize,
}

type SeriesKey = (Box<str>, Option<u32>);

struct Series {
    inflight: [Gauge; IoOp::COUNT],
    stalled: [Gauge; IoOp::COUNT],
    oldest: Gauge,
}

impl Series {
    fn set(&self, inflight: &[u64; IoOp::COUNT], stalled: &[u64; IoOp::COUNT], oldest: Duration) {
        for i in 0..IoOp::COUNT {
            self.inflight[i].set(inflight[i] as f64);
            self.stalled[i].set(stalled[i] as f64);
        }
        self.oldest.set(oldest.as_secs_f64());
    }
}

#[derive(Default)]
struct State {
    tables: Vec<(Weak<TrackerTable>, SeriesKey)>,
    series: BTreeMap<SeriesKey, Series>,
}

/// One per process; see the module documentation.
pub struct Scanner {
    telemetry: Arc<Telemetry>,
    /// Changed at run time by [`Scanner::set_config`] (SIGHUP).
    config: Mutex<ScannerConfig>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Scanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scanner")
            .field("config", &*self.config.lock())
            .finish_non_exhaustive()
    }
}

impl Scanner {
    /// A scanner publishing through `telemetry`.
    pub fn new(telemetry: Arc<Telemetry>, config: ScannerConfig) -> Arc<Scanner> {
        Arc::new(Scanner {
            telemetry,
            config: Mutex::new(config),
            state: Mutex::new(State::default()),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> ScannerConfig {
        *self.config.lock()
    }

    /// Replaces the settings: the next scan uses the new threshold, and the
    /// scan thread waits the new interval after it.
    pub fn set_config(&self, config: ScannerConfig) {
        *self.config.lock() = config;
    }

    /// Adds a table. Only a weak reference is kept: when the device goes
    /// away and drops its table, the next scan prunes it and zeroes its
    /// gauges.
    pub fn register(&self, table: &Arc<TrackerTable>) {
        let key: SeriesKey = (table.target().into(), table.device());
        let mut st = self.state.lock();
        if !st.series.contains_key(&key) {
            let series = self.make_series(&key);
            st.series.insert(key.clone(), series);
        }
        st.tables.push((Arc::downgrade(table), key));
    }

    fn make_series(&self, key: &SeriesKey) -> Series {
        let dev = key.1.map(crate::labels::device_label);
        let labels = |op: Option<IoOp>| {
            let mut l: Vec<(&'static str, &str)> = vec![("target", &key.0)];
            if let Some(op) = op {
                l.push(("op", op.as_str()));
            }
            if let Some(d) = &dev {
                l.push(("device", d.as_str()));
            }
            l
        };
        let t = &self.telemetry;
        Series {
            inflight: IoOp::ALL.map(|op| t.gauge("ublk_io_inflight", &labels(Some(op)))),
            stalled: IoOp::ALL.map(|op| t.gauge("ublk_io_stalled", &labels(Some(op)))),
            oldest: t.gauge("ublk_io_oldest_inflight_seconds", &labels(None)),
        }
    }

    /// Runs one scan now. Cost: O(slots of live tables).
    pub fn scan(&self) -> ScanSummary {
        let threshold_ns =
            u64::try_from(self.config().stall_threshold.as_nanos()).unwrap_or(u64::MAX);
        let mut st = self.state.lock();
        let before = st.tables.len();
        st.tables.retain(|(w, _)| w.strong_count() > 0);
        let mut summary = ScanSummary {
            pruned: before - st.tables.len(),
            ..ScanSummary::default()
        };
        // Every known label set starts at zero, so one whose tables are all
        // gone publishes zeros instead of its last values.
        let mut totals: BTreeMap<SeriesKey, ([u64; IoOp::COUNT], [u64; IoOp::COUNT], u64)> = st
            .series
            .keys()
            .map(|k| (k.clone(), ([0; IoOp::COUNT], [0; IoOp::COUNT], 0)))
            .collect();
        for (weak, key) in &st.tables {
            let Some(table) = weak.upgrade() else {
                continue;
            };
            let Some(entry) = totals.get_mut(key) else {
                continue;
            };
            let now = table.clock().now_ns();
            for slot in table.slots() {
                let Some(s) = slot.sample() else { continue };
                let age = now.saturating_sub(s.start_ns);
                entry.0[s.op.index()] += 1;
                entry.2 = entry.2.max(age);
                summary.inflight += 1;
                if age >= threshold_ns {
                    entry.1[s.op.index()] += 1;
                    summary.stalled += 1;
                    if slot
                        .stuck_logged
                        .swap(s.corr, std::sync::atomic::Ordering::Relaxed)
                        != s.corr
                    {
                        summary.newly_stuck += 1;
                        events::request_stuck(
                            CorrelationId::from_raw(s.corr),
                            table.target(),
                            table.log_device(),
                            s.op,
                            Duration::from_nanos(age),
                        );
                    }
                }
                summary.oldest = summary.oldest.max(Duration::from_nanos(age));
            }
        }
        let live: std::collections::BTreeSet<SeriesKey> =
            st.tables.iter().map(|(_, k)| k.clone()).collect();
        for (key, (inflight, stalled, oldest)) in &totals {
            if let Some(series) = st.series.get(key) {
                series.set(inflight, stalled, Duration::from_nanos(*oldest));
            }
        }
        // Label sets with no table left have just been zeroed; forget them so
        // the map stays bounded by live devices under per-device labels.
        st.series.retain(|k, _| live.contains(k));
        drop(st);
        self.telemetry.scanner_ran();
        summary
    }

    /// Starts the periodic scan on a dedicated thread; dropping the returned
    /// handle stops and joins it.
    pub fn spawn(self: &Arc<Self>) -> std::io::Result<ScannerThread> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let me = Arc::clone(self);
        let stop2 = Arc::clone(&stop);
        let join = std::thread::Builder::new()
            .name("metrics-scanner".into())
            .spawn(move || {
                let (lock, cv) = &*stop2;
                loop {
                    me.scan();
                    let mut stopped = lock.lock();
                    if !*stopped {
                        let interval = me.config().interval;
                        cv.wait_for(&mut stopped, interval);
                    }
                    if *stopped {
                        break;
                    }
                }
            })?;
        Ok(ScannerThread {
            stop,
            join: Some(join),
        })
    }
}

/// The running periodic scan; stops when dropped.
pub struct ScannerThread {
    stop: Arc<(Mutex<bool>, Condvar)>,
    join: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ScannerThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScannerThread").finish_non_exhaustive()
    }
}

impl Drop for ScannerThread {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}
