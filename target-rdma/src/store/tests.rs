use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex as StdMutex};

use proptest::prelude::*;

use super::*;

const B: u64 = 4096;

fn cfg(dir: &Path, slots: u64, extents: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        arena_bytes: slots * B,
        blob_bytes: B as u32,
        swap_bytes: extents * B,
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
    let l2 = s.alloc(1, 11, 2).unwrap();
    let e = s.alloc(0, 12, 3).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Busy {
                slots: 2,
                revoked: 3
            }
        ),
        "{e}"
    );
    assert_eq!(
        *calls.lock().unwrap(),
        vec![
            (1, 0, 10, l0.token),
            (2, 0, 10, l1.token),
            (2, 1, 11, l2.token)
        ]
    );
    let e = s.write(0, 12, 0, b"x").unwrap_err();
    assert!(matches!(e, StoreError::Busy { revoked: 0, .. }), "{e}");
    assert_eq!(calls.lock().unwrap().len(), 3, "each lease is revoked once");
    assert_eq!(s.stats().slots_leased, 2);
    s.commit(0, 10, l0.token, 1).unwrap();
    s.release(l1.token, 2).unwrap();
    s.write(0, 12, 0, b"room").unwrap();
    assert_eq!(s.stats().revocations, 3);
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

/// Writes three keys with one flush each, so the journal ends in three
/// records, then damages the last one.
fn torn_tail(damage: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), 4, 16);
    for k in 0..3 {
        s.write(0, k, 0, &pattern(k)).unwrap();
        s.flush().unwrap();
    }
    drop(s);
    damage(&dir.path().join(index::JOURNAL_FILE));
    let s = open(dir.path(), 4, 16);
    assert_eq!(blob(&s, 0, 0).unwrap(), pattern(0));
    assert_eq!(blob(&s, 0, 1).unwrap(), pattern(1));
    assert!(blob(&s, 0, 2).is_none(), "the damaged record is dropped");
    s.write(0, 2, 0, &pattern(2)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = open(dir.path(), 4, 16);
    assert_eq!(
        blob(&s, 0, 2).unwrap(),
        pattern(2),
        "later records survive the truncation"
    );
}

#[test]
fn truncated_journal_tail_is_ignored() {
    torn_tail(|p| {
        let len = std::fs::metadata(p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
    });
}

#[test]
fn corrupt_journal_tail_is_ignored() {
    torn_tail(|p| {
        let mut b = std::fs::read(p).unwrap();
        let n = b.len();
        b[n - 2] ^= 0x40;
        std::fs::write(p, b).unwrap();
    });
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
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..32u64;
    let range = (0..B as u32).prop_flat_map(|o| (Just(o), 1..=(B as u32 - o)));
    prop_oneof![
        6 => (key.clone(), range.clone(), any::<u8>()).prop_map(|(key, (offset, len), byte)| Op::Write { key, offset, len, byte }),
        4 => key.clone().prop_map(|key| Op::Read { key }),
        4 => (1..4u64, key.clone(), range, any::<u8>(), prop::bool::weighted(0.2))
            .prop_map(|(holder, key, (offset, len), byte, die)| Op::AllocCommit { holder, key, offset, len, byte, die }),
        3 => (1..4u64, key.clone()).prop_map(|(holder, key)| Op::GetRelease { holder, key }),
        1 => (key, 1..6u64).prop_map(|(start, len)| Op::Remove { start, len }),
        2 => Just(Op::Flush),
        1 => Just(Op::Crash),
    ]
}

fn apply(model: &mut HashMap<u64, Vec<u8>>, key: u64, offset: u32, len: u32, byte: u8) {
    let b = model.entry(key).or_insert_with(|| vec![0; B as usize]);
    b[offset as usize..(offset + len) as usize].fill(byte);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model_across_crashes(ops in prop::collection::vec(op(), 1..60)) {
        let dir = tempfile::tempdir().unwrap();
        let mut s = open(dir.path(), 4, 256);
        let mut cur: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut flushed = cur.clone();
        for op in ops {
            match op {
                Op::Write { key, offset, len, byte } => {
                    s.write(0, key, offset, &vec![byte; len as usize]).unwrap();
                    apply(&mut cur, key, offset, len, byte);
                }
                Op::Read { key } => prop_assert_eq!(blob(&s, 0, key), cur.get(&key).cloned(), "read key {}", key),
                Op::AllocCommit { holder, key, offset, len, byte, die } => {
                    let l = s.alloc(0, key, holder).unwrap();
                    let before = cur.get(&key).cloned().unwrap_or_else(|| vec![0; B as usize]);
                    let seen = s.with_lease(l.token, holder, |b| {
                        let seen = b.to_vec();
                        b[offset as usize..(offset + len) as usize].fill(byte);
                        seen
                    }).unwrap();
                    prop_assert_eq!(seen, before, "ALLOC content of key {}", key);
                    if die { s.drop_holder(holder) } else { s.commit(0, key, l.token, holder).unwrap() }
                    apply(&mut cur, key, offset, len, byte);
                }
                Op::GetRelease { holder, key } => match s.get(0, key, holder).unwrap() {
                    Some(l) => {
                        let seen = s.with_lease(l.token, holder, |b| b.to_vec()).unwrap();
                        prop_assert_eq!(Some(seen), cur.get(&key).cloned(), "GET key {}", key);
                        s.release(l.token, holder).unwrap();
                    }
                    None => prop_assert!(!cur.contains_key(&key), "GET lost key {}", key),
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
                Op::Crash => {
                    let g = s.generation();
                    drop(s);
                    s = open(dir.path(), 4, 256);
                    prop_assert_eq!(s.generation(), g + 1);
                    cur = flushed.clone();
                    for k in 0..32 {
                        prop_assert_eq!(blob(&s, 0, k), cur.get(&k).cloned(), "after crash, key {}", k);
                    }
                }
            }
            prop_assert_eq!(s.stats().leases_held, 0);
        }
        for k in 0..32 {
            prop_assert_eq!(blob(&s, 0, k), cur.get(&k).cloned(), "final key {}", k);
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
