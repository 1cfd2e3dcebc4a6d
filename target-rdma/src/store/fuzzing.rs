//! The store's file decoders as the fuzz targets (`target-rdma/fuzz`) and
//! the corpus replay test call them: the input is a few configuration
//! values (what opening a store would pass) followed by the file's bytes,
//! written into a scratch directory for the decoder to read, since the
//! decoders read files, not buffers. The `*_round_trip` functions build
//! the values from the input instead, write them with the store's own
//! encoders and assert that the decoder gives them back; they return the
//! input that makes the matching `check_*` decode that file, which is how
//! the committed seed corpus is made.
//!
//! Not an interface of the store: hidden, and nothing else calls it.
#![doc(hidden)]

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use super::checkpoint::{self, CheckpointFile, CKPT_FILE};
use super::disk::StoreDir;
use super::extent::{self, Ident, MetaFile, META_FILE};
use super::format::{Record, Snapshot, Version};
use super::journal::{self, Journal, JOURNAL_FILE};

/// Reads little-endian values off the front of a fuzz input; missing
/// bytes read as zeros, so every input means something.
struct Take<'a>(&'a [u8]);

impl Take<'_> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let n = N.min(self.0.len());
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        b
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap_or_else(|e| panic!("scratch file {}: {e}", path.display()));
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    let path = dir.join(name);
    fs::read(&path).unwrap_or_else(|e| panic!("scratch file {}: {e}", path.display()))
}

/// Input: configured `blob_bytes` (u32), `extents` (u32), then the
/// checkpoint file.
pub fn check_checkpoint(dir: &Path, input: &[u8]) {
    let dir = &StoreDir::os(dir);
    let mut t = Take(input);
    let (blob_bytes, extents) = (t.u32(), t.u32());
    write(dir, CKPT_FILE, t.0);
    let _ = checkpoint::load(dir, blob_bytes, extents);
}

/// Writes a checkpoint twice (both slots) with the values the input
/// spells, loads it and asserts the newer slot comes back as written.
pub fn checkpoint_round_trip(dir: &Path, input: &[u8]) -> Vec<u8> {
    let dir = &StoreDir::os(dir);
    const BLOB_BYTES: u32 = 4096;
    let mut t = Take(input);
    let epoch = t.u64() >> 1;
    let (generation, journal_bytes) = (t.u64(), t.u64());
    let extents = u32::from(t.u8()) + 1;
    let names: Vec<String> = (0..t.u8() % 4 + 1)
        .map(|i| format!("vol-{i}-{}", t.u8()))
        .collect();
    let mut blobs = BTreeMap::new();
    while !t.is_empty() && blobs.len() < extents as usize {
        let vol = t.u32() % names.len() as u32;
        let key = t.u64();
        let extent = t.u32() % extents;
        let version = Version {
            generation: t.u64(),
            seq: t.u64(),
        };
        blobs.insert((vol, key), (extent, version));
    }
    let volumes: Vec<&str> = names.iter().map(String::as_str).collect();
    let snap = |generation| Snapshot {
        generation,
        blob_bytes: BLOB_BYTES,
        extents,
        volumes: &volumes,
        blob_count: blobs.len() as u64,
        blobs: blobs.iter().map(|(&(v, k), &(e, ver))| (v, k, e, ver)),
    };
    let slot_len = checkpoint::slot_len(&volumes, extents);
    let mut file = CheckpointFile::create(dir, slot_len, epoch, journal_bytes, snap(0))
        .expect("a checkpoint is written");
    file.write(epoch + 1, journal_bytes, snap(generation))
        .expect("a checkpoint is written");
    let loaded = checkpoint::load(dir, BLOB_BYTES, extents)
        .expect("a written checkpoint loads")
        .expect("the checkpoint exists");
    let image = &loaded.newest.image;
    assert_eq!(loaded.slot, 1, "the newer slot is the current one");
    assert_eq!(loaded.other, Ok(Some(epoch)), "the older slot is valid");
    assert_eq!(
        (image.epoch, image.generation, image.extents),
        (epoch + 1, generation, extents)
    );
    assert_eq!(loaded.newest.journal_bytes, journal_bytes);
    assert_eq!(image.volumes, names);
    assert_eq!(image.blobs, blobs);
    let mut seed = [BLOB_BYTES.to_le_bytes(), extents.to_le_bytes()].concat();
    seed.extend(read(dir, CKPT_FILE));
    seed
}

