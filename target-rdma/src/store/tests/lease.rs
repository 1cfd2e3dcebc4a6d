//! Leases: limits, revocation, fair shares between tenants, COMMIT and RELEASE.

use std::sync::{Arc, Mutex as StdMutex};

use super::support::*;
use super::*;
use crate::proto::Lease;

#[test]
fn busy_revokes_oldest_leases_once() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 2, 8);
    let calls = Arc::new(StdMutex::new(Vec::new()));
    let c = calls.clone();
    s.set_revoke_hook(Box::new(move |h, v, k, t| {
        c.lock().unwrap().push((h, v, k, t))
    }));
    let l0 = s.alloc(0, 10, 1).unwrap();
    let l1 = s.get(0, 10, 2).unwrap().unwrap();
    assert_eq!(l0.slot_offset, l1.slot_offset, "GET leases the same slot");
    let _l2 = s.alloc(1, 11, 2).unwrap();
    // Volume 0 is over its share (one of two slots) with two leases, so it
    // is told BUSY and its oldest lease past the share is asked back;
    // volume 1, at its share, keeps its lease.
    let e = s.alloc(0, 12, 3).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Busy {
                slots: 2,
                revoked: 1
            }
        ),
        "{e}"
    );
    assert_eq!(*calls.lock().unwrap(), vec![(1, 0, 10, l0.token)]);
    let e = s.write(0, 12, 0, b"x").unwrap_err();
    assert!(matches!(e, StoreError::Busy { revoked: 0, .. }), "{e}");
    assert_eq!(calls.lock().unwrap().len(), 1, "each lease is revoked once");
    assert_eq!(s.stats().slots_leased, 2);
    s.commit(0, 10, l0.token, 1).unwrap();
    s.release(l1.token, 2).unwrap();
    s.write(0, 12, 0, b"room").unwrap();
    assert_eq!(s.stats().revocations, 1);
}

/// Runs `f` on a thread of its own and returns its result; panics if it
/// has not returned within a minute (a hang guard, not a timing check).
fn within_a_minute<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("the store call returned")
}

#[test]
fn a_hoarding_volume_cannot_keep_another_at_busy() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(open(dir.path(), 4, 16));
    s.set_lease_limits(LeaseLimits {
        revoke_deadline: std::time::Duration::from_millis(200),
        ..LeaseLimits::default()
    });
    let calls = Arc::new(StdMutex::new(Vec::new()));
    let c = calls.clone();
    s.set_revoke_hook(Box::new(move |h, v, k, t| {
        c.lock().unwrap().push((h, v, k, t))
    }));
    // Connection 1 of volume 0 leases every slot and never gives one back.
    let hoard: Vec<Lease> = (0..4).map(|k| s.alloc(0, k, 1).unwrap()).collect();
    // Volume 1, under its share (2 of 4 slots), gets a slot: volume 0's
    // oldest leases past its share are asked back, then ended by force.
    let s2 = s.clone();
    let lease = within_a_minute(move || s2.alloc(1, 100, 2)).expect("volume 1 gets a slot");
    s.with_lease(lease.token, 2, |b| b.fill(7)).unwrap();
    s.commit(1, 100, lease.token, 2).unwrap();
    assert_eq!(blob(&s, 1, 100).unwrap(), vec![7u8; B as usize]);
    let asked = calls.lock().unwrap().clone();
    assert!(
        !asked.is_empty() && asked.len() <= 2,
        "only leases past volume 0's share are asked back: {asked:?}"
    );
    assert!(
        asked.iter().all(|&(h, v, _, _)| (h, v) == (1, 0)),
        "{asked:?}"
    );
    assert_eq!(asked[0].3, hoard[0].token, "the oldest first");
    assert!(s.stats().leases_force_ended >= 1);
    // The hoarder's late COMMIT of the lease ended by force is LEASE_LOST;
    // its leases within the share still commit.
    let e = s.commit(0, 0, hoard[0].token, 1).unwrap_err();
    assert!(matches!(e, StoreError::LeaseLost { .. }), "{e}");
    assert_eq!(e.status(), crate::proto::Status::LeaseLost);
    s.commit(0, 3, hoard[3].token, 1).unwrap();
}

