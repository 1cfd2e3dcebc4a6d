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
//! Besides whole extents it reads aligned ranges of one (a 4 KiB read of a
//! cold blob reads 4 KiB, not the blob) into buffers of its own: a blocking
//! caller on its own ring, an async one on a ring of [`Reads`] (its
//! thread's, or the shared one), so many such reads are in flight at once
//! without a thread each.
//!
//! The file's space is reserved when the store is created ([`space`]), and
//! an existing store's file must be as long as its index says: a missing or
//! truncated swap file is refused, never silently recreated as zeros.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use ublk_metrics::events;

use super::aligned::AlignedBuf;
use super::disk::{DiskFile, Role, StoreDir, Transfer};
use super::error::{io_err, refused, Refusal, StoreError};
use super::extent::{MetaFile, BLOCK};
use super::space;
use super::swap_reads::Reads;

/// Submission queue depth; also the most extents moved per submission.
const RING_ENTRIES: u32 = 64;
/// Range-read and copy buffers kept for reuse, by bytes; by count, as many
/// as reads may be in flight (`swap_reads_in_flight`). More in flight are
/// allocated and freed, so idle memory stays bounded.
const POOLED_BYTES: usize = 32 << 20;
/// The swap file's name in the store directory.
pub(super) const SWAP_FILE: &str = "swap.dat";

/// The swap file and its rings. `Sync`: every transfer borrows a ring of
/// its own.
pub(super) struct Swap {
    /// First, so that it drops (waiting for its reads) before the file.
    reads: Reads,
    file: DiskFile,
    path: PathBuf,
    /// The extent headers, synced with the file.
    meta: Arc<MetaFile>,
    direct: bool,
    extent_bytes: u32,
    /// Idle range-read buffers, at most `pooled` of them.
    buffers: Mutex<Vec<AlignedBuf>>,
    pooled: usize,
    /// Idle rings. A transfer takes one (making one when none is idle) so
    /// that concurrent transfers never share a queue; there are never more
    /// than the threads that ran transfers at once.
    rings: Mutex<Vec<IoUring>>,
    /// Set when a submission failed half-way: queued entries might still run
    /// later against buffers we no longer own, so no more I/O may start.
    broken: AtomicBool,
    /// Set when a sync failed (see [`Refusal::SwapSyncFailed`]).
    sync_failed: AtomicBool,
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

/// One transfer: where in the file, how long, and the memory it moves from
/// or to (a slot, or a range-read buffer).
enum Op {
    Read {
        offset: u64,
        len: u32,
        buf: *mut u8,
    },
    Write {
        offset: u64,
        len: u32,
        buf: *const u8,
    },
}

/// Checks that an existing store's swap file is there and holds the
/// `expect` extents of `extent_bytes` its index was written with (it
/// never shrinks, so a shorter one was cut); returns its length.
pub(super) fn check_file(dir: &Path, extent_bytes: u32, expect: u32) -> Result<u64, StoreError> {
    let path = dir.join(SWAP_FILE);
    let len = match std::fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(StoreError::Corrupt {
                file: path,
                detail: "is missing, but the index names blobs in it; restore it \
                         (or move the whole store directory aside to start empty)"
                    .into(),
            })
        }
        Err(e) => return Err(io_err("reading metadata of swap file", &path)(e)),
    };
    let want = u64::from(expect) * u64::from(extent_bytes);
    if len < want {
        return Err(StoreError::Corrupt {
            file: path,
            detail: format!(
                "is {len} bytes, the index was written for {want} ({expect} extents of {extent_bytes}, \
                 the checkpoint's extents field): truncated; the extents past byte {len} are lost"
            ),
        });
    }
    Ok(len)
}

impl Swap {
    /// Creates the swap file of `total` extents in `dir` (space reserved)
    /// and its extent table. `probe` is page-aligned scratch memory (a free
    /// slot) used to check that the filesystem accepts O_DIRECT.
    pub(super) fn create(
        dir: &StoreDir,
        extent_bytes: u32,
        total: u32,
        reads_in_flight: u32,
        probe: &mut [u8],
    ) -> Result<Swap, StoreError> {
        let meta = MetaFile::create(dir, extent_bytes, total)?;
        let path = dir.join(SWAP_FILE);
        let size = u64::from(total) * u64::from(extent_bytes);
        let file = space::create(dir, Role::Swap, &path, size)?;
        file.sync_all()
            .map_err(io_err("syncing swap file", &path))?;
        drop(file);
        Swap::start(dir, &path, meta, extent_bytes, reads_in_flight, probe)
    }

