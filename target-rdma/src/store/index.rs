//! The persistent index: (volume, key) -> swap extent, as a checkpoint plus a
//! journal of changes since it.
//!
//! Both files only ever name extents whose bytes were written and synced
//! before the record was, and an extent the durable index names is never
//! overwritten (write-backs are copy-on-write), so after a crash at any
//! point the index names only complete blob images.
//!
//! A journal belongs to the checkpoint whose epoch its header carries. A
//! checkpoint is renamed into place before the journal is reset, so a crash
//! in between leaves a stale journal that replay recognizes and skips rather
//! than re-applying older mappings on top of newer ones.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::StoreError;

const CKPT_MAGIC: [u8; 4] = *b"ARNC";
const JOURNAL_MAGIC: [u8; 4] = *b"ARNJ";
const FORMAT_VERSION: u32 = 1;
/// magic, version, blob_bytes, extents, generation, epoch, volume count, blob count.
const CKPT_HEADER_LEN: usize = 4 + 4 + 4 + 4 + 8 + 8 + 4 + 8;
const CKPT_ENTRY_LEN: usize = 4 + 8 + 4;
/// magic, version, epoch, crc32c of those 16 bytes.
const JOURNAL_HEADER_LEN: usize = 4 + 4 + 8 + 4;
/// Record framing: payload length, crc32c of the payload.
const RECORD_HEADER_LEN: usize = 8;
const REC_PUT: u8 = 1;
const REC_REMOVE: u8 = 2;
const PUT_LEN: usize = 1 + 4 + 8 + 4;
const REMOVE_LEN: usize = 1 + 4 + 8;
/// Most volumes a checkpoint may name; bounds what a corrupt header can make
/// us allocate.
pub(super) const MAX_VOLUMES: usize = 1 << 16;
/// Journal records between checkpoints never drop below this, so small
/// stores do not checkpoint on every flush.
const MIN_CHECKPOINT_RECORDS: u64 = 64;

pub(super) const CKPT_FILE: &str = "index.ckpt";
pub(super) const JOURNAL_FILE: &str = "index.journal";

/// One change to the durable index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Record {
    Put { vol: u32, key: u64, extent: u32 },
    Remove { vol: u32, key: u64 },
}

/// What a checkpoint plus its journal say.
pub(super) struct Image {
    pub(super) generation: u64,
    pub(super) epoch: u64,
    pub(super) volumes: Vec<String>,
    /// (persisted volume number, key) -> extent.
    pub(super) blobs: BTreeMap<(u32, u64), u32>,
}

/// The open journal and the checkpoint bookkeeping.
pub(super) struct Index {
    dir: PathBuf,
    journal: File,
    journal_len: u64,
    epoch: u64,
    records_since_checkpoint: u64,
    checkpoint_after: u64,
    /// Set when a failed append could not be rolled back: the journal may end
    /// in a torn record, and replay stops there, so nothing may follow it.
    broken: bool,
    /// Set when a checkpoint was renamed into place but the journal could not
    /// be reset: the file on disk still carries the old epoch, and replay
    /// would skip anything appended to it.
    stale_journal: bool,
    pub(super) journal_records: u64,
    pub(super) checkpoints: u64,
    /// Told how long each journal append and checkpoint took.
    pub(super) timing: Option<super::TimingHook>,
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

fn corrupt(file: &Path, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        file: file.to_path_buf(),
        detail: detail.into(),
    }
}

/// Little-endian reader over a checkpoint image that reports truncation.
struct Cur<'a> {
    buf: &'a [u8],
    file: &'a Path,
}

