//! Leases: a slot pinned for a connection to read (GET) or write (ALLOC)
//! in place by RDMA until COMMIT or RELEASE, the bounds on how many exist,
//! and who gives slots back when every slot is pinned.
//!
//! Fairness between tenants. Each served volume has a share of the arena,
//! `⌊slots / served volumes⌋` leases unless configured. Past its share a
//! volume may still lease free slots, but those leases are the first asked
//! back (REVOKE) when a volume at or under its own share needs a slot and
//! every slot is pinned: that request waits for them rather than being told
//! BUSY. A revoked lease not given back within `revoke_deadline` is ended
//! by force: its slot is unpinned, and the holder's later COMMIT answers
//! LEASE_LOST (a RELEASE is accepted quietly). So a tenant that leases
//! every slot and ignores REVOKE delays another by at most the deadline,
//! and BUSY reaches a volume only when it is over its own share (or when
//! no volume is over its share, i.e. the arena is full with fair use).
//! Each connection may hold at most `connection_max` leases (force-ended
//! ones count until it acknowledges them), which bounds the lease table
//! per client.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::slots::Slots;
use crate::proto::Lease;
use crate::store::error::{LostCause, StoreError};
use crate::store::ids::{BlobKey, HolderId, VolumeId};

/// How leases are shared between tenants (see the `lease` engine module and
/// `docs/PROTOCOL.md`, *Leases and fairness*).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseLimits {
    /// Leases a volume holds before its further leases are the first asked
    /// back for a volume under its own share; `None`: the arena's slots
    /// divided evenly between the served volumes (at least 1).
    pub volume_share: Option<usize>,
    /// Most leases one connection holds at once; `None`: the arena's slots.
    pub connection_max: Option<usize>,
    /// How long a revoked lease may stay out before it is ended by force.
    pub revoke_deadline: std::time::Duration,
}

/// Called once per lease ended by force (holder, token), under the store
/// lock and before the lease's slot is unpinned, so the holder's remote
/// access to the slot (an RDMA key) can be revoked before the slot can
/// go to anyone else. It must not call into the store.
pub type ForceEndHook = Box<dyn Fn(HolderId, u64) + Send + Sync>;

/// Default [`LeaseLimits::revoke_deadline`], milliseconds.
pub const DEFAULT_REVOKE_DEADLINE_MS: u64 = 2000;

impl Default for LeaseLimits {
    fn default() -> Self {
        LeaseLimits {
            volume_share: None,
            connection_max: None,
            revoke_deadline: std::time::Duration::from_millis(DEFAULT_REVOKE_DEADLINE_MS),
        }
    }
}

/// Most leases one `Busy` answer asks back.
const REVOKE_BATCH: usize = 8;
/// Leases allowed per slot on average; bounds the lease table.
const LEASES_PER_SLOT: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LeaseKind {
    Alloc,
    Get,
}

/// One outstanding lease, by token in [`Leases`]' table.
struct LeaseInfo {
    holder: HolderId,
    vol: VolumeId,
    key: u64,
    slot: u32,
    kind: LeaseKind,
    /// When it was asked back.
    revoked: Option<Instant>,
    /// Why it was ended without its holder (its slot is no longer pinned
    /// by it); `None` while live.
    lost: Option<LostCause>,
}

/// The lease table and its accounting per volume and per connection.
pub(super) struct Leases {
    /// By token; tokens grow, so iteration order is age order.
    table: BTreeMap<u64, LeaseInfo>,
    next_token: u64,
    limits: LeaseLimits,
    /// Leases pinning a slot, per volume.
    live: BTreeMap<VolumeId, usize>,
    /// Leases in the table, per connection.
    held: BTreeMap<HolderId, usize>,
    /// Leases ended so far; a waiter that saw the same count knows none
    /// ended since.
    ends: u64,
    /// Leases ended by force.
    forced: u64,
    /// Told of each lease ended by force before its slot is unpinned.
    on_force_end: Option<ForceEndHook>,
    /// Leases asked back and not yet handed to the revoke hook:
    /// (holder, volume, key, token).
    revocations: Vec<(HolderId, VolumeId, u64, u64)>,
    /// Leases asked back so far.
    revoked: u64,
    /// The live leases asked back, by when (and token): the reaper ends
    /// each at its deadline. An entry leaves with its lease, so this never
    /// holds more than the table.
    due: BTreeSet<(Instant, u64)>,
}

