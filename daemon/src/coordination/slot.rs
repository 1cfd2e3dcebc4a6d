//! ublkd's connection to etcd as the daemon holds it: started in the
//! background, so an etcd that is down when ublkd starts delays only what
//! needs it (replicated devices, `ublkctl peer`) and never ublkd itself or
//! its unreplicated devices. Until it is up, every use fails at once with
//! the last start error; no request waits on a lock while etcd is dialled.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use ublk_metrics::events;

use super::config::EtcdConfig;
use super::pool::Coordination;
use super::CoordinationError;

/// Pause between two start attempts.
const RETRY: Duration = Duration::from_secs(2);

/// The coordination service once it is up, or why it is not.
pub struct CoordinationSlot {
    current: RwLock<Result<Arc<Coordination>, String>>,
}

impl CoordinationSlot {
    /// Starts connecting on a thread of its own, retrying every 2 s until
    /// etcd answers and this ublkd holds its writer lease.
    pub fn start(cfg: EtcdConfig, state_dir: PathBuf) -> std::io::Result<Arc<Self>> {
        let slot = Arc::new(Self {
            current: RwLock::new(Err("connecting to etcd".into())),
        });
        let s = Arc::clone(&slot);
        std::thread::Builder::new()
            .name("ublkd-etcd-start".into())
            .spawn(move || loop {
                match Coordination::start(&cfg, &state_dir) {
                    Ok(c) => {
                        tracing::info!(event = events::ETCD_READY, endpoints = ?cfg.endpoints,
                            lease = c.writer().lease_id());
                        *s.current.write() = Ok(Arc::new(c));
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(event = events::ETCD_START_FAILED, error = %e);
                        *s.current.write() = Err(e.to_string());
                        std::thread::sleep(RETRY);
                    }
                }
            })?;
        Ok(slot)
    }

    /// The service, or [`CoordinationError::Unavailable`] with the reason it is
    /// not up yet.
    pub fn get(&self) -> Result<Arc<Coordination>, CoordinationError> {
        self.current
            .read()
            .as_ref()
            .map(Arc::clone)
            .map_err(|detail| CoordinationError::Unavailable {
                what: "start",
                detail: detail.clone(),
            })
    }
}
