//! Readiness and diagnostics contract between a daemon and the endpoints.
//!
//! The daemon owns the knowledge of what "ready" means; this crate owns the
//! vocabulary, so `/ready` answers, the `*_not_ready{reason}` gauge and the
//! runbook all use the same closed set of reasons.

use crate::labels::{closed_enum, count_variants};
use serde::{Deserialize, Serialize};

closed_enum! {
    /// Why a daemon is not ready. Closed set, documented in `docs/METRICS.md`.
    NotReadyReason {
        /// No probes registered yet: the daemon is still starting.
        Starting => "starting",
        /// ublkd: the control socket is not listening.
        ControlSocketDown => "control_socket_down",
        /// ublkd: a configured device is not in the running state.
        DeviceNotRunning => "device_not_running",
        /// ublkd: a configured device's arena peer is not connected.
        PeerDisconnected => "peer_disconnected",
        /// ublkd: the ublk driver is not loaded (`/dev/ublk-control` is
        /// missing), so no device can be added or recovered.
        UblkDriverMissing => "ublk_driver_missing",
        /// arenad: the swap file is not open.
        SwapNotOpen => "swap_not_open",
        /// arenad: the blob index is not open.
        IndexNotOpen => "index_not_open",
        /// The daemon is shutting down.
        ShuttingDown => "shutting_down",
    }
}

/// A set of [`NotReadyReason`]s; a bitset so that readiness checks never
/// allocate and a reason reported by many devices appears once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotReadySet(u32);

impl NotReadySet {
    /// Adds a reason.
    pub fn insert(&mut self, reason: NotReadyReason) {
        self.0 |= 1 << reason.index();
    }

    /// Whether a reason is present.
    pub fn contains(&self, reason: NotReadyReason) -> bool {
        self.0 & (1 << reason.index()) != 0
    }

    /// True when every mandatory check passed.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// The reasons, in declaration order.
    pub fn iter(&self) -> impl Iterator<Item = NotReadyReason> + '_ {
        NotReadyReason::ALL
            .iter()
            .copied()
            .filter(|r| self.contains(*r))
    }
}

/// Implemented by a daemon to answer `/ready` and `/diagnostics`.
pub trait Probes: Send + Sync {
    /// Inserts a reason for each failing mandatory check.
    ///
    /// Called on every `/ready` probe and every scrape, so it must cost
    /// O(devices) (read per-device state flags), never O(in-flight requests)
    /// and never block on I/O.
    fn check_ready(&self, failing: &mut NotReadySet);

    /// The daemon-specific part of `/diagnostics` (devices and states, queue
    /// depths, connection states, oldest in-flight age, ...).
    ///
    /// It is served to anyone who can reach the metrics listener, so it must
    /// contain no secrets, keys, tokens, peer or memory addresses, volume
    /// names from user input, or payload bytes: report states and counts.
    fn diagnostics(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}
