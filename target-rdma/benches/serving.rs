//! `cargo bench --bench serving`: this build's `arenad` binary against a
//! baseline binary (`ARENAD_BASELINE`, e.g. main's, built in the same
//! session), both as real processes on loopback, driven by the same client,
//! alternating in each round so load on a shared machine shifts both
//! sides. The result is the median ratio candidate / baseline per case,
//! with the lowest and highest ratio of a single round (docs/BENCHMARKS.md
//! records them):
//!
//! - 4 KiB read and write round trips at QD 1 (one connection);
//! - resident 4 KiB random reads at QD 32 per connection, over 1, 8 and
//!   64 connections;
//! - resident 1 MiB reads and writes at QD 4 per connection, over 1, 8
//!   and 64 connections;
//! - resident memory (VmRSS) with 2000 idle unauthenticated connections
//!   (each has read its CHALLENGE, none sends HELLO).
//!
//! `BENCH_ROUNDS` (default 3) rounds, `BENCH_SECS` (default 2) per run,
//! `BENCH_ONLY=<substring>` runs the cases whose name contains it.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use target_rdma::client::{ArenaClient, ClientConfig};
use target_rdma::testing::{free_port, secret, secret_file};

mod common;
use common::{closed_loop, median, Dir};

const MIB: usize = 1 << 20;
const SECRET: &str = "benchmark-secret-0123456789";
/// Blobs written before the runs: every request is resident.
const BLOBS: u64 = 64;

fn secs() -> Duration {
    common::secs(2.0)
}

