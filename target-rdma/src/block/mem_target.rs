//! The in-memory reference target: a flat byte vector, no network, no
//! cleverness. The conformance suite checks the arena target against it.

use parking_lot::Mutex;

use ublk_metrics::IoOp;

use super::{check_range, BlockTarget, TargetError};
use crate::blob::{Transport, Via};

/// A RAM disk of fixed size.
pub struct MemTarget {
    data: Mutex<Vec<u8>>,
}

impl MemTarget {
    /// A zero-filled device of `size` bytes.
    pub fn new(size: u64) -> Self {
        Self {
            data: Mutex::new(vec![0; size as usize]),
        }
    }

    fn zero(&self, op: IoOp, offset: u64, len: u64) -> Result<Via, TargetError> {
        let mut d = self.data.lock();
        check_range(op, offset, len, d.len() as u64)?;
        d[offset as usize..(offset + len) as usize].fill(0);
        Ok(Via::InProcess)
    }
}

impl BlockTarget for MemTarget {
    fn transport(&self) -> Transport {
        Transport::InProcess
    }

    fn size(&self) -> u64 {
        self.data.lock().len() as u64
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Via, TargetError> {
        let d = self.data.lock();
        check_range(IoOp::Read, offset, buf.len() as u64, d.len() as u64)?;
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(Via::InProcess)
    }

    async fn write(&self, offset: u64, buf: &[u8], _fua: bool) -> Result<Via, TargetError> {
        let mut d = self.data.lock();
        check_range(IoOp::Write, offset, buf.len() as u64, d.len() as u64)?;
        d[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(Via::InProcess)
    }

    async fn flush(&self) -> Result<Via, TargetError> {
        Ok(Via::Nothing)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<Via, TargetError> {
        self.zero(IoOp::Discard, offset, len)
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<Via, TargetError> {
        self.zero(IoOp::WriteZeroes, offset, len)
    }
}
