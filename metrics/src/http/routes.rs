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
        "/metrics" if openmetrics && prefers_openmetrics(head) => Rendered::OpenMetrics,
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

/// Whether the request's `Accept` header ranks the OpenMetrics text format
/// above the Prometheus text format (as Prometheus itself asks: OpenMetrics
/// first, `text/plain` at a lower `q`). No header, or a tie, is text.
fn prefers_openmetrics(head: &[u8]) -> bool {
    let head = String::from_utf8_lossy(head);
    let Some(accept) = head.split("\r\n").skip(1).find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim().eq_ignore_ascii_case("accept").then_some(value)
    }) else {
        return false;
    };
    let (mut om, mut text) = (0.0f32, 0.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.strip_prefix("q="))
            .find_map(|v| v.parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    om > text
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

#[cfg(test)]
mod tests {
    use super::*;

    fn what(head: &str, openmetrics: bool) -> Option<Rendered> {
        match route(head.as_bytes(), openmetrics) {
            Route::Render { what, .. } => Some(what),
            Route::Now(_) => None,
        }
    }

    #[test]
    fn metrics_answers_openmetrics_to_a_client_that_prefers_it() {
        // What Prometheus sends.
        let prometheus = "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: \
            application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
            version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n\r\n";
        assert_eq!(what(prometheus, true), Some(Rendered::OpenMetrics));
        // Not when the daemon does not serve OpenMetrics.
        assert_eq!(what(prometheus, false), Some(Rendered::Metrics));
        for head in [
            "GET /metrics HTTP/1.1\r\n\r\n",
            "GET /metrics HTTP/1.1\r\naccept: */*\r\n\r\n",
            "GET /metrics HTTP/1.1\r\nAccept: text/plain, application/openmetrics-text\r\n\r\n",
            "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;q=0.2, text/plain\r\n\r\n",
        ] {
            assert_eq!(what(head, true), Some(Rendered::Metrics), "{head:?}");
        }
        let om = "GET /metrics HTTP/1.1\r\nACCEPT: Application/OpenMetrics-Text\r\n\r\n";
        assert_eq!(what(om, true), Some(Rendered::OpenMetrics));
    }
}
