//! The checkpoint file: two slots of the same size, each able to hold a
//! whole index. A checkpoint overwrites the older slot in place and syncs
//! it; the slot with the newest valid epoch is the current one.
//!
//! In place and not "write a temp file, rename it" because a rename needs
//! the space of a second copy at the moment of writing: with both slots
//! allocated when the store is created, a checkpoint never allocates, so a
//! full filesystem cannot stop it. A crash while writing a slot leaves that
//! slot failing its checksum and the other one (the previous checkpoint)
//! intact; the journal's epoch tells which of the two it extends, so a
//! damaged newest slot is refused, never silently replaced by the older.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::PathBuf;

use super::disk::{DiskFile, Role, StoreDir};

use super::error::{corrupt, io_err, refused, swap_shrunk, Refusal, StoreError};
use super::format::{Image, Snapshot, Version, FORMAT_VERSION, MAX_VOLUMES};
use super::space::{self, sync_dir};
use crate::proto::MAX_VOLUME_NAME;

pub(super) const CKPT_FILE: &str = "index.ckpt";
const MAGIC: [u8; 4] = *b"ARNC";
/// magic, version, blob_bytes, extents, generation, epoch, journal_bytes,
/// volume count, reserved, blob count, body length.
const HEADER_LEN: usize = 4 + 4 + 4 + 4 + 8 + 8 + 8 + 4 + 4 + 8 + 8;
/// volume u32, key u64, extent u32, generation u64, seq u64.
const ENTRY_LEN: usize = 4 + 8 + 4 + 8 + 8;
const SLOT_ALIGN: u64 = 4096;

/// What one slot says.
pub(super) struct Slot {
    pub(super) image: Image,
    /// The journal size the store was using.
    pub(super) journal_bytes: u64,
}

/// The loaded file: its newest valid slot, and why the other is not newer.
pub(super) struct Loaded {
    pub(super) newest: Slot,
    /// Which slot that is.
    pub(super) slot: usize,
    pub(super) slot_len: u64,
    /// The other slot: its epoch when valid, else why it is not.
    pub(super) other: Result<Option<u64>, String>,
}

/// Bytes one slot needs for `volumes` and up to `extents` blobs.
pub(super) fn slot_len(volumes: &[&str], extents: u32) -> u64 {
    let names: usize = volumes.iter().map(|n| 2 + n.len()).sum();
    ((HEADER_LEN + names + 4) as u64 + u64::from(extents) * ENTRY_LEN as u64)
        .next_multiple_of(SLOT_ALIGN)
}

/// The checkpoint file, open for writing slots.
pub(super) struct CheckpointFile {
    file: DiskFile,
    path: PathBuf,
    slot_len: u64,
    /// The slot holding the newest checkpoint.
    current: usize,
}

impl CheckpointFile {
    /// Bytes per slot.
    pub(super) fn slot_len(&self) -> u64 {
        self.slot_len
    }

