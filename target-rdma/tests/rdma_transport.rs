//! The RDMA transport's decisions, proven from its driver counters: where
//! payloads went, each fallback reason, recovery from a failed QP, the lease
//! cache. Runs over the loopback provider here; the `verbs_*` tests run over
//! real verbs (soft-RoCE) in the VM suite, `scripts/vm/guest/rdma.sh`.

use std::sync::Arc;

use futures::executor::block_on;
use target_rdma::blob::{BlobIo, Via};
use target_rdma::client::{
    RdmaDriverStats, RdmaTransport, RdmaTransportConfig, TcpReason, TransportGroup,
};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::verbs::SidewayProvider;
use target_rdma::rdma::{wc_status, DeviceSelector, RdmaProvider};
use target_rdma::testing::*;
use ublk_metrics::driver::names;
use ublk_metrics::{DriverSnapshot, DriverStats as _, IoOp};

const BLOB: u32 = 64 << 10;

/// The transport's statistics as they are exported (`ublk_driver_*`).
fn report(t: &RdmaTransport) -> DriverSnapshot {
    RdmaDriverStats::new(
        "rdma",
        vec![Arc::clone(t.stats())],
        Arc::clone(t.client().stats()),
    )
    .snapshot()
}

/// An exported counter, summed over ops and reasons (it must exist).
fn count(t: &RdmaTransport, name: &str) -> u64 {
    let snap = report(t);
    assert!(
        snap.counters.iter().any(|c| c.name == name),
        "no counter {name}"
    );
    snap.counter(name, None)
}

/// An exported counter with `reason`, summed over ops.
fn count_for(t: &RdmaTransport, name: &str, reason: &str) -> u64 {
    report(t)
        .counters
        .iter()
        .filter(|c| c.name == name && c.reason.as_deref() == Some(reason))
        .map(|c| c.value)
        .sum()
}

/// Payload requests sent inline on TCP for `reason`.
fn tcp(t: &RdmaTransport, reason: TcpReason) -> u64 {
    count_for(t, names::TCP_PAYLOAD_REQUESTS, reason.name())
}

fn tcp_total(t: &RdmaTransport) -> u64 {
    count(t, names::TCP_PAYLOAD_REQUESTS)
}

fn cfg() -> RdmaTransportConfig {
    RdmaTransportConfig {
        min_rdma_bytes: 512,
        buffer_bytes: 16 << 10,
        pool_buffers: 4,
        lease_cache: 8,
        ..RdmaTransportConfig::default()
    }
}

struct Setup {
    t: RdmaTransport,
    _peer: Peer,
    _dir: tempfile::TempDir,
}

fn setup(
    server: Option<Arc<dyn RdmaProvider>>,
    client: Result<Arc<dyn RdmaProvider>, String>,
    cfg: RdmaTransportConfig,
) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 4 << 20,
            blob_bytes: BLOB,
            rdma: server,
            ..PeerOpts::default()
        },
    );
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), client, cfg).unwrap();
    Setup {
        t,
        _peer: peer,
        _dir: dir,
    }
}

fn loopback() -> (Arc<LoopbackProvider>, Setup) {
    let p = LoopbackProvider::new();
    let s = setup(Some(p.clone()), Ok(p.clone()), cfg());
    (p, s)
}

/// Writes and reads back 64 x 4 KiB at mixed offsets; returns nothing, asserts data.
fn workload(t: &RdmaTransport) {
    block_on(async {
        for k in 0..16u64 {
            for part in 0..4u32 {
                t.write(k, part * 8192, &pattern(k, u64::from(part), 4096))
                    .await
                    .unwrap();
            }
        }
        t.flush().await.unwrap();
        let mut out = vec![0; 4096];
        for k in 0..16u64 {
            for part in 0..4u32 {
                assert!(t.read(k, part * 8192, &mut out).await.unwrap().moved());
                assert!(
                    out == pattern(k, u64::from(part), 4096),
                    "key {k} part {part}"
                );
            }
        }
    });
}

