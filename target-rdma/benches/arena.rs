//! `cargo bench --bench arena`: the arena's inline TCP data path and its swap,
//! each against its medium's limit measured in the same run (ratios, not
//! absolute numbers, are the result; docs/BENCHMARKS.md records them).
//!
//! - inline 1 MiB sequential and 4 KiB random reads and writes at QD 1 and
//!   32 through a real `arenad` server (the workspace's test harness,
//!   `target_rdma::testing::Peer`) and client on loopback, arena-resident;
//! - the same requests with an arena 16x smaller than the data, so every read
//!   faults in from swap and every write evicts a dirty slot;
//! - baselines: a plain TCP socket copy of the same bytes (1 MiB chunks, and
//!   a 4 KiB request/response ping-pong), and `dd` O_DIRECT sequential write
//!   and read bandwidth of the swap directory's disk.
//!
//! - the client's path alone: 4 KiB WRITEs and READs at QD 1 through the
//!   client to a protocol-only peer (`testing::EchoPeer`: handshake and
//!   tags, no store), against a raw socket ping-pong of the same frame
//!   sizes (`BENCH_ONLY=rtt`);
//!
//! - cold reads: 4 KiB random reads of blobs that are all in swap (a store
//!   reopened over 1 GiB of data), from 32 connections at QD 1 each and
//!   from one connection at QD 32, against `fio` 4 KiB random reads at QD 32
//!   (io_uring, O_DIRECT) of a file on the same disk; and the cost of the
//!   extent checks (CRC32C per 4 KiB block) per 4 KiB and 1 MiB read, as a
//!   share of a cold read's time at QD 1.
//!
//! Each case runs `BENCH_ROUNDS` (default 3) rounds of baseline-then-case and
//! reports the median ratio, so load on a shared machine shifts both sides.
//! `BENCH_SECS` (default 2) sets the time per run; `BENCH_DIR` the swap dir
//! (default: a temp dir under target/); `BENCH_ONLY=swap` runs only the
//! swap-bound cases, `BENCH_ONLY=cold` only the cold-read cases,
//! `BENCH_ONLY=rtt` only the client-path round trips,
//! `BENCH_ONLY=mac` only the cost of protocol version 2's frame tags and of
//! version 3's sealed frames against version 1's none (and the
//! integrity constructions alone, which `BENCH_ONLY=tags` runs by
//! themselves, no server: the way to measure them under `qemu-x86_64`), any other
//! `BENCH_ONLY` only the resident cases whose name contains it
//! (`BENCH_ONLY="read QD32"`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::pin::pin;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use futures::future::select;
use target_rdma::client::{ArenaClient, ClientConfig};
use target_rdma::proto::{self, Request, HEADER_LEN, TAG_LEN};
use target_rdma::store::bench_hooks::extent_checksums;
use target_rdma::store::{Store, StoreConfig, VolumeSpec};
use target_rdma::testing::{secret, EchoPeer, Peer, PeerOpts, UringLoop};

mod common;
use common::{closed_loop, median, sink, Dir};

/// The time per run.
fn secs() -> Duration {
    common::secs(2.0)
}

/// Rounds per case: each round measures the baseline and then the case, so a
/// ratio compares two runs seconds apart; the median ratio is reported.
fn rounds() -> usize {
    common::knob("BENCH_ROUNDS", 3)
}

const MIB: usize = 1 << 20;
const SECRET: &str = "benchmark-secret-0123456789";

/// Bytes/s and ops/s of one case.
struct Rate {
    ops: u64,
    bytes: u64,
    elapsed: Duration,
}

impl Rate {
    fn mib_s(&self) -> f64 {
        self.bytes as f64 / MIB as f64 / self.elapsed.as_secs_f64()
    }
    fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
}

/// Plain TCP: one thread sends `chunk`-sized writes, the receiver drains.
fn raw_tcp_stream(chunk: usize) -> Rate {
    let (addr, rx) = sink(chunk);
    let mut s = TcpStream::connect(addr).unwrap();
    let buf = vec![7u8; chunk];
    let start = Instant::now();
    let mut ops = 0;
    while start.elapsed() < secs() {
        s.write_all(&buf).unwrap();
        ops += 1;
    }
    drop(s);
    let bytes = rx.join().unwrap();
    Rate {
        ops,
        bytes,
        elapsed: start.elapsed(),
    }
}

