//! [`Store`], the handle callers hold: every public operation of the
//! engine, each run under the store lock through [`Store::locked`] (or
//! [`Store::fairly`] when it may need a slot), with slot bytes copied
//! outside it.

use std::fs::{self, File};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::RwLock;
use ublk_metrics::events;

use super::arena::Arena;
use super::check::{self, StoreCheck};
use super::config::{invalid, validate, StoreConfig, VolumeSpec};
use super::dir::{check_new, lock_dir};
use super::disk::{Disk, OsDisk, StoreDir};
use super::engine::{self, Core, Direct, ForceEndHook, Guard, LeaseLimits, ReadPlan};
use super::error::StoreError;
use super::hooks::{RevokeHook, TimingHook};
use super::ids::{HolderId, VolumeId};
use super::index;
use super::repair::{self, RepairReport};
use super::residency::{Immediate, Residency};
#[cfg(test)]
use super::stats::BlobCounts;
use super::stats::{StoreStats, VolumeUsage};
use crate::proto::{Lease, MAX_VOLUME_NAME};

/// The arena peer's storage engine. `Send + Sync`; call it from any thread.
pub struct Store {
    pub(super) core: Arc<Core>,
    hook: RwLock<Option<RevokeHook>>,
    blob_bytes: u32,
    generation: u64,
    /// The background write-back thread; joined on drop.
    /// The cleaner and the read-ahead workers.
    workers: Vec<JoinHandle<()>>,
    /// Holds the advisory lock on the directory while the store is open.
    _lock: File,
}

impl Store {
    /// Opens or creates the store in `cfg.dir`: loads the checkpoint, replays
    /// the journal (dropping a torn last batch, refusing any other damage),
    /// checks the header of every extent the index names, then writes a
    /// fresh checkpoint carrying the bumped generation, so each run starts
    /// with an empty journal whose volume numbers are this run's. A new
    /// store reserves the space of all its files.
    pub fn open(cfg: StoreConfig, volumes: &[VolumeSpec]) -> Result<Store, StoreError> {
        Store::open_on(Arc::new(OsDisk), cfg, volumes)
    }

    /// [`Store::open`] with the files on `disk`.
    pub(crate) fn open_on(
        disk: Arc<dyn Disk>,
        cfg: StoreConfig,
        volumes: &[VolumeSpec],
    ) -> Result<Store, StoreError> {
        let (slots, extents) = validate(&cfg, volumes)?;
        let dir = StoreDir::new(&cfg.dir, disk);
        fs::create_dir_all(&cfg.dir).map_err(|source| StoreError::Io {
            what: "creating store directory",
            path: cfg.dir.clone(),
            source,
        })?;
        let lock = lock_dir(&cfg.dir)?;
        let found = index::load(&dir, cfg.blob_bytes, extents)?;
        if found.is_none() {
            check_new(&dir)?;
        }
        let arena = Arena::new(slots as usize, cfg.blob_bytes as usize).map_err(|source| {
            StoreError::ArenaMap {
                bytes: cfg.arena_bytes,
                source,
            }
        })?;
        let (state, swap) = engine::open(&dir, &cfg, &arena, slots, extents, volumes, found)?;
        let generation = state.generation();
        let core = Arc::new(Core::new(arena, swap, state));
        let cleaner = {
            let core = Arc::clone(&core);
            std::thread::Builder::new()
                .name("arenad-cleaner".into())
                .spawn(move || engine::clean(&core))
                .map_err(|source| StoreError::Io {
                    what: "starting the write-back thread for",
                    path: cfg.dir.clone(),
                    source,
                })?
        };
        let mut workers = vec![cleaner];
        let reaper = {
            let core = Arc::clone(&core);
            std::thread::Builder::new()
                .name("arenad-reaper".into())
                .spawn(move || engine::reap_leases(&core))
        };
        match reaper {
            Ok(t) => workers.push(t),
            Err(source) => {
                core.stop_background();
                for t in workers {
                    let _ = t.join();
                }
                return Err(StoreError::Io {
                    what: "starting the lease reaper thread for",
                    path: cfg.dir.clone(),
                    source,
                });
            }
        }
        for i in 0..engine::READ_AHEAD_WORKERS {
            let worker = Arc::clone(&core);
            let spawned = std::thread::Builder::new()
                .name(format!("arenad-ahead-{i}"))
                .spawn(move || engine::read_ahead_worker(&worker));
            match spawned {
                Ok(t) => workers.push(t),
                Err(source) => {
                    // Stop what already runs before reporting.
                    core.stop_background();
                    for t in workers {
                        let _ = t.join();
                    }
                    return Err(StoreError::Io {
                        what: "starting a read-ahead thread for",
                        path: cfg.dir.clone(),
                        source,
                    });
                }
            }
        }
        Ok(Store {
            blob_bytes: cfg.blob_bytes,
            generation,
            core,
            hook: RwLock::new(None),
            workers,
            _lock: lock,
        })
    }

