//! [`State`], the engine's bookkeeping under the store lock: which blob
//! lives in which slot and extent, each volume's blobs, the version
//! counter, and the mechanisms held as fields of their own types (the
//! slots, the lease table, read-ahead, the pending commit, the slots in
//! transition, the background threads' flags), with what ties them together:
//! dropping a blob, ending a fault-in, counting an integrity error,
//! freeing an extent, the stats.

use std::collections::BTreeMap;
use std::path::Path;
use ublk_metrics::events;

use super::background::Background;
use super::blob::Blob;
use super::durable::Durable;
use super::images::Images;
use super::lease::{ForceEndHook, LeaseKind, LeaseLimits, Leases};
use super::read_ahead::ReadAhead;
use super::slots::Slots;
use super::transit::Transit;
use super::volumes::Volumes;
use crate::proto::Lease;
use crate::store::error::{IntegrityKind, StoreError};
use crate::store::eviction::SlotMeta;
use crate::store::extent::Ident;
use crate::store::format::{Snapshot, Version, MAX_VOLUMES};
use crate::store::hooks::TimingHook;
use crate::store::ids::{BlobKey, HolderId, VolumeId};
use crate::store::residency::Residency;
#[cfg(test)]
use crate::store::stats::BlobCounts;
use crate::store::stats::{StoreStats, VolumeUsage};
use crate::store::swap::Swap;

#[derive(Default)]
pub(super) struct Counters {
    pub(super) evictions: u64,
    pub(super) write_backs: u64,
    pub(super) fault_ins: u64,
    pub(super) flushes: u64,
    /// Reads refused by kind ([`IntegrityKind::index`]).
    pub(super) integrity: [u64; IntegrityKind::COUNT],
}

pub(in crate::store) struct State {
    pub(super) blob_bytes: u32,
    pub(super) generation: u64,
    /// The last write version handed out this run (its seq).
    pub(super) seq: u64,
    pub(super) volumes: Volumes,
    pub(super) blobs: BTreeMap<BlobKey, Blob>,
    pub(super) slots: Slots,
    pub(super) leases: Leases,
    pub(super) durable: Durable,
    pub(super) counters: Counters,
    pub(super) images: Images,
    pub(super) transit: Transit,
    pub(super) background: Background,
    pub(super) read_ahead: ReadAhead,
}

impl State {
    pub(in crate::store) fn generation(&self) -> u64 {
        self.generation
    }

    pub(in crate::store) fn take_revocations(&mut self) -> Vec<(HolderId, VolumeId, u64, u64)> {
        self.leases.take_revocations()
    }

    pub(in crate::store) fn set_lease_limits(&mut self, limits: LeaseLimits) {
        self.leases.set_limits(limits);
    }

    pub(in crate::store) fn set_force_end_hook(&mut self, hook: ForceEndHook) {
        self.leases.set_force_end_hook(hook);
    }

    /// See [`Leases::check_limit`].
    pub(super) fn check_lease_limit(&mut self, holder: HolderId) -> Result<(), StoreError> {
        self.leases.check_limit(self.slots.len(), holder)
    }

    /// See [`Leases::grant`].
    pub(super) fn new_lease(
        &mut self,
        holder: HolderId,
        key: BlobKey,
        slot: u32,
        kind: LeaseKind,
    ) -> Lease {
        self.leases
            .grant(&mut self.slots, self.blob_bytes, holder, key, slot, kind)
    }

    /// See [`Leases::end_holder`].
    pub(in crate::store) fn end_holder(&mut self, holder: HolderId) -> usize {
        self.leases.end_holder(&mut self.slots, holder)
    }

    /// See [`Leases::commit`].
    pub(in crate::store) fn commit(
        &mut self,
        vol: VolumeId,
        key: u64,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.leases.commit(&mut self.slots, vol, key, token, holder)
    }

    /// See [`Leases::release`].
    pub(in crate::store) fn release(
        &mut self,
        token: u64,
        holder: HolderId,
    ) -> Result<(), StoreError> {
        self.leases.release(&mut self.slots, token, holder)
    }

    /// See [`Leases::pin`].
    pub(in crate::store) fn pin_lease(
        &mut self,
        token: u64,
        holder: HolderId,
    ) -> Result<u32, StoreError> {
        self.leases.pin(&mut self.slots, token, holder)
    }

    /// See [`Leases::drop_holder`].
    pub(in crate::store) fn drop_holder(&mut self, holder: HolderId) {
        self.leases.drop_holder(&mut self.slots, holder);
    }

    /// See [`Leases::pinned_full`].
    pub(in crate::store) fn pinned_full(&mut self, vol: VolumeId) -> Result<(), StoreError> {
        let volumes = &self.volumes;
        self.leases
            .pinned_full(&mut self.slots, || volumes.served(), vol)
    }