    /// Writes `snap` as epoch `epoch` into slot 0 of a new file with room
    /// for `slot_len`-byte slots, and puts it in place of any old file.
    /// Used at creation and when a larger index needs larger slots (at open).
    pub(super) fn create<I>(
        dir: &StoreDir,
        slot_len: u64,
        epoch: u64,
        journal_bytes: u64,
        snap: Snapshot<'_, I>,
    ) -> Result<CheckpointFile, StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        let tmp = dir.join(format!("{CKPT_FILE}.tmp"));
        let file = space::create(dir, Role::Checkpoint, &tmp, 2 * slot_len)?;
        let mut c = CheckpointFile {
            file,
            path: tmp.clone(),
            slot_len,
            current: 1,
        };
        c.write(epoch, journal_bytes, snap)?;
        let path = dir.join(CKPT_FILE);
        dir.rename(Role::Checkpoint, &tmp, &path)
            .map_err(io_err("renaming checkpoint into", &path))?;
        sync_dir(dir)?;
        c.path = path;
        Ok(c)
    }

    /// Opens the file [`load`] read (slots of `slot_len`, the newest in
    /// `current`), to write its other slot next.
    pub(super) fn reopen(
        dir: &StoreDir,
        slot_len: u64,
        current: usize,
    ) -> Result<CheckpointFile, StoreError> {
        let path = dir.join(CKPT_FILE);
        let file = dir
            .open(
                Role::Checkpoint,
                &path,
                OpenOptions::new().read(true).write(true),
            )
            .map_err(io_err("opening checkpoint", &path))?;
        Ok(CheckpointFile {
            file,
            path,
            slot_len,
            current,
        })
    }

    /// Writes `snap` as epoch `epoch` into the older slot and syncs it; that
    /// slot is the current one from now on.
    pub(super) fn write<I>(
        &mut self,
        epoch: u64,
        journal_bytes: u64,
        snap: Snapshot<'_, I>,
    ) -> Result<(), StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        let slot = 1 - self.current;
        let names: usize = snap.volumes.iter().map(|n| 2 + n.len()).sum();
        let body = HEADER_LEN as u64 + names as u64 + snap.blob_count * ENTRY_LEN as u64;
        if body + 4 > self.slot_len {
            return Err(corrupt(
                &self.path,
                format!(
                    "a checkpoint of {body} bytes does not fit its {}-byte slot",
                    self.slot_len
                ),
            ));
        }
        // The outer error is the file's, the inner the snapshot's.
        let write = || -> io::Result<Result<(), Refusal>> {
            let mut w = CrcWriter {
                inner: AtWriter {
                    file: &self.file,
                    offset: slot as u64 * self.slot_len,
                    buf: Vec::with_capacity(1 << 20),
                },
                crc: 0,
            };
            w.put(&MAGIC)?;
            w.put(&FORMAT_VERSION.to_le_bytes())?;
            w.put(&snap.blob_bytes.to_le_bytes())?;
            w.put(&snap.extents.to_le_bytes())?;
            w.put(&snap.generation.to_le_bytes())?;
            w.put(&epoch.to_le_bytes())?;
            w.put(&journal_bytes.to_le_bytes())?;
            w.put(&(snap.volumes.len() as u32).to_le_bytes())?;
            w.put(&0u32.to_le_bytes())?;
            w.put(&snap.blob_count.to_le_bytes())?;
            w.put(&body.to_le_bytes())?;
            for name in snap.volumes {
                w.put(&(name.len() as u16).to_le_bytes())?;
                w.put(name.as_bytes())?;
            }
            let mut n = 0u64;
            for (vol, key, extent, v) in snap.blobs {
                w.put(&vol.to_le_bytes())?;
                w.put(&key.to_le_bytes())?;
                w.put(&extent.to_le_bytes())?;
                w.put(&v.generation.to_le_bytes())?;
                w.put(&v.seq.to_le_bytes())?;
                n += 1;
            }
            if n != snap.blob_count {
                return Ok(Err(Refusal::SnapshotMiscounted {
                    yielded: n,
                    announced: snap.blob_count,
                }));
            }
            let crc = w.crc;
            w.inner.write_all(&crc.to_le_bytes())?;
            w.inner.flush()?;
            drop(w);
            self.file.sync_data().map(Ok)
        };
        write()
            .map_err(io_err("writing checkpoint", &self.path))?
            .map_err(|r| refused("writing checkpoint", &self.path, r))?;
        self.current = slot;
        Ok(())
    }
}

/// Writes through to `inner` and folds everything into a CRC32C.
struct CrcWriter<W> {
    inner: W,
    crc: u32,
}

impl<W: Write> CrcWriter<W> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, b);
        self.inner.write_all(b)
    }
}

/// Writes through a buffer to consecutive offsets of a file from `offset`.
struct AtWriter<'a> {
    file: &'a DiskFile,
    offset: u64,
    buf: Vec<u8>,
}

impl Write for AtWriter<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        if self.buf.len() + b.len() > self.buf.capacity() {
            self.flush()?;
        }
        if b.len() >= self.buf.capacity() {
            self.file.write_all_at(b, self.offset)?;
            self.offset += b.len() as u64;
        } else {
            self.buf.extend_from_slice(b);
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.file.write_all_at(&self.buf, self.offset)?;
            self.offset += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }
}