    /// Rebuilds the index of the store in `cfg.dir` from its extent headers
    /// (`arenad --repair`): for an index that is damaged or lost, which
    /// [`Store::open`] refuses. The store must not be open; what could not
    /// be recovered is in the report.
    pub fn repair(cfg: &StoreConfig, volumes: &[VolumeSpec]) -> Result<RepairReport, StoreError> {
        repair::repair(cfg, volumes)
    }

    /// Reads and checks the store in `cfg.dir` as [`Store::open`] would,
    /// writing nothing (`arenad --check`): the error a start would refuse
    /// it with, or what it holds and what a start would warn about.
    pub fn check(cfg: &StoreConfig, volumes: &[VolumeSpec]) -> Result<StoreCheck, StoreError> {
        check::check(cfg, volumes)
    }

    /// Bumped on every open, so clients can tell that leases did not survive.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Blob size in bytes.
    pub fn blob_bytes(&self) -> u32 {
        self.blob_bytes
    }

    /// Installs the callback that asks a holder to give a lease back. It runs
    /// without the store lock held, so it may call back into the store (but
    /// not replace the hook from inside it).
    pub fn set_revoke_hook(&self, hook: RevokeHook) {
        *self.hook.write() = Some(hook);
    }

    /// Installs the callback told how long journal appends and checkpoints
    /// take (arenad's journal and checkpoint latency histograms).
    pub fn set_timing_hook(&self, hook: TimingHook) {
        self.locked(|_, g| g.set_timing_hook(hook));
    }