/// Plain TCP request/response: `size` bytes out, `answer` bytes back, at
/// queue depth 1: the floor of any protocol round trip. `bytes` counts
/// the larger side.
fn raw_tcp_pingpong(size: usize, answer: usize) -> Rate {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0; size];
        let ans = vec![0; answer];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&ans).is_err() {
                break;
            }
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let buf = vec![7u8; size];
    let mut ans = vec![0u8; answer];
    let start = Instant::now();
    let mut ops = 0;
    while start.elapsed() < secs() {
        s.write_all(&buf).unwrap();
        s.read_exact(&mut ans).unwrap();
        ops += 1;
    }
    Rate {
        ops,
        bytes: ops * size.max(answer) as u64,
        elapsed: start.elapsed(),
    }
}

struct Bench {
    client: ArenaClient,
    blob: usize,
    // The server and store, dropped after the client.
    peer: Peer,
}

fn open_store(dir: &Path, arena: u64, swap: u64) -> Store {
    let blob = MIB as u32;
    Store::open(
        StoreConfig {
            dir: dir.to_owned(),
            arena_bytes: arena,
            blob_bytes: blob,
            swap_bytes: swap,
            swap_reads_in_flight: target_rdma::store::DEFAULT_SWAP_READS_IN_FLIGHT,
        },
        &[VolumeSpec {
            name: "bench".into(),
            quota_blobs: swap / u64::from(blob),
        }],
    )
    .unwrap()
}

/// The workspace's arenad harness (the real `Server` over a real `Store`,
/// with its telemetry, as arenad runs them), one volume, 1 MiB blobs.
fn start(dir: &Path, arena: u64, swap: u64) -> Bench {
    let blob = MIB as u32;
    let peer = Peer::start(
        dir,
        PeerOpts {
            arena_bytes: arena,
            blob_bytes: blob,
            swap_bytes: swap,
            quota_blobs: swap / u64::from(blob),
            max_inflight: 64,
            rdma: Vec::new(),
            rdma_isolation: Default::default(),
            volumes: vec![("bench".into(), SECRET.into())],
            allow_v1: false,
            ..PeerOpts::default()
        },
    );
    Bench {
        client: connect(&peer),
        blob: blob as usize,
        peer,
    }
}

fn connect(peer: &Peer) -> ArenaClient {
    let mut cfg = peer.config("bench", SECRET);
    cfg.request_timeout = Duration::from_secs(30);
    ArenaClient::connect(cfg).unwrap()
}

impl Bench {
    /// Another connection to the same server.
    fn connect(&self) -> ArenaClient {
        connect(&self.peer)
    }
}

/// Runs `size`-byte requests at queue depth `qd` for the case duration.
/// Sequential: offsets walk the first `span` bytes in order. Random: a
/// xorshift picks `size`-aligned offsets in `span`.
fn run(b: &Bench, dir: Dir, size: usize, qd: usize, span: u64, sequential: bool) -> Rate {
    run_client(&b.client, None, b.blob, dir, size, qd, span, sequential)
}

