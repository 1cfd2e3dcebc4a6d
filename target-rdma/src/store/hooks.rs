//! The callbacks a store's owner installs to hear of index writes and of
//! leases the store wants back.

use super::ids::{HolderId, VolumeId};

/// Which durable index write a timing belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexWrite {
    /// A journal append, fsync included (once per FLUSH that had records).
    Journal,
    /// A checkpoint: a slot written in place and fsynced.
    Checkpoint,
}

/// Told the duration of each index write; runs under the store lock, so it
/// must only record (e.g. into a histogram).
pub type TimingHook = Box<dyn Fn(IndexWrite, std::time::Duration) + Send + Sync>;

/// Called once per lease the store wants back: (holder, volume, key, token).
pub type RevokeHook = Box<dyn Fn(HolderId, VolumeId, u64, u64) + Send + Sync>;
