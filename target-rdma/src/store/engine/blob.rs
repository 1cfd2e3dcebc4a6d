//! The engine's record of a blob: where its bytes are (a slot, a swap
//! image, the image the durable index names).

use crate::store::format::Version;

/// Where a blob's bytes are. Invariant: `slot` or `extent` is set.
pub(super) struct Blob {
    pub(super) slot: Option<u32>,
    /// Its newest complete swap image.
    pub(super) extent: Option<Placed>,
    /// The image the durable index names.
    pub(super) durable: Option<Placed>,
    /// Why its swap image cannot be trusted, found at open (its header is
    /// missing, damaged or names another image): it is never read, and
    /// reads fail until it is rewritten whole, removed or repaired.
    pub(super) damaged: Option<Box<str>>,
}

/// An image in swap: its extent and the write version its header carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Placed {
    pub(super) extent: u32,
    pub(super) version: Version,
}
