//! What a device's control connections did, shared by every queue
//! connection of the device (`ClientConfig::stats`), so the device reports
//! one set of counters whatever its queue count: payloads carried inline,
//! and the connection's own life (reconnects, timeouts, retries, late
//! answers, peer restarts, revocations, answers that did not parse or did
//! not fit their request). A TCP device reports all of it as its driver
//! statistics; an RDMA device reports the connection counters beside its
//! transport's own.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use ublk_metrics::driver::names;
use ublk_metrics::driver::CounterValue;
use ublk_metrics::{DriverSnapshot, DriverStats, IoOp};

/// Why a payload travelled on the TCP stream; a closed set (metric label).
/// The TCP transport has one: the device is configured for it. The RDMA
/// transport adds its fallback reasons.
pub const REASON_CONFIGURED_TCP: &str = "configured_tcp";

/// The counters; see the module docs.
#[derive(Debug, Default)]
pub struct ClientStats {
    read_requests: AtomicU64,
    read_bytes: AtomicU64,
    write_requests: AtomicU64,
    write_bytes: AtomicU64,
    pub(super) reconnects: AtomicU64,
    pub(super) request_timeouts: AtomicU64,
    pub(super) request_retries: AtomicU64,
    pub(super) late_answers: AtomicU64,
    pub(super) peer_restarts: AtomicU64,
    pub(super) revocations_received: AtomicU64,
    pub(super) revocations_dropped: AtomicU64,
    pub(super) response_id_mismatches: AtomicU64,
    pub(super) length_mismatches: AtomicU64,
    /// Frames that did not parse, by `FrameError::class` (a closed set);
    /// rare, so a map behind a lock.
    frame_errors: Mutex<BTreeMap<&'static str, u64>>,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl ClientStats {
    /// Counts one inline READ answered with `bytes` of payload (0 when the
    /// blob did not exist and nothing moved).
    pub(super) fn read(&self, bytes: usize) {
        bump(&self.read_requests);
        self.read_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts one inline WRITE of `bytes`.
    pub(super) fn write(&self, bytes: usize) {
        bump(&self.write_requests);
        self.write_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts one event.
    pub(super) fn count(&self, c: impl Fn(&Self) -> &AtomicU64) {
        bump(c(self));
    }

    /// Counts one frame that did not parse, by its error class.
    pub(super) fn frame_error(&self, class: &'static str) {
        *self.frame_errors.lock().entry(class).or_insert(0) += 1;
    }

    /// The connection counters under their exported names.
    pub fn connection_counters(&self) -> Vec<CounterValue> {
        let mut counters: Vec<CounterValue> = [
            (names::RECONNECTS, &self.reconnects),
            (names::REQUEST_TIMEOUTS, &self.request_timeouts),
            (names::REQUEST_RETRIES, &self.request_retries),
            (names::LATE_ANSWERS, &self.late_answers),
            (names::PEER_RESTARTS, &self.peer_restarts),
            (names::REVOCATIONS_RECEIVED, &self.revocations_received),
            (names::REVOCATIONS_DROPPED, &self.revocations_dropped),
            (names::RESPONSE_ID_MISMATCHES, &self.response_id_mismatches),
            (names::LENGTH_MISMATCHES, &self.length_mismatches),
        ]
        .into_iter()
        .map(|(name, v)| CounterValue {
            name: Cow::Borrowed(name),
            op: None,
            reason: None,
            value: v.load(Ordering::Relaxed),
        })
        .collect();
        counters.extend(
            self.frame_errors
                .lock()
                .iter()
                .map(|(class, n)| CounterValue {
                    name: Cow::Borrowed(names::FRAME_ERRORS),
                    op: None,
                    reason: Some(Cow::Borrowed(*class)),
                    value: *n,
                }),
        );
        counters
    }
}

fn payload(name: &'static str, op: IoOp, value: &AtomicU64) -> CounterValue {
    CounterValue {
        name: Cow::Borrowed(name),
        op: Some(op),
        reason: Some(Cow::Borrowed(REASON_CONFIGURED_TCP)),
        value: value.load(Ordering::Relaxed),
    }
}

impl DriverStats for ClientStats {
    fn snapshot(&self) -> DriverSnapshot {
        let mut counters = vec![
            payload(names::TCP_PAYLOAD_REQUESTS, IoOp::Read, &self.read_requests),
            payload(names::TCP_PAYLOAD_BYTES, IoOp::Read, &self.read_bytes),
            payload(
                names::TCP_PAYLOAD_REQUESTS,
                IoOp::Write,
                &self.write_requests,
            ),
            payload(names::TCP_PAYLOAD_BYTES, IoOp::Write, &self.write_bytes),
        ];
        counters.extend(self.connection_counters());
        DriverSnapshot {
            driver: Cow::Borrowed("tcp"),
            counters,
            gauges: Vec::new(),
            rails: Vec::new(),
        }
    }
}
