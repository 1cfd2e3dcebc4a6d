//! The bookkeeping behind the store lock: which blob lives in which slot and
//! extent, leases, eviction, write-back and the durable commit.
//!
//! A blob has up to three homes: a slot (its newest bytes when resident), a
//! swap extent (a complete older or equal image), and the extent the durable
//! index names. Write-back never overwrites the durable extent; it goes to a
//! fresh extent or to the blob's own not-yet-durable one. A commit first
//! syncs the swap file, then journals the new mappings, and only then frees
//! the extents they superseded.
//!
//! Fault-ins and evicting or background write-backs run their I/O without
//! the store lock, so that a connection's disk time neither blocks the other
//! connections nor keeps the network idle. Under the lock such a slot is
//! put in transition (pinned, plus `loading` or `writing`), the lock is
//! dropped for the I/O, then retaken to finish the change. While in
//! transition a slot is never a victim, never written back again, and its
//! extent is neither freed nor journaled; users of a loading blob wait on
//! `Core::settled`. A flush waits for in-flight write-backs, then does its
//! own under the lock as before, so its ordering is unchanged.
//!
//! Every image read from swap is checked against its extent header before
//! anyone sees it (see [`extent`](super::extent)): a fault-in before the
//! slot is handed out, a range read of a cold blob before its bytes are.
//! A range read holds nothing while its I/O runs (no slot, no extent pin):
//! if its bytes fail the check, the lock is retaken to see whether the blob
//! moved meanwhile (then the read starts over) or the extent really is bad
//! (then the read fails, counted and logged).
//!
//! Locks, always taken in this order and never the other way: the store
//! lock (`Core::state`), then a slot's bytes lock (`Arena::read`/`write`),
//! then the swap file's ring and buffer pools. Every file here follows
//! it: none takes the store lock while it holds a slot's bytes.
//!
//! One type per mechanism, each with its impl in one file:
//!
//! - [`Core`] (`shared`): what the threads share, and the path that hands
//!   slots out: fault-in, eviction, a write-back's I/O, leases granted;
//! - `State` (`state`): the bookkeeping under the lock, holding each
//!   mechanism's own state as a field: `Volumes` (`volumes`), `Slots`
//!   (`slots`), `Images` (`images`: the swap extents, their headers and
//!   their images' checksums), `Leases` (`lease`), `ReadAhead`
//!   (`read_ahead`), `Durable` (`durable`: what the next commit makes
//!   durable), `Transit` (`transit`: the slots in transition and the
//!   flushes waiting for them) and `Background` (`background`: the
//!   cleaner's wake-up and the stop);
//! - `WriteBack` (`write_back`): a write-back planned and settled under
//!   the lock;
//! - [`Direct`] and [`ReadPlan`] (`range_read`): a read served from a slot
//!   or, for part of a cold blob, planned, read from swap and verified.
//!
//! The procedures around them are functions of one concept each: the
//! durable commit (`commit`), FLUSH (`flush`), the background threads
//! (`workers`), the state rebuilt at open (`open`); `blob` holds the
//! record of a blob. Imports between these files run one way: records and
//! types at the bottom, `shared` above them, the procedures that drive
//! [`Core`] on top.

mod background;
mod blob;
mod commit;
mod durable;
mod flush;
mod images;
mod lease;
mod open;
mod range_read;
mod read_ahead;
mod shared;
mod slots;
mod state;
mod transit;
mod volumes;
mod workers;
mod write_back;

pub(super) use flush::flush;
pub use lease::{ForceEndHook, LeaseLimits, DEFAULT_REVOKE_DEADLINE_MS};
pub(super) use open::open;
pub(super) use range_read::{Direct, ReadPlan};
#[cfg(test)]
pub(super) use read_ahead::READ_AHEAD;
pub(super) use shared::{Core, Guard};
pub(super) use workers::{clean, read_ahead_worker, reap_leases, READ_AHEAD_WORKERS};