#[test]
fn a_tenant_that_gives_revoked_leases_back_is_not_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(open(dir.path(), 4, 16));
    s.set_lease_limits(LeaseLimits {
        // Far beyond the test: only a RELEASE can free the slot.
        revoke_deadline: std::time::Duration::from_secs(600),
        ..LeaseLimits::default()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = StdMutex::new(tx);
    s.set_revoke_hook(Box::new(move |h, _, _, t| {
        let _ = tx.lock().unwrap().send((h, t));
    }));
    for k in 0..4 {
        s.alloc(0, k, 1).unwrap();
    }
    let s2 = s.clone();
    let waiter = std::thread::spawn(move || s2.alloc(1, 100, 2));
    let (holder, token) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a REVOKE for the hoarder");
    s.release(token, holder).unwrap();
    let lease = waiter
        .join()
        .unwrap()
        .expect("volume 1 gets the released slot");
    s.release(lease.token, 2).unwrap();
    assert_eq!(s.stats().leases_force_ended, 0);
}

/// A revoked lease its holder neither gives back nor uses again is ended
/// at its deadline by the store itself: the force-end hook (which takes the
/// holder's RDMA key away) runs with no further call into the store.
#[test]
fn a_revoked_lease_is_ended_at_its_deadline_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    s.set_lease_limits(LeaseLimits {
        connection_max: Some(1),
        revoke_deadline: std::time::Duration::from_millis(100),
        ..LeaseLimits::default()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = StdMutex::new(tx);
    s.set_force_end_hook(Box::new(move |h, t| {
        let _ = tx.lock().unwrap().send((h, t));
    }));
    let a = s.alloc(0, 1, 1).unwrap();
    s.with_lease(a.token, 1, |b| b[..4].copy_from_slice(b"mine"))
        .unwrap();
    // At its limit, the connection is refused and asked its oldest back.
    let e = s.alloc(0, 2, 1).unwrap_err();
    assert!(matches!(e, StoreError::LeaseLimit { limit: 1 }), "{e}");
    assert_eq!(s.stats().revocations, 1);
    let ended = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the lease is ended by force without being touched");
    assert_eq!(ended, (1, a.token));
    assert_eq!(s.stats().leases_force_ended, 1);
    assert_eq!(s.stats().slots_leased, 0, "its slot is unpinned");
    let e = s.commit(0, 1, a.token, 1).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::LeaseLost {
                cause: LostCause::Overdue,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("ended by force at its deadline"),
        "{e}"
    );
    assert_eq!(
        &blob(&s, 0, 1).unwrap()[..4],
        b"mine",
        "what was written before the deadline stays in the slot, uncommitted"
    );
}

/// A lease given back before its deadline is not ended by force after it.
#[test]
fn a_revoked_lease_given_back_in_time_is_not_ended_later() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    s.set_lease_limits(LeaseLimits {
        connection_max: Some(1),
        revoke_deadline: std::time::Duration::from_millis(50),
        ..LeaseLimits::default()
    });
    let a = s.alloc(0, 1, 1).unwrap();
    assert!(s.alloc(0, 2, 1).is_err(), "at the limit: revoked");
    s.release(a.token, 1).unwrap();
    let b = s.alloc(0, 2, 1).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(s.stats().leases_force_ended, 0);
    s.commit(0, 2, b.token, 1).unwrap();
}

#[test]
fn a_connection_holds_at_most_its_lease_limit() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 16);
    s.set_lease_limits(LeaseLimits {
        connection_max: Some(2),
        ..LeaseLimits::default()
    });
    let l0 = s.alloc(0, 1, 1).unwrap();
    s.get(0, 1, 1).unwrap().unwrap();
    let e = s.alloc(0, 2, 1).unwrap_err();
    assert!(matches!(e, StoreError::LeaseLimit { limit: 2 }), "{e}");
    s.alloc(0, 2, 2)
        .expect("another connection is not limited by it");
    s.release(l0.token, 1).unwrap();
    s.alloc(0, 2, 1).expect("room again after a release");
}

