//! Stable structured log events.
//!
//! Event names are part of the operator contract (the runbook searches for
//! them), so every `event` field is one of these constants, and the events
//! with fixed fields have one helper each. Correlation ids link events of
//! one request; no helper takes payloads, keys, addresses or secrets.
//!
//! This module names every event of ublkd's process (the daemon, the
//! client, replica and block code of `target-rdma` it runs, and this
//! crate), the events both daemons emit, and the events of arenad's store
//! (which names no arenad module). The events only arenad's server emits
//! are in `target_rdma::arenad::events`; no name is in both lists, and
//! every name is documented in `docs/` (both checked by
//! `target-rdma/tests/runbook_labels.rs`).

use crate::correlation::CorrelationId;
use crate::json_line::JsonLine;
use crate::labels::{ErrnoClass, IoOp, Phase, Reason, Transport};
use std::time::Duration;
use thiserror::Error;

// Logical requests (ublkd).
/// A logical block request failed (completed to the kernel with an error).
pub const REQUEST_FAILED: &str = "request.failed";
/// A request completed after more than the slow threshold.
pub const REQUEST_SLOW: &str = "request.slow";
/// A request crossed the stall threshold while still pending (logged once).
pub const REQUEST_STUCK: &str = "request.stuck";
/// The error behind a failed request, at debug beside `request.failed` (which
/// carries only bounded classes).
pub const REQUEST_ERROR: &str = "request.error";
/// A request was refused before it reached the target: an op ublkd does not
/// serve, or a descriptor that makes no sense.
pub const REQUEST_REJECTED: &str = "request.rejected";

// Physical attempts and transports (ublkd).
/// One physical attempt failed (the request may still succeed).
pub const ATTEMPT_FAILED: &str = "attempt.failed";
/// A request moved from one transport to another.
pub const TRANSPORT_FAILOVER: &str = "transport.failover";

// Traces (ublkd).
/// A retained request's root span ([`crate::trace`]).
pub const SPAN_REQUEST: &str = "span.request";
/// One attempt of a retained request: a child span.
pub const SPAN_ATTEMPT: &str = "span.attempt";

// The arena protocol, as ublkd's client reads it.
/// The arena client got a frame it could not parse (bad magic, version,
/// reserved bits, opcode, status, length); the connection is closed.
pub const PROTOCOL_FRAME_ERROR: &str = "protocol.frame_error";
/// An answer named a request that is not in flight (never sent, already
/// answered) or answered it with another opcode; the connection is closed.
pub const PROTOCOL_RESPONSE_ID_MISMATCH: &str = "protocol.response_id_mismatch";
/// An answer carried another length than its request asked for; the request
/// fails.
pub const PROTOCOL_LENGTH_MISMATCH: &str = "protocol.length_mismatch";

// Arena peers and sessions (both daemons: ublkd's client, arenad's server).
/// An arena connection was lost: ublkd's connection to its peer (warn), or a
/// client's connection to arenad (debug).
pub const PEER_DISCONNECTED: &str = "peer.disconnected";
/// The arena peer came back with a new generation: it restarted, and the client
/// replays what its flush domain needs.
pub const PEER_RESTARTED: &str = "peer.restarted";
/// Every link of a device's peer is up again after a disconnection.
pub const PEER_RECONNECTED: &str = "peer.reconnected";
/// Waiting for an arena TCP connection's socket to become readable failed: that
/// connection is failed.
pub const PEER_POLL_FAILED: &str = "peer.poll_failed";
/// A session was authenticated: arenad (info) names the volume, generation,
/// epoch and whether RDMA was granted; ublkd's client logs it at debug.
pub const SESSION_OPENED: &str = "session.opened";

