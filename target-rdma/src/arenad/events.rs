//! arenad's structured log events: the `event` field of every event only
//! arenad's server emits. The events arenad shares with ublkd (reloads,
//! the metrics endpoint, sessions, peers) and those of its store are in
//! `ublk_metrics::events`; no name is in both lists, and every name is
//! documented in `docs/` (both checked by
//! `target-rdma/tests/runbook_labels.rs`).

// arenad's process.
/// arenad opened its store and listens (listen, generation).
pub const ARENAD_READY: &str = "arenad.ready";
/// arenad got a stopping signal.
pub const SHUTDOWN_REQUESTED: &str = "shutdown.requested";
/// Every connection closed before the shutdown deadline.
pub const SHUTDOWN_DRAINED: &str = "shutdown.drained";
/// Connections still open at the shutdown deadline were cut.
pub const SHUTDOWN_CUT: &str = "shutdown.cut";
/// arenad flushed its store and stopped.
pub const ARENAD_STOPPED: &str = "arenad.stopped";

// RDMA on the server.
/// arenad registered the arena with an RDMA device.
pub const RDMA_ENABLED: &str = "rdma.enabled";
/// arenad has no usable RDMA device: clients asking for RDMA are declined and
/// use TCP.
pub const RDMA_DISABLED: &str = "rdma.disabled";
/// A client's RDMA request was declined (no device, or setting up its rail
/// failed); it uses TCP.
pub const RDMA_DECLINED: &str = "rdma.declined";
/// Registering a lease's RDMA key failed: answered without one (the client
/// moves its payload over TCP).
pub const RDMA_LEASE_KEY_FAILED: &str = "rdma.lease_key_failed";
/// A lease ended before its RDMA key was registered: answered without one.
pub const RDMA_LEASE_ENDED_UNKEYED: &str = "rdma.lease_ended_unkeyed";
/// A revoked lease was not given back in time: its RDMA key is deregistered.
pub const RDMA_LEASE_KEY_FORCE_ENDED: &str = "rdma.lease_key_force_ended";

// Connections.
/// Accepting a connection failed; arenad backs off and tries again.
pub const ACCEPT_FAILED: &str = "accept.failed";
/// A connection was closed right after accept (reason: `max_connections`
/// reached, or `max_unauthenticated` reached and its source held as many
/// handshake places as any other within one).
pub const CONNECTION_REFUSED: &str = "connection.refused";
/// A connection in its handshake, the oldest of the source holding the most
/// handshake places, was closed to give its place to a source holding fewer.
pub const CONNECTION_DISPLACED: &str = "connection.displaced";
/// A connection was accepted (debug).
pub const CONNECTION_ACCEPTED: &str = "connection.accepted";
/// An accepted connection was lost before it was served (debug).
pub const CONNECTION_LOST: &str = "connection.lost";
/// A connection closed without sending a frame: a port probe or health check
/// (debug).
pub const CONNECTION_PROBE: &str = "connection.probe";
/// A client did not read its answers in time (write deadline or a full REVOKE
/// queue): disconnected.
pub const CONNECTION_NOT_READING: &str = "connection.not_reading";
/// A connection was closed on an internal error of arenad.
pub const CONNECTION_INTERNAL_ERROR: &str = "connection.internal_error";

// Handshakes and protocol.
/// A client failed authentication (peer address, reason): a wrong secret or a
/// scan.
pub const AUTH_FAILED: &str = "auth.failed";
/// A client's HELLO was refused (status, detail: a protocol version or blob
/// size this arenad does not serve).
pub const HELLO_REFUSED: &str = "hello.refused";
/// A client sent a frame or request arenad could not accept; the connection is
/// closed.
pub const PROTOCOL_ERROR: &str = "protocol.error";
/// The store failed a request internally; the request gets an error.
pub const STORE_ERROR: &str = "store.error";

