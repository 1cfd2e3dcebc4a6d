//! arenad's wiring of the observability contract (`ublk-metrics`): the
//! arenad families fed by the server (operations by op and outcome with
//! latency, FLUSH latency, protocol errors by class, authentication
//! failures) and sampled from [`Store::stats`] at each scrape, readiness
//! (store open and not shutting down) and a redacted `/diagnostics`.
//!
//! The server is given this at construction and only calls the hooks
//! below, passing the status it answered with; nothing here reaches back
//! into the server.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ublk_metrics::{
    ArenaMetrics, ArenaOp, ArenaOutcome, ArenaStats, ConnectionRefusal, Daemon, HttpConfig,
    HttpError, IntegrityCheck, MetricsServer, NotReadyReason, NotReadySet, Probes, Promotion,
    ProtocolErrorClass, SlotState, Telemetry, TelemetryError, VolumeCounters, VolumeLabels,
    VolumeMetrics, VolumeSample,
};

use crate::proto::{Opcode, Status};
use crate::store::{IndexWrite, IntegrityKind, Store, StoreStats};

/// The store, once open: the metrics listener starts before it, so that
/// `/ready` can say why arenad is not ready yet.
struct Opened {
    store: Arc<Store>,
}

#[derive(Default)]
struct Shared {
    opened: OnceLock<Opened>,
    /// Volumes served (SIGHUP may change it).
    volumes: AtomicUsize,
    /// The control port accepts sessions: until then `/ready` says
    /// `starting`, even with the store open (registering a large arena
    /// with an RDMA device takes seconds).
    serving: AtomicBool,
    /// Sessions with a completed handshake, now.
    connections: AtomicUsize,
}

/// The observability of one arenad process.
pub struct ArenadObservability {
    tel: Arc<Telemetry>,
    metrics: Arc<ArenaMetrics>,
    volumes: Arc<VolumeMetrics>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ArenadObservability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenadObservability")
            .finish_non_exhaustive()
    }
}

struct ArenadProbes(Arc<Shared>);

impl Probes for ArenadProbes {
    fn check_ready(&self, failing: &mut NotReadySet) {
        // The store opens its swap file and replays its index together:
        // until `Store::open` returned, neither is usable.
        if self.0.opened.get().is_none() {
            failing.insert(NotReadyReason::SwapNotOpen);
            failing.insert(NotReadyReason::IndexNotOpen);
        } else if !self.0.serving.load(Ordering::Acquire) {
            failing.insert(NotReadyReason::Starting);
        }
    }

    fn diagnostics(&self) -> serde_json::Value {
        let Some(Opened { store }) = self.0.opened.get() else {
            return serde_json::json!({ "store": "opening" });
        };
        let volumes = self.0.volumes.load(Ordering::Relaxed);
        let s = store.stats();
        serde_json::json!({
            "store": "open",
            "generation": store.generation(),
            "blob_bytes": store.blob_bytes(),
            "volumes": volumes,
            "connections": self.0.connections.load(Ordering::Relaxed),
            "slots": {
                "total": s.slots_total,
                "free": s.slots_free,
                "clean": s.slots_clean,
                "dirty": s.slots_dirty,
                "leased": s.slots_leased,
            },
            "leases_held": s.leases_held,
            "swap_extents": { "used": s.swap_extents_used, "total": s.swap_extents_total },
            "direct_io": s.direct_io,
        })
    }
}

/// The sampled part of the arenad families, from the store's statistics.
pub fn arena_stats(s: &StoreStats, blob_bytes: u32) -> ArenaStats {
    let mut slots = [0; SlotState::COUNT];
    slots[SlotState::Free.index()] = s.slots_free;
    slots[SlotState::Clean.index()] = s.slots_clean;
    slots[SlotState::Dirty.index()] = s.slots_dirty;
    slots[SlotState::Leased.index()] = s.slots_leased;
    let mut integrity_errors = [0; IntegrityCheck::COUNT];
    for kind in IntegrityKind::ALL {
        let check = match kind {
            IntegrityKind::Checksum => IntegrityCheck::Checksum,
            IntegrityKind::Header => IntegrityCheck::Header,
        };
        integrity_errors[check.index()] = s.integrity_errors[kind.index()];
    }
    let blob = u64::from(blob_bytes);
    ArenaStats {
        slots,
        leases_held: s.leases_held,
        evictions: s.evictions,
        revocations: s.revocations,
        leases_force_ended: s.leases_force_ended,
        writebacks: s.write_backs,
        fault_ins: s.fault_ins,
        swap_read_bytes: s.swap_bytes_read,
        swap_written_bytes: s.swap_bytes_written,
        swap_used_bytes: s.swap_extents_used.saturating_mul(blob),
        swap_capacity_bytes: s.swap_extents_total.saturating_mul(blob),
        arena_used_bytes: s
            .slots_total
            .saturating_sub(s.slots_free)
            .saturating_mul(blob),
        arena_capacity_bytes: s.slots_total.saturating_mul(blob),
        // Not the store's: filled in by the metrics source.
        sessions: 0,
        integrity_errors,
    }
}

