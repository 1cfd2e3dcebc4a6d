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

/// A volume's (blobs, resident, on swap), as the store's tests compare
/// them.
#[cfg(test)]
pub(crate) type BlobCounts = (u64, u64, u64);

/// One volume's share of the store, for `arenactl volumes` and the
/// per-volume metrics: counted as blobs move, so reading it costs one
/// entry per volume, whatever the store holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeUsage {
    /// The volume's name.
    pub name: String,
    /// Configured; `false` for a volume kept only from the persisted index.
    pub served: bool,
    /// Most distinct blobs it may hold.
    pub quota_blobs: u64,
    /// Blobs it holds.
    pub blobs: u64,
    /// Of those, blobs with a slot in the arena.
    pub resident: u64,
    /// Of those, blobs with a complete swap image (a clean resident blob
    /// is both).
    pub on_swap: u64,
    /// Leases pinning one of its slots.
    pub leases: u64,
}
