//! The coordination store as the replication core sees it: the one place
//! that says which arena peers hold a volume, at which epoch, and whether
//! this process may still write it.
//!
//! The core needs exactly three things, and [`Coordinator`] is exactly
//! them: read the volume's [`Membership`], replace it by compare-and-swap
//! on the epoch read, and where this process's writer role stands
//! ([`Lease`]). Everything else (placement, registering peers, taking the
//! lease) belongs to whoever builds the coordinator.
//!
//! Implementations: etcd (ublkd), [`FileCoordinator`] (single host, no
//! etcd: the record in a file of the state directory) and
//! [`MemoryCoordinator`] (tests, with injected faults).
//!
//! # Contract
//!
//! - A membership's epoch only grows: every successful swap stores a
//!   greater epoch than the one it was conditioned on, so the epoch names
//!   the record and conditioning on it is conditioning on the record.
//! - `compare_and_swap` is atomic: it stores `next` if and only if the
//!   stored epoch is still `expected`, and a [`Swap::Lost`] answer carries
//!   the record that won. An answer that cannot say which happened (a
//!   timeout after the request left) is [`CoordErrorKind::Unavailable`];
//!   the core then reads the record again before it relies on anything.
//! - The futures complete on whatever thread the implementation likes
//!   (a channel from a tokio runtime, a helper thread) and must be pollable
//!   from any executor: the core awaits them on a ublk queue thread, which
//!   runs no tokio runtime.
//! - `lease` is called on every request, so it must be cheap (atomic
//!   loads) and never block. Its `until` must err early, not late: it must
//!   lie before the moment another writer could be granted the volume.
//!   Each time the role is taken anew (a lost lease replaced and the
//!   volume's writer key taken again) the `term` changes, so the core
//!   checks the record before it trusts the role again.
//! - While the role is not [`Lease::Held`] (lost and being taken back),
//!   `compare_and_swap` answers [`CoordErrorKind::Unavailable`], never
//!   [`Swap::Lost`]: only the holder of the role may follow a record that
//!   moved on.

mod file;
#[cfg(any(test, feature = "test-utils"))]
mod memory;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use file::FileCoordinator;
#[cfg(any(test, feature = "test-utils"))]
pub use memory::{CoordFault, MemoryCoordinator};

/// Largest replica count of a volume.
pub const MAX_REPLICAS: usize = 5;

/// Where a member stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Holds every acknowledged write: written to and read from.
    Healthy,
    /// Being rebuilt: written to, never read from.
    Syncing,
    /// Taken out after a failure; its data is stale. It may come back only
    /// through a rebuild.
    Failed,
    /// Taken out on purpose (drained, replaced); no longer the volume's.
    Removed,
}

impl MemberState {
    /// Whether the member receives the volume's writes.
    pub fn is_active(self) -> bool {
        matches!(self, Self::Healthy | Self::Syncing)
    }

    /// Stable lower-case name (logs, `ublkctl show`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Syncing => "syncing",
            Self::Failed => "failed",
            Self::Removed => "removed",
        }
    }
}

/// One member of a volume's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// The arena peer's identity, as the coordination store names it (a
    /// placement-pool id, or `host:port`); the daemon maps it to sessions.
    pub peer: String,
    /// Where it stands.
    pub state: MemberState,
}

/// A volume's replica set at one epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// Grows with every change; presented to the peers, which refuse
    /// sessions of an older one.
    pub epoch: u64,
    /// Every member the volume has had that is not forgotten, in a stable
    /// order; at most one record per peer.
    pub members: Vec<MemberRecord>,
}

impl Membership {
    /// A new volume on `peers`, all healthy (they hold nothing yet), at
    /// epoch 1.
    pub fn new_volume(peers: &[String]) -> Result<Self, String> {
        let m = Self {
            epoch: 1,
            members: peers
                .iter()
                .map(|p| MemberRecord {
                    peer: p.clone(),
                    state: MemberState::Healthy,
                })
                .collect(),
        };
        m.validate()?;
        Ok(m)
    }

    /// The members that receive writes (healthy and syncing).
    pub fn active(&self) -> impl Iterator<Item = &MemberRecord> {
        self.members.iter().filter(|m| m.state.is_active())
    }

    /// The record of `peer`.
    pub fn member(&self, peer: &str) -> Option<&MemberRecord> {
        self.members.iter().find(|m| m.peer == peer)
    }

    /// The state of `peer`, `None` when the record does not name it.
    pub fn state(&self, peer: &str) -> Option<MemberState> {
        self.member(peer).map(|m| m.state)
    }

    /// Checks the invariants every stored record keeps: a non-zero epoch,
    /// distinct non-empty peer names, 1..=[`MAX_REPLICAS`] active members
    /// of which at least one is healthy.
    pub fn validate(&self) -> Result<(), String> {
        if self.epoch == 0 {
            return Err("epoch 0 is not a valid epoch".into());
        }
        for (i, m) in self.members.iter().enumerate() {
            if m.peer.is_empty() {
                return Err(format!("member {i} has an empty peer name"));
            }
            if self.members[..i].iter().any(|o| o.peer == m.peer) {
                return Err(format!("peer {:?} is named twice", m.peer));
            }
        }
        let active = self.active().count();
        if !(1..=MAX_REPLICAS).contains(&active) {
            return Err(format!(
                "{active} active members; a volume has 1..={MAX_REPLICAS}"
            ));
        }
        if !self.active().any(|m| m.state == MemberState::Healthy) {
            return Err("no healthy member: no copy holds every write".into());
        }
        Ok(())
    }
}

