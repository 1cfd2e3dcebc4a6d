//! A driven connection: its answers are read by the owner's event loop (a
//! ublk queue thread's io_uring) instead of a reader thread, so an answer
//! completes its request on the thread that waits for it: no thread hop
//! and no cross-thread wake per request.
//!
//! The owner runs [`Driver::run`] on its loop, over a [`Ring`] that tells
//! it when the socket is readable and ticks for the deadline sweeps. The
//! frames, tags, dispatch and expiry are the reader thread's own code (the
//! connection's `Receiver`): only who calls it changes. A reconnect (made
//! by whichever call finds the connection dead) hands the new receiver to
//! the driver through the connection's `Handoff`.
//!
//! With `ClientConfig::busy_poll`, a driver whose requests wait for answers
//! reads the socket again for that long before it waits on the ring.
//!
//! Sends stay on the caller, as with a reader thread, but never block the
//! loop: a send that finds the socket full waits for room while reading
//! the answers that arrive meanwhile (`conn::NoWait`), so a peer blocked on
//! sending answers cannot deadlock against a client blocked on sending
//! requests.

use std::future::poll_fn;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Instant;

use tracing::warn;
use ublk_metrics::events;

use super::receiver::expire;
use super::shared::Shared;
use crate::client::driven::Handoff;
pub use crate::client::driven::Ring;

/// Runs a driven client's receiving side on its owner's loop; see
/// [`ArenaClient::driver`](super::ArenaClient::driver).
pub struct Driver {
    pub(super) client: Weak<Shared>,
    pub(super) handoff: Arc<Handoff>,
}

impl Driver {
    /// Reads answers and expires requests until the client is dropped.
    /// Without it running, a driven client's requests are never answered.
    pub async fn run(&self, ring: &impl Ring) {
        futures::future::join(self.receive(ring), self.sweep(ring)).await;
    }

    async fn receive(&self, ring: &impl Ring) {
        while self.handoff.live().await {
            while let Some(fd) = self.handoff.pump() {
                self.spin();
                if let Err(e) = ring.readable(fd).await {
                    warn!(event = events::PEER_POLL_FAILED, error = %e);
                    if let Some(r) = self.handoff.rx.lock().as_mut() {
                        r.fail(format!("poll failed: {e}"));
                    }
                }
            }
        }
    }

    /// With requests waiting for answers, reads the socket again (one
    /// non-blocking `recv` a round) for up to the config's `busy_poll`,
    /// until an answer completes one: an answer that arrives within it
    /// costs the loop no sleep and no wake-up. What it read is dispatched
    /// as [`Handoff::pump`] always does; the poll armed next reports what
    /// comes later.
    fn spin(&self) {
        let Some(shared) = self.client.upgrade() else {
            return;
        };
        let budget = shared.cfg.busy_poll;
        if budget.is_zero() {
            return;
        }
        let Some(conn) = shared.conn.lock().clone() else {
            return;
        };
        let waiting = conn.in_flight();
        if waiting == 0 {
            return;
        }
        let until = Instant::now() + budget;
        while Instant::now() < until {
            if self.handoff.pump().is_none() || conn.in_flight() < waiting {
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// Deadlines of requests on a quiet connection (a busy one is swept as
    /// its answers are read). Parked while nothing is in flight, so an idle
    /// queue's ring really idles.
    async fn sweep(&self, ring: &impl Ring) {
        loop {
            let busy = poll_fn(|cx| {
                *self.handoff.sweeper.lock() = Some(cx.waker().clone());
                if self.handoff.closed.load(Ordering::SeqCst) {
                    return Poll::Ready(false);
                }
                let Some(shared) = self.client.upgrade() else {
                    return Poll::Ready(false);
                };
                let conn = shared.conn.lock().clone();
                match conn {
                    Some(c) if c.in_flight() > 0 => Poll::Ready(true),
                    _ => Poll::Pending,
                }
            });
            if !busy.await {
                return;
            }
            ring.tick().await;
            let Some(shared) = self.client.upgrade() else {
                return;
            };
            let conn = shared.conn.lock().clone();
            if let Some(c) = conn {
                expire(&shared, &c);
            }
        }
    }
}
