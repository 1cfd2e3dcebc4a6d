//! The metrics listener: `/metrics`, `/metrics/openmetrics` (opt-in),
//! `/health`, `/live`, `/ready`, `/diagnostics`.
//!
//! A scrape endpoint must keep answering when the daemon's async runtime is
//! wedged, which is exactly when it is needed, so it runs on its own std
//! threads, not on the runtime. And it must keep answering when clients
//! misbehave: a thread per connection lets a few dozen sockets that send
//! one byte every few seconds occupy every slot, so `/health` turns 503
//! for as long as they trickle. So:
//!
//! - One event-loop thread ([`event_loop`]) multiplexes every connection
//!   on epoll with non-blocking sockets. A connection costs a descriptor
//!   and a head buffer of at most `max_request_bytes`, not a thread.
//! - Each connection has an absolute deadline (`request_timeout`) from
//!   accept to a complete request head, however it trickles, and one
//!   (`write_timeout`) for its answer to be built and read.
//! - At `max_connections`, a new connection sheds the oldest one still
//!   waiting for its request head instead of being refused: idle and
//!   trickling sockets cannot lock a prober out, they only push each other
//!   out.
//! - `/health`, `/live` and errors are answered on the loop thread: they
//!   read no daemon state, so nothing can stall them. `/metrics`,
//!   `/ready` and `/diagnostics` read daemon state (collectors, probes)
//!   that a wedged daemon may hold locks on, so the loop hands them to a
//!   small pool of render workers ([`render`]) through a bounded queue
//!   (full: 503 at once) and writes their answer when it comes back. A
//!   slow or stuck render delays only the scrapes queued behind it.
//!
//! Every such ending is counted in `<prefix>_metrics_http_rejections_total`
//! by [`HttpRejection`].

mod event_loop;
mod render;
mod routes;

pub use crate::labels::HttpRejection;
use crate::telemetry::Telemetry;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use thiserror::Error;

/// Listener limits.
#[derive(Debug, Clone, Copy)]
pub struct HttpConfig {
    /// Connections open at once; past it a new one sheds the oldest
    /// connection that has not delivered its request head yet.
    pub max_connections: usize,
    /// Largest request head accepted, in bytes.
    pub max_request_bytes: usize,
    /// Time from accept to a complete request head, however it trickles.
    pub request_timeout: Duration,
    /// Time from a complete request head until its answer has been built
    /// and written.
    pub write_timeout: Duration,
}

/// Default `max_connections`: far above what Prometheus and a few probes
/// use; each is one descriptor.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default request deadline, seconds.
pub const DEFAULT_REQUEST_TIMEOUT_SECS: u64 = 5;
/// Default answer deadline, seconds.
pub const DEFAULT_WRITE_TIMEOUT_SECS: u64 = 10;

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_request_bytes: 8 * 1024,
            request_timeout: Duration::from_secs(DEFAULT_REQUEST_TIMEOUT_SECS),
            write_timeout: Duration::from_secs(DEFAULT_WRITE_TIMEOUT_SECS),
        }
    }
}

impl HttpConfig {
    /// The limits a daemon's config keys set, the rest at their defaults.
    pub fn with_limits(
        max_connections: usize,
        request_timeout_secs: u64,
        write_timeout_secs: u64,
    ) -> Self {
        HttpConfig {
            max_connections,
            request_timeout: Duration::from_secs(request_timeout_secs),
            write_timeout: Duration::from_secs(write_timeout_secs),
            ..HttpConfig::default()
        }
    }
}

/// Starting the listener failed.
#[derive(Debug, Error)]
pub enum HttpError {
    /// The address could not be resolved or bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The event loop or a render worker could not be started.
    #[error("cannot start the metrics listener: {0}")]
    Spawn(std::io::Error),
}

/// A running listener; stops (and sets `*_metrics_http_server_up` to 0) when
/// dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: event_loop::Stop,
    threads: Vec<JoinHandle<()>>,
    telemetry: Arc<Telemetry>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Binds `addr` (e.g. `127.0.0.1:9477`, or port 0 in tests) and serves
    /// the endpoints from `telemetry`.
    pub fn start(
        addr: &str,
        telemetry: Arc<Telemetry>,
        config: HttpConfig,
    ) -> Result<MetricsServer, HttpError> {
        let bound = addr
            .to_socket_addrs()
            .and_then(|mut a| {
                a.next().ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address")
                })
            })
            .and_then(TcpListener::bind)
            .and_then(|l| Ok((l.local_addr()?, l)));
        let (local, listener) = match bound {
            Ok(v) => v,
            Err(source) => {
                telemetry.http_start_failed();
                return Err(HttpError::Bind {
                    addr: addr.to_string(),
                    source,
                });
            }
        };
        let started = event_loop::spawn(listener, Arc::clone(&telemetry), config);
        let (stop, threads) = started.map_err(|e| {
            telemetry.http_start_failed();
            HttpError::Spawn(e)
        })?;
        telemetry.http_server_up(true);
        Ok(MetricsServer {
            addr: local,
            stop,
            threads,
            telemetry,
        })
    }

    /// The bound address (the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.stop();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.telemetry.http_server_up(false);
    }
}
