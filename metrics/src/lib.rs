//! The observability contract shared by `ublkd` and `arenad`.
//!
//! Wiring, in order:
//!
//! 1. [`Telemetry::install`] once at start-up (installs the Prometheus
//!    recorder); every handle below is registered through it.
//! 2. Per target: [`IoMetrics::new`] and a [`TrackerTable`], registered with
//!    the process's single [`Scanner`] (started with [`Scanner::spawn`]).
//! 3. Per I/O: [`TrackerTable::start`] then [`TrackerGuard::complete`].
//! 4. [`DriverStatsRegistry`], [`RequestAccounting`] (ublkd) or
//!    [`ArenaMetrics`] (arenad).
//! 5. [`Telemetry::set_probes`] and [`MetricsServer::start`].
//! 6. Optionally a [`Tracer`] (sampled spans, exemplars on
//!    `/metrics/openmetrics` after [`Telemetry::enable_openmetrics`]) and
//!    [`TcpLinks`] (TCP_INFO of the arena connections).
//!
//! Families are listed in [`families`] and documented in `docs/METRICS.md`.

pub mod accounting;
pub mod arenad;
pub mod arenad_volumes;
pub mod clock;
pub mod coordination;
pub mod correlation;
pub mod device_io;
pub mod driver;
pub mod events;
pub mod families;
pub mod health;
pub mod histogram;
pub mod http;
pub mod json_line;
pub mod labels;
pub mod openmetrics;
mod process;
pub mod replicas;
pub mod scanner;
pub mod shard;
pub mod tcp_links;
pub mod telemetry;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod trace;
pub mod tracker;

pub use accounting::{AttemptSpan, RequestAccounting, RequestSpan};
pub use arenad::{
    ArenaMetrics, ArenaOp, ArenaOutcome, ArenaStats, ConnectionRefusal, IntegrityCheck, Promotion,
    ProtocolErrorClass, SlotState, Tier,
};
pub use arenad_volumes::{VolumeCounters, VolumeLabels, VolumeMetrics, VolumeSample};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use coordination::{CoordinationMetrics, CoordinationStats, EpochReason};
pub use correlation::CorrelationId;
pub use device_io::IoMetrics;
pub use driver::{summarize, DeviceDriverReport, DriverSnapshot, DriverStats, DriverStatsRegistry};
pub use families::Daemon;
pub use health::{NotReadyReason, NotReadySet, Probes};
pub use histogram::{Exemplar, LatencyHistogram, LATENCY_BUCKETS_SECONDS};
pub use http::{HttpConfig, HttpError, MetricsServer};
pub use labels::{
    device_label, ErrnoClass, FailureCause, IoOp, LabelError, Outcome, Phase, Reason, Transport,
};
pub use replicas::{HandoverDirection, HedgeOutcome, RebuildOutcome, ReplicaMetrics, ReplicaStats};
pub use scanner::{ScanSummary, Scanner, ScannerConfig, ScannerThread};
pub use shard::{ShardedCounter, ShardedGauge};
pub use tcp_links::{TcpInfoSample, TcpLink, TcpLinks};
pub use telemetry::{Collector, Readiness, RenderError, Telemetry, TelemetryError, REVISION};
pub use trace::{AttemptRecord, RequestRecord, Retention, SpanEnd, TraceConfig, TraceId, Tracer};
pub use tracker::{TableSnapshot, TrackerConfig, TrackerError, TrackerGuard, TrackerTable};
