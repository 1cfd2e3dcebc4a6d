//! The store's file I/O, behind one trait.
//!
//! Every byte the store moves to or from its files goes through a [`Disk`]:
//! opening, positioned reads and writes, syncs, space reservation, the
//! checkpoint's rename, and the transfers the swap queues on io_uring (the
//! ring does the I/O, the disk is asked first). Production uses [`OsDisk`];
//! the store's tests put a disk in its place that fails on cue, so that
//! what the store does with each failing call of each file is tested in
//! `cargo test` rather than hoped for.

use std::fmt;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::ops::Deref;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which of the store's files a call is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Role {
    /// `swap`: the extents.
    Swap,
    /// `swap.meta`: the extent headers.
    ExtentTable,
    /// `index.journal`.
    Journal,
    /// `index.ckpt` (and the temporary file it is created as).
    Checkpoint,
    /// arenad's `epochs`, beside the store's files (and the temporary
    /// file a new one is made as).
    Epochs,
}

/// A transfer the swap queues on an io_uring.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(
    not(test),
    expect(
        dead_code,
        reason = "what a disk that fails on cue needs; the OS's ignores it"
    )
)]
pub(crate) struct Transfer<'a> {
    pub(crate) offset: u64,
    pub(crate) len: u32,
    /// The bytes a write takes to the file; `None` for a read.
    pub(crate) data: Option<&'a [u8]>,
}

/// The file operations of the store.
pub(crate) trait Disk: Send + Sync + fmt::Debug {
    fn open(&self, role: Role, path: &Path, options: &OpenOptions) -> io::Result<File>;
    /// Reads all of `buf` from `offset`.
    fn read_at(&self, role: Role, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, role: Role, file: &File, buf: &[u8], offset: u64) -> io::Result<()>;
    /// fdatasync, or fsync when `metadata`.
    fn sync(&self, role: Role, file: &File, metadata: bool) -> io::Result<()>;
    /// Allocates the file's blocks up to `len` bytes (fallocate mode 0).
    fn allocate(&self, role: Role, file: &File, len: u64) -> io::Result<()>;
    fn rename(&self, role: Role, from: &Path, to: &Path) -> io::Result<()>;
    /// Asked before a transfer is queued on a ring: `None` queues it,
    /// `Some(result)` completes it with that result (a byte count, or a
    /// negated errno) without queueing it.
    fn queue(&self, role: Role, file: &File, transfer: Transfer<'_>) -> Option<i32>;
}

/// The operating system's files.
#[derive(Debug, Default)]
pub(crate) struct OsDisk;

impl Disk for OsDisk {
    fn open(&self, _: Role, path: &Path, options: &OpenOptions) -> io::Result<File> {
        options.open(path)
    }

    fn read_at(&self, _: Role, file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        file.read_exact_at(buf, offset)
    }

    fn write_at(&self, _: Role, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        file.write_all_at(buf, offset)
    }

    fn sync(&self, _: Role, file: &File, metadata: bool) -> io::Result<()> {
        match metadata {
            true => file.sync_all(),
            false => file.sync_data(),
        }
    }

    fn allocate(&self, _: Role, file: &File, len: u64) -> io::Result<()> {
        rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len)
            .map_err(io::Error::from)
    }

    fn rename(&self, _: Role, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn queue(&self, _: Role, _: &File, _: Transfer<'_>) -> Option<i32> {
        None
    }
}

/// The store's directory and the disk its files are on.
#[derive(Clone, Debug)]
pub(crate) struct StoreDir {
    path: PathBuf,
    disk: Arc<dyn Disk>,
}

impl StoreDir {
    pub(crate) fn new(path: impl Into<PathBuf>, disk: Arc<dyn Disk>) -> StoreDir {
        StoreDir {
            path: path.into(),
            disk,
        }
    }

    /// `path` on the operating system's files.
    pub(crate) fn os(path: impl Into<PathBuf>) -> StoreDir {
        StoreDir::new(path, Arc::new(OsDisk))
    }

    /// Opens `path` (a file of the directory) as `role`.
    pub(crate) fn open(
        &self,
        role: Role,
        path: &Path,
        options: &OpenOptions,
    ) -> io::Result<DiskFile> {
        let file = self.disk.open(role, path, options)?;
        Ok(DiskFile {
            file,
            role,
            disk: Arc::clone(&self.disk),
        })
    }

    /// Creates (or empties) `path` as `role` for reading and writing, 0600
    /// whatever the umask (the files name volumes and hold their data).
    pub(crate) fn create(&self, role: Role, path: &Path) -> io::Result<DiskFile> {
        self.open(
            role,
            path,
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600),
        )
    }

    /// The whole of `path`, read as `role`.
    pub(crate) fn read(&self, role: Role, path: &Path) -> io::Result<Vec<u8>> {
        let file = self.open(role, path, OpenOptions::new().read(true))?;
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, 0)?;
        Ok(buf)
    }

    pub(crate) fn rename(&self, role: Role, from: &Path, to: &Path) -> io::Result<()> {
        self.disk.rename(role, from, to)
    }
}

impl Deref for StoreDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

/// An open file of the store, its calls going through its disk.
#[derive(Debug)]
pub(crate) struct DiskFile {
    file: File,
    role: Role,
    disk: Arc<dyn Disk>,
}

impl DiskFile {
    pub(crate) fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.disk.read_at(self.role, &self.file, buf, offset)
    }

    pub(crate) fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.disk.write_at(self.role, &self.file, buf, offset)
    }

    pub(crate) fn sync_data(&self) -> io::Result<()> {
        self.disk.sync(self.role, &self.file, false)
    }

    pub(crate) fn sync_all(&self) -> io::Result<()> {
        self.disk.sync(self.role, &self.file, true)
    }

    pub(crate) fn allocate(&self, len: u64) -> io::Result<()> {
        self.disk.allocate(self.role, &self.file, len)
    }

    pub(crate) fn metadata(&self) -> io::Result<Metadata> {
        self.file.metadata()
    }

    /// Another handle on the same open file (and disk).
    pub(crate) fn try_clone(&self) -> io::Result<DiskFile> {
        Ok(DiskFile {
            file: self.file.try_clone()?,
            role: self.role,
            disk: Arc::clone(&self.disk),
        })
    }

    /// See [`Disk::queue`].
    pub(crate) fn queue(&self, transfer: Transfer<'_>) -> Option<i32> {
        self.disk.queue(self.role, &self.file, transfer)
    }
}

impl AsRawFd for DiskFile {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}