/// Payloads went by RDMA and nothing silently used TCP; then a request
/// above the buffer size is counted as `too_large` and still served.
fn payloads_go_by_rdma_and_a_forced_fallback_is_counted(t: &RdmaTransport) {
    workload(t);
    assert_eq!(count(t, "rdma_transferred"), 128);
    assert_eq!(tcp_total(t), 0, "{:?}", report(t));
    assert_eq!(count(t, "rdma_requests"), 128);
    assert_eq!(
        report(t).counter("rdma_bytes", Some(IoOp::Write)),
        64 * 4096
    );
    assert_eq!(report(t).counter("rdma_bytes", Some(IoOp::Read)), 64 * 4096);
    assert!(count(t, "lease_cache_hits") > 0);
    let big = pattern(99, 1, 32 << 10);
    block_on(t.write(99, 0, &big)).unwrap();
    let mut out = vec![0; 32 << 10];
    assert!(block_on(t.read(99, 0, &mut out)).unwrap().moved());
    assert!(out == big);
    assert_eq!(tcp(t, TcpReason::TooLarge), 2);
    assert_eq!(count(t, "rdma_transferred"), 128);
}

#[test]
fn loopback_payloads_go_by_rdma_and_a_forced_fallback_is_counted() {
    let (_p, s) = loopback();
    payloads_go_by_rdma_and_a_forced_fallback_is_counted(&s.t);
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_payloads_go_by_rdma_and_a_forced_fallback_is_counted() {
    let p: Arc<dyn RdmaProvider> =
        Arc::new(SidewayProvider::open(&DeviceSelector::default()).unwrap());
    let s = setup(Some(p.clone()), Ok(p), cfg());
    assert!(s.t.rdma_status().is_ok());
    payloads_go_by_rdma_and_a_forced_fallback_is_counted(&s.t);
}

#[test]
fn small_payloads_go_inline_counted_below_threshold() {
    let (_p, s) = loopback();
    assert_eq!(block_on(s.t.write(1, 0, &[7; 100])).unwrap(), Via::Tcp);
    let mut out = [0; 100];
    assert!(block_on(s.t.read(1, 0, &mut out)).unwrap().moved());
    assert_eq!(out, [7; 100]);
    assert_eq!(tcp(&s.t, TcpReason::BelowThreshold), 2);
    assert_eq!(count(&s.t, "rdma_requests"), 0);
}

#[test]
fn a_peer_without_rdma_declines_and_every_payload_is_counted() {
    let p = LoopbackProvider::new();
    let s = setup(None, Ok(p), cfg());
    assert!(s.t.rdma_status().unwrap_err().contains("declined"));
    block_on(s.t.write(1, 0, &[1; 4096])).unwrap();
    assert_eq!(tcp(&s.t, TcpReason::Declined), 1);
    // Whole and partial blobs read back what was written.
    let whole = pattern(2, 0, BLOB as usize);
    block_on(s.t.write(2, 0, &whole)).unwrap();
    let mut out = vec![0; BLOB as usize];
    assert!(block_on(s.t.read(2, 0, &mut out)).unwrap().moved());
    assert!(out == whole, "whole blob differs");
    let mut part = vec![0; 4096];
    assert!(block_on(s.t.read(1, 0, &mut part)).unwrap().moved());
    assert!(part == [1; 4096], "partial blob differs");
    // Every payload of the declined transport went inline, none by RDMA.
    assert_eq!(count(&s.t, names::RDMA_REQUESTS), 0);
    assert_eq!(tcp_total(&s.t), tcp(&s.t, TcpReason::Declined));
}

#[test]
fn transport_rdma_refuses_to_start_without_rdma() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let e = RdmaTransport::connect(
        peer.config("a", SECRET_A),
        Err("no RDMA device: listing RDMA devices failed: Function not implemented".into()),
        RdmaTransportConfig {
            require_rdma: true,
            ..cfg()
        },
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("transport = rdma"), "{e}");
    assert!(e.to_string().contains("no local RDMA device"), "{e}");
}

