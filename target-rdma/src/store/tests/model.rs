//! The store against a model, across crashes and corruption (proptest).

use std::collections::HashMap;

use proptest::prelude::*;

use super::support::*;
use super::*;

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
            let (kept, counted) = s.usage_and_recount();
            prop_assert_eq!(kept, counted, "per-volume usage before {:?}", op);
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
