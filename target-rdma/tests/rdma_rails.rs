//! arenad serving two rails (`rdma_rails`): a session connects a QP on
//! each, every lease answer carries a key per rail, each key works only
//! through its own rail, losing one rail keeps the other's keys, and
//! single-rail peers and clients keep the formats they had.

use std::sync::Arc;

use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::ArenaClient;
use target_rdma::proto::{
    self, Opcode, Request, Status, CAP_RAILS, CAP_RDMA, CAP_RDMA_LEASE_KEYS, CAP_TCP_DATA,
    RAIL_CONNECT_BODY, VERSION_2,
};
use target_rdma::rdma::loopback::LoopbackProvider;
use target_rdma::rdma::{wc_status, RdmaOp, RdmaProvider};
use target_rdma::testing::*;

const BLOB: u32 = 64 << 10;

fn peer_on(rails: Vec<Arc<dyn RdmaProvider>>) -> (Peer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(
        dir.path(),
        PeerOpts {
            arena_bytes: 16 * u64::from(BLOB),
            blob_bytes: BLOB,
            rdma: rails,
            ..PeerOpts::default()
        },
    );
    (peer, dir)
}

fn rdma_client(peer: &Peer) -> ArenaClient {
    let mut c = peer.config("a", SECRET_A);
    c.offer_rdma = true;
    c.blob_bytes = BLOB;
    ArenaClient::connect(c).unwrap()
}

fn two_devices() -> [Arc<dyn RdmaProvider>; 2] {
    [LoopbackProvider::new(), LoopbackProvider::new()]
}

/// One blob written through rail 1 with rail 1's key is read back through
/// rail 0 with rail 0's key; a key used on the other rail is refused (it
/// belongs to that rail's protection domain only).
#[test]
fn each_rail_has_its_own_key_to_the_same_slot() {
    let [a, b] = two_devices();
    let (peer, _dir) = peer_on(vec![a.clone(), b.clone()]);
    let c = rdma_client(&peer);
    assert_eq!(c.welcome().unwrap().caps & CAP_RAILS, CAP_RAILS);
    let mut rail0 = RawRail::up(&a, &c, 0, BLOB);
    let mut rail1 = RawRail::up(&b, &c, 1, BLOB);
    assert_eq!((rail0.accept.rkey, rail1.accept.rkey), (0, 0));

    let w = block_on(c.alloc(3)).unwrap();
    let [Some(_), Some(k1)] = w.rkeys else {
        panic!("an ALLOC answer on two rails carries two keys: {w:?}");
    };
    let data = pattern(3, 1, BLOB as usize);
    rail1.local().copy_from_slice(&data);
    assert_eq!(
        rail1.one_sided(RdmaOp::Write, w.slot_offset, k1, BLOB),
        wc_status::SUCCESS
    );
    block_on(c.commit(3, w.token)).unwrap();

    let r = block_on(c.get(3)).unwrap().expect("the blob");
    let [Some(r0), Some(_)] = r.rkeys else {
        panic!("a GET answer on two rails carries two keys: {r:?}");
    };
    assert_eq!(
        rail0.one_sided(RdmaOp::Read, r.slot_offset, r0, BLOB),
        wc_status::SUCCESS
    );
    assert!(
        rail0.local() == data,
        "read through rail 0 what rail 1 wrote"
    );
    // A refused access also breaks the QP it came through (as rxe does):
    // this check comes last.
    assert_ne!(
        rail0.one_sided(RdmaOp::Read, w.slot_offset, k1, BLOB),
        wc_status::SUCCESS,
        "rail 1's key does not work through rail 0"
    );
    block_on(c.release(&[r.token])).unwrap();
    assert_eq!(peer.protocol_errors(), 0);
}