#[test]
fn no_local_device_is_counted_by_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let t =
        RdmaTransport::connect(peer.config("a", SECRET_A), Err("ENOSYS".into()), cfg()).unwrap();
    block_on(t.write(1, 0, &[1; 4096])).unwrap();
    assert_eq!(tcp(&t, TcpReason::NoLocalDevice), 1);
}

#[test]
fn a_pool_that_cannot_register_sends_payloads_to_tcp_counted() {
    let p = LoopbackProvider::new();
    p.refuse_registrations_of(4 * (16 << 10));
    let s = setup(Some(p.clone()), Ok(p), cfg());
    block_on(s.t.write(1, 0, &[1; 4096])).unwrap();
    assert_eq!(tcp(&s.t, TcpReason::RegistrationFailed), 1);
    assert_eq!(count(&s.t, "registration_failures"), 1);
}

#[test]
fn an_exhausted_pool_registers_per_operation() {
    let p = LoopbackProvider::new();
    let s = setup(
        Some(p.clone()),
        Ok(p),
        RdmaTransportConfig {
            pool_buffers: 1,
            ..cfg()
        },
    );
    block_on(async {
        let writes = (0..8u64).map(|k| {
            let t = &s.t;
            async move { t.write(k, 0, &pattern(k, 3, 4096)).await }
        });
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
    });
    assert_eq!(
        count(&s.t, "registrations_pooled") + count(&s.t, "registrations_per_op"),
        8
    );
    let peak = report(&s.t)
        .gauges
        .iter()
        .find(|g| g.name == names::BUFFER_POOL_PEAK)
        .map(|g| g.value);
    assert_eq!(peak, Some(1.0));
    let mut out = vec![0; 4096];
    for k in 0..8 {
        block_on(s.t.read(k, 0, &mut out)).unwrap();
        assert!(out == pattern(k, 3, 4096));
    }
}

#[test]
fn io_buffers_registered_once_are_used_in_place() {
    let (_p, s) = loopback();
    let mut bufs = vec![0u8; 64 << 10];
    // SAFETY: `bufs` outlives the transport's use of it (dropped after `s`
    // is done with it; the transport is not used after this test body).
    unsafe { s.t.register_io_buffers(bufs.as_mut_ptr(), bufs.len()) }.unwrap();
    bufs[..4096].copy_from_slice(&pattern(5, 5, 4096));
    block_on(s.t.write(5, 0, &bufs[..4096])).unwrap();
    let (_, rest) = bufs.split_at_mut(8192);
    assert!(block_on(s.t.read(5, 0, &mut rest[..4096])).unwrap().moved());
    assert!(rest[..4096] == pattern(5, 5, 4096)[..]);
    assert_eq!(count(&s.t, "bounce_copies"), 0);
    assert_eq!(count(&s.t, "registrations_pooled"), 2);
    drop(s);
}

#[test]
fn a_failed_completion_rebuilds_the_rail_and_retries_once() {
    let (p, s) = loopback();
    block_on(s.t.write(1, 0, &pattern(1, 1, 4096))).unwrap();
    p.inject(wc_status::RETRY_EXC_ERR);
    // Retried once over a new rail: still RDMA, no failover.
    assert_eq!(
        block_on(s.t.write(1, 0, &pattern(1, 2, 4096))).unwrap(),
        Via::Rdma
    );
    let mut out = vec![0; 4096];
    assert!(block_on(s.t.read(1, 0, &mut out)).unwrap().moved());
    assert!(out == pattern(1, 2, 4096));
    assert_eq!(count_for(&s.t, "wc_errors", "retry_exceeded"), 1);
    assert_eq!(count(&s.t, "rail_connects"), 2);
    assert_eq!(count(&s.t, "rdma_failed"), 1);
    assert_eq!(count(&s.t, "rdma_transferred"), 3);
    assert_eq!(tcp_total(&s.t), 0);
    // Attempts add up: requests = transferred + failed + timed out.
    assert_eq!(count(&s.t, "rdma_requests"), 3 + 1);
}

