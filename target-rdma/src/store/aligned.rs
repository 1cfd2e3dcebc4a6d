//! Page-aligned buffers of the swap's own, for O_DIRECT range reads and
//! write-back images.

use std::alloc::Layout;
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use super::error::StoreError;
use super::extent::BLOCK;

/// Page-aligned memory for O_DIRECT range reads.
pub(super) struct AlignedBuf {
    ptr: NonNull<u8>,
    pub(super) cap: usize,
    pub(super) len: usize,
}

// SAFETY: the buffer owns its allocation outright; nothing else points to it.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub(super) fn new(cap: usize) -> Result<AlignedBuf, StoreError> {
        let layout =
            Layout::from_size_align(cap.max(BLOCK), BLOCK).map_err(|_| StoreError::Uring {
                source: io::Error::from(io::ErrorKind::InvalidInput),
            })?;
        // SAFETY: the layout has a non-zero size; zeroed memory is a valid
        // `[u8]`, so the buffer never exposes uninitialised bytes.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| StoreError::Uring {
            source: io::Error::from(io::ErrorKind::OutOfMemory),
        })?;
        Ok(AlignedBuf {
            ptr,
            cap: layout.size(),
            len: 0,
        })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this size and alignment.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.cap, BLOCK),
            )
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= cap` bytes of the allocation, initialised (zeroed
        // at allocation, then only written through `&mut`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}
