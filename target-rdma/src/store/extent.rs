//! Extent integrity: which blob image a swap extent holds, and the checksums
//! that prove its bytes.
//!
//! Every extent written to swap gets a header in the side table `swap.meta`:
//! the volume id, key and write version of the image, and a CRC32C per
//! 4 KiB block of its payload. The header lives beside the extent, not in
//! it, so extents stay `blob_bytes` long and aligned: O_DIRECT moves them
//! straight from and to arena slots, lease offsets stay `slot *
//! blob_bytes`, and a 4 KiB blob costs 48 bytes of header rather than a
//! second 4 KiB block. A CRC per block (not per extent) is what lets a
//! 4 KiB read of a cold 1 MiB blob be verified without reading the rest.
//!
//! Each block's CRC is seeded with the image's identity and the block's
//! index, so a block of another blob, of another version of this blob, or
//! from another offset fails the check even when its own bytes are intact.
//!
//! The table is read into memory at open (the checksums of the extents the
//! index names), so checking a read costs no I/O; it is written with
//! buffered I/O when an extent is written back and synced with the swap
//! file before any journal record names the extent.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use ublk_metrics::events;

use super::disk::{DiskFile, Role, StoreDir};
use super::error::{io_err, StoreError};
use super::format::Version;
use super::space;

/// The checksum granule: the smallest aligned read from swap.
pub(super) const BLOCK: usize = 4096;
/// The side table's file name.
pub(super) const META_FILE: &str = "swap.meta";
/// The table's format version (written in its header).
pub(super) const META_VERSION: u32 = 2;
const META_MAGIC: [u8; 4] = *b"ARNM";
const RECORD_MAGIC: [u8; 4] = *b"ARNX";
/// Bytes before the first record: a header block.
const META_HEADER: u64 = 4096;
/// magic, blocks, volume, key, generation, seq.
const RECORD_FIXED: usize = 4 + 4 + 8 + 8 + 8 + 8;

/// The image an extent holds, as its header states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ident {
    /// [`volume_id`] of the volume's name.
    pub(super) volume: u64,
    pub(super) key: u64,
    pub(super) version: Version,
}

/// A volume's id on disk: stable across restarts and config reorderings
/// (the index numbers volumes per run), derived from the name alone so that
/// repair can map an extent back to a configured volume without an index.
pub(super) fn volume_id(name: &str) -> u64 {
    let d = Sha256::digest(name.as_bytes());
    u64::from_le_bytes(d[..8].try_into().unwrap_or_default())
}

fn seed(id: &Ident, block: u32) -> u32 {
    let mut b = [0u8; 36];
    b[..8].copy_from_slice(&id.volume.to_le_bytes());
    b[8..16].copy_from_slice(&id.key.to_le_bytes());
    b[16..24].copy_from_slice(&id.version.generation.to_le_bytes());
    b[24..32].copy_from_slice(&id.version.seq.to_le_bytes());
    b[32..].copy_from_slice(&block.to_le_bytes());
    crc32c::crc32c(&b)
}

/// The CRCs of `bytes` (whole blocks), blocks `first..` of image `id`.
///
/// The blocks' CRCs do not depend on each other, so on x86-64 three are
/// computed at once, interleaved: that hides the latency of the crc32
/// instruction (1.3x to 1.8x the speed of one CRC after another on the
/// project's 2-core VM; the check's cost is in docs/BENCHMARKS.md).
pub(super) fn block_crcs(id: &Ident, first: u32, bytes: &[u8]) -> Vec<u32> {
    let blocks: Vec<&[u8]> = bytes.chunks(BLOCK).collect();
    let mut out = Vec::with_capacity(blocks.len());
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        while i + 3 <= blocks.len() && blocks[i + 2].len() == BLOCK {
            let seeds = [0, 1, 2].map(|j| seed(id, first + (i + j) as u32));
            // SAFETY: SSE4.2 was detected at run time just above.
            out.extend(unsafe {
                interleaved::crc3(seeds, [blocks[i], blocks[i + 1], blocks[i + 2]])
            });
            i += 3;
        }
    }
    out.extend(
        blocks[i..]
            .iter()
            .enumerate()
            .map(|(j, b)| crc32c::crc32c_append(seed(id, first + (i + j) as u32), b)),
    );
    out
}

