//! The arena peer: configuration, the connection server and its
//! observability. The storage engine it serves lives in [`crate::store`].

mod admission;
pub mod config;
pub mod epochs;
mod frames;
pub mod observability;
pub mod server;
