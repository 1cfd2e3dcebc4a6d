//! `ArenaClient`: the requests of the paging protocol on one control
//! connection, many in flight, answered through oneshot channels; see the
//! module docs of [`tcp`](super).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use futures::channel::oneshot;
use parking_lot::Mutex;
use tracing::warn;
use ublk_metrics::events;

use super::config::ClientConfig;
use super::conn::{handshake, Conn, Pending, Reply};
use super::frames::{Landing, OWNED_BODY_MIN};
use super::receiver::{read_loop, Receiver};
use super::ring::Driver;
use super::shared::Shared;
use super::stats::ClientStats;
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::proto::{
    self, Endpoint, FrameError, Lease, Opcode, RailAccept, Request, Status, Welcome, CAP_RAILS,
};

/// A client of one volume on one `arenad`. Cheap to clone; clones share the
/// connection.
#[derive(Clone)]
pub struct ArenaClient {
    shared: Arc<Shared>,
}

impl ArenaClient {
    /// Connects and authenticates, failing with a message that names the
    /// peer and the cause.
    pub fn connect(cfg: ClientConfig) -> Result<Self, ArenaError> {
        let client = Self {
            shared: Arc::new(Shared {
                conn: Mutex::new(None),
                next_id: AtomicU64::new(1),
                blob_bytes: AtomicU32::new(0),
                bodies: Arc::default(),
                connects: AtomicU64::new(0),
                epoch: AtomicU64::new(cfg.epoch),
                revocations: Mutex::new(VecDeque::new()),
                handoff: cfg.driven.then(Arc::default),
                cfg,
            }),
        };
        client.conn()?;
        Ok(client)
    }

    /// The peer's answer to our HELLO on the current connection.
    pub fn welcome(&self) -> Result<Welcome, ArenaError> {
        Ok(self.conn()?.welcome.clone())
    }

    /// Blob size of the volume.
    pub fn blob_bytes(&self) -> Result<u32, ArenaError> {
        Ok(self.conn()?.welcome.blob_bytes)
    }

    /// Blob size agreed at the first handshake; it cannot change for a volume.
    pub fn session_blob_bytes(&self) -> u32 {
        self.shared.blob_bytes.load(Ordering::Relaxed)
    }

    /// Whether the connection is currently up.
    pub fn is_connected(&self) -> bool {
        self.shared
            .conn
            .lock()
            .as_ref()
            .is_some_and(|c| !c.is_dead())
    }

    /// Which connection is live now (1 for the first, +1 per reconnect),
    /// or `None` while disconnected. Leases and RDMA rails belong to one
    /// connection: a different epoch means they are gone.
    pub fn connection_epoch(&self) -> Option<u64> {
        self.shared
            .conn
            .lock()
            .as_ref()
            .filter(|c| !c.is_dead())
            .map(|c| c.epoch)
    }

    /// The current connection's epoch, connecting first when there is no
    /// live connection: a rail set up next belongs to it.
    pub(crate) fn connected_epoch(&self) -> Result<u64, ArenaError> {
        self.conn().map(|c| c.epoch)
    }

    /// Counts a write another data path made (RDMA into a leased slot;
    /// inline WRITE, COMMIT and REMOVE count themselves), so that a peer
    /// restart before the next FLUSH makes that FLUSH fail instead of
    /// claiming durability.
    pub fn record_acknowledged_write(&self) {
        self.shared.cfg.flush_domain.acknowledged();
    }

    /// Whether the peer ever restarted and lost writes acknowledged through
    /// this client's [`FlushDomain`]: its data is older than what was
    /// acknowledged.
    pub fn lost_writes(&self) -> bool {
        self.shared.cfg.flush_domain.lost()
    }

    /// Exchanges QP endpoints for `rail` on the current connection
    /// (RAIL_CONNECT); only valid when its WELCOME granted `CAP_RDMA`. A
    /// peer that did not grant `CAP_RAILS` has rail 0 only.
    pub async fn rail_connect(
        &self,
        rail: u8,
        endpoint: Endpoint,
    ) -> Result<RailAccept, ArenaError> {
        let rail = match (self.welcome()?.caps & CAP_RAILS != 0, rail) {
            (true, r) => Some(r),
            (false, 0) => None,
            // As a peer with rails answers for one it does not serve.
            (false, r) => {
                return Err(ArenaError::Status {
                    op: Opcode::RailConnect,
                    peer: self.shared.cfg.peer.clone(),
                    status: Status::NotFound,
                    message: format!("RDMA rail {r} is not served: the peer serves one rail (it did not grant CAP_RAILS)"),
                })
            }
        };
        match self.call(&Request::RailConnect { endpoint, rail }).await? {
            Reply::Rail(r) => Ok(r),
            _ => Err(self.unexpected(Opcode::RailConnect)),
        }
    }

