//! What the engine's background threads (see `workers`) go by, kept under
//! the store lock.

use super::slots::Slots;

/// What the background threads go by, under the store lock.
#[derive(Default)]
pub(super) struct Background {
    /// The cleaner was woken and has not gone back to sleep yet.
    pub(super) cleaner_kicked: bool,
    /// The store is closing: the cleaner exits.
    pub(super) stopping: bool,
}

impl Background {
    /// Whether to wake the cleaner now (clean slots ran short); notes that
    /// it was woken.
    pub(super) fn cleaner_due(&mut self, slots: &Slots) -> bool {
        let due = !self.cleaner_kicked && !self.stopping && slots.below_low_water();
        self.cleaner_kicked |= due;
        due
    }
}
