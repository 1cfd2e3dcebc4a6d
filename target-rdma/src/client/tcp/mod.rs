//! `ArenaClient`: one authenticated control connection to `arenad` with many
//! requests in flight.
//!
//! The client is executor-agnostic on purpose: a ublk queue thread runs its
//! own io_uring executor, not tokio. Requests are written by the caller
//! under a short lock and answered through oneshot channels, so any
//! executor can await them. Answers are read by a reader thread, which
//! wakes every [`TICK`] to fail requests past their deadline (timeouts
//! without a timer runtime), or, for a client configured
//! [`ClientConfig::driven`], by the owner's own event loop ([`ring`]): a
//! ublk queue thread then completes its requests on its io_uring, with no
//! thread hop per answer.
//!
//! After a disconnect the next call reconnects and idempotent requests
//! (inline READ/WRITE, REMOVE) are retried once. FLUSH is never papered
//! over: if the peer restarted (new generation) while writes it had
//! acknowledged were not yet flushed, the next FLUSH fails with
//! [`ArenaError::UnflushedDataLost`](crate::blob::ArenaError::UnflushedDataLost), because those writes are gone.

mod client;
mod config;
mod conn;
mod durability;
mod frames;
mod receiver;
pub mod ring;
mod shared;
mod source;
mod stats;
pub mod tcp_info;

pub use crate::client::driven::TICK;
pub use client::ArenaClient;
pub use config::ClientConfig;
pub use durability::FlushDomain;
pub use frames::{Body, BodyPool, FrameReader, Landing, OWNED_BODY_MIN};
pub use stats::{ClientStats, REASON_CONFIGURED_TCP};
