//! A replicated device's volume end to end, no kernel needed: three real
//! `arenad` processes on loopback, a real etcd, and ublkd's own device
//! wiring (`Connector` sessions, `EtcdVolume`, `Replicated` with its
//! rebuild thread), driven through the queue's `QueueIo` — the `BlobIo`
//! the block target runs on. A write/verify workload loses a peer to
//! `kill -9` mid-workload with zero errors; the peer restarted is rebuilt
//! and healthy again at a higher epoch; a second peer killed mid-workload
//! still costs zero errors, and every block verifies throughout.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::arenad::{kill9, terminate, Arenad, Proc};
use common::etcd::{eventually, EtcdServer};
use common::{secret, secret_file, SECRET_A};
use futures::executor::block_on;
use target_rdma::blob::BlobIo;
use target_rdma::replica::Coordinator;
use target_rdma::testing::pattern;
use ublkd::config::{TransportChoice, UblkdConfig};
use ublkd::coordination::{Coordination, ReplicationConfig};
use ublkd::device::{Connector, DeviceSpec, ReplicaSpec, Replicated, Resolve};
use ublkd::observability::Observability;
use ublkd::queue_io::QueueIo;

const BLOB: usize = 64 << 10;
const KEYS: u64 = 64;

fn spec(names: &[String], secret_file: std::path::PathBuf) -> DeviceSpec {
    DeviceSpec {
        id: 0,
        peer: names[0].clone(),
        volume: "a".into(),
        secret_file,
        size: KEYS * BLOB as u64,
        queues: 1,
        depth: 4,
        io_buf: BLOB as u64,
        blob_size: BLOB as u64,
        transport: TransportChoice::Tcp,
        logical_block_size: 512,
        physical_block_size: 4096,
        max_io_size: BLOB as u64,
        discard: true,
        max_discard_size: 1 << 30,
        write_zeroes: true,
        max_write_zeroes_size: 1 << 30,
        write_cache: true,
        fua: true,
        read_only: false,
        cpus: Vec::new(),
        replicas: Some(ReplicaSpec {
            peers: names.to_vec(),
        }),
    }
}

/// Writes generation `gen` of every key through the device's queue (and
/// FLUSHes every 16); `during` runs halfway. Every request must succeed.
fn write_all(io: &QueueIo, gen: u64, during: impl FnOnce()) {
    let mut during = Some(during);
    for key in 0..KEYS {
        if key == KEYS / 2 {
            (during.take().unwrap())();
        }
        block_on(io.write(key, 0, &pattern(key, gen, BLOB)))
            .unwrap_or_else(|e| panic!("write {key} gen {gen} failed: {e}"));
        if key % 16 == 15 {
            block_on(io.flush()).unwrap_or_else(|e| panic!("flush after {key}: {e}"));
        }
    }
}

fn verify_all(io: &QueueIo, gen: u64) {
    let mut out = vec![0u8; BLOB];
    for key in 0..KEYS {
        block_on(io.read(key, 0, &mut out)).unwrap_or_else(|e| panic!("read {key}: {e}"));
        assert!(
            out == pattern(key, gen, BLOB),
            "key {key} gen {gen} differs"
        );
    }
}

/// Reads every key straight from `a` (a session at `epoch`): what a
/// rebuilt member holds.
fn verify_peer(a: &Arenad, epoch: u64, gen: u64) {
    let mut cfg = a.config("a");
    cfg.epoch = epoch;
    let c = a.connect_with(cfg);
    let mut out = vec![0u8; BLOB];
    for key in 0..KEYS {
        block_on(c.read(key, 0, &mut out))
            .unwrap_or_else(|e| panic!("{}: read {key}: {e}", a.addr()));
        assert!(
            out == pattern(key, gen, BLOB),
            "{}: key {key} gen {gen} differs",
            a.addr()
        );
    }
}

