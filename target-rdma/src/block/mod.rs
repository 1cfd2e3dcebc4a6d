//! Block targets: what a ublk queue calls to serve READ, WRITE, FLUSH,
//! DISCARD and WRITE_ZEROES.
//!
//! [`BlockTarget`] is implemented by the arena-backed target ([`ArenaTarget`])
//! and by a plain in-memory reference ([`MemTarget`]); one conformance suite
//! (`testing::conformance::target`) runs against both, here
//! (`tests/target_conformance.rs`) and on ublkd's queue path
//! (`daemon/tests/queue_io_conformance.rs`). Errors become errnos in exactly
//! one place, [`TargetError::errno`]; a success says which path carried the
//! request's payloads ([`Via`], folded over its blobs), which is all the
//! request accounting needs to count a failover.

mod arena_target;
mod device_size;
mod mem_target;

use std::future::Future;

pub use arena_target::ArenaTarget;
pub use device_size::DeviceSize;
pub use mem_target::MemTarget;

use ublk_metrics::IoOp;

use crate::blob::{ArenaError, Transport, Via};

/// A block request that failed.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The range does not fit the device.
    #[error("{op} of {len} bytes at byte {offset} is past the end of the {size}-byte device", op = op.as_str())]
    OutOfRange {
        /// The operation.
        op: IoOp,
        /// Start byte.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Device size in bytes.
        size: u64,
    },
    /// The arena failed the request.
    #[error("{op} failed: {source}", op = op.as_str())]
    Arena {
        /// The operation.
        op: IoOp,
        /// The cause.
        source: ArenaError,
    },
}

impl TargetError {
    /// The errno the block layer gets (positive; ublk wants it negated):
    /// the arena error's ([`ErrorKind::errno`](crate::blob::ErrorKind::errno)),
    /// EIO for a range past the end.
    pub fn errno(&self) -> i32 {
        match self {
            Self::OutOfRange { .. } => libc::EIO,
            Self::Arena { source, .. } => source.kind().errno(),
        }
    }
}

/// Serves block requests for one queue. Byte offsets and lengths; the
/// device size may grow while it serves ([`DeviceSize`]), never shrink.
/// Each success returns which path carried the request's payloads.
///
/// Futures need not be `Send`: each ublk queue thread owns its target.
pub trait BlockTarget {
    /// The transport a request's first attempt goes on.
    fn transport(&self) -> Transport;
    /// Device size in bytes, now.
    fn size(&self) -> u64;
    /// Fills `buf` from byte `offset`; unwritten ranges read as zeros.
    fn read(&self, offset: u64, buf: &mut [u8]) -> impl Future<Output = Result<Via, TargetError>>;
    /// Writes `buf` at byte `offset`; with `fua` it is durable on completion.
    fn write(
        &self,
        offset: u64,
        buf: &[u8],
        fua: bool,
    ) -> impl Future<Output = Result<Via, TargetError>>;
    /// Makes every completed write durable.
    fn flush(&self) -> impl Future<Output = Result<Via, TargetError>>;
    /// Drops the range; it reads as zeros afterwards.
    fn discard(&self, offset: u64, len: u64) -> impl Future<Output = Result<Via, TargetError>>;
    /// Zeroes the range.
    fn write_zeroes(&self, offset: u64, len: u64)
        -> impl Future<Output = Result<Via, TargetError>>;
}

/// Checks that `offset..offset+len` lies inside a device of `size` bytes.
pub(crate) fn check_range(op: IoOp, offset: u64, len: u64, size: u64) -> Result<(), TargetError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(TargetError::OutOfRange {
            op,
            offset,
            len,
            size,
        }),
    }
}