/// [`run`] on any client of a volume with `blob`-byte blobs; a driven
/// client runs with its driver on the loop `on`, on this thread.
#[allow(clippy::too_many_arguments)]
fn run_client(
    c: &ArenaClient,
    on: Option<&UringLoop>,
    blob: usize,
    dir: Dir,
    size: usize,
    qd: usize,
    span: u64,
    sequential: bool,
) -> Rate {
    let blob = blob as u64;
    let slots = span / size as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut seq = 0u64;
    let next = move || {
        let i = if sequential {
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
    let pool = std::cell::RefCell::new(vec![vec![0u8; size]; qd]);
    let start = Instant::now();
    let mut ops = 0;
    let work = async {
        ops = closed_loop(c, dir, qd, &data, &pool, next, || start.elapsed() < secs()).await;
    };
    match on {
        None => block_on(work),
        Some(lp) => {
            let driver = c.driver().expect("a driven client");
            lp.block_on(async {
                let _ = select(pin!(work), pin!(driver.run(lp))).await;
            });
        }
    }
    Rate {
        ops,
        bytes: ops * size as u64,
        elapsed: start.elapsed(),
    }
}

/// `dd` O_DIRECT sequential bandwidth of the disk under `dir`, in MiB/s.
fn dd(dir: &Path, write: bool, mib: usize) -> f64 {
    let file = dir.join("dd.bin").display().to_string();
    let count = format!("count={mib}");
    let args: Vec<String> = if write {
        [
            "if=/dev/zero",
            &format!("of={file}"),
            "bs=1M",
            &count,
            "oflag=direct",
            "conv=fdatasync",
        ]
        .map(String::from)
        .into()
    } else {
        [
            &format!("if={file}"),
            "of=/dev/null",
            "bs=1M",
            &count,
            "iflag=direct",
        ]
        .map(|s| s.to_string())
        .into()
    };
    let start = Instant::now();
    let st = Command::new("dd")
        .args(&args)
        .stderr(std::process::Stdio::null())
        .status();
    assert!(
        st.map(|s| s.success()).unwrap_or(false),
        "dd {args:?} failed"
    );
    mib as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let root = std::env::var_os("BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(|| {
            let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-arena");
            std::fs::create_dir_all(&d).unwrap();
            d
        });
    let tmp = tempfile::tempdir_in(&root).unwrap();
    println!(
        "arena benchmark, {:?} per case, swap dir {}",
        secs(),
        tmp.path().display()
    );

    match std::env::var("BENCH_ONLY").ok().as_deref() {
        None => {
            resident(&tmp, "");
            client_path(&tmp);
            swap_bound(&tmp);
            cold_reads(&tmp);
        }
        Some("rtt") => client_path(&tmp),
        Some("swap") => swap_bound(&tmp),
        Some("cold") => cold_reads(&tmp),
        Some("mac") => {
            mac_cost(&tmp);
            integrity_per_body();
        }
        Some("tags") => integrity_per_body(),
        Some(case) => resident(&tmp, case),
    }
}

/// What protocol version 2's frame tags cost: the same resident requests
/// over a version-1 session (no tags) and a version-2 one of the same
/// server, alternating.
fn mac_cost(tmp: &tempfile::TempDir) {
    let dir = tmp.path().join("mac");
    std::fs::create_dir_all(&dir).unwrap();
    let blob = MIB as u32;
    let peer = Peer::start(
        &dir,
        PeerOpts {
            arena_bytes: 1 << 30,
            blob_bytes: blob,
            swap_bytes: 2 << 30,
            quota_blobs: 2048,
            max_inflight: 64,
            rdma: Vec::new(),
            rdma_isolation: Default::default(),
            volumes: vec![("bench".into(), SECRET.into())],
            allow_v1: true,
            ..PeerOpts::default()
        },
    );
    let session = |version: u8| {
        let mut cfg = peer.config("bench", SECRET);
        cfg.request_timeout = Duration::from_secs(30);
        if version == proto::VERSION_3 {
            cfg.confidential = true;
        } else {
            cfg.versions = version..=version;
        }
        ArenaClient::connect(cfg).unwrap()
    };
    // One bench, its client swapped between a v1, a v2 and a v3 session.
    let mut clients = [session(1), session(2), session(3)];
    let mut b = Bench {
        client: session(2),
        blob: blob as usize,
        peer,
    };
    let span = 256 << 20;
    run(&b, Dir::Write, MIB, 32, span, true);
    println!("\n| frame protection, arena-resident | v1 (none) ops/s | v2 (BLAKE3 tags) ops/s | v3 (AES-256-GCM sealed) ops/s | median v2/v1 | median v3/v1 | median v3/v2 |\n|---|---:|---:|---:|---:|---:|---:|");
    for (name, dir, size, qd, seq) in [
        ("1 MiB seq write QD32", Dir::Write, MIB, 32, true),
        ("1 MiB seq read QD32", Dir::Read, MIB, 32, true),
        ("4 KiB rand write QD32", Dir::Write, 4096, 32, false),
        ("4 KiB rand read QD32", Dir::Read, 4096, 32, false),
    ] {
        let mut iops: [Vec<f64>; 3] = Default::default();
        let (mut v2, mut v3, mut v3v2) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds() {
            let mut round = [0.0; 3];
            for (i, c) in clients.iter_mut().enumerate() {
                std::mem::swap(&mut b.client, c);
                round[i] = run(&b, dir, size, qd, span, seq).iops();
                std::mem::swap(&mut b.client, c);
                iops[i].push(round[i]);
            }
            v2.push(round[1] / round[0]);
            v3.push(round[2] / round[0]);
            v3v2.push(round[2] / round[1]);
        }
        let [i1, i2, i3] = iops;
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.3}x | {:.3}x | {:.3}x |",
            median(i1),
            median(i2),
            median(i3),
            median(v2),
            median(v3),
            median(v3v2)
        );
    }
}

