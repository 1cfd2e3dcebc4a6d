//! Coordination of replicated volumes across hosts, on etcd: per volume
//! its replica set and membership epoch, its single writer, and the pool of
//! arena peers placement chooses from. Every decision that must be unique
//! is an etcd transaction or lease (see [`etcd`]); nothing here votes or
//! elects on its own. Key layout: [`records`]; docs/REPLICATION.md
//! describes the operation.
//!
//! - [`config`]: the `[etcd]` section; [`replication`]: `[replication]`.
//! - [`etcd`]: the client on its own tokio runtime, bridged to non-tokio
//!   callers; bounded requests; conditional puts and deletes.
//! - [`writer`]: the writer lease (one ublkd per volume) and the deadline
//!   writes may be acknowledged until.
//! - [`placement`]: choosing peers for replicas and spares.
//! - [`pool`]: the etcd-backed service the device manager uses: the pool,
//!   memberships, placement over them.
//! - [`slot`]: the service as the daemon holds it, started in the
//!   background.
//! - [`volume`]: one volume's [`Coordinator`](target_rdma::replica::Coordinator)
//!   for the replication core: its membership and its writer's deadline.

pub mod config;
pub mod etcd;
pub mod placement;
pub mod pool;
pub mod records;
pub mod replication;
pub mod slot;
pub mod volume;
pub mod writer;

use std::path::PathBuf;

pub use config::EtcdConfig;
pub use pool::Coordination;
pub use records::{MembershipRecord, PeerRecord, WriterRecord};
pub use replication::ReplicationConfig;
pub use slot::CoordinationSlot;
pub use ublk_metrics::EpochReason;
pub use volume::EtcdVolume;
pub use writer::{VolumeWriter, WriterLease};

/// What kind of failure a [`CoordinationError`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordinationErrorKind {
    /// etcd did not answer in time or refused the request.
    Unavailable,
    /// Too many requests in flight.
    Busy,
    /// Another ublkd serves the volume.
    Held,
    /// A record in etcd does not parse.
    Corrupt,
    /// Placement cannot satisfy the request.
    Placement,
    /// Bad input (a peer record, a name).
    Invalid,
    /// The state dir's lease file.
    LeaseFile,
}

/// A coordination failure; messages name what failed and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CoordinationError {
    /// etcd did not answer in time or refused the request.
    #[error("etcd unavailable ({what}): {detail}")]
    Unavailable {
        /// The request.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// `etcd.max_inflight` requests are already out.
    #[error("too many etcd requests in flight (etcd.max_inflight = {0})")]
    Busy(u32),
    /// Another ublkd holds the volume's writer key.
    #[error("volume {volume:?} is already served by {holder}: only one ublkd may serve a volume; delete the device there (ublkctl del), or wait until that ublkd's writer lease expires")]
    Held {
        /// The volume.
        volume: String,
        /// Who holds it.
        holder: String,
    },
    /// A key holds something this ublkd cannot read.
    #[error("etcd key {key} holds a record this ublkd cannot read: {detail}")]
    Corrupt {
        /// The key.
        key: String,
        /// The parse error.
        detail: String,
    },
    /// Placement found no peers that satisfy the rule.
    #[error("{0}")]
    Placement(String),
    /// Bad input.
    #[error("{0}")]
    Invalid(String),
    /// `<state_dir>/writer-lease` could not be used.
    #[error("writer lease file {path}: {detail}")]
    LeaseFile {
        /// The file.
        path: PathBuf,
        /// Why.
        detail: String,
    },
}

impl CoordinationError {
    /// The kind callers match on.
    pub fn kind(&self) -> CoordinationErrorKind {
        match self {
            Self::Unavailable { .. } => CoordinationErrorKind::Unavailable,
            Self::Busy(_) => CoordinationErrorKind::Busy,
            Self::Held { .. } => CoordinationErrorKind::Held,
            Self::Corrupt { .. } => CoordinationErrorKind::Corrupt,
            Self::Placement(_) => CoordinationErrorKind::Placement,
            Self::Invalid(_) => CoordinationErrorKind::Invalid,
            Self::LeaseFile { .. } => CoordinationErrorKind::LeaseFile,
        }
    }
}
