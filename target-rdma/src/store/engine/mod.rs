//! The bookkeeping behind the store lock: which blob lives in which slot and
//! extent, leases, eviction, write-back and the durable commit.
//!
//! A blob has up to three homes: a slot (its newest bytes when resident), a
//! swap extent (a complete older or equal image), and the extent the durable
//! index names. Write-back never overwrites the durable extent; it goes to a
//! fresh extent or to the blob's own not-yet-durable one. A commit first
//! syncs the swap file, then journals the new mappings, and only then frees
//! the extents they superseded.
//!
//! Fault-ins and evicting or background write-backs run their I/O without
//! the store lock, so that a connection's disk time neither blocks the other
//! connections nor keeps the network idle. Under the lock such a slot is
//! put in transition (pinned, plus `loading` or `writing`), the lock is
//! dropped for the I/O, then retaken to finish the change. While in
//! transition a slot is never a victim, never written back again, and its
//! extent is neither freed nor journaled; users of a loading blob wait on
//! [`Core::settled`]. A flush waits for in-flight write-backs, then does its
//! own under the lock as before, so its ordering is unchanged.
//!
//! Every image read from swap is checked against its extent header before
//! anyone sees it (see [`extent`](super::extent)): a fault-in before the
//! slot is handed out, a range read of a cold blob before its bytes are.
//! A range read holds nothing while its I/O runs (no slot, no extent pin):
//! if its bytes fail the check, the lock is retaken to see whether the blob
//! moved meanwhile (then the read starts over) or the extent really is bad
//! (then the read fails, counted and logged).
//!
//! Locks, always taken in this order and never the other way: the store
//! lock (`Core::state`), then a slot's bytes lock (`Arena::read`/`write`),
//! then the swap file's ring and buffer pools. The child files (`open`,
//! `lease`, `write_back`, `flush`) follow it: none takes the store lock
//! while it holds a slot's bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::arena::Arena;
use super::error::{IntegrityKind, StoreError};
use super::eviction::SlotMeta;
use super::extent::{self, Ident, MetaFile, BLOCK};
use super::format::Version;
use super::hooks::TimingHook;
use super::ids::{BlobKey, HolderId, VolumeId};
use super::index::Index;
use super::stats::StoreStats;
use super::swap::{Extents, Swap};
use crate::proto::Lease;

mod flush;
mod lease;
mod open;
mod range_read;
mod read_ahead;
mod residency;
mod slots;
mod volumes;
mod write_back;

pub use lease::{ForceEndHook, LeaseLimits, DEFAULT_REVOKE_DEADLINE_MS};
use lease::{LeaseKind, Leases};
pub(super) use range_read::Direct;
use read_ahead::ReadAhead;
#[cfg(test)]
pub(super) use read_ahead::READ_AHEAD;
pub(super) use read_ahead::{read_ahead_worker, READ_AHEAD_WORKERS};
use slots::Slots;

/// The store lock held.
pub(super) type Guard<'a> = MutexGuard<'a, State>;

/// Where a blob's bytes are. Invariant: `slot` or `extent` is set.
struct Blob {
    slot: Option<u32>,
    /// Its newest complete swap image.
    extent: Option<Placed>,
    /// The image the durable index names.
    durable: Option<Placed>,
    /// Why its swap image cannot be trusted, found at open (its header is
    /// missing, damaged or names another image): it is never read, and
    /// reads fail until it is rewritten whole, removed or repaired.
    damaged: Option<Box<str>>,
}

/// An image in swap: its extent and the write version its header carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Placed {
    pub(super) extent: u32,
    pub(super) version: Version,
}

struct Volume {
    name: String,
    quota: u64,
    blobs: u64,
    /// Configured (served); a volume found only in the persisted index is
    /// kept, unserved, so its blobs survive.
    served: bool,
}

#[derive(Default)]
struct Counters {
    evictions: u64,
    write_backs: u64,
    fault_ins: u64,
    flushes: u64,
    /// Reads refused by kind ([`IntegrityKind::index`]).
    integrity: [u64; IntegrityKind::COUNT],
}