// RDMA, as ublkd's client uses it.
/// The RDMA path to a peer cannot be used (no device, not granted): payloads go
/// over TCP.
pub const RDMA_UNAVAILABLE: &str = "rdma.unavailable";
/// An RDMA rail to a peer connected.
pub const RDMA_RAIL_UP: &str = "rdma.rail_up";
/// Connecting an RDMA rail to a peer failed; payloads go over TCP until it
/// reconnects.
pub const RDMA_RAIL_FAILED: &str = "rdma.rail_failed";
/// An RDMA rail's QP failed under load (an error completion, a timeout): its
/// transfers move to the other rail, or over TCP; it is tried again after
/// a wait that doubles while it keeps failing.
pub const RDMA_RAIL_LOST: &str = "rdma.rail_lost";
/// An RDMA transfer failed; it is retried once, then the request moves to TCP.
pub const RDMA_ATTEMPT_FAILED: &str = "rdma.attempt_failed";
/// A write's lease was taken back by the server (a racing DISCARD): the write
/// is done again.
pub const RDMA_LEASE_LOST: &str = "rdma.lease_lost";
/// Waiting for the RDMA completion queue's event failed.
pub const RDMA_POLL_FAILED: &str = "rdma.poll_failed";
/// Registering memory with the RDMA device failed: a queue's buffers (payloads
/// then bounce through the registered pool) or a request's own (it moves over
/// TCP).
pub const RDMA_REGISTER_FAILED: &str = "rdma.register_failed";

// Configuration and logging (both daemons).
/// A reload applied a changed key (key, old, new).
pub const CONFIG_CHANGED: &str = "config.changed";
/// A reload found a changed key that takes effect only after a restart.
pub const CONFIG_RESTART_NEEDED: &str = "config.restart_needed";
/// A reload finished; the new configuration is in force.
pub const CONFIG_RELOADED: &str = "config.reloaded";
/// A reload was refused (the file does not read or validate): the running
/// configuration stays.
pub const CONFIG_RELOAD_FAILED: &str = "config.reload_failed";
/// A reload's `log_level` is not applied because `RUST_LOG` overrides it.
pub const CONFIG_LOG_LEVEL_IGNORED: &str = "config.log_level_ignored";
/// The log filter could not be swapped at a reload.
pub const CONFIG_LOG_LEVEL_FAILED: &str = "config.log_level_failed";

// The metrics endpoint (both daemons).
/// The metrics and health endpoint listens (addr).
pub const METRICS_LISTENING: &str = "metrics.listening";
/// The metrics endpoint could not listen: the daemon runs without `/metrics`
/// and health checks.
pub const METRICS_LISTEN_FAILED: &str = "metrics.listen_failed";
/// The metrics endpoint could not accept a connection; it pauses accepting
/// (logged at most once per interval).
pub const METRICS_ACCEPT_FAILED: &str = "metrics.accept_failed";

// ublkd's process.
/// ublkd restored its devices and serves the control socket.
pub const UBLKD_READY: &str = "ublkd.ready";
/// ublkd got a stopping signal and shuts down.
pub const UBLKD_SIGNAL: &str = "ublkd.signal";
/// ublkd finished its shutdown (devices kept or removed per `on_shutdown`).
pub const UBLKD_EXIT: &str = "ublkd.exit";
/// Telling systemd that ublkd is ready failed.
pub const SD_NOTIFY_FAILED: &str = "sd_notify.failed";

// The control socket (ublkd).
/// A control socket request was parsed (debug).
pub const CTL_REQUEST: &str = "ctl.request";
/// The control socket could not accept a connection.
pub const CTL_ACCEPT_FAILED: &str = "ctl.accept_failed";
/// No thread could be started to serve a control connection; it is dropped.
pub const CTL_SPAWN_FAILED: &str = "ctl.spawn_failed";

