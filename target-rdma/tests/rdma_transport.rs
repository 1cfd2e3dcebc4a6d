//! The RDMA transport's decisions, proven from its driver counters: where
//! payloads went, each fallback reason, recovery from a failed QP, the lease
//! cache. Runs over the loopback provider here; the `verbs_*` tests run over
//! real verbs (soft-RoCE) in the VM suite, `scripts/vm/guest/rdma.sh`.

use std::sync::Arc;

use futures::executor::block_on;
use target_rdma::blob::{BlobIo, Via};
use target_rdma::client::{
    ArenaClient, RdmaDriverStats, RdmaTransport, RdmaTransportConfig, TcpReason, TransportGroup,
};
use target_rdma::proto::{
    self, Lease, Opcode, RailAccept, Request, Status, CAP_RDMA, CAP_RDMA_LEASE_KEYS, CAP_TCP_DATA,
    VERSION_2,
};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::{wc_status, Access, Isolation, RdmaOp, RdmaProvider};
use target_rdma::store::LeaseLimits;
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
            rdma: server.into_iter().collect(),
            ..PeerOpts::default()
        },
    );
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![client], cfg).unwrap();
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
    let p = rdma_device();
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
        vec![Err(
            "no RDMA device: listing RDMA devices failed: Function not implemented".into(),
        )],
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
    let t = RdmaTransport::connect(
        peer.config("a", SECRET_A),
        vec![Err("ENOSYS".into())],
        cfg(),
    )
    .unwrap();
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

/// After the peer restarts, the rail comes up on the new control
/// connection and payloads move by RDMA again: none is sent to TCP
/// (`qp_error`) because the rail set up by the request that reconnected
/// looked older than its connection.
#[test]
fn after_a_peer_restart_payloads_go_by_rdma_again() {
    let p = LoopbackProvider::new();
    let dir = tempfile::tempdir().unwrap();
    let opts = || PeerOpts {
        arena_bytes: 4 << 20,
        blob_bytes: BLOB,
        rdma: vec![p.clone()],
        ..PeerOpts::default()
    };
    let peer = Peer::start(dir.path(), opts());
    let addr = peer.addr.to_string();
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![Ok(p.clone())], cfg()).unwrap();
    for key in 0..4 {
        block_on(t.write(key, 0, &pattern(key, 1, 4096))).unwrap();
    }
    block_on(t.flush()).unwrap();
    peer.stop();
    let _peer = Peer::start_at(dir.path(), opts(), &addr);
    let mut out = vec![0; 4096];
    for key in 0..4 {
        block_on(t.read(key, 0, &mut out)).unwrap();
        assert!(out == pattern(key, 1, 4096), "key {key}");
    }
    for key in 0..4 {
        assert_eq!(
            block_on(t.write(key, 0, &pattern(key, 2, 4096))).unwrap(),
            Via::Rdma
        );
    }
    // The restarted peer holds the blobs on swap: a read of part of one is
    // served inline at its size (cold), which is not a fallback.
    assert_eq!(
        tcp_total(&t),
        tcp(&t, TcpReason::ColdBlob),
        "{:?}",
        report(&t)
    );
    assert_eq!(count(&t, "rail_connects"), 2);
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
    assert!(block_on(c.read_found(3, 0, &mut out)).unwrap());
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
            rdma: vec![p.clone()],
            ..PeerOpts::default()
        },
    );
    (p, peer, dir)
}

#[test]
fn revoked_leases_are_given_back() {
    // Two slots: a cached lease on one, then a second client's demand revokes it.
    let (p, peer, _dir) = small_peer(2);
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![Ok(p)], cfg()).unwrap();
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
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![Ok(p)], cfg()).unwrap();
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
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![Ok(p)], cfg()).unwrap();
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
        vec![Ok(p.clone())],
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
        let t = Arc::new(RdmaTransport::connect(cc, vec![Ok(p.clone())], cfg()).unwrap());
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
    assert!(block_on(fresh.read_found(6, 0, &mut out)).unwrap());
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
        assert!(
            block_on(fresh.read_found(k, 0, &mut out)).unwrap(),
            "key {k}"
        );
        assert!(out == pattern(k, 99, 4096), "key {k}");
    }
    assert_eq!(peer.protocol_errors(), 0);
}

/// The completion status of an access the peer refused (`IBV_WC_REM_ACCESS_ERR`):
/// a NAK, not a timeout.
fn refused(status: u32) -> bool {
    status == wc_status::REM_ACCESS_ERR
}

fn peer_with(
    p: Arc<dyn RdmaProvider>,
    slots: u64,
    isolation: Isolation,
) -> (Peer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: slots * u64::from(BLOB),
            blob_bytes: BLOB,
            rdma: vec![p],
            rdma_isolation: isolation,
            ..PeerOpts::default()
        },
    );
    (peer, dir)
}

fn isolated_peer(p: Arc<dyn RdmaProvider>, slots: u64) -> (Peer, tempfile::TempDir) {
    peer_with(p, slots, Isolation::Lease)
}