pub(super) struct State {
    blob_bytes: u32,
    generation: u64,
    /// The last write version handed out this run (its seq).
    seq: u64,
    /// Configured volumes first (their ids are the caller's), then volumes
    /// found only in the persisted index, kept so their blobs survive, then
    /// volumes configured while running ([`State::configure_volume`]).
    volumes: Vec<Volume>,
    /// Each volume's on-disk id ([`extent::volume_id`]).
    vol_ids: Vec<u64>,
    blobs: BTreeMap<BlobKey, Blob>,
    slots: Slots,
    leases: Leases,
    index: Index,
    /// Blobs whose `extent` holds a written-back image the index lacks.
    unjournaled: BTreeSet<BlobKey>,
    /// Removed blobs the durable index still names.
    pending_removes: Vec<BlobKey>,
    /// Their durable extents, free once the removals are journaled.
    pending_free: Vec<u32>,
    counters: Counters,
    extents: Extents,
    /// The extent headers on disk: written by write-backs, cleared when an
    /// extent is freed.
    meta: Arc<MetaFile>,
    /// Block CRCs of every extent's current image, `blocks` per extent.
    crcs: Vec<u32>,
    blocks: usize,
    /// Slots loading or writing without the store lock.
    in_transit: usize,
    /// Of those, the ones writing.
    writes_in_flight: usize,
    /// Flushes waiting for in-flight write-backs; while non-zero no new
    /// write-back starts, so a flush cannot starve.
    flush_waiting: usize,
    /// The cleaner was woken and has not gone back to sleep yet.
    cleaner_kicked: bool,
    /// The store is closing: the cleaner exits.
    stopping: bool,
    read_ahead: ReadAhead,
}

/// How a read is served, decided under the store lock.
pub(super) enum ReadPlan {
    /// The key holds no blob.
    Absent,
    /// From this (pinned) slot.
    Slot(u32),
    /// Straight from swap, without faulting the blob in.
    Swap(Direct),
}

/// A slot handed out for use.
#[derive(Clone, Copy, Debug)]
pub(super) enum Staged {
    /// Holds the blob's bytes.
    Ready(u32),
    /// Attached to the blob but unread and pinned in transition, because the
    /// caller overwrites all of it: reading (or zeroing) bytes about to be
    /// replaced would only cost a disk read. Others wait until the write
    /// ends, as for a fault-in.
    Staged(u32),
}

impl Staged {
    pub(super) fn slot(self) -> u32 {
        match self {
            Staged::Ready(s) | Staged::Staged(s) => s,
        }
    }
}

/// The shared engine: the state under its lock, and what runs outside it.
pub(super) struct Core {
    pub(super) arena: Arena,
    pub(super) swap: Swap,
    pub(super) state: Mutex<State>,
    /// Signalled whenever a slot leaves transition and when a flush is done:
    /// fault-in waiters, evictors short of victims and flushes wait on it.
    settled: Condvar,
    /// Wakes the cleaner.
    kick: Condvar,
    /// Wakes the read-ahead workers when blobs are queued.
    ahead: Condvar,
}

fn names(volumes: &[Volume]) -> Vec<&str> {
    volumes.iter().map(|v| v.name.as_str()).collect()
}

impl State {
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    pub(super) fn take_revocations(&mut self) -> Vec<(HolderId, VolumeId, u64, u64)> {
        self.leases.take_revocations()
    }

    pub(in crate::store) fn set_lease_limits(&mut self, limits: LeaseLimits) {
        self.leases.set_limits(limits);
    }

    pub(in crate::store) fn set_force_end_hook(&mut self, hook: ForceEndHook) {
        self.leases.set_force_end_hook(hook);
    }

    /// See [`Leases::check_limit`].
    fn check_lease_limit(&mut self, holder: HolderId) -> Result<(), StoreError> {
        self.leases.check_limit(self.slots.len(), holder)
    }

    /// See [`Leases::grant`].
    fn new_lease(&mut self, holder: HolderId, key: BlobKey, slot: u32, kind: LeaseKind) -> Lease {
        self.leases
            .grant(&mut self.slots, self.blob_bytes, holder, key, slot, kind)
    }

