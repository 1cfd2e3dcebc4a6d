//! arenad families: paging operations, slots, leases, paging to swap,
//! durability latency and protocol/authentication failures.
//!
//! This crate cannot depend on the store, so the periodic update takes plain
//! numbers ([`ArenaStats`]); the server calls the per-operation methods.

use crate::histogram::LatencyHistogram;
use crate::labels::{closed_enum, count_variants};
use crate::telemetry::{Collector, Telemetry};
use metrics::{Counter, Gauge};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

closed_enum! {
    /// Paging-protocol operation.
    ArenaOp {
        /// HELLO / session setup.
        Hello => "hello",
        /// ALLOC.
        Alloc => "alloc",
        /// COMMIT.
        Commit => "commit",
        /// GET.
        Get => "get",
        /// RELEASE.
        Release => "release",
        /// REMOVE.
        Remove => "remove",
        /// FLUSH.
        Flush => "flush",
        /// Payload READ over TCP.
        Read => "read",
        /// Payload WRITE over TCP.
        Write => "write",
        /// STAT / keepalive.
        Stat => "stat",
        /// EPOCH: a writer moves to a newer membership epoch.
        Epoch => "epoch",
    }
}

closed_enum! {
    /// Result of one paging operation.
    ArenaOutcome {
        /// Served.
        Ok => "ok",
        /// The key does not exist.
        NotFound => "not_found",
        /// GET_RESIDENT of a blob in swap only: no lease (the client reads the
        /// range inline).
        Cold => "cold",
        /// Arena and swap are full.
        NoSpace => "no_space",
        /// Refused: bad lease, quota, or not authorised.
        Denied => "denied",
        /// Failed (I/O error, internal error).
        Error => "error",
    }
}

closed_enum! {
    /// What became of a cold blob due to be faulted in in the background.
    Promotion {
        /// Faulted in: its reads go by RDMA again.
        Promoted => "promoted",
        /// Not tried: the most fault-ins of this kind were running.
        Skipped => "skipped",
        /// Tried and failed (arena and swap full, or a disk error).
        Failed => "failed",
    }
}

closed_enum! {
    /// State of an arena slot.
    SlotState {
        /// Unused.
        Free => "free",
        /// Resident and identical to swap.
        Clean => "clean",
        /// Resident and newer than swap.
        Dirty => "dirty",
        /// Pinned by a client lease.
        Leased => "leased",
    }
}

closed_enum! {
    /// Class of a protocol error: the one vocabulary of arenad's metric
    /// label and log field and of the client's frame-error counters
    /// (docs/PROTOCOL.md, *Protocol error classes*, lists it; a test
    /// checks the two agree).
    ProtocolErrorClass {
        /// The 24-byte header is not one (bad magic, unknown flag bits, a
        /// reserved field not zero, an unknown status code), or the stream
        /// ended inside a frame.
        Framing => "framing",
        /// A version byte other than the session's, a HELLO naming a
        /// version not offered, or a version-1 session's request on a
        /// volume whose epoch was raised.
        Version => "version",
        /// An opcode byte with no meaning.
        Opcode => "opcode",
        /// A body longer than its opcode allows, or not its layout's length.
        Length => "length",
        /// A frame not valid in this direction or state (a server frame
        /// as a request, EPOCH in version 1, RAIL_CONNECT without
        /// `CAP_RDMA`, more requests in flight than announced), or a
        /// request naming a lease the session does not hold or a range
        /// outside the blob.
        Sequence => "sequence",
        /// A version-2 or -3 frame whose tag does not verify (injected, replayed,
        /// reordered or altered).
        Tag => "tag",
        /// A field value the protocol forbids (volume name, epoch, RELEASE
        /// count, REMOVE range, inline length, endpoint, a request's
        /// status), or a HELLO's blob size the volume does not use.
        Other => "other",
    }
}

