//! `arenad --repair`: rebuilds the index from what the extents prove.
//!
//! Every extent header (volume id, key, write version, block CRCs) is read,
//! the newest image of each blob of a configured volume is checked block by
//! block against its header, and the ones that verify become the new index
//! (a fresh checkpoint and an empty journal). What could not be recovered
//! is reported: damaged headers, images whose bytes fail their checksums,
//! images of volumes that are not configured, and blobs the old index (when
//! still readable) named that are now gone. An older image is never used in
//! place of a newer one that fails: that would serve stale data as if it
//! were current.
//!
//! Repair keeps images written after the last FLUSH (a volatile write
//! cache may keep or lose those) and drops blobs whose removal reached the
//! extent table (freed extents have their header cleared).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::OpenOptions;
use std::io;
use ublk_metrics::events;

use super::config::{validate, StoreConfig, VolumeSpec};
use super::dir::lock_dir;
use super::disk::{DiskFile, Role, StoreDir};
use super::error::StoreError;
use super::extent::{self, Ident, MetaFile, Record, BLOCK};
use super::format::{Snapshot, Version};
use super::index::{self, Index};
use super::space;
use super::swap::SWAP_FILE;

/// Most items each list of the report names; the counts cover all of them.
const LISTED: usize = 64;

/// A blob, as a report names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobRef {
    /// Volume name.
    pub volume: String,
    /// Key.
    pub key: u64,
    /// The swap extent that held its image (when known).
    pub extent: Option<u32>,
}

/// What [`super::Store::repair`] rebuilt and what it could not.
#[derive(Clone, Debug, Default)]
pub struct RepairReport {
    /// Blobs recovered, per configured volume (configured order).
    pub recovered: Vec<(String, u64)>,
    /// Extents whose header was damaged (their images are lost); up to
    /// [`LISTED`] of them, with the reason.
    pub bad_headers: Vec<(u32, String)>,
    /// How many there were.
    pub bad_headers_total: u64,
    /// Newest images whose bytes fail their checksum (or lie past the end of
    /// the swap file): those blobs are lost.
    pub bad_images: Vec<BlobRef>,
    /// How many there were.
    pub bad_images_total: u64,
    /// Images of volumes that are not configured (by on-disk id): not
    /// indexed; configure the volume and repair again to keep them.
    pub unknown_volumes: BTreeMap<u64, u64>,
    /// Older images of recovered blobs, dropped.
    pub superseded: u64,
    /// Blobs the old index named that were not recovered, when a checkpoint
    /// could still be read (None: it could not, see `old_index`).
    pub lost: Option<Vec<BlobRef>>,
    /// How many there were.
    pub lost_total: u64,
    /// What became of the old index.
    pub old_index: String,
    /// What was wrong with the extent table's header, rewritten from the
    /// configuration (the records it describes are read all the same).
    pub table_header: Option<String>,
    /// The generation recorded (the next start serves the one after).
    pub generation: u64,
}

impl RepairReport {
    /// Whether anything the extents held was left out.
    pub fn complete(&self) -> bool {
        self.bad_headers_total == 0
            && self.bad_images_total == 0
            && self.unknown_volumes.is_empty()
            && self.lost_total == 0
    }
}

