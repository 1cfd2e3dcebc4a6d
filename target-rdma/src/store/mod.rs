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
mod arena;
mod checkpoint;
mod engine;
mod eviction;
mod extent;
mod format;
mod in_process;
mod index;
mod journal;
mod read;
mod reads;
mod repair;
mod space;
mod status;
mod swap;
#[cfg(test)]
mod tests;

pub use repair::{BlobRef, RepairReport};

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

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::RwLock;

use crate::proto::{Lease, MAX_VOLUME_NAME};
use arena::Arena;
use engine::{Core, Guard, State};
pub use engine::{ForceEndHook, Immediate, LeaseLimits, DEFAULT_REVOKE_DEADLINE_MS};
pub use in_process::InProcess;

/// Where and how big the store is.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Directory holding the swap file and the index.
    pub dir: PathBuf,
    /// RAM arena size; a multiple of `blob_bytes`.
    pub arena_bytes: u64,
    /// Blob (slot, extent) size: a power of two from 4 KiB to 16 MiB.
    pub blob_bytes: u32,
    /// Swap file size; a multiple of `blob_bytes`, at least `arena_bytes`.
    pub swap_bytes: u64,
    /// Most range reads of cold blobs in flight at once, over all the
    /// swap's rings; more wait for room. 1 to [`MAX_SWAP_READS_IN_FLIGHT`].
    pub swap_reads_in_flight: u32,
}

/// The default of [`StoreConfig::swap_reads_in_flight`].
pub const DEFAULT_SWAP_READS_IN_FLIGHT: u32 = 128;
/// The most [`StoreConfig::swap_reads_in_flight`] allows.
pub const MAX_SWAP_READS_IN_FLIGHT: u32 = 4096;

/// The files of a store with `cfg`, and the bytes each takes on disk once
/// allocated: what `arenad --check` needs free (beyond what they already
/// hold) for a start to succeed. The checkpoint is sized for no volumes;
/// their names add a few bytes, well inside the rounding of the files.
pub fn footprint(cfg: &StoreConfig) -> Vec<(&'static str, u64)> {
    let extents =
        u32::try_from(cfg.swap_bytes / u64::from(cfg.blob_bytes.max(1))).unwrap_or(u32::MAX);
    vec![
        (swap::SWAP_FILE, cfg.swap_bytes),
        (extent::META_FILE, extent::meta_len(cfg.blob_bytes, extents)),
        (journal::JOURNAL_FILE, journal::capacity(extents)),
        (
            checkpoint::CKPT_FILE,
            2 * checkpoint::slot_len(&[], extents),
        ),
    ]
}

/// A volume the store serves.
#[derive(Clone, Debug)]
pub struct VolumeSpec {
    /// Name clients ask for; the persisted index is keyed by it.
    pub name: String,
    /// Most distinct blobs the volume may hold.
    pub quota_blobs: u64,
}

/// Index into the `volumes` slice given to [`Store::open`].
pub type VolumeId = u32;
/// A connection; owns leases.
pub type HolderId = u64;
/// Where a blob is: what the `_now` calls (`Store::write_now` and its
/// kin) decide by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// No blob under the key.
    Absent,
    /// In its slot: served without a disk read.
    Resident,
    /// In its slot, which a write-back is writing to swap (its bytes
    /// locked for reading until the disk write ends): a READ or GET is
    /// served at once, a WRITE or ALLOC waits for the disk.
    WritingBack,
    /// In swap only, or being loaded: serving it may read the disk.
    Cold,
}
/// Which durable index write a timing belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexWrite {
    /// A journal append, fsync included (once per FLUSH that had records).
    Journal,
    /// A checkpoint: written, fsynced and renamed into place.
    Checkpoint,
}

/// Told the duration of each index write; runs under the store lock, so it
/// must only record (e.g. into a histogram).
pub type TimingHook = Box<dyn Fn(IndexWrite, std::time::Duration) + Send + Sync>;

/// Called once per lease the store wants back: (holder, volume, key, token).
pub type RevokeHook = Box<dyn Fn(HolderId, VolumeId, u64, u64) + Send + Sync>;

