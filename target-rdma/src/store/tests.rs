use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex as StdMutex};

use proptest::prelude::*;

use super::*;
use crate::proto::Lease;

const B: u64 = 4096;

fn cfg(dir: &Path, slots: u64, extents: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        arena_bytes: slots * B,
        blob_bytes: B as u32,
        swap_bytes: extents * B,
        swap_reads_in_flight: super::DEFAULT_SWAP_READS_IN_FLIGHT,
    }
}

fn vols(quota: u64) -> Vec<VolumeSpec> {
    ["a", "b"]
        .iter()
        .map(|n| VolumeSpec {
            name: (*n).into(),
            quota_blobs: quota,
        })
        .collect()
}

fn open(dir: &Path, slots: u64, extents: u64) -> Store {
    Store::open(cfg(dir, slots, extents), &vols(1000)).expect("open store")
}

fn blob(store: &Store, vol: VolumeId, key: u64) -> Option<Vec<u8>> {
    let mut out = vec![0u8; B as usize];
    store.read(vol, key, 0, &mut out).unwrap().then_some(out)
}

fn pattern(seed: u64) -> Vec<u8> {
    (0..B)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8)
        .collect()
}

#[test]
fn write_read_round_trip_and_partial_writes() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 16);
    let mut out = vec![0xffu8; 100];
    assert!(!s.read(0, 7, 0, &mut out).unwrap());
    assert!(out.iter().all(|&b| b == 0), "absent key reads as zeros");

    s.write(0, 7, 100, b"hello").unwrap();
    let full = blob(&s, 0, 7).unwrap();
    assert_eq!(&full[100..105], b"hello");
    assert!(
        full[..100].iter().chain(&full[105..]).all(|&b| b == 0),
        "new key starts as zeros"
    );

    s.write(0, 7, 102, b"LL").unwrap();
    let mut part = [0u8; 5];
    assert!(s.read(0, 7, 100, &mut part).unwrap());
    assert_eq!(&part, b"heLLo");
    assert!(blob(&s, 1, 7).is_none(), "volumes are separate");

    s.write(0, 8, 0, &pattern(8)).unwrap();
    assert_eq!(blob(&s, 0, 8).unwrap(), pattern(8));
}

#[test]
fn range_volume_and_limit_errors() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 8);
    let e = s.write(0, 1, 4090, &[0; 7]).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::OutOfRange {
                offset: 4090,
                len: 7,
                blob_bytes: 4096
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("4090") && e.to_string().contains("4096"),
        "{e}"
    );
    let mut big = vec![0u8; 4097];
    assert!(matches!(
        s.read(0, 1, 0, &mut big),
        Err(StoreError::OutOfRange { .. })
    ));
    let e = s.write(2, 1, 0, b"x").unwrap_err();
    assert!(
        matches!(e, StoreError::UnknownVolume { vol: 2, count: 2 }),
        "{e}"
    );
}

#[test]
fn remove_drops_a_key_range() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 32);
    for k in 0..10 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.write(1, 5, 0, b"other volume").unwrap();
    assert_eq!(s.remove(0, 3, 7).unwrap(), 4);
    for k in 0..10 {
        assert_eq!(blob(&s, 0, k).is_some(), !(3..7).contains(&k), "key {k}");
    }
    assert!(blob(&s, 1, 5).is_some());
    assert_eq!(s.remove(0, 3, 7).unwrap(), 0);
    assert_eq!(s.remove(0, 9, 2).unwrap(), 0, "empty range");
    s.write(0, 4, 0, b"again").unwrap();
    assert_eq!(&blob(&s, 0, 4).unwrap()[..5], b"again");
}

#[test]
fn quota_limits_distinct_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg(dir.path(), 4, 16), &vols(3)).unwrap();
    for k in 0..3 {
        s.write(0, k, 0, b"x").unwrap();
    }
    let e = s.write(0, 3, 0, b"x").unwrap_err();
    assert!(
        matches!(&e, StoreError::QuotaExceeded { volume, quota: 3 } if volume == "a"),
        "{e}"
    );
    assert!(s.alloc(0, 3, 1).is_err());
    s.write(0, 2, 0, b"rewrite is fine").unwrap();
    s.write(1, 3, 0, b"other volume has its own quota").unwrap();
    s.remove(0, 0, 1).unwrap();
    s.write(0, 3, 0, b"room again").unwrap();
}

#[test]
fn no_space_when_arena_and_swap_are_full() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 2, 4);
    let mut written = Vec::new();
    let mut err = None;
    for k in 0..16 {
        match s.write(0, k, 0, &pattern(k)) {
            Ok(()) => written.push(k),
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let e = err.expect("a 2-slot arena with 4 extents fills up");
    assert!(
        matches!(
            e,
            StoreError::NoSpace {
                slots: 2,
                extents: 4
            }
        ),
        "{e}"
    );
    assert_eq!(
        written,
        [0, 1, 2],
        "capacity is the swap less one spare extent"
    );
    s.flush().unwrap();
    for round in 0..3u64 {
        for &k in &written {
            s.write(0, k, 0, &pattern(k + round)).unwrap();
        }
        s.flush().unwrap();
    }
    for &k in &written {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k + 2), "key {k}");
    }
    s.remove(0, 0, 1).unwrap();
    s.write(0, 9, 0, b"room after remove").unwrap();
}

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
fn config_validation_names_key_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let msg = |c: StoreConfig, v: &[VolumeSpec]| match Store::open(c, v) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("config accepted"),
    };
    let mut c = cfg(dir.path(), 4, 8);
    c.blob_bytes = 3000;
    let m = msg(c, &vols(1));
    assert!(m.contains("blob_bytes") && m.contains("3000"), "{m}");
    let mut c = cfg(dir.path(), 4, 8);
    c.blob_bytes = 32 << 20;
    assert!(msg(c, &vols(1)).contains("33554432"));
    let m = msg(cfg(dir.path(), 1, 8), &vols(1));
    assert!(m.contains("arena_bytes") && m.contains("4096"), "{m}");
    let m = msg(cfg(dir.path(), 8, 4), &vols(1));
    assert!(m.contains("swap_bytes") && m.contains("16384"), "{m}");
    let mut c = cfg(dir.path(), 4, 8);
    c.swap_bytes += 1;
    assert!(msg(c, &vols(1)).contains("swap_bytes"));
    let dup = [vols(1)[0].clone(), vols(1)[0].clone()];
    let m = msg(cfg(dir.path(), 4, 8), &dup);
    assert!(m.contains("\"a\" is configured twice"), "{m}");

    drop(open(dir.path(), 4, 8));
    let mut c = cfg(dir.path(), 4, 8);
    c.blob_bytes = 8192;
    c.arena_bytes = 4 * 8192;
    c.swap_bytes = 8 * 8192;
    let m = msg(c, &vols(1));
    assert!(
        m.contains("blob_bytes") && m.contains("8192") && m.contains("4096"),
        "{m}"
    );
}

