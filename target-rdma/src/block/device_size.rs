//! A device's size, shared by every queue's target and the control plane
//! that resizes it (`ublkctl resize`).
//!
//! Each queue checks every request against the size it reads at that
//! moment; the control plane stores a larger size before it tells the
//! kernel, so by the time the kernel sends a request past the old end,
//! every queue accepts it. Only growth reaches a running device: a
//! request checked against the old, smaller size is still inside the new
//! one. (The one store of a smaller value is a rollback when the kernel
//! refused the growth, i.e. the kernel never sent a request past the old
//! end.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A device size in bytes, one value shared by its clones.
#[derive(Clone, Debug, Default)]
pub struct DeviceSize(Arc<AtomicU64>);

impl DeviceSize {
    /// A size of `bytes`, shared by the clones of the result.
    pub fn new(bytes: u64) -> Self {
        Self(Arc::new(AtomicU64::new(bytes)))
    }

    /// The size now.
    pub fn get(&self) -> u64 {
        // Acquire pairs with `set`: a queue that sees the new size also sees
        // what the control plane wrote before it (costs nothing on x86).
        self.0.load(Ordering::Acquire)
    }

    /// Makes `bytes` the size every clone reads from now on.
    pub fn set(&self, bytes: u64) {
        self.0.store(bytes, Ordering::Release);
    }
}

impl From<u64> for DeviceSize {
    fn from(bytes: u64) -> Self {
        Self::new(bytes)
    }
}
