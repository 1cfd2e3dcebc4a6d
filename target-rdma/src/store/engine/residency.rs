//! Where a blob is now, as the `_now` calls of
//! [`Store`](crate::store::Store) see it under the lock that pins its
//! slot: they do nothing rather than wait when the blob would need the
//! disk.

use super::State;
use crate::store::ids::BlobKey;
use crate::store::residency::Residency;

impl State {
    pub(in crate::store) fn residency(&self, key: BlobKey) -> Residency {
        match self.blobs.get(&key) {
            None => Residency::Absent,
            Some(b) => match b.slot.map(|s| &self.slots.meta[s as usize]) {
                Some(m) if m.loading => Residency::Cold,
                Some(m) if m.writing.is_some() => Residency::WritingBack,
                Some(_) => Residency::Resident,
                None => Residency::Cold,
            },
        }
    }
}