#[test]
fn second_open_of_a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 8);
    let e = Store::open(cfg(dir.path(), 4, 8), &vols(10))
        .err()
        .expect("locked");
    assert!(matches!(e, StoreError::Locked { .. }), "{e}");
    drop(s);
    open(dir.path(), 4, 8);
}

#[test]
fn eviction_and_fault_in_through_a_small_arena() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 128);
    for k in 0..64 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    for round in 0..2 {
        for k in (0..64).rev() {
            assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "round {round} key {k}");
        }
    }
    let st = s.stats();
    assert!(
        st.evictions >= 60 && st.write_backs >= 60 && st.fault_ins >= 60,
        "{st:?}"
    );
    assert_eq!(st.swap_bytes_written, st.write_backs * B);
    assert_eq!(st.swap_bytes_read, st.fault_ins * B);
    assert_eq!(st.slots_total, 4);
}

#[test]
fn flushed_data_survives_a_crash_and_generation_bumps() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    let g1 = s.generation();
    for k in 0..20 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.write(1, 3, 0, b"vol b").unwrap();
    s.flush().unwrap();
    s.write(0, 0, 0, b"unflushed overwrite").unwrap();
    s.write(0, 99, 0, b"unflushed new").unwrap();
    s.remove(0, 5, 6).unwrap();
    drop(s); // a crash: no flush

    let s = open(dir.path(), 4, 64);
    assert_eq!(s.generation(), g1 + 1);
    for k in 0..20 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k}");
    }
    assert!(blob(&s, 0, 99).is_none());
    assert_eq!(&blob(&s, 1, 3).unwrap()[..5], b"vol b");
    assert!(s.stats().swap_extents_used >= 21);

    // Volumes are persisted by name: a new order maps them back.
    drop(s);
    let swapped = [vols(1000)[1].clone(), vols(1000)[0].clone()];
    let s = Store::open(cfg(dir.path(), 4, 64), &swapped).unwrap();
    assert_eq!(&blob(&s, 0, 3).unwrap()[..5], b"vol b");
    assert_eq!(blob(&s, 1, 7).unwrap(), pattern(7));
    // A volume left out of the list keeps its blobs for a later run.
    drop(s);
    let s = Store::open(cfg(dir.path(), 4, 64), &swapped[..1]).unwrap();
    assert!(s.read(1, 7, 0, &mut [0; 1]).is_err());
    drop(s);
    let s = open(dir.path(), 4, 64);
    assert_eq!(blob(&s, 0, 7).unwrap(), pattern(7));
}

#[test]
fn repeated_flushes_checkpoint_and_free_superseded_extents() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    for round in 0..100u64 {
        for k in 0..6 {
            s.write(0, k, 0, &pattern(round * 10 + k)).unwrap();
        }
        s.flush().unwrap();
    }
    let st = s.stats();
    assert!(st.checkpoints >= 3, "{st:?}");
    assert!(
        st.swap_extents_used <= 12,
        "old extents are recycled: {st:?}"
    );
    drop(s);
    let s = open(dir.path(), 4, 16);
    for k in 0..6 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(990 + k));
    }
}

/// A store of three keys, one flush each, closed by a crash: its journal
/// holds three one-block batches (at offsets 512, 1024 and 1536).
fn three_flushes(dir: &Path) {
    let s = open(dir, 4, 16);
    for k in 0..3 {
        s.write(0, k, 0, &pattern(k)).unwrap();
        s.flush().unwrap();
    }
}

fn open_err(dir: &Path) -> StoreError {
    Store::open(cfg(dir, 4, 16), &vols(1000))
        .err()
        .expect("the store must refuse to open")
}

#[test]
fn a_torn_last_batch_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    // The crash came before the last batch's block reached the disk.
    let p = dir.path().join(index::JOURNAL_FILE);
    let mut b = std::fs::read(&p).unwrap();
    b[1536..2048].fill(0);
    std::fs::write(&p, b).unwrap();
    let s = open(dir.path(), 4, 16);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(0));
    assert_eq!(blob(&s, 0, 1).unwrap(), pattern(1));
    assert!(
        blob(&s, 0, 2).is_none(),
        "the unacknowledged commit is dropped"
    );
    s.write(0, 2, 0, &pattern(2)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = open(dir.path(), 4, 16);
    assert_eq!(blob(&s, 0, 2).unwrap(), pattern(2), "later commits survive");
}

#[test]
fn a_damaged_or_cut_journal_refuses_to_start_naming_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let p = dir.path().join(index::JOURNAL_FILE);
    let good = std::fs::read(&p).unwrap();
    // A flipped byte in any record, the last one included, is damage: a
    // torn write leaves zeros, never wrong bytes.
    for at in [530, 1040, 1560, 2047] {
        let mut b = good.clone();
        b[at] ^= 0x04;
        std::fs::write(&p, &b).unwrap();
        let e = open_err(dir.path());
        let block = at / 512 * 512;
        assert!(
            matches!(e, StoreError::Corrupt { .. })
                && e.to_string().contains("index.journal")
                && e.to_string().contains(&format!("at offset {block}")),
            "flip at {at}: {e}"
        );
    }
    // A journal cut after any record (or anywhere) is refused.
    for cut in [512, 1024, 1536, 2048, 2047, good.len() - 1] {
        std::fs::write(&p, &good[..cut]).unwrap();
        let e = open_err(dir.path());
        assert!(
            e.to_string().contains("index.journal") && e.to_string().contains("truncated"),
            "cut at {cut}: {e}"
        );
    }
    std::fs::remove_file(&p).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("index.journal: is missing"), "{e}");
    // Put back, it opens and nothing was lost.
    std::fs::write(&p, &good).unwrap();
    let s = open(dir.path(), 4, 16);
    for k in 0..3 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k));
    }
}

#[test]
fn a_missing_checkpoint_refuses_unless_the_store_never_held_anything() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let ckpt = dir.path().join(index::CKPT_FILE);
    let saved = std::fs::read(&ckpt).unwrap();
    std::fs::remove_file(&ckpt).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("index.ckpt: is missing") && e.to_string().contains("--repair"),
        "{e}"
    );
    // Still refused after a clean close (the journal then is empty; the
    // extent headers still say blobs exist).
    std::fs::write(&ckpt, &saved).unwrap();
    drop(open(dir.path(), 4, 16));
    std::fs::remove_file(&ckpt).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("index.ckpt: is missing"), "{e}");

    // A store that never held a blob (or a creation cut short) starts over.
    let empty = tempfile::tempdir().unwrap();
    drop(open(empty.path(), 4, 16));
    std::fs::remove_file(empty.path().join(index::CKPT_FILE)).unwrap();
    let s = open(empty.path(), 4, 16);
    assert!(blob(&s, 0, 0).is_none());
}

