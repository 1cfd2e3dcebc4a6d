//! The bookkeeping behind the store lock: which blob lives in which slot and
//! extent, leases, eviction, write-back and the durable commit.
//!
//! A blob has up to three homes: a slot (its newest bytes when resident), a
//! swap extent (a complete older or equal image), and the extent the durable
//! index names. Write-back never overwrites the durable extent; it goes to a
//! fresh extent or to the blob's own not-yet-durable one. A commit first
//! syncs the swap file, then journals the new mappings, and only then frees
//! the extents they superseded.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use super::arena::{Arena, SlotRead};
use super::clock::{Clock, SlotMeta};
use super::index::{self, Image, Index, Record, Snapshot};
use super::swap::Swap;
use super::{BlobKey, HolderId, StoreConfig, StoreError, StoreStats, VolumeId, VolumeSpec};
use crate::proto::Lease;

/// Most slots one eviction frees (their write-backs share a submission).
const EVICT_BATCH: usize = 8;
/// Most leases one `Busy` answer asks back.
const REVOKE_BATCH: usize = 8;
/// Leases allowed per slot on average; bounds the lease table.
const LEASES_PER_SLOT: usize = 16;
/// Most write-backs per submission during a flush.
const WRITE_BATCH: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeaseKind {
    Alloc,
    Get,
}

struct LeaseInfo {
    holder: HolderId,
    vol: VolumeId,
    key: u64,
    slot: u32,
    kind: LeaseKind,
    revoked: bool,
}

/// Where a blob's bytes are. Invariant: `slot` or `extent` is set.
struct Blob {
    slot: Option<u32>,
    extent: Option<u32>,
    durable: Option<u32>,
}

struct Volume {
    name: String,
    quota: u64,
    blobs: u64,
}

#[derive(Default)]
struct Counters {
    evictions: u64,
    write_backs: u64,
    fault_ins: u64,
    flushes: u64,
    revocations: u64,
}

pub(super) struct State {
    blob_bytes: u32,
    generation: u64,
    /// Configured volumes first (their ids are the caller's), then volumes
    /// found only in the persisted index, kept so their blobs survive.
    volumes: Vec<Volume>,
    configured: usize,
    blobs: BTreeMap<BlobKey, Blob>,
    slots: Vec<SlotMeta>,
    free_slots: Vec<u32>,
    clock: Clock,
    /// By token; tokens grow, so iteration order is age order.
    leases: BTreeMap<u64, LeaseInfo>,
    next_token: u64,
    swap: Swap,
    index: Index,
    /// Blobs whose `extent` holds a written-back image the index lacks.
    unjournaled: BTreeSet<BlobKey>,
    /// Removed blobs the durable index still names.
    pending_removes: Vec<BlobKey>,
    /// Their durable extents, free once the removals are journaled.
    pending_free: Vec<u32>,
    revocations: Vec<(HolderId, VolumeId, u64, u64)>,
    counters: Counters,
}

fn names(volumes: &[Volume]) -> Vec<&str> {
    volumes.iter().map(|v| v.name.as_str()).collect()
}

