//! The paging protocol end to end: a real `arenad` server on loopback and
//! the real client, including hostile peers and malformed frames.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use futures::executor::block_on;
use futures::future::join_all;
use target_rdma::blob::ArenaError;
use target_rdma::client::ArenaClient;
use target_rdma::proto::{
    self, Challenge, Header, Hello, Opcode, Request, Status, HEADER_LEN, MAC_LEN,
};
use target_rdma::testing::*;
use ublk_metrics::driver::names;
use ublk_metrics::DriverStats as _;

#[test]
fn inline_write_read_remove_flush() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let c = peer.client("a", SECRET_A);
    let blob = c.blob_bytes().unwrap() as usize;
    assert_eq!(blob, 64 << 10);
    block_on(async {
        let mut out = vec![0xffu8; 4096];
        assert!(
            !c.read_found(7, 0, &mut out).await.unwrap(),
            "unwritten blob reported present"
        );
        assert!(
            out.iter().all(|b| *b == 0),
            "unwritten blob must read as zeros"
        );

        let data = pattern(7, 1, 4096);
        c.write(7, 8192, &data).await.unwrap();
        assert!(c.read_found(7, 8192, &mut out).await.unwrap());
        assert_eq!(out, data);
        // The untouched part of a partially written blob reads as zeros.
        assert!(c.read_found(7, 0, &mut out).await.unwrap());
        assert!(out.iter().all(|b| *b == 0));

        c.write(8, 0, &pattern(8, 1, blob)).await.unwrap();
        c.flush().await.unwrap();
        assert_eq!(c.remove(0, 8).await.unwrap(), 1, "only key 7 lies in 0..8");
        assert!(!c.read_found(7, 8192, &mut out).await.unwrap());
        let mut whole = vec![0; blob];
        assert!(c.read_found(8, 0, &mut whole).await.unwrap());
        assert_eq!(whole, pattern(8, 1, blob));
    });
}

#[test]
fn leases_alloc_commit_get_release() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let c = peer.client("a", SECRET_A);
    block_on(async {
        assert_eq!(c.get(3).await.unwrap(), None);
        let lease = c.alloc(3).await.unwrap();
        c.commit(3, lease.token).await.unwrap();
        let read_lease = c.get(3).await.unwrap().expect("committed blob is present");
        c.release(&[read_lease.token]).await.unwrap();
        // A token is single use: releasing it again breaks the protocol and
        // costs the connection.
        let e = c.release(&[read_lease.token]).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::Protocol), "{e}");
    });
    assert_eq!(peer.protocol_errors(), 1);
}

/// A REMOVE from another connection between ALLOC and COMMIT (a DISCARD
/// racing a write on another queue) is not the writer's fault: its COMMIT
/// answers LEASE_LOST, the connection stays, and nothing counts as a
/// protocol error.
#[test]
fn a_commit_after_a_racing_remove_answers_lease_lost_and_keeps_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let writer = peer.client("a", SECRET_A);
    let remover = peer.client("a", SECRET_A);
    block_on(async {
        writer.write(5, 0, b"before").await.unwrap();
        let epoch = writer.connection_epoch();
        let lease = writer.alloc(5).await.unwrap();
        assert_eq!(remover.remove(5, 6).await.unwrap(), 1);
        let e = writer.commit(5, lease.token).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
        assert!(e.to_string().contains("removed while leased"), "{e}");
        assert_eq!(writer.connection_epoch(), epoch, "the connection stayed");
        let mut out = [0u8; 6];
        assert!(
            !writer.read_found(5, 0, &mut out).await.unwrap(),
            "the remove won"
        );
        writer.write(5, 0, b"after!").await.unwrap();
        assert!(remover.read_found(5, 0, &mut out).await.unwrap());
        assert_eq!(&out, b"after!");
    });
    assert_eq!(peer.store.stats().leases_held, 0);
    assert_eq!(peer.protocol_errors(), 0);
}