#[test]
fn a_missing_or_short_swap_file_or_extent_table_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let swap = dir.path().join(swap::SWAP_FILE);
    let len = std::fs::metadata(&swap).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&swap)
        .unwrap()
        .set_len(len - B)
        .unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("swap.dat") && e.to_string().contains("truncated"),
        "{e}"
    );
    std::fs::remove_file(&swap).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("swap.dat: is missing"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    three_flushes(dir.path());
    let meta = dir.path().join(extent::META_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&meta)
        .unwrap()
        .set_len(4096 + 8)
        .unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("swap.meta") && e.to_string().contains("truncated"),
        "{e}"
    );
    std::fs::remove_file(&meta).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("swap.meta: is missing"), "{e}");
}

/// Flips one bit of byte `at` of `file`.
fn flip(file: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    use std::os::unix::fs::FileExt;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
}

fn integrity_kind(r: Result<bool, StoreError>) -> Option<IntegrityKind> {
    match r {
        Err(StoreError::Integrity { kind, .. }) => Some(kind),
        _ => None,
    }
}

#[test]
fn a_flipped_byte_in_an_extent_fails_that_read_until_it_is_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    let e3 = s.core.durable_extent((0, 3)).unwrap();
    drop(s);
    flip(&dir.path().join(swap::SWAP_FILE), u64::from(e3) * B + 100);
    let s = open(dir.path(), 4, 64);
    let mut out = vec![0u8; B as usize];
    for _ in 0..2 {
        assert_eq!(
            integrity_kind(s.read(0, 3, 0, &mut out)),
            Some(IntegrityKind::Checksum)
        );
    }
    let e = s.read(0, 3, 0, &mut out).unwrap_err().to_string();
    assert!(
        e.contains("swap.dat")
            && e.contains(&format!("extent {e3}"))
            && e.contains(&format!("at byte {}", u64::from(e3) * B)),
        "{e}"
    );
    assert_eq!(s.stats().integrity_errors, [3, 0]);
    // Everything else reads back; leases and partial writes of the bad blob
    // fail the same way.
    for k in (0..8).filter(|&k| k != 3) {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k}");
    }
    assert!(matches!(s.get(0, 3, 1), Err(StoreError::Integrity { .. })));
    assert!(matches!(
        s.alloc(0, 3, 1),
        Err(StoreError::Integrity { .. })
    ));
    assert!(matches!(
        s.write(0, 3, 10, b"x"),
        Err(StoreError::Integrity { .. })
    ));
    // Rewritten whole, it is good again, durably.
    s.write(0, 3, 0, &pattern(33)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = open(dir.path(), 4, 64);
    assert_eq!(blob(&s, 0, 3).unwrap(), pattern(33));
}

#[test]
fn an_extent_swapped_with_another_volumes_never_serves_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    s.write(0, 1, 0, &pattern(1)).unwrap();
    s.write(1, 2, 0, &pattern(2)).unwrap();
    for k in 10..20 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    let (ea, eb) = (
        s.core.durable_extent((0, 1)).unwrap(),
        s.core.durable_extent((1, 2)).unwrap(),
    );
    drop(s);
    let swap_path = dir.path().join(swap::SWAP_FILE);
    let meta_path = dir.path().join(extent::META_FILE);
    let swap_bytes = |f: &Path, off: u64, len: u64| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(f).unwrap();
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off).unwrap();
        b
    };
    let exchange = |f: &Path, a: u64, b: u64, len: u64| {
        use std::os::unix::fs::FileExt;
        let (x, y) = (swap_bytes(f, a, len), swap_bytes(f, b, len));
        let w = std::fs::OpenOptions::new().write(true).open(f).unwrap();
        w.write_all_at(&y, a).unwrap();
        w.write_all_at(&x, b).unwrap();
    };
    // The payloads alone: they fail their checksums.
    exchange(&swap_path, u64::from(ea) * B, u64::from(eb) * B, B);
    let s = open(dir.path(), 4, 64);
    let mut out = vec![0u8; B as usize];
    assert_eq!(
        integrity_kind(s.read(0, 1, 0, &mut out)),
        Some(IntegrityKind::Checksum)
    );
    assert_eq!(
        integrity_kind(s.read(1, 2, 0, &mut out)),
        Some(IntegrityKind::Checksum)
    );
    drop(s);
    // Payloads and headers together: each header names the other blob.
    let rec = extent::record_len(B as u32) as u64;
    exchange(
        &meta_path,
        4096 + u64::from(ea) * rec,
        4096 + u64::from(eb) * rec,
        rec,
    );
    let s = open(dir.path(), 4, 64);
    assert_eq!(
        integrity_kind(s.read(0, 1, 0, &mut out)),
        Some(IntegrityKind::Header)
    );
    assert_eq!(
        integrity_kind(s.read(1, 2, 100, &mut out[..10])),
        Some(IntegrityKind::Header)
    );
    let e = s.read(0, 1, 0, &mut out).unwrap_err().to_string();
    assert!(
        e.contains("swap.meta") && e.contains("names volume \"b\" key 2"),
        "{e}"
    );
    assert_eq!(s.stats().integrity_errors[IntegrityKind::Header.index()], 3);
    for k in 10..20 {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k));
    }
}

#[test]
fn a_damaged_checkpoint_slot_the_journal_needs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Two runs: slot 0 holds epoch 1, slot 1 epoch 2 with the journal of 2.
    drop(open(dir.path(), 4, 16));
    three_flushes(dir.path());
    let p = dir.path().join(index::CKPT_FILE);
    let good = std::fs::read(&p).unwrap();
    let slot = good.len() / 2;
    // The older slot is not needed: damage there is harmless.
    let mut b = good.clone();
    b[20] ^= 1;
    std::fs::write(&p, &b).unwrap();
    let s = open(dir.path(), 4, 16);
    assert_eq!(blob(&s, 0, 2).unwrap(), pattern(2));
    drop(s);
    // Now the newest (this run's checkpoint, slot 0 again) is damaged and
    // the journal extends it: refused, not replaced by the older slot.
    three_flushes(dir.path());
    let good = std::fs::read(&p).unwrap();
    let newest = {
        let epoch = |o: usize| u64::from_le_bytes(good[o + 24..o + 32].try_into().unwrap());
        if epoch(0) > epoch(slot) {
            0
        } else {
            slot
        }
    };
    let mut b = good.clone();
    b[newest + 70] ^= 1;
    std::fs::write(&p, &b).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.to_string().contains("index.ckpt")
            && e.to_string().contains("belongs to checkpoint epoch"),
        "{e}"
    );
}

#[test]
fn a_store_of_the_old_format_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut v1 = b"ARNC".to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&[0; 52]);
    std::fs::write(dir.path().join(index::CKPT_FILE), &v1).unwrap();
    std::fs::write(dir.path().join(swap::SWAP_FILE), vec![0; 16 * B as usize]).unwrap();
    let e = open_err(dir.path());
    assert!(
        matches!(e, StoreError::OldFormat { version: 1, .. })
            && e.to_string()
                .contains("index.ckpt has on-disk format version 1")
            && e.to_string().contains("does not migrate"),
        "{e}"
    );
}

