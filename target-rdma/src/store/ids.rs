//! The names the store gives volumes, connections and blobs.

/// Index into the `volumes` slice given to [`Store::open`](super::Store::open).
pub type VolumeId = u32;
/// A connection; owns leases.
pub type HolderId = u64;
/// A blob: its volume and key.
pub(super) type BlobKey = (VolumeId, u64);
