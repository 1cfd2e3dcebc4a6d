//! The journal: a preallocated file of 512-byte blocks; each commit appends
//! one *batch* of records (whole blocks) and syncs it.
//!
//! The format is built so that replay can tell a torn append (a crash
//! before the commit was acknowledged: drop it) from damage to records that
//! were acknowledged (refuse to start):
//!
//! - The file never changes size (its length is in the checkpoint), and
//!   everything past the last append is zeros (a reset zeroes what the old
//!   epoch wrote before it writes the new header). A cut file is refused.
//! - Every block carries its own CRC, the epoch, its batch number and its
//!   place in the batch. A sector is written whole or not at all, so a
//!   crash leaves each block of the last batch either complete or still
//!   zero; a non-zero block failing its CRC is damage, never a tear.
//! - Only the last batch may have zero (missing) blocks, and nothing but
//!   zeros may follow it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use ublk_metrics::events;

use super::error::{io_err, refused, Refusal, StoreError};
use super::format::{Record, Version, FORMAT_VERSION};
use super::space::{self, sync_dir};

pub(super) const JOURNAL_FILE: &str = "index.journal";
const MAGIC: [u8; 4] = *b"ARNJ";
const BLOCK_MAGIC: [u8; 4] = *b"ARJB";
/// The header block: magic, version, epoch, CRC32C of those 16 bytes.
const HEADER: u64 = 512;
const BLOCK: usize = 512;
/// magic, part, parts, records, bytes used, epoch, batch.
const BLOCK_HEADER: usize = 4 + 4 + 4 + 2 + 2 + 8 + 8;
const PAYLOAD: usize = BLOCK - BLOCK_HEADER - 4;
const REC_PUT: u8 = 1;
const REC_REMOVE: u8 = 2;
/// type, volume, key, extent, generation, seq.
const PUT_LEN: usize = 1 + 4 + 8 + 4 + 8 + 8;
/// type, volume, key.
const REMOVE_LEN: usize = 1 + 4 + 8;
/// Records of the largest kind one block holds.
const RECORDS_PER_BLOCK: u64 = (PAYLOAD / PUT_LEN) as u64;
/// A journal never holds fewer records than this, so small stores do not
/// checkpoint on every flush.
const MIN_RECORDS: u64 = 64;

/// The size of the journal of a store with `extents` extents: room for one
/// record per extent. One commit never has more (its records each stand
/// for a distinct extent: a new image's or a removed blob's durable one),
/// so a commit always fits an empty journal, and one that does not fit
/// what is left is preceded by a checkpoint.
pub(super) fn capacity(extents: u32) -> u64 {
    let records = u64::from(extents).max(MIN_RECORDS);
    HEADER + (records.div_ceil(RECORDS_PER_BLOCK) + 1) * BLOCK as u64
}

fn header(epoch: u64) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&epoch.to_le_bytes());
    let crc = crc32c::crc32c(&h[..16]);
    h[16..].copy_from_slice(&crc.to_le_bytes());
    h
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap_or_default())
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap_or_default())
}

/// The open journal.
pub(super) struct Journal {
    file: File,
    path: PathBuf,
    capacity: u64,
    epoch: u64,
    /// Bytes in use: the header and the batches appended.
    len: u64,
    /// Bytes that may be non-zero (a torn batch found at open lies past `len`).
    dirty: u64,
    batch: u64,
    /// A failed append could not be zeroed again: what follows `len` may be
    /// a partial batch, so nothing may be appended until a reset.
    broken: bool,
    /// The header on disk is not `epoch`'s yet (a reset failed half-way).
    stale: bool,
}

/// What replay found.
pub(super) struct Replayed {
    pub(super) epoch: u64,
    /// (file offset, record) of every complete batch, in order; empty when
    /// `epoch` is not the one asked for.
    pub(super) records: Vec<(u64, Record)>,
    /// Bytes that may be non-zero.
    pub(super) dirty: u64,
}

impl Journal {
    /// Creates the file with `capacity` bytes reserved, empty, for `epoch`.
    pub(super) fn create(dir: &Path, epoch: u64, capacity: u64) -> Result<Journal, StoreError> {
        let path = dir.join(JOURNAL_FILE);
        let file = space::create(&path, capacity)?;
        file.write_all_at(&header(epoch), 0)
            .and_then(|()| file.sync_all())
            .map_err(io_err("writing journal", &path))?;
        sync_dir(dir)?;
        Ok(Journal {
            file,
            path,
            capacity,
            epoch,
            len: HEADER,
            dirty: HEADER,
            batch: 0,
            broken: false,
            stale: false,
        })
    }

