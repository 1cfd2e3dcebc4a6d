//! The volumes as the engine keeps them: each one's name, quota and blob
//! count, whether it is served, and its on-disk id.

use crate::store::error::StoreError;
use crate::store::extent;
use crate::store::ids::VolumeId;
use crate::store::stats::VolumeUsage;

pub(super) struct Volume {
    pub(super) name: String,
    pub(super) quota: u64,
    pub(super) blobs: u64,
    /// Its blobs with a slot in the arena.
    pub(super) resident: u64,
    /// Its blobs with a complete swap image (a clean resident blob is
    /// both).
    pub(super) on_swap: u64,
    /// Configured (served); a volume found only in the persisted index is
    /// kept, unserved, so its blobs survive.
    pub(super) served: bool,
}

/// The volumes' names, in id order (what a checkpoint records).
pub(super) fn names(volumes: &[Volume]) -> Vec<&str> {
    volumes.iter().map(|v| v.name.as_str()).collect()
}

/// Every volume the engine knows, by id.
pub(super) struct Volumes {
    /// Configured volumes first (their ids are the caller's), then volumes
    /// found only in the persisted index, kept so their blobs survive, then
    /// volumes configured while running (`State::configure_volume`).
    list: Vec<Volume>,
    /// Each volume's on-disk id ([`extent::volume_id`]).
    ids: Vec<u64>,
}

impl Volumes {
    /// `list`, whose on-disk ids are `ids`.
    pub(super) fn new(list: Vec<Volume>, ids: Vec<u64>) -> Volumes {
        Volumes { list, ids }
    }

    /// Volumes known.
    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    /// Volume `vol`.
    pub(super) fn get(&self, vol: VolumeId) -> &Volume {
        &self.list[vol as usize]
    }

    /// Volume `vol`, to change.
    pub(super) fn get_mut(&mut self, vol: VolumeId) -> &mut Volume {
        &mut self.list[vol as usize]
    }

    /// Volume `vol`'s on-disk id ([`extent::volume_id`]).
    pub(super) fn disk_id(&self, vol: VolumeId) -> u64 {
        self.ids[vol as usize]
    }

    /// The volume named `name`.
    pub(super) fn find(&self, name: &str) -> Option<VolumeId> {
        self.list
            .iter()
            .position(|v| v.name == name)
            .map(|i| i as VolumeId)
    }

    /// The volumes' names, in id order.
    pub(super) fn names(&self) -> Vec<&str> {
        names(&self.list)
    }

    /// Every volume's usage, by id; `leases` counts a volume's leases.
    pub(super) fn usage(&self, leases: impl Fn(VolumeId) -> usize) -> Vec<VolumeUsage> {
        self.list
            .iter()
            .enumerate()
            .map(|(id, v)| VolumeUsage {
                name: v.name.clone(),
                served: v.served,
                quota_blobs: v.quota,
                blobs: v.blobs,
                resident: v.resident,
                on_swap: v.on_swap,
                leases: leases(id as VolumeId) as u64,
            })
            .collect()
    }

    /// Volumes served.
    pub(super) fn served(&self) -> usize {
        self.list.iter().filter(|v| v.served).count()
    }

    /// Serves a new volume `name` with a quota of `quota` blobs; its id is
    /// the last.
    pub(super) fn push(&mut self, name: &str, quota: u64) {
        self.list.push(Volume {
            name: name.to_owned(),
            quota,
            blobs: 0,
            resident: 0,
            on_swap: 0,
            served: true,
        });
        self.ids.push(extent::volume_id(name));
    }

    /// Forgets the last volume pushed.
    pub(super) fn pop(&mut self) {
        self.list.pop();
        self.ids.pop();
    }

    /// A request names a served volume (one kept only from the index is not).
    pub(super) fn check(&self, vol: VolumeId) -> Result<(), StoreError> {
        if self.list.get(vol as usize).is_some_and(|v| v.served) {
            Ok(())
        } else {
            Err(StoreError::UnknownVolume {
                vol,
                count: self.served(),
            })
        }
    }
}
