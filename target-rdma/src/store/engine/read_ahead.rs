//! Read-ahead: a run of reads of consecutive keys queues the next blobs,
//! which background workers (see `workers`) fault in before the reader
//! asks, so that its disk reads overlap the network.

use crate::store::ids::BlobKey;

/// Blobs read ahead of a sequential reader: enough to keep the disk busy
/// while the connection sends the previous ones.
pub(in crate::store) const READ_AHEAD: u64 = 4;

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

    /// The next blob to read ahead.
    pub(super) fn next(&mut self) -> Option<BlobKey> {
        self.queue.pop()
    }

    /// Forgets the queued blobs (no slot is free or clean for them).
    pub(super) fn drop_queue(&mut self) {
        self.queue.clear();
    }

    /// The last read noted.
    #[cfg(test)]
    pub(super) fn last(&self) -> Option<BlobKey> {
        self.last
    }
}