/// One arenad process over a fresh swap directory.
struct Daemon {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(bin: &Path, root: &Path, extra: &str) -> Daemon {
        let dir = tempfile::tempdir_in(root).unwrap();
        let key = secret_file(dir.path(), "bench.key", SECRET);
        let port = free_port();
        let metrics = free_port();
        let cfg = dir.path().join("arenad.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"127.0.0.1:{port}\"\narena_bytes = \"256M\"\nblob_bytes = \"1M\"\n\
                 swap_dir = \"{}\"\nswap_bytes = \"512M\"\nmetrics_listen = \"127.0.0.1:{metrics}\"\n\
                 log_level = \"warn\"\n{extra}\n\
                 [[volume]]\nname = \"bench\"\nsecret_file = \"{}\"\nquota = \"1G\"\n",
                dir.path().join("swap").display(),
                key.display()
            ),
        )
        .unwrap();
        let child = Command::new(bin)
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let d = Daemon {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "{} did not start", bin.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    fn connect(&self) -> ArenaClient {
        let mut cfg =
            ClientConfig::new(format!("127.0.0.1:{}", self.port), "bench", secret(SECRET));
        cfg.request_timeout = Duration::from_secs(30);
        cfg.versions = 1..=target_rdma::proto::VERSION;
        ArenaClient::connect(cfg).unwrap()
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A case: request size and direction, queue depth per connection, connections.
#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    dir: Dir,
    size: usize,
    qd: usize,
    conns: usize,
}

const CASES: &[Case] = &[
    Case {
        name: "4K read QD1 x1",
        dir: Dir::Read,
        size: 4096,
        qd: 1,
        conns: 1,
    },
    Case {
        name: "4K write QD1 x1",
        dir: Dir::Write,
        size: 4096,
        qd: 1,
        conns: 1,
    },
    Case {
        name: "4K read QD32 x1",
        dir: Dir::Read,
        size: 4096,
        qd: 32,
        conns: 1,
    },
    Case {
        name: "4K read QD32 x8",
        dir: Dir::Read,
        size: 4096,
        qd: 32,
        conns: 8,
    },
    Case {
        name: "4K read QD32 x64",
        dir: Dir::Read,
        size: 4096,
        qd: 32,
        conns: 64,
    },
    Case {
        name: "1M read QD4 x1",
        dir: Dir::Read,
        size: MIB,
        qd: 4,
        conns: 1,
    },
    Case {
        name: "1M read QD4 x8",
        dir: Dir::Read,
        size: MIB,
        qd: 4,
        conns: 8,
    },
    Case {
        name: "1M read QD4 x64",
        dir: Dir::Read,
        size: MIB,
        qd: 4,
        conns: 64,
    },
    Case {
        name: "1M write QD4 x1",
        dir: Dir::Write,
        size: MIB,
        qd: 4,
        conns: 1,
    },
    Case {
        name: "1M write QD4 x8",
        dir: Dir::Write,
        size: MIB,
        qd: 4,
        conns: 8,
    },
    Case {
        name: "1M write QD4 x64",
        dir: Dir::Write,
        size: MIB,
        qd: 4,
        conns: 64,
    },
];

/// Runs `case` against `d`; returns bytes per second over all connections.
fn run(d: &Daemon, case: Case) -> f64 {
    let clients: Vec<ArenaClient> = (0..case.conns).map(|_| d.connect()).collect();
    let start = Instant::now();
    let total: u64 = std::thread::scope(|sc| {
        let workers: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(t, c)| sc.spawn(move || one_connection(c, case, t as u64, start)))
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    (total * case.size as u64) as f64 / start.elapsed().as_secs_f64()
}

/// One connection's requests at the case's depth until the run ends.
fn one_connection(c: &ArenaClient, case: Case, t: u64, start: Instant) -> u64 {
    let per_blob = (MIB / case.size) as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = x % (BLOBS * per_blob);
        (i / per_blob, ((i % per_blob) as usize * case.size) as u32)
    };
    let data = vec![0x5au8; case.size];
    let pool = std::cell::RefCell::new(vec![vec![0u8; case.size]; case.qd]);
    block_on(closed_loop(
        c,
        case.dir,
        case.qd,
        &data,
        &pool,
        next,
        || start.elapsed() < secs(),
    ))
}

/// VmRSS of `d` in KiB before and with 2000 idle unauthenticated sockets.
fn idle_rss(bin: &Path, root: &Path) -> (u64, u64) {
    let d = Daemon::start(
        bin,
        root,
        "max_connections = 4000\nmax_unauthenticated = 2500\nhandshake_timeout_secs = 600",
    );
    drop(d.connect());
    std::thread::sleep(Duration::from_millis(300));
    let before = d.rss_kib();
    let idle: Vec<TcpStream> = (0..2000)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut body = Vec::new();
            target_rdma::proto::read_frame(&mut s, &mut body)
                .expect("a CHALLENGE")
                .expect("a CHALLENGE, not the end of the stream");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let with = d.rss_kib();
    drop(idle);
    (before, with)
}

fn main() {
    let Some(baseline) = std::env::var_os("ARENAD_BASELINE").map(PathBuf::from) else {
        eprintln!("serving bench: set ARENAD_BASELINE to the arenad binary to compare against");
        return;
    };
    let candidate = PathBuf::from(env!("CARGO_BIN_EXE_arenad"));
    let root = tempfile::tempdir().unwrap();
    let rounds = common::knob("BENCH_ROUNDS", 3);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    println!(
        "serving bench: {} vs baseline {}",
        candidate.display(),
        baseline.display()
    );
    println!(
        "{rounds} rounds of {:?} per run; median of each side, ratio of medians",
        secs()
    );
    for case in CASES.iter().filter(|c| c.name.contains(only.as_str())) {
        let (mut base, mut cand) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            for (bin, out) in [(&baseline, &mut base), (&candidate, &mut cand)] {
                let d = Daemon::start(bin, root.path(), "");
                let c = d.connect();
                for key in 0..BLOBS {
                    block_on(c.write(key, 0, &vec![0x33; MIB])).unwrap();
                }
                drop(c);
                out.push(run(&d, *case));
            }
        }
        // Each round's ratio (its two runs were back to back): the spread.
        let ratios: Vec<f64> = cand.iter().zip(&base).map(|(c, b)| c / b).collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        let (b, c) = (median(base), median(cand));
        let unit = if case.size == MIB {
            format!("{:>8.1} vs {:>8.1} MiB/s", c / MIB as f64, b / MIB as f64)
        } else {
            format!(
                "{:>8.0} vs {:>8.0} ops/s",
                c / case.size as f64,
                b / case.size as f64
            )
        };
        println!(
            "{:<18} {unit}   ratio {:.2} (rounds {lo:.2}..{hi:.2})",
            case.name,
            c / b
        );
    }
    if "idle rss".contains(only.as_str()) || only.is_empty() {
        let (bb, bw) = idle_rss(&baseline, root.path());
        let (cb, cw) = idle_rss(&candidate, root.path());
        println!(
            "RSS, 2000 idle unauthenticated: {:.1} MiB (+{:.1}) vs baseline {:.1} MiB (+{:.1})",
            cw as f64 / 1024.0,
            (cw - cb) as f64 / 1024.0,
            bw as f64 / 1024.0,
            (bw.saturating_sub(bb)) as f64 / 1024.0
        );
    }
}
