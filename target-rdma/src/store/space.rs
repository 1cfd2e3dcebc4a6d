//! Disk space reserved in advance.
//!
//! Every file of the store is allocated to its full size when the store is
//! created (or resized at open), and only ever overwritten in place after
//! that: the swap file, its extent table, the journal and both checkpoint
//! slots. So a filesystem that fills up later (another tenant of the disk,
//! a log that grows) can never make a write-back, a journal append or a
//! checkpoint fail with ENOSPC, and a restart on a full filesystem needs no
//! new space.

use std::fs::File;
use std::io;
use std::path::Path;

use super::disk::{DiskFile, Role, StoreDir};
use super::error::{io_err, StoreError};

/// Zeros written per call where the filesystem cannot allocate (and when
/// clearing a range).
const ZERO_CHUNK: usize = 1 << 20;

/// Creates (or empties) `path`, a file of `dir`, as `role` (see
/// [`StoreDir::create`]), `len` bytes allocated.
pub(super) fn create(
    dir: &StoreDir,
    role: Role,
    path: &Path,
    len: u64,
) -> Result<DiskFile, StoreError> {
    let file = dir.create(role, path).map_err(|source| StoreError::Io {
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
pub(super) fn reserve(file: &DiskFile, path: &Path, len: u64) -> Result<(), StoreError> {
    let err = |source| StoreError::Io {
        what: "reserving disk space for",
        path: path.to_path_buf(),
        source,
    };
    if i64::try_from(len).is_err() {
        return Err(err(io::Error::from_raw_os_error(libc::EFBIG)));
    }
    let e = match file.allocate(len) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
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
pub(super) fn write_zeros(file: &DiskFile, mut offset: u64, len: u64) -> io::Result<()> {
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