closed_enum! {
    /// Why arenad closed a connection before its handshake completed.
    ConnectionRefusal {
        /// `max_connections` connections were open.
        MaxConnections => "max_connections",
        /// `max_unauthenticated` connections were in their handshake, and
        /// the new one's source held as many as any other within one.
        MaxUnauthenticated => "max_unauthenticated",
        /// A connection in its handshake, the oldest of the source holding
        /// the most, gave its place to one from a source holding fewer.
        Displaced => "displaced",
    }
}

closed_enum! {
    /// Which check refused bytes read from swap.
    IntegrityCheck {
        /// A block failed its CRC32C.
        Checksum => "checksum",
        /// The extent's header is missing, damaged or names another image.
        Header => "header",
    }
}

closed_enum! {
    /// Where blobs live: the RAM arena or the swap file behind it.
    Tier {
        /// The RAM arena.
        Arena => "arena",
        /// The swap file.
        Swap => "swap",
    }
}

/// Store state sampled periodically; plain numbers so arenad can fill it
/// from its store without this crate depending on it. Cumulative counters
/// are totals since the store started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ArenaStats {
    /// Slots per state, indexed by [`SlotState::index`].
    pub slots: [u64; SlotState::COUNT],
    /// Leases held.
    pub leases_held: u64,
    /// Evictions since start.
    pub evictions: u64,
    /// Leases asked back since start.
    pub revocations: u64,
    /// Revoked leases ended by force since start.
    pub leases_force_ended: u64,
    /// Write-backs since start.
    pub writebacks: u64,
    /// Fault-ins since start.
    pub fault_ins: u64,
    /// Bytes read from swap since start.
    pub swap_read_bytes: u64,
    /// Bytes written to swap since start.
    pub swap_written_bytes: u64,
    /// Swap bytes in use.
    pub swap_used_bytes: u64,
    /// Swap capacity in bytes.
    pub swap_capacity_bytes: u64,
    /// Arena bytes in use.
    pub arena_used_bytes: u64,
    /// Arena capacity in bytes.
    pub arena_capacity_bytes: u64,
    /// Authenticated sessions open.
    pub sessions: u64,
    /// Reads refused since start, indexed by [`IntegrityCheck::index`].
    pub integrity_errors: [u64; IntegrityCheck::COUNT],
}

/// The arenad families.
pub struct ArenaMetrics {
    ops: [[Counter; ArenaOutcome::COUNT]; ArenaOp::COUNT],
    op_latency: [Arc<LatencyHistogram>; ArenaOp::COUNT],
    slots: [Gauge; SlotState::COUNT],
    leases: Gauge,
    evictions: Counter,
    revocations: Counter,
    force_ended: Counter,
    writebacks: Counter,
    fault_ins: Counter,
    swap_read: Counter,
    swap_written: Counter,
    swap_util: Gauge,
    arena_util: Gauge,
    used: [Gauge; Tier::COUNT],
    capacity: [Gauge; Tier::COUNT],
    sessions: Gauge,
    journal: Arc<LatencyHistogram>,
    checkpoint: Arc<LatencyHistogram>,
    flush: Arc<LatencyHistogram>,
    protocol_errors: [Counter; ProtocolErrorClass::COUNT],
    auth_failures: Counter,
    refusals: [Counter; ConnectionRefusal::COUNT],
    accept_errors: Counter,
    probes: Counter,
    lease_key_failures: Counter,
    leases_fenced: Counter,
    disconnected: Counter,
    promotions: [Counter; Promotion::COUNT],
    integrity_errors: [Counter; IntegrityCheck::COUNT],
    source: Mutex<Option<Box<dyn Fn() -> ArenaStats + Send + Sync>>>,
}

impl std::fmt::Debug for ArenaMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaMetrics").finish_non_exhaustive()
    }
}

fn ratio(used: u64, cap: u64) -> f64 {
    if cap == 0 {
        0.0
    } else {
        (used as f64 / cap as f64).clamp(0.0, 1.0)
    }
}