    /// See [`Leases::end_holder`].
    pub(in crate::store) fn end_holder(&mut self, holder: HolderId) -> usize {
        self.leases.end_holder(&mut self.slots, holder)
    }

    /// See [`Leases::commit`].
    pub(in crate::store) fn commit(
        &mut self,
        vol: VolumeId,
        key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.leases.commit(&mut self.slots, vol, key, token, holder)
    }

    /// See [`Leases::release`].
    pub(in crate::store) fn release(
        &mut self,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.leases.release(&mut self.slots, token, holder)
    }

    /// See [`Leases::pin`].
    pub(in crate::store) fn pin_lease(
        &mut self,
        token: u64,
        holder: HolderId,
    ) -> Result<u32, StoreError> {
        self.leases.pin(&mut self.slots, token, holder)
    }

    /// See [`Leases::drop_holder`].
    pub(in crate::store) fn drop_holder(&mut self, holder: HolderId) {
        self.leases.drop_holder(&mut self.slots, holder);
    }

    /// See [`Leases::pinned_full`].
    pub(super) fn pinned_full(&mut self, vol: VolumeId) -> Result<(), StoreError> {
        let volumes = &self.volumes;
        self.leases.pinned_full(
            &mut self.slots,
            || volumes.iter().filter(|v| v.served).count(),
            vol,
        )
    }

    fn no_space(&self) -> StoreError {
        StoreError::NoSpace {
            slots: self.slots.len(),
            extents: self.extents.total(),
        }
    }

    pub(super) fn stop(&mut self) {
        self.stopping = true;
    }

    /// Ends a fault-in's transition; whether the slot still belonged to
    /// `key` (it no longer does when the blob was removed meanwhile). When
    /// the load failed (`ok` false) the slot is given up: free again, the
    /// blob left in swap.
    fn finish_load(&mut self, slot: u32, key: BlobKey, ok: bool) -> bool {
        self.in_transit -= 1;
        let m = &mut self.slots.meta[slot as usize];
        m.loading = false;
        m.pins -= 1;
        let ours = m.owner == Some(key);
        if ours && !ok {
            m.owner = None;
            if let Some(b) = self.blobs.get_mut(&key) {
                b.slot = None;
            }
        }
        self.slots.free_if_orphaned(slot);
        ours
    }

    /// Image `version` of blob `key`, as its extent header states it.
    fn ident(&self, key: BlobKey, version: Version) -> Ident {
        Ident {
            volume: self.vol_ids[key.0 as usize],
            key: key.1,
            version,
        }
    }

    /// The CRCs of blocks `first..end` of `extent`'s image.
    fn block_crcs(&self, extent: u32, first: usize, end: usize) -> Vec<u32> {
        let at = extent as usize * self.blocks;
        self.crcs[at + first..at + end].to_vec()
    }

    /// Counts, logs and describes a read refused because its image does not
    /// verify; `offset` is the byte offset of the bad part in `file`.
    fn integrity_error(
        &mut self,
        kind: IntegrityKind,
        key: BlobKey,
        file: &Path,
        extent: u32,
        offset: u64,
        detail: String,
    ) -> StoreError {
        self.counters.integrity[kind.index()] += 1;
        let volume = self.volumes[key.0 as usize].name.clone();
        tracing::warn!(event = "swap.integrity_error", kind = kind.name(), file = %file.display(), extent, offset, volume = %volume, key = key.1, detail = %detail, "refusing to serve bytes that do not verify");
        StoreError::Integrity {
            kind,
            file: file.to_path_buf(),
            extent,
            offset,
            volume,
            key: key.1,
            detail,
        }
    }

    /// The error for a blob found damaged at open.
    fn damaged_error(&mut self, key: BlobKey) -> Option<StoreError> {
        let b = self.blobs.get(&key)?;
        let why = b.damaged.as_deref()?.to_string();
        let extent = b.extent.map_or(0, |p| p.extent);
        let path = self.meta.path().to_path_buf();
        let offset = self.meta.offset(extent);
        Some(self.integrity_error(IntegrityKind::Header, key, &path, extent, offset, why))
    }

