//! The durable commit of the index: sync the swap file, journal the
//! mappings written back since the last commit (and the removals), and
//! only then free the extents they superseded.

use std::collections::BTreeSet;

use super::state::State;
use crate::store::error::StoreError;
use crate::store::format::{Record, Snapshot};
use crate::store::ids::BlobKey;
use crate::store::swap::Swap;

/// Makes written-back images and removals durable: sync the swap file,
/// journal the mappings, then free the extents they superseded. A blob
/// whose own extent is being rewritten right now stays unjournaled: its
/// image is not complete until that write-back ends.
pub(super) fn commit_index(st: &mut State, swap: &Swap) -> Result<(), StoreError> {
    if st.durable.unjournaled.is_empty() && st.durable.pending_removes.is_empty() {
        return Ok(());
    }
    let (ready, busy): (BTreeSet<BlobKey>, BTreeSet<BlobKey>) =
        std::mem::take(&mut st.durable.unjournaled)
            .into_iter()
            .partition(|k| {
                let slot = st.blobs.get(k).and_then(|b| b.slot);
                slot.is_none_or(|s| st.slots.meta[s as usize].writing.is_none())
            });
    st.durable.unjournaled = busy;
    if let Err(e) = swap.sync() {
        st.durable.unjournaled.extend(ready);
        return Err(e);
    }
    let mut records = Vec::with_capacity(st.durable.pending_removes.len() + ready.len());
    records.extend(
        st.durable
            .pending_removes
            .iter()
            .map(|&(vol, key)| Record::Remove { vol, key }),
    );
    for &(vol, key) in &ready {
        let p = st.blobs[&(vol, key)]
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
        let names = st.volumes.names();
        let blobs = &st.blobs;
        let (generation, blob_bytes, extents) =
            (st.generation, st.blob_bytes, st.images.extents.total());
        // The index before these records, in case they need a fresh
        // journal: a checkpoint of it comes first.
        st.durable.index.commit(&records, || Snapshot {
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
        st.durable.unjournaled.extend(ready);
        return Err(e);
    }
    for key in ready {
        if let Some(b) = st.blobs.get_mut(&key) {
            let old = std::mem::replace(&mut b.durable, b.extent);
            if let Some(old) = old.filter(|&o| Some(o) != b.extent) {
                st.images.release(old.extent);
            }
        }
    }
    for e in std::mem::take(&mut st.durable.pending_free) {
        st.images.release(e);
    }
    st.durable.pending_removes.clear();
    Ok(())
}
