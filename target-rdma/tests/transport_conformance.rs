//! One suite, every transport: each `BlobIo` implementation must behave the
//! same, failures included: the same failure is the same `ArenaError` kind
//! and status over every transport. Add a transport by adding a line to
//! `conformance!` below.

use std::sync::Arc;

use futures::executor::block_on;
use futures::future::join_all;
use target_rdma::blob::{BlobIo, ErrorKind, Transport, Via};
use target_rdma::client::RdmaTransport;
use target_rdma::proto::Status;
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::RdmaProvider;
use target_rdma::replica::ReplicatedIo;
use target_rdma::store::{InProcess, Store, StoreConfig, VolumeSpec};
use target_rdma::testing::*;

const BLOB: u32 = 64 << 10;
/// Blobs a volume may hold: more than any case below writes but one.
const QUOTA: u64 = 48;

/// A transport plus whatever must outlive it.
struct Fixture<T> {
    io: T,
    _dirs: Vec<tempfile::TempDir>,
    _peers: Vec<Peer>,
}

fn store(dir: &tempfile::TempDir) -> Arc<Store> {
    let store = Store::open(
        StoreConfig {
            dir: dir.path().to_owned(),
            arena_bytes: 1 << 20,
            blob_bytes: BLOB,
            swap_bytes: 64 << 20,
            swap_reads_in_flight: target_rdma::store::DEFAULT_SWAP_READS_IN_FLIGHT,
        },
        &[VolumeSpec {
            name: "a".into(),
            quota_blobs: QUOTA,
        }],
    )
    .unwrap();
    Arc::new(store)
}

fn in_process() -> Fixture<InProcess> {
    let dir = tempfile::tempdir().unwrap();
    Fixture {
        io: InProcess::new(store(&dir), 0),
        _dirs: vec![dir],
        _peers: vec![],
    }
}

fn tcp_peer(dir: &tempfile::TempDir) -> Peer {
    Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 1 << 20,
            blob_bytes: BLOB,
            quota_blobs: QUOTA,
            ..PeerOpts::default()
        },
    )
}

fn tcp() -> Fixture<target_rdma::client::ArenaClient> {
    let dir = tempfile::tempdir().unwrap();
    let peer = tcp_peer(&dir);
    let io = peer.client("a", SECRET_A);
    Fixture {
        io,
        _dirs: vec![dir],
        _peers: vec![peer],
    }
}

/// TCP with the answers read on a ring loop's thread instead of a reader
/// thread (`ClientConfig::driven`, as ublkd's queue threads run it).
fn tcp_driven() -> Fixture<target_rdma::client::ArenaClient> {
    let dir = tempfile::tempdir().unwrap();
    let peer = tcp_peer(&dir);
    let io = peer.driven_client("a", SECRET_A);
    Fixture {
        io,
        _dirs: vec![dir],
        _peers: vec![peer],
    }
}

/// A volume replicated on `n` in-process stores.
fn replicated_in_process(n: usize) -> Fixture<ReplicatedIo<LocalMember>> {
    let dirs: Vec<_> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let members = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("local{i}"), local_member(&store(d), 1)))
        .collect();
    Fixture {
        io: replicated(members).queue(0).unwrap(),
        _dirs: dirs,
        _peers: vec![],
    }
}