#[test]
fn lease_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 8);
    assert!(matches!(
        s.release(99, 1),
        Err(StoreError::UnknownLease { token: 99 })
    ));
    assert!(matches!(
        s.commit(0, 1, 99, 1),
        Err(StoreError::UnknownLease { token: 99 })
    ));
    assert!(s.get(0, 1, 1).unwrap().is_none(), "GET of an absent key");
    let a = s.alloc(0, 1, 1).unwrap();
    let e = s.commit(0, 1, a.token, 2).unwrap_err();
    assert!(
        e.to_string().contains("belongs to connection 1, not 2"),
        "{e}"
    );
    let e = s.commit(0, 2, a.token, 1).unwrap_err();
    assert!(e.to_string().contains("key 1, not volume 0 key 2"), "{e}");
    assert!(s.with_lease(a.token, 2, |_| ()).is_err());
    assert!(s.release(a.token, 2).is_err());
    let g = s.get(0, 1, 1).unwrap().unwrap();
    let e = s.commit(0, 1, g.token, 1).unwrap_err();
    assert!(e.to_string().contains("GET lease"), "{e}");
    s.commit(0, 1, a.token, 1).unwrap();
    assert!(
        matches!(
            s.commit(0, 1, a.token, 1),
            Err(StoreError::UnknownLease { .. })
        ),
        "commit ends the lease"
    );
    s.release(g.token, 1).unwrap();
    let a = s.alloc(0, 3, 1).unwrap();
    assert_eq!(s.remove(0, 3, 4).unwrap(), 1);
    let e = s.commit(0, 3, a.token, 1).unwrap_err();
    assert!(matches!(e, StoreError::LeaseLost { key: 3, .. }), "{e}");
    assert!(e.to_string().contains("removed while leased"), "{e}");
    assert_eq!(s.stats().leases_held, 0);
    assert_eq!(s.stats().slots_leased, 0);
}

#[test]
fn alloc_commit_and_drop_holder_keep_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    s.write(0, 1, 0, b"old content").unwrap();
    let a = s.alloc(0, 1, 7).unwrap();
    s.with_lease(a.token, 7, |b| {
        assert_eq!(&b[..3], b"old", "ALLOC keeps content");
        b[..3].copy_from_slice(b"new");
    })
    .unwrap();
    s.commit(0, 1, a.token, 7).unwrap();
    assert_eq!(&blob(&s, 0, 1).unwrap()[..11], b"new content");

    let a = s.alloc(0, 2, 7).unwrap();
    s.with_lease(a.token, 7, |b| b[..4].copy_from_slice(b"half"))
        .unwrap();
    let g = s.get(0, 1, 7).unwrap().unwrap();
    assert_eq!(s.stats().leases_held, 2);
    s.drop_holder(7);
    assert_eq!(s.stats().leases_held, 0);
    assert!(matches!(
        s.release(g.token, 7),
        Err(StoreError::UnknownLease { .. })
    ));
    assert_eq!(
        &blob(&s, 0, 2).unwrap()[..4],
        b"half",
        "uncommitted ALLOC bytes stay"
    );
    assert_eq!(s.stats().slots_dirty, 2);
}

#[test]
fn concurrent_holders_and_a_flusher_agree() {
    fn shared<T: Send + Sync>(_: &T) {}
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(open(dir.path(), 4, 256));
    shared(&*s);
    let workers: Vec<_> = (0..3u64)
        .map(|h| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..150u64 {
                    let key = h * 100 + i % 10;
                    let v = (i % 251) as u8;
                    if i % 2 == 0 {
                        s.write(0, key, 0, &vec![v; B as usize]).unwrap();
                    } else {
                        let l = loop {
                            match s.alloc(0, key, h) {
                                Ok(l) => break l,
                                Err(StoreError::Busy { .. }) => std::thread::yield_now(),
                                Err(e) => panic!("{e}"),
                            }
                        };
                        s.with_lease(l.token, h, |b| b.fill(v)).unwrap();
                        s.commit(0, key, l.token, h).unwrap();
                    }
                    let mut out = vec![0u8; B as usize];
                    assert!(s.read(0, key, 0, &mut out).unwrap());
                    assert!(out.iter().all(|&b| b == v), "holder {h} key {key}");
                }
            })
        })
        .collect();
    for _ in 0..20 {
        s.flush().unwrap();
    }
    for w in workers {
        w.join().unwrap();
    }
    s.flush().unwrap();
    let st = s.stats();
    assert_eq!(st.leases_held, 0);
    assert_eq!(st.slots_dirty + st.slots_leased, 0, "{st:?}");
}
