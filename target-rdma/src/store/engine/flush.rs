//! FLUSH and the durable commit of the index. A commit syncs the swap file,
//! journals the mappings written back since the last one, and only then
//! frees the extents they superseded; a FLUSH first writes back every dirty
//! slot, with the store lock held once in-flight write-backs are done, so
//! that everything acknowledged before it is covered.

use std::collections::BTreeSet;

use super::{names, Core, Guard, State};
use crate::store::error::StoreError;
use crate::store::format::{Record, Snapshot};
use crate::store::ids::BlobKey;
use crate::store::swap::Swap;

/// Most write-backs per submission during a flush.
const WRITE_BATCH: usize = 64;
/// Most of those whose slot is copied first (ALLOC-leased), so a flush
/// holds at most this many blob copies.
const COPY_BATCH: usize = 8;

impl State {
    /// Makes written-back images and removals durable: sync the swap file,
    /// journal the mappings, then free the extents they superseded. A blob
    /// whose own extent is being rewritten right now stays unjournaled: its
    /// image is not complete until that write-back ends.
    pub(super) fn commit_index(&mut self, swap: &Swap) -> Result<(), StoreError> {
        if self.unjournaled.is_empty() && self.pending_removes.is_empty() {
            return Ok(());
        }
        let (ready, busy): (BTreeSet<BlobKey>, BTreeSet<BlobKey>) =
            std::mem::take(&mut self.unjournaled)
                .into_iter()
                .partition(|k| {
                    let slot = self.blobs.get(k).and_then(|b| b.slot);
                    slot.is_none_or(|s| self.slots.meta[s as usize].writing.is_none())
                });
        self.unjournaled = busy;
        if let Err(e) = swap.sync() {
            self.unjournaled.extend(ready);
            return Err(e);
        }
        let mut records = Vec::with_capacity(self.pending_removes.len() + ready.len());
        records.extend(
            self.pending_removes
                .iter()
                .map(|&(vol, key)| Record::Remove { vol, key }),
        );
        for &(vol, key) in &ready {
            let p = self.blobs[&(vol, key)]
                .extent
                .expect("an unjournaled blob has a swap image");
            records.push(Record::Put {
                vol,
                key,
                extent: p.extent,
                version: p.version,
            });
        }
        let committed = {
            let names = names(&self.volumes);
            let blobs = &self.blobs;
            let (generation, blob_bytes, extents) =
                (self.generation, self.blob_bytes, self.extents.total());
            // The index before these records, in case they need a fresh
            // journal: a checkpoint of it comes first.
            self.index.commit(&records, || Snapshot {
                generation,
                blob_bytes,
                extents,
                volumes: &names,
                blob_count: blobs.values().filter(|b| b.durable.is_some()).count() as u64,
                blobs: blobs
                    .iter()
                    .filter_map(|(k, b)| b.durable.map(|d| (k.0, k.1, d.extent, d.version))),
            })
        };
        if let Err(e) = committed {
            self.unjournaled.extend(ready);
            return Err(e);
        }
        for key in ready {
            if let Some(b) = self.blobs.get_mut(&key) {
                let old = std::mem::replace(&mut b.durable, b.extent);
                if let Some(old) = old.filter(|&o| Some(o) != b.extent) {
                    self.release_extent(old.extent);
                }
            }
        }
        for e in std::mem::take(&mut self.pending_free) {
            self.release_extent(e);
        }
        self.pending_removes.clear();
        Ok(())
    }
}

impl Core {
    /// Writes back every dirty slot, leased ones included (their bytes are
    /// in place), and commits the index. Runs in rounds when free extents
    /// are short: each commit frees the extents the last round superseded.
    /// In-flight write-backs are waited for first, and the lock is then held
    /// throughout, so everything acknowledged before the call is covered.
    pub(in crate::store) fn flush(&self, g: &mut Guard<'_>) -> Result<(), StoreError> {
        g.flush_waiting += 1;
        while g.writes_in_flight > 0 {
            self.settled.wait(g);
        }
        g.flush_waiting -= 1;
        let res = self.flush_locked(g);
        // Evictors held back while we waited may go on.
        self.settled.notify_all();
        res
    }

    fn flush_locked(&self, g: &mut Guard<'_>) -> Result<(), StoreError> {
        let st = &mut **g;
        let dirty: Vec<u32> = (0..st.slots.len() as u32)
            .filter(|&s| {
                let m = &st.slots.meta[s as usize];
                m.owner.is_some() && m.dirty
            })
            .collect();
        let mut todo = &dirty[..];
        while !todo.is_empty() {
            let st = &mut **g;
            let mut free = st.extents.free_count();
            let (mut n, mut copies) = (0, 0);
            for &s in todo.iter().take(WRITE_BATCH) {
                if st.slots.meta[s as usize].writers > 0 {
                    // Copied before writing (see `WriteBack::copy`): a few
                    // per batch bound that memory.
                    if copies == COPY_BATCH {
                        break;
                    }
                    copies += 1;
                }
                if st.needs_fresh(s) {
                    if free == 0 {
                        break;
                    }
                    free -= 1;
                }
                n += 1;
            }
            if n == 0 {
                st.commit_index(&self.swap)?;
                if st.extents.free_count() == 0 {
                    return Err(st.no_space());
                }
                continue;
            }
            let plan = st.plan_write_back(&self.swap, &todo[..n], true)?;
            self.write_back(g, &plan, false, false)?;
            todo = &todo[n..];
        }
        g.commit_index(&self.swap)?;
        g.counters.flushes += 1;
        Ok(())
    }
}
