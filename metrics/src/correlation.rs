//! Process-local correlation ids.
//!
//! They tie a request's log events (`request.slow`, `request.stuck`,
//! `attempt.failed`, ...) together without putting request ids into metric
//! labels. Ids are handed out in blocks per thread so that queue threads do
//! not contend on one shared cache line for every I/O.

use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

const BLOCK: u64 = 1024;
static NEXT_BLOCK: AtomicU64 = AtomicU64::new(1);

thread_local! {
    // (next id, end of the reserved block)
    static LOCAL: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// A process-local, unique, non-zero id of one logical request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CorrelationId(u64);

impl CorrelationId {
    /// A fresh id; never 0, unique within the process.
    #[inline]
    pub fn next() -> CorrelationId {
        LOCAL.with(|cell| {
            let (next, end) = cell.get();
            let (id, end) = if next < end {
                (next, end)
            } else {
                let start = NEXT_BLOCK.fetch_add(BLOCK, Ordering::Relaxed);
                (start, start + BLOCK)
            };
            cell.set((id + 1, end));
            CorrelationId(id)
        })
    }

    pub(crate) const fn from_raw(v: u64) -> CorrelationId {
        CorrelationId(v)
    }

    /// The numeric value, as logged.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for CorrelationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_unique_across_threads() {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..3000)
                        .map(|_| CorrelationId::next().get())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for h in handles {
            for id in h.join().expect("thread") {
                assert_ne!(id, 0);
                assert!(seen.insert(id), "duplicate id {id}");
            }
        }
    }
}
