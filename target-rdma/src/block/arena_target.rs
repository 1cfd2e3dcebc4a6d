//! The arena-backed block target: byte ranges become blob keys and byte
//! ranges inside blobs, and every blob a request touches moves concurrently.
//!
//! Sub-blob writes send only the bytes written (no network read-modify-
//! write). DISCARD and WRITE_ZEROES drop whole blobs with one REMOVE and
//! zero-fill the partial blobs at either end, so both read back as zeros.
//! FUA is honoured by a FLUSH after the write, which covers it.

use std::ops::Range;

use futures::future::try_join_all;

use ublk_metrics::IoOp;

use super::{check_range, BlockTarget, DeviceSize, TargetError};
use crate::blob::{ArenaError, BlobIo, Transport, Via};

/// A block device of `size` bytes over one arena session.
pub struct ArenaTarget<T> {
    io: T,
    /// Shared with the device's other queues and its resize.
    size: DeviceSize,
    blob: u64,
}

/// One blob's share of a request.
#[derive(Debug, PartialEq, Eq)]
struct Segment {
    key: u64,
    offset: u32,
    buf: Range<usize>,
}

/// Splits `offset..offset+len` at blob boundaries.
fn segments(blob: u64, offset: u64, len: u64) -> impl Iterator<Item = Segment> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let key = pos / blob;
        let in_blob = pos % blob;
        let n = (blob - in_blob).min(end - pos);
        let s = Segment {
            key,
            offset: in_blob as u32,
            buf: (pos - offset) as usize..(pos - offset + n) as usize,
        };
        pos += n;
        Some(s)
    })
}

impl<T: BlobIo> ArenaTarget<T> {
    /// A device of `size` bytes over `io`: a fixed `u64`, or a
    /// [`DeviceSize`] the device's resize grows.
    pub fn new(io: T, size: impl Into<DeviceSize>) -> Self {
        let blob = u64::from(io.blob_bytes());
        Self {
            io,
            size: size.into(),
            blob,
        }
    }

    fn arena(op: IoOp) -> impl Fn(ArenaError) -> TargetError {
        move |source| TargetError::Arena { op, source }
    }

    async fn zero_range(&self, op: IoOp, offset: u64, len: u64) -> Result<Via, TargetError> {
        check_range(op, offset, len, self.size.get())?;
        let first_whole = offset.div_ceil(self.blob);
        let end_whole = (offset + len) / self.blob;
        if first_whole < end_whole {
            self.io
                .remove(first_whole, end_whole)
                .await
                .map_err(Self::arena(op))?;
        }
        // The partial blobs at either end are zero-filled in place.
        let zeros = vec![0u8; self.blob.min(len) as usize];
        let partial = segments(self.blob, offset, len)
            .filter(|s| s.buf.len() as u64 != self.blob)
            .map(|s| self.io.write(s.key, s.offset, &zeros[..s.buf.len()]));
        let vias = try_join_all(partial).await.map_err(Self::arena(op))?;
        Ok(fold(vias))
    }
}

/// The outcome of a request's blob operations.
fn fold(vias: Vec<Via>) -> Via {
    vias.into_iter().fold(Via::Nothing, Via::and)
}

impl<T: BlobIo> BlockTarget for ArenaTarget<T> {
    fn transport(&self) -> Transport {
        self.io.transport()
    }

    fn size(&self) -> u64 {
        self.size.get()
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Via, TargetError> {
        check_range(IoOp::Read, offset, buf.len() as u64, self.size.get())?;
        let mut rest = buf;
        let mut reads = Vec::new();
        for s in segments(self.blob, offset, rest.len() as u64) {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(s.buf.len());
            rest = tail;
            reads.push(self.io.read(s.key, s.offset, head));
        }
        let vias = try_join_all(reads).await.map_err(Self::arena(IoOp::Read))?;
        Ok(fold(vias))
    }

    async fn write(&self, offset: u64, buf: &[u8], fua: bool) -> Result<Via, TargetError> {
        check_range(IoOp::Write, offset, buf.len() as u64, self.size.get())?;
        let writes = segments(self.blob, offset, buf.len() as u64)
            .map(|s| self.io.write(s.key, s.offset, &buf[s.buf]));
        let vias = try_join_all(writes)
            .await
            .map_err(Self::arena(IoOp::Write))?;
        if fua {
            self.io.flush().await.map_err(Self::arena(IoOp::Write))?;
        }
        Ok(fold(vias))
    }

    async fn flush(&self) -> Result<Via, TargetError> {
        self.io.flush().await.map_err(Self::arena(IoOp::Flush))?;
        Ok(Via::Nothing)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<Via, TargetError> {
        self.zero_range(IoOp::Discard, offset, len).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<Via, TargetError> {
        self.zero_range(IoOp::WriteZeroes, offset, len).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(key: u64, offset: u32, buf: Range<usize>) -> Segment {
        Segment { key, offset, buf }
    }

    #[test]
    fn ranges_split_at_blob_boundaries() {
        let v: Vec<_> = segments(4096, 1000, 9000).collect();
        assert_eq!(
            v,
            vec![
                seg(0, 1000, 0..3096),
                seg(1, 0, 3096..7192),
                seg(2, 0, 7192..9000)
            ]
        );
        let v: Vec<_> = segments(4096, 8192, 4096).collect();
        assert_eq!(v, vec![seg(2, 0, 0..4096)]);
        assert_eq!(segments(4096, 5, 0).count(), 0);
    }
}