#[test]
fn repair_rebuilds_what_the_extents_prove_and_reports_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 64);
    for k in 0..10 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.write(1, 5, 0, &pattern(500)).unwrap();
    s.flush().unwrap();
    // A newer image of key 0 and a removal, both flushed.
    s.write(0, 0, 0, &pattern(100)).unwrap();
    s.remove(0, 9, 10).unwrap();
    s.flush().unwrap();
    let bad = s.core.durable_extent((0, 4)).unwrap();
    drop(s);
    // Restarts that write nothing leave no extent header behind.
    for _ in 0..3 {
        drop(open(dir.path(), 4, 64));
    }
    let generation_before = open(dir.path(), 4, 64).generation();
    flip(&dir.path().join(swap::SWAP_FILE), u64::from(bad) * B + 7);
    std::fs::remove_file(dir.path().join(index::CKPT_FILE)).unwrap();
    assert!(matches!(open_err(dir.path()), StoreError::Corrupt { .. }));

    let r = Store::repair(&cfg(dir.path(), 4, 64), &vols(1000)).unwrap();
    let text = r.to_string();
    assert_eq!(
        r.recovered,
        vec![("a".to_string(), 8), ("b".to_string(), 1)],
        "{text}"
    );
    assert_eq!(r.bad_images_total, 1, "{text}");
    assert_eq!(
        (r.bad_images[0].volume.as_str(), r.bad_images[0].key),
        ("a", 4)
    );
    assert!(!r.complete());
    assert!(
        text.contains("NOT RECOVERED") && text.contains("key 4"),
        "{text}"
    );
    assert!(r.lost.is_none(), "no readable checkpoint");
    assert!(
        r.generation > generation_before,
        "runs that left no extent header are still behind the repaired generation"
    );

    let s = open(dir.path(), 4, 64);
    assert_eq!(
        blob(&s, 0, 0).unwrap(),
        pattern(100),
        "the newest image wins"
    );
    assert!(blob(&s, 0, 4).is_none(), "the bad image is not served");
    assert!(blob(&s, 0, 9).is_none(), "a removed blob stays removed");
    for k in [1, 2, 3, 5, 6, 7, 8] {
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(k), "key {k}");
    }
    assert_eq!(blob(&s, 1, 5).unwrap(), pattern(500));
    let g = s.generation();
    drop(s);
    // Repair of a store whose index is fine loses nothing and lists it so.
    let r = Store::repair(&cfg(dir.path(), 4, 64), &vols(1000)).unwrap();
    assert!(r.complete() && r.lost_total == 0, "{r}");
    let s = open(dir.path(), 4, 64);
    assert!(s.generation() > g);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(100));
}

fn cfg_blob(dir: &Path, blob: u32, slots: u64, extents: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        arena_bytes: slots * u64::from(blob),
        blob_bytes: blob,
        swap_bytes: extents * u64::from(blob),
        swap_reads_in_flight: super::DEFAULT_SWAP_READS_IN_FLIGHT,
    }
}

fn big_pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(131) ^ seed.wrapping_mul(0x9e37) ^ (i >> 9)) as u8)
        .collect()
}

/// Blob size of [`sixteen_blobs_twelve_cold`]'s store.
const COLD_BLOB: u32 = 64 << 10;

/// A store of 4 slots holding 16 written and flushed 64 KiB blobs
/// (`big_pattern(k)` for key k of volume 0): keys 0..12 are in swap only.
fn sixteen_blobs_twelve_cold(dir: &std::path::Path) -> Store {
    let s = Store::open(cfg_blob(dir, COLD_BLOB, 4, 64), &vols(1000)).unwrap();
    for k in 0..16 {
        s.write(0, k, 0, &big_pattern(k, COLD_BLOB as usize))
            .unwrap();
    }
    s.flush().unwrap();
    s
}

#[test]
fn a_partial_read_of_a_cold_blob_reads_only_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = sixteen_blobs_twelve_cold(dir.path());
    // Keys 0..12 are cold now (4 slots).
    let before = s.stats();
    let mut out = vec![0u8; 4096];
    assert!(s.read(0, 2, 8192, &mut out).unwrap());
    assert_eq!(out[..], big_pattern(2, COLD_BLOB as usize)[8192..12288]);
    // Unaligned, across a block boundary: two blocks read.
    let mut odd = vec![0u8; 100];
    assert!(s.read(0, 5, 4050, &mut odd).unwrap());
    assert_eq!(odd[..], big_pattern(5, COLD_BLOB as usize)[4050..4150]);
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins, "no fault-in");
    assert_eq!(after.swap_bytes_read - before.swap_bytes_read, 3 * 4096);
    assert_eq!(
        after.slots_free + after.slots_clean,
        before.slots_free + before.slots_clean
    );
    // A damaged block fails only the reads that cover it.
    let e7 = s.core.durable_extent((0, 7)).unwrap();
    drop(s);
    flip(
        &dir.path().join(swap::SWAP_FILE),
        u64::from(e7) * u64::from(COLD_BLOB) + 5 * 4096 + 1,
    );
    let s = Store::open(cfg_blob(dir.path(), COLD_BLOB, 4, 64), &vols(1000)).unwrap();
    assert!(s.read(0, 7, 0, &mut out).unwrap());
    assert_eq!(
        integrity_kind(s.read(0, 7, 5 * 4096 + 4000, &mut out[..200])),
        Some(IntegrityKind::Checksum)
    );
    let e = s.read(0, 7, 5 * 4096, &mut out).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "at byte {}",
            u64::from(e7) * u64::from(COLD_BLOB) + 5 * 4096
        )),
        "{e}"
    );
    let mut whole = vec![0u8; COLD_BLOB as usize];
    assert_eq!(
        integrity_kind(s.read(0, 7, 0, &mut whole)),
        Some(IntegrityKind::Checksum)
    );
    assert!(s.read(0, 7, 6 * 4096, &mut out).unwrap());
}

