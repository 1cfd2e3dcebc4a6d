//! [`RdmaTransport`]: the data path of one queue. A payload is routed
//! (`Rails`), its blob leased (`Leases`), its local memory found
//! (`Memory`), and it moves by one RDMA READ or WRITE whose completion the
//! rail's engine delivers; what cannot go by RDMA goes inline on TCP.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use tokio::sync::Semaphore;
use tracing::{debug, info, warn};
use ublk_metrics::events;

use super::completion::{CompletionEngine, OpError};
use super::config::RdmaTransportConfig;
use super::driver::CqDriver;
use super::group::{Removing, TransportGroup};
use super::lease_cache::HeldLease;
use super::leases::{Leases, Member, Want};
use super::pool::{Local, Memory, Pool};
use super::rail::{Rail, RailState};
use super::rails::Rails;
use super::stats::{RdmaStats, TcpReason};
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::client::tcp::{ArenaClient, ClientConfig};
use crate::proto::{Lease, Opcode, Status, CAP_COLD_GET, CAP_RDMA};
use crate::rdma::{RdmaError, RdmaOp, RdmaProvider, WorkRequest};

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
    stats: Arc<RdmaStats>,
    rails: Rails,
    leases: Leases,
    // Dropped after `rails` (its QP) is gone: the device may touch it until then.
    memory: Memory,
    slots: Semaphore,
    peer: String,
    group: OnceLock<Arc<TransportGroup>>,
    /// The peer granted `CAP_COLD_GET`: part of a blob it holds in swap
    /// only is read inline at its size (GET_RESIDENT answers COLD).
    cold_get: bool,
}