// Devices (ublkd).
/// A device is started and serves I/O.
pub const DEVICE_LIVE: &str = "device.live";
/// A device's kernel start did not finish in time; the add fails.
pub const DEVICE_START_TIMEOUT: &str = "device.start_timeout";
/// A device's metrics could not be registered; the device serves without them.
pub const DEVICE_METRICS_FAILED: &str = "device.metrics_failed";
/// A persisted device is being brought back: recovered when the kernel still
/// holds it, else added again under its id.
pub const DEVICE_BRING_BACK: &str = "device.bring_back";
/// A persisted device is back after a restart or a retry.
pub const DEVICE_RESTORED: &str = "device.restored";
/// A replicated device waits for etcd to come back before it is restored;
/// retried with a backoff.
pub const DEVICE_RESTORE_WAITING: &str = "device.restore_waiting";
/// A persisted device could not be brought back; it is listed as failed
/// (`ublkctl recover`).
pub const DEVICE_RESTORE_FAILED: &str = "device.restore_failed";
/// A device's persisted spec file does not read; that device is not restored.
pub const DEVICE_SPEC_UNREADABLE: &str = "device.spec_unreadable";
/// A device's spec could not be saved: after a restart it comes back with its
/// previous role.
pub const DEVICE_SAVE_FAILED: &str = "device.save_failed";
/// Whether a device is in use could not be checked before its removal.
pub const DEVICE_BUSY_CHECK_FAILED: &str = "device.busy_check_failed";
/// The kernel device could not be stopped.
pub const DEVICE_STOP_FAILED: &str = "device.stop_failed";
/// A device's queues stopped serving.
pub const DEVICE_STOPPED: &str = "device.stopped";
/// A device was removed.
pub const DEVICE_DELETED: &str = "device.deleted";
/// A device could not be removed at shutdown (`on_shutdown = "remove"`).
pub const DEVICE_REMOVE_FAILED: &str = "device.remove_failed";
/// A device's flush at shutdown failed: its last writes may not be on the
/// arena.
pub const DEVICE_FLUSH_FAILED: &str = "device.flush_failed";
/// A device was flushed and left to the kernel at shutdown (`on_shutdown =
/// "keep"`).
pub const DEVICE_KEPT: &str = "device.kept";
/// A live device grew to a new size.
pub const DEVICE_RESIZED: &str = "device.resized";
/// A device could not grow; its old size stays.
pub const DEVICE_RESIZE_FAILED: &str = "device.resize_failed";
/// A standby device took the writer role (`ublkctl activate`).
pub const DEVICE_ACTIVATED: &str = "device.activated";
/// A device handed its writer role to a standby (`ublkctl release`).
pub const DEVICE_RELEASED: &str = "device.released";
/// A device took the writer role without a hand-over (the old writer is
/// fenced).
pub const DEVICE_TAKEN_OVER: &str = "device.taken_over";
/// A replicated device's role (writer or standby) changed and was saved.
pub const DEVICE_ROLE_CHANGED: &str = "device.role_changed";

// Queues (ublkd).
/// A queue's wake-up eventfd could not be made; the queue does not start.
pub const QUEUE_EVENTFD_FAILED: &str = "queue.eventfd_failed";
/// A ublk queue could not be created; the queue does not start.
pub const QUEUE_CREATE_FAILED: &str = "queue.create_failed";
/// A queue tag has no I/O buffer large enough; the tag does not serve.
pub const QUEUE_NO_BUFFER: &str = "queue.no_buffer";
/// A queue thread found no client for its queue; it does not serve.
pub const QUEUE_NO_CLIENT: &str = "queue.no_client";
/// A queue tag's task ended with an error; that tag no longer serves.
pub const QUEUE_TAG_FAILED: &str = "queue.tag_failed";
/// Waiting on a queue's wake-up eventfd failed; the queue's waker stops.
pub const QUEUE_WAKE_POLL_FAILED: &str = "queue.wake_poll_failed";
/// A queue's event loop ended with an error.
pub const QUEUE_LOOP_FAILED: &str = "queue.loop_failed";
/// A queue's thread finished.
pub const QUEUE_STOPPED: &str = "queue.stopped";
/// A queue thread was pinned to its CPU (`queue_affinity`).
pub const QUEUE_PINNED: &str = "queue.pinned";
/// A queue thread could not be pinned to its CPU; it runs unpinned.
pub const QUEUE_PIN_FAILED: &str = "queue.pin_failed";
/// A request could not be entered in the in-flight tracker (a bug); it is still
/// counted.
pub const TRACKER_FAILED: &str = "tracker.failed";

// etcd coordination (ublkd).
/// ublkd is connected to etcd and holds its writer lease.
pub const ETCD_READY: &str = "etcd.ready";
/// ublkd could not reach etcd; it keeps trying, and replicated devices wait.
pub const ETCD_START_FAILED: &str = "etcd.start_failed";