    pub(super) fn no_space(&self) -> StoreError {
        StoreError::NoSpace {
            slots: self.slots.len(),
            extents: self.images.extents.total(),
        }
    }

    pub(in crate::store) fn stop(&mut self) {
        self.background.stopping = true;
    }

    /// Ends a fault-in's transition; whether the slot still belonged to
    /// `key` (it no longer does when the blob was removed meanwhile). When
    /// the load failed (`ok` false) the slot is given up: free again, the
    /// blob left in swap.
    pub(super) fn finish_load(&mut self, slot: u32, key: BlobKey, ok: bool) -> bool {
        self.transit.slots -= 1;
        let m = &mut self.slots.meta[slot as usize];
        m.loading = false;
        m.pins -= 1;
        let ours = m.owner == Some(key);
        if ours && !ok {
            m.owner = None;
            if let Some(b) = self.blobs.get_mut(&key) {
                b.slot = None;
                self.volumes.get_mut(key.0).resident -= 1;
            }
        }
        self.slots.free_if_orphaned(slot);
        ours
    }

    /// Image `version` of blob `key`, as its extent header states it.
    pub(super) fn ident(&self, key: BlobKey, version: Version) -> Ident {
        Ident {
            volume: self.volumes.disk_id(key.0),
            key: key.1,
            version,
        }
    }

    /// Counts, logs and describes a read refused because its image does not
    /// verify; `offset` is the byte offset of the bad part in `file`.
    pub(super) fn integrity_error(
        &mut self,
        kind: IntegrityKind,
        key: BlobKey,
        file: &Path,
        extent: u32,
        offset: u64,
        detail: String,
    ) -> StoreError {
        self.counters.integrity[kind.index()] += 1;
        let volume = self.volumes.get(key.0).name.clone();
        tracing::warn!(event = events::SWAP_INTEGRITY_ERROR, kind = kind.name(), file = %file.display(), extent, offset, volume = %volume, key = key.1, detail = %detail, "refusing to serve bytes that do not verify");
        StoreError::Integrity {
            kind,
            file: file.to_path_buf(),
            extent,
            offset,
            volume,
            key: key.1,
            detail,
        }
    }

    /// The error for a blob found damaged at open.
    pub(super) fn damaged_error(&mut self, key: BlobKey) -> Option<StoreError> {
        let b = self.blobs.get(&key)?;
        let why = b.damaged.as_deref()?.to_string();
        let extent = b.extent.map_or(0, |p| p.extent);
        let (path, offset) = self.images.header(extent);
        Some(self.integrity_error(IntegrityKind::Header, key, &path, extent, offset, why))
    }

    /// Drops a pin; `wrote` marks the blob dirty (see [`Slots::unpin`]).
    pub(in crate::store) fn unpin(&mut self, slot: u32, wrote: bool) {
        self.slots.unpin(slot, wrote);
    }

