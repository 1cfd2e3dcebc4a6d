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
//! - The header carries a *synced mark*: the highest batch whose append
//!   was synced. It is rewritten (not synced) right after each append's
//!   sync returns, so it never names a batch before that batch is durable,
//!   and the next append's sync (or the close) makes it durable: one sync
//!   per commit, as without it. A batch at or below the mark that is
//!   missing or incomplete was acknowledged and then lost: damage, not a
//!   tear. Only what lies past the mark (at most the last acknowledged
//!   batch, until something syncs the header, and an unacknowledged one)
//!   is dropped as a tear. A header without a mark (all zeros there, as
//!   written by builds before the mark) protects nothing more than before.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use ublk_metrics::events;

use super::disk::{DiskFile, Role, StoreDir};

use super::error::{io_err, refused, Refusal, StoreError};
use super::format::{Record, Version, FORMAT_VERSION};
use super::space::{self, sync_dir};

pub(super) const JOURNAL_FILE: &str = "index.journal";
const MAGIC: [u8; 4] = *b"ARNJ";
const BLOCK_MAGIC: [u8; 4] = *b"ARJB";
/// The header block: magic, version, epoch, CRC32C of those 16 bytes; then
/// the synced mark at [`MARK_AT`].
const HEADER: u64 = 512;
/// The synced mark: the epoch again, the highest synced batch, CRC32C of
/// those 16 bytes; all zeros when no batch is marked.
const MARK_AT: usize = 20;
/// Bytes of the header block in use.
const HEAD_LEN: usize = MARK_AT + 8 + 8 + 4;
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
/// The largest journal any store can have: the one of the largest swap.
pub(super) const MAX_CAPACITY: u64 = capacity(u32::MAX);

/// The size of the journal of a store with `extents` extents: room for one
/// record per extent. One commit never has more (its records each stand
/// for a distinct extent: a new image's or a removed blob's durable one),
/// so a commit always fits an empty journal, and one that does not fit
/// what is left is preceded by a checkpoint.
pub(super) const fn capacity(extents: u32) -> u64 {
    let records = if (extents as u64) < MIN_RECORDS {
        MIN_RECORDS
    } else {
        extents as u64
    };
    HEADER + (records.div_ceil(RECORDS_PER_BLOCK) + 1) * BLOCK as u64
}

/// Whether `bytes` can be the size of a journal (what a checkpoint's
/// `journal_bytes` field may say): a header and whole blocks, no larger
/// than the journal of the largest swap.
pub(super) fn is_capacity(bytes: u64) -> bool {
    (capacity(0)..=MAX_CAPACITY).contains(&bytes) && (bytes - HEADER).is_multiple_of(BLOCK as u64)
}

/// The header of the journal of `epoch` whose batches up to `synced` were
/// synced (0: none).
fn header(epoch: u64, synced: u64) -> [u8; HEAD_LEN] {
    let mut h = [0u8; HEAD_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&epoch.to_le_bytes());
    let crc = crc32c::crc32c(&h[..16]);
    h[16..20].copy_from_slice(&crc.to_le_bytes());
    if synced > 0 {
        let m = &mut h[MARK_AT..];
        m[..8].copy_from_slice(&epoch.to_le_bytes());
        m[8..16].copy_from_slice(&synced.to_le_bytes());
        let crc = crc32c::crc32c(&m[..16]);
        m[16..].copy_from_slice(&crc.to_le_bytes());
    }
    h
}

/// What the header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Head {
    pub(super) epoch: u64,
    /// Batches `1..=synced` were synced before the mark was written.
    pub(super) synced: u64,
}

