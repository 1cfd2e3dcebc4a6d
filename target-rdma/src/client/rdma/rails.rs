//! [`Rails`]: a transport's QP against the peer over time. It holds the
//! current [`RailState`], brings a rail up on the live control connection
//! (RAIL_CONNECT) when a payload's route asks for one, hands each new
//! rail's completion engine to its reaper (a completion thread, or the
//! driver of a driven transport), and says whether and why payloads go
//! over TCP instead.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tracing::{info, warn};
use ublk_metrics::events;

use super::completion::CompletionEngine;
use super::config::RdmaTransportConfig;
use super::driver::CqDriver;
use super::leases::Leases;
use super::rail::{Rail, RailState, Route, Sizes};
use super::stats::{RdmaStats, TcpReason};
use crate::client::driven::CqHandoff;
use crate::client::tcp::ArenaClient;
use crate::rdma::{QueuePair, RdmaProvider};

/// The rails of one transport.
pub(super) struct Rails {
    state: Mutex<RailState>,
    provider: Option<Arc<dyn RdmaProvider>>,
    cfg: RdmaTransportConfig,
    stats: Arc<RdmaStats>,
    peer: String,
    /// Driven: where each new rail's completion engine goes to the driver.
    cq: Option<Arc<CqHandoff<CompletionEngine>>>,
}

impl Rails {
    /// Rails on `provider` (none: payloads go over TCP), starting in
    /// `state`.
    pub(super) fn new(
        provider: Option<Arc<dyn RdmaProvider>>,
        state: RailState,
        cfg: RdmaTransportConfig,
        stats: Arc<RdmaStats>,
        peer: String,
    ) -> Self {
        Self {
            state: Mutex::new(state),
            provider,
            cq: cfg.driven.then(Arc::default),
            cfg,
            stats,
            peer,
        }
    }

    /// Whether no rail is up yet and one may be brought up.
    pub(super) fn is_down(&self) -> bool {
        matches!(*self.state.lock(), RailState::Down(_))
    }

    /// RDMA will not be used: payloads go over TCP for `reason`.
    pub(super) fn turn_off(&self, reason: TcpReason, why: String) {
        *self.state.lock() = RailState::Off(reason, why);
    }

    /// Why payloads go over TCP, when RDMA will not be used.
    pub(super) fn off(&self) -> Option<String> {
        match &*self.state.lock() {
            RailState::Off(_, why) => Some(why.clone()),
            _ => None,
        }
    }

    /// `Ok(device)` while payloads go by RDMA, or why they go over TCP.
    pub(super) fn status(&self) -> Result<String, String> {
        match &*self.state.lock() {
            RailState::Off(_, why) => Err(why.clone()),
            _ => Ok(self
                .provider
                .as_ref()
                .map(|p| p.device_name())
                .unwrap_or_default()),
        }
    }

    /// Whether payloads go by RDMA (the rail is up, or down and being
    /// re-established). Cheap: no allocation, one short lock.
    pub(super) fn uses_rdma(&self) -> bool {
        !matches!(*self.state.lock(), RailState::Off(..))
    }

    /// The completion driver of driven rails; `None` otherwise.
    pub(super) fn cq_driver(&self) -> Option<CqDriver> {
        self.cq.as_ref().map(|handoff| CqDriver {
            handoff: Arc::clone(handoff),
            busy_poll: self.cfg.busy_poll,
        })
    }

    /// The transport is dropped: the QP is torn down (before the memory
    /// it may touch) and the driver ends.
    pub(super) fn shut_down(&self) {
        *self.state.lock() = RailState::Down(Instant::now());
        if let Some(cq) = &self.cq {
            cq.close();
        }
    }

    /// Brings up a new rail on `client`'s current control connection.
    pub(super) async fn establish(
        &self,
        client: &ArenaClient,
        leases: &Leases,
    ) -> Result<Arc<Rail>, String> {
        let r = self.try_establish(client, leases).await;
        match &r {
            Ok(_) => self.stats.inc(|s| &s.rail_connects),
            Err(e) => {
                self.stats.inc(|s| &s.rail_connect_failures);
                warn!(event = events::RDMA_RAIL_FAILED, peer = %self.peer, error = %e);
            }
        }
        self.state.lock().settle(&r, Instant::now());
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
        let acc = client
            .rail_connect(0, qp.endpoint())
            .await
            .map_err(|e| e.to_string())?;
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
        // leases cached so far died with the peer's old rail: those leases
        // are given back rather than tried.
        if acc.rkey == 0 {
            let stale = leases.retire_all();
            for (key, e) in stale {
                let _ = leases.end_cached(client, key, e).await;
            }
        }
        info!(event = events::RDMA_RAIL_UP, peer = %self.peer, device = %provider.device_name());
        Ok(Arc::new(Rail {
            engine,
            remote: acc,
            epoch: before,
        }))
    }

    /// The rail to use for a payload of `len` bytes, or why to use TCP.
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
        let route = self.state.lock().route(len, sizes, epoch, Instant::now());
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
