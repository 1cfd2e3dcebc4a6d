//! The blob suite (`target_rdma::testing::conformance::blob`) on every
//! `BlobIo` of this crate: the in-process reference, each client transport
//! alone, ublkd's production `Session` over each of them, and volumes
//! replicated over each. Add a backend by adding a line to
//! `blob_conformance!` below.

use std::sync::Arc;

use target_rdma::blob::Transport;
use target_rdma::blob_conformance;
use target_rdma::client::{ArenaClient, RdmaTransport, Session, TransportGroup};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::RdmaProvider;
use target_rdma::replica::{MemberSessions, ReplicatedIo};
use target_rdma::store::{InProcess, Store};
use target_rdma::testing::conformance::blob::{peer_opts, store_config, BLOB};
use target_rdma::testing::conformance::Fixture;
use target_rdma::testing::*;

fn store(dir: &tempfile::TempDir) -> Arc<Store> {
    let (config, volumes) = store_config(dir.path());
    Arc::new(Store::open(config, &volumes).unwrap())
}

/// A peer serving the suite's volume from a directory of its own.
fn peer() -> (Peer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (Peer::start(dir.path(), peer_opts()), dir)
}

fn in_process() -> Fixture<InProcess> {
    let dir = tempfile::tempdir().unwrap();
    Fixture::new(InProcess::new(store(&dir), 0)).keep(dir)
}

fn tcp() -> Fixture<ArenaClient> {
    let (peer, dir) = peer();
    Fixture::new(peer.client("a", SECRET_A))
        .keep(peer)
        .keep(dir)
}

/// TCP with the answers read on a ring loop's thread instead of a reader
/// thread (`ClientConfig::driven`, as ublkd's queue threads run it).
fn tcp_driven() -> Fixture<ArenaClient> {
    let (peer, dir) = peer();
    Fixture::new(peer.driven_client("a", SECRET_A))
        .keep(peer)
        .keep(dir)
}

/// ublkd's queue session (`Session`) over TCP.
fn session_tcp() -> Fixture<Session> {
    tcp().map(Session::Tcp)
}

/// ublkd's queue session over a driven TCP client, as a volume on one
/// peer runs it.
fn session_tcp_driven() -> Fixture<Session> {
    tcp_driven().map(Session::Tcp)
}

/// A volume replicated on `n` in-process stores.
fn replicated_in_process(n: usize) -> Fixture<ReplicatedIo<LocalMember>> {
    let dirs: Vec<_> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let members = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("local{i}"), local_member(&store(d), 1)))
        .collect();
    Fixture::new(replicated(members).queue(0).unwrap()).keep(dirs)
}

/// A volume replicated on `n` arena peers over TCP, each member's sessions
/// made by `sessions`.
fn replicated_over<S: target_rdma::replica::MemberIo + 'static>(
    n: usize,
    sessions: impl Fn(&Peer) -> MemberSessions<S>,
) -> Fixture<ReplicatedIo<S>> {
    let peers: Vec<_> = (0..n).map(|_| peer()).collect();
    let members = peers
        .iter()
        .map(|(p, _)| (p.addr.to_string(), sessions(p)))
        .collect();
    Fixture::new(replicated(members).queue(0).unwrap()).keep(peers)
}

fn replicated_tcp(n: usize) -> Fixture<ReplicatedIo<ArenaClient>> {
    replicated_over(n, |p| p.member_sessions(1))
}

fn replicated_in_process_1() -> Fixture<ReplicatedIo<LocalMember>> {
    replicated_in_process(1)
}
fn replicated_in_process_2() -> Fixture<ReplicatedIo<LocalMember>> {
    replicated_in_process(2)
}
fn replicated_in_process_3() -> Fixture<ReplicatedIo<LocalMember>> {
    replicated_in_process(3)
}
fn replicated_tcp_1() -> Fixture<ReplicatedIo<ArenaClient>> {
    replicated_tcp(1)
}
fn replicated_tcp_2() -> Fixture<ReplicatedIo<ArenaClient>> {
    replicated_tcp(2)
}
fn replicated_tcp_3() -> Fixture<ReplicatedIo<ArenaClient>> {
    replicated_tcp(3)
}