impl fmt::Display for RepairReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "index rebuilt from the extent headers (old index: {})",
            self.old_index
        )?;
        if let Some(why) = &self.table_header {
            writeln!(
                f,
                "  the extent table's header was damaged ({why}): rewritten from the configuration"
            )?;
        }
        for (v, n) in &self.recovered {
            writeln!(f, "  volume {v:?}: {n} blobs recovered")?;
        }
        if self.superseded > 0 {
            writeln!(
                f,
                "  {} older images of recovered blobs dropped",
                self.superseded
            )?;
        }
        let more = |f: &mut fmt::Formatter<'_>, shown: usize, total: u64| {
            if total > shown as u64 {
                writeln!(f, "    ... and {} more", total - shown as u64)
            } else {
                Ok(())
            }
        };
        let blob = |b: &BlobRef| match b.extent {
            Some(e) => format!("volume {:?} key {} (extent {e})", b.volume, b.key),
            None => format!("volume {:?} key {}", b.volume, b.key),
        };
        if self.bad_headers_total > 0 {
            writeln!(
                f,
                "  NOT RECOVERED: {} extents with a damaged header:",
                self.bad_headers_total
            )?;
            for (e, why) in &self.bad_headers {
                writeln!(f, "    extent {e}: {why}")?;
            }
            more(f, self.bad_headers.len(), self.bad_headers_total)?;
        }
        if self.bad_images_total > 0 {
            writeln!(
                f,
                "  NOT RECOVERED: {} blobs whose newest image fails its checksums:",
                self.bad_images_total
            )?;
            for b in &self.bad_images {
                writeln!(f, "    {}", blob(b))?;
            }
            more(f, self.bad_images.len(), self.bad_images_total)?;
        }
        for (id, n) in &self.unknown_volumes {
            writeln!(f, "  NOT RECOVERED: {n} images of a volume that is not configured (on-disk id {id:#018x})")?;
        }
        match &self.lost {
            Some(lost) if self.lost_total > 0 => {
                writeln!(f, "  NOT RECOVERED: {} blobs the old index named:", self.lost_total)?;
                for b in lost {
                    writeln!(f, "    {}", blob(b))?;
                }
                more(f, lost.len(), self.lost_total)?;
            }
            Some(_) => writeln!(f, "  every blob the old index named was recovered")?,
            None => writeln!(f, "  (the old index is unreadable, so blobs it named and no extent holds cannot be listed)")?,
        }
        write!(f, "  generation {}", self.generation)
    }
}

fn push_bounded<T>(list: &mut Vec<T>, total: &mut u64, item: T) {
    *total += 1;
    if list.len() < LISTED {
        list.push(item);
    }
}

/// A verified candidate: the newest header found for a blob.
struct Candidate {
    extent: u32,
    version: Version,
    crcs: Vec<u32>,
}