/// The candidate integrity constructions alone over one frame's body, one
/// core: keyed BLAKE3 as used, HMAC-SHA256, and the AEADs a TLS 1.3 record
/// layer (kTLS) would use, by `ring` with the CPU's AES and carry-less
/// multiply instructions: AES-256-GCM as a tag only (GMAC: the body as
/// associated data) and sealing the body (confidentiality too), and
/// ChaCha20-Poly1305 sealing it. No server: cheap enough to run under
/// user-mode QEMU, which translates code as the VM does.
fn integrity_per_body() {
    use hmac::{Hmac, Mac};
    use ring::aead;
    println!(
        "\n| integrity over one body, one core | keyed BLAKE3 µs | HMAC-SHA256 µs | AES-256-GMAC µs | AES-256-GCM seal µs | ChaCha20-Poly1305 seal µs | HMAC / BLAKE3 | GMAC / BLAKE3 | GCM seal / BLAKE3 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for size in [4096usize, MIB] {
        let body = vec![0x5au8; size];
        let key = [7u8; 32];
        let aead = |alg: &'static aead::Algorithm| {
            aead::LessSafeKey::new(aead::UnboundKey::new(alg, &key).unwrap())
        };
        let (gcm, chacha) = (aead(&aead::AES_256_GCM), aead(&aead::CHACHA20_POLY1305));
        let sealed = std::cell::RefCell::new(body.clone());
        let nonce = || aead::Nonce::assume_unique_for_key([3u8; 12]);
        let n = (64 * MIB / size).max(16);
        let time = |f: &dyn Fn()| {
            let start = Instant::now();
            for _ in 0..n {
                f();
            }
            start.elapsed().as_secs_f64() * 1e6 / n as f64
        };
        let blake = time(&|| {
            std::hint::black_box(blake3::keyed_hash(&key, std::hint::black_box(&body)));
        });
        let hmac = time(&|| {
            let mut m = Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
            m.update(std::hint::black_box(&body));
            std::hint::black_box(m.finalize());
        });
        let gmac = time(&|| {
            let aad = aead::Aad::from(std::hint::black_box(&body[..]));
            let _ = std::hint::black_box(
                gcm.seal_in_place_separate_tag(nonce(), aad, &mut [])
                    .unwrap(),
            );
        });
        let seal = |k: &aead::LessSafeKey| {
            let mut b = sealed.borrow_mut();
            let tag = k.seal_in_place_separate_tag(nonce(), aead::Aad::empty(), &mut b[..]);
            let _ = std::hint::black_box(tag.unwrap());
        };
        let gcm_seal = time(&|| seal(&gcm));
        let chacha_seal = time(&|| seal(&chacha));
        println!(
            "| {} | {blake:.2} | {hmac:.2} | {gmac:.2} | {gcm_seal:.2} | {chacha_seal:.2} | {:.2}x | {:.2}x | {:.2}x |",
            if size == MIB { "1 MiB" } else { "4 KiB" },
            hmac / blake,
            gmac / blake,
            gcm_seal / blake,
        );
    }
}

