//! `cargo bench --bench replica`: what replication costs on loopback. A
//! volume replicated on N = 1, 2, 3 real arena peers (the workspace's
//! harness, `target_rdma::testing::Peer`, one store each) over TCP, against
//! a plain TCP client of one peer measured in the same round: 4 KiB random
//! writes and reads at QD 1 and 32 (IOPS and p99) and 1 MiB sequential
//! writes at QD 32 (MiB/s). Each case runs `BENCH_ROUNDS` (default 4)
//! rounds of the four configurations, each round starting one later
//! (rotated), and reports medians; ratios are the result
//! (docs/BENCHMARKS.md). `BENCH_SECS` (default 1) per run.
//!
//! Then the rebuild: a volume on peer 0 brings peer 1 in as a new member,
//! copying `BENCH_REBUILD_MIB` (default 128) MiB with 1 and 8 copies in
//! flight (unlimited, and 8 at a 64 MiB/s limit), against blob-sized
//! writes of a plain session to peer 1 at QD 1 and 8 (sequential for
//! 1 MiB), rotated the same way; once on the peers above (1 MiB blobs),
//! once on two of 64 KiB blobs. `BENCH_CASE=rebuild` runs only this part.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use futures::stream::{FuturesUnordered, StreamExt};
use target_rdma::blob::BlobIo;
use target_rdma::client::{ArenaClient, FlushDomain};
use target_rdma::replica::clock::system;
use target_rdma::replica::{
    Coordinator, MemberSessions, Membership, MemoryCoordinator, RebuildConfig, RebuildStats,
    ReplicaConfig, ReplicaSet, ReplicatedIo,
};
use target_rdma::testing::{Peer, PeerOpts};

mod common;
use common::median;

const MIB: usize = 1 << 20;
const SECRET: &str = "benchmark-secret-0123456789";
/// The span the requests address, in every store.
const SPAN: u64 = 128 << 20;

fn secs() -> Duration {
    common::secs(1.0)
}

fn rounds() -> usize {
    // Four: every configuration runs first once.
    common::knob("BENCH_ROUNDS", 4)
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

fn sessions(p: &Peer) -> MemberSessions<ArenaClient> {
    let domain = Arc::new(FlushDomain::default());
    MemberSessions {
        queues: vec![client(p, &domain)],
        background: client(p, &domain),
        epoch: 0,
    }
}

/// Rebuilds `to` from a fresh volume on `from` alone, whose record starts
/// at `epoch` (above every epoch the peers saw: each rebuild raises
/// three); the rate in MiB/s.
fn rebuild(from: &Peer, to: &Peer, epoch: u64, keys: u64, inflight: usize, limit: u64) -> f64 {
    let names = vec![from.addr.to_string()];
    let mut record = Membership::new_volume(&names).unwrap();
    record.epoch = epoch;
    let coord = MemoryCoordinator::new(system(), record);
    let set = block_on(ReplicaSet::open(
        "bench",
        coord as Arc<dyn Coordinator>,
        system(),
        ReplicaConfig::default(),
        vec![(names[0].clone(), sessions(from))],
    ))
    .unwrap();
    let blob = u64::from(BlobIo::blob_bytes(&sessions(from).background));
    let cfg = RebuildConfig {
        keys: 0..keys,
        bytes_per_sec: limit,
        inflight,
        ..RebuildConfig::default()
    };
    let stats = RebuildStats::default();
    let start = Instant::now();
    block_on(set.rebuild(&to.addr.to_string(), sessions(to), &cfg, &stats)).unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(stats.bytes_copied.into_inner(), keys * blob);
    (keys * blob) as f64 / MIB as f64 / secs
}

/// Two fresh peers of `blob`-byte blobs.
fn peer_pair(root: &std::path::Path, blob: u32) -> Vec<Peer> {
    (0..2)
        .map(|i| {
            let dir = root.join(format!("rebuild-{blob}-{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            Peer::start(
                &dir,
                PeerOpts {
                    arena_bytes: SPAN * 2,
                    blob_bytes: blob,
                    swap_bytes: SPAN * 2,
                    quota_blobs: SPAN * 2 / u64::from(blob),
                    max_inflight: 64,
                    volumes: vec![("bench".into(), SECRET.into())],
                    ..PeerOpts::default()
                },
            )
        })
        .collect()
}

fn rebuild_cases(peers: &[Peer]) {
    let mib = common::knob("BENCH_REBUILD_MIB", 128u64).min(SPAN / MIB as u64);
    // Every blob the rebuild copies holds data on the source.
    let src = client(&peers[0], &Arc::new(FlushDomain::default()));
    let blob = BlobIo::blob_bytes(&src) as usize;
    let keys = mib * MIB as u64 / blob as u64;
    let data = vec![0xa5u8; blob];
    for k in 0..keys {
        block_on(src.write(k, 0, &data)).unwrap();
    }
    let plain = client(&peers[1], &Arc::new(FlushDomain::default()));
    let kib = blob >> 10;
    println!(
        "\nrebuild of {mib} MiB ({kib} KiB blobs) from peer 0 to peer 1, against {kib} KiB writes of a plain session to peer 1\n\n| case | MiB/s | / plain write QD1 |\n|---|---:|---:|"
    );
    let names = [
        "plain write QD1",
        "plain write QD8",
        "rebuild inflight=1",
        "rebuild inflight=8",
        "rebuild inflight=8, limit 64 MiB/s",
    ];
    let mut rate = vec![Vec::new(); names.len()];
    let mut epoch = 1000;
    for round in 0..rounds() {
        for k in 0..names.len() {
            let i = (round + k) % names.len();
            epoch += 10;
            if i < 2 {
                // A plain session, as a writer past the rebuilds' epochs.
                block_on(plain.raise_epoch(epoch)).unwrap();
            }
            let r = match i {
                0 => run(&plain, Dir::Write, blob, 1).mib_s,
                1 => run(&plain, Dir::Write, blob, 8).mib_s,
                2 => rebuild(&peers[0], &peers[1], epoch, keys, 1, 0),
                3 => rebuild(&peers[0], &peers[1], epoch, keys, 8, 0),
                _ => rebuild(&peers[0], &peers[1], epoch, keys, 8, 64 * MIB as u64),
            };
            rate[i].push(r);
        }
    }
    let rate: Vec<_> = rate.into_iter().map(median).collect();
    for (i, name) in names.iter().enumerate() {
        println!("| {name} | {:.0} | {:.2}x |", rate[i], rate[i] / rate[0]);
    }
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
    println!(
        "replica benchmark, {:?} per run, {} rounds, TCP on loopback",
        secs(),
        rounds()
    );
    let small = peer_pair(tmp.path(), 64 << 10);
    if std::env::var("BENCH_CASE").is_ok_and(|c| c == "rebuild") {
        rebuild_cases(&peers);
        rebuild_cases(&small);
        return;
    }
    let direct = client(&peers[0], &Arc::new(FlushDomain::default()));
    let vols: Vec<_> = (1..=3).map(|n| replicated(&peers, n)).collect();
    // Every store holds the span, so reads hit data.
    run(&vols[2], Dir::Write, MIB, 32);
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
    // Last: the rebuilds raise the peers' epochs past the volumes above.
    rebuild_cases(&peers);
    rebuild_cases(&small);
}
