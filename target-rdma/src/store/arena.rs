//! The RAM arena: one anonymous mapping split into `blob_bytes` slots.
//!
//! One mapping (not one allocation per slot) so that a transport can register
//! the whole arena as a single memory region and name a slot by its offset.
//! Slots are page-aligned because the mapping is and `blob_bytes` is a
//! multiple of 4 KiB, which is what lets O_DIRECT swap I/O run straight from
//! and into slot memory.
//!
//! Every Rust-side access to a slot's bytes goes through that slot's lock, so
//! a connection copying into a pinned slot never aliases a write-back reading
//! it.

use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The slot memory and one lock per slot.
pub(super) struct Arena {
    base: NonNull<u8>,
    len: usize,
    slot_bytes: usize,
    locks: Box<[RwLock<()>]>,
}

// SAFETY: the mapping is plain process memory owned by `Arena` for its whole
// life, and all access to slot bytes is serialized by the per-slot locks.
unsafe impl Send for Arena {}
// SAFETY: as above; shared references only hand out slot bytes under a lock.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `slots * slot_bytes` bytes of zeroed anonymous memory.
    pub(super) fn new(slots: usize, slot_bytes: usize) -> io::Result<Arena> {
        let len = slots
            .checked_mul(slot_bytes)
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: an anonymous private mapping with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Arena {
            base,
            len,
            slot_bytes,
            locks: (0..slots).map(|_| RwLock::new(())).collect(),
        })
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        let i = slot as usize;
        assert!(i < self.locks.len(), "slot {i} outside the arena");
        // SAFETY: i < slots, so the offset stays inside the mapping of
        // slots * slot_bytes bytes.
        unsafe { self.base.as_ptr().add(i * self.slot_bytes) }
    }

    /// Shared access to a slot's bytes; waits for a writer to finish.
    pub(super) fn read(&self, slot: u32) -> SlotRead<'_> {
        let guard = self.locks[slot as usize].read();
        // SAFETY: the slot lies inside the live mapping (slot_ptr checks the
        // index), slots do not overlap, and the read lock held in the guard
        // excludes every mutable access to this slot while the slice lives.
        let bytes = unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), self.slot_bytes) };
        SlotRead {
            _guard: guard,
            bytes,
        }
    }

    /// Exclusive access to a slot's bytes.
    pub(super) fn write(&self, slot: u32) -> SlotWrite<'_> {
        self.exclusive(slot, self.locks[slot as usize].write())
    }

    /// Exclusive access to a slot's bytes if nobody holds them now (a
    /// write-back holds them for its disk write).
    pub(super) fn try_write(&self, slot: u32) -> Option<SlotWrite<'_>> {
        let guard = self.locks[slot as usize].try_write()?;
        Some(self.exclusive(slot, guard))
    }

    fn exclusive<'a>(&'a self, slot: u32, guard: RwLockWriteGuard<'a, ()>) -> SlotWrite<'a> {
        // SAFETY: the slot lies inside the live mapping, slots do not
        // overlap, and `guard` is this slot's write lock, held while the
        // slice lives, which excludes every other access to it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot), self.slot_bytes) };
        SlotWrite {
            _guard: guard,
            bytes,
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in `new`, and no slot
        // guard can outlive `self` (they borrow it).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// A slot's bytes under its read lock.
pub(super) struct SlotRead<'a> {
    _guard: RwLockReadGuard<'a, ()>,
    bytes: &'a [u8],
}

impl Deref for SlotRead<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

/// A slot's bytes under its write lock.
pub(super) struct SlotWrite<'a> {
    _guard: RwLockWriteGuard<'a, ()>,
    bytes: &'a mut [u8],
}

impl Deref for SlotWrite<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for SlotWrite<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}
