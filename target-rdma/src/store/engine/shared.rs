//! [`Core`], the engine every store thread shares: the [`State`] under
//! the store lock, the arena and the swap used outside it, and the
//! condition variables that wake waiters; and the path that hands slots
//! out: a blob's slot found, faulted in from swap (evicting for room) or
//! created, pinned and unpinned, and leased.

use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::blob::{Blob, Placed};
use super::lease::LeaseKind;
use super::state::State;
use super::write_back::WriteBack;
use crate::proto::Lease;
use crate::store::aligned::AlignedBuf;
use crate::store::arena::{Arena, SlotRead};
use crate::store::error::{IntegrityKind, StoreError};
use crate::store::eviction::SlotMeta;
use crate::store::extent::{self, BLOCK};
use crate::store::ids::{BlobKey, HolderId, VolumeId};
use crate::store::stats::StoreStats;
use crate::store::swap::Swap;

/// Most slots one eviction frees (their write-backs share a submission).
const EVICT_BATCH: usize = 8;

/// The store lock held.
pub(in crate::store) type Guard<'a> = MutexGuard<'a, State>;

/// A slot handed out for use.
#[derive(Clone, Copy, Debug)]
pub(in crate::store) enum Staged {
    /// Holds the blob's bytes.
    Ready(u32),
    /// Attached to the blob but unread and pinned in transition, because the
    /// caller overwrites all of it: reading (or zeroing) bytes about to be
    /// replaced would only cost a disk read. Others wait until the write
    /// ends, as for a fault-in.
    Staged(u32),
}

impl Staged {
    pub(in crate::store) fn slot(self) -> u32 {
        match self {
            Staged::Ready(s) | Staged::Staged(s) => s,
        }
    }
}

/// The shared engine: the state under its lock, and what runs outside it.
pub(in crate::store) struct Core {
    pub(in crate::store) arena: Arena,
    pub(in crate::store) swap: Swap,
    pub(in crate::store) state: Mutex<State>,
    /// Signalled whenever a slot leaves transition and when a flush is done:
    /// fault-in waiters, evictors short of victims and flushes wait on it.
    pub(super) settled: Condvar,
    /// Wakes the cleaner.
    pub(super) kick: Condvar,
    /// Wakes the read-ahead workers when blobs are queued.
    pub(super) ahead: Condvar,
    /// Wakes the lease reaper when a lease is asked back (a new deadline).
    pub(super) reap: Condvar,
}

impl Core {
    /// Reads `key`'s image at `placed` into `slot` (put in transition by
    /// the caller) with the store lock dropped, and checks it against the
    /// extent's block checksums: `Some(block)` is the first bad block.
    pub(super) fn load_unlocked(
        &self,
        g: &mut Guard<'_>,
        slot: u32,
        key: BlobKey,
        placed: &Placed,
    ) -> Result<Option<usize>, StoreError> {
        let ident = g.ident(key, placed.version);
        let crcs = g.images.block_crcs(placed.extent, 0, g.images.blocks());
        MutexGuard::unlocked(g, || {
            let mut bytes = self.arena.write(slot);
            self.swap
                .read_extent(placed.extent, &mut bytes)
                .map(|()| extent::first_bad_block(&ident, 0, &bytes, &crcs))
        })
    }

    pub(in crate::store) fn new(arena: Arena, swap: Swap, state: State) -> Core {
        Core {
            arena,
            swap,
            state: Mutex::new(state),
            settled: Condvar::new(),
            kick: Condvar::new(),
            ahead: Condvar::new(),
            reap: Condvar::new(),
        }
    }

    /// Wakes the background threads that have work: the cleaner if clean
    /// slots ran short, the read-ahead workers if blobs are queued, the
    /// reaper if a lease was asked back. Called after every locked
    /// operation so the check lives in one place.
    pub(in crate::store) fn wake_background(&self, g: &mut Guard<'_>) {
        if g.cleaner_due() {
            self.kick.notify_one();
        }
        if g.read_ahead.pending() {
            self.ahead.notify_all();
        }
        if g.leases.revoking() {
            self.reap.notify_one();
        }
    }