    /// Gives an extent back to the free list, its header cleared first (so
    /// that repair never resurrects what it held, and before any write-back
    /// can take it).
    fn release_extent(&mut self, extent: u32) {
        if let Err(e) = self.meta.clear(extent) {
            tracing::warn!(event = "extent_header_clear_failed", extent, error = %e, "could not clear a freed extent's header; arenad --repair might bring back its old image");
        }
        self.extents.free(extent);
    }

    /// Drops a pin; `wrote` marks the blob dirty (see [`Slots::unpin`]).
    pub(super) fn unpin(&mut self, slot: u32, wrote: bool) {
        self.slots.unpin(slot, wrote);
    }

    pub(super) fn remove(
        &mut self,
        vol: VolumeId,
        start: u64,
        end: u64,
    ) -> Result<u64, StoreError> {
        self.check_vol(vol)?;
        if start >= end {
            return Ok(0);
        }
        let keys: Vec<BlobKey> = self
            .blobs
            .range((vol, start)..(vol, end))
            .map(|(&k, _)| k)
            .collect();
        for &key in &keys {
            self.drop_blob(key);
        }
        Ok(keys.len() as u64)
    }

    fn drop_blob(&mut self, key: BlobKey) {
        let Some(blob) = self.blobs.remove(&key) else {
            return;
        };
        self.volumes[key.0 as usize].blobs -= 1;
        // An extent an in-flight write-back targets is freed when that ends.
        let mut writing = None;
        if let Some(s) = blob.slot {
            self.slots.set_dirty(s, false);
            let m = &mut self.slots.meta[s as usize];
            m.owner = None;
            m.referenced = false;
            writing = m.writing;
            self.slots.free_if_orphaned(s);
        }
        match blob.extent {
            Some(e) if blob.extent != blob.durable && writing != Some(e.extent) => {
                self.release_extent(e.extent)
            }
            _ => {}
        }
        if let Some(d) = blob.durable {
            self.pending_free.push(d.extent);
            self.pending_removes.push(key);
        }
        self.unjournaled.remove(&key);
    }

    /// The next write version of this run.
    fn next_version(&mut self) -> Version {
        self.seq += 1;
        Version {
            generation: self.generation,
            seq: self.seq,
        }
    }

    /// Gives `slot` to `key` pinned and loading: its bytes are filled
    /// without the store lock (a fault-in, or a whole-blob write), and users
    /// wait until that ends.
    fn begin_loading(&mut self, slot: u32, key: BlobKey) {
        self.slots.meta[slot as usize] = SlotMeta {
            owner: Some(key),
            pins: 1,
            referenced: true,
            loading: true,
            ..SlotMeta::default()
        };
        self.in_transit += 1;
    }

    pub(super) fn set_timing_hook(&mut self, hook: TimingHook) {
        self.index.timing = Some(hook);
    }

    pub(super) fn stats(&self, swap: &Swap) -> StoreStats {
        let mut s = StoreStats {
            slots_total: self.slots.len() as u64,
            leases_held: self.leases.len() as u64,
            revocations: self.leases.revoked(),
            leases_force_ended: self.leases.forced(),
            evictions: self.counters.evictions,
            write_backs: self.counters.write_backs,
            fault_ins: self.counters.fault_ins,
            swap_bytes_read: swap.bytes_read(),
            swap_bytes_written: swap.bytes_written(),
            swap_extents_used: u64::from(self.extents.total()) - self.extents.free_count() as u64,
            swap_extents_total: u64::from(self.extents.total()),
            flushes: self.counters.flushes,
            journal_records: self.index.journal_records,
            checkpoints: self.index.checkpoints,
            direct_io: swap.direct(),
            integrity_errors: self.counters.integrity,
            ..StoreStats::default()
        };
        self.slots.tally(&mut s);
        s
    }
}

impl Core {
    /// Reads `key`'s image at `placed` into `slot` (put in transition by
    /// the caller) with the store lock dropped, and checks it against the
    /// extent's block checksums: `Some(block)` is the first bad block.
    fn load_unlocked(
        &self,
        g: &mut Guard<'_>,
        slot: u32,
        key: BlobKey,
        placed: &Placed,
    ) -> Result<Option<usize>, StoreError> {
        let ident = g.ident(key, placed.version);
        let crcs = g.block_crcs(placed.extent, 0, g.blocks);
        MutexGuard::unlocked(g, || {
            let mut bytes = self.arena.write(slot);
            self.swap
                .read_extent(placed.extent, &mut bytes)
                .map(|()| extent::first_bad_block(&ident, 0, &bytes, &crcs))
        })
    }

