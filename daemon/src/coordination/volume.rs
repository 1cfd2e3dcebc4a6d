//! One volume's [`Coordinator`] on etcd: what the replication core reads
//! and swaps, and where its writer role stands.
//!
//! A swap is one etcd transaction conditioned on two keys: the membership
//! key still at the `mod_revision` read (so of two writers racing from the
//! same epoch exactly one wins) *and* the volume's writer key still bound
//! to this ublkd's lease (so a writer whose lease lapsed and whose volume
//! another ublkd took cannot move the membership under the new writer).
//! The epoch the core conditions on is checked against the record read
//! first; since epochs only grow, the revision names that epoch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use target_rdma::replica::{
    CoordError as CoreError, CoordErrorKind as CoreKind, CoordFuture, Coordinator, Lease,
    Membership, Swap as CoreSwap,
};

use super::etcd::{Etcd, Expect, TxnOutcome, Versioned};
use super::records::{reason_of_change, MembershipRecord};
use super::writer::VolumeWriter;
use super::{CoordinationError, CoordinationErrorKind};
use ublk_metrics::events;
use ublk_metrics::EpochReason;

impl From<CoordinationError> for CoreError {
    fn from(e: CoordinationError) -> Self {
        let kind = match e.kind() {
            CoordinationErrorKind::Held => CoreKind::LeaseHeld,
            CoordinationErrorKind::Corrupt | CoordinationErrorKind::Invalid => CoreKind::Corrupt,
            CoordinationErrorKind::Unavailable
            | CoordinationErrorKind::Busy
            | CoordinationErrorKind::Placement
            | CoordinationErrorKind::LeaseFile => CoreKind::Unavailable,
        };
        CoreError::new(kind, e.to_string())
    }
}

/// Epoch changes this ublkd made, by [`EpochReason`] (the
/// `ublk_membership_epoch_changes_total` family's source).
#[derive(Debug, Default)]
pub struct EpochChanges([AtomicU64; EpochReason::COUNT]);