    pub(in crate::store) fn remove(
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

    pub(super) fn drop_blob(&mut self, key: BlobKey) {
        let Some(blob) = self.blobs.remove(&key) else {
            return;
        };
        let v = self.volumes.get_mut(key.0);
        v.blobs -= 1;
        v.resident -= u64::from(blob.slot.is_some());
        v.on_swap -= u64::from(blob.extent.is_some());
        // An extent an in-flight write-back targets is freed when that ends.
        let mut writing = None;
        if let Some(s) = blob.slot {
            self.slots.set_dirty(s, false);
            let m = &mut self.slots.meta[s as usize];
            m.owner = None;
            m.referenced = false;
            writing = m.writing;
            self.slots.free_if_orphaned(s);
        }
        match blob.extent {
            Some(e) if blob.extent != blob.durable && writing != Some(e.extent) => {
                self.images.release(e.extent)
            }
            _ => {}
        }
        if let Some(d) = blob.durable {
            self.durable.pending_free.push(d.extent);
            self.durable.pending_removes.push(key);
        }
        self.durable.unjournaled.remove(&key);
    }

    /// The next write version of this run.
    pub(super) fn next_version(&mut self) -> Version {
        self.seq += 1;
        Version {
            generation: self.generation,
            seq: self.seq,
        }
    }

    /// Gives `slot` to `key` pinned and loading: its bytes are filled
    /// without the store lock (a fault-in, or a whole-blob write), and users
    /// wait until that ends.
    pub(super) fn begin_loading(&mut self, slot: u32, key: BlobKey) {
        self.slots.meta[slot as usize] = SlotMeta {
            owner: Some(key),
            pins: 1,
            referenced: true,
            loading: true,
            ..SlotMeta::default()
        };
        self.transit.slots += 1;
    }

    pub(in crate::store) fn set_timing_hook(&mut self, hook: TimingHook) {
        self.durable.index.timing = Some(hook);
    }

    pub(in crate::store) fn volume_usage(&self) -> Vec<VolumeUsage> {
        self.volumes.usage(|vol| self.leases.live(vol))
    }

    /// Each volume's counts from the blobs themselves, to hold the kept
    /// counts to.
    #[cfg(test)]
    pub(in crate::store) fn recounted_usage(&self) -> Vec<BlobCounts> {
        let mut out = vec![(0, 0, 0); self.volumes.len()];
        for (&(vol, _), b) in &self.blobs {
            let c = &mut out[vol as usize];
            c.0 += 1;
            c.1 += u64::from(b.slot.is_some());
            c.2 += u64::from(b.extent.is_some());
        }
        out
    }

    pub(in crate::store) fn leases_held_by(&self, holder: HolderId) -> usize {
        self.leases.held_by(holder)
    }

    pub(in crate::store) fn stats(&self, swap: &Swap) -> StoreStats {
        let mut s = StoreStats {
            slots_total: self.slots.len() as u64,
            leases_held: self.leases.len() as u64,
            revocations: self.leases.revoked(),
            leases_force_ended: self.leases.forced(),
            evictions: self.counters.evictions,
            write_backs: self.counters.write_backs,
            fault_ins: self.counters.fault_ins,
            swap_bytes_read: swap.bytes_read(),
            swap_bytes_written: swap.bytes_written(),
            swap_extents_used: u64::from(self.images.extents.total())
                - self.images.extents.free_count() as u64,
            swap_extents_total: u64::from(self.images.extents.total()),
            flushes: self.counters.flushes,
            journal_records: self.durable.index.journal_records,
            checkpoints: self.durable.index.checkpoints,
            direct_io: swap.direct(),
            integrity_errors: self.counters.integrity,
            ..StoreStats::default()
        };
        self.slots.tally(&mut s);
        s
    }

    /// Whether to wake the cleaner now; notes that it was woken.
    pub(super) fn cleaner_due(&mut self) -> bool {
        self.background.cleaner_due(&self.slots)
    }

    /// Drops a clean unpinned slot's content (its blob stays in swap).
    pub(super) fn evict_slot(&mut self, slot: u32) {
        let m = &mut self.slots.meta[slot as usize];
        debug_assert!(!m.dirty && m.pins == 0);
        if let Some(key) = m.owner.take() {
            if let Some(b) = self.blobs.get_mut(&key) {
                b.slot = None;
                self.volumes.get_mut(key.0).resident -= 1;
            }
        }
        *m = SlotMeta::default();
        self.slots.free.push(slot);
    }

    pub(in crate::store) fn residency(&self, key: BlobKey) -> Residency {
        match self.blobs.get(&key) {
            None => Residency::Absent,
            Some(b) => match b.slot.map(|s| &self.slots.meta[s as usize]) {
                Some(m) if m.loading => Residency::Cold,
                Some(m) if m.writing.is_some() => Residency::WritingBack,
                Some(_) => Residency::Resident,
                None => Residency::Cold,
            },
        }
    }

    /// Serves volume `name` with a quota of `quota` blobs from now on and
    /// returns its id: an existing volume (configured, or kept from the
    /// index) keeps its id and blobs and takes the new quota; a new one is
    /// named in a checkpoint written now, before any journal record can
    /// name it. A quota below the blobs a volume holds refuses new blobs
    /// only.
    pub(in crate::store) fn configure_volume(
        &mut self,
        name: &str,
        quota: u64,
    ) -> Result<VolumeId, StoreError> {
        if let Some(i) = self.volumes.find(name) {
            let v = self.volumes.get_mut(i);
            v.quota = quota;
            v.served = true;
            return Ok(i);
        }
        if self.volumes.len() >= MAX_VOLUMES {
            return Err(StoreError::InvalidConfig {
                key: "volumes",
                detail: format!("the limit of {MAX_VOLUMES} volumes is reached"),
            });
        }
        self.volumes.push(name, quota);
        let names = self.volumes.names();
        let snap = Snapshot {
            generation: self.generation,
            blob_bytes: self.blob_bytes,
            extents: self.images.extents.total(),
            volumes: &names,
            blob_count: self.blobs.values().filter(|b| b.durable.is_some()).count() as u64,
            blobs: self
                .blobs
                .iter()
                .filter_map(|(k, b)| b.durable.map(|d| (k.0, k.1, d.extent, d.version))),
        };
        if let Err(e) = self.durable.index.checkpoint_now(snap) {
            self.volumes.pop();
            return Err(e);
        }
        tracing::info!(event = events::VOLUME_ADDED, volume = %name, quota_blobs = quota);
        Ok((self.volumes.len() - 1) as VolumeId)
    }

    /// See [`Volumes::check`].
    pub(super) fn check_vol(&self, vol: VolumeId) -> Result<(), StoreError> {
        self.volumes.check(vol)
    }
}