// The writer lease of replicated volumes (ublkd).
/// etcd granted ublkd a new writer lease.
pub const WRITER_LEASE_GRANTED: &str = "writer.lease_granted";
/// ublkd adopted the writer lease a previous ublkd on this host left (after a
/// restart).
pub const WRITER_LEASE_ADOPTED: &str = "writer.lease_adopted";
/// The lease id could not be saved: the next ublkd cannot adopt the lease and
/// takes a new one.
pub const WRITER_LEASE_FILE_FAILED: &str = "writer.lease_file_failed";
/// A keep-alive of the writer lease did not reach etcd; the lease lapses if
/// this goes on.
pub const WRITER_KEEPALIVE_FAILED: &str = "writer.keepalive_failed";
/// etcd lost the writer lease: ublkd takes its volumes back under a new one.
pub const WRITER_LEASE_LOST: &str = "writer.lease_lost";
/// A volume was taken back under the new lease after the old one was lost.
pub const WRITER_RETAKEN: &str = "writer.retaken";
/// Taking a volume back after a lost lease failed this round; retried.
pub const WRITER_RETAKE_FAILED: &str = "writer.retake_failed";
/// Another ublkd took the volume while the writer lease was lost: this host no
/// longer writes it.
pub const WRITER_FENCED: &str = "writer.fenced";
/// ublkd became the volume's writer in etcd.
pub const WRITER_ACQUIRED: &str = "writer.acquired";
/// Moving a held volume's writer key to the new lease failed.
pub const WRITER_RENAME_FAILED: &str = "writer.rename_failed";
/// A standby asked the volume's writer to hand the role over.
pub const WRITER_HANDOVER_ASKED: &str = "writer.handover_asked";
/// This host handed the volume's writer role to another.
pub const WRITER_HANDED_OVER: &str = "writer.handed_over";
/// ublkd gave up the volume's writer key.
pub const WRITER_RELEASED: &str = "writer.released";
/// Giving up the volume's writer key failed; it lapses with the lease.
pub const WRITER_RELEASE_FAILED: &str = "writer.release_failed";

// Membership of replicated volumes (ublkd).
/// A replicated volume's membership record was created in etcd.
pub const MEMBERSHIP_CREATED: &str = "membership.created";
/// A replicated volume's membership changed (a member out, a rebuild done),
/// with a new epoch.
pub const MEMBERSHIP_CHANGED: &str = "membership.changed";

// Replica sets (ublkd).
/// A new replicated volume's members were placed on peers.
pub const REPLICAS_PLACED: &str = "replicas.placed";
/// A replicated device opened sessions to its members.
pub const REPLICAS_OPENED: &str = "replicas.opened";
/// A member was taken out of a replicated volume (reason): it no longer gets
/// writes.
pub const REPLICAS_MEMBER_OUT: &str = "replicas.member_out";
/// A standby took the writer role after a hand-over (took_ms).
pub const REPLICA_ACTIVATED: &str = "replica.activated";
/// The writer handed its role to a standby (took_ms).
pub const REPLICA_RELEASED: &str = "replica.released";
/// Handing the writer role over failed; this host keeps it unless it was
/// fenced.
pub const REPLICA_RELEASE_FAILED: &str = "replica.release_failed";
/// Serving a standby's hand-over request failed.
pub const REPLICA_HANDOVER_FAILED: &str = "replica.handover_failed";
/// The writer role was taken without a hand-over.
pub const REPLICA_TAKEN_OVER: &str = "replica.taken_over";
/// The writer took its role back under a new lease (epoch raised).
pub const REPLICA_ROLE_REGAINED: &str = "replica.role_regained";
/// Confirming a role taken back under a new lease failed; checked again.
pub const REPLICA_ROLE_CHECK_FAILED: &str = "replica.role_check_failed";
/// The replica set was fenced (another writer took over): its writes fail from
/// now on.
pub const REPLICA_FENCED: &str = "replica.fenced";