impl State {
    pub(super) fn open(
        cfg: &StoreConfig,
        arena: &Arena,
        slots: u32,
        extents: u32,
        specs: &[VolumeSpec],
        image: Option<Image>,
        swap_path: &Path,
    ) -> Result<State, StoreError> {
        let mut volumes: Vec<Volume> = specs
            .iter()
            .map(|v| Volume {
                name: v.name.clone(),
                quota: v.quota_blobs,
                blobs: 0,
            })
            .collect();
        let mut by_name: HashMap<String, u32> = (0..volumes.len() as u32)
            .map(|i| (volumes[i as usize].name.clone(), i))
            .collect();
        let mut blobs = BTreeMap::new();
        let mut used = vec![false; extents as usize];
        let (generation, epoch) = match image {
            None => (0, 0),
            Some(img) => {
                let ids: Vec<u32> = img
                    .volumes
                    .into_iter()
                    .map(|name| {
                        *by_name.entry(name.clone()).or_insert_with(|| {
                            tracing::warn!(event = "volume_not_configured", volume = %name, "keeping the blobs of a persisted volume that is no longer configured");
                            volumes.push(Volume { name, quota: 0, blobs: 0 });
                            (volumes.len() - 1) as u32
                        })
                    })
                    .collect();
                for ((pv, key), extent) in img.blobs {
                    let vol = ids[pv as usize];
                    if std::mem::replace(&mut used[extent as usize], true) {
                        return Err(StoreError::Corrupt {
                            file: cfg.dir.join(index::CKPT_FILE),
                            detail: format!("swap extent {extent} is mapped by two blobs"),
                        });
                    }
                    volumes[vol as usize].blobs += 1;
                    blobs.insert(
                        (vol, key),
                        Blob {
                            slot: None,
                            extent: Some(extent),
                            durable: Some(extent),
                        },
                    );
                }
                (img.generation, img.epoch)
            }
        };
        let swap = Swap::open(
            swap_path,
            cfg.blob_bytes,
            extents,
            &used,
            &mut arena.write(0),
        )?;
        let generation = generation + 1;
        let index = {
            let names = names(&volumes);
            Index::create(
                &cfg.dir,
                epoch + 1,
                extents,
                Snapshot {
                    generation,
                    blob_bytes: cfg.blob_bytes,
                    extents,
                    volumes: &names,
                    blob_count: blobs.len() as u64,
                    blobs: blobs
                        .iter()
                        .filter_map(|(k, b)| b.durable.map(|d| (k.0, k.1, d))),
                },
            )?
        };
        Ok(State {
            blob_bytes: cfg.blob_bytes,
            generation,
            configured: specs.len(),
            volumes,
            blobs,
            slots: vec![SlotMeta::default(); slots as usize],
            free_slots: (0..slots).rev().collect(),
            clock: Clock::default(),
            leases: BTreeMap::new(),
            next_token: 1,
            swap,
            index,
            unjournaled: BTreeSet::new(),
            pending_removes: Vec::new(),
            pending_free: Vec::new(),
            revocations: Vec::new(),
            counters: Counters::default(),
        })
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    pub(super) fn take_revocations(&mut self) -> Vec<(HolderId, VolumeId, u64, u64)> {
        std::mem::take(&mut self.revocations)
    }

    fn check_vol(&self, vol: VolumeId) -> Result<(), StoreError> {
        if (vol as usize) < self.configured {
            Ok(())
        } else {
            Err(StoreError::UnknownVolume {
                vol,
                count: self.configured,
            })
        }
    }

    fn no_space(&self) -> StoreError {
        StoreError::NoSpace {
            slots: self.slots.len(),
            extents: self.swap.total(),
        }
    }

    /// The blob's slot, faulting it in from swap if needed.
    fn resident(&mut self, arena: &Arena, key: BlobKey) -> Result<Option<u32>, StoreError> {
        let Some(blob) = self.blobs.get(&key) else {
            return Ok(None);
        };
        if let Some(s) = blob.slot {
            self.slots[s as usize].referenced = true;
            return Ok(Some(s));
        }
        let extent = blob
            .extent
            .expect("a blob without a slot has a swap extent");
        let slot = self.take_slot(arena)?;
        let read = self.swap.read_extent(extent, &mut arena.write(slot));
        if let Err(e) = read {
            self.free_slots.push(slot);
            return Err(e);
        }
        self.slots[slot as usize] = SlotMeta {
            owner: Some(key),
            referenced: true,
            ..SlotMeta::default()
        };
        if let Some(b) = self.blobs.get_mut(&key) {
            b.slot = Some(slot);
        }
        self.counters.fault_ins += 1;
        Ok(Some(slot))
    }

    /// The blob's slot; a new blob gets a zeroed one, within the quota.
    fn resident_or_create(&mut self, arena: &Arena, key: BlobKey) -> Result<u32, StoreError> {
        if let Some(s) = self.resident(arena, key)? {
            return Ok(s);
        }
        let v = &self.volumes[key.0 as usize];
        if v.blobs >= v.quota {
            return Err(StoreError::QuotaExceeded {
                volume: v.name.clone(),
                quota: v.quota,
            });
        }
        // Swap is the capacity, the arena a cache over it. One extent stays
        // spare so that a dirty slot can always be written back (a commit
        // frees the extent it supersedes), which keeps fault-in possible.
        if self.blobs.len() as u64 + 1 >= u64::from(self.swap.total()) {
            return Err(self.no_space());
        }
        let slot = self.take_slot(arena)?;
        arena.write(slot).fill(0);
        self.slots[slot as usize] = SlotMeta {
            owner: Some(key),
            dirty: true,
            referenced: true,
            ..SlotMeta::default()
        };
        self.blobs.insert(
            key,
            Blob {
                slot: Some(slot),
                extent: None,
                durable: None,
            },
        );
        self.volumes[key.0 as usize].blobs += 1;
        Ok(slot)
    }

    pub(super) fn pin(
        &mut self,
        arena: &Arena,
        vol: VolumeId,
        key: u64,
    ) -> Result<Option<u32>, StoreError> {
        self.check_vol(vol)?;
        let slot = self.resident(arena, (vol, key))?;
        if let Some(s) = slot {
            self.slots[s as usize].pins += 1;
        }
        Ok(slot)
    }

    pub(super) fn pin_or_create(
        &mut self,
        arena: &Arena,
        vol: VolumeId,
        key: u64,
    ) -> Result<u32, StoreError> {
        self.check_vol(vol)?;
        let s = self.resident_or_create(arena, (vol, key))?;
        self.slots[s as usize].pins += 1;
        Ok(s)
    }

    /// Drops a pin; `wrote` marks the blob dirty. A slot whose blob was
    /// removed while pinned becomes free with its last pin.
    pub(super) fn unpin(&mut self, slot: u32, wrote: bool) {
        let m = &mut self.slots[slot as usize];
        m.pins -= 1;
        if m.owner.is_some() {
            m.dirty |= wrote;
        } else if m.pins == 0 {
            *m = SlotMeta::default();
            self.free_slots.push(slot);
        }
    }

    fn new_lease(&mut self, holder: HolderId, key: BlobKey, slot: u32, kind: LeaseKind) -> Lease {
        let m = &mut self.slots[slot as usize];
        m.pins += 1;
        if kind == LeaseKind::Alloc {
            m.writers += 1;
            m.dirty = true;
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

    pub(super) fn alloc(
        &mut self,
        arena: &Arena,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Lease, StoreError> {
        self.check_vol(vol)?;
        self.check_lease_limit()?;
        let slot = self.resident_or_create(arena, (vol, key))?;
        Ok(self.new_lease(holder, (vol, key), slot, LeaseKind::Alloc))
    }

    pub(super) fn get(
        &mut self,
        arena: &Arena,
        vol: VolumeId,
        key: u64,
        holder: HolderId,
    ) -> Result<Option<Lease>, StoreError> {
        self.check_vol(vol)?;
        self.check_lease_limit()?;
        Ok(self
            .resident(arena, (vol, key))?
            .map(|slot| self.new_lease(holder, (vol, key), slot, LeaseKind::Get)))
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
        let m = &mut self.slots[l.slot as usize];
        if l.kind == LeaseKind::Alloc {
            m.writers -= 1;
            if m.owner.is_some() {
                m.dirty = true;
            }
        }
        self.unpin(l.slot, false);
    }

    pub(super) fn commit(
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
            return Err(StoreError::LeaseMismatch {
                token,
                detail: format!("covers volume {vol} key {key}, which was removed while leased; the write is dropped"),
            });
        }
        Ok(())
    }

    pub(super) fn release(&mut self, token: u64, holder: HolderId) -> Result<(), StoreError> {
        self.find_lease(token, holder)?;
        if let Some(l) = self.leases.remove(&token) {
            self.end_lease(&l);
        }
        Ok(())
    }

    pub(super) fn pin_lease(&mut self, token: u64, holder: HolderId) -> Result<u32, StoreError> {
        let slot = self.find_lease(token, holder)?.slot;
        self.slots[slot as usize].pins += 1;
        Ok(slot)
    }

    pub(super) fn drop_holder(&mut self, holder: HolderId) {
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

    pub(super) fn remove(
        &mut self,
        vol: VolumeId,
        start: u64,
        end: u64,
    ) -> Result<u64, StoreError> {
        self.check_vol(vol)?;
        if start >= end {
            return Ok(0);
        }
        let keys: Vec<BlobKey> = self
            .blobs
            .range((vol, start)..(vol, end))
            .map(|(&k, _)| k)
            .collect();
        for &key in &keys {
            self.drop_blob(key);
        }
        Ok(keys.len() as u64)
    }

    fn drop_blob(&mut self, key: BlobKey) {
        let Some(blob) = self.blobs.remove(&key) else {
            return;
        };
        self.volumes[key.0 as usize].blobs -= 1;
        if let Some(s) = blob.slot {
            let m = &mut self.slots[s as usize];
            m.owner = None;
            m.dirty = false;
            m.referenced = false;
            if m.pins == 0 {
                *m = SlotMeta::default();
                self.free_slots.push(s);
            }
        }
        match blob.extent {
            Some(e) if blob.extent != blob.durable => self.swap.free(e),
            _ => {}
        }
        if let Some(d) = blob.durable {
            self.pending_free.push(d);
            self.pending_removes.push(key);
        }
        self.unjournaled.remove(&key);
    }

    fn take_slot(&mut self, arena: &Arena) -> Result<u32, StoreError> {
        if let Some(s) = self.free_slots.pop() {
            return Ok(s);
        }
        self.evict(arena)?;
        self.free_slots.pop().ok_or_else(|| self.no_space())
    }

    /// Whether writing the slot back needs a fresh extent (its blob has none
    /// of its own that the durable index does not name).
    fn needs_fresh(&self, slot: u32) -> bool {
        let Some(key) = self.slots[slot as usize].owner else {
            return false;
        };
        let b = &self.blobs[&key];
        !matches!(b.extent, Some(e) if b.durable != Some(e))
    }

    /// Frees a batch of unpinned slots chosen by CLOCK, writing dirty ones
    /// back first. Dirty victims that find no extent stay resident.
    fn evict(&mut self, arena: &Arena) -> Result<(), StoreError> {
        let want = self.slots.len().div_ceil(8).clamp(1, EVICT_BATCH);
        let victims = self.clock.pick(&mut self.slots, want);
        if victims.is_empty() {
            return Err(self.busy());
        }
        let dirty: Vec<u32> = victims
            .iter()
            .copied()
            .filter(|&s| self.slots[s as usize].dirty)
            .collect();
        let need = dirty.iter().filter(|&&s| self.needs_fresh(s)).count();
        if self.swap.free_count() < need {
            // Superseded durable extents come back once the index moves on.
            self.commit_index()?;
        }
        let mut fresh_left = self.swap.free_count();
        let writable: Vec<u32> = dirty
            .into_iter()
            .filter(|&s| {
                if !self.needs_fresh(s) {
                    return true;
                }
                let ok = fresh_left > 0;
                fresh_left = fresh_left.saturating_sub(1);
                ok
            })
            .collect();
        self.write_back(arena, &writable)?;
        let mut evicted = 0;
        for s in victims {
            let m = &mut self.slots[s as usize];
            if m.dirty {
                continue;
            }
            if let Some(key) = m.owner.take() {
                if let Some(b) = self.blobs.get_mut(&key) {
                    b.slot = None;
                }
            }
            *m = SlotMeta::default();
            self.free_slots.push(s);
            evicted += 1;
        }
        self.counters.evictions += evicted;
        if evicted == 0 {
            return Err(self.no_space());
        }
        Ok(())
    }

    /// Every slot is pinned: asks the oldest leases back.
    fn busy(&mut self) -> StoreError {
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

    /// Writes slots to extents the durable index does not name, several per
    /// submission, and marks them clean (ALLOC-leased ones stay dirty).
    fn write_back(&mut self, arena: &Arena, slots: &[u32]) -> Result<(), StoreError> {
        for chunk in slots.chunks(WRITE_BATCH) {
            let mut plan: Vec<(u32, BlobKey, u32, bool)> = Vec::with_capacity(chunk.len());
            for &s in chunk {
                let key = self.slots[s as usize]
                    .owner
                    .expect("write-back of an occupied slot");
                let b = &self.blobs[&key];
                let (extent, fresh) = match b.extent {
                    Some(e) if b.durable != Some(e) => (e, false),
                    _ => match self.swap.alloc() {
                        Some(e) => (e, true),
                        None => {
                            for &(_, _, e, fresh) in &plan {
                                if fresh {
                                    self.swap.free(e);
                                }
                            }
                            return Err(self.no_space());
                        }
                    },
                };
                plan.push((s, key, extent, fresh));
            }
            let guards: Vec<SlotRead<'_>> = plan.iter().map(|p| arena.read(p.0)).collect();
            let ios: Vec<(u32, &[u8])> =
                plan.iter().zip(&guards).map(|(p, g)| (p.2, &**g)).collect();
            let res = self.swap.write_extents(&ios);
            drop(ios);
            drop(guards);
            if let Err(e) = res {
                for (_, key, extent, fresh) in plan {
                    if !fresh {
                        // Possibly half-written: the blob no longer has a
                        // valid swap image, only its (dirty) slot.
                        if let Some(b) = self.blobs.get_mut(&key) {
                            b.extent = None;
                        }
                        self.unjournaled.remove(&key);
                    }
                    self.swap.free(extent);
                }
                return Err(e);
            }
            for (s, key, extent, _) in plan {
                if let Some(b) = self.blobs.get_mut(&key) {
                    b.extent = Some(extent);
                }
                let m = &mut self.slots[s as usize];
                if m.writers == 0 {
                    m.dirty = false;
                }
                self.unjournaled.insert(key);
                self.counters.write_backs += 1;
            }
        }
        Ok(())
    }

    /// Makes written-back images and removals durable: sync the swap file,
    /// journal the mappings, then free the extents they superseded.
    fn commit_index(&mut self) -> Result<(), StoreError> {
        if self.unjournaled.is_empty() && self.pending_removes.is_empty() {
            return Ok(());
        }
        self.swap.sync()?;
        let mut records = Vec::with_capacity(self.pending_removes.len() + self.unjournaled.len());
        records.extend(
            self.pending_removes
                .iter()
                .map(|&(vol, key)| Record::Remove { vol, key }),
        );
        for &(vol, key) in &self.unjournaled {
            let extent = self.blobs[&(vol, key)]
                .extent
                .expect("an unjournaled blob has a swap image");
            records.push(Record::Put { vol, key, extent });
        }
        self.index.append(&records)?;
        for key in std::mem::take(&mut self.unjournaled) {
            if let Some(b) = self.blobs.get_mut(&key) {
                let old = std::mem::replace(&mut b.durable, b.extent);
                if let Some(old) = old.filter(|&o| Some(o) != b.extent) {
                    self.swap.free(old);
                }
            }
        }
        for e in std::mem::take(&mut self.pending_free) {
            self.swap.free(e);
        }
        self.pending_removes.clear();
        if self.index.wants_checkpoint() {
            let names = names(&self.volumes);
            let snap = Snapshot {
                generation: self.generation,
                blob_bytes: self.blob_bytes,
                extents: self.swap.total(),
                volumes: &names,
                blob_count: self.blobs.values().filter(|b| b.durable.is_some()).count() as u64,
                blobs: self
                    .blobs
                    .iter()
                    .filter_map(|(k, b)| b.durable.map(|d| (k.0, k.1, d))),
            };
            // The journal already holds everything; a failed checkpoint only
            // means a longer replay, so the commit still succeeds.
            if let Err(e) = self.index.checkpoint(snap) {
                tracing::warn!(event = "checkpoint_failed", error = %e, "index checkpoint failed; the journal keeps growing");
            }
        }
        Ok(())
    }

    /// Writes back every dirty slot, leased ones included (their bytes are
    /// in place), and commits the index. Runs in rounds when free extents
    /// are short: each commit frees the extents the last round superseded.
    pub(super) fn flush(&mut self, arena: &Arena) -> Result<(), StoreError> {
        let dirty: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&s| {
                let m = &self.slots[s as usize];
                m.owner.is_some() && m.dirty
            })
            .collect();
        let mut todo = &dirty[..];
        while !todo.is_empty() {
            let mut free = self.swap.free_count();
            let mut n = 0;
            for &s in todo {
                if self.needs_fresh(s) {
                    if free == 0 {
                        break;
                    }
                    free -= 1;
                }
                n += 1;
            }
            if n == 0 {
                self.commit_index()?;
                if self.swap.free_count() == 0 {
                    return Err(self.no_space());
                }
                continue;
            }
            self.write_back(arena, &todo[..n])?;
            todo = &todo[n..];
        }
        self.commit_index()?;
        self.counters.flushes += 1;
        Ok(())
    }

    pub(super) fn stats(&self) -> StoreStats {
        let mut s = StoreStats {
            slots_total: self.slots.len() as u64,
            leases_held: self.leases.len() as u64,
            revocations: self.counters.revocations,
            evictions: self.counters.evictions,
            write_backs: self.counters.write_backs,
            fault_ins: self.counters.fault_ins,
            swap_bytes_read: self.swap.bytes_read,
            swap_bytes_written: self.swap.bytes_written,
            swap_extents_used: u64::from(self.swap.total()) - self.swap.free_count() as u64,
            swap_extents_total: u64::from(self.swap.total()),
            flushes: self.counters.flushes,
            journal_records: self.index.journal_records,
            checkpoints: self.index.checkpoints,
            direct_io: self.swap.direct(),
            ..StoreStats::default()
        };
        for m in &self.slots {
            if m.pins > 0 {
                s.slots_leased += 1;
            } else if m.owner.is_none() {
                s.slots_free += 1;
            } else if m.dirty {
                s.slots_dirty += 1;
            } else {
                s.slots_clean += 1;
            }
        }
        s
    }
}
