//! Why a store operation failed ([`StoreError`]), how each failure reads
//! on the wire ([`StoreError::status`]: one mapping, used by the server for
//! its answers and by the in-process transport for its errors, so a client
//! sees the same failure as the same status whatever carried it), and the
//! constructors of the errors the store's files report. The bottom of the
//! store: every other file may build on it.

use std::io;
use std::path::{Path, PathBuf};

use super::format::FORMAT_VERSION;
use super::ids::VolumeId;
use crate::proto::Status;

/// What failed when bytes read from swap did not verify.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntegrityKind {
    /// A block's bytes fail their CRC32C (flipped bits, a torn or foreign
    /// write, an extent moved): the payload is not the image the header
    /// describes.
    Checksum,
    /// The extent's header is missing or damaged, or names another volume,
    /// key or version than the index: the extent holds some other image.
    Header,
}

impl IntegrityKind {
    /// Number of kinds.
    pub const COUNT: usize = 2;
    /// Every kind, in [`IntegrityKind::index`] order.
    pub const ALL: [IntegrityKind; Self::COUNT] = [Self::Checksum, Self::Header];

    /// Dense index, for per-kind counters.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Stable lower-case name (logs, metric labels).
    pub fn name(self) -> &'static str {
        match self {
            Self::Checksum => "checksum",
            Self::Header => "header",
        }
    }
}

/// A condition of the store's own that stopped a file operation, where
/// the operating system reported nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The swap file's reads were shut down while this one waited for room.
    #[error("swap reads closed")]
    SwapReadsClosed,
    /// The lane of a swap read went away before the read completed.
    #[error("swap read abandoned")]
    SwapReadAbandoned,
    /// A swap-read lane had no free slot though the read held room in
    /// flight.
    #[error("swap read table full")]
    SwapReadTableFull,
    /// A swap-read lane's submission queue had no free entry.
    #[error("swap read queue full")]
    SwapReadQueueFull,
    /// The swap file's io_uring submission queue had no free entry; the
    /// swap is broken from then on.
    #[error("submission queue full")]
    SwapQueueFull,
    /// An earlier swap submission failed, so buffers may still be in the
    /// kernel's hands: no further swap I/O until arenad restarts.
    #[error("an earlier io_uring submission failed; restart arenad")]
    SwapBroken,
    /// A sync of the swap file or its extent table failed. The kernel may
    /// have dropped what it could not write and a later sync would not
    /// say so, so the images written since the last good sync are never
    /// called durable: no FLUSH succeeds again until a restart, which
    /// starts from the index as last acknowledged.
    #[error("an earlier sync failed, so what was written since may be lost whatever a later sync reports; restart arenad")]
    SwapSyncFailed,
    /// A failed journal append could not be zeroed again; appends wait
    /// for the next checkpoint to reset the journal.
    #[error("an earlier append could not be rolled back; the next checkpoint clears it")]
    JournalBroken,
    /// A batch larger than what is left of the journal.
    #[error("{records} records do not fit the {left} bytes left")]
    JournalFull {
        /// Records in the batch.
        records: usize,
        /// Bytes left in the journal.
        left: u64,
    },
    /// The index snapshot being checkpointed yielded another number of
    /// blobs than it announced (and the checkpoint's header says).
    #[error("snapshot yielded {yielded} blobs, announced {announced}")]
    SnapshotMiscounted {
        /// Blobs the snapshot yielded.
        yielded: u64,
        /// Blobs it announced.
        announced: u64,
    },
}

