//! The in-process transport: [`BlobIo`] by direct calls into a [`Store`] in
//! this process. It is the reference the other transports are checked
//! against and the zero-network baseline of the benchmarks. Its failures are
//! the statuses the server would answer ([`StoreError::status`]), so it
//! returns the same [`ArenaError`] as a TCP session for the same failure.

use std::sync::Arc;

use super::api::Store;
use super::error::StoreError;
use super::ids::VolumeId;
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::proto::Opcode;

/// One volume of a local store.
#[derive(Clone)]
pub struct InProcess {
    store: Arc<Store>,
    volume: VolumeId,
}

impl InProcess {
    /// Serves `volume` of `store`.
    pub fn new(store: Arc<Store>, volume: VolumeId) -> Self {
        Self { store, volume }
    }
}

/// The error a TCP session would get for `e` answering `op`.
fn answered(op: Opcode) -> impl Fn(StoreError) -> ArenaError {
    move |e| ArenaError::Status {
        op,
        peer: "in-process store".into(),
        status: e.status(),
        message: e.to_string(),
    }
}

impl BlobIo for InProcess {
    fn transport(&self) -> Transport {
        Transport::InProcess
    }
    fn blob_bytes(&self) -> u32 {
        self.store.blob_bytes()
    }
    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        let found = self
            .store
            .read(self.volume, key, offset, out)
            .map_err(answered(Opcode::Read))?;
        Ok(if found { Via::InProcess } else { Via::Nothing })
    }
    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        self.store
            .write(self.volume, key, offset, data)
            .map_err(answered(Opcode::Write))?;
        Ok(Via::InProcess)
    }
    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        self.store
            .remove(self.volume, start, end)
            .map_err(answered(Opcode::Remove))
    }
    async fn flush(&self) -> Result<(), ArenaError> {
        self.store.flush().map_err(answered(Opcode::Flush))
    }
}
