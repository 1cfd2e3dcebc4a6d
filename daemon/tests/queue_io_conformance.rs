//! The conformance suites on ublkd's own queue path: a queue's [`QueueIo`]
//! made by ublkd's own code (`Connector` sessions, driven TCP as a volume
//! on one peer runs them; `Replicated::open` for a replicated volume, on
//! the memory coordinator instead of etcd), served by real arena peers
//! (target-rdma's `Peer`: arenad's server and store, in process, sized by
//! each suite). No kernel: the suites call what the queue threads call.
//!
//! `QueueIo` is no `BlobIo` or `BlockTarget` itself: a queue thread builds
//! `ArenaTarget::new(io.volume(), size)` over it. The fixtures do the same
//! with a clone of the volume (`VolumeIo` clones share their sessions),
//! keeping the `QueueIo` alive after it as a queue thread does; that is the
//! whole adapter. The blob suite runs on the same `VolumeIo`. A
//! confidential device (every session sealed, protocol version 3) runs
//! the blob suite on one peer and the target suite replicated.

mod common;

use target_rdma::blob::Transport;
use target_rdma::block::ArenaTarget;
use target_rdma::replica::VolumeIo;
use target_rdma::testing::conformance::{blob, target, Fixture};
use target_rdma::testing::{Peer, PeerOpts};
use target_rdma::{blob_conformance, target_conformance};
use ublkd::queue_io::QueueIo;

/// `n` peers started with `opts`, each in a directory of its own.
fn peers(n: usize, opts: &PeerOpts) -> Vec<(Peer, tempfile::TempDir)> {
    (0..n)
        .map(|_| {
            let dir = tempfile::tempdir().unwrap();
            (Peer::start(dir.path(), opts.clone()), dir)
        })
        .collect()
}

/// Queue 0 of a device on `n` peers started with `opts`, opened as ublkd
/// opens it, with everything it needs kept alive after it.
fn queue_io(n: usize, opts: PeerOpts, blob: u32, size: u64) -> Fixture<QueueIo> {
    open_queue_io(n, opts, blob, size, false)
}

/// The same, confidential (`add --confidential`): every session sealed
/// (protocol version 3).
fn confidential_queue_io(n: usize, opts: PeerOpts, blob: u32, size: u64) -> Fixture<QueueIo> {
    open_queue_io(n, opts, blob, size, true)
}

fn open_queue_io(
    n: usize,
    opts: PeerOpts,
    blob: u32,
    size: u64,
    confidential: bool,
) -> Fixture<QueueIo> {
    let peers = peers(n, &opts);
    let names: Vec<String> = peers.iter().map(|(p, _)| p.addr.to_string()).collect();
    let mut spec = common::device_spec(
        &names,
        size,
        blob.into(),
        256 << 10,
        "unused: the secret is passed in".into(),
    );
    spec.confidential = confidential;
    if n == 1 {
        let io = common::open_single(&spec).remove(0);
        return Fixture::new(io).keep(peers);
    }
    let (mut ios, rep) = common::open_replicated(&spec);
    assert_eq!(ios[0].sessions().len(), n, "a session to every member");
    Fixture::new(ios.remove(0)).keep(rep).keep(peers)
}

/// The queue's volume, as the blob suite's backend.
fn volume(io: Fixture<QueueIo>) -> Fixture<VolumeIo> {
    let volume = io.backend.volume().clone();
    Fixture::new(volume).keep(io)
}

/// The block target a queue thread runs over the queue's volume.
fn block_target(io: Fixture<QueueIo>) -> Fixture<ArenaTarget<VolumeIo>> {
    volume(io).map(|v| ArenaTarget::new(v, target::SIZE))
}

fn single_volume() -> Fixture<VolumeIo> {
    volume(queue_io(1, blob::peer_opts(), blob::BLOB, 1 << 30))
}

fn replicated_2_volume() -> Fixture<VolumeIo> {
    volume(queue_io(2, blob::peer_opts(), blob::BLOB, 1 << 30))
}

fn single_target() -> Fixture<ArenaTarget<VolumeIo>> {
    block_target(queue_io(1, target::peer_opts(), target::BLOB, target::SIZE))
}

fn replicated_2_target() -> Fixture<ArenaTarget<VolumeIo>> {
    block_target(queue_io(2, target::peer_opts(), target::BLOB, target::SIZE))
}

fn single_confidential_volume() -> Fixture<VolumeIo> {
    volume(confidential_queue_io(
        1,
        blob::peer_opts(),
        blob::BLOB,
        1 << 30,
    ))
}

fn replicated_2_confidential_target() -> Fixture<ArenaTarget<VolumeIo>> {
    block_target(confidential_queue_io(
        2,
        target::peer_opts(),
        target::BLOB,
        target::SIZE,
    ))
}

blob_conformance!(
    single_volume => Transport::Tcp,
    replicated_2_volume => Transport::Tcp,
    single_confidential_volume => Transport::Tcp,
);

target_conformance!(
    single_target reference: 8,
    replicated_2_target reference: 4,
    replicated_2_confidential_target reference: 4,
);