pub(super) fn arena_op(op: Opcode) -> ArenaOp {
    match op {
        // RAIL_CONNECT completes an RDMA session's setup, so it counts with HELLO.
        Opcode::Challenge | Opcode::Hello | Opcode::RailConnect => ArenaOp::Hello,
        Opcode::Alloc => ArenaOp::Alloc,
        Opcode::Commit => ArenaOp::Commit,
        Opcode::Get | Opcode::GetResident => ArenaOp::Get,
        Opcode::Release | Opcode::Revoke => ArenaOp::Release,
        Opcode::Remove => ArenaOp::Remove,
        Opcode::Flush => ArenaOp::Flush,
        Opcode::Write => ArenaOp::Write,
        Opcode::Read => ArenaOp::Read,
        Opcode::Epoch => ArenaOp::Epoch,
    }
}

pub(super) fn outcome(status: Status) -> ArenaOutcome {
    match status {
        Status::Ok => ArenaOutcome::Ok,
        Status::NotFound => ArenaOutcome::NotFound,
        Status::Cold => ArenaOutcome::Cold,
        Status::NoSpace => ArenaOutcome::NoSpace,
        Status::QuotaExceeded
        | Status::Busy
        | Status::Protocol
        | Status::AuthFailed
        | Status::VersionMismatch
        | Status::LeaseLost
        | Status::StaleEpoch => ArenaOutcome::Denied,
        Status::ShuttingDown | Status::Internal => ArenaOutcome::Error,
    }
}

impl ArenadObservability {
    /// Registers the arenad families and the probes on `tel`; volumes are
    /// labelled as `labels` says.
    pub fn new(tel: Arc<Telemetry>, labels: VolumeLabels) -> Arc<Self> {
        let shared = Arc::new(Shared::default());
        tel.set_probes(Arc::new(ArenadProbes(Arc::clone(&shared))));
        Arc::new(Self {
            metrics: ArenaMetrics::new(&tel),
            volumes: VolumeMetrics::new(&tel, labels),
            tel,
            shared,
        })
    }

    /// Installs the process-global recorder and registers the families.
    pub fn install(
        version: &'static str,
        labels: VolumeLabels,
    ) -> Result<Arc<Self>, TelemetryError> {
        Ok(Self::new(
            Telemetry::install(Daemon::Arenad, version)?,
            labels,
        ))
    }

    /// The counters of `volume`'s sessions.
    pub fn volume(&self, volume: &str) -> Arc<VolumeCounters> {
        self.volumes.counters(volume)
    }

    /// Starts the metrics listener on `addr` with `limits`; it serves
    /// until dropped.
    pub fn listen(&self, addr: &str, limits: HttpConfig) -> Result<MetricsServer, HttpError> {
        MetricsServer::start(addr, Arc::clone(&self.tel), limits)
    }

