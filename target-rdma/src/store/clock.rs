//! Slot bookkeeping and CLOCK victim selection.
//!
//! CLOCK rather than exact LRU: a hit only sets a bit (no list surgery under
//! the store lock), and a sweep gives a recently used slot a second chance.

use super::BlobKey;

/// What the store knows about one arena slot.
#[derive(Clone, Debug, Default)]
pub(super) struct SlotMeta {
    /// The blob whose content the slot holds; `None` for a free slot, or for
    /// a slot whose blob was removed while it was still pinned.
    pub(super) owner: Option<BlobKey>,
    /// Leases plus in-progress inline copies; a pinned slot is never evicted.
    pub(super) pins: u32,
    /// ALLOC leases: their holders may change the bytes at any moment, so
    /// the slot stays dirty even right after a write-back.
    pub(super) writers: u32,
    /// Newer than the blob's swap copy (or it has none).
    pub(super) dirty: bool,
    /// Used since the hand last passed.
    pub(super) referenced: bool,
}

/// The CLOCK hand.
#[derive(Debug, Default)]
pub(super) struct Clock {
    hand: usize,
}

impl Clock {
    /// Picks up to `want` unpinned occupied slots, clearing reference bits on
    /// the way; two turns of the hand are enough to find any that exist.
    pub(super) fn pick(&mut self, slots: &mut [SlotMeta], want: usize) -> Vec<u32> {
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
            out.push(i as u32);
        }
        out
    }
}
