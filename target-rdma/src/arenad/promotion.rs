//! Cold blobs that RDMA clients keep reading, faulted into the arena in the
//! background.
//!
//! An RDMA client reading part of a blob asks GET_RESIDENT; for a blob in
//! swap only it gets COLD and reads the range inline, which the store
//! serves at that size from swap: a 4 KiB read costs a 4 KiB disk read,
//! not a fault-in of the whole blob on the request's path. A blob that
//! keeps being read that way is worth a slot: when GET_RESIDENTs find it cold
//! `after` times while it is among the last blobs found cold (an eighth of
//! the arena's slots, at most [`MAX_WINDOW`]), it is faulted in on the
//! blocking pool (at most [`MAX_IN_FLIGHT`] at once, so foreground
//! requests keep the pool), and its later reads go by RDMA again. Random
//! reads over a volume larger than the arena rarely find a blob twice
//! within so short a window, so they do not churn the arena (a fault-in
//! costs a whole blob's disk read and evicts another); reads that stay
//! within a blob or a few do.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::store::VolumeId;

/// Most blobs found cold that are remembered (the first found is
/// forgotten first).
pub(super) const MAX_WINDOW: usize = 64;
/// Background fault-ins running at once.
pub(super) const MAX_IN_FLIGHT: usize = 2;

type Blob = (VolumeId, u64);

/// The blobs found cold lately and the fault-ins running.
pub(super) struct Promotion {
    after: u32,
    window: usize,
    recent: Mutex<Recent>,
    in_flight: Arc<AtomicUsize>,
}

/// Cold finds per blob, and the order the blobs were first found in
/// (the oldest is forgotten when a new one needs the room).
#[derive(Default)]
struct Recent {
    finds: HashMap<Blob, u32>,
    order: VecDeque<Blob>,
}

/// What a GET that found a blob cold leads to.
#[derive(Debug)]
pub(super) enum Touch {
    /// Remembered; not due yet (or promotion is off).
    Noted,
    /// Due, and a place to fault it in is held until the ticket drops.
    Promote(Ticket),
    /// Due, but [`MAX_IN_FLIGHT`] fault-ins are running: not tried (its
    /// count starts again).
    Skipped,
}

/// A running fault-in's place.
#[derive(Debug)]
pub(super) struct Ticket(Arc<AtomicUsize>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Promotion {
    /// Faults in a blob found cold `after` times (0: never) while among
    /// the last found cold, remembering an eighth of `arena_slots`.
    pub(super) fn new(after: u32, arena_slots: u64) -> Self {
        Self {
            after,
            window: usize::try_from(arena_slots / 8)
                .unwrap_or(MAX_WINDOW)
                .clamp(1, MAX_WINDOW),
            recent: Mutex::default(),
            in_flight: Arc::default(),
        }
    }

    /// Notes that a GET found blob `key` of `vol` in swap only.
    pub(super) fn found_cold(&self, vol: VolumeId, key: u64) -> Touch {
        if self.after == 0 {
            return Touch::Noted;
        }
        let blob = (vol, key);
        {
            let mut r = self.recent.lock();
            let finds = match r.finds.get_mut(&blob) {
                Some(n) => {
                    *n += 1;
                    *n
                }
                None => {
                    if r.order.len() >= self.window {
                        if let Some(old) = r.order.pop_front() {
                            r.finds.remove(&old);
                        }
                    }
                    r.order.push_back(blob);
                    r.finds.insert(blob, 1);
                    1
                }
            };
            if finds < self.after {
                return Touch::Noted;
            }
            r.finds.remove(&blob);
            r.order.retain(|b| *b != blob);
        }
        let taken = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_IN_FLIGHT).then_some(n + 1)
            });
        match taken {
            Ok(_) => Touch::Promote(Ticket(Arc::clone(&self.in_flight))),
            Err(_) => Touch::Skipped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn promoted(t: Touch) -> bool {
        matches!(t, Touch::Promote(_))
    }

    #[test]
    fn a_blob_is_due_on_its_nth_cold_find_and_counts_again_after() {
        let p = Promotion::new(2, 1024);
        assert!(!promoted(p.found_cold(1, 7)));
        assert!(!promoted(p.found_cold(1, 8)));
        assert!(!promoted(p.found_cold(2, 7)), "another volume's blob 7");
        assert!(promoted(p.found_cold(1, 7)));
        assert!(!promoted(p.found_cold(1, 7)), "its count starts again");
    }

    #[test]
    fn a_blob_pushed_out_of_the_window_starts_from_one() {
        let p = Promotion::new(2, 1024);
        assert!(!promoted(p.found_cold(1, 0)));
        for k in 1..=MAX_WINDOW as u64 {
            assert!(!promoted(p.found_cold(1, k)));
        }
        assert!(
            !promoted(p.found_cold(1, 0)),
            "forgotten: this is its first find again"
        );
        assert!(promoted(p.found_cold(1, 0)));
        assert!(p.recent.lock().finds.len() <= MAX_WINDOW);
    }

    #[test]
    fn the_window_is_an_eighth_of_the_arena() {
        let p = Promotion::new(2, 32);
        assert!(!promoted(p.found_cold(1, 0)));
        for k in 1..=4 {
            assert!(!promoted(p.found_cold(1, k)));
        }
        assert!(!promoted(p.found_cold(1, 0)), "four others pushed it out");
        assert!(promoted(p.found_cold(1, 0)));
        assert_eq!(Promotion::new(2, 3).window, 1);
    }

    #[test]
    fn at_most_max_in_flight_fault_ins_and_a_dropped_ticket_frees_its_place() {
        let p = Promotion::new(1, 1024);
        let running: Vec<_> = (0..MAX_IN_FLIGHT as u64)
            .map(|k| p.found_cold(1, k))
            .collect();
        assert!(running.iter().all(|t| matches!(t, Touch::Promote(_))));
        assert!(matches!(p.found_cold(1, 99), Touch::Skipped));
        drop(running);
        assert!(promoted(p.found_cold(1, 99)));
    }

    #[test]
    fn zero_never_promotes() {
        let p = Promotion::new(0, 1024);
        for _ in 0..10 {
            assert!(matches!(p.found_cold(1, 1), Touch::Noted));
        }
        assert!(p.recent.lock().finds.is_empty());
    }
}
