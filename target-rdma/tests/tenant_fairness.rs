//! Tenant fairness against the real `arenad` binary: a client of volume
//! "a" that leases every arena slot and ignores REVOKE cannot keep volume
//! "b" at BUSY. b's ALLOC gets a slot once a's leases past its share are
//! revoked and, not given back within `revoke_deadline_ms`, ended by
//! force; a's later COMMIT of such a lease answers LEASE_LOST, and its
//! connection goes on.

mod common;

use futures::executor::block_on;
use target_rdma::proto::Status;

use common::arenad::Arenad;

#[test]
fn a_hoarding_tenant_cannot_starve_another_and_its_force_ended_commit_is_lease_lost() {
    let dir = tempfile::tempdir().unwrap();
    // Four 64 KiB slots, volumes a and b: a share of two slots each.
    let arenad = Arenad::new(dir.path(), "256K", "64K", "8M", None);
    arenad.set("revoke_deadline_ms = 300");
    let _proc = arenad.start();

    let hoarder = arenad.connect("a");
    let other = arenad.connect("b");
    block_on(async {
        let mut hoard = Vec::new();
        for key in 0..4 {
            hoard.push(hoarder.alloc(key).await.expect("a free slot"));
        }
        // Every slot is a's. b is under its share: its ALLOC waits for a's
        // leases past a's share (the client's 30 s request timeout is the
        // hang guard), and never answers BUSY.
        let lease = other.alloc(100).await.expect("b gets a slot");
        other.commit(100, lease.token).await.unwrap();
        other.write(100, 0, &[9u8; 512]).await.unwrap();
        let mut out = [0u8; 512];
        assert!(other.read_found(100, 0, &mut out).await.unwrap());
        assert_eq!(out, [9u8; 512]);

        // a was asked back the oldest of its leases past its share, and
        // did not give it back in time.
        let asked: Vec<(u64, u64)> = hoarder.take_revocations();
        assert!(
            asked.contains(&(0, hoard[0].token)),
            "the oldest lease is revoked first: {asked:?}"
        );
        assert!(asked.len() <= 2, "only leases past the share: {asked:?}");
        let e = hoarder.commit(0, hoard[0].token).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::LeaseLost), "{e}");
        // A lease within a's share is still a's, on the same connection.
        hoarder.commit(3, hoard[3].token).await.unwrap();
    });
    assert!(arenad.metric("arenad_leases_force_ended_total", &[]) >= 1.0);
    assert!(arenad.metric("arenad_lease_revocations_total", &[]) >= 1.0);
    assert_eq!(
        arenad.metric("arenad_protocol_errors_total", &[("class", "sequence")]),
        0.0,
        "a LEASE_LOST commit is no protocol error"
    );
}