/// Little-endian reader over a slot that reports truncation.
struct Cur<'a> {
    buf: &'a [u8],
}

impl Cur<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.buf.len() < n {
            return Err("truncated".into());
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
}

/// Reads the checkpoint file; `None` when there is none.
pub(super) fn load(
    dir: &StoreDir,
    blob_bytes: u32,
    extents: u32,
) -> Result<Option<Loaded>, StoreError> {
    let path = dir.join(CKPT_FILE);
    let file = match dir.open(Role::Checkpoint, &path, OpenOptions::new().read(true)) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("opening checkpoint", &path)(e)),
    };
    let len = file
        .metadata()
        .map_err(io_err("reading metadata of checkpoint", &path))?
        .len();
    // Largest file this configuration can have written.
    let max = 2
        * ((HEADER_LEN + MAX_VOLUMES * (2 + MAX_VOLUME_NAME) + 4) as u64
            + u64::from(extents) * ENTRY_LEN as u64)
            .next_multiple_of(SLOT_ALIGN);
    if len > max {
        return Err(corrupt(
            &path,
            format!("{len} bytes, more than the {max} this configuration can write"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, 0)
        .map_err(io_err("reading checkpoint", &path))?;
    // An older build's checkpoint: one image from offset 0, another version.
    let foreign = (buf.len() >= 8 && buf[..4] == MAGIC)
        .then(|| u32::from_le_bytes(buf[4..8].try_into().unwrap_or_default()))
        .filter(|&v| v != FORMAT_VERSION);
    let refuse = |detail: String| match foreign {
        Some(version) => StoreError::OldFormat {
            file: path.clone(),
            version,
        },
        None => corrupt(&path, detail),
    };
    let n = buf.len() as u64;
    if n == 0 || !n.is_multiple_of(2 * SLOT_ALIGN) {
        return Err(refuse(format!(
            "{n} bytes, not two slots of a multiple of {SLOT_ALIGN} bytes: truncated or replaced"
        )));
    }
    let slot_len = n / 2;
    let mut slots = Vec::with_capacity(2);
    for i in 0..2 {
        let s = &buf[(i * slot_len) as usize..((i + 1) * slot_len) as usize];
        slots.push(parse_slot(s, blob_bytes, extents)?);
    }
    let describe = |i: usize, p: &Result<Option<Slot>, String>| match p {
        Err(e) => format!("slot {i} at offset {}: {e}", i as u64 * slot_len),
        _ => format!("slot {i} at offset {}: empty", i as u64 * slot_len),
    };
    let epoch = |p: &Result<Option<Slot>, String>| match p {
        Ok(Some(s)) => Some(s.image.epoch),
        _ => None,
    };
    let slot = match (epoch(&slots[0]), epoch(&slots[1])) {
        (Some(a), Some(b)) => usize::from(b > a),
        (Some(_), None) => 0,
        (None, Some(_)) => 1,
        (None, None) => {
            return Err(refuse(format!(
                "neither slot holds a valid checkpoint ({}; {})",
                describe(0, &slots[0]),
                describe(1, &slots[1])
            )))
        }
    };
    let other = match &slots[1 - slot] {
        Ok(s) => Ok(s.as_ref().map(|s| s.image.epoch)),
        p @ Err(_) => Err(describe(1 - slot, p)),
    };
    let Ok(Some(newest)) = slots.swap_remove(slot) else {
        return Err(corrupt(&path, "the newest slot vanished"));
    };
    Ok(Some(Loaded {
        newest,
        slot,
        slot_len,
        other,
    }))
}

/// Decodes one slot `s`: `Ok(None)` when it was never written, `Err` with
/// the reason (naming the field) when it does not parse (a torn write, or
/// damage); configuration mismatches are errors of the whole load.
/// `extents` is the configured number of swap extents.
pub(super) fn parse_slot(
    s: &[u8],
    blob_bytes: u32,
    extents: u32,
) -> Result<Result<Option<Slot>, String>, StoreError> {
    if s.iter().all(|&b| b == 0) {
        return Ok(Ok(None));
    }
    let mut c = Cur { buf: s };
    let header = (|| -> Result<_, String> {
        if c.take(4)? != MAGIC {
            return Err("bad magic, expected \"ARNC\"".into());
        }
        let version = c.u32()?;
        if version != FORMAT_VERSION {
            return Err(format!("format version {version}"));
        }
        Ok(())
    })();
    if let Err(e) = header {
        return Ok(Err(e));
    }
    let fixed = (|| -> Result<_, String> {
        Ok((
            c.u32()?,
            c.u32()?,
            c.u64()?,
            c.u64()?,
            c.u64()?,
            c.u32()?,
            c.u32()?,
            c.u64()?,
            c.u64()?,
        ))
    })();
    let Ok((
        persisted_blob,
        written_extents,
        generation,
        epoch,
        journal_bytes,
        nvols,
        reserved,
        nblobs,
        body_len,
    )) = fixed
    else {
        return Ok(Err("truncated header".into()));
    };
    // The body length locates the checksum, so it is checked before it.
    let Some(body) = usize::try_from(body_len)
        .ok()
        .filter(|&b| b >= HEADER_LEN && b.checked_add(4).is_some_and(|end| end <= s.len()))
    else {
        return Ok(Err(format!(
            "field body_len = {body_len} does not fit the {}-byte slot (it must be from {HEADER_LEN} to {})",
            s.len(),
            s.len().saturating_sub(4)
        )));
    };
    if crc32c::crc32c(&s[..body])
        != u32::from_le_bytes(s[body..body + 4].try_into().unwrap_or_default())
    {
        return Ok(Err("checksum mismatch".into()));
    }
    if persisted_blob != blob_bytes {
        return Err(StoreError::InvalidConfig {
            key: "blob_bytes",
            detail: format!(
                "configured {blob_bytes} but the store was written with {persisted_blob}"
            ),
        });
    }
    if reserved != 0 {
        return Ok(Err(format!("field reserved = {reserved}, expected 0")));
    }
    let nvols = nvols as usize;
    if nvols > MAX_VOLUMES {
        return Ok(Err(format!(
            "field volumes = {nvols}, the limit is {MAX_VOLUMES}"
        )));
    }
    let mut c = Cur {
        buf: &s[HEADER_LEN..body],
    };
    let rest = (|| -> Result<Image, String> {
        let mut volumes: Vec<String> = Vec::with_capacity(nvols);
        for i in 0..nvols {
            let n = c.u16()? as usize;
            let name = c
                .take(n)
                .map_err(|_| format!("volume {i}: name length = {n} runs past field body_len"))?;
            let name = std::str::from_utf8(name)
                .map_err(|_| format!("volume {i}: the name is not UTF-8"))?;
            if name.is_empty() || name.len() > MAX_VOLUME_NAME {
                return Err(format!(
                    "volume {i}: name length = {n} is not 1 to {MAX_VOLUME_NAME}"
                ));
            }
            if volumes.iter().any(|v| v == name) {
                return Err(format!("volume {i}: {name:?} is named twice"));
            }
            volumes.push(name.to_owned());
        }
        if nblobs.checked_mul(ENTRY_LEN as u64) != Some(c.buf.len() as u64) {
            return Err(format!(
                "field blobs = {nblobs} does not match the {} bytes of entries between the names \
                 of field volumes = {nvols} and the checksum",
                c.buf.len()
            ));
        }
        let mut blobs = BTreeMap::new();
        for i in 0..nblobs {
            let vol = c.u32()?;
            let key = c.u64()?;
            let extent = c.u32()?;
            let version = Version {
                generation: c.u64()?,
                seq: c.u64()?,
            };
            if vol as usize >= nvols {
                return Err(format!(
                    "blob entry {i} names volume {vol}, field volumes = {nvols}"
                ));
            }
            if extent >= written_extents {
                return Err(format!(
                    "blob entry {i} (volume {:?} key {key}) names swap extent {extent}, past field extents = {written_extents}",
                    volumes[vol as usize]
                ));
            }
            if blobs.insert((vol, key), (extent, version)).is_some() {
                return Err(format!(
                    "blob entry {i} repeats volume {:?} key {key}",
                    volumes[vol as usize]
                ));
            }
        }
        Ok(Image {
            generation,
            epoch,
            volumes,
            blobs,
            extents: written_extents,
        })
    })();
    let image = match rest {
        Ok(i) => i,
        Err(e) => return Ok(Err(e)),
    };
    if let Some((_, &(extent, _))) = image.blobs.iter().find(|(_, &(e, _))| e >= extents) {
        return Err(swap_shrunk(extent, extents, written_extents));
    }
    Ok(Ok(Some(Slot {
        image,
        journal_bytes,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::Path;

    const BLOB: u32 = 4096;

    /// A checkpoint of volumes "a" and "b" and three blobs in 16 extents,
    /// written as epoch 3 into slot 0 of a new file; the file's bytes.
    fn written(dir: &Path) -> Vec<u8> {
        let blobs = [(0, 1, 0), (0, 2, 5), (1, 1, 7)].map(|(vol, key, extent)| {
            let v = Version {
                generation: 1,
                seq: key,
            };
            (vol, key, extent, v)
        });
        let snap = Snapshot {
            generation: 1,
            blob_bytes: BLOB,
            extents: 16,
            volumes: &["a", "b"],
            blob_count: 3,
            blobs: blobs.into_iter(),
        };
        let len = slot_len(&["a", "b"], 16);
        CheckpointFile::create(&StoreDir::os(dir), len, 3, 8192, snap).unwrap();
        fs::read(dir.join(CKPT_FILE)).unwrap()
    }

    /// The first slot of `file` with `value` at `at`, its checksum fixed
    /// when `fix`: a writer's bug, or damage the checksum cannot catch.
    fn slot_with(file: &[u8], at: usize, value: &[u8], fix: bool) -> Vec<u8> {
        let mut s = file[..file.len() / 2].to_vec();
        s[at..at + value.len()].copy_from_slice(value);
        if fix {
            let body = u64::from_le_bytes(s[56..64].try_into().unwrap()) as usize;
            let crc = crc32c::crc32c(&s[..body]);
            s[body..body + 4].copy_from_slice(&crc.to_le_bytes());
        }
        s
    }

    fn refused(s: &[u8]) -> String {
        match parse_slot(s, BLOB, 16) {
            Ok(Err(e)) => e,
            Ok(Ok(_)) => panic!("a damaged slot parsed"),
            Err(e) => panic!("the whole load failed: {e}"),
        }
    }

    #[test]
    fn a_written_slot_parses_back() {
        let dir = tempfile::tempdir().unwrap();
        let file = written(dir.path());
        let s = parse_slot(&file[..file.len() / 2], BLOB, 16)
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(s.image.volumes, ["a", "b"]);
        assert_eq!(s.image.blobs.get(&(1, 1)).map(|b| b.0), Some(7));
        assert_eq!(
            (s.image.epoch, s.image.extents, s.journal_bytes),
            (3, 16, 8192)
        );
        assert!(parse_slot(&file[file.len() / 2..], BLOB, 16)
            .unwrap()
            .unwrap()
            .is_none());
    }

    #[test]
    fn every_length_and_count_field_out_of_range_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = written(dir.path());
        let slot = file.len() / 2;
        let body = u64::from_le_bytes(file[56..64].try_into().unwrap());
        // body_len (u64) locates the checksum: checked before it, so its
        // damage is named even though the checksum cannot be trusted.
        for v in [0, 1 << 63, u64::MAX, slot as u64 - 3, body + 1, 63] {
            let e = refused(&slot_with(&file, 56, &v.to_le_bytes(), false));
            let named = e.contains(&format!(
                "field body_len = {v} does not fit the {slot}-byte slot"
            ));
            // A length in range but wrong fails the checksum instead.
            assert!(
                named || (v == body + 1 && e == "checksum mismatch"),
                "{v}: {e}"
            );
        }
        // The blob count (u64), with the checksum fixed.
        for v in [0, 1 << 63, u64::MAX, 4] {
            let e = refused(&slot_with(&file, 48, &v.to_le_bytes(), true));
            assert!(
                e.contains(&format!("field blobs = {v} does not match")),
                "{v}: {e}"
            );
        }
        // The volume count (u32).
        for v in [1u32 << 31, u32::MAX, MAX_VOLUMES as u32 + 1] {
            let e = refused(&slot_with(&file, 40, &v.to_le_bytes(), true));
            assert!(
                e.contains(&format!("field volumes = {v}, the limit is")),
                "{v}: {e}"
            );
        }
        for v in [0u32, 1, 3] {
            let e = refused(&slot_with(&file, 40, &v.to_le_bytes(), true));
            assert!(
                e.contains("field blobs") || e.contains("volume 2: name length = 0"),
                "{v}: {e}"
            );
        }
        // A name's length (u16) past the body.
        for v in [0u16, 1 << 15, u16::MAX] {
            let e = refused(&slot_with(&file, 64, &v.to_le_bytes(), true));
            assert!(e.starts_with("volume 0:"), "{v}: {e}");
        }
        // The swap extents (u32) the blobs must lie in, and a blob's extent.
        for v in [0u32, 7] {
            let e = refused(&slot_with(&file, 12, &v.to_le_bytes(), true));
            assert!(e.contains(&format!("past field extents = {v}")), "{v}: {e}");
        }
        let entry = 64 + 3 + 3 + 12;
        for v in [16u32, 1 << 31, u32::MAX] {
            let e = refused(&slot_with(&file, entry, &v.to_le_bytes(), true));
            assert!(
                e.contains(&format!("swap extent {v}, past field extents = 16")),
                "{v}: {e}"
            );
        }
        // A volume number (u32) past the volumes, and the reserved field.
        for v in [2u32, 1 << 31, u32::MAX] {
            let e = refused(&slot_with(&file, 64 + 6, &v.to_le_bytes(), true));
            assert!(
                e.contains(&format!("names volume {v}, field volumes = 2")),
                "{v}: {e}"
            );
        }
        assert!(refused(&slot_with(&file, 44, &[1], true)).contains("field reserved = 1"));
    }

    #[test]
    fn a_smaller_swap_now_is_the_configuration_and_damage_never_panics() {
        let dir = tempfile::tempdir().unwrap();
        let file = written(dir.path());
        let s = &file[..file.len() / 2];
        let e = parse_slot(s, BLOB, 6)
            .err()
            .expect("extent 7 past 6 extents")
            .to_string();
        assert!(
            e.contains("invalid config swap_bytes") && e.contains("swap extent 7"),
            "{e}"
        );
        // Every prefix of a slot, and every byte flipped: refused or not,
        // never a panic.
        for n in 0..s.len().min(300) {
            let _ = parse_slot(&s[..n], BLOB, 16);
            let mut b = s.to_vec();
            b[n] ^= 0xff;
            let _ = parse_slot(&b, BLOB, 16);
        }
    }

    #[test]
    fn a_body_length_past_either_slot_is_refused_by_load_naming_the_slot() {
        let dir = tempfile::tempdir().unwrap();
        let file = written(dir.path());
        let slot = file.len() / 2;
        let path = dir.path().join(CKPT_FILE);
        // The only slot: nothing to start from.
        let mut b = file.clone();
        b[56..64].copy_from_slice(&u64::MAX.to_le_bytes());
        fs::write(&path, &b).unwrap();
        let e = load(&StoreDir::os(dir.path()), BLOB, 16)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("neither slot holds a valid checkpoint (slot 0 at offset 0: field body_len = 18446744073709551615"),
            "{e}"
        );
        // The other slot damaged: the valid one loads, the other's damage
        // is told.
        let mut b = file.clone();
        b[slot..slot + 64].copy_from_slice(&file[..64]);
        b[slot + 56..slot + 64].copy_from_slice(&u64::MAX.to_le_bytes());
        fs::write(&path, &b).unwrap();
        let l = load(&StoreDir::os(dir.path()), BLOB, 16).unwrap().unwrap();
        assert_eq!(l.slot, 0);
        let other = l.other.expect_err("the other slot is damaged");
        assert!(
            other.contains(&format!("slot 1 at offset {slot}: field body_len")),
            "{other}"
        );
    }
}
