//! A volume's writer role handed from one ublkd to another through etcd,
//! no kernel needed: a real etcd on loopback, two real arena peers (the
//! server and store in process, over TCP), two "hosts" (each its own
//! `Coordination`, state dir and host id) and the replication core on
//! each. Host A writes under a constant load; host B, a standby, reads
//! what A writes and takes the role: every write A acknowledged is there,
//! A acknowledges nothing after, every peer refuses A's epoch, and the
//! role goes back the same way. A
//! writer that dies without handing over loses the role when its lease
//! expires.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use futures::executor::block_on;
use target_rdma::blob::{BlobIo, ErrorKind, ReplicaFailure};
use target_rdma::client::ArenaClient;
use target_rdma::proto::Status;
use target_rdma::replica::{
    clock, Coordinator, MemberSessions, ReplicaConfig, ReplicaSet, ReplicatedIo, Standing,
};
use target_rdma::testing::{pattern, Peer, PeerOpts, SECRET_A};
use ublkd::coordination::{Coordination, EtcdConfig, EtcdVolume};

const KEYS: u64 = 32;

type Set = Arc<ReplicaSet<ArenaClient>>;

fn sessions(peers: &[Peer]) -> Vec<(String, MemberSessions<ArenaClient>)> {
    peers
        .iter()
        .map(|p| {
            let s = MemberSessions {
                queues: vec![p.client("a", SECRET_A)],
                background: p.client("a", SECRET_A),
                epoch: 0,
            };
            (p.addr.to_string(), s)
        })
        .collect()
}

fn config() -> ReplicaConfig {
    ReplicaConfig {
        change_deadline: Duration::from_secs(10),
        coord_timeout: Duration::from_secs(3),
        ..ReplicaConfig::default()
    }
}

fn host(etcd: &EtcdServer, name: &str, dir: &std::path::Path, ttl: u64) -> Coordination {
    let cfg = EtcdConfig {
        host_id: Some(name.into()),
        lease_ttl_secs: ttl,
        lease_margin_ms: 500,
        handover_poll_ms: 20,
        ..etcd.config()
    };
    Coordination::start(&cfg, dir).unwrap()
}

/// The device's supervisor as ublkd runs it: hands the role over when a
/// standby asks, until `stop`.
fn supervise(set: &Set, stop: &Arc<AtomicBool>) -> JoinHandle<()> {
    let (set, stop) = (Arc::clone(set), Arc::clone(stop));
    std::thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            block_on(set.serve_handover()).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
    })
}

/// Writes generation after generation of every key, one write at a time,
/// until one is refused; returns the generation each key last had
/// acknowledged and the write that was refused (key, generation): it may
/// or may not have landed.
fn load(set: &Set, blob: usize) -> JoinHandle<(Vec<u64>, (u64, u64))> {
    let set = Arc::clone(set);
    std::thread::spawn(move || {
        let io = set.queue(0).unwrap();
        let mut acked = vec![0u64; KEYS as usize];
        for gen in 1.. {
            for key in 0..KEYS {
                if let Err(e) = block_on(io.write(key, 0, &pattern(key, gen, blob))) {
                    assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Standby), "{e}");
                    return (acked, (key, gen));
                }
                acked[key as usize] = gen;
            }
        }
        unreachable!()
    })
}

fn read(io: &ReplicatedIo<ArenaClient>, key: u64, blob: usize) -> Vec<u8> {
    let mut out = vec![0u8; blob];
    block_on(io.read(key, 0, &mut out)).unwrap_or_else(|e| panic!("read {key}: {e}"));
    out
}

/// Every key holds what was acknowledged last, but the refused write's
/// key, which may hold the refused write.
fn verify(io: &ReplicatedIo<ArenaClient>, acked: &[u64], refused: (u64, u64), blob: usize) {
    for key in 0..KEYS {
        let now = read(io, key, blob);
        let ok = now == pattern(key, acked[key as usize], blob)
            || (key == refused.0 && now == pattern(key, refused.1, blob));
        assert!(
            ok,
            "key {key}: not the acknowledged generation {}",
            acked[key as usize]
        );
    }
}

