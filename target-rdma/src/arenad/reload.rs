//! SIGHUP in arenad: the config (file and flags) is read again and what
//! can change while sessions run is applied: the log filter and the
//! volumes. A volume added is served, one removed is refused to new
//! sessions (its blobs stay), a quota change holds for new blobs, a
//! volume made confidential (or not) holds for new sessions, and every
//! secret file is read again, so a rotated secret is the one new sessions
//! must prove; sessions already open keep going. Any other
//! changed key is logged as needing a restart. A config, or a secret file,
//! that does not load changes nothing: the running config stays, and the
//! error is logged.

use std::sync::Arc;

use parking_lot::Mutex;
use ublk_metrics::events::LogControl;

use crate::arenad::config::{ArenadConfig, VolumeConfig};
use crate::arenad::events;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::server::{ServedVolume, Server};
use crate::auth::{Secret, SecretError};
use crate::service::config_file::{changes, log_changes, Change};
use crate::store::{Store, StoreError, VolumeSpec};

/// Why a reload changed nothing (or, for `Store`, stopped part way: the
/// volumes configured before the failure are known to the store but not
/// served until a reload succeeds).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The config did not load or validate.
    #[error("{0}")]
    Config(String),
    /// A volume's secret file is unusable.
    #[error("volume {volume:?}: {source}")]
    Secret {
        /// The volume.
        volume: String,
        /// Why.
        source: SecretError,
    },
    /// The store could not take a volume.
    #[error("volume {volume:?}: {source}")]
    Store {
        /// The volume.
        volume: String,
        /// Why.
        source: StoreError,
    },
}

/// Keys a reload applies; a change of any other key (but those of
/// [`RELOADABLE_TABLES`]) is logged as needing a restart.
pub const RELOADABLE: &[&str] = &["log_level"];

/// Arrays of tables a reload applies, every key of every table: the
/// volumes (added, removed, re-quoted, re-keyed, made confidential or
/// not; see [`VolumeChange`]).
pub const RELOADABLE_TABLES: &[&str] = &["volume"];

/// Whether a reload applies a change of `key`, spelled as
/// [`changes`] spells it (`log_level`, `volume[2].quota`).
pub fn applies(key: &str) -> bool {
    RELOADABLE.contains(&key)
        || RELOADABLE_TABLES.iter().any(|t| {
            key.strip_prefix(t)
                .is_some_and(|rest| rest.starts_with('['))
        })
}

/// What a reload did to one volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeChange {
    /// Now served.
    Added(String),
    /// No longer served to new sessions.
    Removed(String),
    /// New quota, in blobs.
    Quota(String, u64),
    /// A new secret (file contents or path).
    Secret(String),
    /// Whether new sessions must be sealed (protocol version 3).
    Confidential(String, bool),
}

impl std::fmt::Display for VolumeChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VolumeChange::Added(v) => write!(f, "volume {v:?} added"),
            VolumeChange::Removed(v) => write!(f, "volume {v:?} no longer served (its blobs stay)"),
            VolumeChange::Quota(v, blobs) => write!(f, "volume {v:?} quota now {blobs} blobs"),
            VolumeChange::Secret(v) => write!(f, "volume {v:?} has a new secret"),
            VolumeChange::Confidential(v, true) => write!(
                f,
                "volume {v:?} is now confidential: new sessions must be sealed (protocol version 3)"
            ),
            VolumeChange::Confidential(v, false) => write!(
                f,
                "volume {v:?} is no longer confidential: new sessions may use protocol version 2"
            ),
        }
    }
}

/// What a reload did.
#[derive(Debug, Default)]
pub struct Reloaded {
    /// Volumes added, removed, re-quoted, re-keyed or made confidential
    /// (or not).
    pub volumes: Vec<VolumeChange>,
    /// Other changes now in force (`log_level`).
    pub applied: Vec<Change>,
    /// Changes that take effect only after a restart.
    pub restart_needed: Vec<Change>,
}

/// The running arenad's reloadable state.
pub struct Runtime {
    log: LogControl,
    store: Arc<Store>,
    server: Arc<Server>,
    obs: Arc<ArenadObservability>,
    /// The config in force (reloadable parts updated by each reload) and
    /// the secrets served.
    running: Mutex<(ArenadConfig, Vec<Secret>)>,
}

/// Reads every volume's secret; the first unusable one is the error.
pub fn read_secrets(volumes: &[VolumeConfig]) -> Result<Vec<Secret>, ReloadError> {
    volumes
        .iter()
        .map(|v| {
            Secret::from_file(&v.secret_file).map_err(|source| ReloadError::Secret {
                volume: v.name.clone(),
                source,
            })
        })
        .collect()
}

/// The volumes of `cfg` as the server serves them, with their store ids.
pub fn served(
    store: &Store,
    cfg: &ArenadConfig,
    secrets: &[Secret],
) -> Result<Vec<ServedVolume>, ReloadError> {
    cfg.volumes
        .iter()
        .zip(secrets)
        .map(|(v, secret)| {
            let quota_blobs = v.quota.div_ceil(cfg.blob_bytes);
            let spec = VolumeSpec {
                name: v.name.clone(),
                quota_blobs,
            };
            let id = store
                .configure_volume(&spec)
                .map_err(|source| ReloadError::Store {
                    volume: v.name.clone(),
                    source,
                })?;
            Ok(ServedVolume {
                name: v.name.clone(),
                secret: secret.clone(),
                id,
                quota_blobs,
                confidential: v.confidential,
            })
        })
        .collect()
}

