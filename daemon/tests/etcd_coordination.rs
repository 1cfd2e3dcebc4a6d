//! The etcd coordinator against a real etcd (Debian's `etcd-server`,
//! started on loopback by each test): compare-and-swap conflicts, the
//! writer lease (a second writer refused, expiry and revocation end the
//! deadline writes are acknowledged until, a restarted ublkd adopts its
//! lease), and placement over a registered pool.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::etcd::{eventually, EtcdServer};
use target_rdma::replica::{
    CoordErrorKind as CoreKind, Coordinator, Lease, MemberRecord, MemberState, Membership,
    Swap as CoreSwap,
};
use ublkd::coordination::etcd::{Etcd, Expect, TxnOutcome};
use ublkd::coordination::{Coordination, CoordinationErrorKind, MembershipRecord, PeerRecord};

const LIMIT: Duration = Duration::from_secs(30);

fn wait<T>(
    f: impl std::future::Future<Output = Result<T, ublkd::coordination::CoordinationError>>,
) -> T {
    Etcd::wait(f).unwrap()
}

fn membership(epoch: u64, peers: &[&str]) -> MembershipRecord {
    let peers: Vec<String> = peers.iter().map(|p| (*p).to_owned()).collect();
    let mut m = MembershipRecord::created(&peers, 1 << 30).unwrap();
    m.membership.epoch = epoch;
    m
}

#[test]
fn membership_swaps_conflict_on_a_stale_revision() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let c = Coordination::start(&etcd.config(), dir.path()).unwrap();
    assert_eq!(wait(c.membership("vm1")), None);
    let created = membership(1, &["m1", "m2"]);
    assert!(matches!(
        wait(c.swap_membership("vm1", &created, Expect::Absent, 0)),
        TxnOutcome::Done(_)
    ));
    // A second creation loses: the key exists.
    match wait(c.swap_membership("vm1", &membership(1, &["m3"]), Expect::Absent, 0)) {
        TxnOutcome::Conflict(Some(_)) => {}
        other => panic!("{other:?}"),
    }
    let read = wait(c.membership("vm1")).unwrap();
    assert_eq!(read.record, created);
    // Two writers that read the same revision: exactly one swap wins.
    let mut a = created.clone();
    a.membership.epoch = 2;
    a.membership.members[1].state = MemberState::Failed;
    a.reason = "member_failed".into();
    let mut b = created.clone();
    b.membership.epoch = 2;
    b.membership.members[0].state = MemberState::Failed;
    let ra = wait(c.swap_membership("vm1", &a, Expect::Revision(read.revision), 1));
    let rb = wait(c.swap_membership("vm1", &b, Expect::Revision(read.revision), 1));
    assert!(matches!(ra, TxnOutcome::Done(_)), "{ra:?}");
    assert!(matches!(rb, TxnOutcome::Conflict(Some(_))), "{rb:?}");
    assert_eq!(wait(c.membership("vm1")).unwrap().record, a);
    // An epoch that does not rise never reaches etcd.
    let e = Etcd::wait(c.swap_membership("vm1", &a, Expect::Revision(1), 2)).unwrap_err();
    assert_eq!(e.kind(), CoordinationErrorKind::Invalid);
    // And etcdctl sees the documented key and JSON.
    let (ok, out) = etcd.etcdctl(&["get", "/ublk/volumes/vm1/membership", "--print-value-only"]);
    assert!(
        ok && out.contains("\"epoch\":2") && out.contains("\"member_failed\""),
        "{out}"
    );
}

#[test]
fn a_second_writer_is_refused_naming_the_holder() {
    let etcd = EtcdServer::start();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cfg = etcd.config();
    cfg.host_id = Some("host-one".into());
    let one = Coordination::start(&cfg, d1.path()).unwrap();
    cfg.host_id = Some("host-two".into());
    let two = Coordination::start(&cfg, d2.path()).unwrap();
    let held = one.writer().acquire("vm1").unwrap();
    assert!(held.valid_until().is_some_and(|t| t > Instant::now()));
    let e = two.writer().acquire("vm1").err().unwrap();
    assert_eq!(e.kind(), CoordinationErrorKind::Held);
    let text = e.to_string();
    assert!(
        text.starts_with("volume \"vm1\" is already served by ublkd on host-one (pid "),
        "{text}"
    );
    assert!(text.contains(&d1.path().display().to_string()), "{text}");
    // Acquiring again is idempotent for the holder; another volume is free.
    one.writer().acquire("vm1").unwrap();
    two.writer().acquire("vm2").unwrap();
    // Released, it can be taken.
    one.writer().release("vm1").unwrap();
    assert!(
        held.valid_until().is_none(),
        "a released volume is not writable"
    );
    two.writer().acquire("vm1").unwrap();
    // One state dir, one ublkd.
    let e = Coordination::start(&cfg, d2.path()).err().unwrap();
    assert_eq!(e.kind(), CoordinationErrorKind::LeaseFile);
    assert!(e.to_string().contains("locked by another ublkd"), "{e}");
}

