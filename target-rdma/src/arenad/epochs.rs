//! Each volume's membership epoch: the highest epoch any authenticated
//! HELLO or EPOCH presented for it, persisted so that a restart does not
//! let a fenced-out writer back in, and the fence that refuses the data
//! operations of sessions below it.
//!
//! The epochs live in a small file of their own, `epochs` in the swap
//! directory (the store's index is the storage engine's format): one line
//! per volume ever raised, configured or not, checksummed, saved in place
//! before a raise is answered (see [`super::epochs_file`]). A damaged file
//! refuses to start, like a damaged index: trusting it could let a stale
//! writer in.
//!
//! A raise is strict: once it returns, no data operation admitted under a
//! lower epoch is still running and the sessions it fenced out hold no
//! lease (the caller ends them), so a new writer that raised the epoch
//! never races a write of the one it fenced out, inline or by RDMA. A
//! session presenting the epoch being raised waits for the same point: it
//! is the same writer's, and its answer promises the same.
//!
//! `u64::MAX` is never an epoch here: the protocol refuses it before a
//! raise, since a writer at it could not be fenced out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::epochs_file::EpochsFile;
pub use super::epochs_file::{file_bytes, EpochError, EPOCHS_FILE};
use crate::store::disk::StoreDir;

/// One volume's epoch and the data operations running under it.
#[derive(Default)]
struct Fence {
    epoch: u64,
    /// Operations admitted at the current epoch, still running.
    active: u64,
    /// Operations admitted at a lower epoch, still running: a raise waits
    /// for them.
    draining: u64,
    /// The highest epoch whose raise finished (drained, older sessions'
    /// leases ended): up to `epoch`.
    settled: u64,
}

/// One volume's epoch and the data operations running under it: a
/// session holds its volume's from the handshake on.
pub struct VolumeEpoch {
    name: String,
    fence: Mutex<Fence>,
    /// Signalled as `draining` reaches 0 and as `settled` rises.
    drained: Condvar,
}

impl VolumeEpoch {
    /// The epoch now.
    pub fn current(&self) -> u64 {
        self.fence.lock().epoch
    }

    /// Whether presenting `epoch` needs no [`Epochs::raise`]: it is below
    /// the volume's (stale), or at it with that raise finished.
    pub fn settled(&self, epoch: u64) -> bool {
        let f = self.fence.lock();
        epoch < f.epoch || epoch <= f.settled
    }

    /// Admits a data operation of a session at `session` epoch, or returns
    /// the volume's (higher) epoch: the session is stale.
    pub fn admit(&self, session: u64) -> Result<Admitted<'_>, u64> {
        let mut f = self.fence.lock();
        if session < f.epoch {
            return Err(f.epoch);
        }
        f.active += 1;
        Ok(Admitted {
            volume: self,
            at: f.epoch,
        })
    }
}

/// Every volume's epoch, backed by the file. Volumes are looked up by
/// name, so one served from a reload (SIGHUP) gets its epoch like one
/// configured at start, and a volume removed and added again keeps its.
pub struct Epochs {
    path: PathBuf,
    /// The volumes sessions have been bound to (each served volume's name:
    /// bounded by the configuration).
    volumes: Mutex<BTreeMap<String, Arc<VolumeEpoch>>>,
    /// Every epoch the file holds, unconfigured volumes' included; the
    /// lock also orders the file's replacements.
    file: Mutex<Persisted>,
}

/// The epochs as saved, and their file.
struct Persisted {
    map: BTreeMap<String, u64>,
    file: EpochsFile,
}

impl std::fmt::Debug for Epochs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epochs")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// A data operation admitted by [`Epochs::admit`]; it counts as running
/// until dropped.
pub struct Admitted<'a> {
    volume: &'a VolumeEpoch,
    at: u64,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let mut f = self.volume.fence.lock();
        if self.at == f.epoch {
            f.active -= 1;
        } else {
            f.draining -= 1;
            if f.draining == 0 {
                self.volume.drained.notify_all();
            }
        }
    }
}