#[cfg(target_arch = "x86_64")]
mod interleaved {
    use std::arch::x86_64::_mm_crc32_u64;

    /// CRC32C (with pre- and post-inversion, as `crc32c::crc32c_append`) of
    /// three equal-length blocks (a multiple of 8 bytes), from three seeds.
    #[target_feature(enable = "sse4.2")]
    pub(super) fn crc3(seeds: [u32; 3], blocks: [&[u8]; 3]) -> [u32; 3] {
        let [mut a, mut b, mut c] = seeds.map(|s| u64::from(!s));
        let word = |w: &[u8]| u64::from_le_bytes(w.try_into().unwrap_or_default());
        let words = blocks[0]
            .chunks_exact(8)
            .zip(blocks[1].chunks_exact(8))
            .zip(blocks[2].chunks_exact(8));
        for ((x, y), z) in words {
            a = _mm_crc32_u64(a, word(x));
            b = _mm_crc32_u64(b, word(y));
            c = _mm_crc32_u64(c, word(z));
        }
        [!(a as u32), !(b as u32), !(c as u32)]
    }
}

/// The CRCs of a whole image (`bytes` is a multiple of [`BLOCK`]).
pub(super) fn image_crcs(id: &Ident, bytes: &[u8]) -> Vec<u32> {
    block_crcs(id, 0, bytes)
}

/// Checks `bytes`, blocks `first..` of image `id`, against `crcs`; the
/// index within `bytes` of the first block that fails.
pub(super) fn first_bad_block(id: &Ident, first: u32, bytes: &[u8], crcs: &[u32]) -> Option<usize> {
    block_crcs(id, first, bytes)
        .iter()
        .zip(crcs)
        .position(|(a, b)| a != b)
}

/// A header as read back: what it names and its block CRCs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Record {
    /// Never written, or cleared when the extent was freed.
    Empty,
    /// Its own checksum fails or its fields are impossible: why, naming
    /// the field.
    Invalid(String),
    /// A valid header.
    Valid(Ident, Vec<u32>),
}

/// The side table file.
pub(super) struct MetaFile {
    file: DiskFile,
    path: PathBuf,
    blocks: usize,
    rec_len: usize,
}

/// Bytes of one record for extents of `blob_bytes`: the fixed fields, a CRC
/// per block and the record's own CRC, rounded up to 8.
pub(super) fn record_len(blob_bytes: u32) -> usize {
    (RECORD_FIXED + 4 * (blob_bytes as usize / BLOCK) + 4).next_multiple_of(8)
}

/// How long the table of `extents` extents is.
pub(super) fn meta_len(blob_bytes: u32, extents: u32) -> u64 {
    META_HEADER + u64::from(extents) * record_len(blob_bytes) as u64
}