/// Replacing the QP of one rail deregisters that rail's keys only: the
/// other rail's key to a held lease keeps working, and a lease granted
/// after the replacement is keyed on both rails again.
#[test]
fn replacing_one_rail_keeps_the_other_rails_keys() {
    let [a, b] = two_devices();
    let (peer, _dir) = peer_on(vec![a.clone(), b.clone()]);
    let c = rdma_client(&peer);
    let _rail0 = RawRail::up(&a, &c, 0, BLOB);
    let rail1 = RawRail::up(&b, &c, 1, BLOB);
    let held = block_on(c.alloc(1)).unwrap();
    let [Some(old0), Some(k1)] = held.rkeys else {
        panic!("two keys: {held:?}");
    };

    let rail0 = RawRail::up(&a, &c, 0, BLOB);
    assert_ne!(
        rail0.one_sided(RdmaOp::Read, held.slot_offset, old0, BLOB),
        wc_status::SUCCESS,
        "the replaced rail's key died with it"
    );
    assert_eq!(
        rail1.one_sided(RdmaOp::Write, held.slot_offset, k1, BLOB),
        wc_status::SUCCESS,
        "the other rail's key lives on"
    );
    // The refused access broke that QP (as rxe does): up again.
    let rail0 = RawRail::up(&a, &c, 0, BLOB);
    let again = block_on(c.alloc(2)).unwrap();
    let [Some(k0), Some(_)] = again.rkeys else {
        panic!("two keys again: {again:?}");
    };
    assert_eq!(
        rail0.one_sided(RdmaOp::Write, again.slot_offset, k0, BLOB),
        wc_status::SUCCESS
    );
    block_on(c.commit(1, held.token)).unwrap();
    block_on(c.commit(2, again.token)).unwrap();
    assert_eq!(peer.protocol_errors(), 0);
}

/// A peer serving one rail grants `CAP_RAILS` all the same: rail 1 is
/// answered NOT_FOUND naming how many rails it serves, rail 0 works, and
/// lease answers carry rail 0's key only. The session goes on.
#[test]
fn a_peer_with_one_rail_answers_rail_1_not_found() {
    let [a, b] = two_devices();
    let (peer, _dir) = peer_on(vec![a.clone()]);
    let c = rdma_client(&peer);
    assert_eq!(c.welcome().unwrap().caps & CAP_RAILS, CAP_RAILS);
    let qp = b.domain().create_qp(4).unwrap();
    match block_on(c.rail_connect(1, qp.endpoint())) {
        Err(ArenaError::Status {
            status: Status::NotFound,
            message,
            ..
        }) => assert!(
            message.contains("rail 1 is not served") && message.contains("serves 1 of its 1"),
            "{message}"
        ),
        other => panic!("rail 1 of a one-rail peer: {other:?}"),
    }
    let _rail0 = RawRail::up(&a, &c, 0, BLOB);
    let l = block_on(c.alloc(1)).unwrap();
    assert!(matches!(l.rkeys, [Some(_), None]), "{l:?}");
    block_on(c.commit(1, l.token)).unwrap();
    assert_eq!(peer.protocol_errors(), 0);
}

/// A client that does not offer `CAP_RAILS` (one from before rails) gets
/// the formats it knows from a two-rail peer: its 28-byte RAIL_CONNECT is
/// rail 0 and its lease answers are 20 bytes with rail 0's key. Naming a
/// rail without the capability is a protocol error that ends the session.
#[test]
fn a_client_without_rails_keeps_its_formats() {
    let [a, b] = two_devices();
    let (peer, _dir) = peer_on(vec![a.clone(), b.clone()]);
    let open = || {
        RawSession::try_open_offering(
            peer.addr,
            "a",
            &secret(SECRET_A),
            VERSION_2,
            0,
            CAP_TCP_DATA | CAP_RDMA | CAP_RDMA_LEASE_KEYS,
        )
        .unwrap()
    };
    let mut s = open();
    assert_eq!(s.welcome.caps & CAP_RAILS, 0);
    let qp = a.domain().create_qp(4).unwrap();
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
    let (h, _) = s.recv().expect("the RAIL_CONNECT answer");
    assert_eq!((h.opcode, h.status), (Opcode::RailConnect, Status::Ok));
    proto::encode_request(&mut f, 2, &Request::Alloc { key: 1 });
    s.send(&f).unwrap();
    let (h, body) = s.recv().expect("the ALLOC answer");
    assert_eq!((h.status, body.len()), (Status::Ok, 20));
    assert!(proto::decode_lease(&h, &body).unwrap().rkeys[0].is_some());

    let mut s = open();
    let qp = b.domain().create_qp(4).unwrap();
    proto::encode_request(
        &mut f,
        1,
        &Request::RailConnect {
            endpoint: qp.endpoint(),
            rail: Some(1),
        },
    );
    assert_eq!(f.len(), proto::HEADER_LEN + RAIL_CONNECT_BODY);
    s.send(&f).unwrap();
    let (h, body) = s.recv().expect("the refusal");
    assert_eq!(h.status, Status::Protocol);
    let msg = proto::decode_error(&body);
    assert!(msg.contains("CAP_RAILS"), "{msg}");
    assert!(s.recv().is_none(), "the session ended");
    assert_eq!(peer.protocol_errors(), 1);
}