#[test]
fn authentication_refuses_wrong_missing_and_cross_volume_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let err = |volume: &str, s: &str| {
        ArenaClient::connect(peer.config(volume, s))
            .err()
            .expect("connect must fail")
    };

    let e = err("a", "not-the-secret-of-anything");
    assert!(matches!(e, ArenaError::AuthFailed { .. }), "{e}");
    assert!(e.to_string().contains("volume \"a\""), "{e}");
    // Holding volume b's secret does not open volume a, and vice versa.
    assert!(matches!(err("a", SECRET_B), ArenaError::AuthFailed { .. }));
    assert!(matches!(err("b", SECRET_A), ArenaError::AuthFailed { .. }));
    // An unknown volume looks exactly like a wrong secret.
    assert!(matches!(
        err("nope", SECRET_A),
        ArenaError::AuthFailed { .. }
    ));
    assert_eq!(peer.metric("arenad_auth_failures_total", &[]), 4);
    assert_eq!(
        peer.metric(
            "arenad_ops_total",
            &[("op", "hello"), ("outcome", "denied")]
        ),
        4
    );
    assert_eq!(peer.protocol_errors(), 0, "a bad MAC is no protocol error");

    // A missing secret file is refused before anything is sent.
    let missing = target_rdma::auth::Secret::from_file(&dir.path().join("absent.key")).unwrap_err();
    assert!(missing.to_string().contains("absent.key"), "{missing}");

    // Volumes are isolated: b never sees a's blobs.
    let a = peer.client("a", SECRET_A);
    let b = peer.client("b", SECRET_B);
    block_on(async {
        a.write(1, 0, &pattern(1, 1, 512)).await.unwrap();
        let mut out = vec![0; 512];
        assert!(!b.read_found(1, 0, &mut out).await.unwrap());
    });
}

/// A hand-rolled peer for one connection: it sends a CHALLENGE, reads the
/// HELLO and answers a WELCOME whose MAC is made with `secret`, or left
/// zeroed when `secret` is `None` (an impostor). It then hands the open
/// socket back, answering nothing more.
fn fake_peer(
    secret_value: Option<&'static str>,
) -> (std::net::SocketAddr, std::thread::JoinHandle<TcpStream>) {
    fake_peer_version(secret_value, 2)
}

/// [`fake_peer`] offering only protocol `version` (1: untagged frames, so
/// a test can write answers by hand).
fn fake_peer_version(
    secret_value: Option<&'static str>,
    version: u16,
) -> (std::net::SocketAddr, std::thread::JoinHandle<TcpStream>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let ch = Challenge {
            min_version: version,
            max_version: version,
            server_nonce: [1; 32],
            max_inflight: 4,
            max_inline: 4096,
        };
        let mut f = Vec::new();
        ch.encode(&mut f);
        s.write_all(&f).unwrap();
        let mut body = Vec::new();
        let h = proto::read_frame(&mut s, &mut body).unwrap().unwrap();
        let hello = Hello::decode(&h, &body).unwrap();
        let mut w = proto::Welcome {
            session_id: 1,
            generation: 1,
            blob_bytes: 4096,
            caps: 1,
            quota_blobs: 1,
            epoch: 0,
            mac: [0; MAC_LEN],
        };
        if let Some(v) = secret_value {
            w.mac = secret(v).sign_welcome(&ch, &hello, &w);
        }
        w.encode(&mut f, hello.version);
        s.write_all(&f).unwrap();
        s
    });
    (addr, peer)
}

#[test]
fn the_client_refuses_an_impostor_peer() {
    // A peer that does not know the secret cannot produce WELCOME's MAC.
    let (addr, peer) = fake_peer(None);
    let cfg = target_rdma::client::ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
    let e = ArenaClient::connect(cfg).err().unwrap();
    assert!(matches!(e, ArenaError::PeerNotAuthentic { .. }), "{e}");
    peer.join().unwrap();
}

