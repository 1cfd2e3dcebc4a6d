//! [`RailSlot`]: one rail of a transport over time (rail 0 or 1: one local
//! RDMA device, on the link to the peer's device of the same index). It
//! holds the device's registered memory and the current [`RailState`],
//! brings a QP up on the live control connection (RAIL_CONNECT naming the
//! rail) when a payload's route asks for one, hands each new QP's
//! completion engine to its reaper (a completion thread, or the driver of
//! a driven transport), counts what it carries, and, after losing its QP,
//! waits longer before each new try while nothing got through.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{info, warn};
use ublk_metrics::events;

use super::completion::CompletionEngine;
use super::config::RdmaTransportConfig;
use super::leases::Leases;
use super::pool::Memory;
use super::rail::{Rail, RailState, Route, Sizes, RAIL_RETRY};
use super::stats::{RailCounters, RdmaStats, TcpReason};
use crate::client::driven::CqHandoff;
use crate::client::tcp::ArenaClient;
use crate::proto::Status;
use crate::rdma::{QueuePair, RdmaProvider};

/// Longest wait before trying a lost rail again.
pub(super) const LOST_RAIL_MAX_WAIT: Duration = Duration::from_secs(30);

/// One rail of a transport.
pub(super) struct RailSlot {
    /// Its index, as RAIL_CONNECT names it.
    pub(super) index: u8,
    state: Mutex<RailState>,
    provider: Option<Arc<dyn RdmaProvider>>,
    /// Local memory registered on this rail's device.
    pub(super) memory: Memory,
    cfg: RdmaTransportConfig,
    stats: Arc<RdmaStats>,
    peer: String,
    /// Driven: where each new QP's completion engine goes to the driver.
    pub(super) cq: Option<Arc<CqHandoff<CompletionEngine>>>,
    /// QPs lost since a transfer last got through: the wait before the
    /// next try doubles with each.
    losses: AtomicU32,
    /// A transfer got through on its current QP. Until one has, while
    /// another rail carries the traffic, one request at a time tries it.
    proven: AtomicBool,
    /// That one request is on it.
    probing: AtomicBool,
}

impl RailSlot {
    /// Rail `index` on `provider` (none: payloads go over TCP), starting in
    /// `state`.
    pub(super) fn new(
        index: u8,
        provider: Option<Arc<dyn RdmaProvider>>,
        memory: Memory,
        state: RailState,
        cfg: RdmaTransportConfig,
        stats: Arc<RdmaStats>,
        peer: String,
    ) -> Self {
        let counters = &stats.rails[usize::from(index)];
        if let Some(p) = &provider {
            let _ = counters.device.set(p.device_name());
        }
        if let RailState::Off(_, why) = &state {
            let _ = counters.off.set(why.clone());
        }
        Self {
            index,
            state: Mutex::new(state),
            provider,
            memory,
            cq: cfg.driven.then(Arc::default),
            cfg,
            stats,
            peer,
            losses: AtomicU32::new(0),
            proven: AtomicBool::new(false),
            probing: AtomicBool::new(false),
        }
    }

    /// Whether no QP is up yet and one may be brought up.
    pub(super) fn is_down(&self) -> bool {
        matches!(*self.state.lock(), RailState::Down(_))
    }

    /// RDMA will not be used on this rail: its payloads go elsewhere, for
    /// `reason`.
    pub(super) fn turn_off(&self, reason: TcpReason, why: String) {
        let _ = self.counters().off.set(why.clone());
        self.counters().up.store(false, Ordering::Relaxed);
        *self.state.lock() = RailState::Off(reason, why);
    }

