//! The persistent index: (volume, key) -> swap extent and the version of
//! the image there, as a checkpoint ([`checkpoint`](super::checkpoint))
//! plus a journal of changes since it ([`journal`](super::journal)).
//!
//! Both only ever name extents whose bytes and headers were written and
//! synced before the record was, and an extent the durable index names is
//! never overwritten (write-backs are copy-on-write), so after a crash at
//! any point the index names only complete blob images.
//!
//! A journal belongs to the checkpoint whose epoch its header carries. A
//! checkpoint holds exactly what the previous checkpoint and its journal
//! held (a commit that does not fit the journal first checkpoints the state
//! before it, then journals it), and it is written before the journal is
//! reset. So a journal of an older epoch is stale and skipped, and one of a
//! newer epoch than any valid checkpoint slot means the checkpoint it needs
//! is damaged: refused, not replaced by the older one.

use std::collections::HashMap;
use std::path::Path;
use ublk_metrics::events;

use super::checkpoint::{self, CheckpointFile};
use super::disk::StoreDir;
use super::error::{corrupt, swap_shrunk, StoreError};
use super::format::{Image, Record, Snapshot, Version};
use super::journal::{self, Journal, Place};

pub(super) use super::checkpoint::CKPT_FILE;
pub(super) use super::journal::JOURNAL_FILE;

/// A store found on disk: its index, and what reopening its files needs.
pub(super) struct Found {
    pub(super) image: Image,
    slot: usize,
    slot_len: u64,
    journal_bytes: u64,
    journal_dirty: u64,
    /// What a start goes on with but `arenad --check` tells.
    pub(super) seen: Seen,
}

/// What a load noticed that does not stop a start.
pub(super) struct Seen {
    /// The checkpoint slot in use.
    pub(super) slot: usize,
    /// The other slot: its epoch when valid, else why it is not (it is
    /// overwritten by the start's checkpoint).
    pub(super) other: Result<Option<u64>, String>,
    /// The epoch of a journal skipped as stale.
    pub(super) stale_journal: Option<u64>,
    /// Complete journal batches replayed.
    pub(super) batches: u64,
    /// The journal header's synced mark.
    pub(super) synced: u64,
    /// A torn batch past the mark, dropped.
    pub(super) torn: Option<Place>,
}

/// The open index files and the checkpoint bookkeeping.
pub(super) struct Index {
    dir: StoreDir,
    checkpoint: CheckpointFile,
    journal: Journal,
    pub(super) journal_records: u64,
    pub(super) checkpoints: u64,
    /// Told how long each journal append and checkpoint took.
    pub(super) timing: Option<super::TimingHook>,
}

/// The newest checkpoint slot, its fields checked against each other.
struct Base {
    image: Image,
    slot: usize,
    slot_len: u64,
    journal_bytes: u64,
    other: Result<Option<u64>, String>,
    /// Which blob each mapped extent holds.
    owners: HashMap<u32, (u32, u64)>,
}

/// Loads the newest checkpoint slot and checks what its checksum cannot:
/// that its journal size is one, and that no extent is mapped twice.
fn base(dir: &StoreDir, blob_bytes: u32, extents: u32) -> Result<Option<Base>, StoreError> {
    let Some(loaded) = checkpoint::load(dir, blob_bytes, extents)? else {
        return Ok(None);
    };
    let checkpoint::Loaded {
        newest,
        slot,
        slot_len,
        other,
    } = loaded;
    let image = newest.image;
    let ckpt = dir.join(CKPT_FILE);
    let name = format!(
        "slot {slot} at offset {} (epoch {})",
        slot as u64 * slot_len,
        image.epoch
    );
    if !journal::is_capacity(newest.journal_bytes) {
        return Err(corrupt(
            &ckpt,
            format!(
                "{name}: field journal_bytes = {} is not a journal size (a 512-byte header and \
                 whole 512-byte blocks, {} to {} bytes)",
                newest.journal_bytes,
                journal::capacity(0),
                journal::MAX_CAPACITY
            ),
        ));
    }
    let mut owners = HashMap::with_capacity(image.blobs.len());
    for (&k, &(extent, _)) in &image.blobs {
        if let Some(o) = owners.insert(extent, k) {
            return Err(corrupt(
                &ckpt,
                format!(
                    "{name}: swap extent {extent} is mapped by two blobs ({} and {})",
                    blob_name(&image, o),
                    blob_name(&image, k)
                ),
            ));
        }
    }
    Ok(Some(Base {
        image,
        slot,
        slot_len,
        journal_bytes: newest.journal_bytes,
        other,
        owners,
    }))
}

