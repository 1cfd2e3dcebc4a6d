//! Disk space reserved in advance.
//!
//! Every file of the store is allocated to its full size when the store is
//! created (or resized at open), and only ever overwritten in place after
//! that: the swap file, its extent table, the journal and both checkpoint
//! slots. So a filesystem that fills up later (another tenant of the disk,
//! a log that grows) can never make a write-back, a journal append or a
//! checkpoint fail with ENOSPC, and a restart on a full filesystem needs no
//! new space.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::error::{io_err, StoreError};

/// Zeros written per call where the filesystem cannot allocate (and when
/// clearing a range).
const ZERO_CHUNK: usize = 1 << 20;

/// Creates (or empties) `path` for reading and writing, `len` bytes
/// allocated, 0600 whatever the umask (the index names volumes, the swap
/// holds their data).
pub(super) fn create(path: &Path, len: u64) -> Result<File, StoreError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| StoreError::Io {
            what: "creating",
            path: path.to_path_buf(),
            source,
        })?;
    reserve(&file, path, len)?;
    Ok(file)
}

/// Allocates `file`'s blocks up to `len` bytes (extending it to `len`).
/// Filesystems without `fallocate` get the missing tail written as zeros,
/// which allocates it just the same.
pub(super) fn reserve(file: &File, path: &Path, len: u64) -> Result<(), StoreError> {
    let err = |source| StoreError::Io {
        what: "reserving disk space for",
        path: path.to_path_buf(),
        source,
    };
    let off_len =
        libc::off_t::try_from(len).map_err(|_| err(io::Error::from_raw_os_error(libc::EFBIG)))?;
    // SAFETY: fallocate on a descriptor we own, with no memory passed.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, off_len) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(err(e));
    }
    let from = file.metadata().map_err(err)?.len();
    if from < len {
        write_zeros(file, from, len - from).map_err(err)?;
    }
    Ok(())
}

/// Overwrites `len` bytes at `offset` with zeros (allocated space stays
/// allocated).
pub(super) fn write_zeros(file: &File, mut offset: u64, len: u64) -> io::Result<()> {
    let zeros = vec![0u8; ZERO_CHUNK.min(len as usize)];
    let end = offset + len;
    while offset < end {
        let n = (end - offset).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], offset)?;
        offset += n as u64;
    }
    Ok(())
}

/// Makes the directory entries of `dir` (a rename into it) durable.
pub(super) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing directory", dir))
}
