//! Blob-addressed I/O, the vocabulary on neither side of the wire.
//!
//! The block target is built on [`BlobIo`]; the TCP client, the RDMA
//! transport and the in-process store adapter implement it, and each
//! returns the one error type, [`ArenaError`], whatever carried the request:
//! the same failure is the same error over every transport.
//! `tests/transport_conformance.rs` holds every implementation to one suite.
//!
//! Client-side modules (`client`, `block`) and server-side ones (`store`,
//! `arenad`) both name this module and never each other.

mod error;

use std::future::Future;

pub use error::{ArenaError, ErrorKind};
pub use ublk_metrics::Transport;

/// Blob-addressed I/O: the capability the block target is built on.
///
/// Futures are not required to be `Send`: a ublk queue runs its requests on
/// one thread.
pub trait BlobIo {
    /// The data path a payload takes first: the transport a request's first
    /// attempt is counted under.
    fn transport(&self) -> Transport;
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