fn blob_name(image: &Image, (vol, key): (u32, u64)) -> String {
    match image.volumes.get(vol as usize) {
        Some(name) => format!("volume {name:?} key {key}"),
        None => format!("volume {vol} key {key}"),
    }
}

/// Applies journal records to `base`'s image, each checked against it: a
/// record naming a volume the checkpoint lacks, an extent the swap did not
/// have when the checkpoint was written, or an extent another blob maps
/// is damage of its batch. An extent the swap had then but the configured
/// `extents` lacks is `swap_bytes` lowered.
fn apply(
    dir: &Path,
    base: &mut Base,
    records: &[(Place, Record)],
    extents: u32,
) -> Result<(), StoreError> {
    let jpath = dir.join(JOURNAL_FILE);
    let image = &mut base.image;
    for &(place, r) in records {
        let at = format!("batch {} at offset {}", place.batch, place.offset);
        let (Record::Put { vol, key, .. } | Record::Remove { vol, key }) = r;
        if vol as usize >= image.volumes.len() {
            return Err(corrupt(
                &jpath,
                format!(
                    "{at}: a record of key {key} names volume {vol}, the checkpoint has {}",
                    image.volumes.len()
                ),
            ));
        }
        match r {
            Record::Put {
                extent, version, ..
            } => {
                let blob = blob_name(image, (vol, key));
                if extent >= image.extents {
                    return Err(corrupt(
                        &jpath,
                        format!(
                            "{at}: the record of {blob} names swap extent {extent}, but the swap had {} \
                             extents when this journal's checkpoint was written",
                            image.extents
                        ),
                    ));
                }
                if extent >= extents {
                    return Err(swap_shrunk(extent, extents, image.extents));
                }
                if let Some(&o) = base.owners.get(&extent).filter(|&&o| o != (vol, key)) {
                    return Err(corrupt(
                        &jpath,
                        format!(
                            "{at}: the record of {blob} names swap extent {extent}, which {} maps",
                            blob_name(image, o)
                        ),
                    ));
                }
                if let Some((old, _)) = image.blobs.insert((vol, key), (extent, version)) {
                    base.owners.remove(&old);
                }
                base.owners.insert(extent, (vol, key));
            }
            Record::Remove { .. } => {
                if let Some((old, _)) = image.blobs.remove(&(vol, key)) {
                    base.owners.remove(&old);
                }
            }
        }
    }
    Ok(())
}