    /// Its QP went down (lost, or a setup failed): since now, unless it
    /// was down already.
    fn went_down(&self) {
        let c = self.counters();
        c.up.store(false, Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_millis() as u64);
        let _ = c
            .down_since_ms
            .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Why this rail will not be used, when it will not.
    pub(super) fn off(&self) -> Option<(TcpReason, String)> {
        match &*self.state.lock() {
            RailState::Off(reason, why) => Some((*reason, why.clone())),
            _ => None,
        }
    }

    /// Why this rail will not be used, when it will not (no allocation).
    pub(super) fn off_reason(&self) -> Option<TcpReason> {
        match &*self.state.lock() {
            RailState::Off(reason, _) => Some(*reason),
            _ => None,
        }
    }

    /// The local device's name.
    pub(super) fn device(&self) -> String {
        self.provider
            .as_ref()
            .map(|p| p.device_name())
            .unwrap_or_default()
    }

    /// Whether payloads may use it (up, or down and being re-established).
    pub(super) fn uses_rdma(&self) -> bool {
        self.off_reason().is_none()
    }

    /// Its QP, when it is up, healthy and of control connection `epoch`.
    pub(super) fn ready(&self, epoch: Option<u64>) -> Option<Arc<Rail>> {
        match &*self.state.lock() {
            RailState::Up(rail) if rail.serves(epoch) => Some(Arc::clone(rail)),
            _ => None,
        }
    }

    /// Whether a new QP is due: it is down past its wait, or up but broken
    /// or of an older control connection.
    pub(super) fn due(&self, epoch: Option<u64>, now: Instant) -> bool {
        match &*self.state.lock() {
            RailState::Down(at) => now >= *at,
            RailState::Up(rail) => !rail.serves(epoch),
            RailState::Connecting | RailState::Off(..) => false,
        }
    }

    fn counters(&self) -> &RailCounters {
        &self.stats.rails[usize::from(self.index)]
    }

    /// Payload bytes posted on it and not completed yet.
    pub(super) fn outstanding(&self) -> u64 {
        self.counters().outstanding.load(Ordering::Relaxed)
    }

    /// Transfers it moved.
    pub(super) fn transfers(&self) -> u64 {
        self.counters().transfers.load(Ordering::Relaxed)
    }

    /// A transfer of `len` bytes is posted on it.
    pub(super) fn posted(&self, len: usize) {
        self.counters()
            .outstanding
            .fetch_add(len as u64, Ordering::Relaxed);
    }

    /// A transfer of `len` bytes posted on it ended; `moved` when it got
    /// through.
    pub(super) fn completed(&self, len: usize, moved: bool) {
        let c = self.counters();
        c.outstanding.fetch_sub(len as u64, Ordering::Relaxed);
        if moved {
            c.transfers.fetch_add(1, Ordering::Relaxed);
            c.bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
    }

    /// Whether a transfer got through on its current QP.
    pub(super) fn proven(&self) -> bool {
        self.proven.load(Ordering::Acquire)
    }

    /// Takes the one try of an unproven QP; `false` when a request has it.
    pub(super) fn try_probe(&self) -> bool {
        !self.probing.swap(true, Ordering::AcqRel)
    }

    /// The request that took the one try is done with the rail (however
    /// its payload went).
    pub(super) fn end_probe(&self) {
        self.probing.store(false, Ordering::Release);
    }

    /// A transfer on `rail` got through: the rail is proven, its waits
    /// start over.
    pub(super) fn carried(&self) {
        self.probing.store(false, Ordering::Release);
        self.losses.store(0, Ordering::Relaxed);
        self.proven.store(true, Ordering::Release);
    }

    /// A transfer on `rail` failed (its QP is broken): unless a newer QP
    /// replaced it meanwhile, the rail is down until [`Self::next_wait`].
    pub(super) fn lost(&self, rail: &Arc<Rail>, now: Instant) {
        self.probing.store(false, Ordering::Release);
        let mut state = self.state.lock();
        if !matches!(&*state, RailState::Up(r) if Arc::ptr_eq(r, rail)) {
            return;
        }
        let wait = self.next_wait();
        self.proven.store(false, Ordering::Release);
        *state = RailState::Down(now + wait);
        drop(state);
        self.counters().lost.fetch_add(1, Ordering::Relaxed);
        self.went_down();
        warn!(event = events::RDMA_RAIL_LOST, peer = %self.peer, rail = self.index, device = %self.device(), retry_in_ms = wait.as_millis() as u64);
    }

    /// The wait before the next try after one more loss: none after the
    /// first since a transfer got through, then [`RAIL_RETRY`] doubling
    /// up to [`LOST_RAIL_MAX_WAIT`].
    fn next_wait(&self) -> Duration {
        match self.losses.fetch_add(1, Ordering::Relaxed) {
            0 => Duration::ZERO,
            n => (RAIL_RETRY * 2u32.saturating_pow(n - 1)).min(LOST_RAIL_MAX_WAIT),
        }
    }

    /// The transport is dropped: the QP is torn down (before the memory
    /// it may touch) and the driver ends.
    pub(super) fn shut_down(&self) {
        self.counters().up.store(false, Ordering::Relaxed);
        *self.state.lock() = RailState::Down(Instant::now());
        if let Some(cq) = &self.cq {
            cq.close();
        }
    }

    /// Brings up a new QP on `client`'s current control connection.
    pub(super) async fn establish(
        &self,
        client: &ArenaClient,
        leases: &Leases,
    ) -> Result<Arc<Rail>, String> {
        let r = self.try_establish(client, leases).await;
        match &r {
            Ok(_) => {
                self.stats.inc(|s| &s.rail_connects);
                let c = self.counters();
                c.connects.fetch_add(1, Ordering::Relaxed);
                c.down_since_ms.store(0, Ordering::Relaxed);
                c.up.store(true, Ordering::Relaxed);
            }
            Err(e) => {
                self.went_down();
                self.stats.inc(|s| &s.rail_connect_failures);
                warn!(event = events::RDMA_RAIL_FAILED, peer = %self.peer, rail = self.index, error = %e);
            }
        }
        self.proven.store(false, Ordering::Release);
        self.probing.store(false, Ordering::Release);
        let now = Instant::now();
        let mut state = self.state.lock();
        state.settle(&r, now);
        // A setup that failed counts as a loss: the next try waits at
        // least RAIL_RETRY, longer while they keep failing.
        if let (Err(_), RailState::Down(at)) = (&r, &mut *state) {
            *at = now + self.next_wait().max(RAIL_RETRY);
        }
        drop(state);
        r
    }

    async fn try_establish(
        &self,
        client: &ArenaClient,
        leases: &Leases,
    ) -> Result<Arc<Rail>, String> {
        let provider = self.provider.as_ref().ok_or("no local RDMA device")?;
        let qp: Arc<dyn QueuePair> = provider
            .domain()
            .create_qp(self.cfg.sq_depth)
            .map_err(|e| e.to_string())?
            .into();
        // Connected first: after the peer restarted, the connection the
        // RAIL_CONNECT goes on is made here, not inside the call (which
        // would make the rail look older than its connection).
        let before = client.connected_epoch().map_err(|e| e.to_string())?;
        let acc = match client.rail_connect(self.index, qp.endpoint()).await {
            Ok(acc) => acc,
            // The peer does not serve this rail: it never will on this
            // connection's peer, so the rail is off (not retried).
            Err(e) if e.status() == Some(Status::NotFound) => {
                self.turn_off(TcpReason::Declined, e.to_string());
                return Err(e.to_string());
            }
            Err(e) => return Err(e.to_string()),
        };
        let epoch = client.connection_epoch();
        if epoch != Some(before) {
            return Err("the control connection changed during the rail setup".into());
        }
        let blob = u64::from(client.session_blob_bytes());
        if acc.arena_len < blob {
            self.stats.inc(|s| &s.rdma_protocol_errors);
            return Err(format!(
                "peer's arena region of {} bytes is smaller than a blob",
                acc.arena_len
            ));
        }
        qp.connect(&acc.endpoint).map_err(|e| e.to_string())?;
        let engine = CompletionEngine::new(
            qp,
            self.cfg.sq_depth,
            self.cfg.op_timeout,
            Arc::clone(&self.stats),
        );
        match &self.cq {
            Some(handoff) => handoff.install(&engine),
            None => engine.spawn().map_err(|e| e.to_string())?,
        }
        // Isolated per lease (no key to the whole arena), the keys of the
        // leases cached so far died with the peer's old QP on this rail:
        // those leases are given back rather than tried (a lease granted
        // from now on carries a key on every rail that is up).
        if acc.rkey == 0 {
            let stale = leases.retire_all();
            for (key, e) in stale {
                let _ = leases.end_cached(client, key, e).await;
            }
        }
        info!(event = events::RDMA_RAIL_UP, peer = %self.peer, rail = self.index, device = %provider.device_name());
        Ok(Arc::new(Rail {
            engine,
            remote: acc,
            epoch: before,
        }))
    }

    /// The QP to use for a payload of `len` bytes on this rail, bringing
    /// one up when it is due, or why not.
    pub(super) async fn route(
        &self,
        len: usize,
        client: &ArenaClient,
        leases: &Leases,
    ) -> Result<Arc<Rail>, TcpReason> {
        let sizes = Sizes {
            min: self.cfg.min_rdma_bytes as usize,
            max: self.cfg.buffer_bytes as usize,
        };
        let epoch = client.connection_epoch();
        let now = Instant::now();
        // A broken QP is a lost one: it is replaced after its wait.
        let broken = match &*self.state.lock() {
            RailState::Up(r) if r.engine.broken().is_some() => Some(Arc::clone(r)),
            _ => None,
        };
        if let Some(r) = broken {
            self.lost(&r, now);
        }
        let route = self.state.lock().route(len, sizes, epoch, now);
        match route {
            Route::Use(rail) => Ok(rail),
            Route::Tcp(reason) => Err(reason),
            Route::Establish => {
                let rail = self
                    .establish(client, leases)
                    .await
                    .map_err(|_| TcpReason::QpError)?;
                if len > sizes.max {
                    return Err(TcpReason::TooLarge);
                }
                Ok(rail)
            }
        }
    }
}