impl fmt::Display for Membership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch {} [", self.epoch)?;
        for (i, m) in self.members.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{} {}", m.peer, m.state.name())?;
        }
        write!(f, "]")
    }
}

/// The outcome of a compare-and-swap that reached the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Swap {
    /// `next` is now the record.
    Done,
    /// The record had moved on; this is what it is now. Nothing was stored.
    Lost(Membership),
}

/// Why the coordination store could not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoordErrorKind {
    /// Unreachable, timed out, or the outcome is unknown.
    Unavailable,
    /// The stored record is unreadable or breaks an invariant.
    Corrupt,
    /// Another writer holds the volume.
    LeaseHeld,
}

/// A failed coordination request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("coordination store: {message}")]
pub struct CoordError {
    /// What kind of failure.
    pub kind: CoordErrorKind,
    /// What happened, naming the volume and the cause.
    pub message: String,
}

impl CoordError {
    /// A failure of `kind`.
    pub fn new(kind: CoordErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// Where this process's writer role of a volume stands, as the store last
/// said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lease {
    /// The role is this process's. The store confirmed it until `until`
    /// (past while the store does not answer); `term` names this tenure
    /// of the role and changes when the role is taken again after a loss.
    Held {
        /// The instant before which no other writer can be granted the
        /// volume.
        until: Instant,
        /// This tenure of the role.
        term: u64,
    },
    /// The store dropped this process's lease (it expired, or was revoked);
    /// the role is being taken back and may be found taken by another.
    Lost,
    /// Another writer holds the volume.
    Taken {
        /// Who, in words.
        holder: String,
    },
}

/// A coordination request in flight.
pub type CoordFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, CoordError>> + Send + 'a>>;

/// One volume's coordination: its membership and this process's writer
/// lease. See the module docs for the contract.
pub trait Coordinator: Send + Sync {
    /// The volume's current membership.
    fn load(&self) -> CoordFuture<'_, Membership>;

    /// Stores `next` if the record's epoch is still `expected`. `next.epoch`
    /// is greater than `expected` and `next` is valid.
    fn compare_and_swap(&self, expected: u64, next: Membership) -> CoordFuture<'_, Swap>;

    /// Where this process's writer role stands.
    fn lease(&self) -> Lease;

    /// Takes the writer role for this process, which does not hold it (a
    /// standby): asks the holder to hand it over and waits until it gave
    /// the role up, or until its lease lapsed; [`Lease::Held`] under a new
    /// term after. A holder that neither hands over nor lets its lease
    /// lapse within the store's bound keeps the role
    /// ([`CoordErrorKind::LeaseHeld`]). A store shared by one process only
    /// has no one to hand over to and refuses.
    fn acquire(&self) -> CoordFuture<'_, ()> {
        Box::pin(async { Err(no_handover()) })
    }

    /// Gives this process's writer role up, so that the standby that asked
    /// for it ([`handover_asked`](Self::handover_asked)) takes it. The core
    /// calls it only once it acknowledges nothing more and every member
    /// flushed what it acknowledged.
    fn release(&self) -> CoordFuture<'_, ()> {
        Box::pin(async { Err(no_handover()) })
    }

    /// Who asked this process, the role's holder, to hand it over. Polled
    /// by the device's supervisor, so it must be cheap (no store request).
    fn handover_asked(&self) -> Option<String> {
        None
    }
}

fn no_handover() -> CoordError {
    CoordError::new(
        CoordErrorKind::Unavailable,
        "this coordination store cannot hand the writer role over: a standby needs a store \
         shared by the hosts ([etcd])",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(peer: &str, state: MemberState) -> MemberRecord {
        MemberRecord {
            peer: peer.into(),
            state,
        }
    }

    #[test]
    fn records_keep_their_invariants() {
        let m = Membership::new_volume(&["a:1".into(), "b:1".into()]).unwrap();
        assert_eq!(m.epoch, 1);
        assert_eq!(m.to_string(), "epoch 1 [a:1 healthy, b:1 healthy]");
        assert!(Membership::new_volume(&[]).is_err());
        assert!(Membership::new_volume(&["a".into(), "a".into()]).is_err());
        let six: Vec<String> = (0..6).map(|i| format!("p{i}")).collect();
        assert!(Membership::new_volume(&six).is_err());
        let only_syncing = Membership {
            epoch: 3,
            members: vec![
                rec("a", MemberState::Syncing),
                rec("b", MemberState::Failed),
            ],
        };
        assert!(only_syncing.validate().unwrap_err().contains("no healthy"));
        let ok = Membership {
            epoch: 3,
            members: vec![
                rec("a", MemberState::Healthy),
                rec("b", MemberState::Removed),
                rec("c", MemberState::Syncing),
            ],
        };
        ok.validate().unwrap();
        assert_eq!(ok.active().count(), 2);
        assert_eq!(ok.state("b"), Some(MemberState::Removed));
        assert_eq!(ok.state("z"), None);
    }

    #[test]
    fn the_stored_form_names_states_in_words() {
        let m = Membership {
            epoch: 7,
            members: vec![
                rec("a", MemberState::Healthy),
                rec("b", MemberState::Failed),
            ],
        };
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(
            json,
            r#"{"epoch":7,"members":[{"peer":"a","state":"healthy"},{"peer":"b","state":"failed"}]}"#
        );
        assert_eq!(serde_json::from_str::<Membership>(&json).unwrap(), m);
    }
}
