//! Two RDMA rails. arenad (`rdma_rails`): a session connects a QP on each,
//! every lease answer carries a key per rail, each key works only through
//! its own rail, losing one rail keeps the other's keys, and single-rail
//! peers and clients keep the formats they had. The client (a transport on
//! two devices): both rails carry payloads, large ones striped, a lost
//! rail's transfers move to the other and the rail comes back.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::executor::block_on;
use target_rdma::blob::{ArenaError, BlobIo, Via};
use target_rdma::client::{ArenaClient, RdmaTransport, RdmaTransportConfig};
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

// --- The client: a transport on two rails ---

fn transport_cfg() -> RdmaTransportConfig {
    RdmaTransportConfig {
        min_rdma_bytes: 512,
        buffer_bytes: BLOB,
        pool_buffers: 4,
        stripe_bytes: 32 << 10,
        lease_cache: 0,
        op_timeout: Duration::from_secs(2),
        ..RdmaTransportConfig::default()
    }
}

fn rail(t: &RdmaTransport, i: usize) -> (u64, u64, u64) {
    let r = &t.stats().rails[i];
    (
        r.transfers.load(Ordering::Relaxed),
        r.bytes.load(Ordering::Relaxed),
        r.lost.load(Ordering::Relaxed),
    )
}

fn tcp_payloads(t: &RdmaTransport) -> u64 {
    t.stats()
        .per_op
        .iter()
        .flat_map(|o| o.tcp.iter())
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
}

fn two_rail_transport(
    devices: &[Arc<dyn RdmaProvider>; 2],
    served: Vec<Arc<dyn RdmaProvider>>,
) -> (Peer, RdmaTransport, tempfile::TempDir) {
    let (peer, dir) = peer_on(served);
    let t = RdmaTransport::connect(
        peer.config("a", SECRET_A),
        devices.iter().cloned().map(Ok).collect(),
        transport_cfg(),
    )
    .unwrap();
    (peer, t, dir)
}

/// Small payloads take turns on the two rails; one of at least
/// `stripe_bytes` moves half on each; everything reads back.
#[test]
fn both_rails_carry_payloads_and_large_ones_are_striped() {
    let devices = two_devices();
    let (_peer, t, _dir) = two_rail_transport(&devices, devices.to_vec());
    assert_eq!(
        t.rdma_status().unwrap(),
        format!("{}+{}", devices[0].device_name(), devices[1].device_name())
    );
    for k in 0..8u64 {
        assert_eq!(
            block_on(t.write(k, 0, &pattern(k, 1, 4096))).unwrap(),
            Via::Rdma
        );
    }
    let (small0, small1) = (rail(&t, 0).0, rail(&t, 1).0);
    assert!(
        small0 >= 2 && small1 >= 2,
        "both rails carried 4 KiB payloads: {small0} {small1}"
    );

    let whole = pattern(9, 1, BLOB as usize);
    assert_eq!(block_on(t.write(9, 0, &whole)).unwrap(), Via::Rdma);
    let mut out = vec![0; BLOB as usize];
    assert_eq!(block_on(t.read(9, 0, &mut out)).unwrap(), Via::Rdma);
    assert!(out == whole, "the striped blob reads back");
    assert_eq!(t.stats().striped.load(Ordering::Relaxed), 2);
    assert_eq!(
        (rail(&t, 0).1 - 8 * 4096 + rail(&t, 1).1) % 4096,
        0,
        "halves are whole pages"
    );
    for k in 0..8u64 {
        let mut out = vec![0; 4096];
        assert_eq!(block_on(t.read(k, 0, &mut out)).unwrap(), Via::Rdma);
        assert!(out == pattern(k, 1, 4096), "key {k}");
    }
    assert_eq!(tcp_payloads(&t), 0, "nothing went over TCP");
}