/// Decodes the header block (or as much of the file as there is). A mark
/// naming another epoch than the header's is no mark: a build before the
/// mark rewrote the header's first 20 bytes at a reset and left it.
pub(super) fn decode_header(b: &[u8]) -> Result<Head, String> {
    let Some(h) = b.get(..HEAD_LEN) else {
        return Err(format!(
            "bad journal header: {} bytes, shorter than its {HEAD_LEN}",
            b.len()
        ));
    };
    if h[..4] != MAGIC {
        return Err("bad journal header: bad magic, expected \"ARNJ\"".into());
    }
    if crc32c::crc32c(&h[..16]) != le32(&h[16..20]) {
        return Err("bad journal header: checksum mismatch".into());
    }
    let epoch = le64(&h[8..16]);
    let m = &h[MARK_AT..];
    if m.iter().all(|&x| x == 0) {
        return Ok(Head { epoch, synced: 0 });
    }
    if crc32c::crc32c(&m[..16]) != le32(&m[16..]) {
        return Err(format!(
            "bad journal header: the synced mark at offset {MARK_AT} fails its checksum"
        ));
    }
    let synced = if le64(&m[..8]) == epoch {
        le64(&m[8..16])
    } else {
        0
    };
    Ok(Head { epoch, synced })
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap_or_default())
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap_or_default())
}

/// The open journal.
pub(super) struct Journal {
    file: DiskFile,
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
    /// The header's synced mark was rewritten since the file was last
    /// synced: the close syncs it.
    mark_unsynced: bool,
}

/// Where a record was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    /// Its batch (from 1 in each epoch).
    pub(super) batch: u64,
    /// File offset of its block.
    pub(super) offset: u64,
}

/// What replay found.
pub(super) struct Replayed {
    pub(super) epoch: u64,
    /// The place and record of every complete batch, in order; empty when
    /// `epoch` is not the one asked for.
    pub(super) records: Vec<(Place, Record)>,
    /// Bytes that may be non-zero.
    pub(super) dirty: u64,
    /// Complete batches read.
    pub(super) batches: u64,
    /// The header's synced mark (0: none).
    pub(super) synced: u64,
    /// A torn last batch past the mark (never acknowledged), dropped:
    /// its number and the offset of its first block.
    pub(super) torn: Option<Place>,
}

impl Journal {
    /// Creates the file with `capacity` bytes reserved, empty, for `epoch`.
    pub(super) fn create(dir: &StoreDir, epoch: u64, capacity: u64) -> Result<Journal, StoreError> {
        let path = dir.join(JOURNAL_FILE);
        let file = space::create(dir, Role::Journal, &path, capacity)?;
        file.write_all_at(&header(epoch, 0), 0)
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
            mark_unsynced: false,
        })
    }

    /// Opens the journal replay read (`dirty` bytes of which may be
    /// non-zero) and empties it for `epoch`, with room for `capacity` bytes
    /// (see [`grow`]). Never shrinks the file: a longer journal is read to
    /// its end, and its tail is zeros.
    pub(super) fn reopen(
        dir: &StoreDir,
        dirty: u64,
        epoch: u64,
        capacity: u64,
    ) -> Result<Journal, StoreError> {
        let path = dir.join(JOURNAL_FILE);
        let file = dir
            .open(
                Role::Journal,
                &path,
                OpenOptions::new().read(true).write(true),
            )
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
            mark_unsynced: false,
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
    /// and synced before the new header (with no mark) is written, so a
    /// crash in between leaves the old header (a stale journal, skipped)
    /// over zeros.
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
            .write_all_at(&header(epoch, 0), 0)
            .and_then(|()| self.file.sync_data())
            .map_err(io_err("writing journal header", &self.path))?;
        self.len = HEADER;
        self.dirty = HEADER;
        self.batch = 0;
        self.broken = false;
        self.stale = false;
        self.mark_unsynced = false;
        Ok(())
    }

    /// Whether `records` fit in what is left.
    pub(super) fn fits(&self, records: &[Record]) -> bool {
        self.len + encoded_len(records) <= self.capacity
    }

    /// Appends `records` as one batch and syncs it, then marks it synced
    /// in the header (unsynced: the next sync carries it). On failure the
    /// batch's blocks are zeroed again, so the next append may take their
    /// place.
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
        self.mark_unsynced = false;
        self.mark();
        Ok(())
    }

    /// Records in the header that batches up to `batch` are synced. A
    /// failure costs only the check at the next start, so it is logged,
    /// and the next append writes the mark again.
    fn mark(&mut self) {
        match self.file.write_all_at(&header(self.epoch, self.batch), 0) {
            Ok(()) => self.mark_unsynced = true,
            Err(e) => {
                tracing::warn!(event = events::JOURNAL_MARK_FAILED, path = %self.path.display(), batch = self.batch, error = %e, "could not mark a synced journal batch in the journal header; a later loss of that batch would not be noticed at start")
            }
        }
    }
}

