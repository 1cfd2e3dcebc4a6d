//! How blob bytes move between a caller's buffer and the arena.
//!
//! [`BlobIo`] is the one capability the block target needs from an arena
//! session. Each transport implements it: the TCP inline path
//! ([`ArenaClient`](crate::client::ArenaClient)), an in-process path over a
//! local [`Store`](crate::store::Store) for tests and benchmarks, and the
//! RDMA path. `tests/transport_conformance.rs` runs one suite against all.

mod inproc;
mod stats;

use std::future::Future;

pub use inproc::InProcess;
pub use stats::{TcpPayloadStats, REASON_CONFIGURED_TCP};

use crate::client::{ArenaClient, ArenaError};

/// Which data path a transport uses; a closed set, used as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Payloads inline on the TCP control stream.
    Tcp,
    /// Direct calls into a store in the same process.
    InProcess,
    /// One-sided RDMA into the peer's arena, TCP inline as counted fallback
    /// ([`RdmaTransport`](crate::rdma::RdmaTransport)).
    Rdma,
}

impl TransportKind {
    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::InProcess => "in_process",
            Self::Rdma => "rdma",
        }
    }
}

/// Blob-addressed I/O: the capability the block target is built on.
///
/// Futures are not required to be `Send`: a ublk queue runs its requests on
/// one thread.
pub trait BlobIo {
    /// Which data path this is.
    fn kind(&self) -> TransportKind;
    /// Blob size of the volume.
    fn blob_bytes(&self) -> u32;
    /// Reads `out.len()` bytes at `offset` in blob `key`; `false` (and
    /// zeros) when the blob does not exist.
    fn read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> impl Future<Output = Result<bool, ArenaError>>;
    /// Writes `data` at `offset` in blob `key` (a new blob starts as zeros).
    fn write(
        &self,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> impl Future<Output = Result<(), ArenaError>>;
    /// Drops blobs `start..end`; returns how many existed.
    fn remove(&self, start: u64, end: u64) -> impl Future<Output = Result<u64, ArenaError>>;
    /// Makes every acknowledged write durable.
    fn flush(&self) -> impl Future<Output = Result<(), ArenaError>>;
}

impl BlobIo for ArenaClient {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn blob_bytes(&self) -> u32 {
        self.session_blob_bytes()
    }
    fn read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> impl Future<Output = Result<bool, ArenaError>> {
        ArenaClient::read(self, key, offset, out)
    }
    fn write(
        &self,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> impl Future<Output = Result<(), ArenaError>> {
        ArenaClient::write(self, key, offset, data)
    }
    fn remove(&self, start: u64, end: u64) -> impl Future<Output = Result<u64, ArenaError>> {
        ArenaClient::remove(self, start, end)
    }
    fn flush(&self) -> impl Future<Output = Result<(), ArenaError>> {
        ArenaClient::flush(self)
    }
}