/// Loads the checkpoint and replays its journal; `None` when there is no
/// checkpoint (the caller decides whether that is a new store). A torn
/// last journal batch past the synced mark is dropped (it was never
/// acknowledged); any other damage, a journal cut short or missing, or a
/// journal that needs a checkpoint slot that is damaged, is an error
/// naming the file, the slot or batch, and the offset or field.
pub(super) fn load(
    dir: &StoreDir,
    blob_bytes: u32,
    extents: u32,
) -> Result<Option<Found>, StoreError> {
    let Some(mut base) = base(dir, blob_bytes, extents)? else {
        return Ok(None);
    };
    let jpath = dir.join(JOURNAL_FILE);
    let epoch = base.image.epoch;
    let replayed = journal::replay(dir, base.journal_bytes, epoch)?;
    if replayed.epoch > epoch {
        let why = match &base.other {
            Err(e) => e.clone(),
            Ok(Some(e)) => format!("the other slot holds epoch {e}"),
            Ok(None) => "the other slot is empty".into(),
        };
        return Err(corrupt(
            &dir.join(CKPT_FILE),
            format!(
                "{} belongs to checkpoint epoch {}, but the newest valid slot holds epoch {epoch} ({why}): \
                 the checkpoint it extends is damaged; rebuild with arenad --repair",
                jpath.display(),
                replayed.epoch,
            ),
        ));
    }
    let stale_journal = (replayed.epoch < epoch).then_some(replayed.epoch);
    if stale_journal.is_some() {
        tracing::warn!(event = events::JOURNAL_STALE, path = %jpath.display(), journal_epoch = replayed.epoch, checkpoint_epoch = epoch, "ignoring the journal of the previous checkpoint (a crash came between checkpoint and journal reset)");
    }
    if let Err(why) = &base.other {
        tracing::warn!(event = events::CHECKPOINT_SLOT_DAMAGED, path = %dir.join(CKPT_FILE).display(), slot = 1 - base.slot, in_use = base.slot, epoch, detail = %why, "the checkpoint slot not in use is damaged (a checkpoint cut short, or damage); this start's checkpoint overwrites it");
    }
    apply(dir, &mut base, &replayed.records, extents)?;
    Ok(Some(Found {
        image: base.image,
        slot: base.slot,
        slot_len: base.slot_len,
        journal_bytes: base.journal_bytes,
        journal_dirty: replayed.dirty,
        seen: Seen {
            slot: base.slot,
            other: base.other,
            stale_journal,
            batches: replayed.batches,
            synced: replayed.synced,
            torn: replayed.torn,
        },
    }))
}

/// What repair can still read of an index [`load`] refuses: the newest
/// valid checkpoint slot and the journal records before the first damage
/// (none when the journal extends another slot), and what that covers;
/// `None` when no checkpoint slot is usable.
pub(super) fn salvage(dir: &StoreDir, blob_bytes: u32, extents: u32) -> Option<(Image, String)> {
    let mut base = base(dir, blob_bytes, extents).ok()??;
    let epoch = base.image.epoch;
    let (replayed, damage) = journal::salvage(dir, base.journal_bytes, epoch);
    let journal = if replayed.epoch != epoch {
        format!(
            "not its journal, which is of epoch {} (the slot it extends is damaged, or it is stale)",
            replayed.epoch
        )
    } else {
        let applied = apply(dir, &mut base, &replayed.records, extents);
        let batches = replayed.batches;
        match (applied, damage) {
            (Ok(()), None) => format!("its {batches} journal batches"),
            (Ok(()), Some(_)) => format!("the {batches} journal batches before the damage"),
            (Err(_), _) => "the journal records before the damaged one".into(),
        }
    };
    let what = format!("checkpoint epoch {epoch} and {journal}");
    Some((base.image, what))
}

/// Whether the journal file holds nothing but a header: a store whose
/// creation was cut short before its checkpoint existed.
pub(super) fn journal_is_blank(dir: &StoreDir) -> Result<bool, StoreError> {
    journal::is_blank(dir)
}