#[test]
fn a_revoked_lease_is_taken_back_unless_another_ublkd_took_the_volume() {
    let etcd = EtcdServer::start();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let cfg = etcd.config();
    let one = Coordination::start(&cfg, d1.path()).unwrap();
    let mut cfg2 = cfg.clone();
    cfg2.host_id = Some("other".into());
    let two = Coordination::start(&cfg2, d2.path()).unwrap();
    let kept = one.writer().acquire("kept").unwrap();
    let taken = one.writer().acquire("taken").unwrap();
    let old = one.writer().lease_id();
    // Revoke: etcd deletes both writer keys at once; the other ublkd takes
    // one of the volumes before our keepalive notices.
    let (ok, out) = etcd.etcdctl(&["lease", "revoke", &format!("{old:x}")]);
    assert!(ok, "{out}");
    two.writer().acquire("taken").unwrap();
    eventually(LIMIT, "the lease loss is noticed", || {
        one.writer().leases_lost() == 1
    });
    eventually(LIMIT, "a new lease", || {
        one.writer().lease_id() != 0 && one.writer().lease_id() != old
    });
    // The key still absent is taken back under the new lease (a new term);
    // the one the other ublkd took fences its writer for good.
    eventually(LIMIT, "the free key is taken back", || kept.held());
    assert!(
        matches!(kept.lease(), Lease::Held { term: 1, .. }),
        "{:?}",
        kept.lease()
    );
    eventually(LIMIT, "the taken key is seen", || {
        matches!(taken.lease(), Lease::Taken { .. })
    });
    assert!(!taken.held() && taken.valid_until().is_none());
    let again = one.writer().acquire("kept").unwrap();
    assert!(Arc::ptr_eq(&again, &kept), "the same writer, not a new one");
    assert_eq!(
        one.writer().acquire("taken").err().unwrap().kind(),
        CoordinationErrorKind::Held
    );
    let (_, out) = etcd.etcdctl(&["get", "/ublk/volumes/taken/writer", "--print-value-only"]);
    assert!(out.contains("\"host\":\"other\""), "{out}");
}

fn block<T>(
    f: target_rdma::replica::CoordFuture<'_, T>,
) -> Result<T, target_rdma::replica::CoordError> {
    futures::executor::block_on(f)
}

#[test]
fn the_volume_coordinator_swaps_on_the_epoch_and_stops_with_its_lease() {
    let etcd = EtcdServer::start();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let cfg = etcd.config();
    let one = Coordination::start(&cfg, d1.path()).unwrap();
    let peers = ["m1".to_string(), "m2".to_string()];
    let vol = one.open_volume("vm1", &peers, 1 << 30).unwrap();
    let m1 = block(vol.load()).unwrap();
    assert_eq!(m1, Membership::new_volume(&peers).unwrap());
    assert!(matches!(vol.lease(), Lease::Held { until, term: 0 } if until > Instant::now()));
    // Two swaps from epoch 1: the first wins, the second learns the winner.
    let mut failed = m1.clone();
    failed.epoch = 2;
    failed.members[1].state = MemberState::Failed;
    let mut other = m1.clone();
    other.epoch = 2;
    other.members[0].state = MemberState::Failed;
    assert_eq!(
        block(vol.compare_and_swap(1, failed.clone())),
        Ok(CoreSwap::Done)
    );
    assert_eq!(
        block(vol.compare_and_swap(1, other)),
        Ok(CoreSwap::Lost(failed.clone()))
    );
    // The reason is read from the change and counted.
    let mut syncing = failed.clone();
    syncing.epoch = 3;
    syncing.members.push(MemberRecord {
        peer: "m3".into(),
        state: MemberState::Syncing,
    });
    assert_eq!(
        block(vol.compare_and_swap(2, syncing.clone())),
        Ok(CoreSwap::Done)
    );
    let (_, out) = etcd.etcdctl(&["get", "/ublk/volumes/vm1/membership", "--print-value-only"]);
    assert!(
        out.contains("\"reason\":\"rebuild_started\"") && out.contains("\"size\":1073741824"),
        "{out}"
    );
    use ublkd::coordination::EpochReason as R;
    let counts = one.epoch_changes();
    assert_eq!(
        [R::Created, R::MemberFailed, R::RebuildStarted].map(|r| counts.get(r)),
        [1, 1, 1]
    );
    // A swap that does not raise the epoch is refused, never stored.
    let e = block(vol.compare_and_swap(3, syncing.clone())).unwrap_err();
    assert_eq!(e.kind, CoreKind::Corrupt);
    // A restarted writer (a second open) keeps the stored record.
    drop(vol);
    let vol = one.open_volume("vm1", &["x".into()], 1).unwrap();
    assert_eq!(block(vol.load()).unwrap(), syncing);
    // The lease revoked: this ublkd takes the writer key back under a new
    // lease (a new term), and another ublkd is refused the volume.
    let old = one.writer().lease_id();
    let (ok, out) = etcd.etcdctl(&["lease", "revoke", &format!("{old:x}")]);
    assert!(ok, "{out}");
    eventually(LIMIT, "the writer key is taken back", || {
        matches!(vol.lease(), Lease::Held { term: 1, .. })
    });
    assert_ne!(one.writer().lease_id(), old);
    let mut cfg2 = cfg.clone();
    cfg2.host_id = Some("other".into());
    let two = Coordination::start(&cfg2, d2.path()).unwrap();
    let e = two.open_volume("vm1", &[], 0).err().unwrap();
    assert!(e.to_string().contains("already served"), "{e}");
    let mut back = syncing.clone();
    back.epoch = 4;
    back.members[2].state = MemberState::Healthy;
    assert_eq!(
        block(vol.compare_and_swap(3, back.clone())),
        Ok(CoreSwap::Done),
        "the retaken writer changes the membership again"
    );
    assert_eq!(block(vol.load()).unwrap(), back);
}

