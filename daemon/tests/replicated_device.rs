//! A replicated device's volume end to end, no kernel needed: three real
//! `arenad` processes on loopback, a real etcd, and ublkd's own device
//! wiring (`Connector` sessions, `EtcdVolume`, `Replicated` with its
//! rebuild thread), driven through the queue's `VolumeIo` — the `BlobIo`
//! the block target runs on. A write/verify workload loses a peer to
//! `kill -9` mid-workload with zero errors; the peer restarted is rebuilt
//! and healthy again at a higher epoch; a second peer killed mid-workload
//! still costs zero errors, and every block verifies throughout. A peer
//! that stays dead is replaced by a spare from etcd's placement pool; a
//! spare that accepts sessions but fails every copy is backed off.

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
use ublkd::config::UblkdConfig;
use ublkd::coordination::{Coordination, EpochReason, PeerRecord, ReplicationConfig};
use ublkd::device::{Connector, DeviceSpec, FindSpare, Replicated, Resolve, SpecStore};
use ublkd::observability::Observability;
use ublkd::queue_io::QueueIo;

const BLOB: usize = 64 << 10;
const KEYS: u64 = 64;

/// The device both tests serve: `KEYS` blobs on `names`, replicated.
fn spec(names: &[String], secret_file: std::path::PathBuf) -> DeviceSpec {
    assert!(names.len() > 1, "a replicated device");
    common::device_spec(
        names,
        KEYS * BLOB as u64,
        BLOB as u64,
        BLOB as u64,
        secret_file,
    )
}

/// Where the rebuild thread records a device's role (a throwaway dir).
fn specs() -> SpecStore {
    let dir = std::env::temp_dir().join(format!("ublkd-specs-{}", std::process::id()));
    SpecStore::open(&dir).unwrap()
}

/// Writes generation `gen` of every key through the device's queue (and
/// FLUSHes every 16); `during` runs halfway. Every request must succeed.
fn write_all(io: &QueueIo, gen: u64, during: impl FnOnce()) {
    let mut during = Some(during);
    for key in 0..KEYS {
        if key == KEYS / 2 {
            (during.take().unwrap())();
        }
        block_on(io.volume().write(key, 0, &pattern(key, gen, BLOB)))
            .unwrap_or_else(|e| panic!("write {key} gen {gen} failed: {e}"));
        if key % 16 == 15 {
            block_on(io.volume().flush()).unwrap_or_else(|e| panic!("flush after {key}: {e}"));
        }
    }
}

