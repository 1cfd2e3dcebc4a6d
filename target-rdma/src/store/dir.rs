//! The store's directory: the lock that keeps a second process out, and
//! whether a directory without an index holds a new store.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use ublk_metrics::events;

use super::disk::StoreDir;
use super::error::StoreError;
use super::{extent, index, swap};

const LOCK_FILE: &str = "lock";

/// Takes an exclusive advisory lock so that two processes never share a
/// swap file and journal.
pub(super) fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|source| StoreError::Io {
            what: "opening lock file",
            path: path.clone(),
            source,
        })?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(StoreError::Locked {
            path: dir.to_path_buf(),
        }),
        Err(e) => Err(StoreError::Io {
            what: "locking",
            path,
            source: e.into(),
        }),
    }
}

/// Takes the directory's lock shared, without creating the lock file,
/// for a reader that writes nothing (`arenad --check`): refused while a
/// store has it open; `None` when no store ever took it.
pub(super) fn lock_shared(dir: &Path) -> Result<Option<File>, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(StoreError::Io {
                what: "opening lock file",
                path,
                source,
            })
        }
    };
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockShared) {
        Ok(()) => Ok(Some(file)),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(StoreError::Locked {
            path: dir.to_path_buf(),
        }),
        Err(e) => Err(StoreError::Io {
            what: "locking",
            path,
            source: e.into(),
        }),
    }
}

/// With no checkpoint the directory must hold a new store: no other store
/// file, or only those of a creation cut short (they describe no extent and
/// journal nothing). Anything else is an index lost, and starting empty
/// would overwrite the blobs it named.
pub(super) fn check_new(dir: &StoreDir) -> Result<(), StoreError> {
    let exists = |name: &str| dir.join(name).exists();
    let present: Vec<&str> = [index::JOURNAL_FILE, extent::META_FILE, swap::SWAP_FILE]
        .into_iter()
        .filter(|f| exists(f))
        .collect();
    if present.is_empty() {
        return Ok(());
    }
    let meta_blank = if exists(extent::META_FILE) {
        extent::table_is_blank(dir)?
    } else {
        !exists(swap::SWAP_FILE)
    };
    if meta_blank && index::journal_is_blank(dir)? {
        tracing::warn!(event = events::STORE_CREATION_RESUMED, dir = %dir.display(), files = ?present, "found the files of a store whose creation was cut short (no checkpoint, nothing journaled, no extent header): creating it again");
        return Ok(());
    }
    Err(StoreError::Corrupt {
        file: dir.join(index::CKPT_FILE),
        detail: format!(
            "is missing, but {} hold the data of existing blobs: refusing to start with an empty \
             index, which would overwrite them; restore it, or rebuild it with arenad --repair",
            present.join(", ")
        ),
    })
}