/// A writer presenting `epoch` gets nothing written at `peer`: the
/// hand-over's raise fenced it (STALE_EPOCH at its HELLO or at its write).
fn assert_fenced(peer: &Peer, epoch: u64, blob: usize) {
    let mut cfg = peer.config("a", SECRET_A);
    cfg.epoch = epoch;
    let status = match ArenaClient::connect(cfg) {
        Err(e) => e.status(),
        Ok(old) => match block_on(old.write(0, 0, &pattern(0, 77, blob))) {
            Err(e) => e.status(),
            Ok(()) => None,
        },
    };
    assert_eq!(
        status,
        Some(Status::StaleEpoch),
        "{}: a writer at epoch {epoch} after the hand-over",
        peer.addr
    );
}

/// Host A writing volume "vm" on two arena peers, and host B on the same
/// etcd, both with writer leases of `ttl` seconds. Fields drop in order:
/// the set and hosts before the peers, the peers before their dirs.
struct TwoHosts {
    a: Set,
    a_coord: Arc<EtcdVolume>,
    b_host: Coordination,
    a_host: Coordination,
    peers: Vec<Peer>,
    blob: usize,
    _dirs: Vec<tempfile::TempDir>,
    etcd: EtcdServer,
}

fn two_hosts(ttl: u64) -> TwoHosts {
    let etcd = EtcdServer::start();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<Peer> = (0..2)
        .map(|i| Peer::start(dirs[i].path(), PeerOpts::default()))
        .collect();
    let names: Vec<String> = peers.iter().map(|p| p.addr.to_string()).collect();
    let blob = PeerOpts::default().blob_bytes as usize;
    let a_host = host(&etcd, "host-a", dirs[2].path(), ttl);
    let b_host = host(&etcd, "host-b", dirs[3].path(), ttl);
    let a_coord = Arc::new(
        a_host
            .open_volume("vm", &names, KEYS * blob as u64)
            .unwrap(),
    );
    let a = block_on(ReplicaSet::open(
        "vm",
        Arc::clone(&a_coord) as Arc<dyn Coordinator>,
        clock::system(),
        config(),
        sessions(&peers),
    ))
    .unwrap();
    TwoHosts {
        a,
        a_coord,
        b_host,
        a_host,
        peers,
        blob,
        _dirs: dirs,
        etcd,
    }
}

