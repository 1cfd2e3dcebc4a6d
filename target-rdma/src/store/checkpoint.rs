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
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::error::{corrupt, io_err, refused, swap_shrunk, Refusal, StoreError};
use super::format::{Image, Snapshot, Version, FORMAT_VERSION, MAX_VOLUMES};
use super::space::{self, sync_dir};

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
    file: File,
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
        dir: &Path,
        slot_len: u64,
        epoch: u64,
        journal_bytes: u64,
        snap: Snapshot<'_, I>,
    ) -> Result<CheckpointFile, StoreError>
    where
        I: Iterator<Item = (u32, u64, u32, Version)>,
    {
        let tmp = dir.join(format!("{CKPT_FILE}.tmp"));
        let file = space::create(&tmp, 2 * slot_len)?;
        let mut c = CheckpointFile {
            file,
            path: tmp.clone(),
            slot_len,
            current: 1,
        };
        c.write(epoch, journal_bytes, snap)?;
        let path = dir.join(CKPT_FILE);
        fs::rename(&tmp, &path).map_err(io_err("renaming checkpoint into", &path))?;
        sync_dir(dir)?;
        c.path = path;
        Ok(c)
    }

    /// Opens the file [`load`] read (slots of `slot_len`, the newest in
    /// `current`), to write its other slot next.
    pub(super) fn reopen(
        dir: &Path,
        slot_len: u64,
        current: usize,
    ) -> Result<CheckpointFile, StoreError> {
        let path = dir.join(CKPT_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
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
            let mut f = &self.file;
            f.seek(SeekFrom::Start(slot as u64 * self.slot_len))?;
            let mut w = CrcWriter {
                inner: BufWriter::with_capacity(1 << 20, f),
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
    dir: &Path,
    blob_bytes: u32,
    extents: u32,
) -> Result<Option<Loaded>, StoreError> {
    let path = dir.join(CKPT_FILE);
    let mut file = match File::open(&path) {
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
        * ((HEADER_LEN + MAX_VOLUMES * (2 + crate::proto::MAX_VOLUME_NAME) + 4) as u64
            + u64::from(extents) * ENTRY_LEN as u64)
            .next_multiple_of(SLOT_ALIGN);
    if len > max {
        return Err(corrupt(
            &path,
            format!("{len} bytes, more than the {max} this configuration can write"),
        ));
    }
    let mut buf = Vec::with_capacity(len as usize);
    file.read_to_end(&mut buf)
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

/// One slot: `Ok(None)` when it was never written, `Err` with the reason
/// when it does not parse (a torn write, or damage); configuration
/// mismatches are errors of the whole load.
fn parse_slot(
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
            c.u32()? as usize,
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
        _,
        nblobs,
        body,
    )) = fixed
    else {
        return Ok(Err("truncated header".into()));
    };
    if body < HEADER_LEN as u64 || body + 4 > s.len() as u64 {
        return Ok(Err(format!("body length {body} does not fit the slot")));
    }
    let body = body as usize;
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
    if nvols > MAX_VOLUMES {
        return Ok(Err(format!("{nvols} volumes, the limit is {MAX_VOLUMES}")));
    }
    let mut c = Cur {
        buf: &s[HEADER_LEN..body],
    };
    let rest = (|| -> Result<Image, String> {
        let mut volumes = Vec::with_capacity(nvols);
        for _ in 0..nvols {
            let n = c.u16()? as usize;
            let name = std::str::from_utf8(c.take(n)?)
                .map_err(|_| "volume name is not UTF-8".to_string())?;
            volumes.push(name.to_owned());
        }
        if (c.buf.len() as u64) != nblobs.saturating_mul(ENTRY_LEN as u64) {
            return Err(format!(
                "{nblobs} blobs announced, {} bytes of entries",
                c.buf.len()
            ));
        }
        let mut blobs = BTreeMap::new();
        for _ in 0..nblobs {
            let vol = c.u32()?;
            let key = c.u64()?;
            let extent = c.u32()?;
            let version = Version {
                generation: c.u64()?,
                seq: c.u64()?,
            };
            if vol as usize >= nvols {
                return Err(format!("a blob names volume {vol}, there are {nvols}"));
            }
            blobs.insert((vol, key), (extent, version));
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
        return Err(swap_shrunk(extent, extents));
    }
    Ok(Ok(Some(Slot {
        image,
        journal_bytes,
    })))
}
