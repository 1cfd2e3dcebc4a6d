//! The etcd-backed coordination service of one ublkd: the connection, its
//! writer lease, the placement pool and the volumes' memberships, as the
//! device manager and the control socket use them.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use super::config::EtcdConfig;
use super::etcd::{Etcd, Expect, TxnOutcome, Versioned};
use super::placement;
use super::records::{Keys, MembershipRecord, PeerRecord};
use super::volume::{EpochChanges, EtcdVolume};
use super::writer::{VolumeWriter, WriterLease};
use super::CoordinationError;
use ublk_metrics::events;
use ublk_metrics::CoordinationStats;

/// A membership as read, with the revision a swap must be conditioned on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revisioned<T> {
    /// The record.
    pub record: T,
    /// The key's `mod_revision`.
    pub revision: i64,
}

/// Connection, lease, pool and memberships.
pub struct Coordination {
    // Dropped first: its lock on the state dir goes with it.
    lease: WriterLease,
    etcd: Arc<Etcd>,
    keys: Keys,
    changes: Arc<EpochChanges>,
}

fn parse<T: serde::de::DeserializeOwned>(key: &str, v: &Versioned) -> Result<T, CoordinationError> {
    serde_json::from_slice(&v.value).map_err(|e| CoordinationError::Corrupt {
        key: key.to_owned(),
        detail: e.to_string(),
    })
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

impl Coordination {
    /// Connects, and takes (or adopts) this ublkd's writer lease.
    pub fn start(cfg: &EtcdConfig, state_dir: &Path) -> Result<Self, CoordinationError> {
        let etcd = Etcd::connect(cfg)?;
        let lease = WriterLease::start(&etcd, cfg, state_dir)?;
        Ok(Self {
            keys: Keys::new(etcd.prefix()),
            etcd,
            lease,
            changes: Arc::default(),
        })
    }

    /// The writer lease.
    pub fn writer(&self) -> &WriterLease {
        &self.lease
    }

    /// Epoch changes made by this ublkd, by reason.
    pub fn epoch_changes(&self) -> &EpochChanges {
        &self.changes
    }

    /// What the coordination metrics export.
    pub fn stats(&self) -> CoordinationStats {
        CoordinationStats {
            epoch_changes: self.changes.all(),
            leases_lost: self.lease.leases_lost(),
            lease_valid: self
                .lease
                .valid_until()
                .is_some_and(|t| t > std::time::Instant::now()),
        }
    }

    /// Takes `volume`'s writer key and returns its coordinator for the
    /// replication core. A volume etcd does not know yet is created on
    /// `peers` (epoch 1, `size` bytes); a known one keeps its stored
    /// membership, which is authoritative after a restart or a move, and
    /// `peers` is then ignored.
    pub fn open_volume(
        &self,
        volume: &str,
        peers: &[String],
        size: u64,
    ) -> Result<EtcdVolume, CoordinationError> {
        let writer = self.lease.acquire(volume)?;
        let key = self.keys.membership(volume);
        if Etcd::wait(self.etcd.get(key.clone()))?.is_none() {
            let record = MembershipRecord::created(peers, size)
                .map_err(|e| CoordinationError::Invalid(format!("volume {volume:?}: {e}")))?;
            if let TxnOutcome::Done(_) =
                Etcd::wait(
                    self.etcd
                        .put_if(key.clone(), json(&record), Expect::Absent, None),
                )?
            {
                self.changes.record(super::EpochReason::Created);
                tracing::info!(event = events::MEMBERSHIP_CREATED, volume, membership = %record.membership);
            }
        }
        Ok(self.coordinator(volume, key, writer))
    }

    /// `volume`'s coordinator over its membership `key`, as writer or
    /// standby by `writer`.
    fn coordinator(&self, volume: &str, key: String, writer: Arc<VolumeWriter>) -> EtcdVolume {
        EtcdVolume::new(
            Arc::clone(&self.etcd),
            key,
            self.keys.writer(volume),
            writer,
            Arc::clone(&self.changes),
        )
    }

    /// A standby's coordinator of `volume`, which another ublkd serves (or
    /// served): no writer key until the core takes the role by a hand-over.
    /// The volume must have a record.
    pub fn open_standby(&self, volume: &str) -> Result<EtcdVolume, CoordinationError> {
        let key = self.keys.membership(volume);
        if Etcd::wait(self.etcd.get(key.clone()))?.is_none() {
            return Err(CoordinationError::Invalid(format!(
                "volume {volume:?} has no record in etcd: a standby follows a volume another \
                 ublkd serves; add it there first"
            )));
        }
        let writer = self.lease.standby(volume)?;
        Ok(self.coordinator(volume, key, writer))
    }

    /// The etcd connection.
    pub fn etcd(&self) -> &Arc<Etcd> {
        &self.etcd
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The registered peers, by id.
    pub fn peers(&self) -> Result<Vec<PeerRecord>, CoordinationError> {
        let prefix = self.keys.peers();
        Etcd::wait(self.etcd.list(prefix))?
            .iter()
            .map(|(k, v)| parse(k, v))
            .collect()
    }

    /// The registered peers with the bytes placed on each.
    pub fn peer_usage(&self) -> Result<Vec<(PeerRecord, u64)>, CoordinationError> {
        let pool = self.peers()?;
        let placed = self.memberships()?;
        let used = placement::used_bytes(placed.iter().map(|(_, m)| &m.record));
        Ok(pool
            .into_iter()
            .map(|p| {
                let u = used.get(&p.id).copied().unwrap_or(0);
                (p, u)
            })
            .collect())
    }

    /// Registers a peer; an id already registered is refused.
    pub fn add_peer(&self, p: &PeerRecord) -> Result<(), CoordinationError> {
        p.validate().map_err(CoordinationError::Invalid)?;
        let key = self.keys.peer(&p.id);
        match Etcd::wait(self.etcd.put_if(key.clone(), json(p), Expect::Absent, None))? {
            TxnOutcome::Done(_) => Ok(()),
            TxnOutcome::Conflict(cur) => {
                let cur: Option<PeerRecord> = cur.map(|v| parse(&key, &v)).transpose()?;
                Err(CoordinationError::Invalid(format!(
                    "peer {:?} is already registered ({}); `ublkctl peer del {}` first to change it",
                    p.id,
                    cur.map_or_else(String::new, |c| c.addr),
                    p.id
                )))
            }
        }
    }

    /// Unregisters a peer; refused while a volume still lists it.
    pub fn remove_peer(&self, id: &str) -> Result<(), CoordinationError> {
        let holding: Vec<String> = self
            .memberships()?
            .into_iter()
            .filter(|(_, m)| m.record.placed().any(|mm| mm.peer == id))
            .map(|(v, _)| v)
            .collect();
        if !holding.is_empty() {
            return Err(CoordinationError::Invalid(format!(
                "peer {id:?} still holds replicas of {} volume(s): {}; move them first",
                holding.len(),
                holding.join(", ")
            )));
        }
        let key = self.keys.peer(id);
        let Some(cur) = Etcd::wait(self.etcd.get(key.clone()))? else {
            return Err(CoordinationError::Invalid(format!(
                "no peer {id:?} is registered (see `ublkctl peer list`)"
            )));
        };
        match Etcd::wait(self.etcd.delete_if(key, Expect::Revision(cur.mod_revision)))? {
            TxnOutcome::Done(_) => Ok(()),
            TxnOutcome::Conflict(_) => Err(CoordinationError::Invalid(format!(
                "peer {id:?} changed while it was being removed; try again"
            ))),
        }
    }

    /// Every volume's membership, by volume key (encoded name).
    pub fn memberships(
        &self,
    ) -> Result<Vec<(String, Revisioned<MembershipRecord>)>, CoordinationError> {
        let prefix = self.keys.volumes();
        let mut out = Vec::new();
        for (k, v) in Etcd::wait(self.etcd.list(prefix.clone()))? {
            let Some(volume) = k
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix("/membership"))
            else {
                continue;
            };
            out.push((
                volume.to_owned(),
                Revisioned {
                    record: parse(&k, &v)?,
                    revision: v.mod_revision,
                },
            ));
        }
        Ok(out)
    }

    /// One volume's membership, `None` before it was created.
    pub fn membership(
        &self,
        volume: &str,
    ) -> impl Future<Output = Result<Option<Revisioned<MembershipRecord>>, CoordinationError>>
           + Send
           + 'static {
        let key = self.keys.membership(volume);
        let get = self.etcd.get(key.clone());
        async move {
            match get.await? {
                None => Ok(None),
                Some(v) => Ok(Some(Revisioned {
                    record: parse(&key, &v)?,
                    revision: v.mod_revision,
                })),
            }
        }
    }

    /// Replaces the volume's membership if it is still at `expect` (the
    /// revision read, or absent for a new volume). The epoch must rise:
    /// a swap that does not raise it is refused before reaching etcd.
    pub fn swap_membership(
        &self,
        volume: &str,
        record: &MembershipRecord,
        expect: Expect,
        previous_epoch: u64,
    ) -> impl Future<Output = Result<TxnOutcome, CoordinationError>> + Send + 'static {
        let refused =
            (record.membership.epoch <= previous_epoch && expect != Expect::Absent).then(|| {
                CoordinationError::Invalid(format!(
                    "membership epoch must rise: {} -> {}",
                    previous_epoch, record.membership.epoch
                ))
            });
        let put = self
            .etcd
            .put_if(self.keys.membership(volume), json(record), expect, None);
        async move {
            if let Some(e) = refused {
                return Err(e);
            }
            put.await
        }
    }

    /// Chooses `n` peers for a new volume of `size` bytes.
    pub fn place(&self, size: u64, n: usize) -> Result<Vec<PeerRecord>, CoordinationError> {
        let pool = self.peers()?;
        let placed = self.memberships()?;
        let used = placement::used_bytes(placed.iter().map(|(_, m)| &m.record));
        placement::choose(&pool, &used, size, n, &BTreeSet::new(), &BTreeSet::new())
            .map_err(CoordinationError::Placement)
    }

    /// A spare to replace member `replacing` of `membership`: a registered
    /// peer that is not (and was not) a member, outside the failure
    /// domains of the members still holding data other than `replacing`
    /// (its domain is the one being given up), with room for the volume.
    pub fn spare(
        &self,
        membership: &MembershipRecord,
        replacing: &str,
    ) -> Result<PeerRecord, CoordinationError> {
        let pool = self.peers()?;
        let placed = self.memberships()?;
        let used = placement::used_bytes(placed.iter().map(|(_, m)| &m.record));
        let members: BTreeSet<String> = membership
            .membership
            .members
            .iter()
            .map(|m| m.peer.clone())
            .collect();
        let domains: BTreeSet<String> = membership
            .placed()
            .filter(|m| m.peer != replacing)
            .filter_map(|m| pool.iter().find(|p| p.id == m.peer))
            .map(|p| p.domain().to_owned())
            .collect();
        placement::choose(&pool, &used, membership.size, 1, &members, &domains)
            .map_err(CoordinationError::Placement)
            .map(|mut v| v.remove(0))
    }

    /// A spare for `volume`'s member `replacing`, chosen over the record
    /// as etcd holds it now; `None` when the pool has no peer that fits
    /// (the member then waits for its own peer).
    pub fn spare_for(
        &self,
        volume: &str,
        replacing: &str,
    ) -> Result<Option<PeerRecord>, CoordinationError> {
        let Some(record) = Etcd::wait(self.membership(volume))? else {
            return Ok(None);
        };
        match self.spare(&record.record, replacing) {
            Ok(p) => Ok(Some(p)),
            Err(CoordinationError::Placement(why)) => {
                tracing::debug!(event = events::REBUILD_NO_SPARE, volume, replacing, reason = %why);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}
