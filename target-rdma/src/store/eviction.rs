//! Slot bookkeeping and CLOCK victim selection.
//!
//! CLOCK rather than exact LRU: a hit only sets a bit (no list surgery under
//! the store lock), and a sweep gives a recently used slot a second chance.

use super::ids::BlobKey;

/// What the store knows about one arena slot.
#[derive(Clone, Debug, Default)]
pub(super) struct SlotMeta {
    /// The blob whose content the slot holds; `None` for a free slot, or for
    /// a slot whose blob was removed while it was still pinned.
    pub(super) owner: Option<BlobKey>,
    /// Leases, in-progress inline copies and an in-flight fault-in or
    /// write-back; a pinned slot is never evicted.
    pub(super) pins: u32,
    /// ALLOC leases: their holders may change the bytes at any moment, so
    /// the slot stays dirty even right after a write-back.
    pub(super) writers: u32,
    /// Newer than the blob's swap copy (or it has none).
    pub(super) dirty: bool,
    /// Used since the hand last passed.
    pub(super) referenced: bool,
    /// Being read in from swap without the store lock: its bytes are not
    /// the blob's yet, so users wait for the fault-in to end.
    pub(super) loading: bool,
    /// The extent a write-back running without the store lock is writing;
    /// nothing else may write, free or journal it until that ends.
    pub(super) writing: Option<u32>,
    /// Read ahead and not used yet; its first use extends the read-ahead.
    pub(super) read_ahead: bool,
}

/// The CLOCK hand.
#[derive(Debug, Default)]
pub(super) struct Clock {
    hand: usize,
}

impl Clock {
    /// Picks up to `want` unpinned occupied slots, clearing reference bits on
    /// the way; two turns of the hand are enough to find any that exist.
    /// `clean_only` passes dirty slots over, so that eviction takes what the
    /// cleaner already wrote back instead of writing a victim itself.
    pub(super) fn pick(
        &mut self,
        slots: &mut [SlotMeta],
        want: usize,
        clean_only: bool,
    ) -> Vec<u32> {
        let n = slots.len();
        let mut out = Vec::with_capacity(want);
        for _ in 0..2 * n {
            if out.len() >= want {
                break;
            }
            let i = self.hand;
            self.hand = (self.hand + 1) % n;
            let m = &mut slots[i];
            if m.owner.is_none() || m.pins > 0 {
                continue;
            }
            if m.referenced {
                m.referenced = false;
                continue;
            }
            // The second turn passes slots the first one already took.
            if (clean_only && m.dirty) || out.contains(&(i as u32)) {
                continue;
            }
            out.push(i as u32);
        }
        out
    }

    /// Up to `want` dirty unpinned slots in the order the hand will reach
    /// them, so that background write-back cleans the next victims first.
    /// Leaves reference bits alone: cleaning is not a use.
    pub(super) fn dirty_ahead(&self, slots: &[SlotMeta], want: usize) -> Vec<u32> {
        let n = slots.len();
        (0..n)
            .map(|i| (self.hand + i) % n)
            .filter(|&i| {
                let m = &slots[i];
                m.owner.is_some() && m.dirty && m.pins == 0
            })
            .take(want)
            .map(|i| i as u32)
            .collect()
    }
}
