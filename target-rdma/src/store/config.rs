//! Where and how big the store is, the volumes it serves, and the checks
//! those settings pass before anything is opened.

use std::collections::HashSet;
use std::path::PathBuf;

use super::error::StoreError;
use super::{checkpoint, extent, format, journal, swap};
use crate::proto::MAX_VOLUME_NAME;

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

pub(super) fn invalid(key: &'static str, detail: String) -> StoreError {
    StoreError::InvalidConfig { key, detail }
}

/// Checks the configuration; returns (slots, extents).
pub(super) fn validate(
    cfg: &StoreConfig,
    volumes: &[VolumeSpec],
) -> Result<(u32, u32), StoreError> {
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
