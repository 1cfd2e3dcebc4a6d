//! The vocabulary shared by the store's on-disk files (checkpoint, journal,
//! extent table): the format version, a blob image's write version, the
//! index records and snapshots, and how file errors are reported. A leaf:
//! the file modules build on it and it builds on none of them.

use std::collections::BTreeMap;

/// The on-disk format of the checkpoint, the journal and the extent table.
pub(super) const FORMAT_VERSION: u32 = 2;
/// Most volumes a checkpoint may name; bounds what a corrupt header can make
/// us allocate.
pub(super) const MAX_VOLUMES: usize = 1 << 16;

/// One change to the durable index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Record {
    Put {
        vol: u32,
        key: u64,
        extent: u32,
        version: Version,
    },
    Remove {
        vol: u32,
        key: u64,
    },
}

/// What a checkpoint plus its journal say.
pub(super) struct Image {
    pub(super) generation: u64,
    pub(super) epoch: u64,
    pub(super) volumes: Vec<String>,
    /// (persisted volume number, key) -> (extent, version of its image).
    pub(super) blobs: BTreeMap<(u32, u64), (u32, Version)>,
    /// Swap extents when the checkpoint was written: the swap file and its
    /// extent table must be at least that long.
    pub(super) extents: u32,
}

/// Which write of a blob an image is: the store generation (one per run of
/// arenad) that wrote it, then the order within that run. Totally ordered,
/// so repair can keep the newest image of each blob; never reused, so an
/// index naming an older write than the extent holds is caught.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// The store generation of the write.
    pub generation: u64,
    /// Its order within that generation, from 1.
    pub seq: u64,
}

/// What a checkpoint records.
pub(super) struct Snapshot<'a, I> {
    pub(super) generation: u64,
    pub(super) blob_bytes: u32,
    pub(super) extents: u32,
    pub(super) volumes: &'a [&'a str],
    pub(super) blob_count: u64,
    /// (volume, key, extent, version), `blob_count` of them.
    pub(super) blobs: I,
}
