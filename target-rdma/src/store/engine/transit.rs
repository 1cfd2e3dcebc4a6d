//! Slots moving between RAM and swap without the store lock (fault-ins and
//! write-backs), and the flushes waiting for those writes to end.

/// How many slots are in transition, and who waits for them.
#[derive(Default)]
pub(super) struct Transit {
    /// Slots loading or writing without the store lock.
    pub(super) slots: usize,
    /// Of those, the ones writing.
    pub(super) writes: usize,
    /// Flushes waiting for in-flight write-backs; while non-zero no new
    /// write-back starts, so a flush cannot starve.
    pub(super) flush_waiting: usize,
}
