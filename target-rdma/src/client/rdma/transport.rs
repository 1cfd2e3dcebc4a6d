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
use super::rail::RailState;
use super::rail_slot::RailSlot;
use super::rails::{Chosen, Rails};
use super::stats::{RdmaStats, TcpReason};
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::client::tcp::{ArenaClient, ClientConfig};
use crate::proto::{Lease, Opcode, Status, CAP_COLD_GET, CAP_RDMA, MAX_RAILS};
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
/// so the device stops touching the buffer the request no longer owns, and
/// takes its bytes off the rail's outstanding count.
struct InFlight<'a> {
    engine: &'a CompletionEngine,
    slot: &'a RailSlot,
    len: usize,
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.engine.fail("a request was abandoned while in flight");
            self.slot.completed(self.len, false);
        }
    }
}

/// The RDMA data path of one queue. See the module docs.
pub struct RdmaTransport {
    client: ArenaClient,
    stats: Arc<RdmaStats>,
    // Each rail's QP is torn down (Drop) before its memory is dropped.
    rails: Rails,
    leases: Leases,
    slots: Semaphore,
    /// Payloads of at least this many bytes are split across two rails.
    stripe_bytes: usize,
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
/// memory of each part (kept until a READ's bytes are copied out of a pool
/// buffer), with the part's start in the payload.
struct MoveDone<'a> {
    held: HeldLease,
    parts: Vec<(usize, Local<'a>)>,
}

impl MoveDone<'_> {
    /// After a READ: each part's bytes into `out`.
    fn copy_out(&self, out: &mut [u8]) {
        let mut starts: Vec<usize> = self.parts.iter().map(|(at, _)| *at).collect();
        starts.push(out.len());
        starts.sort_unstable();
        for (at, local) in &self.parts {
            let end = starts[starts.partition_point(|s| s <= at)];
            local.copy_out(&mut out[*at..end]);
        }
    }
}

/// One part of a payload: `len` bytes at `at` in it.
#[derive(Clone, Copy)]
struct Part {
    at: usize,
    len: usize,
}

