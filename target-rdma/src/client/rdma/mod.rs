//! `RdmaTransport`: blob payloads by one-sided RDMA into the peer's arena,
//! with the control stream ([`ArenaClient`]) for leases and the counted TCP
//! inline path as fallback.
//!
//! One transport per ublk queue: one control connection, one QP (a *rail*),
//! one registered buffer pool. A request leases the blob's slot (GET/ALLOC,
//! or a cached lease), moves its byte range with RDMA READ/WRITE at
//! `arena_base + slot_offset + offset`, then ends the lease (RELEASE/COMMIT)
//! unless it is cached. Many requests are in flight at once, bounded by the
//! send queue depth; nothing holds a lock across an await.
//!
//! Local memory: a buffer inside a region registered with
//! [`RdmaTransport::register_io_buffers`] (ublkd's I/O buffers) is used in
//! place, no copy. Other memory goes through a pool buffer (registered once,
//! one copy, counted as a bounce), or, when the pool is exhausted, is
//! registered for that one request (counted). What cannot go by RDMA goes
//! inline on TCP and is counted by [`TcpReason`].
//!
//! The transports of one block device form a [`TransportGroup`]: leases are
//! cached per connection, but a FLUSH or DISCARD on one queue concerns the
//! blobs every queue writes, so it first ends the other members' affected
//! cached leases.
//!
//! One file per concern: `rail` (the QP and the per-payload route),
//! `leases` (the lease cache, the group, waiting out BUSY), `pool` (local
//! memory: registered regions, the bounce pool, per-transfer
//! registrations), `completion` (wr ids, deadlines, the completion thread),
//! `driver` (the completions reaped on the owner's event loop instead),
//! `stats` (counters and their driver report); this file is the data path
//! that uses them.

mod completion;
mod driver;
mod leases;
mod pool;
mod rail;
mod stats;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

pub use driver::CqDriver;
pub use leases::TransportGroup;
pub use stats::{RdmaDriverStats, RdmaStats, TcpReason};

use super::driven::CqHandoff;
use super::tcp::{ArenaClient, ClientConfig};
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::proto::{Lease, Opcode, Status, CAP_RDMA};
use crate::rdma::{RdmaError, RdmaOp, RdmaProvider, WorkRequest};
use completion::{CompletionEngine, OpError};
use leases::{HeldLease, LeaseCache, OwnLeases, Removing};
use pool::{Local, Memory, Pool};
use rail::{Rail, RailState};

/// Tuning of one RDMA transport.
#[derive(Clone, Debug)]
pub struct RdmaTransportConfig {
    /// Payloads smaller than this go inline on TCP: one control round trip
    /// costs more than the copy.
    pub min_rdma_bytes: u32,
    /// Size of one pool buffer; larger payloads go inline on TCP.
    pub buffer_bytes: u32,
    /// Pool buffers (registered once, as one region).
    pub pool_buffers: u32,
    /// Send queue depth: RDMA requests in flight at once.
    pub sq_depth: u32,
    /// Limit for one RDMA READ/WRITE, from post to completion.
    pub op_timeout: Duration,
    /// Leases kept across requests (hot blobs skip the control round trip).
    /// Each pins an arena slot, so keep it well below the arena's slots.
    pub lease_cache: usize,
    /// `transport = rdma`: fail at connect unless RDMA is negotiated.
    pub require_rdma: bool,
    /// Completions are reaped by the owner's event loop running
    /// [`RdmaTransport::cq_driver`] (a ublk queue's ring), not by a
    /// completion thread of the rail's own.
    pub driven: bool,
    /// Driven: how long the driver polls the completion queue for a
    /// transfer in flight before it sleeps on the completion channel.
    pub busy_poll: Duration,
}

