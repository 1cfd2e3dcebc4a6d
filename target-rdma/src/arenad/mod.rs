//! The arena peer: configuration, the connection server and its
//! telemetry. The storage engine it serves lives in [`crate::store`].

pub mod config;
pub mod server;
pub mod telemetry;
