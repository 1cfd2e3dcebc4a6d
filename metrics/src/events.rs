//! Stable structured log events.
//!
//! Event names are part of the operator contract (the runbook searches for
//! them), so they are constants emitted in the `event` field, and each event
//! has one helper that fixes its fields. Correlation ids link events of one
//! request; no helper takes payloads, keys, addresses or secrets.

use crate::correlation::CorrelationId;
use crate::labels::{ErrnoClass, IoOp, Phase, Reason, Transport};
use std::time::Duration;
use thiserror::Error;

/// A logical block request failed (completed to the kernel with an error).
pub const REQUEST_FAILED: &str = "request.failed";
/// A request completed after more than the slow threshold.
pub const REQUEST_SLOW: &str = "request.slow";
/// A request crossed the stall threshold while still pending (logged once).
pub const REQUEST_STUCK: &str = "request.stuck";
/// One physical attempt failed (the request may still succeed).
pub const ATTEMPT_FAILED: &str = "attempt.failed";
/// A request moved from one transport to another.
pub const TRANSPORT_FAILOVER: &str = "transport.failover";
/// The arena peer connection was lost.
pub const PEER_DISCONNECTED: &str = "peer.disconnected";
/// A retained request's root span ([`crate::trace`]).
pub const SPAN_REQUEST: &str = "span.request";
/// One attempt of a retained request: a child span.
pub const SPAN_ATTEMPT: &str = "span.attempt";
/// The arena client got a frame it could not parse (bad magic, version,
/// reserved bits, opcode, status, length); the connection is closed.
pub const PROTOCOL_FRAME_ERROR: &str = "protocol.frame_error";
/// An answer named a request that is not in flight (never sent, already
/// answered) or answered it with another opcode; the connection is closed.
pub const PROTOCOL_RESPONSE_ID_MISMATCH: &str = "protocol.response_id_mismatch";
/// An answer carried another length than its request asked for; the
/// request fails.
pub const PROTOCOL_LENGTH_MISMATCH: &str = "protocol.length_mismatch";

/// Every stable event name.
pub const ALL: &[&str] = &[
    REQUEST_FAILED,
    REQUEST_SLOW,
    REQUEST_STUCK,
    ATTEMPT_FAILED,
    TRANSPORT_FAILOVER,
    PEER_DISCONNECTED,
    SPAN_REQUEST,
    SPAN_ATTEMPT,
    PROTOCOL_FRAME_ERROR,
    PROTOCOL_RESPONSE_ID_MISMATCH,
    PROTOCOL_LENGTH_MISMATCH,
];

fn dev(device: Option<u32>) -> i64 {
    device.map_or(-1, i64::from)
}

/// Logs [`REQUEST_FAILED`].
pub fn request_failed(
    corr: CorrelationId,
    device: Option<u32>,
    op: IoOp,
    errno: ErrnoClass,
    phase: Phase,
    reason: Reason,
) {
    tracing::warn!(
        event = REQUEST_FAILED,
        corr = corr.get(),
        device = dev(device),
        op = op.as_str(),
        errno = errno.as_str(),
        phase = phase.as_str(),
        reason = reason.as_str(),
        "block request failed"
    );
}

/// Logs [`REQUEST_SLOW`].
pub fn request_slow(
    corr: CorrelationId,
    target: &str,
    device: Option<u32>,
    op: IoOp,
    latency: Duration,
) {
    tracing::warn!(
        event = REQUEST_SLOW,
        corr = corr.get(),
        target,
        device = dev(device),
        op = op.as_str(),
        latency_ms = latency.as_millis() as u64,
        "block request completed slowly"
    );
}

/// Logs [`REQUEST_STUCK`].
pub fn request_stuck(
    corr: CorrelationId,
    target: &str,
    device: Option<u32>,
    op: IoOp,
    age: Duration,
) {
    tracing::warn!(
        event = REQUEST_STUCK,
        corr = corr.get(),
        target,
        device = dev(device),
        op = op.as_str(),
        age_ms = age.as_millis() as u64,
        "block request pending past the stall threshold"
    );
}

