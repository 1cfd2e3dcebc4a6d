//! Confidential sessions (protocol version 3): every frame body sealed
//! with AES-256-GCM. What crosses the wire is looked at from a relay
//! between the client and the peer, as anyone on the path would. A
//! confidential volume (arenad `[[volume]] confidential = true`) takes
//! only such sessions, and says so only to a client that proved its
//! secret.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::thread;

use common::*;
use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::tcp::{ArenaClient, ClientConfig};
use target_rdma::proto::{
    self, Challenge, Opcode, Request, Status, CAP_RAILS, CAP_RDMA, CAP_RDMA_LEASE_KEYS,
    CAP_TCP_DATA, VERSION_1, VERSION_2, VERSION_3,
};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::RdmaProvider;
use target_rdma::testing::relay::{leaks, Relay, Seen};

/// Writes and reads back a small and a large payload through a relay, and
/// returns the payloads and what the relay saw.
fn through_relay(peer: &Peer, confidential: bool, driven: bool) -> (Vec<Vec<u8>>, Seen) {
    let relay = Relay::start(peer.addr);
    let mut cfg: ClientConfig = peer.config("a", SECRET_A);
    cfg.peer = relay.addr.to_string();
    cfg.confidential = confidential;
    cfg.driven = driven;
    let c = if driven {
        target_rdma::testing::driven(cfg)
    } else {
        ArenaClient::connect(cfg).unwrap()
    };
    // A 4 KiB payload (read from the reader's buffer) and a whole 64 KiB
    // blob (a large body, which a tagged session lands in place).
    let payloads = vec![pattern(1, 3, 4096), pattern(2, 5, 64 << 10)];
    for (key, p) in payloads.iter().enumerate() {
        block_on(c.write(key as u64 + 1, 0, p)).unwrap();
    }
    for (key, p) in payloads.iter().enumerate() {
        let mut out = vec![0u8; p.len()];
        assert!(block_on(c.read_found(key as u64 + 1, 0, &mut out)).unwrap());
        assert_eq!(&out, p, "key {} read back", key + 1);
    }
    drop(c);
    let conns = relay.seen();
    assert_eq!(conns.len(), 1, "one session");
    let seen = std::mem::take(&mut *conns[0].lock().unwrap());
    (payloads, seen)
}

#[test]
fn a_confidential_session_never_shows_its_payloads_on_the_wire() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    for driven in [false, true] {
        let (payloads, seen) = through_relay(&peer, true, driven);
        for p in &payloads {
            assert!(
                !leaks(&seen.to_peer, p),
                "a WRITE's payload crossed readable"
            );
            assert!(
                !leaks(&seen.to_client, p),
                "a READ's payload crossed readable"
            );
        }
        // The frames after the handshake carry the session's version 3.
        assert!(seen.to_peer.len() > (64 << 10) + 4096);
    }
    // The same traffic in a session that is not confidential shows the
    // payloads both ways: what the check above would have caught.
    let (payloads, seen) = through_relay(&peer, false, false);
    for p in &payloads {
        assert!(leaks(&seen.to_peer, p) && leaks(&seen.to_client, p));
    }
}

#[test]
fn a_confidential_client_refuses_a_peer_without_sealed_frames() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let ch = Challenge {
            min_version: u16::from(VERSION_2),
            max_version: u16::from(VERSION_2),
            server_nonce: [1; 32],
            max_inflight: 4,
            max_inline: 4096,
        };
        let mut f = Vec::new();
        ch.encode(&mut f);
        s.write_all(&f).unwrap();
        // The client leaves without a HELLO.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let mut cfg = ClientConfig::new(addr.to_string(), "a", secret(SECRET_A));
    cfg.confidential = true;
    match ArenaClient::connect(cfg) {
        Err(ArenaError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, Status::VersionMismatch);
            assert!(
                message.contains("a confidential volume needs version 3"),
                "{message}"
            );
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a confidential session over version 2"),
    }
    assert!(server.join().unwrap().is_empty(), "no HELLO was sent");
}

