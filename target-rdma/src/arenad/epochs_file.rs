//! The `epochs` file: every volume's membership epoch, saved before a
//! raise is answered, in two slots overwritten in place.
//!
//! In place, like the store's checkpoint, because a "write a temporary
//! file, rename it" save needs the space of a second file at the moment of
//! the raise: the slots are allocated when the file is made (at start), so
//! a raise on a full filesystem is still saved. A save writes the same text
//! into slot 0, syncs, then into slot 1 and syncs: the raise is durable
//! once slot 0 is, a crash or a torn write leaves one slot whole, and
//! damage to either slot is survived by the other without losing the last
//! raise (the slot with the higher sequence wins). Only a map outgrowing
//! its slots (many more volumes) makes a new file, by a temporary file and
//! a rename.
//!
//! A slot is text, each line ended by LF, then NUL bytes to the slot's
//! end: `arenad-epochs 2 <sequence>`, one `<epoch> <volume>` line per
//! volume in byte order of the names, then `crc32c <hex>` over every byte
//! before it. A file of format 1 (the same text with the header
//! `arenad-epochs 1` and no sequence, the whole file) is read too: it is
//! what an operator writes by hand, and the next save (at start) turns it
//! into format 2.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use super::events;
use crate::proto::{MAX_EPOCH, MAX_VOLUME_NAME};
use crate::store::disk::{Role, StoreDir};

/// The file's name in the swap directory.
pub const EPOCHS_FILE: &str = "epochs";
/// The header of a format-1 file.
pub(super) const HEADER_V1: &str = "arenad-epochs 1";
/// The header of a format-2 slot, before its sequence.
const HEADER_V2: &str = "arenad-epochs 2 ";
/// Slots are a multiple of this.
const SLOT_ALIGN: u64 = 4096;
/// The longest volume line: a 20-digit epoch, a space, a name, LF.
const MAX_LINE: u64 = 20 + 1 + MAX_VOLUME_NAME as u64 + 1;
/// Volume lines a slot has room for beyond the ones it was sized with.
const SPARE_LINES: u64 = 64;
/// The largest file read: a line for each of 64 Ki volumes, twice, with
/// room to spare; more is damage, and reading it would cost memory
/// without bound.
pub(super) const MAX_FILE_BYTES: u64 = 16 << 20;

/// Why the epochs could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum EpochError {
    /// The file could not be read or written.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// The operation, phrased to precede the path.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file does not parse or fails its checksum.
    #[error("{} is damaged ({detail}): refusing to start, since lost epochs would let fenced-out writers back in; restore it, or move it aside to start every volume at epoch 0", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

/// The file as loaded, open for saves.
pub(super) struct EpochsFile {
    dir: StoreDir,
    path: PathBuf,
    /// The length of each of its two slots; `None` until the file is in
    /// format 2 (absent, or format 1).
    slot_len: Option<u64>,
    /// The sequence of the last save.
    seq: u64,
}