    /// What this client's connections did (shared with the other
    /// connections of its config's device).
    pub fn stats(&self) -> &Arc<ClientStats> {
        &self.shared.cfg.stats
    }

    /// Leases the peer asked back, as `(key, token)`; the owner must COMMIT
    /// or RELEASE each.
    pub fn take_revocations(&self) -> Vec<(u64, u64)> {
        self.shared.revocations.lock().drain(..).collect()
    }

    /// The current connection, reconnecting if it is gone.
    fn conn(&self) -> Result<Arc<Conn>, ArenaError> {
        let mut slot = self.shared.conn.lock();
        if let Some(c) = slot.as_ref().filter(|c| !c.is_dead()) {
            return Ok(Arc::clone(c));
        }
        let agreed = self.shared.blob_bytes.load(Ordering::Relaxed);
        let epoch = self.shared.epoch.load(Ordering::Relaxed);
        let mut conn = handshake(&self.shared.cfg, agreed, epoch, self.shared.handoff.clone())?;
        conn.epoch = self.shared.connects.fetch_add(1, Ordering::Relaxed) + 1;
        if conn.epoch > 1 {
            self.stats().count(|s| &s.reconnects);
        }
        let conn = Arc::new(conn);
        let new = conn.welcome.generation;
        if let Some(old) = self.shared.cfg.flush_domain.connected(new) {
            self.stats().count(|s| &s.peer_restarts);
            warn!(
                event = events::PEER_RESTARTED,
                old_generation = old,
                new_generation = new
            );
        }
        self.shared
            .blob_bytes
            .store(conn.welcome.blob_bytes, Ordering::Relaxed);
        let reader_stream =
            conn.writer
                .lock()
                .stream
                .try_clone()
                .map_err(|source| ArenaError::Connect {
                    peer: self.shared.cfg.peer.clone(),
                    source,
                })?;
        let driven = self.shared.handoff.as_ref();
        let rx = Receiver::new(&self.shared, &conn, reader_stream, driven.is_some());
        match driven {
            Some(handoff) => handoff.install(rx),
            None => {
                thread::Builder::new()
                    .name("arena-client-rx".into())
                    .spawn(move || read_loop(rx))
                    .map_err(|source| ArenaError::Connect {
                        peer: self.shared.cfg.peer.clone(),
                        source,
                    })?;
            }
        }
        *slot = Some(Arc::clone(&conn));
        Ok(conn)
    }

    async fn call(&self, req: &Request<'_>) -> Result<Reply, ArenaError> {
        self.call_into(req, None).await
    }

    /// [`Self::call`], for a READ whose answer may land in `out` directly
    /// (`Reply::Landed` then means `out` holds the data). Idempotent
    /// requests are retried once over a new connection.
    async fn call_into(
        &self,
        req: &Request<'_>,
        mut out: Option<&mut [u8]>,
    ) -> Result<Reply, ArenaError> {
        let idempotent = matches!(
            req,
            Request::Read { .. } | Request::Write { .. } | Request::Remove { .. }
        );
        match self.call_once(req, out.as_deref_mut()).await {
            Err(ArenaError::Disconnected { .. }) if idempotent => {
                self.stats().count(|s| &s.request_retries);
                self.call_once(req, out).await
            }
            r => r,
        }
    }

