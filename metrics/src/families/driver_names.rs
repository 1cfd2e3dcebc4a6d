//! Well-known statistic names. Drivers may report others (exported the same
//! way); these are the ones the summary, dashboard and alerts understand.

/// RDMA requests posted (per op).
pub const RDMA_REQUESTS: &str = "rdma_requests";
/// RDMA requests whose payload moved over RDMA (per op).
pub const RDMA_TRANSFERRED: &str = "rdma_transferred";
/// RDMA requests the peer declined, then served over TCP (per op).
pub const RDMA_DECLINED_SERVED_TCP: &str = "rdma_declined_served_tcp";
/// RDMA requests the peer declined that then failed (per op).
pub const RDMA_DECLINED_FAILED: &str = "rdma_declined_failed";
/// RDMA requests that failed (work completion error, post failure).
pub const RDMA_FAILED: &str = "rdma_failed";
/// RDMA requests answered with a protocol error.
pub const RDMA_PROTOCOL_ERRORS: &str = "rdma_protocol_errors";
/// RDMA requests that timed out.
pub const RDMA_TIMED_OUT: &str = "rdma_timed_out";
/// Payload requests sent inline over TCP (per op, with a `reason`).
pub const TCP_PAYLOAD_REQUESTS: &str = "tcp_payload_requests";
/// Payload bytes sent inline over TCP (per op, with a `reason`).
pub const TCP_PAYLOAD_BYTES: &str = "tcp_payload_bytes";
/// Buffer registrations from the pool.
pub const REGISTRATIONS_POOLED: &str = "registrations_pooled";
/// Buffer registrations made for one operation.
pub const REGISTRATIONS_PER_OP: &str = "registrations_per_op";
/// Memory registration failures.
pub const REGISTRATION_FAILURES: &str = "registration_failures";
/// Buffer allocation failures.
pub const ALLOCATION_FAILURES: &str = "allocation_failures";
/// Lease (token) failures.
pub const LEASE_FAILURES: &str = "lease_failures";
/// Buffers free in the pool.
pub const BUFFER_POOL_FREE: &str = "buffer_pool_free";
/// Buffers in use.
pub const BUFFER_POOL_IN_USE: &str = "buffer_pool_in_use";
/// Most buffers ever in use.
pub const BUFFER_POOL_PEAK: &str = "buffer_pool_peak";
/// Control connections re-established after a loss.
pub const RECONNECTS: &str = "reconnects";
/// Requests that got no answer in time.
pub const REQUEST_TIMEOUTS: &str = "request_timeouts";
/// Idempotent requests sent again over a new connection.
pub const REQUEST_RETRIES: &str = "request_retries";
/// Answers that arrived after their request had timed out.
pub const LATE_ANSWERS: &str = "late_answers";
/// Reconnects that found a new peer generation (the peer restarted).
pub const PEER_RESTARTS: &str = "peer_restarts";
/// Lease revocations the peer sent.
pub const REVOCATIONS_RECEIVED: &str = "revocations_received";
/// Revocations dropped because their owner did not collect them.
pub const REVOCATIONS_DROPPED: &str = "revocations_dropped";
/// Answer frames the client could not parse (with a `reason`: the
/// frame error's class).
pub const FRAME_ERRORS: &str = "frame_errors";
/// Answers naming a request not in flight, or with another opcode.
pub const RESPONSE_ID_MISMATCHES: &str = "response_id_mismatches";
/// Answers whose length differs from what their request asked for.
pub const LENGTH_MISMATCHES: &str = "length_mismatches";

/// Every well-known counter name.
pub const COUNTERS: &[&str] = &[
    RDMA_REQUESTS,
    RDMA_TRANSFERRED,
    RDMA_DECLINED_SERVED_TCP,
    RDMA_DECLINED_FAILED,
    RDMA_FAILED,
    RDMA_PROTOCOL_ERRORS,
    RDMA_TIMED_OUT,
    TCP_PAYLOAD_REQUESTS,
    TCP_PAYLOAD_BYTES,
    REGISTRATIONS_POOLED,
    REGISTRATIONS_PER_OP,
    REGISTRATION_FAILURES,
    ALLOCATION_FAILURES,
    LEASE_FAILURES,
    RECONNECTS,
    REQUEST_TIMEOUTS,
    REQUEST_RETRIES,
    LATE_ANSWERS,
    PEER_RESTARTS,
    REVOCATIONS_RECEIVED,
    REVOCATIONS_DROPPED,
    FRAME_ERRORS,
    RESPONSE_ID_MISMATCHES,
    LENGTH_MISMATCHES,
];
/// Every well-known gauge name.
pub const GAUGES: &[&str] = &[BUFFER_POOL_FREE, BUFFER_POOL_IN_USE, BUFFER_POOL_PEAK];