impl Default for RdmaTransportConfig {
    fn default() -> Self {
        Self {
            min_rdma_bytes: 512,
            buffer_bytes: 1 << 20,
            pool_buffers: 32,
            sq_depth: 64,
            op_timeout: Duration::from_secs(5),
            lease_cache: 64,
            require_rdma: false,
            driven: false,
            busy_poll: Duration::ZERO,
        }
    }
}

/// Why an RDMA transport could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RdmaConnectError {
    /// The control connection failed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// `transport = rdma` and RDMA could not be negotiated.
    #[error("transport = rdma but RDMA to arena peer {peer} is unavailable: {reason}")]
    Unavailable {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
}

/// Fails the QP if a request is abandoned (its future dropped) mid-flight,
/// so the device stops touching the buffer the request no longer owns.
struct InFlight<'a> {
    engine: &'a CompletionEngine,
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.engine.fail("a request was abandoned while in flight");
        }
    }
}

/// The RDMA data path of one queue. See the module docs.
pub struct RdmaTransport {
    client: ArenaClient,
    provider: Option<Arc<dyn RdmaProvider>>,
    cfg: RdmaTransportConfig,
    stats: Arc<RdmaStats>,
    rail: Mutex<RailState>,
    leases: Mutex<LeaseCache>,
    // Dropped after `rail` (its QP) is gone: the device may touch it until then.
    memory: Memory,
    slots: Semaphore,
    /// Our leases at the peer: a BUSY peer (every slot pinned) may be
    /// pinned by them, so a BUSY request waits for one to end and retries.
    pinned: Mutex<OwnLeases>,
    peer: String,
    group: OnceLock<Arc<TransportGroup>>,
    /// Driven: where each new rail's completion engine goes to the driver.
    cq: Option<Arc<CqHandoff<CompletionEngine>>>,
}

/// Times a write is done again because a racing REMOVE took its blob
/// between ALLOC and COMMIT; a fourth loss fails the request.
const MAX_LEASE_LOST: u32 = 3;

impl RdmaTransport {
    /// Connects the control stream and, when both sides can, brings up the
    /// rail. `provider` is the local device, or why there is none.
    /// With `require_rdma` a missing rail is an error; otherwise the
    /// transport serves TCP and says why in [`rdma_status`](Self::rdma_status).
    pub fn connect(
        mut client_cfg: ClientConfig,
        provider: Result<Arc<dyn RdmaProvider>, String>,
        cfg: RdmaTransportConfig,
    ) -> Result<Self, RdmaConnectError> {
        let peer = client_cfg.peer.clone();
        client_cfg.offer_rdma = provider.is_ok();
        let client = ArenaClient::connect(client_cfg)?;
        let stats = Arc::new(RdmaStats::default());
        let (provider, state) = match provider {
            Ok(p) => (Some(p), RailState::Down(Instant::now())),
            Err(why) => (
                None,
                RailState::Off(
                    TcpReason::NoLocalDevice,
                    format!("no local RDMA device: {why}"),
                ),
            ),
        };
        let mut state = state;
        if provider.is_some() && client.welcome()?.caps & CAP_RDMA == 0 {
            state = RailState::Off(
                TcpReason::Declined,
                "the arena peer declined RDMA (no RDMA device there)".into(),
            );
        }
        let pool = match (&provider, &state) {
            (Some(p), RailState::Down(_)) => {
                match Pool::new(p.as_ref(), cfg.pool_buffers, cfg.buffer_bytes) {
                    Ok(pool) => {
                        stats
                            .pool_buffers
                            .store(cfg.pool_buffers.into(), Ordering::Relaxed);
                        Some(pool)
                    }
                    Err(e) => {
                        stats.inc(|s| &s.registration_failures);
                        state = RailState::Off(TcpReason::RegistrationFailed, e.to_string());
                        None
                    }
                }
            }
            _ => None,
        };
        let cfg_driven = cfg.driven;
        let t = Self {
            client,
            memory: Memory::new(provider.clone(), pool),
            provider,
            slots: Semaphore::new(cfg.sq_depth as usize),
            leases: Mutex::new(LeaseCache::new(cfg.lease_cache)),
            cfg,
            stats,
            rail: Mutex::new(state),
            pinned: Mutex::new(OwnLeases::default()),
            peer,
            group: OnceLock::new(),
            cq: cfg_driven.then(Arc::default),
        };
        if matches!(*t.rail.lock(), RailState::Down(_)) {
            if let Err(e) = futures::executor::block_on(t.establish()) {
                *t.rail.lock() = RailState::Off(TcpReason::Declined, e);
            }
        }
        match (&*t.rail.lock(), t.cfg.require_rdma) {
            (RailState::Off(_, why), true) => {
                return Err(RdmaConnectError::Unavailable {
                    peer: t.peer.clone(),
                    reason: why.clone(),
                })
            }
            (RailState::Off(_, why), false) => {
                info!(event = "rdma.unavailable", peer = %t.peer, reason = %why, "payloads go over TCP");
            }
            _ => {}
        }
        Ok(t)
    }

