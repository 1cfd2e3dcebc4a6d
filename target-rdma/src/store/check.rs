//! The store's part of `arenad --check` ([`super::Store::check`]): every
//! file a start reads, read and checked the way the start does, without
//! writing anything (no file created, grown, truncated or rewritten), so
//! that the check refuses exactly what a start would refuse, with the same
//! message naming the file, the slot or batch and the field.
//!
//! The directory's lock is taken shared for the duration: a running
//! arenad (which holds it exclusively) makes the check say so rather than
//! read files that are changing under it, and an arenad starting during
//! the check is told the directory is locked, as during any other check.

use super::config::{validate, StoreConfig, VolumeSpec};
use super::dir::{check_new, lock_shared};
use super::disk::StoreDir;
use super::error::StoreError;
use super::extent::{self, Ident, MetaFile};
use super::index::{self, Seen};
use super::swap;

/// Most damaged blobs a check names; the count covers all of them.
const NAMED: usize = 8;

/// What [`super::Store::check`] found in a store a start would open.
#[derive(Clone, Debug, Default)]
pub struct StoreCheck {
    /// What the store holds, one line.
    pub summary: String,
    /// What a start goes on with but an operator should know (a damaged
    /// checkpoint slot it overwrites, blobs whose images fail their
    /// headers, volumes kept but not served).
    pub warnings: Vec<String>,
}

/// See the module docs.
pub(super) fn check(cfg: &StoreConfig, volumes: &[VolumeSpec]) -> Result<StoreCheck, StoreError> {
    let (_, extents) = validate(cfg, volumes)?;
    let dir = &StoreDir::os(&cfg.dir);
    let blob = cfg.blob_bytes;
    if !dir.exists() {
        return Ok(StoreCheck {
            summary: format!("no store in {} yet: a start creates it", dir.display()),
            warnings: Vec::new(),
        });
    }
    let _lock = lock_shared(dir)?;
    let Some(found) = index::load(dir, blob, extents)? else {
        check_new(dir)?;
        return Ok(StoreCheck {
            summary: format!("no store in {} yet: a start creates it", dir.display()),
            warnings: Vec::new(),
        });
    };
    let image = &found.image;
    swap::check_file(dir, blob, image.extents)?;
    let meta = MetaFile::open_read_only(dir, blob, image.extents)?;
    let mut warnings = Vec::new();
    if let Err(why) = &found.seen.other {
        warnings.push(format!(
            "{}: {why}: not the slot in use (slot {}); a start overwrites it",
            dir.join(index::CKPT_FILE).display(),
            found.seen.slot
        ));
    }
    if let Some(highest) = image.blobs.values().map(|&(e, _)| e).max() {
        let records = meta.read_all(highest + 1)?;
        let mut damaged = Vec::new();
        let mut total = 0u64;
        for (&(pv, key), &(e, version)) in &image.blobs {
            let name = &image.volumes[pv as usize];
            let want = Ident {
                volume: extent::volume_id(name),
                key,
                version,
            };
            let named = |id: u64| {
                image
                    .volumes
                    .iter()
                    .find(|n| extent::volume_id(n) == id)
                    .map_or_else(|| format!("{id:#018x}"), |n| format!("{n:?}"))
            };
            if let Err(why) = extent::verify(&records[e as usize], &want, named) {
                total += 1;
                if damaged.len() < NAMED {
                    damaged.push(format!("volume {name:?} key {key} (extent {e}): {why}"));
                }
            }
        }
        if total > 0 {
            let more = total - damaged.len() as u64;
            warnings.push(format!(
                "{}: {total} blobs whose swap image does not match its header: a start serves them \
                 as errors until they are rewritten, removed or repaired: {}{}",
                meta.path().display(),
                damaged.join("; "),
                if more > 0 {
                    format!("; and {more} more")
                } else {
                    String::new()
                }
            ));
        }
    }
    for (pv, name) in image.volumes.iter().enumerate() {
        if !volumes.iter().any(|v| &v.name == name) {
            let n = image.blobs.keys().filter(|k| k.0 == pv as u32).count();
            warnings.push(format!(
                "volume {name:?} is not configured: a start keeps its {n} blobs, unserved"
            ));
        }
    }
    Ok(StoreCheck {
        summary: summary(dir, &found.image, &found.seen),
        warnings,
    })
}

fn summary(dir: &std::path::Path, image: &super::format::Image, seen: &Seen) -> String {
    let journal = match (seen.stale_journal, seen.torn) {
        (Some(e), _) => format!(
            "a stale journal of epoch {e} a start skips (a crash came between a checkpoint and the journal's reset)"
        ),
        (None, torn) => {
            let torn = torn.map_or_else(String::new, |t| {
                format!(
                    ", and a torn batch {} at offset {} past the synced mark, never acknowledged, \
                     a start drops",
                    t.batch, t.offset
                )
            });
            format!(
                "{} journal batches ({} marked synced){torn}",
                seen.batches, seen.synced
            )
        }
    };
    format!(
        "store in {}: checkpoint epoch {} (slot {}), {journal}; {} blobs indexed, every file as a start needs it",
        dir.display(),
        image.epoch,
        seen.slot,
        image.blobs.len()
    )
}