/// Logs [`ATTEMPT_FAILED`].
pub fn attempt_failed(
    corr: CorrelationId,
    op: IoOp,
    transport: Transport,
    phase: Phase,
    reason: Reason,
) {
    tracing::info!(
        event = ATTEMPT_FAILED,
        corr = corr.get(),
        op = op.as_str(),
        transport = transport.as_str(),
        phase = phase.as_str(),
        reason = reason.as_str(),
        "transport attempt failed"
    );
}

/// Logs [`TRANSPORT_FAILOVER`].
pub fn transport_failover(corr: CorrelationId, op: IoOp, from: Transport, to: Transport) {
    tracing::info!(
        event = TRANSPORT_FAILOVER,
        corr = corr.get(),
        op = op.as_str(),
        from = from.as_str(),
        to = to.as_str(),
        "request moved to another transport"
    );
}

/// Logs [`PEER_DISCONNECTED`]. `device` identifies the device, never the
/// peer's address.
pub fn peer_disconnected(device: Option<u32>, phase: Phase, reason: Reason) {
    tracing::warn!(
        event = PEER_DISCONNECTED,
        device = dev(device),
        phase = phase.as_str(),
        reason = reason.as_str(),
        "arena peer disconnected"
    );
}

/// Logs [`PROTOCOL_FRAME_ERROR`]: `class` is the frame error's bounded
/// class, `detail` its message (which names fields and values, never
/// payload bytes).
pub fn protocol_frame_error(class: &'static str, detail: &dyn std::fmt::Display) {
    tracing::warn!(
        event = PROTOCOL_FRAME_ERROR,
        class,
        detail = %detail,
        "arena answer frame rejected"
    );
}

/// Logs [`PROTOCOL_RESPONSE_ID_MISMATCH`]: the answer's request id and
/// opcode, and the opcode of the request in flight under that id (`none`).
pub fn protocol_response_id_mismatch(request_id: u64, op: &'static str, expected: &'static str) {
    tracing::warn!(
        event = PROTOCOL_RESPONSE_ID_MISMATCH,
        request_id,
        op,
        expected,
        "arena answer does not match a request in flight"
    );
}

/// Logs [`PROTOCOL_LENGTH_MISMATCH`]: `requested` bytes asked, `answered`
/// bytes the answer carries.
pub fn protocol_length_mismatch(request_id: u64, op: &'static str, requested: u64, answered: u64) {
    tracing::warn!(
        event = PROTOCOL_LENGTH_MISMATCH,
        request_id,
        op,
        requested,
        answered,
        "arena answer length differs from the request's"
    );
}

/// Log output format (`log_format` in both daemons' configs, and their
/// `--log-format` flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

impl LogFormat {
    /// The config spelling (`text`, `json`).
    pub const fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }

    /// Parses the config spelling (for command-line flags).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("unknown log format {s:?}: use text or json")),
        }
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Logging could not be set up.
#[derive(Debug, Error)]
pub enum LogInitError {
    /// The filter directive did not parse.
    #[error("invalid log filter {filter:?}: {message}")]
    Filter {
        /// The rejected directive.
        filter: String,
        /// The parser's message.
        message: String,
    },
    /// A global subscriber was already set.
    #[error("a global tracing subscriber is already installed")]
    AlreadySet,
    /// The filter could not be swapped (the subscriber is gone).
    #[error("the log filter cannot be changed: {0}")]
    Reload(String),
}

fn env_filter(filter: &str) -> Result<tracing_subscriber::EnvFilter, LogInitError> {
    tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| LogInitError::Filter {
        filter: filter.to_string(),
        message: e.to_string(),
    })
}

/// Checks a filter directive (`log_level` keys) without installing it.
pub fn check_filter(filter: &str) -> Result<(), String> {
    env_filter(filter).map(drop).map_err(|e| match e {
        LogInitError::Filter { message, .. } => message,
        other => other.to_string(),
    })
}