#[test]
fn while_etcd_does_not_answer_the_deadline_lapses_and_returns_after() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let c = Coordination::start(&etcd.config(), dir.path()).unwrap();
    let v = c.writer().acquire("vm1").unwrap();
    etcd.signal("STOP");
    // No keepalive is answered: the deadline stops moving and passes.
    eventually(LIMIT, "the deadline passes", || {
        v.valid_until().is_none_or(|t| t < Instant::now())
    });
    let lapsed = v.valid_until();
    etcd.signal("CONT");
    eventually(LIMIT, "the deadline moves again", || {
        v.valid_until().is_some_and(|t| t > Instant::now()) && v.valid_until() != lapsed
    });
    assert!(v.held());
}

#[test]
fn a_restarted_ublkd_adopts_its_lease_and_keeps_its_volumes() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = etcd.config();
    let first = Coordination::start(&cfg, dir.path()).unwrap();
    first.writer().acquire("vm1").unwrap();
    let id = first.writer().lease_id();
    // A crash: the process is gone, its lease still alive in etcd.
    drop(first);
    let second = Coordination::start(&cfg, dir.path()).unwrap();
    assert_eq!(second.writer().lease_id(), id, "the live lease is adopted");
    let v = second.writer().acquire("vm1").unwrap();
    assert!(v.valid_until().is_some());
    // Without the lease file, the predecessor's key is waited out (it dies
    // with the old lease), not refused.
    drop(second);
    std::fs::remove_file(dir.path().join("writer-lease")).unwrap();
    let third = Coordination::start(&cfg, dir.path()).unwrap();
    assert_ne!(third.writer().lease_id(), id);
    third.writer().acquire("vm1").unwrap();
}

#[test]
fn placement_spreads_over_failure_domains_and_counts_what_is_placed() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let c = Coordination::start(&etcd.config(), dir.path()).unwrap();
    let g = 1u64 << 30;
    for (id, cap, dom) in [
        ("a1", 100 * g, "rack-a"),
        ("a2", 90 * g, "rack-a"),
        ("b1", 10 * g, "rack-b"),
        ("c1", 50 * g, "rack-c"),
    ] {
        c.add_peer(&PeerRecord {
            id: id.into(),
            addr: format!("10.0.0.{}:7070", id.len()),
            capacity: cap,
            failure_domain: Some(dom.into()),
        })
        .unwrap();
    }
    let dup = c.add_peer(&PeerRecord {
        id: "a1".into(),
        addr: "x:1".into(),
        capacity: 1,
        failure_domain: None,
    });
    assert!(dup.unwrap_err().to_string().contains("already registered"));
    let ids = |v: Vec<PeerRecord>| v.into_iter().map(|p| p.id).collect::<Vec<_>>();
    assert_eq!(ids(c.place(g, 3).unwrap()), ["a1", "c1", "b1"]);
    let e = c.place(g, 4).unwrap_err();
    assert_eq!(e.kind(), CoordinationErrorKind::Placement);
    // A volume placed on b1 uses its room; a spare for a volume on a1, c1
    // avoids rack-a and rack-c.
    let on_b1 = membership(1, &["b1"]);
    let mut big = on_b1.clone();
    big.size = 10 * g;
    Etcd::wait(c.swap_membership("big", &big, Expect::Absent, 0)).unwrap();
    assert!(c.place(g, 3).is_err(), "b1 is full now");
    let vol = membership(1, &["a1", "c1"]);
    assert!(
        c.spare(&vol, "").is_err(),
        "only b1 is outside their domains, and it is full"
    );
    Etcd::wait(c.swap_membership(
        "big",
        &membership(2, &["a2"]),
        Expect::Revision(Etcd::wait(c.membership("big")).unwrap().unwrap().revision),
        1,
    ))
    .unwrap();
    assert_eq!(c.spare(&vol, "").unwrap().id, "b1");
    // A peer holding replicas cannot be unregistered.
    let e = c.remove_peer("a2").unwrap_err().to_string();
    assert!(
        e.contains("still holds replicas of 1 volume(s): big"),
        "{e}"
    );
    c.remove_peer("b1").unwrap();
    assert_eq!(c.peers().unwrap().len(), 3);
}
