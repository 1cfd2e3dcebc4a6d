//! Membership epochs over TCP: what a raise leaves a fenced-out writer
//! (its inline writes and its leases), the epoch no writer may hold, and
//! who may present the volume's current epoch (docs/PROTOCOL.md,
//! *Membership epochs*). The RDMA side of the fence is in `rdma_transport`.

use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::client::ArenaClient;
use target_rdma::proto::{self, Opcode, Request, Status, MAX_EPOCH, VERSION_2};
use target_rdma::testing::*;

const BLOB: usize = 64 << 10;

fn peer() -> (Peer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::start(dir.path(), PeerOpts::default());
    (peer, dir)
}

fn writer(peer: &Peer, epoch: u64) -> ArenaClient {
    let mut c = peer.config("a", SECRET_A);
    c.epoch = epoch;
    ArenaClient::connect(c).unwrap()
}

fn stale(e: &ArenaError) -> bool {
    e.status() == Some(Status::StaleEpoch)
}

fn read(c: &ArenaClient, key: u64) -> Vec<u8> {
    let mut out = vec![0u8; BLOB];
    assert!(
        block_on(c.read_found(key, 0, &mut out)).unwrap(),
        "key {key}"
    );
    out
}

/// Over TCP a fenced-out writer's leases end with the raise too: its
/// inline WRITE and its COMMIT answer STALE_EPOCH, the new writer gets the
/// same slot and its bytes stay, and the old lease, once its holder moved
/// past the volume's epoch, answers LEASE_LOST. A raise by HELLO does the
/// same as one by EPOCH.
#[test]
fn a_raise_ends_the_fenced_writers_leases_and_refuses_its_writes() {
    let (peer, _dir) = peer();
    let old = writer(&peer, 1);
    block_on(old.write(3, 0, &pattern(3, 1, BLOB))).unwrap();
    let lease = block_on(old.alloc(3)).unwrap();
    let other = block_on(old.alloc(4)).unwrap();

    // HELLO at epoch 2 raises the volume and fences the old writer out.
    let new = writer(&peer, 2);
    assert_eq!(peer.metric("arenad_leases_fenced_total", &[]), 2);
    let e = block_on(old.write(3, 0, &pattern(3, 9, BLOB))).unwrap_err();
    assert!(stale(&e), "{e}");
    let e = block_on(old.commit(3, lease.token)).unwrap_err();
    assert!(stale(&e), "{e}");
    assert!(
        read(&new, 3) == pattern(3, 1, BLOB),
        "no write of it landed"
    );

    let l = block_on(new.alloc(3)).unwrap();
    assert_eq!(l.slot_offset, lease.slot_offset, "the same slot");
    block_on(new.write(3, 0, &pattern(3, 2, BLOB))).unwrap();
    block_on(new.commit(3, l.token)).unwrap();
    block_on(new.flush()).unwrap();
    let e = block_on(old.write(3, 0, &pattern(3, 9, BLOB))).unwrap_err();
    assert!(stale(&e), "{e}");
    assert!(
        read(&new, 3) == pattern(3, 2, BLOB),
        "the new writer's bytes"
    );

    // RELEASE of a fenced lease is accepted; once the old writer moves
    // past the volume (fencing the new one), its other lease is lost.
    block_on(old.release(&[other.token])).unwrap();
    assert_eq!(block_on(old.raise_epoch(3)).unwrap(), 3);
    let e = block_on(old.commit(3, lease.token)).unwrap_err();
    assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
    assert!(
        read(&old, 3) == pattern(3, 2, BLOB),
        "still the new writer's"
    );
    let e = block_on(new.write(3, 0, &pattern(3, 9, BLOB))).unwrap_err();
    assert!(stale(&e), "{e}");
    assert_eq!(peer.protocol_errors(), 0);
}

/// `u64::MAX` is no epoch: a HELLO or EPOCH presenting it is a protocol
/// error (counted), the volume's epoch stays, and the client refuses to
/// send it (and does not keep it for its reconnects).
#[test]
fn epoch_u64_max_is_refused() {
    let (peer, _dir) = peer();
    let secret = secret(SECRET_A);
    let r = RawSession::try_open(peer.addr, "a", &secret, VERSION_2, u64::MAX)
        .err()
        .expect("a HELLO at u64::MAX is refused");
    assert_eq!(r.status, Status::Protocol);
    assert!(r.message.contains("never be fenced out"), "{}", r.message);

    let mut s = RawSession::open(peer.addr, "a", &secret, VERSION_2, 1);
    let mut f = Vec::new();
    proto::encode_request(&mut f, 1, &Request::Epoch { epoch: u64::MAX });
    s.send(&f).unwrap();
    let (h, body) = s.recv().expect("an error frame");
    assert_eq!((h.opcode, h.status), (Opcode::Epoch, Status::Protocol));
    assert!(
        proto::decode_error(&body).contains("never be fenced out"),
        "{}",
        proto::decode_error(&body)
    );
    assert!(s.recv().is_none(), "a protocol error closes the session");
    assert_eq!(peer.protocol_errors(), 2);

    let c = writer(&peer, 1);
    let e = block_on(c.raise_epoch(u64::MAX)).unwrap_err();
    assert_eq!(e.status(), Some(Status::Protocol), "{e}");
    assert_eq!(c.epoch(), 1, "not kept for later HELLOs");
    block_on(c.write(1, 0, &[1; 4096])).expect("the volume's epoch stays 1");
    assert_eq!(block_on(c.raise_epoch(MAX_EPOCH)).unwrap(), MAX_EPOCH);
    assert_eq!(peer.protocol_errors(), 2, "the client sent none");
}

/// An epoch names a writer, and a writer has several sessions (one per
/// queue, one for background work) that present it each, and reconnects
/// that present it again; the server cannot tell them from another writer
/// at the same epoch, so every session presenting the volume's epoch is
/// admitted, and none of them fences another. Only a lower epoch is
/// stale.
#[test]
fn sessions_at_the_volumes_epoch_share_it_and_a_reconnect_is_admitted() {
    let (peer, _dir) = peer();
    let q0 = writer(&peer, 0);
    assert_eq!(block_on(q0.raise_epoch(2)).unwrap(), 2);
    let l = block_on(q0.alloc(1)).unwrap();
    // Its sibling presents the same epoch, by HELLO and by EPOCH.
    let q1 = writer(&peer, 2);
    assert_eq!(q1.welcome().unwrap().epoch, 2);
    assert_eq!(block_on(q1.raise_epoch(2)).unwrap(), 2);
    block_on(q1.write(2, 0, &[2; 4096])).unwrap();
    // q0's lease survived its sibling's presenting the epoch.
    block_on(q0.write(1, 0, &[1; 4096])).unwrap();
    block_on(q0.commit(1, l.token)).unwrap();
    assert_eq!(peer.metric("arenad_leases_fenced_total", &[]), 0);

    // The raiser's connection goes; the writer reconnects at its epoch.
    drop(q0);
    let again = writer(&peer, 2);
    block_on(again.write(1, 0, &[3; 4096])).unwrap();
    // A lower epoch is stale.
    let older = writer(&peer, 1);
    let e = block_on(older.write(1, 0, &[9; 4096])).unwrap_err();
    assert!(stale(&e), "{e}");
    let mut out = [0u8; 4096];
    assert!(block_on(q1.read_found(1, 0, &mut out)).unwrap());
    assert_eq!(out, [3; 4096]);
    assert_eq!(peer.protocol_errors(), 0);
}
