//! The per-key guard between rebuild copies and writes.
//!
//! All writes of the volume go through this one writer process (the
//! lease), so an in-process lock per key is enough. While the view has a
//! syncing member, a write holds its key's lock (a remove, every key's)
//! while it is sent to the members, and the copy of a key holds it from the
//! read on the healthy member to the write on the new one. So for each key,
//! the copy and the writes that reach the new member are serialized: a copy
//! cannot overwrite a newer write, and a write that began under an older
//! view (without the new member) is sent again under the lock before it is
//! acknowledged (the acknowledgement rule).

use std::ops::Range;

use futures::lock::{Mutex as AsyncMutex, MutexGuard};

/// Lock stripes of the per-key guard.
const STRIPES: usize = 64;

/// The per-key guard: one lock per stripe of keys.
pub(super) struct KeyLocks {
    stripes: Vec<AsyncMutex<()>>,
}

impl Default for KeyLocks {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| AsyncMutex::new(())).collect(),
        }
    }
}

impl KeyLocks {
    /// Locks the stripes of `keys` (all of them for a range wider than one
    /// key), in stripe order so two holders never wait on each other.
    pub(super) async fn lock(&self, keys: &Range<u64>) -> Vec<MutexGuard<'_, ()>> {
        let one = keys.end.saturating_sub(keys.start) == 1;
        let mut guards = Vec::new();
        for (i, s) in self.stripes.iter().enumerate() {
            if !one || i as u64 == keys.start % STRIPES as u64 {
                guards.push(s.lock().await);
            }
        }
        guards
    }
}
