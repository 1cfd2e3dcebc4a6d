//! Whether a blob is in its slot now: arenad answers a request for a
//! resident blob from the connection's task and sends any other to its
//! blocking pool, so neither a fault-in from swap nor a write-back's disk
//! write (which holds its slot locked for reading) stalls the reactor.

use super::State;
use crate::store::{BlobKey, Residency};

impl State {
    pub(in crate::store) fn residency(&self, key: BlobKey) -> Residency {
        match self.blobs.get(&key) {
            None => Residency::Absent,
            Some(b) => match b.slot.map(|s| &self.slots[s as usize]) {
                Some(m) if m.loading => Residency::Cold,
                Some(m) if m.writing.is_some() => Residency::WritingBack,
                Some(_) => Residency::Resident,
                None => Residency::Cold,
            },
        }
    }
}
