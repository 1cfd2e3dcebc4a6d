//! Per-thread shards for the values every I/O updates.
//!
//! Each ublk queue is one thread. If all queues add to the same atomic, every
//! addition moves that cache line between cores, and two queues already cost
//! several times one (measured in `cargo bench -p ublk-metrics`). So hot
//! counters and histograms keep one cache-line-padded copy per shard, a
//! thread always writes its own shard, and readers (a scrape) sum them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

/// Shards per value: threads beyond this share (round-robin), which costs
/// speed, never correctness.
pub(crate) const SHARDS: usize = 16;

/// One shard on cache lines of its own (two on x86, whose adjacent-line
/// prefetch pairs them).
pub(crate) type Padded<T> = CachePadded<T>;

static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
}

/// This thread's shard.
#[inline]
pub(crate) fn current() -> usize {
    SHARD.with(|s| *s)
}

/// One shard per [`SHARDS`], boxed.
pub(crate) fn new_shards<T: Default>() -> Box<[Padded<T>]> {
    (0..SHARDS).map(|_| Padded::default()).collect()
}

/// A monotonic counter written from many threads without sharing a line.
#[derive(Debug)]
pub struct ShardedCounter {
    shards: Box<[Padded<AtomicU64>]>,
}

impl Default for ShardedCounter {
    fn default() -> Self {
        Self {
            shards: new_shards(),
        }
    }
}

impl ShardedCounter {
    /// Adds `n`.
    #[inline]
    pub fn increment(&self, n: u64) {
        self.shards[current()].fetch_add(n, Ordering::Relaxed);
    }

    /// The sum over all shards.
    pub fn value(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// A gauge of things in flight, raised and lowered from many threads
/// (not necessarily the same one) without sharing a line: a sharded counter
/// whose shards may wrap below zero while their sum does not.
#[derive(Debug, Default)]
pub struct ShardedGauge(ShardedCounter);

impl ShardedGauge {
    /// Adds one.
    #[inline]
    pub fn increment(&self) {
        self.0.increment(1);
    }

    /// Takes one away.
    #[inline]
    pub fn decrement(&self) {
        self.0.increment(u64::MAX);
    }

    /// The sum over all shards.
    pub fn value(&self) -> i64 {
        self.0.value() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn increments_from_many_threads_all_count() {
        let c = Arc::new(ShardedCounter::default());
        let threads: Vec<_> = (0..40)
            .map(|_| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.increment(3);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(c.value(), 40 * 1000 * 3);
    }

    #[test]
    fn a_gauge_raised_on_one_thread_and_lowered_on_another_sums_right() {
        let g = Arc::new(ShardedGauge::default());
        for _ in 0..5 {
            g.increment();
        }
        let g2 = Arc::clone(&g);
        std::thread::spawn(move || {
            for _ in 0..3 {
                g2.decrement();
            }
        })
        .join()
        .unwrap();
        assert_eq!(g.value(), 2);
    }

    #[test]
    fn shards_do_not_share_cache_lines() {
        assert_eq!(std::mem::align_of::<Padded<AtomicU64>>(), 128);
        assert_eq!(std::mem::size_of::<Padded<AtomicU64>>(), 128);
    }
}