    /// Registers memory the caller will pass to reads and writes (ublkd's
    /// per-queue I/O buffers), so those transfers need no copy.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must stay valid until the transport is dropped,
    /// and the caller must not touch a buffer while a request using it runs.
    pub unsafe fn register_io_buffers(&self, addr: *mut u8, len: usize) -> Result<(), RdmaError> {
        // SAFETY: forwarded contract: valid until the transport (which owns
        // the region in `memory`, dropped after its QP) is dropped.
        unsafe { self.memory.register(addr, len, &self.stats) }
    }

    /// The driver statistics (shared; cheap to read at any time).
    pub fn stats(&self) -> &Arc<RdmaStats> {
        &self.stats
    }

    /// `Ok(device)` while payloads go by RDMA, or why they go over TCP.
    pub fn rdma_status(&self) -> Result<String, String> {
        match &*self.rail.lock() {
            RailState::Off(_, why) => Err(why.clone()),
            _ => Ok(self
                .provider
                .as_ref()
                .map(|p| p.device_name())
                .unwrap_or_default()),
        }
    }

    /// Whether payloads go by RDMA (the rail is up, or down and being
    /// re-established); `false` when this transport serves TCP only. Cheap:
    /// no allocation, one short lock.
    pub fn uses_rdma(&self) -> bool {
        !matches!(*self.rail.lock(), RailState::Off(..))
    }

    /// The completion driver of a driven transport (`RdmaTransportConfig::driven`),
    /// which its owner must run on its event loop; `None` otherwise.
    pub fn cq_driver(&self) -> Option<CqDriver> {
        self.cq.as_ref().map(|handoff| CqDriver {
            handoff: Arc::clone(handoff),
            busy_poll: self.cfg.busy_poll,
        })
    }

    /// The control-stream client (leases, inline fallback).
    pub fn client(&self) -> &ArenaClient {
        &self.client
    }