/// Input: the epoch replay wants (u64), the journal capacity the
/// checkpoint names (u64), then the journal file.
pub fn check_journal(dir: &Path, input: &[u8]) {
    let dir = &StoreDir::os(dir);
    let mut t = Take(input);
    let (want, capacity) = (t.u64(), t.u64());
    write(dir, JOURNAL_FILE, t.0);
    let _ = journal::replay(dir, capacity, want);
}

/// Appends batches of the records the input spells to a new journal,
/// replays it and asserts every appended record comes back in order.
pub fn journal_round_trip(dir: &Path, input: &[u8]) -> Vec<u8> {
    let dir = &StoreDir::os(dir);
    let mut t = Take(input);
    let epoch = t.u64();
    let capacity = journal::capacity(u32::from(t.u8()));
    let mut j = Journal::create(dir, epoch, capacity).expect("a journal is created");
    let mut appended = Vec::new();
    while !t.is_empty() {
        let batch: Vec<Record> = (0..t.u8() % 40 + 1)
            .map(|_| match t.u8() % 2 {
                0 => Record::Put {
                    vol: t.u32(),
                    key: t.u64(),
                    extent: t.u32(),
                    version: Version {
                        generation: t.u64(),
                        seq: t.u64(),
                    },
                },
                _ => Record::Remove {
                    vol: t.u32(),
                    key: t.u64(),
                },
            })
            .collect();
        if !j.fits(&batch) {
            break;
        }
        j.append(&batch).expect("a fitting batch is appended");
        appended.extend(batch);
    }
    drop(j);
    let replayed = journal::replay(dir, capacity, epoch).expect("a written journal replays");
    let records: Vec<Record> = replayed.records.into_iter().map(|(_, r)| r).collect();
    assert_eq!(replayed.epoch, epoch);
    assert_eq!(records, appended);
    let mut seed = [epoch.to_le_bytes(), capacity.to_le_bytes()].concat();
    seed.extend(read(dir, JOURNAL_FILE));
    seed
}

/// Input: configured `blob_bytes` (u32), then the extent table; every
/// whole record in it is read, as an index naming that many extents
/// would.
pub fn check_extent_table(dir: &Path, input: &[u8]) {
    let dir = &StoreDir::os(dir);
    let mut t = Take(input);
    let blob_bytes = t.u32();
    write(dir, META_FILE, t.0);
    let records = (t.0.len() as u64).saturating_sub(extent::meta_len(blob_bytes, 0))
        / extent::record_len(blob_bytes) as u64;
    let count = u32::try_from(records).unwrap_or(u32::MAX);
    if let Ok(table) = MetaFile::open(dir, blob_bytes, count, count) {
        let _ = table.read_all(count);
    }
}

/// Writes the headers the input spells into a new table, reads them back
/// and asserts each written one is valid and as written, the rest empty.
pub fn extent_table_round_trip(dir: &Path, input: &[u8]) -> Vec<u8> {
    let dir = &StoreDir::os(dir);
    let mut t = Take(input);
    let blob_bytes = 4096 << (t.u8() % 4);
    let extents = u32::from(t.u8() % 16) + 1;
    let blocks = blob_bytes as usize / extent::BLOCK;
    let table = MetaFile::create(dir, blob_bytes, extents).expect("a table is created");
    let mut want = vec![extent::Record::Empty; extents as usize];
    while !t.is_empty() {
        let at = t.u32() % extents;
        let id = Ident {
            volume: t.u64(),
            key: t.u64(),
            version: Version {
                generation: t.u64(),
                seq: t.u64(),
            },
        };
        let crcs: Vec<u32> = (0..blocks).map(|_| t.u32()).collect();
        table.write(at, &id, &crcs).expect("a header is written");
        want[at as usize] = extent::Record::Valid(id, crcs);
    }
    table.sync().expect("the table is synced");
    assert_eq!(table.read_all(extents).expect("the table reads"), want);
    drop(table);
    let mut seed = blob_bytes.to_le_bytes().to_vec();
    seed.extend(read(dir, META_FILE));
    seed
}