impl Epochs {
    /// Loads the epochs of `dir` (none yet is every volume at 0), writing
    /// nothing (see [`Epochs::prepare`]).
    pub fn open(dir: &Path) -> Result<Epochs, EpochError> {
        Epochs::open_on(&StoreDir::os(dir))
    }

    /// [`Epochs::open`] with the file on `dir`'s disk.
    pub(crate) fn open_on(dir: &StoreDir) -> Result<Epochs, EpochError> {
        let (map, file) = EpochsFile::load(dir)?;
        Ok(Epochs {
            path: dir.join(EPOCHS_FILE),
            volumes: Mutex::new(BTreeMap::new()),
            file: Mutex::new(Persisted { map, file }),
        })
    }

    /// Makes the file (or turns one of format 1 into format 2) with its
    /// space allocated, so that no raise needs new space: done at start,
    /// where a full filesystem is a refusal to start naming the file.
    pub fn prepare(&self) -> Result<(), EpochError> {
        let mut p = self.file.lock();
        if p.file.in_place() {
            return Ok(());
        }
        let Persisted { map, file } = &mut *p;
        file.save(map)
    }

    /// Volume `name`'s current epoch, for a report: read without creating
    /// the volume's fence when it has none yet (a volume known only from
    /// the store's index), so looking never adds state.
    pub fn epoch_of(&self, name: &str) -> u64 {
        let known = self.volumes.lock().get(name).map(Arc::clone);
        match known {
            Some(v) => v.current(),
            None => self.filed(name),
        }
    }

    /// `name`'s epoch as the file has it (0 for a volume never raised).
    fn filed(&self, name: &str) -> u64 {
        self.file.lock().map.get(name).copied().unwrap_or(0)
    }

    /// Volume `name`'s epoch: the one its sessions share, starting from
    /// the file's (0 for a volume never raised).
    pub fn volume(&self, name: &str) -> Arc<VolumeEpoch> {
        let mut volumes = self.volumes.lock();
        if let Some(v) = volumes.get(name) {
            return Arc::clone(v);
        }
        let epoch = self.filed(name);
        let v = Arc::new(VolumeEpoch {
            name: name.to_owned(),
            fence: Mutex::new(Fence {
                epoch,
                settled: epoch,
                ..Fence::default()
            }),
            drained: Condvar::new(),
        });
        volumes.insert(name.to_owned(), Arc::clone(&v));
        v
    }