    /// Opens the journal replay read (`dirty` bytes of which may be
    /// non-zero) and empties it for `epoch`, with room for `capacity` bytes
    /// (see [`grow`]). Never shrinks the file: a longer journal is read to
    /// its end, and its tail is zeros.
    pub(super) fn reopen(
        dir: &Path,
        dirty: u64,
        epoch: u64,
        capacity: u64,
    ) -> Result<Journal, StoreError> {
        let path = dir.join(JOURNAL_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err("opening journal", &path))?;
        let mut j = Journal {
            file,
            path,
            capacity,
            epoch: 0,
            len: HEADER,
            dirty,
            batch: 0,
            broken: false,
            stale: true,
        };
        j.reset(epoch)?;
        Ok(j)
    }

    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(super) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Empties the journal for `epoch`: the old epoch's blocks are zeroed
    /// and synced before the new header is written, so a crash in between
    /// leaves the old header (a stale journal, skipped) over zeros.
    pub(super) fn reset(&mut self, epoch: u64) -> Result<(), StoreError> {
        self.epoch = epoch;
        self.stale = true;
        let end = self.dirty;
        if end > HEADER {
            space::write_zeros(&self.file, HEADER, end - HEADER)
                .and_then(|()| self.file.sync_data())
                .map_err(io_err("clearing journal", &self.path))?;
        }
        self.file
            .write_all_at(&header(epoch), 0)
            .and_then(|()| self.file.sync_data())
            .map_err(io_err("writing journal header", &self.path))?;
        self.len = HEADER;
        self.dirty = HEADER;
        self.batch = 0;
        self.broken = false;
        self.stale = false;
        Ok(())
    }

    /// Whether `records` fit in what is left.
    pub(super) fn fits(&self, records: &[Record]) -> bool {
        self.len + encoded_len(records) <= self.capacity
    }

    /// Appends `records` as one batch and syncs it. On failure the batch's
    /// blocks are zeroed again, so the next append may take their place.
    pub(super) fn append(&mut self, records: &[Record]) -> Result<(), StoreError> {
        if self.stale {
            let epoch = self.epoch;
            self.reset(epoch)?;
        }
        if self.broken {
            return Err(refused(
                "appending to journal",
                &self.path,
                Refusal::JournalBroken,
            ));
        }
        if !self.fits(records) {
            let full = Refusal::JournalFull {
                records: records.len(),
                left: self.capacity - self.len,
            };
            return Err(refused("appending to journal", &self.path, full));
        }
        let buf = encode(records, self.epoch, self.batch + 1);
        self.dirty = self.dirty.max(self.len + buf.len() as u64);
        let res = self
            .file
            .write_all_at(&buf, self.len)
            .and_then(|()| self.file.sync_data());
        if let Err(e) = res {
            if space::write_zeros(&self.file, self.len, buf.len() as u64)
                .and_then(|()| self.file.sync_data())
                .is_err()
            {
                self.broken = true;
            }
            return Err(io_err("appending to journal", &self.path)(e));
        }
        self.len += buf.len() as u64;
        self.batch += 1;
        Ok(())
    }
}

/// Whether the journal holds no block (missing, or a header over zeros).
pub(super) fn is_blank(dir: &Path) -> Result<bool, StoreError> {
    let path = dir.join(JOURNAL_FILE);
    match std::fs::read(&path) {
        Ok(b) => Ok(b
            .get(HEADER as usize..)
            .is_none_or(|t| t.iter().all(|&x| x == 0))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(io_err("reading journal", &path)(e)),
    }
}

/// Makes the journal at least `capacity` bytes long (the added tail is
/// zeros); done before a checkpoint names the larger size, so the file is
/// never shorter than the newest checkpoint says.
pub(super) fn grow(dir: &Path, capacity: u64) -> Result<(), StoreError> {
    let path = dir.join(JOURNAL_FILE);
    let file = OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(io_err("opening journal", &path))?;
    let len = file
        .metadata()
        .map_err(io_err("reading metadata of journal", &path))?
        .len();
    if len < capacity {
        space::reserve(&file, &path, capacity)?;
        file.sync_all().map_err(io_err("syncing journal", &path))?;
    }
    Ok(())
}

fn record_len(r: &Record) -> usize {
    match r {
        Record::Put { .. } => PUT_LEN,
        Record::Remove { .. } => REMOVE_LEN,
    }
}

/// Records per block, greedily, in order.
fn pack(records: &[Record]) -> Vec<&[Record]> {
    let mut blocks = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, r) in records.iter().enumerate() {
        let n = record_len(r);
        if used + n > PAYLOAD {
            blocks.push(&records[start..i]);
            start = i;
            used = 0;
        }
        used += n;
    }
    if start < records.len() {
        blocks.push(&records[start..]);
    }
    blocks
}