// Rebuilds (ublkd).
/// A rebuild onto a spare peer started.
pub const REBUILD_STARTED: &str = "rebuild.started";
/// A rebuild finished; the new member is in the membership.
pub const REBUILD_DONE: &str = "rebuild.done";
/// A rebuild failed; it is retried after a backoff (retry_in_ms).
pub const REBUILD_FAILED: &str = "rebuild.failed";
/// A rebuild stopped because the device stopped.
pub const REBUILD_ABANDONED: &str = "rebuild.abandoned";
/// No spare peer fits the volume's placement; the rebuild waits for one.
pub const REBUILD_NO_SPARE: &str = "rebuild.no_spare";
/// Looking up a spare peer in etcd failed; retried.
pub const REBUILD_SPARE_LOOKUP_FAILED: &str = "rebuild.spare_lookup_failed";
/// The spare peer of a rebuild could not be reached; retried.
pub const REBUILD_PEER_UNREACHABLE: &str = "rebuild.peer_unreachable";
/// The device's rebuild thread could not be started: its volume is not rebuilt.
pub const REBUILD_SPAWN_FAILED: &str = "rebuild.spawn_failed";

// arenad's store (the store code names no arenad module, so its events live here).
/// The files of a store whose creation was cut short were found: the store is
/// created again.
pub const STORE_CREATION_RESUMED: &str = "store_creation_resumed";
/// `arenad --repair` rebuilt the index from the extent headers.
pub const STORE_REPAIRED: &str = "store.repaired";
/// A configured volume was added to the store.
pub const VOLUME_ADDED: &str = "volume.added";
/// The store keeps the blobs of a persisted volume no longer configured.
pub const VOLUME_NOT_CONFIGURED: &str = "volume_not_configured";
/// The journal of the previous checkpoint was ignored at open (a crash came
/// between checkpoint and journal reset).
pub const JOURNAL_STALE: &str = "journal_stale";
/// A torn last journal batch past the synced mark was dropped at open (a
/// commit cut short by a crash, never acknowledged).
pub const JOURNAL_TORN_TAIL: &str = "journal_torn_tail";
/// The journal header's synced mark could not be written or synced: a later
/// loss of the batches it would name goes unnoticed at start.
pub const JOURNAL_MARK_FAILED: &str = "journal_mark_failed";
/// The checkpoint slot not in use is damaged (a checkpoint cut short, or
/// damage); the start's checkpoint overwrites it.
pub const CHECKPOINT_SLOT_DAMAGED: &str = "checkpoint_slot_damaged";
/// Resetting the journal after a checkpoint failed; retried at the next append.
pub const JOURNAL_RESET_FAILED: &str = "journal_reset_failed";
/// The extent table's damaged header was rewritten at open.
pub const EXTENT_TABLE_HEADER_REWRITTEN: &str = "extent_table_header_rewritten";
/// A freed extent's header could not be cleared: `arenad --repair` might bring
/// back its old image.
pub const EXTENT_HEADER_CLEAR_FAILED: &str = "extent_header_clear_failed";
/// A sync of the swap file or its extent table failed: no FLUSH succeeds until
/// arenad restarts.
pub const SWAP_SYNC_FAILED: &str = "swap.sync_failed";
/// The swap file cannot use direct I/O; it goes through the page cache.
pub const SWAP_DIRECT_IO_UNAVAILABLE: &str = "swap_direct_io_unavailable";
/// A blob's swap image does not match its header: its reads fail until it is
/// rewritten, removed or repaired.
pub const SWAP_EXTENT_HEADER_INVALID: &str = "swap.extent_header_invalid";
/// More blobs than are logged one by one have a swap image that does not match
/// its header (count).
pub const SWAP_EXTENT_HEADERS_INVALID: &str = "swap.extent_headers_invalid";
/// Bytes read from the swap did not verify: the read is refused rather than
/// served.
pub const SWAP_INTEGRITY_ERROR: &str = "swap.integrity_error";
/// Submitting swap reads to the ring failed; the next submission carries them.
pub const SWAP_READ_SUBMIT_FAILED: &str = "swap.read_submit_failed";
/// Waiting for swap read completions failed; completions are reaped at the next
/// wait.
pub const SWAP_READ_WAIT_FAILED: &str = "swap.read_wait_failed";
/// Draining a swap read ring at close failed with reads in flight.
pub const SWAP_READ_DRAIN_FAILED: &str = "swap.read_drain_failed";
/// A worker's swap read lane failed; its cold reads fail.
pub const SWAP_READ_LANE_FAILED: &str = "swap.read_lane_failed";
/// A swap read ring's close could not be queued.
pub const SWAP_READS_CLOSE_FAILED: &str = "swap.reads_close_failed";
/// A read-ahead failed; readers fault the blobs in themselves.
pub const READ_AHEAD_FAILED: &str = "read_ahead_failed";
/// A read-ahead image failed its check and was dropped (the reader's own
/// fault-in reports it).
pub const READ_AHEAD_UNVERIFIED: &str = "read_ahead_unverified";
/// The background write-back could not be planned or failed; the slots stay
/// dirty.
pub const CLEANER_FAILED: &str = "cleaner_failed";
/// A store background thread (write-back or read-ahead) panicked.
pub const CLEANER_PANICKED: &str = "cleaner_panicked";

