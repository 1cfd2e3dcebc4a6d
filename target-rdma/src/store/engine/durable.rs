//! What the next commit of the index makes durable (see `commit`).

use std::collections::BTreeSet;

use crate::store::ids::BlobKey;
use crate::store::index::Index;

/// What the next commit makes durable, and the index it goes to.
pub(super) struct Durable {
    pub(super) index: Index,
    /// Blobs whose `extent` holds a written-back image the index lacks.
    pub(super) unjournaled: BTreeSet<BlobKey>,
    /// Removed blobs the durable index still names.
    pub(super) pending_removes: Vec<BlobKey>,
    /// Their durable extents, free once the removals are journaled.
    pub(super) pending_free: Vec<u32>,
}

impl Durable {
    /// Nothing pending yet, for `index`.
    pub(super) fn new(index: Index) -> Durable {
        Durable {
            index,
            unjournaled: BTreeSet::new(),
            pending_removes: Vec::new(),
            pending_free: Vec::new(),
        }
    }
}
