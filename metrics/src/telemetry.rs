//! The recorder, the exposition, and the telemetry plane's own health.

use crate::clock::unix_seconds;
use crate::families::{self, Daemon, Kind};
use crate::health::{NotReadyReason, NotReadySet, Probes};
use crate::histogram::LatencyHistogram;
use crate::labels::HttpRejection;
use crate::shard::{ShardedCounter, ShardedGauge};
use metrics::{Counter, Gauge, Label};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;
use thiserror::Error;

/// Upper bound of one rendered exposition; a scrape larger than this means
/// label cardinality escaped its bounds, and serving it would only move the
/// problem to Prometheus.
pub const MAX_RENDER_BYTES: usize = 16 << 20;

/// Version of the `/diagnostics` and `/ready` JSON documents.
pub const DIAGNOSTICS_SCHEMA_VERSION: u32 = 1;

/// Errors of setting up or rendering telemetry.
#[derive(Debug, Error)]
pub enum TelemetryError {
    /// Another recorder (ours or a library's) was installed first.
    #[error("installing the global metrics recorder failed: {0}")]
    Install(String),
}

/// Why a render produced no exposition.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RenderError {
    /// A registered collector panicked; its state is suspect.
    #[error("metrics collector #{index} panicked")]
    CollectorPanicked {
        /// Position of the collector in registration order.
        index: usize,
    },
    /// The exposition exceeded [`MAX_RENDER_BYTES`].
    #[error("rendered exposition is {len} bytes, above the {MAX_RENDER_BYTES}-byte bound")]
    TooLarge {
        /// Size of the rejected exposition.
        len: usize,
    },
}

/// The git revision the binaries were built from (`unknown` from a source
/// tree without git; see build.rs).
pub const REVISION: &str = env!("UBLK_GIT_REVISION");

/// Something that refreshes gauges or counters from another subsystem's
/// state just before each render (driver statistics, store statistics).
pub trait Collector: Send + Sync {
    /// Publishes current values. Runs on the scrape thread.
    fn collect(&self);
}

struct SelfMetrics {
    ready: Gauge,
    not_ready: Vec<Gauge>,
    http_up: Gauge,
    http_start_failures: Counter,
    http_rejections: [Counter; HttpRejection::COUNT],
    attempts: Counter,
    failures: Counter,
    last_success: Gauge,
    scanner_runs: Counter,
    scanner_last_run: Gauge,
}

/// Result of one readiness evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness {
    /// Failing checks; empty means ready.
    pub failing: NotReadySet,
}

impl Readiness {
    /// Whether every mandatory check passed.
    pub fn is_ready(&self) -> bool {
        self.failing.is_empty()
    }
}

/// The telemetry plane of one daemon: the Prometheus recorder and handle,
/// the native histograms, collectors, probes and self-observability.
///
/// Every metrics handle in this crate is registered through a `Telemetry`,
/// which makes "install the recorder first" a type-level fact.
pub struct Telemetry {
    daemon: Daemon,
    version: &'static str,
    handle: PrometheusHandle,
    // Set for isolated instances (tests, embedded use): registration goes to
    // this recorder instead of the process-global one.
    local: Option<PrometheusRecorder>,
    histograms: Native<LatencyHistogram>,
    /// Per-I/O counters, sharded per thread and rendered here (the
    /// exporter's counters are one shared atomic).
    counters: Native<ShardedCounter>,
    gauges: Native<ShardedGauge>,
    collectors: Mutex<Vec<Weak<dyn Collector>>>,
    probes: RwLock<Option<Arc<dyn Probes>>>,
    shutting_down: AtomicBool,
    openmetrics: AtomicBool,
    started: Instant,
    selfm: SelfMetrics,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("daemon", &self.daemon)
            .field("version", &self.version)
            .field("isolated", &self.local.is_some())
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Installs the Prometheus recorder as the process-global `metrics`
    /// recorder (via `PrometheusBuilder::install_recorder`) and returns the
    /// telemetry plane that renders it. Call once, before creating any
    /// metrics handle; `version` is the daemon's build version.
    pub fn install(
        daemon: Daemon,
        version: &'static str,
    ) -> Result<Arc<Telemetry>, TelemetryError> {
        let handle = PrometheusBuilder::new()
            .install_recorder()
            .map_err(|e| TelemetryError::Install(e.to_string()))?;
        Ok(Arc::new(Self::build(daemon, version, handle, None)))
    }