fn rdma_client(peer: &Peer, vol: &str, secret: &str) -> ArenaClient {
    let mut c = peer.config(vol, secret);
    c.offer_rdma = true;
    c.blob_bytes = BLOB;
    ArenaClient::connect(c).unwrap()
}

/// Volume b's blob 7, written inline; returns its slot's arena offset.
fn victim_blob(victim: &ArenaClient) -> u64 {
    block_on(victim.write(7, 0, &pattern(7, 1, BLOB as usize))).unwrap();
    let l = block_on(victim.alloc(7)).unwrap();
    block_on(victim.commit(7, l.token)).unwrap();
    l.slot_offset
}

fn victim_intact(victim: &ArenaClient) {
    let mut out = vec![0u8; BLOB as usize];
    assert!(block_on(victim.read_found(7, 0, &mut out)).unwrap());
    assert!(
        out == pattern(7, 1, BLOB as usize),
        "volume b's blob changed"
    );
}

/// An ALLOC lease of `key`, with its key (isolated per lease, on a rail).
fn keyed_alloc(c: &ArenaClient, key: u64) -> (Lease, u32) {
    let l = block_on(c.alloc(key)).unwrap();
    let k = l.rkeys[0].expect("an ALLOC answer on a rail carries its key");
    (l, k)
}

/// A client of volume a with a valid lease (and key) on its own slot
/// reaches that slot, and nothing else: a READ or WRITE of volume b's slot
/// with its key, or past its own slot's end, or with the key RAIL_CONNECT
/// named (0), completes with a remote access error and b's bytes are
/// unchanged; b's own live key to that very slot does not work over a's
/// rail (another session's domain); a GET lease's key does not write.
fn a_session_key_reaches_only_its_leased_slots(p: Arc<dyn RdmaProvider>) {
    let (peer, _dir) = isolated_peer(p.clone(), 16);
    let victim = rdma_client(&peer, "b", SECRET_B);
    let theirs = victim_blob(&victim);
    let attacker = rdma_client(&peer, "a", SECRET_A);
    assert_eq!(
        attacker.welcome().unwrap().caps & CAP_RDMA_LEASE_KEYS,
        CAP_RDMA_LEASE_KEYS
    );
    let len = 4096;

    // Its own slot, with its own key: the path works, both ways.
    let mut rail = RawRail::up(&p, &attacker, 0, BLOB);
    assert_eq!(rail.accept.rkey, 0, "no key to the whole arena");
    let (own, key) = keyed_alloc(&attacker, 1);
    assert_ne!(own.slot_offset, theirs);
    rail.local().fill(0x5a);
    assert_eq!(
        rail.one_sided(RdmaOp::Write, own.slot_offset, key, BLOB),
        wc_status::SUCCESS
    );
    rail.local().fill(0);
    assert_eq!(
        rail.one_sided(RdmaOp::Read, own.slot_offset, key, BLOB),
        wc_status::SUCCESS
    );
    assert!(rail.local().iter().all(|&b| b == 0x5a), "its own bytes");
    // Volume b's slot with the same key: refused, nothing read.
    rail.local().fill(0);
    let s = rail.one_sided(RdmaOp::Read, theirs, key, len);
    assert!(
        refused(s),
        "READ of another volume's slot completed with {s}"
    );
    assert!(
        rail.local().iter().all(|&b| b == 0),
        "no byte of b was read"
    );

    // A remote access error fails the QPs: each case on a fresh rail (and
    // a fresh lease: the new rail's domain has none of the old keys).
    let rail = RawRail::up(&p, &attacker, 0, BLOB);
    let (_, key) = keyed_alloc(&attacker, 2);
    let s = rail.one_sided(RdmaOp::Write, theirs, key, len);
    assert!(
        refused(s),
        "WRITE of another volume's slot completed with {s}"
    );
    victim_intact(&victim);
    // Past the end of its own slot (into the next one) with its own key.
    let rail = RawRail::up(&p, &attacker, 0, BLOB);
    let (own, key) = keyed_alloc(&attacker, 3);
    let s = rail.one_sided(
        RdmaOp::Read,
        own.slot_offset + u64::from(BLOB) - 2048,
        key,
        len,
    );
    assert!(refused(s), "READ across its slot's end completed with {s}");
    // With the key RAIL_CONNECT named.
    let rail = RawRail::up(&p, &attacker, 0, BLOB);
    let s = rail.one_sided(RdmaOp::Write, theirs, rail.accept.rkey, len);
    assert!(refused(s), "WRITE with the rail's key completed with {s}");
    victim_intact(&victim);

    // b's own live key to its slot, guessed or stolen, over a's rail:
    // refused (b's domain is not a's), while it works over b's own rail.
    let mut b_rail = RawRail::up(&p, &victim, 0, BLOB);
    let (b_lease, b_key) = keyed_alloc(&victim, 7);
    assert_eq!(b_lease.slot_offset, theirs);
    let rail = RawRail::up(&p, &attacker, 0, BLOB);
    let s = rail.one_sided(RdmaOp::Write, theirs, b_key, len);
    assert!(
        refused(s),
        "WRITE with another session's key completed with {s}"
    );
    assert_eq!(
        b_rail.one_sided(RdmaOp::Read, theirs, b_key, BLOB),
        wc_status::SUCCESS
    );
    assert!(
        b_rail.local() == pattern(7, 1, BLOB as usize),
        "b reads its own blob"
    );
    block_on(victim.commit(7, b_lease.token)).unwrap();
    victim_intact(&victim);

    // A GET lease's key reads, and does not write.
    let mut rail = RawRail::up(&p, &attacker, 0, BLOB);
    assert!(
        block_on(attacker.get(7)).unwrap().is_none(),
        "volume a has no key 7"
    );
    block_on(attacker.write(5, 0, &[5; 4096])).unwrap();
    let ro = block_on(attacker.get(5)).unwrap().unwrap();
    let ro_key = ro.rkeys[0].expect("a GET answer on a rail carries its key");
    assert_eq!(
        rail.one_sided(RdmaOp::Read, ro.slot_offset, ro_key, len),
        wc_status::SUCCESS
    );
    assert!(rail.local()[..4096].iter().all(|&b| b == 5));
    let s = rail.one_sided(RdmaOp::Write, ro.slot_offset, ro_key, len);
    assert!(refused(s), "WRITE through a GET lease completed with {s}");
    let mut out = [0u8; 4096];
    assert!(block_on(attacker.read_found(5, 0, &mut out)).unwrap());
    assert_eq!(out, [5; 4096], "the GET lease's blob is unchanged");
    assert_eq!(peer.protocol_errors(), 0);
}