    /// Raises `volume`'s epoch to `epoch` if that is higher: from now on
    /// sessions below it are refused; the new epoch is persisted, the
    /// operations admitted under a lower one are waited for, and then
    /// `fence_out` ends what the sessions below it still hold (their
    /// leases), before this returns. Presenting the volume's epoch while
    /// its raise is still under way waits for that raise. Returns the
    /// volume's epoch. Blocks (a file sync, running operations): call it
    /// off the reactor.
    pub fn raise(
        &self,
        volume: &VolumeEpoch,
        epoch: u64,
        fence_out: impl FnOnce(),
    ) -> Result<u64, EpochError> {
        {
            let mut f = volume.fence.lock();
            if epoch < f.epoch {
                return Ok(f.epoch);
            }
            if epoch == f.epoch {
                while f.settled < epoch {
                    volume.drained.wait(&mut f);
                }
                return Ok(f.epoch);
            }
            f.epoch = epoch;
            f.draining += std::mem::take(&mut f.active);
        }
        let saved = {
            let mut p = self.file.lock();
            let Persisted { map, file } = &mut *p;
            let now = map.get(&volume.name).copied().unwrap_or(0).max(epoch);
            map.insert(volume.name.clone(), now);
            file.save(map)
        };
        // Even when the file could not be replaced the raise is in force in
        // memory (sessions below it are refused already): it is finished
        // all the same, so that nothing of theirs lands and nobody waiting
        // for it waits for ever.
        {
            let mut f = volume.fence.lock();
            while f.draining > 0 {
                volume.drained.wait(&mut f);
            }
        }
        fence_out();
        let mut f = volume.fence.lock();
        f.settled = f.settled.max(epoch);
        volume.drained.notify_all();
        saved.map(|()| f.epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::super::epochs_file::{HEADER_V1 as HEADER, MAX_FILE_BYTES};
    use super::*;
    use crate::proto::MAX_EPOCH;
    use std::fs;
    use std::time::Duration;

    #[test]
    fn raises_persist_and_survive_a_reopen_with_unconfigured_volumes_kept() {
        let dir = tempfile::tempdir().unwrap();
        let e = Epochs::open(dir.path()).unwrap();
        let a = e.volume("a");
        assert_eq!(a.current(), 0);
        assert_eq!(e.raise(&a, 7, || {}).unwrap(), 7);
        assert_eq!(e.raise(&a, 3, || {}).unwrap(), 7, "never lowered");
        assert_eq!(e.volume("a").current(), 7, "one fence per volume");
        drop((a, e));
        // "b" is gone from the config and "c" is new: a's epoch stays, and
        // so does b's line when c is raised.
        let e = Epochs::open(dir.path()).unwrap();
        e.raise(&e.volume("b"), 4, || {}).unwrap();
        drop(e);
        let e = Epochs::open(dir.path()).unwrap();
        let (a, c) = (e.volume("a"), e.volume("c"));
        assert_eq!((a.current(), c.current()), (7, 0));
        e.raise(&c, 2, || {}).unwrap();
        drop((a, c, e));
        let e = Epochs::open(dir.path()).unwrap();
        assert_eq!((e.volume("a").current(), e.volume("c").current()), (7, 2));
        let text =
            String::from_utf8_lossy(&fs::read(dir.path().join(EPOCHS_FILE)).unwrap()).into_owned();
        assert!(
            text.contains("7 a\n") && text.contains("4 b\n") && text.contains("2 c\n"),
            "{text}"
        );
    }

    #[test]
    fn reading_an_epoch_creates_no_fence() {
        let dir = tempfile::tempdir().unwrap();
        let e = Epochs::open(dir.path()).unwrap();
        e.raise(&e.volume("a"), 5, || {}).unwrap();
        drop(e);
        let e = Epochs::open(dir.path()).unwrap();
        assert_eq!((e.epoch_of("a"), e.epoch_of("never")), (5, 0));
        assert!(e.volumes.lock().is_empty(), "a read created a fence");
        e.raise(&e.volume("a"), 6, || {}).unwrap();
        assert_eq!(e.epoch_of("a"), 6);
    }

    #[test]
    fn a_damaged_file_refuses_to_open() {
        let dir = tempfile::tempdir().unwrap();
        let e = Epochs::open(dir.path()).unwrap();
        e.raise(&e.volume("b"), 12, || {}).unwrap();
        let path = dir.path().join(EPOCHS_FILE);
        let text = String::from_utf8(fs::read(&path).unwrap()).unwrap();
        // Both slots: one would be survived (see epochs_file).
        fs::write(&path, text.replace("12 b", "11 b")).unwrap();
        let err = Epochs::open(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(
                "is damaged (neither slot holds valid epochs (slot 0 at offset 0: checksum"
            ) && err.contains("epochs"),
            "{err}"
        );
        fs::write(&path, "garbage").unwrap();
        assert!(Epochs::open(dir.path()).is_err());
    }

    /// `lines` under the header, with the checksum a writer computes.
    fn file_of(lines: &str) -> String {
        let body = format!("{HEADER}\n{lines}");
        let crc = crc32c::crc32c(body.as_bytes());
        format!("{body}crc32c {crc:08x}\n")
    }

    #[test]
    fn epochs_and_lines_out_of_range_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(EPOCHS_FILE);
        let open = |bytes: &[u8]| {
            fs::write(&path, bytes).unwrap();
            Epochs::open(dir.path()).map(|e| e.volume("a").current())
        };
        for epoch in [0, 1 << 63, MAX_EPOCH] {
            assert_eq!(
                open(file_of(&format!("{epoch} a\n")).as_bytes()).unwrap(),
                epoch
            );
        }
        let refused = |bytes: &[u8]| open(bytes).expect_err("refused").to_string();
        for epoch in ["18446744073709551615", "18446744073709551616", "-1", ""] {
            let e = refused(file_of(&format!("{epoch} a\n")).as_bytes());
            assert!(
                e.contains(&format!(
                    "line 2: epoch {epoch:?} is not a number from 0 to {MAX_EPOCH}"
                )),
                "{epoch}: {e}"
            );
        }
        let e = refused(file_of("3 a\n4 b\n5 a\n").as_bytes());
        assert!(e.contains("line 4: volume \"a\" appears twice"), "{e}");
        let e = refused(file_of("3 a/b\n").as_bytes());
        assert!(e.contains("line 2: \"a/b\" is not a volume name"), "{e}");
        let e = refused(file_of("7\n").as_bytes());
        assert!(e.contains("line 2 is not \"<epoch> <volume>\""), "{e}");
        let mut bytes = file_of("3 a\n").into_bytes();
        let at = bytes.len() - 3;
        bytes[at] = 0xff;
        let e = refused(&bytes);
        assert!(e.contains(&format!("not UTF-8 at byte {at}")), "{e}");
        let text = file_of("3 a\n");
        let e = refused(text.replace("crc32c ", "crc32c 0").as_bytes());
        assert!(e.contains("bad checksum line"), "{e}");
        // A file too large for every volume's epoch is not read whole.
        let big = vec![b'1'; MAX_FILE_BYTES as usize + 1];
        let e = refused(&big);
        assert!(
            e.contains(&format!("more than the {MAX_FILE_BYTES}")),
            "{e}"
        );
    }

    #[test]
    fn stale_sessions_are_refused_and_a_raise_waits_for_running_operations() {
        let dir = tempfile::tempdir().unwrap();
        let e = Arc::new(Epochs::open(dir.path()).unwrap());
        let a = e.volume("a");
        e.raise(&a, 1, || {}).unwrap();
        assert_eq!(a.admit(0).err(), Some(1));
        let running = a.admit(1).unwrap();
        let raiser = {
            let (e, a) = (Arc::clone(&e), Arc::clone(&a));
            std::thread::spawn(move || e.raise(&a, 2, || {}).unwrap())
        };
        // The raise is visible at once, but does not return while an
        // operation admitted at epoch 1 runs.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while a.admit(1).is_ok() {
            assert!(std::time::Instant::now() < deadline, "raise never applied");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!raiser.is_finished());
        let newer = a.admit(2).unwrap();
        drop(running);
        assert_eq!(raiser.join().unwrap(), 2);
        drop(newer);
        assert_eq!(
            e.volume("b").admit(0).map(|_| ()),
            Ok(()),
            "volume b is untouched"
        );
    }

