//! The accept loop: both connection limits hold from the first byte (a
//! socket that never sends HELLO takes a place like any other), a refusal
//! costs one non-blocking write, and accept failures (EMFILE, ENFILE,
//! ENOMEM) are counted, logged at most once per interval and backed off
//! from while the connections there are keep being served.

use std::io;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};
use ublk_metrics::ConnectionRefusal;

use crate::arenad::admission::{Counted, Throttled};
use crate::arenad::shared::Shared;
use crate::arenad::workers::Workers;
use crate::proto::{self, Opcode, Status};

impl Shared {
    /// Accepts until shutdown, each connection handed to one of `workers`
    /// for its life, then waits (up to `shutdown_timeout`) for every
    /// connection to end.
    pub(super) async fn accept_loop(
        self: Arc<Self>,
        listener: TcpListener,
        workers: &Workers,
    ) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let (mut accept_errors, mut refusals) = (Throttled::default(), Throttled::default());
        let mut backoff = Duration::from_millis(10);
        loop {
            let accepted = tokio::select! {
                () = self.stopped() => break,
                r = listener.accept() => r,
            };
            let (stream, peer) = match accepted {
                Ok(v) => v,
                Err(e) => {
                    // Keep serving the connections there are; try again
                    // after a backoff.
                    self.obs.accept_failed();
                    accept_errors.log(|muted| warn!(event = "accept.failed", error = %e, unlogged = muted, "backing off"));
                    tokio::select! {
                        () = self.stopped() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            backoff = Duration::from_millis(10);
            let refuse = |reason: ConnectionRefusal, message: &str, refusals: &mut Throttled| {
                self.obs.connection_refused(reason);
                refusals.log(|muted| {
                    warn!(
                        event = "connection.refused",
                        reason = reason.as_str(),
                        max_connections = self.limits.max_connections,
                        max_unauthenticated = self.limits.max_unauthenticated,
                        unlogged = muted
                    )
                });
                let mut frame = Vec::new();
                proto::encode_error(&mut frame, Opcode::Challenge, 0, Status::Busy, message);
                // Non-blocking: the refusal never waits on the peer.
                let _ = stream.try_write(&frame);
            };
            let Some(open) = Counted::take(&self.open, self.limits.max_connections) else {
                refuse(
                    ConnectionRefusal::MaxConnections,
                    "too many connections",
                    &mut refusals,
                );
                continue;
            };
            let Some(handshaking) =
                Counted::take(&self.unauthenticated, self.limits.max_unauthenticated)
            else {
                refuse(
                    ConnectionRefusal::MaxUnauthenticated,
                    "too many connections in their handshake",
                    &mut refusals,
                );
                continue;
            };
            let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
            debug!(event = "connection.accepted", conn = id, peer = %peer);
            // Moved to its worker's reactor (deregistered from this one).
            let stream = match stream.into_std() {
                Ok(s) => s,
                Err(e) => {
                    debug!(event = "connection.lost", conn = id, error = %e);
                    continue;
                }
            };
            let shared = Arc::clone(&self);
            workers.spawn(async move {
                match tokio::net::TcpStream::from_std(stream) {
                    Ok(s) => shared.run_conn(id, peer, s, open, handshaking).await,
                    Err(e) => debug!(event = "connection.lost", conn = id, error = %e),
                }
            });
        }
        // New connections are refused from here on.
        drop(listener);
        let until = Instant::now() + self.limits.shutdown_timeout;
        while self.open.load(Ordering::Acquire) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let left = self.open.load(Ordering::Acquire);
        if left > 0 {
            warn!(
                event = "shutdown.cut",
                connections = left,
                shutdown_timeout_secs = self.limits.shutdown_timeout.as_secs(),
                "connections still open at the shutdown deadline are cut"
            );
        } else {
            info!(event = "shutdown.drained");
        }
        Ok(())
    }
}