/// See the module docs; the store must not be open elsewhere.
pub(super) fn repair(
    cfg: &StoreConfig,
    volumes: &[VolumeSpec],
) -> Result<RepairReport, StoreError> {
    let (_, extents) = validate(cfg, volumes)?;
    let dir = &StoreDir::os(&cfg.dir);
    let _lock = lock_dir(dir)?;
    let blob = cfg.blob_bytes;
    let mut report = RepairReport::default();

    // The old index, if it still loads, tells what was lost; one that is
    // damaged does as far as it still reads (its checkpoint and the
    // journal batches before the damage).
    let old = match index::load(dir, blob, extents) {
        Ok(Some(found)) => {
            report.old_index = format!(
                "readable (checkpoint epoch {} and its journal)",
                found.image.epoch
            );
            Some(found.image)
        }
        Ok(None) => {
            report.old_index = "no checkpoint".into();
            None
        }
        Err(e) => match index::salvage(dir, blob, extents) {
            Some((image, read)) => {
                report.old_index = format!("unusable: {e}; compared as far as it reads: {read}");
                Some(image)
            }
            None => {
                report.old_index = format!("unusable: {e}");
                None
            }
        },
    };

    let (meta, table_header) = MetaFile::open_for_repair(dir, blob, extents)?;
    report.table_header = table_header;
    let swap_path = dir.join(SWAP_FILE);
    let swap = dir
        .open(
            Role::Swap,
            &swap_path,
            OpenOptions::new().read(true).write(true),
        )
        .map_err(|source| StoreError::Io {
            what: "opening swap file",
            path: swap_path.clone(),
            source,
        })?;
    let swap_len = swap
        .metadata()
        .map_err(|source| StoreError::Io {
            what: "reading metadata of swap file",
            path: swap_path.clone(),
            source,
        })?
        .len();

    let ids: HashMap<u64, u32> = volumes
        .iter()
        .enumerate()
        .map(|(i, v)| (extent::volume_id(&v.name), i as u32))
        .collect();
    let mut newest: BTreeMap<(u32, u64), Candidate> = BTreeMap::new();
    let mut max_generation = old.as_ref().map_or(0, |i| i.generation);
    for (e, rec) in meta.read_all(extents)?.into_iter().enumerate() {
        let e = e as u32;
        match rec {
            Record::Empty => {}
            Record::Invalid(why) => push_bounded(
                &mut report.bad_headers,
                &mut report.bad_headers_total,
                (e, why),
            ),
            Record::Valid(id, crcs) => {
                max_generation = max_generation.max(id.version.generation);
                let Some(&vol) = ids.get(&id.volume) else {
                    *report.unknown_volumes.entry(id.volume).or_default() += 1;
                    continue;
                };
                let c = Candidate {
                    extent: e,
                    version: id.version,
                    crcs,
                };
                match newest.get(&(vol, id.key)) {
                    Some(n) if n.version >= c.version => report.superseded += 1,
                    Some(_) => {
                        report.superseded += 1;
                        newest.insert((vol, id.key), c);
                    }
                    None => {
                        newest.insert((vol, id.key), c);
                    }
                }
            }
        }
    }

    // Check each newest image's bytes.
    let mut buf = vec![0u8; blob as usize];
    let mut blobs = BTreeMap::new();
    for ((vol, key), c) in newest {
        let offset = u64::from(c.extent) * u64::from(blob);
        let id = Ident {
            volume: extent::volume_id(&volumes[vol as usize].name),
            key,
            version: c.version,
        };
        let ok = offset + u64::from(blob) <= swap_len
            && read_full(&swap, &mut buf, offset).is_ok()
            && extent::first_bad_block(&id, 0, &buf, &c.crcs).is_none();
        if ok {
            blobs.insert((vol, key), (c.extent, c.version));
        } else {
            push_bounded(
                &mut report.bad_images,
                &mut report.bad_images_total,
                BlobRef {
                    volume: volumes[vol as usize].name.clone(),
                    key,
                    extent: Some(c.extent),
                },
            );
        }
    }

    if let Some(old) = &old {
        let mut lost = Vec::new();
        for (&(pv, key), &(e, _)) in &old.blobs {
            let name = &old.volumes[pv as usize];
            let here = volumes.iter().position(|v| &v.name == name);
            if here.is_none_or(|i| !blobs.contains_key(&(i as u32, key))) {
                push_bounded(
                    &mut lost,
                    &mut report.lost_total,
                    BlobRef {
                        volume: name.clone(),
                        key,
                        extent: Some(e),
                    },
                );
            }
        }
        report.lost = Some(lost);
    }

    // Headers of what is not indexed go, so a later repair cannot bring
    // those images back over newer data.
    let mapped: std::collections::HashSet<u32> = blobs.values().map(|&(e, _)| e).collect();
    for e in (0..extents).filter(|e| !mapped.contains(e)) {
        meta.clear(e)?;
    }
    meta.sync()?;
    let size = u64::from(extents) * u64::from(blob);
    if swap_len < size {
        space::reserve(&swap, &swap_path, size)?;
    }
    swap.sync_all().map_err(|source| StoreError::Io {
        what: "syncing swap file",
        path: swap_path.clone(),
        source,
    })?;

    // Past any run the headers or the old index know of, so that the next
    // start (one more) is a generation no client has seen. Runs that wrote
    // nothing to swap leave no header, and with the index lost nothing
    // records them: a client connected to one of those would take the
    // repaired store for the same run and its next FLUSH would not report
    // the lost writes. So the generation also jumps to a wall-clock floor
    // (seconds << 20) that no earlier run can have reached unless it
    // restarted a million times a second.
    let max_generation = (max_generation + 1).max(clock_floor());
    report.generation = max_generation;
    report.recovered = volumes
        .iter()
        .enumerate()
        .map(|(i, v)| {
            (
                v.name.clone(),
                blobs.keys().filter(|k| k.0 == i as u32).count() as u64,
            )
        })
        .collect();
    let names: Vec<&str> = volumes.iter().map(|v| v.name.as_str()).collect();
    Index::create(
        dir,
        extents,
        Snapshot {
            generation: max_generation,
            blob_bytes: blob,
            extents,
            volumes: &names,
            blob_count: blobs.len() as u64,
            blobs: blobs.iter().map(|(k, &(e, v))| (k.0, k.1, e, v)),
        },
    )?;
    tracing::info!(event = events::STORE_REPAIRED, dir = %dir.display(), blobs = blobs.len(), complete = report.complete(), "index rebuilt from the extent headers");
    Ok(report)
}

fn read_full(f: &DiskFile, buf: &mut [u8], offset: u64) -> io::Result<()> {
    debug_assert!(buf.len().is_multiple_of(BLOCK));
    f.read_exact_at(buf, offset)
}

/// A generation above any a store can have reached before now: wall-clock
/// seconds shifted left by 20 bits (starts add one each).
fn clock_floor() -> u64 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    secs << 20
}