#[test]
fn a_replicated_device_survives_kill_9_of_two_peers_and_rebuilds_the_one_that_returns() {
    let etcd = EtcdServer::start();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<Arenad> = dirs[..3]
        .iter()
        .map(|d| Arenad::new(d.path(), "8M", "64K", "32M", None))
        .collect();
    let mut procs: Vec<Option<Proc>> = peers.iter().map(|a| Some(a.start())).collect();
    let names: Vec<String> = peers.iter().map(|a| a.addr().to_string()).collect();

    let state = dirs[3].path();
    let mut cfg = UblkdConfig::defaults();
    cfg.state_dir = state.to_owned();
    cfg.connect_timeout_ms = 500;
    cfg.request_timeout_ms = 2000;
    let obs = Observability::new(
        ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
        &cfg.metrics,
        &cfg.tracing,
    );
    let rcfg = ReplicationConfig {
        rebuild_check_ms: 200,
        change_deadline_ms: 10_000,
        coord_timeout_ms: 3000,
        ..ReplicationConfig::default()
    };
    let spec = spec(&names, secret_file(state, "a.key", SECRET_A));
    let coordination = Coordination::start(&etcd.config(), state).unwrap();
    let coord = Arc::new(coordination.open_volume("a", &names, spec.size).unwrap());
    let connector = Connector::new(&cfg, Arc::clone(obs.tcp_links()));
    let resolve: Resolve = Arc::new(|n: &str| Ok(n.to_owned()));
    let (ios, rep) = Replicated::open(
        &connector,
        &spec,
        &secret(SECRET_A),
        Arc::clone(&coord) as Arc<dyn Coordinator>,
        &resolve,
        &rcfg,
    )
    .unwrap();
    let rebuilder = rep
        .spawn_rebuilder(connector, spec.clone(), resolve, rcfg)
        .unwrap();
    let io = &ios[0];
    assert_eq!(rep.info().epoch, 2, "opening takes a new epoch");

    write_all(io, 1, || {});
    verify_all(io, 1);

    // kill -9 of a peer mid-workload: zero errors, the loss recorded.
    write_all(io, 2, || kill9(procs[1].take().unwrap()));
    verify_all(io, 2);
    let info = rep.info();
    assert_eq!((info.epoch, info.healthy), (3, 2), "{info:?}");
    assert_eq!(info.members[1].state, "failed", "{info:?}");

    // Back (its swap kept what it flushed; what it lost is rebuilt): the
    // rebuild thread brings it back healthy at a higher epoch.
    procs[1] = Some(peers[1].start());
    eventually(Duration::from_secs(60), "the member is rebuilt", || {
        let i = rep.info();
        i.healthy == 3 && i.rebuild.is_none()
    });
    let info = rep.info();
    assert_eq!(info.epoch, 5, "syncing at 4, healthy at 5: {info:?}");
    assert_eq!(block_on(coord.load()).unwrap(), rep.set().membership());
    assert_eq!(
        rep.rebuild_stats()
            .bytes_remaining
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(
        rep.rebuild_bytes(),
        (KEYS * BLOB as u64, 0),
        "every blob of the range copied once"
    );
    verify_peer(&peers[1], info.epoch, 2);
    verify_all(io, 2);

    // Another peer killed mid-workload: still zero errors.
    write_all(io, 3, || kill9(procs[2].take().unwrap()));
    verify_all(io, 3);
    let info = rep.info();
    assert_eq!(
        (info.healthy, info.members[2].state.as_str()),
        (2, "failed"),
        "{info:?}"
    );
    verify_peer(&peers[1], info.epoch, 3);

    rep.stop();
    rebuilder.join().unwrap();
    drop(ios);
    drop(rep);
    drop(coord);

    // ublkd restarts (same state dir: it adopts its writer lease) while
    // another member is down: the member is recorded failed before the
    // volume serves, the writer takes a new epoch and every block is there.
    let epoch = info.epoch;
    drop(coordination);
    kill9(procs[1].take().unwrap());
    let coordination = Coordination::start(&etcd.config(), state).unwrap();
    let coord = Arc::new(coordination.open_volume("a", &names, spec.size).unwrap());
    let connector = Connector::new(&cfg, Arc::clone(obs.tcp_links()));
    let resolve: Resolve = Arc::new(|n: &str| Ok(n.to_owned()));
    let (ios, rep) = Replicated::open(
        &connector,
        &spec,
        &secret(SECRET_A),
        Arc::clone(&coord) as Arc<dyn Coordinator>,
        &resolve,
        &ReplicationConfig::default(),
    )
    .unwrap();
    let info = rep.info();
    assert_eq!(
        info.epoch,
        epoch + 2,
        "member out, then a new writer: {info:?}"
    );
    assert_eq!(
        info.members
            .iter()
            .map(|m| m.state.as_str())
            .collect::<Vec<_>>(),
        ["healthy", "failed", "failed"],
        "{info:?}"
    );
    verify_all(&ios[0], 3);
    write_all(&ios[0], 4, || {});
    verify_all(&ios[0], 4);
    drop((ios, rep, coord, coordination));
    for p in procs.into_iter().flatten() {
        terminate(p);
    }
}