    /// Opens an existing store's swap file, which must hold at least the
    /// `expect` extents its index was written with, and grows it (and the
    /// extent table) to `total` if needed. Never shrinks them: a lower
    /// `swap_bytes` leaves the tail unused.
    pub(super) fn open(
        dir: &StoreDir,
        extent_bytes: u32,
        expect: u32,
        total: u32,
        reads_in_flight: u32,
        probe: &mut [u8],
    ) -> Result<Swap, StoreError> {
        let len = check_file(dir, extent_bytes, expect)?;
        let path = dir.join(SWAP_FILE);
        let file = dir
            .open(Role::Swap, &path, OpenOptions::new().write(true))
            .map_err(io_err("opening swap file", &path))?;
        let size = u64::from(total) * u64::from(extent_bytes);
        if len < size {
            space::reserve(&file, &path, size)?;
        }
        drop(file);
        let meta = MetaFile::open(dir, extent_bytes, expect, total)?;
        Swap::start(dir, &path, meta, extent_bytes, reads_in_flight, probe)
    }

    fn start(
        dir: &StoreDir,
        path: &Path,
        meta: MetaFile,
        extent_bytes: u32,
        reads_in_flight: u32,
        probe: &mut [u8],
    ) -> Result<Swap, StoreError> {
        let ring = IoUring::new(RING_ENTRIES).map_err(|source| StoreError::Uring { source })?;
        let (file, direct) = match open_file(dir, path, true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (
                open_file(dir, path, false).map_err(io_err("opening swap file", path))?,
                false,
            ),
            Err(e) => return Err(io_err("opening swap file", path)(e)),
        };
        let reads = Reads::start(&file, path, reads_in_flight)
            .map_err(|source| StoreError::Uring { source })?;
        let mut swap = Swap {
            reads,
            file,
            path: path.to_path_buf(),
            meta: Arc::new(meta),
            direct,
            extent_bytes,
            buffers: Mutex::new(Vec::new()),
            pooled: reads_in_flight as usize,
            rings: Mutex::new(vec![ring]),
            broken: AtomicBool::new(false),
            sync_failed: AtomicBool::new(false),
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
                    swap.file =
                        open_file(dir, path, false).map_err(io_err("opening swap file", path))?;
                    swap.direct = false;
                    swap.reads = Reads::start(&swap.file, path, reads_in_flight)
                        .map_err(|source| StoreError::Uring { source })?;
                }
                Err(e) => return Err(e),
            }
        }
        if !swap.direct {
            tracing::warn!(
                event = events::SWAP_DIRECT_IO_UNAVAILABLE,
                path = %path.display(),
                "filesystem refuses O_DIRECT; swap uses buffered I/O with fdatasync"
            );
        }
        Ok(swap)
    }

    pub(super) fn direct(&self) -> bool {
        self.direct
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// The file offset of byte `byte` of `extent`.
    pub(super) fn offset_of(&self, extent: u32, byte: usize) -> u64 {
        u64::from(extent) * u64::from(self.extent_bytes) + byte as u64
    }

    /// The extent headers.
    pub(super) fn meta(&self) -> &MetaFile {
        &self.meta
    }

    /// The extent headers, for the bookkeeping that clears freed extents'.
    pub(super) fn meta_handle(&self) -> Arc<MetaFile> {
        Arc::clone(&self.meta)
    }

    /// A copy of `bytes` in a buffer of the swap's own (a write-back image
    /// that must not change while it is checksummed and written).
    pub(super) fn copy_of(&self, bytes: &[u8]) -> Result<AlignedBuf, StoreError> {
        let mut b = self.take_buffer(bytes.len())?;
        b.copy_from_slice(bytes);
        Ok(b)
    }

    /// Reads `len` bytes at `offset` of `extent` (both multiples of
    /// [`BLOCK`]) with O_DIRECT into a buffer of the swap's own.
    pub(super) fn read_range(
        &self,
        extent: u32,
        offset: u32,
        len: u32,
    ) -> Result<AlignedBuf, StoreError> {
        let mut buf = self.range_buffer(offset, len)?;
        let op = Op::Read {
            offset: self.offset_of(extent, offset as usize),
            len,
            buf: buf.as_mut_ptr(),
        };
        match self.run(&[op]) {
            Ok(()) => Ok(buf),
            Err(e) => {
                self.give_buffer(buf);
                Err(e)
            }
        }
    }

    /// [`Swap::read_range`], awaited on this thread's ring (see
    /// [`Swap::serve_reads_here`]) or the shared one.
    pub(super) async fn read_range_async(
        &self,
        extent: u32,
        offset: u32,
        len: u32,
    ) -> Result<AlignedBuf, StoreError> {
        let buf = self.range_buffer(offset, len)?;
        self.reads
            .read(self.offset_of(extent, offset as usize), buf)
            .await
    }

    /// A buffer for a range read of `len` bytes at `offset` of an extent
    /// (both multiples of [`BLOCK`]), the one part [`Swap::read_range`] and
    /// [`Swap::read_range_async`] share.
    fn range_buffer(&self, offset: u32, len: u32) -> Result<AlignedBuf, StoreError> {
        debug_assert!(offset.is_multiple_of(BLOCK as u32) && len.is_multiple_of(BLOCK as u32));
        debug_assert!(offset + len <= self.extent_bytes);
        self.take_buffer(len as usize)
    }

    /// Submits and reaps this thread's range reads on this thread, driven
    /// by its current-thread tokio runtime (see [`Reads::serve_here`]).
    pub(super) fn serve_reads_here(&self) -> Result<(), StoreError> {
        self.reads
            .serve_here()
            .map_err(|source| StoreError::Uring { source })
    }

    /// Whether the calling thread has a swap-read ring of its own.
    #[cfg(test)]
    pub(super) fn reads_served_here(&self) -> bool {
        self.reads.served_here()
    }

    fn take_buffer(&self, len: usize) -> Result<AlignedBuf, StoreError> {
        let pooled = {
            let mut pool = self.buffers.lock();
            pool.iter()
                .position(|b| b.cap >= len)
                .map(|i| pool.swap_remove(i))
        };
        let mut buf = match pooled {
            Some(b) => b,
            None => AlignedBuf::new(len)?,
        };
        buf.len = len;
        Ok(buf)
    }

    /// Takes a range-read buffer back for reuse.
    pub(super) fn give_buffer(&self, buf: AlignedBuf) {
        let mut pool = self.buffers.lock();
        let pooled: usize = pool.iter().map(|b| b.cap).sum();
        if pool.len() < self.pooled && pooled + buf.cap <= POOLED_BYTES {
            pool.push(buf);
        }
    }

    pub(super) fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed) + self.reads.bytes_read()
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
        let len = self.extent_bytes;
        let ops: Vec<Op> = reads
            .iter_mut()
            .map(|(extent, buf)| {
                debug_assert_eq!(buf.len(), len as usize);
                Op::Read {
                    offset: u64::from(*extent) * u64::from(len),
                    len,
                    buf: buf.as_mut_ptr(),
                }
            })
            .collect();
        self.run(&ops)
    }

    /// Writes each `(extent, slot bytes)` pair, many per submission, and
    /// runs `work` while the first submission is in flight (write-back
    /// checksums the bytes it writes meanwhile). `work` is not run when the
    /// submission fails.
    pub(super) fn write_extents_while(
        &self,
        writes: &[(u32, &[u8])],
        work: impl FnOnce(),
    ) -> Result<(), StoreError> {
        let len = self.extent_bytes;
        let ops: Vec<Op> = writes
            .iter()
            .map(|&(extent, buf)| {
                debug_assert_eq!(buf.len(), len as usize);
                Op::Write {
                    offset: u64::from(extent) * u64::from(len),
                    len,
                    buf: buf.as_ptr(),
                }
            })
            .collect();
        self.run_while(&ops, Some(work))
    }

    /// Makes every completed write durable, with the headers written. Once
    /// a sync failed, every later one fails too (see
    /// [`Refusal::SwapSyncFailed`]).
    pub(super) fn sync(&self) -> Result<(), StoreError> {
        if self.sync_failed.load(Ordering::Acquire) {
            return Err(refused(
                "syncing swap file",
                &self.path,
                Refusal::SwapSyncFailed,
            ));
        }
        let synced = self
            .file
            .sync_data()
            .map_err(io_err("syncing swap file", &self.path))
            .and_then(|()| self.meta.sync());
        if synced.is_err() {
            self.sync_failed.store(true, Ordering::Release);
            tracing::error!(event = events::SWAP_SYNC_FAILED, path = %self.path.display(), "a sync of the swap file or its extent table failed: no FLUSH succeeds until arenad restarts");
        }
        synced
    }

    /// Runs transfers through a ring of this call's own, and keeps the ring
    /// for the next call unless it broke.
    fn run(&self, ops: &[Op]) -> Result<(), StoreError> {
        self.run_while(ops, None::<fn()>)
    }

    /// [`Swap::run`], running `work` once the first submission is in flight.
    fn run_while(&self, ops: &[Op], work: Option<impl FnOnce()>) -> Result<(), StoreError> {
        let ring = self.rings.lock().pop();
        let mut ring = match ring {
            Some(r) => r,
            None => IoUring::new(RING_ENTRIES).map_err(|source| StoreError::Uring { source })?,
        };
        let res = self.run_on(&mut ring, ops, work);
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
    fn run_on(
        &self,
        ring: &mut IoUring,
        ops: &[Op],
        mut work: Option<impl FnOnce()>,
    ) -> Result<(), StoreError> {
        if self.broken.load(Ordering::Acquire) {
            return Err(refused("using swap file", &self.path, Refusal::SwapBroken));
        }
        let fd = types::Fd(self.file.as_raw_fd());
        for chunk in ops.chunks(RING_ENTRIES as usize) {
            let mut results: Vec<Option<i32>> = vec![None; chunk.len()];
            let mut done = 0;
            let mut queued = 0;
            for (i, op) in chunk.iter().enumerate() {
                let transfer = match *op {
                    Op::Read { offset, len, .. } => Transfer {
                        offset,
                        len,
                        data: None,
                    },
                    Op::Write { offset, len, buf } => {
                        // SAFETY: as for the entry below: the buffer holds
                        // `len` initialised bytes that stay valid and
                        // unchanged until `run_on` returns.
                        let data = unsafe { std::slice::from_raw_parts(buf, len as usize) };
                        Transfer {
                            offset,
                            len,
                            data: Some(data),
                        }
                    }
                };
                if let Some(res) = self.file.queue(transfer) {
                    results[i] = Some(res);
                    done += 1;
                    continue;
                }
                queued += 1;
                let entry = match *op {
                    Op::Read { offset, len, buf } => {
                        opcode::Read::new(fd, buf, len).offset(offset).build()
                    }
                    Op::Write { offset, len, buf } => {
                        opcode::Write::new(fd, buf, len).offset(offset).build()
                    }
                };
                // SAFETY: the entry's buffer is a slot that the caller holds
                // a guard on, or a range buffer it owns, until `run_on`
                // returns, and `run_on` does
                // not return before every pushed entry has completed (or the
                // swap is marked broken and the ring parked in `wrecks`,
                // never used again). The chunk is no larger than the queue,
                // which is empty here: a ring is only reused after every
                // entry of its last call completed.
                let pushed = unsafe { ring.submission().push(&entry.user_data(i as u64)) };
                if pushed.is_err() {
                    self.broken.store(true, Ordering::Release);
                    return Err(refused(
                        "queueing swap I/O for",
                        &self.path,
                        Refusal::SwapQueueFull,
                    ));
                }
            }
            if let Some(work) = work.take() {
                if queued > 0 {
                    if let Err(e) = ring.submit() {
                        self.broken.store(true, Ordering::Release);
                        return Err(io_err("submitting swap I/O for", &self.path)(e));
                    }
                }
                work();
            }
            while done < chunk.len() {
                match ring.submit_and_wait(chunk.len() - done) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        self.broken.store(true, Ordering::Release);
                        return Err(io_err("submitting swap I/O for", &self.path)(e));
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
                let (what, offset, len) = match *op {
                    Op::Read { offset, len, .. } => ("reading swap extent from", offset, len),
                    Op::Write { offset, len, .. } => ("writing swap extent to", offset, len),
                };
                let res = res.unwrap_or(-libc::EIO);
                if res < 0 {
                    return Err(io_err(what, &self.path)(io::Error::from_raw_os_error(-res)));
                }
                if res as u32 != len {
                    return Err(io_err(what, &self.path)(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "extent {} at byte {offset}: short transfer of {res} of {len} bytes",
                            offset / u64::from(self.extent_bytes)
                        ),
                    )));
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

fn open_file(dir: &StoreDir, path: &Path, direct: bool) -> io::Result<DiskFile> {
    let mut o = OpenOptions::new();
    o.read(true).write(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    dir.open(Role::Swap, path, &o)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers given back are kept for reuse up to the reads that may be
    /// in flight (`swap_reads_in_flight`); the rest are freed.
    #[test]
    fn buffers_kept_for_reuse_are_bounded_by_the_reads_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let extent = 64 << 10;
        let mut probe = AlignedBuf::new(extent).unwrap();
        probe.len = extent;
        let swap =
            Swap::create(&StoreDir::os(dir.path()), extent as u32, 4, 3, &mut probe).unwrap();
        let taken: Vec<AlignedBuf> = (0..8).map(|_| swap.take_buffer(4096).unwrap()).collect();
        for b in taken {
            swap.give_buffer(b);
        }
        assert_eq!(swap.buffers.lock().len(), 3);
        // Reused, not allocated: the pool shrinks as they are taken.
        let again = swap.take_buffer(4096).unwrap();
        assert_eq!(swap.buffers.lock().len(), 2);
        swap.give_buffer(again);
        assert_eq!(swap.buffers.lock().len(), 3);
    }
}
