//! The arena peer: configuration and its checks (`--check`), the
//! connection server, reloads (SIGHUP) and its observability. The storage
//! engine it serves lives in [`crate::store`].

mod admission;
pub mod check;
pub mod config;
pub mod epochs;
mod frames;
pub mod listener;
pub mod observability;
pub mod reload;
pub mod server;