/// The `# HELP` text of each well-known name's family.
const HELP: &[(&str, &str)] = &[
    (RDMA_REQUESTS, "RDMA requests posted, by op."),
    (
        RDMA_TRANSFERRED,
        "RDMA requests whose payload moved by RDMA, by op.",
    ),
    (
        RDMA_DECLINED_SERVED_TCP,
        "RDMA requests the peer declined (no key), served over TCP instead, by op.",
    ),
    (
        RDMA_DECLINED_FAILED,
        "RDMA requests the peer declined that then failed, by op.",
    ),
    (
        RDMA_FAILED,
        "RDMA requests that failed (a work completion error or a failed post).",
    ),
    (
        RDMA_PROTOCOL_ERRORS,
        "RDMA requests the peer answered with a protocol error.",
    ),
    (RDMA_TIMED_OUT, "RDMA requests that timed out."),
    (
        TCP_PAYLOAD_REQUESTS,
        "Requests whose payload moved inline on the TCP stream, by op and reason.",
    ),
    (
        TCP_PAYLOAD_BYTES,
        "Payload bytes moved inline on the TCP stream, by op and reason.",
    ),
    (
        REGISTRATIONS_POOLED,
        "RDMA buffers taken from the registered pool.",
    ),
    (
        REGISTRATIONS_PER_OP,
        "RDMA buffers registered for one operation (the pool was empty).",
    ),
    (
        REGISTRATION_FAILURES,
        "RDMA memory registrations that failed.",
    ),
    (ALLOCATION_FAILURES, "Buffer allocations that failed."),
    (LEASE_FAILURES, "Lease (token) failures."),
    (
        BUFFER_POOL_FREE,
        "Registered RDMA buffers free in the pool.",
    ),
    (BUFFER_POOL_IN_USE, "Registered RDMA buffers in use."),
    (
        BUFFER_POOL_PEAK,
        "Most registered RDMA buffers ever in use at once.",
    ),
    (
        RECONNECTS,
        "Control connections re-established after a loss.",
    ),
    (
        REQUEST_TIMEOUTS,
        "Requests that got no answer within the request timeout.",
    ),
    (
        REQUEST_RETRIES,
        "Idempotent requests sent again over a new connection.",
    ),
    (
        LATE_ANSWERS,
        "Answers that arrived after their request had timed out.",
    ),
    (
        PEER_RESTARTS,
        "Reconnects that found the peer restarted (a new store generation).",
    ),
    (
        REVOCATIONS_RECEIVED,
        "Lease revocations (REVOKE) the peer sent.",
    ),
    (
        REVOCATIONS_DROPPED,
        "Revocations dropped because the lease's owner did not collect them.",
    ),
    (
        FRAME_ERRORS,
        "Answer frames that could not be parsed, by the frame error's class.",
    ),
    (
        RESPONSE_ID_MISMATCHES,
        "Answers naming a request not in flight, or with another opcode.",
    ),
    (
        LENGTH_MISMATCHES,
        "Answers whose length differs from what their request asked for.",
    ),
];

/// The `# HELP` text of the family of statistic `name` (a well-known
/// one; others get a text that points to the documentation).
pub fn help(name: &str) -> &'static str {
    HELP.iter().find(|(n, _)| *n == name).map_or(
        "A statistic reported by the data path's driver; see docs/METRICS.md.",
        |(_, h)| h,
    )
}
/// Counters that indicate a problem: the summary prints one line for
/// each that is non-zero.
pub const PROBLEMS: &[&str] = &[
    RDMA_DECLINED_SERVED_TCP,
    RDMA_DECLINED_FAILED,
    RDMA_FAILED,
    RDMA_PROTOCOL_ERRORS,
    RDMA_TIMED_OUT,
    REGISTRATION_FAILURES,
    ALLOCATION_FAILURES,
    LEASE_FAILURES,
    FRAME_ERRORS,
    RESPONSE_ID_MISMATCHES,
    LENGTH_MISMATCHES,
];