/// Random range reads that land on consecutive blobs start no read-ahead
/// (each would fault whole blobs in for one block); a stream of range
/// reads crossing into the next blob, from its first byte, does.
#[test]
fn only_range_reads_from_a_blobs_first_byte_count_toward_read_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let s = sixteen_blobs_twelve_cold(dir.path());
    let before = s.stats().fault_ins;
    let mut out = vec![0u8; 4096];
    for k in 0..6u64 {
        assert!(s.read(0, k, 4096 * (k as u32 + 1), &mut out).unwrap());
        let got = futures::executor::block_on(s.read_cold_with(0, k, 4096, 4096, <[u8]>::to_vec));
        assert_eq!(
            got.unwrap().as_deref(),
            Some(&big_pattern(k, COLD_BLOB as usize)[4096..8192])
        );
    }
    assert_eq!(s.core.last_read(), None, "no read noted");
    assert_eq!(s.stats().fault_ins, before, "no fault-in");
    assert!(s.read(0, 6, 0, &mut out).unwrap());
    assert_eq!(s.core.last_read(), Some((0, 6)));
    assert!(s.read(0, 7, 0, &mut out).unwrap());
    // Keys 8..12 are cold: read-ahead faults them in.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while s.stats().fault_ins < before + engine::READ_AHEAD {
        assert!(
            std::time::Instant::now() < deadline,
            "read-ahead did not fault keys 8..12 in: {:?}",
            s.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A thread serving swap reads on its own ring (as arenad's workers do):
/// reads awaited together by its tasks return their blocks; a task dropped
/// with its read in flight, and the runtime ending with reads in flight,
/// leave the buffers to the ring until the kernel is done; then the
/// thread's reads go to the shared ring again. Refused off a
/// current-thread runtime.
#[test]
fn cold_range_reads_on_a_threads_own_ring_return_their_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(sixteen_blobs_twelve_cold(dir.path()));
    assert!(s.serve_swap_reads_here().is_err(), "no runtime");
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    assert!(multi.block_on(async { s.serve_swap_reads_here() }).is_err());
    drop(multi);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let before = s.stats();
    let pattern =
        |k: u64, at: u32| big_pattern(k, COLD_BLOB as usize)[at as usize..][..4096].to_vec();
    rt.block_on(async {
        s.serve_swap_reads_here().unwrap();
        assert!(s.core.swap.reads_served_here());
        let mut tasks = tokio::task::JoinSet::new();
        for k in [0u64, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11] {
            for at in (0..4u32).map(|i| i * 12288 + 4096) {
                let s = Arc::clone(&s);
                tasks.spawn(async move {
                    (
                        k,
                        at,
                        s.read_cold_with(0, k, at, 4096, <[u8]>::to_vec).await,
                    )
                });
            }
        }
        while let Some(done) = tasks.join_next().await {
            let (k, at, r) = done.unwrap();
            assert_eq!(r.unwrap(), Some(pattern(k, at)), "key {k} at {at}");
        }
        // Pushed, then the task goes away before its read completes.
        let gone = {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.read_cold_with(0, 3, 8192, 4096, <[u8]>::to_vec).await })
        };
        tokio::task::yield_now().await;
        gone.abort();
        // And one still in flight when the runtime ends.
        let s2 = Arc::clone(&s);
        drop(tokio::spawn(async move {
            s2.read_cold_with(0, 5, 8192, 4096, <[u8]>::to_vec).await
        }));
        tokio::task::yield_now().await;
    });
    drop(rt);
    assert!(!s.core.swap.reads_served_here());
    let got = futures::executor::block_on(s.read_cold_with(0, 2, 8192, 4096, <[u8]>::to_vec));
    assert_eq!(got.unwrap(), Some(pattern(2, 8192)));
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins, "no fault-in");
    assert!(after.swap_bytes_read - before.swap_bytes_read >= 49 * 4096);
}

#[test]
fn cold_range_reads_awaited_together_return_their_blocks_and_verify() {
    let dir = tempfile::tempdir().unwrap();
    let s = sixteen_blobs_twelve_cold(dir.path());
    // Keys 0..12 are cold (4 slots); 48 reads of them awaited at once, no
    // key right after the one before (which would start read-ahead).
    let before = s.stats();
    let keys = [0u64, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11];
    let reads = keys
        .into_iter()
        .flat_map(|k| (0..4u32).map(move |i| (k, i * 12288 + 4096)));
    let got = futures::executor::block_on(futures::future::join_all(reads.map(|(k, at)| {
        let s = &s;
        async move {
            let r = s.read_cold_with(0, k, at, 4096, <[u8]>::to_vec).await;
            (k, at, r)
        }
    })));
    for (k, at, r) in got {
        let want = &big_pattern(k, COLD_BLOB as usize)[at as usize..at as usize + 4096];
        assert_eq!(r.unwrap().as_deref(), Some(want), "key {k} at {at}");
    }
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins, "no fault-in");
    assert_eq!(after.swap_bytes_read - before.swap_bytes_read, 48 * 4096);
    // Not cold range reads: a resident blob, no blob, the whole blob.
    let none =
        |k, at, len| futures::executor::block_on(s.read_cold_with(0, k, at, len, |_| ())).unwrap();
    assert_eq!(none(15, 0, 4096), None, "resident");
    assert_eq!(none(99, 0, 4096), None, "absent");
    assert_eq!(none(3, 0, COLD_BLOB as usize), None, "whole blob");
    // A damaged block fails the read that covers it, as the blocking path.
    let e7 = s.core.durable_extent((0, 7)).unwrap();
    drop(s);
    flip(
        &dir.path().join(swap::SWAP_FILE),
        u64::from(e7) * u64::from(COLD_BLOB) + 5 * 4096 + 1,
    );
    let s = Store::open(cfg_blob(dir.path(), COLD_BLOB, 4, 64), &vols(1000)).unwrap();
    let bad = futures::executor::block_on(s.read_cold_with(0, 7, 5 * 4096 + 10, 100, |_| ()));
    assert!(
        matches!(
            bad,
            Err(StoreError::Integrity {
                kind: IntegrityKind::Checksum,
                ..
            })
        ),
        "{bad:?}"
    );
    assert_eq!(s.stats().integrity_errors, [1, 0]);
    let good = futures::executor::block_on(s.read_cold_with(0, 7, 6 * 4096, 4096, <[u8]>::to_vec));
    assert_eq!(
        good.unwrap().as_deref(),
        Some(&big_pattern(7, COLD_BLOB as usize)[6 * 4096..7 * 4096])
    );
}

