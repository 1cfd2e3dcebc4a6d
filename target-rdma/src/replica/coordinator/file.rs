//! The single-host coordination store: without etcd, a volume's membership
//! lives in a file of ublkd's state directory, and the writer lease is an
//! exclusive `flock` on a lock file beside it.
//!
//! This is the documented fallback for one host serving its own volumes
//! (docs/REPLICATION.md): it cannot keep two hosts from serving one volume,
//! only two processes on this host. The record is replaced atomically:
//! written to a temporary file, fsynced, renamed over the old one, and the
//! directory fsynced, so a crash leaves the old record or the new one.
//! Requests run on a short-lived thread each (they are rare: one per
//! membership change), so an fsync never stalls the queue thread that
//! awaits it.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use futures::channel::oneshot;

use super::{CoordError, CoordErrorKind, CoordFuture, Coordinator, Lease, Membership, Swap};

/// How long the lease is reported valid from any call: the `flock` is held
/// for the coordinator's whole life, so it never expires on its own.
const HELD: Duration = Duration::from_secs(24 * 3600);

/// A volume's membership in `<state_dir>/<volume>.replicas.json`, guarded by
/// `<volume>.replicas.lock`.
pub struct FileCoordinator {
    paths: Arc<Paths>,
    /// Holds the `flock` (the writer lease) while the coordinator lives.
    _lock: File,
}

struct Paths {
    dir: PathBuf,
    record: PathBuf,
    temp: PathBuf,
}

fn corrupt(msg: String) -> CoordError {
    CoordError::new(CoordErrorKind::Corrupt, msg)
}

fn unavailable(msg: String) -> CoordError {
    CoordError::new(CoordErrorKind::Unavailable, msg)
}

impl FileCoordinator {
    /// Takes the writer lease of `volume` in `state_dir` and, when the
    /// volume has no record yet, records it on `initial_peers` (all healthy
    /// at epoch 1: a new volume). A second writer on this host is refused
    /// with [`CoordErrorKind::LeaseHeld`].
    pub fn open(
        state_dir: &Path,
        volume: &str,
        initial_peers: &[String],
    ) -> Result<Self, CoordError> {
        let paths = Paths {
            dir: state_dir.to_owned(),
            record: state_dir.join(format!("{volume}.replicas.json")),
            temp: state_dir.join(format!(".{volume}.replicas.json.new")),
        };
        let lock_path = state_dir.join(format!("{volume}.replicas.lock"));
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| unavailable(format!("cannot open {}: {e}", lock_path.display())))?;
        match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(CoordError::new(
                    CoordErrorKind::LeaseHeld,
                    format!(
                        "volume {volume:?} is already served by another process on this host ({} is locked)",
                        lock_path.display()
                    ),
                ))
            }
            Err(e) => {
                return Err(unavailable(format!(
                    "cannot lock {}: {e}",
                    lock_path.display()
                )))
            }
        }
        if !paths.record.exists() {
            let m = Membership::new_volume(initial_peers).map_err(|why| {
                corrupt(format!(
                    "cannot record volume {volume:?} on {initial_peers:?}: {why}"
                ))
            })?;
            paths.store(&m)?;
        }
        paths.read()?;
        Ok(Self {
            paths: Arc::new(paths),
            _lock: lock,
        })
    }

    /// Runs `f` on a thread of its own and answers through a channel.
    fn off_thread<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Paths) -> Result<T, CoordError> + Send + 'static,
    ) -> CoordFuture<'_, T> {
        let paths = Arc::clone(&self.paths);
        let (tx, rx) = oneshot::channel();
        let spawned = thread::Builder::new()
            .name("replica-file".into())
            .spawn(move || {
                let _ = tx.send(f(&paths));
            });
        Box::pin(async move {
            spawned.map_err(|e| unavailable(format!("cannot start a thread: {e}")))?;
            rx.await
                .unwrap_or_else(|_| Err(unavailable("the request's thread died".into())))
        })
    }
}

impl Paths {
    fn read(&self) -> Result<Membership, CoordError> {
        let text = fs::read_to_string(&self.record)
            .map_err(|e| unavailable(format!("cannot read {}: {e}", self.record.display())))?;
        let m: Membership = serde_json::from_str(&text).map_err(|e| {
            corrupt(format!(
                "{} is not a membership record: {e}",
                self.record.display()
            ))
        })?;
        m.validate()
            .map_err(|why| corrupt(format!("{}: {why}", self.record.display())))?;
        Ok(m)
    }