    /// One RDMA transfer of `len` bytes between `local` and the leased slot.
    async fn transfer(
        &self,
        rail: &Rail,
        op: RdmaOp,
        lease: &Lease,
        offset: u32,
        local: &Local<'_>,
        len: usize,
    ) -> Result<(), OpError> {
        let remote = lease.slot_offset + u64::from(offset);
        if remote.saturating_add(len as u64) > rail.remote.arena_len {
            self.stats.inc(|s| &s.rdma_protocol_errors);
            return Err(OpError::QpDown(format!(
                "lease slot offset {} + {offset} + {len} lies outside the peer's {}-byte arena",
                lease.slot_offset, rail.remote.arena_len
            )));
        }
        // Isolated per lease, the lease's own key (`keyed` saw to it);
        // otherwise the arena's (a shared-region server names it in
        // RAIL_CONNECT).
        let rkey = match (lease.rkey, rail.remote.rkey) {
            (Some(k), _) => k,
            (None, k) if k != 0 => k,
            (None, _) => {
                return Err(OpError::QpDown(format!(
                    "lease token {} carries no RDMA key and the peer names none for its arena",
                    lease.token
                )))
            }
        };
        let (lkey, addr) = local.lkey_addr();
        let _permit = self
            .slots
            .acquire()
            .await
            .map_err(|_| OpError::QpDown("transport closed".into()))?;
        let wr = WorkRequest {
            wr_id: 0,
            op,
            local_addr: addr as u64,
            lkey,
            len: len as u32,
            remote_addr: rail.remote.arena_base + remote,
            rkey,
        };
        let rx = rail
            .engine
            .submit(wr)
            .inspect_err(|_| self.stats.inc_op(op, |s| &s.rdma_failed, |o| &o.failed))?;
        let mut guard = InFlight {
            engine: &rail.engine,
            done: false,
        };
        let r = rx
            .await
            .unwrap_or_else(|_| Err(OpError::QpDown("completion thread gone".into())));
        guard.done = true;
        match &r {
            Ok(()) => {
                self.stats
                    .inc_op(op, |s| &s.rdma_transferred, |o| &o.transferred);
                let bytes = if op == RdmaOp::Read {
                    &self.stats.bytes_read
                } else {
                    &self.stats.bytes_written
                };
                bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
            Err(OpError::TimedOut(_)) => {
                self.stats
                    .inc_op(op, |s| &s.rdma_timed_out, |o| &o.timed_out)
            }
            Err(_) => self.stats.inc_op(op, |s| &s.rdma_failed, |o| &o.failed),
        }
        r
    }

    /// Moves a range by RDMA, retrying once over a re-established rail.
    /// `Err(reason)` sends the request to TCP (a failover after an attempt
    /// was made is counted as declined).
    async fn rdma_move(
        &self,
        op: RdmaOp,
        key: u64,
        offset: u32,
        addr: usize,
        len: usize,
        copy_in: Option<&[u8]>,
    ) -> Result<Option<MoveDone<'_>>, Carry> {
        let mut rail = self.route(len).await.map_err(|reason| Carry::Tcp {
            reason,
            failover: false,
        })?;
        let write = op == RdmaOp::Write;
        let held = match self.lease(key, write).await {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(None),
            Err(e) if e.status() == Some(Status::Busy) => {
                return Err(Carry::Tcp {
                    reason: TcpReason::ArenaBusy,
                    failover: false,
                })
            }
            Err(e) => return Err(Carry::Failed(e)),
        };
        let mut held = self
            .keyed(held, &rail, write, false)
            .await
            .map_err(|reason| Carry::Tcp {
                reason,
                failover: false,
            })?;
        let mut attempted = false;
        let result = loop {
            let local = match self.memory.local(addr, len, &self.stats) {
                Ok(l) => l,
                Err(reason) => break Err(reason),
            };
            if let Some(src) = copy_in {
                local.copy_in(src);
            }
            match self
                .transfer(&rail, op, &held.lease, offset, &local, len)
                .await
            {
                Ok(()) => break Ok(local),
                Err(e) => {
                    warn!(event = "rdma.attempt_failed", op = ?op, error = %e, retry = !attempted);
                    if attempted {
                        break Err(TcpReason::QpError);
                    }
                    attempted = true;
                    drop(local);
                    match self.route(len).await {
                        Ok(r) if self.client.connection_epoch() == Some(rail.epoch) => rail = r,
                        _ => break Err(TcpReason::QpError),
                    }
                    held = match self.keyed(held, &rail, write, true).await {
                        Ok(h) => h,
                        Err(reason) => {
                            self.stats.inc_op(op, |s| &s.rdma_declined, |o| &o.declined);
                            return Err(Carry::Tcp {
                                reason,
                                failover: true,
                            });
                        }
                    };
                }
            }
        };
        match result {
            Ok(local) => Ok(Some(MoveDone { held, local })),
            Err(reason) => {
                if attempted {
                    self.stats.inc_op(op, |s| &s.rdma_declined, |o| &o.declined);
                }
                // A write lease must still end; the TCP path then writes the range.
                let _ = self.unlease(held, false).await;
                Err(Carry::Tcp {
                    reason,
                    failover: attempted,
                })
            }
        }
    }
}