    /// Runs `f` under the store lock, then delivers any revocations it queued
    /// after the lock is dropped.
    fn locked<R>(&self, f: impl FnOnce(&Core, &mut Guard<'_>) -> R) -> R {
        let (r, revoked) = {
            let mut g = self.core.state.lock();
            let r = f(&self.core, &mut g);
            self.core.wake_background(&mut g);
            (r, g.take_revocations())
        };
        if !revoked.is_empty() {
            if let Some(hook) = self.hook.read().as_ref() {
                for (holder, vol, key, token) in revoked {
                    hook(holder, vol, key, token);
                }
            }
        }
        r
    }

    fn check_range(&self, offset: u32, len: usize) -> Result<(), StoreError> {
        if (offset as usize).saturating_add(len) > self.blob_bytes as usize {
            return Err(StoreError::OutOfRange {
                offset,
                len,
                blob_bytes: self.blob_bytes,
            });
        }
        Ok(())
    }

    /// Writes `data` at `offset` inside blob `key`; a new key starts as zeros.
    pub fn write(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.check_range(offset, data.len())?;
        let whole = data.len() == self.blob_bytes as usize;
        let slot = self.fairly(|c, g| c.pin_or_create(g, vol, key, whole))?;
        {
            let mut bytes = self.core.arena.write(slot.slot());
            let o = offset as usize;
            bytes[o..o + data.len()].copy_from_slice(data);
        }
        self.locked(|c, g| c.unpin_written(g, slot));
        Ok(())
    }

    /// Leases blob `key`'s own slot for writing in place; the blob is created
    /// (zeroed) if absent. The slot counts as dirty from now on, because the
    /// holder may change it at any moment.
    pub fn alloc(&self, vol: VolumeId, key: u64, holder: HolderId) -> Result<Lease, StoreError> {
        self.fairly(|c, g| c.alloc(g, vol, key, holder))
    }

    /// Leases blob `key`'s slot for reading; `None` when the key holds no blob.
    pub fn get(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Option<Lease>, StoreError> {
        self.fairly(|c, g| c.get(g, vol, key, holder))
    }

    /// Ends an ALLOC lease, keeping what its holder wrote as the blob content.
    pub fn commit(
        &self,
        vol: VolumeId,
        key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.locked(|c, g| {
            let r = g.commit(vol, key, token, holder);
            c.lease_ended();
            r
        })
    }

    /// Ends a lease. An uncommitted ALLOC slot stays dirty: its bytes may
    /// have changed in place.
    pub fn release(&self, token: u64, holder: HolderId) -> Result<(), StoreError> {
        self.locked(|c, g| {
            let r = g.release(token, holder);
            c.lease_ended();
            r
        })
    }

    /// Hands the leased slot's bytes to `f`, the in-process stand-in for an
    /// RDMA READ/WRITE into the slot. `f` must not call back into the store
    /// (a FLUSH waits for the slot while holding the store lock). Changes
    /// through a GET lease are not marked dirty: GET slots are read-only by
    /// contract, as their RDMA registration would be.
    pub fn with_lease<R>(
        &self,
        token: u64,
        holder: HolderId,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, StoreError> {
        let slot = self.locked(|_, g| g.pin_lease(token, holder))?;
        let r = f(&mut self.core.arena.write(slot));
        self.locked(|_, g| g.unpin(slot, false));
        Ok(r)
    }

    /// Serves `spec` from now on and returns its id (see the engine's
    /// `configure_volume`): arenad's SIGHUP adds volumes and changes quotas
    /// with it. A name already known keeps its id and blobs.
    pub fn configure_volume(&self, spec: &VolumeSpec) -> Result<VolumeId, StoreError> {
        if spec.name.is_empty() || spec.name.len() > MAX_VOLUME_NAME {
            return Err(invalid(
                "volumes.name",
                format!("{:?} must be 1 to {MAX_VOLUME_NAME} bytes long", spec.name),
            ));
        }
        self.locked(|_, g| g.configure_volume(&spec.name, spec.quota_blobs))
    }

    /// Where blob `key` is now (it may change as soon as the lock is
    /// dropped, which is why the `_now` calls decide under their own).
    #[cfg(test)]
    pub fn residency(&self, vol: VolumeId, key: u64) -> Residency {
        self.locked(|_, g| g.residency((vol, key)))
    }

    /// Drops keys `start..end` of `vol`; returns how many blobs existed.
    pub fn remove(&self, vol: VolumeId, start: u64, end: u64) -> Result<u64, StoreError> {
        self.locked(|_, g| g.remove(vol, start, end))
    }

    /// Makes every write and commit acknowledged before the call durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.locked(engine::flush)
    }

    /// Ends every lease of a connection that stays open, without it (see
    /// [`ForceEndHook`]: each is reported before its slot is unpinned);
    /// returns how many were live.
    pub fn end_leases_of(&self, holder: HolderId) -> usize {
        self.locked(|c, g| {
            let n = g.end_holder(holder);
            if n > 0 {
                c.lease_ended();
            }
            n
        })
    }

    /// Releases every lease of a dead connection.
    pub fn drop_holder(&self, holder: HolderId) {
        self.locked(|c, g| {
            g.drop_holder(holder);
            c.lease_ended();
        })
    }

    /// The arena mapping as `(base, len)`, for registering it with an RDMA
    /// device so that lease holders read and write slots in place: slot `s`
    /// starts at `base + s * blob_bytes`, which is what lease offsets say.
    /// Called once at startup; it briefly takes slot 0's lock.
    pub fn arena_region(&self) -> (*mut u8, usize) {
        let slots = self.stats().slots_total as usize;
        let base = self.core.arena.write(0).as_mut_ptr();
        (base, slots * self.blob_bytes as usize)
    }

    /// Counters and gauges for metrics.
    pub fn stats(&self) -> StoreStats {
        self.locked(|c, g| c.stats(g))
    }

    /// Every volume's blobs, residency and leases, by volume id.
    pub fn volume_usage(&self) -> Vec<VolumeUsage> {
        self.locked(|_, g| g.volume_usage())
    }

    /// Each volume's (blobs, resident, on swap) as kept and as counted
    /// from the blobs, taken under one hold of the lock.
    #[cfg(test)]
    pub(in crate::store) fn usage_and_recount(&self) -> (Vec<BlobCounts>, Vec<BlobCounts>) {
        self.locked(|_, g| {
            let kept: Vec<BlobCounts> = g
                .volume_usage()
                .iter()
                .map(|u| (u.blobs, u.resident, u.on_swap))
                .collect();
            (kept, g.recounted_usage())
        })
    }

    /// The leases `holder` holds.
    pub fn leases_held_by(&self, holder: HolderId) -> usize {
        self.locked(|_, g| g.leases_held_by(holder))
    }
}

// Fair shares of the arena: see the engine's `lease` module.
impl Store {
    /// [`Self::locked`] for an operation that may need a slot: while
    /// leases held past their volume's share are being reclaimed for it,
    /// waits (without the lock, after their REVOKEs went out) and retries.
    pub(in crate::store) fn fairly<R>(
        &self,
        mut f: impl FnMut(&Core, &mut Guard<'_>) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        loop {
            match self.locked(&mut f) {
                Err(StoreError::Reclaiming { until, ends }) => {
                    self.core.await_lease_end(until, ends)
                }
                r => return r,
            }
        }
    }

    /// Sets how leases are shared between tenants (arenad's config).
    pub fn set_lease_limits(&self, limits: LeaseLimits) {
        self.locked(|_, g| g.set_lease_limits(limits));
    }

    /// Installs the callback told of each lease ended by force (see
    /// [`ForceEndHook`]).
    pub fn set_force_end_hook(&self, hook: ForceEndHook) {
        self.locked(|_, g| g.set_force_end_hook(hook));
    }
}

// Reads through the store: from a blob's slot when resident, else just the
// blocks the range covers, straight from swap and verified (blocking, or
// awaited on the swap's shared ring), or the whole blob faulted in.
impl Store {
    /// Gives the calling thread a swap-read ring of its own, driven by a
    /// task spawned on the thread's current-thread tokio runtime (call it
    /// from within that runtime): [`Store::read_cold_with`] awaited on this
    /// thread submits the reads pushed in one turn of the runtime together
    /// and reaps their completions here, waking no other thread. Without
    /// it a thread's reads use the swap's shared ring and its completion
    /// thread.
    pub fn serve_swap_reads_here(&self) -> Result<(), StoreError> {
        self.core.swap.serve_reads_here()
    }

    /// Reads from blob `key` at `offset`; `Ok(false)` (and zeros) when the
    /// key holds no blob.
    pub fn read(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Result<bool, StoreError> {
        self.read_with(vol, key, offset, out.len(), |bytes| match bytes {
            Some(b) => {
                out.copy_from_slice(b);
                true
            }
            None => {
                out.fill(0);
                false
            }
        })
    }

    /// Hands `len` bytes at `offset` of blob `key` to `f` (`None` when the
    /// key holds no blob), so the server can send them without staging a
    /// copy: straight from its slot when resident, else from a buffer that
    /// read just the aligned blocks covering the range from swap (a 4 KiB
    /// read of a cold blob reads 4 KiB, and does not fault the blob in; a
    /// read of the whole blob does). Bytes from swap are verified first.
    /// A slot stays pinned and read-locked while `f` runs: `f` must not
    /// call back into the store. Concurrent callers do not wait for each
    /// other's disk reads.
    pub fn read_with<R>(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
        f: impl FnOnce(Option<&[u8]>) -> R,
    ) -> Result<R, StoreError> {
        self.check_range(offset, len)?;
        loop {
            match self.fairly(|c, g| ReadPlan::plan(c, g, vol, key, offset, len))? {
                ReadPlan::Absent => return Ok(f(None)),
                ReadPlan::Slot(slot) => return Ok(self.read_pinned(slot, offset, len, f)),
                ReadPlan::Swap(d) => {
                    let Some(buf) = d.read(&self.core)? else {
                        continue;
                    };
                    return Ok(d.serve(&self.core, buf, offset, len, |b| f(Some(b))));
                }
            }
        }
    }

    /// Hands `len` bytes at `offset` of pinned `slot` to `f`, then unpins it.
    pub(super) fn read_pinned<R>(
        &self,
        slot: u32,
        offset: u32,
        len: usize,
        f: impl FnOnce(Option<&[u8]>) -> R,
    ) -> R {
        let r = {
            let bytes = self.core.arena.read(slot);
            let o = offset as usize;
            f(Some(&bytes[o..o + len]))
        };
        self.locked(|_, g| g.unpin(slot, false));
        r
    }

    /// [`Store::read_with`] for part of a cold blob, its disk read awaited
    /// on one of the swap's rings (many in flight, no thread held per read)
    /// and verified the same way. `Ok(None)` when the read is not one
    /// (the blob is absent or resident, or the read covers all of it): the
    /// caller reads it with [`Store::read_with`]. Never blocks the caller's
    /// thread on the disk or on another request.
    pub async fn read_cold_with<R>(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, StoreError> {
        self.check_range(offset, len)?;
        loop {
            let Some(d) = self.locked(|_, g| Direct::plan(g, vol, key, offset, len))? else {
                return Ok(None);
            };
            let Some(buf) = d.read_async(&self.core).await? else {
                continue;
            };
            return Ok(Some(d.serve(&self.core, buf, offset, len, f)));
        }
    }
}

// Whether a blob is in its slot now, decided where its slot is pinned:
// arenad makes a READ, GET, WRITE or ALLOC on the connection's task
// through the `_now` calls here, which do nothing rather than wait when
// the blob would need the disk (a fault-in from swap, or a write-back's
// disk write, which holds its slot locked for reading), and the request
// then goes to the blocking pool: the reactor never waits for the disk. A
// check made before the call could change before it.
impl Store {
    /// [`Store::write`] of a resident blob, for a caller that must not wait
    /// for the disk (arenad's reactor). Residency is checked here, under
    /// the lock that pins the slot, and then on the slot itself: the
    /// cleaner may begin writing a pinned slot back.
    pub fn write_now(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> Result<Immediate<()>, StoreError> {
        self.check_range(offset, data.len())?;
        let pinned = self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Resident => c.pin_or_create(g, vol, key, false).map(|s| Some(s.slot())),
            _ => Ok(None),
        })?;
        let Some(slot) = pinned else {
            return Ok(Immediate::WouldWait);
        };
        // The cleaner writes pinned slots back too, holding their bytes
        // for reading across the disk write.
        let wrote = match self.core.arena.try_write(slot) {
            Some(mut bytes) => {
                let o = offset as usize;
                bytes[o..o + data.len()].copy_from_slice(data);
                true
            }
            None => false,
        };
        self.locked(|_, g| g.unpin(slot, wrote));
        Ok(match wrote {
            true => Immediate::Done(()),
            false => Immediate::WouldWait,
        })
    }

    /// [`Store::read_with`] of a blob in its slot (a write-back shares its
    /// bytes) or of no blob, for a caller that must not wait for the disk:
    /// a blob evicted since the caller's check is not faulted in here.
    pub fn read_now<R>(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
        f: impl FnOnce(Option<&[u8]>) -> R,
    ) -> Result<Immediate<R>, StoreError> {
        self.check_range(offset, len)?;
        let pinned = self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Cold => Ok(None),
            _ => c.pin(g, vol, key).map(Some),
        })?;
        Ok(match pinned {
            None => Immediate::WouldWait,
            Some(None) => Immediate::Done(f(None)),
            Some(Some(slot)) => Immediate::Done(self.read_pinned(slot, offset, len, f)),
        })
    }

    /// [`Store::get`] for a caller that must not wait for the disk.
    pub fn get_now(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Immediate<Option<Lease>>, StoreError> {
        self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Cold => Ok(Immediate::WouldWait),
            _ => c.get(g, vol, key, holder).map(Immediate::Done),
        })
    }

    /// [`Store::alloc`] of a resident blob whose slot no write-back is
    /// writing, for a caller that must not wait for the disk.
    pub fn alloc_now(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Immediate<Lease>, StoreError> {
        self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Resident => c.alloc(g, vol, key, holder).map(Immediate::Done),
            _ => Ok(Immediate::WouldWait),
        })
    }
}

impl Drop for Store {
    /// Stops the cleaner before the arena and swap go away; its in-flight
    /// write-back (if any) completes first.
    fn drop(&mut self) {
        self.core.stop_background();
        for t in self.workers.drain(..) {
            if t.join().is_err() {
                tracing::error!(
                    event = events::CLEANER_PANICKED,
                    "a store background thread (write-back, read-ahead or lease reaper) panicked"
                );
            }
        }
    }
}