impl Runtime {
    /// The runtime of an arenad serving `cfg` with `secrets`.
    pub fn new(
        cfg: ArenadConfig,
        secrets: Vec<Secret>,
        log: LogControl,
        store: Arc<Store>,
        server: Arc<Server>,
        obs: Arc<ArenadObservability>,
    ) -> Self {
        Self {
            log,
            store,
            server,
            obs,
            running: Mutex::new((cfg, secrets)),
        }
    }

    /// Applies `new` (the config read again, flags included, or why it
    /// could not be); `Err` leaves the running config in force. Logs what
    /// changed and what needs a restart.
    pub fn reload(&self, new: Result<ArenadConfig, String>) -> Result<Reloaded, ReloadError> {
        let result = self.apply(new);
        if let Err(e) = &result {
            tracing::error!(event = ublk_metrics::events::CONFIG_RELOAD_FAILED, error = %e, "keeping the running configuration");
        }
        result
    }

    /// What a reload of `new` would do, changing nothing (`arenactl
    /// check`): the config and every secret file are read as a reload
    /// reads them.
    pub fn check(&self, new: Result<ArenadConfig, String>) -> Result<Reloaded, ReloadError> {
        let new = new.map_err(ReloadError::Config)?;
        let secrets = read_secrets(&new.volumes)?;
        let running = self.running.lock();
        Ok(plan(&running.0, &running.1, &new, &secrets))
    }

    fn apply(&self, new: Result<ArenadConfig, String>) -> Result<Reloaded, ReloadError> {
        let new = new.map_err(ReloadError::Config)?;
        let secrets = read_secrets(&new.volumes)?;
        let mut running = self.running.lock();
        let (old, old_secrets) = &*running;
        let done = plan(old, old_secrets, &new, &secrets);
        // Volumes with the new blob size would need a restart (refused
        // above as restart_needed); quotas are counted in the running one.
        let mut in_force = old.clone();
        in_force.volumes = new.volumes.clone();
        in_force.log_level = new.log_level.clone();
        let volumes = served(&self.store, &in_force, &secrets)?;
        let count = volumes.len();
        self.server.set_volumes(volumes);
        self.obs.set_volumes(count);
        if !done.applied.is_empty() {
            self.log.apply_log_level(&new.log_level);
        }
        *running = (in_force, secrets);
        drop(running);
        for v in &done.volumes {
            match v {
                VolumeChange::Added(name) => {
                    tracing::info!(event = events::VOLUME_SERVED, volume = %name)
                }
                VolumeChange::Removed(name) => tracing::info!(
                    event = events::VOLUME_UNSERVED,
                    volume = %name,
                    "new sessions are refused; open ones go on; its blobs stay"
                ),
                VolumeChange::Quota(name, blobs) => {
                    tracing::info!(event = events::VOLUME_QUOTA_CHANGED, volume = %name, quota_blobs = blobs)
                }
                VolumeChange::Secret(name) => tracing::info!(
                    event = events::VOLUME_SECRET_CHANGED,
                    volume = %name,
                    "new sessions must prove the new secret; open ones go on"
                ),
                VolumeChange::Confidential(name, confidential) => tracing::info!(
                    event = events::VOLUME_CONFIDENTIAL_CHANGED,
                    volume = %name,
                    confidential,
                    "holds for new sessions; open ones go on"
                ),
            }
        }
        log_changes(&done.applied, &done.restart_needed, "arenad");
        tracing::info!(
            event = ublk_metrics::events::CONFIG_RELOADED,
            volumes = count,
            volume_changes = done.volumes.len(),
            applied = done.applied.len(),
            restart_needed = done.restart_needed.len()
        );
        Ok(done)
    }
}

/// What applying `new` (with `secrets`) over `old` does.
fn plan(
    old: &ArenadConfig,
    old_secrets: &[Secret],
    new: &ArenadConfig,
    secrets: &[Secret],
) -> Reloaded {
    let mut done = Reloaded {
        volumes: volume_changes(old, old_secrets, new, secrets),
        ..Reloaded::default()
    };
    for change in changes(old, new) {
        if !applies(&change.key) {
            done.restart_needed.push(change);
        } else if RELOADABLE.contains(&change.key.as_str()) {
            done.applied.push(change);
        }
        // A volume's keys are reported as `done.volumes`.
    }
    done
}

/// Per volume name: added, removed, quota, secret or confidentiality
/// changed.
fn volume_changes(
    old: &ArenadConfig,
    old_secrets: &[Secret],
    new: &ArenadConfig,
    new_secrets: &[Secret],
) -> Vec<VolumeChange> {
    let find = |cfg: &ArenadConfig, secrets: &[Secret], name: &str| {
        cfg.volumes
            .iter()
            .zip(secrets)
            .find(|(v, _)| v.name == name)
            .map(|(v, s)| (v.clone(), s.clone()))
    };
    let mut out = Vec::new();
    for (v, secret) in new.volumes.iter().zip(new_secrets) {
        match find(old, old_secrets, &v.name) {
            None => out.push(VolumeChange::Added(v.name.clone())),
            Some((was, was_secret)) => {
                let quota = v.quota.div_ceil(old.blob_bytes);
                if quota != was.quota.div_ceil(old.blob_bytes) {
                    out.push(VolumeChange::Quota(v.name.clone(), quota));
                }
                if !secret.same_as(&was_secret) || v.secret_file != was.secret_file {
                    out.push(VolumeChange::Secret(v.name.clone()));
                }
                if v.confidential != was.confidential {
                    out.push(VolumeChange::Confidential(v.name.clone(), v.confidential));
                }
            }
        }
    }
    for v in &old.volumes {
        if !new.volumes.iter().any(|n| n.name == v.name) {
            out.push(VolumeChange::Removed(v.name.clone()));
        }
    }
    out
}
