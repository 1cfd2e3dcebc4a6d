//! Fencing by epoch against real `arenad` processes: when a newer writer
//! opens a replicated volume (a new membership epoch, presented to every
//! member with EPOCH), the peers refuse the older writer's requests with
//! `STALE_EPOCH`, and the older writer treats that as being fenced, not as
//! a member failure: it acknowledges nothing more, records no removal,
//! and its write never lands. The older writer's lease is still valid
//! here, so the peers' refusal is the only thing that stops it.

mod common;

use std::sync::Arc;

use common::arenad::{terminate, Arenad};
use common::*;
use futures::executor::block_on;
use target_rdma::blob::{BlobIo, ErrorKind, ReplicaFailure};
use target_rdma::client::{ArenaClient, FlushDomain};
use target_rdma::replica::{
    clock, Coordinator, MemberSessions, MemberState, Membership, MemoryCoordinator, ReplicaConfig,
    ReplicaSet,
};

/// Volume "a"'s sessions to `a` as one member (one queue).
fn member(a: &Arenad) -> MemberSessions<ArenaClient> {
    let domain = Arc::new(FlushDomain::default());
    MemberSessions {
        queues: vec![a.connect_in("a", Arc::clone(&domain))],
        background: a.connect_in("a", domain),
        epoch: 0,
    }
}

fn open(peers: &[Arenad], coord: Arc<MemoryCoordinator>) -> Arc<ReplicaSet<ArenaClient>> {
    let members = peers
        .iter()
        .map(|a| (a.addr().to_string(), member(a)))
        .collect();
    block_on(ReplicaSet::open(
        "a",
        coord as Arc<dyn Coordinator>,
        clock::system(),
        ReplicaConfig::default(),
        members,
    ))
    .expect("open the replicated volume")
}

#[test]
fn a_writer_superseded_by_a_newer_epoch_is_refused_by_the_peers_and_acknowledges_nothing() {
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<Arenad> = dirs
        .iter()
        .map(|d| Arenad::new(d.path(), "4M", "64K", "16M", None))
        .collect();
    let procs: Vec<_> = peers.iter().map(Arenad::start).collect();
    let names: Vec<String> = peers.iter().map(|a| a.addr().to_string()).collect();
    let blob = 64 << 10;
    let coord = MemoryCoordinator::new(clock::system(), Membership::new_volume(&names).unwrap());

    let old = open(&peers, Arc::clone(&coord));
    let old_io = old.queue(0).unwrap();
    block_on(old_io.write(1, 0, &pattern(1, 1, blob))).expect("the first writer writes");
    assert_eq!(coord.record().epoch, 2);

    // A second writer takes the volume (epoch 3) and writes.
    let new = open(&peers, coord.writer());
    let new_io = new.queue(0).unwrap();
    assert_eq!(coord.record().epoch, 3);
    block_on(new_io.write(1, 0, &pattern(1, 2, blob))).expect("the new writer writes");

    // The old writer's write reaches the peers, which refuse its epoch.
    let e = block_on(old_io.write(1, 0, &pattern(1, 3, blob))).expect_err("fenced");
    assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Fenced), "{e}");
    assert!(e.to_string().contains("stale_epoch"), "{e}");
    // Fenced for good, and counted once; no member was blamed.
    let e = block_on(old_io.flush()).expect_err("still fenced");
    assert_eq!(e.kind(), ErrorKind::Replica(ReplicaFailure::Fenced));
    let stats = old.stats();
    assert_eq!(
        stats
            .stale_epoch_fences
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(stats.removals.load(std::sync::atomic::Ordering::Relaxed), 0);
    let m = coord.record();
    assert_eq!(m.epoch, 3, "the fenced writer changed nothing: {m}");
    assert!(
        m.members.iter().all(|r| r.state == MemberState::Healthy),
        "{m}"
    );

    // Every member holds the new writer's data, not the refused write.
    let mut out = vec![0u8; blob];
    for a in &peers {
        let mut cfg = a.config("a");
        cfg.epoch = 3;
        let c = a.connect_with(cfg);
        block_on(c.read(1, 0, &mut out)).unwrap();
        assert!(
            out == pattern(1, 2, blob),
            "{}: the new writer's data",
            a.addr()
        );
    }
    drop((old_io, new_io, old, new));
    for p in procs {
        terminate(p);
    }
}