impl RdmaTransport {
    /// Over a rail isolated per lease (its RAIL_CONNECT named no arena
    /// key), the lease's own key must reach the slot through `rail`: after
    /// a failed attempt (`retry`; the rail may be new, and the key died
    /// with the old one, or was ended by force) the lease is given back
    /// and leased anew, and a lease the peer answered without a key
    /// (it could not register one) is given back and its payload goes
    /// inline on TCP. Over a shared-region rail, `held` as is.
    async fn keyed(
        &self,
        held: HeldLease,
        rail: &Rail,
        write: bool,
        retry: bool,
    ) -> Result<HeldLease, TcpReason> {
        if rail.remote.rkey != 0 {
            return Ok(held);
        }
        let held = if retry {
            self.relet(held, write).await.ok_or(TcpReason::QpError)?
        } else {
            held
        };
        if held.lease.rkey.is_none() {
            self.give_back(held).await;
            return Err(TcpReason::Declined);
        }
        Ok(held)
    }
}

/// A transfer that moved its payload: the lease to end and the local
/// memory (kept until a READ's bytes are copied out of a pool buffer).
struct MoveDone<'a> {
    held: HeldLease,
    local: Local<'a>,
}

/// Why a payload did not move by RDMA.
enum Carry {
    /// Serve it inline on TCP; `failover` when an RDMA attempt failed first.
    Tcp {
        reason: TcpReason,
        failover: bool,
    },
    Failed(ArenaError),
}

/// How a payload that went inline on TCP went: a failover when an RDMA
/// attempt failed first.
fn tcp_via(failover: bool) -> Via {
    if failover {
        Via::Failover
    } else {
        Via::Tcp
    }
}

impl RdmaTransport {
    /// Refuses a range past the blob's end as the peer would (PROTOCOL), before
    /// any lease is asked for.
    fn check_range(&self, op: Opcode, offset: u32, len: usize) -> Result<(), ArenaError> {
        let blob = self.blob_bytes();
        if (offset as usize).saturating_add(len) > blob as usize {
            return Err(ArenaError::Status {
                op,
                peer: self.peer.clone(),
                status: Status::Protocol,
                message: format!(
                    "byte range at offset {offset} of length {len} exceeds the blob size {blob}"
                ),
            });
        }
        Ok(())
    }

    /// Sends a payload inline on TCP, and again after each BUSY answer for
    /// as long as [`busy_retry`](Self::busy_retry) says to (our own leases
    /// may be what pins the peer's slots).
    async fn until_not_busy<T>(
        &self,
        mut send: impl AsyncFnMut() -> Result<T, ArenaError>,
    ) -> Result<T, ArenaError> {
        let mut busy = self.busy_start(false);
        loop {
            match send().await {
                Err(e) if e.status() == Some(Status::Busy) && self.busy_retry(&mut busy).await => {}
                r => return r,
            }
        }
    }

    async fn read_via(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        self.check_range(Opcode::Read, offset, out.len())?;
        self.honour_revocations().await;
        let len = out.len();
        match self
            .rdma_move(
                RdmaOp::Read,
                key,
                offset,
                out.as_mut_ptr() as usize,
                len,
                None,
            )
            .await
        {
            Ok(None) => {
                out.fill(0);
                Ok(Via::Nothing)
            }
            Ok(Some(MoveDone { held, local })) => {
                local.copy_out(out);
                drop(local);
                self.unlease(held, false).await?;
                Ok(Via::Rdma)
            }
            Err(Carry::Failed(e)) => Err(e),
            Err(Carry::Tcp { reason, failover }) => {
                self.stats.tcp_payload(RdmaOp::Read, reason, len);
                let found = self
                    .until_not_busy(async || self.client.read_found(key, offset, out).await)
                    .await?;
                // A failover counts even when the blob went away meanwhile.
                Ok(match (found, failover) {
                    (false, false) => Via::Nothing,
                    _ => tcp_via(failover),
                })
            }
        }
    }