#[test]
fn loopback_a_session_key_reaches_only_its_leased_slots() {
    a_session_key_reaches_only_its_leased_slots(LoopbackProvider::new());
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_a_session_key_reaches_only_its_leased_slots() {
    a_session_key_reaches_only_its_leased_slots(rdma_device());
}

/// A lease's key dies with the lease: after COMMIT, after RELEASE, after a
/// REMOVE made its COMMIT lost, and when a new rail replaces the one it
/// was registered for; the refused transfer leaves the slot's bytes as
/// they were.
fn keys_die_with_their_leases(p: Arc<dyn RdmaProvider>) {
    let (peer, _dir) = isolated_peer(p.clone(), 16);
    let c = rdma_client(&peer, "a", SECRET_A);
    let len = 4096;
    let read_back = |key: u64| {
        let mut out = vec![0u8; 4096];
        block_on(c.read(key, 0, &mut out)).unwrap();
        out
    };

    // COMMIT.
    let mut rail = RawRail::up(&p, &c, 0, BLOB);
    let (l, k) = keyed_alloc(&c, 3);
    rail.local().fill(3);
    assert_eq!(
        rail.one_sided(RdmaOp::Write, l.slot_offset, k, len),
        wc_status::SUCCESS
    );
    block_on(c.commit(3, l.token)).unwrap();
    rail.local().fill(4);
    let s = rail.one_sided(RdmaOp::Write, l.slot_offset, k, len);
    assert!(refused(s), "WRITE after COMMIT completed with {s}");
    assert_eq!(read_back(3), vec![3; 4096], "the committed bytes stay");

    // RELEASE (of a GET lease).
    let mut rail = RawRail::up(&p, &c, 0, BLOB);
    let ro = block_on(c.get(3)).unwrap().unwrap();
    let k = ro.rkeys[0].unwrap();
    assert_eq!(
        rail.one_sided(RdmaOp::Read, ro.slot_offset, k, len),
        wc_status::SUCCESS
    );
    assert!(rail.local()[..4096].iter().all(|&b| b == 3));
    block_on(c.release(&[ro.token])).unwrap();
    let s = rail.one_sided(RdmaOp::Read, ro.slot_offset, k, len);
    assert!(refused(s), "READ after RELEASE completed with {s}");

    // A REMOVE makes the lease's COMMIT lost, and its key dies with it.
    let rail = RawRail::up(&p, &c, 0, BLOB);
    let (l, k) = keyed_alloc(&c, 4);
    block_on(c.remove(4, 5)).unwrap();
    let e = block_on(c.commit(4, l.token)).unwrap_err();
    assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
    let s = rail.one_sided(RdmaOp::Read, l.slot_offset, k, len);
    assert!(refused(s), "READ after a lost COMMIT completed with {s}");

    // A new rail: the keys of the old one are dead over it.
    let _old = RawRail::up(&p, &c, 0, BLOB);
    let (l, k) = keyed_alloc(&c, 6);
    let mut rail = RawRail::up(&p, &c, 0, BLOB);
    rail.local().fill(6);
    let s = rail.one_sided(RdmaOp::Write, l.slot_offset, k, len);
    assert!(
        refused(s),
        "WRITE with an old rail's key completed with {s}"
    );
    block_on(c.commit(6, l.token)).unwrap();
    assert_eq!(read_back(6), vec![0; 4096], "nothing landed");
    assert_eq!(peer.protocol_errors(), 0);
}

#[test]
fn loopback_keys_die_with_their_leases() {
    keys_die_with_their_leases(LoopbackProvider::new());
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_keys_die_with_their_leases() {
    keys_die_with_their_leases(rdma_device());
}

/// A lease that is revoked and not given back is ended by force when
/// another volume needs its slot: its key is deregistered before the slot
/// is handed over, and the holder's QP stays up (its other lease still
/// works). The holder's later WRITE with the dead key is refused at once
/// with a remote access error (a NAK, not a hang) and does not land in the
/// other volume's blob, which now lives in that slot.
fn a_force_ended_lease_key_no_longer_reaches_the_slot(p: Arc<dyn RdmaProvider>) {
    let (peer, _dir) = isolated_peer(p.clone(), 2);
    peer.store.set_lease_limits(LeaseLimits {
        revoke_deadline: std::time::Duration::from_millis(200),
        ..LeaseLimits::default()
    });
    let hoarder = rdma_client(&peer, "a", SECRET_A);
    let mut rail = RawRail::up(&p, &hoarder, 0, BLOB);
    let (l1, k1) = keyed_alloc(&hoarder, 1);
    let (l2, k2) = keyed_alloc(&hoarder, 2);
    // Volume b needs a slot: a's leases past its share are revoked, ignored,
    // and ended by force at the deadline; b's WRITE then gets a slot.
    let victim = rdma_client(&peer, "b", SECRET_B);
    let mut wrote = false;
    for _ in 0..100 {
        if block_on(victim.write(7, 0, &pattern(7, 1, BLOB as usize))).is_ok() {
            wrote = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(wrote, "volume b never got a slot");
    assert_eq!(peer.store.stats().leases_force_ended, 1);
    // The oldest lease past a's share was the one ended: b's blob is in
    // its slot now.
    let b = block_on(victim.get(7)).unwrap().unwrap();
    assert_eq!(b.slot_offset, l1.slot_offset);
    block_on(victim.release(&[b.token])).unwrap();
    // The holder's rail is up: its live lease still works.
    rail.local().fill(2);
    assert_eq!(
        rail.one_sided(RdmaOp::Write, l2.slot_offset, k2, 4096),
        wc_status::SUCCESS
    );
    // The ended one's key is refused at once.
    rail.local().fill(0xee);
    let s = rail.one_sided(RdmaOp::Write, l1.slot_offset, k1, 4096);
    assert!(refused(s), "a force-ended lease's key completed with {s}");
    victim_intact(&victim);
    let e = block_on(hoarder.commit(1, l1.token)).unwrap_err();
    assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
    block_on(hoarder.commit(2, l2.token)).unwrap();
    assert_eq!(peer.protocol_errors(), 0);
}

#[test]
fn loopback_a_force_ended_lease_key_no_longer_reaches_the_slot() {
    a_force_ended_lease_key_no_longer_reaches_the_slot(LoopbackProvider::new());
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_a_force_ended_lease_key_no_longer_reaches_the_slot() {
    a_force_ended_lease_key_no_longer_reaches_the_slot(rdma_device());
}

/// A revoked lease that nobody touches again is ended at its deadline,
/// not at its holder's next use or when its slot is needed: the holder's
/// RDMA WRITE with its key, posted once the deadline has passed and with no
/// other request in between, is refused with a remote access error and
/// leaves the slot as it was at the deadline; the holder's COMMIT then
/// answers LEASE_LOST.
fn a_revoked_lease_key_dies_at_its_deadline(p: Arc<dyn RdmaProvider>) {
    let (peer, _dir) = isolated_peer(p.clone(), 4);
    peer.store.set_lease_limits(LeaseLimits {
        connection_max: Some(1),
        revoke_deadline: std::time::Duration::from_millis(200),
        ..LeaseLimits::default()
    });
    let holder = rdma_client(&peer, "a", SECRET_A);
    let mut rail = RawRail::up(&p, &holder, 0, BLOB);
    let (l1, k1) = keyed_alloc(&holder, 1);
    rail.local().fill(1);
    assert_eq!(
        rail.one_sided(RdmaOp::Write, l1.slot_offset, k1, 4096),
        wc_status::SUCCESS
    );
    // At its limit, the holder's next ALLOC is refused and its lease asked
    // back; the holder ignores the REVOKE.
    assert!(block_on(holder.alloc(2)).is_err());
    assert_eq!(peer.store.stats().revocations, 1);
    // Watch the store's counter only (no request that could end the
    // lease on its way): the reaper ends it at the deadline.
    let mut ended = false;
    for _ in 0..600 {
        if peer.store.stats().leases_force_ended == 1 {
            ended = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(ended, "the revoked lease was not ended by force on its own");
    rail.local().fill(2);
    let s = rail.one_sided(RdmaOp::Write, l1.slot_offset, k1, 4096);
    assert!(refused(s), "a key past its deadline completed with {s}");
    let e = block_on(holder.commit(1, l1.token)).unwrap_err();
    assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
    let mut out = vec![0u8; 4096];
    if block_on(holder.read_found(1, 0, &mut out)).unwrap() {
        assert!(
            out.iter().all(|&b| b == 1),
            "bytes written after the deadline landed"
        );
    }
    assert_eq!(peer.protocol_errors(), 0);
}

#[test]
fn loopback_a_revoked_lease_key_dies_at_its_deadline() {
    a_revoked_lease_key_dies_at_its_deadline(LoopbackProvider::new());
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_a_revoked_lease_key_dies_at_its_deadline() {
    a_revoked_lease_key_dies_at_its_deadline(rdma_device());
}

/// A writer of volume "a" at membership epoch `epoch`, offering RDMA.
fn writer(peer: &Peer, epoch: u64) -> ArenaClient {
    let mut c = peer.config("a", SECRET_A);
    c.offer_rdma = true;
    c.blob_bytes = BLOB;
    c.epoch = epoch;
    ArenaClient::connect(c).unwrap()
}

fn stale(e: &target_rdma::blob::ArenaError) -> bool {
    e.status() == Some(Status::StaleEpoch)
}

/// A writer fenced out by a raise (EPOCH) cannot write by RDMA any more.
/// The old writer (two sessions at epoch 1, as two queues) holds ALLOC
/// leases of key 3 with their keys; another session raises the volume to
/// epoch 2. Once that is answered the old leases are ended and their keys
/// dead: an RDMA WRITE with one completes with a remote access error, both
/// before and after the new writer ALLOCed the same key (the same slot),
/// wrote it, COMMITted and FLUSHed; the new writer reads its own bytes.
/// What the old writer had written before the raise stays in the slot (an
/// uncommitted in-place write), until the new writer overwrites it. The
/// old tokens' COMMIT and an inline WRITE answer STALE_EPOCH, RELEASE is
/// accepted, and once the old writer moves past the volume's epoch its old
/// lease answers LEASE_LOST.
fn a_raise_kills_the_fenced_writers_rdma_keys(p: Arc<dyn RdmaProvider>) {
    let (peer, _dir) = isolated_peer(p.clone(), 16);
    let len = 4096;
    let (q0, q1, q2) = (writer(&peer, 1), writer(&peer, 1), writer(&peer, 1));
    let mut rail0 = RawRail::up(&p, &q0, 0, BLOB);
    let mut rail1 = RawRail::up(&p, &q1, 0, BLOB);
    let rail2 = RawRail::up(&p, &q2, 0, BLOB);
    let (l0, k0) = keyed_alloc(&q0, 3);
    let (l1, k1) = keyed_alloc(&q1, 3);
    assert_eq!(l0.slot_offset, l1.slot_offset, "one slot per key");
    let slot = l0.slot_offset;
    rail0.local().fill(1);
    assert_eq!(
        rail0.one_sided(RdmaOp::Write, slot, k0, BLOB),
        wc_status::SUCCESS,
        "epoch 1 is the volume's: the write lands"
    );
    block_on(q0.write(4, 0, &[4; 4096])).unwrap();
    let ro = block_on(q2.get(4)).unwrap().unwrap();
    let ro_key = ro.rkeys[0].unwrap();

    // The new writer connects at the volume's epoch and raises it.
    let new = writer(&peer, 1);
    assert_eq!(block_on(new.raise_epoch(2)).unwrap(), 2);
    assert_eq!(peer.metric("arenad_leases_fenced_total", &[]), 3);

    // Before the new writer touched the key: the old key is dead, and the
    // slot holds what the old writer wrote before the raise.
    rail0.local().fill(0xee);
    let s = rail0.one_sided(RdmaOp::Write, slot, k0, len);
    assert!(refused(s), "a fenced writer's WRITE completed with {s}");
    let mut out = vec![0u8; BLOB as usize];
    assert!(block_on(new.read_found(3, 0, &mut out)).unwrap());
    assert!(
        out.iter().all(|&b| b == 1),
        "the slot keeps the bytes written before the raise, and only those"
    );
    let s = rail2.one_sided(RdmaOp::Read, ro.slot_offset, ro_key, len);
    assert!(refused(s), "a fenced writer's GET key still read: {s}");

    // The new writer takes the same slot, writes, commits, flushes.
    let mut rail = RawRail::up(&p, &new, 0, BLOB);
    let (nl, nk) = keyed_alloc(&new, 3);
    assert_eq!(nl.slot_offset, slot, "the same slot");
    rail.local().fill(2);
    assert_eq!(
        rail.one_sided(RdmaOp::Write, slot, nk, BLOB),
        wc_status::SUCCESS
    );
    block_on(new.commit(3, nl.token)).unwrap();
    block_on(new.flush()).unwrap();

    // After it: the old writer's other session (its QP untouched so far)
    // with its cached key.
    rail1.local().fill(0xee);
    let s = rail1.one_sided(RdmaOp::Write, slot, k1, len);
    assert!(refused(s), "a fenced writer's WRITE completed with {s}");
    let mut out = vec![0u8; BLOB as usize];
    assert!(block_on(new.read_found(3, 0, &mut out)).unwrap());
    assert!(out.iter().all(|&b| b == 2), "the new writer's bytes");

    // The old tokens and the old writer's inline path.
    let e = block_on(q0.commit(3, l0.token)).unwrap_err();
    assert!(stale(&e), "{e}");
    let e = block_on(q1.write(3, 0, &[0xee; 4096])).unwrap_err();
    assert!(stale(&e), "{e}");
    block_on(q2.release(&[ro.token])).unwrap();
    assert_eq!(block_on(q1.raise_epoch(3)).unwrap(), 3);
    let e = block_on(q1.commit(3, l1.token)).unwrap_err();
    assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
    let mut out = vec![0u8; BLOB as usize];
    assert!(block_on(q1.read_found(3, 0, &mut out)).unwrap());
    assert!(out.iter().all(|&b| b == 2), "still the new writer's bytes");
    assert_eq!(peer.protocol_errors(), 0);
}

#[test]
fn loopback_a_raise_kills_the_fenced_writers_rdma_keys() {
    a_raise_kills_the_fenced_writers_rdma_keys(LoopbackProvider::new());
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_a_raise_kills_the_fenced_writers_rdma_keys() {
    a_raise_kills_the_fenced_writers_rdma_keys(rdma_device());
}

/// A HELLO presenting a higher epoch fences like EPOCH: once it is
/// answered the old writer's key is dead and its lease gone.
#[test]
fn loopback_a_raise_by_hello_kills_the_fenced_writers_rdma_keys() {
    let p: Arc<dyn RdmaProvider> = LoopbackProvider::new();
    let (peer, _dir) = isolated_peer(p.clone(), 16);
    let old = writer(&peer, 1);
    let mut rail = RawRail::up(&p, &old, 0, BLOB);
    let (l, k) = keyed_alloc(&old, 3);
    let new = writer(&peer, 2);
    assert_eq!(new.welcome().unwrap().epoch, 2);
    rail.local().fill(0xee);
    let s = rail.one_sided(RdmaOp::Write, l.slot_offset, k, 4096);
    assert!(refused(s), "a fenced writer's WRITE completed with {s}");
    let mut out = vec![0u8; 4096];
    assert!(block_on(new.read_found(3, 0, &mut out)).unwrap());
    assert!(out.iter().all(|&b| b == 0), "nothing of it landed");
    let e = block_on(old.commit(3, l.token)).unwrap_err();
    assert!(stale(&e), "{e}");
    assert_eq!(peer.metric("arenad_leases_fenced_total", &[]), 1);
    assert_eq!(peer.protocol_errors(), 0);
}

/// A client that did not offer `CAP_RDMA_LEASE_KEYS` (an older build) is
/// granted `CAP_RDMA` but refused at RAIL_CONNECT by a server isolating
/// RDMA per lease, with a message naming the config key; a server with
/// `rdma_isolation = "shared"` brings its rail up.
#[test]
fn an_old_client_is_refused_a_rail_when_keys_are_per_lease() {
    let p = LoopbackProvider::new();
    let dynp: Arc<dyn RdmaProvider> = p.clone();
    for isolation in [Isolation::Lease, Isolation::Shared] {
        let (peer, _dir) = peer_with(dynp.clone(), 4, isolation);
        let mut s = RawSession::try_open_offering(
            peer.addr,
            "a",
            &secret(SECRET_A),
            VERSION_2,
            0,
            CAP_TCP_DATA | CAP_RDMA,
        )
        .unwrap();
        assert_eq!(s.welcome.caps, CAP_TCP_DATA | CAP_RDMA);
        let qp = p.domain().create_qp(4).unwrap();
        let mut f = Vec::new();
        proto::encode_request(
            &mut f,
            1,
            &Request::RailConnect {
                endpoint: qp.endpoint(),
                rail: None,
            },
        );
        s.send(&f).unwrap();
        let (h, body) = s.recv().expect("an answer");
        assert_eq!(h.opcode, Opcode::RailConnect);
        match isolation {
            Isolation::Lease => {
                assert_eq!(h.status, Status::Internal);
                let msg = proto::decode_error(&body);
                assert!(
                    msg.contains("rdma_isolation") && msg.contains("CAP_RDMA_LEASE_KEYS"),
                    "{msg}"
                );
            }
            Isolation::Shared => {
                assert_eq!(h.status, Status::Ok);
                assert_ne!(RailAccept::decode(&h, &body).unwrap().rkey, 0);
            }
        }
        assert_eq!(peer.protocol_errors(), 0);
    }
}

/// A session's keys and its protection domain are gone once the session
/// ended, and a rail replacement frees the old domain.
#[test]
fn a_closed_session_leaves_no_key_and_no_domain() {
    let p = LoopbackProvider::new();
    let dynp: Arc<dyn RdmaProvider> = p.clone();
    let (peer, _dir) = isolated_peer(dynp.clone(), 16);
    let (regions, domains) = (p.live_regions(), p.live_domains());
    let c = rdma_client(&peer, "a", SECRET_A);
    let rail = RawRail::up(&dynp, &c, 0, BLOB);
    for k in 0..4 {
        keyed_alloc(&c, k);
    }
    // The rail's local buffer, the four keys; the session's domain.
    assert_eq!(p.live_regions(), regions + 5);
    assert_eq!(p.live_domains(), domains + 1);
    let again = RawRail::up(&dynp, &c, 0, BLOB);
    assert_eq!(p.live_regions(), regions + 2, "two local buffers, no key");
    assert_eq!(p.live_domains(), domains + 1, "the old domain is freed");
    keyed_alloc(&c, 9);
    drop(c);
    let want = (regions + 2, domains, 0);
    let mut left = (usize::MAX, usize::MAX, u64::MAX);
    for _ in 0..1000 {
        left = (
            p.live_regions(),
            p.live_domains(),
            peer.store.stats().leases_held,
        );
        if left == want {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(left, want, "the session's keys, domain and leases are gone");
    drop((rail, again));
    assert_eq!(p.live_regions(), regions);
}

/// A lease the server could not key (here: registrations of a slot's size
/// fail) is answered without a key, counted by arenad; the transport gives
/// it back and moves that payload over TCP, counted as declined by the
/// peer, and the data is right.
#[test]
fn a_lease_the_peer_cannot_key_goes_over_tcp_counted() {
    let p = LoopbackProvider::new();
    let s = setup(Some(p.clone()), Ok(p.clone()), cfg());
    p.refuse_registrations_of(BLOB as usize);
    let data = pattern(1, 1, 4096);
    assert_eq!(block_on(s.t.write(1, 0, &data)).unwrap(), Via::Tcp);
    let mut out = vec![0; 4096];
    assert_eq!(block_on(s.t.read(1, 0, &mut out)).unwrap(), Via::Tcp);
    assert!(out == data);
    assert_eq!(tcp(&s.t, TcpReason::Declined), 2);
    assert_eq!(count(&s.t, "rdma_transferred"), 0);
    assert_eq!(
        s._peer.metric("arenad_rdma_lease_key_failures_total", &[]),
        2,
        "arenad counts each lease it could not key"
    );
    block_on(s.t.flush()).unwrap();
    assert_eq!(
        s._peer.store.stats().leases_held,
        0,
        "the keyless leases were given back"
    );
}

/// `rdma_isolation = "shared"`: the old scheme, an explicit choice. One key
/// to the whole arena, named by RAIL_CONNECT, lease answers without keys,
/// and the trust model it states: that key reaches every volume's slots.
/// The transport works over it.
fn the_shared_region_is_an_explicit_choice_and_still_serves(p: Arc<dyn RdmaProvider>) {
    let (peer, _dir) = peer_with(p.clone(), 64, Isolation::Shared);
    let victim = rdma_client(&peer, "b", SECRET_B);
    let theirs = victim_blob(&victim);
    let raw = rdma_client(&peer, "a", SECRET_A);
    assert_eq!(raw.welcome().unwrap().caps & CAP_RDMA_LEASE_KEYS, 0);
    let mut rail = RawRail::up(&p, &raw, 0, BLOB);
    assert_ne!(rail.accept.rkey, 0);
    let l = block_on(raw.alloc(1)).unwrap();
    assert_eq!(l.rkeys[0], None);
    block_on(raw.commit(1, l.token)).unwrap();
    assert_eq!(
        rail.one_sided(RdmaOp::Read, theirs, rail.accept.rkey, BLOB),
        wc_status::SUCCESS,
        "shared: the arena key reaches another volume's slot"
    );
    assert!(rail.local() == pattern(7, 1, BLOB as usize));
    let t = RdmaTransport::connect(peer.config("a", SECRET_A), vec![Ok(p)], cfg()).unwrap();
    payloads_go_by_rdma_and_a_forced_fallback_is_counted(&t);
}

#[test]
fn loopback_the_shared_region_is_an_explicit_choice_and_still_serves() {
    the_shared_region_is_an_explicit_choice_and_still_serves(LoopbackProvider::new());
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_the_shared_region_is_an_explicit_choice_and_still_serves() {
    the_shared_region_is_an_explicit_choice_and_still_serves(rdma_device());
}

/// What the device holds for per-lease isolation (a protection domain per
/// session, a region per lease), printed for the log; it must make a
/// domain, and hold more than one domain and region.
#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_device_limits() {
    let p = rdma_device();
    let l = p.limits().unwrap();
    println!(
        "device {} max_pd {} max_mr {}",
        p.device_name(),
        l.max_pd,
        l.max_mr
    );
    assert!(l.max_pd > 1 && l.max_mr > 1, "{l:?}");
    p.new_domain().unwrap();
}

/// The cost of isolation per lease, same run, same device (not a timed
/// assertion: it prints figures for docs/BENCHMARKS.md). For a 64 KiB and
/// a 1 MiB slot: (1) registering it in a session's domain and
/// deregistering it, what arenad adds per lease; (2) the ALLOC + COMMIT
/// round trip of a session with a rail against a peer with `"shared"` and
/// one with `"lease"` (and, to split the keys' cost from the rest, one
/// with `"lease"` but no rail), in ten rotating rounds after a warm-up
/// round, the lease/shared ratio and the median of the rounds' ratios.
fn isolation_cost(p: Arc<dyn RdmaProvider>, n: u32) {
    use std::time::{Duration, Instant};
    const ROUNDS: u32 = 10;
    for blob in [64u32 << 10, 1 << 20] {
        let slots = 16usize;
        let mut arena = vec![0u8; slots * blob as usize];
        let domain = p.new_domain().unwrap();
        // The arena's pages exist before they are timed (arenad's do).
        arena.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let t = Instant::now();
        for i in 0..n {
            let addr = arena
                .as_mut_ptr()
                .wrapping_add((i as usize % slots) * blob as usize);
            // SAFETY: `addr` is one slot inside `arena`, which outlives the
            // region (dropped right away) and no device touches it.
            let mr =
                unsafe { domain.register(addr, blob as usize, Access::RemoteReadWrite) }.unwrap();
            drop(mr);
        }
        let reg = t.elapsed() / n;
        drop(domain);
        drop(arena);
        // Shared, lease with a rail (a key registered at ALLOC and
        // deregistered at COMMIT), and lease without a rail (the same
        // server path but no registration): what the keys themselves cost.
        let peers: Vec<_> = [
            (Isolation::Shared, true),
            (Isolation::Lease, true),
            (Isolation::Lease, false),
        ]
        .into_iter()
        .map(|(isolation, with_rail)| {
            let dir = tempfile::tempdir().unwrap();
            let peer = Peer::start(
                dir.path(),
                PeerOpts {
                    arena_bytes: slots as u64 * u64::from(blob),
                    blob_bytes: blob,
                    rdma: vec![p.clone()],
                    rdma_isolation: isolation,
                    ..PeerOpts::default()
                },
            );
            let mut cc = peer.config("a", SECRET_A);
            cc.offer_rdma = true;
            cc.blob_bytes = blob;
            let c = ArenaClient::connect(cc).unwrap();
            let rail = with_rail.then(|| RawRail::up(&p, &c, 0, BLOB));
            let keyed = isolation == Isolation::Lease && with_rail;
            (keyed, c, rail, peer, dir)
        })
        .collect();
        // Per round, the mean ALLOC + COMMIT of each peer, after an untimed
        // round that faults in and warms up all; which peer goes first
        // rotates, so drift hits them alike.
        let mut rounds = Vec::new();
        for r in 0..=ROUNDS {
            let mut round = [Duration::ZERO; 3];
            for k in 0..3 {
                let i = (k + r as usize) % 3;
                let (keyed, c, _rail, _, _) = &peers[i];
                let t = Instant::now();
                for j in 0..n {
                    let key = u64::from(j) % slots as u64;
                    let l = block_on(c.alloc(key)).unwrap();
                    assert_eq!(l.rkeys[0].is_some(), *keyed);
                    block_on(c.commit(key, l.token)).unwrap();
                }
                round[i] = t.elapsed() / n;
            }
            if r > 0 {
                rounds.push(round);
            }
        }
        let mean = |i: usize| rounds.iter().map(|r| r[i]).sum::<Duration>() / ROUNDS;
        let mut ratios: Vec<f64> = rounds
            .iter()
            .map(|r| r[1].as_secs_f64() / r[0].as_secs_f64())
            .collect();
        ratios.sort_by(f64::total_cmp);
        let each: Vec<String> = rounds
            .iter()
            .map(|r| {
                let us: Vec<String> = r.iter().map(|d| d.as_micros().to_string()).collect();
                us.join("/")
            })
            .collect();
        println!(
            "BENCH isolation blob={}KiB n={}x{} register+deregister={:?} alloc+commit shared={:?} lease={:?} lease_without_rail={:?} ratio={:.2} median_round_ratio={:.2} rounds(us shared/lease/lease_without_rail)={}",
            blob >> 10,
            ROUNDS,
            n,
            reg,
            mean(0),
            mean(1),
            mean(2),
            mean(1).as_secs_f64() / mean(0).as_secs_f64(),
            ratios[ratios.len() / 2],
            each.join(",")
        );
    }
}

#[test]
fn loopback_isolation_cost_runs() {
    isolation_cost(LoopbackProvider::new(), 10);
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/vm/guest/rdma.sh"]
fn verbs_isolation_cost_per_lease() {
    isolation_cost(rdma_device(), 150);
}