type BlobKey = (VolumeId, u64);

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
    /// An ALLOC lease's blob was removed (by a REMOVE, maybe from another
    /// connection) before its COMMIT: the write is dropped, as if it had
    /// happened before the remove. Not a client error: the lease is ended
    /// and the writer may write again.
    #[error("lease token {token}: volume {vol} key {key} was removed while leased; the write is dropped")]
    LeaseLost {
        /// The token.
        token: u64,
        /// Volume index.
        vol: u32,
        /// Blob key.
        key: u64,
    },
    /// Every slot is pinned and leases held past their volume's share were
    /// asked back for a requester under its own: the store retries once a
    /// lease ends or at `until` (the revoke deadline). Never returned by a
    /// public [`Store`] method.
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
    #[error("{} has on-disk format version {version}, this arenad reads only version {}: it does not migrate stores; drain the volumes with the arenad that wrote it, or move the directory aside to start empty (docs/OPERATIONS.md)", file.display(), format::FORMAT_VERSION)]
    OldFormat {
        /// The file.
        file: PathBuf,
        /// The version it carries.
        version: u32,
    },
}

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

/// The arena peer's storage engine. `Send + Sync`; call it from any thread.
pub struct Store {
    core: Arc<Core>,
    hook: RwLock<Option<RevokeHook>>,
    blob_bytes: u32,
    generation: u64,
    /// The background write-back thread; joined on drop.
    /// The cleaner and the read-ahead workers.
    workers: Vec<JoinHandle<()>>,
    /// Holds the advisory lock on the directory while the store is open.
    _lock: File,
}

const LOCK_FILE: &str = "lock";

fn invalid(key: &'static str, detail: String) -> StoreError {
    StoreError::InvalidConfig { key, detail }
}

/// Checks the configuration; returns (slots, extents).
fn validate(cfg: &StoreConfig, volumes: &[VolumeSpec]) -> Result<(u32, u32), StoreError> {
    if cfg.dir.as_os_str().is_empty() {
        return Err(invalid("dir", "must not be empty".into()));
    }
    let r = cfg.swap_reads_in_flight;
    if !(1..=MAX_SWAP_READS_IN_FLIGHT).contains(&r) {
        return Err(invalid(
            "swap_reads_in_flight",
            format!("must be from 1 to {MAX_SWAP_READS_IN_FLIGHT}, got {r}"),
        ));
    }
    let b = cfg.blob_bytes;
    if !b.is_power_of_two() || !(4096..=16 << 20).contains(&b) {
        return Err(invalid(
            "blob_bytes",
            format!("must be a power of two from 4096 to 16777216, got {b}"),
        ));
    }
    let b64 = u64::from(b);
    if !cfg.arena_bytes.is_multiple_of(b64) || cfg.arena_bytes / b64 < 2 {
        return Err(invalid(
            "arena_bytes",
            format!(
                "must be a multiple of blob_bytes ({b}) holding at least 2 slots, got {}",
                cfg.arena_bytes
            ),
        ));
    }
    let slots = u32::try_from(cfg.arena_bytes / b64)
        .ok()
        .filter(|_| usize::try_from(cfg.arena_bytes).is_ok())
        .ok_or_else(|| {
            invalid(
                "arena_bytes",
                format!("{} is too large for this machine", cfg.arena_bytes),
            )
        })?;
    if !cfg.swap_bytes.is_multiple_of(b64) || cfg.swap_bytes < cfg.arena_bytes {
        return Err(invalid(
            "swap_bytes",
            format!(
                "must be a multiple of blob_bytes ({b}) and at least arena_bytes ({}), got {}",
                cfg.arena_bytes, cfg.swap_bytes
            ),
        ));
    }
    let extents = u32::try_from(cfg.swap_bytes / b64).map_err(|_| {
        invalid(
            "swap_bytes",
            format!(
                "{} holds more than 2^32 extents of {b} bytes",
                cfg.swap_bytes
            ),
        )
    })?;
    if volumes.len() > format::MAX_VOLUMES {
        return Err(invalid(
            "volumes",
            format!(
                "{} volumes, the limit is {}",
                volumes.len(),
                format::MAX_VOLUMES
            ),
        ));
    }
    let mut seen = HashSet::new();
    for v in volumes {
        if v.name.is_empty() || v.name.len() > MAX_VOLUME_NAME {
            return Err(invalid(
                "volumes.name",
                format!("{:?} must be 1 to {MAX_VOLUME_NAME} bytes long", v.name),
            ));
        }
        if !seen.insert(v.name.as_str()) {
            return Err(invalid(
                "volumes.name",
                format!("{:?} is configured twice", v.name),
            ));
        }
    }
    Ok((slots, extents))
}