impl Leases {
    pub(super) fn new() -> Leases {
        Leases {
            table: BTreeMap::new(),
            next_token: 1,
            limits: LeaseLimits::default(),
            live: BTreeMap::new(),
            held: BTreeMap::new(),
            ends: 0,
            forced: 0,
            on_force_end: None,
            revocations: Vec::new(),
            revoked: 0,
            due: BTreeSet::new(),
        }
    }

    /// Leases in the table.
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// Leases ended by force so far.
    pub(super) fn forced(&self) -> u64 {
        self.forced
    }

    /// Leases ended so far (see [`StoreError::Reclaiming`]).
    pub(super) fn ends(&self) -> u64 {
        self.ends
    }

    /// Leases in the table held by `holder`.
    pub(super) fn held_by(&self, holder: HolderId) -> usize {
        self.held.get(&holder).copied().unwrap_or(0)
    }

    /// Leases pinning a slot of `vol`.
    pub(super) fn live(&self, vol: VolumeId) -> usize {
        self.live.get(&vol).copied().unwrap_or(0)
    }

    /// The leases asked back since the last call, for the revoke hook.
    pub(super) fn take_revocations(&mut self) -> Vec<(HolderId, VolumeId, u64, u64)> {
        std::mem::take(&mut self.revocations)
    }

    /// Leases asked back so far.
    pub(super) fn revoked(&self) -> u64 {
        self.revoked
    }

    pub(super) fn set_limits(&mut self, limits: LeaseLimits) {
        self.limits = limits;
    }

    pub(super) fn set_force_end_hook(&mut self, hook: ForceEndHook) {
        self.on_force_end = Some(hook);
    }

    /// A volume's share: configured, or the arena's `slots` split evenly
    /// between the `served` volumes.
    fn share(&self, slots: usize, served: impl FnOnce() -> usize) -> usize {
        self.limits.volume_share.unwrap_or_else(|| {
            let served = served().max(1);
            (slots / served).max(1)
        })
    }

    /// A new lease of `slot` (of `blob_bytes` bytes) for `holder`.
    pub(super) fn grant(
        &mut self,
        slots: &mut Slots,
        blob_bytes: u32,
        holder: HolderId,
        key: BlobKey,
        slot: u32,
        kind: LeaseKind,
    ) -> Lease {
        let m = &mut slots.meta[slot as usize];
        m.pins += 1;
        if kind == LeaseKind::Alloc {
            m.writers += 1;
            slots.set_dirty(slot, true);
        }
        let l = self;
        let token = l.next_token;
        l.next_token += 1;
        l.table.insert(
            token,
            LeaseInfo {
                holder,
                vol: key.0,
                key: key.1,
                slot,
                kind,
                revoked: None,
                lost: None,
            },
        );
        *l.live.entry(key.0).or_default() += 1;
        *l.held.entry(holder).or_default() += 1;
        Lease::unkeyed(u64::from(slot) * u64::from(blob_bytes), token)
    }

    /// A connection at its limit is refused, and asked back its oldest
    /// lease: a client that caches leases learns to give one up.
    pub(super) fn check_limit(&mut self, slots: usize, holder: HolderId) -> Result<(), StoreError> {
        let limit = slots * LEASES_PER_SLOT;
        if self.len() >= limit {
            return Err(StoreError::LeaseLimit { limit });
        }
        let limit = self.limits.connection_max.unwrap_or(slots);
        if self.held.get(&holder).copied().unwrap_or(0) >= limit {
            let oldest = self
                .table
                .iter()
                .find(|(_, l)| l.holder == holder && l.revoked.is_none() && l.lost.is_none())
                .map(|(&t, _)| t);
            if let Some(t) = oldest {
                self.revoke(t, Instant::now());
            }
            return Err(StoreError::LeaseLimit { limit });
        }
        Ok(())
    }

    /// The lease `token` of `holder`; one revoked and not given back within
    /// the deadline is ended by force first.
    fn find(
        &mut self,
        slots: &mut Slots,
        token: u64,
        holder: HolderId,
    ) -> Result<&LeaseInfo, StoreError> {
        let l = self
            .table
            .get(&token)
            .ok_or(StoreError::UnknownLease { token })?;
        if l.holder != holder {
            return Err(StoreError::LeaseMismatch {
                token,
                detail: format!("belongs to connection {}, not {holder}", l.holder),
            });
        }
        if self.overdue(l, Instant::now()) {
            self.force_end(slots, token);
        }
        self.table
            .get(&token)
            .ok_or(StoreError::UnknownLease { token })
    }

