//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::io::Write;
use std::sync::{Arc, Mutex};

/// Value of the sample `name` whose label set is exactly `labels`.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    want.sort();
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ')?;
        let (n, l) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        let mut got: Vec<String> = if l.is_empty() {
            Vec::new()
        } else {
            l.split(',').map(str::to_string).collect()
        };
        got.sort();
        if got == want {
            return value.parse().ok();
        }
    }
    None
}

/// Like [`sample`], panicking with the exposition when absent.
pub fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(text, name, labels).unwrap_or_else(|| panic!("no sample {name}{labels:?} in:\n{text}"))
}

/// A `tracing` writer collecting formatted events in memory.
#[derive(Clone, Default)]
pub struct LogBuf(pub Arc<Mutex<Vec<u8>>>);

impl LogBuf {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuf {
    type Writer = LogBuf;
    fn make_writer(&'a self) -> LogBuf {
        self.clone()
    }
}

/// Runs `f` with a JSON subscriber writing into the returned buffer.
pub fn capture_logs<T>(f: impl FnOnce() -> T) -> (T, String) {
    let buf = LogBuf::default();
    let sub = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_writer(buf.clone())
        .finish();
    let out = tracing::subscriber::with_default(sub, f);
    (out, buf.text())
}

/// Lines of `logs` whose `event` field is `event`.
pub fn events<'a>(logs: &'a str, event: &str) -> Vec<&'a str> {
    let needle = format!("\"event\":\"{event}\"");
    logs.lines().filter(|l| l.contains(&needle)).collect()
}