/// A volume replicated on two peers over ublkd's `Session`s (TCP), as a
/// replicated device's queues run it.
fn replicated_session_tcp_2() -> Fixture<ReplicatedIo<Session>> {
    replicated_over(2, |p| {
        let s = p.member_sessions(1);
        MemberSessions {
            queues: s.queues.into_iter().map(Session::Tcp).collect(),
            background: Session::Tcp(s.background),
            epoch: s.epoch,
        }
    })
}

/// RDMA over `provider` on both sides, every payload by RDMA (threshold 1
/// byte), a lease cache small enough to leave the 16-slot arena room to evict.
fn rdma_over(provider: Arc<dyn RdmaProvider>, driven: bool) -> Fixture<RdmaTransport> {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            rdma: vec![Arc::clone(&provider)],
            ..peer_opts()
        },
    );
    let io = if driven {
        peer.driven_rdma_session(provider, BLOB, 4, std::time::Duration::ZERO)
    } else {
        peer.rdma_session(provider, BLOB, 4)
    };
    Fixture::new(io).keep(peer).keep(dir)
}

fn rdma_loopback() -> Fixture<RdmaTransport> {
    rdma_over(LoopbackProvider::new(), false)
}

/// Completions reaped on a ring loop's thread instead of a completion
/// thread (`RdmaTransportConfig::driven`, as ublkd's queue threads run
/// it), arriving a moment after each post so the loop waits on the
/// completion channel.
fn rdma_loopback_driven() -> Fixture<RdmaTransport> {
    let p = LoopbackProvider::new();
    p.delay_completions(std::time::Duration::from_millis(1));
    rdma_over(p, true)
}

/// ublkd's queue session over RDMA (loopback provider), in a transport
/// group of its own as a device's queues are.
fn session_rdma_loopback() -> Fixture<Session> {
    rdma_loopback().map(|t| Session::rdma(t, &TransportGroup::new()))
}

/// ublkd's queue session over a driven RDMA transport (loopback).
fn session_rdma_loopback_driven() -> Fixture<Session> {
    rdma_loopback_driven().map(|t| Session::rdma(t, &TransportGroup::new()))
}

/// Real verbs: needs an RDMA device (soft-RoCE in the VM suite,
/// `scripts/vm/guest/rdma.sh`), hence ignored elsewhere.
fn rdma_verbs() -> Fixture<RdmaTransport> {
    rdma_over(rdma_device(), false)
}

/// Real verbs, driven (VM suite).
fn rdma_verbs_driven() -> Fixture<RdmaTransport> {
    rdma_over(rdma_device(), true)
}

blob_conformance!(
    in_process => Transport::InProcess,
    tcp => Transport::Tcp,
    tcp_driven => Transport::Tcp,
    session_tcp => Transport::Tcp,
    session_tcp_driven => Transport::Tcp,
    rdma_loopback => Transport::Rdma,
    rdma_loopback_driven => Transport::Rdma,
    session_rdma_loopback => Transport::Rdma,
    session_rdma_loopback_driven => Transport::Rdma,
    replicated_in_process_1 => Transport::InProcess,
    replicated_in_process_2 => Transport::InProcess,
    replicated_in_process_3 => Transport::InProcess,
    replicated_tcp_1 => Transport::Tcp,
    replicated_tcp_2 => Transport::Tcp,
    replicated_tcp_3 => Transport::Tcp,
    replicated_session_tcp_2 => Transport::Tcp,
    #[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
    rdma_verbs => Transport::Rdma,
    #[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
    rdma_verbs_driven => Transport::Rdma,
);