/// Every event name above.
pub const ALL: &[&str] = &[
    // Logical requests (ublkd).
    REQUEST_FAILED,
    REQUEST_SLOW,
    REQUEST_STUCK,
    REQUEST_ERROR,
    REQUEST_REJECTED,
    // Physical attempts and transports (ublkd).
    ATTEMPT_FAILED,
    TRANSPORT_FAILOVER,
    // Traces (ublkd).
    SPAN_REQUEST,
    SPAN_ATTEMPT,
    // The arena protocol, as ublkd's client reads it.
    PROTOCOL_FRAME_ERROR,
    PROTOCOL_RESPONSE_ID_MISMATCH,
    PROTOCOL_LENGTH_MISMATCH,
    // Arena peers and sessions (both daemons: ublkd's client, arenad's server).
    PEER_DISCONNECTED,
    PEER_RESTARTED,
    PEER_RECONNECTED,
    PEER_POLL_FAILED,
    SESSION_OPENED,
    // RDMA, as ublkd's client uses it.
    RDMA_UNAVAILABLE,
    RDMA_RAIL_UP,
    RDMA_RAIL_FAILED,
    RDMA_RAIL_LOST,
    RDMA_ATTEMPT_FAILED,
    RDMA_LEASE_LOST,
    RDMA_POLL_FAILED,
    RDMA_REGISTER_FAILED,
    // Configuration and logging (both daemons).
    CONFIG_CHANGED,
    CONFIG_RESTART_NEEDED,
    CONFIG_RELOADED,
    CONFIG_RELOAD_FAILED,
    CONFIG_LOG_LEVEL_IGNORED,
    CONFIG_LOG_LEVEL_FAILED,
    // The metrics endpoint (both daemons).
    METRICS_LISTENING,
    METRICS_LISTEN_FAILED,
    METRICS_ACCEPT_FAILED,
    // ublkd's process.
    UBLKD_READY,
    UBLKD_SIGNAL,
    UBLKD_EXIT,
    SD_NOTIFY_FAILED,
    // The control socket (ublkd).
    CTL_REQUEST,
    CTL_ACCEPT_FAILED,
    CTL_SPAWN_FAILED,
    // Devices (ublkd).
    DEVICE_LIVE,
    DEVICE_START_TIMEOUT,
    DEVICE_METRICS_FAILED,
    DEVICE_BRING_BACK,
    DEVICE_RESTORED,
    DEVICE_RESTORE_WAITING,
    DEVICE_RESTORE_FAILED,
    DEVICE_SPEC_UNREADABLE,
    DEVICE_SAVE_FAILED,
    DEVICE_BUSY_CHECK_FAILED,
    DEVICE_STOP_FAILED,
    DEVICE_STOPPED,
    DEVICE_DELETED,
    DEVICE_REMOVE_FAILED,
    DEVICE_FLUSH_FAILED,
    DEVICE_KEPT,
    DEVICE_RESIZED,
    DEVICE_RESIZE_FAILED,
    DEVICE_ACTIVATED,
    DEVICE_RELEASED,
    DEVICE_TAKEN_OVER,
    DEVICE_ROLE_CHANGED,
    // Queues (ublkd).
    QUEUE_EVENTFD_FAILED,
    QUEUE_CREATE_FAILED,
    QUEUE_NO_BUFFER,
    QUEUE_NO_CLIENT,
    QUEUE_TAG_FAILED,
    QUEUE_WAKE_POLL_FAILED,
    QUEUE_LOOP_FAILED,
    QUEUE_STOPPED,
    QUEUE_PINNED,
    QUEUE_PIN_FAILED,
    TRACKER_FAILED,
    // etcd coordination (ublkd).
    ETCD_READY,
    ETCD_START_FAILED,
    // The writer lease of replicated volumes (ublkd).
    WRITER_LEASE_GRANTED,
    WRITER_LEASE_ADOPTED,
    WRITER_LEASE_FILE_FAILED,
    WRITER_KEEPALIVE_FAILED,
    WRITER_LEASE_LOST,
    WRITER_RETAKEN,
    WRITER_RETAKE_FAILED,
    WRITER_FENCED,
    WRITER_ACQUIRED,
    WRITER_RENAME_FAILED,
    WRITER_HANDOVER_ASKED,
    WRITER_HANDED_OVER,
    WRITER_RELEASED,
    WRITER_RELEASE_FAILED,
    // Membership of replicated volumes (ublkd).
    MEMBERSHIP_CREATED,
    MEMBERSHIP_CHANGED,
    // Replica sets (ublkd).
    REPLICAS_PLACED,
    REPLICAS_OPENED,
    REPLICAS_MEMBER_OUT,
    REPLICA_ACTIVATED,
    REPLICA_RELEASED,
    REPLICA_RELEASE_FAILED,
    REPLICA_HANDOVER_FAILED,
    REPLICA_TAKEN_OVER,
    REPLICA_ROLE_REGAINED,
    REPLICA_ROLE_CHECK_FAILED,
    REPLICA_FENCED,
    // Rebuilds (ublkd).
    REBUILD_STARTED,
    REBUILD_DONE,
    REBUILD_FAILED,
    REBUILD_ABANDONED,
    REBUILD_NO_SPARE,
    REBUILD_SPARE_LOOKUP_FAILED,
    REBUILD_PEER_UNREACHABLE,
    REBUILD_SPAWN_FAILED,
    // arenad's store (the store code names no arenad module, so its events live here).
    STORE_CREATION_RESUMED,
    STORE_REPAIRED,
    VOLUME_ADDED,
    VOLUME_NOT_CONFIGURED,
    JOURNAL_STALE,
    JOURNAL_TORN_TAIL,
    JOURNAL_MARK_FAILED,
    CHECKPOINT_SLOT_DAMAGED,
    JOURNAL_RESET_FAILED,
    EXTENT_TABLE_HEADER_REWRITTEN,
    EXTENT_HEADER_CLEAR_FAILED,
    SWAP_SYNC_FAILED,
    SWAP_DIRECT_IO_UNAVAILABLE,
    SWAP_EXTENT_HEADER_INVALID,
    SWAP_EXTENT_HEADERS_INVALID,
    SWAP_INTEGRITY_ERROR,
    SWAP_READ_SUBMIT_FAILED,
    SWAP_READ_WAIT_FAILED,
    SWAP_READ_DRAIN_FAILED,
    SWAP_READ_LANE_FAILED,
    SWAP_READS_CLOSE_FAILED,
    READ_AHEAD_FAILED,
    READ_AHEAD_UNVERIFIED,
    CLEANER_FAILED,
    CLEANER_PANICKED,
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
                event = CONFIG_LOG_LEVEL_IGNORED,
                log_level = %log_level,
                "RUST_LOG is set and overrides log_level"
            ),
            (filter, FilterSource::Config) => {
                if let Err(e) = self.set_filter(&filter) {
                    tracing::error!(event = CONFIG_LOG_LEVEL_FAILED, error = %e);
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
                .event_format(JsonLine)
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
        .event_format(JsonLine)
        .finish()
}