/// A volume replicated on `n` arena peers over TCP.
fn replicated_tcp(n: usize) -> Fixture<ReplicatedIo<target_rdma::client::ArenaClient>> {
    let dirs: Vec<_> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<_> = dirs.iter().map(tcp_peer).collect();
    let members = peers
        .iter()
        .map(|p| (p.addr.to_string(), p.member_sessions(1)))
        .collect();
    Fixture {
        io: replicated(members).queue(0).unwrap(),
        _dirs: dirs,
        _peers: peers,
    }
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
fn replicated_tcp_1() -> Fixture<ReplicatedIo<target_rdma::client::ArenaClient>> {
    replicated_tcp(1)
}
fn replicated_tcp_2() -> Fixture<ReplicatedIo<target_rdma::client::ArenaClient>> {
    replicated_tcp(2)
}
fn replicated_tcp_3() -> Fixture<ReplicatedIo<target_rdma::client::ArenaClient>> {
    replicated_tcp(3)
}

/// RDMA over `provider` on both sides, every payload by RDMA (threshold 1
/// byte), a lease cache small enough to leave the 16-slot arena room to evict.
fn rdma_over(provider: Arc<dyn RdmaProvider>, driven: bool) -> Fixture<RdmaTransport> {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 1 << 20,
            blob_bytes: BLOB,
            quota_blobs: QUOTA,
            rdma: Some(Arc::clone(&provider)),
            ..PeerOpts::default()
        },
    );
    let io = if driven {
        peer.driven_rdma_session(provider, BLOB, 4, std::time::Duration::ZERO)
    } else {
        peer.rdma_session(provider, BLOB, 4)
    };
    Fixture {
        io,
        _dirs: vec![dir],
        _peers: vec![peer],
    }
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

/// Real verbs: needs an RDMA device (soft-RoCE in the VM suite,
/// `scripts/vm/guest/rdma.sh`), hence ignored elsewhere.
fn rdma_verbs() -> Fixture<RdmaTransport> {
    rdma_over(rdma_device(), false)
}

/// Real verbs, driven (VM suite).
fn rdma_verbs_driven() -> Fixture<RdmaTransport> {
    rdma_over(rdma_device(), true)
}

/// The path a transport's payloads take (every fixture moves every payload
/// on its own data path).
fn via(io: &impl BlobIo) -> Via {
    match io.transport() {
        Transport::InProcess => Via::InProcess,
        Transport::Tcp => Via::Tcp,
        Transport::Rdma => Via::Rdma,
    }
}

fn unwritten_blobs_read_as_zeros(io: &impl BlobIo) {
    let mut out = vec![0xaa; 4096];
    assert_eq!(block_on(io.read(5, 100, &mut out)).unwrap(), Via::Nothing);
    assert!(out.iter().all(|b| *b == 0));
}

fn partial_writes_keep_the_rest_of_the_blob(io: &impl BlobIo) {
    block_on(async {
        assert_eq!(io.write(1, 0, &[1; 1000]).await.unwrap(), via(io));
        assert_eq!(io.write(1, 500, &[2; 100]).await.unwrap(), via(io));
        let mut out = vec![0; 2000];
        assert_eq!(io.read(1, 0, &mut out).await.unwrap(), via(io));
        assert!(out[..500].iter().all(|b| *b == 1));
        assert!(out[500..600].iter().all(|b| *b == 2));
        assert!(out[600..1000].iter().all(|b| *b == 1));
        assert!(out[1000..].iter().all(|b| *b == 0));
    });
}

fn whole_blobs_round_trip_beyond_the_arena(io: &impl BlobIo) {
    // 40 blobs through a 16-slot arena: eviction and fault-in on every pass.
    block_on(async {
        for key in 0..40 {
            io.write(key, 0, &pattern(key, 1, BLOB as usize))
                .await
                .unwrap();
        }
        let mut out = vec![0; BLOB as usize];
        for key in (0..40).rev() {
            assert_eq!(io.read(key, 0, &mut out).await.unwrap(), via(io));
            assert!(out == pattern(key, 1, BLOB as usize), "blob {key} differs");
        }
    });
}

fn remove_drops_exactly_the_range(io: &impl BlobIo) {
    block_on(async {
        for key in 0..10 {
            io.write(key, 0, &[key as u8 + 1; 16]).await.unwrap();
        }
        assert_eq!(io.remove(3, 7).await.unwrap(), 4);
        assert_eq!(io.remove(3, 7).await.unwrap(), 0);
        let mut out = [0u8; 16];
        for key in 0..10 {
            let present = io.read(key, 0, &mut out).await.unwrap().moved();
            assert_eq!(present, !(3..7).contains(&key), "key {key}");
        }
    });
}

