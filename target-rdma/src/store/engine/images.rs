//! The swap's extents as the engine sees them: which are free, the table
//! of their headers on disk, and the block CRCs of each one's current
//! image, which every read from swap is checked against.

use std::path::PathBuf;
use std::sync::Arc;
use ublk_metrics::events;

use crate::store::extent::MetaFile;
use crate::store::swap::Extents;

/// The extents, their headers and their images' checksums.
pub(super) struct Images {
    pub(super) extents: Extents,
    /// The extent headers on disk: written by write-backs, cleared when an
    /// extent is freed.
    meta: Arc<MetaFile>,
    /// Block CRCs of every extent's current image, `blocks` per extent.
    crcs: Vec<u32>,
    blocks: usize,
}

impl Images {
    pub(super) fn new(
        extents: Extents,
        meta: Arc<MetaFile>,
        crcs: Vec<u32>,
        blocks: usize,
    ) -> Images {
        Images {
            extents,
            meta,
            crcs,
            blocks,
        }
    }

    /// Blocks per extent.
    pub(super) fn blocks(&self) -> usize {
        self.blocks
    }

    /// The CRCs of blocks `first..end` of `extent`'s image.
    pub(super) fn block_crcs(&self, extent: u32, first: usize, end: usize) -> Vec<u32> {
        let at = extent as usize * self.blocks;
        self.crcs[at + first..at + end].to_vec()
    }

    /// Records the CRCs of `extent`'s new image, one per block.
    pub(super) fn set_crcs(&mut self, extent: u32, crcs: &[u32]) {
        let at = extent as usize * self.blocks;
        self.crcs[at..at + self.blocks].copy_from_slice(crcs);
    }

    /// The extent table and the byte offset of `extent`'s header in it.
    pub(super) fn header(&self, extent: u32) -> (PathBuf, u64) {
        (self.meta.path().to_path_buf(), self.meta.offset(extent))
    }

    /// Gives an extent back to the free list, its header cleared first (so
    /// that repair never resurrects what it held, and before any write-back
    /// can take it).
    pub(super) fn release(&mut self, extent: u32) {
        if let Err(e) = self.meta.clear(extent) {
            tracing::warn!(event = events::EXTENT_HEADER_CLEAR_FAILED, extent, error = %e, "could not clear a freed extent's header; arenad --repair might bring back its old image");
        }
        self.extents.free(extent);
    }
}