/// Why a part of a payload did not move.
enum PartError {
    /// No local memory for it: the payload goes over TCP for this reason.
    Local(TcpReason),
    /// The transfer failed (the rail is lost).
    Transfer,
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
    /// rails. `devices` are the local devices, rail `i` on `devices[i]` (one
    /// or two), or why a device is missing. With `require_rdma` no rail up
    /// is an error; otherwise the transport serves TCP and says why in
    /// [`rdma_status`](Self::rdma_status). With two rails, one that the
    /// peer does not serve is off (counted) and one that could not come up
    /// is tried again later.
    pub fn connect(
        mut client_cfg: ClientConfig,
        devices: Vec<Result<Arc<dyn RdmaProvider>, String>>,
        cfg: RdmaTransportConfig,
    ) -> Result<Self, RdmaConnectError> {
        let peer = client_cfg.peer.clone();
        client_cfg.offer_rdma = devices.iter().any(Result::is_ok);
        let client = ArenaClient::connect(client_cfg)?;
        let stats = Arc::new(RdmaStats::default());
        let caps = client.welcome()?.caps;
        let declined = caps & CAP_RDMA == 0;
        let slots = devices
            .into_iter()
            .take(MAX_RAILS)
            .enumerate()
            .map(|(i, device)| {
                let (provider, state) = match device {
                    Ok(_) if declined => (
                        None,
                        RailState::Off(
                            TcpReason::Declined,
                            "the arena peer declined RDMA (no RDMA device there)".into(),
                        ),
                    ),
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
                let pool = match (&provider, &state) {
                    (Some(p), RailState::Down(_)) => {
                        match Pool::new(p.as_ref(), cfg.pool_buffers, cfg.buffer_bytes) {
                            Ok(pool) => {
                                stats
                                    .pool_buffers
                                    .fetch_add(cfg.pool_buffers.into(), Ordering::Relaxed);
                                Some(pool)
                            }
                            Err(e) => {
                                stats.inc(|s| &s.registration_failures);
                                state =
                                    RailState::Off(TcpReason::RegistrationFailed, e.to_string());
                                None
                            }
                        }
                    }
                    _ => None,
                };
                RailSlot::new(
                    i as u8,
                    provider.clone(),
                    Memory::new(provider, pool),
                    state,
                    cfg.clone(),
                    Arc::clone(&stats),
                    peer.clone(),
                )
            })
            .collect();
        let require_rdma = cfg.require_rdma;
        let t = Self {
            client,
            slots: Semaphore::new(cfg.sq_depth as usize),
            stripe_bytes: cfg.stripe_bytes as usize,
            leases: Leases::new(cfg.lease_cache, Arc::clone(&stats)),
            rails: Rails::new(slots, cfg.busy_poll, cfg.min_rdma_bytes, cfg.buffer_bytes),
            stats,
            peer,
            group: OnceLock::new(),
            cold_get: caps & CAP_COLD_GET != 0,
        };
        let mut failed = Vec::new();
        for slot in t.rails.slots().iter().filter(|s| s.is_down()) {
            if let Err(e) = futures::executor::block_on(slot.establish(&t.client, &t.leases)) {
                failed.push((slot, e));
            }
        }
        // No rail came up: as with one rail, payloads go over TCP for good.
        if t.rails
            .slots()
            .iter()
            .all(|s| s.off().is_some() || s.is_down())
        {
            for (slot, e) in failed {
                slot.turn_off(TcpReason::Declined, e);
            }
        }
        match (t.rails.off(), require_rdma) {
            (Some((_, why)), true) => {
                return Err(RdmaConnectError::Unavailable {
                    peer: t.peer.clone(),
                    reason: why,
                })
            }
            (Some((_, why)), false) => {
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
        // the regions in its rails' memory, dropped after their QPs) is
        // dropped.
        unsafe { self.rails.register(addr, len, &self.stats) }
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

    /// One RDMA transfer of `len` bytes between `local` and the leased slot,
    /// on `chosen`'s QP.
    async fn transfer(
        &self,
        chosen: &Chosen<'_>,
        op: RdmaOp,
        lease: &Lease,
        offset: u32,
        local: &Local<'_>,
        len: usize,
    ) -> Result<(), OpError> {
        let rail = &chosen.rail;
        let remote = lease.slot_offset + u64::from(offset);
        if remote.saturating_add(len as u64) > rail.remote.arena_len {
            self.stats.inc(|s| &s.rdma_protocol_errors);
            return Err(OpError::QpDown(format!(
                "lease slot offset {} + {offset} + {len} lies outside the peer's {}-byte arena",
                lease.slot_offset, rail.remote.arena_len
            )));
        }
        // Isolated per lease, the lease's own key on this rail (`keyed`
        // saw to it); otherwise the arena's (a shared-region server names
        // it in RAIL_CONNECT).
        let index = usize::from(chosen.slot.index);
        let rkey = match (lease.rkeys[index], rail.remote.rkey) {
            (Some(k), _) => k,
            (None, k) if k != 0 => k,
            (None, _) => {
                return Err(OpError::QpDown(format!(
                    "lease token {} carries no RDMA key for rail {index} and the peer names none for its arena",
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
        chosen.slot.posted(len);
        let mut guard = InFlight {
            engine: &rail.engine,
            slot: chosen.slot,
            len,
            done: false,
        };
        let r = rx
            .await
            .unwrap_or_else(|_| Err(OpError::QpDown("completion thread gone".into())));
        guard.done = true;
        chosen.slot.completed(len, r.is_ok());
        match &r {
            Ok(()) => {
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

    /// Moves one part of a payload on `chosen`'s rail: local memory on that
    /// rail's device (filled from `copy_in` for a WRITE), then the
    /// transfer. On failure the rail is lost (see [`RailSlot::lost`]).
    #[allow(clippy::too_many_arguments)]
    async fn move_part<'a>(
        &'a self,
        chosen: &Chosen<'a>,
        op: RdmaOp,
        lease: &Lease,
        offset: u32,
        addr: usize,
        part: Part,
        copy_in: Option<&[u8]>,
    ) -> Result<Local<'a>, PartError> {
        let local = chosen
            .slot
            .memory
            .local(addr + part.at, part.len, &self.stats)
            .map_err(PartError::Local)?;
        if let Some(src) = copy_in {
            local.copy_in(&src[part.at..part.at + part.len]);
        }
        match self
            .transfer(chosen, op, lease, offset + part.at as u32, &local, part.len)
            .await
        {
            Ok(()) => {
                chosen.slot.carried();
                Ok(local)
            }
            Err(e) => {
                warn!(event = events::RDMA_ATTEMPT_FAILED, op = ?op, rail = chosen.slot.index, error = %e);
                chosen.slot.lost(&chosen.rail, Instant::now());
                Err(PartError::Transfer)
            }
        }
    }

    /// Moves a range by RDMA: on one rail, or split across two when it is
    /// large and both carry traffic. A part that fails is tried once more,
    /// on the other rail when it is up (striped: the rail that carried the
    /// other part), else on its own rail brought up again.
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
        let first = self
            .rails
            .pick(len, &self.client, &self.leases, None)
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
        let held = self
            .keyed(held, &first, write, false)
            .await
            .map_err(|reason| Carry::Tcp {
                reason,
                failover: false,
            })?;
        let epoch = self.client.connection_epoch();
        let partner = (len >= self.stripe_bytes)
            .then(|| self.rails.partner(first.slot, epoch))
            .flatten()
            .filter(|p| Self::keys_reach(&held.lease, p));
        match partner {
            Some(second) => {
                self.striped(op, held, offset, addr, len, copy_in, [first, second])
                    .await
            }
            None => {
                self.whole(op, held, offset, addr, len, copy_in, first)
                    .await
            }
        }
    }

    /// The payload on one rail, tried once more after a failure.
    #[allow(clippy::too_many_arguments)]
    async fn whole<'a>(
        &'a self,
        op: RdmaOp,
        mut held: HeldLease,
        offset: u32,
        addr: usize,
        len: usize,
        copy_in: Option<&[u8]>,
        mut chosen: Chosen<'a>,
    ) -> Result<Option<MoveDone<'a>>, Carry> {
        let write = op == RdmaOp::Write;
        let whole = Part { at: 0, len };
        let mut attempted = false;
        let result = loop {
            match self
                .move_part(&chosen, op, &held.lease, offset, addr, whole, copy_in)
                .await
            {
                Ok(local) => break Ok(local),
                Err(PartError::Local(reason)) => break Err(reason),
                Err(PartError::Transfer) if attempted => break Err(TcpReason::QpError),
                Err(PartError::Transfer) => {
                    attempted = true;
                    let failed = chosen.slot.index;
                    let epoch = chosen.rail.epoch;
                    match self
                        .rails
                        .pick(len, &self.client, &self.leases, Some(failed))
                        .await
                    {
                        Ok(c) if self.client.connection_epoch() == Some(epoch) => chosen = c,
                        _ => break Err(TcpReason::QpError),
                    }
                    // The same rail brought up again: its keys died with
                    // the old QP. Another rail: the lease's key there, if
                    // it has one.
                    let relet =
                        chosen.slot.index == failed || !Self::keys_reach(&held.lease, &chosen);
                    held = match self.keyed(held, &chosen, write, relet).await {
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
            Ok(local) => {
                self.stats
                    .inc_op(op, |s| &s.rdma_transferred, |o| &o.transferred);
                Ok(Some(MoveDone {
                    held,
                    parts: vec![(0, local)],
                }))
            }
            Err(reason) => Err(self.give_up(op, held, reason, attempted).await),
        }
    }

    /// The payload split in two halves moved on both rails at once; a half
    /// that fails is moved again on the rail that carried the other.
    #[allow(clippy::too_many_arguments)]
    async fn striped<'a>(
        &'a self,
        op: RdmaOp,
        held: HeldLease,
        offset: u32,
        addr: usize,
        len: usize,
        copy_in: Option<&[u8]>,
        rails: [Chosen<'a>; 2],
    ) -> Result<Option<MoveDone<'a>>, Carry> {
        // Halves on 4 KiB boundaries, so each is whole pages of the payload.
        let cut = (len / 2).next_multiple_of(4096).min(len);
        let parts = [
            Part { at: 0, len: cut },
            Part {
                at: cut,
                len: len - cut,
            },
        ];
        // A copy: `held` goes to `give_up` or `MoveDone` by value.
        let lease: Lease = held.lease;
        let lease = &lease;
        let (a, b) = futures::future::join(
            self.move_part(&rails[0], op, lease, offset, addr, parts[0], copy_in),
            self.move_part(&rails[1], op, lease, offset, addr, parts[1], copy_in),
        )
        .await;
        let mut done = Vec::with_capacity(2);
        let mut failed = Vec::new();
        for (i, r) in [a, b].into_iter().enumerate() {
            match r {
                Ok(local) => done.push((parts[i].at, local)),
                Err(PartError::Local(reason)) => {
                    return Err(self.give_up(op, held, reason, false).await)
                }
                Err(PartError::Transfer) => failed.push(i),
            }
        }
        let attempted = !failed.is_empty();
        for i in failed {
            // The rail that carried the other half (if it did).
            let other = &rails[1 - i];
            let again = if done.len() == 1 {
                self.move_part(other, op, lease, offset, addr, parts[i], copy_in)
                    .await
                    .ok()
            } else {
                None
            };
            match again {
                Some(local) => done.push((parts[i].at, local)),
                None => {
                    drop(done);
                    return Err(self.give_up(op, held, TcpReason::QpError, true).await);
                }
            }
        }
        if attempted {
            debug!(event = events::RDMA_ATTEMPT_FAILED, op = ?op, "a striped half moved on the other rail");
        }
        self.stats
            .inc_op(op, |s| &s.rdma_transferred, |o| &o.transferred);
        self.stats.inc(|s| &s.striped);
        Ok(Some(MoveDone { held, parts: done }))
    }

    /// The payload goes inline on TCP for `reason`: the lease ends first (a
    /// write lease must, before the TCP path writes the range).
    async fn give_up(
        &self,
        op: RdmaOp,
        held: HeldLease,
        reason: TcpReason,
        attempted: bool,
    ) -> Carry {
        if attempted {
            self.stats.inc_op(op, |s| &s.rdma_declined, |o| &o.declined);
        }
        let _ = self.leases.unlease(&self.client, held, false).await;
        Carry::Tcp {
            reason,
            failover: attempted,
        }
    }

    /// Whether `lease` can be moved over `chosen`'s rail as it is: it has a
    /// key there, or the rail has a key to the whole arena.
    fn keys_reach(lease: &Lease, chosen: &Chosen<'_>) -> bool {
        chosen.rail.remote.rkey != 0 || lease.rkeys[usize::from(chosen.slot.index)].is_some()
    }

    /// Over a rail isolated per lease (its RAIL_CONNECT named no arena
    /// key), the lease's own key must reach the slot through `chosen`'s
    /// rail: with `relet` (the rail is new, and the key died with the old
    /// one, or was ended by force, or the lease has no key on it) the lease
    /// is given back and leased anew, and a lease the peer answered
    /// without a key on that rail (it could not register one) is given
    /// back and its payload goes inline on TCP. Over a shared-region rail,
    /// `held` as is.
    async fn keyed(
        &self,
        held: HeldLease,
        chosen: &Chosen<'_>,
        write: bool,
        relet: bool,
    ) -> Result<HeldLease, TcpReason> {
        if chosen.rail.remote.rkey != 0 {
            return Ok(held);
        }
        let held = if relet {
            self.leases
                .relet(self, held, write)
                .await
                .ok_or(TcpReason::QpError)?
        } else {
            held
        };
        if held.lease.rkeys[usize::from(chosen.slot.index)].is_none() {
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
            Ok(Some(done)) => {
                done.copy_out(out);
                let held = done.held;
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
            Ok(Some(MoveDone { held, parts })) => {
                drop(parts);
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