/// Takes an exclusive advisory lock so that two processes never share a
/// swap file and journal.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|source| StoreError::Io {
            what: "opening lock file",
            path: path.clone(),
            source,
        })?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(StoreError::Locked {
            path: dir.to_path_buf(),
        }),
        Err(e) => Err(StoreError::Io {
            what: "locking",
            path,
            source: e.into(),
        }),
    }
}

/// With no checkpoint the directory must hold a new store: no other store
/// file, or only those of a creation cut short (they describe no extent and
/// journal nothing). Anything else is an index lost, and starting empty
/// would overwrite the blobs it named.
fn check_new(dir: &Path) -> Result<(), StoreError> {
    let exists = |name: &str| dir.join(name).exists();
    let present: Vec<&str> = [index::JOURNAL_FILE, extent::META_FILE, swap::SWAP_FILE]
        .into_iter()
        .filter(|f| exists(f))
        .collect();
    if present.is_empty() {
        return Ok(());
    }
    let meta_blank = if exists(extent::META_FILE) {
        extent::table_is_blank(dir)?
    } else {
        !exists(swap::SWAP_FILE)
    };
    if meta_blank && index::journal_is_blank(dir)? {
        tracing::warn!(event = "store_creation_resumed", dir = %dir.display(), files = ?present, "found the files of a store whose creation was cut short (no checkpoint, nothing journaled, no extent header): creating it again");
        return Ok(());
    }
    Err(StoreError::Corrupt {
        file: dir.join(index::CKPT_FILE),
        detail: format!(
            "is missing, but {} hold the data of existing blobs: refusing to start with an empty \
             index, which would overwrite them; restore it, or rebuild it with arenad --repair",
            present.join(", ")
        ),
    })
}

impl Store {
    /// Opens or creates the store in `cfg.dir`: loads the checkpoint, replays
    /// the journal (dropping a torn last batch, refusing any other damage),
    /// checks the header of every extent the index names, then writes a
    /// fresh checkpoint carrying the bumped generation, so each run starts
    /// with an empty journal whose volume numbers are this run's. A new
    /// store reserves the space of all its files.
    pub fn open(cfg: StoreConfig, volumes: &[VolumeSpec]) -> Result<Store, StoreError> {
        let (slots, extents) = validate(&cfg, volumes)?;
        fs::create_dir_all(&cfg.dir).map_err(|source| StoreError::Io {
            what: "creating store directory",
            path: cfg.dir.clone(),
            source,
        })?;
        let lock = lock_dir(&cfg.dir)?;
        let found = index::load(&cfg.dir, cfg.blob_bytes, extents)?;
        if found.is_none() {
            check_new(&cfg.dir)?;
        }
        let arena = Arena::new(slots as usize, cfg.blob_bytes as usize).map_err(|source| {
            StoreError::ArenaMap {
                bytes: cfg.arena_bytes,
                source,
            }
        })?;
        let (state, swap) = State::open(&cfg, &arena, slots, extents, volumes, found)?;
        let generation = state.generation();
        let core = Arc::new(Core::new(arena, swap, state));
        let cleaner = {
            let core = Arc::clone(&core);
            std::thread::Builder::new()
                .name("arenad-cleaner".into())
                .spawn(move || core.clean())
                .map_err(|source| StoreError::Io {
                    what: "starting the write-back thread for",
                    path: cfg.dir.clone(),
                    source,
                })?
        };
        let mut workers = vec![cleaner];
        for i in 0..engine::READ_AHEAD_WORKERS {
            let worker = Arc::clone(&core);
            let spawned = std::thread::Builder::new()
                .name(format!("arenad-ahead-{i}"))
                .spawn(move || worker.read_ahead_worker());
            match spawned {
                Ok(t) => workers.push(t),
                Err(source) => {
                    // Stop what already runs before reporting.
                    core.stop_cleaner();
                    for t in workers {
                        let _ = t.join();
                    }
                    return Err(StoreError::Io {
                        what: "starting a read-ahead thread for",
                        path: cfg.dir.clone(),
                        source,
                    });
                }
            }
        }
        Ok(Store {
            blob_bytes: cfg.blob_bytes,
            generation,
            core,
            hook: RwLock::new(None),
            workers,
            _lock: lock,
        })
    }

