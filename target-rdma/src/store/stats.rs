//! A point-in-time view of the store, for metrics.

use super::error::IntegrityKind;

/// A point-in-time view of the store for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Arena slots.
    pub slots_total: u64,
    /// Slots holding no blob.
    pub slots_free: u64,
    /// Unpinned slots equal to their swap copy.
    pub slots_clean: u64,
    /// Unpinned slots newer than their swap copy.
    pub slots_dirty: u64,
    /// Slots pinned by a lease or an inline copy.
    pub slots_leased: u64,
    /// Outstanding leases.
    pub leases_held: u64,
    /// Leases asked back through the revoke hook.
    pub revocations: u64,
    /// Revoked leases not given back within the revoke deadline, ended by
    /// force.
    pub leases_force_ended: u64,
    /// Blobs dropped from RAM to make room.
    pub evictions: u64,
    /// Slots written to swap.
    pub write_backs: u64,
    /// Blobs read back from swap.
    pub fault_ins: u64,
    /// Bytes read from swap.
    pub swap_bytes_read: u64,
    /// Bytes written to swap.
    pub swap_bytes_written: u64,
    /// Swap extents holding a blob image.
    pub swap_extents_used: u64,
    /// Swap extents.
    pub swap_extents_total: u64,
    /// Completed FLUSH calls.
    pub flushes: u64,
    /// Journal records appended.
    pub journal_records: u64,
    /// Checkpoints written (including the one at open).
    pub checkpoints: u64,
    /// Whether swap I/O bypasses the page cache.
    pub direct_io: bool,
    /// Reads refused because their bytes did not verify, by
    /// [`IntegrityKind::index`].
    pub integrity_errors: [u64; IntegrityKind::COUNT],
}