/// A rail whose transfers fail is lost: what it carried moves to the other
/// rail (no request fails, none goes over TCP), and it comes back by
/// itself: brought up again by a later request, proven by one transfer,
/// then carrying its share again.
#[test]
fn a_lost_rail_hands_its_transfers_to_the_other_and_comes_back() {
    let [a, b] = [LoopbackProvider::new(), LoopbackProvider::new()];
    let devices = [
        a as Arc<dyn RdmaProvider>,
        b.clone() as Arc<dyn RdmaProvider>,
    ];
    let (_peer, t, _dir) = two_rail_transport(&devices, devices.to_vec());
    // Rail 1's next post fails as on a dead link (retries exhausted).
    b.inject(wc_status::RETRY_EXC_ERR);
    for k in 0..8u64 {
        assert_eq!(
            block_on(t.write(k, 0, &pattern(k, 2, 4096))).unwrap(),
            Via::Rdma,
            "key {k}"
        );
    }
    let whole = pattern(20, 2, BLOB as usize);
    assert_eq!(block_on(t.write(20, 0, &whole)).unwrap(), Via::Rdma);
    assert!(rail(&t, 1).2 >= 1, "rail 1 was lost");
    assert_eq!(
        tcp_payloads(&t),
        0,
        "no payload went over TCP while rail 0 was up"
    );
    // It comes back: its QP is brought up again and carries payloads.
    let before = rail(&t, 1).0;
    for k in 30..60u64 {
        block_on(t.write(k, 0, &pattern(k, 2, 4096))).unwrap();
        if rail(&t, 1).0 > before + 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(rail(&t, 1).0 > before + 2, "rail 1 carries payloads again");
    let mut out = vec![0; BLOB as usize];
    block_on(t.read(20, 0, &mut out)).unwrap();
    assert!(out == whole);
    for k in 0..8u64 {
        let mut out = vec![0; 4096];
        block_on(t.read(k, 0, &mut out)).unwrap();
        assert!(out == pattern(k, 2, 4096), "key {k}");
    }
    assert_eq!(tcp_payloads(&t), 0);
}

/// A peer with one rail gives a two-rail client one rail: rail 1 is off
/// (counted as a failed rail setup, its reason shown), payloads go by
/// rail 0, none by TCP.
#[test]
fn a_one_rail_peer_gives_a_two_rail_client_one_rail() {
    let devices = two_devices();
    let (_peer, t, _dir) = two_rail_transport(&devices, vec![devices[0].clone()]);
    assert_eq!(t.rdma_status().unwrap(), devices[0].device_name());
    assert_eq!(t.stats().rail_connect_failures.load(Ordering::Relaxed), 1);
    let whole = pattern(1, 3, BLOB as usize);
    assert_eq!(block_on(t.write(1, 0, &whole)).unwrap(), Via::Rdma);
    let mut out = vec![0; BLOB as usize];
    assert_eq!(block_on(t.read(1, 0, &mut out)).unwrap(), Via::Rdma);
    assert!(out == whole);
    assert_eq!((rail(&t, 1).0, tcp_payloads(&t)), (0, 0));
    assert_eq!(t.stats().striped.load(Ordering::Relaxed), 0);
}

/// Both rails lost: payloads go over TCP, counted as a failover, and the
/// data is right.
#[test]
fn with_both_rails_lost_payloads_fail_over_to_tcp() {
    let [a, b] = [LoopbackProvider::new(), LoopbackProvider::new()];
    let devices = [
        a.clone() as Arc<dyn RdmaProvider>,
        b.clone() as Arc<dyn RdmaProvider>,
    ];
    let (_peer, t, _dir) = two_rail_transport(&devices, devices.to_vec());
    for _ in 0..8 {
        a.inject(wc_status::RETRY_EXC_ERR);
        b.inject(wc_status::RETRY_EXC_ERR);
    }
    let data = pattern(5, 4, 4096);
    let via = block_on(t.write(5, 0, &data)).unwrap();
    assert!(matches!(via, Via::Failover | Via::Rdma), "{via:?}");
    let mut out = vec![0; 4096];
    block_on(t.read(5, 0, &mut out)).unwrap();
    assert!(out == data);
}

/// A striped payload whose half fails on one rail moves that half on the
/// other rail: the request succeeds by RDMA and reads back whole.
#[test]
fn a_striped_half_that_fails_moves_on_the_other_rail() {
    let [a, b] = [LoopbackProvider::new(), LoopbackProvider::new()];
    let devices = [
        a as Arc<dyn RdmaProvider>,
        b.clone() as Arc<dyn RdmaProvider>,
    ];
    let (_peer, t, _dir) = two_rail_transport(&devices, devices.to_vec());
    for k in 0..4u64 {
        block_on(t.write(k, 0, &pattern(k, 5, 4096))).unwrap();
    }
    assert!(rail(&t, 0).0 > 0 && rail(&t, 1).0 > 0, "both rails proven");
    b.inject(wc_status::RETRY_EXC_ERR);
    let whole = pattern(7, 5, BLOB as usize);
    assert_eq!(block_on(t.write(7, 0, &whole)).unwrap(), Via::Rdma);
    assert_eq!(t.stats().striped.load(Ordering::Relaxed), 1);
    assert_eq!(rail(&t, 1).2, 1, "rail 1 was lost");
    let mut out = vec![0; BLOB as usize];
    assert_eq!(block_on(t.read(7, 0, &mut out)).unwrap(), Via::Rdma);
    assert!(out == whole);
    assert_eq!(tcp_payloads(&t), 0);
}

/// The one try of an unproven rail is given back however the request that
/// took it ends: a read of a blob that does not exist moves nothing, and
/// the rail is tried (and proven) by the next payload.
#[test]
fn a_request_that_moves_nothing_gives_the_rails_try_back() {
    let devices = two_devices();
    let (_peer, t, _dir) = two_rail_transport(&devices, devices.to_vec());
    block_on(t.write(1, 0, &pattern(1, 6, 4096))).unwrap();
    assert_eq!(
        (rail(&t, 0).0, rail(&t, 1).0),
        (1, 0),
        "rail 0 proven first"
    );
    let mut out = vec![0; 4096];
    assert_eq!(block_on(t.read(99, 0, &mut out)).unwrap(), Via::Nothing);
    for k in 2..6u64 {
        block_on(t.write(k, 0, &pattern(k, 6, 4096))).unwrap();
    }
    assert!(rail(&t, 1).0 > 0, "rail 1 was tried and carries payloads");
}

/// A request abandoned while its transfer is in flight takes its bytes
/// off the rail's outstanding count (else the rail would look busy for
/// good and carry nothing).
#[test]
fn an_abandoned_transfer_leaves_nothing_outstanding() {
    let [a, b] = [LoopbackProvider::new(), LoopbackProvider::new()];
    let devices = [
        a.clone() as Arc<dyn RdmaProvider>,
        b.clone() as Arc<dyn RdmaProvider>,
    ];
    let (_peer, t, _dir) = two_rail_transport(&devices, devices.to_vec());
    a.delay_completions(Duration::from_secs(2));
    b.delay_completions(Duration::from_secs(2));
    let outstanding = |t: &RdmaTransport| -> u64 {
        t.stats()
            .rails
            .iter()
            .map(|r| r.outstanding.load(Ordering::Relaxed))
            .sum()
    };
    let data = pattern(1, 7, 4096);
    block_on(async {
        let mut write = std::pin::pin!(t.write(1, 0, &data));
        for _ in 0..200 {
            assert!(futures::poll!(write.as_mut()).is_pending());
            if outstanding(&t) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(outstanding(&t), 4096, "the transfer is in flight");
    });
    assert_eq!(outstanding(&t), 0);
}
