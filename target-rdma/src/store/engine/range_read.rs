//! Range reads of cold blobs: planned under the store lock (a lookup, never
//! a wait), read without it (on the caller's ring, or awaited on the swap's
//! shared one), and verified against the blob's header and block checksums
//! before any byte is handed out.

use super::blob::Placed;
use super::shared::{Core, Guard};
use crate::store::aligned::AlignedBuf;
use crate::store::error::{IntegrityKind, StoreError};
use crate::store::extent::{self, Ident, BLOCK};
use crate::store::ids::{BlobKey, VolumeId};

/// How a read is served, decided under the store lock.
pub(in crate::store) enum ReadPlan {
    /// The key holds no blob.
    Absent,
    /// From this (pinned) slot.
    Slot(u32),
    /// Straight from swap, without faulting the blob in.
    Swap(Direct),
}

impl ReadPlan {
    /// How to serve a read of `len` bytes at `offset` of blob `key`: from
    /// its slot (pinned; faulted in when the read covers the whole blob), or,
    /// for part of a blob that is not resident, straight from swap.
    pub(in crate::store) fn plan(
        core: &Core,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
    ) -> Result<ReadPlan, StoreError> {
        if let Some(d) = Direct::plan(g, vol, key, offset, len)? {
            return Ok(ReadPlan::Swap(d));
        }
        Ok(match core.pin(g, vol, key)? {
            Some(s) => ReadPlan::Slot(s),
            None => ReadPlan::Absent,
        })
    }
}

/// A range read of a cold blob: the aligned blocks covering the request,
/// and what they must check against.
pub(in crate::store) struct Direct {
    key: BlobKey,
    placed: Placed,
    ident: Ident,
    first: u32,
    crcs: Vec<u32>,
}

impl Direct {
    /// The range read from swap of `len` bytes at `offset` of blob `key`,
    /// if the blob is cold and the read is part of it; `None` otherwise
    /// (absent, resident, or a whole-blob read, which faults it in). Never
    /// waits: an error only for a damaged image.
    pub(in crate::store) fn plan(
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
            crcs: st.images.block_crcs(placed.extent, first, end),
        }))
    }

    /// Runs a planned range read without the lock. `None` when the blob
    /// moved meanwhile (the caller plans again); an integrity error only
    /// when the blob still has that image and no write-back is rewriting
    /// its extent, so a race never passes for damage.
    pub(in crate::store) fn read(&self, core: &Core) -> Result<Option<AlignedBuf>, StoreError> {
        let (extent, offset, len) = self.range();
        let buf = core.swap.read_range(extent, offset, len)?;
        self.verified(core, buf)
    }

    /// [`Direct::read`], its disk read awaited on the swap's shared
    /// ring rather than run on the calling thread.
    pub(in crate::store) async fn read_async(
        &self,
        core: &Core,
    ) -> Result<Option<AlignedBuf>, StoreError> {
        let (extent, offset, len) = self.range();
        let buf = core.swap.read_range_async(extent, offset, len).await?;
        self.verified(core, buf)
    }

    /// Hands the `len` bytes at `offset` of the blob, read into `buf`, to
    /// `f`, then gives the buffer back to the swap.
    pub(in crate::store) fn serve<R>(
        &self,
        core: &Core,
        buf: AlignedBuf,
        offset: u32,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> R {
        let o = (offset - self.offset()) as usize;
        let r = f(&buf[o..o + len]);
        core.swap.give_buffer(buf);
        r
    }

    /// Byte offset of the read's first block in its blob.
    fn offset(&self) -> u32 {
        self.first * BLOCK as u32
    }

    /// What to read from swap: the extent, and the offset and length in it
    /// of the blocks covering the request.
    fn range(&self) -> (u32, u32, u32) {
        let len = (self.crcs.len() * BLOCK) as u32;
        (self.placed.extent, self.offset(), len)
    }

    /// A range read's bytes if they verify against the plan's header and
    /// checksums; see [`Direct::read`].
    fn verified(&self, core: &Core, buf: AlignedBuf) -> Result<Option<AlignedBuf>, StoreError> {
        let Some(bad) = extent::first_bad_block(&self.ident, self.first, &buf, &self.crcs) else {
            return Ok(Some(buf));
        };
        core.swap.give_buffer(buf);
        let mut g = core.state.lock();
        let st = &mut *g;
        let unchanged = st.blobs.get(&self.key).is_some_and(|b| {
            b.extent == Some(self.placed)
                && b.slot
                    .is_none_or(|s| st.slots.meta[s as usize].writing != Some(self.placed.extent))
        });
        if !unchanged {
            return Ok(None);
        }
        let block = self.first as usize + bad;
        let offset = core.swap.offset_of(self.placed.extent, block * BLOCK);
        Err(st.integrity_error(
            IntegrityKind::Checksum,
            self.key,
            core.swap.path(),
            self.placed.extent,
            offset,
            format!("block {block} fails its checksum"),
        ))
    }
}
