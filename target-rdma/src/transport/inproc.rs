//! The in-process transport: direct calls into a [`Store`] in this process.
//! It is the reference the other transports are checked against and the
//! zero-network baseline of the benchmarks.

use std::sync::Arc;

use super::{BlobIo, TransportKind};
use crate::client::ArenaError;
use crate::store::{Store, VolumeId};

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

impl BlobIo for InProcess {
    fn kind(&self) -> TransportKind {
        TransportKind::InProcess
    }
    fn blob_bytes(&self) -> u32 {
        self.store.blob_bytes()
    }
    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<bool, ArenaError> {
        Ok(self.store.read(self.volume, key, offset, out)?)
    }
    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<(), ArenaError> {
        Ok(self.store.write(self.volume, key, offset, data)?)
    }
    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        Ok(self.store.remove(self.volume, start, end)?)
    }
    async fn flush(&self) -> Result<(), ArenaError> {
        Ok(self.store.flush()?)
    }
}
