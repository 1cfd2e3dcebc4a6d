//! A driven client on one thread with its owner's loop, as a ublk queue
//! thread runs it: requests and the driver share one `UringLoop`, so every
//! answer is read, and its request completed, on that thread.

use std::pin::pin;

use futures::future::{join_all, select, Either};
use target_rdma::client::ArenaClient;
use target_rdma::testing::{pattern, Peer, PeerOpts, UringLoop, SECRET_A};

const MIB: usize = 1 << 20;

fn driven_on_this_thread(peer: &Peer) -> ArenaClient {
    let mut cfg = peer.config("a", SECRET_A);
    cfg.driven = true;
    ArenaClient::connect(cfg).unwrap()
}

/// Runs `work` on `lp` alongside the client's driver.
fn on_loop<T>(lp: &UringLoop, c: &ArenaClient, work: impl std::future::Future<Output = T>) -> T {
    let driver = c.driver().expect("driven");
    lp.block_on(async {
        match select(pin!(work), pin!(driver.run(lp))).await {
            Either::Left((v, _)) => v,
            Either::Right(((), _)) => panic!("the driver ended while its client lives"),
        }
    })
}

#[test]
fn answers_complete_requests_on_the_callers_thread() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let c = driven_on_this_thread(&peer);
    let lp = UringLoop::new().unwrap();
    let me = std::thread::current().id();
    on_loop(&lp, &c, async {
        c.write(3, 512, &[7; 4096]).await.unwrap();
        let mut out = vec![0; 4096];
        assert!(c.read_found(3, 512, &mut out).await.unwrap());
        assert_eq!(out, vec![7; 4096]);
        assert!(
            !c.read_found(4, 0, &mut out).await.unwrap(),
            "never written"
        );
    });
    assert_eq!(std::thread::current().id(), me);
    // No reader thread was started for the connection.
    let readers = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.trim() == "arena-client-rx")
        .count();
    assert_eq!(readers, 0, "a driven client has no reader thread");
}

/// 1 MiB reads of 32 blobs and 1 MiB writes of 32 others, all in flight
/// at once on one connection: more bytes each way than the socket buffers
/// hold, so the writes find the socket full while the reads' answers wait
/// to be read on the same thread. A send that blocked the thread would
/// deadlock against the peer, blocked sending those answers.
#[test]
fn full_sockets_both_ways_do_not_deadlock_the_loop() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 256 << 20,
            blob_bytes: MIB as u32,
            swap_bytes: 512 << 20,
            quota_blobs: 512,
            max_inflight: 64,
            ..PeerOpts::default()
        },
    );
    let c = driven_on_this_thread(&peer);
    let lp = UringLoop::new().unwrap();
    let half = 32u64;
    // Blob k holds byte `k + gen[k]`.
    let fill = |k: u64, gen: u8| vec![(k as u8).wrapping_add(gen); MIB];
    on_loop(&lp, &c, async {
        join_all((0..2 * half).map(|k| {
            let c = &c;
            async move { c.write(k, 0, &fill(k, 0)).await.unwrap() }
        }))
        .await;
        for round in 0..4u64 {
            // Even rounds read the first half and rewrite the second, odd
            // rounds the other way round.
            let (read, write) = if round % 2 == 0 {
                (0..half, half..2 * half)
            } else {
                (half..2 * half, 0..half)
            };
            let reads = read.map(|k| {
                let c = &c;
                async move {
                    let mut out = vec![0u8; MIB];
                    assert!(c.read_found(k, 0, &mut out).await.unwrap());
                    // Written in round 0's populate or rewritten in the
                    // previous round.
                    let gen = if round == 0 { 0 } else { round as u8 };
                    assert!(out == fill(k, gen), "blob {k} in round {round}");
                }
            });
            let writes = write.map(|k| {
                let c = &c;
                async move { c.write(k, 0, &fill(k, round as u8 + 1)).await.unwrap() }
            });
            futures::future::join(join_all(reads), join_all(writes)).await;
        }
    });
    assert!(c.is_connected(), "no send timed out");
}

/// With `busy_poll` the driver reads the socket again while a request
/// waits for its answer instead of waiting on the ring at once: the
/// answers still complete the right requests with the right bytes, at QD 1
/// (the spin catches the answer) and with many in flight (it returns at
/// the first answer and the ring reports the rest).
#[test]
fn busy_polling_completes_every_request_with_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let mut cfg = peer.config("a", SECRET_A);
    cfg.driven = true;
    cfg.busy_poll = std::time::Duration::from_millis(5);
    let c = ArenaClient::connect(cfg).unwrap();
    let lp = UringLoop::new().unwrap();
    on_loop(&lp, &c, async {
        for k in 0..16u64 {
            c.write(k, 0, &pattern(k, 1, 4096)).await.unwrap();
            let mut out = vec![0; 4096];
            assert!(c.read_found(k, 0, &mut out).await.unwrap());
            assert!(out == pattern(k, 1, 4096), "blob {k} at QD 1");
        }
        let reads = (0..16u64).map(|k| {
            let c = &c;
            async move {
                let mut out = vec![0; 4096];
                assert!(c.read_found(k, 0, &mut out).await.unwrap());
                assert!(out == pattern(k, 1, 4096), "blob {k} at QD 16");
            }
        });
        join_all(reads).await;
    });
}