impl ArenaMetrics {
    /// Registers the families and makes the result a collector of
    /// `telemetry` (see [`ArenaMetrics::set_source`]).
    pub fn new(telemetry: &Arc<Telemetry>) -> Arc<Self> {
        let t = &**telemetry;
        // A counter that renders at zero from the start.
        fn c0(t: &Telemetry, name: &str, labels: &[(&'static str, &str)]) -> Counter {
            let c = t.counter(name, labels);
            c.increment(0);
            c
        }
        let m = Arc::new(ArenaMetrics {
            ops: ArenaOp::ALL.map(|op| {
                ArenaOutcome::ALL.map(|o| {
                    t.counter(
                        "arenad_ops_total",
                        &[("op", op.as_str()), ("outcome", o.as_str())],
                    )
                })
            }),
            op_latency: ArenaOp::ALL
                .map(|op| t.histogram("arenad_op_latency_seconds", &[("op", op.as_str())])),
            slots: SlotState::ALL.map(|s| t.gauge("arenad_slots", &[("state", s.as_str())])),
            leases: t.gauge("arenad_leases_held", &[]),
            evictions: c0(t, "arenad_evictions_total", &[]),
            revocations: c0(t, "arenad_lease_revocations_total", &[]),
            force_ended: c0(t, "arenad_leases_force_ended_total", &[]),
            writebacks: c0(t, "arenad_writebacks_total", &[]),
            fault_ins: c0(t, "arenad_fault_ins_total", &[]),
            swap_read: c0(t, "arenad_swap_read_bytes_total", &[]),
            swap_written: c0(t, "arenad_swap_written_bytes_total", &[]),
            swap_util: t.gauge("arenad_swap_utilisation_ratio", &[]),
            arena_util: t.gauge("arenad_arena_utilisation_ratio", &[]),
            used: Tier::ALL.map(|tier| t.gauge("arenad_used_bytes", &[("tier", tier.as_str())])),
            capacity: Tier::ALL
                .map(|tier| t.gauge("arenad_capacity_bytes", &[("tier", tier.as_str())])),
            sessions: t.gauge("arenad_sessions", &[]),
            journal: t.histogram("arenad_journal_latency_seconds", &[]),
            checkpoint: t.histogram("arenad_checkpoint_latency_seconds", &[]),
            flush: t.histogram("arenad_flush_latency_seconds", &[]),
            protocol_errors: ProtocolErrorClass::ALL
                .map(|c| t.counter("arenad_protocol_errors_total", &[("class", c.as_str())])),
            auth_failures: c0(t, "arenad_auth_failures_total", &[]),
            refusals: ConnectionRefusal::ALL.map(|r| {
                c0(
                    t,
                    "arenad_connections_refused_total",
                    &[("reason", r.as_str())],
                )
            }),
            accept_errors: c0(t, "arenad_accept_errors_total", &[]),
            probes: c0(t, "arenad_probes_total", &[]),
            lease_key_failures: c0(t, "arenad_rdma_lease_key_failures_total", &[]),
            leases_fenced: c0(t, "arenad_leases_fenced_total", &[]),
            disconnected: c0(t, "arenad_sessions_disconnected_total", &[]),
            promotions: Promotion::ALL
                .map(|p| c0(t, "arenad_promotions_total", &[("outcome", p.as_str())])),
            integrity_errors: IntegrityCheck::ALL
                .map(|c| c0(t, "arenad_integrity_errors_total", &[("kind", c.as_str())])),
            source: Mutex::new(None),
        });
        m.update_from(&ArenaStats::default());
        telemetry.register_collector(&m);
        m
    }

    /// Accounts one served operation.
    #[inline]
    pub fn record_op(&self, op: ArenaOp, outcome: ArenaOutcome, latency: Duration) {
        self.ops[op.index()][outcome.index()].increment(1);
        self.op_latency[op.index()].record(latency);
    }

    /// Accounts one journal append + sync.
    pub fn record_journal(&self, latency: Duration) {
        self.journal.record(latency);
    }

    /// Accounts one checkpoint.
    pub fn record_checkpoint(&self, latency: Duration) {
        self.checkpoint.record(latency);
    }

    /// Accounts one client FLUSH made durable.
    pub fn record_flush(&self, latency: Duration) {
        self.flush.record(latency);
    }

    /// Counts a malformed or unexpected frame.
    pub fn protocol_error(&self, class: ProtocolErrorClass) {
        self.protocol_errors[class.index()].increment(1);
    }

    /// Counts a connection refused at authentication.
    pub fn auth_failure(&self) {
        self.auth_failures.increment(1);
    }

    /// Counts a connection closed before its handshake, for `reason`.
    pub fn connection_refused(&self, reason: ConnectionRefusal) {
        self.refusals[reason.index()].increment(1);
    }

    /// Counts a failed accept (out of descriptors or memory).
    pub fn accept_error(&self) {
        self.accept_errors.increment(1);
    }

    /// Counts a connection closed before it sent a byte.
    pub fn probe(&self) {
        self.probes.increment(1);
    }

    /// Counts a lease answered without its RDMA key because registering
    /// the key failed.
    pub fn lease_key_failure(&self) {
        self.lease_key_failures.increment(1);
    }

    /// Counts `n` leases ended by a raise of their volume's epoch: their
    /// holders were fenced out.
    pub fn leases_fenced(&self, n: u64) {
        self.leases_fenced.increment(n);
    }

    /// Counts a session ended by an operator.
    pub fn session_disconnected(&self) {
        self.disconnected.increment(1);
    }

    /// Counts a cold blob's background fault-in by what became of it.
    pub fn promotion(&self, outcome: Promotion) {
        self.promotions[outcome.index()].increment(1);
    }

    /// Publishes store state. Cumulative fields are applied as absolute
    /// values that never decrease, so a store that restarts its counts does
    /// not make the exported counters go back.
    pub fn update_from(&self, s: &ArenaStats) {
        for (g, v) in self.slots.iter().zip(s.slots) {
            g.set(v as f64);
        }
        self.leases.set(s.leases_held as f64);
        self.evictions.absolute(s.evictions);
        self.revocations.absolute(s.revocations);
        self.force_ended.absolute(s.leases_force_ended);
        self.writebacks.absolute(s.writebacks);
        self.fault_ins.absolute(s.fault_ins);
        self.swap_read.absolute(s.swap_read_bytes);
        self.swap_written.absolute(s.swap_written_bytes);
        for (c, &v) in self.integrity_errors.iter().zip(&s.integrity_errors) {
            c.absolute(v);
        }
        self.swap_util
            .set(ratio(s.swap_used_bytes, s.swap_capacity_bytes));
        self.arena_util
            .set(ratio(s.arena_used_bytes, s.arena_capacity_bytes));
        for (tier, used, capacity) in [
            (Tier::Arena, s.arena_used_bytes, s.arena_capacity_bytes),
            (Tier::Swap, s.swap_used_bytes, s.swap_capacity_bytes),
        ] {
            self.used[tier.index()].set(used as f64);
            self.capacity[tier.index()].set(capacity as f64);
        }
        self.sessions.set(s.sessions as f64);
    }

    /// Sets a function sampled at every scrape to refresh the store gauges
    /// (instead of, or in addition to, calling [`Self::update_from`] from a
    /// timer). It runs on the scrape thread: it must be cheap and must not
    /// block on the store's I/O.
    pub fn set_source(&self, source: impl Fn() -> ArenaStats + Send + Sync + 'static) {
        *self.source.lock() = Some(Box::new(source));
    }
}

impl Collector for ArenaMetrics {
    fn collect(&self) {
        let stats = self.source.lock().as_ref().map(|f| f());
        if let Some(s) = stats {
            self.update_from(&s);
        }
    }
}
