//! The swap file: blob-sized extents, moved by io_uring, O_DIRECT when the
//! filesystem allows it.
//!
//! Direct I/O keeps cold blobs out of the page cache (the arena already is
//! the cache) and lets write-back run straight from slot memory. Filesystems
//! that refuse it (tmpfs on old kernels, some FUSE mounts) still work through
//! buffered I/O, because durability comes from fdatasync either way.
//!
//! The file side ([`Swap`]) is shared and runs without the store lock, so
//! that connection threads and the cleaner move extents in parallel; the
//! extent free list ([`Extents`]) is bookkeeping and lives under the lock.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use super::StoreError;

/// Submission queue depth; also the most extents moved per submission.
const RING_ENTRIES: u32 = 64;

/// The swap file and its rings. `Sync`: every transfer borrows a ring of
/// its own.
pub(super) struct Swap {
    file: File,
    path: PathBuf,
    direct: bool,
    extent_bytes: u32,
    /// Idle rings. A transfer takes one (making one when none is idle) so
    /// that concurrent transfers never share a queue; there are never more
    /// than the threads that ran transfers at once.
    rings: Mutex<Vec<IoUring>>,
    /// Set when a submission failed half-way: queued entries might still run
    /// later against buffers we no longer own, so no more I/O may start.
    broken: AtomicBool,
    /// The rings that failed so, kept open (never reused) until the store
    /// closes rather than torn down under entries that may still run.
    wrecks: Mutex<Vec<IoUring>>,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// The extent free list.
pub(super) struct Extents {
    total: u32,
    /// Free extents, lowest on top so the file fills from the front.
    free: Vec<u32>,
}

impl Extents {
    /// `used[e]` marks extents the durable index references.
    pub(super) fn new(total: u32, used: &[bool]) -> Extents {
        Extents {
            total,
            free: (0..total).rev().filter(|&e| !used[e as usize]).collect(),
        }
    }

    pub(super) fn total(&self) -> u32 {
        self.total
    }

    pub(super) fn free_count(&self) -> usize {
        self.free.len()
    }

    pub(super) fn alloc(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub(super) fn free(&mut self, extent: u32) {
        debug_assert!(extent < self.total && !self.free.contains(&extent));
        self.free.push(extent);
    }
}

/// One extent transfer: the extent and the slot memory it moves from or to.
enum Op {
    Read { extent: u32, buf: *mut u8 },
    Write { extent: u32, buf: *const u8 },
}

impl Swap {
    /// Opens (creating and sizing) the swap file of `total` extents. `probe`
    /// is page-aligned scratch memory (a free slot) used to check that the
    /// filesystem accepts O_DIRECT.
    pub(super) fn open(
        path: &Path,
        extent_bytes: u32,
        total: u32,
        probe: &mut [u8],
    ) -> Result<Swap, StoreError> {
        let io_err = |what: &'static str| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { what, path, source }
        };
        let ring = IoUring::new(RING_ENTRIES).map_err(|source| StoreError::Uring { source })?;
        let want_len = u64::from(total) * u64::from(extent_bytes);
        let (file, direct) = match open_file(path, true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (
                open_file(path, false).map_err(io_err("opening swap file"))?,
                false,
            ),
            Err(e) => return Err(io_err("opening swap file")(e)),
        };
        let len = file
            .metadata()
            .map_err(io_err("reading metadata of swap file"))?
            .len();
        if len != want_len {
            file.set_len(want_len).map_err(io_err("sizing swap file"))?;
        }
        let mut swap = Swap {
            file,
            path: path.to_path_buf(),
            direct,
            extent_bytes,
            rings: Mutex::new(vec![ring]),
            broken: AtomicBool::new(false),
            wrecks: Mutex::new(Vec::new()),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
        };
        if swap.direct {
            // Some filesystems accept O_DIRECT at open and refuse it per I/O.
            match swap.read_extent(0, probe) {
                Ok(()) => swap.bytes_read = AtomicU64::new(0),
                Err(StoreError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    swap.file = open_file(path, false).map_err(io_err("opening swap file"))?;
                    swap.direct = false;
                }
                Err(e) => return Err(e),
            }
        }
        if !swap.direct {
            tracing::warn!(
                event = "swap_direct_io_unavailable",
                path = %path.display(),
                "filesystem refuses O_DIRECT; swap uses buffered I/O with fdatasync"
            );
        }
        Ok(swap)
    }

    pub(super) fn direct(&self) -> bool {
        self.direct
    }

    pub(super) fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    pub(super) fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }

    /// Reads one extent into `buf` (a slot).
    pub(super) fn read_extent(&self, extent: u32, buf: &mut [u8]) -> Result<(), StoreError> {
        self.read_extents(&mut [(extent, buf)])
    }