fn header(blob_bytes: u32, rec_len: usize) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[..4].copy_from_slice(&META_MAGIC);
    h[4..8].copy_from_slice(&META_VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&blob_bytes.to_le_bytes());
    h[12..16].copy_from_slice(&(rec_len as u32).to_le_bytes());
    let crc = crc32c::crc32c(&h[..16]);
    h[16..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The table's header fields, when its checksum holds.
struct Header {
    version: u32,
    blob_bytes: u32,
    rec_len: u32,
}

/// Decodes the table's header from the start of `b`; an error says why
/// it is unusable.
fn decode_header(b: &[u8]) -> Result<Header, String> {
    let Some(h) = b.get(..20) else {
        return Err(format!("{} bytes, shorter than its header", b.len()));
    };
    if h[..4] != META_MAGIC {
        return Err("bad magic at offset 0, expected \"ARNM\"".into());
    }
    if crc32c::crc32c(&h[..16]) != le32(&h[16..]) {
        return Err("header checksum mismatch at offset 0".into());
    }
    Ok(Header {
        version: le32(&h[4..8]),
        blob_bytes: le32(&h[8..12]),
        rec_len: le32(&h[12..16]),
    })
}

fn read_header(file: &DiskFile) -> Result<Header, String> {
    let mut h = [0u8; 20];
    let len = file
        .metadata()
        .map_err(|e| format!("reading its length: {e}"))?
        .len();
    let n = h.len().min(usize::try_from(len).unwrap_or(usize::MAX));
    file.read_exact_at(&mut h[..n], 0)
        .map_err(|e| format!("reading its header: {e}"))?;
    decode_header(&h[..n])
}

/// Whether a checksummed header is one this build can have written: a
/// blob size the configuration allows and the record length it implies.
fn plausible(h: &Header) -> Result<(), String> {
    if !h.blob_bytes.is_power_of_two() || !(BLOCK as u32..=16 << 20).contains(&h.blob_bytes) {
        return Err(format!(
            "header field blob_bytes = {} is not a blob size (a power of two from 4096 to 16777216)",
            h.blob_bytes
        ));
    }
    if h.rec_len as usize != record_len(h.blob_bytes) {
        return Err(format!(
            "header field record_len = {}, but {}-byte extents have {}-byte records",
            h.rec_len,
            h.blob_bytes,
            record_len(h.blob_bytes)
        ));
    }
    Ok(())
}

/// Checks an existing table (open as `file`) against `blob_bytes` and the
/// `expect` extents the index was written with.
fn check_table(
    file: &DiskFile,
    path: &Path,
    blob_bytes: u32,
    expect: u32,
) -> Result<(), StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        file: path.to_path_buf(),
        detail,
    };
    let h = read_header(file).map_err(|e| corrupt(format!("bad header: {e}")))?;
    if h.version != META_VERSION {
        return Err(StoreError::OldFormat {
            file: path.to_path_buf(),
            version: h.version,
        });
    }
    plausible(&h).map_err(corrupt)?;
    if h.blob_bytes != blob_bytes {
        return Err(corrupt(format!(
            "written for {}-byte extents, configured {blob_bytes}",
            h.blob_bytes
        )));
    }
    let len = file
        .metadata()
        .map_err(io_err("reading metadata of extent table", path))?
        .len();
    let want = meta_len(blob_bytes, expect);
    if len < want {
        return Err(corrupt(format!(
            "is {len} bytes, the index needs {want} (headers of {expect} extents): truncated"
        )));
    }
    Ok(())
}

/// What a start says of a missing table.
const MISSING: &str = "is missing: the index names extents whose headers it held; \
                       restore it (arenad --repair cannot work without it)";

