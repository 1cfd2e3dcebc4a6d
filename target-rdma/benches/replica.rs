//! `cargo bench --bench replica`: what replication costs on loopback. A
//! volume replicated on N = 1, 2, 3 real arena peers (the workspace's
//! harness, `target_rdma::testing::Peer`, one store each) over TCP, against
//! a plain TCP client of one peer measured in the same round: 4 KiB random
//! writes and reads at QD 1 and 32 (IOPS and p99) and 1 MiB sequential
//! writes at QD 32 (MiB/s). Each case runs `BENCH_ROUNDS` (default 4)
//! rounds of the four configurations, each round starting one later
//! (rotated), and reports medians; ratios are the result
//! (docs/BENCHMARKS.md). `BENCH_SECS` (default 1) per run.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use futures::stream::{FuturesUnordered, StreamExt};
use target_rdma::blob::BlobIo;
use target_rdma::client::{ArenaClient, FlushDomain};
use target_rdma::replica::clock::system;
use target_rdma::replica::{
    Coordinator, MemberSessions, Membership, MemoryCoordinator, ReplicaConfig, ReplicaSet,
    ReplicatedIo,
};
use target_rdma::testing::{Peer, PeerOpts};

const MIB: usize = 1 << 20;
const SECRET: &str = "benchmark-secret-0123456789";
/// The span the requests address, in every store.
const SPAN: u64 = 128 << 20;

