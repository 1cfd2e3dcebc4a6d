//! Whether a blob is in its slot now, decided where its slot is pinned:
//! arenad makes a READ, GET, WRITE or ALLOC on the connection's task
//! through the `_now` calls here, which do nothing rather than wait when
//! the blob would need the disk (a fault-in from swap, or a write-back's
//! disk write, which holds its slot locked for reading), and the request
//! then goes to the blocking pool: the reactor never waits for the disk. A
//! check made before the call could change before it.

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
    /// for the disk (arenad's reactor). Residency is checked here, under
    /// the lock that pins the slot, and then on the slot itself: the
    /// cleaner may begin writing a pinned slot back.
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
