//! A driven rail: the QP's completions are reaped by the owner's event loop
//! (a ublk queue thread's io_uring) instead of a completion thread, so a
//! completion wakes its request on the thread that waits for it: no thread
//! hop and no cross-thread wake per transfer.
//!
//! While requests are in flight the driver polls the completion queue for
//! up to `busy_poll` (ibv_poll_cq reads the queue in user memory on rxe and
//! on hardware alike: no syscall), then arms the channel and waits for it on
//! the ring; with nothing in flight it parks until the next submit. A second
//! future sweeps request deadlines on the ring's tick while requests are in
//! flight, as the completion thread did.
//!
//! A rail replaced by a new one (a reconnect, a broken QP) hands its engine
//! over through [`CqHandoff`]; the driver finishes what the old engine
//! still has in flight (bounded by the request deadline, which it sweeps),
//! then moves on. A transport with two rails has a hand-off per rail, each
//! served by its own pair of futures on the same loop.

use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tracing::warn;
use ublk_metrics::events;

use super::completion::CompletionEngine;
use crate::client::driven::{CqHandoff, Engine, Ring};

/// Runs a driven RDMA transport's completions on its owner's loop; see
/// [`RdmaTransport::cq_driver`](super::RdmaTransport::cq_driver).
pub struct CqDriver {
    pub(super) rails: Vec<RailDriver>,
}

impl CqDriver {
    /// Reaps completions and expires requests, on every rail, until the
    /// transport is dropped. Without it running, a driven transport's RDMA
    /// transfers never complete (their deadlines are the sweep's, so they
    /// would not even time out).
    pub async fn run(&self, ring: &impl Ring) {
        futures::future::join_all(self.rails.iter().map(|r| r.run(ring))).await;
    }
}

/// The driver of one rail's engines.
pub(super) struct RailDriver {
    pub(super) handoff: Arc<CqHandoff<CompletionEngine>>,
    pub(super) busy_poll: Duration,
}

impl RailDriver {
    async fn run(&self, ring: &impl Ring) {
        futures::future::join(self.reap(ring), self.sweep(ring)).await;
    }

    /// The engine being served, once it has requests in flight; parked
    /// (woken by a submit, an install or the end) until then. `None` once
    /// the transport is gone.
    async fn work(&self) -> Option<Arc<CompletionEngine>> {
        poll_fn(|cx| {
            let Ok(engine) = self.handoff.current(cx.waker()) else {
                return Poll::Ready(None);
            };
            let Some(engine) = engine else {
                return Poll::Pending;
            };
            engine.park(cx.waker());
            if engine.in_flight() > 0 && !engine.stopped() {
                Poll::Ready(Some(engine))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    async fn reap(&self, ring: &impl Ring) {
        let mut buf = Vec::new();
        while let Some(engine) = self.work().await {
            if self.spin(&engine, &mut buf) {
                continue;
            }
            // Arm, then look once more: a completion that landed before the
            // arm raises no event.
            if let Err(e) = engine.qp().arm() {
                engine.fail(&e.to_string());
            }
            if engine.deliver(&mut buf) > 0 {
                continue;
            }
            // Requests in flight always complete (a failed or expired QP
            // flushes them), so this wait ends.
            if let Err(e) = ring.readable(engine.qp().event_fd()).await {
                warn!(event = events::RDMA_POLL_FAILED, error = %e);
                engine.fail(&format!("waiting on the completion channel failed: {e}"));
            }
            if let Err(e) = engine.qp().take_event() {
                engine.fail(&e.to_string());
            }
            engine.deliver(&mut buf);
        }
    }

    /// Polls the completion queue until something completes or `busy_poll`
    /// passes; whether something completed.
    fn spin(&self, engine: &CompletionEngine, buf: &mut Vec<crate::rdma::Completion>) -> bool {
        let until = Instant::now() + self.busy_poll;
        loop {
            if engine.deliver(buf) > 0 {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Deadlines of the requests in flight, swept every tick while there
    /// are any.
    async fn sweep(&self, ring: &impl Ring) {
        while let Some(engine) = self.work().await {
            ring.tick().await;
            engine.expire(Instant::now());
        }
    }
}
