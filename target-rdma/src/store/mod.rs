//! The storage engine of `arenad`: RAM arena slots in front of a swap file,
//! with a persistent (volume, key) -> extent index.
//!
//! One mutex guards the bookkeeping; slot bytes have their own per-slot
//! locks so that connection threads copy payloads without holding the store
//! lock. Lock order is store lock, then slot lock, never the reverse: code
//! holding a slot lock never takes the store lock.
//!
//! Swap I/O runs without the store lock (see [`engine`]): a slot being
//! faulted in or written back is pinned and marked in transition under the
//! lock, moved with only its slot lock held, and settled under the lock
//! again. A background thread writes dirty slots back ahead of demand, so
//! that eviction usually finds a clean victim, and reads ahead of a
//! sequential reader, so that its disk reads overlap the network.
//!
//! Nothing read from disk is served unverified: every swap extent has a
//! header (volume, key, write version, a CRC32C per 4 KiB block) in
//! [`extent`]'s side table, checked on every read from swap; the index files
//! are checksummed block by block and refused when damaged ([`index`]); and
//! `arenad --repair` ([`Store::repair`]) rebuilds a lost index from the
//! headers. Every file's space is reserved up front ([`space`]), so a full
//! filesystem never stops a FLUSH or a restart.

mod aligned;
mod api;
mod arena;
mod check;
mod checkpoint;
mod config;
mod dir;
pub(crate) mod disk;
mod engine;
mod error;
mod eviction;
mod extent;
#[cfg(test)]
pub(crate) mod faults;
mod format;
pub mod fuzzing;
mod hooks;
mod ids;
mod in_process;
mod index;
mod journal;
mod repair;
mod residency;
mod space;
mod stats;
mod swap;
mod swap_reads;
#[cfg(test)]
mod tests;

pub use api::Store;
pub use check::StoreCheck;
pub use config::{
    footprint, StoreConfig, VolumeSpec, DEFAULT_SWAP_READS_IN_FLIGHT, MAX_SWAP_READS_IN_FLIGHT,
};
pub use engine::{ForceEndHook, LeaseLimits, DEFAULT_REVOKE_DEADLINE_MS};
pub use error::{IntegrityKind, LostCause, Refusal, StoreError};
pub use hooks::{IndexWrite, RevokeHook, TimingHook};
pub use ids::{HolderId, VolumeId};
pub use in_process::InProcess;
pub use repair::{BlobRef, RepairReport};
pub use residency::{Immediate, Residency};
pub use stats::{StoreStats, VolumeUsage};

/// What the benchmarks time inside the store (feature `bench-hooks`, which
/// only benches and tests turn on).
#[cfg(feature = "bench-hooks")]
#[doc(hidden)]
pub mod bench_hooks {
    use super::extent::{self, Ident};
    use super::format::Version;

    /// The checksums a read from swap computes to check `bytes` (whole
    /// 4 KiB blocks) against their extent header: the cost of the check.
    pub fn extent_checksums(bytes: &[u8]) -> Vec<u32> {
        let id = Ident {
            volume: 1,
            key: 2,
            version: Version::default(),
        };
        extent::block_crcs(&id, 0, bytes)
    }
}