impl Cur<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], StoreError> {
        if self.buf.len() < n {
            return Err(corrupt(self.file, "truncated"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
}

/// Loads the checkpoint and replays its journal; `None` for a new store.
/// A torn or corrupt journal tail is dropped (it was never acknowledged).
pub(super) fn load(dir: &Path, blob_bytes: u32, extents: u32) -> Result<Option<Image>, StoreError> {
    let ckpt_path = dir.join(CKPT_FILE);
    let mut image = match load_checkpoint(&ckpt_path, blob_bytes, extents)? {
        Some(i) => i,
        None => return Ok(None),
    };
    let jpath = dir.join(JOURNAL_FILE);
    let file = match File::open(&jpath) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Some(image)),
        Err(e) => return Err(io_err("opening journal", &jpath)(e)),
    };
    let mut r = BufReader::new(file);
    let mut hdr = [0u8; JOURNAL_HEADER_LEN];
    if r.read_exact(&mut hdr).is_err()
        || hdr[..4] != JOURNAL_MAGIC
        || crc32c::crc32c(&hdr[..16]) != le32(&hdr[16..])
    {
        tracing::warn!(event = "journal_header_invalid", path = %jpath.display(), "ignoring journal with a torn or foreign header");
        return Ok(Some(image));
    }
    let version = le32(&hdr[4..8]);
    if version != FORMAT_VERSION {
        return Err(corrupt(
            &jpath,
            format!("format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let epoch = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
    if epoch != image.epoch {
        tracing::warn!(event = "journal_stale", path = %jpath.display(), journal_epoch = epoch, checkpoint_epoch = image.epoch, "ignoring journal of an older checkpoint");
        return Ok(Some(image));
    }
    let mut offset = JOURNAL_HEADER_LEN as u64;
    let mut payload = [0u8; PUT_LEN];
    loop {
        let mut rh = [0u8; RECORD_HEADER_LEN];
        match read_full(&mut r, &mut rh).map_err(io_err("reading journal", &jpath))? {
            0 => break,
            n if n < RECORD_HEADER_LEN => {
                tracing::warn!(event = "journal_torn_tail", path = %jpath.display(), offset, "dropping a torn journal record header");
                break;
            }
            _ => {}
        }
        let len = le32(&rh[..4]) as usize;
        if len != PUT_LEN && len != REMOVE_LEN {
            tracing::warn!(event = "journal_torn_tail", path = %jpath.display(), offset, len, "dropping journal tail with a bad record length");
            break;
        }
        let p = &mut payload[..len];
        if read_full(&mut r, p).map_err(io_err("reading journal", &jpath))? < len
            || crc32c::crc32c(p) != le32(&rh[4..])
        {
            tracing::warn!(event = "journal_torn_tail", path = %jpath.display(), offset, "dropping a torn or corrupt journal record");
            break;
        }
        let vol = le32(&p[1..5]);
        let key = u64::from_le_bytes(p[5..13].try_into().unwrap_or_default());
        if vol as usize >= image.volumes.len() {
            return Err(corrupt(
                &jpath,
                format!(
                    "record at offset {offset} names volume {vol}, the checkpoint has {}",
                    image.volumes.len()
                ),
            ));
        }
        match (p[0], len) {
            (REC_PUT, PUT_LEN) => {
                let extent = le32(&p[13..17]);
                if extent >= extents {
                    return Err(swap_shrunk(extent, extents));
                }
                image.blobs.insert((vol, key), extent);
                if image.blobs.len() > extents as usize {
                    return Err(corrupt(
                        &jpath,
                        format!("maps more blobs than the {extents} swap extents"),
                    ));
                }
            }
            (REC_REMOVE, REMOVE_LEN) => {
                image.blobs.remove(&(vol, key));
            }
            (t, _) => {
                return Err(corrupt(
                    &jpath,
                    format!("record at offset {offset} has type {t} and length {len}"),
                ))
            }
        }
        offset += (RECORD_HEADER_LEN + len) as u64;
    }
    Ok(Some(image))
}

fn swap_shrunk(extent: u32, extents: u32) -> StoreError {
    StoreError::InvalidConfig {
        key: "swap_bytes",
        detail: format!("the index references swap extent {extent} but swap_bytes now holds only {extents} extents"),
    }
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap_or_default())
}

/// Reads until `buf` is full or EOF; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn load_checkpoint(
    path: &Path,
    blob_bytes: u32,
    extents: u32,
) -> Result<Option<Image>, StoreError> {
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("opening checkpoint", path)(e)),
    };
    let len = file
        .metadata()
        .map_err(io_err("reading metadata of checkpoint", path))?
        .len();
    // Largest checkpoint this configuration can have written.
    let max = (CKPT_HEADER_LEN + MAX_VOLUMES * (2 + crate::proto::MAX_VOLUME_NAME) + 4) as u64
        + u64::from(extents) * CKPT_ENTRY_LEN as u64;
    if len > max {
        return Err(corrupt(
            path,
            format!("{len} bytes, more than the {max} this configuration can write"),
        ));
    }
    let mut buf = Vec::with_capacity(len as usize);
    file.read_to_end(&mut buf)
        .map_err(io_err("reading checkpoint", path))?;
    if buf.len() < CKPT_HEADER_LEN + 4 {
        return Err(corrupt(
            path,
            format!("{} bytes, shorter than a header", buf.len()),
        ));
    }
    let (body, crc) = buf.split_at(buf.len() - 4);
    if crc32c::crc32c(body) != le32(crc) {
        return Err(corrupt(path, "checksum mismatch"));
    }
    let mut c = Cur {
        buf: body,
        file: path,
    };
    if c.take(4)? != CKPT_MAGIC {
        return Err(corrupt(path, "bad magic, expected \"ARNC\""));
    }
    let version = c.u32()?;
    if version != FORMAT_VERSION {
        return Err(corrupt(
            path,
            format!("format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let persisted_blob = c.u32()?;
    if persisted_blob != blob_bytes {
        return Err(StoreError::InvalidConfig {
            key: "blob_bytes",
            detail: format!(
                "configured {blob_bytes} but the store in {} was written with {persisted_blob}",
                path.display()
            ),
        });
    }
    let _extents_when_written = c.u32()?;
    let generation = c.u64()?;
    let epoch = c.u64()?;
    let nvols = c.u32()? as usize;
    let nblobs = c.u64()?;
    if nvols > MAX_VOLUMES {
        return Err(corrupt(
            path,
            format!("{nvols} volumes, the limit is {MAX_VOLUMES}"),
        ));
    }
    if nblobs > u64::from(extents) {
        return Err(corrupt(
            path,
            format!("{nblobs} blobs, more than the {extents} swap extents"),
        ));
    }
    let mut volumes = Vec::with_capacity(nvols);
    for _ in 0..nvols {
        let n = c.u16()? as usize;
        let name = std::str::from_utf8(c.take(n)?)
            .map_err(|_| corrupt(path, "volume name is not UTF-8"))?;
        volumes.push(name.to_owned());
    }
    let mut blobs = BTreeMap::new();
    for _ in 0..nblobs {
        let vol = c.u32()?;
        let key = c.u64()?;
        let extent = c.u32()?;
        if vol as usize >= nvols {
            return Err(corrupt(
                path,
                format!("blob names volume {vol}, there are {nvols}"),
            ));
        }
        if extent >= extents {
            return Err(swap_shrunk(extent, extents));
        }
        blobs.insert((vol, key), extent);
    }
    if !c.buf.is_empty() {
        return Err(corrupt(path, format!("{} trailing bytes", c.buf.len())));
    }
    Ok(Some(Image {
        generation,
        epoch,
        volumes,
        blobs,
    }))
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

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing directory", dir))
}

/// What a checkpoint records.
pub(super) struct Snapshot<'a, I> {
    pub(super) generation: u64,
    pub(super) blob_bytes: u32,
    pub(super) extents: u32,
    pub(super) volumes: &'a [&'a str],
    pub(super) blob_count: u64,
    /// (volume, key, extent), `blob_count` of them.
    pub(super) blobs: I,
}

impl Index {
    /// Writes a checkpoint of `snap` with epoch `epoch`, starts an empty
    /// journal for it and opens that journal for appending.
    pub(super) fn create<I>(
        dir: &Path,
        epoch: u64,
        extents: u32,
        snap: Snapshot<'_, I>,
    ) -> Result<Index, StoreError>
    where
        I: Iterator<Item = (u32, u64, u32)>,
    {
        write_checkpoint(dir, epoch, snap)?;
        let (journal, journal_len) = reset_journal(dir, epoch)?;
        Ok(Index {
            dir: dir.to_path_buf(),
            journal,
            journal_len,
            epoch,
            records_since_checkpoint: 0,
            checkpoint_after: MIN_CHECKPOINT_RECORDS.max(u64::from(extents)),
            broken: false,
            stale_journal: false,
            journal_records: 0,
            checkpoints: 1,
            timing: None,
        })
    }

    /// Appends records and makes them durable. On failure the journal is cut
    /// back to its last good length so later appends stay replayable.
    pub(super) fn append(&mut self, records: &[Record]) -> Result<(), StoreError> {
        let path = self.dir.join(JOURNAL_FILE);
        if self.stale_journal {
            let (journal, len) = reset_journal(&self.dir, self.epoch)?;
            self.journal = journal;
            self.journal_len = len;
            self.stale_journal = false;
            self.broken = false;
        }
        if self.broken {
            return Err(io_err("appending to journal", &path)(io::Error::other(
                "an earlier append could not be rolled back; restart arenad",
            )));
        }
        let mut buf = Vec::with_capacity(records.len() * (RECORD_HEADER_LEN + PUT_LEN));
        for r in records {
            let mut p = [0u8; PUT_LEN];
            let len = match *r {
                Record::Put { vol, key, extent } => {
                    p[0] = REC_PUT;
                    p[1..5].copy_from_slice(&vol.to_le_bytes());
                    p[5..13].copy_from_slice(&key.to_le_bytes());
                    p[13..17].copy_from_slice(&extent.to_le_bytes());
                    PUT_LEN
                }
                Record::Remove { vol, key } => {
                    p[0] = REC_REMOVE;
                    p[1..5].copy_from_slice(&vol.to_le_bytes());
                    p[5..13].copy_from_slice(&key.to_le_bytes());
                    REMOVE_LEN
                }
            };
            buf.extend_from_slice(&(len as u32).to_le_bytes());
            buf.extend_from_slice(&crc32c::crc32c(&p[..len]).to_le_bytes());
            buf.extend_from_slice(&p[..len]);
        }
        let started = std::time::Instant::now();
        let res = self
            .journal
            .write_all(&buf)
            .and_then(|()| self.journal.sync_data());
        if let Err(e) = res {
            if self
                .journal
                .set_len(self.journal_len)
                .and_then(|()| self.journal.sync_data())
                .is_err()
            {
                self.broken = true;
            }
            return Err(io_err("appending to journal", &path)(e));
        }
        if let Some(hook) = &self.timing {
            hook(super::IndexWrite::Journal, started.elapsed());
        }
        self.journal_len += buf.len() as u64;
        self.journal_records += records.len() as u64;
        self.records_since_checkpoint += records.len() as u64;
        Ok(())
    }

    /// Whether the journal has grown enough that replaying it would cost more
    /// than writing a checkpoint (whose size is bounded by the extent count).
    pub(super) fn wants_checkpoint(&self) -> bool {
        self.records_since_checkpoint >= self.checkpoint_after
    }

    /// Replaces checkpoint and journal with a checkpoint of `snap`.
    pub(super) fn checkpoint<I>(&mut self, snap: Snapshot<'_, I>) -> Result<(), StoreError>
    where
        I: Iterator<Item = (u32, u64, u32)>,
    {
        let epoch = self.epoch + 1;
        let started = std::time::Instant::now();
        write_checkpoint(&self.dir, epoch, snap)?;
        if let Some(hook) = &self.timing {
            hook(super::IndexWrite::Checkpoint, started.elapsed());
        }
        self.epoch = epoch;
        self.records_since_checkpoint = 0;
        self.checkpoints += 1;
        // The new checkpoint holds everything the old journal did, so a
        // fresh journal also clears an earlier unrecoverable append.
        match reset_journal(&self.dir, epoch) {
            Ok((journal, len)) => {
                self.journal = journal;
                self.journal_len = len;
                self.broken = false;
                Ok(())
            }
            Err(e) => {
                self.stale_journal = true;
                Err(e)
            }
        }
    }
}

fn write_checkpoint<I>(dir: &Path, epoch: u64, snap: Snapshot<'_, I>) -> Result<(), StoreError>
where
    I: Iterator<Item = (u32, u64, u32)>,
{
    let tmp = dir.join(format!("{CKPT_FILE}.tmp"));
    let file = create_private(&tmp).map_err(io_err("creating checkpoint", &tmp))?;
    let mut w = CrcWriter {
        inner: BufWriter::new(file),
        crc: 0,
    };
    let write = || -> io::Result<File> {
        w.put(&CKPT_MAGIC)?;
        w.put(&FORMAT_VERSION.to_le_bytes())?;
        w.put(&snap.blob_bytes.to_le_bytes())?;
        w.put(&snap.extents.to_le_bytes())?;
        w.put(&snap.generation.to_le_bytes())?;
        w.put(&epoch.to_le_bytes())?;
        w.put(&(snap.volumes.len() as u32).to_le_bytes())?;
        w.put(&snap.blob_count.to_le_bytes())?;
        for name in snap.volumes {
            w.put(&(name.len() as u16).to_le_bytes())?;
            w.put(name.as_bytes())?;
        }
        let mut n = 0u64;
        for (vol, key, extent) in snap.blobs {
            w.put(&vol.to_le_bytes())?;
            w.put(&key.to_le_bytes())?;
            w.put(&extent.to_le_bytes())?;
            n += 1;
        }
        if n != snap.blob_count {
            return Err(io::Error::other(format!(
                "snapshot yielded {n} blobs, announced {}",
                snap.blob_count
            )));
        }
        let crc = w.crc;
        w.inner.write_all(&crc.to_le_bytes())?;
        let file = w.inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(file)
    };
    write().map_err(io_err("writing checkpoint", &tmp))?;
    let dst = dir.join(CKPT_FILE);
    fs::rename(&tmp, &dst).map_err(io_err("renaming checkpoint into", &dst))?;
    sync_dir(dir)
}

fn reset_journal(dir: &Path, epoch: u64) -> Result<(File, u64), StoreError> {
    let tmp = dir.join(format!("{JOURNAL_FILE}.tmp"));
    let mut hdr = [0u8; JOURNAL_HEADER_LEN];
    hdr[..4].copy_from_slice(&JOURNAL_MAGIC);
    hdr[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    hdr[8..16].copy_from_slice(&epoch.to_le_bytes());
    let crc = crc32c::crc32c(&hdr[..16]);
    hdr[16..].copy_from_slice(&crc.to_le_bytes());
    create_private(&tmp)
        .and_then(|mut f| {
            f.write_all(&hdr)?;
            f.sync_all()
        })
        .map_err(io_err("writing journal", &tmp))?;
    let dst = dir.join(JOURNAL_FILE);
    fs::rename(&tmp, &dst).map_err(io_err("renaming journal into", &dst))?;
    sync_dir(dir)?;
    let file = OpenOptions::new()
        .append(true)
        .open(&dst)
        .map_err(io_err("opening journal", &dst))?;
    Ok((file, JOURNAL_HEADER_LEN as u64))
}

/// `File::create`, but 0600 whatever the umask: the index names volumes.
fn create_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}
