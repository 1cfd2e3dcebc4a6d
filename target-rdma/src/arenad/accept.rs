//! The accept loop: both connection limits hold from the first byte (a
//! socket that never sends HELLO takes a place like any other), the
//! handshake places are shared between sources (a new connection may take
//! the oldest place of the source holding the most), a refusal costs one
//! non-blocking write, and accept failures (EMFILE, ENFILE, ENOMEM) are
//! counted, logged at most once per interval and backed off from while
//! the connections there are keep being served.

use std::io;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, field, info, warn};
use ublk_metrics::ConnectionRefusal;

use crate::arenad::admission::{busy_frame, Source, Throttled, HANDSHAKES_FULL};
use crate::arenad::connection;
use crate::arenad::events;
use crate::arenad::shared::Shared;
use crate::arenad::workers::Workers;

/// Accepts until shutdown, each connection handed to one of `workers`
/// for its life, then waits (up to `shutdown_timeout`) for every
/// connection to end.
pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    listener: TcpListener,
    workers: &Workers,
) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let (mut accept_errors, mut refusals) = (Throttled::default(), Throttled::default());
    let mut displacements = Throttled::default();
    let mut backoff = Duration::from_millis(10);
    loop {
        let accepted = tokio::select! {
            () = shared.stop.stopped() => break,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(v) => v,
            Err(e) => {
                // Keep serving the connections there are; try again
                // after a backoff.
                shared.obs.accept_failed();
                accept_errors.log(|muted| warn!(event = events::ACCEPT_FAILED, error = %e, unlogged = muted, "backing off"));
                tokio::select! {
                    () = shared.stop.stopped() => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        backoff = Duration::from_millis(10);
        // `source`: the peer's source of handshakes, and how many it holds.
        let refuse = |reason: ConnectionRefusal,
                      message: &str,
                      source: Option<(Source, usize)>,
                      refusals: &mut Throttled| {
            shared.obs.connection_refused(reason);
            refusals.log(|muted| {
                warn!(
                    event = events::CONNECTION_REFUSED,
                    reason = reason.as_str(),
                    peer = %peer,
                    source = source.map(|(s, _)| field::display(s)),
                    source_handshakes = source.map(|(_, held)| held),
                    max_connections = shared.limits.max_connections,
                    max_unauthenticated = shared.limits.max_unauthenticated,
                    unlogged = muted
                )
            });
            // Non-blocking: the refusal never waits on the peer.
            let _ = stream.try_write(&busy_frame(message));
        };
        let Some(open) = shared.admission.open(shared.limits.max_connections) else {
            refuse(
                ConnectionRefusal::MaxConnections,
                "too many connections",
                None,
                &mut refusals,
            );
            continue;
        };
        let id = shared.admission.next_id();
        let handshaking = match shared.admission.handshaking(id, peer.ip(), &shared.limits) {
            Ok((handshaking, None)) => handshaking,
            Ok((handshaking, Some(victim))) => {
                // The victim's own task writes its BUSY frame and closes.
                shared.obs.connection_refused(ConnectionRefusal::Displaced);
                displacements.log(|muted| {
                    warn!(
                        event = events::CONNECTION_DISPLACED,
                        conn = victim.id,
                        source = %victim.source,
                        source_handshakes = victim.held,
                        taken_by = %peer,
                        max_unauthenticated = shared.limits.max_unauthenticated,
                        unlogged = muted,
                        "the oldest handshake of the source holding the most gave its place to a source holding fewer"
                    )
                });
                handshaking
            }
            Err(refused) => {
                refuse(
                    ConnectionRefusal::MaxUnauthenticated,
                    HANDSHAKES_FULL,
                    Some((refused.source, refused.held)),
                    &mut refusals,
                );
                continue;
            }
        };
        debug!(event = events::CONNECTION_ACCEPTED, conn = id, peer = %peer);
        // Moved to its worker's reactor (deregistered from this one).
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                debug!(event = events::CONNECTION_LOST, conn = id, error = %e);
                continue;
            }
        };
        let shared = Arc::clone(&shared);
        workers.spawn(async move {
            match tokio::net::TcpStream::from_std(stream) {
                Ok(s) => connection::run(shared, id, peer, s, open, handshaking).await,
                Err(e) => debug!(event = events::CONNECTION_LOST, conn = id, error = %e),
            }
        });
    }
    // New connections are refused from here on.
    drop(listener);
    let until = Instant::now() + shared.limits.shutdown_timeout;
    while shared.admission.open_now() > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let left = shared.admission.open_now();
    if left > 0 {
        warn!(
            event = events::SHUTDOWN_CUT,
            connections = left,
            shutdown_timeout_secs = shared.limits.shutdown_timeout.as_secs(),
            "connections still open at the shutdown deadline are cut"
        );
    } else {
        info!(event = events::SHUTDOWN_DRAINED);
    }
    Ok(())
}