#[test]
fn an_altered_sealed_frame_ends_its_session_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    let bystander = peer.client("a", SECRET_A);
    block_on(bystander.write(1, 0, b"kept")).unwrap();

    let mut s = RawSession::open(peer.addr, "a", &secret(SECRET_A), VERSION_3, 0);
    // A well-sealed GET is answered, and the answer opens.
    let mut f = Vec::new();
    proto::encode_request(&mut f, 6, &Request::Get { key: 1 });
    s.send(&f).unwrap();
    let (h, _) = s.recv().expect("the GET is answered");
    assert_eq!((h.opcode, h.status), (Opcode::Get, Status::Ok));

    // The next frame sealed right, then one bit of its ciphertext flipped
    // on the way.
    let mut f = Vec::new();
    proto::encode_request(
        &mut f,
        7,
        &Request::Write {
            key: 1,
            offset: 0,
            data: b"evil",
        },
    );
    f[4] = VERSION_3;
    let key = s.client_key().expect("a sealed session");
    let (header, body) = f.split_at_mut(proto::HEADER_LEN);
    let header: &[u8; proto::HEADER_LEN] = (&*header).try_into().unwrap();
    let tag = key.protect(1, header, body);
    f.extend_from_slice(&tag);
    f[proto::HEADER_LEN + 20] ^= 1;
    s.inject(&f).unwrap();
    let (h, body) = s.recv().expect("an error frame, itself sealed");
    assert_eq!(h.status, Status::Protocol);
    let msg = proto::decode_error(&body);
    assert!(msg.contains("authentication tag"), "{msg}");
    assert!(s.recv().is_none(), "the session ends");

    let mut out = [0u8; 4];
    assert!(block_on(bystander.read_found(1, 0, &mut out)).unwrap());
    assert_eq!(&out, b"kept", "the altered WRITE did nothing");
    assert_eq!(peer.protocol_errors(), 1);
}

/// A peer serving "a" to sealed sessions only, "b" to any (and version 1
/// allowed, so that refusal is the volume's, not the peer's offer).
fn confidential_a(dir: &std::path::Path) -> Peer {
    Peer::start(
        dir,
        PeerOpts {
            confidential: vec!["a".into()],
            allow_v1: true,
            ..PeerOpts::default()
        },
    )
}

#[test]
fn a_confidential_volume_takes_only_sealed_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let peer = confidential_a(dir.path());

    // A version-2 client with the right secret is told why, and nothing
    // is opened.
    match ArenaClient::connect(peer.config("a", SECRET_A)) {
        Err(ArenaError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, Status::VersionMismatch, "{message}");
            assert_eq!(
                message,
                "volume \"a\" is confidential: it takes only sealed sessions \
                 (protocol version 3), not version 2"
            );
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a version-2 session of a confidential volume"),
    }
    // So is a version-1 HELLO, though the peer offers version 1.
    let r = RawSession::try_open(peer.addr, "a", &secret(SECRET_A), VERSION_1, 0)
        .err()
        .expect("a version-1 session of a confidential volume");
    assert_eq!(r.status, Status::VersionMismatch, "{}", r.message);
    assert!(r.message.contains("not version 1"), "{}", r.message);
    assert_eq!(peer.sessions(), 0);
    assert_eq!(
        peer.metric("arenad_protocol_errors_total", &[("class", "version")]),
        2
    );
    assert_eq!(
        peer.metric(
            "arenad_ops_total",
            &[("op", "hello"), ("outcome", "denied")]
        ),
        2
    );
    assert_eq!(peer.metric("arenad_auth_failures_total", &[]), 0);

    // A confidential client is served, thread and driven alike.
    for driven in [false, true] {
        let mut cfg = peer.config("a", SECRET_A);
        cfg.confidential = true;
        cfg.driven = driven;
        let c = if driven {
            target_rdma::testing::driven(cfg)
        } else {
            ArenaClient::connect(cfg).expect("a sealed session of a confidential volume")
        };
        let key = u64::from(driven) + 1;
        let data = pattern(key, 1, 64 << 10);
        block_on(c.write(key, 0, &data)).unwrap();
        let mut out = vec![0u8; data.len()];
        assert!(block_on(c.read_found(key, 0, &mut out)).unwrap());
        assert_eq!(out, data);
    }
    // A raw version-3 HELLO is accepted too.
    let s = RawSession::open(peer.addr, "a", &secret(SECRET_A), VERSION_3, 0);
    assert_eq!(s.version, VERSION_3);
    drop(s);

    // The other volume still takes version 2, and sealed sessions too.
    let b = peer.client("b", SECRET_B);
    block_on(b.write(1, 0, b"plain")).unwrap();
    let mut cfg = peer.config("b", SECRET_B);
    cfg.confidential = true;
    let sealed_b = ArenaClient::connect(cfg).unwrap();
    let mut out = [0u8; 5];
    assert!(block_on(sealed_b.read_found(1, 0, &mut out)).unwrap());
    assert_eq!(&out, b"plain");
    assert_eq!(
        peer.metric("arenad_protocol_errors_total", &[("class", "version")]),
        2,
        "nothing more refused"
    );
}

