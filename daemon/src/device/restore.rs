//! Bringing the persisted devices back at start: every one at once, and
//! the replicated ones whose coordinator is not reachable yet again and
//! again in the background, so a restart never needs an operator.

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;
use ublk_metrics::events;

use super::{DeviceError, Manager};

impl Manager {
    /// Re-creates or recovers every persisted device. Failures are logged
    /// and leave the device listed as `failed` for `ublkctl recover`; a
    /// replicated device whose coordinator is not reachable yet (etcd still
    /// connecting, or down) is retried in the background with backoff until
    /// it is, its kernel device held quiesced meanwhile (I/O waits, nothing
    /// fails).
    pub fn restore(self: &Arc<Self>) -> Result<(), DeviceError> {
        let _op = self.ops.lock();
        let mut waiting = Vec::new();
        for spec in self.store.load_all()? {
            let id = spec.id;
            match self.bring_back(spec.clone()) {
                Ok(()) => tracing::info!(event = events::DEVICE_RESTORED, id),
                Err(e) if spec.replicas.is_some() && e.coordinator_unreachable() => {
                    tracing::warn!(event = events::DEVICE_RESTORE_WAITING, id, error = %e);
                    self.insert_failed(spec, &e);
                    waiting.push(id);
                }
                Err(e) => {
                    tracing::error!(event = events::DEVICE_RESTORE_FAILED, id, error = %e);
                    self.insert_failed(spec, &e);
                }
            }
        }
        if !waiting.is_empty() {
            let weak = Arc::downgrade(self);
            std::thread::Builder::new()
                .name("ublkd-restore".into())
                .spawn(move || restore_when_reachable(&weak, waiting))
                .map_err(|source| DeviceError::State {
                    path: PathBuf::from("ublkd-restore thread"),
                    source,
                })?;
        }
        Ok(())
    }
}

/// Retries the restore of `ids` (replicated devices whose coordinator was
/// not reachable) until each is live, deleted, or fails for another reason.
fn restore_when_reachable(manager: &Weak<Manager>, mut ids: Vec<u32>) {
    let mut pause = Duration::from_millis(500);
    while !ids.is_empty() {
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(10));
        let Some(m) = manager.upgrade() else { return };
        ids.retain(|&id| match m.recover(id) {
            Ok(_) => {
                tracing::info!(event = events::DEVICE_RESTORED, id);
                false
            }
            Err(e) if e.coordinator_unreachable() => {
                tracing::debug!(event = events::DEVICE_RESTORE_WAITING, id, error = %e);
                true
            }
            Err(DeviceError::Unknown(_)) => false,
            Err(e) => {
                tracing::error!(event = events::DEVICE_RESTORE_FAILED, id, error = %e);
                false
            }
        });
    }
}
