//! `ublkd`: serves ublk block devices backed by a remote arena, and the
//! library behind `ublkctl`.
//!
//! Control plane: [`config`], [`check`] (`--check-config`), [`reload`]
//! (SIGHUP), [`coordination`] (etcd: writer lease, memberships,
//! placement), [`device`] (the device manager, its persisted
//! definitions and the peer monitor), [`control_socket`] and [`ctl`] (the
//! control socket and its protocol), [`observability`] (metrics, readiness,
//! diagnostics, and the per-request observer), [`device_stats`] (the
//! `ublkctl stats` counters). I/O plane: [`io`] (descriptor -> target call
//! -> result, pure and unit-tested), [`queue`] (the per-queue io_uring
//! loop), [`queue_io`] (a queue's session and tag buffers) and [`wake`]
//! (waking that loop from the arena client's threads).

pub mod busy;
pub mod check;
pub mod config;
pub mod config_doc;
pub mod control_socket;
pub mod coordination;
pub mod ctl;
pub mod device;
pub mod device_stats;
pub mod features;
pub mod io;
pub mod observability;
pub mod queue;
pub mod queue_io;
pub mod reload;
pub mod wake;
