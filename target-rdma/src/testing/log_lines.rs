//! A real daemon's JSON log lines, read as they come (both daemons log one
//! shape, so arenad's and ublkd's tests share these).

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// The log lines up to and including the first with `"event":"<event>"`.
pub fn until(lines: &Receiver<String>, event: &str) -> Vec<String> {
    let marker = format!("\"event\":\"{event}\"");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no {event} (or the daemon exited) after:\n{seen:#?}"));
        let done = line.contains(&marker);
        seen.push(line);
        if done {
            return seen;
        }
    }
}

/// Whether one of `lines` is event `event` and contains `field`.
pub fn has(lines: &[String], event: &str, field: &str) -> bool {
    lines
        .iter()
        .any(|l| l.contains(&format!("\"event\":\"{event}\"")) && l.contains(field))
}
