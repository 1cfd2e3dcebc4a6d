//! A queue's way to its volume, whichever kind the volume is: the queue's
//! [`Session`] for a volume on one peer, or the replication core's
//! [`ReplicatedIo`] over one session per member. The block target runs on
//! it directly, so a request crosses from ublkd into this crate once and
//! stays here down to the wire.

use std::sync::Arc;

use super::ReplicatedIo;
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::client::Session;

/// One queue's way to its volume. Cloning shares it.
#[derive(Clone)]
pub struct VolumeIo {
    path: Path,
}

#[derive(Clone)]
enum Path {
    /// A volume on one peer: the queue's session.
    Single(Session),
    /// A replicated volume: the core's request path for this queue, and
    /// the queue's session of each member it was opened with (for the
    /// peer monitor and the data-path report).
    Replicated {
        io: Arc<ReplicatedIo<Session>>,
        sessions: Vec<Session>,
    },
}

impl VolumeIo {
    /// A volume on one peer, over `session`.
    pub fn single(session: Session) -> Self {
        Self {
            path: Path::Single(session),
        }
    }

    /// A replicated volume: `io` is the queue's request path, `sessions`
    /// the queue's session of every member (at least one).
    pub fn replicated(io: ReplicatedIo<Session>, sessions: Vec<Session>) -> Self {
        Self {
            path: Path::Replicated {
                io: Arc::new(io),
                sessions,
            },
        }
    }

    /// The queue's first session (the only one of a volume on one peer):
    /// its handshake answers (quota, blob size) hold for every member.
    pub fn session(&self) -> &Session {
        &self.sessions()[0]
    }

    /// The queue's sessions, one per member it was opened with.
    pub fn sessions(&self) -> &[Session] {
        match &self.path {
            Path::Single(s) => std::slice::from_ref(s),
            Path::Replicated { sessions, .. } => sessions,
        }
    }
}

impl BlobIo for VolumeIo {
    fn transport(&self) -> Transport {
        match &self.path {
            Path::Single(s) => s.transport(),
            Path::Replicated { io, .. } => io.transport(),
        }
    }

    fn blob_bytes(&self) -> u32 {
        match &self.path {
            Path::Single(s) => s.blob_bytes(),
            Path::Replicated { io, .. } => io.blob_bytes(),
        }
    }

    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        match &self.path {
            Path::Single(s) => s.read(key, offset, out).await,
            Path::Replicated { io, .. } => io.read(key, offset, out).await,
        }
    }

    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        match &self.path {
            Path::Single(s) => s.write(key, offset, data).await,
            Path::Replicated { io, .. } => io.write(key, offset, data).await,
        }
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        match &self.path {
            Path::Single(s) => s.remove(start, end).await,
            Path::Replicated { io, .. } => io.remove(start, end).await,
        }
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        match &self.path {
            Path::Single(s) => s.flush().await,
            Path::Replicated { io, .. } => io.flush().await,
        }
    }
}
