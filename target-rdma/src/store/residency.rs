//! Where a blob is, and the outcome of a call that must not wait for the
//! disk: what arenad's reactor decides by (the `_now` calls of
//! [`Store`](super::Store)).

/// Where a blob is: what the `_now` calls (`Store::write_now` and its
/// kin) decide by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// No blob under the key.
    Absent,
    /// In its slot: served without a disk read.
    Resident,
    /// In its slot, which a write-back is writing to swap (its bytes
    /// locked for reading until the disk write ends): a READ or GET is
    /// served at once, a WRITE or ALLOC waits for the disk.
    WritingBack,
    /// In swap only, or being loaded: serving it may read the disk.
    Cold,
}

/// The outcome of a store call made where it must not wait for the disk.
#[derive(Debug, PartialEq, Eq)]
pub enum Immediate<T> {
    Done(T),
    /// Nothing was done: the blob is not in its slot (serving it would read
    /// swap) or a write-back holds its slot for a disk write.
    WouldWait,
}