    /// A telemetry plane with its own recorder, not installed globally:
    /// handles registered through it render only in its exposition. For
    /// tests and for running several daemons in one process.
    pub fn isolated(daemon: Daemon, version: &'static str) -> Arc<Telemetry> {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        Arc::new(Self::build(daemon, version, handle, Some(recorder)))
    }

    fn build(
        daemon: Daemon,
        version: &'static str,
        handle: PrometheusHandle,
        local: Option<PrometheusRecorder>,
    ) -> Telemetry {
        let p = daemon.prefix();
        let register = || {
            for fam in families::IO
                .iter()
                .chain(families::ACCOUNTING)
                .chain(families::DRIVER)
                .chain(families::RAILS)
                .chain(families::TCP)
                .chain(families::COORDINATION)
                .chain(families::ARENA)
            {
                describe(fam.name.to_string(), fam.kind, fam.help);
            }
            for fam in families::SELF {
                describe(format!("{p}{}", fam.name), fam.kind, fam.help);
            }
            metrics::gauge!(format!("{p}_build_info"), "version" => version, "revision" => REVISION)
                .set(1.0);
            SelfMetrics {
                ready: metrics::gauge!(format!("{p}_ready")),
                not_ready: NotReadyReason::ALL
                    .iter()
                    .map(|r| metrics::gauge!(format!("{p}_not_ready"), "reason" => r.as_str()))
                    .collect(),
                http_up: metrics::gauge!(format!("{p}_metrics_http_server_up")),
                http_start_failures: metrics::counter!(format!(
                    "{p}_metrics_http_start_failures_total"
                )),
                http_rejections: HttpRejection::ALL.map(|r| {
                    metrics::counter!(format!("{p}_metrics_http_rejections_total"), "reason" => r.as_str())
                }),
                attempts: metrics::counter!(format!("{p}_metrics_serialization_attempts_total")),
                failures: metrics::counter!(format!("{p}_metrics_serialization_failures_total")),
                last_success: metrics::gauge!(format!(
                    "{p}_metrics_last_success_timestamp_seconds"
                )),
                scanner_runs: metrics::counter!(format!("{p}_scanner_runs_total")),
                scanner_last_run: metrics::gauge!(format!(
                    "{p}_scanner_last_run_timestamp_seconds"
                )),
            }
        };
        let selfm = match &local {
            Some(r) => metrics::with_local_recorder(r, register),
            None => register(),
        };
        // Touch the zero-valued counters so they render before first use.
        selfm.http_start_failures.increment(0);
        for c in &selfm.http_rejections {
            c.increment(0);
        }
        selfm.failures.increment(0);
        selfm.scanner_runs.increment(0);
        Telemetry {
            daemon,
            version,
            handle,
            local,
            histograms: Mutex::new(BTreeMap::new()),
            counters: Mutex::new(BTreeMap::new()),
            gauges: Mutex::new(BTreeMap::new()),
            collectors: Mutex::new(Vec::new()),
            probes: RwLock::new(None),
            shutting_down: AtomicBool::new(false),
            openmetrics: AtomicBool::new(false),
            started: Instant::now(),
            selfm,
        }
    }

    /// Which daemon this is.
    pub fn daemon(&self) -> Daemon {
        self.daemon
    }

    fn with_recorder<T>(&self, f: impl FnOnce() -> T) -> T {
        match &self.local {
            Some(r) => metrics::with_local_recorder(r, f),
            None => f(),
        }
    }