#[test]
fn connect_errors_name_the_peer() {
    let port = target_rdma::testing::free_port();
    let cfg =
        target_rdma::client::ClientConfig::new(format!("127.0.0.1:{port}"), "a", secret(SECRET_A));
    let e = ArenaClient::connect(cfg).err().unwrap();
    assert!(matches!(e, ArenaError::Connect { .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

/// Opens a raw authenticated session of volume "a" in `version` (2, or 3
/// with sealed bodies).
fn raw_session(peer: &Peer, version: u8) -> RawSession {
    RawSession::open(peer.addr, "a", &secret(SECRET_A), version, 0)
}

/// Sends `bytes` in a session of `version` (as the session's next frame,
/// tagged, or as they are when `tagged` is false), expects a PROTOCOL
/// error frame whose message contains `needle`, then the connection
/// closing.
fn expect_protocol_error(
    peer: &Peer,
    version: u8,
    bytes: &[u8],
    tagged: bool,
    needle: &str,
) -> Header {
    let mut s = raw_session(peer, version);
    if tagged {
        s.send(bytes).unwrap();
    } else {
        s.inject(bytes).unwrap();
    }
    let _ = s.stream.shutdown(std::net::Shutdown::Write);
    let (h, body) = s.recv().expect("an error frame");
    assert_eq!(h.status, Status::Protocol, "for {needle}");
    let msg = proto::decode_error(&body);
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
    assert!(
        s.recv().is_none(),
        "connection stayed open after a protocol error"
    );
    h
}

#[test]
fn malformed_frames_get_a_counted_error_and_only_their_connection_closes() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let bystander = peer.client("a", SECRET_A);
    block_on(bystander.write(1, 0, &pattern(1, 1, 4096))).unwrap();

    let mut good = Vec::new();
    proto::encode_request(&mut good, 1, &Request::Alloc { key: 1 });
    for version in [proto::VERSION_2, proto::VERSION_3] {
        malformed_frames_in(&peer, version, &good);
    }
    let errors = peer.protocol_errors();
    assert_eq!(errors, 20, "{}", peer.obs.telemetry().render().unwrap());

    // The bystander's session and data were untouched throughout.
    let mut out = vec![0; 4096];
    assert!(block_on(bystander.read_found(1, 0, &mut out)).unwrap());
    assert_eq!(out, pattern(1, 1, 4096));
}

/// Ten malformed frames, each in a session of `version` of its own.
fn malformed_frames_in(peer: &Peer, version: u8, good: &[u8]) {
    let expect_protocol_error = |bytes: &[u8], tagged: bool, needle: &str| {
        expect_protocol_error(peer, version, bytes, tagged, needle)
    };
    let good = good.to_vec();

    let mut b = good.clone();
    b[0] = b'Z';
    expect_protocol_error(&b, false, "bad magic");
    // A frame of the other tagged version, and a version-1 frame.
    let other = if version == proto::VERSION_2 { 3 } else { 2 };
    let mut b = good.clone();
    b[4] = other;
    expect_protocol_error(&b, false, &format!("unsupported protocol version {other}"));
    expect_protocol_error(&good, false, "unsupported protocol version 1");
    let mut b = good.clone();
    b[5] = 0x55;
    expect_protocol_error(&b, true, "unknown opcode 0x55");
    let mut b = good.clone();
    b[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
    // The error frame names the request it answers.
    let h = expect_protocol_error(&b, true, "exceeds the limit");
    assert_eq!((h.opcode, h.request_id), (Opcode::Alloc, 1));
    let mut b = good.clone();
    b[4] = version;
    expect_protocol_error(&b[..HEADER_LEN + 3], false, "truncated");
    let mut b = Vec::new();
    proto::encode_revoke(&mut b, 1, 1);
    expect_protocol_error(&b, true, "unexpected revoke");
    // Semantically bad requests: unknown lease token, COMMIT without ALLOC,
    // a range past the end of the blob.
    proto::encode_request(
        &mut b,
        5,
        &Request::Release {
            tokens: vec![12345],
        },
    );
    expect_protocol_error(&b, true, "12345");
    proto::encode_request(&mut b, 5, &Request::Commit { key: 9, token: 777 });
    expect_protocol_error(&b, true, "777");
    proto::encode_request(
        &mut b,
        5,
        &Request::Read {
            key: 1,
            offset: 64 << 10,
            len: 1,
        },
    );
    expect_protocol_error(&b, true, "65536");
}

#[test]
fn a_client_that_vanishes_mid_request_hurts_nobody() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let mut s = raw_session(&peer, proto::VERSION_2);
    let mut f = Vec::new();
    proto::encode_request(
        &mut f,
        1,
        &Request::Write {
            key: 3,
            offset: 0,
            data: &[7; 8192],
        },
    );
    s.inject(&f[..f.len() / 2]).unwrap();
    drop(s);
    let c = peer.client("a", SECRET_A);
    let mut out = vec![1; 8192];
    assert!(
        !block_on(c.read_found(3, 0, &mut out)).unwrap(),
        "a half-sent write must not land"
    );
    block_on(c.write(3, 0, &[9; 8192])).unwrap();
    assert!(block_on(c.read_found(3, 0, &mut out)).unwrap());
    assert_eq!(out, vec![9; 8192]);
}

#[test]
fn many_clients_many_requests_in_flight_no_mixups() {
    const CLIENTS: u64 = 8;
    const INFLIGHT: u64 = 32;
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 64 << 20,
            ..PeerOpts::default()
        },
    );
    let len = 16 << 10;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|ci| {
            let c = peer.client("a", SECRET_A);
            std::thread::spawn(move || {
                block_on(async {
                    for round in 0..3u64 {
                        let keys: Vec<u64> = (0..INFLIGHT).map(|i| ci * 1000 + i).collect();
                        let writes = keys.iter().map(|k| {
                            let c = c.clone();
                            let data = pattern(*k, round, len);
                            async move { c.write(*k, 0, &data).await }
                        });
                        for r in join_all(writes).await {
                            r.unwrap();
                        }
                        let reads = keys.iter().map(|k| {
                            let c = c.clone();
                            async move {
                                let mut out = vec![0; len];
                                c.read_found(*k, 0, &mut out).await.map(|_| (*k, out))
                            }
                        });
                        for r in join_all(reads).await {
                            let (k, out) = r.unwrap();
                            assert!(
                                out == pattern(k, round, len),
                                "key {k} round {round} mixed up"
                            );
                        }
                    }
                })
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn requests_time_out_and_say_so() {
    requests_time_out(false);
}

#[test]
fn requests_of_a_driven_client_time_out_on_its_ring() {
    requests_time_out(true);
}

fn requests_time_out(driven: bool) {
    // A peer that authenticates but never answers requests.
    let (addr, peer) = fake_peer(Some(SECRET_A));
    let mut cfg = target_rdma::client::ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
    cfg.request_timeout = Duration::from_millis(300);
    cfg.driven = driven;
    let c = if driven {
        target_rdma::testing::driven(cfg)
    } else {
        ArenaClient::connect(cfg).unwrap()
    };
    let _open = peer.join().unwrap();
    let e = block_on(c.flush()).unwrap_err();
    assert!(
        matches!(
            e,
            ArenaError::TimedOut {
                op: Opcode::Flush,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("timed out after 300ms"), "{e}");
    assert_eq!(client_counter(&c, names::REQUEST_TIMEOUTS), 1);
}

#[test]
fn a_peer_that_accepts_but_never_greets_is_a_named_handshake_timeout() {
    // What a client saw of an arenad still registering its arena: a
    // socket that accepts and says nothing.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let mut cfg = target_rdma::client::ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
    cfg.connect_timeout = Duration::from_millis(300);
    let e = ArenaClient::connect(cfg).map(drop).unwrap_err();
    assert_eq!(e.kind(), target_rdma::blob::ErrorKind::Connect, "{e}");
    assert_eq!(
        e.to_string(),
        format!(
            "cannot connect to arena peer {addr}: handshake (no answer from the peer; is it still \
             starting?) timed out after 0.3 s"
        )
    );
    drop(silent);
}

#[test]
fn pressure_revokes_leases_and_quota_is_a_status_not_a_disconnect() {
    let dir = tempfile::tempdir().unwrap();
    let opts = PeerOpts {
        arena_bytes: 2 * (64 << 10),
        quota_blobs: 3,
        ..PeerOpts::default()
    };
    let peer = Peer::start(dir.path(), opts);
    let c = peer.client("a", SECRET_A);
    block_on(async {
        let l1 = c.alloc(1).await.unwrap();
        let l2 = c.alloc(2).await.unwrap();
        // Both slots pinned, volume "a" past its share (one of two slots,
        // with volume "b" served): the third blob cannot get one, and the
        // peer asks the lease past the share back, the oldest.
        let e = c.alloc(3).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::Busy), "{e}");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut revoked = Vec::new();
        while revoked.is_empty() && std::time::Instant::now() < deadline {
            revoked.extend(c.take_revocations());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(revoked, vec![(1, l1.token)]);
        // Honouring the revocation frees the slot.
        c.commit(1, l1.token).await.unwrap();
        c.commit(2, l2.token).await.unwrap();
        c.write(3, 0, &[3; 16]).await.unwrap();
        // A fourth distinct blob exceeds the quota of 3: a status, the
        // session goes on.
        let e = c.write(4, 0, &[4; 16]).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::QuotaExceeded), "{e}");
        let mut out = [0u8; 16];
        assert!(c.read_found(3, 0, &mut out).await.unwrap());
        assert_eq!(out, [3; 16]);
    });
    assert_eq!(client_counter(&c, names::RECONNECTS), 0);
    assert_eq!(client_counter(&c, names::REVOCATIONS_RECEIVED), 1);
}

#[test]
fn the_client_reconnects_after_a_peer_restart_and_retries_idempotent_requests() {
    reconnects_after_a_peer_restart(false);
}

#[test]
fn a_driven_client_reconnects_after_a_peer_restart() {
    reconnects_after_a_peer_restart(true);
}

fn reconnects_after_a_peer_restart(driven: bool) {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let addr = peer.addr;
    let c = if driven {
        peer.driven_client("a", SECRET_A)
    } else {
        peer.client("a", SECRET_A)
    };
    block_on(async {
        c.write(1, 0, &[1; 4096]).await.unwrap();
        c.flush().await.unwrap();
    });
    peer.stop();
    let peer = Peer::start_at(dir.path(), PeerOpts::default(), &addr.to_string());
    let mut out = vec![0; 4096];
    assert!(
        block_on(c.read_found(1, 0, &mut out)).unwrap(),
        "flushed data after the restart"
    );
    assert_eq!(out, vec![1; 4096]);
    assert_eq!(client_counter(&c, names::RECONNECTS), 1);
    assert_eq!(client_counter(&c, names::PEER_RESTARTS), 1);
    // Everything was flushed before the restart, so FLUSH has nothing to report.
    block_on(c.flush()).unwrap();
    drop(peer);
}

#[test]
fn inline_payloads_are_counted_as_tcp_driver_statistics() {
    use ublk_metrics::driver::names::{TCP_PAYLOAD_BYTES, TCP_PAYLOAD_REQUESTS};
    use ublk_metrics::IoOp;

    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let cfg = peer.config("a", SECRET_A);
    let stats = std::sync::Arc::clone(&cfg.stats);
    // Two connections of one device share the counters.
    let (c1, c2) = (
        ArenaClient::connect(cfg.clone()).unwrap(),
        ArenaClient::connect(cfg).unwrap(),
    );
    block_on(async {
        c1.write(1, 0, &[1; 4096]).await.unwrap();
        c2.write(2, 0, &[2; 512]).await.unwrap();
        let mut out = vec![0; 1024];
        c1.read_found(1, 0, &mut out).await.unwrap();
        c2.read_found(99, 0, &mut out).await.unwrap(); // absent: a request, no payload
    });
    let snap = stats.snapshot();
    assert_eq!(snap.driver, "tcp");
    assert_eq!(snap.counter(TCP_PAYLOAD_REQUESTS, Some(IoOp::Write)), 2);
    assert_eq!(snap.counter(TCP_PAYLOAD_BYTES, Some(IoOp::Write)), 4608);
    assert_eq!(snap.counter(TCP_PAYLOAD_REQUESTS, Some(IoOp::Read)), 2);
    assert_eq!(snap.counter(TCP_PAYLOAD_BYTES, Some(IoOp::Read)), 1024);
}

/// A client's exported connection counter (`ublk_driver_<name>_total`).
fn client_counter(c: &ArenaClient, name: &str) -> u64 {
    let snap = c.stats().snapshot();
    assert!(snap.counters.iter().any(|v| v.name == name), "no {name}");
    snap.counter(name, None)
}

/// Reads one request frame from the client: its header.
fn next_request(s: &mut TcpStream) -> proto::Header {
    let mut body = Vec::new();
    proto::read_frame(s, &mut body).unwrap().unwrap()
}

/// A READ answer of `len` bytes to request `id`.
fn read_answer(id: u64, len: u32) -> Vec<u8> {
    let mut f = Vec::new();
    proto::encode_read_head(&mut f, id, len);
    f.resize(f.len() + len as usize, 0xab);
    f
}

#[test]
fn a_read_answer_of_another_length_fails_that_request_only() {
    let (addr, peer) = fake_peer_version(Some(SECRET_A), 1);
    let mut cfg = target_rdma::client::ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
    cfg.versions = 1..=1;
    let c = ArenaClient::connect(cfg).unwrap();
    let mut s = peer.join().unwrap();
    let client = c.clone();
    let reads = std::thread::spawn(move || {
        block_on(async {
            let mut out = vec![0; 512];
            let first = client.read_found(1, 0, &mut out).await;
            let second = client.read_found(1, 0, &mut out).await;
            (first, second)
        })
    });
    let h = next_request(&mut s);
    s.write_all(&read_answer(h.request_id, 100)).unwrap();
    let h = next_request(&mut s);
    s.write_all(&read_answer(h.request_id, 512)).unwrap();
    let (first, second) = reads.join().unwrap();
    let e = first.unwrap_err();
    assert!(matches!(e, ArenaError::Protocol { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("read body is 100 bytes, expected 512"),
        "{e}"
    );
    assert!(second.unwrap(), "the connection still serves");
    assert_eq!(client_counter(&c, names::LENGTH_MISMATCHES), 1);
    assert_eq!(client_counter(&c, names::RESPONSE_ID_MISMATCHES), 0);
    assert!(c.stats().snapshot().counter(names::FRAME_ERRORS, None) == 0);
}

#[test]
fn answers_to_requests_not_in_flight_are_mismatches_and_close_the_connection() {
    // An id never sent, then an answer whose opcode is not its request's.
    for wrong_op in [false, true] {
        let (addr, peer) = fake_peer_version(Some(SECRET_A), 1);
        let mut cfg =
            target_rdma::client::ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
        cfg.versions = 1..=1;
        let c = ArenaClient::connect(cfg).unwrap();
        let mut s = peer.join().unwrap();
        let client = c.clone();
        let flush = std::thread::spawn(move || block_on(client.flush()));
        let h = next_request(&mut s);
        assert_eq!(h.opcode, Opcode::Flush);
        let mut f = Vec::new();
        if wrong_op {
            proto::encode_ok(&mut f, Opcode::Commit, h.request_id);
        } else {
            proto::encode_ok(&mut f, Opcode::Flush, h.request_id + 1000);
        }
        s.write_all(&f).unwrap();
        let e = flush.join().unwrap().unwrap_err();
        assert!(matches!(e, ArenaError::Disconnected { .. }), "{e}");
        assert!(
            e.to_string().contains(if wrong_op {
                "commit answer to request id 1, which is a flush"
            } else {
                "flush answer to request id 1001, which is not in flight"
            }),
            "{e}"
        );
        assert_eq!(client_counter(&c, names::RESPONSE_ID_MISMATCHES), 1);
        assert_eq!(client_counter(&c, names::LATE_ANSWERS), 0);
        assert_eq!(c.stats().snapshot().counter(names::FRAME_ERRORS, None), 0);
    }
}

#[test]
fn a_late_answer_is_no_mismatch_and_a_bad_frame_is_a_frame_error() {
    let (addr, peer) = fake_peer_version(Some(SECRET_A), 1);
    let mut cfg = target_rdma::client::ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
    cfg.versions = 1..=1;
    cfg.request_timeout = Duration::from_millis(200);
    let c = ArenaClient::connect(cfg).unwrap();
    let mut s = peer.join().unwrap();
    let client = c.clone();
    let flush = std::thread::spawn(move || block_on(client.flush()));
    let h = next_request(&mut s);
    let e = flush.join().unwrap().unwrap_err();
    assert!(matches!(e, ArenaError::TimedOut { .. }), "{e}");
    let mut f = Vec::new();
    proto::encode_ok(&mut f, Opcode::Flush, h.request_id);
    s.write_all(&f).unwrap();
    // The late answer is read and counted; the connection stays up.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while client_counter(&c, names::LATE_ANSWERS) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "late answer not counted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(c.is_connected());
    assert_eq!(client_counter(&c, names::RESPONSE_ID_MISMATCHES), 0);
    // Then a frame with a bad magic: a frame error of its class.
    let mut bad = f.clone();
    bad[..4].copy_from_slice(b"XXXX");
    s.write_all(&bad).unwrap();
    while c.is_connected() {
        assert!(std::time::Instant::now() < deadline, "bad frame not seen");
        std::thread::sleep(Duration::from_millis(10));
    }
    let snap = c.stats().snapshot();
    let frame_errors: Vec<_> = snap
        .counters
        .iter()
        .filter(|v| v.name == names::FRAME_ERRORS)
        .map(|v| (v.reason.as_deref().unwrap_or_default(), v.value))
        .collect();
    assert_eq!(frame_errors, [("framing", 1)]);
    assert_eq!(client_counter(&c, names::RESPONSE_ID_MISMATCHES), 0);
}

/// TCP_INFO of a real connection to a real arenad reaches the links:
/// sampled at open, every 256 answers and at close.
#[test]
fn arena_connections_report_their_tcp_info() {
    use std::sync::Arc;
    use ublk_metrics::TcpLinks;

    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let mut cfg = peer.config("a", SECRET_A);
    let links = Arc::new(TcpLinks::default());
    cfg.tcp_links = Arc::clone(&links);
    let c = ArenaClient::connect(cfg).unwrap();
    block_on(async {
        c.write(1, 0, &[5; 4096]).await.unwrap();
        let mut out = vec![0; 4096];
        for _ in 0..300 {
            c.read_found(1, 0, &mut out).await.unwrap();
        }
    });
    let s = links.summary();
    assert_eq!(s.connections, 1, "{s:?}");
    assert!(s.rtt_max > 0.0 && s.rtt_mean > 0.0, "{s:?}");
    assert!(s.cwnd_min > 0.0 && s.cwnd_mean > 0.0, "{s:?}");
    c.disconnect();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while links.summary().connections != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "closed link still open"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Loopback loses nothing; the count survives the connection.
    assert_eq!(links.retransmissions(), 0);
}

/// Version 1 (no tags, no epochs) only where the operator allows it, and
/// never on a volume whose epoch was raised.
#[test]
fn version_1_sessions_only_with_allow_v1_and_only_below_any_epoch() {
    let v1 = |peer: &Peer, volume: &str, s: &str| {
        let mut cfg = peer.config(volume, s);
        cfg.versions = 1..=2;
        cfg
    };
    let dir = tempfile::tempdir().unwrap();
    let strict = Peer::start(dir.path(), PeerOpts::default());
    let e = RawSession::try_open(strict.addr, "a", &secret(SECRET_A), 1, 0)
        .err()
        .expect("v1 refused by default");
    assert_eq!(e.status, Status::VersionMismatch, "{}", e.message);
    // A client that accepts 1..=2 still gets 2 from a strict peer.
    let c = ArenaClient::connect(v1(&strict, "a", SECRET_A)).unwrap();
    assert_eq!(block_on(c.raise_epoch(1)).unwrap(), 1);
    drop((c, strict));

    let lenient = Peer::start(
        dir.path(),
        PeerOpts {
            allow_v1: true,
            ..PeerOpts::default()
        },
    );
    let mut only_v1 = v1(&lenient, "b", SECRET_B);
    only_v1.versions = 1..=1;
    let old = ArenaClient::connect(only_v1.clone()).unwrap();
    block_on(old.write(1, 0, b"v1 ok")).unwrap();
    let e = block_on(old.raise_epoch(2)).unwrap_err();
    assert_eq!(e.status(), Some(Status::VersionMismatch), "{e}");
    // Volume a's epoch (1, persisted by the strict peer) keeps v1 out.
    let mut a_v1 = only_v1.clone();
    a_v1.volume = "a".into();
    a_v1.secret = secret(SECRET_A);
    let e = ArenaClient::connect(a_v1).err().expect("v1 refused on a");
    assert_eq!(e.status(), Some(Status::VersionMismatch), "{e}");
    // Once b's epoch is raised, the v1 session is closed at its next op.
    let new = ArenaClient::connect(v1(&lenient, "b", SECRET_B)).unwrap();
    assert_eq!(block_on(new.raise_epoch(1)).unwrap(), 1);
    let e = block_on(old.write(1, 0, b"late!")).unwrap_err();
    assert!(e.to_string().contains("version 2"), "{e}");
}

/// A version-1 session refused because its volume's epoch was raised is
/// answered under the refused request's opcode and id (its client fails
/// that request with the reason, not an answer to nothing), and the
/// session ends.
#[test]
fn a_version_1_request_refused_after_a_raise_is_answered_under_its_own_id() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            allow_v1: true,
            ..PeerOpts::default()
        },
    );
    let mut old = RawSession::open(peer.addr, "a", &secret(SECRET_A), 1, 0);
    let new = peer.client("a", SECRET_A);
    assert_eq!(block_on(new.raise_epoch(1)).unwrap(), 1);
    let mut f = Vec::new();
    proto::encode_request(
        &mut f,
        42,
        &Request::Write {
            key: 1,
            offset: 0,
            data: b"late",
        },
    );
    old.send(&f).unwrap();
    let (h, body) = old.recv().expect("an error frame");
    let msg = proto::decode_error(&body);
    assert_eq!(
        (h.opcode, h.request_id, h.status),
        (Opcode::Write, 42, Status::VersionMismatch),
        "{msg}"
    );
    assert!(msg.contains("needs protocol version 2"), "{msg}");
    assert!(old.recv().is_none(), "the session ends");
    assert_eq!(
        peer.metric("arenad_protocol_errors_total", &[("class", "version")]),
        1
    );
    assert_eq!(
        peer.metric(
            "arenad_ops_total",
            &[("op", "write"), ("outcome", "denied")]
        ),
        1
    );
}

/// A HELLO naming a version the server does not offer is refused
/// `VERSION_MISMATCH`, whatever layout the rest of its body has: the
/// server reads the version field before it decodes the rest.
#[test]
fn a_hello_of_a_version_not_offered_is_a_version_mismatch_in_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    // (the layout the body has, the version its first two bytes name)
    for (layout, named) in [(2u16, 0u16), (1, 4), (2, u16::MAX)] {
        let mut s = TcpStream::connect(peer.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut body = Vec::new();
        let h = proto::read_frame(&mut s, &mut body).unwrap().unwrap();
        let ch = Challenge::decode(&h, &body).unwrap();
        let mut hello = Hello {
            version: layout,
            caps: proto::CAP_TCP_DATA,
            blob_bytes: 0,
            epoch: 0,
            client_nonce: [7; proto::NONCE_LEN],
            mac: [0; MAC_LEN],
            volume: "a".into(),
        };
        hello.mac = secret(SECRET_A).sign_hello(&ch, &hello);
        let mut f = Vec::new();
        hello.encode(&mut f);
        f[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&named.to_le_bytes());
        s.write_all(&f).unwrap();
        let h = proto::read_frame(&mut s, &mut body).unwrap().unwrap();
        let msg = proto::decode_error(&body);
        assert_eq!(
            (h.opcode, h.request_id, h.status),
            (Opcode::Hello, 0, Status::VersionMismatch),
            "version {named} in the version-{layout} layout: {msg}"
        );
        assert!(
            msg.contains(&format!(
                "client chose version {named}, server speaks 2..=3"
            )),
            "{msg}"
        );
    }
    assert_eq!(
        peer.metric("arenad_protocol_errors_total", &[("class", "version")]),
        3
    );
}
