//! The arena peer: configuration and its checks (`--check`), the
//! connection server, reloads (SIGHUP) and its observability. The storage
//! engine it serves lives in [`crate::store`].

mod accept;
pub mod admin_socket;
mod admission;
mod barrier;
mod blocking;
pub mod check;
pub mod config;
pub mod config_doc;
mod connection;
mod dispatch;
pub mod epochs;
mod epochs_file;
pub mod events;
mod fatal;
mod fenced;
mod frames;
mod handshake;
mod lease_keys;
pub mod listener;
pub mod observability;
mod outbox;
mod promotion;
pub mod reload;
mod request;
mod served;
pub mod server;
mod session;
mod sessions;
mod shared;
mod stop;
mod workers;