#[test]
fn a_second_failure_fails_over_to_tcp_counted_and_the_data_is_right() {
    let (p, s) = loopback();
    p.inject(wc_status::REM_ACCESS_ERR);
    p.inject(wc_status::RETRY_EXC_ERR);
    // The outcome says so: the request accounting counts one failover.
    assert_eq!(
        block_on(s.t.write(2, 100, &pattern(2, 1, 4096))).unwrap(),
        Via::Failover
    );
    assert_eq!(count(&s.t, "rdma_declined_served_tcp"), 1);
    assert_eq!(tcp(&s.t, TcpReason::QpError), 1);
    assert_eq!(count_for(&s.t, "wc_errors", "remote_access"), 1);
    let mut out = vec![0; 4096];
    assert!(block_on(s.t.read(2, 100, &mut out)).unwrap().moved());
    assert!(out == pattern(2, 1, 4096));
}

#[test]
fn dirty_cached_leases_are_committed_by_flush() {
    let (_p, s) = loopback();
    block_on(s.t.write(3, 0, &[9; 4096])).unwrap();
    block_on(s.t.write(3, 4096, &[8; 4096])).unwrap();
    assert_eq!(count(&s.t, "lease_cache_hits"), 1);
    assert_eq!(s._peer.store.stats().leases_held, 1);
    block_on(s.t.flush()).unwrap();
    assert_eq!(s._peer.store.stats().leases_held, 0);
    // The peer has it: a plain TCP client reads it back.
    let c = s._peer.client("a", SECRET_A);
    let mut out = vec![0; 8192];
    assert!(block_on(c.read(3, 0, &mut out)).unwrap());
    assert!(out[..4096].iter().all(|b| *b == 9) && out[4096..].iter().all(|b| *b == 8));
}

/// A peer of `slots` arena slots that grants RDMA over a loopback provider.
fn small_peer(slots: u64) -> (Arc<LoopbackProvider>, Peer, tempfile::TempDir) {
    let p = LoopbackProvider::new();
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: slots * u64::from(BLOB),
            blob_bytes: BLOB,
            rdma: Some(p.clone()),
            ..PeerOpts::default()
        },
    );
    (p, peer, dir)
}

#[test]
fn revoked_leases_are_given_back() {
    // Two slots: a cached lease on one, then a second client's demand revokes it.
    let (p, peer, _dir) = small_peer(2);
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), Ok(p), cfg()).unwrap();
    block_on(t.write(1, 0, &[1; 4096])).unwrap();
    block_on(t.write(2, 0, &[2; 4096])).unwrap();
    assert_eq!(peer.store.stats().leases_held, 2);
    let other = peer.client("a", SECRET_A);
    assert!(block_on(other.write(3, 0, &[3; 4096])).is_err());
    // REVOKE frames arrive asynchronously: wait until ours has been read.
    for _ in 0..2000 {
        if report(&t).counter(names::REVOCATIONS_RECEIVED, None) > 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Our next request sees the revocations and gives the leases back.
    let mut out = [0u8; 1024];
    block_on(t.read(1, 0, &mut out)).unwrap();
    assert!(count(&t, "lease_revocations") >= 1);
    block_on(t.flush()).unwrap();
    block_on(other.write(3, 0, &[3; 4096])).unwrap();
}

