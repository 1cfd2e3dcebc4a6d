//! Test support shared by the workspace's tests: one GET against a metrics
//! listener, reading a sample out of an exposition, and `promtool`, whose
//! absence fails the test that asks for it (CI installs it; a silently
//! skipped check never runs). Compiled for tests only (feature
//! `test-utils`), never into the daemons.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// One `GET path`; returns the status code and the body. Panics on a
/// connection or protocol failure: it exists for tests.
pub fn http_get(addr: impl ToSocketAddrs, path: &str) -> (u16, String) {
    let (code, _, body) = http_get_typed(addr, path);
    (code, body)
}

/// [`http_get`] that also returns the `Content-Type` header's value.
pub fn http_get_typed(addr: impl ToSocketAddrs, path: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    let code = head
        .split(' ')
        .nth(1)
        .expect("a status line")
        .parse()
        .expect("a status code");
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (code, content_type, body.to_string())
}

/// promtool from `$PROMTOOL` or `PATH`; panics with the install hint when
/// it is missing.
pub fn promtool() -> PathBuf {
    std::env::var_os("PROMTOOL")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p).map(|d| d.join("promtool")).find(|f| f.is_file())
            })
        })
        .unwrap_or_else(|| {
            panic!(
                "promtool not found: install it with `apt-get install -y --no-install-recommends prometheus` \
                 (Debian package `prometheus`; CI installs it) or set PROMTOOL"
            )
        })
}

/// Runs `promtool ARGS` in `dir` with `stdin` as input; panics unless it
/// succeeds, and returns its combined output.
pub fn run_promtool(args: &[&str], stdin: Option<&str>, dir: &Path) -> String {
    let mut child = Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    let input = child.stdin.take().expect("piped stdin");
    if let Some(text) = stdin {
        let mut input = input;
        input.write_all(text.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// `promtool check metrics` on an exposition; panics on any problem and
/// returns promtool's (lint) output.
pub fn promtool_check_metrics(exposition: &str) -> String {
    run_promtool(&["check", "metrics"], Some(exposition), Path::new("."))
}

/// A Python 3 that has the `prometheus_client` package (Debian
/// `python3-prometheus-client`; CI installs it): `$PYTHON3`, else
/// `/usr/bin/python3`. Panics with the install hint when it is missing.
pub fn python_with_prometheus_client() -> PathBuf {
    let python = std::env::var_os("PYTHON3")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/python3"));
    let ok = Command::new(&python)
        .args(["-c", "import prometheus_client.openmetrics.parser"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import prometheus_client: install it with \
         `apt-get install -y --no-install-recommends python3-prometheus-client` \
         (CI installs it) or set PYTHON3",
        python.display()
    );
    python
}

/// Parses an OpenMetrics exposition with the reference Python parser
/// (`prometheus_client.openmetrics.parser`, which rejects what the
/// specification forbids) and returns one line per sample:
/// `<family type> <sample name> <labels as sorted JSON> <value> <exemplar
/// trace_id or -> <exemplar value or ->`. Panics with the parser's error.
pub fn parse_openmetrics(exposition: &str) -> String {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        ex = s.exemplar
        print(fam.type, s.name, json.dumps(s.labels, sort_keys=True, separators=(",", ":")), s.value,
              ex.labels.get("trace_id", "-") if ex else "-", ex.value if ex else "-")
"#;
    let mut child = Command::new(python_with_prometheus_client())
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser rejected the exposition:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Starts `cmd` with stderr piped and returns the child and a channel of
/// its stderr lines, so a test can wait for a daemon's start events.
pub fn spawn_with_log_lines(
    cmd: &mut Command,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the daemon");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// The loopback `IP:port` a daemon logged after `marker` (daemons under test
/// bind port 0 and log the address they got).
pub fn addr_after(line: &str, marker: &str) -> Option<String> {
    let rest = &line[line.find(marker)?..];
    let start = rest.find("127.0.0.1:")?;
    Some(
        rest[start..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
            .collect(),
    )
}

/// The sum of the samples of `name` whose labels include every pair of
/// `labels`, in a Prometheus text exposition (0 when there is none).
pub fn sample(exposition: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Runs `f` with this thread's `tracing` records captured as JSON lines
/// (the shape `log_format = "json"` writes, [`crate::events::json_subscriber`]) and returns its result and the
/// parsed records.
pub fn capture_json_logs<R>(f: impl FnOnce() -> R) -> (R, Vec<serde_json::Value>) {
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<parking_lot::Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let sink = buf.clone();
    let subscriber =
        crate::events::json_subscriber(tracing_subscriber::EnvFilter::new("trace"), move || {
            sink.clone()
        });
    let r = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(buf.0.lock().clone()).expect("utf-8 logs");
    let records = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON log record"))
        .collect();
    (r, records)
}