/// Resident: arena 1 GiB, data span 512 MiB; the cases whose name contains `only`.
fn resident(tmp: &tempfile::TempDir, only: &str) {
    let resident_dir = tmp.path().join("resident");
    std::fs::create_dir_all(&resident_dir).unwrap();
    let b = start(&resident_dir, 1 << 30, 2 << 30);
    let span = 512 << 20;
    run(&b, Dir::Write, MIB, 32, span, true); // populate so reads hit data
    println!(
        "\n| inline, arena-resident | MiB/s | ops/s | baseline | median ratio |\n|---|---:|---:|---|---:|"
    );
    for (name, dir, size, qd, seq) in [
        ("1 MiB seq write QD1", Dir::Write, MIB, 1, true),
        ("1 MiB seq write QD32", Dir::Write, MIB, 32, true),
        ("1 MiB seq read QD1", Dir::Read, MIB, 1, true),
        ("1 MiB seq read QD32", Dir::Read, MIB, 32, true),
        ("4 KiB rand write QD1", Dir::Write, 4096, 1, false),
        ("4 KiB rand write QD32", Dir::Write, 4096, 32, false),
        ("4 KiB rand read QD1", Dir::Read, 4096, 1, false),
        ("4 KiB rand read QD32", Dir::Read, 4096, 32, false),
    ]
    .into_iter()
    .filter(|case| case.0.contains(only))
    {
        let (mut rates, mut ratios, mut bases) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds() {
            // 1 MiB requests against a raw stream of the same chunks; 4 KiB
            // ones against a raw request/response of the same size at QD1.
            let (base, base_ops) = if size == MIB {
                let r = raw_tcp_stream(MIB);
                (r.mib_s(), r.iops())
            } else {
                let r = raw_tcp_pingpong(4096, 24);
                (r.mib_s(), r.iops())
            };
            let r = run(&b, dir, size, qd, span, seq);
            ratios.push(r.iops() / base_ops);
            bases.push(base);
            rates.push((r.mib_s(), r.iops()));
        }
        rates.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mib, iops) = rates[rates.len() / 2];
        let base = if size == MIB {
            "TCP stream"
        } else {
            "TCP ping-pong QD1"
        };
        println!(
            "| {name} | {mib:.1} | {iops:.0} | {base} {:.1} MiB/s | {:.2}x |",
            median(bases),
            median(ratios)
        );
    }
}

/// The client's path alone at QD 1: 4 KiB WRITEs and READs through an
/// `ArenaClient` to the protocol-only [`EchoPeer`] (handshake, tags, no
/// store), against a raw socket ping-pong of the same frame sizes each
/// way, and through the real arenad for comparison, in the same round;
/// each with a reader thread and driven on the caller's ring.
fn client_path(tmp: &tempfile::TempDir) {
    let dir = tmp.path().join("rtt");
    std::fs::create_dir_all(&dir).unwrap();
    let b = start(&dir, 64 << 20, 128 << 20);
    let span = 16 << 20;
    run(&b, Dir::Write, MIB, 8, span, true); // reads find data
    let echo = EchoPeer::start("bench", secret(SECRET), MIB as u32);
    let mut cfg = ClientConfig::new(echo.addr.to_string(), "bench", secret(SECRET));
    cfg.request_timeout = Duration::from_secs(30);
    let c = ArenaClient::connect(cfg.clone()).unwrap();
    // The same clients driven on this thread's ring, as ublkd's queues run
    // them.
    cfg.driven = true;
    let dc = ArenaClient::connect(cfg).unwrap();
    let mut acfg = b.peer.config("bench", SECRET);
    acfg.request_timeout = Duration::from_secs(30);
    acfg.driven = true;
    let da = ArenaClient::connect(acfg).unwrap();
    let lp = UringLoop::new().unwrap();
    let size = 4096usize;
    // Frame bytes each way, tags included.
    let mut frame = Vec::new();
    let data = vec![0u8; size];
    let req = |r: &Request<'_>, frame: &mut Vec<u8>| {
        frame.clear();
        proto::encode_request(frame, 1, r);
        frame.len() + TAG_LEN
    };
    let write_out = req(
        &Request::Write {
            key: 0,
            offset: 0,
            data: &data,
        },
        &mut frame,
    );
    let read_out = req(
        &Request::Read {
            key: 0,
            offset: 0,
            len: size as u32,
        },
        &mut frame,
    );
    let ok_back = HEADER_LEN + TAG_LEN;
    println!(
        "\n| client path, QD 1 | raw ping-pong | echo, reader thread | echo, driven | arenad, reader thread | arenad, driven | echo thread / raw | echo driven / raw | arenad driven / thread |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (name, d, out, back) in [
        ("4 KiB write", Dir::Write, write_out, ok_back),
        ("4 KiB read", Dir::Read, read_out, ok_back + size),
    ] {
        // ops/s of raw, echo (thread, driven), arenad (thread, driven),
        // and the three ratios.
        let mut cols: Vec<Vec<f64>> = vec![Vec::new(); 8];
        for _ in 0..rounds() {
            let base = raw_tcp_pingpong(out, back).iops();
            let et = run_client(&c, None, MIB, d, size, 1, span, false).iops();
            let ed = run_client(&dc, Some(&lp), MIB, d, size, 1, span, false).iops();
            let at = run(&b, d, size, 1, span, false).iops();
            let ad = run_client(&da, Some(&lp), MIB, d, size, 1, span, false).iops();
            for (i, v) in [base, et, ed, at, ad, et / base, ed / base, ad / at]
                .into_iter()
                .enumerate()
            {
                cols[i].push(v);
            }
        }
        let m: Vec<f64> = cols.into_iter().map(median).collect();
        println!(
            "| {name} ({out} B out, {back} B back) | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2}x | {:.2}x | {:.2}x |",
            m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]
        );
    }
}

