//! ublkd's wiring of the observability contract (`ublk-metrics`): one
//! [`Observability`] per process owns the telemetry plane, the tracker
//! scanner, the driver-statistics registry and the request accounting, and
//! one [`DeviceObs`] per device holds what its queues update on the I/O
//! path and what readiness reads (state and peer flags, kept up to date by
//! the device manager and the requests, so that `/ready` costs O(devices)).
//!
//! Each block request is observed once, by one owner: the [`RequestObs`]
//! that [`DeviceObs::begin`] returns holds its tracker slot, its request and
//! attempt accounting, the device's `ublkctl stats` counters and its
//! `request.failed` event (`request.rs`), and, with `[tracing] enabled`, its
//! spans and exemplars. Nothing here holds a session: the device manager
//! reports what it sees of them (`peer_checked`), and the arena clients
//! sample their sockets' TCP_INFO into the process's [`TcpLinks`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use ublk_metrics::{
    events, Clock, DeviceDriverReport, DriverStats, DriverStatsRegistry, IoMetrics, MonotonicClock,
    NotReadyReason, NotReadySet, Phase, Probes, Reason, RequestAccounting, Scanner, ScannerConfig,
    TableSnapshot, TcpLinks, Telemetry, TraceConfig, Tracer, TrackerConfig, TrackerError,
    TrackerTable, Transport,
};

use crate::config::{self, MetricsConfig, TracingConfig};
use crate::device_stats::DeviceStats;

mod request;

pub use request::{AttemptObs, Failure, RequestObs};

/// The target label of every ublkd device (the arena target).
pub const TARGET: &str = "arena";

/// Where a device is in its life, as readiness and `/diagnostics` see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DevState {
    /// Being added.
    Starting = 0,
    /// Re-attaching to a quiesced kernel device.
    Recovering = 1,
    /// Serving I/O.
    Live = 2,
    /// Its queues stopped.
    Stopped = 3,
    /// Could not be started or recovered.
    Failed = 4,
}

impl DevState {
    /// Stable lower-case name (`ublkctl list` uses the same).
    pub fn name(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Recovering => "recovering",
            Self::Live => "live",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Starting,
            1 => Self::Recovering,
            2 => Self::Live,
            3 => Self::Stopped,
            _ => Self::Failed,
        }
    }
}

/// What the metrics side of a device needs to know about it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceShape {
    /// Device id (N of `/dev/ublkbN`).
    pub id: u32,
    /// Hardware queues.
    pub queues: u16,
    /// Tags per queue.
    pub depth: u16,
    /// Transport the device was configured for.
    pub transport: config::TransportChoice,
}

/// One device's observability state, shared by its queue threads.
pub struct DeviceObs {
    shape: DeviceShape,
    state: AtomicU8,
    peer_connected: AtomicBool,
    stats: Arc<DeviceStats>,
    table: Arc<TrackerTable>,
    io: IoMetrics,
    acct: Arc<RequestAccounting>,
    /// Set when `[tracing] enabled`.
    tracer: Option<Tracer>,
    /// The data path its queues negotiated, and why not RDMA when not.
    negotiated: Option<(Transport, Option<String>)>,
    /// Per queue: whether its arena connection was up at the last check.
    links: Mutex<Vec<bool>>,
}