    /// Reads each `(extent, slot bytes)` pair, many per submission.
    pub(super) fn read_extents(&self, reads: &mut [(u32, &mut [u8])]) -> Result<(), StoreError> {
        let ops: Vec<Op> = reads
            .iter_mut()
            .map(|(extent, buf)| {
                debug_assert_eq!(buf.len(), self.extent_bytes as usize);
                Op::Read {
                    extent: *extent,
                    buf: buf.as_mut_ptr(),
                }
            })
            .collect();
        self.run(&ops)
    }

    /// Writes each `(extent, slot bytes)` pair, many per submission.
    pub(super) fn write_extents(&self, writes: &[(u32, &[u8])]) -> Result<(), StoreError> {
        let ops: Vec<Op> = writes
            .iter()
            .map(|&(extent, buf)| {
                debug_assert_eq!(buf.len(), self.extent_bytes as usize);
                Op::Write {
                    extent,
                    buf: buf.as_ptr(),
                }
            })
            .collect();
        self.run(&ops)
    }

    /// Makes every completed write durable.
    pub(super) fn sync(&self) -> Result<(), StoreError> {
        self.file.sync_data().map_err(|source| StoreError::Io {
            what: "syncing swap file",
            path: self.path.clone(),
            source,
        })
    }

    /// Runs transfers through a ring of this call's own, and keeps the ring
    /// for the next call unless it broke.
    fn run(&self, ops: &[Op]) -> Result<(), StoreError> {
        let ring = self.rings.lock().pop();
        let mut ring = match ring {
            Some(r) => r,
            None => IoUring::new(RING_ENTRIES).map_err(|source| StoreError::Uring { source })?,
        };
        let res = self.run_on(&mut ring, ops);
        if self.broken.load(Ordering::Acquire) {
            self.wrecks.lock().push(ring);
        } else {
            self.rings.lock().push(ring);
        }
        res
    }

    /// Runs transfers through `ring`, `RING_ENTRIES` at a time, and checks
    /// that each moved a whole extent. The buffers must stay valid until this
    /// returns, which the callers guarantee by holding the slot guards.
    fn run_on(&self, ring: &mut IoUring, ops: &[Op]) -> Result<(), StoreError> {
        let err = |what: &'static str, path: &Path, source: io::Error| StoreError::Io {
            what,
            path: path.to_path_buf(),
            source,
        };
        if self.broken.load(Ordering::Acquire) {
            return Err(err(
                "using swap file",
                &self.path,
                io::Error::other("an earlier io_uring submission failed; restart arenad"),
            ));
        }
        let fd = types::Fd(self.file.as_raw_fd());
        let len = self.extent_bytes;
        for chunk in ops.chunks(RING_ENTRIES as usize) {
            for (i, op) in chunk.iter().enumerate() {
                let entry = match *op {
                    Op::Read { extent, buf } => opcode::Read::new(fd, buf, len)
                        .offset(u64::from(extent) * u64::from(len))
                        .build(),
                    Op::Write { extent, buf } => opcode::Write::new(fd, buf, len)
                        .offset(u64::from(extent) * u64::from(len))
                        .build(),
                };
                // SAFETY: the entry's buffer is a whole slot that the caller
                // holds a guard on until `run_on` returns, and `run_on` does
                // not return before every pushed entry has completed (or the
                // swap is marked broken and the ring parked in `wrecks`,
                // never used again). The chunk is no larger than the queue,
                // which is empty here: a ring is only reused after every
                // entry of its last call completed.
                let pushed = unsafe { ring.submission().push(&entry.user_data(i as u64)) };
                if pushed.is_err() {
                    self.broken.store(true, Ordering::Release);
                    return Err(err(
                        "queueing swap I/O for",
                        &self.path,
                        io::Error::other("submission queue full"),
                    ));
                }
            }
            let mut results: Vec<Option<i32>> = vec![None; chunk.len()];
            let mut done = 0;
            while done < chunk.len() {
                match ring.submit_and_wait(chunk.len() - done) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        self.broken.store(true, Ordering::Release);
                        return Err(err("submitting swap I/O for", &self.path, e));
                    }
                }
                for cqe in ring.completion() {
                    if let Some(r) = results.get_mut(cqe.user_data() as usize) {
                        if r.replace(cqe.result()).is_none() {
                            done += 1;
                        }
                    }
                }
            }
            for (op, res) in chunk.iter().zip(results) {
                let (what, extent) = match *op {
                    Op::Read { extent, .. } => ("reading swap extent from", extent),
                    Op::Write { extent, .. } => ("writing swap extent to", extent),
                };
                let res = res.unwrap_or(-libc::EIO);
                if res < 0 {
                    return Err(err(what, &self.path, io::Error::from_raw_os_error(-res)));
                }
                if res as u32 != len {
                    return Err(err(
                        what,
                        &self.path,
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("extent {extent}: short transfer of {res} of {len} bytes"),
                        ),
                    ));
                }
                let counter = match op {
                    Op::Read { .. } => &self.bytes_read,
                    Op::Write { .. } => &self.bytes_written,
                };
                counter.fetch_add(u64::from(len), Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

fn open_file(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true).truncate(false);
    o.mode(0o600);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}