fn corrupt(path: &Path, detail: String) -> EpochError {
    EpochError::Corrupt {
        path: path.to_owned(),
        detail,
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EpochError {
    let path = path.to_owned();
    move |source| EpochError::Io { what, path, source }
}

/// Decodes `text` (a format-1 file, or the text of a format-2 slot): its
/// header line (given to `header`, which returns the sequence or why the
/// line is wrong), the volume lines, the checksum line. An error names
/// the line and what is wrong with it.
fn parse(
    text: &str,
    header: impl Fn(&str) -> Result<u64, String>,
) -> Result<(u64, BTreeMap<String, u64>), String> {
    let body_end = text
        .trim_end_matches('\n')
        .rfind('\n')
        .map(|i| i + 1)
        .ok_or("no checksum line")?;
    let (body, last) = text.split_at(body_end);
    let want = last
        .trim_end()
        .strip_prefix("crc32c ")
        .filter(|h| h.len() == 8)
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| format!("bad checksum line {:?}", last.trim_end()))?;
    let got = crc32c::crc32c(body.as_bytes());
    if got != want {
        return Err(format!("checksum {got:08x}, the file says {want:08x}"));
    }
    let mut lines = body.lines();
    let seq = header(lines.next().unwrap_or_default())?;
    let mut map = BTreeMap::new();
    for (n, line) in lines.enumerate() {
        let n = n + 2;
        let (epoch, name) = line
            .split_once(' ')
            .ok_or_else(|| format!("line {n} is not \"<epoch> <volume>\""))?;
        let epoch = epoch
            .parse::<u64>()
            .ok()
            .filter(|&e| e <= MAX_EPOCH)
            .ok_or_else(|| {
                format!("line {n}: epoch {epoch:?} is not a number from 0 to {MAX_EPOCH}")
            })?;
        if !crate::proto::valid_volume_name(name) {
            return Err(format!("line {n}: {name:?} is not a volume name"));
        }
        if map.insert(name.to_owned(), epoch).is_some() {
            return Err(format!("line {n}: volume {name:?} appears twice"));
        }
    }
    Ok((seq, map))
}

fn utf8(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 at byte {}", e.valid_up_to()))
}

fn v1_header(line: &str) -> Result<u64, String> {
    match line == HEADER_V1 {
        true => Ok(0),
        false => Err(format!("the first line is not {HEADER_V1:?}")),
    }
}

fn v2_header(line: &str) -> Result<u64, String> {
    line.strip_prefix(HEADER_V2)
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| format!("the first line is not \"{HEADER_V2}<sequence>\""))
}

/// Decodes one format-2 slot: its text up to the first NUL, NULs after.
fn parse_slot(slot: &[u8]) -> Result<(u64, BTreeMap<String, u64>), String> {
    let end = slot.iter().position(|&b| b == 0).unwrap_or(slot.len());
    if let Some(at) = slot[end..].iter().position(|&b| b != 0) {
        return Err(format!("byte {} after the text is not NUL", end + at));
    }
    parse(utf8(&slot[..end])?, v2_header)
}

/// The most bytes a file made for `volumes` volumes takes (what a start
/// needs free for it: `arenad --check` counts it).
pub fn file_bytes(volumes: usize) -> u64 {
    let text =
        (HEADER_V2.len() + 21 + "crc32c 00000000\n".len()) as u64 + volumes as u64 * MAX_LINE;
    2 * (text + SPARE_LINES * MAX_LINE).next_multiple_of(SLOT_ALIGN)
}

/// The text of a slot: `map` at sequence `seq`.
fn render(map: &BTreeMap<String, u64>, seq: u64) -> String {
    let mut text = format!("{HEADER_V2}{seq}\n");
    for (name, epoch) in map {
        text.push_str(&format!("{epoch} {name}\n"));
    }
    let crc = crc32c::crc32c(text.as_bytes());
    text.push_str(&format!("crc32c {crc:08x}\n"));
    text
}