    #[test]
    fn the_older_sessions_are_fenced_after_the_drain_and_an_equal_epoch_waits_for_it() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let e = Arc::new(Epochs::open(dir.path()).unwrap());
        let a = e.volume("a");
        e.raise(&a, 1, || {}).unwrap();
        let running = a.admit(1).unwrap();
        // 1: fenced with the operation still running (wrong); 2: after it.
        let fenced = Arc::new(AtomicU64::new(0));
        let raiser = {
            let (e, a, fenced, a2) = (
                Arc::clone(&e),
                Arc::clone(&a),
                Arc::clone(&fenced),
                Arc::clone(&a),
            );
            std::thread::spawn(move || {
                e.raise(&a, 2, || {
                    let drained = a2.fence.lock().draining == 0;
                    fenced.store(if drained { 2 } else { 1 }, Ordering::SeqCst);
                })
                .unwrap()
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while a.current() < 2 {
            assert!(std::time::Instant::now() < deadline, "raise never applied");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!a.settled(2), "under way");
        let sibling = {
            let (e, a) = (Arc::clone(&e), Arc::clone(&a));
            std::thread::spawn(move || e.raise(&a, 2, || panic!("only the raiser fences")).unwrap())
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!sibling.is_finished(), "the same epoch waits for its raise");
        assert_eq!(fenced.load(Ordering::SeqCst), 0);
        drop(running);
        assert_eq!(raiser.join().unwrap(), 2);
        assert_eq!(sibling.join().unwrap(), 2);
        assert_eq!(
            fenced.load(Ordering::SeqCst),
            2,
            "fenced once, after the drain"
        );
        assert!(a.settled(2) && a.settled(1) && !a.settled(3));
    }
}