    pub(crate) fn counter(
        &self,
        name: impl Into<String>,
        labels: &[(&'static str, &str)],
    ) -> Counter {
        let labels = to_labels(labels);
        let name: String = name.into();
        self.with_recorder(|| metrics::counter!(name, labels))
    }

    pub(crate) fn gauge(&self, name: impl Into<String>, labels: &[(&'static str, &str)]) -> Gauge {
        let labels = to_labels(labels);
        let name: String = name.into();
        self.with_recorder(|| metrics::gauge!(name, labels))
    }

    pub(crate) fn describe(&self, name: String, kind: Kind, help: &'static str) {
        self.with_recorder(|| describe(name, kind, help));
    }

    /// Registers (or finds) the native histogram of a series. Registering the
    /// same family and labels twice returns the same histogram, so memory is
    /// bounded by label cardinality, not by how often targets are created.
    pub(crate) fn histogram(
        &self,
        family: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Arc<LatencyHistogram> {
        register(&self.histograms, family, labels)
    }

    /// Registers (or finds) the sharded counter of a series; like
    /// [`Self::histogram`], once per family and labels.
    pub(crate) fn sharded_counter(
        &self,
        family: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Arc<ShardedCounter> {
        register(&self.counters, family, labels)
    }

    /// Registers (or finds) the sharded gauge of a series.
    pub(crate) fn sharded_gauge(
        &self,
        family: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Arc<ShardedGauge> {
        register(&self.gauges, family, labels)
    }

    /// Drops the per-device I/O series of device `id` (requests, bytes,
    /// errors, latency): a device later created with the same id is
    /// another disk, often of another volume, and its series start from
    /// zero instead of inheriting the old one's counts. Handles the old
    /// device still holds keep counting, unrendered.
    pub fn forget_device(&self, id: u32) {
        let needle = format!("device=\"{}\"", crate::labels::device_label(id));
        let mine = |labels: &String| labels.split(',').any(|l| l == needle);
        for series in self.counters.lock().values_mut() {
            series.retain(|labels, _| !mine(labels));
        }
        for series in self.histograms.lock().values_mut() {
            series.retain(|labels, _| !mine(labels));
        }
    }

    /// Registers a collector that runs before each render. Only a weak
    /// reference is kept: dropping the collector unregisters it.
    pub fn register_collector<C: Collector + 'static>(&self, collector: &Arc<C>) {
        let weak: Weak<C> = Arc::downgrade(collector);
        let mut list = self.collectors.lock();
        list.retain(|w| w.strong_count() > 0);
        list.push(weak);
    }

    /// Sets the daemon's readiness and diagnostics provider. Until it is set,
    /// `/ready` answers 503 `starting`.
    pub fn set_probes(&self, probes: Arc<dyn Probes>) {
        *self.probes.write() = Some(probes);
    }

    /// Marks the daemon as shutting down: `/ready` answers 503
    /// `shutting_down` from now on, so load balancers and orchestration stop
    /// sending work before the listener closes.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
    }

    /// Evaluates readiness (O(devices) through [`Probes::check_ready`]) and
    /// publishes it as `<prefix>_ready` and `<prefix>_not_ready{reason}`.
    pub fn readiness(&self) -> Readiness {
        let mut failing = NotReadySet::default();
        if self.shutting_down.load(Ordering::Acquire) {
            failing.insert(NotReadyReason::ShuttingDown);
        }
        match self.probes.read().as_ref() {
            Some(p) => p.check_ready(&mut failing),
            None => failing.insert(NotReadyReason::Starting),
        }
        self.selfm
            .ready
            .set(if failing.is_empty() { 1.0 } else { 0.0 });
        for (r, g) in NotReadyReason::ALL.iter().zip(&self.selfm.not_ready) {
            g.set(if failing.contains(*r) { 1.0 } else { 0.0 });
        }
        Readiness { failing }
    }

    /// The `/diagnostics` document: schema version, build, uptime,
    /// readiness, and the daemon's [`Probes::diagnostics`] under `details`.
    pub fn diagnostics(&self) -> serde_json::Value {
        let ready = self.readiness();
        let details = self
            .probes
            .read()
            .as_ref()
            .map(|p| p.diagnostics())
            .unwrap_or(serde_json::Value::Null);
        serde_json::json!({
            "schema_version": DIAGNOSTICS_SCHEMA_VERSION,
            "daemon": self.daemon.prefix(),
            "version": self.version,
            "uptime_seconds": self.started.elapsed().as_secs(),
            "ready": ready.is_ready(),
            "not_ready": ready.failing.iter().map(|r| r.as_str()).collect::<Vec<_>>(),
            "details": details,
        })
    }

    /// Serves the OpenMetrics exposition on `/metrics/openmetrics` from now
    /// on (opt-in: until then that path answers 404).
    pub fn enable_openmetrics(&self) {
        self.openmetrics.store(true, Ordering::Release);
    }

    /// Whether `/metrics/openmetrics` is served.
    pub fn openmetrics_enabled(&self) -> bool {
        self.openmetrics.load(Ordering::Acquire)
    }

    /// Renders the Prometheus text exposition (format 0.0.4): runs
    /// collectors, renders the exporter's counters and gauges, then the
    /// native histograms.
    pub fn render(&self) -> Result<String, RenderError> {
        self.render_as(false)
    }

    /// Renders the same samples as [`Self::render`] in OpenMetrics 1.0
    /// text, with the latest retained trace of each histogram bucket as its
    /// exemplar, ending with `# EOF`.
    pub fn render_openmetrics(&self) -> Result<String, RenderError> {
        self.render_as(true)
    }

    fn render_as(&self, openmetrics: bool) -> Result<String, RenderError> {
        self.selfm.attempts.increment(1);
        self.readiness();
        let collectors: Vec<Arc<dyn Collector>> = {
            let mut list = self.collectors.lock();
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for (index, c) in collectors.iter().enumerate() {
            if catch_unwind(AssertUnwindSafe(|| c.collect())).is_err() {
                self.selfm.failures.increment(1);
                return Err(RenderError::CollectorPanicked { index });
            }
        }
        let mut out = self.handle.render();
        render_sharded(
            &self.counters.lock(),
            "counter",
            |c| c.value().to_string(),
            &mut out,
        );
        render_sharded(
            &self.gauges.lock(),
            "gauge",
            |g| g.value().to_string(),
            &mut out,
        );
        self.render_histograms(openmetrics, &mut out);
        crate::process::render(&mut out);
        if openmetrics {
            out = crate::openmetrics::from_text(&out);
        }
        if out.len() > MAX_RENDER_BYTES {
            self.selfm.failures.increment(1);
            return Err(RenderError::TooLarge { len: out.len() });
        }
        self.selfm.last_success.set(unix_seconds());
        Ok(out)
    }

    fn render_histograms(&self, exemplars: bool, out: &mut String) {
        let map = self.histograms.lock();
        for (family, series) in map.iter() {
            let _ = writeln!(out, "# HELP {family} {}", families::help(family));
            let _ = writeln!(out, "# TYPE {family} histogram");
            for (labels, h) in series {
                h.render(family, labels, exemplars, out);
            }
            out.push('\n');
        }
    }

    pub(crate) fn http_server_up(&self, up: bool) {
        self.selfm.http_up.set(if up { 1.0 } else { 0.0 });
    }

    pub(crate) fn http_start_failed(&self) {
        self.selfm.http_start_failures.increment(1);
    }

    pub(crate) fn http_rejected(&self, why: HttpRejection) {
        self.selfm.http_rejections[why.index()].increment(1);
    }

    pub(crate) fn scanner_ran(&self) {
        self.selfm.scanner_runs.increment(1);
        self.selfm.scanner_last_run.set(unix_seconds());
    }
}

fn describe(name: String, kind: Kind, help: &'static str) {
    match kind {
        Kind::Counter => metrics::describe_counter!(name, help),
        Kind::Gauge => metrics::describe_gauge!(name, help),
        // Native histograms render their own HELP.
        Kind::Histogram => {}
    }
}

fn to_labels(labels: &[(&'static str, &str)]) -> Vec<Label> {
    labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect()
}

/// Series this crate renders itself: family -> rendered labels -> value.
type Native<V> = Mutex<BTreeMap<&'static str, BTreeMap<String, Arc<V>>>>;

/// The value of a native series, created on first registration.
fn register<V: Default>(
    map: &Native<V>,
    family: &'static str,
    labels: &[(&'static str, &str)],
) -> Arc<V> {
    map.lock()
        .entry(family)
        .or_default()
        .entry(render_labels(labels))
        .or_default()
        .clone()
}

/// Renders the families of sharded values of one type.
fn render_sharded<V>(
    map: &BTreeMap<&'static str, BTreeMap<String, Arc<V>>>,
    kind: &str,
    value: impl Fn(&V) -> String,
    out: &mut String,
) {
    for (family, series) in map {
        let _ = writeln!(out, "# HELP {family} {}", families::help(family));
        let _ = writeln!(out, "# TYPE {family} {kind}");
        for (labels, v) in series {
            let _ = if labels.is_empty() {
                writeln!(out, "{family} {}", value(v))
            } else {
                writeln!(out, "{family}{{{labels}}} {}", value(v))
            };
        }
        out.push('\n');
    }
}

/// `k="v",...` with values escaped, as a series key and for rendering.
fn render_labels(labels: &[(&'static str, &str)]) -> String {
    let mut rendered = String::new();
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            rendered.push(',');
        }
        let _ = write!(rendered, "{k}=\"{}\"", escape(v));
    }
    rendered
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