    /// Asks the background threads to exit.
    pub(in crate::store) fn stop_background(&self) {
        self.state.lock().stop();
        self.kick.notify_all();
        self.ahead.notify_all();
        self.reap.notify_all();
    }

    /// The blob's slot, faulting it in from swap if needed. Returns with the
    /// lock held and the slot usable; the caller pins it before unlocking.
    /// With `stage` the caller is about to overwrite the whole blob, so a
    /// slot that is not resident is attached unread (see [`Staged`]).
    pub(super) fn resident(
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
                    st.volumes.get_mut(key.0).resident += 1;
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

    /// The blob's slot; a new blob gets a zeroed one, within the quota, or
    /// with `stage` an unzeroed staged one.
    pub(super) fn resident_or_create(
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
            let v = st.volumes.get(key.0);
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
            if st.blobs.len() as u64 + 1 >= u64::from(st.images.extents.total()) {
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
            let v = st.volumes.get_mut(key.0);
            v.blobs += 1;
            v.resident += 1;
            return Ok(if stage {
                Staged::Staged(slot)
            } else {
                Staged::Ready(slot)
            });
        }
    }

    pub(in crate::store) fn pin(
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
    pub(in crate::store) fn pin_or_create(
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
    pub(in crate::store) fn unpin_written(&self, g: &mut Guard<'_>, slot: Staged) {
        if let Staged::Staged(s) = slot {
            g.slots.meta[s as usize].loading = false;
            g.transit.slots -= 1;
            self.settled.notify_all();
        }
        g.slots.unpin(slot.slot(), true);
    }

    pub(in crate::store) fn stats(&self, g: &Guard<'_>) -> StoreStats {
        g.stats(&self.swap)
    }

    pub(in crate::store) fn alloc(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Lease, StoreError> {
        g.check_vol(vol)?;
        g.check_lease_limit(holder)?;
        let slot = loop {
            let s = self.resident_or_create(g, (vol, key), false)?.slot();
            if g.slots.meta[s as usize].writing.is_none() {
                break s;
            }
            // A write-back without the lock is checksumming and writing
            // this slot: the holder's RDMA writes must not race it.
            self.settled.wait(g);
        };
        Ok(g.new_lease(holder, (vol, key), slot, LeaseKind::Alloc))
    }

    pub(in crate::store) fn get(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Option<Lease>, StoreError> {
        g.check_vol(vol)?;
        g.check_lease_limit(holder)?;
        Ok(self
            .resident(g, (vol, key), false)?
            .map(|s| g.new_lease(holder, (vol, key), s.slot(), LeaseKind::Get)))
    }

    /// Wakes requests waiting for a lease to end ([`StoreError::Reclaiming`]).
    pub(in crate::store) fn lease_ended(&self) {
        self.settled.notify_all();
    }

    /// Waits, without the store lock, until a lease ends or `until`; returns
    /// at once if one ended since the count `ends` was seen.
    pub(in crate::store) fn await_lease_end(&self, until: Instant, ends: u64) {
        let mut g = self.state.lock();
        if g.leases.ends() == ends && Instant::now() < until {
            let _ = self.settled.wait_until(&mut g, until);
        }
    }

    /// A free slot for volume `vol`, evicting if there is none. May drop
    /// the lock.
    pub(super) fn take_slot(&self, g: &mut Guard<'_>, vol: VolumeId) -> Result<u32, StoreError> {
        loop {
            if let Some(s) = g.slots.free.pop() {
                return Ok(s);
            }
            self.evict(g, vol)?;
        }
    }

    /// Frees unpinned slots chosen by CLOCK. Clean victims go at once; only
    /// when every victim is dirty (the cleaner fell behind) does this thread
    /// write them back itself, without the lock, and free those still clean
    /// after. `Ok` without a free slot means "look again": the lock was
    /// dropped and things changed.
    fn evict(&self, g: &mut Guard<'_>, vol: VolumeId) -> Result<(), StoreError> {
        if g.transit.flush_waiting > 0 {
            self.settled.wait(g);
            return Ok(());
        }
        let st = &mut **g;
        let want = st.slots.len().div_ceil(8).clamp(1, EVICT_BATCH);
        let clean = st.slots.pick(want, true);
        if !clean.is_empty() {
            st.counters.evictions += clean.len() as u64;
            for s in clean {
                st.evict_slot(s);
            }
            return Ok(());
        }
        if st.transit.writes > 0 {
            // Clean slots are on their way; waiting beats writing a victim.
            self.settled.wait(g);
            return Ok(());
        }
        let victims = st.slots.pick(want, false);
        if victims.is_empty() {
            if st.transit.slots > 0 {
                // Slots are only held by in-flight I/O; wait for it rather
                // than asking leases back.
                self.settled.wait(g);
                return Ok(());
            }
            return st.pinned_full(vol);
        }
        // No write-back is in flight, so every victim is dirty.
        let plan = WriteBack::plan(st, &self.swap, &victims, true)?;
        if plan.is_empty() {
            return Err(st.no_space());
        }
        self.write_back(g, &plan, true, true)
    }

    /// Runs a planned write-back, several extents per submission, without
    /// the lock when `unlocked`, then finishes it under the lock. Each
    /// image's block CRCs are computed from the bytes written, and its
    /// header goes to the extent table with it.
    pub(super) fn write_back(
        &self,
        g: &mut Guard<'_>,
        plan: &[WriteBack],
        evict: bool,
        unlocked: bool,
    ) -> Result<(), StoreError> {
        let io = || -> Result<Vec<Vec<u32>>, StoreError> {
            let guards: Vec<SlotRead<'_>> = plan.iter().map(|w| self.arena.read(w.slot)).collect();
            let mut copies: Vec<Option<AlignedBuf>> = Vec::with_capacity(plan.len());
            for (w, b) in plan.iter().zip(&guards) {
                copies.push(if w.copy {
                    Some(self.swap.copy_of(b)?)
                } else {
                    None
                });
            }
            let images: Vec<&[u8]> = guards
                .iter()
                .zip(&copies)
                .map(|(b, c)| c.as_deref().unwrap_or(b))
                .collect();
            let ios: Vec<(u32, &[u8])> = plan
                .iter()
                .zip(&images)
                .map(|(w, b)| (w.extent, *b))
                .collect();
            // The bytes do not change while they are written, so their
            // checksums are computed meanwhile.
            let mut crcs: Vec<Vec<u32>> = Vec::new();
            let written = self
                .swap
                .write_extents_while(&ios, || {
                    crcs = plan
                        .iter()
                        .zip(&images)
                        .map(|(w, b)| extent::image_crcs(&w.ident, b))
                        .collect();
                })
                .and_then(|()| {
                    plan.iter()
                        .zip(&crcs)
                        .try_for_each(|(w, c)| self.swap.meta().write(w.extent, &w.ident, c))
                });
            for c in copies.into_iter().flatten() {
                self.swap.give_buffer(c);
            }
            written.map(|()| crcs)
        };
        let res = if unlocked {
            MutexGuard::unlocked(g, io)
        } else {
            io()
        };
        WriteBack::finish(g, plan, res.as_deref().ok(), evict);
        self.settled.notify_all();
        res.map(|_| ())
    }
}

#[cfg(test)]
impl Core {
    /// The last read noted toward read-ahead.
    pub(in crate::store) fn last_read(&self) -> Option<crate::store::ids::BlobKey> {
        self.state.lock().read_ahead.last()
    }

    /// The slot blob `key` is in, if any.
    pub(in crate::store) fn slot_of(&self, key: BlobKey) -> Option<u32> {
        self.state.lock().blobs.get(&key).and_then(|b| b.slot)
    }

    /// The extent the durable index names for `key` (tests damage it).
    pub(in crate::store) fn durable_extent(&self, key: BlobKey) -> Option<u32> {
        self.state
            .lock()
            .blobs
            .get(&key)
            .and_then(|b| b.durable)
            .map(|p| p.extent)
    }
}