    pub(super) fn new(arena: Arena, swap: Swap, state: State) -> Core {
        Core {
            arena,
            swap,
            state: Mutex::new(state),
            settled: Condvar::new(),
            kick: Condvar::new(),
            ahead: Condvar::new(),
        }
    }

    /// Wakes the cleaner if clean slots ran short; called after every
    /// locked operation so the check lives in one place.
    pub(super) fn kick_cleaner_if_due(&self, g: &mut Guard<'_>) {
        if g.cleaner_due() {
            self.kick.notify_one();
        }
        if g.read_ahead.pending() {
            self.ahead.notify_all();
        }
    }

    /// Asks the cleaner and the read-ahead workers to exit.
    pub(super) fn stop_cleaner(&self) {
        self.state.lock().stop();
        self.kick.notify_all();
        self.ahead.notify_all();
    }

    /// The blob's slot, faulting it in from swap if needed. Returns with the
    /// lock held and the slot usable; the caller pins it before unlocking.
    /// With `stage` the caller is about to overwrite the whole blob, so a
    /// slot that is not resident is attached unread (see [`Staged`]).
    fn resident(
        &self,
        g: &mut Guard<'_>,
        key: BlobKey,
        stage: bool,
    ) -> Result<Option<Staged>, StoreError> {
        loop {
            let st = &mut **g;
            let Some(blob) = st.blobs.get(&key) else {
                return Ok(None);
            };
            if let Some(s) = blob.slot {
                let m = &mut st.slots.meta[s as usize];
                if m.loading {
                    self.settled.wait(g);
                    continue;
                }
                m.referenced = true;
                if std::mem::take(&mut m.read_ahead) {
                    st.read_ahead.note(key);
                }
                return Ok(Some(Staged::Ready(s)));
            }
            if !stage {
                if let Some(e) = st.damaged_error(key) {
                    return Err(e);
                }
            }
            // May drop the lock, after which the blob may have changed.
            let slot = self.take_slot(g, key.0)?;
            let st = &mut **g;
            let placed = match st.blobs.get_mut(&key) {
                Some(b) if b.slot.is_none() && (stage || b.damaged.is_none()) => {
                    b.slot = Some(slot);
                    // A whole-blob write replaces a damaged image.
                    b.damaged = None;
                    b.extent.expect("a blob without a slot has a swap extent")
                }
                _ => {
                    st.slots.free.push(slot);
                    continue;
                }
            };
            st.begin_loading(slot, key);
            if stage {
                return Ok(Some(Staged::Staged(slot)));
            }
            let read = self.load_unlocked(g, slot, key, &placed);
            let st = &mut **g;
            let ours = st.finish_load(slot, key, matches!(read, Ok(None)));
            self.settled.notify_all();
            match read? {
                None if ours => {
                    st.counters.fault_ins += 1;
                    st.read_ahead.note(key);
                    return Ok(Some(Staged::Ready(slot)));
                }
                Some(bad) if ours => {
                    let offset = self.swap.offset_of(placed.extent, bad * BLOCK);
                    return Err(st.integrity_error(
                        IntegrityKind::Checksum,
                        key,
                        self.swap.path(),
                        placed.extent,
                        offset,
                        format!("block {bad} fails its checksum"),
                    ));
                }
                // Removed while loading: look again.
                _ => {}
            }
        }
    }

    /// How to serve a read of `len` bytes at `offset` of blob `key`: from
    /// its slot (pinned; faulted in when the read covers the whole blob), or,
    /// for part of a blob that is not resident, straight from swap.
    pub(super) fn plan_read(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
    ) -> Result<ReadPlan, StoreError> {
        if let Some(d) = Direct::plan(g, vol, key, offset, len)? {
            return Ok(ReadPlan::Swap(d));
        }
        Ok(match self.pin(g, vol, key)? {
            Some(s) => ReadPlan::Slot(s),
            None => ReadPlan::Absent,
        })
    }

