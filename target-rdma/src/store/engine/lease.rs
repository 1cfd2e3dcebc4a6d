//! Leases: a slot pinned for a connection to read (GET) or write (ALLOC)
//! in place by RDMA until COMMIT or RELEASE, the bound on how many exist,
//! and asking the oldest back when every slot is pinned.

use super::{Core, Guard, State};
use crate::proto::Lease;
use crate::store::{BlobKey, HolderId, StoreError, VolumeId};

/// Most leases one `Busy` answer asks back.
const REVOKE_BATCH: usize = 8;
/// Leases allowed per slot on average; bounds the lease table.
const LEASES_PER_SLOT: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeaseKind {
    Alloc,
    Get,
}

/// One outstanding lease, by token in [`State`]'s table.
pub(super) struct LeaseInfo {
    holder: HolderId,
    vol: VolumeId,
    key: u64,
    slot: u32,
    kind: LeaseKind,
    revoked: bool,
}

impl State {
    fn new_lease(&mut self, holder: HolderId, key: BlobKey, slot: u32, kind: LeaseKind) -> Lease {
        let m = &mut self.slots[slot as usize];
        m.pins += 1;
        if kind == LeaseKind::Alloc {
            m.writers += 1;
            self.set_dirty(slot, true);
        }
        let token = self.next_token;
        self.next_token += 1;
        self.leases.insert(
            token,
            LeaseInfo {
                holder,
                vol: key.0,
                key: key.1,
                slot,
                kind,
                revoked: false,
            },
        );
        Lease {
            slot_offset: u64::from(slot) * u64::from(self.blob_bytes),
            token,
        }
    }

    fn check_lease_limit(&self) -> Result<(), StoreError> {
        let limit = self.slots.len() * LEASES_PER_SLOT;
        if self.leases.len() >= limit {
            return Err(StoreError::LeaseLimit { limit });
        }
        Ok(())
    }

    fn find_lease(&self, token: u64, holder: HolderId) -> Result<&LeaseInfo, StoreError> {
        let l = self
            .leases
            .get(&token)
            .ok_or(StoreError::UnknownLease { token })?;
        if l.holder != holder {
            return Err(StoreError::LeaseMismatch {
                token,
                detail: format!("belongs to connection {}, not {holder}", l.holder),
            });
        }
        Ok(l)
    }

    fn end_lease(&mut self, l: &LeaseInfo) {
        if l.kind == LeaseKind::Alloc {
            self.slots[l.slot as usize].writers -= 1;
            self.set_dirty(l.slot, true);
        }
        self.unpin(l.slot, false);
    }

    pub(in crate::store) fn commit(
        &mut self,
        vol: VolumeId,
        key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        let l = self.find_lease(token, holder)?;
        if l.kind != LeaseKind::Alloc {
            return Err(StoreError::LeaseMismatch {
                token,
                detail: "is a GET lease; only an ALLOC lease can be committed".into(),
            });
        }
        if (l.vol, l.key) != (vol, key) {
            return Err(StoreError::LeaseMismatch {
                token,
                detail: format!(
                    "was granted for volume {} key {}, not volume {vol} key {key}",
                    l.vol, l.key
                ),
            });
        }
        let Some(l) = self.leases.remove(&token) else {
            return Err(StoreError::UnknownLease { token });
        };
        let kept = self.slots[l.slot as usize].owner == Some((vol, key));
        self.end_lease(&l);
        if !kept {
            return Err(StoreError::LeaseLost { token, vol, key });
        }
        Ok(())
    }

    pub(in crate::store) fn release(
        &mut self,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.find_lease(token, holder)?;
        if let Some(l) = self.leases.remove(&token) {
            self.end_lease(&l);
        }
        Ok(())
    }

    pub(in crate::store) fn pin_lease(
        &mut self,
        token: u64,
        holder: HolderId,
    ) -> Result<u32, StoreError> {
        let slot = self.find_lease(token, holder)?.slot;
        self.slots[slot as usize].pins += 1;
        Ok(slot)
    }

    pub(in crate::store) fn drop_holder(&mut self, holder: HolderId) {
        let tokens: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.holder == holder)
            .map(|(&t, _)| t)
            .collect();
        for t in tokens {
            if let Some(l) = self.leases.remove(&t) {
                self.end_lease(&l);
            }
        }
    }

    /// Every slot is pinned: asks the oldest leases back.
    pub(super) fn busy(&mut self) -> StoreError {
        let mut revoked = 0;
        for (&token, l) in self.leases.iter_mut() {
            if revoked == REVOKE_BATCH {
                break;
            }
            if !l.revoked {
                l.revoked = true;
                self.revocations.push((l.holder, l.vol, l.key, token));
                revoked += 1;
            }
        }
        self.counters.revocations += revoked as u64;
        StoreError::Busy {
            slots: self.slots.len(),
            revoked,
        }
    }
}

impl Core {
    pub(in crate::store) fn alloc(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Lease, StoreError> {
        g.check_vol(vol)?;
        g.check_lease_limit()?;
        let slot = loop {
            let s = self.resident_or_create(g, (vol, key), false)?.slot();
            if g.slots[s as usize].writing.is_none() {
                break s;
            }
            // A write-back without the lock is checksumming and writing
            // this slot: the holder's RDMA writes must not race it.
            self.settled.wait(g);
        };
        Ok(g.new_lease(holder, (vol, key), slot, LeaseKind::Alloc))
    }

    pub(in crate::store) fn get(
        &self,
        g: &mut Guard<'_>,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Option<Lease>, StoreError> {
        g.check_vol(vol)?;
        g.check_lease_limit()?;
        Ok(self
            .resident(g, (vol, key), false)?
            .map(|s| g.new_lease(holder, (vol, key), s.slot(), LeaseKind::Get)))
    }
}