#[test]
fn cold_range_reads_race_rewrites_without_false_errors_or_mixed_versions() {
    const BLOB: u32 = 16 << 10;
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(Store::open(cfg_blob(dir.path(), BLOB, 4, 256), &vols(1000)).unwrap());
    let fill = |k: u64, v: u64| vec![(k * 16 + v % 16) as u8; BLOB as usize];
    for k in 0..16 {
        s.write(0, k, 0, &fill(k, 0)).unwrap();
    }
    s.flush().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..4u64)
        .map(|r| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = r;
                let mut out = vec![0u8; 6000];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i = i
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let k = (i >> 33) % 16;
                    let off = ((i >> 20) % 8000) as u32;
                    assert!(s.read(0, k, off, &mut out).unwrap(), "key {k}");
                    // Each half of the blob is written at once (a partial
                    // round writes the halves one after the other), so each
                    // half read is one version, and every byte is key k's.
                    let split = (8192 - off as usize).min(out.len());
                    for half in [&out[..split], &out[split..]] {
                        let v = half.first().copied().unwrap_or((k * 16) as u8);
                        assert!(
                            u64::from(v / 16) == k && half.iter().all(|&b| b == v),
                            "key {k} off {off}: mixed or foreign bytes"
                        );
                    }
                }
            })
        })
        .collect();
    for round in 1..60u64 {
        for k in (round % 3..16).step_by(3) {
            if round % 2 == 0 {
                s.write(0, k, 0, &fill(k, round)).unwrap();
            } else {
                let b = fill(k, round);
                s.write(0, k, 0, &b[..8192]).unwrap();
                s.write(0, k, 8192, &b[8192..]).unwrap();
            }
        }
        if round % 4 == 0 {
            s.flush().unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(s.stats().integrity_errors, [0, 0]);
}

#[test]
fn corrupt_checkpoint_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    s.write(0, 1, 0, b"x").unwrap();
    s.flush().unwrap();
    drop(s);
    let p = dir.path().join(index::CKPT_FILE);
    let mut b = std::fs::read(&p).unwrap();
    b[30] ^= 1;
    std::fs::write(&p, b).unwrap();
    let e = Store::open(cfg(dir.path(), 4, 16), &vols(10))
        .err()
        .expect("corrupt");
    assert!(
        matches!(e, StoreError::Corrupt { .. }) && e.to_string().contains("index.ckpt"),
        "{e}"
    );
}

#[derive(Clone, Debug)]
enum Op {
    Write {
        key: u64,
        offset: u32,
        len: u32,
        byte: u8,
    },
    Read {
        key: u64,
    },
    AllocCommit {
        holder: u64,
        key: u64,
        offset: u32,
        len: u32,
        byte: u8,
        die: bool,
    },
    GetRelease {
        holder: u64,
        key: u64,
    },
    Remove {
        start: u64,
        len: u64,
    },
    Flush,
    Crash,
    /// A crash, then one bit of a flushed blob's durable image (its bytes,
    /// or its extent header) flipped on disk.
    Corrupt {
        pick: usize,
        at: u32,
        header: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..32u64;
    let range = (0..B as u32).prop_flat_map(|o| (Just(o), 1..=(B as u32 - o)));
    prop_oneof![
        6 => (key.clone(), range.clone(), any::<u8>()).prop_map(|(key, (offset, len), byte)| Op::Write { key, offset, len, byte }),
        2 => (key.clone(), any::<u8>()).prop_map(|(key, byte)| Op::Write { key, offset: 0, len: B as u32, byte }),
        4 => key.clone().prop_map(|key| Op::Read { key }),
        4 => (1..4u64, key.clone(), range, any::<u8>(), prop::bool::weighted(0.2))
            .prop_map(|(holder, key, (offset, len), byte, die)| Op::AllocCommit { holder, key, offset, len, byte, die }),
        3 => (1..4u64, key.clone()).prop_map(|(holder, key)| Op::GetRelease { holder, key }),
        1 => (key, 1..6u64).prop_map(|(start, len)| Op::Remove { start, len }),
        2 => Just(Op::Flush),
        1 => Just(Op::Crash),
        1 => (any::<usize>(), 0..B as u32 * 8, any::<bool>()).prop_map(|(pick, at, header)| Op::Corrupt { pick, at, header }),
    ]
}

/// A key's content in the model: bytes, or an image damaged on disk, which
/// every read (and lease, and partial write) must refuse.
#[derive(Clone, Debug, PartialEq)]
enum Content {
    Bytes(Vec<u8>),
    Damaged,
}

type Model = HashMap<u64, Content>;

/// Applies a write; `Err` when the model says the store must refuse it (a
/// partial write of a damaged blob needs its old bytes).
fn apply(model: &mut Model, key: u64, offset: u32, len: u32, byte: u8) -> Result<(), ()> {
    let whole = offset == 0 && len == B as u32;
    let b = match model
        .entry(key)
        .or_insert_with(|| Content::Bytes(vec![0; B as usize]))
    {
        Content::Damaged if !whole => return Err(()),
        c @ Content::Damaged => {
            *c = Content::Bytes(vec![0; B as usize]);
            match c {
                Content::Bytes(b) => b,
                Content::Damaged => unreachable!(),
            }
        }
        Content::Bytes(b) => b,
    };
    b[offset as usize..(offset + len) as usize].fill(byte);
    Ok(())
}

/// The outcome a whole-blob read must have, as the model sees it.
fn expect_read(model: &Model, key: u64) -> Result<Option<Vec<u8>>, ()> {
    match model.get(&key) {
        None => Ok(None),
        Some(Content::Bytes(b)) => Ok(Some(b.clone())),
        Some(Content::Damaged) => Err(()),
    }
}

fn read_outcome(s: &Store, key: u64) -> Result<Option<Vec<u8>>, ()> {
    let mut out = vec![0u8; B as usize];
    match s.read(0, key, 0, &mut out) {
        Ok(true) => Ok(Some(out)),
        Ok(false) => Ok(None),
        Err(StoreError::Integrity { .. }) => Err(()),
        Err(e) => panic!("read of key {key}: {e}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model_across_crashes_and_corruption(ops in prop::collection::vec(op(), 1..60)) {
        let dir = tempfile::tempdir().unwrap();
        let mut s = open(dir.path(), 4, 256);
        let mut cur: Model = HashMap::new();
        let mut flushed = cur.clone();
        for op in ops {
            match op {
                Op::Write { key, offset, len, byte } => {
                    let want = apply(&mut cur, key, offset, len, byte);
                    let got = s.write(0, key, offset, &vec![byte; len as usize]);
                    match got {
                        Ok(()) => prop_assert!(want.is_ok(), "write of damaged key {} accepted", key),
                        Err(StoreError::Integrity { .. }) => prop_assert!(want.is_err(), "write of key {} refused", key),
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Read { key } => prop_assert_eq!(read_outcome(&s, key), expect_read(&cur, key), "read key {}", key),
                Op::AllocCommit { holder, key, offset, len, byte, die } => {
                    let before = expect_read(&cur, key).map(|b| b.unwrap_or_else(|| vec![0; B as usize]));
                    let l = match s.alloc(0, key, holder) {
                        Ok(l) => l,
                        Err(StoreError::Integrity { .. }) => {
                            prop_assert!(before.is_err(), "ALLOC of key {} refused", key);
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    };
                    let seen = s.with_lease(l.token, holder, |b| {
                        let seen = b.to_vec();
                        b[offset as usize..(offset + len) as usize].fill(byte);
                        seen
                    }).unwrap();
                    prop_assert_eq!(Ok(seen), before, "ALLOC content of key {}", key);
                    if die { s.drop_holder(holder) } else { s.commit(0, key, l.token, holder).unwrap() }
                    apply(&mut cur, key, offset, len, byte).unwrap();
                }
                Op::GetRelease { holder, key } => match s.get(0, key, holder) {
                    Ok(Some(l)) => {
                        let seen = s.with_lease(l.token, holder, |b| b.to_vec()).unwrap();
                        prop_assert_eq!(Ok(Some(seen)), expect_read(&cur, key), "GET key {}", key);
                        s.release(l.token, holder).unwrap();
                    }
                    Ok(None) => prop_assert!(!cur.contains_key(&key), "GET lost key {}", key),
                    Err(StoreError::Integrity { .. }) => prop_assert_eq!(cur.get(&key), Some(&Content::Damaged), "GET of key {} refused", key),
                    Err(e) => panic!("{e}"),
                },
                Op::Remove { start, len } => {
                    let n = s.remove(0, start, start + len).unwrap();
                    let before = cur.len();
                    cur.retain(|k, _| !(start..start + len).contains(k));
                    prop_assert_eq!(n as usize, before - cur.len());
                }
                Op::Flush => {
                    s.flush().unwrap();
                    flushed = cur.clone();
                }
                Op::Crash | Op::Corrupt { .. } => {
                    let g = s.generation();
                    let mut keys: Vec<u64> = flushed
                        .iter()
                        .filter(|(_, c)| matches!(c, Content::Bytes(_)))
                        .map(|(&k, _)| k)
                        .collect();
                    keys.sort_unstable();
                    drop(s);
                    let victim = match op {
                        Op::Corrupt { pick, at, header } if !keys.is_empty() => {
                            // The durable index as a restart sees it.
                            let k = keys[pick % keys.len()];
                            let e = open(dir.path(), 4, 256).core.durable_extent((0, k)).expect("a flushed key has an extent");
                            Some((k, e, at, header))
                        }
                        _ => None,
                    };
                    let g = if victim.is_some() { g + 1 } else { g };
                    if let Some((k, e, at, header)) = victim {
                        let (file, byte) = if header {
                            let rec = extent::record_len(B as u32) as u64;
                            (extent::META_FILE, 4096 + u64::from(e) * rec + u64::from(at / 8) % rec)
                        } else {
                            (swap::SWAP_FILE, u64::from(e) * B + u64::from(at / 8))
                        };
                        let path = dir.path().join(file);
                        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
                        use std::os::unix::fs::FileExt;
                        let mut b = [0u8];
                        f.read_exact_at(&mut b, byte).unwrap();
                        f.write_all_at(&[b[0] ^ (1 << (at % 8))], byte).unwrap();
                        flushed.insert(k, Content::Damaged);
                    }
                    s = open(dir.path(), 4, 256);
                    prop_assert_eq!(s.generation(), g + 1);
                    cur = flushed.clone();
                    for k in 0..32 {
                        prop_assert_eq!(read_outcome(&s, k), expect_read(&cur, k), "after crash, key {}", k);
                    }
                }
            }
            prop_assert_eq!(s.stats().leases_held, 0);
        }
        for k in 0..32 {
            prop_assert_eq!(read_outcome(&s, k), expect_read(&cur, k), "final key {}", k);
        }
    }
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

#[test]
fn concurrent_fault_ins_of_one_blob_race_eviction_without_mixing() {
    let dir = tempfile::tempdir().unwrap();
    // More slots than threads, so inline copies alone never pin them all.
    let s = Arc::new(open(dir.path(), 6, 128));
    for k in 0..16 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    // Readers walk the same keys in the same order, so they fault the same
    // blob in at once; a writer evicts under them with whole and partial
    // writes of other keys.
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                for round in 0..20 {
                    for k in 0..16 {
                        let got = blob(&s, 0, k).expect("key exists");
                        assert!(
                            got == pattern(k),
                            "round {round} key {k}: mixed or lost bytes"
                        );
                    }
                }
            })
        })
        .collect();
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || {
            for round in 0..40u64 {
                for k in 16..24 {
                    let want = pattern(k + round * 100);
                    if k % 2 == 0 {
                        s.write(0, k, 0, &want).unwrap();
                    } else {
                        s.write(0, k, 0, &want[..2048]).unwrap();
                        s.write(0, k, 2048, &want[2048..]).unwrap();
                    }
                    assert_eq!(blob(&s, 0, k).unwrap(), want, "round {round} key {k}");
                }
            }
        })
    };
    for r in readers {
        r.join().unwrap();
    }
    writer.join().unwrap();
    let st = s.stats();
    assert!(st.fault_ins > 16 && st.evictions > 16, "{st:?}");
    assert_eq!(st.slots_leased, 0, "{st:?}");
}