impl Index {
    /// The index of a new store: an empty journal, then the first
    /// checkpoint, whose appearance is what makes the store exist.
    pub(super) fn create<I>(
        dir: &StoreDir,
        extents: u32,
        snap: Snapshot<'_, I>,
    ) -> Result<Index, StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        let epoch = 1;
        let capacity = journal::capacity(extents);
        let journal = Journal::create(dir, epoch, capacity)?;
        let slot_len = checkpoint::slot_len(snap.volumes, extents);
        let checkpoint = CheckpointFile::create(dir, slot_len, epoch, capacity, snap)?;
        Ok(Index::new(dir, checkpoint, journal))
    }

    /// Reopens a found store's index for a new run: a checkpoint of `snap`
    /// (what was found, renumbered for this run) with the next epoch, then
    /// an empty journal for it.
    pub(super) fn reopen<I>(
        dir: &StoreDir,
        found: Found,
        extents: u32,
        snap: Snapshot<'_, I>,
    ) -> Result<Index, StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        let epoch = found.image.epoch + 1;
        // A slot-growing checkpoint cut short by a crash left this behind.
        let _ = std::fs::remove_file(dir.join(format!("{CKPT_FILE}.tmp")));
        let capacity = journal::capacity(extents).max(found.journal_bytes);
        journal::grow(dir, capacity)?;
        let need = checkpoint::slot_len(snap.volumes, extents);
        let checkpoint = if need > found.slot_len {
            CheckpointFile::create(dir, need, epoch, capacity, snap)?
        } else {
            let mut c = CheckpointFile::reopen(dir, found.slot_len, found.slot)?;
            c.write(epoch, capacity, snap)?;
            c
        };
        let journal = Journal::reopen(dir, found.journal_dirty, epoch, capacity)?;
        Ok(Index::new(dir, checkpoint, journal))
    }

    fn new(dir: &StoreDir, checkpoint: CheckpointFile, journal: Journal) -> Index {
        Index {
            dir: dir.clone(),
            checkpoint,
            journal,
            journal_records: 0,
            checkpoints: 1,
            timing: None,
        }
    }

    /// Makes `records` durable: appended to the journal, after a checkpoint
    /// of the index as it stands (`before`, not yet changed by `records`)
    /// when they do not fit what is left of it. Runs under the store lock,
    /// and never allocates disk space.
    pub(super) fn commit<'a, I>(
        &mut self,
        records: &[Record],
        before: impl FnOnce() -> Snapshot<'a, I>,
    ) -> Result<(), StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        if !self.journal.fits(records) {
            let epoch = self.journal.epoch() + 1;
            let started = std::time::Instant::now();
            self.checkpoint
                .write(epoch, self.journal_capacity(), before())?;
            if let Some(hook) = &self.timing {
                hook(super::IndexWrite::Checkpoint, started.elapsed());
            }
            self.checkpoints += 1;
            // The new checkpoint holds everything the old journal did; a
            // reset that fails here is retried by the append below.
            if let Err(e) = self.journal.reset(epoch) {
                tracing::warn!(event = events::JOURNAL_RESET_FAILED, path = %self.dir.join(JOURNAL_FILE).display(), error = %e, "resetting the journal after a checkpoint failed; retrying on append");
            }
        }
        let started = std::time::Instant::now();
        self.journal.append(records)?;
        if let Some(hook) = &self.timing {
            hook(super::IndexWrite::Journal, started.elapsed());
        }
        self.journal_records += records.len() as u64;
        Ok(())
    }

    /// Writes a checkpoint of `snap` (the durable index as it stands) now
    /// and starts the journal over, so the index names every volume of
    /// `snap`: a volume configured while running must be named before a
    /// journal record refers to it. Slots too small for the new names are
    /// replaced by a larger file, as at open.
    pub(super) fn checkpoint_now<I>(&mut self, snap: Snapshot<'_, I>) -> Result<(), StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        let epoch = self.journal.epoch() + 1;
        let capacity = self.journal_capacity();
        let started = std::time::Instant::now();
        let need = checkpoint::slot_len(snap.volumes, snap.extents);
        if need > self.checkpoint.slot_len() {
            self.checkpoint = CheckpointFile::create(&self.dir, need, epoch, capacity, snap)?;
        } else {
            self.checkpoint.write(epoch, capacity, snap)?;
        }
        if let Some(hook) = &self.timing {
            hook(super::IndexWrite::Checkpoint, started.elapsed());
        }
        self.checkpoints += 1;
        self.journal.reset(epoch)
    }

    fn journal_capacity(&self) -> u64 {
        self.journal.capacity()
    }
}