#[test]
fn the_writer_role_is_handed_over_and_back_under_load_with_no_acknowledged_write_lost() {
    // Every part bound (a field left out would drop here: etcd, a host's
    // lease, the peers' dirs), in the order they were made.
    let TwoHosts {
        etcd,
        _dirs,
        peers,
        blob,
        a_host: _a_host,
        b_host,
        a_coord,
        a,
    } = two_hosts(10);
    let b_coord = Arc::new(b_host.open_standby("vm").unwrap());
    let b = block_on(ReplicaSet::standby(
        "vm",
        Arc::clone(&b_coord) as Arc<dyn Coordinator>,
        clock::system(),
        config(),
        sessions(&peers),
        false,
    ))
    .unwrap();
    assert_eq!(b.standing(), Standing::Standby);
    let epoch = block_on(a_coord.load()).unwrap().epoch;

    // B reads what A writes, and writes nothing.
    let (aio, bio) = (a.queue(0).unwrap(), b.queue(0).unwrap());
    block_on(aio.write(0, 0, &pattern(0, 0, blob))).unwrap();
    assert!(read(&bio, 0, blob) == pattern(0, 0, blob));
    let e = block_on(bio.write(0, 0, &pattern(0, 99, blob))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Standby), "{e}");
    assert_eq!(block_on(a_coord.load()).unwrap().epoch, epoch);

    // B takes the role while A writes. A's supervisor runs throughout, as
    // in ublkd: it must not give back a role A takes later.
    let a_stop = Arc::new(AtomicBool::new(false));
    let a_sup = supervise(&a, &a_stop);
    let a_load = load(&a, blob);
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    block_on(b.activate()).unwrap();
    let took = started.elapsed();
    let (acked, refused) = a_load.join().unwrap();
    assert!(
        acked.iter().all(|g| *g >= 1),
        "A wrote every key before: {acked:?}"
    );
    assert_eq!(b.standing(), Standing::Confirmed);
    assert_eq!(a.standing(), Standing::Standby);
    verify(&bio, &acked, refused, blob);
    assert_eq!(block_on(b_coord.load()).unwrap().epoch, epoch + 1);
    let (_, holder) = etcd.etcdctl(&["get", "/ublk/volumes/vm/writer", "--print-value-only"]);
    assert!(holder.contains("host-b"), "{holder}");
    let (_, asks) = etcd.etcdctl(&["get", "--prefix", "/ublk/handover/", "--keys-only"]);
    assert!(asks.trim().is_empty(), "the request is gone: {asks}");
    eprintln!("hand-over A -> B under load took {took:?}");
    // A's epoch is refused by every peer, whatever A's set would send.
    for p in &peers {
        assert_fenced(p, epoch, blob);
    }

    // B writes; A, a standby now, reads it and writes nothing.
    for key in 0..KEYS {
        block_on(bio.write(key, 0, &pattern(key, 1000, blob))).unwrap();
    }
    for key in 0..KEYS {
        assert!(
            read(&aio, key, blob) == pattern(key, 1000, blob),
            "key {key}"
        );
    }
    let e = block_on(aio.write(1, 0, &pattern(1, 5, blob))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Standby), "{e}");

    // And back: B hands over to A under B's load.
    let b_stop = Arc::new(AtomicBool::new(false));
    let b_sup = supervise(&b, &b_stop);
    let b_load = load(&b, blob);
    std::thread::sleep(Duration::from_millis(300));
    block_on(a.activate()).unwrap();
    let (acked, refused) = b_load.join().unwrap();
    // Many hand-over polls later, A still holds the role: what its polls
    // found while it was the writer the first time asks for nothing now.
    std::thread::sleep(Duration::from_millis(500));
    for (sup, stop) in [(a_sup, a_stop), (b_sup, b_stop)] {
        stop.store(true, Ordering::Release);
        sup.join().unwrap();
    }
    assert_eq!(a.standing(), Standing::Confirmed);
    assert_eq!(b.standing(), Standing::Standby);
    verify(&aio, &acked, refused, blob);
    assert_eq!(block_on(a_coord.load()).unwrap().epoch, epoch + 2);
    for p in &peers {
        assert_fenced(p, epoch + 1, blob);
    }
}

/// A writer that dies without handing over (its ublkd killed): the
/// standby gets the role once the dead writer's lease expires in etcd,
/// and every write the writer acknowledged is there.
#[test]
fn a_dead_writer_loses_the_role_when_its_lease_expires() {
    let TwoHosts {
        etcd: _etcd,
        _dirs,
        peers,
        blob,
        a_host,
        b_host,
        a_coord: _a_coord,
        a,
    } = two_hosts(2);
    let aio = a.queue(0).unwrap();
    for key in 0..KEYS {
        block_on(aio.write(key, 0, &pattern(key, 7, blob))).unwrap();
    }
    let b = block_on(ReplicaSet::standby(
        "vm",
        Arc::new(b_host.open_standby("vm").unwrap()) as Arc<dyn Coordinator>,
        clock::system(),
        config(),
        sessions(&peers),
        true,
    ))
    .unwrap();
    // A's ublkd dies: its lease is no longer kept alive.
    drop(a_host);
    let bio = b.queue(0).unwrap();
    // The first write takes the role (activate on write).
    block_on(bio.write(0, 0, &pattern(0, 8, blob))).unwrap();
    assert_eq!(b.standing(), Standing::Confirmed);
    assert!(read(&bio, 0, blob) == pattern(0, 8, blob));
    for key in 1..KEYS {
        assert!(read(&bio, key, blob) == pattern(key, 7, blob), "key {key}");
    }
    let e = block_on(aio.write(1, 0, &pattern(1, 9, blob))).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Replica(ReplicaFailure::Fenced | ReplicaFailure::Unrecorded)
        ),
        "the dead writer's set acknowledges nothing: {e}"
    );
    assert!(read(&bio, 1, blob) == pattern(1, 7, blob));
}