/// Why a lease ended before its holder committed it (a `LEASE_LOST`
/// answer), each with what became of the bytes written through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LostCause {
    /// Its blob was removed (by a REMOVE, maybe from another connection).
    #[error("was removed while leased: the write is dropped, as if it came before the REMOVE")]
    Removed,
    /// It was asked back (REVOKE) and not given back within the revoke
    /// deadline.
    #[error("was revoked and ended by force at its deadline: bytes written into the slot before the deadline stay there uncommitted, none after it landed; write the blob again")]
    Overdue,
    /// A raise of the volume's epoch fenced its session out.
    #[error("was ended by a raise of the volume's epoch: bytes written into the slot before the raise stay there uncommitted, none after it landed")]
    Fenced,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Arena and swap are both full.
    #[error("no space: all {slots} arena slots and all {extents} swap extents are in use")]
    NoSpace {
        /// Arena slots.
        slots: usize,
        /// Swap extents.
        extents: u32,
    },
    /// The volume already holds its quota of blobs.
    #[error("volume {volume:?} is at its quota of {quota} blobs")]
    QuotaExceeded {
        /// Volume name.
        volume: String,
        /// Its quota.
        quota: u64,
    },
    /// Every slot is pinned by a lease; the oldest leases were revoked.
    #[error("all {slots} arena slots are pinned by leases; {revoked} leases revoked, retry later")]
    Busy {
        /// Arena slots.
        slots: usize,
        /// Leases newly asked back.
        revoked: usize,
    },
    /// No lease has this token.
    #[error("unknown lease token {token}")]
    UnknownLease {
        /// The token.
        token: u64,
    },
    /// The lease exists but does not fit the request.
    #[error("lease token {token} {detail}")]
    LeaseMismatch {
        /// The token.
        token: u64,
        /// What did not match.
        detail: String,
    },
    /// A lease ended before its COMMIT without its holder, for `cause`.
    /// Not a client error: the lease is ended and the writer may write
    /// again.
    #[error("lease token {token} (volume {vol} key {key}) {cause}")]
    LeaseLost {
        /// The token.
        token: u64,
        /// Volume index.
        vol: u32,
        /// Blob key.
        key: u64,
        /// Why it ended.
        cause: LostCause,
    },
    /// Every slot is pinned and leases held past their volume's share were
    /// asked back for a requester under its own: the store retries once a
    /// lease ends or at `until` (the revoke deadline). Never returned by a
    /// public [`Store`](super::Store) method.
    #[error("every arena slot is pinned; waiting until a revoked lease is given back or ended")]
    Reclaiming {
        /// When the first of them may be ended by force.
        until: std::time::Instant,
        /// Leases ended when this was decided.
        ends: u64,
    },
    /// Too many leases are outstanding (in the arena, or of this connection).
    #[error("too many leases outstanding: the limit is {limit}")]
    LeaseLimit {
        /// The limit.
        limit: usize,
    },
    /// A byte range does not fit in a blob.
    #[error("byte range at offset {offset} of length {len} exceeds the blob size {blob_bytes}")]
    OutOfRange {
        /// Range start.
        offset: u32,
        /// Range length.
        len: usize,
        /// Blob size.
        blob_bytes: u32,
    },
    /// No such volume.
    #[error("unknown volume id {vol}: {count} volumes are configured")]
    UnknownVolume {
        /// The id.
        vol: VolumeId,
        /// Configured volumes.
        count: usize,
    },
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// The operation, phrased to precede the path.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file operation stopped on a condition of the store's own.
    #[error("{what} {path}: {refusal}")]
    Refused {
        /// The operation, phrased to precede the path.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The condition.
        refusal: Refusal,
    },
    /// io_uring could not be set up.
    #[error("setting up io_uring for the swap file failed: {source}")]
    Uring {
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The arena could not be mapped.
    #[error("mapping a {bytes}-byte arena failed: {source}")]
    ArenaMap {
        /// Arena size.
        bytes: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A persisted file does not parse.
    #[error("corrupt {}: {detail}", file.display())]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A configuration value is unusable.
    #[error("invalid config {key}: {detail}")]
    InvalidConfig {
        /// The key.
        key: &'static str,
        /// Why, with the value.
        detail: String,
    },
    /// Another process has the store open.
    #[error("store directory {} is locked by another process", path.display())]
    Locked {
        /// The directory.
        path: PathBuf,
    },
    /// Bytes read from swap do not verify against their extent header, so
    /// they are not served (an EIO-class error for the reader).
    #[error("integrity check failed for volume {volume:?} key {key}: {} extent {extent} at byte {offset}: {detail}", file.display())]
    Integrity {
        /// Which check failed.
        kind: IntegrityKind,
        /// The file holding the bad bytes (the swap file, or its extent
        /// table for a bad header).
        file: PathBuf,
        /// The swap extent.
        extent: u32,
        /// Byte offset of the bad block or header in `file`.
        offset: u64,
        /// The blob's volume.
        volume: String,
        /// The blob's key.
        key: u64,
        /// What did not match.
        detail: String,
    },
    /// A file written in another on-disk format; there is no migration.
    #[error("{} has on-disk format version {version}, this arenad reads only version {}: it does not migrate stores; drain the volumes with the arenad that wrote it, or move the directory aside to start empty (docs/OPERATIONS.md)", file.display(), FORMAT_VERSION)]
    OldFormat {
        /// The file.
        file: PathBuf,
        /// The version it carries.
        version: u32,
    },
}

impl StoreError {
    /// The status a client is answered with. `Protocol` means the request
    /// itself was wrong (a lease it does not hold, a range past the blob);
    /// the server then ends the connection.
    pub fn status(&self) -> Status {
        match self {
            Self::NoSpace { .. } => Status::NoSpace,
            Self::QuotaExceeded { .. } => Status::QuotaExceeded,
            Self::Busy { .. } | Self::LeaseLimit { .. } | Self::Reclaiming { .. } => Status::Busy,
            Self::LeaseLost { .. } => Status::LeaseLost,
            Self::UnknownLease { .. } | Self::LeaseMismatch { .. } | Self::OutOfRange { .. } => {
                Status::Protocol
            }
            Self::UnknownVolume { .. }
            | Self::Io { .. }
            | Self::Refused { .. }
            | Self::Uring { .. }
            | Self::ArenaMap { .. }
            | Self::Corrupt { .. }
            | Self::InvalidConfig { .. }
            | Self::Locked { .. }
            | Self::Integrity { .. }
            | Self::OldFormat { .. } => Status::Internal,
        }
    }
}

pub(super) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

pub(super) fn refused(what: &'static str, path: &Path, refusal: Refusal) -> StoreError {
    StoreError::Refused {
        what,
        path: path.to_path_buf(),
        refusal,
    }
}

pub(super) fn corrupt(file: &Path, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        file: file.to_path_buf(),
        detail: detail.into(),
    }
}

/// A blob the index names lies in an extent the swap had when the index
/// was written (`written` extents) but past the `extents` configured now:
/// `swap_bytes` was lowered.
pub(super) fn swap_shrunk(extent: u32, extents: u32, written: u32) -> StoreError {
    StoreError::InvalidConfig {
        key: "swap_bytes",
        detail: format!(
            "the index references swap extent {extent} but swap_bytes now holds only {extents} extents \
             (the store was written with {written}): set swap_bytes back to at least {} extents",
            u64::from(extent) + 1
        ),
    }
}
