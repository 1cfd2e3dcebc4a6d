//! Range reads of cold blobs: planned under the store lock (a lookup, never
//! a wait), read without it (on the caller's ring, or awaited on the swap's
//! shared one), and verified against the blob's header and block checksums
//! before any byte is handed out.

use super::{Core, Direct, Guard};
use crate::store::aligned::AlignedBuf;
use crate::store::error::{IntegrityKind, StoreError};
use crate::store::extent::{self, BLOCK};
use crate::store::ids::VolumeId;

impl Core {
    /// The range read from swap of `len` bytes at `offset` of blob `key`,
    /// if the blob is cold and the read is part of it; `None` otherwise
    /// (absent, resident, or a whole-blob read, which faults it in). Never
    /// waits: an error only for a damaged image.
    pub(in crate::store) fn plan_cold(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
    ) -> Result<Option<Direct>, StoreError> {
        g.check_vol(vol)?;
        let key = (vol, key);
        let whole = offset == 0 && len == g.blob_bytes as usize;
        let st = &mut **g;
        let cold = st
            .blobs
            .get(&key)
            .and_then(|b| b.slot.is_none().then_some(b.extent).flatten());
        let Some(placed) = cold.filter(|_| !whole && len > 0) else {
            return Ok(None);
        };
        if let Some(e) = st.damaged_error(key) {
            return Err(e);
        }
        let first = offset as usize / BLOCK;
        let end = (offset as usize + len).div_ceil(BLOCK).max(first + 1);
        // Only a read from the blob's first byte counts toward read-ahead:
        // a stream crossing into this blob does, while random reads that
        // happen to land on consecutive blobs (one in a thousand over a
        // thousand blobs) would each fault whole blobs in for nothing.
        if offset == 0 {
            st.read_ahead.note(key);
        }
        Ok(Some(Direct {
            key,
            placed,
            ident: st.ident(key, placed.version),
            first: first as u32,
            crcs: st.block_crcs(placed.extent, first, end),
        }))
    }

    /// The last read noted toward read-ahead.
    #[cfg(test)]
    pub(in crate::store) fn last_read(&self) -> Option<crate::store::ids::BlobKey> {
        self.state.lock().read_ahead.last()
    }

    /// Runs a planned range read without the lock. `None` when the blob
    /// moved meanwhile (the caller plans again); an integrity error only
    /// when the blob still has that image and no write-back is rewriting
    /// its extent, so a race never passes for damage.
    pub(in crate::store) fn read_direct(
        &self,
        d: &Direct,
    ) -> Result<Option<AlignedBuf>, StoreError> {
        let len = (d.crcs.len() * BLOCK) as u32;
        let buf = self.swap.read_range(d.placed.extent, d.offset(), len)?;
        self.verified(d, buf)
    }

    /// [`Core::read_direct`], its disk read awaited on the swap's shared
    /// ring rather than run on the calling thread.
    pub(in crate::store) async fn read_direct_async(
        &self,
        d: &Direct,
    ) -> Result<Option<AlignedBuf>, StoreError> {
        let len = (d.crcs.len() * BLOCK) as u32;
        let buf = self
            .swap
            .read_range_async(d.placed.extent, d.offset(), len)
            .await?;
        self.verified(d, buf)
    }

    /// A range read's bytes if they verify against the plan's header and
    /// checksums; see [`Core::read_direct`].
    fn verified(&self, d: &Direct, buf: AlignedBuf) -> Result<Option<AlignedBuf>, StoreError> {
        let Some(bad) = extent::first_bad_block(&d.ident, d.first, &buf, &d.crcs) else {
            return Ok(Some(buf));
        };
        self.swap.give_buffer(buf);
        let mut g = self.state.lock();
        let st = &mut *g;
        let unchanged = st.blobs.get(&d.key).is_some_and(|b| {
            b.extent == Some(d.placed)
                && b.slot
                    .is_none_or(|s| st.slots.meta[s as usize].writing != Some(d.placed.extent))
        });
        if !unchanged {
            return Ok(None);
        }
        let block = d.first as usize + bad;
        let offset = self.swap.offset_of(d.placed.extent, block * BLOCK);
        Err(st.integrity_error(
            IntegrityKind::Checksum,
            d.key,
            self.swap.path(),
            d.placed.extent,
            offset,
            format!("block {block} fails its checksum"),
        ))
    }
}