// Epochs.
/// A raised epoch ended the leases of older sessions of the volume.
pub const EPOCH_LEASES_FENCED: &str = "epoch.leases_fenced";
/// A raised epoch could not be persisted: the request or HELLO that raised it
/// is refused.
pub const EPOCH_PERSIST_FAILED: &str = "epoch.persist_failed";
/// One slot of the epochs file is damaged; the other holds the last saved
/// epochs, and the next save rewrites both.
pub const EPOCHS_SLOT_DAMAGED: &str = "epochs.slot_damaged";
/// A raise was saved in slot 0 of the epochs file but not copied to slot 1.
pub const EPOCHS_COPY_FAILED: &str = "epochs.copy_failed";

// Volumes at a reload.
/// A volume added to the configuration is served.
pub const VOLUME_SERVED: &str = "volume.served";
/// A volume removed from the configuration: new sessions are refused, open ones
/// go on, its blobs stay.
pub const VOLUME_UNSERVED: &str = "volume.unserved";
/// A volume's quota changed.
pub const VOLUME_QUOTA_CHANGED: &str = "volume.quota_changed";
/// A volume's secret changed: new sessions must prove the new one, open ones go
/// on.
pub const VOLUME_SECRET_CHANGED: &str = "volume.secret_changed";
/// A volume was made confidential (new sessions must be sealed, protocol
/// version 3) or no longer is; open sessions go on.
pub const VOLUME_CONFIDENTIAL_CHANGED: &str = "volume.confidential_changed";

// Swap reads of the workers.
/// A worker got no swap read ring of its own; its cold reads use the swap's
/// shared ring.
pub const SWAP_READ_RING_UNAVAILABLE: &str = "swap.read_ring_unavailable";

// The admin socket.
/// The admin socket listens (`arenactl` can reach this arenad).
pub const ADMIN_LISTENING: &str = "admin.listening";
/// The admin socket could not be set up: arenad serves without it.
pub const ADMIN_UNAVAILABLE: &str = "admin.unavailable";
/// An admin connection could not be accepted or given a thread.
pub const ADMIN_CONNECTION_FAILED: &str = "admin.connection_failed";
/// An operator ended a session (`arenactl disconnect`).
pub const SESSION_DISCONNECTED: &str = "session.disconnected";

/// Every event name above.
pub const ALL: &[&str] = &[
    // arenad's process.
    ARENAD_READY,
    SHUTDOWN_REQUESTED,
    SHUTDOWN_DRAINED,
    SHUTDOWN_CUT,
    ARENAD_STOPPED,
    // RDMA on the server.
    RDMA_ENABLED,
    RDMA_DISABLED,
    RDMA_DECLINED,
    RDMA_LEASE_KEY_FAILED,
    RDMA_LEASE_ENDED_UNKEYED,
    RDMA_LEASE_KEY_FORCE_ENDED,
    // Connections.
    ACCEPT_FAILED,
    CONNECTION_REFUSED,
    CONNECTION_DISPLACED,
    CONNECTION_ACCEPTED,
    CONNECTION_LOST,
    CONNECTION_PROBE,
    CONNECTION_NOT_READING,
    CONNECTION_INTERNAL_ERROR,
    // Handshakes and protocol.
    AUTH_FAILED,
    HELLO_REFUSED,
    PROTOCOL_ERROR,
    STORE_ERROR,
    // Epochs.
    EPOCH_LEASES_FENCED,
    EPOCH_PERSIST_FAILED,
    EPOCHS_SLOT_DAMAGED,
    EPOCHS_COPY_FAILED,
    // Volumes at a reload.
    VOLUME_SERVED,
    VOLUME_UNSERVED,
    VOLUME_QUOTA_CHANGED,
    VOLUME_SECRET_CHANGED,
    VOLUME_CONFIDENTIAL_CHANGED,
    // Swap reads of the workers.
    SWAP_READ_RING_UNAVAILABLE,
    // The admin socket.
    ADMIN_LISTENING,
    ADMIN_UNAVAILABLE,
    ADMIN_CONNECTION_FAILED,
    SESSION_DISCONNECTED,
];
