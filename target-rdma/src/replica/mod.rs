//! Replicated volumes: one volume on N arena peers, served to the block
//! target as one `BlobIo`, so it works over every transport and the target
//! does not change. The rules it keeps (writes to every member, removal of
//! a failed member in the coordination store before anything it missed is
//! acknowledged, hedged reads from healthy members only, epochs) are in
//! docs/REPLICATION.md.
//!
//! - [`coordinator`]: what the core needs of the coordination store (etcd,
//!   a file for single-host use, memory for tests).
//! - [`ReplicaSet`] (set.rs): the state all queues of a device share: the
//!   recorded membership, the members, the one path that changes it.
//! - [`ReplicatedIo`] (io.rs): one queue's request path.
//! - member.rs: what the core needs of a member's sessions ([`MemberIo`]).
//! - rebuild.rs: bringing a new member up to date ([`ReplicaSet::rebuild`]);
//!   keys.rs: the per-key guard between its copies and the writes.
//! - handover.rs: a standby, and handing the writer role from one process
//!   to another ([`ReplicaSet::activate`], [`ReplicaSet::release`]).
//! - [`VolumeIo`] (volume.rs): a queue's way to its volume, one session
//!   or the replication core: what the block target runs on.
//! - [`clock`]: time and timers on any executor.
//!
//! Client side: it composes client sessions and never names the server
//! side.

pub mod clock;
pub mod coordinator;
#[cfg(any(test, feature = "test-utils"))]
pub mod fake;
mod handover;
mod io;
mod keys;
mod member;
mod rebuild;
mod set;
mod volume;

pub use coordinator::{
    CoordError, CoordErrorKind, CoordFuture, Coordinator, FileCoordinator, Lease, MemberRecord,
    MemberState, Membership, Swap, MAX_REPLICAS,
};
#[cfg(any(test, feature = "test-utils"))]
pub use coordinator::{CoordFault, MemoryCoordinator};
pub use handover::Handover;
pub use io::ReplicatedIo;
pub use member::{MemberIo, MemberSessions};
pub use rebuild::{GuestLoad, RebuildConfig, RebuildStats, DEFAULT_INFLIGHT, RATE_WINDOW};
pub use set::{ReplicaConfig, ReplicaCounters, ReplicaSet, Standing};
pub use volume::VolumeIo;

#[cfg(test)]
mod tests;