/// A peer of four slots and a transport with more requests in flight than
/// slots: each BUSY answer caused by our own leases waits for one of them to
/// end, so every request completes (by RDMA or counted TCP) with its data.
#[test]
fn more_requests_in_flight_than_arena_slots_all_complete() {
    let (p, peer, _dir) = small_peer(4);
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), Ok(p), cfg()).unwrap();
    block_on(async {
        for round in 0..4u64 {
            let writes = (0..48u64).map(|k| {
                let data = pattern(k, round, 4096);
                let t = &t;
                async move { t.write(k, 4096, &data).await }
            });
            for r in futures::future::join_all(writes).await {
                r.unwrap();
            }
            t.flush().await.unwrap();
            let reads = (0..48u64).map(|k| {
                let t = &t;
                async move {
                    let mut out = vec![0; 4096];
                    assert!(t.read(k, 4096, &mut out).await.unwrap().moved());
                    assert!(out == pattern(k, round, 4096), "key {k} round {round}");
                }
            });
            futures::future::join_all(reads).await;
        }
    });
    assert_eq!(count(&t, "rdma_transferred") + tcp_total(&t), 4 * 96);
}

/// When another client pins every slot, BUSY reaches the caller (no hang,
/// no endless retry); once those leases end the same request succeeds.
#[test]
fn an_arena_pinned_by_another_client_answers_busy() {
    let (p, peer, _dir) = small_peer(2);
    let other = peer.client("a", SECRET_A);
    let held: Vec<_> = (10..12u64)
        .map(|k| (k, block_on(other.alloc(k)).unwrap()))
        .collect();
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), Ok(p), cfg()).unwrap();
    let e = block_on(t.write(1, 0, &[1; 4096])).unwrap_err();
    assert_eq!(e.status(), Some(target_rdma::proto::Status::Busy), "{e}");
    for (k, lease) in held {
        block_on(other.commit(k, lease.token)).unwrap();
    }
    block_on(t.write(1, 0, &[1; 4096])).unwrap();
    let mut out = vec![0; 4096];
    assert!(block_on(t.read(1, 0, &mut out)).unwrap().moved());
    assert!(out.iter().all(|b| *b == 1));
}

/// A DISCARD on another queue removes the blob between this write's ALLOC
/// and its COMMIT: the COMMIT answers LEASE_LOST and the write is done
/// again, after the remove, so the acknowledged data is what reads back.
#[test]
fn a_write_racing_a_remove_on_another_connection_is_done_again() {
    let (p, peer, _dir) = small_peer(8);
    let t = RdmaTransport::connect(
        peer.config("a", SECRET_A),
        Ok(p.clone()),
        RdmaTransportConfig {
            lease_cache: 0,
            ..cfg()
        },
    )
    .unwrap();
    block_on(t.write(4, 0, &pattern(4, 1, 4096))).unwrap();
    let remover = peer.client("a", SECRET_A);
    p.before_next_post(move || {
        // The transport's thread is inside its own executor: remove from
        // another thread, as another queue would.
        std::thread::spawn(move || assert_eq!(block_on(remover.remove(4, 5)).unwrap(), 1))
            .join()
            .unwrap();
    });
    let data = pattern(4, 2, 4096);
    block_on(t.write(4, 4096, &data)).unwrap();
    let mut out = vec![0; 8192];
    assert!(block_on(t.read(4, 0, &mut out)).unwrap().moved());
    assert!(
        out[..4096].iter().all(|b| *b == 0),
        "the remove dropped the old bytes"
    );
    assert!(out[4096..] == data[..], "the write after it is there");
    assert_eq!(count(&t, "lease_failures"), 1);
    assert_eq!(peer.protocol_errors(), 0);
}

/// Two queues of one device, each caching leases on its own connection.
fn two_queues(
    slots: u64,
) -> (
    Arc<RdmaTransport>,
    Arc<RdmaTransport>,
    Peer,
    tempfile::TempDir,
) {
    let (p, peer, dir) = small_peer(slots);
    let group = TransportGroup::new();
    let domain = Arc::new(target_rdma::client::FlushDomain::default());
    let queue = || {
        let mut cc = peer.config("a", SECRET_A);
        cc.flush_domain = Arc::clone(&domain);
        let t = Arc::new(RdmaTransport::connect(cc, Ok(p.clone()), cfg()).unwrap());
        t.join(&group);
        t
    };
    let (q0, q1) = (queue(), queue());
    (q0, q1, peer, dir)
}

