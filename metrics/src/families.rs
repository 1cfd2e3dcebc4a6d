//! The catalogue of exported metric families.
//!
//! One table feeds the `# HELP` lines, the documentation check and the
//! dashboard check, so a family cannot be exported without being listed
//! here, and a dashboard cannot query a family that is not exported. The
//! well-known driver-statistics names ([`driver_names`]) are listed here
//! too, for the same checks; [`crate::driver`] exports them.

/// Prometheus metric type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic counter (`_total`).
    Counter,
    /// Gauge.
    Gauge,
    /// Histogram (`_bucket`, `_sum`, `_count`).
    Histogram,
}

/// One metric family.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// Full name, as rendered (for self-observability families, the part
    /// after the daemon prefix, starting with `_`).
    pub name: &'static str,
    /// Type.
    pub kind: Kind,
    /// Label names (optional ones in brackets, e.g. `[device]`).
    pub labels: &'static [&'static str],
    /// `# HELP` text.
    pub help: &'static str,
}

const fn f(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Family {
    Family {
        name,
        kind,
        labels,
        help,
    }
}

use Kind::{Counter, Gauge, Histogram};

/// Device I/O accounting and scanner families (ublkd).
pub const IO: &[Family] = &[
    f(
        "ublk_io_requests_total",
        Counter,
        &["target", "op", "[device]"],
        "Block requests completed by the target, successful or failed.",
    ),
    f(
        "ublk_io_bytes_total",
        Counter,
        &["target", "op", "[device]"],
        "Bytes of successfully completed block requests.",
    ),
    f(
        "ublk_io_errors_total",
        Counter,
        &["target", "op", "errno", "[device]"],
        "Block requests completed with an error, by errno class.",
    ),
    f(
        "ublk_io_latency_seconds",
        Histogram,
        &["target", "op", "[device]"],
        "Time from the target taking a block request to its completion.",
    ),
    f(
        "ublk_io_inflight",
        Gauge,
        &["target", "op", "[device]"],
        "Block requests in flight at the last scan.",
    ),
    f(
        "ublk_io_stalled",
        Gauge,
        &["target", "op", "[device]"],
        "Block requests pending for at least the stall threshold at the last scan.",
    ),
    f(
        "ublk_io_oldest_inflight_seconds",
        Gauge,
        &["target", "[device]"],
        "Age of the oldest in-flight block request at the last scan; 0 when idle.",
    ),
];

/// Logical request and physical attempt accounting (ublkd).
pub const ACCOUNTING: &[Family] = &[
    f(
        "ublk_requests_started_total",
        Counter,
        &["op", "transport"],
        "Logical block requests started.",
    ),
    f(
        "ublk_request_outcomes_total",
        Counter,
        &["op", "transport", "outcome"],
        "Logical block requests that reached a terminal outcome.",
    ),
    f(
        "ublk_requests_inflight",
        Gauge,
        &["op", "transport"],
        "Logical block requests started and not yet terminal.",
    ),
    f(
        "ublk_attempts_started_total",
        Counter,
        &["op", "transport"],
        "Physical transport attempts started.",
    ),
    f(
        "ublk_attempt_outcomes_total",
        Counter,
        &["op", "transport", "outcome"],
        "Physical transport attempts that reached a terminal outcome.",
    ),
    f(
        "ublk_attempts_inflight",
        Gauge,
        &["op", "transport"],
        "Physical transport attempts started and not yet terminal.",
    ),
    f(
        "ublk_failovers_total",
        Counter,
        &["op", "from", "to"],
        "Logical requests that moved to another transport (counted once per request).",
    ),
    f(
        "ublk_request_failures_total",
        Counter,
        &["transport", "phase", "reason"],
        "Logical block requests that failed, by failing phase and reason.",
    ),
    f(
        "ublk_attempt_failures_total",
        Counter,
        &["transport", "phase", "reason"],
        "Physical attempts that failed, by failing phase and reason.",
    ),
    f(
        "ublk_attempt_latency_seconds",
        Histogram,
        &["op", "transport"],
        "Duration of physical attempts that succeeded or failed, by the transport they ran on.",
    ),
];

/// TCP_INFO of the arena connections (ublkd), aggregated over connections:
/// kernel TCP retransmissions, apart from software retries
/// (`ublk_driver_request_retries_total`) and RDMA completion errors
/// (`ublk_driver_wc_errors_total`).
pub const TCP: &[Family] = &[
    f(
        "ublk_tcp_connections",
        Gauge,
        &[],
        "Arena TCP connections open, whose TCP_INFO the gauges below aggregate.",
    ),
    f(
        "ublk_tcp_retransmissions_total",
        Counter,
        &[],
        "TCP segments the kernel retransmitted on arena connections (TCP_INFO tcpi_total_retrans).",
    ),
    f(
        "ublk_tcp_rtt_max_seconds",
        Gauge,
        &[],
        "Largest smoothed round-trip time of the open arena connections at their last sample.",
    ),
    f(
        "ublk_tcp_rtt_mean_seconds",
        Gauge,
        &[],
        "Mean smoothed round-trip time of the open arena connections at their last sample.",
    ),
    f(
        "ublk_tcp_cwnd_min_segments",
        Gauge,
        &[],
        "Smallest congestion window of the open arena connections at their last sample.",
    ),
    f(
        "ublk_tcp_cwnd_mean_segments",
        Gauge,
        &[],
        "Mean congestion window of the open arena connections at their last sample.",
    ),
];

/// Driver statistics aggregates (ublkd); the per-counter families are in
/// [`driver_families`].
pub const DRIVER: &[Family] = &[
    f(
        "ublk_driver_reporting",
        Gauge,
        &[],
        "Devices whose data-path driver reports statistics.",
    ),
    f(
        "ublk_driver_partial",
        Gauge,
        &[],
        "1 when reporting devices use different drivers, so no sums are exported.",
    ),
];

/// RDMA rails (ublkd), summed over devices by rail index and local RDMA
/// device (at most `driver::MAX_RAIL_SERIES` label sets).
pub const RAILS: &[Family] = &[
    f(
        "ublk_driver_rail_queues",
        Gauge,
        &["rail", "rdma_device"],
        "Device queues with a QP on this rail.",
    ),
    f(
        "ublk_driver_rail_queues_up",
        Gauge,
        &["rail", "rdma_device"],
        "Device queues whose QP on this rail is up; below ublk_driver_rail_queues, queues run on their other rail.",
    ),
    f(
        "ublk_driver_rail_outstanding_bytes",
        Gauge,
        &["rail", "rdma_device"],
        "Payload bytes posted on this rail and not completed yet.",
    ),
    f(
        "ublk_driver_rail_transfers_total",
        Counter,
        &["rail", "rdma_device"],
        "RDMA transfers this rail moved (each half of a striped payload counts).",
    ),
    f(
        "ublk_driver_rail_bytes_total",
        Counter,
        &["rail", "rdma_device"],
        "Payload bytes this rail moved.",
    ),
    f(
        "ublk_driver_rail_lost_total",
        Counter,
        &["rail", "rdma_device"],
        "Times a QP on this rail failed under load (an error completion or a timeout): its transfers moved to the other rail.",
    ),
];

/// Replicated volumes (ublkd): coordination on etcd (with `[etcd]`) and
/// replica health.
pub const COORDINATION: &[Family] = &[
    f(
        "ublk_membership_epoch_changes_total",
        Counter,
        &["reason"],
        "Membership epoch changes this ublkd made, by reason.",
    ),
    f(
        "ublk_writer_leases_lost_total",
        Counter,
        &[],
        "Writer leases etcd no longer knew (expired or revoked); their writers were fenced.",
    ),
    f(
        "ublk_writer_lease_valid",
        Gauge,
        &[],
        "1 while this ublkd's writer lease allows acknowledging writes, else 0.",
    ),
    // Replica health (metrics/src/replicas.rs); with or without etcd.
    f(
        "ublk_replicas",
        Gauge,
        &[],
        "Replicas the replicated devices were created with, summed over the devices.",
    ),
    f(
        "ublk_replicas_healthy",
        Gauge,
        &[],
        "Members of replicated devices that hold every acknowledged write, summed.",
    ),
    f(
        "ublk_devices_degraded",
        Gauge,
        &[],
        "Replicated devices with fewer healthy members than replicas.",
    ),
    f(
        "ublk_rebuild_bytes_total",
        Counter,
        &[],
        "Blob bytes copied to rebuilt members.",
    ),
    f(
        "ublk_rebuild_remaining_bytes",
        Gauge,
        &[],
        "Blob bytes the running rebuilds still have to copy.",
    ),
    f(
        "ublk_rebuild_bytes_per_second",
        Gauge,
        &[],
        "Bytes per second the running rebuilds copy, over the last 5 s.",
    ),
    f(
        "ublk_writer_stale_epoch_fences_total",
        Counter,
        &[],
        "Writers fenced because a peer had seen a newer membership epoch (another writer took over).",
    ),
    f(
        "ublk_replica_writers_unconfirmed",
        Gauge,
        &[],
        "Replicated devices whose writer role etcd does not confirm now (serving on the peers' epoch fence).",
    ),
    f(
        "ublk_replica_writers_fenced",
        Gauge,
        &[],
        "Replicated devices whose writer is fenced: every write fails until `ublkctl recover`.",
    ),
    f(
        "ublk_replica_stragglers_total",
        Counter,
        &[],
        "Members failed because they answered a write or flush too late after the other members.",
    ),
    f(
        "ublk_replica_roles_regained_total",
        Counter,
        &[],
        "Writer roles confirmed again after etcd lost the writer lease and the key was taken back.",
    ),
    f(
        "ublk_replica_standbys",
        Gauge,
        &[],
        "Replicated devices served as a standby: reads served, no write acknowledged until a hand-over gives them the writer role.",
    ),
    f(
        "ublk_replica_handovers_total",
        Counter,
        &["direction"],
        "Writer roles moved between ublkd by a hand-over: `in` taken by a standby here, `out` handed to another's.",
    ),
    f(
        "ublk_replica_last_handover_seconds",
        Gauge,
        &[],
        "How long the last hand-over into this ublkd took, from asking the writer to serving writes.",
    ),
    f(
        "ublk_replica_hedged_reads_total",
        Counter,
        &["outcome"],
        "Reads of replicated devices also sent to a second member because the first was slow, by which answered first.",
    ),
    f(
        "ublk_rebuilds_total",
        Counter,
        &["outcome"],
        "Rebuilds of replicated devices' members (a returning peer or a spare), by how they ended.",
    ),
];

/// arenad families.
pub const ARENA: &[Family] = &[
    f(
        "arenad_ops_total",
        Counter,
        &["op", "outcome"],
        "Paging-protocol operations served, by op and outcome.",
    ),
    f(
        "arenad_op_latency_seconds",
        Histogram,
        &["op"],
        "Time to serve one paging-protocol operation.",
    ),
    f("arenad_slots", Gauge, &["state"], "Arena slots by state."),
    f(
        "arenad_leases_held",
        Gauge,
        &[],
        "Leases currently held by clients.",
    ),
    f(
        "arenad_lease_revocations_total",
        Counter,
        &[],
        "Leases the arena asked back (REVOKE) because every slot was pinned.",
    ),
    f(
        "arenad_leases_force_ended_total",
        Counter,
        &[],
        "Revoked leases not given back within revoke_deadline_ms, ended by force.",
    ),
    f(
        "arenad_evictions_total",
        Counter,
        &[],
        "Blobs evicted from the RAM arena.",
    ),
    f(
        "arenad_writebacks_total",
        Counter,
        &[],
        "Dirty blobs written back to swap.",
    ),
    f(
        "arenad_fault_ins_total",
        Counter,
        &[],
        "Blobs read back from swap into the arena.",
    ),
    f(
        "arenad_swap_read_bytes_total",
        Counter,
        &[],
        "Bytes read from the swap file.",
    ),
    f(
        "arenad_swap_written_bytes_total",
        Counter,
        &[],
        "Bytes written to the swap file.",
    ),
    f(
        "arenad_swap_utilisation_ratio",
        Gauge,
        &[],
        "Used fraction of the swap file (0-1).",
    ),
    f(
        "arenad_arena_utilisation_ratio",
        Gauge,
        &[],
        "Used fraction of the RAM arena (0-1).",
    ),
    f(
        "arenad_used_bytes",
        Gauge,
        &["tier"],
        "Bytes of blobs held, in the RAM arena or in the swap file.",
    ),
    f(
        "arenad_capacity_bytes",
        Gauge,
        &["tier"],
        "Bytes the RAM arena or the swap file can hold.",
    ),
    f(
        "arenad_sessions",
        Gauge,
        &[],
        "Authenticated paging-protocol sessions open.",
    ),
    f(
        "arenad_sessions_disconnected_total",
        Counter,
        &[],
        "Sessions ended by an operator (arenactl disconnect).",
    ),
    f(
        "arenad_volume_requests_total",
        Counter,
        &["volume", "op"],
        "Requests answered, per volume and operation.",
    ),
    f(
        "arenad_volume_bytes_total",
        Counter,
        &["volume", "op"],
        "Control-stream bytes of a volume's requests and answers, per operation.",
    ),
    f(
        "arenad_volume_errors_total",
        Counter,
        &["volume"],
        "A volume's requests answered no_space, denied or error.",
    ),
    f(
        "arenad_volume_sessions",
        Gauge,
        &["volume"],
        "Authenticated sessions open on a volume.",
    ),
    f(
        "arenad_volume_resident_bytes",
        Gauge,
        &["volume"],
        "Bytes of a volume's blobs in the RAM arena.",
    ),
    f(
        "arenad_volume_swap_bytes",
        Gauge,
        &["volume"],
        "Bytes of a volume's blob images in the swap file.",
    ),
    f(
        "arenad_volume_leases",
        Gauge,
        &["volume"],
        "Leases pinning a volume's blobs.",
    ),
    f(
        "arenad_volume_quota_bytes",
        Gauge,
        &["volume"],
        "A volume's quota in bytes.",
    ),
    f(
        "arenad_journal_latency_seconds",
        Histogram,
        &[],
        "Time to append and sync one journal record.",
    ),
    f(
        "arenad_checkpoint_latency_seconds",
        Histogram,
        &[],
        "Time to write one index checkpoint.",
    ),
    f(
        "arenad_flush_latency_seconds",
        Histogram,
        &[],
        "Time to make a client FLUSH durable.",
    ),
    f(
        "arenad_protocol_errors_total",
        Counter,
        &["class"],
        "Malformed or unexpected frames, by class.",
    ),
    f(
        "arenad_auth_failures_total",
        Counter,
        &[],
        "Connections refused at authentication.",
    ),
    f(
        "arenad_rdma_lease_key_failures_total",
        Counter,
        &[],
        "Leases answered without their RDMA key: registering it failed.",
    ),
    f(
        "arenad_promotions_total",
        Counter,
        &["outcome"],
        "Cold blobs read often enough to be faulted into the arena in the background, by outcome.",
    ),
    f(
        "arenad_leases_fenced_total",
        Counter,
        &[],
        "Leases ended by a raise of their volume's epoch: their holders were fenced out.",
    ),
    f(
        "arenad_connections_refused_total",
        Counter,
        &["reason"],
        "Connections closed before their handshake: refused at accept by a limit, or displaced from a handshake place by a source holding fewer.",
    ),
    f(
        "arenad_accept_errors_total",
        Counter,
        &[],
        "Failed accepts (out of descriptors or memory); arenad backs off and keeps serving.",
    ),
    f(
        "arenad_probes_total",
        Counter,
        &[],
        "Connections closed before sending a byte (health checks, port scans).",
    ),
    f(
        "arenad_integrity_errors_total",
        Counter,
        &["kind"],
        "Reads refused because bytes from swap did not verify, by check.",
    ),
];

/// The standard process families (the names every Prometheus client
/// library exports, unprefixed), read from Linux `/proc` at each scrape.
pub const PROCESS: &[Family] = &[
    f(
        "process_start_time_seconds",
        Gauge,
        &[],
        "Start time of the process since the Unix epoch, in seconds.",
    ),
    f(
        "process_cpu_seconds_total",
        Counter,
        &[],
        "User and system CPU time spent, in seconds.",
    ),
    f(
        "process_resident_memory_bytes",
        Gauge,
        &[],
        "Resident memory size in bytes.",
    ),
    f(
        "process_virtual_memory_bytes",
        Gauge,
        &[],
        "Virtual memory size in bytes.",
    ),
    f("process_open_fds", Gauge, &[], "Open file descriptors."),
    f(
        "process_max_fds",
        Gauge,
        &[],
        "The soft limit of open file descriptors (LimitNOFILE).",
    ),
];

/// Self-observability families; the name is appended to the daemon prefix
/// (`ublkd`, `arenad`).
pub const SELF: &[Family] = &[
    f(
        "_build_info",
        Gauge,
        &["version", "revision"],
        "Always 1; identifies the running build (revision: git commit, or unknown).",
    ),
    f(
        "_ready",
        Gauge,
        &[],
        "1 when the last readiness evaluation passed, else 0.",
    ),
    f(
        "_not_ready",
        Gauge,
        &["reason"],
        "1 for each readiness check failing at the last evaluation.",
    ),
    f(
        "_metrics_http_server_up",
        Gauge,
        &[],
        "1 while the metrics HTTP listener is serving.",
    ),
    f(
        "_metrics_http_start_failures_total",
        Counter,
        &[],
        "Failures to bind or start the metrics HTTP listener.",
    ),
    f(
        "_metrics_http_rejections_total",
        Counter,
        &["reason"],
        "Metrics HTTP connections or requests ended without their answer, by reason.",
    ),
    f(
        "_metrics_serialization_attempts_total",
        Counter,
        &[],
        "Renders of the metrics exposition.",
    ),
    f(
        "_metrics_serialization_failures_total",
        Counter,
        &[],
        "Renders that failed (a collector panicked or the output exceeded its bound).",
    ),
    f(
        "_metrics_last_success_timestamp_seconds",
        Gauge,
        &[],
        "Unix time of the last successful render.",
    ),
    f(
        "_scanner_runs_total",
        Counter,
        &[],
        "Completed tracker scans.",
    ),
    f(
        "_scanner_last_run_timestamp_seconds",
        Gauge,
        &[],
        "Unix time of the last tracker scan.",
    ),
];

/// Which daemon a [`crate::Telemetry`] belongs to; selects the prefix of the
/// self-observability families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daemon {
    /// The ublk daemon.
    Ublkd,
    /// The arena peer.
    Arenad,
}

