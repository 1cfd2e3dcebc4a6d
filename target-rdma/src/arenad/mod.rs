//! The arena peer: configuration and the connection server. The storage
//! engine it serves lives in [`crate::store`].

pub mod config;
pub mod server;