/// Opens the table (for writing too when `write`); a missing one is
/// `Corrupt` with `missing` as the detail.
fn open_existing(
    dir: &StoreDir,
    missing: &str,
    write: bool,
) -> Result<(DiskFile, PathBuf), StoreError> {
    let path = dir.join(META_FILE);
    match dir.open(
        Role::ExtentTable,
        &path,
        OpenOptions::new().read(true).write(write),
    ) {
        Ok(f) => Ok((f, path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(StoreError::Corrupt {
            file: path,
            detail: missing.into(),
        }),
        Err(e) => Err(io_err("opening extent table", &path)(e)),
    }
}

impl MetaFile {
    /// Creates the table for `extents` extents, its space reserved.
    pub(super) fn create(
        dir: &StoreDir,
        blob_bytes: u32,
        extents: u32,
    ) -> Result<MetaFile, StoreError> {
        let path = dir.join(META_FILE);
        let file = space::create(dir, Role::ExtentTable, &path, meta_len(blob_bytes, extents))?;
        let rec_len = record_len(blob_bytes);
        file.write_all_at(&header(blob_bytes, rec_len), 0)
            .and_then(|()| file.sync_all())
            .map_err(io_err("writing extent table", &path))?;
        Ok(MetaFile {
            file,
            path,
            blocks: blob_bytes as usize / BLOCK,
            rec_len,
        })
    }

    /// Opens an existing table that must describe at least `expect`
    /// extents of `blob_bytes`, and grows it for `extents` if needed.
    pub(super) fn open(
        dir: &StoreDir,
        blob_bytes: u32,
        expect: u32,
        extents: u32,
    ) -> Result<MetaFile, StoreError> {
        let (file, path) = open_existing(dir, MISSING, true)?;
        check_table(&file, &path, blob_bytes, expect)?;
        MetaFile::sized(file, path, blob_bytes, extents)
    }

    /// Opens an existing table as [`MetaFile::open`] does, without
    /// writing (for `arenad --check`): never grown, never to be written.
    pub(super) fn open_read_only(
        dir: &StoreDir,
        blob_bytes: u32,
        expect: u32,
    ) -> Result<MetaFile, StoreError> {
        let (file, path) = open_existing(dir, MISSING, false)?;
        check_table(&file, &path, blob_bytes, expect)?;
        Ok(MetaFile {
            file,
            path,
            blocks: blob_bytes as usize / BLOCK,
            rec_len: record_len(blob_bytes),
        })
    }

    /// Opens the table for repair: a damaged header (one failing its
    /// checksum, or naming no possible layout) is rewritten (the layout
    /// follows from `blob_bytes`) and what was wrong returned, one naming
    /// another extent size or format is refused, and the file is sized
    /// for `extents`.
    pub(super) fn open_for_repair(
        dir: &StoreDir,
        blob_bytes: u32,
        extents: u32,
    ) -> Result<(MetaFile, Option<String>), StoreError> {
        let (file, path) = open_existing(
            dir,
            "is missing: without extent headers there is nothing to rebuild the index from",
            true,
        )?;
        let other = |h: &Header| StoreError::InvalidConfig {
            key: "blob_bytes",
            detail: format!(
                "configured {blob_bytes} but {} was written for {}-byte extents (format {})",
                path.display(),
                h.blob_bytes,
                h.version
            ),
        };
        let damaged = match read_header(&file) {
            Ok(h) if h.version != META_VERSION => return Err(other(&h)),
            Ok(h) => match plausible(&h) {
                Err(why) => Some(why),
                Ok(()) if h.blob_bytes != blob_bytes => return Err(other(&h)),
                Ok(()) => None,
            },
            Err(why) => Some(why),
        };
        if let Some(why) = &damaged {
            tracing::warn!(event = events::EXTENT_TABLE_HEADER_REWRITTEN, path = %path.display(), detail = %why, "the extent table's header was damaged; rewritten");
            file.write_all_at(&header(blob_bytes, record_len(blob_bytes)), 0)
                .map_err(io_err("writing extent table", &path))?;
        }
        Ok((MetaFile::sized(file, path, blob_bytes, extents)?, damaged))
    }

    /// Grows `file` (never shrinks it, so it stays as long as any
    /// checkpoint still on disk says) to hold `extents` records.
    fn sized(
        file: DiskFile,
        path: PathBuf,
        blob_bytes: u32,
        extents: u32,
    ) -> Result<MetaFile, StoreError> {
        let len = file
            .metadata()
            .map_err(io_err("reading metadata of extent table", &path))?
            .len();
        let size = meta_len(blob_bytes, extents);
        if len < size {
            space::reserve(&file, &path, size)?;
        }
        Ok(MetaFile {
            file,
            path,
            blocks: blob_bytes as usize / BLOCK,
            rec_len: record_len(blob_bytes),
        })
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn offset(&self, extent: u32) -> u64 {
        META_HEADER + u64::from(extent) * self.rec_len as u64
    }

    /// Writes extent `extent`'s header (buffered; [`MetaFile::sync`] makes
    /// it durable).
    pub(super) fn write(&self, extent: u32, id: &Ident, crcs: &[u32]) -> Result<(), StoreError> {
        debug_assert_eq!(crcs.len(), self.blocks);
        let mut r = vec![0u8; self.rec_len];
        r[..4].copy_from_slice(&RECORD_MAGIC);
        r[4..8].copy_from_slice(&(self.blocks as u32).to_le_bytes());
        r[8..16].copy_from_slice(&id.volume.to_le_bytes());
        r[16..24].copy_from_slice(&id.key.to_le_bytes());
        r[24..32].copy_from_slice(&id.version.generation.to_le_bytes());
        r[32..40].copy_from_slice(&id.version.seq.to_le_bytes());
        let mut o = RECORD_FIXED;
        for c in crcs {
            r[o..o + 4].copy_from_slice(&c.to_le_bytes());
            o += 4;
        }
        let crc = crc32c::crc32c(&r[..o]);
        r[o..o + 4].copy_from_slice(&crc.to_le_bytes());
        self.file
            .write_all_at(&r, self.offset(extent))
            .map_err(io_err("writing extent header to", &self.path))
    }

    /// Clears a freed extent's header, so that repair never brings back an
    /// image the index had dropped (a removed blob, a superseded version).
    pub(super) fn clear(&self, extent: u32) -> Result<(), StoreError> {
        self.file
            .write_all_at(&vec![0u8; self.rec_len], self.offset(extent))
            .map_err(io_err("clearing extent header in", &self.path))
    }

    pub(super) fn sync(&self) -> Result<(), StoreError> {
        self.file
            .sync_data()
            .map_err(io_err("syncing extent table", &self.path))
    }

    /// Reads the headers of extents `0..count`, in order.
    pub(super) fn read_all(&self, count: u32) -> Result<Vec<Record>, StoreError> {
        let mut buf = vec![0u8; count as usize * self.rec_len];
        self.file
            .read_exact_at(&mut buf, META_HEADER)
            .map_err(io_err("reading extent table", &self.path))?;
        Ok(buf
            .chunks(self.rec_len)
            .map(|r| parse(r, self.blocks))
            .collect())
    }
}

/// Whether the table describes no extent (every record empty).
pub(super) fn table_is_blank(dir: &StoreDir) -> Result<bool, StoreError> {
    let path = dir.join(META_FILE);
    let b = dir
        .read(Role::ExtentTable, &path)
        .map_err(io_err("reading extent table", &path))?;
    Ok(b.get(META_HEADER as usize..)
        .is_none_or(|t| t.iter().all(|&x| x == 0)))
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap_or_default())
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap_or_default())
}

/// Decodes one record `r` of a table of `blocks`-block extents.
pub(super) fn parse(r: &[u8], blocks: usize) -> Record {
    if r.iter().all(|&b| b == 0) {
        return Record::Empty;
    }
    let end = RECORD_FIXED.saturating_add(blocks.saturating_mul(4));
    if r.len() < end.saturating_add(4) {
        return Record::Invalid(format!(
            "a record of {} bytes, {blocks} blocks need {}",
            r.len(),
            end.saturating_add(4)
        ));
    }
    if r[..4] != RECORD_MAGIC {
        return Record::Invalid("bad magic".into());
    }
    if crc32c::crc32c(&r[..end]) != le32(&r[end..]) {
        return Record::Invalid("checksum mismatch".into());
    }
    let n = le32(&r[4..8]);
    if n as usize != blocks {
        return Record::Invalid(format!("field blocks = {n}, extents here have {blocks}"));
    }
    let id = Ident {
        volume: le64(&r[8..16]),
        key: le64(&r[16..24]),
        version: Version {
            generation: le64(&r[24..32]),
            seq: le64(&r[32..40]),
        },
    };
    let crcs = r[RECORD_FIXED..end].chunks(4).map(le32).collect();
    Record::Valid(id, crcs)
}

/// The block CRCs of `rec` when it is the header of image `want`, else
/// why not; `volume` names an on-disk volume id.
pub(super) fn verify<'a>(
    rec: &'a Record,
    want: &Ident,
    volume: impl Fn(u64) -> String,
) -> Result<&'a [u32], String> {
    match rec {
        Record::Valid(id, c) if id == want => Ok(c),
        Record::Valid(id, _) => Err(format!(
            "its header names volume {} key {} version {}.{}, the index expects key {} version {}.{}",
            volume(id.volume),
            id.key,
            id.version.generation,
            id.version.seq,
            want.key,
            want.version.generation,
            want.version.seq
        )),
        Record::Empty => Err("it has no header".to_string()),
        Record::Invalid(why) => Err(format!("its header is damaged ({why})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: u64, seq: u64) -> Ident {
        Ident {
            volume: volume_id("a"),
            key,
            version: Version { generation: 3, seq },
        }
    }

    #[test]
    fn a_block_fails_under_another_identity_version_or_offset() {
        let data = vec![7u8; 2 * BLOCK];
        let crcs = image_crcs(&id(1, 1), &data);
        assert_eq!(first_bad_block(&id(1, 1), 0, &data, &crcs), None);
        assert_eq!(first_bad_block(&id(2, 1), 0, &data, &crcs), Some(0));
        assert_eq!(first_bad_block(&id(1, 2), 0, &data, &crcs), Some(0));
        // The same bytes as block 1 instead of block 0.
        assert_eq!(
            first_bad_block(&id(1, 1), 1, &data[..BLOCK], &crcs[..1]),
            Some(0)
        );
        let mut flipped = data.clone();
        flipped[BLOCK + 9] ^= 1;
        assert_eq!(first_bad_block(&id(1, 1), 0, &flipped, &crcs), Some(1));
        assert_ne!(volume_id("a"), volume_id("b"));
    }

    #[test]
    fn interleaved_crcs_equal_one_block_at_a_time() {
        let data: Vec<u8> = (0..7 * BLOCK as u64)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for first in [0, 5] {
            let want: Vec<u32> = data
                .chunks(BLOCK)
                .enumerate()
                .map(|(i, b)| crc32c::crc32c_append(seed(&id(4, 2), first + i as u32), b))
                .collect();
            assert_eq!(block_crcs(&id(4, 2), first, &data), want);
            assert_eq!(block_crcs(&id(4, 2), first, &data[..2 * BLOCK]), want[..2]);
        }
    }

    #[test]
    fn records_round_trip_and_damage_is_invalid() {
        let dir = tempfile::tempdir().unwrap();
        let m = MetaFile::create(&StoreDir::os(dir.path()), 8192, 4).unwrap();
        let crcs = vec![11, 22];
        m.write(2, &id(9, 4), &crcs).unwrap();
        m.write(3, &id(8, 5), &crcs).unwrap();
        m.clear(3).unwrap();
        let recs = m.read_all(4).unwrap();
        assert_eq!(recs[0], Record::Empty);
        assert_eq!(recs[2], Record::Valid(id(9, 4), crcs));
        assert_eq!(recs[3], Record::Empty);
        drop(m);
        let p = dir.path().join(META_FILE);
        let mut b = std::fs::read(&p).unwrap();
        b[META_HEADER as usize + 2 * record_len(8192) + 17] ^= 1;
        std::fs::write(&p, b).unwrap();
        let m = MetaFile::open(&StoreDir::os(dir.path()), 8192, 4, 4).unwrap();
        assert_eq!(
            m.read_all(4).unwrap()[2],
            Record::Invalid("checksum mismatch".into())
        );
        let e = MetaFile::open(&StoreDir::os(dir.path()), 8192, 8, 8)
            .err()
            .unwrap();
        assert!(e.to_string().contains("truncated"), "{e}");
    }

    /// Sets `value` at `at` of the table's header and fixes its checksum.
    fn set_header_field(dir: &Path, at: usize, value: u32) {
        let p = dir.join(META_FILE);
        let mut b = std::fs::read(&p).unwrap();
        b[at..at + 4].copy_from_slice(&value.to_le_bytes());
        let crc = crc32c::crc32c(&b[..16]);
        b[16..20].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&p, b).unwrap();
    }

    #[test]
    fn table_header_fields_out_of_range_are_refused_by_name_and_repaired() {
        let dir = tempfile::tempdir().unwrap();
        drop(MetaFile::create(&StoreDir::os(dir.path()), 8192, 4).unwrap());
        let good = std::fs::read(dir.path().join(META_FILE)).unwrap();
        let cases = [
            (8, "blob_bytes", [0, 1 << 31, u32::MAX, 8192 + 1]),
            (
                12,
                "record_len",
                [0, 1 << 31, u32::MAX, record_len(8192) as u32 + 8],
            ),
        ];
        for (at, field, values) in cases {
            for v in values {
                set_header_field(dir.path(), at, v);
                let want = format!("header field {field} = {v}");
                let e = MetaFile::open(&StoreDir::os(dir.path()), 8192, 4, 4)
                    .err()
                    .expect("refused")
                    .to_string();
                assert!(e.contains("swap.meta") && e.contains(&want), "{want}: {e}");
                let e = MetaFile::open_read_only(&StoreDir::os(dir.path()), 8192, 4)
                    .err()
                    .expect("refused");
                assert!(e.to_string().contains(&want), "{want}: {e}");
                // Repair rewrites what no layout explains, and says so.
                let (_, why) =
                    MetaFile::open_for_repair(&StoreDir::os(dir.path()), 8192, 4).unwrap();
                assert!(why.is_some_and(|w| w.contains(&want)));
                MetaFile::open(&StoreDir::os(dir.path()), 8192, 4, 4).unwrap();
                std::fs::write(dir.path().join(META_FILE), &good).unwrap();
            }
        }
        // Another possible blob size is the configuration's, not damage.
        set_header_field(dir.path(), 8, 16384);
        set_header_field(dir.path(), 12, record_len(16384) as u32);
        let e = MetaFile::open_for_repair(&StoreDir::os(dir.path()), 8192, 4)
            .err()
            .unwrap();
        assert!(
            matches!(
                e,
                StoreError::InvalidConfig {
                    key: "blob_bytes",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_record_block_count_out_of_range_is_invalid_by_name_and_nothing_panics() {
        let m = |blocks: u32| {
            let mut r = vec![0u8; record_len(8192)];
            r[..4].copy_from_slice(&RECORD_MAGIC);
            r[4..8].copy_from_slice(&blocks.to_le_bytes());
            let end = RECORD_FIXED + 8;
            let crc = crc32c::crc32c(&r[..end]);
            r[end..end + 4].copy_from_slice(&crc.to_le_bytes());
            r
        };
        assert!(matches!(parse(&m(2), 2), Record::Valid(..)));
        for v in [0, 1 << 31, u32::MAX, 3] {
            assert_eq!(
                parse(&m(v), 2),
                Record::Invalid(format!("field blocks = {v}, extents here have 2"))
            );
        }
        let r = m(2);
        // Shorter than the fixed fields, two CRCs and its own.
        for n in 0..RECORD_FIXED + 12 {
            assert!(matches!(
                parse(&r[..n], 2),
                Record::Empty | Record::Invalid(_)
            ));
        }
        assert!(matches!(parse(&r, usize::MAX), Record::Invalid(_)));
        for n in 0..24 {
            let _ = decode_header(&vec![0x41; n]);
        }
    }
}