    async fn write_via(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        self.check_range(Opcode::Write, offset, data.len())?;
        let mut lost = 0;
        loop {
            self.honour_revocations().await;
            match self.write_once(key, offset, data).await {
                // Another connection removed the blob between our ALLOC and
                // COMMIT (a DISCARD racing this write): the write counts as
                // before the remove, so it is done again, after it.
                Err(e) if e.status() == Some(Status::LeaseLost) && lost < MAX_LEASE_LOST => {
                    lost += 1;
                    debug!(event = "rdma.lease_lost", key, attempt = lost);
                }
                r => return r,
            }
        }
    }

    async fn write_once(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        match self
            .rdma_move(
                RdmaOp::Write,
                key,
                offset,
                data.as_ptr() as usize,
                data.len(),
                Some(data),
            )
            .await
        {
            Ok(Some(MoveDone { held, local })) => {
                drop(local);
                self.unlease(held, true).await.map(|()| Via::Rdma)
            }
            Ok(None) => unreachable_alloc(key),
            Err(Carry::Failed(e)) => Err(e),
            Err(Carry::Tcp { reason, failover }) => {
                self.stats.tcp_payload(RdmaOp::Write, reason, data.len());
                self.until_not_busy(async || self.client.write(key, offset, data).await)
                    .await?;
                Ok(tcp_via(failover))
            }
        }
    }
}

impl BlobIo for RdmaTransport {
    fn transport(&self) -> Transport {
        if self.uses_rdma() {
            Transport::Rdma
        } else {
            Transport::Tcp
        }
    }

    fn blob_bytes(&self) -> u32 {
        self.client.session_blob_bytes()
    }

    fn read(
        &self,
        key: u64,
        offset: u32,
        out: &mut [u8],
    ) -> impl Future<Output = Result<Via, ArenaError>> {
        self.read_via(key, offset, out)
    }

    fn write(
        &self,
        key: u64,
        offset: u32,
        data: &[u8],
    ) -> impl Future<Output = Result<Via, ArenaError>> {
        self.write_via(key, offset, data)
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        self.honour_revocations().await;
        // Leases on removed blobs would outlive them, on any queue: keep
        // leases granted until the REMOVE is done out of every cache, and
        // give the cached ones back first, without committing what the
        // blobs are about to lose.
        let others = self.others();
        let members: Vec<&RdmaTransport> = others.iter().map(|t| &**t).chain([self]).collect();
        let _removing = Removing::start(&members);
        for t in &members {
            t.forget_range(start, end).await?;
        }
        self.client.remove(start, end).await
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        self.honour_revocations().await;
        // Writes acknowledged through cached leases, on any queue, are
        // COMMITted first, so the peer's FLUSH covers them.
        let others = self.others();
        for t in others.iter().map(|t| &**t).chain([self]) {
            t.commit_dirty().await?;
        }
        self.client.flush().await
    }
}

/// ALLOC always yields a lease; `Ok(None)` is only possible for reads.
fn unreachable_alloc(key: u64) -> Result<Via, ArenaError> {
    Err(ArenaError::Disconnected {
        peer: String::new(),
        detail: format!("ALLOC of key {key} answered without a lease"),
    })
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        // Tear the QP down before the pool and regions it may touch.
        *self.rail.lock() = RailState::Down(Instant::now());
        if let Some(cq) = &self.cq {
            cq.close();
        }
    }
}
