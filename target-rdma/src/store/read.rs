//! Reads through the store: from a blob's slot when resident, else just the
//! blocks the range covers, straight from swap and verified (blocking, or
//! awaited on the swap's shared ring), or the whole blob faulted in.

use super::engine::ReadPlan;
use super::{Store, StoreError, VolumeId};

impl Store {
    /// Gives the calling thread a swap-read ring of its own, driven by a
    /// task spawned on the thread's current-thread tokio runtime (call it
    /// from within that runtime): [`Store::read_cold_with`] awaited on this
    /// thread submits the reads pushed in one turn of the runtime together
    /// and reaps their completions here, waking no other thread. Without
    /// it a thread's reads use the swap's shared ring and its completion
    /// thread.
    pub fn serve_swap_reads_here(&self) -> Result<(), StoreError> {
        self.core.swap.serve_reads_here()
    }

    /// Reads from blob `key` at `offset`; `Ok(false)` (and zeros) when the
    /// key holds no blob.
    pub fn read(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Result<bool, StoreError> {
        self.read_with(vol, key, offset, out.len(), |bytes| match bytes {
            Some(b) => {
                out.copy_from_slice(b);
                true
            }
            None => {
                out.fill(0);
                false
            }
        })
    }

    /// Hands `len` bytes at `offset` of blob `key` to `f` (`None` when the
    /// key holds no blob), so the server can send them without staging a
    /// copy: straight from its slot when resident, else from a buffer that
    /// read just the aligned blocks covering the range from swap (a 4 KiB
    /// read of a cold blob reads 4 KiB, and does not fault the blob in; a
    /// read of the whole blob does). Bytes from swap are verified first.
    /// A slot stays pinned and read-locked while `f` runs: `f` must not
    /// call back into the store. Concurrent callers do not wait for each
    /// other's disk reads.
    pub fn read_with<R>(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
        f: impl FnOnce(Option<&[u8]>) -> R,
    ) -> Result<R, StoreError> {
        self.check_range(offset, len)?;
        loop {
            match self.fairly(|c, g| c.plan_read(g, vol, key, offset, len))? {
                ReadPlan::Absent => return Ok(f(None)),
                ReadPlan::Slot(slot) => return Ok(self.read_pinned(slot, offset, len, f)),
                ReadPlan::Swap(d) => {
                    let Some(buf) = self.core.read_direct(&d)? else {
                        continue;
                    };
                    let o = (offset - d.offset()) as usize;
                    let r = f(Some(&buf[o..o + len]));
                    self.core.swap.give_buffer(buf);
                    return Ok(r);
                }
            }
        }
    }

    /// Hands `len` bytes at `offset` of pinned `slot` to `f`, then unpins it.
    pub(super) fn read_pinned<R>(
        &self,
        slot: u32,
        offset: u32,
        len: usize,
        f: impl FnOnce(Option<&[u8]>) -> R,
    ) -> R {
        let r = {
            let bytes = self.core.arena.read(slot);
            let o = offset as usize;
            f(Some(&bytes[o..o + len]))
        };
        self.locked(|_, g| g.unpin(slot, false));
        r
    }

    /// [`Store::read_with`] for part of a cold blob, its disk read awaited
    /// on one of the swap's rings (many in flight, no thread held per read)
    /// and verified the same way. `Ok(None)` when the read is not one
    /// (the blob is absent or resident, or the read covers all of it): the
    /// caller reads it with [`Store::read_with`]. Never blocks the caller's
    /// thread on the disk or on another request.
    pub async fn read_cold_with<R>(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, StoreError> {
        self.check_range(offset, len)?;
        loop {
            let Some(d) = self.locked(|c, g| c.plan_cold(g, vol, key, offset, len))? else {
                return Ok(None);
            };
            let Some(buf) = self.core.read_direct_async(&d).await? else {
                continue;
            };
            let o = (offset - d.offset()) as usize;
            let r = f(&buf[o..o + len]);
            self.core.swap.give_buffer(buf);
            return Ok(Some(r));
        }
    }
}