fn verify_all(io: &QueueIo, gen: u64) {
    let mut out = vec![0u8; BLOB];
    for key in 0..KEYS {
        block_on(io.volume().read(key, 0, &mut out)).unwrap_or_else(|e| panic!("read {key}: {e}"));
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
        .spawn_rebuilder(
            connector,
            spec.clone(),
            specs(),
            resolve,
            None,
            rcfg,
            Arc::new(|| 0),
        )
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

/// A ublkd-side volume on pool peers `a` and `b` of `pool` (etcd's
/// placement pool, which also holds the spares), with the rebuild thread
/// running; peers are resolved and spares found through the pool, as
/// ublkd's manager does.
struct PoolVolume {
    ios: Vec<QueueIo>,
    rep: Arc<Replicated>,
    rebuilder: Option<std::thread::JoinHandle<()>>,
    coordination: Arc<Coordination>,
}

impl PoolVolume {
    fn open(
        etcd: &EtcdServer,
        state: &std::path::Path,
        pool: &[(&str, &Arenad)],
        rcfg: ReplicationConfig,
    ) -> Self {
        let coordination = Arc::new(Coordination::start(&etcd.config(), state).unwrap());
        for (id, a) in pool {
            coordination
                .add_peer(&PeerRecord {
                    id: (*id).into(),
                    addr: a.addr().to_string(),
                    capacity: 1 << 30,
                    failure_domain: None,
                })
                .unwrap();
        }
        let names = vec!["a".to_string(), "b".to_string()];
        let spec = spec(&names, secret_file(state, "a.key", SECRET_A));
        let coord = Arc::new(coordination.open_volume("a", &names, spec.size).unwrap());
        let mut cfg = UblkdConfig::defaults();
        cfg.state_dir = state.to_owned();
        cfg.connect_timeout_ms = 500;
        cfg.request_timeout_ms = 2000;
        let obs = Observability::new(
            ublk_metrics::Telemetry::isolated(ublk_metrics::Daemon::Ublkd, "test"),
            &cfg.metrics,
            &cfg.tracing,
        );
        let connector = Connector::new(&cfg, Arc::clone(obs.tcp_links()));
        let c = Arc::clone(&coordination);
        let resolve: Resolve = Arc::new(move |n: &str| {
            let peers = c
                .peers()
                .map_err(ublkd::device::DeviceError::Coordination)?;
            Ok(peers
                .into_iter()
                .find(|p| p.id == n)
                .expect("a pool peer")
                .addr)
        });
        let c = Arc::clone(&coordination);
        let spares: FindSpare = Arc::new(move |volume: &str, replacing: &str| {
            let spare = c
                .spare_for(volume, replacing)
                .map_err(ublkd::device::DeviceError::Coordination)?;
            Ok(spare.map(|p| p.id))
        });
        let (ios, rep) = Replicated::open(
            &connector,
            &spec,
            &secret(SECRET_A),
            coord as Arc<dyn Coordinator>,
            &resolve,
            &rcfg,
        )
        .unwrap();
        let rebuilder = rep
            .spawn_rebuilder(
                connector,
                spec,
                specs(),
                resolve,
                Some(spares),
                rcfg,
                Arc::new(|| 0),
            )
            .unwrap();
        PoolVolume {
            ios,
            rep,
            rebuilder: Some(rebuilder),
            coordination,
        }
    }

    fn states(&self) -> Vec<(String, String)> {
        self.rep
            .info()
            .members
            .into_iter()
            .map(|m| (m.peer, m.state))
            .collect()
    }
}

impl Drop for PoolVolume {
    fn drop(&mut self) {
        self.rep.stop();
        if let Some(t) = self.rebuilder.take() {
            let _ = t.join();
        }
    }
}

fn pair(p: &str, s: &str) -> (String, String) {
    (p.into(), s.into())
}

#[test]
fn a_peer_that_stays_dead_is_replaced_by_a_spare_from_the_pool() {
    let etcd = EtcdServer::start();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<Arenad> = dirs[..3]
        .iter()
        .map(|d| Arenad::new(d.path(), "8M", "64K", "32M", None))
        .collect();
    let mut procs: Vec<Option<Proc>> = peers.iter().map(|a| Some(a.start())).collect();
    let rcfg = ReplicationConfig {
        // Every read over loopback TCP takes longer: each one is hedged.
        hedge_after_us: 10,
        rebuild_check_ms: 200,
        replace_after_ms: 1500,
        change_deadline_ms: 10_000,
        coord_timeout_ms: 3000,
        ..ReplicationConfig::default()
    };
    let pool = [("a", &peers[0]), ("b", &peers[1]), ("c", &peers[2])];
    let v = PoolVolume::open(&etcd, dirs[3].path(), &pool, rcfg);
    let io = &v.ios[0];
    assert_eq!(v.states(), [pair("a", "healthy"), pair("b", "healthy")]);
    write_all(io, 1, || {});
    let hedged = |v: &PoolVolume| v.rep.replica_stats(2).hedged_reads.iter().sum::<u64>();
    assert_eq!(hedged(&v), 0);
    verify_all(io, 1);
    assert!(hedged(&v) > 0, "the hedge fired and the counter moved");
    // kill -9 of b mid-workload, and it stays dead: zero errors; after
    // the grace the spare c is rebuilt and takes b's place.
    write_all(io, 2, || kill9(procs[1].take().unwrap()));
    verify_all(io, 2);
    eventually(Duration::from_secs(90), "the spare replaces b", || {
        let i = v.rep.info();
        i.healthy == 2 && i.rebuild.is_none() && i.members.iter().any(|m| m.peer == "c")
    });
    let info = v.rep.info();
    assert_eq!(
        v.states(),
        [
            pair("a", "healthy"),
            pair("b", "removed"),
            pair("c", "healthy")
        ],
        "{info:?}"
    );
    // failed at 3, c syncing at 4, c healthy and b removed at 5.
    assert_eq!(info.epoch, 5, "{info:?}");
    let stored = block_on(v.coordination.membership("a")).unwrap().unwrap();
    assert_eq!(stored.record.membership, v.rep.set().membership());
    assert_eq!(stored.record.reason, "member_replaced");
    assert_eq!(
        v.coordination
            .epoch_changes()
            .get(EpochReason::MemberReplaced),
        1
    );
    // What `ublkctl show` prints and `--json` carries.
    let lines = info.show_lines();
    assert_eq!(lines[0], "  replicas   2 healthy of 2 active, epoch 5");
    assert_eq!(
        &lines[1..],
        [
            "  role       writer",
            "    healthy  a",
            "    removed  b",
            "    healthy  c"
        ]
    );
    let json = serde_json::to_value(&info).unwrap();
    assert_eq!(
        json["members"][2],
        serde_json::json!({"peer": "c", "state": "healthy"})
    );
    // c holds every block by itself: written before and during the kill.
    verify_peer(&peers[2], info.epoch, 2);
    write_all(io, 3, || {});
    kill9(procs[0].take().unwrap());
    verify_all(io, 3);
    let s = v.rep.replica_stats(2);
    assert_eq!(s.rebuilds, [1, 0, 0], "one rebuild, done");
    assert_eq!(s.rebuild_bytes, KEYS * BLOB as u64);
    drop(v);
    for p in procs.into_iter().flatten() {
        terminate(p);
    }
}

#[test]
fn a_spare_that_fails_every_copy_is_backed_off() {
    let etcd = EtcdServer::start();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<Arenad> = dirs[..3]
        .iter()
        .map(|d| Arenad::new(d.path(), "8M", "64K", "32M", None))
        .collect();
    // c accepts sessions, but its quota holds a quarter of the device:
    // every copy fails past it.
    let cfg = dirs[2].path().join("arenad.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replacen("quota = \"1G\"", "quota = \"1M\"", 1)).unwrap();
    let mut procs: Vec<Option<Proc>> = peers.iter().map(|a| Some(a.start())).collect();
    let rcfg = ReplicationConfig {
        rebuild_check_ms: 200,
        replace_after_ms: 100,
        rebuild_backoff_max_ms: 60_000,
        change_deadline_ms: 10_000,
        coord_timeout_ms: 3000,
        ..ReplicationConfig::default()
    };
    let pool = [("a", &peers[0]), ("b", &peers[1]), ("c", &peers[2])];
    let v = PoolVolume::open(&etcd, dirs[3].path(), &pool, rcfg.clone());
    let io = &v.ios[0];
    write_all(io, 1, || kill9(procs[1].take().unwrap()));
    let rep = &v.rep;
    let failed = |n: u32| {
        move || {
            rep.info()
                .members
                .iter()
                .any(|m| m.peer == "c" && m.rebuild_failures == n)
        }
    };
    eventually(Duration::from_secs(60), "c fails once", failed(1));
    let first = v.rep.info();
    let seen = std::time::Instant::now();
    let c = first.members.iter().find(|m| m.peer == "c").unwrap();
    assert_eq!(c.state, "failed", "{first:?}");
    assert!(c.retry_in_ms.is_some(), "backed off: {first:?}");
    let lines = first.show_lines().join("\n");
    assert!(
        lines.contains("failed   c  rebuild failed 1x, next try in"),
        "{lines}"
    );
    let pause = Duration::from_millis(c.retry_in_ms.unwrap());
    eventually(Duration::from_secs(60), "c fails twice", failed(2));
    assert!(
        seen.elapsed() >= pause,
        "not tried again before its pause ran out"
    );
    let second = v.rep.info();
    // Each try costs two epochs (syncing, failed) and nothing between.
    assert_eq!(second.epoch, first.epoch + 2, "{first:?} {second:?}");
    let s = v.rep.replica_stats(2);
    assert_eq!(s.rebuilds[ublk_metrics::RebuildOutcome::Failed.index()], 2);
    assert_eq!(s.degraded, 1);
    // The volume still serves from a alone, every block intact.
    verify_all(io, 1);
    drop(v);
    for p in procs.into_iter().flatten() {
        terminate(p);
    }
}
