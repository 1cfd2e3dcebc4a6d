//! One suite, every block target: the arena target over each transport
//! (in-process, TCP, RDMA over the loopback provider) must match the
//! in-memory reference target byte for byte, and say which path carried
//! each request.

use std::sync::Arc;

use futures::executor::block_on;
use proptest::prelude::*;
use target_rdma::blob::{Transport, Via};
use target_rdma::block::{ArenaTarget, BlockTarget, MemTarget, TargetError};
use target_rdma::client::{ArenaClient, RdmaTransport};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::replica::ReplicatedIo;
use target_rdma::store::{InProcess, Store, StoreConfig, VolumeSpec};
use target_rdma::testing::*;

const BLOB: u32 = 16 << 10;
const SIZE: u64 = 1 << 20;

struct Fixture<T> {
    target: T,
    _dir: Option<tempfile::TempDir>,
    _peers: Vec<Peer>,
}

fn mem() -> Fixture<MemTarget> {
    Fixture {
        target: MemTarget::new(SIZE),
        _dir: None,
        _peers: vec![],
    }
}

/// A store of volume "a" in `dir`, its arena 8 blobs.
fn store(dir: &std::path::Path) -> Arc<Store> {
    let store = Store::open(
        StoreConfig {
            dir: dir.to_owned(),
            arena_bytes: 8 * u64::from(BLOB),
            blob_bytes: BLOB,
            swap_bytes: 64 << 20,
            swap_reads_in_flight: target_rdma::store::DEFAULT_SWAP_READS_IN_FLIGHT,
        },
        &[VolumeSpec {
            name: "a".into(),
            quota_blobs: 1 << 20,
        }],
    )
    .unwrap();
    Arc::new(store)
}

fn arena_in_process() -> Fixture<ArenaTarget<InProcess>> {
    let dir = tempfile::tempdir().unwrap();
    Fixture {
        target: ArenaTarget::new(InProcess::new(store(dir.path()), 0), SIZE),
        _dir: Some(dir),
        _peers: vec![],
    }
}

fn arena_tcp() -> Fixture<ArenaTarget<ArenaClient>> {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 8 * u64::from(BLOB),
            blob_bytes: BLOB,
            ..PeerOpts::default()
        },
    );
    let target = ArenaTarget::new(peer.client("a", SECRET_A), SIZE);
    Fixture {
        target,
        _dir: Some(dir),
        _peers: vec![peer],
    }
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
    Fixture {
        target: ArenaTarget::new(replicated(members).queue(0).unwrap(), SIZE),
        _dir: Some(dir),
        _peers: vec![],
    }
}

/// The arena target over a volume replicated on two arena peers over TCP.
fn arena_replicated_tcp() -> Fixture<ArenaTarget<ReplicatedIo<ArenaClient>>> {
    let dir = tempfile::tempdir().unwrap();
    let opts = PeerOpts {
        arena_bytes: 8 * u64::from(BLOB),
        blob_bytes: BLOB,
        ..PeerOpts::default()
    };
    let peers: Vec<_> = (0..2)
        .map(|i| Peer::start(&dir.path().join(i.to_string()), opts.clone()))
        .collect();
    let members = peers
        .iter()
        .map(|p| (p.addr.to_string(), p.member_sessions(1)))
        .collect();
    Fixture {
        target: ArenaTarget::new(replicated(members).queue(0).unwrap(), SIZE),
        _dir: Some(dir),
        _peers: peers,
    }
}

/// RDMA over the loopback provider: every payload by RDMA (threshold 1
/// byte), a lease cache that leaves the 8-slot arena room to evict.
fn arena_rdma_loopback() -> Fixture<ArenaTarget<RdmaTransport>> {
    let dir = tempfile::tempdir().unwrap();
    let provider = LoopbackProvider::new();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 8 * u64::from(BLOB),
            blob_bytes: BLOB,
            rdma: Some(provider.clone()),
            ..PeerOpts::default()
        },
    );
    let t = peer.rdma_session(provider, BLOB, 2);
    Fixture {
        target: ArenaTarget::new(t, SIZE),
        _dir: Some(dir),
        _peers: vec![peer],
    }
}

fn read(t: &impl BlockTarget, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xee; len];
    block_on(t.read(offset, &mut buf)).unwrap();
    buf
}

fn fresh_device_reads_zeros(t: &impl BlockTarget) {
    assert!(read(t, 0, 64 << 10).iter().all(|b| *b == 0));
    assert!(read(t, SIZE - 512, 512).iter().all(|b| *b == 0));
}

fn writes_spanning_blobs_read_back(t: &impl BlockTarget) {
    let data = pattern(1, 1, 3 * BLOB as usize + 1536);
    block_on(t.write(u64::from(BLOB) - 512, &data, false)).unwrap();
    assert!(read(t, u64::from(BLOB) - 512, data.len()) == data);
    assert!(
        read(t, 0, BLOB as usize - 512).iter().all(|b| *b == 0),
        "bytes before the write changed"
    );
}

fn fua_and_flush_succeed(t: &impl BlockTarget) {
    block_on(t.write(4096, &[7; 4096], true)).unwrap();
    block_on(t.flush()).unwrap();
    assert_eq!(read(t, 4096, 4096), vec![7; 4096]);
}

fn discard_and_write_zeroes_read_back_zeros(t: &impl BlockTarget) {
    let all = pattern(2, 1, SIZE as usize / 4);
    block_on(t.write(0, &all, false)).unwrap();
    // Partial blob at each end and whole blobs in between.
    let (off, len) = (1000u64, 3 * u64::from(BLOB) + 777);
    block_on(t.discard(off, len)).unwrap();
    let got = read(t, 0, all.len());
    assert_eq!(got[..off as usize], all[..off as usize]);
    assert!(got[off as usize..(off + len) as usize]
        .iter()
        .all(|b| *b == 0));
    assert_eq!(got[(off + len) as usize..], all[(off + len) as usize..]);

    block_on(t.write_zeroes(0, 512)).unwrap();
    assert!(read(t, 0, 512).iter().all(|b| *b == 0));
}

