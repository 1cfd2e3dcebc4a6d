//! Whether a blob is in its slot now: arenad answers a request for a
//! resident blob from the connection's task and sends any other to its
//! blocking pool, so a fault-in from swap never stalls the reactor.

use super::State;
use crate::store::{BlobKey, Residency};

impl State {
    pub(in crate::store) fn residency(&self, key: BlobKey) -> Residency {
        match self.blobs.get(&key) {
            None => Residency::Absent,
            Some(b) => match b.slot {
                Some(s) if !self.slots[s as usize].loading => Residency::Resident,
                _ => Residency::Cold,
            },
        }
    }
}