#[test]
fn a_client_without_the_secret_cannot_tell_a_confidential_volume_from_none() {
    let dir = tempfile::tempdir().unwrap();
    let peer = confidential_a(dir.path());
    let wrong = secret("not-the-secret-of-anything-at-all");

    // On the wire: the same error frame for a wrong secret to the
    // confidential volume (whichever version the HELLO names), to a
    // plain volume, and for a volume that does not exist.
    let refusal = |volume: &str, version: u8| {
        let r = RawSession::try_open(peer.addr, volume, &wrong, version, 0)
            .err()
            .expect("refused");
        (r.status, r.message)
    };
    let unknown = refusal("nope", VERSION_2);
    assert_eq!(
        unknown,
        (Status::AuthFailed, "authentication failed".to_owned())
    );
    for version in [VERSION_1, VERSION_2, VERSION_3] {
        assert_eq!(refusal("a", version), unknown, "version {version}");
        assert_eq!(refusal("nope", version), unknown, "version {version}");
    }
    assert_eq!(refusal("b", VERSION_2), unknown);

    // Through the client: AUTH_FAILED, never VERSION_MISMATCH.
    for confidential in [false, true] {
        for volume in ["a", "nope"] {
            let mut cfg = peer.config(volume, "not-the-secret-of-anything-at-all");
            cfg.confidential = confidential;
            let e = ArenaClient::connect(cfg).err().expect("refused");
            assert!(
                matches!(e, ArenaError::AuthFailed { .. }),
                "{volume}, confidential {confidential}: {e}"
            );
        }
    }
    assert_eq!(peer.metric("arenad_auth_failures_total", &[]), 12);
    assert_eq!(peer.protocol_errors(), 0, "no refusal of a version");
}

/// One-sided RDMA would carry a sealed session's payloads around the seal,
/// in the clear: a version-3 HELLO that offers it anyway is granted none
/// of the RDMA capabilities, where a version-2 one on the same peer gets
/// them.
#[test]
fn a_sealed_session_is_granted_no_rdma() {
    let dir = tempfile::tempdir().unwrap();
    let rail: Arc<dyn RdmaProvider> = LoopbackProvider::new();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            rdma: vec![rail],
            ..PeerOpts::default()
        },
    );
    let rdma = CAP_RDMA | CAP_RDMA_LEASE_KEYS | CAP_RAILS;
    let open = |version| {
        RawSession::try_open_offering(
            peer.addr,
            "a",
            &secret(SECRET_A),
            version,
            0,
            CAP_TCP_DATA | rdma,
        )
        .unwrap()
    };
    assert_eq!(
        open(VERSION_2).welcome.caps & CAP_RDMA,
        CAP_RDMA,
        "this peer grants RDMA to a tagged session"
    );
    let sealed = open(VERSION_3);
    assert_eq!(sealed.welcome.caps & rdma, 0, "RDMA for a sealed session");
    assert_eq!(sealed.welcome.caps & CAP_TCP_DATA, CAP_TCP_DATA);
}
