//! `RdmaTransport`: blob payloads by one-sided RDMA into the peer's arena,
//! with the control stream ([`ArenaClient`](super::ArenaClient)) for
//! leases and the counted TCP inline path as fallback.
//!
//! One transport per ublk queue: one control connection, one QP per *rail*
//! (one or two: a local device each, on the link to the peer's device of
//! the same index), a registered buffer pool per rail. A request leases the blob's slot (GET/ALLOC,
//! or a cached lease), moves its byte range with RDMA READ/WRITE at
//! `arena_base + slot_offset + offset`, then ends the lease (RELEASE/COMMIT)
//! unless it is cached. Many requests are in flight at once, bounded by the
//! send queue depth; nothing holds a lock across an await.
//!
//! Local memory: a buffer inside a region registered with
//! [`RdmaTransport::register_io_buffers`] (ublkd's I/O buffers) is used in
//! place, no copy. Other memory goes through a pool buffer (registered once,
//! one copy, counted as a bounce), or, when the pool is exhausted, is
//! registered for that one request (counted). What cannot go by RDMA goes
//! inline on TCP and is counted by [`TcpReason`].
//!
//! The transports of one block device form a [`TransportGroup`]: leases are
//! cached per connection, but a FLUSH or DISCARD on one queue concerns the
//! blobs every queue writes, so it first ends the other members' affected
//! cached leases.
//!
//! One type per mechanism, each held by the transport and each in its
//! file: `transport` (`RdmaTransport`, the data path that uses the
//! others), `rails` (`Rails`: which rail a payload takes, and striping)
//! over `rail_slot` (`RailSlot`: one rail's QP over time, set up, lost and
//! replaced, and its memory) over `rail` (one QP and the per-payload
//! route), `leases` (`Leases`: asking
//! for, caching and ending leases, waiting out BUSY) over `lease_cache`
//! (the cache's state machine) and `busy` (our own leases, as BUSY answers
//! see them), `group` (`TransportGroup`, the device's transports), `pool`
//! (`Memory`: registered regions, the bounce pool, per-transfer
//! registrations), `completion` (wr ids, deadlines, the completion thread),
//! `driver` (the completions reaped on the owner's event loop instead),
//! `config` and `stats` (counters and their driver report).

mod busy;
mod completion;
mod config;
mod driver;
mod group;
mod lease_cache;
mod leases;
mod pool;
mod rail;
mod rail_slot;
mod rails;
mod stats;
mod transport;

pub use config::RdmaTransportConfig;
pub use driver::CqDriver;
pub use group::TransportGroup;
pub use stats::{RdmaDriverStats, RdmaStats, TcpReason};
pub use transport::{RdmaConnectError, RdmaTransport};
