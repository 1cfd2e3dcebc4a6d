//! Blob-addressed I/O, the vocabulary on neither side of the wire.
//!
//! The block target is built on [`BlobIo`]; the TCP client, the RDMA
//! transport, a queue's session and the in-process store adapter implement
//! it. Each returns the one error type, [`ArenaError`], whatever carried the
//! request (the same failure is the same error over every transport), and
//! says in its `Ok` value which path carried the payload ([`Via`]), so a
//! failover reaches the request accounting in the return value, not through
//! a side channel. Nothing here names a transport, so a composite of
//! sessions can implement the trait too. One suite
//! (`testing::conformance::blob`) holds every implementation to the same
//! behaviour, here (`tests/transport_conformance.rs`) and on ublkd's queue
//! path (`daemon/tests/queue_io_conformance.rs`).
//!
//! Client-side modules (`client`, `block`) and server-side ones (`store`,
//! `arenad`) both name this module and never each other.

mod error;

use std::future::Future;

pub use error::{ArenaError, ErrorKind, ReplicaFailure};
pub use ublk_metrics::Transport;

/// Which path carried a payload: what a successful operation tells the
/// request/attempt accounting, returned in its `Ok` value (as Firecracker's
/// `FileEngineOk` does).
///
/// Ordered by how much it says about the request: [`Via::and`] keeps the
/// greater, so the outcome of a request touching several blobs is a
/// failover when any of its payloads failed over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Via {
    /// No payload moved: a read of a blob that does not exist (the buffer
    /// is zero-filled), or an operation without payload.
    #[default]
    Nothing,
    /// Direct calls into a store in this process.
    InProcess,
    /// Inline on the TCP control stream.
    Tcp,
    /// One-sided RDMA into the peer's arena.
    Rdma,
    /// An RDMA attempt failed; the payload then went inline on TCP.
    Failover,
}

impl Via {
    /// The outcome of two operations of one request.
    pub fn and(self, other: Via) -> Via {
        self.max(other)
    }

    /// Whether a payload moved: `false` only for a read of a blob that
    /// does not exist.
    pub fn moved(self) -> bool {
        self != Via::Nothing
    }

    /// Whether a payload failed over to TCP after an RDMA attempt failed.
    pub fn failed_over(self) -> bool {
        self == Via::Failover
    }
}

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
    /// Reads `out.len()` bytes at `offset` in blob `key`. A blob that does
    /// not exist reads as zeros and answers [`Via::Nothing`].
    fn read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> impl Future<Output = Result<Via, ArenaError>>;
    /// Writes `data` at `offset` in blob `key` (a new blob starts as zeros).
    fn write(
        &self,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> impl Future<Output = Result<Via, ArenaError>>;
    /// Drops blobs `start..end`; returns how many existed.
    fn remove(&self, start: u64, end: u64) -> impl Future<Output = Result<u64, ArenaError>>;
    /// Makes every acknowledged write durable.
    fn flush(&self) -> impl Future<Output = Result<(), ArenaError>>;
}

impl<T: BlobIo + ?Sized> BlobIo for &T {
    fn transport(&self) -> Transport {
        (**self).transport()
    }
    fn blob_bytes(&self) -> u32 {
        (**self).blob_bytes()
    }
    fn read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> impl Future<Output = Result<Via, ArenaError>> {
        (**self).read(key, offset, out)
    }
    fn write(
        &self,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> impl Future<Output = Result<Via, ArenaError>> {
        (**self).write(key, offset, data)
    }
    fn remove(&self, start: u64, end: u64) -> impl Future<Output = Result<u64, ArenaError>> {
        (**self).remove(start, end)
    }
    fn flush(&self) -> impl Future<Output = Result<(), ArenaError>> {
        (**self).flush()
    }
}

#[cfg(test)]
mod tests {
    use super::Via;

    #[test]
    fn a_request_is_a_failover_when_any_of_its_payloads_is() {
        let fold = |v: &[Via]| v.iter().fold(Via::Nothing, |a, b| a.and(*b));
        assert_eq!(fold(&[]), Via::Nothing);
        assert_eq!(fold(&[Via::Nothing, Via::Tcp]), Via::Tcp);
        assert_eq!(fold(&[Via::Rdma, Via::Tcp, Via::Nothing]), Via::Rdma);
        assert_eq!(fold(&[Via::Rdma, Via::Failover, Via::Tcp]), Via::Failover);
        assert!(fold(&[Via::Tcp, Via::Failover]).failed_over());
        assert!(!Via::Nothing.moved() && Via::InProcess.moved());
    }
}
