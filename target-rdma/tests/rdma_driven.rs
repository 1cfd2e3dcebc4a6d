//! A driven RDMA transport on one thread with its owner's loop, as a ublk
//! queue thread runs it: transfers and the completion driver share one
//! `UringLoop`, so every completion is reaped, and its request completed,
//! on that thread, with no completion thread of the rail's own. Over the
//! loopback provider here; the VM suite runs the conformance suite's
//! driven fixture over real verbs (soft-RoCE).

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{select, Either};
use target_rdma::blob::{BlobIo, Via};
use target_rdma::client::{RdmaDriverStats, RdmaTransport, RdmaTransportConfig};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::{wc_status, RdmaProvider};
use target_rdma::testing::*;
use ublk_metrics::{DriverSnapshot, DriverStats as _};

const BLOB: u32 = 64 << 10;

fn count(t: &RdmaTransport, name: &str) -> u64 {
    let snap: DriverSnapshot = RdmaDriverStats::new(
        "rdma",
        vec![Arc::clone(t.stats())],
        Arc::clone(t.client().stats()),
    )
    .snapshot();
    assert!(
        snap.counters.iter().any(|c| c.name == name),
        "no counter {name}"
    );
    snap.counter(name, None)
}

struct Setup {
    t: RdmaTransport,
    provider: Arc<LoopbackProvider>,
    _peer: Peer,
    _dir: tempfile::TempDir,
}

fn driven(busy_poll: Duration) -> Setup {
    driven_with(busy_poll, Duration::ZERO)
}

/// `delay`: how long after its post each transfer completes.
fn driven_with(busy_poll: Duration, delay: Duration) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let provider = LoopbackProvider::new();
    provider.delay_completions(delay);
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 4 << 20,
            blob_bytes: BLOB,
            rdma: vec![provider.clone() as Arc<dyn RdmaProvider>],
            ..PeerOpts::default()
        },
    );
    let cfg = RdmaTransportConfig {
        min_rdma_bytes: 512,
        buffer_bytes: 16 << 10,
        pool_buffers: 4,
        lease_cache: 8,
        driven: true,
        busy_poll,
        ..RdmaTransportConfig::default()
    };
    let t = RdmaTransport::connect(
        peer.config("a", SECRET_A),
        vec![Ok(provider.clone() as Arc<dyn RdmaProvider>)],
        cfg,
    )
    .unwrap();
    Setup {
        t,
        provider,
        _peer: peer,
        _dir: dir,
    }
}

/// Runs `work` on `lp` alongside the transport's completion driver.
fn on_loop<T>(lp: &UringLoop, t: &RdmaTransport, work: impl std::future::Future<Output = T>) -> T {
    let driver = t.cq_driver().expect("a driven transport has a driver");
    lp.block_on(async {
        match select(pin!(work), pin!(driver.run(lp))).await {
            Either::Left((v, _)) => v,
            Either::Right(((), _)) => panic!("the driver ended while its transport lives"),
        }
    })
}

fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.trim() == name)
        .count()
}

/// 32 x 4 KiB written and read back, 8 in flight at a time, on one loop.
async fn workload(t: &RdmaTransport) {
    for round in 0..4u64 {
        let writes = (0..8u64).map(|k| {
            let key = round * 8 + k;
            async move {
                let data = pattern(key, 1, 4096);
                t.write(key, 4096, &data).await
            }
        });
        for r in futures::future::join_all(writes).await {
            assert_eq!(r.unwrap(), Via::Rdma);
        }
    }
    for key in 0..32u64 {
        let mut out = vec![0; 4096];
        assert_eq!(t.read(key, 4096, &mut out).await.unwrap(), Via::Rdma);
        assert!(out == pattern(key, 1, 4096), "blob {key} read back wrong");
    }
}

/// Runs the workload on a driven transport whose transfers complete
/// `delay` after their post, reaped with `busy_poll`: every one by RDMA,
/// none timed out.
fn reaped(busy_poll: Duration, delay: Duration) -> Setup {
    let s = driven_with(busy_poll, delay);
    let lp = UringLoop::new().unwrap();
    on_loop(&lp, &s.t, workload(&s.t));
    let why = format!("busy_poll {busy_poll:?}, delay {delay:?}");
    assert_eq!(count(&s.t, "rdma_transferred"), 64, "{why}");
    assert_eq!(count(&s.t, "rdma_requests"), 64, "{why}");
    assert_eq!(count(&s.t, "rdma_timed_out"), 0, "{why}");
    assert_eq!(count(&s.t, "tcp_payload_requests"), 0, "{why}");
    s
}

