//! Write-back: a dirty slot's bytes copied to a swap extent, never the one
//! the durable index names, with the extent's header, so the slot can be
//! reused. Eviction does it on demand when every victim is dirty; the
//! cleaner does it ahead of the CLOCK hand so eviction seldom has to. The
//! I/O runs without the store lock: a slot being written is pinned and
//! marked `writing`, and the outcome is settled under the lock again.

use parking_lot::MutexGuard;
use std::time::Duration;

use super::{Core, Guard, Placed, State};
use crate::store::aligned::AlignedBuf;
use crate::store::arena::SlotRead;
use crate::store::error::StoreError;
use crate::store::eviction::SlotMeta;
use crate::store::extent::{self, Ident};
use crate::store::ids::{BlobKey, VolumeId};
use crate::store::swap::Swap;

/// Most slots one eviction frees (their write-backs share a submission).
const EVICT_BATCH: usize = 8;

/// Most write-backs per cleaner submission: enough to keep the disk queue
/// busy, few enough that slots come back clean at a steady pace.
const CLEAN_BATCH: usize = 8;

/// How long the cleaner rests after a failed write-back, so a broken disk
/// does not make it spin.
const CLEAN_RETRY: Duration = Duration::from_millis(50);

/// A write-back the store lock has set up: `slot`'s bytes go to `extent`
/// as image `ident`.
pub(super) struct WriteBack {
    slot: u32,
    key: BlobKey,
    extent: u32,
    /// `extent` was free, not the blob's own.
    fresh: bool,
    ident: Ident,
    /// The slot has ALLOC leases, whose holders may change it by RDMA at any
    /// moment: the image is copied first, so that its checksums and the
    /// bytes written are the same bytes.
    copy: bool,
}

impl State {
    /// Whether to wake the cleaner now; notes that it was woken.
    pub(super) fn cleaner_due(&mut self) -> bool {
        let due = !self.cleaner_kicked && !self.stopping && self.slots.below_low_water();
        self.cleaner_kicked |= due;
        due
    }

    /// Drops a clean unpinned slot's content (its blob stays in swap).
    pub(super) fn evict_slot(&mut self, slot: u32) {
        let m = &mut self.slots.meta[slot as usize];
        debug_assert!(!m.dirty && m.pins == 0);
        if let Some(key) = m.owner.take() {
            if let Some(b) = self.blobs.get_mut(&key) {
                b.slot = None;
            }
        }
        *m = SlotMeta::default();
        self.slots.free.push(slot);
    }

    /// Whether writing the slot back needs a fresh extent (its blob has none
    /// of its own that the durable index does not name).
    pub(super) fn needs_fresh(&self, slot: u32) -> bool {
        let Some(key) = self.slots.meta[slot as usize].owner else {
            return false;
        };
        let b = &self.blobs[&key];
        !matches!(b.extent, Some(e) if b.durable != Some(e))
    }

    /// Chooses extents for writing back `slots` and puts those slots in
    /// transition. Slots that find no extent are left out (they stay dirty
    /// and resident). With `commit`, commits the index first when extents
    /// are short, since that frees the extents earlier write-backs
    /// superseded; the cleaner does not, so that it never makes unflushed
    /// data durable on its own.
    pub(super) fn plan_write_back(
        &mut self,
        swap: &Swap,
        slots: &[u32],
        commit: bool,
    ) -> Result<Vec<WriteBack>, StoreError> {
        let need = slots.iter().filter(|&&s| self.needs_fresh(s)).count();
        if commit && self.extents.free_count() < need {
            self.commit_index(swap)?;
        }
        let mut plan = Vec::with_capacity(slots.len());
        for &slot in slots {
            let Some(key) = self.slots.meta[slot as usize].owner else {
                continue;
            };
            let b = &self.blobs[&key];
            let (extent, fresh) = match b.extent {
                Some(e) if b.durable != Some(e) => (e.extent, false),
                _ => match self.extents.alloc() {
                    Some(e) => (e, true),
                    None => continue,
                },
            };
            let version = self.next_version();
            plan.push(WriteBack {
                slot,
                key,
                extent,
                fresh,
                ident: self.ident(key, version),
                copy: self.slots.meta[slot as usize].writers > 0,
            });
        }
        for w in &plan {
            let m = &mut self.slots.meta[w.slot as usize];
            m.pins += 1;
            m.writing = Some(w.extent);
            // Clean from now on unless changed again before the write ends;
            // ALLOC-leased slots may change at any moment, so stay dirty.
            let writers = m.writers;
            self.slots.set_dirty(w.slot, writers > 0);
        }
        self.in_transit += plan.len();
        self.writes_in_flight += plan.len();
        Ok(plan)
    }