impl std::fmt::Debug for DeviceObs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceObs")
            .field("shape", &self.shape)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl DeviceObs {
    /// Device id.
    pub fn id(&self) -> u32 {
        self.shape.id
    }

    /// The device's counters for `ublkctl stats`.
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// The in-flight slots, one per (queue, tag).
    pub fn table(&self) -> &TrackerTable {
        &self.table
    }

    /// Current state.
    pub fn state(&self) -> DevState {
        DevState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Sets the state (device thread).
    pub fn set_state(&self, s: DevState) {
        self.state.store(s as u8, Ordering::Release);
    }

    /// The data path the device uses: RDMA when every queue negotiated
    /// it, else TCP (with the first reason a queue gave), `None` without
    /// queues (a failed device).
    pub fn negotiated(&self) -> Option<(Transport, Option<String>)> {
        self.negotiated.clone()
    }

    /// Whether every queue's arena connection was up at the last check.
    pub fn peer_connected(&self) -> bool {
        self.peer_connected.load(Ordering::Acquire)
    }

    /// A request reached the peer and got an answer: the connection is up.
    /// One load on the I/O path; a store only on a change.
    #[inline]
    pub fn peer_ok(&self) {
        if !self.peer_connected.load(Ordering::Relaxed) {
            self.peer_connected.store(true, Ordering::Release);
        }
    }

    /// The peer was lost (or could not be reached): readiness reports
    /// `peer_disconnected` and `peer.disconnected` is logged once per loss.
    pub fn peer_lost(&self, phase: Phase, reason: Reason) {
        if self.peer_connected.swap(false, Ordering::AcqRel) {
            events::peer_disconnected(Some(self.shape.id), phase, reason);
        }
    }

    /// The device manager checked the queues' arena connections (`links`,
    /// one per queue, re-established where it could): readiness follows,
    /// and `peer.reconnected` / `peer.disconnected` are logged on a change.
    pub fn peer_checked(&self, links: &[bool]) {
        *self.links.lock() = links.to_vec();
        if links.iter().all(|up| *up) {
            if !self.peer_connected.swap(true, Ordering::AcqRel) {
                tracing::info!(event = events::PEER_RECONNECTED, device = self.shape.id);
            }
        } else {
            self.peer_lost(Phase::Connect, Reason::Unavailable);
        }
    }

    fn diagnostics(&self, stall_threshold: Duration) -> serde_json::Value {
        let TableSnapshot {
            inflight,
            stalled,
            oldest,
        } = self.table.snapshot(stall_threshold);
        let connections: Vec<&str> = self
            .links
            .lock()
            .iter()
            .map(|up| if *up { "connected" } else { "disconnected" })
            .collect();
        serde_json::json!({
            "id": self.shape.id,
            "state": self.state().name(),
            "queues": self.shape.queues,
            "queue_depth": self.shape.depth,
            "transport_configured": self.shape.transport.name(),
            "transport_in_use": self.negotiated().map_or("none", |(n, _)| n.as_str()),
            "peer_connected": self.peer_connected(),
            "connections": connections,
            "inflight": inflight,
            "stalled": stalled,
            "oldest_inflight_seconds": oldest.as_secs_f64(),
        })
    }
}

fn slow_threshold(cfg: &MetricsConfig) -> Option<Duration> {
    (cfg.slow_threshold_ms > 0).then(|| Duration::from_millis(cfg.slow_threshold_ms))
}

/// Registering a device's metrics failed.
#[derive(Debug, thiserror::Error)]
pub enum ObsError {
    /// The tracker table could not be built for this geometry.
    #[error("device {id}: request tracker: {source}")]
    Tracker {
        /// Device id.
        id: u32,
        /// Why.
        source: TrackerError,
    },
}

/// The process's observability: see the module documentation.
pub struct Observability {
    tel: Arc<Telemetry>,
    scanner: Arc<Scanner>,
    driver: Arc<DriverStatsRegistry>,
    acct: Arc<RequestAccounting>,
    tracer: Option<Tracer>,
    tcp_links: Arc<TcpLinks>,
    clock: Arc<dyn Clock>,
    per_device_labels: bool,
    /// `[metrics] slow_threshold_ms` in force (SIGHUP changes it).
    slow_threshold: Mutex<Option<Duration>>,
    control_socket_up: AtomicBool,
    /// The ublk control node, when readiness should check that the driver
    /// is loaded (the daemon sets it; in-process tests have no driver).
    driver_node: Mutex<Option<std::path::PathBuf>>,
    devices: Mutex<BTreeMap<u32, Arc<DeviceObs>>>,
}

impl std::fmt::Debug for Observability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observability").finish_non_exhaustive()
    }
}

/// `/ready` and `/diagnostics` of ublkd. Holds the [`Observability`]
/// weakly: the telemetry plane owns the probes, and the observability owns
/// the telemetry plane.
struct UblkdProbes(Weak<Observability>);

impl Probes for UblkdProbes {
    fn check_ready(&self, failing: &mut NotReadySet) {
        match self.0.upgrade() {
            Some(obs) => obs.check_ready(failing),
            None => failing.insert(NotReadyReason::ShuttingDown),
        }
    }

    fn diagnostics(&self) -> serde_json::Value {
        self.0
            .upgrade()
            .map_or(serde_json::Value::Null, |o| o.diagnostics())
    }
}