fn encoded_len(records: &[Record]) -> u64 {
    (pack(records).len() * BLOCK) as u64
}

fn encode(records: &[Record], epoch: u64, batch: u64) -> Vec<u8> {
    let blocks = pack(records);
    let parts = blocks.len() as u32;
    let mut out = vec![0u8; blocks.len() * BLOCK];
    for (i, (recs, b)) in blocks.iter().zip(out.chunks_mut(BLOCK)).enumerate() {
        let mut o = BLOCK_HEADER;
        for r in *recs {
            match *r {
                Record::Put {
                    vol,
                    key,
                    extent,
                    version,
                } => {
                    b[o] = REC_PUT;
                    b[o + 1..o + 5].copy_from_slice(&vol.to_le_bytes());
                    b[o + 5..o + 13].copy_from_slice(&key.to_le_bytes());
                    b[o + 13..o + 17].copy_from_slice(&extent.to_le_bytes());
                    b[o + 17..o + 25].copy_from_slice(&version.generation.to_le_bytes());
                    b[o + 25..o + 33].copy_from_slice(&version.seq.to_le_bytes());
                    o += PUT_LEN;
                }
                Record::Remove { vol, key } => {
                    b[o] = REC_REMOVE;
                    b[o + 1..o + 5].copy_from_slice(&vol.to_le_bytes());
                    b[o + 5..o + 13].copy_from_slice(&key.to_le_bytes());
                    o += REMOVE_LEN;
                }
            }
        }
        b[..4].copy_from_slice(&BLOCK_MAGIC);
        b[4..8].copy_from_slice(&(i as u32).to_le_bytes());
        b[8..12].copy_from_slice(&parts.to_le_bytes());
        b[12..14].copy_from_slice(&(recs.len() as u16).to_le_bytes());
        b[14..16].copy_from_slice(&((o - BLOCK_HEADER) as u16).to_le_bytes());
        b[16..24].copy_from_slice(&epoch.to_le_bytes());
        b[24..32].copy_from_slice(&batch.to_le_bytes());
        let crc = crc32c::crc32c(&b[..BLOCK - 4]);
        b[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
    }
    out
}

/// A block's header fields.
struct BlockHead {
    part: u32,
    parts: u32,
    count: u16,
    used: u16,
    batch: u64,
}

fn parse_block(b: &[u8], epoch: u64) -> Result<BlockHead, String> {
    if b[..4] != BLOCK_MAGIC {
        return Err("bad block magic".into());
    }
    if crc32c::crc32c(&b[..BLOCK - 4]) != le32(&b[BLOCK - 4..]) {
        return Err("checksum mismatch".into());
    }
    let h = BlockHead {
        part: le32(&b[4..8]),
        parts: le32(&b[8..12]),
        count: u16::from_le_bytes([b[12], b[13]]),
        used: u16::from_le_bytes([b[14], b[15]]),
        batch: le64(&b[24..32]),
    };
    let e = le64(&b[16..24]);
    if e != epoch {
        return Err(format!(
            "block of epoch {e} in the journal of epoch {epoch}"
        ));
    }
    if h.parts == 0 || h.part >= h.parts || h.used as usize > PAYLOAD {
        return Err(format!("impossible part {} of {}", h.part, h.parts));
    }
    Ok(h)
}

fn decode(
    b: &[u8],
    h: &BlockHead,
    offset: u64,
    out: &mut Vec<(u64, Record)>,
) -> Result<(), String> {
    let mut p = &b[BLOCK_HEADER..BLOCK_HEADER + h.used as usize];
    for _ in 0..h.count {
        let (r, n) = match p.first() {
            Some(&REC_PUT) if p.len() >= PUT_LEN => (
                Record::Put {
                    vol: le32(&p[1..5]),
                    key: le64(&p[5..13]),
                    extent: le32(&p[13..17]),
                    version: Version {
                        generation: le64(&p[17..25]),
                        seq: le64(&p[25..33]),
                    },
                },
                PUT_LEN,
            ),
            Some(&REC_REMOVE) if p.len() >= REMOVE_LEN => (
                Record::Remove {
                    vol: le32(&p[1..5]),
                    key: le64(&p[5..13]),
                },
                REMOVE_LEN,
            ),
            t => return Err(format!("record of type {t:?} does not fit its block")),
        };
        out.push((offset, r));
        p = &p[n..];
    }
    if !p.is_empty() {
        return Err(format!("{} bytes after the last record", p.len()));
    }
    Ok(())
}

/// Reads the journal, which must be at least `capacity` bytes long (what
/// the checkpoint says it was preallocated to), and returns the
/// records of epoch `want` (none when the journal is of another epoch).
/// Damage anywhere but a torn last batch is an error naming the offset.
pub(super) fn replay(dir: &Path, capacity: u64, want: u64) -> Result<Replayed, StoreError> {
    let path = dir.join(JOURNAL_FILE);
    let corrupt = |offset: u64, detail: String| StoreError::Corrupt {
        file: path.clone(),
        detail: format!("at offset {offset}: {detail}"),
    };
    let buf = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(StoreError::Corrupt {
                file: path,
                detail: "is missing, so the records since the last checkpoint are lost; \
                         restore it or rebuild the index with arenad --repair"
                    .into(),
            })
        }
        Err(e) => return Err(io_err("reading journal", &path)(e)),
    };
    if buf.len() >= 8 && buf[..4] == MAGIC && le32(&buf[4..8]) != FORMAT_VERSION {
        return Err(StoreError::OldFormat {
            file: path,
            version: le32(&buf[4..8]),
        });
    }
    if (buf.len() as u64) < capacity {
        return Err(StoreError::Corrupt {
            file: path,
            detail: format!(
                "is {} bytes but was preallocated to {capacity}: truncated or replaced",
                buf.len()
            ),
        });
    }
    if buf[..4] != MAGIC || crc32c::crc32c(&buf[..16]) != le32(&buf[16..20]) {
        return Err(corrupt(0, "bad journal header".into()));
    }
    let epoch = le64(&buf[8..16]);
    if epoch != want {
        return Ok(Replayed {
            epoch,
            records: Vec::new(),
            dirty: buf.len() as u64,
        });
    }
    let blocks: Vec<&[u8]> = buf[HEADER as usize..].chunks(BLOCK).collect();
    let off = |i: usize| HEADER + (i * BLOCK) as u64;
    let zero = |b: &[u8]| b.iter().all(|&x| x == 0);
    let mut records = Vec::new();
    let mut pos = 0;
    let mut batch = 1u64;
    while pos < blocks.len() {
        // The batch starting here: its size from the first block present.
        let Some(first) = (pos..blocks.len()).find(|&i| !zero(blocks[i])) else {
            return Ok(Replayed {
                epoch,
                records,
                dirty: off(pos),
            });
        };
        let h = parse_block(blocks[first], epoch).map_err(|e| corrupt(off(first), e))?;
        if h.batch != batch || h.part as usize != first - pos {
            return Err(corrupt(
                off(first),
                format!(
                    "block {} of batch {} where block {} of batch {batch} belongs",
                    h.part,
                    h.batch,
                    first - pos
                ),
            ));
        }
        let end = pos + h.parts as usize;
        if end > blocks.len() {
            return Err(corrupt(
                off(first),
                format!("batch of {} blocks runs past the end", h.parts),
            ));
        }
        let mut recs = Vec::new();
        let mut complete = true;
        for (i, b) in blocks.iter().enumerate().take(end).skip(pos) {
            if zero(b) {
                complete = false;
                continue;
            }
            let bh = parse_block(b, epoch).map_err(|e| corrupt(off(i), e))?;
            if bh.batch != batch || bh.part as usize != i - pos || bh.parts != h.parts {
                return Err(corrupt(
                    off(i),
                    format!(
                        "block {} of {} of batch {} inside batch {batch}",
                        bh.part, bh.parts, bh.batch
                    ),
                ));
            }
            decode(b, &bh, off(i), &mut recs).map_err(|e| corrupt(off(i), e))?;
        }
        if !complete {
            // A torn last batch: never acknowledged, so dropped; nothing
            // may follow it.
            if let Some(i) = (end..blocks.len()).find(|&i| !zero(blocks[i])) {
                return Err(corrupt(off(i), "data after a torn batch".into()));
            }
            tracing::warn!(event = events::JOURNAL_TORN_TAIL, path = %path.display(), offset = off(pos), "dropping a torn last journal batch (a commit cut short by the crash)");
            return Ok(Replayed {
                epoch,
                records,
                dirty: off(end),
            });
        }
        records.extend(recs);
        pos = end;
        batch += 1;
    }
    Ok(Replayed {
        epoch,
        records,
        dirty: buf.len() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: u64) -> Record {
        Record::Put {
            vol: 0,
            key,
            extent: key as u32,
            version: Version {
                generation: 1,
                seq: key,
            },
        }
    }

    #[test]
    fn batches_replay_and_damage_is_told_from_a_tear() {
        let dir = tempfile::tempdir().unwrap();
        let cap = capacity(64);
        let mut j = Journal::create(dir.path(), 5, cap).unwrap();
        let big: Vec<Record> = (0..20).map(put).collect(); // two blocks
        j.append(&[put(100)]).unwrap();
        j.append(&big).unwrap();
        j.append(&[Record::Remove { vol: 0, key: 100 }]).unwrap();
        drop(j);
        let p = dir.path().join(JOURNAL_FILE);
        let good = std::fs::read(&p).unwrap();
        let r = replay(dir.path(), cap, 5).unwrap();
        assert_eq!(r.records.len(), 22);
        assert_eq!(r.records[1].1, put(0));
        assert_eq!(
            replay(dir.path(), cap, 6).unwrap().records.len(),
            0,
            "another epoch"
        );

        // The last batch torn (its only block missing) is dropped; so is a
        // two-block batch with either block missing.
        let mut b = good.clone();
        b[512 + 3 * 512..512 + 4 * 512].fill(0);
        std::fs::write(&p, &b).unwrap();
        assert_eq!(replay(dir.path(), cap, 5).unwrap().records.len(), 21);
        for missing in [1, 2] {
            let mut b = good.clone();
            b[512 + 3 * 512..].fill(0);
            b[512 + missing * 512..512 + (missing + 1) * 512].fill(0);
            std::fs::write(&p, &b).unwrap();
            assert_eq!(
                replay(dir.path(), cap, 5).unwrap().records.len(),
                1,
                "missing {missing}"
            );
        }
        // A missing block followed by a later batch is damage, as is any
        // flipped byte, even in the last record.
        let mut b = good.clone();
        b[512 + 512..512 + 2 * 512].fill(0);
        std::fs::write(&p, &b).unwrap();
        let e = replay(dir.path(), cap, 5).err().unwrap().to_string();
        assert!(
            e.contains("index.journal") && e.contains("offset 2048"),
            "{e}"
        );
        for at in [
            512 + 40,
            512 + 512 + 100,
            512 + 3 * 512 + 35,
            512 + 4 * 512 + 7,
        ] {
            let mut b = good.clone();
            b[at] ^= 0x10;
            std::fs::write(&p, &b).unwrap();
            let e = replay(dir.path(), cap, 5)
                .err()
                .expect("flip refused")
                .to_string();
            let block = 512 + (at - 512) / 512 * 512;
            assert!(e.contains(&format!("offset {block}")), "flip at {at}: {e}");
        }
        // Any cut is refused.
        for cut in [good.len() - 1, 512 + 512, 100] {
            std::fs::write(&p, &good[..cut]).unwrap();
            let e = replay(dir.path(), cap, 5).err().unwrap().to_string();
            assert!(e.contains("truncated"), "{e}");
        }
    }

    #[test]
    fn reset_clears_the_old_epoch_and_full_journals_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let cap = capacity(64);
        let mut j = Journal::create(dir.path(), 1, cap).unwrap();
        let all: Vec<Record> = (0..64).map(put).collect();
        assert!(j.fits(&all));
        j.append(&all).unwrap();
        assert!(!j.fits(&all));
        let e = j.append(&all).unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Refused {
                    refusal: Refusal::JournalFull { records: 64, .. },
                    ..
                }
            ),
            "{e:?}"
        );
        let path = dir.path().join(JOURNAL_FILE);
        let want = format!(
            "appending to journal {}: 64 records do not fit",
            path.display()
        );
        assert!(e.to_string().starts_with(&want), "{e}");
        j.reset(2).unwrap();
        j.append(&[put(1)]).unwrap();
        let b = std::fs::read(dir.path().join(JOURNAL_FILE)).unwrap();
        assert!(b[1024..].iter().all(|&x| x == 0), "old blocks zeroed");
        assert_eq!(replay(dir.path(), cap, 2).unwrap().records.len(), 1);
    }
}