fn ranges_past_the_blob_end_are_refused(io: &impl BlobIo) {
    for (offset, len) in [(BLOB - 10, 11), (BLOB, 1), (u32::MAX, 1)] {
        let e = block_on(io.write(1, offset, &vec![0; len])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Status(Status::Protocol), "{e}");
        assert!(e.to_string().contains(&offset.to_string()), "{e}");
        let e = block_on(io.read(1, offset, &mut vec![0; len])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Status(Status::Protocol), "{e}");
    }
    // The session survives its refused requests.
    block_on(io.write(1, 0, &[1; 16])).unwrap();
}

fn a_volume_at_its_quota_refuses_new_blobs_but_not_old_ones(io: &impl BlobIo) {
    block_on(async {
        for key in 0..QUOTA {
            io.write(key, 0, &[key as u8; 512]).await.unwrap();
        }
        let e = io.write(QUOTA, 0, &[1; 512]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Status(Status::QuotaExceeded), "{e}");
        assert_eq!(e.status(), Some(Status::QuotaExceeded));
        // Blobs it holds still take writes; a removed one makes room.
        io.write(3, 512, &[9; 512]).await.unwrap();
        assert_eq!(io.remove(0, 1).await.unwrap(), 1);
        io.write(QUOTA, 0, &[7; 512]).await.unwrap();
        let mut out = [0u8; 512];
        assert!(io.read(QUOTA, 0, &mut out).await.unwrap().moved());
        assert_eq!(out, [7; 512]);
    });
}

fn concurrent_writes_to_many_keys(io: &impl BlobIo) {
    block_on(async {
        let writes = (0..32u64).map(|k| async move { io.write(k, 8, &pattern(k, 7, 3000)).await });
        for r in join_all(writes).await {
            r.unwrap();
        }
        io.flush().await.unwrap();
        let mut out = vec![0; 3000];
        for k in 0..32 {
            io.read(k, 8, &mut out).await.unwrap();
            assert!(out == pattern(k, 7, 3000), "blob {k} differs");
        }
    });
}

macro_rules! conformance {
    ($($(#[$attr:meta])* $transport:ident => $kind:expr),*) => {$(
        mod $transport {
            use super::*;
            $(#[$attr])* #[test] fn transport() { assert_eq!(super::$transport().io.transport(), $kind); }
            $(#[$attr])* #[test] fn unwritten_blobs_read_as_zeros() { super::unwritten_blobs_read_as_zeros(&super::$transport().io) }
            $(#[$attr])* #[test] fn partial_writes_keep_the_rest_of_the_blob() { super::partial_writes_keep_the_rest_of_the_blob(&super::$transport().io) }
            $(#[$attr])* #[test] fn whole_blobs_round_trip_beyond_the_arena() { super::whole_blobs_round_trip_beyond_the_arena(&super::$transport().io) }
            $(#[$attr])* #[test] fn remove_drops_exactly_the_range() { super::remove_drops_exactly_the_range(&super::$transport().io) }
            $(#[$attr])* #[test] fn ranges_past_the_blob_end_are_refused() { super::ranges_past_the_blob_end_are_refused(&super::$transport().io) }
            $(#[$attr])* #[test] fn a_volume_at_its_quota_refuses_new_blobs_but_not_old_ones() { super::a_volume_at_its_quota_refuses_new_blobs_but_not_old_ones(&super::$transport().io) }
            $(#[$attr])* #[test] fn concurrent_writes_to_many_keys() { super::concurrent_writes_to_many_keys(&super::$transport().io) }
        }
    )*};
}

conformance!(
    in_process => Transport::InProcess,
    tcp => Transport::Tcp,
    tcp_driven => Transport::Tcp,
    rdma_loopback => Transport::Rdma,
    rdma_loopback_driven => Transport::Rdma,
    replicated_in_process_1 => Transport::InProcess,
    replicated_in_process_2 => Transport::InProcess,
    replicated_in_process_3 => Transport::InProcess,
    replicated_tcp_1 => Transport::Tcp,
    replicated_tcp_2 => Transport::Tcp,
    replicated_tcp_3 => Transport::Tcp,
    #[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
    rdma_verbs => Transport::Rdma,
    #[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
    rdma_verbs_driven => Transport::Rdma
);