    /// The telemetry plane.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.tel
    }

    /// The store is open (swap and index usable), and every scrape samples
    /// its statistics; readiness passes once [`Self::serving`] too.
    pub fn store_opened(&self, store: &Arc<Store>, volumes: usize) {
        self.set_volumes(volumes);
        let _ = self.shared.opened.set(Opened {
            store: Arc::clone(store),
        });
        // Weak both: the store holds the metrics (its timing hook), and
        // `shared` holds the store.
        let weak = Arc::downgrade(store);
        let shared = Arc::downgrade(&self.shared);
        self.metrics.set_source(move || {
            let mut stats = weak
                .upgrade()
                .map(|s| arena_stats(&s.stats(), s.blob_bytes()))
                .unwrap_or_default();
            stats.sessions = shared
                .upgrade()
                .map_or(0, |s| s.connections.load(Ordering::Relaxed) as u64);
            stats
        });
        // The configured volumes take their labels first, in order, and
        // render at zero before their first request.
        for v in store.volume_usage() {
            self.volumes.counters(&v.name);
        }
        let weak = Arc::downgrade(store);
        self.volumes.set_source(move || {
            let Some(store) = weak.upgrade() else {
                return Vec::new();
            };
            let blob = u64::from(store.blob_bytes());
            store
                .volume_usage()
                .into_iter()
                .map(|u| VolumeSample {
                    resident_bytes: u.resident * blob,
                    swap_bytes: u.on_swap * blob,
                    leases: u.leases,
                    quota_bytes: u.quota_blobs * blob,
                    name: u.name,
                })
                .collect()
        });
        let metrics = Arc::clone(&self.metrics);
        store.set_timing_hook(Box::new(move |write, latency| match write {
            IndexWrite::Journal => metrics.record_journal(latency),
            IndexWrite::Checkpoint => metrics.record_checkpoint(latency),
        }));
    }

    /// The control port accepts sessions now.
    pub fn serving(&self) {
        self.shared.serving.store(true, Ordering::Release);
    }

    /// The number of volumes served (`/diagnostics`).
    pub fn set_volumes(&self, volumes: usize) {
        self.shared.volumes.store(volumes, Ordering::Relaxed);
    }

    /// A session completed its handshake (`/diagnostics` counts them).
    pub fn session_opened(&self) {
        self.shared.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// Authenticated sessions open now.
    pub fn sessions(&self) -> usize {
        self.shared.connections.load(Ordering::Relaxed)
    }

    /// A session ended.
    pub fn session_closed(&self) {
        self.shared.connections.fetch_sub(1, Ordering::Relaxed);
    }

    /// `/ready` answers 503 `shutting_down` from now on.
    pub fn begin_shutdown(&self) {
        self.tel.begin_shutdown();
    }

    /// A request of `op` was answered with `status` after `latency`.
    pub fn answered(&self, op: Opcode, status: Status, latency: Duration) {
        let out = outcome(status);
        self.metrics.record_op(arena_op(op), out, latency);
        if op == Opcode::Flush && out == ArenaOutcome::Ok {
            self.metrics.record_flush(latency);
        }
    }

    /// A request of `op` was refused with an error that ends its
    /// connection (a bad lease or range, a version-1 session on a volume
    /// whose epoch was raised); its class is counted by
    /// [`Self::protocol_error`].
    pub fn refused(&self, op: Opcode, latency: Duration) {
        self.metrics
            .record_op(arena_op(op), ArenaOutcome::Denied, latency);
    }

    /// A session was opened (HELLO accepted) after `latency`.
    pub fn hello_ok(&self, latency: Duration) {
        self.metrics
            .record_op(ArenaOp::Hello, ArenaOutcome::Ok, latency);
    }

    /// A HELLO was refused for authentication (bad MAC or unknown volume).
    pub fn auth_failed(&self) {
        self.metrics.auth_failure();
        self.metrics
            .record_op(ArenaOp::Hello, ArenaOutcome::Denied, Duration::ZERO);
    }

    /// A HELLO was refused for another reason (`status`); its class is
    /// counted by [`Self::protocol_error`].
    pub fn hello_refused(&self, status: Status) {
        self.metrics
            .record_op(ArenaOp::Hello, outcome(status), Duration::ZERO);
    }

    /// A protocol error of `class` ended a connection.
    pub fn protocol_error(&self, class: ProtocolErrorClass) {
        self.metrics.protocol_error(class);
    }

    /// A connection was closed before its handshake, for `reason`: a
    /// limit at accept, or displaced from its handshake place.
    pub fn connection_refused(&self, reason: ConnectionRefusal) {
        self.metrics.connection_refused(reason);
    }

    /// accept() failed (out of descriptors or memory); the server backs off.
    pub fn accept_failed(&self) {
        self.metrics.accept_error();
    }

    /// A connection closed before sending a byte (a probe or port scan).
    pub fn probe(&self) {
        self.metrics.probe();
    }

    /// A lease's RDMA key could not be registered: the lease went without
    /// one, and its holder moves that payload over TCP.
    pub fn lease_key_failed(&self) {
        self.metrics.lease_key_failure();
    }

    /// An operator ended a session (`arenactl disconnect`).
    pub fn session_disconnected(&self) {
        self.metrics.session_disconnected();
    }

    /// What became of a cold blob due to be faulted in in the background.
    pub fn promotion(&self, outcome: Promotion) {
        self.metrics.promotion(outcome);
    }

    /// A raise ended `n` leases of a session it fenced out.
    pub fn leases_fenced(&self, n: u64) {
        self.metrics.leases_fenced(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_stats_map_to_arena_stats_in_bytes() {
        let s = StoreStats {
            slots_total: 8,
            slots_free: 2,
            slots_clean: 3,
            slots_dirty: 2,
            slots_leased: 1,
            swap_extents_used: 5,
            swap_extents_total: 20,
            write_backs: 7,
            integrity_errors: [3, 1],
            ..StoreStats::default()
        };
        let a = arena_stats(&s, 4096);
        assert_eq!(a.integrity_errors[IntegrityCheck::Checksum.index()], 3);
        assert_eq!(a.integrity_errors[IntegrityCheck::Header.index()], 1);
        assert_eq!(a.slots, [2, 3, 2, 1]);
        assert_eq!(
            (a.arena_used_bytes, a.arena_capacity_bytes),
            (6 * 4096, 8 * 4096)
        );
        assert_eq!(
            (a.swap_used_bytes, a.swap_capacity_bytes),
            (5 * 4096, 20 * 4096)
        );
        assert_eq!(a.writebacks, 7);
    }

    #[test]
    fn readiness_waits_for_the_store_and_shutdown() {
        let t = ArenadObservability::new(
            Telemetry::isolated(Daemon::Arenad, "test"),
            VolumeLabels::default(),
        );
        let r = t.telemetry().readiness();
        assert!(r.failing.contains(NotReadyReason::SwapNotOpen));
        assert!(r.failing.contains(NotReadyReason::IndexNotOpen));
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            Store::open(
                crate::store::StoreConfig {
                    dir: dir.path().to_owned(),
                    arena_bytes: 1 << 20,
                    blob_bytes: 64 << 10,
                    swap_bytes: 4 << 20,
                    swap_reads_in_flight: crate::store::DEFAULT_SWAP_READS_IN_FLIGHT,
                },
                &[crate::store::VolumeSpec {
                    name: "v".into(),
                    quota_blobs: 16,
                }],
            )
            .unwrap(),
        );
        t.store_opened(&store, 1);
        let r = t.telemetry().readiness();
        assert!(
            r.failing.contains(NotReadyReason::Starting)
                && !r.failing.contains(NotReadyReason::SwapNotOpen),
            "open but not serving yet: {r:?}"
        );
        t.serving();
        assert!(t.telemetry().readiness().is_ready());
        let text = t.telemetry().render().unwrap();
        assert!(text.contains("arenad_slots{state=\"free\"} 16"), "{text}");
        assert!(
            text.contains("arenad_integrity_errors_total{kind=\"checksum\"} 0"),
            "{text}"
        );
        t.begin_shutdown();
        assert!(t
            .telemetry()
            .readiness()
            .failing
            .contains(NotReadyReason::ShuttingDown));
    }

    #[test]
    fn the_answered_status_decides_the_outcome_and_flush_latency() {
        let t = ArenadObservability::new(
            Telemetry::isolated(Daemon::Arenad, "test"),
            VolumeLabels::default(),
        );
        t.answered(Opcode::Flush, Status::Ok, Duration::from_millis(2));
        t.answered(Opcode::Get, Status::NotFound, Duration::from_micros(30));
        t.auth_failed();
        t.protocol_error(crate::proto::FrameError::BadOpcode(0x77).class());
        let text = t.telemetry().render().unwrap();
        for want in [
            "arenad_ops_total{op=\"flush\",outcome=\"ok\"} 1",
            "arenad_ops_total{op=\"get\",outcome=\"not_found\"} 1",
            "arenad_ops_total{op=\"hello\",outcome=\"denied\"} 1",
            "arenad_flush_latency_seconds_count 1",
            "arenad_auth_failures_total 1",
            "arenad_protocol_errors_total{class=\"opcode\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing in:\n{text}");
        }
    }
}
