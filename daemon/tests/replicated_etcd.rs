//! The replication core (target-rdma `replica`) coordinated by etcd end to
//! end, no kernel needed: a real etcd on loopback, three real arena peers
//! (the arena server and store in process, over TCP on loopback), the
//! core's `ReplicatedIo` over `ArenaClient` sessions and ublkd's
//! `EtcdVolume` as its coordinator. A write/verify workload loses a peer
//! mid-workload (its server stops: connections end, like a killed
//! arenad) with zero errors, then a second one, and every block still
//! verifies; the epochs and member states are recorded in etcd. Writer
//! fencing: a second ublkd is refused the volume, and once this ublkd's
//! lease is revoked its writes stop being acknowledged.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::etcd::{eventually, EtcdServer};
use futures::executor::block_on;
use target_rdma::blob::BlobIo;
use target_rdma::client::ArenaClient;
use target_rdma::replica::{
    clock, Coordinator, MemberSessions, MemberState, ReplicaConfig, ReplicaSet, ReplicatedIo,
    Standing,
};
use target_rdma::testing::{pattern, Peer, PeerOpts, SECRET_A};
use ublkd::coordination::{Coordination, CoordinationErrorKind, EpochReason};

const KEYS: u64 = 48;

fn sessions(p: &Peer) -> MemberSessions<ArenaClient> {
    MemberSessions {
        queues: vec![p.client("a", SECRET_A)],
        background: p.client("a", SECRET_A),
        epoch: 0,
    }
}

fn config() -> ReplicaConfig {
    ReplicaConfig {
        change_deadline: Duration::from_secs(10),
        coord_timeout: Duration::from_secs(3),
        ..ReplicaConfig::default()
    }
}

/// Writes generation `gen` of every key; every write must be acknowledged.
fn write_all(io: &ReplicatedIo<ArenaClient>, gen: u64, blob: usize, during: impl FnOnce()) {
    let mut during = Some(during);
    for key in 0..KEYS {
        if key == KEYS / 2 {
            (during.take().unwrap())();
        }
        block_on(io.write(key, 0, &pattern(key, gen, blob)))
            .unwrap_or_else(|e| panic!("write {key} gen {gen} failed: {e}"));
    }
}

fn verify_all(io: &ReplicatedIo<ArenaClient>, gen: u64, blob: usize) {
    let mut out = vec![0u8; blob];
    for key in 0..KEYS {
        block_on(io.read(key, 0, &mut out)).unwrap_or_else(|e| panic!("read {key}: {e}"));
        assert!(
            out == pattern(key, gen, blob),
            "key {key} gen {gen} differs"
        );
    }
}

#[test]
fn a_replicated_volume_survives_two_lost_peers_and_its_writer_is_fenced() {
    let etcd = EtcdServer::start();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut peers: Vec<Peer> = (0..3)
        .map(|i| Peer::start(dirs[i].path(), PeerOpts::default()))
        .collect();
    let names: Vec<String> = peers.iter().map(|p| p.addr.to_string()).collect();
    let blob = PeerOpts::default().blob_bytes as usize;
    let one = Coordination::start(&etcd.config(), dirs[3].path()).unwrap();
    let coord = Arc::new(one.open_volume("vm1", &names, KEYS * blob as u64).unwrap());
    let set = block_on(ReplicaSet::open(
        "vm1",
        Arc::clone(&coord) as Arc<dyn Coordinator>,
        clock::system(),
        config(),
        peers
            .iter()
            .map(|p| (p.addr.to_string(), sessions(p)))
            .collect(),
    ))
    .unwrap();
    let io = set.queue(0).unwrap();
    let stored = || block_on(coord.load()).unwrap();
    assert_eq!(stored().epoch, 2, "opening takes a new epoch");

    write_all(&io, 1, blob, || {});
    verify_all(&io, 1, blob);
    // A peer lost mid-workload: no write fails, the loss is recorded.
    write_all(&io, 2, blob, || peers[1].pause());
    verify_all(&io, 2, blob);
    let m = stored();
    assert_eq!(m.epoch, 3, "{m}");
    assert_eq!(m.state(&names[1]), Some(MemberState::Failed), "{m}");
    assert_eq!(set.membership(), m);
    // A second one: the last healthy member carries the volume.
    write_all(&io, 3, blob, || peers[2].pause());
    verify_all(&io, 3, blob);
    let m = stored();
    assert_eq!((m.epoch, m.active().count()), (4, 1), "{m}");
    assert_eq!(m.state(&names[0]), Some(MemberState::Healthy), "{m}");
    assert_eq!(one.epoch_changes().get(EpochReason::MemberFailed), 2);
    let (_, out) = etcd.etcdctl(&["get", "/ublk/volumes/vm1/membership", "--print-value-only"]);
    assert!(out.contains("\"reason\":\"member_failed\""), "{out}");

    // Another ublkd is refused the volume, naming this one.
    let other = tempfile::tempdir().unwrap();
    let mut cfg = etcd.config();
    cfg.host_id = Some("other-host".into());
    let two = Coordination::start(&cfg, other.path()).unwrap();
    let e = two.open_volume("vm1", &names, 0).err().unwrap();
    assert_eq!(e.kind(), CoordinationErrorKind::Held);
    assert!(e.to_string().contains("already served by ublkd on"), "{e}");

    // The lease revoked: this ublkd takes the writer key back; the writer
    // checks the record (unchanged), raises the epoch and serves on.
    let lease = one.writer().lease_id();
    let (ok, out) = etcd.etcdctl(&["lease", "revoke", &format!("{lease:x}")]);
    assert!(ok, "{out}");
    eventually(
        Duration::from_secs(30),
        "the role is confirmed again",
        || {
            let _ = block_on(set.check_role());
            set.stats()
                .roles_regained
                .load(std::sync::atomic::Ordering::Relaxed)
                == 1
        },
    );
    assert_eq!(set.standing(), Standing::Confirmed);
    write_all(&io, 4, blob, || {});
    verify_all(&io, 4, blob);
    // That the peers refuse a superseded writer's epoch (STALE_EPOCH) is
    // target-rdma/tests/replica_fencing.rs.
    for p in peers.drain(..) {
        p.stop();
    }
}
