//! The target suite (`target_rdma::testing::conformance::target`) on every
//! block target of this crate: the in-memory reference, and the arena
//! target over each transport (in-process, TCP, RDMA over the loopback
//! provider) and over replicated volumes. ublkd's own queue path runs it
//! in `daemon/tests/queue_io_conformance.rs`.

use std::sync::Arc;

use target_rdma::block::{ArenaTarget, MemTarget};
use target_rdma::client::{ArenaClient, RdmaTransport};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::replica::ReplicatedIo;
use target_rdma::store::{InProcess, Store};
use target_rdma::target_conformance;
use target_rdma::testing::conformance::target::{peer_opts, store_config, BLOB, SIZE};
use target_rdma::testing::conformance::Fixture;
use target_rdma::testing::*;

fn mem() -> Fixture<MemTarget> {
    Fixture::new(MemTarget::new(SIZE))
}

fn store(dir: &std::path::Path) -> Arc<Store> {
    let (config, volumes) = store_config(dir);
    Arc::new(Store::open(config, &volumes).unwrap())
}

fn arena_in_process() -> Fixture<ArenaTarget<InProcess>> {
    let dir = tempfile::tempdir().unwrap();
    Fixture::new(ArenaTarget::new(InProcess::new(store(dir.path()), 0), SIZE)).keep(dir)
}

fn arena_tcp() -> Fixture<ArenaTarget<ArenaClient>> {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), peer_opts());
    let target = ArenaTarget::new(peer.client("a", SECRET_A), SIZE);
    Fixture::new(target).keep(peer).keep(dir)
}

/// The arena target over a volume replicated on three in-process stores.
fn arena_replicated_in_process() -> Fixture<ArenaTarget<ReplicatedIo<LocalMember>>> {
    let dir = tempfile::tempdir().unwrap();
    let members = (0..3)
        .map(|i| {
            let store = store(&dir.path().join(i.to_string()));
            (format!("local{i}"), local_member(&store, 1))
        })
        .collect();
    let io = replicated(members).queue(0).unwrap();
    Fixture::new(ArenaTarget::new(io, SIZE)).keep(dir)
}

/// The arena target over a volume replicated on two arena peers over TCP.
fn arena_replicated_tcp() -> Fixture<ArenaTarget<ReplicatedIo<ArenaClient>>> {
    let dir = tempfile::tempdir().unwrap();
    let peers: Vec<_> = (0..2)
        .map(|i| Peer::start(&dir.path().join(i.to_string()), peer_opts()))
        .collect();
    let members = peers
        .iter()
        .map(|p| (p.addr.to_string(), p.member_sessions(1)))
        .collect();
    let io = replicated(members).queue(0).unwrap();
    Fixture::new(ArenaTarget::new(io, SIZE))
        .keep(peers)
        .keep(dir)
}

/// RDMA over the loopback provider: every payload by RDMA (threshold 1
/// byte), a lease cache that leaves the 8-slot arena room to evict.
fn arena_rdma_loopback() -> Fixture<ArenaTarget<RdmaTransport>> {
    let dir = tempfile::tempdir().unwrap();
    let provider = LoopbackProvider::new();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            rdma: vec![provider.clone()],
            ..peer_opts()
        },
    );
    let t = peer.rdma_session(provider, BLOB, 2);
    Fixture::new(ArenaTarget::new(t, SIZE)).keep(peer).keep(dir)
}

target_conformance!(
    mem,
    // Cached leases, evictions and the bounce pool under random operations.
    arena_in_process reference: 24,
    arena_tcp,
    arena_rdma_loopback reference: 8,
    arena_replicated_in_process,
    arena_replicated_tcp,
);
