//! `ublkd`: serves ublk block devices backed by a remote arena, and the
//! library behind `ublkctl`.
//!
//! Control plane: [`config`], [`device`] (the device manager and its
//! persisted definitions), [`server`] and [`ctl`] (the control socket and
//! its protocol), [`observability`] (metrics, readiness, diagnostics, and the per-request observer). I/O plane: [`io`] (descriptor → target call → result,
//! pure and unit-tested), [`queue`] (the per-queue io_uring loop) and
//! [`wake`] (waking that loop from the arena client's threads).

pub mod busy;
pub mod config;
pub mod ctl;
pub mod device;
pub mod features;
pub mod io;
pub mod observability;
pub mod queue;
pub mod queue_io;
pub mod server;
pub mod stats;
pub mod wake;
