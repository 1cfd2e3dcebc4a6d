//! The arena peer: configuration, the connection server and its
//! observability. The storage engine it serves lives in [`crate::store`].

pub mod config;
pub mod epochs;
pub mod observability;
pub mod server;