    /// The blob's slot; a new blob gets a zeroed one, within the quota, or
    /// with `stage` an unzeroed staged one.
    fn resident_or_create(
        &self,
        g: &mut Guard<'_>,
        key: BlobKey,
        stage: bool,
    ) -> Result<Staged, StoreError> {
        loop {
            if let Some(s) = self.resident(g, key, stage)? {
                return Ok(s);
            }
            let st = &mut **g;
            let v = &st.volumes[key.0 as usize];
            if v.blobs >= v.quota {
                return Err(StoreError::QuotaExceeded {
                    volume: v.name.clone(),
                    quota: v.quota,
                });
            }
            // Swap is the capacity, the arena a cache over it. One extent
            // stays spare so that a dirty slot can always be written back (a
            // commit frees the extent it supersedes), which keeps fault-in
            // possible.
            if st.blobs.len() as u64 + 1 >= u64::from(st.extents.total()) {
                return Err(st.no_space());
            }
            let slot = self.take_slot(g, key.0)?;
            let st = &mut **g;
            if st.blobs.contains_key(&key) {
                // Created by another thread while we evicted.
                st.slots.free.push(slot);
                continue;
            }
            if stage {
                st.begin_loading(slot, key);
            } else {
                self.arena.write(slot).fill(0);
                st.slots.meta[slot as usize] = SlotMeta {
                    owner: Some(key),
                    referenced: true,
                    ..SlotMeta::default()
                };
                st.slots.set_dirty(slot, true);
            }
            st.blobs.insert(
                key,
                Blob {
                    slot: Some(slot),
                    extent: None,
                    durable: None,
                    damaged: None,
                },
            );
            st.volumes[key.0 as usize].blobs += 1;
            return Ok(if stage {
                Staged::Staged(slot)
            } else {
                Staged::Ready(slot)
            });
        }
    }

    pub(super) fn pin(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
    ) -> Result<Option<u32>, StoreError> {
        g.check_vol(vol)?;
        let slot = self.resident(g, (vol, key), false)?.map(Staged::slot);
        if let Some(s) = slot {
            g.slots.meta[s as usize].pins += 1;
        }
        Ok(slot)
    }

    /// Pins the blob's slot for a write; `whole` (the write covers the blob)
    /// may give a staged slot, which [`Core::unpin_written`] completes.
    pub(super) fn pin_or_create(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        whole: bool,
    ) -> Result<Staged, StoreError> {
        g.check_vol(vol)?;
        let s = self.resident_or_create(g, (vol, key), whole)?;
        if let Staged::Ready(s) = s {
            g.slots.meta[s as usize].pins += 1;
        }
        Ok(s)
    }

    /// Ends a write's pin; a staged slot leaves transition, now holding the
    /// blob's bytes, and its waiters go on.
    pub(super) fn unpin_written(&self, g: &mut Guard<'_>, slot: Staged) {
        if let Staged::Staged(s) = slot {
            g.slots.meta[s as usize].loading = false;
            g.in_transit -= 1;
            self.settled.notify_all();
        }
        g.slots.unpin(slot.slot(), true);
    }

    pub(super) fn stats(&self, g: &Guard<'_>) -> StoreStats {
        g.stats(&self.swap)
    }
}

#[cfg(test)]
impl Core {
    /// The last read noted toward read-ahead.
    pub(in crate::store) fn last_read(&self) -> Option<crate::store::ids::BlobKey> {
        self.state.lock().read_ahead.last()
    }

    /// The slot blob `key` is in, if any.
    pub(super) fn slot_of(&self, key: BlobKey) -> Option<u32> {
        self.state.lock().blobs.get(&key).and_then(|b| b.slot)
    }

    /// The extent the durable index names for `key` (tests damage it).
    pub(super) fn durable_extent(&self, key: BlobKey) -> Option<u32> {
        self.state
            .lock()
            .blobs
            .get(&key)
            .and_then(|b| b.durable)
            .map(|p| p.extent)
    }
}