/// Swap-bound: arena 64 MiB under a 1 GiB data span, against `dd` O_DIRECT
/// on the same directory.
fn swap_bound(tmp: &tempfile::TempDir) {
    let swap_dir = tmp.path().join("swap");
    std::fs::create_dir_all(&swap_dir).unwrap();
    let b = start(&swap_dir, 64 << 20, 2 << 30);
    let span = 1 << 30;
    let (mut w, mut r, mut dw, mut dr, mut rw, mut rr) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for _ in 0..rounds() {
        let dd_w = dd(&swap_dir, true, 512);
        let store_w = run(&b, Dir::Write, MIB, 32, span, true).mib_s();
        let dd_r = dd(&swap_dir, false, 512);
        let store_r = run(&b, Dir::Read, MIB, 32, span, true).mib_s();
        rw.push(store_w / dd_w);
        rr.push(store_r / dd_r);
        w.push(store_w);
        r.push(store_r);
        dw.push(dd_w);
        dr.push(dd_r);
    }
    std::fs::remove_file(swap_dir.join("dd.bin")).ok();
    println!(
        "\n| swap-bound (arena 64 MiB, data 1 GiB) | MiB/s | dd O_DIRECT MiB/s | median ratio |\n|---|---:|---:|---:|"
    );
    println!(
        "| 1 MiB seq write QD32, evicting dirty slots (write-back) | {:.1} | {:.0} | {:.2}x |",
        median(w),
        median(dw),
        median(rw)
    );
    println!(
        "| 1 MiB seq read QD32, faulting in from swap | {:.1} | {:.0} | {:.2}x |",
        median(r),
        median(dr),
        median(rr)
    );
}