    /// Rebuilds the index of the store in `cfg.dir` from its extent headers
    /// (`arenad --repair`): for an index that is damaged or lost, which
    /// [`Store::open`] refuses. The store must not be open; what could not
    /// be recovered is in the report.
    pub fn repair(cfg: &StoreConfig, volumes: &[VolumeSpec]) -> Result<RepairReport, StoreError> {
        repair::repair(cfg, volumes)
    }

    /// Bumped on every open, so clients can tell that leases did not survive.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Blob size in bytes.
    pub fn blob_bytes(&self) -> u32 {
        self.blob_bytes
    }

    /// Installs the callback that asks a holder to give a lease back. It runs
    /// without the store lock held, so it may call back into the store (but
    /// not replace the hook from inside it).
    pub fn set_revoke_hook(&self, hook: RevokeHook) {
        *self.hook.write() = Some(hook);
    }

    /// Installs the callback told how long journal appends and checkpoints
    /// take (arenad's journal and checkpoint latency histograms).
    pub fn set_timing_hook(&self, hook: TimingHook) {
        self.locked(|_, g| g.set_timing_hook(hook));
    }

    /// Runs `f` under the store lock, then delivers any revocations it queued
    /// after the lock is dropped.
    fn locked<R>(&self, f: impl FnOnce(&Core, &mut Guard<'_>) -> R) -> R {
        let (r, revoked) = {
            let mut g = self.core.state.lock();
            let r = f(&self.core, &mut g);
            self.core.kick_cleaner_if_due(&mut g);
            (r, g.take_revocations())
        };
        if !revoked.is_empty() {
            if let Some(hook) = self.hook.read().as_ref() {
                for (holder, vol, key, token) in revoked {
                    hook(holder, vol, key, token);
                }
            }
        }
        r
    }

    fn check_range(&self, offset: u32, len: usize) -> Result<(), StoreError> {
        if (offset as usize).saturating_add(len) > self.blob_bytes as usize {
            return Err(StoreError::OutOfRange {
                offset,
                len,
                blob_bytes: self.blob_bytes,
            });
        }
        Ok(())
    }

    /// Writes `data` at `offset` inside blob `key`; a new key starts as zeros.
    pub fn write(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.check_range(offset, data.len())?;
        let whole = data.len() == self.blob_bytes as usize;
        let slot = self.fairly(|c, g| c.pin_or_create(g, vol, key, whole))?;
        {
            let mut bytes = self.core.arena.write(slot.slot());
            let o = offset as usize;
            bytes[o..o + data.len()].copy_from_slice(data);
        }
        self.locked(|c, g| c.unpin_written(g, slot));
        Ok(())
    }

    /// Leases blob `key`'s own slot for writing in place; the blob is created
    /// (zeroed) if absent. The slot counts as dirty from now on, because the
    /// holder may change it at any moment.
    pub fn alloc(&self, vol: VolumeId, key: u64, holder: HolderId) -> Result<Lease, StoreError> {
        self.fairly(|c, g| c.alloc(g, vol, key, holder))
    }

    /// Leases blob `key`'s slot for reading; `None` when the key holds no blob.
    pub fn get(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Option<Lease>, StoreError> {
        self.fairly(|c, g| c.get(g, vol, key, holder))
    }

    /// Ends an ALLOC lease, keeping what its holder wrote as the blob content.
    pub fn commit(
        &self,
        vol: VolumeId,
        key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.locked(|c, g| {
            let r = g.commit(vol, key, token, holder);
            c.lease_ended();
            r
        })
    }

    /// Ends a lease. An uncommitted ALLOC slot stays dirty: its bytes may
    /// have changed in place.
    pub fn release(&self, token: u64, holder: HolderId) -> Result<(), StoreError> {
        self.locked(|c, g| {
            let r = g.release(token, holder);
            c.lease_ended();
            r
        })
    }

    /// Hands the leased slot's bytes to `f`, the in-process stand-in for an
    /// RDMA READ/WRITE into the slot. `f` must not call back into the store
    /// (a FLUSH waits for the slot while holding the store lock). Changes
    /// through a GET lease are not marked dirty: GET slots are read-only by
    /// contract, as their RDMA registration would be.
    pub fn with_lease<R>(
        &self,
        token: u64,
        holder: HolderId,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, StoreError> {
        let slot = self.locked(|_, g| g.pin_lease(token, holder))?;
        let r = f(&mut self.core.arena.write(slot));
        self.locked(|_, g| g.unpin(slot, false));
        Ok(r)
    }

    /// Serves `spec` from now on and returns its id (see the engine's
    /// `configure_volume`): arenad's SIGHUP adds volumes and changes quotas
    /// with it. A name already known keeps its id and blobs.
    pub fn configure_volume(&self, spec: &VolumeSpec) -> Result<VolumeId, StoreError> {
        if spec.name.is_empty() || spec.name.len() > MAX_VOLUME_NAME {
            return Err(invalid(
                "volumes.name",
                format!("{:?} must be 1 to {MAX_VOLUME_NAME} bytes long", spec.name),
            ));
        }
        self.locked(|_, g| g.configure_volume(&spec.name, spec.quota_blobs))
    }

    /// Where blob `key` is now (it may change as soon as the lock is
    /// dropped, which is why the `_now` calls decide under their own).
    #[cfg(test)]
    pub fn residency(&self, vol: VolumeId, key: u64) -> Residency {
        self.locked(|_, g| g.residency((vol, key)))
    }

    /// Drops keys `start..end` of `vol`; returns how many blobs existed.
    pub fn remove(&self, vol: VolumeId, start: u64, end: u64) -> Result<u64, StoreError> {
        self.locked(|_, g| g.remove(vol, start, end))
    }

    /// Makes every write and commit acknowledged before the call durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.locked(|c, g| c.flush(g))
    }

    /// Ends every lease of a connection that stays open, without it (see
    /// [`ForceEndHook`]: each is reported before its slot is unpinned);
    /// returns how many were live.
    pub fn end_leases_of(&self, holder: HolderId) -> usize {
        self.locked(|c, g| {
            let n = g.end_holder(holder);
            if n > 0 {
                c.lease_ended();
            }
            n
        })
    }

    /// Releases every lease of a dead connection.
    pub fn drop_holder(&self, holder: HolderId) {
        self.locked(|c, g| {
            g.drop_holder(holder);
            c.lease_ended();
        })
    }

    /// The arena mapping as `(base, len)`, for registering it with an RDMA
    /// device so that lease holders read and write slots in place: slot `s`
    /// starts at `base + s * blob_bytes`, which is what lease offsets say.
    /// Called once at startup; it briefly takes slot 0's lock.
    pub fn arena_region(&self) -> (*mut u8, usize) {
        let slots = self.stats().slots_total as usize;
        let base = self.core.arena.write(0).as_mut_ptr();
        (base, slots * self.blob_bytes as usize)
    }

    /// Counters and gauges for metrics.
    pub fn stats(&self) -> StoreStats {
        self.locked(|c, g| c.stats(g))
    }
}

impl Drop for Store {
    /// Stops the cleaner before the arena and swap go away; its in-flight
    /// write-back (if any) completes first.
    fn drop(&mut self) {
        self.core.stop_cleaner();
        for t in self.workers.drain(..) {
            if t.join().is_err() {
                tracing::error!(
                    event = "cleaner_panicked",
                    "a store background thread (write-back or read-ahead) panicked"
                );
            }
        }
    }
}
