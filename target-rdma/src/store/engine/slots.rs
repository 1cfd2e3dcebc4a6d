//! The arena's slots as the engine sees them: each one's metadata
//! ([`SlotMeta`]), the free list, the CLOCK hand over them, and how many
//! are dirty.

use crate::store::eviction::{Clock, SlotMeta};
use crate::store::stats::StoreStats;

/// Every slot's metadata, by slot number, and what is kept beside it.
pub(super) struct Slots {
    pub(super) meta: Vec<SlotMeta>,
    pub(super) free: Vec<u32>,
    clock: Clock,
    /// Occupied dirty slots; kept so the watermark check is O(1).
    pub(super) n_dirty: usize,
}

impl Slots {
    /// `n` slots, all free.
    pub(super) fn new(n: u32) -> Slots {
        Slots {
            meta: vec![SlotMeta::default(); n as usize],
            free: (0..n).rev().collect(),
            clock: Clock::default(),
            n_dirty: 0,
        }
    }

    /// Slots in the arena.
    pub(super) fn len(&self) -> usize {
        self.meta.len()
    }

    /// [`Clock::pick`] over these slots.
    pub(super) fn pick(&mut self, want: usize, clean_only: bool) -> Vec<u32> {
        self.clock.pick(&mut self.meta, want, clean_only)
    }

    /// [`Clock::dirty_ahead`] over these slots.
    pub(super) fn dirty_ahead(&self, want: usize) -> Vec<u32> {
        self.clock.dirty_ahead(&self.meta, want)
    }

    /// Sets a slot's dirty bit, keeping `n_dirty` in step; call it before
    /// giving a slot an owner's dirty state and before taking its owner away.
    pub(super) fn set_dirty(&mut self, slot: u32, dirty: bool) {
        let m = &mut self.meta[slot as usize];
        if m.owner.is_some() && m.dirty != dirty {
            if dirty {
                self.n_dirty += 1;
            } else {
                self.n_dirty -= 1;
            }
        }
        m.dirty = dirty;
    }

    /// Gives a slot that lost its blob back to the free list once unpinned.
    pub(super) fn free_if_orphaned(&mut self, slot: u32) {
        let m = &mut self.meta[slot as usize];
        if m.owner.is_none() && m.pins == 0 {
            *m = SlotMeta::default();
            self.free.push(slot);
        }
    }

    /// Drops a pin; `wrote` marks the blob dirty. A slot whose blob was
    /// removed while pinned becomes free with its last pin.
    pub(super) fn unpin(&mut self, slot: u32, wrote: bool) {
        self.meta[slot as usize].pins -= 1;
        if wrote {
            self.set_dirty(slot, true);
        }
        self.free_if_orphaned(slot);
    }

    /// Clean plus free slots below which the cleaner runs; it stops at twice
    /// this, so it works in batches rather than one slot at a time.
    pub(super) fn low_water(&self) -> usize {
        (self.meta.len() / 8).max(1)
    }

    pub(super) fn below_low_water(&self) -> bool {
        self.meta.len() - self.n_dirty < self.low_water()
    }

    /// Counts the slots by state into `s`.
    pub(super) fn tally(&self, s: &mut StoreStats) {
        debug_assert_eq!(
            self.n_dirty,
            self.meta
                .iter()
                .filter(|m| m.owner.is_some() && m.dirty)
                .count()
        );
        for m in &self.meta {
            // A fault-in or write-back in flight is not a lease.
            let transit = u32::from(m.loading || m.writing.is_some());
            if m.pins > transit {
                s.slots_leased += 1;
            } else if m.owner.is_none() {
                s.slots_free += 1;
            } else if m.dirty {
                s.slots_dirty += 1;
            } else {
                s.slots_clean += 1;
            }
        }
    }
}
