//! Whether a blob is in its slot now: arenad answers a request for a
//! resident blob from the connection's task and sends any other to its
//! blocking pool, so neither a fault-in from swap nor a write-back's disk
//! write (which holds its slot locked for reading) stalls the reactor. The
//! `_now` calls close the gap between that choice and the store call (an
//! eviction, a write-back begun in between): they do nothing rather than
//! wait.

use super::State;
use crate::proto::Lease;
use crate::store::{BlobKey, HolderId, Residency, Store, StoreError, VolumeId};

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

/// The outcome of a store call made where it must not wait for the disk.
#[derive(Debug, PartialEq, Eq)]
pub enum Immediate<T> {
    Done(T),
    /// Nothing was done: the blob is not in its slot (serving it would read
    /// swap) or a write-back holds its slot for a disk write.
    WouldWait,
}

impl Store {
    /// [`Store::write`] of a resident blob, for a caller that must not wait
    /// for the disk (arenad's reactor). [`Store::residency`] is only a hint
    /// by the time the write comes: the blob may have been evicted, or the
    /// cleaner may have begun writing its slot back, since. Both are checked
    /// here, under the lock that pins the slot and on the slot itself.
    pub fn write_now(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> Result<Immediate<()>, StoreError> {
        self.check_range(offset, data.len())?;
        let pinned = self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Resident => c.pin_or_create(g, vol, key, false).map(|s| Some(s.slot())),
            _ => Ok(None),
        })?;
        let Some(slot) = pinned else {
            return Ok(Immediate::WouldWait);
        };
        // The cleaner writes pinned slots back too, holding their bytes
        // for reading across the disk write.
        let wrote = match self.core.arena.try_write(slot) {
            Some(mut bytes) => {
                let o = offset as usize;
                bytes[o..o + data.len()].copy_from_slice(data);
                true
            }
            None => false,
        };
        self.locked(|_, g| g.unpin(slot, wrote));
        Ok(match wrote {
            true => Immediate::Done(()),
            false => Immediate::WouldWait,
        })
    }

    /// [`Store::read_with`] of a blob in its slot (a write-back shares its
    /// bytes) or of no blob, for a caller that must not wait for the disk:
    /// a blob evicted since the caller's check is not faulted in here.
    pub fn read_now<R>(
        &self,
        vol: VolumeId,
        key: u64,
        offset: u32,
        len: usize,
        f: impl FnOnce(Option<&[u8]>) -> R,
    ) -> Result<Immediate<R>, StoreError> {
        self.check_range(offset, len)?;
        let pinned = self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Cold => Ok(None),
            _ => c.pin(g, vol, key).map(Some),
        })?;
        Ok(match pinned {
            None => Immediate::WouldWait,
            Some(None) => Immediate::Done(f(None)),
            Some(Some(slot)) => Immediate::Done(self.read_pinned(slot, offset, len, f)),
        })
    }

    /// [`Store::get`] for a caller that must not wait for the disk.
    pub fn get_now(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Immediate<Option<Lease>>, StoreError> {
        self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Cold => Ok(Immediate::WouldWait),
            _ => c.get(g, vol, key, holder).map(Immediate::Done),
        })
    }

    /// [`Store::alloc`] of a resident blob whose slot no write-back is
    /// writing, for a caller that must not wait for the disk.
    pub fn alloc_now(
        &self,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Immediate<Lease>, StoreError> {
        self.locked(|c, g| match g.residency((vol, key)) {
            Residency::Resident => c.alloc(g, vol, key, holder).map(Immediate::Done),
            _ => Ok(Immediate::WouldWait),
        })
    }
}