impl Observability {
    /// Sets up the scanner, driver statistics, accounting, TCP links and
    /// (when enabled) the tracer on `tel` and registers the readiness and
    /// diagnostics probes.
    pub fn new(tel: Arc<Telemetry>, cfg: &MetricsConfig, tracing: &TracingConfig) -> Arc<Self> {
        let scan_interval = Duration::from_secs(cfg.scan_interval_secs);
        let stall_threshold = Duration::from_secs(cfg.stall_threshold_secs);
        let scanner = Scanner::new(
            Arc::clone(&tel),
            ScannerConfig {
                interval: scan_interval,
                stall_threshold,
            },
        );
        if cfg.openmetrics {
            tel.enable_openmetrics();
        }
        let obs = Arc::new(Self {
            driver: DriverStatsRegistry::new(&tel),
            acct: Arc::new(RequestAccounting::new(&tel)),
            tracer: tracing.enabled.then(|| {
                Tracer::new(TraceConfig {
                    sample_rate_ppm: tracing.sample_rate_ppm,
                    slow_threshold: slow_threshold(cfg),
                })
            }),
            tcp_links: TcpLinks::new(&tel),
            scanner,
            clock: Arc::new(MonotonicClock::new()),
            per_device_labels: cfg.per_device_labels,
            slow_threshold: Mutex::new(slow_threshold(cfg)),
            control_socket_up: AtomicBool::new(false),
            driver_node: Mutex::new(None),
            devices: Mutex::new(BTreeMap::new()),
            tel,
        });
        obs.tel
            .set_probes(Arc::new(UblkdProbes(Arc::downgrade(&obs))));
        obs
    }

