//! The metrics listener: `/metrics`, `/metrics/openmetrics` (opt-in),
//! `/health`, `/live`, `/ready`, `/diagnostics`.
//!
//! A scrape endpoint must keep answering when the daemon's async runtime is
//! wedged, which is exactly when it is needed, so it runs on its own std
//! threads. It serves one small GET per connection, with bounded request
//! size, socket timeouts and a connection limit, so a misbehaving client
//! cannot exhaust the daemon.

use crate::telemetry::{Telemetry, DIAGNOSTICS_SCHEMA_VERSION};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use thiserror::Error;

/// Listener limits.
#[derive(Debug, Clone, Copy)]
pub struct HttpConfig {
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Largest request head accepted, in bytes.
    pub max_request_bytes: usize,
    /// Socket read timeout.
    pub read_timeout: Duration,
    /// Socket write timeout.
    pub write_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            max_connections: 16,
            max_request_bytes: 8 * 1024,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
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
    /// The accept thread could not be started.
    #[error("cannot start the metrics listener thread: {0}")]
    Spawn(std::io::Error),
}

/// A running listener; stops (and sets `*_metrics_http_server_up` to 0) when
/// dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
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
        let stop = Arc::new(AtomicBool::new(false));
        let tel = Arc::clone(&telemetry);
        let stop2 = Arc::clone(&stop);
        let accept = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || accept_loop(listener, tel, stop2, config))
            .map_err(|e| {
                telemetry.http_start_failed();
                HttpError::Spawn(e)
            })?;
        telemetry.http_server_up(true);
        Ok(MetricsServer {
            addr: local,
            stop,
            accept: Some(accept),
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
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(j) = self.accept.take() {
            let _ = j.join();
        }
        self.telemetry.http_server_up(false);
    }
}

fn accept_loop(
    listener: TcpListener,
    tel: Arc<Telemetry>,
    stop: Arc<AtomicBool>,
    config: HttpConfig,
) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let Ok(stream) = conn else { continue };
        let _ = stream.set_read_timeout(Some(config.read_timeout));
        let _ = stream.set_write_timeout(Some(config.write_timeout));
        if active.fetch_add(1, Ordering::AcqRel) >= config.max_connections {
            active.fetch_sub(1, Ordering::AcqRel);
            let mut s = stream;
            let _ = respond(&mut s, 503, "text/plain", b"too many connections\n", false);
            continue;
        }
        let tel = Arc::clone(&tel);
        let active2 = Arc::clone(&active);
        let spawned = std::thread::Builder::new()
            .name("metrics-http-conn".into())
            .spawn(move || {
                serve(stream, &tel, &config);
                active2.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn read_head(stream: &mut TcpStream, max: usize) -> Option<Vec<u8>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > max {
            return None;
        }
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Some(buf);
        }
    }
}

fn serve(mut stream: TcpStream, tel: &Telemetry, config: &HttpConfig) {
    let Some(head) = read_head(&mut stream, config.max_request_bytes) else {
        let _ = respond(&mut stream, 400, "text/plain", b"bad request\n", false);
        return;
    };
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default();
    let target = parts.next().unwrap_or_default();
    let path = target.split('?').next().unwrap_or_default();
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        let _ = respond(
            &mut stream,
            405,
            "text/plain",
            b"method not allowed\n",
            false,
        );
        return;
    }
    let (status, ctype, body): (u16, &str, Vec<u8>) = match path {
        "/metrics" => match tel.render() {
            Ok(text) => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text.into_bytes(),
            ),
            Err(e) => (500, "text/plain", format!("{e}\n").into_bytes()),
        },
        "/metrics/openmetrics" if tel.openmetrics_enabled() => match tel.render_openmetrics() {
            Ok(text) => (200, crate::openmetrics::CONTENT_TYPE, text.into_bytes()),
            Err(e) => (500, "text/plain", format!("{e}\n").into_bytes()),
        },
        "/health" => (200, "text/plain", b"ok\n".to_vec()),
        "/live" => (
            200,
            "application/json",
            json(&serde_json::json!({"schema_version": DIAGNOSTICS_SCHEMA_VERSION, "live": true})),
        ),
        "/ready" => {
            let r = tel.readiness();
            let reasons: Vec<&str> = r.failing.iter().map(|x| x.as_str()).collect();
            let body = json(&serde_json::json!({
                "schema_version": DIAGNOSTICS_SCHEMA_VERSION,
                "ready": r.is_ready(),
                "reasons": reasons,
            }));
            (
                if r.is_ready() { 200 } else { 503 },
                "application/json",
                body,
            )
        }
        "/diagnostics" => (200, "application/json", json(&tel.diagnostics())),
        _ => (404, "text/plain", b"not found\n".to_vec()),
    };
    let _ = respond(&mut stream, status, ctype, &body, head_only);
}

fn json(v: &serde_json::Value) -> Vec<u8> {
    let mut out = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    out.push(b'\n');
    out
}

fn respond(
    stream: &mut TcpStream,
    status: u16,
    ctype: &str,
    body: &[u8],
    head_only: bool,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        500 => "Internal Server Error",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(body)?;
    }
    stream.flush()?;
    let _ = stream.shutdown(Shutdown::Write);
    Ok(())
}