impl Daemon {
    /// Metric name prefix.
    pub const fn prefix(self) -> &'static str {
        match self {
            Daemon::Ublkd => "ublkd",
            Daemon::Arenad => "arenad",
        }
    }
}

pub mod driver_names;

/// Families exported for each driver-statistics name documented in
/// [`driver_names`].
pub fn driver_families() -> Vec<(String, Kind)> {
    let mut out: Vec<(String, Kind)> = driver_names::COUNTERS
        .iter()
        .map(|n| (format!("ublk_driver_{n}_total"), Counter))
        .collect();
    out.extend(
        driver_names::GAUGES
            .iter()
            .map(|n| (format!("ublk_driver_{n}"), Gauge)),
    );
    out
}

/// Every family name the project exports, with its type.
pub fn exported() -> Vec<(String, Kind)> {
    let mut out: Vec<(String, Kind)> = IO
        .iter()
        .chain(ACCOUNTING)
        .chain(DRIVER)
        .chain(RAILS)
        .chain(TCP)
        .chain(COORDINATION)
        .chain(ARENA)
        .chain(PROCESS)
        .map(|f| (f.name.to_string(), f.kind))
        .collect();
    out.extend(driver_families());
    for d in [Daemon::Ublkd, Daemon::Arenad] {
        out.extend(
            SELF.iter()
                .map(|f| (format!("{}{}", d.prefix(), f.name), f.kind)),
        );
    }
    out
}

/// Every sample name a scrape can contain (histograms expand to their
/// `_bucket`, `_sum` and `_count` series).
pub fn exported_sample_names() -> Vec<String> {
    let mut out = Vec::new();
    for (name, kind) in exported() {
        if kind == Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                out.push(format!("{name}{suffix}"));
            }
        }
        out.push(name);
    }
    out
}

/// Help text of a fixed (non-driver, non-self) family.
pub(crate) fn help(name: &str) -> &'static str {
    IO.iter()
        .chain(ACCOUNTING)
        .chain(DRIVER)
        .chain(RAILS)
        .chain(TCP)
        .chain(COORDINATION)
        .chain(ARENA)
        .chain(PROCESS)
        .find(|f| f.name == name)
        .map(|f| f.help)
        .unwrap_or("")
}