/// Times a write is done again because a racing REMOVE took its blob
/// between ALLOC and COMMIT; a fourth loss fails the request.
const MAX_LEASE_LOST: u32 = 3;

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
        let caps = client.welcome()?.caps;
        if provider.is_some() && caps & CAP_RDMA == 0 {
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
        let require_rdma = cfg.require_rdma;
        let t = Self {
            client,
            memory: Memory::new(provider.clone(), pool),
            slots: Semaphore::new(cfg.sq_depth as usize),
            leases: Leases::new(cfg.lease_cache, Arc::clone(&stats)),
            rails: Rails::new(provider, state, cfg, Arc::clone(&stats), peer.clone()),
            stats,
            peer,
            group: OnceLock::new(),
            cold_get: caps & CAP_COLD_GET != 0,
        };
        if t.rails.is_down() {
            if let Err(e) = futures::executor::block_on(t.rails.establish(&t.client, &t.leases)) {
                t.rails.turn_off(TcpReason::Declined, e);
            }
        }
        match (t.rails.off(), require_rdma) {
            (Some(why), true) => {
                return Err(RdmaConnectError::Unavailable {
                    peer: t.peer.clone(),
                    reason: why,
                })
            }
            (Some(why), false) => {
                info!(event = events::RDMA_UNAVAILABLE, peer = %t.peer, reason = %why, "payloads go over TCP");
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
        self.rails.status()
    }

    /// Whether payloads go by RDMA (the rail is up, or down and being
    /// re-established); `false` when this transport serves TCP only. Cheap:
    /// no allocation, one short lock.
    pub fn uses_rdma(&self) -> bool {
        self.rails.uses_rdma()
    }

    /// The completion driver of a driven transport (`RdmaTransportConfig::driven`),
    /// which its owner must run on its event loop; `None` otherwise.
    pub fn cq_driver(&self) -> Option<CqDriver> {
        self.rails.cq_driver()
    }

    /// The control-stream client (leases, inline fallback).
    pub fn client(&self) -> &ArenaClient {
        &self.client
    }

    /// Makes this transport a member of `group` (the other queues of its
    /// device). A transport joins at most one group; later calls are ignored.
    pub fn join(self: &Arc<Self>, group: &Arc<TransportGroup>) {
        if self.group.set(Arc::clone(group)).is_ok() {
            let me: Weak<dyn Member> = Arc::downgrade(self) as Weak<dyn Member>;
            group.add(me);
        }
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
        let rkey = match (lease.rkeys[0], rail.remote.rkey) {
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
        let mut rail = self
            .rails
            .route(len, &self.client, &self.leases)
            .await
            .map_err(|reason| Carry::Tcp {
                reason,
                failover: false,
            })?;
        let write = op == RdmaOp::Write;
        let want = match op {
            RdmaOp::Write => Want::Write,
            // Part of a blob in swap only is read inline at its size; the
            // whole of one is faulted in and read by RDMA.
            RdmaOp::Read if self.cold_get && len < self.blob_bytes() as usize => {
                Want::ReadIfResident
            }
            RdmaOp::Read => Want::Read,
        };
        let held = match self.leases.lease(self, key, want).await {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(None),
            Err(e) if e.status() == Some(Status::Busy) => {
                return Err(Carry::Tcp {
                    reason: TcpReason::ArenaBusy,
                    failover: false,
                })
            }
            Err(e) if e.status() == Some(Status::Cold) => {
                return Err(Carry::Tcp {
                    reason: TcpReason::ColdBlob,
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
                    warn!(event = events::RDMA_ATTEMPT_FAILED, op = ?op, error = %e, retry = !attempted);
                    if attempted {
                        break Err(TcpReason::QpError);
                    }
                    attempted = true;
                    drop(local);
                    match self.rails.route(len, &self.client, &self.leases).await {
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
                let _ = self.leases.unlease(&self.client, held, false).await;
                Err(Carry::Tcp {
                    reason,
                    failover: attempted,
                })
            }
        }
    }

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
            self.leases
                .relet(self, held, write)
                .await
                .ok_or(TcpReason::QpError)?
        } else {
            held
        };
        if held.lease.rkeys[0].is_none() {
            self.leases.give_back(&self.client, held).await;
            return Err(TcpReason::Declined);
        }
        Ok(held)
    }

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

    async fn read_via(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        self.check_range(Opcode::Read, offset, out.len())?;
        self.leases.honour_revocations(&self.client).await;
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
                self.leases.unlease(&self.client, held, false).await?;
                Ok(Via::Rdma)
            }
            Err(Carry::Failed(e)) => Err(e),
            Err(Carry::Tcp { reason, failover }) => {
                self.stats.tcp_payload(RdmaOp::Read, reason, len);
                let found = self
                    .leases
                    .until_not_busy(self, async || {
                        self.client.read_found(key, offset, out).await
                    })
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
            self.leases.honour_revocations(&self.client).await;
            match self.write_once(key, offset, data).await {
                // Another connection removed the blob between our ALLOC and
                // COMMIT (a DISCARD racing this write): the write counts as
                // before the remove, so it is done again, after it.
                Err(e) if e.status() == Some(Status::LeaseLost) && lost < MAX_LEASE_LOST => {
                    lost += 1;
                    debug!(event = events::RDMA_LEASE_LOST, key, attempt = lost);
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
                self.leases
                    .unlease(&self.client, held, true)
                    .await
                    .map(|()| Via::Rdma)
            }
            Ok(None) => unreachable_alloc(key),
            Err(Carry::Failed(e)) => Err(e),
            Err(Carry::Tcp { reason, failover }) => {
                self.stats.tcp_payload(RdmaOp::Write, reason, data.len());
                self.leases
                    .until_not_busy(self, async || self.client.write(key, offset, data).await)
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
        self.leases.honour_revocations(&self.client).await;
        // Leases on removed blobs would outlive them, on any queue: keep
        // leases granted until the REMOVE is done out of every cache, and
        // give the cached ones back first, without committing what the
        // blobs are about to lose.
        let others = self.others();
        let members: Vec<&dyn Member> = others
            .iter()
            .map(|t| &**t)
            .chain([self as &dyn Member])
            .collect();
        let _removing = Removing::start(&members);
        for t in &members {
            t.leases().forget_range(t.client(), start, end).await?;
        }
        self.client.remove(start, end).await
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        self.leases.honour_revocations(&self.client).await;
        // Writes acknowledged through cached leases, on any queue, are
        // COMMITted first, so the peer's FLUSH covers them.
        let others = self.others();
        for t in others.iter().map(|t| &**t).chain([self as &dyn Member]) {
            t.leases().commit_dirty(t.client()).await?;
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
        self.rails.shut_down();
    }
}

impl Member for RdmaTransport {
    fn client(&self) -> &ArenaClient {
        &self.client
    }

    fn leases(&self) -> &Leases {
        &self.leases
    }

    fn others(&self) -> Vec<Arc<dyn Member>> {
        self.group.get().map_or_else(Vec::new, |g| g.others(self))
    }
}
