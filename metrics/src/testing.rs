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

/// Value of the sample `name` whose label set is exactly `labels`.
pub fn exact_sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
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

/// Like [`exact_sample`], panicking with the exposition when absent.
pub fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    exact_sample(text, name, labels)
        .unwrap_or_else(|| panic!("no sample {name}{labels:?} in:\n{text}"))
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
    let r = tracing::subscriber::with_default(subscriber, || {
        // A callsite first hit by another test thread while this
        // subscriber was being registered can keep the interest computed
        // without it ("never": its events would be lost here); recompute
        // every callsite's interest now that it is live.
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let text = String::from_utf8(buf.0.lock().clone()).expect("utf-8 logs");
    let records = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON log record"))
        .collect();
    (r, records)
}

/// Sockets that hold a metrics listener's connections the way a slowloris
/// attack does: `trickling` ones that send a request head one byte every
/// 200 ms and never finish it, and `idle` ones that never send a byte.
/// Like an attacker, it reconnects (up to 50 a round) the ones the server
/// closes, so `idle + trickling` stay open from this side until dropped.
pub struct SlowClients {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const SLOW_HEAD: &[u8] = b"GET /health HTTP/1.1\r\nX-Pad: ";

impl SlowClients {
    /// Opens `trickling` then `idle` connections to `addr`, each trickler
    /// sending its first byte at once.
    pub fn open(addr: &str, idle: usize, trickling: usize) -> SlowClients {
        raise_fd_limit((idle + trickling + 256) as u64);
        let addr = addr.to_string();
        let connect = |addr: &str, trickle: bool| {
            let mut s = TcpStream::connect(addr).expect("connect to the metrics listener");
            if trickle {
                let _ = s.write(&SLOW_HEAD[..1]);
            }
            s.set_nonblocking(true).unwrap();
            (s, trickle)
        };
        let mut socks: Vec<(TcpStream, bool)> = (0..trickling)
            .map(|_| connect(&addr, true))
            .chain((0..idle).map(|_| connect(&addr, false)))
            .collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut at = 1usize;
            while !flag.load(std::sync::atomic::Ordering::Acquire) {
                let byte = SLOW_HEAD.get(at).copied().unwrap_or(b'a');
                let mut reconnects = 0;
                for (s, trickle) in &mut socks {
                    let mut sink = [0u8; 512];
                    let closed = if *trickle {
                        s.write(&[byte]).is_err()
                    } else {
                        // Any answer, end of stream or error: the server
                        // is done with it.
                        !matches!(
                            s.read(&mut sink),
                            Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock
                        )
                    };
                    if closed && reconnects < 50 {
                        reconnects += 1;
                        *s = connect(&addr, *trickle).0;
                    }
                }
                at += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        SlowClients {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SlowClients {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sends a request head to `addr` one byte every `every`, never finishing
/// it, until the server closes the connection; returns what the server
/// sent. Panics if the connection is still open after `guard` (a hang
/// guard, not a timing assertion).
pub fn trickle_until_closed(addr: impl ToSocketAddrs, every: Duration, guard: Duration) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics listener");
    s.set_read_timeout(Some(every)).unwrap();
    let started = std::time::Instant::now();
    let mut got = Vec::new();
    let mut sent = 0usize;
    loop {
        assert!(
            started.elapsed() < guard,
            "a trickling request ({sent} bytes sent) was still open after {guard:?}"
        );
        if s.write_all(b"a").is_err() {
            break;
        }
        sent += 1;
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Raises this process's soft descriptor limit to at least `want` (up to
/// the hard limit), for tests that open many sockets.
pub fn raise_fd_limit(want: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    let hard = l.maximum.unwrap_or(u64::MAX);
    if l.current.is_some_and(|c| c < want) {
        l.current = Some(want.min(hard));
        let _ = setrlimit(Resource::Nofile, l);
    }
}

/// Descriptors process `pid` has open.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read /proc/PID/fd")
        .count()
}

/// Resident set size of process `pid`, bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS in /proc/PID/status")
        * 1024
}

/// What the metrics listener at `addr` of daemon `pid` (metric prefix
/// `prefix`, `max_connections` and a 2 s request deadline configured)
/// must do under a slowloris: while 500 trickling and 500 idle connections
/// are held against it, answer `/health` 200 every time, with the daemon's
/// descriptors bounded by `max_connections` and its RSS growing by at most
/// 16 MiB; and close a trickling request at its deadline however it
/// trickles (a 60 s hang guard, no timing assertion); and count both.
pub fn assert_survives_slowloris(addr: &str, pid: u32, prefix: &str, max_connections: usize) {
    let (fds_before, rss_before) = (open_fds(pid), rss_bytes(pid));
    let clients = SlowClients::open(addr, 500, 500);
    for _ in 0..20 {
        let (code, body) = http_get(addr, "/health");
        assert_eq!(
            (code, body.as_str()),
            (200, "ok\n"),
            "/health under slowloris"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (fds, rss) = (open_fds(pid), rss_bytes(pid));
    // At the limit, a newly accepted connection is open for a moment
    // before the oldest is shed for it: one above `max_connections`.
    assert!(
        fds <= fds_before + max_connections + 1,
        "{fds} descriptors open (were {fds_before}, max_connections {max_connections})"
    );
    assert!(
        rss <= rss_before + (16 << 20),
        "RSS grew from {rss_before} to {rss} bytes"
    );
    drop(clients);

    let sent_back = trickle_until_closed(addr, Duration::from_millis(100), Duration::from_secs(60));
    assert!(
        sent_back.is_empty() || sent_back.starts_with("HTTP/1.1 408"),
        "{sent_back}"
    );
    let (_, text) = http_get(addr, "/metrics");
    for reason in ["request_deadline", "shed"] {
        let name = format!("{prefix}_metrics_http_rejections_total");
        assert!(
            sample(&text, &name, &[("reason", reason)]) >= 1.0,
            "{reason}"
        );
    }
}