    async fn call_once(
        &self,
        req: &Request<'_>,
        out: Option<&mut [u8]>,
    ) -> Result<Reply, ArenaError> {
        /// Gives the buffer back however the request ends, dropped included.
        struct Abandon(Arc<Landing>);
        impl Drop for Abandon {
            fn drop(&mut self) {
                self.0.abandon();
            }
        }
        let landing = out.filter(|o| o.len() >= OWNED_BODY_MIN).map(|o| {
            // SAFETY: `o` stays borrowed by this future until the `Abandon`
            // guard below drops, and its drop runs `abandon` (on completion,
            // failure, or the future being dropped); this future does not
            // touch the buffer at all.
            unsafe { Landing::new(o) }
        });
        let _abandon = landing.clone().map(Abandon);
        let peer = &self.shared.cfg.peer;
        let disconnected = |detail: &str| ArenaError::Disconnected {
            peer: peer.clone(),
            detail: detail.to_owned(),
        };
        let conn = self.conn()?;
        let _permit = conn
            .slots
            .acquire()
            .await
            .map_err(|_| disconnected("connection closed"))?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut t = conn.pending.lock();
            if let Some(why) = &t.dead {
                return Err(disconnected(why));
            }
            t.map.insert(
                id,
                Pending {
                    op: req.opcode(),
                    want_len: match req {
                        Request::Read { len, .. } => Some(*len),
                        _ => None,
                    },
                    landing,
                    deadline: Instant::now() + self.shared.cfg.request_timeout,
                    tx,
                },
            );
        }
        if let Some(h) = &self.shared.handoff {
            h.in_flight();
        }
        let mut head = Vec::with_capacity(64);
        proto::encode_request_head(&mut head, id, req);
        let payload: &[u8] = match req {
            Request::Write { data, .. } => data,
            _ => &[],
        };
        // The body's digest is taken before the lock: only the tag, which
        // needs the frame's place in the stream, is computed under it.
        let digest = conn
            .digests_bodies()
            .then(|| crate::auth::body_digest(&[&head[proto::HEADER_LEN..], payload]));
        let sent = conn.writer.lock().send(&mut head, payload, digest.as_ref());
        if let Err(e) = sent {
            conn.kill(peer, &format!("send failed: {e}"));
        }
        let reply = rx
            .await
            .unwrap_or_else(|_| Err(disconnected("answer channel closed")))?;
        if matches!(
            req,
            Request::Write { .. } | Request::Commit { .. } | Request::Remove { .. }
        ) {
            // Counted with the peer generation that acknowledged it, so a
            // restart found meanwhile by another connection is not missed.
            self.shared
                .cfg
                .flush_domain
                .acknowledged_in(conn.welcome.generation);
        }
        Ok(reply)
    }

    fn unexpected(&self, op: Opcode) -> ArenaError {
        ArenaError::Protocol {
            peer: self.shared.cfg.peer.clone(),
            source: FrameError::Unexpected {
                op: op.name(),
                detail: "answer of the wrong shape",
            },
        }
    }

    /// Writes `data` at `offset` inside blob `key`, inline on the stream.
    pub async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<(), ArenaError> {
        let req = Request::Write { key, offset, data };
        match self.call(&req).await? {
            Reply::Empty => {
                self.stats().write(data.len());
                Ok(())
            }
            _ => Err(self.unexpected(Opcode::Write)),
        }
    }

    /// Reads `out.len()` bytes at `offset` of blob `key` inline; whether the
    /// blob was found: `false` (and zeros) when it was never written. The
    /// same read as [`BlobIo::read`], which says how the payload came.
    pub async fn read_found(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> Result<bool, ArenaError> {
        let req = Request::Read {
            key,
            offset,
            len: out.len() as u32,
        };
        match self.call_into(&req, Some(&mut *out)).await? {
            Reply::Landed => {
                self.stats().read(out.len());
                Ok(true)
            }
            Reply::Data(d) if d.len() == out.len() => {
                out.copy_from_slice(&d);
                self.stats().read(d.len());
                self.shared.bodies.give(d);
                Ok(true)
            }
            Reply::NotFound => {
                out.fill(0);
                self.stats().read(0);
                Ok(false)
            }
            _ => Err(self.unexpected(Opcode::Read)),
        }
    }

    /// Leases blob `key` for writing.
    pub async fn alloc(&self, key: u64) -> Result<Lease, ArenaError> {
        match self.call(&Request::Alloc { key }).await? {
            Reply::Lease(l) => Ok(l),
            _ => Err(self.unexpected(Opcode::Alloc)),
        }
    }

    /// Leases blob `key` for reading; `None` when it holds nothing.
    pub async fn get(&self, key: u64) -> Result<Option<Lease>, ArenaError> {
        self.lease_for_reading(Request::Get { key }).await
    }

    /// Leases blob `key` for reading if it is in the peer's RAM: a
    /// [`Status::Cold`](crate::proto::Status::Cold) error when it is in swap
    /// only (read the range inline), `None` when it does not exist. Needs
    /// the peer to have granted [`CAP_COLD_GET`](crate::proto::CAP_COLD_GET).
    pub async fn get_resident(&self, key: u64) -> Result<Option<Lease>, ArenaError> {
        self.lease_for_reading(Request::GetResident { key }).await
    }

    async fn lease_for_reading(&self, req: Request<'_>) -> Result<Option<Lease>, ArenaError> {
        match self.call(&req).await? {
            Reply::Lease(l) => Ok(Some(l)),
            Reply::NotFound => Ok(None),
            _ => Err(self.unexpected(req.opcode())),
        }
    }

    /// Publishes an ALLOC lease's slot as the blob's content.
    pub async fn commit(&self, key: u64, token: u64) -> Result<(), ArenaError> {
        match self.call(&Request::Commit { key, token }).await? {
            Reply::Empty => Ok(()),
            _ => Err(self.unexpected(Opcode::Commit)),
        }
    }

    /// Drops leases, in batches of at most [`proto::MAX_RELEASE_BATCH`].
    pub async fn release(&self, tokens: &[u64]) -> Result<(), ArenaError> {
        for chunk in tokens.chunks(proto::MAX_RELEASE_BATCH as usize) {
            match self
                .call(&Request::Release {
                    tokens: chunk.to_vec(),
                })
                .await?
            {
                Reply::Empty => {}
                _ => return Err(self.unexpected(Opcode::Release)),
            }
        }
        Ok(())
    }

    /// Drops blobs `start..end`; returns how many existed.
    pub async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        match self.call(&Request::Remove { start, end }).await? {
            Reply::Count(n) => Ok(n),
            _ => Err(self.unexpected(Opcode::Remove)),
        }
    }

    /// The membership epoch this client presents (see
    /// [`ClientConfig::epoch`]).
    pub fn epoch(&self) -> u64 {
        self.shared.epoch.load(Ordering::Relaxed)
    }

    /// Moves the session to `epoch` (EPOCH): the peer raises the volume's
    /// epoch to it if it is higher, which makes every session with a lower
    /// epoch stale (their data operations answer `STALE_EPOCH`), and
    /// persists it before answering. Later connections present it in
    /// HELLO. Returns the volume's epoch. An `epoch` below the volume's
    /// answers `STALE_EPOCH`: a newer writer owns the volume.
    pub async fn raise_epoch(&self, epoch: u64) -> Result<u64, ArenaError> {
        let conn = self.conn()?;
        if conn.version < proto::VERSION_2 {
            return Err(ArenaError::Refused {
                peer: self.shared.cfg.peer.clone(),
                status: proto::Status::VersionMismatch,
                message: "the session speaks protocol version 1, which has no epochs".into(),
            });
        }
        if epoch > proto::MAX_EPOCH {
            // Not kept for later HELLOs either: every one would be refused.
            return Err(ArenaError::Refused {
                peer: self.shared.cfg.peer.clone(),
                status: proto::Status::Protocol,
                message: format!(
                    "epoch {epoch} is above the highest membership epoch {}: a writer there could never be fenced out",
                    proto::MAX_EPOCH
                ),
            });
        }
        self.shared.epoch.fetch_max(epoch, Ordering::Relaxed);
        match self.call(&Request::Epoch { epoch }).await? {
            Reply::Count(now) => Ok(now),
            _ => Err(self.unexpected(Opcode::Epoch)),
        }
    }

    /// Makes every write acknowledged before this call durable on the peer.
    pub async fn flush(&self) -> Result<(), ArenaError> {
        let lost = |(old, new)| ArenaError::UnflushedDataLost {
            peer: self.shared.cfg.peer.clone(),
            old,
            new,
        };
        let domain = &self.shared.cfg.flush_domain;
        let mark = domain.flush_start().map_err(lost)?;
        match self.call(&Request::Flush).await? {
            Reply::Empty => domain.flush_done(mark).map_err(lost),
            _ => Err(self.unexpected(Opcode::Flush)),
        }
    }

    /// The receiving side of a [`ClientConfig::driven`] client, for its
    /// owner's loop to run ([`Driver::run`]); `None` for a client with
    /// reader threads.
    pub fn driver(&self) -> Option<Driver> {
        Some(Driver {
            client: Arc::downgrade(&self.shared),
            handoff: Arc::clone(self.shared.handoff.as_ref()?),
        })
    }

    /// Closes the connection; the next call reconnects.
    pub fn disconnect(&self) {
        if let Some(c) = self.shared.conn.lock().take() {
            c.kill(&self.shared.cfg.peer, "closed by the client");
        }
    }
}

impl BlobIo for ArenaClient {
    fn transport(&self) -> Transport {
        Transport::Tcp
    }
    fn blob_bytes(&self) -> u32 {
        self.session_blob_bytes()
    }
    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        let found = self.read_found(key, offset, out).await?;
        Ok(if found { Via::Tcp } else { Via::Nothing })
    }
    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        ArenaClient::write(self, key, offset, data).await?;
        Ok(Via::Tcp)
    }
    fn remove(&self, start: u64, end: u64) -> impl Future<Output = Result<u64, ArenaError>> {
        ArenaClient::remove(self, start, end)
    }
    fn flush(&self) -> impl Future<Output = Result<(), ArenaError>> {
        ArenaClient::flush(self)
    }
}