    /// Ends the transition of a planned write-back: on success (`crcs`
    /// holds each image's block CRCs) the blob's swap image moves to the
    /// written extent (and, with `evict`, slots still clean and unpinned are
    /// freed); on failure the slot is dirty again and a half-written extent
    /// of its own is dropped.
    fn finish_write_back(&mut self, plan: &[WriteBack], crcs: Option<&[Vec<u32>]>, evict: bool) {
        self.in_transit -= plan.len();
        self.writes_in_flight -= plan.len();
        let mut evicted = 0;
        for (i, w) in plan.iter().enumerate() {
            let m = &mut self.slots.meta[w.slot as usize];
            m.pins -= 1;
            m.writing = None;
            if m.owner != Some(w.key) {
                // Removed meanwhile; `drop_blob` left the extent to us.
                self.release_extent(w.extent);
                self.slots.free_if_orphaned(w.slot);
                continue;
            }
            if let Some(crcs) = crcs {
                let at = w.extent as usize * self.blocks;
                self.crcs[at..at + self.blocks].copy_from_slice(&crcs[i]);
                if let Some(b) = self.blobs.get_mut(&w.key) {
                    b.extent = Some(Placed {
                        extent: w.extent,
                        version: w.ident.version,
                    });
                }
                self.unjournaled.insert(w.key);
                self.counters.write_backs += 1;
                let m = &self.slots.meta[w.slot as usize];
                if evict && m.pins == 0 && !m.dirty {
                    self.evict_slot(w.slot);
                    evicted += 1;
                }
            } else {
                if !w.fresh {
                    // Possibly half-written: the blob no longer has a valid
                    // swap image, only its (dirty) slot.
                    if let Some(b) = self.blobs.get_mut(&w.key) {
                        b.extent = None;
                    }
                    self.unjournaled.remove(&w.key);
                }
                self.release_extent(w.extent);
                self.slots.set_dirty(w.slot, true);
            }
        }
        self.counters.evictions += evicted;
    }
}

impl Core {
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
        if g.flush_waiting > 0 {
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
        if st.writes_in_flight > 0 {
            // Clean slots are on their way; waiting beats writing a victim.
            self.settled.wait(g);
            return Ok(());
        }
        let victims = st.slots.pick(want, false);
        if victims.is_empty() {
            if st.in_transit > 0 {
                // Slots are only held by in-flight I/O; wait for it rather
                // than asking leases back.
                self.settled.wait(g);
                return Ok(());
            }
            return st.pinned_full(vol);
        }
        // No write-back is in flight, so every victim is dirty.
        let plan = st.plan_write_back(&self.swap, &victims, true)?;
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
        g.finish_write_back(plan, res.as_deref().ok(), evict);
        self.settled.notify_all();
        res.map(|_| ())
    }

    /// The cleaner thread: while clean plus free slots are below the low
    /// watermark, writes back the dirty unpinned slots the CLOCK hand will
    /// reach next, a batch per submission and without the lock, so demand
    /// eviction finds clean victims and disk writes overlap the network.
    /// Stays clear of flushes, which do their own write-back.
    pub(in crate::store) fn clean(&self) {
        let mut g = self.state.lock();
        // Between the watermarks: keep cleaning once started.
        let mut active = false;
        while !g.stopping {
            let clean = g.slots.len() - g.slots.n_dirty;
            active = (active && clean < 2 * g.slots.low_water()) || g.slots.below_low_water();
            if g.flush_waiting > 0 || !active {
                g.cleaner_kicked = false;
                self.kick.wait(&mut g);
                continue;
            }
            let st = &mut *g;
            let want = (2 * st.slots.low_water())
                .saturating_sub(st.slots.len() - st.slots.n_dirty)
                .clamp(1, CLEAN_BATCH);
            let batch = st.slots.dirty_ahead(want);
            let plan = match st.plan_write_back(&self.swap, &batch, false) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(event = "cleaner_failed", error = %e, "background write-back could not be planned");
                    MutexGuard::unlocked(&mut g, || std::thread::sleep(CLEAN_RETRY));
                    continue;
                }
            };
            if plan.is_empty() {
                // Every dirty slot is pinned or no extent is free: wait for
                // the next change rather than spin.
                g.cleaner_kicked = false;
                self.kick.wait(&mut g);
                continue;
            }
            if let Err(e) = self.write_back(&mut g, &plan, false, true) {
                tracing::warn!(event = "cleaner_failed", error = %e, "background write-back failed; slots stay dirty");
                MutexGuard::unlocked(&mut g, || std::thread::sleep(CLEAN_RETRY));
            }
        }
    }
}
