//! What each request gets: the paths, which of them read daemon state (and
//! so are built by a render worker), and the bytes of an answer.

use crate::telemetry::{Telemetry, DIAGNOSTICS_SCHEMA_VERSION};

/// A path whose answer reads daemon state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rendered {
    Metrics,
    OpenMetrics,
    Ready,
    Diagnostics,
}

/// What a complete request head asks for.
#[derive(Debug)]
pub(super) enum Route {
    /// Answered at once, from no daemon state.
    Now(Vec<u8>),
    /// Built by a render worker.
    Render { what: Rendered, head_only: bool },
}

/// Routes a request head (everything up to and including the blank line).
pub(super) fn route(head: &[u8], openmetrics: bool) -> Route {
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default();
    let target = parts.next().unwrap_or_default();
    let path = target.split('?').next().unwrap_or_default();
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return Route::Now(plain(405, "method not allowed\n"));
    }
    let what = match path {
        "/metrics" => Rendered::Metrics,
        "/metrics/openmetrics" if openmetrics => Rendered::OpenMetrics,
        "/ready" => Rendered::Ready,
        "/diagnostics" => Rendered::Diagnostics,
        "/health" => return Route::Now(response(200, "text/plain", b"ok\n", head_only)),
        "/live" => {
            let body = json(&serde_json::json!({
                "schema_version": DIAGNOSTICS_SCHEMA_VERSION,
                "live": true,
            }));
            return Route::Now(response(200, "application/json", &body, head_only));
        }
        _ => return Route::Now(response(404, "text/plain", b"not found\n", head_only)),
    };
    Route::Render { what, head_only }
}

/// Builds the answer of a [`Route::Render`] (on a render worker).
pub(super) fn render(tel: &Telemetry, what: Rendered, head_only: bool) -> Vec<u8> {
    let (status, ctype, body): (u16, &str, Vec<u8>) = match what {
        Rendered::Metrics => match tel.render() {
            Ok(text) => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text.into_bytes(),
            ),
            Err(e) => (500, "text/plain", format!("{e}\n").into_bytes()),
        },
        Rendered::OpenMetrics => match tel.render_openmetrics() {
            Ok(text) => (200, crate::openmetrics::CONTENT_TYPE, text.into_bytes()),
            Err(e) => (500, "text/plain", format!("{e}\n").into_bytes()),
        },
        Rendered::Ready => {
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
        Rendered::Diagnostics => (200, "application/json", json(&tel.diagnostics())),
    };
    response(status, ctype, &body, head_only)
}

/// A `text/plain` answer with a body.
pub(super) fn plain(status: u16, body: &str) -> Vec<u8> {
    response(status, "text/plain", body.as_bytes(), false)
}

fn json(v: &serde_json::Value) -> Vec<u8> {
    let mut out = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    out.push(b'\n');
    out
}

fn response(status: u16, ctype: &str, body: &[u8], head_only: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        500 => "Internal Server Error",
        _ => "Service Unavailable",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}