/// `fio` random reads of `bs` bytes at queue depth `qd` on `file` (laid out
/// on first use), O_DIRECT through io_uring; IOPS.
fn fio_randread(file: &Path, size_mib: u64, bs: usize, qd: usize) -> f64 {
    let out = Command::new("fio")
        .args([
            "--name=baseline",
            &format!("--filename={}", file.display()),
            &format!("--size={size_mib}M"),
            "--rw=randread",
            &format!("--bs={bs}"),
            &format!("--iodepth={qd}"),
            "--direct=1",
            "--ioengine=io_uring",
            "--time_based",
            &format!("--runtime={}ms", secs().as_millis()),
            "--randrepeat=0",
            "--output-format=json",
        ])
        .output()
        .expect("fio must be installed (apt-get install fio) for the cold-read baseline");
    assert!(
        out.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("fio JSON");
    v["jobs"][0]["read"]["iops"]
        .as_f64()
        .expect("fio JSON has jobs[0].read.iops")
}

/// `threads` threads, each doing one random `size`-aligned read of `span`
/// at a time with `read(thread, key, offset, buffer)`, for the case
/// duration.
fn run_threads(
    b: &Bench,
    threads: usize,
    size: usize,
    span: u64,
    read: impl Fn(usize, u64, u32, &mut [u8]) + Sync,
) -> Rate {
    let blob = b.blob as u64;
    let slots = span / size as u64;
    let read = &read;
    let start = Instant::now();
    let ops: u64 = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                sc.spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64
                        ^ (t as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    let mut out = vec![0u8; size];
                    let mut ops = 0u64;
                    while start.elapsed() < secs() {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let off = (x % slots) * size as u64;
                        read(t, off / blob, (off % blob) as u32, &mut out);
                        ops += 1;
                    }
                    ops
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    Rate {
        ops,
        bytes: ops * size as u64,
        elapsed: start.elapsed(),
    }
}

/// Reads over `clients`, one request each at a time.
fn run_connections(b: &Bench, clients: &[ArenaClient], size: usize, span: u64) -> Rate {
    run_threads(b, clients.len(), size, span, |t, key, off, out| {
        block_on(clients[t].read_found(key, off, out)).expect("cold read");
    })
}

/// Reads by `threads` threads calling the store directly (no network).
fn run_store(b: &Bench, threads: usize, size: usize, span: u64) -> Rate {
    run_threads(b, threads, size, span, |_, key, off, out| {
        b.peer.store.read(0, key, off, out).expect("cold read");
    })
}

/// Seconds per `len`-byte extent check (the store's own code, through its
/// bench hook), over buffers out of cache.
fn check_secs(len: usize) -> f64 {
    let buf: Vec<u8> = (0..64 * MIB).map(|i| (i * 31) as u8).collect();
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < Duration::from_millis(500) {
        let at = (n * len) % (buf.len() - len);
        std::hint::black_box(extent_checksums(&buf[at..at + len]));
        n += 1;
    }
    start.elapsed().as_secs_f64() / n as f64
}

/// Cold reads: 1 GiB of 1 MiB blobs written and flushed, then the store
/// reopened with a 64 MiB arena, so every blob starts in swap; 4 KiB random
/// reads over it never fault a blob in, so it stays that way.
fn cold_reads(tmp: &tempfile::TempDir) {
    let dir = tmp.path().join("cold");
    std::fs::create_dir_all(&dir).unwrap();
    let span: u64 = 1 << 30;
    {
        let s = open_store(&dir, 64 << 20, 2 << 30);
        let data = vec![0x3cu8; MIB];
        for k in 0..span / MIB as u64 {
            s.write(0, k, 0, &data).unwrap();
        }
        s.flush().unwrap();
    }
    let b = start(&dir, 64 << 20, 2 << 30);
    let clients: Vec<ArenaClient> = (0..32).map(|_| b.connect()).collect();
    let fio_file = dir.join("fio.bin");
    let (mut many, mut one, mut qd1, mut whole) = (vec![], vec![], vec![], vec![]);
    let (mut fio32, mut r_many, mut r_one) = (vec![], vec![], vec![]);
    let (mut direct, mut r_direct) = (vec![], vec![]);
    for _ in 0..rounds() {
        let f = fio_randread(&fio_file, 1024, 4096, 32);
        let m = run_connections(&b, &clients, 4096, span).iops();
        let o = run(&b, Dir::Read, 4096, 32, span, false).iops();
        let d = run_store(&b, 32, 4096, span).iops();
        direct.push(d);
        r_direct.push(d / f);
        fio32.push(f);
        many.push(m);
        one.push(o);
        r_many.push(m / f);
        r_one.push(o / f);
        qd1.push(run_connections(&b, &clients[..1], 4096, span).iops());
    }
    // Whole-blob reads fault blobs in: after the 4 KiB cases, which want
    // the arena empty.
    for _ in 0..rounds() {
        whole.push(run_connections(&b, &clients[..1], MIB, span).iops());
    }
    std::fs::remove_file(&fio_file).ok();
    let (check4k, check1m) = (check_secs(4096), check_secs(MIB));
    let (lat4k, lat1m) = (1.0 / median(qd1.clone()), 1.0 / median(whole.clone()));
    println!(
        "\n| cold 4 KiB random reads (arena 64 MiB, data 1 GiB, all in swap) | IOPS | fio QD32 IOPS | median ratio |\n|---|---:|---:|---:|"
    );
    println!(
        "| 32 connections x QD1 | {:.0} | {:.0} | {:.2}x |",
        median(many),
        median(fio32.clone()),
        median(r_many)
    );
    println!(
        "| store API, 32 threads (no network) | {:.0} | {:.0} | {:.2}x |",
        median(direct),
        median(fio32.clone()),
        median(r_direct)
    );
    println!(
        "| 1 connection x QD32 | {:.0} | {:.0} | {:.2}x |",
        median(one),
        median(fio32),
        median(r_one)
    );
    println!(
        "\n| extent check (CRC32C per 4 KiB block) | check us | cold read QD1 us | check / read |\n|---|---:|---:|---:|"
    );
    println!(
        "| 4 KiB range read | {:.2} | {:.1} | {:.3} |",
        check4k * 1e6,
        lat4k * 1e6,
        check4k / lat4k
    );
    println!(
        "| 1 MiB whole-blob read (fault-in) | {:.1} | {:.1} | {:.3} |",
        check1m * 1e6,
        lat1m * 1e6,
        check1m / lat1m
    );
}