/// The path a target's payloads take (every fixture moves every payload on
/// its own data path, none fails over).
fn own_path(t: &impl BlockTarget) -> Via {
    match t.transport() {
        Transport::InProcess => Via::InProcess,
        Transport::Tcp => Via::Tcp,
        Transport::Rdma => Via::Rdma,
    }
}

fn every_success_names_the_path_that_carried_it(t: &impl BlockTarget) {
    let via = own_path(t);
    let data = pattern(3, 1, 2 * BLOB as usize + 100);
    assert_eq!(block_on(t.write(BLOB.into(), &data, false)).unwrap(), via);
    assert_eq!(block_on(t.write(0, &data[..512], true)).unwrap(), via);
    let mut buf = vec![0; data.len()];
    assert_eq!(block_on(t.read(BLOB.into(), &mut buf)).unwrap(), via);
    assert!(buf == data);
    assert_eq!(block_on(t.flush()).unwrap(), Via::Nothing, "no payload");
    // Partial blobs at the ends are zero-filled: a payload each.
    assert_eq!(block_on(t.discard(100, 2 * u64::from(BLOB))).unwrap(), via);
}

fn out_of_range_is_eio_not_a_hang(t: &impl BlockTarget) {
    let mut buf = vec![0; 1024];
    let e = block_on(t.read(SIZE - 512, &mut buf)).unwrap_err();
    assert!(matches!(e, TargetError::OutOfRange { .. }), "{e}");
    assert_eq!(e.errno(), libc::EIO);
    assert!(e.to_string().contains("past the end"), "{e}");
    assert!(block_on(t.write(u64::MAX - 10, &buf, false)).is_err());
    assert!(block_on(t.discard(SIZE, 1)).is_err());
}

macro_rules! conformance {
    ($($target:ident),*) => {$(
        mod $target {
            #[test] fn fresh_device_reads_zeros() { super::fresh_device_reads_zeros(&super::$target().target) }
            #[test] fn writes_spanning_blobs_read_back() { super::writes_spanning_blobs_read_back(&super::$target().target) }
            #[test] fn fua_and_flush_succeed() { super::fua_and_flush_succeed(&super::$target().target) }
            #[test] fn discard_and_write_zeroes_read_back_zeros() { super::discard_and_write_zeroes_read_back_zeros(&super::$target().target) }
            #[test] fn every_success_names_the_path_that_carried_it() { super::every_success_names_the_path_that_carried_it(&super::$target().target) }
            #[test] fn out_of_range_is_eio_not_a_hang() { super::out_of_range_is_eio_not_a_hang(&super::$target().target) }
        }
    )*};
}

conformance!(
    mem,
    arena_in_process,
    arena_tcp,
    arena_rdma_loopback,
    arena_replicated_in_process,
    arena_replicated_tcp
);

#[derive(Debug, Clone)]
enum Op {
    Write(u64, usize, u8),
    Read(u64, usize),
    Discard(u64, u64),
    Zeroes(u64, u64),
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    let off = 0..SIZE - 70_000;
    prop_oneof![
        4 => (off.clone(), 1..70_000usize, any::<u8>()).prop_map(|(o, l, b)| Op::Write(o, l, b)),
        3 => (off.clone(), 1..70_000usize).prop_map(|(o, l)| Op::Read(o, l)),
        1 => (off.clone(), 1..70_000u64).prop_map(|(o, l)| Op::Discard(o, l)),
        1 => (off, 1..70_000u64).prop_map(|(o, l)| Op::Zeroes(o, l)),
        1 => Just(Op::Flush),
    ]
}

/// Runs `ops` on `target` and on the reference; every read must match.
fn matches_the_reference(target: &impl BlockTarget, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let reference = MemTarget::new(SIZE);
    block_on(async {
        for op in ops {
            match op {
                Op::Write(o, l, b) => {
                    let data = vec![b; l];
                    reference.write(o, &data, false).await.unwrap();
                    target.write(o, &data, false).await.unwrap();
                }
                Op::Read(o, l) => {
                    let (mut a, mut b) = (vec![0; l], vec![1; l]);
                    reference.read(o, &mut a).await.unwrap();
                    target.read(o, &mut b).await.unwrap();
                    prop_assert!(a == b, "read {}+{} differs", o, l);
                }
                Op::Discard(o, l) => {
                    reference.discard(o, l).await.unwrap();
                    target.discard(o, l).await.unwrap();
                }
                Op::Zeroes(o, l) => {
                    reference.write_zeroes(o, l).await.unwrap();
                    target.write_zeroes(o, l).await.unwrap();
                }
                Op::Flush => {
                    target.flush().await.unwrap();
                }
            }
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random unaligned operations on the arena target (8-slot arena under a
    /// 64-blob device, so eviction runs constantly) match the reference.
    #[test]
    fn arena_target_matches_the_reference(ops in proptest::collection::vec(op(), 1..40)) {
        matches_the_reference(&arena_in_process().target, ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// The same over RDMA (loopback provider): cached leases, evictions and
    /// the bounce pool under random unaligned operations.
    #[test]
    fn arena_target_over_rdma_matches_the_reference(ops in proptest::collection::vec(op(), 1..40)) {
        matches_the_reference(&arena_rdma_loopback().target, ops)?;
    }
}