#[test]
fn cleaner_writes_back_without_a_flush_and_a_crash_keeps_flushed_data() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    let flushed = s.stats();
    for k in 0..8 {
        s.write(0, k, 0, &pattern(k + 100)).unwrap();
    }
    // Every slot is dirty now: the cleaner brings clean ones back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let st = loop {
        let st = s.stats();
        let cleaned = st.write_backs >= flushed.write_backs + 2;
        if cleaned || std::time::Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert!(st.slots_clean >= 2, "{st:?}");
    assert!(st.write_backs >= flushed.write_backs + 2, "{st:?}");
    assert_eq!(st.flushes, 1, "{st:?}");
    assert_eq!(
        st.journal_records, flushed.journal_records,
        "cleaning journals nothing"
    );
    for k in 0..8 {
        assert_eq!(
            blob(&s, 0, k).unwrap(),
            pattern(k + 100),
            "key {k} before the crash"
        );
    }
    drop(s); // a crash: no flush

    let s = open(dir.path(), 8, 64);
    for k in 0..8 {
        assert_eq!(
            blob(&s, 0, k).unwrap(),
            pattern(k),
            "key {k} after the crash"
        );
    }
}

/// A blob whose slot the cleaner is writing to swap reports
/// `WritingBack` for as long as the disk write holds its slot locked, so
/// arenad sends a WRITE or ALLOC of it to the blocking pool instead of
/// blocking its reactor on the slot lock; and if the write-back begins
/// after that check, `write_now` and `alloc_now` decline rather than wait
/// (here they would wait for as long as the test holds the slots, for
/// ever). Reads and the data are unaffected.
#[test]
fn a_slot_under_write_back_is_reported_so_writes_wait_off_the_reactor() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..7 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    assert_eq!(s.residency(0, 0), Residency::Resident);
    // Hold the bytes of every slot but the last free one, as a slow disk
    // would hold a write-back's: the cleaner's write-back, woken by the
    // write that dirties the last slot, stops at the first of them.
    let held: Vec<_> = (0..7)
        .map(|k| s.core.arena.write(s.core.slot_of((0, k)).unwrap()))
        .collect();
    s.write(0, 7, 0, &pattern(7)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let writing_back = loop {
        let states: Vec<Residency> = (0..7).map(|k| s.residency(0, k)).collect();
        if states.contains(&Residency::WritingBack) || std::time::Instant::now() > deadline {
            break states;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(
        writing_back.contains(&Residency::WritingBack),
        "{writing_back:?}"
    );
    let busy = writing_back
        .iter()
        .position(|r| *r == Residency::WritingBack)
        .unwrap() as u64;
    assert_eq!(
        s.write_now(0, busy, 0, &pattern(100 + busy)).unwrap(),
        Immediate::WouldWait
    );
    assert_eq!(s.alloc_now(0, busy, 1).unwrap(), Immediate::WouldWait);
    assert_eq!(s.stats().leases_held, 0, "a declined ALLOC leases nothing");
    drop(held);
    // Reading shares the write-back's lock: served, once the test's
    // stand-in for the slow disk lets go of the bytes.
    assert_eq!(
        s.read_now(0, busy, 0, B as usize, |b| b.unwrap().to_vec())
            .unwrap(),
        Immediate::Done(pattern(busy))
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while (0..8).any(|k| s.residency(0, k) != Residency::Resident) {
        assert!(std::time::Instant::now() < deadline, "the write-back ended");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // A write-back that begins between arenad's residency check and the
    // write: the blob still resident, its bytes held for reading.
    let reading = s.core.arena.read(s.core.slot_of((0, busy)).unwrap());
    assert_eq!(
        s.write_now(0, busy, 0, &pattern(100 + busy)).unwrap(),
        Immediate::WouldWait
    );
    drop(reading);
    assert_eq!(
        s.write_now(0, busy, 0, &pattern(100 + busy)).unwrap(),
        Immediate::Done(()),
        "the write-back ended: written at once"
    );
    for k in 0..8 {
        let want = if k == busy { 100 + k } else { k };
        assert_eq!(blob(&s, 0, k).unwrap(), pattern(want), "key {k}");
    }
}

/// The `_now` calls of a blob that is in swap only decline: serving them
/// would read the disk on the caller's thread. Nothing is faulted in.
/// `write_now` and `alloc_now` of no blob decline too (they would take a
/// slot, maybe by a write-back); `read_now` and `get_now` of no blob answer
/// that there is none.
#[test]
fn calls_that_must_not_wait_decline_cold_and_absent_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..24 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    assert_eq!(s.residency(0, 0), Residency::Cold);
    let before = s.stats();
    for k in [0, 1000] {
        assert_eq!(
            s.write_now(0, k, 0, &[1; 4096]).unwrap(),
            Immediate::WouldWait,
            "key {k}"
        );
        assert_eq!(s.alloc_now(0, k, 1).unwrap(), Immediate::WouldWait);
    }
    assert_eq!(
        s.read_now(0, 0, 0, 1024, |b| b.is_some()).unwrap(),
        Immediate::WouldWait
    );
    assert_eq!(s.get_now(0, 0, 1).unwrap(), Immediate::WouldWait);
    assert_eq!(
        s.read_now(0, 1000, 0, 1024, |b| b.is_some()).unwrap(),
        Immediate::Done(false)
    );
    assert_eq!(s.get_now(0, 1000, 1).unwrap(), Immediate::Done(None));
    let after = s.stats();
    assert_eq!(after.fault_ins, before.fault_ins);
    assert_eq!(after.swap_bytes_read, before.swap_bytes_read);
    assert_eq!(after.leases_held, 0);
    assert_eq!(s.residency(0, 0), Residency::Cold);
    assert_eq!(s.residency(0, 1000), Residency::Absent);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(0));
    // A resident blob is written at once, and so is its lease.
    assert_eq!(
        s.write_now(0, 23, 0, &pattern(123)).unwrap(),
        Immediate::Done(())
    );
    assert_eq!(blob(&s, 0, 23).unwrap(), pattern(123));
    assert_eq!(
        s.read_now(0, 23, 1024, 1024, |b| b.unwrap().to_vec())
            .unwrap(),
        Immediate::Done(pattern(123)[1024..2048].to_vec())
    );
    assert!(matches!(
        s.get_now(0, 23, 1).unwrap(),
        Immediate::Done(Some(_))
    ));
    assert!(matches!(s.alloc_now(0, 23, 1).unwrap(), Immediate::Done(_)));
}

/// Two consecutive reads from swap start a read-ahead: with no further
/// request, the background workers fault the next blobs in, with the
/// right contents.
#[test]
fn sequential_reads_fault_the_next_blobs_in_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    for k in 0..24 {
        s.write(0, k, 0, &pattern(k)).unwrap();
    }
    s.flush().unwrap();
    // The arena holds 8 of 24: keys 0..8 were evicted to swap long ago.
    let before = s.stats().fault_ins;
    assert_eq!(blob(&s, 0, 0), Some(pattern(0)));
    assert_eq!(blob(&s, 0, 1), Some(pattern(1)));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while s.stats().fault_ins < before + 2 + engine::READ_AHEAD {
        assert!(
            std::time::Instant::now() < deadline,
            "read-ahead did not fault keys 2..6 in: {:?}",
            s.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for k in 2..6 {
        assert_eq!(blob(&s, 0, k), Some(pattern(k)), "key {k}");
    }
}

#[test]
fn a_volume_configured_while_running_survives_a_crash_and_keeps_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 8, 64);
    s.write(0, 1, 0, &pattern(1)).unwrap();
    let spec = VolumeSpec {
        name: "late".into(),
        quota_blobs: 2,
    };
    let late = s.configure_volume(&spec).unwrap();
    assert_eq!(late, 2, "after a and b");
    assert_eq!(
        s.configure_volume(&spec).unwrap(),
        late,
        "same name, same id"
    );
    s.write(late, 5, 0, &pattern(5)).unwrap();
    s.write(late, 6, 0, &pattern(6)).unwrap();
    assert!(
        matches!(
            s.write(late, 7, 0, &pattern(7)),
            Err(StoreError::QuotaExceeded { .. })
        ),
        "its quota holds"
    );
    // A lower quota refuses new blobs, keeps the old ones; a higher one admits.
    s.configure_volume(&VolumeSpec {
        name: "late".into(),
        quota_blobs: 3,
    })
    .unwrap();
    s.write(late, 7, 0, &pattern(7)).unwrap();
    s.flush().unwrap();
    drop(s); // as after kill -9: no clean shutdown beyond the FLUSH

    // Reopened with the new volume in the config, anywhere in the list.
    let specs = vec![
        VolumeSpec {
            name: "late".into(),
            quota_blobs: 3,
        },
        VolumeSpec {
            name: "a".into(),
            quota_blobs: 1000,
        },
    ];
    let s = Store::open(cfg(dir.path(), 8, 64), &specs).unwrap();
    for key in [5, 6, 7] {
        assert_eq!(blob(&s, 0, key).unwrap(), pattern(key), "late/{key}");
    }
    assert_eq!(blob(&s, 1, 1).unwrap(), pattern(1));
    // "b" is kept but not served until configured again.
    assert!(matches!(
        s.read(2, 1, 0, &mut [0; 8]),
        Err(StoreError::UnknownVolume { .. })
    ));
    assert_eq!(
        s.configure_volume(&VolumeSpec {
            name: "b".into(),
            quota_blobs: 9
        })
        .unwrap(),
        2
    );
}