/// The filter in force: `RUST_LOG` when it is set (it overrides the
/// config's `log_level`, at start and at every reload), else `configured`.
pub fn effective_filter(configured: &str) -> (String, FilterSource) {
    match std::env::var("RUST_LOG") {
        Ok(f) => (f, FilterSource::Environment),
        Err(_) => (configured.to_owned(), FilterSource::Config),
    }
}

/// Where the filter in force came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterSource {
    /// `RUST_LOG`.
    Environment,
    /// The config's `log_level`.
    Config,
}

/// Colour only for a person: when stderr (where the lines go) is a
/// terminal and `NO_COLOR` is unset. A journal, a pipe or a file gets no
/// escape codes.
fn use_ansi() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

type Reloader = Box<dyn Fn(tracing_subscriber::EnvFilter) -> Result<(), String> + Send + Sync>;

/// The installed subscriber's filter, changeable while the daemon runs
/// (SIGHUP reloads `log_level`).
pub struct LogControl {
    reload: Reloader,
    filter: parking_lot::Mutex<String>,
}

impl std::fmt::Debug for LogControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogControl")
            .field("filter", &*self.filter.lock())
            .finish_non_exhaustive()
    }
}

impl LogControl {
    /// The directive in force.
    pub fn filter(&self) -> String {
        self.filter.lock().clone()
    }

    /// Replaces the directive; `Ok(false)` when it is already in force.
    pub fn set_filter(&self, filter: &str) -> Result<bool, LogInitError> {
        let mut current = self.filter.lock();
        if *current == filter {
            return Ok(false);
        }
        (self.reload)(env_filter(filter)?).map_err(LogInitError::Reload)?;
        *current = filter.to_owned();
        Ok(true)
    }

    /// A reload's `log_level`: put in force unless `RUST_LOG` overrides it
    /// (said in a warning). The level was validated when the configuration
    /// was read, so a failure here is the subscriber's, logged.
    pub fn apply_log_level(&self, log_level: &str) {
        match effective_filter(log_level) {
            (_, FilterSource::Environment) => tracing::warn!(
                event = "config.log_level_ignored",
                log_level = %log_level,
                "RUST_LOG is set and overrides log_level"
            ),
            (filter, FilterSource::Config) => {
                if let Err(e) = self.set_filter(&filter) {
                    tracing::error!(event = "config.log_level_failed", error = %e);
                }
            }
        }
    }
}

/// Installs the process's `tracing` subscriber writing to stderr, with an
/// `EnvFilter` directive such as `info` or `ublkd=debug`. Both daemons log
/// through this, so their JSON lines have one shape ([`json_subscriber`]).
pub fn init_logging(format: LogFormat, filter: &str) -> Result<LogControl, LogInitError> {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter(filter)?)
        .with_writer(std::io::stderr);
    // The reload layer wraps the finished formatter, so it comes last.
    let reload: Reloader = match format {
        LogFormat::Text => {
            let b = builder.with_ansi(use_ansi()).with_filter_reloading();
            let h = b.reload_handle();
            b.try_init().map_err(|_| LogInitError::AlreadySet)?;
            Box::new(move |f| h.reload(f).map_err(|e| e.to_string()))
        }
        LogFormat::Json => {
            let b = builder
                .with_ansi(false)
                .json()
                .flatten_event(true)
                .with_target(false)
                .with_filter_reloading();
            let h = b.reload_handle();
            b.try_init().map_err(|_| LogInitError::AlreadySet)?;
            Box::new(move |f| h.reload(f).map_err(|e| e.to_string()))
        }
    };
    Ok(LogControl {
        reload,
        filter: parking_lot::Mutex::new(filter.to_owned()),
    })
}

/// The JSON log shape: one object per line, the event's fields at the top
/// level, and no `target` key for the module path, which would be a second
/// `target` key in the events that name the I/O target (`request.slow`,
/// `span.request`), and JSON readers keep only one of two.
pub fn json_subscriber<W>(
    filter: impl Into<tracing_subscriber::EnvFilter>,
    writer: W,
) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .json()
        .flatten_event(true)
        .with_target(false)
        .finish()
}