impl EpochChanges {
    /// Counts one change.
    pub fn record(&self, reason: EpochReason) {
        self.0[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Changes made for `reason`.
    pub fn get(&self, reason: EpochReason) -> u64 {
        self.0[reason.index()].load(Ordering::Relaxed)
    }

    /// Every count, by [`EpochReason::index`].
    pub fn all(&self) -> [u64; EpochReason::COUNT] {
        EpochReason::ALL.map(|r| self.get(r))
    }
}

/// A volume served by this ublkd, as the replication core coordinates it.
pub struct EtcdVolume {
    etcd: Arc<Etcd>,
    volume: String,
    membership_key: String,
    writer_key: String,
    writer: Arc<VolumeWriter>,
    changes: Arc<EpochChanges>,
}

fn parse(key: &str, v: &Versioned) -> Result<MembershipRecord, CoreError> {
    serde_json::from_slice::<MembershipRecord>(&v.value)
        .map_err(|e| format!("unreadable: {e}"))
        .and_then(|r| r.membership.validate().map(|()| r))
        .map_err(|e| CoreError::new(CoreKind::Corrupt, format!("etcd key {key}: {e}")))
}

impl EtcdVolume {
    /// The coordinator of `volume`, whose writer key `writer` holds.
    pub(super) fn new(
        etcd: Arc<Etcd>,
        membership_key: String,
        writer_key: String,
        writer: Arc<VolumeWriter>,
        changes: Arc<EpochChanges>,
    ) -> Self {
        Self {
            etcd,
            volume: writer.volume().to_owned(),
            membership_key,
            writer_key,
            writer,
            changes,
        }
    }

    /// The writer this coordinator acknowledges under.
    pub fn writer(&self) -> &Arc<VolumeWriter> {
        &self.writer
    }

    async fn read(&self) -> Result<(MembershipRecord, i64), CoreError> {
        match self.etcd.get(self.membership_key.clone()).await? {
            Some(v) => Ok((parse(&self.membership_key, &v)?, v.mod_revision)),
            None => Err(CoreError::new(
                CoreKind::Corrupt,
                format!(
                    "volume {:?}: its membership key {} was deleted",
                    self.volume, self.membership_key
                ),
            )),
        }
    }

    async fn swap(&self, expected: u64, next: Membership) -> Result<CoreSwap, CoreError> {
        if next.epoch <= expected {
            return Err(CoreError::new(
                CoreKind::Corrupt,
                format!("epoch must rise: {expected} -> {}", next.epoch),
            ));
        }
        next.validate()
            .map_err(|e| CoreError::new(CoreKind::Corrupt, format!("refused membership: {e}")))?;
        // Only the role's holder may learn that the record moved on (and
        // follow it): a writer whose lease was lost waits until its key is
        // taken again.
        let lease = match self.writer.lease() {
            Lease::Held { .. } => self.writer.lease_id().ok_or_else(|| self.regaining())?,
            Lease::Lost => return Err(self.regaining()),
            Lease::Taken { .. } => return Err(self.fenced()),
        };
        let (current, revision) = self.read().await?;
        if current.membership.epoch != expected {
            return Ok(CoreSwap::Lost(current.membership));
        }
        let reason = reason_of_change(&current.membership, &next);
        let record = MembershipRecord {
            membership: next,
            size: current.size,
            reason: reason.as_str().into(),
        };
        let value = serde_json::to_vec(&record).unwrap_or_default();
        let conditions = vec![
            (self.membership_key.clone(), Expect::Revision(revision)),
            (self.writer_key.clone(), Expect::Lease(lease)),
        ];
        let put = self
            .etcd
            .put_if_all(self.membership_key.clone(), conditions, value);
        match put.await? {
            TxnOutcome::Done(_) => {
                self.changes.record(reason);
                tracing::info!(event = events::MEMBERSHIP_CHANGED, volume = %self.volume,
                    membership = %record.membership, reason = reason.as_str());
                Ok(CoreSwap::Done)
            }
            TxnOutcome::Conflict(Some(now)) if now.mod_revision != revision => Ok(CoreSwap::Lost(
                parse(&self.membership_key, &now)?.membership,
            )),
            // The membership did not move: the writer key is no longer ours.
            TxnOutcome::Conflict(Some(_)) => Err(self.fenced()),
            TxnOutcome::Conflict(None) => Err(CoreError::new(
                CoreKind::Corrupt,
                format!("volume {:?}: its membership key was deleted", self.volume),
            )),
        }
    }

    fn regaining(&self) -> CoreError {
        CoreError::new(
            CoreKind::Unavailable,
            format!(
                "volume {:?}: etcd lost this ublkd's writer lease; the writer key is being taken again",
                self.volume
            ),
        )
    }

    fn fenced(&self) -> CoreError {
        CoreError::new(
            CoreKind::LeaseHeld,
            format!(
                "volume {:?}: this ublkd's writer lease is gone; it no longer serves the volume",
                self.volume
            ),
        )
    }
}

impl Coordinator for EtcdVolume {
    fn load(&self) -> CoordFuture<'_, Membership> {
        Box::pin(async move { Ok(self.read().await?.0.membership) })
    }

    fn compare_and_swap(&self, expected: u64, next: Membership) -> CoordFuture<'_, CoreSwap> {
        Box::pin(self.swap(expected, next))
    }

    fn lease(&self) -> Lease {
        self.writer.lease()
    }

    fn acquire(&self) -> CoordFuture<'_, ()> {
        Box::pin(async move { Ok(self.writer.take(&self.etcd).await?) })
    }

    fn release(&self) -> CoordFuture<'_, ()> {
        Box::pin(async move { Ok(self.writer.give_up(&self.etcd).await?) })
    }

    fn handover_asked(&self) -> Option<String> {
        self.writer.handover_asked()
    }
}