impl EpochsFile {
    /// Reads the epochs of `dir` (none yet is every volume at 0), writing
    /// nothing.
    pub(super) fn load(dir: &StoreDir) -> Result<(BTreeMap<String, u64>, EpochsFile), EpochError> {
        let path = dir.join(EPOCHS_FILE);
        let mut file = EpochsFile {
            dir: dir.clone(),
            path: path.clone(),
            slot_len: None,
            seq: 0,
        };
        let opened = dir.open(Role::Epochs, &path, OpenOptions::new().read(true));
        let f = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok((BTreeMap::new(), file));
            }
            Err(e) => return Err(io("reading", &path)(e)),
        };
        let len = f.metadata().map_err(io("reading", &path))?.len();
        if len > MAX_FILE_BYTES {
            return Err(corrupt(
                &path,
                format!(
                    "{len} bytes, more than the {MAX_FILE_BYTES} a file of every volume's epoch can be"
                ),
            ));
        }
        let mut bytes = vec![0u8; len as usize];
        f.read_exact_at(&mut bytes, 0)
            .map_err(io("reading", &path))?;
        if !bytes.starts_with(HEADER_V2.as_bytes()) {
            let (_, map) = utf8(&bytes)
                .and_then(|text| parse(text, v1_header))
                .map_err(|e| corrupt(&path, e))?;
            return Ok((map, file));
        }
        if len == 0 || !len.is_multiple_of(2 * SLOT_ALIGN) {
            return Err(corrupt(
                &path,
                format!("{len} bytes, not two slots of a multiple of {SLOT_ALIGN} bytes: truncated or replaced"),
            ));
        }
        let half = len / 2;
        let slot = |i: u64| {
            parse_slot(&bytes[(i * half) as usize..((i + 1) * half) as usize])
                .map_err(|e| format!("slot {i} at offset {}: {e}", i * half))
        };
        let (seq, map) = match (slot(0), slot(1)) {
            (Ok(a), Ok(b)) if a.0 == b.0 && a.1 != b.1 => {
                return Err(corrupt(
                    &path,
                    format!("both slots are sequence {} and differ", a.0),
                ))
            }
            (Ok(a), Ok(b)) => match a.0 >= b.0 {
                true => a,
                false => b,
            },
            (Ok(good), Err(why)) | (Err(why), Ok(good)) => {
                tracing::warn!(event = events::EPOCHS_SLOT_DAMAGED, path = %path.display(), detail = %why, "one slot of the epochs file is damaged; the other holds the last saved epochs, and the next save rewrites both");
                good
            }
            (Err(a), Err(b)) => {
                return Err(corrupt(
                    &path,
                    format!("neither slot holds valid epochs ({a}; {b})"),
                ))
            }
        };
        file.slot_len = Some(half);
        file.seq = seq;
        Ok((map, file))
    }

    /// Whether the file is in format 2: saves need no new space.
    pub(super) fn in_place(&self) -> bool {
        self.slot_len.is_some()
    }

    /// Saves `map`: in place when it fits the slots, else as a new file.
    /// Returns once it is durable.
    pub(super) fn save(&mut self, map: &BTreeMap<String, u64>) -> Result<(), EpochError> {
        self.seq += 1;
        let text = render(map, self.seq);
        match self.slot_len {
            Some(len) if text.len() as u64 <= len => {
                let mut buf = text.into_bytes();
                buf.resize(len as usize, 0);
                let file = self
                    .dir
                    .open(Role::Epochs, &self.path, OpenOptions::new().write(true))
                    .map_err(io("opening", &self.path))?;
                file.write_all_at(&buf, 0)
                    .and_then(|()| file.sync_data())
                    .map_err(io("writing", &self.path))?;
                // Durable from here; the copy is what survives damage to
                // slot 0 later.
                if let Err(e) = file.write_all_at(&buf, len).and_then(|()| file.sync_data()) {
                    tracing::warn!(event = events::EPOCHS_COPY_FAILED, path = %self.path.display(), error = %e, "the epochs were saved in slot 0 of the epochs file but not copied to slot 1: damage to slot 0 before the next save would lose them");
                }
                Ok(())
            }
            _ => self.make(&text),
        }
    }

    /// Makes a new file with room for `text` and more, both slots holding
    /// it, in place of the old one.
    fn make(&mut self, text: &str) -> Result<(), EpochError> {
        let len = (text.len() as u64 + SPARE_LINES * MAX_LINE).next_multiple_of(SLOT_ALIGN);
        let tmp = self.path.with_extension("tmp");
        let file = self
            .dir
            .create(Role::Epochs, &tmp)
            .map_err(io("creating", &tmp))?;
        // Both slots written whole: every block allocated now.
        let mut buf = text.as_bytes().to_vec();
        buf.resize(len as usize, 0);
        file.write_all_at(&buf, 0)
            .and_then(|()| file.write_all_at(&buf, len))
            .and_then(|()| file.sync_all())
            .map_err(io("writing", &tmp))?;
        self.dir
            .rename(Role::Epochs, &tmp, &self.path)
            .map_err(io("renaming into place", &self.path))?;
        std::fs::File::open(&*self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing the directory of", &self.path))?;
        self.slot_len = Some(len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::MetadataExt;
    use std::sync::Arc;

    use super::*;
    use crate::store::disk::Disk;
    use crate::store::faults::{FaultyDisk, Op, EVERY_FAULT};

    fn on(disk: &Arc<FaultyDisk>, dir: &Path) -> StoreDir {
        StoreDir::new(dir, Arc::clone(disk) as Arc<dyn Disk>)
    }

    fn epoch_of(dir: &Path, volume: &str) -> u64 {
        let (map, _) = EpochsFile::load(&StoreDir::os(dir)).unwrap();
        map.get(volume).copied().unwrap_or(0)
    }

    fn load_err(dir: &Path) -> String {
        EpochsFile::load(&StoreDir::os(dir))
            .err()
            .expect("refused")
            .to_string()
    }

    #[test]
    fn once_made_saves_are_in_place_in_both_slots() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FaultyDisk::default());
        let (mut map, mut f) = EpochsFile::load(&on(&disk, dir.path())).unwrap();
        assert!(!f.in_place());
        f.save(&map).unwrap();
        assert!(f.in_place());
        let path = dir.path().join(EPOCHS_FILE);
        let (ino, len) = {
            let m = fs::metadata(&path).unwrap();
            (m.ino(), m.len())
        };
        assert_eq!(len, file_bytes(0));
        let renames = disk.calls(Role::Epochs, Op::Rename);
        for (i, name) in ["a", "b", "c"].iter().enumerate() {
            map.insert((*name).into(), 10 + i as u64);
            f.save(&map).unwrap();
        }
        // No new file, no rename, no growth: nothing that needs space.
        let m = fs::metadata(&path).unwrap();
        assert_eq!((m.ino(), m.len()), (ino, len));
        assert_eq!(disk.calls(Role::Epochs, Op::Rename), renames);
        assert_eq!(disk.calls(Role::Epochs, Op::Allocate), 0);
        let bytes = fs::read(&path).unwrap();
        let half = (len / 2) as usize;
        assert_eq!(
            bytes[..half],
            bytes[half..],
            "both slots hold the last save"
        );
        let (seq, saved) = parse_slot(&bytes[..half]).unwrap();
        assert_eq!((seq, &saved), (4, &map), "the first save, then three");
    }

    #[test]
    fn a_map_outgrowing_its_slots_gets_a_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let (mut map, mut f) = EpochsFile::load(&StoreDir::os(dir.path())).unwrap();
        f.save(&map).unwrap();
        for i in 0..200 {
            map.insert(format!("{i:0>60}"), MAX_EPOCH - i);
            f.save(&map).unwrap();
        }
        assert!(fs::metadata(dir.path().join(EPOCHS_FILE)).unwrap().len() > file_bytes(0));
        let (loaded, _) = EpochsFile::load(&StoreDir::os(dir.path())).unwrap();
        assert_eq!(loaded, map);
    }

    #[test]
    fn a_damaged_slot_is_survived_without_losing_the_last_save() {
        let dir = tempfile::tempdir().unwrap();
        let (mut map, mut f) = EpochsFile::load(&StoreDir::os(dir.path())).unwrap();
        for epoch in [5, 6] {
            map.insert("a".into(), epoch);
            f.save(&map).unwrap();
        }
        let path = dir.path().join(EPOCHS_FILE);
        let good = fs::read(&path).unwrap();
        let half = good.len() / 2;
        for slot in 0..2 {
            let mut bad = good.clone();
            bad[slot * half + 20] ^= 0x01;
            fs::write(&path, &bad).unwrap();
            assert_eq!(epoch_of(dir.path(), "a"), 6, "slot {slot} damaged");
        }
        let mut bad = good.clone();
        bad[20] ^= 0x01;
        bad[half + 20] ^= 0x01;
        fs::write(&path, &bad).unwrap();
        let err = load_err(dir.path());
        assert!(
            err.contains("neither slot holds valid epochs (slot 0 at offset 0: checksum")
                && err.contains(&format!("slot 1 at offset {half}: checksum")),
            "{err}"
        );
        // Bytes after a slot's text, and a file cut short, are damage too.
        let mut bad = good.clone();
        bad[half - 1] = b'x';
        bad[2 * half - 1] = b'x';
        fs::write(&path, &bad).unwrap();
        let err = load_err(dir.path());
        assert!(
            err.contains(&format!("byte {} after the text is not NUL", half - 1)),
            "{err}"
        );
        fs::write(&path, &good[..half + 100]).unwrap();
        let err = load_err(dir.path());
        assert!(err.contains("not two slots"), "{err}");
    }

    #[test]
    fn a_format_1_file_is_read_and_saved_as_format_2() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(EPOCHS_FILE);
        let body = format!("{HEADER_V1}\n7 vm1\n12 vm2\n");
        let crc = crc32c::crc32c(body.as_bytes());
        fs::write(&path, format!("{body}crc32c {crc:08x}\n")).unwrap();
        let (map, mut f) = EpochsFile::load(&StoreDir::os(dir.path())).unwrap();
        assert_eq!(map.get("vm2"), Some(&12));
        assert!(!f.in_place());
        f.save(&map).unwrap();
        let bytes = fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"arenad-epochs 2 1\n"), "{bytes:?}");
        assert_eq!(epoch_of(dir.path(), "vm1"), 7);
        assert_eq!(epoch_of(dir.path(), "vm2"), 12);
    }

    /// The file made, then saves of volume "a" at 1..=6 on `disk`, the
    /// power cut after them: the highest save that returned OK.
    fn saves(disk: &Arc<FaultyDisk>, dir: &Path) -> u64 {
        let Ok((mut map, mut f)) = EpochsFile::load(&on(disk, dir)) else {
            return 0;
        };
        let mut acked = 0;
        if f.save(&map).is_ok() {
            for epoch in 1..=6 {
                map.insert("a".into(), epoch);
                if f.save(&map).is_ok() {
                    acked = epoch;
                }
            }
        }
        disk.crash().unwrap();
        acked
    }

    /// Every fault on every call the saves make: no save that returned OK
    /// is lost after a power cut, and the file loads.
    #[test]
    fn every_fault_of_the_file_loses_no_save_that_returned() {
        let clean = {
            let dir = tempfile::tempdir().unwrap();
            let disk = Arc::new(FaultyDisk::default());
            assert_eq!(saves(&disk, dir.path()), 6);
            disk
        };
        let mut cases = 0;
        for &(op, faults) in EVERY_FAULT {
            for n in 1..=clean.calls(Role::Epochs, op) {
                for &fault in faults {
                    let dir = tempfile::tempdir().unwrap();
                    let disk = Arc::new(FaultyDisk::default());
                    disk.fail_once(Role::Epochs, op, n, fault);
                    let acked = saves(&disk, dir.path());
                    let (map, _) = EpochsFile::load(&StoreDir::os(dir.path()))
                        .unwrap_or_else(|e| panic!("{op:?} call {n}, {fault:?}: {e}"));
                    let found = map.get("a").copied().unwrap_or(0);
                    assert!(
                        found >= acked && found <= 6,
                        "{op:?} call {n}, {fault:?}: saved {acked}, found {found}"
                    );
                    cases += 1;
                }
            }
        }
        assert!(cases >= 20, "{cases} cases");
    }
}
