//! Volumes configured while the store runs (arenad's SIGHUP): a new volume
//! must be named in the index before a journal record can refer to it.

use super::{names, State, Volume};
use crate::store::error::StoreError;
use crate::store::extent;
use crate::store::format::{Snapshot, MAX_VOLUMES};
use crate::store::ids::VolumeId;

impl State {
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
        if let Some(i) = self.volumes.iter().position(|v| v.name == name) {
            let v = &mut self.volumes[i];
            v.quota = quota;
            v.served = true;
            return Ok(i as VolumeId);
        }
        if self.volumes.len() >= MAX_VOLUMES {
            return Err(StoreError::InvalidConfig {
                key: "volumes",
                detail: format!("the limit of {MAX_VOLUMES} volumes is reached"),
            });
        }
        self.volumes.push(Volume {
            name: name.to_owned(),
            quota,
            blobs: 0,
            served: true,
        });
        self.vol_ids.push(extent::volume_id(name));
        let names = names(&self.volumes);
        let snap = Snapshot {
            generation: self.generation,
            blob_bytes: self.blob_bytes,
            extents: self.extents.total(),
            volumes: &names,
            blob_count: self.blobs.values().filter(|b| b.durable.is_some()).count() as u64,
            blobs: self
                .blobs
                .iter()
                .filter_map(|(k, b)| b.durable.map(|d| (k.0, k.1, d.extent, d.version))),
        };
        if let Err(e) = self.index.checkpoint_now(snap) {
            self.volumes.pop();
            self.vol_ids.pop();
            return Err(e);
        }
        tracing::info!(event = "volume.added", volume = %name, quota_blobs = quota);
        Ok((self.volumes.len() - 1) as VolumeId)
    }

    /// A request names a served volume (one kept only from the index is not).
    pub(super) fn check_vol(&self, vol: VolumeId) -> Result<(), StoreError> {
        if self.volumes.get(vol as usize).is_some_and(|v| v.served) {
            Ok(())
        } else {
            Err(StoreError::UnknownVolume {
                vol,
                count: self.volumes.iter().filter(|v| v.served).count(),
            })
        }
    }
}