/// A DISCARD on queue 1 ends queue 0's cached lease on the blob first: the
/// next write on queue 0 leases the blob anew instead of landing in the
/// removed one's slot, and a FLUSH on queue 1 COMMITs it.
#[test]
fn a_remove_on_one_queue_ends_the_cached_leases_of_the_others() {
    let (q0, q1, peer, _dir) = two_queues(8);
    block_on(q0.write(6, 0, &pattern(6, 1, 4096))).unwrap();
    assert_eq!(
        peer.store.stats().leases_held,
        1,
        "queue 0 caches its lease"
    );
    assert_eq!(block_on(q1.remove(6, 7)).unwrap(), 1);
    assert_eq!(
        peer.store.stats().leases_held,
        0,
        "the remove ended it first"
    );
    let data = pattern(6, 2, 4096);
    block_on(q0.write(6, 4096, &data)).unwrap();
    block_on(q1.flush()).unwrap();
    assert_eq!(
        peer.store.stats().leases_held,
        0,
        "the flush committed queue 0's lease"
    );
    let fresh = peer.client("a", SECRET_A);
    let mut out = vec![0; 8192];
    assert!(block_on(fresh.read(6, 0, &mut out)).unwrap());
    assert!(
        out[..4096].iter().all(|b| *b == 0),
        "removed bytes stay removed"
    );
    assert!(
        out[4096..] == data[..],
        "the write after the remove is there"
    );
    assert_eq!(count(&q0, "lease_failures"), 0);
}

/// Queue 0's idle cached leases pin every slot; a write on queue 1 gets
/// BUSY, gives them back and succeeds.
#[test]
fn a_busy_queue_gives_back_the_idle_cached_leases_of_the_others() {
    let (q0, q1, peer, _dir) = two_queues(4);
    for k in 0..4u64 {
        block_on(q0.write(k, 0, &pattern(k, 1, 4096))).unwrap();
    }
    assert_eq!(peer.store.stats().leases_held, 4);
    block_on(q1.write(9, 0, &pattern(9, 1, 4096))).unwrap();
    block_on(q1.flush()).unwrap();
    let mut out = vec![0; 4096];
    for k in [0u64, 1, 2, 3, 9] {
        assert!(block_on(q1.read(k, 0, &mut out)).unwrap().moved());
        assert!(out == pattern(k, 1, 4096), "key {k}");
    }
}

/// Queue 0 keeps writing hot blobs through cached leases while queue 1
/// removes and flushes under it; once both stop, queue 0's last writes must
/// all be there: none went through a lease whose blob was removed.
#[test]
fn writes_on_one_queue_survive_removes_and_flushes_on_another() {
    let (q0, q1, peer, _dir) = two_queues(16);
    let writer = {
        let q0 = Arc::clone(&q0);
        std::thread::spawn(move || {
            block_on(async {
                for round in 0..40u64 {
                    for k in 0..8u64 {
                        q0.write(k, 512 * (round as u32 % 8), &pattern(k, round, 512))
                            .await
                            .unwrap();
                    }
                }
            })
        })
    };
    block_on(async {
        for i in 0..40u64 {
            let start = i % 8;
            q1.remove(start, start + 2).await.unwrap();
            if i % 4 == 0 {
                q1.flush().await.unwrap();
            }
        }
    });
    writer.join().unwrap();
    block_on(async {
        for k in 0..8u64 {
            q0.write(k, 0, &pattern(k, 99, 4096)).await.unwrap();
        }
        q1.flush().await.unwrap();
    });
    let fresh = peer.client("a", SECRET_A);
    let mut out = vec![0; 4096];
    for k in 0..8u64 {
        assert!(block_on(fresh.read(k, 0, &mut out)).unwrap(), "key {k}");
        assert!(out == pattern(k, 99, 4096), "key {k}");
    }
    assert_eq!(peer.protocol_errors(), 0);
}