    fn overdue(&self, l: &LeaseInfo, now: Instant) -> bool {
        l.lost.is_none()
            && l.revoked
                .is_some_and(|at| now.duration_since(at) >= self.limits.revoke_deadline)
    }

    /// Unpins a lease's slot.
    fn unpin(&mut self, slots: &mut Slots, slot: u32, kind: LeaseKind, vol: VolumeId) {
        if kind == LeaseKind::Alloc {
            slots.meta[slot as usize].writers -= 1;
            slots.set_dirty(slot, true);
        }
        slots.unpin(slot, false);
        decrement(&mut self.live, vol);
        self.ends += 1;
    }

    /// Ends a revoked lease that was not given back: its slot is unpinned,
    /// the entry stays until its holder commits or releases it.
    fn force_end(&mut self, slots: &mut Slots, token: u64) {
        if self.end_unasked(slots, token, LostCause::Overdue) {
            self.forced += 1;
        }
    }

    /// Ends by force every revoked lease whose deadline has passed at
    /// `now`; how many. The reaper calls it at each deadline, so a holder
    /// that ignores REVOKE loses its remote access on time, not when it
    /// next uses the lease or when its slot is needed.
    pub(super) fn end_overdue(&mut self, slots: &mut Slots, now: Instant) -> usize {
        let mut ended = 0;
        while let Some(&(at, token)) = self.due.first() {
            if now.saturating_duration_since(at) < self.limits.revoke_deadline {
                break;
            }
            self.due.pop_first();
            let before = self.forced;
            self.force_end(slots, token);
            ended += usize::from(self.forced > before);
        }
        ended
    }

