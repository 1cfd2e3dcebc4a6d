//! Read-ahead: a run of reads of consecutive keys queues the next blobs,
//! and background workers fault them in before the reader asks, so that
//! its disk reads overlap the network.

use super::{Core, Guard};
use crate::store::eviction::SlotMeta;
use crate::store::ids::BlobKey;

/// Blobs read ahead of a sequential reader: enough to keep the disk busy
/// while the connection sends the previous ones.
pub(in crate::store) const READ_AHEAD: u64 = 4;
/// Threads that fault read-ahead blobs in, one extent each at a time: the
/// swap sees this many reads in flight, not one read and a hand-off gap.
pub(in crate::store) const READ_AHEAD_WORKERS: usize = 3;

/// What read-ahead knows of the readers, under the store lock.
#[derive(Default)]
pub(super) struct ReadAhead {
    /// The last blob a reader faulted in or found read ahead; the next key
    /// after it means a sequential reader.
    last: Option<BlobKey>,
    /// Blobs to read ahead, for the background thread.
    queue: Vec<BlobKey>,
}

impl ReadAhead {
    /// Notes a read of `key` from swap (or from read-ahead); a run of
    /// consecutive keys queues the next ones for the background thread.
    pub(super) fn note(&mut self, key: BlobKey) {
        let sequential = self.last == Some((key.0, key.1.wrapping_sub(1)));
        self.last = Some(key);
        if sequential {
            self.queue = (1..=READ_AHEAD)
                .filter_map(|d| key.1.checked_add(d))
                .map(|k| (key.0, k))
                .rev()
                .collect();
        }
    }

    /// Whether blobs are queued for the workers.
    pub(super) fn pending(&self) -> bool {
        !self.queue.is_empty()
    }

    /// The last read noted.
    #[cfg(test)]
    pub(super) fn last(&self) -> Option<BlobKey> {
        self.last
    }
}

/// A read-ahead worker: faults queued read-ahead blobs in, one at a
/// time, until the store stops. Several run, so several extents are in
/// flight while the readers consume the ones already loaded.
pub(in crate::store) fn read_ahead_worker(core: &Core) {
    let mut g = core.state.lock();
    while !g.stopping {
        match g.read_ahead.queue.pop() {
            Some(key) => read_ahead_one(core, &mut g, key),
            None => core.ahead.wait(&mut g),
        }
    }
}

/// Faults in one read-ahead blob into a free or clean slot only:
/// read-ahead never writes a victim back or waits. The slot starts
/// unreferenced, so an unused guess is evicted first. With no such
/// slot the queue is dropped: the readers fault their blobs in.
fn read_ahead_one(core: &Core, g: &mut Guard<'_>, key: BlobKey) {
    let st = &mut **g;
    let Some(placed) = st
        .blobs
        .get(&key)
        .filter(|b| b.slot.is_none() && b.damaged.is_none())
        .and_then(|b| b.extent)
    else {
        return;
    };
    let slot = match st.slots.free.pop() {
        Some(s) => s,
        None => match st.slots.pick(1, true).first() {
            Some(&s) => {
                st.counters.evictions += 1;
                st.evict_slot(s);
                st.slots.free.pop().unwrap_or(s)
            }
            None => {
                st.read_ahead.queue.clear();
                return;
            }
        },
    };
    if let Some(b) = st.blobs.get_mut(&key) {
        b.slot = Some(slot);
    }
    st.slots.meta[slot as usize] = SlotMeta {
        owner: Some(key),
        pins: 1,
        loading: true,
        read_ahead: true,
        ..SlotMeta::default()
    };
    st.in_transit += 1;
    let read = core.load_unlocked(g, slot, key, &placed);
    let st = &mut **g;
    let ok = matches!(read, Ok(None));
    if st.finish_load(slot, key, ok) && ok {
        st.counters.fault_ins += 1;
    }
    core.settled.notify_all();
    match read {
        Err(e) => {
            tracing::warn!(event = "read_ahead_failed", error = %e, "read-ahead failed; readers fault the blobs in themselves");
        }
        Ok(Some(_)) => {
            // The reader's own fault-in reports it (counted, logged).
            tracing::debug!(
                event = "read_ahead_unverified",
                extent = placed.extent,
                "a read-ahead image failed its check; dropped"
            );
        }
        Ok(None) => {}
    }
}
