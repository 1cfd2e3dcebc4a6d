//! Both ends of the paging protocol, and data flows one way between them.
//!
//! - Shared vocabulary: [`blob`] (`BlobIo`, the one `ArenaError`, `Via`),
//!   [`proto`] (the wire codec), [`auth`], [`rdma`] (the verbs layer),
//!   [`service`] (what a daemon process needs around its service: config
//!   file, preflight checks, sd_notify, error chains, sizes, the local
//!   admin socket), [`admin`] (arenad's admin protocol, which `arenactl`
//!   speaks).
//! - Client side (ublkd): [`client`] (the TCP client, the RDMA transport, a
//!   queue's `Session`), [`replica`] (a volume on N peers as one `BlobIo`)
//!   and [`block`] (the block target).
//! - Server side (arenad): [`arenad`] (server, observability, config) and
//!   [`store`] (the storage engine, and `InProcess`, the reference
//!   transport).
//!
//! The client side never names the server side and the reverse
//! (`tests/tests/layout.rs` checks it); `testing` (feature `test-utils`) is
//! the harness that puts both together for tests and benchmarks.

pub mod admin;
pub mod arenad;
pub mod auth;
pub mod blob;
pub mod block;
pub mod client;
pub mod fuzzing;
pub mod proto;
pub mod rdma;
pub mod replica;
pub mod service;
pub mod store;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