impl Drop for Journal {
    /// Syncs the last synced mark, so that after a clean close every
    /// acknowledged batch is one the next start insists on.
    fn drop(&mut self) {
        if self.mark_unsynced {
            if let Err(e) = self.file.sync_data() {
                tracing::warn!(event = events::JOURNAL_MARK_FAILED, path = %self.path.display(), batch = self.batch, error = %e, "could not sync the journal header's synced mark at close");
            }
        }
    }
}

/// Whether the journal holds no block (missing, or a header over zeros).
pub(super) fn is_blank(dir: &StoreDir) -> Result<bool, StoreError> {
    let path = dir.join(JOURNAL_FILE);
    match dir.read(Role::Journal, &path) {
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
pub(super) fn grow(dir: &StoreDir, capacity: u64) -> Result<(), StoreError> {
    let path = dir.join(JOURNAL_FILE);
    let file = dir
        .open(Role::Journal, &path, OpenOptions::new().write(true))
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BlockHead {
    pub(super) part: u32,
    pub(super) parts: u32,
    pub(super) count: u16,
    pub(super) used: u16,
    pub(super) batch: u64,
}

/// Decodes one 512-byte block's header of the journal of `epoch`; an error
/// names the field that is wrong.
pub(super) fn parse_block(b: &[u8], epoch: u64) -> Result<BlockHead, String> {
    if b.len() != BLOCK {
        return Err(format!("a block of {} bytes, not {BLOCK}", b.len()));
    }
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
    if h.parts == 0 || h.part >= h.parts {
        return Err(format!(
            "impossible field part = {} of parts = {}",
            h.part, h.parts
        ));
    }
    if h.used as usize > PAYLOAD {
        return Err(format!(
            "field used = {} is more than the {PAYLOAD} bytes a block holds",
            h.used
        ));
    }
    Ok(h)
}

/// Decodes the `h.count` records of block `b` (whose header is `h`) into
/// `out`, each with `place`; an error names the record that is wrong.
pub(super) fn decode_records(
    b: &[u8],
    h: &BlockHead,
    place: Place,
    out: &mut Vec<(Place, Record)>,
) -> Result<(), String> {
    let used = BLOCK_HEADER + h.used as usize;
    let Some(mut p) = b.get(BLOCK_HEADER..used.min(BLOCK - 4)) else {
        return Err(format!("a block of {} bytes, not {BLOCK}", b.len()));
    };
    if p.len() != h.used as usize {
        return Err(format!(
            "field used = {} is more than the {PAYLOAD} bytes a block holds",
            h.used
        ));
    }
    for i in 0..h.count {
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
            t => {
                return Err(format!(
                    "record {i} of field records = {} (type {t:?}) does not fit the field used = {} bytes",
                    h.count, h.used
                ))
            }
        };
        out.push((place, r));
        p = &p[n..];
    }
    if !p.is_empty() {
        return Err(format!(
            "{} bytes after the last of field records = {} (field used = {})",
            p.len(),
            h.count,
            h.used
        ));
    }
    Ok(())
}

/// Reads the journal, which must be at least `capacity` bytes long (what
/// the checkpoint says it was preallocated to), and returns the records of
/// epoch `want` (none when the journal is of another epoch). Damage
/// anywhere but a torn last batch past the synced mark is an error naming
/// the offset and the batch; the torn batch is dropped with a note.
pub(super) fn replay(dir: &StoreDir, capacity: u64, want: u64) -> Result<Replayed, StoreError> {
    let path = dir.join(JOURNAL_FILE);
    let buf = read(dir, &path)?;
    let (replayed, damage) = scan(&path, &buf, capacity, want);
    if let Some(e) = damage {
        return Err(e);
    }
    if let Some(t) = replayed.torn {
        tracing::info!(event = events::JOURNAL_TORN_TAIL, path = %path.display(), offset = t.offset, batch = t.batch, synced = replayed.synced, "dropping a torn last journal batch past the synced mark (a commit cut short by the crash, never acknowledged)");
    }
    Ok(replayed)
}

/// What replay reads of a damaged journal: what it read before the
/// damage (the records of the complete batches, when the journal is of
/// epoch `want`), and the damage (none when it is whole).
pub(super) fn salvage(dir: &StoreDir, capacity: u64, want: u64) -> (Replayed, Option<StoreError>) {
    let path = dir.join(JOURNAL_FILE);
    match read(dir, &path) {
        Ok(buf) => scan(&path, &buf, capacity, want),
        Err(e) => {
            let nothing = Replayed {
                epoch: want,
                records: Vec::new(),
                dirty: 0,
                batches: 0,
                synced: 0,
                torn: None,
            };
            (nothing, Some(e))
        }
    }
}

fn read(dir: &StoreDir, path: &Path) -> Result<Vec<u8>, StoreError> {
    match dir.read(Role::Journal, path) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(StoreError::Corrupt {
            file: path.to_path_buf(),
            detail: "is missing, so the records since the last checkpoint are lost; \
                     restore it or rebuild the index with arenad --repair"
                .into(),
        }),
        Err(e) => Err(io_err("reading journal", path)(e)),
    }
}

/// Decodes journal file `buf` (read from `path`) as [`replay`] does, over
/// bytes: what it read up to the first damage, and that damage.
pub(super) fn scan(
    path: &Path,
    buf: &[u8],
    capacity: u64,
    want: u64,
) -> (Replayed, Option<StoreError>) {
    let corrupt = |detail: String| StoreError::Corrupt {
        file: path.to_path_buf(),
        detail,
    };
    // Until the header is read, the epoch asked for: a journal damaged
    // before its header tells is salvaged as its checkpoint's.
    let mut r = Replayed {
        epoch: want,
        records: Vec::new(),
        dirty: buf.len() as u64,
        batches: 0,
        synced: 0,
        torn: None,
    };
    if buf.len() >= 8 && buf[..4] == MAGIC && le32(&buf[4..8]) != FORMAT_VERSION {
        let e = StoreError::OldFormat {
            file: path.to_path_buf(),
            version: le32(&buf[4..8]),
        };
        return (r, Some(e));
    }
    if (buf.len() as u64) < capacity {
        let e = corrupt(format!(
            "is {} bytes but was preallocated to {capacity} (the checkpoint's journal_bytes): truncated or replaced",
            buf.len()
        ));
        return (r, Some(e));
    }
    let Some(body) = buf.get(HEADER as usize..) else {
        let e = corrupt(format!(
            "is {} bytes, shorter than its {HEADER}-byte header block: truncated or replaced",
            buf.len()
        ));
        return (r, Some(e));
    };
    let head = match decode_header(buf) {
        Ok(h) => h,
        Err(e) => return (r, Some(corrupt(format!("at offset 0: {e}")))),
    };
    r.epoch = head.epoch;
    r.synced = head.synced;
    if head.epoch != want {
        return (r, None);
    }
    let blocks = body.chunks_exact(BLOCK);
    let tail = blocks.remainder();
    if tail.iter().any(|&x| x != 0) {
        let at = buf.len() - tail.len();
        let e = corrupt(format!(
            "at offset {at}: {} bytes that are not a whole block (the file is not a whole number of {BLOCK}-byte blocks)",
            tail.len()
        ));
        return (r, Some(e));
    }
    let blocks: Vec<&[u8]> = blocks.collect();
    let damage = scan_batches(&blocks, head, &mut r).err().map(corrupt);
    (r, damage)
}

/// The batches of `blocks` (after the header): records into `r`, the
/// first damage as its message.
fn scan_batches(blocks: &[&[u8]], head: Head, r: &mut Replayed) -> Result<(), String> {
    let off = |i: usize| HEADER + (i * BLOCK) as u64;
    let zero = |b: &[u8]| b.iter().all(|&x| x == 0);
    let synced = head.synced;
    let lost = |batch: u64, at: u64, what: String| {
        format!(
            "at offset {at}: batch {batch} {what}, but the journal header marks batches 1 to {synced} as synced: \
             an acknowledged commit is lost; restore the file or rebuild the index with arenad --repair"
        )
    };
    let mut pos = 0;
    let mut batch = 1u64;
    loop {
        // The batch starting here: its size from the first block present.
        let Some(first) = (pos..blocks.len()).find(|&i| !zero(blocks[i])) else {
            if batch <= synced {
                return Err(lost(
                    batch,
                    off(pos),
                    "is missing (zeros to the end)".into(),
                ));
            }
            r.dirty = off(pos);
            return Ok(());
        };
        let at = |i: usize| format!("at offset {} (batch {batch})", off(i));
        let h =
            parse_block(blocks[first], head.epoch).map_err(|e| format!("{}: {e}", at(first)))?;
        if h.batch != batch || h.part as usize != first - pos {
            let found = format!(
                "block {} of batch {} where block {} of batch {batch} belongs",
                h.part,
                h.batch,
                first - pos
            );
            if batch <= synced {
                return Err(lost(batch, off(pos), format!("is missing ({found})")));
            }
            return Err(format!("at offset {}: {found}", off(first)));
        }
        let end = pos
            .checked_add(h.parts as usize)
            .filter(|&e| e <= blocks.len())
            .ok_or_else(|| {
                format!(
                    "{}: field parts = {} runs past the end of the file ({} blocks left)",
                    at(first),
                    h.parts,
                    blocks.len() - pos
                )
            })?;
        let mut recs = Vec::new();
        let mut missing = None;
        for (i, b) in blocks.iter().enumerate().take(end).skip(pos) {
            if zero(b) {
                missing = missing.or(Some(i));
                continue;
            }
            let bh = parse_block(b, head.epoch).map_err(|e| format!("{}: {e}", at(i)))?;
            if bh.batch != batch || bh.part as usize != i - pos || bh.parts != h.parts {
                return Err(format!(
                    "{}: block {} of {} of batch {} inside batch {batch} of {} blocks",
                    at(i),
                    bh.part,
                    bh.parts,
                    bh.batch,
                    h.parts
                ));
            }
            let place = Place {
                batch,
                offset: off(i),
            };
            decode_records(b, &bh, place, &mut recs).map_err(|e| format!("{}: {e}", at(i)))?;
        }
        if let Some(m) = missing {
            if batch <= synced {
                let what = format!("is incomplete (its block at offset {} is zeros)", off(m));
                return Err(lost(batch, off(pos), what));
            }
            // A torn last batch: never acknowledged, so dropped; nothing
            // may follow it.
            if let Some(i) = (end..blocks.len()).find(|&i| !zero(blocks[i])) {
                return Err(format!(
                    "at offset {}: data after the torn batch {batch} at offset {}",
                    off(i),
                    off(pos)
                ));
            }
            r.torn = Some(Place {
                batch,
                offset: off(pos),
            });
            r.dirty = off(end);
            return Ok(());
        }
        r.records.extend(recs);
        r.batches = batch;
        pos = end;
        batch += 1;
    }
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

    /// A journal of epoch 5 with three batches: one block (offset 512),
    /// two blocks (1024, 1536), one block (2048); and the file as it was
    /// after each batch's append returned (its header marking it synced).
    fn three_batches(dir: &Path) -> (u64, [Vec<u8>; 3]) {
        let cap = capacity(64);
        let p = dir.join(JOURNAL_FILE);
        let mut j = Journal::create(&StoreDir::os(dir), 5, cap).unwrap();
        j.append(&[put(100)]).unwrap();
        let one = std::fs::read(&p).unwrap();
        j.append(&(0..20).map(put).collect::<Vec<_>>()).unwrap();
        let two = std::fs::read(&p).unwrap();
        j.append(&[Record::Remove { vol: 0, key: 100 }]).unwrap();
        drop(j);
        (cap, [one, two, std::fs::read(&p).unwrap()])
    }

    fn replay_bytes(b: &[u8], cap: u64) -> Result<Replayed, StoreError> {
        let (r, damage) = scan(Path::new(JOURNAL_FILE), b, cap, 5);
        damage.map_or(Ok(r), Err)
    }

    fn refused(b: &[u8], cap: u64) -> String {
        match replay_bytes(b, cap) {
            Ok(r) => panic!("replayed {} records", r.records.len()),
            Err(e) => e.to_string(),
        }
    }

    /// Sets `value` at `range` of the block at `at` and fixes its CRC, as
    /// a writer with a bug would leave it.
    fn set_block_field(b: &mut [u8], at: usize, range: std::ops::Range<usize>, value: &[u8]) {
        let block = &mut b[at..at + BLOCK];
        block[range].copy_from_slice(value);
        let crc = crc32c::crc32c(&block[..BLOCK - 4]);
        block[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn batches_replay_with_their_places_and_the_synced_mark() {
        let dir = tempfile::tempdir().unwrap();
        let (cap, [one, two, good]) = three_batches(dir.path());
        let r = replay(&StoreDir::os(dir.path()), cap, 5).unwrap();
        assert_eq!(r.records.len(), 22);
        assert_eq!((r.batches, r.synced, r.torn), (3, 3, None));
        assert_eq!(
            r.records[1],
            (
                Place {
                    batch: 2,
                    offset: 1024
                },
                put(0)
            )
        );
        assert_eq!(r.records[21].0.offset, 2048);
        assert_eq!(
            replay(&StoreDir::os(dir.path()), cap, 6)
                .unwrap()
                .records
                .len(),
            0,
            "another epoch"
        );
        // Each append marks the one before durable in the header, and its
        // own once its sync returned.
        assert_eq!(decode_header(&one).unwrap().synced, 1);
        assert_eq!(decode_header(&two).unwrap().synced, 2);
        assert_eq!(
            decode_header(&good).unwrap(),
            Head {
                epoch: 5,
                synced: 3
            }
        );
    }

    #[test]
    fn a_torn_batch_past_the_mark_is_dropped_a_lost_synced_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (cap, [one, two, good]) = three_batches(dir.path());
        // The crash came while batch 3 was being appended: the file as it
        // was when batch 2's append returned, batch 3 absent or whole.
        let r = replay_bytes(&two, cap).unwrap();
        assert_eq!((r.records.len(), r.torn), (21, None));
        let mut b = two.clone();
        b[2048..2560].copy_from_slice(&good[2048..2560]);
        assert_eq!(replay_bytes(&b, cap).unwrap().records.len(), 22);
        // ... or while batch 2 was: either of its two blocks is dropped
        // with it, noted as torn.
        for missing in [1024, 1536] {
            let mut b = one.clone();
            b[1024..2048].copy_from_slice(&two[1024..2048]);
            b[missing..missing + 512].fill(0);
            let r = replay_bytes(&b, cap).unwrap();
            let torn = Place {
                batch: 2,
                offset: 1024,
            };
            assert_eq!(
                (r.records.len(), r.torn),
                (1, Some(torn)),
                "missing {missing}"
            );
        }
        // Batches at or below the mark are lost, not torn: refused, naming
        // the batch and where it was.
        let mut b = good.clone();
        b[2048..2560].fill(0);
        let e = refused(&b, cap);
        assert!(
            e.contains("at offset 2048: batch 3 is missing")
                && e.contains("marks batches 1 to 3 as synced"),
            "{e}"
        );
        let mut b = good.clone();
        b[1536..2048].fill(0);
        let e = refused(&b, cap);
        assert!(
            e.contains("at offset 1024: batch 2 is incomplete (its block at offset 1536 is zeros)"),
            "{e}"
        );
        let mut b = good.clone();
        b[1024..].fill(0);
        let e = refused(&b, cap);
        assert!(e.contains("batch 2 is missing"), "{e}");
        // A journal of a build without the mark: the same zeroed batch is
        // a tear, dropped as before.
        let mut b = good.clone();
        b[MARK_AT..HEAD_LEN].fill(0);
        b[2048..2560].fill(0);
        let r = replay_bytes(&b, cap).unwrap();
        assert_eq!((r.records.len(), r.synced), (21, 0));
        // A mark left by such a build's reset (of another epoch) is none.
        let mut b = good.clone();
        b[MARK_AT..HEAD_LEN].copy_from_slice(&header(4, 3)[MARK_AT..]);
        b[2048..2560].fill(0);
        assert_eq!(replay_bytes(&b, cap).unwrap().records.len(), 21);
        // A mark failing its checksum is damage.
        let mut b = good.clone();
        b[MARK_AT + 9] ^= 1;
        assert!(refused(&b, cap).contains("the synced mark at offset 20 fails its checksum"));
    }

    #[test]
    fn damage_is_refused_naming_offset_and_batch() {
        let dir = tempfile::tempdir().unwrap();
        let (cap, [_, two, good]) = three_batches(dir.path());
        // Any flipped byte, even in the last record, is damage.
        for (at, batch) in [
            (512 + 40, 1),
            (1024 + 100, 2),
            (1536 + 35, 2),
            (2048 + 7, 3),
        ] {
            let mut b = good.clone();
            b[at] ^= 0x10;
            let e = refused(&b, cap);
            let block = 512 + (at - 512) / 512 * 512;
            assert!(
                e.contains(&format!("at offset {block} (batch {batch})")),
                "flip at {at}: {e}"
            );
        }
        // A block missing before a later batch (past the mark too).
        let mut b = two.clone();
        b[2048..2560].copy_from_slice(&good[2048..2560]);
        b[1024..1536].fill(0);
        b[MARK_AT..HEAD_LEN].copy_from_slice(&header(5, 1)[MARK_AT..]);
        let e = refused(&b, cap);
        assert!(
            e.contains("at offset 2048: data after the torn batch 2"),
            "{e}"
        );
        // Any cut is refused, and so is a file that is not whole blocks.
        for cut in [good.len() - 1, 512 + 512, 100, 0] {
            let e = refused(&good[..cut], cap);
            assert!(e.contains("truncated"), "cut at {cut}: {e}");
        }
        let mut b = good.clone();
        b.extend_from_slice(&[0, 0, 7]);
        let e = refused(&b, cap);
        assert!(
            e.contains(&format!(
                "at offset {}: 3 bytes that are not a whole block",
                good.len()
            )),
            "{e}"
        );
        b.truncate(good.len() + 2);
        b[good.len()..].fill(0);
        assert_eq!(
            replay_bytes(&b, cap).unwrap().records.len(),
            22,
            "a zero tail is no data"
        );
    }

    #[test]
    fn length_fields_out_of_range_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (cap, [_, _, good]) = three_batches(dir.path());
        let blocks_left = (good.len() - 2048) / BLOCK;
        // parts (u32, blocks in the batch) of batch 3's only block.
        for parts in [0, 1 << 31, u32::MAX, blocks_left as u32 + 1] {
            let mut b = good.clone();
            set_block_field(&mut b, 2048, 8..12, &parts.to_le_bytes());
            let e = refused(&b, cap);
            assert!(
                e.contains("at offset 2048 (batch 3)") && e.contains(&format!("parts = {parts}")),
                "parts {parts}: {e}"
            );
        }
        // used (u16, bytes of records in the block) and records (u16).
        for used in [0, PAYLOAD as u16 + 1, 1 << 15, u16::MAX] {
            let mut b = good.clone();
            set_block_field(&mut b, 2048, 14..16, &used.to_le_bytes());
            let e = refused(&b, cap);
            assert!(
                e.contains(&format!("field used = {used}")),
                "used {used}: {e}"
            );
        }
        for count in [0, 2, 1 << 15, u16::MAX] {
            let mut b = good.clone();
            set_block_field(&mut b, 2048, 12..14, &count.to_le_bytes());
            let e = refused(&b, cap);
            assert!(
                e.contains(&format!("field records = {count}")),
                "records {count}: {e}"
            );
        }
        // The synced mark (u64) past the batches there are.
        for mark in [4, 1 << 63, u64::MAX] {
            let mut b = good.clone();
            b[..HEAD_LEN].copy_from_slice(&header(5, mark));
            let e = refused(&b, cap);
            assert!(
                e.contains("batch 4 is missing") && e.contains(&format!("1 to {mark} as synced")),
                "mark {mark}: {e}"
            );
        }
        // The size the checkpoint names (u64): past the file is a cut, and
        // only a header plus whole blocks is a size at all.
        for bytes in [good.len() as u64 + 512, 1 << 63, u64::MAX] {
            assert!(refused(&good, bytes).contains(&format!("preallocated to {bytes}")));
        }
        for bytes in [0, 512, 1 << 63, u64::MAX, capacity(64) + 1] {
            assert!(!is_capacity(bytes), "{bytes}");
        }
        assert!(is_capacity(capacity(64)) && is_capacity(capacity(u32::MAX)));
    }

    #[test]
    fn no_input_makes_a_decoder_panic() {
        let dir = tempfile::tempdir().unwrap();
        let (cap, [_, _, good]) = three_batches(dir.path());
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        };
        for len in [
            0,
            1,
            19,
            20,
            39,
            40,
            511,
            512,
            513,
            1023,
            1024,
            1100,
            good.len(),
        ] {
            for bytes in [noise(len), good[..len].to_vec()] {
                let _ = scan(Path::new(JOURNAL_FILE), &bytes, cap, 5);
                let _ = scan(Path::new(JOURNAL_FILE), &bytes, 0, 5);
                let _ = decode_header(&bytes);
                if let Ok(h) = parse_block(&bytes, 5) {
                    let place = Place {
                        batch: 1,
                        offset: 0,
                    };
                    let _ = decode_records(&bytes, &h, place, &mut Vec::new());
                }
            }
        }
        // Noise with valid block framing: every field at random.
        for _ in 0..2000 {
            let mut b = noise(BLOCK);
            b[..4].copy_from_slice(&BLOCK_MAGIC);
            b[16..24].copy_from_slice(&5u64.to_le_bytes());
            let crc = crc32c::crc32c(&b[..BLOCK - 4]);
            b[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
            if let Ok(h) = parse_block(&b, 5) {
                let place = Place {
                    batch: 1,
                    offset: 0,
                };
                let _ = decode_records(&b, &h, place, &mut Vec::new());
                let _ = decode_records(&b[..100], &h, place, &mut Vec::new());
            }
            let mut file = good[..512].to_vec();
            file.extend_from_slice(&b);
            let _ = scan(Path::new(JOURNAL_FILE), &file, 0, 5);
        }
    }

    #[test]
    fn reset_clears_the_old_epoch_and_full_journals_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let cap = capacity(64);
        let mut j = Journal::create(&StoreDir::os(dir.path()), 1, cap).unwrap();
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
        assert_eq!(
            replay(&StoreDir::os(dir.path()), cap, 2)
                .unwrap()
                .records
                .len(),
            1
        );
    }
}
