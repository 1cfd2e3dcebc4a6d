//! Write-back: a dirty slot's bytes copied to a swap extent, never the one
//! the durable index names, with the extent's header, so the slot can be
//! reused. Eviction does it on demand when every victim is dirty; the
//! cleaner does it ahead of the CLOCK hand so eviction seldom has to. The
//! I/O (`Core::write_back`) runs without the store lock: a slot being
//! written is pinned and marked `writing` here, and the outcome is settled
//! under the lock again, here too.

use super::blob::Placed;
use super::commit::commit_index;
use super::state::State;
use crate::store::error::StoreError;
use crate::store::extent::Ident;
use crate::store::ids::BlobKey;
use crate::store::swap::Swap;

/// A write-back the store lock has set up: `slot`'s bytes go to `extent`
/// as image `ident`.
pub(super) struct WriteBack {
    pub(super) slot: u32,
    pub(super) key: BlobKey,
    pub(super) extent: u32,
    /// `extent` was free, not the blob's own.
    pub(super) fresh: bool,
    pub(super) ident: Ident,
    /// The slot has ALLOC leases, whose holders may change it by RDMA at any
    /// moment: the image is copied first, so that its checksums and the
    /// bytes written are the same bytes.
    pub(super) copy: bool,
}

impl WriteBack {
    /// Whether writing the slot back needs a fresh extent (its blob has none
    /// of its own that the durable index does not name).
    pub(super) fn needs_fresh(st: &State, slot: u32) -> bool {
        let Some(key) = st.slots.meta[slot as usize].owner else {
            return false;
        };
        let b = &st.blobs[&key];
        !matches!(b.extent, Some(e) if b.durable != Some(e))
    }

    /// Chooses extents for writing back `slots` and puts those slots in
    /// transition. Slots that find no extent are left out (they stay dirty
    /// and resident). With `commit`, commits the index first when extents
    /// are short, since that frees the extents earlier write-backs
    /// superseded; the cleaner does not, so that it never makes unflushed
    /// data durable on its own.
    pub(super) fn plan(
        st: &mut State,
        swap: &Swap,
        slots: &[u32],
        commit: bool,
    ) -> Result<Vec<WriteBack>, StoreError> {
        let need = slots.iter().filter(|&&s| Self::needs_fresh(st, s)).count();
        if commit && st.images.extents.free_count() < need {
            commit_index(st, swap)?;
        }
        let mut plan = Vec::with_capacity(slots.len());
        for &slot in slots {
            let Some(key) = st.slots.meta[slot as usize].owner else {
                continue;
            };
            let b = &st.blobs[&key];
            let (extent, fresh) = match b.extent {
                Some(e) if b.durable != Some(e) => (e.extent, false),
                _ => match st.images.extents.alloc() {
                    Some(e) => (e, true),
                    None => continue,
                },
            };
            let version = st.next_version();
            plan.push(WriteBack {
                slot,
                key,
                extent,
                fresh,
                ident: st.ident(key, version),
                copy: st.slots.meta[slot as usize].writers > 0,
            });
        }
        for w in &plan {
            let m = &mut st.slots.meta[w.slot as usize];
            m.pins += 1;
            m.writing = Some(w.extent);
            // Clean from now on unless changed again before the write ends;
            // ALLOC-leased slots may change at any moment, so stay dirty.
            let writers = m.writers;
            st.slots.set_dirty(w.slot, writers > 0);
        }
        st.transit.slots += plan.len();
        st.transit.writes += plan.len();
        Ok(plan)
    }

    /// Ends the transition of a planned write-back: on success (`crcs`
    /// holds each image's block CRCs) the blob's swap image moves to the
    /// written extent (and, with `evict`, slots still clean and unpinned are
    /// freed); on failure the slot is dirty again and a half-written extent
    /// of its own is dropped.
    pub(super) fn finish(
        st: &mut State,
        plan: &[WriteBack],
        crcs: Option<&[Vec<u32>]>,
        evict: bool,
    ) {
        st.transit.slots -= plan.len();
        st.transit.writes -= plan.len();
        let mut evicted = 0;
        for (i, w) in plan.iter().enumerate() {
            let m = &mut st.slots.meta[w.slot as usize];
            m.pins -= 1;
            m.writing = None;
            if m.owner != Some(w.key) {
                // Removed meanwhile; `drop_blob` left the extent to us.
                st.images.release(w.extent);
                st.slots.free_if_orphaned(w.slot);
                continue;
            }
            if let Some(crcs) = crcs {
                st.images.set_crcs(w.extent, &crcs[i]);
                if let Some(b) = st.blobs.get_mut(&w.key) {
                    let had = b.extent.is_some();
                    b.extent = Some(Placed {
                        extent: w.extent,
                        version: w.ident.version,
                    });
                    st.volumes.get_mut(w.key.0).on_swap += u64::from(!had);
                }
                st.durable.unjournaled.insert(w.key);
                st.counters.write_backs += 1;
                let m = &st.slots.meta[w.slot as usize];
                if evict && m.pins == 0 && !m.dirty {
                    st.evict_slot(w.slot);
                    evicted += 1;
                }
            } else {
                if !w.fresh {
                    // Possibly half-written: the blob no longer has a valid
                    // swap image, only its (dirty) slot.
                    if let Some(b) = st.blobs.get_mut(&w.key) {
                        let had = b.extent.take().is_some();
                        st.volumes.get_mut(w.key.0).on_swap -= u64::from(had);
                    }
                    st.durable.unjournaled.remove(&w.key);
                }
                st.images.release(w.extent);
                st.slots.set_dirty(w.slot, true);
            }
        }
        st.counters.evictions += evicted;
    }
}
