//! Reads of blobs that are in swap only, over the RDMA transport: the peer
//! answers the GET COLD instead of faulting the whole blob in, the range is
//! read inline at its own size (counted as `cold_blob`), and a blob read
//! cold again soon is faulted in in the background, after which its reads
//! go by RDMA. A client that does not offer `CAP_COLD_GET` still gets its
//! lease. Runs over the loopback RDMA provider against the real server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use target_rdma::blob::{BlobIo, Via};
use target_rdma::client::{RdmaDriverStats, RdmaTransport, RdmaTransportConfig, TcpReason};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::testing::*;
use ublk_metrics::driver::names;
use ublk_metrics::DriverStats as _;

const BLOB: u32 = 64 << 10;
const KEYS: u64 = 16;
const SLOTS: u64 = 4;

fn cold_reads(t: &RdmaTransport) -> u64 {
    RdmaDriverStats::new(
        "rdma",
        vec![Arc::clone(t.stats())],
        Arc::clone(t.client().stats()),
    )
    .snapshot()
    .counters
    .iter()
    .filter(|c| {
        c.name == names::TCP_PAYLOAD_REQUESTS
            && c.reason.as_deref() == Some(TcpReason::ColdBlob.name())
    })
    .map(|c| c.value)
    .sum()
}

/// A peer of four slots holding sixteen written blobs, so at least twelve
/// are in swap only, and an RDMA transport to it.
fn peer_with_cold_blobs(promote_cold_after: u32) -> (Peer, RdmaTransport, tempfile::TempDir) {
    let p = LoopbackProvider::new();
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: SLOTS * u64::from(BLOB),
            blob_bytes: BLOB,
            rdma: vec![p.clone()],
            promote_cold_after,
            ..PeerOpts::default()
        },
    );
    let writer = peer.client("a", SECRET_A);
    block_on(async {
        for k in 0..KEYS {
            writer
                .write(k, 0, &pattern(k, 0, BLOB as usize))
                .await
                .unwrap();
        }
        writer.flush().await.unwrap();
    });
    drop(writer);
    let cfg = RdmaTransportConfig {
        min_rdma_bytes: 512,
        buffer_bytes: 16 << 10,
        pool_buffers: 4,
        lease_cache: 0,
        ..RdmaTransportConfig::default()
    };
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![Ok(p)], cfg).unwrap();
    (peer, t, dir)
}

/// Reads 4 KiB of blob `k` at `offset` and checks the bytes.
fn read_4k(t: &RdmaTransport, k: u64, offset: u32) -> Via {
    let mut out = vec![0; 4096];
    let via = block_on(t.read(k, offset, &mut out)).unwrap();
    let o = offset as usize;
    assert!(
        out[..] == pattern(k, 0, BLOB as usize)[o..o + 4096],
        "blob {k} at {offset}"
    );
    via
}

/// The first blob, by key, whose 4 KiB read at offset 0 went cold.
fn first_cold(t: &RdmaTransport) -> u64 {
    (0..KEYS)
        .find(|&k| read_4k(t, k, 0) == Via::Tcp)
        .expect("a blob in swap only")
}

#[test]
fn a_cold_blob_is_read_at_size_without_a_fault_in() {
    let (peer, t, _dir) = peer_with_cold_blobs(0);
    let before = peer.store.stats();
    let vias: Vec<Via> = (0..KEYS).map(|k| read_4k(&t, k, 8192)).collect();
    let after = peer.store.stats();
    let cold = cold_reads(&t);
    assert!(
        cold >= KEYS - SLOTS,
        "at least {} of {KEYS} blobs are in swap only; {cold} reads went cold ({vias:?})",
        KEYS - SLOTS
    );
    assert_eq!(
        vias.iter().filter(|v| **v == Via::Rdma).count() as u64,
        KEYS - cold,
        "every other read went by RDMA: {vias:?}"
    );
    assert_eq!(after.fault_ins, before.fault_ins, "no blob was faulted in");
    assert_eq!(
        after.swap_bytes_read - before.swap_bytes_read,
        cold * 4096,
        "each cold read read its 4 KiB from swap, not the blob"
    );
    assert!(peer.metric("arenad_ops_total", &[("op", "get"), ("outcome", "cold")]) >= cold);
    assert_eq!(
        peer.metric("arenad_promotions_total", &[]),
        0,
        "promote_cold_after = 0 promotes nothing"
    );
}

#[test]
fn a_blob_read_cold_twice_is_faulted_in_and_then_read_by_rdma() {
    let (peer, t, _dir) = peer_with_cold_blobs(2);
    // A blob in swap only: its first read goes cold.
    let k = first_cold(&t);
    let first = cold_reads(&t);
    let faults = peer.store.stats().fault_ins;
    assert_eq!(
        read_4k(&t, k, 4096),
        Via::Tcp,
        "the second read is cold too"
    );
    let promoted = || peer.metric("arenad_promotions_total", &[("outcome", "promoted")]);
    let until = Instant::now() + Duration::from_secs(20);
    while promoted() == 0 {
        assert!(Instant::now() < until, "blob {k} was not promoted");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(peer.store.stats().fault_ins, faults + 1, "one fault-in");
    assert_eq!(read_4k(&t, k, 12288), Via::Rdma, "resident now: by RDMA");
    assert_eq!(cold_reads(&t), first + 1);
}

#[test]
fn a_client_without_cold_get_still_gets_its_lease() {
    let (peer, t, _dir) = peer_with_cold_blobs(0);
    let k = first_cold(&t);
    let faults = peer.store.stats().fault_ins;
    let tcp_only = peer.client("a", SECRET_A);
    let lease = block_on(tcp_only.get(k)).unwrap().expect("a lease");
    block_on(tcp_only.release(&[lease.token])).unwrap();
    assert_eq!(peer.store.stats().fault_ins, faults + 1);
}