#[test]
fn completions_are_reaped_on_the_callers_loop_with_or_without_busy_polling() {
    for busy_poll in [Duration::ZERO, Duration::from_micros(200)] {
        reaped(busy_poll, Duration::ZERO);
        // Every transport of this test binary is driven: none starts one.
        assert_eq!(
            threads_named("rdma-cq"),
            0,
            "a driven rail has no completion thread"
        );
    }
}

/// Completions that arrive after the post: with no busy poll (or one too
/// short) the loop arms the completion channel and sleeps on it; a busy
/// poll longer than the delay reaps them without sleeping. Both complete
/// every transfer with the right bytes.
#[test]
fn late_completions_are_reaped_through_the_channel_or_the_busy_poll() {
    for busy_poll in [
        Duration::ZERO,
        Duration::from_micros(50),
        Duration::from_millis(20),
    ] {
        reaped(busy_poll, Duration::from_millis(2));
    }
}

/// A failed completion breaks the rail; the retry brings up a new one, whose
/// engine the same driver serves from then on.
#[test]
fn the_driver_follows_a_rail_replaced_after_a_failure() {
    let s = driven(Duration::ZERO);
    let lp = UringLoop::new().unwrap();
    on_loop(&lp, &s.t, async {
        assert_eq!(
            s.t.write(1, 0, &pattern(1, 1, 4096)).await.unwrap(),
            Via::Rdma
        );
        s.provider.inject(wc_status::RETRY_EXC_ERR);
        assert_eq!(
            s.t.write(1, 0, &pattern(1, 2, 4096)).await.unwrap(),
            Via::Rdma,
            "retried once over a new rail"
        );
        let mut out = vec![0; 4096];
        assert_eq!(s.t.read(1, 0, &mut out).await.unwrap(), Via::Rdma);
        assert!(out == pattern(1, 2, 4096));
    });
    assert_eq!(count(&s.t, "rail_connects"), 2);
    assert_eq!(count(&s.t, "rdma_failed"), 1);
    assert_eq!(count(&s.t, "rdma_transferred"), 3);
}

/// Dropping the transport ends its driver, so a queue that goes away
/// leaves no task behind.
#[test]
fn the_driver_ends_with_its_transport() {
    let s = driven(Duration::ZERO);
    let driver = s.t.cq_driver().unwrap();
    let lp = UringLoop::new().unwrap();
    on_loop(&lp, &s.t, async {
        s.t.write(2, 0, &[5; 4096]).await.unwrap();
    });
    drop(s);
    lp.block_on(driver.run(&lp));
}

/// Two rails driven on one loop: the driver reaps both rails'
/// completions, payloads (striped ones included) move on both, and a rail
/// lost under load hands its transfers to the other.
#[test]
fn two_driven_rails_share_the_loop_and_survive_losing_one() {
    let dir = tempfile::tempdir().unwrap();
    let [a, b] = [LoopbackProvider::new(), LoopbackProvider::new()];
    let devices: Vec<Arc<dyn RdmaProvider>> = vec![a.clone(), b.clone()];
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 4 << 20,
            blob_bytes: BLOB,
            rdma: devices.clone(),
            ..PeerOpts::default()
        },
    );
    let cfg = RdmaTransportConfig {
        min_rdma_bytes: 512,
        buffer_bytes: BLOB,
        pool_buffers: 4,
        stripe_bytes: 32 << 10,
        lease_cache: 8,
        driven: true,
        ..RdmaTransportConfig::default()
    };
    let t = RdmaTransport::connect(
        peer.config("a", SECRET_A),
        devices.into_iter().map(Ok).collect(),
        cfg,
    )
    .unwrap();
    let lp = UringLoop::new().unwrap();
    on_loop(&lp, &t, workload(&t));
    let carried = |i: usize| {
        t.stats().rails[i]
            .transfers
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(
        carried(0) > 0 && carried(1) > 0,
        "{} {}",
        carried(0),
        carried(1)
    );
    b.inject(wc_status::RETRY_EXC_ERR);
    let whole = pattern(40, 1, BLOB as usize);
    on_loop(&lp, &t, async {
        assert_eq!(t.write(40, 0, &whole).await.unwrap(), Via::Rdma);
        let mut out = vec![0; BLOB as usize];
        assert_eq!(t.read(40, 0, &mut out).await.unwrap(), Via::Rdma);
        assert!(out == whole);
    });
    on_loop(&lp, &t, workload(&t));
    assert_eq!(count(&t, "tcp_payload_requests"), 0);
}