    fn store(&self, m: &Membership) -> Result<(), CoordError> {
        let io = |what: &str, p: &Path, e: std::io::Error| {
            unavailable(format!("{what} {}: {e}", p.display()))
        };
        let mut text = serde_json::to_string_pretty(m).expect("a membership serializes");
        text.push('\n');
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&self.temp)
            .map_err(|e| io("cannot create", &self.temp, e))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| io("cannot write", &self.temp, e))?;
        fs::rename(&self.temp, &self.record).map_err(|e| io("cannot replace", &self.record, e))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("cannot sync", &self.dir, e))
    }
}

impl Coordinator for FileCoordinator {
    fn load(&self) -> CoordFuture<'_, Membership> {
        self.off_thread(Paths::read)
    }

    fn compare_and_swap(&self, expected: u64, next: Membership) -> CoordFuture<'_, Swap> {
        self.off_thread(move |p| {
            next.validate()
                .map_err(|why| corrupt(format!("refusing to store {next}: {why}")))?;
            // Only this process writes the file (it holds the lock), so
            // reading then replacing it is atomic.
            let now = p.read()?;
            if now.epoch != expected {
                return Ok(Swap::Lost(now));
            }
            if next.epoch <= expected {
                return Err(corrupt(format!(
                    "refusing to store {next}: the epoch must grow past {expected}"
                )));
            }
            p.store(&next)?;
            Ok(Swap::Done)
        })
    }

    fn lease(&self) -> Lease {
        Lease::Held {
            until: Instant::now() + HELD,
            term: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;

    use super::*;
    use crate::replica::coordinator::MemberState;

    fn peers() -> Vec<String> {
        vec!["10.0.0.1:7000".into(), "10.0.0.2:7000".into()]
    }

    #[test]
    fn a_new_volume_is_recorded_and_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let c = FileCoordinator::open(dir.path(), "vol", &peers()).unwrap();
        let m = block_on(c.load()).unwrap();
        assert_eq!(m, Membership::new_volume(&peers()).unwrap());
        let mut next = m.clone();
        next.epoch = 2;
        next.members[1].state = MemberState::Failed;
        assert_eq!(
            block_on(c.compare_and_swap(1, next.clone())).unwrap(),
            Swap::Done
        );
        assert_eq!(
            block_on(c.compare_and_swap(1, next.clone())).unwrap(),
            Swap::Lost(next.clone())
        );
        drop(c);
        // Reopened with other peers: the record wins, it is not a new volume.
        let c = FileCoordinator::open(dir.path(), "vol", &["x:1".into()]).unwrap();
        assert_eq!(block_on(c.load()).unwrap(), next);
        let mode = fs::metadata(dir.path().join("vol.replicas.json")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.permissions().mode() & 0o777, 0o600);
        assert!(!dir.path().join(".vol.replicas.json.new").exists());
    }

    #[test]
    fn a_second_writer_on_the_host_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = FileCoordinator::open(dir.path(), "vol", &peers()).unwrap();
        let e = FileCoordinator::open(dir.path(), "vol", &peers())
            .err()
            .unwrap();
        assert_eq!(e.kind, CoordErrorKind::LeaseHeld);
        assert!(e.to_string().contains("already served"), "{e}");
        assert!(matches!(first.lease(), Lease::Held { until, .. } if until > Instant::now()));
        drop(first);
        FileCoordinator::open(dir.path(), "vol", &peers()).unwrap();
    }

    #[test]
    fn a_damaged_record_is_refused_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        drop(FileCoordinator::open(dir.path(), "vol", &peers()).unwrap());
        let path = dir.path().join("vol.replicas.json");
        fs::write(&path, "{\"epoch\": 3, \"members\": [").unwrap();
        let e = FileCoordinator::open(dir.path(), "vol", &peers())
            .err()
            .unwrap();
        assert_eq!(e.kind, CoordErrorKind::Corrupt);
        fs::write(
            &path,
            r#"{"epoch":3,"members":[{"peer":"a","state":"failed"}]}"#,
        )
        .unwrap();
        let e = FileCoordinator::open(dir.path(), "vol", &peers())
            .err()
            .unwrap();
        assert!(e.to_string().contains("active members"), "{e}");
    }

    #[test]
    fn swaps_that_break_the_rules_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let c = FileCoordinator::open(dir.path(), "vol", &peers()).unwrap();
        let mut same = block_on(c.load()).unwrap();
        assert!(
            block_on(c.compare_and_swap(1, same.clone())).is_err(),
            "epoch did not grow"
        );
        same.epoch = 2;
        for m in &mut same.members {
            m.state = MemberState::Failed;
        }
        let e = block_on(c.compare_and_swap(1, same)).unwrap_err();
        assert_eq!(e.kind, CoordErrorKind::Corrupt);
        assert_eq!(block_on(c.load()).unwrap().epoch, 1);
    }
}