fn secs() -> Duration {
    Duration::from_secs_f64(
        std::env::var("BENCH_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1.0),
    )
}

fn rounds() -> usize {
    // Four: every configuration runs first once.
    std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn client(peer: &Peer, domain: &Arc<FlushDomain>) -> ArenaClient {
    let mut cfg = peer.config("bench", SECRET);
    cfg.request_timeout = Duration::from_secs(30);
    cfg.flush_domain = Arc::clone(domain);
    ArenaClient::connect(cfg).unwrap()
}

/// A volume on the first `n` peers, one queue.
fn replicated(peers: &[Peer], n: usize) -> ReplicatedIo<ArenaClient> {
    let members: Vec<_> = peers[..n]
        .iter()
        .map(|p| {
            let domain = Arc::new(FlushDomain::default());
            let sessions = MemberSessions {
                queues: vec![client(p, &domain)],
                background: client(p, &domain),
                epoch: 0,
            };
            (p.addr.to_string(), sessions)
        })
        .collect();
    let names: Vec<_> = members.iter().map(|(n, _)| n.clone()).collect();
    let coord = MemoryCoordinator::new(system(), Membership::new_volume(&names).unwrap());
    let set = block_on(ReplicaSet::open(
        "bench",
        coord as Arc<dyn Coordinator>,
        system(),
        ReplicaConfig::default(),
        members,
    ))
    .unwrap();
    set.queue(0).unwrap()
}

#[derive(Clone, Copy, PartialEq)]
enum Dir {
    Read,
    Write,
}

struct Rate {
    iops: f64,
    mib_s: f64,
    p99_us: f64,
}

/// `size`-byte requests at queue depth `qd` for the run's duration, at
/// random `size`-aligned offsets of the span (sequential for 1 MiB).
fn run(io: &impl BlobIo, dir: Dir, size: usize, qd: usize) -> Rate {
    let blob = u64::from(io.blob_bytes());
    let slots = SPAN / size as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut seq = 0u64;
    let mut next = move || {
        let i = if size == MIB {
            seq += 1;
            (seq - 1) % slots
        } else {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % slots
        };
        let off = i * size as u64;
        (off / blob, (off % blob) as u32)
    };
    let data = vec![0x5au8; size];
    let data = &data;
    let pool = RefCell::new(vec![vec![0u8; size]; qd]);
    let pool = &pool;
    let mut lat = Vec::new();
    let start = Instant::now();
    block_on(async {
        let mut inflight = FuturesUnordered::new();
        loop {
            while inflight.len() < qd && start.elapsed() < secs() {
                let (key, off) = next();
                inflight.push(async move {
                    let t = Instant::now();
                    match dir {
                        Dir::Write => io.write(key, off, data).await.map(|_| ()),
                        Dir::Read => {
                            let mut out = pool.borrow_mut().pop().expect("a buffer per slot");
                            let r = io.read(key, off, &mut out).await.map(|_| ());
                            pool.borrow_mut().push(out);
                            r
                        }
                    }
                    .expect("bench request");
                    t.elapsed()
                });
            }
            match inflight.next().await {
                Some(d) => lat.push(d),
                None => break,
            }
        }
    });
    let elapsed = start.elapsed().as_secs_f64();
    lat.sort_unstable();
    let ops = lat.len() as f64;
    Rate {
        iops: ops / elapsed,
        mib_s: ops * size as f64 / MIB as f64 / elapsed,
        p99_us: lat[lat.len() * 99 / 100].as_secs_f64() * 1e6,
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-replica");
    std::fs::create_dir_all(&root).unwrap();
    let tmp = tempfile::tempdir_in(&root).unwrap();
    let peers: Vec<_> = (0..3)
        .map(|i| {
            let dir = tmp.path().join(i.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            Peer::start(
                &dir,
                PeerOpts {
                    arena_bytes: SPAN * 2,
                    blob_bytes: MIB as u32,
                    swap_bytes: SPAN * 2,
                    quota_blobs: SPAN * 2 / MIB as u64,
                    max_inflight: 64,
                    volumes: vec![("bench".into(), SECRET.into())],
                    ..PeerOpts::default()
                },
            )
        })
        .collect();
    let direct = client(&peers[0], &Arc::new(FlushDomain::default()));
    let vols: Vec<_> = (1..=3).map(|n| replicated(&peers, n)).collect();
    // Every store holds the span, so reads hit data.
    run(&vols[2], Dir::Write, MIB, 32);
    println!(
        "replica benchmark, {:?} per run, {} rounds, TCP on loopback",
        secs(),
        rounds()
    );
    println!(
        "\n| case | direct TCP | N=1 | N=2 | N=3 | N=2 / N=1 | N=3 / N=1 | N=1 / direct |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (name, dir, size, qd) in [
        ("4 KiB rand write QD1", Dir::Write, 4096, 1),
        ("4 KiB rand write QD32", Dir::Write, 4096, 32),
        ("4 KiB rand read QD1", Dir::Read, 4096, 1),
        ("4 KiB rand read QD32", Dir::Read, 4096, 32),
        ("1 MiB seq write QD32", Dir::Write, MIB, 32),
    ] {
        // Per configuration (direct, N=1..3): medians of rate and p99.
        let mut rate = vec![Vec::new(); 4];
        let mut p99 = vec![Vec::new(); 4];
        for round in 0..rounds() {
            // Each round starts one configuration later: on a shared host
            // the slow stretches (another process's time slices) would
            // otherwise land on whichever configuration always runs first.
            for k in 0..4 {
                let i = (round + k) % 4;
                let r = match i {
                    0 => run(&direct, dir, size, qd),
                    n => run(&vols[n - 1], dir, size, qd),
                };
                rate[i].push(if size == MIB { r.mib_s } else { r.iops });
                p99[i].push(r.p99_us);
            }
        }
        let rate: Vec<_> = rate.into_iter().map(median).collect();
        let p99: Vec<_> = p99.into_iter().map(median).collect();
        let unit = if size == MIB { "MiB/s" } else { "IOPS" };
        let cell = |i: usize| format!("{:.0} {unit}, p99 {:.0} µs", rate[i], p99[i]);
        println!(
            "| {name} | {} | {} | {} | {} | {:.2}x | {:.2}x | {:.2}x |",
            cell(0),
            cell(1),
            cell(2),
            cell(3),
            rate[2] / rate[1],
            rate[3] / rate[1],
            rate[1] / rate[0],
        );
    }
}