    /// When the next revoked lease is due to be ended by force.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.due
            .first()
            .map(|&(at, _)| at + self.limits.revoke_deadline)
    }

    /// Whether leases were asked back since the revoke hook last took
    /// them (the reaper has a new deadline to wait for).
    pub(super) fn revoking(&self) -> bool {
        !self.revocations.is_empty()
    }

    /// Ends lease `token` without its holder: the force-end hook is told
    /// (so its remote access goes) before the slot is unpinned, and the
    /// entry stays, lost for `cause`, until its holder commits or releases
    /// it. `false` when it was not live.
    fn end_unasked(&mut self, slots: &mut Slots, token: u64, cause: LostCause) -> bool {
        let Some(l) = self.table.get_mut(&token) else {
            return false;
        };
        if l.lost.is_some() {
            return false;
        }
        l.lost = Some(cause);
        if let Some(at) = l.revoked {
            self.due.remove(&(at, token));
        }
        let (slot, kind, vol, holder) = (l.slot, l.kind, l.vol, l.holder);
        if let Some(hook) = &self.on_force_end {
            hook(holder, token);
        }
        self.unpin(slots, slot, kind, vol);
        true
    }

    /// Ends every live lease of `holder`, as a raise of its volume's epoch
    /// does to a session it fences out: the slots go back as if RELEASEd
    /// without COMMIT (an ALLOC slot keeps the bytes written into it and
    /// stays dirty), and the holder's later COMMIT of one answers
    /// `LEASE_LOST`. Returns how many were ended.
    pub(super) fn end_holder(&mut self, slots: &mut Slots, holder: HolderId) -> usize {
        let tokens: Vec<u64> = self
            .table
            .iter()
            .filter(|(_, l)| l.holder == holder && l.lost.is_none())
            .map(|(&t, _)| t)
            .collect();
        tokens
            .into_iter()
            .filter(|&t| self.end_unasked(slots, t, LostCause::Fenced))
            .count()
    }

    /// Takes `token` out of the table, unpinning its slot unless it was
    /// ended by force already.
    fn take(&mut self, slots: &mut Slots, token: u64) -> Option<LeaseInfo> {
        let l = self.table.remove(&token)?;
        decrement(&mut self.held, l.holder);
        if let Some(at) = l.revoked {
            self.due.remove(&(at, token));
        }
        if l.lost.is_none() {
            self.unpin(slots, l.slot, l.kind, l.vol);
        }
        Some(l)
    }

    pub(super) fn commit(
        &mut self,
        slots: &mut Slots,
        vol: VolumeId,
        key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        let l = self.find(slots, token, holder)?;
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
        let Some(l) = self.take(slots, token) else {
            return Err(StoreError::UnknownLease { token });
        };
        let cause = match l.lost {
            Some(cause) => cause,
            None if slots.meta[l.slot as usize].owner != Some((vol, key)) => LostCause::Removed,
            None => return Ok(()),
        };
        Err(StoreError::LeaseLost {
            token,
            vol,
            key,
            cause,
        })
    }

    pub(super) fn release(
        &mut self,
        slots: &mut Slots,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.find(slots, token, holder)?;
        self.take(slots, token);
        Ok(())
    }

    pub(super) fn pin(
        &mut self,
        slots: &mut Slots,
        token: u64,
        holder: HolderId,
    ) -> Result<u32, StoreError> {
        let l = self.find(slots, token, holder)?;
        if let Some(cause) = l.lost {
            let (vol, key) = (l.vol, l.key);
            self.take(slots, token);
            return Err(StoreError::LeaseLost {
                token,
                vol,
                key,
                cause,
            });
        }
        let slot = l.slot;
        slots.meta[slot as usize].pins += 1;
        Ok(slot)
    }

    pub(super) fn drop_holder(&mut self, slots: &mut Slots, holder: HolderId) {
        let tokens: Vec<u64> = self
            .table
            .iter()
            .filter(|(_, l)| l.holder == holder)
            .map(|(&t, _)| t)
            .collect();
        for t in tokens {
            self.take(slots, t);
        }
    }

    /// Asks lease `token` back.
    fn revoke(&mut self, token: u64, now: Instant) {
        if let Some(l) = self.table.get_mut(&token) {
            l.revoked = Some(now);
            self.due.insert((now, token));
            self.revocations.push((l.holder, l.vol, l.key, token));
            self.revoked += 1;
        }
    }

    /// Every slot is pinned and `vol` needs one (of the `served` volumes). Ends overdue leases by
    /// force (then the caller looks again), asks back leases held past
    /// their volume's share, oldest first, and tells a requester at or
    /// under its share to wait for them ([`StoreError::Reclaiming`]); any
    /// other requester is told `Busy`.
    pub(super) fn pinned_full(
        &mut self,
        slots: &mut Slots,
        served: impl FnOnce() -> usize,
        vol: VolumeId,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        if self.end_overdue(slots, now) > 0 {
            return Ok(());
        }
        let share = self.share(slots.len(), served);
        let mut excess: BTreeMap<VolumeId, usize> = self
            .live
            .iter()
            .filter(|&(_, &n)| n > share)
            .map(|(&v, &n)| (v, n - share))
            .collect();
        let mut ask = Vec::new();
        let mut reclaim_by: Option<Instant> = None;
        for (&token, l) in &self.table {
            let Some(left) = excess.get_mut(&l.vol).filter(|n| **n > 0) else {
                continue;
            };
            if l.lost.is_some() {
                continue;
            }
            *left -= 1;
            match l.revoked {
                Some(at) => {
                    let due = at + self.limits.revoke_deadline;
                    reclaim_by = Some(reclaim_by.map_or(due, |r| r.min(due)));
                }
                None if ask.len() < REVOKE_BATCH => ask.push(token),
                None => {}
            }
        }
        let under = self.live(vol) <= share;
        if !ask.is_empty() {
            let due = now + self.limits.revoke_deadline;
            reclaim_by = Some(reclaim_by.map_or(due, |r| r.min(due)));
        }
        if reclaim_by.is_none() {
            // Nobody is over their share: ask the oldest leases back.
            ask = self
                .table
                .iter()
                .filter(|(_, l)| l.revoked.is_none() && l.lost.is_none())
                .map(|(&t, _)| t)
                .take(REVOKE_BATCH)
                .collect();
        }
        let revoked = ask.len();
        for t in ask {
            self.revoke(t, now);
        }
        match reclaim_by {
            Some(until) if under => Err(StoreError::Reclaiming {
                until,
                ends: self.ends,
            }),
            _ => Err(StoreError::Busy {
                slots: slots.len(),
                revoked,
            }),
        }
    }
}

fn decrement<K: Ord>(map: &mut BTreeMap<K, usize>, k: K) {
    if let Some(n) = map.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            map.remove(&k);
        }
    }
}