    /// The telemetry plane.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.tel
    }

    /// The tracker scanner (start it with [`Scanner::spawn`]).
    pub fn scanner(&self) -> &Arc<Scanner> {
        &self.scanner
    }

    /// Where every arena connection's TCP_INFO goes.
    pub fn tcp_links(&self) -> &Arc<TcpLinks> {
        &self.tcp_links
    }

    /// The stall threshold in force.
    pub fn stall_threshold(&self) -> Duration {
        self.scanner.config().stall_threshold
    }

    /// Applies reloaded `[metrics]` settings: the scan interval and stall
    /// threshold from the next scan, the slow threshold to every device's
    /// requests (their `request.slow` logs and the tracer's retention)
    /// completing from now on. `listen` is the daemon's (it owns
    /// the listener); `per_device_labels` needs a restart (it names series).
    pub fn apply(&self, cfg: &MetricsConfig) {
        self.scanner.set_config(ScannerConfig {
            interval: Duration::from_secs(cfg.scan_interval_secs),
            stall_threshold: Duration::from_secs(cfg.stall_threshold_secs),
        });
        let slow = slow_threshold(cfg);
        *self.slow_threshold.lock() = slow;
        if let Some(t) = &self.tracer {
            t.set_slow_threshold(slow);
        }
        for d in self.all() {
            d.table.set_slow_threshold(slow);
        }
    }

    /// Makes readiness report `ublk_driver_missing` while `node` (the ublk
    /// control node) does not exist.
    pub fn watch_driver(&self, node: impl Into<std::path::PathBuf>) {
        *self.driver_node.lock() = Some(node.into());
    }

    /// Records whether the control socket is accepting.
    pub fn set_control_socket_up(&self, up: bool) {
        self.control_socket_up.store(up, Ordering::Release);
    }

    /// Registers (or replaces) device `shape.id`: its tracker table, I/O
    /// series and driver statistics. `negotiated` is the data path its
    /// queues negotiated (`None`: it has none, it failed), `driver` its data
    /// path's driver statistics.
    pub fn register(
        &self,
        shape: DeviceShape,
        state: DevState,
        stats: Arc<DeviceStats>,
        negotiated: Option<(Transport, Option<String>)>,
        driver: Arc<dyn DriverStats>,
    ) -> Result<Arc<DeviceObs>, ObsError> {
        let id = shape.id;
        let label = self.per_device_labels.then_some(id);
        let table = TrackerTable::new(
            TrackerConfig {
                target: TARGET.into(),
                device: label,
                queues: shape.queues,
                depth: shape.depth,
                slow_threshold: *self.slow_threshold.lock(),
            },
            Some(id),
            Arc::clone(&self.clock),
        )
        .map_err(|source| ObsError::Tracker { id, source })?;
        let io = IoMetrics::new(&self.tel, TARGET, label).map_err(|e| ObsError::Tracker {
            id,
            source: TrackerError::Label(e),
        })?;
        let table = Arc::new(table);
        self.scanner.register(&table);
        let dev = Arc::new(DeviceObs {
            shape,
            state: AtomicU8::new(state as u8),
            peer_connected: AtomicBool::new(negotiated.is_some()),
            stats,
            table,
            io,
            acct: Arc::clone(&self.acct),
            tracer: self.tracer.clone(),
            links: Mutex::new(if negotiated.is_some() {
                vec![true; usize::from(shape.queues)]
            } else {
                Vec::new()
            }),
            negotiated,
        });
        // A device set to RDMA that moved nothing over RDMA is what the
        // driver summary warns about; an `auto` device is held to the
        // transport it negotiated (a TCP-only peer is not a warning: its
        // payloads are counted by reason).
        let configured = match shape.transport {
            config::TransportChoice::Tcp => Transport::Tcp,
            config::TransportChoice::Rdma => Transport::Rdma,
            config::TransportChoice::Auto => match dev.negotiated() {
                Some((Transport::Rdma, _)) => Transport::Rdma,
                _ => Transport::Tcp,
            },
        };
        self.driver.add_device(id, configured, driver);
        self.devices.lock().insert(id, Arc::clone(&dev));
        Ok(dev)
    }

    /// Forgets a device: its table goes (the next scan zeroes its gauges)
    /// and its driver statistics are folded into the retired totals.
    pub fn unregister(&self, id: u32) {
        self.devices.lock().remove(&id);
        self.driver.remove_device(id);
        if self.per_device_labels {
            self.tel.forget_device(id);
        }
    }

    /// A registered device.
    pub fn device(&self, id: u32) -> Option<Arc<DeviceObs>> {
        self.devices.lock().get(&id).cloned()
    }

    fn all(&self) -> Vec<Arc<DeviceObs>> {
        self.devices.lock().values().cloned().collect()
    }

    /// Device `id`'s RDMA rails, as its driver reports them (none on TCP).
    pub fn rails(&self, id: u32) -> Vec<ublk_metrics::driver::RailValue> {
        self.driver_reports(Some(id))
            .into_iter()
            .find_map(|r| r.stats)
            .map(|s| s.rails)
            .unwrap_or_default()
    }

    /// Driver statistics of one device or all, for `ublkctl stats`.
    pub fn driver_reports(&self, id: Option<u32>) -> Vec<DeviceDriverReport> {
        self.driver
            .reports()
            .into_iter()
            .filter(|r| id.is_none_or(|want| want == r.device))
            .collect()
    }

    /// Readiness: the control socket accepts, and every configured device
    /// is live with its peer connected. Reads flags only: O(devices).
    pub fn check_ready(&self, failing: &mut NotReadySet) {
        if !self.control_socket_up.load(Ordering::Acquire) {
            failing.insert(NotReadyReason::ControlSocketDown);
        }
        // One stat(2): cheap, and the only way to see a driver that was
        // unloaded (or never loaded) while the daemon runs.
        if let Some(node) = &*self.driver_node.lock() {
            if !node.exists() {
                failing.insert(NotReadyReason::UblkDriverMissing);
            }
        }
        for d in self.devices.lock().values() {
            if d.state() != DevState::Live {
                failing.insert(NotReadyReason::DeviceNotRunning);
            } else if !d.peer_connected() {
                failing.insert(NotReadyReason::PeerDisconnected);
            }
        }
    }

    /// The `details` of `/diagnostics`: states, depths, connection states
    /// and ages. No peer address, volume, secret or payload.
    pub fn diagnostics(&self) -> serde_json::Value {
        let devices: Vec<serde_json::Value> = self
            .all()
            .iter()
            .map(|d| d.diagnostics(self.stall_threshold()))
            .collect();
        let scan = self.scanner.config();
        serde_json::json!({
            "control_socket": if self.control_socket_up.load(Ordering::Acquire) { "up" } else { "down" },
            "metrics": {
                "per_device_labels": self.per_device_labels,
                "scan_interval_seconds": scan.interval.as_secs(),
                "stall_threshold_seconds": scan.stall_threshold.as_secs(),
                "slow_threshold_ms": self.slow_threshold.lock().map_or(0, |d| d.as_millis() as u64),
                "tracing": self.tracer.is_some(),
            },
            "devices": devices,
        })
    }
}
